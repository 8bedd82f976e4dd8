"""Cost model (eq. 12, 13) and the explain views built on it."""
from __future__ import annotations

from fractions import Fraction

import pytest

import foldc
from foldc.cost import CONSTRUCTION, GPUS, IssueVerdict, lane_slots_per_byte, verdicts
from foldc.explain import SEED_TABLE_HEADER, explain_table, plan_summary, seed_table

A = foldc.Affine
GPU = {g.name: g for g in GPUS}
H4_G128 = Fraction(2 * 4, 128)  # the fold's ops per value at h = 4, g = 128


# -- budgets (eq. 13) -------------------------------------------------------------------------
@pytest.mark.parametrize("name, arch, budget", [("H100 SXM", "sm_90", 9.99), ("H200", "sm_90", 6.97),
                                                ("B200", "sm_100", 4.65)])
def test_lane_slot_budgets(name, arch, budget):
    gpu = GPU[name]
    assert gpu.arch == arch
    assert gpu.lane_slots_per_byte == pytest.approx(budget, abs=0.02)
    assert gpu.lane_slots_per_byte == pytest.approx(gpu.sms * 128 * gpu.clock_ghz / (gpu.hbm_tb_s * 1e3))


def test_gpu_list():
    assert [g.name for g in GPUS] == ["H100 SXM", "H200", "B200"]
    assert set(CONSTRUCTION) == {g.arch for g in GPUS}


# -- demand (eq. 13), the seed's figures ---------------------------------------------------------
@pytest.mark.parametrize("arch, fold, want", [
    ("sm_90", "dequant", 6.0), ("sm_90", "acc-fold", 4.25), ("sm_90", "operand-fold", 4.25),
    ("sm_100", "dequant", 8.0), ("sm_100", "acc-fold", 1.0), ("sm_100", "operand-fold", 1.0)])
def test_int2_h4_g128_demand_matches_the_seed(arch, fold, want):
    assert lane_slots_per_byte(arch, fold, 2, H4_G128) == pytest.approx(want, abs=1e-12)


def test_demand_scales_with_values_per_byte():
    assert lane_slots_per_byte("sm_90", "dequant", 4, 0) == pytest.approx(3.0)
    assert lane_slots_per_byte("sm_90", "dequant", 8, 0) == pytest.approx(1.5)
    assert lane_slots_per_byte("sm_100", "acc-fold", 4, 0.25) == pytest.approx(2 * (0.1875 + 0.25))
    # the fold's own ops per value are added per value
    assert lane_slots_per_byte("sm_90", "acc-fold", 2, 1) - lane_slots_per_byte("sm_90", "acc-fold", 2, 0) == \
        pytest.approx(4)


def test_demand_unknown_arch():
    with pytest.raises(ValueError, match=r"^arch='sm_80' has no cost figures; use one of \['sm_100', 'sm_90'\]$"):
        lane_slots_per_byte("sm_80", "dequant", 2, 0)


@pytest.mark.parametrize("fold", ["none", "fold"])
def test_demand_of_a_fold_that_reads_no_codes(fold):
    with pytest.raises(ValueError, match=rf"^fold='{fold}' reads no codes$"):
        lane_slots_per_byte("sm_90", fold, 2, 0)


# -- verdicts ---------------------------------------------------------------------------------
def test_verdicts_dequant_int2():
    v = {x.gpu.name: x for x in verdicts("dequant", 2, 0)}
    assert [x.bound for x in v.values()] == ["bandwidth-bound", "bandwidth-bound", "issue-bound"]
    assert str(v["H100 SXM"]) == "H100 SXM: 6.00 of 9.99 lane-slots/byte (60%) -> bandwidth-bound"
    assert str(v["H200"]) == "H200: 6.00 of 6.97 lane-slots/byte (86%) -> bandwidth-bound"
    assert str(v["B200"]) == "B200: 8.00 of 4.65 lane-slots/byte (172%) -> issue-bound"


def test_verdicts_fold_int2():
    v = {x.gpu.name: x for x in verdicts("acc-fold", 2, H4_G128)}
    assert all(x.bound == "bandwidth-bound" for x in v.values())
    assert str(v["H100 SXM"]) == "H100 SXM: 4.25 of 9.99 lane-slots/byte (43%) -> bandwidth-bound"
    assert str(v["H200"]) == "H200: 4.25 of 6.97 lane-slots/byte (61%) -> bandwidth-bound"
    # 1.00 / 4.6546 = 21.5%: docs/derivation.md rounds the budget to 4.65 first and says 22%
    assert str(v["B200"]) == "B200: 1.00 of 4.65 lane-slots/byte (21%) -> bandwidth-bound"


def test_verdict_bound_is_strict():
    gpu = GPUS[0]
    assert IssueVerdict(gpu, 1.0, 2.0).bound == "bandwidth-bound"
    assert IssueVerdict(gpu, 2.0, 2.0).bound == "issue-bound"
    assert IssueVerdict(gpu, 3.0, 2.0).bound == "issue-bound"


def test_plan_carries_the_issue_verdicts():
    p = foldc.plan(foldc.AttentionSpec(32, 8, 128, A(2, "token", 128), A(2, "channel", 128)))
    for prod in p.products.values():
        assert [round(v.demand, 6) for v in prod.issue] == [4.25, 4.25, 1.0]
        assert [v.gpu.name for v in prod.issue] == ["H100 SXM", "H200", "B200"]
    dq = foldc.plan(foldc.AttentionSpec(32, 2, 128, A(2, "token", 32), A(2, "channel", 32)))
    assert [v.demand for v in dq.products["qk"].issue] == [6.0, 6.0, 8.0]
    assert foldc.plan(foldc.AttentionSpec(32, 8, 128)).products["qk"].issue == ()


# -- explain_table ----------------------------------------------------------------------------
def parse_table(text: str) -> dict[str, list[str]]:
    """``explain_table`` / ``seed_table`` text -> {row label: [cell text per column]}, header row first."""
    lines = [line for line in text.splitlines() if line.startswith(("|", "+"))]
    rows, block = [], []
    for line in lines:
        if line.startswith("+"):
            if block:
                rows.append(block)
            block = []
        else:
            block.append([c.strip() for c in line.strip()[1:-1].split(" | ")])
    out = {}
    for block in rows:
        cells = [" ".join(part[i] for part in block if part[i]) for i in range(len(block[0]))]
        out[cells[0]] = cells[1:]
    return out


def squash(text: str) -> str:
    """Compare wrapped cells without the whitespace and hyphen breaks textwrap may add."""
    return "".join(text.split())


ROWS = ["product", "encoded operand", "fold", "scale goes to", "correction term", "code bias (eq. 7)",
        "must land before", "operand precision (eq. 6a)", "tiling constraint", "cost (eq. 12)", "break-even",
        "issue budget (eq. 13)"]


@pytest.mark.parametrize("k, v", [("token", "token"), ("token", "channel"), ("channel", "token"),
                                  ("channel", "channel")])
def test_explain_table_rows_for_each_product(k, v):
    p = foldc.plan(foldc.AttentionSpec(32, 8, 128, A(2, k, 128), A(2, v, 128)), code_bias={"key": 1024})
    text = explain_table(p)
    assert text.splitlines()[0] == "foldc plan: 32 query heads / 8 KV heads (4 per KV head), head_dim 128"
    table = parse_table(text)
    assert list(table) == ["", *ROWS]
    assert table[""] == ["qk", "pv"]
    for col, (name, prod) in enumerate(p.products.items()):
        cell = {row: table[row][col] for row in ROWS}
        assert squash(cell["fold"]).startswith(squash(f"{prod.fold}: {prod.reason}"))
        assert squash(cell["scale goes to"]) == squash(str(prod.scale_site))
        assert squash(cell["correction term"]) == squash(str(prod.correction))
        assert squash(cell["must land before"]) == squash(str(prod.lands_before))
        assert squash(cell["break-even"]) == squash(prod.break_even)
        assert squash(cell["cost (eq. 12)"]).startswith(squash("fold 2*h/g = 2*4/128 = 0.0625"))
        assert cell["code bias (eq. 7)"] == ("1024 folded into the zero" if name == "qk" else "none")
        # a plan without a query dtype: the decision for each (eq. 6a), split exactly for operand-folds
        want = "split" if prod.fold == "operand-fold" else "plain"
        assert squash(f"fp16: {want}") in squash(cell["operand precision (eq. 6a)"])
        assert squash(f"bf16: {want}") in squash(cell["operand precision (eq. 6a)"])
        constraints = [str(c).split(": ", 1)[1] for c in prod.constraints]
        assert len(constraints) == 1
        assert squash(cell["tiling constraint"]) == squash(" ".join(constraints))
        issue = squash(cell["issue budget (eq. 13)"])
        for gpu, demand, pct in (("H100 SXM", "4.25", "43%"), ("H200", "4.25", "61%"), ("B200", "1.00", "21%")):
            assert squash(f"{gpu}: {demand} of") in issue and squash(f"({pct}, reconstruction") in issue
        assert issue.count("bandwidth-bound") == 3
    assert squash(table["encoded operand"][0]) == squash(
        f"%k {k}:2:128: 2-bit codes, one (scale, zero) per 128 {'channel' if k == 'token' else 'token'}s")


def test_explain_table_dequant_and_plain():
    dq = parse_table(explain_table(foldc.plan(foldc.AttentionSpec(32, 2, 128, A(2, "token", 32), None))))
    assert squash(dq["fold"][0]).startswith(squash("dequant: the fold does not pay here (see break-even)"))
    assert dq["code bias (eq. 7)"][0] == "-"
    assert dq["tiling constraint"][0] == "-"
    assert squash("group_size=32 <= 2*h=32") in squash(dq["break-even"][0])
    issue = squash(dq["issue budget (eq. 13)"][0])
    assert squash("B200: 8.00 of 4.65 lane-slots/byte (172%, reconstruction 8.00) -> issue-bound") in issue
    # the plain V column
    assert squash(dq["encoded operand"][1]) == squash("%v plain (no encoding)")
    assert dq["fold"][1] == "none: %v is a plain operand"
    for row in ("code bias (eq. 7)", "must land before", "tiling constraint", "cost (eq. 12)", "break-even",
                "issue budget (eq. 13)"):
        assert dq[row][1] == "-", row


def test_plan_summary():
    p = foldc.plan(foldc.AttentionSpec(32, 8, 128, A(2, "token", 128), A(2, "channel", 128)))
    assert str(p) == plan_summary(p)
    lines = plan_summary(p).splitlines()
    assert lines[0] == "plan for heads 32/8, head_dim 128, K token:2:128, V channel:2:128"
    assert lines[1].startswith("  qk: acc-fold     scale -> each group's partial sum (per 128 channels)")
    assert lines[2].startswith("  pv: acc-fold     scale -> each group's partial sum (per 128 tokens)")
    assert lines[3:] == ["  tiling: pv: an unscaled partial sum must not cross a multiple of 128 along token",
                         "  tiling: qk: an unscaled partial sum must not cross a multiple of 128 along channel"]


# -- seed_table ---------------------------------------------------------------------------------
def test_seed_table_rows():
    plans = [foldc.plan(foldc.AttentionSpec(32, 8, 128, A(2, k, 128), A(2, v, 128)))
             for k, v in (("token", "token"), ("channel", "channel"))]
    text = seed_table(plans)
    table = parse_table(text)
    assert list(table)[0] == SEED_TABLE_HEADER[0] and text.count("| cache layout") == 1
    assert table[SEED_TABLE_HEADER[0]] == list(SEED_TABLE_HEADER[1:])
    rows = {label: [squash(c) for c in cells] for label, cells in list(table.items())[1:]}
    assert list(rows) == ["token-wise K", "channel-wise K", "token-wise V", "channel-wise V"]
    assert rows["token-wise K"] == [squash("QK^T, sums over channels"), "acc-fold",
                                    squash("each group's partial sum (per 128 channels)")]
    assert rows["channel-wise K"] == [squash("QK^T, sums over channels"), "operand-fold",
                                      squash("the other operand: q x scale, before the product")]
    assert rows["token-wise V"] == [squash("PV, sums over tokens"), "operand-fold",
                                    squash("the other operand: p x scale, before the product")]
    assert rows["channel-wise V"] == [squash("PV, sums over tokens"), "acc-fold",
                                      squash("each group's partial sum (per 128 tokens)")]


def test_seed_table_skips_plain_operands_and_repeats():
    plans = [foldc.plan(foldc.AttentionSpec(32, 8, 128, A(2, "token", 128), None)),
             foldc.plan(foldc.AttentionSpec(32, 8, 128, A(4, "token", 64), None))]
    rows = list(parse_table(seed_table(plans)))
    assert rows == ["cache layout", "token-wise K"]
