"""`foldc bench` argument checks (the benchmark itself needs a GPU; it runs on the H200 only)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foldc import bench


def test_kernels_filter_that_matches_no_row_names_the_rows(capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["--kernels", "INT3 KtVt"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--kernels='INT3 KtVt' matches no row" in err and "fold INT2 KtVt g128" in err


@pytest.mark.parametrize("shapes", ["8by4096", "0x4096", "8x"])
def test_bad_shapes_are_refused(shapes, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--shapes", shapes])
    assert "--shapes=" in capsys.readouterr().err


def test_kernels_filter_takes_an_exact_label_alone():
    assert bench.selects("fold INT2 KtVt g128", "fold INT2 KtVt g128")
    assert not bench.selects("fold INT2 KtVt g128", "fold INT2 KtVt g128 (triton)")
    assert bench.selects("KtVt g128", "fold INT2 KtVt g128 (triton)")


def test_decode_case_gives_the_specs_shapes_and_repeats_with_its_seed(tmp_path):
    """The sweeps' shared inputs (benchmarks/*_sweep.py, ab_kernel.py): fresh normals, quantized
    with each side's own encoding, the same for the same seed."""
    import json

    import torch

    import foldc

    spec = foldc.AttentionSpec(8, 2, 64, foldc.Affine(2, "token", 64), foldc.Affine(4, "channel", 32))
    q, k, v = bench.decode_case(spec, 2, 96, seed=5, device="cpu")
    assert q.shape == (2, 8, 64) and q.dtype == torch.bfloat16 and q.abs().sum() > 0
    assert k.encoding == spec.k and v.encoding == spec.v and k.codes.shape[:3] == (2, 2, 96)
    q2, k2, _ = bench.decode_case(spec, 2, 96, seed=5, device="cpu")
    assert torch.equal(q, q2) and torch.equal(k.codes, k2.codes)
    assert not torch.equal(q, bench.decode_case(spec, 2, 96, seed=6, device="cpu")[0])
    bench.save_rows([{"a": 1}], str(tmp_path / "rows.json"))
    assert json.loads((tmp_path / "rows.json").read_text()) == [{"a": 1}]


def test_ncu_stall_summary_reads_the_per_instruction_table(tmp_path):
    """foldc.profiling (benchmarks/ncu_stalls.py prints it): shares of each stall reason over all
    samples, with the opcodes (predicates and modifiers stripped) that carry them, from ncu's
    source-page CSV."""
    import csv

    from foldc import profiling as module
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
              "L1 Wavefronts Shared Excessive", "stall_wait", "stall_long_sb", "stall_long_sb (Not Issued)"]
    table = [["0x0", "  LOP3.LUT R1, R2, 0x3, R4, 0xea, !PT", "6", "100", "0", "6", "0", "0"],
             ["0x10", "@!P1 LDG.E.U16 R5, desc[UR4][R6.64]", "1", "10", "0", "0", "1", "1"],
             ["0x20", "  IMAD.MOV.U32 R7, RZ, RZ, 0x4", "3", "10", "0", "0", "3", "3"],
             ["0x30", "  LDS R8, [R9]", "0", "20", "12", "0", "0", "0"]]
    out = tmp_path / "t.csv"
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "k"])
        w.writerow(header)
        w.writerows(table)
    text = module.summarize(str(out))
    assert "10 samples" in text
    assert "stall_wait              60.0%   LOP3 60.0%" in text
    assert "stall_long_sb           40.0%   IMAD 30.0%, LDG 10.0%" in text
    assert "LOP3 71.4%" in text and "LDS 12" in text


def test_gluon_call_parts_make_a_whole_decode_launch():
    """The pieces benchmarks launch by hand: every kernel argument given once, a grid of (batch, head
    groups, splits) and a workspace per split (resident programs fixed: no GPU to compile on)."""
    import torch

    import foldc
    from foldc.backends.gluon.kernel import foldc_decode_gluon
    from foldc.backends.gluon.launch import GluonAttention
    from foldc.testing import random_inputs

    enc = foldc.Affine(2, "token", 128)
    spec = foldc.AttentionSpec(32, 8, 128, enc, enc)
    attn = GluonAttention(spec)
    attn.resident = lambda *args, **kwargs: 12
    q, k, v, _ = random_inputs(spec, 3, 1000, torch.bfloat16, "cpu", torch.Generator().manual_seed(1))
    parts = bench.gluon_call_parts(attn, q, k, v, 0.1)
    assert parts["grid"] == (3, 8 // parts["launch"]["heads"], parts["splits"])
    assert parts["splits"] * parts["per_split"] >= 1000 > (parts["splits"] - 1) * parts["per_split"]
    assert parts["ws"][2].shape[:3] == (3, 8 // parts["launch"]["heads"], parts["splits"])
    named = set(foldc_decode_gluon.arg_names[:len(parts["args"])]) | set(parts["kwargs"])
    # every parameter but MERGE, which a call that merges in the merge kernel leaves at its default
    assert named - {"num_warps", "maxnreg"} == set(foldc_decode_gluon.arg_names) - {"MERGE"}


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n_shapes=st.integers(1, 5))
def test_the_plot_gives_each_kernel_its_colour_peers_dashed_and_the_speedup_panel(tmp_path_factory, seed, n_shapes):
    """Rows as `run_bench` writes them (random figures): every kernel its own colour, peers dashed and
    foldc solid in the upper panel; the lower panel holds each foldc kernel's speed-up over cuDNN."""
    import random

    rng = random.Random(seed)
    names = [r[0] for r in bench.kernel_list(False)] + ["sdpa cudnn bf16", "sdpa flash bf16", "flashinfer bf16"]
    shapes = bench.GRID[:n_shapes]
    rows = []
    for b, t in shapes:
        for name in names:
            rows.append({"batch": b, "tokens": t, "kernel": name, "pct_ceiling": rng.uniform(5, 99),
                         "x_sdpa cudnn bf16": rng.uniform(0.3, 6)})
    path = tmp_path_factory.mktemp("plot") / "bench.png"
    fig = bench.plot({"rows": rows, "gpu": "H200", "date": "2026-12-02"}, path)
    top, bottom = fig.axes
    lines = {line.get_label(): line for line in top.get_lines() if not line.get_label().startswith("_")}
    assert set(lines) == set(names)
    assert len({tuple(line.get_color()) for line in lines.values()}) == len(names)   # one colour per kernel
    for name, line in lines.items():
        assert line.get_linestyle() == ("--" if name.startswith(("sdpa", "flashinfer")) else "-"), name
    speedups = {line.get_label(): line for line in bottom.get_lines() if not line.get_label().startswith("_")}
    assert set(speedups) == {n for n in names if not n.startswith(("sdpa", "flashinfer"))}
    want = [r["x_sdpa cudnn bf16"] for r in rows if r["kernel"] == names[0]]
    assert list(speedups[names[0]].get_ydata()) == want
    assert any(list(line.get_ydata()) == [1.0, 1.0] for line in bottom.get_lines())   # the bar at 1.0
    assert path.stat().st_size > 0
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_the_table_reports_host_time_beside_eager_and_graph_time():
    row = {"batch": 1, "tokens": 16384, "kernel": "fold INT2 KtVt g128", "us": 14.2, "us_eager": 84.7,
           "us_graph": 14.2, "us_host": 61.0, "pct_ceiling": 16.0, "x_sdpa cudnn bf16": 2.28, "error": 1.7e-3}
    text = bench.format_table({"gpu": "H200", "date": "2026-12-02", "torch": "2.11", "ceiling_tb_s": 4.3,
                               "rows": [row]})
    header, _, line = text.strip().splitlines()[1:4]
    cells = dict(zip([c.strip() for c in header.strip("|").split("|")], [c.strip() for c in line.strip("|").split("|")]))
    assert (cells["us"], cells["eager us"], cells["host us"], cells["x cuDNN"]) == ("14.2", "84.7", "61.0", "2.28")


@pytest.mark.parametrize("argv", [["--gemm", "--cpu", "--deadline", "1"],
                                  ["--layouts", "--check-only", "--target", "interpret", "--only", "K token:2:128 V "
                                   "token:2:128 32/8"],
                                  ["--serving", "--dry-run"],
                                  ["--serving", "--dry-run", "--parts", "correctness,bogus"]])
def test_an_out_that_is_a_file_or_an_unknown_part_is_a_usage_error_before_anything_runs(argv, tmp_path, capsys):
    """A file given as --out raised FileExistsError from the first mkdir (a traceback); an unknown
    --serving part stopped the run only after the parts before it had run."""
    from foldc.cli import main

    taken = tmp_path / "taken"
    taken.write_text("x")
    with pytest.raises(SystemExit) as info:
        main(["bench", *argv, "--out", str(taken)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert ("unknown part(s) ['bogus']" if "bogus" in argv[-1] else "is not a writable folder") in err


def test_a_rebound_kernel_keeps_the_decorators_unspecialised_arguments():
    """A benchmark's variant of the decode kernel must still take ``cache_tokens`` per call (bound launches give
    it per call: a specialised copy is refused at launch)."""
    pytest.importorskip("triton.experimental.gluon")
    import foldc.backends.gluon.kernel as kernel

    copy = bench.rebound(kernel.foldc_decode_gluon)
    assert copy is not kernel.foldc_decode_gluon
    unspecialised = [p.name for p in copy.params if p.do_not_specialize]
    assert unspecialised == [p.name for p in kernel.foldc_decode_gluon.params if p.do_not_specialize]
    assert unspecialised == ["cache_tokens"]


# --- the byte count and the ceiling of the run (the metrics audit of 2026-12) ----------------------

@pytest.mark.parametrize("text,tokens", [("channel:2:128", 300), ("channel:4:64:fp32", 100), ("token:2:32:bf16", 96),
                                         ("channel:8:128", 4096), ("token:4:128", 77)])
def test_cache_bytes_are_the_bytes_quantize_stores(text, tokens, monkeypatch):
    """A partial last channel-wise group is a whole group of scales and zeros in the cache: `cache_bytes` counted
    values // group_size groups (300 tokens in groups of 128: 2 groups where the cache holds 3, 3% too few bytes)."""
    import torch

    import foldc
    from foldc.encoding import parse_affine

    monkeypatch.setattr(bench, "KV_HEADS", 2)
    enc = parse_affine(text)
    stored = foldc.quantize(torch.randn(3, 2, tokens, bench.HEAD_DIM), enc)
    assert bench.cache_bytes(enc, 3, tokens) == sum(t.numel() * t.element_size()
                                                    for t in (stored.codes, stored.scale, stored.zero))
    assert bench.cache_bytes(None, 3, tokens) == 3 * 2 * tokens * bench.HEAD_DIM * 2


def test_the_ceiling_of_a_run_is_never_below_a_rate_the_run_reached():
    """bench_h200_2026-12-04: cuDNN bf16 read 8.59 GB in 1839.4 µs (4.67 TB/s, '108%') against a streaming read of
    4.31 TB/s, so every row's % of that 'ceiling' was 8% too high. The run's ceiling is the faster of the two now."""
    stream = 4.31e12
    cudnn = (8_590_000_000, 1839.4)
    assert bench.run_ceiling(stream, [cudnn, (1e9, 1e3), (1e9, None)]) == pytest.approx(8.59e9 / 1839.4e-6)
    assert bench.run_ceiling(stream, [(1e9, 1e3)]) == stream          # every row slower: the streaming read
    assert bench.run_ceiling(float("nan"), [(1e9, 1e3)]) == 1e12
    results = {"rows": [{"bytes": 1_000_000_000, "us": 250.0}, {"bytes": 8_590_000_000, "us": 1839.4}]}
    bench.set_ceiling(results, stream)
    assert results["stream_read_tb_s"] == pytest.approx(4.31)
    assert results["ceiling_tb_s"] == pytest.approx(4.67, abs=0.01)
    assert results["rows"][1]["pct_ceiling"] == pytest.approx(100.0)    # not 108
    assert results["rows"][0]["pct_ceiling"] == pytest.approx(100 * 4.0 / 4.67, abs=0.1)   # 85.6%, not 92.8%
    table = bench.format_table({"gpu": "H200", "date": "d", "torch": "t", **results,
                                "rows": [{**r, "batch": 1, "tokens": 2, "kernel": "k", "error": 0.0}
                                         for r in results["rows"]]})
    assert "ceiling 4.67 TB/s (the faster of a streaming read, 4.31 TB/s" in table


def test_an_sdpa_peer_selects_its_backend_once_around_a_measurement_not_in_each_call(monkeypatch):
    """The cuDNN peer entered torch's sdpa_kernel context inside every call: about 10 µs of host time a call (this
    CPU: 11), which 'cuDNN host µs' counted against foldc's (docs/perf.md: foldc's host time 0.66-1.04x cuDNN's). The
    backend is selected once around the measurement now, and a call outside it raises rather than let SDPA choose."""
    import torch
    import torch.nn.attention as attention

    entered = []
    real = attention.sdpa_kernel

    def counting(*args, **kwargs):
        entered.append(args)
        return real(*args, **kwargs)
    monkeypatch.setattr(attention, "sdpa_kernel", counting)
    q = torch.randn(1, 4, 16)
    k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    run = bench.sdpa_peer(attention.SDPBackend.MATH)(q, k, v)
    with pytest.raises(RuntimeError, match="selected"):
        run()
    with bench.selected(run):
        outs = [run() for _ in range(5)]
    assert len(entered) == 1 and outs[0].shape == (1, 4, 16)
    with bench.selected(lambda: None):   # a call with no backend to select (FlashInfer's)
        pass


@pytest.mark.parametrize("argv,flag", [(["--shapes", ""], "--shapes"), (["--kernels", " , "], "--kernels"),
                                       (["--layouts", "--check-only", "--target", "interpret", "--only", ""], "--only"),
                                       (["--layouts", "--shapes", ","], "--shapes"),
                                       (["--layouts", "--check-only", "--target", "interpret", "--check-shape", ""],
                                        "--check-shape"),
                                       (["--serving", "--dry-run", "--parts", ""], "--parts"),
                                       (["--serving", "--dry-run", "--batches", ""], "--batches")])
def test_an_empty_list_flag_is_a_usage_error_not_its_default(argv, flag, tmp_path, capsys):
    """An empty comma-separated flag (an unset shell variable: --only "$LAYOUT") was taken for the flag left out:
    --only '' checked the whole grid, --shapes '' timed every shape, --batches '' ran the default batches, and
    --parts '' ran no part, exited 0 and said it wrote reports it never wrote. Each exits 2 naming the flag now,
    before anything runs or is made."""
    from foldc.cli import main

    with pytest.raises(SystemExit) as info:
        main(["bench", *argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"{flag}=" in err and "is empty" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
