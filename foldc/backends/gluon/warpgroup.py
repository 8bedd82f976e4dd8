"""The warpgroup template of the register-operand kernel (sm_90): token-wise INT2 keys and values in one
group per token, head_dim 128, 32 query rows per KV head. Four warps per program share one wgmma
(docs/register_operands.md, "Warpgroup template"):

  scores  S^T[tok, r] = K'[tok, k] . Q'^T[k, r]    A: the unpacked key codes in registers; B: the query
  values  O^T[m, r]  += V'^T[m, tok] . P'^T[tok, r] A: the unpacked value codes in registers; B: P x s_tok

both in shared memory. The codes enter as fp16 subnormals, code x 2^(2i) x 2^-24 with i the bit field
(operands.py); the field weights go into the query (keys) and onto the output rows (values), the
zero corrections are added before the softmax (keys, eq. 6) and before the merge's division (values).
Each thread holds a key word pair of two tokens and one byte of the value words of its tokens (the
MMA's lane rows are channels there), so the wgmma's A fragments are the unpack's results with no data
movement. Per tile: the warps' score maxima meet through shared memory (barrier 1), then P and the
next tile's copies (barrier 2). Against the one-warp program's two row blocks of 16 at 32 query rows
per KV head this unpacks each code once and issues one wgmma for four warps' MMA work.

Import this module only where Triton runs natively (not under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import math

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from foldc.backends.gluon.operands import key_unpack_asm, lane_value_unpack_asm

# the key unpack (result 2i+p = field i of bytes (p, p+2) as subnormals) and the value unpack with a
# byte selector per lane (result 2i = field i of the lane's byte of tokens (t0, t1), 2i+1 of (t8, t9))
KEY_ASM = gl.constexpr(key_unpack_asm(2)[0])
KEY_CONS = gl.constexpr(key_unpack_asm(2)[1])
VALUE_ASM = gl.constexpr(lane_value_unpack_asm(2)[0])
VALUE_CONS = gl.constexpr(lane_value_unpack_asm(2)[1])


@gluon.constexpr_function
def key_words_layout(BN):
    # [BN tokens, 8 words]: lane (g, t) of warp w holds words 2t, 2t+1 of tokens 16w + g (+8, +64 j)
    reg = [[0, 1], [8, 0]] + [[64 << i, 0] for i in range(int(math.log2(BN // 64)))]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BN, 8])


@gluon.constexpr_function
def value_words_layout(BN):
    # [8 words, 4 bytes, BN tokens]: lane (g, t) of warp w holds byte g % 4 of word 2w + g // 4 of tokens
    # 2t + (0, 1, 8, 9) + 16j; the byte axis is a lane axis, so a [8, BN] load in SliceLayout(1, .)
    # broadcast over it reads each word once per lane that needs one of its bytes
    reg = [[0, 0, 1], [0, 0, 8]] + [[0, 0, 16 << i] for i in range(int(math.log2(BN // 16)))]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [1, 0, 0]],
                                      warp_bases=[[2, 0, 0], [4, 0, 0]], block_bases=[], shape=[8, 4, BN])


@gluon.constexpr_function
def partial_layout(BN, ROWS):
    # [BN // 16, 8, ROWS]: the score accumulator's layout with M = 16 x (axis 0) + 8a + g summed over a,
    # the per-lane partial sums of the denominator and sum(P x z_tok)
    reg = [[0, 0, 1]] + [[0, 0, 8 << i] for i in range(int(math.log2(ROWS // 8)))] + \
        [[4 << i, 0, 0] for i in range(int(math.log2(BN // 64)))]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
                                      warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[BN // 16, 8, ROWS])


@gluon.constexpr_function
def copy_layout(BN):
    # cp.async of a [BN, 8] word tile by four warps: 16 bytes per lane
    return gl.BlockedLayout([1, 4], [16, 2], [4, 1], [1, 0])


@gluon.jit
def _key_operand(kw, a_l: gl.constexpr, BN: gl.constexpr):
    r0, r1, r2, r3, r4, r5, r6, r7 = gl.inline_asm_elementwise(KEY_ASM, KEY_CONS, [gl.join(kw, kw)],
                                                               dtype=(gl.float16,) * 8, is_pure=True, pack=2)
    y0 = gl.join(r0, r1)    # [BN, w, e, p] field 0
    y1 = gl.join(r2, r3)
    y2 = gl.join(r4, r5)
    y3 = gl.join(r6, r7)
    y = gl.join(gl.join(y0, y2), gl.join(y1, y3))        # [BN, w, e, p, ih, il], field 2 ih + il
    y = gl.reshape(y, [BN, 4, 2, 2, 2, 2, 2])            # w = 2t + u
    y = gl.permute(y, (0, 2, 5, 6, 4, 1, 3))             # k = e + 2t + 8p + 16 field + 64u
    return gl.convert_layout(gl.reshape(y, [BN, 128]), a_l, assert_trivial=True)


@gluon.jit
def _value_operand(v_tile, sel, a_l: gl.constexpr, BN: gl.constexpr):
    vw_l: gl.constexpr = value_words_layout(BN)
    w8 = v_tile.permute((1, 0)).load(gl.SliceLayout(1, vw_l))            # [8 words, BN]
    vw = gl.expand_dims(w8, 1).broadcast_to([8, 4, BN])
    r0, r1, r2, r3 = gl.inline_asm_elementwise(VALUE_ASM, VALUE_CONS, [vw, sel], dtype=(gl.float16,) * 4,
                                               is_pure=True, pack=4)
    x = gl.join(gl.join(r0, r2), gl.join(r1, r3))         # [word, byte, BN, c, a], field a + 2c
    x = gl.reshape(x, [4, 2, 4, BN, 2, 2])                # word = 2 wp + g2; lane row g = byte + 4 g2
    x = gl.permute(x, (4, 0, 5, 1, 2, 3))                 # m = byte + 4 g2 + 8a + 16 wp + 64c
    return gl.convert_layout(gl.reshape(x, [128, BN]), a_l, assert_trivial=True)


@gluon.constexpr_function
def exchange_layout(ROWS):
    # [4 warps, ROWS]: every thread holds the four warps' maxima of its own columns (the score
    # accumulator's column distribution, broadcast over lane rows and warps)
    reg = [[0, 1]] + [[0, 8 << i] for i in range(int(math.log2(ROWS // 8)))] + [[1, 0], [2, 0]]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
                                      warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[4, ROWS])


@gluon.jit
def _issue(slot, n0, end, KC, VC, KS, KZ, VS, VZ, cbase, sbase, k_smem, v_smem, ks_smem, kz_smem, vs_smem, vz_smem,
           MASKED: gl.constexpr, BN: gl.constexpr):
    """cp.async of tile n0's key and value words and its four token-wise parameters into ``slot``."""
    cl: gl.constexpr = copy_layout(BN)
    sl: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [4, 1], [1, 0])
    ct = gl.arange(0, BN, layout=gl.SliceLayout(1, cl))
    cw = gl.arange(0, 8, layout=gl.SliceLayout(0, cl))
    sc = gl.arange(0, BN // 8, layout=gl.SliceLayout(1, sl))
    st = (n0 + sc * 8)[:, None] + gl.arange(0, 8, layout=gl.SliceLayout(0, sl))[None, :]
    rows = (n0 + ct)[:, None] * 8 + cw[None, :]
    if MASKED:
        cm = ((n0 + ct) < end)[:, None]
        sm = ((n0 + sc * 8) < end)[:, None]
    else:
        cm = None
        sm = None
    async_copy.async_copy_global_to_shared(k_smem.index(slot), KC + cbase + rows, mask=cm)
    async_copy.async_copy_global_to_shared(v_smem.index(slot), VC + cbase + rows, mask=cm)
    async_copy.async_copy_global_to_shared(ks_smem.index(slot), KS + sbase + st, mask=sm)
    async_copy.async_copy_global_to_shared(kz_smem.index(slot), KZ + sbase + st, mask=sm)
    async_copy.async_copy_global_to_shared(vs_smem.index(slot), VS + sbase + st, mask=sm)
    async_copy.async_copy_global_to_shared(vz_smem.index(slot), VZ + sbase + st, mask=sm)
    async_copy.commit_group()


@gluon.jit
def _tile(j, n0, end, next_n0, KC, VC, KS, KZ, VS, VZ, cbase, sbase, k_smem, v_smem, ks_smem, kz_smem, vs_smem,
          vz_smem, q_smem, p_smem, red_smem, sel, row_c, row_z, m_i, l_p, z_p, o, MASKED: gl.constexpr, ROWS: gl.constexpr,
          BN: gl.constexpr, STAGES: gl.constexpr, ISSUE: gl.constexpr):
    """One tile. On entry tile j's copies are complete and visible (the previous tile's second barrier).
    Barrier 1: the warps' score maxima; barrier 2: P in shared memory and tile j + 1's copies."""
    acc_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROWS, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_s, k_width=2)
    kw_l: gl.constexpr = key_words_layout(BN)
    tok_l: gl.constexpr = gl.SliceLayout(1, acc_s)
    lp_l: gl.constexpr = partial_layout(BN, ROWS)
    slot = j % STAGES
    kw = k_smem.index(slot).load(kw_l)
    ks = ks_smem.index(slot).reshape([BN]).load(tok_l).to(gl.float32)
    kz = kz_smem.index(slot).reshape([BN]).load(tok_l).to(gl.float32)
    vs = vs_smem.index(slot).reshape([BN]).load(tok_l).to(gl.float32)
    vz = vz_smem.index(slot).reshape([BN]).load(tok_l).to(gl.float32)
    sacc = warpgroup_mma(_key_operand(kw, a_l, BN), q_smem, gl.zeros([BN, ROWS], gl.float32, layout=acc_s))
    t = sacc * ks[:, None] + kz[:, None] * row_z[None, :]      # logits / row_c
    if MASKED:
        tok = gl.arange(0, BN, layout=tok_l)
        t = gl.where(((n0 + tok) < end)[:, None], t, float("-inf"))
    tmax = _tile_max(t, red_smem, ROWS, BN)
    # every warp is past tile j - 1 (barrier 1): its slot takes tile j + STAGES - 1
    _copy_next(j, next_n0, end, KC, VC, KS, KZ, VS, VZ, cbase, sbase, k_smem, v_smem, ks_smem, kz_smem, vs_smem,
               vz_smem, BN, STAGES, ISSUE)
    m_new = gl.maximum(m_i, tmax)
    mc = m_new * row_c
    alpha = gl.exp2(m_i * row_c - mc)
    p = gl.exp2(t * row_c[None, :] - mc[None, :])
    a3 = gl.convert_layout(alpha, gl.SliceLayout(0, gl.SliceLayout(1, lp_l)))[None, None, :]
    p_smem.store((p * vs[:, None]).to(gl.float16))
    # per-lane partial sums over the thread's own tokens (register bits of M): no shuffles per tile
    l_p = l_p * a3 + gl.convert_layout(gl.sum(gl.reshape(p, [BN // 16, 2, 8, ROWS]), axis=1), lp_l,
                                       assert_trivial=True)
    z_p = z_p * a3 + gl.convert_layout(gl.sum(gl.reshape(p * vz[:, None], [BN // 16, 2, 8, ROWS]), axis=1), lp_l,
                                  assert_trivial=True)
    fence_async_shared()
    async_copy.wait_group(STAGES - 2)
    gl.thread_barrier()
    otile = warpgroup_mma(_value_operand(v_smem.index(slot), sel, a_l, BN), p_smem,
                          gl.zeros([128, ROWS], gl.float32, layout=acc_s))
    # a fresh accumulator per tile, added in fp32 (the tensor core's own running sum loses low bits)
    o = o * alpha[None, :] + otile
    return m_new, l_p, z_p, o


@gluon.jit
def _copy_next(j, next_n0, end, KC, VC, KS, KZ, VS, VZ, cbase, sbase, k_smem, v_smem, ks_smem, kz_smem, vs_smem,
               vz_smem, BN: gl.constexpr, STAGES: gl.constexpr, ISSUE: gl.constexpr):
    if ISSUE:   # masked: past the split's end it copies nothing
        _issue((j + STAGES - 1) % STAGES, next_n0, end, KC, VC, KS, KZ, VS, VZ, cbase, sbase, k_smem, v_smem,
               ks_smem, kz_smem, vs_smem, vz_smem, True, BN)
    else:
        async_copy.commit_group()


@gluon.jit
def _tile_max(t, red_smem, ROWS: gl.constexpr, BN: gl.constexpr):
    """The tile's max per column: over the thread's tokens and the lane rows (shuffles), then over the
    four warps through shared memory (one barrier)."""
    acc_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROWS, 16])
    if BN == 64:
        wmax = gl.max(gl.max(gl.reshape(t, [4, 2, 8, ROWS]), axis=1), axis=1)             # [4 warps, ROWS]
    else:
        wmax = gl.max(gl.max(gl.max(gl.reshape(t, [BN // 64, 4, 2, 8, ROWS]), axis=0), axis=1), axis=1)
    red_smem.store(wmax)
    gl.thread_barrier()
    return gl.convert_layout(gl.max(red_smem.load(exchange_layout(ROWS)), axis=0), gl.SliceLayout(0, acc_s))


@gluon.jit(do_not_specialize=["cache_tokens"])   # one build for every length (kernel.py's foldc_decode_gluon)
def foldc_decode_warpgroup(Q, KC, KS, KZ, VC, VS, VZ, SEQ_LENS, WS_M, WS_L, WS_ACC, stride_qb, stride_qh, stride_cb,
                           stride_ch, stride_sb, stride_sh, qk_scale, tokens_per_split, cache_tokens,
                           HAS_LENS: gl.constexpr, ROWS: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                           QH: gl.constexpr = 0):
    """Program (batch, KV head, split) of four warps: the split's tokens in tiles of BN, each tile's
    scores on wgmma with the key codes as the register A operand and the query in shared memory, P x
    s_tok through shared memory as the value product's B operand. Writes the split's (max in log2
    units, denominator, accumulator) for the merge kernel (eq. 14). stride_sb, stride_sh: the scales' strides
    in rows of eight (16 bytes, the copies' width). QH > 0: the KV head has QH < ROWS query rows; rows QH..
    ROWS - 1 are padding, read as zeros (finite logits of 0), written to the workspace and not merged."""
    D: gl.constexpr = 128
    b = gl.program_id(0)
    h = gl.program_id(1)
    split = gl.program_id(2)
    splits = gl.num_programs(2)
    acc_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROWS, 16])
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([D, ROWS], gl.float16)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, ROWS], gl.float16)
    w_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    r_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    ql: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [4, 1], [0, 1])
    vw_l: gl.constexpr = value_words_layout(BN)
    row_l: gl.constexpr = gl.SliceLayout(0, acc_s)

    # query -> shared memory, in the key operand's k order, field weights 2^-2i and a power of two per row
    k = gl.arange(0, D, layout=gl.SliceLayout(1, ql))
    field = (k >> 4) & 3
    chan = field * 32 + 4 * (2 * ((k >> 1) & 3) + (k >> 6)) + ((k >> 3) & 1) + 2 * (k & 1)
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(0, ql))
    if QH > 0:
        qrow = Q + b * stride_qb + (h * QH + r) * stride_qh
        q = gl.load(qrow[None, :] + chan[:, None], mask=(r < QH)[None, :], other=0.0).to(gl.float32)
    else:
        qrow = Q + b * stride_qb + (h * ROWS + r) * stride_qh
        q = gl.load(qrow[None, :] + chan[:, None]).to(gl.float32)
    qmax = gl.max(gl.abs(q), axis=0)
    e_row = gl.where(qmax > 0, 14.0 - gl.floor(gl.log2(gl.maximum(qmax, 1e-30))), 0.0)
    q16 = (q * gl.exp2(e_row[None, :] - 2.0 * field.to(gl.float32)[:, None])).to(gl.float16)
    q_smem = gl.allocate_shared_memory(gl.float16, [D, ROWS], q_sl, q16)
    p_smem = gl.allocate_shared_memory(gl.float16, [BN, ROWS], p_sl)
    red_smem = gl.allocate_shared_memory(gl.float32, [4, ROWS], r_sl)
    k_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BN, 8], w_sl)
    v_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BN, 8], w_sl)
    ks_smem = gl.allocate_shared_memory(gl.float16, [STAGES, BN // 8, 8], w_sl)
    kz_smem = gl.allocate_shared_memory(gl.float16, [STAGES, BN // 8, 8], w_sl)
    vs_smem = gl.allocate_shared_memory(gl.float16, [STAGES, BN // 8, 8], w_sl)
    vz_smem = gl.allocate_shared_memory(gl.float16, [STAGES, BN // 8, 8], w_sl)
    # logits = row_c x (s_tok x S^T + z_tok x row_z): the MMA's unit 2^24 / 2^e per row, sum(q) per row
    row_c = gl.convert_layout(gl.exp2(24.0 - e_row) * qk_scale, row_l)
    row_z = gl.convert_layout(gl.sum(q, axis=0) * gl.exp2(e_row - 24.0), row_l)

    start = split * tokens_per_split
    if HAS_LENS:
        seq_len = gl.load(SEQ_LENS + b)
    else:
        seq_len = cache_tokens
    end = gl.minimum(start + tokens_per_split, seq_len)
    beta = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, vw_l)))
    sel = gl.zeros([8, 4, BN], gl.int32, layout=vw_l) + \
        (beta | (beta << 4) | ((4 + beta) << 8) | ((4 + beta) << 12))[None, :, None]
    cbase = b * stride_cb + h * stride_ch
    sbase = (b * stride_sb + h * stride_sh) * 8    # strides in 16-byte rows of eight scales

    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_l)
    l_p = gl.zeros([BN // 16, 8, ROWS], gl.float32, layout=partial_layout(BN, ROWS))
    z_p = l_p
    o = gl.zeros([D, ROWS], gl.float32, layout=acc_s)
    full_end = start + (end - start) // BN * BN
    for i in gl.static_range(STAGES - 1):
        _issue(i, start + i * BN, end, KC, VC, KS, KZ, VS, VZ, cbase, sbase, k_smem, v_smem, ks_smem, kz_smem,
               vs_smem, vz_smem, True, BN)
    async_copy.wait_group(STAGES - 2)
    fence_async_shared()
    gl.thread_barrier()
    j = 0
    for n0 in range(start, full_end, BN):
        m_i, l_p, z_p, o = _tile(j, n0, end, n0 + (STAGES - 1) * BN, KC, VC, KS, KZ, VS, VZ, cbase, sbase, k_smem,
                                 v_smem, ks_smem, kz_smem, vs_smem, vz_smem, q_smem, p_smem, red_smem, sel, row_c,
                                 row_z, m_i, l_p, z_p, o, False, ROWS, BN, STAGES, True)
        j += 1
    if full_end < end:
        m_i, l_p, z_p, o = _tile(j, full_end, end, end, KC, VC, KS, KZ, VS, VZ, cbase, sbase, k_smem, v_smem,
                                 ks_smem, kz_smem, vs_smem, vz_smem, q_smem, p_smem, red_smem, sel, row_c,
                                 row_z, m_i, l_p, z_p, o, True, ROWS, BN, STAGES, False)
    async_copy.wait_group(0)

    l_i = gl.convert_layout(gl.sum(gl.sum(l_p, axis=0), axis=0), row_l)
    z_i = gl.convert_layout(gl.sum(gl.sum(z_p, axis=0), axis=0), row_l)
    mm = gl.arange(0, D, layout=gl.SliceLayout(1, acc_s))
    mfield = ((mm >> 3) & 1) + 2 * (mm >> 6)
    mchan = mfield * 32 + (mm & 7) + 8 * ((mm >> 4) & 3)
    res = o * gl.exp2(24.0 - 2.0 * mfield.to(gl.float32))[:, None] + z_i[None, :]
    rr = gl.arange(0, ROWS, layout=row_l)
    base = ((b * gl.num_programs(1) + h) * splits + split) * ROWS
    gl.store(WS_ACC + (base + rr)[None, :] * D + mchan[:, None], res)
    gl.store(WS_M + base + rr, m_i * row_c)
    gl.store(WS_L + base + rr, l_i)
