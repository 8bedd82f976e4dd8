"""Value side of one tile of the register-operand decode kernel (kernel.py): the online softmax of a tile's
logits and O^T += V'^T.(P x s)^T with its ``sum(P x zero)`` correction, before the final division (eq. 4, 6, 9);
plain, folded, channel-wise and dequant value sides, and the packed heads' P.

Import this module only where Triton runs natively (not under TRITON_INTERPRET=1).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from foldc.backends.gluon.tile_memory import PLAIN_VIEW, words_per_token
from foldc.backends.gluon.tile_dequant import (VALUE_E_HI, VALUE_E_LO, VALUE_TOP, channel_group, dequant_exponent,
                                               pow2, rebuild, token_exponent, value_fields, value_token_dequant)
from foldc.backends.gluon.tile_groups import PIECE_C, piece_count, piece_group, value_weights
from foldc.backends.gluon.tile_operands import (group_mmas, join_field_groups, join_groups, load_value_words,
                                                per_channel, per_channel16, per_row, scaled_p, split_field_groups,
                                                split_groups, value_operand, zeros_groups)

#: token-wise folded values: the tile's largest |scale| x 2^e lies in [2^14, 2^15), so P x scale x 2^e (P <= 1 at the
#: running maximum) stays below fp16's 65504 and away from its subnormals (below 2^-14)
VALUE_UNIT_TOP: gl.constexpr = gl.constexpr(14)


@gluon.jit
def consume_values(t, v_smem, slot, vs, vz, m_i, l_i, zsum, acc_o, head_b, v_scale, v_zero, BN: gl.constexpr,
                   D: gl.constexpr, F: gl.constexpr, ROWS: gl.constexpr, H: gl.constexpr, VAL_G: gl.constexpr,
                   VA0: gl.constexpr, VA1: gl.constexpr, VA2: gl.constexpr, VA3: gl.constexpr, VCONS: gl.constexpr,
                   AND_P: gl.constexpr, VAL_NG: gl.constexpr, VDQ: gl.constexpr, LEAN: gl.constexpr = False,
                   VMG: gl.constexpr = False, DRV: gl.constexpr = 0, PDT: gl.constexpr = gl.bfloat16):
    """Online softmax of one tile's logits ``t`` and its value side into (offset, denominator, zero sum, O^T): the
    offset is the running maximum of the logits, lowered by `value_unit`'s e with token-wise folded values.
    VDQ: a dequant plan (tile_dequant.py; one KV head per program). LEAN: channel-wise V's group
    parameters held 16-bit (both sides channel-wise past 128 channels, `value_params`). VMG, DRV: as
    tile_scores' KMG, DRK.
    ``AND_P``: mask each packed head's P by an AND per register instead of a select per half. With
    VAL_NG channel groups per token (token-wise V), vs, vz and zsum are tuples of VAL_NG."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    W: gl.constexpr = words_per_token(D, F)
    if F > 0 and not VDQ and VAL_G == 0:
        # token-wise folded values: P at 2^e, the running offset m_i taken e below the largest logit, so that the
        # tile's P x scale (its fp16 MMA operand) lies below 2^15 with its largest near 2^14 at any scale; the
        # denominator, the zero sums and O^T share the unit, which the final division cancels (as the merge of
        # splits, whose offsets are these)
        m_new = gl.maximum(m_i, gl.max(t, axis=0) - value_unit(vs, H, VAL_NG))
    else:
        m_new = gl.maximum(m_i, gl.max(t, axis=0))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(t - m_new[None, :])
    p_sum = gl.sum(p, axis=0)
    l_i = l_i * alpha + p_sum
    if F == 0:
        # plain values (in the queries' dtype PDT): O^T += V^T.P^T, V^T read from shared memory as the MMA operand
        pb = gl.convert_layout(p.to(PDT), b_l)
        pv = gl.zeros([D, ROWS], gl.float32, layout=mma)
        for i in gl.static_range(H):
            va = v_smem.index(slot + i)._reinterpret(PDT, [BN, D], PLAIN_VIEW).permute((1, 0)).load(a_l)
            pv = mma_v2(va, _head_p(pb, head_b, i, b_l, H, False), pv)
        acc_o = acc_o * alpha[None, :] + pv
    elif VDQ:
        # dequant: each value rebuilt in fp16 times 2^e, P times 2^-e, a plain MMA; no correction (eq. 1)
        gl.static_assert(H == 1, "dequant plans take one KV head per program")
        if VAL_G == 0:   # 2^e per token
            e = token_exponent(vs, vz, 8 // F, VAL_NG, VALUE_E_LO, VALUE_E_HI, VALUE_TOP)
            pb = gl.convert_layout((p * pow2(-e)[:, None]).to(gl.float16), b_l)
        elif VAL_G >= BN:   # one 2^e per group: v_zero holds its 2^-e
            pb = gl.convert_layout((p * v_zero).to(gl.float16), b_l)
        else:               # two groups per tile: each half of the tokens takes its group's 2^-e
            first = (gl.arange(0, BN, layout=gl.SliceLayout(1, mma)) < VAL_G)[:, None]
            pb = gl.convert_layout((p * gl.where(first, v_zero[0], v_zero[1])).to(gl.float16), b_l)
        vw = load_value_words(v_smem.index(slot), BN, W)
        va = gl.convert_layout(value_operand(vw, BN, D, F, VA0, VA1, VA2, VA3, VCONS), a_l, assert_trivial=True)
        rows_l: gl.constexpr = gl.SliceLayout(1, a_l)
        if VAL_G == 0:
            vd = value_token_dequant(va, vs, vz, e, a_l, D, F, VAL_NG, DRV)
        elif VAL_G >= BN:   # v_scale: the group's (a, b) per output row
            a, _ = gl.broadcast(gl.convert_layout(v_scale[0], rows_l)[:, None], va)
            b, _ = gl.broadcast(gl.convert_layout(v_scale[1], rows_l)[:, None], va)
            vd = rebuild(va, a, b)
        else:               # two groups per tile: the tokens (K) of each half take their group's (a, b)
            first_k = (gl.arange(0, BN, layout=gl.SliceLayout(0, a_l)) < VAL_G)[None, :]
            a = gl.where(first_k, gl.convert_layout(v_scale[0][0], rows_l)[:, None],
                         gl.convert_layout(v_scale[1][0], rows_l)[:, None])
            b = gl.where(first_k, gl.convert_layout(v_scale[0][1], rows_l)[:, None],
                         gl.convert_layout(v_scale[1][1], rows_l)[:, None])
            vd = rebuild(va, a, b)
        pv = mma_v2(vd, pb, gl.zeros([D, ROWS], gl.float32, layout=mma))
        acc_o = acc_o * alpha[None, :] + pv
    elif VAL_NG > 1 and VMG:
        # token-wise V in groups across the padded bit fields: the values cut into pieces of PIECE output rows,
        # each piece's product with P scaled by each group it meets, kept in the rows of that group's channels
        # (eq. 4, 6); a piece of padding rows alone (never stored) takes no MMA
        NP: gl.constexpr = D // PIECE_C
        pbs, zsum = scaled_p(p, vs, vz, zsum, alpha, b_l, H, VAL_NG)
        pieces = ()
        for i in gl.static_range(NP):
            pieces = pieces + (gl.zeros([PIECE_C, ROWS], gl.float32, layout=mma),)
        for h in gl.static_range(H):   # head h's values against its own rows' P (other heads' columns zero)
            vw = load_value_words(v_smem.index(slot + h), BN, W)
            va = split_groups(value_operand(vw, BN, D, F, VA0, VA1, VA2, VA3, VCONS), NP, 0)
            summed = ()
            for i in gl.static_range(NP):
                prev = pieces[i]
                if piece_count(1, i, F, D, DRV, VAL_NG) == 0:
                    pv_i = prev
                else:
                    a_i = gl.convert_layout(va[i], a_l, assert_trivial=True)
                    pv_i = mma_v2(a_i, _head_p(pbs[piece_group(1, i, 0, F, D, DRV, VAL_NG)], head_b, h, b_l, H, AND_P),
                                  prev)
                    if piece_count(1, i, F, D, DRV, VAL_NG) > 1:
                        field, chan = value_fields(PIECE_C * i + gl.arange(0, PIECE_C, layout=gl.SliceLayout(1, mma)),
                                                   D, D // F)
                        grp = channel_group(field, chan, D, F, VAL_NG, DRV)
                        for j in gl.static_range(1, piece_count(1, i, F, D, DRV, VAL_NG)):
                            pv_i = gl.where((grp == piece_group(1, i, j, F, D, DRV, VAL_NG))[:, None],
                                            mma_v2(a_i, _head_p(pbs[piece_group(1, i, j, F, D, DRV, VAL_NG)], head_b, h,
                                                                b_l, H, AND_P), prev), pv_i)
                summed = summed + (pv_i,)
            pieces = summed
        pv = gl.convert_layout(join_groups(pieces, NP), mma, assert_trivial=True)
        acc_o = acc_o * alpha[None, :] + pv
    elif VAL_NG > 1:
        # operand-fold per channel group: group g's output channels (a range of O^T's rows) take P
        # scaled by group g's scales (eq. 4, 6)
        pbs, zsum = scaled_p(p, vs, vz, zsum, alpha, b_l, H, VAL_NG)
        pv = zeros_groups([D // VAL_NG, ROWS], mma, VAL_NG)
        for i in gl.static_range(H):
            vw = load_value_words(v_smem.index(slot + i), BN, W)
            va = value_operand(vw, BN, D, F, VA0, VA1, VA2, VA3, VCONS)
            if D // VAL_NG < D // F:   # groups smaller than a bit field
                va_parts = split_field_groups(va, F, W, VAL_NG)
            else:                      # groups of whole fields: consecutive rows
                va_parts = split_groups(va, VAL_NG, 0)
            pv = group_mmas(va_parts, _head_ps(pbs, head_b, i, b_l, H, AND_P, VAL_NG), pv, a_l, b_l, VAL_NG)
        if D // VAL_NG < D // F:
            pv_all = join_field_groups(pv, F, W, VAL_NG)
        else:
            pv_all = join_groups(pv, VAL_NG)
        acc_o = acc_o * alpha[None, :] + gl.convert_layout(pv_all, mma, assert_trivial=True)
    elif VAL_G == 0:
        vs2 = per_row(vs, H)
        vz2 = per_row(vz, H)
        # operand-fold: P x scale before the product; sum(P x zero) beside it (eq. 4, 6)
        pb = gl.convert_layout((p * vs2).to(gl.float16), b_l)
        zsum = zsum * alpha + gl.sum(p * vz2, axis=0)
    else:
        pb = gl.convert_layout(p.to(gl.float16), b_l)
    if VAL_NG == 1 and F > 0 and not VDQ and (VAL_G == 0 or VAL_G >= BN):
        # a fresh accumulator per tile: the tensor core's own running sum over many tiles loses low bits;
        # head i's values meet only the columns (query rows) of head i
        pv = gl.zeros([D, ROWS], gl.float32, layout=mma)
        for i in gl.static_range(H):
            vw = load_value_words(v_smem.index(slot + i), BN, W)
            va = gl.convert_layout(value_operand(vw, BN, D, F, VA0, VA1, VA2, VA3, VCONS), a_l, assert_trivial=True)
            pv = mma_v2(va, _head_p(pb, head_b, i, b_l, H, AND_P), pv)
        if VAL_G == 0:
            acc_o = acc_o * alpha[None, :] + pv
        else:
            # acc-fold: this tile lies in one token group; scale the tile's sum per channel, add zero x sum(P)
            w = value_weights(D, F)
            acc_o = acc_o * alpha[None, :] + pv * _channel_scale(v_scale, H, w, LEAN) + \
                _channel_zero(v_zero, H, LEAN) * p_sum[None, :]
    elif F > 0 and not VDQ and VAL_G > 0:
        # channel-wise V in groups of half a tile (acc-fold, eq. 3): one product per group, P zeroed past
        # (or before) its tokens, each scaled per channel by its own group's scale with its zero x sum(P)
        first = (gl.arange(0, BN, layout=gl.SliceLayout(1, b_l)) < VAL_G)[:, None]
        p0 = gl.where(first, pb, gl.zeros_like(pb))
        p1 = gl.where(first, gl.zeros_like(pb), pb)
        pv0 = gl.zeros([D, ROWS], gl.float32, layout=mma)
        pv1 = gl.zeros([D, ROWS], gl.float32, layout=mma)
        for i in gl.static_range(H):
            vw = load_value_words(v_smem.index(slot + i), BN, W)
            va = gl.convert_layout(value_operand(vw, BN, D, F, VA0, VA1, VA2, VA3, VCONS), a_l, assert_trivial=True)
            pv0 = mma_v2(va, _head_p(p0, head_b, i, b_l, H, AND_P), pv0)
            pv1 = mma_v2(va, _head_p(p1, head_b, i, b_l, H, AND_P), pv1)
        s0 = gl.sum(gl.where((gl.arange(0, BN, layout=gl.SliceLayout(1, mma)) < VAL_G)[:, None], p, 0.0), axis=0)
        w = value_weights(D, F)
        acc_o = (acc_o * alpha[None, :] + pv0 * _channel_scale(v_scale[0], H, w, LEAN) +
                 _channel_zero(v_zero[0], H, LEAN) * s0[None, :] + pv1 * _channel_scale(v_scale[1], H, w, LEAN) +
                 _channel_zero(v_zero[1], H, LEAN) * (p_sum - s0)[None, :])
    return m_new, l_i, zsum, acc_o


@gluon.jit
def value_unit(vs, H: gl.constexpr, NG: gl.constexpr):
    """e per query row (float32, integers in [-64, 64]; a scalar with one head a program) with the tile's largest
    |scale| of token-wise values x 2^e in [2^VALUE_UNIT_TOP, 2^(VALUE_UNIT_TOP + 1)) (vs: [BN], [BN, ROWS] with
    packed heads, or tuples of NG): the largest over tokens and groups, in the scales' own dtype."""
    if NG == 1:
        top = gl.abs(vs)
    else:
        top = gl.abs(vs[0])
        for g in gl.static_range(1, NG):
            top = gl.maximum(top, gl.abs(vs[g]))
    return dequant_exponent(gl.max(top, axis=0).to(gl.float32), -64, 64, VALUE_UNIT_TOP).to(gl.float32)


@gluon.jit
def _channel_scale(v_scale, H: gl.constexpr, weight, LEAN: gl.constexpr):
    """A channel-wise V group's scale per output row in float32, as the acc-fold applies it: LEAN, the 16-bit
    scale of value_group's KEEP16 times the field weights ``weight`` (value_weights); else value_group's float32
    scale (the weights in it already, ``weight`` unused)."""
    if LEAN:
        out = per_channel16(v_scale, H, weight)
    else:
        out = per_channel(v_scale, H)
    return out


@gluon.jit
def _channel_zero(v_zero, H: gl.constexpr, LEAN: gl.constexpr):
    """A channel-wise V group's zero per output row in float32 (16-bit where LEAN, as _channel_scale)."""
    if LEAN:
        out = per_channel16(v_zero, H)
    else:
        out = per_channel(v_zero, H)
    return out


@gluon.jit
def _head_p(pb, head_b, i, b_l: gl.constexpr, H: gl.constexpr, AND_P: gl.constexpr):
    """P as packed head i's value MMA sees it: the other heads' columns (query rows) zeroed."""
    if H == 1:
        out = pb
    elif not AND_P:
        out = gl.where((head_b == i)[None, :], pb, gl.zeros_like(pb))
    else:
        # a lane's pair of P (two tokens of one column, one query row) is one head's: kept or
        # zeroed by one AND per register (a select per half took a SEL and two PRMTs)
        keep = gl.where((head_b == i)[None, :], gl.full(pb.shape, -1, gl.int16, layout=b_l),
                        gl.zeros(pb.shape, gl.int16, layout=b_l))
        out = gl.inline_asm_elementwise("and.b32 $0, $1, $2;", "=r,r,r", [pb, keep], dtype=gl.float16, is_pure=True,
                                        pack=2)
    return out


@gluon.jit
def _head_ps(pbs, head_b, i, b_l: gl.constexpr, H: gl.constexpr, AND_P: gl.constexpr, NG: gl.constexpr):
    """_head_p of each group's P (a tuple of NG)."""
    if NG == 8:
        lo = _head_ps((pbs[0], pbs[1], pbs[2], pbs[3]), head_b, i, b_l, H, AND_P, 4)
        hi = _head_ps((pbs[4], pbs[5], pbs[6], pbs[7]), head_b, i, b_l, H, AND_P, 4)
        out = (lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3])
    elif NG == 2:
        out = (_head_p(pbs[0], head_b, i, b_l, H, AND_P), _head_p(pbs[1], head_b, i, b_l, H, AND_P))
    else:
        out = (_head_p(pbs[0], head_b, i, b_l, H, AND_P), _head_p(pbs[1], head_b, i, b_l, H, AND_P),
               _head_p(pbs[2], head_b, i, b_l, H, AND_P), _head_p(pbs[3], head_b, i, b_l, H, AND_P))
    return out
