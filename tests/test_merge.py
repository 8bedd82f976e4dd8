"""merge_attention and return_lse: attention over split key ranges merges back exactly."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import foldc
from foldc.errors import InputError


def _lse_reference(q, k, sm_scale):
    b, hq, d = q.shape
    hkv = k.shape[1]
    logits = torch.einsum("bkhd,bknd->bkhn", q.double().reshape(b, hkv, hq // hkv, d), k.double()) * sm_scale
    return torch.logsumexp(logits, dim=-1).reshape(b, hq)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), tokens=st.integers(2, 90), parts=st.integers(1, 4), ratio=st.sampled_from([1, 2, 4]))
def test_split_keys_merge_to_the_whole(seed, tokens, parts, ratio):
    gen = torch.Generator().manual_seed(seed)
    spec = foldc.AttentionSpec(2 * ratio, 2, 16)
    q = torch.randn(2, 2 * ratio, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 2, tokens, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 2, tokens, 16, generator=gen, dtype=torch.float64) + 1.0
    cuts = sorted({0, tokens, *torch.randint(1, tokens, (parts - 1,), generator=gen).tolist()})
    attn = foldc.compile(spec, "reference")
    pieces = [attn(q, k[:, :, a:b], v[:, :, a:b], return_lse=True) for a, b in zip(cuts, cuts[1:])]
    out, lse = foldc.merge_attention(pieces)
    whole, whole_lse = attn(q, k, v, return_lse=True)
    assert torch.allclose(out, whole, rtol=1e-12, atol=1e-12)
    assert torch.allclose(lse, whole_lse, rtol=1e-12, atol=1e-12)
    assert torch.allclose(whole_lse, _lse_reference(q, k, 1 / math.sqrt(16)), rtol=1e-12, atol=1e-12)


def test_interpreter_kernel_returns_the_same_lse():
    gen = torch.Generator().manual_seed(3)
    spec = foldc.AttentionSpec(8, 2, 64, foldc.Affine(2, "token", 16), foldc.Affine(4, "channel", 16))
    q = torch.randn(2, 8, 64, generator=gen).half()
    k = foldc.quantize(torch.randn(2, 2, 70, 64, generator=gen), spec.k)
    v = foldc.quantize(torch.randn(2, 2, 70, 64, generator=gen), spec.v)
    _, lse = foldc.compile(spec, "interpret", block_n=16)(q, k, v, return_lse=True)
    _, ref = foldc.compile(spec, "reference")(q, k, v, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == (2, 8)
    assert torch.allclose(lse.double(), ref, atol=2e-3)


def test_an_empty_part_contributes_nothing():
    out = torch.randn(1, 2, 4)
    merged, lse = foldc.merge_attention([(out, torch.zeros(1, 2)), (torch.randn(1, 2, 4), torch.full((1, 2), -math.inf))])
    assert torch.allclose(merged, out) and torch.allclose(lse, torch.zeros(1, 2))


def test_mismatched_parts_are_rejected():
    with pytest.raises(InputError, match="part 1"):
        foldc.merge_attention([(torch.randn(1, 2, 4), torch.zeros(1, 2)), (torch.randn(1, 3, 4), torch.zeros(1, 3))])
    with pytest.raises(InputError, match="at least one"):
        foldc.merge_attention([])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_lse_is_refused(dtype):
    """A log-sum-exp rounded to 16 bits moves each part's weight exp(lse_i - lse) by up to 2**-8 x |lse|: about 6%
    at lse 20 in bf16, silently."""
    gen = torch.Generator().manual_seed(11)
    lse = 20 + torch.rand(1, 2, generator=gen, dtype=torch.float64)
    parts = [(torch.randn(1, 2, 4, generator=gen), lse.float()), (torch.randn(1, 2, 4, generator=gen), lse.float() - 1)]
    rounded = lse.to(dtype).double()
    assert (rounded - lse).abs().max() > 1e-3   # the rounding the merge would have taken as the logits' own
    with pytest.raises(InputError, match="part 1: lse dtype"):
        foldc.merge_attention([parts[0], (parts[1][0], parts[1][1].to(dtype))])
    foldc.merge_attention(parts)   # float32 and float64 lse pass
    foldc.merge_attention([(o, s.double()) for o, s in parts])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("index", [0, 1])
def test_a_float8_output_is_refused_by_name(dtype, index):
    """A part's out in float8 raised NotImplementedError from inside torch (no isfinite for float8); it is refused
    naming the part and the dtypes the merge takes, and the same parts in float32 merge to the whole."""
    gen = torch.Generator().manual_seed(41 + index)
    q = torch.randn(2, 3, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 3, 12, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 3, 12, 8, generator=gen, dtype=torch.float64) + 0.5
    attn = foldc.compile(foldc.AttentionSpec(3, 3, 8), "reference")
    parts = [attn(q, k[:, :, a:b], v[:, :, a:b], return_lse=True) for a, b in ((0, 5), (5, 12))]
    bad = list(parts)
    bad[index] = (parts[index][0].to(dtype), parts[index][1].float())
    with pytest.raises(InputError, match=f"part {index}: out dtype={dtype}: the merge takes"):
        foldc.merge_attention(bad)
    out, lse = foldc.merge_attention([(o.float(), s.float()) for o, s in parts])
    whole, whole_lse = attn(q, k, v, return_lse=True)
    assert torch.allclose(out.double(), whole, atol=1e-5) and torch.allclose(lse.double(), whole_lse, atol=1e-5)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), parts=st.integers(1, 3), lse64=st.booleans(),
       out_dtype=st.sampled_from([torch.float16, torch.float32, torch.float64]))
def test_parts_on_the_meta_device_merge_to_meta_tensors(seed, parts, lse64, out_dtype):
    """Attention runs on meta tensors (a shape-only run: foldc.compile's reference target returns meta out and lse),
    but merging its parts raised torch's RuntimeError (Tensor.item() cannot be called on meta tensors) from the
    check of the lse values. Meta parts hold no values to check: they merge to meta tensors of the shapes and dtypes
    real parts give."""
    gen = torch.Generator().manual_seed(seed)
    lse_dtype = torch.float64 if lse64 else torch.float32
    real = [(torch.randn(2, 3, 8, generator=gen).to(out_dtype), torch.randn(2, 3, generator=gen).to(lse_dtype))
            for _ in range(parts)]
    out, lse = foldc.merge_attention(real)
    got, got_lse = foldc.merge_attention([(o.to("meta"), s.to("meta")) for o, s in real])
    assert got.is_meta and got_lse.is_meta
    assert (got.shape, got.dtype, got_lse.shape, got_lse.dtype) == (out.shape, out.dtype, lse.shape, lse.dtype)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), which=st.sampled_from(["out", "lse"]), index=st.integers(0, 1))
def test_a_sparse_part_is_refused_by_name(seed, which, index):
    """A sparse out or lse raised from inside torch (NotImplementedError: aten::ne.Scalar on SparseCPU, or
    isfinite's); attention itself refuses sparse tensors by name. Now an InputError naming the part, the tensor,
    its layout and to_dense()."""
    gen = torch.Generator().manual_seed(seed)
    parts = [[torch.randn(2, 3, 8, generator=gen), torch.randn(2, 3, generator=gen)] for _ in range(2)]
    slot = 0 if which == "out" else 1
    parts[index][slot] = parts[index][slot].to_sparse()
    with pytest.raises(InputError, match=rf"part {index}: {which} is a tensor of layout torch.sparse_coo.*"
                                         rf"{which}.to_dense\(\)"):
        foldc.merge_attention([tuple(p) for p in parts])


@pytest.mark.parametrize("lse_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("magnitude", [3e4, 1e8, 1e15])
def test_parts_of_a_large_lse_merge_with_weights_summing_to_one(lse_dtype, magnitude):
    """Weights exp(lse_i - lse) with the merged lse rounded: at |lse| 1e8 float32's step is 8, so two parts of
    equal lse each got weight 1 (the output twice the right one), silently; at 3e4 the weights were off by ~1e-4."""
    gen = torch.Generator().manual_seed(int(magnitude) % 1000)
    lse = magnitude * (1 + torch.rand(2, 3, generator=gen, dtype=torch.float64))
    lse = lse.to(lse_dtype)
    gaps = torch.rand(2, 3, generator=gen, dtype=torch.float64) * 4 - 2   # the second part's lse, within 2 of the first
    lse2 = (lse.double() + gaps).to(lse_dtype)
    o1, o2 = torch.randn(2, 3, 8, generator=gen), torch.randn(2, 3, 8, generator=gen) + 1
    out, merged = foldc.merge_attention([(o1, lse), (o2, lse2)])
    d = (lse2.double() - lse.double())   # the weights from the lse as given, in float64
    w1 = 1 / (1 + torch.exp(d))
    want = w1[..., None] * o1.double() + (1 - w1[..., None]) * o2.double()
    assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-5)
    want_lse = lse.double() + torch.log1p(torch.exp(d))
    assert torch.allclose(merged.double(), want_lse, rtol=1e-6 if lse_dtype == torch.float32 else 1e-12, atol=0)


@pytest.mark.parametrize("gap", [120.0, 400.0])
def test_a_part_whose_weight_underflows_keeps_the_nan_of_its_output(gap):
    """NaN values in a part whose lse lies far below the other's: one attention over all the keys is NaN there
    (0 x NaN), and so is the merge; only an empty part (lse -inf) adds exactly 0. A zero weight was taken for an
    empty part, and the NaN dropped."""
    gen = torch.Generator().manual_seed(int(gap))
    o1, o2 = torch.randn(2, 3, 8, generator=gen), torch.randn(2, 3, 8, generator=gen)
    lse1 = torch.randn(2, 3, generator=gen)
    o2[1, 2, 5] = float("nan")
    out, lse = foldc.merge_attention([(o1, lse1), (o2, lse1 - gap)])
    assert bool(out[1, 2].isnan().any())
    keep = torch.ones(2, 3, dtype=torch.bool)
    keep[1, 2] = False
    assert torch.allclose(out[keep], o1[keep], atol=1e-6) and torch.allclose(lse, lse1)
