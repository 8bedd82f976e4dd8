"""The split-merge kernel (foldc_merge, eq. 14) under Triton's interpreter: random per-split states,
empty splits and more splits than one step holds, against the same merge in float64."""
from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from foldc.backends.runtime.merge import MERGE_SOURCE, launch_merge
from foldc.backends.runtime.modules import interpreter
from foldc.backends.runtime.modules import load_module


def _merge64(ws_m, ws_l, ws_acc, q_per_kv):
    """out [b, hkv * q_per_kv, d] and natural-log lse from the states, in float64."""
    m, l, acc = ws_m.double(), ws_l.double(), ws_acc.double()
    top = m.amax(dim=2, keepdim=True)
    w = torch.exp2(m - top)                                   # [b, hkv, splits, rows]
    total = (l * w).sum(dim=2)                                 # [b, hkv, rows]
    out = (acc * w[..., None]).sum(dim=2) / total[..., None]   # [b, hkv, rows, d]
    lse = (top.squeeze(2) + torch.log2(total)) * math.log(2)
    b, hkv = m.shape[:2]
    return out[:, :, :q_per_kv].reshape(b, hkv * q_per_kv, -1), lse[:, :, :q_per_kv].reshape(b, hkv * q_per_kv)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), splits=st.integers(1, 150), q_per_kv=st.sampled_from([1, 3, 4]),
       empty=st.floats(0.0, 0.5))
def test_merge_matches_float64_for_any_split_count(seed, splits, q_per_kv, empty):
    """Up to 150 splits (three steps of the interpreter's 64), some of them empty (max -inf,
    denominator 0, as a split past a sequence's end writes), maxima far apart across steps."""
    merge = load_module("import triton\nimport triton.language as tl\n" + MERGE_SOURCE, interpret=True).foldc_merge
    gen = torch.Generator().manual_seed(seed)
    b, hkv, rows, d = 2, 2, 4, 16
    ws_m = torch.randn(b, hkv, splits, rows, generator=gen) * 20     # log2 units: weights 2^-60..1
    ws_l = torch.rand(b, hkv, splits, rows, generator=gen) * 50 + 0.5
    ws_acc = torch.randn(b, hkv, splits, rows, d, generator=gen) * ws_l[..., None]
    gone = torch.rand(b, hkv, splits, 1, generator=gen) < empty
    gone[:, :, 0] = False                                            # every row keeps one split
    ws_m = ws_m.masked_fill(gone, float("-inf"))
    ws_l = ws_l.masked_fill(gone, 0.0)
    ws_acc = ws_acc.masked_fill(gone[..., None], 0.0)
    out = torch.full((b, hkv * q_per_kv, d), float("nan"), dtype=torch.float32)
    lse = torch.full((b, hkv * q_per_kv), float("nan"), dtype=torch.float32)
    with interpreter(True):
        launch_merge(merge, ws_m, ws_l, ws_acc, out, lse, q_per_kv)
    want, want_lse = _merge64(ws_m, ws_l, ws_acc, q_per_kv)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-5), (out.double() - want).abs().max()
    assert torch.allclose(lse.double(), want_lse, rtol=1e-6, atol=1e-4)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), splits=st.integers(1, 70), kv_heads=st.integers(1, 3),
       blocks=st.sampled_from([(17, 9, 16), (25, 13, 16), (31, 16, 16), (9, 5, 8), (30, 8, 8), (13, 7, 8)]))
def test_merge_writes_ragged_row_blocks_to_their_query_heads(seed, splits, kv_heads, blocks):
    """Ragged row blocks (HEAD_ROWS): each KV head's query rows split into blocks of q_per_kv rows, the last
    shorter; workspace head j is block j % blocks of KV head j // blocks. Every query head is
    written once from its block's row, nothing past the last block's real rows (the NaN-filled output
    would keep a stray NaN otherwise, and an out-of-range write would land on a later head)."""
    head_rows, q_per_kv, rows = blocks
    n_blocks = -(-head_rows // q_per_kv)
    merge = load_module("import triton\nimport triton.language as tl\n" + MERGE_SOURCE, interpret=True).foldc_merge
    gen = torch.Generator().manual_seed(seed)
    b, d = 2, 16
    programs = kv_heads * n_blocks
    ws_m = torch.randn(b, programs, splits, rows, generator=gen) * 20
    ws_l = torch.rand(b, programs, splits, rows, generator=gen) * 50 + 0.5
    ws_acc = torch.randn(b, programs, splits, rows, d, generator=gen) * ws_l[..., None]
    out = torch.full((b, kv_heads * head_rows, d), float("nan"), dtype=torch.float32)
    lse = torch.full((b, kv_heads * head_rows), float("nan"), dtype=torch.float32)
    with interpreter(True):
        launch_merge(merge, ws_m, ws_l, ws_acc, out, lse, q_per_kv, head_rows=head_rows)
    every, every_lse = _merge64(ws_m, ws_l, ws_acc, q_per_kv)   # [b, programs * q_per_kv, d]: blocks padded
    every = every.reshape(b, kv_heads, n_blocks * q_per_kv, d)[:, :, :head_rows].reshape(b, kv_heads * head_rows, d)
    every_lse = every_lse.reshape(b, kv_heads, n_blocks * q_per_kv)[:, :, :head_rows].reshape(b, -1)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.allclose(out.double(), every, rtol=1e-5, atol=1e-5), (out.double() - every).abs().max()
    assert torch.allclose(lse.double(), every_lse, rtol=1e-6, atol=1e-4)


def test_merge_moves_its_pointers_to_the_row_in_int64_and_keeps_the_split_loop_32_bit():
    """The workspace (batch x heads x splits x rows x head_dim) and the output may pass 2**31 elements: the
    row's workspace pointers and the output's batch offset are 64-bit, outside the loop over splits."""
    src = MERGE_SOURCE
    assert "base = (b * NUM_KV_HEADS + kvh).to(tl.int64) * num_splits * ROWS + row" in src
    assert "WS_ACC += base * HEAD_DIM" in src and "WS_M += base" in src and "WS_L += base" in src
    assert "OUT + b.to(tl.int64) * stride_ob" in src and src.count("lse_at = b.to(tl.int64)") == 2
    loop = src[src.index("for s0 in"):src.index("l_total")]
    assert "base" not in loop and "int64" not in loop
