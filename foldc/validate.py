"""The one validation layer of foldc's public entry points: compiled attention callables, the
serving caches and wrappers, `merge_attention`, the torch ops. Each check runs on the host before
any data is touched, names the argument, the value and the fix, and raises a `FoldError`.

Rules shared by every entry point (one function each, so the messages agree):

- `check_sm_scale`: a real, finite number (not text, not a bool) within float32's range (the kernels'
  sm_scale * log2(e) is a float32); None means head_dim ** -0.5.
- `check_out`: a floating-point tensor of the wanted shape, one of the allowed dtypes, on the
  wanted device, unit stride along the last axis, no two elements sharing memory.
- `check_call`: q, k, v and seq_lens of one attention call against its spec, and an out that
  shares no memory with them (`check_no_overlap`).
- `check_merge_parts`: the (out, lse) parts of `foldc.merge_attention`.

Values that come from the data itself (a NaN key, a NaN query) are not refused here: the
kernels propagate them as NaN."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from .encoding import AffineTensor
from .errors import InputError, InputTypeError, UnsupportedError
from .spec import AttentionSpec


#: the largest |sm_scale|: the kernels take sm_scale * log2(e) as a float32
MAX_SM_SCALE = float(torch.finfo(torch.float32).max) / math.log2(math.e)


#: the outputs `foldc.merge_attention` takes: those attention writes (torch has no isfinite of float8)
MERGE_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: the dtypes seq_lens may come in (torch has no min/max of complex or of 32- and 64-bit unsigned integers)
SEQ_LENS_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)


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
        if x.encoding is not enc and x.encoding != enc:
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
        if x.layout != torch.strided:   # (the float64 executor raised from inside torch: no storage)
            raise InputError(f"{name} is a tensor of layout {x.layout}; attention reads a dense cache: pass "
                             f"{name}.to_dense()")
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
               q_dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64), out=None,
               read_lens: bool = True) -> CallShape:
    """q, k, v and seq_lens of one attention call against its spec, and an ``out`` (given or None) that shares no
    memory with q, k or v (the kernel's programs write it while others still read them). ``read_lens=False``: the
    lengths' values are not checked (a custom op's fake implementation, whose tensors hold none)."""
    if not isinstance(q, torch.Tensor):
        raise InputTypeError(f"q must be a torch.Tensor [batch, num_q_heads, head_dim], got {type(q).__name__}")
    if q.layout != torch.strided:   # (the float64 executor raised from inside torch's reshape)
        raise InputError(f"q is a tensor of layout {q.layout}; attention takes dense queries: pass q.to_dense()")
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
    sm_scale = check_sm_scale(sm_scale, spec.head_dim)
    lens = None
    if seq_lens is not None:
        try:
            lens = torch.as_tensor(seq_lens)
        except (TypeError, ValueError, RuntimeError):
            raise InputTypeError(f"seq_lens={seq_lens!r} must be an integer tensor (or list) of one length per "
                                 f"sequence, shape ({batch},)") from None
        if lens.layout != torch.strided or lens.is_meta:
            where = "on the meta device" if lens.is_meta else f"of layout {lens.layout}"
            raise InputError(f"seq_lens is a tensor {where}, whose lengths cannot be read; pass a dense integer "
                             f"tensor (or list) of shape ({batch},)")
        if lens.dtype not in SEQ_LENS_DTYPES:
            raise InputError(f"seq_lens dtype={lens.dtype} must be an integer type: one of "
                             f"{', '.join(map(str, SEQ_LENS_DTYPES))} (convert with .to(torch.int32))")
        if lens.shape != (batch,):
            raise InputError(f"seq_lens shape={tuple(lens.shape)} but q has batch={batch}; pass one length per sequence")
        # the value check reads the lengths on the host; inside a CUDA-graph capture it cannot, and
        # the kernels clamp to the cache anyway (a length past the cache reads nothing beyond it)
        if read_lens and not (lens.is_cuda and torch.cuda.is_current_stream_capturing()):
            lo, hi = torch.stack(torch.aminmax(lens)).tolist()   # one read of the device, not two
            if lo < 1:
                raise InputError(f"seq_lens holds {lo}; every sequence needs at least one token")
            if hi > nk:
                raise InputError(f"seq_lens holds {hi} but the cache holds {nk} tokens; lengths cannot exceed the "
                                 "cache")
        lens = lens.to(device=q.device, dtype=torch.int64)
    check_no_overlap(out, "out", q=q, k=k, v=v)
    return CallShape(batch, nk, sm_scale, lens)


def check_sm_scale(sm_scale, head_dim: int) -> float:
    """The softmax scale as a finite Python float; None gives ``head_dim ** -0.5``."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(sm_scale, torch.Tensor) and sm_scale.numel() == 1 and not sm_scale.is_complex():
        if sm_scale.is_meta:
            raise InputError(f"sm_scale is a tensor on the meta device, which holds no value; pass a float (such as "
                             f"{1.0 / math.sqrt(head_dim):.4g}), a tensor with its value, or None for head_dim ** -0.5")
        if sm_scale.requires_grad and torch.is_grad_enabled():   # .item() below would drop its gradient, silently
            raise InputError("sm_scale is a tensor that records gradients, and no target passes a gradient to the "
                             "softmax scale (it is read as a number); pass sm_scale.detach() or a float, or call "
                             "under torch.no_grad()")
        sm_scale = sm_scale.item()   # a 0-d or one-element tensor (reads the device once)
    # text would parse silently (float("0.1")), a bool is an int to Python: neither is a scale
    if isinstance(sm_scale, (str, bytes, bool)) or not isinstance(sm_scale, numbers.Real):
        raise InputTypeError(f"sm_scale={sm_scale!r} must be a real number (a float such as "
                             f"{1.0 / math.sqrt(head_dim):.4g}, or None for head_dim ** -0.5)")
    try:
        value = float(sm_scale)
    except OverflowError:   # an int past float64's range
        value, shown = None, f"(an int of {len(str(abs(int(sm_scale))))} digits)"
    else:
        shown = f"{value:g}"
    if value is not None and not math.isfinite(value):
        raise InputError(f"sm_scale={value} must be finite; pass a finite float, or None for head_dim ** -0.5 "
                         f"= {1.0 / math.sqrt(head_dim):.4g}")
    if value is None or abs(value) > MAX_SM_SCALE:   # the kernels' float32 sm_scale * log2(e) would be inf: NaN out
        raise InputError(f"sm_scale={shown} is beyond float32's range: the kernels take sm_scale * log2(e) as a "
                         f"float32, so |sm_scale| must be at most {MAX_SM_SCALE:.4g}; pass a smaller scale, or None "
                         f"for head_dim ** -0.5 = {1.0 / math.sqrt(head_dim):.4g}")
    return value


def check_out(out, want: tuple[int, ...], device: torch.device, dtypes: tuple[torch.dtype, ...],
              name: str = "out") -> torch.Tensor | None:
    """``out`` (or None) as a tensor a kernel may write ``want`` into: floating point, one of
    ``dtypes``, on ``device``, unit stride along the last axis. An integer or bool ``out`` would
    truncate the result, so it is refused, as is anything that is not a tensor."""
    if out is None:
        return None
    if not isinstance(out, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor {tuple(want)} or None, got {type(out).__name__}")
    if out.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise InputError(f"{name} dtype={out.dtype} cannot hold the result: use one of {allowed} (an integer or "
                         f"bool {name} would truncate it)")
    if tuple(out.shape) != tuple(want):
        raise InputError(f"{name} shape={tuple(out.shape)} but the result is {tuple(want)}")
    if out.device != device:
        raise InputError(f"{name} is on {out.device} but the result is computed on {device}; allocate it there")
    if out.numel() and out.stride(-1) != 1:
        raise InputError(f"{name} has strides {out.stride()}; it needs unit stride along its last axis "
                         f"(allocate it with torch.empty{tuple(want)})")
    if out.numel() and overlaps_itself(out):
        raise InputError(f"{name} has strides {out.stride()} for shape {tuple(out.shape)}: some of its elements "
                         f"share memory (a view made by expand?), so several results would land in one place; "
                         f"allocate it with torch.empty{tuple(want)}")
    return out


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory: its axes of more than one element, by stride, must each
    step past everything the shorter-strided axes reach (a dense or sliced tensor does; an expanded one, stride 0,
    does not). Layouts that interleave without overlapping are rare and count as overlapping here."""
    reach = 0   # elements spanned by the axes seen so far, less one
    for stride, size in sorted((abs(st), sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def last_byte(t: torch.Tensor, start: int) -> int:
    """The last byte address a non-empty tensor's elements touch (a contiguous tensor's without a loop)."""
    if t.is_contiguous():
        return start + t.nbytes - 1
    extent = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return start + (extent + 1) * t.element_size() - 1


def _span(t: torch.Tensor) -> tuple | None:
    """(first byte, last byte, element size, contiguous) of a non-empty tensor with addresses of its own, else None
    (empty, the meta device, or a subclass such as a tracer's fake tensors, whose addresses mean nothing)."""
    if type(t) is not torch.Tensor or t.is_meta or not t.numel():
        return None
    lo = t.data_ptr()
    contiguous = t.is_contiguous()
    return lo, last_byte(t, lo), t.element_size(), contiguous


def shared_memory_pair(tensors) -> tuple[int, int] | None:
    """The indices (i, j) of the first two of ``tensors`` that certainly have elements at a common address, or None,
    from addresses and strides alone (no loop over elements): their first elements coincide (one tensor, or views of
    it, passed twice), or an end element (first or last) of one lies in the bytes of the other where that other is
    contiguous (it covers its span). Views that interleave without touching (every other column each) are never
    named; others that interleave and do share some elements may pass."""
    spans = [_span(t) for t in tensors]
    for i, x in enumerate(spans):
        for j in range(i + 1, len(spans)):
            y = spans[j]
            if x is None or y is None or x[0] > y[1] or y[0] > x[1]:
                continue
            if x[0] == y[0]:
                return i, j
            for (x0, x1, size, _), (y0, y1, _, dense) in ((x, y), (y, x)):
                # the first element [x0, x0 + size) and the last [x1 - size + 1, x1] against a dense span [y0, y1]
                if dense and ((x0 <= y1 and x0 + size - 1 >= y0) or (x1 - size + 1 <= y1 and x1 >= y0)):
                    return i, j
    return None


def check_kernel_operands(q: torch.Tensor, k, v) -> None:
    """What a generated attention kernel reads as it lies in memory: every part of k and v contiguous, a plain side
    in q's dtype, q with unit stride along head_dim (the Triton launcher's call and the decode_attention op's fake,
    which refuses at trace time what the kernel refuses at run time)."""
    for name, x in (("k", k), ("v", v)):
        for t in (x.codes, x.scale, x.zero) if isinstance(x, AffineTensor) else (x,):
            if not t.is_contiguous():
                raise InputError(f"{name} must be contiguous (a part of it has strides {t.stride()}); "
                                 "call .contiguous() on it first")
        if not isinstance(x, AffineTensor) and x.dtype != q.dtype:
            raise InputError(f"{name} dtype={x.dtype} must match q dtype={q.dtype} for a plain operand")
    if q.stride(-1) != 1:
        raise InputError(f"q must have unit stride along head_dim; got strides {q.stride()}")


def check_no_overlap(out, name: str = "out", **inputs) -> None:
    """Refuse an output that shares memory with an input a kernel still reads while it writes (a GEMM's
    programs write y while others read x): the answer would be silently wrong. An AffineTensor input is
    checked by its codes, scales and zeros; inputs that are not tensors (None) are skipped."""
    if not isinstance(out, torch.Tensor):
        return
    if out.layout != torch.strided:   # (no memory to compare: torch raised from inside data_ptr)
        raise InputError(f"{name} is a tensor of layout {out.layout}; the kernels write a dense {name}: allocate it "
                         "with torch.empty, or pass none")
    if out.numel() == 0 or out.is_meta:   # meta: no memory (every address 0)
        return
    lo = out.data_ptr()
    hi = last_byte(out, lo)
    for what, t in inputs.items():
        parts = ((f"{what}.codes", t.codes), (f"{what}.scale", t.scale), (f"{what}.zero", t.zero)) \
            if isinstance(t, AffineTensor) else ((what, t),)
        for part, u in parts:
            if not isinstance(u, torch.Tensor) or u.is_meta:
                continue
            a = u.data_ptr()
            if a > hi or not u.numel():
                continue
            b = last_byte(u, a)
            if b >= lo:
                raise InputError(f"{name} shares memory with {part} (bytes {max(a, lo):#x}..{min(b, hi):#x}); the "
                                 f"kernel reads {part} while it writes {name}: pass a separate {name} "
                                 f"(torch.empty_like) or none")


def check_merge_parts(parts) -> None:
    """The parts of `foldc.merge_attention`: a non-empty list of (out [batch, heads, head_dim],
    lse [batch, heads]) floating-point tensor pairs of one shape and device, each lse float32 or float64."""
    if isinstance(parts, (torch.Tensor, str, bytes)) or not isinstance(parts, (list, tuple)):
        raise InputTypeError(f"parts must be a list of (out, lse) pairs, got {type(parts).__name__}")
    if not parts:
        raise InputError("merge_attention needs at least one (out, lse) part")
    first = None
    for i, part in enumerate(parts):
        if isinstance(part, torch.Tensor) or not isinstance(part, (list, tuple)) or len(part) != 2:
            raise InputTypeError(f"part {i} must be a pair (out, lse) as returned by attn(..., return_lse=True); "
                                 f"got {type(part).__name__}")
        o, s = part
        for what, t in (("out", o), ("lse", s)):
            if not isinstance(t, torch.Tensor):
                raise InputTypeError(f"part {i}: {what} must be a torch.Tensor, got {type(t).__name__}")
            if not t.is_floating_point():
                raise InputError(f"part {i}: {what} dtype={t.dtype} must be floating point")
            if t.layout != torch.strided:   # (the merge raised from inside torch: no ne, no isfinite)
                raise InputError(f"part {i}: {what} is a tensor of layout {t.layout}; the merge takes the dense "
                                 f"tensors attention returns: pass {what}.to_dense()")
        if o.dtype not in MERGE_OUT_DTYPES:   # (fp8: torch raised from inside isfinite, which it has not for them)
            raise InputError(f"part {i}: out dtype={o.dtype}: the merge takes the outputs attention writes, float16, "
                             f"bfloat16, float32 or float64; pass out.to(torch.float32)")
        if s.dtype not in (torch.float32, torch.float64):   # bf16 at lse 20 moves a part's weight by up to 6%
            raise InputError(f"part {i}: lse dtype={s.dtype}: a log-sum-exp rounded to 16 bits moves the parts' "
                             "weights exp(lse_i - lse) by up to 2**-8 x |lse| (6% at lse 20); pass the float32 lse "
                             "the attention call returned")
        if o.dim() != 3 or tuple(s.shape) != tuple(o.shape[:2]):
            raise InputError(f"part {i}: out {tuple(o.shape)} / lse {tuple(s.shape)}: out must be [batch, heads, "
                             "head_dim] and lse out.shape[:2]")
        if first is None:
            first = (o.shape, o.device)
            if s.device != o.device:
                raise InputError(f"part {i}: lse is on {s.device} but out is on {o.device}; keep each part's pair "
                                 "on one device")
        elif o.shape != first[0] or o.device != first[1] or s.device != first[1]:
            raise InputError(f"part {i}: out {tuple(o.shape)} on {o.device} does not match part 0's "
                             f"{tuple(first[0])} on {first[1]}; every part covers the same queries")


def output_buffer(out: torch.Tensor | None, want: tuple[int, ...], q: torch.Tensor) -> torch.Tensor:
    """The tensor a kernel writes its attention output into: ``out`` when given, else a new one in
    q's dtype. ``out`` may be q's dtype or float32; float32 keeps partial outputs unrounded for a
    later `foldc.merge_attention` (merging two bf16-rounded parts rounds twice)."""
    if out is None:
        return torch.empty(want, device=q.device, dtype=q.dtype)
    return check_out(out, want, q.device, tuple(dict.fromkeys((q.dtype, torch.float32))))


#: the fix a backward through the compiled GEMM names
GEMM_FIX = ("For gradients use foldc.nn.FoldLinear (torch.ops.foldc.linear has a backward), or call this kernel under "
            "torch.no_grad()")
#: the fix a backward through an attention kernel names (the float64 executor is torch ops: it has a backward)
ATTENTION_FIX = ("For gradients use target='reference' (the float64 executor, which has a backward), or call this "
                 "kernel under torch.no_grad()")
#: what a backward through a direct call of `foldc.compile`'s attention kernels names
ATTENTION_KERNEL = "the attention kernel (foldc.compile of an AttentionSpec)"


class _NoBackward(torch.autograd.Function):
    """y as computed, joined to the graph of the inputs it came from so that a backward through it raises instead of
    leaving those inputs' gradients out (the kernel's output had no grad_fn: a loss through it trained the rest of a
    model and silently never this path)."""

    @staticmethod
    def forward(ctx, y, what, fix, *inputs):
        ctx.what, ctx.fix = what, fix
        return y.view_as(y)

    @staticmethod
    def backward(ctx, *grads):
        raise UnsupportedError(f"{ctx.what} has no backward: its kernels compute inference only. {ctx.fix}")


def without_backward(y, x, what: str, fix: str = GEMM_FIX):
    """``y`` (a tensor, or a tuple of them: out and lse), the output of a kernel without a backward, computed from
    ``x`` (a tensor, or a tuple of the call's inputs; anything but a tensor ignored): unchanged unless gradients are
    being recorded for one of them, then views whose backward raises `UnsupportedError` naming ``what`` and ``fix``
    (`_NoBackward`) rather than drop those gradients silently. Callers on a hot path call it only when one of them
    requires grad (no torch call otherwise)."""
    if isinstance(x, torch.Tensor):   # (the GEMM's x: no tuple built per call)
        inputs = (x,) if x.requires_grad else ()
    else:
        inputs = tuple(t for t in x if isinstance(t, torch.Tensor) and t.requires_grad) if isinstance(x, tuple) else ()
    if not inputs or not torch.is_grad_enabled():
        return y
    if isinstance(y, tuple):
        return tuple(_NoBackward.apply(t, what, fix, *inputs) for t in y)
    return _NoBackward.apply(y, what, fix, *inputs)

