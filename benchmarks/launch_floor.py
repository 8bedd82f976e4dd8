"""What a batch-1 decode call costs beyond its kernels' work: CUDA-graph replays of an empty kernel,
of two empty kernels (the second a programmatic dependent, as the merge is), of the decode kernel
alone and of the whole call (decode + merge) at a few shapes, each the median of triton's do_bench
(H200; evidence for docs/perf.md, not a test). The same again launched eagerly (do_bench flushes L2
before each call, so the host's launch path hides unless it is slower than that flush), the host's
time per eager call (no synchronisation), and cProfile's heaviest functions of the eager call.

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
from foldc.backends.runtime.merge import launch_merge
from foldc.bench import decode_case, gluon_call_parts
from foldc.timing import back_to_back_us, capture_graph, host_us


@triton.jit
def _empty(X):
    tl.store(X + tl.program_id(0), 1.0)


def replay_us(fn) -> float:
    from triton.testing import do_bench

    fn()
    graph = capture_graph(fn)
    return do_bench(graph.replay, warmup=50, rep=200, return_mode="median") * 1e3


def eager_us(fn) -> float:
    from triton.testing import do_bench

    fn()
    return do_bench(fn, warmup=50, rep=200, return_mode="median") * 1e3


def profile(fn, calls: int = 200, top: int = 14) -> str:
    import cProfile
    import io
    import pstats

    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


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
    empty = _empty.warmup(x, grid=(1,))
    empty._init_handles()
    rows = [dict(what="one empty kernel", us=replay_us(lambda: _empty[(1,)](x)),
                 eager_us=eager_us(lambda: _empty[(1,)](x)), host_us=host_us(lambda: _empty[(1,)](x)),
                 back_to_back_us=back_to_back_us(lambda: _empty[(1,)](x))),
            dict(what="one empty kernel, compiled handle", us=replay_us(lambda: empty[(1, 1, 1)](x)),
                 eager_us=eager_us(lambda: empty[(1, 1, 1)](x)), host_us=host_us(lambda: empty[(1, 1, 1)](x)),
                 back_to_back_us=back_to_back_us(lambda: empty[(1, 1, 1)](x))),
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
            parts = gluon_call_parts(attn, q, k, v, 128 ** -0.5)
            launch, splits, ws = parts["launch"], parts["splits"], parts["ws"]
            dargs, kwargs, grid = parts["args"], parts["kwargs"], parts["grid"]
            decode, _ = attn._kernels()
            alone = lambda: decode[grid](*dargs, **kwargs)
            rows.append(dict(what=f"INT{bits} {item} decode kernel alone", splits=splits, heads=launch["heads"],
                             us=replay_us(alone), eager_us=eager_us(alone), host_us=host_us(alone),
                             back_to_back_us=back_to_back_us(alone)))
            # the same kernel through its compiled handle: no argument binding or cache key per call
            binder = decode.device_caches[torch.cuda.current_device()][4]
            bound = list(binder(*dargs, **kwargs)[0].values())
            handle = decode.warmup(*dargs, grid=grid, **kwargs)
            handle._init_handles()
            fast = lambda: handle[grid](*bound)
            rows.append(dict(what=f"INT{bits} {item} decode alone, compiled handle", us=replay_us(fast),
                             eager_us=eager_us(fast), host_us=host_us(fast),
                             back_to_back_us=back_to_back_us(fast)))
            # the two kernels by hand through triton's ordinary launch, the merge a programmatic
            # dependent or not, eager as well as in a graph (the launcher now uses PDL in graphs only)
            _, merge = attn._kernels()
            lse = torch.empty(b, spec.num_q_heads, device="cuda")
            for pdl in (True, False):
                both = lambda: (decode[grid](*dargs, **kwargs),
                                launch_merge(merge, *ws, out, lse, spec.q_per_kv * launch["heads"], pdl=pdl))
                rows.append(dict(what=f"INT{bits} {item} decode + merge by hand (pdl={pdl})", us=replay_us(both),
                                 eager_us=eager_us(both), host_us=host_us(both), back_to_back_us=back_to_back_us(both)))
            for pdl in (True, False):
                attn.pdl = pdl
                call = lambda: attn(q, k, v, out=out)
                rows.append(dict(what=f"INT{bits} {item} whole call (merge pdl={pdl})", us=replay_us(call),
                                 eager_us=eager_us(call), host_us=host_us(call),
                                 back_to_back_us=back_to_back_us(call)))
            attn.pdl = True
            rows[-2]["profile"] = profile(lambda: attn(q, k, v, out=out))
    print(f"{'what':<48} {'graph':>8} {'eager':>8} {'host':>8} {'b2b':>8}   (us; b2b: back to back)")
    for r in rows:
        print(f"{r['what']:<48} {r['us']:8.2f} " + " ".join(f"{r.get(k, float('nan')):8.2f}" for k in
                                                          ("eager_us", "host_us", "back_to_back_us")), flush=True)
    for r in rows:
        if "profile" in r:
            print(r["what"], "eager call, cProfile by own time:\n", r["profile"])
    Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
