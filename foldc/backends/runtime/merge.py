"""The merge kernel both attention backends launch after their split kernels (eq. 14): each
split's (max, denominator, accumulator) of one query row into the output and its log-sum-exp."""
from __future__ import annotations

import functools
import math

import triton

MERGE_SOURCE = '''
from triton.language.extra.cuda import gdc_wait


@triton.jit
def foldc_merge(WS_M, WS_L, WS_ACC, OUT, LSE, stride_ob, stride_oh, num_splits,
                Q_PER_KV: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                NUM_KV_HEADS: tl.constexpr, SPLIT_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr,
                PDL: tl.constexpr, HEAD_ROWS: tl.constexpr = 0):
    """Merge the per-split (max, denominator, accumulator) states (eq. 14) and divide (eq. 10).
    Program (b, kv_head, row x channel block): one query row's channels d*D_BLOCK.., SPLIT_BLOCK
    splits per step in one pass: a step's max, denominators and accumulators load together (one
    memory round trip per step) and rescale the running sums to the new maximum (eq. 14 again).
    Rows are independent, so a call with few (batch, head) pairs and many splits (batch 1, long
    context) still spreads over ROWS * HEAD_DIM / D_BLOCK programs per head. PDL: launched as a
    programmatic dependent of the decode kernel, so wait until its writes are visible.
    HEAD_ROWS > 0: ragged row blocks. Each KV head's HEAD_ROWS query rows were split into blocks of
    Q_PER_KV (the last one shorter), one workspace head per block: block j of KV head h holds query
    heads h * HEAD_ROWS + j * Q_PER_KV + row, and rows past HEAD_ROWS are padding."""
    if PDL:
        gdc_wait()
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    row = tl.program_id(2) // (HEAD_DIM // D_BLOCK)
    dblk = tl.program_id(2) % (HEAD_DIM // D_BLOCK)
    real = row < Q_PER_KV          # rows past q_per_kv are the MMA's padding: nothing to write
    if HEAD_ROWS > 0:              # ragged row blocks: the workspace head kvh is block j of KV head kvh // BLOCKS
        BLOCKS: tl.constexpr = (HEAD_ROWS + Q_PER_KV - 1) // Q_PER_KV
        first = (kvh // BLOCKS) * HEAD_ROWS + (kvh % BLOCKS) * Q_PER_KV   # its first query head
        real = real & ((kvh % BLOCKS) * Q_PER_KV + row < HEAD_ROWS)
        lse_at = b.to(tl.int64) * (NUM_KV_HEADS // BLOCKS) * HEAD_ROWS + first + row
    else:
        first = kvh * Q_PER_KV
        lse_at = b.to(tl.int64) * NUM_KV_HEADS * Q_PER_KV + kvh * Q_PER_KV + row
    cols = dblk * D_BLOCK + tl.arange(0, D_BLOCK)
    sb = tl.arange(0, SPLIT_BLOCK)
    # 64-bit addressing outside the loop: the workspace and the output may pass 2**31 elements, so the
    # pointers move to this row once in int64 and the loop's offsets (splits x ROWS x HEAD_DIM) stay int32
    base = (b * NUM_KV_HEADS + kvh).to(tl.int64) * num_splits * ROWS + row
    WS_M += base
    WS_L += base
    WS_ACC += base * HEAD_DIM
    m = tl.max(tl.full([SPLIT_BLOCK], float("-inf"), tl.float32), axis=0)
    l = tl.sum(tl.zeros([SPLIT_BLOCK], tl.float32), axis=0)
    acc = tl.zeros([D_BLOCK], tl.float32)
    for s0 in range(0, num_splits, SPLIT_BLOCK):
        live = ((s0 + sb) < num_splits) & real
        idx = (s0 + sb) * ROWS
        m_s = tl.load(WS_M + idx, mask=live, other=float("-inf"))
        l_s = tl.load(WS_L + idx, mask=live, other=0.0)
        acc_s = tl.load(WS_ACC + idx[:, None] * HEAD_DIM + cols[None, :], mask=live[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(m_s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # nothing yet: every weight is 0
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(m_s - m_safe)
        l = l * alpha + tl.sum(l_s * w, axis=0)
        acc = acc * alpha + tl.sum(acc_s * w[:, None], axis=0)
        m = m_new
    l_total = tl.where(real, l, 1.0)   # a padding row divides by 1, not 0
    out = acc / l_total
    ptr = OUT + b.to(tl.int64) * stride_ob + (first + row) * stride_oh + cols
    tl.store(ptr, out.to(OUT.dtype.element_ty), mask=real & (cols < HEAD_DIM))
    # natural-log sum of exp of the logits (m is in log2 units): lets callers merge attention
    # over several caches, e.g. a quantized body and a bf16 window (eq. 14)
    lse = (m + tl.log2(l_total)) * 0.6931471805599453
    tl.store(LSE + lse_at, lse, mask=real & (dblk == 0))
'''


def launch_merge(merge_kernel, ws_m, ws_l, ws_acc, out, lse, q_per_kv: int, pdl: bool = False,
                 head_rows: int = 0) -> None:
    """Launch ``foldc_merge`` over the workspace [batch, kv_heads, splits, rows(, head_dim)]: one
    program per (batch, head, real query row, block of channels), up to 128 splits per step.
    Padding rows (rows >= q_per_kv) get no program. Blocks of 32 channels on a GPU (16 or fewer where
    32 does not divide head_dim, e.g. 80 or 112); all channels in one program under the interpreter
    (CPU tensors), which runs programs one after another.
    ``pdl``: a programmatic dependent launch (sm_90+): the merge's launch overlaps the end of the
    kernel before it on the stream, and its programs wait for that kernel's writes.
    ``head_rows`` > 0: each KV head's ``head_rows`` query rows were split into ragged blocks of
    ``q_per_kv`` (the last one shorter), one workspace head per block (foldc_merge)."""
    grid, args, kwargs = merge_arguments(ws_m, ws_l, ws_acc, out, lse, q_per_kv, pdl, head_rows)
    merge_kernel[grid](*args, **kwargs)


def run_bound(state, decode_addresses: tuple, merge_kernel, ws, out, lse, q_per_kv: int, values: tuple = (),
              head_rows: int = 0) -> bool:
    """A call's bound decode and merge launches (a `fast_launch.Bindings` state) with its addresses (and the
    decode's integers given per call, ``values``): True where the decode went bound (the merge bound too, or
    through ``merge_kernel`` where its bound launch declines), False where the call takes the ordinary path
    (nothing bound yet, or the decode's bound launch declines). A state of one launch is a decode that merges its
    splits itself (foldc/backends/gluon/split_merge.py)."""
    if type(state) is not tuple or not state or not state[0](decode_addresses, values):
        return False
    if len(state) == 1:
        return True
    if not state[1]((*(t.data_ptr() for t in ws), out.data_ptr(), lse.data_ptr())):
        launch_merge(merge_kernel, *ws, out, lse, q_per_kv, head_rows=head_rows)
    return True


def merge_arguments(ws_m, ws_l, ws_acc, out, lse, q_per_kv: int, pdl: bool = False,
                    head_rows: int = 0) -> tuple[tuple, tuple, dict]:
    """(grid, positional arguments, keyword arguments) of `launch_merge`'s launch; its five tensors come first."""
    b, hkv, splits, rows = ws_m.shape
    grid, kwargs = _merge_launch(b, hkv, splits, rows, ws_acc.shape[-1], q_per_kv, pdl, ws_m.device.type == "cpu",
                                 head_rows)
    return grid, (ws_m, ws_l, ws_acc, out, lse, out.stride(0), out.stride(1), splits), kwargs


@functools.lru_cache(maxsize=256)
def _merge_launch(b: int, hkv: int, splits: int, rows: int, head_dim: int, q_per_kv: int, pdl: bool,
                  cpu: bool, head_rows: int = 0) -> tuple[tuple[int, int, int], dict]:
    """The merge's grid and keyword arguments for a workspace shape (one dict object per shape, which
    `FastLaunch` recognises without reading it again)."""
    whole = cpu and head_dim & (head_dim - 1) == 0
    d_block = head_dim if whole else math.gcd(head_dim, 32)   # a power of two that divides head_dim
    # one pass, one round trip per step: 128 splits of 32 channels per step is 32 values per thread
    split_block = min(128 if d_block <= 32 else 64, max(2, triton.next_power_of_2(splits)))
    kwargs = dict(Q_PER_KV=q_per_kv, ROWS=rows, HEAD_DIM=head_dim, NUM_KV_HEADS=hkv, SPLIT_BLOCK=split_block,
                  D_BLOCK=d_block, PDL=pdl, num_warps=4 if split_block * d_block >= 1024 else 1,
                  **({"HEAD_ROWS": head_rows} if head_rows else {}), **({"launch_pdl": True} if pdl else {}))
    return (b, hkv, q_per_kv * (head_dim // d_block)), kwargs
