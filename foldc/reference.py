"""Float64 attention over dequantized values: the ground truth every plan and kernel is held to."""
from __future__ import annotations

import math

import torch

from .encoding import AffineTensor
from .errors import InputError, InputTypeError
from .spec import AttentionSpec
from .validate import check_call


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
    call = check_call(spec_of(q, k, v), q, k, v, sm_scale, seq_lens)   # as every compiled target checks them
    kf, vf = dequantized(k), dequantized(v)
    b, hq, d = q.shape
    hkv, n = kf.shape[1], kf.shape[2]
    qf = q.to(torch.float64).reshape(b, hkv, hq // hkv, d)
    if call.seq_lens is not None:   # (a NaN or Inf past a length gave NaN: weight 0 times NaN)
        kf, vf = past_lengths_zeroed(kf, call.seq_lens), past_lengths_zeroed(vf, call.seq_lens)
    logits = torch.einsum("bkhd,bknd->bkhn", qf, kf) * call.sm_scale
    if call.seq_lens is not None:
        lens = call.seq_lens.reshape(b, 1, 1, 1)
        logits = logits.masked_fill(torch.arange(n, device=logits.device) >= lens, -math.inf)
    p = torch.softmax(logits, dim=-1)
    return torch.einsum("bkhn,bknd->bkhd", p, vf).reshape(b, hq, d)


def past_lengths_zeroed(x, seq_lens: torch.Tensor):
    """``x`` (an AffineTensor or a plain cache ``[batch, kv_heads, tokens, head_dim]``) with what belongs only to
    tokens at or past ``seq_lens[b]`` set to 0 (new tensors; codes kept): plain values, a token-wise scale and zero
    row per token, a channel-wise group's pair where the group starts at or past the length (a group that a length
    cuts holds valid tokens too). Attention gives such tokens a weight of 0, and 0 times a NaN or Inf (storage
    allocated by torch.empty) is NaN: the kernels never read them, so neither may the float64 references."""
    lens = seq_lens.to(torch.int64).reshape(-1, 1)
    if not isinstance(x, AffineTensor):
        past = torch.arange(x.shape[2], device=x.device) >= lens   # [batch, tokens]
        return x.masked_fill(past[:, None, :, None], 0)
    step = x.encoding.group_size if x.encoding.layout == "channel" else 1   # tokens a scale row covers
    past = torch.arange(x.scale.shape[2], device=x.device) * step >= lens   # [batch, scale rows]
    return AffineTensor(x.codes, x.scale.masked_fill(past[:, None, :, None], 0),
                        x.zero.masked_fill(past[:, None, :, None], 0), x.encoding, x.head_dim)


def spec_of(q, k, v) -> AttentionSpec:
    """The AttentionSpec an attention call over ``q``, ``k`` and ``v`` implies (heads, head_dim, each side's
    encoding or None): what `attention_reference` validates its arguments against."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise InputTypeError(f"q must be a torch.Tensor [batch, num_q_heads, head_dim], got {got}")
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, (torch.Tensor, AffineTensor)) or len(x.shape) != 4:
            got = tuple(x.shape) if isinstance(x, (torch.Tensor, AffineTensor)) else type(x).__name__
            raise InputTypeError(f"{name} must be a torch.Tensor or AffineTensor [batch, num_kv_heads, tokens, "
                                 f"head_dim], got {got}")
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads < 1 or heads % kv_heads:
        raise InputError(f"q has {heads} heads and k {kv_heads}: the query heads must be a multiple of the KV heads")
    encoding = lambda x: x.encoding if isinstance(x, AffineTensor) else None  # noqa: E731
    return AttentionSpec(heads, kv_heads, q.shape[2], k=encoding(k), v=encoding(v))
