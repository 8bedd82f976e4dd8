"""`compile_gemm(spec, target)`: a callable ``y = gemm(x, w)``.

Targets as for attention: ``"reference"`` (float64 plan executor, float64 [m, n]), ``"sm_90"``,
``"sm_100"`` (the generated Triton kernel on a GPU), ``"interpret"`` (the same kernel under
Triton's interpreter, CPU, fp16), ``"auto"``.
"""
from __future__ import annotations

import torch

from ..errors import SpecError
from .plan import gemm_plan
from .reference import ReferenceGemm
from .spec import GemmSpec

TARGETS = ("reference", "auto", "sm_90", "sm_100", "interpret")
GPU_TARGETS = {"sm_90": 9, "sm_100": 10}


def compile_gemm(spec: GemmSpec, target: str = "reference", **options):
    if not isinstance(spec, GemmSpec):
        raise SpecError(f"spec must be a foldc.GemmSpec, got {type(spec).__name__}")
    if target not in TARGETS:
        raise SpecError(f"target={target!r} is not available; use one of {TARGETS}")
    if target == "reference":
        if options:
            raise SpecError(f"unknown option(s) {sorted(options)} for target='reference'; it takes none")
        return ReferenceGemm(gemm_plan(spec))
    if target == "auto":
        from ..compile import detect_target

        target = detect_target()
    if target in GPU_TARGETS:
        if not torch.cuda.is_available():
            raise SpecError(f"target={target!r} needs a CUDA GPU and none is visible; use target='interpret' "
                            "(CPU, fp16) or 'reference', or build ahead of time with `foldc compile`")
        major = torch.cuda.get_device_capability()[0]
        if major != GPU_TARGETS[target]:
            raise SpecError(f"target={target!r} but the GPU has compute capability {major}.x; use target='auto'")
    from ..backends.triton.gemm_launch import TritonGemm

    return TritonGemm(spec, target, **options)
