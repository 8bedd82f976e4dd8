"""Each GPU kernel's error against plain attention in the query's dtype (docs/derivation.md, eq. 6a).

On the H200 (device tool), from the repository root:

    PYTHONPATH=. python3 benchmarks/precision_check.py --out $OUT/precision_check.json

For fp16 and bf16 queries, several layouts and two kinds of data (ordinary, and values whose
group zero is large against the values themselves: the case where one rounding of a pre-scaled
operand cancels against the zero correction), it runs the register-operand kernel and the
generated Triton kernel, and reports each one's relative L2 error against float64 attention over
the dequantized cache divided by the error of `foldc.testing.plain_attention` (plain attention in
the query's dtype over the same values) and by plain bf16 attention's. The model's bar is 2 against
the plan's bar dtype: the query's for the Triton kernel, bf16 for the register-operand kernel
(foldc.backends.gluon.lower.BAR_DTYPE). ``--time`` also times the default kernel per query dtype
(CUDA graphs, L2 flushed): the register-operand kernel for both.
"""
from __future__ import annotations

import argparse
import json
import math

import torch

import foldc
from foldc.reference import attention_reference
from foldc.testing import plain_attention, rel_l2

A = foldc.Affine
LAYOUTS = {
    "K token:2:128 / V token:2:128": (A(2, "token", 128), A(2, "token", 128)),
    "K token:4:128 / V token:4:128": (A(4, "token", 128), A(4, "token", 128)),
    "K token:2:128 / V channel:2:128": (A(2, "token", 128), A(2, "channel", 128)),
    "K channel:2:128 / V token:2:128": (A(2, "channel", 128), A(2, "token", 128)),
    "K token:2:64 / V token:2:64": (A(2, "token", 64), A(2, "token", 64)),
}
DATA = {"ordinary": dict(spread=1.0, offset=0.5, outliers=0, size=0.0),
        "large zero": dict(spread=0.1, offset=0.0, outliers=1, size=-30.0)}


def inputs(spec, batch, tokens, dtype, gen, spread, offset, outliers, size):
    q = torch.randn(batch, spec.num_q_heads, spec.head_dim, generator=gen)
    k = torch.randn(batch, spec.num_kv_heads, tokens, spec.head_dim, generator=gen)
    k[..., torch.randint(0, spec.head_dim, (3,), generator=gen)] *= 6.0
    v = torch.randn(batch, spec.num_kv_heads, tokens, spec.head_dim, generator=gen) * spread + offset
    if outliers:
        channel = spec.v.layout == "channel"
        shape = (batch, spec.num_kv_heads, outliers, spec.head_dim) if channel else \
            (batch, spec.num_kv_heads, tokens, outliers)
        idx = torch.randint(0, tokens if channel else spec.head_dim, shape, generator=gen)
        v.scatter_(-2 if channel else -1, idx, size * torch.rand(shape, generator=gen))
    lens = torch.randint(tokens // 2, tokens + 1, (batch,), generator=gen)
    lens[0] = tokens
    dev = "cuda"
    return (q.to(dev, dtype), foldc.quantize(k.to(dev), spec.k), foldc.quantize(v.to(dev), spec.v), lens.to(dev))


def time_graph(fn) -> float:
    """ms per call of ``fn`` replayed in a CUDA graph, L2 flushed between calls (triton's do_bench)."""
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=50, rep=300)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--time", default="", help="shapes to time, e.g. 8x65536,32x16384")
    args = ap.parse_args()
    rows, times = [], []
    for shape in filter(None, args.time.split(",")):
        batch, tokens = map(int, shape.split("x"))
        for name, (ek, ev) in LAYOUTS.items():
            spec = foldc.AttentionSpec(32, 8, 128, k=ek, v=ev)
            attn = foldc.compile(spec, target="auto")   # the register-operand kernel, both query dtypes
            gen = torch.Generator().manual_seed(0)
            k = foldc.quantize(torch.randn(batch, 8, tokens, 128, generator=gen).cuda(), ek)
            v = foldc.quantize(torch.randn(batch, 8, tokens, 128, generator=gen).cuda(), ev)
            for dtype in (torch.bfloat16, torch.float16):
                q = torch.randn(batch, 32, 128, generator=gen).to("cuda", dtype)
                out = torch.empty_like(q)
                us = time_graph(lambda: attn(q, k, v, out=out)) * 1e3
                times.append(dict(layout=name, shape=shape, dtype=str(dtype).replace("torch.", ""), us=us))
                print(f"time {shape:10s} {name:34s} {times[-1]['dtype']:8s} {us:8.1f} us", flush=True)
    for name, (ek, ev) in LAYOUTS.items():
        spec = foldc.AttentionSpec(32, 8, 128, k=ek, v=ev)
        kernels = {}
        for kernel in ("gluon", "triton"):
            try:
                kernels[kernel] = foldc.compile(spec, target="auto", kernel=kernel)
            except foldc.FoldError as e:
                print(f"{name}: {kernel} refused: {e}")
        for data, kw in DATA.items():
            for dtype in (torch.float16, torch.bfloat16):
                worst = {}
                for seed in range(args.seeds):
                    gen = torch.Generator().manual_seed(seed)
                    q, k, v, lens = inputs(spec, 2, args.tokens, dtype, gen, **kw)
                    scale = 1 / math.sqrt(128)
                    ref = attention_reference(q, k, v, sm_scale=scale, seq_lens=lens)
                    plain = rel_l2(plain_attention(q, k, v, scale, lens), ref)
                    plain_bf16 = rel_l2(plain_attention(q, k, v, scale, lens, torch.bfloat16), ref)
                    for kernel, attn in kernels.items():
                        err = rel_l2(attn(q, k, v, sm_scale=scale, seq_lens=lens), ref)
                        worst[kernel] = max(worst.get(kernel, 0.0), err / plain)
                        worst[kernel + "/bf16"] = max(worst.get(kernel + "/bf16", 0.0), err / plain_bf16)
                row = dict(layout=name, data=data, dtype=str(dtype).replace("torch.", ""), **worst)
                rows.append(row)
                print(f"{name:34s} {data:10s} {row['dtype']:8s} " +
                      "  ".join(f"{k} {v:5.2f}x" for k, v in worst.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), tokens=args.tokens, seeds=args.seeds,
                           rows=rows, times=times), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
