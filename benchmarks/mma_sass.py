"""Which SASS each ``mma.sync`` operand type becomes, per architecture (CPU, ahead of time; evidence for
docs/perf.md, "What would close it", not a test): a one-warp loop of m16n8k32 MMAs with e4m3 and with int8
operands (Gluon's ``mma_v2``) compiled for sm_89, sm_90 and sm_100, and the tensor-core and conversion opcodes
counted in its SASS. A native 8-bit MMA would let the unpack build four codes per 32-bit register instead of two.

    TRITON_INTERPRET= PYTHONPATH=. python3 benchmarks/mma_sass.py [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from foldc.backends.runtime.sass import _tool


@gluon.jit
def _mma8_loop(OUT, ITERS: gl.constexpr, M: gl.constexpr, N: gl.constexpr, FP8: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=4)
    pid = gl.program_id(0)
    ra = gl.arange(0, M, layout=gl.SliceLayout(1, a_l))
    ka = gl.arange(0, 32, layout=gl.SliceLayout(0, a_l))
    kb = gl.arange(0, 32, layout=gl.SliceLayout(1, b_l))
    nb = gl.arange(0, N, layout=gl.SliceLayout(0, b_l))
    a = (ra[:, None] * 16 + ka[None, :] + pid) % 7
    b = (kb[:, None] + nb[None, :] * 3) % 5
    if FP8:
        acc = mma_v2(a.to(gl.float16).to(gl.float8e4nv), b.to(gl.float16).to(gl.float8e4nv),
                     gl.zeros([M, N], gl.float32, layout=mma))
        for _ in range(ITERS):   # each step depends on the last: the loop stays
            acc = mma_v2(a.to(gl.float16).to(gl.float8e4nv), b.to(gl.float16).to(gl.float8e4nv), acc)
    else:
        acc = mma_v2(a.to(gl.int8), b.to(gl.int8), gl.zeros([M, N], gl.int32, layout=mma))
        for _ in range(ITERS):
            acc = mma_v2(a.to(gl.int8), b.to(gl.int8), acc)
    rm = gl.arange(0, M, layout=gl.SliceLayout(1, mma))
    rn = gl.arange(0, N, layout=gl.SliceLayout(0, mma))
    gl.store(OUT + pid * M * N + rm[:, None] * N + rn[None, :], acc.to(gl.float32))


def opcodes(fp8: bool, arch: int) -> dict:
    """The PTX MMA form and the kernel's SASS multiply and conversion instructions (with their type suffixes)."""
    sig = {"OUT": "*fp32", "ITERS": "constexpr", "M": "constexpr", "N": "constexpr", "FP8": "constexpr"}
    compiled = triton.compile(GluonASTSource(_mma8_loop, sig, constexprs={"ITERS": 64, "M": 16, "N": 8, "FP8": fp8}),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": 1})
    cubin = Path(tempfile.mkdtemp()) / "mma8.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([_tool("cuobjdump"), "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    forms = Counter(re.findall(r"\b((?:[HIQ]MMA|F2FP|I2F|F2I)\.[\w.]+)", sass))
    ptx = sorted(set(re.findall(r"mma\.sync[\w.]*", compiled.asm["ptx"])))
    return {"ptx": ptx, "sass": dict(forms.most_common())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for fp8 in (True, False):
        for arch in (89, 90, 100):
            row = {"operands": "e4m3" if fp8 else "int8", "arch": f"sm_{arch}", **opcodes(fp8, arch)}
            rows.append(row)
            print(row, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
