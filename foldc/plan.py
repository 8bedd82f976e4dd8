"""`plan(spec)`: run the passes and summarise, per product, what a backend must generate.

A `ProductPlan` says, for one contraction, with no reference to the layout it came from:
which operand is encoded and along which axis its groups run, the fold kind, where the scale
goes, the correction term, what it must land before, the tiling constraint, and the cost
figures, each a typed decision of foldc/decisions.py. A backend and a serving layer read these
fields (and the graph) and nothing else; `plan_of(spec)` gives the (cached) plan of a spec, and
`check_plan` refuses a plan that breaks a fold rule.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields, replace
from fractions import Fraction

import torch

from .builder import build_decode_attention
from .cost import IssueVerdict, verdicts
from .decisions import (STAGE_OF, CorrectionTerm, FoldKind, GroupAxis, Missing, ScaleSite, ScaleTarget, Stage,
                        TilingConstraint)
from .errors import InputTypeError, PlanError, SpecError
from .ir import Contract, Correction, Graph, Input, structural_fold, verify
from .options import attention_kernel
from .precision import UNIT_ROUNDOFF, PrecisionDecision, product_precision
from .passes import (FOLD_POLICIES, FoldCosts, PassRecord, TileConstraint, check_code_bias, check_plan_rules,
                     check_spec_inputs, default_passes, fold_cost, rows_sharing_group, run_pipeline)
from .registry import attention_backend, workload_of
from .spec import AttentionSpec

PRODUCT_ORDER = ("qk", "pv")
OPERAND_PRODUCT = {"k": "qk", "v": "pv"}
SCALE_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclass(frozen=True)
class ProductPlan:
    """One product's decisions. For a plain operand (``encoded`` None, fold NONE) the encoding
    fields, ``scale_site`` and ``correction`` are None; a dequant product has no correction (None);
    a folded one whose graph adds none has ``correction`` `Missing.CORRECTION` (`check_plan`
    refuses it). ``constraints``: the ordering pass's records for this product (eq. 5);
    ``tiling``: the numbers a kernel's tiles and a cache's writes must respect."""

    product: str
    encoded: str | None
    other: str
    reduce: str
    fold: FoldKind
    group_axis: GroupAxis | None = None
    group_size: int | None = None
    bits: int | None = None
    scale_dtype: str | None = None
    code_bias: int = 0
    scale_site: ScaleSite | None = None
    correction: CorrectionTerm | Missing | None = None
    constraints: tuple[TileConstraint, ...] = ()
    tiling: TilingConstraint = TilingConstraint()
    rows_per_group: int | None = None
    fold_ops_per_value: Fraction | None = None
    reason: str = ""
    break_even: str = ""
    issue: tuple[IssueVerdict, ...] = field(default=(), compare=False)
    #: how the MMA operand is rounded for the query dtype the plan was made for (eq. 6a); None
    #: for a plan made without a dtype (reference, executor, proofs: no rounding)
    precision: PrecisionDecision | None = None

    @property
    def lands_before(self) -> Stage | None:
        """What this product's terms must reach first: the softmax (qk, eq. 8) or the division
        (pv, eq. 10); None for a plain operand."""
        if isinstance(self.correction, CorrectionTerm):
            return self.correction.lands_before
        return STAGE_OF[self.product] if self.encoded is not None else None

    @property
    def correction_missing(self) -> bool:
        """A folded product whose graph adds no correction term (eq. 6)."""
        return self.correction is Missing.CORRECTION

    @property
    def token_tile_multiple(self) -> int | None:
        """Channel-wise groups of G tokens: G (a token tile divides it); else None."""
        return self.tiling.token_tile_multiple


@dataclass(frozen=True)
class Plan:
    spec: AttentionSpec
    graph: Graph = field(compare=False)
    products: dict[str, ProductPlan] = field(compare=False)
    constraints: tuple[TileConstraint, ...] = ()
    passes: tuple[PassRecord, ...] = ()
    dtype: str | None = None     # the query dtype the precision decisions are for (eq. 6a)
    operand_dtype: str | None = None   # the MMA operand dtype where it is not the query's
    rows_per_program: int | None = None   # query rows sharing one reconstructed tile, where a kernel
    #                                       splits a KV head's rows into blocks (eq. 12's h); None: all
    bar_dtype: str | None = None   # the plain attention whose error bounds the precisions, where not dtype's

    @property
    def folds(self) -> dict[str, str]:
        """``{"qk": ..., "pv": ...}`` with values acc-fold, operand-fold, dequant or none (plain
        strings, for reports; each product's `ProductPlan.fold` is the `FoldKind`)."""
        return {name: str(p.fold) for name, p in self.products.items()}

    @property
    def token_alignment(self) -> int:
        """The lcm of the channel-wise groups' sizes (1 if none): a cache append, a page or a
        sequence's quantized body must hold a multiple of this many tokens."""
        return math.lcm(*(p.tiling.token_alignment for p in self.products.values()))

    def of_operand(self, name: str) -> ProductPlan:
        """The product that reads cache operand ``name``: "k" -> qk, "v" -> pv."""
        return self.products[OPERAND_PRODUCT[name]]

    def with_graph(self, graph: Graph) -> "Plan":
        """The same plan over an edited graph (used to check hand-made or mutated plans)."""
        return _make_plan(self.spec, graph, self.passes, self.dtype, self.operand_dtype, self.rows_per_program,
                          self.bar_dtype)

    def __str__(self) -> str:
        from .explain import plan_summary

        return plan_summary(self)


def plan(spec: AttentionSpec, code_bias: dict[str, int] | None = None, fold_policy: str = "auto",
         dtype: str | None = None, operand_dtype: str | None = None, target: str | None = None,
         kernel: str = "auto", rows_per_program: int | None = None, bar_dtype: str | None = None,
         fold_costs: FoldCosts | None = None) -> Plan:
    """Plan decode attention for ``spec``: pick each fold, insert corrections, check ordering.

    ``target`` ("sm_90", "sm_100", "interpret"): the plan the kernel ``foldc.compile(spec, target,
    kernel=kernel)`` runs for ``dtype`` queries (default bf16; fp16, the only one it runs, for "interpret"), with
    that kernel's code biases and
    operand dtype: the register-operand kernel's (`foldc.backends.gluon.lower.gluon_plan`) where it
    lowers the plan, else the generated Triton kernel's (`triton_plan`). The kernel is generated
    from exactly this plan; where neither kernel tiles ``spec`` (head_dim 8, channel groups of 7 tokens...)
    SpecError says why. ``code_bias`` and ``operand_dtype`` are then the target's, not options.

    ``code_bias`` maps "key"/"value" to the constant a backend ORs into the codes (eq. 7); the
    reference plan uses none. ``fold_policy="dequant"`` forces per-value reconstruction.
    ``dtype`` ("fp16" or "bf16", the query's): also choose each product's operand precision from
    the error model of eq. 6a (`ProductPlan.precision`); without it no precision is decided.
    ``operand_dtype``: the matrix unit's operand dtype where it differs from the query's (the
    register-operand kernel feeds fp16 operands to bf16 queries' products).
    ``bar_dtype``: the plain attention whose error is the bar (eq. 6a) where it is not the query's
    dtype's (the register-operand kernel holds fp16 queries to plain bf16 attention's error).
    ``rows_per_program``: the query rows of a KV head one program takes, where a kernel splits them
    into blocks that each reconstruct the tile on their own; the break-even (eq. 12) then weighs a
    fold against that many rows (None: all the query heads of a KV head).
    ``fold_costs``: a target kernel's departures from eq. 12's count (`foldc.passes.FoldCosts`, eq. 12a; the
    register-operand kernel's plan passes its own).
    A spec of a registered workload (`foldc.GemmSpec`) is planned by that workload (foldc/registry.py;
    `foldc.gemm.plan.gemm_plan`, with the same passes).
    """
    if target is None and (isinstance(kernel, bool) or kernel != "auto"):   # the reference plan: no kernel's
        raise SpecError(f"kernel={kernel!r} without target: the kernel's plan is a target's (its code bias, row "
                        "blocks, operand dtype); pass target='sm_90', 'sm_100' or 'interpret' with it, or drop kernel "
                        "for the reference plan")
    if target is not None:
        dtype = dtype or ("fp16" if target == "interpret" else "bf16")
        return _target_plan(spec, target, kernel, dtype, code_bias, operand_dtype, fold_policy, bar_dtype,
                            rows_per_program, fold_costs)
    workload = workload_of(spec)
    if workload is not None:
        attention_only = {"dtype": dtype, "operand_dtype": operand_dtype, "rows_per_program": rows_per_program,
                          "bar_dtype": bar_dtype, "fold_costs": fold_costs}
        given = [f"{name}={value!r}" for name, value in attention_only.items() if value is not None]
        if given:   # its plan decides no precision and no row blocks: they were dropped, silently
            raise SpecError(f"{', '.join(given)}: a {type(spec).__name__}'s plan takes code_bias and fold_policy only "
                            "(dtype, operand_dtype, rows_per_program, bar_dtype and fold_costs plan attention); drop "
                            "them")
        return workload.plan(spec, code_bias, fold_policy)
    if not isinstance(spec, AttentionSpec):
        raise SpecError(f"spec must be a foldc.AttentionSpec, got {type(spec).__name__}")
    if fold_policy not in FOLD_POLICIES:
        raise SpecError(f"fold_policy={fold_policy!r} is not one of {FOLD_POLICIES}")
    if dtype is not None and not _unit_dtype(dtype):
        raise SpecError(f"dtype={dtype!r} is not one of {sorted(UNIT_ROUNDOFF)} (the query's dtype) or None")
    for name, value in (("operand_dtype", operand_dtype), ("bar_dtype", bar_dtype)):
        if value is not None and (dtype is None or not _unit_dtype(value)):
            raise SpecError(f"{name}={value!r} needs a query dtype and must be one of {sorted(UNIT_ROUNDOFF)} or None")
    code_bias = check_code_bias(code_bias, ("key", "value"))
    if rows_per_program is not None and (isinstance(rows_per_program, bool) or not isinstance(rows_per_program, int)
                                         or not 1 <= rows_per_program <= spec.q_per_kv):
        raise SpecError(f"rows_per_program={rows_per_program!r} must be an int from 1 to the query heads per KV head "
                        f"({spec.q_per_kv}), or None")
    if fold_costs is not None and not isinstance(fold_costs, FoldCosts):
        raise SpecError(f"fold_costs={fold_costs!r} must be a foldc.passes.FoldCosts or None")
    graph, log = run_pipeline(build_decode_attention(spec),
                              default_passes(code_bias, fold_policy, rows_per_program, fold_costs))
    return _make_plan(spec, graph, tuple(log), dtype, operand_dtype, rows_per_program, bar_dtype)


def _unit_dtype(dtype) -> bool:
    return isinstance(dtype, str) and dtype in UNIT_ROUNDOFF   # a list or dict is no dtype (nor hashable)


def as_plan(the_plan, what: str):
    """``the_plan`` if it is a `Plan` or a registered workload's plan (a `foldc.gemm.GemmPlan`), else
    InputTypeError naming what was passed (a spec, say: it raised AttributeError)."""
    if isinstance(the_plan, Plan) or workload_of(getattr(the_plan, "spec", None)) is not None:
        return the_plan
    raise InputTypeError(f"{what}() takes a plan, got {type(the_plan).__name__}; make one with foldc.plan(spec)")


def _target_plan(spec, target: str, kernel: str, dtype: str, code_bias, operand_dtype, fold_policy,
                 bar_dtype=None, rows_per_program=None, fold_costs=None) -> Plan:
    """The plan of the kernel that runs ``spec`` on ``target`` for ``dtype`` queries (`plan`'s ``target``)."""
    if not isinstance(spec, AttentionSpec):
        raise SpecError(f"plan(..., target={target!r}) plans attention; got {type(spec).__name__} (plan a GemmSpec "
                        "without a target)")
    if target not in ("sm_90", "sm_100", "interpret"):
        raise SpecError(f"target={target!r}: plan(..., target=) takes 'sm_90', 'sm_100' or 'interpret' (the "
                        "reference plan has no target: leave it out)")
    if code_bias is not None or operand_dtype is not None or bar_dtype is not None:
        raise SpecError("code_bias, operand_dtype and bar_dtype are the target's with target= set; drop them or "
                        "drop target")
    for name, value in (("rows_per_program", rows_per_program), ("fold_costs", fold_costs)):
        if value is not None:   # the target's kernel sets its own row blocks and fold costs: it was dropped, silently
            raise SpecError(f"{name}={value!r} with target={target!r}: the target's kernel plans its own row blocks "
                            f"and fold costs; drop {name} (or drop target to plan with it)")
    if not _unit_dtype(dtype):
        raise SpecError(f"dtype={dtype!r} is not one of {sorted(UNIT_ROUNDOFF)} (the query's dtype)")
    if target == "interpret" and dtype != "fp16":   # its plan (bf16's code bias of 128) would describe no kernel
        raise SpecError(f"dtype={dtype!r}: the interpreter's kernel runs fp16 queries only (Triton's interpreter "
                        "mishandles bf16); plan it with dtype='fp16', or plan target='sm_90' for bf16")
    options = {} if fold_policy == "auto" else {"fold_policy": fold_policy}
    name = attention_kernel(spec, target, kernel, options, aot=True, dtype=dtype)
    backend = attention_backend(name)
    # attention_kernel picks the register-operand kernel only where it lowers; the Triton kernel is its fallback
    ok, reason = backend.lowerable(spec, dtype) if name != "gluon" and backend.lowerable is not None else (True, "")
    if not ok:   # no kernel is built for it: a plan would describe nothing that runs
        raise SpecError(f"target={target!r}: no kernel runs this spec ({reason}); its plan without a target is the "
                        "float64 executor's (target='reference')")
    return backend.target_plan(spec, dtype, fold_policy)


@functools.lru_cache(maxsize=256)
def plan_of(spec: AttentionSpec) -> Plan:
    """``plan(spec)``, cached per spec: for code that holds a spec and reads its decisions (the
    tiling numbers, the token alignment). Shared between callers: do not edit its graph."""
    if not isinstance(spec, AttentionSpec):
        raise SpecError(f"spec must be a foldc.AttentionSpec, got {type(spec).__name__}")
    return plan(spec)


def check_plan(the_plan: Plan) -> Plan:
    """Return ``the_plan`` if it keeps the fold rules, else raise PlanError naming the rule and the
    product: a folded product without its correction (eq. 6), a key correction that does not land
    before the softmax (eq. 8) or a value correction after the division (eq. 10), an unscaled
    partial sum across a group (eq. 5), a graph whose inputs are not the spec's (``spec-mismatch``)
    or a decision that is not the one its graph implements (``decision-mismatch``: a backend reads
    the decisions, the proof runs the graph). `plan` holds its graphs to these rules (the ordering
    pass); a plan made with `Plan.with_graph` or `dataclasses.replace` is checked here."""
    as_plan(the_plan, "check_plan")
    workload = workload_of(getattr(the_plan, "spec", None))
    if workload is not None:   # a GEMM plan: its workload's own check (this one raised AttributeError)
        return workload.check_plan(the_plan)
    for name, p in the_plan.products.items():
        if p.correction_missing:
            raise PlanError("missing-correction", f"{name}: %{p.encoded} is folded ({p.fold}) but the plan adds no "
                            f"correction term (zero x sum of {p.other}, eq. 6)", product=name)
        stage = STAGE_OF.get(name)
        if isinstance(p.correction, CorrectionTerm) and stage is not None and p.correction.lands_before is not stage:
            rule = "key-correction-after-softmax" if stage is Stage.SOFTMAX else "value-correction-after-division"
            raise PlanError(rule, f"{name}: its correction lands before {p.correction.lands_before}; it must land "
                            f"before {stage} (eq. {8 if stage is Stage.SOFTMAX else 10})", product=name)
    try:
        check_plan_rules(the_plan.graph)
    except PlanError as e:
        if not e.product or e.detail.startswith(f"{e.product}: "):
            raise
        raise PlanError(e.rule, f"{e.product}: {e.detail}", product=e.product) from e
    check_decisions(the_plan)
    return the_plan


def check_decisions(the_plan: Plan) -> None:
    """PlanError unless ``the_plan``'s graph reads the spec's inputs (rule ``spec-mismatch``) and each product's
    decisions are the ones `plan` reads off that graph (rule ``decision-mismatch``): the proof and the executor
    run the graph, a backend reads the decisions (the fold, bits, group size, tiling, code bias, precision...), so
    a decision edited with `dataclasses.replace` would have a kernel generated from a plan that was not proved."""
    spec, graph = the_plan.spec, the_plan.graph
    verify(graph)   # a hand-edited graph must be well-formed before its decisions can be read off it
    check_spec_inputs(graph, build_decode_attention(spec), spec.describe())
    if set(the_plan.products) != set(PRODUCT_ORDER):
        raise PlanError("decision-mismatch", f"the plan has products {sorted(the_plan.products)}; decode attention "
                        f"has {list(PRODUCT_ORDER)}")
    for node in graph.nodes_of(Contract):   # the fold a product's contractions name is the one its nodes apply
        applied = structural_fold(graph, node.product) or "none"
        if node.product in PRODUCT_ORDER and node.fold != applied:
            raise PlanError("decision-mismatch", f"{node.product}: %{node.name} says fold {node.fold}, but the graph "
                            f"applies {applied} (eq. 11)", product=node.product)
    fresh = _make_plan(spec, graph, the_plan.passes, the_plan.dtype, the_plan.operand_dtype, the_plan.rows_per_program,
                       the_plan.bar_dtype)
    if the_plan.constraints != fresh.constraints:
        raise PlanError("decision-mismatch", f"the plan's tiling constraints {[str(c) for c in the_plan.constraints]} "
                        f"are not its graph's {[str(c) for c in fresh.constraints]} (eq. 5)")
    for name in PRODUCT_ORDER:
        have, want = the_plan.products[name], fresh.products[name]
        for f in fields(ProductPlan):
            if f.compare and getattr(have, f.name) != getattr(want, f.name):
                raise PlanError("decision-mismatch", f"{name}: the plan's {f.name} is {getattr(have, f.name)!r}, but "
                                f"its graph implements {getattr(want, f.name)!r}; a backend would generate a kernel "
                                "from a decision that was not proved (plan the spec again, or edit the graph and "
                                "use Plan.with_graph)", product=name)


def _make_plan(spec: AttentionSpec, graph: Graph, log, dtype: str | None = None,
               operand_dtype: str | None = None, rows_per_program: int | None = None,
               bar_dtype: str | None = None) -> Plan:
    constraints = tuple(graph.meta.get("constraint", ()))
    products = {}
    for name in PRODUCT_ORDER:
        p = _product_plan(graph, name, spec, constraints, rows_per_program)
        if dtype is not None:   # eq. 6a: the operand precision, from the product's decisions
            p = replace(p, precision=product_precision(p, dtype, operand_dtype=operand_dtype, bar_dtype=bar_dtype))
        products[name] = p
    return Plan(spec, graph, products, constraints, tuple(log), dtype, operand_dtype, rows_per_program, bar_dtype)


def _product_plan(graph: Graph, name: str, spec: AttentionSpec, constraints,
                  rows_per_program: int | None = None) -> ProductPlan:
    role, other, reduce = {"qk": ("key", "q", "channel"), "pv": ("value", "p", "token")}[name]
    contracts = [n for n in graph.nodes_of(Contract) if n.product == name]
    fold = FoldKind(contracts[0].fold if contracts else "none")
    inp = next(n for n in graph.nodes_of(Input) if n.role == role)
    enc = inp.encoding
    if enc is None:
        return ProductPlan(name, None, other, reduce, FoldKind.NONE, reason=f"%{inp.name} is a plain operand")
    if fold is FoldKind.NONE:   # a hand-edited graph: the contraction of an encoded operand names no fold
        raise PlanError("fold-kind-mismatch", f"{name}: %{inp.name} is encoded but its contraction says fold none; "
                        "it is folded (eq. 3, 4) or dequantized (eq. 1)", product=name)
    h = rows_sharing_group(graph, _probe_contract(name, inp, other, reduce))
    if rows_per_program is not None:   # a kernel's row blocks each rebuild the tile for their own rows (eq. 12)
        h = min(h, rows_per_program)
    cost = fold_cost(h, enc.group_size)
    axis, g = GroupAxis.of(enc), enc.group_size
    target = {FoldKind.ACC_FOLD: ScaleTarget.ACCUMULATOR, FoldKind.OPERAND_FOLD: ScaleTarget.OPERAND}
    site = ScaleSite(target.get(fold, ScaleTarget.VALUE), other if fold.folded else inp.name, axis, g)
    corr = None
    if fold.folded:   # eq. 6: acc-fold sums the other operand per group, operand-fold contracts it with the zero
        corr = CorrectionTerm(inp.name, other, reduce, g if fold is FoldKind.ACC_FOLD else None, STAGE_OF[name])
        if not any(n.product == name for n in graph.nodes_of(Correction)):
            corr = Missing.CORRECTION
    codes = graph[f"{inp.name}.codes"] if f"{inp.name}.codes" in graph else None
    return ProductPlan(
        product=name, encoded=inp.name, other=other, reduce=reduce, fold=fold, group_axis=axis,
        group_size=g, bits=enc.bits, scale_dtype=SCALE_DTYPES[enc.scale_dtype], code_bias=getattr(codes, "bias", 0),
        scale_site=site, correction=corr, constraints=tuple(c for c in constraints if c.product == name),
        tiling=TilingConstraint.of(enc, spec.head_dim), rows_per_group=h, fold_ops_per_value=cost,
        reason=graph.meta.get(f"reason.{name}", ""), break_even=graph.meta.get(f"break-even.{name}", ""),
        issue=tuple(verdicts(fold, enc.bits, cost if fold is not FoldKind.DEQUANT else 0)),
    )


def _probe_contract(name, inp, other, reduce) -> Contract:
    """A stand-in contraction of ``other`` with the encoded input, to count rows per group."""
    return Contract(f"__probe_{name}", (), lhs=other, rhs=inp.name, reduce=reduce, product=name)
