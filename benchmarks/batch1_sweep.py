"""Where batch-1 decode time goes: the register-operand kernel at batch 1 over split counts, tile
sizes, packed heads and the merge launched as a programmatic dependent (PDL), each timed as a
CUDA-graph replay (as `foldc bench` reports it), with the GPU time of each kernel (torch.profiler,
L2 flushed before each call) and the error of the replayed output against float64 attention
(H200; evidence for docs/perf.md, not a test).

    PYTHONPATH=. python3 benchmarks/batch1_sweep.py --out results/batch1.json
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch

import foldc
from foldc.bench import decode_case, save_rows
from foldc.testing import rel_l2
from foldc.timing import capture_graph


def kernel_times(fn, reps: int) -> dict:
    """GPU µs of each kernel one call of ``fn`` launches, with L2 flushed before every call."""
    flush = torch.empty(64 << 20, dtype=torch.int32, device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "foldc" in e.name:
            per[e.name] += e.device_time / reps
    return dict(per)


def main() -> int:
    from triton.testing import do_bench

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="1x16384,1x4096")
    ap.add_argument("--bits", default="2,4")
    ap.add_argument("--pack", default="1,2")
    ap.add_argument("--block-n", default="32,64")
    ap.add_argument("--splits", default="auto,32,64,128,256,512")
    ap.add_argument("--pdl", default="0,1")
    ap.add_argument("--scale-ahead", default="default", help="comma-separated 1, 0 or default (the launcher's)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for bits in (int(b) for b in args.bits.split(",")):
        enc = foldc.Affine(bits, "token", 128)
        spec = foldc.AttentionSpec(32, 8, 128, enc, enc)
        for item in args.shapes.split(","):
            b, n = (int(x) for x in item.split("x"))
            q, k, v = decode_case(spec, b, n, seed=b + n + bits)
            ref = foldc.attention_reference(q, k, v)
            for pack in (int(p) for p in args.pack.split(",")):
                for bn in (int(x) for x in args.block_n.split(",")):
                    for sp, ahead in ((sp, a) for sp in args.splits.split(",") for a in args.scale_ahead.split(",")):
                        splits = None if sp == "auto" else int(sp)
                        if splits is not None and splits * bn > n:
                            continue
                        attn = foldc.compile(spec, "sm_90", kernel="gluon", pack_heads=pack, block_n=bn,
                                             stages=2, splits=splits, split_factor=1.0, maxnreg=None,
                                             scale_ahead=None if ahead == "default" else ahead == "1")
                        for pdl in (int(x) for x in args.pdl.split(",")):
                            attn.pdl = bool(pdl)
                            out = torch.full_like(q, float("nan"))
                            try:
                                attn(q, k, v, out=out)
                                graph = capture_graph(lambda: attn(q, k, v, out=out))
                                out.fill_(float("nan"))
                                us = do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e3
                                torch.cuda.synchronize()
                                err = rel_l2(out, ref)
                                parts = kernel_times(lambda: attn(q, k, v, out=out), args.reps) if not pdl else {}
                            except Exception as e:   # report and go on
                                us, err, parts = None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}", {}
                            cfg = attn.launch_config(q.dtype, b, n)
                            used, _ = attn.split_plan(cfg, b, n, q.device, q.dtype, False)
                            row = dict(bits=bits, shape=item, pack=pack, block_n=bn, splits=used, asked=sp, pdl=pdl,
                                       scale_ahead=ahead,
                                       us=us, error=err, kernels=parts)
                            rows.append(row)
                            ks = ", ".join(f"{name.split('_')[-1]} {t:.1f}" for name, t in parts.items())
                            print(f"INT{bits} {item} pack {pack} bn {bn} splits {used:>4} ({sp}) pdl {pdl} ahead {ahead}: "
                                  f"{us if us is None else round(us, 1)} us  error {err}  [{ks}]", flush=True)
                            save_rows(rows, args.out)
            del q, k, v
    return 0


if __name__ == "__main__":
    sys.exit(main())
