"""Channel-wise K's query operand by fp16 products and its zero term by MMA (main's tile_groups.key_group16)
beside the float32 path before it (benchmarks/variants/kernel_kgroup_f32.py, kernel.py as of d2cdf97): error
against float64 attention for layouts with channel-wise keys (fp16 scales take key_group16; bf16 scales and
head_dim 256 the float32 path in both), both query dtypes, ragged lengths, and keys and queries far from unit
size. Evidence for docs/perf.md, not a test.

    PYTHONPATH=. python3 benchmarks/variants/check_kgroup.py [--out check.json]
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch

import foldc
from foldc.reference import attention_reference
from foldc.spec import spec_from_args
from foldc.testing import bf16_attention, rel_l2

sys.path.insert(0, "benchmarks")
from ab_kernel import load_variant  # noqa: E402

LAYOUTS = [("channel:2:32", "token:2:32", "32/8", 128), ("channel:2:128", "token:2:128", "32/8", 128),
           ("channel:2:16", "token:2:128", "32/8", 128), ("channel:4:64", "channel:4:64", "32/8", 128),
           ("channel:8:32", "token:8:32", "32/8", 128), ("channel:2:32", "channel:2:32", "8/8", 128),
           ("channel:4:128", "token:2:128", "40/8", 128), ("channel:2:64", "token:2:32", "32/8", 64),
           ("channel:4:64", "token:4:64", "64/2", 128), ("channel:2:32", "token:2:32", "32/8", 96),
           ("channel:4:128", "token:4:128", "16/4", 256), ("channel:2:32:bf16", "token:2:32", "32/8", 128)]
SIZES = [(1.0, 1.0), (1e-4, 1.0), (300.0, 1.0), (1.0, 30.0)]   # (keys x, queries x)


def case(attn, spec, dtype, k_mult, q_mult, seed):
    gen = torch.Generator().manual_seed(seed)
    b, n = 3, 2500
    q = (torch.randn(b, spec.num_q_heads, spec.head_dim, generator=gen) * q_mult).to("cuda", dtype)
    keys = torch.randn(b, spec.num_kv_heads, n, spec.head_dim, generator=gen) * k_mult
    # channels of very different sizes, as real keys have
    keys = keys * torch.exp2(torch.randint(-6, 4, (1, spec.num_kv_heads, 1, spec.head_dim), generator=gen).float())
    values = torch.randn(b, spec.num_kv_heads, n, spec.head_dim, generator=gen) + 0.5
    kq, vq = foldc.quantize(keys.cuda(), spec.k), foldc.quantize(values.cuda(), spec.v)
    lens = torch.tensor([n, 1, 1301], device="cuda")
    sm_scale = 1.0 / (k_mult * q_mult * math.sqrt(spec.head_dim))
    out = torch.full((b, spec.num_q_heads, spec.head_dim), float("nan"), device="cuda", dtype=dtype)
    got = attn(q, kq, vq, sm_scale=sm_scale, seq_lens=lens, out=out)
    ref = attention_reference(q, kq, vq, sm_scale=sm_scale, seq_lens=lens)
    return rel_l2(got, ref), rel_l2(bf16_attention(q, kq, vq, sm_scale, lens), ref), int(torch.isnan(out).sum())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="benchmarks/variants/kernel_kgroup_f32.py")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    module = load_variant("f32", args.variant)
    rows, worst = [], 0.0
    for i, (k, v, heads, d) in enumerate(LAYOUTS):
        spec = spec_from_args(k, v, heads, d)
        main_attn = foldc.compile(spec, "sm_90", kernel="gluon", splits=5)
        var_attn = main_attn.with_decode_kernel(module.foldc_decode_gluon)
        for dtype in (torch.bfloat16, torch.float16):
            for k_mult, q_mult in SIZES:
                seed = 1000 * i + int(math.log10(k_mult) + 10) * 10 + int(q_mult) % 7 + (dtype == torch.float16)
                row = dict(k=k, v=v, heads=heads, head_dim=d, dtype=str(dtype)[6:], keys_x=k_mult, queries_x=q_mult)
                for name, attn in (("main", main_attn), ("f32", var_attn)):
                    try:
                        err, base, nan = case(attn, spec, dtype, k_mult, q_mult, seed)
                        row[name] = dict(error=err, bf16_error=base, ratio=err / base, unwritten=nan)
                    except Exception as e:   # reported, the rest go on
                        row[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                rows.append(row)
                va, m = row["main"], row["f32"]
                fmt = lambda r: r if isinstance(r, str) else f"{r['error']:.2e} ({r['ratio']:.2f}x bf16, nan {r['unwritten']})"
                print(f"{k:<18} {v:<12} {heads:<5} d{d:<4} {row['dtype']:<9} k x{k_mult:<7g} q x{q_mult:<5g} "
                      f"main {fmt(va)}  f32 {fmt(m)}", flush=True)
                if not isinstance(va, str):
                    worst = max(worst, va["ratio"] if va["unwritten"] == 0 else math.inf)
                else:
                    worst = math.inf
    print(f"worst main error / bf16's: {worst:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
