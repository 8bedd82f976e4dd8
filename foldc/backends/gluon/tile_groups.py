"""The per-group parameters of the register-operand kernel's tiles (kernel.py): the query read from
memory, a channel-wise group's query operand and logits' map (key side) or scales and zeros (value
side), folded (tile_operands.key_group, value_group) or for a dequant plan (tile_dequant.py), the two
groups of a tile of channel-wise groups of 16 tokens, and the masked per-group sums of groups that
cross a padded head_dim's bit fields.

Import this module only where Triton runs natively (not under TRITON_INTERPRET=1).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from foldc.backends.gluon.operands import VALUE_EXPONENT
from foldc.backends.gluon.tile_dequant import key_group_dequant, rebuild, value_group_dequant
from foldc.backends.gluon.tile_operands import key_group, swap_k01, value_group


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
    s0 = gl.convert_layout(gl.sum(gl.where((grp == 0)[:, None], qv, 0.0), axis=0) * scale, layout)
    s1 = gl.convert_layout(gl.sum(gl.where((grp == 1)[:, None], qv, 0.0), axis=0) * scale, layout)
    if NG == 2:
        out = (s0, s1)
    elif NG == 3:
        out = (s0, s1, gl.convert_layout(gl.sum(gl.where((grp == 2)[:, None], qv, 0.0), axis=0) * scale, layout))
    else:
        out = (s0, s1, gl.convert_layout(gl.sum(gl.where((grp == 2)[:, None], qv, 0.0), axis=0) * scale, layout),
               gl.convert_layout(gl.sum(gl.where((grp == 3)[:, None], qv, 0.0), axis=0) * scale, layout))
    return out


@gluon.jit
def _only(q16, grp, g):
    return gl.where((grp == g)[:, None], q16, gl.zeros_like(q16))


@gluon.jit
def masked_query(q16, grp, NG: gl.constexpr):
    """Per group g (grp: each channel's group), the query operand with the other groups' channels
    zero: a tuple of NG, made once before the token loop (the keys then need no mask)."""
    if NG == 2:
        out = (_only(q16, grp, 0), _only(q16, grp, 1))
    elif NG == 3:
        out = (_only(q16, grp, 0), _only(q16, grp, 1), _only(q16, grp, 2))
    else:
        out = (_only(q16, grp, 0), _only(q16, grp, 1), _only(q16, grp, 2), _only(q16, grp, 3))
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
