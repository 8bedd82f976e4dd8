"""GEMM as a registered workload (foldc/registry.py): what `foldc.plan`, `foldc.prove`,
`foldc.compile`, layout files and `foldc compile` call for a `GemmSpec`."""
from __future__ import annotations

import torch

from ..errors import SpecError
from ..options import check_launch_options
from ..registry import Workload, register_workload
from .compile import compile_gemm
from .explain import gemm_explain_table
from .plan import check_gemm_plan, gemm_plan
from .proof import prove_gemm
from .reference import gemm_reference, quantize_2d
from .spec import GemmSpec, gemm_spec_from_table

CHECK_ROWS = 4       # rows of x for a GEMM check when the layout leaves m symbolic


def _rel_l2(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def cli_options(spec: GemmSpec, target: str, kernel: str, block_n, num_warps, num_stages) -> tuple[str, dict]:
    """`foldc compile`'s flags for a GEMM layout: the generated Triton GEMM and its validated options."""
    if block_n is not None:
        raise SpecError(f"block_n={block_n!r} (--block-n) is the attention kernel's tokens per tile; a GEMM "
                        "layout takes its tiles from its launch configuration: drop --block-n")
    if kernel == "gluon":
        raise SpecError("kernel='gluon' (--kernel gluon): the register-operand kernel computes attention; a "
                        "GEMM layout runs the generated Triton kernel: drop --kernel")
    return "gemm", check_launch_options(target, "gemm", num_warps=num_warps, num_stages=num_stages)


def check(spec: GemmSpec, target: str, seed: int, gemm) -> tuple[str, bool]:
    """`foldc compile`'s check on fresh random inputs: the float64 plan executor against
    dequantize-then-matmul (reference), or the interpreter's kernel against the executor."""
    m = spec.m or CHECK_ROWS
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, spec.k, generator=gen) + 0.25
    w = torch.randn(spec.n, spec.k, generator=gen) * 0.5
    xq = quantize_2d(x, spec.activation) if spec.activation else x.half()
    wq = quantize_2d(w, spec.weight)
    want = compile_gemm(spec, target="reference")(xq, wq)
    if target == "reference":
        err = _rel_l2(want, gemm_reference(xq, wq))
        return (f"checked: float64 plan executor vs dequantize-then-matmul, m={m}: rel L2 {err:.2e}", err < 1e-12)
    got = gemm(xq, wq)
    err, rounding = _rel_l2(got, want), _rel_l2(want.half(), want)
    return (f"checked: interpreter kernel vs float64 plan executor, m={m}, seed {seed}: rel L2 {err:.2e} "
            f"(fp16 output rounding alone {rounding:.2e})", err < 3 * rounding + 1e-4)


def kernel_plan(spec: GemmSpec):
    from ..backends.triton.gemm_launch import gemm_kernel_plan

    return gemm_kernel_plan(spec)


def build(spec: GemmSpec, target: str, out, dtype: str, **options) -> dict:
    from ..backends.triton.gemm_aot import compile_gemm_aot

    return compile_gemm_aot(spec, target, out, dtype=dtype, **options)


WORKLOAD = register_workload(Workload(
    name="gemm", spec_type=GemmSpec, table="gemm", from_table=gemm_spec_from_table, plan=gemm_plan,
    prove=prove_gemm, compile=compile_gemm, explain=gemm_explain_table, kernel_plan=kernel_plan,
    cli_options=cli_options, check=check, build=build, artifact="foldc_gemm", check_plan=check_gemm_plan))
