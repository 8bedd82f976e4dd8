"""An experiment for issue 20's large-m target (m = 256 no slower than fp16 cuBLAS): the dequantize-then-
dot GEMM as a Gluon kernel whose wgmma runs asynchronously while the next chunk is unpacked.

The Triton template (foldc/backends/triton/gemm_dequant.py) waits for every wgmma before it unpacks the
next field (its SASS: ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` after each chain; Triton 3.6 does not pipeline a
dot whose A operand is computed in registers) and loads the scales from global memory inside the loop,
so the tensor cores idle while the warps unpack: 0.55-0.67x cuBLAS at m = 256 (docs/gemm.md). Here:

- Programs of two warpgroups (8 warps): 128 weight rows x BLOCK_M activation rows (y's tile transposed,
  the weight is wgmma's A operand from registers; the activation chunk is the B operand in shared
  memory). Chunks of 64 k slots (four wgmma k-steps) run through a STAGES-deep cp.async ring; the
  chunk i + STAGES - 2 is copied while chunk i is unpacked.
- wgmma i is issued asynchronously and waited with one group outstanding: the unpack of chunk i + 1
  overlaps it (ptxas keeps A's registers until the wait, or serializes; `--aot` reports which).
- The k slots of a chunk are permuted so that one 16-bit load gives a thread all its A-operand values
  of a k-step: slot ``16 (b P + p) + 8 h + 2 t + e`` is field ``2 p + h`` of byte ``8 b + 2 t + e``
  (P = fields / 2; a byte holds fields f at k = f * K/F + j, the planar packing of foldc/encoding.py).
  The activation chunk is copied into the same slot order, 8 consecutive k (16 bytes) per copy, so
  the product is unchanged.
- Values are ``fma(code, scale, zero)`` in fp16 (bf16 with bf16 scales): one rounding of the exact
  ``s * c + z``, as the template and the plan executor form them. The scales of chunk i + 1 are
  loaded while chunk i's wgmma runs.

2-, 4- and 8-bit weights (8-bit with fp16 only), k groups that hold whole chunks (16 and up for INT2, 32 for
INT4, 64 for INT8; 8-bit slots are the bytes in stored order).

Result (H200, 2026-12-05, docs/gemm.md "The large-m template against fp16 cuBLAS"): exact, but 0.23-0.68x
cuBLAS and slower than the template at most INT4 shapes; not adopted.

    PYTHONPATH=. python3 benchmarks/gemm_wgmma.py --out $OUT/wgmma [--check-only | --time-only | --small]
                            # GPU: check against float64, then time beside cuBLAS and the Triton template
    python3 benchmarks/gemm_wgmma.py --aot [--out DIR]    # CPU: the slot orders emulated in float64, then
                                                          # sm_90 builds: registers, spills, waits per wgmma
"""
from __future__ import annotations

import argparse
import json
import math
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
    fence_async_shared, warpgroup_mma, warpgroup_mma_wait)

ROWS = gl.constexpr(128)     # weight rows per program (two warpgroups of 64)
CHUNK = gl.constexpr(64)     # k slots per chunk (four wgmma k-steps of 16)


def unpack_pair_asm(bits: int, bf16: bool) -> tuple[str, str]:
    """PTX for pack=2 over (u16, the same u16): per bit field f one pair (MAGIC + field f of the low
    byte, MAGIC + field f of the high byte), fp16 1024 + code or bf16 128 + code (exact)."""
    fields = 8 // bits
    magic = "0x43004300" if bf16 else "0x64006400"
    mask = (1 << bits) - 1
    out = ["{ .reg .b32 a, t;", f"prmt.b32 a, ${fields}, 0, 0x4140;"]
    for f in range(fields):
        src = "a"
        if f:
            out.append(f"shr.b32 t, a, {bits * f};")
            src = "t"
        out.append(f"lop3.b32 ${f}, {src}, 0x{mask:04x}{mask:04x}, {magic}, 0xea;")
    out.append("}")
    return " ".join(out), ",".join(["=r"] * fields + ["r"])


@gluon.constexpr_function
def slot_layout(P, NBLK):
    # [ROWS, NBLK, P, 2 (h), 4 (t), 2 (e)]: wgmma's register A operand (k_width 2, 8 warps on rows) with
    # k slot 16 (b P + p) + 8 h + 2 t + e: registers e, row + 8, h, then the k-steps (p, then b)
    def v(dim, x):
        return [x if d == dim else 0 for d in range(6)]
    reg = [v(5, 1), v(0, 8), v(3, 1)] + [v(2, 1 << i) for i in range(int(math.log2(P)))] + \
        [v(1, 1 << i) for i in range(int(math.log2(NBLK)))]
    lanes = [v(4, 1), v(4, 2), v(0, 1), v(0, 2), v(0, 4)]
    warps = [v(0, 16), v(0, 32), v(0, 64)]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lanes, warp_bases=warps, block_bases=[],
                                      shape=[128, NBLK, P, 2, 4, 2])


@gluon.constexpr_function
def words_layout(NBLK):
    # [ROWS, 4 NBLK] 16-bit code pairs, u = 4 b + t: lane (g, t) of warp w holds u = 4 b + t of rows
    # 16 w + g (+ 8)
    reg = [[8, 0]] + [[0, 4 << i] for i in range(int(math.log2(NBLK)))]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16, 0], [32, 0], [64, 0]], block_bases=[], shape=[128, 4 * NBLK])


@gluon.jit
def _issue(i, x_buf, c_buf, X, stride_x, WC, stride_w, m0, n0, M, N, j_first, RB: gl.constexpr,
           BLOCK_M: gl.constexpr, BK: gl.constexpr, P: gl.constexpr):
    """cp.async of chunk i: the activation rows in slot order and the code bytes of the 128 weight rows."""
    xl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    cl: gl.constexpr = gl.BlockedLayout([1, BK // 4], [16, 2], [8, 1], [1, 0])
    j0 = j_first + i * BK
    c = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, xl))
    ks = c // 16
    if P == 0:   # 8-bit codes: slot c is byte c, as stored
        k = j0 + c
    else:
        k = (2 * (ks % P) + (c // 8) % 2) * RB + j0 + 8 * (ks // P) + c % 8
    r = gl.minimum(m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, xl)), M - 1)
    async_copy.async_copy_global_to_shared(x_buf, X + r[:, None] * stride_x + k[None, :])
    n = gl.minimum(n0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, cl)), N - 1)
    u = gl.arange(0, BK // 2, layout=gl.SliceLayout(0, cl))
    async_copy.async_copy_global_to_shared(c_buf, WC + n[:, None] * (stride_w // 2) + (j0 // 2 + u)[None, :])
    async_copy.commit_group()


@gluon.jit
def _pick(s: gl.constexpr, b0, b1, b2, b3, b4):
    """Buffer s of the ring (one allocation per stage, so that the compiler's barrier analysis sees that
    the copies into one stage do not touch the stage being read)."""
    if s == 0:
        out = b0
    elif s == 1:
        out = b1
    elif s == 2:
        out = b2
    elif s == 3:
        out = b3
    else:
        out = b4
    return out


@gluon.jit
def _params(WS, WZ, stride_ws, n0, N, j0, RB: gl.constexpr, GROUP: gl.constexpr, P: gl.constexpr,
            NBLK: gl.constexpr):
    """The scales and zeros of a chunk, [ROWS, P, 2] (row, field pair, field in pair), in the slice of
    slot_layout they broadcast from."""
    PP: gl.constexpr = max(P, 1)
    l3: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(4, gl.SliceLayout(5, slot_layout(PP, NBLK))))
    r = gl.minimum(n0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, l3))), N - 1)
    p = gl.arange(0, PP, layout=gl.SliceLayout(1, gl.SliceLayout(0, l3)))
    h = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(0, l3)))
    field = 2 * p[:, None] + h[None, :]
    if P == 0:   # 8-bit codes: one field; h is a byte offset
        field = field * 0
    g = (field * RB + j0) // GROUP
    off = r[:, None, None] * stride_ws + g[None, :, :]
    return gl.load(WS + off), gl.load(WZ + off)


@gluon.jit
def _spread(t, shape: gl.constexpr):
    """[ROWS, P, 2] -> [ROWS, NBLK, P, 2, 4, 2], the same value over the bytes of a field."""
    return gl.expand_dims(gl.expand_dims(gl.expand_dims(t, 1), 4), 5).broadcast_to(shape)


@gluon.jit
def _fields(pair, ASM: gl.constexpr, CONS: gl.constexpr, F: gl.constexpr, BF16: gl.constexpr):
    if F == 1:
        out = gl.inline_asm_elementwise(ASM, CONS, [pair], dtype=gl.float16, is_pure=True, pack=2)
    elif BF16:
        if F == 2:
            out = gl.inline_asm_elementwise(ASM, CONS, [pair], dtype=(gl.bfloat16,) * 2, is_pure=True, pack=2)
        else:
            out = gl.inline_asm_elementwise(ASM, CONS, [pair], dtype=(gl.bfloat16,) * 4, is_pure=True, pack=2)
    else:
        if F == 2:
            out = gl.inline_asm_elementwise(ASM, CONS, [pair], dtype=(gl.float16,) * 2, is_pure=True, pack=2)
        else:
            out = gl.inline_asm_elementwise(ASM, CONS, [pair], dtype=(gl.float16,) * 4, is_pure=True, pack=2)
    return out


@gluon.jit
def _operand(c_tile, s, z, ASM: gl.constexpr, CONS: gl.constexpr, F: gl.constexpr, P: gl.constexpr,
             NBLK: gl.constexpr, BF16: gl.constexpr, BIAS: gl.constexpr):
    """The chunk's weight values s * c + z (one rounding) in wgmma's register A layout, [ROWS, CHUNK]."""
    PP: gl.constexpr = max(P, 1)
    w16 = c_tile.load(words_layout(CHUNK // F // 8))                               # [ROWS, BK / 2]
    pair = gl.join(w16, w16)
    if F == 1:   # u = 8 ks + 4 h + t: bytes 16 ks + 8 h + 2 t + e in stored order
        y = _fields(pair, ASM, CONS, F, BF16)
    elif F == 2:
        f0, f1 = _fields(pair, ASM, CONS, F, BF16)
        y = gl.join(f0, f1)                                                        # [ROWS, 4 NBLK, e, h]
        y = gl.reshape(y, [ROWS, NBLK, 4, 2, 2])
        y = gl.permute(y, (0, 1, 4, 2, 3))
    else:
        f0, f1, f2, f3 = _fields(pair, ASM, CONS, F, BF16)
        y = gl.join(gl.join(f0, f1), gl.join(f2, f3))                              # [ROWS, 4 NBLK, e, h, p]
        y = gl.reshape(y, [ROWS, NBLK, 4, 2, 2, 2])
        y = gl.permute(y, (0, 1, 5, 4, 2, 3))
    l6: gl.constexpr = slot_layout(PP, NBLK)
    shape: gl.constexpr = [ROWS, NBLK, PP, 2, 4, 2]
    y = gl.convert_layout(gl.reshape(y, shape), l6, assert_trivial=True)
    v = gl.fma(y - BIAS, _spread(s, shape), _spread(z, shape))
    return gl.reshape(v, [ROWS, CHUNK])


@gluon.jit
def foldc_gemm_wgmma(X, stride_x, WC, stride_w, WS, WZ, stride_ws, Y, stride_y, M, N,
                     K: gl.constexpr, BITS: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
                     STAGES: gl.constexpr, GROUP_M: gl.constexpr, SPLIT_K: gl.constexpr, BF16: gl.constexpr,
                     ASM: gl.constexpr, CONS: gl.constexpr):
    """y[m, n] = sum_k x[m, k] (s[n, g] code[n, k] + z[n, g]); program (tile, split)."""
    F: gl.constexpr = 8 // BITS
    P: gl.constexpr = F // 2               # field pairs per byte (0: 8-bit codes)
    NBLK: gl.constexpr = 4 // max(P, 1)
    BK: gl.constexpr = CHUNK // F          # code bytes of a row per chunk
    RB: gl.constexpr = K // F              # code bytes of a row
    PART: gl.constexpr = RB // SPLIT_K
    CHUNKS: gl.constexpr = PART // BK
    VT: gl.constexpr = gl.bfloat16 if BF16 else gl.float16
    BIAS: gl.constexpr = 128.0 if BF16 else 1024.0
    INSTR_N: gl.constexpr = BLOCK_M if BLOCK_M <= 256 else 256
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, INSTR_N, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    x_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, CHUNK], VT)
    c_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])

    pid = gl.program_id(0)
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, ROWS)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    size_m = gl.minimum(tiles_m - first_m, GROUP_M)
    m0 = (first_m + (pid % per_group) % size_m) * BLOCK_M
    n0 = ((pid % per_group) // size_m) * ROWS
    j_first = gl.program_id(1) * PART

    gl.static_assert(CHUNKS % STAGES == 0, "the ring's stages must divide the chunks of a program")
    gl.static_assert(STAGES >= 3 and STAGES <= 5)
    x0 = gl.allocate_shared_memory(VT, [BLOCK_M, CHUNK], x_sl)
    x1 = gl.allocate_shared_memory(VT, [BLOCK_M, CHUNK], x_sl)
    x2 = gl.allocate_shared_memory(VT, [BLOCK_M, CHUNK], x_sl)
    c0 = gl.allocate_shared_memory(gl.int16, [ROWS, BK // 2], c_sl)
    c1 = gl.allocate_shared_memory(gl.int16, [ROWS, BK // 2], c_sl)
    c2 = gl.allocate_shared_memory(gl.int16, [ROWS, BK // 2], c_sl)
    if STAGES > 3:
        x3 = gl.allocate_shared_memory(VT, [BLOCK_M, CHUNK], x_sl)
        c3 = gl.allocate_shared_memory(gl.int16, [ROWS, BK // 2], c_sl)
    else:
        x3 = x0
        c3 = c0
    if STAGES > 4:
        x4 = gl.allocate_shared_memory(VT, [BLOCK_M, CHUNK], x_sl)
        c4 = gl.allocate_shared_memory(gl.int16, [ROWS, BK // 2], c_sl)
    else:
        x4 = x0
        c4 = c0
    WC16 = WC.to(gl.pointer_type(gl.int16), bitcast=True)
    for pre in gl.static_range(STAGES - 2):
        _issue(pre, _pick(pre, x0, x1, x2, x3, x4), _pick(pre, c0, c1, c2, c3, c4), X, stride_x, WC16, stride_w, m0, n0,
               M, N, j_first, RB, BLOCK_M, BK, P)
    s, z = _params(WS, WZ, stride_ws, n0, N, j_first, RB, GROUP, P, NBLK)
    acc = gl.zeros([ROWS, BLOCK_M], gl.float32, layout=acc_l)
    a = gl.zeros([ROWS, CHUNK], VT, layout=a_l)
    for i0 in range(0, CHUNKS, STAGES):
        for st in gl.static_range(STAGES):
            i = i0 + st
            async_copy.wait_group(STAGES - 3)       # chunk i is here (this thread's copies)
            fence_async_shared()
            gl.thread_barrier()                     # everyone's copies; every wgmma before i - 1 is done
            if i + STAGES - 2 < CHUNKS:
                _issue(i + STAGES - 2, _pick((st + STAGES - 2) % STAGES, x0, x1, x2, x3, x4),
                       _pick((st + STAGES - 2) % STAGES, c0, c1, c2, c3, c4), X, stride_x,
                       WC16, stride_w, m0, n0, M, N, j_first, RB, BLOCK_M, BK, P)
            else:
                async_copy.commit_group()
            v = _operand(_pick(st, c0, c1, c2, c3, c4), s, z, ASM, CONS, F, P, NBLK, BF16, BIAS)
            if i + 1 < CHUNKS:
                s, z = _params(WS, WZ, stride_ws, n0, N, j_first + (i + 1) * BK, RB, GROUP, P, NBLK)
            a_next = gl.convert_layout(v, a_l, assert_trivial=True)
            acc = warpgroup_mma(a_next, _pick(st, x0, x1, x2, x3, x4).permute((1, 0)), acc, is_async=True)
            # wgmma i - 1 is done: a, its operand, is free; a_next stays in use until the next wait
            acc, a = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a))
            a = a_next
    acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))
    async_copy.wait_group(0)

    n = n0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_l))
    m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc_l))
    ok = (m < M)[None, :] & (n < N)[:, None]
    ptrs = Y + m[None, :] * stride_y + n[:, None]
    if SPLIT_K > 1:
        gl.atomic_add(ptrs, acc, mask=ok, sem="relaxed")
    else:
        gl.store(ptrs, acc.to(Y.dtype.element_ty), mask=ok)


# ---- launch, check and time (GPU) ------------------------------------------------------------------------

def refusal(k: int, n: int, bits: int, group: int, block_m: int, stages: int, split_k: int,
            bf16: bool = False) -> str | None:
    """Why the kernel does not take this call (None: it does)."""
    if bits not in (2, 4, 8):
        return f"bits={bits}: 2, 4 and 8"
    if bits == 8 and bf16:
        return "8-bit codes with bf16: 128 + code is not exact in bf16 past 128"
    fields = 8 // bits
    bk = CHUNK.value // fields
    rb = k // fields
    if rb % group or group % bk:
        return f"group {group}: a chunk's {bk} bytes per field must lie in one group, and groups in one field"
    if rb % split_k or (rb // split_k) % (bk * stages):
        return f"k={k}: {rb // split_k} code bytes per split are not whole rings of {stages} x {bk}-byte chunks"
    if block_m not in (32, 64, 128, 256):
        return f"block_m={block_m}"
    return None


def launch(x, codes, scale, zero, bits: int, group: int, block_m: int = 256, stages: int = 4, split_k: int = 1):
    """y = x @ w.T for a foldc k-group weight (codes [n, K/F] bytes, scale and zero [n, K/group] in x's dtype)."""
    import torch
    m, k = x.shape
    n = codes.shape[0]
    bf16 = x.dtype == torch.bfloat16
    why = refusal(k, n, bits, group, block_m, stages, split_k, bf16)
    if why:
        raise ValueError(why)
    asm, cons = unpack_pair_asm(bits, bf16)
    grid = (-(-m // block_m) * -(-n // 128), split_k)
    consts = dict(K=k, BITS=bits, GROUP=group, BLOCK_M=block_m, STAGES=stages, GROUP_M=8, SPLIT_K=split_k, BF16=bf16,
                  ASM=asm, CONS=cons, num_warps=8)
    if split_k > 1:
        ws = torch.zeros(m, n, device=x.device, dtype=torch.float32)
        foldc_gemm_wgmma[grid](x, x.stride(0), codes, codes.stride(0), scale, zero, scale.stride(0), ws, ws.stride(0),
                               m, n, **consts)
        return ws.to(x.dtype)
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    foldc_gemm_wgmma[grid](x, x.stride(0), codes, codes.stride(0), scale, zero, scale.stride(0), y, y.stride(0),
                           m, n, **consts)
    return y


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


CHECKED = ["k-group:4:128", "k-group:4:64", "k-group:4:32", "k-group:2:128", "k-group:2:64", "k-group:2:32",
           "k-group:8:128", "k-group:8:64", "k-group:4:128:bf16", "k-group:2:64:bf16"]


def check(seed: int, log) -> list:
    """Every variant against float64 dequantize-then-matmul, beside torch's own (bar: 2x its error)."""
    import torch

    from foldc.gemm import parse_gemm_encoding
    from foldc.gemm.reference import quantize_2d

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for enc in CHECKED:
        e = parse_gemm_encoding(enc, "weight")
        dtype = torch.bfloat16 if e.scale_dtype == torch.bfloat16 else torch.float16
        for n, k in ((1000, 2048),):
            w = quantize_2d((torch.randn(n, k, generator=gen) * 0.05).cuda(), e)
            codes, sc, zr = w.codes[0, 0], w.scale[0, 0], w.zero[0, 0]
            wd = w.dequantize(torch.float64)[0, 0]
            for m in (17, 100, 256, 300):
                x = torch.randn(m, k, generator=gen).to("cuda", dtype)
                ref = x.double() @ wd.T
                bar = rel(x @ wd.to(dtype).T, ref)
                for bm, stages, split in ((256, 4, 1), (128, 4, 2), (32, 4, 2)):
                    why = refusal(k, n, e.bits, e.group_size, bm, stages, split, dtype == torch.bfloat16)
                    if why:
                        continue
                    errs = [rel(launch(x, codes, sc, zr, e.bits, e.group_size, bm, stages, split), ref) for _ in range(3)]
                    ok = max(errs) <= 2 * bar + 1e-6
                    rows.append(dict(enc=enc, n=n, k=k, m=m, block_m=bm, stages=stages, split=split, err=max(errs),
                                     spread=max(errs) - min(errs), torch_err=bar, ok=ok))
                    log(f"{enc:20s} {n}x{k} m={m:3d} bm={bm} split={split} err {max(errs):.2e} torch {bar:.2e} "
                        f"{'ok' if ok else 'FAIL'}")
    return rows


TIMED = [(4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192)]
TIMED_ROWS = [64, 128, 256, 512]
VARIANTS = [(256, 4, 1), (128, 4, 1), (256, 4, 2), (128, 4, 2), (64, 4, 2)]   # block_m, stages, split_k


def timing(log) -> list:
    """do_bench (L2 flushed) of fp16 cuBLAS on the dequantized weight, foldc's default (the Triton
    template), and the variants here, fp16 activations."""
    import torch
    from triton.testing import do_bench

    import foldc
    from foldc.gemm import GemmSpec, parse_gemm_encoding
    from foldc.gemm.reference import quantize_2d

    rows = []
    for enc in ("k-group:4:128", "k-group:2:128", "k-group:8:128"):
        e = parse_gemm_encoding(enc, "weight")
        for n, k in TIMED if e.bits < 8 else TIMED[-1:]:
            spec = GemmSpec(n, k, e)
            w = quantize_2d((torch.randn(n, k) * 0.05).cuda(), e)
            w16 = w.dequantize(torch.float16)[0, 0].contiguous()
            codes, sc, zr = w.codes[0, 0], w.scale[0, 0], w.zero[0, 0]
            kern = foldc.compile(spec, target="auto")
            for m in TIMED_ROWS:
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                ref = x.double() @ w.dequantize(torch.float64)[0, 0].T
                row = dict(enc=enc, n=n, k=k, m=m, cublas_us=do_bench(lambda: x @ w16.T) * 1e3,
                           cublas_err=rel(x @ w16.T, ref), template_us=do_bench(lambda: kern(x, w)) * 1e3,
                           template_err=rel(kern(x, w), ref), variants=[])
                for bm, stages, split in VARIANTS:
                    if refusal(k, n, e.bits, e.group_size, bm, stages, split):
                        continue
                    try:
                        err = rel(launch(x, codes, sc, zr, e.bits, e.group_size, bm, stages, split), ref)
                        us = do_bench(lambda: launch(x, codes, sc, zr, e.bits, e.group_size, bm, stages, split)) * 1e3
                        row["variants"].append([bm, stages, split, round(us, 2), err])
                    except Exception as ex:  # noqa: BLE001 - a variant that does not build is a result
                        row["variants"].append([bm, stages, split, f"{type(ex).__name__}: {str(ex)[:120]}", None])
                ok = [v for v in row["variants"] if isinstance(v[3], float) and v[4] <= 2 * row["cublas_err"] + 1e-6]
                best = min(ok, key=lambda v: v[3]) if ok else None
                row["best"] = best
                log(f"{enc} {n}x{k} m={m}: cuBLAS {row['cublas_us']:.1f} template {row['template_us']:.1f} "
                    + (f"wgmma {best[3]:.1f} {best[:3]} => x{row['cublas_us'] / best[3]:.2f} cuBLAS, "
                       f"x{row['template_us'] / best[3]:.2f} template" if best else "wgmma: none ok")
                    + " | " + " ".join(f"{v[:3]}:{v[3]}" for v in row["variants"]))
                rows.append(row)
    return rows


SMALL_VARIANTS = [(32, 4, 1), (32, 4, 2), (32, 4, 4), (32, 4, 8)]   # block_m, stages, split_k


def small_timing(log) -> list:
    """m = 1 and 16 (issue 20's GEMV targets) in CUDA graphs over cold weight copies: fp16 cuBLAS, torch's
    INT4 kernel, foldc's default (its GEMV), and this kernel at block_m = 32 (wgmma n = 32) with split k."""
    import torch

    import foldc
    from foldc.gemm import GemmSpec, parse_gemm_encoding
    from foldc.gemm.reference import quantize_2d
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gemv_check import copies, graph_us, int4pack

    rows = []
    for enc, shapes in (("k-group:4:128", TIMED), ("k-group:2:128", TIMED[2:])):
        e = parse_gemm_encoding(enc, "weight")
        for n, k in shapes:
            w = quantize_2d((torch.randn(n, k) * 0.05).cuda(), e)
            w16 = w.dequantize(torch.float16)[0, 0].contiguous()
            ref_w = w.dequantize(torch.float64)[0, 0]
            kern = foldc.compile(GemmSpec(n, k, e), target="auto")
            nbytes = w.codes.numel() + 4 * w.scale.numel()
            ws = copies(w, nbytes)
            for m in (1, 16):
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                ref = x.double() @ ref_w.T
                y = torch.empty(m, n, device="cuda", dtype=torch.float16)
                row = dict(enc=enc, n=n, k=k, m=m, ideal_us=nbytes / 4.45e6,
                           fp16_us=graph_us([lambda t=t: torch.mm(x, t.T) for t in copies(w16, n * k * 2)]),
                           foldc_us=graph_us([lambda c=c: kern(x, c, out=y) for c in ws]),
                           foldc_err=rel(kern(x, w), ref), cublas_err=rel(x @ w16.T, ref), variants=[])
                if e.bits == 4:
                    packed, sz = int4pack(w)
                    xb = x.bfloat16()
                    row["torch_int4_us"] = graph_us([lambda p=p: torch._weight_int4pack_mm(xb, p, 128, sz)
                                                     for p in copies(packed, packed.numel())])
                for bm, stages, split in SMALL_VARIANTS:
                    if refusal(k, n, e.bits, e.group_size, bm, stages, split):
                        continue
                    try:
                        args = (e.bits, e.group_size, bm, stages, split)
                        err = rel(launch(x, w.codes[0, 0], w.scale[0, 0], w.zero[0, 0], *args), ref)
                        us = graph_us([lambda c=c: launch(x, c.codes[0, 0], c.scale[0, 0], c.zero[0, 0], *args)
                                       for c in ws])
                        row["variants"].append([bm, stages, split, round(us, 2), err])
                    except Exception as ex:  # noqa: BLE001 - a variant that does not build is a result
                        row["variants"].append([bm, stages, split, f"{type(ex).__name__}: {str(ex)[:120]}", None])
                log(f"{enc} {n}x{k} m={m}: ideal {row['ideal_us']:.1f} fp16 {row['fp16_us']:.1f} "
                    f"torch_int4 {row.get('torch_int4_us', float('nan')):.1f} foldc {row['foldc_us']:.1f} "
                    f"(err {row['foldc_err']:.1e}, cuBLAS {row['cublas_err']:.1e}) | "
                    + " ".join(f"{v[:3]}:{v[3]} {v[4] if v[4] is None else f'{v[4]:.1e}'}" for v in row["variants"]))
                rows.append(row)
    return rows


def emulate(bits: int, group: int, n: int = 128, k: int = 1024, m: int = 8, seed: int = 0) -> float:
    """The kernel's index arithmetic in float64 torch, op for op (join = stack on a new last axis, the
    unpack's element e = field of byte 2u + e): max |sum over chunks of A_chunk @ B_chunk - W @ x^T|.
    Checks that the weight's slot order (_operand, _params) and the activation's (_issue) agree."""
    import torch

    from foldc.gemm import parse_gemm_encoding
    from foldc.gemm.reference import quantize_2d

    gen = torch.Generator().manual_seed(seed)
    F, chunk = 8 // bits, CHUNK.value
    P, bk, rb = max(F // 2, 1), chunk // F, k // F
    nblk = 4 // P
    w = quantize_2d(torch.randn(n, k, generator=gen) * 0.05, parse_gemm_encoding(f"k-group:{bits}:{group}:fp32", "weight"))
    codes, sc, zr = w.codes[0, 0].long(), w.scale[0, 0].double(), w.zero[0, 0].double()
    x = torch.randn(m, k, generator=gen, dtype=torch.float64)
    acc = torch.zeros(n, m, dtype=torch.float64)
    for j0 in range(0, rb, bk):
        cb = codes[:, j0:j0 + bk]
        byte = torch.stack([cb[:, 0::2], cb[:, 1::2]], -1)                          # [n, bk / 2, e]
        f = [(byte >> (bits * i)) & ((1 << bits) - 1) for i in range(F)]
        if F == 1:
            y = f[0].reshape(n, nblk, 1, 2, 4, 2)
        elif F == 2:
            y = torch.stack(f, -1).reshape(n, nblk, 4, 2, 2).permute(0, 1, 4, 2, 3)
        else:
            y = torch.stack([torch.stack(f[:2], -1), torch.stack(f[2:], -1)], -1)
            y = y.reshape(n, nblk, 4, 2, 2, 2).permute(0, 1, 5, 4, 2, 3)
        field = (2 * torch.arange(P)[:, None] + torch.arange(2)[None, :]) * (F > 1)
        g = (field * rb + j0) // group
        a = (y.reshape(n, nblk, P, 2, 4, 2) * sc[:, g][:, None, :, :, None, None]
             + zr[:, g][:, None, :, :, None, None]).reshape(n, chunk)
        c = torch.arange(chunk)
        ks = c // 16
        kk = j0 + c if F == 1 else (2 * (ks % P) + (c // 8) % 2) * rb + j0 + 8 * (ks // P) + c % 8
        acc += a @ x[:, kk].T
    return float((acc - w.dequantize(torch.float64)[0, 0] @ x.T).abs().max())


# ---- ahead-of-time build (CPU) ---------------------------------------------------------------------------

def aot(bits: int, group: int, k: int, block_m: int, stages: int, split_k: int, bf16: bool, out: Path | None) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from foldc.backends.gluon.aot import registers
    from foldc.backends.runtime.sass import disassemble, loop_instructions

    asm, cons = unpack_pair_asm(bits, bf16)
    act = "*bf16" if bf16 else "*fp16"
    sig = {"X": act, "stride_x": "i32", "WC": "*u8", "stride_w": "i32", "WS": act, "WZ": act, "stride_ws": "i32",
           "Y": act, "stride_y": "i32", "M": "i32", "N": "i32"}
    consts = dict(K=k, BITS=bits, GROUP=group, BLOCK_M=block_m, STAGES=stages, GROUP_M=8, SPLIT_K=split_k,
                  BF16=bf16, ASM=asm, CONS=cons)
    if split_k > 1:
        sig["Y"] = "*fp32"
    sig.update({c: "constexpr" for c in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(9)}
    c = triton.compile(GluonASTSource(foldc_gemm_wgmma, sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    name = f"int{bits}_g{group}_k{k}_m{block_m}_s{stages}_split{split_k}{'_bf16' if bf16 else ''}"
    d = Path(out or "/tmp/gemm_wgmma") / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "kernel.cubin").write_bytes(c.asm["cubin"])
    for key in ("ttgir", "ptx"):
        (d / f"kernel.{key}").write_text(c.asm[key])
    sass = disassemble(d / "kernel.cubin")
    (d / "kernel.sass").write_text("\n".join(f"{a:#06x} {op} {rest}" for a, op, rest in sass))
    loop = loop_instructions(d / "kernel.cubin")
    ops = [op for _, op, _ in loop]
    waits = [rest for _, op, rest in loop if op.startswith("WARPGROUP") and "gsb0" in rest]
    return {"layout": name, "registers": registers(d / "kernel.cubin"), "shared": c.metadata.shared,
            "spill_stores": sum(op.startswith("STL") for _, op, _ in sass),
            "loop_instructions": len(loop), "hgmma": sum(op.startswith("HGMMA") for op in ops),
            "waits": waits, "hfma2": sum(op.startswith("HFMA2") for op in ops),
            "lds": sum(op.startswith("LDS") for op in ops), "ldg": sum(op.startswith("LDG") for op in ops),
            "bar": sum(op.startswith("BAR") for op in ops)}


AOT_CASES = [  # bits, group, k, block_m, stages, split_k, bf16
    (4, 128, 8192, 256, 4, 1, False), (2, 128, 8192, 256, 4, 1, False), (4, 32, 4096, 128, 4, 1, False),
    (4, 128, 14336, 128, 4, 2, False), (2, 64, 4096, 256, 4, 1, True), (8, 128, 8192, 256, 4, 1, False),
    (8, 64, 4096, 128, 4, 2, False)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--aot", action="store_true", help="build for sm_90 on this machine (no GPU) and report")
    ap.add_argument("--out", default=None)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--time-only", action="store_true")
    ap.add_argument("--small", action="store_true", help="time m = 1 and 16 only (CUDA graphs, cold weights)")
    a = ap.parse_args()
    if a.aot:
        for bits, group in ((2, 16), (2, 64), (4, 32), (4, 128), (8, 64)):
            err = emulate(bits, group)
            print(f"emulated index arithmetic, INT{bits} g{group}: max error {err:.1e}")
            if err > 1e-9:
                raise SystemExit("the weight's and the activation's slot orders disagree")
        rows = [aot(*case, out=Path(a.out) if a.out else None) for case in AOT_CASES]
        for r in rows:
            print(json.dumps(r))
        if a.out:
            (Path(a.out) / "aot.json").write_text(json.dumps(rows, indent=1))
        return
    import torch
    out = Path(a.out or "results/wgmma")
    out.mkdir(parents=True, exist_ok=True)
    lines = []

    def log(line):
        print(line, flush=True)
        lines.append(line)
    log(f"seed {a.seed}; {torch.cuda.get_device_name()}; torch {torch.__version__}")
    result = {"seed": a.seed}
    if a.small:
        result["small"] = small_timing(log)
        (out / "wgmma_small.json").write_text(json.dumps(result, indent=1, default=str))
        (out / "wgmma_small.txt").write_text("\n".join(lines) + "\n")
        return
    if not a.time_only:
        result["checks"] = check(a.seed, log)
        bad = [r for r in result["checks"] if not r["ok"]]
        log(f"checks: {len(result['checks']) - len(bad)}/{len(result['checks'])} within the bar")
    if not a.check_only:
        result["times"] = timing(log)
    tag = "check" if a.check_only else "times" if a.time_only else "all"
    (out / f"wgmma_{tag}.json").write_text(json.dumps(result, indent=1, default=str))
    (out / f"wgmma_{tag}.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
