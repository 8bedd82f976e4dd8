"""A variant of the register-operand GEMV for `benchmarks/gemv_ab.py`: production's kernel
(foldc/backends/gluon/gemv.py) with one function replaced. Not production code.

    PYTHONPATH=. python3 benchmarks/gemv_ab.py --b benchmarks/gemv_variants.py --quick --cases 0,1,2,3,4,7   # H200
    PYTHONPATH=. python3 benchmarks/gemv_variants.py   # CPU: registers and chunk SASS, sm_90

``foldc_gemv_gluon`` (the row): the bf16 path that puts x in fp16 (production's where the weight's plan carries
no code bias: 8-bit codes, or 2-bit codes in one group over a long k) at m = 1 converts the row with one value
per lane first (D / 32 each: one load, the warp's largest magnitude by shuffles, the same power of two), then lays
it out as the MMA operand's columns (`convert_layout`); production converts it after broadcasting it to the
operand's [D, ROWS] layout, where each lane holds D / 4 values. Same values and powers of two: the outputs equal
production's bit for bit.

On the H200 (2026-12-04, docs/results/gemv_bias_ab_h200_2026-12-04.json) against production's bf16 path then (x
put in fp16): INT4 g128 4096 x 14336 16.2 against 19.3 µs, 28672 x 8192 51.3 against 63.0; the biased bf16 codes
that production now runs for 2- and 4-bit codes took 15.1 and 45.3 in the same run. X_SHARED (the only case this
variant changes) is 2- and 4-bit codes at m = 1, so it is left here. `rebound` copies production's callers with
their callee swapped.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

import foldc.backends.gluon.gemv as production
import foldc.backends.gluon.gemv_chunk as production_chunk
from foldc.bench import rebound
from foldc.backends.gluon.tile_operands import swap_k01


@gluon.jit
def _x_operand(x_in, D: gl.constexpr, ROWS: gl.constexpr, XF16: gl.constexpr, X_SHARED: gl.constexpr,
               SWAP: gl.constexpr, BIAS: gl.constexpr):
    """production_chunk._x_operand, except at m = 1 with bf16 activations: the row in fp16 with one value per lane
    first, then in every column."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    if X_SHARED and not production_chunk.x_as_is(XF16, BIAS):
        flat: gl.constexpr = gl.BlockedLayout(size_per_thread=[max(1, D // 32)], threads_per_warp=[32],
                                              warps_per_cta=[1], order=[0])
        xr = x_in.load(flat).to(gl.float32)
        c1 = gl.exp2(12.0 - gl.floor(gl.log2(gl.maximum(gl.max(gl.abs(xr), axis=0), 1e-30))))
        xd = gl.convert_layout((xr * c1).to(gl.float16), gl.SliceLayout(1, b_l))
        if SWAP:
            xd = gl.convert_layout(swap_k01(xd, D, 0), gl.SliceLayout(1, b_l), assert_trivial=True)
        x16 = gl.broadcast(xd[:, None], gl.zeros([D, ROWS], gl.int1, layout=b_l))[0]
        # the one row's c in every column, in the accumulators' layout (production_chunk._undo's conversion: none)
        c = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(0, mma)) + c1
    else:
        x16, c = production_chunk._x_operand(x_in, D, ROWS, XF16, X_SHARED, SWAP, BIAS)
    return x16, c


_chunk = rebound(production_chunk._chunk, _x_operand=_x_operand)
chunk_loop = rebound(production.chunk_loop, _chunk=_chunk)
program_sums = rebound(production.program_sums, chunk_loop=chunk_loop)
foldc_gemv_gluon = rebound(production.foldc_gemv_gluon, program_sums=program_sums)


CASES = (("k-group:4:128", 4096, 14336, 1), ("k-group:2:128", 28672, 8192, 1))

if __name__ == "__main__":   # python3 benchmarks/gemv_variants.py: the SASS comparison at fp16 and bf16 activations (the
    # variant's bf16 build runs the unbiased path only where production's plan has no code bias, so here it equals
    # production's)
    from foldc.bench import gemv_variant_builds

    gemv_variant_builds(foldc_gemv_gluon, "row", CASES, dtypes=("fp16", "bf16"))
