"""transformers with a static foldc cache: `FoldcStaticCache`, for ``generate`` under ``torch.compile``
and CUDA graphs (transformers compiles the decode step itself when the cache is compileable).

::

    import foldc.integrations.hf as fhf
    from foldc.integrations.hf_static import FoldcStaticCache

    model.set_attn_implementation("foldc")
    cache = FoldcStaticCache(model, max_cache_len=4096, k="token:4:128", v="token:4:128")
    out = model.generate(input_ids, max_new_tokens=64, **{fhf.CACHE_KWARG: cache})

Storage is allocated once, at the first forward, and written in place: each layer holds its
quantized (or plain) keys and values for ``max_cache_len`` tokens, and its token count twice on the
device (a scalar, and one int32 per batch row for the kernels), advanced in place. A compiled decode
step therefore reads and writes only tensors whose addresses never change and asks the host nothing
(an eager one reads the count once, to refuse a token past the storage):
the append is ``torch.ops.foldc.append_kv`` (no checks read back), the attention
``torch.ops.foldc.decode_attention`` over the whole storage with the row counts as lengths, both
custom ops with fake implementations, so the step traces into one graph and replays from a CUDA
graph.

Because it is bound to the model (`FoldcStaticCache(model, ...)` gives the model's attention
modules a shared `StaticSlot`, ``foldc_static``, that each update points at the cache in use), the
"foldc" attention finds the layer without a tag on the key tensor (which tracing cannot carry).

Limits, each refused with the reason: token-wise groups or plain sides only (a channel-wise group
is quantized when its last token arrives: `FoldcCache` keeps the tokens before it plain), no sink or
window, one prompt per cache in eager code (the prompt attends with SDPA over its own keys; a second prompt into
a filled cache is refused; traced, where the host reads nothing, a prompt attends over the tokens held and its own,
`FoldcStaticLayer.prompt_attention`), equal-length rows (no padding), full-attention layers, no beam search or
cropping, inference only, decode steps through the bound model only (another instance or a copy is
refused). The checks a `FoldcCache` makes at every append (NaN/Inf, scale overflow) run at the prompt
only; a padding mask is refused at the prompt and at an eager decode step (a compiled step reads no mask).
"""
from __future__ import annotations

import torch

from ..decisions import GroupAxis
from ..errors import InputError, SpecError, UnsupportedError
from ..ops import append_op, attention_op
from .hf import _TAG, FoldcCache, FoldcLayer, _model_shape

__all__ = ["FoldcStaticCache", "FoldcStaticLayer"]

BOUND = "foldc_static"   # the model's and its attention modules' attribute: their `StaticSlot`


class StaticSlot:
    """What a model's attention modules share: the `FoldcStaticCache` that was updated last (each
    update of a layer names its cache here, so a model may switch between static caches)."""

    __slots__ = ("cache",)

    def __init__(self):
        self.cache = None

    def layer(self, index: int):
        """The layer ``index`` of the cache in use, or None."""
        return None if self.cache is None else self.cache.layers[index]

    def take(self, index: int):
        """`layer`, once: the slot forgets the cache, so that only the attention call right after a
        `FoldcStaticCache` update reads it. A later forward with another cache (a DynamicCache, or
        none) then never attends over this one's tokens."""
        layer = self.layer(index)
        self.cache = None
        return layer


class FoldcStaticLayer(FoldcLayer):
    """One attention layer's static storage (see the module doc)."""

    is_compileable = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        super().lazy_initialization(key_states, value_states)   # checks the shapes, dtype and target
        cache = self.cache
        self.k, self.v = cache._body["k"], cache._body["v"]     # the whole storage, max_cache_len tokens
        self.batch = key_states.shape[0]
        self.length = torch.zeros((), dtype=torch.int64, device=self.device)
        self.row_lengths = torch.zeros(self.batch, dtype=torch.int32, device=self.device)
        if not torch.compiler.is_compiling():   # fixed addresses: CUDA graphs replay them
            for t in self._tensors():
                torch._dynamo.mark_static_address(t)

    def _tensors(self):
        for x in (self.k, self.v):
            yield from ((x.codes, x.scale, x.zero) if hasattr(x, "codes") else (x,))
        yield self.length
        yield self.row_lengths

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        prompt = new > 1
        if prompt and not torch.compiler.is_compiling():   # eager: the prompt is checked on the host
            held = int(self.length)
            if held:
                raise InputError(f"FoldcStaticCache holds {held} tokens and a second prompt of {new} arrived: it "
                                 "takes one prompt, then decode steps; call cache.reset() between prompts")
            if key_states.shape[0] != self.cache.batch:
                raise InputError(f"FoldcStaticCache was built for {self.cache.batch} sequences (its storage stays "
                                 f"where captured graphs read it, reset() included) but the prompt has "
                                 f"{key_states.shape[0]}; build a new FoldcStaticCache for another batch")
            if new > self.max_cache_len:
                raise InputError(f"a prompt of {new} tokens does not fit FoldcStaticCache(max_cache_len="
                                 f"{self.max_cache_len}); build it with max_cache_len >= prompt + max_new_tokens")
            self.cache.append(key_states, value_states)   # the checks of FoldcCache's appends, then the bits
        else:
            # eager, the host reads the count and refuses a token past the storage; traced (compiled), it reads
            # nothing and the appends skip such tokens (a plain side's copy too, `_traced_copy`): generate stops at
            # max_cache_len when the cache was built for prompt + max_new_tokens
            if not torch.compiler.is_compiling() and int(self.length) + new > self.max_cache_len:
                raise InputError(f"FoldcStaticCache(max_cache_len={self.max_cache_len}) is full: {new} more "
                                 "token(s) do not fit; build it with max_cache_len >= prompt + max_new_tokens")
            self._check_step(key_states, value_states, new)
            for x, dst in ((key_states, self.k), (value_states, self.v)):
                if hasattr(dst, "codes"):
                    append_op(dst, x, self.row_lengths, check=False)
                elif torch.compiler.is_compiling():
                    dst.index_copy_(2, *self._traced_copy(dst, x.to(dst.dtype), self.length))
                else:
                    positions = self.length + torch.arange(new, device=self.device)
                    dst.index_copy_(2, positions, x.to(dst.dtype))
        if prompt and torch.compiler.is_compiling():   # where this prompt starts: `prompt_attention` reads it
            self.prompt_start = self.length.clone()
        self.length.add_(new)
        self.row_lengths.add_(new)
        if prompt:   # causal SDPA over the prompt's own keys (foldc_attention's prefill path)
            keys = key_states.view(key_states.shape)
            setattr(keys, _TAG, (self, "prefill"))
            return keys, value_states
        return key_states, value_states

    def _traced_copy(self, dst: torch.Tensor, x: torch.Tensor, start: torch.Tensor) -> tuple:
        """(positions, values) for ``dst.index_copy(2, ...)`` of a traced step's tokens ``x`` from ``start`` (a
        device scalar), those past the storage skipped as the append kernels skip them (index_copy_ at such a
        position raised IndexError on the CPU, a device-side assert on a GPU; clamped to the last slot, they
        overwrote the token that slot holds): they are aimed at the last slot with the value it gets anyway (its
        token of this step, or the one held)."""
        last = self.max_cache_len - 1
        positions = (start + torch.arange(x.shape[2], device=start.device)).clamp(max=last)
        values = x.index_select(2, (positions - start).clamp(min=0))
        return positions, torch.where(start > last, dst.index_select(2, positions), values)

    def _check_step(self, key_states: torch.Tensor, value_states: torch.Tensor, new: int) -> None:
        """Refuse a decode step's keys or values not shaped as the storage takes them, before either side is written
        (a plain side's copy raised from inside torch). Shapes only: nothing is read from the device."""
        want = (self.batch, self.spec.num_kv_heads, new, self.spec.head_dim)
        for name, x in (("key_states", key_states), ("value_states", value_states)):
            if tuple(x.shape) != want:
                raise InputError(f"{name} shape={tuple(x.shape)} but FoldcStaticCache holds {want[0]} sequences of "
                                 f"{want[1]} KV heads of head_dim {want[3]}: a decode step passes {want}; build a new "
                                 "FoldcStaticCache for another batch or model")

    def prompt_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         scaling: float) -> torch.Tensor:
        """A traced (compiled) prompt's attention ``[batch, q_len, heads, head_dim]``: each of its q_len tokens over
        the tokens held before it (their stored bits, dequantized) and the prompt's own up to itself (``key``,
        ``value`` as given, at their positions). Traced, the host cannot read how many tokens are held (eager, a
        second prompt is refused): it attends over the whole storage, positions past the prompt's token masked. A
        prompt into an empty cache gives what attention over its own keys gives; a chunk after it (chunked prefill,
        a later turn) attends to the chunks before it."""
        _, heads, q_len, _ = query.shape
        start = self.prompt_start
        positions = (start + torch.arange(q_len, device=start.device)).clamp(max=self.max_cache_len - 1)
        work = key.dtype if key.dtype.itemsize > query.dtype.itemsize else query.dtype  # float32 K/V: float32 math
        full = []
        for store, new in ((self.k, key), (self.v, value)):
            values = store.dequantize(torch.float32) if hasattr(store, "codes") else store
            values = values.to(work)   # (a copy: the storage is never written here)
            copy = self._traced_copy(values, new.to(work), start)   # (the last slot's token, not one past it)
            full.append(values.index_copy(2, *copy).repeat_interleave(heads // new.shape[1], 1))
        allowed = torch.arange(self.max_cache_len, device=start.device)[None, :] <= positions[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(query.to(work), full[0], full[1], attn_mask=allowed,
                                                               scale=scaling)
        return out.to(query.dtype).transpose(1, 2).contiguous()

    def attention(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Decode attention of ``query [batch, heads, 1, head_dim]`` over every token of the layer:
        ``[batch, 1, heads, head_dim]``."""
        out = attention_op(self.spec, query[:, :, 0], self.k, self.v, sm_scale=scaling, seq_lens=self.row_lengths)
        return out.unsqueeze(1)

    def get_seq_length(self, *args):
        return self.length if self.is_initialized else 0

    def get_mask_sizes(self, query, *args) -> tuple[int, int]:
        return self.max_cache_len, 0

    def reset(self) -> None:
        if self.is_initialized:   # storage kept (its addresses are in captured graphs); counts back to 0
            self.length.zero_()
            self.row_lengths.zero_()
            self.cache.reset()    # the next prompt is written from token 0, where attention reads it

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise UnsupportedError(f"FoldcStaticCache cannot drop tokens (crop({tokens_to_remove}), assisted or "
                                   "speculative decoding): they are quantized in place. Use greedy or sampled "
                                   "decoding")


#: the projections that mark a transformers attention module (separate, or fused: Phi-3, GPT-NeoX and Falcon, GPT-2
#: and GPTBigCode, MPT/DBRX)
PROJECTIONS = ("q_proj", "qkv_proj", "query_key_value", "c_attn", "Wqkv")


class FoldcStaticCache(FoldcCache):
    """A compileable foldc cache bound to ``model`` (module doc). ``max_cache_len``, ``k``, ``v`` and
    ``target`` as `FoldcCache`; no sink or window. Its layers' ``length`` (a device scalar) counts their
    tokens; ``layer_caches`` (the `QuantizedKVCache` s that checked and stored the prompt) count the
    prompt only."""

    layer_class = FoldcStaticLayer

    def __init__(self, model, max_cache_len: int, *, k, v, target: str = "auto"):
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise SpecError(f"FoldcStaticCache(model, ...) takes the transformers model itself (its attention "
                            f"layers are bound to the cache), got {type(model).__name__}")
        super().__init__(model.config, max_cache_len, k=k, v=v, target=target)
        for name, enc in (("k", self.spec.k), ("v", self.spec.v)):
            if enc is not None and GroupAxis.of(enc) is GroupAxis.TOKEN:   # a channel-wise encoding
                raise SpecError(f"{name}={enc.short()!r}: FoldcStaticCache takes token-wise groups or a plain side "
                                "(a channel-wise group is quantized when its last token arrives); use a token-wise "
                                "encoding, or FoldcCache")
        if getattr(self.config, "alibi", False) is True:   # (a bias in the mask, which a compiled step does not read)
            raise SpecError("the model adds an ALiBi position bias to its attention mask (alibi=True), which foldc "
                            "attention does not apply; run it with attn_implementation='sdpa' and DynamicCache")
        _, _, _, layers = _model_shape(self.config)
        slot = getattr(model, BOUND, None)
        if not isinstance(slot, StaticSlot):
            slot = StaticSlot()
            object.__setattr__(model, BOUND, slot)   # a plain attribute (nn.Module keeps no state of it)
        self._slot = slot
        bound = 0
        for module in model.modules():
            idx = getattr(module, "layer_idx", None)
            if isinstance(idx, int) and 0 <= idx < layers and any(hasattr(module, n) for n in PROJECTIONS):
                object.__setattr__(module, BOUND, slot)
                bound += 1
        if bound != layers:
            raise SpecError(f"FoldcStaticCache found {bound} attention modules (with layer_idx and one of "
                            f"{', '.join(PROJECTIONS)}) in the model but its config has {layers} layers; use "
                            "FoldcCache for this model")

    @property
    def is_compileable(self) -> bool:
        return True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        slot = self._slot
        if slot.cache is self and key_states.shape[-2] == 1:
            # the attention after this cache's last update did not take it from the slot (`StaticSlot.take`): the
            # modules that ran are not the bound model's, and this step's would attend over its new token alone
            raise SpecError("the attention of the last forward did not read this FoldcStaticCache: its decode steps "
                            "attend through the attention modules of the model it was built from, and the model "
                            "that runs is another one (another instance, or a copy such as copy.deepcopy(model)) "
                            "or does not attend through attn_implementation='foldc'. Build FoldcStaticCache(model, "
                            "...) from the model that runs (this cache refuses decode steps until reset())")
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        slot.cache = self   # the model's attention reads this cache's layers from now on
        return keys, values

    def __deepcopy__(self, memo: dict):
        """`FoldcCache`'s copy, bound to the same model: the slot its attention modules read is the model's."""
        memo[id(self._slot)] = self._slot
        return super().__deepcopy__(memo)

    def reset(self) -> None:
        super().reset()
        if self._slot.cache is self:   # (an update whose attention did not take it)
            self._slot.cache = None

