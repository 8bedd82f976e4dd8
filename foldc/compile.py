"""`compile(spec, target)`: a callable ``attn(q, k, v, sm_scale=None, seq_lens=None)``.

Targets:
- ``"reference"``: the float64 executor runs the plan step by step (folds, corrections, online
  softmax in token tiles). Returns float64 ``[batch, num_q_heads, head_dim]``.
"""
from __future__ import annotations

import torch

from .encoding import AffineTensor
from .errors import SpecError
from .executor import Executor, TorchOps
from .ir import BATCH, CHANNEL, KV_HEAD, Q_PER_KV, TOKEN
from .plan import Plan, plan
from .spec import AttentionSpec
from .validate import check_call

TARGETS = ("reference",)


def bind_inputs(spec: AttentionSpec, q: torch.Tensor, k, v) -> dict:
    """Float64 arrays for the executor, keyed by (input name, part), in canonical axis order."""
    b = q.shape[0]
    bindings = {("q", "values"): q.to(torch.float64).reshape(b, spec.num_kv_heads, spec.q_per_kv, spec.head_dim)}
    for name, x in (("k", k), ("v", v)):
        if isinstance(x, AffineTensor):
            bindings[(name, "codes")] = x.unpack().to(torch.float64)
            bindings[(name, "scale")] = x.scale.to(torch.float64)
            bindings[(name, "zero")] = x.zero.to(torch.float64)
        else:
            bindings[(name, "values")] = x.to(torch.float64)
    return bindings


class ReferenceAttention:
    """The float64 plan executor as an attention callable."""

    def __init__(self, the_plan: Plan, token_tile: int = 64):
        if isinstance(token_tile, bool) or not isinstance(token_tile, int) or token_tile < 1:
            raise SpecError(f"token_tile={token_tile!r} must be a positive integer")
        self.plan, self.spec, self.token_tile = the_plan, the_plan.spec, token_tile

    def __call__(self, q, k, v, sm_scale=None, seq_lens=None) -> torch.Tensor:
        call = check_call(self.spec, q, k, v, sm_scale, seq_lens)
        sizes = {BATCH: call.batch, KV_HEAD: self.spec.num_kv_heads, Q_PER_KV: self.spec.q_per_kv,
                 CHANNEL: self.spec.head_dim, TOKEN: call.tokens}
        tokens = call.tokens if call.seq_lens is None else int(call.seq_lens.max())
        env = Executor(self.plan.graph, TorchOps(q.device), bind_inputs(self.spec, q, k, v), sizes, tokens,
                       call.sm_scale, self.token_tile, valid_tokens=call.seq_lens).run()
        out = env[self.plan.graph.output].data
        return out.reshape(call.batch, self.spec.num_q_heads, self.spec.head_dim)


def compile(spec: AttentionSpec, target: str = "reference", **options):  # noqa: A001 - public API name
    """Plan ``spec`` and return an attention callable for ``target``.

    Options for "reference": ``token_tile`` (tokens per online-softmax step, default 64).
    """
    if not isinstance(spec, AttentionSpec):
        raise SpecError(f"spec must be a foldc.AttentionSpec, got {type(spec).__name__}")
    if target == "reference":
        unknown = sorted(set(options) - {"token_tile"})
        if unknown:
            raise SpecError(f"unknown option(s) {unknown} for target='reference'; the only option is token_tile")
        return ReferenceAttention(plan(spec), **options)
    raise SpecError(f"target={target!r} is not available; use one of {TARGETS}")
