"""Host time of one layer's decode step with a foldc cache, piece by piece, beside what transformers'
DynamicCache does for the same step (torch.cat of the new key and value, then SDPA): evidence for
docs/perf.md's host-time section (H200), not a test.

    PYTHONPATH=. python3 benchmarks/cache_step_host.py --out $OUT/cache_step.json

Each figure is the median host µs of one call on an idle GPU (`foldc.timing.host_us`: synchronised before
each call, so a call that waits for the GPU is charged its wait), and "back to back" the µs per step of
steps called with no sync between (what an eager model sees, the GPU's time included where it is longer).
Shapes: one sequence, 16 query / 4 KV heads of 128 channels (a ~1B Llama), a cache of --tokens tokens
(--sink and --window plain ones among them).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv", default="token:4:128")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--sink", type=int, default=0)
    ap.add_argument("--window", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import foldc
    from foldc.encoding import parse_affine
    from foldc.serving.append import append_quantized
    from foldc.serving.cache import QuantizedKVCache, check_new_tokens
    from foldc.timing import back_to_back_us, host_us

    enc = parse_affine(args.kv)
    spec = foldc.AttentionSpec(16, 4, 128, enc, enc)
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    calls = 1200   # appends per measurement round; the cache is reset before it fills
    cache = QuantizedKVCache(spec, 1, args.tokens + 4 * calls, sink=args.sink, window=args.window, device=dev,
                             dtype=dt)
    prefix = torch.randn(1, 4, args.tokens, 128, device=dev, dtype=dt, generator=gen)
    # the new key as the rotary embedding makes it, the value a view of a transpose (as in transformers)
    k1 = torch.randn(1, 4, 1, 128, device=dev, dtype=dt, generator=gen)
    v1 = torch.randn(1, 1, 4, 128, device=dev, dtype=dt, generator=gen).transpose(1, 2)
    q = torch.randn(1, 16, 128, device=dev, dtype=dt, generator=gen)

    def refill():
        cache.reset()
        cache.append(prefix, prefix)

    refill()
    rows = {}

    def timed(name, fn, n=200):
        if cache.num_tokens + 3 * n > cache.capacity:
            refill()
        rows[name] = host_us(fn, n)

    timed("append (k, v of one token)", lambda: cache.append(k1, v1))
    timed("  check_new_tokens x 2", lambda: (check_new_tokens("k_new", k1, 1, spec, dt, cache.device),
                                             check_new_tokens("v_new", v1, 1, spec, dt, cache.device)))
    timed("  the body write of k and v (one bound launch)", lambda: cache._write_bodies(k1, v1))
    timed("  one operand's body write (bound launch)", lambda: cache._write_body("k", k1))
    # what a step no longer does: copy a device flag to host memory (the kernel writes it there), check both
    # operands for NaN/Inf with a sync (the kernel flags them)
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    timed("  (not made) a flag's copy to host memory (non_blocking)",
          lambda: cache._flag_host.copy_(flag, non_blocking=True))
    timed("  (not made) peaks: stack(_foreach_norm(k, v))", lambda: torch.stack(torch._foreach_norm([k1, v1], math.inf)))
    timed("  (not made) peaks + tolist (the sync)", lambda: torch.stack(torch._foreach_norm([k1, v1], math.inf)).tolist())
    body = cache._body["k"]
    timed("  append_quantized, check=False", lambda: append_quantized(body, k1, cache.body_tokens, check=False))
    timed("attention", lambda: cache.attention(q))
    timed("append + attention", lambda: (cache.append(k1, v1), cache.attention(q)))

    # transformers' DynamicCache step for one layer: cat the new token onto the keys and values, then SDPA
    keys = torch.randn(1, 4, args.tokens, 128, device=dev, dtype=dt, generator=gen)
    vals = keys.clone()
    qq = q[:, :, None]

    def default_step():
        k = torch.cat([keys, k1], dim=2)
        v = torch.cat([vals, v1], dim=2)
        return torch.nn.functional.scaled_dot_product_attention(qq, k, v, enable_gqa=True)

    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        rows["default: cat x 2 + SDPA"] = host_us(default_step)
        rows["default back to back"] = back_to_back_us(default_step)
    refill()
    rows["foldc append + attention back to back"] = back_to_back_us(lambda: (cache.append(k1, v1), cache.attention(q)),
                                                                    calls=min(300, (cache.capacity - cache.num_tokens) // 4))
    for name, us in rows.items():
        print(f"{name:45} {us:8.1f} µs")
    Path(args.out).write_text(json.dumps(dict(kv=args.kv, tokens=args.tokens, sink=args.sink, window=args.window,
                                              device=torch.cuda.get_device_name(), host_us=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
