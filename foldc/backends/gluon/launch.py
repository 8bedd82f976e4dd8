"""The register-operand kernel as an attention callable (sm_90 GPUs).

`GluonAttention` validates a call like the Triton backend, launches the Gluon decode kernel
(kernel.py) over (batch, kv_head, split) programs of one warp each and the Triton backend's merge
kernel (eq. 14), and returns [batch, num_q_heads, head_dim] in the query's dtype. Calls are
CUDA-graph capturable: no host synchronisation, lengths clamped in the kernel.
"""
from __future__ import annotations

import math

import torch

from ...errors import InputError, SpecError
from ...validate import check_call, output_buffer
from ..triton.launch import MERGE_SOURCE, launch_merge, load_module, num_sms
from .lower import FoldKernel, gluon_plan, lower
from .operands import VALUE_EXPONENT, key_unpack_asm, value_unpack_asm

DTYPES = (torch.float16, torch.bfloat16)
TUNED_OPTIONS = {"block_n", "stages", "maxnreg", "split_factor", "heads"}   # what a tuned bucket sets
PROGRAMS_PER_SM = 16   # one warp each; enough resident warps to hide the code loads


def constexprs(cfg: FoldKernel, block_n: int, stages: int, heads: int = 1, scale_ahead: bool | None = None) -> dict:
    """The kernel's compile-time arguments for ``cfg`` (the unpack PTX is generated here), with
    ``heads`` KV heads packed into one program's query rows; ``scale_ahead``: load the next tile's
    token-wise scales and zeros one tile early into registers, else each tile's at its start
    (None: `default_scale_ahead`)."""
    if scale_ahead is None:
        scale_ahead = default_scale_ahead(cfg)
    key_asm, key_cons = key_unpack_asm(cfg.bits, exact=cfg.key_bias == 0)
    values = [value_unpack_asm(cfg.bits, byte) for byte in range(4)]
    return dict(Q_PER_KV=cfg.q_per_kv, ROWS=cfg.rows, H=heads, BN=block_n, D=cfg.head_dim, BITS=cfg.bits,
                KEY_BIAS=cfg.key_bias, KEY_G=cfg.key_tokens, VAL_G=cfg.value_tokens, STAGES=stages,
                SCALE_AHEAD=bool(scale_ahead), KASM=key_asm, KCONS=key_cons, VA0=values[0][0],
                VA1=values[1][0], VA2=values[2][0], VA3=values[3][0], VCONS=values[0][1], VALUE_EXP=VALUE_EXPONENT)


def packable_heads(cfg: FoldKernel, num_kv_heads: int) -> int:
    """Most KV heads one program can pack into the MMA's N axis: a power of two whose query rows
    together fill at most ``cfg.rows`` (so the softmax works on real rows only) and that divides
    ``num_kv_heads``. 1 for channel-wise V (its per-channel scales would become per row)."""
    if cfg.value_tokens:
        return 1
    heads = 1 << (max(1, cfg.rows // cfg.q_per_kv).bit_length() - 1)   # a power of two
    while num_kv_heads % heads:
        heads //= 2
    return heads


def default_pack_heads(cfg: FoldKernel, num_kv_heads: int) -> int:
    """The launcher's choice: pack as many heads as fit for token-wise K and V; one head per
    program for channel-wise K, whose per-group query scaling gets per-row loads when packed (the
    SASS then needs 255 registers and 9.6 lane-slots per byte instead of 5.9 at INT2)."""
    return 1 if cfg.key_tokens else packable_heads(cfg, num_kv_heads)


def default_scale_ahead(cfg: FoldKernel) -> bool:
    """Token-wise K and V: load each tile's scales at its start (frees the registers that held the
    next tile's; 1-4% faster on the H200, docs/perf.md). A channel-wise side: one tile ahead (its
    token-wise side's scales loaded late cost 10-45% there)."""
    return bool(cfg.key_tokens or cfg.value_tokens)


def choose_splits(batch: int, kv_heads: int, tokens: int, block_n: int, sms: int, factor: float = 1.0) -> int:
    """Split count: about PROGRAMS_PER_SM one-warp programs per SM, at least two tiles per split."""
    tiles = max(1, math.ceil(tokens / block_n))
    want = math.ceil(PROGRAMS_PER_SM * sms * factor / (batch * kv_heads))
    return max(1, min(want, math.ceil(tiles / 2), 1024))


class GluonAttention:
    """Decode attention through the register-operand kernel. Options: ``block_n`` (32 or 64
    tokens per tile), ``stages`` (code tiles in flight, 2-4), ``splits`` (split-KV count; default
    about 16 programs per SM), ``maxnreg`` (register cap per thread, e.g. 128), ``pack_heads``
    (KV heads per program whose query rows share the MMA's N axis; default `default_pack_heads`),
    ``scale_ahead`` (load token-wise scales a tile early, in registers; default `default_scale_ahead`)."""

    def __init__(self, spec, block_n: int | None = None, stages: int | None = None, splits: int | None = None,
                 maxnreg: int | None = None, split_factor: float | None = None, pack_heads: int | None = None,
                 scale_ahead: bool | None = None):
        self.spec, self.target = spec, "sm_90"
        self.plan = gluon_plan(spec)
        self.config = lower(self.plan)      # raises NotLowerable with the reason
        most = packable_heads(self.config, spec.num_kv_heads)
        bad_pack = pack_heads is not None and (
            isinstance(pack_heads, bool) or not isinstance(pack_heads, int) or pack_heads < 1
            or spec.num_kv_heads % pack_heads or pack_heads > most or pack_heads & (pack_heads - 1)
            or (pack_heads > 1 and self.config.value_tokens))
        if bad_pack:
            raise SpecError(f"pack_heads={pack_heads!r}: this spec packs 1 to {most} KV heads per program (a power "
                            f"of two dividing num_kv_heads={spec.num_kv_heads} whose {spec.q_per_kv} query rows each "
                            f"fit the MMA's {self.config.rows} rows; token-wise V only); use pack_heads={most} or None")
        # options left as None come from the autotuning cache for the call's shape bucket, else defaults
        self.explicit = {k: v for k, v in (("block_n", block_n), ("stages", stages), ("maxnreg", maxnreg),
                                           ("split_factor", split_factor), ("heads", pack_heads),
                                           ("scale_ahead", scale_ahead)) if v is not None}
        if pack_heads is None:
            pack_heads = default_pack_heads(self.config, spec.num_kv_heads)
        self.heads = pack_heads     # the default; a tuned bucket may take one head per program instead
        # 64-token tiles won for packed INT2 at every large shape on the H200 (docs/perf.md); 32 elsewhere
        block_n, stages = block_n or (64 if pack_heads > 1 and self.config.bits == 2 else 32), stages or 2
        if block_n not in (32, 64):
            raise SpecError(f"block_n={block_n!r} must be 32 or 64 for the register-operand kernel")
        for name, group in (("k", self.config.key_tokens), ("v", self.config.value_tokens)):
            if group and group % block_n:
                raise SpecError(f"block_n={block_n} must divide {name}'s channel-wise group of {group} tokens (a tile "
                                "lies in one group); use block_n=32")
        if stages not in (2, 3, 4):
            raise SpecError(f"stages={stages!r} must be 2, 3 or 4 (code tiles in flight)")
        if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int) or splits < 1):
            raise SpecError(f"splits={splits!r} must be a positive integer or None for automatic")
        if scale_ahead is not None and not isinstance(scale_ahead, bool):
            raise SpecError(f"scale_ahead={scale_ahead!r} must be True, False or None (the default)")
        if maxnreg is not None and (not isinstance(maxnreg, int) or not 32 <= maxnreg <= 255):
            raise SpecError(f"maxnreg={maxnreg!r} must be an integer in [32, 255] or None")
        self.splits = splits
        self._defaults = {"block_n": block_n, "stages": stages, "maxnreg": maxnreg, "split_factor": split_factor or 1.0,
                          "heads": self.heads, "scale_ahead": scale_ahead}   # None: default_scale_ahead
        self._configs: dict = {}
        self._modules = None

    @property
    def default_block_n(self) -> int:
        """Tokens per tile when neither the call's options nor a tuned bucket say otherwise."""
        return self._defaults["block_n"]

    def launch_config(self, dtype: torch.dtype, batch: int, tokens: int) -> dict:
        """block_n / stages / maxnreg / split factor for this call (memoised per shape bucket)."""
        bucket = (dtype, batch, tokens)
        if bucket not in self._configs:
            opts = dict(self._defaults)
            if not TUNED_OPTIONS <= set(self.explicit):   # some option is left to the tuning cache
                from ..triton.autotune import lookup

                tuned = lookup(self.spec, dtype, batch, tokens, kernel="gluon")
                if tuned is not None:
                    opts.update(block_n=tuned.block_n, stages=tuned.stages, maxnreg=tuned.maxnreg,
                                split_factor=tuned.split_factor, heads=tuned.pack_heads or self.heads)
            opts.update(self.explicit)
            opts["constexprs"] = constexprs(self.config, opts["block_n"], opts["stages"], opts["heads"],
                                           opts["scale_ahead"])
            self._configs[bucket] = opts
        return self._configs[bucket]

    def _kernels(self):
        if self._modules is None:
            from . import kernel

            merge = load_module("import triton\nimport triton.language as tl\n" + MERGE_SOURCE, interpret=False)
            self._modules = (kernel.foldc_decode_gluon, merge.foldc_merge)
        return self._modules

    def __call__(self, q, k, v, sm_scale=None, seq_lens=None, out: torch.Tensor | None = None,
                 return_lse: bool = False):
        """Same call as foldc.compile(...)'s other targets: q [batch, num_q_heads, head_dim] fp16/bf16 on
        the GPU, k and v AffineTensors of the spec's encodings; returns out (and the lse if asked)."""
        call = check_call(self.spec, q, k, v, sm_scale, seq_lens, q_dtypes=DTYPES)
        device = q.device
        if device.type != "cuda":
            raise InputError(f"the register-operand kernel runs on a CUDA GPU; q is on {device}. Use "
                             "target='interpret' (CPU, fp16) or 'reference'")
        for name, x in (("k", k), ("v", v)):
            for t in (x.codes, x.scale, x.zero):
                if not t.is_contiguous():
                    raise InputError(f"{name} must be contiguous (a part of it has strides {t.stride()}); "
                                     "call .contiguous() on it first")
            if x.codes.data_ptr() % 4:
                raise InputError(f"{name}.codes starts at an address not divisible by 4; the kernel reads "
                                 "32-bit words: pass a tensor that owns its storage (e.g. .clone())")
        if q.stride(-1) != 1:
            raise InputError(f"q must have unit stride along head_dim; got strides {q.stride()}")
        launch = self.launch_config(q.dtype, call.batch, call.tokens)
        b, cfg = call.batch, self.config
        splits, per_split = self.split_plan(launch, b, call.tokens, device)
        # no lengths: the kernel reads none (no fill and cast kernels before it, which count at batch 1)
        has_lens = call.seq_lens is not None
        lens = call.seq_lens.to(device=device, dtype=torch.int32) if has_lens else None
        ws = self.workspace(launch, b, splits, device)
        want = (b, self.spec.num_q_heads, cfg.head_dim)
        out = output_buffer(out, want, q)
        lse = torch.empty(b, self.spec.num_q_heads, device=device, dtype=torch.float32)
        self.launch(launch, q, k, v, lens, ws, out, lse, call.sm_scale, per_split, splits, call.tokens)
        return (out, lse) if return_lse else out

    def split_plan(self, launch: dict, batch: int, tokens: int, device) -> tuple[int, int]:
        """(splits, tokens per split) for ``tokens`` cached tokens: whole tiles per split."""
        block_n, hkv = launch["block_n"], self.spec.num_kv_heads // launch["heads"]
        splits = self.splits or choose_splits(batch, hkv, tokens, block_n, num_sms(device), launch["split_factor"])
        per_split = math.ceil(math.ceil(tokens / splits) / block_n) * block_n
        return max(1, math.ceil(tokens / per_split)), per_split

    def workspace(self, launch: dict, batch: int, splits: int, device) -> tuple[torch.Tensor, ...]:
        """Per-split (max, denominator, accumulator): H packed KV heads are one head of H x q_per_kv
        rows for the workspace and the merge."""
        hkv, rows = self.spec.num_kv_heads // launch["heads"], self.config.rows
        ws_m = torch.empty(batch, hkv, splits, rows, device=device, dtype=torch.float32)
        return ws_m, torch.empty_like(ws_m), torch.empty(batch, hkv, splits, rows, self.config.head_dim,
                                                          device=device, dtype=torch.float32)

    def launch(self, launch: dict, q, k, v, lens, ws, out, lse, sm_scale: float, per_split: int, splits: int,
               cache_tokens: int, paged: tuple | None = None) -> None:
        """Launch the decode and merge kernels, no checks (callers validate). ``lens``: int32 device
        lengths or None (every sequence holds ``cache_tokens``); ``paged``: (kv_indptr, kv_indices,
        page_size) when k and v are page pools (foldc/serving/paged.py)."""
        decode, merge = self._kernels()
        heads = launch["heads"]
        kc, vc = k.codes.view(torch.int32), v.codes.view(torch.int32)
        indptr, indices, page = paged if paged is not None else (q, q, 0)
        extra = {"maxnreg": launch["maxnreg"]} if launch["maxnreg"] else {}
        decode[(q.shape[0], self.spec.num_kv_heads // heads, splits)](
            q, kc, k.scale, k.zero, vc, v.scale, v.zero, q if lens is None else lens, *ws, indptr, indices,
            q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), k.scale.stride(0), k.scale.stride(1),
            k.scale.stride(2), vc.stride(0), vc.stride(1), v.scale.stride(0), v.scale.stride(1), v.scale.stride(2),
            sm_scale * 1.4426950408889634, per_split, cache_tokens, HAS_LENS=lens is not None, PAGE=page,
            **launch["constexprs"], num_warps=1, **extra)
        launch_merge(merge, *ws, out, lse, self.spec.q_per_kv * heads)
