"""One layer's KV cache: a quantized body plus plain sink and recent-window tokens.

Token order in the cache::

    [ sink (first `sink` tokens, model dtype) | body (quantized per spec.k / spec.v) | recent (model dtype) ]

New tokens fill the sink first, then join the recent window. When the window holds more than
``window`` tokens, the oldest ones are flushed into the body by the quantize-on-append kernel
(`foldc.serving.append_quantized`): token-wise encodings at once, channel-wise encodings only in
whole groups (every flush is a multiple of ``unit``, the least common multiple of the channel-wise
group sizes of K and V, so that K and V bodies hold the same tokens and every body group is
complete). The recent window may thus hold up to ``window + unit - 1`` tokens.

Attention over the whole cache is the quantized body's attention (``foldc.compile(spec)``) merged
with the plain attention over sink + recent (one plain operand: the sink and the recent tokens
sit next to each other in one buffer) by log-sum-exp (`foldc.merge_attention`, eq. 14). Keys
carry no position here (rotary embeddings are applied before caching), so the split into parts
does not change the result.

Bad values: an append of several tokens (a prefill), or one that fills the sink, is checked for NaN/Inf
and scale overflow before anything is written (one device sync). Any other one-token append (a decode
step) reads nothing back: the append kernel that quantizes a token into the body stores a flag where a
scale or zero is not finite, straight into pinned host memory on a GPU (no copy, no sync), and the cache's
next call (or `QuantizedKVCache.check`) raises; a token the window or a filling channel-wise group keeps
plain is flagged when it moves to the body: by the kernel's flag when a one-token append moves it, by a
host check of what is written when an append of several tokens moves it (one more sync, only once a
one-token append has left an unchecked token plain).
"""
from __future__ import annotations

import functools
import math
import os

import torch

from ..backends.runtime.fast_launch import Bindings
from ..backends.runtime.launch import RAW_STREAM, STREAM_CAPTURING, Scratch, stream_handle
from ..compile import TARGETS as COMPILE_TARGETS
from ..compile import compile as compile_attention
from ..decisions import GroupAxis
from ..targets import detect_target
from ..encoding import AffineTensor, scale_shape
from ..errors import InputError, InputTypeError, SpecError
from ..merge import merge_parts
from ..plan import plan_of
from ..spec import AttentionSpec
from ..validate import ATTENTION_FIX, check_sm_scale, without_backward
from .append import (OFFSET_ARG, append_arguments, append_quantized, check_finite, plan_append, resolve_target,
                     run_append, safe_abs_limit)
from .inputs import check_new_tokens, count, mapped_flag, resolve_device
from .part_merge import merge_two_parts

_TENSOR = torch.Tensor
_CAPTURING = STREAM_CAPTURING
_STREAM = RAW_STREAM

MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=64)
def compiled_attention(spec: AttentionSpec, target: str):
    """``foldc.compile(spec, target)``, once per (spec, target) and shared by every cache that asks: a
    model's layers hold one spec, and each compile plans, proves and lowers it again (16 layers' compiles
    took 1.0 of the 1.85 s of host time of a 16-token generate of a 1B model on the H200,
    benchmarks/hf_step_profile.py). The kernels keep no state of a call that another call could see:
    the caches pass their own workspaces."""
    return compile_attention(spec, target)


class QuantizedKVCache:
    """One layer's KV cache for decode attention with ``spec``.

    Args:
        spec: the attention and its K/V encodings (a None encoding keeps that operand plain).
        batch: sequences (all of one length: ragged/paged batches are not handled here).
        capacity: most tokens per sequence (sink + body + recent).
        sink: first tokens kept plain forever (attention sinks).
        window: most recent tokens kept plain (channel-wise encodings keep up to group_size - 1 more).
        device, dtype: where and in which model dtype (float16, bfloat16, float32) tokens arrive.
        target: attention and append target: "auto" (GPU kernels on CUDA, the interpreter on the
            CPU), "sm_90", "sm_100", "interpret" (CPU, float16 only) or "reference" (float64
            executor; foldc.quantize for appends).
    """

    def __init__(self, spec: AttentionSpec, batch: int, capacity: int, *, sink: int = 0, window: int = 0,
                 device="cpu", dtype: torch.dtype = torch.float16, target: str = "auto"):
        if not isinstance(spec, AttentionSpec):
            raise SpecError(f"spec must be a foldc.AttentionSpec, got {type(spec).__name__}")
        self.spec = spec
        self.batch = count("batch", batch, 1)
        self.capacity = count("capacity", capacity, 1)
        self.sink = count("sink", sink, 0)
        self.window = count("window", window, 0)
        if dtype not in MODEL_DTYPES:
            raise SpecError(f"dtype={dtype} is not supported; use one of {list(MODEL_DTYPES)}")
        self.dtype = dtype
        self.device = resolve_device(device)
        if target not in COMPILE_TARGETS:
            raise SpecError(f"target={target!r} is not available; use one of {COMPILE_TARGETS}")
        given = target
        if target == "auto":
            target = "interpret" if self.device.type == "cpu" else detect_target()
        if target == "interpret" and (self.device.type != "cpu" or dtype != torch.float16):
            raise SpecError(f"target={given!r} runs Triton's interpreter, float16 on the CPU; got dtype={dtype} on "
                            f"{self.device}. Use dtype=torch.float16 and device='cpu', or target='reference'")
        if target in ("sm_90", "sm_100") and dtype == torch.float32:
            raise SpecError(f"target={target!r} attends with float16 or bfloat16 tokens; got dtype={dtype}. "
                            "Use dtype=torch.float16 or torch.bfloat16, or target='reference'")
        self.target = target
        self._plan = plan_of(spec)
        self.unit = self._plan.token_alignment   # the lcm of the channel-wise groups' sizes (1 if none)
        self.body_capacity = self.capacity - min(self.sink, self.capacity)
        self.plain_capacity = min(self.capacity, self.sink + self.window + self.unit - 1)
        hkv, d = spec.num_kv_heads, spec.head_dim
        self._body = {name: self._allocate_body(getattr(spec, name)) for name in ("k", "v")}
        self._plain = {name: torch.zeros(self.batch, hkv, self.plain_capacity, d, dtype=dtype, device=self.device)
                       for name in ("k", "v")}
        plain_spec = AttentionSpec(spec.num_q_heads, hkv, d)
        # compiled up front: a spec the target cannot run fails here, not at the first decode step
        self._body_attention = compiled_attention(spec, target)
        self._plain_attention = compiled_attention(plain_spec, target)
        # per part: a device tensor of its length (refilled when the length changes, not per call) and the
        # kernel's workspace between calls
        self._lens: dict = {}
        self._scratch = {"body": Scratch(), "plain": Scratch()}
        self._part_launches: dict = {}   # (part, query dtype) -> its attention's Launch
        self._prepared: dict = {}   # (part, query dtype, softmax scale, stream) -> its attention's prepared run
        self._write_addresses: dict = {}   # the body writes' bound launches: their storage's addresses
        # a decode step's repeated calls (`append`, `attention`): what the whole path checked and found for the
        # last one-token write and body-only attention whose launches were bound (see `_token_write`, `_attend`)
        self._token_write = None
        self._attend = None
        self._last_prepared = None
        self._q_shape = (self.batch, spec.num_q_heads, spec.head_dim)
        self._what = f"QuantizedKVCache.attention with target={target!r}"   # (a backward through it raises)
        # the body's appends: the largest |value| below which no group can overflow its scale dtype (above
        # it, the exact check of append_quantized), and the append kernel's launch per (operand, tokens)
        self._safe_abs = {name: safe_abs_limit(enc.scale_dtype) for name in ("k", "v")
                          if (enc := getattr(spec, name)) is not None}
        self._append_mode = resolve_target(target, self.device) if target != "reference" else "reference"
        self._append_launches: dict = {}
        self._append_bindings = Bindings(64)   # the body writes' bound launches (the offset given per call)
        # keys and values of token-wise encodings (one, or one each): one append launch writes both (`_write_bodies`)
        self._pair = all(enc is not None and GroupAxis.of(enc) is GroupAxis.CHANNEL for enc in (spec.k, spec.v))
        # one-token appends: the append kernels' flag (1: a scale or zero written that is not finite). On a GPU
        # it lives in pinned host memory that the kernels write through its device address (`mapped_flag`):
        # the host reads it with no copy and no sync; else (no mapping) a device flag copied after each append
        self._flag_host = (torch.zeros(1, dtype=torch.int32, pin_memory=True) if self.device.type == "cuda"
                           else torch.zeros(1, dtype=torch.int32))
        mapped = mapped_flag(self._flag_host, self.device) if self.device.type == "cuda" else None
        self._flag_mapped = mapped is not None
        self._flag = (mapped if mapped is not None else self._flag_host if self.device.type == "cpu"
                      else torch.zeros(1, dtype=torch.int32, device=self.device))
        self._flag_seen = self._flag_host.numpy()
        self._flag_copied = False   # since the last reset: a copy of the flag issued, or (mapped) a flagging write
        self.reset()

    def _allocate_body(self, enc):
        b, h, n, d = self.batch, self.spec.num_kv_heads, self.body_capacity, self.spec.head_dim
        if enc is None:
            return torch.zeros(b, h, n, d, dtype=self.dtype, device=self.device)
        # zeros, not empty: the attention kernel reads whole tiles, and scales past the body must be finite
        return AffineTensor(torch.zeros(b, h, n, d // enc.codes_per_byte, dtype=torch.uint8, device=self.device),
                            torch.zeros(scale_shape(enc, b, h, n, d), dtype=enc.scale_dtype, device=self.device),
                            torch.zeros(scale_shape(enc, b, h, n, d), dtype=enc.scale_dtype, device=self.device),
                            enc, d)

    def _lengths(self, name: str, n: int) -> torch.Tensor:
        """int32 [batch] device tensor of ``n``, the token count of part ``name``, for the kernel; kept
        between calls and refilled when ``n`` changes (inside a CUDA-graph capture: a new tensor)."""
        held = self._lens.get(name)
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.full((self.batch,), n, dtype=torch.int32, device=self.device)
        if held is None:
            held = self._lens[name] = [-1, torch.empty(self.batch, dtype=torch.int32, device=self.device)]
        if held[0] != n:
            held[1].fill_(n)
            held[0] = n
        return held[1]

    # ---- state --------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every token (storage is kept and overwritten by later appends)."""
        self._sink_len = 0
        self._body_len = 0
        self._recent_len = 0
        self._ring_head = 0  # a ring window (`_ring`): the slot of its oldest token
        self._max_abs = 0.0  # largest |value| appended since reset (decides the overflow check)
        self._deferred = False   # this append: checked by the append kernel's flag (one token, native kernels)
        # a one-token append (checked only by the flag of the kernel that quantizes it) left a token plain in the
        # window or a filling channel-wise group: an append of several tokens that moves it to the body checks it
        self._plain_unchecked = False
        self._flag_written = False   # this append: a body write stored to the flag
        if self._flag_copied:   # an old flag's copy (or a kernel's write) still on its way would land on the zero
            torch.cuda.synchronize(self.device)
            self._flag_copied = False
        self._flag_host.zero_()
        if not self._flag_mapped and self._flag is not self._flag_host:
            self._flag.zero_()

    def check(self) -> None:
        """Raise InputError if a one-token append wrote a scale or zero that is not finite (waits for the
        append kernels: a sync). Each call of the cache raises the same way without a sync, once the
        kernel's write has reached host memory."""
        if self._flag_mapped:   # every kernel's write has landed
            torch.cuda.synchronize(self.device)
        elif int(self._flag.item()):
            self._flag_host.fill_(1)
        self._raise_if_flagged()

    def _raise_if_flagged(self) -> None:
        if self._flag_seen[0]:
            raise InputError(
                "a one-token append held NaN or Inf, or a value whose scale or zero overflows the encoding's scale "
                "dtype: the append kernel found a scale or zero that is not finite after writing it, and attention "
                "over that token is NaN. Check the layer that produced those keys or values and reset() the cache; "
                "appends of several tokens are checked before anything is written")

    @property
    def num_tokens(self) -> int:
        return self._sink_len + self._body_len + self._recent_len

    @property
    def sink_tokens(self) -> int:
        return self._sink_len

    @property
    def body_tokens(self) -> int:
        return self._body_len

    @property
    def window_tokens(self) -> int:
        return self._recent_len

    # ---- append -------------------------------------------------------------------------------

    def _check_tokens(self, name: str, x) -> None:
        check_new_tokens(name, x, self.batch, self.spec, self.dtype, self.device)

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Add ``T`` tokens, ``k_new`` and ``v_new`` of shape [batch, kv_heads, T, head_dim].

        All checks (shapes, dtype, device, capacity and, for several tokens, NaN/Inf and scale
        overflow) run before any counter moves: a rejected append leaves the cache as it was. A
        one-token append is checked by the kernel that quantizes it (the module's "Bad values")."""
        fast = self._token_write
        if (fast is not None and type(k_new) is _TENSOR and type(v_new) is _TENSOR and not self._flag_seen[0]
                and self._sink_len >= self.sink and self._sink_len + self._body_len < self.capacity
                and k_new.shape == fast[0] and v_new.shape == fast[0] and k_new.stride() == fast[1]
                and v_new.stride() == fast[2] and k_new.dtype == fast[3] and v_new.dtype == fast[3]
                and k_new.get_device() == fast[4] and v_new.get_device() == fast[4]
                and fast[5]((k_new.data_ptr(), *fast[6], v_new.data_ptr(), *fast[7]), (self._body_len,))):
            # a decode step shaped as the last one the whole path wrote with its bound pair launch (`_launch_write`)
            self._body_len += 1
            self._deferred = True
            self._flag_copied_after_write()
            return
        self._raise_if_flagged()
        self._check_tokens("k_new", k_new)
        self._check_tokens("v_new", v_new)
        tokens = k_new.shape[2]
        if v_new.shape[2] != tokens:
            raise InputError(f"k_new holds {tokens} tokens but v_new holds {v_new.shape[2]}; they must match")
        if self.num_tokens + tokens > self.capacity:
            raise InputError(f"appending {tokens} tokens to {self.num_tokens} would hold {self.num_tokens + tokens} "
                             f"but capacity={self.capacity}; build the cache with a larger capacity or reset() it")
        if tokens == 0:
            return
        # one token past the sink: the append kernel's flag (`_write_body`; a token of the sink is never
        # quantized); else max |x| of both (NaN where one holds a NaN, inf for an Inf) in one fused op and one
        # device sync
        self._deferred = tokens == 1 and self._sink_len >= self.sink and self._append_mode != "reference"
        if not self._deferred:
            peaks = torch.stack(torch._foreach_norm([k_new, v_new], math.inf)).tolist()
            for name, x, peak in (("k_new", k_new, peaks[0]), ("v_new", v_new, peaks[1])):
                if not math.isfinite(peak):
                    check_finite(x, name)  # raises, naming the first NaN/Inf
            self._max_abs = max(self._max_abs, *peaks)
        if self._deferred and not self.window and self.unit == 1:   # a decode step: the token goes to the body
            self._write_bodies(k_new, v_new)
            self._body_len += 1
        else:
            if self._ring:
                self._append_ring(k_new, v_new, tokens)
            else:
                self._append_shift(k_new, v_new, tokens)
            self._plain_unchecked |= self._deferred   # (the new token stays plain, or came after one that did)
            if not self._deferred and tokens >= self.window + self.unit:   # every token kept plain before has moved
                self._plain_unchecked = False                             # to the body, checked: no sync from now
        if self._flag_written:   # the flag in host memory, no sync (read by the next call)
            self._flag_written = False
            self._flag_copied_after_write()

    def _flag_copied_after_write(self) -> None:
        if self._flag_mapped:   # the kernel writes it there itself
            self._flag_copied = True
        elif self._flag_host is not self._flag:
            self._flag_host.copy_(self._flag, non_blocking=True)
            self._flag_copied = True

    def _append_shift(self, k_new: torch.Tensor, v_new: torch.Tensor, tokens: int) -> None:
        """`append` (checked) with the recent window shifted: sink first, then whole units of the oldest
        tokens to the body, the rest to the window's end."""
        n_sink = min(tokens, self.sink - self._sink_len)
        rest = tokens - n_sink
        total = self._recent_len + rest  # recent tokens before the flush
        flush = ((total - self.window) // self.unit) * self.unit if total > self.window else 0
        from_recent = min(flush, self._recent_len)
        from_new = flush - from_recent

        # 1. flush into the body (writes past body_len only: invisible until the counters move)
        if flush:
            srcs = []
            for name, new in (("k", k_new), ("v", v_new)):
                src = new if from_new == tokens else new[:, :, n_sink:n_sink + from_new]
                if from_recent:
                    old = self._plain[name][:, :, self.sink:self.sink + from_recent]
                    src = torch.cat([old, src], dim=2) if from_new else old
                srcs.append(src)
            self._write_bodies(*srcs)
        # 2. sink, then the recent window (kept tokens shift to the front of the window)
        keep = self._recent_len - from_recent
        for name, new in (("k", k_new), ("v", v_new)):
            plain = self._plain[name]
            if n_sink:
                plain[:, :, self._sink_len:self._sink_len + n_sink] = new[:, :, :n_sink]
            if from_recent and keep:
                start = self.sink + from_recent
                plain[:, :, self.sink:self.sink + keep] = plain[:, :, start:start + keep].clone()
            arrive = rest - from_new
            if arrive:
                plain[:, :, self.sink + keep:self.sink + keep + arrive] = new[:, :, n_sink + from_new:]
        self._sink_len += n_sink
        self._body_len += flush
        self._recent_len = keep + rest - from_new

    @property
    def _ring(self) -> bool:
        """Whether the recent window is a ring of ``window`` slots after the sink: with no channel-wise groups
        (flushes of single tokens) the window is always full once it has filled, so its slots are one
        contiguous prefix of the plain buffer with the sink, in some order (attention does not depend on the
        order of the tokens it reads). A step then moves no kept token: the oldest leaves for the body and the
        new one takes its slot."""
        return self.unit == 1 and self.window > 0

    def _ring_parts(self, buffer: torch.Tensor, first: int, count: int) -> list[torch.Tensor]:
        """Views of ``count`` window tokens of ``buffer`` from logical index ``first`` (0: the oldest): one
        run of slots, or two where they wrap."""
        w, base = self.window, self.sink
        start = (self._ring_head + first) % w
        head = min(count, w - start)
        parts = [buffer[:, :, base + start:base + start + head]]
        if count > head:
            parts.append(buffer[:, :, base:base + count - head])
        return parts

    def _append_ring(self, k_new: torch.Tensor, v_new: torch.Tensor, tokens: int) -> None:
        """`append` (checked) with a ring window: sink first, the oldest window tokens (then the oldest new
        ones) to the body, the newest ``window`` into the freed slots."""
        n_sink = min(tokens, self.sink - self._sink_len)
        rest = tokens - n_sink
        count = self._recent_len
        flush = max(0, count + rest - self.window)
        from_recent = min(flush, count)
        from_new = flush - from_recent
        arrive = rest - from_new
        if flush:   # writes past body_len only: invisible until the counters move
            srcs = []
            for name, new in (("k", k_new), ("v", v_new)):
                parts = self._ring_parts(self._plain[name], 0, from_recent) if from_recent else []
                if from_new:
                    parts.append(new[:, :, n_sink:n_sink + from_new] if n_sink or from_new < tokens else new)
                srcs.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
            self._write_bodies(*srcs)
        if n_sink:
            for name, new in (("k", k_new), ("v", v_new)):
                self._plain[name][:, :, self._sink_len:self._sink_len + n_sink] = new[:, :, :n_sink]
        self._ring_head = (self._ring_head + from_recent) % self.window
        count -= from_recent
        if arrive:
            for name, new in (("k", k_new), ("v", v_new)):
                at = n_sink + from_new
                for part in self._ring_parts(self._plain[name], count, arrive):
                    n = part.shape[2]
                    part.copy_(new if n == tokens else new[:, :, at:at + n])
                    at += n
        self._sink_len += n_sink
        self._body_len += flush
        self._recent_len = count + arrive

    def _recent(self, name: str) -> torch.Tensor:
        """The window's tokens of operand ``name`` in token order (a ring's slots rotated)."""
        plain = self._plain[name]
        if not self._ring or self._ring_head == 0:
            return plain[:, :, self.sink:self.sink + self._recent_len]
        return torch.cat(self._ring_parts(plain, 0, self._recent_len), dim=2)

    def _write_bodies(self, k_src: torch.Tensor, v_src: torch.Tensor) -> None:
        """`_write_body` of the keys and then the values; one launch for both where both are token-wise (each in
        its own encoding, each with its own strides) and the append kernel's checks suffice (the pair launch)."""
        if self._plain_unchecked and not self._deferred:
            self._check_unchecked(k_src, v_src)
        if (self._pair and k_src.dtype == v_src.dtype and self._append_mode != "reference"
                and (self._deferred or self._max_abs <= min(self._safe_abs["k"], self._safe_abs["v"]))):
            if k_src.stride(-1) != 1:
                k_src = k_src.contiguous()
            if v_src.stride(-1) != 1:
                v_src = v_src.contiguous()
            self._launch_write("k", k_src, v_src)
            return
        self._write_body("k", k_src)
        self._write_body("v", v_src)

    def _check_unchecked(self, k_src: torch.Tensor, v_src: torch.Tensor) -> None:
        """An append of several tokens moves to the body tokens that one-token appends kept plain unchecked (their
        check is the flag of the append kernel that quantizes them, and this write sets no flag): NaN or Inf among
        them flags the cache, as that kernel would have, and raises before anything is written; their largest
        |value| joins the one that decides the exact overflow check (`_write_body`). One device sync."""
        peaks = torch.stack(torch._foreach_norm([k_src, v_src], math.inf)).tolist()
        if not all(math.isfinite(p) for p in peaks):
            self._flag_host.fill_(1)
            if not self._flag_mapped and self._flag is not self._flag_host:
                self._flag.fill_(1)
            self._raise_if_flagged()
        self._max_abs = max(self._max_abs, *peaks)

    def _write_body(self, name: str, src: torch.Tensor) -> None:
        body, enc = self._body[name], getattr(self.spec, name)
        n = src.shape[2]
        if enc is None:
            body[:, :, self._body_len:self._body_len + n] = src
            return
        # exact overflow check only when some value could overflow the scale dtype (rare)
        if self._append_mode == "reference" or (not self._deferred and self._max_abs > self._safe_abs[name]):
            append_quantized(body, src, self._body_len, target=self.target, check=self._max_abs > self._safe_abs[name])
            return
        if src.stride(-1) != 1:
            src = src.contiguous()
        self._launch_write(name, src)

    def _launch_write(self, name: str, src: torch.Tensor, second: torch.Tensor | None = None) -> None:
        """The append kernel's launch of ``src`` into body ``name`` at the body's end, without append_quantized's
        checks (the cache's own storage and checked tokens); ``second``: the values, written by the same launch
        into the value body in their own encoding (`_write_bodies`)."""
        body = self._body[name]
        n, deferred, pair = src.shape[2], self._deferred, second is not None
        key = (name, n, src.dtype, deferred, pair)
        launch = self._append_launches.get(key)
        if launch is None:
            if len(self._append_launches) >= 64:   # a prefill's flushes come in many sizes
                self._append_launches.clear()
            launch = self._append_launches[key] = plan_append(
                getattr(self.spec, name), body.shape[1], body.shape[3], src.shape[0], n, src.dtype == torch.bfloat16,
                False, 0, False, self._append_mode == "interpret", deferred, self.spec.v if pair else False)
        flag = self._flag if deferred else None   # one token: the kernel flags a scale or zero that is not finite
        self._flag_written |= deferred
        other = (self._body["v"], second) if pair else None
        if self._append_mode != "native":
            run_append(launch, body, src, self._body_len, None, flag=flag, second=other)
            return
        # a write seen before with these strides: the compiled kernel with the addresses and the offset alone
        # (bound in native mode only; the values' strides are the launch's too)
        bkey = (name, n, src.dtype, src.stride(), deferred, second.stride() if pair else None)
        state = self._append_bindings.get(bkey, launch)
        if type(state) is tuple and state:
            # the storage's addresses never change (reset keeps it): made once per (operand, flag, pair)
            fixed = self._write_addresses.get((name, deferred, pair))
            if fixed is None:
                codes = body.codes.data_ptr()
                v_body = self._body["v"]
                fixed = self._write_addresses[(name, deferred, pair)] = (
                    (codes, body.scale.data_ptr(), body.zero.data_ptr(), codes, codes, codes, codes,
                     flag.data_ptr() if deferred else codes),
                    (v_body.codes.data_ptr(), v_body.scale.data_ptr(), v_body.zero.data_ptr(), codes) if pair
                    else (codes, codes, codes, codes, codes))   # the pair's (not read) and ARRIVALS (not read)
            addresses = ((src.data_ptr(), *fixed[0], second.data_ptr(), *fixed[1]) if pair
                         else (src.data_ptr(), *fixed[0], *fixed[1]))
            if state[0](addresses, (self._body_len,)):
                if pair and deferred and not self.window and self.unit == 1:   # `append`'s next decode steps:
                    # (k's shape, k's and v's strides, dtype, device index; the bound launch; the bodies' addresses)
                    self._token_write = (src.shape, src.stride(), second.stride(), src.dtype, src.get_device(),
                                         state[0], fixed[0], fixed[1])
                return
        if os.environ.get("TRITON_INTERPRET"):
            run_append(launch, body, src, self._body_len, None, flag=flag, second=other)
            return
        kernel, args, kwargs = append_arguments(launch, body, src, self._body_len, None, flag=flag, second=other)
        kernel[launch.grid](*args, **kwargs)
        self._append_bindings.note(bkey, launch, state,
                                   lambda: (kernel.bind(launch.grid, args, kwargs, dynamic=(OFFSET_ARG,)),))

    # ---- read ---------------------------------------------------------------------------------

    def body(self):
        """(k, v) of the body's tokens: AffineTensor views (quantized operands) or plain tensors."""
        n = self._body_len
        out = []
        for name in ("k", "v"):
            x, enc = self._body[name], getattr(self.spec, name)
            if enc is None:
                out.append(x[:, :, :n])
                continue
            # one scale row per token, or per group of G tokens (channel-wise)
            rows = math.ceil(n / self._plan.of_operand(name).tiling.token_alignment)
            out.append(AffineTensor(x.codes[:, :, :n], x.scale[:, :, :rows], x.zero[:, :, :rows], enc,
                                    self.spec.head_dim))
        return tuple(out)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v): every cached token as float32 [batch, kv_heads, num_tokens, head_dim], in token order
        (sink, body dequantized, recent)."""
        result = []
        for name, body in zip(("k", "v"), self.body()):
            plain = self._plain[name]
            body_f = body.dequantize(torch.float32) if isinstance(body, AffineTensor) else body.to(torch.float32)
            result.append(torch.cat([plain[:, :, :self._sink_len].to(torch.float32), body_f,
                                     self._recent(name).to(torch.float32)], dim=2))
        return result[0], result[1]

    def attention(self, q: torch.Tensor, sm_scale: float | None = None, return_lse: bool = False):
        """Decode attention of ``q [batch, num_q_heads, head_dim]`` over every cached token.

        Returns ``[batch, num_q_heads, head_dim]`` in q's dtype (float64 for target="reference"),
        and the float32 log-sum-exp per head with ``return_lse=True``."""
        fast = self._attend
        if (fast is not None and not return_lse and type(q) is _TENSOR and not self._flag_seen[0] and self._body_len
                and not self._sink_len and not self._recent_len and type(sm_scale) is fast[0] and sm_scale == fast[1]
                and q.shape == self._q_shape and q.dtype == fast[2] and q.get_device() == fast[3]
                and q.is_contiguous() and (fast[3] < 0 or (not _CAPTURING() and _STREAM(fast[3]) == fast[4]))):
            # a decode step over the body alone, shaped as the last one the whole path ran prepared (`_part`)
            out = torch.empty_like(q)   # contiguous as q is (half torch.empty's host time)
            fast[5](q, out, self._body_len)
            return out if not q.requires_grad else without_backward(out, q, self._what, ATTENTION_FIX)
        self._raise_if_flagged()
        if not isinstance(q, torch.Tensor):
            raise InputTypeError(f"q must be a torch.Tensor [batch, num_q_heads, head_dim], got {type(q).__name__}")
        if q.shape != self._q_shape:
            raise InputError(f"q shape={tuple(q.shape)} but this cache needs {self._q_shape} (batch, num_q_heads, "
                             "head_dim)")
        if self.target != "reference" and q.dtype != self.dtype:
            raise InputError(f"q dtype={q.dtype} but the cache holds {self.dtype} tokens; pass q.to({self.dtype})")
        if q.device != self.device:
            raise InputError(f"q is on {q.device} but the cache is on {self.device}; move it there")
        if q.stride(-1) != 1:
            if q.layout != torch.strided:   # (its strides read (0, 0, 0))
                raise InputError(f"q is a tensor of layout {q.layout}; attention takes dense queries: pass "
                                 "q.to_dense()")
            raise InputError(f"q must have unit stride along head_dim; got strides {q.stride()}: pass q.contiguous()")
        if self.num_tokens == 0:
            raise InputError("the cache holds no tokens; append() keys and values before attention()")
        plain_len = self._sink_len + self._recent_len
        # with two parts, each stays float32 until the merge: one rounding to q's dtype, not two
        wide = bool(self._body_len and plain_len and self.target != "reference")

        scale = check_sm_scale(sm_scale, self.spec.head_dim)
        parts = []
        if self._body_len:
            self._last_prepared = None
            parts.append(self._part("body", q, scale, wide, return_lse))
            # the next decode steps' fast path, for a scale given as a number or None (a tensor scale may change in
            # place: its value is read each call, by the whole path)
            if not plain_len and self._last_prepared is not None and not isinstance(sm_scale, torch.Tensor):
                # (the scale's type and value as given, q's dtype and device index, the stream, the prepared run)
                self._attend = (type(sm_scale), sm_scale, q.dtype, q.get_device(), *self._last_prepared)
        if plain_len:  # sink and recent are one contiguous prefix of the plain buffer
            parts.append(self._part("plain", q, scale, wide, return_lse))
        if len(parts) == 1:
            out, lse = parts[0]
        elif self.target == "reference":   # float64 parts, a float64 result
            out, lse = merge_parts(parts)
        else:   # one launch: eq. 14 over the two parts, written in q's dtype
            out, lse = merge_two_parts(parts[0], parts[1], q.dtype)
        result = (out, lse) if return_lse else out
        if q.requires_grad and self.target != "reference":   # (the float64 executor's parts and merge have a backward)
            return without_backward(result, q, self._what, ATTENTION_FIX)
        return result

    def _part(self, name: str, q: torch.Tensor, scale: float, wide: bool, return_lse: bool):
        """(out, lse) of attention over part ``name`` ("body": the quantized tokens; "plain": sink and window)."""
        if name == "body":
            attention, k, v, n = self._body_attention, self._body["k"], self._body["v"], self._body_len
        else:
            attention, k, v, n = self._plain_attention, self._plain["k"], self._plain["v"], self._sink_len + self._recent_len
        if self.target == "reference":
            return attention(q, k, v, sm_scale=scale, seq_lens=self._lengths(name, n), return_lse=True)
        # the cache's own tensors: the launch is planned once per part and query dtype (the buffers never change)
        # and run without re-checking them; every row holds n tokens: a launch without lengths takes n per call
        # (no lengths tensor to refill), a backend whose kernel reads lengths plans with them (`Launch.has_lens`)
        launch = self._part_launches.get((name, q.dtype))
        if launch is None:
            launch = self._part_launches[(name, q.dtype)] = attention.plan_launch(
                q.dtype, self.batch, k.shape[2], self.device, has_lens=False, k=k, v=v)
        out = torch.empty(self._q_shape, dtype=torch.float32 if wide else q.dtype, device=self.device)
        cuda = self.device.type == "cuda"
        if not launch.has_lens and not return_lse and not (cuda and _CAPTURING()):
            # a decode step: the part's prepared run on this stream (its storage, workspace and lse fixed)
            stream = stream_handle(self.device)
            prepared = self._prepared.get((name, q.dtype, scale, stream))
            if prepared is None:
                if len(self._prepared) >= 16:
                    self._prepared.clear()
                workspace, lse = self._scratch[name].get(launch, self.device, self._q_shape[:2], stream=stream)
                prepared = self._prepared[(name, q.dtype, scale, stream)] = attention.prepare(launch, k, v, workspace,
                                                                                              lse, scale)
            prepared(q, out, n)
            self._last_prepared = (stream, prepared)
            return out, prepared.lse
        # the buffers of this part's last call on this stream, unless the lse goes to the caller
        workspace, lse = self._scratch[name].get(launch, self.device, self._q_shape[:2], fresh=return_lse)
        if launch.has_lens:
            attention.run(launch, q, k, v, out, lse, scale, seq_lens=self._lengths(name, n), workspace=workspace)
        else:
            attention.run(launch, q, k, v, out, lse, scale, workspace=workspace, tokens=n)
        return out, lse

    def __deepcopy__(self, memo: dict) -> QuantizedKVCache:
        """A cache holding the same tokens in storage of its own (transformers reuses a prompt's cache through
        ``copy.deepcopy``): the compiled attention is shared (`compiled_attention`), the launches and fast paths are
        made again for the new storage, and a flag a one-token append raised travels with the tokens. Python's own
        copy raised TypeError ("cannot pickle 'module' object") once a kernel had run."""
        new = QuantizedKVCache(self.spec, self.batch, self.capacity, sink=self.sink, window=self.window,
                               device=self.device, dtype=self.dtype, target=self.target)
        memo[id(self)] = new
        for name in ("k", "v"):
            for mine, theirs in ((new._body[name], self._body[name]), (new._plain[name], self._plain[name])):
                if isinstance(theirs, AffineTensor):
                    for part in ("codes", "scale", "zero"):
                        getattr(mine, part).copy_(getattr(theirs, part))
                else:
                    mine.copy_(theirs)
                memo[id(theirs)] = mine   # (e.g. FoldcStaticLayer's views of the body: the copy's)
        for attr in ("_sink_len", "_body_len", "_recent_len", "_ring_head", "_max_abs", "_plain_unchecked"):
            setattr(new, attr, getattr(self, attr))
        if self._flag_copied:   # a kernel's flag on its way to host memory
            torch.cuda.synchronize(self.device)
        if self._flag_seen[0]:
            new._flag_host.fill_(1)
            if not new._flag_mapped and new._flag is not new._flag_host:
                new._flag.fill_(1)
        return new

    def __repr__(self) -> str:
        return (f"QuantizedKVCache({self.spec.describe()}, batch={self.batch}, capacity={self.capacity}, "
                f"sink={self.sink}, window={self.window}, tokens={self.num_tokens} "
                f"[sink {self._sink_len}, body {self._body_len}, recent {self._recent_len}], target={self.target!r})")
