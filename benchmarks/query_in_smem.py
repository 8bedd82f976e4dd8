"""A variant of the register-operand decode kernel for `benchmarks/ab_kernel.py`: at 16 query rows per program
(and more), token-wise keys in one channel group, the query operand Q'^T [D, ROWS] waits in shared memory and is
loaded for each tile instead of living in registers across the token loop. Not production code.

Why (docs/perf.md "Many query rows per KV head"): the 16-row program takes 236 registers (8 warps an SM, two a
scheduler) and is bound by latency (0.83 eligible warps per scheduler on the H200), not by the MMA rate. Q'^T is
32 of those registers at head_dim 128; at 204 or fewer, 10 warps fit an SM. The shared load costs a few LDS per
tile. Built from production's kernel.py by five substitutions (so it follows the kernel as it changes).

    python3 benchmarks/query_in_smem.py        # CPU: registers and SASS per tile beside production's (sm_90)
    PYTHONPATH=. python3 benchmarks/ab_kernel.py --variant qsmem=benchmarks/query_in_smem.py --heads 64/4 \\
        --cases 2:token/token:8x65536,4:token/token:8x65536 --out $OUT/ab.json
"""
from __future__ import annotations

import importlib.util
import pathlib
import tempfile

import foldc.backends.gluon.kernel as production

WHEN = "ROWS >= 16 and KF > 0 and KEY_G == 0 and KEY_NG == 1 and not KDQ"
SUBSTITUTIONS = (
    ("    h = (gl.program_id(1) // RB) * H\n",
     f"    USE_QSMEM: gl.constexpr = {WHEN}\n    h = (gl.program_id(1) // RB) * H\n"),
    ("    # row m of O^T is channel operands.value_channel(m)\n",
     "    q_smem = gl.allocate_shared_memory(gl.float16, [D, ROWS], QUERY_SMEM)   # benchmarks/query_in_smem.py\n"
     "    if USE_QSMEM:\n"
     "        q_smem.store(q16)\n"
     "    # row m of O^T is channel operands.value_channel(m)\n"),
    ("                                          acc_o, tm, head_c, head_b, q16, q_bias,",
     "                                          acc_o, tm, head_c, head_b, _query(q16, q_smem, b_l, USE_QSMEM), q_bias,"),
    ("                                      head_c, head_b, q16, q_bias,",
     "                                      head_c, head_b, _query(q16, q_smem, b_l, USE_QSMEM), q_bias,"),
    ("@constexpr_function\ndef _side_smem(fields):",
     "QUERY_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[0, 1])\n\n\n"
     "@gluon.jit\n"
     "def _query(q16, q_smem, layout: gl.constexpr, USE: gl.constexpr):\n"
     "    if USE:   # Q'^T from shared memory for this tile\n"
     "        q = q_smem.load(layout)\n"
     "    else:\n"
     "        q = q16\n"
     "    return q\n\n\n"
     "@constexpr_function\ndef _side_smem(fields):"),
)


def _source() -> str:
    source = pathlib.Path(production.__file__).read_text()
    for old, new in SUBSTITUTIONS:
        if source.count(old) != 1:
            raise SystemExit(f"kernel.py no longer has exactly one {old.strip()[:60]!r}: update query_in_smem.py")
        source = source.replace(old, new)
    return source


def _load():
    path = pathlib.Path(tempfile.mkdtemp()) / "foldc_query_in_smem.py"
    path.write_text(_source())
    spec = importlib.util.spec_from_file_location("foldc_query_in_smem", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.foldc_decode_gluon


foldc_decode_gluon = _load()


if __name__ == "__main__":
    from foldc.bench import decode_variant_builds

    decode_variant_builds(foldc_decode_gluon, "query smem", [("token:2:128", "token:2:128", "64/4", 128),
                                                             ("token:4:128", "token:4:128", "64/4", 128),
                                                             ("token:2:128", "token:2:128", "32/8", 128)])
