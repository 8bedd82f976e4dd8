"""A variant of the register-operand GEMV for `benchmarks/gemv_ab.py --b benchmarks/gemv_variants.py`: the
production kernel (foldc/backends/gluon/gemv.py) with another `_chunk`. Not production code.

    PYTHONPATH=. python3 benchmarks/gemv_ab.py --b benchmarks/gemv_variants.py --quick --cases 0,1,2,3,4,7   # H200
    PYTHONPATH=. python3 benchmarks/gemv_variants.py     # CPU: registers and chunk-loop SASS beside production's

At m = 1 with bf16 activations (X_SHARED) the production `_chunk` puts the row in fp16 after broadcasting it
to the MMA operand's [D, ROWS] layout, where each lane holds D / 4 values (the row's 8 columns are copies):
the conversion (to float32, the largest magnitude, times a power of two, to fp16) runs on each of them, and
bf16 calls took 1.4x the fp16 ones on the H200 (19.4 against 13.7 µs at INT4 g128 4096 x 14336,
docs/results/gemv_ab_release_h200_2026-12-04.json). Here the row is converted with one element per lane
(D / 32 each: one load, the warp's largest magnitude by shuffles, the same power of two), then laid out as
the operand's columns (`convert_layout`, through shared memory). The values and the power of two are the
production kernel's, so the outputs should be bit-identical to it. Everything but `_chunk` is the production
kernel's; `chunk_loop`, `program_sums` and the kernel are copies that call this module's `_chunk`.

Built for sm_90 (`sass_counts`), INT4 g128 4096 x 14336 at bf16: 110 registers and 392 SASS per chunk against
production's 167 and 572 (fp16: 98 and 299); INT2 g128 28672 x 8192: 102 and 476 against 127 and 654. Not yet
run on a GPU (the previous variant, a release-only split-k counter, was 0-3% slower: the .json above).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from foldc.backends.gluon.gemv import (_finish, _issue, _load_x, _ones_mmas, _reduce, _row_tile, _zeros_tiles,
                                       program_start)
from foldc.backends.gluon.tile_operands import split_groups, swap_k01


@gluon.jit
def _chunk(w_tile, s_run, z_run, j_lo, x_in, ys, n0, N, stride_ws, j0, T: gl.constexpr, W: gl.constexpr,
           F: gl.constexpr, NG: gl.constexpr, ROWS: gl.constexpr, ROW_BYTES: gl.constexpr, G: gl.constexpr,
           BITS: gl.constexpr, ASM: gl.constexpr, CONS: gl.constexpr, XF16: gl.constexpr, VALUE_EXP: gl.constexpr,
           KIND: gl.constexpr, GW: gl.constexpr, X_SHARED: gl.constexpr, SWAP: gl.constexpr):
    """One chunk (bytes j0 .. j0 + NB of every row of the block) into the T row tiles' accumulators
    ``ys``; the activation's pieces and their sums are made once and shared by the tiles. ``x_in``: the
    activation chunk, its one row [D] in shared memory (X_SHARED, m = 1) or [D, ROWS] in registers, in
    channel order; SWAP: the weight's unpack (ASM) has k with bits 0 and 1 of the byte index swapped
    (operands.key_unpack_asm), and the activation is permuted to match (PRMTs that also build the MMA's
    register pairs), else the unpack keeps channel order (operands.natural_key_unpack_asm)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    row_l: gl.constexpr = gl.SliceLayout(0, mma)
    D: gl.constexpr = W * 4 * F
    P: gl.constexpr = D // NG
    if X_SHARED:   # one row, in every column
        if XF16:
            xd = x_in.load(gl.SliceLayout(1, b_l))
        else:   # bf16: the row in fp16 with one element per lane first
            flat: gl.constexpr = gl.BlockedLayout(size_per_thread=[max(1, D // 32)], threads_per_warp=[32],
                                                  warps_per_cta=[1], order=[0])
            xr = x_in.load(flat).to(gl.float32)
            c1 = gl.exp2(12.0 - gl.floor(gl.log2(gl.maximum(gl.max(gl.abs(xr), axis=0), 1e-30))))
            xd = gl.convert_layout((xr * c1).to(gl.float16), gl.SliceLayout(1, b_l))
        if SWAP:
            xd = gl.convert_layout(swap_k01(xd, D, 0), gl.SliceLayout(1, b_l), assert_trivial=True)
        xv = gl.broadcast(xd[:, None], gl.zeros([D, ROWS], gl.int1, layout=b_l))[0]
    elif SWAP:
        xv = gl.convert_layout(swap_k01(x_in, D, ROWS), b_l, assert_trivial=True)
    else:
        xv = x_in
    if XF16 or X_SHARED:   # (X_SHARED bf16: made above, one power of two c1 for the one row)
        x16 = xv
    else:   # each row times a power of two c (its largest entry near 2^12), then fp16 (exact)
        xf = xv.to(gl.float32)
        c = gl.exp2(12.0 - gl.floor(gl.log2(gl.maximum(gl.max(gl.abs(xf), axis=0), 1e-30))))
        x16 = (xf * c[None, :]).to(gl.float16)
    # each piece's sum of x as an MMA of ones, in the accumulator's layout (every row the same)
    ones = gl.full([16, P], 1.0, gl.float16, layout=a_l)
    zero = gl.zeros([16, ROWS], gl.float32, layout=mma)
    if NG == 1:
        xs = (x16,)
        sums = (mma_v2(ones, x16, zero),)
    else:
        xs = split_groups(x16, NG, 0)
        sums = _ones_mmas(ones, xs, zero, b_l, NG)
    if XF16:
        acc = ys
    else:
        acc = _zeros_tiles(ROWS, T)
    if T == 1:
        acc = (_row_tile(w_tile, s_run, z_run, j_lo, 0, xs, sums, acc[0], n0, N, stride_ws, j0, W, F, NG, ROWS,
                         ROW_BYTES, G, BITS, ASM, CONS, VALUE_EXP, KIND, GW),)
    elif T == 2:
        acc = (_row_tile(w_tile, s_run, z_run, j_lo, 0, xs, sums, acc[0], n0, N, stride_ws, j0, W, F, NG, ROWS,
                         ROW_BYTES, G, BITS, ASM, CONS, VALUE_EXP, KIND, GW),
               _row_tile(w_tile, s_run, z_run, j_lo, 1, xs, sums, acc[1], n0, N, stride_ws, j0, W, F, NG, ROWS,
                         ROW_BYTES, G, BITS, ASM, CONS, VALUE_EXP, KIND, GW))
    else:
        acc = (_row_tile(w_tile, s_run, z_run, j_lo, 0, xs, sums, acc[0], n0, N, stride_ws, j0, W, F, NG, ROWS,
                         ROW_BYTES, G, BITS, ASM, CONS, VALUE_EXP, KIND, GW),
               _row_tile(w_tile, s_run, z_run, j_lo, 1, xs, sums, acc[1], n0, N, stride_ws, j0, W, F, NG, ROWS,
                         ROW_BYTES, G, BITS, ASM, CONS, VALUE_EXP, KIND, GW),
               _row_tile(w_tile, s_run, z_run, j_lo, 2, xs, sums, acc[2], n0, N, stride_ws, j0, W, F, NG, ROWS,
                         ROW_BYTES, G, BITS, ASM, CONS, VALUE_EXP, KIND, GW),
               _row_tile(w_tile, s_run, z_run, j_lo, 3, xs, sums, acc[3], n0, N, stride_ws, j0, W, F, NG, ROWS,
                         ROW_BYTES, G, BITS, ASM, CONS, VALUE_EXP, KIND, GW))
    if XF16:
        out = acc
    else:   # this chunk's sums were of x times c: undone per activation row
        if X_SHARED:
            inv = 1.0 / c1
        else:
            inv = gl.convert_layout(1.0 / c, row_l)[None, :]
        if T == 1:
            out = (ys[0] + acc[0] * inv,)
        elif T == 2:
            out = (ys[0] + acc[0] * inv, ys[1] + acc[1] * inv)
        else:
            out = (ys[0] + acc[0] * inv, ys[1] + acc[1] * inv, ys[2] + acc[2] * inv, ys[3] + acc[3] * inv)
    return out


@gluon.jit
def chunk_loop(X, x_at, x_smem, w_rows, w_smem, s_run, z_run, n0, c_lo, c_hi, M, N, stride_x, stride_ws,
               BN: gl.constexpr, W: gl.constexpr, F: gl.constexpr, NG: gl.constexpr, ROWS: gl.constexpr,
               ROW_BYTES: gl.constexpr, G: gl.constexpr, BITS: gl.constexpr, STAGES: gl.constexpr, ASM: gl.constexpr,
               CONS: gl.constexpr, XF16: gl.constexpr, VALUE_EXP: gl.constexpr, KIND: gl.constexpr, SUB: gl.constexpr,
               GW: gl.constexpr, X_SHARED: gl.constexpr, SWAP: gl.constexpr):
    """A program's chunks c_lo .. c_hi after `program_start`: the pipeline's copies STAGES - 1 stages ahead and
    each chunk's work; returns the T row tiles' float32 accumulators (every copy waited for)."""
    NB: gl.constexpr = W * 4
    T: gl.constexpr = BN // 16
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
                            SWAP)
    async_copy.wait_group(0)
    return ys


@gluon.jit
def program_sums(X, WC, WS, WZ, M, N, stride_x, stride_wc, stride_ws, chunks_per_split, BN: gl.constexpr,
                 W: gl.constexpr, F: gl.constexpr, NG: gl.constexpr, ROWS: gl.constexpr, ROW_BYTES: gl.constexpr,
                 G: gl.constexpr, BITS: gl.constexpr, STAGES: gl.constexpr, ASM: gl.constexpr, CONS: gl.constexpr,
                 XF16: gl.constexpr, VALUE_EXP: gl.constexpr, KIND: gl.constexpr, SUB: gl.constexpr, GW: gl.constexpr,
                 X_SHARED: gl.constexpr, SWAP: gl.constexpr):
    """A program's work up to its end: (n0, the T row tiles' float32 sums over its split of k)."""
    n0, c_lo, c_hi, w_rows, x_at, w_smem, x_smem, s_run, z_run = program_start(
        X, WC, WS, WZ, M, N, stride_x, stride_wc, stride_ws, chunks_per_split, BN, W, F, ROWS, ROW_BYTES, G, STAGES,
        SUB, GW, KIND != 2, X_SHARED)
    ys = chunk_loop(X, x_at, x_smem, w_rows, w_smem, s_run, z_run, n0, c_lo, c_hi, M, N, stride_x, stride_ws, BN, W, F,
                    NG, ROWS, ROW_BYTES, G, BITS, STAGES, ASM, CONS, XF16, VALUE_EXP, KIND, SUB, GW, X_SHARED, SWAP)
    return n0, ys


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
        gl.thread_barrier()   # every lane's partial is written before the counter says so
        done = gl.atomic_add(COUNTERS + gl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:   # the last program of the block: the sum of all partials, then y
            for t in gl.static_range(T):
                _reduce(t, Y, PART, n0, M, N, stride_y, SPLIT, ROWS)
            gl.atomic_xchg(COUNTERS + gl.program_id(0), 0, sem="relaxed", scope="gpu")


def sass_counts(cases=(("k-group:4:128", 4096, 14336), ("k-group:2:128", 28672, 8192))) -> list[dict]:
    """Registers and chunk-loop SASS of the production kernel and this variant, built ahead of time for sm_90
    at m = 1 with fp16 and bf16 activations (CPU, no GPU; TRITON_INTERPRET unset)."""
    import sys
    import tempfile

    import foldc.backends.gluon.gemv as production
    from foldc.backends.gluon.gemv_aot import compile_gemv_aot
    from foldc.gemm import GemmSpec, parse_gemm_encoding

    rows, kept = [], production.foldc_gemv_gluon
    variant = sys.modules[__name__].foldc_gemv_gluon
    for enc, n, k in cases:
        for name, kernel in (("production", kept), ("variant", variant)):
            for dtype in ("fp16", "bf16"):
                production.foldc_gemv_gluon = kernel   # compile_gemv_aot builds the module's kernel
                try:
                    with tempfile.TemporaryDirectory() as out:
                        r = compile_gemv_aot(GemmSpec(n, k, parse_gemm_encoding(enc, "weight")), "sm_90", out, m=1,
                                             dtype=dtype)
                finally:
                    production.foldc_gemv_gluon = kept
                rows.append(dict(weight=enc, n=n, k=k, kernel=name, dtype=dtype, registers=r["registers"],
                                 chunk_sass=r["chunk_loop"]["instructions_per_warp"]))
                print(f"{enc} {n}x{k} {name:10} {dtype}: {r['registers']} registers, "
                      f"{rows[-1]['chunk_sass']} SASS per chunk", flush=True)
    return rows


if __name__ == "__main__":   # python3 benchmarks/gemv_variants.py: the SASS comparison above
    sass_counts()
