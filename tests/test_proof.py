"""foldc.prove: right plans pass, and each kind of wrong plan is rejected by the rule (or the
symbolic check) that names it."""
from __future__ import annotations

import dataclasses

import pytest

import foldc
import foldc.proof as proof
from foldc.builder import build_decode_attention
from foldc.errors import GraphError, PlanError, ProofError
from foldc.ir import Add, GroupedAxis, canonical
from foldc.passes import AxisAnalysis, BreakEven, FoldRewrite, Ordering, run_pipeline
from foldc.proof import group_lemma, symbolic_check

A = foldc.Affine
LAYOUTS = [(k, v) for k in ("token", "channel") for v in ("token", "channel")]
SEED = {("qk", "token"): "acc-fold", ("qk", "channel"): "operand-fold",
        ("pv", "token"): "operand-fold", ("pv", "channel"): "acc-fold"}


def small_plan(k="token", v="channel", bits=2, group=16, code_bias=None):
    """8/2 heads (h = 4), head_dim 16: folds pay for group 16."""
    return foldc.plan(foldc.AttentionSpec(8, 2, 16, A(bits, k, group), A(bits, v, group)), code_bias=code_bias)


def check_report(report, plan):
    assert report.plan_folds == plan.folds
    folded = [name for name, p in plan.products.items() if p.fold in ("acc-fold", "operand-fold")]
    assert [lemma.split(":")[0] for lemma in report.lemmas] == folded
    for lemma in report.lemmas:
        name = lemma.split(":")[0]
        p = plan.products[name]
        assert lemma.startswith(f"{name}: {p.fold} (bias b={p.code_bias}): sum_r o[r]")
    assert report.checks == ("accumulator", "denominator", "output = accumulator / denominator")
    text = str(report)
    assert text.startswith(f"proof of plan {plan.folds}: exact")
    assert text.count("lemma (symbolic g): ") == len(folded)
    # the instances: small concrete sizes that cross every group and tile boundary
    assert len(report.instances) == 2
    tiles = [inst.token_tile for inst in report.instances]
    assert tiles == [3, 2]
    for inst, small in zip(report.instances, (2, 3)):
        assert inst.q_per_kv == 2
        token_group = inst.groups.get("token", small)
        assert inst.channels == 2 * inst.groups.get("channel", small)  # two channel groups
        assert inst.tokens == 2 * token_group + 1  # a partial last token group
        assert f"  instance: {inst}" in text
        assert f"{inst.tokens} tokens in tiles of {inst.token_tile}" in str(inst)
        assert f"{inst.channels} channels" in str(inst)
    assert report.seconds > 0


# -- right plans pass ------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("k, v", LAYOUTS)
def test_prove_all_layouts(k, v, bits):
    plan = foldc.plan(foldc.AttentionSpec(32, 8, 128, A(bits, k, 128), A(bits, v, 128)))
    assert plan.folds == {"qk": SEED[("qk", k)], "pv": SEED[("pv", v)]}
    report = foldc.prove(plan)
    check_report(report, plan)
    # group 128 of the real layout becomes groups of 2 and 3 in the instances
    for inst, small in zip(report.instances, (2, 3)):
        assert inst.groups == {("channel" if k == "token" else "token"): small,
                               ("channel" if v == "token" else "token"): small}
        assert "lemma (symbolic g)" in str(report)


def test_prove_dequant_plan():
    plan = foldc.plan(foldc.AttentionSpec(32, 2, 128, A(2, "token", 32), A(2, "channel", 32)))
    assert plan.folds == {"qk": "dequant", "pv": "dequant"}
    report = foldc.prove(plan)
    check_report(report, plan)
    assert report.lemmas == ()
    # the dequantized inputs keep their (shrunk) groups in the instances
    assert [inst.groups for inst in report.instances] == [{"channel": 2, "token": 2}, {"channel": 3, "token": 3}]
    assert "(channel groups of 2, token groups of 2)" in str(report.instances[0])


def test_prove_plain_plan():
    plan = foldc.plan(foldc.AttentionSpec(32, 8, 128))
    report = foldc.prove(plan)
    check_report(report, plan)
    assert report.plan_folds == {"qk": "none", "pv": "none"} and report.lemmas == ()
    assert all(inst.groups == {} and "(no groups)" in str(inst) for inst in report.instances)


def test_prove_mixed_plan():
    plan = foldc.plan(foldc.AttentionSpec(32, 8, 128, A(2, "token", 128), None))
    report = foldc.prove(plan)
    check_report(report, plan)
    assert report.plan_folds == {"qk": "acc-fold", "pv": "none"}
    assert len(report.lemmas) == 1


@pytest.mark.parametrize("k, v", [("token", "channel"), ("channel", "token")])
def test_prove_code_bias_plan(k, v):
    plan = foldc.plan(foldc.AttentionSpec(32, 8, 128, A(2, k, 64), A(2, v, 64)),
                      code_bias={"key": 1024, "value": 128})
    report = foldc.prove(plan)
    check_report(report, plan)
    assert report.lemmas[0].startswith(f"qk: {SEED[('qk', k)]} (bias b=1024)")
    assert report.lemmas[1].startswith(f"pv: {SEED[('pv', v)]} (bias b=128)")


def test_prove_accepts_a_split_finer_than_the_scale_group():
    plan = small_plan("token", "channel")
    g = plan.graph.copy()
    fine = GroupedAxis("token", 8)  # scale group 16: two partials per group, each inside one group
    n = g["pv.partial"]
    g.replace_node(dataclasses.replace(n, split=fine, axes=canonical(
        [fine if isinstance(a, GroupedAxis) else a for a in n.axes])))
    g.replace_node(dataclasses.replace(g["pv.scaled"], groups=fine))
    report = foldc.prove(plan.with_graph(g))
    assert report.plan_folds == {"qk": "acc-fold", "pv": "acc-fold"}


# -- wrong plans ---------------------------------------------------------------------------
def rejected(plan, graph, cls=PlanError):
    """prove(plan over graph) must raise exactly ``cls``; returns the exception."""
    with pytest.raises(PlanError) as info:
        foldc.prove(plan.with_graph(graph))
    assert type(info.value) is cls, type(info.value)
    return info.value


def key_after_softmax(plan):
    """The key correction is added to the softmax weights instead of the scores."""
    g = plan.graph.copy()
    g.rename_uses("scores", "scores.scaled")
    g.remove("scores")
    g.add(Add("p.corr", g["p"].axes, lhs="p", rhs="scores.offset"))
    g.rename_uses("p", "p.corr", skip=["p.corr", "acc", "out"])
    return g


def missing_correction(plan, keep_node):
    """The key correction is never added (its node left dangling, or removed)."""
    g = plan.graph.copy()
    g.rename_uses("scores", "scores.scaled")
    g.remove("scores")
    if not keep_node:
        g.remove("scores.offset")
    return g


def bias_unfolded(plan):
    """The codes carry bias 1024 but the zero does not subtract 1024 * scale."""
    g = plan.graph.copy()
    g.replace_node(dataclasses.replace(g["k.codes"], bias=1024))
    return g


def test_wrong_key_correction_after_softmax():
    plan = small_plan()
    e = rejected(plan, key_after_softmax(plan))
    assert e.rule == "key-correction-after-softmax"
    assert str(e) == ("[key-correction-after-softmax] %scores.offset (key side) is added after the softmax %p; "
                      "it must reach the logits before the max and exp (eq. 8)")


def test_wrong_value_correction_after_division():
    plan = small_plan()
    g = plan.graph.copy()
    g.rename_uses("pv", "pv.scaled")
    g.remove("pv")
    g.add(Add("out2", g["out"].axes, lhs="out", rhs="pv.offset"))
    g.output = "out2"
    e = rejected(plan, g)
    assert e.rule == "value-correction-after-division"
    assert str(e) == ("[value-correction-after-division] %pv.offset (value side) is added after the division by "
                      "the softmax denominator; it must land in the accumulator before it (eq. 10)")


def test_wrong_value_correction_after_accumulate_before_divide():
    plan = small_plan(v="token")
    g = plan.graph.copy()
    g.rename_uses("pv", "pv.scaled")
    g.remove("pv")
    g.add(Add("acc2", g["acc"].axes, lhs="acc", rhs="pv.offset"))
    g.rename_uses("acc", "acc2", skip=["acc2"])
    assert g["out"].acc == "acc2"
    e = rejected(plan, g)
    assert e.rule == "value-correction-after-division"
    assert str(e) == ("[value-correction-after-division] %pv.offset (value side) does not feed the accumulator "
                      "%acc, so the online softmax cannot rescale it; add it to the per-tile contribution before "
                      "the division (eq. 10)")


def test_wrong_partial_sum_crosses_group():
    plan = small_plan("token", "channel")
    g = plan.graph.copy()
    coarse = GroupedAxis("token", 32)  # the scale changes every 16 tokens
    n = g["pv.partial"]
    g.replace_node(dataclasses.replace(n, split=coarse, axes=canonical(
        [coarse if isinstance(a, GroupedAxis) else a for a in n.axes])))
    g.replace_node(dataclasses.replace(g["pv.scaled"], groups=coarse))
    e = rejected(plan, g)
    assert e.rule == "partial-sum-crosses-group"
    assert str(e) == ("[partial-sum-crosses-group] %pv.partial keeps partial sums per 32 along token but the "
                      "scale %v.scale changes every 16; an unscaled partial sum crosses a group boundary (eq. 5): "
                      "split every 16")
    # the symbolic layer alone also finds the coarse split wrong
    with pytest.raises(ProofError):
        symbolic_check(g, 2, 3)


def test_wrong_scaled_partial_that_is_not_a_split_contraction():
    plan = small_plan("token", "channel")
    g = plan.graph.copy()
    g.add(Add("pv.partial2", g["pv.partial"].axes, lhs="pv.partial", rhs="pv.partial"))
    g.replace_node(dataclasses.replace(g["pv.scaled"], partial="pv.partial2"))
    e = rejected(plan, g)
    assert e.rule == "partial-sum-crosses-group"
    assert str(e) == ("[partial-sum-crosses-group] %pv.scaled scales %pv.partial2, which is not split per group "
                      "along token; an unscaled partial sum would cross a group boundary (eq. 5)")


def test_wrong_fold_kind_operand_fold_on_token_wise_key():
    spec = foldc.AttentionSpec(8, 2, 16, A(2, "token", 16), A(2, "channel", 16))
    g = build_decode_attention(spec)
    g.replace_node(dataclasses.replace(g["scores"], fold="operand-fold"))
    g, log = run_pipeline(g, [BreakEven(), FoldRewrite(), Ordering()])
    assert "scores.prescaled" in g and "scores.partial" not in g
    plan = foldc.plan(spec)
    e = rejected(plan, g)
    assert e.rule == "fold-kind-mismatch"
    assert str(e) == ("[fold-kind-mismatch] qk applies operand-fold to %k, but the scale of %k is constant along "
                      "channel inside a group of 16 (eq. 3): the axes call for acc-fold")
    # operand-fold is still exact arithmetic: only the rule layer rejects this plan
    symbolic_check(g, 2, 3)


def test_wrong_fold_kind_acc_fold_on_channel_wise_key():
    spec = foldc.AttentionSpec(8, 2, 16, A(2, "channel", 16), A(2, "channel", 16))
    g = build_decode_attention(spec)
    g.replace_node(dataclasses.replace(g["scores"], fold="acc-fold"))
    with pytest.raises(PlanError) as info:
        run_pipeline(g, [BreakEven(), FoldRewrite(), Ordering()])
    assert type(info.value) is PlanError and info.value.rule == "fold-kind-mismatch"
    assert "qk: acc-fold needs the scale of %k constant along channel inside a group" in str(info.value)


def test_wrong_missing_correction_never_added():
    plan = small_plan()
    e = rejected(plan, missing_correction(plan, keep_node=True))
    assert e.rule == "missing-correction"
    assert str(e) == "[missing-correction] %scores.offset is computed but never added to the result"


def test_wrong_missing_correction_removed():
    plan = small_plan()
    e = rejected(plan, missing_correction(plan, keep_node=False))
    assert e.rule == "missing-correction"
    assert str(e) == "[missing-correction] %scores.partial folds %k but no correction adds zero x other (eq. 6)"


def test_wrong_code_bias_not_folded_into_zero():
    plan = small_plan()
    e = rejected(plan, bias_unfolded(plan), cls=ProofError)
    assert e.rule == "not-exact"
    assert str(e).startswith("[not-exact] the folded accumulator differs from dequantize-then-compute at index "
                             "(0, 0, 0, 0) on the instance 2 query rows, 4 channels, 5 tokens in tiles of 3")


def test_code_bias_folded_on_both_sides_is_exact():
    plan = small_plan()
    g = bias_unfolded(plan)
    g.replace_node(dataclasses.replace(g["k.zero"], bias=1024))
    report = foldc.prove(plan.with_graph(g))
    assert report.lemmas[0].startswith("qk: acc-fold (bias b=1024)")


def test_wrong_key_correction_after_sm_scale():
    """The rules accept a correction added after sm_scale (it still precedes the softmax);
    the symbolic execution finds that the correction misses the factor sm_scale."""
    plan = small_plan()
    g = plan.graph.copy()
    g.rename_uses("scores", "scores.scaled")
    g.remove("scores")
    g.add(Add("logits.corr", g["logits"].axes, lhs="logits", rhs="scores.offset"))
    g.rename_uses("logits", "logits.corr", skip=["logits.corr"])
    e = rejected(plan, g, cls=ProofError)
    assert e.rule == "not-exact"


def test_malformed_graph_is_a_graph_error():
    plan = small_plan()
    g = plan.graph.copy()
    g.replace_node(dataclasses.replace(g["logits"], axes=("batch", "kv_head", "q_per_kv", "channel")))
    with pytest.raises(GraphError, match=r"^%logits \(mul_scalar\): axes \[batch, kv_head, q_per_kv, channel\]"):
        foldc.prove(plan.with_graph(g))


def test_prove_needs_softmax_and_division():
    plan = foldc.plan(foldc.AttentionSpec(8, 2, 16))
    g = plan.graph.copy()
    g.remove("out")
    g.output = "acc"
    with pytest.raises(PlanError) as info:
        foldc.prove(plan.with_graph(g))
    assert info.value.rule == "not-attention"
    assert str(info.value) == "[not-attention] prove() handles decode-attention plans (online softmax and division)"


# -- the symbolic layer alone catches the executable wrong plans --------------------------------
@pytest.mark.parametrize("mutate", [key_after_softmax, lambda p: missing_correction(p, True),
                                    lambda p: missing_correction(p, False), bias_unfolded],
                         ids=["key-after-softmax", "missing-correction", "correction-removed", "bias-unfolded"])
def test_symbolic_check_alone_rejects(mutate):
    g = mutate(small_plan())
    with pytest.raises(ProofError) as info:
        symbolic_check(g, 2, 3)
    assert info.value.rule == "not-exact"
    assert "differs from dequantize-then-compute" in str(info.value)


def test_symbolic_check_accepts_the_right_plan():
    inst, checks = symbolic_check(small_plan().graph, 2, 3)
    assert (inst.q_per_kv, inst.channels, inst.tokens, inst.token_tile) == (2, 4, 5, 3)
    assert inst.groups == {"channel": 2, "token": 2}
    assert checks == ["accumulator", "denominator", "output = accumulator / denominator"]



@pytest.mark.parametrize("k, v", [(A(2, "token", 4), A(2, "token", 64)), (A(4, "token", 64), A(4, "token", 4)),
                                  (A(2, "token", 4), A(2, "channel", 256)), (A(2, "token", 8), A(2, "token", 64))])
def test_instances_stay_small_where_k_and_v_groups_differ_many_times(k, v):
    """Group sizes scale by the first operand's: K in groups of 1 channel and V of 128 made V's instance groups 256
    symbols each, and prove() ran for hours in sympy (a property test of the passes hung CI there). A group many times
    the reference's is two reference groups in the instance (one symbol more where the reference's does not divide
    it); the proof still rejects a wrong plan over such groups."""
    plan = foldc.plan(foldc.AttentionSpec(2, 2, 64, k, v))   # one query row per KV head: every side folds
    assert set(plan.folds.values()) <= {"acc-fold", "operand-fold"}
    for small in (2, 3):   # (fails fast where the instance is large, before sympy takes it)
        assert max(proof._shrink(plan.graph, small, 3)[1].groups.values()) <= 2 * small + 1
    report = foldc.prove(plan)
    check_report(report, plan)
    for inst, small in zip(report.instances, (2, 3)):
        assert max(inst.groups.values()) <= 2 * small + 1, inst
    with pytest.raises(ProofError, match="differs from dequantize-then-compute"):
        symbolic_check(key_after_softmax(plan), 2, 3)

# -- lemmas over a symbolic group size ----------------------------------------------------------
@pytest.mark.parametrize("fold", ["acc-fold", "operand-fold"])
@pytest.mark.parametrize("bias", [0, 1024])
def test_group_lemma(fold, bias):
    text = group_lemma(fold, bias)
    assert text.startswith(f"{fold} (bias b={bias}): sum_r o[r](s")
    assert ("s[r] c[r]" in text) == (fold == "operand-fold")


@pytest.mark.parametrize("fold", ["acc-fold", "operand-fold"])
def test_group_lemma_detects_a_broken_identity(fold, monkeypatch):
    """Perturb the folded side by one: the lemma must fail and name the fold and bias."""
    real = proof._linear_sums
    calls = []

    def perturbed(expr):
        calls.append(expr)
        return real(expr) + (1 if len(calls) == 1 else 0)  # the first call expands the folded side

    monkeypatch.setattr(proof, "_linear_sums", perturbed)
    with pytest.raises(ProofError) as info:
        group_lemma(fold, 1024)
    assert info.value.rule == "not-exact"
    assert str(info.value) == f"[not-exact] the {fold} group identity with bias 1024 does not hold"
    assert len(calls) == 2
