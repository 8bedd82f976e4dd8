"""Ahead-of-time builds of the generated decode kernel for sm_90 and sm_100 (no GPU needed:
triton 3.6 bundles ptxas for both), and the `foldc compile` command.

triton.compile must run in a process where TRITON_INTERPRET was unset when triton was first
imported, and the interpreter tests in this session may have imported it with the variable
set, so every real build runs in a fresh subprocess. One subprocess builds the whole set (about
1 s per kernel); the tests below then check its artifacts and reports.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import foldc
from foldc.backends.triton.aot import compile_aot, mma_instructions
from foldc.errors import SpecError

ROOT = Path(__file__).resolve().parents[2]
ARCHS = ("sm_90", "sm_100")
A = foldc.Affine

# (name, heads, kv_heads, head_dim, k, v) -- k/v in the CLI's layout:bits:group syntax
BUILDS = [
    ("int2 K token / V token", 32, 8, 128, "token:2:128", "token:2:128"),
    ("int2 K token / V channel", 32, 8, 128, "token:2:128", "channel:2:128"),
    ("int2 K channel / V token", 32, 8, 128, "channel:2:128", "token:2:128"),
    ("int2 K channel / V channel", 32, 8, 128, "channel:2:128", "channel:2:128"),
    ("int4 K token / V channel", 32, 8, 128, "token:4:128", "channel:4:128"),
    ("int2 dequant (32/2, g32)", 32, 2, 128, "token:2:32", "channel:2:32"),
    ("plain", 32, 8, 128, "none", "none"),
    ("int4 head_dim 96", 32, 8, 96, "token:4:96", "token:4:96"),   # chunks of 16 inside 48-channel fields
    ("int2 head_dim 96", 32, 8, 96, "token:2:96", "token:2:96"),   # 24-channel fields: a padded chunk each
]

BUILD_SCRIPT = r"""
import json, sys, time
from foldc.backends.triton.aot import compile_aot
from foldc.spec import spec_from_args
jobs, out_root = json.loads(sys.argv[1]), sys.argv[2]
results = []
for name, heads, kv, hd, k, v, arch, dtype, folder in jobs:
    spec = spec_from_args(k, v, f"{heads}/{kv}", hd)
    t0 = time.time()
    report = compile_aot(spec, arch, f"{out_root}/{folder}", dtype=dtype)
    results.append({"name": name, "folder": folder, "seconds": time.time() - t0, "report": report})
print(json.dumps(results))
"""


def _env(cache: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["FOLDC_CACHE_DIR"] = cache
    env["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")  # a real build, not a hit in ~/.triton
    return env


def _folder(name: str, arch: str, dtype: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name) + f"__{arch}_{dtype}"


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    root = tmp_path_factory.mktemp("aot")
    jobs = [(name, h, kv, d, k, v, arch, "bf16", _folder(name, arch, "bf16"))
            for name, h, kv, d, k, v in BUILDS for arch in ARCHS]
    jobs.append(("int2 K token / V token", 32, 8, 128, "token:2:128", "token:2:128", "sm_90", "fp16",
                 _folder("int2 K token / V token", "sm_90", "fp16")))
    jobs.append(("int4 head_dim 96", 32, 8, 96, "token:4:96", "token:4:96", "sm_90", "fp16",   # fp16 queries'
                 _folder("int4 head_dim 96", "sm_90", "fp16")))                                 # GPU kernel there
    proc = subprocess.run([sys.executable, "-c", BUILD_SCRIPT, json.dumps(jobs), str(root)], cwd=ROOT,
                          env=_env(str(root / "cache")), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"AOT build subprocess failed:\n{proc.stderr[-4000:]}"
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for r in results:
        r["dir"] = root / r["folder"]
    return results


def _table(results) -> list[str]:
    lines = [f"{'arch':<7} {'dtype':<5} {'layout':<28} {'folds (qk/pv)':<26} {'wgmma':>5} {'tcgen05':>7} "
             f"{'mma.sync':>8} {'cubin B':>8} {'smem B':>7} {'s':>5}"]
    for r in results:
        rep = r["report"]
        m = rep["mma"]
        lines.append(f"{rep['arch']:<7} {rep['dtype']:<5} {r['name']:<28} "
                     f"{rep['folds']['qk'] + '/' + rep['folds']['pv']:<26} {m['wgmma']:>5} {m['tcgen05']:>7} "
                     f"{m['mma.sync']:>8} {rep['cubin_bytes']:>8} {rep['shared_bytes']:>7} {r['seconds']:>5.2f}")
    return lines


def test_every_build_uses_tensor_cores(builds, report_table):
    table = _table(builds)
    print("\n" + "\n".join(table))  # shown with pytest -s
    report_table("Triton AOT builds: matrix instructions in the PTX", table)
    assert len(builds) == 2 * len(BUILDS) + 2   # and two fp16 builds for sm_90
    for r in builds:
        mma = r["report"]["mma"]
        assert sum(mma.values()) >= 1, f"{r['name']} {r['report']['arch']}: no matrix instruction in the PTX: {mma}"


def test_artifacts_exist(builds):
    for r in builds:
        arch, d = r["report"]["arch"], r["dir"]
        src = (d / "foldc_decode.py").read_text()
        assert "@triton.jit" in src and "def foldc_decode(" in src
        for ext in ("ttir", "ttgir", "llir", "ptx"):
            assert (d / f"foldc_decode.{arch}.{ext}").stat().st_size > 0, (r["name"], ext)
        cubin = (d / f"foldc_decode.{arch}.cubin").read_bytes()
        assert cubin[:4] == b"\x7fELF" and len(cubin) == r["report"]["cubin_bytes"] > 1000
        ptx = (d / f"foldc_decode.{arch}.ptx").read_text()
        assert f".target {arch}a" in ptx
        assert mma_instructions(ptx) == r["report"]["mma"]
        assert json.loads((d / f"foldc_decode.{arch}.json").read_text()) == r["report"]


def test_reports_describe_the_plan(builds):
    by_name = {}
    for r in builds:
        by_name.setdefault(r["name"], []).append(r["report"])
    expect = {
        "int2 K token / V token": ("acc-fold", "operand-fold"),
        "int2 K token / V channel": ("acc-fold", "acc-fold"),
        "int2 K channel / V token": ("operand-fold", "operand-fold"),
        "int2 K channel / V channel": ("operand-fold", "acc-fold"),
        "int4 K token / V channel": ("acc-fold", "acc-fold"),
        "int2 dequant (32/2, g32)": ("dequant", "dequant"),
        "plain": ("none", "none"),
        "int4 head_dim 96": ("acc-fold", "operand-fold"),
        "int2 head_dim 96": ("acc-fold", "operand-fold"),
    }
    for name, reports in by_name.items():
        for rep in reports:
            assert (rep["folds"]["qk"], rep["folds"]["pv"]) == expect[name], (name, rep["folds"])
            assert rep["rows"] == 16 and rep["block_n"] == (32 if "g32" in name else 64)
    assert {rep["arch"] for reps in by_name.values() for rep in reps} == set(ARCHS)
    assert any(rep["dtype"] == "fp16" for reps in by_name.values() for rep in reps)


# -- errors that come before any build (safe in this process) ------------------------------------

SPEC = foldc.AttentionSpec(32, 8, 128, A(2, "token", 128), A(2, "channel", 128))


def test_unknown_arch(tmp_path):
    with pytest.raises(SpecError, match=r"arch='sm_80' is not supported.*'sm_100', 'sm_90'"):
        compile_aot(SPEC, "sm_80", tmp_path)


def test_refuses_under_interpreter(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SpecError, match="TRITON_INTERPRET unset.*fresh shell"):
        compile_aot(SPEC, "sm_90", tmp_path)
    assert not any(tmp_path.iterdir())


# -- the CLI -------------------------------------------------------------------------------------

def _has_compile_command() -> bool:
    from foldc.cli import build_parser

    return "compile" in build_parser()._subparsers._group_actions[0].choices


needs_cli = pytest.mark.skipif(not _has_compile_command(), reason="foldc/cli.py has no 'compile' subcommand yet")


@needs_cli
def test_cli_compile(tmp_path):
    """The generated Triton kernel for fp16 queries (`--kernel triton`: with auto the register-operand kernel
    builds fp16 too, tests/backends/test_gluon_aot.py)."""
    out = tmp_path / "build"
    proc = subprocess.run([sys.executable, "-m", "foldc", "compile", "--k", "token:2:128", "--v", "channel:2:128",
                           "--heads", "32/8", "--head-dim", "128", "--target", "sm_100", "--dtype", "fp16",
                           "--block-n", "32", "--kernel", "triton", "--out", str(out)],
                          cwd=ROOT, env=_env(str(tmp_path / "cache")), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "proof of plan {'qk': 'acc-fold', 'pv': 'acc-fold'}: exact" in proc.stdout
    first, rest = proc.stdout[proc.stdout.index("\nwrote ") + 1:].split("\n", 1)
    assert first.startswith("wrote ") and "sm_100" in first
    report = json.loads(rest)
    assert report["arch"] == "sm_100" and report["dtype"] == "fp16" and report["block_n"] == 32
    assert report["folds"] == {"qk": "acc-fold", "pv": "acc-fold"}
    assert sum(report["mma"].values()) >= 1
    assert (out / "foldc_decode.sm_100.cubin").stat().st_size == report["cubin_bytes"] > 0
    assert (out / "foldc_decode.sm_100.ptx").stat().st_size > 0
    assert "x 32 tokens" in (out / "foldc_decode.py").read_text()


@needs_cli
def test_cli_compile_from_layout_file(tmp_path):
    layout = tmp_path / "layout.toml"
    layout.write_text('[attention]\nheads = "16/4"\nhead_dim = 64\nk = "channel:4:64"\nv = "token:8:32"\n')
    out = tmp_path / "build"
    for kernel, name in (("triton", "foldc_decode"), ("auto", "foldc_decode_gluon")):   # auto: it lowers there
        proc = subprocess.run([sys.executable, "-m", "foldc", "compile", str(layout), "--target", "sm_90",
                               "--out", str(out / kernel), "--kernel", kernel],
                              cwd=ROOT, env=_env(str(tmp_path / "cache")), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        report = json.loads(proc.stdout[proc.stdout.index("\nwrote ") + 1:].split("\n", 1)[1])
        assert report["spec"] == "heads 16/4, head_dim 64, K channel:4:64, V token:8:32"
        assert sum(report["mma"].values()) >= 1 and (out / kernel / f"{name}.sm_90.cubin").stat().st_size > 0


@needs_cli
@pytest.mark.parametrize("argv,fragments", [
    (["--k", "token:2:8", "--v", "none", "--head-dim", "64"], ["tensor-core minimum of 16", "token:2:8"]),
    (["--v", "channel:2:24"], ["group_size=[24]", "multiple of 16"]),
    (["--block-n", "24"], ["block_n=24", "power of two"]),
    (["--k", "none", "--v", "none", "--head-dim", "40"], ["head_dim=40", "multiple of 16"]),
], ids=["token-group-8", "channel-group-24", "block-n-24", "head-dim-40"])
def test_cli_compile_errors(tmp_path, capsys, argv, fragments):
    """Errors raised before any build: exit status 2, one line naming the value and the fix."""
    from foldc.cli import main

    rc = main(["compile", *argv, "--target", "sm_90", "--out", str(tmp_path / "build")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("foldc: error: ")
    for frag in fragments:
        assert frag in err
    assert not (tmp_path / "build").exists()



MIXED_SCRIPT = r"""
import json, sys
import triton, triton.language  # imported natively first, as torch.compile or a serving engine would
import torch, foldc
from foldc.testing import run_case
from foldc.backends.triton.aot import compile_aot
spec = foldc.AttentionSpec(8, 2, 64, foldc.Affine(2, "token", 32), foldc.Affine(4, "channel", 32))
attn = foldc.compile(spec, "interpret", block_n=16)
errors = [run_case(attn, spec, 1, 40, torch.float16, "cpu", 0).error]
report = compile_aot(spec, "sm_90", sys.argv[1])            # native build after interpreting
errors.append(run_case(attn, spec, 1, 40, torch.float16, "cpu", 1).error)  # and interpreting again
print(json.dumps({"errors": errors, "mma": sum(report["mma"].values())}))
"""


def test_interpreter_and_native_builds_share_a_process(tmp_path):
    """Triton fixes its library functions' mode (tl.sum, tl.max ...) at first import; foldc swaps
    them per launch, so target="interpret" works after a native import of triton, and an AOT
    build works after interpreting, in one process."""
    proc = subprocess.run([sys.executable, "-c", MIXED_SCRIPT, str(tmp_path / "build")], cwd=ROOT,
                          env=_env(str(tmp_path / "cache")), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(e <= 2e-3 for e in result["errors"]), result
    assert result["mma"] >= 1
