"""Where one decode call's time goes: GPU time of each kernel it launches (torch.profiler), for the
register-operand kernel at a few shapes (H200; evidence for docs/perf.md, not a test).

    PYTHONPATH=. python3 benchmarks/kernel_times.py --shapes 1x16384,8x65536
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch

import foldc
from foldc.bench import decode_case


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x4096,1x16384,1x131072,8x65536")
    ap.add_argument("--bits", default="2,4")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    for bits in (int(b) for b in args.bits.split(",")):
        enc = foldc.Affine(bits, "token", 128)
        spec = foldc.AttentionSpec(32, 8, 128, enc, enc)
        attn = foldc.compile(spec, "sm_90", kernel="gluon")
        for item in args.shapes.split(","):
            b, n = (int(x) for x in item.split("x"))
            q, k, v = decode_case(spec, b, n, seed=b + n)
            out = attn(q, k, v)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(args.reps):
                    attn(q, k, v, out=out)
                torch.cuda.synchronize()
            per = defaultdict(float)
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    per[e.name] += e.device_time / args.reps
            parts = ", ".join(f"{name[:28]} {us:.1f} us" for name, us in sorted(per.items(), key=lambda x: -x[1]))
            cfg = attn.launch_config(q.dtype, b, n)
            print(f"INT{bits} {b}x{n} (pack {attn.heads}, block_n {cfg['block_n']}): {parts}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
