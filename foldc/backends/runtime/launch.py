"""`Launch`: what one call of a compiled attention kernel launches, decided once per shape on the host.

Both attention backends split the cache into whole tiles per split (eq. 14's partition) and keep a
float32 workspace of per-split maxima, denominators and accumulators that the merge kernel reads;
the arithmetic is here once. A backend's ``plan_launch(...)`` returns a `Launch` and its ``run(launch,
...)`` launches it with no validation, no host synchronisation and no allocation when ``workspace``
is given; serving code holds a `Launch` between calls (foldc/serving/paged.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch


@dataclass(frozen=True)
class Launch:
    """One call's launch: grid ``(batch, head_programs, splits)``, ``per_split`` tokens per split
    (whole ``block_n``-token tiles), ``cache_tokens`` the splits cover, the workspace's ``rows`` per
    program and ``head_dim`` columns, ``page`` tokens per page (0: a contiguous cache), ``has_lens``
    (the kernel reads per-sequence lengths) and ``options``: the backend's specialisation for it
    (tile, stages, register cap, compile-time constants), read only by that backend."""

    kernel: str
    dtype: torch.dtype
    batch: int
    head_programs: int
    splits: int
    per_split: int
    block_n: int
    cache_tokens: int
    rows: int
    head_dim: int
    page: int = 0
    has_lens: bool = False
    options: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.batch, self.head_programs, self.splits)

    @property
    def workspace_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(max, denominator, accumulator) per program and split, float32."""
        m = (self.batch, self.head_programs, self.splits, self.rows)
        return m, m, m + (self.head_dim,)


def split_partition(tokens: int, splits: int, block_n: int) -> tuple[int, int]:
    """(splits, tokens per split) covering ``tokens`` with about ``splits`` splits of whole tiles:
    the split count is what the rounded-up split length needs (at least 1)."""
    per_split = math.ceil(math.ceil(max(tokens, 1) / splits) / block_n) * block_n
    return max(1, math.ceil(tokens / per_split)), per_split


def allocate_workspace(launch: Launch, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fresh float32 workspace for ``launch`` on ``device``."""
    m, _, acc = launch.workspace_shapes
    ws_m = torch.empty(m, device=device, dtype=torch.float32)
    return ws_m, torch.empty_like(ws_m), torch.empty(acc, device=device, dtype=torch.float32)


def workspace_fits(workspace, launch: Launch) -> bool:
    """Whether ``workspace`` (a tuple of three tensors, or None) has ``launch``'s shapes."""
    return workspace is not None and tuple(tuple(t.shape) for t in workspace) == launch.workspace_shapes


def side_key(x) -> tuple:
    """What a decode kernel's specialisation and integer arguments take from one side of the cache (a
    plain tensor or an AffineTensor): its tensors' dtypes and strides (a bound launch's key)."""
    if isinstance(x, torch.Tensor):
        return x.dtype, x.stride()
    codes, scale = x.codes, x.scale
    return codes.dtype, codes.stride(), scale.dtype, scale.stride(), x.zero.dtype


# torch's C functions behind torch.cuda's current-stream calls, without their Python frames (a decode step calls
# them every layer; None in a torch built without CUDA): device index -> the current stream's raw handle, and
# whether the current stream is capturing a CUDA graph
RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
STREAM_CAPTURING = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


def stream_handle(device: torch.device) -> int:
    """The raw handle of ``device``'s current CUDA stream (0 off the GPU, where the interpreter has one)."""
    return RAW_STREAM(device.index) if device.type == "cuda" else 0


def capturing(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s device's current stream is capturing a CUDA graph (False off the GPU):
    torch.cuda.is_current_stream_capturing() without the wrapper's Python frames (a tensor on the GPU means
    CUDA is initialised)."""
    return tensor.is_cuda and STREAM_CAPTURING()


class Scratch:
    """The workspace and log-sum-exp buffer of a kernel's eager calls, kept between calls: one set per
    CUDA stream, replaced when a call's launch needs other shapes. Calls on one stream run in order, so
    each may reuse the buffers of the one before (a new allocation per call was a third of an eager
    call's host time on the H200). Fresh buffers, not kept, inside a CUDA-graph capture (the graph
    keeps them) and for a call that hands its lse to the caller (``fresh``)."""

    __slots__ = ("_held",)

    def __init__(self):
        self._held: dict = {}   # stream handle -> (launch, workspace, lse)

    def get(self, launch: Launch, device: torch.device, lse_shape: tuple[int, int], *, fresh: bool = False,
            stream: int | None = None):
        """(workspace, lse) for ``launch`` on ``device``'s current stream (or the raw handle ``stream``)."""
        cuda = device.type == "cuda"
        if fresh or (cuda and STREAM_CAPTURING()):
            return allocate_workspace(launch, device), torch.empty(lse_shape, device=device, dtype=torch.float32)
        if stream is None:   # the CPU (the interpreter) has one stream
            stream = stream_handle(device)
        held = self._held.get(stream)
        if held is not None and (held[0] is launch or (held[0].workspace_shapes == launch.workspace_shapes
                                                       and tuple(held[2].shape) == lse_shape)):
            return held[1], held[2]
        workspace = allocate_workspace(launch, device)
        lse = torch.empty(lse_shape, device=device, dtype=torch.float32)
        self._held[stream] = (launch, workspace, lse)
        return workspace, lse
