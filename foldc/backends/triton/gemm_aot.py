"""Ahead-of-time builds of the generated GEMM kernel for sm_90 and sm_100 (no GPU needed), as
aot.py does for attention: source, TTIR/TTGIR/LLIR, PTX, cubin and a JSON report naming the
matrix instructions the kernel uses (int8 x int8 -> int32 is IMMA / wgmma .s8 / tcgen05 .kind::i8).

Must run where TRITON_INTERPRET is unset when triton is first imported (see aot.py).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ...errors import SpecError
from ...options import check_choice, check_gemm_options, check_int, check_out_dir
from ..runtime.artifacts import build_errors, write_artifacts
from .aot import ARCHS, mma_instructions
from .gemm_dequant import check_tensor_memory
from .gemm_launch import check_int8_sum, gemm_kernel_source, k_chunk, launch_config
from ..runtime.modules import interpreter
from ..runtime.modules import load_module

PTR = {"fp16": "*fp16", "bf16": "*bf16"}
SCALE_PTR = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}


def _signature(ks, spec, dtype: str) -> dict:
    sig = {}
    for a in ks.args:
        if a.startswith("stride_") or a == "M":
            sig[a] = "i32"
        elif a.endswith("_CODES"):
            sig[a] = "*u8"
        elif a.endswith(("_SCALE", "_ZERO")):
            enc = spec.weight if a.startswith("W") else spec.activation
            sig[a] = SCALE_PTR[str(enc.scale_dtype).replace("torch.", "")]
        else:  # X, W values and Y
            sig[a] = PTR[dtype]
    return sig


def compile_gemm_aot(spec, arch: str, out_dir: str | Path, dtype: str = "bf16", m: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None, block_m: int | None = None,
                     block_n: int | None = None, block_k: int | None = None, split_k: int | None = None) -> dict:
    """Build the GEMM kernel of ``spec`` for ``arch`` with the launch tiles of ``m`` rows (spec.m, or 16),
    or the tile sizes given."""
    if arch not in ARCHS:
        raise SpecError(f"arch={arch!r} is not supported for ahead-of-time builds; use one of {sorted(ARCHS)}")
    check_choice("dtype", dtype, tuple(PTR))
    explicit = check_gemm_options(num_warps=num_warps, num_stages=num_stages, block_m=block_m, block_n=block_n,
                                  block_k=block_k, split_k=split_k)
    if m is not None:
        check_int("m", m, 1, what="rows of the launch tiles")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SpecError("ahead-of-time compilation needs TRITON_INTERPRET unset in this process; run "
                        "`foldc compile` in a fresh shell")
    check_out_dir(out_dir)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ks, the_plan = gemm_kernel_source(spec, dtype)
    module = load_module(ks.source, interpret=False)
    rows = m or spec.m or 16
    cfg = launch_config(rows, spec.n)
    cfg.update(explicit)
    constexprs = {"N": spec.n, "K": spec.k, "GROUP": ks.group, "BLOCK_M": cfg["block_m"],
                  "BLOCK_N": cfg["block_n"], "BLOCK_K": k_chunk(spec, ks.group, cfg["block_k"]),
                  "SPLIT_K": cfg["split_k"]}
    check_int8_sum(ks.int8_dot, spec.k, constexprs["BLOCK_K"], constexprs["SPLIT_K"])
    signature = _signature(ks, spec, dtype)
    if constexprs["SPLIT_K"] > 1:  # split-K programs add into a float32 buffer (gemm_launch.py)
        signature["Y"] = "*fp32"
    signature.update({k: "constexpr" for k in constexprs})
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(ks.args) if signature[a].startswith("*")}
    with interpreter(False), build_errors(f"the GEMM kernel for {arch} with {cfg}"):
        compiled = triton.compile(ASTSource(module.foldc_gemm, signature, constexprs=constexprs, attrs=attrs),
                                  target=GPUTarget("cuda", ARCHS[arch], 32),
                                  options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
    check_tensor_memory(compiled, arch, {"block_m": cfg["block_m"], "block_n": cfg["block_n"]})
    out = Path(out_dir)
    write_artifacts(out, "foldc_gemm", arch, compiled, ks.source)
    report = {
        "spec": spec.describe(), "folds": the_plan.folds, "arch": arch, "dtype": dtype,
        "mma_inputs": "int8" if ks.int8_dot else dtype, "group": ks.group, "rows": rows,
        **{k.lower(): v for k, v in constexprs.items() if k.startswith(("BLOCK", "SPLIT"))},
        "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"],
        "mma": mma_instructions(compiled.asm["ptx"]), "cubin_bytes": len(compiled.asm["cubin"]),
        "registers": getattr(compiled, "n_regs", None), "spills": getattr(compiled, "n_spills", None),
        "shared_bytes": compiled.metadata.shared,
    }
    (out / f"foldc_gemm.{arch}.json").write_text(json.dumps(report, indent=2))
    return report
