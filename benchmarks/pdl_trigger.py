"""Variants of the register-operand decode kernel for `benchmarks/ab_kernel.py`: the kernel signals
`griddepcontrol.launch_dependents`, so that the merge (launched as its programmatic dependent under CUDA graphs)
is launched before the last decode program exits. Not production code.

Why (`benchmarks/merge_share.py`, H100, 2026-12-06): under CUDA graphs the merge adds 2.4-2.7 µs to INT2 calls of
1 x 4K and 1 x 16K (16-17%) and 3.4-4.2 µs at larger shapes. The merge is launched with PDL, but production's
decode kernel never triggers, so the merge launches only once every decode program has exited. A trigger lets its
programs be placed as SMs free up in the decode's tail; its `griddepcontrol.wait` still waits for the whole decode
grid and its writes, so the answer is the same whatever the trigger's place.

`foldc_decode_gluon`: the trigger at each program's start; `at_end`: after its last tile, before the workspace
writes. Both are production's source with one line added (built from foldc/backends/gluon/kernel.py as it is).

    PYTHONPATH=. python3 benchmarks/ab_kernel.py --variant start=benchmarks/pdl_trigger.py \\
        --variant end=benchmarks/pdl_trigger.py:at_end --cases 2:token/token:1x16384,2:token/token:8x65536 --out $OUT/ab.json
"""
from __future__ import annotations

import importlib.util
import pathlib
import tempfile

import foldc.backends.gluon.kernel as production

TRIGGER = ('    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32, '
           'is_pure=False, pack=1)\n')
START = "    h = (gl.program_id(1) // RB) * H\n"
END = "    # token-wise V: undo the field weights 2^(bits*field) per output row, add the zero term (eq. 6);\n"


def _variant(name: str, anchor: str):
    """Production's kernel.py with TRIGGER before its one line ``anchor``, imported as a module of its own."""
    source = pathlib.Path(production.__file__).read_text()
    if source.count(anchor) != 1:
        raise SystemExit(f"kernel.py no longer has exactly one {anchor.strip()!r}: update benchmarks/pdl_trigger.py")
    path = pathlib.Path(tempfile.mkdtemp()) / f"foldc_pdl_{name}.py"
    path.write_text(source.replace(anchor, TRIGGER + anchor))
    spec = importlib.util.spec_from_file_location(f"foldc_pdl_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.foldc_decode_gluon


foldc_decode_gluon = _variant("start", START)
at_end = _variant("end", END)


if __name__ == "__main__":   # CPU: both build for sm_90 and carry the trigger
    import glob
    import subprocess

    from foldc.backends.gluon.aot import compile_gluon_aot
    from foldc.backends.runtime.sass import _tool
    from foldc.spec import spec_from_args

    kept = production.foldc_decode_gluon
    for name, kernel in (("start", foldc_decode_gluon), ("end", at_end)):
        production.foldc_decode_gluon = kernel   # compile_gluon_aot builds the module's kernel
        try:
            out = tempfile.mkdtemp()
            r = compile_gluon_aot(spec_from_args("token:2:128", "token:2:128", "32/8", 128), "sm_90", out)
        finally:
            production.foldc_decode_gluon = kept
        cubin = glob.glob(out + "/*.sm_90.cubin")[0]
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
        print(f"{name}: {r['registers']} registers, ACQBULK/PREEXIT lines: "
              f"{[line.strip() for line in sass.splitlines() if 'PREEXIT' in line or 'ACQBULK' in line][:3]}")
