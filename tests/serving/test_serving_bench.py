"""`foldc bench --serving` (foldc/serving/bench.py, what the H200 run uses) works end to end on the CPU: its
--dry-run mode runs the correctness part with tiny shapes under Triton's interpreter, every check
passes, and the JSON and Markdown reports are written."""
from __future__ import annotations

import json

import pytest

from foldc import cli
from foldc.serving import bench


def test_serving_bench_dry_run_checks_pass_and_reports_are_written(tmp_path, capsys):
    code = bench.main(["--dry-run", "--out", str(tmp_path), "--parts", "correctness"])
    results = json.loads((tmp_path / "serving.json").read_text())
    rows = results["correctness"]["rows"]
    assert code == 0 and rows and all(r["pass"] for r in rows), [r for r in rows if not r["pass"]]
    assert {r["check"] for r in rows} >= {"append (paged, ragged counts)", "paged decode vs float64",
                                          "PagedKVCache == QuantizedKVCache"}
    assert "a. correctness" in (tmp_path / "serving.md").read_text()
    assert "| check" in capsys.readouterr().out


@pytest.mark.parametrize("budget", ["-5", "0", "nan"])
def test_a_budget_that_is_not_a_positive_number_exits_2(tmp_path, capsys, budget):
    """--budget-s -5 (or 0) skipped every part, printed 'wrote serving.json and serving.md' (neither was written) and
    exited 0; NaN was never spent. Both exit 2 naming the flag now, before anything runs."""
    with pytest.raises(SystemExit) as done:
        cli.main(["bench", "--serving", "--dry-run", "--budget-s", budget, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert done.value.code == 2 and f"--budget-s={float(budget):g}" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()



@pytest.mark.parametrize("flags", [["--prompt", "0"], ["--new-tokens", "0"], ["--prompt", "0", "--new-tokens", "3"],
                                   ["--prompt", "-2"], ["--batches", "1,0"]])
def test_a_prompt_or_new_tokens_of_0_exits_2(tmp_path, capsys, monkeypatch, flags):
    """--prompt 0 (or --new-tokens 0) was read as the flag left out: the throughput part ran its default 48 (4096 on
    a GPU) prompt tokens, silently; a negative one exited 2 after the --out folder was made. Both exit 2 naming the
    flags now, before anything runs or is made."""
    ran = []
    monkeypatch.setattr(bench, "PARTS", {"throughput": lambda c: ran.append((c.prompt, c.new)) or ([], "")})
    with pytest.raises(SystemExit) as done:
        bench.main(["--dry-run", "--parts", "throughput", "--out", str(tmp_path / "out"), *flags])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "must be" in err and "Traceback" not in err, err
    assert not ran and not (tmp_path / "out").exists()
    assert bench.main(["--dry-run", "--parts", "throughput", "--out", str(tmp_path / "ok"), "--prompt", "5",
                       "--new-tokens", "1"]) == 0
    assert ran == [(5, 1)]

def test_the_sdpa_baseline_reads_each_kv_head_once(monkeypatch):
    """`--parts paged_kernel`'s bf16 SDPA ran SDPA's default backend over K and V repeated to the query heads (4x the
    bytes at 32/8 heads; 123 µs at 8 x 4K on the H200, where `foldc bench`'s cuDNN peer took 48): the baseline is that
    peer now, SDPA with enable_gqa over the KV heads (cuDNN alone on a GPU), and computes grouped-query attention."""
    import torch

    import foldc

    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        seen.append((tuple(k.shape), kwargs.get("enable_gqa")))
        return sdpa(q, k, v, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 64, generator=gen)
    k, v = (torch.randn(2, 2, 40, 64, generator=gen) for _ in range(2))
    run = bench.sdpa_baseline(q, k, v)
    with run.selected():
        got = run()
    assert seen == [((2, 2, 40, 64), True)]
    assert torch.allclose(got.double(), foldc.attention_reference(q, k, v), atol=1e-5)
