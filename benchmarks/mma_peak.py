"""Throughput of the tensor-core instructions the decode kernels can use (H200; evidence for
docs/perf.md, not a test): mma.sync m16n8k16 (Gluon's mma_v2, what the register-operand kernel
issues) with fp16 operands and fp32 accumulators, operands in registers, many independent
accumulators per warp, against the dense fp16 matmul of cuBLAS (wgmma on sm_90) as the reference.

    PYTHONPATH=. python3 benchmarks/mma_peak.py [--out results.json]

Prints TFLOP/s per (warps per program, programs per SM). The question it answers: what rate of
MMA work a one-warp decode program can reach at all, so that a target measured in bytes per second
can be turned into the FLOP/s it needs (docs/perf.md, 16 and 32 query rows per KV head).
"""
from __future__ import annotations

import argparse
import json

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.testing import do_bench


@gluon.jit
def _mma_loop(OUT, ITERS: gl.constexpr, M: gl.constexpr, N: gl.constexpr, WARPS: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    pid = gl.program_id(0)
    ra = gl.arange(0, M, layout=gl.SliceLayout(1, a_l))
    ka = gl.arange(0, 16, layout=gl.SliceLayout(0, a_l))
    a = ((ra[:, None] * 16 + ka[None, :] + pid) % 7).to(gl.float16) * 0.125
    kb = gl.arange(0, 16, layout=gl.SliceLayout(1, b_l))
    nb = gl.arange(0, N, layout=gl.SliceLayout(0, b_l))
    b = ((kb[:, None] + nb[None, :] * 3) % 5).to(gl.float16) * 0.0625
    acc = gl.zeros([M, N], gl.float32, layout=mma)
    for _ in range(ITERS):   # a loop the compiler keeps: each step depends on the last
        acc = mma_v2(a, b, acc)
    rm = gl.arange(0, M, layout=gl.SliceLayout(1, mma))
    rn = gl.arange(0, N, layout=gl.SliceLayout(0, mma))
    gl.store(OUT + pid * M * N + rm[:, None] * N + rn[None, :], acc)


def mma_sync_tflops(warps: int, per_sm: int, m_per_warp: int = 64, n: int = 64, iters: int = 4096) -> float:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = sms * per_sm
    m = m_per_warp * warps
    out = torch.empty(programs * m * n, device="cuda", dtype=torch.float32)

    def run():
        _mma_loop[(programs,)](out, iters, m, n, warps, num_warps=warps)

    ms = do_bench(run, warmup=5, rep=50)
    flops = 2.0 * programs * m * n * 16 * iters
    return flops / (ms * 1e-3) / 1e12


def cublas_tflops(size: int = 8192) -> float:
    a = torch.randn(size, size, device="cuda", dtype=torch.float16)
    b = torch.randn(size, size, device="cuda", dtype=torch.float16)
    ms = do_bench(lambda: a @ b, warmup=5, rep=50)
    return 2.0 * size ** 3 / (ms * 1e-3) / 1e12


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for warps, per_sm, m in ((1, 4, 64), (1, 8, 64), (1, 16, 64), (1, 8, 32), (1, 16, 32), (4, 2, 64), (4, 4, 64)):
        t = mma_sync_tflops(warps, per_sm, m)
        rows.append({"instr": "mma.sync.m16n8k16 f16->f32", "warps": warps, "programs_per_sm": per_sm,
                     "m_per_warp": m, "n": 64, "tflops": round(t, 1)})
        print(f"mma.sync m16n8k16 f16/f32: {warps} warp(s) x {per_sm} per SM, {m}x64 accumulators per warp: "
              f"{t:.1f} TFLOP/s")
    t = cublas_tflops()
    rows.append({"instr": "cublas fp16 8192^3", "tflops": round(t, 1)})
    print(f"cuBLAS fp16 8192^3 (wgmma): {t:.1f} TFLOP/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
