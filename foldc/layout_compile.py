"""`foldc compile LAYOUT.toml`: from a layout file to a proved plan and a verified kernel.

Steps, for an attention or a GEMM layout alike:

1. plan the layout with the passes the Triton backend uses (its code bias included, eq. 7) and
   print the explain table;
2. prove that plan with sympy (foldc.prove) and print the proof;
3. by target:
   - ``sm_90`` / ``sm_100``: build the generated kernel ahead of time (no GPU needed) into
     ``--out``: source, TTIR/TTGIR/LLIR, PTX, cubin and a JSON report;
   - ``interpret``: run the generated kernel under Triton's interpreter (CPU, fp16) on fresh
     random inputs and compare it with the float64 plan executor; the source goes to ``--out``;
   - ``reference``: run the float64 plan executor against dequantize-then-compute.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .errors import SpecError
from .gemm.spec import GemmSpec

TARGETS = ("sm_90", "sm_100", "interpret", "reference")
CHECK_ROWS = 4       # rows of x for a GEMM check when the layout leaves m symbolic
CHECK_TOKENS = 300   # cached tokens for an attention check


def _rel_l2(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def kernel_plan(spec, dtype: str):
    """The plan the Triton backend lowers for ``spec`` (with its code bias)."""
    if isinstance(spec, GemmSpec):
        from .backends.triton.gemm_launch import gemm_kernel_plan

        return gemm_kernel_plan(spec)
    from .backends.triton.launch import triton_plan

    return triton_plan(spec, dtype)


def explain(the_plan) -> str:
    if isinstance(the_plan.spec, GemmSpec):
        from .gemm.explain import gemm_explain_table

        return gemm_explain_table(the_plan)
    from .explain import explain_table

    return explain_table(the_plan)


def _check_gemm(spec: GemmSpec, target: str, seed: int) -> tuple[str, bool]:
    import foldc
    from .gemm.reference import gemm_reference, quantize_2d

    m = spec.m or CHECK_ROWS
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, spec.k, generator=gen) + 0.25
    w = torch.randn(spec.n, spec.k, generator=gen) * 0.5
    xq = quantize_2d(x, spec.activation) if spec.activation else x.half()
    wq = quantize_2d(w, spec.weight)
    want = foldc.compile(spec, target="reference")(xq, wq)
    if target == "reference":
        err = _rel_l2(want, gemm_reference(xq, wq))
        return (f"checked: float64 plan executor vs dequantize-then-matmul, m={m}: rel L2 {err:.2e}", err < 1e-12)
    got = foldc.compile(spec, target="interpret")(xq, wq)
    err, rounding = _rel_l2(got, want), _rel_l2(want.half(), want)
    return (f"checked: interpreter kernel vs float64 plan executor, m={m}, seed {seed}: rel L2 {err:.2e} "
            f"(fp16 output rounding alone {rounding:.2e})", err < 3 * rounding + 1e-4)


def _check_attention(spec, target: str, seed: int) -> tuple[str, bool]:
    import foldc
    from .reference import attention_reference
    from .testing import random_inputs, run_case

    attn = foldc.compile(spec, target=target)
    if target == "reference":
        q, k, v, lens = random_inputs(spec, 2, CHECK_TOKENS, torch.float16, "cpu", torch.Generator().manual_seed(seed))
        err = _rel_l2(attn(q, k, v, seq_lens=lens), attention_reference(q, k, v, seq_lens=lens))
        return (f"checked: float64 plan executor vs float64 attention, {CHECK_TOKENS} tokens: rel L2 {err:.2e}",
                err < 1e-12)
    res = run_case(attn, spec, 1, CHECK_TOKENS, torch.float16, "cpu", seed)
    return (f"checked: interpreter kernel vs float64 attention, {CHECK_TOKENS} tokens, seed {seed}: rel L2 "
            f"{res.error:.2e} (plain bf16 attention {res.bf16_error:.2e})", res.error <= res.bf16_error)


def _register_operand(spec, target: str, kernel: str, block_n: int | None) -> bool:
    """Whether an attention AOT build for ``target`` uses the register-operand kernel: "auto" does on
    sm_90 where it lowers the plan (and block_n, if given, is one it runs: 32 or 64), "gluon"
    insists (and says why it cannot), "triton" never."""
    if kernel not in ("auto", "triton", "gluon"):
        raise SpecError(f"kernel={kernel!r} is not one of ('auto', 'triton', 'gluon')")
    if kernel == "triton" or (kernel == "auto" and (target != "sm_90" or block_n not in (None, 32, 64))):
        return False
    if block_n not in (None, 32, 64):
        raise SpecError(f"block_n={block_n} must be 32 or 64 for the register-operand kernel")
    from .backends.gluon.lower import lowerable

    ok, reason = lowerable(spec)
    if kernel == "gluon" and not ok:
        raise SpecError(f"--kernel gluon cannot lower this layout: {reason}; use --kernel auto or triton")
    return ok


def compile_layout(spec, target: str, out: str | None, dtype: str = "bf16", seed: int = 0, **aot) -> int:
    """Print the plan and its proof, then build or check the kernel for ``target``; exit status."""
    from .proof import prove

    if target not in TARGETS:
        raise SpecError(f"target={target!r} is not one of {TARGETS}")
    if target in ("sm_90", "sm_100") and not out:
        raise SpecError(f"target={target!r} writes the kernel's PTX and cubin: give --out DIR")
    the_plan = kernel_plan(spec, "fp16" if target == "interpret" else dtype)
    print(explain(the_plan))
    print(prove(the_plan))
    if target in ("sm_90", "sm_100"):
        if isinstance(spec, GemmSpec):
            from .backends.triton.gemm_aot import compile_gemm_aot

            report = compile_gemm_aot(spec, target, out, dtype=dtype, num_warps=aot.get("num_warps"),
                                      num_stages=aot.get("num_stages"))
            name = "foldc_gemm"
        elif _register_operand(spec, target, aot.get("kernel") or "auto", aot.get("block_n")):
            from .backends.gluon.aot import compile_gluon_aot

            report = compile_gluon_aot(spec, target, out, dtype=dtype, block_n=aot.get("block_n") or 32,
                                       stages=aot.get("num_stages") or 2)
            name = "foldc_decode_gluon"
        else:
            from .backends.triton.aot import compile_aot

            report = compile_aot(spec, target, out, dtype=dtype, block_n=aot.get("block_n") or 64,
                                 num_warps=aot.get("num_warps") or 4, num_stages=aot.get("num_stages") or 2)
            name = "foldc_decode"
        if name == "foldc_decode_gluon":
            print(f"wrote the register-operand kernel's {target} TTGIR/LLIR/PTX/cubin to {out}/{name}.{target}.*")
        else:
            print(f"wrote {out}/{name}.py and the {target} TTIR/TTGIR/LLIR/PTX/cubin")
        print(json.dumps(report, indent=2))
        return 0
    if out and target == "interpret":
        Path(out).mkdir(parents=True, exist_ok=True)
        if isinstance(spec, GemmSpec):
            from .backends.triton.gemm_launch import gemm_kernel_source

            path, source = Path(out) / "foldc_gemm.py", gemm_kernel_source(spec, "fp16")[0].source
        else:
            from .backends.triton.launch import kernel_source

            path, source = Path(out) / "foldc_decode.py", kernel_source(spec, "fp16")[0].source
        path.write_text(source)
        print(f"wrote {path}")
    line, ok = (_check_gemm if isinstance(spec, GemmSpec) else _check_attention)(spec, target, seed)
    print(line + ("" if ok else "  MISMATCH"))
    return 0 if ok else 1
