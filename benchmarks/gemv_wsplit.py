"""A variant of the register-operand GEMV for `benchmarks/gemv_ab.py`: each program's chunks split among PARTS one-warp
worker partitions of one CTA (`gl.warp_specialize`, each production's one-warp chunk loop over its own share, with its
own shared memory; the default partition, four warps, waits), their sums added in shared memory at the end. Not
production code.

Why: with split k across programs, every program ends in a partial's store and the split-k counter's acq_rel round
trip, and a block's last program then reads every split's partial (a quarter of a program's life with its start,
Nsight Compute, docs/gemm.md). Split among the warps of one CTA, the partial sums meet in shared memory behind one
barrier; with PARTS warps a CTA and the split across CTAs divided by PARTS, as many warps reside as before.

    bash benchmarks/host_path_gpu.sh gemv_wsplit   # beside production (launched with num_warps=4, maxnreg=64)
    (--b-kernel foldc_gemv_wsplit2 for two partitions)

Timed on an H100 (2026-12-06, docs/gemm.md, "Three more answers at m = 1"): as fast as production at 4096 x 14336
with one CTA per block, 6% faster at 4096 x 4096, 3-100% slower elsewhere; outputs within production's error.

Each partition's work is production's (`program_tiles`' arithmetic, `_copy_runs`, `_issue`, `chunk_loop`), so its sum
is production's over its chunks; only the order in which the partitions' sums are added differs.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

import foldc.backends.gluon.gemv as production
from foldc.backends.runtime.modules import with_globals
from triton.experimental.gluon import constexpr_function

PARTS = gl.constexpr(4)          # one-warp partitions a program
WORKER_REGS = gl.constexpr(104)  # registers of each worker partition (launch with maxnreg=64: the default four warps keep 24)


@constexpr_function
def unpack(bits, swap, bias, which):
    """The launcher's unpack asm (which 0) or its constraints (1): a partition's arguments cannot carry strings."""
    from foldc.backends.gluon.operands import biased_key_unpack_asm, key_unpack_asm, natural_key_unpack_asm

    bits = int(bits)
    if int(bias):
        pair = biased_key_unpack_asm(bits)
    else:
        pair = (key_unpack_asm if swap else natural_key_unpack_asm)(bits)
    return pair[int(which)]


@gluon.jit
def _part(p: gl.constexpr, rt, bufs, CONSTS: gl.constexpr):
    """Partition p (one warp): share p of this program's chunks, its sum [BN, ROWS] into sums[p]. ``rt``: the
    runtime arguments and shared buffers, ``CONSTS``: the constants (a partition's tensors cannot be passed alone)."""
    X, WC, WS, WZ, M, N, stride_x, stride_wc, stride_ws, chunks_per_split, sums = rt
    w_smem, x_smem, s_copy, z_copy = bufs
    # a partition's arguments lose the launch's alignment facts (16-byte pointers and strides): given again
    X = gl.multiple_of(X, 16)
    WC = gl.multiple_of(WC, 16)
    WS = gl.multiple_of(WS, 16)
    WZ = gl.multiple_of(WZ, 16)
    stride_x = gl.multiple_of(stride_x, 16)
    stride_wc = gl.multiple_of(stride_wc, 16)
    BN: gl.constexpr = CONSTS[0]
    W: gl.constexpr = CONSTS[1]
    F: gl.constexpr = CONSTS[2]
    NG: gl.constexpr = CONSTS[3]
    ROWS: gl.constexpr = CONSTS[4]
    ROW_BYTES: gl.constexpr = CONSTS[5]
    G: gl.constexpr = CONSTS[6]
    BITS: gl.constexpr = CONSTS[7]
    STAGES: gl.constexpr = CONSTS[8]
    XF16: gl.constexpr = CONSTS[9]
    VALUE_EXP: gl.constexpr = CONSTS[10]
    KIND: gl.constexpr = CONSTS[11]
    SUB: gl.constexpr = CONSTS[12]
    GW: gl.constexpr = CONSTS[13]
    X_SHARED: gl.constexpr = CONSTS[14]
    SWAP: gl.constexpr = CONSTS[15]
    BIAS: gl.constexpr = CONSTS[16]
    PARTS: gl.constexpr = CONSTS[17]
    NB: gl.constexpr = W * 4
    D: gl.constexpr = NB * F
    NCH: gl.constexpr = ROW_BYTES // NB
    ASM: gl.constexpr = unpack(BITS, SWAP, BIAS, 0)
    CONS: gl.constexpr = unpack(BITS, SWAP, BIAS, 1)
    RUN: gl.constexpr = [F * production.pow2_at_least(GW), BN]
    row_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    n0 = gl.program_id(0) * BN
    lo = gl.program_id(1) * chunks_per_split
    hi = gl.minimum(lo + chunks_per_split, NCH)
    share = gl.cdiv(hi - lo, PARTS)
    c_lo = gl.minimum(lo + p * share, hi)
    c_hi = gl.minimum(c_lo + share, hi)
    w_rows = production.code_rows(WC, n0, N, stride_wc, BN, W, NCH)
    if X_SHARED == 1:
        x_at = production._x_offsets(D, NB, ROW_BYTES)
    elif X_SHARED == 2:
        xl: gl.constexpr = production.x_rows_copy_layout(D, gl.num_warps())
        r = gl.minimum(gl.arange(0, ROWS, layout=gl.SliceLayout(1, xl)), M - 1)
        kx = gl.arange(0, D, layout=gl.SliceLayout(0, xl))
        x_at = r[:, None] * stride_x + ((kx // NB) * ROW_BYTES + kx % NB)[None, :]
    else:
        mma: gl.constexpr = production.gemv_mma(gl.num_warps())
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
        x_at = gl.minimum(gl.arange(0, ROWS, layout=gl.SliceLayout(0, b_l)), M - 1)
        x_smem = w_smem
    mma: gl.constexpr = production.gemv_mma(gl.num_warps())
    if c_lo < c_hi:
        production._copy_runs(WS.to(gl.pointer_type(gl.int32), bitcast=True), s_copy, n0, N, stride_ws, c_lo * NB, BN,
                              F, GW, ROW_BYTES, G, KIND != 2)
        production._copy_runs(WZ.to(gl.pointer_type(gl.int32), bitcast=True), z_copy, n0, N, stride_ws, c_lo * NB, BN,
                              F, GW, ROW_BYTES, G, KIND != 2)
        for first in gl.static_range(STAGES - 1):
            if c_lo + first * SUB < c_hi:
                production._issue(first, c_lo + first * SUB, c_hi, w_rows, w_smem, X, x_at, x_smem, W, SUB, X_SHARED)
            else:
                async_copy.commit_group()
        ys = production.chunk_loop(X, x_at, x_smem, w_rows, w_smem, s_copy._reinterpret(gl.int32, RUN, row_l),
                                   z_copy._reinterpret(gl.int32, RUN, row_l), n0, c_lo, c_hi, M, N, stride_x,
                                   stride_ws, BN, W, F, NG, ROWS, ROW_BYTES, G, BITS, STAGES, ASM, CONS, XF16,
                                   VALUE_EXP, KIND, SUB, GW, X_SHARED, SWAP, BIAS)
        sums.index(p).store(ys[0])
    else:   # no chunks for this partition (a short last split)
        sums.index(p).store(gl.zeros([BN, ROWS], gl.float32, layout=mma))


@gluon.jit
def _buffers(X, BN: gl.constexpr, W: gl.constexpr, F: gl.constexpr, ROWS: gl.constexpr, STAGES: gl.constexpr,
             SUB: gl.constexpr, GW: gl.constexpr, X_SHARED: gl.constexpr):
    """One partition's shared memory, as production's program allocates it: (code tiles, activation tiles, scale
    words, zero words)."""
    NB: gl.constexpr = W * 4
    D: gl.constexpr = NB * F
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES * SUB, BN, W], production.weight_tile_layout(W))
    if X_SHARED == 1:
        x_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        x_smem = gl.allocate_shared_memory(X.dtype.element_ty, [STAGES * SUB, D], x_l)
    elif X_SHARED == 2:
        x_smem = gl.allocate_shared_memory(X.dtype.element_ty, [STAGES * SUB, ROWS, D], production.x_rows_tile_layout())
    else:
        x_smem = w_smem
    RUN: gl.constexpr = [F * production.pow2_at_least(GW), BN]
    p_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    s_copy = gl.allocate_shared_memory(gl.int32, RUN, p_l)
    z_copy = gl.allocate_shared_memory(gl.int32, RUN, p_l)
    return w_smem, x_smem, s_copy, z_copy


@gluon.jit
def _idle(sums):
    """The default partition (four warps: a warp-specialized kernel's least) waits for the workers."""
    pass


@gluon.jit
def foldc_gemv_gluon(X, WC, WS, WZ, Y, PART, COUNTERS, M, N, stride_x, stride_wc, stride_ws, stride_y,
                     chunks_per_split, BN: gl.constexpr, W: gl.constexpr, F: gl.constexpr, NG: gl.constexpr,
                     ROWS: gl.constexpr, ROW_BYTES: gl.constexpr, G: gl.constexpr, BITS: gl.constexpr,
                     STAGES: gl.constexpr, SPLIT: gl.constexpr, ASM: gl.constexpr, CONS: gl.constexpr,
                     XF16: gl.constexpr, VALUE_EXP: gl.constexpr, KIND: gl.constexpr, SUB: gl.constexpr,
                     GW: gl.constexpr, X_SHARED: gl.constexpr, SWAP: gl.constexpr, BIAS: gl.constexpr):
    """production.foldc_gemv_gluon's arguments and grid (BN == 16), launched with num_warps=4: each program's chunks
    split among PARTS one-warp worker partitions, the four default warps idle until they add the workers' sums."""
    CONSTS: gl.constexpr = (BN, W, F, NG, ROWS, ROW_BYTES, G, BITS, STAGES, XF16, VALUE_EXP, KIND, SUB, GW, X_SHARED,
                            SWAP, BIAS, PARTS)
    sums_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    sums = gl.allocate_shared_memory(gl.float32, [PARTS, BN, ROWS], sums_l)
    rt = (X, WC, WS, WZ, M, N, stride_x, stride_wc, stride_ws, chunks_per_split, sums)
    b0 = _buffers(X, BN, W, F, ROWS, STAGES, SUB, GW, X_SHARED)
    b1 = _buffers(X, BN, W, F, ROWS, STAGES, SUB, GW, X_SHARED)
    if PARTS == 2:
        gl.warp_specialize([(_idle, (sums,)), (_part, (0, rt, b0, CONSTS)), (_part, (1, rt, b1, CONSTS))], [1, 1],
                           [WORKER_REGS, WORKER_REGS])
    else:
        b2 = _buffers(X, BN, W, F, ROWS, STAGES, SUB, GW, X_SHARED)
        b3 = _buffers(X, BN, W, F, ROWS, STAGES, SUB, GW, X_SHARED)
        gl.warp_specialize([(_idle, (sums,)), (_part, (0, rt, b0, CONSTS)), (_part, (1, rt, b1, CONSTS)),
                            (_part, (2, rt, b2, CONSTS)), (_part, (3, rt, b3, CONSTS))], [1, 1, 1, 1],
                           [WORKER_REGS, WORKER_REGS, WORKER_REGS, WORKER_REGS])
    lay: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[32 // ROWS, ROWS],
                                         warps_per_cta=[gl.num_warps(), 1], order=[1, 0])
    y = sums.index(0).load(lay)
    for p in gl.static_range(1, PARTS):
        y += sums.index(p).load(lay)
    n0 = gl.program_id(0) * BN
    rn = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, lay))
    rm = gl.arange(0, ROWS, layout=gl.SliceLayout(0, lay))
    ok = (rn < N)[:, None] & (rm < M)[None, :]
    if SPLIT == 1:
        gl.store(Y + rm[None, :] * stride_y + rn[:, None], y.to(Y.dtype.element_ty), mask=ok)
    else:
        gl.store(PART + gl.program_id(1) * M * N + rm[None, :] * N + rn[:, None], y, mask=ok)
        gl.thread_barrier()   # every lane's partial is written before the counter says so
        done = gl.atomic_add(COUNTERS + gl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:   # the last program of the block: the sum of all partials, then y
            total = gl.zeros([BN, ROWS], gl.float32, layout=lay)
            for j in range(SPLIT):
                total += gl.load(PART + j * M * N + rm[None, :] * N + rn[:, None], mask=ok, other=0.0,
                                 cache_modifier=".cg")
            gl.store(Y + rm[None, :] * stride_y + rn[:, None], total.to(Y.dtype.element_ty), mask=ok)
            gl.atomic_xchg(COUNTERS + gl.program_id(0), 0, sem="relaxed", scope="gpu")


foldc_gemv_wsplit2 = gluon.jit(with_globals(foldc_gemv_gluon.fn, PARTS=gl.constexpr(2)))

