"""IR nodes: one frozen dataclass per operation, typed fields, axes always named.

Operands are referenced by node name (a string); `Graph` resolves them. Every node states the
axes of its result in canonical order (see axes.py) so the verifier can check them.

Node kinds, grouped:

- sources: `Input` (query, key, value; a GEMM's activation, weight and constant ``ones``),
  and for an encoded input its `Codes`, `GroupParam` (scale or zero) or per-value `Dequantize`;
- products: `Contract` (a sum over one axis, optionally keeping per-group partial sums),
  `Prescale` (operand-fold: multiply the other operand by the scale), `ScaleGroups` (acc-fold:
  multiply each group's partial sum by its scale and add the groups), `Correction` (the offset
  term), `Add`, `MulScalar`;
- softmax: `OnlineSoftmax` (running max, rescale, running denominator over token tiles),
  `Accumulate` (the rescaled running sum of per-tile value contributions), `Divide`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar, Literal

from ..encoding import Affine
from .axes import Axis, GroupedAxis, format_axes

Role = Literal["query", "key", "value", "activation", "weight", "ones"]
Fold = Literal["none", "acc-fold", "operand-fold", "dequant"]
FOLD_KINDS = ("none", "acc-fold", "operand-fold", "dequant")


@dataclass(frozen=True)
class Node:
    name: str
    axes: tuple[Axis, ...]

    kind: ClassVar[str] = "node"
    #: names of the fields that hold operand node names
    operand_fields: ClassVar[tuple[str, ...]] = ()
    #: attributes printed even when they hold their default
    always_print: ClassVar[tuple[str, ...]] = ()

    def operands(self) -> tuple[str, ...]:
        return tuple(getattr(self, f) for f in self.operand_fields)

    def attrs(self) -> str:
        """Non-operand attributes for the printer, ``key=value`` separated by spaces."""
        skip = {"name", "axes", *self.operand_fields}
        out = []
        for f in fields(self):
            if f.name in skip:
                continue
            val = getattr(self, f.name)
            if val == f.default and f.name not in self.always_print:
                continue
            out.append(f"{f.name}={_fmt(val)}")
        return " ".join(out)


    def __str__(self) -> str:
        ops = ", ".join(f"%{o}" for o in self.operands())
        attrs = self.attrs()
        parts = [self.kind, ops, attrs]
        return f"%{self.name} = " + " ".join(p for p in parts if p) + f" : {format_axes(self.axes)}"


def _fmt(val) -> str:
    if isinstance(val, Affine):
        return val.short()
    if isinstance(val, GroupedAxis):
        return str(val)
    return str(val)


@dataclass(frozen=True)
class Input(Node):
    """A kernel input. ``group_axis`` names the axis the encoding's groups run along when it is
    not the attention default (``encoding.group_axis``): a GEMM weight groups along ``k``.
    role ``ones`` is the constant 1 along its axes: contracting with it sums the other operand
    (the row and column sums of eq. 15)."""

    role: Role = "query"
    encoding: Affine | None = None
    group_axis: str = ""
    kind = "input"
    always_print = ("role",)


@dataclass(frozen=True)
class Codes(Node):
    """The raw integer codes of an encoded input, plus a constant ``bias`` (eq. 7: c' = c + bias)."""

    source: str = ""
    bias: int = 0
    kind = "codes"
    operand_fields = ("source",)


@dataclass(frozen=True)
class GroupParam(Node):
    """The per-group scale or zero of an encoded input. A zero with ``bias`` b holds z - b*s (eq. 7)."""

    source: str = ""
    param: Literal["scale", "zero"] = "scale"
    bias: int = 0
    kind = "param"
    operand_fields = ("source",)
    always_print = ("param",)


@dataclass(frozen=True)
class Dequantize(Node):
    """Per-value reconstruction s*c + z (the way existing kernels work)."""

    source: str = ""
    kind = "dequantize"
    operand_fields = ("source",)


@dataclass(frozen=True)
class Contract(Node):
    """Sum of ``lhs * rhs`` over axis ``reduce``.

    ``split`` set: partial sums are kept apart per group of ``split.group_size`` along ``reduce``
    (the result has ``split`` in place of the reduced axis), eq. 5.
    ``product`` names the attention product ("qk" or "pv") this contraction computes;
    ``fold`` is the decision of the axis analysis for it (eq. 11).
    """

    lhs: str = ""
    rhs: str = ""
    reduce: str = ""
    split: GroupedAxis | None = None
    product: str = ""
    fold: Fold = "none"
    kind = "contract"
    operand_fields = ("lhs", "rhs")
    always_print = ("reduce",)


@dataclass(frozen=True)
class Prescale(Node):
    """Operand-fold (eq. 4): ``operand * scale``, the scale broadcast to one entry per value."""

    operand: str = ""
    scale: str = ""
    product: str = ""
    kind = "prescale"
    operand_fields = ("operand", "scale")


@dataclass(frozen=True)
class ScaleGroups(Node):
    """Acc-fold (eq. 3): multiply each group's partial sum by the group's scale, then sum groups.

    ``keep_groups``: do not sum the groups (the result keeps ``groups`` as an axis). A fold nested
    inside a per-group partial sum (the second operand of eq. 15) keeps them.
    """

    partial: str = ""
    scale: str = ""
    groups: GroupedAxis | None = None
    product: str = ""
    keep_groups: bool = False
    kind = "scale_groups"
    operand_fields = ("partial", "scale")


@dataclass(frozen=True)
class Correction(Node):
    """The offset term of a fold (eq. 6), summed over axis ``reduce``.

    ``form="group-sum"`` (acc-fold): z_g * (sum of ``other`` over group g), added over groups.
    ``form="contract"`` (operand-fold): sum over r of other[r] * z[r].
    ``form="presummed"``: ``other`` already holds the sums over each group of r (it has the
    grouped axis in place of r, e.g. the row sums of an encoded operand, eq. 15):
    sum over groups g of z_g * other[g].
    ``keep_groups`` (group-sum form): do not add the groups up (see ScaleGroups).
    """

    zero: str = ""
    other: str = ""
    reduce: str = ""
    form: Literal["group-sum", "contract", "presummed"] = "contract"
    product: str = ""
    keep_groups: bool = False
    kind = "correction"
    operand_fields = ("zero", "other")
    always_print = ("reduce", "form")


@dataclass(frozen=True)
class Add(Node):
    lhs: str = ""
    rhs: str = ""
    kind = "add"
    operand_fields = ("lhs", "rhs")


@dataclass(frozen=True)
class MulScalar(Node):
    """Multiply by a runtime scalar (``sm_scale``)."""

    input: str = ""
    scalar: str = "sm_scale"
    kind = "mul_scalar"
    operand_fields = ("input",)
    always_print = ("scalar",)


@dataclass(frozen=True)
class OnlineSoftmax(Node):
    """exp(logits - running max) over token tiles, with the running denominator (eq. 9).

    Its value per tile is the unnormalised weight P; the denominator and the rescale factor
    alpha are state that `Accumulate` and `Divide` read.
    """

    logits: str = ""
    axis: str = "token"
    kind = "online_softmax"
    operand_fields = ("logits",)


@dataclass(frozen=True)
class Accumulate(Node):
    """Running sum over token tiles of ``input``, rescaled by the softmax's alpha each tile (eq. 9)."""

    input: str = ""
    softmax: str = ""
    kind = "accumulate"
    operand_fields = ("input", "softmax")


@dataclass(frozen=True)
class Divide(Node):
    """Final division of the accumulator by the softmax denominator (eq. 10)."""

    acc: str = ""
    softmax: str = ""
    kind = "divide"
    operand_fields = ("acc", "softmax")
