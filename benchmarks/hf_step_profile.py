"""Host time of transformers' decode steps with a foldc cache: cProfile of a warmed-up ``generate``
on examples/hf_decode.py's model (H200; evidence for docs/perf.md, not a test).

    PYTHONPATH=. python3 benchmarks/hf_step_profile.py --new 64 --out $OUT/hf_profile.txt [--long --weight k-group:4:128]

Both caches' generate are profiled, foldc's first, each by own time and by cumulative time.
"""
from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import pstats
import sys
import time
from pathlib import Path

import torch


def load_example():
    """examples/hf_decode.py as a module (its ``build_model`` and ``generate``)."""
    path = Path(__file__).resolve().parent.parent / "examples" / "hf_decode.py"
    spec = importlib.util.spec_from_file_location("hf_decode", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def parse_on_gpu(ap: argparse.ArgumentParser):
    """(the parsed arguments, examples/hf_decode.py as a module), or (None, None) after saying so without a GPU."""
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return None, None
    return args, load_example()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--kv", default="token:4:32")
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--long", action="store_true",
                    help="16 layers, hidden 2048, 16/4 heads of 128, vocabulary 32000 (a ~1B model)")
    ap.add_argument("--weight", default=None, help="quantize the foldc run's linears, e.g. k-group:4:128 (W4 + KV)")
    ap.add_argument("--out", required=True)
    args, example = parse_on_gpu(ap)
    if args is None:
        return 2
    import foldc.integrations.hf as fhf
    from transformers import DynamicCache

    size = dict(layers=16, hidden=2048, heads="16/4", head_dim=128, vocab=32000) if args.long else {}
    model = example.build_model("cuda", torch.bfloat16, positions=max(256, args.prompt + args.new), **size)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), device="cuda")
    fmodel = model
    if args.weight:   # a second model, built as the first (the same weights), its linears quantized
        fmodel = fhf.quantize_model(example.build_model("cuda", torch.bfloat16, positions=max(256, args.prompt + args.new),
                                                        **size), weight=args.weight)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # flash/efficient SDPA for the default cache and the prompt: cuDNN builds a graph per new length
    backends = sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
    backends.__enter__()

    def run(cache, impl, new):
        torch.cuda.synchronize()
        start = time.perf_counter()
        example.generate(fmodel if impl == fhf.ATTN_IMPLEMENTATION else model, cache, ids, new, impl)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def foldc_cache():
        return fhf.FoldcCache(fmodel.config, args.prompt + args.new, k=args.kv, v=args.kv, sink=args.sink,
                              window=args.window)

    lines = []
    for label, make, impl in (("default", lambda: DynamicCache(config=model.config), "sdpa"),
                              ("foldc", foldc_cache, fhf.ATTN_IMPLEMENTATION)):
        run(make(), impl, 4)
        took = run(make(), impl, args.new)
        lines.append(f"{label}: {took / args.new * 1e3:.2f} ms per token ({args.new} new tokens)")
    for label, make, impl in (("foldc", foldc_cache, fhf.ATTN_IMPLEMENTATION),
                              ("default", lambda: DynamicCache(config=model.config), "sdpa")):
        prof = cProfile.Profile()
        cache = make()
        prof.enable()
        example.generate(fmodel if impl == fhf.ATTN_IMPLEMENTATION else model, cache, ids, args.new, impl)
        torch.cuda.synchronize()
        prof.disable()
        for order in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats(order).print_stats(35)
            lines.append(f"==== {label}, by {order}\n" + text.getvalue())
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines[:2]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
