"""Fold rewrite: turn each contraction with an encoded operand into the folded computation.

Applies docs/derivation.md equations 3, 4, 6 and 7. For ``%y = contract %o, %x over r``:

- acc-fold (eq. 3, 6):  y = scale_groups(contract(o, codes(x)) split per group of r, scale(x))
                          + correction(zero(x), o, form=group-sum)
- operand-fold (eq. 4, 6): y = contract(prescale(o, scale(x)), codes(x))
                          + correction(zero(x), o, form=contract)
- dequant: y = contract(o, dequantize(x))

The folded result keeps the name %y, so its users (the softmax for the key side, the
accumulator for the value side) see it unchanged: that placement is what ordering.py checks.
``code_bias`` maps a role ("key"/"value") to the constant beta a backend ORs into the codes
(eq. 7); the bias is then folded into the zero (z - beta*s) so the correction absorbs it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import PlanError
from ..ir import (Add, Codes, Contract, Correction, Dequantize, GroupedAxis, GroupParam, Prescale, ScaleGroups,
                  canonical,
                  element_axes, param_axes)
from ..ir.axes import base_of, find
from .axis_analysis import encoded_operand
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


@dataclass(frozen=True)
class FoldRewrite(Pass):
    name = "fold-rewrite"
    equation = "3, 4, 6, 7"
    code_bias: dict = field(default_factory=dict)

    def apply(self, graph):
        out = graph.copy()
        changed = False
        for node in graph.nodes_of(Contract):
            enc, other = encoded_operand(graph, node)
            if enc is None:
                continue
            changed = True
            if node.fold == "dequant":
                deq = out.add(Dequantize(f"{enc.name}.values", enc.axes, source=enc.name)) \
                    if f"{enc.name}.values" not in out else f"{enc.name}.values"
                lhs, rhs = (other, deq) if node.rhs == enc.name else (deq, other)
                out.replace_node(Contract(node.name, node.axes, lhs=lhs, rhs=rhs, reduce=node.reduce,
                                          product=node.product, fold="dequant"))
                continue
            bias = int(self.code_bias.get(enc.role, 0))
            codes, scale, zero = _source_nodes(out, enc, bias)
            other_axes = out[other].axes
            if node.fold == "acc-fold":
                split = find(out[scale].axes, node.reduce)  # a GroupedAxis (eq. 5)
                if not isinstance(split, GroupedAxis):
                    raise PlanError("fold-kind-mismatch",
                                    f"{node.product}: acc-fold needs the scale of %{enc.name} constant along "
                                    f"{node.reduce} inside a group, but it has axes {[str(a) for a in out[scale].axes]}; "
                                    "use operand-fold (eq. 4)")
                partial_axes = canonical([*_drop_reduced(canonical({base_of(a): a for a in
                                          (*other_axes, *enc.axes)}.values()), node.reduce), split])
                out.add(Contract(f"{node.name}.partial", partial_axes, lhs=other, rhs=codes,
                                 reduce=node.reduce, split=split, product=node.product, fold="acc-fold"))
                out.add(ScaleGroups(f"{node.name}.scaled", node.axes, partial=f"{node.name}.partial",
                                    scale=scale, groups=split, product=node.product))
                form = "group-sum"
            else:
                pre_axes = canonical({base_of(a): a for a in
                                      (*other_axes, *element_axes(out[scale].axes))}.values())
                out.add(Prescale(f"{node.name}.prescaled", pre_axes, operand=other, scale=scale,
                                 product=node.product))
                out.add(Contract(f"{node.name}.scaled", node.axes, lhs=f"{node.name}.prescaled", rhs=codes,
                                 reduce=node.reduce, product=node.product, fold="operand-fold"))
                form = "contract"
            out.add(Correction(f"{node.name}.offset", node.axes, zero=zero, other=other, reduce=node.reduce,
                               form=form, product=node.product))
            out.replace_node(Add(node.name, node.axes, lhs=f"{node.name}.scaled", rhs=f"{node.name}.offset"))
        return out, changed
