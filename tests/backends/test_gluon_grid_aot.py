"""Ahead-of-time builds of the register-operand kernel over the layout grid, for sm_90 and sm_100 (no
GPU needed): each side at its own width (2, 4, 8 bits, or plain bf16), layout (token- or
channel-wise) and group size (32, 64, 128), query rows per KV head from 1 to 32 (row blocks past 16), head_dim 64, 128 and
256 (80, 96 and 160 padded to the next), fp16, bf16 and fp32 scales. Every build takes the launcher's default tile and KV heads per
program, and is checked against the design: mma.sync on register operands and no wgmma, the
expected number of HMMA per tile, one LOP3 per two codes for the unpack (within a few for the
rest of the loop), no register spills in the token loop, and for token-wise builds the cost model's
estimate of the whole loop within 12% of the SASS.

The builds run in one fresh subprocess, two at a time (TRITON_INTERPRET must be unset when triton
is imported).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _kernel_cases import native_env

from foldc.backends.gluon.operands import PIECE, piece_groups


# (K, V, query heads / KV heads, head_dim)
GRID = [(f"{kl}:{b}:{g}", f"{vl}:{b}:{g}", "32/8", 128) for b in (2, 4, 8) for kl, vl in
        (("token", "token"), ("channel", "channel")) for g in (32, 128)]
GRID += [("token:4:128", "token:2:128", "32/8", 128), ("token:2:128", "token:4:128", "32/8", 128),
         ("token:8:128", "token:4:128", "32/8", 128), ("token:8:128", "token:2:128", "32/8", 128),
         ("token:2:128", "token:8:128", "32/8", 128), ("token:4:64", "token:4:64", "32/8", 128),
         ("token:8:64", "token:8:32", "32/8", 128), ("token:4:32", "token:8:64", "32/8", 128),
         ("channel:4:128", "token:2:128", "32/8", 128), ("channel:8:64", "token:4:128", "32/8", 128),
         ("token:4:128", "channel:2:128", "32/8", 128), ("token:8:32", "channel:4:64", "32/8", 128),
         ("channel:2:32", "channel:8:64", "32/8", 128), ("channel:4:64", "token:4:32", "32/8", 128),
         ("token:2:128", "token:2:128", "8/8", 128), ("token:4:128", "token:4:128", "40/8", 128),
         ("token:4:128", "token:2:128", "56/8", 128), ("token:2:128", "token:2:128", "64/4", 128),
         ("token:4:128", "token:4:128", "128/4", 128), ("token:2:128", "token:2:128", "64/2", 128),
         ("channel:4:128", "token:4:128", "64/2", 128), ("token:4:128", "token:4:128", "32/8", 256),
         ("token:2:128", "token:2:128", "32/4", 256), ("channel:4:128", "token:4:128", "16/4", 256),
         ("token:4:64", "token:8:64", "32/8", 64), ("channel:8:64", "token:8:64", "16/8", 64),
         ("token:4:128:fp32", "token:2:128:bf16", "32/8", 128), ("channel:4:64:bf16", "token:4:32:fp32", "32/8", 128),
         ("token:8:128:bf16", "channel:8:128:fp32", "32/8", 128), ("token:2:64:fp32", "token:2:64:fp32", "32/8", 128),
         ("token:4:32", "token:4:32", "40/8", 128), ("token:8:64", "token:8:64", "24/2", 128),
         ("none", "token:4:128", "32/8", 128), ("token:2:128", "none", "32/8", 128),
         ("none", "channel:2:64", "32/8", 128), ("channel:8:128", "none", "16/8", 64),
         ("token:2:64", "token:2:64", "32/8", 64), ("channel:2:64", "token:2:32", "32/8", 64),
         ("token:2:64", "channel:2:32", "8/8", 64), ("token:2:64", "token:4:64", "64/4", 64),
         ("token:2:128:fp32", "token:2:128", "32/8", 128),   # K and V scale dtypes differ, scales prefetched
         ("channel:4:64", "token:4:64", "64/2", 128),         # folds for its row blocks' 16 rows (eq. 12)
         ("token:4:96", "token:4:96", "32/8", 96), ("token:2:48", "channel:2:64", "32/8", 96),   # padded to 128
         ("token:2:80", "none", "32/8", 80), ("channel:8:64", "token:4:80", "16/8", 160),
         # dequant plans (eq. 12: groups of at most twice a program's 16 rows), rebuilt per value
         ("token:2:32", "token:2:32", "64/4", 128), ("channel:2:32", "channel:4:32", "64/4", 128),
         ("token:4:32", "channel:2:32", "64/2", 128), ("channel:8:32", "token:8:32", "64/4", 64),
         ("channel:4:32", "channel:4:32", "64/4", 96), ("channel:2:16", "channel:2:16", "64/4", 128),
         ("token:2:32", "token:2:32", "64/4", 96),
         # channel-wise groups of 16 tokens: two per tile
         ("channel:2:16", "token:2:128", "32/8", 128), ("token:4:128", "channel:4:16", "32/8", 128),
         ("channel:2:16", "channel:2:16", "32/8", 128), ("channel:8:16", "token:4:32", "16/8", 64),
         # both sides channel-wise past 128 channels (the query re-read per group, 16-bit V parameters)
         ("channel:2:128", "channel:2:128", "32/8", 256), ("channel:4:64", "channel:4:64", "16/4", 256),
         # eight token-wise channel groups per token (head_dim 256 in groups of 32)
         ("token:2:32", "token:2:32", "32/8", 256), ("token:8:32", "token:2:128", "32/8", 256),
         # token-wise groups across a padded head_dim's bit fields (the operand in pieces, each piece's MMA once
         # per group it meets): three groups at head_dim 96, five and six at 160 and 192
         ("token:2:32", "token:2:32", "32/8", 96), ("token:8:48", "token:8:32", "32/8", 96),
         ("token:2:32", "token:2:32", "32/8", 160), ("token:4:32", "token:8:32", "16/8", 192),
         ("token:8:32", "token:4:96", "64/4", 96),   # a dequant plan's groups across them
         # 32-token tiles where 64 spilled: four groups per token beside a channel-wise side; head_dim 256 in four
         ("token:2:32", "channel:2:64", "32/8", 128), ("token:2:64", "token:2:64", "32/8", 256),
         # ragged row blocks (17 rows per KV head: 9 + 8; 9 at head_dim 256: 5 + 4)
         ("token:2:128", "token:2:128", "34/2", 128), ("channel:4:128", "token:2:128", "50/2", 128),
         ("token:2:128", "token:4:128", "18/2", 256),
         # channel-wise groups of 16 tokens past 128 channels (they spill: KNOWN_SPILLS)
         ("channel:2:16", "token:2:128", "32/8", 256), ("token:4:128", "channel:4:16", "32/8", 256)]
ARCHS = ("sm_90", "sm_100")
# Builds whose token loop reads or writes local memory (spilled registers), with today's count of
# those instructions as a bound: every other build must have none. Found when the check moved from the
# loop's twelve commonest opcodes to its full count (docs/perf.md, "Ahead-of-time builds and register
# spills"); each in every tile of the build.
KNOWN_SPILLS = {# two groups' query operands, parameters and products per tile past 128 channels (docs/perf.md)
                ("channel:2:16", "token:2:128", "32/8", 256, "sm_90"): (101, 101),
                ("channel:2:16", "token:2:128", "32/8", 256, "sm_100"): (65, 65),
                ("token:4:128", "channel:4:16", "32/8", 256, "sm_90"): (150, 150),
                ("token:4:128", "channel:4:16", "32/8", 256, "sm_100"): (100, 100),
                ("channel:4:128", "token:4:128", "16/4", 256, "sm_100"): (4, 4),
                # folds at the tie of 16 rows a program (eq. 12a; 1.14-1.17x the dequant plans' speed, H100)
                ("token:4:32", "channel:2:32", "64/2", 128, "sm_90"): (12, 12),
                ("token:2:32", "token:2:32", "64/4", 96, "sm_90"): (6, 6),
                ("token:2:32", "token:2:32", "64/4", 96, "sm_100"): (10, 10),
                # two packed heads with groups of 16 tokens both sides (none on sm_90; 1.39x one head's speed, H100)
                ("channel:2:16", "channel:2:16", "32/8", 128, "sm_100"): (8, 8),
                ("token:2:32", "token:2:32", "32/8", 256, "sm_100"): (22, 22),
                # five groups across head_dim 160's bit fields at 2 bits: both 256-channel operands, the query pieces
                # and five scaled P's per tile
                ("token:2:32", "token:2:32", "32/8", 160, "sm_90"): (42, 42),
                ("token:2:32", "token:2:32", "32/8", 160, "sm_100"): (16, 16)}
JOBS = [(k, v, h, d, arch) for k, v, h, d in GRID for arch in ARCHS]

SCRIPT = r"""
import json, sys
from concurrent.futures import ProcessPoolExecutor

def build(job):
    import tempfile
    from foldc.backends.gluon.aot import compile_gluon_aot
    from foldc.backends.gluon.lower import gluon_plan, lower
    from foldc.spec import spec_from_args
    k, v, heads, d, arch = job
    spec = spec_from_args(k, v, heads, d)
    r = compile_gluon_aot(spec, arch, tempfile.mkdtemp())   # the launcher's defaults: tile, heads, register cap
    cfg = lower(gluon_plan(spec))
    r["config"] = dict(key_bits=cfg.key_bits, value_bits=cfg.value_bits, rows=cfg.rows, row_blocks=cfg.row_blocks,
                       key_words=cfg.key_tile_words, value_words=cfg.value_tile_words, width=cfg.width,
                       key_tokens=cfg.key_tokens,
                       value_tokens=cfg.value_tokens, key_groups=cfg.key_groups, value_groups=cfg.value_groups,
                       key_masked=cfg.key_masked_groups, value_masked=cfg.value_masked_groups,
                       key_dequant=cfg.key_dequant, value_dequant=cfg.value_dequant)
    return r

with ProcessPoolExecutor(2) as pool:
    out = list(pool.map(build, json.loads(sys.argv[1])))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    root = tmp_path_factory.mktemp("gluon_grid_aot")
    env = native_env(root / "triton")
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(JOBS)], env=env, capture_output=True, text=True,
                          timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(zip(JOBS, json.loads(done.stdout.strip().splitlines()[-1])))


def test_the_grid_covers_every_axis():
    """At least 40 layouts, and each axis of the issue's grid appears: widths per side, mixed widths,
    both layouts per side, group sizes, query rows per KV head, head dims, scale dtypes."""
    from foldc.spec import spec_from_args

    every = [spec_from_args(k, v, h, d) for k, v, h, d in GRID]
    specs = [s for s in every if s.k is not None and s.v is not None]
    assert len(GRID) >= 40 and len(set(GRID)) == len(GRID)
    assert any(s.k is None for s in every) and any(s.v is None for s in every)   # a plain side each way
    assert {s.k.bits for s in specs} == {s.v.bits for s in specs} == {2, 4, 8}
    assert any(s.k.bits != s.v.bits for s in specs)
    assert {(s.k.layout, s.v.layout) for s in specs} == {("token", "token"), ("token", "channel"),
                                                         ("channel", "token"), ("channel", "channel")}
    assert {s.k.group_size for s in specs} >= {32, 64, 128} and {s.v.group_size for s in specs} >= {32, 64, 128}
    assert {s.q_per_kv for s in specs} >= {1, 4, 5, 7, 8, 12, 16, 32}
    assert {s.head_dim for s in every} >= {64, 80, 96, 128, 160, 256}
    assert {str(s.k.scale_dtype) for s in specs} | {str(s.v.scale_dtype) for s in specs} >= \
        {"torch.float16", "torch.bfloat16", "torch.float32"}


@pytest.mark.parametrize("job", JOBS, ids=[f"{k}-{v}-{h}-d{d}-{a}" for k, v, h, d, a in JOBS])
def test_grid_build_is_the_designed_kernel(job, reports):
    r = reports[job]
    cfg = r["config"]
    assert r["mma"]["mma.sync"] > 0 and r["mma"]["wgmma"] == 0
    assert r["registers"] is not None and r["registers"] <= 255
    loop = r["inner_loop"]["top_opcodes"]
    # no spilled register in the token loop, but for the known builds (at most their count)
    most, every_tile = KNOWN_SPILLS.get(job, (0, 0))
    assert r["inner_loop"]["local_memory"] <= most, f"register spills in the token loop: {r['inner_loop']}"
    assert r["inner_loop"]["local_memory_every_tile"] <= every_tile, f"spills in every tile: {r['inner_loop']}"
    heads, block_n, rows = r["pack_heads"], r["block_n"], cfg["rows"]
    # one HMMA per 16 x 8 x 16 block: keys [tokens, channels] x [channels, rows], values
    # [channels, tokens] x [tokens, rows], every packed head (two value products with groups of 16 tokens);
    # a padded head_dim's plain values: the MMAs
    # of output rows past head_dim, never stored, are dropped by the compiler
    value_tiles = -(-job[3] // 16) if cfg["value_bits"] == 16 else cfg["width"] // 16
    if cfg["value_tokens"] == 16 and not cfg["value_dequant"]:
        value_tiles *= 2   # channel-wise V folded in groups of half a tile: one value product per group
    key_tiles = cfg["width"] // 16
    # groups across a padded head_dim's bit fields: each piece of 32 k indices (keys) or rows (values) takes one
    # MMA per group it meets, and none where it is padding alone (operands.piece_groups); of a value piece's two
    # tiles of 16 rows, the compiler keeps a group's MMA only where the tile's rows meet the group (the select
    # takes no other row of it)
    if cfg["key_masked"]:
        key_tiles = PIECE // 16 * sum(len(piece_groups("key", i, cfg["key_bits"], cfg["width"], job[3],
                                                       cfg["key_groups"])) for i in range(cfg["width"] // PIECE))
    if cfg["value_masked"]:
        value_tiles = sum(len(piece_groups("value", i, cfg["value_bits"], cfg["width"], job[3], cfg["value_groups"],
                                           rows=16)) for i in range(cfg["width"] // 16))
    blocks = heads * (block_n // 16) * (key_tiles + value_tiles) * (rows // 8)
    if _key_query16(job, cfg):   # each key group's zero term: one MMA over head_dim (tile_groups.key_group16)
        blocks += cfg["width"] // 16 * (2 if cfg["key_tokens"] < block_n else 1)
    if cfg["value_masked"] and heads > 1:
        # each further packed head's masked values: ptxas keeps up to one more MMA per value piece and 16 tokens
        # (8-bit values in groups of 32 at head_dim 96, two heads: 88 where the count above gives 80)
        assert blocks <= loop.get("HMMA", 0) <= blocks + (heads - 1) * (block_n // 16) * (cfg["width"] // PIECE), loop
    else:
        assert loop.get("HMMA", 0) == blocks, loop
    # one LOP3 per two codes on each side: a side of W words per token unpacks 2 x fields registers
    # per word (operands.py); the rest of the loop adds a few (masks, group reloads, addressing)
    unpack = sum(heads * block_n * words * 2 * (8 // bits) // 32
                 for words, bits in ((cfg["key_words"], cfg["key_bits"]), (cfg["value_words"], cfg["value_bits"])))
    if cfg["key_masked"] or cfg["value_masked"]:   # the masks' selects: ptxas folds some unpack ANDs into them
        # (11% of them at head_dim 192, K token:4:32 / V token:8:32)
        assert 0.85 * unpack <= loop.get("LOP3", 0) <= unpack + 24 + unpack // 4, (unpack, loop)
    else:
        assert unpack <= loop.get("LOP3", 0) <= unpack + 24 + unpack // 4, (unpack, loop)


def _key_query16(job, cfg) -> bool:
    """The build folds 2-bit channel-wise keys in groups of up to 32 tokens with fp16 scales (kernel.py's KQ16)."""
    import torch

    from foldc.spec import spec_from_args

    spec = spec_from_args(*job[:4])
    return cfg["key_bits"] == 2 and 0 < cfg["key_tokens"] <= 32 and not cfg["key_dequant"] and cfg["width"] <= 128 and cfg["rows"] <= 8 and \
        spec.k.scale_dtype == torch.float16


def _in_the_fit(job) -> bool:
    """Token-wise builds of the shapes the whole-loop model was fitted on: 8 query rows per MMA (up to 8
    per KV head), head_dim <= 128 and eight or more words per token. With 16 rows and at 256 channels it
    overestimates (by 12-40%: the per-head figures were fitted with 8 rows), and four-word tokens (head_dim 64
    at 2 bits: 11% below the SASS, whose value words are read twice and shifted), and padded head_dims
    (the model counts the cache's channels, the registers hold the padded width), so those builds are held
    to the unpack count only."""
    from foldc.backends.gluon.lower import gluon_plan, lower
    from foldc.spec import spec_from_args

    k, v, heads, d, arch = job
    cfg = lower(gluon_plan(spec_from_args(k, v, heads, d)))
    return arch == "sm_90" and not (cfg.key_tokens or cfg.value_tokens or cfg.key_plain or cfg.value_plain) and \
        cfg.rows == 8 and d <= 128 and not cfg.narrow and not cfg.padded_dim


@pytest.mark.parametrize("job", [j for j in JOBS if _in_the_fit(j)], ids=lambda j: f"{j[0]}-{j[1]}-{j[2]}-d{j[3]}")
def test_token_wise_grid_builds_match_the_cost_model(job, reports):
    """The fitted whole-loop cost model (foldc/cost.py, eq. 13), now per side's width, within 12% of
    the SASS of the token-wise builds of the grid it covers (fitted to INT2 and INT4 at one width; it
    holds for mixed widths and INT8 too)."""
    r = reports[job]["inner_loop"]
    assert r["model_lane_slots_per_byte"] == pytest.approx(r["lane_slots_per_byte"], rel=0.12), r


def test_sm_100_builds_the_same_token_loop(reports):
    """B200 keeps mma.sync: the sm_100 build of every layout has the same matrix instructions and unpack
    as sm_90's, and a token loop within 15% of its length (10.5% shorter on sm_100 for channel-wise V in
    groups of 16 tokens, 13.5-14.2% beside rebuilt channel-wise keys at 16 rows). Where the launcher's default
    tile differs by target (row blocks beside channel-wise groups of 64 tokens take 64-token tiles on sm_90
    only), the matrix instructions per token must match."""
    for k, v, h, d, arch in JOBS:
        if arch != "sm_100":
            continue
        r100, r90 = reports[(k, v, h, d, "sm_100")], reports[(k, v, h, d, "sm_90")]
        b100, b90 = r100["inner_loop"], r90["inner_loop"]
        if r100["block_n"] != r90["block_n"]:
            assert b100["top_opcodes"].get("HMMA") * r90["block_n"] == \
                b90["top_opcodes"].get("HMMA") * r100["block_n"], (k, v, h, d)
            continue
        assert b100["top_opcodes"].get("HMMA") == b90["top_opcodes"].get("HMMA"), (k, v, h, d)
        assert abs(b100["instructions_per_tile"] - b90["instructions_per_tile"]) <= 0.15 * b90["instructions_per_tile"]


@pytest.mark.parametrize("job", [j for j in JOBS if "channel" in j[0] and "channel" in j[1] and j[2] == "64/4"],
                         ids=lambda j: f"{j[0]}-{j[1]}-{j[2]}-d{j[3]}-{j[4]}")
def test_dequant_group_parameters_load_once_per_lane(job, reports):
    """A channel-wise dequant plan's group (its scales and zeros, and the power of two they are rebuilt
    at; and a folded channel-wise side's) is read and computed once per lane, D/32 channels each, then moved to
    the operand's layout: not once per k index a lane holds (32 of them: 96 global loads per 32-token tile, 192 with groups of
    16 tokens, before)."""
    r = reports[job]
    assert r["config"]["key_dequant"], r["config"]   # (eq. 12a: channel-wise keys past 8 rows; values at the tie fold)
    groups_per_tile = max(1, r["block_n"] // min(int(job[0].split(":")[2]), int(job[1].split(":")[2])))
    width = r["config"]["width"]
    # per side (scales, zeros) x width / 32 channels per lane for a rebuilt side, x the 2 x width / 16 output rows a
    # lane holds for a folded channel-wise V (its per-row scales and zeros), per group in the tile
    per_group = sum(2 * (width // 32) if r["config"][f"{side}_dequant"] else 2 * (width // 8)
                    for side in ("key", "value"))
    assert r["inner_loop"]["global_loads"] <= per_group * groups_per_tile, r["inner_loop"]


@pytest.mark.parametrize("job", [j for j in JOBS if j[3] == 96 and j[0].startswith("token:") and
                                 j[0].endswith(":32")], ids=lambda j: f"{j[0]}-{j[1]}-{j[2]}-d{j[3]}-{j[4]}")
def test_groups_across_padded_fields_select_per_token_not_per_value(job, reports):
    """Token-wise groups of 32 channels across head_dim 96's bit fields: each lane's channels of one
    field lie in one group (the boundaries fall on multiples of eight channels), so a group's
    parameters are selected per token and field, and the fold masks the query once before the loop
    instead of the keys per tile. Before: 456 selects per 32-token tile (dequant) and 160 (fold)."""
    r = reports[job]
    assert r["config"]["key_masked"] or r["config"]["key_dequant"], r["config"]
    loop = r["inner_loop"]["top_opcodes"]
    values_per_lane = 2 * r["block_n"] * r["config"]["width"] // 32
    selects = loop.get("FSEL", 0) + loop.get("SEL", 0)
    assert selects <= values_per_lane // 2, loop


def test_the_known_spills_are_the_builds_that_spill(reports):
    """KNOWN_SPILLS lists exactly the builds of the grid whose token loop touches local memory: one that
    stops spilling leaves the list (so the list never hides a new spill behind an old entry)."""
    spilling = {job for job, r in reports.items() if r["inner_loop"]["local_memory"]}
    assert spilling == set(KNOWN_SPILLS), (spilling - set(KNOWN_SPILLS), set(KNOWN_SPILLS) - spilling)
