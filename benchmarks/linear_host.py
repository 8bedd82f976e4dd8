"""Host time of one eager FoldLinear call at decode (m = 1, bf16), piece by piece, beside nn.Linear
(H200; evidence for the eager path of issues 19 and 20, not a test). Each figure is the median host
µs of one call made on an idle GPU (``foldc.timing.host_us``); then a cProfile of 2000 calls of the custom op (the
path torch.compile traces; eager calls skip it).

    PYTHONPATH=. python3 benchmarks/linear_host.py --out $OUT/linear_host.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

import torch

from foldc.timing import host_us


def main(argv=None) -> int:
    from foldc.encoding import AffineTensor
    from foldc.nn import FoldLinear, _gemm, _weight_encoding

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2048)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    lin = torch.nn.Linear(args.k, args.n, bias=False).cuda().to(torch.bfloat16)
    layer = FoldLinear.from_linear(lin, "k-group:4:128").cuda()
    x = torch.randn(1, args.k, device="cuda", dtype=torch.bfloat16)
    x16 = torch.randn(16, args.k, device="cuda", dtype=torch.bfloat16)
    layer(x)
    torch.cuda.synchronize()
    enc_text = layer._encoding_text
    _, affine = _weight_encoding(enc_text, args.k)
    w = AffineTensor(layer.codes, layer.scale, layer.zero, affine, args.k)
    gemm = _gemm(args.n, args.k, enc_text, "auto")
    gemv = gemm.gemv
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    launch = gemv.plan_launch(torch.bfloat16, 1, sms)
    out = torch.empty(1, args.n, device="cuda", dtype=torch.bfloat16)
    counters = layer.gemv_counters

    @torch.library.custom_op("foldc_bench::identity", mutates_args=())
    def identity(t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    rows_ = gemv.weight_rows(w)

    def unbound(fn):
        """``fn`` with the GEMV's bound launches forgotten before each call (every launch keyed by FastLaunch)."""
        def run():
            gemv._bindings.clear()
            return fn()
        return run

    pieces = {
        "FoldLinear(x), launches not bound": unbound(lambda: layer(x)),
        "GluonGemv.run_rows, launches not bound": unbound(lambda: gemv.run_rows(launch, x, *rows_, out, counters)),
        "nn.Linear bf16": lambda: lin(x),
        "FoldLinear(x)": lambda: layer(x),
        "FoldLinear(x), 16 rows": lambda: layer(x16),
        "nn.Linear bf16, 16 rows": lambda: lin(x16),
        "FoldLinear._eager_gemv(x)": lambda: layer._eager_gemv(x),
        "GluonGemv.run_rows (caller's counters)": lambda: gemv.run_rows(launch, x, *rows_, out, counters),
        "torch.ops.foldc.linear": lambda: torch.ops.foldc.linear(x, layer.codes, layer.scale, layer.zero, None,
                                                                 enc_text, args.n, counters),
        "GemmKernel(x, w, counters)": lambda: gemm(x, w, counters=counters),
        "GluonGemv(x, w, counters)": lambda: gemv(x, w, counters=counters),
        "GluonGemv.check": lambda: gemv.check(x, w),
        "GluonGemv.takes": lambda: gemv.takes(x, w),
        "GluonGemv.run (own buffers)": lambda: gemv.run(launch, x, w, out),
        "GluonGemv.run (caller's counters)": lambda: gemv.run(launch, x, w, out, counters),
        "AffineTensor(...)": lambda: AffineTensor(layer.codes, layer.scale, layer.zero, affine, args.k),
        "a custom op's clone of x": lambda: identity(x),
        "x.clone()": lambda: x.clone(),
        "torch.empty(1, n)": lambda: torch.empty(1, args.n, device="cuda", dtype=torch.bfloat16),
    }
    rows = {name: round(host_us(fn), 2) for name, fn in pieces.items()}
    for name, us in rows.items():
        print(f"{us:8.2f}  {name}", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        torch.ops.foldc.linear(x, layer.codes, layer.scale, layer.zero, None, enc_text, args.n, counters)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    print(text.getvalue())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"n": args.n, "k": args.k, "host_us": rows, "profile": text.getvalue()},
                                         indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
