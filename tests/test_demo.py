"""`foldc demo` at a small size: the four layouts are planned, proved and executed, the seed's
table is regenerated, and every folded plan matches dequantize-then-compute at float64 level."""
from __future__ import annotations

import contextlib
import inspect
import io
import re
import types

import pytest

import foldc.demo
from foldc.demo import run_demo

LAYOUT_ROWS = ("K token-wise, V token-wise", "K token-wise, V channel-wise",
               "K channel-wise, V token-wise", "K channel-wise, V channel-wise")
# the explainer's table: (cache layout, product, fold, start of "where the scale goes")
SEED_ROWS = (
    ("token-wise K", "QK^T, sums over channels", "acc-fold", "each group's partial sum"),
    ("channel-wise K", "QK^T, sums over channels", "operand-fold", "the other operand: q x scale"),
    ("token-wise V", "PV, sums over tokens", "operand-fold", "the other operand: p x scale"),
    ("channel-wise V", "PV, sums over tokens", "acc-fold", "each group's partial sum"),
)
FOLDS = {LAYOUT_ROWS[0]: ("acc-fold", "operand-fold"), LAYOUT_ROWS[1]: ("acc-fold", "acc-fold"),
         LAYOUT_ROWS[2]: ("operand-fold", "operand-fold"), LAYOUT_ROWS[3]: ("operand-fold", "acc-fold")}
NUM = r"([0-9.]+(?:e[+-]\d+)?)"
ERROR_ROW = re.compile(rf"^(K \w+-wise, V \w+-wise)\s+(\S+)\s+(\S+)\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}s$")


@pytest.fixture(scope="module")
def demo():
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = run_demo(batch=1, tokens=200)
    return rc, buf.getvalue()


def _error_rows(text: str) -> dict[str, tuple]:
    rows = {}
    for line in text.splitlines():
        m = ERROR_ROW.match(line)
        if m:
            name, qk, pv, *nums = m.groups()
            assert name not in rows, f"two error rows for {name}"
            rows[name] = (qk, pv, *map(float, nums))
    return rows


def test_demo_succeeds(demo):
    rc, out = demo
    assert rc == 0, out
    assert out.startswith("foldc demo: 32 query heads / 8 KV heads, head_dim 128, INT2, groups of 128; "
                          "batch 1, 200 cached tokens (seed 0)")
    assert "OK: every folded plan matches dequantize-then-compute at float64 level" in out
    assert "FAILED" not in out


def test_demo_plans_and_proves_the_four_layouts(demo):
    _, out = demo
    for k_layout in ("token", "channel"):
        for v_layout in ("token", "channel"):
            header = f"plan for heads 32/8, head_dim 128, K {k_layout}:2:128, V {v_layout}:2:128"
            assert out.count(header) == 1, header
    assert out.count("  proof: exact (") == 4


def test_demo_prints_the_seed_table(demo):
    _, out = demo
    table = out.split("The explainer's table, regenerated from the plans:", 1)[1]
    found = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) == 6 and cells[1].endswith(("-wise K", "-wise V")):
            found.append(tuple(cells[1:5]))
        if line.startswith("Folded plan executed"):
            break
    assert len(found) == 4, table
    for (layout, product, fold, site), (w_layout, w_product, w_fold, w_site) in zip(found, SEED_ROWS):
        assert (layout, product, fold) == (w_layout, w_product, w_fold)
        assert site.startswith(w_site), site


def test_demo_errors_are_at_float64_level(demo):
    _, out = demo
    rows = _error_rows(out)
    assert set(rows) == set(LAYOUT_ROWS), out
    for name, (qk, pv, rel, max_abs, vs_exact, secs) in rows.items():
        assert (qk, pv) == FOLDS[name]
        assert 0 <= rel < 1e-10, f"{name}: rel L2 vs dequantized {rel}"
        assert 0 <= max_abs < 1e-10, f"{name}: max abs {max_abs}"
        # the INT2 quantization error itself is large: the comparison really used the quantized cache
        assert 0.05 < vs_exact < 5, f"{name}: vs exact {vs_exact}"
        assert secs >= 0


def test_demo_reports_failure(monkeypatch, capsys):
    """A plan result off by more than float64 rounding makes the demo print FAILED and return 1."""
    real_compile = foldc.demo.compile_attention

    def off_by_a_bit(spec, target="reference", **kw):
        attn = real_compile(spec, target=target, **kw)
        return lambda *a, **k: attn(*a, **k) * (1 + 1e-6)

    monkeypatch.setattr(foldc.demo, "compile_attention", off_by_a_bit)
    monkeypatch.setattr(foldc.demo, "prove", lambda p: types.SimpleNamespace(lemmas=[], instances=[]))
    # skip the generated-kernel section where the demo has one: only the float64 check is under test
    kwargs = {"kernels": False} if "kernels" in inspect.signature(run_demo).parameters else {}
    assert run_demo(batch=1, tokens=20, seed=1, **kwargs) == 1
    out = capsys.readouterr().out
    assert "FAILED: a folded plan differs from dequantize-then-compute" in out
    worst = float(re.search(r"\(worst ([0-9.e+-]+)\)", out).group(1))
    assert 1e-7 < worst < 1e-5
