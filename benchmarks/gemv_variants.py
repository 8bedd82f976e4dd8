"""Variants of the register-operand GEMV for `benchmarks/gemv_ab.py`: production's kernel
(foldc/backends/gluon/gemv.py) with one or two of its functions replaced. Not production code.

    PYTHONPATH=. python3 benchmarks/gemv_ab.py --b benchmarks/gemv_variants.py --quick --cases 0,1,2,3,4,7   # H200
    PYTHONPATH=. python3 benchmarks/gemv_ab.py --b benchmarks/gemv_variants.py --b-kernel foldc_gemv_bias \
        --quick --cases 0,1,2,3,4,7                                                                       # H200
    PYTHONPATH=. python3 benchmarks/gemv_variants.py   # CPU: the bias unpack's check, registers and chunk SASS

Both are about bf16 activations, which took 1.4x the fp16 calls on the H200 (19.4 against 13.7 µs at INT4 g128
4096 x 14336, docs/results/gemv_ab_release_h200_2026-12-04.json), where torch's INT4 kernel takes bf16 only.

- ``foldc_gemv_gluon`` (the row): at m = 1 production's `_x_operand` puts the row in fp16 after broadcasting it
  to the MMA operand's [D, ROWS] layout, where each lane holds D / 4 values (the 8 columns are copies): the
  conversion (to float32, the largest magnitude, times a power of two, to fp16) runs on each. Here the row is
  converted with one value per lane first (D / 32 each: one load, the warp's largest magnitude by shuffles, the
  same power of two), then laid out as the operand's columns (`convert_layout`, through shared memory). Same
  values and powers of two as production: its outputs should equal production's bit for bit.
- ``foldc_gemv_bias`` (2- and 4-bit codes): no conversion. The MMA is bf16 x bf16, and each code enters as the
  bf16 ``128 + code * 2^shift`` (`bias_unpack_asm`: production's AND becomes a LOP3 that ORs in 0x4300 per half,
  and the field whose top bit is the byte's bit 7, a bf16's exponent there, is shifted down one place first); each
  piece adds ``mma * scale * 2^-shift + (zero - 128 * scale * 2^-shift) * sum(x)`` (eq. 7's code bias of 128
  folded into the zero). A production form would take the bias from the GEMM plan (`gemm_plan(spec,
  code_bias={"weight": 128})`, proved and checked against the precision budget) instead of writing it here.

Built for sm_90 (`sass_counts`), registers and SASS per chunk at m = 1:

| weight, N x K | production fp16 | production bf16 | row bf16 | bias bf16 |
|---|---|---|---|---|
| INT4 g128, 4096 x 14336 | 98, 299 | 167, 572 | 110, 393 | 97, 338 |
| INT2 g128, 28672 x 8192 | 104, 384 | 127, 654 | 100, 477 | 96, 411 |

Neither has run on a GPU yet (the variant this file held before, a release-only split-k counter, was 0-3% slower:
the .json above). Functions not replaced are production's: `rebound` copies production's callers with their
callees swapped.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

import foldc.backends.gluon.gemv as production
from foldc.bench import rebound
from foldc.backends.gluon.tile_operands import (_join4, _pairs, group_mmas, key_words_layout, split_groups, swap_k01,
                                                zeros_groups)


@gluon.jit
def _x_operand(x_in, D: gl.constexpr, ROWS: gl.constexpr, XF16: gl.constexpr, X_SHARED: gl.constexpr,
               SWAP: gl.constexpr):
    """production._x_operand, except at m = 1 with bf16 activations: the row in fp16 with one value per lane
    first, then in every column."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    if X_SHARED and not XF16:
        flat: gl.constexpr = gl.BlockedLayout(size_per_thread=[max(1, D // 32)], threads_per_warp=[32],
                                              warps_per_cta=[1], order=[0])
        xr = x_in.load(flat).to(gl.float32)
        c1 = gl.exp2(12.0 - gl.floor(gl.log2(gl.maximum(gl.max(gl.abs(xr), axis=0), 1e-30))))
        xd = gl.convert_layout((xr * c1).to(gl.float16), gl.SliceLayout(1, b_l))
        if SWAP:
            xd = gl.convert_layout(swap_k01(xd, D, 0), gl.SliceLayout(1, b_l), assert_trivial=True)
        x16 = gl.broadcast(xd[:, None], gl.zeros([D, ROWS], gl.int1, layout=b_l))[0]
        # the one row's c in every column, in the accumulators' layout (production._undo's conversion is then none)
        c = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(0, mma)) + c1
    else:
        x16, c = production._x_operand(x_in, D, ROWS, XF16, X_SHARED, SWAP)
    return x16, c


_chunk = rebound(production._chunk, _x_operand=_x_operand)
chunk_loop = rebound(production.chunk_loop, _chunk=_chunk)
program_sums = rebound(production.program_sums, chunk_loop=chunk_loop)
foldc_gemv_gluon = rebound(production.foldc_gemv_gluon, program_sums=program_sums)


# ---- the second variant, `foldc_gemv_bias`: bf16 activations into a bf16 MMA, codes biased by 128 ----------------

BF16_MAGIC = 0x43004300   # a bf16 pair (128, 128): 0x4300 | m is 128 + m exactly for m < 128


@constexpr_function
def field_shift(bits: int, field: int) -> int:
    """log2 of field ``field``'s weight in `bias_unpack_asm`'s values: bits * field, less one for the field
    whose top bit is the byte's bit 7 (shifted down one place: bit 7 is a bf16's exponent)."""
    return bits * field - (1 if bits * (field + 1) > 7 else 0)


@constexpr_function
def bias_unpack_asm(bits: int) -> tuple[str, str]:
    """`operands.key_unpack_asm`'s words and k order (result 2i+p = field i of bytes (p, p+2)) as bf16 pairs
    ``128 + code * 2^field_shift(bits, i)``: one LOP3 each ((w & mask) | magic), a shift first for the top field.
    2- and 4-bit codes (an 8-bit code would reach the exponent)."""
    fields = 8 // bits
    n = 2 * fields
    out = ["{ .reg .b32 t, u, v;", f"shr.b32 t, ${n}, 8;", f"shr.b32 u, ${n}, 1;", f"shr.b32 v, ${n}, 9;"]
    for i in range(fields):
        top = bits * (i + 1) > 7
        mask = (((1 << bits) - 1) << (bits * i)) * 0x00010001 >> (1 if top else 0)
        for reg, src in ((2 * i, "u" if top else f"${n}"), (2 * i + 1, "v" if top else "t")):
            out.append(f"lop3.b32 ${reg}, {src}, {mask}, {BF16_MAGIC}, 0xea;")
    out.append("}")
    return " ".join(out), ",".join(["=r"] * n + ["r", "r"])


@constexpr_function
def _bias_asm(bits):
    return bias_unpack_asm(int(bits))[0]


@constexpr_function
def _bias_cons(bits):
    return bias_unpack_asm(int(bits))[1]


@constexpr_function
def _field_weight(bits, field):
    return 2.0 ** -field_shift(int(bits), int(field))


@gluon.jit
def _bias_operand(kw, BN: gl.constexpr, D: gl.constexpr, F: gl.constexpr, BITS: gl.constexpr):
    """tile_operands.key_operand's [BN, D] operand in bf16 from `bias_unpack_asm` (2- and 4-bit codes)."""
    gl.static_assert(F == 2 or F == 4, "the biased bf16 operand takes 2- and 4-bit codes")
    NB: gl.constexpr = D // F
    x = gl.join(kw, kw)
    ASM_B: gl.constexpr = _bias_asm(BITS)
    CONS_B: gl.constexpr = _bias_cons(BITS)
    if F == 4:
        a0, a1, b0, b1, c0, c1, d0, d1 = gl.inline_asm_elementwise(
            ASM_B, CONS_B, [x], dtype=(gl.bfloat16,) * 8, is_pure=True, pack=2)
        op = _join4(_pairs(a0, a1, BN, NB), _pairs(b0, b1, BN, NB), _pairs(c0, c1, BN, NB), _pairs(d0, d1, BN, NB))
        op = gl.reshape(gl.permute(op, (0, 2, 3, 1)), [BN, D])
    else:
        a0, a1, b0, b1 = gl.inline_asm_elementwise(ASM_B, CONS_B, [x], dtype=(gl.bfloat16,) * 4, is_pure=True,
                                                   pack=2)
        op = gl.reshape(gl.permute(gl.join(_pairs(a0, a1, BN, NB), _pairs(b0, b1, BN, NB)), (0, 2, 1)), [BN, D])
    return op


@gluon.jit
def _bias_x_operand(x_in, D: gl.constexpr, ROWS: gl.constexpr, XF16: gl.constexpr, X_SHARED: gl.constexpr,
                    SWAP: gl.constexpr):
    """bf16 activations as they are (the MMA is bf16); c = 1 in every column. fp16: production's."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    if XF16:
        x16, c = production._x_operand(x_in, D, ROWS, XF16, X_SHARED, SWAP)
    else:
        if X_SHARED:
            xd = x_in.load(gl.SliceLayout(1, b_l))
            if SWAP:
                xd = gl.convert_layout(swap_k01(xd, D, 0), gl.SliceLayout(1, b_l), assert_trivial=True)
            x16 = gl.broadcast(xd[:, None], gl.zeros([D, ROWS], gl.int1, layout=b_l))[0]
        elif SWAP:
            x16 = gl.convert_layout(swap_k01(x_in, D, ROWS), b_l, assert_trivial=True)
        else:
            x16 = x_in
        c = gl.full([ROWS], 1.0, gl.float32, layout=gl.SliceLayout(0, mma))
    return x16, c


@gluon.jit
def _bias_row_tile(w_tile, s_run, z_run, j_lo, t: gl.constexpr, xs, sums, y, n0, N, stride_ws, j0, W: gl.constexpr,
                   F: gl.constexpr, NG: gl.constexpr, ROWS: gl.constexpr, ROW_BYTES: gl.constexpr, G: gl.constexpr,
                   BITS: gl.constexpr, ASM: gl.constexpr, CONS: gl.constexpr, VALUE_EXP: gl.constexpr,
                   KIND: gl.constexpr, GW: gl.constexpr):
    """production._row_tile; with bf16 activations the codes enter as 128 + code * 2^shift (bf16), so each piece
    adds mma * scale * 2^-shift + (zero - 128 * scale * 2^-shift) * sum(x): scale * code * x + zero * x summed."""
    if xs[0].dtype == gl.float16:
        y = production._row_tile(w_tile, s_run, z_run, j_lo, t, xs, sums, y, n0, N, stride_ws, j0, W, F, NG, ROWS,
                                 ROW_BYTES, G, BITS, ASM, CONS, VALUE_EXP, KIND, GW)
    else:
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
        D: gl.constexpr = W * 4 * F
        PPF: gl.constexpr = NG // F
        P: gl.constexpr = D // NG
        GWP: gl.constexpr = production.pow2_at_least(GW)
        kw = w_tile.slice(16 * t, 16, dim=0).load(key_words_layout(16, W))
        op = _bias_operand(kw, 16, D, F, BITS)
        zero = gl.zeros([16, ROWS], gl.float32, layout=mma)
        if NG == 1:
            parts = (mma_v2(gl.convert_layout(op, a_l, assert_trivial=True), xs[0], zero),)
        else:
            parts = group_mmas(split_groups(op, NG, 1), xs, zeros_groups([16, ROWS], mma, NG), a_l, b_l, NG)
        rows = gl.minimum(n0 + 16 * t + gl.arange(0, 16, layout=gl.SliceLayout(1, mma)), N - 1)
        for p in gl.static_range(NG):
            g = production._group((p // PPF) * ROW_BYTES + j0 + (p % PPF) * P, G)
            g_first = production._group((p // PPF) * ROW_BYTES + j_lo, G)
            sp = production._param(s_run, (p // PPF) * GWP, g - g_first, t, rows, stride_ws, g, g_first, KIND) * \
                _field_weight(BITS, p // PPF)
            zp = production._param(z_run, (p // PPF) * GWP, g - g_first, t, rows, stride_ws, g, g_first, KIND) - \
                128.0 * sp
            y = y + parts[p] * sp[:, None] + sums[p] * zp[:, None]
    return y


_bias_chunk = rebound(production._chunk, _x_operand=_bias_x_operand, _row_tile=_bias_row_tile)
_bias_loop = rebound(production.chunk_loop, _chunk=_bias_chunk)
_bias_sums = rebound(production.program_sums, chunk_loop=_bias_loop)
foldc_gemv_bias = rebound(production.foldc_gemv_gluon, program_sums=_bias_sums)


def check_bias_unpack(bits: int, words: int = 4096, seed: int = 0) -> None:
    """`bias_unpack_asm`'s PTX run on random words by a small interpreter of its two instructions (shr.b32,
    lop3.b32 with table 0xea: (a & b) | c); every result pair, read as bf16, must be 128 + code * 2^shift of the
    field and bytes `key_unpack_asm` puts there. Raises AssertionError otherwise."""
    import random
    import re
    import struct

    asm, _ = bias_unpack_asm(bits)
    rng = random.Random(seed)
    n = 2 * (8 // bits)
    for _ in range(words):
        w = rng.getrandbits(32)
        regs = {f"${n}": w}
        for op, dst, src, a, b in re.findall(r"(shr|lop3)\.b32 (\S+), (\S+), (\w+)(?:, (\w+))?", asm):
            if op == "shr":
                regs[dst] = regs[src] >> int(a)
            else:
                regs[dst] = (regs[src] & int(a)) | int(b)
        for i in range(8 // bits):
            for p in (0, 1):
                value = regs[f"${2 * i + p}"]
                for half, byte in ((0, p), (1, p + 2)):
                    bf16 = (value >> (16 * half)) & 0xFFFF
                    got = struct.unpack("<f", struct.pack("<I", bf16 << 16))[0]
                    code = (w >> (8 * byte + bits * i)) & ((1 << bits) - 1)
                    assert got == 128 + code * 2 ** field_shift(bits, i), (bits, hex(w), i, p, half, got, code)


def sass_counts(cases=(("k-group:4:128", 4096, 14336), ("k-group:2:128", 28672, 8192))) -> list[dict]:
    """Registers and chunk-loop SASS of the production kernel and this variant, built ahead of time for sm_90
    at m = 1 with fp16 and bf16 activations (CPU, no GPU; TRITON_INTERPRET unset)."""
    import sys
    import tempfile

    from foldc.backends.gluon.gemv_aot import compile_gemv_aot
    from foldc.gemm import GemmSpec, parse_gemm_encoding

    rows, kept = [], production.foldc_gemv_gluon
    here = sys.modules[__name__]
    for enc, n, k in cases:
        for name, kernel in (("production", kept), ("row", here.foldc_gemv_gluon), ("bias", here.foldc_gemv_bias)):
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


if __name__ == "__main__":   # python3 benchmarks/gemv_variants.py: the bias unpack's check, the SASS comparison
    for b in (2, 4):
        check_bias_unpack(b)
    print("bias_unpack_asm: every code of 2 and 4 bits as 128 + code * 2^shift (4096 random words each)")
    sass_counts()
