"""Serving benchmark and checks of the quantized KV cache on a GPU, in one process (< 8 minutes on an H200).

    PYTHONPATH=. python3 -m foldc bench --serving --out $OUT/serving          # H200
    PYTHONPATH=. python3 -m foldc bench --serving --dry-run --out /tmp/serving  # CPU, tiny, interpreter
    PYTHONPATH=. python3 -m foldc bench --serving --out $OUT/serving --parts throughput \
        --prompt 1024 --new-tokens 32 --batches 1      # a shorter throughput table

Parts (each guarded: a failing part is recorded and the next one runs):

a. ``correctness``: the append kernels (contiguous and paged) bit for bit against foldc.quantize; the
   paged decode kernel against float64 attention over the gathered cache (bar: 1.10 x the error of
   bf16 attention over the same dequantized values), paged == contiguous kernel; a PagedKVCache
   decode loop against the contiguous QuantizedKVCache (same bits) and float64 attention.
b. ``paged_kernel``: one layer's decode attention at 4K context, batch 1 and 8, CUDA-graph replay with the L2
   flushed before each replay (median): paged foldc kernel, contiguous foldc kernel, and bf16 SDPA over the same
   (dequantized) tokens (cuDNN, ``enable_gqa`` over the KV heads as `foldc bench` runs it: `sdpa_baseline`).
c. ``throughput``: decode tokens/s of a randomly initialised Llama-style model (hidden 2048, 16 layers,
   32/8 heads, head_dim 128, bf16, no download) with transformers' DynamicCache (bf16), foldc's
   FoldcCache INT4 and INT2 (contiguous), PagedFoldcCache INT4 and INT2 (paged, no host sync per
   decode step), the same model with foldc INT4 k-group:128 linears (`quantize_model`) over bf16,
   INT4 and INT2 paged caches, and transformers' QuantizedCache (quanto / HQQ) when installed;
   batch 1 and 8, prompt 4096, 128 new tokens (greedy, no early stop).
d. ``accuracy``: attention-output relative L2 against exact float64 attention over the unquantized
   K/V, through the GPU path (PagedKVCache: paged kernel + bf16 sink/window merged by log-sum-exp),
   INT2/INT4 x K/V layouts x rotation off/on x windows off/on, Gaussian and outlier data
   (foldc.accuracy); next to the float64-only figure of foldc.accuracy for the same configuration.

Prints one table per part and writes ``serving.json`` (every number) and ``serving.md`` (the tables)
under ``--out``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

import foldc
from foldc.decisions import token_group
from foldc.encoding import AffineTensor, scale_shape
from foldc.serving import (PagedDecodeWrapper, PagedKVCache, QuantizedKVCache, append_paged, append_quantized,
                           gather_pages)
from foldc.testing import bf16_attention, rel_l2

A = foldc.Affine
TOLERANCE = 1.10


class Ctx:
    """Run settings: full size on a GPU, tiny under the interpreter (--dry-run)."""

    def __init__(self, dry: bool):
        self.dry = dry
        self.device = "cpu" if dry else "cuda"
        self.dtype = torch.float16 if dry else torch.bfloat16
        self.target = "interpret" if dry else "auto"
        self.heads, self.head_dim = ((4, 2), 64) if dry else ((32, 8), 128)
        self.group = 32 if dry else 128
        self.page = 32 if dry else 128
        self.tokens = 200 if dry else 4099
        self.ctx_len = 256 if dry else 4096
        self.batches = (1, 2) if dry else (1, 8)
        self.prompt, self.new = (48, 6) if dry else (4096, 128)

    def sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()


def table(title: str, header: list[str], rows: list[list]) -> str:
    cells = [header] + [[c if isinstance(c, str) else f"{c:.3g}" if isinstance(c, float) else str(c) for c in r]
                        for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [f"### {title}", "", "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells[1:]]
    return "\n".join(lines) + "\n"


# ---- a. correctness ----------------------------------------------------------------------------------

def _same_bits(a: AffineTensor, b: AffineTensor) -> bool:
    return all(torch.equal(getattr(a, f).view(torch.uint8), getattr(b, f).view(torch.uint8))
               for f in ("codes", "scale", "zero"))


def _random_table(lens, page, num_pages, gen, device):
    pages = [max(1, -(-n // page)) for n in lens]
    perm = torch.randperm(num_pages, generator=gen)[:sum(pages)]
    indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page for n, p in zip(lens, pages)], dtype=torch.int32)
    return indptr.to(device), perm.to(torch.int32).to(device), last.to(device)


def correctness(c: Ctx) -> tuple[list, str]:
    rows, gen = [], torch.Generator().manual_seed(int(time.time()) % 100000)
    hq, hkv = c.heads
    d = c.head_dim
    # append kernels: contiguous and paged, vs foldc.quantize
    for enc in (A(2, "token", c.group), A(4, "token", c.group // 4), A(2, "channel", c.group),
                A(4, "channel", c.group // 2, torch.bfloat16)):
        x = (torch.randn(3, hkv, 2 * c.group, d, generator=gen) * 2 + 0.3).to(c.device, c.dtype)
        dst = AffineTensor(torch.zeros(3, hkv, 4 * c.group, d * enc.bits // 8, dtype=torch.uint8, device=c.device),
                           *(torch.zeros(scale_shape(enc, 3, hkv, 4 * c.group, d), dtype=enc.scale_dtype,
                                         device=c.device) for _ in range(2)), enc, d)
        append_quantized(dst, x, c.group, target=c.target)
        want = foldc.quantize(x, enc)
        region = slice(c.group, 3 * c.group)
        g = enc.group_size
        rows_s = slice(c.group // g, 3 * c.group // g) if token_group(enc) else region   # scale rows: per group
        ok = (torch.equal(dst.codes[:, :, region], want.codes)
              and torch.equal(dst.scale[:, :, rows_s].view(torch.uint8), want.scale.view(torch.uint8))
              and torch.equal(dst.zero[:, :, rows_s].view(torch.uint8), want.zero.view(torch.uint8)))
        rows.append(["append (contiguous)", enc.short(), "bit-exact" if ok else "MISMATCH", ok])
        spec = foldc.AttentionSpec(hq, hkv, d, enc, enc)
        pools = [foldc.serving.page_pool(spec, "k", 12, 2 * c.group, device=c.device) for _ in range(2)]
        indptr = torch.tensor([0, 4, 8, 12], dtype=torch.int32, device=c.device)
        indices = torch.randperm(12, generator=gen).to(torch.int32).to(c.device)
        start = torch.tensor([0, c.group, 4 * c.group], dtype=torch.int32, device=c.device)
        counts = torch.tensor([2 * c.group, c.group, 0], dtype=torch.int32, device=c.device)
        append_paged(pools[0], x, indptr, indices, start, page_size=2 * c.group, counts=counts, target=c.target)
        append_paged(pools[1], x, indptr, indices, start, page_size=2 * c.group, counts=counts, target="reference")
        ok = _same_bits(*pools)
        rows.append(["append (paged, ragged counts)", enc.short(), "bit-exact" if ok else "MISMATCH", ok])
    # paged decode vs float64, and paged == contiguous kernel
    specs = [(2, "token", "channel"), (2, "channel", "token"), (4, "token", "token"), (4, "channel", "channel")]
    for bits, kl, vl in specs:
        spec = foldc.AttentionSpec(hq, hkv, d, A(bits, kl, c.group), A(bits, vl, c.group))
        lens = [c.tokens, 1, c.page + 1, c.tokens // 2, c.page, 7] if not c.dry else [c.tokens, 1, c.page + 1]
        num_pages = sum(max(1, -(-n // c.page)) for n in lens) + 5
        k = torch.randn(num_pages, hkv, c.page, d, generator=gen)
        k[..., :3] *= 6.0
        v = torch.randn(num_pages, hkv, c.page, d, generator=gen) + 0.5
        kp, vp = foldc.quantize(k.to(c.device), spec.k), foldc.quantize(v.to(c.device), spec.v)
        indptr, indices, last = _random_table(lens, c.page, num_pages, gen, c.device)
        wrapper = PagedDecodeWrapper(spec, c.page, max_seq_len=max(lens), device=c.device, target=c.target)
        wrapper.plan(indptr, indices, last, num_pages=num_pages)
        q = torch.randn(len(lens), hq, d, generator=gen).to(c.device, c.dtype)
        out = wrapper.run(q, kp, vp)
        kc, seq = gather_pages(kp, indptr, indices, lens, c.page)
        vc, _ = gather_pages(vp, indptr, indices, lens, c.page)
        seq = seq.to(c.device)
        ref = foldc.compile(spec, "reference")(q, kc, vc, seq_lens=seq)
        err = rel_l2(out, ref)
        bar = TOLERANCE * rel_l2(bf16_attention(q, kc, vc, d ** -0.5, seq), ref)
        ok = err <= bar and not torch.isnan(out).any()
        rows.append(["paged decode vs float64", spec.describe(), f"{err:.2e} (bar {bar:.2e})", ok])
        contiguous = foldc.compile(spec, c.target)(q, kc, vc, seq_lens=seq)
        diff = rel_l2(out, contiguous.double())
        rows.append(["paged vs contiguous kernel", spec.describe(), f"{diff:.2e}", diff <= 1e-2])
    # a PagedKVCache decode loop vs the contiguous cache (bits) and float64 attention
    spec = foldc.AttentionSpec(hq, hkv, d, A(4, "token", c.group), A(2, "channel", c.group // 2))
    batch, steps, prompt = 3, (20 if c.dry else 150), (40 if c.dry else 1000)
    cache = PagedKVCache(spec, num_layers=1, page_size=c.page, num_pages=64, max_seq_len=64 * c.page // batch,
                         sink=4, window=c.group // 4, device=c.device, dtype=c.dtype, target=c.target)
    per = 64 // batch
    cache.plan(torch.arange(0, per * batch + 1, per, dtype=torch.int32),
               torch.randperm(64, generator=gen)[:per * batch].to(torch.int32), [0] * batch)
    contiguous = QuantizedKVCache(spec, batch, 64 * c.page // batch, sink=4, window=c.group // 4, device=c.device,
                                  dtype=c.dtype, target="reference")

    def toks(n):
        return (torch.randn(batch, hkv, n, d, generator=gen).to(c.device, c.dtype),
                (torch.randn(batch, hkv, n, d, generator=gen) + 0.5).to(c.device, c.dtype))
    kv = toks(prompt)
    cache.append(0, *kv)
    contiguous.append(*kv)
    for _ in range(steps):
        kv = toks(1)
        cache.append(0, *kv)
        contiguous.append(*kv)
    gk, gv, _ = cache.dequantized(0)
    wk, wv = contiguous.dequantized()
    same = torch.equal(gk, wk) and torch.equal(gv, wv)
    rows.append(["PagedKVCache == QuantizedKVCache", f"{prompt}+{steps} tokens", "same bits" if same else
                 "MISMATCH", same])
    q = torch.randn(batch, hq, d, generator=gen).to(c.device, c.dtype)
    ref = foldc.attention_reference(q, wk, wv)
    err = rel_l2(cache.attention(0, q), ref)
    bar = TOLERANCE * rel_l2(bf16_attention(q, wk, wv, d ** -0.5, torch.full((batch,), wk.shape[2],
                                                                          device=c.device)), ref)
    rows.append(["PagedKVCache attention vs float64", spec.describe(), f"{err:.2e} (bar {bar:.2e})", err <= bar])
    text = table("a. correctness (GPU kernels vs foldc.quantize / float64)", ["check", "case", "result", "pass"],
                 rows)
    return [dict(zip(["check", "case", "result", "pass"], r)) for r in rows], text


# ---- b. one layer's decode kernel ----------------------------------------------------------------------

def _time(c: Ctx, fn, reps: int) -> float:
    """Seconds per call: on a GPU the median of ``reps`` CUDA-graph replays, the L2 flushed before each (as
    `foldc.timing.graph_us`, with a fixed count of replays: a decode step appends a token per replay); the mean of
    plain calls on the CPU. Replays back to back kept a cache smaller than the L2 (INT4 at batch 1 x 4K: 4.7 MB)
    there between calls, but not a larger one (bf16 SDPA's)."""
    fn()
    c.sync()
    if c.device != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")   # triton do_bench's L2 flush
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush.zero_()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3


def sdpa_baseline(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """A call of torch SDPA over q [batch, q heads, head_dim] and k, v [batch, KV heads, tokens, head_dim] as
    `foldc bench` times its peer (`foldc.bench.sdpa_peer`): ``enable_gqa`` (each KV head read once) and, on a GPU,
    the cuDNN backend alone (the math backend on the CPU). It was SDPA's default backend over K and V repeated to the
    query heads (4x the bytes at 32/8 heads: 123 µs at 8 x 4K on the H200, where cuDNN took 48 in `foldc bench`)."""
    from torch.nn.attention import SDPBackend

    from foldc.bench import sdpa_peer

    return sdpa_peer(SDPBackend.CUDNN_ATTENTION if q.is_cuda else SDPBackend.MATH)(q, k, v)


def paged_kernel(c: Ctx) -> tuple[list, str]:
    rows, gen = [], torch.Generator().manual_seed(5)
    hq, hkv = c.heads
    d, n = c.head_dim, c.ctx_len
    reps = 3 if c.dry else 200
    for bits in (4, 2):
        spec = foldc.AttentionSpec(hq, hkv, d, A(bits, "token", c.group), A(bits, "token", c.group))
        for batch in c.batches:
            pages_each = n // c.page
            num_pages = batch * pages_each
            k = torch.randn(num_pages, hkv, c.page, d, generator=gen).to(c.device)
            v = torch.randn(num_pages, hkv, c.page, d, generator=gen).to(c.device)
            kp, vp = foldc.quantize(k, spec.k), foldc.quantize(v, spec.v)
            indptr = torch.arange(0, num_pages + 1, pages_each, dtype=torch.int32, device=c.device)
            indices = torch.randperm(num_pages, generator=gen).to(torch.int32).to(c.device)
            last = torch.full((batch,), c.page, dtype=torch.int32, device=c.device)
            wrapper = PagedDecodeWrapper(spec, c.page, max_seq_len=n, device=c.device, target=c.target)
            wrapper.plan(indptr, indices, last, num_pages=num_pages)
            q = torch.randn(batch, hq, d, generator=gen).to(c.device, c.dtype)
            out = torch.empty_like(q)
            t_paged = _time(c, lambda: wrapper.run(q, kp, vp, out=out), reps)
            kc, _ = gather_pages(kp, indptr, indices, [n] * batch, c.page)
            vc, _ = gather_pages(vp, indptr, indices, [n] * batch, c.page)
            lens = torch.full((batch,), n, dtype=torch.int32, device=c.device)
            contiguous = foldc.compile(spec, c.target)
            t_contig = _time(c, lambda: contiguous(q, kc, vc, seq_lens=lens, out=out), reps)
            kd = kc.dequantize(torch.float32).to(c.dtype)
            vd = vc.dequantize(torch.float32).to(c.dtype)
            sdpa = sdpa_baseline(q, kd, vd)
            with sdpa.selected():
                t_sdpa = _time(c, sdpa, reps)
            kv_bytes = 2 * batch * hkv * n * d * 2
            t_step = _decode_step_time(c, spec, batch, n, reps, gen)
            rows.append([f"INT{bits} token/token g{c.group}", batch, n, t_paged * 1e6, t_contig * 1e6, t_step * 1e6,
                         t_sdpa * 1e6, kv_bytes / t_sdpa / 1e9])
    header = ["cache", "batch", "tokens", "paged foldc (us)", "contiguous foldc (us)",
              "PagedKVCache step: append + attention (us)", "bf16 SDPA (us)", "SDPA GB/s (bf16 K+V)"]
    text = table("b. one layer's decode attention (CUDA-graph replay, L2 flushed, median; SDPA: cuDNN, enable_gqa)",
                 header, rows)
    return [dict(zip(header, r)) for r in rows], text


def _decode_step_time(c: Ctx, spec, batch: int, n: int, reps: int, gen) -> float:
    """One layer's decode step of a PagedKVCache (append one token per sequence: bf16 window, flushes
    into pages; attention: paged body + window merged), after a prompt of ``n`` tokens."""
    hkv, d = spec.num_kv_heads, spec.head_dim
    per = -(-(n + reps + 8 + 256) // c.page)
    cache = PagedKVCache(spec, num_layers=1, page_size=c.page, num_pages=batch * per, max_seq_len=per * c.page,
                         sink=4, window=128 if not c.dry else 16, device=c.device, dtype=c.dtype, target=c.target)
    cache.plan(torch.arange(0, batch * per + 1, per, dtype=torch.int32), torch.arange(batch * per, dtype=torch.int32),
               [0] * batch)
    cache.append(0, torch.randn(batch, hkv, n, d, generator=gen).to(c.device, c.dtype),
                 torch.randn(batch, hkv, n, d, generator=gen).to(c.device, c.dtype))
    k1 = torch.randn(batch, hkv, 1, d, generator=gen).to(c.device, c.dtype)
    v1 = torch.randn(batch, hkv, 1, d, generator=gen).to(c.device, c.dtype)
    q = torch.randn(batch, spec.num_q_heads, d, generator=gen).to(c.device, c.dtype)
    out = torch.empty_like(q)

    def step():
        cache.append(0, k1, v1)
        out.copy_(cache.attention(0, q))
    return _time(c, step, reps)


# ---- c. tokens/s of a Llama-style model ------------------------------------------------------------------

def build_model(c: Ctx):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if c.dry:
        cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=64, vocab_size=256, max_position_embeddings=256)
    else:
        cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128, vocab_size=32000, max_position_embeddings=8192)
    cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id = None, 0, 1
    with torch.device(c.device):
        model = LlamaForCausalLM(cfg)
    return model.eval().to(c.dtype)


def _cache_bytes(cache) -> int | None:
    try:
        from foldc.integrations.hf import FoldcCache
        from foldc.integrations.hf_paged import PagedFoldcCache
        if isinstance(cache, PagedFoldcCache):
            paged = cache.paged_cache
            total = sum(t.numel() * t.element_size() for pools in paged.pools for pool in pools.values()
                        for t in (pool.codes, pool.scale, pool.zero))
            return total + sum(st[n].numel() * st[n].element_size() for st in paged._layers for n in "kv")
        if isinstance(cache, FoldcCache):
            total = 0
            for lc in cache.layer_caches:
                for part in list(lc._body.values()) + list(lc._plain.values()):
                    ts = (part.codes, part.scale, part.zero) if isinstance(part, AffineTensor) else (part,)
                    total += sum(t.numel() * t.element_size() for t in ts)
            return total
        return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
                   if isinstance(t, torch.Tensor))
    except Exception:  # noqa: BLE001 - a size is a nicety, never a failure
        return None


def throughput(c: Ctx) -> tuple[list, str]:
    import transformers
    from transformers import DynamicCache

    import foldc.integrations.hf as fhf
    from foldc.integrations.hf_paged import PagedFoldcCache

    model = build_model(c)
    # the same model with every linear but lm_head as foldc INT4 k-group:128 weights (FoldLinear:
    # the register-operand GEMV at decode, the Triton GEMM for the prompt)
    wmodel = fhf.quantize_model(build_model(c), weight="k-group:4:128" if not c.dry else "k-group:4:32")
    g = c.group if not c.dry else 32
    caches = [
        ("bf16 DynamicCache" if not c.dry else "fp16 DynamicCache", "sdpa",
         lambda: DynamicCache(), None),
        ("foldc INT4 (K,V token:4, window 128)", "foldc",
         lambda: fhf.FoldcCache(model.config, c.prompt + c.new + 8, k=f"token:4:{g}", v=f"token:4:{g}", window=128,
                                target=c.target), None),
        ("foldc INT2 (K channel:2, V token:2, window 128)", "foldc",
         lambda: fhf.FoldcCache(model.config, c.prompt + c.new + 8, k=f"channel:2:{g}", v=f"token:2:{g}",
                                window=128, target=c.target), None),
        ("foldc INT4 paged (PagedFoldcCache, K,V token:4)", "foldc",
         lambda: PagedFoldcCache(model.config, c.prompt + c.new + 8, k=f"token:4:{g}", v=f"token:4:{g}", window=128,
                                 target=c.target), None),
        ("foldc INT2 paged (PagedFoldcCache, K channel:2, V token:2)", "foldc",
         lambda: PagedFoldcCache(model.config, c.prompt + c.new + 8, k=f"channel:2:{g}", v=f"token:2:{g}",
                                 window=128, target=c.target), None),
        ("W4 (foldc k-group:4:128 linears) + bf16 DynamicCache", "sdpa", lambda: DynamicCache(), "w4"),
        ("W4 + KV4 paged (K,V token:4)", "foldc",
         lambda: PagedFoldcCache(model.config, c.prompt + c.new + 8, k=f"token:4:{g}", v=f"token:4:{g}", window=128,
                                 target=c.target), "w4"),
        ("W4 + KV2 paged (K channel:2, V token:2)", "foldc",
         lambda: PagedFoldcCache(model.config, c.prompt + c.new + 8, k=f"channel:2:{g}", v=f"token:2:{g}",
                                 window=128, target=c.target), "w4"),
    ]
    for backend, package in (("quanto", "optimum.quanto"), ("HQQ", "hqq")):
        if importlib.util.find_spec(package.split(".")[0]) is not None and \
                (package == "hqq" or importlib.util.find_spec(package) is not None):
            caches.append((f"transformers QuantizedCache ({backend}, INT4)", "sdpa", None,
                           {"cache_implementation": "quantized",
                            "cache_config": {"backend": backend, "nbits": 4, "residual_length": 128}}))
        else:
            caches.append((f"transformers QuantizedCache ({backend})", "sdpa", None, f"skipped: {package} not "
                           "installed"))
    rows = []
    for batch in c.batches:
        ids = torch.randint(2, model.config.vocab_size, (batch, c.prompt), generator=torch.Generator()
                            .manual_seed(batch)).to(c.device)

        def gen(make, impl, extra, new):
            the_model = wmodel if extra == "w4" else model
            the_model.set_attn_implementation(impl)
            kw = dict(extra) if isinstance(extra, dict) else {}
            if make is not None:
                kw[fhf.CACHE_KWARG] = make()
            c.sync()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = the_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                     min_new_tokens=new, do_sample=False, return_dict_in_generate=True, **kw)
            c.sync()
            return time.perf_counter() - t0, out, kw.get(fhf.CACHE_KWARG)

        for name, impl, make, extra in caches:
            if isinstance(extra, str) and extra != "w4":
                rows.append([name, batch, c.prompt, c.new, extra, "", "", ""])
                continue
            try:
                if c.device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                gen(make, impl, extra, 2)  # warm-up: compiles every kernel at these shapes
                t1, _, _ = gen(make, impl, extra, 1)
                tn, out, cache = gen(make, impl, extra, c.new)
                decode = batch * (c.new - 1) / max(tn - t1, 1e-9)
                peak = torch.cuda.max_memory_allocated() / 2**30 if c.device == "cuda" else float("nan")
                size = _cache_bytes(cache) if cache is not None else None
                rows.append([name, batch, c.prompt, c.new, f"{decode:.1f}", f"{batch * c.new / tn:.1f}",
                             f"{size / 2**20:.1f}" if size else "-", f"{peak:.1f}"])
            except Exception as err:  # noqa: BLE001 - one cache failing must not hide the others
                rows.append([name, batch, c.prompt, c.new, f"failed: {type(err).__name__}: {str(err)[:120]}", "",
                             "", ""])
    header = ["cache", "batch", "prompt", "new", "decode tok/s", "end-to-end tok/s", "cache MiB", "peak GiB"]
    note = (f"transformers {transformers.__version__}; decode tok/s = batch x (new - 1) / (time(new) - time(1)); "
            "end-to-end includes the prefill.\n")
    return [dict(zip(header, r)) for r in rows], table("c. decode throughput, random Llama-style model", header,
                                                       rows) + "\n" + note


# ---- d. accuracy through the GPU path ------------------------------------------------------------------

def accuracy(c: Ctx) -> tuple[list, str]:
    from foldc.accuracy import AccuracyConfig, compare, make_data, quantized_attention
    from foldc.rotation import Rotation

    tokens = 512 if c.dry else 4096
    shape = {"num_q_heads": c.heads[0], "num_kv_heads": c.heads[1], "head_dim": c.head_dim}
    sink, window = (8, 32) if c.dry else (64, 256)
    seeds = (0,) if c.dry else (0, 1)
    data = {(kind, s): make_data(kind, tokens=tokens, seed=s, **shape) for kind in ("gaussian", "outlier")
            for s in seeds}
    rot = Rotation(c.head_dim, 0)
    rows = []
    layouts = [("token", "token"), ("channel", "token")] if c.dry else \
        [("token", "token"), ("token", "channel"), ("channel", "token"), ("channel", "channel")]
    for bits in (2, 4):
        for kl, vl in layouts:
            for rotate in (False, True):
                for windows in (False, True):
                    cfg = AccuracyConfig(bits, kl, vl, c.group, rotate=rotate, rotation_seed=0,
                                         sink=sink if windows else 0, window=window if windows else 0)
                    spec = foldc.AttentionSpec(shape["num_q_heads"], shape["num_kv_heads"], c.head_dim,
                                               cfg.encoding("k"), cfg.encoding("v"))
                    cell = {}
                    for kind in ("gaussian", "outlier"):
                        gpu, f64 = [], []
                        for s in seeds:
                            q, k, v = data[kind, s]
                            exact = foldc.attention_reference(q, k, v)
                            f64.append(compare(quantized_attention(q, k, v, cfg), exact).rel_l2)
                            if rotate:
                                q, k, v = rot.rotate_queries(q), rot.rotate_keys(k), rot.rotate_values(v)
                            cache = PagedKVCache(spec, num_layers=1, page_size=c.page, num_pages=tokens // c.page + 2,
                                                 max_seq_len=tokens, sink=cfg.sink, window=cfg.window,
                                                 device=c.device, dtype=c.dtype, target=c.target)
                            cache.plan(torch.tensor([0, tokens // c.page + 2], dtype=torch.int32),
                                       torch.arange(tokens // c.page + 2, dtype=torch.int32), [0])
                            cache.append(0, k.to(c.device, c.dtype), v.to(c.device, c.dtype))
                            out = cache.attention(0, q.to(c.device, c.dtype)).double().cpu()
                            if rotate:
                                out = rot.unrotate_output(out)
                            gpu.append(compare(out, exact).rel_l2)
                        cell[kind] = (sum(gpu) / len(gpu), sum(f64) / len(f64))
                    rows.append([f"INT{bits}", f"{kl}/{vl}", "yes" if rotate else "no",
                                 f"{sink}+{window}" if windows else "none",
                                 cell["gaussian"][0], cell["gaussian"][1], cell["outlier"][0], cell["outlier"][1]])
    header = ["bits", "K/V layout", "rotation", "sink+window", "gaussian: GPU kernel", "gaussian: float64",
              "outlier: GPU kernel", "outlier: float64"]
    note = (f"relative L2 of the attention output vs exact float64 attention over the unquantized K/V; {tokens} tokens, "
            f"{shape['num_q_heads']}/{shape['num_kv_heads']} heads, head_dim {c.head_dim}, groups of {c.group}, "
            f"mean of {len(seeds)} seed(s). 'GPU kernel': PagedKVCache ({'fp16 interpreter' if c.dry else 'bf16'}, "
            "paged kernel + plain window merged by log-sum-exp; its window keeps window..window+group-1 tokens for "
            "channel-wise layouts); 'float64': foldc.accuracy (quantization error only).\n")
    return [dict(zip(header, r)) for r in rows], table("d. attention accuracy through the serving path", header,
                                                       rows) + "\n" + note


PARTS = {"correctness": correctness, "paged_kernel": paged_kernel, "throughput": throughput, "accuracy": accuracy}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="foldc bench --serving", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for serving.json and serving.md")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU under Triton's interpreter")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--budget-s", type=float, default=450.0, help="skip the parts left once this many seconds passed")
    ap.add_argument("--prompt", type=int, default=None, help="throughput: prompt tokens (default 4096)")
    ap.add_argument("--new-tokens", type=int, default=None, help="throughput: generated tokens (default 128)")
    ap.add_argument("--batches", default=None, help="throughput and kernel timing: comma-separated batch sizes "
                    "(default 1,8)")
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA GPU: run with --dry-run for the CPU check of this script", file=sys.stderr)
        return 2
    from foldc.options import cli_items, cli_out_dir

    parts = cli_items(ap, "--parts", args.parts)
    unknown = [p for p in parts if p not in PARTS]
    if unknown:   # before any part runs (one found after the others had run minutes)
        ap.error(f"--parts={args.parts!r}: unknown part(s) {unknown}; parts are {list(PARTS)}")
    if not args.budget_s > 0:   # -5 skipped every part (exit 0); NaN was never spent (inf: no budget)
        ap.error(f"--budget-s={args.budget_s:g}: give the seconds after which the parts left are skipped, a positive "
                 "number (default 450)")
    c = Ctx(args.dry_run)
    if args.prompt is not None or args.new_tokens is not None:
        if min(n for n in (args.prompt, args.new_tokens) if n is not None) < 1:   # 0 was taken for the default
            ap.error(f"--prompt={args.prompt} and --new-tokens={args.new_tokens} must be positive")
        c.prompt = c.prompt if args.prompt is None else args.prompt
        c.new = c.new if args.new_tokens is None else args.new_tokens
    if cli_items(ap, "--batches", args.batches):
        try:
            c.batches = tuple(int(b) for b in args.batches.split(","))
        except ValueError:
            ap.error(f"--batches={args.batches!r}: use comma-separated positive integers, e.g. 1,8")
        if min(c.batches) < 1:
            ap.error(f"--batches={args.batches!r}: every batch size must be at least 1")
    cli_out_dir(ap, args.out)   # after every check of the flags: a refused command leaves no folder behind
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "python": platform.python_version(), "dry_run": args.dry_run,
            "device": torch.cuda.get_device_name() if c.device == "cuda" else "cpu (interpreter)",
            "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    import triton
    meta["triton"] = triton.__version__
    results, texts, t_start, failed = {"meta": meta}, [], time.perf_counter(), False
    print(json.dumps(meta))
    for name in parts:
        if time.perf_counter() - t_start > args.budget_s:
            results[name] = {"skipped": f"time budget of {args.budget_s:.0f} s spent"}
            print(f"\n[{name}] skipped: time budget spent")
            continue
        t0 = time.perf_counter()
        try:
            rows, text = PARTS[name](c)
            results[name] = {"rows": rows, "seconds": time.perf_counter() - t0}
            if name == "correctness" and not all(r["pass"] for r in rows):
                failed = True
        except Exception as err:  # noqa: BLE001 - record and go on with the next part
            failed = True
            text = f"### {name}\n\nFAILED: {type(err).__name__}: {err}\n\n```\n{traceback.format_exc()}```\n"
            results[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        text += f"\n({name}: {time.perf_counter() - t0:.1f} s)\n"
        print("\n" + text, flush=True)
        texts.append(text)
        (out / "serving.json").write_text(json.dumps(results, indent=1, default=str))
        (out / "serving.md").write_text("\n".join(texts))
    print(f"total {time.perf_counter() - t_start:.1f} s; wrote {out / 'serving.json'} and {out / 'serving.md'}")
    if failed:
        print("SOME CHECKS FAILED (see above)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
