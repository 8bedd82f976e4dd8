"""`compile_gemm(spec, target)`: a callable ``y = gemm(x, w)``.

Targets as for attention: ``"reference"`` (float64 plan executor, float64 [m, n]), ``"sm_90"``,
``"sm_100"`` (a GPU), ``"interpret"`` (the generated Triton kernel under Triton's interpreter,
CPU, fp16), ``"auto"``.

On a GPU each call goes where its plan lowers: the register-operand GEMV (the attention kernel's
operand library, foldc/backends/gluon/gemv.py) takes calls of up to 16 rows of plain fp16/bf16
activations whose plan at that row count is an acc-fold; the generated Triton kernel takes the
rest (more rows, dequant verdicts of eq. 16, encoded activations). ``kernel="triton"`` or
``kernel="gluon"`` forces one (the latter raises for a call it does not take).
"""
from __future__ import annotations

import torch

from ..errors import InputError, SpecError
from ..validate import without_backward
from .plan import gemm_plan
from .reference import ReferenceGemm
from .spec import GemmSpec

TARGETS = ("reference", "auto", "sm_90", "sm_100", "interpret")
KERNELS = ("auto", "gluon", "triton")
GLUON_OPTIONS = ("block_rows", "gemv_split", "gemv_stages", "gemv_sub", "gemv_maxnreg", "gemv_warps",
                 "gemv_chunk_k")
TRITON_OPTIONS = ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages", "out_dtype", "fold_policy")


class GemmKernel:
    """The GPU GEMM callable: the register-operand GEMV where it lowers, the Triton kernel otherwise.
    Triton's options (block_m, block_n, block_k, split_k, num_warps, num_stages, out_dtype,
    fold_policy) go to the Triton kernel; block_rows, gemv_split, gemv_stages, gemv_sub, gemv_maxnreg, gemv_warps and
    gemv_chunk_k to the GEMV."""

    def __init__(self, spec: GemmSpec, target: str, kernel: str = "auto", **options):
        from ..backends.gluon.gemv_launch import GluonGemv
        from ..backends.triton.gemm_launch import TritonGemm

        if kernel not in KERNELS:
            raise SpecError(f"kernel={kernel!r} must be one of {KERNELS}")
        gluon = {k: options.pop(k) for k in GLUON_OPTIONS if k in options}
        self.spec, self.target, self.choice = spec, target, kernel
        self.triton = TritonGemm(spec, target, **options)
        uses_gluon = kernel != "triton" and options.get("fold_policy", "auto") == "auto" and spec.activation is None
        if kernel == "gluon" and not uses_gluon:
            raise SpecError(f"kernel='gluon' with {spec.describe()} and fold_policy="
                            f"{options.get('fold_policy', 'auto')!r}: the GEMV takes plain activations and the "
                            "plan's own fold; use kernel='auto'")
        self.gemv = GluonGemv(spec, target, gluon.get("block_rows"), gluon.get("gemv_split"),
                              gluon.get("gemv_stages"), gluon.get("gemv_sub"), gluon.get("gemv_maxnreg"),
                              gluon.get("gemv_warps"), gluon.get("gemv_chunk_k")) \
            if uses_gluon else None
        if gluon and self.gemv is None:
            raise SpecError(f"{sorted(gluon)}: options of the register-operand GEMV, which this kernel does not use")

    def uses_gemv(self, x, w=None) -> bool:
        """Whether a call with ``x`` (and ``w``: its alignment is checked too) runs the register-operand
        GEMV. With ``kernel="gluon"`` a call it does not take raises (the GEMV's own checks say why)."""
        if self.gemv is None or not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] == 0:
            return False   # (an AffineTensor, a NumPy array, no rows: the Triton launcher's checks say what to pass)
        if self.choice == "gluon":
            ok, why = self.gemv.lowers(x.dtype, x.shape[0])
            if not ok:
                raise InputError(f"kernel='gluon': a call with m={x.shape[0]} rows does not lower to the GEMV: {why}")
            return True
        return self.gemv.lowers(x.dtype, x.shape[0])[0] if w is None else self.gemv.takes(x, w)

    def __call__(self, x, w, out=None, counters=None):
        """``y = x @ w.T``; ``counters``: the GEMV's split-k counters from the caller (see
        `GluonGemv.__call__`), unused by the Triton kernels."""
        if self.uses_gemv(x, w):
            return without_backward(self.gemv(x, w, out=out, counters=counters), x,
                                    "the compiled GEMM (foldc.compile of a GemmSpec)")
        return self.triton(x, w, out=out)

    def gemv_for(self, m: int, dtype, device, w):
        """(GluonGemv, its launch, the weight's 2-D rows) for calls of ``m`` rows of ``dtype`` on ``device``
        with weight ``w`` (an AffineTensor), where `__call__` would send them to the GEMV; else None
        (`GluonGemv.bind`: `foldc.nn.FoldLinear`'s eager calls)."""
        bound = None if self.gemv is None else self.gemv.bind(m, dtype, device, w)
        return None if bound is None else (self.gemv, *bound)

    def plan_for(self, dtype=None, m: int | None = None):
        """The plan the call runs: the GEMV's at ``m`` rows of ``dtype`` (default fp16) where it takes them,
        else the Triton kernel's."""
        gemv_dtype = torch.float16 if dtype is None else dtype
        if m is not None and self.gemv is not None and self.gemv.lowers(gemv_dtype, m)[0]:
            return self.gemv.plan_for(gemv_dtype, m)
        return self.triton.plan_for(dtype, m) if dtype is not None else self.triton.plan_for(m=m)

    def source(self, *args, **kwargs) -> str:
        return self.triton.source(*args, **kwargs)


def compile_gemm(spec: GemmSpec, target: str = "reference", **options):
    if not isinstance(spec, GemmSpec):
        raise SpecError(f"spec must be a foldc.GemmSpec, got {type(spec).__name__}")
    if target not in TARGETS:
        raise SpecError(f"target={target!r} is not available; use one of {TARGETS}")
    if target == "reference":
        if options:
            raise SpecError(f"unknown option(s) {sorted(options)} for target='reference'; it takes none")
        return ReferenceGemm(gemm_plan(spec))
    unknown = sorted(set(options) - {"kernel"} - set(TRITON_OPTIONS) - set(GLUON_OPTIONS))
    if unknown:
        raise SpecError(f"unknown option(s) {unknown} for a GEMM on target={target!r}; options are kernel, "
                        f"{', '.join(TRITON_OPTIONS)} (Triton kernel), {', '.join(GLUON_OPTIONS)} (register-operand GEMV)")
    kernel = options.get("kernel", "auto")
    if isinstance(kernel, bool) or kernel not in KERNELS:
        raise SpecError(f"kernel={kernel!r} must be one of {KERNELS}")
    from ..targets import check_gpu_target, detect_target

    if target == "auto":
        target = detect_target()
    check_gpu_target(target)
    if target == "interpret":
        kernel = options.pop("kernel", "auto")
        bad = sorted(set(options) & set(GLUON_OPTIONS))
        if kernel == "gluon" or bad:
            raise SpecError(f"{'kernel=gluon' if kernel == 'gluon' else bad}: the register-operand GEMV runs on "
                            "sm_90 / sm_100 GPUs only (inline PTX); target='interpret' runs the Triton kernel")
        from ..backends.triton.gemm_launch import TritonGemm

        return TritonGemm(spec, target, **options)
    return GemmKernel(spec, target, **options)
