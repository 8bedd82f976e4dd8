"""Sweep the register-operand kernel's KV heads per program and tile size over query-heads-per-KV-head
ratios (INT2 token-wise g128, head_dim 128, 8 x 64K, CUDA graph, L2 flushed by do_bench):

    PYTHONPATH=. python3 benchmarks/gqa_sweep.py --out $OUT/gqa_sweep.json
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

import foldc
from foldc.bench import decode_case, stream_read_ceiling
from foldc.timing import graph_us

HEADS = ((8, 8), (32, 8), (40, 8), (64, 8), (64, 4), (64, 2))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8x65536")
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    batch, tokens = map(int, args.shape.split("x"))
    ceiling = stream_read_ceiling()
    rows = []
    for q_heads, kv_heads in HEADS:
        enc = foldc.Affine(args.bits, "token", 128)
        spec = foldc.AttentionSpec(q_heads, kv_heads, 128, enc, enc)
        q, k, v = decode_case(spec, batch, tokens, seed=1)
        read = sum(t.numel() * t.element_size() for x in (k, v) for t in (x.codes, x.scale, x.zero)) + 4 * q.numel()
        for pack, block_n in itertools.product((1, 2, 4, 8), (32, 64)):
            try:
                attn = foldc.compile(spec, "sm_90", kernel="gluon", pack_heads=pack, block_n=block_n)
                us = graph_us(lambda: attn(q, k, v))
            except Exception as e:   # a packing the spec cannot take
                print(f"{q_heads}/{kv_heads} pack {pack} bn {block_n}: {type(e).__name__}: {str(e)[:80]}", flush=True)
                continue
            row = dict(heads=f"{q_heads}/{kv_heads}", pack=pack, block_n=block_n, us=us,
                       pct=100 * read / (us * 1e-6) / ceiling)
            print(json.dumps(row), flush=True)
            rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(ceiling=ceiling, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
