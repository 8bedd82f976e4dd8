"""The typed decisions of a plan (`foldc.plan.ProductPlan`): what a backend and a serving layer read.

Each decision is an enum or a frozen dataclass; ``str()`` of one is the English text ``foldc
explain`` shows. The enums are str-enums, so ``p.fold == "acc-fold"`` holds. docs/derivation.md:
the fold kinds are eq. 3 (acc-fold), eq. 4 (operand-fold) and eq. 1 (dequant); the correction
term is eq. 6; where it lands, eq. 8 (key side) and eq. 10 (value side); the tiling numbers,
eq. 5 and the planar packing of foldc/encoding.py.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class _Text(str, enum.Enum):
    """A str-enum whose ``str()`` and ``format()`` are its value."""

    __str__ = str.__str__
    __format__ = str.__format__


class FoldKind(_Text):
    """How a product meets an encoded operand's (scale, zero)."""

    ACC_FOLD = "acc-fold"          # eq. 3: the scale multiplies each group's partial sum
    OPERAND_FOLD = "operand-fold"  # eq. 4: the scale multiplies the other operand before the product
    DEQUANT = "dequant"            # eq. 1: each value is reconstructed, s*c + z, then the product
    NONE = "none"                  # a plain operand

    @property
    def folded(self) -> bool:
        """acc-fold or operand-fold: the product runs on the codes and adds a correction (eq. 6)."""
        return self in (FoldKind.ACC_FOLD, FoldKind.OPERAND_FOLD)


class GroupAxis(_Text):
    """The axis along which one (scale, zero) group runs (``Affine.group_axis``)."""

    CHANNEL = "channel"   # token-wise encoding: each token's head_dim is cut into groups of G channels
    TOKEN = "token"       # channel-wise encoding: each channel's runs of G tokens share a pair

    @classmethod
    def of(cls, enc) -> "GroupAxis":
        return cls(enc.group_axis)


class Stage(_Text):
    """The step of the online softmax a product's terms must reach before it runs."""

    SOFTMAX = "the softmax (max, exp)"                                   # key side, eq. 8
    DIVISION = "the division by the denominator (rescaled with acc)"     # value side, eq. 10


#: what each attention product's terms land before
STAGE_OF = {"qk": Stage.SOFTMAX, "pv": Stage.DIVISION}


class ScaleTarget(_Text):
    """What the group scale multiplies."""

    OPERAND = "operand"           # operand-fold (eq. 4): the other operand, before the product
    ACCUMULATOR = "accumulator"   # acc-fold (eq. 3): the group's partial sum
    VALUE = "value"               # dequant (eq. 1): each value


@dataclass(frozen=True)
class ScaleSite:
    """Where the encoded operand's scale goes: it multiplies ``multiplies`` (the operand
    ``operand``: the other one for OPERAND and ACCUMULATOR, the encoded one for VALUE), and it
    changes every ``per`` elements along ``axis``, the axis its groups run along."""

    multiplies: ScaleTarget
    operand: str
    axis: GroupAxis
    per: int

    def __str__(self) -> str:
        if self.multiplies is ScaleTarget.ACCUMULATOR:
            return f"each group's partial sum (per {self.per} {self.axis}s)"
        if self.multiplies is ScaleTarget.OPERAND:
            return f"the other operand: {self.operand} x scale, before the product"
        return "each value (s*c + z, then the product)"


@dataclass(frozen=True)
class CorrectionTerm:
    """The offset term a folded product adds (eq. 6): the zero of ``zero`` times the sum of
    ``other`` over ``axis`` (the product's reduction), per group of ``group_size`` for an
    acc-fold, or as one contraction of ``other`` with the zero for an operand-fold (None: the
    zero changes along the summed axis). It must reach the result before ``lands_before``."""

    zero: str
    other: str
    axis: str
    group_size: int | None
    lands_before: Stage

    def __str__(self) -> str:
        if self.group_size is not None:
            return f"zero x sum of {self.other} over each group of {self.group_size} {self.axis}s"
        return f"sum over {self.axis} of {self.other} x zero"


class Missing(_Text):
    """A folded product whose graph adds no correction term: `foldc.plan.check_plan` refuses it."""

    CORRECTION = "MISSING"


def token_group(enc) -> int | None:
    """`TilingConstraint.token_tile_multiple` of ``enc`` where no head_dim is at hand: G for a
    channel-wise encoding (groups of G tokens), None for a token-wise one or a plain operand."""
    return enc.group_size if enc is not None and GroupAxis.of(enc) is GroupAxis.TOKEN else None


@dataclass(frozen=True)
class TilingConstraint:
    """The numbers a kernel's tiling and a cache's writes must respect for one operand (eq. 5).

    ``token_tile_multiple``: channel-wise encodings, G: a token tile must lie inside one group of
    G tokens (the tile divides G), and a cache append or page holds whole groups (a multiple of G).
    ``channels_per_field``: encoded operands, ``head_dim * bits // 8``, the contiguous channel range
    one bit field of the planar packing holds (foldc/encoding.py).
    ``channel_group``: token-wise encodings, G channels per group; a kernel that scales per bit
    field needs whole fields per group (`whole_fields`). All None for a plain operand.
    """

    token_tile_multiple: int | None = None
    channels_per_field: int | None = None
    channel_group: int | None = None

    @classmethod
    def of(cls, enc, head_dim: int) -> "TilingConstraint":
        """The constraint of encoding ``enc`` (None: plain) on rows of ``head_dim`` channels."""
        if enc is None:
            return cls()
        tokens = token_group(enc)
        return cls(token_tile_multiple=tokens, channels_per_field=head_dim * enc.bits // 8,
                   channel_group=None if tokens else enc.group_size)

    @property
    def token_alignment(self) -> int:
        """Tokens a write, a page or one scale row spans: G for channel-wise groups, else 1."""
        return self.token_tile_multiple or 1

    @property
    def whole_fields(self) -> bool:
        """Each channel group is made of whole bit fields (True where groups do not cut channels)."""
        return self.channel_group is None or self.channel_group % self.channels_per_field == 0

    def __str__(self) -> str:
        parts = []
        if self.token_tile_multiple is not None:
            parts.append(f"a token tile lies in one group of {self.token_tile_multiple} tokens")
        if self.channel_group is not None:
            parts.append(f"channel groups of {self.channel_group} over bit fields of {self.channels_per_field} "
                         "channels")
        return "; ".join(parts) or "-"
