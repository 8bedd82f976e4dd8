"""The Python of a foldc cache's calls inside whole transformers decode forwards, with stand-in kernels that
launch nothing (CPU, no GPU). Evidence for docs/perf.md, not a test.

    python3 benchmarks/hf_forward_python.py [--layers 16] [--out hf_forward_python.json]

A Llama built from a config (examples/hf_decode.py's `build_model`: hidden 64, 16/4 heads of 128, float16 on the
CPU) decodes with `FoldcCache` (K and V token:4:128, no sink or window) whose layers' append and body-attention
kernels stand in (as benchmarks/step_python.py's). `FoldcLayer.update` and the attention function transformers
calls are timed around each decode call, µs per layer, median over steps; the whole forward's time is mostly the
CPU's own matmuls and not comparable with a GPU's. A layer's calls cost 2-4x their time in a tight loop here,
because the model's other layers run between them (docs/perf.md).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(ROOT / "examples"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import hf_decode
    from step_python import _Kernel
    from transformers import AttentionInterface, DynamicCache

    import foldc.integrations.hf as fhf
    from foldc.backends.gluon.launch import GluonAttention
    from foldc.serving import append as append_module
    from foldc.serving.cache import QuantizedKVCache

    class StandIn(GluonAttention):
        def resident(self, *a):   # no GPU to compile on
            return 12

        def _launchers(self):
            return self._stand_ins

    append_module._fast = lambda name, interpret: _Kernel()

    def lazy(self, k, v=None):   # the layer's cache as on a GPU, its kernels standing in
        self.cache = QuantizedKVCache(self.spec, k.shape[0], self.max_cache_len, sink=self.sink, window=self.window,
                                      device=k.device, dtype=k.dtype, target="interpret")
        self.cache._append_mode = "native"
        body = StandIn(self.spec)
        body._stand_ins = (_Kernel(), _Kernel())
        self.cache._body_attention = body
        self.dtype, self.device, self.is_initialized = k.dtype, k.device, True

    fhf.FoldcLayer.lazy_initialization = lazy
    took = {"update": [], "attention": []}
    update = fhf.FoldcLayer.update

    def timed_update(self, key, *rest, **kwargs):
        start = time.perf_counter()
        out = update(self, key, *rest, **kwargs)
        if key.shape[2] == 1:
            took["update"].append(time.perf_counter() - start)
        return out

    attention = fhf.foldc_attention

    def timed_attention(module, query, key, *rest, **kwargs):
        start = time.perf_counter()
        out = attention(module, query, key, *rest, **kwargs)
        if key.shape[2] == 1:
            took["attention"].append(time.perf_counter() - start)
        return out

    fhf.FoldcLayer.update = timed_update
    fhf.register()
    AttentionInterface.register(fhf.ATTN_IMPLEMENTATION, timed_attention)
    model = hf_decode.build_model("cpu", torch.float16, layers=args.layers, hidden=64, heads="16/4", head_dim=128,
                                  vocab=256, positions=4096)
    prompt = 64
    ids = torch.randint(2, 256, (1, prompt + args.steps), generator=torch.Generator().manual_seed(0))
    cache = fhf.FoldcCache(model.config, prompt + args.steps, k="token:4:128", v="token:4:128", sink=0, window=0)
    with hf_decode.attention(model, fhf.ATTN_IMPLEMENTATION), torch.no_grad():
        model(ids[:, :prompt], use_cache=True, past_key_values=cache)
        for t in range(prompt, prompt + args.steps - 2):
            if t == prompt + 20:   # warmed up: launches bound
                took = {"update": [], "attention": []}
            model(ids[:, t:t + 1], use_cache=True, past_key_values=cache)
        rows = {name: statistics.median(values) * 1e6 for name, values in took.items()}
        # Python calls of one whole decode forward, this cache's and DynamicCache's with SDPA (the same model;
        # C functions and torch ops count as one call each): what transformers' side and each cache's add
        # (the timing wrappers out first: their own calls are not the cache's)
        fhf.FoldcLayer.update = update
        AttentionInterface.register(fhf.ATTN_IMPLEMENTATION, attention)
        t = prompt + args.steps - 1
        calls = {"FoldcCache": _calls(lambda: model(ids[:, t:t + 1], use_cache=True, past_key_values=cache))}
    default = DynamicCache(config=model.config)
    with hf_decode.attention(model, "sdpa"), torch.no_grad():
        model(ids[:, :prompt], use_cache=True, past_key_values=default)
        for t in range(prompt, prompt + 20):
            model(ids[:, t:t + 1], use_cache=True, past_key_values=default)
        calls["DynamicCache + sdpa"] = _calls(lambda: model(ids[:, t + 1:t + 2], use_cache=True,
                                                           past_key_values=default))
    for name, us in rows.items():
        print(f"{name:10} {us:6.1f} µs per layer and step")
    for name, n in calls.items():
        print(f"{name:20} {n / args.layers:6.1f} Python calls per layer in a decode forward ({n} in all)")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(us_per_layer=rows, calls_per_forward=calls, layers=args.layers,
                                                  cpu=os.cpu_count()), indent=1))
    return 0


def _calls(fn) -> int:
    """Python and C function calls made while ``fn`` runs (sys.setprofile's call and c_call events)."""
    count = [0]

    def profile(frame, event, arg):
        if event in ("call", "c_call"):
            count[0] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count[0]


if __name__ == "__main__":
    sys.exit(main())
