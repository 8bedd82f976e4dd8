"""A variant of the register-operand GEMV for `benchmarks/gemv_ab.py`: a programmatic dependent launch (PDL, sm_90+)
that only warms the L2 before it waits. Not production code.

    PYTHONPATH=. python3 benchmarks/gemv_ab.py --b benchmarks/gemv_pdl_l2.py --quick --cases 0,1,2,3,4,5 \\
        --b-override '[{"launch_pdl": true}, {}]' --out $OUT/pdl_l2.json     # GPU: checked, then timed
    python3 benchmarks/gemv_pdl_l2.py                                      # CPU: registers and SASS per chunk

`benchmarks/gemv_pdl.py` copies a program's first code words into shared memory before it waits for the kernel
before it on the stream: a kernel that writes the weights (a `load_state_dict` copy) just before the call could then
be read stale. Here each program only asks the L2 for the lines of its first STAGES - 1 chunks of every row
(``prefetch.global.L2``, one line a row and chunk: the L2 is where every write lands, so no copy can be stale), waits
(``griddepcontrol.wait``), then starts as production does; it lets the next launch begin once its chunks are done.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

import foldc.backends.gluon.gemv as production
from foldc.bench import rebound

from gemv_pdl import _grid_wait, _let_dependents_launch   # noqa: E402 (benchmarks/ on the path: gemv_ab loads files)


@gluon.jit
def _warm_first_chunks(WC, n0, N, stride_wc, c_lo, c_hi, AHEAD: gl.constexpr, BN: gl.constexpr, W: gl.constexpr):
    """prefetch.global.L2 of the first line of each of the block's BN rows in chunks c_lo .. c_lo + AHEAD - 1."""
    PAIRS: gl.constexpr = BN * AHEAD
    L: gl.constexpr = production.pow2_at_least(PAIRS)
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    i = gl.arange(0, L, layout=lay)
    row = gl.minimum(n0 + i % BN, N - 1)
    chunk = gl.minimum(c_lo + i // BN, c_hi - 1)
    ptr = WC + row * stride_wc + chunk * W
    gl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.b32 $0, 0;", "=r,l", [ptr], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def program_start(X, WC, WS, WZ, M, N, stride_x, stride_wc, stride_ws, chunks_per_split, BN: gl.constexpr,
                  W: gl.constexpr, F: gl.constexpr, ROWS: gl.constexpr, ROW_BYTES: gl.constexpr, G: gl.constexpr,
                  STAGES: gl.constexpr, SUB: gl.constexpr, GW: gl.constexpr, HALF: gl.constexpr,
                  X_SHARED: gl.constexpr):
    """production.program_start after warming the L2 with the first chunks and waiting for the kernel before."""
    n0 = gl.program_id(0) * BN
    c_lo = gl.program_id(1) * chunks_per_split
    c_hi = gl.minimum(c_lo + chunks_per_split, ROW_BYTES // (W * 4))
    _warm_first_chunks(WC, n0, N, stride_wc, c_lo, c_hi, (STAGES - 1) * SUB, BN, W)
    _grid_wait(n0)
    return production.program_start(X, WC, WS, WZ, M, N, stride_x, stride_wc, stride_ws, chunks_per_split, BN, W, F,
                                    ROWS, ROW_BYTES, G, STAGES, SUB, GW, HALF, X_SHARED)


program_sums = rebound(production.program_sums, program_start=program_start)


@gluon.jit
def _trigger_after_sums(X, WC, WS, WZ, M, N, stride_x, stride_wc, stride_ws, chunks_per_split, BN: gl.constexpr,
                        W: gl.constexpr, F: gl.constexpr, NG: gl.constexpr, ROWS: gl.constexpr,
                        ROW_BYTES: gl.constexpr, G: gl.constexpr, BITS: gl.constexpr, STAGES: gl.constexpr,
                        ASM: gl.constexpr, CONS: gl.constexpr, XF16: gl.constexpr, VALUE_EXP: gl.constexpr,
                        KIND: gl.constexpr, SUB: gl.constexpr, GW: gl.constexpr, X_SHARED: gl.constexpr,
                        SWAP: gl.constexpr, BIAS: gl.constexpr):
    """program_sums, then let the next launch begin."""
    n0, ys = program_sums(X, WC, WS, WZ, M, N, stride_x, stride_wc, stride_ws, chunks_per_split, BN, W, F, NG, ROWS,
                          ROW_BYTES, G, BITS, STAGES, ASM, CONS, XF16, VALUE_EXP, KIND, SUB, GW, X_SHARED, SWAP,
                          BIAS)
    _let_dependents_launch(n0)
    return n0, ys


foldc_gemv_gluon = rebound(production.foldc_gemv_gluon, program_sums=_trigger_after_sums)

CASES = (("k-group:4:128", 4096, 14336, 1), ("k-group:2:128", 28672, 8192, 1), ("k-group:4:128", 28672, 8192, 16))

if __name__ == "__main__":   # registers and SASS per chunk beside production's
    from foldc.bench import gemv_variant_builds

    gemv_variant_builds(foldc_gemv_gluon, "pdl-l2", CASES)
