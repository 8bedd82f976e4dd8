"""Human-readable views of a plan: `plan_summary` (what ``str(plan)`` prints) and
`explain_table` (what ``foldc explain`` prints): one column per product, one row per decision."""
from __future__ import annotations

import textwrap

from .cost import lane_slots_per_byte
from .decisions import FoldKind

SEED_TABLE_HEADER = ("cache layout", "product (sums over)", "fold", "where the scale goes")


def scale_text(p) -> str:
    """The scale site's text; "-" for a plain operand."""
    return "-" if p.scale_site is None else str(p.scale_site)


def correction_text(p) -> str:
    """The correction term's text ("MISSING" where a folded product lacks it); "-" for a plain
    operand, and for dequant the note that the zero is applied per value."""
    if p.correction is not None:
        return str(p.correction)
    return "-" if p.encoded is None else "none (zero applied per value)"


def lands_text(p) -> str:
    return "-" if p.lands_before is None else str(p.lands_before)


def plan_summary(plan) -> str:
    lines = [f"plan for {plan.spec.describe()}"]
    for name, p in plan.products.items():
        lines.append(f"  {name}: {p.fold:<12} scale -> {scale_text(p)}; correction: {correction_text(p)}")
    for c in plan.constraints:
        lines.append(f"  tiling: {c}")
    return "\n".join(lines)


def _encoding_text(p, spec) -> str:
    enc = spec.k if p.product == "qk" else spec.v
    if enc is None:
        return f"%{'k' if p.product == 'qk' else 'v'} plain (no encoding)"
    return (f"%{p.encoded} {enc.short()}: {enc.bits}-bit codes, one (scale, zero) per {enc.group_size} "
            f"{p.group_axis}s")


def _fold_text(p) -> str:
    if p.fold is FoldKind.DEQUANT:
        return f"dequant: the fold does not pay here (see break-even); by the axes alone: {p.reason}"
    return f"{p.fold}" + (f": {p.reason}" if p.reason else "")


def _cost_text(p) -> str:
    if p.fold is FoldKind.NONE:
        return "-"
    h, g = p.rows_per_group, p.group_size
    return (f"fold 2*h/g = 2*{h}/{g} = {float(p.fold_ops_per_value):.4g} scale+offset ops per stored value; "
            "per-value reconstruction 1")


def _issue_text(p) -> str:
    if p.fold is FoldKind.NONE:
        return "-"
    rows = []
    for v in p.issue:
        dq = lane_slots_per_byte(v.gpu.arch, "dequant", p.bits, 0)
        rows.append(f"{v.gpu.name}: {v.demand:.2f} of {v.budget:.2f} lane-slots/byte "
                    f"({100 * v.demand / v.budget:.0f}%, reconstruction {dq:.2f}) -> {v.bound}")
    return "\n".join(rows)


def _precision_text(p) -> str:
    """The plan's decision for its dtype; for a plan made without one, what each dtype would get (or why none
    meets the bar: the plan runs in the float64 executor all the same)."""
    from .errors import PlanError
    from .precision import product_precision

    if p.precision is not None:
        return str(p.precision)
    lines = []
    for dtype in ("fp16", "bf16"):
        try:
            lines.append(str(product_precision(p, dtype)))
        except PlanError as e:
            lines.append(f"{dtype}: no precision meets the bar ({e.detail})")
    return "\n".join(lines)


def _table(header: list[str], rows: list[list[str]], width: int = 46) -> str:
    wrapped = [[textwrap.wrap(cell, width) or [""] if "\n" not in cell else
                [w for line in cell.split("\n") for w in textwrap.wrap(line, width)] for cell in row]
               for row in rows]
    widths = [max([len(header[i])] + [len(line) for row in wrapped for line in row[i]]) for i in range(len(header))]
    sep = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    out = [sep, "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |", sep.replace("-", "=")]
    for row in wrapped:
        for i in range(max(len(c) for c in row)):
            out.append("| " + " | ".join((c[i] if i < len(c) else "").ljust(w) for c, w in zip(row, widths)) + " |")
        out.append(sep)
    return "\n".join(out)


def explain_table(plan) -> str:
    spec = plan.spec
    prods = list(plan.products.values())
    fields = [
        ("product", lambda p: {"qk": "scores = q . k (sums over channel)",
                               "pv": "out = p . v (sums over token)"}[p.product]),
        ("encoded operand", lambda p: _encoding_text(p, spec)),
        ("fold", _fold_text),
        ("scale goes to", scale_text),
        ("correction term", correction_text),
        ("code bias (eq. 7)", lambda p: "-" if not p.fold.folded else
         (f"{p.code_bias} folded into the zero" if p.code_bias else "none")),
        ("must land before", lands_text),
        ("operand precision (eq. 6a)", _precision_text),
        ("tiling constraint", lambda p: "\n".join(str(c).split(": ", 1)[1] for c in p.constraints) or "-"),
        ("cost (eq. 12)", _cost_text),
        ("break-even", lambda p: p.break_even or "-"),
        ("issue budget (eq. 13)", _issue_text),
    ]
    rows = [[label] + [fn(p) for p in prods] for label, fn in fields]
    head = (f"foldc plan: {spec.num_q_heads} query heads / {spec.num_kv_heads} KV heads "
            f"({spec.q_per_kv} per KV head), head_dim {spec.head_dim}")
    return head + "\n" + _table(["", *[p.product for p in prods]], rows) + "\n" + textwrap.fill(_kernel_text(spec), 110)


def _kernel_text(spec) -> str:
    """What each registered backend adds about its kernel for ``spec`` (the register-operand
    kernel's whole-loop issue demand, `foldc.backends.gluon.describe`)."""
    from .registry import attention_backends

    return " ".join(b.describe(spec) for b in attention_backends() if b.describe is not None)


def seed_table(plans) -> str:
    """The explainer's layout table, regenerated from plans: one row per (operand, layout)."""
    rows, seen = [], set()
    for plan in plans:
        for name, p in plan.products.items():
            enc = plan.spec.k if name == "qk" else plan.spec.v
            if enc is None or (name, enc.layout) in seen:
                continue
            seen.add((name, enc.layout))
            operand = "K" if name == "qk" else "V"
            prod = "QK^T, sums over channels" if name == "qk" else "PV, sums over tokens"
            rows.append([f"{enc.layout}-wise {operand}", prod, str(p.fold), scale_text(p)])
    rows.sort(key=lambda r: (r[0][-1], r[0].startswith("channel")))
    return _table(list(SEED_TABLE_HEADER), rows, width=50)
