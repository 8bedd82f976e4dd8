"""The register-operand kernel's launch defaults: its constexprs from the lowered plan, how many KV heads a
program packs, tokens per tile, where token scales load, the resident programs of an SM and the split count that
fills a wave.
`GluonAttention` (launch.py) reads them; each cites the measurement behind it (docs/perf.md)."""
from __future__ import annotations

import math

from ...errors import SpecError
from .lower import HALF_TILE_GROUP, FoldKernel
from .operands import KEY_EXPONENT, VALUE_EXPONENT, key_unpack_asm, value_unpack_asm

# Hopper's register file and block limits, for the resident programs of one SM (resident_programs)
PARTITIONS, REGISTERS_PER_PARTITION, REGISTER_UNIT = 4, 16384, 256
MAX_PROGRAMS_PER_SM, SHARED_PER_BLOCK = 32, 1024


def constexprs(cfg: FoldKernel, block_n: int, stages: int, heads: int = 1, scale_ahead: bool | None = None,
               dynamic: bool = False) -> dict:
    """The kernel's compile-time arguments for ``cfg`` (the unpack PTX is generated here), with
    ``heads`` KV heads packed into one program's query rows; ``scale_ahead``: load the next tile's
    token-wise scales and zeros one tile early into registers, else each tile's at its start
    (None: `default_scale_ahead`); ``dynamic``: the programs of a (batch, head group) draw chunks of
    tiles from a shared counter (`chunk_tiles` each) instead of taking consecutive splits."""
    if dynamic and stages != 2:
        raise SpecError(f"dynamic tiles need stages=2 (the tile copied ahead is the next one drawn); got "
                        f"stages={stages}: use stages=2 or dynamic_tiles=False")
    if heads > 1 and (cfg.key_dequant or cfg.value_dequant):
        raise SpecError(f"pack_heads={heads} with a dequant plan: the dequant paths take one KV head per program; "
                        "use pack_heads=1")
    if scale_ahead is None:
        scale_ahead = default_scale_ahead(cfg)
    # a plain side has no unpack (its KEY_G / VAL_G is -1: no scales, no groups)
    key_asm, key_cons = ("", "") if cfg.key_plain else key_unpack_asm(cfg.key_bits)
    values = [("", "")] * 4 if cfg.value_plain else [value_unpack_asm(cfg.value_bits, byte, cfg.value_dequant)
                                                     for byte in range(4)]
    return dict(Q_PER_KV=cfg.q_per_kv, ROWS=cfg.rows, H=heads, BN=block_n, D=cfg.width, DR=cfg.head_dim,
                KBITS=cfg.key_bits,
                VBITS=cfg.value_bits, RB=cfg.row_blocks,
                KEY_G=-1 if cfg.key_plain else cfg.key_tokens,
                VAL_G=-1 if cfg.value_plain else cfg.value_tokens, STAGES=stages,
                SCALE_AHEAD=bool(scale_ahead), KASM=key_asm, KCONS=key_cons, VA0=values[0][0],
                VA1=values[1][0], VA2=values[2][0], VA3=values[3][0], VCONS=values[0][1], VALUE_EXP=VALUE_EXPONENT,
                KEY_EXP=0 if cfg.key_dequant else KEY_EXPONENT, PREFETCH=default_prefetch(cfg),
                DYNAMIC=bool(dynamic),
                CHUNK=chunk_tiles(cfg, block_n), KEY_NG=cfg.key_groups, VAL_NG=cfg.value_groups,
                KDQ=cfg.key_dequant, VDQ=cfg.value_dequant, KMG=cfg.key_masked_groups, VMG=cfg.value_masked_groups,
                QH=cfg.head_rows)


def chunk_tiles(cfg: FoldKernel, block_n: int) -> int:
    """Tiles a program draws at once with dynamic tiles: one, or a channel-wise group's worth, so that
    a chunk starts on a group boundary and walks its group in order (the kernel reloads a group's
    scales at its first tile)."""
    return max([block_n] + [g for g in (cfg.key_tokens, cfg.value_tokens) if g]) // block_n


DEFAULT_MAX_PACK = 4   # KV heads per program the launcher packs by default (default_pack_heads)


def packable_heads(cfg: FoldKernel, num_kv_heads: int) -> int:
    """Most KV heads one program can pack into the MMA's N axis: a power of two whose query rows
    together fill at most ``cfg.rows`` (so the softmax works on real rows only) and that divides
    ``num_kv_heads`` (channel-wise sides then take per-row channel scales)."""
    if cfg.key_dequant or cfg.value_dequant:   # the dequant paths rebuild one head's values per tile
        return 1
    heads = 1 << (max(1, cfg.rows // cfg.q_per_kv).bit_length() - 1)   # a power of two
    while num_kv_heads % heads:
        heads //= 2
    return heads


def default_pack_heads(cfg: FoldKernel, num_kv_heads: int) -> int:
    """The launcher's choice: pack as many heads as fit, every layout. With a channel-wise side the
    packed kernel needs more registers (227-255 at INT2 against 168-237 for one head, AOT SASS), yet
    it was 9-62% faster on the H200 at 8 x 64K and 32 x 64K, INT2 and INT4 (docs/perf.md). Past 128
    channels with a channel-wise side, one head: two spill (per-row channel scales of 256 channels)."""
    if cfg.width > 128 and (cfg.key_tokens or cfg.value_tokens):
        return 1
    if cfg.key_masked_groups or cfg.value_masked_groups:
        # token-wise groups across a padded head_dim's bit fields: each packed head's pieces in turn, at most two
        # and only in 128 padded channels. H100, head_dim 96, 32/8, 8 x 64K: token-wise g32 INT2 199.3 -> 160.1 us,
        # INT4 1.06x, INT8 (K g48) 1.01x, INT2 at 2 x 16K 1.04x (docs/results/masked_heads_d96_32x8_h100_2026-12-06
        # .json). At head_dim 160, INT2 g32, two heads spilled 143 registers a tile against one's 50 (AOT, sm_90)
        return 1 if cfg.width > 128 else min(packable_heads(cfg, num_kv_heads), 2)
    if max(cfg.key_groups, cfg.value_groups) > 4 or (cfg.width > 128 and max(cfg.key_groups, cfg.value_groups) == 4):
        # eight channel groups per token (head_dim 256 in groups of 32): eight score accumulators and
        # eight P's per head; two packed heads spilled 194-257 registers, one head none (AOT SASS). Four groups
        # of 64 at head_dim 256: two heads spilled 6 registers per 32-token tile, one head none (sm_90, sm_100)
        return 1
    if cfg.value_tokens == HALF_TILE_GROUP or (cfg.key_tokens == HALF_TILE_GROUP and cfg.value_tokens):
        # channel-wise V in groups of half a tile (two value products per head, each its own accumulator),
        # or both sides channel-wise with such groups: two heads. On an H100 at 8 x 64K, 32/8, two were
        # 1.05-1.56x faster than one (INT2 1.23-1.56x, INT4 1.10-1.34x, INT8 1.05x;
        # docs/results/pack2_half_tile_32x8_h100_2026-12-06.json) with 0-24 spilled registers a tile in AOT
        # builds; before V's parameter offsets (219200f) 2-4 heads spilled 4-335
        return min(packable_heads(cfg, num_kv_heads), 2)
    # at most DEFAULT_MAX_PACK: eight one-row heads (query heads = KV heads) took 235 us at INT2 8 x 64K
    # on the H200 against 104 with four and 108 with two (each head's P masked by a select per half
    # with more than two; benchmarks/gqa_sweep.py, docs/perf.md)
    return min(packable_heads(cfg, num_kv_heads), DEFAULT_MAX_PACK)


def row_blocks_at_64(cfg: FoldKernel, target: str) -> bool:
    """Whether a kernel of query row blocks beside a channel-wise side in groups of 64 tokens takes 64-token tiles
    by default, its scales loaded at each tile's start (`GluonAttention` then leaves ``scale_ahead`` False)."""
    # H200, 8 x 64K at 64/2: 147.0 against 182.8 µs for K channel:4:64 / V token:4:64,
    # 152.5 against 185.9 for both channel:4:64; groups of 128 and INT8 were slower so, docs/perf.md).
    # sm_90 only: not measured on sm_100, whose build of both channel:4:64 spills 52 registers so
    # Not beside a dequant plan (eq. 12a rebuilds channel-wise keys past 8 rows): 64-token tiles of rebuilt keys
    # spilled 30-44 registers a tile ahead of time, 32 none (K channel:4:64 at 64/2 146.1 µs on an H100 against
    # the fold's 148.2 at 64, docs/results/fold_or_dequant_h100_2026-12-06.json)
    groups = [g for g in (cfg.key_tokens, cfg.value_tokens) if g]
    return target == "sm_90" and cfg.row_blocks > 1 and 64 in groups and not (cfg.key_dequant or cfg.value_dequant)


def default_block_n(cfg: FoldKernel, target: str, pack_heads: int) -> int:
    """Tokens per tile where neither the call nor a tuned bucket sets them, for ``pack_heads`` KV heads per
    program: 64 for wide INT2 layouts and `row_blocks_at_64`, else 32."""
    # 64-token tiles won for packed INT2 at every large shape and layout on the H200 (docs/perf.md):
    # 4-13% faster than 32 for channel-wise sides since their scales arrive as vectors. 32 elsewhere,
    # and where a channel-wise group of 32 tokens could not hold a 64-token tile. With two channel
    # groups per token, 32-token tiles: 168 registers (three warps per scheduler) against 214,
    # 1-3% faster at INT2 8 x 64K and 32 x 64K; with four, both sizes hold two warps and 64 was
    # 6-7% faster (H200, tenth session: `git show 6178656:docs/perf.md`). Two token-wise groups a token beside a
    # channel-wise side in groups of 64 or 128 tokens, head_dim 128: 64, 3-7% faster at INT2 32/8 8 x 64K on an
    # H100 (docs/results/block64_mixed_32x8_h100_2026-12-06.json; no spill ahead of time on sm_90 or sm_100;
    # at head_dim 64 and 96 64-token tiles spilled 8-13 registers a tile)
    groups = [g for g in (cfg.key_tokens, cfg.value_tokens) if g]
    # one KV head per program: 64 also won at INT2 (114.5 against 118.3 us at 32/8, 115.6 against
    # 119.2 at 40/8); four packed heads: 32 (103.8 against 123.1 us at 8/8; benchmarks/gqa_sweep.py)
    # 16 rows of one head: 32 (94.3 against 94.8 us at 64/4; a cap of 168 registers, 12 programs per SM
    # instead of 8 and no spills at 32, was slower: 98.0 against 94.5, docs/perf.md)
    # Not (AOT SASS, docs/results/grid_aot_full.json): past 128 channels (token:2:64 at head_dim 256 spilled 223
    # registers per 64-token tile on sm_90), nor four channel groups per token beside a channel-wise side
    # (spilled 12-37 per tile on sm_90, 2-110 on sm_100; 32-token tiles none on sm_90, at most one on sm_100;
    # neither tile size timed there: `benchmarks/spill_twins.py` on a GPU)
    one_wide_head = cfg.rows == 16 and pack_heads == 1
    most_groups = max(cfg.key_groups, cfg.value_groups)
    wide = pack_heads <= 2 and not one_wide_head and cfg.key_bits == cfg.value_bits == 2 and \
        all(g % 64 == 0 for g in groups) and cfg.width <= 128 and \
        (most_groups == 1 or (most_groups == 4 and not groups) or
         (most_groups == 2 and bool(groups) and cfg.head_dim == 128))
    return 64 if wide or row_blocks_at_64(cfg, target) else 32


def default_scale_ahead(cfg: FoldKernel) -> bool:
    """Token-wise K and V: load each tile's scales at its start (frees the registers that held the
    next tile's; 1-4% faster on the H200, docs/perf.md). A channel-wise side: one tile ahead (its
    token-wise side's scales loaded late cost 10-45% there)."""
    return bool(cfg.key_tokens or cfg.value_tokens)


def default_prefetch(cfg: FoldKernel) -> bool:
    """Prefetch the next tile's token-wise scales into L2 while this tile runs (scales loaded at each
    tile's start only): at INT2, 1-2% faster on the H200 at 8 x 64K, 32 x 16K, 32 x 64K and 1 x 16K.
    At INT4 the pointers cost registers (168 -> 174 with 32-token tiles, two heads: 8 programs per SM
    instead of 12) and it was 0.4% slower (docs/perf.md). The kernel prefetches on contiguous
    caches only: on pages, rebasing the four pointers per tile adds 7% to the loop, unmeasured. Not
    with several channel groups per token, whose parameters span more than one line per tile row."""
    return cfg.key_bits == cfg.value_bits == 2 and cfg.key_groups == 1 and cfg.value_groups == 1   # never plain


def resident_programs(n_regs: int, shared_bytes: int, max_shared: int) -> int:
    """One-warp programs an SM holds at once: each of its four scheduler partitions holds the warps
    whose registers (allocated per warp in units of 256) fit its 16K, and shared memory and the
    block limit cap the rest. 168 registers: 3 per partition, 12 per SM; 184 or 192: 8 per SM."""
    per_warp = math.ceil(max(int(n_regs), 1) * 32 / REGISTER_UNIT) * REGISTER_UNIT
    by_registers = PARTITIONS * (REGISTERS_PER_PARTITION // per_warp)
    by_shared = max_shared // (shared_bytes + SHARED_PER_BLOCK) if shared_bytes else MAX_PROGRAMS_PER_SM
    return max(1, min(by_registers, by_shared, MAX_PROGRAMS_PER_SM))


MIN_SPLIT_TOKENS = 128   # tokens per split past half a wave of resident programs (wave_splits)


def wave_splits(groups: int, tokens: int, block_n: int, sms: int, resident: int, waves: float = 1.0,
                min_tokens: int = MIN_SPLIT_TOKENS) -> int:
    """Split count for ``groups`` (batch x packed KV head) programs per split: as many as fill
    ``waves`` whole waves of resident programs (``sms x resident`` each) without starting another,
    at least two tiles per split, and ``min_tokens`` past half a wave (0: no such floor). A wave that
    spills over by a few programs leaves the SMs nearly idle while they finish: 1.13 waves took 23%
    longer than 0.97 (docs/perf.md)."""
    tiles = max(1, math.ceil(tokens / block_n))
    fit = int(waves * sms * resident) // max(1, groups)
    splits = max(1, min(fit, math.ceil(tiles / 2), 1024))
    # Past half a wave, splits of two 32-token tiles spend more on each program's fixed work (its query, a
    # group's parameters, its workspace rows, which the merge reads back) than on its tiles: at least
    # ``min_tokens`` per split there, down to half a wave (1 x 16K at 16 rows per program: 15% faster on the
    # H100, docs/perf.md). Below half a wave the programs run side by side and more splits are shorter.
    half = (sms * resident // 2) // max(1, groups)
    if min_tokens and splits > half:
        splits = max(1, min(splits, max(half, tokens // min_tokens)))
    return splits


# An eager call's decode kernel merges its own splits (split_merge.py) where its grid holds at most this many
# programs: the barrier's GPU time grows with them (H100, `benchmarks/grid_merge.py`, docs/perf.md)
MERGE_MOST_PROGRAMS = 1024
BARRIER_FIXED = 2   # the merging barrier's counters before the groups' (split_merge.py): arrivals and the generation
