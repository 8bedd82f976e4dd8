"""`foldc compile LAYOUT.toml`: from a layout file to a proved plan and a verified kernel.

Steps, for an attention or a GEMM layout alike:

1. plan the layout as the kernel that will be built lowers it (the register-operand kernel: no code bias, its row
   blocks' rows; the Triton backend: its code bias, eq. 7) and print the explain table;
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
from .options import check_choice, check_int, check_out_dir, cli_launch_options
from .registry import workload_of

TARGETS = ("sm_90", "sm_100", "interpret", "reference")
CHECK_TOKENS = 300   # cached tokens for an attention check
DEFAULTS = {"block_n": 64, "num_warps": 4, "num_stages": 2}   # the generated attention kernel's AOT build


def _rel_l2(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def kernel_plan(spec, dtype: str, kernel: str | None = None):
    """The plan the kernel that will be built lowers for ``spec``: the register-operand kernel's (``kernel`` "gluon":
    no code bias, its row blocks' rows, `gluon_plan`) or the Triton backend's (its code bias)."""
    workload = workload_of(spec)
    if workload is not None:
        return workload.kernel_plan(spec)
    from .registry import attention_backend

    return attention_backend(kernel or "triton").target_plan(spec, dtype)


def explain(the_plan) -> str:
    from .plan import as_plan

    as_plan(the_plan, "explain")
    workload = workload_of(the_plan.spec)
    if workload is not None:
        return workload.explain(the_plan)
    from .explain import explain_table

    return explain_table(the_plan)


def _check_attention(spec, target: str, seed: int, attn) -> tuple[str, bool]:
    from .reference import attention_reference
    from .testing import random_inputs, run_case

    if target == "reference":
        q, k, v, lens = random_inputs(spec, 2, CHECK_TOKENS, torch.float16, "cpu", torch.Generator().manual_seed(seed))
        err = _rel_l2(attn(q, k, v, seq_lens=lens), attention_reference(q, k, v, seq_lens=lens))
        return (f"checked: float64 plan executor vs float64 attention, {CHECK_TOKENS} tokens: rel L2 {err:.2e}",
                err < 1e-12)
    res = run_case(attn, spec, 1, CHECK_TOKENS, torch.float16, "cpu", seed)
    return (f"checked: interpreter kernel vs float64 attention, {CHECK_TOKENS} tokens, seed {seed}: rel L2 "
            f"{res.error:.2e} (plain bf16 attention {res.bf16_error:.2e})", res.error <= res.bf16_error)


def _prepare(spec, target: str, kernel: str | None, options: dict):
    """Everything that can fail on the layout and options before anything is printed: the
    interpret/reference callable (or None for a GPU build), and the Triton kernel's tiling."""
    import foldc

    if target in ("interpret", "reference"):
        return foldc.compile(spec, target=target, **options)
    if kernel == "triton":
        from .backends.triton.layout import geometry

        geometry(spec, options.get("block_n", DEFAULTS["block_n"]))
    return None


def _build(spec, target: str, out: str, dtype: str, kernel: str, options: dict) -> tuple[str, dict]:
    """The ahead-of-time build of ``kernel``: (artifact name, report)."""
    workload = workload_of(spec)
    if workload is not None:
        return workload.artifact, workload.build(spec, target, out, dtype, **options)
    if kernel == "gluon":
        from .backends.gluon.aot import compile_gluon_aot, compile_warpgroup_aot
        from .backends.gluon.warpgroup_launch import WarpgroupLaunch, warpgroup_applies

        report = compile_gluon_aot(spec, target, out, dtype=dtype,   # the launcher's defaults
                                   block_n=options.get("block_n"), stages=options.get("stages"))
        if dtype == "bf16" and not options and warpgroup_applies(spec, target):
            # what a contiguous cache's call runs; the one-warp program stays for paged calls
            wg = WarpgroupLaunch(spec)   # 17..32 query rows per KV head: 32 rows, the rest padding
            report["warpgroup"] = compile_warpgroup_aot(out, rows=wg.rows,
                                                        head_rows=0 if wg.head_rows == wg.rows else wg.head_rows)
        return "foldc_decode_gluon", report
    from .backends.triton.aot import compile_aot

    return "foldc_decode", compile_aot(spec, target, out, dtype=dtype, **{**DEFAULTS, **options})


def compile_layout(spec, target: str, out: str | None, dtype: str | None = None, seed: int = 0,
                   block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                   kernel: str = "auto") -> int:
    """Check the layout and every option, print the plan and its proof, then build or check the
    kernel for ``target``; exit status. ``dtype``: the MMA dtype of a GPU build (default bf16);
    the interpreter runs fp16 only."""
    from .proof import prove

    check_choice("target", target, TARGETS)
    if dtype is not None:
        check_choice("dtype", dtype, ("bf16", "fp16"))
        if target == "reference":   # the float64 executor has no MMA dtype: the flag would change nothing
            raise SpecError(f"dtype={dtype!r} (--dtype): target='reference' runs the float64 executor, no kernel; "
                            "drop --dtype or build for a GPU target")
        if target == "interpret" and dtype != "fp16":
            raise SpecError(f"dtype={dtype!r} (--dtype): the interpreter runs fp16 only; drop --dtype or build for "
                            "a GPU target")
    dtype = dtype or ("fp16" if target == "interpret" else "bf16")
    check_int("seed", seed, 0, 2**63 - 1, what="random inputs of the check")
    if target in ("sm_90", "sm_100") and not out:
        raise SpecError(f"target={target!r} writes the kernel's PTX and cubin: give --out DIR")
    if out and target == "reference":
        raise SpecError(f"out={out!r} (--out): target='reference' writes no kernel; drop --out or use "
                        "--target interpret")
    workload = workload_of(spec)
    which, options = cli_launch_options(spec, target, kernel, block_n, num_warps, num_stages, dtype=dtype)
    checker = _prepare(spec, target, which, options)
    if out:
        check_out_dir(out)
    # the plan the built or checked kernel runs (the executor's own for reference), explained and proved
    the_plan = checker.plan if target == "reference" else kernel_plan(spec, dtype, which)
    print(explain(the_plan))
    print(prove(the_plan))
    if target in ("sm_90", "sm_100"):
        name, report = _build(spec, target, out, dtype, which, options)
        if name == "foldc_decode_gluon":
            print(f"wrote the register-operand kernel's {target} TTGIR/LLIR/PTX/cubin to {out}/{name}.{target}.*")
            if "warpgroup" in report:
                print(f"wrote its warpgroup template (contiguous caches) to {out}/foldc_decode_warpgroup.{target}.*")
        else:
            print(f"wrote {out}/{name}.py and the {target} TTIR/TTGIR/LLIR/PTX/cubin")
        print(json.dumps(report, indent=2))
        return 0
    if out:  # the interpreter's kernel, with the options given
        path = Path(out) / f"{workload.artifact if workload is not None else 'foldc_decode'}.py"
        path.write_text(checker.source(torch.float16))
        print(f"wrote {path}")
    line, ok = (workload.check if workload is not None else _check_attention)(spec, target, seed, checker)
    print(line + ("" if ok else "  MISMATCH"))
    return 0 if ok else 1
