"""Fold rewrite: turn each contraction with an encoded operand into the folded computation.

Applies docs/derivation.md equations 3, 4, 6, 7 and 15. For ``%y = contract %o, %x over r``:

- acc-fold (eq. 3, 6):  y = scale_groups(contract(o, codes(x)) split per group of r, scale(x))
                          + correction(zero(x), o, form=group-sum)
- operand-fold (eq. 4, 6): y = contract(prescale(o, scale(x)), codes(x))
                          + correction(zero(x), o, form=contract)
- dequant: y = contract(o, dequantize(x))
- o encoded too (eq. 15): the correction's sum of o becomes ``rowsum = contract(o, ones)`` per
  group and a ``presummed`` correction; the codes contraction and the row sum still have o
  encoded and are folded in turn (inside a per-group partial sum, keeping the groups).

The folded result keeps the name %y, so its users (the softmax for the key side, the
accumulator for the value side) see it unchanged: that placement is what ordering.py checks.
``code_bias`` maps a role ("key"/"value") to the constant beta a backend ORs into the codes
(eq. 7); the bias is then folded into the zero (z - beta*s) so the correction absorbs it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import PlanError, SpecError
from ..ir import (Add, Codes, Contract, Correction, Dequantize, GroupedAxis, GroupParam, Input, Prescale,
                  ScaleGroups, canonical, element_axes, param_axes)
from ..ir.axes import base_of, find
from .axis_analysis import encoded_operand, fold_from_axes
from .base import Pass


def _source_nodes(graph, enc, bias: int) -> tuple[str, str, str]:
    """Add (once) the codes, scale and zero nodes of an encoded input; return their names."""
    names = (f"{enc.name}.codes", f"{enc.name}.scale", f"{enc.name}.zero")
    if names[0] not in graph:
        pax = param_axes(enc)
        graph.add(Codes(names[0], enc.axes, source=enc.name, bias=bias))
        graph.add(GroupParam(names[1], pax, source=enc.name, param="scale"))
        graph.add(GroupParam(names[2], pax, source=enc.name, param="zero", bias=bias))
    return names


def _drop_reduced(axes, reduce: str):
    return canonical(a for a in axes if base_of(a) != reduce)


def _ones(graph, axis: str) -> str:
    """The constant-ones input along ``axis`` (contracting with it sums the other operand)."""
    name = f"ones.{axis}"
    if name not in graph:
        graph.add(Input(name, (axis,), role="ones"))
    return name


def _is_encoded(node) -> bool:
    return isinstance(node, Input) and node.encoding is not None


def check_code_bias(code_bias, roles: tuple[str, ...]) -> dict:
    """``code_bias`` (None, or a dict mapping some of ``roles`` to an int) as a dict; SpecError
    naming what is wrong (a float bias was truncated by the fold, 2.5 planned as 2)."""
    if code_bias is None:
        return {}
    if not isinstance(code_bias, dict):
        raise SpecError(f"code_bias={code_bias!r} must be a dict mapping {' and/or '.join(map(repr, roles))} "
                        "to an int, or None")
    unknown = sorted((r for r in code_bias if r not in roles), key=repr)
    if unknown:
        raise SpecError(f"code_bias has unknown role(s) {unknown}; use {' and/or '.join(map(repr, roles))}")
    for role, bias in code_bias.items():
        if isinstance(bias, bool) or not isinstance(bias, int):
            raise SpecError(f"code_bias[{role!r}]={bias!r} must be an int: the constant a backend ORs into the "
                            "codes (eq. 7)")
    return dict(code_bias)


@dataclass(frozen=True)
class FoldRewrite(Pass):
    name = "fold-rewrite"
    equation = "3, 4, 6, 7, 15"
    code_bias: dict = field(default_factory=dict)

    def apply(self, graph):
        """Rewrite contractions with an encoded operand until none is left: a fold whose other
        operand is itself encoded leaves a codes contraction (and a row sum) with an encoded
        operand, folded in turn (eq. 15)."""
        out = graph.copy()
        changed = False
        while True:
            node = next((n for n in out.nodes_of(Contract) if encoded_operand(out, n)[0] is not None), None)
            if node is None:
                return out, changed
            self._rewrite(out, node)
            changed = True

    def _rewrite(self, out, node: Contract) -> None:
        enc, other = encoded_operand(out, node)
        fold = node.fold if node.fold != "none" else fold_from_axes(enc, node.reduce)[0]
        if fold == "dequant":
            deq = out.add(Dequantize(f"{enc.name}.values", enc.axes, source=enc.name)) \
                if f"{enc.name}.values" not in out else f"{enc.name}.values"
            lhs, rhs = (other, deq) if node.rhs == enc.name else (deq, other)
            out.replace_node(Contract(node.name, node.axes, lhs=lhs, rhs=rhs, reduce=node.reduce, split=node.split,
                                      product=node.product, fold="dequant"))
            return
        bias = int(self.code_bias.get(enc.role, 0))
        codes, scale, zero = _source_nodes(out, enc, bias)
        other_axes = out[other].axes
        keep = node.split is not None  # folding inside a per-group partial sum keeps the groups (eq. 15)
        if fold == "acc-fold":
            split = find(out[scale].axes, node.reduce)  # a GroupedAxis (eq. 5)
            if not isinstance(split, GroupedAxis):
                raise PlanError("fold-kind-mismatch",
                                f"{node.product}: acc-fold needs the scale of %{enc.name} constant along "
                                f"{node.reduce} inside a group, but it has axes {[str(a) for a in out[scale].axes]}; "
                                "use operand-fold (eq. 4)")
            if keep and split != node.split:
                raise PlanError("partial-sum-crosses-group",
                                f"%{node.name} sums per {node.split} but the scale of %{enc.name} is per {split}; "
                                "a nested fold needs the same groups (eq. 15)")
            partial_axes = node.axes if keep else canonical([*_drop_reduced(canonical(
                {base_of(a): a for a in (*other_axes, *enc.axes)}.values()), node.reduce), split])
            out.add(Contract(f"{node.name}.partial", partial_axes, lhs=other, rhs=codes,
                             reduce=node.reduce, split=split, product=node.product, fold="acc-fold"))
            out.add(ScaleGroups(f"{node.name}.scaled", node.axes, partial=f"{node.name}.partial",
                                scale=scale, groups=split, product=node.product, keep_groups=keep))
            form = "group-sum"
        else:
            if keep:
                raise PlanError("fold-kind-mismatch", f"%{node.name}: an operand-fold cannot nest inside a "
                                "per-group partial sum; eq. 15 needs both scales grouped along the reduced axis")
            pre_axes = canonical({base_of(a): a for a in
                                  (*other_axes, *element_axes(out[scale].axes))}.values())
            out.add(Prescale(f"{node.name}.prescaled", pre_axes, operand=other, scale=scale,
                             product=node.product))
            out.add(Contract(f"{node.name}.scaled", node.axes, lhs=f"{node.name}.prescaled", rhs=codes,
                             reduce=node.reduce, product=node.product, fold="operand-fold"))
            form = "contract"
        if _is_encoded(out[other]):  # eq. 15: the sum of an encoded operand is a contraction with ones
            if form != "group-sum":
                raise PlanError("fold-kind-mismatch", f"%{node.name}: the other operand %{other} is encoded, "
                                "which eq. 15 handles for acc-folds only")
            groups = find(out[zero].axes, node.reduce)
            sums_axes = canonical([*(a for a in other_axes if base_of(a) != node.reduce), groups])
            out.add(Contract(f"{node.name}.rowsum", sums_axes, lhs=other, rhs=_ones(out, node.reduce),
                             reduce=node.reduce, split=groups, product=node.product))
            out.add(Correction(f"{node.name}.offset", node.axes, zero=zero, other=f"{node.name}.rowsum",
                               reduce=node.reduce, form="presummed", product=node.product))
        else:
            out.add(Correction(f"{node.name}.offset", node.axes, zero=zero, other=other, reduce=node.reduce,
                               form=form, product=node.product, keep_groups=keep))
        out.replace_node(Add(node.name, node.axes, lhs=f"{node.name}.scaled", rhs=f"{node.name}.offset"))
