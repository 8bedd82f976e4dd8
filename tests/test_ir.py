"""The IR: named axes, the graph container, node printing and the structural verifier.

Every verifier message has one negative test that checks the exception class and that the
message names the offending node, field and values.
"""
from __future__ import annotations

import dataclasses
import re

import pytest

import foldc
from foldc.builder import CACHE_AXES, QUERY_AXES, SCORE_AXES, build_decode_attention
from foldc.errors import FoldError, GraphError
from foldc.ir import (BATCH, CANONICAL, CHANNEL, KV_HEAD, Q_PER_KV, TOKEN, Accumulate, Add, Codes,
                      Contract, Correction, Divide, Graph, GroupedAxis, GroupParam, Input, MulScalar,
                      OnlineSoftmax, Prescale, ScaleGroups, base_of, canonical, element_axes, param_axes,
                      verify)

A = foldc.Affine


def spec(k="token", v="channel", bits=2, group=16, heads=(8, 2), head_dim=16):
    enc = lambda layout: None if layout is None else A(bits, layout, group)  # noqa: E731
    return foldc.AttentionSpec(heads[0], heads[1], head_dim, k=enc(k), v=enc(v))


def built(k="token", v="channel"):
    """The unfolded decode-attention graph (a fresh copy: tests may edit it)."""
    return build_decode_attention(spec(k, v)).copy()


def planned(k="token", v="channel"):
    """A folded graph: K token-wise -> acc-fold on qk, V channel-wise -> acc-fold on pv by default."""
    return foldc.plan(spec(k, v)).graph.copy()


def swap(g: Graph, name: str, **changes) -> None:
    g.replace_node(dataclasses.replace(g[name], **changes))


def verify_error(g: Graph) -> str:
    with pytest.raises(GraphError) as info:
        verify(g)
    assert isinstance(info.value, FoldError)
    return str(info.value)


# -- axes ----------------------------------------------------------------------------------
def test_canonical_order_is_batch_kvhead_qperkv_token_channel_then_gemm_mnk():
    assert CANONICAL == (BATCH, KV_HEAD, Q_PER_KV, TOKEN, CHANNEL, "m", "n", "k")
    assert canonical([CHANNEL, TOKEN, BATCH]) == (BATCH, TOKEN, CHANNEL)
    assert canonical([CHANNEL, Q_PER_KV, KV_HEAD, TOKEN, BATCH]) == CANONICAL[:5]
    assert canonical(["k", "n", "m"]) == ("m", "n", "k")
    assert canonical([]) == ()


def test_grouped_axis_sorts_where_its_base_would():
    t64 = GroupedAxis(TOKEN, 64)
    assert canonical([CHANNEL, t64, BATCH]) == (BATCH, t64, CHANNEL)
    c32 = GroupedAxis(CHANNEL, 32)
    assert canonical([c32, TOKEN, KV_HEAD]) == (KV_HEAD, TOKEN, c32)


def test_grouped_axis_str_and_base():
    assert str(GroupedAxis("channel", 128)) == "channel/128"
    assert str(GroupedAxis("token", 7)) == "token/7"
    assert base_of(GroupedAxis("token", 7)) == "token"
    assert base_of("channel") == "channel"
    assert element_axes((BATCH, GroupedAxis(TOKEN, 4), CHANNEL)) == (BATCH, TOKEN, CHANNEL)
    # value semantics: equal when base and size agree
    assert GroupedAxis("token", 4) == GroupedAxis("token", 4) != GroupedAxis("token", 8)


def test_canonical_duplicate_base_axis_is_an_error():
    with pytest.raises(ValueError, match=r"axes \[token, token/16\] name the same base axis twice"):
        canonical([TOKEN, GroupedAxis(TOKEN, 16)])
    with pytest.raises(ValueError, match=r"axes \[channel, channel\] name the same base axis twice"):
        canonical([CHANNEL, CHANNEL])


def test_canonical_unknown_axis_is_an_error():
    with pytest.raises(ValueError, match=r"unknown axis 'head'; known axes are \('batch'"):
        canonical([BATCH, "head"])
    with pytest.raises(ValueError, match=r"unknown axis 'heads'"):
        canonical([GroupedAxis("heads", 2)])


def test_param_axes_group_the_encodings_group_axis():
    k = Input("k", CACHE_AXES, role="key", encoding=A(2, "token", 32))
    v = Input("v", CACHE_AXES, role="value", encoding=A(4, "channel", 64))
    assert param_axes(k) == (BATCH, KV_HEAD, TOKEN, GroupedAxis(CHANNEL, 32))
    assert param_axes(v) == (BATCH, KV_HEAD, GroupedAxis(TOKEN, 64), CHANNEL)


# -- node printing -------------------------------------------------------------------------
def test_node_str_prints_operands_nondefault_attrs_and_axes():
    n = Contract("s", SCORE_AXES, lhs="q", rhs="k", reduce=CHANNEL, product="qk")
    assert str(n) == "%s = contract %q, %k reduce=channel product=qk : [batch, kv_head, q_per_kv, token]"
    # always_print fields appear even at their default, defaults are omitted otherwise
    assert str(Input("q", QUERY_AXES)) == "%q = input role=query : [batch, kv_head, q_per_kv, channel]"
    assert str(GroupParam("k.scale", (BATCH, GroupedAxis(TOKEN, 8)), source="k")) == \
        "%k.scale = param %k param=scale : [batch, token/8]"
    assert str(Codes("k.codes", (TOKEN,), source="k", bias=1024)) == "%k.codes = codes %k bias=1024 : [token]"
    assert str(Input("k", CACHE_AXES, role="key", encoding=A(4, "channel", 64))) == \
        "%k = input role=key encoding=channel:4:64 : [batch, kv_head, token, channel]"


# -- Graph -----------------------------------------------------------------------------------
def chain() -> Graph:
    g = Graph("t", sizes={CHANNEL: 4})
    g.add(Input("a", (TOKEN,), role="key"))
    g.add(MulScalar("b", (TOKEN,), input="a"))
    g.add(MulScalar("c", (TOKEN,), input="b"))
    g.output = "c"
    return g


def test_graph_add_twice_is_an_error():
    g = chain()
    with pytest.raises(GraphError, match=r"node %b is defined twice; pick a fresh name"):
        g.add(MulScalar("b", (TOKEN,), input="a"))
    # the failed add left the graph as it was
    assert [n.name for n in g] == ["a", "b", "c"]
    verify(g)


def test_graph_forward_reference_can_be_defined_later():
    g = Graph("t")
    g.add(MulScalar("b", (TOKEN,), input="a"))
    assert "a" not in g and g.undefined() == ["a"]
    g.add(Input("a", (TOKEN,), role="key"))
    g.output = "b"
    verify(g)
    assert [n.name for n in g] == ["a", "b"]


def test_graph_getitem_unknown_name():
    with pytest.raises(GraphError, match=r"%nope is used but never defined"):
        chain()["nope"]


def test_graph_replace_node_rewires_operands():
    g = chain()
    g.replace_node(MulScalar("c", (TOKEN,), input="a"))
    assert g["c"].input == "a"
    assert [u.name for u in g.users("a")] == ["b", "c"]
    assert g.users("b") == []
    assert g.ancestors("c") == {"a"}
    verify(g)


def test_graph_replace_node_drops_an_unused_forward_reference():
    g = chain()
    g.replace_node(MulScalar("c", (TOKEN,), input="ghost"))
    assert g.undefined() == ["ghost"]
    g.replace_node(MulScalar("c", (TOKEN,), input="b"))
    assert g.undefined() == []
    verify(g)


def test_graph_replace_unknown_node_is_an_error():
    with pytest.raises(GraphError, match=r"cannot replace %zz: no such node"):
        chain().replace_node(MulScalar("zz", (TOKEN,), input="a"))


def test_graph_rename_uses_rewrites_every_user_field_and_the_output():
    g = Graph("t")
    g.add(Input("a", (TOKEN,), role="key"))
    g.add(Input("b", (TOKEN,), role="value"))
    g.add(Add("sq", (TOKEN,), lhs="a", rhs="a"))
    g.add(Add("keep", (TOKEN,), lhs="a", rhs="b"))
    g.output = "a"
    g.rename_uses("a", "b", skip=["keep"])
    assert (g["sq"].lhs, g["sq"].rhs) == ("b", "b")
    assert (g["keep"].lhs, g["keep"].rhs) == ("a", "b")
    assert g.output == "b"
    assert [u.name for u in g.users("a")] == ["keep"]


def test_graph_remove_with_users_is_an_error():
    g = chain()
    with pytest.raises(GraphError, match=r"cannot remove %a: still used by \['b'\]"):
        g.remove("a")
    assert "a" in g


def test_graph_remove_unknown_node_is_an_error():
    with pytest.raises(GraphError, match=r"cannot remove %nope: no such node"):
        chain().remove("nope")


def test_graph_remove_leaf():
    g = chain()
    g.remove("c")
    assert "c" not in g and [n.name for n in g] == ["a", "b"]
    g.output = "b"
    verify(g)


def test_graph_copy_is_independent():
    g = chain()
    g.meta["x"] = "1"
    h = g.copy()
    h.replace_node(MulScalar("c", (TOKEN,), input="a"))
    h.add(MulScalar("d", (TOKEN,), input="c"))
    h.meta["y"] = "2"
    h.sizes[TOKEN] = 9
    assert g["c"].input == "b" and "d" not in g
    assert "y" not in g.meta and TOKEN not in g.sizes
    assert h.title == g.title and h.output == g.output and h.meta["x"] == "1"


def test_graph_iteration_is_topological_with_insertion_order_ties():
    g = Graph("t")
    for name in ("x", "y", "z"):
        g.add(Input(name, (TOKEN,), role="key"))
    g.add(Add("late", (TOKEN,), lhs="z", rhs="x"))
    g.add(Add("early", (TOKEN,), lhs="x", rhs="y"))
    # make "x" depend on "early": x must now come after early although it was added first
    g.replace_node(Add("x", (TOKEN,), lhs="y", rhs="y"))
    order = [n.name for n in g]
    assert order == ["y", "x", "z", "late", "early"]
    assert [n.name for n in g] == order == [n.name for n in g.copy()]


def test_graph_iteration_of_a_built_graph_is_stable():
    first = [n.name for n in build_decode_attention(spec())]
    assert first == ["q", "k", "v", "scores", "logits", "p", "pv", "acc", "out"]
    assert first == [n.name for n in build_decode_attention(spec())]
    folded = [n.name for n in foldc.plan(spec()).graph]
    # fold-rewrite adds nodes at the end; iteration still puts each one before its users
    assert folded.index("k.codes") < folded.index("scores.partial") < folded.index("scores.scaled") \
        < folded.index("scores") < folded.index("logits") < folded.index("p")
    assert folded.index("scores.offset") < folded.index("scores")
    assert folded.index("pv") < folded.index("acc") < folded.index("out")


def test_nodes_of_and_users():
    g = planned()
    assert [n.name for n in g.nodes_of(Correction)] == ["scores.offset", "pv.offset"]
    assert [n.name for n in g.users("p")] == ["acc", "out", "pv.partial", "pv.offset"]


# -- verifier: graph-level ------------------------------------------------------------------
def test_built_and_planned_graphs_verify():
    for k in ("token", "channel", None):
        for v in ("token", "channel", None):
            verify(build_decode_attention(spec(k, v)))
            verify(foldc.plan(spec(k, v)).graph)


def test_verify_undefined_operand():
    g = built()
    swap(g, "logits", input="ghost")
    msg = verify_error(g)
    assert msg == "%ghost is used but never defined"


def test_verify_cycle():
    g = built()
    swap(g, "scores", lhs="logits")  # scores -> logits -> scores
    msg = verify_error(g)
    assert msg == "graph decode_attention(heads 8/2, head_dim 16, K token:2:16, V channel:2:16) has a cycle"


def test_verify_missing_output():
    g = built()
    g.output = None
    assert verify_error(g).endswith("has no output (output=None)")
    g.output = "nowhere"
    assert verify_error(g).endswith("has no output (output='nowhere')")


def test_verify_two_online_softmaxes():
    g = built()
    g.add(OnlineSoftmax("p2", SCORE_AXES, logits="logits"))
    assert verify_error(g) == "graph has 2 online softmaxes; decode attention has one"


def test_verify_axes_not_in_canonical_order():
    g = built()
    swap(g, "logits", axes=(BATCH, KV_HEAD, TOKEN, Q_PER_KV))
    msg = verify_error(g)
    assert msg == "%logits: axes [batch, kv_head, token, q_per_kv] are not in canonical order"


def test_verify_unknown_or_duplicate_axis_names_the_node():
    g = built()
    swap(g, "logits", axes=(BATCH, "head", TOKEN))
    assert verify_error(g).startswith("%logits: unknown axis 'head'")
    g = built()
    swap(g, "logits", axes=(BATCH, TOKEN, GroupedAxis(TOKEN, 2)))
    assert verify_error(g) == "%logits: axes [batch, token, token/2] name the same base axis twice"


# -- verifier: per node ---------------------------------------------------------------------
def test_verify_encoded_query():
    g = built()
    swap(g, "q", encoding=A(2, "token", 16))
    assert verify_error(g) == "%q: the query cannot be encoded"


def test_verify_contract_reduces_an_axis_an_operand_lacks():
    g = built()
    swap(g, "scores", reduce=TOKEN)
    msg = verify_error(g)
    assert msg == ("%scores (contract) sums over 'token' but operand %q has axes "
                   "[batch, kv_head, q_per_kv, channel]")


def test_verify_wrong_declared_axes_names_both_lists():
    g = built()
    swap(g, "scores", axes=QUERY_AXES)
    msg = verify_error(g)
    assert msg == ("%scores (contract): axes [batch, kv_head, q_per_kv, channel] but its operands give "
                   "[batch, kv_head, q_per_kv, token]")


def test_verify_wrong_declared_axes_of_a_mul_scalar():
    g = built()
    swap(g, "logits", axes=(BATCH, KV_HEAD, TOKEN))
    msg = verify_error(g)
    assert msg == ("%logits (mul_scalar): axes [batch, kv_head, token] but its operands give "
                   "[batch, kv_head, q_per_kv, token]")


def test_verify_contract_split_along_another_axis():
    g = planned()
    swap(g, "scores.partial", split=GroupedAxis(TOKEN, 16))
    msg = verify_error(g)
    assert msg == ("%scores.partial: split=token/16 but reduce='channel'; partials can only be split along "
                   "the reduced axis")


def test_verify_contract_of_a_grouped_operand():
    g = planned()
    # q . v.scale over channel: both have a plain channel axis, but v.scale is per token group
    g.add(Contract("bad", (BATCH, KV_HEAD, Q_PER_KV, GroupedAxis(TOKEN, 16)), lhs="q", rhs="v.scale",
                   reduce=CHANNEL))
    msg = verify_error(g)
    assert msg == ("%bad: contraction operands must have one entry per value; got "
                   "[batch, kv_head, q_per_kv, channel] and [batch, kv_head, token/16, channel]")


def test_verify_param_with_element_axes():
    g = planned()
    swap(g, "k.zero", axes=CACHE_AXES)
    msg = verify_error(g)
    assert msg == ("%k.zero (param): axes [batch, kv_head, token, channel] but its operands give "
                   "[batch, kv_head, token, channel/16]")


def test_verify_add_of_mismatched_axes():
    g = planned()
    swap(g, "scores", rhs="q")
    msg = verify_error(g)
    assert msg == ("%scores: adds %scores.scaled [batch, kv_head, q_per_kv, token] and "
                   "%q [batch, kv_head, q_per_kv, channel], whose axes differ")


def test_verify_accumulate_input_still_has_the_token_axis():
    g = built()
    swap(g, "acc", input="logits")
    msg = verify_error(g)
    assert msg == ("%acc: accumulates %logits, which still has axis 'token'; sum it over the tile first")


@pytest.mark.parametrize("node, field", [("acc", "softmax"), ("out", "softmax")])
def test_verify_softmax_operand_must_be_an_online_softmax(node, field):
    g = built()
    swap(g, node, **{field: "logits"})
    msg = verify_error(g)
    assert msg == f"%{node}: softmax operand %logits is a mul_scalar, not an online softmax"


def test_verify_online_softmax_over_a_missing_axis():
    g = built()
    swap(g, "p", axis=CHANNEL)
    msg = verify_error(g)
    assert msg == ("%p (online_softmax) sums over 'channel' but operand %logits has axes "
                   "[batch, kv_head, q_per_kv, token]")


def test_verify_codes_of_a_plain_input():
    g = planned()
    swap(g, "k.codes", source="q")
    assert verify_error(g) == "%k.codes (codes) reads %q, which is not an encoded input"


def test_verify_param_of_a_plain_input():
    g = planned()
    swap(g, "k.zero", source="q")
    assert verify_error(g) == "%k.zero (param) reads %q, which is not an encoded input"


def test_verify_scale_with_a_bias():
    g = planned()
    swap(g, "k.scale", bias=1024)
    assert verify_error(g) == "%k.scale: a scale carries no bias (bias=1024)"


def test_verify_prescale_needs_a_scale():
    g = planned(k="channel")
    swap(g, "scores.prescaled", scale="k.zero")
    assert verify_error(g) == "%scores.prescaled: prescale needs a scale parameter, got %k.zero (param)"
    g = planned(k="channel")
    swap(g, "scores.prescaled", scale="q")
    assert verify_error(g) == "%scores.prescaled: prescale needs a scale parameter, got %q (input)"


def test_verify_scale_groups_needs_a_scale():
    g = planned()
    swap(g, "scores.scaled", scale="k.zero")
    assert verify_error(g) == "%scores.scaled: needs a scale parameter, got %k.zero (param)"


def test_verify_scale_groups_on_an_axis_the_partial_lacks():
    g = planned()
    swap(g, "scores.scaled", groups=GroupedAxis(CHANNEL, 8))
    msg = verify_error(g)
    assert msg == ("%scores.scaled: groups=channel/8 is not an axis of %scores.partial "
                   "[batch, kv_head, q_per_kv, token, channel/16]")
    swap(g, "scores.scaled", groups=None)
    assert verify_error(g).startswith("%scores.scaled: groups=None is not an axis of %scores.partial")


def test_verify_correction_needs_a_zero():
    g = planned()
    swap(g, "scores.offset", zero="k.scale")
    assert verify_error(g) == "%scores.offset: needs a zero parameter, got %k.scale (param)"


def test_verify_group_sum_correction_needs_a_grouped_zero():
    g = planned(k="channel")  # the zero of channel-wise K is per channel, grouped along token
    swap(g, "scores.offset", form="group-sum")
    msg = verify_error(g)
    assert msg == ("%scores.offset: form=group-sum needs the zero grouped along 'channel'; %k.zero has axes "
                   "[batch, kv_head, token/16, channel]")


def test_verify_correction_over_a_missing_axis():
    g = planned()
    swap(g, "scores.offset", reduce=TOKEN)
    msg = verify_error(g)
    assert msg == ("%scores.offset (correction) sums over 'token' but operand %q has axes "
                   "[batch, kv_head, q_per_kv, channel]")


def test_every_node_kind_has_a_verifier_check():
    from foldc.ir import nodes
    from foldc.ir.verify import _CHECKS
    kinds = {obj for obj in vars(nodes).values()
             if isinstance(obj, type) and issubclass(obj, nodes.Node) and obj is not nodes.Node}
    assert len(kinds) == 13
    assert kinds == set(_CHECKS)
