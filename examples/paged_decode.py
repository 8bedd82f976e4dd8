"""Paged decode with foldc: a FlashInfer-style page table, quantize-on-append into pages, plan/run.

    .venv/bin/python examples/paged_decode.py            # CPU: Triton's interpreter, float16
    python3 examples/paged_decode.py --steps 64          # GPU: the generated kernel, bfloat16

Three sequences of different lengths share one page pool per layer (shuffled pages). Each has a
prompt, then decode steps of one token: append (quantized into the pages once the bf16 recent
window overflows) and attention (the paged kernel over the quantized body, merged with the bf16
sink + window by log-sum-exp). Every few steps the output is compared with float64 attention over
exactly what the cache holds (its dequantized contents), which is what the kernel must reproduce.
On a GPU the decode step (all layers) is captured once in a CUDA graph and replayed.
"""
from __future__ import annotations

import argparse

import torch

import foldc
from foldc.serving import PagedKVCache
from foldc.spec import spec_from_args
from foldc.testing import rel_l2


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24, help="decode steps")
    ap.add_argument("--k", default="token:4:32", help="key encoding")
    ap.add_argument("--v", default="channel:2:32", help="value encoding")
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float16)
    spec = spec_from_args(args.k, args.v, "8/2", 64)
    layers, page_size, num_pages, batch = 2, 32, 48, 3
    cache = PagedKVCache(spec, num_layers=layers, page_size=page_size, num_pages=num_pages, max_seq_len=512,
                         sink=4, window=16, device=device, dtype=dtype)
    # the page table: sequence b owns pages kv_indices[kv_indptr[b]:kv_indptr[b + 1]] (here 8 each, shuffled)
    gen = torch.Generator().manual_seed(0)
    kv_indptr = torch.tensor([0, 8, 16, 24], dtype=torch.int32)
    kv_indices = torch.randperm(num_pages, generator=gen)[:24].to(torch.int32)
    cache.plan(kv_indptr, kv_indices, seq_lens=[0, 0, 0])
    print(f"{spec.describe()}; {layers} layers, pages of {page_size} tokens, {device} {dtype}")

    def tokens(n):
        k = torch.randn(batch, spec.num_kv_heads, n, spec.head_dim, generator=gen)
        return k.to(device, dtype), (torch.randn(k.shape, generator=gen) + 0.5).to(device, dtype)

    prompt = [tokens(70) for _ in range(layers)]  # prefill: planned on the host
    for layer, (k, v) in enumerate(prompt):
        cache.append(layer, k, v)
    static = [tokens(1) for _ in range(layers)]
    q = torch.randn(batch, spec.num_q_heads, spec.head_dim, generator=gen).to(device, dtype)
    outs = [torch.empty_like(q) for _ in range(layers)]

    def step():  # device work only: capturable
        for layer, (k, v) in enumerate(static):
            cache.append(layer, k, v)
            outs[layer].copy_(cache.attention(layer, q))

    step()
    graph = None
    if gpu:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    for i in range(args.steps):
        for k, v in static:
            k.copy_(torch.randn(k.shape, generator=gen))
            v.copy_(torch.randn(v.shape, generator=gen) + 0.5)
        if graph is not None:
            cache.before_replay()  # host bookkeeping (capacity checks, counts) of one replayed step
            graph.replay()
        else:
            step()
        if i % 8 == 7 or i == args.steps - 1:
            keys, values, lens = cache.dequantized(layers - 1)
            ref = foldc.attention_reference(q, keys, values)
            body = cache.body_len(lens[0])
            print(f"step {i + 1:3d}: {lens[0]} tokens per sequence ({body} quantized in pages, "
                  f"{lens[0] - body} bf16/fp16 sink + window); rel. L2 vs float64 over the cache: "
                  f"{rel_l2(outs[-1], ref):.2e}")


if __name__ == "__main__":
    main()
