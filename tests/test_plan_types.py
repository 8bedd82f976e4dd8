"""The plan is the contract: every decision of a `ProductPlan` is typed (foldc/decisions.py), its
text is what `foldc explain` shows, its numbers match the encoding, and `foldc.plan.check_plan`
refuses a plan that breaks a fold rule, naming the rule and the product."""
from __future__ import annotations

import dataclasses
import math
import os
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import foldc
from foldc.decisions import (STAGE_OF, CorrectionTerm, FoldKind, GroupAxis, Missing, ScaleSite, ScaleTarget, Stage,
                             TilingConstraint, token_group)
from foldc.errors import PlanError, SpecError
from foldc.explain import explain_table, plan_summary
from foldc.ir import Add, GroupedAxis, canonical
from foldc.passes import TileConstraint
from foldc.plan import Plan, ProductPlan, check_plan, plan_of

from test_cost import parse_table   # the explain_table reader of tests/test_cost.py

A = foldc.Affine
SCALE_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
TARGETS = {FoldKind.ACC_FOLD: ScaleTarget.ACCUMULATOR, FoldKind.OPERAND_FOLD: ScaleTarget.OPERAND,
           FoldKind.DEQUANT: ScaleTarget.VALUE}


def small_plan(k="token", v="channel"):
    """8/2 heads, head_dim 16, groups of 16: both products fold."""
    return foldc.plan(foldc.AttentionSpec(8, 2, 16, A(2, k, 16), A(2, v, 16)))


# ---- the enums keep the strings' behaviour ------------------------------------------------------

def test_fold_kind_compares_formats_and_hashes_as_its_string():
    kind = FoldKind.ACC_FOLD
    assert kind == "acc-fold" and str(kind) == "acc-fold" and f"{kind:<12}|" == "acc-fold    |"
    assert {"acc-fold": 1}[kind] == 1 and kind in ("acc-fold", "operand-fold")
    assert FoldKind("operand-fold") is FoldKind.OPERAND_FOLD
    assert [k.folded for k in FoldKind] == [True, True, False, False]
    assert GroupAxis.CHANNEL == "channel" and GroupAxis.TOKEN == "token"
    assert GroupAxis.of(A(2, "token", 32)) is GroupAxis.CHANNEL and GroupAxis.of(A(2, "channel", 32)) is GroupAxis.TOKEN
    assert Missing.CORRECTION == "MISSING"


def test_the_seed_layouts_decisions():
    p = foldc.plan(foldc.AttentionSpec(32, 8, 128, A(2, "token", 128), A(4, "channel", 64, torch.bfloat16)))
    qk, pv = p.products["qk"], p.products["pv"]
    assert qk.fold is FoldKind.ACC_FOLD and qk.group_axis is GroupAxis.CHANNEL
    assert qk.scale_site == ScaleSite(ScaleTarget.ACCUMULATOR, "q", GroupAxis.CHANNEL, 128)
    assert qk.correction == CorrectionTerm("k", "q", "channel", 128, Stage.SOFTMAX)
    assert qk.tiling == TilingConstraint(None, 32, 128) and qk.token_tile_multiple is None and qk.tiling.whole_fields
    assert pv.fold is FoldKind.ACC_FOLD and pv.group_axis is GroupAxis.TOKEN and pv.scale_dtype == "bf16"
    assert pv.correction.lands_before is Stage.DIVISION and pv.lands_before is Stage.DIVISION
    assert pv.tiling == TilingConstraint(64, 64, None) and pv.token_tile_multiple == 64
    assert p.token_alignment == 64 and p.of_operand("v") is pv
    assert str(qk.scale_site) == "each group's partial sum (per 128 channels)"
    assert str(qk.correction) == "zero x sum of q over each group of 128 channels"
    assert str(qk.lands_before) == "the softmax (max, exp)"
    assert p.folds == {"qk": "acc-fold", "pv": "acc-fold"} and type(p.folds["qk"]) is str

    of = foldc.plan(foldc.AttentionSpec(32, 8, 128, A(2, "channel", 32), A(2, "token", 32))).products
    assert of["qk"].scale_site == ScaleSite(ScaleTarget.OPERAND, "q", GroupAxis.TOKEN, 32)
    assert str(of["qk"].scale_site) == "the other operand: q x scale, before the product"
    assert of["pv"].correction == CorrectionTerm("v", "p", "token", None, Stage.DIVISION)
    assert str(of["pv"].correction) == "sum over token of p x zero"
    assert of["pv"].tiling.whole_fields   # groups of 32 channels: one bit field of 128 x 2 / 8 each

    plain = foldc.plan(foldc.AttentionSpec(8, 8, 64)).products["qk"]
    assert plain.fold is FoldKind.NONE and plain.scale_site is None and plain.correction is None
    assert plain.lands_before is None and plain.tiling == TilingConstraint()
    dq = foldc.plan(foldc.AttentionSpec(8, 2, 64, A(2, "token", 32)), fold_policy="dequant").products["qk"]
    assert dq.fold is FoldKind.DEQUANT and dq.correction is None and dq.lands_before is Stage.SOFTMAX
    assert dq.scale_site == ScaleSite(ScaleTarget.VALUE, "k", GroupAxis.CHANNEL, 32)


def test_plan_of_is_cached_per_spec():
    spec = foldc.AttentionSpec(8, 2, 64, A(2, "channel", 32), A(2, "channel", 48))
    assert plan_of(spec) is plan_of(foldc.AttentionSpec(8, 2, 64, A(2, "channel", 32), A(2, "channel", 48)))
    assert plan_of(spec).token_alignment == math.lcm(32, 48)
    assert plan_of(spec).products == foldc.plan(spec).products
    with pytest.raises(SpecError, match="must be a foldc.AttentionSpec"):
        plan_of("token:2:32")


# ---- random valid specs: every field typed, explain renders, numbers match the encoding -----------

def _settings(examples):
    return settings(max_examples=examples, deadline=None, derandomize=os.environ.get("CI") == "true",
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def encodings(draw, head_dim):
    if draw(st.integers(0, 4)) == 0:
        return None
    bits, layout = draw(st.sampled_from([2, 4, 8])), draw(st.sampled_from(["token", "channel"]))
    groups = [g for g in (8, 16, 32, 64, 128) if head_dim % g == 0] if layout == "token" else [8, 16, 24, 32, 64, 128]
    return A(bits, layout, draw(st.sampled_from(groups)), draw(st.sampled_from(list(SCALE_DTYPES))))


@st.composite
def plans(draw):
    head_dim = draw(st.sampled_from([16, 32, 64, 128]))
    kv = draw(st.integers(1, 4))
    spec = foldc.AttentionSpec(kv * draw(st.sampled_from([1, 2, 4, 8, 16])), kv, head_dim,
                               draw(encodings(head_dim)), draw(encodings(head_dim)))
    policy = draw(st.sampled_from(["auto", "auto", "dequant"]))
    bias = draw(st.sampled_from([None, {"key": 1024}, {"key": 128, "value": 128}]))
    dtype = draw(st.sampled_from([None, "bf16"]))
    try:
        return foldc.plan(spec, code_bias=bias, fold_policy=policy, dtype=dtype)
    except PlanError as e:   # a precision the error model refuses (eq. 6a): not a plan
        assert e.rule == "precision"
        return foldc.plan(spec, fold_policy=policy)


@_settings(60)
@given(plans())
def test_every_product_field_is_typed_and_matches_the_encoding(p):
    spec = p.spec
    assert isinstance(p, Plan) and check_plan(p) is p
    for name, prod in p.products.items():
        enc = spec.k if name == "qk" else spec.v
        assert isinstance(prod, ProductPlan) and isinstance(prod.fold, FoldKind)
        assert all(isinstance(c, TileConstraint) and c.product == name for c in prod.constraints)
        assert isinstance(prod.tiling, TilingConstraint) and prod.tiling == TilingConstraint.of(enc, spec.head_dim)
        if enc is None:
            assert prod.fold is FoldKind.NONE and prod.encoded is None
            assert prod.group_axis is prod.scale_site is prod.correction is prod.lands_before is None
            assert prod.tiling == TilingConstraint() and prod.token_tile_multiple is None
            continue
        assert isinstance(prod.group_axis, GroupAxis) and prod.group_axis == enc.group_axis
        assert (prod.group_size, prod.bits, prod.scale_dtype) == (enc.group_size, enc.bits,
                                                                  SCALE_DTYPES[enc.scale_dtype])
        assert isinstance(prod.code_bias, int) and isinstance(prod.rows_per_group, int)
        assert isinstance(prod.fold_ops_per_value, Fraction)
        site = prod.scale_site
        assert isinstance(site, ScaleSite) and site.multiplies is TARGETS[prod.fold]
        assert (site.axis, site.per) == (prod.group_axis, enc.group_size)
        assert site.operand == (prod.other if prod.fold.folded else prod.encoded)
        assert isinstance(prod.lands_before, Stage) and prod.lands_before is STAGE_OF[name]
        if prod.fold.folded:
            corr = prod.correction
            assert isinstance(corr, CorrectionTerm) and not prod.correction_missing
            assert (corr.zero, corr.other, corr.axis, corr.lands_before) == (prod.encoded, prod.other, prod.reduce,
                                                                             STAGE_OF[name])
            assert corr.group_size == (enc.group_size if prod.fold is FoldKind.ACC_FOLD else None)
        else:
            assert prod.fold is FoldKind.DEQUANT and prod.correction is None
        # the numbers of the encoding
        t = prod.tiling
        assert t.channels_per_field == spec.head_dim * enc.bits // 8
        if enc.layout == "channel":
            assert prod.token_tile_multiple == enc.group_size == token_group(enc) and t.channel_group is None
        else:
            assert prod.token_tile_multiple is None and token_group(enc) is None and t.channel_group == enc.group_size
            assert t.whole_fields == (enc.group_size % t.channels_per_field == 0)
    groups = [e.group_size for e in (spec.k, spec.v) if e is not None and e.layout == "channel"]
    assert p.token_alignment == (math.lcm(*groups) if groups else 1)
    table, summary = parse_table(explain_table(p)), plan_summary(p)
    for col, (name, prod) in enumerate(p.products.items()):
        assert f"{name}: {prod.fold:<12} scale -> " in summary
        cells = {row: squash(table[row][col]) for row in ("scale goes to", "correction term", "must land before")}
        assert cells["scale goes to"] == squash(str(prod.scale_site) if prod.scale_site else "-")
        if prod.correction is not None:
            assert cells["correction term"] == squash(str(prod.correction))
            assert str(prod.correction) in summary
        assert cells["must land before"] == squash(str(prod.lands_before) if prod.lands_before else "-")


def squash(text: str) -> str:
    return "".join(text.split())


# ---- wrong plans are refused, naming the rule and the product ---------------------------------

def refused(the_plan) -> PlanError:
    with pytest.raises(PlanError) as info:
        check_plan(the_plan)
    return info.value


def without_key_correction(the_plan):
    """The key correction removed from the graph (the scaled partial sum feeds the logits alone)."""
    g = the_plan.graph.copy()
    g.rename_uses("scores", "scores.scaled")
    g.remove("scores")
    g.remove("scores.offset")
    return the_plan.with_graph(g)


def test_a_folded_product_without_its_correction_is_missing_and_refused():
    bad = without_key_correction(small_plan())
    qk = bad.products["qk"]
    assert qk.fold is FoldKind.ACC_FOLD and qk.correction is Missing.CORRECTION and qk.correction_missing
    assert qk.lands_before is Stage.SOFTMAX
    assert "correction: MISSING" in str(bad)
    e = refused(bad)
    assert e.rule == "missing-correction" and e.product == "qk"
    assert str(e) == ("[missing-correction] qk: %k is folded (acc-fold) but the plan adds no correction term "
                      "(zero x sum of q, eq. 6)")


def test_a_key_correction_after_the_softmax_is_refused():
    the_plan = small_plan()
    g = the_plan.graph.copy()   # the key correction added to the softmax weights instead of the scores
    g.rename_uses("scores", "scores.scaled")
    g.remove("scores")
    g.add(Add("p.corr", g["p"].axes, lhs="p", rhs="scores.offset"))
    g.rename_uses("p", "p.corr", skip=["p.corr", "acc", "out"])
    e = refused(the_plan.with_graph(g))
    assert e.rule == "key-correction-after-softmax" and e.product == "qk"
    assert str(e).startswith("[key-correction-after-softmax] qk: %scores.offset (key side) is added after the "
                             "softmax %p")


def test_a_key_correction_typed_to_land_after_the_softmax_is_refused():
    the_plan = small_plan()
    qk = the_plan.products["qk"]
    late = dataclasses.replace(qk, correction=dataclasses.replace(qk.correction, lands_before=Stage.DIVISION))
    bad = dataclasses.replace(the_plan, products={**the_plan.products, "qk": late})
    e = refused(bad)
    assert e.rule == "key-correction-after-softmax" and e.product == "qk"
    assert str(e) == ("[key-correction-after-softmax] qk: its correction lands before the division by the "
                      "denominator (rescaled with acc); it must land before the softmax (max, exp) (eq. 8)")


def test_an_unscaled_partial_sum_across_a_group_is_refused():
    the_plan = small_plan("token", "channel")
    g = the_plan.graph.copy()
    coarse = GroupedAxis("token", 32)  # the value scale changes every 16 tokens
    n = g["pv.partial"]
    g.replace_node(dataclasses.replace(n, split=coarse, axes=canonical(
        [coarse if isinstance(a, GroupedAxis) else a for a in n.axes])))
    g.replace_node(dataclasses.replace(g["pv.scaled"], groups=coarse))
    e = refused(the_plan.with_graph(g))
    assert e.rule == "partial-sum-crosses-group" and e.product == "pv"
    assert str(e) == ("[partial-sum-crosses-group] pv: %pv.partial keeps partial sums per 32 along token but the "
                      "scale %v.scale changes every 16; an unscaled partial sum crosses a group boundary (eq. 5): "
                      "split every 16")


@pytest.mark.parametrize("k, v", [("token", "token"), ("token", "channel"), ("channel", "token"),
                                  ("channel", "channel")])
def test_right_plans_pass(k, v):
    the_plan = small_plan(k, v)
    assert check_plan(the_plan) is the_plan
    assert check_plan(the_plan.with_graph(the_plan.graph)).products == the_plan.products


def test_the_register_operand_kernel_refuses_a_missing_correction_before_lowering():
    """lower() runs check_plan first: a folded product without its correction is a PlanError naming it."""
    from foldc.backends.gluon.lower import gluon_plan, lower

    the_plan = gluon_plan(foldc.AttentionSpec(32, 8, 128, A(2, "token", 128), A(2, "token", 128)))
    with pytest.raises(PlanError, match=r"\[missing-correction\] qk"):
        lower(without_key_correction(the_plan))


# ---- what serving and the Triton backend read from the plan -----------------------------------------

def test_token_tiles_and_pages_follow_the_plan():
    from foldc.backends.triton.layout import geometry, token_block
    from foldc.backends.triton.paging import check_page_size

    spec = foldc.AttentionSpec(8, 2, 64, A(2, "channel", 32), A(4, "token", 32))
    assert token_block(spec, 64) == 32 and geometry(spec, 64).block_n == 32
    assert geometry(spec, 64).width_pv == 32   # chunks inside one channel group of 32 (and a bit field of 32)
    assert check_page_size(spec, 64) == 64
    with pytest.raises(SpecError, match=r"page_size=48 is not a multiple of group_size=32 of the channel-wise k "
                                        r"encoding \(channel:2:32\)"):
        check_page_size(spec, 48)
    with pytest.raises(SpecError, match=r"channel-wise group_size=\[8\] admits no token tile"):
        token_block(foldc.AttentionSpec(8, 2, 64, A(2, "channel", 8)), 64)


# ---- the plan a target's kernel runs ----------------------------------------------------------------

@pytest.mark.parametrize("k,v,target,kernel,dtype,want", [
    ("token:4:128", "token:2:128", "sm_90", "auto", "bf16", "gluon"),
    ("token:4:128", "token:2:128", "sm_100", "auto", "bf16", "gluon"),
    ("token:4:128", "token:2:128", "sm_90", "auto", "fp16", "gluon"),
    ("token:4:128", "token:2:128", "sm_90", "triton", "fp16", "triton"),
    ("token:4:128", "token:2:128", "sm_90", "triton", "bf16", "triton"),
    ("channel:2:64", "none", "interpret", "auto", "fp16", "triton"),
])
def test_plan_for_a_target_is_the_plan_its_kernel_runs(k, v, target, kernel, dtype, want):
    """foldc.plan(spec, target=..., kernel=..., dtype=...) is the plan compile's kernel is generated from:
    equal, decision by decision, to the backend's own planning rule (gluon_plan or triton_plan)."""
    from foldc.backends.gluon.lower import gluon_plan
    from foldc.backends.triton.launch import triton_plan
    from foldc.spec import spec_from_args

    spec = spec_from_args(k, v, "32/8", 128)
    got = foldc.plan(spec, target=target, kernel=kernel, dtype=dtype)
    ref = gluon_plan(spec, dtype) if want == "gluon" else triton_plan(spec, dtype)
    assert got.products == ref.products and (got.dtype, got.operand_dtype, got.bar_dtype) == \
        (ref.dtype, ref.operand_dtype, ref.bar_dtype)
    assert got.bar_dtype == ("bf16" if (want, dtype) == ("gluon", "fp16") else None)
    assert check_plan(got) is got


def test_plan_for_a_target_refuses_what_it_cannot_mean():
    spec = foldc.AttentionSpec(32, 8, 128, A(2, "token", 128), A(2, "token", 128))
    assert foldc.plan(spec, target="interpret").dtype == "fp16"   # the interpreter's kernel runs fp16 queries only
    with pytest.raises(foldc.SpecError, match="target='reference'"):
        foldc.plan(spec, target="reference")
    with pytest.raises(foldc.SpecError, match="code_bias, operand_dtype and bar_dtype are the target.s"):
        foldc.plan(spec, target="sm_90", code_bias={"key": 0})
    with pytest.raises(foldc.SpecError, match="kernel='gluon'"):
        foldc.plan(spec, target="interpret", kernel="gluon")



@pytest.mark.parametrize("option,value", [("rows_per_program", 1), ("rows_per_program", 2),
                                          ("fold_costs", "FoldCosts")])
@pytest.mark.parametrize("target", ["sm_90", "interpret"])
def test_plan_for_a_target_refuses_the_options_its_kernel_sets(option, value, target):
    """foldc.plan(spec, target=..., rows_per_program=1) (or fold_costs=) returned the target kernel's plan with its
    own row blocks and costs, the option dropped silently: the plan told of another break-even than asked for."""
    from foldc.passes import FoldCosts

    spec = foldc.AttentionSpec(32, 8, 128, A(2, "token", 128), A(2, "token", 128))
    value = FoldCosts(target) if value == "FoldCosts" else value
    with pytest.raises(foldc.SpecError, match=rf"{option}=.* with target='{target}': the target's kernel plans its "
                                              rf"own row blocks and fold costs; drop {option}"):
        foldc.plan(spec, target=target, **{option: value})
    planned = foldc.plan(spec, **{option: value})   # without a target the option is planned with
    assert option != "rows_per_program" or planned.rows_per_program == value


@pytest.mark.parametrize("kernel", ["triton", "gluon", "Triton", None])
def test_plan_refuses_a_kernel_without_a_target(kernel):
    """foldc.plan(spec, kernel="triton") returned the reference plan (no code bias) while the Triton kernel's plan
    has bf16's code bias of 128: the kernel was dropped silently (any text was taken, a misspelt one too)."""
    spec = foldc.AttentionSpec(32, 8, 128, A(2, "token", 128), A(2, "channel", 128))
    gemm = foldc.GemmSpec(256, 256, foldc.gemm.parse_gemm_encoding("k-group:4:64", "weight"))
    for the_spec in (spec, gemm):
        with pytest.raises(foldc.SpecError, match=rf"kernel={kernel!r} without target: the kernel's plan is a "
                                                  r"target's .* pass target='sm_90', 'sm_100' or 'interpret'"):
            foldc.plan(the_spec, kernel=kernel)
    assert foldc.plan(spec, kernel="auto").products == foldc.plan(spec).products
    assert foldc.plan(spec, target="sm_90", kernel="triton").products["qk"].code_bias == 128


@pytest.mark.parametrize("option,value", [("dtype", "bf16"), ("dtype", "fp8"), ("operand_dtype", "fp16"),
                                          ("rows_per_program", 2), ("bar_dtype", "bf16"), ("fold_costs", "costs")])
def test_plan_of_a_gemm_refuses_attention_options(option, value):
    """foldc.plan(gemm_spec, dtype="bf16") returned a plan that decides no precision, the dtype dropped silently (as
    rows_per_program, operand_dtype, bar_dtype and fold_costs, whatever their value)."""
    from foldc.passes import FoldCosts

    spec = foldc.GemmSpec(256, 256, foldc.gemm.parse_gemm_encoding("k-group:4:64", "weight"), m=4)
    value = FoldCosts("sm_90") if value == "costs" else value
    with pytest.raises(foldc.SpecError, match=rf"{option}=.*: a GemmSpec's plan takes code_bias and fold_policy "
                                              r"only .* drop them"):
        foldc.plan(spec, **{option: value})
    assert foldc.plan(spec, code_bias={"weight": 8}, fold_policy="dequant").spec == spec

@st.composite
def _attention_specs(draw):
    kv = draw(st.sampled_from([1, 2, 8]))
    head_dim = draw(st.sampled_from([8, 16, 24, 32, 48, 64, 96, 128, 160, 256]))

    def enc():
        if draw(st.integers(0, 4)) == 0:
            return None
        layout, bits = draw(st.sampled_from(["token", "channel"])), draw(st.sampled_from([2, 4, 8]))
        group = draw(st.sampled_from([d for d in range(1, head_dim + 1) if head_dim % d == 0]) if layout == "token"
                     else st.integers(1, 300))
        return A(bits, layout, group)

    return foldc.AttentionSpec(kv * draw(st.sampled_from([1, 3, 4, 16])), kv, head_dim, enc(), enc())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(_attention_specs(), st.sampled_from(["fp16", "bf16"]))
def test_plan_for_the_interpreter_exists_where_its_kernel_does(spec, dtype):
    """foldc.plan(spec, target="interpret") gave a plan for specs whose kernel foldc.compile refuses (head_dim 8 or 24,
    channel groups of 7 tokens, chunks crossing a token-wise group): the plan of a kernel that is never built. The
    interpreter's kernel runs fp16 queries only: a bf16 plan of it (a code bias of 128) would describe none."""
    if dtype == "bf16":
        with pytest.raises(SpecError, match="runs fp16 queries only"):
            foldc.plan(spec, target="interpret", dtype=dtype)
    else:
        try:
            foldc.compile(spec, target="interpret")
        except SpecError as e:
            with pytest.raises(SpecError) as ei:
                foldc.plan(spec, target="interpret", dtype=dtype)
            assert str(e) in str(ei.value)
        else:
            try:
                got = foldc.plan(spec, target="interpret", dtype=dtype)
            except PlanError as e:   # a plan whose error model its dtype refuses (eq. 6a), the same on both sides
                assert e.rule == "precision"
            else:
                assert check_plan(got) is got


@settings(max_examples=60, deadline=None)
@given(bias=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.integers(0, 2048).map(str),
                      st.lists(st.integers(), max_size=2)),
       role=st.sampled_from(["key", "value"]), gemm=st.booleans())
def test_a_code_bias_that_is_no_int_is_refused(bias, role, gemm):
    """A code bias is the constant a backend ORs into the codes: a float was truncated by the fold
    (2.5 planned and proved as 2), a string or True read as its int, NaN raised ValueError."""
    if gemm:
        spec = foldc.GemmSpec(64, 128, foldc.gemm.parse_gemm_encoding("k-group:4:128", "weight"))
        role = "weight"
    else:
        spec = foldc.AttentionSpec(8, 2, 64, A(2, "token", 64), A(4, "token", 64))
    with pytest.raises(SpecError, match=r"code_bias\[.*must be an int"):
        foldc.plan(spec, code_bias={role: bias})


@pytest.mark.parametrize("code_bias", [["key"], "key", 3])
def test_a_code_bias_that_is_no_dict_is_refused(code_bias):
    spec = foldc.AttentionSpec(8, 2, 64, A(2, "token", 64), A(4, "token", 64))
    with pytest.raises(SpecError, match="code_bias=.* must be a dict"):
        foldc.plan(spec, code_bias=code_bias)   # a list raised ValueError inside dict()


def test_a_query_dtype_that_is_no_string_is_a_spec_error():
    spec = foldc.AttentionSpec(8, 2, 64, A(2, "token", 64), A(4, "token", 64))
    for kwargs in ({"dtype": ["fp16"]}, {"dtype": "fp16", "operand_dtype": {"fp16"}}, {"target": "sm_90", "dtype": ["bf16"]}):
        with pytest.raises(SpecError, match="dtype"):   # TypeError (unhashable) before
            foldc.plan(spec, **kwargs)


@pytest.mark.parametrize("wrong", [None, "plan", A(2, "token", 64), foldc.AttentionSpec(8, 2, 64, A(2, "token", 64))])
def test_prove_check_and_explain_name_a_spec_passed_for_a_plan(wrong):
    """foldc.prove(spec) raised AttributeError ('AttentionSpec' object has no attribute 'graph')."""
    from foldc.layout_compile import explain

    for fn in (foldc.prove, check_plan, explain):
        with pytest.raises(foldc.InputTypeError, match=rf"takes a plan, got {type(wrong).__name__}; make one with "
                                                        r"foldc\.plan\(spec\)"):
            fn(wrong)
