"""`foldc explain / prove / compile LAYOUT.toml` with GEMM layouts: every shipped example goes
from file to a proved plan and a checked kernel; bad files exit 2 with a message naming the key,
its value and the fix."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import foldc
from foldc.cli import main
from foldc.gemm import GemmSpec
from foldc.spec import spec_from_toml

REPO = Path(foldc.__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples" / "layouts").glob("*.toml"))


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_examples_include_gemm_and_attention_layouts():
    kinds = [type(spec_from_toml(p)).__name__ for p in EXAMPLES]
    assert kinds.count("GemmSpec") >= 4 and kinds.count("AttentionSpec") >= 2


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_compiles_and_proves(capsys, path):
    rc, out, err = run(capsys, "compile", path, "--target", "reference")
    assert rc == 0, err
    spec = spec_from_toml(path)
    folds = foldc.plan(spec).folds
    assert f"proof of plan {folds}: exact" in out
    err_value = float(re.search(r"rel L2 ([0-9.e+-]+)", out).group(1))
    assert err_value < 1e-12 and "MISMATCH" not in out


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "layout.toml"
    path.write_text(text)
    return path


def test_one_command_from_file_to_verified_interpreter_kernel(capsys, tmp_path):
    path = write(tmp_path, '[gemm]\nm = 3\nn = 48\nk = 256\nweight = "k-group:2:64"\n')
    rc, out, err = run(capsys, "compile", path, "--target", "interpret", "--out", tmp_path / "build")
    assert rc == 0, err
    assert out.startswith("foldc plan: y = x . w^T, m = 3, n = 48, k = 256")
    assert "proof of plan {'w': 'acc-fold'}: exact" in out
    assert "checked: interpreter kernel vs float64 plan executor, m=3" in out and "MISMATCH" not in out
    assert "def foldc_gemm(" in (tmp_path / "build" / "foldc_gemm.py").read_text()


def test_explain_and_prove_accept_gemm_layouts(capsys, tmp_path):
    path = write(tmp_path, '[gemm]\nm = 8\nn = 64\nk = 128\nweight = "per-channel:8"\nactivation = "per-token:8"\n')
    rc, out, err = run(capsys, "explain", path)
    assert rc == 0 and err == ""
    assert "| fold" in out and "acc-fold" in out and "column sums of w's codes" in out
    rc, out, err = run(capsys, "prove", path)
    assert rc == 0 and "two encoded operands (eq. 15)" in out
    assert "proof of plan {'w': 'acc-fold', 'x': 'acc-fold'}: exact" in out


def test_gemm_table_form_and_symbolic_m(tmp_path):
    path = write(tmp_path, '[gemm]\nm = "symbolic"\nn = 64\nk = 128\n'
                 'weight = { kind = "k-group", bits = 4, group_size = 32, scale_dtype = "bf16" }\n')
    spec = spec_from_toml(path)
    assert isinstance(spec, GemmSpec) and spec.m is None and spec.weight.short() == "k-group:4:32:bf16"


@pytest.mark.parametrize("text, fragments", [
    ('[gemm]\nn = 64\nweight = "k-group:4:32"\n', ["missing key 'k'"]),
    ('[gemm]\nn = 64\nk = 100\nweight = "k-group:4:32"\n', ["group_size=32 does not divide k=100"]),
    ('[gemm]\nn = 64\nk = 128\nweight = "k-group:4:32"\nbias = 1\n', ["unknown keys ['bias']"]),
    ('[gemm]\nn = 64\nk = 128\nweight = "k-grp:4:32"\n', ["kind 'k-grp' is not a weight encoding"]),
    ('[gemm]\nn = 64\nk = 128\nweight = { kind = "k-group", bits = 4 }\n', ["'k-group:bits:group_size'"]),
    ('[gemm]\nn = 64\nk = 128\nweight = "k-group:4:32"\nactivation = "per-token:8"\n',
     ["activation='per-token:8' needs weight='per-channel:8'"]),
    ('[gemm]\nn = 64\nk = 128\n[attention]\nheads = "8/2"\nhead_dim = 64\n', ["both [attention] and [gemm]"]),
    ('[gemm]\nm = -1\nn = 64\nk = 128\nweight = "per-channel:8"\n', ["m=-1 must be a positive integer"]),
    # a scale dtype alone raised IndexError; a value's error now names the file, as an attention layout's does
    ('[gemm]\nn = 64\nk = 128\nweight = "bf16"\n', ["layout.toml: [gemm]: weight='bf16': kind ''"]),
    ('[gemm]\nm = true\nn = 64\nk = 128\nweight = "per-channel:8"\n', ["layout.toml: [gemm]: m=True must be"]),
])
def test_bad_gemm_layouts_exit_2_naming_the_value(capsys, tmp_path, text, fragments):
    rc, out, err = run(capsys, "explain", write(tmp_path, text))
    assert rc == 2 and out == ""
    assert err.startswith("foldc: error: ")
    for fragment in fragments:
        assert fragment in err


def test_gpu_target_needs_out(capsys, tmp_path):
    path = write(tmp_path, '[gemm]\nn = 64\nk = 128\nweight = "per-channel:8"\n')
    rc, out, err = run(capsys, "compile", path, "--target", "sm_90")
    assert rc == 2 and "target='sm_90' writes the kernel's PTX and cubin: give --out DIR" in err


def test_one_command_for_an_attention_layout(capsys, tmp_path):
    path = write(tmp_path, '[attention]\nheads = "8/2"\nhead_dim = 64\nk = "token:4:32"\nv = "channel:2:32"\n')
    rc, out, err = run(capsys, "compile", path, "--out", tmp_path / "build")  # default target: interpret
    assert rc == 0, err
    assert out.startswith("foldc plan: 8 query heads / 2 KV heads")
    assert "proof of plan {'qk': 'acc-fold', 'pv': 'acc-fold'}: exact" in out
    assert "checked: interpreter kernel vs float64 attention" in out and "MISMATCH" not in out
    assert "def foldc_decode(" in (tmp_path / "build" / "foldc_decode.py").read_text()


GEMM_FILE = '[gemm]\nn = 64\nk = 128\nweight = "k-group:4:32"\n'


@pytest.mark.parametrize("argv,fragments", [
    (["--target", "interpret", "--block-n", "64"], ["block_n=64 (--block-n)", "drop --block-n"]),
    (["--target", "sm_90", "--out", "OUT", "--block-n", "32"], ["block_n=32 (--block-n)", "GEMM"]),
    (["--target", "sm_90", "--out", "OUT", "--kernel", "gluon"], ["kernel='gluon'", "drop --kernel"]),
    (["--target", "sm_90", "--out", "OUT", "--num-warps", "3"], ["num_warps=3", "power of two"]),
    (["--target", "interpret", "--num-stages", "0"], ["num_stages=0", "positive integer"]),
    (["--target", "reference", "--num-warps", "4"], ["num_warps=4 (--num-warps)", "target='reference'"]),
], ids=["interp-block-n", "aot-block-n", "gluon", "warps-3", "stages-0", "ref-warps"])
def test_gemm_compile_option_errors_before_the_plan(capsys, tmp_path, argv, fragments):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    rc, out, err = run(capsys, "compile", write(tmp_path, GEMM_FILE), *argv)
    assert rc == 2 and out == "", (rc, out, err)
    assert err.startswith("foldc: error: ") and err.count("\n") == 1
    for fragment in fragments:
        assert fragment in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text,fragments", [
    ("gemm = 5\n", ["gemm must be a table", "5"]),
    ('note = 1\n[gemm]\nn = 64\nk = 128\nweight = "per-channel:8"\n', ["unknown top-level keys ['note']"]),
    ('[gemm]\nn = 64\nk = 128\nweight = "per-channel:8"\n[gemm.extra]\nx = 1\n', ["unknown keys ['extra']"]),
], ids=["not-a-table", "top-level-key", "sub-table"])
def test_gemm_misplaced_keys(capsys, tmp_path, text, fragments):
    rc, out, err = run(capsys, "explain", write(tmp_path, text))
    assert rc == 2 and out == ""
    for fragment in fragments:
        assert fragment in err


def test_gemm_file_not_utf8(capsys, tmp_path):
    path = tmp_path / "layout.toml"
    path.write_bytes(b"[gemm]\nn = 64 # \xff\nk = 128\n")
    rc, out, err = run(capsys, "explain", path)
    assert rc == 2 and out == "" and "is not UTF-8 text" in err


def test_gemm_interpret_runs_the_options_given(capsys, tmp_path):
    rc, out, err = run(capsys, "compile", write(tmp_path, GEMM_FILE), "--target", "interpret", "--num-warps", "2")
    assert rc == 0, err
    assert "checked: interpreter kernel vs float64 plan executor" in out and "MISMATCH" not in out
