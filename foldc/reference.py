"""Float64 attention over dequantized values: the ground truth every plan and kernel is held to."""
from __future__ import annotations

import math

import torch

from .encoding import AffineTensor
from .validate import check_sm_scale


def dequantized(x) -> torch.Tensor:
    """float64 values of a cache operand (AffineTensor or plain tensor)."""
    if isinstance(x, AffineTensor):
        return x.dequantize(torch.float64)
    return x.to(torch.float64)


def attention_reference(q: torch.Tensor, k, v, sm_scale: float | None = None,
                        seq_lens: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(sm_scale * q k^T) v in float64, GQA by head grouping, keys past seq_lens[b] ignored.

    q: [batch, num_q_heads, head_dim]; k, v: [batch, num_kv_heads, tokens, head_dim] (AffineTensor
    or plain). Returns float64 [batch, num_q_heads, head_dim].
    """
    kf, vf = dequantized(k), dequantized(v)
    b, hq, d = q.shape
    hkv, n = kf.shape[1], kf.shape[2]
    scale = check_sm_scale(sm_scale, d)
    qf = q.to(torch.float64).reshape(b, hkv, hq // hkv, d)
    logits = torch.einsum("bkhd,bknd->bkhn", qf, kf) * scale
    if seq_lens is not None:
        lens = torch.as_tensor(seq_lens, device=logits.device).reshape(b, 1, 1, 1)
        logits = logits.masked_fill(torch.arange(n, device=logits.device) >= lens, -math.inf)
    p = torch.softmax(logits, dim=-1)
    return torch.einsum("bkhn,bknd->bkhd", p, vf).reshape(b, hq, d)
