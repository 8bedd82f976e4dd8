"""Orthogonal (randomized) Hadamard rotation of K and V: attention is unchanged, quantization improves.

Low-bit affine quantization stores each group as ``scale * code + zero`` with ``scale`` set by the
group's range, so one large channel (real keys have a few channels 10-20x larger than the rest)
stretches the range of every token-wise group it falls in and the small channels collapse onto a
code or two. Multiplying each head's vectors by an orthogonal matrix ``R`` (``R Rᵀ = I``) spreads
such a channel over all ``head_dim`` channels, so every group sees a similar, Gaussian-like range;
and because ``R`` is orthogonal, attention computed on rotated operands is the same in exact
arithmetic:

- keys: ``(q R)(k R)ᵀ = q R Rᵀ kᵀ = q kᵀ``, so rotating q and k alike leaves every logit unchanged;
- values: ``softmax(...) (v R) = (softmax(...) v) R``, so the output comes out rotated and
  ``o Rᵀ`` recovers it.

Here ``R = diag(s) H``: ``H`` the normalized Walsh-Hadamard matrix of order ``head_dim`` (a power
of two; Sylvester order, symmetric, ``H Hᵀ = I``) and ``s`` an optional random ±1 vector drawn
from a seeded generator (a "randomized Hadamard"; without a seed ``s = 1`` and ``R = H``). A
row ``x`` is rotated as ``x R = fwht(x * s)`` with the O(d log d) butterfly transform `fwht`, and
un-rotated as ``x Rᵀ = fwht(x) * s``. The same ``R`` serves every head of a layer (a query head
must use the ``R`` of the KV head it reads, so one matrix per layer is the simple choice).

Where each rotation sits in a serving pipeline (one layer, decode)::

    x --W_k--> k --RoPE--> k --rotate_keys-------> quantize-on-append -> cache (body; sink/recent plain)
    x --W_v--> v --------------rotate_values-----> quantize-on-append -> cache
    x --W_q--> q --RoPE--> q --rotate_queries----> decode attention (unchanged kernel) -> o
                                                   o --unrotate_output--> W_o --> residual

- **K**: after RoPE (RoPE is position-dependent and does not commute with ``R``) and before
  quantization; the sink and recent windows hold rotated keys too, since q is rotated for all.
- **q**: at decode, after RoPE: one ``d x d`` product (or one `fwht`) per query head per step,
  the only run-time cost of the rotation. This is the key rotation "folded into q": the kernel
  reads rotated keys with a rotated query and never un-rotates a key.
- **V**: before quantization. V carries no RoPE, so ``v R`` folds offline into the value
  projection (`fold_into_value_projection`: ``W_v`` rows of each KV head multiplied by ``Rᵀ``).
- **output**: after attention, ``o Rᵀ``; this folds offline into the output projection
  (`fold_into_output_projection`: ``W_o``'s input columns of each query head multiplied by ``R``).

With those folds the attention kernel, the cache layout and the plan are untouched: the only
new run-time work is rotating the new key (O(d log d) per token, fusable into quantize-on-append)
and the query (per step). Quantization error in the rotated basis maps back through an orthogonal
matrix, so its L2 size is unchanged by un-rotation; only how well the codes fit changes.
See docs/accuracy.md for measured errors with and without rotation.
"""
from __future__ import annotations

import math

import torch

from .errors import InputError, InputTypeError, SpecError
from .options import as_int

_WORK_DTYPES = (torch.float32, torch.float64)


def _check_head_dim(head_dim) -> int:
    head_dim = as_int(head_dim)   # a NumPy or 0-dim torch integer is that int (as AttentionSpec takes it)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise SpecError(f"head_dim={head_dim!r} must be a positive integer (a power of two: 64, 128, 256)")
    if head_dim & (head_dim - 1):
        lo = 1 << (head_dim.bit_length() - 1)
        raise SpecError(
            f"head_dim={head_dim} is not a power of two; a Walsh-Hadamard rotation needs one "
            f"(pad each head to {lo * 2} channels with zeros, or use a head_dim like {lo} or {lo * 2})"
        )
    return head_dim


def _check_rows(x, name: str, head_dim: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor [..., head_dim], got {type(x).__name__}")
    if not x.is_floating_point():
        raise InputError(f"{name} dtype={x.dtype} must be a floating-point type; pass {name}.float()")
    if x.dim() < 1 or x.shape[-1] != head_dim:
        raise InputError(
            f"{name} shape={tuple(x.shape)} must end in head_dim={head_dim} (rotation acts on each "
            f"head's vector); build the Rotation with head_dim={x.shape[-1] if x.dim() else '?'} or "
            f"reshape {name} to [..., {head_dim}]"
        )
    return x


def _check_dtype(dtype) -> torch.dtype:
    """A floating-point dtype: the entries are ±1/sqrt(d), which an integer dtype truncates to 0."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise SpecError(f"dtype={dtype!r} must be a floating-point torch.dtype (the entries are ±1/sqrt(head_dim)), "
                        "e.g. torch.float64")
    return dtype


def hadamard_matrix(head_dim: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """Normalized Walsh-Hadamard matrix (Sylvester order): ``H[i, j] = (-1)^popcount(i & j) / sqrt(d)``.

    Symmetric and orthogonal (``H Hᵀ = I``). Dense, for checks and small folds; rotate with `fwht`."""
    d = _check_head_dim(head_dim)
    _check_dtype(dtype)
    # built on the CPU, then moved: the loop reads its bits on the host (a device sync each step; on the meta
    # device, where a model built with init_empty_weights lives, no value can be read at all)
    idx = torch.arange(d)
    bits = idx[:, None] & idx[None, :]
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return ((1 - 2 * parity).to(torch.float64) / math.sqrt(d)).to(device=device, dtype=dtype)


def _fwht_(y: torch.Tensor) -> torch.Tensor:
    """In-place normalized Walsh-Hadamard transform of the last axis of a contiguous float tensor."""
    d = y.shape[-1]
    flat = y.view(-1, d)
    h = 1
    while h < d:  # stage h: x[i], x[i + h] <- x[i] + x[i + h], x[i] - x[i + h] within blocks of 2h
        pairs = flat.view(-1, d // (2 * h), 2, h)
        a, b = pairs[:, :, 0, :], pairs[:, :, 1, :]
        diff = a - b
        a.add_(b)
        b.copy_(diff)
        h *= 2
    return y.mul_(1.0 / math.sqrt(d))


def _work_copy(x: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous copy of x in float32 (half types) or its own dtype (float32/64)."""
    if x.dtype in _WORK_DTYPES:
        return x.clone(memory_format=torch.contiguous_format)
    return x.to(torch.float32).contiguous()


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Fast normalized Walsh-Hadamard transform of the last axis: ``x @ hadamard_matrix(d)``.

    ``log2(d)`` butterfly stages of ``d`` additions each, O(d log d) (on a copy; x is not
    modified). The last axis must be a power of two. float16/bfloat16 inputs are transformed in
    float32 and cast back."""
    if not isinstance(x, torch.Tensor):
        raise InputTypeError(f"x must be a torch.Tensor [..., d], got {type(x).__name__}")
    if x.dim() < 1:
        raise InputError("x must have at least one axis (the one to transform)")
    d = _check_head_dim(x.shape[-1])
    _check_rows(x, "x", d)
    return _fwht_(_work_copy(x)).to(x.dtype)


class Rotation:
    """The per-head rotation ``R = diag(s) H`` of one layer (module docstring).

    Args:
        head_dim: channels per head, a power of two.
        seed: None for the plain Hadamard ``R = H``; an int draws the ±1 signs ``s`` from
            ``torch.Generator().manual_seed(seed)`` (same seed, same rotation, on any device).
    """

    def __init__(self, head_dim: int, seed: int | None = None):
        self.head_dim = head_dim = _check_head_dim(head_dim)
        seed = as_int(seed)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**64):
            raise SpecError(f"seed={seed!r} must be an int in [-2**63, 2**64) (a randomized Hadamard; "
                            "torch.Generator's range) or None (plain Hadamard)")
        self.seed = seed
        if seed is None:
            self.signs = torch.ones(head_dim, dtype=torch.float64)
        else:
            gen = torch.Generator().manual_seed(seed)
            self.signs = torch.randint(0, 2, (head_dim,), generator=gen).to(torch.float64) * 2 - 1

    def _signs(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype if x.dtype in _WORK_DTYPES else torch.float32
        return self.signs.to(device=x.device, dtype=dtype)

    def _rotate(self, x: torch.Tensor, name: str) -> torch.Tensor:
        _check_rows(x, name, self.head_dim)
        return _fwht_(_work_copy(x).mul_(self._signs(x))).to(x.dtype)          # fwht(x * s) = x diag(s) H

    def _unrotate(self, x: torch.Tensor, name: str) -> torch.Tensor:
        _check_rows(x, name, self.head_dim)
        return _fwht_(_work_copy(x)).mul_(self._signs(x)).to(x.dtype)          # fwht(x) * s = x H diag(s)

    def matrix(self, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
        """Dense ``R = diag(s) H`` ([head_dim, head_dim]); ``x @ R`` equals `rotate_keys(x)`."""
        _check_dtype(dtype)
        h = hadamard_matrix(self.head_dim, torch.float64, device)
        return (self.signs.to(device)[:, None] * h).to(dtype)

    def rotate_keys(self, k: torch.Tensor) -> torch.Tensor:
        """``k R`` for keys ``[..., head_dim]`` (after RoPE, before quantization)."""
        return self._rotate(k, "k")

    def rotate_queries(self, q: torch.Tensor) -> torch.Tensor:
        """``q R`` for queries ``[..., head_dim]`` (after RoPE): ``(q R)(k R)ᵀ = q kᵀ``."""
        return self._rotate(q, "q")

    def rotate_values(self, v: torch.Tensor) -> torch.Tensor:
        """``v R`` for values ``[..., head_dim]`` (before quantization; foldable into W_v)."""
        return self._rotate(v, "v")

    def unrotate_output(self, o: torch.Tensor) -> torch.Tensor:
        """``o Rᵀ`` for an attention output over rotated values (foldable into W_o)."""
        return self._unrotate(o, "o")

    def __repr__(self) -> str:
        kind = "Hadamard" if self.seed is None else f"randomized Hadamard, seed={self.seed}"
        return f"Rotation(head_dim={self.head_dim}, {kind})"


def _check_weight(w, name: str, axis: int, heads_name: str, rotation: Rotation) -> torch.Tensor:
    if not isinstance(rotation, Rotation):
        raise InputTypeError(f"rotation must be a foldc.rotation.Rotation, got {type(rotation).__name__}")
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise InputError(f"{name} must be a floating-point 2-D weight [out_features, in_features]; got {got}")
    if w.shape[axis] % rotation.head_dim:
        raise InputError(
            f"{name} shape={tuple(w.shape)}: axis {axis} ({w.shape[axis]}) is not a whole number of "
            f"{heads_name} of head_dim={rotation.head_dim}"
        )
    return w


def _check_bias(bias, w_v: torch.Tensor) -> torch.Tensor:
    """The value projection's bias: ``[out_features]`` floating point, on w_v's device (``nn.Linear``'s)."""
    if not isinstance(bias, torch.Tensor):
        raise InputTypeError(f"bias must be a torch.Tensor [out_features={w_v.shape[0]}] or None, got "
                             f"{type(bias).__name__}")
    if not bias.is_floating_point() or tuple(bias.shape) != (w_v.shape[0],):
        raise InputError(f"bias dtype={bias.dtype} shape={tuple(bias.shape)} must be a floating-point "
                         f"[out_features={w_v.shape[0]}] vector (w_v is {tuple(w_v.shape)}), as nn.Linear's bias")
    if bias.device != w_v.device:
        raise InputError(f"bias is on {bias.device} but w_v is on {w_v.device}; move both to one device")
    return bias


def fold_into_value_projection(w_v: torch.Tensor, rotation: Rotation, bias: torch.Tensor | None = None):
    """Offline fold of `Rotation.rotate_values` into a value projection (``torch.nn.Linear`` layout).

    ``w_v`` is ``[num_kv_heads * head_dim, hidden]`` (``v = x @ w_v.T + bias``); returns
    ``(w_v', bias')`` with each KV head's block of rows replaced by ``Rᵀ @ block`` (and its bias
    block by ``bias @ R``), so the projection emits ``v R`` directly."""
    _check_weight(w_v, "w_v", 0, "KV heads", rotation)
    d = rotation.head_dim
    r = rotation.matrix(torch.float64, w_v.device)
    blocks = w_v.to(torch.float64).reshape(-1, d, w_v.shape[1])
    w_new = torch.einsum("ji,hjc->hic", r, blocks).reshape(w_v.shape).to(w_v.dtype)
    if bias is None:
        return w_new, None
    _check_bias(bias, w_v)
    b_new = (bias.to(torch.float64).reshape(-1, d) @ r).reshape(bias.shape).to(bias.dtype)
    return w_new, b_new


def fold_into_output_projection(w_o: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    """Offline fold of `Rotation.unrotate_output` into the output projection (``nn.Linear`` layout).

    ``w_o`` is ``[hidden, num_q_heads * head_dim]`` (``y = o_flat @ w_o.T``); returns ``w_o'`` with
    each query head's block of input columns replaced by ``block @ R``, so that
    ``(o R)_flat @ w_o'.T == o_flat @ w_o.T``."""
    _check_weight(w_o, "w_o", 1, "query heads", rotation)
    d = rotation.head_dim
    r = rotation.matrix(torch.float64, w_o.device)
    blocks = w_o.to(torch.float64).reshape(w_o.shape[0], -1, d)
    return torch.einsum("ohj,ji->ohi", blocks, r).reshape(w_o.shape).to(w_o.dtype)


__all__ = ["Rotation", "fold_into_output_projection", "fold_into_value_projection", "fwht", "hadamard_matrix"]
