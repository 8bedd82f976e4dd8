"""A/B of the warpgroup template (foldc/backends/gluon/warpgroup.py) against the one-warp program's row
blocks on the same calls: CUDA-graph replay, L2 flushed (do_bench), beside cuDNN bf16 SDPA; each answer
checked against float64 attention over the dequantized cache.

    PYTHONPATH=. python3 benchmarks/warpgroup_ab.py --shapes 8x65536x128x4,32x65536x128x4 --out $OUT/ab.json
"""
from __future__ import annotations

import argparse
import json

import torch

import foldc
from foldc.bench import stream_read_ceiling
from foldc.spec import spec_from_args
from foldc.timing import graph_us


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8x65536x128x4,32x65536x128x4,8x65536x32x1",
                    help="batch x tokens x query heads x KV heads, comma-separated")
    ap.add_argument("--layout", default="token:2:128")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ceiling = stream_read_ceiling()
    rows = []
    for item in args.shapes.split(","):
        batch, tokens, hq, hkv = map(int, item.split("x"))
        spec = spec_from_args(args.layout, args.layout, f"{hq}/{hkv}", 128)
        gen = torch.Generator(device="cuda").manual_seed(7)
        q = torch.randn(batch, hq, 128, device="cuda", generator=gen).to(torch.bfloat16)
        raw = [torch.randn(batch, hkv, tokens, 128, device="cuda", generator=gen) for _ in range(2)]
        k, v = (foldc.quantize(x, spec.k) for x in raw)
        read = sum(t.numel() * t.element_size() for x in (k, v) for t in (x.codes, x.scale, x.zero)) + 4 * q.numel()
        kd, vd = (x.dequantize(torch.float64) for x in (k, v))
        s = torch.einsum("bhrd,bhnd->bhrn", q.double().view(batch, hkv, hq // hkv, 128), kd) * 128 ** -0.5
        ref = torch.einsum("bhrn,bhnd->bhrd", torch.softmax(s, -1), vd).reshape(batch, hq, 128)
        del kd, vd, s
        row = dict(batch=batch, tokens=tokens, heads=f"{hq}/{hkv}", layout=args.layout)
        for name in ("warpgroup", "one_warp"):
            attn = foldc.compile(spec, "sm_90", kernel="gluon")
            if name == "one_warp":
                attn.warpgroup = None
            elif attn.warpgroup is None:
                row["warpgroup"] = "not taken"
                continue
            row[f"{name}_err"] = (attn(q, k, v).double() - ref).abs().max().item()
            row[f"{name}_us"] = graph_us(lambda: attn(q, k, v))
            row[f"{name}_pct"] = 100 * read / (row[f"{name}_us"] * 1e-6) / ceiling
        kb, vb = (x.to(torch.bfloat16) for x in raw)
        q4 = q.unsqueeze(2)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q4, kb, vb, enable_gqa=True)
        row["cudnn_us"] = graph_us(cudnn)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(ceiling=ceiling, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
