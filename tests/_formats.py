"""Packers of other tools' weight formats, written from the formats' definitions (not from foldc's unpacking):
the converters' tests (tests/gemm/test_gemm_convert.py) and the checkpoint loader's (tests/integrations) build the
tensors the tools write with them."""
from __future__ import annotations

import torch


def int32_words(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the int32 tensor with the same bits (two's complement)."""
    return (((words + 2**31) % 2**32) - 2**31).to(torch.int32)


def pack_along(codes: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """32/bits codes per int32 word along ``dim``, field j (low bits first) holding the code at
    position ``order[j]`` of each run (consecutive positions without an order)."""
    per = 32 // bits
    order = order or tuple(range(per))
    c = codes.to(torch.int64).movedim(dim, -1)
    runs = c.reshape(*c.shape[:-1], c.shape[-1] // per, per)
    words = sum(runs[..., order[j]] << (bits * j) for j in range(per))
    return int32_words(words).movedim(-1, dim)


def asymmetric_codes(w: torch.Tensor, bits: int, group: int):
    """Min-max asymmetric quantization of w [n, k] in groups of k, integer zeros, fp16 scales (GPTQ's
    and AWQ's quantizer): (codes [n, k], scales [n, groups] fp16, zeros [n, groups] int)."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / (2**bits - 1)).clamp(min=1e-5).half()
    zero = torch.round(-lo / scale.float()).clamp(0, 2**bits - 1).to(torch.int64)
    codes = torch.clamp(torch.round(g / scale.float()[..., None]) + zero[..., None], 0, 2**bits - 1)
    return codes.reshape(n, k).to(torch.int64), scale, zero
