"""An experiment for issue 20's large-m target (m = 256 no slower than fp16 cuBLAS): the weight dequantized into
shared memory as wgmma's B operand, the next chunk's dequantization overlapping the current chunk's wgmma.

`benchmarks/gemm_wgmma.py` fed the unpacked weight to wgmma from registers (A operand) and ran at 0.23-0.68x cuBLAS
(docs/gemm.md); the Triton template (foldc/backends/triton/gemm_dequant.py) waits for every dot before it unpacks
the next field: 0.55-0.67x. Here both wgmma operands come from shared memory, as in a plain fp16 GEMM:

- A program is 8 warps (two warpgroups) and a [BLOCK_M activation rows, BLOCK_N weight rows] tile of y. The weight
  is 4-bit codes in foldc's planar packing (byte j of a row holds k = j and k = K/2 + j), so a chunk of 64 code
  bytes of each weight row is two 64-wide k ranges: the activation's two [BLOCK_M, 64] tiles and the code tile
  [BLOCK_N, 64 bytes] travel together through a STAGES-deep cp.async ring.
- Dequantization: each thread unpacks two code words of four weight rows (PRMT, SHR, LOP3 to 1024 + code in fp16,
  a subtraction, exact) and forms ``fma(code, scale, zero)`` in fp16, one rounding of the exact ``s * c + z``, as
  the plan executor and the template do; the two fields' [BLOCK_N, 64] fp16 tiles go to shared memory (16-byte
  stores into the 128-byte swizzle wgmma reads), double-buffered.
- Chunk i's two wgmmas run asynchronously while chunk i + 1 is dequantized; they are waited just before chunk
  i + 1's are issued. No operand of a wgmma in flight is in registers, so nothing serialises them.

k groups of 64 and up (a chunk's 64 k of a field in one group), fp16 activations and fp16 scales. `foldc_gemm_ws`
below does the same work warp-specialized: a worker partition copies and dequantizes, the default partition only
issues the wgmmas, mbarriers between them. Not production code: both were slower than the template at m >= 256 on
an H100 (docs/gemm.md, "The large-m template against fp16 cuBLAS").

    PYTHONPATH=. python3 benchmarks/gemm_smem_b.py --out $OUT/smem_b       # GPU: check against float64, then time
                                                                           # beside cuBLAS and the template
    PYTHONPATH=. python3 benchmarks/gemm_smem_b.py --ablate --out $OUT/smem_b   # without dequantization / wgmmas
    PYTHONPATH=. python3 benchmarks/gemm_smem_b.py --ws --out $OUT/ws      # the warp-specialized kernel
    python3 benchmarks/gemm_smem_b.py --aot                                # CPU: sm_90 builds, registers, spills
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

CB = gl.constexpr(64)   # code bytes of a weight row per chunk (64 k per field)

# one code word (bytes b0..b3, k = 4u + e of each field) -> fp16 s * code + z for field 0 (k pairs (0, 1), (2, 3))
# and field 1; inputs: the word, then (scale, zero) of each field as packed half2
DEQUANT_ASM = gl.constexpr(" ".join([
    "{ .reg .b32 t0, t1, h0, h1, a0, a1, a2, a3, m;",
    "mov.b32 m, 0x64006400;",
    "prmt.b32 t0, $8, 0, 0x4140;", "prmt.b32 t1, $8, 0, 0x4342;",
    "shr.b32 h0, t0, 4;", "shr.b32 h1, t1, 4;",
    "lop3.b32 a0, t0, 0x000f000f, m, 0xea;", "lop3.b32 a1, t1, 0x000f000f, m, 0xea;",
    "lop3.b32 a2, h0, 0x000f000f, m, 0xea;", "lop3.b32 a3, h1, 0x000f000f, m, 0xea;",
    "sub.f16x2 a0, a0, m;", "sub.f16x2 a1, a1, m;", "sub.f16x2 a2, a2, m;", "sub.f16x2 a3, a3, m;",
    "fma.rn.f16x2 a0, a0, $9, $10;", "fma.rn.f16x2 a1, a1, $9, $10;",
    "fma.rn.f16x2 a2, a2, $11, $12;", "fma.rn.f16x2 a3, a3, $11, $12;",
    "mov.b32 {$0, $1}, a0;", "mov.b32 {$2, $3}, a1;", "mov.b32 {$4, $5}, a2;", "mov.b32 {$6, $7}, a3;",
    "}"]))
DEQUANT_CONS = gl.constexpr(",".join(["=h"] * 8 + ["r"] * 5))


@gluon.constexpr_function
def dequant_layout(WARPS, WORDS=16):
    # [BLOCK_N rows, WORDS words]: two consecutive words (8 k of each field) of a row per thread
    return gl.BlockedLayout([1, 2], [64 // int(WORDS), int(WORDS) // 2], [WARPS, 1], [1, 0])


@gluon.jit
def _issue(i, x_smem, c_smem, X, stride_x, WC32, stride_w32, m0, n0, M, N, j_first, RB: gl.constexpr,
           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """cp.async of chunk i into its ring slot: the activation's two [BLOCK_M, 64] k ranges and the code words."""
    slot = i % STAGES
    xl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    cl: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [gl.num_warps(), 1], [1, 0])
    j0 = j_first + i * CB
    r = gl.minimum(m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, xl)), M - 1)
    c = gl.arange(0, CB, layout=gl.SliceLayout(0, xl))
    xp = X + r[:, None] * stride_x + (j0 + c)[None, :]
    async_copy.async_copy_global_to_shared(x_smem.index(2 * slot), xp)
    async_copy.async_copy_global_to_shared(x_smem.index(2 * slot + 1), xp + RB)
    n = gl.minimum(n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, cl)), N - 1)
    u = gl.arange(0, CB // 4, layout=gl.SliceLayout(0, cl))
    async_copy.async_copy_global_to_shared(c_smem.index(slot), WC32 + n[:, None] * stride_w32 + (j0 // 4 + u)[None, :])
    async_copy.commit_group()


@gluon.jit
def _half2(v):
    """fp16 values as int32 words holding the value twice (a half2 of it)."""
    b = v.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    return b | (b << 16)


@gluon.jit
def _params(WS, WZ, stride_ws, n0, N, j0, RB: gl.constexpr, GROUP: gl.constexpr, BLOCK_N: gl.constexpr,
            PARAMS_T: gl.constexpr):
    """The (scale, zero) of both fields at code byte j0 for each weight row [BLOCK_N] (made half2 words where they
    are used, so that the loads' latency hides behind a chunk: packed here, the packing waited for them); PARAMS_T:
    the scales and zeros stored transposed, [k groups, n] (a chunk's rows one run of memory, not one line each)."""
    n = gl.minimum(n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, dequant_layout(gl.num_warps()))), N - 1)
    g0 = j0 // GROUP
    g1 = (RB + j0) // GROUP
    if PARAMS_T:
        a0 = g0 * stride_ws + n
        a1 = g1 * stride_ws + n
    else:
        a0 = n * stride_ws + g0
        a1 = n * stride_ws + g1
    return gl.load(WS + a0), gl.load(WZ + a0), gl.load(WS + a1), gl.load(WZ + a1)


@gluon.jit
def _join4(x0, x1, x2, x3):
    # [..., 2, 2] whose element [..., u, v] is x_(2u+v)
    return gl.join(gl.join(x0, x2), gl.join(x1, x3))


@gluon.jit
def _dequantize(c_tile, w_tiles, b, params, BLOCK_N: gl.constexpr, WIDTH: gl.constexpr = CB):
    """The code words of one chunk (WIDTH bytes of each row) -> the two fields' fp16 weight tiles [BLOCK_N, WIDTH]
    in buffer b."""
    w = c_tile.load(dequant_layout(gl.num_warps(), WIDTH // 4))
    s0, z0, s1, z1 = params
    s0 = gl.broadcast(_half2(s0)[:, None], w)[0]
    z0 = gl.broadcast(_half2(z0)[:, None], w)[0]
    s1 = gl.broadcast(_half2(s1)[:, None], w)[0]
    z1 = gl.broadcast(_half2(z1)[:, None], w)[0]
    o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(DEQUANT_ASM, DEQUANT_CONS, [w, s0, z0, s1, z1],
                                                               dtype=(gl.float16,) * 8, is_pure=True, pack=1)
    w_tiles.index(2 * b).store(gl.reshape(_join4(o0, o1, o2, o3), [BLOCK_N, WIDTH]))
    w_tiles.index(2 * b + 1).store(gl.reshape(_join4(o4, o5, o6, o7), [BLOCK_N, WIDTH]))


@gluon.jit
def foldc_gemm_smem_b(X, stride_x, WC, stride_w, WS, WZ, stride_ws, Y, stride_y, M, N,
                      K: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr, SPLIT: gl.constexpr, ABLATE: gl.constexpr = 0,
                      PARAMS_T: gl.constexpr = False):
    """y[m, n] = sum_k x[m, k] (s[n, g] code[n, k] + z[n, g]) for a 4-bit k-group weight; one [BLOCK_M, BLOCK_N]
    tile of y per program (SPLIT > 1: each split's share of k added into float32 y), weight-row tiles outer so that
    a weight tile's programs run side by side; BLOCK_M // 16 warps."""
    RB: gl.constexpr = K // 2              # code bytes of a row
    CHUNKS: gl.constexpr = RB // CB // SPLIT
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                    instr_shape=[16, BLOCK_N, 16])
    x_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, CB], gl.float16)
    w_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, CB], gl.float16)
    c_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    gl.static_assert(CHUNKS >= STAGES)

    pid = gl.program_id(0)
    tiles_m = gl.cdiv(M, BLOCK_M)
    m0 = (pid % tiles_m) * BLOCK_M
    n0 = (pid // tiles_m) * BLOCK_N
    j_first = gl.program_id(1) * (CHUNKS * CB)
    x_smem = gl.allocate_shared_memory(gl.float16, [2 * STAGES, BLOCK_M, CB], x_sl)
    c_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, CB // 4], c_sl)
    w_smem = gl.allocate_shared_memory(gl.float16, [4, BLOCK_N, CB], w_sl)
    WC32 = WC.to(gl.pointer_type(gl.int32), bitcast=True)
    stride_w32 = stride_w // 4

    for pre in gl.static_range(STAGES - 1):
        _issue(pre, x_smem, c_smem, X, stride_x, WC32, stride_w32, m0, n0, M, N, j_first, RB, BLOCK_M, BLOCK_N, STAGES)
    params = _params(WS, WZ, stride_ws, n0, N, j_first, RB, GROUP, BLOCK_N, PARAMS_T)
    async_copy.wait_group(STAGES - 2)
    gl.thread_barrier()
    _dequantize(c_smem.index(0), w_smem, 0, params, BLOCK_N)
    params = _params(WS, WZ, stride_ws, n0, N, j_first + CB, RB, GROUP, BLOCK_N, PARAMS_T)
    fence_async_shared()
    gl.thread_barrier()
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=acc_l)
    acc = warpgroup_mma(x_smem.index(0), w_smem.index(0).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(x_smem.index(1), w_smem.index(1).permute((1, 0)), acc, is_async=True)
    if ABLATE >= 2:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for i in range(CHUNKS - 1):
        # chunk i's wgmmas are in flight; chunk i - 1's slot and weight buffer are free
        if i + STAGES - 1 < CHUNKS:
            _issue(i + STAGES - 1, x_smem, c_smem, X, stride_x, WC32, stride_w32, m0, n0, M, N, j_first, RB,
                   BLOCK_M, BLOCK_N, STAGES)
        else:
            async_copy.commit_group()
        async_copy.wait_group(STAGES - 2)     # chunk i + 1 is here (this thread's copies)
        gl.thread_barrier()
        nb = (i + 1) % 2
        if ABLATE % 2 == 0:   # ABLATE 1 and 3 (`--ablate`): no dequantization
            _dequantize(c_smem.index((i + 1) % STAGES), w_smem, nb, params, BLOCK_N)
        if i + 2 < CHUNKS:
            params = _params(WS, WZ, stride_ws, n0, N, j_first + (i + 2) * CB, RB, GROUP, BLOCK_N, PARAMS_T)
        fence_async_shared()
        gl.thread_barrier()
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        slot = (i + 1) % STAGES
        if ABLATE < 2:   # ABLATE 2 and 3: no wgmma past the first chunk's
            acc = warpgroup_mma(x_smem.index(2 * slot), w_smem.index(2 * nb).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma(x_smem.index(2 * slot + 1), w_smem.index(2 * nb + 1).permute((1, 0)), acc,
                                is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    async_copy.wait_group(0)

    m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_l))
    n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_l))
    ok = (m < M)[:, None] & (n < N)[None, :]
    ptrs = Y + m[:, None] * stride_y + n[None, :]
    if SPLIT > 1:
        gl.atomic_add(ptrs, acc, mask=ok, sem="relaxed")
    else:
        gl.store(ptrs, acc.to(Y.dtype.element_ty), mask=ok)


# ---- the warp-specialized kernel ---------------------------------------------------------------------------

CW = gl.constexpr(32)   # code bytes of a weight row per chunk (32 k per field)


@gluon.jit
def _ws_params(WS, WZ, p_rows, j, RB: gl.constexpr, GROUP: gl.constexpr):
    """Chunk j's (scale, zero) of both fields for the rows ``p_rows`` (offsets of their first group), as `_params`."""
    g0 = (j * CW) // GROUP
    g1 = (RB + j * CW) // GROUP
    return gl.load(WS + p_rows + g0), gl.load(WZ + p_rows + g0), gl.load(WS + p_rows + g1), gl.load(WZ + p_rows + g1)


@gluon.jit
def _ws_producer(X, stride_x, WC32, stride_w32, WS, WZ, stride_ws, M, N, m0, n0, x_smem, c_smem, w_smem, ready,
                 w_empty, xc_empty, CONSTS: gl.constexpr):
    """The worker partition: cp.async of chunk i (the activation's two [BLOCK_M, CW] k ranges and the code words)
    into ring slot i % NC once the consumer is done with chunk i - NC, and the dequantization of chunk j = i - (NC - 2)
    into weight buffer j % NW, announced on ``ready``. (A lookahead of NC - 1 would deadlock: the consumer hands
    chunk i - NC's slot back only after chunk j's wgmmas are issued.)"""
    K: gl.constexpr = CONSTS[0]
    GROUP: gl.constexpr = CONSTS[1]
    BLOCK_M: gl.constexpr = CONSTS[2]
    BLOCK_N: gl.constexpr = CONSTS[3]
    NC: gl.constexpr = CONSTS[4]
    NW: gl.constexpr = CONSTS[5]
    RB: gl.constexpr = K // 2
    CHUNKS: gl.constexpr = RB // CW
    LA: gl.constexpr = NC - 2
    gl.static_assert(NC >= 3)
    WARPS: gl.constexpr = gl.num_warps()
    xl: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [WARPS, 1], [1, 0])
    cl: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [WARPS, 1], [1, 0])
    r = gl.minimum(m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, xl)), M - 1)
    x_rows = X + r[:, None] * stride_x + gl.arange(0, CW, layout=gl.SliceLayout(0, xl))[None, :]
    nc = gl.minimum(n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, cl)), N - 1)
    c_rows = WC32 + nc[:, None] * stride_w32 + gl.arange(0, CW // 4, layout=gl.SliceLayout(0, cl))[None, :]
    nd = gl.minimum(n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, dequant_layout(WARPS, CW // 4))), N - 1)
    p_rows = nd * stride_ws
    params = _ws_params(WS, WZ, p_rows, 0, RB, GROUP)
    for i in range(CHUNKS + LA):
        if i < CHUNKS:
            s = i % NC
            mbarrier.wait(xc_empty.index(s), ((i // NC) & 1) ^ 1)
            async_copy.async_copy_global_to_shared(x_smem.index(2 * s), x_rows + i * CW)
            async_copy.async_copy_global_to_shared(x_smem.index(2 * s + 1), x_rows + (RB + i * CW))
            async_copy.async_copy_global_to_shared(c_smem.index(s), c_rows + i * (CW // 4))
        async_copy.commit_group()
        if i >= LA:
            j = i - LA
            b = j % NW
            async_copy.wait_group(LA)        # chunk j is here (this thread's copies)
            gl.thread_barrier()              # (every producer thread's)
            mbarrier.wait(w_empty.index(b), ((j // NW) & 1) ^ 1)
            _dequantize(c_smem.index(j % NC), w_smem, b, params, BLOCK_N, CW)
            params = _ws_params(WS, WZ, p_rows, gl.minimum(j + 1, CHUNKS - 1), RB, GROUP)   # one chunk ahead
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(ready.index(b), count=1)


@gluon.jit
def _ws_consumer(Y, stride_y, M, N, m0, n0, x_smem, w_smem, ready, w_empty, xc_empty, CONSTS: gl.constexpr):
    """The default partition: chunk j's two wgmmas once ``ready``, chunk j - 1's buffers handed back once its
    wgmmas are done; then y's tile."""
    K: gl.constexpr = CONSTS[0]
    BLOCK_M: gl.constexpr = CONSTS[2]
    BLOCK_N: gl.constexpr = CONSTS[3]
    NC: gl.constexpr = CONSTS[4]
    NW: gl.constexpr = CONSTS[5]
    CHUNKS: gl.constexpr = K // 2 // CW
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                    instr_shape=[16, BLOCK_N, 16])
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=acc_l)
    for j in range(CHUNKS):
        s = j % NC
        b = j % NW
        mbarrier.wait(ready.index(b), (j // NW) & 1)
        acc = warpgroup_mma(x_smem.index(2 * s), w_smem.index(2 * b).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(x_smem.index(2 * s + 1), w_smem.index(2 * b + 1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc,))    # chunk j - 1's are done (this warpgroup's)
        gl.thread_barrier()                                         # (both warpgroups')
        if j > 0:
            mbarrier.arrive(xc_empty.index((j - 1) % NC), count=1)
            mbarrier.arrive(w_empty.index((j - 1) % NW), count=1)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_l))
    n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_l))
    ok = (m < M)[:, None] & (n < N)[None, :]
    gl.store(Y + m[:, None] * stride_y + n[None, :], acc.to(Y.dtype.element_ty), mask=ok)


@gluon.jit
def foldc_gemm_ws(X, stride_x, WC, stride_w, WS, WZ, stride_ws, Y, stride_y, M, N, K: gl.constexpr,
                  GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NC: gl.constexpr,
                  NW: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """`foldc_gemm_smem_b`'s product with the copies and the dequantization in a worker partition of
    PRODUCER_WARPS warps and the wgmmas in the default one (BLOCK_M // 16 warps): an NC-slot ring of activation and
    code tiles, NW dequantized weight buffers, mbarriers between the two."""
    x_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, CW], gl.float16)
    w_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, CW], gl.float16)
    c_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    gl.static_assert(K // 2 // CW >= NC)
    pid = gl.program_id(0)
    tiles_m = gl.cdiv(M, BLOCK_M)
    m0 = (pid % tiles_m) * BLOCK_M
    n0 = (pid // tiles_m) * BLOCK_N
    x_smem = gl.allocate_shared_memory(gl.float16, [2 * NC, BLOCK_M, CW], x_sl)
    c_smem = gl.allocate_shared_memory(gl.int32, [NC, BLOCK_N, CW // 4], c_sl)
    w_smem = gl.allocate_shared_memory(gl.float16, [2 * NW, BLOCK_N, CW], w_sl)
    ready = gl.allocate_shared_memory(gl.int64, [NW, 1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [NW, 1], mbarrier.MBarrierLayout())
    xc_empty = gl.allocate_shared_memory(gl.int64, [NC, 1], mbarrier.MBarrierLayout())
    for k in gl.static_range(NW):
        mbarrier.init(ready.index(k), count=1)
        mbarrier.init(w_empty.index(k), count=1)
    for k in gl.static_range(NC):
        mbarrier.init(xc_empty.index(k), count=1)
    CONSTS: gl.constexpr = (K, GROUP, BLOCK_M, BLOCK_N, NC, NW)
    gl.warp_specialize([(_ws_consumer, (Y, stride_y, M, N, m0, n0, x_smem, w_smem, ready, w_empty, xc_empty,
                                         CONSTS)),
                              (_ws_producer, (X, stride_x, WC.to(gl.pointer_type(gl.int32), bitcast=True),
                                              stride_w // 4, WS, WZ, stride_ws, M, N, m0, n0, x_smem, c_smem, w_smem,
                                              ready, w_empty, xc_empty, CONSTS))],
                       [PRODUCER_WARPS], [PRODUCER_REGS])


# ---- launch, check and time (GPU) ------------------------------------------------------------------------

def refusal(k: int, n: int, group: int, block_m: int, block_n: int, stages: int, split: int = 1) -> str | None:
    """Why the kernel does not take this call (None: it does)."""
    rb, cb = k // 2, CB.value
    if rb % (cb * split) or group % cb or rb % group:
        return f"k={k}, group {group}: 64-byte chunks of a row per field must lie in one group, groups in one field"
    if rb // cb // split < stages:
        return f"k={k}: fewer chunks per split than stages"
    if block_m not in (64, 128) or block_n not in (64, 128, 256):
        return f"block_m={block_m}, block_n={block_n}"
    return None


def launch(x, codes, scale, zero, group: int, block_m: int = 128, block_n: int = 128, stages: int = 3, split: int = 1,
           ablate: int = 0, params_t: bool = False):
    """y = x @ w.T for a foldc k-group:4 weight (codes [n, K/2] bytes, scale and zero [n, K/group] fp16); split > 1
    adds each split's share into a zeroed float32 y and casts it (both timed with the kernel)."""
    import torch
    m, k = x.shape
    n = codes.shape[0]
    why = refusal(k, n, group, block_m, block_n, stages, split)
    if why:
        raise ValueError(why)
    y = torch.zeros(m, n, device=x.device, dtype=torch.float32) if split > 1 else \
        torch.empty(m, n, device=x.device, dtype=x.dtype)
    grid = (-(-m // block_m) * -(-n // block_n), split)
    foldc_gemm_smem_b[grid](x, x.stride(0), codes, codes.stride(0), scale, zero, scale.stride(0), y, y.stride(0), m, n,
                            K=k, GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, SPLIT=split,
                            ABLATE=ablate, PARAMS_T=params_t, num_warps=block_m // 16)
    return y.to(x.dtype) if split > 1 else y


def refusal_ws(k: int, n: int, group: int, block_m: int, block_n: int, nc: int, nw: int, pw: int) -> str | None:
    """Why the warp-specialized kernel does not take this call (None: it does)."""
    rb, cw = k // 2, CW.value
    if rb % cw or group % cw or rb % group:
        return f"k={k}, group {group}: 32-byte chunks of a row per field must lie in one group, groups in one field"
    if rb // cw < nc:
        return f"k={k}: fewer chunks than ring slots"
    if block_m not in (64, 128) or block_n not in (128, 256) or nc < 3:
        return f"block_m={block_m}, block_n={block_n}, nc={nc}"
    if pw not in PRODUCER_REGS or (pw == 8 and block_m * block_n > 128 * 128):
        return f"{pw} producer warps: ptxas caps every thread at 65536 / threads registers (the accumulator)"
    return None


PRODUCER_REGS = {4: 128, 8: 80}   # the worker partition's registers by its warps (the default partition: the rest)


def launch_ws(x, codes, scale, zero, group: int, block_m: int = 128, block_n: int = 256, nc: int = 4, nw: int = 2,
              pw: int = 4):
    """`launch` through the warp-specialized kernel (ring slots nc, weight buffers nw, pw producer warps)."""
    import torch
    m, k = x.shape
    n = codes.shape[0]
    why = refusal_ws(k, n, group, block_m, block_n, nc, nw, pw)
    if why:
        raise ValueError(why)
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    grid = (-(-m // block_m) * -(-n // block_n),)
    foldc_gemm_ws[grid](x, x.stride(0), codes, codes.stride(0), scale, zero, scale.stride(0), y, y.stride(0), m, n,
                        K=k, GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, NC=nc, NW=nw, PRODUCER_WARPS=pw,
                        PRODUCER_REGS=PRODUCER_REGS[pw], num_warps=block_m // 16)
    return y


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# block_m, block_n, stages, split: (128, 64, 2) and (64, 64, 2) fit two and three programs an SM
VARIANTS = [(128, 128, 3, 1), (128, 64, 4, 1), (128, 64, 2, 1), (64, 64, 2, 1), (64, 128, 3, 1), (128, 64, 2, 2),
            (128, 128, 3, 2), (128, 64, 2, 4)]
WS_VARIANTS = [(128, 256, 6, 2, 4), (128, 128, 6, 2, 4), (128, 128, 6, 2, 8), (128, 128, 8, 3, 8),
               (64, 128, 8, 2, 8)]   # block_m, block_n, nc, nw, producer warps
def launch_t(x, codes, scale_t, zero_t, group: int, *variant):
    """`launch` with the scales and zeros transposed, [k groups, n] (`transposed`)."""
    return launch(x, codes, scale_t, zero_t, group, *variant, 0, True)


def transposed(scale, zero):
    return scale.t().contiguous(), zero.t().contiguous()


# name: (launch, refusal, variants, the scales and zeros as the launch takes them)
KERNELS = {"smem_b": (launch, refusal, VARIANTS, lambda s, z: (s, z)),
           "smem_b_t": (launch_t, refusal, VARIANTS, transposed),
           "ws": (launch_ws, refusal_ws, WS_VARIANTS, lambda s, z: (s, z))}


def check(seed: int, log, kernel: str = "smem_b") -> list:
    """Each variant against float64 dequantize-then-matmul, beside torch's own fp16 (bar: 2x its error)."""
    run, why, variants, prepare = KERNELS[kernel]
    import torch

    from foldc.gemm import parse_gemm_encoding
    from foldc.gemm.reference import quantize_2d

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for enc in ("k-group:4:128", "k-group:4:64"):
        e = parse_gemm_encoding(enc, "weight")
        for n, k in ((1000, 2048), (384, 4096)):
            w = quantize_2d((torch.randn(n, k, generator=gen) * 0.05).cuda(), e)
            codes, (sc, zr) = w.codes[0, 0], prepare(w.scale[0, 0], w.zero[0, 0])
            wd = w.dequantize(torch.float64)[0, 0]
            for m in (17, 128, 300):
                x = torch.randn(m, k, generator=gen).to("cuda", torch.float16)
                ref = x.double() @ wd.T
                bar = rel(x @ wd.half().T, ref)
                for v in variants:
                    if why(k, n, e.group_size, *v):
                        continue
                    errs = [rel(run(x, codes, sc, zr, e.group_size, *v), ref) for _ in range(2)]
                    ok = max(errs) <= 2 * bar + 1e-6
                    rows.append(dict(kernel=kernel, enc=enc, n=n, k=k, m=m, variant=v, err=max(errs), torch_err=bar,
                                     ok=ok))
                    log(f"{kernel} {enc} {n}x{k} m={m:3d} {v}: err {max(errs):.2e} torch {bar:.2e} "
                        f"{'ok' if ok else 'FAIL'}")
    return rows


TIMED = [(4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192)]
TIMED_ROWS = [128, 256, 512]


def timing(log, kernel: str = "smem_b", rows_timed: list[int] = TIMED_ROWS) -> list:
    """do_bench (L2 flushed) of fp16 cuBLAS on the dequantized weight, foldc's default (the Triton template), and
    the variants here, fp16 activations, INT4 g128."""
    import torch
    from triton.testing import do_bench

    import foldc
    from foldc.gemm import GemmSpec, parse_gemm_encoding
    from foldc.gemm.reference import quantize_2d

    run, why, variants, prepare = KERNELS[kernel]
    rows = []
    e = parse_gemm_encoding("k-group:4:128", "weight")
    for n, k in TIMED:
        w = quantize_2d((torch.randn(n, k) * 0.05).cuda(), e)
        w16 = w.dequantize(torch.float16)[0, 0].contiguous()
        codes, (sc, zr) = w.codes[0, 0], prepare(w.scale[0, 0], w.zero[0, 0])
        kern = foldc.compile(GemmSpec(n, k, e), target="auto")
        wd = w.dequantize(torch.float64)[0, 0]
        for m in rows_timed:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            ref = x.double() @ wd.T
            row = dict(n=n, k=k, m=m, cublas_us=do_bench(lambda: x @ w16.T) * 1e3, cublas_err=rel(x @ w16.T, ref),
                       template_us=do_bench(lambda: kern(x, w)) * 1e3, template_err=rel(kern(x, w), ref),
                       variants=[])
            for v in variants:
                if why(k, n, 128, *v):
                    continue
                try:
                    err = rel(run(x, codes, sc, zr, 128, *v), ref)
                    us = do_bench(lambda: run(x, codes, sc, zr, 128, *v)) * 1e3
                    row["variants"].append([*v, round(us, 2), err])
                except Exception as ex:  # noqa: BLE001 - a variant that does not build is a result
                    row["variants"].append([*v, f"{type(ex).__name__}: {str(ex)[:160]}", None])
            ok = [v for v in row["variants"] if isinstance(v[-2], float) and v[-1] <= 2 * row["cublas_err"] + 1e-6]
            best = min(ok, key=lambda v: v[-2]) if ok else None
            row["best"] = best
            log(f"INT4 g128 {n}x{k} m={m}: cuBLAS {row['cublas_us']:.1f} template {row['template_us']:.1f} "
                + (f"{kernel} {best[-2]:.1f} {best[:-2]} => x{row['cublas_us'] / best[-2]:.2f} cuBLAS, "
                   f"x{row['template_us'] / best[-2]:.2f} template" if best else f"{kernel}: none ok")
                + " | " + " ".join(f"{v[:-2]}:{v[-2]}" for v in row["variants"]))
            rows.append(row)
    return rows


def ablation(log) -> list:
    """Where a chunk's time goes: the kernel beside itself without the dequantization (1), without the wgmmas past
    the first chunk's (2), and with neither (3, the copies alone); fp16 x, INT4 g128, do_bench (L2 flushed)."""
    import torch
    from triton.testing import do_bench

    from foldc.gemm import parse_gemm_encoding
    from foldc.gemm.reference import quantize_2d

    rows = []
    e = parse_gemm_encoding("k-group:4:128", "weight")
    for n, k, m in ((28672, 8192, 256), (14336, 4096, 256), (4096, 4096, 256)):
        w = quantize_2d((torch.randn(n, k) * 0.05).cuda(), e)
        codes, sc, zr = w.codes[0, 0], w.scale[0, 0], w.zero[0, 0]
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        for bm, bn, stages in ((128, 128, 3), (128, 64, 4)):
            us = [do_bench(lambda: launch(x, codes, sc, zr, 128, bm, bn, stages, 1, ab)) * 1e3 for ab in range(4)]
            rows.append(dict(n=n, k=k, m=m, block_m=bm, block_n=bn, stages=stages, us=us))
            log(f"ablation {n}x{k} m={m} {bm}x{bn} s{stages}: all {us[0]:.1f} | no dequant {us[1]:.1f} | "
                f"no wgmma {us[2]:.1f} | copies alone {us[3]:.1f}")
    return rows


def aot(k: int, block_m: int, block_n: int, stages: int, split: int, out: Path | None) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from foldc.backends.gluon.aot import registers
    from foldc.backends.runtime.sass import disassemble, loop_instructions

    sig = {"X": "*fp16", "stride_x": "i32", "WC": "*u8", "stride_w": "i32", "WS": "*fp16", "WZ": "*fp16",
           "stride_ws": "i32", "Y": "*fp16", "stride_y": "i32", "M": "i32", "N": "i32"}
    consts = dict(K=k, GROUP=128, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, SPLIT=split, ABLATE=0)
    if split > 1:
        sig["Y"] = "*fp32"
    sig.update({c: "constexpr" for c in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(9)}
    c = triton.compile(GluonASTSource(foldc_gemm_smem_b, sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": block_m // 16})
    d = Path(out or "/tmp/gemm_smem_b") / f"k{k}_m{block_m}_n{block_n}_s{stages}_split{split}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "kernel.cubin").write_bytes(c.asm["cubin"])
    (d / "kernel.ptx").write_text(c.asm["ptx"])
    sass = disassemble(d / "kernel.cubin")
    (d / "kernel.sass").write_text("\n".join(f"{a:#06x} {op} {rest}" for a, op, rest in sass))
    loop = [op for _, op, _ in loop_instructions(d / "kernel.cubin")]
    count = lambda p: sum(op.startswith(p) for op in loop)  # noqa: E731
    return {"build": d.name, "registers": registers(d / "kernel.cubin"), "shared": c.metadata.shared,
            "spill_stores": sum(op.startswith("STL") for _, op, _ in sass), "loop_instructions": len(loop),
            "hgmma": count("HGMMA"), "hfma2": count("HFMA2"), "lds": count("LDS"), "sts": count("STS"),
            "ldg": count("LDG"), "ldgsts": count("LDGSTS"), "bar": count("BAR"), "depbar": count("WARPGROUP")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--aot", action="store_true", help="build for sm_90 on this machine (no GPU) and report")
    ap.add_argument("--out", default=None)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--ablate", action="store_true", help="time the kernel without its dequantization or wgmmas")
    ap.add_argument("--ws", action="store_true", help="check and time the warp-specialized kernel instead")
    ap.add_argument("--params-t", action="store_true", help="... the kernel with its scales and zeros transposed")
    ap.add_argument("--rows", default=",".join(map(str, TIMED_ROWS)), help="activation rows timed (comma-separated)")
    ap.add_argument("--one", nargs="+", type=int, metavar="N K M VARIANT",
                    help="launch one variant once at n x k, m rows (Nsight Compute); --ws: the warp-specialized")
    a = ap.parse_args()
    if a.aot:
        rows = [aot(8192, *v, Path(a.out) if a.out else None) for v in VARIANTS]
        for r in rows:
            print(json.dumps(r))
        return
    import torch
    if a.one:
        from foldc.gemm import parse_gemm_encoding
        from foldc.gemm.reference import quantize_2d
        n, k, m, *variant = a.one
        w = quantize_2d((torch.randn(n, k) * 0.05).cuda(), parse_gemm_encoding("k-group:4:128", "weight"))
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        run = KERNELS["ws" if a.ws else "smem_b"][0]
        run(x, w.codes[0, 0], w.scale[0, 0], w.zero[0, 0], 128, *variant)
        torch.cuda.synchronize()
        return
    out = Path(a.out or "results/smem_b")
    out.mkdir(parents=True, exist_ok=True)
    lines = []

    def log(line):
        print(line, flush=True)
        lines.append(line)
    log(f"seed {a.seed}; {torch.cuda.get_device_name()}; torch {torch.__version__}")
    if a.ablate:
        (out / "smem_b_ablation.json").write_text(json.dumps(ablation(log), indent=1))
        return
    kernel = "ws" if a.ws else "smem_b_t" if a.params_t else "smem_b"
    result = {"seed": a.seed, "checks": check(a.seed, log, kernel)}
    bad = [r for r in result["checks"] if not r["ok"]]
    log(f"checks: {len(result['checks']) - len(bad)}/{len(result['checks'])} within the bar")
    if not a.check_only:
        result["times"] = timing(log, kernel, [int(r) for r in a.rows.split(",")])
    (out / f"{kernel}.json").write_text(json.dumps(result, indent=1, default=str))
    (out / f"{kernel}.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
