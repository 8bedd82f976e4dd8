"""A variant of the register-operand GEMV for `benchmarks/gemv_ab.py`: the chunk loop unrolled by the pipeline's
depth, so that each step's stage is a constant. Not production code.

    PYTHONPATH=. python3 benchmarks/gemv_ab.py --b benchmarks/gemv_unrolled.py --quick   # GPU: time, check
    python3 benchmarks/gemv_unrolled.py                                                  # CPU: SASS per chunk

Production (foldc/backends/gluon/gemv.py, `chunk_loop`) indexes its STAGES-deep ring by ``i % STAGES``: at m = 1
(INT4 g128, sm_90) the loop computes the modulo by a multiply with 0x55555556 and the stage's shared addresses from
it every chunk. Unrolled STAGES times, each copy of the body reads and refills fixed stages (the loop runs whole
rounds of STAGES steps, each step guarded by the chunk count). The same values reach the same arithmetic: outputs
equal production's (`gemv_ab.py` checks both against float64).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

import foldc.backends.gluon.gemv as production
from foldc.bench import rebound

async_copy = production.async_copy


@gluon.jit
def chunk_loop(X, x_at, x_smem, w_rows, w_smem, s_run, z_run, n0, c_lo, c_hi, M, N, stride_x, stride_ws,
               BN: gl.constexpr, W: gl.constexpr, F: gl.constexpr, NG: gl.constexpr, ROWS: gl.constexpr,
               ROW_BYTES: gl.constexpr, G: gl.constexpr, BITS: gl.constexpr, STAGES: gl.constexpr, ASM: gl.constexpr,
               CONS: gl.constexpr, XF16: gl.constexpr, VALUE_EXP: gl.constexpr, KIND: gl.constexpr, SUB: gl.constexpr,
               GW: gl.constexpr, X_SHARED: gl.constexpr, SWAP: gl.constexpr, BIAS: gl.constexpr):
    """production.chunk_loop in rounds of STAGES steps, step s of a round on stage s (a constant)."""
    NB: gl.constexpr = W * 4
    T: gl.constexpr = BN // (16 * gl.num_warps())
    D: gl.constexpr = NB * F
    ys = production._zeros_tiles(ROWS, T)
    if not X_SHARED:
        x_next = production._load_x(X, x_at, stride_x, c_lo * NB, D, NB, ROWS, ROW_BYTES)
    steps = gl.cdiv(c_hi - c_lo, SUB)
    for i0 in range(0, steps, STAGES):
        for s in gl.static_range(STAGES):
            i = i0 + s
            if i < steps:
                gl.thread_barrier()   # every lane is done reading the stage the next copy overwrites
                if c_lo + (i + STAGES - 1) * SUB < c_hi:
                    production._issue((s + STAGES - 1) % STAGES, c_lo + (i + STAGES - 1) * SUB, c_hi, w_rows, w_smem,
                                      X, x_at, x_smem, W, SUB, X_SHARED)
                else:
                    async_copy.commit_group()
                async_copy.wait_group(STAGES - 1)
                gl.thread_barrier()   # stage s's words, copied by every lane, are visible
                for u in gl.static_range(SUB):
                    c = c_lo + i * SUB + u
                    if X_SHARED:
                        x_in = x_smem.index(s * SUB + u)
                    else:
                        x_in = x_next
                        x_next = production._load_x(X, x_at, stride_x, gl.minimum(c + 1, c_hi - 1) * NB, D, NB, ROWS,
                                                    ROW_BYTES)
                    if c < c_hi:
                        ys = production._chunk(w_smem.index(s * SUB + u), s_run, z_run, c_lo * NB, x_in, ys, n0, N,
                                               stride_ws, c * NB, T, W, F, NG, ROWS, ROW_BYTES, G, BITS, ASM, CONS,
                                               XF16, VALUE_EXP, KIND, GW, X_SHARED, SWAP, BIAS)
    async_copy.wait_group(0)
    return ys


program_sums = rebound(production.program_sums, chunk_loop=chunk_loop)
foldc_gemv_gluon = rebound(production.foldc_gemv_gluon, program_sums=program_sums)


CASES = (("k-group:4:128", 4096, 14336, 1), ("k-group:2:128", 28672, 8192, 1), ("k-group:4:128", 28672, 8192, 16),
         ("k-group:8:128", 4096, 14336, 1))

if __name__ == "__main__":   # registers and SASS per chunk beside production's (its loop body holds STAGES chunks)
    from foldc.backends.gluon.gemv_launch import STAGES
    from foldc.bench import gemv_variant_builds

    gemv_variant_builds(foldc_gemv_gluon, "unrolled", CASES, loop_copies=STAGES)
