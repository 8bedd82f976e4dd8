"""`gemm_explain_table(plan)`: what ``foldc explain`` prints for a GEMM layout, one column per
encoded operand (the weight w, the activation x), one row per decision."""
from __future__ import annotations

from ..explain import _issue_text, _table


def _cost(p) -> str:
    return (f"fold 2*h/g = 2*{p.rows_per_group}/{p.group_size} = {float(p.fold_ops_per_value):.4g} scale+offset "
            "ops per stored value; per-value reconstruction 1 (eq. 16)")


def gemm_explain_table(plan) -> str:
    spec = plan.spec
    ops = list(plan.operands.values())
    names = {"w": "w [n, k] (weight)", "x": "x [m, k] (activation)"}
    fields = [
        ("operand", lambda p: names[p.operand]),
        ("encoding", lambda p: f"{p.encoding}: {p.bits}-bit codes, one (scale, zero) per "
         + (f"{p.group_size} k" if p.group_size < spec.k else f"row (the whole k = {spec.k})")),
        ("fold", lambda p: p.fold + (f": {p.reason}" if p.reason and p.fold != "dequant" else
                                     " (the fold does not pay here, see break-even)" if p.fold == "dequant" else "")),
        ("scale goes to", lambda p: p.scale_site),
        ("correction term", lambda p: p.correction),
        ("code bias (eq. 7)", lambda p: f"{p.code_bias} folded into the zero" if p.code_bias else "none"),
        ("tiling constraint", lambda p: "\n".join(str(c).split(": ", 1)[1] for c in plan.constraints) or "-"),
        ("cost (eq. 16)", _cost),
        ("break-even", lambda p: p.break_even or "-"),
        ("issue budget (eq. 13)", _issue_text),
    ]
    rows = [[label] + [fn(p) for p in ops] for label, fn in fields]
    m = "m symbolic" if spec.m is None else f"m = {spec.m}"
    head = (f"foldc plan: y = x . w^T, {m}, n = {spec.n}, k = {spec.k} "
            f"(rows sharing one weight tile h = {spec.rows_per_tile})")
    return head + "\n" + _table(["", *[p.operand for p in ops]], rows)
