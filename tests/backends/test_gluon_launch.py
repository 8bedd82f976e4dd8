"""The register-operand launcher off the GPU: resident programs from registers, split counts in whole
waves, default tiles, and the eager launches' bookkeeping (noted, bound, launched by address)."""
from __future__ import annotations

import math

import pytest
import torch
from _kernel_cases import LaunchRecorder
from hypothesis import given, settings
from hypothesis import strategies as st

import foldc
import foldc.testing
from foldc.backends.gluon.launch import GluonAttention
from foldc.backends.gluon.launch_defaults import MIN_SPLIT_TOKENS, constexprs, resident_programs, wave_splits
from foldc.errors import SpecError

H200_SHARED = 233472   # bytes of shared memory per SM


@pytest.mark.parametrize("n_regs, want", [(128, 16), (168, 12), (184, 8), (192, 8), (255, 8), (96, 20), (40, 32)])
def test_resident_programs_follow_the_register_partitions(n_regs, want):
    # the H200 sweep (docs/perf.md): 184 and 192 registers behave as 8 programs per SM, not 10 or 11
    assert resident_programs(n_regs, 4 * 1024, H200_SHARED) == want


def test_shared_memory_can_bound_residency():
    assert resident_programs(64, 100 * 1024, H200_SHARED) == 2
    assert resident_programs(64, 0, H200_SHARED) == 32


@settings(max_examples=300, deadline=None)
@given(groups=st.integers(1, 4096), tokens=st.integers(1, 1 << 20), block_n=st.sampled_from([32, 64]),
       sms=st.integers(1, 160), resident=st.integers(1, 32), waves=st.sampled_from([1.0, 2.0, 3.0, 0.5]))
def test_wave_splits_fill_whole_waves_and_never_spill(groups, tokens, block_n, sms, resident, waves):
    splits = wave_splits(groups, tokens, block_n, sms, resident, waves)
    capacity = int(waves * sms * resident)
    tiles = math.ceil(tokens / block_n)
    assert 1 <= splits <= max(1, math.ceil(tiles / 2))
    if splits > 1:   # more than one split only while they all fit in the waves asked for
        assert splits * groups <= capacity
    half = (sms * resident // 2) // groups
    if splits > max(1, half):   # past half a wave: every split takes at least MIN_SPLIT_TOKENS
        assert splits * MIN_SPLIT_TOKENS <= tokens
    # and as many as fit: one more split would spill or pass the two-tiles-per-split floor or the cap, or pass
    # half a wave with splits shorter than MIN_SPLIT_TOKENS
    assert ((splits + 1) * groups > capacity or splits + 1 > math.ceil(tiles / 2) or splits == 1024
            or splits + 1 > max(half, tokens // MIN_SPLIT_TOKENS))


@pytest.mark.parametrize("groups,tokens,want", [(4, 16384, 132), (4, 4096, 64), (16, 65536, 66), (64, 65536, 16)])
def test_small_shapes_take_fewer_longer_splits_past_half_a_wave(groups, tokens, want):
    """H100 figures (132 SMs, 8 resident one-warp programs): 1 x 16K at four programs per sequence took 29.7 µs in
    256 splits of 64 tokens and 25.2 in 128 of 128 (benchmarks/split_sweep.py, docs/perf.md): past half a wave,
    splits of at least MIN_SPLIT_TOKENS; 1 x 4K (256 programs of two tiles, under half a wave) keeps its 64."""
    assert wave_splits(groups, tokens, 32, 132, 8) == want
    # no floor (channel-wise groups of 16 tokens): as many two-tile splits as fill the wave
    assert wave_splits(groups, tokens, 32, 132, 8, min_tokens=0) == min(132 * 8 // groups, tokens // 64, 1024)


@settings(max_examples=200, deadline=None)
@given(groups=st.integers(8, 4096), tokens=st.integers(65536, 1 << 20), block_n=st.sampled_from([32, 64]),
       resident=st.integers(1, 16))
def test_the_split_floor_changes_nothing_at_8_x_64k_and_larger(groups, tokens, block_n, resident):
    """At batch 8 or more (8 or more programs per split) and 64K tokens or more on an H100/H200 (132 SMs), the
    wave allows at most 264 splits, each of 248 tokens or more: the 128-token floor never binds there."""
    assert wave_splits(groups, tokens, block_n, 132, resident) == wave_splits(groups, tokens, block_n, 132, resident,
                                                                              min_tokens=0)


def _spec(bits=2):
    enc = foldc.Affine(bits, "token", 128)
    return foldc.AttentionSpec(32, 8, 128, enc, enc)


class _Resident(GluonAttention):
    """The launcher with a fixed residency (no GPU to compile on)."""

    def __init__(self, *a, resident: int, **kw):
        super().__init__(*a, **kw)
        self._fixed = resident

    def resident(self, launch, q_dtype, has_lens, page, device):
        return self._fixed


@pytest.mark.parametrize("batch, tokens, resident", [(8, 65536, 12), (32, 16384, 8), (32, 65536, 16), (1, 16384, 12),
                                                     (64, 32768, 8), (3, 1000, 12)])
def test_split_plan_stays_within_one_wave(monkeypatch, batch, tokens, resident):
    monkeypatch.setattr("foldc.backends.gluon.launch.num_sms", lambda device: 132)
    attn = _Resident(_spec(), resident=resident)
    launch = dict(attn._defaults)
    splits, per_split = attn.split_plan(launch, batch, tokens, "cuda")
    groups = batch * 8 // launch["heads"]
    assert splits * per_split >= tokens > (splits - 1) * per_split      # every token in exactly one split
    assert per_split % launch["block_n"] == 0
    if splits > 1:
        assert groups * splits <= 132 * resident
    # the sweep's best 8 x 64K INT2 launch (168 registers, 12 per SM): 49 splits, 0.99 waves
    if (batch, tokens, resident) == (8, 65536, 12):
        assert splits == 49


def test_explicit_splits_win_over_waves(monkeypatch):
    monkeypatch.setattr("foldc.backends.gluon.launch.num_sms", lambda device: 132)
    attn = _Resident(_spec(), resident=12, splits=7)
    assert attn.split_plan(dict(attn._defaults), 8, 65536, "cuda")[0] == 7


@pytest.mark.parametrize("factor", [0, -1.0, True, "1", 100.0])
def test_split_factor_must_be_a_positive_number_of_waves(factor):
    with pytest.raises(SpecError, match="split_factor"):
        GluonAttention(_spec(), split_factor=factor)


LAYOUT_PAIRS = [("token", "token"), ("token", "channel"), ("channel", "token"), ("channel", "channel")]


@pytest.mark.parametrize("kl,vl", LAYOUT_PAIRS, ids=[f"K{k[0]}V{v[0]}" for k, v in LAYOUT_PAIRS])
@pytest.mark.parametrize("has_lens,page,merged", [(False, 0, False), (True, 0, False), (True, 16, False),
                                                   (False, 0, True), (True, 0, True)])
def test_mock_arguments_fill_every_kernel_parameter_with_the_real_dtypes(kl, vl, has_lens, page, merged):
    """The stand-in arguments that compile the kernel for its register count (GluonAttention.resident)
    name every parameter once, with the dtypes and shapes a real call passes (``merged``: the build that merges
    its splits itself, its output, log-sum-exp and barrier counters in the page table's and counters' places)."""
    import torch
    from triton.runtime.jit import MockTensor

    from foldc.backends.gluon.kernel import foldc_decode_gluon

    spec = foldc.AttentionSpec(32, 8, 128, foldc.Affine(2, kl, 128), foldc.Affine(2, vl, 128, torch.bfloat16))
    attn = GluonAttention(spec)
    launch = dict(attn._defaults, constexprs=constexprs(attn.config, 32, 2, attn.heads))
    args, kwargs = attn.mock_arguments(launch, torch.float16, has_lens, page, merged)
    names = [n for n in foldc_decode_gluon.arg_names if merged or n != "MERGE"]   # (False by default)
    assert len(args) + len([k for k in kwargs if k in names]) == len(names)
    bound = dict(zip(names, args))
    assert bound["Q"].dtype == torch.float16 and bound["KC"].dtype == torch.int32
    assert bound["KS"].dtype == torch.float16 and bound["VS"].dtype == bound["VZ"].dtype == torch.bfloat16
    assert isinstance(bound["SEQ_LENS"], MockTensor) and (bound["SEQ_LENS"].dtype == torch.int32) == has_lens
    assert kwargs["HAS_LENS"] is has_lens and kwargs["PAGE"] == page
    assert kwargs.get("MERGE", False) is merged and kwargs.get("launch_cooperative_grid", False) is merged
    if merged:
        assert (bound["KV_INDPTR"].dtype, bound["KV_INDICES"].dtype, bound["COUNTERS"].dtype) == (
            torch.float16, torch.float32, torch.int64)
    assert bound["stride_qh"] == 128 and bound["stride_kh"] == (page or 4096) * 8   # INT2: 8 words a token
    assert all(isinstance(bound[n], int) for n in names if n.startswith("stride_"))
    # token-wise scales run along tokens with stride 1, as a real cache's do
    if kl == "token":
        assert bound["stride_ksn"] == 1


class _FakeCompiled:
    def __init__(self, n_regs):
        self.n_regs, self.metadata = n_regs, type("M", (), {"shared": 8192})()
        self.loaded = False

    def _init_handles(self):
        self.loaded = True


def test_residency_compiles_each_variant_once_for_every_bucket(monkeypatch, tmp_path):
    """The register count comes from compiling the call's variant (no launch), once per variant:
    a growing cache (a new bucket per decode step) must not compile again."""
    import contextlib

    import torch

    compiles = []

    class FakeKernel:
        def warmup(self, *args, grid, **kwargs):
            compiles.append((kwargs["HAS_LENS"], kwargs["PAGE"]))
            return _FakeCompiled(168)

    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: type("P", (), {"shared_memory_per_multiprocessor": 233472})())
    monkeypatch.setattr("foldc.backends.gluon.launch.num_sms", lambda device: 132)
    attn = GluonAttention(_spec(), block_n=64, stages=2, split_factor=1.0, maxnreg=None)
    monkeypatch.setattr(attn, "_kernels", lambda: (FakeKernel(), None))
    monkeypatch.setenv("FOLDC_CACHE_DIR", str(tmp_path))     # an empty tuning cache: the defaults
    for tokens in (65536, 65537, 65538):          # three buckets, one variant
        launch = attn.launch_config(torch.bfloat16, 8, tokens)
        splits, _ = attn.split_plan(launch, 8, tokens, "cuda", torch.bfloat16, False, 0)
        assert launch[("registers", False, 0)] == 168
        assert attn.resident(launch, torch.bfloat16, False, 0, "cuda") == 12     # 168 registers: 12 per SM
        assert attn.resident(launch, torch.float16, False, 0, "cuda") == 12      # fp16 queries: the same build's
        assert splits == 49                                                       # 0.99 waves of 12 x 132
    assert compiles == [(False, 0)]
    attn.split_plan(attn.launch_config(torch.bfloat16, 8, 65536), 8, 65536, "cuda", torch.bfloat16, True, 16)
    assert compiles == [(False, 0), (True, 16)]   # the paged variant with lengths is another kernel


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("kl,vl", LAYOUT_PAIRS, ids=[f"K{k[0]}V{v[0]}" for k, v in LAYOUT_PAIRS])
@pytest.mark.parametrize("group", [128, 64, 32])
@pytest.mark.parametrize("pack", [1, 2])
def test_default_tile_is_64_tokens_only_for_packed_int2_whose_groups_hold_it(bits, kl, vl, group, pack):
    """64-token tiles for INT2 of every layout with one or two KV heads per program (measured faster on
    the H200), 32 otherwise; never a tile that straddles a channel-wise group."""
    def enc(layout):
        return foldc.Affine(bits, layout, 128 if layout == "token" else group)
    spec = foldc.AttentionSpec(32, 8, 128, enc(kl), enc(vl))
    attn = GluonAttention(spec, pack_heads=pack)
    channel_groups = [group for layout in (kl, vl) if layout == "channel"]
    want = 64 if bits == 2 and pack <= 2 and all(g % 64 == 0 for g in channel_groups) else 32
    assert attn.default_block_n == want
    for g in channel_groups:
        assert g % attn.default_block_n == 0


@pytest.mark.parametrize("k,v,dequant,block_n", [("channel:4:64", "token:4:64", True, 32),
                                                  ("channel:4:64", "channel:4:64", True, 32),
                                                  ("token:4:64", "channel:4:64", False, 64)])
def test_row_blocks_beside_groups_of_64_tokens_take_64_token_tiles_unless_a_side_is_rebuilt(k, v, dequant, block_n):
    """32 query rows per KV head in two blocks of 16 beside channel-wise groups of 64 tokens: 64-token tiles on sm_90
    where both sides fold; where eq. 12a rebuilds the channel-wise keys, 32 (64 spilled 30-44 registers a tile)."""
    from foldc.spec import spec_from_args

    attn = GluonAttention(spec_from_args(k, v, "64/2", 128), target="sm_90")
    assert attn.config.row_blocks == 2 and attn.config.key_dequant is dequant
    assert attn.default_block_n == block_n


@pytest.mark.parametrize("k,v,block_n", [("channel:2:64", "token:2:64", 64), ("channel:2:128", "token:2:64", 64),
                                          ("token:2:64", "channel:2:64", 64), ("token:2:64", "channel:2:128", 64),
                                          ("channel:2:64", "token:2:32", 32), ("token:2:32", "channel:2:128", 32),
                                          ("channel:4:64", "token:4:64", 32), ("channel:2:32", "token:2:64", 32)])
@pytest.mark.parametrize("target", ["sm_90", "sm_100"])
def test_default_tile_beside_a_channel_wise_side_and_two_token_groups(k, v, block_n, target):
    """Two token-wise groups a token on one side and channel-wise groups of 64 or 128 tokens on the other, INT2:
    64-token tiles (3-7% faster than 32 on an H100 at 8 x 64K, no spill ahead of time); four token-wise groups, INT4,
    or channel-wise groups of 32 tokens: 32."""
    from foldc.spec import spec_from_args

    attn = GluonAttention(spec_from_args(k, v, "32/8", 128), target=target)
    assert attn.heads == 2
    assert attn.default_block_n == block_n


@pytest.mark.parametrize("heads,kl,vl,block_n", [((64, 4), "token", "token", 32), ((64, 2), "token", "token", 32),
                                                 ((32, 2), "token", "token", 32), ((64, 4), "channel", "token", 32),
                                                 ((8, 8), "token", "token", 32), ((40, 8), "token", "token", 64),
                                                 ((32, 8), "token", "token", 64)])
def test_default_tile_by_query_rows(heads, kl, vl, block_n):
    """16 query rows of one KV head (q_per_kv 16, or a row block of 32): 32-token tiles (a register cap
    of 168 was slower in the H200 layout grid run, docs/perf.md). One head of 5 rows: 64-token tiles. Four
    one-row heads per program (query heads = KV heads): 32."""
    spec = foldc.AttentionSpec(*heads, 128, foldc.Affine(2, kl, 128), foldc.Affine(2, vl, 128))
    attn = GluonAttention(spec)
    assert attn.default_block_n == block_n
    assert attn.heads == (4 if heads == (8, 8) else 2 if heads == (32, 8) else 1)


@pytest.mark.parametrize("k_group,v_group,pack,want", [(64, 64, 2, 32), (32, 32, 2, 64), (32, 64, 2, 64),
                                                        (32, 128, 2, 64), (64, 64, 1, 32), (128, 128, 2, 64)])
def test_default_tile_with_token_wise_channel_groups(k_group, v_group, pack, want):
    """Packed INT2 with two channel groups per token takes 32-token tiles (168 registers, three warps
    per scheduler, against 214); with four, 64 (both sizes hold two warps; H200, docs/perf.md). A mix
    follows the side with more groups (not measured)."""
    spec = foldc.AttentionSpec(32, 8, 128, foldc.Affine(2, "token", k_group), foldc.Affine(2, "token", v_group))
    attn = GluonAttention(spec, pack_heads=pack)
    assert (attn.config.key_groups, attn.config.value_groups) == (128 // k_group, 128 // v_group)
    assert attn.default_block_n == (want if pack > 1 else 32)


@pytest.mark.parametrize("k,v,head_dim,block_n,heads", [
    ("token:2:32", "channel:2:64", 128, 32, 2), ("channel:2:128", "token:2:32", 128, 32, 2),
    ("token:2:32", "token:2:32", 128, 64, 2), ("token:2:64", "token:2:64", 256, 32, 1),
    ("token:2:128", "token:2:128", 256, 32, 2)])
def test_tiles_and_heads_that_spilled_give_way(k, v, head_dim, block_n, heads):
    """Four channel groups per token beside a channel-wise side take 32-token tiles (64 spilled 12-37 registers per
    tile on sm_90, 32 none), as does head_dim 256, where four groups take one KV head per program (two spilled,
    AOT SASS: tests/backends/test_gluon_grid_aot.py builds both); both sides token-wise in four groups keep 64."""
    from foldc.spec import spec_from_args

    attn = GluonAttention(spec_from_args(k, v, "32/8", head_dim))
    assert (attn.default_block_n, attn.heads) == (block_n, heads)


CHUNKS = [("token", "token", 64, 1), ("token", "token", 32, 1), ("channel", "token", 64, 2),
          ("token", "channel", 32, 4), ("channel", "channel", 64, 2)]


@pytest.mark.parametrize("kl,vl,block_n,chunk", CHUNKS, ids=[f"K{k[0]}V{v[0]}-bn{n}" for k, v, n, _ in CHUNKS])
def test_dynamic_tiles_draw_a_channel_group_at_a_time(kl, vl, block_n, chunk):
    """A drawn chunk starts on a channel-wise group's boundary and covers the group (128 tokens here),
    so the kernel's once-per-group reload of the group's scales meets every group at its first tile."""
    from foldc.backends.gluon.launch_defaults import chunk_tiles

    spec = foldc.AttentionSpec(32, 8, 128, foldc.Affine(2, kl, 128), foldc.Affine(2, vl, 128))
    attn = GluonAttention(spec, block_n=block_n, dynamic_tiles=True)
    assert chunk_tiles(attn.config, block_n) == chunk
    import torch

    consts = attn.launch_config(torch.bfloat16, 8, 4096)["constexprs"]
    assert consts["DYNAMIC"] and consts["CHUNK"] == chunk
    assert not GluonAttention(spec, block_n=block_n).launch_config(torch.bfloat16, 8, 4096)["constexprs"]["DYNAMIC"]


@pytest.mark.parametrize("bad", [None, 1, "yes"])
def test_dynamic_tiles_must_be_a_bool(bad):
    with pytest.raises(SpecError, match="dynamic_tiles"):
        GluonAttention(_spec(), dynamic_tiles=bad)


def test_dynamic_tiles_need_two_stages():
    with pytest.raises(SpecError, match="stages=2"):
        GluonAttention(_spec(), dynamic_tiles=True, stages=3)
    with pytest.raises(SpecError, match="stages=2"):
        constexprs(GluonAttention(_spec()).config, 32, 4, 1, None, dynamic=True)


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 64), tokens=st.integers(1, 1 << 18), resident=st.integers(1, 16),
       splits=st.one_of(st.none(), st.integers(1, 300)), group=st.sampled_from([None, 32, 128]))
def test_dynamic_split_plan_never_launches_more_programs_than_chunks(batch, tokens, resident, splits, group):
    """With dynamic tiles a program's first chunk is its own (chunk s); every further one is drawn.
    Programs past the chunks would only write empty partials, so the plan launches at most one per
    chunk, and at least one."""
    import torch

    enc = foldc.Affine(2, "token", 128)
    venc = enc if group is None else foldc.Affine(2, "channel", group)
    attn = _Resident(foldc.AttentionSpec(32, 8, 128, enc, venc), resident=resident, splits=splits, block_n=32,
                     dynamic_tiles=True)
    launch = attn.launch_config(torch.bfloat16, batch, tokens)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("foldc.backends.gluon.launch.num_sms", lambda device: 132)
        used, _ = attn.split_plan(launch, batch, tokens, "cuda")
    chunks = math.ceil(math.ceil(tokens / 32) / launch["constexprs"]["CHUNK"])
    assert 1 <= used <= chunks
    if splits is not None:
        assert used == min(splits, chunks)


def _recorded(spec, monkeypatch):
    """(a launcher of fixed residency, its decode and merge kernels as stand-ins that record their launches)."""
    attn = _Resident(spec, resident=12)
    decode, merge = LaunchRecorder(), LaunchRecorder()
    monkeypatch.setattr(attn, "_launchers", lambda: (decode, merge))
    return attn, decode, merge


def test_eager_launches_are_noted_then_bound_then_launched_by_address(monkeypatch):
    """`GluonAttention.launch` on stand-in kernels (CPU tensors): the first call with a launch's integers
    launches both kernels the ordinary way and notes them, the second binds them, later ones give the bound
    launches the call's addresses (the decode kernel's 14 in its order, the merge's five) and launch nothing
    else. A bound launch that declines (a misaligned tensor) sends that call the ordinary way, the merge's
    alone where only it declines; another cache length takes the same bound launches (the count given per call),
    another softmax scale is another launch, noted anew."""
    from foldc.backends.gluon.decode_args import TOKENS_ARG, decode_addresses
    from foldc.backends.runtime.launch import allocate_workspace

    spec = _spec(2)
    attn, decode, merge = _recorded(spec, monkeypatch)
    gen = torch.Generator().manual_seed(9)
    q, k, v, _ = foldc.testing.random_inputs(spec, 2, 256, torch.float16, "cpu", gen)
    launch = attn.plan_launch(torch.bfloat16, 2, 256, torch.device("cpu"))
    ws = allocate_workspace(launch, "cpu")
    out, lse = torch.empty(2, 32, 128, dtype=q.dtype), torch.empty(2, 32)

    def call(scale=0.1, tokens=256):
        attn.launch(launch.options, q, k, v, None, ws, out, lse, scale, launch.per_split, launch.splits, tokens)

    call()
    assert (len(decode.launches), len(merge.launches), decode.bound) == (1, 1, [])
    call()
    assert (len(decode.launches), len(merge.launches), len(decode.bound), len(merge.bound)) == (2, 2, 1, 1)
    for _ in range(3):
        q.normal_(generator=gen)   # new values, same buffers: the same launch
        call()
    assert (len(decode.launches), len(merge.launches)) == (2, 2)
    (bound_decode,), (bound_merge,) = decode.bound, merge.bound
    assert bound_decode.calls == [decode_addresses(q, k, v, None, ws)] * 3
    assert bound_merge.calls == [(*(t.data_ptr() for t in ws), out.data_ptr(), lse.data_ptr())] * 3
    bound_merge.ok = False
    call()
    assert (len(decode.launches), len(merge.launches), len(bound_decode.calls)) == (2, 3, 4)
    bound_decode.ok = False
    call()
    assert (len(decode.launches), len(merge.launches)) == (3, 4)
    bound_decode.ok = bound_merge.ok = True
    call(0.1, 200)   # another cache length: the same bound launches, the token count given per call
    assert (len(decode.launches), len(merge.launches)) == (3, 4)
    assert bound_decode.dynamic == (TOKENS_ARG,) and bound_decode.values == [(256,)] * 5 + [(200,)]
    call(0.2, 256)   # another softmax scale: another launch, noted, not yet bound
    assert len(decode.bound) == 1 and (len(decode.launches), len(merge.launches)) == (4, 5)


def test_paged_launches_bind_with_the_page_table_given_per_call(monkeypatch):
    """A paged decode (`PagedDecodeWrapper.run`'s launch) binds as a contiguous one does: its second call with one
    launch's integers binds, later ones hand the bound decode the page table's addresses among its 14 (a new table
    at another address takes the same bound launches); another page size is another launch, noted anew."""
    from foldc.backends.gluon.decode_args import decode_addresses
    from foldc.backends.runtime.launch import allocate_workspace
    from foldc.serving import page_pool

    spec = _spec(2)
    attn, decode, merge = _recorded(spec, monkeypatch)
    gen = torch.Generator().manual_seed(5)
    batch, pages = 2, 8
    q = torch.randn(batch, 32, 128, generator=gen).half()
    lens = torch.tensor([70, 100], dtype=torch.int32)
    out, lse = torch.empty(batch, 32, 128, dtype=q.dtype), torch.empty(batch, 32)

    def call(page, indices):
        k, v = page_pool(spec, "k", pages, page), page_pool(spec, "v", pages, page)
        launch = attn.plan_launch(torch.bfloat16, batch, 128, torch.device("cpu"), has_lens=True, page=page)
        ws = allocate_workspace(launch, "cpu")
        paged = (torch.tensor([0, 2, 4], dtype=torch.int32), indices, page)
        attn.launch(launch.options, q, k, v, lens, ws, out, lse, 0.1, launch.per_split, launch.splits,
                    launch.cache_tokens, paged)
        return decode_addresses(q, k, v, lens, ws, paged)

    table = torch.randperm(pages, generator=gen)[:4].to(torch.int32)
    call(64, table)
    call(64, table)
    assert (len(decode.launches), len(decode.bound), len(merge.bound)) == (2, 1, 1)
    moved = table.clone()   # another page table (another address): the same bound launches
    addresses = [call(64, table), call(64, moved)]
    assert len(decode.launches) == 2 and decode.bound[0].calls == addresses
    assert addresses[0][12] == table.data_ptr() and addresses[1][12] == moved.data_ptr()
    call(32, table)   # another page size: another launch, noted
    assert (len(decode.launches), len(decode.bound)) == (3, 1)


def test_run_takes_the_token_count_per_call_within_its_launch(monkeypatch):
    """`GluonAttention.run(..., tokens=n)` (the serving caches' steps): a launch planned without lengths runs
    over n of its tokens, the count reaching the decode kernel as its cache_tokens argument; a count outside
    0 .. the launch's tokens (an out-of-bounds read) and a count with page tables are refused by name."""
    from foldc.backends.gluon.decode_args import TOKENS_ARG
    from foldc.backends.runtime.launch import allocate_workspace

    spec = _spec(2)
    attn, decode, merge = _recorded(spec, monkeypatch)
    gen = torch.Generator().manual_seed(3)
    q, k, v, _ = foldc.testing.random_inputs(spec, 1, 512, torch.float16, "cpu", gen)
    launch = attn.plan_launch(torch.bfloat16, 1, 512, torch.device("cpu"), has_lens=False)
    assert not launch.has_lens and launch.cache_tokens == 512
    ws = allocate_workspace(launch, "cpu")
    out, lse = torch.empty(1, 32, 128, dtype=q.dtype), torch.empty(1, 32)
    for n in (0, 1, 300, 512):
        attn.run(launch, q, k, v, out, lse, 0.1, workspace=ws, tokens=n)
    assert [args[TOKENS_ARG] for _, args in decode.launches] == [0, 1]   # then bound: the count per call
    assert decode.bound[0].values == [(300,), (512,)]
    for bad, paged in ((-1, None), (513, None), (10, (q, q))):
        with pytest.raises(foldc.InputError, match=f"tokens={bad}"):
            attn.run(launch, q, k, v, out, lse, 0.1, workspace=ws, tokens=bad, paged=paged)


def test_a_prepared_run_hands_the_bound_launches_its_fixed_addresses(monkeypatch):
    """`GluonAttention.prepare` (a serving cache's decode steps): its first two calls go through `run` (keyed, then
    bound), later ones hand the bound decode and merge the cache's and buffers' addresses made once with each call's
    q, out and token count; a q of other strides, or of another batch, and a call inside a CUDA-graph capture take
    `run` again; a merge that declines is launched the ordinary way."""
    import foldc.backends.gluon.launch as gluon_launch
    import foldc.backends.gluon.prepared as gluon_prepared
    from foldc.backends.runtime.launch import allocate_workspace

    spec = _spec(2)
    attn, decode, merge = _recorded(spec, monkeypatch)
    merges = []
    monkeypatch.setattr(gluon_prepared, "launch_merge", lambda *a, **kw: merges.append(a))
    gen = torch.Generator().manual_seed(5)
    q, k, v, _ = foldc.testing.random_inputs(spec, 1, 512, torch.float16, "cpu", gen)
    launch = attn.plan_launch(torch.float16, 1, 512, torch.device("cpu"), has_lens=False)
    ws, lse = allocate_workspace(launch, "cpu"), torch.empty(1, 32)
    prepared = attn.prepare(launch, k, v, ws, lse, 0.1)
    outs = [torch.empty(1, 32, 128, dtype=q.dtype) for _ in range(4)]
    qs = [torch.randn(1, 32, 128, generator=gen).half() for _ in range(4)]
    for i, n in enumerate((100, 200, 300, 512)):
        prepared(qs[i], outs[i], n)
    assert len(decode.launches) == 2 and len(decode.bound) == 1
    (bd,), (bm,) = decode.bound, merge.bound
    fixed = (k.codes.data_ptr(), k.scale.data_ptr(), k.zero.data_ptr(), v.codes.data_ptr(), v.scale.data_ptr(),
             v.zero.data_ptr())
    wsa = tuple(t.data_ptr() for t in ws)
    assert bd.calls == [(x.data_ptr(), *fixed, x.data_ptr(), *wsa, *(x.data_ptr(),) * 3) for x in qs[2:]]
    assert bd.values == [(300,), (512,)]
    assert bm.calls == [(*wsa, o.data_ptr(), lse.data_ptr()) for o in outs[2:]]
    wide = torch.randn(1, 32, 256, generator=gen).half()[:, :, :128]   # other strides: run, keyed anew
    prepared(wide, outs[0], 64)
    assert len(decode.launches) == 3 and decode.launches[-1][1][0] is wide
    for module in (gluon_launch, gluon_prepared):   # inside a capture: run, never bound
        monkeypatch.setattr(module, "capturing", lambda t: True)
    prepared(qs[0], outs[0], 64)
    assert len(decode.launches) == 4 and len(bd.calls) == 2
    for module in (gluon_launch, gluon_prepared):
        monkeypatch.setattr(module, "capturing", lambda t: False)
    bm.ok = False
    prepared(qs[1], outs[1], 77)
    assert len(bd.calls) == 3 and len(merges) == 1 and merges[0][4] is outs[1] and merges[0][5] is lse


def test_the_generated_kernels_eager_launches_are_bound_too(monkeypatch):
    """`TritonAttention.run` (the generated kernel: plain parts of the caches, fp16 queries) on stand-in
    kernels: its tensors come first in the generated signature; the second call with a launch's integers
    binds decode and merge, later ones pass the tensors' addresses (in the signature's order) and nothing
    else; another softmax scale is another launch; the interpreter and page tables never bind."""
    from foldc.backends.runtime.launch import allocate_workspace
    from foldc.registry import attention_backend

    for spec in (foldc.AttentionSpec(8, 2, 64), _spec(2)):
        attn = attention_backend("triton").kernel(spec, "sm_90")
        decode, merge = LaunchRecorder(), LaunchRecorder()
        monkeypatch.setattr(attn, "_fast_kernels", lambda module: (decode, merge))
        gen = torch.Generator().manual_seed(4)
        q, k, v, lens = foldc.testing.random_inputs(spec, 2, 96, torch.float16, "cpu", gen)
        lens = lens.to(torch.int32)
        launch = attn.plan_launch(torch.float16, 2, 96, torch.device("cpu"))
        ws = allocate_workspace(launch, "cpu")
        out, lse = torch.empty(2, spec.num_q_heads, spec.head_dim, dtype=q.dtype), torch.empty(2, spec.num_q_heads)
        _, ks, _, _ = attn.kernels("fp16", launch.block_n)
        names = [a for a in ks.args if a.isupper()]
        assert ks.args[:len(names)] == names   # the tensors first

        def call(scale=0.1):
            attn.run(launch, q, k, v, out, lse, scale, seq_lens=lens, workspace=ws)

        for _ in range(5):
            call()
        assert (len(decode.launches), len(merge.launches), len(decode.bound), len(merge.bound)) == (2, 2, 1, 1)
        tensors = {"SEQ_LENS": lens, "WS_M": ws[0], "WS_L": ws[1], "WS_ACC": ws[2], "Q": q}
        for side, x in (("K", k), ("V", v)):
            tensors.update({f"{side}_CODES": x.codes, f"{side}_SCALE": x.scale, f"{side}_ZERO": x.zero}
                           if isinstance(x, foldc.AffineTensor) else {f"{side}_VALUES": x})
        assert decode.bound[0].calls == [tuple(tensors[a].data_ptr() for a in names)] * 3
        assert merge.bound[0].calls == [(*(t.data_ptr() for t in ws), out.data_ptr(), lse.data_ptr())] * 3
        first = decode.launches[0][1]   # the ordinary launch: the same tensors, in the same order
        assert all(a is tensors[name] for a, name in zip(first, names)) and len(first) == len(ks.args)
        call(0.2)
        assert (len(decode.launches), len(decode.bound)) == (3, 1)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr("foldc.backends.triton.launch.interpreter", lambda on: __import__("contextlib").nullcontext())
        for _ in range(3):
            call(0.3)
        monkeypatch.delenv("TRITON_INTERPRET")
        assert (len(decode.launches), len(decode.bound)) == (6, 1)


def test_a_cache_past_32_bit_offsets_is_refused_by_the_register_operand_kernels():
    """The decode kernels' token loops keep 32-bit offsets: a contiguous cache whose code words pass 2**31 - 1
    (b x stride_b) is refused by name with the fixes; a paged pool is checked within a page (its page offsets are
    64-bit), so the same pool as pages is taken (meta tensors: nothing allocated)."""
    from types import SimpleNamespace

    from foldc.backends.runtime.offsets import DECODE_FIX, INT32_MAX, check_offsets, decode_offsets
    from foldc.errors import InputError

    def side(batch, tokens):
        codes = torch.empty(batch, 8, tokens, 64, device="meta", dtype=torch.uint8)   # INT4, head_dim 128
        scale = torch.empty(batch, 8, tokens, 1, device="meta", dtype=torch.float16)
        return SimpleNamespace(codes=codes, scale=scale, zero=scale)

    q = torch.empty(64, 32, 128, device="meta", dtype=torch.bfloat16)
    ws = (None, None, torch.empty(64, 8, 4, 16, 128, device="meta"))
    k = side(64, 2**18 + 16)
    words = 64 * 8 * (2**18 + 16) * 16 - 1
    assert words > INT32_MAX
    offsets = decode_offsets(q, k, k, ws)
    assert offsets["k.codes (32-bit words)"] == words and offsets["q"] == 64 * 32 * 128 - 1
    with pytest.raises(InputError, match=rf"k.codes \(32-bit words\) reaches element offset {words}.*paged pool"):
        check_offsets("register-operand decode kernel", offsets, DECODE_FIX)
    pages = side(64 * (2**18 + 16) // 16, 16)
    check_offsets("register-operand decode kernel", decode_offsets(q, pages, pages, ws, paged=(None, None, 16)),
                  DECODE_FIX)
