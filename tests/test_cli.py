"""The command line: `foldc explain`, `foldc prove`, `foldc demo` through `foldc.cli.main`, and
the `python -m foldc` entry point."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import foldc
import foldc.demo
from foldc.cli import main
from foldc.spec import spec_from_toml

REPO = Path(foldc.__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples" / "layouts").glob("*.toml"))

# (K layout, V layout) -> the folds the explainer's table gives (groups of 128, 4 query heads per KV head)
LAYOUT_FOLDS = {
    ("token", "token"): ("acc-fold", "operand-fold"),
    ("token", "channel"): ("acc-fold", "acc-fold"),
    ("channel", "token"): ("operand-fold", "operand-fold"),
    ("channel", "channel"): ("operand-fold", "acc-fold"),
}


def _row(text: str, label: str) -> list[str]:
    """The cells (qk, pv) of the first line of the explain table's row ``label``."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) == 5 and cells[1] == label:
            return cells[2:4]
    raise AssertionError(f"no row {label!r} in:\n{text}")


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("k_layout,v_layout", list(LAYOUT_FOLDS))
def test_explain_flags_prints_the_folds_of_each_layout(capsys, k_layout, v_layout):
    rc, out, err = _run(capsys, "explain", "--k", f"{k_layout}:2:128", "--v", f"{v_layout}:2:128",
                        "--heads", "32/8", "--head-dim", "128")
    assert rc == 0 and err == ""
    assert out.startswith("foldc plan: 32 query heads / 8 KV heads (4 per KV head), head_dim 128")
    qk, pv = _row(out, "fold")
    want_qk, want_pv = LAYOUT_FOLDS[(k_layout, v_layout)]
    assert qk.startswith(want_qk + ":") and pv.startswith(want_pv + ":")
    enc_k, enc_v = _row(out, "encoded operand")
    assert enc_k.startswith(f"%k {k_layout}:2:128") and enc_v.startswith(f"%v {v_layout}:2:128")
    assert _row(out, "product")[0].startswith("scores = q . k")
    assert "graph decode_attention" not in out  # the IR only with --ir


def test_explain_dequant_and_plain_operands(capsys):
    rc, out, _ = _run(capsys, "explain", "--k", "token:4:16", "--v", "none", "--heads", "16/1", "--head-dim", "32")
    assert rc == 0
    qk, pv = _row(out, "fold")
    assert qk.startswith("dequant:") and pv.startswith("none: %v is a plain operand")
    assert _row(out, "encoded operand")[1] == "%v plain (no encoding)"
    assert "group_size=16 <= 2*h=32" in out


def test_explain_a_whole_cache_channel_group_shows_the_precision_no_kernel_meets(capsys):
    """Groups of MAX_GROUP_SIZE tokens (one group over the whole cache): the reference plan's table printed what each
    query dtype would get, and an operand-fold no precision bounds raised PlanError, so explain printed nothing (prove
    and compile --target reference took the layout)."""
    rc, out, err = _run(capsys, "explain", "--k", "channel:2:2147483647", "--v", "channel:2:2147483647")
    assert rc == 0 and err == ""
    qk, _ = _row(out, "operand precision (eq. 6a)")
    assert qk.startswith("fp16: no precision meets")
    assert "hi + lo bounds the error at 40x" in out and "bf16: no precision meets" in out
    assert "only the float64 executor (target='reference') runs it" in out

def test_explain_ir_prints_the_graph(capsys):
    rc, out, err = _run(capsys, "explain", "--k", "token:2:64", "--v", "channel:4:32", "--heads", "8/2",
                        "--head-dim", "64", "--ir")
    assert rc == 0 and err == ""
    table, graph = out.split("\ngraph ", 1)
    assert "| fold" in table
    assert graph.startswith("decode_attention(heads 8/2, head_dim 64, K token:2:64, V channel:4:32)")
    for line in ("%q = input role=query", "%k = input role=key encoding=token:2:64",
                 "%scores.partial = contract %q, %k.codes", "%p = online_softmax %logits",
                 "%acc = accumulate", "return %out"):
        assert line in graph, line


def test_explain_toml_file(capsys, tmp_path):
    path = tmp_path / "layout.toml"
    path.write_text('[attention]\nheads = "8/2"\nhead_dim = 64\nk = "channel:4:16:fp32"\n'
                    'v = { layout = "token", bits = 8, group_size = 32 }\n')
    rc, out, err = _run(capsys, "explain", str(path))
    assert rc == 0 and err == ""
    assert out.startswith("foldc plan: 8 query heads / 2 KV heads (4 per KV head), head_dim 64")
    enc_k, enc_v = _row(out, "encoded operand")
    assert enc_k.startswith("%k channel:4:16:fp32") and enc_v.startswith("%v token:8:32")
    qk, pv = _row(out, "fold")
    assert qk.startswith("operand-fold") and pv.startswith("operand-fold")


def test_a_toml_file_describes_the_whole_layout_and_flags_beside_it_are_refused(capsys, tmp_path):
    """A layout flag given with a file was ignored, silently (--heads 32/8 explained the file's 4/4)."""
    path = tmp_path / "layout.toml"
    path.write_text('heads = "4/4"\nhead_dim = 16\nk = "none"\n')
    rc, out, _ = _run(capsys, "explain", str(path))
    assert rc == 0
    assert out.startswith("foldc plan: 4 query heads / 4 KV heads (1 per KV head), head_dim 16")
    assert [c.split(":")[0] for c in _row(out, "fold")] == ["none", "none"]
    for flag, value in (("--heads", "32/8"), ("--head-dim", "128"), ("--k", "token:4:16"), ("--v", "none")):
        rc, out, err = _run(capsys, "explain", str(path), flag, value)
        assert rc == 2 and out == "" and f"{flag} given with the layout file" in err


@pytest.mark.parametrize("command", ["explain", "prove", "compile"])
@pytest.mark.parametrize("argv,fragment", [
    (["--k", ""], "--k=''"), (["--v", ""], "--v=''"), (["--heads", ""], "--heads=''"), ([""], "layout file ''")])
def test_an_empty_layout_value_exits_2_naming_the_flag(capsys, command, argv, fragment):
    """An empty --k, --v, --heads or layout path (an unset shell variable: --k "$K") was taken for a flag left out:
    the default token:2:128 or 32/8 (or the flags' layout for an empty path) came out with exit status 0."""
    rc, out, err = _run(capsys, command, *argv, *(["--target", "reference"] if command == "compile" else []))
    assert rc == 2 and out == ""
    assert err.startswith("foldc: error: ") and fragment in err and err.count("\n") == 1

@pytest.mark.parametrize("argv,note", [
    (["--k", "token:2:32", "--head-dim", "32"], "--v was left out: its default is token:2:128"),
    (["--v", "none", "--head-dim", "48"], "--k was left out: its default is token:2:128"),
    (["--k", "token:2:48", "--v", "none"], "--head-dim was left out: its default is 128"),
])
def test_a_default_the_message_blames_is_named_as_one(capsys, argv, note):
    """--head-dim 32 with --k alone: the error named 'group_size=128 ... head_dim (for v)=32', a value never typed
    (the default --v), without saying where it came from."""
    rc, out, err = _run(capsys, "explain", *argv)
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert note in err
    rc, out, err = _run(capsys, "explain", "--k", "token:2:48", "--v", "none", "--head-dim", "128")
    assert rc == 2 and "left out" not in err   # every value typed: nothing to add


def test_examples_exist():
    assert EXAMPLES, f"no example layouts under {REPO / 'examples' / 'layouts'}"


ATTENTION_EXAMPLES = [p for p in EXAMPLES if "[attention]" in p.read_text()]


@pytest.mark.parametrize("path", ATTENTION_EXAMPLES, ids=[p.name for p in ATTENTION_EXAMPLES])
def test_explain_shipped_examples(capsys, path):
    spec = spec_from_toml(path)
    rc, out, err = _run(capsys, "explain", str(path))
    assert rc == 0 and err == ""
    assert out.startswith(f"foldc plan: {spec.num_q_heads} query heads / {spec.num_kv_heads} KV heads")
    folds = foldc.plan(spec).folds
    qk, pv = _row(out, "fold")
    assert qk.startswith(folds["qk"]) and pv.startswith(folds["pv"])


def test_prove_prints_exact(capsys):
    rc, out, err = _run(capsys, "prove", "--k", "channel:4:64", "--v", "token:2:32", "--heads", "8/2",
                        "--head-dim", "64")
    assert rc == 0 and err == ""
    assert "plan for heads 8/2, head_dim 64, K channel:4:64, V token:2:32" in out
    assert "proof of plan {'qk': 'operand-fold', 'pv': 'operand-fold'}: exact" in out
    assert "lemma (symbolic g): qk: operand-fold" in out and "checked: output = accumulator / denominator" in out


@pytest.mark.parametrize("argv,fragments", [
    (["--k", "token:3:128"], ["bits=3", "(2, 4, 8)"]),
    (["--v", "token:2:100"], ["group_size=100", "head_dim (for v)=128", "divisor of 128"]),
    (["--heads", "32/5"], ["num_q_heads=32", "num_kv_heads=5", "multiple"]),
    (["--heads", "32"], ["heads='32'", "'Q/KV'"]),
    (["--head-dim", "0"], ["head_dim=0", "positive integer"]),
    (["--k", "diagonal:2:128"], ["layout='diagonal'", "'token'", "'channel'"]),
    (["--k", "token:2"], ["encoding 'token:2'", "layout:bits:group_size"]),
    (["--k", "token:2:128:fp8"], ["scale dtype 'fp8'", "bf16"]),
], ids=["bits", "group", "heads-ratio", "heads-syntax", "head-dim", "layout", "encoding-syntax", "scale-dtype"])
@pytest.mark.parametrize("command", ["explain", "prove"])
def test_bad_flags_exit_2_naming_the_field(capsys, command, argv, fragments):
    rc, out, err = _run(capsys, command, *argv)
    assert rc == 2 and out == ""
    assert err.startswith("foldc: error: ") and err.count("\n") == 1
    for frag in fragments:
        assert frag in err, f"{frag!r} missing from {err!r}"


@pytest.mark.parametrize("content,fragments", [
    ('heads = "8/2"\n', ["missing key 'head_dim'"]),
    ('heads = "8/2"\nhead_dim = 64\nkk = "none"\n', ["unknown keys ['kk']", "heads, head_dim, k, v"]),
    ('heads = "8/2"\nhead_dim = 64\nk = { layout = "token", bits = 2 }\n', ["[k] is missing 'group_size'"]),
    ('heads = "8/2"\nhead_dim = 64\nv = { layout = "token", bits = 2, group_size = 8, scale = 1 }\n',
     ["[v] has unknown keys ['scale']"]),
    ('heads = 8/2\n', ["is not valid TOML"]),
], ids=["missing", "unknown", "table-missing", "table-unknown", "syntax"])
def test_bad_toml_exit_2_naming_the_key(capsys, tmp_path, content, fragments):
    path = tmp_path / "bad.toml"
    path.write_text(content)
    rc, out, err = _run(capsys, "explain", str(path))
    assert rc == 2 and out == ""
    assert str(path) in err
    for frag in fragments:
        assert frag in err, f"{frag!r} missing from {err!r}"


def test_missing_toml_file(capsys, tmp_path):
    path = tmp_path / "nope.toml"
    rc, out, err = _run(capsys, "explain", str(path))
    assert rc == 2 and out == ""
    assert f"cannot read layout file {str(path)!r}" in err


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["explain", "--head-dim", "abc"])
    assert info.value.code == 2
    assert "--head-dim" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


def test_demo_command_passes_its_flags(capsys, monkeypatch):
    calls = []

    def fake_run_demo(**kwargs):
        calls.append(kwargs)
        return 7

    monkeypatch.setattr(foldc.demo, "run_demo", fake_run_demo)
    assert main(["demo", "--batch", "3", "--tokens", "77", "--seed", "5"]) == 7
    assert len(calls) == 1
    assert {k: calls[0][k] for k in ("batch", "tokens", "seed")} == {"batch": 3, "tokens": 77, "seed": 5}


def _python_m_foldc(*argv):
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "foldc", *argv], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=120)


def test_python_m_foldc_entry_point():
    r = _python_m_foldc("explain", "--k", "channel:2:32", "--v", "channel:2:32", "--heads", "8/2",
                        "--head-dim", "32")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("foldc plan: 8 query heads / 2 KV heads")
    qk, pv = _row(r.stdout, "fold")
    assert qk.startswith("operand-fold") and pv.startswith("acc-fold")

    r = _python_m_foldc("explain", "--k", "token:5:32", "--head-dim", "32")
    assert r.returncode == 2 and r.stdout == ""
    assert "foldc: error: bits=5" in r.stderr


@pytest.mark.parametrize("k_layout,v_layout,bits,want", [
    ("token", "token", 2, "fitted"), ("token", "token", 4, "fitted"), ("channel", "token", 2, "channel-wise"),
    ("token", "channel", 4, "channel-wise")])
def test_explain_gives_the_register_operand_kernels_whole_loop_demand(capsys, k_layout, v_layout, bits, want):
    """Below the table: the sm_90 kernel's whole token loop against the H200's budget (the table's
    budget row counts operand construction only), or why no figure is given."""
    from foldc.cost import token_loop_lane_slots_per_byte

    rc, out, _ = _run(capsys, "explain", "--k", f"{k_layout}:{bits}:128", "--v", f"{v_layout}:{bits}:128",
                      "--heads", "32/8", "--head-dim", "128")
    assert rc == 0
    tail = " ".join(out.split("+\n")[-1].split())
    assert tail.startswith("register-operand kernel (sm_90, sm_100)") and "2 KV head(s) per program" in tail
    if want == "fitted":
        block_n = 64 if bits == 2 else 32      # the launcher's default tiles for two packed heads
        assert f"{block_n}-token tiles" in tail
        demand = token_loop_lane_slots_per_byte("sm_90", bits, 128, heads=2, block_n=block_n)
        assert f"{demand:.2f} of the H200's 6.97 lane-slots/byte" in tail
    else:
        assert "no fitted whole-loop figure" in tail


def test_explain_says_when_the_register_operand_kernel_is_not_used(capsys):
    rc, out, _ = _run(capsys, "explain", "--k", "token:4:16", "--v", "none", "--heads", "16/1", "--head-dim", "32")
    assert rc == 0
    tail = " ".join(out.split("+\n")[-1].split())
    assert "not used for this layout" in tail and "generated Triton kernel" in tail


UNTILED = {   # layouts the reference plan takes and neither kernel tiles
    "head-dim-8": ["--k", "token:2:8", "--v", "token:2:8", "--heads", "1/1", "--head-dim", "8"],
    "channel-g7": ["--k", "channel:2:7", "--v", "token:2:128"],
    "plain-hd24": ["--k", "none", "--v", "none", "--head-dim", "24"],
}


@pytest.mark.parametrize("layout", list(UNTILED.values()), ids=list(UNTILED))
def test_explain_does_not_promise_a_kernel_for_a_layout_none_runs(capsys, layout):
    """explain said "the generated Triton kernel runs it" for layouts the Triton kernel refuses (head_dim 8, channel
    groups of 7 tokens...), and `explain --target sm_90` printed a plan for a kernel that is never built: `foldc
    compile --target sm_90` then failed. Now explain says only the float64 executor runs the layout, and --target
    fails with the Triton kernel's reason."""
    rc, out, err = _run(capsys, "explain", *layout)
    assert rc == 0 and err == ""
    tail = " ".join(out.split("+\n")[-1].split())
    assert "the generated Triton kernel runs it" not in tail and "target='reference'" in tail, tail
    for target in ("sm_90", "sm_100", "interpret"):
        rc, out, err = _run(capsys, "explain", *layout, "--target", target)
        assert rc == 2 and out == "" and err.count("\n") == 1 and f"target={target!r}" in err, (rc, err)
        rc, cout, cerr = _run(capsys, "compile", *layout, "--target", "interpret")
        assert rc == 2 and cerr.split("error: ")[-1].strip() in err   # the reason compile gives


# -- issue 17: every option checked before the plan prints, every failure a one-line error ---------

def _fails_before_printing(capsys, argv, fragments):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2, (rc, out, err)
    assert out == "", f"printed before the error:\n{out[:300]}"
    assert err.startswith("foldc: error: ") and err.count("\n") == 1 and "Traceback" not in err
    for frag in fragments:
        assert frag in err, f"{frag!r} missing from {err!r}"
    return err


@pytest.mark.parametrize("argv,fragments", [
    (["--target", "interpret", "--block-n", "0"], ["block_n=0", "power of two >= 16"]),
    (["--target", "interpret", "--num-warps", "3"], ["num_warps=3", "power of two"]),
    (["--target", "interpret", "--num-stages", "0"], ["num_stages=0", "positive integer"]),
    (["--target", "interpret", "--block-n", "1048576"], ["block_n=1048576", "<= 256"]),
    (["--target", "reference", "--block-n", "64"], ["block_n=64 (--block-n)", "target='reference'", "drop"]),
    (["--target", "reference", "--num-warps", "4"], ["num_warps=4 (--num-warps)", "target='reference'"]),
    (["--target", "reference", "--kernel", "triton"], ["kernel='triton' (--kernel)", "drop --kernel"]),
    (["--target", "reference", "--out", "build"], ["out='build' (--out)", "writes no kernel"]),
    (["--target", "reference", "--dtype", "bf16"], ["dtype='bf16' (--dtype)", "target='reference'", "drop"]),
    (["--target", "interpret", "--kernel", "gluon"], ["kernel='gluon'", "target='interpret'"]),
    (["--target", "interpret", "--dtype", "bf16"], ["dtype='bf16' (--dtype)", "fp16 only"]),
    (["--target", "interpret", "--seed", "-1"], ["seed=-1", ">= 0"]),
    (["--target", "sm_90", "--out", "OUT", "--num-warps", "64"], ["num_warps=64", "<= 32", "1024 threads"]),
    (["--target", "sm_90", "--out", "OUT", "--block-n", "0"], ["block_n=0", "power of two"]),
    (["--target", "sm_100", "--out", "OUT", "--num-warps", "3"], ["num_warps=3", "power of two"]),
    (["--target", "sm_90", "--out", "OUT", "--num-stages", "9", "--kernel", "triton"], ["num_stages=9", "<= 8"]),
    (["--target", "reference", "--head-dim", "1000000"], ["head_dim=1000000", "<= 1024", "MAX_HEAD_DIM"]),
    (["--target", "interpret", "--heads", "100000/1"], ["num_q_heads=100000", "<= 1024", "MAX_HEADS"]),
    (["--target", "reference", "--heads", "8/2000"], ["num_kv_heads=2000", "<= 1024"]),
], ids=["block-n-0", "warps-3", "stages-0", "block-n-huge", "ref-block-n", "ref-warps", "ref-kernel", "ref-out",
        "ref-dtype", "interp-gluon", "interp-bf16", "seed", "aot-warps-64", "aot-block-n-0", "sm100-warps-3",
        "aot-stages-9", "head-dim-huge", "heads-huge", "kv-heads-huge"])
def test_compile_option_errors_come_before_the_plan(capsys, tmp_path, argv, fragments):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    _fails_before_printing(capsys, ["compile", "--k", "token:2:128", "--v", "token:2:128", *argv], fragments)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv,fragments", [
    (["--block-n", "16", "--kernel", "gluon"], ["block_n=16", "32 or 64"]),
    (["--num-warps", "4", "--kernel", "gluon"], ["num_warps=4 (--num-warps)", "one warp per program",
                                                 "--kernel triton"]),
    (["--num-stages", "1"], ["num_stages=1 (--num-stages)", "--kernel auto picks the register-operand kernel",
                             "--kernel triton"]),
], ids=["gluon-block-n", "gluon-warps", "auto-gluon-stages"])
def test_register_operand_option_errors_come_before_the_plan(capsys, tmp_path, gluon_lowers_as, argv, fragments):
    """On sm_90 the register-operand kernel (picked by --kernel auto where it lowers the plan, here
    forced to lower) takes no --num-warps, 32/64-token tiles and 2-4 stages: said before the plan."""
    gluon_lowers_as(lambda spec, dtype="bf16": (True, ""))
    _fails_before_printing(capsys, ["compile", "--k", "token:2:128", "--v", "token:2:128", "--target", "sm_90",
                                    "--out", str(tmp_path / "out"), *argv], fragments)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_compile_unwritable_out(capsys, tmp_path, where):
    (tmp_path / "file").write_text("x")
    out = str(tmp_path / "file" / "sub") if where == "under-a-file" else "/proc/foldc-test/sub"
    _fails_before_printing(capsys, ["compile", "--target", "sm_90", "--out", out], [f"out={out!r}",
                                                                                    "not a writable folder"])


def test_compile_interpret_uses_the_block_n_given(capsys, tmp_path):
    """--block-n reaches the interpreter's kernel (it used to run the default 64)."""
    rc, out, err = _run(capsys, "compile", "--k", "token:2:64", "--v", "channel:2:32", "--heads", "4/2",
                        "--head-dim", "64", "--block-n", "16", "--out", str(tmp_path))
    assert rc == 0, err
    assert "x 16 tokens" in (tmp_path / "foldc_decode.py").read_text()
    assert "checked: interpreter kernel" in out and "MISMATCH" not in out


def test_aot_build_records_the_options_given(tmp_path):
    """A real sm_100 build: the JSON report carries the block_n, num_warps and num_stages given."""
    out = tmp_path / "build"
    env = {**os.environ, "FOLDC_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-m", "foldc", "compile", "--k", "token:2:128", "--v", "token:2:128",
                        "--target", "sm_100", "--block-n", "32", "--num-warps", "2", "--num-stages", "3",
                        "--out", str(out)], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout[r.stdout.index("\nwrote ") + 1:].split("\n", 1)[1])
    assert (report["block_n"], report["num_warps"], report["num_stages"]) == (32, 2, 3)


@pytest.mark.parametrize("argv,fragment", [
    (["--tokens", "-5"], "tokens=-5"), (["--tokens", "0"], "tokens=0"), (["--batch", "0"], "batch=0"),
    (["--batch", "1000"], "batch=1000"), (["--batch", "64", "--tokens", "65536"], "tokens=65536"),
    (["--seed", "-3"], "seed=-3")])
def test_demo_bad_sizes_exit_2_before_printing(capsys, argv, fragment):
    err = _fails_before_printing(capsys, ["demo", "--no-kernels", *argv], [fragment])
    assert "must be" in err


@pytest.mark.parametrize("content,fragments", [
    ('k = "token:2:64"\n[attention]\nheads = "8/2"\nhead_dim = 64\n', ["['k']", "above the [attention] header",
                                                                        "move them below [attention]"]),
    ('[attention]\nheads = "8/2"\nhead_dim = 64\n[extra]\nx = 1\n', ["['extra']", "only an [attention] table"]),
    ('attention = 5\n', ["attention=5 must be a table"]),
], ids=["key-above-table", "extra-table", "attention-not-a-table"])
def test_misplaced_toml_keys_exit_2(capsys, tmp_path, content, fragments):
    path = tmp_path / "bad.toml"
    path.write_text(content)
    _fails_before_printing(capsys, ["explain", str(path)], [str(path), *fragments])


def test_non_utf8_toml_exits_2(capsys, tmp_path):
    path = tmp_path / "bad.toml"
    path.write_bytes(b'\xff\xfe[attention]\nheads = "8/2"\n')
    _fails_before_printing(capsys, ["explain", str(path)], [repr(str(path)), "not UTF-8"])


def test_missing_toml_file_for_compile(capsys, tmp_path):
    path = tmp_path / "nope.toml"
    _fails_before_printing(capsys, ["compile", str(path)], [f"cannot read layout file {str(path)!r}"])


@pytest.mark.parametrize("argv,fragment", [(["--k", "token:4:128", "--v", "none", "--heads", "32/8"],
                                            "2 KV head(s) per program:"),
                                           (["--k", "token:2:128", "--v", "token:2:128", "--heads", "64/2"],
                                            "2 row blocks of 16 query rows per KV head")])
def test_explain_gives_no_fitted_figure_outside_the_fit(capsys, argv, fragment):
    """A plain side or row blocks lower to the register-operand kernel, but the whole-loop model was not
    fitted to them: explain says so instead of printing a figure."""
    rc, out, _ = _run(capsys, "explain", *argv, "--head-dim", "128")
    tail = " ".join(out.split("+\n")[-1].split())
    assert rc == 0 and "no fitted whole-loop figure" in tail and "lane-slots/byte" not in tail
    assert fragment in tail


@pytest.mark.parametrize("heads,rows", [((32, 8), None), ((34, 2), 9), ((64, 2), 16)])
def test_compile_explains_and_proves_the_plan_of_the_kernel_it_builds(heads, rows):
    """`foldc compile` prints and proves the plan the built kernel runs: for the register-operand kernel its own plan
    (no code bias: fp16-subnormal codes; the break-even of one row block's rows), for the Triton kernel the Triton
    backend's (its code bias, eq. 7)."""
    from foldc.backends.gluon.lower import gluon_plan
    from foldc.backends.triton.launch import triton_plan
    from foldc.layout_compile import kernel_plan

    spec = foldc.AttentionSpec(*heads, 128, foldc.Affine(2, "token", 128), foldc.Affine(4, "channel", 64))
    mine = kernel_plan(spec, "bf16", "gluon")
    assert mine == gluon_plan(spec, "bf16") and mine.rows_per_program == rows
    assert (mine.products["qk"].code_bias, mine.products["pv"].code_bias) == (0, 0)
    assert kernel_plan(spec, "bf16", "triton") == triton_plan(spec, "bf16") == kernel_plan(spec, "bf16")
    assert foldc.prove(mine) is not None


@pytest.mark.parametrize("heads,says", [("34/2", "32 rows in one program (15 of them padding)"),
                                        ("64/2", "32 rows in one program (docs"), ("64/4", None)])
def test_explain_names_the_warpgroup_template_where_it_runs(capsys, heads, says):
    """17 to 32 query rows per KV head at token-wise INT2 g128: explain's kernel paragraph says a contiguous cache
    runs the warpgroup template (and how many of its 32 rows are padding); 16 rows keep the one-warp program."""
    assert main(["explain", "--heads", heads, "--target", "sm_90"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert ("warpgroup template" in text) == (says is not None)
    if says:
        assert says in text


def test_explain_and_prove_take_a_target(capsys):
    """`foldc explain --target sm_90` renders the plan the register-operand kernel runs (no code bias, one row block's
    rows in the cost and the break-even: 17 rows per KV head in blocks of 9); `prove --target` proves that plan; a
    GEMM layout's plan has no target."""
    assert main(["explain", "--heads", "34/2", "--target", "sm_90"]) == 0
    out = capsys.readouterr().out
    assert "code bias (eq. 7)          | none" in out and "2*9/128" in out and "2*17/128" not in out
    assert "2 row blocks of 9 query rows per KV head (the last 8)" in " ".join(out.split())
    assert main(["explain", "--heads", "34/2"]) == 0
    out = capsys.readouterr().out
    assert "2*17/128" in out   # the reference plan: every query row of a KV head shares a tile
    assert main(["prove", "--heads", "34/2", "--target", "interpret"]) == 0
    assert "exact" in capsys.readouterr().out
    gemm = Path(__file__).resolve().parent.parent / "examples" / "layouts" / "gemm_int4_g128_gemv.toml"
    assert main(["explain", str(gemm), "--target", "sm_90"]) == 2
    assert "a GEMM layout's plan has no target" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["reference", "interpret"])
def test_an_empty_out_folder_exits_2_naming_the_flag(capsys, target):
    """``--out ""`` (an unset shell variable) was taken for no --out: the kernel source was not written, exit 0."""
    rc, out, err = _run(capsys, "compile", "--target", target, "--out", "")
    assert rc == 2 and out == ""
    assert err.startswith("foldc: error: ") and "--out=''" in err and err.count("\n") == 1


@pytest.mark.parametrize("layout", [["--k", "token:2:128", "--v", "channel:4:64", "--heads", "8/2"],
                                    [str(REPO / "examples" / "layouts" / "gemm_w8a8.toml")]], ids=["attention", "w8a8"])
def test_compile_reference_prints_the_plan_it_checks(capsys, layout):
    """`foldc compile --target reference` printed and proved the Triton kernel's bf16 plan (a code bias of 128 on the
    keys, -128 on both W8A8 operands), then checked the float64 executor, which runs the reference plan: the plan
    printed must be the one `foldc explain` gives without a target."""
    rc, ref, _ = _run(capsys, "explain", *layout)
    assert rc == 0
    rc, out, err = _run(capsys, "compile", *layout, "--target", "reference")
    assert rc == 0 and err == "" and "checked: float64 plan executor" in out
    assert out.startswith(ref), out[:2000]
