"""A variant of the register-operand GEMV for `benchmarks/gemv_ab.py`: a programmatic dependent launch (PDL, sm_90+).
Not production code.

    PYTHONPATH=. python3 benchmarks/gemv_ab.py --b benchmarks/gemv_pdl.py --quick --cases 0,1,2,3,4,5 \\
        --b-override '[{"launch_pdl": true}, {}]' --out $OUT/pdl.json        # GPU: checked, then timed
    python3 benchmarks/gemv_pdl.py                                         # CPU: registers and SASS per chunk

Why: at 4096 x 14336, m = 1 (INT4 g128) a call reads 31 MB, 7 µs at the H200's ceiling, and takes 14 µs; a one-wave
program of 7 chunks pays the launch, the first chunk's round trip and the split-k end (partials, an atomic, the last
program's sum) once each, about 5 µs of the call, with the memory idle for much of it. The weights (codes, scales,
zeros) are written by no kernel of a decode step; only the activation is. Launched with the PDL attribute, a call's
programs may start while the kernel before it on the stream finishes: each copies its scale and zero words and the
code words of its first STAGES - 1 stages, then waits for that kernel (``griddepcontrol.wait``) before it copies or
reads the activation. Each program lets the next launch begin once its chunks are done
(``griddepcontrol.launch_dependents``, before its partial and the split-k end), so a chain of GEMVs (a layer's
projections) streams weights across the calls' ends. Production launches without the attribute: these
instructions then do nothing (the wait returns at once), so the variant run as production's plain launch (``{}`` in
the override above) measures what they cost alone.

The activation of the first STAGES - 1 stages is copied in one group of its own after the wait, so the first
STAGES - 1 steps wait for one group fewer outstanding (every other step waits as production does).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

import foldc.backends.gluon.gemv as production
from foldc.bench import rebound

async_copy = production.async_copy


@gluon.jit
def _grid_wait(v):
    """Wait until the grids this launch depends on have finished and their writes are visible (``v``: any int32)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; mov.b32 $0, $1;", "=r,r", [v], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _let_dependents_launch(v):
    """Let the next programmatic dependent launch on the stream begin (``v``: any int32)."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.b32 $0, $1;", "=r,r", [v], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def program_start(X, WC, WS, WZ, M, N, stride_x, stride_wc, stride_ws, chunks_per_split, BN: gl.constexpr,
                  W: gl.constexpr, F: gl.constexpr, ROWS: gl.constexpr, ROW_BYTES: gl.constexpr, G: gl.constexpr,
                  STAGES: gl.constexpr, SUB: gl.constexpr, GW: gl.constexpr, HALF: gl.constexpr,
                  X_SHARED: gl.constexpr):
    """production.program_start with the weights' copies before the wait for the kernel before and the activation's
    after it."""
    NB: gl.constexpr = W * 4
    n0, c_lo, c_hi, w_rows, x_at, w_smem, x_smem = production.program_tiles(
        X, WC, M, N, stride_x, stride_wc, chunks_per_split, BN, W, F, ROWS, ROW_BYTES, STAGES, SUB, X_SHARED)
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
    for first in gl.static_range(STAGES - 1):   # the code words alone (X_SHARED 0: no activation copy)
        if c_lo + first * SUB < c_hi:
            production._issue(first, c_lo + first * SUB, c_hi, w_rows, w_smem, X, x_at, x_smem, W, SUB, 0)
        else:
            async_copy.commit_group()
    _grid_wait(n0)
    if X_SHARED:   # the first stages' activation, one group
        for first in gl.static_range(STAGES - 1):
            for u in gl.static_range(SUB):
                c = gl.minimum(c_lo + first * SUB + u, c_hi - 1)
                async_copy.async_copy_global_to_shared(x_smem.index(first * SUB + u), X + c * NB + x_at)
        async_copy.commit_group()
    return n0, c_lo, c_hi, w_rows, x_at, w_smem, x_smem, s_run, z_run


@gluon.jit
def chunk_loop(X, x_at, x_smem, w_rows, w_smem, s_run, z_run, n0, c_lo, c_hi, M, N, stride_x, stride_ws,
               BN: gl.constexpr, W: gl.constexpr, F: gl.constexpr, NG: gl.constexpr, ROWS: gl.constexpr,
               ROW_BYTES: gl.constexpr, G: gl.constexpr, BITS: gl.constexpr, STAGES: gl.constexpr, ASM: gl.constexpr,
               CONS: gl.constexpr, XF16: gl.constexpr, VALUE_EXP: gl.constexpr, KIND: gl.constexpr, SUB: gl.constexpr,
               GW: gl.constexpr, X_SHARED: gl.constexpr, SWAP: gl.constexpr, BIAS: gl.constexpr):
    """production.chunk_loop; with X_SHARED the first STAGES - 1 steps wait for one copy group fewer outstanding
    (the first stages' activation group, committed after their code words)."""
    NB: gl.constexpr = W * 4
    T: gl.constexpr = BN // (16 * gl.num_warps())
    D: gl.constexpr = NB * F
    ys = production._zeros_tiles(ROWS, T)
    if not X_SHARED:
        x_next = production._load_x(X, x_at, stride_x, c_lo * NB, D, NB, ROWS, ROW_BYTES)
    for i in range(gl.cdiv(c_hi - c_lo, SUB)):
        ahead = i + STAGES - 1
        gl.thread_barrier()
        if c_lo + ahead * SUB < c_hi:
            production._issue(ahead % STAGES, c_lo + ahead * SUB, c_hi, w_rows, w_smem, X, x_at, x_smem, W, SUB,
                              X_SHARED)
        else:
            async_copy.commit_group()
        if X_SHARED and i < STAGES - 1:
            async_copy.wait_group(STAGES - 2)
        else:
            async_copy.wait_group(STAGES - 1)
        gl.thread_barrier()
        for u in gl.static_range(SUB):
            c = c_lo + i * SUB + u
            slot = (i % STAGES) * SUB + u
            if X_SHARED:
                x_in = x_smem.index(slot)
            else:
                x_in = x_next
                x_next = production._load_x(X, x_at, stride_x, gl.minimum(c + 1, c_hi - 1) * NB, D, NB, ROWS,
                                            ROW_BYTES)
            if c < c_hi:
                ys = production._chunk(w_smem.index(slot), s_run, z_run, c_lo * NB, x_in, ys, n0, N, stride_ws,
                                       c * NB, T, W, F, NG, ROWS, ROW_BYTES, G, BITS, ASM, CONS, XF16, VALUE_EXP, KIND,
                                       GW, X_SHARED, SWAP, BIAS)
    async_copy.wait_group(0)
    return ys


program_sums = rebound(production.program_sums, program_start=program_start, chunk_loop=chunk_loop)


@gluon.jit
def foldc_gemv_gluon(X, WC, WS, WZ, Y, PART, COUNTERS, M, N, stride_x, stride_wc, stride_ws, stride_y,
                     chunks_per_split, BN: gl.constexpr, W: gl.constexpr, F: gl.constexpr, NG: gl.constexpr,
                     ROWS: gl.constexpr, ROW_BYTES: gl.constexpr, G: gl.constexpr, BITS: gl.constexpr,
                     STAGES: gl.constexpr, SPLIT: gl.constexpr, ASM: gl.constexpr, CONS: gl.constexpr,
                     XF16: gl.constexpr, VALUE_EXP: gl.constexpr, KIND: gl.constexpr, SUB: gl.constexpr,
                     GW: gl.constexpr, X_SHARED: gl.constexpr, SWAP: gl.constexpr, BIAS: gl.constexpr):
    """production.foldc_gemv_gluon with the variant's start and loop, letting the next launch begin after the
    chunks."""
    T: gl.constexpr = BN // (16 * gl.num_warps())
    n0, ys = program_sums(X, WC, WS, WZ, M, N, stride_x, stride_wc, stride_ws, chunks_per_split, BN, W, F, NG, ROWS,
                          ROW_BYTES, G, BITS, STAGES, ASM, CONS, XF16, VALUE_EXP, KIND, SUB, GW, X_SHARED, SWAP,
                          BIAS)
    _let_dependents_launch(n0)
    for t in gl.static_range(T):
        production._finish(ys[t], t, Y, PART, n0, gl.program_id(1), M, N, stride_y, SPLIT, ROWS)
    if SPLIT > 1:
        gl.thread_barrier()
        done = gl.atomic_add(COUNTERS + gl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:
            for t in gl.static_range(T):
                production._reduce(t, Y, PART, n0, M, N, stride_y, SPLIT, ROWS)
            gl.atomic_xchg(COUNTERS + gl.program_id(0), 0, sem="relaxed", scope="gpu")


CASES = (("k-group:4:128", 4096, 14336, 1), ("k-group:2:128", 28672, 8192, 1), ("k-group:4:128", 28672, 8192, 16),
         ("k-group:4:128", 4096, 14336, 4))

if __name__ == "__main__":   # registers and SASS per chunk beside production's
    from foldc.bench import gemv_variant_builds

    gemv_variant_builds(foldc_gemv_gluon, "pdl", CASES)
