"""The register-operand GEMV / small-M GEMM kernel (Gluon, sm_90 and sm_100): ``y = x @ w.T`` for a
weight of packed codes with one scale and zero per output channel and k group, and m <= 16 rows of
fp16 or bf16 activations.

One chunk's arithmetic (the codes' MMAs, each k group's scale and zero, the activation's pieces and their sums:
the equations) is gemv_chunk.py's; this module is the program around it: its shared memory, the copies that
feed its chunks, the loop over them and the split-k reduction.

Programs are WARPS warps (`gl.num_warps()`, one by default): (block of BN = 16 WARPS T output channels, split of
the k chunks), warp w taking channels 16 w .. 16 w + 15 of each of the T row tiles; a chunk's row tiles share
the activation's pieces and their sums. The program's scale and zero words (the
32-bit words that hold its groups' 16-bit parameters) go global -> shared memory once, by one cp.async
per tensor at the start: per bit field and row the GW words from the field's first group in the split. Code words
follow, STAGES stages of SUB chunks ahead (tile_memory.copy_layout; no copy past the program's last
chunk), into a swizzled tile so that the operand's 8-byte reads are free of bank conflicts. The
activation travels with them: its one row at m = 1 for 2- and 4-bit codes (X_SHARED 1), every row of the chunk at
m > 8 for 4-bit codes (X_SHARED 2, a swizzled [16, D] tile); otherwise its chunk is loaded into registers one chunk
ahead. With SPLIT > 1 each program writes its float32 partial [m, BN] to a workspace and bumps its row block's
counter; the last program of the block sums the partials, writes y and resets the counter to 0 (one launch,
CUDA-graph safe).

Import this module only where Triton runs natively (not under TRITON_INTERPRET=1).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from foldc.backends.gluon.gemv_chunk import _chunk, _group, _zeros_tiles, gemv_mma, pow2_at_least
from foldc.backends.gluon.tile_memory import copy_layout


@constexpr_function
def weight_tile_layout(W):
    """Shared layout of a [BN, W] word tile: rows XOR-swizzled in 8-word units so that the eight rows
    a warp's 8-byte reads touch land in different banks (W = 8 needs none: rows are 8 words apart)."""
    W = int(W)
    if W >= 32:
        return gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=4, order=[1, 0])
    if W == 16:
        return gl.SwizzledSharedLayout(vec=8, per_phase=2, max_phase=2, order=[1, 0])
    return gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])


@constexpr_function
def x_copy_layout(D, WARPS):
    """cp.async of one activation row's chunk [D] across the program's lanes, 4-16 bytes a lane."""
    D, WARPS = int(D), int(WARPS)
    return gl.BlockedLayout(size_per_thread=[max(2, min(8, D // (32 * WARPS)))], threads_per_warp=[32],
                            warps_per_cta=[WARPS], order=[0])


@constexpr_function
def x_rows_copy_layout(D, WARPS):
    """cp.async of the activation chunk [ROWS, D] (X_SHARED 2): 16 bytes (8 values) a lane, a row's lanes side by
    side."""
    D, WARPS = int(D), int(WARPS)
    across = min(32, D // 8)
    return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // across, across], warps_per_cta=[WARPS, 1],
                            order=[1, 0])


@constexpr_function
def x_rows_tile_layout():
    """The activation chunk's shared tile [ROWS, D] (X_SHARED 2): 64-byte units (32 values) XOR-ed with the row's
    parity. The MMA's B operand reads a 32-k block of eight rows in one LDS.128, lane 4n + u on row n's 16-byte unit
    u, served eight lanes (rows n, n + 1) at a time: with rows n and n + 1 in different halves of a 128-byte bank
    window each eight lanes take one wavefront (16-byte units XOR-ed by the row modulo 8 put both rows in the same
    half: two; 6-9% slower at m = 16, docs/gemm.md "The activation tile's bank conflicts")."""
    return gl.SwizzledSharedLayout(vec=32, per_phase=1, max_phase=2, order=[1, 0])


@gluon.jit
def _copy_runs(P32, run, n0, N, stride_ws, j_lo, BN: gl.constexpr, F: gl.constexpr, GW: gl.constexpr,
               ROW_BYTES: gl.constexpr, G: gl.constexpr, HALF: gl.constexpr):
    """Start copying, per bit field f, the GW parameter words of each of the block's rows from the word that
    holds the field's first group in this program (k = f * ROW_BYTES + j_lo) into rows f * GWP .. of ``run``
    [F * GWP, BN] (GWP: GW rounded up to a power of two), in one copy (never past the tensor's last word;
    a copy per word put a barrier between each two). A row's words are neighbours in one copy, so they meet
    in the same sectors."""
    GWP: gl.constexpr = pow2_at_least(GW)
    GROUPS: gl.constexpr = ROW_BYTES * F // G
    r_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[max(1, 32 // BN), min(BN, 32)],
                                         warps_per_cta=[1, gl.num_warps()], order=[1, 0])
    last = (N - 1) * stride_ws + GROUPS - 1
    if HALF:
        last = last // 2
    i = gl.arange(0, F * GWP, layout=gl.SliceLayout(1, r_l))
    rows = gl.minimum(n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, r_l)), N - 1)
    f = i // GWP
    w = i % GWP
    e = rows[None, :] * stride_ws + _group(f * ROW_BYTES + j_lo, G)[:, None]
    if HALF:
        e = e >> 1
    e = e + w[:, None]
    async_copy.async_copy_global_to_shared(run, P32 + e, mask=(w < GW)[:, None] & (e <= last))


@gluon.jit
def _finish(y, t: gl.constexpr, Y, PART, n0, pid_s, M, N, stride_y, SPLIT: gl.constexpr, ROWS: gl.constexpr):
    """Row tile t's result: y (SPLIT == 1) or this split's float32 partial."""
    mma: gl.constexpr = gemv_mma(gl.num_warps())
    TM: gl.constexpr = 16 * gl.num_warps()
    rn = n0 + TM * t + gl.arange(0, TM, layout=gl.SliceLayout(1, mma))
    rm = gl.arange(0, ROWS, layout=gl.SliceLayout(0, mma))
    ok = (rn < N)[:, None] & (rm < M)[None, :]
    if SPLIT == 1:
        gl.store(Y + rm[None, :] * stride_y + rn[:, None], y.to(Y.dtype.element_ty), mask=ok)
    else:
        gl.store(PART + pid_s * M * N + rm[None, :] * N + rn[:, None], y, mask=ok)


@gluon.jit
def _reduce(t: gl.constexpr, Y, PART, n0, M, N, stride_y, SPLIT: gl.constexpr, ROWS: gl.constexpr):
    """Row tile t of y as the sum of every split's partial (the block's last program)."""
    mma: gl.constexpr = gemv_mma(gl.num_warps())
    TM: gl.constexpr = 16 * gl.num_warps()
    rn = n0 + TM * t + gl.arange(0, TM, layout=gl.SliceLayout(1, mma))
    rm = gl.arange(0, ROWS, layout=gl.SliceLayout(0, mma))
    ok = (rn < N)[:, None] & (rm < M)[None, :]
    part = rm[None, :] * N + rn[:, None]
    total = gl.zeros([TM, ROWS], gl.float32, layout=mma)
    for j in range(SPLIT):
        total += gl.load(PART + j * M * N + part, mask=ok, other=0.0, cache_modifier=".cg")
    gl.store(Y + rm[None, :] * stride_y + rn[:, None], total.to(Y.dtype.element_ty), mask=ok)


@gluon.jit
def _x_offsets(D: gl.constexpr, NB: gl.constexpr, ROW_BYTES: gl.constexpr):
    """Element offsets of chunk 0 of the activation's row [D] in channel order (channel kx of a chunk: field
    kx // NB, byte kx % NB), for its copies (X_SHARED)."""
    kx = gl.arange(0, D, layout=x_copy_layout(D, gl.num_warps()))
    return (kx // NB) * ROW_BYTES + kx % NB


@gluon.jit
def _load_x(X, rx, stride_x, j0, D: gl.constexpr, NB: gl.constexpr, ROWS: gl.constexpr, ROW_BYTES: gl.constexpr):
    """The activation chunk [D, ROWS] in channel order, in the MMA's operand layout (rows ``rx``)."""
    mma: gl.constexpr = gemv_mma(gl.num_warps())
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    kx = gl.arange(0, D, layout=gl.SliceLayout(1, b_l))
    koff = (kx // NB) * ROW_BYTES + j0 + kx % NB
    return gl.load(X + rx[None, :] * stride_x + koff[:, None])


@constexpr_function
def chunk_words(W, BN):
    """Words from a chunk of a weight row to its next chunk in the codes as `foldc.quantize` packs them: W (a
    benchmark's variant of another code layout replaces this and `code_rows`)."""
    return int(W)


@gluon.jit
def code_rows(WC, n0, N, stride_wc, BN: gl.constexpr, W: gl.constexpr, NCH: gl.constexpr):
    """Pointers to chunk 0's code words of the block's BN rows from n0 [BN, W], in the copies' layout (rows
    past N read row N - 1, in bounds, never stored)."""
    cp_l: gl.constexpr = copy_layout(BN, W, gl.num_warps())
    rc = gl.minimum(n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, cp_l)), N - 1)
    wc = gl.arange(0, W, layout=gl.SliceLayout(0, cp_l))
    return WC + rc[:, None] * stride_wc + wc[None, :]


@gluon.jit
def _issue(stage, c0, c_hi, w_rows, w_smem, X, x_offs, x_smem, W: gl.constexpr, SUB: gl.constexpr,
           X_SHARED: gl.constexpr):
    """Start copying the code words (and with X_SHARED the activation's row) of the SUB chunks from c0 into
    stage ``stage``, back to back, so that each weight row is read SUB * NB contiguous bytes at a time
    (chunks past the program's last are its last again, never used)."""
    NB: gl.constexpr = W * 4
    for u in gl.static_range(SUB):
        c = gl.minimum(c0 + u, c_hi - 1)
        async_copy.async_copy_global_to_shared(w_smem.index(stage * SUB + u),
                                               w_rows + c * chunk_words(W, w_smem.shape[1]))
        if X_SHARED:
            async_copy.async_copy_global_to_shared(x_smem.index(stage * SUB + u), X + c * NB + x_offs)
    async_copy.commit_group()


@gluon.jit
def program_tiles(X, WC, M, N, stride_x, stride_wc, chunks_per_split, BN: gl.constexpr, W: gl.constexpr,
                  F: gl.constexpr, ROWS: gl.constexpr, ROW_BYTES: gl.constexpr, STAGES: gl.constexpr, SUB: gl.constexpr,
                  X_SHARED: gl.constexpr):
    """A program's output channels from n0, its chunks c_lo .. c_hi and the shared memory of its pipeline: (n0,
    c_lo, c_hi, w_rows: the code words' pointers at chunk 0, x_at: the activation's offsets at chunk 0
    (X_SHARED) or the rows each column reads, w_smem, x_smem)."""
    NB: gl.constexpr = W * 4
    D: gl.constexpr = NB * F
    NCH: gl.constexpr = ROW_BYTES // NB
    n0 = gl.program_id(0) * BN
    c_lo = gl.program_id(1) * chunks_per_split
    c_hi = gl.minimum(c_lo + chunks_per_split, NCH)
    w_rows = code_rows(WC, n0, N, stride_wc, BN, W, NCH)
    # m = 1 (X_SHARED): the activation's row goes through shared memory with the code words, and every column
    # of the MMA's operand reads it there (its loads wait on shared memory, not on global loads one chunk
    # ahead, and no registers hold the next chunk: 4096 x 14336 INT4 14.8 -> 14.0 µs, benchmarks/gemv_ab.py).
    # m > 8 at 4 bits (X_SHARED 2): every row of the chunk goes with the codes too. Each one-warp program reads 8 KB
    # of the activation per 2 KB of codes, and loaded into registers one chunk ahead those loads were a third of the
    # stall samples (Nsight Compute, H100): 28672 x 8192 INT4 102.6 -> 86.5 µs, 4096 x 14336 31.2 -> 26.8 (H100,
    # docs/gemm.md; 2-bit codes, a chunk of half the bytes beside the same 8 KB, were slower and keep registers).
    # m = 2..8: the chunk in registers one chunk ahead (a copy of the rows was 1.2-1.4x slower at m = 4 on the
    # H200; 4096 x 14336, m = 4 16.7 against 21.6 µs on the H100). Rows past m read row m - 1 again (their columns
    # are never stored).
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES * SUB, BN, W], weight_tile_layout(W))
    if X_SHARED == 1:
        x_at = _x_offsets(D, NB, ROW_BYTES)
        x_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        x_smem = gl.allocate_shared_memory(X.dtype.element_ty, [STAGES * SUB, D], x_l)
    elif X_SHARED == 2:   # every row of the chunk, copied with the codes (rows past m read row m - 1 again)
        xl: gl.constexpr = x_rows_copy_layout(D, gl.num_warps())
        r = gl.minimum(gl.arange(0, ROWS, layout=gl.SliceLayout(1, xl)), M - 1)
        kx = gl.arange(0, D, layout=gl.SliceLayout(0, xl))
        x_at = r[:, None] * stride_x + ((kx // NB) * ROW_BYTES + kx % NB)[None, :]
        x_smem = gl.allocate_shared_memory(X.dtype.element_ty, [STAGES * SUB, ROWS, D], x_rows_tile_layout())
    else:
        mma: gl.constexpr = gemv_mma(gl.num_warps())
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
        x_at = gl.minimum(gl.arange(0, ROWS, layout=gl.SliceLayout(0, b_l)), M - 1)
        x_smem = w_smem   # (unused)
    return n0, c_lo, c_hi, w_rows, x_at, w_smem, x_smem


@gluon.jit
def program_start(X, WC, WS, WZ, M, N, stride_x, stride_wc, stride_ws, chunks_per_split, BN: gl.constexpr,
                  W: gl.constexpr, F: gl.constexpr, ROWS: gl.constexpr, ROW_BYTES: gl.constexpr, G: gl.constexpr,
                  STAGES: gl.constexpr, SUB: gl.constexpr, GW: gl.constexpr, HALF: gl.constexpr,
                  X_SHARED: gl.constexpr):
    """A program's start: its output channels from n0 and chunks c_lo .. c_hi, its shared memory, the
    copies of its parameter words and of its first STAGES - 1 stages under way. Returns (n0, c_lo, c_hi,
    w_rows: the code words' pointers at chunk 0, x_at: the activation's offsets at chunk 0 (X_SHARED) or the
    rows each column reads, w_smem, x_smem, s_run, z_run)."""
    NB: gl.constexpr = W * 4
    n0, c_lo, c_hi, w_rows, x_at, w_smem, x_smem = program_tiles(X, WC, M, N, stride_x, stride_wc, chunks_per_split,
                                                                 BN, W, F, ROWS, ROW_BYTES, STAGES, SUB, X_SHARED)
    # the program's scale and zero words, copied once: per bit field and row the GW words from the field's
    # first group in this split (copies per piece and chunk, each of 16 rows' words in its own sector,
    # took the copies from 8.7 to 14.7 µs at INT4 4096 x 14336: benchmarks/gemv_anatomy.py)
    # the runs are copied as one [F * GWP, BN] tile each and read one row (word index) at a time
    RUN: gl.constexpr = [F * pow2_at_least(GW), BN]
    p_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    row_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    s_run = gl.allocate_shared_memory(gl.int32, RUN, p_l)
    z_run = gl.allocate_shared_memory(gl.int32, RUN, p_l)
    _copy_runs(WS.to(gl.pointer_type(gl.int32), bitcast=True), s_run, n0, N, stride_ws, c_lo * NB, BN, F, GW,
               ROW_BYTES, G, HALF)
    _copy_runs(WZ.to(gl.pointer_type(gl.int32), bitcast=True), z_run, n0, N, stride_ws, c_lo * NB, BN, F, GW,
               ROW_BYTES, G, HALF)
    s_run = s_run._reinterpret(gl.int32, RUN, row_l)
    z_run = z_run._reinterpret(gl.int32, RUN, row_l)
    for first in gl.static_range(STAGES - 1):   # (past the last chunk: an empty copy group); the runs go with the first
        if c_lo + first * SUB < c_hi:
            _issue(first, c_lo + first * SUB, c_hi, w_rows, w_smem, X, x_at, x_smem, W, SUB, X_SHARED)
        else:
            async_copy.commit_group()
    return n0, c_lo, c_hi, w_rows, x_at, w_smem, x_smem, s_run, z_run


@gluon.jit
def chunk_loop(X, x_at, x_smem, w_rows, w_smem, s_run, z_run, n0, c_lo, c_hi, M, N, stride_x, stride_ws,
               BN: gl.constexpr, W: gl.constexpr, F: gl.constexpr, NG: gl.constexpr, ROWS: gl.constexpr,
               ROW_BYTES: gl.constexpr, G: gl.constexpr, BITS: gl.constexpr, STAGES: gl.constexpr, ASM: gl.constexpr,
               CONS: gl.constexpr, XF16: gl.constexpr, VALUE_EXP: gl.constexpr, KIND: gl.constexpr, SUB: gl.constexpr,
               GW: gl.constexpr, X_SHARED: gl.constexpr, SWAP: gl.constexpr, BIAS: gl.constexpr):
    """A program's chunks c_lo .. c_hi after `program_start`: the pipeline's copies STAGES - 1 stages ahead and
    each chunk's work; returns the T row tiles' float32 accumulators (every copy waited for)."""
    NB: gl.constexpr = W * 4
    T: gl.constexpr = BN // (16 * gl.num_warps())   # row tiles of 16 channels per warp
    D: gl.constexpr = NB * F
    ys = _zeros_tiles(ROWS, T)
    if not X_SHARED:
        x_next = _load_x(X, x_at, stride_x, c_lo * NB, D, NB, ROWS, ROW_BYTES)
    for i in range(gl.cdiv(c_hi - c_lo, SUB)):
        ahead = i + STAGES - 1
        gl.thread_barrier()   # every lane is done reading the stage the next copy overwrites
        if c_lo + ahead * SUB < c_hi:
            _issue(ahead % STAGES, c_lo + ahead * SUB, c_hi, w_rows, w_smem, X, x_at, x_smem, W, SUB, X_SHARED)
        else:
            async_copy.commit_group()
        async_copy.wait_group(STAGES - 1)
        gl.thread_barrier()   # stage i's words, copied by every lane, are visible
        for u in gl.static_range(SUB):
            c = c_lo + i * SUB + u
            slot = (i % STAGES) * SUB + u
            if X_SHARED:
                x_in = x_smem.index(slot)
            else:
                x_in = x_next   # the next chunk's activations on their way while this one runs
                x_next = _load_x(X, x_at, stride_x, gl.minimum(c + 1, c_hi - 1) * NB, D, NB, ROWS, ROW_BYTES)
            if c < c_hi:
                ys = _chunk(w_smem.index(slot), s_run, z_run, c_lo * NB, x_in, ys, n0, N, stride_ws, c * NB, T, W,
                            F, NG, ROWS, ROW_BYTES, G, BITS, ASM, CONS, XF16, VALUE_EXP, KIND, GW, X_SHARED,
                            SWAP, BIAS)
    async_copy.wait_group(0)
    return ys


@gluon.jit
def program_sums(X, WC, WS, WZ, M, N, stride_x, stride_wc, stride_ws, chunks_per_split, BN: gl.constexpr,
                 W: gl.constexpr, F: gl.constexpr, NG: gl.constexpr, ROWS: gl.constexpr, ROW_BYTES: gl.constexpr,
                 G: gl.constexpr, BITS: gl.constexpr, STAGES: gl.constexpr, ASM: gl.constexpr, CONS: gl.constexpr,
                 XF16: gl.constexpr, VALUE_EXP: gl.constexpr, KIND: gl.constexpr, SUB: gl.constexpr, GW: gl.constexpr,
                 X_SHARED: gl.constexpr, SWAP: gl.constexpr, BIAS: gl.constexpr):
    """A program's work up to its end: (n0, the T row tiles' float32 sums over its split of k)."""
    n0, c_lo, c_hi, w_rows, x_at, w_smem, x_smem, s_run, z_run = program_start(
        X, WC, WS, WZ, M, N, stride_x, stride_wc, stride_ws, chunks_per_split, BN, W, F, ROWS, ROW_BYTES, G, STAGES,
        SUB, GW, KIND != 2, X_SHARED)
    ys = chunk_loop(X, x_at, x_smem, w_rows, w_smem, s_run, z_run, n0, c_lo, c_hi, M, N, stride_x, stride_ws, BN, W, F,
                    NG, ROWS, ROW_BYTES, G, BITS, STAGES, ASM, CONS, XF16, VALUE_EXP, KIND, SUB, GW, X_SHARED, SWAP,
                    BIAS)
    return n0, ys


@gluon.jit
def foldc_gemv_gluon(X, WC, WS, WZ, Y, PART, COUNTERS, M, N, stride_x, stride_wc, stride_ws, stride_y,
                     chunks_per_split, BN: gl.constexpr, W: gl.constexpr, F: gl.constexpr, NG: gl.constexpr,
                     ROWS: gl.constexpr, ROW_BYTES: gl.constexpr, G: gl.constexpr, BITS: gl.constexpr,
                     STAGES: gl.constexpr, SPLIT: gl.constexpr, ASM: gl.constexpr, CONS: gl.constexpr,
                     XF16: gl.constexpr, VALUE_EXP: gl.constexpr, KIND: gl.constexpr, SUB: gl.constexpr,
                     GW: gl.constexpr, X_SHARED: gl.constexpr, SWAP: gl.constexpr, BIAS: gl.constexpr):
    T: gl.constexpr = BN // (16 * gl.num_warps())   # row tiles of 16 channels per warp
    n0, ys = program_sums(X, WC, WS, WZ, M, N, stride_x, stride_wc, stride_ws, chunks_per_split, BN, W, F, NG, ROWS,
                          ROW_BYTES, G, BITS, STAGES, ASM, CONS, XF16, VALUE_EXP, KIND, SUB, GW, X_SHARED, SWAP,
                          BIAS)
    for t in gl.static_range(T):
        _finish(ys[t], t, Y, PART, n0, gl.program_id(1), M, N, stride_y, SPLIT, ROWS)
    if SPLIT > 1:
        gl.thread_barrier()   # every lane's partial is written before the counter says so
        done = gl.atomic_add(COUNTERS + gl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:   # the last program of the block: the sum of all partials, then y
            for t in gl.static_range(T):
                _reduce(t, Y, PART, n0, M, N, stride_y, SPLIT, ROWS)
            gl.atomic_xchg(COUNTERS + gl.program_id(0), 0, sem="relaxed", scope="gpu")
