"""Variants of the register-operand GEMV for `benchmarks/gemv_ab.py --b benchmarks/gemv_variants.py`: the production
kernel's start and chunk loop (foldc/backends/gluon/gemv.py) with another end. Not production code.

    PYTHONPATH=. python3 benchmarks/gemv_ab.py --b benchmarks/gemv_variants.py --quick --cases 0,1,4

- ``foldc_gemv_gluon`` (the one gemv_ab.py loads): the split-k counter bumped with release semantics only, and
  the acquire (a fence) taken by the last program of a block alone. The production kernel's acq_rel atomic
  makes every program wait for the atomic's round trip and invalidate its L1 (CCTL.IVALL, 4% of the stall
  samples at INT4 4096 x 14336, docs/results/ncu_gemv_h200_2026-12-04.txt) although only the last one reads
  what the others wrote.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from foldc.backends.gluon.gemv import _finish, _reduce, program_sums


@gluon.jit
def _acquire(v):
    """A gpu-scope acquire-release fence, ordered after ``v`` (the counter's old value), which it returns."""
    return gl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, $1;", "=r,r", [v], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def foldc_gemv_gluon(X, WC, WS, WZ, Y, PART, COUNTERS, M, N, stride_x, stride_wc, stride_ws, stride_y,
                     chunks_per_split, BN: gl.constexpr, W: gl.constexpr, F: gl.constexpr, NG: gl.constexpr,
                     ROWS: gl.constexpr, ROW_BYTES: gl.constexpr, G: gl.constexpr, BITS: gl.constexpr,
                     STAGES: gl.constexpr, SPLIT: gl.constexpr, ASM: gl.constexpr, CONS: gl.constexpr,
                     XF16: gl.constexpr, VALUE_EXP: gl.constexpr, KIND: gl.constexpr, SUB: gl.constexpr,
                     GW: gl.constexpr, X_SHARED: gl.constexpr, SWAP: gl.constexpr):
    T: gl.constexpr = BN // 16
    n0, ys = program_sums(X, WC, WS, WZ, M, N, stride_x, stride_wc, stride_ws, chunks_per_split, BN, W, F, NG, ROWS,
                          ROW_BYTES, G, BITS, STAGES, ASM, CONS, XF16, VALUE_EXP, KIND, SUB, GW, X_SHARED, SWAP)
    for t in gl.static_range(T):
        _finish(ys[t], t, Y, PART, n0, gl.program_id(1), M, N, stride_y, SPLIT, ROWS)
    if SPLIT > 1:
        gl.thread_barrier()
        done = gl.atomic_add(COUNTERS + gl.program_id(0), 1, sem="release", scope="gpu")
        if done == SPLIT - 1:
            done = _acquire(done)
            if done == SPLIT - 1:   # (the fence's result keeps it before the partials' reads)
                for t in gl.static_range(T):
                    _reduce(t, Y, PART, n0, M, N, stride_y, SPLIT, ROWS)
                gl.atomic_xchg(COUNTERS + gl.program_id(0), 0, sem="relaxed", scope="gpu")
