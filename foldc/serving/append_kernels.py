"""The quantize-on-append kernels that foldc/serving/append.py plans and launches (its docstring gives the
numerics): the token-wise kernel (a scale row per token; with PAIR, keys and values in one launch, each of its own
token-wise encoding) and the channel-wise kernel (a scale row per group of tokens).

The kernels are plain functions wrapped on first use (`kernel`) as a JITFunction (GPU) or an InterpretedFunction
(CPU), so one process can run both (see foldc/backends/runtime/modules.py, interpreter); the token kernel's body,
`_quantize_token_block`, is wrapped in the same mode and put in the kernel's own copy of this module's globals.
Their tensors come first (a bound launch passes them as addresses, `FastLaunch.bind`), and the token offset is not
specialised on (one build for every offset: a bound launch takes it per call).
"""
from __future__ import annotations

import triton.language as tl

from ..backends.runtime.modules import with_globals


def _store_scale_zero(s_ptr, z_ptr, raw_scale, lo, mask, SCALE_KIND: tl.constexpr):
    """Store a block's scales and zeros in the encoding's dtype (SCALE_KIND 0 float16, 1 bfloat16 as its int16
    bits, 2 float32), rounded to nearest even; returns them as float32, as stored (what the codes divide by)."""
    if SCALE_KIND == 0:  # float16: round to nearest even by the cast
        s_lo = raw_scale.to(tl.float16)
        z_lo = lo.to(tl.float16)
        tl.store(s_ptr, s_lo, mask=mask)
        tl.store(z_ptr, z_lo, mask=mask)
        scale = s_lo.to(tl.float32)
        zero = z_lo.to(tl.float32)
    elif SCALE_KIND == 1:  # bfloat16 on its bits: round the float32 pattern to nearest even
        s_bits = raw_scale.to(tl.uint32, bitcast=True)
        s_bits = (s_bits + 0x7FFF + ((s_bits >> 16) & 1)) >> 16
        z_bits = lo.to(tl.uint32, bitcast=True)
        z_bits = (z_bits + 0x7FFF + ((z_bits >> 16) & 1)) >> 16
        tl.store(s_ptr, s_bits.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
        tl.store(z_ptr, z_bits.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
        scale = (s_bits << 16).to(tl.float32, bitcast=True)
        zero = (z_bits << 16).to(tl.float32, bitcast=True)
    else:  # float32: nothing to round
        tl.store(s_ptr, raw_scale, mask=mask)
        tl.store(z_ptr, lo, mask=mask)
        scale = raw_scale
        zero = lo
    return scale, zero


def _codes(x, scale, zero, MAX_CODE: tl.constexpr):
    """round((x - zero) / scale), half to even, clamped to [0, MAX_CODE], as int32 (0 where scale is not positive:
    a constant group)."""
    nonzero = scale > 0
    v = tl.math.div_rn(x - zero, tl.where(nonzero, scale, 1.0))
    f = tl.floor(v)  # round half to even from floor: exact for every float32
    frac = v - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    r = tl.where((frac > 0.5) | ((frac == 0.5) & odd), f + 1.0, f)
    r = tl.minimum(tl.maximum(r, 0.0), MAX_CODE * 1.0)
    return tl.where(nonzero, r, 0.0).to(tl.int32)


def _quantize_token_block(
    X, CODES, SCALE, ZERO, KV_INDPTR, KV_INDICES, COUNTS, FLAG, b, h, start,
    stride_xb, stride_xh, stride_xn, stride_cb, stride_ch, stride_cn,
    stride_sb, stride_sh, stride_sn, stride_zb, stride_zh, stride_zn, tokens, capacity, entries,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, NUM_GROUPS: tl.constexpr, BITS: tl.constexpr,
    CPB: tl.constexpr, MAX_CODE: tl.constexpr, BLOCK_T: tl.constexpr, X_BF16: tl.constexpr,
    SCALE_KIND: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_COUNT: tl.constexpr,
    GROUP_P: tl.constexpr, NUM_GROUPS_P: tl.constexpr, WIDTH_P: tl.constexpr, HAS_FLAG: tl.constexpr,
):
    """BLOCK_T new tokens (token block ``program_id(1)``) of row ``b``, head ``h`` of X quantized into CODES,
    SCALE and ZERO at token ``start`` on, in one token-wise encoding (the constexprs; see `_append_token_kernel`)."""
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < tokens
    PADDED: tl.constexpr = GROUP_P != GROUP or NUM_GROUPS_P != NUM_GROUPS or WIDTH_P != HEAD_DIM // CPB
    g_idx = tl.arange(0, NUM_GROUPS_P)
    cols = g_idx[:, None] * GROUP + tl.arange(0, GROUP_P)[None, :]  # channel = g * GROUP + e
    col_ok = (g_idx < NUM_GROUPS)[:, None] & (tl.arange(0, GROUP_P) < GROUP)[None, :]
    x_ptr = X + b * stride_xb + h * stride_xh + t[:, None, None].to(tl.int64) * stride_xn + cols[None, :, :]
    x_mask = t_ok[:, None, None] & col_ok[None, :, :]
    if X_BF16:  # bf16 bits << 16 is the float32 value, exactly (the interpreter's own bf16 is broken)
        bits = tl.load(x_ptr, mask=x_mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
        x = (bits << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(x_ptr, mask=x_mask, other=0.0).to(tl.float32)
    if PADDED:
        lo = tl.min(tl.where(col_ok[None, :, :], x, float("inf")), axis=2)  # [BLOCK_T, NUM_GROUPS_P]
        hi = tl.max(tl.where(col_ok[None, :, :], x, float("-inf")), axis=2)
    else:
        lo = tl.min(x, axis=2)  # [BLOCK_T, NUM_GROUPS]
        hi = tl.max(x, axis=2)
    raw_scale = tl.math.div_rn(hi - lo, tl.zeros_like(lo) + MAX_CODE)
    # a group holding NaN or Inf stores NaN scale and zero (min/max would drop a NaN): attention
    # over it is then NaN, as over the raw values, never a finite wrong number
    bad = tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=2) > 0
    lo = tl.where(bad, float("nan"), lo)
    raw_scale = tl.where(bad, float("nan"), raw_scale)
    if HAS_COUNT:
        t_ok = t_ok & (t < tl.load(COUNTS + b))
    pos = (start + t).to(tl.int64)
    if PAGED:
        first = tl.load(KV_INDPTR + b).to(tl.int64)
        entry = first + pos // PAGE_SIZE
        # a negative position has no page (and pos // PAGE_SIZE rounds toward 0 there): not written; nor is a
        # token whose table entry lies outside kv_indices' ``entries`` (a kv_indptr past the table: never read)
        t_ok = t_ok & (pos >= 0) & (pos // PAGE_SIZE < tl.load(KV_INDPTR + b + 1) - first)
        t_ok = t_ok & (entry >= 0) & (entry < entries)
        dst = tl.load(KV_INDICES + entry, mask=t_ok, other=0).to(tl.int64)
        t_ok = t_ok & (dst >= 0) & (dst < capacity)   # (capacity: the pool's pages) a page outside it: not written
        row = pos % PAGE_SIZE
    else:
        t_ok = t_ok & (pos >= 0) & (pos < capacity)
        dst = tl.zeros([BLOCK_T], tl.int64) + b
        row = pos
    s_ptr = SCALE + dst[:, None] * stride_sb + h * stride_sh + row[:, None] * stride_sn + g_idx[None, :]
    z_ptr = ZERO + dst[:, None] * stride_zb + h * stride_zh + row[:, None] * stride_zn + g_idx[None, :]
    p_mask = t_ok[:, None] & (g_idx < NUM_GROUPS)[None, :]
    scale, zero = _store_scale_zero(s_ptr, z_ptr, raw_scale, lo, p_mask, SCALE_KIND)
    if HAS_FLAG:
        wrong = (scale != scale) | (tl.abs(scale) == float("inf")) | (zero != zero) | (tl.abs(zero) == float("inf"))
        n_wrong = tl.sum(tl.sum((wrong & p_mask).to(tl.int32), axis=1), axis=0)
        tl.store(FLAG, 1, mask=n_wrong > 0)
    shifts = tl.arange(0, CPB) * BITS
    if PADDED:
        # the codes in planar order [t, i, j] = channel i * HEAD_DIM/CPB + j, each with its own group's
        # scale and zero (a select over the NUM_GROUPS groups)
        WIDTH: tl.constexpr = HEAD_DIM // CPB
        j = tl.arange(0, WIDTH_P)
        chan = tl.arange(0, CPB)[:, None] * WIDTH + j[None, :]
        ch_ok = (j < WIDTH)[None, :]
        xp_ptr = X + b * stride_xb + h * stride_xh + t[:, None, None].to(tl.int64) * stride_xn + chan[None, :, :]
        xp_mask = t_ok[:, None, None] & ch_ok[None, :, :]
        if X_BF16:
            bits = tl.load(xp_ptr, mask=xp_mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
            xp = (bits << 16).to(tl.float32, bitcast=True)
        else:
            xp = tl.load(xp_ptr, mask=xp_mask, other=0.0).to(tl.float32)
        grp = chan // GROUP
        s_el = tl.zeros([BLOCK_T, CPB, WIDTH_P], tl.float32)
        z_el = tl.zeros([BLOCK_T, CPB, WIDTH_P], tl.float32)
        for g in tl.static_range(NUM_GROUPS):
            s_g = tl.sum(tl.where(g_idx[None, :] == g, scale, 0.0), axis=1)
            z_g = tl.sum(tl.where(g_idx[None, :] == g, zero, 0.0), axis=1)
            s_el = tl.where((grp == g)[None, :, :], s_g[:, None, None], s_el)
            z_el = tl.where((grp == g)[None, :, :], z_g[:, None, None], z_el)
        code = _codes(xp, s_el, z_el, MAX_CODE)
        packed = tl.sum(code << shifts[None, :, None], axis=1)  # disjoint bit fields: sum == or
        c_ptr = CODES + dst[:, None] * stride_cb + h * stride_ch + row[:, None] * stride_cn + j[None, :]
        tl.store(c_ptr, packed.to(tl.uint8), mask=t_ok[:, None] & ch_ok)
    else:
        code = _codes(x, scale[:, :, None], zero[:, :, None], MAX_CODE)  # [BLOCK_T, NUM_GROUPS, GROUP]
        planar = tl.reshape(code, [BLOCK_T, CPB, HEAD_DIM // CPB])  # [t, i, j] = channel i * HEAD_DIM/CPB + j
        packed = tl.sum(planar << shifts[None, :, None], axis=1)  # disjoint bit fields: sum == or
        c_ptr = CODES + dst[:, None] * stride_cb + h * stride_ch + row[:, None] * stride_cn + \
            tl.arange(0, HEAD_DIM // CPB)[None, :]
        tl.store(c_ptr, packed.to(tl.uint8), mask=t_ok[:, None])


def _append_token_kernel(
    X, CODES, SCALE, ZERO, OFFSETS, KV_INDPTR, KV_INDICES, COUNTS, FLAG, X2, CODES2, SCALE2, ZERO2, ARRIVALS,
    stride_xb, stride_xh, stride_xn, stride_cb, stride_ch, stride_cn,
    stride_sb, stride_sh, stride_sn, stride_zb, stride_zh, stride_zn,
    offset, tokens, heads, capacity, entries,
    stride_x2b, stride_x2h, stride_x2n, stride_c2b, stride_c2h, stride_c2n,
    stride_s2b, stride_s2h, stride_s2n, stride_z2b, stride_z2h, stride_z2n,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, NUM_GROUPS: tl.constexpr, BITS: tl.constexpr,
    CPB: tl.constexpr, MAX_CODE: tl.constexpr, BLOCK_T: tl.constexpr, X_BF16: tl.constexpr,
    SCALE_KIND: tl.constexpr, PER_ROW: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_COUNT: tl.constexpr, GROUP_P: tl.constexpr, NUM_GROUPS_P: tl.constexpr, WIDTH_P: tl.constexpr,
    HAS_FLAG: tl.constexpr = False, PAIR: tl.constexpr = False, ADVANCE: tl.constexpr = False,
    GROUP2: tl.constexpr = 0, NUM_GROUPS2: tl.constexpr = 0, BITS2: tl.constexpr = 0, CPB2: tl.constexpr = 0,
    MAX_CODE2: tl.constexpr = 0, SCALE_KIND2: tl.constexpr = 0, GROUP_P2: tl.constexpr = 0,
    NUM_GROUPS_P2: tl.constexpr = 0, WIDTH_P2: tl.constexpr = 0, SAME2: tl.constexpr = False,
):
    """One program: BLOCK_T new tokens of one (batch, kv head); each token row is cut into
    NUM_GROUPS groups of GROUP channels. PAGED: token positions map through the page table
    (paged.py); tokens past the row's own pages, or on a page index outside [0, capacity) (the pool's pages),
    are not written; else positions outside [0, capacity) are not written. HAS_COUNT: row b writes only its first COUNTS[b] tokens.
    HAS_FLAG: a written scale or zero that is not finite after rounding to its dtype (NaN or Inf in
    x, or a value past the scale dtype's range) stores 1 to FLAG[0] (the caches' deferred check).
    GROUP_P, NUM_GROUPS_P, WIDTH_P: the powers of two tl.arange takes for GROUP, NUM_GROUPS and the
    HEAD_DIM // CPB bytes of a token (equal to them for head_dims and groups that are powers of two;
    else the padding is masked and the codes are rebuilt in planar order, each with its group's scale).
    PAIR: the grid's first axis is doubled and its second half writes X2 into CODES2, SCALE2, ZERO2 (the values
    beside the keys: one launch for both) in the second token-wise encoding, GROUP2 ... WIDTH_P2 (SAME2 where they
    equal the first's: one body, the second half's tensors and strides selected per program), with strides of their own (stride_x2b ... stride_z2n; X2 of X's dtype
    and shape). Without PAIR those are not read and the second half is not compiled.
    ADVANCE (with PER_ROW, without HAS_COUNT): the launch moves each row's offset on by ``tokens`` itself. Every
    program counts itself in ARRIVALS[b] (int32, zero between launches) once it has read OFFSETS[b]; the row's
    last program to arrive stores OFFSETS[b] + tokens and sets ARRIVALS[b] back to zero (a decode step's
    ``offsets += 1`` without a launch of its own, and captured with the step)."""
    pid = tl.program_id(0)
    if PAIR:
        half = tl.num_programs(0) // 2
        pid = pid % half   # both halves: the same (batch, kv head)
    b = (pid // heads).to(tl.int64)
    h = (pid % heads).to(tl.int64)
    if PER_ROW:
        start = tl.load(OFFSETS + b).to(tl.int64)
    else:
        start = offset
    if PAIR and not SAME2:
        # two encodings: a body each (constexpr branches, so that a launch without a pair, or of one encoding,
        # compiles one body; a runtime `if` alone would compile the values' branch with their constants unset)
        if tl.program_id(0) >= half:   # the values, in their own encoding
            _quantize_token_block(
                X2, CODES2, SCALE2, ZERO2, KV_INDPTR, KV_INDICES, COUNTS, FLAG, b, h, start,
                stride_x2b, stride_x2h, stride_x2n, stride_c2b, stride_c2h, stride_c2n,
                stride_s2b, stride_s2h, stride_s2n, stride_z2b, stride_z2h, stride_z2n, tokens, capacity, entries,
                HEAD_DIM, GROUP2, NUM_GROUPS2, BITS2, CPB2, MAX_CODE2, BLOCK_T, X_BF16, SCALE_KIND2, PAGED,
                PAGE_SIZE, HAS_COUNT, GROUP_P2, NUM_GROUPS_P2, WIDTH_P2, HAS_FLAG)
        else:
            _quantize_token_block(
                X, CODES, SCALE, ZERO, KV_INDPTR, KV_INDICES, COUNTS, FLAG, b, h, start,
                stride_xb, stride_xh, stride_xn, stride_cb, stride_ch, stride_cn,
                stride_sb, stride_sh, stride_sn, stride_zb, stride_zh, stride_zn, tokens, capacity, entries,
                HEAD_DIM, GROUP, NUM_GROUPS, BITS, CPB, MAX_CODE, BLOCK_T, X_BF16, SCALE_KIND, PAGED,
                PAGE_SIZE, HAS_COUNT, GROUP_P, NUM_GROUPS_P, WIDTH_P, HAS_FLAG)
    else:
        if PAIR:   # one encoding (SAME2): the second half's tensors and strides stand in for the first's
            values = tl.program_id(0) >= half
            if values:
                X = X2
                CODES = CODES2
                SCALE = SCALE2
                ZERO = ZERO2
            stride_xb, stride_xh, stride_xn = (tl.where(values, stride_x2b, stride_xb),
                                               tl.where(values, stride_x2h, stride_xh),
                                               tl.where(values, stride_x2n, stride_xn))
            stride_cb, stride_ch, stride_cn = (tl.where(values, stride_c2b, stride_cb),
                                               tl.where(values, stride_c2h, stride_ch),
                                               tl.where(values, stride_c2n, stride_cn))
            stride_sb, stride_sh, stride_sn = (tl.where(values, stride_s2b, stride_sb),
                                               tl.where(values, stride_s2h, stride_sh),
                                               tl.where(values, stride_s2n, stride_sn))
            stride_zb, stride_zh, stride_zn = (tl.where(values, stride_z2b, stride_zb),
                                               tl.where(values, stride_z2h, stride_zh),
                                               tl.where(values, stride_z2n, stride_zn))
        _quantize_token_block(
            X, CODES, SCALE, ZERO, KV_INDPTR, KV_INDICES, COUNTS, FLAG, b, h, start,
            stride_xb, stride_xh, stride_xn, stride_cb, stride_ch, stride_cn,
            stride_sb, stride_sh, stride_sn, stride_zb, stride_zh, stride_zn, tokens, capacity, entries,
            HEAD_DIM, GROUP, NUM_GROUPS, BITS, CPB, MAX_CODE, BLOCK_T, X_BF16, SCALE_KIND, PAGED,
            PAGE_SIZE, HAS_COUNT, GROUP_P, NUM_GROUPS_P, WIDTH_P, HAS_FLAG)
    if ADVANCE:
        # every thread of the program has read OFFSETS[b] before the barrier; the release half of the
        # counter's acq_rel publishes that, its acquire half lets the last program see every other's
        tl.debug_barrier()
        arrivals = (2 if PAIR else 1) * heads * tl.num_programs(1)
        arrived = tl.atomic_add(ARRIVALS + b, 1, sem="acq_rel", scope="gpu")
        last = arrived == arrivals - 1
        tl.store(OFFSETS + b, (start + tokens).to(tl.int32), mask=last)
        tl.store(ARRIVALS + b, 0, mask=last)


def _append_channel_kernel(
    X, CODES, SCALE, ZERO, OFFSETS, KV_INDPTR, KV_INDICES, COUNTS, FLAG, X2, CODES2, SCALE2, ZERO2, ARRIVALS,
    stride_xb, stride_xh, stride_xn, stride_cb, stride_ch, stride_cn,
    stride_sb, stride_sh, stride_sn, stride_zb, stride_zh, stride_zn,
    offset, heads, capacity, entries,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr, CPB: tl.constexpr,
    MAX_CODE: tl.constexpr, BLOCK_T: tl.constexpr, X_BF16: tl.constexpr, SCALE_KIND: tl.constexpr,
    PER_ROW: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_COUNT: tl.constexpr,
    WIDTH_P: tl.constexpr, HAS_FLAG: tl.constexpr = False,
):
    """One program: one whole group of GROUP new tokens of one (batch, kv head), all channels,
    held in planar order [CPB, HEAD_DIM // CPB]; two passes over the group's tokens (min/max,
    then codes). HAS_FLAG: as the token kernel's. X2, CODES2, SCALE2, ZERO2, ARRIVALS: the token kernel's pair and
    advance (not read)."""
    pid = tl.program_id(0)
    b = (pid // heads).to(tl.int64)
    h = (pid % heads).to(tl.int64)
    grp = tl.program_id(1).to(tl.int64)
    if PER_ROW:
        start = tl.load(OFFSETS + b).to(tl.int64)
    else:
        start = offset
    WIDTH: tl.constexpr = HEAD_DIM // CPB
    chan = tl.arange(0, CPB)[:, None] * WIDTH + tl.arange(0, WIDTH_P)[None, :]
    ch_ok = (tl.arange(0, WIDTH_P) < WIDTH)[None, :]   # all true unless WIDTH is no power of two
    x_base = X + b * stride_xb + h * stride_xh + grp * GROUP * stride_xn
    lo = tl.full([CPB, WIDTH_P], float("inf"), tl.float32)
    hi = tl.full([CPB, WIDTH_P], float("-inf"), tl.float32)
    bad = tl.zeros([CPB, WIDTH_P], tl.int32)   # channels whose group holds NaN or Inf
    for t0 in range(0, GROUP, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < GROUP
        x_ptr = x_base + t[:, None, None].to(tl.int64) * stride_xn + chan[None, :, :]
        if X_BF16:
            bits = tl.load(x_ptr, mask=t_ok[:, None, None] & ch_ok[None, :, :], other=0).to(tl.uint16, bitcast=True)
            x = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            x = tl.load(x_ptr, mask=t_ok[:, None, None] & ch_ok[None, :, :], other=0.0).to(tl.float32)
        lo = tl.minimum(lo, tl.min(tl.where(t_ok[:, None, None], x, float("inf")), axis=0))
        hi = tl.maximum(hi, tl.max(tl.where(t_ok[:, None, None], x, float("-inf")), axis=0))
        nonfinite = ((x != x) | (tl.abs(x) == float("inf"))) & t_ok[:, None, None]
        bad = tl.maximum(bad, tl.max(nonfinite.to(tl.int32), axis=0))
    raw_scale = tl.math.div_rn(hi - lo, tl.zeros_like(lo) + MAX_CODE)
    lo = tl.where(bad > 0, float("nan"), lo)             # NaN scale and zero: see the token kernel
    raw_scale = tl.where(bad > 0, float("nan"), raw_scale)
    pos0 = start + grp * GROUP  # the group's first token (a page holds whole groups)
    ok = pos0 >= 0
    if HAS_COUNT:   # whole groups within the row's count (a group the count ends in is not written)
        ok = ok & ((grp + 1) * GROUP <= tl.load(COUNTS + b))
    if PAGED:
        first = tl.load(KV_INDPTR + b).to(tl.int64)
        entry = first + pos0 // PAGE_SIZE
        # a group off a group boundary would run past its page into the next one: not written; nor one whose
        # table entry lies outside kv_indices' ``entries`` (never read)
        ok = ok & (pos0 % GROUP == 0) & (pos0 // PAGE_SIZE < tl.load(KV_INDPTR + b + 1) - first)
        ok = ok & (entry >= 0) & (entry < entries)
        dst = tl.load(KV_INDICES + entry, mask=ok, other=0).to(tl.int64)
        ok = ok & (dst >= 0) & (dst < capacity)   # (capacity: the pool's pages) a page outside it: not written
        row0 = pos0 % PAGE_SIZE
    else:  # a whole group inside [0, capacity), starting a group
        ok = ok & (pos0 % GROUP == 0) & (pos0 + GROUP <= capacity)
        dst = b
        row0 = pos0
    g_mask = ch_ok & ok
    prow = row0 // GROUP
    s_ptr = SCALE + dst * stride_sb + h * stride_sh + prow * stride_sn + chan
    z_ptr = ZERO + dst * stride_zb + h * stride_zh + prow * stride_zn + chan
    scale, zero = _store_scale_zero(s_ptr, z_ptr, raw_scale, lo, g_mask, SCALE_KIND)
    if HAS_FLAG:
        wrong = (scale != scale) | (tl.abs(scale) == float("inf")) | (zero != zero) | (tl.abs(zero) == float("inf"))
        n_wrong = tl.sum(tl.sum((wrong & g_mask).to(tl.int32), axis=1), axis=0)
        tl.store(FLAG, 1, mask=n_wrong > 0)
    shifts = tl.arange(0, CPB) * BITS
    c_base = CODES + dst * stride_cb + h * stride_ch
    for t0 in range(0, GROUP, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < GROUP
        x_ptr = x_base + t[:, None, None].to(tl.int64) * stride_xn + chan[None, :, :]
        if X_BF16:
            bits = tl.load(x_ptr, mask=t_ok[:, None, None] & ch_ok[None, :, :], other=0).to(tl.uint16, bitcast=True)
            x = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            x = tl.load(x_ptr, mask=t_ok[:, None, None] & ch_ok[None, :, :], other=0.0).to(tl.float32)
        code = _codes(x, scale[None, :, :], zero[None, :, :], MAX_CODE)  # [BLOCK_T, CPB, WIDTH_P]
        packed = tl.sum(code << shifts[None, :, None], axis=1)
        row = row0 + t.to(tl.int64)
        tl.store(c_base + row[:, None] * stride_cn + tl.arange(0, WIDTH_P)[None, :], packed.to(tl.uint8),
                 mask=t_ok[:, None] & ok & ch_ok)


_WRAPPED: dict[tuple[str, bool], object] = {}


def kernel(name: str, interpret: bool):
    """The kernel ``name`` ("token" or "channel") as a JITFunction (native) or an InterpretedFunction
    (interpreter): a copy of the kernel whose globals name its callees (`_store_scale_zero`, `_codes` and the token
    kernel's body, `_quantize_token_block`, itself such a copy) wrapped in the same mode (a JITFunction calls
    JITFunctions, an interpreted kernel calls InterpretedFunctions)."""
    key = (name, interpret)
    if key not in _WRAPPED:
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            def wrap(fn, **kw):
                return InterpretedFunction(fn)
        else:
            from triton.runtime.jit import JITFunction as wrap
        helpers = dict(_store_scale_zero=wrap(_store_scale_zero), _codes=wrap(_codes))
        fn = {"token": _append_token_kernel, "channel": _append_channel_kernel}[name]
        if name == "token":
            helpers["_quantize_token_block"] = wrap(with_globals(_quantize_token_block, **helpers))
        _WRAPPED[key] = wrap(with_globals(fn, **helpers), do_not_specialize=["offset"])
    return _WRAPPED[key]
