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
