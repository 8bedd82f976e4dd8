"""Shared helpers for kernel checks (CPU interpreter tests, GPU tests, benchmarks/gpu_check.py).

A case draws fresh random inputs (never zeros: keys get outlier channels, values an offset so
zeros are not special), quantizes them, runs a compiled kernel into a NaN-poisoned output and
compares it with float64 attention over the same dequantized cache; it also reports the error
of plain bf16 attention over those dequantized values, the bar a kernel must not exceed, and the
error of plain attention in the query's dtype (`plain_attention`), which the operand precision
model (docs/derivation.md, eq. 6a) bounds every kernel by: at most 2x.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .encoding import quantize
from .reference import attention_reference, dequantized
from .spec import AttentionSpec


@dataclass(frozen=True)
class CaseResult:
    spec: AttentionSpec
    dtype: torch.dtype
    batch: int
    tokens: int
    error: float            # relative L2 of the kernel vs float64 over the dequantized cache
    bf16_error: float       # relative L2 of bf16 attention over the same dequantized values
    unwritten: int          # output elements still NaN after the call
    plain_error: float = float("nan")   # relative L2 of plain attention in the query's dtype (eq. 6a)
    plain_bf16_error: float = float("nan")   # relative L2 of plain attention in bf16 (eq. 6a's bf16 bar)

    @property
    def ratio(self) -> float:
        return self.error / self.bf16_error

    @property
    def plain_ratio(self) -> float:
        """error over plain attention's in the query's dtype: the eq. 6a model bounds it by 2."""
        return self.error / self.plain_error


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def random_inputs(spec: AttentionSpec, batch: int, tokens: int, dtype: torch.dtype, device, gen: torch.Generator):
    q = torch.randn(batch, spec.num_q_heads, spec.head_dim, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(batch, spec.num_kv_heads, tokens, spec.head_dim, generator=gen)
    v = torch.randn(batch, spec.num_kv_heads, tokens, spec.head_dim, generator=gen) + 0.5
    outliers = torch.randint(0, spec.head_dim, (3,), generator=gen)
    k[..., outliers] *= 6.0  # outlier channels, as real keys have
    kq = quantize(k.to(device), spec.k) if spec.k is not None else k.to(device=device, dtype=dtype)
    vq = quantize(v.to(device), spec.v) if spec.v is not None else v.to(device=device, dtype=dtype)
    lens = torch.randint(max(1, tokens // 2), tokens + 1, (batch,), generator=gen)
    lens[0] = tokens
    return q, kq, vq, lens.to(device)


def bf16_attention(q, k, v, sm_scale, seq_lens) -> torch.Tensor:
    """Plain bf16 attention over the dequantized values (fp32 softmax), as serving engines run it."""
    kf, vf = dequantized(k).to(torch.bfloat16), dequantized(v).to(torch.bfloat16)
    b, hq, d = q.shape
    hkv, n = kf.shape[1], kf.shape[2]
    qf = q.to(torch.bfloat16).reshape(b, hkv, hq // hkv, d)
    logits = torch.einsum("bkhd,bknd->bkhn", qf, kf).float() * sm_scale
    mask = torch.arange(n, device=q.device)[None, :] >= seq_lens[:, None]
    logits = logits.masked_fill(mask[:, None, None, :], -math.inf)
    p = torch.softmax(logits, dim=-1).to(torch.bfloat16)
    return torch.einsum("bkhn,bknd->bkhd", p, vf).float().reshape(b, hq, d)


def plain_attention(q, k, v, sm_scale, seq_lens, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain attention in ``dtype`` (default q's) over the dequantized values, as an fp16/bf16
    FlashAttention kernel runs it: q, K and V rounded to ``dtype``; logits, max, exp and the
    denominator in fp32; the unnormalised weights P = exp(t - max) rounded to ``dtype`` before the
    PV product, accumulated in fp32; divided by the fp32 denominator; the output rounded to
    ``dtype``. One tile over all tokens (the running max of eq. 9 changes no rounding to first
    order). The reference of the operand precision model (docs/derivation.md, eq. 6a)."""
    dt = q.dtype if dtype is None else dtype
    kf, vf = dequantized(k).to(dt).float(), dequantized(v).to(dt).float()
    b, hq, d = q.shape
    hkv, n = kf.shape[1], kf.shape[2]
    qf = q.to(dt).float().reshape(b, hkv, hq // hkv, d)
    logits = torch.einsum("bkhd,bknd->bkhn", qf, kf) * sm_scale
    mask = torch.arange(n, device=q.device)[None, :] >= seq_lens[:, None]
    logits = logits.masked_fill(mask[:, None, None, :], -math.inf)
    p = torch.exp(logits - logits.amax(-1, keepdim=True))
    out = torch.einsum("bkhn,bknd->bkhd", p.to(dt).float(), vf) / p.sum(-1, keepdim=True)
    return out.to(dt).reshape(b, hq, d)


def run_case(attn, spec: AttentionSpec, batch: int, tokens: int, dtype: torch.dtype, device, seed: int) -> CaseResult:
    gen = torch.Generator().manual_seed(seed)
    q, k, v, lens = random_inputs(spec, batch, tokens, dtype, device, gen)
    sm_scale = 1.0 / math.sqrt(spec.head_dim) * float(0.5 + torch.rand((), generator=gen))
    out = torch.full((batch, spec.num_q_heads, spec.head_dim), float("nan"), device=device, dtype=dtype)
    got = attn(q, k, v, sm_scale=sm_scale, seq_lens=lens, out=out)
    ref = attention_reference(q, k, v, sm_scale=sm_scale, seq_lens=lens)
    base = bf16_attention(q, k, v, sm_scale, lens)
    plain = rel_l2(plain_attention(q, k, v, sm_scale, lens), ref)
    plain_bf16 = plain if dtype == torch.bfloat16 else rel_l2(plain_attention(q, k, v, sm_scale, lens, torch.bfloat16),
                                                               ref)
    return CaseResult(spec, dtype, batch, tokens, rel_l2(got, ref), rel_l2(base, ref),
                      int(torch.isnan(out).sum().item()), plain, plain_bf16)
