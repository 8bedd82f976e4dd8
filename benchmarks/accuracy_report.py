"""Attention-output error of quantized KV caches against exact attention, with Hadamard rotation and exact windows.

Rows: INT2/INT4 x K layout x V layout x rotation off/on x windows off/on (sink 64 + recent 256
tokens exact); columns: Gaussian data and outlier-key / structured-value data (foldc.accuracy).
Each cell is the mean over ``--seeds`` data seeds at the paper's shape (32 query heads, 8 KV heads,
head_dim 128, groups of 128). CPU, float64; about a minute with the defaults.

    .venv/bin/python benchmarks/accuracy_report.py              # prints the table, writes docs/accuracy.md
    .venv/bin/python benchmarks/accuracy_report.py --no-write   # print only
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import platform
import sys
import time
from pathlib import Path

import torch

from foldc.accuracy import (DATA_KINDS, PAPER_SHAPE, AccuracyConfig, compare, make_data, quantized_attention,
                            window_mass)
from foldc.reference import attention_reference
from foldc.rotation import Rotation

ROOT = Path(__file__).resolve().parent.parent
LAYOUT_SHORT = {"token": "tok", "channel": "chan"}
ROTATION_SEED = 0


def configs(group: int, sink: int, window: int):
    for bits, k_layout, v_layout, rotate, windows in itertools.product(
            (2, 4), ("token", "channel"), ("token", "channel"), (False, True), (False, True)):
        yield AccuracyConfig(bits, k_layout, v_layout, group, rotate=rotate, rotation_seed=ROTATION_SEED,
                             sink=sink if windows else 0, window=window if windows else 0)


def run(tokens: int, seeds: list[int], group: int, sink: int, window: int):
    data = {(kind, s): make_data(kind, tokens=tokens, seed=s, **PAPER_SHAPE) for kind in DATA_KINDS for s in seeds}
    exact = {key: attention_reference(*qkv) for key, qkv in data.items()}
    rotation = Rotation(PAPER_SHAPE["head_dim"], ROTATION_SEED)  # every rotated row uses this one
    rotated = {key: (rotation.rotate_queries(q), rotation.rotate_keys(k), rotation.rotate_values(v))
               for key, (q, k, v) in data.items()}
    rows = []
    for cfg in configs(group, sink, window):
        cells = {}
        for kind in DATA_KINDS:
            reps = [compare(quantized_attention(*(rotated if cfg.rotate else data)[kind, s], cfg,
                                                prerotated=cfg.rotate), exact[kind, s]) for s in seeds]
            rel = [r.rel_l2 for r in reps]
            cells[kind] = {
                "rel_l2": sum(rel) / len(rel),
                "l2": sum(r.l2 for r in reps) / len(reps),
                "spread": (max(rel) - min(rel)) / (sum(rel) / len(rel)),
            }
        rows.append((cfg, cells))
    context = {kind: {
        "out_norm": sum(compare(exact[kind, s], exact[kind, s]).out_norm for s in seeds) / len(seeds),
        "window_mass": sum(window_mass(data[kind, s][0], data[kind, s][1], sink, window)
                           for s in seeds) / len(seeds),
    } for kind in DATA_KINDS}
    return rows, context


def label(cfg: AccuracyConfig) -> tuple[str, ...]:
    return (f"INT{cfg.bits}", LAYOUT_SHORT[cfg.k_layout], LAYOUT_SHORT[cfg.v_layout],
            "on" if cfg.rotate else "off", "on" if cfg.sink or cfg.window else "off")


def markdown_table(rows) -> str:
    head = ("| bits | K | V | rotation | windows | Gaussian rel L2 | Gaussian L2 | outlier rel L2 | outlier L2 |\n"
            "|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for cfg, cells in rows:
        g, o = cells["gaussian"], cells["outlier"]
        lines.append("| " + " | ".join(label(cfg)) +
                     f" | {g['rel_l2']:.3f} | {g['l2']:.3f} | {o['rel_l2']:.3f} | {o['l2']:.2f} |")
    return "\n".join(lines)


def find(rows, bits, k, v, rotate, windows):
    for cfg, cells in rows:
        windows_on = bool(cfg.sink or cfg.window)
        if (cfg.bits, cfg.k_layout, cfg.v_layout, cfg.rotate, windows_on) == (bits, k, v, rotate, windows):
            return cells
    raise KeyError((bits, k, v, rotate, windows))


def key_figures(rows, context) -> str:
    def rel(kind, *key):
        return find(rows, *key)[kind]["rel_l2"]

    def ratios(kind, change, **fixed):
        """rel error with the change on / off, over every row the change applies to."""
        out = []
        for bits, k, v, r, w in itertools.product((2, 4), ("token", "channel"), ("token", "channel"),
                                                  (False, True), (False, True)):
            key = {"bits": bits, "k": k, "v": v, "rotate": r, "windows": w}
            if key[change] or any(key[f] != val for f, val in fixed.items()):
                continue
            on = dict(key, **{change: True})
            out.append(rel(kind, *on.values()) / rel(kind, *key.values()))
        return min(out), max(out)

    lines = []
    for bits in (2, 4):
        for v in ("token", "channel"):
            a, b = rel("outlier", bits, "token", v, False, False), rel("outlier", bits, "token", v, True, False)
            c = rel("outlier", bits, "channel", v, False, False)
            lines.append(f"- INT{bits}, token-wise K, {v}-wise V, outlier data: rotation takes the relative error "
                         f"from {a:.3f} to {b:.3f} ({a / b:.1f}x less); channel-wise K without rotation: {c:.3f}.")
    lo, hi = ratios("outlier", "rotate", k="channel")
    lines.append(f"- Channel-wise K, outlier data: with rotation the error is {lo:.2f}-{hi:.2f}x the error without.")
    g = {bits: [rel("gaussian", bits, k, v, r, w) for k, v, r, w in itertools.product(
        ("token", "channel"), ("token", "channel"), (False, True), (False, True))] for bits in (2, 4)}
    for bits in (2, 4):
        lines.append(f"- INT{bits}, Gaussian data: relative error {min(g[bits]):.3f}-{max(g[bits]):.3f} in every row.")
    lines.append(f"- Gaussian data, INT2 / INT4 error: {sum(g[2]) / sum(g[4]):.1f}x (mean over rows).")
    for kind in DATA_KINDS:
        lo, hi = ratios(kind, "windows")
        lines.append(f"- Windows, {kind} data: the exact tokens carry {context[kind]['window_mass']:.1%} of the "
                     f"attention weight; with windows the error is {lo:.2f}-{hi:.2f}x the error without.")
    spread = max(c[kind]["spread"] for _, c in rows for kind in DATA_KINDS)
    lines.append(f"- Seed-to-seed spread of one cell's relative error ((max - min) over seeds / mean): up to "
                 f"{spread:.0%}.")
    return "\n".join(lines)


DOC = """# Accuracy of low-bit KV caches: quantization error, rotation and exact windows

foldc's kernels are exact with respect to the dequantized cache (docs/backend.md, H200: median
relative L2 1.8e-3 against float64 with bf16 queries, no worse than bf16 attention on the same
values; the reference paper reports ~1.7e-3 for its kernel). This page measures the other error, the
one the codes cause: attention over the cache a configuration would hold, against exact float64
attention over the **unquantized** keys and values (and the two remedies measured here: Hadamard rotation
of K and V, exact sink and recent windows).

## How it is measured

`foldc/accuracy.py`, float64 on the CPU: optionally rotate q and K, and V (un-rotating the output
after attention) with a randomized Hadamard matrix (`foldc/rotation.py`, seed 0); keep the first
{sink} and last {window} tokens exact when windows are on; quantize the tokens between with
`foldc.quantize` (min-max, round to nearest, fp16 scale and zero, groups of {group}) and dequantize;
softmax attention in float64. The arithmetic is float64, so **these are exact quantization-error
figures**: the codes plus the fp16 storage of scale and zero, nothing from a kernel. A fused bf16
kernel adds its ~2e-3 on top. The windows are kept exact here; a real cache stores them in bf16
(about 2e-3 relative per value, far below every INT2/INT4 figure), and
`foldc.serving.QuantizedKVCache` flushes channel-wise groups whole, so its recent window holds up
to group_size - 1 more tokens than the {window} used here. The data are synthetic (below); they
show the mechanisms, not the error of a particular model.

Shape: batch 1, {q_heads} query heads, {kv_heads} KV heads, head_dim {head_dim}, {tokens} cached
tokens; each cell is the mean over data seeds {seeds}.

- **Gaussian**: q, K, V i.i.d. N(0, 1). Attention is nearly uniform (logits have standard deviation
  1), so the exact output is small (mean per-head norm {g_norm:.3f}).
- **outlier**: q ~ N(0, 1); K ~ N(0, 1) with 4 channels per KV head scaled by 10-20x; V a rank-8
  signal with AR(1) token coefficients (rho 0.9) plus per-channel offsets and noise (std 0.25).
  The outlier channels make attention peaked (mean per-head output norm {o_norm:.2f}).

rel L2 = ||o_hat - o|| / ||o|| over the whole output; L2 = mean over query heads of the plain
distance ||o_hat_h - o_h||_2. L2 scales with the data (see the output norms above), so the
reference paper's "L2 distance ~0.5-0.6 for plain INT2" on its stress test cannot be compared to
these L2 values; compare configurations within a column.

Command ({date}, {machine}, torch {torch_version}, {runtime:.0f} s):

    {command}

## Results

{table}

## Key figures

{figures}

## Reading the table

- **Rotation is the fix for outlier keys under token-wise K.** A token's group spans its channels,
  so a 10-20x channel stretches every group's range and the ordinary channels collapse onto one or
  two codes; the Hadamard rotation spreads each outlier over all 128 channels, and the error drops
  2-4x (key figures). Token-wise K is the layout the reference paper measures its kernels on, so
  rotation is what makes that layout usable on keys with outlier channels.
- **Channel-wise K needs no rotation and is the most accurate K layout on the outlier data**: each
  channel has its own scale, so an outlier channel only costs its own range. Rotation makes it
  no better, and in most rows slightly worse (key figures). A likely reason (a one-off check, not
  part of this script): the rms logit error over all tokens is about the same with and without
  rotation, but weighted by the exact attention it is lower without, because min-max codes
  reproduce each group's extremes (nearly) exactly and with peaked attention the heaviest tokens
  are the extremes of the outlier channels; rotation mixes those channels and gives that up.
- **Gaussian data**: rotation changes nothing systematic (i.i.d. Gaussian data are rotation
  invariant), and INT2 min-max quantization with groups of 128 loses most of the output: one step
  is ~1.7 standard deviations. INT4 is several times more accurate on the same data.
- **Windows protect exactly the attention weight that falls on them.** These synthetic data have
  no attention sinks and no recency bias, so the windows hold ~(64+256)/{tokens} of the weight
  and their effect is small; with channel-wise layouts the sink also shifts every group boundary
  of the body by 64 tokens, which re-draws which tokens share a scale and moves the error a little
  in either direction (the with/without ratios above bracket 1 for the outlier data). In real
  models the first tokens (sinks) and the recent ones carry a large share of the weight, which is
  why the reference work keeps them in bf16: measure that on real activations before relying on
  the synthetic figure.
- The seed spread above is between independent data draws; the on/off comparisons in a row pair
  use the same data, so they are less noisy than that spread suggests.
- **Deploying rotation without touching the kernel** (foldc/rotation.py): rotate K after RoPE,
  before quantize-on-append, and q at decode (one d x d product or fast transform per query head);
  fold the V rotation into W_v and the output un-rotation into W_o offline
  (`fold_into_value_projection`, `fold_into_output_projection`). The sink and recent windows hold
  rotated K and V as well.
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seeds", type=int, default=3, help="data seeds 0..N-1 averaged per cell")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--sink", type=int, default=64)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--out", default=str(ROOT / "docs" / "accuracy.md"))
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    args = ap.parse_args(argv)
    seeds = list(range(args.seeds))
    start = time.perf_counter()
    rows, context = run(args.tokens, seeds, args.group, args.sink, args.window)
    runtime = time.perf_counter() - start
    table, figures = markdown_table(rows), key_figures(rows, context)
    print(table)
    print()
    print(figures)
    print(f"\n{runtime:.1f} s")
    if args.no_write:
        return 0
    cmd = ".venv/bin/python benchmarks/accuracy_report.py" + "".join(
        f" {flag} {value}" for flag, value, default in (
            ("--tokens", args.tokens, 4096), ("--seeds", args.seeds, 3), ("--group", args.group, 128),
            ("--sink", args.sink, 64), ("--window", args.window, 256)) if value != default)
    doc = DOC.format(
        sink=args.sink, window=args.window, group=args.group, tokens=args.tokens, seeds=seeds,
        q_heads=PAPER_SHAPE["num_q_heads"], kv_heads=PAPER_SHAPE["num_kv_heads"], head_dim=PAPER_SHAPE["head_dim"],
        g_norm=context["gaussian"]["out_norm"], o_norm=context["outlier"]["out_norm"],
        date=datetime.date.today().isoformat(), machine=f"{platform.machine()} CPU, {torch.get_num_threads()} threads",
        torch_version=torch.__version__, runtime=runtime, command=cmd, table=table, figures=figures)
    Path(args.out).write_text(doc)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
