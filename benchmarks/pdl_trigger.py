"""A variant of the register-operand decode kernel for `benchmarks/ab_kernel.py`: the kernel signals
`griddepcontrol.launch_dependents`, so that the merge (launched as its programmatic dependent under CUDA graphs)
is launched before the last decode program exits. Not production code.

Why (`benchmarks/merge_share.py`, H100, 2026-12-06): under CUDA graphs the merge adds 2.4-2.7 µs to INT2 calls of
1 x 4K and 1 x 16K (16-17%) and 3.4-4.2 µs at larger shapes. The merge is launched with PDL, but production's
decode kernel never triggers, so the merge launches only once every decode program has exited. A trigger lets its
programs be placed as SMs free up in the decode's tail; its `griddepcontrol.wait` still waits for the whole decode
grid and its writes, so the answer is the same whatever the trigger's place.

The trigger goes in where the kernel reads its query (`load_query`, in the prologue once the first tiles' copies
are under way; later calls of it have no effect): production's kernel with that one callee rebound. Measured on an
H100 (docs/perf.md "What the merge costs under CUDA graphs"): at most 2% off; a trigger after each program's last
tile, measured beside it, is `git show 8a4e71d:benchmarks/pdl_trigger.py`.

    PYTHONPATH=. python3 benchmarks/ab_kernel.py --variant start=benchmarks/pdl_trigger.py --rounds 3 \\
        --cases 2:token/token:1x16384,2:token/token:8x65536 --out $OUT/ab.json
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

import foldc.backends.gluon.kernel as production
from foldc.backends.gluon.tile_groups import load_query
from foldc.bench import rebound


@gluon.jit
def load_query_then_trigger(Q, b, stride_qb, q_head0, stride_qh, rq, q_off, q_mask, D: gl.constexpr,
                            ROWS: gl.constexpr, SWAP: gl.constexpr):
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)
    return load_query(Q, b, stride_qb, q_head0, stride_qh, rq, q_off, q_mask, D, ROWS, SWAP)


foldc_decode_gluon = rebound(production.foldc_decode_gluon, load_query=load_query_then_trigger)


if __name__ == "__main__":   # CPU: the sm_90 build carries the trigger (PREEXIT) and keeps production's registers
    import tempfile
    from pathlib import Path

    from foldc.backends.runtime.sass import disassemble
    from foldc.bench import decode_variant_builds

    decode_variant_builds(foldc_decode_gluon, "trigger", [("token:2:128", "token:2:128", "32/8", 128)])
    kept = production.foldc_decode_gluon
    production.foldc_decode_gluon = foldc_decode_gluon
    try:
        from foldc.backends.gluon.aot import compile_gluon_aot
        from foldc.spec import spec_from_args

        with tempfile.TemporaryDirectory() as out:
            compile_gluon_aot(spec_from_args("token:2:128", "token:2:128", "32/8", 128), "sm_90", out)
            ops = [op for _, op, _ in disassemble(next(Path(out).glob("*.sm_90.cubin")))]
    finally:
        production.foldc_decode_gluon = kept
    print(f"PREEXIT instructions: {ops.count('PREEXIT')}")
