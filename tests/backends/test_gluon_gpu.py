"""The register-operand (Gluon) kernel on an sm_90 GPU. Skipped elsewhere (CI has no GPU).

Same bar as the Triton kernel's GPU tests: relative L2 against float64 attention over the same
dequantized cache at most 1.10x that of plain bf16 attention over those values, fresh random
inputs, ``out=`` poisoned with NaN and fully written.
"""
from __future__ import annotations

import pytest
import torch
from _kernel_cases import check_graph_replay, run_with_lens

import foldc
from foldc.testing import random_inputs, rel_l2, run_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                reason="needs an sm_90 GPU")

TOLERANCE = 1.10
A = foldc.Affine
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}   # both held to plain bf16 attention's error


def _spec(bits=2, heads=(32, 8), head_dim=128, kl="token", vl="token", group=128):
    def enc(layout):
        return A(bits, layout, head_dim if layout == "token" else group)
    return foldc.AttentionSpec(*heads, head_dim, enc(kl), enc(vl))


LAYOUTS = [("token", "token"), ("channel", "token"), ("token", "channel"), ("channel", "channel")]


def _check(r, what):
    assert r.unwritten == 0, f"{what}: {r.unwritten} output elements never written"
    assert r.error <= TOLERANCE * r.bf16_error, f"{what}: error {r.error:.3e} > {TOLERANCE} x bf16's {r.bf16_error:.3e}"


def test_auto_takes_the_register_operand_kernel_for_token_wise_plans():
    assert type(foldc.compile(_spec(), "auto")).__name__ == "GluonAttention"
    assert type(foldc.compile(_spec(), "auto", kernel="triton")).__name__ == "TritonAttention"
    whole_fields = foldc.AttentionSpec(32, 8, 128, A(2, "token", 32), A(2, "token", 64))
    assert type(foldc.compile(whole_fields, "auto")).__name__ == "GluonAttention"
    split_fields = foldc.AttentionSpec(32, 8, 128, A(4, "token", 32), A(4, "token", 32))
    assert type(foldc.compile(split_fields, "auto")).__name__ == "GluonAttention"
    mixed = foldc.AttentionSpec(32, 8, 128, A(4, "token", 128), A(2, "token", 128))
    assert type(foldc.compile(mixed, "auto")).__name__ == "GluonAttention"


# (K, V as "layout:bits:group", query heads / KV heads, head_dim): layouts the generator lowers
# beyond one width and whole-field groups: mixed widths, INT8, groups inside a bit field, row blocks
# (more query rows per KV head than the MMA's N), head_dim 64 and 256, other scale dtypes
GRID = [("token:4:128", "token:2:128", "32/8", 128), ("token:2:128", "token:4:128", "32/8", 128),
        ("channel:4:128", "token:2:128", "32/8", 128), ("token:4:128", "channel:2:128", "32/8", 128),
        ("token:8:128", "token:8:128", "32/8", 128), ("channel:8:128", "channel:8:128", "32/8", 128),
        ("token:8:128", "token:4:128", "32/8", 128), ("token:4:32", "token:4:32", "32/8", 128),
        ("token:8:32", "token:8:64", "32/8", 128), ("token:4:64", "token:8:32", "32/8", 128),
        ("channel:8:32", "token:4:32", "32/8", 128), ("channel:2:32", "channel:8:64", "32/8", 128),
        ("token:2:128", "token:2:128", "32/1", 128), ("token:4:128", "channel:4:128", "64/2", 128),
        ("token:2:128", "token:2:128", "48/2", 128), ("token:4:128", "token:2:128", "40/8", 128),
        ("token:4:128", "token:4:128", "56/8", 128), ("token:4:128", "token:4:128", "8/8", 128),
        ("token:4:128", "token:4:128", "32/8", 256), ("channel:4:128", "token:2:128", "16/4", 256),
        ("token:2:128", "token:2:128", "32/2", 256), ("token:8:64", "token:4:64", "32/8", 64),
        ("channel:8:64", "token:8:64", "16/8", 64), ("token:4:128:fp32", "token:2:128:bf16", "32/8", 128),
        ("channel:4:64:bf16", "token:4:32:fp32", "32/8", 128), ("none", "token:4:128", "32/8", 128),
        ("token:4:128", "none", "32/8", 128), ("none", "channel:2:128", "32/8", 128),
        ("channel:4:64", "none", "32/8", 128), ("none", "token:8:64", "16/8", 64),
        ("token:2:128", "none", "16/4", 256), ("none", "token:2:128", "64/2", 128),
        ("token:2:64", "token:2:64", "32/8", 64), ("channel:2:64", "token:2:32", "32/8", 64),
        ("token:2:64", "channel:2:32", "8/8", 64), ("token:2:64", "token:4:64", "64/4", 64),
        ("channel:2:64", "channel:2:64", "16/8", 64), ("token:2:64", "none", "32/8", 64),
        ("none", "token:2:32", "40/8", 64), ("token:2:64:fp32", "token:2:64:bf16", "48/4", 64),
        ("channel:4:64", "token:4:64", "64/2", 128), ("token:2:128:fp32", "token:2:128", "32/8", 128),
        ("token:4:96", "token:4:96", "32/8", 96), ("token:2:48", "channel:2:64", "32/8", 96),
        ("channel:4:64", "token:2:96", "24/8", 96), ("token:2:80", "none", "32/8", 80),
        ("none", "token:4:112", "32/8", 112), ("channel:8:64", "token:4:80", "16/8", 160),
        ("channel:4:32", "channel:4:32", "32/8", 96),
        # 16 rows per program: each side rebuilt per value or folded as eq. 12 and 12a say (channel-wise keys
        # rebuilt; token-wise groups at the tie folded)
        ("token:2:32", "token:2:32", "64/4", 128), ("channel:2:32", "channel:4:32", "64/4", 128),
        ("token:4:32", "channel:2:32", "64/2", 128), ("channel:2:32", "token:2:128", "64/4", 128),
        ("token:4:64", "token:4:32", "64/2", 128), ("channel:8:32", "token:8:32", "64/4", 64),
        ("token:2:32", "token:4:32", "64/4", 64), ("channel:4:32", "channel:4:32", "64/4", 96),
        ("token:8:32", "token:2:32:fp32", "64/4", 128), ("channel:4:32:bf16", "channel:2:32:fp32", "64/2", 128),
        # channel-wise groups of 16 tokens: two per 32-token tile, folded or (16 rows) rebuilt per value
        ("channel:2:16", "token:2:128", "32/8", 128), ("token:4:128", "channel:4:16", "32/8", 128),
        ("channel:2:16", "channel:2:16", "32/8", 128), ("channel:8:16", "token:4:32", "16/8", 64),
        ("channel:4:16:fp32", "channel:8:16", "40/8", 128), ("channel:2:16", "channel:4:16", "64/4", 128),
        ("token:2:128", "channel:2:16", "8/8", 128), ("channel:4:16", "token:4:96", "32/8", 96),
        # ... past 128 channels (head_dim 160 padded to 256, and 256)
        ("channel:2:16", "token:2:128", "32/8", 256), ("token:4:128", "channel:4:16", "32/8", 256),
        ("channel:2:16", "channel:2:16", "32/8", 256), ("channel:8:16", "token:4:64", "16/4", 256),
        ("token:2:128", "channel:2:16", "16/8", 256), ("channel:4:16:fp32", "channel:2:16", "8/8", 256),
        ("channel:4:16", "token:4:80", "32/8", 160), ("channel:4:16", "token:2:128", "72/8", 256),
        ("channel:2:16", "channel:2:16", "16/2", 256), ("token:4:128", "channel:4:16", "64/8", 256),   # dequant
        # both sides channel-wise past 128 channels
        ("channel:2:128", "channel:2:128", "32/8", 256), ("channel:4:64", "channel:8:64", "16/4", 256),
        ("channel:2:32:bf16", "channel:4:32", "16/8", 256), ("channel:8:128", "channel:2:128", "8/8", 256),
        # eight token-wise channel groups per token
        ("token:2:32", "token:2:32", "32/8", 256), ("token:4:32:fp32", "token:4:32", "16/8", 256),
        ("token:8:32", "token:2:128", "32/8", 256), ("token:2:128", "token:2:32:bf16", "32/2", 256),
        # token-wise groups across a padded head_dim's bit fields
        ("token:2:32", "token:2:32", "32/8", 96), ("token:4:32", "token:2:96", "32/8", 96),
        ("token:8:48", "token:8:32:fp32", "32/8", 96), ("token:8:80", "token:8:80", "16/8", 160),
        ("token:2:32", "channel:2:32", "40/8", 96),
        # ... five and six groups (head_dim 160 and 192 in groups of 32), ragged row blocks (9 rows: 5 + 4) among them
        ("token:2:32", "token:2:32", "32/8", 160), ("token:4:32", "token:8:32:fp32", "16/8", 192),
        ("token:8:32", "token:2:32:bf16", "32/4", 160), ("token:2:32", "none", "32/8", 192),
        ("none", "token:4:32", "32/8", 160), ("token:4:32", "channel:4:32", "32/8", 192),
        ("channel:2:64", "token:2:32", "16/8", 192), ("token:2:32", "token:4:32", "18/2", 160),
        # eight token-wise groups beside a channel-wise side at head_dim 256
        ("token:2:32", "channel:2:64", "16/4", 256), ("channel:2:64", "token:2:32", "16/4", 256),
        ("token:4:32", "channel:4:128", "32/8", 256),
        # token-wise groups across a padded head_dim's bit fields at 16 rows (dequant plans before eq. 12a)
        ("token:2:32", "token:2:32", "64/4", 96), ("token:8:32", "token:4:96", "64/4", 96),
        # head_dims below 64 that README says lower: 48 (padded to 128) and 32 at 8 bits
        ("token:2:48", "channel:4:64", "16/4", 48), ("token:4:48", "token:2:48", "32/8", 48),
        ("token:8:32", "token:8:32", "32/8", 32)]
# ragged row blocks: query rows per KV head that split into no equal blocks (17: 9 + 8; 9 at head_dim 256: 5 + 4),
# the last block's padding rows masked in the kernel and the merge; a dequant plan at 16-row blocks (31: 16 + 15)
RAGGED = [("token:2:128", "token:2:128", "34/2", 128), ("token:4:64", "channel:2:64", "50/2", 128),
          ("channel:4:64", "token:4:64", "62/2", 128), ("token:2:64", "token:2:64", "42/2", 64),
          ("token:2:128", "token:4:128", "18/2", 256), ("channel:4:128", "token:2:128", "26/2", 256),
          ("token:2:32", "token:2:32", "46/2", 128), ("token:4:96", "token:4:96", "21/1", 96),
          ("token:2:32", "channel:4:32", "62/2", 128)]


def _grid_spec(k, v, heads, head_dim):
    from foldc.spec import spec_from_args

    return spec_from_args(k, v, heads, head_dim)


@pytest.mark.parametrize("k,v,heads,head_dim", GRID, ids=[f"{k}-{v}-{h}-d{d}" for k, v, h, d in GRID])
def test_generated_layouts_match_float64(k, v, heads, head_dim):
    """Each side lowered on its own (widths, groups, layouts, a plain bf16 side) gives the float64 answer within the bar,
    ragged lengths with a 1-token sequence and a partial last tile, splits that start mid-sequence."""
    spec = _grid_spec(k, v, heads, head_dim)
    attn = foldc.compile(spec, "sm_90", kernel="gluon", splits=5)
    r = run_with_lens(attn, spec, [3001, 1, 1500, 2047], 3001, torch.bfloat16, "cuda",
                      seed=sum(map(ord, k + v + heads)) + head_dim)
    _check(r, f"{spec.describe()}")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("k,v,heads,head_dim", RAGGED, ids=[f"{k}-{v}-{h}-d{d}" for k, v, h, d in RAGGED])
def test_ragged_row_blocks_match_float64(k, v, heads, head_dim, dtype):
    """Query rows per KV head in row blocks of unequal size: every query head written once from its own block
    (out poisoned with NaN), within the bar for both query dtypes, ragged lengths, splits mid-sequence."""
    spec = _grid_spec(k, v, heads, head_dim)
    attn = foldc.compile(spec, "sm_90", kernel="gluon", splits=5)
    assert attn.config.head_rows == spec.q_per_kv and attn.config.row_blocks > 1
    r = run_with_lens(attn, spec, [2500, 1, 1300, 2047], 2500, DTYPES[dtype], "cuda",
                      seed=sum(map(ord, k + v + heads)) + head_dim + 7)
    _check(r, f"{spec.describe()} {dtype}")
    # calls without lengths: the ordinary path, then the bound launches (decode and merge with HEAD_ROWS), then
    # the held eager entry; each a new output, all equal to the first and to float64 within the bar
    q, kc, vc, _ = random_inputs(spec, 2, 1000, DTYPES[dtype], "cuda", torch.Generator().manual_seed(head_dim))
    outs = [attn(q, kc, vc) for _ in range(4)]
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert rel_l2(outs[0], foldc.attention_reference(q, kc, vc)) <= 5e-3


PLAIN_GRID = [row for row in GRID if "none" in row[:2]]


@pytest.mark.parametrize("k,v,heads,head_dim", PLAIN_GRID, ids=[f"{k}-{v}-{h}-d{d}" for k, v, h, d in PLAIN_GRID])
def test_a_plain_side_in_fp16_matches_float64(k, v, heads, head_dim):
    """fp16 queries with a plain fp16 side: the kernel reads that side's words in the queries' dtype."""
    spec = _grid_spec(k, v, heads, head_dim)
    attn = foldc.compile(spec, "sm_90")
    assert type(attn).__name__ == "GluonAttention"
    r = run_with_lens(attn, spec, [3001, 1, 1500, 2047], 3001, torch.float16, "cuda",
                      seed=sum(map(ord, k + v + heads)) + head_dim + 1)
    _check(r, f"{spec.describe()} fp16")


DEQUANT_RANGES = [("channel:4:64", "token:4:64"), ("channel:4:32", "channel:2:32")]


@pytest.mark.parametrize("k,v", DEQUANT_RANGES, ids=[f"{k}-{v}" for k, v in DEQUANT_RANGES])
@pytest.mark.parametrize("k_mult,v_mult", [(1e-4, 1e-4), (300.0, 200.0), (1e-3, 50.0)],
                         ids=["tiny", "large", "mixed"])
def test_dequant_plans_keep_values_in_range(k, v, k_mult, v_mult):
    """A dequant plan rebuilds values in fp16 at a power of two per token or group (tile_dequant.py):
    caches of keys and values 1e-4 or hundreds of times the usual size stay within the bar."""
    from foldc.reference import attention_reference
    from foldc.testing import bf16_attention

    spec = _grid_spec(k, v, "64/4", 128)
    gen = torch.Generator().manual_seed(int(k_mult * 1e4) + int(v_mult))
    q = torch.randn(2, 64, 128, generator=gen).to("cuda", torch.bfloat16)
    keys = torch.randn(2, 4, 1500, 128, generator=gen) * k_mult
    values = (torch.randn(2, 4, 1500, 128, generator=gen) + 0.5) * v_mult
    kq, vq = foldc.quantize(keys.cuda(), spec.k), foldc.quantize(values.cuda(), spec.v)
    lens = torch.tensor([1500, 777], device="cuda")
    sm_scale = 0.5 / (k_mult * 128 ** 0.5)   # logits of order one whatever the keys' size
    out = torch.full((2, 64, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = foldc.compile(spec, "sm_90", kernel="gluon")(q, kq, vq, sm_scale=sm_scale, seq_lens=lens, out=out)
    ref = attention_reference(q, kq, vq, sm_scale=sm_scale, seq_lens=lens)
    err, base = rel_l2(got, ref), rel_l2(bf16_attention(q, kq, vq, sm_scale, lens), ref)
    assert not torch.isnan(out).any()
    assert err <= TOLERANCE * base, f"{spec.describe()} x({k_mult}, {v_mult}): error {err:.3e} > bf16's {base:.3e}"


KEY_FOLD_RANGES = [("channel:2:32", "token:2:32", "32/8", 128), ("channel:2:32", "channel:4:64", "8/8", 128),
                   ("channel:2:16", "token:4:128", "40/8", 128), ("channel:2:16", "token:2:64", "32/8", 64)]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("k,v,heads,head_dim", KEY_FOLD_RANGES, ids=[f"{k}-{v}-{h}-d{d}" for k, v, h, d in KEY_FOLD_RANGES])
@pytest.mark.parametrize("k_mult,q_mult", [(1e-4, 1.0), (300.0, 1.0), (1.0, 30.0), (3e-3, 30.0)],
                         ids=["tiny", "large", "loud", "tiny-loud"])
def test_channel_wise_key_fold_keeps_values_in_range(k, v, heads, head_dim, dtype, k_mult, q_mult):
    """Channel-wise keys with fp16 scales build each group's query operand in fp16 at a power of two per query
    row and per head's group (tile_groups.key_group16): keys 1e-4 or hundreds of times the usual size, channels
    of sizes 2^-6 to 2^3 apart, queries 30 times louder, stay within the bar at logits of order one."""
    from foldc.reference import attention_reference
    from foldc.testing import bf16_attention

    spec = _grid_spec(k, v, heads, head_dim)
    gen = torch.Generator().manual_seed(int(k_mult * 1e4) + int(q_mult) + head_dim)
    q = (torch.randn(2, spec.num_q_heads, head_dim, generator=gen) * q_mult).to("cuda", DTYPES[dtype])
    keys = torch.randn(2, spec.num_kv_heads, 1500, head_dim, generator=gen) * k_mult * \
        torch.exp2(torch.randint(-6, 4, (1, spec.num_kv_heads, 1, head_dim), generator=gen).float())
    values = torch.randn(2, spec.num_kv_heads, 1500, head_dim, generator=gen) + 0.5
    kq, vq = foldc.quantize(keys.cuda(), spec.k), foldc.quantize(values.cuda(), spec.v)
    lens = torch.tensor([1500, 777], device="cuda")
    sm_scale = 1.0 / (k_mult * q_mult * head_dim ** 0.5)
    out = torch.full(q.shape, float("nan"), device="cuda", dtype=q.dtype)
    got = foldc.compile(spec, "sm_90", kernel="gluon")(q, kq, vq, sm_scale=sm_scale, seq_lens=lens, out=out)
    ref = attention_reference(q, kq, vq, sm_scale=sm_scale, seq_lens=lens)
    err, base = rel_l2(got, ref), rel_l2(bf16_attention(q, kq, vq, sm_scale, lens), ref)
    assert not torch.isnan(out).any()
    assert err <= TOLERANCE * base, f"{spec.describe()} x({k_mult}, {q_mult}): error {err:.3e} > bf16's {base:.3e}"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("bits", [2, 4], ids=["int2", "int4"])
@pytest.mark.parametrize("kl,vl", LAYOUTS, ids=[f"K{k[0]}V{v[0]}" for k, v in LAYOUTS])
@pytest.mark.parametrize("group", [128, 32], ids=["g128", "g32"])
def test_every_layout_matches_float64(kl, vl, bits, group, dtype):
    """Channel-wise groups of 128 and of 32 tokens (one group per tile), ragged lengths."""
    if group == 32 and kl == vl == "token":
        pytest.skip("token-wise K and V have no token groups: group 32 is the g128 case again")
    spec = _spec(bits, kl=kl, vl=vl, group=group)
    attn = foldc.compile(spec, "sm_90", kernel="gluon")
    seed = bits * 1000 + LAYOUTS.index((kl, vl)) * 10 + group
    _check(run_case(attn, spec, 3, 4099, DTYPES[dtype], "cuda", seed), f"{spec.describe()} {dtype}")


@pytest.mark.parametrize("splits", [1, 7, 37])
def test_channel_wise_splits_not_on_group_boundaries(splits):
    """Splits of whole tiles that start inside a token group must use that group's scales."""
    spec = _spec(2, kl="channel", vl="channel", group=128)
    attn = foldc.compile(spec, "sm_90", kernel="gluon", splits=splits)
    r = run_with_lens(attn, spec, [5000, 3001, 4099], 5000, torch.bfloat16, "cuda", seed=splits)
    assert r.unwritten == 0 and r.error <= TOLERANCE * r.bf16_error, (splits, r.error, r.bf16_error)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("bits,heads,head_dim", [(2, (32, 8), 128), (4, (32, 8), 128), (2, (32, 2), 128),
                                                 (4, (8, 8), 64), (2, (16, 4), 256), (4, (28, 4), 128)],
                         ids=["int2", "int4", "int2-r16", "int4-d64-r1", "int2-d256", "int4-r7"])
@pytest.mark.parametrize("block_n,stages", [(32, 2), (64, 3)], ids=["bn32s2", "bn64s3"])
def test_matches_float64(bits, heads, head_dim, block_n, stages, dtype):
    spec = _spec(bits, heads, head_dim)
    if head_dim > 128:   # one (scale, zero) per 256 channels: eq. 6a refuses V's one rounding there
        spec = foldc.AttentionSpec(*heads, head_dim, A(bits, "token", 128), A(bits, "token", 128))
    attn = foldc.compile(spec, "sm_90", kernel="gluon", block_n=block_n, stages=stages)
    seed = bits * 100 + head_dim + heads[1] + block_n
    _check(run_case(attn, spec, 3, 5003, DTYPES[dtype], "cuda", seed), f"{spec.describe()} {dtype} {block_n}/{stages}")


@pytest.mark.parametrize("tokens,splits", [(65536, 2), (131072, 1)], ids=["64K-2splits", "128K-1split"])
def test_long_splits_keep_their_accuracy(tokens, splits):
    """Tens of thousands of tokens in one split: the running sums must not drift."""
    spec = _spec(2)
    attn = foldc.compile(spec, "sm_90", kernel="gluon", splits=splits)
    _check(run_case(attn, spec, 1, tokens, torch.bfloat16, "cuda", seed=tokens), f"{tokens} tokens, {splits} splits")


def test_ragged_lengths_every_sequence():
    spec = _spec(2)
    attn = foldc.compile(spec, "sm_90", kernel="gluon")
    lens = [5000, 1, 17, 31, 32, 33, 1001, 4095]
    r = run_with_lens(attn, spec, lens, 5000, torch.bfloat16, "cuda", seed=5)
    assert r.unwritten == 0
    for b, n in enumerate(lens):
        rb = rel_l2(r.out[b], r.ref[b])
        assert rb <= 4 * r.bf16_error, f"sequence {b} (length {n}): relative L2 {rb:.3e}"


def test_lse_matches_the_reference_and_merges():
    spec = _spec(4)
    attn = foldc.compile(spec, "sm_90", kernel="gluon")
    gen = torch.Generator().manual_seed(3)
    q, k, v, lens = random_inputs(spec, 2, 3000, torch.bfloat16, "cuda", gen)
    out, lse = attn(q, k, v, seq_lens=lens, return_lse=True)
    ref_out, ref_lse = foldc.compile(spec, "reference")(q, k, v, seq_lens=lens, return_lse=True)
    assert rel_l2(out, ref_out) < 5e-3
    assert (lse.double() - ref_lse.cpu().double().to(lse.device)).abs().max().item() < 2e-2


def test_cuda_graph_capture_and_replay_as_lengths_change():
    """No host sync in a call: it can be captured once and replayed as lengths grow (decode)."""
    check_graph_replay(foldc.compile(_spec(2), "sm_90", kernel="gluon"), _spec(2), seed=11)


PACKINGS = [((32, 8), "token", "token", 1), ((32, 8), "token", "token", 2), ((24, 8), "token", "token", 2),
            ((16, 8), "token", "token", 4), ((8, 8), "token", "token", 8), ((8, 8), "token", "token", 2),
            ((32, 8), "channel", "token", 2), ((32, 8), "token", "channel", 2), ((24, 8), "token", "channel", 2),
            ((16, 8), "channel", "channel", 4)]


@pytest.mark.parametrize("bits", [2, 4], ids=["int2", "int4"])
@pytest.mark.parametrize("heads,kl,vl,pack", PACKINGS,
                         ids=[f"{h[0]}/{h[1]}-K{kl[0]}V{vl[0]}-H{p}" for h, kl, vl, p in PACKINGS])
def test_packed_heads_match_float64_and_one_head_per_program(heads, kl, vl, pack, bits):
    """KV heads packed into one program's query rows (24/8: 6 real rows of 8, padding rows clamp
    to the last packed head) give the float64 answer, and the answer of one head per program
    with the same splits: each head's values only meet its own rows, each row takes its own
    head's channel scales."""
    spec = _spec(bits, heads, kl=kl, vl=vl)
    # the same tiles and splits for both (packed INT2 would default to 64-token tiles)
    packed = foldc.compile(spec, "sm_90", kernel="gluon", pack_heads=pack, splits=5, block_n=32)
    single = foldc.compile(spec, "sm_90", kernel="gluon", pack_heads=1, splits=5, block_n=32)
    assert packed.heads == pack
    r = run_case(packed, spec, 3, 3001, torch.bfloat16, "cuda", seed=pack * 10 + bits)
    _check(r, f"{spec.describe()} pack_heads={pack}")
    gen = torch.Generator().manual_seed(pack)
    q, k, v, lens = random_inputs(spec, 2, 2500, torch.bfloat16, "cuda", gen)
    assert rel_l2(packed(q, k, v, seq_lens=lens), single(q, k, v, seq_lens=lens).double()) <= 1e-5


@pytest.mark.parametrize("bits", [2, 4], ids=["int2", "int4"])
def test_without_seq_lens_every_sequence_fills_the_cache(bits):
    """No seq_lens: the kernel reads no lengths and attends over every cached token."""
    from foldc.testing import bf16_attention

    spec = _spec(bits)
    attn = foldc.compile(spec, "sm_90", kernel="gluon")
    gen = torch.Generator().manual_seed(40 + bits)
    q, k, v, _ = random_inputs(spec, 2, 3001, torch.bfloat16, "cuda", gen)
    full = torch.full((2,), 3001, device="cuda")
    ref = foldc.attention_reference(q, k, v)
    err = rel_l2(attn(q, k, v), ref)
    assert err <= TOLERANCE * rel_l2(bf16_attention(q, k, v, spec.head_dim ** -0.5, full), ref), err


GROUP_CASES = [(2, 64, 64, 2, 64), (2, 32, 32, 2, 32), (2, 32, 128, 2, 64), (2, 128, 64, 1, 64), (2, 64, 32, 1, 32),
               (4, 64, 64, 2, 32), (4, 128, 64, 1, 64)]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("bits,k_group,v_group,pack,block_n", GROUP_CASES,
                         ids=[f"int{b}-Kg{kg}-Vg{vg}-H{p}-bn{n}" for b, kg, vg, p, n in GROUP_CASES])
def test_token_wise_channel_groups_match_float64(bits, k_group, v_group, pack, block_n, dtype):
    """Several scale/zero groups per token (KIVI-style groups of 32 or 64 channels): each group's
    score and value products are scaled by that group's own parameters, with packed heads, ragged
    lengths (a 1-token sequence, a partial last tile) and splits that start mid-sequence. A group
    scaled by another group's parameters, or one group's zero term given to every channel, is off by
    tens of percent."""
    spec = foldc.AttentionSpec(32, 8, 128, A(bits, "token", k_group), A(bits, "token", v_group))
    attn = foldc.compile(spec, "sm_90", kernel="gluon", pack_heads=pack, block_n=block_n, splits=5)
    cfg = attn.launch_config(DTYPES[dtype], 4, 3001)["constexprs"]
    assert (cfg["KEY_NG"], cfg["VAL_NG"]) == (128 // k_group, 128 // v_group)
    r = run_with_lens(attn, spec, [3001, 1, 2 * block_n + 7, 1500], 3001, DTYPES[dtype], "cuda",
                      seed=bits * 100 + k_group + v_group + pack)
    _check(r, f"{spec.describe()} pack_heads={pack} block_n={block_n} {dtype}")


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("k_group,v_group", [(64, 32), (128, 64)], ids=["Kg64-Vg32", "Kg128-Vg64"])
def test_token_wise_channel_groups_with_other_scale_dtypes(scale_dtype, k_group, v_group):
    """bf16 parameters take the one-word load too (its halves are bf16); fp32 ones are loaded per group:
    both give the float64 answer."""
    spec = foldc.AttentionSpec(32, 8, 128, A(2, "token", k_group, scale_dtype), A(2, "token", v_group, scale_dtype))
    attn = foldc.compile(spec, "sm_90", kernel="gluon", splits=4)
    r = run_with_lens(attn, spec, [2049, 3, 1000], 2049, torch.bfloat16, "cuda", seed=90 + k_group + v_group)
    _check(r, f"{spec.describe()}")


@pytest.mark.parametrize("schedule", [dict(scale_ahead=True), dict(dynamic_tiles=True, splits=40)],
                         ids=["scale-ahead", "dynamic-40splits"])
def test_token_wise_channel_groups_with_other_schedules(schedule):
    """Scales a tile ahead (tuples of group parameters carried across tiles) and dynamic tiles with
    more programs than chunks give the float64 answer and the default kernel's."""
    spec = foldc.AttentionSpec(32, 8, 128, A(2, "token", 32), A(2, "token", 64))
    opts = dict(kernel="gluon", block_n=32, splits=3)
    other = foldc.compile(spec, "sm_90", **dict(opts, **schedule))
    default = foldc.compile(spec, "sm_90", **opts)
    r = run_with_lens(other, spec, [3001, 77, 2048, 1], 3001, torch.bfloat16, "cuda", seed=81)
    _check(r, f"{spec.describe()} {schedule}")
    gen = torch.Generator().manual_seed(82)
    q, k, v, lens = random_inputs(spec, 2, 2500, torch.bfloat16, "cuda", gen)
    assert rel_l2(other(q, k, v, seq_lens=lens), default(q, k, v, seq_lens=lens).double()) <= 1e-3


SCHEDULES = [dict(scale_ahead=True, stages=2), dict(scale_ahead=True, stages=4), dict(scale_ahead=False, stages=3)]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=["ahead-s2", "ahead-s4", "late-s3"])
@pytest.mark.parametrize("kl,vl", LAYOUTS, ids=[f"K{k[0]}V{v[0]}" for k, v in LAYOUTS])
@pytest.mark.parametrize("bits", [2, 4], ids=["int2", "int4"])
def test_every_schedule_matches_float64_and_the_default_schedule(kl, vl, bits, schedule):
    """Token-wise scales loaded a tile ahead (scale_ahead=True) or at each tile's start (the default),
    with 2-4 stages: the float64 answer and the default kernel's, with ragged lengths (1-tile and
    tail-only splits), group boundaries inside splits and a tail tile."""
    spec = _spec(bits, kl=kl, vl=vl, group=128)
    other = foldc.compile(spec, "sm_90", kernel="gluon", splits=3, block_n=32, **schedule)
    default = foldc.compile(spec, "sm_90", kernel="gluon", splits=3, block_n=32)
    r = run_with_lens(other, spec, [3001, 77, 2048, 40], 3001, torch.bfloat16, "cuda", seed=60 + bits)
    _check(r, f"{spec.describe()} {schedule}")
    gen = torch.Generator().manual_seed(61 + bits)
    q, k, v, lens = random_inputs(spec, 2, 2500, torch.bfloat16, "cuda", gen)
    assert rel_l2(other(q, k, v, seq_lens=lens), default(q, k, v, seq_lens=lens).double()) <= 1e-6


DYNAMIC_CASES = [(2, "token", "token", 64, 2), (4, "token", "token", 32, 2), (2, "channel", "token", 64, 2),
                 (2, "token", "channel", 32, 2), (4, "channel", "channel", 32, 2), (2, "token", "token", 32, 1)]


@pytest.mark.parametrize("bits,kl,vl,block_n,pack", DYNAMIC_CASES,
                         ids=[f"int{b}-K{k[0]}V{v[0]}-bn{n}-H{p}" for b, k, v, n, p in DYNAMIC_CASES])
@pytest.mark.parametrize("splits", [3, 40], ids=["3splits", "40splits"])
def test_dynamic_tiles_match_float64_and_the_static_split(bits, kl, vl, block_n, pack, splits):
    """Tiles drawn from a counter: every full tile exactly once (a skipped or repeated tile moves the
    answer by a percent), the partial last tile once, with lengths of 1 token, less than a tile,
    fewer chunks than programs (40 splits) and a whole cache; channel-wise groups of 128 tokens draw
    two 64-token tiles at a time. And a second call, on counters zeroed again, gives the same answer."""
    spec = _spec(bits, kl=kl, vl=vl, group=128)
    opts = dict(kernel="gluon", block_n=block_n, pack_heads=pack, splits=splits)
    dynamic = foldc.compile(spec, "sm_90", dynamic_tiles=True, **opts)
    static = foldc.compile(spec, "sm_90", dynamic_tiles=False, **opts)
    assert dynamic.launch_config(torch.bfloat16, 4, 4099)["constexprs"]["DYNAMIC"]
    assert not static.launch_config(torch.bfloat16, 4, 4099)["constexprs"]["DYNAMIC"]
    lens = [4099, 1, 17, 2 * block_n + 5]
    r = run_with_lens(dynamic, spec, lens, 4099, torch.bfloat16, "cuda", seed=70 + bits + splits)
    _check(r, f"{spec.describe()} dynamic, {splits} splits")
    for b, n in enumerate(lens):
        rb = rel_l2(r.out[b], r.ref[b])
        assert rb <= 4 * r.bf16_error, f"sequence {b} (length {n}): relative L2 {rb:.3e}"
    gen = torch.Generator().manual_seed(71 + bits)
    q, k, v, lens = random_inputs(spec, 3, 2500, torch.bfloat16, "cuda", gen)
    first = dynamic(q, k, v, seq_lens=lens).double()
    assert rel_l2(dynamic(q, k, v, seq_lens=lens), first) <= 1e-3
    assert rel_l2(static(q, k, v, seq_lens=lens), first) <= 1e-3


def test_dynamic_tiles_replay_in_a_cuda_graph():
    """The counters are zeroed inside the captured call, so every replay draws every tile again."""
    spec = _spec(2)
    check_graph_replay(foldc.compile(spec, "sm_90", kernel="gluon", dynamic_tiles=True, splits=9), spec, seed=12)


@pytest.mark.parametrize("merge_in_decode", [True, False])
def test_repeated_calls_reuse_the_compiled_kernel_only_for_the_same_specialisation(merge_in_decode):
    """Eager calls after the first go straight to the compiled kernels (FastLaunch), keyed by
    triton's own specialisation: new query values on the same buffers, a query 2 bytes off a
    16-byte boundary and a cache length that is no multiple of 16 each give the float64 answer,
    and the last two each compile and key a kernel of their own. The second call with one key binds
    its launches (`FastLaunch.bind`); the fourth launches the bound kernels with the new tensors'
    addresses alone, and the third, misaligned, falls back to the ordinary path. Merging inside the decode (the
    default for these small grids) the merge kernel is never built; told not to, it is built once."""
    spec = _spec(2)
    attn = foldc.compile(spec, "sm_90", kernel="gluon", splits=3)
    attn.merge_in_decode = merge_in_decode
    gen = torch.Generator().manual_seed(77)
    for tokens, misaligned in ((784, False), (784, False), (784, True), (784, False), (777, False)):
        q, k, v, lens = random_inputs(spec, 2, tokens, torch.bfloat16, "cuda", gen)
        if misaligned:
            flat = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)
            flat[1:] = q.flatten()
            q = flat[1:].view(q.shape)
            assert q.data_ptr() % 16
        ref = foldc.attention_reference(q, k, v, seq_lens=lens)
        err = rel_l2(attn(q, k, v, seq_lens=lens), ref)
        assert err <= 5e-3, (tokens, misaligned, err)
    decode, merge = attn._launchers()
    assert len(decode.compiled) == 3, list(decode.compiled)
    assert len(merge.compiled) == (0 if merge_in_decode else 1)
    assert len(attn._bindings.bound()) == 1


@pytest.mark.parametrize("bits, heads", [(2, (32, 8)), (4, (16, 4))])
def test_eager_calls_of_one_shape_take_the_memo_of_bound_calls(bits, heads):
    """From the third eager call of one shape (no lengths), `GluonAttention` finds the call in its memo of bound
    calls (eager.py) and launches the bound kernels with the call's own addresses: new caches, new queries, a
    given output and none, each within 5e-3 of float64; a misaligned query and a call with lengths take the whole
    path and are right too."""
    spec = _spec(bits, heads=heads)
    attn = foldc.compile(spec, "sm_90", kernel="gluon")
    gen = torch.Generator().manual_seed(bits)
    out = torch.empty(2, heads[0], 128, device="cuda", dtype=torch.bfloat16)
    for i in range(7):
        q, k, v, lens = random_inputs(spec, 2, 1000, torch.bfloat16, "cuda", gen)
        if i == 5:   # 2 bytes off a 16-byte boundary: the bound launch declines
            flat = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)
            flat[1:] = q.flatten()
            q = flat[1:].view(q.shape)
        ref = foldc.attention_reference(q, k, v)
        out.fill_(float("nan"))
        got = attn(q, k, v, out=out) if i % 2 else attn(q, k, v)
        assert rel_l2(got, ref) <= 5e-3, (i, rel_l2(got, ref))
        if i == 3:
            assert len(attn._eager) == 2, "calls with and without out are held as two entries"
        with_lens = attn(q, k, v, seq_lens=lens)
        assert rel_l2(with_lens, foldc.attention_reference(q, k, v, seq_lens=lens)) <= 5e-3


@pytest.mark.parametrize("k, v, heads, head_dim", [("token:2:128", "token:2:128", "32/8", 128),
                                                   ("token:4:32", "channel:4:64", "40/8", 128),
                                                   ("token:8:32", "token:2:32", "8/8", 96),
                                                   ("channel:2:16", "token:4:64", "64/4", 64)])
def test_eager_calls_merge_their_splits_inside_the_decode(k, v, heads, head_dim):
    """Eager calls whose grid fits a wave merge their splits inside the decode kernel (split_merge.py, one
    cooperative launch): within the bar of float64 and within 1e-5 of the merge kernel's answer on the same
    workspace, through the whole path, the bound launch and the memo of bound calls, at grids of several sizes on one
    stream (one barrier buffer), each leaving the barrier's counts at zero; under CUDA-graph capture the merge
    kernel runs instead."""
    from foldc.spec import spec_from_args

    spec = spec_from_args(k, v, heads, head_dim)
    attn = foldc.compile(spec, "sm_90", kernel="gluon")
    apart = foldc.compile(spec, "sm_90", kernel="gluon")
    apart.merge_in_decode = False
    gen = torch.Generator().manual_seed(head_dim)
    merged = 0
    for batch, tokens in ((1, 4096), (2, 1000), (1, 16384), (3, 333), (1, 4096)):
        q, kc, vc, lens = random_inputs(spec, batch, tokens, torch.bfloat16, "cuda", gen)
        launch = attn.plan_launch(q.dtype, batch, tokens, q.device, k=kc, v=vc)
        merged += attn.merges_inside(launch.options, q, launch.splits, True)
        ref = foldc.attention_reference(q, kc, vc)
        two = apart(q, kc, vc)
        for i in range(4):   # whole path, bound, memo
            got = attn(q, kc, vc)
            assert rel_l2(got, ref) <= 5e-3, (batch, tokens, i, rel_l2(got, ref))
            assert (got.float() - two.float()).abs().max().item() <= 1e-5 * two.float().abs().max().item() + 1e-6
        with_lens = attn(q, kc, vc, seq_lens=lens)
        assert rel_l2(with_lens, foldc.attention_reference(q, kc, vc, seq_lens=lens)) <= 5e-3
        torch.cuda.synchronize()
        for barrier in (b for held in attn._barriers.values() for b in held):
            assert barrier[0].item() == 0 and barrier[2:].abs().sum().item() == 0
    assert merged >= 3, "the small grids merge inside the decode"
    check_graph_replay(attn, spec, head_dim)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_prepared_runs_merge_inside_the_decode_on_each_stream(dtype):
    """A serving cache's prepared run (`GluonAttention.prepare`) of a launch whose grid fits a wave merges inside
    the decode with the barrier of the stream it is called on: calls alternating between the current stream and
    another, at several token counts, each within the bar of float64 over its tokens, every stream's barrier counts
    back at zero; told `merge_in_decode = False` on the way, the same run binds the two launches again."""
    from foldc.backends.runtime.launch import allocate_workspace
    from foldc.spec import spec_from_args

    spec = spec_from_args("token:2:128", "token:2:128", "32/8", 128)
    attn = foldc.compile(spec, "sm_90", kernel="gluon")
    gen = torch.Generator().manual_seed(11)
    tokens = 16384
    q, kc, vc, _ = random_inputs(spec, 1, tokens, DTYPES[dtype], "cuda", gen)
    launch = attn.plan_launch(q.dtype, 1, tokens, q.device, k=kc, v=vc)
    assert attn.merges_inside(launch.options, q, launch.splits, True)
    lse = torch.empty(1, spec.num_q_heads, device="cuda")
    prepared = attn.prepare(launch, kc, vc, allocate_workspace(launch, q.device), lse, 0.1)
    out = torch.empty_like(q)
    side = torch.cuda.Stream()
    merged_binds = 0
    for i, count in enumerate((tokens, 9000, tokens, 5000, 12000, tokens, 7777, tokens)):
        if i == 6:
            attn.merge_in_decode = False
        torch.cuda.synchronize()
        stream = side if i % 2 else torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            prepared(q, out, count)
        torch.cuda.synchronize()
        lens = torch.full((1,), count, dtype=torch.int32, device="cuda")
        ref = foldc.attention_reference(q, kc, vc, sm_scale=0.1, seq_lens=lens)
        assert rel_l2(out, ref) <= 5e-3, (i, count, rel_l2(out, ref))
        bound = prepared._bound
        merged_binds += bound is not None and bound[6] is None
        if i >= 6:
            assert bound is None or bound[6] is not None, "bound to merge inside after merge_in_decode = False"
    assert merged_binds >= 3, "the prepared run bound its one merging launch"
    assert len(attn._barriers) >= 2, "one barrier buffer per stream"
    for barrier in (b for held in attn._barriers.values() for b in held):
        assert barrier[0].item() == 0 and barrier[2:].abs().sum().item() == 0


def _large_zero_inputs(spec, batch, tokens, dtype, gen):
    """Values whose group zero is large against the values (a large negative outlier per token or
    channel over small values): one rounding of P x scale or q x scale cancels against the zero
    correction there (docs/derivation.md, eq. 6a)."""
    q = torch.randn(batch, spec.num_q_heads, spec.head_dim, generator=gen)
    k = torch.randn(batch, spec.num_kv_heads, tokens, spec.head_dim, generator=gen) * 0.2
    v = torch.randn(batch, spec.num_kv_heads, tokens, spec.head_dim, generator=gen) * 0.1
    for x, enc in ((k, spec.k), (v, spec.v)):
        along_tokens = enc.layout == "channel"
        shape = (batch, spec.num_kv_heads, 1, spec.head_dim) if along_tokens else (batch, spec.num_kv_heads, tokens, 1)
        idx = torch.randint(0, tokens if along_tokens else spec.head_dim, shape, generator=gen)
        x.scatter_(2 if along_tokens else 3, idx, -30.0 * torch.rand(shape, generator=gen))
    lens = torch.randint(tokens // 2, tokens + 1, (batch,), generator=gen)
    return q.cuda().to(dtype), foldc.quantize(k.cuda(), spec.k), foldc.quantize(v.cuda(), spec.v), lens.cuda()


@pytest.mark.parametrize("kl, vl", LAYOUTS)
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_error_within_2x_plain_bf16_attention_on_large_zeros(kl, vl, bits, dtype):
    """eq. 6a's bar on the data where one rounding fails plain fp16 attention's: kernel="auto" runs both
    query dtypes on the register-operand kernel, each within 2x plain bf16 attention's error (the plan's
    bar); kernel="triton" keeps fp16 queries within 2x plain fp16 attention's."""
    from foldc.reference import attention_reference
    from foldc.testing import plain_attention

    spec = _spec(bits=bits, kl=kl, vl=vl)
    attn = foldc.compile(spec, "sm_90")
    assert type(attn).__name__ == "GluonAttention"
    assert attn.plan_for(DTYPES[dtype]).bar_dtype in (None, "bf16")
    triton = foldc.compile(spec, "sm_90", kernel="triton") if dtype == "fp16" else None
    for seed in range(3):
        q, k, v, lens = _large_zero_inputs(spec, 2, 2048, DTYPES[dtype], torch.Generator().manual_seed(seed))
        ref = attention_reference(q, k, v, sm_scale=0.1, seq_lens=lens)
        err = rel_l2(attn(q, k, v, sm_scale=0.1, seq_lens=lens), ref)
        bar = rel_l2(plain_attention(q, k, v, 0.1, lens, dtype=torch.bfloat16), ref)
        assert err <= 2 * bar, f"seed {seed}: error {err:.3e} > 2 x plain bf16 attention's {bar:.3e}"
        if triton is not None:
            plain = rel_l2(plain_attention(q, k, v, 0.1, lens), ref)
            err = rel_l2(triton(q, k, v, sm_scale=0.1, seq_lens=lens), ref)
            assert err <= 2 * plain, f"seed {seed}: Triton error {err:.3e} > 2 x plain fp16 attention's {plain:.3e}"


# (V, magnitude of the values): INT8 values of 1e-3 to 1e-4 have scales among fp16's subnormals; fp32 and bf16 scales
# past 65504 (values of 1e7 at 8 bits) overflowed fp16
VALUE_MAGNITUDES = [("token:8:128", 1e-3), ("token:8:128", 3e-4), ("token:8:128", 1e-4), ("token:4:128", 1e-4),
                    ("token:8:32", 1e-4), ("token:8:128:fp32", 1e-4), ("token:8:128:fp32", 1e7),
                    ("token:8:64:bf16", 1e7), ("token:2:128", 1e-4), ("token:8:128", 1e4)]


# (fp16 queries take fp16 outputs, which hold at most 65504: values of 1e7 with bf16 queries only)
MAGNITUDE_CASES = [(v, m, d) for v, m in VALUE_MAGNITUDES for d in ("bf16", "fp16") if d == "bf16" or m < 1e5]


@pytest.mark.parametrize("v_enc, magnitude, dtype", MAGNITUDE_CASES)
@pytest.mark.parametrize("heads", ["32/8", "8/8", "64/4"])
def test_token_wise_values_of_any_magnitude_match_float64(v_enc, magnitude, dtype, heads):
    """Each tile's P x scale (the value MMA's fp16 operand) lies below 2^15 with its largest near 2^14 at any scale
    (tile_values.value_unit): within 2x plain bf16 attention's error. Before it, INT8 values of 1e-3 erred 2.1x that
    error, 3e-4 9x, 1e-4 40x (H100, docs/results/value_scale_errors_before_h100_2026-12-08.json), and scales past
    65504 made the output inf."""
    from foldc.reference import attention_reference
    from foldc.spec import spec_from_args
    from foldc.testing import plain_attention

    spec = spec_from_args("token:4:128", v_enc, heads, 128)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    b, n = 2, 2048
    q = torch.randn(b, spec.num_q_heads, 128, generator=gen).cuda().to(DTYPES[dtype])
    k = foldc.quantize(torch.randn(b, spec.num_kv_heads, n, 128, generator=gen).cuda(), spec.k)
    v = foldc.quantize((torch.randn(b, spec.num_kv_heads, n, 128, generator=gen) * magnitude).cuda(), spec.v)
    lens = torch.randint(n // 2, n + 1, (b,), generator=gen).cuda()
    attn = foldc.compile(spec, "sm_90")
    assert type(attn).__name__ == "GluonAttention"
    ref = attention_reference(q, k, v, seq_lens=lens)
    out = attn(q, k, v, seq_lens=lens)
    bar = rel_l2(plain_attention(q, k, v, 128 ** -0.5, lens, dtype=torch.bfloat16), ref)
    assert torch.isfinite(out).all() and rel_l2(out, ref) <= 2 * bar, (rel_l2(out, ref), bar)


@pytest.mark.parametrize("kl, vl", LAYOUTS)
@pytest.mark.parametrize("name", ["k", "v"])
def test_nan_in_the_cache_propagates_as_nan(kl, vl, name):
    """A NaN scale (NaN keys or values quantized on the device) reaches the output as NaN for the
    query heads of that KV head only, never as zeros or a finite number."""
    spec = _spec(kl=kl, vl=vl)
    gen = torch.Generator().manual_seed(3)
    q, k, v, lens = random_inputs(spec, 2, 1500, torch.bfloat16, "cuda", gen)
    x = {"k": k, "v": v}[name]
    x.scale[1, 3, 0, 0] = float("nan")   # batch 1, KV head 3: query heads 12-15
    out = foldc.compile(spec, "sm_90")(q, k, v, seq_lens=lens)
    assert torch.isnan(out[1, 12:16]).any()
    mask = torch.ones(2, 32, dtype=torch.bool)
    mask[1, 12:16] = False
    assert torch.isfinite(out[mask]).all()


def test_a_query_or_plain_side_that_records_gradients_gets_outputs_whose_backward_raises():
    """The kernel has no backward: the whole path (first call, lengths, lse) and the memo of bound calls return
    outputs whose backward raises by name, with the same values, rather than outputs without a grad_fn."""
    from foldc.errors import UnsupportedError

    spec = _spec()
    attn = foldc.compile(spec, "sm_90")
    gen = torch.Generator().manual_seed(31)
    q, k, v, _ = random_inputs(spec, 2, 512, torch.bfloat16, "cuda", gen)
    want = attn(q, k, v)
    qg = q.clone().requires_grad_()
    for call in (lambda: attn(qg, k, v), lambda: attn(qg, k, v, return_lse=True)[1],
                 lambda: attn(qg, k, v, seq_lens=torch.full((2,), 512, device="cuda"))):
        for _ in range(3):   # from the third call of one shape the memo's bound launches take it
            got = call()
            assert got.requires_grad
            with pytest.raises(UnsupportedError, match="has no backward"):
                got.float().sum().backward()
    assert torch.equal(attn(qg, k, v).detach(), want) and len(attn._eager) >= 1
    plain = foldc.AttentionSpec(32, 8, 128, spec.k, None)
    vg = v.dequantize().to(q.dtype).requires_grad_()
    with pytest.raises(UnsupportedError, match="has no backward"):
        foldc.compile(plain, "sm_90")(q, k, vg).float().sum().backward()
