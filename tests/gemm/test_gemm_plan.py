"""GEMM through the generic passes and proofs: the three reductions of issue 6 (k-group weight,
per-output-channel weight, INT8 x INT8 with zero points), the break-even of eq. 16, spec
validation, and one wrong plan per rule rejected by foldc.prove."""
from __future__ import annotations

import dataclasses

import pytest

import foldc
from foldc.errors import GraphError, PlanError, ProofError, SpecError
from foldc.gemm import GemmSpec, parse_gemm_encoding
from foldc.ir import Add, Contract, Correction, GroupedAxis, Prescale


def spec(weight="k-group:4:128", activation=None, m=1, n=256, k=512):
    return GemmSpec(n, k, parse_gemm_encoding(weight, "weight"), parse_gemm_encoding(activation, "activation"), m=m)


CASES = {
    "int4 k-group": spec("k-group:4:128"),
    "int2 k-group": spec("k-group:2:64", m=16),
    "per-channel": spec("per-channel:8", m=None),
    "int8 x int8": spec("per-channel:8", "per-token:8", m=16),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_case_plans_and_proves(name):
    plan = foldc.plan(CASES[name])
    report = foldc.prove(plan)
    assert report.plan_folds == plan.folds
    assert all(fold == "acc-fold" for fold in plan.folds.values())
    assert len(report.instances) == 2 and report.checks == ("output = dequantize-then-matmul, every entry",)


def test_k_group_folds_per_group_with_a_row_sum_correction():
    plan = foldc.plan(spec("k-group:4:128"))
    g = plan.graph
    assert g["y.partial"].split == GroupedAxis("k", 128)
    assert g["y.offset"].form == "group-sum" and g["y.offset"].other == "x"
    assert [str(c) for c in plan.constraints] == ["xw: an unscaled partial sum must not cross a multiple of 128 along k"]
    assert plan.operands["w"].scale_site == "each group's partial sum (per 128 k)"


def test_per_channel_is_an_epilogue_fold():
    plan = foldc.plan(spec("per-channel:4", m=None))
    assert plan.graph["y.partial"].split == GroupedAxis("k", 512)  # one group spans k: scale once per output
    assert plan.operands["w"].scale_site == "the finished sum, once per output (epilogue)"


def test_int8_expansion_has_the_four_terms_of_eq_15():
    g = foldc.plan(CASES["int8 x int8"]).graph
    codes_product = g["y.partial.partial"]
    assert (codes_product.lhs, codes_product.rhs) == ("w.codes", "x.codes")       # codes . codes
    assert (g["y.partial.offset"].zero, g["y.partial.offset"].other) == ("x.zero", "w.codes")  # column sums of w
    assert (g["y.rowsum.partial"].lhs, g["y.rowsum.partial"].rhs) == ("ones.k", "x.codes")     # row sums of x
    assert (g["y.rowsum.offset"].zero, g["y.rowsum.offset"].other) == ("x.zero", "ones.k")     # constant k z_x z_w
    assert g["y.offset"].form == "presummed" and g["y.offset"].zero == "w.zero"


@pytest.mark.parametrize("m, group, fold", [(1, 128, "acc-fold"), (16, 128, "acc-fold"), (64, 128, "dequant"),
                                            (256, 128, "dequant"), (256, 256, "acc-fold"), (32, 64, "dequant")])
def test_break_even_of_eq_16(m, group, fold):
    plan = foldc.plan(spec(f"k-group:4:{group}", m=m))
    h = min(m, 64)
    assert plan.folds["w"] == fold
    assert plan.operands["w"].rows_per_group == h
    assert (2 * h < group) == (fold == "acc-fold")


def test_fold_policy_dequant_still_proves():
    plan = foldc.plan(spec("k-group:2:128"), fold_policy="dequant")
    assert plan.folds == {"w": "dequant"}
    foldc.prove(plan)


@pytest.mark.parametrize("kwargs, message", [
    (dict(weight="k-group:4:100"), "group_size=100 does not divide k=512; pick a divisor of 512"),
    (dict(weight="per-channel:8", activation="per-token:8", k=0), "k=0 must be a positive integer"),
    (dict(weight="k-group:4:128", activation="per-token:8"),
     "activation='per-token:8' needs weight='per-channel:8' (or other bits)"),
    (dict(weight=None, activation=None), "weight=None and activation=None: nothing is encoded"),
    (dict(weight="k-group:3:128"), "bits=3 is not supported; use one of (2, 4, 8)"),
])
def test_spec_errors_name_the_value_and_the_fix(kwargs, message):
    with pytest.raises(SpecError) as info:
        spec(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize("text, role, message", [
    ("k-group:4", "weight", "weight='k-group:4' must look like 'k-group:bits:group_size'"),
    ("per-token:8", "weight", "kind 'per-token' is not a weight encoding"),
    ("per-channel:8:128", "weight", "must look like 'per-channel:bits'"),
    ("k-group:four:128", "weight", "bits and group_size must be integers"),
    ("bf16", "weight", "kind '' is not a weight encoding"),          # a scale dtype alone: IndexError before
    ("fp32", "activation", "kind '' is not a activation encoding"),
])
def test_encoding_text_errors(text, role, message):
    with pytest.raises(SpecError) as info:
        parse_gemm_encoding(text, role)
    assert message in str(info.value)


# -- wrong plans: one per rule ---------------------------------------------------------------
def rejected(plan, graph, cls=PlanError):
    with pytest.raises(cls) as info:
        foldc.prove(plan.with_graph(graph))
    return info.value


def drop_correction(graph, add_name):
    """Replace ``add = scaled + offset`` by the scaled part alone."""
    g = graph.copy()
    add = g[add_name]
    g.rename_uses(add_name, add.lhs)
    g.remove(add_name)
    g.remove(add.rhs)
    return g


def test_missing_row_sum_correction_is_rejected():
    plan = foldc.plan(CASES["int8 x int8"])
    g = drop_correction(plan.graph, "y")
    for name in ("y.rowsum", "y.rowsum.scaled", "y.rowsum.offset", "y.rowsum.partial"):
        g.remove(name)
    e = rejected(plan, g)
    assert e.rule == "missing-correction"
    assert "applies the scale of %w but no correction adds its zero" in str(e)


def test_missing_column_sum_correction_is_rejected():
    plan = foldc.plan(CASES["int8 x int8"])
    e = rejected(plan, drop_correction(plan.graph, "y.partial"))  # drops z_x x column sums of w codes
    assert e.rule == "missing-correction"
    assert str(e) == ("[missing-correction] %y.partial.scaled scales by %x.scale but is not added to the offset "
                      "correction of %x (zero x sum of the other operand, eq. 6)")


def test_missing_weight_correction_is_rejected():
    plan = foldc.plan(spec("k-group:4:128"))
    e = rejected(plan, drop_correction(plan.graph, "y"))
    assert e.rule == "missing-correction"
    assert str(e) == "[missing-correction] %y.partial folds %w but no correction adds zero x other (eq. 6)"


def test_partial_sum_crossing_a_group_boundary_is_rejected():
    plan = foldc.plan(spec("k-group:4:128"))
    g = plan.graph.copy()
    wide = GroupedAxis("k", 256)
    g.replace_node(dataclasses.replace(g["y.partial"], split=wide, axes=("m", "n", wide)))
    g.replace_node(dataclasses.replace(g["y.scaled"], groups=wide))
    e = rejected(plan, g)
    assert e.rule == "partial-sum-crosses-group"
    assert "the scale %w.scale changes every 128; an unscaled partial sum crosses a group boundary" in str(e)


def test_fold_kind_mismatch_is_rejected():
    """An operand-fold (pre-scaling x by the weight scale) where the axes call for acc-fold."""
    plan = foldc.plan(spec("k-group:4:128"))
    g = plan.graph.copy()
    g.add(Prescale("y.pre", ("m", "n", "k"), operand="x", scale="w.scale", product="xw"))
    g.add(Contract("y.op", ("m", "n"), lhs="y.pre", rhs="w.codes", reduce="k", product="xw", fold="operand-fold"))
    g.add(Correction("y.off", ("m", "n"), zero="w.zero", other="x", reduce="k", form="contract", product="xw"))
    g.replace_node(Add("y", ("m", "n"), lhs="y.op", rhs="y.off"))
    for name in ("y.scaled", "y.offset", "y.partial"):
        g.remove(name)
    e = rejected(plan, g)
    assert e.rule == "fold-kind-mismatch"
    assert str(e) == ("[fold-kind-mismatch] xw applies operand-fold to %w, but the scale of %w is constant along "
                      "k inside a group of 128 (eq. 3): the axes call for acc-fold")


def test_wrong_code_bias_is_caught_by_the_symbolic_run():
    plan = foldc.plan(spec("k-group:4:128"), code_bias={"weight": 8})
    foldc.prove(plan)  # the right plan, with the bias folded into the zero (eq. 7)
    g = plan.graph.copy()
    g.replace_node(dataclasses.replace(g["w.zero"], bias=0))  # bias added to codes but not folded
    e = rejected(plan, g, cls=ProofError)
    assert e.rule == "not-exact"
    assert "differs from dequantize-then-matmul at index" in str(e)


def test_verifier_rejects_presummed_correction_without_group_sums():
    plan = foldc.plan(CASES["int8 x int8"])
    g = plan.graph.copy()
    g.replace_node(dataclasses.replace(g["y.offset"], other="x.codes"))
    with pytest.raises(GraphError, match="form=presummed needs"):
        foldc.prove(plan.with_graph(g))


@pytest.mark.parametrize("weight", ["k-group:2:128", "k-group:4:32", "k-group:8:64", "per-channel:4"])
def test_the_weight_operand_carries_its_packing(weight):
    """Codes per byte and bytes per packed row are the plan's numbers (the kernels read them there)."""
    from foldc.gemm.plan import gemm_plan
    from foldc.gemm.spec import GemmSpec, parse_gemm_encoding

    enc = parse_gemm_encoding(weight, "weight")
    w = gemm_plan(GemmSpec(64, 1024, weight=enc)).operands["w"]
    assert w.fields * enc.bits == 8 and w.row_bytes * w.fields == 1024
