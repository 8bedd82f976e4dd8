"""`foldc.compile`: argument validation (before any compute) and the attention callable's
contract: output shape and dtype, GQA head mapping, sequence-length masking, sm_scale default."""
from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import foldc
from foldc.errors import InputError, InputTypeError, SpecError

compile_module = importlib.import_module("foldc.compile")  # foldc.compile is the function

PROP = settings(max_examples=20, deadline=None)

ENC_K = foldc.Affine(2, "token", 8)
ENC_V = foldc.Affine(4, "channel", 5)
SPEC = foldc.AttentionSpec(4, 2, 16, k=ENC_K, v=ENC_V)
B, N = 2, 11


def _rand(*shape, gen=None, shift=0.5):
    return torch.randn(*shape, generator=gen, dtype=torch.float64) + shift


@pytest.fixture
def inputs():
    gen = torch.Generator().manual_seed(0)
    q = _rand(B, 4, 16, gen=gen).float()
    k = foldc.quantize(_rand(B, 2, N, 16, gen=gen), ENC_K)
    v = foldc.quantize(_rand(B, 2, N, 16, gen=gen), ENC_V)
    return q, k, v


@pytest.fixture
def attn(monkeypatch):
    """The compiled callable, with the executor replaced by a tripwire: validation errors must
    come before any compute."""
    fn = foldc.compile(SPEC, target="reference")

    class Tripwire:
        def __init__(self, *a, **kw):
            raise AssertionError("the executor ran before the arguments were validated")

    monkeypatch.setattr(compile_module, "Executor", Tripwire)
    return fn


def _raises(exc, call, *fragments):
    """Check the class and that the message names every fragment (argument, value, fix)."""
    with pytest.raises(exc) as info:
        call()
    assert isinstance(info.value, foldc.FoldError)
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} missing from: {msg}"
    return msg


# ------------------------------------------------------------------------------------------
# q
# ------------------------------------------------------------------------------------------

def test_q_not_a_tensor(attn, inputs):
    _, k, v = inputs
    _raises(InputTypeError, lambda: attn(np.ones((B, 4, 16)), k, v), "q must be a torch.Tensor", "ndarray")


@pytest.mark.parametrize("shape", [(B, 4, 16, 1), (4, 16), (B, 8, 16), (B, 4, 32)],
                         ids=["rank4", "rank2", "heads", "head_dim"])
def test_q_wrong_shape(attn, inputs, shape):
    _, k, v = inputs
    _raises(InputError, lambda: attn(torch.randn(*shape), k, v), f"q shape={shape}", "[batch, 4, 16]")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64])
def test_q_non_float_dtype(attn, inputs, dtype):
    _, k, v = inputs
    q = torch.ones(B, 4, 16, dtype=dtype)
    _raises(InputError, lambda: attn(q, k, v), f"q dtype={dtype}", "torch.float32")


def test_q_empty_batch(attn):
    q = torch.randn(0, 4, 16)
    _raises(InputError, lambda: attn(q, None, None), "batch=0", "at least one")


# ------------------------------------------------------------------------------------------
# k and v
# ------------------------------------------------------------------------------------------

def test_plain_tensor_where_spec_is_affine(attn, inputs):
    q, _, v = inputs
    msg = _raises(InputTypeError, lambda: attn(q, torch.randn(B, 2, N, 16), v),
                  "k must be a foldc.AffineTensor", ENC_K.short(), "Tensor", "foldc.quantize(k, spec.k)")
    assert "spec.k" in msg


def test_affine_tensor_with_another_encoding(attn, inputs):
    q, _, v = inputs
    other = foldc.Affine(4, "token", 8)
    k = foldc.quantize(_rand(B, 2, N, 16), other)
    _raises(InputError, lambda: attn(q, k, v), "k was quantized as token:4:8", "spec says token:2:8", "re-quantize")


def test_affine_tensor_differing_only_in_scale_dtype(attn, inputs):
    q, k, _ = inputs
    v = foldc.quantize(_rand(B, 2, N, 16), foldc.Affine(4, "channel", 5, torch.float32))
    _raises(InputError, lambda: attn(q, k, v), "v was quantized as channel:4:5:fp32", "spec says channel:4:5",
            "torch.float32", "torch.float16")


def test_affine_tensor_where_spec_is_plain(inputs, monkeypatch):
    q, k, v = inputs
    spec = foldc.AttentionSpec(4, 2, 16, k=None, v=ENC_V)
    fn = foldc.compile(spec)
    monkeypatch.setattr(compile_module, "Executor", None)  # any compute would fail differently
    _raises(InputTypeError, lambda: fn(q, k, v), "k is an AffineTensor but spec.k is None",
            "k.dequantize()", f"k={ENC_K.short()!r}")


def test_plain_cache_not_a_tensor(inputs, monkeypatch):
    q, _, v = inputs
    fn = foldc.compile(foldc.AttentionSpec(4, 2, 16, k=None, v=ENC_V))
    monkeypatch.setattr(compile_module, "Executor", None)
    _raises(InputTypeError, lambda: fn(q, np.ones((B, 2, N, 16)), v), "k must be a torch.Tensor", "ndarray")


def test_plain_cache_integer_dtype(inputs, monkeypatch):
    q, k, _ = inputs
    fn = foldc.compile(foldc.AttentionSpec(4, 2, 16, k=ENC_K, v=None))
    monkeypatch.setattr(compile_module, "Executor", None)
    _raises(InputError, lambda: fn(q, k, torch.ones(B, 2, N, 16, dtype=torch.int32)),
            "v dtype=torch.int32", "floating point")


def test_plain_cache_without_tokens(monkeypatch):
    fn = foldc.compile(foldc.AttentionSpec(4, 2, 16))
    monkeypatch.setattr(compile_module, "Executor", None)
    q = torch.randn(B, 4, 16)
    _raises(InputError, lambda: fn(q, torch.randn(B, 2, 0, 16), torch.randn(B, 2, 0, 16)),
            "k holds tokens=0", "at least one cached token")


def test_token_counts_differ(attn, inputs):
    q, k, _ = inputs
    v = foldc.quantize(_rand(B, 2, N + 3, 16), ENC_V)
    _raises(InputError, lambda: attn(q, k, v), f"k holds {N} tokens but v holds {N + 3}", "must match")


def test_batch_mismatch(attn, inputs):
    q, _, v = inputs
    k = foldc.quantize(_rand(B + 1, 2, N, 16), ENC_K)
    _raises(InputError, lambda: attn(q, k, v), f"k shape={(B + 1, 2, N, 16)}", f"({B}, 2, 'tokens', 16)")


def test_kv_heads_mismatch(attn, inputs):
    q, k, _ = inputs
    v = foldc.quantize(_rand(B, 4, N, 16), ENC_V)
    _raises(InputError, lambda: attn(q, k, v), f"v shape={(B, 4, N, 16)}", f"({B}, 2, 'tokens', 16)")


def test_cache_on_another_device(monkeypatch):
    fn = foldc.compile(foldc.AttentionSpec(4, 2, 16))
    monkeypatch.setattr(compile_module, "Executor", None)
    q = torch.empty(B, 4, 16, device="meta")
    _raises(InputError, lambda: fn(q, torch.randn(B, 2, N, 16), torch.randn(B, 2, N, 16)),
            "k is on cpu but q is on meta", "one device")


# ------------------------------------------------------------------------------------------
# seq_lens and sm_scale
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lens", [[5], [5, 6, 7], [[5, 6]], 5], ids=["short", "long", "2d", "scalar"])
def test_seq_lens_wrong_shape(attn, inputs, lens):
    _raises(InputError, lambda: attn(*inputs, seq_lens=torch.tensor(lens)), "seq_lens shape=",
            f"batch={B}", "one length per sequence")


@pytest.mark.parametrize("lens", [torch.tensor([3.0, 4.0]), torch.tensor([True, True])], ids=["float", "bool"])
def test_seq_lens_not_integer(attn, inputs, lens):
    _raises(InputError, lambda: attn(*inputs, seq_lens=lens), f"seq_lens dtype={lens.dtype}", "integer")


@pytest.mark.parametrize("lens", [torch.tensor([3 + 0j, 4 + 0j]), torch.tensor([3, 4], dtype=torch.uint32),
                                  torch.tensor([3, 4], dtype=torch.uint64), np.array([3, 4], dtype=np.uint64)],
                         ids=["complex", "uint32", "uint64", "np-uint64"])
def test_seq_lens_integer_dtype_without_min_max(attn, inputs, lens):
    """Complex and 32/64-bit unsigned lengths passed the dtype check and raised a NotImplementedError from inside
    torch (aminmax)."""
    dtype = torch.as_tensor(lens).dtype
    _raises(InputError, lambda: attn(*inputs, seq_lens=lens), f"seq_lens dtype={dtype}", "torch.int32", "torch.int64")


@pytest.mark.parametrize("where", ["sparse", "meta"])
def test_seq_lens_without_dense_data(attn, inputs, where):
    """A sparse or meta tensor raised a NotImplementedError from inside torch."""
    lens = torch.tensor([3, 4]).to_sparse() if where == "sparse" else torch.empty(B, dtype=torch.int64, device="meta")
    _raises(InputError, lambda: attn(*inputs, seq_lens=lens), "seq_lens", where, "dense")


def test_seq_lens_small_integer_dtypes_still_work(inputs):
    attn = foldc.compile(SPEC, token_tile=4)
    want = attn(*inputs, seq_lens=torch.tensor([7, 11]))
    for dtype in (torch.int8, torch.int16, torch.uint8):
        assert torch.equal(attn(*inputs, seq_lens=torch.tensor([7, 11], dtype=dtype)), want)


@pytest.mark.parametrize("lens", ["abc", [3, None]], ids=["str", "none-entry"])
def test_seq_lens_not_convertible(attn, inputs, lens):
    _raises(InputTypeError, lambda: attn(*inputs, seq_lens=lens), f"seq_lens={lens!r}", f"({B},)")


@pytest.mark.parametrize("bad", [0, -2])
def test_seq_lens_below_one(attn, inputs, bad):
    _raises(InputError, lambda: attn(*inputs, seq_lens=torch.tensor([4, bad])), f"seq_lens holds {bad}",
            "at least one token")


def test_seq_lens_longer_than_cache(attn, inputs):
    _raises(InputError, lambda: attn(*inputs, seq_lens=torch.tensor([N + 4, 3])), f"seq_lens holds {N + 4}",
            f"cache holds {N} tokens")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_sm_scale_not_finite(attn, inputs, value):
    _raises(InputError, lambda: attn(*inputs, sm_scale=value), f"sm_scale={value}", "finite")


@pytest.mark.parametrize("value", ["0.5", "abc", [0.5], torch.tensor([0.5, 0.5]), 1j], ids=str)
def test_sm_scale_not_a_number(attn, inputs, value):
    _raises(InputTypeError, lambda: attn(*inputs, sm_scale=value), f"sm_scale={value!r}", "must be a real number")


def test_sm_scale_on_the_meta_device(attn, inputs):
    """A one-element tensor on the meta device raised a RuntimeError from Tensor.item()."""
    _raises(InputError, lambda: attn(*inputs, sm_scale=torch.tensor(0.25, device="meta")), "sm_scale", "meta device",
            "a float")


@pytest.mark.parametrize("value", [1e39, -3e38, 1e300, 10**400, np.float64(1e300)],
                         ids=["1e39", "-3e38", "1e300", "int-10**400", "np-1e300"])
def test_sm_scale_beyond_float32(attn, inputs, value):
    """The kernels take sm_scale * log2(e) as a float32: past float32's range it is inf and every output NaN
    (a Python int past float64's raised an OverflowError from float())."""
    _raises(InputError, lambda: attn(*inputs, sm_scale=value), "sm_scale=", "float32", "at most")


def test_sm_scale_beyond_float32_on_the_interpreter():
    gen = torch.Generator().manual_seed(3)
    spec = foldc.AttentionSpec(2, 1, 16, k=foldc.Affine(2, "token", 16), v=foldc.Affine(4, "channel", 16))
    q = torch.randn(1, 2, 16, generator=gen).half()
    k = foldc.quantize(torch.randn(1, 1, 20, 16, generator=gen), spec.k)
    v = foldc.quantize(torch.randn(1, 1, 20, 16, generator=gen), spec.v)
    attn = foldc.compile(spec, "interpret", block_n=16)
    _raises(InputError, lambda: attn(q, k, v, sm_scale=1e39), "sm_scale=1e+39", "float32")
    # a large scale within float32's range still runs (finite, as the reference), and the reference has the same rule
    assert torch.isfinite(attn(q, k, v, sm_scale=1e30)).all()
    _raises(InputError, lambda: foldc.compile(spec)(q, k, v, sm_scale=1e39), "sm_scale=1e+39")


# ------------------------------------------------------------------------------------------
# compile() itself
# ------------------------------------------------------------------------------------------

def test_unknown_target():
    _raises(SpecError, lambda: foldc.compile(SPEC, target="triton"), "target='triton'", "'reference'")


@pytest.mark.parametrize("tile", [0, -3, 2.5, True, "64"])
def test_bad_token_tile(tile):
    _raises(SpecError, lambda: foldc.compile(SPEC, token_tile=tile), f"token_tile={tile!r}", "positive integer")


def test_a_numpy_token_tile_is_the_int_it_holds(inputs):
    """token_tile=np.int64(16) was refused as 'must be a positive integer' (AttentionSpec takes NumPy sizes)."""
    import numpy as np

    attn = foldc.compile(SPEC, token_tile=np.int64(16))
    assert attn.token_tile == 16 and type(attn.token_tile) is int
    assert torch.equal(attn(*inputs), foldc.compile(SPEC, token_tile=16)(*inputs))


def test_unknown_option():
    _raises(SpecError, lambda: foldc.compile(SPEC, tile=32), "['tile']", "token_tile")


@pytest.mark.parametrize("spec", ["32/8", {"heads": "32/8"}, foldc.Affine(2, "token", 8)], ids=["str", "dict", "affine"])
def test_spec_not_an_attention_spec(spec):
    _raises(SpecError, lambda: foldc.compile(spec), "spec must be a foldc.AttentionSpec", type(spec).__name__)


# ------------------------------------------------------------------------------------------
# the callable's contract
# ------------------------------------------------------------------------------------------

def _cache(gen, b, h, n, d):
    return torch.randn(b, h, n, d, generator=gen, dtype=torch.float64) * 1.3 + 0.4


@st.composite
def gqa_cases(draw):
    d = draw(st.sampled_from([16, 32, 64]))
    kv = draw(st.integers(1, 4))
    ratio = draw(st.sampled_from([1, 2, 4, 8]))

    def enc():
        layout = draw(st.sampled_from(["token", "channel", None]))
        if layout is None:
            return None
        g = draw(st.sampled_from([4, 8, 16]) if layout == "token" else st.integers(1, 40))
        return foldc.Affine(draw(st.sampled_from([2, 4, 8])), layout, g)
    spec = foldc.AttentionSpec(kv * ratio, kv, d, k=enc(), v=enc())
    return spec, draw(st.integers(1, 3)), draw(st.integers(1, 150)), draw(st.integers(0, 2**31 - 1))


def _quant(x, enc):
    return x if enc is None else foldc.quantize(x, enc)


def _deq(x):
    return x.dequantize(torch.float64) if isinstance(x, foldc.AffineTensor) else x.to(torch.float64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_output_shape_and_dtype(dtype):
    gen = torch.Generator().manual_seed(3)
    spec = foldc.AttentionSpec(8, 2, 32, k=foldc.Affine(4, "token", 16), v=None)
    q = torch.randn(3, 8, 32, generator=gen).to(dtype)
    k = foldc.quantize(_cache(gen, 3, 2, 37, 32), spec.k)
    v = _cache(gen, 3, 2, 37, 32).to(dtype)
    out = foldc.compile(spec)(q, k, v)
    assert out.shape == (3, 8, 32) and out.dtype == torch.float64
    assert torch.isfinite(out).all()
    ref = foldc.attention_reference(q, k, v)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-12


@PROP
@given(gqa_cases())
def test_gqa_query_head_reads_its_kv_head(case):
    """Query head kv * q_per_kv + j attends over KV head kv: checked head by head against a
    plain per-head softmax (no reshape tricks), with each KV head's values shifted far apart."""
    spec, b, n, seed = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, spec.num_q_heads, spec.head_dim, generator=gen, dtype=torch.float64)
    k = _cache(gen, b, spec.num_kv_heads, n, spec.head_dim)
    v = _cache(gen, b, spec.num_kv_heads, n, spec.head_dim)
    v += 100.0 * torch.arange(1, spec.num_kv_heads + 1, dtype=torch.float64).reshape(1, -1, 1, 1)
    kq, vq = _quant(k, spec.k), _quant(v, spec.v)
    sm = 0.7 / math.sqrt(spec.head_dim)
    out = foldc.compile(spec, token_tile=1 + seed % 50)(q, kq, vq, sm)
    kf, vf = _deq(kq), _deq(vq)
    for h in range(spec.num_q_heads):
        kv = h // spec.q_per_kv
        w = torch.softmax(sm * torch.einsum("bd,bnd->bn", q[:, h], kf[:, kv]), dim=-1)
        want = torch.einsum("bn,bnd->bd", w, vf[:, kv])
        assert torch.allclose(out[:, h], want, rtol=1e-12, atol=0), f"query head {h} (KV head {kv})"
        # and it is far from every other KV head's values
        assert (out[:, h] - 100.0 * (kv + 1)).abs().max() < 50


@PROP
@given(gqa_cases(), st.data())
def test_seq_lens_masks_tokens_past_the_length(case, data):
    """Tokens past seq_lens[b] (codes, and their own scales/zeros) never reach the output."""
    spec, b, n, seed = case
    if n < 2:
        n = 2
    lens = torch.tensor(data.draw(st.lists(st.integers(1, n - 1), min_size=b, max_size=b)))
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, spec.num_q_heads, spec.head_dim, generator=gen)
    kq = _quant(_cache(gen, b, spec.num_kv_heads, n, spec.head_dim), spec.k)
    vq = _quant(_cache(gen, b, spec.num_kv_heads, n, spec.head_dim), spec.v)
    attn = foldc.compile(spec, token_tile=data.draw(st.integers(1, 40)))
    out = attn(q, kq, vq, None, lens)

    def scramble(x, enc):
        """New random content for every token at or past lens[b] in sequence b."""
        if enc is None:
            y = x.clone()
            for i, L in enumerate(lens.tolist()):
                y[i, :, L:] = 5 * torch.randn(y[i, :, L:].shape, generator=gen, dtype=y.dtype) - 2
            return y
        codes, scale, zero = x.codes.clone(), x.scale.clone(), x.zero.clone()
        for i, L in enumerate(lens.tolist()):
            codes[i, :, L:] = torch.randint(0, 256, codes[i, :, L:].shape, dtype=torch.uint8, generator=gen)
            # params that belong only to masked tokens: token rows (token layout) or token groups
            # starting at or past L (channel layout)
            first = L if enc.layout == "token" else -(-L // enc.group_size)
            scale[i, :, first:] = (3 * torch.rand(scale[i, :, first:].shape, generator=gen) + 0.1).to(scale.dtype)
            zero[i, :, first:] = (9 * torch.rand(zero[i, :, first:].shape, generator=gen) - 4).to(zero.dtype)
        return foldc.AffineTensor(codes, scale, zero, x.encoding, x.head_dim)

    k2, v2 = scramble(kq, spec.k), scramble(vq, spec.v)
    torch.testing.assert_close(attn(q, k2, v2, None, lens), out, rtol=1e-13, atol=1e-13)
    ref = foldc.attention_reference(q, kq, vq, seq_lens=lens)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-12
    # non-vacuous: the masked tokens really were changed
    assert not (torch.equal(_deq(k2), _deq(kq)) and torch.equal(_deq(v2), _deq(vq)))


def test_seq_lens_accepts_lists_arrays_and_int32(inputs):
    attn = foldc.compile(SPEC, token_tile=4)
    want = attn(*inputs, seq_lens=torch.tensor([7, 11]))
    for lens in ([7, 11], np.array([7, 11]), torch.tensor([7, 11], dtype=torch.int32)):
        assert torch.equal(attn(*inputs, seq_lens=lens), want)
    assert torch.equal(attn(*inputs, seq_lens=[N, N]), attn(*inputs))


@settings(max_examples=10, deadline=None)
@given(gqa_cases())
def test_sm_scale_default_is_inverse_sqrt_head_dim(case):
    spec, b, n, seed = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, spec.num_q_heads, spec.head_dim, generator=gen)
    kq = _quant(_cache(gen, b, spec.num_kv_heads, n, spec.head_dim), spec.k)
    vq = _quant(_cache(gen, b, spec.num_kv_heads, n, spec.head_dim), spec.v)
    attn = foldc.compile(spec)
    default = attn(q, kq, vq)
    assert torch.equal(default, attn(q, kq, vq, sm_scale=1 / math.sqrt(spec.head_dim)))
    assert torch.equal(default, attn(q, kq, vq, None, None))
    if n > 1:  # with one token the softmax is 1 whatever the scale
        assert not torch.allclose(default, attn(q, kq, vq, sm_scale=3 / math.sqrt(spec.head_dim)))
