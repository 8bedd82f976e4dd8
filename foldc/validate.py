"""Checks every compiled attention callable runs before touching data: shapes, dtypes,
encodings, devices, sequence lengths. Each error names the argument, the value and the fix."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .encoding import AffineTensor
from .errors import InputError, InputTypeError
from .spec import AttentionSpec


@dataclass(frozen=True)
class CallShape:
    batch: int
    tokens: int
    sm_scale: float
    seq_lens: torch.Tensor | None  # int64 on the cache's device, or None (= all tokens)


def _check_cache(name: str, x, enc, spec: AttentionSpec, batch: int, device) -> int:
    if enc is not None:
        if not isinstance(x, AffineTensor):
            raise InputTypeError(f"{name} must be a foldc.AffineTensor encoded as {enc.short()} "
                                 f"(spec.{name}); got {type(x).__name__}. Build it with foldc.quantize({name}, spec.{name})")
        if x.encoding != enc:
            raise InputError(f"{name} was quantized as {x.encoding.short()} (scale {x.encoding.scale_dtype}) but the "
                             f"spec says {enc.short()} (scale {enc.scale_dtype}); re-quantize or compile another spec")
        shape = x.shape
    else:
        if isinstance(x, AffineTensor):
            raise InputTypeError(f"{name} is an AffineTensor but spec.{name} is None (plain); pass "
                                 f"{name}.dequantize() or compile a spec with {name}={x.encoding.short()!r}")
        if not isinstance(x, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise InputError(f"{name} dtype={x.dtype} must be floating point")
        shape = tuple(x.shape)
    want = (batch, spec.num_kv_heads, "tokens", spec.head_dim)
    if len(shape) != 4 or shape[0] != batch or shape[1] != spec.num_kv_heads or shape[3] != spec.head_dim:
        raise InputError(f"{name} shape={tuple(shape)} but the spec and q need {want}")
    if shape[2] < 1:
        raise InputError(f"{name} holds tokens={shape[2]}; attention needs at least one cached token")
    if x.device != device:
        raise InputError(f"{name} is on {x.device} but q is on {device}; move both to one device")
    return shape[2]


def check_call(spec: AttentionSpec, q, k, v, sm_scale, seq_lens,
               q_dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64)) -> CallShape:
    if not isinstance(q, torch.Tensor):
        raise InputTypeError(f"q must be a torch.Tensor [batch, num_q_heads, head_dim], got {type(q).__name__}")
    if q.dim() != 3 or q.shape[1] != spec.num_q_heads or q.shape[2] != spec.head_dim:
        raise InputError(f"q shape={tuple(q.shape)} but the spec needs [batch, {spec.num_q_heads}, {spec.head_dim}]")
    if q.dtype not in q_dtypes:
        raise InputError(f"q dtype={q.dtype} is not supported here; use one of {list(q_dtypes)}")
    batch = q.shape[0]
    if batch < 1:
        raise InputError(f"q has batch={batch}; pass at least one sequence")
    nk = _check_cache("k", k, spec.k, spec, batch, q.device)
    nv = _check_cache("v", v, spec.v, spec, batch, q.device)
    if nk != nv:
        raise InputError(f"k holds {nk} tokens but v holds {nv}; they must match")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(spec.head_dim)
    try:
        if isinstance(sm_scale, (str, bytes)):  # float("0.5") would parse text silently
            raise TypeError
        sm_scale = float(sm_scale)
    except (TypeError, ValueError):
        raise InputTypeError(f"sm_scale={sm_scale!r} must be a float") from None
    if not math.isfinite(sm_scale):
        raise InputError(f"sm_scale={sm_scale} must be finite")
    lens = None
    if seq_lens is not None:
        try:
            lens = torch.as_tensor(seq_lens)
        except (TypeError, ValueError, RuntimeError):
            raise InputTypeError(f"seq_lens={seq_lens!r} must be an integer tensor (or list) of one length per "
                                 f"sequence, shape ({batch},)") from None
        if lens.dtype.is_floating_point or lens.dtype == torch.bool:
            raise InputError(f"seq_lens dtype={lens.dtype} must be an integer type")
        if lens.shape != (batch,):
            raise InputError(f"seq_lens shape={tuple(lens.shape)} but q has batch={batch}; pass one length per sequence")
        # the value check reads the lengths on the host; inside a CUDA-graph capture it cannot, and
        # the kernels clamp to the cache anyway (a length past the cache reads nothing beyond it)
        if not (lens.is_cuda and torch.cuda.is_current_stream_capturing()):
            lo, hi = int(lens.min()), int(lens.max())
            if lo < 1:
                raise InputError(f"seq_lens holds {lo}; every sequence needs at least one token")
            if hi > nk:
                raise InputError(f"seq_lens holds {hi} but the cache holds {nk} tokens; lengths cannot exceed the "
                                 "cache")
        lens = lens.to(device=q.device, dtype=torch.int64)
    return CallShape(batch, nk, sm_scale, lens)


def output_buffer(out: torch.Tensor | None, want: tuple[int, ...], q: torch.Tensor) -> torch.Tensor:
    """The tensor a kernel writes its attention output into: ``out`` when given, else a new one in
    q's dtype. ``out`` may be q's dtype or float32; float32 keeps partial outputs unrounded for a
    later `foldc.merge_attention` (merging two bf16-rounded parts rounds twice)."""
    if out is None:
        return torch.empty(want, device=q.device, dtype=q.dtype)
    if not isinstance(out, torch.Tensor):
        raise InputTypeError(f"out must be a torch.Tensor {want}, got {type(out).__name__}")
    if (tuple(out.shape) != tuple(want) or out.dtype not in (q.dtype, torch.float32) or out.device != q.device
            or out.stride(-1) != 1):
        raise InputError(f"out has shape={tuple(out.shape)}, dtype={out.dtype}, device={out.device}, strides "
                         f"{out.stride()}; it must be {tuple(want)} in q's dtype {q.dtype} or float32, on "
                         f"{q.device}, with unit stride along head_dim")
    return out
