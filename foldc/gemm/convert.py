"""Weights in the formats other tools write, repacked once into foldc's layout.

Each converter returns ``(weight, encoding)`` (``from_gptq_act_order`` the input order too): an `AffineTensor` ``[1, 1, n, k]`` (foldc's planar
packing along k, one (scale, zero) per output channel and group of k) and its `GemmEncoding`
(``k-group:bits:group:fp32``), so that ``foldc.compile(GemmSpec(n, k, weight=encoding), ...)`` takes
it. foldc's affine form is ``value = scale * code + zero``; the tools store

- GPTQ (AutoGPTQ / GPTQModel, ``from_gptq``): ``qweight`` int32 ``[k * bits / 32, n]`` (codes packed
  along k, low bits first), ``qzeros`` int32 ``[groups, n * bits / 32]`` (packed along n), ``scales``
  ``[groups, n]``, ``g_idx`` ``[k]``; ``value = scale * (code - zero)`` with the stored zero one less than
  the zero, modulo 2^bits (the "v1" checkpoint format: a zero of 0 is stored as all ones; ``zero_offset=0`` for
  the v2 format). With act-order (``g_idx`` not
  in order), ``from_gptq_act_order`` also returns the input order that makes each group consecutive;
- AWQ (AutoAWQ's GEMM format, ``from_awq``): ``qweight`` int32 ``[k, n * bits / 32]`` and ``qzeros``
  int32 ``[groups, n * bits / 32]``, both packed along n in the order (0, 2, 4, 6, 1, 3, 5, 7) at 4 bits,
  ``scales`` ``[groups, n]``; ``value = scale * (code - zero)``;
- HQQ (``from_hqq``): codes ``W_q`` with a float ``scale`` and ``zero`` per group of ``group_size``
  consecutive weights of each row; ``value = (W_q - zero) * scale``;
- torch's INT4 (tinygemm, the format of ``torch._weight_int4pack_mm`` before it is tiled by
  ``_convert_weight_to_int4pack``; ``from_int4pack``): codes ``[n, k]`` in 0..15 and
  ``scales_and_zeros`` ``[k / group, n, 2]``; ``value = (code - 8) * scale + zero``.

The zero becomes ``-scale * zero`` (``zero - 8 * scale`` for tinygemm). Both are kept in float32,
where they are exact for fp16/bf16 scales and zeros and integer codes (a product of an 11-bit and a
4-bit mantissa, or of two 11-bit ones), so the converted weight dequantizes to exactly the values the
tool's own dequantization gives in float64; a converter checks this and raises `InputError` if not.
"""
from __future__ import annotations

import operator

import torch

from ..encoding import AffineTensor, pack_codes
from ..errors import InputError, InputTypeError
from .spec import GemmEncoding, GemmSpec

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # the column each 4-bit field of an AWQ word holds, low bits first


def _int32(name: str, t, shape: tuple | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise InputError(f"{name} dtype={t.dtype}: the packed format stores int32 words")
    if t.dim() != 2:
        raise InputError(f"{name} shape={tuple(t.shape)}: the packed format stores a 2-D tensor of words")
    if shape is not None and tuple(t.shape) != shape:
        raise InputError(f"{name} shape={tuple(t.shape)} but this layer needs {shape}")
    return t


def _fields(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Split each int32 word into its 32/bits fields (low bits first), the fields next to each other
    along ``dim``: [.., w, ..] -> [.., w * 32/bits, ..]."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, device=words.device, dtype=torch.int32)
    moved = words.movedim(dim, -1)
    fields = (moved[..., None] >> shifts) & ((1 << bits) - 1)          # [.., w, per]
    return fields.reshape(*moved.shape[:-1], moved.shape[-1] * per).movedim(-1, dim)


def _check_bits(bits: int, allowed=(2, 4, 8)) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in allowed:   # 4.0 == 4, but no shift takes it
        raise InputError(f"bits={bits!r}: foldc packs {allowed}-bit weights")


def _check_group(group_size) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise InputError(f"group_size={group_size!r} must be a positive integer (the weights per scale along k)")


def _check_sizes(n: int, k: int, bits: int | None = None) -> None:
    """A layer of n output and k input channels: neither empty; with ``bits``, the zeros' words (packed along
    n, 32 / bits a word) hold whole rows."""
    if n < 1 or k < 1:
        raise InputError(f"the weight is {n} x {k} (n x k): a layer needs at least one output and input channel")
    if bits is not None and n * bits % 32:
        raise InputError(f"n={n} output channels is not a multiple of {32 // bits}: qzeros packs {32 // bits} "
                         f"{bits}-bit zeros a word along n")


def _one_device(*named: tuple[str, torch.Tensor]) -> None:
    """Refuse a layer's tensors on the meta device (no values to convert) or on two devices (torch raised from
    inside the unpacking, naming neither)."""
    first_name, first = named[0]
    for name, t in named:
        if t.is_meta:
            raise InputError(f"{name} is on the meta device (no values to convert): load the checkpoint's tensors "
                             "onto the CPU or a GPU first")
        if t.device != first.device:
            raise InputError(f"{name} is on {t.device} but {first_name} is on {first.device}: move the layer's "
                             "tensors to one device")


def _float_params(name: str, t: torch.Tensor, hint: str = "") -> None:
    """Refuse scales or zeros that are not real floating point (integer, bool, complex)."""
    if not t.is_floating_point():
        raise InputError(f"{name} dtype={t.dtype}: the format stores float {name}{hint}")


def _integer_codes(name: str, codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes`` as int32, refused unless every one is an integer in 0 .. 2^bits - 1 (a float code of 3.7
    would otherwise be truncated to 3, and the check against the format's own formula pass on the truncated
    codes)."""
    if codes.dtype == torch.bool or codes.is_complex():
        raise InputError(f"{name} dtype={codes.dtype}: pass the integer codes")
    if codes.is_floating_point():
        finite = torch.isfinite(codes)
        if not bool(finite.all()):
            raise InputError(f"{name} holds {float(codes[~finite][0])!r}; codes are integers 0..{(1 << bits) - 1}")
        if not bool((codes == codes.round()).all()):
            raise InputError(f"{name} holds non-integer codes; pass the tool's unpacked integer codes")
    lo, hi = int(codes.min()), int(codes.max())
    if lo < 0 or hi >= 1 << bits:
        raise InputError(f"{name} codes span [{lo}, {hi}], outside 0..{(1 << bits) - 1}")
    return codes.to(torch.int32)


def _build(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group: int,
           want: torch.Tensor) -> tuple[AffineTensor, GemmEncoding]:
    """codes [n, k] (ints), scale and zero [n, k / group] float32 (value = scale * code + zero), the
    tool's dequantized values ``want`` [n, k] float64 to check against."""
    n, k = codes.shape
    infinite = torch.isinf(scale) | torch.isinf(zero)
    if bool(infinite.any()):   # scale * code + zero cannot hold what the format gives there (+-inf, or NaN)
        i, g = (int(x) for x in infinite.nonzero()[0])
        raise InputError(f"row {i}, group {g} has scale={float(scale[i, g])!r} and zero={float(zero[i, g])!r} in "
                         "foldc's scale * code + zero: infinite (a corrupt layer?); foldc takes finite scales and zeros")
    enc = GemmEncoding("k-group", bits, group, torch.float32)
    GemmSpec(n, k, weight=enc)   # the layout foldc can plan (SpecError with the reason, e.g. groups across bit fields)
    # row-major scales and zeros (the formats store them [groups, n]): the layout foldc's kernels read
    weight = AffineTensor(pack_codes(codes, bits).reshape(1, 1, n, k * bits // 8).contiguous(),
                          scale.contiguous().reshape(1, 1, n, -1), zero.contiguous().reshape(1, 1, n, -1),
                          enc.affine(k), k)
    got = weight.dequantize(torch.float64)[0, 0]
    bad = (got != want) & ~(torch.isnan(got) & torch.isnan(want))
    if bool(bad.any()):
        i, j = (int(x) for x in bad.nonzero()[0])
        raise InputError(f"the converted weight at [{i}, {j}] is {float(got[i, j])!r} but the format's own "
                         f"dequantization gives {float(want[i, j])!r}: its scale or zero does not survive float32 "
                         "(foldc keeps scale and scale * zero in float32; two float32 parameters' product, e.g. HQQ's "
                         "fp32 meta, needs 48 bits). Convert parameters held in float16 or bfloat16 (the values move "
                         "by their rounding), or quantize the float weight with foldc: FoldLinear.from_linear")
    return weight, enc


def _g_idx(g_idx, k: int, group: int) -> torch.Tensor:
    """``g_idx`` as int64 [k], refused unless it names each of the k / group groups for exactly ``group`` input
    channels (what GPTQ writes, in order or reordered by act-order)."""
    if not isinstance(g_idx, torch.Tensor):
        raise InputTypeError(f"g_idx must be a torch.Tensor [{k}] of group indices, got {type(g_idx).__name__}")
    if g_idx.dtype == torch.bool or g_idx.is_floating_point() or g_idx.is_complex():
        raise InputError(f"g_idx dtype={g_idx.dtype}: GPTQ stores integer group indices")
    if tuple(g_idx.shape) != (k,):
        raise InputError(f"g_idx shape={tuple(g_idx.shape)} but this layer has k={k} input channels")
    _one_device(("g_idx", g_idx))   # a g_idx on another real device than the weight is taken
    g_idx = g_idx.to(torch.int64)
    groups = k // group
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise InputError(f"g_idx spans [{int(g_idx.min())}, {int(g_idx.max())}], outside the layer's {groups} groups")
    counts = torch.bincount(g_idx.cpu(), minlength=groups)
    if bool((counts != group).any()):
        g = int((counts != group).nonzero()[0])
        raise InputError(f"g_idx names group {g} for {int(counts[g])} input channels, not group_size={group}: "
                         "foldc takes groups of group_size channels each")
    return g_idx


def _groups_in_order(g_idx, k: int, group: int, name: str = "g_idx") -> None:
    if g_idx is None:
        return
    g_idx = _g_idx(g_idx, k, group)
    if not torch.equal(g_idx, torch.arange(k, device=g_idx.device) // group):
        raise InputError(f"{name} is not [k // group_size for k in range({k})]: the checkpoint reorders input "
                         "channels (act-order / desc_act); convert it with from_gptq_act_order, which returns the "
                         "input order FoldLinear(..., input_order=...) applies")


def _zero_point_layer(qzeros, scales, k: int, n: int, bits: int, group_size: int) -> tuple[torch.Tensor, int]:
    """Check a GPTQ/AWQ layer's ``qzeros`` and ``scales`` against its k x n weight; (qzeros, groups)."""
    if k % group_size:
        raise InputError(f"k={k} (from qweight) is not a multiple of group_size={group_size}")
    groups = k // group_size
    qzeros = _int32("qzeros", qzeros, (groups, n * bits // 32))
    if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != (groups, n):
        got = getattr(scales, "shape", type(scales).__name__)
        raise InputError(f"scales must be a [{groups}, {n}] tensor; got {got}")
    _float_params("scales", scales)
    return qzeros, groups


def _from_integer_zeros(codes, zeros, scales, bits: int, group_size: int) -> tuple[AffineTensor, GemmEncoding]:
    """codes [n, k], integer zeros [n, groups], scales [groups, n]: value = scale * (code - zero)."""
    s = scales.T.to(torch.float64)
    want = s.repeat_interleave(group_size, 1) * (codes - zeros.repeat_interleave(group_size, 1)).to(torch.float64)
    return _build(codes, s.to(torch.float32), (-s * zeros).to(torch.float32), bits, group_size, want)


def _gptq_layer(qweight, qzeros, scales, bits: int, group_size: int, zero_offset: int):
    """A GPTQ layer's tensors checked: (codes [n, k] in k's stored order, integer zeros [n, groups], k, the group
    size: ``group_size``, or k where it is -1, GPTQ's one group per row)."""
    _check_bits(bits)
    if not (type(group_size) is int and group_size == -1):
        _check_group(group_size)
    if type(zero_offset) is not int or zero_offset not in (0, 1):
        raise InputError(f"zero_offset={zero_offset!r} must be 1 (GPTQ's v1 checkpoints: the zero stored minus one) "
                         "or 0 (the v2 format: the zero as it is)")
    qweight = _int32("qweight", qweight)
    k, n = qweight.shape[0] * 32 // bits, qweight.shape[1]
    _check_sizes(n, k, bits)
    # -1, GPTQ's one group per row; a group past k (a layer narrower than the group: AutoGPTQ stores
    # ceil(k / group_size) = 1 group, every g_idx 0) is that one group too
    group_size = k if group_size == -1 or group_size > k else group_size
    qzeros, _ = _zero_point_layer(qzeros, scales, k, n, bits, group_size)
    _one_device(("qweight", qweight), ("qzeros", qzeros), ("scales", scales))
    # v1: the zero is (stored + 1) mod 2^bits, as AutoGPTQ's kernels (cuda, exllama, exllamav2: `(z + 1) & 0x0f`) and
    # GPTQModel's dequantizer read it: a zero of 0, stored as -1, is all ones in its field and reads back as 0
    zeros = (_fields(qzeros, bits, 1) + zero_offset) & ((1 << bits) - 1)
    _check_symmetric_zeros(zeros, bits, zero_offset)
    return _fields(qweight, bits, 0).T, zeros.T, k, group_size


def _check_symmetric_zeros(zeros: torch.Tensor, bits: int, zero_offset: int) -> None:
    """Refuse zeros that all read one off a symmetric layer's: GPTQ's symmetric quantizer (sym=True, its default)
    gives every zero 2^(bits-1), stored minus one in v1 checkpoints and as it is in v2, so a layer read with the
    other format's zero_offset has every zero 2^(bits-1) + 1 (a v2 layer read as v1) or 2^(bits-1) - 1 (v1 read as
    v2): each weight one scale step off, which the check against the format's own dequantization (of the same
    zeros) does not see. An asymmetric layer's zeros, one per output channel and group, are never all that value."""
    half = 1 << (bits - 1)
    read = half + 1 if zero_offset == 1 else half - 1
    if not bool((zeros == read).all()):
        return
    stored = "as they are (the v2 format, GPTQModel's checkpoint_format='gptq_v2')" if zero_offset == 1 else \
        "minus one (the v1 format, AutoGPTQ's and most GPTQ checkpoints)"
    fix = "checkpoint='gptq_v2'" if zero_offset == 1 else "checkpoint='gptq'"
    raise InputError(f"every zero of the layer reads as {read} with zero_offset={zero_offset}, one off the "
                     f"{half} of a symmetric GPTQ layer (sym=True): its zeros are stored {stored}; convert it with "
                     f"zero_offset={1 - zero_offset} (load_quantized(..., {fix}))")


def from_gptq(qweight, qzeros, scales, g_idx=None, *, bits: int = 4, group_size: int = 128,
              zero_offset: int = 1) -> tuple[AffineTensor, GemmEncoding]:
    """A GPTQ layer (module doc) as a foldc weight: ``qweight`` int32 [k * bits / 32, n], ``qzeros``
    int32 [k / group_size, n * bits / 32], ``scales`` [k / group_size, n], ``g_idx`` None or in order;
    ``group_size=-1`` (GPTQ's one group per row) is the layer's k."""
    codes, zeros, k, group_size = _gptq_layer(qweight, qzeros, scales, bits, group_size, zero_offset)
    _groups_in_order(g_idx, k, group_size)
    return _from_integer_zeros(codes, zeros, scales, bits, group_size)


def from_gptq_act_order(qweight, qzeros, scales, g_idx, *, bits: int = 4, group_size: int = 128,
                        zero_offset: int = 1) -> tuple[AffineTensor, GemmEncoding, torch.Tensor]:
    """A GPTQ layer quantized with act-order (``desc_act``: ``g_idx`` names each input channel's group, the
    groups' channels scattered along k) as ``(weight, encoding, input_order)``: the weight's columns sorted by
    group (``input_order`` = the stable argsort of ``g_idx``, int64 [k]), so that each group is consecutive, and
    ``y = x[..., input_order] @ weight.T`` equals the layer's ``x @ W.T`` (`foldc.nn.FoldLinear` takes
    ``input_order`` and gathers x by it). Tensors as `from_gptq`'s; ``g_idx`` in order gives the identity order."""
    codes, zeros, k, group_size = _gptq_layer(qweight, qzeros, scales, bits, group_size, zero_offset)
    order = torch.argsort(_g_idx(g_idx, k, group_size), stable=True)
    weight, enc = _from_integer_zeros(codes[:, order.to(codes.device)], zeros, scales, bits, group_size)
    return weight, enc, order


def from_awq(qweight, qzeros, scales, *, bits: int = 4, group_size: int = 128) -> tuple[AffineTensor, GemmEncoding]:
    """An AWQ GEMM layer (module doc) as a foldc weight: ``qweight`` int32 [k, n * bits / 32], ``qzeros``
    int32 [k / group_size, n * bits / 32], ``scales`` [k / group_size, n]; ``group_size=-1`` (AutoAWQ's
    ``q_group_size`` for one group per row: ``WQLinear_GEMM`` reads it as in_features) is the layer's k."""
    _check_bits(bits, (4,))
    if not (type(group_size) is int and group_size == -1):
        _check_group(group_size)
    qweight = _int32("qweight", qweight)
    k, n = qweight.shape[0], qweight.shape[1] * 32 // bits
    _check_sizes(n, k)
    group_size = k if group_size == -1 else group_size
    qzeros, _ = _zero_point_layer(qzeros, scales, k, n, bits, group_size)
    _one_device(("qweight", qweight), ("qzeros", qzeros), ("scales", scales))
    order = torch.tensor(AWQ_ORDER).argsort()   # field holding column c of each group of eight

    def columns(words):   # [rows, n / 8] words -> [rows, n] codes in column order
        f = _fields(words, bits, 1).reshape(words.shape[0], -1, 8)
        return f[..., order].reshape(words.shape[0], -1)
    codes, zeros = columns(qweight).T, columns(qzeros).T                 # [n, k], [n, groups]
    return _from_integer_zeros(codes, zeros, scales, bits, group_size)


def from_hqq(W_q, scale, zero, *, shape: tuple[int, int], group_size: int, bits: int = 4
             ) -> tuple[AffineTensor, GemmEncoding]:
    """An HQQ weight (module doc): unpacked codes ``W_q`` (any shape holding n * k codes, row-major, in
    groups of ``group_size`` consecutive weights of a row: HQQ's axis=1), ``scale`` and ``zero`` one per group (any
    shape holding n * k / group_size), ``shape`` = (n, k). HQQ's axis=0 shapes (codes [group_size, n * k /
    group_size], scales [1, n * k / group_size]: groups across output channels) are refused, as are shapes of the
    weight's transpose (codes [k, n], scale and zero [k / group_size, n])."""
    _check_bits(bits)
    _check_group(group_size)
    try:
        n, k = (operator.index(x) for x in shape)
    except (TypeError, ValueError):
        raise InputError(f"shape={shape!r} must be the weight's (n, k), two integers") from None
    _check_sizes(n, k)
    if k % group_size:
        raise InputError(f"k={k} is not a multiple of group_size={group_size}")
    for name, t, size in (("W_q", W_q, n * k), ("scale", scale, n * k // group_size),
                          ("zero", zero, n * k // group_size)):
        if not isinstance(t, torch.Tensor) or t.numel() != size:
            raise InputError(f"{name} must hold {size} values for shape {shape} in groups of {group_size}; got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    for name, t in (("scale", scale), ("zero", zero)):   # HQQ's quant_scale / quant_zero store 8-bit codes of them
        _float_params(name, t, f" (with quant_{name}=True HQQ stores the {name} as codes of its own: pass the "
                               f"dequantized {name})")
    _one_device(("W_q", W_q), ("scale", scale), ("zero", zero))
    groups = n * k // group_size
    natural = ((groups, group_size), (n, k), (n, k // group_size))   # axis=1's shapes, and the weight's own
    if (W_q.dim() == 2 and tuple(W_q.shape) == (group_size, groups) and (group_size, groups) not in natural) or \
            any(t.dim() == 2 and tuple(t.shape) == (1, groups) and (1, groups) not in natural for t in (scale, zero)):
        raise InputError(f"W_q {tuple(W_q.shape)}, scale {tuple(scale.shape)}: HQQ's axis=0 layout (each group a "
                         f"column of the weight reshaped to [{group_size}, {groups}], values {groups} apart, across "
                         "output channels), which foldc cannot group along k; quantize with axis=1 (HQQ's "
                         "BaseQuantizeConfig(axis=1), transformers' HqqConfig(axis=1))")
    _refuse_transposed(W_q, scale, zero, n, k, group_size, natural + ((groups, 1),))
    codes = _integer_codes("W_q", W_q.reshape(n, k), bits)
    s, z = scale.reshape(n, -1).to(torch.float64), zero.reshape(n, -1).to(torch.float64)
    want = (codes.to(torch.float64) - z.repeat_interleave(group_size, 1)) * s.repeat_interleave(group_size, 1)
    return _build(codes, s.to(torch.float32), (-s * z).to(torch.float32), bits, group_size, want)


def _refuse_transposed(W_q, scale, zero, n: int, k: int, group_size: int, natural: tuple) -> None:
    """Refuse HQQ tensors shaped as the weight's transpose (codes [k, n], scales and zeros [k / group_size, n], as
    GPTQ and AWQ store their scales): read row-major as [n, k] they gave a wrong weight, and the check against the
    same reading passed. A shape that is also one of ``natural`` (n == k, ...) cannot tell and is taken."""
    for name, t, flipped in (("W_q", W_q, (k, n)), ("scale", scale, (k // group_size, n)),
                             ("zero", zero, (k // group_size, n))):
        if t.dim() == 2 and tuple(t.shape) == flipped and flipped not in natural:
            axis = "k" if name == "W_q" else "k / group_size"
            raise InputError(f"{name} shape={flipped} is [{axis}, n], the weight's layout transposed (as GPTQ stores "
                             f"its scales); from_hqq reads HQQ's tensors row-major over the weight's n={n} rows: "
                             f"pass {name}.T")


def from_int4pack(codes, scales_and_zeros, *, group_size: int) -> tuple[AffineTensor, GemmEncoding]:
    """torch's tinygemm INT4 (module doc): ``codes`` [n, k] in 0..15 (before
    ``torch._convert_weight_to_int4pack`` tiles them), ``scales_and_zeros`` [k / group_size, n, 2]."""
    if not isinstance(codes, torch.Tensor) or codes.dim() != 2:
        raise InputError(f"codes must be an [n, k] tensor; got {getattr(codes, 'shape', type(codes).__name__)}")
    _check_group(group_size)
    n, k = codes.shape
    _check_sizes(n, k)
    if codes.dtype == torch.uint8 and getattr(scales_and_zeros, "shape", None) == (2 * k // group_size, n, 2):
        raise InputError(f"codes [{n}, {k}] with scales_and_zeros for k={2 * k}: the codes are packed two codes a byte "
                         "(uint8 [n, k / 2], as torch._convert_weight_to_int4pack takes them on the GPU); pass the "
                         f"[{n}, {2 * k}] codes in 0..15 (the high nibble of byte j holds code 2j, the low one 2j + 1)")
    if k % group_size:
        raise InputError(f"k={k} is not a multiple of group_size={group_size}")
    if not isinstance(scales_and_zeros, torch.Tensor) or tuple(scales_and_zeros.shape) != (k // group_size, n, 2):
        raise InputError(f"scales_and_zeros must be [{k // group_size}, {n}, 2]; got "
                         f"{getattr(scales_and_zeros, 'shape', type(scales_and_zeros).__name__)}")
    _float_params("scales_and_zeros", scales_and_zeros)
    _one_device(("codes", codes), ("scales_and_zeros", scales_and_zeros))
    codes = _integer_codes("codes", codes, 4)
    s = scales_and_zeros[..., 0].T.to(torch.float64)                   # [n, groups]
    z = scales_and_zeros[..., 1].T.to(torch.float64)
    want = (codes - 8).to(torch.float64) * s.repeat_interleave(group_size, 1) + z.repeat_interleave(group_size, 1)
    return _build(codes, s.to(torch.float32), (z - 8 * s).to(torch.float32), 4, group_size, want)
