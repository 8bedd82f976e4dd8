"""A variant of the register-operand GEMV for `benchmarks/gemv_ab.py --b benchmarks/gemv_variants.py`: the
production kernel (foldc/backends/gluon/gemv.py) with another `_x_operand`. Not production code.

    PYTHONPATH=. python3 benchmarks/gemv_ab.py --b benchmarks/gemv_variants.py --quick --cases 0,1,2,3,4,7   # H200
    PYTHONPATH=. python3 benchmarks/gemv_variants.py     # CPU: registers and chunk-loop SASS beside production's

At m = 1 with bf16 activations (X_SHARED) the production `_x_operand` puts the row in fp16 after broadcasting it
to the MMA operand's [D, ROWS] layout, where each lane holds D / 4 values (the row's 8 columns are copies):
the conversion (to float32, the largest magnitude, times a power of two, to fp16) runs on each of them, and
bf16 calls took 1.4x the fp16 ones on the H200 (19.4 against 13.7 µs at INT4 g128 4096 x 14336,
docs/results/gemv_ab_release_h200_2026-12-04.json). Here the row is converted with one element per lane
(D / 32 each: one load, the warp's largest magnitude by shuffles, the same power of two), then laid out as
the operand's columns (`convert_layout`, through shared memory). The values and the power of two are the
production kernel's, so the outputs should be bit-identical to it. Everything but `_x_operand` is the production
kernel's: `_chunk`, `chunk_loop`, `program_sums` and the kernel are production's functions rebound to call this
module's `_x_operand` (`rebound`).

Built for sm_90 (`sass_counts`), INT4 g128 4096 x 14336 at bf16: 110 registers and 393 SASS per chunk against
production's 167 and 572 (fp16: 98 and 299); INT2 g128 28672 x 8192: 100 and 477 against 127 and 654. Not yet
run on a GPU (the previous variant, a release-only split-k counter, was 0-3% slower: the .json above).
"""
from __future__ import annotations

import types

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

import foldc.backends.gluon.gemv as production
from foldc.backends.gluon.tile_operands import swap_k01


@gluon.jit
def _x_operand(x_in, D: gl.constexpr, ROWS: gl.constexpr, XF16: gl.constexpr, X_SHARED: gl.constexpr,
               SWAP: gl.constexpr):
    """production._x_operand, except at m = 1 with bf16 activations: the row in fp16 with one value per lane
    first, then in every column."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    if X_SHARED and not XF16:
        flat: gl.constexpr = gl.BlockedLayout(size_per_thread=[max(1, D // 32)], threads_per_warp=[32],
                                              warps_per_cta=[1], order=[0])
        xr = x_in.load(flat).to(gl.float32)
        c1 = gl.exp2(12.0 - gl.floor(gl.log2(gl.maximum(gl.max(gl.abs(xr), axis=0), 1e-30))))
        xd = gl.convert_layout((xr * c1).to(gl.float16), gl.SliceLayout(1, b_l))
        if SWAP:
            xd = gl.convert_layout(swap_k01(xd, D, 0), gl.SliceLayout(1, b_l), assert_trivial=True)
        x16 = gl.broadcast(xd[:, None], gl.zeros([D, ROWS], gl.int1, layout=b_l))[0]
        # the one row's c in every column, in the accumulators' layout (production._undo's conversion is then none)
        c = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(0, mma)) + c1
    else:
        x16, c = production._x_operand(x_in, D, ROWS, XF16, X_SHARED, SWAP)
    return x16, c


def rebound(jit_function, **names):
    """A copy of a production Gluon function whose global ``names`` are this module's objects (the callees it
    compiles), so that a variant replaces one function and leaves its callers' source as it is."""
    fn = jit_function.fn
    scope = dict(fn.__globals__, **names)
    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__annotations__ = fn.__kwdefaults__, fn.__annotations__
    return gluon.jit(copy)


_chunk = rebound(production._chunk, _x_operand=_x_operand)
chunk_loop = rebound(production.chunk_loop, _chunk=_chunk)
program_sums = rebound(production.program_sums, chunk_loop=chunk_loop)
foldc_gemv_gluon = rebound(production.foldc_gemv_gluon, program_sums=program_sums)


def sass_counts(cases=(("k-group:4:128", 4096, 14336), ("k-group:2:128", 28672, 8192))) -> list[dict]:
    """Registers and chunk-loop SASS of the production kernel and this variant, built ahead of time for sm_90
    at m = 1 with fp16 and bf16 activations (CPU, no GPU; TRITON_INTERPRET unset)."""
    import sys
    import tempfile

    from foldc.backends.gluon.gemv_aot import compile_gemv_aot
    from foldc.gemm import GemmSpec, parse_gemm_encoding

    rows, kept = [], production.foldc_gemv_gluon
    variant = sys.modules[__name__].foldc_gemv_gluon
    for enc, n, k in cases:
        for name, kernel in (("production", kept), ("variant", variant)):
            for dtype in ("fp16", "bf16"):
                production.foldc_gemv_gluon = kernel   # compile_gemv_aot builds the module's kernel
                try:
                    with tempfile.TemporaryDirectory() as out:
                        r = compile_gemv_aot(GemmSpec(n, k, parse_gemm_encoding(enc, "weight")), "sm_90", out, m=1,
                                             dtype=dtype)
                finally:
                    production.foldc_gemv_gluon = kept
                rows.append(dict(weight=enc, n=n, k=k, kernel=name, dtype=dtype, registers=r["registers"],
                                 chunk_sass=r["chunk_loop"]["instructions_per_warp"]))
                print(f"{enc} {n}x{k} {name:10} {dtype}: {r['registers']} registers, "
                      f"{rows[-1]['chunk_sass']} SASS per chunk", flush=True)
    return rows


if __name__ == "__main__":   # python3 benchmarks/gemv_variants.py: the SASS comparison above
    sass_counts()
