"""Run a plan's graph step by step, tile by tile along tokens.

One interpreter serves two array kinds:

- `TorchOps`: float64 torch tensors, the numeric executor behind ``compile(..., "reference")``;
- `SympyOps`: numpy object arrays of sympy expressions, used by `foldc.proof` to execute the
  same graph symbolically (the online-softmax running maxima become free symbols, eq. 9).

Tensors are `Named` arrays whose dimensions follow their node's axes (canonical order). Every
product is an einsum built from axis names, so the interpreter knows nothing about layouts:
a grouped axis (``token/64``) maps to its elements through a 0/1 membership matrix computed
from the current tile's offset.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import sympy as sp
import torch

from .errors import GraphError
from .ir import (TOKEN, Accumulate, Add, Codes, Contract, Correction, Dequantize, Divide, GroupedAxis,
                 GroupParam, Input, MulScalar, OnlineSoftmax, Prescale, ScaleGroups, element_axes,
                 param_axes)
from .ir.axes import base_of

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass
class Named:
    data: Any
    axes: tuple


class TorchOps:
    symbolic = False

    def einsum(self, eq, *xs):
        return torch.einsum(eq, *xs)

    def const(self, values: np.ndarray):
        return torch.as_tensor(values, dtype=torch.float64, device=self.device)

    def exp(self, x):
        return torch.exp(x)

    def zeros(self, shape):
        return torch.zeros(shape, dtype=torch.float64, device=self.device)

    def stack(self, xs, dim):
        return torch.stack(xs, dim)

    def __init__(self, device="cpu"):
        self.device = device


class SympyOps:
    symbolic = True

    def einsum(self, eq, *xs):
        return np.einsum(eq, *xs, optimize=False)

    def const(self, values: np.ndarray):
        return np.asarray(values).astype(object)

    def exp(self, x):
        return np.vectorize(sp.exp, otypes=[object])(x)

    def zeros(self, shape):
        return np.full(shape, sp.Integer(0), dtype=object)

    def stack(self, xs, dim):
        return np.stack(xs, dim)


class _Tile:
    """Which tokens the current tile covers, and the membership matrices that follow from it."""

    def __init__(self, ops, start: int, stop: int, sizes: dict[str, int]):
        self.ops, self.start, self.stop, self.sizes = ops, start, stop, sizes

    def length(self, base: str) -> int:
        return self.stop - self.start if base == TOKEN else self.sizes[base]

    def offset(self, base: str) -> int:
        return self.start if base == TOKEN else 0

    def group_ids(self, axis: GroupedAxis) -> np.ndarray:
        """Local group index of every element of the tile along axis.base."""
        off = self.offset(axis.base)
        idx = np.arange(off, off + self.length(axis.base))
        return idx // axis.group_size - off // axis.group_size

    def group_slice(self, axis: GroupedAxis) -> slice:
        off, n = self.offset(axis.base), self.length(axis.base)
        return slice(off // axis.group_size, (off + n - 1) // axis.group_size + 1)

    def membership(self, axis: GroupedAxis):
        """[elements, groups] 0/1 matrix: element i belongs to local group j."""
        ids = self.group_ids(axis)
        m = np.zeros((len(ids), ids.max() + 1), dtype=np.int64)
        m[np.arange(len(ids)), ids] = 1
        return self.ops.const(m)

    def regroup(self, fine: GroupedAxis, coarse: GroupedAxis):
        """[fine groups, coarse groups] 0/1 matrix: fine group i is read with coarse group j
        (the coarse group of its first element)."""
        fine_ids, coarse_ids = self.group_ids(fine), self.group_ids(coarse)
        n_fine = fine_ids.max() + 1
        m = np.zeros((n_fine, coarse_ids.max() + 1), dtype=np.int64)
        for i in range(n_fine):
            m[i, coarse_ids[np.argmax(fine_ids == i)]] = 1
        return self.ops.const(m)


def _einsum(ops, inputs: list[tuple[Any, tuple]], out_axes: tuple):
    letters: dict[Any, str] = {}
    def sub(axes):  # noqa: E306
        return "".join(letters.setdefault(a, _LETTERS[len(letters)]) for a in axes)
    lhs = ",".join(sub(axes) for _, axes in inputs)
    return ops.einsum(f"{lhs}->{sub(out_axes)}", *[d for d, _ in inputs])


def _to_elements(ops, tile: _Tile, x: Named) -> Named:
    """Broadcast a tensor on grouped axes to one entry per element."""
    out_axes = element_axes(x.axes)
    if out_axes == tuple(x.axes):
        return x
    inputs = [(x.data, x.axes)]
    for a in x.axes:
        if isinstance(a, GroupedAxis):
            inputs.append((tile.membership(a), (a.base, a)))
    return Named(_einsum(ops, inputs, out_axes), out_axes)


def _slice_tokens(data, axes, tile: _Tile):
    for dim, a in enumerate(axes):
        if base_of(a) == TOKEN:
            sl = tile.group_slice(a) if isinstance(a, GroupedAxis) else slice(tile.start, tile.stop)
            return data[(slice(None),) * dim + (sl,)]
    return data


class Executor:
    """Interprets a graph. ``bindings`` maps (input name, part) to a full array in canonical axes,
    part being "values" (plain input), "codes", "scale" or "zero"."""

    def __init__(self, graph, ops, bindings: dict, sizes: dict[str, int], num_tokens: int,
                 sm_scale, token_tile: int, valid_tokens=None):
        if token_tile < 1:
            raise GraphError(f"token_tile={token_tile} must be >= 1")
        self.graph, self.ops, self.bindings = graph, ops, bindings
        self.sizes, self.num_tokens, self.sm_scale = sizes, num_tokens, sm_scale
        self.token_tile = token_tile
        self.valid_tokens = valid_tokens  # numeric only: per-batch sequence lengths (torch int64)
        self.softmax = graph.nodes_of(OnlineSoftmax)
        self._symbols = itertools.count()

    # -- the tile loop --------------------------------------------------------------------
    def run(self) -> dict[str, Named]:
        """Evaluate the graph; returns the final values (output, and the softmax state)."""
        if not self.softmax:
            return self._eval_all(_Tile(self.ops, 0, self.num_tokens, self.sizes), {})
        sm = self.softmax[0]
        state: dict[str, Any] = {"m": None, "l": None}
        accs: dict[str, Named] = {}
        final_nodes = self.graph.descendants(sm.name)
        for start in range(0, self.num_tokens, self.token_tile):
            tile = _Tile(self.ops, start, min(start + self.token_tile, self.num_tokens), self.sizes)
            env: dict[str, Named] = {}
            for node in self.graph:
                if isinstance(node, Accumulate):
                    contrib = env[node.input]
                    prev = accs.get(node.name)
                    accs[node.name] = contrib if prev is None else Named(
                        _einsum(self.ops, [(prev.data, prev.axes), (state["alpha"], state["axes"])], prev.axes)
                        + contrib.data, prev.axes)
                    continue
                if isinstance(node, Divide) or self._after_accumulate(node):
                    continue
                if isinstance(node, OnlineSoftmax):
                    env[node.name] = self._softmax_step(node, env[node.logits], tile, state)
                    continue
                env[node.name] = self._eval(node, env, tile)
        env = dict(accs)
        env["__denominator__"] = Named(state["l"], state["axes"])
        env["__max__"] = Named(state["m"], state["axes"])
        if self.ops.symbolic:  # an opaque denominator, so the proof can check out * L == acc
            lam = np.empty(np.shape(state["l"]), dtype=object)
            for idx in np.ndindex(*lam.shape):
                lam[idx] = sp.Symbol("L_" + "_".join(map(str, idx)), positive=True)
            env["__lambda__"] = Named(lam, state["axes"])
        for node in self.graph:
            if node.name in final_nodes and node.name not in accs and self._after_accumulate(node):
                env[node.name] = self._eval_final(node, env, state)
        return env

    def _after_accumulate(self, node) -> bool:
        return any(isinstance(self.graph[a], Accumulate) for a in self.graph.ancestors(node.name))

    def _eval_all(self, tile, env):
        for node in self.graph:
            env[node.name] = self._eval(node, env, tile)
        return env

    def _softmax_step(self, node: OnlineSoftmax, logits: Named, tile: _Tile, state) -> Named:
        """One tile of eq. 9: new running max, rescale factor alpha, running denominator."""
        ops = self.ops
        dim = logits.axes.index(node.axis)
        row_axes = tuple(a for a in logits.axes if a != node.axis)
        if ops.symbolic:
            shape = tuple(s for i, s in enumerate(logits.data.shape) if i != dim)
            tile_no = next(self._symbols)
            m_new = np.empty(shape, dtype=object)
            for idx in np.ndindex(*shape):
                m_new[idx] = sp.Symbol(f"m{tile_no}_" + "_".join(map(str, idx)), real=True)
            shifted = logits.data - np.expand_dims(m_new, dim)
            p = ops.exp(shifted)
        else:
            x = logits.data
            if self.valid_tokens is not None:
                pos = torch.arange(tile.start, tile.stop, device=x.device)
                keep = pos[None, :] < self.valid_tokens[:, None]  # [batch, tile]
                keep = keep.reshape(keep.shape[0], *([1] * (x.dim() - 2)), keep.shape[1]).movedim(-1, dim)
                x = torch.where(keep, x, torch.full_like(x, -math.inf))
            tile_max = x.amax(dim)
            m_new = tile_max if state["m"] is None else torch.maximum(state["m"], tile_max)
            p = torch.exp(x - m_new.unsqueeze(dim))
        if state["m"] is None:
            alpha = None  # nothing accumulated yet
            l_new = _einsum(ops, [(p, logits.axes)], row_axes)
        else:
            alpha = ops.exp(state["m"] - m_new)
            l_new = alpha * state["l"] + _einsum(ops, [(p, logits.axes)], row_axes)
        state.update(m=m_new, l=l_new, alpha=alpha, axes=row_axes)
        return Named(p, logits.axes)

    def _eval_final(self, node, env, state) -> Named:
        if isinstance(node, Divide):
            acc = env[node.acc]
            if self.ops.symbolic:
                inv = np.vectorize(lambda v: 1 / v, otypes=[object])(env["__lambda__"].data)
            else:
                inv = 1 / state["l"]
            return Named(_einsum(self.ops, [(acc.data, acc.axes), (inv, state["axes"])], acc.axes), acc.axes)
        return self._eval(node, env, None)

    # -- one node -------------------------------------------------------------------------
    def _eval(self, node, env, tile: _Tile | None) -> Named:
        ops = self.ops

        def get(name):
            if name not in env:
                raise GraphError(f"%{node.name} reads %{name}, which has no value at this point of the "
                                 "tile loop (is a per-tile value used after the accumulation?)")
            if env[name].data is None:
                raise GraphError(f"%{node.name} reads the encoded input %{name} directly; read its "
                                 "codes, scale and zero (fold) or its dequantized values")
            return env[name]
        if isinstance(node, Input):
            if node.role == "ones":  # the constant 1 (row and column sums, eq. 15)
                return Named(ops.const(np.ones([tile.length(a) for a in node.axes], dtype=np.int64)), node.axes)
            if node.encoding is not None:
                return Named(None, node.axes)  # read through its codes / param / dequantize nodes
            return self._bound(node.name, "values", node.axes, tile)
        if isinstance(node, Codes):
            c = self._bound(node.source, "codes", node.axes, tile)
            return Named(c.data + node.bias, node.axes) if node.bias else c
        if isinstance(node, GroupParam):
            p = self._bound(node.source, node.param, node.axes, tile)
            if node.param == "zero" and node.bias:
                s = self._bound(node.source, "scale", node.axes, tile)
                return Named(p.data - node.bias * s.data, node.axes)
            return p
        if isinstance(node, Dequantize):
            pax = param_axes(self.graph[node.source])
            c = self._bound(node.source, "codes", node.axes, tile)
            s = _to_elements(ops, tile, self._bound(node.source, "scale", pax, tile))
            z = _to_elements(ops, tile, self._bound(node.source, "zero", pax, tile))
            return Named(s.data * c.data + z.data, node.axes)
        if isinstance(node, Contract):
            lhs, rhs = get(node.lhs), get(node.rhs)
            if node.split is not None:
                return self._split_contract(node, lhs, rhs, tile)
            return Named(_einsum(ops, [(lhs.data, lhs.axes), (rhs.data, rhs.axes)], node.axes), node.axes)
        if isinstance(node, Prescale):
            operand = get(node.operand)
            scale = _to_elements(ops, tile, get(node.scale))
            return Named(_einsum(ops, [(operand.data, operand.axes), (scale.data, scale.axes)], node.axes),
                         node.axes)
        if isinstance(node, ScaleGroups):
            partial, scale = get(node.partial), get(node.scale)
            coarse = next(a for a in scale.axes if isinstance(a, GroupedAxis) and a.base == node.groups.base)
            inputs = [(partial.data, partial.axes), (scale.data, scale.axes)]
            if coarse != node.groups:
                inputs.append((tile.regroup(node.groups, coarse), (node.groups, coarse)))
            return Named(_einsum(ops, inputs, node.axes), node.axes)
        if isinstance(node, Correction):
            zero, other = get(node.zero), get(node.other)
            if node.form == "presummed":  # other holds per-group sums on the zero's group axis (eq. 15)
                return Named(_einsum(ops, [(other.data, other.axes), (zero.data, zero.axes)], node.axes), node.axes)
            if node.form == "group-sum":
                grouped = next(a for a in zero.axes if isinstance(a, GroupedAxis) and a.base == node.reduce)
                sums_axes = tuple(grouped if base_of(a) == node.reduce else a for a in other.axes)
                group_sums = _einsum(ops, [(other.data, other.axes), (tile.membership(grouped),
                                                                      (node.reduce, grouped))], sums_axes)
                zero_rest = Named(zero.data, zero.axes)
                zero_rest = _to_elements_except(ops, tile, zero_rest, node.reduce)
                return Named(_einsum(ops, [(group_sums, sums_axes), (zero_rest.data, zero_rest.axes)], node.axes),
                             node.axes)
            z = _to_elements(ops, tile, zero)
            return Named(_einsum(ops, [(other.data, other.axes), (z.data, z.axes)], node.axes), node.axes)
        if isinstance(node, Add):
            return Named(get(node.lhs).data + get(node.rhs).data, node.axes)
        if isinstance(node, MulScalar):
            return Named(get(node.input).data * self.sm_scale, node.axes)
        raise GraphError(f"%{node.name}: the executor cannot run a {node.kind} node here")

    def _split_contract(self, node, lhs: Named, rhs: Named, tile: _Tile) -> Named:
        """Partial sums per group (eq. 5): one contraction per group over its run of the reduced
        axis (groups are consecutive indices), stacked along the group axis."""
        ids = tile.group_ids(node.split)
        part_axes = tuple(a for a in node.axes if a != node.split)
        parts = []
        for j in range(int(ids.max()) + 1):
            lo, hi = int(np.argmax(ids == j)), int(len(ids) - np.argmax(ids[::-1] == j))
            take = [(_take(x.data, x.axes, node.reduce, lo, hi), x.axes) for x in (lhs, rhs)]
            parts.append(_einsum(self.ops, take, part_axes))
        return Named(self.ops.stack(parts, node.axes.index(node.split)), node.axes)

    def _bound(self, name: str, part: str, axes, tile: _Tile | None) -> Named:
        try:
            data = self.bindings[(name, part)]
        except KeyError:
            raise GraphError(f"no {part} bound for input %{name}") from None
        return Named(_slice_tokens(data, axes, tile), tuple(axes))


def _take(data, axes, base: str, lo: int, hi: int):
    """``data`` restricted to indices [lo, hi) of its axis ``base``."""
    dim = tuple(axes).index(base)
    return data[(slice(None),) * dim + (slice(lo, hi),)]


def _to_elements_except(ops, tile, x: Named, keep_base: str) -> Named:
    """Broadcast grouped axes to elements, except the one on ``keep_base``."""
    inputs = [(x.data, x.axes)]
    out_axes = []
    for a in x.axes:
        if isinstance(a, GroupedAxis) and a.base != keep_base:
            inputs.append((tile.membership(a), (a.base, a)))
            out_axes.append(a.base)
        else:
            out_axes.append(a)
    if len(inputs) == 1:
        return x
    return Named(_einsum(ops, inputs, tuple(out_axes)), tuple(out_axes))
