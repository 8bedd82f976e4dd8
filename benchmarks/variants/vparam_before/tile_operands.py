"""Register side of the register-operand kernel (kernel.py): the layouts the code words are read in,
the unpack of key and value words into fp16 MMA operands (two codes per LOP3, the PTX from
operands.py), and the per-row, per-channel and channel-wise group parameters that meet them.

Import this module only where Triton runs natively (not under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import math

from triton.experimental import gluon
from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from foldc.backends.gluon.operands import NARROW_WORDS

LANES_KEY = [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]
LANES_KEY_NARROW = [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]]   # four words per token: one word per lane
LANES_VALUE = [[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]]
# words per token below the MMA's eight lane rows (head_dim 64 at 2 bits), as the kernels see it
NARROW = gl.constexpr(NARROW_WORDS)


@constexpr_function
def value_tile_words(W):
    """Words per token of a value tile in shared memory: W, or 8 for four-word tokens, whose words
    the copy writes twice (rows w and w + 4, operands.value_row)."""
    return 8 if int(W) == NARROW_WORDS else int(W)


@constexpr_function
def key_words_layout(BN, W, WARPS=1):
    """Key words [BN tokens, W words]: words 2t, 2t+1 of rows g, g+8 per lane (the k_width=8 A operand);
    with four words per token, word t (operands.key_k). WARPS warps take consecutive row ranges of BN / WARPS
    (an MMA layout with warps_per_cta [WARPS, 1])."""
    BN, W, WARPS = int(BN), int(W), int(WARPS)
    per = BN // WARPS
    warp = [[per << i, 0] for i in range(int(math.log2(WARPS)))]
    if W == NARROW_WORDS:
        reg = [[8, 0]] + [[16 << i, 0] for i in range(int(math.log2(per // 16)))]
        return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=LANES_KEY_NARROW, warp_bases=warp,
                                          block_bases=[], shape=[BN, W])
    reg = [[0, 1], [8, 0]] + [[0, 8 << i] for i in range(int(math.log2(W // 8)))] + \
        [[16 << i, 0] for i in range(int(math.log2(per // 16)))]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=LANES_KEY, warp_bases=warp, block_bases=[],
                                      shape=[BN, W])


@constexpr_function
def value_words_layout(BN, W):
    """Value words [W words, BN tokens]: four consecutive tokens of one word in consecutive registers."""
    BN, W = int(BN), int(W)
    reg = [[0, 1], [0, 2], [0, 4]] + [[0, 32 << i] for i in range(int(math.log2(BN // 32)))] + \
        [[8 << i, 0] for i in range(int(math.log2(W // 8)))]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=LANES_VALUE, warp_bases=[], block_bases=[],
                                      shape=[W, BN])


@gluon.jit
def _join4(x0, x1, x2, x3):
    # [..., 2, 2] whose element [..., u, v] is x_(2u+v)
    return gl.join(gl.join(x0, x2), gl.join(x1, x3))


@gluon.jit
def _pairs(x0, x1, BN: gl.constexpr, NB: gl.constexpr):
    # x_p[t, w, e] holds byte 4w + p + 2e; k = 4w + 2p + e keeps each unpacked register one k pair
    return gl.reshape(gl.permute(gl.join(x0, x1), (0, 1, 3, 2)), [BN, NB])


@gluon.jit
def key_operand(kw, BN: gl.constexpr, D: gl.constexpr, F: gl.constexpr, ASM: gl.constexpr, CONS: gl.constexpr,
                DTYPE: gl.constexpr = gl.float16):
    """The [BN, D] MMA operand of a tile's code words ``kw`` [BN, D / F / 4] unpacked by ``ASM`` (operands.py:
    fp16 subnormal codes, or bf16 codes plus a bias with DTYPE bf16), k in the unpack's order."""
    NB: gl.constexpr = D // F
    x = gl.join(kw, kw)
    if NB == 4 * NARROW:
        # four words per token, one per lane: k = 32 (field // 2) + 8 word + 4 (field % 2) + 2p + e
        # (operands.key_k), so that the MMA's lane bits of k are the word's
        a0, a1, b0, b1, c0, c1, d0, d1 = gl.inline_asm_elementwise(
            ASM, CONS, [x], dtype=(DTYPE.value,) * 8, is_pure=True, pack=2)
        f0 = gl.permute(gl.join(a0, a1), (0, 1, 3, 2))    # [BN, word, p, e]
        f1 = gl.permute(gl.join(b0, b1), (0, 1, 3, 2))
        f2 = gl.permute(gl.join(c0, c1), (0, 1, 3, 2))
        f3 = gl.permute(gl.join(d0, d1), (0, 1, 3, 2))
        op = gl.join(gl.join(f0, f1), gl.join(f2, f3))    # [BN, word, p, e, field % 2, field // 2]
        op = gl.reshape(gl.permute(op, (0, 5, 1, 4, 2, 3)), [BN, D])
    elif F == 4:
        a0, a1, b0, b1, c0, c1, d0, d1 = gl.inline_asm_elementwise(
            ASM, CONS, [x], dtype=(DTYPE.value,) * 8, is_pure=True, pack=2)
        op = _join4(_pairs(a0, a1, BN, NB), _pairs(b0, b1, BN, NB), _pairs(c0, c1, BN, NB), _pairs(d0, d1, BN, NB))
        op = gl.reshape(gl.permute(op, (0, 2, 3, 1)), [BN, D])
    elif F == 2:
        a0, a1, b0, b1 = gl.inline_asm_elementwise(ASM, CONS, [x], dtype=(DTYPE.value,) * 4, is_pure=True, pack=2)
        op = gl.reshape(gl.permute(gl.join(_pairs(a0, a1, BN, NB), _pairs(b0, b1, BN, NB)), (0, 2, 1)), [BN, D])
    else:   # 8-bit codes: one field, the k index is the byte's
        a0, a1 = gl.inline_asm_elementwise(ASM, CONS, [x], dtype=(DTYPE.value,) * 2, is_pure=True, pack=2)
        op = _pairs(a0, a1, BN, NB)
    return op


@gluon.jit
def _value_fields(vw, ASM: gl.constexpr, CONS: gl.constexpr, F: gl.constexpr):
    if F == 4:
        r0, r1, r2, r3 = gl.inline_asm_elementwise(ASM, CONS, [vw], dtype=(gl.float16,) * 4, is_pure=True, pack=4)
    elif F == 2:
        r0, r1 = gl.inline_asm_elementwise(ASM, CONS, [vw], dtype=(gl.float16,) * 2, is_pure=True, pack=4)
        r2 = r0
        r3 = r1
    else:   # 8-bit codes: one field
        r0 = gl.inline_asm_elementwise(ASM, CONS, [vw], dtype=gl.float16, is_pure=True, pack=4)
        r1 = r0
        r2 = r0
        r3 = r0
    return r0, r1, r2, r3


@gluon.jit
def load_value_words(tile, BN: gl.constexpr, W: gl.constexpr):
    """A value tile's words [value_tile_words(W), BN] in the value operand's layout. Four words per
    token: the tile holds each word twice and rows w + 4 come shifted right by 16 bits, so that
    bytes 0 and 1 of row r are bytes 2 (r // 4) + (0, 1) of word r % 4 (operands.value_row)."""
    WT: gl.constexpr = value_tile_words(W)
    vw_l: gl.constexpr = value_words_layout(BN, WT)
    vw = tile.permute((1, 0)).load(vw_l)
    if W == NARROW:
        r = gl.arange(0, WT, layout=gl.SliceLayout(1, vw_l))
        vw = vw >> ((r // NARROW) * 16)[:, None]
    return vw


@gluon.jit
def value_operand(vw, BN: gl.constexpr, D: gl.constexpr, F: gl.constexpr, VA0: gl.constexpr, VA1: gl.constexpr,
                  VA2: gl.constexpr, VA3: gl.constexpr, VCONS: gl.constexpr):
    if D // F == 4 * NARROW:
        op = _narrow_value_operand(vw, BN, D, F, VA0, VA1, VCONS)
    else:
        op = _value_operand(vw, BN, D, F, VA0, VA1, VA2, VA3, VCONS)
    return op


@gluon.jit
def _narrow_value_operand(vw, BN: gl.constexpr, D: gl.constexpr, F: gl.constexpr, VA0: gl.constexpr,
                          VA1: gl.constexpr, VCONS: gl.constexpr):
    # four words per token (load_value_words): bytes 0 and 1 of each of the eight rows;
    # row m = 16 field + 8 byte + r (operands.value_row)
    p00, p10, p20, p30 = _value_fields(vw, VA0, VCONS, F)   # p<field><byte>
    p01, p11, p21, p31 = _value_fields(vw, VA1, VCONS, F)
    op = _join4(gl.join(p00, p01), gl.join(p10, p11), gl.join(p20, p21), gl.join(p30, p31))   # [8, BN, byte, fu, fv]
    return gl.reshape(gl.permute(op, (3, 4, 2, 0, 1)), [D, BN])


@gluon.jit
def _value_operand(vw, BN: gl.constexpr, D: gl.constexpr, F: gl.constexpr, VA0: gl.constexpr, VA1: gl.constexpr,
                   VA2: gl.constexpr, VA3: gl.constexpr, VCONS: gl.constexpr):
    p00, p10, p20, p30 = _value_fields(vw, VA0, VCONS, F)   # p<field><byte>
    p01, p11, p21, p31 = _value_fields(vw, VA1, VCONS, F)
    p02, p12, p22, p32 = _value_fields(vw, VA2, VCONS, F)
    p03, p13, p23, p33 = _value_fields(vw, VA3, VCONS, F)
    j0 = _join4(p00, p01, p02, p03)      # [W, BN, u, v]: byte 2u+v of field 0
    j1 = _join4(p10, p11, p12, p13)      # (unused with one field)
    if F == 4:
        op = _join4(j0, j1, _join4(p20, p21, p22, p23), _join4(p30, p31, p32, p33))
        op = gl.reshape(gl.permute(op, (4, 5, 2, 3, 0, 1)), [D, BN])
    elif F == 2:
        op = gl.reshape(gl.permute(gl.join(j0, j1), (4, 2, 3, 0, 1)), [D, BN])
    else:   # 8-bit codes: row m = byte * W + word
        op = gl.reshape(gl.permute(j0, (2, 3, 0, 1)), [D, BN])
    return op


@gluon.jit
def per_row(x, H: gl.constexpr):
    """A token-wise parameter as float32 [BN, ROWS] (or [BN, 1] to broadcast, one head per program)."""
    if H == 1:
        y = x.to(gl.float32)[:, None]
    else:
        y = x.to(gl.float32)
    return y


@gluon.jit
def swap_k01(x, D: gl.constexpr, ROWS: gl.constexpr):
    """x[c] -> x[key_channel(k)]: the key operand's k index is the channel with its bits 0 and 1
    swapped (operands.py), a reshape and a permute of the tensor (no data moves between lanes)."""
    if ROWS == 0:
        y = gl.reshape(gl.permute(gl.reshape(x, [D // 4, 2, 2]), (0, 2, 1)), [D])
    else:
        y = gl.reshape(gl.permute(gl.reshape(x, [D // 4, 2, 2, ROWS]), (0, 2, 1, 3)), [D, ROWS])
    return y


@gluon.jit
def _channel_param(P, chan, head_q, stride_h, D: gl.constexpr, ROWS: gl.constexpr, H: gl.constexpr,
                   SWAP: gl.constexpr, CH: gl.constexpr, CHR: gl.constexpr):
    """channel_param16 in float32."""
    return channel_param16(P, chan, head_q, stride_h, D, ROWS, H, SWAP, CH, CHR).to(gl.float32)


@gluon.jit
def channel_param16(P, chan, head_q, stride_h, D: gl.constexpr, ROWS: gl.constexpr, H: gl.constexpr,
                    SWAP: gl.constexpr, CH: gl.constexpr, CHR: gl.constexpr):
    """A channel-wise K parameter (scale or zero) of one token group in its 16-bit dtype, in the query
    operand's layout, [D, 1] or [D, ROWS] with each row's own head: each lane's eight consecutive
    channels in one vector load, then put in k order (swap_k01). Not SWAP (four words per token,
    whose k order moves channels across lanes): each k's channel ``chan`` loaded where it is used.
    CH, CHR: channels per bit field in the registers and in the cache (a padded head_dim:
    the padding channels load zero)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    c = gl.arange(0, D, layout=gl.SliceLayout(1, b_l))
    if CH != CHR:   # a padded head_dim: each lane's channels mapped to the cache's, the padding zero
        ok = c % CH < CHR
        c = (c // CH) * CHR + c % CH
        if H == 1:
            x = gl.load(P + c, mask=ok, other=0)
            out = gl.convert_layout(swap_k01(x, D, 0), gl.SliceLayout(1, b_l), assert_trivial=True)[:, None]
        else:
            x = gl.load(P + head_q[None, :] * stride_h + c[:, None], mask=ok[:, None], other=0)
            out = gl.convert_layout(swap_k01(x, D, ROWS), b_l, assert_trivial=True)
    elif not SWAP:
        if H == 1:
            out = gl.load(P + chan)[:, None]
        else:
            out = gl.load(P + head_q[None, :] * stride_h + chan[:, None])
    elif H == 1:
        x = gl.load(P + c)
        out = gl.convert_layout(swap_k01(x, D, 0), gl.SliceLayout(1, b_l), assert_trivial=True)[:, None]
    else:
        x = gl.load(P + head_q[None, :] * stride_h + c[:, None])
        out = gl.convert_layout(swap_k01(x, D, ROWS), b_l, assert_trivial=True)
    return out


@gluon.jit
def key_group(qv, field, chan, head_q, stride_ksh, KSg, KZg, qk_scale, BITS: gl.constexpr,
              KEY_EXP: gl.constexpr, H: gl.constexpr, D: gl.constexpr, ROWS: gl.constexpr, SWAP: gl.constexpr = True,
              CH: gl.constexpr = 0, CHR: gl.constexpr = 0):
    """Channel-wise K, one token group: the query pre-scaled by the group's channel scales and field
    weights (operand-fold, eq. 4), each row by its own power of two c so the largest entry sits
    near 2^12 (large channel scales must not overflow fp16), and the logits' affine map
    ``t = acc * mul + add`` with mul = qk_scale * 2^KEY_EXP / c and add = qk_scale * sum(q x zero)
    (eq. 6; subnormal codes carry no bias, eq. 7, and KEY_EXP is 24)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    row_l: gl.constexpr = gl.SliceLayout(0, mma)
    sk = _channel_param(KSg, chan, head_q, stride_ksh, D, ROWS, H, SWAP, CH, CHR)   # each row its own head's
    zk = _channel_param(KZg, chan, head_q, stride_ksh, D, ROWS, H, SWAP, CH, CHR)
    qs = qv * sk * gl.exp2(-(field * BITS).to(gl.float32))[:, None]
    c = gl.exp2(12.0 - gl.floor(gl.log2(gl.maximum(gl.max(gl.abs(qs), axis=0), 1e-30))))
    q16 = (qs * c[None, :]).to(gl.float16)
    mul = qk_scale * (2.0 ** KEY_EXP) / c
    add = gl.sum(qv * zk, axis=0) * qk_scale
    return q16, gl.convert_layout(mul, row_l), gl.convert_layout(add, row_l)


@gluon.jit
def value_group(VSg, VZg, chan_o, weight, head_c, ok, stride_vsh, H: gl.constexpr, PAD: gl.constexpr = False,
                KEEP16: gl.constexpr = False):
    """Channel-wise V: one token group's scale (times the field weight) and zero per output row
    [D], or per output row and query row [D, ROWS] with packed heads (each row its own head's).
    PAD: a padded head_dim, whose padding rows (not ``ok``) load zero (``ok`` is None otherwise).
    KEEP16: 16-bit scales and zeros as loaded (`per_channel` applies ``weight``), half the registers."""
    if H == 1:
        off = chan_o
        w = weight
    else:
        off = head_c[None, :] * stride_vsh + chan_o[:, None]
        w = weight[:, None]
    if KEEP16:   # held in their 16-bit dtype across the tiles of the group, the field weight applied at use
        if PAD:
            m = ok if H == 1 else ok[:, None]
            out = gl.load(VSg + off, mask=m, other=0), gl.load(VZg + off, mask=m, other=0)
        else:
            out = gl.load(VSg + off), gl.load(VZg + off)
    elif PAD:
        m = ok if H == 1 else ok[:, None]
        out = gl.load(VSg + off, mask=m, other=0).to(gl.float32) * w, gl.load(VZg + off, mask=m, other=0).to(gl.float32)
    else:
        out = gl.load(VSg + off).to(gl.float32) * w, gl.load(VZg + off).to(gl.float32)
    return out


@gluon.jit
def per_channel(x, H: gl.constexpr):
    """A channel-wise V parameter as [D, ROWS] or [D, 1] to broadcast (one head per program)."""
    if H == 1:
        y = x[:, None]
    else:
        y = x
    return y


@gluon.jit
def per_channel16(x, H: gl.constexpr, weight=None):
    """per_channel of a 16-bit parameter (value_group's KEEP16) in float32, times ``weight`` per row
    where given."""
    y = x.to(gl.float32)
    if weight is not None:
        if H == 1:
            y = y * weight
        else:
            y = y * weight[:, None]
    return per_channel(y, H)


@gluon.jit
def split_groups(x, NG: gl.constexpr, AXIS: gl.constexpr):
    """x [R, C] cut along AXIS into NG consecutive equal pieces, a tuple (x itself when NG == 1): a
    token-wise channel group's slice of an operand whose K (or M) index is field-major (operands.py),
    so that a group of whole fields is a contiguous range. The cut axis's top index bits are register
    bits of the MMA layouts, so no data moves."""
    R: gl.constexpr = x.shape[0]
    C: gl.constexpr = x.shape[1]
    if NG == 1:
        out = x
    elif NG == 8:   # halves first (groups 0-3 and 4-7), then each half in four
        h0, h1 = split_groups(x, 2, AXIS)
        a = split_groups(h0, 4, AXIS)
        b = split_groups(h1, 4, AXIS)
        out = (a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3])
    elif NG == 2:
        if AXIS == 0:
            y = gl.permute(gl.reshape(x, [2, R // 2, C]), (1, 2, 0))
        else:
            y = gl.permute(gl.reshape(x, [R, 2, C // 2]), (0, 2, 1))
        out = gl.split(y)
    else:
        if AXIS == 0:
            y = gl.permute(gl.reshape(x, [2, 2, R // 4, C]), (2, 3, 0, 1))
        else:
            y = gl.permute(gl.reshape(x, [R, 2, 2, C // 4]), (0, 3, 1, 2))
        even, odd = gl.split(y)      # bit 0 of the piece index; each still holds bit 1 last
        p0, p2 = gl.split(even)
        p1, p3 = gl.split(odd)
        out = (p0, p1, p2, p3)
    return out


@gluon.jit
def join_groups(parts, NG: gl.constexpr):
    """The inverse of split_groups along axis 0: NG pieces [G, C] back into [NG * G, C]."""
    if NG == 1:
        out = parts
    elif NG == 8:
        out = join_groups((join_groups((parts[0], parts[1], parts[2], parts[3]), 4),
                           join_groups((parts[4], parts[5], parts[6], parts[7]), 4)), 2)
    elif NG == 2:
        G: gl.constexpr = parts[0].shape[0]
        C: gl.constexpr = parts[0].shape[1]
        out = gl.reshape(gl.permute(gl.join(parts[0], parts[1]), (2, 0, 1)), [2 * G, C])
    else:
        G: gl.constexpr = parts[0].shape[0]
        C: gl.constexpr = parts[0].shape[1]
        j = gl.join(gl.join(parts[0], parts[1]), gl.join(parts[2], parts[3]))   # [G, C, bit 0, bit 1]
        out = gl.reshape(gl.permute(j, (3, 2, 0, 1)), [4 * G, C])
    return out


@gluon.jit
def split_field_groups(x, F: gl.constexpr, W: gl.constexpr, NG: gl.constexpr):
    """The value operand x [D, BN] (or an accumulator [D, ROWS]) cut into its NG token-wise channel
    groups when a group is smaller than a bit field: row m = field * 4W + byte * W + word holds
    channel field * 4W + 4 * word + byte, so group g = field * WH + word // WL (WH groups per field,
    WL = group / 4 words each) is the rows of one field whose word index has high part g % WH. The
    group bits are register bits of the MMA layouts (WL >= 8: the lane bits stay inside a group), so
    no data moves. Returns a tuple of NG pieces [4 * WL, C] (row r = byte * WL + word low part)."""
    C: gl.constexpr = x.shape[1]
    WL: gl.constexpr = W * F // NG
    WH: gl.constexpr = W // WL
    y = gl.permute(gl.reshape(x, [F, 4, WH, WL, C]), (1, 3, 4, 0, 2))   # [byte, WL, C, field, WH]
    if NG == 2:
        out = gl.split(gl.reshape(y, [4 * WL, C, 2]))
    elif NG == 4:
        even, odd = gl.split(gl.reshape(y, [4 * WL, C, 2, 2]))   # bit 0 of the group index, then bit 1
        p0, p2 = gl.split(even)
        p1, p3 = gl.split(odd)
        out = (p0, p1, p2, p3)
    else:
        even, odd = gl.split(gl.reshape(y, [4 * WL, C, 2, 2, 2]))   # bits 0, 1, 2 of the group index
        e0, e2 = gl.split(even)
        o1, o3 = gl.split(odd)
        p0, p4 = gl.split(e0)
        p2, p6 = gl.split(e2)
        p1, p5 = gl.split(o1)
        p3, p7 = gl.split(o3)
        out = (p0, p1, p2, p3, p4, p5, p6, p7)
    return out


@gluon.jit
def join_field_groups(parts, F: gl.constexpr, W: gl.constexpr, NG: gl.constexpr):
    """The inverse of split_field_groups: NG pieces [4 * WL, C] back into [D, C]."""
    C: gl.constexpr = parts[0].shape[1]
    WL: gl.constexpr = W * F // NG
    WH: gl.constexpr = W // WL
    if NG == 2:
        j = gl.join(parts[0], parts[1])                                           # [G, C, g]
    elif NG == 4:
        j = gl.permute(gl.join(gl.join(parts[0], parts[1]), gl.join(parts[2], parts[3])), (0, 1, 3, 2))
    else:   # [G, C, bit 0, bit 1, bit 2] -> [G, C, bit 2, bit 1, bit 0]
        j = gl.join(gl.join(gl.join(parts[0], parts[1]), gl.join(parts[2], parts[3])),
                    gl.join(gl.join(parts[4], parts[5]), gl.join(parts[6], parts[7])))
        j = gl.reshape(gl.permute(j, (0, 1, 4, 3, 2)), [parts[0].shape[0], C, 8])
    y = gl.reshape(j, [4, WL, C, F, WH])
    return gl.reshape(gl.permute(y, (3, 0, 4, 1, 2)), [F * 4 * W, C])


@gluon.jit
def group_mmas(a_parts, b_parts, accs, a_l: gl.constexpr, b_l: gl.constexpr, NG: gl.constexpr):
    """One MMA per channel group, group g's operands into accumulator accs[g]: a tuple of NG."""
    a0 = gl.convert_layout(a_parts[0], a_l, assert_trivial=True)
    a1 = gl.convert_layout(a_parts[1], a_l, assert_trivial=True)
    b0 = gl.convert_layout(b_parts[0], b_l, assert_trivial=True)
    b1 = gl.convert_layout(b_parts[1], b_l, assert_trivial=True)
    if NG == 2:
        out = (mma_v2(a0, b0, accs[0]), mma_v2(a1, b1, accs[1]))
    elif NG == 8:
        lo = group_mmas((a_parts[0], a_parts[1], a_parts[2], a_parts[3]), (b_parts[0], b_parts[1], b_parts[2], b_parts[3]),
                        (accs[0], accs[1], accs[2], accs[3]), a_l, b_l, 4)
        hi = group_mmas((a_parts[4], a_parts[5], a_parts[6], a_parts[7]), (b_parts[4], b_parts[5], b_parts[6], b_parts[7]),
                        (accs[4], accs[5], accs[6], accs[7]), a_l, b_l, 4)
        out = (lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3])
    else:
        a2 = gl.convert_layout(a_parts[2], a_l, assert_trivial=True)
        a3 = gl.convert_layout(a_parts[3], a_l, assert_trivial=True)
        b2 = gl.convert_layout(b_parts[2], b_l, assert_trivial=True)
        b3 = gl.convert_layout(b_parts[3], b_l, assert_trivial=True)
        out = (mma_v2(a0, b0, accs[0]), mma_v2(a1, b1, accs[1]), mma_v2(a2, b2, accs[2]), mma_v2(a3, b3, accs[3]))
    return out


@gluon.jit
def select_groups(keep, new, old, NG: gl.constexpr):
    """Per group, ``new`` where ``keep`` else ``old`` (tuples of NG)."""
    if NG == 2:
        out = (gl.where(keep, new[0], old[0]), gl.where(keep, new[1], old[1]))
    elif NG == 4:
        out = (gl.where(keep, new[0], old[0]), gl.where(keep, new[1], old[1]), gl.where(keep, new[2], old[2]),
               gl.where(keep, new[3], old[3]))
    else:
        out = (gl.where(keep, new[0], old[0]), gl.where(keep, new[1], old[1]), gl.where(keep, new[2], old[2]),
               gl.where(keep, new[3], old[3]), gl.where(keep, new[4], old[4]), gl.where(keep, new[5], old[5]),
               gl.where(keep, new[6], old[6]), gl.where(keep, new[7], old[7]))
    return out


@gluon.jit
def zeros_groups(shape: gl.constexpr, layout: gl.constexpr, NG: gl.constexpr):
    """A float32 zero tensor per group: a tuple of NG (one tensor for NG == 1)."""
    z = gl.zeros(shape, gl.float32, layout=layout)
    if NG == 1:
        out = z
    elif NG == 2:
        out = (z, z)
    elif NG == 3:
        out = (z, z, z)
    elif NG == 4:
        out = (z, z, z, z)
    else:
        out = (z,) * NG
    return out


@gluon.jit
def group_sums(parts, scale, layout: gl.constexpr, NG: gl.constexpr):
    """Per group, the sum of its piece over axis 0 times ``scale``, as ``layout``: a tuple of NG."""
    if NG == 8:
        lo = group_sums((parts[0], parts[1], parts[2], parts[3]), scale, layout, 4)
        hi = group_sums((parts[4], parts[5], parts[6], parts[7]), scale, layout, 4)
        out = (lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3])
    elif NG == 2:
        out = (gl.convert_layout(gl.sum(parts[0], axis=0) * scale, layout),
               gl.convert_layout(gl.sum(parts[1], axis=0) * scale, layout))
    else:
        out = (gl.convert_layout(gl.sum(parts[0], axis=0) * scale, layout),
               gl.convert_layout(gl.sum(parts[1], axis=0) * scale, layout),
               gl.convert_layout(gl.sum(parts[2], axis=0) * scale, layout),
               gl.convert_layout(gl.sum(parts[3], axis=0) * scale, layout))
    return out


@gluon.jit
def scaled_p(p, vs, vz, zsum, alpha, b_l: gl.constexpr, H: gl.constexpr, NG: gl.constexpr):
    """Token-wise V with NG channel groups per token (operand-fold, eq. 4, 6): per group, P times the
    group's scale as the value MMA's fp16 operand, and the running sum(P x zero) (tuples of NG)."""
    if NG > 4 and NG < 8:   # five to seven groups (a padded head_dim's, kernel.py's VMG): one at a time
        pbs = ()
        zs = ()
        for g in gl.static_range(NG):
            pbs = pbs + (gl.convert_layout((p * per_row(vs[g], H)).to(gl.float16), b_l),)
            zs = zs + (zsum[g] * alpha + gl.sum(p * per_row(vz[g], H), axis=0),)
    elif NG == 8:
        lo, zlo = _scaled_p(p, (vs[0], vs[1], vs[2], vs[3]), (vz[0], vz[1], vz[2], vz[3]),
                            (zsum[0], zsum[1], zsum[2], zsum[3]), alpha, b_l, H, 4)
        hi, zhi = _scaled_p(p, (vs[4], vs[5], vs[6], vs[7]), (vz[4], vz[5], vz[6], vz[7]),
                            (zsum[4], zsum[5], zsum[6], zsum[7]), alpha, b_l, H, 4)
        pbs = (lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3])
        zs = (zlo[0], zlo[1], zlo[2], zlo[3], zhi[0], zhi[1], zhi[2], zhi[3])
    else:
        pbs, zs = _scaled_p(p, vs, vz, zsum, alpha, b_l, H, NG)
    return pbs, zs


@gluon.jit
def _scaled_p(p, vs, vz, zsum, alpha, b_l: gl.constexpr, H: gl.constexpr, NG: gl.constexpr):
    pb0 = gl.convert_layout((p * per_row(vs[0], H)).to(gl.float16), b_l)
    pb1 = gl.convert_layout((p * per_row(vs[1], H)).to(gl.float16), b_l)
    z0 = zsum[0] * alpha + gl.sum(p * per_row(vz[0], H), axis=0)
    z1 = zsum[1] * alpha + gl.sum(p * per_row(vz[1], H), axis=0)
    if NG == 2:
        pbs = (pb0, pb1)
        zs = (z0, z1)
    elif NG == 3:
        pbs = (pb0, pb1, gl.convert_layout((p * per_row(vs[2], H)).to(gl.float16), b_l))
        zs = (z0, z1, zsum[2] * alpha + gl.sum(p * per_row(vz[2], H), axis=0))
    else:
        pbs = (pb0, pb1, gl.convert_layout((p * per_row(vs[2], H)).to(gl.float16), b_l),
               gl.convert_layout((p * per_row(vs[3], H)).to(gl.float16), b_l))
        zs = (z0, z1, zsum[2] * alpha + gl.sum(p * per_row(vz[2], H), axis=0),
              zsum[3] * alpha + gl.sum(p * per_row(vz[3], H), axis=0))
    return pbs, zs
