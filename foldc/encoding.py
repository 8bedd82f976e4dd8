"""Affine encodings of a KV cache and the quantizer that produces them.

A stored value is ``scale * code + zero`` (docs/derivation.md, equation 1), with ``code`` an
unsigned integer in ``[0, 2**bits)`` and one ``(scale, zero)`` pair per group of values.

Layouts (x is ``[batch, kv_heads, tokens, head_dim]``):

- ``"token"``: each token is quantized on its own; its ``head_dim`` channels are cut into groups
  of ``group_size`` channels. scale/zero are ``[batch, kv_heads, tokens, head_dim // group_size]``.
- ``"channel"``: each channel is quantized on its own; runs of ``group_size`` consecutive tokens
  share a pair. scale/zero are ``[batch, kv_heads, ceil(tokens / group_size), head_dim]``; the
  last group may be partial.

Packing order ("planar"): codes are packed along ``head_dim``. With ``k = 8 // bits`` codes per
byte, a token's row is ``head_dim // k`` bytes and bit field ``i`` (bits ``[i*bits, (i+1)*bits)``)
of byte ``j`` holds channel ``i * (head_dim // k) + j``. One shift and one mask of a row of
bytes thus yields a *contiguous* channel range ``[i*head_dim/k, (i+1)*head_dim/k)``, so a kernel
can split the reduction over channels per bit field instead of interleaving channels.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from .errors import InputError, InputTypeError, ScaleOverflowError, SpecError
from .options import as_int

Layout = Literal["token", "channel"]
SUPPORTED_BITS = (2, 4, 8)
SUPPORTED_LAYOUTS = ("token", "channel")
SUPPORTED_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: the largest group: the kernels take the group size as an int32 argument (a channel-wise group past the
#: cache's tokens is one group of them all, so a larger one would mean nothing more)
MAX_GROUP_SIZE = 2**31 - 1


@dataclass(frozen=True)
class Affine:
    """How one operand of the KV cache is encoded: ``value = scale * code + zero``.

    Args:
        bits: code width, 2, 4 or 8.
        layout: ``"token"`` (groups run along head_dim) or ``"channel"`` (groups run along tokens).
        group_size: number of values sharing one (scale, zero).
        scale_dtype: storage dtype of scale and zero (float16, bfloat16 or float32).
    """

    bits: int
    layout: Layout
    group_size: int
    scale_dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        for field in ("bits", "group_size"):   # a NumPy or 0-dim torch integer is that int
            object.__setattr__(self, field, as_int(getattr(self, field)))
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or self.bits not in SUPPORTED_BITS:
            raise SpecError(f"bits={self.bits!r} is not supported; use one of {SUPPORTED_BITS}")
        if self.layout not in SUPPORTED_LAYOUTS:
            raise SpecError(
                f"layout={self.layout!r} is not supported; use 'token' (groups along head_dim) "
                "or 'channel' (groups along tokens)"
            )
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or \
                not 1 <= self.group_size <= MAX_GROUP_SIZE:
            raise SpecError(f"group_size={self.group_size!r} must be a positive integer <= {MAX_GROUP_SIZE} "
                            "(foldc.encoding.MAX_GROUP_SIZE: the kernels take it as an int32)")
        if self.scale_dtype not in SUPPORTED_SCALE_DTYPES:
            raise SpecError(
                f"scale_dtype={self.scale_dtype} is not supported; use torch.float16, torch.bfloat16 "
                "or torch.float32"
            )

    @property
    def codes_per_byte(self) -> int:
        return 8 // self.bits

    @property
    def group_axis(self) -> str:
        """The IR axis along which one group runs: ``"channel"`` for token layout, else ``"token"``."""
        return "channel" if self.layout == "token" else "token"

    @property
    def max_code(self) -> int:
        return (1 << self.bits) - 1

    def short(self) -> str:
        """``token:2:128`` style text, the CLI's syntax."""
        dt = {torch.float16: "", torch.bfloat16: ":bf16", torch.float32: ":fp32"}[self.scale_dtype]
        return f"{self.layout}:{self.bits}:{self.group_size}{dt}"

    def check_head_dim(self, head_dim: int, field: str = "head_dim") -> None:
        """Raise SpecError if this encoding cannot be applied to rows of ``head_dim`` channels."""
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
            raise SpecError(f"{field}={head_dim!r} must be a positive integer (channels per head)")
        if head_dim % self.codes_per_byte:
            raise SpecError(
                f"{field}={head_dim} is not a multiple of {self.codes_per_byte}, the number of "
                f"{self.bits}-bit codes per byte; pad head_dim or use more bits"
            )
        if self.layout == "token" and head_dim % self.group_size:
            raise SpecError(
                f"group_size={self.group_size} does not divide {field}={head_dim}; token-wise groups "
                f"cut head_dim, so pick a divisor of {head_dim}"
            )


def parse_affine(text: str) -> Affine:
    """Parse ``layout:bits:group[:fp16|bf16|fp32]`` (e.g. ``token:2:128``) into an Affine."""
    if not isinstance(text, str):
        raise SpecError(f"encoding {text!r} must be a string like 'token:2:128'")
    parts = text.strip().split(":")
    if len(parts) not in (3, 4):
        raise SpecError(
            f"encoding {text!r} must look like 'layout:bits:group_size' (e.g. 'token:2:128'), "
            "optionally followed by ':fp16', ':bf16' or ':fp32' for the scale dtype"
        )
    layout, bits, group = parts[:3]
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    scale_dtype = torch.float16
    if len(parts) == 4:
        if parts[3] not in dtypes:
            raise SpecError(f"scale dtype {parts[3]!r} in {text!r} must be one of {sorted(dtypes)}")
        scale_dtype = dtypes[parts[3]]
    try:
        bits_i, group_i = int(bits), int(group)
    except ValueError:
        raise SpecError(f"encoding {text!r}: bits={bits!r} and group_size={group!r} must be integers") from None
    return Affine(bits_i, layout, group_i, scale_dtype)  # type: ignore[arg-type]


def scale_shape(enc: Affine, batch: int, heads: int, tokens: int, head_dim: int) -> tuple[int, int, int, int]:
    """Shape of the scale and zero tensors for x of shape [batch, heads, tokens, head_dim]."""
    if enc.layout == "token":
        return (batch, heads, tokens, head_dim // enc.group_size)
    return (batch, heads, math.ceil(tokens / enc.group_size), head_dim)


def _check_bits(bits) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise SpecError(f"bits={bits!r} is not supported; use one of {SUPPORTED_BITS}")


def _check_rows(name: str, t, what: str) -> None:
    """A dense tensor of at least one dim (rows along the last): pack_codes' codes, unpack_codes' bytes."""
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor of {what}, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise InputError(f"{name} is a tensor of layout {t.layout}; pass {name}.to_dense()")
    if t.dim() == 0:
        raise InputError(f"{name} is a 0-d tensor; codes are packed along the last dim: pass rows, e.g. "
                         f"{name}.reshape(1, -1)")


_WIDE_UNSIGNED = tuple(getattr(torch, name) for name in ("uint16", "uint32", "uint64") if hasattr(torch, name))


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes [..., head_dim] into uint8 [..., head_dim * bits // 8] (planar order)."""
    _check_bits(bits)
    k, top = 8 // bits, (1 << bits) - 1
    _check_rows("codes", codes, "integer codes, e.g. torch.tensor(codes, dtype=torch.uint8)")
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise InputError(f"codes dtype={codes.dtype} must be an integer dtype (codes 0..{top}); round and convert "
                         "them first, e.g. codes.round().to(torch.uint8)")
    if codes.dtype in _WIDE_UNSIGNED:   # (torch has no aminmax for them; a uint64 past 2**63 reads negative: refused)
        codes = codes.to(torch.int64)
    if codes.shape[-1] % k:
        raise InputError(f"codes last dim {codes.shape[-1]} is not a multiple of {k}, the number of {bits}-bit codes "
                         "per byte; pad the rows")
    if codes.numel() and not codes.is_meta:   # (meta codes hold no values to check)
        lo, hi = torch.stack(torch.aminmax(codes)).tolist()
        if lo < 0 or hi > top:
            raise InputError(f"codes span [{lo}, {hi}], outside 0..{top} ({bits}-bit codes): a code past its bit "
                             f"field spills into its neighbours'; clamp them (codes.clamp(0, {top})) or use more bits")
    return _pack(codes, bits)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """`pack_codes` without its checks (codes already in 0 .. 2**bits - 1)."""
    k = 8 // bits
    d = codes.shape[-1]
    fields = codes.to(torch.uint8).reshape(*codes.shape[:-1], k, d // k)
    packed = torch.zeros(fields.shape[:-2] + (d // k,), dtype=torch.uint8, device=codes.device)
    for i in range(k):
        packed |= fields[..., i, :] << (i * bits)
    return packed


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_codes`: uint8 [..., head_dim * bits // 8] -> uint8 codes [..., head_dim] (bytes held in
    another integer dtype give codes of that dtype; int8 is read as the bytes' bits)."""
    _check_bits(bits)
    _check_rows("packed", packed, "uint8 bytes (pack_codes' output)")
    given = packed.dtype
    if given in _WIDE_UNSIGNED:   # read as int64 (torch has no aminmax or shifts for them), returned in their dtype
        packed = packed.to(torch.int64)
    if packed.dtype != torch.uint8:
        if packed.is_floating_point() or packed.is_complex() or packed.dtype == torch.bool:
            raise InputError(f"packed dtype={packed.dtype}: unpack_codes reads bytes of packed codes (uint8, as "
                             "pack_codes writes them); pass the uint8 tensor itself")
        if packed.dtype != torch.int8 and packed.numel():   # a wider integer: each element one byte, 0..255
            lo, hi = torch.stack(torch.aminmax(packed)).tolist()
            if lo < 0 or hi > 255:
                raise InputError(f"packed dtype={given} holds values in [{lo}, {hi}], outside a byte's 0..255: "
                                 "each element is one byte of packed codes (only its low 8 bits would be read); pass "
                                 "uint8 bytes (another tool's packed words, e.g. GPTQ's int32: "
                                 "foldc.gemm.convert)")
    k = 8 // bits
    mask = (1 << bits) - 1
    fields = [(packed >> (i * bits)) & mask for i in range(k)]
    return torch.cat(fields, dim=-1).to(given)


def _check_value_dtype(dtype) -> None:
    """The dtype of dequantized values (or of their scale and zero): a floating-point torch.dtype."""
    if not isinstance(dtype, torch.dtype):
        raise InputTypeError(f"dtype={dtype!r} must be a torch.dtype, e.g. torch.float32 (the default) or "
                             "torch.float16")
    if not dtype.is_floating_point:
        raise InputError(f"dtype={dtype} is not a floating-point dtype: scales, zeros and values would be "
                         "cast to it (an integer dtype truncates them); pass torch.float32 (the default), "
                         "torch.float64, torch.float16 or torch.bfloat16")


@dataclass(frozen=True, eq=False)
class AffineTensor:
    """A quantized tensor: packed codes plus per-group scale and zero.

    Attributes:
        codes: uint8 ``[batch, kv_heads, tokens, head_dim * bits // 8]``, planar packing (module doc).
        scale: ``encoding.scale_dtype``, shape from `scale_shape`.
        zero: same shape and dtype as scale.
        encoding: the Affine that produced it.
        head_dim: number of channels per token (codes hold ``head_dim * bits // 8`` bytes).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    encoding: Affine
    head_dim: int

    def __post_init__(self) -> None:
        enc = self.encoding
        if not isinstance(enc, Affine):
            raise InputTypeError(f"encoding={enc!r} must be a foldc.Affine")
        for name in ("codes", "scale", "zero"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}; build an AffineTensor "
                                     "with foldc.quantize(x, encoding) or from the tensors of one")
            if t.layout != torch.strided:
                raise InputError(f"{name} is a tensor of layout {t.layout}; an AffineTensor holds dense tensors: "
                                 f"pass {name}.to_dense()")
        enc.check_head_dim(self.head_dim)
        if self.codes.dtype != torch.uint8 or self.codes.dim() != 4:
            raise InputError(
                f"codes must be uint8 [batch, kv_heads, tokens, head_dim*bits/8]; got "
                f"dtype={self.codes.dtype}, shape={tuple(self.codes.shape)}"
            )
        b, h, n, packed_d = self.codes.shape
        if packed_d * enc.codes_per_byte != self.head_dim:
            raise InputError(
                f"codes last dim {packed_d} x {enc.codes_per_byte} codes/byte != head_dim={self.head_dim}"
            )
        want = scale_shape(enc, b, h, n, self.head_dim)
        for name, t in (("scale", self.scale), ("zero", self.zero)):
            if tuple(t.shape) != want:
                raise InputError(f"{name} shape={tuple(t.shape)} but {enc.short()} needs {want}")
            if t.dtype != enc.scale_dtype:
                raise InputError(f"{name} dtype={t.dtype} but encoding.scale_dtype={enc.scale_dtype}")
            if t.device != self.codes.device:
                raise InputError(f"{name} is on {t.device} but codes are on {self.codes.device}")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Logical shape [batch, kv_heads, tokens, head_dim]."""
        b, h, n, _ = self.codes.shape
        return (b, h, n, self.head_dim)

    @property
    def num_tokens(self) -> int:
        return self.codes.shape[2]

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def to(self, device) -> "AffineTensor":
        """The same codes, scales and zeros on ``device``."""
        if isinstance(device, torch.dtype):   # (the codes cast to it were refused as "codes must be uint8")
            raise InputTypeError(f"AffineTensor.to({device}): it moves devices only; its dtypes are its encoding's "
                                 f"(uint8 codes, {self.encoding.scale_dtype} scales). For values in {device} call "
                                 f".dequantize({device}); for other scales quantize with scale_dtype={device}")
        return AffineTensor(self.codes.to(device), self.scale.to(device), self.zero.to(device),
                            self.encoding, self.head_dim)

    def unpack(self) -> torch.Tensor:
        """Integer codes (int64) shaped [batch, kv_heads, tokens, head_dim]."""
        return unpack_codes(self.codes, self.encoding.bits).to(torch.int64)

    def expanded_params(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """scale and zero broadcast to one entry per value, [batch, kv_heads, tokens, head_dim]."""
        _check_value_dtype(dtype)
        g = self.encoding.group_size
        s, z = self.scale.to(dtype), self.zero.to(dtype)
        if self.encoding.layout == "token":
            s, z = s.repeat_interleave(g, dim=-1), z.repeat_interleave(g, dim=-1)
        else:   # token t reads group t // g (repeating each group g times allocated g per group, past the tokens)
            group = torch.arange(self.num_tokens, device=s.device) // g
            s, z = s[:, :, group], z[:, :, group]
        return s, z

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``scale * code + zero`` in ``dtype`` (float32 by default), shaped like the input: computed in float32 (or
        float64) and rounded to ``dtype`` once (in fp16, ``scale * code`` of a value near its range overflowed to inf
        before ``zero`` brought it back)."""
        _check_value_dtype(dtype)
        work = torch.float64 if dtype == torch.float64 else torch.float32
        s, z = self.expanded_params(work)
        return (s * self.unpack().to(work) + z).to(dtype)


_CHUNK_VALUES = 1 << 28  # above this many values, quantize sequence by sequence


def quantize(x: torch.Tensor, enc: Affine) -> AffineTensor:
    """Asymmetric min-max quantization of x [batch, kv_heads, tokens, head_dim], round to nearest.

    Each group gets ``zero = min`` and ``scale = (max - min) / (2**bits - 1)``, both rounded to
    ``enc.scale_dtype``; codes are computed against the rounded values so that ``dequantize``
    reproduces x as closely as the stored pair allows. A constant group gets ``scale = 0``
    and codes 0 (no division by zero).
    """
    if not isinstance(enc, Affine):
        raise InputTypeError(f"enc={enc!r} must be a foldc.Affine, e.g. foldc.Affine(2, 'token', 128)")
    if not isinstance(x, torch.Tensor):
        raise InputTypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.layout != torch.strided or x.is_meta:
        where = "on the meta device" if x.is_meta else f"of layout {x.layout}"
        raise InputError(f"x is a tensor {where}, whose values cannot be read; pass a dense tensor holding the "
                         "values (x.to_dense(), or weights loaded onto a real device)")
    if x.dim() != 4:
        raise InputError(f"x must be [batch, kv_heads, tokens, head_dim]; got shape={tuple(x.shape)}")
    if not x.is_floating_point():
        raise InputError(f"x dtype={x.dtype} must be a floating-point type")
    b, h, n, d = x.shape
    for name, size in (("batch", b), ("kv_heads", h), ("tokens", n), ("head_dim", d)):
        if size < 1:
            raise InputError(f"x has {name}={size} (shape={tuple(x.shape)}); quantize at least one value along "
                             "every axis of [batch, kv_heads, tokens, head_dim]")
    enc.check_head_dim(d)
    if b > 1 and x.numel() > _CHUNK_VALUES:  # bound the float32 temporaries: one sequence at a time
        parts = [quantize(x[i:i + 1], enc) for i in range(b)]
        return AffineTensor(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                            torch.cat([p.zero for p in parts]), enc, d)
    xf = x.to(torch.float32)
    if not torch.isfinite(xf).all():
        bad = (~torch.isfinite(xf)).nonzero()[0].tolist()
        if bool(torch.isfinite(x[tuple(bad)])):
            raise InputError(f"x holds {float(x[tuple(bad)])!r} at index {bad}, beyond float32's range (the "
                             "quantizer computes in float32); scale the values into it")
        raise InputError(f"x holds NaN or Inf (first at index {bad}); quantize finite values only")
    g = enc.group_size
    if enc.layout == "token":
        grouped = xf.reshape(b, h, n, d // g, g)
        mn, mx = grouped.amin(-1), grouped.amax(-1)
    else:
        n_groups = math.ceil(n / g)
        span = min(g, n)   # one group past the tokens holds them all: padding it to g allocated g tokens
        pad = n_groups * span - n
        lo = torch.nn.functional.pad(xf, (0, 0, 0, pad), value=math.inf) if pad else xf
        hi = torch.nn.functional.pad(xf, (0, 0, 0, pad), value=-math.inf) if pad else xf
        mn = lo.reshape(b, h, n_groups, span, d).amin(3)
        mx = hi.reshape(b, h, n_groups, span, d).amax(3)
    scale = ((mx - mn) / enc.max_code).to(enc.scale_dtype)
    zero = mn.to(enc.scale_dtype)
    if not (torch.isfinite(scale).all() and torch.isfinite(zero).all()):
        if not torch.isfinite(mx - mn).all():   # float32 scales would overflow too
            raise ScaleOverflowError(
                f"x has values (max |x| = {xf.abs().max().item():.4g}) whose group's range (max - min) is beyond "
                f"float32's range (the quantizer computes in float32), so no scale_dtype holds its scale; scale the "
                "values down (or clip them) before quantizing")
        raise ScaleOverflowError(
            f"x has values (max |x| = {xf.abs().max().item():.4g}) whose scale or zero overflow "
            f"scale_dtype={enc.scale_dtype}; use float32 scales: '{enc.layout}:{enc.bits}:{enc.group_size}:fp32' "
            "as text, or Affine(..., scale_dtype=torch.float32)"
        )
    at = AffineTensor(torch.zeros(b, h, n, d // enc.codes_per_byte, dtype=torch.uint8, device=x.device),
                      scale, zero, enc, d)
    s_full, z_full = at.expanded_params(torch.float32)
    safe = torch.where(s_full > 0, s_full, torch.ones_like(s_full))
    codes = torch.where(s_full > 0, torch.round((xf - z_full) / safe), torch.zeros_like(xf))
    codes = codes.clamp_(0, enc.max_code).to(torch.uint8)
    return AffineTensor(_pack(codes, enc.bits), scale, zero, enc, d)   # codes clamped: no checks
