"""An experiment for issue 20's GEMV at m = 1: the weight's codes as int8 tensor-core operands (IMMA.16832,
mma.sync m16n8k32 s8 x s8 -> s32) against the activation cut into three int8 digits, instead of fp16
subnormal codes against fp16 x (HMMA.16816). Not production code.

Why: at m = 1 the production kernel (foldc/backends/gluon/gemv.py) issues about 299 SASS instructions per
chunk of 4096 INT4 weights (72 LOP3 of unpack at two codes per AND, 36 PRMT for x's register pairs, 32 HMMA
of which 16 on a matrix of ones for the pieces' sums of x); the schedulers issue about a third of cycles
and the grid is one wave, so the chunks' instructions, not the bytes, set its time (docs/gemm.md). Here:

- one LOP3 makes four int8 operand values: field f of a code word, masked in place, is
  ``code * 2^(bits*f)`` per byte; the field holding bit 7 is XOR-ed with 0x80 (``- 128``, a code bias that
  returns through the zero, eq. 7), so every field is a signed byte without a shift;
- the activation is cut once per call (`x_digits`, a small Triton kernel) into three int8 digits per value
  against a power-of-two unit ``u`` per piece of k: ``x = u (d0 + d1 / 128 + d2 / 16384)`` up to u / 32768
  (``|d0| <= 127``, ``|d1|, |d2| <= 64``; every step exact in float32), and each piece's sum of x;
- the digits are the MMA's columns 0-2 (columns 3-7 zero), so one IMMA per 16 x 32 codes makes all three
  dot products; each lane reads its 16 code bytes and its 16 digit bytes as they lie (k in natural order:
  no permutation, no PRMT);
- per piece (one field of a chunk inside one k group): ``Y[:, c] += float(A[:, c]) * scale * u / 2^(bits*f)``
  and ``Z += (zero + scale * bias / 2^(bits*f)) * sum_piece(x)``; at the end ``y = sum_c Y[:, c] w_c + Z``
  with ``w = (1, 2^-7, 2^-14)``: no unscaled partial sum crosses a group (one IMMA chain per piece).

The program around the chunks is production's: one warp of 16 output channels, a split of k, the scale and
zero words copied once (`gemv._copy_runs`, read by `gemv_chunk._param`), the code words STAGES deep by
cp.async into a tile swizzled for 16-byte reads (rows r and r + 1 in different halves of a bank window),
the split-k partials and counter (`gemv._finish`, `gemv._reduce`). k groups of 32 and more (pieces of 128 k and
more read 16 code bytes a lane, k_width 16; of 32 and 64, 8 bytes, k_width 8); 2-, 4- and 8-bit codes.

    TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/gemv_imma_digits.py  # the digits and the algebra (CPU)
    PYTHONPATH=. python3 benchmarks/gemv_imma.py --aot                      # SASS per chunk (CPU)
    PYTHONPATH=. python3 benchmarks/gemv_imma.py --out $OUT/imma.json       # checked, timed beside production
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from foldc.backends.gluon.gemv import _copy_runs, _finish, _reduce, weight_tile_layout
from foldc.backends.gluon.gemv_chunk import _group, _half_value, _param, gemv_mma, pow2_at_least
from foldc.backends.gluon.tile_operands import split_groups

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv_imma_digits import x_digits  # noqa: E402

# ---- the GEMV ------------------------------------------------------------------------------------------------

@constexpr_function
def code_words_layout(W, KW):
    """Code words [16, W] as the int8 operand of k_width KW wants them. KW 16 (pieces of 128 k and more): lane (r, q)
    holds words 4q .. 4q + 3 of rows r and r + 8 (16 consecutive k of a 64-k span), then the next 64-k spans. KW 8
    (pieces of 32 and 64 k, which a 64-k span would straddle): words 2q, 2q + 1 of each 32-k span."""
    W, KW = int(W), int(KW)
    per = KW // 4                           # words a lane holds of one span
    span = 4 * per                          # words of a span (64 or 32 k)
    reg = [[0, 1 << i] for i in range(int(math.log2(per)))] + [[8, 0]] + \
        [[0, span << i] for i in range(int(math.log2(W // span)))]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[[0, per], [0, 2 * per], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[], block_bases=[], shape=[16, W])


@constexpr_function
def code_tile_layout(W, KW):
    """The code tile [16, W] in shared memory. KW 16: 64-byte units XOR-ed by the row's parity, so that the eight lanes
    of one 16-byte read (rows r and r + 1, 64 bytes each) meet all 32 banks. KW 8: 8-byte reads, as production's
    (`gemv.weight_tile_layout`)."""
    if int(KW) == 8:
        return weight_tile_layout(W)
    return gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=2, order=[1, 0])


@constexpr_function
def copy_words_layout(W):
    """cp.async of a [16, W] word tile: 16 bytes a lane."""
    W = int(W)
    return gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[32 // (W // 4), W // 4], warps_per_cta=[1, 1],
                            order=[1, 0])


@constexpr_function
def field_mask(bits, field):
    """The LOP3's mask and XOR for field ``field``: its bits of every byte, and 0x80 in every byte where the field
    holds bit 7 (as int32 values)."""
    bits, field = int(bits), int(field)
    byte = ((1 << bits) - 1) << (bits * field)
    mask = byte * 0x01010101
    xor = 0x80808080 if byte & 0x80 else 0
    signed = lambda v: v - (1 << 32) if v >= 1 << 31 else v  # noqa: E731
    return signed(mask), signed(xor)


@constexpr_function
def field_bias(bits, field):
    """The code bias of field ``field``'s operand values, in its units (``code * 2^(bits*field) - bias``)."""
    bits, field = int(bits), int(field)
    return 128.0 if ((((1 << bits) - 1) << (bits * field)) & 0x80) else 0.0


@constexpr_function
def field_unit(bits, field):
    return 2.0 ** (-int(bits) * int(field))


@gluon.jit
def _field_operand(kw, zero_reg, BITS: gl.constexpr, f: gl.constexpr, W: gl.constexpr):
    """Field f of the code words kw [16, W] as the int8 MMA operand [16, 4W] (k = 4 word + byte)."""
    MASK: gl.constexpr = field_mask(BITS, f)[0]
    XOR: gl.constexpr = field_mask(BITS, f)[1]
    if XOR != 0:   # (kw & mask) ^ 0x80808080 in one LOP3: SASS takes one immediate, so the mask comes in a register
        m = gl.full(kw.shape, MASK, gl.int32, layout=kw.type.layout) + zero_reg
        v = gl.inline_asm_elementwise("lop3.b32 $0, $1, -2139062144, $2, 0x6c;", "=r,r,r", [kw, m], dtype=gl.int32,
                                      is_pure=True, pack=1)
    else:
        v = kw & MASK
    return gl.reshape(_as_bytes(v), [16, 4 * W])


@constexpr_function
def digit_words_layout(D, KW):
    """Digit words [D / 4, 8] (column c: digit c's word) as the int8 B operand of k_width KW wants them: lane (c, q)
    holds words 4q .. 4q + 3 of column c (KW 16: 16 consecutive k), or 2q, 2q + 1 (KW 8), then the next spans."""
    D, KW = int(D), int(KW)
    per = KW // 4
    span = 4 * per
    reg = [[1 << i, 0] for i in range(int(math.log2(per)))] + \
        [[span << i, 0] for i in range(int(math.log2(D // 4 // span)))]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[[per, 0], [2 * per, 0], [0, 1], [0, 2], [0, 4]],
                                      warp_bases=[], block_bases=[], shape=[D // 4, 8])


@gluon.jit
def _as_bytes(v):
    """int32 words [..., W] as their bytes [..., W, 2, 2] (byte 2a + b at [..., a, b]), no instruction."""
    v4 = gl.join(gl.join(v, v), gl.join(v, v))
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r,r,r", [v4], dtype=gl.int8, is_pure=True, pack=4)


@gluon.jit
def _digits(DIG, K, k0, D: gl.constexpr, KW: gl.constexpr):
    """The digit words of x at k0 .. k0 + D - 1 [D / 4, 8] (column c: digit c, columns 3-7 digit 2 again, their
    sums weighted by 0 at the end; DIG: the digits [3, K] as int32 words), read in the chunk that uses them: bytes
    carried across the loop were taken apart and put together again there."""
    wl: gl.constexpr = digit_words_layout(D, KW)
    w = gl.arange(0, D // 4, layout=gl.SliceLayout(1, wl))
    c = gl.minimum(gl.arange(0, 8, layout=gl.SliceLayout(0, wl)), 2)   # columns 3-7 read digit 2 (weighted 0)
    return gl.load(DIG + c[None, :] * (K // 4) + (k0 // 4 + w)[:, None])


@gluon.jit
def _digit_operand(words):
    """Digit words [D / 4, 8] as the MMA's B operand [D, 8] (k = 4 word + byte)."""
    D4: gl.constexpr = words.shape[0]
    b = gl.permute(_as_bytes(words), (0, 2, 3, 1))     # [D / 4, 2, 2, 8]
    return gl.reshape(b, [4 * D4, 8])


@gluon.jit
def _param_even(run, base: gl.constexpr, g, g_first, KIND: gl.constexpr):
    """A piece's parameter (float32 [16], rows r and r + 8 per lane) of group g where every row's run starts at the
    same half of its word (an even stride, `gemv_chunk._param`'s general case aside)."""
    mma: gl.constexpr = gemv_mma(1)
    rl: gl.constexpr = gl.SliceLayout(1, mma)
    if KIND == 2:
        out = run.index(base + g - g_first).load(rl).to(gl.float32, bitcast=True)
    else:
        v = run.index(base + (g >> 1) - (g_first >> 1)).load(rl)
        out = _half_value((v >> ((g & 1) * 16)) & 0xFFFF, KIND)
    return out


@gluon.jit
def _chunk_imma(w_tile, dig, zero_reg, s_run, z_run, U, Y, Z, j_lo, j0, rows, stride_ws, W: gl.constexpr,
                F: gl.constexpr, G: gl.constexpr, BITS: gl.constexpr, ROW_BYTES: gl.constexpr, KIND: gl.constexpr,
                GW: gl.constexpr, NP: gl.constexpr, P: gl.constexpr, EVEN: gl.constexpr, KW: gl.constexpr):
    mma: gl.constexpr = gemv_mma(1)
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=KW)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=KW)
    GWP: gl.constexpr = pow2_at_least(GW)
    kw = w_tile.load(code_words_layout(W, KW))
    zero = gl.zeros([16, 8], gl.int32, layout=mma)
    for f in gl.static_range(F):
        ops = _field_operand(kw, zero_reg, BITS, f, W)
        xs = _digit_operand(dig[f])
        if NP == 1:
            ops = (ops,)
            xs = (xs,)
        else:   # consecutive k ranges of the chunk (the operands' top k bit is a register bit: nothing moves)
            ops = split_groups(ops, NP, 1)
            xs = split_groups(xs, NP, 0)
        for p in gl.static_range(NP):
            acc = mma_v2(gl.convert_layout(ops[p], a_l, assert_trivial=True),
                         gl.convert_layout(xs[p], b_l, assert_trivial=True), zero)
            k = f * ROW_BYTES + j0 + p * P
            g = _group(k, G)
            g_first = _group(f * ROW_BYTES + j_lo, G)
            if EVEN:
                s = _param_even(s_run, f * GWP, g, g_first, KIND)
                z = _param_even(z_run, f * GWP, g, g_first, KIND)
            else:
                s = _param(s_run, f * GWP, g - g_first, 0, rows, stride_ws, g, g_first, KIND)
                z = _param(z_run, f * GWP, g - g_first, 0, rows, stride_ws, g, g_first, KIND)
            u = gl.load(U + 2 * (k // P))
            xsum = gl.load(U + 2 * (k // P) + 1)
            Y = Y + acc.to(gl.float32) * (s * (u * field_unit(BITS, f)))[:, None]
            Z = Z + (z + s * (field_bias(BITS, f) * field_unit(BITS, f))) * xsum
    return Y, Z


@gluon.jit
def _load_digits(DIG, K, j0, F: gl.constexpr, ROW_BYTES: gl.constexpr, NB: gl.constexpr, KW: gl.constexpr):
    """The digit words of each field's k range of the chunk at byte j0."""
    if F == 1:
        out = (_digits(DIG, K, j0, NB, KW),)
    elif F == 2:
        out = (_digits(DIG, K, j0, NB, KW), _digits(DIG, K, ROW_BYTES + j0, NB, KW))
    else:
        out = (_digits(DIG, K, j0, NB, KW), _digits(DIG, K, ROW_BYTES + j0, NB, KW),
               _digits(DIG, K, 2 * ROW_BYTES + j0, NB, KW), _digits(DIG, K, 3 * ROW_BYTES + j0, NB, KW))
    return out


@gluon.jit
def foldc_gemv_imma(DIG, U, WC, WS, WZ, Y_OUT, PART, COUNTERS, N, K, stride_wc, stride_ws, stride_y,
                    chunks_per_split, zero_reg, W: gl.constexpr, F: gl.constexpr, ROW_BYTES: gl.constexpr,
                    G: gl.constexpr, BITS: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, KIND: gl.constexpr,
                    GW: gl.constexpr, NP: gl.constexpr, EVEN: gl.constexpr, KW: gl.constexpr):
    mma: gl.constexpr = gemv_mma(1)
    NB: gl.constexpr = W * 4
    P: gl.constexpr = NB // NP
    NCH: gl.constexpr = ROW_BYTES // NB
    n0 = gl.program_id(0) * 16
    c_lo = gl.program_id(1) * chunks_per_split
    c_hi = gl.minimum(c_lo + chunks_per_split, NCH)
    cp_l: gl.constexpr = copy_words_layout(W)
    rc = gl.minimum(n0 + gl.arange(0, 16, layout=gl.SliceLayout(1, cp_l)), N - 1)
    wc = gl.arange(0, W, layout=gl.SliceLayout(0, cp_l))
    w_rows = WC + rc[:, None] * stride_wc + wc[None, :]
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 16, W], code_tile_layout(W, KW))
    RUN: gl.constexpr = [F * pow2_at_least(GW), 16]
    p_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    row_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    s_run = gl.allocate_shared_memory(gl.int32, RUN, p_l)
    z_run = gl.allocate_shared_memory(gl.int32, RUN, p_l)
    HALF: gl.constexpr = KIND != 2
    _copy_runs(WS.to(gl.pointer_type(gl.int32), bitcast=True), s_run, n0, N, stride_ws, c_lo * NB, 16, F, GW,
               ROW_BYTES, G, HALF)
    _copy_runs(WZ.to(gl.pointer_type(gl.int32), bitcast=True), z_run, n0, N, stride_ws, c_lo * NB, 16, F, GW,
               ROW_BYTES, G, HALF)
    s_run = s_run._reinterpret(gl.int32, RUN, row_l)
    z_run = z_run._reinterpret(gl.int32, RUN, row_l)
    for first in gl.static_range(STAGES - 1):
        if c_lo + first < c_hi:
            async_copy.async_copy_global_to_shared(w_smem.index(first), w_rows + (c_lo + first) * W)
        async_copy.commit_group()
    rows = gl.minimum(n0 + gl.arange(0, 16, layout=gl.SliceLayout(1, mma)), N - 1)
    Y = gl.zeros([16, 8], gl.float32, layout=mma)
    Z = gl.zeros([16], gl.float32, layout=gl.SliceLayout(1, mma))
    for c in range(c_lo, c_hi):
        i = c - c_lo
        dig = _load_digits(DIG, K, c * NB, F, ROW_BYTES, NB, KW)   # (L2 / L1: every program reads them)
        gl.thread_barrier()
        if c + STAGES - 1 < c_hi:
            async_copy.async_copy_global_to_shared(w_smem.index((i + STAGES - 1) % STAGES),
                                                   w_rows + (c + STAGES - 1) * W)
        async_copy.commit_group()
        async_copy.wait_group(STAGES - 1)
        gl.thread_barrier()
        Y, Z = _chunk_imma(w_smem.index(i % STAGES), dig, zero_reg, s_run, z_run, U, Y, Z, c_lo * NB, c * NB, rows,
                           stride_ws, W, F, G, BITS, ROW_BYTES, KIND, GW, NP, P, EVEN, KW)
    async_copy.wait_group(0)
    c8 = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
    weight = gl.where(c8 == 0, 1.0, gl.where(c8 == 1, 1.0 / 128.0, gl.where(c8 == 2, 1.0 / 16384.0, 0.0)))
    y = gl.sum(Y * weight[None, :], axis=1) + Z
    yt = y[:, None] + gl.zeros([16, 8], gl.float32, layout=mma)
    _finish(yt, 0, Y_OUT, PART, n0, gl.program_id(1), 1, N, stride_y, SPLIT, 8)
    if SPLIT > 1:
        gl.thread_barrier()
        done = gl.atomic_add(COUNTERS + gl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:
            _reduce(0, Y_OUT, PART, n0, 1, N, stride_y, SPLIT, 8)
            gl.atomic_xchg(COUNTERS + gl.program_id(0), 0, sem="relaxed", scope="gpu")


# ---- launch ------------------------------------------------------------------------------------------------

def launch_constants(gemv, dtype, sms: int) -> tuple[dict, tuple, int, int]:
    """(constants, grid, chunks_per_split, piece k) of the production launcher's m = 1 launch, for this kernel."""
    launch = gemv.plan_launch(dtype, 1, sms)
    c = dict(launch.constants)
    kern = launch.kernel
    nb = c["W"] * 4
    piece = min(kern.group, nb)
    if piece < 32 or nb % piece:
        raise ValueError(f"groups of {kern.group} k: this experiment takes 32 and up")
    consts = dict(W=c["W"], F=c["F"], ROW_BYTES=c["ROW_BYTES"], G=c["G"], BITS=c["BITS"], STAGES=c["STAGES"],
                  SPLIT=c["SPLIT"], KIND=c["KIND"], GW=c["GW"], NP=nb // piece, KW=16 if piece >= 128 else 8,
                  EVEN=(kern.k // kern.group) % 2 == 0, num_warps=1)
    return consts, launch.grid, launch.chunks_per_split, piece


def make_call(gemv, dtype):
    """``call(x [1, k], w, out [1, n])``: digits, then the GEMV, on the production launcher's grid and split."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    consts, grid, per, piece = launch_constants(gemv, dtype, sms)
    k, n = gemv.spec.k, gemv.spec.n
    dev = torch.device("cuda")
    dig = torch.empty(3, k, dtype=torch.int8, device=dev)
    u = torch.empty(k // piece, 2, dtype=torch.float32, device=dev)
    part = torch.empty(max(1, consts["SPLIT"] * n), dtype=torch.float32, device=dev)
    counters = torch.zeros(grid[0], dtype=torch.int32, device=dev)

    def call(x, w, out):
        x_digits[(k // piece,)](x, dig, u, k, P=piece)
        codes, scale, zero = w.codes[0, 0], w.scale[0, 0], w.zero[0, 0]
        consts["EVEN"] = scale.stride(0) % 2 == 0   # every row's parameters start at the same half of a word
        foldc_gemv_imma[grid](dig.view(torch.int32), u, codes.view(torch.int32), scale, zero, out, part, counters, n, k,
                              codes.stride(0) // 4, scale.stride(0), out.stride(0), per, 0, **consts)
    return call


# ---- ahead of time -----------------------------------------------------------------------------------------

AOT_CASES = [("k-group:4:128", 4096, 14336), ("k-group:2:128", 28672, 8192), ("k-group:8:128", 4096, 14336),
             ("k-group:4:128", 28672, 8192), ("k-group:4:32", 4096, 14336), ("k-group:4:64", 4096, 14336),
             ("k-group:2:64", 28672, 8192)]


def aot(arch: str = "sm_90") -> list[dict]:
    """Build each AOT case for ``arch`` with the production launcher's m = 1 launch (132 SMs): registers and the
    chunk loop's SASS beside production's (`compile_gemv_aot`)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from foldc.backends.gluon.aot import registers
    from foldc.backends.gluon.gemv_aot import compile_gemv_aot
    from foldc.backends.gluon.gemv_launch import GluonGemv
    from foldc.backends.runtime.artifacts import write_artifacts
    from foldc.backends.runtime.sass import loop_instructions
    from foldc.gemm import GemmSpec, parse_gemm_encoding

    out = []
    for enc, n, k in AOT_CASES:
        spec = GemmSpec(n, k, parse_gemm_encoding(enc, "weight"))
        gemv = GluonGemv(spec, arch)
        consts, grid, per, piece = launch_constants(gemv, torch.float16, 132)
        opts = {"num_warps": consts.pop("num_warps")}
        kind = {0: "*fp16", 1: "*bf16", 2: "*fp32"}[consts["KIND"]]
        sig = {"DIG": "*i32", "U": "*fp32", "WC": "*i32", "WS": kind, "WZ": kind, "Y_OUT": "*fp16",
               "PART": "*fp32", "COUNTERS": "*i32", "N": "i32", "K": "i32", "stride_wc": "i32", "stride_ws": "i32",
               "stride_y": "i32", "chunks_per_split": "i32", "zero_reg": "i32"}
        sig.update({name: "constexpr" for name in consts})
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(foldc_gemv_imma.arg_names)
                 if name in ("DIG", "U", "WC", "WS", "WZ", "Y_OUT", "PART", "COUNTERS", "K", "stride_wc")}
        compiled = triton.compile(GluonASTSource(foldc_gemv_imma, sig, constexprs=consts, attrs=attrs),
                                  target=GPUTarget("cuda", {"sm_90": 90, "sm_100": 100}[arch], 32), options=opts)
        d = Path(tempfile.mkdtemp())
        cubin = write_artifacts(d, "foldc_gemv_imma", arch, compiled)
        loop = Counter(o for _, o, _ in loop_instructions(cubin))
        prod = compile_gemv_aot(spec, arch, tempfile.mkdtemp(), m=1)
        row = {"enc": enc, "n": n, "k": k, "arch": arch, "registers": registers(cubin),
               "chunk_instructions": sum(loop.values()), "weights_per_chunk": 16 * consts["W"] * 4 * consts["F"],
               "local_memory": loop.get("LDL", 0) + loop.get("STL", 0), "top": dict(loop.most_common(10)),
               "production": {"registers": prod["registers"], "chunk_instructions":
                              prod["chunk_loop"]["instructions_per_warp"],
                              "weights_per_chunk": 16 * prod["operand_k"]}}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


# ---- on a GPU ------------------------------------------------------------------------------------------------

CASES = [("k-group:4:128", 4096, 14336), ("k-group:4:128", 28672, 8192), ("k-group:2:128", 28672, 8192),
         ("k-group:4:128", 14336, 4096), ("k-group:4:128", 4096, 4096), ("k-group:2:128", 4096, 14336),
         ("k-group:8:128", 4096, 14336), ("k-group:4:128", 4100, 4096), ("k-group:2:128", 1000, 14336),
         ("k-group:4:256", 4096, 14336), ("k-group:4:32", 4096, 14336), ("k-group:4:64", 4096, 14336),
         ("k-group:2:64", 28672, 8192), ("k-group:8:32", 4096, 14336)]


def gpu(out_path: str, seed: int) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gemv_check import copies, graph_us, int4pack, read_ceiling, rel

    import foldc
    from foldc.backends.gluon.gemv_launch import MAX_SPLIT, GluonGemv, gemv_bytes
    from foldc.gemm import GemmSpec, parse_gemm_encoding
    from foldc.gemm.reference import gemm_reference, quantize_2d

    gen = torch.Generator().manual_seed(seed)
    rows, fails = [], 0
    for enc, n, k in CASES:
        spec = GemmSpec(n, k, parse_gemm_encoding(enc, "weight"))
        w = (torch.randn(n, k, generator=gen) * 0.05 + 0.01 * torch.randn(n, 1, generator=gen)).cuda()
        wq = quantize_2d(w, spec.weight)
        nbytes = gemv_bytes(spec)
        row = {"enc": enc, "n": n, "k": k}
        ws = copies(wq, nbytes)
        for dt in (torch.float16, torch.bfloat16):
            tag = str(dt)[6:]
            # an outlier channel or two, as activations have them
            x = torch.randn(1, k, generator=gen) * 2 + 0.1
            x[0, torch.randint(0, k, (4,), generator=gen)] *= 40
            x = x.to("cuda", dt)
            ref = gemm_reference(x, wq)
            kern = foldc.compile(spec, target="auto", kernel="gluon")
            y = kern(x, wq)
            row[f"prod_{tag}_err"] = rel(y, ref)
            row[f"prod_{tag}_us"] = graph_us([lambda c=c: kern(x, c, out=y) for c in ws])
            call = make_call(kern.gemv, dt)
            yi = torch.empty_like(y)
            call(x, wq, yi)
            torch.cuda.synchronize()
            row[f"imma_{tag}_err"] = rel(yi, ref)
            ok = row[f"imma_{tag}_err"] <= 1.2 * row[f"prod_{tag}_err"] + 1e-6
            if not ok:
                fails += 1
                print("FAIL", enc, n, k, tag, row[f"imma_{tag}_err"], row[f"prod_{tag}_err"], flush=True)
            row[f"imma_{tag}_us"] = graph_us([lambda c=c: call(x, c, yi) for c in ws])
            # fewer registers (about 70 against 98) leave room for more programs an SM: twice the split, and with
            # four stages (more bytes in flight a program)
            split = kern.gemv.plan_launch(dt, 1, torch.cuda.get_device_properties(0).multi_processor_count).grid[1]
            for name, opts in (("split2", {"split_k": min(2 * split, MAX_SPLIT)}),
                               ("split2_stages4", {"split_k": min(2 * split, MAX_SPLIT), "stages": 4})):
                other = make_call(GluonGemv(spec, kern.gemv.target, **opts), dt)
                y2 = torch.empty_like(y)
                other(x, wq, y2)
                torch.cuda.synchronize()
                row[f"imma_{name}_{tag}_err"] = rel(y2, ref)
                if not row[f"imma_{name}_{tag}_err"] <= 1.2 * row[f"prod_{tag}_err"] + 1e-6:
                    fails += 1
                    print("FAIL", name, enc, n, k, tag, row[f"imma_{name}_{tag}_err"], flush=True)
                row[f"imma_{name}_{tag}_us"] = graph_us([lambda c=c, o=other, y2=y2: o(x, c, y2) for c in ws])
            if dt == torch.float16:
                w16 = w.half()
                row["fp16_us"] = graph_us([lambda t=t: torch.mm(x, t.T) for t in copies(w16, n * k * 2)])
            if enc == "k-group:4:128" and dt == torch.bfloat16 and n % 64 == 0:   # (tinygemm's n: whole tiles)
                packed, sz = int4pack(wq)
                row["torch_int4_us"] = graph_us([lambda p=p: torch._weight_int4pack_mm(x, p, 128, sz)
                                                 for p in copies(packed, packed.numel() * packed.element_size())])
            row[f"imma_{tag}_pct"] = 100 * nbytes / (row[f"imma_{tag}_us"] * 1e-6) / read_ceiling()
        del ws
        print(json.dumps(row), flush=True)
        rows.append(row)
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps({"seed": seed, "device": torch.cuda.get_device_name(),
                                              "ceiling_tb_s": read_ceiling() / 1e12, "rows": rows}, indent=1))
    return 1 if fails else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--aot", action="store_true", help="build for sm_90 and sm_100 (CPU) and print SASS counts")
    ap.add_argument("--out", default="results/gemv_imma.json")
    ap.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(2), "little"))
    args = ap.parse_args(argv)
    if args.aot:
        rows = aot("sm_90") + aot("sm_100")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))
        return 0
    print(f"seed {args.seed}", flush=True)
    return gpu(args.out, args.seed)


if __name__ == "__main__":
    raise SystemExit(main())
