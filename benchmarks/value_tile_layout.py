"""Variants of the register-operand decode kernel for `benchmarks/ab_kernel.py`: the code-word tiles stored so that
the operands' shared-memory reads meet no bank conflicts, at every width. Not production code.

`load_value_words` reads a tile [BN tokens, W words] as [W, BN] in `value_words_layout`: one LDS.32 per register,
its 32 lanes on words 0..7 of tokens t, t + 8, t + 16, t + 24. Stored token by token, those four tokens' words share
a bank: four shared wavefronts a read where one would do (the model below; Nsight Compute counted exactly that on
the H200 at head_dim 64, INT2: `git show 5524660:docs/results/ncu_d64_int2_sass_h200.csv.gz`, 131,072 wavefronts for
32,768 value LDS). `tile_memory.lane_order_smem` places the words so that one read meets 32 consecutive words.
Key tiles of 16 words a token and more (INT4 at head_dim 128, INT2 at 256) meet two to four wavefronts per half warp
in their 64-bit reads; `key_smem` gives them the placement an eight-word token has already.

Measured (H100, 2026-12-06, docs/perf.md "head_dim 64 and head_dims between powers of two"): lane-order value tiles 25% faster at head_dim
64, INT2 (four-word tokens, copied twice into an eight-word tile), 1-7% slower at eight words a token and more; the
key placement 4-6% slower at INT4 and head_dim 256, level elsewhere. Production took the value placement for
four-word tokens only; `foldc_decode_gluon` here takes both sides' at every width, `values_only` and `keys_only`
one side's.

    PYTHONPATH=. python3 benchmarks/ab_kernel.py --variant value_tiles=benchmarks/value_tile_layout.py --out $OUT/ab.json
    python3 benchmarks/value_tile_layout.py   # CPU: wavefronts by the model, SASS beside production's (sm_90)
"""
from __future__ import annotations

from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl

import foldc.backends.gluon.kernel as production
from foldc.backends.gluon.operands import NARROW_WORDS
from foldc.backends.gluon.tile_memory import lane_order_copy_layout, lane_order_smem
from foldc.bench import rebound


@constexpr_function
def value_smem(fields, BN, W):
    """Every code side's value tiles in production's lane order (`tile_memory.lane_order_smem`; production keeps
    it for four-word tokens only), W words a token in the cache."""
    fields, BN, W = int(fields), int(BN), int(W)
    if fields == 0:
        return production._side_smem(fields)
    return lane_order_smem(BN, 8 if W == NARROW_WORDS else W)


@constexpr_function
def value_copy(fields, BN, W):
    """cp.async into `value_smem`."""
    fields, BN, W = int(fields), int(BN), int(W)
    if fields == 0:
        return production.copy_layout(BN, W)
    return lane_order_copy_layout(BN, 8 if W == NARROW_WORDS else W)


@constexpr_function
def key_smem(fields, BN, W):
    """[BN, W] key words, W >= 16: offset bits words 1, 2, 4, tokens 1, 2, 4, then the words from 8, then tokens 8, 16,
    ... (a 64-bit key read's 16 lanes, words 2, 4 and tokens 1, 2, meet 32 consecutive words; W = 8 is that
    already, token by token)."""
    fields, BN, W = int(fields), int(BN), int(W)
    if fields == 0 or W < 16:
        return production._side_smem(fields)
    bases = [[0, 1], [0, 2], [0, 4], [1, 0], [2, 0], [4, 0]] + [[0, 8 << i] for i in range((W // 8).bit_length() - 1)] + \
        [[8 << i, 0] for i in range((BN // 8).bit_length() - 1)]
    return gl.SharedLinearLayout(offset_bases=bases)


@constexpr_function
def key_copy(fields, BN, W):
    """cp.async of a [BN, W] key tile into `key_smem`: four words a lane; lanes 0-7 word 4 and tokens 1, 2."""
    fields, BN, W = int(fields), int(BN), int(W)
    if fields == 0 or W < 16:
        return production.copy_layout(BN, W)
    rest = [[4, 0]] + [[0, 8 << i] for i in range((W // 8).bit_length() - 1)] + \
        [[8 << i, 0] for i in range((BN // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2]] + rest[2:], lane_bases=[[0, 4], [1, 0], [2, 0]] + rest[:2],
                                      warp_bases=[], block_bases=[], shape=[BN, W])


foldc_decode_gluon = rebound(production.foldc_decode_gluon, _value_smem=value_smem, value_copy_layout=value_copy,
                             _key_smem=key_smem, key_copy_layout=key_copy)
values_only = rebound(production.foldc_decode_gluon, _value_smem=value_smem, value_copy_layout=value_copy)
keys_only = rebound(production.foldc_decode_gluon, _key_smem=key_smem, key_copy_layout=key_copy)


def read_wavefronts(offset, BN: int = 32, W: int = 8) -> float:
    """Shared wavefronts per value read (one LDS.32 per register of `value_words_layout`: lane bits 0-1 tokens 8
    and 16, bits 2-4 words 1, 2, 4) for a tile whose word (t, w) sits at ``offset(t, w)``; 1 is the least."""
    total, reads = 0, 0
    for w8 in range(W // 8):
        for t0 in list(range(8)) + [32 * j for j in range(1, BN // 32)]:
            banks: dict[int, set] = {}
            for lane in range(32):
                t, w = t0 + 8 * (lane & 1) + 16 * ((lane >> 1) & 1), (lane >> 2) + 8 * w8
                banks.setdefault(offset(t, w) % 32, set()).add(offset(t, w))
            total += max(len(a) for a in banks.values())
            reads += 1
    return total / reads


def key_read_wavefronts(offset, BN: int = 32, W: int = 16) -> float:
    """Shared wavefronts per 64-bit key read (`key_words_layout`: lane bits 0-1 words 2, 4, bits 2-4 tokens 1, 2, 4;
    registers word 1, token 8, words from 8, tokens from 16), served sixteen lanes at a time; 2 is the least."""
    total, reads = 0, 0
    for t0 in range(0, BN, 8):
        for w0 in range(0, W, 8):
            for half in range(2):
                banks: dict[int, set] = {}
                for lane in range(16 * half, 16 * half + 16):
                    t, w = t0 + (lane >> 2), w0 + 2 * (lane & 3)
                    for x in (offset(t, w), offset(t, w + 1)):
                        banks.setdefault(x % 32, set()).add(x)
                total += max(len(a) for a in banks.values())
            reads += 1
    return total / reads


def key_offset(BN: int, W: int):
    """`key_smem`'s placement as a function (t, w) -> word offset."""
    bits = [("w", 1), ("w", 2), ("w", 4), ("t", 1), ("t", 2), ("t", 4)] + \
        [("w", 8 << i) for i in range((W // 8).bit_length() - 1)] + [("t", 8 << i) for i in range((BN // 8).bit_length() - 1)]

    def offset(t, w):
        return sum(1 << i for i, (d, v) in enumerate(bits) if (t if d == "t" else w) & v)
    return offset


def linear_offset(BN: int, W: int):
    """`value_smem`'s placement as a function (t, w) -> word offset."""
    bits = [("w", 1), ("w", 2), ("w", 4), ("t", 8), ("t", 16)] + [("w", 8 << i) for i in range((W // 8).bit_length() - 1)] + \
        [("t", 1), ("t", 2), ("t", 4)] + [("t", 32 << i) for i in range((BN // 32).bit_length() - 1)]

    def offset(t, w):
        return sum(1 << i for i, (d, v) in enumerate(bits) if (t if d == "t" else w) & v)
    return offset


if __name__ == "__main__":
    from foldc.bench import decode_variant_builds

    for W in (8, 16, 32):
        print(f"W = {W}: wavefronts per value read, production {read_wavefronts(lambda t, w: t * W + w, 64, W):.0f}, "
              f"this layout {read_wavefronts(linear_offset(64, W), 64, W):.0f}")
    for W in (16, 32):
        print(f"W = {W}: wavefronts per key read, production {key_read_wavefronts(lambda t, w: t * W + w, 64, W):.0f}, "
              f"this layout {key_read_wavefronts(key_offset(64, W), 64, W):.0f}")
    decode_variant_builds(foldc_decode_gluon, "value tiles", [
        ("token:2:128", "token:2:128", "32/8", 128), ("token:4:128", "token:4:128", "32/8", 128),
        ("token:4:128", "token:2:128", "32/8", 128), ("token:2:128", "token:2:128", "32/8", 256)])
