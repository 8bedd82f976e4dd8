"""transformers with a paged foldc cache: `PagedFoldcCache`, the `FoldcCache` of foldc.integrations.hf
with every layer kept in one `foldc.serving.PagedKVCache` (page pools, bf16/fp16 sink and window).

::

    import foldc.integrations.hf as fhf
    from foldc.integrations.hf_paged import PagedFoldcCache

    model.set_attn_implementation("foldc")
    cache = PagedFoldcCache(model.config, max_cache_len=4096, k="token:4:128", v="token:4:128", window=128)
    out = model.generate(input_ids, max_new_tokens=64, **{fhf.CACHE_KWARG: cache})

The cache adds no host synchronisation to a decode step (the paged cache keeps its lengths on the
host and on the device), unlike `FoldcCache`, whose contiguous cache checks values and lengths on the
host at every step of every layer (transformers' generate loop still synchronises once per step). Prefill and the limits are those of `FoldcCache` (equal-length
rows, full-attention layers, no beam search); the model runs in float16 or bfloat16 (float16 only
under the interpreter), and both K and V must be encoded.

Storage: the first forward fixes the batch and allocates, per layer, ``batch * ceil(max_cache_len /
page_size)`` pages; sequence b owns a contiguous range of them (a real engine would hand out pages
from a shared pool and re-plan; `foldc.serving.PagedKVCache.plan`).
"""
from __future__ import annotations

import math

import torch

from ..errors import InputError, SpecError
from ..plan import plan_of
from ..serving import PagedKVCache
from ..serving.paged import check_wrapper_page_size
from .hf import FoldcCache, FoldcLayer

__all__ = ["PagedFoldcCache", "PagedFoldcLayer"]


def _check_device(paged: PagedKVCache, layer: int, device: torch.device) -> None:
    """Refuse key or value states of ``layer`` on another ``device`` than the pages of the `PagedKVCache` every layer
    shares (the paged cache's own check told the caller to move the model's states to the pages' device). The fix is
    the model's or the cache's: one device for the whole model, FoldcCache for a model split across devices, or a
    reset for a model moved since the pages were built."""
    if device != paged.device:
        raise InputError(f"layer {layer}'s key and value states are on {device} but this PagedFoldcCache's pages are "
                         f"on {paged.device}, where its first forward built them: every layer shares one "
                         f"PagedKVCache, on one device. Run the whole model on one device (a model split across "
                         f"devices, e.g. by device_map, needs FoldcCache, which builds each layer's cache on that "
                         f"layer's device); for a model moved to {device} since, call cache.reset() (its tokens "
                         f"are dropped) and the next forward builds the pages there")


class _LayerView:
    """One layer of a `PagedKVCache`, with the methods `FoldcLayer` and `foldc_attention` call on a
    `QuantizedKVCache`."""

    def __init__(self, cache: PagedKVCache, layer: int):
        self.paged, self.layer = cache, layer

    @property
    def batch(self) -> int:
        return self.paged.batch

    @property
    def num_tokens(self) -> int:
        return self.paged.num_tokens(self.layer)[0]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.paged.append(self.layer, k.contiguous(), v.contiguous())

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        k, v, _ = self.paged.dequantized(self.layer)
        return k, v

    def attention(self, q: torch.Tensor, sm_scale: float | None = None) -> torch.Tensor:
        return self.paged.attention(self.layer, q, sm_scale)

    def __repr__(self) -> str:
        return f"layer {self.layer} of a PagedKVCache({self.paged.spec.describe()}, {self.num_tokens} tokens)"


class PagedFoldcLayer(FoldcLayer):
    """A `FoldcLayer` backed by one layer of the `PagedKVCache` its `PagedFoldcCache` shares."""

    def __init__(self, shared: dict, index: int, *args):
        super().__init__(*args)
        self.shared, self.index = shared, index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        batch, heads, _, head_dim = key_states.shape
        if (heads, head_dim) != (self.spec.num_kv_heads, self.spec.head_dim):
            super().lazy_initialization(key_states, value_states)  # raises the FoldcLayer error
        paged = self.shared.get("cache")
        if paged is None or paged.batch != batch:
            paged = self._build(batch, key_states.dtype, key_states.device)
            self.shared["cache"] = paged
        _check_device(paged, self.index, key_states.device)   # a later layer on another device than the first's
        self.cache = _LayerView(paged, self.index)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.is_initialized:   # before a prefill reads the cached tokens (torch.cat raised across devices)
            _check_device(self.cache.paged, self.index, key_states.device)
        return super().update(key_states, value_states, *args, **kwargs)

    def _build(self, batch: int, dtype: torch.dtype, device: torch.device) -> PagedKVCache:
        s = self.shared
        if dtype not in (torch.float16, torch.bfloat16):
            raise SpecError(f"PagedFoldcCache holds float16 or bfloat16 models; this one runs in {dtype}: use "
                            "model.half() / model.bfloat16(), or FoldcCache for other dtypes")
        per_seq = math.ceil(self.max_cache_len / s["page_size"])
        cache = PagedKVCache(self.spec, num_layers=s["num_layers"], page_size=s["page_size"],
                             num_pages=batch * per_seq, max_seq_len=self.max_cache_len, sink=self.sink,
                             window=self.window, device=device, dtype=dtype, target=self.target)
        indptr = torch.arange(0, batch * per_seq + 1, per_seq, dtype=torch.int32)
        cache.plan(indptr, torch.arange(batch * per_seq, dtype=torch.int32), [0] * batch)
        return cache

    def reset(self) -> None:
        super().reset()
        self.shared["cache"] = None


class PagedFoldcCache(FoldcCache):
    """`FoldcCache` on paged storage (module doc). Arguments as `FoldcCache`, plus ``page_size``
    (tokens per page; default: the least multiple of 64 that holds whole channel-wise groups, so that pages hold the
    register-operand kernel's 64-token tiles on sm_90 and sm_100; pages of fewer than 32 tokens run the generated
    Triton kernel)."""

    def __init__(self, config, max_cache_len: int, *, k, v, sink: int = 0, window: int = 0, target: str = "auto",
                 page_size: int | None = None):
        super().__init__(config, max_cache_len, k=k, v=v, sink=sink, window=window, target=target)
        if self.spec.k is None or self.spec.v is None:
            raise SpecError(f"PagedFoldcCache quantizes both K and V (k={k!r}, v={v!r}); use FoldcCache for a "
                            "plain operand")
        if page_size is None:   # whole tiles and whole channel-wise groups in a page (the plan's token alignment)
            page_size = math.lcm(64, plan_of(self.spec).token_alignment)
        check_wrapper_page_size(self.spec, page_size)   # here, not at the first forward
        shared = {"cache": None, "page_size": page_size, "num_layers": len(self.layers)}
        self.layers = [PagedFoldcLayer(shared, i, self.spec, max_cache_len, sink, window, target)
                       for i in range(len(self.layers))]
        self._share_refusal()
        self.shared = shared

    @property
    def paged_cache(self) -> PagedKVCache | None:
        """The `PagedKVCache` behind every layer (None before the first forward)."""
        return self.shared["cache"]
