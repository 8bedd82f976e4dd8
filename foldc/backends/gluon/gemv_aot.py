"""Ahead-of-time build of the register-operand GEMV (gemv.py) for sm_90 / sm_100, no GPU needed, and
what the compiler emitted: matrix instructions, registers, spills and the chunk loop's SASS.

Must run where TRITON_INTERPRET is unset when triton is first imported.
"""
from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path

import torch

from ...errors import SpecError
from ...gemm.spec import GemmSpec
from ...options import check_out_dir
from ..runtime.artifacts import build_errors, write_artifacts
from ..runtime.sass import loop_instructions
from .aot import registers
from .gemv_launch import GluonGemv

POINTERS = {"X": None, "WC": "*i32", "WS": None, "WZ": None, "Y": None, "PART": "*fp32", "COUNTERS": "*i32"}
SCALE_TYPES = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32"}
ALIGNED_INTS = ("stride_wc", "stride_x", "stride_y")


def compile_gemv_aot(spec: GemmSpec, arch: str, out_dir: str | Path, m: int = 1, dtype: str = "fp16",
                     block_rows: int | None = None, split_k: int | None = None, stages: int | None = None,
                     sub: int | None = None, sms: int = 132, maxnreg: int | None = None,
                     warps: int | None = None, chunk_k: int | None = None) -> dict:
    """Build the GEMV kernel of ``spec`` at ``m`` rows of ``dtype`` activations for ``arch`` into
    ``out_dir``, with the launcher's choices (``sms``: the SM count its split-k heuristic assumes);
    return a report (registers, spilled bytes in the chunk loop, MMAs per chunk)."""
    if arch not in ("sm_90", "sm_100"):
        raise SpecError(f"arch={arch!r}: the register-operand GEMV builds for sm_90 and sm_100")
    if dtype not in ("fp16", "bf16"):
        raise SpecError(f"dtype={dtype!r} must be 'fp16' or 'bf16'")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SpecError("ahead-of-time compilation needs TRITON_INTERPRET unset in this process")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from .gemv import foldc_gemv_gluon

    launcher = GluonGemv(spec, arch, block_rows=block_rows, split_k=split_k, stages=stages, sub=sub, maxnreg=maxnreg,
                         warps=warps, chunk_k=chunk_k)
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    ok, why = launcher.lowers(torch_dtype, m)
    if not ok:
        raise SpecError(f"{spec.describe()} at m={m} does not lower to the GEMV kernel: {why}")
    launch = launcher.plan_launch(torch_dtype, m, sms)
    check_out_dir(out_dir)
    consts = dict(launch.constants)
    options = {"num_warps": consts.pop("num_warps")}
    if "maxnreg" in consts:
        options["maxnreg"] = consts.pop("maxnreg")
    signature, attrs = {}, {}
    for i, name in enumerate(foldc_gemv_gluon.arg_names):
        if name in consts:
            signature[name] = "constexpr"
        elif name in POINTERS:
            t = POINTERS[name]
            if name in ("X", "Y"):
                t = f"*{dtype}"
            elif name in ("WS", "WZ"):
                t = SCALE_TYPES[launch.kernel.scale_dtype]
            signature[name] = t
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
            if name in ALIGNED_INTS:
                attrs[(i,)] = [["tt.divisibility", 16]]
    with build_errors(f"the register-operand GEMV for {arch}, m={m}"):
        compiled = triton.compile(GluonASTSource(foldc_gemv_gluon, signature, constexprs=consts, attrs=attrs),
                                  target=GPUTarget("cuda", {"sm_90": 90, "sm_100": 100}[arch], 32), options=options)
    out = Path(out_dir)
    cubin = write_artifacts(out, "foldc_gemv_gluon", arch, compiled)
    body = loop_instructions(cubin)
    loop = Counter(o for _, o, _ in body)
    ptx = compiled.asm["ptx"]
    k = launch.kernel
    report = {"spec": spec.describe(), "kernel": "gluon-gemv", "arch": arch, "dtype": dtype, "m": m,
              "block_rows": consts["BN"], "split_k": consts["SPLIT"], "stages": consts["STAGES"], "sub": consts["SUB"],
              "maxnreg": options.get("maxnreg"), "warps": options["num_warps"],
              "chunk_bytes": k.chunk_bytes, "operand_k": k.chunk_bytes * k.fields, "pieces": k.pieces, "registers": registers(cubin),
              "mma_in_ptx": len(re.findall(r"\bmma\.sync", ptx)),
              "chunk_loop": {"instructions_per_warp": sum(loop.values()), "mma": loop.get("HMMA", 0),
                             "local_memory": loop.get("LDL", 0) + loop.get("STL", 0),
                             "top_opcodes": dict(loop.most_common(12))}}
    (out / f"foldc_gemv_gluon.{arch}.json").write_text(json.dumps(report, indent=2))
    return report

