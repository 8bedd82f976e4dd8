"""Structural verifier, run after every pass.

Checks that the graph is a DAG with every operand defined, that each node's axes follow from
its operands' axes, and that softmax state is wired the only way the executor understands.
Messages name the node, the axis and the two values that disagree.
"""
from __future__ import annotations

from ..errors import GraphError
from .axes import GroupedAxis, base_of, canonical, find, format_axes
from .nodes import (Accumulate, Add, Codes, Contract, Correction, Dequantize, Divide, GroupParam,
                    Input, MulScalar, Node, OnlineSoftmax, Prescale, ScaleGroups)


def param_axes(inp: Input) -> tuple:
    """Axes of the scale/zero of an encoded input: its group axis becomes a GroupedAxis."""
    enc = inp.encoding
    assert enc is not None
    group_axis = inp.group_axis or enc.group_axis
    return tuple(GroupedAxis(a, enc.group_size) if a == group_axis else a for a in inp.axes)


def element_axes(axes) -> tuple:
    """Replace grouped axes by their base axis (what a broadcast to one entry per value gives)."""
    return tuple(base_of(a) for a in axes)


def _union(*axes_lists) -> tuple:
    seen: dict[str, object] = {}
    for axes in axes_lists:
        for a in axes:
            seen.setdefault(base_of(a), a)
    return canonical(seen.values())


def _expect(node: Node, want, what: str = "axes") -> None:
    want = tuple(want)
    if tuple(node.axes) != want:
        raise GraphError(f"%{node.name} ({node.kind}): {what} {format_axes(node.axes)} "
                         f"but its operands give {format_axes(want)}")


def _encoded_source(graph, node: Node, field: str = "source") -> Input:
    src = graph[getattr(node, field)]
    if not isinstance(src, Input) or src.encoding is None:
        raise GraphError(f"%{node.name} ({node.kind}) reads %{src.name}, which is not an encoded input")
    return src


def _require_axis(node: Node, operand: Node, axis: str) -> None:
    if axis not in operand.axes:
        raise GraphError(f"%{node.name} ({node.kind}) sums over {axis!r} but operand %{operand.name} "
                         f"has axes {format_axes(operand.axes)}")


def verify(graph) -> None:
    """Raise GraphError at the first malformed node."""
    missing = graph.undefined()
    if missing:
        raise GraphError(f"%{missing[0]} is used but never defined")
    if not graph.is_acyclic():
        raise GraphError(f"graph {graph.title} has a cycle")
    if graph.output is None or graph.output not in graph:
        raise GraphError(f"graph {graph.title} has no output (output={graph.output!r})")
    softmaxes = graph.nodes_of(OnlineSoftmax)
    if len(softmaxes) > 1:
        raise GraphError(f"graph has {len(softmaxes)} online softmaxes; decode attention has one")
    for node in graph:
        try:
            if tuple(canonical(node.axes)) != tuple(node.axes):
                raise GraphError(f"%{node.name}: axes {format_axes(node.axes)} are not in canonical order")
        except ValueError as e:
            raise GraphError(f"%{node.name}: {e}") from None
        _CHECKS[type(node)](graph, node)


def _check_input(graph, node: Input) -> None:
    if node.encoding is not None and node.role in ("query", "ones"):
        raise GraphError(f"%{node.name}: the {node.role} cannot be encoded")
    if node.encoding is not None and (node.group_axis or node.encoding.group_axis) not in node.axes:
        raise GraphError(f"%{node.name}: its groups run along {node.group_axis or node.encoding.group_axis!r}, "
                         f"which is not one of its axes {format_axes(node.axes)}")


def _check_codes(graph, node: Node) -> None:
    _expect(node, _encoded_source(graph, node).axes)


def _check_param(graph, node: GroupParam) -> None:
    src = _encoded_source(graph, node)
    _expect(node, param_axes(src))
    if node.param == "scale" and node.bias:
        raise GraphError(f"%{node.name}: a scale carries no bias (bias={node.bias})")


def _check_contract(graph, node: Contract) -> None:
    lhs, rhs = graph[node.lhs], graph[node.rhs]
    for operand in (lhs, rhs):
        _require_axis(node, operand, node.reduce)
    want = [a for a in _union(lhs.axes, rhs.axes) if base_of(a) != node.reduce]
    if node.split is not None:
        if node.split.base != node.reduce:
            raise GraphError(f"%{node.name}: split={node.split} but reduce={node.reduce!r}; "
                             "partials can only be split along the reduced axis")
        want.append(node.split)
    _expect(node, canonical(want))
    if any(isinstance(a, GroupedAxis) for a in (*lhs.axes, *rhs.axes)):
        raise GraphError(f"%{node.name}: contraction operands must have one entry per value; "
                         f"got {format_axes(lhs.axes)} and {format_axes(rhs.axes)}")


def _check_prescale(graph, node: Prescale) -> None:
    operand, scale = graph[node.operand], graph[node.scale]
    if not isinstance(scale, GroupParam) or scale.param != "scale":
        raise GraphError(f"%{node.name}: prescale needs a scale parameter, got %{scale.name} ({scale.kind})")
    _expect(node, _union(operand.axes, element_axes(scale.axes)))


def _check_scale_groups(graph, node: ScaleGroups) -> None:
    partial, scale = graph[node.partial], graph[node.scale]
    if not isinstance(scale, GroupParam) or scale.param != "scale":
        raise GraphError(f"%{node.name}: needs a scale parameter, got %{scale.name} ({scale.kind})")
    if node.groups is None or node.groups not in partial.axes:
        raise GraphError(f"%{node.name}: groups={node.groups} is not an axis of %{partial.name} "
                         f"{format_axes(partial.axes)}")
    if not isinstance(find(scale.axes, node.groups.base), GroupedAxis):   # eq. 3: one scale per group
        raise GraphError(f"%{node.name}: scales partial sums per {node.groups}, but the scale %{scale.name} "
                         f"{format_axes(scale.axes)} is not grouped along {node.groups.base!r}")
    _expect(node, canonical(a for a in _union(partial.axes, scale.axes) if node.keep_groups or a != node.groups))


def _check_correction(graph, node: Correction) -> None:
    zero, other = graph[node.zero], graph[node.other]
    if not isinstance(zero, GroupParam) or zero.param != "zero":
        raise GraphError(f"%{node.name}: needs a zero parameter, got %{zero.name} ({zero.kind})")
    grouped = find(zero.axes, node.reduce)
    if node.form == "presummed":  # other holds per-group sums: its entry on reduce is the zero's group axis
        if find(other.axes, node.reduce) != grouped or node.keep_groups:
            raise GraphError(f"%{node.name}: form=presummed needs %{other.name} {format_axes(other.axes)} summed "
                             f"per group of the zero %{zero.name} {format_axes(zero.axes)} along {node.reduce!r}")
        _expect(node, canonical(a for a in _union(other.axes, zero.axes) if base_of(a) != node.reduce))
        return
    _require_axis(node, other, node.reduce)
    if node.form == "group-sum" and not isinstance(grouped, GroupedAxis):
        raise GraphError(f"%{node.name}: form=group-sum needs the zero grouped along {node.reduce!r}; "
                         f"%{zero.name} has axes {format_axes(zero.axes)}")
    if node.keep_groups and node.form != "group-sum":
        raise GraphError(f"%{node.name}: keep_groups needs form=group-sum, got form={node.form}")
    kept = [grouped] if node.keep_groups else []
    _expect(node, canonical([*(a for a in _union(other.axes, element_axes(zero.axes)) if a != node.reduce), *kept]))


def _check_add(graph, node: Add) -> None:
    lhs, rhs = graph[node.lhs], graph[node.rhs]
    if tuple(lhs.axes) != tuple(rhs.axes):
        raise GraphError(f"%{node.name}: adds %{lhs.name} {format_axes(lhs.axes)} and "
                         f"%{rhs.name} {format_axes(rhs.axes)}, whose axes differ")
    _expect(node, lhs.axes)


def _check_same_axes(graph, node: Node) -> None:
    _expect(node, graph[node.operands()[0]].axes)


def _check_softmax(graph, node: OnlineSoftmax) -> None:
    logits = graph[node.logits]
    _require_axis(node, logits, node.axis)
    _expect(node, logits.axes)


def _check_accumulate(graph, node: Accumulate) -> None:
    inp, sm = graph[node.input], graph[node.softmax]
    if not isinstance(sm, OnlineSoftmax):
        raise GraphError(f"%{node.name}: softmax operand %{sm.name} is a {sm.kind}, not an online softmax")
    if sm.axis in element_axes(inp.axes):
        raise GraphError(f"%{node.name}: accumulates %{inp.name}, which still has axis {sm.axis!r}; "
                         "sum it over the tile first")
    _expect(node, inp.axes)


def _check_divide(graph, node: Divide) -> None:
    acc, sm = graph[node.acc], graph[node.softmax]
    if not isinstance(sm, OnlineSoftmax):
        raise GraphError(f"%{node.name}: softmax operand %{sm.name} is a {sm.kind}, not an online softmax")
    _expect(node, acc.axes)


_CHECKS = {
    Input: _check_input, Codes: _check_codes, GroupParam: _check_param, Dequantize: _check_codes,
    Contract: _check_contract, Prescale: _check_prescale, ScaleGroups: _check_scale_groups,
    Correction: _check_correction, Add: _check_add, MulScalar: _check_same_axes,
    OnlineSoftmax: _check_softmax, Accumulate: _check_accumulate, Divide: _check_divide,
}


def structural_fold(graph, product: str) -> str | None:
    """The fold kind the graph's structure implements for ``product`` (eq. 11): a ScaleGroups is an acc-fold, a
    Prescale an operand-fold, a contraction of dequantized values a dequant; None for a plain product."""
    nodes = [n for n in graph if getattr(n, "product", None) == product]
    if any(isinstance(n, ScaleGroups) for n in nodes):
        return "acc-fold"
    if any(isinstance(n, Prescale) for n in nodes):
        return "operand-fold"
    contracts = [n for n in nodes if isinstance(n, Contract)]
    if any(isinstance(graph[o], Dequantize) for c in contracts for o in c.operands()):
        return "dequant"
    return None
