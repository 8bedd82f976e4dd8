"""`plan(spec)`: run the passes and summarise, per product, what a backend must generate.

A `ProductPlan` says, for one contraction, with no reference to the layout it came from:
which operand is encoded and along which axis its groups run, the fold kind, where the scale
goes, the correction term, what it must land before, the tiling constraint, and the cost
figures. A backend reads these fields (and the graph) and nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from fractions import Fraction

from .builder import build_decode_attention
from .cost import IssueVerdict, verdicts
from .errors import SpecError
from .ir import Contract, Correction, Graph, Input
from .precision import UNIT_ROUNDOFF, PrecisionDecision, product_precision
from .passes import FOLD_POLICIES, PassRecord, TileConstraint, default_passes, fold_cost, rows_sharing_group, run_pipeline
from .spec import AttentionSpec

PRODUCT_ORDER = ("qk", "pv")


@dataclass(frozen=True)
class ProductPlan:
    product: str
    encoded: str | None
    other: str
    reduce: str
    fold: str
    group_axis: str | None = None
    group_size: int | None = None
    bits: int | None = None
    code_bias: int = 0
    scale_site: str = "-"
    correction: str = "-"
    lands_before: str = "-"
    constraints: tuple[TileConstraint, ...] = ()
    rows_per_group: int | None = None
    fold_ops_per_value: Fraction | None = None
    reason: str = ""
    break_even: str = ""
    issue: tuple[IssueVerdict, ...] = field(default=(), compare=False)
    #: how the MMA operand is rounded for the query dtype the plan was made for (eq. 6a); None
    #: for a plan made without a dtype (reference, executor, proofs: no rounding)
    precision: PrecisionDecision | None = None


@dataclass(frozen=True)
class Plan:
    spec: AttentionSpec
    graph: Graph = field(compare=False)
    products: dict[str, ProductPlan] = field(compare=False)
    constraints: tuple[TileConstraint, ...] = ()
    passes: tuple[PassRecord, ...] = ()
    dtype: str | None = None     # the query dtype the precision decisions are for (eq. 6a)
    operand_dtype: str | None = None   # the MMA operand dtype where it is not the query's

    @property
    def folds(self) -> dict[str, str]:
        """``{"qk": ..., "pv": ...}`` with values acc-fold, operand-fold, dequant or none."""
        return {name: p.fold for name, p in self.products.items()}

    def with_graph(self, graph: Graph) -> "Plan":
        """The same plan over an edited graph (used to check hand-made or mutated plans)."""
        return _make_plan(self.spec, graph, self.passes, self.dtype, self.operand_dtype)

    def __str__(self) -> str:
        from .explain import plan_summary

        return plan_summary(self)


def plan(spec: AttentionSpec, code_bias: dict[str, int] | None = None, fold_policy: str = "auto",
         dtype: str | None = None, operand_dtype: str | None = None) -> Plan:
    """Plan decode attention for ``spec``: pick each fold, insert corrections, check ordering.

    ``code_bias`` maps "key"/"value" to the constant a backend ORs into the codes (eq. 7); the
    reference plan uses none. ``fold_policy="dequant"`` forces per-value reconstruction.
    ``dtype`` ("fp16" or "bf16", the query's): also choose each product's operand precision from
    the error model of eq. 6a (`ProductPlan.precision`); without it no precision is decided.
    ``operand_dtype``: the matrix unit's operand dtype where it differs from the query's (the
    register-operand kernel feeds fp16 operands to bf16 queries' products).
    A `foldc.GemmSpec` is planned by `foldc.gemm.plan.gemm_plan` with the same passes.
    """
    from .gemm.spec import GemmSpec

    if isinstance(spec, GemmSpec):
        from .gemm.plan import gemm_plan

        return gemm_plan(spec, code_bias, fold_policy)
    if not isinstance(spec, AttentionSpec):
        raise SpecError(f"spec must be a foldc.AttentionSpec, got {type(spec).__name__}")
    if fold_policy not in FOLD_POLICIES:
        raise SpecError(f"fold_policy={fold_policy!r} is not one of {FOLD_POLICIES}")
    if dtype is not None and dtype not in UNIT_ROUNDOFF:
        raise SpecError(f"dtype={dtype!r} is not one of {sorted(UNIT_ROUNDOFF)} (the query's dtype) or None")
    if operand_dtype is not None and (dtype is None or operand_dtype not in UNIT_ROUNDOFF):
        raise SpecError(f"operand_dtype={operand_dtype!r} needs a query dtype and must be one of "
                        f"{sorted(UNIT_ROUNDOFF)} or None")
    unknown = sorted(set(code_bias or {}) - {"key", "value"})
    if unknown:
        raise SpecError(f"code_bias has unknown role(s) {unknown}; use 'key' and/or 'value'")
    graph, log = run_pipeline(build_decode_attention(spec), default_passes(code_bias, fold_policy))
    return _make_plan(spec, graph, tuple(log), dtype, operand_dtype)


def _make_plan(spec: AttentionSpec, graph: Graph, log, dtype: str | None = None,
               operand_dtype: str | None = None) -> Plan:
    constraints = tuple(graph.meta.get("constraint", ()))
    products = {}
    for name in PRODUCT_ORDER:
        p = _product_plan(graph, name, spec, constraints)
        if dtype is not None:   # eq. 6a: the operand precision, from the product's decisions
            p = replace(p, precision=product_precision(p, dtype, operand_dtype=operand_dtype))
        products[name] = p
    return Plan(spec, graph, products, constraints, tuple(log), dtype, operand_dtype)


def _product_plan(graph: Graph, name: str, spec: AttentionSpec, constraints) -> ProductPlan:
    role, other, reduce = {"qk": ("key", "q", "channel"), "pv": ("value", "p", "token")}[name]
    contracts = [n for n in graph.nodes_of(Contract) if n.product == name]
    fold = contracts[0].fold if contracts else "none"
    inp = next(n for n in graph.nodes_of(Input) if n.role == role)
    enc = inp.encoding
    if enc is None:
        return ProductPlan(name, None, other, reduce, "none", reason=f"%{inp.name} is a plain operand")
    h = rows_sharing_group(graph, _probe_contract(name, inp, other, reduce))
    cost = fold_cost(h, enc.group_size)
    lands = "the softmax (max, exp)" if role == "key" else "the division by the denominator (rescaled with acc)"
    corr_node = next((n for n in graph.nodes_of(Correction) if n.product == name), None)
    if fold == "acc-fold":
        site = f"each group's partial sum (per {enc.group_size} {reduce}s)"
        corr = f"zero x sum of {other} over each group of {enc.group_size} {reduce}s"
    elif fold == "operand-fold":
        site = f"the other operand: {other} x scale, before the product"
        corr = f"sum over {reduce} of {other} x zero"
    else:
        site, corr = "each value (s*c + z, then the product)", "none (zero applied per value)"
    if corr_node is None and fold in ("acc-fold", "operand-fold"):
        corr = "MISSING"
    codes = graph[f"{inp.name}.codes"] if f"{inp.name}.codes" in graph else None
    return ProductPlan(
        product=name, encoded=inp.name, other=other, reduce=reduce, fold=fold, group_axis=enc.group_axis,
        group_size=enc.group_size, bits=enc.bits, code_bias=getattr(codes, "bias", 0), scale_site=site,
        correction=corr, lands_before=lands, constraints=tuple(c for c in constraints if c.product == name),
        rows_per_group=h, fold_ops_per_value=cost, reason=graph.meta.get(f"reason.{name}", ""),
        break_even=graph.meta.get(f"break-even.{name}", ""),
        issue=tuple(verdicts(fold, enc.bits, cost if fold != "dequant" else 0)),
    )


def _probe_contract(name, inp, other, reduce) -> Contract:
    """A stand-in contraction of ``other`` with the encoded input, to count rows per group."""
    return Contract(f"__probe_{name}", (), lhs=other, rhs=inp.name, reduce=reduce, product=name)
