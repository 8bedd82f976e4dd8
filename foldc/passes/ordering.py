"""Ordering: check where each fold's pieces sit and export the tiling constraints a backend
must honour. Applies docs/derivation.md equations 5, 8 and 10.

Rules (each raises PlanError with the rule's name):

- ``key-correction-after-softmax`` (eq. 8): a key-side correction must reach the logits before
  the online softmax takes its max and exp.
- ``value-correction-after-division`` (eq. 10): a value-side correction must be part of the
  per-tile contribution the accumulator rescales; it may not be added after the division (nor
  after the accumulation, where the softmax would not rescale it).
- ``partial-sum-crosses-group`` (eq. 5): under acc-fold, each partial sum that a group scale
  multiplies must lie inside one group.
- ``missing-correction`` (eq. 6): every folded product adds its offset correction, and each
  scaled partial meets its own operand's correction before another operand's scale multiplies
  it (the nested folds of eq. 15).

The same checks run inside `foldc.prove` and `foldc.plan.check_plan`, so a hand-edited plan is
held to them too; each error carries the product at fault (``PlanError.product``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import PlanError
from ..ir import (Accumulate, Add, Contract, Correction, Divide, GroupedAxis, Input,
                  OnlineSoftmax, Prescale, ScaleGroups)
from ..ir.axes import find
from .base import Pass


@dataclass(frozen=True)
class TileConstraint:
    """Along ``axis``, a kernel tile must not let ``what`` straddle a multiple of ``every``.

    The pass-level record, read from the folded graph; `foldc.plan.ProductPlan.tiling` holds the
    numbers a kernel and a cache read (`foldc.decisions.TilingConstraint`)."""

    product: str
    axis: str
    every: int
    what: str

    def __str__(self) -> str:
        return f"{self.product}: {self.what} must not cross a multiple of {self.every} along {self.axis}"


def _role_of(graph, node) -> str:
    return graph[graph[node.zero].source].role


def check_correction_placement(graph) -> None:
    """Rules key-correction-after-softmax, value-correction-after-division, missing-correction."""
    softmaxes = graph.nodes_of(OnlineSoftmax)
    accs = graph.nodes_of(Accumulate)
    divides = graph.nodes_of(Divide)
    corrected = set()
    for corr in graph.nodes_of(Correction):
        role = _role_of(graph, corr)
        below = graph.descendants(corr.name)
        corrected.add(graph[corr.zero].source)
        if graph.output not in below:
            raise PlanError("missing-correction", f"%{corr.name} is computed but never added to the result",
                              product=corr.product)
        if role == "key":
            for sm in softmaxes:
                if sm.name not in below:
                    raise PlanError("key-correction-after-softmax",
                                    f"%{corr.name} (key side) is added after the softmax %{sm.name}; it must "
                                    "reach the logits before the max and exp (eq. 8)", product=corr.product)
        elif role == "value":
            if any(d.name in graph.ancestors(corr.name) | {corr.name} for d in divides) or \
                    any(d.name not in below for d in divides):
                raise PlanError("value-correction-after-division",
                                f"%{corr.name} (value side) is added after the division by the softmax "
                                "denominator; it must land in the accumulator before it (eq. 10)",
                                product=corr.product)
            for acc in accs:
                if acc.name not in below or acc.name in graph.ancestors(corr.name):
                    raise PlanError("value-correction-after-division",
                                    f"%{corr.name} (value side) does not feed the accumulator %{acc.name}, "
                                    "so the online softmax cannot rescale it; add it to the per-tile "
                                    "contribution before the division (eq. 10)", product=corr.product)
    for node in graph.nodes_of(Contract):
        if node.fold in ("acc-fold", "operand-fold"):
            codes = graph[node.rhs] if node.rhs.endswith(".codes") else graph[node.lhs]
            source = getattr(codes, "source", None)
            if source is not None and source not in corrected:
                raise PlanError("missing-correction",
                                f"%{node.name} folds %{source} but no correction adds zero x other (eq. 6)",
                                product=node.product)
    for node in (*graph.nodes_of(ScaleGroups), *graph.nodes_of(Prescale)):
        source = graph[node.scale].source
        if source not in corrected:
            raise PlanError("missing-correction",
                            f"%{node.name} applies the scale of %{source} but no correction adds its zero x "
                            "the sum of the other operand (eq. 6)", product=node.product)


def check_group_boundaries(graph) -> None:
    """Rule partial-sum-crosses-group (eq. 5)."""
    for sg in graph.nodes_of(ScaleGroups):
        partial = graph[sg.partial]
        scale_axis = find(graph[sg.scale].axes, sg.groups.base if sg.groups else "")
        if isinstance(partial, Contract):
            split = partial.split
        elif isinstance(partial, Add) and any(isinstance(graph[o], ScaleGroups) and graph[o].keep_groups
                                              for o in partial.operands()):
            split = find(partial.axes, sg.groups.base) if sg.groups else None  # a nested fold's per-group sum (eq. 15)
            split = split if isinstance(split, GroupedAxis) else None
        else:
            split = None
        if split is None or split != sg.groups:
            raise PlanError("partial-sum-crosses-group",
                            f"%{sg.name} scales %{partial.name}, which is not split per group along "
                            f"{sg.groups.base if sg.groups else '?'}; an unscaled partial sum would cross "
                            "a group boundary (eq. 5)", product=sg.product)
        if isinstance(scale_axis, GroupedAxis) and scale_axis.group_size % split.group_size:
            raise PlanError("partial-sum-crosses-group",
                            f"%{partial.name} keeps partial sums per {split.group_size} along {split.base} "
                            f"but the scale %{sg.scale} changes every {scale_axis.group_size}; an unscaled "
                            f"partial sum crosses a group boundary (eq. 5): split every {scale_axis.group_size}",
                            product=sg.product)


def tile_constraints(graph) -> list[TileConstraint]:
    """What a kernel's tiling must respect, derived from the folded graph (eq. 5)."""
    out = []
    for node in graph.nodes_of(Contract):
        if node.split is not None:
            out.append(TileConstraint(node.product, node.split.base, node.split.group_size,
                                      "an unscaled partial sum"))
    for node in graph.nodes_of(Prescale):
        scale = graph[node.scale]
        for ax in scale.axes:  # the group index on a non-reduced axis (eq. 4, section 11)
            if isinstance(ax, GroupedAxis):
                out.append(TileConstraint(node.product, ax.base, ax.group_size,
                                          f"one pre-scaled %{node.operand} (it changes per {ax.base} group)"))
    return sorted(set(out), key=str)


def check_offsets_paired(graph) -> None:
    """Rule missing-correction (eq. 6): each scaled partial is added to its own operand's offset."""
    corrections = graph.nodes_of(Correction)
    for sg in graph.nodes_of(ScaleGroups):
        source = graph[sg.scale].source
        reach, todo = set(), [u.name for u in graph.users(sg.name)]
        while todo:  # where sg's value flows before another operand's scale multiplies it
            name = todo.pop()
            node = graph[name]
            if name in reach or (isinstance(node, ScaleGroups) and graph[node.scale].source != source):
                continue
            reach.add(name)
            todo += [u.name for u in graph.users(name)]
        if not any(graph[c.zero].source == source and (graph.descendants(c.name) & reach) for c in corrections):
            raise PlanError("missing-correction",
                            f"%{sg.name} scales by %{sg.scale} but is not added to the offset correction of "
                            f"%{source} (zero x sum of the other operand, eq. 6)", product=sg.product)


def check_spec_inputs(graph, built, spec_text: str) -> None:
    """Rule ``spec-mismatch``: ``graph`` (a plan's, perhaps edited) reads the inputs and axis sizes of ``built``, the
    graph its spec builds (``spec_text`` describes the spec), and no input of its own but matrices of ones. A plan
    whose graph reads another encoding would be proved for that one while its kernel is built for the spec's."""
    for node in built.nodes_of(Input):
        have = graph[node.name] if node.name in graph else None
        if have != node:
            raise PlanError("spec-mismatch", f"the plan's graph has input {have} where its spec ({spec_text}) gives "
                            f"{node}; plan the spec again (foldc.plan)")
    extra = sorted(n.name for n in graph.nodes_of(Input) if n.role != "ones" and n.name not in built)
    if extra or any(graph.sizes.get(axis) != size for axis, size in built.sizes.items()):
        raise PlanError("spec-mismatch", f"the plan's graph (inputs {extra or 'as the spec'}, sizes {graph.sizes}) is "
                        f"not one of its spec ({spec_text}, sizes {built.sizes}); plan the spec again")


def check_plan_rules(graph) -> None:
    """Every rule of this module on ``graph`` (`foldc.plan.check_plan` runs them on a plan)."""
    check_correction_placement(graph)
    check_offsets_paired(graph)
    check_group_boundaries(graph)


@dataclass(frozen=True)
class Ordering(Pass):
    name = "ordering"
    equation = "5, 8, 10"

    def apply(self, graph):
        check_plan_rules(graph)
        out = graph.copy()
        out.meta["constraint"] = tile_constraints(graph)
        return out, True
