"""Axis analysis: choose acc-fold or operand-fold for each contraction from the axes alone.

Applies docs/derivation.md equations 3, 4, 11 and 15. For a contraction summing over axis r with an
encoded operand x = s*c + z, look at the axes of s:
- r is a grouped axis of s (or absent): s is constant along r inside a group -> acc-fold (eq. 3);
- r is a plain axis of s (one scale per index of r): s varies along r -> operand-fold (eq. 4).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import PlanError
from ..ir import Contract, GroupedAxis, Input, param_axes
from ..ir.axes import find
from .base import Pass


def encoded_operand(graph, contract: Contract) -> tuple[Input | None, str | None]:
    """(encoded input, name of the other operand) of a contraction; (None, None) if unencoded.

    With two encoded operands (eq. 15) the right-hand one is folded first and the left-hand one
    is the "other" operand; that needs both scales grouped the same way along the reduced axis.
    """
    ops = [graph[contract.lhs], graph[contract.rhs]]
    encoded = [op for op in ops if isinstance(op, Input) and op.encoding is not None]
    if not encoded:
        return None, None
    if len(encoded) == 2:
        entries = [find(param_axes(op), contract.reduce) for op in encoded]
        if entries[0] != entries[1] or not isinstance(entries[0], GroupedAxis):
            raise PlanError("two-encoded-operands",
                            f"%{contract.name} contracts two encoded operands whose scales along {contract.reduce} "
                            f"are {entries[0]} and {entries[1]}; eq. 15 needs both grouped the same way "
                            "(e.g. per-token activations with per-channel weights), or make one side plain")
        return encoded[1], contract.lhs
    enc = encoded[0]
    other = contract.rhs if enc.name == contract.lhs else contract.lhs
    return enc, other


def fold_from_axes(encoded: Input, reduce: str) -> tuple[str, str]:
    """(fold kind, reason) for summing ``encoded`` over ``reduce`` (eq. 11)."""
    entry = find(param_axes(encoded), reduce)
    if entry is None:
        return "acc-fold", f"the scale of %{encoded.name} does not depend on {reduce}"
    if isinstance(entry, GroupedAxis):
        return "acc-fold", (f"the scale of %{encoded.name} is constant along {reduce} inside a group of "
                            f"{entry.group_size} (eq. 3)")
    return "operand-fold", (f"the scale of %{encoded.name} changes with every {reduce} index, so it "
                            "pre-scales the other operand (eq. 4)")


@dataclass(frozen=True)
class AxisAnalysis(Pass):
    name = "axis-analysis"
    equation = "3, 4, 11, 15"

    def apply(self, graph):
        out = graph.copy()
        changed = False
        for node in graph.nodes_of(Contract):
            enc, _ = encoded_operand(graph, node)
            if enc is None or node.fold != "none":
                continue
            kind, reason = fold_from_axes(enc, node.reduce)
            out.replace_node(replace(node, fold=kind))
            out.meta[f"reason.{node.product}"] = reason
            changed = True
        return out, changed
