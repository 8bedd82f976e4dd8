"""Serving-side pieces around the compiled attention: quantize-on-append into preallocated
storage (`append_quantized`, and into page pools: `append_paged`), one layer's contiguous KV cache
with a plain sink and recent window (`QuantizedKVCache`), the FlashInfer-style paged decode wrapper
(`PagedDecodeWrapper`, `page_pool`) and a paged multi-layer cache (`PagedKVCache`)."""
from .append import append_paged, append_quantized
from .cache import QuantizedKVCache
from .page_table import PageTable, gather_pages, page_pool
from .paged import PagedDecodeWrapper
from .paged_cache import PagedKVCache

__all__ = ["PageTable", "PagedDecodeWrapper", "PagedKVCache", "QuantizedKVCache", "append_paged",
           "append_quantized", "gather_pages", "page_pool"]
