"""Time a list of layouts at one shape on the GPU, beside cuDNN bf16 SDPA and (optionally) the
generated Triton kernel: CUDA-graph replay, L2 flushed by do_bench, default options. % of the ceiling: of the
faster of a streaming read and the fastest must-read rate timed in the run, cuDNN's included
(`foldc.bench.run_ceiling`), recomputed for every row at the end.

    PYTHONPATH=. python3 benchmarks/layout_times.py --shape 8x65536 --out $OUT/times.json \
        --layouts "token:2:128,token:2:128,32/8,128;token:4:128,token:2:128,32/8,128"
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import foldc
from foldc.bench import run_ceiling, stream_read_ceiling
from foldc.timing import graph_us
from foldc.spec import spec_from_args


def nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(nbytes(t) for t in (x.codes, x.scale, x.zero))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", required=True, help="K,V,heads,head_dim entries separated by ';'")
    ap.add_argument("--shape", default="8x65536")
    ap.add_argument("--triton", action="store_true", help="also time kernel='triton'")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    batch, tokens = map(int, args.shape.split("x"))
    stream_read = ceiling = stream_read_ceiling()
    print(f"streaming-read ceiling {stream_read / 1e12:.2f} TB/s", flush=True)
    rows = []
    for item in args.layouts.split(";"):
        k_text, v_text, heads, d = item.split(",")
        spec = spec_from_args(k_text, v_text, heads, int(d))
        gen = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(batch, spec.num_q_heads, spec.head_dim, device="cuda", generator=gen).to(torch.bfloat16)
        raw = [torch.randn(batch, spec.num_kv_heads, tokens, spec.head_dim, device="cuda", generator=gen)
               for _ in range(2)]
        k, v = (foldc.quantize(x, e) if e is not None else x.to(torch.bfloat16) for x, e in zip(raw, (spec.k, spec.v)))
        read = nbytes(k) + nbytes(v) + 2 * nbytes(q)
        bf16_read = 2 * raw[0].numel() * 2 + 2 * nbytes(q)
        row = dict(k=k_text, v=v_text, heads=heads, head_dim=int(d), shape=args.shape, bytes=read, bf16_bytes=bf16_read)
        kb, vb = (x.to(torch.bfloat16) for x in raw)
        q4 = q.unsqueeze(2)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q4, kb, vb, enable_gqa=True)
        try:
            row["cudnn_us"] = graph_us(cudnn)
            ceiling = run_ceiling(ceiling, [(bf16_read, row["cudnn_us"])])
        except Exception as e:
            row["cudnn_us"] = None
            row["cudnn_error"] = str(e)[:200]
        del kb, vb
        for kernel in ("auto",) + (("triton",) if args.triton else ()):
            t0 = time.time()
            try:
                attn = foldc.compile(spec, "sm_90", kernel=kernel)
                name = type(getattr(attn, "bf16", attn)).__name__
                attn(q, k, v)
                us = graph_us(lambda: attn(q, k, v))
                row[f"{kernel}_kernel"] = name
                row[f"{kernel}_us"] = us
                ceiling = run_ceiling(ceiling, [(read, us)])
                row[f"{kernel}_pct"] = 100 * read / (us * 1e-6) / ceiling
            except Exception as e:
                row[f"{kernel}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            row[f"{kernel}_build_s"] = time.time() - t0
        if row.get("cudnn_us") and row.get("auto_us"):
            row["x_cudnn"] = row["cudnn_us"] / row["auto_us"]
            row["x_ideal"] = row["x_cudnn"] / (bf16_read / read)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del q, k, v, raw
        torch.cuda.empty_cache()
    for row in rows:   # every row against the run's final ceiling
        for kernel in ("auto", "triton"):
            if row.get(f"{kernel}_us"):
                row[f"{kernel}_pct"] = 100 * row["bytes"] / (row[f"{kernel}_us"] * 1e-6) / ceiling
    print(f"ceiling of the run {ceiling / 1e12:.2f} TB/s (streaming read {stream_read / 1e12:.2f})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(ceiling=ceiling, stream_read=stream_read, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
