"""`foldc.attention_reference`, the float64 attention every plan and kernel is held to (foldc/reference.py)."""
from __future__ import annotations

import pytest
import torch

import foldc
from foldc.reference import attention_reference


@pytest.mark.parametrize("k_enc, v_enc", [(foldc.Affine(4, "token", 32), foldc.Affine(4, "channel", 16)),
                                          (foldc.Affine(2, "channel", 32), foldc.Affine(8, "token", 64)),
                                          (None, None)])
def test_values_past_the_lengths_do_not_reach_the_output(k_enc, v_enc):
    """Tokens past seq_lens[b] holding NaN or Inf (a cache allocated with torch.empty) made every output of that
    sequence NaN in `attention_reference` and in the float64 executor (target "reference", where a longer sequence
    of the batch made it read them): masked weights are 0, and 0 x NaN is NaN. The kernels never read them; both
    references ignore them now, as their docstrings say, and equal attention over each sequence's own tokens."""
    gen = torch.Generator().manual_seed(61)
    batch, heads, kv_heads, tokens, head_dim = 3, 8, 2, 96, 64
    lens = torch.tensor([40, 96, 57])
    q = torch.randn(batch, heads, head_dim, generator=gen)

    def cache(enc):
        x = torch.randn(batch, kv_heads, tokens, head_dim, generator=gen, dtype=torch.float64) + 0.5
        if enc is None:
            x[0, :, 40:] = float("nan")
            x[2, :, 57:] = float("inf")
            return x
        a = foldc.quantize(x, enc)
        for b, n in ((0, 40), (2, 57)):   # the scale rows of tokens past the length alone
            first = n if enc.layout == "token" else -(-n // enc.group_size)
            a.scale[b, :, first:] = float("nan")
            a.zero[b, :, first:] = float("inf")
        return a

    k, v = cache(k_enc), cache(v_enc)
    spec = foldc.AttentionSpec(heads, kv_heads, head_dim, k_enc, v_enc)
    for out in (attention_reference(q, k, v, seq_lens=lens), foldc.compile(spec, "reference")(q, k, v, seq_lens=lens)):
        assert torch.isfinite(out).all()
        for b, n in enumerate(lens.tolist()):   # each sequence over its own tokens alone
            def own(x):
                x = x.dequantize(torch.float64) if isinstance(x, foldc.AffineTensor) else x
                return x[b:b + 1, :, :n]
            want = attention_reference(q[b:b + 1], own(k), own(v))
            torch.testing.assert_close(out[b:b + 1], want, rtol=1e-12, atol=1e-12)
