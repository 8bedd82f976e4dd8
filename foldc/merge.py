"""Merge attention computed over disjoint parts of one sequence's keys (docs/derivation.md,
equation 14): each part gives its output o_i (already divided by its own denominator) and the
log-sum-exp lse_i of its scaled logits; the whole is sum_i w_i o_i with w_i = exp(lse_i - lse)
and lse = log sum_i exp(lse_i). Used to combine a quantized cache body with bf16 sink and
recent-token windows."""
from __future__ import annotations

import torch

from .errors import InputError


def merge_attention(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``[(out_i [batch, heads, head_dim], lse_i [batch, heads]), ...]`` into (out, lse).

    A part with lse = -inf (no keys) contributes nothing. Computed in float32 (float64 when a
    part is float64); the output takes the first part's dtype.
    """
    if not parts:
        raise InputError("merge_attention needs at least one (out, lse) part")
    shape, lse_shape = parts[0][0].shape, parts[0][1].shape
    for i, (o, s) in enumerate(parts):
        if o.shape != shape or s.shape != lse_shape or tuple(s.shape) != tuple(o.shape[:2]):
            raise InputError(f"part {i}: out {tuple(o.shape)} / lse {tuple(s.shape)} do not match part 0's "
                             f"{tuple(shape)} / {tuple(lse_shape)} (lse must be out.shape[:2])")
    work = torch.float64 if any(o.dtype == torch.float64 or s.dtype == torch.float64 for o, s in parts) \
        else torch.float32
    lses = torch.stack([s.to(work) for _, s in parts])           # [parts, batch, heads]
    total = torch.logsumexp(lses, dim=0)                          # [batch, heads]
    safe = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
    weights = torch.exp(lses - safe)                              # 0 for empty parts
    # where, not a product: an empty part's output may be 0/0 = NaN, and 0 * NaN is NaN
    out = sum(torch.where(w[..., None] > 0, w[..., None] * o.to(work), 0.0) for w, (o, _) in zip(weights, parts))
    return out.to(parts[0][0].dtype), total
