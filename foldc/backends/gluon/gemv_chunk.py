"""One chunk of the register-operand GEMV (gemv.py): the weight's codes as the MMA's operand, the activation's
pieces, and each piece's scale and zero, added into the accumulators of a program's row tiles.

The weight plays the attention kernel's key side (kernel.py, operands.py): output channels are the
MMA's M axis ("tokens"), k its K axis, and the activation rows its N axis (padded to ROWS = 8 or 16).
A chunk of NB bytes of one weight row holds NB * F channels of k (F codes per byte, planar packing:
field i of byte j is k = i * K/F + j), unpacked by `key_operand` (two codes per AND, fp16 subnormals
code * 2^(bits*i) * 2^-24). Per chunk, each piece of the operand that lies inside one k group (a
field's whole chunk, or a part of it when the group is smaller) gets its own MMA chain, and

    y[n, m] += mma_p[n, m] * scale[n, g_p] * 2^(24 - bits*i_p) / c[m]  +  zero[n, g_p] * X_p[m]

where X_p is the sum of x over the piece's k (the correction of eq. 6, here per group and so exact
for a k-group weight: eq. 5 and 6 of docs/derivation.md with the weight's groups along k). No
partial sum is carried unscaled from one group into another; a group longer than a chunk adds its
chunks' scaled pieces (the same scale, so the same sum). c[m] is 1 for fp16 activations. bf16
activations: where the plan carries the weight's code bias BIAS = 128 (2- and 4-bit codes, eq. 7), the
codes enter a bf16 MMA as ``128 + code * 2^shift_i`` (operands.biased_key_unpack_asm) with x as it is,
and each piece adds ``mma_p * scale * 2^-shift_i + (zero - 128 * scale * 2^-shift_i) * X_p`` (the bias
folded into the zero); otherwise (8-bit codes, or a bias the precision budget refuses) x is put in fp16 per
chunk, each row times a power of two c that brings its largest entry near 2^12 (exact).

A program's pipeline, copies and split-k reduction around these chunks are gemv.py's.

Import this module only where Triton runs natively (not under TRITON_INTERPRET=1).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from foldc.backends.gluon.operands import biased_field_shift
from foldc.backends.gluon.tile_operands import (group_mmas, key_operand, key_words_layout, split_groups, swap_k01,
                                                zeros_groups)


@constexpr_function
def gemv_mma(WARPS):
    """The accumulators' layout: mma.sync m16n8, warp w holding output channels 16w .. 16w + 15 of a row tile."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[int(WARPS), 1], instr_shape=[16, 8])


@constexpr_function
def pow2_at_least(n):
    """The least power of two >= n."""
    return 1 << (int(n) - 1).bit_length()


@constexpr_function
def group_shift(G):
    """log2 of a power-of-two group size (groups by a shift: the k indices are never negative), else -1."""
    G = int(G)
    return G.bit_length() - 1 if G & (G - 1) == 0 else -1


_biased_field_shift = constexpr_function(biased_field_shift)


@constexpr_function
def biased_field_weight(bits, field):
    """2^-shift: field ``field``'s weight undone for the biased bf16 codes (operands.biased_key_unpack_asm)."""
    return 2.0 ** -_biased_field_shift(int(bits), int(field))


@constexpr_function
def x_as_is(xf16, bias):
    """Whether the activation enters the MMA as it is: fp16, or bf16 against biased bf16 codes."""
    return bool(xf16) or int(bias) != 0


@gluon.jit
def _group(k, G: gl.constexpr):
    """The k group of k index ``k`` (>= 0)."""
    SHIFT: gl.constexpr = group_shift(G)
    if SHIFT >= 0:
        out = k >> SHIFT
    else:
        out = k // G
    return out


@gluon.jit
def _param(run, base: gl.constexpr, local, t: gl.constexpr, rows, stride_ws, g, g_first, KIND: gl.constexpr):
    """A piece's parameter for row tile t's channels ``rows``, float32 [16]: group g, the ``local``-th of its
    field since the field's first group g_first in this program, from the field's words at rows ``base`` ..
    of ``run`` (KIND: 0 fp16, 1 bf16, 2 fp32). A 16-bit parameter's run starts at the word that holds
    g_first, so a row whose g_first is an odd half finds group g one word further."""
    mma: gl.constexpr = gemv_mma(gl.num_warps())
    TM: gl.constexpr = 16 * gl.num_warps()
    rl: gl.constexpr = gl.SliceLayout(1, mma)
    if KIND == 2:
        out = run.index(base + local).slice(TM * t, TM, dim=0).load(rl).to(gl.float32, bitcast=True)
    else:
        w0 = run.index(base + (local >> 1)).slice(TM * t, TM, dim=0).load(rl)
        w1 = run.index(base + ((local + 1) >> 1)).slice(TM * t, TM, dim=0).load(rl)
        v = gl.where(((rows * stride_ws + g_first) & 1) == 1, w1, w0)
        out = _half_value((v >> (((rows * stride_ws + g) & 1) * 16)) & 0xFFFF, KIND)
    return out


@gluon.jit
def _half_value(half, KIND: gl.constexpr):
    """A 16-bit parameter's bits (int32, the upper half zero) as float32: bf16 (KIND 1) or fp16 (KIND 0)."""
    if KIND == 1:
        out = (half << 16).to(gl.float32, bitcast=True)
    else:
        out = half.to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
    return out


@gluon.jit
def _ones_mmas(ones, xs, zero, b_l: gl.constexpr, NG: gl.constexpr):
    """mma(ones, xs[p]) per piece: each row holds the piece's sum of x per activation row."""
    if NG == 2:
        out = (mma_v2(ones, gl.convert_layout(xs[0], b_l, assert_trivial=True), zero),
               mma_v2(ones, gl.convert_layout(xs[1], b_l, assert_trivial=True), zero))
    elif NG == 4:
        lo = _ones_mmas(ones, (xs[0], xs[1]), zero, b_l, 2)
        hi = _ones_mmas(ones, (xs[2], xs[3]), zero, b_l, 2)
        out = (lo[0], lo[1], hi[0], hi[1])
    else:
        lo = _ones_mmas(ones, (xs[0], xs[1], xs[2], xs[3]), zero, b_l, 4)
        hi = _ones_mmas(ones, (xs[4], xs[5], xs[6], xs[7]), zero, b_l, 4)
        out = (lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3])
    return out


@gluon.jit
def _row_tile(w_tile, s_run, z_run, j_lo, t: gl.constexpr, xs, sums, y, n0, N, stride_ws, j0, W: gl.constexpr,
              F: gl.constexpr, NG: gl.constexpr, ROWS: gl.constexpr, ROW_BYTES: gl.constexpr, G: gl.constexpr,
              BITS: gl.constexpr, ASM: gl.constexpr, CONS: gl.constexpr, VALUE_EXP: gl.constexpr, KIND: gl.constexpr,
              GW: gl.constexpr, BIAS: gl.constexpr):
    """Output channels n0 + TM t .. n0 + TM t + TM - 1 of one chunk (TM: 16 per warp, each warp its own 16): per
    piece, the codes' MMA with x's piece, times the group's scale (and field weight), plus the group's zero (less
    BIAS times the scaled field weight: the plan's code bias, eq. 7) times the piece's sum of x."""
    mma: gl.constexpr = gemv_mma(gl.num_warps())
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    D: gl.constexpr = W * 4 * F
    P: gl.constexpr = D // NG            # k per piece
    PPF: gl.constexpr = NG // F
    GWP: gl.constexpr = pow2_at_least(GW)
    TM: gl.constexpr = 16 * gl.num_warps()   # a row tile: 16 output channels per warp
    kw = w_tile.slice(TM * t, TM, dim=0).load(key_words_layout(TM, W, gl.num_warps()))
    if BIAS != 0:
        op = key_operand(kw, TM, D, F, ASM, CONS, gl.bfloat16)
    else:
        op = key_operand(kw, TM, D, F, ASM, CONS)
    zero = gl.zeros([TM, ROWS], gl.float32, layout=mma)
    if NG == 1:
        parts = (mma_v2(gl.convert_layout(op, a_l, assert_trivial=True), xs[0], zero),)
    else:
        parts = group_mmas(split_groups(op, NG, 1), xs, zeros_groups([TM, ROWS], mma, NG), a_l, b_l, NG)
    rows = gl.minimum(n0 + TM * t + gl.arange(0, TM, layout=gl.SliceLayout(1, mma)), N - 1)
    for p in gl.static_range(NG):
        g = _group((p // PPF) * ROW_BYTES + j0 + (p % PPF) * P, G)
        g_first = _group((p // PPF) * ROW_BYTES + j_lo, G)
        if BIAS != 0:
            sp = _param(s_run, (p // PPF) * GWP, g - g_first, t, rows, stride_ws, g, g_first, KIND) * \
                biased_field_weight(BITS, p // PPF)
            zp = _param(z_run, (p // PPF) * GWP, g - g_first, t, rows, stride_ws, g, g_first, KIND) - BIAS * sp
        else:
            sp = _param(s_run, (p // PPF) * GWP, g - g_first, t, rows, stride_ws, g, g_first, KIND) * \
                (2.0 ** (VALUE_EXP - BITS * (p // PPF)))
            zp = _param(z_run, (p // PPF) * GWP, g - g_first, t, rows, stride_ws, g, g_first, KIND)
        y = y + parts[p] * sp[:, None] + sums[p] * zp[:, None]
    return y


@gluon.jit
def _x_operand(x_in, D: gl.constexpr, ROWS: gl.constexpr, XF16: gl.constexpr, X_SHARED: gl.constexpr,
               SWAP: gl.constexpr, BIAS: gl.constexpr):
    """(the activation chunk as the MMA's operand [D, ROWS], and the power of two c per column that each column
    was multiplied by: bf16 activations put in fp16; 1.0 where x enters as it is, fp16 or against biased bf16
    codes). ``x_in`` as in `_chunk`."""
    mma: gl.constexpr = gemv_mma(gl.num_warps())
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    if X_SHARED == 1:   # one row, in every column
        xd = x_in.load(gl.SliceLayout(1, b_l))
        if SWAP:
            xd = gl.convert_layout(swap_k01(xd, D, 0), gl.SliceLayout(1, b_l), assert_trivial=True)
        xv = gl.broadcast(xd[:, None], gl.zeros([D, ROWS], gl.int1, layout=b_l))[0]
    elif X_SHARED == 2:   # every row, the tile [ROWS, D] read as the operand [D, ROWS]
        xv = x_in.permute((1, 0)).load(b_l)
        if SWAP:
            xv = gl.convert_layout(swap_k01(xv, D, ROWS), b_l, assert_trivial=True)
    elif SWAP:
        xv = gl.convert_layout(swap_k01(x_in, D, ROWS), b_l, assert_trivial=True)
    else:
        xv = x_in
    if x_as_is(XF16, BIAS):
        x16 = xv
        c = 1.0
    else:   # each row times a power of two c (its largest entry near 2^12), then fp16 (exact)
        xf = xv.to(gl.float32)
        c = gl.exp2(12.0 - gl.floor(gl.log2(gl.maximum(gl.max(gl.abs(xf), axis=0), 1e-30))))
        x16 = (xf * c[None, :]).to(gl.float16)
    return x16, c


@gluon.jit
def _undo(c):
    """1 / c per activation row, in the accumulators' layout ([1, ROWS])."""
    mma: gl.constexpr = gemv_mma(gl.num_warps())
    return gl.convert_layout(1.0 / c, gl.SliceLayout(0, mma))[None, :]


@gluon.jit
def _chunk(w_tile, s_run, z_run, j_lo, x_in, ys, n0, N, stride_ws, j0, T: gl.constexpr, W: gl.constexpr,
           F: gl.constexpr, NG: gl.constexpr, ROWS: gl.constexpr, ROW_BYTES: gl.constexpr, G: gl.constexpr,
           BITS: gl.constexpr, ASM: gl.constexpr, CONS: gl.constexpr, XF16: gl.constexpr, VALUE_EXP: gl.constexpr,
           KIND: gl.constexpr, GW: gl.constexpr, X_SHARED: gl.constexpr, SWAP: gl.constexpr, BIAS: gl.constexpr):
    """One chunk (bytes j0 .. j0 + NB of every row of the block) into the T row tiles' accumulators
    ``ys``; the activation's pieces and their sums are made once and shared by the tiles. ``x_in``: the
    activation chunk, its one row [D] in shared memory (X_SHARED 1, m = 1), its rows [ROWS, D] there (X_SHARED 2)
    or [D, ROWS] in registers, in channel order; SWAP: the weight's unpack (ASM) has k with bits 0 and 1 of the
    byte index swapped (operands.key_unpack_asm), and the activation is permuted to match (PRMTs that also build
    the MMA's register pairs), else the unpack keeps channel order (operands.natural_key_unpack_asm)."""
    mma: gl.constexpr = gemv_mma(gl.num_warps())
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    D: gl.constexpr = W * 4 * F
    P: gl.constexpr = D // NG
    x16, c = _x_operand(x_in, D, ROWS, XF16, X_SHARED, SWAP, BIAS)
    # each piece's sum of x as an MMA of ones, in the accumulator's layout (every row the same)
    TM: gl.constexpr = 16 * gl.num_warps()
    ones = gl.full([TM, P], 1.0, x16.dtype, layout=a_l)
    zero = gl.zeros([TM, ROWS], gl.float32, layout=mma)
    if NG == 1:
        xs = (x16,)
        sums = (mma_v2(ones, x16, zero),)
    else:
        xs = split_groups(x16, NG, 0)
        sums = _ones_mmas(ones, xs, zero, b_l, NG)
    if x_as_is(XF16, BIAS):
        acc = ys
    else:
        acc = _zeros_tiles(ROWS, T)
    if T == 1:
        acc = (_row_tile(w_tile, s_run, z_run, j_lo, 0, xs, sums, acc[0], n0, N, stride_ws, j0, W, F, NG, ROWS,
                         ROW_BYTES, G, BITS, ASM, CONS, VALUE_EXP, KIND, GW, BIAS),)
    elif T == 2:
        acc = (_row_tile(w_tile, s_run, z_run, j_lo, 0, xs, sums, acc[0], n0, N, stride_ws, j0, W, F, NG, ROWS,
                         ROW_BYTES, G, BITS, ASM, CONS, VALUE_EXP, KIND, GW, BIAS),
               _row_tile(w_tile, s_run, z_run, j_lo, 1, xs, sums, acc[1], n0, N, stride_ws, j0, W, F, NG, ROWS,
                         ROW_BYTES, G, BITS, ASM, CONS, VALUE_EXP, KIND, GW, BIAS))
    else:
        acc = (_row_tile(w_tile, s_run, z_run, j_lo, 0, xs, sums, acc[0], n0, N, stride_ws, j0, W, F, NG, ROWS,
                         ROW_BYTES, G, BITS, ASM, CONS, VALUE_EXP, KIND, GW, BIAS),
               _row_tile(w_tile, s_run, z_run, j_lo, 1, xs, sums, acc[1], n0, N, stride_ws, j0, W, F, NG, ROWS,
                         ROW_BYTES, G, BITS, ASM, CONS, VALUE_EXP, KIND, GW, BIAS),
               _row_tile(w_tile, s_run, z_run, j_lo, 2, xs, sums, acc[2], n0, N, stride_ws, j0, W, F, NG, ROWS,
                         ROW_BYTES, G, BITS, ASM, CONS, VALUE_EXP, KIND, GW, BIAS),
               _row_tile(w_tile, s_run, z_run, j_lo, 3, xs, sums, acc[3], n0, N, stride_ws, j0, W, F, NG, ROWS,
                         ROW_BYTES, G, BITS, ASM, CONS, VALUE_EXP, KIND, GW, BIAS))
    if x_as_is(XF16, BIAS):
        out = acc
    else:   # this chunk's sums were of x times c: undone per activation row
        inv = _undo(c)
        if T == 1:
            out = (ys[0] + acc[0] * inv,)
        elif T == 2:
            out = (ys[0] + acc[0] * inv, ys[1] + acc[1] * inv)
        else:
            out = (ys[0] + acc[0] * inv, ys[1] + acc[1] * inv, ys[2] + acc[2] * inv, ys[3] + acc[3] * inv)
    return out


@gluon.jit
def _zeros_tiles(ROWS: gl.constexpr, T: gl.constexpr):
    mma: gl.constexpr = gemv_mma(gl.num_warps())
    z = gl.zeros([16 * gl.num_warps(), ROWS], gl.float32, layout=mma)
    if T == 1:
        out = (z,)
    elif T == 2:
        out = (z, z)
    else:
        out = (z, z, z, z)
    return out
