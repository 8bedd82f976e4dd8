"""Converters from other tools' weight formats (foldc/gemm/convert.py). The tensors are built the way
those tools build them, by packers written here from the formats' definitions (not by foldc's own
unpacking): GPTQ's int32 words along k with zeros stored minus one, AWQ's interleaved words along n,
HQQ's fractional zeros, tinygemm's codes minus 8. Each converted weight must dequantize to exactly the
format's own float64 dequantization, and the GEMM plan over it must give x @ W.T in float64."""
from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import foldc
from foldc.errors import InputError
from foldc.gemm import GemmSpec
from foldc.gemm.convert import AWQ_ORDER, from_awq, from_gptq, from_gptq_act_order, from_hqq, from_int4pack
from foldc.gemm.reference import gemm_reference

from _formats import asymmetric_codes, pack_along  # noqa: E402  (tests/_formats.py)


def _dequant(codes, scale, zero, group):
    """float64 scale * (code - zero), the formats' shared definition."""
    s = scale.to(torch.float64).repeat_interleave(group, 1)
    return s * (codes.to(torch.float64) - zero.to(torch.float64).repeat_interleave(group, 1))


def _check(weight, enc, want, seed):
    assert enc.kind == "k-group" and enc.scale_dtype == torch.float32
    assert torch.equal(weight.dequantize(torch.float64)[0, 0], want)
    n, k = want.shape
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(seed)).half()
    y = foldc.compile(GemmSpec(n, k, weight=enc), target="reference")(x, weight)
    assert torch.allclose(y, x.double() @ want.T, rtol=0, atol=1e-9 * float(want.abs().max()) * k)
    assert torch.allclose(y, gemm_reference(x, weight), rtol=0, atol=1e-12 * float(y.abs().max() + 1))


shapes = st.tuples(st.sampled_from([16, 32, 48]), st.sampled_from([1, 2, 4]), st.sampled_from([32, 64, 128]))


@settings(max_examples=25, deadline=None)
@given(shape=shapes, bits=st.sampled_from([2, 4, 8]), v2=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_gptq_layers_convert_exactly(shape, bits, v2, seed):
    n, groups, group = shape
    k = groups * group
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    codes, scale, zero = asymmetric_codes(w, bits, group)
    qweight = pack_along(codes.T, bits, 0)                        # [k / per, n]: along k
    stored = zero if v2 else zero - 1                               # v1 checkpoints store zero - 1
    qzeros = pack_along(stored.T % (2**bits), bits, 1)            # [groups, n / per]: along n (-1 wraps)
    g_idx = torch.arange(k, dtype=torch.int32) // group
    weight, enc = from_gptq(qweight, qzeros, scale.T.contiguous(), g_idx, bits=bits, group_size=group,
                            zero_offset=0 if v2 else 1)
    # a zero of 0 is stored as -1, all ones in its field (wrapped here field by field): the format reads the zero
    # back as (stored + 1) mod 2^bits, the zero itself (AutoGPTQ's kernels: `(z + 1) & 0x0f`)
    _check(weight, enc, _dequant(codes, scale, zero, group), seed)


def _act_order_layer(n: int, k: int, group: int, bits: int, gen: torch.Generator):
    """A GPTQ layer quantized with act-order as AutoGPTQ makes one (desc_act): the columns taken in a permuted
    order, groups of ``group`` consecutive permuted columns quantized together, the codes packed back in the
    layer's own channel order and ``g_idx[c]`` the group of channel c. (qweight, qzeros (v2: zeros as they are),
    scales [groups, n], g_idx int32 [k], the float64 weight W [n, k] the format dequantizes to)."""
    w = torch.randn(n, k, generator=gen) * 0.05
    perm = torch.randperm(k, generator=gen)
    codes_p, scale, zero = asymmetric_codes(w[:, perm], bits, group)   # groups over the permuted columns
    inverse = torch.argsort(perm)
    codes = codes_p[:, inverse]                                    # back in channel order
    g_idx = (torch.arange(k) // group)[inverse]
    want = scale.double()[:, g_idx] * (codes.double() - zero.double()[:, g_idx])
    return (pack_along(codes.T, bits, 0), pack_along(zero.T, bits, 1), scale.T.contiguous(), g_idx.to(torch.int32),
            want)


@settings(max_examples=20, deadline=None)
@given(shape=shapes, bits=st.sampled_from([2, 4, 8]), seed=st.integers(0, 2**31 - 1))
def test_act_order_gptq_layers_convert_to_a_weight_and_its_input_order(shape, bits, seed):
    """from_gptq refuses an act-order layer naming from_gptq_act_order; that returns the weight with each group's
    channels together and the input order: weight == W[:, order] exactly, and FoldLinear with that order gives
    x @ W.T over the layer's own channel order (float64 executor)."""
    from foldc.nn import FoldLinear

    n, groups, group = shape
    k = groups * group
    gen = torch.Generator().manual_seed(seed)
    qweight, qzeros, scales, g_idx, want = _act_order_layer(n, k, group, bits, gen)
    if groups > 1 and not torch.equal(g_idx.long(), torch.arange(k) // group):
        with pytest.raises(InputError, match="from_gptq_act_order"):
            from_gptq(qweight, qzeros, scales, g_idx, bits=bits, group_size=group, zero_offset=0)
    weight, enc, order = from_gptq_act_order(qweight, qzeros, scales, g_idx, bits=bits, group_size=group,
                                             zero_offset=0)
    assert order.dtype == torch.int64 and torch.equal(g_idx[order].long(), torch.arange(k) // group)
    assert torch.equal(weight.dequantize(torch.float64)[0, 0], want[:, order])
    layer = FoldLinear(weight, enc, input_order=order)
    x = torch.randn(3, k, generator=gen)
    y = layer(x)
    ref = x.double() @ want.T
    assert float((y.double() - ref).abs().max()) <= 1e-6 * float(ref.abs().max() + 1)


def test_act_order_g_idx_must_name_each_group_for_group_size_channels():
    gen = torch.Generator().manual_seed(11)
    qweight, qzeros, scales, g_idx, _ = _act_order_layer(16, 256, 64, 4, gen)
    uneven = g_idx.clone()
    uneven[int((g_idx == 0).nonzero()[0])] = 1                       # group 0 one short, group 1 one over
    for bad, match in ((uneven, "names group 0 for 63"), (g_idx.float(), "integer group indices"),
                       (g_idx[:-1], "k=256"), (g_idx + 1, "outside the layer's 4 groups")):
        with pytest.raises(InputError, match=match):
            from_gptq_act_order(qweight, qzeros, scales, bad, group_size=64, zero_offset=0)
    in_order = torch.arange(256, dtype=torch.int32) // 64
    _, _, order = from_gptq_act_order(qweight, qzeros, scales, in_order, group_size=64, zero_offset=0)
    assert torch.equal(order, torch.arange(256))


@settings(max_examples=20, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_awq_layers_convert_exactly(shape, seed):
    n, groups, group = shape
    k = groups * group
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    codes, scale, zero = asymmetric_codes(w, 4, group)
    qweight = pack_along(codes.T, 4, 1, AWQ_ORDER)                # [k, n / 8], interleaved along n
    qzeros = pack_along(zero.T, 4, 1, AWQ_ORDER)                  # [groups, n / 8]
    weight, enc = from_awq(qweight, qzeros, scale.T.contiguous(), group_size=group)
    _check(weight, enc, _dequant(codes, scale, zero, group), seed)


@settings(max_examples=20, deadline=None)
@given(shape=shapes, bits=st.sampled_from([2, 4, 8]), seed=st.integers(0, 2**31 - 1))
def test_hqq_weights_with_fractional_zeros_convert_exactly(shape, bits, seed):
    n, groups, group = shape
    k = groups * group
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n * k // group, group), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n * k // group, 1, generator=gen) * 0.02 + 1e-3).half()
    zero = (torch.rand(n * k // group, 1, generator=gen) * (2**bits - 1)).half()   # fractional, as HQQ's are
    weight, enc = from_hqq(codes, scale, zero, shape=(n, k), group_size=group, bits=bits)
    want = ((codes.to(torch.float64) - zero.to(torch.float64)) * scale.to(torch.float64)).reshape(n, k)
    _check(weight, enc, want, seed)


@settings(max_examples=20, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_tinygemm_int4_converts_exactly(shape, seed):
    n, groups, group = shape
    k = groups * group
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    g = w.reshape(n, groups, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    zero = lo + 8 * scale                                           # the mid-point zero tinygemm stores
    codes = torch.clamp(torch.round((g - lo[..., None]) / scale[..., None]), 0, 15).reshape(n, k).to(torch.int32)
    sz = torch.stack([scale.T, zero.T], -1).to(torch.bfloat16)     # [groups, n, 2]
    s = sz[..., 0].T.to(torch.float64).repeat_interleave(group, 1)
    z = sz[..., 1].T.to(torch.float64).repeat_interleave(group, 1)
    try:
        weight, enc = from_int4pack(codes, sz, group_size=group)
    except InputError as e:   # zero - 8 x scale not exact in float32: said, with the position
        assert "does not survive float32" in str(e)
    else:
        _check(weight, enc, (codes - 8).to(torch.float64) * s + z, seed)


def test_bad_layers_are_refused_with_the_reason():
    codes, scale, zero = asymmetric_codes(torch.randn(16, 128) * 0.05, 4, 64)
    qweight, qzeros = pack_along(codes.T, 4, 0), pack_along(zero.T, 4, 1)
    with pytest.raises(InputError, match="act-order.*from_gptq_act_order"):
        shuffled = (torch.arange(128) // 64).flip(0).to(torch.int32)
        from_gptq(qweight, qzeros, scale.T.contiguous(), shuffled, group_size=64)
    with pytest.raises(InputError, match="qzeros shape"):
        from_gptq(qweight, qzeros[:, :1], scale.T.contiguous(), group_size=64)
    with pytest.raises(InputError, match="int32"):
        from_awq(qweight.to(torch.int64), qzeros, scale.T.contiguous(), group_size=64)
    with pytest.raises(InputError, match="outside 0..15"):
        from_int4pack(torch.full((16, 128), 16), torch.ones(2, 16, 2), group_size=64)
    with pytest.raises(InputError, match="not a multiple of group_size"):
        from_hqq(torch.zeros(16 * 96, dtype=torch.uint8), torch.ones(16), torch.ones(16), shape=(16, 96), group_size=64)
    with pytest.raises(foldc.SpecError, match="bit field"):   # a layout the GEMM plan cannot take, said at conversion
        from_hqq(torch.zeros(16 * 96, dtype=torch.uint8), torch.ones(48), torch.ones(48), shape=(16, 96), group_size=32)


@pytest.mark.parametrize("call, match", [
    (lambda q, z, s: from_gptq(q, z, s, group_size=0), "group_size=0 must be a positive integer"),
    (lambda q, z, s: from_gptq(q, z, s, group_size=64.0), "group_size=64.0 must be a positive integer"),
    (lambda q, z, s: from_gptq(q.flatten(), z, s, group_size=64), r"qweight shape=\(256,\): the packed format"),
    (lambda q, z, s: from_awq(q.flatten(), z, s, group_size=64), r"qweight shape=\(256,\): the packed format"),
    (lambda q, z, s: from_gptq(q[:, :12], z[:, :1], s[:, :12], group_size=64), "n=12 output channels is not a "
     "multiple of 8"),
    (lambda q, z, s: from_gptq(q[:0], z, s, group_size=64), r"the weight is 16 x 0"),
    (lambda q, z, s: from_hqq(torch.ones(2048), torch.ones(32), torch.ones(32), shape=(2048,), group_size=64),
     r"shape=\(2048,\) must be the weight's \(n, k\)"),
    (lambda q, z, s: from_hqq(torch.ones(0), torch.ones(0), torch.ones(0), shape=(0, 128), group_size=64),
     "the weight is 0 x 128"),
    (lambda q, z, s: from_int4pack(torch.full((16, 128), float("nan")), torch.ones(2, 16, 2), group_size=64),
     "codes holds nan"),
    (lambda q, z, s: from_int4pack(torch.ones(16, 128), torch.ones(2, 16, 2), group_size=0),
     "group_size=0 must be a positive integer"),
])
def test_inconsistent_tensors_are_refused_by_name(call, match):
    """What the tools never write (empty layers, zero groups, 1-D words, zeros that do not fill their words, NaN
    codes) is an InputError naming the value, not an error from inside torch."""
    codes, scale, zero = asymmetric_codes(torch.randn(16, 128) * 0.05, 4, 64)
    with pytest.raises(InputError, match=match):
        call(pack_along(codes.T, 4, 0), pack_along(zero.T, 4, 1), scale.T.contiguous())


@settings(max_examples=20, deadline=None)
@given(fmt=st.sampled_from(["hqq", "int4pack"]), where=st.tuples(st.integers(0, 15), st.integers(0, 127)),
       frac=st.floats(0.01, 0.99), seed=st.integers(0, 2**31 - 1))
def test_a_fractional_code_is_refused_not_truncated(fmt, where, frac, seed):
    """One float code of c + frac among integer codes: refused (truncating it to c passed the check before)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 15, (16, 128), generator=gen).float()
    codes[where] += frac
    with pytest.raises(InputError, match="non-integer codes"):
        if fmt == "hqq":
            from_hqq(codes, torch.rand(32, generator=gen) + 0.1, torch.rand(32, generator=gen), shape=(16, 128),
                     group_size=64)
        else:
            from_int4pack(codes, torch.rand(2, 16, 2, generator=gen) + 0.1, group_size=64)


def _converted(fmt: str, gen: torch.Generator, n: int, k: int, group: int):
    """One weight in ``fmt``'s own tensors, converted: (AffineTensor, encoding)."""
    w = torch.randn(n, k, generator=gen) * 0.05
    codes, scale, zero = asymmetric_codes(w, 4, group)
    if fmt == "gptq":
        return from_gptq(pack_along(codes.T, 4, 0), pack_along(zero.T % 16, 4, 1), scale.T.contiguous(),
                         bits=4, group_size=group, zero_offset=0)
    if fmt == "awq":
        return from_awq(pack_along(codes.T, 4, 1, AWQ_ORDER), pack_along(zero.T, 4, 1, AWQ_ORDER),
                        scale.T.contiguous(), group_size=group)
    if fmt == "hqq":
        flat = codes.reshape(n * k // group, group).to(torch.uint8)
        return from_hqq(flat, scale.reshape(-1, 1), zero.reshape(-1, 1).half(), shape=(n, k), group_size=group)
    sz = torch.stack([scale.T.float(), (scale.float() * (8 - zero)).T], -1)   # tinygemm's [groups, n, 2]
    return from_int4pack(codes.to(torch.int32), sz, group_size=group)


@pytest.mark.parametrize("fmt", ["gptq", "awq", "hqq", "int4pack"])
def test_converted_weights_run_on_the_kernels(fmt):
    # the formats store scales [groups, n]; a converted weight must come out in the layout the kernels read
    # (column-major scales once gave the Triton kernels 30-54% errors, silently)
    seed = int(torch.randint(0, 2**31 - 1, ()))
    gen = torch.Generator().manual_seed(seed)
    n, k, group = 40, 256, 32
    weight, enc = _converted(fmt, gen, n, k, group)
    kern = foldc.compile(GemmSpec(n, k, weight=enc), target="interpret")
    for m in (3, 40):   # the generated kernel's fold, then the large-m template's dequant verdict (eq. 16)
        x = torch.randn(m, k, generator=gen).half()
        ref = gemm_reference(x, weight)
        plain = (x.float() @ weight.dequantize(torch.float16)[0, 0].float().T).half()
        bar = float((plain.double() - ref).norm() / ref.norm())
        err = float((kern(x, weight).double() - ref).norm() / ref.norm())
        assert err <= 2 * bar + 1e-6, (fmt, seed, m, kern.plan_launch(torch.float16, m, 2).template, err, bar)


@pytest.mark.parametrize("offset", [-1, 2, 0.5, True, None, "1"])
def test_a_zero_offset_other_than_0_or_1_is_refused(offset):
    """GPTQ's zeros are stored minus one (v1, zero_offset=1) or as they are (v2, 0). "Stored minus one" read as
    zero_offset=-1 shifted every zero by two, silently; 0.5 made fractional zeros, None a TypeError inside torch."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    codes, scale, zero = asymmetric_codes(torch.randn(16, 128, generator=gen) * 0.05, 4, 64)
    args = (pack_along(codes.T, 4, 0), pack_along(zero.T, 4, 1), scale.T.contiguous())
    for convert in (from_gptq, lambda *a, **kw: from_gptq_act_order(*a, torch.arange(128) // 64, **kw)):
        with pytest.raises(InputError, match=f"zero_offset={offset!r} must be 1 .* or 0"):
            convert(*args, group_size=64, zero_offset=offset)


def _symmetric_codes(w: torch.Tensor, bits: int, group: int):
    """GPTQ's symmetric quantizer (sym=True, its default): scale max|w| / (2^(bits-1) - 1/2) per group, every zero
    2^(bits-1). (codes [n, k], scales [n, groups] fp16, zeros [n, groups] int)."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    half = 2 ** (bits - 1)
    scale = (2 * g.abs().amax(-1) / (2**bits - 1)).clamp(min=1e-5).half()
    zero = torch.full((n, k // group), half, dtype=torch.int64)
    codes = torch.clamp(torch.round(g / scale.float()[..., None]) + half, 0, 2**bits - 1)
    return codes.reshape(n, k).to(torch.int64), scale, zero


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("saved_v2", [False, True])
def test_a_symmetric_gptq_layer_read_with_the_other_formats_zero_offset_is_refused(bits, saved_v2):
    """A symmetric GPTQ layer (sym=True, GPTQ's default) has every zero 2^(bits-1): stored minus one in v1
    checkpoints, as it is in v2 (GPTQModel's checkpoint_format='gptq_v2'). Read with the other format's
    zero_offset, every zero came out one off (2^(bits-1) + 1 or - 1) and every weight one scale step off, silently
    (the check against the format's dequantization read the same zeros). A layer whose zeros all read one off the
    symmetric zero is refused, naming the zero_offset that reads it; with it the layer converts exactly."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    n, k, group = 32, 256, 64
    codes, scale, zero = _symmetric_codes(torch.randn(n, k, generator=gen) * 0.05, bits, group)
    stored = zero if saved_v2 else zero - 1
    args = (pack_along(codes.T, bits, 0), pack_along(stored.T % 2**bits, bits, 1), scale.T.contiguous())
    right, wrong = (0, 1) if saved_v2 else (1, 0)
    read = 2 ** (bits - 1) + (1 if wrong == 1 else -1)
    for convert in (from_gptq, lambda *a, **kw: from_gptq_act_order(*a, torch.arange(k) // group, **kw)):
        with pytest.raises(InputError, match=rf"every zero .* reads as {read} with zero_offset={wrong}.*"
                                             rf"zero_offset={right}"):
            convert(*args, bits=bits, group_size=group, zero_offset=wrong)
        weight, enc = convert(*args, bits=bits, group_size=group, zero_offset=right)[:2]
        _check(weight, enc, _dequant(codes, scale, zero, group), 0)


def test_bits_that_are_no_integer_are_refused_by_name():
    """bits=4.0 (a float from a parsed config) passed the check (4.0 in (2, 4, 8)) and raised a TypeError inside
    the unpacking ('<<' of an int and a float)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    codes, scale, zero = asymmetric_codes(torch.randn(16, 128, generator=gen) * 0.05, 4, 64)
    calls = [lambda b: from_gptq(pack_along(codes.T, 4, 0), pack_along(zero.T, 4, 1), scale.T.contiguous(), bits=b,
                                 group_size=64, zero_offset=0),
             lambda b: from_awq(pack_along(codes.T, 4, 1, AWQ_ORDER), pack_along(zero.T, 4, 1, AWQ_ORDER),
                                scale.T.contiguous(), bits=b, group_size=64),
             lambda b: from_hqq(codes, scale, zero.half(), shape=(16, 128), group_size=64, bits=b)]
    for call in calls:
        with pytest.raises(InputError, match=r"bits=4\.0: foldc packs"):
            call(4.0)


def _hqq_axis0(w: torch.Tensor, bits: int, group: int):
    """HQQ's axis=0 quantization (its Quantizer with axis=0): the weight reshaped to [group, n * k / group], each
    column a group (values n * k / group apart in the row-major weight), scale and zero [1, n * k / group]."""
    wg = w.reshape(group, -1)
    lo, hi = wg.amin(0, keepdim=True), wg.amax(0, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).half()
    zero = (-lo / scale.float()).half()
    codes = torch.clamp(torch.round(wg / scale.float() + zero.float()), 0, 2**bits - 1).to(torch.uint8)
    return codes, scale, zero


@pytest.mark.parametrize("flat", [False, True])
def test_hqq_axis_0_tensors_are_refused_not_regrouped(flat):
    """HQQ's axis=0 layout groups values that lie n * k / group apart (across output channels): read as groups of
    consecutive weights of a row it converted, and the check against the same misreading passed; the weight was
    wrong everywhere. Its shapes ([group, N] codes, [1, N] scales) are refused now, naming axis=1."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    n, k, group = 32, 128, 64
    codes, scale, zero = _hqq_axis0(torch.randn(n, k, generator=gen) * 0.05, 4, group)
    if flat:   # codes flattened by the caller: the scales' [1, N] still tell
        codes = codes.reshape(-1)
    with pytest.raises(InputError, match="axis=0.*axis=1"):
        from_hqq(codes, scale, zero, shape=(n, k), group_size=group, bits=4)


@settings(max_examples=12, deadline=None)
@given(shape=shapes, which=st.sampled_from(["W_q", "scale", "zero"]), seed=st.integers(0, 2**31 - 1))
def test_hqq_tensors_shaped_as_the_weights_transpose_are_refused(shape, which, seed):
    """Codes [k, n] or scales and zeros [k / group_size, n] (groups first, as GPTQ stores its scales) were read
    row-major as [n, k]: a wrong weight, and the check against the same reading passed. Refused now, naming
    the tensor and .T; the tensors as HQQ shapes them convert exactly."""
    n, groups, group = shape
    k = groups * group
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, groups, generator=gen) * 0.02 + 1e-3).half()
    zero = (torch.rand(n, groups, generator=gen) * 15).half()
    tensors = {"W_q": codes, "scale": scale, "zero": zero}
    flipped = dict(tensors, **{which: tensors[which].T})
    # not also a shape HQQ's own tensors take (n == k, n == group_size, ...): there the shapes cannot tell
    assume(tuple(flipped[which].shape) not in ((n * groups, group), (n, k), (n, groups), (n * groups, 1)))
    # (where k or k / group_size is one layer-wide group, the transpose is also HQQ's axis=0 shape: refused as that)
    with pytest.raises(InputError, match=rf"^{which} shape=.* is \[k.*, n\], the weight's layout transposed.*"
                                         rf"pass {which}\.T|axis=0"):
        from_hqq(flipped["W_q"], flipped["scale"], flipped["zero"], shape=(n, k), group_size=group)
    weight, enc = from_hqq(codes, scale, zero, shape=(n, k), group_size=group)
    _check(weight, enc, _dequant(codes, scale, zero, group), seed)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.bool, torch.complex64])
def test_scales_and_zeros_that_are_not_floating_point_are_refused(dtype):
    """HQQ with quant_zero / quant_scale stores the zero (scale) as 8-bit codes of its own: passed as they are, the
    codes were taken for the zero itself (a wrong weight, silently), as were integer or bool GPTQ/AWQ scales;
    complex ones lost their imaginary part with a warning."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    codes, scale, zero = asymmetric_codes(torch.randn(16, 128, generator=gen) * 0.05, 4, 64)
    as_dtype = lambda t: (t.float() * 100).to(dtype)   # noqa: E731
    with pytest.raises(InputError, match=f"zero dtype={dtype}.*quant_zero"):
        from_hqq(codes, scale, as_dtype(zero), shape=(16, 128), group_size=64)
    with pytest.raises(InputError, match=f"scale dtype={dtype}.*quant_scale"):
        from_hqq(codes, as_dtype(scale), zero.half(), shape=(16, 128), group_size=64)
    with pytest.raises(InputError, match=f"scales dtype={dtype}"):
        from_gptq(pack_along(codes.T, 4, 0), pack_along(zero.T, 4, 1), as_dtype(scale.T), group_size=64)
    with pytest.raises(InputError, match=f"scales dtype={dtype}"):
        from_awq(pack_along(codes.T, 4, 1, AWQ_ORDER), pack_along(zero.T, 4, 1, AWQ_ORDER), as_dtype(scale.T),
                 group_size=64)
    with pytest.raises(InputError, match=f"scales_and_zeros dtype={dtype}"):
        from_int4pack(codes, as_dtype(torch.stack([scale.T, scale.T], -1)), group_size=64)


def test_an_infinite_scale_is_named_not_blamed_on_float32():
    """One inf among a GPTQ layer's scales (a corrupt checkpoint): the converter said "its scale or zero does not
    survive float32", which points at precision; it names the infinite scale, its row and group now."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    codes, scale, zero = asymmetric_codes(torch.randn(16, 128, generator=gen) * 0.05, 4, 64)
    scales = scale.T.contiguous()
    scales[1, 5] = float("inf")
    with pytest.raises(InputError, match=r"row 5, group 1.*scale=inf"):
        from_gptq(pack_along(codes.T, 4, 0), pack_along(zero.T, 4, 1), scales, group_size=64, zero_offset=0)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_without_groups_converts_from_group_size_minus_1(act_order):
    """GPTQ's quantize_config says group_size=-1 for one group per row (the whole k): refused as "must be a positive
    integer", which no value of one layer's k fixes for a whole model (load_quantized takes one group_size)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    n, k, bits = 16, 128, 4
    codes, scale, zero = asymmetric_codes(torch.randn(n, k, generator=gen) * 0.05, bits, k)
    args = (pack_along(codes.T, bits, 0), pack_along(zero.T, bits, 1), scale.T.contiguous())
    g_idx = torch.zeros(k, dtype=torch.int32)
    if act_order:
        weight, enc, order = from_gptq_act_order(*args, g_idx, bits=bits, group_size=-1, zero_offset=0)
        assert torch.equal(order, torch.arange(k))
    else:
        weight, enc = from_gptq(*args, g_idx, bits=bits, group_size=-1, zero_offset=0)
    assert enc.group_size == k
    _check(weight, enc, _dequant(codes, scale, zero, k), 0)


def _format_tensors(fmt: str, gen: torch.Generator) -> dict:
    """One 16 x 128 layer (groups of 64) in ``fmt``'s own tensors, by name (the converter's arguments)."""
    codes, scale, zero = asymmetric_codes(torch.randn(16, 128, generator=gen) * 0.05, 4, 64)
    if fmt in ("gptq", "gptq_act_order"):
        tensors = {"qweight": pack_along(codes.T, 4, 0), "qzeros": pack_along(zero.T, 4, 1),
                   "scales": scale.T.contiguous()}
        return dict(tensors, g_idx=(torch.arange(128) // 64)[torch.randperm(128, generator=gen)]) \
            if fmt == "gptq_act_order" else tensors
    if fmt == "awq":
        return {"qweight": pack_along(codes.T, 4, 1, AWQ_ORDER), "qzeros": pack_along(zero.T, 4, 1, AWQ_ORDER),
                "scales": scale.T.contiguous()}
    if fmt == "hqq":
        return {"W_q": codes.to(torch.uint8), "scale": scale, "zero": zero.half()}
    return {"codes": codes.to(torch.int32), "scales_and_zeros": torch.stack([scale.T.float(),
                                                                             (scale.float() * (8 - zero)).T], -1)}


_CONVERTERS = {
    "gptq": lambda t: from_gptq(t["qweight"], t["qzeros"], t["scales"], group_size=64),
    "gptq_act_order": lambda t: from_gptq_act_order(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], group_size=64),
    "awq": lambda t: from_awq(t["qweight"], t["qzeros"], t["scales"], group_size=64),
    "hqq": lambda t: from_hqq(t["W_q"], t["scale"], t["zero"], shape=(16, 128), group_size=64),
    "int4pack": lambda t: from_int4pack(t["codes"], t["scales_and_zeros"], group_size=64),
}


@pytest.mark.parametrize("fmt, name", [(fmt, name) for fmt in _CONVERTERS
                                       for name in _format_tensors(fmt, torch.Generator())])
def test_a_tensor_on_the_meta_device_is_refused_by_name(fmt, name):
    """A layer's tensor on the meta device (a checkpoint loaded without memory) raised a RuntimeError from inside
    torch ("Tensor.item() cannot be called on meta tensors", "not on the expected device"); an InputError naming
    it now. The same tensors on one real device convert."""
    tensors = _format_tensors(fmt, torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()))))
    _CONVERTERS[fmt](tensors)
    with pytest.raises(InputError, match=rf"^{name} is on the meta device"):
        _CONVERTERS[fmt](dict(tensors, **{name: tensors[name].to("meta")}))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device (a CUDA GPU)")
@pytest.mark.parametrize("fmt", list(_CONVERTERS))
def test_tensors_on_two_devices_are_refused_by_name(fmt):
    """A layer's tensors split between the GPU and the CPU raised torch's "Expected all tensors to be on the same
    device" from inside the unpacking; an InputError naming the tensor and both devices now."""
    tensors = _format_tensors(fmt, torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()))))
    first, *rest = (name for name in tensors if name != "g_idx")
    with pytest.raises(InputError, match=rf"^{rest[-1]} is on cuda:0 but {first} is on cpu"):
        _CONVERTERS[fmt](dict(tensors, **{rest[-1]: tensors[rest[-1]].cuda()}))


@settings(max_examples=10, deadline=None)
@given(n=st.sampled_from([16, 32]), groups=st.sampled_from([1, 2, 4]), group=st.sampled_from([32, 64, 128]),
       seed=st.integers(0, 2**31 - 1))
def test_int4pack_codes_packed_two_a_byte_are_refused_naming_the_packing(n, groups, group, seed):
    """torch._convert_weight_to_int4pack takes the codes packed two a byte (uint8 [n, k / 2]) on the GPU: given those
    with the layer's scales_and_zeros, from_int4pack took k / 2 for k and refused the right scales ("scales_and_zeros
    must be [1, n, 2]") or the group ("k=64 is not a multiple of group_size=128"), naming neither the codes nor the
    fix."""
    k = groups * group
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    packed = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)              # [n, k / 2], two codes a byte
    sz = torch.stack([torch.rand(groups, n, generator=gen) * 0.1 + 1e-3, torch.randn(groups, n, generator=gen)],
                     -1).to(torch.bfloat16)
    with pytest.raises(InputError, match=rf"codes \[{n}, {k // 2}\] .*two codes a byte.*\[{n}, {k}\] codes"):
        from_int4pack(packed, sz, group_size=group)
    try:   # the unpacked codes convert (or, where zero - 8 x scale is not exact in float32, say so)
        from_int4pack(codes, sz, group_size=group)
    except InputError as e:
        assert "does not survive float32" in str(e)


def test_awq_without_groups_converts_from_group_size_minus_1():
    """AutoAWQ's quant_config says q_group_size=-1 for one group per row (WQLinear_GEMM reads it as in_features):
    from_awq refused it as "must be a positive integer", which no value of one layer's k fixes for a whole model
    (load_quantized takes one group_size)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    n, k = 16, 128
    codes, scale, zero = asymmetric_codes(torch.randn(n, k, generator=gen) * 0.05, 4, k)
    weight, enc = from_awq(pack_along(codes.T, 4, 1, AWQ_ORDER), pack_along(zero.T, 4, 1, AWQ_ORDER),
                           scale.T.contiguous(), group_size=-1)
    assert enc.group_size == k
    _check(weight, enc, _dequant(codes, scale, zero, k), 0)
    with pytest.raises(InputError, match="group_size=-2 must be a positive integer"):
        from_awq(pack_along(codes.T, 4, 1, AWQ_ORDER), pack_along(zero.T, 4, 1, AWQ_ORDER), scale.T.contiguous(),
                 group_size=-2)


@settings(max_examples=10, deadline=None)
@given(k=st.sampled_from([32, 64, 96]), group=st.sampled_from([128, 256]), bits=st.sampled_from([2, 4, 8]),
       act_order=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_a_gptq_layer_narrower_than_its_group_is_one_group_per_row(k, group, bits, act_order, seed):
    """AutoGPTQ quantizes a layer of k < group_size input channels as ceil(k / group_size) = 1 group (scales [1, n],
    every g_idx 0): it was refused as "k=64 (from qweight) is not a multiple of group_size=128", though it is one
    group per row exactly. Converted so now, to the format's float64 values."""
    assume(k * bits % 32 == 0)
    gen = torch.Generator().manual_seed(seed)
    n = 16
    codes, scale, zero = asymmetric_codes(torch.randn(n, k, generator=gen) * 0.05, bits, k)
    args = (pack_along(codes.T, bits, 0), pack_along(((zero - 1) % 2**bits).T, bits, 1), scale.T.contiguous())
    g_idx = torch.arange(k, dtype=torch.int32) // group   # all 0
    if act_order:
        weight, enc, order = from_gptq_act_order(*args, g_idx, bits=bits, group_size=group)
        assert torch.equal(order, torch.arange(k))
    else:
        weight, enc = from_gptq(*args, g_idx, bits=bits, group_size=group)
    assert enc.group_size == k
    _check(weight, enc, _dequant(codes, scale, zero, k), seed)


def test_hqq_float32_meta_is_refused_naming_what_converts():
    """HQQ layers with float32 scales and zeros: each value's scale * zero needs 48 bits, which foldc's float32
    parameters cannot hold, so the conversion is refused; the message said only "does not survive float32". It names
    the parameters it takes and the way to a foldc weight now."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    codes = torch.randint(0, 16, (16 * 128 // 64, 64), generator=gen, dtype=torch.uint8)
    scale = torch.rand(16 * 128 // 64, 1, generator=gen) * 0.02 + 1e-3
    zero = torch.rand(16 * 128 // 64, 1, generator=gen) * 15
    with pytest.raises(InputError, match=r"does not survive float32 .*float16 or bfloat16.*FoldLinear.from_linear"):
        from_hqq(codes, scale, zero, shape=(16, 128), group_size=64, bits=4)
    weight, enc = from_hqq(codes, scale.half(), zero.half(), shape=(16, 128), group_size=64, bits=4)
    want = ((codes.double() - zero.half().double()) * scale.half().double()).reshape(16, 128)
    _check(weight, enc, want, 0)
