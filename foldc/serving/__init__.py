"""Serving-side pieces around the compiled attention: quantize-on-append into preallocated
storage (`append_quantized`) and one layer's KV cache with a plain sink and recent window
(`QuantizedKVCache`)."""
from .append import append_quantized
from .cache import QuantizedKVCache

__all__ = ["QuantizedKVCache", "append_quantized"]
