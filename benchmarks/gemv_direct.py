"""A variant of the register-operand GEMV for `benchmarks/gemv_ab.py`: the code words go from global memory straight
into the registers of the MMA's operand layout, AHEAD chunks ahead (a ring of register tiles), with no shared-memory
stage, no cp.async wait and no barrier per chunk; the activation chunk is loaded into registers one chunk ahead at
every m (production's path for m > 1). Not production code.

    PYTHONPATH=. python3 benchmarks/gemv_ab.py --b benchmarks/gemv_direct.py --quick --cases 0,1,2,3,4,5   # GPU
    python3 benchmarks/gemv_direct.py                                                                        # CPU: SASS

Why: Nsight Compute put 44% of the production kernel's stall samples at the barrier after each stage's copy wait
(docs/gemm.md), and its chunk loop spends 35 LDS per 2 KB chunk reading back what cp.async wrote. Each lane's
operand words are two consecutive 32-bit words of rows g and g + 8 (`key_words_layout`): loaded from global memory
as 8-byte vectors, four lanes read one 32-byte sector of a row, every sector whole. The loads in flight are the
registers of the ring (16 words per lane per chunk of 16 rows x 128 bytes), not shared memory, so they do not
cost resident programs shared memory. Same values, same arithmetic as production's `_row_tile` (checked against
float64 by gemv_ab.py).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

import foldc.backends.gluon.gemv as production
from foldc.bench import rebound
from foldc.backends.gluon.tile_operands import group_mmas, key_operand, key_words_layout, split_groups, zeros_groups

async_copy = production.async_copy
mma_v2 = production.mma_v2


@gluon.jit
def _code_ptrs(WC, n0, N, stride_wc, W: gl.constexpr):
    """Pointers to chunk 0's code words of the program's 16 x warps rows, in the operand's word layout."""
    TM: gl.constexpr = 16 * gl.num_warps()
    kl: gl.constexpr = key_words_layout(TM, W, gl.num_warps())
    rows = gl.minimum(n0 + gl.arange(0, TM, layout=gl.SliceLayout(1, kl)), N - 1)
    words = gl.arange(0, W, layout=gl.SliceLayout(0, kl))
    return WC + rows[:, None] * stride_wc + words[None, :]


@gluon.jit
def _codes(ptrs, c, c_hi, W: gl.constexpr):
    """Chunk c's words (the program's last chunk again past it, never used), streamed past L1."""
    return gl.load(ptrs + gl.minimum(c, c_hi - 1) * W, cache_modifier=".cg")


@gluon.jit
def _x_row(X, offs, c, c_hi, NB: gl.constexpr):
    """m = 1: chunk c's activation row [D] in the layout production reads it from shared memory, from global memory
    (every program of a split reads the same row: L1 hits after the first)."""
    return gl.load(X + offs + gl.minimum(c, c_hi - 1) * NB)


@gluon.jit
def _x_operand(x_in, D: gl.constexpr, ROWS: gl.constexpr, XF16: gl.constexpr, X_SHARED: gl.constexpr,
               SWAP: gl.constexpr, BIAS: gl.constexpr):
    """production._x_operand with the m = 1 row already in registers."""
    mma: gl.constexpr = production.gemv_mma(gl.num_warps())
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    if X_SHARED:
        xd = x_in
        if SWAP:
            xd = gl.convert_layout(production.swap_k01(xd, D, 0), gl.SliceLayout(1, b_l), assert_trivial=True)
        xv = gl.broadcast(xd[:, None], gl.zeros([D, ROWS], gl.int1, layout=b_l))[0]
    elif SWAP:
        xv = gl.convert_layout(production.swap_k01(x_in, D, ROWS), b_l, assert_trivial=True)
    else:
        xv = x_in
    if production.x_as_is(XF16, BIAS):
        x16 = xv
        c = 1.0
    else:
        xf = xv.to(gl.float32)
        c = gl.exp2(12.0 - gl.floor(gl.log2(gl.maximum(gl.max(gl.abs(xf), axis=0), 1e-30))))
        x16 = (xf * c[None, :]).to(gl.float16)
    return x16, c


@gluon.jit
def _row_tile(kw, s_run, z_run, j_lo, xs, sums, y, n0, N, stride_ws, j0, W: gl.constexpr,
              F: gl.constexpr, NG: gl.constexpr, ROWS: gl.constexpr, ROW_BYTES: gl.constexpr, G: gl.constexpr,
              BITS: gl.constexpr, ASM: gl.constexpr, CONS: gl.constexpr, VALUE_EXP: gl.constexpr, KIND: gl.constexpr,
              GW: gl.constexpr, BIAS: gl.constexpr):
    """production._row_tile of row tile 0 with its code words given in registers."""
    mma: gl.constexpr = production.gemv_mma(gl.num_warps())
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    D: gl.constexpr = W * 4 * F
    P: gl.constexpr = D // NG
    PPF: gl.constexpr = NG // F
    GWP: gl.constexpr = production.pow2_at_least(GW)
    TM: gl.constexpr = 16 * gl.num_warps()
    if BIAS != 0:
        op = key_operand(kw, TM, D, F, ASM, CONS, gl.bfloat16)
    else:
        op = key_operand(kw, TM, D, F, ASM, CONS)
    zero = gl.zeros([TM, ROWS], gl.float32, layout=mma)
    if NG == 1:
        parts = (mma_v2(gl.convert_layout(op, a_l, assert_trivial=True), xs[0], zero),)
    else:
        parts = group_mmas(split_groups(op, NG, 1), xs, zeros_groups([TM, ROWS], mma, NG), a_l, b_l, NG)
    rows = gl.minimum(n0 + gl.arange(0, TM, layout=gl.SliceLayout(1, mma)), N - 1)
    for p in gl.static_range(NG):
        g = production._group((p // PPF) * ROW_BYTES + j0 + (p % PPF) * P, G)
        g_first = production._group((p // PPF) * ROW_BYTES + j_lo, G)
        if BIAS != 0:
            sp = production._param(s_run, (p // PPF) * GWP, g - g_first, 0, rows, stride_ws, g, g_first, KIND) * \
                production.biased_field_weight(BITS, p // PPF)
            zp = production._param(z_run, (p // PPF) * GWP, g - g_first, 0, rows, stride_ws, g, g_first, KIND) - \
                BIAS * sp
        else:
            sp = production._param(s_run, (p // PPF) * GWP, g - g_first, 0, rows, stride_ws, g, g_first, KIND) * \
                (2.0 ** (VALUE_EXP - BITS * (p // PPF)))
            zp = production._param(z_run, (p // PPF) * GWP, g - g_first, 0, rows, stride_ws, g, g_first, KIND)
        y = y + parts[p] * sp[:, None] + sums[p] * zp[:, None]
    return y


@gluon.jit
def _chunk(kw, s_run, z_run, j_lo, x_in, y, n0, N, stride_ws, j0, W: gl.constexpr, F: gl.constexpr,
           NG: gl.constexpr, ROWS: gl.constexpr, ROW_BYTES: gl.constexpr, G: gl.constexpr, BITS: gl.constexpr,
           ASM: gl.constexpr, CONS: gl.constexpr, XF16: gl.constexpr, VALUE_EXP: gl.constexpr, KIND: gl.constexpr,
           GW: gl.constexpr, X_SHARED: gl.constexpr, SWAP: gl.constexpr, BIAS: gl.constexpr):
    """production._chunk for one row tile, the activation chunk in registers (X_SHARED: its one row [D])."""
    mma: gl.constexpr = production.gemv_mma(gl.num_warps())
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    D: gl.constexpr = W * 4 * F
    P: gl.constexpr = D // NG
    TM: gl.constexpr = 16 * gl.num_warps()
    x16, c = _x_operand(x_in, D, ROWS, XF16, X_SHARED, SWAP, BIAS)
    ones = gl.full([TM, P], 1.0, x16.dtype, layout=a_l)
    zero = gl.zeros([TM, ROWS], gl.float32, layout=mma)
    if NG == 1:
        xs = (x16,)
        sums = (mma_v2(ones, x16, zero),)
    else:
        xs = split_groups(x16, NG, 0)
        sums = production._ones_mmas(ones, xs, zero, b_l, NG)
    if production.x_as_is(XF16, BIAS):
        out = _row_tile(kw, s_run, z_run, j_lo, xs, sums, y, n0, N, stride_ws, j0, W, F, NG, ROWS, ROW_BYTES, G,
                        BITS, ASM, CONS, VALUE_EXP, KIND, GW, BIAS)
    else:
        acc = _row_tile(kw, s_run, z_run, j_lo, xs, sums, zero, n0, N, stride_ws, j0, W, F, NG, ROWS, ROW_BYTES, G,
                        BITS, ASM, CONS, VALUE_EXP, KIND, GW, BIAS)
        out = y + acc * production._undo(c)
    return out


@gluon.jit
def program_sums(X, WC, WS, WZ, M, N, stride_x, stride_wc, stride_ws, chunks_per_split, BN: gl.constexpr,
                 W: gl.constexpr, F: gl.constexpr, NG: gl.constexpr, ROWS: gl.constexpr, ROW_BYTES: gl.constexpr,
                 G: gl.constexpr, BITS: gl.constexpr, STAGES: gl.constexpr, ASM: gl.constexpr, CONS: gl.constexpr,
                 XF16: gl.constexpr, VALUE_EXP: gl.constexpr, KIND: gl.constexpr, SUB: gl.constexpr, GW: gl.constexpr,
                 X_SHARED: gl.constexpr, SWAP: gl.constexpr, BIAS: gl.constexpr):
    """production.program_sums with the code words loaded into registers STAGES - 1 chunks ahead (1 to 3)."""
    gl.static_assert(BN == 16 * gl.num_warps(), "one row tile per warp")
    gl.static_assert(STAGES >= 2 and STAGES <= 4, "1 to 3 chunks ahead")
    NB: gl.constexpr = W * 4
    D: gl.constexpr = NB * F
    mma: gl.constexpr = production.gemv_mma(gl.num_warps())
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    n0 = gl.program_id(0) * BN
    c_lo = gl.program_id(1) * chunks_per_split
    c_hi = gl.minimum(c_lo + chunks_per_split, ROW_BYTES // NB)
    RUN: gl.constexpr = [F * production.pow2_at_least(GW), BN]
    p_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    row_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    s_run = gl.allocate_shared_memory(gl.int32, RUN, p_l)
    z_run = gl.allocate_shared_memory(gl.int32, RUN, p_l)
    production._copy_runs(WS.to(gl.pointer_type(gl.int32), bitcast=True), s_run, n0, N, stride_ws, c_lo * NB, BN, F,
                          GW, ROW_BYTES, G, KIND != 2)
    production._copy_runs(WZ.to(gl.pointer_type(gl.int32), bitcast=True), z_run, n0, N, stride_ws, c_lo * NB, BN, F,
                          GW, ROW_BYTES, G, KIND != 2)
    async_copy.commit_group()
    ptrs = _code_ptrs(WC, n0, N, stride_wc, W)
    x_rows = gl.minimum(gl.arange(0, ROWS, layout=gl.SliceLayout(0, b_l)), M - 1)
    k0 = _codes(ptrs, c_lo, c_hi, W)
    if STAGES >= 3:
        k1 = _codes(ptrs, c_lo + 1, c_hi, W)
    if STAGES >= 4:
        k2 = _codes(ptrs, c_lo + 2, c_hi, W)
    if X_SHARED:
        kx = gl.arange(0, D, layout=gl.SliceLayout(1, b_l))
        x_offs = (kx // NB) * ROW_BYTES + kx % NB
        x_next = _x_row(X, x_offs, c_lo, c_hi, NB)
    else:
        x_next = production._load_x(X, x_rows, stride_x, c_lo * NB, D, NB, ROWS, ROW_BYTES)
    async_copy.wait_group(0)
    gl.thread_barrier()   # every lane's parameter words are visible
    s_run = s_run._reinterpret(gl.int32, RUN, row_l)
    z_run = z_run._reinterpret(gl.int32, RUN, row_l)
    y = gl.zeros([BN, ROWS], gl.float32, layout=mma)
    for c in range(c_lo, c_hi):
        x_in = x_next
        if X_SHARED:
            x_next = _x_row(X, x_offs, c + 1, c_hi, NB)
        else:
            x_next = production._load_x(X, x_rows, stride_x, gl.minimum(c + 1, c_hi - 1) * NB, D, NB, ROWS,
                                        ROW_BYTES)
        kw = k0
        if STAGES == 2:
            k0 = _codes(ptrs, c + 1, c_hi, W)
        elif STAGES == 3:
            k0 = k1
            k1 = _codes(ptrs, c + 2, c_hi, W)
        else:
            k0 = k1
            k1 = k2
            k2 = _codes(ptrs, c + 3, c_hi, W)
        y = _chunk(kw, s_run, z_run, c_lo * NB, x_in, y, n0, N, stride_ws, c * NB, W, F, NG, ROWS, ROW_BYTES, G,
                   BITS, ASM, CONS, XF16, VALUE_EXP, KIND, GW, X_SHARED, SWAP, BIAS)
    return n0, (y,)


foldc_gemv_gluon = rebound(production.foldc_gemv_gluon, program_sums=program_sums)

CASES = (("k-group:4:128", 4096, 14336, 1), ("k-group:4:128", 28672, 8192, 1), ("k-group:2:128", 28672, 8192, 1),
         ("k-group:4:128", 28672, 8192, 16), ("k-group:8:128", 4096, 14336, 1))

if __name__ == "__main__":   # registers and SASS per chunk beside production's
    from foldc.bench import gemv_variant_builds

    gemv_variant_builds(foldc_gemv_gluon, "direct", CASES)
