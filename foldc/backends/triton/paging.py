"""Paged KV storage for the generated decode kernel (FlashInfer's page-table conventions).

A page pool holds ``num_pages`` pages of ``page_size`` (P) tokens for every KV head. An encoded
operand's pool is an `AffineTensor` whose batch axis is the page: codes ``[num_pages, kv_heads, P,
head_dim * bits / 8]`` and scale/zero ``[num_pages, kv_heads, P, head_dim / group_size]`` (token-wise)
or ``[num_pages, kv_heads, P / group_size, head_dim]`` (channel-wise), in the packed encoding of
foldc/encoding.py; a plain operand's pool is ``[num_pages, kv_heads, P, head_dim]``. Sequence ``b``
owns pages ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` in token order: token ``t`` of ``b`` lies at
row ``t % P`` of page ``kv_indices[kv_indptr[b] + t // P]``.

How the kernel reads through the table: ``generate(..., paged=True)`` emits exactly the tile body of
the contiguous kernel, which addresses a token row as ``<input>_base + offs_n * stride_n`` (and a
channel-wise parameter row as ``<input>_sbase + (tile_start // group_size) * stride_sn``). Instead of
one base per (batch, KV head) hoisted before the loop, the paged kernel computes the bases per tile
from the page that holds the tile, *rebased* by the page's first token::

    page  = kv_indices[kv_indptr[b] + tile_start // P]
    base  = page * stride_page + kvh * stride_h - (tile_start // P) * P * stride_n

so ``base + offs_n * stride_n`` is row ``offs_n % P`` of that page. This needs a tile inside one
page (``block_n`` divides P; tiles start at multiples of ``block_n``) and, for channel-wise
encodings, whole groups in a page (``group_size`` divides P). Nothing else in the kernel changes.
"""
from __future__ import annotations

import math

from ...decisions import token_group
from ...errors import SpecError
from ...plan import plan_of
from .layout import MIN_DOT, check_block_n

PAGED_ARGS = ("KV_INDPTR", "KV_INDICES")


def check_page_size(spec, page_size) -> int:
    """P must be a positive integer; channel-wise encodings need whole groups in a page (each
    product's `token_tile_multiple` in the spec's plan)."""
    the_plan = plan_of(spec)
    for name in ("k", "v"):
        check_page_size_for(getattr(spec, name), page_size, name, the_plan.of_operand(name).token_tile_multiple)
    return page_size


def check_page_size_for(enc, page_size, name: str = "", group: int | None = None) -> int:
    """`check_page_size` for one operand's encoding (None: plain); ``group``: its plan's
    `token_tile_multiple` (None: read from ``enc``, `foldc.decisions.token_group`)."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise SpecError(f"page_size={page_size!r} must be a positive integer (tokens per page), e.g. 16 or 64")
    group = token_group(enc) if group is None else group
    if group and page_size % group:
        raise SpecError(f"page_size={page_size} is not a multiple of group_size={enc.group_size} of the "
                        f"channel-wise {name + ' ' if name else ''}encoding ({enc.short()}): a page must hold whole "
                        f"groups, so use page_size={math.lcm(page_size, enc.group_size)} or another multiple of "
                        f"{enc.group_size}")
    return page_size


def paged_block_n(spec, page_size: int, block_n: int | None) -> int:
    """Tokens per tile for paged storage: a power of two >= 16 that divides ``page_size`` (a tile
    lies in one page). ``None`` picks the largest such divisor up to 64."""
    check_page_size(spec, page_size)
    if block_n is None:
        block_n = 1
        while block_n < 64 and page_size % (block_n * 2) == 0:
            block_n *= 2
        if block_n < MIN_DOT:
            raise SpecError(f"page_size={page_size} has no power-of-two divisor >= {MIN_DOT}; the kernel's token "
                            f"tiles (block_n) must divide the page: use a page_size that is a multiple of {MIN_DOT}")
        return block_n
    check_block_n(block_n)
    if page_size % block_n:
        raise SpecError(f"block_n={block_n} does not divide page_size={page_size}: a token tile must lie in one "
                        f"page; use a block_n dividing {page_size} (e.g. {math.gcd(block_n, page_size)}) or leave "
                        "block_n=None")
    return block_n


def hoisted_lines() -> list[str]:
    """Kernel lines before the token loop: where this sequence's page list starts, and the split's
    end clamped to the tokens its pages hold."""
    return ["page_first = tl.load(KV_INDPTR + b)  # this sequence's first entry in KV_INDICES",
            # device lengths are not checked on the host (a sync): never read past the sequence's own pages
            "end = tl.minimum(end, (tl.load(KV_INDPTR + b + 1) - page_first) * PAGE_SIZE)"]


def tile_base_lines(inputs: dict) -> list[str]:
    """Per-tile kernel lines: the page holding the tile and every input's rebased bases
    (``inputs``: name -> (kind "values" | "encoded", encoding or None))."""
    lines = [
        "tile_page = tile_start // PAGE_SIZE",
        "page = tl.load(KV_INDICES + page_first + tile_page).to(tl.int64)",
        "page_token0 = tile_page * PAGE_SIZE  # the page's first token in this sequence",
    ]
    for name, (kind, enc) in inputs.items():
        lines.append(f"{name}_base = page * stride_{name}b + kvh * stride_{name}h - page_token0 * stride_{name}n")
        if kind == "encoded":
            # token-wise parameters are addressed per token, channel-wise ones per token group
            group = token_group(enc)
            row0 = "page_token0" if group is None else f"(page_token0 // {group})"
            lines.append(f"{name}_sbase = page * stride_{name}sb + kvh * stride_{name}sh - {row0} * stride_{name}sn")
    return lines
