"""How the Triton backend maps a plan's axes onto one program's register tiles.

One program handles one (batch, kv_head, split): its query rows (``q_per_kv`` padded to
``rows``) are the MMA's M, a tile of ``block_n`` tokens the N (scores) or K (values) dimension,
and the channel axis is cut into *chunks* of ``width`` channels, each of which lies inside one
bit field of the planar packing (see foldc/encoding.py) and inside one channel group of any
token-wise encoding, so no unscaled partial sum crosses a group (eq. 5).

Axes of a plan value become:
- ``q_per_kv`` -> rows; ``token`` -> the tile's tokens; ``token/g`` -> nothing (a tile lies in
  one token group: ``block_n`` divides every token group size, the plan's tiling constraint);
- ``channel`` -> one register tile per chunk; ``channel/g`` -> one per channel group.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ...errors import SpecError
from ...ir import CHANNEL, TOKEN
from ...plan import plan_of

MIN_DOT = 16  # smallest M, N and K of tl.dot


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two that divides n and is <= cap."""
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p


@dataclass(frozen=True)
class TileGeometry:
    head_dim: int
    rows: int          # padded query rows (power of two, >= 16)
    block_n: int       # tokens per tile
    width_qk: int      # channels per chunk in the qk product
    width_pv: int      # channels per chunk in the pv product
    # chunk c of each product holds channels first[c] .. first[c] + valid[c] - 1 and then valid..width
    # padding channels (zero query, zero codes, outputs not stored): a bit field of fewer channels than
    # a whole number of 16-wide chunks (head_dim 96 at INT2: 24 per field) ends in a padded chunk
    first_qk: tuple[int, ...] = ()
    valid_qk: tuple[int, ...] = ()
    first_pv: tuple[int, ...] = ()
    valid_pv: tuple[int, ...] = ()

    def chunks(self, product: str) -> int:
        return len(self.first(product))

    def width(self, product: str) -> int:
        return self.width_qk if product == "qk" else self.width_pv

    def first(self, product: str) -> tuple[int, ...]:
        return self.first_qk if product == "qk" else self.first_pv

    def valid(self, product: str) -> tuple[int, ...]:
        return self.valid_qk if product == "qk" else self.valid_pv

    def padded(self, product: str, chunk: int) -> bool:
        return self.valid(product)[chunk] < self.width(product)


def channel_chunks(spec, product) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """(width, first channel of each chunk, its real channels) for one product (a `foldc.plan.ProductPlan`):
    chunks of a power of two >= 16 channels inside one bit field and one channel group (its tiling
    numbers). Where a field's channels are no multiple of 16 (head_dim 96 at INT2: 24) each field ends in
    a padded chunk, which must still lie in one channel group."""
    cap = 64
    head_dim, t = spec.head_dim, product.tiling
    per_field, group = t.channels_per_field or head_dim, t.channel_group or head_dim
    width = _pow2_divisor(math.gcd(head_dim, per_field, group), cap)
    if width >= MIN_DOT:
        starts = tuple(range(0, head_dim, width))
        return width, starts, (width,) * len(starts)
    width = MIN_DOT
    starts, valid = [], []
    for f in range(head_dim // per_field):
        for s in range(0, per_field, width):
            first, n = f * per_field + s, min(width, per_field - s)
            if first // group != (first + n - 1) // group:
                enc = spec.k if product.product == "qk" else spec.v
                raise SpecError(
                    f"the Triton backend splits {product.product} channels into chunks of {MIN_DOT} inside one bit "
                    f"field and one channel group; with head_dim={head_dim} and {enc.short() if enc else 'plain'} "
                    f"the chunk of channels {first}..{first + n - 1} would cross a group of {group} (a chunk would "
                    f"otherwise hold {_pow2_divisor(math.gcd(head_dim, per_field, group), cap)} channels, below the "
                    f"tensor-core minimum of {MIN_DOT}): use a larger group_size, or the reference target")
            starts.append(first)
            valid.append(n)
    return width, tuple(starts), tuple(valid)


def token_block(spec, requested: int, the_plan=None) -> int:
    """Tokens per tile: a power of two >= 16 that divides every token-group size (eq. 5), the
    plan's `token_tile_multiple` (``the_plan`` defaults to `plan_of(spec)`)."""
    the_plan = the_plan or plan_of(spec)
    groups = [p.token_tile_multiple for p in the_plan.products.values() if p.token_tile_multiple]
    block = requested
    for group in groups:
        block = min(block, _pow2_divisor(group, requested))
    if block < MIN_DOT:
        raise SpecError(
            f"channel-wise group_size={groups} admits no token tile of >= {MIN_DOT} tokens that stays "
            "inside one group (the plan's tiling constraint): use a group size that is a multiple of 16")
    return block


def check_block_n(block_n) -> None:
    """``block_n`` is the token extent of tl.arange and tl.dot: a power of two >= MIN_DOT."""
    if isinstance(block_n, bool) or not isinstance(block_n, int) or block_n < MIN_DOT or block_n & (block_n - 1):
        raise SpecError(f"block_n={block_n!r} must be a power of two >= {MIN_DOT} (tokens per tile), e.g. 32 or 64")


def geometry(spec, block_n: int = 64, the_plan=None) -> TileGeometry:
    """The tiles for ``spec``, from its plan's tiling numbers (``the_plan`` defaults to `plan_of(spec)`)."""
    check_block_n(block_n)
    if spec.head_dim < MIN_DOT or spec.head_dim % MIN_DOT:
        # channels go in chunks of a power of two >= 16 (channel_chunks); head_dim is only their count
        raise SpecError(f"head_dim={spec.head_dim} must be a multiple of {MIN_DOT} for the Triton backend")
    the_plan = the_plan or plan_of(spec)
    rows = max(MIN_DOT, 1 << (spec.q_per_kv - 1).bit_length())
    w_qk, first_qk, valid_qk = channel_chunks(spec, the_plan.products["qk"])
    w_pv, first_pv, valid_pv = channel_chunks(spec, the_plan.products["pv"])
    return TileGeometry(spec.head_dim, rows, token_block(spec, block_n, the_plan), w_qk, w_pv, first_qk, valid_qk,
                        first_pv, valid_pv)


def tile_kind(axes) -> tuple[bool, bool, str | None]:
    """(has rows, has tokens, channel form) of a value with these plan axes."""
    bases = {getattr(a, "base", a): a for a in axes}
    rows = "q_per_kv" in bases
    tokens = TOKEN in bases and bases[TOKEN] == TOKEN
    chan = None
    if CHANNEL in bases:
        chan = "chunk" if bases[CHANNEL] == CHANNEL else "group"
    return rows, tokens, chan
