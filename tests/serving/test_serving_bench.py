"""`foldc bench --serving` (foldc/serving/bench.py, what the H200 run uses) works end to end on the CPU: its
--dry-run mode runs the correctness part with tiny shapes under Triton's interpreter, every check
passes, and the JSON and Markdown reports are written."""
from __future__ import annotations

import json

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
