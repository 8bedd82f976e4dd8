"""The fold passes: axis analysis (eq. 11), break-even (eq. 12), fold rewrite (eq. 3, 4, 6, 7),
ordering (eq. 5, 8, 10) and the pipeline that runs them."""
from __future__ import annotations

import dataclasses
import importlib
import re
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import foldc
from foldc.builder import build_decode_attention
from foldc.errors import GraphError, PlanError, SpecError
from foldc.ir import (CHANNEL, TOKEN, Add, Codes, Contract, Correction, Dequantize, GroupedAxis, GroupParam,
                      MulScalar, Prescale, ScaleGroups)
from foldc.passes import (AxisAnalysis, BreakEven, FoldCosts, FoldRewrite, Ordering, Pass, TileConstraint,
                          default_passes, encoded_operand, fold_cost, fold_from_axes, rows_sharing_group, run_pipeline,
                          tile_constraints)

A = foldc.Affine

#: the seed table: (operand, layout) -> fold chosen from the axes alone
SEED = {("k", "token"): "acc-fold", ("k", "channel"): "operand-fold",
        ("v", "token"): "operand-fold", ("v", "channel"): "acc-fold"}
PRODUCT = {"k": "qk", "v": "pv"}
LAYOUTS = ("token", "channel")


def contract_of(graph, product):
    """The contraction that carries the product's fold decision."""
    hits = [n for n in graph.nodes_of(Contract) if n.product == product]
    assert len(hits) == 1, hits
    return hits[0]


# -- strategies ---------------------------------------------------------------------------
@st.composite
def specs(draw):
    """Random decode-attention specs: layouts (or plain), bits, group sizes, GQA ratios."""
    bits = draw(st.sampled_from((2, 4, 8)))
    head_dim = draw(st.sampled_from((16, 32, 64, 128)))
    num_kv = draw(st.sampled_from((1, 2, 8)))
    q_per_kv = draw(st.sampled_from((1, 2, 4, 8, 16)))

    def encoding():
        layout = draw(st.sampled_from(("token", "channel", None)))
        if layout is None:
            return None
        divisors = [d for d in range(1, head_dim + 1) if head_dim % d == 0]
        if layout == "token":  # groups cut head_dim
            group = draw(st.sampled_from(divisors))
        else:  # groups run along tokens: any size
            group = draw(st.sampled_from(divisors) | st.integers(1, 300))
        return A(bits, layout, group)

    return foldc.AttentionSpec(num_kv * q_per_kv, num_kv, head_dim, k=encoding(), v=encoding())


FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- axis analysis (eq. 11) ----------------------------------------------------------------
@FAST
@given(specs())
def test_axis_analysis_reproduces_the_seed_table(spec):
    graph, log = run_pipeline(build_decode_attention(spec), [AxisAnalysis()])
    for operand, enc in (("k", spec.k), ("v", spec.v)):
        product = PRODUCT[operand]
        node = contract_of(graph, product)
        if enc is None:
            assert node.fold == "none" and f"reason.{product}" not in graph.meta
            continue
        assert node.fold == SEED[(operand, enc.layout)]
        reason = graph.meta[f"reason.{product}"]
        assert reason.startswith(f"the scale of %{operand} ")
        assert ("(eq. 3)" in reason) == (node.fold == "acc-fold")
        assert ("(eq. 4)" in reason) == (node.fold == "operand-fold")
    assert log[0].changed == (spec.k is not None or spec.v is not None)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [8, 32, 64, 128])
@pytest.mark.parametrize("k, v", [(k, v) for k in LAYOUTS for v in LAYOUTS])
def test_plan_folds_follow_the_seed_table_when_folding_pays(bits, group, k, v):
    p = foldc.plan(foldc.AttentionSpec(8, 8, 128, A(bits, k, group), A(bits, v, group)))  # h = 1: folds pay
    assert p.folds == {"qk": SEED[("k", k)], "pv": SEED[("v", v)]}


def test_fold_from_axes_reasons():
    k_tok = build_decode_attention(foldc.AttentionSpec(4, 1, 64, A(2, "token", 32)))["k"]
    k_chan = build_decode_attention(foldc.AttentionSpec(4, 1, 64, A(2, "channel", 32)))["k"]
    assert fold_from_axes(k_tok, CHANNEL) == (
        "acc-fold", "the scale of %k is constant along channel inside a group of 32 (eq. 3)")
    assert fold_from_axes(k_chan, CHANNEL) == (
        "operand-fold", "the scale of %k changes with every channel index, so it pre-scales the other operand (eq. 4)")
    # an axis the scale does not have at all: the scale is constant along it
    assert fold_from_axes(k_tok, "q_per_kv") == ("acc-fold", "the scale of %k does not depend on q_per_kv")


def test_axis_analysis_leaves_decided_contractions_alone():
    g = build_decode_attention(foldc.AttentionSpec(4, 1, 64, A(2, "token", 32), A(2, "token", 32)))
    g.replace_node(dataclasses.replace(g["scores"], fold="dequant"))
    out, changed = AxisAnalysis().apply(g)
    assert out["scores"].fold == "dequant" and "reason.qk" not in out.meta
    assert out["pv"].fold == "operand-fold" and changed
    assert g["pv"].fold == "none"  # the input graph is not edited


def test_two_encoded_operands_with_different_groups_is_a_plan_error():
    g = build_decode_attention(foldc.AttentionSpec(4, 1, 64, A(2, "token", 32), A(2, "channel", 32))).copy()
    g.add(Contract("kv", ("batch", "kv_head", "token"), lhs="k", rhs="v", reduce=CHANNEL, product="kv"))
    with pytest.raises(PlanError) as info:
        AxisAnalysis().apply(g)
    assert info.value.rule == "two-encoded-operands"
    assert str(info.value).startswith("[two-encoded-operands] %kv contracts two encoded operands whose scales "
                                      "along channel are channel/32 and channel; eq. 15 needs")


def test_encoded_operand():
    g = build_decode_attention(foldc.AttentionSpec(4, 1, 64, A(2, "token", 32), None))
    enc, other = encoded_operand(g, g["scores"])
    assert (enc.name, other) == ("k", "q")
    assert encoded_operand(g, g["pv"]) == (None, None)


# -- break-even (eq. 12) --------------------------------------------------------------------
@FAST
@given(specs())
def test_break_even_keeps_a_fold_iff_group_exceeds_twice_the_rows(spec):
    p = foldc.plan(spec)
    h = spec.q_per_kv
    for operand, enc in (("k", spec.k), ("v", spec.v)):
        product = PRODUCT[operand]
        prod = p.products[product]
        if enc is None:
            assert prod.fold == "none" and prod.break_even == ""
            continue
        g = enc.group_size
        kept = g > 2 * h
        assert prod.fold == (SEED[(operand, enc.layout)] if kept else "dequant")
        assert prod.rows_per_group == h
        assert prod.fold_ops_per_value == Fraction(2 * h, g)
        nodes = [n for n in p.graph if getattr(n, "product", None) == product]
        corrections = [n for n in nodes if isinstance(n, Correction)]
        if kept:
            assert prod.break_even.startswith(f"fold costs 2*h/g = 2*{h}/{g} = ")
            assert prod.break_even.endswith(f"{prod.fold} kept")
            assert len(corrections) == 1
            assert f"{operand}.values" not in p.graph
        else:
            assert prod.break_even.startswith(f"group_size={g} <= 2*h={2 * h}: the {SEED[(operand, enc.layout)]}")
            assert prod.break_even.endswith(": dequant")
            assert corrections == []
            assert isinstance(p.graph[f"{operand}.values"], Dequantize)
            assert contract_of(p.graph, product).fold == "dequant"
            assert not any(isinstance(n, (Prescale, ScaleGroups)) for n in nodes)
            assert f"{operand}.codes" not in p.graph and f"{operand}.zero" not in p.graph


@pytest.mark.parametrize("h, g, kept", [
    (4, 128, True), (4, 9, True), (4, 8, False),        # g = 2h is a tie: no fold
    (8, 16, False), (8, 17, True), (16, 32, False), (16, 64, True), (1, 3, True), (1, 2, False)])
def test_break_even_boundary(h, g, kept):
    spec = foldc.AttentionSpec(2 * h, 2, 64, k=A(2, "channel", g), v=A(2, "channel", g))
    p = foldc.plan(spec)
    assert p.folds == ({"qk": "operand-fold", "pv": "acc-fold"} if kept else {"qk": "dequant", "pv": "dequant"})
    for prod in p.products.values():
        assert f"2*{h}/{g}" in prod.break_even if kept else f"group_size={g} <= 2*h={2 * h}" in prod.break_even
    assert [r.changed for r in p.passes if r.name == "break-even"] == [not kept]
    assert bool(p.graph.nodes_of(Correction)) == kept
    assert bool(p.graph.nodes_of(Dequantize)) == (not kept)


@FAST
@given(specs(), st.integers(1, 16), st.booleans())
def test_a_targets_costs_keep_folds_at_the_tie_and_rebuild_keys_past_its_resident_rows(spec, resident, at_tie):
    """eq. 12a: with a target's `FoldCosts` a fold at the tie (g = 2h) is kept where ``fold_at_tie`` says so, and a
    channel-wise key side (an operand-fold of the query, which stays the same along the token loop, in groups along
    that loop) is reconstructed past ``resident_rows`` rows; every other verdict is eq. 12's. Both plans prove."""
    costs = FoldCosts("a target", fold_at_tie=at_tie, resident_rows=resident)
    graph, _ = run_pipeline(build_decode_attention(spec), default_passes(fold_costs=costs))
    h = spec.q_per_kv
    for operand, enc in (("k", spec.k), ("v", spec.v)):
        if enc is None:
            continue
        g, seed = enc.group_size, SEED[(operand, enc.layout)]
        rebuilt = operand == "k" and enc.layout == "channel" and h > resident
        kept = not rebuilt and (g > 2 * h or (g == 2 * h and at_tie))
        node = contract_of(graph, PRODUCT[operand])
        assert node.fold == (seed if kept else "dequant")
        text = graph.meta[f"break-even.{PRODUCT[operand]}"]
        if rebuilt:
            assert f"from the {h} rows it keeps, more than the {resident}" in text and text.endswith(": dequant")
        elif g == 2 * h and at_tie:
            assert text.endswith(f"keeps the {seed} at the tie")
    plan = foldc.plan(spec, fold_costs=costs)
    assert plan.folds == {PRODUCT[o]: contract_of(graph, PRODUCT[o]).fold if e is not None else "none"
                          for o, e in (("k", spec.k), ("v", spec.v))}
    assert foldc.prove(plan) is not None
    with pytest.raises(SpecError, match="fold_costs"):
        foldc.plan(spec, fold_costs="fold at the tie")


def test_break_even_text_names_the_numbers():
    p = foldc.plan(foldc.AttentionSpec(32, 2, 128, A(2, "token", 32), A(2, "channel", 32)))
    assert p.products["qk"].break_even == (
        "group_size=32 <= 2*h=32: the acc-fold would cost 2*h/g = 1 ops/value, not less than 1 for per-value "
        "reconstruction: dequant")
    p = foldc.plan(foldc.AttentionSpec(32, 8, 128, A(2, "token", 128), A(2, "channel", 128)))
    assert p.products["pv"].break_even == (
        "fold costs 2*h/g = 2*4/128 = 0.0625 ops/value < 1 for per-value reconstruction: acc-fold kept")


def test_rows_sharing_group_and_fold_cost():
    g = build_decode_attention(foldc.AttentionSpec(24, 2, 64, A(2, "token", 32), A(2, "channel", 32)))
    assert rows_sharing_group(g, g["scores"]) == 12
    assert rows_sharing_group(g, g["pv"]) == 12
    assert fold_cost(4, 128) == Fraction(1, 16)
    assert fold_cost(8, 16) == 1


def test_break_even_needs_the_size_of_the_shared_axis():
    g, _ = run_pipeline(build_decode_attention(foldc.AttentionSpec(8, 2, 64, A(2, "token", 32))), [AxisAnalysis()])
    del g.sizes["q_per_kv"]
    with pytest.raises(PlanError) as info:
        BreakEven().apply(g)
    assert info.value.rule == "unknown-size"
    assert str(info.value) == "[unknown-size] break-even for %scores needs the size of axis 'q_per_kv'"


# -- fold rewrite (eq. 3, 4, 6, 7) ------------------------------------------------------------
@pytest.mark.parametrize("k, v", [(k, v) for k in LAYOUTS for v in LAYOUTS])
def test_fold_rewrite_corrections_feed_the_add_before_softmax_and_accumulator(k, v):
    g = foldc.plan(foldc.AttentionSpec(32, 8, 128, A(2, k, 64), A(2, v, 64))).graph
    for product, before in (("qk", "logits"), ("pv", "acc")):
        corr = g[f"{product if product == 'pv' else 'scores'}.offset"]
        add = g["scores" if product == "qk" else "pv"]
        assert isinstance(corr, Correction) and isinstance(add, Add)
        assert [u.name for u in g.users(corr.name)] == [add.name]
        assert {add.lhs, add.rhs} == {corr.name, add.name + ".scaled"}
        assert [u.name for u in g.users(add.name)] == [before]
    assert isinstance(g["logits"], MulScalar) and g.users("logits")[0].name == "p"
    assert g["scores.offset"].form == ("group-sum" if k == "token" else "contract")
    assert g["pv.offset"].form == ("contract" if v == "token" else "group-sum")
    assert (g["scores.offset"].other, g["pv.offset"].other) == ("q", "p")


@pytest.mark.parametrize("layout, split", [("token", GroupedAxis(CHANNEL, 32)), ("channel", None)])
def test_fold_rewrite_key_side_structure(layout, split):
    g = foldc.plan(foldc.AttentionSpec(8, 2, 64, A(4, layout, 32))).graph
    if split is not None:  # acc-fold: per-group partial sums over codes, then scale_groups
        partial = g["scores.partial"]
        assert (partial.lhs, partial.rhs, partial.split, partial.fold) == ("q", "k.codes", split, "acc-fold")
        assert (g["scores.scaled"].partial, g["scores.scaled"].scale, g["scores.scaled"].groups) == \
            ("scores.partial", "k.scale", split)
    else:  # operand-fold: q x scale, then a plain contraction with the codes
        assert (g["scores.prescaled"].operand, g["scores.prescaled"].scale) == ("q", "k.scale")
        sc = g["scores.scaled"]
        assert (sc.lhs, sc.rhs, sc.split, sc.fold) == ("scores.prescaled", "k.codes", None, "operand-fold")


@pytest.mark.parametrize("bias", [{"key": 1024}, {"key": 1024, "value": 128}, {"value": 128}])
def test_fold_rewrite_code_bias_goes_on_codes_and_zero(bias):
    p = foldc.plan(foldc.AttentionSpec(32, 8, 128, A(2, "token", 128), A(2, "channel", 128)), code_bias=bias)
    g = p.graph
    for operand, role in (("k", "key"), ("v", "value")):
        b = bias.get(role, 0)
        assert g[f"{operand}.codes"].bias == b
        assert g[f"{operand}.zero"].bias == b
        assert g[f"{operand}.scale"].bias == 0
        assert p.products[PRODUCT[operand]].code_bias == b
    assert ("%k.codes = codes %k bias=1024 :" in str(g)) == ("key" in bias)


def test_fold_rewrite_dequant_shares_one_dequantize_node():
    g = foldc.plan(foldc.AttentionSpec(32, 2, 128, A(2, "token", 32), A(2, "token", 32))).graph
    assert [n.name for n in g.nodes_of(Dequantize)] == ["k.values", "v.values"]
    assert (g["scores"].lhs, g["scores"].rhs) == ("q", "k.values")
    assert (g["pv"].lhs, g["pv"].rhs) == ("p", "v.values")
    assert not g.nodes_of(GroupParam) and not g.nodes_of(Codes)


def test_fold_rewrite_acc_fold_on_a_per_element_scale_is_an_error():
    g, _ = run_pipeline(build_decode_attention(foldc.AttentionSpec(8, 2, 64, A(2, "channel", 32))),
                        [AxisAnalysis(), BreakEven()])
    g.replace_node(dataclasses.replace(g["scores"], fold="acc-fold"))
    with pytest.raises(PlanError) as info:
        FoldRewrite().apply(g)
    assert info.value.rule == "fold-kind-mismatch"
    msg = str(info.value)
    assert "acc-fold needs the scale of %k constant along channel inside a group" in msg
    assert "['batch', 'kv_head', 'token/32', 'channel']" in msg and "use operand-fold (eq. 4)" in msg


# -- ordering: tiling constraints (eq. 5) -----------------------------------------------------
@pytest.mark.parametrize("k, v", [(k, v) for k in LAYOUTS for v in LAYOUTS])
@pytest.mark.parametrize("group", [16, 64])
def test_ordering_exports_tile_constraints(k, v, group):
    p = foldc.plan(foldc.AttentionSpec(8, 2, 128, A(2, k, group), A(2, v, group)))
    want = set()
    # acc-fold: partial sums split along the reduced axis every g
    if k == "token":
        want.add(TileConstraint("qk", CHANNEL, group, "an unscaled partial sum"))
    else:  # channel-wise K: the pre-scaled q changes per token group
        want.add(TileConstraint("qk", TOKEN, group, "one pre-scaled %q (it changes per token group)"))
    if v == "channel":
        want.add(TileConstraint("pv", TOKEN, group, "an unscaled partial sum"))
    else:  # token-wise V: the pre-scaled p changes per channel group (eq. 4, section 11)
        want.add(TileConstraint("pv", CHANNEL, group, "one pre-scaled %p (it changes per channel group)"))
    assert set(p.constraints) == want and len(p.constraints) == 2
    assert list(p.constraints) == sorted(p.constraints, key=str)
    assert set(p.products["qk"].constraints) | set(p.products["pv"].constraints) == want
    assert all(c.product == "qk" for c in p.products["qk"].constraints)
    for node in p.graph.nodes_of(Contract):
        if node.fold == "acc-fold":
            assert node.split == GroupedAxis(node.reduce, group)
        else:
            assert node.split is None


def test_tile_constraint_text():
    c = TileConstraint("qk", CHANNEL, 128, "an unscaled partial sum")
    assert str(c) == "qk: an unscaled partial sum must not cross a multiple of 128 along channel"


def test_no_constraints_without_folds():
    for spec in (foldc.AttentionSpec(8, 2, 64), foldc.AttentionSpec(32, 2, 128, A(2, "token", 32), A(2, "channel", 32))):
        p = foldc.plan(spec)
        assert p.constraints == () and tile_constraints(p.graph) == []


# -- the pipeline and its log ------------------------------------------------------------------
PASS_EQUATIONS = [("axis-analysis", "3, 4, 11, 15"), ("break-even", "12, 12a, 16"), ("fold-rewrite", "3, 4, 6, 7, 15"),
                  ("ordering", "5, 8, 10")]


def test_pass_log_records_each_pass_with_its_equation():
    p = foldc.plan(foldc.AttentionSpec(32, 8, 128, A(2, "token", 128), A(2, "channel", 128)))
    assert [(r.name, r.equation) for r in p.passes] == PASS_EQUATIONS
    assert [r.changed for r in p.passes] == [True, False, True, True]
    assert [str(r) for r in p.passes] == [
        "axis-analysis (eq. 3, 4, 11, 15): changed", "break-even (eq. 12, 12a, 16): no change",
        "fold-rewrite (eq. 3, 4, 6, 7, 15): changed", "ordering (eq. 5, 8, 10): changed"]
    plain = foldc.plan(foldc.AttentionSpec(8, 2, 64))
    assert [r.changed for r in plain.passes] == [False, False, False, True]
    assert [(r.name, r.equation) for r in plain.passes] == PASS_EQUATIONS
    assert [(type(p).name, type(p).equation) for p in default_passes()] == PASS_EQUATIONS


@pytest.mark.parametrize("module, cls", [("axis_analysis", AxisAnalysis), ("break_even", BreakEven),
                                         ("fold_rewrite", FoldRewrite), ("ordering", Ordering)])
def test_each_pass_module_docstring_cites_its_equations(module, cls):
    doc = importlib.import_module(f"foldc.passes.{module}").__doc__
    assert re.search(r"\beq\.|\bequations?\b", doc), module
    assert "docs/derivation.md" in doc
    for number in cls.equation.split(", "):
        assert re.search(rf"\b{number}\b", doc), (module, number)


def test_run_pipeline_verifies_after_every_pass():
    @dataclasses.dataclass(frozen=True)
    class Breaker(Pass):
        name = "breaker"
        equation = "0"

        def apply(self, graph):
            out = graph.copy()
            out.replace_node(dataclasses.replace(out["logits"], input="ghost"))
            return out, True

    g = build_decode_attention(foldc.AttentionSpec(8, 2, 64))
    with pytest.raises(GraphError, match=r"^%ghost is used but never defined$"):
        run_pipeline(g, [AxisAnalysis(), Breaker()])
    # and before the first one
    bad = g.copy()
    bad.output = None
    with pytest.raises(GraphError, match=r"has no output"):
        run_pipeline(bad, [])


def test_pass_without_apply():
    with pytest.raises(NotImplementedError, match=r"pass pass does not implement apply\(\)"):
        Pass().apply(build_decode_attention(foldc.AttentionSpec(8, 2, 64)))


def test_passes_do_not_edit_their_input():
    g = build_decode_attention(foldc.AttentionSpec(8, 2, 64, A(2, "token", 32), A(2, "token", 32)))
    before = str(g)
    out, _ = run_pipeline(g, default_passes({"key": 1024}))
    assert str(g) == before and str(out) != before


def test_plan_needs_an_attention_spec():
    with pytest.raises(foldc.SpecError, match=r"^spec must be a foldc.AttentionSpec, got dict$"):
        foldc.plan({"heads": "32/8"})
