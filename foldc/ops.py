"""torch.library custom ops, so torch.compile and CUDA graphs see foldc kernels as single ops.

``torch.ops.foldc.decode_attention(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero,
seq_lens, layout, sm_scale)``: decode attention over a cache described by ``layout`` (the text
of `layout_key`, e.g. ``"32/8/128/token:2:128/channel:2:128"``). For an encoded operand,
``*_data`` is the packed uint8 codes and ``*_scale``/``*_zero`` its parameters; for a plain
operand, ``*_data`` is the values and scale/zero are None. Output: q's shape and dtype. On a
GPU it runs the generated Triton kernel; on the CPU the interpreter (fp16 queries) or the float64
executor (other dtypes), cast to q's dtype.

``torch.ops.foldc.append_kv(codes, scale, zero, x, offset, offsets, encoding, check)``: quantize
the new tokens ``x [batch, kv_heads, T, head_dim]`` into one operand's preallocated storage
(``codes``/``scale``/``zero`` of an `AffineTensor` encoded as ``encoding``, the text of
`Affine.short`, e.g. ``"token:4:32"``) at tokens ``[offset, offset + T)``, in place, bit for bit
as `foldc.quantize` (`foldc.serving.append_quantized`). ``offsets`` (an integer tensor [batch]),
when given, replaces ``offset`` (which must then be 0) with one start per batch row. Returns nothing;
``codes``, ``scale`` and ``zero`` are declared mutated, so torch.compile orders the writes and later reads
correctly.
On a GPU it runs the append kernel; on the CPU the interpreter (fp16 tokens) or foldc.quantize
and a copy (other dtypes): both write the same bits. ``check=False`` reads nothing from the device
(no NaN check, offsets not validated: tokens they would put outside the storage are skipped), so
the op can be captured in a CUDA graph.
"""
from __future__ import annotations

import functools

import torch

from .encoding import AffineTensor, parse_affine
from .errors import InputError, InputTypeError, SpecError
from .spec import AttentionSpec, spec_from_args
from .validate import check_call, check_kernel_operands, check_sm_scale


def layout_key(spec: AttentionSpec) -> str:
    enc = lambda e: "none" if e is None else e.short()  # noqa: E731
    return f"{spec.num_q_heads}/{spec.num_kv_heads}/{spec.head_dim}/{enc(spec.k)}/{enc(spec.v)}"


def spec_from_key(layout: str) -> AttentionSpec:
    """The `AttentionSpec` of ``layout``, the text of `layout_key`."""
    if not isinstance(layout, str):   # before the cache, which would hash it
        raise SpecError(f"layout={layout!r} must be a string like '32/8/128/token:2:128/none' (foldc.ops.layout_key), "
                        f"got {type(layout).__name__}")
    return _spec_from_key(layout)


@functools.lru_cache(maxsize=None)
def _spec_from_key(layout: str) -> AttentionSpec:
    try:
        heads_q, heads_kv, head_dim, k, v = layout.split("/")
    except ValueError:
        raise SpecError(f"layout={layout!r} must look like 'Q/KV/head_dim/k_encoding/v_encoding', "
                        "e.g. '32/8/128/token:2:128/none' (see foldc.ops.layout_key)") from None
    if "" in (k, v):   # spec_from_args reads '' as plain; layout_key writes 'none'
        raise SpecError(f"layout={layout!r} has an empty {'k' if k == '' else 'v'} encoding; write 'none' for a plain "
                        "operand (see foldc.ops.layout_key)")
    return spec_from_args(k, v, f"{heads_q}/{heads_kv}", head_dim)


@functools.lru_cache(maxsize=None)
def _kernel(layout: str, target: str):
    from .compile import compile as compile_attention

    return compile_attention(spec_from_key(layout), target=target)


def _operand(enc, data, scale, zero, head_dim, name):
    if enc is None:
        if scale is not None or zero is not None:   # they would be dropped: the caller's cache is not the layout's
            raise InputError(f"{name}_scale / {name}_zero given, but the layout says {name} is a plain operand "
                             f"('none'); pass None for both, or give the layout {name}'s encoding "
                             "(foldc.ops.layout_key)")
        return data
    if scale is None or zero is None:   # (the message named no operand: k's and v's alike)
        missing = [f"{name}_{part}" for part, t in (("scale", scale), ("zero", zero)) if t is None]
        verb = "are" if len(missing) == 2 else "is"
        raise SpecError(f"{' and '.join(missing)} {verb} None, but the layout says {name} is encoded as "
                        f"{enc.short()}: pass {name}'s codes, scale and zero (foldc.quantize({name}, encoding)), or a "
                        f"layout with {name} 'none' for plain values (foldc.ops.layout_key)")
    return AffineTensor(data, scale, zero, enc, head_dim)


@torch.library.custom_op("foldc::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor | None,
                     k_zero: torch.Tensor | None, v_data: torch.Tensor, v_scale: torch.Tensor | None,
                     v_zero: torch.Tensor | None, seq_lens: torch.Tensor | None, layout: str,
                     sm_scale: float) -> torch.Tensor:
    spec = spec_from_key(layout)
    k = _operand(spec.k, k_data, k_scale, k_zero, spec.head_dim, "k")
    v = _operand(spec.v, v_data, v_scale, v_zero, spec.head_dim, "v")
    if q.is_cuda:
        target = "auto"
    else:
        target = "interpret" if q.dtype == torch.float16 else "reference"
    # return_lse: every buffer of the call is its own, none kept for the next (a kernel keeps an eager call's
    # workspace between calls; inside torch.compile's CUDA-graph pool no allocation may outlive the step)
    out, _ = _kernel(layout, target)(q, k, v, sm_scale=sm_scale, seq_lens=seq_lens, return_lse=True)
    return out.to(q.dtype).contiguous()


#: the query dtypes of the kernels the op runs on a GPU (on the CPU the float64 executor takes the others)
GPU_Q_DTYPES = (torch.float16, torch.bfloat16)


@decode_attention.register_fake
def _(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, seq_lens, layout, sm_scale):
    # what the op refuses without reading data fails at trace time too, with its error (a bad layout, a q or a
    # cache of the wrong shape, dtype or strides, a NaN sm_scale); the lengths' values are read by the op alone
    spec = spec_from_key(layout)
    k = _operand(spec.k, k_data, k_scale, k_zero, spec.head_dim, "k")
    v = _operand(spec.v, v_data, v_scale, v_zero, spec.head_dim, "v")
    if q.is_cuda:
        check_call(spec, q, k, v, sm_scale, seq_lens, q_dtypes=GPU_Q_DTYPES, read_lens=False)
    else:
        check_call(spec, q, k, v, sm_scale, seq_lens, read_lens=False)
    if q.is_cuda or q.dtype == torch.float16:   # a kernel, not the float64 executor: caches as they lie
        check_kernel_operands(q, k, v)
    # contiguous, as the real output is whatever q's strides (torch.compile lays out its readers by these)
    return q.new_empty(q.shape)


def attention_op(spec: AttentionSpec, q, k, v, sm_scale: float | None = None, seq_lens=None) -> torch.Tensor:
    """Call ``torch.ops.foldc.decode_attention`` with AffineTensors or plain tensors."""
    def parts(x):
        return (x.codes, x.scale, x.zero) if isinstance(x, AffineTensor) else (x, None, None)
    scale = check_sm_scale(sm_scale, spec.head_dim)
    if seq_lens is not None and not isinstance(seq_lens, torch.Tensor):   # a list, as foldc.compile's calls take
        try:
            seq_lens = torch.as_tensor(seq_lens, device=q.device if isinstance(q, torch.Tensor) else None)
        except (TypeError, ValueError, RuntimeError):
            raise InputTypeError(f"seq_lens={seq_lens!r} must be an integer tensor (or list) of one length per "
                                 "sequence") from None
    return torch.ops.foldc.decode_attention(q, *parts(k), *parts(v), seq_lens, layout_key(spec), scale)


# ---- foldc::append_kv ----------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def encoding_from_key(encoding: str):
    """The `Affine` of ``encoding`` (``Affine.short()`` text, e.g. ``"channel:2:64:bf16"``)."""
    if encoding in ("none", "plain", ""):
        raise SpecError(f"encoding={encoding!r} is a plain operand; append_kv quantizes into an encoded "
                        "operand's storage, e.g. encoding='token:4:32' (copy plain tokens with a slice assignment)")
    return parse_affine(encoding)


@torch.library.custom_op("foldc::append_kv", mutates_args=("codes", "scale", "zero"))
def append_kv(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, x: torch.Tensor, offset: int,
              offsets: torch.Tensor | None, encoding: str, check: bool) -> None:
    from .serving.append import append_quantized

    dst, target = _append_call(codes, scale, zero, x, encoding, offset, offsets)
    append_quantized(dst, x, offsets if offsets is not None else offset, target=target, check=check)


def _append_call(codes, scale, zero, x, encoding: str, offset: int, offsets):
    """The storage of an append_kv call as an AffineTensor, and the target that writes it."""
    if offsets is not None and offset != 0:   # offsets replace offset: a start given with them would be dropped
        raise InputError(f"offset={offset} given with per-row offsets: offsets replaces offset (one start per batch "
                         "row, not added to it); pass offset=0 and add it to offsets (offsets + offset)")
    enc = encoding_from_key(encoding)
    # the storage's head_dim, so that an x of another head_dim or rank is the one the error names (an int: traced
    # with dynamic shapes, the fake's is symbolic, and head_dim is fixed by the model)
    head_dim = int(codes.shape[-1]) * enc.codes_per_byte if codes.dim() == 4 else int(x.shape[-1]) if x.dim() else 0
    dst = AffineTensor(codes, scale, zero, enc, head_dim)
    if x.is_cuda:
        return dst, "auto"
    return dst, "interpret" if x.dtype == torch.float16 else "reference"


@append_kv.register_fake
def _(codes, scale, zero, x, offset, offsets, encoding, check):
    from .serving.append import check_append, check_unit_stride

    # what the op refuses without reading data fails at trace time too, with its error (a bad encoding, storage
    # or x, an int offset past the storage, storage the kernels cannot write); the offsets' values and x's NaN are
    # read by the op alone
    dst, target = _append_call(codes, scale, zero, x, encoding, offset, offsets)
    tokens, _, _, mode = check_append(dst, x, offsets if offsets is not None else offset, target, read_device=False)
    if tokens and mode != "reference":
        check_unit_stride("dst", dst)
    return None


def append_op(dst: AffineTensor, x: torch.Tensor, offset=0, check: bool = True) -> None:
    """Call ``torch.ops.foldc.append_kv`` for an `AffineTensor` ``dst`` (``offset``: an int, or an
    integer tensor of one start per batch row)."""
    if not isinstance(dst, AffineTensor):
        raise InputTypeError(f"dst must be a foldc.AffineTensor (preallocated storage), got {type(dst).__name__}")
    per_row = offset if isinstance(offset, torch.Tensor) else None
    if per_row is None and (isinstance(offset, bool) or not isinstance(offset, int)):
        raise InputTypeError(f"offset={offset!r} must be an int or an integer tensor of one offset per batch row")
    start = 0 if per_row is not None else offset
    torch.ops.foldc.append_kv(dst.codes, dst.scale, dst.zero, x, start, per_row, dst.encoding.short(), check)
