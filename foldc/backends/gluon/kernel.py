"""The register-operand decode kernel (Gluon, sm_90): codes go from 32-bit words to tensor-core
operands in registers, two codes per LOP3, with no per-value scale or zero.

One program = one warp = one (batch, H packed kv_heads, split). Per tile of BN tokens:
  key side   S^T = K'.Q'^T       M = tokens, N = query rows, K = channels    (eq. 3, 8)
             t = s_tok * S^T * 2^24 / c + z_tok * sum(q)                        (eq. 6, 7)
  softmax    online, per query row (log2 units)                                (eq. 9)
  value side O^T += V'^T.(P * s_tok)^T  M = channels, N = rows, K = tokens       (eq. 4)
             plus sum(P * z_tok) per row                                         (eq. 6)
With KEY_NG / VAL_NG channel groups per token (token-wise sides), each group is a contiguous range
of the K index (key side) or M index (value side) and gets its own MMA: per-group scores scaled by
their group's s_tok before they are added, per-group P * s_tok for the group's output channels.
The codes of both sides enter the MMA as fp16 subnormals (code x 2^-24, exact; operands.py): the
key side's 2^24 rides on the logits' scale, the value side's is undone per output row at the end
(the plan's code biases are 0 on both sides, lower.py). The code
words travel global -> shared memory by cp.async, STAGES tiles ahead; token-wise scales and zeros
are loaded at each tile's start (SCALE_AHEAD=False; with PREFETCH the next tile's go to L2 first)
or one tile ahead in registers (SCALE_AHEAD=True). Each split writes (max, denominator,
accumulator) for the merge kernel (eq. 14), the same workspace the Triton backend uses; with MERGE (an eager call's
cooperative launch, split_merge.py) the programs then merge it themselves. The channel and row maps of
the operands are in operands.py; a tile's key side in tile_scores.py and its softmax and value side in
tile_values.py; the unpack and the group parameters in tile_operands.py; a tile's group loads in
tile_groups.py; dequant plans' per-value rebuild in tile_dequant.py; copies, scale loads, cache
addressing, tile draws and the shared-memory tiles of a plain side in tile_memory.py.

Import this module only where Triton runs natively (not under TRITON_INTERPRET=1).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

# absolute imports: benchmarks load copies of this file as modules of their own (ab_kernel.py)
from foldc.backends.gluon.operands import NARROW_WORDS
from foldc.backends.gluon.tile_memory import (CODE_WORDS, PLAIN_WORDS, copy_layout, draw_chunk, issue_copies,
                                              lane_order_copy_layout, lane_order_smem, next_tile, prefetch_scales,
                                              stage_tail, tile_bases, tile_scales)
from foldc.backends.gluon.tile_dequant import channel_group
from foldc.backends.gluon.tile_groups import (key_query16, key_tile_params, key_tile_params16, load_query, masked_sums,
                                              piece_queries, value_tile_params)
from foldc.backends.gluon.tile_operands import (NARROW, group_sums, split_groups, value_row_channel, value_tile_words,
                                                zeros_groups)
from foldc.backends.gluon.split_merge import merge_splits
from foldc.backends.gluon.tile_scores import tile_scores
from foldc.backends.gluon.tile_values import consume_values


@constexpr_function
def _and_p(heads, dynamic, page, value_plain=False):
    return heads == 2 and not (dynamic and page > 0) and not value_plain


@constexpr_function
def _side_smem(fields):
    """Shared-memory layout of one side's word tiles: codes as written, a plain side swizzled."""
    return PLAIN_WORDS if int(fields) == 0 else CODE_WORDS


@constexpr_function
def _key_smem(fields, BN, W):
    """The key side's word tiles [BN, W] in shared memory: `_side_smem`'s (benchmarks/value_tile_layout.py swaps
    these four functions: each side's tile layout and the layout of the copies that fill it)."""
    return _side_smem(fields)


@constexpr_function
def key_copy_layout(fields, BN, W):
    """cp.async of the key side's word tiles: `copy_layout`'s."""
    return copy_layout(BN, W)


@constexpr_function
def _value_smem(fields, BN, W):
    """The value side's word tiles [BN, value_tile_words(W)] in shared memory (W: words per token in the
    cache). Codes of four words a token: `lane_order_smem`, whose reads meet no bank conflicts (there the
    reads bound the kernel: 1.35x at head_dim 64, INT2, on an H100; docs/perf.md "head_dim 64 and head_dims
    between powers of two"); else `_side_smem`'s, token by token (lane order 1-7% slower at eight words and more)."""
    if int(fields) > 0 and int(W) == NARROW_WORDS:
        return lane_order_smem(BN, value_tile_words(W))
    return _side_smem(fields)


@constexpr_function
def value_copy_layout(fields, BN, W):
    """cp.async of the value side's word tiles (`_value_smem`'s, W words a token in the cache)."""
    if int(fields) > 0 and int(W) == NARROW_WORDS:
        return lane_order_copy_layout(BN, value_tile_words(W))
    return copy_layout(BN, value_tile_words(W) if int(fields) > 0 else W)


@constexpr_function
def _fields(bits):
    """Codes per byte; 0 for a plain (bf16) side, whose "words" are bf16 pairs."""
    return 8 // int(bits) if int(bits) <= 8 else 0


@gluon.jit
def _tile(n0, end, k_smem, v_smem, slot, ks, kz, vs, vz, m_i, l_i, zsum, acc_o, tm, head_c, head_b, q16, q_bias,
          q_sum, row_scale, v_scale, v_zero, BN: gl.constexpr, D: gl.constexpr, KF: gl.constexpr, VF: gl.constexpr,
          ROWS: gl.constexpr,
          H: gl.constexpr, KEY_G: gl.constexpr, VAL_G: gl.constexpr, KASM: gl.constexpr,
          KCONS: gl.constexpr, VA0: gl.constexpr, VA1: gl.constexpr, VA2: gl.constexpr, VA3: gl.constexpr,
          VCONS: gl.constexpr, MASKED: gl.constexpr, AND_P: gl.constexpr, KEY_NG: gl.constexpr,
          VAL_NG: gl.constexpr, KDQ: gl.constexpr = False, VDQ: gl.constexpr = False, LEAN: gl.constexpr = False,
          KMG: gl.constexpr = False, VMG: gl.constexpr = False, DRQ: gl.constexpr = 0,
          PDT: gl.constexpr = gl.bfloat16):
    """One tile, key side then value side (PDT: the dtype of a plain side, the queries')."""
    t = tile_scores(n0, end, k_smem, slot, ks, kz, tm, head_c, q16, q_bias, q_sum, row_scale, BN, D, KF, ROWS, H,
                    KEY_G, KASM, KCONS, MASKED, KEY_NG, KDQ, KMG, DRQ, PDT)
    return consume_values(t, v_smem, slot, vs, vz, m_i, l_i, zsum, acc_o, head_b, v_scale, v_zero, BN, D, VF, ROWS,
                          H, VAL_G, VA0, VA1, VA2, VA3, VCONS, AND_P, VAL_NG, VDQ, LEAN, VMG, DRQ, PDT)


@gluon.jit(do_not_specialize=["cache_tokens"])   # one build for every length: given per call by bound launches
def foldc_decode_gluon(Q, KC, KS, KZ, VC, VS, VZ, SEQ_LENS, WS_M, WS_L, WS_ACC, KV_INDPTR, KV_INDICES, COUNTERS,
                       stride_qb, stride_qh, stride_kb, stride_kh, stride_ksb, stride_ksh, stride_ksn,
                       stride_vb, stride_vh, stride_vsb, stride_vsh, stride_vsn, qk_scale, tokens_per_split,
                       cache_tokens, HAS_LENS: gl.constexpr, PAGE: gl.constexpr, Q_PER_KV: gl.constexpr,
                       ROWS: gl.constexpr,
                       H: gl.constexpr, BN: gl.constexpr,
                       D: gl.constexpr, DR: gl.constexpr, KBITS: gl.constexpr, VBITS: gl.constexpr,
                       KEY_G: gl.constexpr,
                       VAL_G: gl.constexpr, STAGES: gl.constexpr, SCALE_AHEAD: gl.constexpr, KASM: gl.constexpr,
                       KCONS: gl.constexpr, VA0: gl.constexpr, VA1: gl.constexpr, VA2: gl.constexpr,
                       VA3: gl.constexpr, VCONS: gl.constexpr, VALUE_EXP: gl.constexpr, KEY_EXP: gl.constexpr,
                       PREFETCH: gl.constexpr, DYNAMIC: gl.constexpr, CHUNK: gl.constexpr, KEY_NG: gl.constexpr,
                       VAL_NG: gl.constexpr, RB: gl.constexpr, KDQ: gl.constexpr = False,
                       VDQ: gl.constexpr = False, KMG: gl.constexpr = False, VMG: gl.constexpr = False,
                       QH: gl.constexpr = 0, MERGE: gl.constexpr = False):
    # each side's bytes per token per bit field (NB), 32-bit words per token (W), fields per byte (F)
    # (a plain side: KBITS or VBITS 16, fields 0, its words bf16 pairs)
    KNB: gl.constexpr = D * KBITS // 8
    KW: gl.constexpr = KNB // 4
    KF: gl.constexpr = _fields(KBITS)
    VNB: gl.constexpr = D * VBITS // 8
    VW: gl.constexpr = VNB // 4
    VF: gl.constexpr = _fields(VBITS)
    # a head_dim between powers of two (DR) is padded to D channels in the registers: each bit field
    # of a token holds CH channels there and CHR in the cache (the rest zero codes, zero query
    # channels); KWR, VWR: words per token in the cache
    PAD: gl.constexpr = D != DR
    KCH: gl.constexpr = D // KF if KF > 0 else D
    KCHR: gl.constexpr = DR // KF if KF > 0 else DR
    VCH: gl.constexpr = D // VF if VF > 0 else D
    VCHR: gl.constexpr = DR // VF if VF > 0 else DR
    # past 128 channels with both sides channel-wise, or eight token-wise groups beside a channel-wise side:
    # the query is read again at each key group instead of held in float32, and the value groups'
    # parameters are held 16-bit (they spilled 66-147 registers, AOT SASS)
    LEAN: gl.constexpr = D > 128 and ((KEY_G > 0 and VAL_G > 0) or (VAL_G > 0 and KEY_NG > 4) or
                                      (KEY_G > 0 and VAL_NG > 4))
    # 2-bit channel-wise K folded in groups of up to 32 tokens with fp16 scales, up to 128 channels and 8 query rows:
    # each group's query operand by fp16 products, its zero term by one MMA (tile_groups.key_group16: 300 -> 161 SASS
    # a group at 32/8, AOT; 1.04-1.31x on an H100, docs/perf.md). INT4, INT8 and larger groups (no faster, and a few
    # builds spilled), 16 rows and head_dim 256 (spilled), other scale dtypes keep the float32 path (key_group)
    KQ16: gl.constexpr = (KBITS == 2 and KEY_G > 0 and KEY_G <= 32 and not KDQ and D <= 128 and ROWS <= 8 and
                          KS.dtype.element_ty == gl.float16)
    KWR: gl.constexpr = DR * KBITS // 32
    VWR: gl.constexpr = DR * VBITS // 32
    # P masked per head by ANDs with two packed heads: 3.6% fewer instructions per INT2 tile, 1-3% faster
    # at INT2 on the H200 (docs/perf.md). Not with 4 or 8 heads, where ptxas then allocates 207-234
    # registers against 168-226, nor on dynamic paged builds (178 against 168; AOT SASS)
    AND_P: gl.constexpr = _and_p(H, DYNAMIC, PAGE, VF == 0)
    b = gl.program_id(0)
    # the first of the H KV heads this program packs into the MMA's N; with RB row blocks per KV head
    # (more query rows per KV head than the N axis holds; then H == 1) the program takes rows
    # [rb * Q_PER_KV, (rb + 1) * Q_PER_KV) of its head, and q_head0 is the first query head it reads
    # (QH > 0: ragged row blocks, the KV head's QH query rows in blocks of Q_PER_KV, the last one shorter:
    # the rows past its end are padding, read as zeros and not merged)
    h = (gl.program_id(1) // RB) * H
    if QH > 0:
        q_head0 = h * QH + gl.program_id(1) % RB * Q_PER_KV
        real_rows = gl.minimum(QH - gl.program_id(1) % RB * Q_PER_KV, Q_PER_KV)
    else:
        q_head0 = (h * RB + gl.program_id(1) % RB) * Q_PER_KV
        real_rows = Q_PER_KV * H
    s = gl.program_id(2)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    # four-word value tokens: each word copied twice into the tile (load_value_words)
    VWT: gl.constexpr = value_tile_words(VW) if VF > 0 else VW
    kcp_l: gl.constexpr = key_copy_layout(KF, BN, KW)
    vcp_l: gl.constexpr = value_copy_layout(VF, BN, VW)
    row_l: gl.constexpr = gl.SliceLayout(0, mma)
    tok_l: gl.constexpr = gl.SliceLayout(1, mma)

    if HAS_LENS:
        seq_len = gl.minimum(gl.load(SEQ_LENS + b), cache_tokens)   # lengths past the cache are clamped
    else:                                                            # every sequence fills the cache
        seq_len = cache_tokens
    if DYNAMIC:   # every program of a (batch, head group) draws chunks of CHUNK tiles: next_tile
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
    # what tile_bases needs to place a tile, contiguous or paged
    cache = (KC, KS, KZ, VC, VS, VZ)
    table = (first, n_pages, KV_INDICES)
    strides = (stride_kb, stride_kh, stride_ksb, stride_ksh, stride_ksn, stride_vb, stride_vh, stride_vsb, stride_vsh,
               stride_vsn)

    # the first tiles' code words start on their way before the query is read and rescaled, so
    # that the two memory latencies overlap (a program of one or two tiles, at batch 1, waits on both)
    lanes = (gl.arange(0, BN, layout=gl.SliceLayout(1, kcp_l)), gl.arange(0, KW, layout=gl.SliceLayout(0, kcp_l)),
             gl.arange(0, BN, layout=gl.SliceLayout(1, vcp_l)), gl.arange(0, VWT, layout=gl.SliceLayout(0, vcp_l)) % VW)
    k_smem = gl.allocate_shared_memory(gl.int32, [STAGES * H, BN, KW], _key_smem(KF, BN, KW))
    v_smem = gl.allocate_shared_memory(gl.int32, [STAGES * H, BN, VWT], _value_smem(VF, BN, VW))
    if n_full > 0:
        for i in gl.static_range(STAGES - 1):
            n_i = start + gl.minimum(i, n_full - 1) * BN
            k_i, v_i, _, _, _, _ = tile_bases(n_i, b, h, cache, table, strides, KWR, VWR, KEY_G, VAL_G, PAGE, KEY_NG,
                                              VAL_NG)
            issue_copies(i, n_i, k_smem, v_smem, k_i, v_i, stride_kh, stride_vh, lanes, KWR, VWR, H, PAD)
    # the chunk this program takes after its first, drawn now so that its latency hides under the prologue
    drawn = draw_chunk(counter, gl.num_programs(2), n_full > 0, 0, DYNAMIC)

    # Q'^T [D, ROWS]: k index -> channel as operands.key_channel; field weight 2^-(bits*field);
    # each row scaled by a power of two c so that its largest entry is near 2^12 (no fp16 underflow).
    # Row r is query head h * Q_PER_KV + r: the query rows of the H packed KV heads, one after another
    kq = gl.arange(0, D, layout=gl.SliceLayout(1, b_l))
    rq = gl.arange(0, ROWS, layout=gl.SliceLayout(0, b_l))
    # (four words per token: operands.key_k's order, each k's channel loaded where it is used)
    KSWAP: gl.constexpr = KW != NARROW
    if KSWAP:
        field = kq // KNB
        j = kq % KNB
        chan = field * KNB + ((j & ~3) | ((j & 1) << 1) | ((j >> 1) & 1))
        q_off = kq
    else:
        field = 2 * ((kq >> 5) & 1) + ((kq >> 2) & 1)
        chan = field * KNB + 4 * ((kq >> 3) & 3) + ((kq >> 1) & 1) + 2 * (kq & 1)
        q_off = chan
    # each lane's eight consecutive channels in one vector load, then put in k order (swap_k01)
    q_mask = (rq < real_rows)[None, :]
    if PAD:   # the cache's channel of each register channel; the padding reads nothing (zero)
        q_mask = q_mask & (q_off % KCH < KCHR)[:, None]
        q_off = (q_off // KCH) * KCHR + q_off % KCH
    q_nat, qv = load_query(Q, b, stride_qb, q_head0, stride_qh, rq, q_off, q_mask, D, ROWS, KSWAP)
    head_q = gl.minimum(rq // Q_PER_KV, H - 1)                                  # packed head of each row
    head_b = head_q
    head_c = gl.minimum(gl.arange(0, ROWS, layout=row_l) // Q_PER_KV, H - 1)
    if KF == 0:   # plain keys (KEY_G -1): the query as it is, in channel order, the softmax scale per row
        q16 = gl.convert_layout(q_nat, gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2))
        row_scale = gl.convert_layout(gl.full([ROWS], 1.0, gl.float32, layout=gl.SliceLayout(0, b_l)) * qk_scale,
                                      row_l)
        q_bias = row_scale
        q_sum = row_scale
    else:
        amax = gl.maximum(gl.max(gl.abs(qv), axis=0), 1e-30)
        c = gl.exp2(12.0 - gl.floor(gl.log2(amax)))
        row_scale = gl.convert_layout(qk_scale * (2.0 ** KEY_EXP) / c, row_l)
    k_base, v_base, KSp, KZp, VSp, VZp = tile_bases(start, b, h, cache, table, strides, KWR, VWR, KEY_G, VAL_G, PAGE,
                                                    KEY_NG, VAL_NG)
    if KF == 0:
        pass
    elif KEY_G == 0 and KDQ:   # dequant: the query as it is, each row times c (the keys carry the scales)
        q16 = (qv * c[None, :]).to(gl.float16)
        q_bias = row_scale
        q_sum = row_scale
    elif KEY_G == 0:
        q16 = (qv * c[None, :] * gl.exp2(-(field * KBITS).to(gl.float32))[:, None]).to(gl.float16)
        q_bias = row_scale   # subnormal key codes: no bias to remove (q_bias is unused)
        if KEY_NG == 1:
            q_sum = gl.convert_layout(gl.sum(qv, axis=0) * qk_scale, row_l)
        elif KMG:   # groups across the padded bit fields: the whole Q'^T, each group's sum(q) over its channels
            grp_q = channel_group(field, chan, D, KF, KEY_NG, DR)
            q_sum = masked_sums(qv, grp_q, qk_scale, row_l, KEY_NG)
            q16 = piece_queries(q16, grp_q, D, KF, DR, KEY_NG)
        else:   # per channel group: its piece of Q'^T for its own MMA, and its sum(q) (tile_scores)
            q16 = split_groups(q16, KEY_NG, 0)
            q_sum = group_sums(split_groups(qv, KEY_NG, 0), qk_scale, row_l, KEY_NG)
    else:
        if KDQ:   # channel-wise K, dequant: the query times c (fp16) and the logits' factor per row, once
            qv = ((qv * c[None, :]).to(gl.float16), gl.convert_layout(qk_scale / c, row_l))
        if KQ16:   # the query's fixed operands (qv is then key_query16's tuple)
            qv = key_query16(Q, b, stride_qb, q_head0, stride_qh, rq, q_mask, real_rows, qv, field, qk_scale, KBITS,
                             KEY_EXP, D, ROWS, DR)
            q16, q_bias, q_sum = key_tile_params16(qv, chan, head_q, stride_ksh, KSp, KZp, stride_ksn, start, end, H,
                                                   D, ROWS, Q_PER_KV, KSWAP, KCH, KCHR, DR, KEY_G, BN)
        else:
            q16, q_bias, q_sum = key_tile_params(qv, field, chan, head_q, stride_ksh, KSp, KZp, stride_ksn, start,
                                                  end, qk_scale, KBITS, KEY_EXP, H, D, ROWS, KSWAP, KCH, KCHR, KDQ,
                                                  KEY_G, BN)
    # row m of O^T is channel operands.value_channel(m)
    cm = gl.arange(0, D, layout=tok_l)
    if VF == 0:   # plain values: channel order
        chan_o = cm
    else:
        chan_o = value_row_channel(cm, D, VBITS)
    # the value codes enter the MMA as fp16 subnormals code * 2^(bits*field - VALUE_EXP) (operands.py)
    weight_o = gl.exp2((VALUE_EXP - (cm // VNB) * VBITS).to(gl.float32))
    out_ok = None   # every output row is a channel of the cache
    if PAD:   # output row -> the cache's channel; padding rows are computed and not stored
        out_ok = chan_o % VCH < VCHR
        chan_o = (chan_o // VCH) * VCHR + chan_o % VCH
    if VAL_G == 0:
        v_scale = weight_o
        v_zero = weight_o
    else:
        v_scale, v_zero = value_tile_params(VSp, VZp, stride_vsn, start, end, chan_o, weight_o, head_c, out_ok,
                                             stride_vsh, cm, H, PAD, D, VBITS, VDQ, VAL_G, BN, LEAN)

    tm = gl.arange(0, BN, layout=tok_l)

    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_l)
    l_i = gl.zeros([ROWS], gl.float32, layout=row_l)
    zsum = zeros_groups([ROWS], row_l, VAL_NG)   # sum(P x zero) per row (and channel group)
    acc_o = gl.zeros([D, ROWS], gl.float32, layout=mma)
    if n_full > 0:
        if SCALE_AHEAD:   # the first tile's scales; each iteration then loads the next tile's
            ks, kz, vs, vz = tile_scales(start, end, tm, head_c, KSp, KZp, VSp, VZp, stride_ksh, stride_vsh,
                                         KEY_G, VAL_G, H, False, KEY_NG, VAL_NG)
        t = start // BN
        i = 0
        while t < t_stop:
            n0 = t * BN
            if PAGE > 0:   # this tile's page: its group scales
                _, _, KSp, KZp, VSp, VZp = tile_bases(n0, b, h, cache, table, strides, KWR, VWR, KEY_G, VAL_G, PAGE,
                                                      KEY_NG, VAL_NG)
            if KEY_G > 0:
                if n0 % KEY_G == 0:
                    if KQ16:
                        q16, q_bias, q_sum = key_tile_params16(qv, chan, head_q, stride_ksh, KSp, KZp, stride_ksn, n0,
                                                               end, H, D, ROWS, Q_PER_KV, KSWAP, KCH, KCHR, DR, KEY_G,
                                                               BN)
                    else:
                        if LEAN and not KDQ:   # the query read again (L1/L2) at each group: no float32 copy held
                            _, qg = load_query(Q, b, stride_qb, q_head0, stride_qh, rq, q_off, q_mask, D, ROWS, KSWAP)
                        else:
                            qg = qv
                        q16, q_bias, q_sum = key_tile_params(qg, field, chan, head_q, stride_ksh, KSp, KZp, stride_ksn,
                                                              n0, end, qk_scale, KBITS, KEY_EXP, H, D, ROWS,
                                                              KSWAP, KCH, KCHR, KDQ, KEY_G, BN)
            if VAL_G > 0:
                if n0 % VAL_G == 0:
                    v_scale, v_zero = value_tile_params(VSp, VZp, stride_vsn, n0, end, chan_o, weight_o, head_c,
                                                         out_ok, stride_vsh, cm, H, PAD, D, VBITS, VDQ, VAL_G, BN, LEAN)
            t_next, drawn = next_tile(t, drawn, t_stop, counter, gl.num_programs(2), CHUNK, DYNAMIC)
            if DYNAMIC:   # STAGES == 2: the tile copied ahead is the next one
                t_ahead = t_next
            else:
                t_ahead = t + STAGES - 1
            n_next = gl.minimum(t_next, t_stop - 1) * BN
            n_ahead = gl.minimum(t_ahead, t_stop - 1) * BN
            ahead = i + STAGES - 1
            if PAGE > 0:   # the pages of the next tile (its scales) and of the tile copied ahead
                _, _, KSn, KZn, VSn, VZn = tile_bases(n_next, b, h, cache, table, strides, KWR, VWR, KEY_G, VAL_G, PAGE,
                                                      KEY_NG, VAL_NG)
                k_a, v_a, _, _, _, _ = tile_bases(n_ahead, b, h, cache, table, strides, KWR, VWR, KEY_G, VAL_G, PAGE,
                                                  KEY_NG, VAL_NG)
            else:
                KSn = KSp
                KZn = KZp
                VSn = VSp
                VZn = VZp
                k_a = k_base
                v_a = v_base
            if SCALE_AHEAD:   # one tile ahead, in registers
                ks2, kz2, vs2, vz2 = tile_scales(n_next, end, tm, head_c, KSn, KZn, VSn, VZn, stride_ksh, stride_vsh,
                                             KEY_G, VAL_G, H, False, KEY_NG, VAL_NG)
            else:             # this tile's, loaded now: fewer live registers, the latency under the key side
                ks, kz, vs, vz = tile_scales(n0, end, tm, head_c, KSp, KZp, VSp, VZp, stride_ksh, stride_vsh,
                                             KEY_G, VAL_G, H, False, KEY_NG, VAL_NG)
            gl.thread_barrier()   # every lane is done reading the stage the next copy overwrites
            if DYNAMIC:   # past the last tile: an empty copy group (the last tile may be a DRAM read away)
                if t_ahead < t_stop:
                    issue_copies(ahead % STAGES, n_ahead, k_smem, v_smem, k_a, v_a, stride_kh, stride_vh, lanes, KWR,
                                 VWR, H, PAD)
                else:
                    async_copy.commit_group()
            else:         # a copy of the last tile again, just read: from L2
                issue_copies(ahead % STAGES, n_ahead, k_smem, v_smem, k_a, v_a, stride_kh, stride_vh, lanes, KWR, VWR,
                             H, PAD)
            if PREFETCH and not SCALE_AHEAD:   # the next tile's scales on their way to L2 (loaded at its start);
                if (KEY_G == 0 or VAL_G == 0) and PAGE == 0:   # not measured on pages, where it costs 7% more SASS
                    prefetch_scales(n_next, KSn, KZn, VSn, VZn, stride_ksh, stride_vsh, KEY_G, VAL_G, H, BN)
            async_copy.wait_group(STAGES - 1)
            gl.thread_barrier()   # tile i's words, copied by every lane, are visible
            m_i, l_i, zsum, acc_o = _tile(n0, end, k_smem, v_smem, (i % STAGES) * H, ks, kz, vs, vz, m_i, l_i, zsum,
                                          acc_o, tm, head_c, head_b, q16, q_bias, q_sum, row_scale, v_scale, v_zero,
                                          BN, D, KF, VF, ROWS, H, KEY_G, VAL_G, KASM, KCONS, VA0, VA1, VA2, VA3,
                                          VCONS, False, AND_P, KEY_NG, VAL_NG, KDQ, VDQ, LEAN, KMG, VMG, DR,
                                          Q.dtype.element_ty)
            if SCALE_AHEAD:
                ks, kz, vs, vz = ks2, kz2, vs2, vz2
            t = t_next
            i += 1
        async_copy.wait_group(0)
    full_end = t_stop * BN
    if full_end < end:
        if PAGE > 0:
            k_base, v_base, KSp, KZp, VSp, VZp = tile_bases(full_end, b, h, cache, table, strides, KWR, VWR, KEY_G,
                                                            VAL_G, PAGE, KEY_NG, VAL_NG)
        if KQ16:
            q16, q_bias, q_sum = key_tile_params16(qv, chan, head_q, stride_ksh, KSp, KZp, stride_ksn, full_end, end, H,
                                                   D, ROWS, Q_PER_KV, KSWAP, KCH, KCHR, DR, KEY_G, BN)
        elif KEY_G > 0:
            if LEAN and not KDQ:
                _, qg = load_query(Q, b, stride_qb, q_head0, stride_qh, rq, q_off, q_mask, D, ROWS, KSWAP)
            else:
                qg = qv
            q16, q_bias, q_sum = key_tile_params(qg, field, chan, head_q, stride_ksh, KSp, KZp, stride_ksn, full_end,
                                                  end, qk_scale, KBITS, KEY_EXP, H, D, ROWS, KSWAP, KCH, KCHR,
                                                  KDQ, KEY_G, BN)
        if VAL_G > 0:
            v_scale, v_zero = value_tile_params(VSp, VZp, stride_vsn, full_end, end, chan_o, weight_o, head_c, out_ok,
                                                 stride_vsh, cm, H, PAD, D, VBITS, VDQ, VAL_G, BN, LEAN)
        ks, kz, vs, vz = tile_scales(full_end, end, tm, head_c, KSp, KZp, VSp, VZp, stride_ksh, stride_vsh,
                                     KEY_G, VAL_G, H, True, KEY_NG, VAL_NG)
        stage_tail(full_end, end, k_smem, v_smem, k_base, v_base, stride_kh, stride_vh, lanes, KWR, VWR, H, PAD)
        m_i, l_i, zsum, acc_o = _tile(full_end, end, k_smem, v_smem, 0, ks, kz, vs, vz, m_i, l_i, zsum, acc_o, tm,
                                      head_c, head_b, q16, q_bias, q_sum, row_scale, v_scale, v_zero, BN, D, KF, VF, ROWS,
                                      H, KEY_G, VAL_G, KASM, KCONS, VA0, VA1, VA2, VA3, VCONS, True,
                                      AND_P, KEY_NG, VAL_NG, KDQ, VDQ, LEAN, KMG, VMG, DR, Q.dtype.element_ty)

    # token-wise V: undo the field weights 2^(bits*field) per output row, add the zero term (eq. 6);
    # channel-wise V has both in acc_o already. The workspace sees the H packed heads as one head
    # of H * Q_PER_KV query rows (the merge kernel is launched so)
    rr = gl.arange(0, ROWS, layout=row_l)
    if VAL_G == 0 and not VDQ:
        if VAL_NG == 1:
            zrow = zsum[None, :]
        else:   # row m of O^T is channel chan_o[m], in group chan_o[m] // (D // VAL_NG)
            zrow = gl.zeros([D, ROWS], gl.float32, layout=mma)
            if VMG:                 # groups across a padded head_dim's bit fields: the cache's channel
                row_group = chan_o // (DR // VAL_NG)
            elif D // VAL_NG < VNB:   # groups smaller than a bit field
                row_group = chan_o // (D // VAL_NG)
            else:                   # whole fields: consecutive rows
                row_group = cm // (D // VAL_NG)
            for g in gl.static_range(VAL_NG):
                zrow = gl.where((row_group == g)[:, None], zsum[g][None, :], zrow)
        res = acc_o * weight_o[:, None] + zrow
    else:   # channel-wise V, or a dequant plan's: the scales and zeros are in acc_o
        res = acc_o
    base = ((b * gl.num_programs(1) + gl.program_id(1)) * gl.num_programs(2) + s) * ROWS
    if PAD:
        out_ok = out_ok[:, None]
    gl.store(WS_ACC + (base + rr)[None, :] * DR + chan_o[:, None], res, mask=out_ok)
    gl.store(WS_M + base + rr, m_i)
    gl.store(WS_L + base + rr, l_i)
    if MERGE:   # the call's splits merged here, by every program after all have written (split_merge.py): a
        # contiguous launch leaves the page-table and tile-counter arguments unread, which then take the output,
        # its log-sum-exp and the barrier's counters
        merge_splits(KV_INDPTR, KV_INDICES, COUNTERS, WS_M, WS_L, WS_ACC, b, s, ROWS, DR, Q_PER_KV * H)
