"""`gemm_plan(spec)`: the same passes as attention, summarised per encoded operand of a GEMM.

An `OperandPlan` says, for the weight ``w`` or the activation ``x``: the fold the passes chose
(read back from the folded graph's structure), where its scale goes, its correction term, the
tiling constraint, and the cost of eq. 16. A backend reads these fields and the graph.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from fractions import Fraction

from ..cost import IssueVerdict, verdicts
from ..errors import PlanError, SpecError
from ..ir import Correction, Dequantize, Graph, Input, Prescale, ScaleGroups, verify
from ..passes import (FOLD_POLICIES, PassRecord, TileConstraint, check_code_bias, check_spec_inputs, default_passes,
                      fold_cost, run_pipeline)
from .builder import build_gemm
from .spec import GemmSpec

ROLES = {"w": "weight", "x": "activation"}


@dataclass(frozen=True)
class OperandPlan:
    operand: str
    encoding: str
    fold: str
    group_size: int | None = None
    bits: int | None = None
    fields: int | None = None       # codes per byte: bit fields of a packed byte (8 // bits)
    row_bytes: int | None = None    # bytes of one packed row along k: field f of byte j is k = f * row_bytes + j
    code_bias: int = 0
    scale_site: str = "-"
    correction: str = "-"
    rows_per_group: int | None = None
    fold_ops_per_value: Fraction | None = None
    reason: str = ""
    break_even: str = ""
    issue: tuple[IssueVerdict, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class GemmPlan:
    spec: GemmSpec
    graph: Graph = field(compare=False)
    operands: dict[str, OperandPlan] = field(compare=False)
    constraints: tuple[TileConstraint, ...] = ()
    passes: tuple[PassRecord, ...] = ()
    kind = "gemm"

    @property
    def folds(self) -> dict[str, str]:
        """``{"w": ..., "x": ...}``: acc-fold, operand-fold, dequant or none per operand."""
        return {name: p.fold for name, p in self.operands.items()}

    # attention plans call these "products"; reports iterate over either
    @property
    def products(self) -> dict[str, OperandPlan]:
        return self.operands

    def with_graph(self, graph: Graph) -> "GemmPlan":
        return _make_plan(self.spec, graph, self.passes)

    def __str__(self) -> str:
        lines = [f"plan for {self.spec.describe()}"]
        for name, p in self.operands.items():
            lines.append(f"  {name}: {p.fold:<12} scale -> {p.scale_site}; correction: {p.correction}")
        for c in self.constraints:
            lines.append(f"  tiling: {c}")
        return "\n".join(lines)


def gemm_plan(spec: GemmSpec, code_bias: dict[str, int] | None = None, fold_policy: str = "auto") -> GemmPlan:
    """Plan ``y = x @ w.T`` for ``spec``. ``code_bias`` maps "weight"/"activation" to a constant a
    backend adds to the codes (eq. 7), folded into the zero."""
    if not isinstance(spec, GemmSpec):
        raise SpecError(f"spec must be a foldc.GemmSpec, got {type(spec).__name__}")
    if fold_policy not in FOLD_POLICIES:
        raise SpecError(f"fold_policy={fold_policy!r} is not one of {FOLD_POLICIES}")
    code_bias = check_code_bias(code_bias, ("weight", "activation"))
    graph, log = run_pipeline(build_gemm(spec), default_passes(code_bias, fold_policy))
    return _make_plan(spec, graph, tuple(log))


def check_gemm_plan(the_plan: GemmPlan) -> GemmPlan:
    """``the_plan`` if its graph reads its spec's inputs (rule ``spec-mismatch``) and each operand's decisions are
    the ones `gemm_plan` reads off that graph (rule ``decision-mismatch``), else PlanError naming the field: the
    proof runs the graph, a kernel reads the decisions (fold, bits, group size, fields, row bytes, code bias), so
    one edited with `dataclasses.replace` would have a kernel generated from a plan that was not proved."""
    spec, graph = the_plan.spec, the_plan.graph
    verify(graph)
    check_spec_inputs(graph, build_gemm(spec), spec.describe())
    fresh = _make_plan(spec, graph, the_plan.passes)
    if the_plan.constraints != fresh.constraints or set(the_plan.operands) != set(fresh.operands):
        raise PlanError("decision-mismatch", f"the plan's operands {sorted(the_plan.operands)} and tiling constraints "
                        f"{[str(c) for c in the_plan.constraints]} are not its graph's {sorted(fresh.operands)}, "
                        f"{[str(c) for c in fresh.constraints]}", product="xw")
    for name, want in fresh.operands.items():
        have = the_plan.operands[name]
        for f in fields(OperandPlan):
            if f.compare and getattr(have, f.name) != getattr(want, f.name):
                raise PlanError("decision-mismatch", f"{name}: the plan's {f.name} is {getattr(have, f.name)!r}, but "
                                f"its graph implements {getattr(want, f.name)!r}; a kernel would be generated from "
                                "a decision that was not proved (plan the spec again)", product="xw")
    return the_plan


def structural_fold(graph: Graph, source: str) -> str:
    """The fold the graph applies to input ``source``, read from its structure."""
    for node in graph:
        if isinstance(node, ScaleGroups) and graph[node.scale].source == source:
            return "acc-fold"
        if isinstance(node, Prescale) and graph[node.scale].source == source:
            return "operand-fold"
        if isinstance(node, Dequantize) and node.source == source:
            return "dequant"
    return "none"


def _correction_text(graph: Graph, source: str) -> str:
    texts = []
    for corr in graph.nodes_of(Correction):
        if graph[corr.zero].source != source:
            continue
        other = graph[corr.other]
        group = next((str(a) for a in graph[corr.zero].axes if str(a).startswith(corr.reduce + "/")), corr.reduce)
        if corr.form == "presummed":
            o = "x" if source == "w" else "w"
            texts.append(f"zero({source}) x row sums of {o} per {group} group, folded in turn into "
                         f"scale({o}) x row sums of {o}'s codes + zero({o}) x group length (eq. 15)")
        elif isinstance(other, Input) and other.role == "ones":
            texts.append(f"zero({source}) x group length (the constant term of eq. 15)")
        elif corr.form == "group-sum":
            what = (f"column sums of {other.source}'s codes" if hasattr(other, "source") else
                    f"row sums of {other.name}")
            texts.append(f"zero({source}) x {what} over each {group} group")
        else:
            texts.append(f"sum over {corr.reduce} of %{other.name} x zero({source})")
    return "; ".join(texts) or ("none (zero applied per value)" if structural_fold(graph, source) == "dequant"
                                else "MISSING")


def _make_plan(spec: GemmSpec, graph: Graph, log) -> GemmPlan:
    constraints = tuple(graph.meta.get("constraint", ()))
    operands = {}
    for name, enc in (("w", spec.weight), ("x", spec.activation)):
        if enc is None:
            continue
        other = "x" if name == "w" else "w"
        fold = structural_fold(graph, name)
        g = enc.group_size or spec.k
        h = graph.sizes["m" if name == "w" else "n"]
        cost = fold_cost(h, g)
        if fold == "acc-fold":
            site = (f"each group's partial sum (per {g} k)" if enc.group_size else
                    "the finished sum, once per output (epilogue)")
        elif fold == "operand-fold":
            site = f"the other operand: {other} x scale, before the product"
        else:
            site = "each value (s*c + z, then the product)"
        codes = graph[f"{name}.codes"] if f"{name}.codes" in graph else None
        operands[name] = OperandPlan(
            operand=name, encoding=enc.short(), fold=fold, group_size=g, bits=enc.bits, fields=8 // enc.bits,
            row_bytes=spec.k // (8 // enc.bits),
            code_bias=getattr(codes, "bias", 0), scale_site=site, correction=_correction_text(graph, name),
            rows_per_group=h, fold_ops_per_value=cost,
            reason=graph.meta.get("reason.xw", "") if name == "w" else
            "folded in turn inside the weight's per-group partial sums (eq. 15)",
            break_even=graph.meta.get("break-even.xw", "") if name == "w" else
            f"fold costs 2*h/g = 2*{h}/{g} = {float(cost):.4g} ops/value: kept (eq. 16)",
            issue=tuple(verdicts(fold, enc.bits, cost if fold != "dequant" else 0)),
        )
    return GemmPlan(spec, graph, operands, constraints, tuple(log))
