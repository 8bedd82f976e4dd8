"""The warpgroup template of the register-operand kernel (warpgroup.py, warpgroup_launch.py): which plans
and calls take it (CPU), its ahead-of-time sm_90 build against the design (CPU, a fresh subprocess:
TRITON_INTERPRET must be unset when triton is imported), and its answer against float64 (sm_90 GPU)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from _kernel_cases import LaunchRecorder, check_graph_replay, native_env, run_with_lens

import foldc
from foldc.backends.gluon.launch import GluonAttention
from foldc.spec import spec_from_args
from foldc.testing import random_inputs, rel_l2, run_case

GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
TOLERANCE = 1.10   # as the other register-operand GPU tests: at most 1.10x plain bf16 attention's error


@pytest.mark.parametrize("k,v,heads,target,takes", [
    ("token:2:128", "token:2:128", "128/4", "sm_90", True),
    ("token:2:128", "token:2:128", "32/1", "sm_90", True),
    ("token:2:128", "token:2:128", "128/4", "sm_100", False),     # B200: no wgmma, the one-warp program
    ("token:2:128", "token:2:128", "64/4", "sm_90", False),      # 16 rows: the one-warp program
    ("token:2:128", "token:2:128", "34/2", "sm_90", True),       # 17..31 rows: 32, the rest padding
    ("token:2:128", "token:2:128", "50/2", "sm_90", True),
    ("token:2:128", "token:2:128", "62/2", "sm_90", True),
    ("token:2:128", "token:2:128", "66/2", "sm_90", False),      # 33 rows: the one-warp program's row blocks
    ("token:4:128", "token:4:128", "128/4", "sm_90", False),
    ("token:2:128", "token:4:128", "128/4", "sm_90", False),
    ("channel:2:128", "token:2:128", "128/4", "sm_90", False),
    ("token:2:128", "channel:2:128", "128/4", "sm_90", False),
    ("token:2:64", "token:2:64", "128/4", "sm_90", False),
    ("token:2:128:bf16", "token:2:128", "128/4", "sm_90", False),
    ("token:2:128", "token:2:128:fp32", "128/4", "sm_90", False),
    ("none", "token:2:128", "128/4", "sm_90", False),
])
def test_the_template_takes_exactly_its_plans(k, v, heads, target, takes):
    attn = GluonAttention(spec_from_args(k, v, heads, 128), target=target)
    assert (attn.warpgroup is not None) == takes


def test_eager_launches_are_noted_then_bound_then_launched_by_address(monkeypatch):
    """`WarpgroupLaunch.run` on stand-in kernels (CPU tensors): the first launch of one launch's integers goes
    the ordinary way and is noted, the second binds the template and the merge, later ones hand them the
    call's addresses (the template's 11 tensors, the merge's five); a declined merge alone goes the ordinary
    way; another softmax scale is another launch."""
    import foldc.backends.gluon.warpgroup_launch as wl
    from foldc.backends.runtime.launch import allocate_workspace

    spec = spec_from_args("token:2:128", "token:2:128", "64/2", 128)
    launcher = wl.WarpgroupLaunch(spec)
    launcher._kernel = kernel = LaunchRecorder()
    merge = LaunchRecorder()
    ordinary_merges = []
    monkeypatch.setattr("foldc.backends.runtime.merge.launch_merge", lambda *a, **kw: ordinary_merges.append(a))
    monkeypatch.setattr(wl, "num_sms", lambda device: 132)
    gen = torch.Generator().manual_seed(2)
    q, k, v, _ = random_inputs(spec, 2, 256, torch.float16, "cpu", gen)
    launch = launcher.plan_launch(torch.bfloat16, 2, 256, torch.device("cpu"))
    ws = allocate_workspace(launch, "cpu")
    out, lse = torch.empty(2, 64, 128, dtype=q.dtype), torch.empty(2, 64)
    for _ in range(4):
        q.normal_(generator=gen)
        launcher.run(launch, q, k, v, None, 0.1, out, lse, ws, merge)
    assert (len(kernel.launches), len(merge.launches), kernel.binds, merge.binds) == (2, 2, 1, 1)
    (bound,), (bound_merge,) = kernel.bound, merge.bound
    want = (q.data_ptr(), k.codes.data_ptr(), k.scale.data_ptr(), k.zero.data_ptr(), v.codes.data_ptr(),
            v.scale.data_ptr(), v.zero.data_ptr(), q.data_ptr(), *(t.data_ptr() for t in ws))
    assert bound.calls == [want] * 2
    assert bound.dynamic == (19,) and bound.values == [(256,)] * 2   # the token count, given per call
    assert bound_merge.calls == [(*(t.data_ptr() for t in ws), out.data_ptr(), lse.data_ptr())] * 2
    bound_merge.ok = False
    launcher.run(launch, q, k, v, None, 0.1, out, lse, ws, merge)
    assert (len(kernel.launches), len(ordinary_merges), len(bound.calls)) == (2, 1, 3)
    launcher.run(launch, q, k, v, None, 0.2, out, lse, ws, merge)
    assert (len(kernel.launches), kernel.binds) == (3, 1)


@pytest.mark.parametrize("heads,rows", [("34/2", 17), ("50/2", 25), ("62/2", 31), ("64/2", 32)])
def test_fewer_rows_than_the_template_run_as_padding_and_merge_only_the_real_ones(monkeypatch, heads, rows):
    """17..31 query rows per KV head: the template's 32 rows (the workspace's), the kernel told the real count
    (QH, where fewer), and the merge writing only the real rows to their query heads (grid (batch, KV heads,
    rows x channel blocks); on CPU one block of all channels)."""
    import foldc.backends.gluon.warpgroup_launch as wl
    from foldc.backends.runtime.launch import allocate_workspace

    spec = spec_from_args("token:2:128", "token:2:128", heads, 128)
    launcher = wl.WarpgroupLaunch(spec)
    assert (launcher.rows, launcher.head_rows) == (32, rows)
    assert launcher._keywords(False).get("QH", 32) == rows and launcher._keywords(False)["ROWS"] == 32
    launcher._kernel = LaunchRecorder(bindable=False)
    merge = LaunchRecorder(bindable=False)
    monkeypatch.setattr(wl, "num_sms", lambda device: 132)
    gen = torch.Generator().manual_seed(rows)
    q, k, v, _ = random_inputs(spec, 2, 256, torch.float16, "cpu", gen)
    launch = launcher.plan_launch(torch.bfloat16, 2, 256, torch.device("cpu"))
    ws = allocate_workspace(launch, "cpu")
    assert ws[0].shape[-1] == 32   # rows per workspace head
    out, lse = torch.empty(2, 2 * rows, 128, dtype=q.dtype), torch.empty(2, 2 * rows)
    launcher.run(launch, q, k, v, None, 0.1, out, lse, ws, merge)
    (grid, args), = merge.launches
    assert grid == (2, 2, rows)


def test_explicit_options_keep_the_one_warp_program():
    spec = spec_from_args("token:2:128", "token:2:128", "128/4", 128)
    assert GluonAttention(spec).warpgroup is not None
    for options in ({"block_n": 32}, {"stages": 3}, {"splits": 4}, {"maxnreg": 200}, {"dynamic_tiles": True}):
        assert GluonAttention(spec, **options).warpgroup is None, options


SCRIPT = r"""
import json, sys, tempfile
from foldc.backends.gluon.aot import compile_warpgroup_aot
print(json.dumps(compile_warpgroup_aot(tempfile.mkdtemp())))
"""


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    root = tmp_path_factory.mktemp("warpgroup_aot")
    env = native_env(root / "triton")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_aot_build_is_the_designed_kernel(build):
    """wgmma only; per 128-token tile 16 HGMMA for the scores (two M of 64, eight K steps of 16 channels)
    and 16 for the values (two M of 64 channels, eight K steps of 16 tokens); one LOP3 per two codes
    (128 tokens x 2 x 128 codes over 128 threads, two per LOP3: 128), no spills, two programs per SM."""
    loop = build["inner_loop"]["top_opcodes"]
    assert build["mma"]["wgmma"] > 0 and build["mma"]["mma.sync"] == 0
    assert loop.get("HGMMA") == 32 and "HMMA" not in loop, loop
    assert 128 <= loop.get("LOP3", 0) <= 128 + 16, loop
    assert build["inner_loop"]["local_memory"] == 0, build["inner_loop"]
    assert build["registers"] <= 255 and 65536 // (build["registers"] * 128) >= 2


needs_gpu = pytest.mark.skipif(not GPU, reason="needs an sm_90 GPU")


@pytest.mark.parametrize("head_rows", [17, 25])
def test_aot_build_of_fewer_rows_keeps_the_design(head_rows, tmp_path):
    """17..31 rows: the same wgmma loop (32 HGMMA a tile, nothing spilled, two programs an SM), the padding
    rows' query read masked."""
    script = ("import json, tempfile\nfrom foldc.backends.gluon.aot import compile_warpgroup_aot\n"
              f"print(json.dumps(compile_warpgroup_aot(tempfile.mkdtemp(), head_rows={head_rows})))")
    done = subprocess.run([sys.executable, "-c", script], env=native_env(tmp_path / "triton"), capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["head_rows"] == head_rows and r["rows"] == 32
    assert r["inner_loop"]["top_opcodes"].get("HGMMA") == 32 and r["inner_loop"]["local_memory"] == 0
    assert 65536 // (r["registers"] * 128) >= 2


@needs_gpu
@pytest.mark.parametrize("heads", ["128/4", "32/1", "34/2", "50/2", "62/2"])
def test_matches_float64_with_ragged_lengths(heads):
    """Fresh random inputs, a 1-token sequence, partial last tiles, splits that end mid-tile; out= poisoned."""
    spec = spec_from_args("token:2:128", "token:2:128", heads, 128)
    attn = foldc.compile(spec, "sm_90")
    assert attn.warpgroup is not None
    r = run_with_lens(attn, spec, [3001, 1, 1500, 2047], 3008, torch.bfloat16, "cuda", seed=sum(map(ord, heads)))
    assert r.unwritten == 0
    assert r.error <= TOLERANCE * r.bf16_error, (r.error, r.bf16_error)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("batch,tokens", [(1, 65536), (3, 5000)])
def test_long_and_short_splits_match_float64(batch, tokens, dtype):
    """bf16 and fp16 queries, both within the bf16 bar (the template reads q as fp32 either way)."""
    spec = spec_from_args("token:2:128", "token:2:128", "64/2", 128)
    attn = foldc.compile(spec, "sm_90")
    assert attn.warpgroup is not None
    r = run_case(attn, spec, batch, tokens, dtype, "cuda", seed=tokens + batch)
    assert r.unwritten == 0 and r.error <= TOLERANCE * r.bf16_error, (r.error, r.bf16_error)


@needs_gpu
def test_agrees_with_the_one_warp_program_and_replays_in_a_graph():
    spec = spec_from_args("token:2:128", "token:2:128", "128/4", 128)
    wide = foldc.compile(spec, "sm_90", kernel="gluon")
    narrow = foldc.compile(spec, "sm_90", kernel="gluon")
    narrow.warpgroup = None
    gen = torch.Generator().manual_seed(21)
    q, k, v, lens = random_inputs(spec, 2, 4096, torch.bfloat16, "cuda", gen)
    a, lse_a = wide(q, k, v, seq_lens=lens, return_lse=True)
    b, lse_b = narrow(q, k, v, seq_lens=lens, return_lse=True)
    assert rel_l2(a, b) < 5e-3 and (lse_a - lse_b).abs().max().item() < 1e-3
    check_graph_replay(wide, spec, seed=12)


def test_the_template_runs_its_own_checked_plan():
    """The plan of all 32 rows per program (eq. 12 against 32 rows, not a row block's 16), checked: an
    acc-fold for the scores and an operand-fold for the values, both corrections before their stage."""
    from foldc.decisions import FoldKind
    from foldc.plan import check_plan

    spec = spec_from_args("token:2:128", "token:2:128", "128/4", 128)
    launch = GluonAttention(spec).warpgroup
    check_plan(launch.plan)
    assert launch.plan.products["qk"].fold == FoldKind.ACC_FOLD
    assert launch.plan.products["pv"].fold == FoldKind.OPERAND_FOLD


def test_foldc_compile_builds_the_template_beside_the_one_warp_program(tmp_path):
    """`foldc compile --kernel gluon --target sm_90` builds what a call runs: for 32 rows per KV head at
    token-wise INT2 the template too (contiguous caches), and only the one-warp program on sm_100."""
    env = native_env(tmp_path / "triton")
    for target, want in (("sm_90", True), ("sm_100", False)):
        out = tmp_path / target
        done = subprocess.run([sys.executable, "-m", "foldc", "compile", "--heads", "128/4", "--target", target,
                               "--kernel", "gluon", "--out", str(out)], env=env, capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0, done.stderr[-2000:]
        assert (out / f"foldc_decode_gluon.{target}.cubin").exists()
        assert (out / f"foldc_decode_warpgroup.{target}.cubin").exists() == want
        assert ("wrote its warpgroup template" in done.stdout) == want   # (explain's paragraph names it on both)
