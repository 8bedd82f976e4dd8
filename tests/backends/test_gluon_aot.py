"""Ahead-of-time builds of the register-operand kernel (no GPU needed), checked against what the
design says the compiler must emit: mma.sync on register operands, the unpack's LOP3 count (one
per two codes), one HMMA per 16x8x16 block, and no spills.

Builds run in one fresh subprocess (TRITON_INTERPRET must be unset when triton is imported).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _kernel_cases import native_env

# (bits, heads, kv_heads, head_dim, arch, block_n, stages, K layout, V layout, pack_heads: None = auto,
#  page size: 0 = contiguous cache)
BUILDS = [(2, 32, 8, 128, "sm_90", 32, 2, "token", "token", None, 0),
          (4, 32, 8, 128, "sm_90", 32, 2, "token", "token", None, 0),
          (2, 32, 8, 128, "sm_90", 32, 2, "token", "token", 1, 0), (4, 32, 8, 128, "sm_90", 32, 2, "token", "token", 1, 0),
          (2, 16, 8, 128, "sm_90", 32, 2, "token", "token", None, 0),
          (2, 32, 8, 128, "sm_90", 64, 3, "token", "token", None, 0),
          (2, 32, 2, 128, "sm_90", 32, 2, "token", "token", None, 0),
          (2, 32, 8, 128, "sm_100", 32, 2, "token", "token", None, 0),
          (2, 32, 8, 128, "sm_90", 32, 2, "channel", "token", None, 0),
          (2, 32, 8, 128, "sm_90", 32, 2, "token", "channel", None, 0),
          (4, 32, 8, 128, "sm_90", 32, 2, "channel", "channel", None, 0),
          (2, 32, 8, 128, "sm_90", 64, 2, "token", "token", None, 128),
          (2, 32, 8, 128, "sm_90", 32, 2, "channel", "token", None, 128)]
# token-wise channel groups ("token32": groups of 32 channels; several per token), spill-free choices
GROUP_BUILDS = [(2, 32, 8, 128, "sm_90", 32, 2, "token64", "token64", None, 0),
                (2, 32, 8, 128, "sm_90", 32, 2, "token32", "token32", None, 0),
                (2, 32, 8, 128, "sm_90", 64, 2, "token32", "token32", None, 0),
                (4, 32, 8, 128, "sm_90", 32, 2, "token64", "token64", None, 0),
                (2, 32, 8, 128, "sm_90", 64, 2, "token64", "token64", 1, 0)]
# channel-wise V in groups of one 32-token tile beside K channel-wise in groups of 128 or token-wise
MIXED_GROUP_BUILDS = [(2, 32, 8, 128, "sm_90", 32, 2, "channel", "channel32", None, 0),
                      (2, 32, 8, 128, "sm_90", 32, 2, "token", "channel32", None, 0)]
# the same builds with dynamic tiles (GluonAttention's dynamic_tiles): the static build they compare with
DYNAMIC_BUILDS = {(2, 32, 8, 128, "sm_90", 64, 2, "token", "token", None, 0, True):
                      (2, 32, 8, 128, "sm_90", 64, 2, "token", "token", None, 0),
                  (2, 32, 8, 128, "sm_90", 64, 2, "token", "token", None, 128, True):
                      (2, 32, 8, 128, "sm_90", 64, 2, "token", "token", None, 128)}

# the builds that merge their splits themselves (an eager call's cooperative launch, split_merge.py): the build each
# compares with
MERGED_BUILDS = {(2, 32, 8, 128, "sm_90", 64, 2, "token", "token", None, 0, "merge"):
                     (2, 32, 8, 128, "sm_90", 64, 2, "token", "token", None, 0),
                 (2, 32, 8, 128, "sm_100", 32, 2, "token", "token", None, 0, "merge"):
                     (2, 32, 8, 128, "sm_100", 32, 2, "token", "token", None, 0),
                 (2, 32, 8, 128, "sm_90", 32, 2, "channel", "token", None, 0, "merge"):
                     (2, 32, 8, 128, "sm_90", 32, 2, "channel", "token", None, 0)}

SCRIPT = r"""
import json, sys
import foldc
from foldc.backends.gluon.aot import compile_gluon_aot
jobs, root = json.loads(sys.argv[1]), sys.argv[2]
out = []
def enc(bits, layout, d):   # "token32": token-wise, groups of 32 channels; else one group of d
    name = layout.rstrip("0123456789")
    return foldc.Affine(bits, name, int(layout[len(name):] or d))
for bits, h, kv, d, arch, bn, st, kl, vl, ph, page, *flags in jobs:   # flags: [True] dynamic tiles, ["merge"]
    spec = foldc.AttentionSpec(h, kv, d, enc(bits, kl, d), enc(bits, vl, d))
    out.append(compile_gluon_aot(spec, arch, f"{root}/{bits}-{h}-{kv}-{arch}-{bn}-{st}-{kl}-{vl}-{ph}-{page}-{flags}",
                                 block_n=bn, stages=st, pack_heads=ph, page_size=page, dynamic=True in flags,
                                 merge="merge" in flags))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    root = tmp_path_factory.mktemp("gluon_aot")
    env = native_env(root / "triton")
    jobs = BUILDS + GROUP_BUILDS + MIXED_GROUP_BUILDS + list(DYNAMIC_BUILDS) + list(MERGED_BUILDS)
    jobs += [b for b in DYNAMIC_BUILDS.values() if b not in BUILDS]
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(jobs), str(root)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(zip(map(tuple, jobs), json.loads(done.stdout.strip().splitlines()[-1])))


@pytest.mark.parametrize("build", BUILDS, ids=[f"int{b[0]}-{b[1]}/{b[2]}-{b[4]}-bn{b[5]}-K{b[7][0]}V{b[8][0]}-H{b[9]}-P{b[10]}"
                                               for b in BUILDS])
def test_build_emits_register_operand_mma_and_the_designed_unpack(build, reports):
    bits, heads, kv, head_dim, arch, block_n, stages, kl, vl, pack, _ = build
    r = reports[build]
    packed = r["pack_heads"]
    assert packed == (pack or min(8 // (heads // kv), kv) if heads // kv <= 8 else 1)
    assert r["mma"]["mma.sync"] > 0 and r["mma"]["wgmma"] == 0
    assert r["registers"] is not None and r["registers"] <= 255
    loop = r["inner_loop"]["top_opcodes"]
    assert r["inner_loop"]["local_memory"] == 0, f"register spills in the token loop: {r['inner_loop']}"
    words = packed * block_n * head_dim * bits // 32   # 32-bit code words per tile, per operand, all heads
    fields = 8 // bits
    # one LOP3 per two codes: K and V each unpack `words` words into 2*fields registers (channel-wise
    # groups add a few LOP3 of their once-per-group reload, which sits inside the loop)
    unpack = 2 * words * 2 * fields // 32
    rows = 8 if heads // kv <= 8 else 16
    # two packed heads: each head's P operand (block_n x rows halves, two per register) masked to that
    # head's columns by one AND per register (kernel.py's _and_p; more heads select per half instead)
    mask = packed * block_n * rows // 64 if packed == 2 else 0
    assert unpack + mask <= loop.get("LOP3", 0) <= unpack + mask + (16 if kl == vl == "token" else 32), loop
    hmma = packed * 2 * (block_n // 16) * (head_dim // 16) * (rows // 8)
    assert loop.get("HMMA", 0) == hmma, loop


@pytest.mark.parametrize("build", [b for b in BUILDS if b[4] == "sm_90"],
                         ids=lambda b: f"int{b[0]}-{b[1]}/{b[2]}-bn{b[5]}-K{b[7][0]}V{b[8][0]}-P{b[10]}")
def test_once_per_group_work_is_counted_apart_from_every_tile(build, reports):
    """Token-wise builds do the same work every tile; a channel-wise side reloads its group scales
    behind a branch, and the per-tile figure counts that block block_n/group times (group: 128 here)."""
    r = reports[build]["inner_loop"]
    block_n, channel_wise = build[5], "channel" in build[7:9]
    if not channel_wise:
        assert r["once_per_group"] == 0 and r["instructions_per_tile"] == r["instructions_per_warp"]
    else:
        # the group block holds the scale loads of the group: at least one per channel of a lane
        assert r["once_per_group"] >= 32, r
        every_tile = r["instructions_per_warp"] - r["once_per_group"]
        assert r["instructions_per_tile"] == pytest.approx(every_tile + r["once_per_group"] * block_n / 128)


@pytest.mark.parametrize("build", MIXED_GROUP_BUILDS, ids=lambda b: f"K{b[7]}-V{b[8]}")
def test_groups_of_one_tile_reload_every_tile_and_only_longer_groups_count_apart(build, reports):
    """A side whose group is one tile reloads at every tile with no branch (n0 % 32 is always 0), so the
    once-per-group block is K's alone, 128 tokens apart: counted block_n/128 times a tile, not block_n/32."""
    r = reports[build]["inner_loop"]
    every_tile = r["instructions_per_warp"] - r["once_per_group"]
    if build[7] == "token":
        assert r["once_per_group"] == 0 and r["instructions_per_tile"] == r["instructions_per_warp"]
    else:
        assert r["once_per_group"] >= 32, r
        assert r["instructions_per_tile"] == pytest.approx(every_tile + r["once_per_group"] * 32 / 128)


@pytest.mark.parametrize("build", [b for b in BUILDS if b[4] == "sm_90" and b[7] == b[8] == "token" and b[2] == 8
                                   and b[10] == 0],
                         ids=lambda b: f"int{b[0]}-{b[1]}/{b[2]}-bn{b[5]}-H{b[9]}-P{b[10]}")
def test_sass_matches_the_token_loop_cost_model(build, reports):
    """foldc.cost's whole-loop figure (construction, per-head and shared per-token work, per-tile
    work; eq. 13) within 5% of the SASS of contiguous-cache builds (the fit is within 3%; a paged
    build adds its page lookups, test_paged_reads_cost_little_in_the_token_loop)."""
    r = reports[build]["inner_loop"]
    assert r["model_lane_slots_per_byte"] == pytest.approx(r["lane_slots_per_byte"], rel=0.05), r


def test_foldc_compile_builds_the_register_operand_kernel(tmp_path):
    """`foldc compile --target sm_90` takes the register-operand kernel where it lowers the plan."""
    env = native_env(tmp_path / "triton")
    args = [sys.executable, "-m", "foldc.cli", "compile", "--k", "channel:4:64", "--v", "token:4:128", "--heads",
            "32/8", "--head-dim", "128", "--target", "sm_90", "--out", str(tmp_path / "out")]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "register-operand kernel" in done.stdout and (tmp_path / "out" / "foldc_decode_gluon.sm_90.cubin").exists()
    # the plan printed and proved is the one the kernel runs: no code bias (the codes enter as fp16 subnormals)
    assert "code bias (eq. 7)          | none" in done.stdout and "folded into the zero" not in done.stdout
    refused = subprocess.run(args[:5] + ["token:4:16", "--v", "token:4:16"] + args[8:] + ["--kernel", "gluon"],
                             env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "token-wise groups of 16 channels" in refused.stderr
    blackwell = subprocess.run(args[:5] + ["token:4:128", "--v", "token:2:128"] + args[8:13] + ["sm_100", "--out",
                               str(tmp_path / "b200"), "--kernel", "gluon"], env=env, capture_output=True, text=True,
                               timeout=300)
    assert blackwell.returncode == 0, blackwell.stderr[-2000:]
    assert (tmp_path / "b200" / "foldc_decode_gluon.sm_100.cubin").exists()


def test_paged_reads_cost_little_in_the_token_loop(reports):
    """The paged build adds the page lookup and the rebased bases per tile, nothing per code: the
    same unpack and matrix instructions and at most 6% more instructions than the contiguous build
    (5.2% since the first tiles' copies start before the query is read: 1399 against 1330)."""
    paged = reports[(2, 32, 8, 128, "sm_90", 64, 2, "token", "token", None, 128)]["inner_loop"]
    flat = reports[(2, 32, 8, 128, "sm_90", 64, 3, "token", "token", None, 0)]["inner_loop"]
    assert paged["top_opcodes"]["HMMA"] == flat["top_opcodes"]["HMMA"], (paged, flat)
    # the unpack's LOP3s are the same; address arithmetic may add or fold a few
    assert abs(paged["top_opcodes"]["LOP3"] - flat["top_opcodes"]["LOP3"]) <= 8, (paged, flat)
    assert paged["instructions_per_warp"] <= 1.06 * flat["instructions_per_warp"], (paged, flat)


@pytest.mark.parametrize("build", [b for b in BUILDS if b[7] == b[8] == "token" and b[4] == "sm_90"],
                         ids=lambda b: f"int{b[0]}-{b[1]}/{b[2]}-bn{b[5]}-H{b[9]}-P{b[10]}")
def test_token_wise_scales_load_at_offsets_from_one_base_each(build, reports):
    """Each lane loads its tokens' scale and zero of K and V (BN / 8 tokens, four parameters) at
    immediate offsets from one base register per parameter: a 64-bit address per load kept warps
    waiting on the address registers (Nsight Compute, docs/perf.md)."""
    loop = reports[build]["inner_loop"]
    block_n, paged = build[5], build[10] > 0
    lookups = 2 if paged else 0      # a paged build also reads the page of this tile and of the tile copied ahead
    assert loop["global_loads"] == 4 * block_n // 8 + lookups, loop
    assert loop["global_load_bases"] <= 4 + lookups, loop


@pytest.mark.parametrize("build", [b for b in BUILDS if b[4] == "sm_90"],
                         ids=lambda b: f"int{b[0]}-{b[1]}/{b[2]}-bn{b[5]}-K{b[7][0]}V{b[8][0]}-H{b[9]}-P{b[10]}")
def test_int2_prefetches_the_next_tiles_scales_into_l2(build, reports):
    """At INT2 with scales loaded at each tile's start (token-wise K and V), the token loop sends
    the next tile's scale rows to L2 with one prefetch; INT4 (where its registers cost resident
    programs), the layouts that load scales a tile ahead and the paged builds (where the per-tile page
    rebases the four pointers) do not (launch_defaults.default_prefetch, kernel.py)."""
    bits, kl, vl, page = build[0], build[7], build[8], build[10]
    want = 1 if bits == 2 and kl == vl == "token" and page == 0 else 0
    assert reports[build]["inner_loop"]["l2_prefetches"] == want, reports[build]["inner_loop"]


@pytest.mark.parametrize("build", list(DYNAMIC_BUILDS), ids=lambda b: f"int{b[0]}-bn{b[5]}-P{b[10]}")
def test_dynamic_tiles_draw_once_per_tile_and_keep_the_registers(build, reports):
    """With dynamic tiles the token loop draws the next tile with one atomic and does the static
    loop's work otherwise: no spills, the static build's registers (168 at INT2 with two heads: 12
    programs per SM) and no more instructions per tile than it plus a dozen (the draw's broadcast
    through shared memory), fewer where the static loop's clamped re-copy of the last tile goes."""
    dyn, ref = reports[build], reports[DYNAMIC_BUILDS[build]]
    loop = dyn["inner_loop"]
    assert dyn["dynamic"] and not ref["dynamic"]
    assert loop["atomics"] == 1 and ref["inner_loop"]["atomics"] == 0, loop
    assert loop["local_memory"] == 0, loop
    assert dyn["registers"] <= ref["registers"], (dyn["registers"], ref["registers"])
    assert loop["instructions_per_tile"] <= ref["inner_loop"]["instructions_per_tile"] + 12, (loop, ref["inner_loop"])
    assert loop["top_opcodes"]["HMMA"] == ref["inner_loop"]["top_opcodes"]["HMMA"]


@pytest.mark.parametrize("build", list(MERGED_BUILDS), ids=lambda b: f"{b[4]}-K{b[7][0]}V{b[8][0]}-bn{b[5]}")
def test_a_build_that_merges_its_splits_keeps_the_token_loop(build, reports):
    """The merge after a split's end (a grid barrier, then each program's share of the merge) leaves the token loop
    as it was: the same register units or fewer (the residency its cooperative launch needs), no spills in the loop, its
    instructions within 2% of the plain build's (ptxas schedules it anew) and no atomic in it (the barrier's are after the loop)."""
    merged, ref = reports[build], reports[MERGED_BUILDS[build]]
    loop, ref_loop = merged["inner_loop"], ref["inner_loop"]
    # registers are allocated in units of 8 a thread: the same units, the same programs per SM
    assert -(-merged["registers"] // 8) <= -(-ref["registers"] // 8), (merged["registers"], ref["registers"])
    assert loop["local_memory"] == 0 and loop["atomics"] == 0, loop
    assert abs(loop["instructions_per_tile"] - ref_loop["instructions_per_tile"]) <= \
        0.02 * ref_loop["instructions_per_tile"], (loop, ref_loop)
    assert loop["top_opcodes"]["HMMA"] == ref_loop["top_opcodes"]["HMMA"]


@pytest.mark.parametrize("build", GROUP_BUILDS, ids=lambda b: f"int{b[0]}-K{b[7]}-V{b[8]}-bn{b[5]}-H{b[9]}")
def test_channel_groups_split_the_same_matrix_work(build, reports):
    """Several channel groups per token cut each tile's score and value products into one MMA per
    group over the group's contiguous K (or M) range: the same HMMA count and the same unpack as one
    group per token, no spills in the token loop, one load per token for all groups of a parameter,
    no L2 prefetch, and the cost model's group terms within 5% of the SASS."""
    bits, heads, kv, head_dim, arch, block_n, _, kl, vl, pack, _ = build
    r = reports[build]
    loop = r["inner_loop"]
    top = loop["top_opcodes"]
    packed, rows = r["pack_heads"], 8
    assert loop["local_memory"] == 0, f"register spills in the token loop: {loop}"
    assert top["HMMA"] == packed * 2 * (block_n // 16) * (head_dim // 16) * (rows // 8), top
    words = packed * block_n * head_dim * bits // 32
    unpack = 2 * words * 2 * (8 // bits) // 32
    groups = {side: head_dim // int(layout[len("token"):]) for side, layout in (("k", kl), ("v", vl))}
    # two packed heads: each group's P masked to each head's rows, one AND per register
    mask = groups["v"] * packed * block_n * rows // 64 if packed == 2 else 0
    assert unpack + mask <= top["LOP3"] <= unpack + mask + 16, top
    # a token's groups of one parameter arrive in one 32- or 64-bit load (16-bit scales): four loads
    # per token of a lane, as with one group
    assert loop["global_loads"] == 4 * block_n // 8, loop
    assert loop["l2_prefetches"] == 0, loop
    assert loop["model_lane_slots_per_byte"] == pytest.approx(loop["lane_slots_per_byte"], rel=0.05), loop


PLAIN_SCRIPT = r"""
import json, sys
import foldc
from foldc.backends.gluon.aot import compile_gluon_aot
root, out = sys.argv[1], []
enc = foldc.Affine(2, "token", 128)
for name, k, v in (("plain-v", enc, None), ("plain-k", None, enc)):
    for arch in ("sm_90", "sm_100"):
        for dtype in ("bf16", "fp16"):
            spec = foldc.AttentionSpec(32, 8, 128, k, v)
            r = compile_gluon_aot(spec, arch, f"{root}/{name}-{arch}-{dtype}", dtype=dtype)
            out.append(dict(name=name, arch=arch, dtype=dtype, registers=r["registers"], mma=r["mma"],
                            loop=r["inner_loop"]))
print(json.dumps(out))
"""


def test_a_plain_side_builds_in_the_queries_dtype(tmp_path):
    """fp16 queries read a plain side as fp16 words (kernel.py's PDT, the query's element type): each build
    of both dtypes, sm_90 and sm_100, keeps mma.sync on register operands, no spills in the token loop, and
    the bf16 build's register count and HMMA count."""
    env = native_env(tmp_path / "triton")
    done = subprocess.run([sys.executable, "-c", PLAIN_SCRIPT, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(rows) == 8
    by = {(r["name"], r["arch"], r["dtype"]): r for r in rows}
    for r in rows:
        assert r["mma"]["mma.sync"] > 0 and r["loop"]["local_memory"] == 0, r
        twin = by[(r["name"], r["arch"], "bf16")]
        assert r["registers"] == twin["registers"], (r, twin)
        assert r["loop"]["top_opcodes"].get("HMMA") == twin["loop"]["top_opcodes"].get("HMMA"), (r, twin)
