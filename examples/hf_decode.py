"""Greedy decoding of a tiny random Llama through foldc, next to transformers' default cache.

    .venv/bin/python examples/hf_decode.py                      # INT4 K and V, sink 4, window 4
    .venv/bin/python examples/hf_decode.py --k channel:2:16 --v token:2:32 --window 8
    .venv/bin/python examples/hf_decode.py --k none --v none    # plain cache: same tokens as the default
    .venv/bin/python examples/hf_decode.py --weight k-group:4:32 # foldc's linears too (W4 + KV4)

CPU: float16 with Triton's interpreter (``--dtype fp32`` runs the float64 executor instead);
GPU: bfloat16 with the generated kernel. No weights are downloaded: the model is built from a
config with a fixed seed.

Per step it prints the tokens of both runs and two logit differences, both computed on the tokens
foldc generated (the references replay them, so the numbers stay comparable after the runs part):

- vs default: against transformers' DynamicCache, full precision: the quantization's effect (with
  ``--weight``, the weights' quantization too).
- vs dequant: against the same quantized cache attended by dequantize-then-SDPA in float32
  (foldc.integrations.hf.DequantizedFoldcCache): the fused kernel's own error, float rounding.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch

try:
    import transformers
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
except ImportError:
    sys.exit("this example needs transformers: .venv/bin/pip install -e '.[hf]'")

import foldc
import foldc.integrations.hf as fhf


def build_model(device, dtype, seed=0, layers=2, hidden=128, heads="4/2", head_dim=64, vocab=256, positions=256):
    torch.manual_seed(seed)
    q_heads, kv_heads = (int(x) for x in heads.split("/"))
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=q_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         vocab_size=vocab, max_position_embeddings=positions, initializer_range=0.1,
                         pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return LlamaForCausalLM(config).eval().to(device=device, dtype=dtype)


@contextlib.contextmanager
def attention(model, impl):
    old = model.config._attn_implementation
    model.set_attn_implementation(impl)
    try:
        yield
    finally:
        model.set_attn_implementation(old)


def generate(model, cache, ids, new, impl):
    """Greedy generate with ``cache`` (a Cache object, or "static": transformers' own static cache)."""
    how = {"cache_implementation": "static"} if cache == "static" else {fhf.CACHE_KWARG: cache}
    with attention(model, impl):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, **how)
    return out.sequences, torch.stack(out.logits).float()  # [batch, prompt + new], [new, batch, vocab]


@torch.no_grad()
def replay(model, cache, seq, prompt_len, impl):
    """Logits of each step of ``seq``, fed as generate feeds it (the prompt, then one token a step)."""
    with attention(model, impl):
        out = model(seq[:, :prompt_len], use_cache=True, **{fhf.CACHE_KWARG: cache})
        logits = [out.logits[:, -1]]
        for t in range(prompt_len, seq.shape[1] - 1):
            out = model(seq[:, t:t + 1], use_cache=True, **{fhf.CACHE_KWARG: cache})
            logits.append(out.logits[:, -1])
    return torch.stack(logits).float()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", default="token:4:32", help="key encoding, e.g. token:4:32, channel:2:16, none")
    ap.add_argument("--v", default="token:4:32", help="value encoding")
    ap.add_argument("--sink", type=int, default=4, help="first tokens kept plain")
    ap.add_argument("--window", type=int, default=4, help="recent tokens kept plain")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens (random ids)")
    ap.add_argument("--new", type=int, default=16, help="tokens to generate")
    ap.add_argument("--layers", type=int, default=2, help="model size: decoder layers (default 2)")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size (default 128; the MLP is twice it)")
    ap.add_argument("--heads", default="4/2", help="query heads / KV heads (default 4/2)")
    ap.add_argument("--head-dim", type=int, default=64, help="channels per head (default 64)")
    ap.add_argument("--vocab", type=int, default=256, help="vocabulary size (default 256)")
    ap.add_argument("--no-check", action="store_true",
                    help="time only: skip the replays that compare logits (long prompts)")
    ap.add_argument("--cache", choices=["dynamic", "paged", "static"], default="dynamic",
                    help="foldc cache: FoldcCache (default), PagedFoldcCache, or FoldcStaticCache (no sink or "
                         "window); with static, the default cache is transformers' static cache too, and on a GPU "
                         "generate compiles the decode step (torch.compile, CUDA graphs) for both")
    ap.add_argument("--sdpa", choices=["auto", "flash"], default="auto",
                    help="SDPA backends for the default cache and the prompt: torch's choice (on an H200 with torch "
                         "2.11, cuDNN, which builds a graph for each new length), or flash/efficient only")
    ap.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default=None,
                    help="model dtype (default: bf16 on a GPU, fp16 on the CPU)")
    ap.add_argument("--target", default=None,
                    help="foldc target (default: auto; reference for fp32 on the CPU)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="timed rounds, the default cache's generate and foldc's alternating (fresh caches each): "
                         "medians and each round's ratio (hosts vary between processes, and within one)")
    ap.add_argument("--split", action="store_true",
                    help="also time each cache's prompt alone (generate of one token) in every round, and report "
                         "the time per later token apart from it")
    ap.add_argument("--weight", default=None,
                    help="also quantize the foldc run's linear layers (foldc.integrations.hf.quantize_model), e.g. "
                         "k-group:4:128: a W4 + KV model against the bf16 model with the default cache")
    args = ap.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype_name = args.dtype or ("bf16" if device == "cuda" else "fp16")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    target = args.target or ("reference" if dtype == torch.float32 else "auto")
    model = build_model(device, dtype, layers=args.layers, hidden=args.hidden, heads=args.heads,
                        head_dim=args.head_dim, vocab=args.vocab, positions=max(256, args.prompt + args.new))
    # the foldc runs' model: the same weights, or (--weight) the same weights quantized by foldc
    fmodel = model if args.weight is None else fhf.quantize_model(
        build_model(device, dtype, layers=args.layers, hidden=args.hidden, heads=args.heads, head_dim=args.head_dim,
                    vocab=args.vocab, positions=max(256, args.prompt + args.new)), weight=args.weight)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), generator=gen).to(device)
    capacity = args.prompt + args.new

    if args.cache == "static" and (args.sink or args.window):
        sys.exit("--cache static keeps no plain sink or window: pass --sink 0 --window 0")

    def foldc_cache(kind=None):
        if kind is None and args.cache == "static":
            from foldc.integrations.hf_static import FoldcStaticCache

            return FoldcStaticCache(fmodel, capacity, k=args.k, v=args.v, target=target)
        if kind is None and args.cache == "paged":
            from foldc.integrations.hf_paged import PagedFoldcCache

            kind = PagedFoldcCache
        return (kind or fhf.FoldcCache)(fmodel.config, capacity, k=args.k, v=args.v, sink=args.sink,
                                        window=args.window, target=target)

    def default_cache():
        return "static" if args.cache == "static" else DynamicCache(config=model.config)

    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {device}, {dtype_name}, "
          f"foldc target={target!r}")
    cache = foldc_cache()
    print(f"model: Llama, {model.config.num_hidden_layers} layers, {model.config.num_attention_heads} query / "
          f"{model.config.num_key_value_heads} KV heads, head_dim {model.config.head_dim}; cache: {cache.spec.describe()}, "
          f"sink {args.sink}, window {args.window}, {type(cache).__name__}; batch {args.batch}, prompt {args.prompt}, {args.new} new tokens"
          + (f"; foldc's linears {args.weight}" if args.weight else ""))

    if args.sdpa == "flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = contextlib.ExitStack()   # for the rest of the run
        backends.enter_context(sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                            SDPBackend.MATH]))
    # warm-up (and compile), so that the timings compare; a static cache compiles for its length, so the
    # warm-up of transformers' static cache generates as many tokens as the timed run
    # transformers keeps its static cache between generate calls (same storage, so the compiled step
    # and its CUDA graphs replay); FoldcStaticCache is kept the same way: warmed up at the timed
    # length, then reset (a fresh one would have new addresses, and the step would compile again)
    # Both warm-ups generate as many tokens as the timed runs: a kernel specialises on its integer arguments
    # (Triton: a length of 1 or a multiple of 16 is its own build), so a shorter warm-up leaves builds to the
    # timed run. The dynamic and paged runs take a fresh cache each, as generate's callers do. (The CPU's
    # interpreter times nothing worth a long warm-up.)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    warm = args.new if device == "cuda" or args.cache == "static" else 2
    generate(model, default_cache(), ids, warm, "sdpa")
    sync()
    t0 = time.perf_counter()
    generate(fmodel, cache if args.cache == "static" else foldc_cache(), ids, warm, fhf.ATTN_IMPLEMENTATION)
    sync()
    t_first = time.perf_counter() - t0
    def fresh():
        if args.cache == "static":
            cache.reset()
            return cache
        return foldc_cache()

    def timed(fn):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        return time.perf_counter() - t0, out

    refs, folds, prompts = [], [], []
    for r in range(max(1, args.rounds)):
        t_ref, ref = timed(lambda: generate(model, default_cache(), ids, args.new, "sdpa"))
        timed_cache = fresh()
        t_foldc, out = timed(lambda: generate(fmodel, timed_cache, ids, args.new, fhf.ATTN_IMPLEMENTATION))
        refs.append(t_ref)
        folds.append(t_foldc)
        if r == 0:   # the first round's tokens, logits and cache are the ones checked below
            (ref_seq, ref_logits), (seq, logits), first_cache = ref, out, timed_cache
        if args.split:   # the prompt and first token alone
            prompts.append((timed(lambda: generate(model, default_cache(), ids, 1, "sdpa"))[0],
                            timed(lambda: generate(fmodel, fresh(), ids, 1, fhf.ATTN_IMPLEMENTATION))[0]))
    t_ref, t_foldc, cache = refs[0], folds[0], first_cache
    note = " (Triton's interpreter: correctness, not speed)" if device == "cpu" and target != "reference" else ""
    timing = (f"time (after a warm-up of {warm} tokens): default cache {t_ref:.2f} s, foldc {t_foldc:.2f} s "
              f"({t_ref / t_foldc:.2f}x); foldc's first generate in this process {t_first:.2f} s (builds its "
              f"kernels){note}")
    if args.rounds > 1:
        ratios = sorted(a / b for a, b in zip(refs, folds))
        timing += (f"\nrounds {len(refs)}: default cache median {statistics.median(refs):.2f} s "
                   f"({min(refs):.2f}-{max(refs):.2f}), foldc {statistics.median(folds):.2f} s "
                   f"({min(folds):.2f}-{max(folds):.2f}); default / foldc per round {statistics.median(ratios):.2f}x "
                   f"median ({ratios[0]:.2f}-{ratios[-1]:.2f})")
    if prompts and args.new > 1:
        p_ref, p_foldc = (statistics.median(x) for x in zip(*prompts))
        later = args.new - 1
        d_ref, d_foldc = ((statistics.median(t) - p) / later * 1e3 for t, p in ((refs, p_ref), (folds, p_foldc)))
        timing += (f"\nprompt and first token: default cache {p_ref:.3f} s, foldc {p_foldc:.3f} s; each later token: "
                   f"default {d_ref:.2f} ms, foldc {d_foldc:.2f} ms ({d_ref / d_foldc:.2f}x) (medians)")
    if args.no_check:
        print(timing)
        return
    vs_default = replay(model, DynamicCache(config=model.config), seq, args.prompt, "sdpa")
    vs_dequant = replay(fmodel, foldc_cache(fhf.DequantizedFoldcCache), seq, args.prompt, fhf.ATTN_IMPLEMENTATION)

    scale = float(vs_default.abs().max())
    print(f"\nlargest |logit| {scale:.3g}; differences are max |logit - reference| over batch and vocabulary\n")
    print(f"{'step':>4}  {'foldc tokens':<16} {'default tokens':<16} {'vs default':>10} {'vs dequant':>10}")
    new = seq[:, args.prompt:]
    ref_new = ref_seq[:, args.prompt:]
    for t in range(args.new):
        mine = " ".join(f"{int(x):3d}" for x in new[:, t])
        theirs = " ".join(f"{int(x):3d}" for x in ref_new[:, t])
        mark = "" if torch.equal(new[:, t], ref_new[:, t]) else "  *"
        d_def = float((logits[t] - vs_default[t]).abs().max())
        d_deq = float((logits[t] - vs_dequant[t]).abs().max())
        print(f"{t:>4}  {mine:<16} {theirs:<16} {d_def:>10.2e} {d_deq:>10.2e}{mark}")
    same = torch.equal(seq, ref_seq)
    rel = float((logits - vs_default).norm() / vs_default.norm())
    rel_dq = float((logits - vs_dequant).norm() / vs_dequant.norm())
    print(f"\nsame tokens as the default cache: {same}"
          + ("" if same else " (* marks steps whose tokens differ; later steps follow different prefixes)"))
    print(f"relative logit difference: {rel:.2e} vs default, {rel_dq:.2e} vs dequantize-then-attend")
    if args.cache == "static":
        print(f"layer 0 holds {int(cache.layers[0].length)} tokens in its static storage")
    elif args.cache == "dynamic":
        layer = cache.layer_caches[0]
        body = "quantized" if cache.spec.k or cache.spec.v else "plain"
        print(f"layer 0 holds {layer.num_tokens} tokens: sink {layer.sink_tokens}, body {layer.body_tokens} ({body}), "
              f"recent window {layer.window_tokens}")
    print(timing)


if __name__ == "__main__":
    try:
        main()
    except foldc.FoldError as err:  # a setting foldc cannot run: say which and why, without a traceback
        sys.exit(f"{type(err).__name__}: {err}")
