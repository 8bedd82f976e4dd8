"""A variant of the register-operand GEMV for `benchmarks/gemv_ab.py`: programs that stay resident and stream work
items, each item production's program (a block of output channels and a split of its k chunks). Not production code.

    PYTHONPATH=. python3 benchmarks/gemv_ab.py --b benchmarks/gemv_persistent.py --b-kernel foldc_gemv_persistent \
        --quick --cases 0,1,3,4 --options '[{"gemv_split": 16}]' \
        --b-override '[{"_programs_per_sm": 12}, {"_programs_per_sm": 15}, {"_programs_per_sm": 12, "_options": {"gemv_split": 16}}, {"_programs_per_sm": 15, "_options": {"gemv_split": 16}}]'
    PYTHONPATH=. python3 benchmarks/gemv_persistent.py   # CPU: registers beside production's, sm_90

(`--b-kernel foldc_gemv_persistent_late` for the persistent grid alone: the next item's copies after the end.)
Built ahead of time for sm_90 (the second command, 2026-12-06): 131 registers against production's 98 at INT4 g128
4096 x 14336, m = 1, 136 against 102 at INT2 28672 x 8192, 182 against 114 at INT4 m = 16; no local memory (the late
kernel as many: the item loop's registers, not the overlap's). So 12 one-warp programs an SM reside at m = 1 (16 of
production's) and 8 at m = 16. Timed on an H100 (docs/gemm.md, "Persistent programs and the split against waves"):
10% faster at INT4 28672 x 8192, m = 1, slower where production fits one wave, at INT2 and at m = 16.

Why: Nsight Compute put a quarter of a production program's life in its start (the parameter words' and first
stages' copies on their way) and its end (the partial's stores, then the split-k counter's round trip), with about
seven chunks a program at INT4 g128 4096 x 14336, m = 1 (docs/gemm.md, "Where the time goes"). Here a program takes
items i = p, p + P, ... (P programs, about as many as the GPU holds at once) and starts the copies of its next
item's parameters and first stages before it stores the current item's partial and bumps its counter, so the next
item's reads are in flight through the current one's end, and an item's start waits on nothing but its copies.

Each item is production's work, in production's functions (`chunk_loop`, `_finish`, `_reduce`, `_copy_runs`,
`_issue`): the same sums in the same order, so the outputs equal production's bit for bit at the same split.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

import foldc.backends.gluon.gemv as production
from foldc.backends.runtime.modules import with_globals

EARLY = gl.constexpr(True)   # the next item's copies before the current item's end (False: after it)


@gluon.jit
def _start_item(item, X, WC, WS, WZ, N, stride_wc, stride_ws, chunks_per_split, w_smem, x_smem, s_copy, z_copy,
                x_offs,
                BN: gl.constexpr, W: gl.constexpr, F: gl.constexpr, ROW_BYTES: gl.constexpr, G: gl.constexpr,
                STAGES: gl.constexpr, SUB: gl.constexpr, GW: gl.constexpr, HALF: gl.constexpr, SPLIT: gl.constexpr,
                X_SHARED: gl.constexpr):
    """Item ``item``'s (n0, c_lo, c_hi, w_rows), its parameter words' copies and its first STAGES - 1 stages under
    way (production.program_start's copies, into buffers allocated once)."""
    NB: gl.constexpr = W * 4
    NCH: gl.constexpr = ROW_BYTES // NB
    n0 = (item // SPLIT) * BN
    c_lo = (item % SPLIT) * chunks_per_split
    c_hi = gl.minimum(c_lo + chunks_per_split, NCH)
    w_rows = production.code_rows(WC, n0, N, stride_wc, BN, W, NCH)
    production._copy_runs(WS.to(gl.pointer_type(gl.int32), bitcast=True), s_copy, n0, N, stride_ws, c_lo * NB, BN, F,
                          GW, ROW_BYTES, G, HALF)
    production._copy_runs(WZ.to(gl.pointer_type(gl.int32), bitcast=True), z_copy, n0, N, stride_ws, c_lo * NB, BN, F,
                          GW, ROW_BYTES, G, HALF)
    for first in gl.static_range(STAGES - 1):
        if c_lo + first * SUB < c_hi:
            production._issue(first, c_lo + first * SUB, c_hi, w_rows, w_smem, X, x_offs, x_smem, W, SUB, X_SHARED)
        else:
            async_copy.commit_group()
    return n0, c_lo, c_hi, w_rows


@gluon.jit
def foldc_gemv_persistent(X, WC, WS, WZ, Y, PART, COUNTERS, M, N, stride_x, stride_wc, stride_ws, stride_y,
                          chunks_per_split, BN: gl.constexpr, W: gl.constexpr, F: gl.constexpr, NG: gl.constexpr,
                          ROWS: gl.constexpr, ROW_BYTES: gl.constexpr, G: gl.constexpr, BITS: gl.constexpr,
                          STAGES: gl.constexpr, SPLIT: gl.constexpr, ASM: gl.constexpr, CONS: gl.constexpr,
                          XF16: gl.constexpr, VALUE_EXP: gl.constexpr, KIND: gl.constexpr, SUB: gl.constexpr,
                          GW: gl.constexpr, X_SHARED: gl.constexpr, SWAP: gl.constexpr, BIAS: gl.constexpr):
    """production.foldc_gemv_gluon's arguments, over a grid of (P,) programs: items p, p + P, ... of the
    cdiv(N, BN) x SPLIT (block, split) items, the next one's copies started before the current one ends (EARLY),
    or after it (`foldc_gemv_persistent_late`: the persistent grid alone)."""
    T: gl.constexpr = BN // (16 * gl.num_warps())
    NB: gl.constexpr = W * 4
    D: gl.constexpr = NB * F
    HALF: gl.constexpr = KIND != 2
    # the shared memory of production.program_tiles / program_start, allocated once for every item
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES * SUB, BN, W], production.weight_tile_layout(W))
    if X_SHARED == 1:
        x_at = production._x_offsets(D, NB, ROW_BYTES)
        x_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        x_smem = gl.allocate_shared_memory(X.dtype.element_ty, [STAGES * SUB, D], x_l)
    elif X_SHARED == 2:
        xl: gl.constexpr = production.x_rows_copy_layout(D, gl.num_warps())
        r = gl.minimum(gl.arange(0, ROWS, layout=gl.SliceLayout(1, xl)), M - 1)
        kx = gl.arange(0, D, layout=gl.SliceLayout(0, xl))
        x_at = r[:, None] * stride_x + ((kx // NB) * ROW_BYTES + kx % NB)[None, :]
        x_smem = gl.allocate_shared_memory(X.dtype.element_ty, [STAGES * SUB, ROWS, D],
                                           production.x_rows_tile_layout())
    else:
        mma: gl.constexpr = production.gemv_mma(gl.num_warps())
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
        x_at = gl.minimum(gl.arange(0, ROWS, layout=gl.SliceLayout(0, b_l)), M - 1)
        x_smem = w_smem
    RUN: gl.constexpr = [F * production.pow2_at_least(GW), BN]
    p_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    row_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    s_copy = gl.allocate_shared_memory(gl.int32, RUN, p_l)   # copied as production's: one [F * GWP, BN] tile each,
    z_copy = gl.allocate_shared_memory(gl.int32, RUN, p_l)   # read one row (word index) at a time
    s_run = s_copy._reinterpret(gl.int32, RUN, row_l)
    z_run = z_copy._reinterpret(gl.int32, RUN, row_l)
    items = gl.cdiv(N, BN) * SPLIT
    item = gl.program_id(0)
    if item < items:
        n0, c_lo, c_hi, w_rows = _start_item(item, X, WC, WS, WZ, N, stride_wc, stride_ws, chunks_per_split, w_smem,
                                             x_smem, s_copy, z_copy, x_at, BN, W, F, ROW_BYTES, G, STAGES, SUB, GW,
                                             HALF, SPLIT, X_SHARED)
        while item < items:
            ys = production.chunk_loop(X, x_at, x_smem, w_rows, w_smem, s_run, z_run, n0, c_lo, c_hi, M, N, stride_x,
                                       stride_ws, BN, W, F, NG, ROWS, ROW_BYTES, G, BITS, STAGES, ASM, CONS, XF16,
                                       VALUE_EXP, KIND, SUB, GW, X_SHARED, SWAP, BIAS)
            block = item // SPLIT
            split = item % SPLIT
            done_n0 = n0
            item += gl.num_programs(0)
            gl.thread_barrier()   # every lane is done with this item's stages and parameter words
            if EARLY:
                if item < items:   # the next item's copies, in flight through this item's end
                    n0, c_lo, c_hi, w_rows = _start_item(item, X, WC, WS, WZ, N, stride_wc, stride_ws,
                                                         chunks_per_split, w_smem, x_smem, s_copy, z_copy, x_at, BN, W,
                                                         F, ROW_BYTES, G, STAGES, SUB, GW, HALF, SPLIT, X_SHARED)
            for t in gl.static_range(T):
                production._finish(ys[t], t, Y, PART, done_n0, split, M, N, stride_y, SPLIT, ROWS)
            if SPLIT > 1:
                gl.thread_barrier()   # every lane's partial is written before the counter says so
                done = gl.atomic_add(COUNTERS + block, 1, sem="acq_rel", scope="gpu")
                if done == SPLIT - 1:   # the block's last item: the sum of all partials, then y
                    for t in gl.static_range(T):
                        production._reduce(t, Y, PART, done_n0, M, N, stride_y, SPLIT, ROWS)
                    gl.atomic_xchg(COUNTERS + block, 0, sem="relaxed", scope="gpu")
            if not EARLY:
                if item < items:
                    n0, c_lo, c_hi, w_rows = _start_item(item, X, WC, WS, WZ, N, stride_wc, stride_ws,
                                                         chunks_per_split, w_smem, x_smem, s_copy, z_copy, x_at, BN, W,
                                                         F, ROW_BYTES, G, STAGES, SUB, GW, HALF, SPLIT, X_SHARED)


foldc_gemv_persistent_late = gluon.jit(with_globals(foldc_gemv_persistent.fn, EARLY=gl.constexpr(False)))


if __name__ == "__main__":
    from foldc.bench import gemv_variant_builds

    cases = [("k-group:4:128", 4096, 14336, 1), ("k-group:2:128", 28672, 8192, 1), ("k-group:4:128", 28672, 8192, 16)]
    gemv_variant_builds(foldc_gemv_persistent, "persistent", cases)
    gemv_variant_builds(foldc_gemv_persistent_late, "late", cases)
