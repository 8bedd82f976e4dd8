"""A variant of the register-operand GEMV for `benchmarks/gemv_ab.py`: at m > 8 (4-bit codes, the activation's rows
copied into shared memory, `X_SHARED` 2) the activation tile [ROWS, D] is swizzled in 64-byte units, each row's units
XOR-ed with its row's parity, instead of 16-byte units XOR-ed with the row modulo 8. Not production code.

Why (Nsight Compute at INT4 28672 x 8192, m = 16, H100, docs/results/ncu_gemv_m16_m1_h100_2026-12-06.txt and its
per-instruction source page): each of the chunk's eight LDS.128 reads of the tile takes 8 shared wavefronts where 4
would do. The MMA's B operand puts a 32-k block of eight rows in one LDS.128, lane 4n + u reading row n's 16-byte unit
u; a 128-bit load is served eight lanes (rows n and n + 1) at a time, and the 16-byte swizzle maps both rows' four
units into the same 64 bytes of a 128-byte bank window (u ^ n for n = 0, 1 stays in 0..3). With 64-byte units XOR-ed
by the row's parity, rows n and n + 1 fall in different halves of the window: one wavefront per eight lanes. The
copies into the tile (16 lanes a row) stay conflict-free: eight lanes cover half a row, one 128-byte window.

    PYTHONPATH=. python3 benchmarks/gemv_ab.py --b benchmarks/gemv_xswizzle.py --quick --cases 5,6,11 \
        --out $OUT/gemv_xswizzle.json
    python3 benchmarks/gemv_xswizzle.py   # CPU: the modelled wavefronts, the SASS beside production's

Built ahead of time for sm_90 (2026-12-06): 301 SASS per chunk against 308, 106-112 registers against 112-114, the
tile's reads still eight LDS.128 a chunk; the model below gives 4 wavefronts per read against production's 8 at every
chunk width. Not yet run on a GPU.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl

import foldc.backends.gluon.gemv as production
from foldc.bench import rebound


@constexpr_function
def x_rows_tile_64b():
    """The activation tile [ROWS, D] (X_SHARED 2): 64-byte units (32 fp16), XOR-ed with the row's parity."""
    return gl.SwizzledSharedLayout(vec=32, per_phase=1, max_phase=2, order=[1, 0])


program_tiles = rebound(production.program_tiles, x_rows_tile_layout=x_rows_tile_64b)
program_start = rebound(production.program_start, program_tiles=program_tiles)
program_sums = rebound(production.program_sums, program_start=program_start)
foldc_gemv_gluon = rebound(production.foldc_gemv_gluon, program_sums=program_sums)


def lds128_wavefronts(vec: int, max_phase: int, d: int, rows: int = 16) -> float:
    """Shared wavefronts per LDS.128 of the MMA's B operand from a [rows, d] fp16 tile swizzled in units of ``vec``
    elements (each row's units XOR-ed with the row modulo ``max_phase``), as the hardware serves a 128-bit load: eight
    lanes at a time, lane 4n + u reading row n's 16-byte unit u of a 32-k block (the operand's linear layout, gl.
    to_linear_layout: lane bits 0-1 k 8 and 16, bits 2-4 the row). Production's tile (vec 8, max_phase 8) gives 8,
    what Nsight Compute counted (917,504 wavefronts for 114,688 loads); 4 is the least for 512 bytes."""
    total, loads = 0, 0
    for tile in range(rows // 8):
        for block in range(d // 32):
            for quarter in range(4):
                banks: dict[int, set] = {}
                for lane in range(8 * quarter, 8 * quarter + 8):
                    row, col = lane // 4 + 8 * tile, 32 * block + 8 * (lane % 4)
                    word = (row * d + ((col // vec) ^ (row % max_phase)) * vec + col % vec) // 2
                    for w in range(word, word + 4):
                        banks.setdefault(w % 32, set()).add(w)
                total += max(len(words) for words in banks.values())
            loads += 1
    return total / loads


if __name__ == "__main__":
    from foldc.bench import gemv_variant_builds

    for d in (128, 256, 512):
        print(f"D = {d}: wavefronts per LDS.128, production {lds128_wavefronts(8, 8, d):.0f}, "
              f"64-byte units {lds128_wavefronts(32, 2, d):.0f}")

    gemv_variant_builds(foldc_gemv_gluon, "xswizzle", [("k-group:4:128", 28672, 8192, 16),
                                                       ("k-group:4:128", 4096, 14336, 16),
                                                       ("k-group:4:128", 4096, 14336, 12)])
