"""The GPU targets and the visible GPU's: which compute capability each target needs."""
from __future__ import annotations

import torch

from .errors import SpecError

GPU_TARGETS = {"sm_90": 9, "sm_100": 10}


def check_gpu_target(target: str) -> None:
    """For an sm_90 / sm_100 target: a GPU of that generation must be visible (else SpecError)."""
    if target not in GPU_TARGETS:
        return
    if not torch.cuda.is_available():
        raise SpecError(f"target={target!r} needs a CUDA GPU and none is visible; use target='interpret' "
                        "(CPU, fp16) or 'reference', or build ahead of time with `foldc compile`")
    major = torch.cuda.get_device_capability()[0]
    if major != GPU_TARGETS[target]:
        raise SpecError(f"target={target!r} but the GPU has compute capability {major}.x; use target='auto'")


def detect_target() -> str:
    """``sm_90`` or ``sm_100`` for the visible GPU, ``interpret`` without one."""
    if not torch.cuda.is_available():
        return "interpret"
    major = torch.cuda.get_device_capability()[0]
    for name, m in GPU_TARGETS.items():
        if m == major:
            return name
    raise SpecError(f"the GPU has compute capability {major}.x; foldc's Triton targets are sm_90 and sm_100")
