"""A plan whose decisions are not the ones its graph implements, or whose graph is not its spec's, is refused.

The proof and the float64 executor run a plan's graph; a backend reads the plan's typed decisions (the fold, bits,
group size, tiling numbers, code bias, operand precision...). `foldc.plan.check_plan` (which `prove`, the Triton
code generator and the register-operand lowering run first) holds the two together: one decision edited with
`dataclasses.replace` is rule ``decision-mismatch``, a graph edited to another spec's input ``spec-mismatch``.
Before, such plans passed check_plan and prove, and the Triton interpreter kernel generated from, e.g., a
channel-wise V plan whose token tile multiple was doubled (32 -> 64) returned 0.3 relative L2 off the float64
reference.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import foldc
from foldc.decisions import FoldKind, GroupAxis, ScaleTarget, Stage
from foldc.errors import FoldError, PlanError
from foldc.ir import Contract
from foldc.plan import check_plan
from foldc.precision import OperandPrecision

A = foldc.Affine
R = dataclasses.replace


def _encoding(layout, bits, group, scale):
    """Groups of 16 to 128 tokens, or 16 to 64 channels (a divisor of every head_dim drawn)."""
    return None if layout == "plain" else A(bits, layout, min(group, 64) if layout == "token" else group, scale)


ENCODINGS = st.builds(_encoding, st.sampled_from(["token", "channel", "plain"]), st.sampled_from([2, 4, 8]),
                      st.sampled_from([16, 32, 64, 128]), st.sampled_from([torch.float16, torch.float32]))
SPECS = st.builds(lambda r, kv, d, k, v: foldc.AttentionSpec(r * kv, kv, d, k, v), st.sampled_from([1, 4, 8, 32]),
                  st.sampled_from([1, 2]), st.sampled_from([64, 128, 256]), ENCODINGS, ENCODINGS)
TARGETS = st.sampled_from([None, ("interpret", "fp16"), ("sm_90", "bf16"), ("sm_100", "fp16")])


def _plan(spec, target):
    if target is None:
        return foldc.plan(spec)
    try:
        return foldc.plan(spec, target=target[0], dtype=target[1])
    except FoldError:   # no kernel of that target tiles the spec
        return foldc.plan(spec)


def _other(value, choices):
    return next(c for c in choices if c != value)


def _mutants(p):
    """One edited decision of ProductPlan ``p`` per entry: (what, the edited product)."""
    out = [("fold", R(p, fold=_other(p.fold, list(FoldKind))))]
    if p.encoded is None:
        return out + [("encoded", R(p, encoded="k" if p.product == "qk" else "v"))]
    t, site = p.tiling, p.scale_site
    out += [
        ("encoded", R(p, encoded=None)),
        ("bits", R(p, bits=_other(p.bits, [2, 4, 8]))),
        ("group_size", R(p, group_size=2 * p.group_size)),
        ("group_axis", R(p, group_axis=_other(p.group_axis, list(GroupAxis)))),
        ("scale_dtype", R(p, scale_dtype=_other(p.scale_dtype, ["fp16", "bf16", "fp32"]))),
        ("code_bias", R(p, code_bias=_other(p.code_bias, [0, 128, 1024]))),
        ("scale_site", R(p, scale_site=R(site, multiplies=_other(site.multiplies, list(ScaleTarget))))),
        ("tiling", R(p, tiling=R(t, channels_per_field=2 * t.channels_per_field))),
        ("tiling", R(p, tiling=R(t, token_tile_multiple=2 * t.token_tile_multiple) if t.token_tile_multiple
                     else R(t, channel_group=2 * t.channel_group))),
    ]
    if p.correction is not None and not p.correction_missing:
        out.append(("correction", R(p, correction=None)))
        out.append(("correction", R(p, correction=R(p.correction, group_size=None if p.correction.group_size
                                                    else p.group_size))))
    if p.precision is not None:
        out.append(("precision", R(p, precision=R(p.precision,
                                                 precision=_other(p.precision.precision, list(OperandPrecision))))))
    return out


@settings(max_examples=25, deadline=None)
@given(SPECS, TARGETS, st.sampled_from(["qk", "pv"]), st.data())
def test_a_decision_its_graph_does_not_implement_is_refused(spec, target, product, data):
    the_plan = _plan(spec, target)
    check_plan(the_plan)
    what, edited = data.draw(st.sampled_from(_mutants(the_plan.products[product])))
    bad = R(the_plan, products={**the_plan.products, product: edited})
    with pytest.raises(PlanError) as info:
        check_plan(bad)
    assert info.value.rule == "decision-mismatch" and info.value.product == product
    assert str(info.value).startswith(f"[decision-mismatch] {product}: the plan's {what} is ")


def test_prove_and_code_generation_refuse_an_edited_tiling():
    """The bug this guards: a doubled token tile multiple let a Triton tile straddle two groups of V (one scale
    row read for both): proved, generated, and 0.3 relative L2 off under the interpreter."""
    from foldc.backends.triton.codegen import generate
    from foldc.backends.triton.layout import geometry

    spec = foldc.AttentionSpec(4, 2, 64, k=A(4, "token", 64), v=A(4, "channel", 32))
    the_plan = foldc.plan(spec, target="interpret", dtype="fp16")
    pv = the_plan.products["pv"]
    bad = R(the_plan, products={**the_plan.products, "pv": R(pv, tiling=R(pv.tiling, token_tile_multiple=64))})
    for check in (foldc.prove, lambda p: generate(p, geometry(spec, 64, p), "fp16")):
        with pytest.raises(PlanError, match=r"^\[decision-mismatch\] pv: the plan's tiling is "):
            check(bad)


@pytest.mark.parametrize("edit", ["bits", "scale_dtype", "group_size", "group_axis"])
def test_a_graph_whose_inputs_are_not_the_specs_is_refused(edit):
    """The proof proves the graph for the encoding it holds; a kernel reads the cache the spec describes."""
    spec = foldc.AttentionSpec(8, 2, 64, k=A(4, "token", 32), v=A(4, "channel", 32))
    the_plan = foldc.plan(spec)
    g = the_plan.graph.copy()
    k = g["k"]
    changes = {"bits": dict(encoding=R(k.encoding, bits=2)),
               "scale_dtype": dict(encoding=R(k.encoding, scale_dtype=torch.float32)),
               "group_size": dict(encoding=R(k.encoding, group_size=64)),
               "group_axis": dict(group_axis="token")}[edit]
    g.replace_node(R(k, **changes))
    with pytest.raises(FoldError) as info:   # GraphError where the scale's axes no longer follow
        check_plan(R(the_plan, graph=g))
    if edit in ("bits", "scale_dtype"):   # the graph stays well formed: only the spec tells
        assert isinstance(info.value, PlanError) and info.value.rule == "spec-mismatch"
        with pytest.raises(PlanError, match=r"^\[spec-mismatch\] the plan's graph has input %k"):
            foldc.prove(the_plan.with_graph(g))


def test_a_contraction_naming_a_fold_its_nodes_do_not_apply_is_refused():
    spec = foldc.AttentionSpec(8, 2, 64, k=A(4, "token", 64), v=A(4, "channel", 64))
    the_plan = foldc.plan(spec)
    g = the_plan.graph.copy()
    partial = g["scores.partial"]
    assert isinstance(partial, Contract) and partial.fold == "acc-fold"
    g.replace_node(R(partial, fold="operand-fold"))
    with pytest.raises(PlanError, match=r"^\[decision-mismatch\] qk: %scores.partial says fold operand-fold, but "
                                        "the graph applies acc-fold"):
        check_plan(the_plan.with_graph(g))
    g.replace_node(R(partial, fold="none"))
    with pytest.raises(PlanError, match=r"^\[fold-kind-mismatch\] qk: %k is encoded but its contraction says fold"):
        the_plan.with_graph(g)


def test_the_correction_stage_rule_keeps_its_name():
    """An edited stage is refused by its own rule (eq. 8), before the decisions are compared."""
    the_plan = foldc.plan(foldc.AttentionSpec(8, 2, 64, k=A(4, "token", 64), v=A(4, "channel", 64)))
    qk = the_plan.products["qk"]
    late = R(qk, correction=R(qk.correction, lands_before=Stage.DIVISION))
    with pytest.raises(PlanError) as info:
        check_plan(R(the_plan, products={**the_plan.products, "qk": late}))
    assert info.value.rule == "key-correction-after-softmax"


@pytest.mark.parametrize("node, scale", [("scores.scaled", "v.scale"), ("pv.scaled", "k.scale")])
def test_a_group_scale_taken_from_the_other_operand_is_a_graph_error(node, scale):
    """The scale of one group of partial sums must be grouped along them (eq. 3); prove() raised StopIteration."""
    the_plan = foldc.plan(foldc.AttentionSpec(8, 2, 64, k=A(4, "token", 32), v=A(4, "channel", 16)))
    g = the_plan.graph.copy()
    g.replace_node(R(g[node], scale=scale))
    with pytest.raises(foldc.errors.GraphError, match=f"^%{node}: scales partial sums per .* is not grouped along"):
        foldc.prove(the_plan.with_graph(g))


# -- GEMM: the same rule for a GemmPlan's OperandPlan decisions (foldc/gemm/plan.py) -------------------------
def _gemm_spec(weight, activation, m):
    from foldc.gemm import GemmSpec, parse_gemm_encoding

    return GemmSpec(256, 512, parse_gemm_encoding(weight, "weight"), parse_gemm_encoding(activation, "activation"),
                    m=m)


GEMM_SPECS = st.builds(lambda pair, m: _gemm_spec(*pair, m),
                       st.sampled_from([("k-group:4:64", None), ("k-group:2:128", None), ("k-group:8:32", None),
                                        ("per-channel:4", None), ("per-channel:8", "per-token:8")]),
                       st.sampled_from([1, 16, 256]))
GEMM_EDITS = {"fold": lambda w: _other(w.fold, ["acc-fold", "operand-fold", "dequant"]),
              "bits": lambda w: _other(w.bits, [2, 4, 8]),
              "group_size": lambda w: w.group_size // 2, "fields": lambda w: 2 * w.fields,
              "row_bytes": lambda w: 2 * w.row_bytes, "code_bias": lambda w: w.code_bias + 128}


@settings(max_examples=20, deadline=None)
@given(GEMM_SPECS, st.sampled_from(sorted(GEMM_EDITS)))
def test_a_gemm_decision_its_graph_does_not_implement_is_refused(spec, what):
    """Before, prove() accepted such a plan and lower_gemv built, e.g., a 2-bit kernel from a 4-bit weight's plan."""
    the_plan = foldc.plan(spec)
    check_plan(the_plan)   # a GEMM plan (it raised AttributeError)
    w = the_plan.operands["w"]
    bad = R(the_plan, operands={**the_plan.operands, "w": R(w, **{what: GEMM_EDITS[what](w)})})
    for check in (check_plan, foldc.prove):
        with pytest.raises(PlanError, match=rf"^\[decision-mismatch\] w: the plan's {what} is "):
            check(bad)
