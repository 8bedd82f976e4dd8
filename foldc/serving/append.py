"""Quantize-on-append: a Triton kernel that quantizes new KV tokens straight into preallocated
`foldc.AffineTensor` storage, bit for bit as `foldc.quantize` would.

``append_quantized(dst, x, offset)`` writes ``x [batch, kv_heads, T, head_dim]`` into
``dst`` at tokens ``[offset, offset + T)`` (``offset`` an int, or an int tensor of one offset per
batch row for ragged batches):

- token-wise encodings (groups along head_dim): any ``T``; each token's row is quantized on its own.
- channel-wise encodings (groups along tokens): ``T`` and every offset must be multiples of
  ``group_size``: a group's scale/zero is the per-channel min/max over its ``group_size`` tokens,
  so only whole groups can be written (callers keep a partial group in the model dtype).

``append_paged(pool, x, kv_indptr, kv_indices, start, page_size=P, counts=None)`` is the same
quantization into a page pool (foldc/serving/paged.py): the same two kernels, whose PAGED mode maps
each token position through the page table, and whose ``counts`` let one launch write a
data-dependent number of tokens per sequence. Neither it nor ``append_quantized(..., check=False)``
reads anything from the device, so both can be captured in a CUDA graph.

Numerics (exactly those of `foldc.quantize`): ``zero = min`` and ``scale = (max - min) / (2**bits - 1)``
(float32, correctly rounded division), both rounded to nearest-even into ``scale_dtype``; codes are
``round_half_even((x - zero) / scale)`` computed in float32 against the ROUNDED pair, clamped to
``[0, 2**bits - 1]``; a group with ``scale == 0`` gets codes 0. Codes are packed planar (byte ``j``,
bit field ``i`` holds channel ``i * head_dim / k + j``, see foldc/encoding.py).

How the kernel stays exact on every backend: divisions use ``tl.math.div_rn`` (a plain ``/`` may be
an approximate division on the GPU); round-half-even is built from ``floor`` (no libdevice, which
the interpreter lacks); bf16 inputs and bf16 scales go through their bit patterns (an exact shift
in, a round-to-nearest-even on the bits out), so they are exact under Triton's interpreter too,
whose own bf16 is broken.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton.language as tl

from ..backends.runtime.fast_launch import FastLaunch, keywords
from ..decisions import GroupAxis, token_group
from ..encoding import AffineTensor
from ..errors import InputError, InputTypeError, SpecError

TARGETS = ("auto", "interpret", "sm_90", "sm_100", "reference")
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SCALE_KIND = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
BLOCK_T_TOKEN = 16   # most tokens per program of the token-wise kernel
BLOCK_T_CHANNEL = 32  # tokens per step of the channel-wise kernel's loop over one group


# The kernels are plain functions wrapped on first use as a JITFunction (GPU) or an
# InterpretedFunction (CPU), so one process can run both (see foldc/backends/runtime/modules.py, interpreter).
# Their tensors come first (a bound launch passes them as addresses, `FastLaunch.bind`), and the token
# offset is not specialised on (one build for every offset: a bound launch takes it per call).
OFFSET_ARG = 26   # the position of ``offset`` in both kernels' arguments

def _append_token_kernel(
    X, CODES, SCALE, ZERO, OFFSETS, KV_INDPTR, KV_INDICES, COUNTS, FLAG, X2, CODES2, SCALE2, ZERO2, ARRIVALS,
    stride_xb, stride_xh, stride_xn, stride_cb, stride_ch, stride_cn,
    stride_sb, stride_sh, stride_sn, stride_zb, stride_zh, stride_zn,
    offset, tokens, heads, capacity,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, NUM_GROUPS: tl.constexpr, BITS: tl.constexpr,
    CPB: tl.constexpr, MAX_CODE: tl.constexpr, BLOCK_T: tl.constexpr, X_BF16: tl.constexpr,
    SCALE_KIND: tl.constexpr, PER_ROW: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_COUNT: tl.constexpr, GROUP_P: tl.constexpr, NUM_GROUPS_P: tl.constexpr, WIDTH_P: tl.constexpr,
    HAS_FLAG: tl.constexpr = False, PAIR: tl.constexpr = False, ADVANCE: tl.constexpr = False,
):
    """One program: BLOCK_T new tokens of one (batch, kv head); each token row is cut into
    NUM_GROUPS groups of GROUP channels. PAGED: token positions map through the page table
    (paged.py) and tokens past the row's own pages are not written; else positions outside
    [0, capacity) are not written. HAS_COUNT: row b writes only its first COUNTS[b] tokens.
    HAS_FLAG: a written scale or zero that is not finite after rounding to its dtype (NaN or Inf in
    x, or a value past the scale dtype's range) stores 1 to FLAG[0] (the caches' deferred check).
    GROUP_P, NUM_GROUPS_P, WIDTH_P: the powers of two tl.arange takes for GROUP, NUM_GROUPS and the
    HEAD_DIM // CPB bytes of a token (equal to them for head_dims and groups that are powers of two;
    else the padding is masked and the codes are rebuilt in planar order, each with its group's scale).
    PAIR: the grid's first axis is doubled and its second half writes X2 into CODES2, SCALE2, ZERO2 (the values
    beside the keys: one launch for both, with the same encoding, shapes and strides).
    ADVANCE (with PER_ROW, without HAS_COUNT): the launch moves each row's offset on by ``tokens`` itself. Every
    program counts itself in ARRIVALS[b] (int32, zero between launches) once it has read OFFSETS[b]; the row's
    last program to arrive stores OFFSETS[b] + tokens and sets ARRIVALS[b] back to zero (a decode step's
    ``offsets += 1`` without a launch of its own, and captured with the step)."""
    pid = tl.program_id(0)
    if PAIR:
        half = tl.num_programs(0) // 2
        if pid >= half:
            X = X2
            CODES = CODES2
            SCALE = SCALE2
            ZERO = ZERO2
            pid = pid - half
    b = (pid // heads).to(tl.int64)
    h = (pid % heads).to(tl.int64)
    if PER_ROW:
        start = tl.load(OFFSETS + b).to(tl.int64)
    else:
        start = offset
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
        first = tl.load(KV_INDPTR + b)
        # a negative position has no page (and pos // PAGE_SIZE rounds toward 0 there): not written
        t_ok = t_ok & (pos >= 0) & (pos // PAGE_SIZE < tl.load(KV_INDPTR + b + 1) - first)
        dst = tl.load(KV_INDICES + first + pos // PAGE_SIZE, mask=t_ok, other=0).to(tl.int64)
        row = pos % PAGE_SIZE
    else:
        t_ok = t_ok & (pos >= 0) & (pos < capacity)
        dst = tl.zeros([BLOCK_T], tl.int64) + b
        row = pos
    s_ptr = SCALE + dst[:, None] * stride_sb + h * stride_sh + row[:, None] * stride_sn + g_idx[None, :]
    z_ptr = ZERO + dst[:, None] * stride_zb + h * stride_zh + row[:, None] * stride_zn + g_idx[None, :]
    p_mask = t_ok[:, None] & (g_idx < NUM_GROUPS)[None, :]
    if SCALE_KIND == 0:  # float16: round to nearest even by the cast
        s_lo = raw_scale.to(tl.float16)
        z_lo = lo.to(tl.float16)
        tl.store(s_ptr, s_lo, mask=p_mask)
        tl.store(z_ptr, z_lo, mask=p_mask)
        scale = s_lo.to(tl.float32)
        zero = z_lo.to(tl.float32)
    elif SCALE_KIND == 1:  # bfloat16 on its bits: round the float32 pattern to nearest even
        s_bits = raw_scale.to(tl.uint32, bitcast=True)
        s_bits = (s_bits + 0x7FFF + ((s_bits >> 16) & 1)) >> 16
        z_bits = lo.to(tl.uint32, bitcast=True)
        z_bits = (z_bits + 0x7FFF + ((z_bits >> 16) & 1)) >> 16
        tl.store(s_ptr, s_bits.to(tl.uint16).to(tl.int16, bitcast=True), mask=p_mask)
        tl.store(z_ptr, z_bits.to(tl.uint16).to(tl.int16, bitcast=True), mask=p_mask)
        scale = (s_bits << 16).to(tl.float32, bitcast=True)
        zero = (z_bits << 16).to(tl.float32, bitcast=True)
    else:  # float32: nothing to round
        tl.store(s_ptr, raw_scale, mask=p_mask)
        tl.store(z_ptr, lo, mask=p_mask)
        scale = raw_scale
        zero = lo
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
        nonzero = s_el > 0
        v = tl.math.div_rn(xp - z_el, tl.where(nonzero, s_el, 1.0))
        f = tl.floor(v)  # round half to even from floor: exact for every float32
        frac = v - f
        odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
        r = tl.where((frac > 0.5) | ((frac == 0.5) & odd), f + 1.0, f)
        r = tl.minimum(tl.maximum(r, 0.0), MAX_CODE * 1.0)
        code = tl.where(nonzero, r, 0.0).to(tl.int32)
        packed = tl.sum(code << shifts[None, :, None], axis=1)  # disjoint bit fields: sum == or
        c_ptr = CODES + dst[:, None] * stride_cb + h * stride_ch + row[:, None] * stride_cn + j[None, :]
        tl.store(c_ptr, packed.to(tl.uint8), mask=t_ok[:, None] & ch_ok)
    else:
        nonzero = scale[:, :, None] > 0
        safe = tl.where(nonzero, scale[:, :, None], 1.0)
        v = tl.math.div_rn(x - zero[:, :, None], safe)
        f = tl.floor(v)  # round half to even from floor: exact for every float32
        frac = v - f
        odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
        r = tl.where((frac > 0.5) | ((frac == 0.5) & odd), f + 1.0, f)
        r = tl.minimum(tl.maximum(r, 0.0), MAX_CODE * 1.0)
        code = tl.where(nonzero, r, 0.0).to(tl.int32)  # [BLOCK_T, NUM_GROUPS, GROUP]
        planar = tl.reshape(code, [BLOCK_T, CPB, HEAD_DIM // CPB])  # [t, i, j] = channel i * HEAD_DIM/CPB + j
        packed = tl.sum(planar << shifts[None, :, None], axis=1)  # disjoint bit fields: sum == or
        c_ptr = CODES + dst[:, None] * stride_cb + h * stride_ch + row[:, None] * stride_cn + \
            tl.arange(0, HEAD_DIM // CPB)[None, :]
        tl.store(c_ptr, packed.to(tl.uint8), mask=t_ok[:, None])
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
    offset, heads, capacity,
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
    if HAS_COUNT:
        ok = ok & (grp * GROUP < tl.load(COUNTS + b))
    if PAGED:
        first = tl.load(KV_INDPTR + b)
        # a group off a group boundary would run past its page into the next one: not written
        ok = ok & (pos0 % GROUP == 0) & (pos0 // PAGE_SIZE < tl.load(KV_INDPTR + b + 1) - first)
        dst = tl.load(KV_INDICES + first + pos0 // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
        row0 = pos0 % PAGE_SIZE
    else:  # a whole group inside [0, capacity), starting a group
        ok = ok & (pos0 % GROUP == 0) & (pos0 + GROUP <= capacity)
        dst = b
        row0 = pos0
    g_mask = ch_ok & ok
    prow = row0 // GROUP
    s_ptr = SCALE + dst * stride_sb + h * stride_sh + prow * stride_sn + chan
    z_ptr = ZERO + dst * stride_zb + h * stride_zh + prow * stride_zn + chan
    if SCALE_KIND == 0:
        s_lo = raw_scale.to(tl.float16)
        z_lo = lo.to(tl.float16)
        tl.store(s_ptr, s_lo, mask=g_mask)
        tl.store(z_ptr, z_lo, mask=g_mask)
        scale = s_lo.to(tl.float32)
        zero = z_lo.to(tl.float32)
    elif SCALE_KIND == 1:
        s_bits = raw_scale.to(tl.uint32, bitcast=True)
        s_bits = (s_bits + 0x7FFF + ((s_bits >> 16) & 1)) >> 16
        z_bits = lo.to(tl.uint32, bitcast=True)
        z_bits = (z_bits + 0x7FFF + ((z_bits >> 16) & 1)) >> 16
        tl.store(s_ptr, s_bits.to(tl.uint16).to(tl.int16, bitcast=True), mask=g_mask)
        tl.store(z_ptr, z_bits.to(tl.uint16).to(tl.int16, bitcast=True), mask=g_mask)
        scale = (s_bits << 16).to(tl.float32, bitcast=True)
        zero = (z_bits << 16).to(tl.float32, bitcast=True)
    else:
        tl.store(s_ptr, raw_scale, mask=g_mask)
        tl.store(z_ptr, lo, mask=g_mask)
        scale = raw_scale
        zero = lo
    if HAS_FLAG:
        wrong = (scale != scale) | (tl.abs(scale) == float("inf")) | (zero != zero) | (tl.abs(zero) == float("inf"))
        n_wrong = tl.sum(tl.sum((wrong & g_mask).to(tl.int32), axis=1), axis=0)
        tl.store(FLAG, 1, mask=n_wrong > 0)
    nonzero = scale[None, :, :] > 0
    safe = tl.where(nonzero, scale[None, :, :], 1.0)
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
        v = tl.math.div_rn(x - zero[None, :, :], safe)
        f = tl.floor(v)
        frac = v - f
        odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
        r = tl.where((frac > 0.5) | ((frac == 0.5) & odd), f + 1.0, f)
        r = tl.minimum(tl.maximum(r, 0.0), MAX_CODE * 1.0)
        code = tl.where(nonzero, r, 0.0).to(tl.int32)  # [BLOCK_T, CPB, WIDTH_P]
        packed = tl.sum(code << shifts[None, :, None], axis=1)
        row = row0 + t.to(tl.int64)
        tl.store(c_base + row[:, None] * stride_cn + tl.arange(0, WIDTH_P)[None, :], packed.to(tl.uint8),
                 mask=t_ok[:, None] & ok & ch_ok)


_WRAPPED: dict[tuple[str, bool], object] = {}


def _kernel(name: str, interpret: bool):
    """The kernel ``name`` as a JITFunction (native) or an InterpretedFunction (interpreter)."""
    key = (name, interpret)
    if key not in _WRAPPED:
        fn = {"token": _append_token_kernel, "channel": _append_channel_kernel}[name]
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            _WRAPPED[key] = InterpretedFunction(fn)
        else:
            from triton.runtime.jit import JITFunction

            _WRAPPED[key] = JITFunction(fn, do_not_specialize=["offset"])
    return _WRAPPED[key]


def resolve_target(target: str, device: torch.device) -> str:
    """``"interpret"``, ``"native"`` or ``"reference"`` for ``target`` on ``device``."""
    if target not in TARGETS:
        raise SpecError(f"target={target!r} is not available for the append kernel; use one of {TARGETS}")
    if target == "reference":
        return "reference"
    if target == "auto":
        return "native" if device.type == "cuda" else "interpret"
    if target == "interpret":
        if device.type != "cpu":
            raise InputError(f"target='interpret' runs on the CPU but the storage is on {device}; "
                             "use target='auto'")
        return "interpret"
    if device.type != "cuda":
        raise InputError(f"target={target!r} runs on a CUDA GPU but the storage is on {device}; "
                         "use target='interpret' (CPU) or 'auto'")
    return "native"


def safe_abs_limit(scale_dtype: torch.dtype) -> float:
    """Largest |x| for which no group can overflow ``scale_dtype`` (zero = min needs |x| <= max of
    the dtype; scale <= 2|x|/3 and max - min in float32 need 2|x| <= float32 max)."""
    return min(torch.finfo(scale_dtype).max, torch.finfo(torch.float32).max / 2)


def check_finite(x: torch.Tensor, name: str = "x") -> float:
    """max |x| (one device sync); InputError if x holds NaN or Inf."""
    m = float(x.abs().amax()) if x.numel() else 0.0
    if not math.isfinite(m):
        bad = (~torch.isfinite(x)).nonzero()[0].tolist()
        raise InputError(f"{name} holds NaN or Inf (first at index {bad}); only finite values can be "
                         "quantized into the cache")
    return m


def _offsets(offset, dst: AffineTensor, tokens: int, read_device: bool = True):
    """(scalar offset, None) or (None, per-row int64 offsets on dst's device), validated. Without
    ``read_device``, the values of an offset tensor are not read (no sync; the kernel skips tokens
    that would land outside dst)."""
    batch, cap, enc = dst.shape[0], dst.num_tokens, dst.encoding
    group = token_group(enc)   # channel-wise: offsets start groups of G tokens
    if isinstance(offset, torch.Tensor):
        if offset.dtype.is_floating_point or offset.dtype.is_complex or offset.dtype == torch.bool:
            raise InputError(f"offset dtype={offset.dtype} must be an integer type (token positions)")
        if tuple(offset.shape) != (batch,):
            raise InputError(f"offset shape={tuple(offset.shape)} but dst has batch={batch}; pass one token "
                             "offset per batch row, or an int")
        # contiguous: the kernel reads offset b at OFFSETS + b (a strided view would give other rows' values)
        per_row = offset.to(device=dst.device, dtype=torch.int64).contiguous()
        if not read_device:
            return None, per_row
        lo, hi = int(offset.min()), int(offset.max())
        if group and bool((per_row % group != 0).any()):
            bad = int(per_row[per_row % enc.group_size != 0][0])
            raise InputError(f"offset={bad} is not a multiple of group_size={enc.group_size}; channel-wise "
                             "groups are written whole, so every offset must start a group")
        scalar = None
    else:
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise InputTypeError(f"offset={offset!r} must be an int or an integer tensor of one offset per "
                                 "batch row")
        lo = hi = offset
        per_row = None
        scalar = offset
        if group and offset % group:
            raise InputError(f"offset={offset} is not a multiple of group_size={enc.group_size}; channel-wise "
                             "groups are written whole, so the offset must start a group")
    if lo < 0:
        raise InputError(f"offset={lo} is negative; token offsets start at 0")
    if hi + tokens > cap:
        raise InputError(f"writing {tokens} tokens at offset {hi} needs {hi + tokens} token slots but dst holds "
                         f"{cap}; allocate a larger cache or write fewer tokens")
    return scalar, per_row


def append_quantized(dst: AffineTensor, x: torch.Tensor, offset=0, *, target: str = "auto",
                     check: bool = True) -> None:
    """Quantize ``x [batch, kv_heads, T, head_dim]`` into ``dst`` at tokens ``[offset, offset + T)``.

    Args:
        dst: preallocated storage (its codes, scale and zero are written in place).
        x: new tokens, float16, bfloat16 or float32, on dst's device.
        offset: token position of x's first token, an int or an integer tensor [batch] (ragged rows).
            Channel-wise encodings need whole groups: T and every offset multiples of group_size.
        target: "auto" (GPU kernel on CUDA, interpreter on CPU), "interpret", "sm_90", "sm_100",
            or "reference" (foldc.quantize and a copy, any device).
        check: reject NaN/Inf and validate the values of an offset tensor (device syncs). With
            False nothing is read from the device, so the call can be captured in a CUDA graph:
            pass it only for values already checked; tokens an offset would put outside dst (or, for
            channel-wise encodings, off a group boundary) are then skipped, not written.

    The bits written equal ``foldc.quantize(x, dst.encoding)`` (for channel-wise encodings, the
    groups are x's runs of group_size tokens); tokens outside ``[offset, offset + T)`` and scale rows
    outside their groups are not touched.
    """
    if not isinstance(dst, AffineTensor):
        raise InputTypeError(f"dst must be a foldc.AffineTensor (preallocated storage), got {type(dst).__name__}")
    if not isinstance(x, torch.Tensor):
        raise InputTypeError(f"x must be a torch.Tensor [batch, kv_heads, tokens, head_dim], got {type(x).__name__}")
    enc, (batch, heads, _, head_dim) = dst.encoding, dst.shape
    if x.dim() != 4 or x.shape[0] != batch or x.shape[1] != heads or x.shape[3] != head_dim:
        raise InputError(f"x shape={tuple(x.shape)} but dst needs [{batch}, {heads}, tokens, {head_dim}]")
    if x.dtype not in INPUT_DTYPES:
        raise InputError(f"x dtype={x.dtype} is not supported; use one of {list(INPUT_DTYPES)}")
    if x.device != dst.device:
        raise InputError(f"x is on {x.device} but dst is on {dst.device}; move x to {dst.device}")
    tokens, group = x.shape[2], token_group(enc)
    if group and tokens % group:
        raise InputError(f"x holds {tokens} tokens, not a multiple of group_size={enc.group_size}; channel-wise "
                         "groups are written whole (keep the partial group in the model dtype until it fills)")
    scalar, per_row = _offsets(offset, dst, tokens, read_device=check)
    mode = resolve_target(target, dst.device)
    if tokens == 0:
        return
    if check:
        m = check_finite(x)
        if m > safe_abs_limit(enc.scale_dtype):
            from ..encoding import quantize

            quantize(x, enc)  # raises exactly when foldc.quantize would (scale/zero overflow)
    if mode == "reference":
        _append_reference(dst, x, scalar, per_row)
        return
    for name, t in (("codes", dst.codes), ("scale", dst.scale), ("zero", dst.zero)):
        if t.stride(-1) != 1:
            raise InputError(f"dst.{name} must have unit stride along its last dim; got strides {t.stride()}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    _launch(dst, x, scalar, per_row, mode == "interpret")


@dataclass(frozen=True)
class AppendLaunch:
    """What one append launches, decided from the destination's encoding and the shapes alone:
    the kernel (``"token"``: a scale row per token; ``"channel"``: one per group of tokens), its grid
    and its compile-time constants. `plan_append` makes it (memoised), `run_append` launches it."""

    kernel: str
    grid: tuple[int, int]
    interpret: bool
    constants: tuple   # (name, value) pairs: the kernel's constexprs and num_warps


@functools.lru_cache(maxsize=1024)
def plan_append(enc, heads: int, head_dim: int, batch: int, tokens: int, x_bf16: bool, per_row: bool,
                page_size: int, counts: bool, interpret: bool, flag: bool = False, pair: bool = False,
                advance: bool = False) -> AppendLaunch:
    """The `AppendLaunch` writing ``tokens`` tokens of ``batch`` rows of ``heads`` heads into storage
    encoded as ``enc`` (``page_size`` > 0: a page pool; ``per_row``: one offset per row; ``counts``:
    tokens to write per row; ``flag``: store 1 to a flag where a scale or zero is not finite; ``pair``: two
    operands of this encoding, shapes and strides in one launch, token-wise encodings only; ``advance``: the launch
    adds ``tokens`` to the per-row offsets itself, token-wise encodings with ``per_row`` and without ``counts``)."""
    common = dict(HEAD_DIM=head_dim, GROUP=enc.group_size, BITS=enc.bits, CPB=enc.codes_per_byte,
                  MAX_CODE=enc.max_code, X_BF16=x_bf16, SCALE_KIND=SCALE_KIND[enc.scale_dtype], PER_ROW=per_row,
                  PAGED=page_size > 0, PAGE_SIZE=page_size or 1, HAS_COUNT=counts,
                  WIDTH_P=_pow2(head_dim // enc.codes_per_byte), num_warps=4)
    if flag:
        common["HAS_FLAG"] = True
    if GroupAxis.of(enc) is GroupAxis.CHANNEL:   # token-wise: groups of channels, a scale row per token
        block_t = min(BLOCK_T_TOKEN, 1 << (tokens - 1).bit_length())
        groups = head_dim // enc.group_size
        common.update(NUM_GROUPS=groups, BLOCK_T=block_t, GROUP_P=_pow2(enc.group_size), NUM_GROUPS_P=_pow2(groups))
        if pair:
            common["PAIR"] = True
        if advance:
            if not per_row or counts:
                raise SpecError("advance=True moves per-row offsets on by the launch's tokens: it needs per_row=True "
                                "and counts=False")
            common["ADVANCE"] = True
        return AppendLaunch("token", ((2 if pair else 1) * batch * heads, math.ceil(tokens / block_t)), interpret,
                            tuple(common.items()))
    if pair or advance:
        raise SpecError(f"pair=True or advance=True with {enc.short()}: token-wise encodings only")
    common.update(BLOCK_T=min(BLOCK_T_CHANNEL, 1 << (enc.group_size - 1).bit_length()))
    return AppendLaunch("channel", (batch * heads, tokens // enc.group_size), interpret, tuple(common.items()))


def _kernel_views(dst: AffineTensor, x: torch.Tensor) -> tuple:
    """(x, codes, scale, zero) as the kernels read them: bf16 as its int16 bits."""
    xin = x.view(torch.int16) if x.dtype == torch.bfloat16 else x
    scale, zero = dst.scale, dst.zero
    if dst.encoding.scale_dtype == torch.bfloat16:
        scale, zero = scale.view(torch.int16), zero.view(torch.int16)
    return xin, dst.codes, scale, zero


def append_arguments(launch: AppendLaunch, dst: AffineTensor, x: torch.Tensor, scalar, per_row,
                     paging: tuple | None = None, counts: torch.Tensor | None = None,
                     flag: torch.Tensor | None = None, second: tuple | None = None,
                     arrivals: torch.Tensor | None = None) -> tuple:
    """(the kernel behind `FastLaunch`, its positional arguments, its keyword arguments) of `run_append`
    (``flag``: an int32 tensor the kernel stores 1 to, for a launch planned with ``flag=True``; ``second``:
    (dst2, x2) for a launch planned with ``pair=True``, x2 into dst2 with x's and dst's strides, unchecked;
    ``arrivals``: int32 ``[batch]``, zero, for a launch planned with ``advance=True``)."""
    xin, codes, scale, zero = _kernel_views(dst, x)
    offs = per_row if per_row is not None else codes  # not read unless PER_ROW
    indptr, indices = paging if paging is not None else (codes, codes)  # read only if PAGED
    pair = _kernel_views(*second) if second is not None else (codes, codes, codes, codes)   # read only if PAIR
    sx, sc, ss, sz = xin.stride(), codes.stride(), scale.stride(), zero.stride()
    args = (xin, codes, scale, zero, offs, indptr, indices, counts if counts is not None else codes,
            flag if flag is not None else codes, *pair, arrivals if arrivals is not None else codes,   # (read if ADVANCE)
            sx[0], sx[1], sx[2], sc[0], sc[1], sc[2], ss[0], ss[1], ss[2], sz[0], sz[1], sz[2],
            0 if scalar is None else scalar)
    args += (x.shape[2], dst.shape[1], dst.num_tokens) if launch.kernel == "token" else (dst.shape[1], dst.num_tokens)
    return _fast(launch.kernel, launch.interpret), args, keywords(launch)


def run_append(launch: AppendLaunch, dst: AffineTensor, x: torch.Tensor, scalar, per_row,
               paging: tuple | None = None, counts: torch.Tensor | None = None,
               flag: torch.Tensor | None = None, second: tuple | None = None,
               arrivals: torch.Tensor | None = None) -> None:
    """Launch ``launch`` (from `plan_append`), no checks: ``x`` into ``dst`` at ``scalar`` (an int) or
    ``per_row`` offsets; ``paging`` = (kv_indptr, kv_indices): dst is a page pool; ``counts``: tokens
    to write per row; ``flag``, ``second``, ``arrivals``: see `append_arguments`."""
    kernel, args, kwargs = append_arguments(launch, dst, x, scalar, per_row, paging, counts, flag, second, arrivals)
    if launch.interpret or os.environ.get("TRITON_INTERPRET"):
        from ..backends.runtime.modules import interpreter

        with interpreter(launch.interpret):
            kernel[launch.grid](*args, **kwargs)
    else:   # native mode already: no switch (the decode step's host path)
        kernel[launch.grid](*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _fast(name: str, interpret: bool):
    """The append kernel ``name`` behind `FastLaunch` (repeat launches skip triton's binder)."""
    return FastLaunch(_kernel(name, interpret))


def _launch(dst: AffineTensor, x: torch.Tensor, scalar, per_row, interpret: bool, paging: tuple | None = None,
            counts: torch.Tensor | None = None) -> None:
    """Plan and launch the append kernel of dst's layout. ``paging`` = (kv_indptr, kv_indices, page_size):
    dst is a page pool and positions map through the table; ``counts``: tokens to write per row."""
    launch = plan_append(dst.encoding, dst.shape[1], dst.shape[3], x.shape[0], x.shape[2], x.dtype == torch.bfloat16,
                         per_row is not None, paging[2] if paging is not None else 0, counts is not None, interpret)
    run_append(launch, dst, x, scalar, per_row, None if paging is None else paging[:2], counts)


def _pow2(n: int) -> int:
    """The power of two tl.arange takes for n (n itself when it is one)."""
    return 1 << (n - 1).bit_length()


def _append_reference(dst: AffineTensor, x: torch.Tensor, scalar, per_row) -> None:
    """foldc.quantize, then a copy into place (the exactness the kernel is held to)."""
    from ..encoding import quantize

    q = quantize(x, dst.encoding)
    tokens, enc = x.shape[2], dst.encoding
    starts = [scalar] * dst.shape[0] if per_row is None else per_row.tolist()
    for b, start in enumerate(starts):
        dst.codes[b, :, start:start + tokens] = q.codes[b]
        if GroupAxis.of(enc) is GroupAxis.CHANNEL:
            dst.scale[b, :, start:start + tokens] = q.scale[b]
            dst.zero[b, :, start:start + tokens] = q.zero[b]
        else:
            g0, ng = start // enc.group_size, tokens // enc.group_size
            dst.scale[b, :, g0:g0 + ng] = q.scale[b]
            dst.zero[b, :, g0:g0 + ng] = q.zero[b]


def append_paged(pool: AffineTensor, x: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                 start: torch.Tensor, *, page_size: int, counts: torch.Tensor | None = None,
                 target: str = "auto") -> None:
    """Quantize ``x`` into a page pool at each sequence's own token positions, with no host sync.

    Token t of sequence b lands at row ``(start[b] + t) % page_size`` of page
    ``kv_indices[kv_indptr[b] + (start[b] + t) // page_size]``, with the bits ``foldc.quantize(x)``
    gives (channel-wise: groups are x's runs of group_size tokens). A token whose page-table entry
    lies past the sequence's own pages is not written (the kernel never writes outside them).
    Values are not checked for NaN/Inf (that needs a sync): a group holding one gets NaN scale and
    zero, so attention over it is NaN (never a finite wrong number); target "reference" raises.

    Parameters
    ----------
    pool : AffineTensor ``[num_pages, kv_heads, page_size, head_dim]``
        Page pool (uint8 codes, scale/zero in the encoding's dtype; `foldc.serving.page_pool`).
    x : torch.Tensor ``[batch, kv_heads, T, head_dim]``
        New tokens, float16, bfloat16 or float32, on the pool's device.
    kv_indptr : torch.Tensor, int32 ``[batch + 1]``
    kv_indices : torch.Tensor, int32 ``[kv_indptr[-1]]``
        FlashInfer page table (foldc/serving/paged.py), validated by `PagedDecodeWrapper.plan`, not here.
    start : torch.Tensor, int32 or int64 ``[batch]``
        Token position of x's first token in each sequence (device). Channel-wise encodings need a
        multiple of group_size (a group starts there). Not checked (a sync): tokens at negative
        positions, and channel-wise groups off a group boundary, are not written.
    page_size : int
        Tokens per page (channel-wise: a multiple of group_size).
    counts : torch.Tensor, int32 ``[batch]``, optional
        Sequence b writes only x's first ``counts[b]`` tokens (channel-wise: a multiple of group_size):
        one launch writes a data-dependent number of tokens per row (e.g. 0 or one group), so decode
        steps can be captured in a CUDA graph.
    target : str
        "auto", "interpret", "sm_90", "sm_100" or "reference" (foldc.quantize and copies, host loop,
        synchronises).
    """
    from ..backends.triton.paging import check_page_size_for

    if not isinstance(pool, AffineTensor):
        raise InputTypeError(f"pool must be a foldc.AffineTensor page pool, got {type(pool).__name__}")
    if not isinstance(x, torch.Tensor):
        raise InputTypeError(f"x must be a torch.Tensor [batch, kv_heads, tokens, head_dim], got {type(x).__name__}")
    enc, (_, heads, rows, head_dim) = pool.encoding, pool.shape
    check_page_size_for(enc, page_size)
    if rows != page_size:
        raise InputError(f"pool holds pages of {rows} tokens but page_size={page_size}; pass the pool's page size")
    if x.dim() != 4 or x.shape[1] != heads or x.shape[3] != head_dim:
        raise InputError(f"x shape={tuple(x.shape)} but the pool needs [batch, {heads}, tokens, {head_dim}]")
    if x.dtype not in INPUT_DTYPES:
        raise InputError(f"x dtype={x.dtype} is not supported; use one of {list(INPUT_DTYPES)}")
    batch, tokens = x.shape[0], x.shape[2]
    kv_indptr, kv_indices, start, counts = (
        _table_tensor(name, t, n, batch, pool.device)
        for name, t, n in (("kv_indptr", kv_indptr, batch + 1), ("kv_indices", kv_indices, None),
                           ("start", start, batch), ("counts", counts, batch)))
    if x.device != pool.device:
        raise InputError(f"x is on {x.device} but the pool is on {pool.device}; move x there")
    group = token_group(enc)
    if group and tokens % group:
        raise InputError(f"x holds {tokens} tokens, not a multiple of group_size={enc.group_size}; channel-wise "
                         "groups are written whole (keep the partial group in the model dtype until it fills)")
    mode = resolve_target(target, pool.device)
    if tokens == 0:
        return
    if mode == "reference":
        _append_paged_reference(pool, x, kv_indptr, kv_indices, start, page_size, counts)
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    _launch(pool, x, None, start, mode == "interpret", paging=(kv_indptr, kv_indices, page_size), counts=counts)


def _table_tensor(name: str, t, n: int | None, batch: int, device: torch.device) -> torch.Tensor | None:
    """A page-table argument of `append_paged` (None passes through): a 1-D int32/int64 tensor on the
    pool's device of ``n`` entries (None: any number), returned contiguous, since the kernel reads
    entry i at ``base + i`` (a strided view would give it other entries, no error)."""
    if t is None:
        return None
    what = f"shape ({n},) for x's batch={batch}" if n is not None else "shape [kv_indptr[-1]]"
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64) or t.dim() != 1 \
            or (n is not None and t.shape[0] != n):
        raise InputError(f"{name} must be an int32 tensor of {what}; got "
                         f"{type(t).__name__} {getattr(t, 'dtype', '')} {tuple(getattr(t, 'shape', ()))}")
    if t.device != device:
        raise InputError(f"{name} is on {t.device} but the pool is on {device}; move it there")
    return t.contiguous()


def _append_paged_reference(pool, x, kv_indptr, kv_indices, start, page_size, counts) -> None:
    """foldc.quantize per sequence, then a copy into its pages (host loop)."""
    from ..encoding import quantize

    enc = pool.encoding
    indptr, indices = kv_indptr.tolist(), kv_indices.tolist()
    for b in range(x.shape[0]):
        n = x.shape[2] if counts is None else min(x.shape[2], int(counts[b]))
        if n == 0:
            continue
        q = quantize(x[b:b + 1, :, :n], enc)
        s0 = int(start[b])
        group = token_group(enc)
        if group and s0 % group:
            raise InputError(f"start[{b}]={s0} is not a multiple of group_size={enc.group_size}; channel-wise "
                             "groups are written whole, so every start must begin a group (the kernel skips such "
                             "groups)")
        owned = indices[indptr[b]:indptr[b + 1]]
        for t in range(n):
            pos = s0 + t
            if pos < 0:   # no page (as in the kernel): not written
                continue
            if pos // page_size >= len(owned):
                break
            page, row = owned[pos // page_size], pos % page_size
            pool.codes[page, :, row] = q.codes[0, :, t]
            if GroupAxis.of(enc) is GroupAxis.CHANNEL:
                pool.scale[page, :, row] = q.scale[0, :, t]
                pool.zero[page, :, row] = q.zero[0, :, t]
            elif t % enc.group_size == 0:
                pool.scale[page, :, row // enc.group_size] = q.scale[0, :, t // enc.group_size]
                pool.zero[page, :, row // enc.group_size] = q.zero[0, :, t // enc.group_size]
