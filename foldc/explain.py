"""Human-readable views of a plan: the summary `str(plan)` prints and the `explain` table."""
from __future__ import annotations


def plan_summary(plan) -> str:
    lines = [f"plan for {plan.spec.describe()}"]
    for name, p in plan.products.items():
        lines.append(f"  {name}: {p.fold:<12} scale -> {p.scale_site}; correction: {p.correction}")
    for c in plan.constraints:
        lines.append(f"  tiling: {c}")
    return "\n".join(lines)
