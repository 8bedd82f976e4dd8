"""The register-operand kernel as an attention callable (sm_90 and sm_100 GPUs).

`GluonAttention` validates a call like the Triton backend, launches the Gluon decode kernel
(kernel.py) over (batch, kv_head, split) programs of one warp each and the Triton backend's merge
kernel (eq. 14), or, for an eager call of one wave, the decode kernel alone, merging its own splits
(split_merge.py), and returns [batch, num_q_heads, head_dim] in the query's dtype. Calls are
CUDA-graph capturable: no host synchronisation, lengths clamped in the kernel.
"""
from __future__ import annotations

import copy
import math
import warnings

import torch

from ...plan import Plan
from ...errors import InputError, SpecError
from ...options import check_launch_options, check_splits
from ...validate import ATTENTION_FIX, ATTENTION_KERNEL, check_call, output_buffer, without_backward
from ..runtime.fast_launch import Bindings, FastLaunch
from ..runtime.launch import Launch, Scratch, allocate_workspace, capturing, split_partition, stream_handle
from ..runtime.merge import MERGE_SOURCE, merge_arguments, run_bound
from ..runtime.modules import load_module, num_sms
from ..runtime.offsets import DECODE_FIX, check_offsets, decode_offsets
from .decode_args import (TOKENS_ARG, binding_key, decode_addresses, decode_arguments, draws_tiles,
                          mock_decode_arguments)
from .eager import EagerCalls
from .launch_defaults import (BARRIER_FIXED, MERGE_MOST_PROGRAMS, MIN_SPLIT_TOKENS, constexprs, default_block_n,
                              default_pack_heads, packable_heads, resident_programs, row_blocks_at_64, wave_splits)
from .lower import HALF_TILE_GROUP, NotLowerable, gluon_plan, lower
from .prepared import PreparedRun
from .warpgroup_launch import WarpgroupLaunch, warpgroup_applies

DTYPES = (torch.bfloat16, torch.float16)   # lower.QUERY_DTYPES, each held to plain bf16 attention's error
TUNED_OPTIONS = {"block_n", "stages", "maxnreg", "split_factor", "heads"}   # what a tuned bucket sets


class GluonAttention:
    """Decode attention through the register-operand kernel. Options: ``block_n`` (32 or 64
    tokens per tile), ``stages`` (code tiles in flight, 2-4), ``splits`` (split-KV count; default
    as many as fill ``split_factor`` waves of resident programs, each split at least two tiles and, past
    half a wave, MIN_SPLIT_TOKENS: `wave_splits`; pass ``splits`` to set the count), ``maxnreg``
    (register cap per thread, e.g. 128), ``pack_heads`` (KV heads per program whose query rows
    share the MMA's N axis; default `default_pack_heads`), ``scale_ahead`` (load token-wise scales a
    tile early, in registers; default `default_scale_ahead`), ``dynamic_tiles`` (default False: the
    programs of a (batch, KV head group) draw their tiles from a shared counter, zeroed each call,
    instead of taking consecutive splits, so that the programs the warp schedulers favour take more
    tiles and every SM stays busy to the end. The order in which tiles meet then varies between calls,
    and so do the output's last bits. On the H200 it was 0-3.5% faster at INT2 token-wise and slower
    at INT4 and with channel-wise sides (more registers), docs/perf.md; 2 stages only). The
    attribute ``pdl`` (default True) launches the merge as a programmatic dependent of the decode
    kernel inside a CUDA-graph capture (eager calls never do: it cost ~44 µs of GPU time there on the
    H200); set it False to launch the two kernels one after the other everywhere. Eager calls after
    the first reuse the compiled kernels through `FastLaunch`."""

    def __init__(self, spec, block_n: int | None = None, stages: int | None = None, splits: int | None = None,
                 maxnreg: int | None = None, split_factor: float | None = None, pack_heads: int | None = None,
                 scale_ahead: bool | None = None, dynamic_tiles: bool = False, target: str = "sm_90"):
        if target not in ("sm_90", "sm_100"):
            raise SpecError(f"target={target!r}: the register-operand kernel runs on 'sm_90' or 'sm_100'")
        self.spec, self.target = spec, target
        check_launch_options(target, "gluon", block_n=block_n, stages=stages)   # before any default
        check_splits(splits)
        # the plan per query dtype (lower.QUERY_DTYPES: eq. 6a's precisions against plain bf16 attention);
        # both lower to one configuration, the kernel's, read from the bf16 plan
        self.plans = {dtype: gluon_plan(spec, name) for dtype, name in ((torch.bfloat16, "bf16"),
                                                                          (torch.float16, "fp16"))}
        self.plan = self.plans[torch.bfloat16]
        self.config = lower(self.plan)      # raises NotLowerable with the reason
        if lower(self.plans[torch.float16]) != self.config:
            raise NotLowerable("the fp16 and bf16 queries' plans lower to different kernels; the register-operand "
                               "kernel builds one per spec")
        if pack_heads is not None and self._pack_reason(pack_heads):
            raise SpecError(self._pack_reason(pack_heads))
        # options left as None come from the autotuning cache for the call's shape bucket, else defaults
        self.explicit = {k: v for k, v in (("block_n", block_n), ("stages", stages), ("maxnreg", maxnreg),
                                           ("split_factor", split_factor), ("heads", pack_heads),
                                           ("scale_ahead", scale_ahead)) if v is not None}
        if pack_heads is None:
            pack_heads = default_pack_heads(self.config, spec.num_kv_heads)
        self.heads = pack_heads     # the default; a tuned bucket may take one head per program instead
        # where neither the call nor a tuned bucket sets the tile size (launch_defaults.default_block_n); row blocks
        # beside a channel-wise side in groups of 64 tokens load its scales at each tile's start
        if row_blocks_at_64(self.config, target) and scale_ahead is None:
            scale_ahead = False
        block_n, stages = block_n or default_block_n(self.config, target, pack_heads), stages or 2
        if self._tile_reason(block_n):
            raise SpecError(self._tile_reason(block_n))
        if scale_ahead is not None and not isinstance(scale_ahead, bool):
            raise SpecError(f"scale_ahead={scale_ahead!r} must be True, False or None (the default)")
        if not isinstance(dynamic_tiles, bool):
            raise SpecError(f"dynamic_tiles={dynamic_tiles!r} must be True or False (the default)")
        if dynamic_tiles and stages != 2:
            raise SpecError(f"dynamic_tiles=True needs stages=2 (got stages={stages}): the tile copied ahead is "
                            "the next one drawn; use stages=2 or dynamic_tiles=False")
        if split_factor is not None and (isinstance(split_factor, bool) or not isinstance(split_factor, (int, float))
                                         or not 0 < split_factor <= 64):
            raise SpecError(f"split_factor={split_factor!r} must be a number of waves of resident programs in "
                            "(0, 64], e.g. 1.0 (the default) or 2.0")
        if maxnreg is not None and (not isinstance(maxnreg, int) or not 32 <= maxnreg <= 255):
            raise SpecError(f"maxnreg={maxnreg!r} must be an integer in [32, 255] or None")
        self.splits = splits
        self._defaults = {"block_n": block_n, "stages": stages, "maxnreg": maxnreg,
                          "split_factor": float(split_factor or 1.0),
                          "heads": self.heads, "scale_ahead": scale_ahead}   # None: default_scale_ahead
        self.dynamic_tiles = dynamic_tiles
        self._configs: dict = {}
        self._launches: dict = {}     # plan_launch()'s memo: (dtype, batch, tokens, has_lens, page, device) -> Launch
        self._variants: dict = {}     # compiled kernel variant -> (resident programs per SM, registers)
        self._modules = None
        self._fast = None
        self._scratch = Scratch()     # eager calls' workspace and lse, per stream
        self._bindings = Bindings()   # eager launches bound to their integers (`launch`)
        self._eager = EagerCalls()    # bound eager calls by their shapes (eager.py)
        # the merge as a programmatic dependent launch of the decode kernel: its launch overlaps the
        # decode's last programs (0.2-0.4 µs of a batch-1 call on the H200, docs/perf.md)
        self.pdl = True
        # eager calls that fit one wave merge their splits inside the decode kernel (one launch: split_merge.py);
        # False: every call launches the merge kernel after it (`merge_in_decode`)
        self._merge_in_decode = True
        self._barriers: dict = {}     # the merging launches' barrier counters, per (device, stream)
        # 32 query rows per KV head at token-wise INT2: the four-warp wgmma template for calls on a contiguous
        # cache with the launcher's defaults (warpgroup_launch.py); None: the one-warp program only
        self.warpgroup = WarpgroupLaunch(spec) if (
            warpgroup_applies(spec, target) and not self.explicit and splits is None
            and not dynamic_tiles) else None

    def _pack_reason(self, heads) -> str | None:
        """Why ``heads`` KV heads per program do not fit this spec's kernel, or None."""
        most = packable_heads(self.config, self.spec.num_kv_heads)
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or self.spec.num_kv_heads % heads \
                or heads > most or heads & (heads - 1):
            return (f"pack_heads={heads!r}: this spec packs 1 to {most} KV heads per program (a power of two dividing "
                    f"num_kv_heads={self.spec.num_kv_heads} whose {self.spec.q_per_kv} query rows each fit the MMA's "
                    f"{self.config.rows} rows); use pack_heads={most} or None")
        return None

    def _tile_reason(self, block_n: int) -> str | None:
        """Why a tile of ``block_n`` tokens does not fit this spec's channel-wise groups, or None."""
        for name, group in (("k", self.config.key_tokens), ("v", self.config.value_tokens)):
            if group and group % block_n and not (group == HALF_TILE_GROUP and block_n == 2 * group):
                return (f"block_n={block_n} must divide {name}'s channel-wise group of {group} tokens (a tile lies in "
                        "one group), or be twice a group of 16; use block_n=32")
        return None

    def plan_for(self, dtype: torch.dtype) -> Plan:
        """The plan ``dtype`` queries run (`lower.gluon_plan`; InputError for a dtype the kernel does not take)."""
        if dtype not in self.plans:
            raise InputError(f"dtype={dtype}: the register-operand kernel takes {list(self.plans)} queries")
        return self.plans[dtype]

    @property
    def merge_in_decode(self) -> bool:
        """Whether eager calls that fit one wave merge their splits inside the decode kernel (split_merge.py); False:
        every call launches the merge kernel after it. Setting it drops the memo of bound calls, whose entries hold
        one way or the other (prepared runs look at it per call)."""
        return self._merge_in_decode

    @merge_in_decode.setter
    def merge_in_decode(self, value: bool) -> None:
        self._merge_in_decode = bool(value)
        self._eager.clear()

    @property
    def default_block_n(self) -> int:
        """Tokens per tile when neither the call's options nor a tuned bucket say otherwise."""
        return self._defaults["block_n"]

    @property
    def default_stages(self) -> int:
        return self._defaults["stages"]

    def launch_config(self, dtype: torch.dtype, batch: int, tokens: int, device=None) -> dict:
        """block_n / stages / maxnreg / split factor for this call on ``device`` (its tensors' device, whose GPU's
        tuned entry applies; None: the current GPU's), memoised per shape bucket."""
        bucket = (dtype, batch, tokens, device)
        if bucket not in self._configs:
            opts = dict(self._defaults)
            if not TUNED_OPTIONS <= set(self.explicit):   # some option is left to the tuning cache
                from ..runtime.tuning import lookup

                tuned = lookup(self.spec, dtype, batch, tokens, kernel="gluon", device=device)
                reason = None if tuned is None else (self._tile_reason(tuned.block_n)
                                                     or (tuned.pack_heads and self._pack_reason(tuned.pack_heads)))
                if reason:   # an entry tuned for another kernel build (or damaged): the defaults run
                    warnings.warn(f"foldc tuning cache: the entry for {self.spec.describe()} at batch {batch}, "
                                  f"{tokens} tokens is ignored ({reason})", RuntimeWarning, stacklevel=3)
                    tuned = None
                if tuned is not None:
                    opts.update(block_n=tuned.block_n, stages=tuned.stages, maxnreg=tuned.maxnreg,
                                split_factor=tuned.split_factor, heads=tuned.pack_heads or self.heads)
            opts.update(self.explicit)
            if self.dynamic_tiles:   # a tuned bucket's stages give way: dynamic tiles copy one tile ahead
                opts["stages"] = 2
            opts["constexprs"] = constexprs(self.config, opts["block_n"], opts["stages"], opts["heads"],
                                           opts["scale_ahead"], self.dynamic_tiles)
            self._configs[bucket] = opts
        return self._configs[bucket]

    def _kernels(self):
        if self._modules is None:
            from . import kernel

            merge = load_module("import triton\nimport triton.language as tl\n" + MERGE_SOURCE, interpret=False)
            self._modules = (kernel.foldc_decode_gluon, merge.foldc_merge)
        return self._modules

    def with_decode_kernel(self, decode) -> "GluonAttention":
        """A copy of this launcher that runs ``decode`` (a Gluon kernel with the arguments of kernel.py's
        ``foldc_decode_gluon``: an A/B variant kept in benchmarks/) instead of the production kernel,
        with the same merge kernel, options and plan; its residency and launches are worked out anew."""
        other = copy.copy(self)
        other._modules = (decode, self._kernels()[1])
        other._fast, other._variants, other._launches, other._configs = None, {}, {}, dict(self._configs)
        other._bindings = Bindings()
        other._eager = EagerCalls()
        other._scratch = Scratch()
        other.warpgroup = None   # the variant is the one-warp program's
        other.merge_in_decode = self.merge_in_decode and "MERGE" in getattr(decode, "arg_names", ())
        return other

    def _launchers(self):
        """The two kernels behind `FastLaunch` (rebuilt when ``_modules`` is swapped, as the
        benchmarks do to time a variant kernel)."""
        modules = self._kernels()
        if self._fast is None or self._fast[0] is not modules:
            self._fast = (modules, tuple(FastLaunch(k) for k in modules))
            self._bindings.clear()
            self._eager.clear()
        return self._fast[1]

    def __call__(self, q, k, v, sm_scale=None, seq_lens=None, out: torch.Tensor | None = None,
                 return_lse: bool = False):
        """Same call as foldc.compile(...)'s other targets: q [batch, num_q_heads, head_dim] bf16 or fp16
        on the GPU, k and v AffineTensors of the spec's encodings (a plain side in q's dtype); returns out
        (and the lse if asked)."""
        if seq_lens is None and not return_lse:   # a call shaped as one bound before: its launches at once
            done = self._eager.run(self, q, k, v, sm_scale, out)
            if done is not None:   # (k and v are AffineTensors here: q alone may record gradients)
                return done if not q.requires_grad else without_backward(done, q, ATTENTION_KERNEL, ATTENTION_FIX)
        call = check_call(self.spec, q, k, v, sm_scale, seq_lens, q_dtypes=DTYPES, out=out)
        device = q.device
        if device.type != "cuda":
            raise InputError(f"the register-operand kernel runs on a CUDA GPU; q is on {device}. Use "
                             "target='interpret' (CPU, fp16) or 'reference'")
        for name, x in (("k", k), ("v", v)):
            if isinstance(x, torch.Tensor):   # a plain side: rows in q's dtype, read as 32-bit words
                if x.dtype != q.dtype:
                    raise InputError(f"{name} dtype={x.dtype}: the register-operand kernel reads a plain side in the "
                                     f"queries' dtype ({q.dtype}); pass {name}.to({q.dtype})")
                if not x.is_contiguous() or x.data_ptr() % 16:
                    raise InputError(f"{name} must be contiguous and 16-byte aligned (strides {x.stride()}); call "
                                     ".contiguous() on it first")
                continue
            for t in (x.codes, x.scale, x.zero):
                if not t.is_contiguous():
                    raise InputError(f"{name} must be contiguous (a part of it has strides {t.stride()}); "
                                     "call .contiguous() on it first")
            if x.codes.data_ptr() % 4:
                raise InputError(f"{name}.codes starts at an address not divisible by 4; the kernel reads "
                                 "32-bit words: pass a tensor that owns its storage (e.g. .clone())")
        if q.stride(-1) != 1:
            raise InputError(f"q must have unit stride along head_dim; got strides {q.stride()}")
        # no lengths: the kernel reads none (no fill and cast kernels before it, which count at batch 1)
        has_lens = call.seq_lens is not None
        launch = self.plan_launch(q.dtype, call.batch, call.tokens, device, has_lens=has_lens, k=k, v=v)
        lens = call.seq_lens.to(device=device, dtype=torch.int32) if has_lens else None
        given = out
        out = output_buffer(out, (call.batch, self.spec.num_q_heads, self.config.head_dim), q)
        # the buffers of this stream's last call, unless the lse goes to the caller (`Scratch`)
        workspace, lse = self._scratch.get(launch, device, (call.batch, self.spec.num_q_heads), fresh=return_lse)
        self.run(launch, q, k, v, out, lse, call.sm_scale, seq_lens=lens, workspace=workspace)
        if not has_lens and not return_lse and not capturing(q):   # bound by now? then later calls find it
            self._eager.note(self, launch, q, k, v, sm_scale, given, workspace, lse,
                             lambda merging: binding_key(launch.options, q, k, v, None, out, call.sm_scale,
                                                         launch.per_split, launch.splits, None, merging))
        result = (out, lse) if return_lse else out
        if q.requires_grad or (isinstance(k, torch.Tensor) and k.requires_grad) or (
                isinstance(v, torch.Tensor) and v.requires_grad):   # no backward: one through it raises by name
            return without_backward(result, (q, k, v), ATTENTION_KERNEL, ATTENTION_FIX)
        return result

    def plan_launch(self, dtype: torch.dtype, batch: int, tokens: int, device, *, has_lens: bool = False,
                    page: int = 0, k=None, v=None) -> Launch:
        """The `Launch` of a call with ``dtype`` queries, ``batch`` sequences and ``tokens`` cached
        tokens per sequence (a page table's most, with ``page`` tokens per page), memoised: the tuned
        or default options of its shape bucket (`launch_config`) and its splits (`split_plan`).
        ``has_lens``: the call passes per-sequence lengths. ``k``, ``v``: the contiguous cache the
        launch will read, where the spec takes the warpgroup template (the ``warpgroup`` attribute):
        if they suit it (`WarpgroupLaunch.takes`), the launch is the template's ("gluon-warpgroup")."""
        warpgroup = (self.warpgroup is not None and not page and k is not None and v is not None
                     and self.warpgroup.takes(k, v))
        key = (dtype, batch, tokens, has_lens, page, device, warpgroup)   # torch.device hashes without a str()
        launch = self._launches.get(key)
        if launch is None and warpgroup:
            launch = self._launches[key] = self.warpgroup.plan_launch(dtype, batch, tokens, device, has_lens)
        if launch is None:
            opts = self.launch_config(dtype, batch, tokens, device)
            splits, per_split = self.split_plan(opts, batch, tokens, device, dtype, has_lens, page)
            launch = Launch("gluon", dtype, batch, self.head_programs(opts), splits, per_split, opts["block_n"],
                            per_split * splits if page else tokens, self.config.rows, self.config.head_dim, page,
                            has_lens, opts)
            self._launches[key] = launch
        return launch

    def run(self, launch: Launch, q, k, v, out, lse, sm_scale: float, *, seq_lens=None, workspace=None,
            paged: tuple | None = None, tokens: int | None = None) -> None:
        """Launch ``launch`` (from `plan_launch`) into ``out`` and ``lse``, no checks and no host sync (callers
        validate): ``seq_lens`` int32 device lengths where the launch has them, ``workspace`` its
        three float32 buffers (allocated here if None), ``paged`` (kv_indptr, kv_indices) when k and
        v are page pools (foldc/serving/paged.py). ``tokens``: for a contiguous launch without lengths, the
        tokens every sequence holds (0 .. ``launch.cache_tokens``; by default all of them): a cache that grows
        a token per step runs one launch plan and one bound launch at every length, with no lengths tensor
        to refill (the kernels take the count per call, unspecialised)."""
        ws = workspace if workspace is not None else allocate_workspace(launch, q.device)
        count = launch.cache_tokens if tokens is None else tokens
        if not 0 <= count <= launch.cache_tokens or paged is not None and tokens is not None:
            raise InputError(f"tokens={tokens}: a launch planned for {launch.cache_tokens} cached tokens runs over 0 .. "
                             f"{launch.cache_tokens} of them (contiguous caches only; pass seq_lens for pages)")
        if launch.kernel == "gluon-warpgroup":
            self.warpgroup.run(launch, q, k, v, seq_lens, sm_scale, out, lse, ws, self._launchers()[1], count)
            return
        self.launch(launch.options, q, k, v, seq_lens, ws, out, lse, sm_scale, launch.per_split, launch.splits,
                    count, None if paged is None else (*paged, launch.page))

    def prepare(self, launch: Launch, k, v, workspace, lse, sm_scale: float, *, seq_lens=None,
                paged: tuple | None = None) -> PreparedRun:
        """A repeated `run` of ``launch`` over ``k``, ``v``, ``workspace`` and ``lse`` (and ``seq_lens``, and the
        page table ``paged`` = (kv_indptr, kv_indices) of a paged launch), which must stay where they are while it is
        used: `PreparedRun` (a serving cache's decode steps, `PagedDecodeWrapper.run`)."""
        return PreparedRun(self, launch, k, v, workspace, lse, sm_scale, seq_lens, paged)

    def split_plan(self, launch: dict, batch: int, tokens: int, device, q_dtype: torch.dtype = torch.bfloat16,
                   has_lens: bool = False, page: int = 0) -> tuple[int, int]:
        """(splits, tokens per split) for ``tokens`` cached tokens: whole tiles per split; unless the
        call fixed the split count, as many as fill the launch's ``split_factor`` waves of resident
        programs (`wave_splits`; ``q_dtype``, ``has_lens``, ``page``: the kernel variant it runs)."""
        block_n, hkv = launch["block_n"], self.head_programs(launch)
        splits = self.splits
        if splits is None:
            resident = self.resident(launch, q_dtype, has_lens, page, device)
            # channel-wise groups of 16 tokens reload their parameters every tile: a program's fixed work is
            # small beside its tiles, and longer splits made them 18% slower at 1 x 16K (H100, docs/perf.md)
            half_tiles = HALF_TILE_GROUP in (self.config.key_tokens, self.config.value_tokens)
            splits = wave_splits(batch * hkv, tokens, block_n, num_sms(device), resident, launch["split_factor"],
                                 0 if half_tiles else MIN_SPLIT_TOKENS)
        used, per_split = split_partition(tokens, splits, block_n)
        if draws_tiles(launch):   # no more programs than chunks; each draws what it runs
            chunks = math.ceil(math.ceil(tokens / block_n) / launch["constexprs"]["CHUNK"])
            return max(1, min(splits, chunks)), per_split
        return used, per_split

    def resident(self, launch: dict, q_dtype: torch.dtype, has_lens: bool, page: int, device,
                 merged: bool = False) -> int:
        """Programs of this launch's kernel one SM holds at once (`resident_programs`), from its
        compiled register and shared-memory use; compiled once per variant (no launch). fp16 and bf16
        queries share the bf16 build's figures (the query dtype changes a load's conversion and a plain
        side's view, not the registers: equal counts in the AOT builds), so a wrapper that plans both
        dtypes compiles one variant. The ``merged`` build's figures are ``q_dtype``'s own: they size a cooperative
        launch, which the driver refuses where one program too many would have to wait, and that build stores the
        output in the query's dtype."""
        build_dtype = q_dtype if merged else torch.bfloat16
        key = ("resident", has_lens, page) + ((True, build_dtype) if merged else ())
        if key not in launch:
            # one compile per kernel variant, shared by every shape bucket that runs it (a growing
            # cache makes a new bucket at each decode step)
            variant = (tuple(sorted(launch["constexprs"].items())), launch["maxnreg"], has_lens, page, str(device),
                       merged, build_dtype)
            if variant not in self._variants:
                args, kwargs = self.mock_arguments(launch, build_dtype, has_lens, page, merged)
                with torch.cuda.device(device):
                    compiled = self._kernels()[0].warmup(*args, grid=(1, 1, 1), **kwargs)
                    compiled._init_handles()
                props = torch.cuda.get_device_properties(device)
                max_shared = getattr(props, "shared_memory_per_multiprocessor", 233472)
                self._variants[variant] = (resident_programs(compiled.n_regs, compiled.metadata.shared, max_shared),
                                           compiled.n_regs)
            launch[key], launch[("registers",) + key[1:]] = self._variants[variant]
        return launch[key]

    def mock_arguments(self, launch: dict, q_dtype: torch.dtype, has_lens: bool, page: int,
                       merged: bool = False) -> tuple[tuple, dict]:
        """The decode kernel's arguments for one sequence with no memory behind them (`mock_decode_arguments`):
        enough to compile the variant a call would run."""
        return mock_decode_arguments(self.spec, self.config, launch, q_dtype, has_lens, page, merged)

    def head_programs(self, launch: dict) -> int:
        """Programs per sequence and split (the grid's second axis): one per group of ``launch["heads"]``
        packed KV heads, or ``row_blocks`` per KV head when its query rows exceed the MMA's N axis."""
        return self.spec.num_kv_heads // launch["heads"] * self.config.row_blocks

    def workspace(self, launch: dict, batch: int, splits: int, device) -> tuple[torch.Tensor, ...]:
        """Per-split (max, denominator, accumulator): H packed KV heads are one head of H x q_per_kv
        rows for the workspace and the merge."""
        return allocate_workspace(Launch("gluon", torch.bfloat16, batch, self.head_programs(launch), splits, 0,
                                         launch["block_n"], 0, self.config.rows, self.config.head_dim), device)

    def merges_inside(self, launch: dict, q, splits: int, contiguous_out: bool, paged: tuple | None = None,
                      has_lens: bool = False) -> bool:
        """Whether a call merges its splits inside the decode kernel (split_merge.py, one cooperative launch)
        rather than in the merge kernel: eager calls (not under CUDA-graph capture, where the merge kernel's
        programmatic dependent launch costs no host time) on a contiguous cache, without dynamic tiles, row blocks
        or ragged rows, into a contiguous output, whose grid fits one wave of the merging build's resident programs
        and holds at most `MERGE_MOST_PROGRAMS` (past that its barrier costs more GPU time than a launch saves)."""
        if (not self.merge_in_decode or paged is not None or draws_tiles(launch) or q.device.type != "cuda"
                or self.config.row_blocks != 1 or self.config.head_rows or self.config.head_dim % 8
                or not contiguous_out or capturing(q)):
            return False
        programs = q.shape[0] * self.head_programs(launch) * splits
        if programs > MERGE_MOST_PROGRAMS:
            return False
        resident = self.resident(launch, q.dtype, has_lens, 0, q.device, merged=True)
        return programs <= resident * num_sms(q.device)

    def barrier(self, q, groups: int) -> torch.Tensor:
        """The merging launches' int64 barrier counters on q's device and current stream (split_merge.py): zeros,
        which every call leaves as it found them, at least ``2 + groups`` of them."""
        key = (q.device, stream_handle(q.device))   # the raw handle, as prepared runs compare it
        held = self._barriers.setdefault(key, [])
        if not held or held[-1].numel() < BARRIER_FIXED + groups:   # a larger one; the smaller ones stay alive,
            # since bound calls and prepared runs hold their addresses
            held.append(torch.zeros(BARRIER_FIXED + max(groups, 64), device=q.device, dtype=torch.int64))
        return held[-1]

    def launch(self, launch: dict, q, k, v, lens, ws, out, lse, sm_scale: float, per_split: int, splits: int,
               cache_tokens: int, paged: tuple | None = None) -> None:
        """Launch the decode and merge kernels, no checks (callers validate). ``lens``: int32 device
        lengths or None (every sequence holds ``cache_tokens``); ``paged``: (kv_indptr, kv_indices,
        page_size) when k and v are page pools (foldc/serving/paged.py). Where `merges_inside` says so, the decode
        kernel merges its splits itself: one launch."""
        decode, merge = self._launchers()
        now_capturing = capturing(q)
        bindable = not now_capturing and not draws_tiles(launch)
        merging = not now_capturing and self.merges_inside(launch, q, splits, out.is_contiguous(), paged,
                                                           lens is not None)
        merged = (out, lse, self.barrier(q, q.shape[0] * self.head_programs(launch))) if merging else None
        if bindable:   # later calls with one launch's integers, strides and dtypes: its bound kernels (the
            # token count given per call: the kernel does not specialise on it; a page table's addresses too)
            key = binding_key(launch, q, k, v, lens, out, sm_scale, per_split, splits, paged, merging)
            state = self._bindings.get(key, launch)
            if type(state) is tuple and run_bound(state, decode_addresses(q, k, v, lens, ws, paged, merged), merge,
                                                  ws, out, lse, self.config.q_per_kv * launch["heads"],
                                                  (cache_tokens,), self.config.head_rows):
                return
        check_offsets("register-operand decode kernel", decode_offsets(q, k, v, ws, paged), DECODE_FIX)
        counters = None
        if draws_tiles(launch):   # one tile counter per (batch, head group), zeroed each call
            counters = torch.zeros(q.shape[0] * self.head_programs(launch), device=q.device,
                                   dtype=torch.int32)
        args, kwargs = self.decode_arguments(launch, q, k, v, lens, ws, sm_scale, per_split, cache_tokens, paged,
                                             counters, merged)
        grid = (q.shape[0], self.head_programs(launch), splits)
        try:
            decode[grid](*args, **kwargs)
        except RuntimeError as err:
            if not merging or "cooperative" not in str(err).lower():   # (the driver's "too many blocks in
                raise                                                      # cooperative launch", or the code's name)
            # the driver holds fewer programs at once than the SMs x the build's residency promise (MPS's share of
            # the SMs, a green context): the kernel never ran; this launcher keeps two launches from now on
            warnings.warn(f"foldc: the decode that merges its splits inside was refused as a cooperative launch of "
                          f"{math.prod(grid)} programs ({err}); this launcher launches the merge kernel from now on "
                          "(merge_in_decode = False)", RuntimeWarning, stacklevel=3)
            self.merge_in_decode = False
            return self.launch(launch, q, k, v, lens, ws, out, lse, sm_scale, per_split, splits, cache_tokens, paged)
        if merging:
            if bindable:
                self._bindings.note(key, launch, state,
                                    lambda: (decode.bind(grid, args, kwargs, dynamic=(TOKENS_ARG,)),))
            return
        # PDL under CUDA-graph capture only: launched eagerly, the programmatic dependent merge cost
        # ~44 µs of GPU time per call at INT2 1 x 16K (H200, ninth session: `git show 6178656:docs/perf.md`)
        merge_grid, merge_args, merge_kwargs = merge_arguments(*ws, out, lse, self.config.q_per_kv * launch["heads"],
                                                               pdl=self.pdl and now_capturing,
                                                               head_rows=self.config.head_rows)
        merge[merge_grid](*merge_args, **merge_kwargs)
        if bindable:
            self._bindings.note(key, launch, state, lambda: (decode.bind(grid, args, kwargs, dynamic=(TOKENS_ARG,)),
                                                              merge.bind(merge_grid, merge_args, merge_kwargs)))

    decode_arguments = staticmethod(decode_arguments)   # the kernel's arguments for one call (decode_args.py)
