"""The register-operand decode kernel (Gluon, sm_90): codes go from 32-bit words to tensor-core
operands in registers, two codes per LOP3, with no per-value scale or zero.

One program = one warp = one (batch, H packed kv_heads, split). Per tile of BN tokens:
  key side   S^T = K'.Q'^T       M = tokens, N = query rows, K = channels    (eq. 3, 8)
             t = s_tok * S^T * 2^24 / c + z_tok * sum(q)                        (eq. 6, 7)
  softmax    online, per query row (log2 units)                                (eq. 9)
  value side O^T += V'^T.(P * s_tok)^T  M = channels, N = rows, K = tokens       (eq. 4)
             plus sum(P * z_tok) per row                                         (eq. 6)
The codes of both sides enter the MMA as fp16 subnormals (code x 2^-24, exact; operands.py): the
key side's 2^24 rides on the logits' scale, the value side's is undone per output row at the end
(a plan with the OR trick's key bias 1024 subtracts 1024 x sum(q') from S^T instead). The code
words travel global -> shared memory by cp.async, STAGES tiles ahead; token-wise scales and zeros
are loaded at each tile's start (SCALE_AHEAD=False; with PREFETCH the next tile's go to L2 first)
or one tile ahead in registers (SCALE_AHEAD=True). Each split writes (max, denominator,
accumulator) for the merge kernel (eq. 14), the same workspace the Triton backend uses. The channel and row maps of
the operands are in operands.py.

Import this module only where Triton runs natively (not under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import math

from triton.experimental import gluon
from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

LANES_KEY = [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]
LANES_VALUE = [[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]]


@constexpr_function
def key_words_layout(BN, W):
    """Key words [BN tokens, W words]: words 2t, 2t+1 of rows g, g+8 per lane (the k_width=8 A operand)."""
    BN, W = int(BN), int(W)
    reg = [[0, 1], [8, 0]] + [[0, 8 << i] for i in range(int(math.log2(W // 8)))] + \
        [[16 << i, 0] for i in range(int(math.log2(BN // 16)))]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=LANES_KEY, warp_bases=[], block_bases=[],
                                      shape=[BN, W])


@constexpr_function
def value_words_layout(BN, W):
    """Value words [W words, BN tokens]: four consecutive tokens of one word in consecutive registers."""
    BN, W = int(BN), int(W)
    reg = [[0, 1], [0, 2], [0, 4]] + [[0, 32 << i] for i in range(int(math.log2(BN // 32)))] + \
        [[8 << i, 0] for i in range(int(math.log2(W // 8)))]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=LANES_VALUE, warp_bases=[], block_bases=[],
                                      shape=[W, BN])


@constexpr_function
def copy_layout(BN, W):
    """cp.async of a [BN, W] word tile: 16 bytes per lane."""
    BN, W = int(BN), int(W)
    return gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[32 // (W // 4), W // 4], warps_per_cta=[1, 1],
                            order=[1, 0])


@gluon.jit
def _join4(x0, x1, x2, x3):
    # [..., 2, 2] whose element [..., u, v] is x_(2u+v)
    return gl.join(gl.join(x0, x2), gl.join(x1, x3))


@gluon.jit
def _pairs(x0, x1, BN: gl.constexpr, NB: gl.constexpr):
    # x_p[t, w, e] holds byte 4w + p + 2e; k = 4w + 2p + e keeps each unpacked register one k pair
    return gl.reshape(gl.permute(gl.join(x0, x1), (0, 1, 3, 2)), [BN, NB])


@gluon.jit
def _key_operand(kw, BN: gl.constexpr, D: gl.constexpr, F: gl.constexpr, ASM: gl.constexpr, CONS: gl.constexpr):
    NB: gl.constexpr = D // F
    x = gl.join(kw, kw)
    if F == 4:
        a0, a1, b0, b1, c0, c1, d0, d1 = gl.inline_asm_elementwise(
            ASM, CONS, [x], dtype=(gl.float16,) * 8, is_pure=True, pack=2)
        op = _join4(_pairs(a0, a1, BN, NB), _pairs(b0, b1, BN, NB), _pairs(c0, c1, BN, NB), _pairs(d0, d1, BN, NB))
        op = gl.reshape(gl.permute(op, (0, 2, 3, 1)), [BN, D])
    else:
        a0, a1, b0, b1 = gl.inline_asm_elementwise(ASM, CONS, [x], dtype=(gl.float16,) * 4, is_pure=True, pack=2)
        op = gl.reshape(gl.permute(gl.join(_pairs(a0, a1, BN, NB), _pairs(b0, b1, BN, NB)), (0, 2, 1)), [BN, D])
    return op


@gluon.jit
def _value_fields(vw, ASM: gl.constexpr, CONS: gl.constexpr, F: gl.constexpr):
    if F == 4:
        r0, r1, r2, r3 = gl.inline_asm_elementwise(ASM, CONS, [vw], dtype=(gl.float16,) * 4, is_pure=True, pack=4)
    else:
        r0, r1 = gl.inline_asm_elementwise(ASM, CONS, [vw], dtype=(gl.float16,) * 2, is_pure=True, pack=4)
        r2 = r0
        r3 = r1
    return r0, r1, r2, r3


@gluon.jit
def _value_operand(vw, BN: gl.constexpr, D: gl.constexpr, F: gl.constexpr, VA0: gl.constexpr, VA1: gl.constexpr,
                   VA2: gl.constexpr, VA3: gl.constexpr, VCONS: gl.constexpr):
    p00, p10, p20, p30 = _value_fields(vw, VA0, VCONS, F)   # p<field><byte>
    p01, p11, p21, p31 = _value_fields(vw, VA1, VCONS, F)
    p02, p12, p22, p32 = _value_fields(vw, VA2, VCONS, F)
    p03, p13, p23, p33 = _value_fields(vw, VA3, VCONS, F)
    j0 = _join4(p00, p01, p02, p03)      # [W, BN, u, v]: byte 2u+v of field 0
    j1 = _join4(p10, p11, p12, p13)
    if F == 4:
        op = _join4(j0, j1, _join4(p20, p21, p22, p23), _join4(p30, p31, p32, p33))
        op = gl.reshape(gl.permute(op, (4, 5, 2, 3, 0, 1)), [D, BN])
    else:
        op = gl.reshape(gl.permute(gl.join(j0, j1), (4, 2, 3, 0, 1)), [D, BN])
    return op


@gluon.jit
def _issue(stage, n0, k_smem, v_smem, k_base, v_base, stride_kh, stride_vh, tc, wc, W: gl.constexpr,
           H: gl.constexpr):
    """Start copying the code words of tile n0, every packed head, into pipeline stage ``stage``."""
    rows = (n0 + tc)[:, None] * W + wc[None, :]
    for i in gl.static_range(H):
        async_copy.async_copy_global_to_shared(k_smem.index(stage * H + i), k_base + i * stride_kh + rows)
        async_copy.async_copy_global_to_shared(v_smem.index(stage * H + i), v_base + i * stride_vh + rows)
    async_copy.commit_group()


@gluon.jit
def _prefetch_scales(n0, KSp, KZp, VSp, VZp, stride_ksh, stride_vsh, KEY_G: gl.constexpr, VAL_G: gl.constexpr,
                     H: gl.constexpr, BN: gl.constexpr):
    """Bring tile n0's token-wise scales and zeros into L2 (``prefetch.global.L2``, no registers
    held): lane l takes parameter l % 4 of head (l // 4) % H, one BN x 2-byte row each (at most
    128 bytes, one line). The loads at the tile's start then wait on L2, not on DRAM (long-scoreboard
    stalls on them were 17% of the samples, docs/perf.md)."""
    lane = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
    p = lane % 4
    head = (lane // 4) % H
    if KEY_G == 0:
        ptr = gl.where(p == 0, KSp + head * stride_ksh, KZp + head * stride_ksh)
    else:
        ptr = VSp + head * stride_vsh
    if VAL_G == 0:
        ptr = gl.where(p == 2, VSp + head * stride_vsh, gl.where(p == 3, VZp + head * stride_vsh, ptr))
    gl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.b32 $0, 0;", "=r,l", [ptr + n0], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _param(P, n0, tm, head_c, stride_h, live, H: gl.constexpr, MASKED: gl.constexpr):
    """One token-wise parameter (scale or zero) per token of tile n0: [BN] with one head per program,
    else [BN, ROWS] with each query row's own head (head_c: the packed head of each row).
    A lane's tokens are tm = g + 8j: the address is one base per lane (row g) plus 8j elements, so
    every load takes an immediate offset from that base instead of its own 64-bit address (the
    address registers of 32 loads per tile had warps waiting on them, docs/perf.md)."""
    lo = tm & 7          # the lane's row g, the same in every register
    hi = tm & -8         # 8j: a constant per register
    if H == 1:
        ptr = (P + n0 + lo) + hi
        ok = live
    else:
        ptr = (P + n0 + head_c[None, :] * stride_h + lo[:, None]) + hi[:, None]
        ok = live[:, None]
    if MASKED:
        x = gl.load(ptr, mask=ok, other=0.0)
    else:
        x = gl.load(ptr)
    return x


@gluon.jit
def _scales(n0, end, tm, head_c, KSp, KZp, VSp, VZp, stride_ksh, stride_vsh, KEY_G: gl.constexpr,
            VAL_G: gl.constexpr, H: gl.constexpr, MASKED: gl.constexpr):
    """Per-token scale and zero of the token-wise sides (placeholders for channel-wise ones)."""
    tok = n0 + tm
    live = tok < end
    if KEY_G == 0:
        ks = _param(KSp, n0, tm, head_c, stride_ksh, live, H, MASKED)
        kz = _param(KZp, n0, tm, head_c, stride_ksh, live, H, MASKED)
    else:
        ks = tm
        kz = tm
    if VAL_G == 0:
        vs = _param(VSp, n0, tm, head_c, stride_vsh, live, H, MASKED)
        vz = _param(VZp, n0, tm, head_c, stride_vsh, live, H, MASKED)
    else:
        vs = tm
        vz = tm
    return ks, kz, vs, vz


@gluon.jit
def _stage_tail(n0, end, k_smem, v_smem, k_base, v_base, stride_kh, stride_vh, tc, wc, W: gl.constexpr,
                H: gl.constexpr):
    """The last, partial tile into stage 0 of the pipeline's shared memory, zeros past the end."""
    tok = n0 + tc
    rows = tok[:, None] * W + wc[None, :]
    live = (tok < end)[:, None]
    gl.thread_barrier()   # every lane is done reading the stages
    for i in gl.static_range(H):
        k_smem.index(i).store(gl.load(k_base + i * stride_kh + rows, mask=live, other=0))
        v_smem.index(i).store(gl.load(v_base + i * stride_vh + rows, mask=live, other=0))
    gl.thread_barrier()   # the words are visible to every lane


@gluon.jit
def _per_row(x, H: gl.constexpr):
    """A token-wise parameter as float32 [BN, ROWS] (or [BN, 1] to broadcast, one head per program)."""
    if H == 1:
        y = x.to(gl.float32)[:, None]
    else:
        y = x.to(gl.float32)
    return y


@gluon.jit
def _scores(n0, end, k_smem, slot, ks, kz, tm, head_c, q16, q_bias, q_sum, row_scale, BN: gl.constexpr,
            D: gl.constexpr, F: gl.constexpr, ROWS: gl.constexpr, H: gl.constexpr, KEY_G: gl.constexpr,
            KEY_BIAS: gl.constexpr, KASM: gl.constexpr, KCONS: gl.constexpr, MASKED: gl.constexpr):
    """Key side of one tile: the logits t [BN tokens, ROWS] (log2 units), -inf past ``end``."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    W: gl.constexpr = D // F // 4
    kw_l: gl.constexpr = key_words_layout(BN, W)
    # scores of every packed head: head i's keys against all query rows, kept in the rows of head i
    sacc = gl.zeros([BN, ROWS], gl.float32, layout=mma)
    for i in gl.static_range(H):
        kw = k_smem.index(slot + i).load(kw_l)
        ka = gl.convert_layout(_key_operand(kw, BN, D, F, KASM, KCONS), a_l, assert_trivial=True)
        if H == 1:
            sacc = mma_v2(ka, q16, sacc)
        else:
            sacc = gl.where((head_c == i)[None, :], mma_v2(ka, q16, gl.zeros([BN, ROWS], gl.float32, layout=mma)),
                            sacc)
    if KEY_G == 0:
        ks2 = _per_row(ks, H)
        kz2 = _per_row(kz, H)
        # acc-fold, one scale per token (row of M); bias and zero through sum(q') and sum(q) (eq. 3, 6, 7)
        if KEY_BIAS == 0:   # subnormal codes: nothing to remove, row_scale carries 2^KEY_EXP
            t = ks2 * (sacc * row_scale[None, :]) + kz2 * q_sum[None, :]
        else:
            t = ks2 * ((sacc - q_bias[None, :]) * row_scale[None, :]) + kz2 * q_sum[None, :]
    else:
        # operand-fold: q16 was pre-scaled by this group's channel scales (and its own power of two);
        # here q_bias is that group's scale back to logits and q_sum its offset: the bias removed and
        # sum(q x zero) added (eq. 4, 6, 7), see _key_group
        t = sacc * q_bias[None, :] + q_sum[None, :]
    if MASKED:
        t = gl.where((n0 + tm < end)[:, None], t, float("-inf"))
    return t


@gluon.jit
def _consume(t, v_smem, slot, vs, vz, m_i, l_i, zsum, acc_o, head_b, v_scale, v_zero, BN: gl.constexpr,
             D: gl.constexpr, F: gl.constexpr, ROWS: gl.constexpr, H: gl.constexpr, VAL_G: gl.constexpr,
             VA0: gl.constexpr, VA1: gl.constexpr, VA2: gl.constexpr, VA3: gl.constexpr, VCONS: gl.constexpr,
             AND_P: gl.constexpr):
    """Online softmax of one tile's logits ``t`` and its value side into (max, denominator, zero sum, O^T).
    ``AND_P``: mask each packed head's P by an AND per register instead of a select per half."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    W: gl.constexpr = D // F // 4
    vw_l: gl.constexpr = value_words_layout(BN, W)
    m_new = gl.maximum(m_i, gl.max(t, axis=0))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(t - m_new[None, :])
    p_sum = gl.sum(p, axis=0)
    l_i = l_i * alpha + p_sum
    if VAL_G == 0:
        vs2 = _per_row(vs, H)
        vz2 = _per_row(vz, H)
        # operand-fold: P x scale before the product; sum(P x zero) beside it (eq. 4, 6)
        pb = gl.convert_layout((p * vs2).to(gl.float16), b_l)
        zsum = zsum * alpha + gl.sum(p * vz2, axis=0)
    else:
        pb = gl.convert_layout(p.to(gl.float16), b_l)
    # a fresh accumulator per tile: the tensor core's own running sum over many tiles loses low bits;
    # head i's values meet only the columns (query rows) of head i
    pv = gl.zeros([D, ROWS], gl.float32, layout=mma)
    for i in gl.static_range(H):
        vw = v_smem.index(slot + i).permute((1, 0)).load(vw_l)
        va = gl.convert_layout(_value_operand(vw, BN, D, F, VA0, VA1, VA2, VA3, VCONS), a_l, assert_trivial=True)
        if H == 1:
            pv = mma_v2(va, pb, pv)
        elif not AND_P:
            pv = mma_v2(va, gl.where((head_b == i)[None, :], pb, gl.zeros_like(pb)), pv)
        else:
            # a lane's pair of P (two tokens of one column, one query row) is one head's: kept or
            # zeroed by one AND per register (a select per half took a SEL and two PRMTs)
            keep = gl.where((head_b == i)[None, :], gl.full(pb.shape, -1, gl.int16, layout=b_l),
                            gl.zeros(pb.shape, gl.int16, layout=b_l))
            pv = mma_v2(va, gl.inline_asm_elementwise("and.b32 $0, $1, $2;", "=r,r,r", [pb, keep], dtype=gl.float16,
                                                      is_pure=True, pack=2), pv)
    if VAL_G == 0:
        acc_o = acc_o * alpha[None, :] + pv
    else:
        # acc-fold: this tile lies in one token group; scale the tile's sum per channel, add zero x sum(P)
        acc_o = acc_o * alpha[None, :] + pv * _per_channel(v_scale, H) + _per_channel(v_zero, H) * p_sum[None, :]
    return m_new, l_i, zsum, acc_o


@constexpr_function
def _and_p(heads, dynamic, page):
    return heads == 2 and not (dynamic and page > 0)


@gluon.jit
def _tile(n0, end, k_smem, v_smem, slot, ks, kz, vs, vz, m_i, l_i, zsum, acc_o, tm, head_c, head_b, q16, q_bias,
          q_sum, row_scale, v_scale, v_zero, BN: gl.constexpr, D: gl.constexpr, F: gl.constexpr, ROWS: gl.constexpr,
          H: gl.constexpr, KEY_G: gl.constexpr, VAL_G: gl.constexpr, KEY_BIAS: gl.constexpr, KASM: gl.constexpr,
          KCONS: gl.constexpr, VA0: gl.constexpr, VA1: gl.constexpr, VA2: gl.constexpr, VA3: gl.constexpr,
          VCONS: gl.constexpr,
          MASKED: gl.constexpr, AND_P: gl.constexpr):
    """One tile, key side then value side."""
    t = _scores(n0, end, k_smem, slot, ks, kz, tm, head_c, q16, q_bias, q_sum, row_scale, BN, D, F, ROWS, H, KEY_G,
                KEY_BIAS, KASM, KCONS, MASKED)
    return _consume(t, v_smem, slot, vs, vz, m_i, l_i, zsum, acc_o, head_b, v_scale, v_zero, BN, D, F, ROWS, H,
                    VAL_G, VA0, VA1, VA2, VA3, VCONS, AND_P)


@gluon.jit
def _swap_k01(x, D: gl.constexpr, ROWS: gl.constexpr):
    """x[c] -> x[key_channel(k)]: the key operand's k index is the channel with its bits 0 and 1
    swapped (operands.py), a reshape and a permute of the tensor (no data moves between lanes)."""
    if ROWS == 0:
        y = gl.reshape(gl.permute(gl.reshape(x, [D // 4, 2, 2]), (0, 2, 1)), [D])
    else:
        y = gl.reshape(gl.permute(gl.reshape(x, [D // 4, 2, 2, ROWS]), (0, 2, 1, 3)), [D, ROWS])
    return y


@gluon.jit
def _channel_param(P, head_q, stride_h, D: gl.constexpr, ROWS: gl.constexpr, H: gl.constexpr):
    """A channel-wise K parameter (scale or zero) of one token group as float32 in the query
    operand's layout, [D, 1] or [D, ROWS] with each row's own head: each lane's eight consecutive
    channels in one vector load, then put in k order (_swap_k01)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    c = gl.arange(0, D, layout=gl.SliceLayout(1, b_l))
    if H == 1:
        x = gl.load(P + c)
        y = gl.convert_layout(_swap_k01(x, D, 0), gl.SliceLayout(1, b_l), assert_trivial=True)
        out = y.to(gl.float32)[:, None]
    else:
        x = gl.load(P + head_q[None, :] * stride_h + c[:, None])
        out = gl.convert_layout(_swap_k01(x, D, ROWS), b_l, assert_trivial=True).to(gl.float32)
    return out


@gluon.jit
def _key_group(qv, field, chan, head_q, stride_ksh, KSg, KZg, qk_scale, BITS: gl.constexpr, KEY_BIAS: gl.constexpr,
               KEY_EXP: gl.constexpr, H: gl.constexpr, D: gl.constexpr, ROWS: gl.constexpr):
    """Channel-wise K, one token group: the query pre-scaled by the group's channel scales and field
    weights (operand-fold, eq. 4), each row by its own power of two c so the largest entry sits
    near 2^12 (large channel scales must not overflow fp16), and the logits' affine map
    ``t = acc * mul + add`` with mul = qk_scale * 2^KEY_EXP / c and add = -mul * bias * sum(q') +
    qk_scale * sum(q x zero) (eq. 6, 7; subnormal codes: bias 0, KEY_EXP 24)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    row_l: gl.constexpr = gl.SliceLayout(0, mma)
    sk = _channel_param(KSg, head_q, stride_ksh, D, ROWS, H)   # each row its own head's
    zk = _channel_param(KZg, head_q, stride_ksh, D, ROWS, H)
    qs = qv * sk * gl.exp2(-(field * BITS).to(gl.float32))[:, None]
    c = gl.exp2(12.0 - gl.floor(gl.log2(gl.maximum(gl.max(gl.abs(qs), axis=0), 1e-30))))
    q16 = (qs * c[None, :]).to(gl.float16)
    mul = qk_scale * (2.0 ** KEY_EXP) / c
    add = gl.sum(qv * zk, axis=0) * qk_scale
    if KEY_BIAS != 0:
        add = add - mul * KEY_BIAS * gl.sum(q16.to(gl.float32), axis=0)
    return q16, gl.convert_layout(mul, row_l), gl.convert_layout(add, row_l)


@gluon.jit
def _value_group(VSg, VZg, chan_o, weight, head_c, stride_vsh, H: gl.constexpr):
    """Channel-wise V: one token group's scale (times the field weight) and zero per output row
    [D], or per output row and query row [D, ROWS] with packed heads (each row its own head's)."""
    if H == 1:
        off = chan_o
        w = weight
    else:
        off = head_c[None, :] * stride_vsh + chan_o[:, None]
        w = weight[:, None]
    return gl.load(VSg + off).to(gl.float32) * w, gl.load(VZg + off).to(gl.float32)


@gluon.jit
def _per_channel(x, H: gl.constexpr):
    """A channel-wise V parameter as [D, ROWS] or [D, 1] to broadcast (one head per program)."""
    if H == 1:
        y = x[:, None]
    else:
        y = x
    return y


@gluon.jit
def _draw(counter, first, live, previous, DYNAMIC: gl.constexpr):
    """The next chunk for this program from its (batch, head group)'s counter where ``live``, else
    ``previous``: chunks 0 .. splits-1 are the programs' first ones, so a draw returns splits + the
    counter's old value. One lane draws (a scalar atomic); a program draws again only after its last
    draw succeeded, so every chunk drawn is processed."""
    if DYNAMIC:
        got = first + gl.atomic_add(counter, 1, mask=live, sem="relaxed")
        drawn = gl.where(live, got, previous)
    else:
        drawn = previous
    return drawn


@gluon.jit
def _next_tile(t, drawn, t_stop, counter, first, CHUNK: gl.constexpr, DYNAMIC: gl.constexpr):
    """(tile after tile t, the chunk drawn ahead). Static: t + 1. Dynamic: the next tile of t's chunk,
    or the first of the chunk drawn ahead, and then the next draw (its latency hides under a tile).
    Past the sequence's t_stop full tiles the program stops."""
    if DYNAMIC:
        last = (t + 1) % CHUNK == 0
        t_next = gl.where(last, drawn * CHUNK, t + 1)
        drawn = _draw(counter, first, last & (drawn * CHUNK < t_stop), drawn, DYNAMIC)
    else:
        t_next = t + 1
    return t_next, drawn


@gluon.jit
def _bases(n0, b, h, cache, table, strides, W: gl.constexpr, KEY_G: gl.constexpr, VAL_G: gl.constexpr,
           PAGE: gl.constexpr):
    """Base pointers of the code words and the scales/zeros for the tile holding token n0.
    Contiguous cache (PAGE == 0): batch b's. Paged (PAGE tokens a page, FlashInfer's table): the page
    that holds n0, *rebased* by that page's first token tok0, so that ``base + token * row_stride``
    addresses row token - tok0 of the page for every token of the tile (a tile lies in one page).
    ``first``/``n_pages``: the sequence's entries in KV_INDICES; a slot past them (an empty split)
    reads no entry and takes page 0, whose rows no load then touches. ``cache``: the six tensors'
    pointers, ``table``: (first, n_pages, KV_INDICES), ``strides``: theirs, as the kernel's arguments."""
    KC, KS, KZ, VC, VS, VZ = cache
    first, n_pages, KV_INDICES = table
    stride_kb, stride_kh, stride_ksb, stride_ksh, stride_ksn, stride_vb, stride_vh, stride_vsb, stride_vsh, \
        stride_vsn = strides
    if PAGE > 0:
        slot = n0 // PAGE
        unit = gl.load(KV_INDICES + first + slot, mask=slot < n_pages, other=0).to(gl.int64)
        tok0 = slot * PAGE
    else:
        unit = b
        tok0 = 0
    k_base = KC + unit * stride_kb + h * stride_kh - tok0 * W
    v_base = VC + unit * stride_vb + h * stride_vh - tok0 * W
    if KEY_G == 0:      # scale/zero rows: tokens (stride 1) or token groups (stride_ksn)
        k_row = tok0
    else:
        k_row = (tok0 // KEY_G) * stride_ksn
    if VAL_G == 0:
        v_row = tok0
    else:
        v_row = (tok0 // VAL_G) * stride_vsn
    KSp = KS + unit * stride_ksb + h * stride_ksh - k_row
    KZp = KZ + unit * stride_ksb + h * stride_ksh - k_row
    VSp = VS + unit * stride_vsb + h * stride_vsh - v_row
    VZp = VZ + unit * stride_vsb + h * stride_vsh - v_row
    return k_base, v_base, KSp, KZp, VSp, VZp


@gluon.jit
def foldc_decode_gluon(Q, KC, KS, KZ, VC, VS, VZ, SEQ_LENS, WS_M, WS_L, WS_ACC, KV_INDPTR, KV_INDICES, COUNTERS,
                       stride_qb, stride_qh, stride_kb, stride_kh, stride_ksb, stride_ksh, stride_ksn,
                       stride_vb, stride_vh, stride_vsb, stride_vsh, stride_vsn, qk_scale, tokens_per_split,
                       cache_tokens, HAS_LENS: gl.constexpr, PAGE: gl.constexpr, Q_PER_KV: gl.constexpr,
                       ROWS: gl.constexpr,
                       H: gl.constexpr, BN: gl.constexpr,
                       D: gl.constexpr, BITS: gl.constexpr, KEY_BIAS: gl.constexpr, KEY_G: gl.constexpr,
                       VAL_G: gl.constexpr, STAGES: gl.constexpr, SCALE_AHEAD: gl.constexpr, KASM: gl.constexpr,
                       KCONS: gl.constexpr, VA0: gl.constexpr, VA1: gl.constexpr, VA2: gl.constexpr,
                       VA3: gl.constexpr, VCONS: gl.constexpr, VALUE_EXP: gl.constexpr, KEY_EXP: gl.constexpr,
                       PREFETCH: gl.constexpr, DYNAMIC: gl.constexpr, CHUNK: gl.constexpr):
    NB: gl.constexpr = D * BITS // 8
    W: gl.constexpr = NB // 4
    F: gl.constexpr = 8 // BITS
    # P masked per head by ANDs with two packed heads: 3.6% fewer instructions per INT2 tile, 1-3% faster
    # at INT2 on the H200 (docs/perf.md). Not with 4 or 8 heads, where ptxas then allocates 207-234
    # registers against 168-226, nor on dynamic paged builds (178 against 168; AOT SASS)
    AND_P: gl.constexpr = _and_p(H, DYNAMIC, PAGE)
    b = gl.program_id(0)
    h = gl.program_id(1) * H     # the first of the H KV heads this program packs into the MMA's N
    s = gl.program_id(2)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    cp_l: gl.constexpr = copy_layout(BN, W)
    row_l: gl.constexpr = gl.SliceLayout(0, mma)
    tok_l: gl.constexpr = gl.SliceLayout(1, mma)
    smem_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])

    if HAS_LENS:
        seq_len = gl.minimum(gl.load(SEQ_LENS + b), cache_tokens)   # lengths past the cache are clamped
    else:                                                            # every sequence fills the cache
        seq_len = cache_tokens
    if DYNAMIC:   # every program of a (batch, head group) draws chunks of CHUNK tiles: _next_tile
        t_stop = seq_len // BN            # the sequence's full tiles; program s starts on chunk s
        start = s * CHUNK * BN
        end = gl.where(s == 0, seq_len, t_stop * BN)   # program 0 also takes the partial last tile
        n_full = gl.maximum(t_stop - s * CHUNK, 0)     # > 0: the program has its first chunk
        counter = COUNTERS + b * gl.num_programs(1) + gl.program_id(1)
    else:         # tokens_per_split consecutive tokens
        start = s * tokens_per_split
        end = gl.minimum(start + tokens_per_split, seq_len)
        n_full = gl.maximum(end - start, 0) // BN
        t_stop = start // BN + n_full
        counter = COUNTERS
    if PAGE > 0:   # this sequence's entries in the page table
        first = gl.load(KV_INDPTR + b)
        n_pages = gl.load(KV_INDPTR + b + 1) - first
    else:
        first = 0
        n_pages = 0
    # what _bases needs to place a tile, contiguous or paged
    cache = (KC, KS, KZ, VC, VS, VZ)
    table = (first, n_pages, KV_INDICES)
    strides = (stride_kb, stride_kh, stride_ksb, stride_ksh, stride_ksn, stride_vb, stride_vh, stride_vsb, stride_vsh,
               stride_vsn)

    # the first tiles' code words start on their way before the query is read and rescaled, so
    # that the two memory latencies overlap (a program of one or two tiles, at batch 1, waits on both)
    tc = gl.arange(0, BN, layout=gl.SliceLayout(1, cp_l))
    wc = gl.arange(0, W, layout=gl.SliceLayout(0, cp_l))
    k_smem = gl.allocate_shared_memory(gl.int32, [STAGES * H, BN, W], smem_l)
    v_smem = gl.allocate_shared_memory(gl.int32, [STAGES * H, BN, W], smem_l)
    if n_full > 0:
        for i in gl.static_range(STAGES - 1):
            n_i = start + gl.minimum(i, n_full - 1) * BN
            k_i, v_i, _, _, _, _ = _bases(n_i, b, h, cache, table, strides, W, KEY_G, VAL_G, PAGE)
            _issue(i, n_i, k_smem, v_smem, k_i, v_i, stride_kh, stride_vh, tc, wc, W, H)
    # the chunk this program takes after its first, drawn now so that its latency hides under the prologue
    drawn = _draw(counter, gl.num_programs(2), n_full > 0, 0, DYNAMIC)

    # Q'^T [D, ROWS]: k index -> channel as operands.key_channel; field weight 2^-(bits*field);
    # each row scaled by a power of two c so that its largest entry is near 2^12 (no fp16 underflow).
    # Row r is query head h * Q_PER_KV + r: the query rows of the H packed KV heads, one after another
    kq = gl.arange(0, D, layout=gl.SliceLayout(1, b_l))
    rq = gl.arange(0, ROWS, layout=gl.SliceLayout(0, b_l))
    field = kq // NB
    j = kq % NB
    chan = field * NB + ((j & ~3) | ((j & 1) << 1) | ((j >> 1) & 1))
    # each lane's eight consecutive channels in one vector load, then put in k order (_swap_k01)
    q_nat = gl.load(Q + b * stride_qb + (h * Q_PER_KV + rq)[None, :] * stride_qh + kq[:, None],
                    mask=(rq < Q_PER_KV * H)[None, :], other=0.0)
    qv = gl.convert_layout(_swap_k01(q_nat, D, ROWS), b_l, assert_trivial=True).to(gl.float32)
    head_q = gl.minimum(rq // Q_PER_KV, H - 1)                                  # packed head of each row
    head_b = head_q
    head_c = gl.minimum(gl.arange(0, ROWS, layout=row_l) // Q_PER_KV, H - 1)
    amax = gl.maximum(gl.max(gl.abs(qv), axis=0), 1e-30)
    c = gl.exp2(12.0 - gl.floor(gl.log2(amax)))
    row_scale = gl.convert_layout(qk_scale * (2.0 ** KEY_EXP) / c, row_l)
    k_base, v_base, KSp, KZp, VSp, VZp = _bases(start, b, h, cache, table, strides, W, KEY_G, VAL_G, PAGE)
    if KEY_G == 0:
        q16 = (qv * c[None, :] * gl.exp2(-(field * BITS).to(gl.float32))[:, None]).to(gl.float16)
        if KEY_BIAS == 0:   # subnormal key codes: no bias to remove (q_bias is unused)
            q_bias = row_scale
        else:
            q_bias = gl.convert_layout(gl.sum(q16.to(gl.float32), axis=0) * KEY_BIAS, row_l)
        q_sum = gl.convert_layout(gl.sum(qv, axis=0) * qk_scale, row_l)
    else:
        g0 = start // KEY_G
        q16, q_bias, q_sum = _key_group(qv, field, chan, head_q, stride_ksh, KSp + g0 * stride_ksn,
                                        KZp + g0 * stride_ksn, qk_scale, BITS, KEY_BIAS, KEY_EXP, H, D, ROWS)
    # row m of O^T is channel operands.value_channel(m)
    cm = gl.arange(0, D, layout=tok_l)
    chan_o = (cm // NB) * NB + 4 * (cm % W) + (cm // W) % 4
    # the value codes enter the MMA as fp16 subnormals code * 2^(bits*field - VALUE_EXP) (operands.py)
    weight_o = gl.exp2((VALUE_EXP - (cm // NB) * BITS).to(gl.float32))
    if VAL_G == 0:
        v_scale = weight_o
        v_zero = weight_o
    else:
        g0 = start // VAL_G
        v_scale, v_zero = _value_group(VSp + g0 * stride_vsn, VZp + g0 * stride_vsn, chan_o, weight_o, head_c,
                                       stride_vsh, H)

    tm = gl.arange(0, BN, layout=tok_l)

    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_l)
    l_i = gl.zeros([ROWS], gl.float32, layout=row_l)
    zsum = gl.zeros([ROWS], gl.float32, layout=row_l)
    acc_o = gl.zeros([D, ROWS], gl.float32, layout=mma)
    if n_full > 0:
        if SCALE_AHEAD:   # the first tile's scales; each iteration then loads the next tile's
            ks, kz, vs, vz = _scales(start, end, tm, head_c, KSp, KZp, VSp, VZp, stride_ksh, stride_vsh, KEY_G, VAL_G,
                                     H, False)
        t = start // BN
        i = 0
        while t < t_stop:
            n0 = t * BN
            if PAGE > 0:   # this tile's page: its group scales
                _, _, KSp, KZp, VSp, VZp = _bases(n0, b, h, cache, table, strides, W, KEY_G, VAL_G, PAGE)
            if KEY_G > 0:
                if n0 % KEY_G == 0:
                    q16, q_bias, q_sum = _key_group(qv, field, chan, head_q, stride_ksh,
                                                    KSp + (n0 // KEY_G) * stride_ksn, KZp + (n0 // KEY_G) * stride_ksn,
                                                    qk_scale, BITS, KEY_BIAS, KEY_EXP, H, D, ROWS)
            if VAL_G > 0:
                if n0 % VAL_G == 0:
                    v_scale, v_zero = _value_group(VSp + (n0 // VAL_G) * stride_vsn, VZp + (n0 // VAL_G) * stride_vsn,
                                                   chan_o, weight_o, head_c, stride_vsh, H)
            t_next, drawn = _next_tile(t, drawn, t_stop, counter, gl.num_programs(2), CHUNK, DYNAMIC)
            if DYNAMIC:   # STAGES == 2: the tile copied ahead is the next one
                t_ahead = t_next
            else:
                t_ahead = t + STAGES - 1
            n_next = gl.minimum(t_next, t_stop - 1) * BN
            n_ahead = gl.minimum(t_ahead, t_stop - 1) * BN
            ahead = i + STAGES - 1
            if PAGE > 0:   # the pages of the next tile (its scales) and of the tile copied ahead
                _, _, KSn, KZn, VSn, VZn = _bases(n_next, b, h, cache, table, strides, W, KEY_G, VAL_G, PAGE)
                k_a, v_a, _, _, _, _ = _bases(n_ahead, b, h, cache, table, strides, W, KEY_G, VAL_G, PAGE)
            else:
                KSn = KSp
                KZn = KZp
                VSn = VSp
                VZn = VZp
                k_a = k_base
                v_a = v_base
            if SCALE_AHEAD:   # one tile ahead, in registers
                ks2, kz2, vs2, vz2 = _scales(n_next, end, tm, head_c, KSn, KZn, VSn, VZn, stride_ksh, stride_vsh,
                                             KEY_G, VAL_G, H, False)
            else:             # this tile's, loaded now: fewer live registers, the latency under the key side
                ks, kz, vs, vz = _scales(n0, end, tm, head_c, KSp, KZp, VSp, VZp, stride_ksh, stride_vsh, KEY_G, VAL_G,
                                         H, False)
            gl.thread_barrier()   # every lane is done reading the stage the next copy overwrites
            if DYNAMIC:   # past the last tile: an empty copy group (the last tile may be a DRAM read away)
                if t_ahead < t_stop:
                    _issue(ahead % STAGES, n_ahead, k_smem, v_smem, k_a, v_a, stride_kh, stride_vh, tc, wc, W, H)
                else:
                    async_copy.commit_group()
            else:         # a copy of the last tile again, just read: from L2
                _issue(ahead % STAGES, n_ahead, k_smem, v_smem, k_a, v_a, stride_kh, stride_vh, tc, wc, W, H)
            if PREFETCH and not SCALE_AHEAD:   # the next tile's scales on their way to L2 (loaded at its start);
                if (KEY_G == 0 or VAL_G == 0) and PAGE == 0:   # not measured on pages, where it costs 7% more SASS
                    _prefetch_scales(n_next, KSn, KZn, VSn, VZn, stride_ksh, stride_vsh, KEY_G, VAL_G, H, BN)
            async_copy.wait_group(STAGES - 1)
            gl.thread_barrier()   # tile i's words, copied by every lane, are visible
            m_i, l_i, zsum, acc_o = _tile(n0, end, k_smem, v_smem, (i % STAGES) * H, ks, kz, vs, vz, m_i, l_i, zsum,
                                          acc_o, tm, head_c, head_b, q16, q_bias, q_sum, row_scale, v_scale, v_zero,
                                          BN, D, F, ROWS, H, KEY_G, VAL_G, KEY_BIAS, KASM, KCONS, VA0, VA1, VA2, VA3,
                                          VCONS, False, AND_P)
            if SCALE_AHEAD:
                ks, kz, vs, vz = ks2, kz2, vs2, vz2
            t = t_next
            i += 1
        async_copy.wait_group(0)
    full_end = t_stop * BN
    if full_end < end:
        if PAGE > 0:
            k_base, v_base, KSp, KZp, VSp, VZp = _bases(full_end, b, h, cache, table, strides, W, KEY_G, VAL_G, PAGE)
        if KEY_G > 0:
            g_end = full_end // KEY_G
            q16, q_bias, q_sum = _key_group(qv, field, chan, head_q, stride_ksh, KSp + g_end * stride_ksn,
                                            KZp + g_end * stride_ksn, qk_scale, BITS, KEY_BIAS, KEY_EXP, H, D, ROWS)
        if VAL_G > 0:
            v_scale, v_zero = _value_group(VSp + (full_end // VAL_G) * stride_vsn,
                                           VZp + (full_end // VAL_G) * stride_vsn, chan_o, weight_o, head_c, stride_vsh,
                                           H)
        ks, kz, vs, vz = _scales(full_end, end, tm, head_c, KSp, KZp, VSp, VZp, stride_ksh, stride_vsh, KEY_G, VAL_G,
                                 H, True)
        _stage_tail(full_end, end, k_smem, v_smem, k_base, v_base, stride_kh, stride_vh, tc, wc, W, H)
        m_i, l_i, zsum, acc_o = _tile(full_end, end, k_smem, v_smem, 0, ks, kz, vs, vz, m_i, l_i, zsum, acc_o, tm,
                                      head_c, head_b, q16, q_bias, q_sum, row_scale, v_scale, v_zero, BN, D, F, ROWS,
                                      H, KEY_G, VAL_G, KEY_BIAS, KASM, KCONS, VA0, VA1, VA2, VA3, VCONS, True,
                                      AND_P)

    # token-wise V: undo the field weights 2^(bits*field) per output row, add the zero term (eq. 6);
    # channel-wise V has both in acc_o already. The workspace sees the H packed heads as one head
    # of H * Q_PER_KV query rows (the merge kernel is launched so)
    rr = gl.arange(0, ROWS, layout=row_l)
    if VAL_G == 0:
        res = acc_o * weight_o[:, None] + zsum[None, :]
    else:
        res = acc_o
    base = ((b * gl.num_programs(1) + gl.program_id(1)) * gl.num_programs(2) + s) * ROWS
    gl.store(WS_ACC + (base + rr)[None, :] * D + chan_o[:, None], res)
    gl.store(WS_M + base + rr, m_i)
    gl.store(WS_L + base + rr, l_i)
