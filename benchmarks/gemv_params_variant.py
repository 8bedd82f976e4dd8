"""A variant of the register-operand GEMV for `benchmarks/gemv_ab.py`: 16-bit scales and zeros widened to float32
once per program instead of once per chunk. Not production code.

    PYTHONPATH=. python3 benchmarks/gemv_ab.py --b benchmarks/gemv_params_variant.py --quick   # H200: time, check
    python3 benchmarks/gemv_params_variant.py                                                  # CPU: chunk SASS

Production (foldc/backends/gluon/gemv.py) copies each program's 32-bit parameter words to shared memory and, per
chunk and piece, reads the two words a row's group may sit in, picks the half by the row's parity and widens it
(`_param`): with fp16 scales the chunk loop is 299 SASS instructions at INT4 g128 and 384 at INT2 g128 (m = 1,
sm_90), against 261 and 274 with fp32 scales, which take one shared load each. This variant gathers the program's
16-bit parameters from global memory once at its start (one value per lane and element, no parity), widens them
and keeps them in shared memory as float32, so that each chunk reads them as production reads fp32 scales. The
same values reach the same arithmetic: the outputs should equal production's bit for bit (`gemv_ab.py` checks
both against float64). Shared memory per program doubles for the parameters (float32).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

import foldc.backends.gluon.gemv as production
import foldc.backends.gluon.gemv_chunk as production_chunk
from foldc.bench import rebound

pow2_at_least = production.pow2_at_least


@gluon.jit
def _param(run, base: gl.constexpr, local, t: gl.constexpr, rows, stride_ws, g, g_first, KIND: gl.constexpr):
    """production_chunk._param, reading the program's float32 parameters: field base // GWP's rows start at 2 * base
    (two 16-bit groups per word of production's runs); fp32 parameters as production reads them."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    rl: gl.constexpr = gl.SliceLayout(1, mma)
    if KIND == 2:
        out = run.index(base + local).slice(16 * t, 16, dim=0).load(rl).to(gl.float32, bitcast=True)
    else:
        out = run.index(2 * base + local).slice(16 * t, 16, dim=0).load(rl)
    return out


@gluon.jit
def _widened(P, n0, N, stride_ws, j_lo, BN: gl.constexpr, F: gl.constexpr, GW: gl.constexpr,
             ROW_BYTES: gl.constexpr, G: gl.constexpr):
    """The program's 16-bit parameters of each bit field's groups from its first in this split, as float32 in
    shared memory [F * 2 * GWP, BN] (rows f * 2 * GWP + local), gathered from global memory (rows past N read
    row N - 1, groups past the row's last read its last: never used)."""
    GWP: gl.constexpr = pow2_at_least(GW)
    LG: gl.constexpr = 2 * GWP
    GROUPS: gl.constexpr = ROW_BYTES * F // G
    l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[max(1, 32 // BN), min(BN, 32)],
                                       warps_per_cta=[1, 1], order=[1, 0])
    i = gl.arange(0, F * LG, layout=gl.SliceLayout(1, l))
    f = i // LG
    g = gl.minimum(production._group(f * ROW_BYTES + j_lo, G) + i % LG, GROUPS - 1)
    rows = gl.minimum(n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, l)), N - 1)
    v = gl.load(P + rows[None, :] * stride_ws + g[:, None]).to(gl.float32)
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    row_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    out = gl.allocate_shared_memory(gl.float32, [F * LG, BN], flat)
    out.store(v)
    return out._reinterpret(gl.float32, [F * LG, BN], row_l)


@gluon.jit
def program_start(X, WC, WS, WZ, M, N, stride_x, stride_wc, stride_ws, chunks_per_split, BN: gl.constexpr,
                  W: gl.constexpr, F: gl.constexpr, ROWS: gl.constexpr, ROW_BYTES: gl.constexpr, G: gl.constexpr,
                  STAGES: gl.constexpr, SUB: gl.constexpr, GW: gl.constexpr, HALF: gl.constexpr,
                  X_SHARED: gl.constexpr):
    """production.program_start with 16-bit parameters gathered and widened once (`_widened`); fp32 parameters
    as production copies them (its program_start). The same returns."""
    if HALF:
        NB: gl.constexpr = W * 4
        n0, c_lo, c_hi, w_rows, x_at, w_smem, x_smem = production.program_tiles(
            X, WC, M, N, stride_wc, chunks_per_split, BN, W, F, ROWS, ROW_BYTES, STAGES, SUB, X_SHARED)
        for first in gl.static_range(STAGES - 1):   # the code words first: the parameters' loads overlap them
            if c_lo + first * SUB < c_hi:
                production._issue(first, c_lo + first * SUB, c_hi, w_rows, w_smem, X, x_at, x_smem, W, SUB, X_SHARED)
            else:
                production.async_copy.commit_group()
        s_run = _widened(WS, n0, N, stride_ws, c_lo * NB, BN, F, GW, ROW_BYTES, G)
        z_run = _widened(WZ, n0, N, stride_ws, c_lo * NB, BN, F, GW, ROW_BYTES, G)
    else:
        n0, c_lo, c_hi, w_rows, x_at, w_smem, x_smem, s_run, z_run = production.program_start(
            X, WC, WS, WZ, M, N, stride_x, stride_wc, stride_ws, chunks_per_split, BN, W, F, ROWS, ROW_BYTES, G, STAGES,
            SUB, GW, HALF, X_SHARED)
    return n0, c_lo, c_hi, w_rows, x_at, w_smem, x_smem, s_run, z_run


_row_tile = rebound(production_chunk._row_tile, _param=_param)
_chunk = rebound(production_chunk._chunk, _row_tile=_row_tile)
chunk_loop = rebound(production.chunk_loop, _chunk=_chunk)
program_sums = rebound(production.program_sums, program_start=program_start, chunk_loop=chunk_loop)
foldc_gemv_gluon = rebound(production.foldc_gemv_gluon, program_sums=program_sums)


CASES = (("k-group:4:128", 4096, 14336, 1), ("k-group:2:128", 28672, 8192, 1), ("k-group:4:32", 4096, 14336, 1),
         ("k-group:4:128", 28672, 8192, 16), ("k-group:2:128", 28672, 8192, 16))

if __name__ == "__main__":   # registers and SASS per chunk beside production's
    from foldc.bench import gemv_variant_builds

    gemv_variant_builds(foldc_gemv_gluon, "widened", CASES)
