"""Variants of the register-operand decode kernel for `benchmarks/ab_kernel.py`: code tiles of 16 words a token and
more XOR-swizzled in 32-byte units, so that the operands' shared reads meet fewer bank conflicts without the
lane-order placement's extra address registers (benchmarks/value_tile_layout.py: 178 registers against 168, and
slower at these widths). Not production code.

A key read (`key_words_layout`, LDS.64: tokens t..t+3 and eight words a half warp) takes 2 wavefronts at most at
eight words a token; at 16 words tokens t and t + 2 share banks (4), at 32 all four do (8). Units of eight words
XOR-ed by (t // 2) % 2 at 16 words, t % 4 at 32 and more, give 2. A value read (`value_words_layout`, LDS.32: words
0..7 of tokens t, t + 8, t + 16, t + 24) takes 4; units XOR-ed by (t // 8) % (W / 8) give 2 at 16 words, 1 at 32.
Counted from the production layouts by tests/backends/test_gluon_shared_banks.py's model:
`python3 benchmarks/swizzled_tiles.py`. The copies (16 bytes a lane, inside one unit) stay conflict-free.

`foldc_decode_gluon`: both sides; `keys_only`, `values_only`: one side.

    PYTHONPATH=. python3 benchmarks/ab_kernel.py --variant both=benchmarks/swizzled_tiles.py \\
        --variant keys=benchmarks/swizzled_tiles.py:keys_only \\
        --variant values=benchmarks/swizzled_tiles.py:values_only \\
        --cases 4:token/token:8x65536,2:token/token:8x65536 --out $OUT/ab.json
"""
from __future__ import annotations

import sys

from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl

import foldc.backends.gluon.kernel as production
from foldc.backends.gluon.operands import NARROW_WORDS
from foldc.bench import rebound


@constexpr_function
def key_smem(fields, BN, W):
    """[BN, W] key words: W >= 16 swizzled in 8-word units (phase (t // 2) % 2 at 16 words, t % 4 past)."""
    fields, BN, W = int(fields), int(BN), int(W)
    if fields == 0 or W < 16:
        return production._key_smem(fields, BN, W)
    return gl.SwizzledSharedLayout(vec=8, per_phase=max(1, 32 // W), max_phase=min(4, W // 8), order=[1, 0])


@constexpr_function
def value_smem(fields, BN, W):
    """[BN, W] value words (W words a token in the cache): W >= 16 swizzled in 8-word units by (t // 8) % (W / 8)."""
    fields, BN, W = int(fields), int(BN), int(W)
    if fields == 0 or W == NARROW_WORDS or W < 16:
        return production._value_smem(fields, BN, W)
    return gl.SwizzledSharedLayout(vec=8, per_phase=8, max_phase=min(4, W // 8), order=[1, 0])


foldc_decode_gluon = rebound(production.foldc_decode_gluon, _key_smem=key_smem, _value_smem=value_smem)
keys_only = rebound(production.foldc_decode_gluon, _key_smem=key_smem)
values_only = rebound(production.foldc_decode_gluon, _value_smem=value_smem)


if __name__ == "__main__":   # CPU: the modelled wavefronts, then registers and SASS per tile beside production's
    import statistics
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "backends"))
    from test_gluon_shared_banks import _xor, value_read_wavefronts, wavefronts, word_offsets

    from foldc.backends.gluon.tile_operands import key_words_layout
    from foldc.bench import decode_variant_builds

    def key_wavefronts(smem, BN, W):
        layout, offsets = key_words_layout(BN, W), word_offsets(smem, BN, W)
        regs, total, reads = layout.reg_bases[1:], 0, 0   # register bit 0: the pair's second word, one LDS.64
        for r in range(1 << len(regs)):
            for half in range(2):
                lanes = []
                for lane in range(16 * half, 16 * half + 16):
                    t, w = [a ^ b for a, b in zip(_xor(regs, r), _xor(layout.lane_bases, lane))]
                    lanes.append({offsets[(t, w)], offsets[(t, w | 1)]})
                total += wavefronts(lanes)
            reads += 1
        return total / reads

    for W in (16, 32):
        print(f"W = {W}: key read wavefronts {key_wavefronts(production._key_smem(1, 64, W), 64, W):.0f} -> "
              f"{key_wavefronts(key_smem(1, 64, W), 64, W):.0f}; value read "
              f"{statistics.mean(value_read_wavefronts(production._value_smem(1, 64, W), 64, W)):.0f} -> "
              f"{statistics.mean(value_read_wavefronts(value_smem(1, 64, W), 64, W)):.0f}")
    decode_variant_builds(foldc_decode_gluon, "swizzled", [("token:4:128", "token:4:128", "32/8", 128),
                                                           ("token:2:128", "token:2:128", "32/8", 256),
                                                           ("token:8:128", "token:8:128", "32/8", 128)])
