"""Where does the fold kernel's time go? One device call that times launch-config and
single-sided variants of the generated kernel at one large shape and prints registers,
occupancy-relevant numbers and achieved bandwidth.

    PYTHONPATH=. python3 benchmarks/probe_variants.py [--batch 8 --tokens 65536]

Rows:
- INT2 token/token fold across block_n x num_warps x num_stages (registers and spills from
  the compiled kernel), to see whether occupancy or issue limits it;
- one side encoded, the other plain bf16 (K only, V only), to see which product costs more;
- the bf16 kernel, for the machinery's own ceiling.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch
from triton.testing import do_bench

import foldc
from foldc.backends.triton.launch import TritonAttention
from foldc.bench import HEAD_DIM, HEADS, KV_HEADS, must_read, stream_read_ceiling


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=65536)
    args = ap.parse_args(argv)
    b, n = args.batch, args.tokens
    ceiling = stream_read_ceiling()
    q = torch.randn(b, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, KV_HEADS, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, KV_HEADS, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    int2 = foldc.Affine(2, "token", 128)
    kq, vq = foldc.quantize(k, int2), foldc.quantize(v, foldc.Affine(2, "token", 128))
    print(f"{torch.cuda.get_device_name()}, ceiling {ceiling / 1e12:.2f} TB/s, batch {b} x {n} tokens")
    print(f"{'variant':<44} {'us':>8} {'%ceil':>6} {'regs':>5} {'spill':>5}")

    def run(label, spec, kk, vv, **cfg):
        attn = TritonAttention(spec, "sm_90", **cfg)
        try:
            attn(q, kk, vv)
            us = do_bench(lambda: attn(q, kk, vv), warmup=10, rep=60, return_mode="median") * 1e3
        except Exception as e:
            print(f"{label:<44} failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
            return
        kernel = None
        for (_, bn), entry in attn._kernels.items():
            fn = entry[0].foldc_decode
            for dev_cache in fn.device_caches.values():
                for compiled in dev_cache[0].values():
                    kernel = compiled
        regs = getattr(kernel, "n_regs", "?")
        spills = getattr(kernel, "n_spills", "?")
        pct = 100 * must_read(spec.k, spec.v, b, n) / (us * 1e-6) / ceiling
        print(f"{label:<44} {us:>8.1f} {pct:>6.1f} {regs:>5} {spills:>5}", flush=True)

    spec = foldc.AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, k=int2, v=int2)
    for bn, warps, stages in itertools.product((16, 32, 64, 128), (1, 2, 4, 8), (1, 2)):
        if bn == 16 and warps > 4:
            continue
        run(f"INT2 t/t bn={bn} w={warps} s={stages}", spec, kq, vq, block_n=bn, num_warps=warps, num_stages=stages)
    for warps in (2, 4):
        run(f"K INT2 only (V bf16) w={warps}", foldc.AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, k=int2), kq, v,
            block_n=64, num_warps=warps, num_stages=2)
        run(f"V INT2 only (K bf16) w={warps}", foldc.AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, v=int2), k, vq,
            block_n=64, num_warps=warps, num_stages=2)
        run(f"bf16 w={warps}", foldc.AttentionSpec(HEADS, KV_HEADS, HEAD_DIM), k, v, block_n=64, num_warps=warps,
            num_stages=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
