"""Load generated kernels and launch them: the attention callable of the Triton targets.

``foldc.compile(spec, target)`` with target "auto", "sm_90", "sm_100" (GPU) or "interpret"
(Triton's interpreter on the CPU) returns a `TritonAttention`. On each call it validates the
inputs, picks the plan for the query dtype (the code bias of eq. 7 depends on it), launches the
generated split-KV kernel and the merge kernel (eq. 14), and returns ``[batch, num_q_heads,
head_dim]`` in the query's dtype.
"""
from __future__ import annotations

import math
import os

import torch

from ...encoding import AffineTensor
from ...errors import InputError
from ...options import check_launch_options
from ...plan import Plan, plan
from ...precision import code_bias_allowed, key_reduction_group
from ...validate import (ATTENTION_FIX, ATTENTION_KERNEL, check_call, check_kernel_operands, output_buffer,
                         without_backward)
from ..runtime.launch import Launch, allocate_workspace, capturing, side_key, split_partition
from ..runtime.fast_launch import Bindings, FastLaunch
from ..runtime.merge import MERGE_SOURCE, launch_merge, merge_arguments, run_bound
from ..runtime.modules import interpreter
from ..runtime.modules import load_module, num_sms
from ..runtime.offsets import check_offsets, last_offset
from .codegen import MAGIC, KernelSource, generate, magic_ok
from .layout import TileGeometry, geometry, token_block

DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
def triton_plan(spec, dtype: str, fold_policy: str = "auto") -> Plan:
    """The plan the Triton backend lowers: key codes carry the OR-trick bias folded into the
    zero (eq. 7); value codes have it subtracted per value (docs/derivation.md section 7: folding it
    through the value accumulator loses accuracy on the GPU). Planned for ``dtype``, so each
    product carries its operand precision (eq. 6a), which the generated code follows."""
    key_bias = 0
    if spec.k is not None and magic_ok(spec.k.bits, dtype):
        bias = MAGIC[dtype][1]   # folded only where the error model of eq. 6a allows it (bf16: 128 yes, fp16: 1024 no)
        if code_bias_allowed(dtype, spec.k.bits, key_reduction_group(spec), bias):
            key_bias = bias
    return plan(spec, code_bias={"key": key_bias}, fold_policy=fold_policy, dtype=dtype)


def kernel_source(spec, dtype: str, block_n: int = 64, fold_policy: str = "auto", fast: bool = False,
                  split_prescaled: bool | None = None, paged: bool = False) -> tuple[KernelSource, TileGeometry, Plan]:
    """Generated source (decode + merge kernels); ``fast`` uses GPU-only inline PTX; ``paged``
    reads K/V through a page table (paging.py); ``split_prescaled`` None follows the plan's
    operand precision (eq. 6a), True/False overrides it."""
    the_plan = triton_plan(spec, dtype, fold_policy)
    geo = geometry(spec, block_n, the_plan)
    ks = generate(the_plan, geo, dtype, fast=fast, split_prescaled=split_prescaled, paged=paged)
    ks.source = ks.source + MERGE_SOURCE
    return ks, geo, the_plan


def choose_splits(batch: int, kv_heads: int, tokens: int, block_n: int, sms: int) -> tuple[int, int]:
    """(splits, tokens per split): enough programs to fill the SMs twice, whole tiles per split."""
    tiles = math.ceil(tokens / block_n)
    want = math.ceil(2 * sms / (batch * kv_heads))
    splits = max(1, min(want, tiles, 128))
    per_split = math.ceil(tiles / splits) * block_n
    return math.ceil(tokens / per_split), per_split


_DATA_PTR = torch.Tensor.data_ptr


def _pointer_addresses(names, q, k, v, lens, workspace) -> tuple:
    """The addresses of a generated decode kernel's tensor arguments, which come first in ``names`` (its
    arguments in order; codegen puts the upper-case tensor names first), for a bound launch."""
    tensors = {"SEQ_LENS": lens, "WS_M": workspace[0], "WS_L": workspace[1], "WS_ACC": workspace[2], "Q": q}
    for name, x in (("K", k), ("V", v)):
        if isinstance(x, AffineTensor):
            tensors.update({f"{name}_CODES": x.codes, f"{name}_SCALE": x.scale, f"{name}_ZERO": x.zero})
        else:
            tensors[f"{name}_VALUES"] = x
    return tuple(tensors[a].data_ptr() for a in names if a.isupper())


def runtime_arguments(q, k, v, lens, workspace, sm_scale: float, per_split: int, splits: int) -> dict:
    """Every runtime argument a generated decode kernel may take, by name (codegen picks its own)."""
    ws_m, ws_l, ws_acc = workspace
    runtime = {"SEQ_LENS": lens, "WS_M": ws_m, "WS_L": ws_l, "WS_ACC": ws_acc, "Q": q,
               "stride_qb": q.stride(0), "stride_qh": q.stride(1),
               "qk_scale": sm_scale * 1.4426950408889634, "tokens_per_split": per_split, "num_splits": splits,
               "cache_tokens": k.shape[2]}
    for name, x in (("k", k), ("v", v)):
        up = name.upper()
        if isinstance(x, AffineTensor):
            runtime.update({f"{up}_CODES": x.codes, f"{up}_SCALE": x.scale, f"{up}_ZERO": x.zero,
                            f"stride_{name}b": x.codes.stride(0), f"stride_{name}h": x.codes.stride(1),
                            f"stride_{name}n": x.codes.stride(2), f"stride_{name}sb": x.scale.stride(0),
                            f"stride_{name}sh": x.scale.stride(1), f"stride_{name}sn": x.scale.stride(2)})
        else:
            runtime.update({f"{up}_VALUES": x, f"stride_{name}b": x.stride(0), f"stride_{name}h": x.stride(1),
                            f"stride_{name}n": x.stride(2)})
    return runtime


class TritonAttention:
    """The generated kernel as an attention callable. Launch options left as None come from the
    autotuning cache for the call's shape bucket (foldc/tune.py) on a GPU, else from defaults."""

    DEFAULTS = {"block_n": 64, "num_warps": 4, "num_stages": 2}

    def __init__(self, spec, target: str, block_n: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None, splits: int | None = None, fold_policy: str = "auto",
                 split_prescaled: bool | None = None):
        self.spec, self.target, self.fold_policy = spec, target, fold_policy
        self.split_prescaled = split_prescaled
        self.interpret = target == "interpret"
        self.explicit = {k: v for k, v in (("block_n", block_n), ("num_warps", num_warps),
                                           ("num_stages", num_stages)) if v is not None}
        self.splits = splits
        check_launch_options(target, "triton", block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                             splits=splits)
        geometry(spec, self.DEFAULTS["block_n"] if block_n is None else block_n)  # raise now if the spec cannot be tiled
        self._kernels: dict[tuple, tuple] = {}
        self._configs: dict[tuple, dict] = {}
        self._launches: dict[tuple, Launch] = {}   # plan_launch()'s memo
        self._kwargs: dict[tuple, dict] = {}       # the decode launch's keyword arguments, one dict per options
        self._bindings = Bindings()                # run's bound launches (decode, merge)

    def kernels(self, dtype: str, block_n: int | None = None, paged: bool = False):
        block_n = block_n or self.explicit.get("block_n", self.DEFAULTS["block_n"])
        key = (dtype, block_n) if not paged else (dtype, block_n, "paged")
        if key not in self._kernels:
            ks, geo, the_plan = kernel_source(self.spec, dtype, block_n, self.fold_policy, fast=not self.interpret,
                                              split_prescaled=self.split_prescaled, paged=paged)
            self._kernels[key] = (load_module(ks.source, self.interpret), ks, geo, the_plan)
        return self._kernels[key]

    def plan_for(self, dtype: torch.dtype) -> Plan:
        return self.kernels(DTYPES[dtype])[3]

    def source(self, dtype: torch.dtype = torch.float16) -> str:
        return self.kernels(DTYPES[dtype])[1].source

    def launch_config(self, dtype: torch.dtype, batch: int, tokens: int, device=None) -> dict:
        """block_n / num_warps / num_stages / split factor for this call on ``device`` (its tensors' device, whose
        GPU's tuned entry applies; None: the current GPU's), memoised per bucket."""
        bucket = (dtype, batch, tokens, device)
        cfg = self._configs.get(bucket)
        if cfg is not None:
            return cfg
        cfg = dict(self.DEFAULTS, split_factor=1.0)
        if not self.interpret and len(self.explicit) < 3:
            from ..runtime.tuning import lookup

            tuned = lookup(self.spec, dtype, batch, tokens, self.fold_policy, device=device)
            if tuned is not None:
                cfg.update(block_n=tuned.block_n, num_warps=tuned.num_warps, num_stages=tuned.num_stages,
                           split_factor=tuned.split_factor)
        cfg.update(self.explicit)
        self._configs[bucket] = cfg
        return cfg

    def __call__(self, q, k, v, sm_scale=None, seq_lens=None, out: torch.Tensor | None = None,
                 return_lse: bool = False):
        """Decode attention. ``out`` (optional): a preallocated [batch, num_q_heads, head_dim]
        tensor on q's device, of q's dtype or float32 (unrounded, for a later merge), to write into.
        ``return_lse``: also return the float32 log-sum-exp of the scaled logits per query head,
        [batch, num_q_heads] (see `foldc.merge_attention`)."""
        q_dtypes = (torch.float16,) if self.interpret else (torch.float16, torch.bfloat16)
        call = check_call(self.spec, q, k, v, sm_scale, seq_lens, q_dtypes=q_dtypes, out=out)
        device = q.device
        if self.interpret and device.type != "cpu":
            raise InputError(f"target='interpret' runs on the CPU; q is on {device}")
        if not self.interpret and device.type != "cuda":
            raise InputError(f"target={self.target!r} runs on a CUDA GPU; q is on {device}. "
                             "Use target='interpret' (CPU, fp16) or 'reference'")
        check_kernel_operands(q, k, v)
        b = call.batch
        launch = self.plan_launch(q.dtype, b, call.tokens, device, has_lens=True)
        lens = call.seq_lens if call.seq_lens is not None else torch.full((b,), call.tokens, device=device)
        lens = lens.to(device=device, dtype=torch.int32)
        out = output_buffer(out, (b, self.spec.num_q_heads, self.spec.head_dim), q)
        lse = torch.empty(b, self.spec.num_q_heads, device=device, dtype=torch.float32)
        self.run(launch, q, k, v, out, lse, call.sm_scale, seq_lens=lens)
        result = (out, lse) if return_lse else out
        if q.requires_grad or (isinstance(k, torch.Tensor) and k.requires_grad) or (
                isinstance(v, torch.Tensor) and v.requires_grad):   # no backward: one through it raises by name
            return without_backward(result, (q, k, v), ATTENTION_KERNEL, ATTENTION_FIX)
        return result

    def plan_launch(self, dtype: torch.dtype, batch: int, tokens: int, device, *, has_lens: bool = True,
                    page: int = 0, k=None, v=None) -> Launch:
        """The `Launch` of a call with ``dtype`` queries, ``batch`` sequences and ``tokens`` cached
        tokens per sequence (a page table's most, ``page`` tokens per page), memoised: the tuned or
        default options of its shape bucket (`launch_config`) and enough splits to fill the GPU twice
        (`choose_splits`) times the bucket's split factor, or the ``splits`` given. The generated
        kernel always reads lengths (``has_lens`` is recorded, not a variant); ``k``, ``v`` (the tensors
        the launch will read) pick no variant here."""
        key = (dtype, batch, tokens, page, device)
        launch = self._launches.get(key)
        if launch is None:
            cfg = self.launch_config(dtype, batch, tokens, device)
            _, _, geo, _ = self.kernels(DTYPES[dtype], cfg["block_n"], paged=bool(page))
            hkv = self.spec.num_kv_heads
            want = self.splits
            if want is None:
                auto, _ = choose_splits(batch, hkv, tokens, geo.block_n, num_sms(device))
                want = max(1, int(round(auto * cfg["split_factor"])))
            splits, per_split = split_partition(tokens, want, geo.block_n)
            launch = Launch("triton", dtype, batch, hkv, splits, per_split, geo.block_n,
                            per_split * splits if page else tokens, geo.rows, self.spec.head_dim, page, True, cfg)
            self._launches[key] = launch
        return launch

    def run(self, launch: Launch, q, k, v, out, lse, sm_scale: float, *, seq_lens, workspace=None,
            paged: tuple | None = None) -> None:
        """Launch ``launch`` (from `plan_launch`) into ``out`` and ``lse``, no checks and no host sync
        (callers validate): ``seq_lens`` int32 device lengths (0 allowed), ``workspace`` its three
        float32 buffers (allocated here if None), ``paged`` (kv_indptr, kv_indices) when k and v are
        page pools (foldc/serving/paged.py)."""
        module, ks, geo, _ = self.kernels(DTYPES[q.dtype], launch.block_n, paged=launch.page > 0)
        ws = workspace if workspace is not None else allocate_workspace(launch, q.device)
        bindable = paged is None and not self.interpret and not capturing(q) and not os.environ.get("TRITON_INTERPRET")
        if bindable:   # later calls with one launch's integers, strides and dtypes: its bound kernels
            key = (id(launch), q.stride(), side_key(k), side_key(v), out.stride(), out.dtype, seq_lens.dtype,
                   sm_scale, k.shape[2])
            state = self._bindings.get(key, launch)
            if type(state) is tuple and run_bound(state, _pointer_addresses(ks.args, q, k, v, seq_lens, ws),
                                                  self._fast_kernels(module)[1], ws, out, lse, self.spec.q_per_kv):
                return
        check_offsets("Triton decode kernel", token_offsets(k, v, launch.cache_tokens),
                      "split the sequences' tokens over several calls and merge their outputs by their lse")
        runtime = runtime_arguments(q, k, v, seq_lens, ws, sm_scale, launch.per_split, launch.splits)
        extra = {}
        if paged is not None:
            runtime.update(KV_INDPTR=paged[0], KV_INDICES=paged[1], cache_tokens=launch.cache_tokens)
            extra["PAGE_SIZE"] = launch.page
        args = [runtime[a] for a in ks.args]
        if self.interpret or os.environ.get("TRITON_INTERPRET"):
            with interpreter(self.interpret):
                self._launch(module, args, launch.batch, launch.head_programs, launch.splits, geo, *ws, out, lse,
                             launch.options, **extra)
        else:   # native mode already: no switch (an eager call's host path)
            self._launch(module, args, launch.batch, launch.head_programs, launch.splits, geo, *ws, out, lse,
                         launch.options, **extra)
            if bindable:
                decode, merge = self._fast_kernels(module)
                grid = (launch.batch, launch.head_programs, launch.splits)
                kwargs = self._decode_keywords(geo, launch.head_programs, launch.options)
                merge_grid, merge_args, merge_kwargs = merge_arguments(*ws, out, lse, self.spec.q_per_kv)
                self._bindings.note(key, launch, state, lambda: (decode.bind(grid, tuple(args), kwargs),
                                                                  merge.bind(merge_grid, merge_args, merge_kwargs)))

    def _launch(self, module, args, b, hkv, splits, geo, ws_m, ws_l, ws_acc, out, lse, cfg, **paged) -> None:
        decode, merge = self._fast_kernels(module)
        kwargs = self._decode_keywords(geo, hkv, cfg)
        decode[(b, hkv, splits)](*args, **kwargs, **paged)
        launch_merge(merge, ws_m, ws_l, ws_acc, out, lse, self.spec.q_per_kv)

    def _decode_keywords(self, geo, hkv: int, cfg) -> dict:
        """The decode launch's constexprs and options, one dict object per (tiles, heads, options) (`FastLaunch`
        reads a dict it saw once only once)."""
        key = (geo.rows, geo.block_n, hkv, cfg["num_warps"], cfg["num_stages"])
        kwargs = self._kwargs.get(key)
        if kwargs is None:
            kwargs = self._kwargs[key] = dict(Q_PER_KV=self.spec.q_per_kv, ROWS=geo.rows, BLOCK_N=geo.block_n,
                                              HEAD_DIM=self.spec.head_dim, NUM_KV_HEADS=hkv,
                                              num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        return kwargs

    def _fast_kernels(self, module) -> tuple:
        """``module``'s decode and merge kernels behind `FastLaunch` (repeat launches skip triton's
        binder; under the interpreter they pass straight through)."""
        fast = self.__dict__.setdefault("_fast", {})
        pair = fast.get(id(module))
        if pair is None or pair[0] is not module:
            pair = fast[id(module)] = (module, FastLaunch(module.foldc_decode), FastLaunch(module.foldc_merge))
        return pair[1], pair[2]


def token_offsets(k, v, tokens: int) -> dict:
    """The largest offset from a (batch, head)'s base (or a page's, rebased) that the kernel's token loop
    computes in int32 (token x token stride + channel), per cache tensor: the bases are 64-bit (codegen.py)."""
    out = {}
    for side, x in (("k", k), ("v", v)):
        parts = {side: x} if isinstance(x, torch.Tensor) else {f"{side}.{p}": getattr(x, p) for p in ("codes", "scale")}
        for name, t in parts.items():
            out[name] = max(tokens, t.shape[2]) * t.stride(2) + last_offset(t, 3)
    return out


def launch_options(cfg, spec, q, k) -> dict:
    """compile() options for a tuning config (`foldc.backends.triton.tuning.Config`): the split count is
    the default heuristic x split_factor."""
    tokens = k.shape[2] if hasattr(k, "shape") else k.num_tokens
    block = token_block(spec, cfg.block_n)
    splits, _ = choose_splits(q.shape[0], spec.num_kv_heads, tokens, block, num_sms(q.device))
    return {"block_n": cfg.block_n, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
            "splits": max(1, int(round(splits * cfg.split_factor)))}
