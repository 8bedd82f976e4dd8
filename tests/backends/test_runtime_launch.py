"""`Launch` (foldc/backends/runtime/launch.py): the split partition both backends share, each
backend's ``plan_launch`` (memoised, frozen, its workspace shapes) and ``run`` (no allocation when
the workspace is given; the same answer as ``__call__``)."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import foldc
from foldc.backends.gluon.launch import GluonAttention
from foldc.backends.runtime.launch import Launch, Scratch, allocate_workspace, split_partition, workspace_fits
from foldc.backends.triton import TritonAttention
from foldc.testing import rel_l2



@settings(max_examples=400, deadline=None)
@given(tokens=st.integers(1, 1 << 21), splits=st.integers(1, 512), block_n=st.sampled_from([16, 32, 64, 128]))
def test_the_split_partition_covers_the_cache_in_whole_tiles(tokens, splits, block_n):
    used, per_split = split_partition(tokens, splits, block_n)
    assert per_split % block_n == 0 and per_split >= block_n
    assert 1 <= used <= splits
    assert (used - 1) * per_split < tokens <= used * per_split   # every split but the last is full
    assert per_split == math.ceil(math.ceil(tokens / splits) / block_n) * block_n


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 64), tokens=st.integers(1, 1 << 18), splits=st.integers(1, 64),
       heads=st.sampled_from([(32, 8), (64, 4), (8, 8), (40, 8)]), page=st.sampled_from([0, 64]))
def test_register_operand_launch_is_frozen_memoised_and_sized_from_its_options(batch, tokens, splits, heads, page):
    """With the split count given, the register-operand launcher plans without a GPU: the grid, the
    tokens per split and the workspace follow its options; a repeat call returns the same object."""
    enc = foldc.Affine(2, "token", 128)
    attn = GluonAttention(foldc.AttentionSpec(*heads, 128, enc, enc), splits=splits)
    launch = attn.plan_launch(torch.bfloat16, batch, tokens, "cuda", has_lens=bool(page), page=page)
    assert attn.plan_launch(torch.bfloat16, batch, tokens, "cuda", has_lens=bool(page), page=page) is launch
    with pytest.raises(dataclasses.FrozenInstanceError):
        launch.splits = 1
    opts = attn.launch_config(torch.bfloat16, batch, tokens, "cuda")   # (memoised per device, as the launch)
    assert launch.options is opts and launch.block_n == opts["block_n"] and launch.kernel == "gluon"
    assert (launch.splits, launch.per_split) == attn.split_plan(opts, batch, tokens, "cuda", torch.bfloat16,
                                                                bool(page), page)
    assert launch.grid == (batch, attn.head_programs(opts), launch.splits)
    assert launch.cache_tokens == (launch.per_split * launch.splits if page else tokens)
    ws = attn.workspace(opts, batch, launch.splits, "cpu")
    assert workspace_fits(ws, launch) and all(t.dtype == torch.float32 for t in ws)


@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 3), tokens=st.integers(1, 200), splits=st.sampled_from([None, 1, 3]),
       layouts=st.sampled_from([("token", "token"), ("channel", "token"), ("token", None)]),
       seed=st.integers(0, 2**31 - 1))
def test_generated_kernel_run_matches_its_call_and_fills_the_workspace_given(batch, tokens, splits, layouts, seed):
    """The generated kernel under the interpreter: ``run(plan_launch(...))`` into a workspace and an
    output the caller holds (NaN before) writes the answer ``__call__`` gives, within float64's
    bar, and uses that workspace (no other)."""
    kl, vl = layouts
    k_enc = foldc.Affine(4, kl, 32)
    v_enc = foldc.Affine(4, vl, 32) if vl else None
    spec = foldc.AttentionSpec(8, 2, 64, k_enc, v_enc)
    attn = TritonAttention(spec, "interpret", block_n=32, splits=splits)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 8, 64, generator=gen).half()
    tokens = tokens if kl == "token" else max(32, tokens // 32 * 32)
    raw = [torch.randn(batch, 2, tokens, 64, generator=gen) for _ in range(2)]
    k = foldc.quantize(raw[0], k_enc)
    v = foldc.quantize(raw[1], v_enc) if v_enc else raw[1].half()
    lens = torch.randint(1, tokens + 1, (batch,), generator=gen, dtype=torch.int32)
    launch = attn.plan_launch(torch.float16, batch, tokens, "cpu")
    assert isinstance(launch, Launch) and launch.kernel == "triton" and launch.cache_tokens == tokens
    ws = tuple(torch.full(s, math.nan) for s in launch.workspace_shapes)
    out = torch.full((batch, 8, 64), math.nan, dtype=torch.float16)
    lse = torch.full((batch, 8), math.nan)
    attn.run(launch, q, k, v, out, lse, 64 ** -0.5, seq_lens=lens, workspace=ws)
    want, want_lse = attn(q, k, v, seq_lens=lens, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert rel_l2(out, foldc.attention_reference(q, k, v, seq_lens=lens)) < 1e-2
    # every (sequence, head, split) wrote its row-0 maximum into the given buffer (-inf: a split past the length)
    assert not torch.isnan(ws[0][..., :1]).any()


def test_allocate_workspace_takes_the_launch_shapes():
    launch = Launch("triton", torch.float16, 2, 4, 3, 64, 32, 192, 16, 128)
    ws = allocate_workspace(launch, "cpu")
    assert [tuple(t.shape) for t in ws] == [(2, 4, 3, 16), (2, 4, 3, 16), (2, 4, 3, 16, 128)]
    assert workspace_fits(ws, launch) and not workspace_fits(None, launch)
    assert not workspace_fits(ws, dataclasses.replace(launch, splits=4))


def test_scratch_keeps_one_set_of_buffers_per_stream_and_replaces_it_when_the_shapes_change():
    launch = Launch("gluon", torch.bfloat16, 2, 4, 3, 64, 32, 192, 16, 128)
    scratch = Scratch()
    ws, lse = scratch.get(launch, torch.device("cpu"), (2, 32), stream=7)
    assert workspace_fits(ws, launch) and tuple(lse.shape) == (2, 32) and lse.dtype == torch.float32
    again = scratch.get(dataclasses.replace(launch, per_split=128), torch.device("cpu"), (2, 32), stream=7)
    assert again[0] is ws and again[1] is lse            # same shapes, same stream: the same buffers
    other = scratch.get(launch, torch.device("cpu"), (2, 32), stream=9)
    assert other[0][0] is not ws[0]                       # another stream: its own
    wider = dataclasses.replace(launch, splits=5)
    grown = scratch.get(wider, torch.device("cpu"), (2, 32), stream=7)
    assert workspace_fits(grown[0], wider) and grown[0][0] is not ws[0]
    assert scratch.get(wider, torch.device("cpu"), (2, 32), stream=7)[0] is grown[0]
    given = scratch.get(wider, torch.device("cpu"), (2, 32), fresh=True, stream=7)   # an lse the caller keeps
    assert workspace_fits(given[0], wider) and given[1] is not grown[1] and given[0][0] is not grown[0][0]
    assert scratch.get(wider, torch.device("cpu"), (2, 32), stream=7)[1] is grown[1]


class _FixedResidency(GluonAttention):
    """The register-operand launcher with a fixed residency (no GPU to compile its variant on)."""

    def resident(self, launch, q_dtype, has_lens, page, device):
        return 8


@pytest.mark.parametrize("batch,tokens", [(8, 65536), (1, 16384), (32, 4096)])
def test_a_cache_that_suits_the_warpgroup_template_gets_its_launch(monkeypatch, batch, tokens):
    """INT2 token-wise at 32 query rows per KV head on sm_90: ``plan_launch`` with the cache the call
    reads picks the warpgroup template where the cache suits it (capacity a multiple of 8 tokens,
    16-byte aligned rows), its splits one wave of two programs per SM; otherwise, and for a paged
    call, the one-warp program."""
    from foldc.backends.gluon import warpgroup_launch

    monkeypatch.setattr(warpgroup_launch, "num_sms", lambda device: 132)
    monkeypatch.setattr("foldc.backends.gluon.launch.num_sms", lambda device: 132)
    enc = foldc.Affine(2, "token", 128)
    spec = foldc.AttentionSpec(128, 4, 128, enc, enc)
    attn = _FixedResidency(spec, target="sm_90")
    assert attn.warpgroup is not None
    gen = torch.Generator().manual_seed(batch)
    k, v = (foldc.quantize(torch.randn(1, 4, 64, 128, generator=gen), enc) for _ in range(2))
    launch = attn.plan_launch(torch.bfloat16, batch, tokens, "cuda", k=k, v=v)
    assert launch.kernel == "gluon-warpgroup" and launch.rows == 32 and launch.block_n == 128
    assert (launch.splits, launch.per_split) == attn.warpgroup.split_plan(batch, tokens, "cuda")
    assert launch.splits * batch * 4 <= 2 * 132 or launch.splits == 1
    odd = foldc.AffineTensor(k.codes[:, :, 1:], k.scale[:, :, 1:], k.zero[:, :, 1:], enc, 128)   # 63 tokens, rows off 16 bytes
    for other in (attn.plan_launch(torch.bfloat16, batch, tokens, "cuda", k=odd, v=v),
                  attn.plan_launch(torch.bfloat16, batch, tokens, "cuda"),
                  attn.plan_launch(torch.bfloat16, batch, tokens, "cuda", has_lens=True, page=64, k=k, v=v)):
        assert other.kernel == "gluon" and other.rows == 16 and other.head_programs == 4 * 2   # two row blocks
