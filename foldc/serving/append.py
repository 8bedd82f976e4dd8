"""Quantize-on-append: a Triton kernel that quantizes new KV tokens straight into preallocated
`foldc.AffineTensor` storage, bit for bit as `foldc.quantize` would.

``append_quantized(dst, x, offset)`` writes ``x [batch, kv_heads, T, head_dim]`` into
``dst`` at tokens ``[offset, offset + T)`` (``offset`` an int, or an int tensor of one offset per
batch row for ragged batches):

- token-wise encodings (groups along head_dim): any ``T``; each token's row is quantized on its own.
- channel-wise encodings (groups along tokens): ``T`` and every offset must be multiples of
  ``group_size``: a group's scale/zero is the per-channel min/max over its ``group_size`` tokens,
  so only whole groups can be written (callers keep a partial group in the model dtype).

``append_paged(pool, x, kv_indptr, kv_indices, start, page_size=P, counts=None)`` is the same
quantization into a page pool (foldc/serving/paged.py): the same two kernels, whose PAGED mode maps
each token position through the page table, and whose ``counts`` let one launch write a
data-dependent number of tokens per sequence. Neither it nor ``append_quantized(..., check=False)``
reads anything from the device, so both can be captured in a CUDA graph.

Numerics (exactly those of `foldc.quantize`): ``zero = min`` and ``scale = (max - min) / (2**bits - 1)``
(float32, correctly rounded division), both rounded to nearest-even into ``scale_dtype``; codes are
``round_half_even((x - zero) / scale)`` computed in float32 against the ROUNDED pair, clamped to
``[0, 2**bits - 1]``; a group with ``scale == 0`` gets codes 0. Codes are packed planar (byte ``j``,
bit field ``i`` holds channel ``i * head_dim / k + j``, see foldc/encoding.py).

How the kernel stays exact on every backend: divisions use ``tl.math.div_rn`` (a plain ``/`` may be
an approximate division on the GPU); round-half-even is built from ``floor`` (no libdevice, which
the interpreter lacks); bf16 inputs and bf16 scales go through their bit patterns (an exact shift
in, a round-to-nearest-even on the bits out), so they are exact under Triton's interpreter too,
whose own bf16 is broken.
"""
from __future__ import annotations

import functools
import math
import os
import weakref
from dataclasses import dataclass

import torch

from ..backends.runtime.fast_launch import FastLaunch, keywords
from ..decisions import GroupAxis, token_group
from ..encoding import Affine, AffineTensor
from ..errors import InputError, InputTypeError, SpecError
from ..validate import overlaps_itself, shared_memory_pair
from .append_kernels import kernel as _kernel

TARGETS = ("auto", "interpret", "sm_90", "sm_100", "reference")
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SCALE_KIND = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
BLOCK_T_TOKEN = 16   # most tokens per program of the token-wise kernel
BLOCK_T_CHANNEL = 32  # tokens per step of the channel-wise kernel's loop over one group
# the position of ``offset`` in both kernels' arguments (foldc/serving/append_kernels.py), as `append_arguments`
# orders them: a bound launch takes it per call
OFFSET_ARG = 26


def resolve_target(target: str, device: torch.device) -> str:
    """``"interpret"``, ``"native"`` or ``"reference"`` for ``target`` on ``device``."""
    if target not in TARGETS:
        raise SpecError(f"target={target!r} is not available for the append kernel; use one of {TARGETS}")
    if target == "reference":
        return "reference"
    if target == "auto":
        return "native" if device.type == "cuda" else "interpret"
    if target == "interpret":
        if device.type != "cpu":
            raise InputError(f"target='interpret' runs on the CPU but the storage is on {device}; "
                             "use target='auto'")
        return "interpret"
    if device.type != "cuda":
        raise InputError(f"target={target!r} runs on a CUDA GPU but the storage is on {device}; "
                         "use target='interpret' (CPU) or 'auto'")
    return "native"


def safe_abs_limit(scale_dtype: torch.dtype) -> float:
    """Largest |x| for which no group can overflow ``scale_dtype`` (zero = min needs |x| <= max of
    the dtype; scale <= 2|x|/3 and max - min in float32 need 2|x| <= float32 max)."""
    return min(torch.finfo(scale_dtype).max, torch.finfo(torch.float32).max / 2)


def check_finite(x: torch.Tensor, name: str = "x") -> float:
    """max |x| (one device sync); InputError if x holds NaN or Inf."""
    m = float(x.abs().amax()) if x.numel() else 0.0
    if not math.isfinite(m):
        bad = (~torch.isfinite(x)).nonzero()[0].tolist()
        raise InputError(f"{name} holds NaN or Inf (first at index {bad}); only finite values can be "
                         "quantized into the cache")
    return m


def _offsets(offset, dst: AffineTensor, tokens: int, read_device: bool = True):
    """(scalar offset, None) or (None, per-row int64 offsets on dst's device), validated. Without
    ``read_device``, the values of an offset tensor are not read (no sync; the kernel skips tokens
    that would land outside dst)."""
    batch, cap, enc = dst.shape[0], dst.num_tokens, dst.encoding
    group = token_group(enc)   # channel-wise: offsets start groups of G tokens
    if isinstance(offset, torch.Tensor):
        if offset.dtype.is_floating_point or offset.dtype.is_complex or offset.dtype == torch.bool:
            raise InputError(f"offset dtype={offset.dtype} must be an integer type (token positions)")
        if tuple(offset.shape) != (batch,):
            raise InputError(f"offset shape={tuple(offset.shape)} but dst has batch={batch}; pass one token "
                             "offset per batch row, or an int")
        if offset.layout != torch.strided or (offset.is_meta and dst.device.type != "meta"):
            # (torch raised from inside the copy to dst's device: a meta tensor holds no values, a sparse one no
            # memory the kernel could read)
            where = "on the meta device" if offset.is_meta else f"of layout {offset.layout}"
            raise InputError(f"offset is a tensor {where}, whose values cannot be read; pass a dense integer tensor "
                             f"of one offset per batch row on {dst.device}, or an int")
        # contiguous: the kernel reads offset b at OFFSETS + b (a strided view would give other rows' values)
        per_row = offset.to(device=dst.device, dtype=torch.int64).contiguous()
        if not read_device:
            return None, per_row
        lo, hi = int(per_row.min()), int(per_row.max())   # (int64: torch has no min of uint16/32/64)
        if group and bool((per_row % group != 0).any()):
            bad = int(per_row[per_row % enc.group_size != 0][0])
            raise InputError(f"offset={bad} is not a multiple of group_size={enc.group_size}; channel-wise "
                             "groups are written whole, so every offset must start a group")
        scalar = None
    else:
        # (a SymInt: the int offset of a traced call, which torch.compile makes symbolic once it changes between
        # calls; the append_kv op's fake checks it as an int, and its errors name the value: int() below)
        if isinstance(offset, bool) or not isinstance(offset, (int, torch.SymInt)):
            raise InputTypeError(f"offset={offset!r} must be an int or an integer tensor of one offset per "
                                 "batch row")
        lo = hi = offset
        per_row = None
        scalar = offset
        if group and offset % group:
            raise InputError(f"offset={int(offset)} is not a multiple of group_size={enc.group_size}; channel-wise "
                             "groups are written whole, so the offset must start a group")
    if lo < 0:
        raise InputError(f"offset={int(lo)} is negative; token offsets start at 0")
    if hi + tokens > cap:
        raise InputError(f"writing {int(tokens)} tokens at offset {int(hi)} needs {int(hi + tokens)} token slots but "
                         f"dst holds {int(cap)}; allocate a larger cache or write fewer tokens")
    return scalar, per_row


def append_quantized(dst: AffineTensor, x: torch.Tensor, offset=0, *, target: str = "auto",
                     check: bool = True) -> None:
    """Quantize ``x [batch, kv_heads, T, head_dim]`` into ``dst`` at tokens ``[offset, offset + T)``.

    Args:
        dst: preallocated storage (its codes, scale and zero are written in place).
        x: new tokens, float16, bfloat16 or float32, on dst's device.
        offset: token position of x's first token, an int or an integer tensor [batch] (ragged rows).
            Channel-wise encodings need whole groups: T and every offset multiples of group_size.
        target: "auto" (GPU kernel on CUDA, interpreter on CPU), "interpret", "sm_90", "sm_100",
            or "reference" (foldc.quantize and a copy, any device).
        check: reject NaN/Inf and validate the values of an offset tensor (device syncs). With
            False nothing is read from the device, so the call can be captured in a CUDA graph:
            pass it only for values already checked; tokens an offset would put outside dst (or, for
            channel-wise encodings, off a group boundary) are then skipped, not written.

    The bits written equal ``foldc.quantize(x, dst.encoding)`` (for channel-wise encodings, the
    groups are x's runs of group_size tokens); tokens outside ``[offset, offset + T)`` and scale rows
    outside their groups are not touched.
    """
    tokens, scalar, per_row, mode = check_append(dst, x, offset, target, read_device=check)
    enc = dst.encoding
    if tokens == 0:
        return
    if check:
        m = check_finite(x)
        if m > safe_abs_limit(enc.scale_dtype):
            from ..encoding import quantize

            quantize(x, enc)  # raises exactly when foldc.quantize would (scale/zero overflow)
    if mode == "reference":
        _append_reference(dst, x, scalar, per_row)
        return
    check_unit_stride("dst", dst)
    if x.stride(-1) != 1:
        x = x.contiguous()
    _launch(dst, x, scalar, per_row, mode == "interpret")


def check_append(dst: AffineTensor, x: torch.Tensor, offset, target: str, read_device: bool = True):
    """(tokens, scalar offset, per-row offsets, mode) of an `append_quantized` call, its arguments checked; without
    ``read_device`` nothing is read from the device (`_offsets`; the ``append_kv`` op's fake implementation)."""
    if not isinstance(dst, AffineTensor):
        raise InputTypeError(f"dst must be a foldc.AffineTensor (preallocated storage), got {type(dst).__name__}")
    if not isinstance(x, torch.Tensor):
        raise InputTypeError(f"x must be a torch.Tensor [batch, kv_heads, tokens, head_dim], got {type(x).__name__}")
    enc, (batch, heads, _, head_dim) = dst.encoding, dst.shape
    if x.dim() != 4 or x.shape[0] != batch or x.shape[1] != heads or x.shape[3] != head_dim:
        raise InputError(f"x shape={tuple(x.shape)} but dst needs [{batch}, {heads}, tokens, {head_dim}]")
    if x.layout != torch.strided:   # (torch raised from inside the NaN check or the kernel's launch)
        raise InputError(f"x is a tensor of layout {x.layout}; appends quantize dense tokens: pass x.to_dense()")
    _check_rows(x)
    check_no_shared_elements("dst", dst)
    if x.dtype not in INPUT_DTYPES:
        raise InputError(f"x dtype={x.dtype} is not supported; use one of {list(INPUT_DTYPES)}")
    if x.device != dst.device:
        raise InputError(f"x is on {x.device} but dst is on {dst.device}; move x to {dst.device}")
    tokens, group = x.shape[2], token_group(enc)
    if group and tokens % group:
        raise InputError(f"x holds {tokens} tokens, not a multiple of group_size={enc.group_size}; channel-wise "
                         "groups are written whole (keep the partial group in the model dtype until it fills)")
    scalar, per_row = _offsets(offset, dst, tokens, read_device=read_device)
    return tokens, scalar, per_row, resolve_target(target, dst.device)


def _check_rows(x: torch.Tensor) -> None:
    """New tokens of at least one sequence and one head (as `foldc.quantize` and attention take them)."""
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise InputError(f"x shape={tuple(x.shape)} holds no rows (batch={x.shape[0]}, kv_heads={x.shape[1]}); "
                         "an append needs at least one sequence and one head: skip the call for an empty batch")


# storage whose parts were found apart (`check_no_shared_elements`), with their addresses then
_APART: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_no_shared_elements(what: str, storage: AffineTensor) -> None:
    """Storage whose parts hold each element at an address of its own: in an expanded part (stride 0) every
    token's write lands on the same bytes (the kernel's last write wins, silently; the reference's copy raises),
    and two parts at one address (``scale = zero = torch.zeros(...)``) hold whichever the append wrote last."""
    parts = (("codes", storage.codes), ("scale", storage.scale), ("zero", storage.zero))
    for name, t in parts:
        if not t.is_contiguous() and overlaps_itself(t):
            raise InputError(f"{what}.{name} has strides {t.stride()} for shape {tuple(t.shape)}: some of its elements "
                             "share memory (an expanded tensor), so appended tokens would overwrite one another; "
                             f"allocate it whole, e.g. {what}.{name}.contiguous() (keep that tensor as the storage)")
    codes, scale, zero = storage.codes, storage.scale, storage.zero
    if type(codes) is not torch.Tensor or type(scale) is not torch.Tensor or type(zero) is not torch.Tensor:
        return   # a tracer's fake tensors (the append_kv op's fake): no addresses
    # two parts at one address: checked once per storage object and addresses (a serving loop appends into the
    # same pools every step)
    addresses = (codes.data_ptr(), scale.data_ptr(), zero.data_ptr())
    if _APART.get(storage) == addresses:
        return
    pair = shared_memory_pair((codes, scale, zero))
    if pair is None:
        _APART[storage] = addresses
    else:
        name, other = parts[pair[0]][0], parts[pair[1]][0]
        raise InputError(f"{what}.{name} and {what}.{other} share memory (one tensor, or views of one, passed as "
                         f"both?): an append writes both, so one overwrites the other and the stored tokens "
                         f"dequantize wrong; give each part its own tensor, e.g. {what}.{other}.clone() "
                         "(keep that tensor as the storage)")


def check_unit_stride(what: str, storage: AffineTensor) -> None:
    """The kernels write each token's codes, scales and zeros at unit stride along the last dim (the other
    strides they take as given): storage with another last stride would get its bytes in the wrong places."""
    for name, t in (("codes", storage.codes), ("scale", storage.scale), ("zero", storage.zero)):
        if t.stride(-1) != 1:
            raise InputError(f"{what}.{name} must have unit stride along its last dim; got strides {t.stride()} "
                             f"for shape {tuple(t.shape)}: pass {what}.{name}.contiguous()")


@dataclass(frozen=True)
class AppendLaunch:
    """What one append launches, decided from the destination's encoding and the shapes alone:
    the kernel (``"token"``: a scale row per token; ``"channel"``: one per group of tokens), its grid
    and its compile-time constants. `plan_append` makes it (memoised), `run_append` launches it."""

    kernel: str
    grid: tuple[int, int]
    interpret: bool
    constants: tuple   # (name, value) pairs: the kernel's constexprs and num_warps


@functools.lru_cache(maxsize=1024)
def plan_append(enc, heads: int, head_dim: int, batch: int, tokens: int, x_bf16: bool, per_row: bool,
                page_size: int, counts: bool, interpret: bool, flag: bool = False, pair: bool | Affine = False,
                advance: bool = False) -> AppendLaunch:
    """The `AppendLaunch` writing ``tokens`` tokens of ``batch`` rows of ``heads`` heads into storage
    encoded as ``enc`` (``page_size`` > 0: a page pool; ``per_row``: one offset per row; ``counts``:
    tokens to write per row; ``flag``: store 1 to a flag where a scale or zero is not finite; ``pair``: a second
    operand of the same shapes in the same launch, in ``enc`` (``True``) or in the token-wise encoding given
    (an `Affine`), token-wise encodings only; ``advance``: the launch adds ``tokens`` to the per-row offsets itself,
    token-wise encodings with ``per_row`` and without ``counts``)."""
    common = dict(HEAD_DIM=head_dim, GROUP=enc.group_size, BITS=enc.bits, CPB=enc.codes_per_byte,
                  MAX_CODE=enc.max_code, X_BF16=x_bf16, SCALE_KIND=SCALE_KIND[enc.scale_dtype], PER_ROW=per_row,
                  PAGED=page_size > 0, PAGE_SIZE=page_size or 1, HAS_COUNT=counts,
                  WIDTH_P=_pow2(head_dim // enc.codes_per_byte), num_warps=4)
    if flag:
        common["HAS_FLAG"] = True
    if GroupAxis.of(enc) is GroupAxis.CHANNEL:   # token-wise: groups of channels, a scale row per token
        block_t = min(BLOCK_T_TOKEN, 1 << (tokens - 1).bit_length())
        common.update(BLOCK_T=block_t, **_token_constants(enc, head_dim))
        if pair is not False:
            common["PAIR"] = True
            second = _token_constants(_second_encoding(enc, pair), head_dim)
            common.update({f"{name}2": value for name, value in second.items()})
            common["SAME2"] = second == _token_constants(enc, head_dim)   # one encoding: one body
        if advance:
            if not per_row or counts:
                raise SpecError("advance=True moves per-row offsets on by the launch's tokens: it needs per_row=True "
                                "and counts=False")
            common["ADVANCE"] = True
        return AppendLaunch("token", ((2 if pair is not False else 1) * batch * heads, math.ceil(tokens / block_t)),
                            interpret, tuple(common.items()))
    if pair is not False or advance:
        raise SpecError(f"pair and advance=True take token-wise encodings only, not {enc.short()} (channel-wise "
                        "groups are written whole, a launch per operand)")
    common.update(BLOCK_T=min(BLOCK_T_CHANNEL, 1 << (enc.group_size - 1).bit_length()))
    return AppendLaunch("channel", (batch * heads, tokens // enc.group_size), interpret, tuple(common.items()))


def _token_constants(enc, head_dim: int) -> dict:
    """The token kernel's constexprs of one token-wise encoding (the pair's second gets them with a 2 appended)."""
    groups = head_dim // enc.group_size
    return dict(GROUP=enc.group_size, NUM_GROUPS=groups, BITS=enc.bits, CPB=enc.codes_per_byte, MAX_CODE=enc.max_code,
                SCALE_KIND=SCALE_KIND[enc.scale_dtype], GROUP_P=_pow2(enc.group_size), NUM_GROUPS_P=_pow2(groups),
                WIDTH_P=_pow2(head_dim // enc.codes_per_byte))


def _second_encoding(enc, pair) -> Affine:
    """The pair's second encoding: ``enc`` for ``pair=True``, else ``pair``, a token-wise `Affine`."""
    if pair is True:
        return enc
    if not isinstance(pair, Affine):
        raise SpecError(f"pair={pair!r} must be True (the values in the keys' encoding) or the values' foldc.Affine")
    if GroupAxis.of(pair) is not GroupAxis.CHANNEL:
        raise SpecError(f"pair={pair.short()} is channel-wise: the pair launch writes two token-wise encodings "
                        "only (groups along head_dim); append a channel-wise operand in whole groups on its own")
    return pair


def _kernel_views(dst: AffineTensor, x: torch.Tensor) -> tuple:
    """(x, codes, scale, zero) as the kernels read them: bf16 as its int16 bits."""
    xin = x.view(torch.int16) if x.dtype == torch.bfloat16 else x
    scale, zero = dst.scale, dst.zero
    if dst.encoding.scale_dtype == torch.bfloat16:
        scale, zero = scale.view(torch.int16), zero.view(torch.int16)
    return xin, dst.codes, scale, zero


def append_arguments(launch: AppendLaunch, dst: AffineTensor, x: torch.Tensor, scalar, per_row,
                     paging: tuple | None = None, counts: torch.Tensor | None = None,
                     flag: torch.Tensor | None = None, second: tuple | None = None,
                     arrivals: torch.Tensor | None = None) -> tuple:
    """(the kernel behind `FastLaunch`, its positional arguments, its keyword arguments) of `run_append`
    (``flag``: an int32 tensor the kernel stores 1 to, for a launch planned with ``flag=True``; ``second``:
    (dst2, x2) for a launch planned with ``pair``: x2 (x's shape and dtype, unit stride along head_dim) into dst2
    (dst's shape, the pair's second encoding), each with strides of its own, unchecked; ``arrivals``: int32
    ``[batch]``, zero, for a launch planned with ``advance=True``)."""
    xin, codes, scale, zero = _kernel_views(dst, x)
    offs = per_row if per_row is not None else codes  # not read unless PER_ROW
    indptr, indices = paging if paging is not None else (codes, codes)  # read only if PAGED
    pair = _kernel_views(*second) if second is not None else None   # read only if PAIR
    first = _strides(xin, codes, scale, zero)
    kwargs = keywords(launch)
    # the kernels' capacity: the tokens of contiguous storage, or a page pool's pages (a page index outside the
    # pool, or a pair's smaller pool, is not written)
    capacity = (min(dst.shape[0], second[0].shape[0]) if second is not None else dst.shape[0]) \
        if kwargs["PAGED"] else dst.num_tokens
    args = (xin, codes, scale, zero, offs, indptr, indices, counts if counts is not None else codes,
            flag if flag is not None else codes, *(pair if pair is not None else (codes,) * 4),
            arrivals if arrivals is not None else codes,   # (read if ADVANCE)
            *first, 0 if scalar is None else scalar)
    # the page table's entries (kv_indices' length): an entry index kv_indptr puts past it is never read
    entries = indices.numel() if paging is not None else 0
    if launch.kernel == "token":   # then the second operand's strides (the first's again where there is none)
        args += (x.shape[2], dst.shape[1], capacity, entries, *(_strides(*pair) if pair is not None else first))
    else:
        args += (dst.shape[1], capacity, entries)
    return _fast(launch.kernel, launch.interpret), args, kwargs


def _strides(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple:
    """The kernels' 12 strides of one operand: (batch, head, token) of x, codes, scale and zero."""
    return (*x.stride()[:3], *codes.stride()[:3], *scale.stride()[:3], *zero.stride()[:3])


def run_append(launch: AppendLaunch, dst: AffineTensor, x: torch.Tensor, scalar, per_row,
               paging: tuple | None = None, counts: torch.Tensor | None = None,
               flag: torch.Tensor | None = None, second: tuple | None = None,
               arrivals: torch.Tensor | None = None) -> None:
    """Launch ``launch`` (from `plan_append`), no checks: ``x`` into ``dst`` at ``scalar`` (an int) or
    ``per_row`` offsets; ``paging`` = (kv_indptr, kv_indices): dst is a page pool; ``counts``: tokens
    to write per row; ``flag``, ``second``, ``arrivals``: see `append_arguments`."""
    kernel, args, kwargs = append_arguments(launch, dst, x, scalar, per_row, paging, counts, flag, second, arrivals)
    if launch.interpret or os.environ.get("TRITON_INTERPRET"):
        from ..backends.runtime.modules import interpreter

        with interpreter(launch.interpret):
            kernel[launch.grid](*args, **kwargs)
    else:   # native mode already: no switch (the decode step's host path)
        kernel[launch.grid](*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _fast(name: str, interpret: bool):
    """The append kernel ``name`` behind `FastLaunch` (repeat launches skip triton's binder)."""
    return FastLaunch(_kernel(name, interpret))


def _launch(dst: AffineTensor, x: torch.Tensor, scalar, per_row, interpret: bool, paging: tuple | None = None,
            counts: torch.Tensor | None = None) -> None:
    """Plan and launch the append kernel of dst's layout. ``paging`` = (kv_indptr, kv_indices, page_size):
    dst is a page pool and positions map through the table; ``counts``: tokens to write per row."""
    launch = plan_append(dst.encoding, dst.shape[1], dst.shape[3], x.shape[0], x.shape[2], x.dtype == torch.bfloat16,
                         per_row is not None, paging[2] if paging is not None else 0, counts is not None, interpret)
    run_append(launch, dst, x, scalar, per_row, None if paging is None else paging[:2], counts)


def _pow2(n: int) -> int:
    """The power of two tl.arange takes for n (n itself when it is one)."""
    return 1 << (n - 1).bit_length()


def _append_reference(dst: AffineTensor, x: torch.Tensor, scalar, per_row) -> None:
    """foldc.quantize, then a copy into place (the exactness the kernel is held to)."""
    from ..encoding import quantize

    q = quantize(x, dst.encoding)
    tokens, enc, cap = x.shape[2], dst.encoding, dst.num_tokens
    starts = [scalar] * dst.shape[0] if per_row is None else per_row.tolist()
    for b, start in enumerate(starts):
        # what the kernels write of an unchecked offset (check=False): tokens inside [0, cap), channel-wise
        # groups whole, starting a group; the rest is skipped
        if GroupAxis.of(enc) is GroupAxis.CHANNEL:
            lo, hi = max(0, start), min(cap, start + tokens)
            if lo < hi:
                dst.codes[b, :, lo:hi] = q.codes[b, :, lo - start:hi - start]
                dst.scale[b, :, lo:hi] = q.scale[b, :, lo - start:hi - start]
                dst.zero[b, :, lo:hi] = q.zero[b, :, lo - start:hi - start]
            continue
        g = enc.group_size
        if start % g:
            continue
        lo, hi = max(0, start), min(cap // g * g, start + tokens)
        if lo < hi:
            dst.codes[b, :, lo:hi] = q.codes[b, :, lo - start:hi - start]
            dst.scale[b, :, lo // g:hi // g] = q.scale[b, :, (lo - start) // g:(hi - start) // g]
            dst.zero[b, :, lo // g:hi // g] = q.zero[b, :, (lo - start) // g:(hi - start) // g]


def append_paged(pool: AffineTensor, x: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                 start: torch.Tensor, *, page_size: int, counts: torch.Tensor | None = None,
                 target: str = "auto") -> None:
    """Quantize ``x`` into a page pool at each sequence's own token positions, with no host sync.

    Token t of sequence b lands at row ``(start[b] + t) % page_size`` of page
    ``kv_indices[kv_indptr[b] + (start[b] + t) // page_size]``, with the bits ``foldc.quantize(x)``
    gives (channel-wise: groups are x's runs of group_size tokens). A token whose page-table entry
    lies past the sequence's own pages, or names a page outside the pool, is not written (the kernel never
    writes outside them; `PagedDecodeWrapper.plan` checks a table on the host and refuses a bad one by name).
    Values are not checked for NaN/Inf (that needs a sync): a group holding one gets NaN scale and
    zero, so attention over it is NaN (never a finite wrong number); target "reference" raises.

    Parameters
    ----------
    pool : AffineTensor ``[num_pages, kv_heads, page_size, head_dim]``
        Page pool (uint8 codes, scale/zero in the encoding's dtype, each of unit stride along its last dim;
        `foldc.serving.page_pool`).
    x : torch.Tensor ``[batch, kv_heads, T, head_dim]``
        New tokens, float16, bfloat16 or float32, on the pool's device.
    kv_indptr : torch.Tensor, int32 ``[batch + 1]``
    kv_indices : torch.Tensor, int32 ``[kv_indptr[-1]]`` (or longer)
        FlashInfer page table (foldc/serving/paged.py), validated by `PagedDecodeWrapper.plan`. Here a table on
        the CPU (or target "reference") whose kv_indptr decreases or runs past kv_indices, or through whose entries
        the append would write one page twice (two sequences' entries naming it: a prefix shared on read), is
        refused by name; on the GPU (a check would sync) the kernel reads no entry past kv_indices' length and
        writes no token whose entry lies there, but a decreasing kv_indptr or a page written through two entries is
        not caught: the last write wins, silently (plan such a table with `PagedDecodeWrapper.plan`, which takes a
        page listed twice only as a full page before each listing sequence's last token, which appends at the
        sequences' ends never write; or give each writer a page of its own).
    start : torch.Tensor, int32 or int64 ``[batch]``
        Token position of x's first token in each sequence (device). Channel-wise encodings need a
        multiple of group_size (a group starts there). Not checked (a sync): tokens at negative
        positions, and channel-wise groups off a group boundary, are not written.
    page_size : int
        Tokens per page (channel-wise: a multiple of group_size).
    counts : torch.Tensor, int32 ``[batch]``, optional
        Sequence b writes only x's first ``counts[b]`` tokens (channel-wise: a multiple of group_size;
        not checked (a sync): only the whole groups within ``counts[b]`` are written): one launch writes a
        data-dependent number of tokens per row (e.g. 0 or one group), so decode steps can be captured in a
        CUDA graph.
    target : str
        "auto", "interpret", "sm_90", "sm_100" or "reference" (foldc.quantize and copies, host loop,
        synchronises).
    """
    write_paged(pool, x, kv_indptr, kv_indices, start, page_size=page_size, counts=counts, target=target)


def write_paged(pool: AffineTensor, x: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                start: torch.Tensor, *, page_size: int, counts: torch.Tensor | None = None, target: str = "auto",
                table_checked: bool = False) -> None:
    """`append_paged`; ``table_checked``: the table is one `PagedDecodeWrapper.plan` checked (a `PagedKVCache`'s own
    buffers), not read here again (a decode step reads nothing on the host)."""
    from ..backends.triton.paging import check_page_size_for

    if not isinstance(pool, AffineTensor):
        raise InputTypeError(f"pool must be a foldc.AffineTensor page pool, got {type(pool).__name__}")
    if not isinstance(x, torch.Tensor):
        raise InputTypeError(f"x must be a torch.Tensor [batch, kv_heads, tokens, head_dim], got {type(x).__name__}")
    if x.layout != torch.strided:   # (torch raised from inside the copy or the kernel's launch)
        raise InputError(f"x is a tensor of layout {x.layout}; appends quantize dense tokens: pass x.to_dense()")
    enc, (_, heads, rows, head_dim) = pool.encoding, pool.shape
    check_page_size_for(enc, page_size)
    if rows != page_size:
        raise InputError(f"pool holds pages of {rows} tokens but page_size={page_size}; pass the pool's page size")
    if x.dim() != 4 or x.shape[1] != heads or x.shape[3] != head_dim:
        raise InputError(f"x shape={tuple(x.shape)} but the pool needs [batch, {heads}, tokens, {head_dim}]")
    _check_rows(x)
    check_no_shared_elements("pool", pool)
    if x.dtype not in INPUT_DTYPES:
        raise InputError(f"x dtype={x.dtype} is not supported; use one of {list(INPUT_DTYPES)}")
    batch, tokens = x.shape[0], x.shape[2]
    kv_indptr, kv_indices, start, counts = (
        _table_tensor(name, t, n, batch, pool.device)
        for name, t, n in (("kv_indptr", kv_indptr, batch + 1), ("kv_indices", kv_indices, None),
                           ("start", start, batch), ("counts", counts, batch)))
    if x.device != pool.device:
        raise InputError(f"x is on {x.device} but the pool is on {pool.device}; move x there")
    mode = resolve_target(target, pool.device)
    if not table_checked and (mode == "reference" or kv_indptr.device.type == "cpu"):   # read with no device sync
        _check_indptr(kv_indptr, kv_indices.numel())
    group = token_group(enc)
    if group and tokens % group:
        raise InputError(f"x holds {tokens} tokens, not a multiple of group_size={enc.group_size}; channel-wise "
                         "groups are written whole (keep the partial group in the model dtype until it fills)")
    if tokens == 0:
        return
    if not table_checked and (mode == "reference" or kv_indptr.device.type == "cpu"):   # read with no device sync
        _check_pages_written_once(kv_indptr, kv_indices, start, counts, tokens, page_size, group, pool.shape[0])
    if mode == "reference":
        _append_paged_reference(pool, x, kv_indptr, kv_indices, start, page_size, counts)
        return
    check_unit_stride("pool", pool)
    if x.stride(-1) != 1:
        x = x.contiguous()
    _launch(pool, x, None, start, mode == "interpret", paging=(kv_indptr, kv_indices, page_size), counts=counts)


def _table_tensor(name: str, t, n: int | None, batch: int, device: torch.device) -> torch.Tensor | None:
    """A page-table argument of `append_paged` (None passes through): a 1-D int32/int64 tensor on the
    pool's device of ``n`` entries (None: any number), returned contiguous, since the kernel reads
    entry i at ``base + i`` (a strided view would give it other entries, no error)."""
    if t is None:
        return None
    what = f"shape ({n},) for x's batch={batch}" if n is not None else "shape [kv_indptr[-1]]"
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64) or t.dim() != 1 \
            or (n is not None and t.shape[0] != n):
        raise InputError(f"{name} must be an int32 tensor of {what}; got "
                         f"{type(t).__name__} {getattr(t, 'dtype', '')} {tuple(getattr(t, 'shape', ()))}")
    if t.layout != torch.strided:   # (the kernel reads entries at their addresses: a sparse tensor has none)
        raise InputError(f"{name} is a tensor of layout {t.layout}; pass a dense int32 tensor ({name}.to_dense())")
    if t.device != device:
        raise InputError(f"{name} is on {t.device} but the pool is on {device}; move it there")
    return t.contiguous()


def _check_indptr(kv_indptr: torch.Tensor, entries: int) -> None:
    """Every ``kv_indptr`` entry in ``[0, entries]`` (``kv_indices``' length), none below the one before: the kernel
    reads sequence b's page numbers at ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``, and one past the end read
    whatever memory follows as page numbers (tokens written into other sequences' pages, silently; the reference
    dropped them); a decrease gave one sequence no page (its tokens dropped) and the next the pages of those before
    it (written over theirs through the same entries, which the check of pages written twice does not see)."""
    lo, hi, step = torch.stack([*torch.aminmax(kv_indptr), kv_indptr.diff().min()]).tolist()
    if step < 0:
        b = int((kv_indptr.diff() < 0).nonzero()[0])
        raise InputError(f"kv_indptr decreases at sequence {b} ({int(kv_indptr[b])} -> {int(kv_indptr[b + 1])}); it "
                         "must be non-decreasing (a prefix sum of pages per sequence): sequence b owns entries "
                         "kv_indptr[b]:kv_indptr[b + 1], so a range that runs back gives the next sequence the pages "
                         "of those before it")
    if lo >= 0 and hi <= entries:
        return
    bad = lo if lo < 0 else hi
    at = int(((kv_indptr < 0) | (kv_indptr > entries)).nonzero()[0])
    raise InputError(f"kv_indptr[{at}]={bad} but kv_indices holds {entries} entries: sequence page ranges "
                     f"kv_indptr[b]:kv_indptr[b + 1] must lie in [0, {entries}] (kv_indptr[-1] <= len(kv_indices)); "
                     "pass the kv_indices this kv_indptr indexes")


def _check_pages_written_once(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, start: torch.Tensor,
                              counts: torch.Tensor | None, tokens: int, page_size: int, group: int | None,
                              num_pages: int) -> None:
    """No page that this append writes through two page-table entries: two sequences' entries naming one page, or
    one sequence's page listed twice. The kernel's programs write such a page in any order and the reference one
    entry after the other, so one entry's tokens are overwritten by the other's, silently. Only the entries the
    append writes through count (the positions of its tokens, as the kernels write them), so a shared page that
    no token lands on passes."""
    indptr, indices = kv_indptr.tolist(), kv_indices.tolist()
    lens = [tokens] * (len(indptr) - 1) if counts is None else [min(tokens, max(0, n)) for n in counts.tolist()]
    owner: dict = {}
    for b, (s0, n) in enumerate(zip(start.tolist(), lens)):
        if group:   # channel-wise: whole groups from a group boundary (the kernels skip the rest)
            if s0 % group:
                continue
            n = n // group * group
        lo, hi = max(s0, 0), s0 + n   # the positions written: [lo, hi), within the sequence's own entries
        for entry in range(indptr[b] + lo // page_size, min(indptr[b + 1], indptr[b] + (hi - 1) // page_size + 1)):
            page = indices[entry]
            if not 0 <= page < num_pages:   # not written
                continue
            b0, e0 = owner.setdefault(page, (b, entry))
            if e0 != entry:
                who = f"sequence {b}" if b0 == b else f"sequences {b0} and {b}"
                raise InputError(f"kv_indices[{e0}] and kv_indices[{entry}] both name page {page}, and this append "
                                 f"writes tokens of {who} through both: one entry's tokens would overwrite the "
                                 "other's; give every page-table entry a page of its own (as PagedDecodeWrapper.plan "
                                 "requires)")


def _append_paged_reference(pool, x, kv_indptr, kv_indices, start, page_size, counts) -> None:
    """foldc.quantize per sequence, then a copy into its pages (host loop)."""
    from ..encoding import quantize

    enc = pool.encoding
    indptr, indices = kv_indptr.tolist(), kv_indices.tolist()
    group = token_group(enc)
    for b in range(x.shape[0]):
        n = x.shape[2] if counts is None else min(x.shape[2], int(counts[b]))
        if group:   # channel-wise: the whole groups within the count (as the kernel)
            n = n // group * group
        if n <= 0:
            continue
        q = quantize(x[b:b + 1, :, :n], enc)
        s0 = int(start[b])
        if group and s0 % group:
            raise InputError(f"start[{b}]={s0} is not a multiple of group_size={enc.group_size}; channel-wise "
                             "groups are written whole, so every start must begin a group (the kernel skips such "
                             "groups)")
        owned = indices[indptr[b]:indptr[b + 1]]
        for t in range(n):
            pos = s0 + t
            if pos < 0:   # no page (as in the kernel): not written
                continue
            if pos // page_size >= len(owned):
                break
            page, row = owned[pos // page_size], pos % page_size
            if not 0 <= page < pool.shape[0]:   # a page outside the pool: not written (as in the kernel; a
                continue                        # negative index would wrap to the pool's last pages here)
            pool.codes[page, :, row] = q.codes[0, :, t]
            if GroupAxis.of(enc) is GroupAxis.CHANNEL:
                pool.scale[page, :, row] = q.scale[0, :, t]
                pool.zero[page, :, row] = q.zero[0, :, t]
            elif t % enc.group_size == 0:
                pool.scale[page, :, row // enc.group_size] = q.scale[0, :, t // enc.group_size]
                pool.zero[page, :, row // enc.group_size] = q.zero[0, :, t // enc.group_size]
