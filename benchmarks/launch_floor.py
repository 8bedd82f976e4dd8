"""What a batch-1 decode call costs beyond its kernels' work: CUDA-graph replays of an empty kernel,
of two empty kernels (the second a programmatic dependent, as the merge is), of the decode kernel
alone and of the whole call (decode + merge) at a few shapes, each the median of triton's do_bench
(H200; evidence for docs/perf.md, not a test).

    PYTHONPATH=. python3 benchmarks/launch_floor.py --shapes 1x16384,1x4096 --out $OUT/floor.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

import foldc
from foldc.bench import decode_case
from foldc.timing import capture_graph


@triton.jit
def _empty(X):
    tl.store(X + tl.program_id(0), 1.0)


def replay_us(fn) -> float:
    from triton.testing import do_bench

    fn()
    graph = capture_graph(fn)
    return do_bench(graph.replay, warmup=50, rep=200, return_mode="median") * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x16384,1x4096")
    ap.add_argument("--bits", default="2")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    x = torch.zeros(1024, device="cuda")
    rows = [dict(what="one empty kernel", us=replay_us(lambda: _empty[(1,)](x))),
            dict(what="two empty kernels", us=replay_us(lambda: (_empty[(1,)](x), _empty[(1,)](x)))),
            dict(what="two empty kernels, 512 programs", us=replay_us(lambda: (_empty[(512,)](x), _empty[(512,)](x))))]
    for bits in (int(b) for b in args.bits.split(",")):
        enc = foldc.Affine(bits, "token", 128)
        spec = foldc.AttentionSpec(32, 8, 128, enc, enc)
        for item in args.shapes.split(","):
            b, n = (int(v) for v in item.split("x"))
            q, k, v = decode_case(spec, b, n, seed=b + n)
            attn = foldc.compile(spec, "sm_90", kernel="gluon")
            out = attn(q, k, v)
            launch = attn.launch_config(q.dtype, b, n)
            splits, per_split = attn.split_plan(launch, b, n, q.device, q.dtype)
            ws = attn.workspace(launch, b, splits, q.device)
            decode, _ = attn._kernels()
            dargs, kwargs = attn.decode_arguments(launch, q, k, v, None, ws, 128 ** -0.5, per_split, n, None)
            grid = (b, spec.num_kv_heads // launch["heads"], splits)
            rows.append(dict(what=f"INT{bits} {item} decode kernel alone", splits=splits, heads=launch["heads"],
                             us=replay_us(lambda: decode[grid](*dargs, **kwargs))))
            for pdl in (True, False):
                attn.pdl = pdl
                rows.append(dict(what=f"INT{bits} {item} whole call (merge pdl={pdl})",
                                 us=replay_us(lambda: attn(q, k, v, out=out))))
    for r in rows:
        print(f"{r['what']:<48} {r['us']:7.2f} us", flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
