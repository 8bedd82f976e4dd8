"""Key side of one tile of the register-operand decode kernel (kernel.py): the logits S^T = K'.Q'^T of a tile's
tokens for the program's query rows, scaled per group and corrected by ``zero x sum(q)`` before the softmax
(eq. 3, 6, 7, 8); plain, folded, two-groups-a-tile and dequant key sides.

Import this module only where Triton runs natively (not under TRITON_INTERPRET=1).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from foldc.backends.gluon.tile_memory import PLAIN_VIEW, words_per_token
from foldc.backends.gluon.tile_dequant import KEY_E_HI, KEY_E_LO, KEY_TOP, key_token_dequant, pow2, token_exponent
from foldc.backends.gluon.tile_groups import PIECE_C, piece_slot, rebuild_rows
from foldc.backends.gluon.tile_operands import (group_mmas, join_groups, key_operand, key_words_layout, per_row,
                                                select_groups, split_groups, zeros_groups)


@gluon.jit
def tile_scores(n0, end, k_smem, slot, ks, kz, tm, head_c, q16, q_bias, q_sum, row_scale, BN: gl.constexpr,
                D: gl.constexpr, F: gl.constexpr, ROWS: gl.constexpr, H: gl.constexpr, KEY_G: gl.constexpr,
                KASM: gl.constexpr, KCONS: gl.constexpr, MASKED: gl.constexpr,
                KEY_NG: gl.constexpr, KDQ: gl.constexpr, KMG: gl.constexpr = False, DRK: gl.constexpr = 0,
                PDT: gl.constexpr = gl.bfloat16):
    """Key side of one tile: the logits t [BN tokens, ROWS] (log2 units), -inf past ``end``. F == 0:
    a plain key side in the queries' dtype PDT (its words are pairs, read from shared memory as the MMA
    operand).
    KDQ: a dequant plan (tile_dequant.py; one KV head per program). KMG: the KEY_NG groups cross a
    padded head_dim's bit fields: one MMA per group over all of K, the other groups' channels masked
    to zero (each packed head's keys in turn). DRK: the real head_dim (a padded one's groups follow the
    cache's channels)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    W: gl.constexpr = words_per_token(D, F)
    kw_l: gl.constexpr = key_words_layout(BN, W)
    if F == 0:
        # plain keys: S^T = K.Q^T in PDT, the logits' scale on the rows (no fold, no correction); the
        # operands in the k_width=2 layout ldmatrix loads (q16 is in it, kernel prologue)
        a2_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        sacc = gl.zeros([BN, ROWS], gl.float32, layout=mma)
        for i in gl.static_range(H):
            ka = k_smem.index(slot + i)._reinterpret(PDT, [BN, D], PLAIN_VIEW).load(a2_l)
            if H == 1:
                sacc = mma_v2(ka, q16, sacc)
            else:
                sacc = gl.where((head_c == i)[None, :], mma_v2(ka, q16, gl.zeros([BN, ROWS], gl.float32, layout=mma)),
                                sacc)
        t = sacc * row_scale[None, :]
    elif KDQ:
        # dequant (eq. 12's verdict): each key rebuilt in fp16 as code x scale + zero times 2^e, a plain
        # MMA against the query, 2^-e on the scores; no correction (eq. 1)
        gl.static_assert(H == 1, "dequant plans take one KV head per program")
        kw = k_smem.index(slot).load(kw_l)
        ka = gl.convert_layout(key_operand(kw, BN, D, F, KASM, KCONS), a_l, assert_trivial=True)
        if KEY_G == 0:
            e = token_exponent(ks, kz, 8 // F, KEY_NG, KEY_E_LO, KEY_E_HI, KEY_TOP)
            kd = key_token_dequant(ka, ks, kz, e, a_l, D, F, KEY_NG, DRK)
            sacc = mma_v2(kd, q16, gl.zeros([BN, ROWS], gl.float32, layout=mma))
            t = (sacc * row_scale[None, :]) * pow2(-e)[:, None]
        elif KEY_G >= BN:   # channel-wise: q_bias is the group's (a, b) per k, q_sum the logits' factor per row
            sacc = mma_v2(rebuild_rows(ka, q_bias[0], q_bias[1]), q16, gl.zeros([BN, ROWS], gl.float32, layout=mma))
            t = sacc * q_sum[None, :]
        else:   # two groups per tile: each half of the tile's tokens (a register bit of M) rebuilt with its own
            halves = split_groups(ka, 2, 0)
            k0 = rebuild_rows(gl.convert_layout(halves[0], a_l, assert_trivial=True), q_bias[0][0], q_bias[0][1])
            k1 = rebuild_rows(gl.convert_layout(halves[1], a_l, assert_trivial=True), q_bias[1][0], q_bias[1][1])
            t0 = mma_v2(k0, q16[0], gl.zeros([BN // 2, ROWS], gl.float32, layout=mma)) * q_sum[0][None, :]
            t1 = mma_v2(k1, q16[0], gl.zeros([BN // 2, ROWS], gl.float32, layout=mma)) * q_sum[1][None, :]
            t = gl.convert_layout(join_groups((t0, t1), 2), mma, assert_trivial=True)
    elif KEY_G > 0 and KEY_G < BN:
        # channel-wise K in groups of half a tile (operand-fold, eq. 4): each half of the tile's tokens (token
        # bit 4, a register bit of the MMA's M) against the query pre-scaled by its own group's scales
        s0 = gl.zeros([BN // 2, ROWS], gl.float32, layout=mma)
        s1 = gl.zeros([BN // 2, ROWS], gl.float32, layout=mma)
        for i in gl.static_range(H):
            kw = k_smem.index(slot + i).load(kw_l)
            halves = split_groups(key_operand(kw, BN, D, F, KASM, KCONS), 2, 0)
            h0 = mma_v2(gl.convert_layout(halves[0], a_l, assert_trivial=True), q16[0],
                        gl.zeros([BN // 2, ROWS], gl.float32, layout=mma))
            h1 = mma_v2(gl.convert_layout(halves[1], a_l, assert_trivial=True), q16[1],
                        gl.zeros([BN // 2, ROWS], gl.float32, layout=mma))
            if H == 1:
                s0 = h0
                s1 = h1
            else:
                s0 = gl.where((head_c == i)[None, :], h0, s0)
                s1 = gl.where((head_c == i)[None, :], h1, s1)
        t = gl.convert_layout(join_groups((s0 * q_bias[0][None, :] + q_sum[0][None, :],
                                           s1 * q_bias[1][None, :] + q_sum[1][None, :]), 2), mma, assert_trivial=True)
    elif KEY_NG > 1 and KMG:
        # token-wise K in groups across the padded bit fields: the keys cut into pieces of PIECE k indices, each
        # piece's MMA into the accumulator of each group it meets, against the query piece with the other groups'
        # channels zero (q16[piece][slot], made once before the loop; the codes carry no bias); a piece of padding
        # alone takes no MMA; scaled per group before the groups meet (eq. 3, 6)
        NP: gl.constexpr = D // PIECE_C
        heads_parts = ()
        for i in gl.static_range(H):   # each packed head's key operand, cut into pieces once
            kw = k_smem.index(slot + i).load(kw_l)
            heads_parts = heads_parts + (split_groups(key_operand(kw, BN, D, F, KASM, KCONS), NP, 1),)
        acc = gl.zeros([BN, ROWS], gl.float32, layout=mma)
        for g in gl.static_range(KEY_NG):
            accg = gl.zeros([BN, ROWS], gl.float32, layout=mma)
            for h in gl.static_range(H):   # head h's keys against every row, kept in the rows of head h
                acch = gl.zeros([BN, ROWS], gl.float32, layout=mma)
                for i in gl.static_range(NP):
                    if piece_slot(0, i, g, F, D, DRK, KEY_NG) >= 0:
                        acch = mma_v2(gl.convert_layout(heads_parts[h][i], a_l, assert_trivial=True),
                                      gl.convert_layout(q16[i][piece_slot(0, i, g, F, D, DRK, KEY_NG)], b_l,
                                                        assert_trivial=True), acch)
                if H == 1:
                    accg = acch
                else:
                    accg = gl.where((head_c == h)[None, :], acch, accg)
            acc = acc + per_row(ks[g], H) * accg
        off = per_row(kz[0], H) * q_sum[0][None, :]
        for g in gl.static_range(1, KEY_NG):
            off = off + per_row(kz[g], H) * q_sum[g][None, :]
        t = acc * row_scale[None, :] + off
    elif KEY_NG > 1:
        # token-wise K in KEY_NG channel groups: one accumulator per group (q16 and q_sum are tuples
        # of the groups' pieces), each scaled by its group's scale before the groups meet (eq. 3, 6)
        sacc = zeros_groups([BN, ROWS], mma, KEY_NG)
        for i in gl.static_range(H):
            kw = k_smem.index(slot + i).load(kw_l)
            parts = group_mmas(split_groups(key_operand(kw, BN, D, F, KASM, KCONS), KEY_NG, 1), q16,
                               zeros_groups([BN, ROWS], mma, KEY_NG), a_l, b_l, KEY_NG)
            if H == 1:
                sacc = parts
            else:
                sacc = select_groups((head_c == i)[None, :], parts, sacc, KEY_NG)
        acc = per_row(ks[0], H) * sacc[0]
        off = per_row(kz[0], H) * q_sum[0][None, :]
        for g in gl.static_range(1, KEY_NG):
            acc = acc + per_row(ks[g], H) * sacc[g]
            off = off + per_row(kz[g], H) * q_sum[g][None, :]
        t = acc * row_scale[None, :] + off
    else:
        # scores of every packed head: head i's keys against all query rows, kept in the rows of head i
        sacc = gl.zeros([BN, ROWS], gl.float32, layout=mma)
        for i in gl.static_range(H):
            kw = k_smem.index(slot + i).load(kw_l)
            ka = gl.convert_layout(key_operand(kw, BN, D, F, KASM, KCONS), a_l, assert_trivial=True)
            if H == 1:
                sacc = mma_v2(ka, q16, sacc)
            else:
                sacc = gl.where((head_c == i)[None, :], mma_v2(ka, q16, gl.zeros([BN, ROWS], gl.float32, layout=mma)),
                                sacc)
        if KEY_G == 0:
            ks2 = per_row(ks, H)
            kz2 = per_row(kz, H)
            # acc-fold, one scale per token (row of M); bias and zero through sum(q') and sum(q) (eq. 3, 6, 7)
            # (subnormal codes: no bias to remove, row_scale carries 2^KEY_EXP)
            t = ks2 * (sacc * row_scale[None, :]) + kz2 * q_sum[None, :]
        else:
            # operand-fold: q16 was pre-scaled by this group's channel scales (and its own power of two);
            # here q_bias is that group's scale back to logits and q_sum its offset: the bias removed and
            # sum(q x zero) added (eq. 4, 6, 7), see key_group
            t = sacc * q_bias[None, :] + q_sum[None, :]
    if MASKED:
        t = gl.where((n0 + tm < end)[:, None], t, float("-inf"))
    return t
