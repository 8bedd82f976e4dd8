"""The float64 plan executor runs GEMM plans: property tests against dequantize-then-matmul in
float64 on fresh random data (every case, random shapes, groups, bits and m)."""
from __future__ import annotations

import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

import foldc
from foldc.errors import InputError, InputTypeError
from foldc.gemm import GemmSpec, parse_gemm_encoding
from foldc.gemm.reference import ReferenceGemm, gemm_reference, quantize_2d

import pytest


@st.composite
def gemm_cases(draw):
    kind = draw(st.sampled_from(["k-group", "per-channel", "int8xint8"]))
    bits = draw(st.sampled_from([2, 4, 8]))
    group = draw(st.sampled_from([8, 16, 32]))
    k = group * draw(st.integers(1, 4)) * (4 if kind == "k-group" else 1)
    n = draw(st.integers(1, 24))
    m = draw(st.integers(1, 70))
    policy = draw(st.sampled_from(["auto", "dequant"]))
    if kind == "k-group":
        w, a = f"k-group:{bits}:{group}", None
    elif kind == "per-channel":
        w, a = f"per-channel:{bits}", None
    else:
        w, a = "per-channel:8", f"per-token:{bits}"
    spec = GemmSpec(n, k, parse_gemm_encoding(w, "weight"), parse_gemm_encoding(a, "activation"),
                    m=draw(st.sampled_from([m, None])))
    return spec, m, policy, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=40, deadline=None)
@given(gemm_cases())
def test_executor_matches_dequantize_then_matmul(case):
    spec, m, policy, seed = case
    note(f"{spec.describe()} m={m} policy={policy}")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, spec.k, generator=gen) * 3 + torch.rand((), generator=gen)
    w = torch.randn(spec.n, spec.k, generator=gen) + 0.5
    xq = quantize_2d(x, spec.activation) if spec.activation else x.half()
    wq = quantize_2d(w, spec.weight)
    plan = foldc.plan(spec, fold_policy=policy) if spec.activation is None else foldc.plan(spec)
    got = ReferenceGemm(plan)(xq, wq)
    want = gemm_reference(xq, wq)
    assert got.dtype == torch.float64 and got.shape == (m, spec.n)
    assert want.abs().max() > 0
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12 * float(want.abs().max()))


def test_reference_gemm_checks_its_inputs():
    spec = GemmSpec(16, 64, parse_gemm_encoding("k-group:4:32", "weight"))
    gemm = foldc.compile(spec, target="reference")
    x, w = torch.randn(2, 64).half(), torch.randn(16, 64)
    with pytest.raises(InputTypeError, match="w must be an AffineTensor of encoding k-group:4:32"):
        gemm(x, w)
    with pytest.raises(InputError, match=r"x must be a \[rows, k=64\] tensor"):
        gemm(torch.randn(2, 32), quantize_2d(w, spec.weight))
    for dtype in (torch.int64, torch.int8, torch.bool):   # never cast to float64 and back as if it were exact
        with pytest.raises(InputError, match=f"x dtype={dtype}: a plain operand is floating point"):
            gemm(torch.ones(2, 64, dtype=dtype), quantize_2d(w, spec.weight))


@pytest.mark.parametrize("enc", ["k-group:4:64", foldc.Affine(4, "token", 64), None])
def test_quantize_2d_names_the_encoding_it_takes(enc):
    """quantize_2d(w, "k-group:4:64") raised AttributeError: 'str' object has no attribute 'affine'."""
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()))))
    with pytest.raises(InputTypeError, match=r"GemmEncoding.*parse_gemm_encoding"):
        quantize_2d(w, enc)


def test_quantize_2d_and_the_gemm_name_shapes_and_encodings_in_gemm_terms():
    """A [rows, k] weight's errors came from the attention quantizer: 'group_size=32 does not divide head_dim=48;
    token-wise groups cut head_dim', 'x has tokens=0 (shape=(1, 1, 0, 64))'; and a compiled GEMM refused a weight of
    another group as 'w has encoding token:4:16 ... the spec needs token:4:32', the attention syntax."""
    from foldc.errors import SpecError

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    enc = parse_gemm_encoding("k-group:4:32", "weight")
    with pytest.raises(SpecError, match=r"^group_size=32 of k-group:4:32 does not divide k=48, the matrix's columns"):
        quantize_2d(torch.randn(16, 48, generator=gen), enc)
    with pytest.raises(SpecError, match=r"^k=6, the matrix's columns, is not a multiple of 4, the 2-bit codes per"):
        quantize_2d(torch.randn(16, 6, generator=gen), parse_gemm_encoding("per-channel:2", "weight"))
    with pytest.raises(InputError, match=r"^the matrix has shape \(0, 64\); quantize_2d needs at least one row"):
        quantize_2d(torch.randn(0, 64, generator=gen), enc)
    spec = GemmSpec(16, 64, enc)
    gemm = foldc.compile(spec, target="reference")
    x = torch.randn(2, 64, generator=gen).half()
    for other, text in (("k-group:4:16", "k-group:4:16"), ("per-channel:4:bf16", "per-channel:4:bf16")):
        w = quantize_2d(torch.randn(16, 64, generator=gen), parse_gemm_encoding(other, "weight"))
        with pytest.raises(InputError, match=f"^w has encoding {text} and shape \\(1, 1, 16, 64\\); the spec needs "
                                             r"k-group:4:32 with shape \[1, 1, rows, k=64\]$"):
            gemm(x, w)
    w = quantize_2d(torch.randn(16, 64, generator=gen), enc)
    assert torch.allclose(gemm(x, w), gemm_reference(x, w), rtol=1e-12, atol=1e-12)


@settings(max_examples=15, deadline=None)
@given(st.sampled_from(["k-group:4:128", "k-group:2:64", "per-channel:8"]), st.floats(1e8, 1e30),
       st.integers(0, 2**31 - 1))
def test_quantize_2d_scale_overflow_names_the_fp32_encoding_and_it_works(weight, big, seed):
    """A weight whose scales overflow fp16 is refused with the GEMM encoding that takes it (its ':fp32' form,
    not the attention quantizer's Affine advice), and that encoding quantizes it within half a step."""
    from foldc.errors import ScaleOverflowError

    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 256, generator=gen)
    w[int(torch.randint(8, (1,), generator=gen)), int(torch.randint(256, (1,), generator=gen))] = big
    enc = parse_gemm_encoding(weight, "weight")
    with pytest.raises(ScaleOverflowError) as ei:
        quantize_2d(w, enc)
    assert isinstance(ei.value, InputError)
    fix = str(ei.value).split("float32 scales, ")[1].strip("'")
    assert fix == weight + ":fp32"
    q = quantize_2d(w, parse_gemm_encoding(fix, "weight"))
    s = q.scale[0, 0].double().repeat_interleave(256 // q.scale.shape[-1], dim=1)
    assert ((q.dequantize(torch.float64)[0, 0] - w.double()).abs() <= s / 2 * (1 + 1e-5) + 1e-3 * s).all()


@settings(max_examples=8, deadline=None)
@given(st.sampled_from(["k-group:4:32", "per-channel:8"]), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_reference_gemm_refuses_operands_it_cannot_read(weight, m, seed):
    """x on the meta device returned a float64 [m, n] of whatever memory held (no error); a weight on the meta device
    (or another device than x) and a sparse x raised torch's RuntimeError naming neither; a NumPy x was refused as
    "got (m, k)", its shape, the right one. Each is refused by name; the same operands on one device still answer."""
    spec = GemmSpec(16, 64, parse_gemm_encoding(weight, "weight"))
    gemm = foldc.compile(spec, target="reference")
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, 64, generator=gen) + 0.5).half()
    w = quantize_2d(torch.randn(16, 64, generator=gen), spec.weight)
    with pytest.raises(InputError, match="w is on cpu but x is on meta; move both to one device"):
        gemm(x.to("meta"), w)
    with pytest.raises(InputError, match="w is on meta but x is on cpu; move both to one device"):
        gemm(x, w.to("meta"))
    with pytest.raises(InputError, match="x and w are on the meta device, which holds no values"):
        gemm(x.to("meta"), w.to("meta"))
    with pytest.raises(InputError, match=r"x is a tensor of layout torch.sparse_coo.*x.to_dense\(\)"):
        gemm(x.float().to_sparse(), w)
    with pytest.raises(InputError, match=r"x must be a \[rows, k=64\] tensor; got a ndarray, not a torch.Tensor"):
        gemm(x.numpy(), w)
    want = gemm_reference(x, w)
    assert float(want.abs().max()) > 0 and torch.allclose(gemm(x, w), want, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("weight", ["k-group:4:32", "per-channel:8"])
def test_reference_gemm_runs_on_the_operands_gpu(weight):
    """The executor made its group-membership matrices on the CPU whatever the operands' device: x and w on a GPU
    raised torch's device-mismatch RuntimeError. It now runs where they are, with the CPU's answer."""
    spec = GemmSpec(16, 64, parse_gemm_encoding(weight, "weight"))
    gemm = foldc.compile(spec, target="reference")
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    x = (torch.randn(3, 64, generator=gen) + 0.5).half()
    w = quantize_2d(torch.randn(16, 64, generator=gen), spec.weight)
    got = gemm(x.cuda(), w.to("cuda"))
    assert got.is_cuda and torch.allclose(got.cpu(), gemm(x, w), rtol=1e-12, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["k-group:4:32", "k-group:2:64:bf16", "per-channel:8", "k-group:4:32:fp32"]),
       st.floats(0.3, 1.3), st.integers(0, 2**31 - 1))
def test_rebuilt_peak_is_the_largest_value_where_it_passes_the_limit(weight, spread, seed):
    """`rebuilt_peak` (the check of a plan rebuilding values in fp16): the largest |scale * code + zero| and where
    it lies, exactly where it passes the limit (a bound from the scales alone decides only that it cannot)."""
    from foldc.gemm.reference import rebuilt_peak

    limit = 65504.0
    gen = torch.Generator().manual_seed(seed)
    w = quantize_2d(torch.rand(8, 128, generator=gen) * limit * spread, parse_gemm_encoding(weight, "weight"))
    values = w.dequantize(torch.float64)[0, 0].abs()
    peak = float(values.max())
    found = rebuilt_peak(w, limit)
    note(f"peak={peak} found={found}")
    if peak > limit:
        assert found is not None and found[0] == peak and float(values[found[1], found[2]]) == peak
    else:
        assert found is None
