"""A paged KV cache for a whole model: quantized page pools plus plain sink and recent windows.

Per layer, a sequence's tokens are split as in `QuantizedKVCache`::

    [ sink (first `sink` tokens, model dtype) | body (quantized, in pages) | recent (model dtype) ]

The body lives in page pools (one per layer and operand) addressed by one page table shared by
every layer (FlashInfer conventions, see paged.py); sink and recent tokens live in a plain buffer
per layer, ``[batch, kv_heads, sink + window + unit, head_dim]``. The split is a function of the
token count ``n`` alone: ``body(n) = (n - sink - window) // unit * unit`` when positive, else 0,
where ``unit`` is the least common multiple of the channel-wise group sizes (1 if none). So the
host knows every length without reading the device.

A decode step (one new token per sequence) runs on the device only, so it can be captured in a
CUDA graph: the token is written after the plain tokens; when the recent window reaches
``window + unit`` tokens, its oldest ``unit`` tokens are quantized into the body's pages
(`append_paged` with a per-sequence count of 0 or ``unit``) and the rest slide down. Attention is the
paged kernel over the body merged with the plain attention over sink + recent by log-sum-exp
(`foldc.merge_attention`). Without sink and window and with token-wise groups (unit 1) the body holds every
token: a decode step quantizes its token straight into the pages and attention reads the pages alone. A
prefill (several tokens) is planned on the host, sequence by sequence.

Lengths: the cache tracks them on the host (no device reads) and on the device (per layer, advanced
by the decode kernels). ``plan(kv_indptr, kv_indices, seq_lens)`` sets both; call it again (same batch
size: same buffers) whenever the page table grows, e.g. before each replay of a captured step.
"""
from __future__ import annotations

import copy
import math
import os

import torch

from ..backends.runtime.fast_launch import Bindings
from ..backends.runtime.launch import STREAM_CAPTURING
from ..compile import compile as compile_attention
from ..encoding import AffineTensor, quantize
from ..errors import InputError, InputTypeError, ScaleOverflowError, SpecError
from .part_merge import merge_two_parts
from ..plan import plan_of
from ..reference import attention_reference
from ..spec import AttentionSpec
from ..validate import ATTENTION_FIX, check_sm_scale, without_backward
from .append import (append_arguments, append_paged, check_finite, plan_append, resolve_target, run_append,
                     safe_abs_limit, write_paged)
from .inputs import check_new_tokens, check_readable, count, resolve_device
from .page_table import check_page_table, gather_pages, page_pool
from .paged import PagedDecodeWrapper, launch_plain

_TENSOR = torch.Tensor
_CAPTURING = STREAM_CAPTURING
_WHAT = "PagedKVCache.attention"   # what a backward through its kernels' output names (it has none)


def _lengths(seq_lens) -> list[int]:
    """Host token counts from a list or an integer tensor (one per sequence)."""
    if isinstance(seq_lens, (str, bytes)):
        raise InputTypeError(f"seq_lens={seq_lens!r} must be a list of ints or an integer tensor [batch]")
    try:
        lens = torch.as_tensor(seq_lens)
    except (TypeError, ValueError, RuntimeError):
        raise InputTypeError(f"seq_lens={seq_lens!r} must be a list of ints or an integer tensor [batch]") from None
    check_readable("seq_lens", lens, "integer tensor [batch] (or a list of ints)")
    if lens.dtype.is_floating_point or lens.dtype.is_complex or lens.dtype == torch.bool or lens.dim() != 1 \
            or lens.numel() < 1:
        raise InputError(f"seq_lens dtype={lens.dtype} shape={tuple(lens.shape)} must be one integer token count "
                         "per sequence, shape [batch] with batch >= 1")
    return [int(n) for n in lens.tolist()]


class PagedKVCache:
    """Paged, quantized KV cache of ``num_layers`` attention layers with a plain sink and recent window.

    Parameters
    ----------
    spec : AttentionSpec
        The attention and its K/V encodings (both encoded: the body is quantized).
    num_layers : int
        Attention layers (each gets its own pools and plain buffers).
    page_size : int
        Tokens per page (channel-wise encodings: a multiple of group_size).
    num_pages : int
        Pages per pool; pools are `AffineTensor` ``[num_pages, kv_heads, page_size, head_dim]``.
    max_seq_len : int
        Most tokens per sequence (sink + body + recent).
    sink, window : int
        Plain first tokens; plain recent tokens (the window holds up to ``window + unit - 1``).
    device : str or torch.device
    dtype : torch.dtype
        Model dtype of keys, values and queries: float16 or bfloat16 (float16 under the interpreter).
        The plain buffers are ``[batch, kv_heads, sink + window + unit, head_dim]`` of it.
    target : str
        "auto", "sm_90", "sm_100", "interpret" (CPU, float16) or "reference" (appends by
        foldc.quantize, attention in float64 over the dequantized cache: slow, for checking).
    """

    def __init__(self, spec: AttentionSpec, *, num_layers: int, page_size: int, num_pages: int, max_seq_len: int,
                 sink: int = 0, window: int = 0, device="cpu", dtype: torch.dtype = torch.float16,
                 target: str = "auto"):
        if not isinstance(spec, AttentionSpec):
            raise SpecError(f"spec must be a foldc.AttentionSpec, got {type(spec).__name__}")
        if spec.k is None or spec.v is None:
            raise SpecError(f"PagedKVCache quantizes both K and V into pages, but the spec has k={spec.k}, "
                            f"v={spec.v}; give both an encoding (keep plain tokens in the sink/window instead)")
        self.spec = spec
        self.num_layers = count("num_layers", num_layers, 1)
        self.sink, self.window = count("sink", sink, 0), count("window", window, 0)
        self.num_pages = count("num_pages", num_pages, 1)
        self.max_seq_len = count("max_seq_len", max_seq_len, 1)
        if dtype not in (torch.float16, torch.bfloat16):
            raise SpecError(f"dtype={dtype} is not supported; use torch.float16 or torch.bfloat16")
        self.device, self.dtype = resolve_device(device), dtype
        self.unit = plan_of(spec).token_alignment   # the lcm of the channel-wise groups' sizes (1 if none)
        self.plain_capacity = self.sink + self.window + self.unit
        # no sink, no window, token-wise groups: the body holds every token, so a decode step's token goes
        # straight into the pages and attention reads the pages alone (no plain part, no merge)
        self._direct = self.sink == 0 and self.window == 0 and self.unit == 1
        self.wrapper = PagedDecodeWrapper(spec, page_size, max_seq_len=max_seq_len, device=self.device,
                                          target=target)
        self.target, self.page_size = self.wrapper.target, page_size
        if self.target == "interpret" and (self.device.type != "cpu" or dtype != torch.float16):
            raise SpecError(f"target='interpret' runs Triton's interpreter, float16 on the CPU; got dtype={dtype} on "
                            f"{self.device}. Use dtype=torch.float16 and device='cpu', or target='reference'")
        self._append_target = "reference" if self.target == "reference" else "auto"
        # straight to pages (token-wise groups): one append launch writes K and V, each in its own encoding (the
        # kernel's pair mode), and moves the offsets on itself
        mode = resolve_target(self._append_target, self.device)
        self._pair = self._direct and mode != "reference"
        self._append_interpret = mode == "interpret"
        self._append_bindings = Bindings(16)   # the pair launch's bound kernel per (dtype, k's and v's strides)
        self.pools = [{name: page_pool(spec, name, num_pages, page_size, device=self.device) for name in "kv"}
                      for _ in range(num_layers)]
        if self.target != "reference":
            self._plain_attn = compile_attention(AttentionSpec(spec.num_q_heads, spec.num_kv_heads, spec.head_dim),
                                                 self.target)
        self._layers: list[dict] = []
        self._owned: list = []   # the last plan's page-table entries per sequence (host)
        self.batch = 0
        # a decode step's pair write shaped as the last bound one (`append`'s fast path): its key and launch, and
        # per layer the pools', offsets' and page table's addresses (made again at each plan)
        self._token_write = None
        self._write_fixed: dict = {}
        # straight to pages, attention shaped as the last whole-path call (`attention`'s fast path): (q's shape,
        # strides, dtype and device index, the sm_scale argument) and per layer the wrapper's prepared run
        self._attend = None
        self._attend_runs: dict = {}

    # ---- lengths --------------------------------------------------------------------------------

    def body_len(self, n: int) -> int:
        """Quantized tokens of a sequence holding ``n`` tokens."""
        return max(0, n - self.sink - self.window) // self.unit * self.unit if n > self.sink else 0

    def _refuse_short_pages(self, kv_indptr, kv_indices, lens: list, body: list) -> None:
        """Raise, naming ``seq_lens`` as the caller gave them, where a sequence owns too few pages for its body's
        tokens (a table the wrapper refused; it names the body's lengths)."""
        pages = check_page_table(kv_indptr, kv_indices, None, self.num_pages, self.page_size, [0] * len(lens)).pages
        for b, (n, m, p) in enumerate(zip(lens, body, pages)):
            if m > p * self.page_size:
                raise InputError(f"seq_lens[{b}]={n} puts {m} tokens in the quantized body (sink={self.sink}, "
                                 f"window={self.window}) but sequence {b} owns {p} pages of page_size={self.page_size} "
                                 f"({p * self.page_size} tokens); give it at least {-(-m // self.page_size)} pages "
                                 "in kv_indices")

    def _refuse_moved_sequences(self, owned: list, lens: list, body: list) -> None:
        """Raise where a held sequence with sink or window tokens would be planned with other pages under the ones its
        body fills (its first page, while its body fills none and both tables give it one): its plain tokens stay at
        its batch position, so a sequence moved to another position (a batch compacted after one finished) read the
        plain tokens of the sequence that was there, silently. ``owned``: the new table's entries per sequence."""
        for b, (n, m) in enumerate(zip(lens, body)):
            if n == m or b >= len(self._owned):   # no plain token to mismatch (n = 0 included), or a new position
                continue
            filled = -(-m // self.page_size) or min(1, len(self._owned[b]), len(owned[b]))
            was, now = self._owned[b][:filled], owned[b][:filled]
            if was != now:
                raise InputError(f"seq_lens[{b}]={n}: sequence {b} began with pages {was} (the last plan's kv_indices; "
                                 f"its body fills {-(-m // self.page_size)} with {m} quantized tokens) but this table "
                                 f"gives it {now} there, and its {n - m} sink and window tokens are kept at its batch "
                                 "position: a held sequence moved to another position (it would read another "
                                 "sequence's plain tokens) or its first pages changed. Keep each held sequence at its "
                                 "position with its first pages (add pages after them), or pass seq_lens 0 there to "
                                 "start a sequence anew")

    def plan(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, seq_lens) -> None:
        """Set the body's page table and every sequence's token count (host; may synchronise).

        Parameters
        ----------
        kv_indptr : torch.Tensor, int32 ``[batch + 1]``
        kv_indices : torch.Tensor, int32 ``[kv_indptr[-1]]``
            Page table of the body (paged.py). Sequence b must own at least
            ``ceil(body_len(n_b) / page_size)`` pages; pages past that are reserved for the body's
            growth (appends past them raise).
        seq_lens : list of int or torch.Tensor ``[batch]``
            Tokens each sequence holds now (0 for a new one). A sequence the cache already holds must
            be given its current count.

        The cache knows a sequence by its batch position (its sink and window tokens are kept there): a held
        sequence keeps its position and the pages its body fills (its first page, while the body fills none). A
        table that moves one with sink or window tokens is refused where it held a page and is given one; a
        sequence given no page in either table cannot be told from the one that was there by its length alone.
        Compacting a batch (moving sequences into a finished one's place) is not supported: restart a moved
        sequence with 0.
        """
        lens = _lengths(seq_lens)
        held_counts = [self._counts(st) for st in self._layers] or [[]]   # (none held yet: a new cache)
        for b, n in enumerate(lens):
            if not 0 <= n <= self.max_seq_len:
                raise InputError(f"seq_lens[{b}]={n} must lie in [0, max_seq_len={self.max_seq_len}]")
            for layer, counts in enumerate(held_counts):
                held = counts[b] if b < len(counts) else 0
                if n and n != held:   # lengths may only claim tokens the cache received
                    raise InputError(f"seq_lens[{b}]={n} but layer {layer} holds {held} tokens of sequence {b}; "
                                     "pass its current count, or 0 to start a new sequence there (then append() "
                                     "its tokens)")
        body = [self.body_len(n) for n in lens]
        try:   # (the wrapper's check, before anything changes: the table's entries are read below)
            check_page_table(kv_indptr, kv_indices, None, self.num_pages, self.page_size, body)
        except InputError:
            self._refuse_short_pages(kv_indptr, kv_indices, lens, body)   # named by the lengths given, if that
            raise                                                          # is the reason (the wrapper's: the body's)
        indptr, indices = kv_indptr.cpu().tolist(), kv_indices.cpu().tolist()
        owned = [indices[indptr[b]:indptr[b + 1]] for b in range(len(lens))]
        self._refuse_moved_sequences(owned, lens, body)
        self.table = self.wrapper.plan(kv_indptr, kv_indices, None, num_pages=self.num_pages, seq_lens=body)
        self._owned = owned
        if len(lens) != self.batch:  # new buffers (a captured graph must be captured again)
            old, kept = self._layers, min(self.batch, len(lens))
            self.batch = len(lens)
            shape = (self.batch, self.spec.num_kv_heads, self.plain_capacity, self.spec.head_dim)
            self._layers = [{"k": torch.zeros(shape, dtype=self.dtype, device=self.device),
                             "v": torch.zeros(shape, dtype=self.dtype, device=self.device),
                             "body": torch.zeros(self.batch, dtype=torch.int32, device=self.device),
                             "plain": torch.zeros(self.batch, dtype=torch.int32, device=self.device),
                             # the pair append's per-row counters (it advances "body" itself): zero between launches
                             "arrivals": torch.zeros(self.batch, dtype=torch.int32, device=self.device)}
                            for _ in range(self.num_layers)]
            for before, now in zip(old, self._layers):   # the sequences kept keep their plain tokens
                for name in "kv":
                    now[name][:kept].copy_(before[name][:kept])
        # a decode step's host bookkeeping is O(1): a count added to every sequence (`_counts` applies it), the
        # smallest count, and (straight to pages) the fewest tokens any sequence still has room for
        room = None
        if self._direct:
            room = min((min(self.max_seq_len, pages * self.page_size) - n for pages, n in zip(self.table.pages, lens)),
                       default=0)
        self._token_write, self._write_fixed = None, {}   # the fast paths' addresses: made again for this plan
        self._attend, self._attend_runs = None, {}
        for layer in self._layers:
            layer["n"], layer["add"], layer["least"], layer["room"] = list(lens), 0, min(lens, default=0), room
            layer["body"].copy_(torch.tensor(body, dtype=torch.int32), non_blocking=True)
            layer["plain"].copy_(torch.tensor([n - m for n, m in zip(lens, body)], dtype=torch.int32),
                                 non_blocking=True)

    def before_replay(self, tokens: int = 1) -> None:
        """Host bookkeeping for a captured decode step: call it before each ``graph.replay()`` of a
        graph that appends ``tokens`` per sequence to every layer (Python code inside the graph does
        not run on replay). Raises, before anything is written, when the step would go past capacity."""
        tokens = count("tokens", tokens, 0)   # (-1 moved every host count back, out of step with the device's)
        for layer in range(self.num_layers):
            st = self._state(layer)
            self._check_capacity(st, tokens)
        for st in self._layers:
            self._advance(st, tokens)

    def _counts(self, st: dict) -> list[int]:
        """Every sequence's token count in ``st`` (a layer's state), the steps since it was last made added."""
        add = st["add"]
        if add:
            st["n"], st["add"] = [n + add for n in st["n"]], 0
        return st["n"]

    @staticmethod
    def _advance(st: dict, tokens: int) -> None:
        """``tokens`` more in every sequence of ``st``: O(1), the counts made when read (`_counts`)."""
        st["add"] += tokens
        st["least"] += tokens
        if st["room"] is not None:
            st["room"] -= tokens

    def _check_capacity(self, st: dict, tokens: int) -> None:
        if st["room"] is not None and tokens <= st["room"]:   # every sequence has room (straight to pages)
            return
        for b, n in enumerate(self._counts(st)):
            if n + tokens > self.max_seq_len:
                raise InputError(f"appending {tokens} tokens to sequence {b} ({n} tokens) goes past capacity: "
                                 f"max_seq_len={self.max_seq_len}; build the cache with a larger max_seq_len")
            need, have = self.body_len(n + tokens), self.table.pages[b] * self.page_size
            if need > have:
                raise InputError(f"appending {tokens} tokens to sequence {b} ({n} tokens) goes past capacity: its "
                                 f"body needs {need} token slots but its {self.table.pages[b]} pages hold {have}; "
                                 "plan() again with more pages for it")

    def num_tokens(self, layer: int = 0) -> list[int]:
        return list(self._counts(self._state(layer)))

    def _state(self, layer: int) -> dict:
        if not self._layers:
            raise InputError("the cache has no batch layout yet; call plan(kv_indptr, kv_indices, seq_lens) first")
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise InputError(f"layer={layer!r} must be an integer in [0, {self.num_layers - 1}]")
        return self._layers[layer]

    # ---- append ---------------------------------------------------------------------------------

    def _check_tokens(self, name: str, x) -> None:
        check_new_tokens(name, x, self.batch, self.spec, self.dtype, self.device)

    def append(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Add ``T`` tokens per sequence to ``layer``.

        ``T == 1`` (decode) runs on the device only (capturable; during a capture the host counts do not
        move: call `before_replay` before each replay); a NaN or Inf it brings makes attention over its
        sequence NaN. ``T > 1`` (prefill) is planned on the host and refuses NaN/Inf (InputError), as
        does every append with target "reference", and tokens it moves into the pages whose scale or zero would
        overflow the encoding's scale dtype (`ScaleOverflowError`, as foldc.quantize and `QuantizedKVCache`).
        Capacity is checked on the host, and a prefill's values, before anything is written.

        Parameters
        ----------
        layer : int
        k_new, v_new : torch.Tensor ``[batch, kv_heads, T, head_dim]``, the cache's dtype and device
        """
        fast = self._token_write
        if (fast is not None and type(layer) is int and type(k_new) is _TENSOR and type(v_new) is _TENSOR
                and k_new.shape == fast[0] and v_new.shape == fast[0] and k_new.stride() == fast[1]
                and v_new.stride() == fast[2] and k_new.dtype == fast[3] and v_new.dtype == fast[3]
                and k_new.get_device() == fast[4] and v_new.get_device() == fast[4]):
            # a decode step shaped as the last one whose pair write was bound (`_write_pair`); capacity by the
            # layer's room, no capture (the whole path keeps the host counts still there)
            fixed = self._write_fixed.get(layer)
            if fixed is not None and (fast[4] < 0 or not _CAPTURING()):
                st = self._layers[layer]
                if st["room"] >= 1 and fast[5]((k_new.data_ptr(), *fixed[0], v_new.data_ptr(), *fixed[1]), ()):
                    self._advance(st, 1)   # the launch moved the offsets on itself
                    return
        st = self._state(layer)
        self._check_tokens("k_new", k_new)
        self._check_tokens("v_new", v_new)
        tokens = k_new.shape[2]
        if v_new.shape[2] != tokens:
            raise InputError(f"k_new holds {tokens} tokens but v_new holds {v_new.shape[2]}; they must match")
        self._check_capacity(st, tokens)
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if tokens == 0:
            return
        if (tokens > 1 or self.target == "reference") and not capturing:
            # host-planned appends read the values anyway: refuse NaN/Inf here, naming the first. A
            # device-only decode step cannot (a sync); there a NaN key gives NaN attention instead.
            for name, x in (("k_new", k_new), ("v_new", v_new)):
                check_finite(x, name)
        if tokens == 1:
            self._decode_append(layer, st, k_new, v_new)
        elif capturing:
            raise InputError(f"appending {tokens} tokens per sequence is planned on the host and cannot be captured "
                             "in a CUDA graph; capture decode steps (one token per sequence) only")
        else:
            self._prefill_append(layer, st, k_new, v_new)
        if not capturing:  # a captured step runs on replay: before_replay() counts it then
            self._advance(st, tokens)

    def _decode_append(self, layer: int, st: dict, k_new, v_new) -> None:
        """One token per sequence, device operations only."""
        if self._direct:   # every token is the body's: quantized into its page at position body
            pools, table = self.pools[layer], (self.wrapper.kv_indptr, self.wrapper.kv_indices)
            if not self._pair:   # (target "reference": the host's copies)
                for name, x in (("k", k_new), ("v", v_new)):
                    write_paged(pools[name], x, *table, st["body"], page_size=self.page_size,
                                target=self._append_target, table_checked=True)
                st["body"] += 1
                return
            # checked tokens (one dtype), the cache's own pools and table; each operand with strides of its own
            k_new = k_new if k_new.stride(-1) == 1 else k_new.contiguous()
            v_new = v_new if v_new.stride(-1) == 1 else v_new.contiguous()
            launch = plan_append(self.spec.k, self.spec.num_kv_heads, self.spec.head_dim, self.batch, 1,
                                 k_new.dtype == torch.bfloat16, True, self.page_size, False, self._append_interpret,
                                 pair=self.spec.v, advance=True)
            self._write_pair(layer, launch, pools, k_new, v_new, st, table)   # moves "body" on itself
            return
        b, h, d = self.batch, self.spec.num_kv_heads, self.spec.head_dim
        idx = st["plain"].long().view(b, 1, 1, 1).expand(b, h, 1, d)
        st["k"].scatter_(2, idx, k_new)
        st["v"].scatter_(2, idx, v_new)
        st["plain"] += 1
        flush = st["plain"] >= self.plain_capacity           # the window overflowed by one unit
        counts = flush.to(torch.int32) * self.unit
        lo = self.sink
        for name in "kv":
            write_paged(self.pools[layer][name], st[name][:, :, lo:lo + self.unit], self.wrapper.kv_indptr,
                        self.wrapper.kv_indices, st["body"], page_size=self.page_size, counts=counts,
                        target=self._append_target, table_checked=True)
            if self.window:  # the kept tokens slide down by one unit where a flush happened
                kept = st[name][:, :, lo:lo + self.window]
                moved = st[name][:, :, lo + self.unit:lo + self.unit + self.window]
                kept.copy_(torch.where(flush.view(b, 1, 1, 1), moved, kept))
        st["plain"] -= counts
        st["body"] += counts

    def _write_pair(self, layer: int, launch, pools: dict, k_new, v_new, st: dict, table: tuple) -> None:
        """The pair launch of a decode step's K and V (each in its own encoding) into the pages at each sequence's
        ``st["body"]`` offset, which the launch then moves on by one (`plan_append`'s advance, counting in ``st["arrivals"]``). Natively
        a launch seen before with these strides is bound (`FastLaunch.bind`) and later ones give it the tensors'
        addresses alone: the tokens', the pools', the offsets', the page table's and the counters' (as
        `append_arguments` orders them; the counts and flag it does not read are the key codes')."""
        body, arrivals = st["body"], st["arrivals"]
        if self._append_interpret or os.environ.get("TRITON_INTERPRET"):
            run_append(launch, pools["k"], k_new, None, body, paging=table, second=(pools["v"], v_new),
                       arrivals=arrivals)
            return
        key = (k_new.dtype, k_new.stride(), v_new.stride())
        state = self._append_bindings.get(key, launch)
        if type(state) is tuple and state:
            kp, vp = pools["k"], pools["v"]
            codes = kp.codes.data_ptr()
            fixed = ((codes, kp.scale.data_ptr(), kp.zero.data_ptr(), body.data_ptr(), table[0].data_ptr(),
                      table[1].data_ptr(), codes, codes),
                     (vp.codes.data_ptr(), vp.scale.data_ptr(), vp.zero.data_ptr(), arrivals.data_ptr()))
            if state[0]((k_new.data_ptr(), *fixed[0], v_new.data_ptr(), *fixed[1]), ()):
                # the next steps of this shape (`append`'s fast path): (k's shape, k's and v's strides, dtype,
                # device index, the bound launch), and this layer's addresses
                self._token_write = (k_new.shape, k_new.stride(), v_new.stride(), k_new.dtype, k_new.get_device(),
                                     state[0])
                self._write_fixed[layer] = fixed
                return
        kernel, args, kwargs = append_arguments(launch, pools["k"], k_new, None, body, table, None, None,
                                                (pools["v"], v_new), arrivals)
        kernel[launch.grid](*args, **kwargs)
        self._append_bindings.note(key, launch, state, lambda: (kernel.bind(launch.grid, args, kwargs),))

    def _prefill_append(self, layer: int, st: dict, k_new, v_new) -> None:
        """Several tokens per sequence: every part's range computed on the host, sequence by sequence. The tokens
        that move into the pages are checked first (`_check_flushed`): a refused prefill writes nothing."""
        tokens, sink = k_new.shape[2], self.sink
        moves = []   # per sequence: (b, n, old body, tokens flushed, new sink tokens, {name: old recent + new})
        for b, n in enumerate(self._counts(st)):
            m = n + tokens
            body_old, body_new = self.body_len(n), self.body_len(m)
            n_sink_new = max(0, min(m, sink) - n)
            tails = {}
            for name, new in (("k", k_new[b:b + 1]), ("v", v_new[b:b + 1])):
                # the sequence's tokens from the first not yet in the body on: old recent, then new
                old_recent = st[name][b:b + 1, :, sink:sink + (n - min(n, sink) - body_old)]
                tails[name] = torch.cat([old_recent, new[:, :, n_sink_new:]], dim=2)
            moves.append((b, n, body_old, body_new - body_old, n_sink_new, tails))
        self._check_flushed(layer, moves)
        for b, n, body_old, flushed, n_sink_new, tails in moves:
            for name, new in (("k", k_new[b:b + 1]), ("v", v_new[b:b + 1])):
                plain, tail = st[name][b:b + 1], tails[name]
                if n_sink_new:
                    plain[:, :, n:n + n_sink_new] = new[:, :, :n_sink_new]
                if flushed:
                    pages = self._row_table(b)
                    start = torch.full((1,), body_old, dtype=torch.int32, device=self.device)
                    append_paged(self.pools[layer][name], tail[:, :, :flushed].contiguous(), *pages, start,
                                 page_size=self.page_size, target=self._append_target)
                keep = tail[:, :, flushed:]
                plain[:, :, sink:sink + keep.shape[2]] = keep.clone()
        body = [self.body_len(n + tokens) for n in st["n"]]
        st["body"].copy_(torch.tensor(body, dtype=torch.int32))
        st["plain"].copy_(torch.tensor([n + tokens - m for n, m in zip(st["n"], body)], dtype=torch.int32))

    def _check_flushed(self, layer: int, moves: list) -> None:
        """Refuse (`ScaleOverflowError`, foldc.quantize's) a prefill whose tokens moving into the pages hold a value
        whose scale or zero overflows the encoding's scale dtype, before anything is written, as `QuantizedKVCache`
        refuses one (the append kernels would store an inf scale, and attention over the sequence be NaN). The
        tokens moved are the new ones and the window's older ones (a decode step's, unchecked); their largest
        |value| in one device sync, and only above `safe_abs_limit` the exact check, foldc.quantize of the groups
        written."""
        parts = [(b, name, tails[name][:, :, :flushed]) for b, _, _, flushed, _, tails in moves if flushed
                 for name in "kv"]
        if not parts:
            return
        peaks = torch.stack(torch._foreach_norm([part for _, _, part in parts], math.inf)).tolist()
        for (b, name, part), peak in zip(parts, peaks):
            enc = getattr(self.spec, name)
            if peak > safe_abs_limit(enc.scale_dtype):
                try:
                    quantize(part, enc)
                except ScaleOverflowError as e:
                    raise ScaleOverflowError(f"layer {layer}, sequence {b}: the {'keys' if name == 'k' else 'values'} "
                                             f"this prefill moves into the pages cannot be quantized: {e}; nothing "
                                             "was written") from None

    def _row_table(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A one-sequence page table for sequence b (host values from the plan)."""
        first = sum(self.table.pages[:b])
        own = self.wrapper.kv_indices[first:first + self.table.pages[b]]
        return torch.tensor([0, self.table.pages[b]], dtype=torch.int32, device=self.device), own

    # ---- read -----------------------------------------------------------------------------------

    def attention(self, layer: int, q: torch.Tensor, sm_scale: float | None = None) -> torch.Tensor:
        """Decode attention over every token of ``layer``: the paged body merged with the plain sink +
        recent window by log-sum-exp. No host synchronisation (target "reference" aside).

        Parameters
        ----------
        layer : int
        q : torch.Tensor ``[batch, num_q_heads, head_dim]``, the cache's dtype and device
        sm_scale : float, optional
            Softmax scale (default ``head_dim ** -0.5``).

        Returns
        -------
        torch.Tensor ``[batch, num_q_heads, head_dim]``, q's dtype
        """
        fast = self._attend
        if (fast is not None and type(q) is _TENSOR and q.shape == fast[0] and q.stride() == fast[1]
                and q.dtype == fast[2] and q.get_device() == fast[3] and type(sm_scale) is type(fast[4])
                and sm_scale == fast[4] and type(layer) is int):
            # straight to pages, shaped as a call the whole path ran: the layer's prepared run (it takes `run` for
            # what it cannot vouch for, a capture included); the layer holds tokens (counts only grow until `plan`)
            prepared = self._attend_runs.get(layer)
            if prepared is not None:
                out = torch.empty_like(q)
                prepared(q, out)
                return out if not q.requires_grad else without_backward(out, q, _WHAT, ATTENTION_FIX)
        st = self._state(layer)
        want = (self.batch, self.spec.num_q_heads, self.spec.head_dim)
        if not isinstance(q, torch.Tensor) or tuple(q.shape) != want:
            raise InputError(f"q shape={tuple(getattr(q, 'shape', ()))} but this cache needs {want} (batch, "
                             "num_q_heads, head_dim)")
        if q.dtype != self.dtype or q.device != self.device:
            raise InputError(f"q is {q.dtype} on {q.device} but the cache holds {self.dtype} on {self.device}")
        if not st["least"]:
            raise InputError(f"sequence {self._counts(st).index(0)} of layer {layer} holds no tokens; append() its keys "
                             "and values before attention()")
        scale = check_sm_scale(sm_scale, self.spec.head_dim)
        if self.target == "reference":
            k, v, lens = self.dequantized(layer)
            return attention_reference(q, k, v, sm_scale=scale, seq_lens=torch.tensor(lens)).to(q.dtype)
        pools = self.pools[layer]
        if self._direct:   # no plain tokens: the pages are the whole sequence
            out = self.wrapper.run(q, pools["k"], pools["v"], sm_scale=scale, seq_lens=st["body"])
            prepared = self.wrapper.prepared_run(q.dtype, scale, pools["k"], pools["v"], st["body"])
            # the next calls of q's shape (`attention`'s fast path); a tensor scale, which may change in place, is
            # read each call by the whole path
            if prepared is not None and q.is_contiguous() and not isinstance(sm_scale, torch.Tensor):
                key = (q.shape, q.stride(), q.dtype, q.get_device(), sm_scale)
                if self._attend != key:
                    self._attend, self._attend_runs = key, {}
                self._attend_runs[layer] = prepared
            return out if not q.requires_grad else without_backward(out, q, _WHAT, ATTENTION_FIX)
        # both parts stay float32 until the merge: one rounding to q's dtype, not two
        body = self.wrapper.run(q, pools["k"], pools["v"], sm_scale=scale, return_lse=True, seq_lens=st["body"],
                                out=torch.empty(want, dtype=torch.float32, device=q.device))
        out = torch.empty(want, dtype=torch.float32, device=q.device)
        lse = torch.empty(want[:2], dtype=torch.float32, device=q.device)
        launch_plain(self._plain_attn, q, st["k"], st["v"], st["plain"], scale, out, lse)
        out = merge_two_parts(body, (out, lse), q.dtype)[0]   # one launch: eq. 14, written in q's dtype
        return out if not q.requires_grad else without_backward(out, q, _WHAT, ATTENTION_FIX)

    def __deepcopy__(self, memo: dict) -> PagedKVCache:
        """A cache of the same tokens in pools and buffers of its own, planned with the same page table (transformers
        reuses a prompt's cache through ``copy.deepcopy``; a `PagedFoldcCache` holds one of these): its kernels'
        launches and fast paths are made again for the new storage. Python's own copy raised TypeError ("cannot
        pickle 'module' object") from inside the copy."""
        new = PagedKVCache(self.spec, num_layers=self.num_layers, page_size=self.page_size, num_pages=self.num_pages,
                           max_seq_len=self.max_seq_len, sink=self.sink, window=self.window, device=self.device,
                           dtype=self.dtype, target=self.target)
        memo[id(self)] = new
        for mine, theirs in zip(new.pools, self.pools):
            for name in "kv":
                for part in ("codes", "scale", "zero"):
                    getattr(mine[name], part).copy_(getattr(theirs[name], part))
        if self._layers:
            new.table = new.wrapper.plan(self.wrapper.kv_indptr, self.wrapper.kv_indices[:sum(self.table.pages)], None,
                                         num_pages=self.num_pages, seq_lens=list(self.table.seq_lens))
            new.batch, new._owned = self.batch, [list(pages) for pages in self._owned]
            new._layers = [{key: value.clone() if isinstance(value, torch.Tensor) else copy.copy(value)
                            for key, value in st.items()} for st in self._layers]
        return new

    def dequantized(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(k, v, lengths): every token of ``layer`` as float32 ``[batch, kv_heads, max_tokens, head_dim]``
        in token order (sink, body dequantized, recent), padded with zeros. Host loop, for checks."""
        st = self._state(layer)
        lens = self._counts(st)
        out = []
        for name in "kv":
            body, _ = gather_pages(self.pools[layer][name], self.wrapper.kv_indptr,
                                   self.wrapper.kv_indices[:sum(self.table.pages)],
                                   self.table.seq_lens, self.page_size)
            body = body.dequantize(torch.float32) if isinstance(body, AffineTensor) else body.float()
            full = torch.zeros(self.batch, self.spec.num_kv_heads, max(1, max(lens)), self.spec.head_dim,
                               device=self.device)
            for b, n in enumerate(lens):
                m, s = self.body_len(n), min(n, self.sink)
                plain = st[name][b].float()
                full[b, :, :s] = plain[:, :s]
                full[b, :, s:s + m] = body[b, :, :m]
                full[b, :, s + m:n] = plain[:, self.sink:self.sink + n - s - m]
            out.append(full)
        return out[0], out[1], list(lens)
