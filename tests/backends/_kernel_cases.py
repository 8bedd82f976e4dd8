"""Helpers shared by the Triton backend tests (not a test module)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy
import pytest
import torch

from foldc.reference import attention_reference
from foldc.testing import bf16_attention, random_inputs, rel_l2

#: triton 3.6's interpreter breaks with numpy >= 2.4 ("only 0-dimensional arrays can be converted
#: to Python scalars" whenever a runtime int bounds a range()); pyproject pins numpy<2.4, but the
#: GPU machine's own python may carry a newer one
NUMPY_OK = tuple(int(p) for p in numpy.__version__.split(".")[:2]) < (2, 4)
needs_interpreter = pytest.mark.skipif(
    not NUMPY_OK, reason=f"triton 3.6's interpreter needs numpy < 2.4; this python has {numpy.__version__}")


@dataclass
class LensResult:
    error: float          # relative L2 vs float64 attention over the dequantized cache
    bf16_error: float     # the same for plain bf16 attention over those values
    unwritten: int        # output elements still NaN after the call
    out: torch.Tensor
    ref: torch.Tensor


def run_with_lens(attn, spec, lens, tokens: int, dtype: torch.dtype, device, seed: int) -> LensResult:
    """Like foldc.testing.run_case, but with the given per-sequence lengths: fresh random inputs
    and a NaN-poisoned ``out=``."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, _ = random_inputs(spec, len(lens), tokens, dtype, device, gen)
    seq_lens = torch.tensor(lens, device=device)
    sm_scale = 1.0 / math.sqrt(spec.head_dim) * float(0.5 + torch.rand((), generator=gen))
    out = torch.full((len(lens), spec.num_q_heads, spec.head_dim), float("nan"), device=device, dtype=dtype)
    got = attn(q, k, v, sm_scale=sm_scale, seq_lens=seq_lens, out=out)
    assert got is out, "the callable must write into (and return) the out= tensor it was given"
    ref = attention_reference(q, k, v, sm_scale=sm_scale, seq_lens=seq_lens)
    base = bf16_attention(q, k, v, sm_scale, seq_lens)
    return LensResult(rel_l2(got, ref), rel_l2(base, ref), int(torch.isnan(out).sum().item()), got, ref)
