"""Hugging Face transformers: decode through foldc with ``generate``.

::

    import foldc.integrations.hf as fhf        # registers the "foldc" attention implementation

    model.set_attn_implementation("foldc")     # or from_pretrained(..., attn_implementation="foldc")
    cache = fhf.FoldcCache(model.config, max_cache_len=4096, k="token:4:32", v="token:4:32")
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=64)
    # recent transformers name the argument ``cache=`` (``past_key_values=`` still works, with a
    # FutureWarning): ``model.generate(input_ids, **{fhf.CACHE_KWARG: cache}, ...)`` fits both

How it works. Attention layers call ``cache.update(k, v, layer_idx)`` after the rotary embedding
and then the registered attention function with what ``update`` returned:

- `FoldcCache` holds one `foldc.serving.QuantizedKVCache` per layer (quantized body, plain sink
  and recent window). ``update`` appends the new keys and values to it.
- Prefill (more than one new token): ``update`` returns the full-precision keys and values (the
  dequantized cached tokens, if any, then the new ones) and `foldc_attention` runs causal
  attention over them with ``torch.nn.functional.scaled_dot_product_attention``. The prompt thus
  attends exactly as with the default cache; only later tokens see its quantized form.
- Decode (one new token): ``update`` returns the new token only, tagged with its layer, and
  `foldc_attention` calls ``QuantizedKVCache.attention``, the fused folded kernel over the whole
  cache. Nothing is dequantized.

`DequantizedFoldcCache` is the same cache (same storage, same bits) whose decode steps attend by
dequantize-then-SDPA instead: the baseline the fused decode must match up to float rounding,
whatever the encoding (tests/integrations/test_hf.py, examples/hf_decode.py).

Limits (each raises an error that says so): every batch row holds the same number of tokens (no
padding masks: pass rows of one length), full-attention layers only (no sliding-window, chunked
or linear-attention layers, no soft-capping, learned sinks, position biases or sparse key selection; a sliding
window max_cache_len never reaches, of every layer (Mistral's, Phi-3's) or of sliding layers (Gemma 3's), is full
attention), no beam search, no cropping
(assisted or speculative decoding), inference only. Keys are cached after the rotary embedding,
so positions need nothing from foldc.

Targets: ``"auto"`` (the generated Triton kernel on CUDA, fp16/bf16 models; Triton's interpreter
on the CPU, fp16 models only), ``"interpret"``, ``"sm_90"``, ``"sm_100"``, or ``"reference"`` (the
float64 executor, any model dtype, any device: slow, exact, for checking).
"""
from __future__ import annotations

import copy
import inspect

import torch
import torch.nn.functional as F

from ..encoding import Affine, parse_affine
from ..errors import InputError, SpecError, UnsupportedError
from ..compile import TARGETS as CACHE_TARGETS
from ..serving import QuantizedKVCache
from ..spec import AttentionSpec

try:
    import transformers
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, create_causal_mask
    from transformers.modeling_utils import AttentionInterface
except ImportError as err:  # pragma: no cover - exercised only without transformers
    raise ImportError("foldc.integrations.hf needs transformers>=4.56 (the layered Cache API): "
                      "pip install 'foldc[hf]'") from err

ATTN_IMPLEMENTATION = "foldc"
_TAG = "_foldc_step"  # attribute set on the key tensor that FoldcCache.update returns
# the name of generate's cache argument: "cache" since transformers renamed it ("past_key_values"
# is still accepted there, with a FutureWarning), "past_key_values" before
CACHE_KWARG = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"

__all__ = ["ATTN_IMPLEMENTATION", "CACHE_KWARG", "DequantizedFoldcCache", "FoldcCache", "FoldcLayer",
           "foldc_attention", "quantize_model", "register"]


def _encoding(value, name: str) -> Affine | None:
    if value is None or isinstance(value, Affine):
        return value
    if isinstance(value, str):
        return None if value.strip() in ("", "none", "plain") else parse_affine(value)
    raise SpecError(f"{name}={value!r} must be a foldc.Affine, a string like 'token:4:32', or None (plain)")


def _model_shape(config) -> tuple[int, int, int, int]:
    """(num_q_heads, num_kv_heads, head_dim, num_layers) of a decoder config."""
    heads = getattr(config, "num_attention_heads", None)
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(heads, int) or not isinstance(layers, int):
        raise SpecError(f"config {type(config).__name__} has no integer num_attention_heads / num_hidden_layers; "
                        "pass the model's (text) config, e.g. model.config")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv_heads, head_dim, layers


def _window_tokens(value) -> int | None:
    """A ``sliding_window`` as its count of tokens, or None where it is none (a bool, not an int, or not positive)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _check_windows(config, layer_types, max_cache_len: int) -> None:
    """Refuse the layers FoldcCache cannot hold: foldc attends over every cached token, so a sliding window that
    ``max_cache_len`` can pass hides tokens it would attend to; a window it never reaches makes a layer full
    attention. Without ``layer_types`` the config's ``sliding_window`` applies to every layer (Mistral, Mixtral,
    Phi-3, PhiMoE, Starcoder2, ...; PhiMoE applies it through the mask alone, which a compiled `FoldcStaticCache`
    step does not read: it was ignored, silently); with them, the sliding layers they list (Gemma 2 and 3, Qwen2
    with use_sliding_window). Chunked and linear-attention layers are refused."""
    window = _window_tokens(getattr(config, "sliding_window", None))
    never = window is not None and window >= max_cache_len   # (a sliding layer of no readable window: refused)
    fits = f"a cache of max_cache_len <= {window} never reaches the window"
    if layer_types is not None:
        bad = sorted({t for t in layer_types if t != "full_attention" and not (t == "sliding_attention" and never)})
        if bad:
            fix = f" ({fits})" if bad == ["sliding_attention"] and window is not None else ""
            raise SpecError(f"the model has {bad} layers; FoldcCache holds full-attention layers only{fix}")
    elif window is not None and not never and getattr(config, "use_sliding_window", True) is not False:
        raise SpecError(f"the model's config has sliding_window={window}: each token attends to the last {window} "
                        f"tokens only, but foldc attends over every cached token and max_cache_len={max_cache_len} "
                        f"holds more; run this model with DynamicCache and attn_implementation='sdpa' ({fits})")


class FoldcLayer(CacheLayerMixin):
    """One attention layer's cache: a `QuantizedKVCache`, built on the first update (which fixes the
    batch size, model dtype and device) and dropped by `reset` (the next update builds a new one)."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, spec: AttentionSpec, max_cache_len: int, sink: int, window: int, target: str):
        super().__init__()
        self.keys = self.values = None  # transformers' own layers keep tensors here; this one keeps self.cache
        self.is_initialized = False
        self.spec, self.max_cache_len, self.sink, self.window, self.target = spec, max_cache_len, sink, window, target
        self.cache: QuantizedKVCache | None = None
        self.module_checked = None   # the attention module whose attributes (learned sinks) were checked
        # why a forward failed after this layer's update, leaving the cache's layers out of step (one list shared by
        # a FoldcCache's layers: its next forward is refused with it until reset())
        self.refusal = [None]

    def __repr__(self) -> str:
        return f"FoldcLayer({self.cache!r})" if self.cache is not None else f"FoldcLayer({self.spec.describe()}, empty)"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        batch, heads, _, head_dim = key_states.shape
        if (heads, head_dim) != (self.spec.num_kv_heads, self.spec.head_dim):
            raise InputError(f"key states have {heads} heads of {head_dim} channels but the cache was built for "
                             f"{self.spec.num_kv_heads} KV heads of head_dim={self.spec.head_dim}: build FoldcCache "
                             "from this model's config; if it was, this architecture caches keys of another shape "
                             "than its config's heads (e.g. DeepSeek's compressed MLA keys), which FoldcCache does "
                             "not hold")
        cpu = key_states.device.type == "cpu"
        if self.target == "interpret" or (self.target == "auto" and cpu):
            if not cpu or key_states.dtype != torch.float16:
                raise SpecError(f"FoldcCache target={self.target!r} runs Triton's interpreter here, float16 on the "
                                f"CPU only, but the model runs in {key_states.dtype} on {key_states.device}: use "
                                "model.half() on the CPU, target='reference' (any dtype), or a GPU")
        self.cache = QuantizedKVCache(self.spec, batch, self.max_cache_len, sink=self.sink, window=self.window,
                                      device=key_states.device, dtype=key_states.dtype, target=self.target)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        cache = self.cache
        new = key_states.shape[-2]
        if cache.num_tokens + new > self.max_cache_len:
            raise InputError(f"FoldcCache(max_cache_len={self.max_cache_len}) holds {cache.num_tokens} tokens and "
                             f"{new} more do not fit; build it with max_cache_len >= prompt + max_new_tokens")
        if new == 1:  # decode: the attention reads the whole cache itself
            try:
                cache.append(key_states, value_states)
            except InputError:   # (no check on the step's path: the cache's own refuses another device)
                if key_states.device != self.device:
                    raise self._moved(key_states.device) from None
                raise
            _DECODING[0] = self
            keys, values, step = key_states, value_states, "decode"
        else:  # prefill: full-precision attention over the cached tokens (dequantized) and the new ones
            if key_states.device != self.device:
                raise self._moved(key_states.device)
            if cache.num_tokens:
                if key_states.shape[0] != cache.batch:
                    raise InputError(f"this FoldcCache holds {cache.batch} sequences but the prompt has "
                                     f"{key_states.shape[0]}; call cache.reset() before a prompt of another batch")
                old_k, old_v = cache.dequantized()
                keys = torch.cat([old_k.to(key_states.dtype), key_states], dim=-2)
                values = torch.cat([old_v.to(value_states.dtype), value_states], dim=-2)
            else:
                keys, values = key_states, value_states
            cache.append(key_states, value_states)
            step = "prefill"
        if step == "prefill":
            keys = keys.view(keys.shape)  # a fresh tensor object to carry the tag
        # a decode step's key is the model's own new tensor: tagged as it is (a view costs a torch call per layer)
        setattr(keys, _TAG, (self, step))
        return keys, values

    def _moved(self, device: torch.device) -> InputError:
        """The error for key states on another ``device`` than this layer's cache, built by its first forward on
        its device (the cache's own check told the caller to move the model's states to the cache)."""
        return InputError(f"this layer's key and value states are on {device} but its FoldcCache layer was built on "
                          f"{self.device} by the first forward: for a model moved to {device} since, call "
                          f"cache.reset() (its tokens are dropped) or use a new FoldcCache; a model split across "
                          f"devices keeps each layer on one device")

    def get_seq_length(self, *args) -> int:
        return self.cache.num_tokens if self.cache is not None else 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    get_max_cache_shape = get_max_length  # the name before transformers 5

    def get_mask_sizes(self, query, *args) -> tuple[int, int]:
        # transformers 5 passes the query length, 4.5x the cache_position tensor
        query_length = query if isinstance(query, int) else int(query.shape[0])
        return self.get_seq_length() + query_length, 0

    def reset(self) -> None:
        self.cache = None
        self.is_initialized = False

    def offload(self) -> None:
        raise UnsupportedError("FoldcCache does not offload layers to the CPU (offload): keep it on the model's "
                               "device")

    def prefetch(self) -> None:
        raise UnsupportedError("FoldcCache does not offload layers to the CPU (prefetch): keep it on the model's "
                               "device")

    def _refuse(self, what: str) -> None:
        if self.get_seq_length():
            raise UnsupportedError(f"FoldcCache cannot {what}: its tokens are quantized in place. Use greedy or "
                                   "sampled decoding with one sequence per prompt (no beam search, assisted or "
                                   "speculative decoding)")

    def crop(self, tokens_to_remove: int) -> None:
        # 0 removes nothing; transformers < 5 passed the length to keep, which is a no-op when it is the length
        if tokens_to_remove and tokens_to_remove != self.get_seq_length():
            self._refuse(f"drop tokens (crop({tokens_to_remove}), assisted or speculative decoding)")

    def reorder_cache(self, beam_idx) -> None:
        self._refuse("reorder its batch (reorder_cache, beam search)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            self._refuse(f"repeat its batch rows (batch_repeat_interleave({repeats}))")

    def batch_select_indices(self, indices) -> None:
        self._refuse("select batch rows (batch_select_indices)")


class FoldcCache(Cache):
    """A transformers `Cache` whose layers are foldc `QuantizedKVCache` s, for ``generate`` with
    ``attn_implementation="foldc"``.

    Args:
        config: the model's config (``model.config``); gives heads, KV heads, head_dim and layers.
            Its ``_attn_implementation`` must be ``"foldc"`` when the cache is updated.
        max_cache_len: most tokens per sequence (prompt + generated).
        k, v: the encodings of keys and values: a `foldc.Affine`, its text (``"token:4:32"``,
            ``"channel:2:64:bf16"``, see README) or None / ``"none"`` to keep that operand in the model dtype.
        sink, window: plain first tokens and plain recent tokens (see `QuantizedKVCache`).
        target: ``"auto"``, ``"interpret"``, ``"sm_90"``, ``"sm_100"`` or ``"reference"`` (module doc).

    Batch size, model dtype and device come from the first forward. `reset` forgets everything
    (the next forward may use another batch size). Every batch row must hold the same tokens
    (no padding).
    """

    layer_class = FoldcLayer

    def __init__(self, config, max_cache_len: int, *, k, v, sink: int = 0, window: int = 0, target: str = "auto"):
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        heads, kv_heads, head_dim, num_layers = _model_shape(text)
        layer_types = getattr(text, "layer_types", None)
        for name, value, least in (("max_cache_len", max_cache_len, 1), ("sink", sink, 0), ("window", window, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise SpecError(f"{name}={value!r} must be " + ("a positive integer" if least else "an integer >= 0"))
        _check_windows(text, layer_types, max_cache_len)
        if target not in CACHE_TARGETS:
            raise SpecError(f"target={target!r} is not available; use one of {CACHE_TARGETS}")
        self.spec = AttentionSpec(heads, kv_heads, head_dim, k=_encoding(k, "k"), v=_encoding(v, "v"))
        self.config = text
        self._max_cache_len = max_cache_len  # (transformers < 5 derives max_cache_len from the layers)
        super().__init__(layers=[self.layer_class(self.spec, max_cache_len, sink, window, target)
                                 for _ in range(num_layers)])
        self._share_refusal()

    def _share_refusal(self) -> None:
        """One refusal for all the layers (`FoldcLayer.refusal`): a forward that fails at any layer marks the cache."""
        self.refusal = [None]
        for layer in self.layers:
            layer.refusal = self.refusal

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec.describe()}, layers={len(self.layers)}, max_cache_len={self._max_cache_len})"

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # read at each forward's first layer (a config attribute costs a few µs through transformers' lookups;
        # the implementation does not change between a forward's layers)
        impl = getattr(self.config, "_attn_implementation", None) if layer_idx == 0 else ATTN_IMPLEMENTATION
        if layer_idx == 0:   # a new forward: its mask is read again, even the last one's tensor refilled in place
            _MASK_READ[0] = None
            if self.refusal[0] is not None:
                raise InputError(self.refusal[0])
        if impl != ATTN_IMPLEMENTATION:
            raise SpecError(f"FoldcCache decodes through attn_implementation={ATTN_IMPLEMENTATION!r} but the model "
                            f"uses {impl!r}; import foldc.integrations.hf and call "
                            f"model.set_attn_implementation({ATTN_IMPLEMENTATION!r}) (or load the model with "
                            f"attn_implementation={ATTN_IMPLEMENTATION!r})")
        try:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        except Exception as err:   # (a try costs nothing on the way through)
            if layer_idx:   # the layers before this one cached this forward's tokens (the first refuses before)
                self.refusal[0] = _refusal_text(err)
            raise

    def reset(self) -> None:
        super().reset()
        self.refusal[0] = None

    def __deepcopy__(self, memo: dict):
        """A cache of the same tokens in storage of its own (transformers reuses a prompt's cache through
        ``copy.deepcopy``; each layer's `QuantizedKVCache` copies itself). What belongs to the model is shared, not
        copied: its config and the attention modules the layers checked (a copy of each held its weights)."""
        for layer in self.layers:
            if layer.module_checked is not None:
                memo[id(layer.module_checked)] = layer.module_checked
        memo[id(self.config)] = self.config
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for name, value in vars(self).items():
            setattr(new, name, copy.deepcopy(value, memo))
        return new

    def get_mask_sizes(self, query, layer_idx: int = 0, *args) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query)

    @property
    def layer_caches(self) -> list[QuantizedKVCache | None]:
        """Each layer's `QuantizedKVCache` (None before the first forward)."""
        return [layer.cache for layer in self.layers]


class DequantizedFoldcLayer(FoldcLayer):
    """A `FoldcLayer` whose decode steps hand the attention every cached token, dequantized to float32
    (untagged: `foldc_attention` then runs SDPA over them in float32 and rounds the output once)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if getattr(keys, _TAG)[1] == "decode":
            keys, values = self.cache.dequantized()  # float32: foldc_attention attends in float32
            _DECODING[0] = None                      # (untagged on purpose: the whole cache, not the new token)
        return keys, values


class DequantizedFoldcCache(FoldcCache):
    """`FoldcCache` with dequantize-then-attend decode steps: the same quantized tokens (appends are
    bit-identical across targets), attention by float32 SDPA over their dequantized values, output in
    the model dtype. A baseline for checking the fused decode, not for speed."""

    layer_class = DequantizedFoldcLayer


# ---- the attention function ----------------------------------------------------------------------

def _allowed(mask: torch.Tensor) -> torch.Tensor:
    """Boolean 'may attend' of a transformers mask (boolean, or additive float with 0 = attend)."""
    return mask if mask.dtype == torch.bool else mask == 0


def _causal(q_len: int, kv_len: int, device) -> torch.Tensor:
    """[q_len, kv_len] lower-right aligned causal mask (the queries are the last q_len tokens)."""
    rows = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    return rows >= torch.arange(kv_len, device=device)[None, :]


_DECODING = [None]    # the FoldcLayer whose decode update awaits its attention call (`foldc_attention`)
_MASK_READ = [None]   # the decode mask last read and found without padding (`foldc_attention`)
_PADDING = ("FoldcCache holds sequences of one length: padding masks are not supported. Pass batch rows of "
            "equal length without padding (an attention_mask of all ones), or decode them one at a time")


# attention arguments that change the scores or the softmax, which foldc attention does not apply (``indices``,
# ``block_indices``: the keys a sparse attention selects, DeepSeek-V3.2's indexer, MiniMax-M3's blocks, which such a
# model puts in the mask only for eager and SDPA)
_REFUSED = ("softcap", "sliding_window", "s_aux", "sinks", "position_bias", "indices", "block_indices")
# the arguments transformers' SDPA refuses too (softcap) or whose models do not take SDPA (Gemma2, gpt-oss: sinks)
_EAGER_ONLY = {"softcap": "eager", "s_aux": "eager", "sinks": "eager"}


def _shown(value) -> str:
    """``value`` for an error message: a tensor by its shape, not its values."""
    return f"<tensor {tuple(value.shape)}>" if isinstance(value, torch.Tensor) else repr(value)


def _is_causal(module, kwargs: dict) -> bool:
    """Whether a call without a mask attends causally: the call's ``is_causal`` where it passes one, else the module's
    (transformers' SDPA reads both; an encoder's attention, e.g. a VLM's vision tower, is not causal)."""
    flag = kwargs.get("is_causal")
    return bool(getattr(module, "is_causal", True) if flag is None else flag)


def _window_binds(window, module, key: torch.Tensor, layer) -> bool:
    """Whether a ``sliding_window`` argument can hide a key from this call's queries (a query attends to the keys
    less than ``window`` positions before it): a foldc cache layer's queries see at most its max_cache_len tokens
    (Mistral and Phi-3 pass their config's window to every layer; the caches take a window max_cache_len never
    reaches), another call's its keys."""
    if layer is None:   # a FoldcStaticCache's layer, if the module is bound to one (its key is the new token)
        slot = getattr(module, "foldc_static", None)
        layer = slot.layer(module.layer_idx) if slot is not None else None
    reach = layer.max_cache_len if layer is not None else key.shape[-2]
    return _window_tokens(window) is None or reach > window


def _refusal_text(err: Exception) -> str:
    """What the next forward through a cache is told after ``err`` failed a forward partway through its layers."""
    return (f"this cache's layers no longer hold the same tokens: its last forward failed ({type(err).__name__}: "
            f"{err}) after some layers had cached that forward's keys and values and before the others did. Call "
            "cache.reset() (its tokens are dropped) or use a new cache, and send the prompt again")


def _mask_error(mask: torch.Tensor) -> Exception:
    """The error for a mask that hides cached tokens: padding, unless an additive mask holds values other than 0 and
    its masked value (a position bias the model adds to the mask: Falcon's ALiBi), which no padding fixes."""
    if not mask.dtype.is_floating_point:
        return InputError(_PADDING)
    bias = (mask != 0) & (mask > torch.finfo(mask.dtype).min / 2)
    if not bool(bias.any()):
        return InputError(_PADDING)
    value = float(mask[bias].flatten()[0])
    return SpecError(f"the attention mask holds an additive bias (e.g. {value:.4g}, neither 0 nor masked): the model "
                     "adds a position bias to its mask (ALiBi, as Falcon's alibi=True), which foldc attention does not "
                     "apply; run this model with attn_implementation='sdpa' and DynamicCache")


def _check_decode_mask(mask: torch.Tensor | None, tokens=None) -> None:
    """Refuse a decode step's mask that hides any of the first ``tokens`` (all: None) tokens, reading each mask
    object once: the layers of one forward share it, so the first layer it reaches reads it."""
    if mask is not None and mask is not _MASK_READ[0]:
        if not bool(_allowed(mask if tokens is None else mask[..., :int(tokens)]).all()):
            raise _mask_error(mask)
        _MASK_READ[0] = mask   # held, so that its identity is not another tensor's


def foldc_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs):
    """The ``"foldc"`` attention implementation: `QuantizedKVCache.attention` for a decode step of a
    `FoldcCache`, SDPA otherwise (causal unless the call or the module says ``is_causal=False``). Shapes as
    transformers' attention functions: query [batch, heads, q_len, head_dim], key/value [batch, kv_heads, kv_len,
    head_dim]; returns ([batch, q_len, heads, head_dim], None)."""
    owner = None
    try:
        layer, step = getattr(key, _TAG, (None, None))
        owner = layer   # the foldc cache layer this call's update wrote to, once known: a failure marks its cache
        if dropout:
            raise SpecError(f"dropout={dropout} in foldc attention: it is for inference; call model.eval()")
        for name in _REFUSED:   # (an argument the SDPA path would also drop: T5's relative bias, Inkling's sinks...)
            if kwargs.get(name) is not None and (name != "sliding_window" or _window_binds(kwargs[name], module, key,
                                                                                           layer)):
                raise SpecError(f"{name}={_shown(kwargs[name])}: foldc attention supports plain softmax attention "
                                "over the whole cache only; run this model (or these layers) with "
                                f"attn_implementation={_EAGER_ONLY.get(name, 'sdpa')!r}")
        if kwargs.get("output_attentions"):
            raise SpecError("output_attentions=True: foldc attention does not return attention weights")
        # a module's attributes are read once per layer (a missing attribute of an nn.Module costs an exception)
        if layer is None or layer.module_checked is not module:
            if getattr(module, "sinks", None) is not None:
                raise SpecError("the attention module has learned sinks; foldc attention does not support them: run "
                                "this model with attn_implementation='eager'")
            if layer is not None:
                layer.module_checked = module
        if layer is None and _DECODING[0] is not None:
            # a FoldcLayer's decode update came before this call, but its tagged key did not reach it: the model
            # replaced the key cache.update returned (JetMoe's key.repeat, a key norm or pad after the update), so
            # the key here is the new token's alone, not the cache's
            owner, _DECODING[0] = _DECODING[0], None
            raise SpecError("the key reaching foldc attention is not the one FoldcCache.update returned: this model "
                            "changes the key after the cache's update (e.g. a repeat, norm or pad in its attention), "
                            "which FoldcCache cannot follow; use DynamicCache with this model")
        if step == "decode":   # a FoldcCache's decode step: the fused kernel over the layer's whole cache
            _DECODING[0] = None
            if query.shape[2] != 1:
                raise InputError(f"a decode step of FoldcCache appended 1 token but the query holds {query.shape[2]}")
            # each forward's mask is read once (a read waits for the GPU), by the first layer it reaches: the layers
            # of one forward share the mask object, and a serving loop may pad any step, not only the prompt
            _check_decode_mask(attention_mask)
            if scaling is None:
                scaling = query.shape[3] ** -0.5
            q3 = query.squeeze(2)   # [batch, heads, head_dim] (a squeeze costs half an index's host time)
            out = layer.cache.attention(q3 if q3.stride(-1) == 1 else q3.contiguous(), sm_scale=scaling)
            return (out if out.dtype == query.dtype else out.to(query.dtype)).unsqueeze(1), None
        batch, heads, q_len, head_dim = query.shape
        kv_heads, kv_len = key.shape[1], key.shape[2]
        if heads % kv_heads:
            raise InputError(f"query has {heads} heads, not a multiple of the {kv_heads} key/value heads")
        if scaling is None:
            scaling = head_dim ** -0.5
        # a FoldcStaticCache's decode step (foldc/integrations/hf_static.py): the module is bound to its layer and
        # the key is the new token, untagged (tracing carries no tag; eager, FoldcCache's keys are tagged)
        slot = getattr(module, "foldc_static", None)
        # taken once: a stale slot (a forward after the static cache's, with another cache) must not be read
        static = slot.take(module.layer_idx) if slot is not None else None
        if owner is None:
            owner = static
        if (static is not None and q_len == 1 and kv_len == 1 and static.is_initialized
                and (torch.compiler.is_compiling() or layer is None)):
            # eager, each forward's mask is read once, over the tokens held, as for FoldcCache (traced: nothing is
            # read)
            if not torch.compiler.is_compiling():
                _check_decode_mask(attention_mask, static.length)
            return static.attention(query, scaling), None

        if static is not None and q_len > 1 and static.is_initialized and torch.compiler.is_compiling():
            # a traced prompt into a FoldcStaticCache: over the tokens it holds and the prompt's own (eager, the
            # host refuses a prompt into a cache that holds tokens)
            return static.prompt_attention(query, key, value, scaling), None
        if layer is not None and attention_mask is not None:
            causal = _causal(q_len, kv_len, query.device)
            allowed = _allowed(attention_mask[..., :kv_len])
            if not torch.equal(allowed, causal.expand_as(allowed)):
                raise _mask_error(attention_mask)
        if heads != kv_heads:
            key = key.repeat_interleave(heads // kv_heads, dim=1)
            value = value.repeat_interleave(heads // kv_heads, dim=1)
        mask, is_causal = None, False
        if attention_mask is not None:
            mask = attention_mask[..., :kv_len]
        elif q_len > 1 and _is_causal(module, kwargs):   # a bidirectional module (an encoder's) attends to all
            # a foldc cache's prefill key holds its cached tokens, then the new ones: lower-right aligned. Another
            # cache's key without a mask is transformers' SDPA case, upper-left aligned (is_causal): a prompt into an
            # empty StaticCache, whose key holds max_cache_len slots, the prompt's first
            if q_len == kv_len or layer is None:
                is_causal = True
            else:
                mask = _causal(q_len, kv_len, query.device)
        work = key.dtype if key.dtype.itemsize > query.dtype.itemsize else query.dtype  # float32 K/V: float32 math
        out = F.scaled_dot_product_attention(query.to(work), key.to(work), value.to(work), attn_mask=mask,
                                             is_causal=is_causal, scale=scaling)
        return out.to(query.dtype).transpose(1, 2).contiguous(), None
    except Exception as err:   # (a try costs nothing on the way through)
        if owner is not None:   # this layer and those before it cached this forward's tokens, those after it did not
            owner.refusal[0] = _refusal_text(err)
        raise


def register() -> str:
    """Register `foldc_attention` as ``"foldc"`` with transformers' attention interface, and the SDPA
    mask builder for it (so that padding reaches `foldc_attention` and is refused). Done on import;
    returns the name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, foldc_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return ATTN_IMPLEMENTATION


register()
TRANSFORMERS_VERSION = transformers.__version__

from .hf_weights import load_quantized, quantize_model  # noqa: E402,F401  (the linear layers: hf_weights.py)
