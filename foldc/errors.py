"""One exception family for foldc.

Every error names the offending value and says what to change. Subclasses also derive from
the matching builtin (ValueError, TypeError) so callers that catch those keep working.
"""
from __future__ import annotations


class FoldError(Exception):
    """Base of every error foldc raises on purpose."""


class SpecError(FoldError, ValueError):
    """A layout or attention spec that foldc cannot plan (bad bits, group size, heads...)."""


class InputError(FoldError, ValueError):
    """A tensor handed to a compiled kernel or to `quantize` that does not fit its spec."""


class ScaleOverflowError(InputError):
    """Values whose quantization scale or zero overflow the encoding's 16-bit scale dtype (the fix: fp32 scales)."""


class UnsupportedError(FoldError, NotImplementedError):
    """An operation foldc does not run (beam search's reorder_cache on a quantized cache...), named with the
    alternative."""


class InputTypeError(FoldError, TypeError):
    """An argument of the wrong kind (a plain tensor where an AffineTensor is needed...)."""


class TuneError(FoldError, RuntimeError):
    """`foldc.tune` timed no candidate: every launch configuration failed (each reason printed as it was skipped;
    the error names the first)."""


class GraphError(FoldError):
    """The IR verifier found a malformed graph (missing input, axis mismatch, cycle...)."""


class PlanError(FoldError):
    """A plan that breaks a fold rule. `rule` names the rule (see docs/derivation.md); `product`
    the product at fault ("qk", "pv", "xw"), where the rule knows it."""

    def __init__(self, rule: str, detail: str, product: str | None = None):
        self.rule = rule
        self.detail = detail
        self.product = product
        super().__init__(f"[{rule}] {detail}")


class ProofError(PlanError):
    """The symbolic check found the folded computation differs from dequantize-then-compute."""
