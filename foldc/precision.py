"""Operand precision: how a fold's rounded matrix-unit operand is carried (docs/derivation.md, eq. 6a).

Plain attention in the query's dtype rounds each product's operands once (the dequantized K, or
P before the PV product, FlashAttention-style) and accumulates in fp32. A fold changes what is
rounded:

- operand-fold (eq. 4) rounds the pre-scaled operand ``o x s`` and multiplies it by the code
  ``c``, while the correction ``sum o x z`` (eq. 6) is exact. The rounding error is multiplied
  by ``s x c = v - z``, not by the value ``v``: where ``|z|`` is large against ``|v|`` the codes
  term and the correction cancel and the error does not (issue 17).
- acc-fold (eq. 3) and dequant feed the operand as plain attention does; their error equals
  plain's provided the correction reads the operand as rounded (``z x sum rho(P)``).
- a code bias folded into the zero (eq. 7) makes the fp32 accumulator hold ``(beta + c) x o'``.

`error_ratio` bounds each product's rounding error relative to plain attention's over the same
dequantized values (first-order, random-rounding model, eq. 6a); `choose_precision` keeps one
rounding where that bound is within `TARGET` and splits the operand into hi + lo otherwise.
Pure functions of the product's decisions, the query dtype and the encoding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from .errors import PlanError

#: unit roundoff of the matrix unit's input dtypes and of its fp32 accumulator
UNIT_ROUNDOFF = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
ACCUMULATOR_ROUNDOFF = 2.0 ** -24
#: every product's rounding error must stay within this multiple of plain attention's
TARGET = 2.0
#: most of plain attention's error a folded code bias may add through the fp32 accumulator (eq. 6a):
#: the bound assumes the query's weight spreads like the values; a query that meets the keys where
#: they are small breaks it by several times (fp16, bias 1024, INT2 keys with outlier channels: 3.5x
#: plain fp16 attention's error under the interpreter, 2.6x on the H200; with bias 0, 0.8x)
BIAS_BUDGET = 0.1


class OperandPrecision(Enum):
    """How the product's matrix-unit operand is rounded."""

    PLAIN = "plain"     # no pre-scaled operand: q, rho(P) or rho(s*c + z), as plain attention rounds them
    SINGLE = "single"   # the pre-scaled operand rounded once to the MMA dtype
    SPLIT = "split"     # the pre-scaled operand as hi + lo, two MMA terms (~2x the mantissa)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class PrecisionDecision:
    """The chosen precision of one product and the bounds (eq. 6a) it was chosen from."""

    precision: OperandPrecision
    dtype: str
    bound: float                  # bound of the chosen precision (error / plain attention's)
    single: float | None = None   # operand-fold only: the bound with one rounding
    split: float | None = None    # operand-fold only: the bound with hi + lo
    target: float = TARGET
    operand_dtype: str | None = None   # the matrix unit's operand dtype, where it is not ``dtype``
    bar_dtype: str | None = None       # the plain attention whose error is the bar, where it is not ``dtype``

    @property
    def split_operand(self) -> bool:
        return self.precision is OperandPrecision.SPLIT

    def __str__(self) -> str:
        text = f"{self.dtype}: {self.precision}, error <= {self.bound:.2g}x plain {self.bar_dtype or self.dtype} attention's"
        if self.operand_dtype not in (None, self.dtype):
            text += f" ({self.operand_dtype} operands)"
        if self.single is not None and self.precision is OperandPrecision.SPLIT:
            text += f" (one rounding: <= {self.single:.3g}x)"
        return text


def spread_bound(group_size: int) -> float:
    """kappa of eq. 6a: rms of ``s x c`` over a group over the rms of its dequantized values, at most
    ``sqrt(2 (g - 1))``. Min-max codes give ``s x c`` in ``[0, R]`` (R the group's range), 0 at the
    group's minimum: the other g - 1 values add at most ``(g - 1) R^2`` to ``sum (s x c)^2``. The
    group holds its minimum m and maximum m + R, so ``sum v^2 >= m^2 + (m + R)^2 >= R^2 / 2``."""
    return math.sqrt(2.0 * max(group_size - 1, 0))


def error_ratio(fold: str, precision: OperandPrecision, dtype: str, group_size: int | None, bits: int | None,
                code_bias: int = 0, operand_dtype: str | None = None, bar_dtype: str | None = None) -> float:
    """Bound (eq. 6a) of a product's rounding error over plain ``bar_dtype`` attention's (default
    ``dtype``, the query's) on the same values, for a kernel whose matrix-unit operands are
    ``operand_dtype`` (default ``dtype``: the Triton kernel; the register-operand kernel feeds fp16
    operands to bf16 queries' products too)."""
    operand_dtype = dtype if operand_dtype is None else operand_dtype
    bar_dtype = dtype if bar_dtype is None else bar_dtype
    for name, value in (("dtype", dtype), ("operand_dtype", operand_dtype), ("bar_dtype", bar_dtype)):
        if value not in UNIT_ROUNDOFF:
            raise PlanError("precision", f"{name}={value!r} is not a matrix-unit dtype; use one of "
                            f"{sorted(UNIT_ROUNDOFF)}")
    if fold in ("none", "dequant"):
        return UNIT_ROUNDOFF[operand_dtype] / UNIT_ROUNDOFF[bar_dtype]   # plain's operands, rounded to operand_dtype
    u, u_op = UNIT_ROUNDOFF[bar_dtype], UNIT_ROUNDOFF[operand_dtype]
    kappa, cmax = spread_bound(group_size), (1 << bits) - 1
    accumulator = kappa * (abs(code_bias) + cmax) / cmax * ACCUMULATOR_ROUNDOFF / u
    if fold == "acc-fold":
        if precision is not OperandPrecision.PLAIN:
            raise PlanError("precision", f"an acc-fold has no pre-scaled operand to carry as {precision}")
        return u_op / u + accumulator    # rho(P) (or the exact q) with the correction from the same operand
    if fold != "operand-fold":
        raise PlanError("precision", f"fold={fold!r} is not one of none, dequant, acc-fold, operand-fold")
    operand = {OperandPrecision.SINGLE: u_op, OperandPrecision.SPLIT: u_op * u_op}.get(precision)
    if operand is None:
        raise PlanError("precision", "an operand-fold rounds its pre-scaled operand: choose single or split")
    return kappa * operand / u + accumulator


def choose_precision(fold: str, dtype: str, group_size: int | None, bits: int | None, code_bias: int = 0,
                     target: float = TARGET, operand_dtype: str | None = None, bar_dtype: str | None = None
                     ) -> PrecisionDecision:
    """One rounding where its bound is within ``target``, else hi + lo; a PlanError if neither is.
    The bar is plain ``bar_dtype`` attention's error (default ``dtype``'s)."""
    bar = bar_dtype or dtype
    keep = dict(target=target, operand_dtype=operand_dtype, bar_dtype=bar_dtype)
    if fold != "operand-fold":
        bound = error_ratio(fold, OperandPrecision.PLAIN, dtype, group_size, bits, code_bias, operand_dtype, bar_dtype)
        if bound > target:   # only the accumulator's term grows: with the group's spread, and with the bias
            fix = "plan with bias 0" if code_bias else "use smaller groups or fold_policy='dequant'"
            raise PlanError("precision", f"{fold} of {bits}-bit codes in groups of {group_size} with a code bias of "
                            f"{code_bias}: the fp32 accumulator's error bound is {bound:.3g}x plain {bar} attention's, "
                            f"above {target:g}x; {fix}")
        return PrecisionDecision(OperandPrecision.PLAIN, dtype, bound, **keep)
    single = error_ratio(fold, OperandPrecision.SINGLE, dtype, group_size, bits, code_bias, operand_dtype, bar_dtype)
    split = error_ratio(fold, OperandPrecision.SPLIT, dtype, group_size, bits, code_bias, operand_dtype, bar_dtype)
    if single <= target:
        return PrecisionDecision(OperandPrecision.SINGLE, dtype, single, single, split, **keep)
    if split <= target:
        return PrecisionDecision(OperandPrecision.SPLIT, dtype, split, single, split, **keep)
    fix = "plan with bias 0 or fold_policy='dequant'" if code_bias else "use smaller groups or fold_policy='dequant'"
    raise PlanError("precision", f"operand-fold of {bits}-bit codes in groups of {group_size}, code bias "
                    f"{code_bias}: even hi + lo bounds the error at {split:.3g}x plain {bar} attention's, above "
                    f"{target:g}x; {fix}")


def code_bias_allowed(dtype: str, bits: int, group_size: int, code_bias: int, operand_dtype: str | None = None,
                      budget: float = BIAS_BUDGET) -> bool:
    """Whether a code bias folded into the zero (eq. 7) keeps its accumulator term of eq. 6a within
    ``budget`` of plain ``dtype`` attention's error; else the backend subtracts it per value."""
    u = UNIT_ROUNDOFF[dtype]
    cmax = (1 << bits) - 1
    return spread_bound(group_size) * (abs(code_bias) + cmax) / cmax * ACCUMULATOR_ROUNDOFF / u <= budget


def key_reduction_group(spec) -> int:
    """Key values sharing one (scale, zero) along the scores' reduction (channels): a token-wise
    group, or the whole head for channel-wise keys (their groups run along tokens)."""
    return spec.k.group_size if spec.k.group_axis == "channel" else spec.head_dim


def product_precision(product, dtype: str, target: float = TARGET, operand_dtype: str | None = None,
                      bar_dtype: str | None = None) -> PrecisionDecision:
    """`choose_precision` for a `foldc.plan.ProductPlan`."""
    return choose_precision(product.fold, dtype, product.group_size, product.bits, product.code_bias, target,
                            operand_dtype, bar_dtype)
