"""The two-part merge kernel (foldc/serving/part_merge.py) against foldc.merge.merge_parts, under Triton's
interpreter on fresh random parts: the same result within float32 rounding, empty parts (lse -inf, output NaN)
adding nothing, both empty giving zeros and -inf, and NaN in either lse giving a NaN row."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from foldc.merge import merge_parts
from foldc.serving.part_merge import merge_two_parts


def _part(gen, b, h, d, scale):
    return (torch.randn(b, h, d, generator=gen) * scale,
            (torch.randn(b, h, generator=gen) * 4).float())


@settings(max_examples=20, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 6), d=st.sampled_from([16, 64, 96, 128]),
       out_dtype=st.sampled_from([torch.float16, torch.float32]), seed=st.integers(0, 2**31 - 1))
def test_two_parts_merge_as_merge_parts_does(b, h, d, out_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    p0, p1 = _part(gen, b, h, d, 1.0), _part(gen, b, h, d, 3.0)
    out, lse = merge_two_parts(p0, p1, out_dtype)
    want, want_lse = merge_parts([p0, p1])
    assert out.dtype == out_dtype and lse.dtype == torch.float32
    assert torch.allclose(lse, want_lse, rtol=1e-6, atol=1e-6)
    tol = 1e-3 if out_dtype == torch.float16 else 1e-6
    assert torch.allclose(out.float(), want.float(), rtol=tol, atol=tol * float(want.abs().max()))


def test_empty_and_nan_parts():
    gen = torch.Generator().manual_seed(4)
    (o0, l0), (o1, l1) = _part(gen, 2, 3, 32, 1.0), _part(gen, 2, 3, 32, 1.0)
    l0[0, 0] = -math.inf          # row (0, 0): part 0 empty, its output NaN: the row is part 1's
    o0[0, 0] = float("nan")
    l0[1, 1] = l1[1, 1] = -math.inf   # row (1, 1): both empty
    l1[0, 2] = float("nan")       # row (0, 2): NaN
    out, lse = merge_two_parts((o0, l0), (o1, l1), torch.float32)
    assert torch.allclose(out[0, 0], o1[0, 0]) and float(lse[0, 0]) == pytest.approx(float(l1[0, 0]))
    assert torch.equal(out[1, 1], torch.zeros(32)) and float(lse[1, 1]) == -math.inf
    assert bool(out[0, 2].isnan().all()) and math.isnan(float(lse[0, 2]))
    want, _ = merge_parts([(o0, l0), (o1, l1)])
    ok = ~torch.zeros(2, 3, dtype=torch.bool)
    ok[0, 2] = False
    assert torch.allclose(out[ok], want[ok], atol=1e-6)


def test_merge_two_takes_its_batch_offset_in_int64():
    """out [batch, heads, head_dim] views may pass 2**31 elements: batch x stride is 64-bit."""
    import inspect

    from foldc.serving import part_merge
    assert "b = (pid // heads).to(tl.int64)" in inspect.getsource(part_merge._merge_two_kernel)


def test_a_part_whose_weight_underflows_keeps_the_nan_of_its_output():
    """As merge_parts: a part 200 below the other (its weight 0 in float32) with NaN in its output gives a NaN row;
    a zero weight was taken for an empty part and the NaN dropped."""
    gen = torch.Generator().manual_seed(9)
    (o0, l0), (o1, _) = _part(gen, 2, 3, 32, 1.0), _part(gen, 2, 3, 32, 1.0)
    l1 = l0 - 200
    o1[0, 1, 7] = float("nan")
    out, lse = merge_two_parts((o0, l0), (o1, l1), torch.float32)
    assert bool(out[0, 1].isnan().any())
    keep = torch.ones(2, 3, dtype=torch.bool)
    keep[0, 1] = False
    assert torch.allclose(out[keep], o0[keep], atol=1e-6) and torch.allclose(lse, l0)
    want, _ = merge_parts([(o0, l0), (o1, l1)])
    assert torch.equal(want.isnan(), out.isnan())
