"""Correctness sweep of the generated Triton kernels against the float64 executor's reference.

On the H200 (device tool), from the repository root:

    PYTHONPATH=. python3 benchmarks/gpu_check.py --out $OUT/gpu_check.json

Every case draws fresh random inputs, poisons the output with NaN, and compares the kernel with
float64 attention over the same dequantized cache; the bar is the error of plain bf16
attention over those dequantized values. On a CPU it runs a small sweep under the interpreter
(fp16 only): ``python benchmarks/gpu_check.py --quick``.
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time

import torch

import foldc
from foldc.testing import run_case

#: a kernel passes when its error is at most this multiple of bf16 attention's error on the same
#: dequantized values: both round once per operand to bf16, so equal errors differ by sampling noise
TOLERANCE = 1.10


def cases(quick: bool, dtypes):
    layouts = ["token", "channel", None]
    out = []
    # every K/V layout pair (plain included) x bits 2/4 each x dtype, at the paper's shape
    for kl, vl in itertools.product(layouts, layouts):
        for kb, vb in itertools.product((2, 4), (2, 4)):
            if (kl is None and kb == 4) or (vl is None and vb == 4):
                continue
            for dt in dtypes:
                k = foldc.Affine(kb, kl, 128) if kl else None
                v = foldc.Affine(vb, vl, 128) if vl else None
                out.append((foldc.AttentionSpec(32, 8, 128, k, v), dt, 4, 4099))
    # group sizes, head dims, GQA ratios, 8-bit, dequant plans
    rng = random.Random(0)
    for d in (64, 128, 256):
        for g in sorted({32, 64, min(128, d), d}):
            for ratio in (1, 2, 4, 8, 16):
                kl, vl = rng.choice(["token", "channel"]), rng.choice(["token", "channel"])
                kb, vb = rng.choice((2, 4, 8)), rng.choice((2, 4, 8))
                spec = foldc.AttentionSpec(4 * ratio, 4, d, foldc.Affine(kb, kl, g), foldc.Affine(vb, vl, g))
                out.append((spec, rng.choice(dtypes), 3, rng.randint(1000, 6000)))
    if quick:
        small = []
        for spec, dt, _, _ in out[:: max(1, len(out) // 12)]:
            k = foldc.Affine(spec.k.bits, spec.k.layout, 32) if spec.k else None
            v = foldc.Affine(spec.v.bits, spec.v.layout, 32) if spec.v else None
            small.append((foldc.AttentionSpec(spec.q_per_kv * 2, 2, 64, k, v), torch.float16, 2, 150))
        return small
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sweep (CPU interpreter)")
    ap.add_argument("--out", default=None, help="write every case as JSON here")
    ap.add_argument("--seed", type=int, default=int(time.time()))
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    dtypes = (torch.bfloat16, torch.float16) if gpu else (torch.float16,)
    target = "auto" if gpu else "interpret"
    rows, worst_ratio, failures = [], 0.0, 0
    print(f"device: {torch.cuda.get_device_name() if gpu else 'cpu (interpreter)'}; seed {args.seed}")
    t0 = time.time()
    for i, (spec, dt, batch, tokens) in enumerate(cases(args.quick or not gpu, dtypes)):
        attn = foldc.compile(spec, target=target, kernel="triton")   # the generated kernel, not auto's pick
        r = run_case(attn, spec, batch, tokens, dt, device, args.seed + i)
        folds = attn.plan_for(dt).folds
        ok = r.unwritten == 0 and r.error <= r.bf16_error * TOLERANCE
        failures += not ok
        worst_ratio = max(worst_ratio, r.ratio)
        rows.append({"spec": spec.describe(), "dtype": str(dt).replace("torch.", ""), "batch": batch,
                     "tokens": tokens, "folds": folds, "error": r.error, "bf16_error": r.bf16_error,
                     "ratio": r.ratio, "unwritten": r.unwritten, "ok": ok})
        print(f"{'ok ' if ok else 'BAD'} {spec.describe():<62} {rows[-1]['dtype']:<8} "
              f"{folds['qk']:>12}/{folds['pv']:<12} err {r.error:.2e} bf16 {r.bf16_error:.2e} "
              f"ratio {r.ratio:.2f}", flush=True)
    print(f"{len(rows)} cases in {time.time() - t0:.0f} s; {failures} failed; worst error / bf16 error = "
          f"{worst_ratio:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if gpu else "cpu", "seed": args.seed,
                       "cases": rows}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
