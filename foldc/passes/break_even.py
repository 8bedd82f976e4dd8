"""Break-even check: keep a fold only while it does fewer scale-and-offset operations per
stored value than per-value reconstruction (docs/derivation.md, equations 12, 12a and 16).

A fold costs one scale op and one offset op per row of the other operand per group:
2 * h / g operations per stored value, where h is the number of other-operand rows that share
one group (the query heads per KV head in attention) and g the group size. Reconstruction
(s * c + z per value) costs 1. The fold is kept only while g > 2 * h; otherwise the contraction
falls back to "dequant" and the plan records why. In a GEMM (eq. 16) h is the number of
activation rows that share one dequantized weight tile, min(m, rows per tile): decode GEMVs
fold, large-m GEMMs with small groups reconstruct. Attention likewise: a kernel whose programs take
blocks of r of the query rows per KV head, each block reconstructing the tile again, shares each
reconstruction among r rows, so h = min(query heads per KV head, r) (``rows_per_program``).

A target whose kernel departs from that count passes its `FoldCosts` (eq. 12a): the register-operand kernel keeps
a fold at the tie, and reconstructs a key side whose groups run along the token loop past the rows whose query
operand it can rebuild in registers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction

from ..errors import PlanError
from ..ir import BATCH, Contract, element_axes
from ..ir.axes import TOKEN
from .axis_analysis import encoded_operand
from .base import Pass


def rows_sharing_group(graph, contract: Contract) -> int:
    """h: rows of the other operand that read the same encoded value (its extra axes, batch aside)."""
    enc, other = encoded_operand(graph, contract)
    extra = set(element_axes(graph[other].axes)) - set(enc.axes) - {BATCH}
    missing = [a for a in extra if a not in graph.sizes]
    if missing:
        raise PlanError("unknown-size", f"break-even for %{contract.name} needs the size of axis {missing[0]!r}")
    return math.prod(graph.sizes[a] for a in extra)


def fold_cost(rows: int, group_size: int) -> Fraction:
    """Scale-and-offset operations per stored value under a fold (eq. 12)."""
    return Fraction(2 * rows, group_size)


@dataclass(frozen=True)
class FoldCosts:
    """Where a target's kernel departs from eq. 12's count (eq. 12a, docs/derivation.md), as measured on it.

    ``fold_at_tie``: keep a fold whose cost ties with reconstruction's (g = 2h): its operations land on fp32
    accumulator or P elements the kernel scales anyway, while reconstruction adds an integer unpack and a rebuild
    at a power of two per value.
    ``resident_rows``: an operand-fold whose other operand is the same at every step of the loop (the query) and
    whose groups run along the loop axis rebuilds that operand at each group from rows it keeps; past this many
    rows per program they do not fit beside the accumulators, and the plan reconstructs (None: no limit).
    ``loop_axis``: the axis the kernel's loop walks (the cache's tokens)."""

    target: str
    fold_at_tie: bool = False
    resident_rows: int | None = None
    loop_axis: str = TOKEN


@dataclass(frozen=True)
class BreakEven(Pass):
    """``policy="auto"`` applies the rule; ``"dequant"`` reconstructs every value regardless (the
    comparison point existing kernels represent, used by the benchmark)."""

    name = "break-even"
    equation = "12, 12a, 16"
    policy: str = "auto"
    rows_per_program: int | None = None   # r: rows that share one reconstructed tile (None: all of them)
    costs: FoldCosts | None = None        # a target's departures from the count (eq. 12a); None: eq. 12 alone

    def apply(self, graph):
        out = graph.copy()
        changed = False
        for node in graph.nodes_of(Contract):
            if node.fold not in ("acc-fold", "operand-fold"):
                continue
            enc, other = encoded_operand(graph, node)
            h, g = rows_sharing_group(graph, node), enc.encoding.group_size
            blocked = self.rows_per_program is not None and self.rows_per_program < h
            if blocked:   # each program reconstructs the tile for its own block of rows
                h = self.rows_per_program
            per = " (rows per program)" if blocked else ""
            cost = fold_cost(h, g)
            if self.policy == "dequant":
                out.replace_node(replace(node, fold="dequant"))
                out.meta[f"break-even.{node.product}"] = (
                    f"fold_policy='dequant' asks for per-value reconstruction (the fold would cost "
                    f"2*{h}/{g} = {float(cost):.4g} ops/value)")
                changed = True
                continue
            costs = self.costs
            along_loop = costs is not None and (enc.group_axis or enc.encoding.group_axis) == costs.loop_axis
            resident = costs is not None and node.fold == "operand-fold" and along_loop and \
                costs.loop_axis not in element_axes(graph[other].axes)
            if resident and costs.resident_rows is not None and h > costs.resident_rows:
                out.replace_node(replace(node, fold="dequant"))
                out.meta[f"break-even.{node.product}"] = (
                    f"{costs.target} (eq. 12a): the {node.fold} rebuilds the loop-invariant operand at each group of "
                    f"{g} along {costs.loop_axis} from the {h} rows{per} it keeps, more than the "
                    f"{costs.resident_rows} that fit beside the accumulators: dequant")
                changed = True
                continue
            if g > 2 * h:
                out.meta[f"break-even.{node.product}"] = (
                    f"fold costs 2*h/g = 2*{h}{per}/{g} = {float(cost):.4g} ops/value < 1 for per-value "
                    f"reconstruction: {node.fold} kept")
                continue
            if g == 2 * h and costs is not None and costs.fold_at_tie:
                out.meta[f"break-even.{node.product}"] = (
                    f"fold costs 2*h/g = 2*{h}{per}/{g} = 1 op/value, a tie with per-value reconstruction; "
                    f"{costs.target} (eq. 12a) keeps the {node.fold} at the tie")
                continue
            out.replace_node(replace(node, fold="dequant"))
            out.meta[f"break-even.{node.product}"] = (
                f"group_size={g} <= 2*h={2 * h}{per}: the {node.fold} would cost 2*h/g = {float(cost):.4g} "
                "ops/value, not less than 1 for per-value reconstruction: dequant")
            changed = True
        return out, changed
