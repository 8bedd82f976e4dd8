"""Sweep the register-operand kernel's launch options on a GPU (one process, a few minutes).

For each shape and option set: relative L2 against float64 attention on the same dequantized
cache (shapes up to 600K tokens), time of eager calls and of CUDA-graph replays (medians of
triton.testing.do_bench), and % of the HBM read ceiling (a streaming read measured at the start of the run) on the
bytes the kernel must read.

    PYTHONPATH=. python3 benchmarks/gluon_sweep.py --out results/sweep.json [--quick]
    PYTHONPATH=. python3 benchmarks/gluon_sweep.py --out d64.json --bits 2 --head-dim 64 --group 64 \
        --shapes 8x65536 --pack 2,4 --block-n 32,64 --stages 2,3,4 --maxnreg none --scale-ahead 0,1
    PYTHONPATH=. python3 benchmarks/gluon_sweep.py --out c8.json --sides channel:8:16/token:4:64 --heads 16/4 \
        --head-dim 256 --shapes 1x16384 --pack 1 --block-n 32 --stages 2,3 --split-factor 0.5,1,2
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time


import foldc
from foldc.bench import decode_case, save_rows, stream_read_ceiling, timed
from foldc.encoding import parse_affine
from foldc.testing import rel_l2



def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", help="comma-separated BATCHxTOKENS, e.g. 8x65536,32x16384")
    ap.add_argument("--pack", default="1,auto", help="pack_heads values to try (auto: the launcher's choice)")
    ap.add_argument("--maxnreg", default="none,128", help="register caps to try (none: the compiler's)")
    ap.add_argument("--block-n", default="32,64")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--split-factor", default="1", help="waves of resident programs")
    ap.add_argument("--scale-ahead", default="0", help="1: token-wise scales a tile early in registers; 0: at each "
                    "tile's start (fewer registers); 1,0 tries both; auto: the launcher's default")
    ap.add_argument("--bits", default="2,4")
    ap.add_argument("--layouts", default="token/token", help="K/V layouts, e.g. token/token,token/channel "
                    "(channel-wise sides in groups of 128 tokens)")
    ap.add_argument("--heads", default="32/8", help="query heads / KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--group", type=int, default=128, help="group size of both sides")
    ap.add_argument("--sides", default=None, help="K and V encodings as foldc parses them, e.g. "
                    "'channel:8:16/token:4:64' (in place of --bits, --layouts and --group)")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds after which no new shape starts")
    args = ap.parse_args()
    num_q, num_kv = map(int, args.heads.split("/"))
    shapes = [(1, 4096), (1, 16384), (1, 131072), (8, 4096), (8, 65536), (32, 16384), (64, 32768)]
    if args.shapes:
        shapes = [tuple(int(x) for x in sh.split("x")) for sh in args.shapes.split(",")]

    def values(text, cast):
        return [None if x in ("none", "auto") else cast(x) for x in text.split(",")]
    options = [dict(block_n=bn, stages=st, maxnreg=mr, split_factor=sf, pack_heads=ph,
                    scale_ahead=None if sa is None else bool(sa))
               for ph, bn, st, mr, sf, sa in itertools.product(
                   values(args.pack, int), values(args.block_n, int), values(args.stages, int),
                   values(args.maxnreg, int), values(args.split_factor, float), values(args.scale_ahead, int))]
    if args.quick:
        shapes, options = shapes[1:3] + shapes[4:5], options[:4]
    rows = []
    t0 = time.time()
    ceiling = stream_read_ceiling()   # of this card, this run (a fixed 4.4 TB/s, the H200's, was taken on every card)
    print(f"streaming-read ceiling {ceiling / 1e12:.2f} TB/s", flush=True)
    if args.sides:
        k_text, v_text = args.sides.split("/")
        cases = [(0, args.sides, foldc.AttentionSpec(num_q, num_kv, args.head_dim, parse_affine(k_text),
                                                     parse_affine(v_text)))]
    else:
        cases = [(bits, layouts, foldc.AttentionSpec(num_q, num_kv, args.head_dim,
                                                     foldc.Affine(bits, layouts.split("/")[0], args.group),
                                                     foldc.Affine(bits, layouts.split("/")[1], args.group)))
                 for bits, layouts in itertools.product(values(args.bits, int), args.layouts.split(","))]
    for bits, layouts, spec in cases:
        for b, n in shapes:
            if time.time() - t0 > args.deadline:
                print(f"int{bits} {b}x{n}: not run, deadline of {args.deadline:g} s reached", flush=True)
                continue
            q, k, v = decode_case(spec, b, n, seed=b * n + bits)
            ref = foldc.attention_reference(q, k, v) if b * n <= 600_000 else None
            nbytes = sum(t.numel() * t.element_size() for x in (k, v) for t in (x.codes, x.scale, x.zero)) + \
                2 * q.numel() * 2
            for opt in options:
                row = {"bits": bits, "layouts": layouts, "heads": args.heads, "head_dim": args.head_dim,
                       "group": None if args.sides else args.group, "batch": b, "tokens": n, **opt}
                try:
                    attn = foldc.compile(spec, "sm_90", kernel="gluon", **{k: v for k, v in opt.items()
                                                                             if v is not None})
                    row["pack_heads"] = attn.heads
                    out = attn(q, k, v)
                    if ref is not None:
                        row["error"] = rel_l2(out, ref)
                    row["eager_us"], row["graph_us"] = timed(lambda attn=attn, q=q, k=k, v=v: attn(q, k, v))
                    best = min(t for t in (row["eager_us"], row["graph_us"]) if t is not None)
                    row["pct_ceiling"] = 100 * nbytes / (best * 1e-6) / ceiling
                except Exception as e:  # keep sweeping; the row records the failure
                    row["fail"] = repr(e)[:300]
                rows.append(row)
            mine = [r for r in rows if r["bits"] == bits and r["layouts"] == layouts]
            best = min((r for r in mine if r["batch"] == b and r["tokens"] == n
                        and "pct_ceiling" in r), key=lambda r: -r["pct_ceiling"], default=None)
            if best:
                fastest = min(t for t in (best['graph_us'], best['eager_us']) if t)
                print(f"int{bits} {layouts} {b}x{n}: best {fastest:.1f} us "
                      f"({best['pct_ceiling']:.0f}%) bn{best['block_n']} st{best['stages']} "
                      f"reg{best['maxnreg']} sf{best['split_factor']} H{best.get('pack_heads')} "
                      f"ahead{best['scale_ahead']} err {best.get('error')}",
                      flush=True)
                for ph in sorted({r.get("pack_heads") for r in rows if "pct_ceiling" in r} - {None}):
                    mine = [r for r in rows if r["bits"] == bits and r["layouts"] == layouts and r["batch"] == b
                            and r["tokens"] == n and r.get("pack_heads") == ph and "pct_ceiling" in r]
                    if mine:
                        top = max(mine, key=lambda r: r["pct_ceiling"])
                        print(f"    H{ph}: {top['pct_ceiling']:.0f}% bn{top['block_n']} st{top['stages']} "
                              f"reg{top['maxnreg']} sf{top['split_factor']}", flush=True)
                for ahead in (True, False, None):
                    mine = [r for r in rows if r["bits"] == bits and r["layouts"] == layouts and r["batch"] == b
                            and r["tokens"] == n and r["scale_ahead"] == ahead and "pct_ceiling" in r]
                    if mine:
                        top = max(mine, key=lambda r: r["pct_ceiling"])
                        print(f"    scale_ahead={ahead}: {top['pct_ceiling']:.0f}% bn{top['block_n']} "
                              f"st{top['stages']} reg{top['maxnreg']} sf{top['split_factor']} H{top['pack_heads']}",
                              flush=True)
            del q, k, v
            save_rows(rows, args.out)   # after every shape: a cut-off run keeps what it measured
    fails = [r for r in rows if "fail" in r]
    errs = [r["error"] for r in rows if "error" in r]
    print(f"{len(rows)} runs, {len(fails)} failed, error range {min(errs, default=0):.2e}..{max(errs, default=0):.2e}, "
          f"{time.time() - t0:.0f} s")
    for r in fails[:5]:
        print("FAIL", r)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
