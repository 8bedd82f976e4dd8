"""`compile(spec, target)`: a callable ``attn(q, k, v, sm_scale=None, seq_lens=None)``.

Targets:
- ``"reference"``: the float64 executor runs the plan step by step (folds, corrections, online
  softmax in token tiles). Returns float64 ``[batch, num_q_heads, head_dim]``.
- ``"sm_90"``, ``"sm_100"``: a fused kernel on a CUDA GPU of that generation (fp16 or bf16
  queries; output in the query's dtype). Plans the register-operand kernel lowers
  (foldc/backends/gluon: K and V each folded or dequantized at 2, 4 or 8 bits, or plain) run it unless
  ``kernel="triton"``, every other plan the generated Triton kernel (foldc/backends/triton). The
  register-operand kernel holds fp16 queries to plain bf16 attention's error, the Triton kernel to
  plain fp16 attention's (docs/derivation.md eq. 6a).
- ``"interpret"``: the same generated kernel under Triton's interpreter on the CPU (fp16 only).
- ``"auto"``: ``sm_90``/``sm_100`` by the GPU found, else ``interpret``.
"""
from __future__ import annotations

import torch

from .encoding import AffineTensor
from .errors import SpecError
from .executor import Executor, TorchOps
from .ir import BATCH, CHANNEL, KV_HEAD, Q_PER_KV, TOKEN
from .options import KERNELS, as_int, attention_kernel, check_kernel  # noqa: F401 - KERNELS: public name
from .passes import FOLD_POLICIES
from .plan import Plan, plan
from .reference import past_lengths_zeroed
from .registry import attention_backend, workload_of
from .spec import AttentionSpec
from .targets import GPU_TARGETS, check_gpu_target, detect_target  # noqa: F401 - public names
from .validate import check_call, check_out

TARGETS = ("reference", "auto", "sm_90", "sm_100", "interpret")
# the float64 result may be written into any floating-point out (rounded once)
REFERENCE_OUT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


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
        token_tile = as_int(token_tile)   # a NumPy or 0-dim torch integer is that int
        if isinstance(token_tile, bool) or not isinstance(token_tile, int) or token_tile < 1:
            raise SpecError(f"token_tile={token_tile!r} must be a positive integer")
        self.plan, self.spec, self.token_tile = the_plan, the_plan.spec, token_tile

    def __call__(self, q, k, v, sm_scale=None, seq_lens=None, out: torch.Tensor | None = None,
                 return_lse: bool = False):
        call = check_call(self.spec, q, k, v, sm_scale, seq_lens, out=out)
        want = (call.batch, self.spec.num_q_heads, self.spec.head_dim)
        out = check_out(out, want, q.device, REFERENCE_OUT_DTYPES)
        sizes = {BATCH: call.batch, KV_HEAD: self.spec.num_kv_heads, Q_PER_KV: self.spec.q_per_kv,
                 CHANNEL: self.spec.head_dim, TOKEN: call.tokens}
        tokens = call.tokens if call.seq_lens is None else int(call.seq_lens.max())
        if call.seq_lens is not None:   # (the executor's weights past a length are 0, and 0 x NaN is NaN)
            k, v = past_lengths_zeroed(k, call.seq_lens), past_lengths_zeroed(v, call.seq_lens)
        env = Executor(self.plan.graph, TorchOps(q.device), bind_inputs(self.spec, q, k, v), sizes, tokens,
                       call.sm_scale, self.token_tile, valid_tokens=call.seq_lens).run()
        result = env[self.plan.graph.output].data.reshape(call.batch, self.spec.num_q_heads, self.spec.head_dim)
        lse = (env["__max__"].data + torch.log(env["__denominator__"].data)).reshape(call.batch, self.spec.num_q_heads)
        if out is not None:
            out.copy_(result)
            result = out
        return (result, lse) if return_lse else result


def compile(spec: AttentionSpec, target: str = "reference", **options):  # noqa: A001 - public API name
    """Plan ``spec`` and return an attention callable for ``target``.

    Options for "reference": ``token_tile`` (tokens per online-softmax step, default 64).
    Options for the GPU and interpreter targets: ``kernel`` ("auto", "triton" or "gluon": which
    backend lowers the plan; "auto" takes the register-operand kernel on sm_90 and sm_100 when it
    lowers the plan), ``block_n`` (tokens per tile), ``splits`` (split-KV count; default: enough programs to
    fill the GPU). Triton kernel only: ``num_warps``, ``num_stages``, ``fold_policy`` ("auto", or
    "dequant" to force per-value reconstruction), ``split_prescaled`` (feed operand-fold pre-scaled
    operands as hi + lo; default on for bf16 queries). Register-operand kernel only: ``stages``
    (code tiles in flight), ``maxnreg`` (register cap per thread), ``split_factor`` (waves of
    resident programs the splits fill; default one), ``pack_heads`` (KV heads whose
    query rows share one program's MMA rows; default: as many as fill them), ``scale_ahead``
    (token-wise scales loaded a tile early into registers; default: at each tile's start),
    ``dynamic_tiles`` (the programs of a sequence and head draw tiles from a shared counter: 0-3.5%
    faster at INT2 on the H200, outputs no longer bitwise repeatable; default False).
    """
    workload = workload_of(spec)
    if workload is not None:   # e.g. y = x @ w.T with encoded operands (foldc/gemm/compile.py)
        return workload.compile(spec, target, **options)
    if not isinstance(spec, AttentionSpec):
        raise SpecError(f"spec must be a foldc.AttentionSpec or foldc.GemmSpec, got {type(spec).__name__}")
    if target == "reference":
        unknown = sorted(set(options) - {"token_tile"})
        if unknown:
            raise SpecError(f"unknown option(s) {unknown} for target='reference'; the only option is token_tile")
        return ReferenceAttention(plan(spec), **options)
    if target not in TARGETS:
        raise SpecError(f"target={target!r} is not available; use one of {TARGETS}")
    triton_only = {"num_warps", "num_stages", "fold_policy", "split_prescaled"}
    gluon_only = {"stages", "maxnreg", "split_factor", "pack_heads", "scale_ahead", "dynamic_tiles"}
    unknown = sorted(set(options) - {"kernel", "block_n", "splits"} - triton_only - gluon_only)
    if unknown:
        raise SpecError(f"unknown option(s) {unknown} for target={target!r}; options are kernel, block_n, splits, "
                        "num_warps, num_stages, fold_policy, split_prescaled, stages, maxnreg, split_factor, "
                        "pack_heads, scale_ahead, dynamic_tiles")
    kernel = check_kernel(options.pop("kernel", "auto"))
    if "fold_policy" in options and options["fold_policy"] not in FOLD_POLICIES:
        raise SpecError(f"fold_policy={options['fold_policy']!r} must be one of {FOLD_POLICIES}")
    if options.get("split_prescaled") is not None and not isinstance(options["split_prescaled"], bool):
        raise SpecError(f"split_prescaled={options['split_prescaled']!r} must be True, False or None (the plan's "
                        "default)")
    if target == "auto":
        target = detect_target()
    check_gpu_target(target)
    if attention_kernel(spec, target, kernel, options) == "gluon":
        wrong = sorted(set(options) & triton_only)
        if wrong:
            raise SpecError(f"option(s) {wrong} belong to the Triton kernel; drop them or pass kernel='triton'")
        return attention_backend("gluon").kernel(spec, target, **options)   # bf16 and fp16 queries
    wrong = sorted(set(options) & gluon_only)
    if wrong:
        raise SpecError(f"option(s) {wrong} belong to the register-operand kernel (sm_90, kernel='gluon'); "
                        "drop them for this target")
    return _triton(spec, target, options)


def _triton(spec, target: str, options: dict):
    return attention_backend("triton").kernel(spec, target, **options)
