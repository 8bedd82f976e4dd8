"""`prove_gemm(plan)`: show with sympy that a GEMM plan equals dequantize-then-matmul.

The same three layers as for attention (foldc.proof): the plan rules (eq. 5, 6, 11), lemmas
over a symbolic group size (eq. 3 with the plan's code bias, and eq. 15 when both operands are
encoded), and a symbolic run of the plan's own graph at a small instance with every group size
shrunk (two k groups for a k-group weight, one for per-channel/per-token), compared entry by
entry with the dequantized product.
"""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import sympy as sp

from ..errors import PlanError, ProofError
from ..executor import Executor, SympyOps
from ..ir import K, M, N, GroupedAxis, Input, param_axes, verify
from ..ir.graph import Graph
from ..passes import check_plan_rules
from .plan import check_gemm_plan
from ..proof import ProofReport, _linear_sums, _symbols, check_fold_kinds, group_lemma

#: small group sizes tried: group 2 and group 3 (k = 4 and 6 for a k-group weight)
SMALL_GROUPS = (2, 3)


def expansion_lemma() -> str:
    """Eq. 15 over a symbolic group size g: the product of two affine operands expands into the
    codes product, the two row/column sums and a constant."""
    g = sp.Symbol("g", integer=True, positive=True)
    r = sp.Symbol("r", integer=True)
    a, b = sp.IndexedBase("a"), sp.IndexedBase("b")
    sa, za, sb, zb = sp.symbols("s_a z_a s_b z_b")
    lhs = sp.Sum((sa * a[r] + za) * (sb * b[r] + zb), (r, 0, g - 1))
    rhs = (sa * sb * sp.Sum(a[r] * b[r], (r, 0, g - 1)) + sa * zb * sp.Sum(a[r], (r, 0, g - 1))
           + za * sb * sp.Sum(b[r], (r, 0, g - 1)) + g * za * zb)
    if sp.simplify((_linear_sums(lhs) - _linear_sums(rhs)).doit()) != 0:
        raise ProofError("not-exact", "the two-operand expansion (eq. 15) does not hold")
    return ("two encoded operands (eq. 15): sum_r (s_a a[r] + z_a)(s_b b[r] + z_b) = s_a s_b sum a b "
            "+ s_a z_b sum a + z_a s_b sum b + g z_a z_b")


def _shrink(graph: Graph, k: int, small: int) -> tuple[Graph, int]:
    """The graph with each k group of size G < k mapped to ``small`` and whole-k groups to the small k."""
    partial = sorted({a.group_size for n in graph for a in n.axes if isinstance(a, GroupedAxis) and a.group_size < k}
                     | {n.encoding.group_size for n in graph.nodes_of(Input)
                        if n.encoding is not None and n.encoding.group_size < k})
    if len(partial) > 1:
        raise PlanError("group-mismatch", f"the plan mixes k groups of sizes {partial}; one group size per GEMM")
    k_small = 2 * small if partial else small

    def size(gs: int) -> int:
        return k_small if gs >= k else small

    def axis(a):
        return GroupedAxis(a.base, size(a.group_size)) if isinstance(a, GroupedAxis) else a

    out = graph.copy()
    for node in graph:
        changes = {"axes": tuple(axis(a) for a in node.axes)}
        for f in ("split", "groups"):
            if getattr(node, f, None) is not None:
                changes[f] = axis(getattr(node, f))
        if isinstance(node, Input) and node.encoding is not None:
            changes["encoding"] = replace(node.encoding, group_size=size(node.encoding.group_size))
        out.replace_node(replace(node, **changes))
    return out, k_small


def symbolic_check(graph: Graph, k: int, small: int) -> str:
    g, k_small = _shrink(graph, k, small)
    sizes = {M: 2, N: 2, K: k_small}
    binds, values = {}, {}
    for inp in g.nodes_of(Input):
        if inp.role == "ones":
            continue
        shape = tuple(sizes[a] for a in inp.axes)
        if inp.encoding is None:
            binds[(inp.name, "values")] = values[inp.name] = _symbols(inp.name, shape)
            continue
        pax = param_axes(inp)
        pshape = tuple(-(-sizes[a.base] // a.group_size) if isinstance(a, GroupedAxis) else sizes[a] for a in pax)
        c, s, z = _symbols(f"c{inp.name}", shape), _symbols(f"s{inp.name}", pshape), _symbols(f"z{inp.name}", pshape)
        binds.update({(inp.name, "codes"): c, (inp.name, "scale"): s, (inp.name, "zero"): z})
        values[inp.name] = _expand(s, pax, sizes) * c + _expand(z, pax, sizes)
    env = Executor(g, SympyOps(), binds, sizes, 1, None, 1).run()
    have = env[g.output].data
    want = np.einsum("mk,nk->mn", values["x"], values["w"], optimize=False)
    for idx in np.ndindex(*want.shape):
        if sp.expand(have[idx] - want[idx]) != 0:
            raise ProofError("not-exact", f"the folded output differs from dequantize-then-matmul at index {idx} "
                             f"on the instance m=2, n=2, k={k_small}")
    return f"m=2, n=2, k={k_small} (k groups of {small if k_small > small else k_small})"


def _expand(p: np.ndarray, axes, sizes) -> np.ndarray:
    for dim, a in enumerate(axes):
        if isinstance(a, GroupedAxis):
            p = np.repeat(p, a.group_size, axis=dim).take(np.arange(sizes[a.base]), axis=dim)
    return p


def prove_gemm(the_plan) -> ProofReport:
    t0 = time.perf_counter()
    graph = the_plan.graph
    verify(graph)
    check_fold_kinds(graph)
    check_plan_rules(graph)
    check_gemm_plan(the_plan)   # the decisions a kernel reads are the graph's, and the graph is the spec's
    lemmas = [f"{name}: " + group_lemma(p.fold, p.code_bias) for name, p in the_plan.operands.items()
              if p.fold in ("acc-fold", "operand-fold")]
    if len(the_plan.operands) == 2 and all(p.fold == "acc-fold" for p in the_plan.operands.values()):
        lemmas.append(expansion_lemma())
    instances = tuple(symbolic_check(graph, the_plan.spec.k, small) for small in SMALL_GROUPS)
    return ProofReport(dict(the_plan.folds), tuple(lemmas), instances,
                       ("output = dequantize-then-matmul, every entry",), time.perf_counter() - t0)
