"""Load generated kernels and launch them: the attention callable of the Triton targets.

``foldc.compile(spec, target)`` with target "auto", "sm_90", "sm_100" (GPU) or "interpret"
(Triton's interpreter on the CPU) returns a `TritonAttention`. On each call it validates the
inputs, picks the plan for the query dtype (the code bias of eq. 7 depends on it), launches the
generated split-KV kernel and the merge kernel (eq. 14), and returns ``[batch, num_q_heads,
head_dim]`` in the query's dtype.
"""
from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import triton

from ...encoding import AffineTensor
from ...errors import InputError
from ...options import check_launch_options
from ...plan import Plan, plan
from ...precision import code_bias_allowed, key_reduction_group
from ...validate import check_call, output_buffer
from .codegen import MAGIC, KernelSource, generate, magic_ok
from .layout import TileGeometry, geometry

DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
MERGE_SOURCE = '''
from triton.language.extra.cuda import gdc_wait


@triton.jit
def foldc_merge(WS_M, WS_L, WS_ACC, OUT, LSE, stride_ob, stride_oh, num_splits,
                Q_PER_KV: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                NUM_KV_HEADS: tl.constexpr, SPLIT_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr,
                PDL: tl.constexpr):
    """Merge the per-split (max, denominator, accumulator) states (eq. 14) and divide (eq. 10).
    Program (b, kv_head, row x channel block): one query row's channels d*D_BLOCK.., SPLIT_BLOCK
    splits per step in one pass: a step's max, denominators and accumulators load together (one
    memory round trip per step) and rescale the running sums to the new maximum (eq. 14 again).
    Rows are independent, so a call with few (batch, head) pairs and many splits (batch 1, long
    context) still spreads over ROWS * HEAD_DIM / D_BLOCK programs per head. PDL: launched as a
    programmatic dependent of the decode kernel, so wait until its writes are visible."""
    if PDL:
        gdc_wait()
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    row = tl.program_id(2) // (HEAD_DIM // D_BLOCK)
    dblk = tl.program_id(2) % (HEAD_DIM // D_BLOCK)
    real = row < Q_PER_KV          # rows past q_per_kv are the MMA's padding: nothing to write
    cols = dblk * D_BLOCK + tl.arange(0, D_BLOCK)
    sb = tl.arange(0, SPLIT_BLOCK)
    base = (b * NUM_KV_HEADS + kvh) * num_splits * ROWS + row
    m = tl.max(tl.full([SPLIT_BLOCK], float("-inf"), tl.float32), axis=0)
    l = tl.sum(tl.zeros([SPLIT_BLOCK], tl.float32), axis=0)
    acc = tl.zeros([D_BLOCK], tl.float32)
    for s0 in range(0, num_splits, SPLIT_BLOCK):
        live = ((s0 + sb) < num_splits) & real
        idx = base + (s0 + sb) * ROWS
        m_s = tl.load(WS_M + idx, mask=live, other=float("-inf"))
        l_s = tl.load(WS_L + idx, mask=live, other=0.0)
        acc_s = tl.load(WS_ACC + idx[:, None] * HEAD_DIM + cols[None, :], mask=live[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(m_s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # nothing yet: every weight is 0
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(m_s - m_safe)
        l = l * alpha + tl.sum(l_s * w, axis=0)
        acc = acc * alpha + tl.sum(acc_s * w[:, None], axis=0)
        m = m_new
    l_total = tl.where(real, l, 1.0)   # a padding row divides by 1, not 0
    out = acc / l_total
    ptr = OUT + b * stride_ob + (kvh * Q_PER_KV + row) * stride_oh + cols
    tl.store(ptr, out.to(OUT.dtype.element_ty), mask=real & (cols < HEAD_DIM))
    # natural-log sum of exp of the logits (m is in log2 units): lets callers merge attention
    # over several caches, e.g. a quantized body and a bf16 window (eq. 14)
    lse = (m + tl.log2(l_total)) * 0.6931471805599453
    tl.store(LSE + b * NUM_KV_HEADS * Q_PER_KV + kvh * Q_PER_KV + row, lse, mask=real & (dblk == 0))
'''


def launch_merge(merge_kernel, ws_m, ws_l, ws_acc, out, lse, q_per_kv: int, pdl: bool = False) -> None:
    """Launch ``foldc_merge`` over the workspace [batch, kv_heads, splits, rows(, head_dim)]: one
    program per (batch, head, real query row, block of channels), up to 128 splits per step.
    Padding rows (rows >= q_per_kv) get no program. Blocks of 32 channels on a GPU (16 or fewer where
    32 does not divide head_dim, e.g. 80 or 112); all channels in one program under the interpreter
    (CPU tensors), which runs programs one after another.
    ``pdl``: a programmatic dependent launch (sm_90+): the merge's launch overlaps the end of the
    kernel before it on the stream, and its programs wait for that kernel's writes."""
    b, hkv, splits, rows = ws_m.shape
    head_dim = ws_acc.shape[-1]
    whole = ws_m.device.type == "cpu" and head_dim & (head_dim - 1) == 0
    d_block = head_dim if whole else math.gcd(head_dim, 32)   # a power of two that divides head_dim
    # one pass, one round trip per step: 128 splits of 32 channels per step is 32 values per thread
    split_block = min(128 if d_block <= 32 else 64, max(2, triton.next_power_of_2(splits)))
    merge_kernel[(b, hkv, q_per_kv * (head_dim // d_block))](
        ws_m, ws_l, ws_acc, out, lse, out.stride(0), out.stride(1), splits, Q_PER_KV=q_per_kv, ROWS=rows,
        HEAD_DIM=head_dim, NUM_KV_HEADS=hkv, SPLIT_BLOCK=split_block, D_BLOCK=d_block, PDL=pdl,
        num_warps=4 if split_block * d_block >= 1024 else 1, **({"launch_pdl": True} if pdl else {}))


def cache_dir() -> Path:
    root = os.environ.get("FOLDC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "foldc")
    path = Path(root) / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


_MISSING = object()
_TWINS: dict[int, tuple] = {}  # id(library function) -> (it, the same function in the other mode)


def _library_twin(obj, interpret: bool):
    """``obj``, a @triton.jit function of triton.language, in the other execution mode; None if
    it already suits ``interpret`` (or is not such a function). Pinned to triton 3.6 internals."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if interpret and isinstance(obj, JITFunction):
        make = lambda: InterpretedFunction(  # noqa: E731
            obj.fn, version=obj.version, do_not_specialize=obj.do_not_specialize,
            do_not_specialize_on_alignment=obj.do_not_specialize_on_alignment, debug=obj.debug,
            noinline=obj.noinline, repr=obj._repr, launch_metadata=obj.launch_metadata)
    elif not interpret and isinstance(obj, InterpretedFunction):
        make = lambda: JITFunction(obj.fn, **obj.kwargs)  # noqa: E731
    else:
        return None
    if id(obj) not in _TWINS:
        _TWINS[id(obj)] = (obj, make())
    return _TWINS[id(obj)][1]


@contextmanager
def _interpret(on: bool):
    """Run Triton in interpreter mode (``on``) or native mode for the duration.

    Triton fixes the mode of its own library functions (tl.sum, tl.max, tl.zeros, ... are
    @triton.jit functions) when triton.language is first imported: a process that imported
    triton with TRITON_INTERPRET unset cannot interpret a kernel that calls them ("Cannot call
    @triton.jit'd outside of the scope of a kernel"), and one that imported it under the
    interpreter cannot compile them natively. And an interpreted call of one of them patches
    triton.language for the interpreter without undoing it. So besides setting the variable,
    swap those functions for twins of the wanted mode, and on exit put back every attribute of
    triton.language that changed."""
    old = os.environ.get("TRITON_INTERPRET")
    if on:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    saved = []
    try:
        import triton.language as tl  # a first import happens in the wanted mode

        if not on and type(tl.standard.sum).__name__ == "JITFunction":
            yield  # native mode, native library: nothing to swap (the fast path of GPU launches)
            return
        holders = [m for n, m in list(sys.modules.items()) if n.startswith("triton.language") and m is not None]
        holders += [tl.tensor, tl.dtype, tl.core.tensor_descriptor_base]
        saved = [(h, dict(vars(h))) for h in holders]
        for holder in holders:
            for name, obj in list(vars(holder).items()):
                twin = _library_twin(obj, on)
                if twin is not None:
                    setattr(holder, name, twin)
        yield
    finally:
        for holder, before in saved:
            now = vars(holder)
            for name, value in before.items():
                if now.get(name, _MISSING) is not value:
                    setattr(holder, name, value)
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def load_module(source: str, interpret: bool):
    """Write ``source`` to the kernel cache and import it (Triton needs a real file)."""
    key = hashlib.sha256((source + str(interpret)).encode()).hexdigest()[:20]
    mod_name = f"foldc_kernel_{key}_{'interp' if interpret else 'native'}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    path = cache_dir() / f"{mod_name}.py"
    if not path.exists() or path.read_text() != source:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        tmp.replace(path)
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    with _interpret(interpret):
        spec.loader.exec_module(module)
    sys.modules[mod_name] = module
    return module


def triton_plan(spec, dtype: str, fold_policy: str = "auto") -> Plan:
    """The plan the Triton backend lowers: key codes carry the OR-trick bias folded into the
    zero (eq. 7); value codes have it subtracted per value (fold-kernel-probe.md: folding it
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


_SMS: dict = {}   # CUDA device index -> SM count (get_device_properties costs ~10 us per call)


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _SMS:
            _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
        return _SMS[index]
    return 2


def choose_splits(batch: int, kv_heads: int, tokens: int, block_n: int, sms: int) -> tuple[int, int]:
    """(splits, tokens per split): enough programs to fill the SMs twice, whole tiles per split."""
    tiles = math.ceil(tokens / block_n)
    want = math.ceil(2 * sms / (batch * kv_heads))
    splits = max(1, min(want, tiles, 128))
    per_split = math.ceil(tiles / splits) * block_n
    return math.ceil(tokens / per_split), per_split


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
    autotuning cache for the call's shape bucket (autotune.py) on a GPU, else from defaults."""

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

    def launch_config(self, dtype: torch.dtype, batch: int, tokens: int) -> dict:
        """block_n / num_warps / num_stages / split factor for this call (memoised per bucket)."""
        bucket = (dtype, batch, tokens)
        cfg = self._configs.get(bucket)
        if cfg is not None:
            return cfg
        cfg = dict(self.DEFAULTS, split_factor=1.0)
        if not self.interpret and len(self.explicit) < 3:
            from .autotune import lookup

            tuned = lookup(self.spec, dtype, batch, tokens, self.fold_policy)
            if tuned is not None:
                cfg.update(block_n=tuned.block_n, num_warps=tuned.num_warps, num_stages=tuned.num_stages,
                           split_factor=tuned.split_factor)
        cfg.update(self.explicit)
        self._configs[bucket] = cfg
        return cfg

    def __call__(self, q, k, v, sm_scale=None, seq_lens=None, out: torch.Tensor | None = None,
                 return_lse: bool = False):
        """Decode attention. ``out`` (optional): a preallocated [batch, num_q_heads, head_dim]
        tensor of q's dtype and device to write into. ``return_lse``: also return the float32
        log-sum-exp of the scaled logits per query head, [batch, num_q_heads] (see
        `foldc.merge_attention`)."""
        q_dtypes = (torch.float16,) if self.interpret else (torch.float16, torch.bfloat16)
        call = check_call(self.spec, q, k, v, sm_scale, seq_lens, q_dtypes=q_dtypes)
        device = q.device
        if self.interpret and device.type != "cpu":
            raise InputError(f"target='interpret' runs on the CPU; q is on {device}")
        if not self.interpret and device.type != "cuda":
            raise InputError(f"target={self.target!r} runs on a CUDA GPU; q is on {device}. "
                             "Use target='interpret' (CPU, fp16) or 'reference'")
        for name, x in (("k", k), ("v", v)):
            parts = (x.codes, x.scale, x.zero) if isinstance(x, AffineTensor) else (x,)
            for t in parts:
                if not t.is_contiguous():
                    raise InputError(f"{name} must be contiguous (a part of it has strides {t.stride()}); "
                                     "call .contiguous() on it first")
            if not isinstance(x, AffineTensor) and x.dtype != q.dtype:
                raise InputError(f"{name} dtype={x.dtype} must match q dtype={q.dtype} for a plain operand")
        if q.stride(-1) != 1:
            raise InputError(f"q must have unit stride along head_dim; got strides {q.stride()}")
        dtype = DTYPES[q.dtype]
        b, hkv = call.batch, self.spec.num_kv_heads
        cfg = self.launch_config(q.dtype, b, call.tokens)
        module, ks, geo, _ = self.kernels(dtype, cfg["block_n"])
        want_splits = self.splits
        if want_splits is None:
            auto, _ = choose_splits(b, hkv, call.tokens, geo.block_n, num_sms(device))
            want_splits = max(1, int(round(auto * cfg["split_factor"])))
        per_split = math.ceil(math.ceil(call.tokens / want_splits) / geo.block_n) * geo.block_n
        splits = math.ceil(call.tokens / per_split)
        lens = call.seq_lens if call.seq_lens is not None else torch.full((b,), call.tokens, device=device)
        lens = lens.to(device=device, dtype=torch.int32)
        ws_m = torch.empty(b, hkv, splits, geo.rows, device=device, dtype=torch.float32)
        ws_l = torch.empty_like(ws_m)
        ws_acc = torch.empty(b, hkv, splits, geo.rows, self.spec.head_dim, device=device, dtype=torch.float32)
        want = (b, self.spec.num_q_heads, self.spec.head_dim)
        out = output_buffer(out, want, q)
        runtime = runtime_arguments(q, k, v, lens, (ws_m, ws_l, ws_acc), call.sm_scale, per_split, splits)
        args = [runtime[a] for a in ks.args]
        lse = torch.empty(b, self.spec.num_q_heads, device=device, dtype=torch.float32)
        with _interpret(self.interpret):
            self._launch(module, args, b, hkv, splits, geo, ws_m, ws_l, ws_acc, out, lse, cfg)
        return (out, lse) if return_lse else out

    def _launch(self, module, args, b, hkv, splits, geo, ws_m, ws_l, ws_acc, out, lse, cfg, **paged) -> None:
        module.foldc_decode[(b, hkv, splits)](
            *args, Q_PER_KV=self.spec.q_per_kv, ROWS=geo.rows, BLOCK_N=geo.block_n, HEAD_DIM=self.spec.head_dim,
            NUM_KV_HEADS=hkv, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **paged)
        launch_merge(module.foldc_merge, ws_m, ws_l, ws_acc, out, lse, self.spec.q_per_kv)
