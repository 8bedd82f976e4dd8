"""Whether a change leaves the register-operand kernel's machine code alone: every build of a set of
layouts ahead of time (CPU, no GPU), the SHA-256 of its whole disassembly (opcodes and operands, in
order; addresses left out), written to a file or compared with one written before.

    python3 benchmarks/sass_hash.py --out /tmp/before.json              # on the tree before a change (a worktree)
    python3 benchmarks/sass_hash.py --compare /tmp/before.json          # after it: exit 1 if any differs

Layouts: the CI grid's (tests/backends/test_gluon_grid_aot.py) by default, or ``--grid quick|timed|full``
of `foldc bench --layouts`; ``--only`` keeps the labels that contain one of its comma-separated words.
``--gemv``: the register-operand GEMV instead (GEMV_CASES: weight encodings x activation rows x dtypes); ``--merge``:
the decode builds that merge their splits inside (an eager call's cooperative launch, split_merge.py).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the tree this script is in, not an installed (editable) foldc: a worktree of the old commit measures the old code
sys.path.insert(0, str(ROOT))


def layouts(grid: str | None):
    if grid is None:
        sys.path.insert(0, str(ROOT / "tests" / "backends"))
        from test_gluon_grid_aot import GRID

        from foldc.spec import spec_from_args

        return [(f"K {k} V {v} {h} d{d}", spec_from_args(None if k == "none" else k, None if v == "none" else v, h, d))
                for k, v, h, d in GRID]
    from foldc.layout_grid import grid as layout_grid

    return [(x.label, x.spec()) for x in layout_grid(grid)]


GEMV_CASES = [(enc, n, k, m, dtype) for enc, n, k in (("k-group:4:128", 4096, 14336), ("k-group:2:128", 28672, 8192),
                                                        ("k-group:8:128", 4096, 4096), ("k-group:4:32", 4096, 14336),
                                                        ("per-channel:4", 1000, 2048), ("k-group:2:64:fp32", 96, 1536))
              for m in (1, 5, 16) for dtype in ("fp16", "bf16")]


def gemv_layouts():
    from foldc.gemm import GemmSpec, parse_gemm_encoding

    return [(f"gemv {enc} {n}x{k} m{m} {dtype}", (GemmSpec(n, k, parse_gemm_encoding(enc, "weight")), m, dtype))
            for enc, n, k, m, dtype in GEMV_CASES]


def sass_hash(spec, arch: str, merge: bool = False) -> str:
    from foldc.backends.gluon.aot import compile_gluon_aot
    from foldc.backends.gluon.gemv_aot import compile_gemv_aot
    from foldc.backends.runtime.sass import disassemble

    with tempfile.TemporaryDirectory() as out:
        if isinstance(spec, tuple):   # a GEMV: (spec, m, dtype)
            compile_gemv_aot(spec[0], arch, out, m=spec[1], dtype=spec[2])
        else:
            compile_gluon_aot(spec, arch, out, merge=merge)
        cubin = next(Path(out).glob(f"*.{arch}.cubin"))
        text = "\n".join(f"{op} {args}" for _, op, args in disassemble(cubin))
    return hashlib.sha256(text.encode()).hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grid", choices=("quick", "timed", "full"), default=None)
    ap.add_argument("--only", default=None)
    ap.add_argument("--gemv", action="store_true", help="the GEMV's builds (GEMV_CASES) instead of attention's")
    ap.add_argument("--arch", default="sm_90,sm_100")
    ap.add_argument("--merge", action="store_true", help="the decode builds that merge their splits inside")
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--out")
    group.add_argument("--compare")
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    from foldc.errors import FoldError

    chosen = gemv_layouts() if args.gemv else layouts(args.grid)
    if args.only:
        chosen = [(label, s) for label, s in chosen if any(w.strip() in label for w in args.only.split(","))]
    hashes = {}
    for label, spec in chosen:
        for arch in args.arch.split(","):
            try:
                hashes[f"{label} {arch}"] = sass_hash(spec, arch, args.merge)
            except FoldError as e:
                hashes[f"{label} {arch}"] = f"refused: {str(e)[:120]}"
            print(f"{label} {arch}: {hashes[f'{label} {arch}'][:16]}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(hashes, indent=1))
        return 0
    before = json.loads(Path(args.compare).read_text())
    changed = sorted(k for k in hashes if k in before and before[k] != hashes[k])
    missing = sorted(set(before) - set(hashes))
    print(f"{len(hashes)} builds: {len(changed)} changed, {len(missing)} in the old file not built now")
    for k in changed:
        print("  changed:", k)
    return 1 if changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
