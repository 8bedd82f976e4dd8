"""Tests for foldc.encoding: Affine, parse_affine, pack/unpack, AffineTensor, quantize."""
from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import foldc

from foldc.encoding import (
    MAX_GROUP_SIZE,
    SUPPORTED_BITS,
    Affine,
    AffineTensor,
    pack_codes,
    parse_affine,
    quantize,
    scale_shape,
    unpack_codes,
)
from foldc.errors import InputError, InputTypeError, ScaleOverflowError, SpecError

SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PROP = settings(max_examples=80, deadline=None)


# --------------------------------------------------------------------------------------------
# helpers and strategies
# --------------------------------------------------------------------------------------------

def _divisors(d: int) -> list[int]:
    return [q for q in range(1, d + 1) if d % q == 0]


@st.composite
def encodings_and_shapes(draw, layouts=("token", "channel"), scale_dtypes=SCALE_DTYPES,
                         partial_channel_group=False):
    """A valid (Affine, (B, H, N, D)) pair with small shapes."""
    bits = draw(st.sampled_from(SUPPORTED_BITS))
    layout = draw(st.sampled_from(layouts))
    k = 8 // bits
    d = k * draw(st.integers(1, 6))
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    if layout == "token":
        n = draw(st.integers(1, 5))
        g = draw(st.sampled_from(_divisors(d)))
    elif partial_channel_group:
        g = draw(st.integers(2, 5))
        n = g * draw(st.integers(0, 2)) + draw(st.integers(1, g - 1))  # n % g != 0
    else:
        n = draw(st.integers(1, 11))
        g = draw(st.integers(1, 12))
    enc = Affine(bits, layout, g, draw(st.sampled_from(scale_dtypes)))
    return enc, (b, h, n, d)


@st.composite
def random_inputs(draw, x_dtypes=(torch.float32, torch.float16, torch.bfloat16), **kw):
    """(x, enc): x is fresh Gaussian data with a random spread and offset (never all zeros)."""
    enc, shape = draw(encodings_and_shapes(**kw))
    seed = draw(st.integers(0, 2**31 - 1))
    spread = draw(st.sampled_from([1e-3, 0.5, 3.0, 200.0]))
    offset = draw(st.floats(-50.0, 50.0, allow_nan=False))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * spread + offset
    x = x.to(draw(st.sampled_from(x_dtypes)))
    assume(x.float().abs().max() > 0)
    return x, enc


def group_minmax(x: torch.Tensor, enc: Affine) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group min and max, shaped like scale; channel groups are cut by slicing (the last
    one partial), independently of quantize's padding trick."""
    xf = x.float()
    b, h, n, d = xf.shape
    g = enc.group_size
    if enc.layout == "token":
        grp = xf.reshape(b, h, n, d // g, g)
        return grp.amin(-1), grp.amax(-1)
    blocks = [xf[:, :, t0:t0 + g] for t0 in range(0, n, g)]
    return (torch.stack([blk.amin(2) for blk in blocks], 2),
            torch.stack([blk.amax(2) for blk in blocks], 2))


def ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An upper bound on the spacing of `dtype` around |t| (subnormals included)."""
    fi = torch.finfo(dtype)
    return torch.clamp(t.abs(), min=fi.smallest_normal) * fi.eps


def fp32_slack(*terms: torch.Tensor) -> torch.Tensor:
    """Float32 arithmetic noise of computing codes and scale * code + zero."""
    return 8 * torch.finfo(torch.float32).eps * sum(t.abs() for t in terms) + 1e-30


# --------------------------------------------------------------------------------------------
# Affine
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [2, 4, 8])
def test_affine_derived_properties(bits):
    tok = Affine(bits, "token", 32)
    ch = Affine(bits, "channel", 16, torch.float32)
    assert tok.codes_per_byte == ch.codes_per_byte == 8 // bits
    assert tok.max_code == ch.max_code == 2**bits - 1
    assert tok.group_axis == "channel"
    assert ch.group_axis == "token"
    assert tok.scale_dtype == torch.float16  # the default


@pytest.mark.parametrize("bits", [3, 0, 1, 16, 2.0, True, "2"])
def test_affine_bad_bits(bits):
    with pytest.raises(SpecError, match=r"bits=") as ei:
        Affine(bits, "token", 32)
    assert f"bits={bits!r}" in str(ei.value)


@pytest.mark.parametrize("layout", ["row", "Token", "", None])
def test_affine_bad_layout(layout):
    with pytest.raises(SpecError) as ei:
        Affine(4, layout, 32)
    assert f"layout={layout!r}" in str(ei.value)


@pytest.mark.parametrize("group_size", [0, -1, True, False, 2.5, "64", 2**31, 10**17])
def test_affine_bad_group_size(group_size):   # past int32: the kernels' argument (an InterpreterError inside Triton)
    with pytest.raises(SpecError) as ei:
        Affine(4, "channel", group_size)
    assert f"group_size={group_size!r}" in str(ei.value)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.float64, "fp16"])
def test_affine_bad_scale_dtype(dtype):
    with pytest.raises(SpecError) as ei:
        Affine(4, "token", 32, dtype)
    assert f"scale_dtype={dtype}" in str(ei.value)


def test_affine_is_frozen():
    enc = Affine(2, "token", 64)
    with pytest.raises(AttributeError):
        enc.bits = 4  # type: ignore[misc]


@PROP
@given(bits=st.sampled_from(SUPPORTED_BITS), layout=st.sampled_from(["token", "channel"]),
       g=st.integers(1, 256), d=st.integers(1, 256))
def test_check_head_dim_accepts_exactly_the_valid_dims(bits, layout, g, d):
    enc = Affine(bits, layout, g)
    k = 8 // bits
    valid = d % k == 0 and (layout == "channel" or d % g == 0)
    if valid:
        enc.check_head_dim(d)
    else:
        with pytest.raises(SpecError):
            enc.check_head_dim(d)


@pytest.mark.parametrize("bits,d", [(2, 6), (2, 130), (4, 7), (4, 129)])
def test_check_head_dim_not_multiple_of_codes_per_byte(bits, d):
    enc = Affine(bits, "channel", 16)
    with pytest.raises(SpecError) as ei:
        enc.check_head_dim(d)
    msg = str(ei.value)
    assert f"head_dim={d}" in msg and f"multiple of {8 // bits}" in msg
    with pytest.raises(SpecError, match=f"head_dim={d} is not a multiple"):  # same check in quantize
        quantize(torch.randn(1, 1, 3, d), enc)


@pytest.mark.parametrize("g,d", [(48, 64), (3, 64), (256, 128)])
def test_token_group_must_divide_head_dim(g, d):
    enc = Affine(4, "token", g)
    with pytest.raises(SpecError) as ei:
        enc.check_head_dim(d)
    assert f"group_size={g} does not divide head_dim={d}" in str(ei.value)
    with pytest.raises(SpecError, match=f"group_size={g} does not divide"):
        quantize(torch.randn(1, 2, 3, d), enc)


def test_check_head_dim_names_the_given_field():
    with pytest.raises(SpecError, match=r"group_size=48 does not divide head_dim \(for k\)=64"):
        Affine(4, "token", 48).check_head_dim(64, field="head_dim (for k)")


def test_channel_group_need_not_divide_head_dim():
    Affine(4, "channel", 48).check_head_dim(64)  # channel groups run along tokens
    at = quantize(torch.randn(1, 1, 50, 64), Affine(4, "channel", 48))
    assert at.scale.shape == (1, 1, 2, 64)


# --------------------------------------------------------------------------------------------
# parse_affine / short
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,want", [
    ("token:2:128", Affine(2, "token", 128, torch.float16)),
    ("channel:4:64:fp32", Affine(4, "channel", 64, torch.float32)),
    ("channel:8:32:bf16", Affine(8, "channel", 32, torch.bfloat16)),
    ("token:4:16:fp16", Affine(4, "token", 16, torch.float16)),
    ("  token:2:64\n", Affine(2, "token", 64)),
])
def test_parse_affine(text, want):
    assert parse_affine(text) == want


@pytest.mark.parametrize("text", ["token:2", "token", "", "token:2:128:fp32:x", ":::::"])
def test_parse_affine_wrong_number_of_fields(text):
    with pytest.raises(SpecError) as ei:
        parse_affine(text)
    assert repr(text) in str(ei.value) and "layout:bits:group_size" in str(ei.value)


@pytest.mark.parametrize("text,bad", [("token:two:128", "'two'"), ("token:2:lots", "'lots'"),
                                      ("token:2.0:128", "'2.0'")])
def test_parse_affine_non_integer(text, bad):
    with pytest.raises(SpecError) as ei:
        parse_affine(text)
    assert bad in str(ei.value) and "must be integers" in str(ei.value)


@pytest.mark.parametrize("suffix", ["fp64", "float16", "", "FP16"])
def test_parse_affine_bad_scale_dtype(suffix):
    text = f"channel:4:64:{suffix}"
    with pytest.raises(SpecError) as ei:
        parse_affine(text)
    assert f"scale dtype {suffix!r}" in str(ei.value)


@pytest.mark.parametrize("text,field", [("row:2:128", "layout='row'"), ("token:3:128", "bits=3"),
                                        ("token:2:0", "group_size=0"), ("token:2:-8", "group_size=-8")])
def test_parse_affine_invalid_values_reach_affine_validation(text, field):
    with pytest.raises(SpecError, match=field):
        parse_affine(text)


@pytest.mark.parametrize("value", [5, None, 2.5, ["token", 2, 128]])
def test_parse_affine_non_string(value):
    with pytest.raises(SpecError) as ei:
        parse_affine(value)  # type: ignore[arg-type]
    assert f"encoding {value!r} must be a string" in str(ei.value)


@PROP
@given(bits=st.sampled_from(SUPPORTED_BITS), layout=st.sampled_from(["token", "channel"]),
       g=st.integers(1, 4096), dtype=st.sampled_from(SCALE_DTYPES))
def test_short_round_trips_through_parse_affine(bits, layout, g, dtype):
    enc = Affine(bits, layout, g, dtype)
    text = enc.short()
    assert text.startswith(f"{layout}:{bits}:{g}")
    assert parse_affine(text) == enc


# --------------------------------------------------------------------------------------------
# pack_codes / unpack_codes
# --------------------------------------------------------------------------------------------

@st.composite
def code_rows(draw):
    bits = draw(st.sampled_from(SUPPORTED_BITS))
    k = 8 // bits
    d = k * draw(st.integers(1, 6))
    rows = draw(st.integers(1, 4))
    vals = draw(st.lists(st.integers(0, 2**bits - 1), min_size=rows * d, max_size=rows * d))
    assume(len(set(vals)) > 1)
    return bits, torch.tensor(vals, dtype=torch.int64).reshape(rows, d)


@PROP
@given(code_rows())
def test_pack_unpack_round_trip(case):
    bits, codes = case
    rows, d = codes.shape
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (rows, d * bits // 8)
    back = unpack_codes(packed, bits)
    assert back.shape == codes.shape
    assert torch.equal(back.to(torch.int64), codes)


@PROP
@given(bits=st.sampled_from(SUPPORTED_BITS), nbytes=st.integers(1, 8), seed=st.integers(0, 2**31 - 1))
def test_unpack_then_pack_is_identity_on_any_bytes(bits, nbytes, seed):
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (3, 2, nbytes), generator=gen).to(torch.uint8)
    codes = unpack_codes(packed, bits)
    assert codes.shape == (3, 2, nbytes * (8 // bits))
    assert int(codes.max()) <= 2**bits - 1
    assert torch.equal(pack_codes(codes, bits), packed)


@PROP
@given(code_rows())
def test_planar_packing_order_bit_by_bit(case):
    """Byte j, bit field i (bits [i*bits, (i+1)*bits)) holds channel i * (D/k) + j."""
    bits, codes = case
    k = 8 // bits
    d = codes.shape[-1]
    width = d // k
    mask = (1 << bits) - 1
    packed = pack_codes(codes, bits).tolist()
    c = codes.tolist()
    for r, row in enumerate(packed):
        for j, byte in enumerate(row):
            assert 0 <= byte < 256
            expected = 0
            for i in range(k):
                assert (byte >> (i * bits)) & mask == c[r][i * width + j]
                expected |= c[r][i * width + j] << (i * bits)
            assert byte == expected


def test_planar_packing_example():
    # 2-bit, head_dim 8: byte 0 holds channels 0, 2, 4, 6 in bit fields 0..3.
    codes = torch.tensor([[1, 2, 3, 0, 2, 1, 0, 3]])
    assert pack_codes(codes, 2).tolist() == [[1 | 3 << 2 | 2 << 4 | 0 << 6, 2 | 0 << 2 | 1 << 4 | 3 << 6]]
    # 4-bit: low nibble channel j, high nibble channel D/2 + j.
    assert pack_codes(torch.tensor([[5, 9, 12, 3]]), 4).tolist() == [[5 | 12 << 4, 9 | 3 << 4]]


# --------------------------------------------------------------------------------------------
# quantize: shapes, codes, AffineTensor accessors
# --------------------------------------------------------------------------------------------

@PROP
@given(random_inputs())
def test_quantize_shapes_and_code_range(case):
    x, enc = case
    b, h, n, d = x.shape
    at = quantize(x, enc)
    g = enc.group_size
    want = (b, h, n, d // g) if enc.layout == "token" else (b, h, math.ceil(n / g), d)
    assert scale_shape(enc, b, h, n, d) == want
    assert at.codes.dtype == torch.uint8 and at.codes.shape == (b, h, n, d * enc.bits // 8)
    assert at.scale.shape == want and at.zero.shape == want
    assert at.scale.dtype == at.zero.dtype == enc.scale_dtype
    assert at.encoding == enc and at.head_dim == d
    assert at.shape == (b, h, n, d) and at.num_tokens == n and at.device == x.device
    codes = at.unpack()
    assert codes.dtype == torch.int64 and codes.shape == (b, h, n, d)
    assert int(codes.min()) >= 0 and int(codes.max()) < 2**enc.bits
    assert torch.isfinite(at.scale.float()).all() and torch.isfinite(at.zero.float()).all()
    assert (at.scale.float() >= 0).all()


@PROP
@given(random_inputs(layouts=("channel",), partial_channel_group=True))
def test_quantize_channel_partial_last_group(case):
    x, enc = case
    n, g = x.shape[2], enc.group_size
    assert n % g  # the strategy guarantees a partial last group
    at = quantize(x, enc)
    assert at.scale.shape[2] == n // g + 1
    mn, mx = group_minmax(x, enc)
    # the partial group's stats come from its real tokens only (not from padding)
    assert torch.equal(at.zero, mn.to(enc.scale_dtype))
    assert torch.equal(at.scale, ((mx - mn) / enc.max_code).to(enc.scale_dtype))
    assert torch.isfinite(at.dequantize()).all()


@PROP
@given(random_inputs())
def test_expanded_params_map_each_value_to_its_group(case):
    x, enc = case
    at = quantize(x, enc)
    s, z = at.expanded_params()
    assert s.shape == z.shape == x.shape and s.dtype == torch.float32
    b, h, n, d = x.shape
    g = enc.group_size
    t = torch.arange(n).view(n, 1).expand(n, d)
    c = torch.arange(d).view(1, d).expand(n, d)
    if enc.layout == "token":
        ws, wz = at.scale.float()[:, :, t, c // g], at.zero.float()[:, :, t, c // g]
    else:
        ws, wz = at.scale.float()[:, :, t // g, c], at.zero.float()[:, :, t // g, c]
    assert torch.equal(s, ws) and torch.equal(z, wz)
    s64, _ = at.expanded_params(torch.float64)
    assert s64.dtype == torch.float64


@PROP
@given(random_inputs())
def test_zero_and_scale_are_rounded_group_min_and_step(case):
    x, enc = case
    at = quantize(x, enc)
    mn, mx = group_minmax(x, enc)
    assert torch.equal(at.zero, mn.to(enc.scale_dtype))
    assert torch.equal(at.scale, ((mx - mn) / enc.max_code).to(enc.scale_dtype))


def test_to_moves_every_tensor():
    at = quantize(torch.randn(1, 2, 5, 16), Affine(4, "channel", 4))
    moved = at.to("cpu")
    assert isinstance(moved, AffineTensor) and moved.device.type == "cpu"
    assert torch.equal(moved.codes, at.codes) and torch.equal(moved.scale, at.scale)


# --------------------------------------------------------------------------------------------
# quantize: accuracy
# --------------------------------------------------------------------------------------------

@PROP
@given(random_inputs())
def test_dequantize_error_bound(case):
    """|x - dequantize| <= scale/2, plus the rounding of (scale, zero) to scale_dtype (which can
    push a group's extreme values into the clamp), plus float32 noise."""
    x, enc = case
    at = quantize(x, enc)
    xf = x.float()
    deq = at.dequantize()
    assert deq.dtype == torch.float32 and deq.shape == x.shape
    s, z = at.expanded_params()
    err = (xf - deq).abs()
    tol = (s / 2 + ulp(z, enc.scale_dtype) + enc.max_code * ulp(s, enc.scale_dtype)
           + fp32_slack(xf, z, s * enc.max_code))
    assert (err <= tol).all(), float((err - tol).max())
    # values whose code is not clamped are within half a step of the stored grid
    codes = at.unpack()
    inner = (codes > 0) & (codes < enc.max_code)
    assert (err[inner] <= (s / 2 + fp32_slack(xf, z, s * enc.max_code))[inner]).all()


@PROP
@given(random_inputs(scale_dtypes=(torch.float32,)))
def test_dequantize_error_bound_float32_scale(case):
    """With float32 scale/zero nothing is lost to storage: error <= scale/2 + fp32 noise."""
    x, enc = case
    at = quantize(x, enc)
    xf = x.float()
    s, z = at.expanded_params()
    err = (xf - at.dequantize()).abs()
    assert (err <= s / 2 + fp32_slack(xf, z, s * enc.max_code)).all()


@PROP
@given(random_inputs(scale_dtypes=(torch.float32,)))
def test_group_min_and_max_reproduced_float32_scale(case):
    """Every group uses code 0 and (if not constant) code 2**bits-1; its min comes back exactly
    and its max within float32 rounding."""
    x, enc = case
    at = quantize(x, enc)
    mn, mx = group_minmax(x, enc)
    cmin, cmax = group_minmax(at.unpack().float(), enc)
    dmin, dmax = group_minmax(at.dequantize(), enc)
    assert (cmin == 0).all()
    nonconst = mx > mn
    assert (cmax[nonconst] == enc.max_code).all()
    assert (cmax[~nonconst] == 0).all()
    assert torch.equal(at.zero, mn)
    assert torch.equal(dmin, mn)
    assert (dmax - mx).abs().le(fp32_slack(mx, mn)).all()


@PROP
@given(random_inputs(scale_dtypes=(torch.float16, torch.bfloat16)))
def test_group_min_and_max_reproduced_low_precision_scale(case):
    x, enc = case
    at = quantize(x, enc)
    mn, mx = group_minmax(x, enc)
    dmin, dmax = group_minmax(at.dequantize(), enc)
    s, z = at.scale.float(), at.zero.float()
    tol = s / 2 + ulp(z, enc.scale_dtype) + enc.max_code * ulp(s, enc.scale_dtype) + fp32_slack(mn, mx)
    assert ((dmin - mn).abs() <= tol).all()
    assert ((dmax - mx).abs() <= tol).all()
    # the zero is the group min up to the rounding of scale_dtype
    assert ((z - mn).abs() <= ulp(mn, enc.scale_dtype)).all()


@PROP
@given(random_inputs(x_dtypes=(torch.float32,)), st.data())
def test_codes_are_monotone_in_x_within_a_group(case, data):
    x, enc = case
    codes = quantize(x, enc).unpack()
    # compare two values of one group: for token layout along head_dim, else along tokens
    b, h, n, d = x.shape
    g = enc.group_size
    bi, hi = data.draw(st.integers(0, b - 1)), data.draw(st.integers(0, h - 1))
    if enc.layout == "token":
        t = data.draw(st.integers(0, n - 1))
        grp = data.draw(st.integers(0, d // g - 1))
        xs, cs = x[bi, hi, t, grp * g:(grp + 1) * g], codes[bi, hi, t, grp * g:(grp + 1) * g]
    else:
        c = data.draw(st.integers(0, d - 1))
        grp = data.draw(st.integers(0, math.ceil(n / g) - 1))
        xs, cs = x[bi, hi, grp * g:(grp + 1) * g, c], codes[bi, hi, grp * g:(grp + 1) * g, c]
    order = torch.argsort(xs, stable=True)
    assert (cs[order].diff() >= 0).all()


# --------------------------------------------------------------------------------------------
# quantize: constant groups
# --------------------------------------------------------------------------------------------

nonzero_values = st.floats(-6e4, 6e4, allow_nan=False, allow_infinity=False).filter(lambda v: v != 0)


def _fp16_half_ulp(v: float) -> float:
    return max(abs(v), torch.finfo(torch.float16).smallest_normal) * torch.finfo(torch.float16).eps / 2


@PROP
@given(encodings_and_shapes(scale_dtypes=(torch.float16,)), nonzero_values,
       st.integers(0, 2**31 - 1), st.data())
def test_constant_group_gets_scale_zero(es, v, seed, data):
    enc, (b, h, n, d) = es
    x = torch.randn((b, h, n, d), generator=torch.Generator().manual_seed(seed))
    g = enc.group_size
    bi, hi = data.draw(st.integers(0, b - 1)), data.draw(st.integers(0, h - 1))
    if enc.layout == "token":
        t, grp = data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, d // g - 1))
        idx = (bi, hi, t, slice(grp * g, (grp + 1) * g))
        pidx = (bi, hi, t, grp)
    else:
        c, grp = data.draw(st.integers(0, d - 1)), data.draw(st.integers(0, math.ceil(n / g) - 1))
        idx = (bi, hi, slice(grp * g, (grp + 1) * g), c)
        pidx = (bi, hi, grp, c)
    x[idx] = v
    at = quantize(x, enc)
    v16 = torch.tensor(v).to(torch.float16)
    assert float(at.scale[pidx]) == 0.0
    assert at.zero[pidx] == v16
    assert (at.unpack()[idx] == 0).all()
    deq = at.dequantize()
    assert torch.isfinite(deq).all()
    assert (deq[idx] == v16.float()).all()
    assert (deq[idx] - v).abs().max() <= _fp16_half_ulp(v)


@PROP
@given(encodings_and_shapes(), nonzero_values)
def test_all_constant_tensor(es, v):
    enc, shape = es
    at = quantize(torch.full(shape, v), enc)
    assert (at.scale.float() == 0).all()
    assert (at.unpack() == 0).all()
    deq = at.dequantize()
    assert not torch.isnan(deq).any()
    assert (deq == torch.tensor(v).to(enc.scale_dtype).float()).all()


@PROP
@given(random_inputs(layouts=("token",), x_dtypes=(torch.float32,), scale_dtypes=(torch.float16,)))
def test_group_size_one_token_layout_is_fp16_rounding(case):
    x, enc = case
    at = quantize(x, Affine(enc.bits, "token", 1))
    assert (at.scale == 0).all()
    assert torch.equal(at.dequantize(), x.to(torch.float16).float())


# --------------------------------------------------------------------------------------------
# quantize: bad input values
# --------------------------------------------------------------------------------------------

@PROP
@given(encodings_and_shapes(), st.sampled_from([math.nan, math.inf, -math.inf]),
       st.sampled_from([torch.float32, torch.float16]), st.integers(0, 2**31 - 1), st.data())
def test_nan_or_inf_input_raises(es, bad, x_dtype, seed, data):
    enc, shape = es
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(x_dtype)
    pos = [data.draw(st.integers(0, s - 1)) for s in shape]
    x[tuple(pos)] = bad
    with pytest.raises(InputError) as ei:
        quantize(x, enc)
    msg = str(ei.value)
    assert "NaN or Inf" in msg
    assert f"index {pos}" in msg


@PROP
@given(encodings_and_shapes(scale_dtypes=(torch.float16,)),
       st.floats(2e7, 1e30), st.booleans(), st.integers(0, 2**31 - 1), st.data())
def test_fp16_scale_overflow_raises_and_float32_works(es, big, negative, seed, data):
    enc, shape = es
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 10
    pos = tuple(data.draw(st.integers(0, s - 1)) for s in shape)
    x[pos] = -big if negative else big  # overflows the fp16 zero (negative) or scale (positive)
    with pytest.raises(InputError) as ei:
        quantize(x, enc)
    msg = str(ei.value)
    assert "scale_dtype=torch.float16" in msg and "scale_dtype=torch.float32" in msg
    assert "overflow" in msg
    enc32 = Affine(enc.bits, enc.layout, enc.group_size, torch.float32)
    assert parse_affine(msg.split("float32 scales: '")[1].split("'")[0]) == enc32    # the text it names
    at = quantize(x, enc32)
    s, z = at.expanded_params()
    err = (x - at.dequantize()).abs()
    assert (err <= s / 2 + fp32_slack(x, z, s * enc.max_code)).all()


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_fp16_input_extremes_fit_fp16_scale(bits):
    x = torch.randn(1, 1, 4, 8, generator=torch.Generator().manual_seed(bits)).to(torch.float16)
    x[0, 0, 1, :4] = 65504.0
    x[0, 0, 2, 4:] = -65504.0
    enc = Affine(bits, "channel", 4)
    at = quantize(x, enc)
    assert torch.isfinite(at.scale).all() and torch.isfinite(at.zero).all()
    s, z = at.expanded_params()
    err = (x.float() - at.dequantize()).abs()
    tol = s / 2 + ulp(z, torch.float16) + enc.max_code * ulp(s, torch.float16) + fp32_slack(x.float(), z)
    assert (err <= tol).all()


def test_quantize_rejects_non_affine_encoding():
    with pytest.raises(InputTypeError, match=r"enc='token:2:128' must be a foldc.Affine"):
        quantize(torch.randn(1, 1, 2, 128), "token:2:128")  # type: ignore[arg-type]


def test_quantize_rejects_non_tensor():
    with pytest.raises(InputTypeError, match="x must be a torch.Tensor, got list"):
        quantize([[1.0, 2.0]], Affine(8, "token", 2))  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [(2, 3, 8), (1, 1, 2, 3, 8)])
def test_quantize_rejects_wrong_rank(shape):
    with pytest.raises(InputError) as ei:
        quantize(torch.randn(shape), Affine(8, "token", 8))
    assert f"shape={shape}" in str(ei.value)


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.bool])
def test_quantize_rejects_non_float(dtype):
    x = torch.randint(1, 5, (1, 1, 2, 8)).to(dtype)
    with pytest.raises(InputError) as ei:
        quantize(x, Affine(8, "token", 8))
    assert f"dtype={dtype}" in str(ei.value)


def test_quantize_rejects_zero_tokens():
    with pytest.raises(InputError, match="tokens=0"):
        quantize(torch.randn(1, 2, 0, 8), Affine(4, "channel", 4))


# --------------------------------------------------------------------------------------------
# AffineTensor constructor validation
# --------------------------------------------------------------------------------------------

def _valid_parts():
    enc = Affine(4, "channel", 3)
    at = quantize(torch.randn(2, 2, 7, 8, generator=torch.Generator().manual_seed(7)), enc)
    return at.codes, at.scale, at.zero, enc


def test_affine_tensor_accepts_valid_parts():
    codes, scale, zero, enc = _valid_parts()
    at = AffineTensor(codes, scale, zero, enc, 8)
    assert at.shape == (2, 2, 7, 8)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.float16])
def test_affine_tensor_codes_dtype(dtype):
    codes, scale, zero, enc = _valid_parts()
    with pytest.raises(InputError) as ei:
        AffineTensor(codes.to(dtype), scale, zero, enc, 8)
    assert "codes must be uint8" in str(ei.value) and f"dtype={dtype}" in str(ei.value)


def test_affine_tensor_codes_rank():
    codes, scale, zero, enc = _valid_parts()
    with pytest.raises(InputError) as ei:
        AffineTensor(codes[0], scale, zero, enc, 8)
    assert "codes must be uint8" in str(ei.value) and f"shape={tuple(codes[0].shape)}" in str(ei.value)


@pytest.mark.parametrize("head_dim", [4, 6, 16])
def test_affine_tensor_head_dim_mismatch(head_dim):
    codes, scale, zero, enc = _valid_parts()
    with pytest.raises(InputError) as ei:
        AffineTensor(codes, scale, zero, enc, head_dim)
    assert f"head_dim={head_dim}" in str(ei.value) and "codes last dim 4" in str(ei.value)


@pytest.mark.parametrize("which", ["scale", "zero"])
@pytest.mark.parametrize("bad_shape", [(2, 2, 2, 8), (2, 2, 7, 8), (2, 2, 3, 4)])
def test_affine_tensor_param_shape(which, bad_shape):
    codes, scale, zero, enc = _valid_parts()
    bad = torch.ones(bad_shape, dtype=torch.float16)
    parts = {"scale": scale, "zero": zero, which: bad}
    with pytest.raises(InputError) as ei:
        AffineTensor(codes, parts["scale"], parts["zero"], enc, 8)
    msg = str(ei.value)
    assert f"{which} shape={bad_shape}" in msg and "(2, 2, 3, 8)" in msg


@pytest.mark.parametrize("which", ["scale", "zero"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_affine_tensor_param_dtype(which, dtype):
    codes, scale, zero, enc = _valid_parts()
    parts = {"scale": scale, "zero": zero}
    parts[which] = parts[which].to(dtype)
    with pytest.raises(InputError) as ei:
        AffineTensor(codes, parts["scale"], parts["zero"], enc, 8)
    assert f"{which} dtype={dtype}" in str(ei.value) and "torch.float16" in str(ei.value)


@pytest.mark.parametrize("which", ["scale", "zero"])
def test_affine_tensor_param_device(which):
    codes, scale, zero, enc = _valid_parts()
    parts = {"scale": scale, "zero": zero}
    parts[which] = parts[which].to("meta")
    with pytest.raises(InputError, match=f"{which} is on meta but codes are on cpu"):
        AffineTensor(codes, parts["scale"], parts["zero"], enc, 8)


def test_affine_tensor_encoding_type():
    codes, scale, zero, _ = _valid_parts()
    with pytest.raises(InputTypeError, match="encoding='channel:4:3' must be a foldc.Affine"):
        AffineTensor(codes, scale, zero, "channel:4:3", 8)  # type: ignore[arg-type]


@pytest.mark.parametrize("enc", [Affine(2, "token", 32), Affine(4, "channel", 16), Affine(8, "channel", 7)])
def test_large_inputs_quantized_sequence_by_sequence_give_the_same_bits(monkeypatch, enc):
    import foldc.encoding as encoding

    x = torch.randn(3, 2, 70, 64, generator=torch.Generator().manual_seed(9))
    whole = quantize(x, enc)
    monkeypatch.setattr(encoding, "_CHUNK_VALUES", 10)  # force the per-sequence path
    chunked = quantize(x, enc)
    for name in ("codes", "scale", "zero"):
        assert torch.equal(getattr(whole, name), getattr(chunked, name)), name


@pytest.mark.parametrize("shape, axis", [((0, 2, 4, 64), "batch"), ((1, 0, 4, 64), "kv_heads"),
                                         ((1, 2, 0, 64), "tokens"), ((1, 2, 4, 0), "head_dim")])
def test_quantize_refuses_an_empty_axis(shape, axis):
    with pytest.raises(InputError, match=rf"x has {axis}=0 \(shape={re.escape(str(shape))}\)"):
        foldc.quantize(torch.randn(shape), foldc.Affine(2, "channel", 32))


@pytest.mark.parametrize("field", ["codes", "scale", "zero"])
def test_affine_tensor_parts_must_be_tensors(field):
    at = foldc.quantize(torch.randn(1, 2, 4, 64), foldc.Affine(2, "token", 32))
    parts = {"codes": at.codes, "scale": at.scale, "zero": at.zero, field: [1]}
    with pytest.raises(InputTypeError, match=rf"{field} must be a torch.Tensor, got list"):
        foldc.AffineTensor(parts["codes"], parts["scale"], parts["zero"], at.encoding, 64)


def test_affine_tensor_token_groups_must_divide_head_dim():
    enc = foldc.Affine(2, "token", 64)
    z = torch.zeros(1, 1, 4, 1, dtype=torch.float16)
    with pytest.raises(SpecError, match=r"group_size=64 does not divide head_dim=96"):
        foldc.AffineTensor(torch.zeros(1, 1, 4, 24, dtype=torch.uint8), z, z, enc, 96)
    with pytest.raises(SpecError, match=r"head_dim=0 must be a positive integer"):
        foldc.AffineTensor(torch.zeros(1, 1, 4, 0, dtype=torch.uint8), z, z, enc, 0)


@settings(max_examples=25, deadline=None)
@given(bits=st.sampled_from(SUPPORTED_BITS), tokens=st.integers(1, 70), extra=st.sampled_from([0, 1, 5, 2**20, None]),
       seed=st.integers(0, 2**31 - 1))
def test_a_channel_group_past_the_tokens_is_one_group_of_them_all(bits, tokens, extra, seed):
    """quantize padded the tokens to a whole group and expanded_params repeated each pair group_size
    times: the largest group over a 40-token cache tried to allocate half a terabyte (RuntimeError
    inside torch). A group at least as long as the tokens is one group of all of them."""
    extra = MAX_GROUP_SIZE - tokens if extra is None else extra
    x = torch.randn(2, 2, tokens, 16, generator=torch.Generator().manual_seed(seed)) * 3 + 1
    big = quantize(x, Affine(bits, "channel", tokens + extra))
    whole = quantize(x, Affine(bits, "channel", tokens))
    assert big.scale.shape == (2, 2, 1, 16)
    assert torch.equal(big.codes, whole.codes) and torch.equal(big.scale, whole.scale)
    assert torch.equal(big.zero, whole.zero) and torch.equal(big.dequantize(), whole.dequantize())
    assert torch.equal(big.zero, x.amin(2, keepdim=True).half())   # the group's minimum over every token


@pytest.mark.parametrize("dtype, exc, match", [
    (torch.int32, InputError, r"dtype=torch.int32 is not a floating-point dtype"),
    (torch.int64, InputError, r"dtype=torch.int64 is not a floating-point dtype"),
    (torch.bool, InputError, r"dtype=torch.bool is not a floating-point dtype"),
    (torch.complex64, InputError, r"dtype=torch.complex64 is not a floating-point dtype"),
    ("float16", InputTypeError, r"dtype='float16' must be a torch.dtype"),
    (None, InputTypeError, r"dtype=None must be a torch.dtype"),
])
@pytest.mark.parametrize("layout", ["token", "channel"])
def test_dequantize_refuses_a_dtype_that_is_not_floating_point(dtype, exc, match, layout):
    """dequantize(torch.int32) truncated every scale, zero and value (scale 0.19 -> 0: every value its group's
    truncated zero, silently); a dtype given as text raised a RuntimeError from torch ("Invalid device string")."""
    x = torch.randn(2, 2, 6, 16, generator=torch.Generator().manual_seed(41)) * 3
    at = quantize(x, Affine(4, layout, 4))
    for call in (at.dequantize, at.expanded_params):
        with pytest.raises(exc, match=match):
            call(dtype)
    for ok in (torch.float16, torch.bfloat16, torch.float32, torch.float64):   # floating dtypes still work
        assert at.dequantize(ok).dtype == ok
        assert torch.allclose(at.dequantize(ok).double(), at.dequantize(torch.float64), rtol=1e-2, atol=1e-1)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("layout", ["token", "channel"])
def test_dequantize_to_16_bits_rounds_once_and_keeps_values_in_range(bits, layout):
    """dequantize(torch.float16) computed scale * code in fp16: a group spanning [-40000, 40000] (every value an
    fp16) has scale * max_code = 80000, inf before zero = -40000 brought it back: inf for its largest values,
    silently. The values are computed in float32 and rounded to the dtype once."""
    gen = torch.Generator().manual_seed(48 + bits)
    x = (torch.rand(2, 2, 8, 16, generator=gen) * 2 - 1) * 40000
    x[:, :, :, 0], x[:, :, 0, :] = 40000, -40000   # each group (of either layout) spans the whole range
    at = quantize(x.half(), Affine(bits, layout, 4))
    wide = at.dequantize(torch.float32)
    assert wide.abs().max() < 65504
    for dtype in (torch.float16, torch.bfloat16):
        got = at.dequantize(dtype)
        assert got.dtype == dtype and torch.isfinite(got).all()
        assert torch.equal(got, wide.to(dtype))


@pytest.mark.parametrize("where", ["meta", "sparse_coo"])
def test_quantize_refuses_x_whose_values_cannot_be_read(where):
    """x on the meta device (a model built with empty weights) raised a RuntimeError from torch's Tensor.item(),
    a sparse x a NotImplementedError from inside torch."""
    x = torch.randn(1, 2, 4, 16, generator=torch.Generator().manual_seed(44))
    bad = x.to("meta") if where == "meta" else x.to_sparse()
    what = "on the meta device" if where == "meta" else "of layout torch.sparse_coo"
    with pytest.raises(InputError, match=rf"x is a tensor {what}, whose values cannot be read; pass a dense "
                                         r"tensor"):
        quantize(bad, Affine(4, "token", 8))
    if where == "sparse_coo":   # the fix the message names: the dense tensor quantizes as x does
        dense, want = quantize(bad.to_dense(), Affine(4, "token", 8)), quantize(x, Affine(4, "token", 8))
        assert torch.equal(dense.codes, want.codes) and torch.equal(dense.scale, want.scale)


@pytest.mark.parametrize("part", ["codes", "scale", "zero"])
def test_affine_tensor_refuses_sparse_parts(part):
    """A sparse part was taken, and dequantize (or attention) raised a NotImplementedError from inside torch."""
    codes, scale, zero, enc = _valid_parts()
    parts = {"codes": codes, "scale": scale, "zero": zero}
    parts[part] = parts[part].to_sparse()
    with pytest.raises(InputError, match=rf"{part} is a tensor of layout torch.sparse_coo; an AffineTensor holds "
                                         rf"dense tensors: pass {part}.to_dense\(\)"):
        AffineTensor(parts["codes"], parts["scale"], parts["zero"], enc, 8)
    parts[part] = parts[part].to_dense()
    assert torch.equal(AffineTensor(parts["codes"], parts["scale"], parts["zero"], enc, 8).dequantize(),
                       AffineTensor(codes, scale, zero, enc, 8).dequantize())


@settings(max_examples=30, deadline=None)
@given(encodings_and_shapes(), st.floats(1.8e38, 3.4e38), st.integers(0, 2**31 - 1), st.data())
def test_a_range_past_float32_names_scaling_the_values_not_float32_scales(es, big, seed, data):
    """Finite values whose group range (max - min) overflows float32, the quantizer's arithmetic: the error told
    to use float32 scales, with float32 scales already (and with 16-bit ones, where they would not help either)."""
    enc, shape = es
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    pos = [data.draw(st.integers(0, s - 1)) for s in shape]
    twin = list(pos)   # a second value of the same group, of the opposite sign
    axis = 3 if enc.layout == "token" else 2
    others = [i for i in range(shape[axis]) if i != pos[axis] and i // enc.group_size == pos[axis] // enc.group_size]
    assume(others)
    twin[axis] = data.draw(st.sampled_from(others))
    x[tuple(pos)], x[tuple(twin)] = big, -big
    with pytest.raises(ScaleOverflowError) as ei:
        quantize(x, enc)
    msg = str(ei.value)
    assert "float32 scales" not in msg and "beyond float32's range" in msg and "scale the values" in msg, msg
    assert quantize(x / 4, Affine(enc.bits, enc.layout, enc.group_size, torch.float32)).scale.isfinite().all()


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_pack_codes_refuses_codes_it_cannot_pack(bits):
    """pack_codes OR-ed a code past 2**bits - 1 (or a negative one, wrapped to 255) into its neighbours' bit fields
    and truncated float codes (silently: unpack_codes gave other codes back); a row of a width that is not a
    multiple of the codes per byte raised a RuntimeError from torch's reshape."""
    gen = torch.Generator().manual_seed(45 + bits)
    k, top = 8 // bits, (1 << bits) - 1
    codes = torch.randint(0, top + 1, (3, 4 * k), generator=gen)
    assert torch.equal(unpack_codes(pack_codes(codes, bits), bits).long(), codes)   # in range: a round trip
    for bad in (top + 1 + int(torch.randint(0, 9, (), generator=gen)), -1):
        wrong = codes.clone()
        wrong[1, 2] = bad
        with pytest.raises(InputError, match=rf"codes span \[{int(wrong.min())}, {int(wrong.max())}\], "
                                             rf"outside 0..{top} \({bits}-bit codes\)"):
            pack_codes(wrong, bits)
    with pytest.raises(InputError, match=r"codes dtype=torch.float32 must be an integer dtype"):
        pack_codes(codes.float() + 0.4, bits)
    if k > 1:
        with pytest.raises(InputError, match=rf"codes last dim {4 * k + 1} is not a multiple of {k}"):
            pack_codes(torch.cat([codes, codes[:, :1]], dim=1), bits)


@pytest.mark.parametrize("bits", [0, 1, 3, 5, 16, True])
def test_pack_and_unpack_codes_refuse_unsupported_bits(bits):
    """bits=3 packed two 3-bit fields a byte and unpacked them with a 3-bit mask: other codes back, silently."""
    codes = torch.randint(0, 2, (2, 8), generator=torch.Generator().manual_seed(46))
    for call in (lambda: pack_codes(codes, bits), lambda: unpack_codes(codes.to(torch.uint8), bits)):
        with pytest.raises(SpecError, match=rf"bits={bits!r} is not supported; use one of \(2, 4, 8\)"):
            call()


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_unpack_codes_refuses_what_is_not_bytes_of_packed_codes(bits):
    """unpack_codes of a bool tensor gave codes of its True/False (garbage, silently), of GPTQ-style int32 words
    the codes of each word's low byte alone (the other 24 bits dropped, silently), and of a float tensor a
    NotImplementedError from inside torch. Bytes held in any integer dtype (0..255, or int8's bits) still unpack."""
    gen = torch.Generator().manual_seed(47 + bits)
    codes = torch.randint(0, 1 << bits, (3, 4 * (8 // bits)), generator=gen)
    packed = pack_codes(codes, bits)
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        assert torch.equal(unpack_codes(packed.to(dtype) if dtype != torch.int8 else packed.view(torch.int8),
                                        bits).long() & 0xFF, codes)
    for bad in (packed.bool(), packed.float(), packed.to(torch.float16)):
        with pytest.raises(InputError, match=rf"packed dtype={bad.dtype}: unpack_codes reads bytes of packed codes"):
            unpack_codes(bad, bits)
    words = packed.to(torch.int32) | (1 << 20)
    with pytest.raises(InputError, match=r"packed dtype=torch.int32 holds values in \[\d+, \d+\], outside a byte's "
                                         r"0..255.*foldc.gemm.convert"):
        unpack_codes(words, bits)
    with pytest.raises(InputTypeError, match=r"packed must be a torch.Tensor"):
        unpack_codes(packed.tolist(), bits)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_pack_and_unpack_codes_refuse_what_holds_no_rows(bits):
    """pack_codes of a list raised AttributeError, of a 0-d tensor IndexError, of a sparse tensor a
    NotImplementedError from inside torch; unpack_codes of a 0-d or sparse tensor a RuntimeError or
    NotImplementedError from inside torch; pack_codes of meta codes a NotImplementedError from .tolist().
    Each is refused by name now; meta codes pack to meta bytes (there are no values to check)."""
    gen = torch.Generator().manual_seed(49 + bits)
    codes = torch.randint(0, 1 << bits, (3, 4 * (8 // bits)), generator=gen).to(torch.uint8)
    packed = pack_codes(codes, bits)
    with pytest.raises(InputTypeError, match=r"codes must be a torch.Tensor of integer codes.*got list"):
        pack_codes(codes.tolist(), bits)
    for name, call, t in (("codes", pack_codes, codes), ("packed", unpack_codes, packed)):
        with pytest.raises(InputError, match=rf"{name} is a 0-d tensor; codes are packed along the last dim"):
            call(t[0, 0], bits)
        with pytest.raises(InputError, match=rf"{name} is a tensor of layout torch.sparse_coo; pass "
                                             rf"{name}.to_dense\(\)"):
            call(t.to_sparse(), bits)
    assert torch.equal(unpack_codes(pack_codes(codes[0, :8 // bits], bits), bits), codes[0, :8 // bits])
    meta = pack_codes(codes.to("meta"), bits)
    assert meta.is_meta and meta.shape == packed.shape and meta.dtype == torch.uint8


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.uint8])
def test_affine_tensor_to_a_dtype_names_dequantize_not_the_codes(dtype):
    """``AffineTensor.to(torch.float16)`` cast the codes and was refused as "codes must be uint8", blaming codes the
    caller never touched. It names what .to does (devices) and the calls that give other dtypes; .to(device) still
    moves every part."""
    x = foldc.quantize(torch.randn(1, 2, 8, 32, generator=torch.Generator().manual_seed(3)), Affine(4, "token", 16))
    with pytest.raises(InputTypeError, match=r"moves devices only.*dequantize"):
        x.to(dtype)
    moved = x.to("cpu")
    assert torch.equal(moved.dequantize(), x.dequantize())


@settings(max_examples=20, deadline=None)
@given(dtype=st.sampled_from([torch.uint16, torch.uint32, torch.uint64]), bits=st.sampled_from([2, 4, 8]),
       rows=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_codes_and_bytes_in_wide_unsigned_dtypes_pack_and_unpack(dtype, bits, rows, seed):
    """pack_codes / unpack_codes of uint16, uint32 or uint64 tensors raised NotImplementedError from inside torch
    (no aminmax, no shifts for them). Their values are read as int64: they pack to the uint8 bytes their int64 twins
    pack to, unpack to codes in their own dtype, and a value out of range is refused naming the given dtype."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, 32), generator=gen)
    packed = pack_codes(codes.to(dtype), bits)
    assert packed.dtype == torch.uint8 and torch.equal(packed, pack_codes(codes, bits))
    back = unpack_codes(packed.to(dtype), bits)
    assert back.dtype == dtype and torch.equal(back.to(torch.int64), codes)
    with pytest.raises(InputError, match=rf"outside 0..{(1 << bits) - 1}"):
        pack_codes((codes + (1 << bits)).to(dtype), bits)
    with pytest.raises(InputError, match=rf"packed dtype={dtype} holds values in \[.*, 300\]"):
        unpack_codes(torch.cat([packed.to(torch.int64), torch.full((rows, 1), 300)], -1).to(dtype), bits)
