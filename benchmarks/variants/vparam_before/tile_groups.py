"""The per-group parameters of the register-operand kernel's tiles (kernel.py): the query read from
memory, a channel-wise group's query operand and logits' map (key side) or scales and zeros (value
side), folded (tile_operands.key_group, value_group) or for a dequant plan (tile_dequant.py), the two
groups of a tile of channel-wise groups of 16 tokens, and for groups that cross a padded head_dim's bit
fields the per-group sums of the query and its pieces (operands.piece_groups: which groups a piece meets).
2-bit channel-wise K in groups of up to 32 tokens with fp16 scales (kernel.py's KQ16) builds each group's query
operand by fp16 products and its zero term by one MMA (key_query16, key_group16).

Import this module only where Triton runs natively (not under TRITON_INTERPRET=1).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from foldc.backends.gluon.operands import PIECE, VALUE_EXPONENT, piece_groups
from foldc.backends.gluon.tile_dequant import key_group_dequant, rebuild, value_group_dequant
from benchmarks.variants.vparam_before.tile_operands import channel_param16, key_group, split_groups, swap_k01, value_group


@gluon.jit
def rebuild_rows(ka, a, b):
    """A channel-wise dequant group's keys ka [tokens, D]: code x a[k] + b[k] (tile_dequant.rebuild)."""
    aa, bb = gl.broadcast(a[None, :], b[None, :])
    aa, _ = gl.broadcast(aa, ka)
    bb, _ = gl.broadcast(bb, ka)
    return rebuild(ka, aa, bb)


VALUE_EXP_C: gl.constexpr = gl.constexpr(VALUE_EXPONENT)   # the value codes' subnormal unit (operands.py)


@gluon.jit
def value_weights(D: gl.constexpr, F: gl.constexpr):
    """The field weight 2^(VALUE_EXP - bits*field) of each output row, applied at use where a channel-wise
    V group's scales stay 16-bit (past 128 channels, value_group's KEEP16)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    cm = gl.arange(0, D, layout=gl.SliceLayout(1, mma))
    return gl.exp2((VALUE_EXP_C - (cm // (D // F)) * (8 // F)).to(gl.float32))


@gluon.jit
def load_query(Q, b, stride_qb, q_head0, stride_qh, rq, q_off, q_mask, D: gl.constexpr, ROWS: gl.constexpr,
           SWAP: gl.constexpr):
    """The program's query rows [D, ROWS] as read from Q (each lane's channels in k order) and in float32."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    q_nat = gl.load(Q + b * stride_qb + (q_head0 + rq)[None, :] * stride_qh + q_off[:, None], mask=q_mask, other=0.0)
    if SWAP:
        qv = gl.convert_layout(swap_k01(q_nat, D, ROWS), b_l, assert_trivial=True).to(gl.float32)
    else:
        qv = q_nat.to(gl.float32)
    return q_nat, qv


@gluon.jit
def masked_sums(qv, grp, scale, layout: gl.constexpr, NG: gl.constexpr):
    """Per group g (grp: each channel's group), sum(q) over its channels times ``scale``: a tuple of NG."""
    out = ()
    for g in gl.static_range(NG):
        out = out + (gl.convert_layout(gl.sum(gl.where((grp == g)[:, None], qv, 0.0), axis=0) * scale, layout),)
    return out


@gluon.jit
def _only(q16, grp, g):
    return gl.where((grp == g)[:, None], q16, gl.zeros_like(q16))


PIECE_C: gl.constexpr = gl.constexpr(PIECE)
_SIDES = ("key", "value")


@constexpr_function
def piece_count(side, piece, F, D, DR, NG):
    """How many token-wise groups piece ``piece`` of the key (side 0) or value (side 1) operand meets on a head_dim
    DR padded to D channels in F bit fields (operands.piece_groups)."""
    return len(piece_groups(_SIDES[int(side)], int(piece), 8 // int(F), int(D), int(DR), int(NG)))


@constexpr_function
def piece_group(side, piece, s, F, D, DR, NG):
    """The s-th group piece ``piece`` meets (as piece_count)."""
    return piece_groups(_SIDES[int(side)], int(piece), 8 // int(F), int(D), int(DR), int(NG))[int(s)]


@constexpr_function
def piece_slot(side, piece, g, F, D, DR, NG):
    """Where group g stands among the groups piece ``piece`` meets, -1 if it meets no channel of g."""
    met = piece_groups(_SIDES[int(side)], int(piece), 8 // int(F), int(D), int(DR), int(NG))
    return met.index(int(g)) if int(g) in met else -1


@gluon.jit
def piece_queries(q16, grp, D: gl.constexpr, F: gl.constexpr, DR: gl.constexpr, NG: gl.constexpr):
    """The query operand Q'^T [D, ROWS] cut into D / PIECE pieces of its k index, each a tuple with one entry per
    group the piece meets: the piece itself where it meets one group, else per group the piece with the other
    groups' channels zero (grp: each channel's group). Made once before the token loop; a piece of padding
    alone keeps its (zero) piece."""
    NP: gl.constexpr = D // PIECE_C
    parts = split_groups(q16, NP, 0)
    out = ()
    for i in gl.static_range(NP):
        if piece_count(0, i, F, D, DR, NG) <= 1:
            out = out + ((parts[i],),)
        else:
            entry = ()
            for s in gl.static_range(piece_count(0, i, F, D, DR, NG)):
                entry = entry + (split_groups(_only(q16, grp, piece_group(0, i, s, F, D, DR, NG)), NP, 0)[i],)
            out = out + (entry,)
    return out


@gluon.jit
def key_params(qv, field, chan, head_q, stride_ksh, KSg, KZg, qk_scale, BITS: gl.constexpr,
               KEY_EXP: gl.constexpr, H: gl.constexpr, D: gl.constexpr, ROWS: gl.constexpr, SWAP: gl.constexpr,
               CH: gl.constexpr, CHR: gl.constexpr, DQ: gl.constexpr):
    """A channel-wise K group's query operand, per-k parameters and logits' map: the fold's
    (tile_operands.key_group, from the float32 query qv) or, for a dequant plan,
    tile_dequant.key_group_dequant's (qv is then the pair of the fp16 query and its rows' factor)."""
    if DQ:
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
        out = key_group_dequant(qv, KSg, KZg, gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8), D, 8 // BITS,
                                CH, CHR)
    else:
        out = key_group(qv, field, chan, head_q, stride_ksh, KSg, KZg, qk_scale, BITS, KEY_EXP, H, D, ROWS,
                        SWAP, CH, CHR)
    return out


@gluon.jit
def value_params(VSg, VZg, chan_o, weight, head_c, ok, stride_vsh, cm, H: gl.constexpr, PAD: gl.constexpr,
                 D: gl.constexpr, BITS: gl.constexpr, DQ: gl.constexpr, LEAN: gl.constexpr = False):
    """A channel-wise V group's (scale, zero) per output row (tile_operands.value_group) or, for a
    dequant plan, ((a, b) per output row, P's factor 2^-e) (tile_dequant.value_group_dequant)."""
    if DQ:
        a, b, f = value_group_dequant(VSg, VZg, chan_o, cm, ok, D, 8 // BITS, PAD)
        out = (a, b), f
    else:
        out = value_group(VSg, VZg, chan_o, weight, head_c, ok, stride_vsh, H, PAD, LEAN)
    return out


@gluon.jit
def key_tile_params(qv, field, chan, head_q, stride_ksh, KSp, KZp, stride_ksn, n0, end, qk_scale,
                     BITS: gl.constexpr, KEY_EXP: gl.constexpr, H: gl.constexpr,
                     D: gl.constexpr, ROWS: gl.constexpr, SWAP: gl.constexpr, CH: gl.constexpr, CHR: gl.constexpr,
                     DQ: gl.constexpr, KEY_G: gl.constexpr, BN: gl.constexpr):
    """_key_group of the group holding token n0; with groups of half a tile (KEY_G < BN) the two
    groups' (q16, q_bias, q_sum) as pairs, the second clamped to the last group before ``end``."""
    g = n0 // KEY_G
    first = key_params(qv, field, chan, head_q, stride_ksh, KSp + g * stride_ksn, KZp + g * stride_ksn, qk_scale, BITS,
                       KEY_EXP, H, D, ROWS, SWAP, CH, CHR, DQ)
    if KEY_G < BN:
        g2 = gl.maximum(gl.minimum(g + 1, (end - 1) // KEY_G), g)
        second = key_params(qv, field, chan, head_q, stride_ksh, KSp + g2 * stride_ksn, KZp + g2 * stride_ksn,
                            qk_scale, BITS, KEY_EXP, H, D, ROWS, SWAP, CH, CHR, DQ)
        out = (first[0], second[0]), (first[1], second[1]), (first[2], second[2])
    else:
        out = first
    return out


@gluon.jit
def value_tile_params(VSp, VZp, stride_vsn, n0, end, chan_o, weight, head_c, ok, stride_vsh, cm, H: gl.constexpr,
                       PAD: gl.constexpr, D: gl.constexpr, BITS: gl.constexpr, DQ: gl.constexpr,
                       VAL_G: gl.constexpr, BN: gl.constexpr, LEAN: gl.constexpr = False):
    """_value_group of the group holding token n0; with groups of half a tile, both groups' as pairs."""
    g = n0 // VAL_G
    first = value_params(VSp + g * stride_vsn, VZp + g * stride_vsn, chan_o, weight, head_c, ok, stride_vsh, cm, H, PAD,
                         D, BITS, DQ, LEAN)
    if VAL_G < BN:
        g2 = gl.maximum(gl.minimum(g + 1, (end - 1) // VAL_G), g)
        second = value_params(VSp + g2 * stride_vsn, VZp + g2 * stride_vsn, chan_o, weight, head_c, ok, stride_vsh, cm,
                              H, PAD, D, BITS, DQ, LEAN)
        out = (first[0], second[0]), (first[1], second[1])
    else:
        out = first
    return out


@gluon.jit
def key_query16(Q, b, stride_qb, q_head0, stride_qh, rq, q_mask, real_rows, qv, field, qk_scale, BITS: gl.constexpr,
                KEY_EXP: gl.constexpr, D: gl.constexpr, ROWS: gl.constexpr, DR: gl.constexpr):
    """Channel-wise K by fp16 products (KQ16), once a call: each query row times a power of two cq putting its largest
    entry in [1/2, 1), as Q'n = q x cq x 2^-(bits x field) in fp16 (exact for bf16 and fp16 queries in fp16's
    normal range) in the key operand's k order (the B operand of the keys' MMA, key_group16 scales it per group),
    and as Qz = q x cq in channel order, the A operand of the zero term's MMA (rows past the query rows zero);
    the logits' factor per row qk_scale x 2^KEY_EXP / cq, and the zero term's qk_scale / cq per A row."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    amax = gl.maximum(gl.max(gl.abs(qv), axis=0), 1e-30)
    cq = gl.exp2(-1.0 - gl.floor(gl.log2(amax)))
    qn16 = (qv * cq[None, :] * gl.exp2(-(field * BITS).to(gl.float32))[:, None]).to(gl.float16)
    mul = gl.convert_layout(qk_scale * (2.0 ** KEY_EXP) / cq, gl.SliceLayout(0, mma))
    ra = gl.arange(0, 16, layout=gl.SliceLayout(1, a_l))
    ca = gl.arange(0, D, layout=gl.SliceLayout(0, a_l))
    qa = gl.load(Q + b * stride_qb + (q_head0 + ra)[:, None] * stride_qh + ca[None, :],
                 mask=((ra < real_rows) & (ra < ROWS))[:, None] & (ca < DR)[None, :], other=0.0).to(gl.float32)
    cqa = gl.exp2(-1.0 - gl.floor(gl.log2(gl.maximum(gl.max(gl.abs(qa), axis=1), 1e-30))))
    qza = (qa * cqa[:, None]).to(gl.float16)
    zmul = gl.convert_layout(qk_scale / cqa, gl.SliceLayout(1, mma))
    return qn16, qza, mul, zmul


@gluon.jit
def key_group16(query, chan, head_q, stride_ksh, KSg, KZg, H: gl.constexpr, D: gl.constexpr, ROWS: gl.constexpr,
                Q_PER_KV: gl.constexpr, SWAP: gl.constexpr, CH: gl.constexpr, CHR: gl.constexpr, DR: gl.constexpr):
    """One channel-wise K group with fp16 scales (operand-fold, eq. 4, 6): each head's scales s times a power
    of two 2^-e putting the largest in [1, 2) (e clamped to [-15, 15]), Q' = Q'n x (s x 2^-e) in fp16 (finite:
    |Q'n| < 1); the logits' map t = acc x mul + add with mul = key_query16's factor x 2^e and
    add = qk_scale x sum(q x zero) from one MMA, C[r, n] = sum_c Qz[r, c] z[c] of head n % H, each query row
    keeping a column of its own head (``query``: key_query16's)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    row_l: gl.constexpr = gl.SliceLayout(0, mma)
    qn16, qza, mul, zmul = query
    sk = channel_param16(KSg, chan, head_q, stride_ksh, D, ROWS, H, SWAP, CH, CHR)
    top = gl.max(gl.abs(sk), axis=0).to(gl.float32).to(gl.int32, bitcast=True)   # zero, subnormal: e = -15
    e = gl.minimum(gl.maximum(((top >> 23) & 255) - 127, -15), 15)
    down = ((127 - e) << 23).to(gl.float32, bitcast=True).to(gl.float16)   # 2^-e, exact in fp16
    up = ((127 + e) << 23).to(gl.float32, bitcast=True)
    q16 = qn16 * (sk * down[None, :])
    cz = gl.arange(0, D, layout=gl.SliceLayout(1, b_l))
    nz = gl.arange(0, 8, layout=gl.SliceLayout(0, b_l))
    zb = gl.load(KZg + (nz % H)[None, :] * stride_ksh + cz[:, None], mask=(cz < DR)[:, None], other=0.0)
    c = mma_v2(qza, zb, gl.zeros([16, 8], gl.float32, layout=mma))
    rm = gl.arange(0, 16, layout=gl.SliceLayout(1, mma))
    nm = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
    mine = (nm % H)[None, :] == gl.minimum(rm // Q_PER_KV, H - 1)[:, None]
    v = gl.max(gl.where(mine, c, float("-inf")), axis=1) * zmul   # [16]: the rows past ROWS are zero
    if ROWS == 16:
        add = gl.convert_layout(v, row_l)
    else:
        add = gl.convert_layout(gl.sum(gl.reshape(v, [16 // ROWS, ROWS]), axis=0), row_l)
    return q16, mul * gl.convert_layout(up, row_l), add


@gluon.jit
def key_tile_params16(query, chan, head_q, stride_ksh, KSp, KZp, stride_ksn, n0, end, H: gl.constexpr,
                      D: gl.constexpr, ROWS: gl.constexpr, Q_PER_KV: gl.constexpr, SWAP: gl.constexpr,
                      CH: gl.constexpr, CHR: gl.constexpr, DR: gl.constexpr, KEY_G: gl.constexpr, BN: gl.constexpr):
    """key_tile_params by key_group16: the group holding token n0, or with groups of half a tile both groups'
    (q16, mul, add) as pairs."""
    g = n0 // KEY_G
    first = key_group16(query, chan, head_q, stride_ksh, KSp + g * stride_ksn, KZp + g * stride_ksn, H, D, ROWS,
                        Q_PER_KV, SWAP, CH, CHR, DR)
    if KEY_G < BN:
        g2 = gl.maximum(gl.minimum(g + 1, (end - 1) // KEY_G), g)
        second = key_group16(query, chan, head_q, stride_ksh, KSp + g2 * stride_ksn, KZp + g2 * stride_ksn, H, D,
                             ROWS, Q_PER_KV, SWAP, CH, CHR, DR)
        out = (first[0], second[0]), (first[1], second[1]), (first[2], second[2])
    else:
        out = first
    return out
