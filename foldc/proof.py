"""`prove(plan)`: show with sympy that the folded plan equals dequantize-then-compute.

Three layers, all of which must pass:

1. Rules (structural): the fold kind matches the axes (eq. 11), key corrections land before the
   softmax (eq. 8), value corrections before the division (eq. 10), no unscaled partial sum
   crosses a group (eq. 5), every fold has its correction (eq. 6). A broken rule raises
   PlanError naming it.
2. Lemmas over a *symbolic* group size g (sympy ``Sum``): for each folded product, the folded
   group sum with the plan's code bias equals the dequantized group sum (eq. 3, 4, 7).
3. Whole-plan symbolic execution: the plan's own graph is run by the executor on symbols
   (queries, codes, scales, zeros, sm_scale; the running maxima are free symbols, eq. 9) at
   small concrete sizes chosen to hit every boundary: two channel groups, token groups with a
   partial last group, and token tiles that straddle group boundaries. The accumulator, the
   denominator and the output are compared with dequantize-then-compute, term by term after
   expansion. A mismatch raises ProofError.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np
import sympy as sp

from .errors import PlanError, ProofError
from .executor import Executor, SympyOps
from .ir import (CHANNEL, TOKEN, Accumulate, Codes, Contract, Divide, GroupedAxis, Input, OnlineSoftmax,
                 param_axes, structural_fold, verify)
from .ir.graph import Graph
from .passes import check_plan_rules, fold_from_axes
from .registry import workload_of

#: symbolic instances: (small group size, token tile). Group 2 with tiles of 3 makes tiles
#: straddle group boundaries; group 3 with tiles of 2 makes groups straddle tile boundaries.
INSTANCES = ((2, 3), (3, 2))


@dataclass(frozen=True)
class Instance:
    q_per_kv: int
    channels: int
    tokens: int
    token_tile: int
    groups: dict = field(default_factory=dict)  # base axis -> small group size of the encoding

    def __str__(self) -> str:
        gs = ", ".join(f"{b} groups of {g}" for b, g in sorted(self.groups.items())) or "no groups"
        return (f"{self.q_per_kv} query rows, {self.channels} channels, {self.tokens} tokens in tiles of "
                f"{self.token_tile} ({gs})")


@dataclass(frozen=True)
class ProofReport:
    plan_folds: dict
    lemmas: tuple[str, ...]
    instances: tuple[Instance, ...]
    checks: tuple[str, ...]
    seconds: float

    def __str__(self) -> str:
        lines = [f"proof of plan {self.plan_folds}: exact"]
        lines += [f"  lemma (symbolic g): {s}" for s in self.lemmas]
        lines += [f"  instance: {i}" for i in self.instances]
        lines += [f"  checked: {c}" for c in self.checks]
        lines.append(f"  ({self.seconds:.1f} s)")
        return "\n".join(lines)


# -- 1. rules ---------------------------------------------------------------------------
def check_fold_kinds(graph: Graph) -> None:
    """Rule fold-kind-mismatch (eq. 11): the structure must match what the axes call for."""
    for contract in graph.nodes_of(Contract):
        codes = [graph[o] for o in contract.operands() if isinstance(graph[o], Codes)]
        if not codes:
            continue
        enc = graph[codes[0].source]
        want, why = fold_from_axes(enc, contract.reduce)
        have = structural_fold(graph, contract.product)
        if have != want:
            raise PlanError("fold-kind-mismatch",
                            f"{contract.product} applies {have} to %{enc.name}, but {why}: the axes call for {want}")


# -- 2. lemmas over a symbolic group size ------------------------------------------------
def _linear_sums(expr):
    """Expand and split sums over added terms so sympy can compare them."""
    expr = sp.expand(expr)
    return expr.replace(lambda x: isinstance(x, sp.Sum),
                        lambda x: sp.Sum(sp.expand(x.function), *x.limits).expand())


def group_lemma(fold: str, bias: int) -> str:
    """Prove the per-group identity of ``fold`` with code bias ``bias`` for symbolic g."""
    g = sp.Symbol("g", integer=True, positive=True)
    r = sp.Symbol("r", integer=True)
    o, c = sp.IndexedBase("o"), sp.IndexedBase("c")
    beta = sp.Integer(bias)
    if fold == "acc-fold":
        s, z = sp.symbols("s z")
        dequantized = sp.Sum(o[r] * (s * c[r] + z), (r, 0, g - 1))
        folded = s * sp.Sum(o[r] * (c[r] + beta), (r, 0, g - 1)) + (z - beta * s) * sp.Sum(o[r], (r, 0, g - 1))
        text = "sum_r o[r](s c[r] + z) = s sum_r o[r] c'[r] + (z - b s) sum_r o[r], c' = c + b"
    else:
        s, z = sp.IndexedBase("s"), sp.IndexedBase("z")
        dequantized = sp.Sum(o[r] * (s[r] * c[r] + z[r]), (r, 0, g - 1))
        folded = sp.Sum((o[r] * s[r]) * (c[r] + beta), (r, 0, g - 1)) + \
            sp.Sum(o[r] * (z[r] - beta * s[r]), (r, 0, g - 1))
        text = "sum_r o[r](s[r] c[r] + z[r]) = sum_r (o[r] s[r]) c'[r] + sum_r o[r](z[r] - b s[r]), c' = c + b"
    if sp.simplify(_linear_sums(folded) - _linear_sums(dequantized)) != 0:
        raise ProofError("not-exact", f"the {fold} group identity with bias {bias} does not hold")
    return f"{fold} (bias b={bias}): {text}"


# -- 3. whole-plan symbolic execution -----------------------------------------------------
def _canon(expr):
    """Expanded form with products of exponentials merged and their arguments expanded."""
    expr = sp.expand(expr, power_exp=False)
    expr = sp.powsimp(expr, combine="exp")
    expr = expr.replace(lambda x: isinstance(x, sp.exp), lambda x: sp.exp(sp.expand(x.args[0])))
    return sp.expand(expr, power_exp=False)


def _shrink(graph: Graph, small_group: int, token_tile: int) -> tuple[Graph, Instance]:
    """Copy of the graph with every group size scaled so the encoding's group becomes ``small_group``."""
    ref = {}
    for inp in graph.nodes_of(Input):
        if inp.encoding is not None:
            ref.setdefault(inp.encoding.group_axis, inp.encoding.group_size)

    def small(ax):
        if not isinstance(ax, GroupedAxis):
            return ax
        base_ref = ref.get(ax.base, ax.group_size)
        size = max(1, ax.group_size * small_group // base_ref)
        if size > 2 * small_group:
            # a group many times the reference's (K in groups of 1, V of 128: 256 symbols a group, and an
            # instance sympy takes hours over): two reference groups a group where the reference's divides it,
            # else one more symbol, so that it stays a multiple of the reference's or does not
            size = 2 * small_group if ax.group_size % base_ref == 0 else 2 * small_group + 1
        return GroupedAxis(ax.base, size)

    out = graph.copy()
    for node in graph:
        changes = {"axes": tuple(small(a) for a in node.axes)}
        for f in ("split", "groups"):
            if getattr(node, f, None) is not None:
                changes[f] = small(getattr(node, f))
        if isinstance(node, Input) and node.encoding is not None:
            changes["encoding"] = replace(node.encoding, group_size=small(
                GroupedAxis(node.encoding.group_axis, node.encoding.group_size)).group_size)
        out.replace_node(replace(node, **changes))
    groups = {}
    for node in out:
        grouped = [a for a in node.axes if isinstance(a, GroupedAxis)]
        if isinstance(node, Input) and node.encoding is not None:  # dequantized inputs are grouped too
            grouped.append(GroupedAxis(node.encoding.group_axis, node.encoding.group_size))
        for ax in grouped:
            groups[ax.base] = max(groups.get(ax.base, 1), ax.group_size)
    channels = 2 * groups.get(CHANNEL, small_group)
    token_group = groups.get(TOKEN, small_group)
    inst = Instance(q_per_kv=2, channels=channels, tokens=2 * token_group + 1, token_tile=token_tile,
                    groups=groups)
    return out, inst


def _symbols(prefix: str, shape) -> np.ndarray:
    arr = np.empty(shape, dtype=object)
    for idx in np.ndindex(*shape):
        arr[idx] = sp.Symbol(f"{prefix}_" + "_".join(map(str, idx)), real=True)
    return arr


def _dim(ax, inst: Instance) -> int:
    size = {"batch": 1, "kv_head": 1, "q_per_kv": inst.q_per_kv, TOKEN: inst.tokens, CHANNEL: inst.channels}
    if isinstance(ax, GroupedAxis):
        return -(-size[ax.base] // ax.group_size)
    return size[ax]


def _expand_groups(x: np.ndarray, axes, inst: Instance) -> np.ndarray:
    for dim, ax in enumerate(axes):
        if isinstance(ax, GroupedAxis):
            x = np.repeat(x, ax.group_size, axis=dim)
            x = x.take(np.arange(_dim(ax.base, inst)), axis=dim)
    return x


def symbolic_check(graph: Graph, small_group: int, token_tile: int) -> tuple[Instance, list[str]]:
    small, inst = _shrink(graph, small_group, token_tile)
    bindings, values = {}, {}
    for inp in small.nodes_of(Input):
        shape = tuple(_dim(a, inst) for a in inp.axes)
        if inp.encoding is None:
            bindings[(inp.name, "values")] = values[inp.name] = _symbols(inp.name, shape)
            continue
        pax = param_axes(inp)
        pshape = tuple(_dim(a, inst) for a in pax)
        codes, s, z = _symbols(f"c{inp.name}", shape), _symbols(f"s{inp.name}", pshape), _symbols(f"z{inp.name}", pshape)
        bindings.update({(inp.name, "codes"): codes, (inp.name, "scale"): s, (inp.name, "zero"): z})
        values[inp.name] = _expand_groups(s, pax, inst) * codes + _expand_groups(z, pax, inst)
    sigma = sp.Symbol("sigma", positive=True)
    sizes = {"q_per_kv": inst.q_per_kv, CHANNEL: inst.channels, TOKEN: inst.tokens}
    env = Executor(small, SympyOps(), bindings, sizes, inst.tokens, sigma, inst.token_tile).run()
    q, k, v = values["q"], values["k"], values["v"]
    m_last = env["__max__"].data
    logits = sigma * np.einsum("bkhc,bknc->bkhn", q, k, optimize=False)
    weights = np.vectorize(sp.exp, otypes=[object])(logits - m_last[..., None])
    acc_ref = np.einsum("bkhn,bknc->bkhc", weights, v, optimize=False)
    l_ref = weights.sum(axis=-1)
    acc = small.nodes_of(Accumulate)[0].name
    checks = [("accumulator", env[acc].data, acc_ref), ("denominator", env["__denominator__"].data, l_ref)]
    lam = env["__lambda__"].data
    out = env[small.output].data
    checks.append(("output = accumulator / denominator", out * lam[..., None], env[acc].data))
    for what, have, want in checks:
        for idx in np.ndindex(*np.shape(want)):
            if _canon(have[idx] - want[idx]) != 0:
                raise ProofError("not-exact", f"the folded {what} differs from dequantize-then-compute at "
                                 f"index {idx} on the instance {inst}")
    return inst, [c[0] for c in checks]


def prove(the_plan) -> ProofReport:
    """Prove ``the_plan`` exact, or raise PlanError/ProofError naming the rule or value that fails."""
    from .plan import as_plan, check_plan

    as_plan(the_plan, "prove")
    workload = workload_of(getattr(the_plan, "spec", None))
    if workload is not None:   # e.g. a GEMM plan (foldc/gemm/proof.py)
        return workload.prove(the_plan)
    t0 = time.perf_counter()
    graph = the_plan.graph
    verify(graph)  # a hand-edited graph must be well-formed before its rules mean anything
    check_fold_kinds(graph)
    check_plan_rules(graph)
    if not graph.nodes_of(OnlineSoftmax) or not graph.nodes_of(Divide):
        raise PlanError("not-attention", "prove() handles decode-attention plans (online softmax and division)")
    check_plan(the_plan)   # the decisions a backend reads are the graph's, and the graph is the spec's
    lemmas = []
    for name, prod in the_plan.products.items():
        if prod.fold in ("acc-fold", "operand-fold"):
            lemmas.append(f"{name}: " + group_lemma(prod.fold, prod.code_bias))
    instances = []
    for small_group, token_tile in INSTANCES:
        inst, checks = symbolic_check(graph, small_group, token_tile)
        instances.append(inst)
    return ProofReport(dict(the_plan.folds), tuple(lemmas), tuple(instances), tuple(checks),
                       time.perf_counter() - t0)
