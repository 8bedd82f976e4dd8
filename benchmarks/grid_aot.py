"""Build the register-operand kernel ahead of time for every layout of a `foldc bench --layouts` grid,
for sm_90 and sm_100 (CPU, no GPU): what `foldc compile --kernel gluon --target sm_90|sm_100` builds
for each spec, with the launcher's default tile, KV heads per program and register cap. Per build:
registers, spilled registers in the token loop (LDL/STL there), SASS per tile and matrix instructions;
a layout the lowering refuses is recorded with its reason.

    TRITON_INTERPRET= python3 benchmarks/grid_aot.py --grid full --out docs/results/grid_aot_full.json
    python3 benchmarks/grid_aot.py --grid timed --jobs 2 --only "64/4"
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor


def build(job):
    label, arch = job
    from foldc.backends.gluon.aot import compile_gluon_aot
    from foldc.layout_grid import grid
    from foldc.errors import FoldError

    lay = next(x for x in grid(build.grid_name) if x.label == label)
    row = dict(label=label, arch=arch)
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as out:
            r = compile_gluon_aot(lay.spec(), arch, out)
    except FoldError as e:   # refused before code generation: the reason is the answer
        row.update(status="refused", reason=str(e)[:300])
        return row
    except Exception as e:   # a build that fails is a finding, recorded with its message
        row.update(status="failed", reason=f"{type(e).__name__}: {str(e)[:300]}")
        return row
    loop = r["inner_loop"]
    row.update(status="ok", seconds=round(time.perf_counter() - start, 1), registers=r["registers"],
               block_n=r["block_n"], pack_heads=r["pack_heads"], rows=r["rows"],
               spills=loop["local_memory"], instructions_per_tile=loop["instructions_per_tile"],
               hmma=loop["top_opcodes"].get("HMMA", 0), global_loads=loop["global_loads"])
    return row


def _init(grid_name):
    os.environ.pop("TRITON_INTERPRET", None)
    build.grid_name = grid_name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", choices=("quick", "timed", "full"), default="full")
    ap.add_argument("--archs", default="sm_90,sm_100")
    ap.add_argument("--only", default=None, help="comma-separated substrings of the layouts' labels")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        sys.exit("run with TRITON_INTERPRET unset: the builds need Triton's native backend")
    from foldc.layout_grid import grid

    labels = [x.label for x in grid(args.grid)]
    if args.only:
        labels = [x for x in labels if any(w.strip() in x for w in args.only.split(","))]
    jobs = [(label, arch) for label in labels for arch in args.archs.split(",")]
    rows = []
    start = time.perf_counter()
    with ProcessPoolExecutor(args.jobs, initializer=_init, initargs=(args.grid,)) as pool:
        for row in pool.map(build, jobs):
            rows.append(row)
            print(json.dumps(row), flush=True)
    by_status = {s: sum(r["status"] == s for r in rows) for s in ("ok", "refused", "failed")}
    spilled = [f"{r['label']} {r['arch']}" for r in rows if r["status"] == "ok" and r["spills"]]
    summary = dict(grid=args.grid, builds=len(rows), **by_status, spilled_in_loop=spilled,
                   seconds=round(time.perf_counter() - start))
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(summary=summary, rows=rows), f, indent=1)
    return 0 if not by_status["failed"] and not spilled else 1


if __name__ == "__main__":
    sys.exit(main())
