"""Merge attention computed over disjoint parts of one sequence's keys (docs/derivation.md,
equation 14): each part gives its output o_i (already divided by its own denominator) and the
log-sum-exp lse_i of its scaled logits; the whole is sum_i w_i o_i with w_i = exp(lse_i - lse)
and lse = log sum_i exp(lse_i). Used to combine a quantized cache body with bf16 sink and
recent-token windows.

NaN is never turned into a number here: a part whose lse is NaN (NaN keys or queries reached its
kernel) makes the merged output and lse NaN, as one attention over all the keys would be. An empty
part (lse = -inf, output 0/0) contributes nothing."""
from __future__ import annotations

import torch

from .errors import InputError
from .validate import check_merge_parts


def merge_attention(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``[(out_i [batch, heads, head_dim], lse_i [batch, heads]), ...]`` into (out, lse).

    A part with lse = -inf (no keys) contributes nothing. Computed in float32 (float64 when a
    part is float64); the output takes the first part's dtype.

    Raises `foldc.InputError` when a part's lse is NaN or +inf where its output is finite: such a
    pair did not come from one attention call (its lse is not the log-sum-exp of the logits that
    gave the output). Outside a CUDA-graph capture that check reads the values (one device sync);
    inside one it cannot, and such a part makes the result NaN instead. Parts on the meta device merge to
    meta tensors of the result's shapes and dtypes, unchecked.
    """
    check_merge_parts(parts)
    o0 = parts[0][0]
    # meta tensors (a shape-only run, as attention runs on them) hold no values to check: every part is on o0's device
    if not (o0.is_meta or (o0.is_cuda and torch.cuda.is_current_stream_capturing())):
        for i, (o, s) in enumerate(parts):
            bad = (torch.isnan(s) | (s == float("inf"))) & torch.isfinite(o).all(-1)
            if bool(bad.any()):
                where = bad.nonzero()[0].tolist()
                raise InputError(f"part {i}: lse={float(s[tuple(where)])} at [batch, head] {where} but its output "
                                 "there is finite; pass the (out, lse) pair one attention call returned "
                                 "(return_lse=True), lse = log-sum-exp of the scaled logits, -inf for no keys")
    return merge_parts(parts)


def merge_parts(parts) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge of eq. 14 without checks or host reads (capturable): callers inside foldc that
    built the parts themselves. NaN in any part's lse or output propagates to the result."""
    work = torch.float64 if any(o.dtype == torch.float64 or s.dtype == torch.float64 for o, s in parts) \
        else torch.float32
    lses = torch.stack([s.to(work) for _, s in parts])           # [parts, batch, heads]
    top = lses.amax(dim=0)                                        # [batch, heads]; NaN if any lse is
    # only "no keys anywhere" (-inf) is replaced: NaN and +inf stay and make the weights NaN
    empty = top == float("-inf")
    shifted = torch.exp(lses - torch.where(empty, torch.zeros_like(top), top))   # 0 for empty parts
    denominator = shifted.sum(dim=0)
    # weights exp(lse_i - m) / sum_j exp(lse_j - m) sum to 1 at any |lse|: exp(lse_i - lse) with lse rounded
    # (float32's step is 8 at 1e8, where both weights of two equal parts were 1, the output twice the right one)
    weights = shifted / torch.where(empty, torch.ones_like(denominator), denominator)
    total = torch.where(empty, top, top + torch.log(denominator))
    # an empty part's output may be 0/0 = NaN and 0 * NaN is NaN: an empty part (lse -inf) adds exactly 0; a part
    # whose weight only underflows keeps NaN in its output (one attention over all the keys would be NaN there)
    out = sum(torch.where(s[..., None] == float("-inf"), 0.0, w[..., None] * o.to(work))
              for w, s, (o, _) in zip(weights, lses, parts))
    return out.to(parts[0][0].dtype), total
