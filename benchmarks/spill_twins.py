"""The grid's builds that spill in the token loop (docs/results/grid_aot_full.json, benchmarks/grid_aot.py)
beside their twins with 32-token tiles and/or one KV head per program, or with the token-wise scales loaded at
each tile's start or one tile ahead (``scale_ahead``): on the CPU, each variant's AOT
build (registers, spills, SASS per tile); on the GPU, each variant timed at one shape (CUDA-graph
replay, L2 flushed) with its error against float64, beside cuDNN bf16, to decide the launcher's default.

    python3 benchmarks/spill_twins.py --aot [--arch sm_100] [--out twins_aot.json]    # CPU
    PYTHONPATH=. python3 benchmarks/spill_twins.py --shape 8x65536 --out $OUT/twins.json   # GPU
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results" / "grid_aot_full.json"
VARIANTS = {"default": {}, "bn32": {"block_n": 32}, "one_head": {"pack_heads": 1},
            "bn32_one_head": {"block_n": 32, "pack_heads": 1}, "scales_at_start": {"scale_ahead": False},
            "scales_ahead": {"scale_ahead": True}}


def spilling_layouts(arch: str = "sm_90") -> list[str]:
    rows = json.loads(RESULTS.read_text())["rows"]
    return [r["label"] for r in rows if r["arch"] == arch and r["status"] == "ok" and r["spills"]]


def layout_of(label: str):
    from foldc.layout_grid import grid

    return next(x for x in grid("full") if x.label == label)


def aot(labels, arch, out_path=None):
    from foldc.backends.gluon.aot import compile_gluon_aot
    from foldc.errors import FoldError

    rows = []
    for label in labels:
        spec = layout_of(label).spec()
        for name, opts in VARIANTS.items():
            row = dict(label=label, arch=arch, variant=name)
            try:
                with tempfile.TemporaryDirectory() as out:
                    r = compile_gluon_aot(spec, arch, out, **opts)
                loop = r["inner_loop"]
                row.update(block_n=r["block_n"], pack_heads=r["pack_heads"], scale_ahead=r["scale_ahead"],
                           registers=r["registers"], spills=loop["local_memory"],
                           spills_every_tile=loop["local_memory_every_tile"],
                           instructions_per_tile=round(loop["instructions_per_tile"], 1),
                           bytes_per_tile=loop["bytes_per_tile"])
            except FoldError as e:
                row["refused"] = str(e)[:200]
            print(json.dumps(row), flush=True)
            rows.append(row)
    if out_path:
        Path(out_path).write_text(json.dumps(dict(arch=arch, rows=rows), indent=1))


def gpu(labels, batch, tokens, out_path):
    import torch

    import foldc
    from foldc.bench import stream_read_ceiling
    from foldc.bench_layouts import must_read
    from foldc.errors import FoldError
    from foldc.testing import rel_l2
    from foldc.timing import graph_us

    ceiling = stream_read_ceiling()
    rows = []
    for label in labels:
        lay = layout_of(label)
        spec = lay.spec()
        gen = torch.Generator(device="cuda").manual_seed(5)
        q = torch.randn(batch, spec.num_q_heads, spec.head_dim, device="cuda", generator=gen).to(torch.bfloat16)
        raw = [torch.randn(batch, spec.num_kv_heads, tokens, spec.head_dim, device="cuda", generator=gen)
               for _ in range(2)]
        k, v = (foldc.quantize(x, e) if e is not None else x.to(torch.bfloat16) for x, e in zip(raw, (spec.k, spec.v)))
        ref = foldc.attention_reference(q, k, v)
        read = must_read(lay, batch, tokens)
        for name, opts in VARIANTS.items():
            row = dict(label=label, variant=name, shape=f"{batch}x{tokens}")
            try:
                attn = foldc.compile(spec, "sm_90", kernel="gluon", **opts)
                out = attn(q, k, v)
                row["rel_l2"] = rel_l2(out, ref)
                row["us"] = graph_us(lambda: attn(q, k, v))
                row["pct"] = 100 * read / (row["us"] * 1e-6) / ceiling
            except (FoldError, RuntimeError) as e:   # keep going: the row records it
                row["fail"] = repr(e)[:300]
            print(json.dumps(row), flush=True)
            rows.append(row)
    if out_path:
        Path(out_path).write_text(json.dumps(dict(ceiling=ceiling, rows=rows), indent=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--aot", action="store_true", help="CPU: AOT builds of every variant")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--only", default=None, help="comma-separated substrings of the labels")
    ap.add_argument("--shape", default="8x65536")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    labels = spilling_layouts(args.arch)
    if args.only:
        labels = [x for x in labels if any(w.strip() in x for w in args.only.split(","))]
    if args.aot:
        os.environ.pop("TRITON_INTERPRET", None)
        aot(labels, args.arch, args.out)
    else:
        batch, tokens = map(int, args.shape.split("x"))
        gpu(labels, batch, tokens, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
