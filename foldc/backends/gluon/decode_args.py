"""The register-operand decode kernel's arguments (kernel.py's ``foldc_decode_gluon``): built from a call's tensors
(`decode_arguments`), the same tensors as addresses for a bound launch (`decode_addresses`), the key that finds a
launch's bound kernels (`binding_key`), and stand-ins with a call's dtypes, shapes and strides but no memory, which
compile the kernel variant a call would run without one (`mock_decode_arguments`). `GluonAttention` (launch.py)
and `PreparedRun` (prepared.py) use them."""
from __future__ import annotations

import math

import torch

from ...encoding import scale_shape
from ..runtime.launch import side_key

_DATA_PTR = torch.Tensor.data_ptr
TOKENS_ARG = 28   # the position of ``cache_tokens`` in the decode kernel's arguments (given per call when bound)


def decode_arguments(launch: dict, q, k, v, lens, ws, sm_scale: float, per_split: int, cache_tokens: int,
                     paged: tuple | None, counters=None, merged: tuple | None = None) -> tuple[tuple, dict]:
    """The decode kernel's arguments (positional, keyword) for one call (see `GluonAttention.launch`); ``counters``:
    int32 zeros, one per (batch, head group), for dynamic tiles; ``merged``: (out, lse, barrier) of a contiguous
    launch that merges its splits itself (split_merge.py), which take the page table's and counters' places."""
    (kc, ks, kz), (vc, vs, vz) = _parts(k, q), _parts(v, q)
    indptr, indices, page = paged if paged is not None else (q, q, 0)
    if merged is not None:
        indptr, indices, counters = merged
    qs, kcs, vcs = q.stride(), kc.stride(), vc.stride()
    args = (q, kc, ks, kz, vc, vs, vz, q if lens is None else lens, *ws, indptr, indices,
            q if counters is None else counters,
            qs[0], qs[1], kcs[0], kcs[1], *_scale_strides(ks, kc), vcs[0], vcs[1], *_scale_strides(vs, vc),
            sm_scale * 1.4426950408889634, per_split, cache_tokens)
    # the keyword arguments depend on the launch's options alone: built once per (lengths, page)
    key = ("kwargs", lens is not None, page, merged is not None)
    kwargs = launch.get(key)
    if kwargs is None:
        extra = {"maxnreg": launch["maxnreg"]} if launch["maxnreg"] else {}
        if merged is not None:   # every program resident at once: its barrier cannot deadlock (MERGE is left out
            # otherwise: a benchmark's copy of an older kernel has no such parameter)
            extra.update(MERGE=True, launch_cooperative_grid=True)
        kwargs = launch[key] = dict(HAS_LENS=lens is not None, PAGE=page, **launch["constexprs"], num_warps=1,
                                    **extra)
    return args, kwargs


def mock_decode_arguments(spec, cfg, launch: dict, q_dtype: torch.dtype, has_lens: bool,
                          page: int, merged: bool = False) -> tuple[tuple, dict]:
    """The decode kernel's arguments for one sequence of ``spec`` (lowered to ``cfg``) with no memory behind them
    (triton's MockTensor: dtypes, shapes, strides): enough to compile the variant a call would run (``merged``: the
    build that merges its splits itself)."""
    d, h = cfg.head_dim, spec.num_kv_heads
    q = _mock(q_dtype, [1, spec.num_q_heads, d])
    k, v = (_MockAffine(enc, h, d, w, page or 4096) if enc is not None else _MockPlain(h, w, page or 4096)
            for enc, w in ((spec.k, cfg.key_words), (spec.v, cfg.value_words)))
    int32 = _mock(torch.int32, [1])
    ws = (_mock(torch.float32, [1]),) * 3
    paged = (int32, int32, page) if page else None
    out = (q, _mock(torch.float32, [1]), _mock(torch.int64, [1])) if merged else None
    return decode_arguments(launch, q, k, v, int32 if has_lens else None, ws, 1.0, 2 * launch["block_n"],
                            4096, paged, int32 if draws_tiles(launch) else None, out)


def binding_key(options: dict, q, k, v, lens, out, sm_scale: float, per_split: int, splits: int,
                paged: tuple | None = None, merged: bool = False) -> tuple:
    """What a decode launch's bound kernels fix besides its options: shapes, strides, dtypes, integers (and a page
    table's page size and dtypes: one options dict serves contiguous and paged launches of a shape; ``merged``:
    the launch that merges its splits itself, one bound kernel instead of two)."""
    return (id(options), q.shape[0], q.stride(), side_key(k), side_key(v), out.stride(), out.dtype,
            None if lens is None else lens.dtype, sm_scale, per_split, splits,
            None if paged is None else (paged[2], paged[0].dtype, paged[1].dtype), merged)


def decode_addresses(q, k, v, lens, ws, paged: tuple | None = None, merged: tuple | None = None) -> tuple:
    """The decode kernel's 14 tensor arguments as addresses, in `decode_arguments`' order, for a launch without
    dynamic tiles (the counters are the query, unread; so is the page table of a contiguous cache, unless
    ``merged`` = (out, lse, barrier) take those places)."""
    qa = q.data_ptr()
    ka = (k.data_ptr(), qa, qa) if isinstance(k, torch.Tensor) else (
        k.codes.data_ptr(), k.scale.data_ptr(), k.zero.data_ptr())
    va = (v.data_ptr(), qa, qa) if isinstance(v, torch.Tensor) else (
        v.codes.data_ptr(), v.scale.data_ptr(), v.zero.data_ptr())
    if merged is not None:
        return (qa, *ka, *va, qa if lens is None else lens.data_ptr(), *map(_DATA_PTR, ws), *map(_DATA_PTR, merged))
    table = (qa, qa) if paged is None else (paged[0].data_ptr(), paged[1].data_ptr())
    return (qa, *ka, *va, qa if lens is None else lens.data_ptr(), *map(_DATA_PTR, ws), *table, qa)


def _parts(x, q):
    """(32-bit code words, scale, zero) of an encoded side; a plain side's bf16 rows as 32-bit words
    and the query standing in for the scales it has none of (the kernel reads none)."""
    if isinstance(x, torch.Tensor) or isinstance(x, _MockPlain):
        return x.view(torch.int32), q, q
    return x.codes.view(torch.int32), x.scale, x.zero


def _scale_strides(scale, words) -> tuple[int, int, int]:
    """The scale tensor's (batch, head, token or group) strides; zeros for a plain side (``scale`` is
    the query then, whose shape is not the codes')."""
    shape = scale.shape
    if len(shape) != 4 or tuple(shape[:2]) != tuple(words.shape[:2]):
        return 0, 0, 0
    strides = scale.stride()
    return strides[0], strides[1], strides[2]


def draws_tiles(launch: dict) -> bool:
    """Whether this launch draws tiles from counters (a launch without compiled options: no)."""
    return bool(launch.get("constexprs", {}).get("DYNAMIC", False))


def _mock(dtype: torch.dtype, shape: list):
    """triton's MockTensor (a dtype and a shape, no memory) whose ``stride(dim)`` answers as torch's."""
    from triton.runtime.jit import MockTensor

    class Mock(MockTensor):
        def stride(self, dim=None):   # row-major, as a contiguous torch tensor's
            strides = tuple(math.prod(self.shape[i + 1:]) for i in range(len(self.shape)))
            return strides if dim is None else strides[dim]

    return Mock(dtype, list(shape))


class _MockAffine:
    """Stand-in for an AffineTensor of ``tokens`` tokens (one sequence) with the shapes, strides and
    dtypes a real one has: enough to compile the kernel variant without memory (`GluonAttention.resident`)."""

    def __init__(self, enc, heads: int, head_dim: int, words: int, tokens: int):
        self.codes = _MockCodes(_mock(torch.int32, [1, heads, tokens, words]))
        self.scale = self.zero = _mock(enc.scale_dtype, scale_shape(enc, 1, heads, tokens, head_dim))


class _MockPlain:
    """Stand-in for a plain bf16 side of ``tokens`` tokens: its 32-bit view is what the kernel takes."""

    def __init__(self, heads: int, words: int, tokens: int):
        self.words = _mock(torch.int32, [1, heads, tokens, words])

    def view(self, dtype):
        return self.words


class _MockCodes:
    def __init__(self, words):
        self.words = words

    def view(self, dtype):
        return self.words
