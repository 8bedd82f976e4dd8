"""The K/V layout grid as data (foldc/layout_grid.py): the full product, the timed subset's coverage of every axis,
the quick grid, ``--only``'s selection and the layouts' labels."""
from __future__ import annotations

import torch

import foldc
from foldc import bench_layouts as bl
from foldc import layout_grid as lg

A = foldc.Affine


def test_full_grid_is_the_product_of_both_sides_plus_plain_sides_and_extras():
    grid = lg.full_grid()
    sides = lg.side_encodings()
    assert len(sides) == 2 * 3 * 3 == 18
    extras = len(lg.SCALE_DTYPE_EXTRAS) + len(lg.GQA_EXTRAS) + len(lg.HEAD_DIM_EXTRAS) + len(lg.FEATURE_EXTRAS)
    assert len(grid) == 18 * 18 + 2 * 18 + extras == 396
    assert len({lay.label for lay in grid}) == len(grid)            # no duplicates
    base = [lay for lay in grid if (lay.q_heads, lay.kv_heads, lay.head_dim) == (32, 8, 128)]
    pairs = {(lg.side_text(lay.k), lg.side_text(lay.v)) for lay in base}
    assert {(k, v) for k in sides for v in sides} <= pairs            # mixed widths and groups included
    assert {(k, "plain") for k in sides} | {("plain", v) for v in sides} <= pairs
    assert lg.axes(grid)["gqa ratio"] == {1, 4, 5, 7, 8, 16, 17, 32}
    assert lg.axes(grid)["head_dim"] == {64, 96, 128, 256}
    assert lg.axes(grid)["scale dtype"] == {"fp16", "bf16", "fp32"}
    assert {(lay.q_heads, lay.kv_heads) for lay in grid} == set(lg.GQA_HEADS.values())
    assert max(lay.q_heads for lay in grid) == 64


def test_timed_subset_covers_every_axis_of_the_grid():
    timed = lg.grid("timed")
    assert len(timed) >= 24
    assert set(timed) <= set(lg.full_grid())
    assert lg.uncovered(timed) == {}
    seen = lg.axes(timed)
    # spelled out, so that a shrinking subset (or a shrinking TIMED_MUST_COVER) fails here
    assert seen["k bits"] == seen["v bits"] == {2, 4, 8}
    assert seen["k layout"] == seen["v layout"] == {"token", "channel", "plain"}
    assert seen["group size"] >= {16, 32, 64, 128}
    assert True in seen["mixed bits"]
    assert {"bf16", "fp32"} <= seen["scale dtype"]
    assert {1, 5, 7, 16, 17, 32} <= seen["gqa ratio"]
    assert {64, 96, 256} <= seen["head_dim"]
    for lay in timed:
        lay.spec()   # none of the timed layouts is one foldc refuses
    assert bl.CHECK_SHAPES["timed"][1] >= 16384   # where `foldc bench --layouts` checks and times it
    assert all(b * n >= 512 * 1024 for b, n in bl.TIME_SHAPES)


def test_uncovered_names_what_a_subset_lacks():
    timed = lg.grid("timed")
    no_plain_k = [lay for lay in timed if lay.k is not None]
    assert lg.uncovered(no_plain_k) == {"k layout": {"plain"}}
    only_base = [lay for lay in timed if lay.gqa == 4 and lay.head_dim == 128]
    assert lg.uncovered(only_base) == {"gqa ratio": {1, 5, 7, 8, 16, 17, 32}, "head_dim": {64, 256}}


def test_quick_grid_and_only_filter():
    quick = lg.grid("quick")
    assert len(quick) == 6 and set(quick) <= set(lg.full_grid())
    label = "K token:2:128 V token:2:128 32/8 d128"
    assert [lay.label for lay in lg.pick(quick, [label])] == [label]     # an exact label alone
    assert len(lg.pick(quick, ["V token:2:128"])) == 2                  # else every label containing it
    assert lg.pick(quick, None) == quick


def test_layout_labels_and_heads():
    lay = lg.layout("channel:4:64:fp32", "plain", 64, 2, 256)
    assert lay.label == "K channel:4:64:fp32 V plain 64/2 d256" and lay.gqa == 32
    assert lay.k == A(4, "channel", 64, torch.float32) and lay.v is None
    assert lay.spec().describe() == "heads 64/2, head_dim 256, K channel:4:64:fp32, V plain"
