"""torch.library custom ops, so torch.compile and CUDA graphs see foldc kernels as single ops.

``torch.ops.foldc.decode_attention(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero,
seq_lens, layout, sm_scale)``: decode attention over a cache described by ``layout`` (the text
of `layout_key`, e.g. ``"32/8/128/token:2:128/channel:2:128"``). For an encoded operand,
``*_data`` is the packed uint8 codes and ``*_scale``/``*_zero`` its parameters; for a plain
operand, ``*_data`` is the values and scale/zero are None. Output: q's shape and dtype. On a
GPU it runs the generated Triton kernel; on the CPU the interpreter (fp16 queries) or the float64
executor (other dtypes), cast to q's dtype.
"""
from __future__ import annotations

import functools

import torch

from .encoding import AffineTensor
from .errors import SpecError
from .spec import AttentionSpec, spec_from_args


def layout_key(spec: AttentionSpec) -> str:
    enc = lambda e: "none" if e is None else e.short()  # noqa: E731
    return f"{spec.num_q_heads}/{spec.num_kv_heads}/{spec.head_dim}/{enc(spec.k)}/{enc(spec.v)}"


@functools.lru_cache(maxsize=None)
def spec_from_key(layout: str) -> AttentionSpec:
    try:
        heads_q, heads_kv, head_dim, k, v = layout.split("/")
    except ValueError:
        raise SpecError(f"layout={layout!r} must look like 'Q/KV/head_dim/k_encoding/v_encoding', "
                        "e.g. '32/8/128/token:2:128/none' (see foldc.ops.layout_key)") from None
    return spec_from_args(k, v, f"{heads_q}/{heads_kv}", head_dim)


@functools.lru_cache(maxsize=None)
def _kernel(layout: str, target: str):
    from .compile import compile as compile_attention

    return compile_attention(spec_from_key(layout), target=target)


def _operand(enc, data, scale, zero, head_dim):
    if enc is None:
        return data
    if scale is None or zero is None:
        raise SpecError("an encoded operand needs its scale and zero tensors (got None)")
    return AffineTensor(data, scale, zero, enc, head_dim)


@torch.library.custom_op("foldc::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor | None,
                     k_zero: torch.Tensor | None, v_data: torch.Tensor, v_scale: torch.Tensor | None,
                     v_zero: torch.Tensor | None, seq_lens: torch.Tensor | None, layout: str,
                     sm_scale: float) -> torch.Tensor:
    spec = spec_from_key(layout)
    k = _operand(spec.k, k_data, k_scale, k_zero, spec.head_dim)
    v = _operand(spec.v, v_data, v_scale, v_zero, spec.head_dim)
    if q.is_cuda:
        target = "auto"
    else:
        target = "interpret" if q.dtype == torch.float16 else "reference"
    out = _kernel(layout, target)(q, k, v, sm_scale=sm_scale, seq_lens=seq_lens)
    return out.to(q.dtype)


@decode_attention.register_fake
def _(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, seq_lens, layout, sm_scale):
    spec_from_key(layout)  # a bad layout fails at trace time too
    return torch.empty_like(q)


def attention_op(spec: AttentionSpec, q, k, v, sm_scale: float | None = None, seq_lens=None) -> torch.Tensor:
    """Call ``torch.ops.foldc.decode_attention`` with AffineTensors or plain tensors."""
    def parts(x):
        return (x.codes, x.scale, x.zero) if isinstance(x, AffineTensor) else (x, None, None)
    scale = float(sm_scale) if sm_scale is not None else spec.head_dim ** -0.5
    return torch.ops.foldc.decode_attention(q, *parts(k), *parts(v), seq_lens, layout_key(spec), scale)
