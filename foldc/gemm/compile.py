"""`compile_gemm(spec, target)`: a callable ``y = gemm(x, w)``.

Targets as for attention: ``"reference"`` (float64 plan executor, float64 [m, n]), ``"sm_90"``,
``"sm_100"`` (the generated Triton kernel on a GPU), ``"interpret"`` (the same kernel under
Triton's interpreter, CPU, fp16), ``"auto"``.
"""
from __future__ import annotations

from ..errors import SpecError
from .plan import gemm_plan
from .reference import ReferenceGemm
from .spec import GemmSpec

TARGETS = ("reference", "auto", "sm_90", "sm_100", "interpret")


def compile_gemm(spec: GemmSpec, target: str = "reference", **options):
    if not isinstance(spec, GemmSpec):
        raise SpecError(f"spec must be a foldc.GemmSpec, got {type(spec).__name__}")
    if target not in TARGETS:
        raise SpecError(f"target={target!r} is not available; use one of {TARGETS}")
    if target == "reference":
        if options:
            raise SpecError(f"unknown option(s) {sorted(options)} for target='reference'; it takes none")
        return ReferenceGemm(gemm_plan(spec))
    from ..targets import check_gpu_target, detect_target

    if target == "auto":
        target = detect_target()
    check_gpu_target(target)
    from ..backends.triton.gemm_launch import TritonGemm

    return TritonGemm(spec, target, **options)
