"""torch.ops.foldc.decode_attention: matches compile(), passes opcheck, traces under torch.compile."""
import pytest
import torch

import foldc
from foldc.errors import SpecError
from foldc.ops import attention_op, layout_key, spec_from_key

SPEC = foldc.AttentionSpec(8, 2, 64, foldc.Affine(2, "token", 32), foldc.Affine(4, "channel", 16))


def _inputs(seed, dtype=torch.float16, spec=SPEC, tokens=50):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, spec.num_q_heads, spec.head_dim, generator=gen).to(dtype)
    k = torch.randn(2, spec.num_kv_heads, tokens, spec.head_dim, generator=gen)
    v = torch.randn(2, spec.num_kv_heads, tokens, spec.head_dim, generator=gen) + 0.5
    kq = foldc.quantize(k, spec.k) if spec.k else k.to(dtype)
    vq = foldc.quantize(v, spec.v) if spec.v else v.to(dtype)
    return q, kq, vq, torch.tensor([tokens, tokens - 13])


def test_layout_key_round_trips():
    assert layout_key(SPEC) == "8/2/64/token:2:32/channel:4:16"
    assert spec_from_key(layout_key(SPEC)) == SPEC
    plain = foldc.AttentionSpec(4, 4, 32)
    assert spec_from_key(layout_key(plain)) == plain


def test_bad_layout_key_names_the_format():
    with pytest.raises(SpecError, match="Q/KV/head_dim"):
        spec_from_key("8/2/64/token:2:32")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_op_matches_the_reference(dtype):
    q, k, v, lens = _inputs(1, dtype)
    got = attention_op(SPEC, q, k, v, seq_lens=lens)
    ref = foldc.attention_reference(q, k, v, seq_lens=lens)
    assert got.dtype == dtype and got.shape == q.shape
    assert ((got.double() - ref).norm() / ref.norm()).item() < 2e-3


def test_opcheck():
    q, k, v, lens = _inputs(2, torch.float32)
    args = (q, k.codes, k.scale, k.zero, v.codes, v.scale, v.zero, lens, layout_key(SPEC), 0.125)
    torch.library.opcheck(torch.ops.foldc.decode_attention.default, args)


def test_plain_operand_opcheck():
    spec = foldc.AttentionSpec(8, 2, 64, foldc.Affine(2, "token", 32), None)
    q, k, v, lens = _inputs(3, torch.float32, spec)
    args = (q, k.codes, k.scale, k.zero, v, None, None, lens, layout_key(spec), 0.125)
    torch.library.opcheck(torch.ops.foldc.decode_attention.default, args)


def test_traces_under_torch_compile_without_graph_breaks():
    q, k, v, lens = _inputs(4, torch.float32)

    def step(q, kc, ks, kz, vc, vs, vz, lens):
        h = q * 2.0
        out = torch.ops.foldc.decode_attention(h, kc, ks, kz, vc, vs, vz, lens, layout_key(SPEC), 0.125)
        return out + 1.0

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    args = (q, k.codes, k.scale, k.zero, v.codes, v.scale, v.zero, lens)
    assert torch.allclose(compiled(*args), step(*args))
