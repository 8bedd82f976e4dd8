"""The per-group parameters of the register-operand kernel's tiles (kernel.py): the query read from
memory, a channel-wise group's query operand and logits' map (key side) or scales and zeros (value
side), folded (tile_operands.key_group, value_group) or for a dequant plan (tile_dequant.py), the two
groups of a tile of channel-wise groups of 16 tokens, and for groups that cross a padded head_dim's bit
fields the per-group sums of the query and its pieces (operands.piece_groups: which groups a piece meets).

Import this module only where Triton runs natively (not under TRITON_INTERPRET=1).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl

from foldc.backends.gluon.operands import PIECE, VALUE_EXPONENT, piece_groups
from foldc.backends.gluon.tile_dequant import key_group_dequant, rebuild, value_group_dequant
from foldc.backends.gluon.tile_operands import key_group, split_groups, swap_k01, value_group


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
