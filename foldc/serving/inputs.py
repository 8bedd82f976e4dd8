"""What the serving caches check of their arguments and tokens, and where their flag lives: shared by
`QuantizedKVCache` and `PagedKVCache`."""
from __future__ import annotations

import torch

from ..errors import InputError, InputTypeError, SpecError


def resolve_device(device) -> torch.device:
    """``device`` as a torch.device with its index: "cuda" means the current GPU, so that it compares
    equal to the device of the tensors created there (``torch.device("cuda") != "cuda:0"``)."""
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError):
        raise SpecError(f"device={device!r} is not a torch device; use e.g. 'cpu' or 'cuda'") from None
    if dev.type == "meta":   # (an append raised NotImplementedError inside torch; target 'auto' said to use 'auto')
        raise SpecError(f"device={device!r} holds no values, and a cache stores tokens and reads them back; use "
                        "device='cpu' (Triton's interpreter, float16, or target='reference') or 'cuda'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SpecError(f"device={device!r} but torch finds no CUDA GPU; use device='cpu' (Triton's interpreter, "
                        "float16) or run where a GPU is visible")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def count(name: str, value, minimum: int) -> int:
    """``value``, a whole number of at least ``minimum`` (0 or 1), or a SpecError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else "an integer >= 0"
        raise SpecError(f"{name}={value!r} must be {kind}")
    return value


def check_readable(name: str, x: torch.Tensor, what: str) -> torch.Tensor:
    """``x``, a tensor whose values the host reads (a page table, lengths), refused where it holds none to read:
    on the meta device or sparse (torch raised NotImplementedError or RuntimeError from inside its copy).
    ``what``: the tensor wanted, for the message (e.g. "int32 tensor [batch + 1]")."""
    if x.layout != torch.strided or x.is_meta:
        where = "on the meta device" if x.is_meta else f"of layout {x.layout}"
        raise InputError(f"{name} is a tensor {where}, whose values cannot be read; pass a dense {what} on the CPU "
                         f"or the GPU{' (x.to_dense())' if not x.is_meta else ''}")
    return x


def check_new_tokens(name: str, x, batch: int, spec, dtype: torch.dtype, device: torch.device) -> None:
    """Tokens to append: a tensor [batch, kv_heads, tokens, head_dim] of the cache's dtype and device."""
    if not isinstance(x, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor [batch, kv_heads, tokens, head_dim], "
                             f"got {type(x).__name__}")
    if x.layout != torch.strided:   # (torch raised from inside the NaN check, the scatter or the kernel's launch)
        raise InputError(f"{name} is a tensor of layout {x.layout}; the cache stores dense tokens: pass "
                         f"{name}.to_dense()")
    shape = x.shape
    if len(shape) != 4 or shape[0] != batch or shape[1] != spec.num_kv_heads or shape[3] != spec.head_dim:
        raise InputError(f"{name} shape={tuple(shape)} but this cache holds [{batch}, {spec.num_kv_heads}, tokens, "
                         f"{spec.head_dim}] (batch, kv_heads, tokens, head_dim): mismatched heads or batch")
    if x.dtype != dtype:
        raise InputError(f"{name} dtype={x.dtype} but the cache was built with dtype={dtype}; pass {name}.to({dtype})")
    if x.device != device:
        raise InputError(f"{name} is on {x.device} but the cache is on {device}; move it there")


class _DeviceView:
    """``__cuda_array_interface__`` of an int32 host tensor's memory, for `mapped_flag`."""

    def __init__(self, host: torch.Tensor):
        self.__cuda_array_interface__ = {"shape": tuple(host.shape), "typestr": "<i4", "strides": None,
                                         "data": (host.data_ptr(), False), "version": 3}


def mapped_flag(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A CUDA tensor over the memory of ``host`` (pinned int32), which a kernel on ``device`` writes straight
    into host memory (unified addressing: pinned memory is mapped for every device at its host address), or
    None where that is not so (then the caller copies a device flag)."""
    if not host.is_pinned():
        return None
    try:
        view = torch.as_tensor(_DeviceView(host), device=device)
    except (RuntimeError, TypeError, ValueError):
        return None
    return view if view.data_ptr() == host.data_ptr() and view.device == device else None
