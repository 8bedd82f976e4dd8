"""A variant of the register-operand GEMV for `benchmarks/gemv_ab.py`: at m > 1 the activation chunk [rows, D] goes
global -> shared memory with the code words (cp.async, one copy per stage), and every warp of a program reads its
MMA operand there, where production loads it into each warp's registers one chunk ahead. Not production code.

    PYTHONPATH=. python3 benchmarks/gemv_ab.py --b benchmarks/gemv_xrows.py --quick --cases 5,6,9 \
        --b-override '[{"X_SHARED": true, "_options": {"gemv_warps": 4}}]'   # GPU
    python3 benchmarks/gemv_xrows.py                                                            # CPU: SASS

Why (docs/gemm.md): at m = 16 a third of the stall samples wait on the activation's global loads, and each one-warp
program of 16 output channels reads 8 KB of activation per 2 KB of codes, mostly from L2: 470 MB of L2 reads per
28672 x 8192 call against 117 MB of codes. Programs of several warps that share one copy of the chunk in shared
memory read it once per program: with 4 warps x 32 channels, an eighth of it. Run with X_SHARED true (the override)
at m > 1; at m = 1 production's one-row path is unchanged (this file only replaces the m > 1 layouts).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl

import foldc.backends.gluon.gemv as production
from foldc.bench import rebound

async_copy = production.async_copy


@constexpr_function
def x_rows_copy_layout(ROWS, D, WARPS):
    """cp.async of the activation chunk [ROWS, D]: 16 bytes (8 values) a lane, a row's lanes side by side."""
    ROWS, D, WARPS = int(ROWS), int(D), int(WARPS)
    across = min(32, D // 8)
    return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // across, across], warps_per_cta=[WARPS, 1],
                            order=[1, 0])


@constexpr_function
def x_rows_smem_layout(ROWS, D):
    """The chunk's shared tile [ROWS, D]: rows XOR-swizzled in 16-byte units, so that the operand's reads of one k
    range from eight rows meet eight banks."""
    return gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])


@gluon.jit
def _x_operand(x_in, D: gl.constexpr, ROWS: gl.constexpr, XF16: gl.constexpr, X_SHARED: gl.constexpr,
               SWAP: gl.constexpr, BIAS: gl.constexpr):
    """production._x_operand with X_SHARED meaning the whole chunk [ROWS, D] in shared memory."""
    mma: gl.constexpr = production.gemv_mma(gl.num_warps())
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    if X_SHARED:
        xv = x_in.permute((1, 0)).load(b_l)
    else:
        xv = x_in
    if SWAP:
        xv = gl.convert_layout(production.swap_k01(xv, D, ROWS), b_l, assert_trivial=True)
    if production.x_as_is(XF16, BIAS):
        x16 = xv
        c = 1.0
    else:
        xf = xv.to(gl.float32)
        c = gl.exp2(12.0 - gl.floor(gl.log2(gl.maximum(gl.max(gl.abs(xf), axis=0), 1e-30))))
        x16 = (xf * c[None, :]).to(gl.float16)
    return x16, c


@gluon.jit
def program_start(X, WC, WS, WZ, M, N, stride_x, stride_wc, stride_ws, chunks_per_split, BN: gl.constexpr,
                  W: gl.constexpr, F: gl.constexpr, ROWS: gl.constexpr, ROW_BYTES: gl.constexpr, G: gl.constexpr,
                  STAGES: gl.constexpr, SUB: gl.constexpr, GW: gl.constexpr, HALF: gl.constexpr,
                  X_SHARED: gl.constexpr):
    """production.program_start with the activation's rows [ROWS, D] copied per stage where X_SHARED."""
    NB: gl.constexpr = W * 4
    D: gl.constexpr = NB * F
    NCH: gl.constexpr = ROW_BYTES // NB
    n0 = gl.program_id(0) * BN
    c_lo = gl.program_id(1) * chunks_per_split
    c_hi = gl.minimum(c_lo + chunks_per_split, NCH)
    w_rows = production.code_rows(WC, n0, N, stride_wc, BN, W, NCH)
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES * SUB, BN, W], production.weight_tile_layout(W))
    if X_SHARED:
        xl: gl.constexpr = x_rows_copy_layout(ROWS, D, gl.num_warps())
        r = gl.minimum(gl.arange(0, ROWS, layout=gl.SliceLayout(1, xl)), M - 1)
        kx = gl.arange(0, D, layout=gl.SliceLayout(0, xl))
        x_at = r[:, None] * stride_x + ((kx // NB) * ROW_BYTES + kx % NB)[None, :]
        x_smem = gl.allocate_shared_memory(X.dtype.element_ty, [STAGES * SUB, ROWS, D], x_rows_smem_layout(ROWS, D))
    else:
        mma: gl.constexpr = production.gemv_mma(gl.num_warps())
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
        x_at = gl.minimum(gl.arange(0, ROWS, layout=gl.SliceLayout(0, b_l)), M - 1)
        x_smem = w_smem
    RUN: gl.constexpr = [F * production.pow2_at_least(GW), BN]
    p_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    row_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    s_run = gl.allocate_shared_memory(gl.int32, RUN, p_l)
    z_run = gl.allocate_shared_memory(gl.int32, RUN, p_l)
    production._copy_runs(WS.to(gl.pointer_type(gl.int32), bitcast=True), s_run, n0, N, stride_ws, c_lo * NB, BN, F,
                          GW, ROW_BYTES, G, HALF)
    production._copy_runs(WZ.to(gl.pointer_type(gl.int32), bitcast=True), z_run, n0, N, stride_ws, c_lo * NB, BN, F,
                          GW, ROW_BYTES, G, HALF)
    s_run = s_run._reinterpret(gl.int32, RUN, row_l)
    z_run = z_run._reinterpret(gl.int32, RUN, row_l)
    for first in gl.static_range(STAGES - 1):
        if c_lo + first * SUB < c_hi:
            production._issue(first, c_lo + first * SUB, c_hi, w_rows, w_smem, X, x_at, x_smem, W, SUB, X_SHARED)
        else:
            async_copy.commit_group()
    return n0, c_lo, c_hi, w_rows, x_at, w_smem, x_smem, s_run, z_run


_chunk = rebound(production._chunk, _x_operand=_x_operand)
chunk_loop = rebound(production.chunk_loop, _chunk=_chunk)
program_sums = rebound(production.program_sums, program_start=program_start, chunk_loop=chunk_loop)
foldc_gemv_gluon = rebound(production.foldc_gemv_gluon, program_sums=program_sums)

CASES = (("k-group:4:128", 28672, 8192, 16), ("k-group:4:128", 4096, 14336, 4))

if __name__ == "__main__":   # registers and SASS per chunk beside production's (X_SHARED is the launcher's here)
    from foldc.bench import gemv_variant_builds

    gemv_variant_builds(foldc_gemv_gluon, "xrows", CASES)
