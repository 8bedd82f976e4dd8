"""One call of the register-operand GEMV, for a profiler (ncu) to look at.

    PYTHONPATH=. ncu --section WarpStateStats --section SchedulerStats --section SpeedOfLight \\
        -k regex:foldc_gemv -c 1 python3 benchmarks/gemv_one.py k-group:4:128 28672 8192 1
"""
from __future__ import annotations

import json
import sys

import torch

import foldc
from foldc.gemm import GemmSpec, parse_gemm_encoding
from foldc.gemm.reference import quantize_2d


def main(argv) -> None:
    enc, n, k, m = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    options = json.loads(argv[4]) if len(argv) > 4 else {}
    spec = GemmSpec(n, k, parse_gemm_encoding(enc, "weight"))
    gen = torch.Generator().manual_seed(0)
    wq = quantize_2d((torch.randn(n, k, generator=gen) * 0.05).cuda(), spec.weight)
    x = torch.randn(m, k, generator=gen).to("cuda", torch.float16)
    kern = foldc.compile(spec, target="auto", kernel="gluon", **options)
    kern(x, wq)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
