"""The merge of a cache's two attention parts (the quantized body and the plain sink and window) in one
kernel launch: eq. 14 over two (output, log-sum-exp) pairs, as `foldc.merge.merge_parts` computes it with
about twenty torch operations (each a launch and ~8 µs of host time on the H200; benchmarks/cache_step_host.py).

Per query row: ``m = max(lse0, lse1)``; the weights ``exp(lse_p - m) / sum`` are ``exp(lse_p - total)``
with ``total = m + log(sum)``; an empty part (lse -inf) adds exactly 0 (its output may be NaN), one whose weight
underflows to 0 keeps a NaN of its output;
no keys anywhere (both -inf) gives a zero row and -inf; NaN in either lse makes the row NaN. The
output is written in the caller's dtype (one rounding), the lse in float32.
"""
from __future__ import annotations

import os

import torch
import triton.language as tl

from ..backends.runtime.fast_launch import Bindings, FastLaunch
from ..backends.runtime.launch import capturing


def _merge_two_kernel(O0, L0, O1, L1, OUT, LSE, s0b, s0h, s1b, s1h, sob, soh, heads,
                      D: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (batch, query head): the two parts' rows weighted by their lse (eq. 14)."""
    pid = tl.program_id(0)
    b = (pid // heads).to(tl.int64)   # 64-bit: batch x stride may pass 2**31 - 1
    h = pid % heads
    l0 = tl.load(L0 + pid)
    l1 = tl.load(L1 + pid)
    m = tl.maximum(l0, l1, propagate_nan=tl.PropagateNan.ALL)
    empty = m == float("-inf")
    base = tl.where(empty, 0.0, m)
    e0 = tl.exp(l0 - base)
    e1 = tl.exp(l1 - base)
    total_e = tl.where(empty, 1.0, e0 + e1)   # (no keys: e0 = e1 = 0, both weights 0)
    w0 = e0 / total_e
    w1 = e1 / total_e
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    o0 = tl.load(O0 + b * s0b + h * s0h + d, mask=ok, other=0.0).to(tl.float32)
    o1 = tl.load(O1 + b * s1b + h * s1h + d, mask=ok, other=0.0).to(tl.float32)
    # an empty part (lse -inf; its output may be 0/0) adds exactly 0; one whose weight underflows keeps its NaN
    out = tl.where(l0 == float("-inf"), 0.0, w0 * o0) + tl.where(l1 == float("-inf"), 0.0, w1 * o1)
    tl.store(OUT + b * sob + h * soh + d, out.to(OUT.dtype.element_ty), mask=ok)
    tl.store(LSE + pid, tl.where(empty, float("-inf"), base + tl.log(total_e)))


_KERNELS: dict[bool, FastLaunch] = {}
_BINDINGS = Bindings(64)


def _kernel(interpret: bool) -> FastLaunch:
    if interpret not in _KERNELS:
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            _KERNELS[interpret] = FastLaunch(InterpretedFunction(_merge_two_kernel))
        else:
            from triton.runtime.jit import JITFunction

            _KERNELS[interpret] = FastLaunch(JITFunction(_merge_two_kernel))
    return _KERNELS[interpret]


def merge_two_parts(part0, part1, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [batch, heads, head_dim] in ``out_dtype``, lse [batch, heads] float32) of two parts' (out, lse),
    each out [batch, heads, head_dim] with unit stride along head_dim and each lse a contiguous float32
    [batch, heads] on one device; no checks (the caches' own parts). CPU tensors run Triton's interpreter."""
    (o0, l0), (o1, l1) = part0, part1
    l0, l1 = (x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous() for x in (l0, l1))
    b, heads, d = o0.shape
    out = torch.empty(b, heads, d, dtype=out_dtype, device=o0.device)
    lse = torch.empty(b, heads, dtype=torch.float32, device=o0.device)
    interpret = o0.device.type == "cpu"
    kernel = _kernel(interpret)
    grid = (b * heads,)
    s0, s1, so = o0.stride(), o1.stride(), out.stride()
    bindable = not interpret and not capturing(o0)   # (under capture: the keyed launch, as the decode's)
    key = (b, heads, d, o0.dtype, o1.dtype, out_dtype, s0, s1, o0.device.index)
    state = _BINDINGS.get(key, kernel) if bindable else None
    if type(state) is tuple and state and state[0]((o0.data_ptr(), l0.data_ptr(), o1.data_ptr(), l1.data_ptr(),
                                                   out.data_ptr(), lse.data_ptr())):
        return out, lse
    args = (o0, l0, o1, l1, out, lse, s0[0], s0[1], s1[0], s1[1], so[0], so[1], heads)
    kwargs = _keywords(d)
    if interpret or os.environ.get("TRITON_INTERPRET"):
        from ..backends.runtime.modules import interpreter

        with interpreter(interpret):
            kernel[grid](*args, **kwargs)
        return out, lse
    kernel[grid](*args, **kwargs)
    if bindable:
        _BINDINGS.note(key, kernel, state, lambda: (kernel.bind(grid, args, kwargs),))
    return out, lse


_KEYWORDS: dict[int, dict] = {}


def _keywords(d: int) -> dict:
    """The launch's constexprs, one dict object per head_dim (`FastLaunch` reads a dict it saw once only once)."""
    if d not in _KEYWORDS:
        _KEYWORDS[d] = dict(D=d, BLOCK_D=1 << (d - 1).bit_length(), num_warps=1)
    return _KEYWORDS[d]
