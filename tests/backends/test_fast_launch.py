"""FastLaunch off the GPU: under the interpreter it passes every launch to the kernel unchanged and
keeps nothing (its GPU path is tested in test_gluon_gpu.py)."""
from __future__ import annotations

import torch

from foldc.backends.triton.fast_launch import FastLaunch
from foldc.backends.triton.launch import MERGE_SOURCE, _interpret, launch_merge, load_module


def test_interpreted_kernels_pass_through_and_nothing_is_kept():
    merge = load_module("import triton\nimport triton.language as tl\n" + MERGE_SOURCE, interpret=True).foldc_merge
    gen = torch.Generator().manual_seed(5)
    batch, heads, splits, rows, dim = 2, 2, 5, 8, 32
    ws_m = torch.randn(batch, heads, splits, rows, generator=gen)
    ws_l = torch.rand(batch, heads, splits, rows, generator=gen) + 0.5
    ws_acc = torch.randn(batch, heads, splits, rows, dim, generator=gen)
    outs = []
    for kernel in (merge, FastLaunch(merge)):
        out = torch.full((batch, heads * 4, dim), float("nan"), dtype=torch.float16)
        lse = torch.full((batch, heads * 4), float("nan"))
        with _interpret(True):
            launch_merge(kernel, ws_m, ws_l, ws_acc, out, lse, 4)
        outs.append((out, lse))
        if isinstance(kernel, FastLaunch):
            assert kernel.compiled == {}
    assert not torch.isnan(outs[0][0]).any()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
