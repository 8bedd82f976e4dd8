"""`foldc bench --layouts` (foldc/bench_layouts.py): the byte arithmetic, the table,
refusals, and a small end-to-end run of the checks under Triton's interpreter (CPU). The timing
itself needs a GPU: its test is skipped without one."""
from __future__ import annotations

import json
import math

import pytest
import torch

import foldc
from foldc import bench
from foldc import bench_layouts as bl
from foldc import layout_grid as lg
from foldc import cli

A = foldc.Affine


# --- bytes and speed ----------------------------------------------------------------------------

def test_bytes_of_int2_token_wise_by_hand():
    lay = lg.layout("token:2:128", "token:2:128")
    values = 8 * 8 * 65536 * 128                       # 536,870,912 per side
    side = values // 4 + (values // 128) * 2 * 2      # 2-bit codes; one fp16 scale and zero per 128 values
    assert side == 150_994_944
    q_out = 2 * 2 * 8 * 32 * 128                      # bf16 query and output
    assert bl.must_read(lay, 8, 65536) == 2 * side + q_out == 302_120_960
    assert bl.bf16_bytes(lay, 8, 65536) == 2 * 2 * values + q_out == 2_147_614_720
    enc = A(2, "token", 128)
    assert bl.must_read(lay, 8, 65536) == bench.must_read(enc, enc, 8, 65536)   # bench.py's 32/8/128 sum
    assert bl.bf16_bytes(lay, 8, 65536) == bench.must_read(None, None, 8, 65536)


def test_speed_figures_by_hand():
    lay = lg.layout("token:2:128", "token:2:128")
    got = bl.speed(lay, 8, 65536, us=100.0, cudnn_us=500.0, ceiling=4e12)
    assert got["bytes"] == 302_120_960 and got["bf16_bytes"] == 2_147_614_720
    assert got["pct_ceiling"] == pytest.approx(100 * 302_120_960 / 100e-6 / 4e12)   # 75.5%
    assert got["pct_ceiling"] == pytest.approx(75.53024)
    assert got["ideal"] == pytest.approx(2_147_614_720 / 302_120_960)              # 7.11x fewer bytes
    assert got["x_cudnn"] == 5.0
    assert got["x_ideal"] == pytest.approx(5.0 / (2_147_614_720 / 302_120_960))    # 0.70
    assert got["x_ideal"] == pytest.approx(0.703387, abs=1e-6)
    none = bl.speed(lay, 8, 65536, us=100.0, cudnn_us=None, ceiling=4e12)
    assert math.isnan(none["x_cudnn"]) and math.isnan(none["x_ideal"])


def test_bytes_of_a_partial_channel_group_fp32_scales_and_a_plain_side():
    lay = lg.layout("channel:4:64:fp32", "plain", 64, 2, 256)
    values = 1 * 2 * 100 * 256                         # 51,200
    k_side = values // 2 + 2 * (2 * 2 * 256) * 4      # 4-bit codes; ceil(100 / 64) = 2 groups per channel, fp32
    assert k_side == 33_792
    q_out = 2 * 2 * 1 * 64 * 256
    assert bl.must_read(lay, 1, 100) == k_side + 2 * values + q_out == 201_728
    assert bl.bf16_bytes(lay, 1, 100) == 4 * values + q_out == 270_336
    bf16_scales = lg.layout("token:2:32:bf16", "token:2:32:bf16", 32, 8, 64)
    values = 2 * 8 * 10 * 64
    assert bl.side_bytes(bf16_scales.k, 2, 8, 10, 64) == values // 4 + (values // 32) * 2 * 2 == 3_840


# --- bar, table, refusals -----------------------------------------------------------------------

def test_meets_bar_is_two_times_plain_attention():
    ok = {"unwritten": 0, "error": 2e-3, "plain_error": 1e-3}
    assert bl.meets_bar(ok)
    assert not bl.meets_bar({**ok, "error": 2.1e-3})
    assert not bl.meets_bar({**ok, "unwritten": 1})
    assert not bl.meets_bar({**ok, "error": float("nan")})
    assert bl.meets_bar({"unwritten": 0, "error": 1.1e-5, "plain_error": 1e-6})   # 2e-6 + the noise floor 1e-5
    assert not bl.meets_bar({"unwritten": 0, "error": 1.3e-5, "plain_error": 1e-6})
    # a row held to plain bf16 attention's error (the register-operand kernel's fp16 queries): bar_error rules
    fp16 = {"unwritten": 0, "error": 5e-4, "plain_error": 2e-4, "bar_error": 1.8e-3}
    assert bl.meets_bar(fp16) and not bl.meets_bar({**fp16, "bar_error": 2e-4})


def _check(kernel: str, error: float, plain: float) -> dict:
    row = {"kernel": kernel, "error": error, "plain_error": plain, "ratio": error / plain, "unwritten": 0}
    return {**row, "meets_bar": bl.meets_bar(row)}


def _results(rows: list) -> dict:
    for row in rows:
        row["status"] = bl.status(row)
    return {"gpu": "NVIDIA H200", "date": "2026-12-01", "torch": "2.11.0", "triton": "3.6.0", "grid": "timed",
            "target": "auto", "options": "default (no tuning cache)", "check_shape": [2, 16384],
            "time_shapes": [[8, 65536]], "ceiling_tb_s": 4.3, "rows": rows}


def test_table_formatting():
    lay = lg.layout("token:2:128", "token:2:128")
    timing = {"batch": 8, "tokens": 65536, "us": 100.0,
              **bl.speed(lay, 8, 65536, us=100.0, cudnn_us=500.0, ceiling=4.3e12)}
    good = {**lay.describe(), "timings": [timing],
            "checks": {"bf16": _check("GluonAttention", 2.0e-3, 2.5e-3), "fp16": _check("TritonAttention", 3e-4, 4e-4)}}
    over = {**lg.layout("token:8:32", "plain", 64, 2, 128).describe(), "timings": [],
            "checks": {"bf16": _check("TritonAttention", 6e-3, 2e-3), "fp16": {"refused": "PlanError: too big"}}}
    refused = {**lg.layout("token:2:128", "token:2:128", 32, 8, 64).describe(), "checks": {}, "timings": [],
               "status": "refused", "message": "SpecError: group_size=128 does not divide head_dim=64"}
    text = bl.format_table(_results([good, over, refused]))
    lines = text.splitlines()
    assert lines[0].startswith("NVIDIA H200, 2026-12-01, torch 2.11.0, triton 3.6.0; grid timed (3 layouts)")
    assert "ceiling 4.30 TB/s" in lines[1] and "x ideal = x cuDNN / (bf16 bytes / ours)" in lines[1]
    assert "at 2 x 16384 tokens, ragged lengths" in lines[2] and "bar: <= 2x" in lines[2]
    assert ("| K | V | GQA | head_dim | shape | kernel | µs | % ceiling | x cuDNN | x ideal | err bf16 | err fp16 "
            "| bar |") in lines
    assert ("| token:2:128 | token:2:128 | 32/8 (4) | 128 | 8x65536 | GluonAttention (fp16: TritonAttention) | "
            "100.0 | 70 | 5.00 | 0.70 | 2.0e-03 (0.80x) | 3.0e-04 (0.75x) | yes |") in lines
    assert ("| token:8:32 | plain | 64/2 (32) | 128 | - | TritonAttention | - | - | - | - | 6.0e-03 (3.00x) | "
            "refused | NO |") in lines
    assert not any(line.startswith("| token:2:128 | token:2:128 | 32/8 (4) | 64 |") for line in lines)
    assert "3 layouts: 1 meet the bar, 1 over it, 1 refused, 0 failed" in lines
    assert "8x65536: 1 of 1 timed layouts at >= 60% of the ceiling" in lines   # 70%
    assert "8x65536: slower than cuDNN: none" in lines
    at = lines.index("refused:")
    assert lines[at + 1:at + 3] == [
        "- K token:8:32 V plain 64/2 d128: fp16 queries: PlanError: too big",
        "- K token:2:128 V token:2:128 32/8 d64: SpecError: group_size=128 does not divide head_dim=64"]
    assert "failed:" not in lines


def test_target_lines_name_the_layouts_below_each_bar():
    """The share of the ceiling counts at batch x tokens >= 512K only, the cuDNN bar at >= 16K tokens only."""
    def row(k, us, cudnn_us, batch, tokens, heads=(32, 8)):
        lay = lg.layout(k, k, *heads)
        t = {"batch": batch, "tokens": tokens, "us": us, **bl.speed(lay, batch, tokens, us, cudnn_us, 4.3e12)}
        return {**lay.describe(), "timings": [t], "checks": {}}
    fast, slow = row("token:2:128", 100.0, 480.0, 8, 65536), row("token:2:128", 300.0, 250.0, 8, 65536, (64, 2))
    pct = slow["timings"][0]["pct_ceiling"]
    results = {"time_shapes": [[8, 65536]], "rows": [fast, slow]}
    assert bl.target_lines(results) == [
        "", f"8x65536: 1 of 2 timed layouts at >= 60% of the ceiling; below: {slow['label']} ({pct:.0f}%)",
        f"8x65536: slower than cuDNN: {slow['label']} (0.83x)"]
    small = {"time_shapes": [[1, 4096], [1, 16384]],
             "rows": [row("token:2:128", 20.0, 16.0, 1, 4096), row("token:2:128", 20.0, 30.0, 1, 16384)]}
    assert bl.target_lines(small) == ["", "1x16384: slower than cuDNN: none"]   # 1 x 4K: below both bars' shapes
    assert bl.target_lines({"time_shapes": [], "rows": [fast]}) == []


def test_status_of_partial_refusals_and_failures():
    base = lg.layout("token:2:128", "token:2:128").describe()
    status = lambda checks, timings=(): bl.status({**base, "checks": checks, "timings": list(timings)})  # noqa: E731
    ok = _check("TritonAttention", 1e-3, 1e-3)
    assert status({"bf16": {"refused": "x"}, "fp16": {"refused": "y"}}) == "refused"
    assert status({"bf16": {"failed": "x"}, "fp16": ok}) == "failed"
    assert status({"fp16": ok}, [{"batch": 1, "tokens": 2, "failed": "OOM"}]) == "failed"
    assert status({"bf16": {"refused": "x"}, "fp16": ok}) == "ok"     # one dtype refused, the other meets the bar
    assert status({"bf16": _check("GluonAttention", 3e-3, 1e-3), "fp16": ok}) == "over bar"


def test_a_layout_foldc_refuses_is_reported_not_raised():
    run = bl.Run("interpret", (2, 80))
    row = bl.run_layout(lg.layout("token:2:128", "channel:2:128", 32, 8, 64), run)
    assert row["status"] == "refused" and "group_size=128 does not divide" in row["message"]
    assert row["message"].startswith("SpecError: ")


def test_a_crash_is_reported_as_failed(monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("boom\nsecond line")
    monkeypatch.setattr(foldc, "compile", boom)
    row = bl.run_layout(lg.layout("token:2:128", "token:2:128"), bl.Run("interpret", (2, 80)))
    assert row["status"] == "failed" and row["message"] == "RuntimeError: boom"


def test_without_tuning_cache_points_the_cache_at_an_empty_folder():
    import os

    from foldc.backends.runtime.tuning import cache_path, load_cache

    before = os.environ.get("FOLDC_CACHE_DIR")
    with bl.without_tuning_cache() as folder:
        assert str(cache_path()).startswith(folder) and load_cache() == {}
    assert os.environ.get("FOLDC_CACHE_DIR") == before


# --- the command line ---------------------------------------------------------------------------

def test_bench_dispatches_layouts_and_lists_the_grid(capsys):
    assert cli.main(["bench", "--layouts", "--grid", "quick", "--list"]) == 0
    labels = capsys.readouterr().out.split("\n")
    assert labels[:2] == ["K token:2:128 V token:2:128 32/8 d128", "K token:2:128 V channel:2:128 32/8 d128"]
    assert len([line for line in labels if line]) == 6


def test_without_a_gpu_it_says_so_and_fails(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "--layouts", "--grid", "quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "--check-only --target interpret" in err
    assert not (tmp_path / "layouts.json").exists()


@pytest.mark.parametrize("argv,wanted", [
    (["--target", "interpret"], "add --check-only"),
    (["--only", "INT3"], "--only='INT3' matches no layout"),
    (["--shapes", "8by4096"], "--shapes="),
    (["--check-only", "--check-shape", "0x16"], "--check-shape="),
    (["--check-only", "--jobs", "0"], "--jobs=0: give at least 1"),
    (["--grid", "quick", "--jobs", "4"], "--jobs=4 checks only"),
])
def test_bad_arguments_are_refused(argv, wanted, capsys):
    with pytest.raises(SystemExit) as info:
        bl.main(argv)
    assert info.value.code == 2 and wanted in capsys.readouterr().err



def test_check_shape_takes_one_shape(monkeypatch, tmp_path, capsys):
    """--check-shape 2x80,4x96 checked at 2x80 and dropped 4x96, silently; it exits 2 naming the flag now."""
    ran = []
    monkeypatch.setattr(bl, "run_grid", lambda *args: ran.append(args[3]) or {"rows": []})
    monkeypatch.setattr(bl, "format_table", lambda results: "")
    argv = ["--check-only", "--target", "interpret", "--only", "K token:2:128 V token:2:128 32/8", "--out",
            str(tmp_path), "--check-shape"]
    with pytest.raises(SystemExit) as info:
        bl.main([*argv, "2x80,4x96"])
    assert info.value.code == 2 and "--check-shape='2x80,4x96': give one BATCHxTOKENS" in capsys.readouterr().err
    assert not ran
    assert bl.main([*argv, "4x96"]) == 0 and ran == [(4, 96)]

@pytest.mark.parametrize("jobs", [1, 2])
def test_check_only_under_the_interpreter_end_to_end(tmp_path, capsys, jobs):
    """Three layouts of the full grid through `foldc bench --layouts --check-only --target interpret`:
    a refused one (groups of 128 over head_dim 64), GQA 1 with mixed sides, and a plain V side; one after
    another and in two worker processes (the rows in the grid's order either way)."""
    only = "K token:2:128 V token:2:128 32/8 d64,K channel:4:64 V token:4:64 8/8 d128,K token:2:32 V plain 32/8 d128"
    rc = cli.main(["bench", "--layouts", "--grid", "full", "--check-only", "--target", "interpret", "--only", only,
                     "--out", str(tmp_path), "--jobs", str(jobs)])
    assert rc == 0
    results = json.loads((tmp_path / "layouts.json").read_text())
    assert results["target"] == "interpret" and results["check_shape"] == [2, 80] and results["time_shapes"] == []
    rows = {row["label"]: row for row in results["rows"]}
    assert list(rows) == [lay.label for lay in lg.pick(lg.grid("full"), only.split(","))]   # the grid's order
    assert sorted(rows) == sorted(only.split(","))
    refused = rows["K token:2:128 V token:2:128 32/8 d64"]
    assert refused["status"] == "refused" and "does not divide" in refused["message"]
    for label in only.split(",")[1:]:
        row = rows[label]
        assert row["status"] == "ok" and list(row["checks"]) == ["fp16"] and row["timings"] == []
        fp16 = row["checks"]["fp16"]
        assert fp16["kernel"] == "TritonAttention" and fp16["unwritten"] == 0 and fp16["meets_bar"]
        assert 0 < fp16["error"] <= 2 * fp16["plain_error"] + bl.ERROR_FLOOR
    assert rows[only.split(",")[2]]["checks"]["fp16"]["folds"]["pv"] == "none"
    table = (tmp_path / "layouts.txt").read_text()
    assert "3 layouts: 2 meet the bar, 0 over it, 1 refused, 0 failed" in table
    assert "- K token:2:128 V token:2:128 32/8 d64: SpecError: group_size=128 does not divide" in table
    assert "| channel:4:64 | token:4:64 | 8/8 (1) | 128 | - | TritonAttention |" in table
    assert table in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times kernels: needs a CUDA GPU")
def test_one_layout_timed_on_the_gpu(tmp_path):
    rc = bl.main(["--grid", "quick", "--only", "K token:2:128 V token:2:128 32/8 d128", "--shapes", "1x4096",
                  "--check-shape", "1x1024", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "layouts.json").read_text())
    row = results["rows"][0]
    assert rc == 0 and row["status"] == "ok" and set(row["checks"]) == {"bf16", "fp16"}
    timing = row["timings"][0]
    assert timing["us"] > 0 and timing["bytes"] == bl.must_read(lg.grid("quick")[0], 1, 4096)
    assert timing["error"] < 1e-2 and results["ceiling_tb_s"] > 0


def test_the_ceiling_of_a_timed_run_is_the_fastest_read_in_it(monkeypatch, tmp_path):
    """layout_grid_h200.json: cuDNN read at 103% of the streaming read at 8 x 64K, so the layouts' % of that read
    were 3% too high. With the kernels and cuDNN faked (CPU), the run's ceiling is cuDNN's rate, every timing's %
    is of it (the first layout's too, timed before cuDNN raised it), and the table says so."""
    stream = 4.0e12
    lays = [lg.layout("token:2:128", "token:2:128"), lg.layout("token:4:128", "token:4:128")]
    cudnn_us = bl.bf16_bytes(lays[0], 8, 65536) / 4.4e12 * 1e6     # cuDNN at 4.4 TB/s: 110% of the streaming read
    ours_us = {lay.label: bl.must_read(lay, 8, 65536) / 3.2e12 * 1e6 for lay in lays}   # both layouts at 3.2 TB/s

    monkeypatch.setattr(bench, "stream_read_ceiling", lambda: stream)
    monkeypatch.setattr(bench, "peers", lambda: {"sdpa cudnn bf16": None})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(foldc, "compile", lambda spec, target: object())
    monkeypatch.setattr(bl, "check", lambda *a: {**_check("GluonAttention", 1e-3, 1e-3), "bar_dtype": "bf16",
                                                 "batch": 2, "tokens": 80, "folds": None})
    labels = {lay.spec(): lay.label for lay in lays}
    monkeypatch.setattr(bl, "time_kernel", lambda attn, spec, b, n, seed: {
        "batch": b, "tokens": n, "us": ours_us[labels[spec]], "us_eager": 1.0, "us_graph": None, "error": 1e-3})
    monkeypatch.setattr(bl, "time_cudnn", lambda make, lay, b, n: {"us": cudnn_us, "us_eager": cudnn_us,
                                                                   "us_graph": None})
    results = bl.run_grid(lays, tmp_path, check_shape=(2, 80), time_shapes=((8, 65536),))
    assert results["stream_read_tb_s"] == pytest.approx(4.0) and results["ceiling_tb_s"] == pytest.approx(4.4)
    for row in results["rows"]:
        assert row["timings"][0]["pct_ceiling"] == pytest.approx(100 * 3.2 / 4.4)   # 72.7%, not 80%
    assert json.loads((tmp_path / "layouts.json").read_text())["ceiling_tb_s"] == pytest.approx(4.4)
    assert "ceiling 4.40 TB/s (the faster of a streaming read, 4.00 TB/s" in (tmp_path / "layouts.txt").read_text()
