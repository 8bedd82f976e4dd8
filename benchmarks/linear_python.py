"""The Python of an eager `FoldLinear` call at decode (m = 1, bf16), with a stand-in GEMV kernel that launches
nothing (CPU, no GPU): the whole eager path (as `forward` runs it on a GPU: checks, reshape, the layer's launch
entry, `GluonGemv.run_rows` with its bound launch, reshape) against the fast path of a call shaped as the last
bound one. Evidence for docs/perf.md, not a test.

    python3 benchmarks/linear_python.py [--out linear_python.json]

A layer of 2048 x 2048 at k-group:4:128, the GEMV's real launch plan for 132 SMs, its kernel a stand-in whose
bound launch returns at once. Each figure the median µs of one call over 3000 calls; "cold": other Python runs
between calls (benchmarks/step_python.py's walk), as a model's other layers do.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2048)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step_python import _Kernel, median_us

    import foldc.nn as fnn
    from foldc.backends.gluon.gemv_launch import GluonGemv
    from foldc.gemm.spec import GemmSpec

    torch.manual_seed(0)
    layer = fnn.FoldLinear.from_linear(torch.nn.Linear(args.k, args.n, bias=False), "k-group:4:128")
    gemv = GluonGemv(GemmSpec(args.n, args.k, weight=layer.encoding), "sm_90")
    gemv._kernel = _Kernel()
    launch = gemv.plan_launch(torch.bfloat16, 1, 132)

    class _Gemm:
        def gemv_for(self, m, dtype, device, w):
            return gemv, launch, (w.codes[0, 0], w.scale[0, 0], w.zero[0, 0])

    fnn._gemm = lambda *a: _Gemm()
    x = torch.randn(1, 1, args.k, dtype=torch.bfloat16)

    def whole(x):
        """`forward`'s eager path on a GPU (its is_cuda test aside)."""
        if not isinstance(x, torch.Tensor) or x.shape[-1] != layer.in_features:
            raise ValueError
        lead = x.shape[:-1]
        x2 = x.reshape(-1, layer.in_features)
        if type(x) is torch.Tensor and not x.requires_grad and not fnn._traced():
            y = layer._eager_gemv(x2)
        return y.reshape(*lead, layer.out_features)

    for _ in range(3):   # keyed, bound: the launch entry and the bound launch made
        whole(x)
    layer._eager_gemv(x.reshape(-1, args.k), x)   # the fast path's entry, as a bound GPU call leaves it
    assert layer._fast is not None
    rows = {"whole eager path": median_us(lambda: whole(x), 3000),
            "fast path (layer(x))": median_us(lambda: layer(x), 3000),
            "whole eager path, cold": median_us(lambda: whole(x), 2000, cold=True),
            "fast path, cold": median_us(lambda: layer(x), 2000, cold=True)}
    for name, us in rows.items():
        print(f"{name:28} {us:6.2f} µs")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(host_python_us=rows, cpu=os.cpu_count(), n=args.n, k=args.k),
                                             indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
