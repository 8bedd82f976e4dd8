"""Golden text of the folded IR, ``str(foldc.plan(spec).graph)``, one file per case in tests/golden/.

Regenerate after an intended change with::

    FOLDC_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/test_golden.py

then read the diff: the seed table must still hold (token-wise K -> acc-fold, channel-wise K ->
operand-fold on q, token-wise V -> operand-fold on p, channel-wise V -> acc-fold), and each
correction must feed the add that precedes the softmax (key) or the accumulator (value).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import foldc
from foldc.gemm import parse_gemm_encoding

A = foldc.Affine
G = parse_gemm_encoding
GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("FOLDC_UPDATE_GOLDEN") == "1"


def int2(layout, group=128):
    return A(2, layout, group)


#: name -> (spec, code_bias)
CASES = {
    "int2_g128_k_token_v_token": (foldc.AttentionSpec(32, 8, 128, int2("token"), int2("token")), None),
    "int2_g128_k_token_v_channel": (foldc.AttentionSpec(32, 8, 128, int2("token"), int2("channel")), None),
    "int2_g128_k_channel_v_token": (foldc.AttentionSpec(32, 8, 128, int2("channel"), int2("token")), None),
    "int2_g128_k_channel_v_channel": (foldc.AttentionSpec(32, 8, 128, int2("channel"), int2("channel")), None),
    # q_per_kv = 16, group 32: 32 <= 2*16, so both folds fall back to per-value dequantize
    "int2_g32_h16_dequant": (foldc.AttentionSpec(32, 2, 128, int2("token", 32), int2("channel", 32)), None),
    "plain": (foldc.AttentionSpec(32, 8, 128, None, None), None),
    "mixed_k_token_v_plain": (foldc.AttentionSpec(32, 8, 128, int2("token"), None), None),
    # token-wise V with 4 channel groups: the pre-scaled p changes per channel group
    "int4_g32_k_channel_v_token_bias": (foldc.AttentionSpec(32, 8, 128, A(4, "channel", 32), A(4, "token", 32)),
                                        {"key": 1024, "value": 128}),
    # GEMM y = x @ w.T: a k-group INT4 weight at decode (acc-fold per group, row sums of x)
    "gemm_int4_g128_m1": (foldc.GemmSpec(4096, 4096, G("k-group:4:128", "weight"), m=1), None),
    # INT8 x INT8 with zero points, code bias -128: the four terms of eq. 15
    "gemm_w8a8_bias": (foldc.GemmSpec(4096, 4096, G("per-channel:8", "weight"), G("per-token:8", "activation"),
                                      m=16), {"weight": -128, "activation": -128}),
}


def render(name: str) -> str:
    spec, bias = CASES[name]
    return str(foldc.plan(spec, code_bias=bias).graph) + "\n"


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_ir(name):
    path = GOLDEN / f"{name}.txt"
    text = render(name)
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
        pytest.skip(f"FOLDC_UPDATE_GOLDEN=1: rewrote {path.name}")
    assert path.exists(), f"{path} is missing; run with FOLDC_UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text()


def test_no_stale_golden_files():
    on_disk = {p.stem for p in GOLDEN.glob("*.txt")}
    assert on_disk == set(CASES)


def test_golden_text_is_deterministic():
    name = "int2_g128_k_token_v_channel"
    assert render(name) == render(name)


# The golden files are checked above byte for byte; the tests below read them back and check
# the facts a reviewer would check, so a regenerated file with a wrong plan cannot slip in.
def golden(name: str) -> list[str]:
    return [line.strip() for line in (GOLDEN / f"{name}.txt").read_text().splitlines()]


def line_of(lines, prefix: str) -> str:
    hits = [line for line in lines if line.startswith(prefix)]
    assert len(hits) == 1, (prefix, hits)
    return hits[0]


@pytest.mark.parametrize("k, v", [("token", "token"), ("token", "channel"), ("channel", "token"),
                                  ("channel", "channel")])
def test_golden_files_follow_the_seed_table(k, v):
    lines = golden(f"int2_g128_k_{k}_v_{v}")
    if k == "token":  # acc-fold: partial per channel group, scaled, then corrected by a group sum
        assert "fold=acc-fold" in line_of(lines, "%scores.partial = contract %q, %k.codes reduce=channel "
                                                 "split=channel/128")
        line_of(lines, "%scores.scaled = scale_groups %scores.partial, %k.scale groups=channel/128")
        line_of(lines, "%scores.offset = correction %k.zero, %q reduce=channel form=group-sum")
    else:  # operand-fold on q
        line_of(lines, "%scores.prescaled = prescale %q, %k.scale product=qk")
        assert "fold=operand-fold" in line_of(lines, "%scores.scaled = contract %scores.prescaled, %k.codes")
        line_of(lines, "%scores.offset = correction %k.zero, %q reduce=channel form=contract")
    if v == "token":  # operand-fold on p
        line_of(lines, "%pv.prescaled = prescale %p, %v.scale product=pv")
        assert "fold=operand-fold" in line_of(lines, "%pv.scaled = contract %pv.prescaled, %v.codes")
        line_of(lines, "%pv.offset = correction %v.zero, %p reduce=token form=contract")
    else:  # acc-fold
        assert "fold=acc-fold" in line_of(lines, "%pv.partial = contract %p, %v.codes reduce=token split=token/128")
        line_of(lines, "%pv.scaled = scale_groups %pv.partial, %v.scale groups=token/128")
        line_of(lines, "%pv.offset = correction %v.zero, %p reduce=token form=group-sum")
    # corrections feed the add that precedes the softmax / the accumulator
    names = [line.split(" = ")[0] for line in lines if line.startswith("%")]
    line_of(lines, "%scores = add %scores.scaled, %scores.offset")
    line_of(lines, "%pv = add %pv.scaled, %pv.offset")
    line_of(lines, "%logits = mul_scalar %scores")
    line_of(lines, "%p = online_softmax %logits")
    line_of(lines, "%acc = accumulate %pv, %p")
    assert names.index("%scores") < names.index("%p") < names.index("%pv") < names.index("%acc")
    assert lines[-1].startswith("reason.qk") and "return %out" in lines


def test_golden_dequant_has_no_correction():
    lines = golden("int2_g32_h16_dequant")
    assert not any(" correction " in line or " prescale " in line or " scale_groups " in line for line in lines)
    line_of(lines, "%k.values = dequantize %k")
    line_of(lines, "%v.values = dequantize %v")
    assert "fold=dequant" in line_of(lines, "%scores = contract %q, %k.values")
    assert "fold=dequant" in line_of(lines, "%pv = contract %p, %v.values")
    assert "group_size=32 <= 2*h=32" in line_of(lines, "break-even.qk:")
    assert not any(line.startswith("constraint:") for line in lines)


def test_golden_plain_and_mixed():
    plain = golden("plain")
    assert not any("codes" in line or "correction" in line or "dequantize" in line for line in plain)
    assert "fold=" not in line_of(plain, "%scores = contract %q, %k reduce=channel")
    mixed = golden("mixed_k_token_v_plain")
    line_of(mixed, "%v = input role=value : [batch, kv_head, token, channel]")
    line_of(mixed, "%pv = contract %p, %v reduce=token product=pv :")
    line_of(mixed, "%scores.offset = correction %k.zero, %q")
    assert not any(line.startswith("%v.") or line.startswith("%pv.") for line in mixed)


def test_golden_bias_case():
    lines = golden("int4_g32_k_channel_v_token_bias")
    line_of(lines, "%k.codes = codes %k bias=1024 :")
    line_of(lines, "%k.zero = param %k param=zero bias=1024 :")
    line_of(lines, "%v.codes = codes %v bias=128 :")
    line_of(lines, "%v.zero = param %v param=zero bias=128 :")
    assert "bias" not in line_of(lines, "%k.scale =")
    assert line_of(lines, "constraint: pv:") == \
        "constraint: pv: one pre-scaled %p (it changes per channel group) must not cross a multiple of 32 along channel"
    assert line_of(lines, "constraint: qk:") == \
        "constraint: qk: one pre-scaled %q (it changes per token group) must not cross a multiple of 32 along token"
