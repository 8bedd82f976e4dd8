"""Host time of transformers' decode step with foldc's cache beside its DynamicCache, per layer and per
forward: evidence for docs/perf.md's eager transformers section (H200), not a test.

    PYTHONPATH=. python3 benchmarks/hf_layer_step.py --out $OUT/hf_layer_step.json [--kv token:2:128]

A model shaped as examples/hf_decode.py's 1B one (hidden 2048, 16 query / 4 KV heads of 128; --layers
of them, random weights), a prompt of --tokens tokens in each cache, then:

- "layer": what one attention layer does with its cache in a decode step, the cache's ``update`` with the
  new key and value and then the attention function transformers calls with what it returned
  (`foldc.integrations.hf.foldc_attention`; `sdpa_attention_forward` with flash SDPA for the default);
- "forward": one decode forward of the whole model (a token in, logits out).

Each as the median host µs of one call on an idle GPU (`foldc.timing.host_us`) and as µs per call of calls
back to back (`foldc.timing.back_to_back_us`, what generate sees). Both caches are timed in one process
(hosts differ by up to 2x between runs: compare within a run).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv", default="token:4:128")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of each cache's calls")
    ap.add_argument("--profile", type=int, default=0, help="also cProfile this many decode forwards of each cache")
    ap.add_argument("--out", required=True)
    from hf_step_profile import parse_on_gpu   # (benchmarks/: the script's own folder)

    args, example = parse_on_gpu(ap)
    if args is None:
        return 2
    import foldc.integrations.hf as fhf
    from foldc.timing import back_to_back_us, host_us
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import DynamicCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    spare = 4096   # tokens each cache takes during the timing
    model = example.build_model("cuda", torch.bfloat16, layers=args.layers, hidden=2048, heads="16/4", head_dim=128,
                                vocab=32000, positions=args.tokens + spare)
    gen = torch.Generator(device="cuda").manual_seed(0)
    prompt = torch.randint(3, 32000, (1, args.tokens), device="cuda", generator=gen)
    token = torch.randint(3, 32000, (1, 1), device="cuda", generator=gen)
    attn = model.model.layers[0].self_attn
    scaling = attn.scaling
    # a decode step's query, key and value as the attention module makes them: the query and the value views of
    # a transpose, the key the rotary embedding's new tensor
    q4 = torch.randn(1, 1, 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
    k1 = torch.randn(1, 4, 1, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v1 = torch.randn(1, 1, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
    rows, profiles = {}, {}
    flash = sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
    flash.__enter__()
    caches, steps = {}, {}
    with torch.no_grad():
        for name, impl in (("default", "sdpa"), ("foldc", fhf.ATTN_IMPLEMENTATION)):
            model.set_attn_implementation(impl)
            if name == "default":
                cache = DynamicCache(config=model.config)
                attention = sdpa_attention_forward
            else:
                cache = fhf.FoldcCache(model.config, max_cache_len=args.tokens + spare, k=args.kv, v=args.kv)
                attention = fhf.foldc_attention
            model(prompt, past_key_values=cache, use_cache=True)
            caches[name] = cache

            def layer(cache=cache, attention=attention):
                k, v = cache.update(k1, v1, 0)
                return attention(attn, q4, k, v, None, scaling=scaling)

            def forward(cache=cache):
                return model(token, past_key_values=cache, use_cache=True).logits

            steps[name] = {"forward": forward, "layer": layer}
            forward()
            layer()
        # the two caches' calls alternate, round by round (the host's speed drifts within a run); whole forwards
        # first: the layer timing grows layer 0's cache alone
        for what, calls in (("forward", 40), ("layer", 100)):
            for kind in ("one call", "back to back"):
                took = {"default": [], "foldc": []}
                for _ in range(args.rounds):
                    for name, impl in (("default", "sdpa"), ("foldc", fhf.ATTN_IMPLEMENTATION)):
                        model.set_attn_implementation(impl)
                        fn = steps[name][what]
                        took[name].append(host_us(fn, calls) if kind == "one call" else
                                          back_to_back_us(fn, calls=calls, warmup=2, repeats=1))
                for name in took:
                    rows[f"{name}: {what}, {kind}"] = statistics.median(took[name])
            if args.profile:
                for name, impl in (("default", "sdpa"), ("foldc", fhf.ATTN_IMPLEMENTATION)):
                    model.set_attn_implementation(impl)
                    profiles[f"{name}, {what}"] = profile(steps[name][what], args.profile)
    flash.__exit__(None, None, None)
    for key in ("layer, one call", "layer, back to back", "forward, one call", "forward, back to back"):
        d, f = rows[f"default: {key}"], rows[f"foldc: {key}"]
        print(f"{key:24} default {d:8.1f} µs  foldc {f:8.1f} µs  default/foldc {d / f:5.2f}x")
    Path(args.out).write_text(json.dumps(dict(kv=args.kv, tokens=args.tokens, layers=args.layers, rounds=args.rounds,
                                              device=torch.cuda.get_device_name(), host_us=rows), indent=1))
    if profiles:
        Path(args.out).with_suffix(".profile.txt").write_text("\n".join(f"==== {k}\n{v}" for k, v in profiles.items()))
    return 0


def profile(fn, calls: int) -> str:
    """cProfile of ``calls`` calls of ``fn``: the top functions by own time and by cumulative time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    for order in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(40)
    return text.getvalue()


if __name__ == "__main__":
    sys.exit(main())
