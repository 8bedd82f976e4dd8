"""Named axes of the IR (decode attention and GEMM).

An axis is a plain string naming one element per index (``"token"``), or a `GroupedAxis`
naming one entry per *group* of ``group_size`` consecutive indices of a base axis
(``token/128``). Scales and zeros of an encoded operand live on grouped axes, and so do the
partial sums an acc-fold keeps apart (docs/derivation.md, equation 5).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

BATCH = "batch"
KV_HEAD = "kv_head"
Q_PER_KV = "q_per_kv"
TOKEN = "token"
CHANNEL = "channel"
#: GEMM axes: y[m, n] = sum_k x[m, k] * w[n, k] (m: tokens/rows, n: output channels, k: reduced)
M = "m"
N = "n"
K = "k"

#: Canonical order: every tensor of the IR keeps its axes in this order.
CANONICAL = (BATCH, KV_HEAD, Q_PER_KV, TOKEN, CHANNEL, M, N, K)


@dataclass(frozen=True)
class GroupedAxis:
    """One entry per group of ``group_size`` consecutive indices of ``base``."""

    base: str
    group_size: int

    def __str__(self) -> str:
        return f"{self.base}/{self.group_size}"


Axis = Union[str, GroupedAxis]


def base_of(axis: Axis) -> str:
    return axis.base if isinstance(axis, GroupedAxis) else axis


def canonical(axes) -> tuple[Axis, ...]:
    """Sort axes into canonical order (a grouped axis sits where its base would)."""
    axes = tuple(axes)
    bases = [base_of(a) for a in axes]
    if len(set(bases)) != len(bases):
        raise ValueError(f"axes {format_axes(axes)} name the same base axis twice")
    unknown = [b for b in bases if b not in CANONICAL]
    if unknown:
        raise ValueError(f"unknown axis {unknown[0]!r}; known axes are {CANONICAL}")
    return tuple(sorted(axes, key=lambda a: CANONICAL.index(base_of(a))))


def find(axes, base: str) -> Axis | None:
    """The entry of ``axes`` on base axis ``base`` (plain or grouped), or None."""
    for a in axes:
        if base_of(a) == base:
            return a
    return None


def format_axes(axes) -> str:
    return "[" + ", ".join(str(a) for a in axes) + "]"
