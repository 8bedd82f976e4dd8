"""32-bit element offsets: what a kernel that addresses a tensor with int32 arithmetic can reach.

Triton and Gluon compute ``index * stride`` in int32 when both are int32 (a launch passes an integer
under 2**31 as int32), and an offset past 2**31 - 1 wraps: the kernel reads or writes the wrong memory
with no error. Kernels whose hot loops keep 32-bit offsets (the Gluon attention and GEMV kernels) are
guarded here instead: their launchers refuse a tensor whose largest offset passes the limit.
"""
from __future__ import annotations

import torch

from ...errors import InputError

INT32_MAX = 2**31 - 1


def last_offset(t, dims: int = 0) -> int:
    """The largest element offset from ``t``'s first element to one of its elements, over its dims from
    ``dims`` on (the earlier dims' offsets being 64-bit in the kernel); -1 for an empty tensor."""
    shape, strides = tuple(t.shape), t.stride()
    if any(s == 0 for s in shape):
        return -1
    return sum((s - 1) * st for s, st in zip(shape[dims:], strides[dims:]))


def check_offsets(kernel: str, tensors: dict, fix: str) -> None:
    """Refuse a call where a tensor's largest element offset (``tensors``: name -> the offset, or a tensor
    whose `last_offset` it is) passes the 32-bit limit of ``kernel``'s addressing; ``fix`` says what to do."""
    for name, t in tensors.items():
        offset = t if isinstance(t, int) else last_offset(t)
        if offset > INT32_MAX:
            raise InputError(f"{name} reaches element offset {offset}, past the {kernel}'s 32-bit offsets (limit "
                             f"{INT32_MAX} = 2**31 - 1: a larger offset would wrap and read the wrong memory); {fix}")


DECODE_FIX = ("split the batch into calls of fewer sequences, hold the cache in a paged pool (foldc.serving: "
            "page offsets are 64-bit), or compile with kernel='triton' (64-bit batch and head offsets)")


def decode_offsets(q, k, v, ws, paged: tuple | None = None) -> dict:
    """The largest element offset the register-operand decode kernels compute in int32 per tensor (a
    32-bit word of codes, a scale, a query or workspace element): the whole tensor's, but a page pool's
    within one page (the page's offset is 64-bit). The kernels stay 32-bit: 64-bit batch bases would cost
    instructions in their token loops."""
    dims = 1 if paged is not None else 0
    out = {"q": last_offset(q), "workspace": last_offset(ws[2])}
    for side, x in (("k", k), ("v", v)):
        if isinstance(x, torch.Tensor):
            out[side] = last_offset(x.view(torch.int32), dims)
        else:
            out.update({f"{side}.codes (32-bit words)": last_offset(x.codes.view(torch.int32), dims),
                        f"{side}.scale": last_offset(x.scale, dims), f"{side}.zero": last_offset(x.zero, dims)})
    return out
