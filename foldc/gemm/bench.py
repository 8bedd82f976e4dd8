"""Benchmark of the generated GEMM/GEMV kernels against torch, after checking each one.

On the H200 (device tool), from the repository root, one process, under 6 minutes:

    PYTHONPATH=. python3 -m foldc bench --gemm --out $OUT/gemm

For every case (tokens 1, 16, 256; weights N x K = 4096 x 4096 and 14336 x 4096; INT4 and INT2
in groups of 128, INT8 per output channel, INT8 x INT8 with zero points) it

1. checks the foldc kernel against the float64 reference (dequantize, then matmul in float64),
   next to the error of torch's bf16 dequantize-then-matmul on the same values (the bar);
2. times with ``triton.testing.do_bench``: the foldc kernel (tile sizes tuned per case from a few
   candidates, the chosen one timed again for the table), the same generated kernel with
   ``fold_policy="dequant"`` (every weight value reconstructed in the kernel: what the fold saves), torch
   dequantize-then-matmul (unpack, s*c + z to bf16, then ``x @ w.T``), and a bf16 ``x @ w.T`` on weights
   already dequantized (no quantization at all);
3. prints a table and writes ``gemm_bench.json`` (and the table as ``gemm_bench.txt``) under --out.

The INT8 x INT8 case times the GEMM on activations already quantized per token (quantizing x is
not included, for either side). ``--cpu`` runs a tiny version under Triton's interpreter (fp16)
to check the script itself: correctness only, times are not meaningful.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

import foldc
from foldc.encoding import unpack_codes
from foldc.gemm import GemmSpec, parse_gemm_encoding
from foldc.gemm.reference import gemm_reference, quantize_2d

ENCODINGS = {  # name -> (weight, activation)
    "int4 g128": ("k-group:4:128", None),
    "int2 g128": ("k-group:2:128", None),
    "int8 per-channel": ("per-channel:8", None),
    "int8 x int8": ("per-channel:8", "per-token:8"),
}
SHAPES = ((4096, 4096), (14336, 4096))   # (N, K): output channels x input channels
TOKENS = (1, 16, 256)
DEADLINE_S = 270                         # stop timing new cases after this (the limit is 6 minutes)
#: a kernel passes when its error is at most this multiple of torch bf16 dequantize-then-matmul's
#: error on the same values (plus the rounding of one bf16 output)
TOLERANCE = 2.0


def torch_dequantize(t, dtype: torch.dtype) -> torch.Tensor:
    """[rows, k] values of a `quantize_2d` AffineTensor in ``dtype``: unpack, then s*c + z per group."""
    enc = t.encoding
    codes = unpack_codes(t.codes[0, 0], enc.bits)           # uint8 [rows, k]
    rows, k = codes.shape
    s, z = t.scale[0, 0].to(dtype), t.zero[0, 0].to(dtype)  # [rows, k / g]
    g = enc.group_size
    return (codes.view(rows, k // g, g).to(dtype) * s[..., None] + z[..., None]).view(rows, k)


def weight_bytes(t) -> int:
    return t.codes.numel() + t.scale.numel() * t.scale.element_size() * 2


def rel_l2(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def candidates(m: int, cpu: bool, gemv: bool = True) -> list[dict]:
    """Launch configs tried per case (the first is the launcher's default). ``gemv``: plain activations,
    whose calls of up to 16 rows run the register-operand GEMV where the plan lowers to it."""
    if cpu:
        return [{}]
    if m <= 16 and gemv:  # rows per program, stage depth
        return [{}, {"block_rows": 32, "gemv_stages": 2}, {"gemv_sub": 1, "gemv_stages": 4}]
    if m <= 16:  # the Triton kernel: more bytes in flight per program (block_k) or more programs (block_n)
        return [{}, {"block_n": 64, "block_k": 128}, {"block_n": 64, "block_k": 128, "split_k": 4}]
    if m <= 64:
        return [{}, {"block_n": 128, "num_warps": 8}]
    return [{}, {"block_m": 128, "block_n": 128, "num_warps": 8}, {"block_m": 64, "block_n": 64, "num_warps": 4}]


def run_case(name, n, k, m, device, dtype, bench, cpu, seed) -> dict:
    weight, act = ENCODINGS[name]
    spec = GemmSpec(n, k, parse_gemm_encoding(weight, "weight"), parse_gemm_encoding(act, "activation"), m=m)
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) + 0.1).to(device)
    w = (torch.randn(n, k, generator=gen) * 0.02 + 0.001).to(device)
    wq = quantize_2d(w, spec.weight)
    xq = quantize_2d(x, spec.activation) if spec.activation else x.to(dtype)
    target = "interpret" if cpu else "auto"
    row = {"case": name, "n": n, "k": k, "tokens": m, "folds": foldc.plan(spec).folds}

    # 1. correctness against float64 dequantize-then-matmul
    ref = gemm_reference(xq, wq)
    x_vals = torch_dequantize(xq, dtype) if spec.activation else xq
    w_vals = torch_dequantize(wq, dtype)
    baseline = x_vals @ w_vals.T
    best = None
    for cfg in candidates(m, cpu, spec.activation is None):
        try:
            kernel = foldc.compile(spec, target=target, out_dtype=dtype, **cfg)
            out = kernel(xq, wq)
        except Exception as e:  # noqa: BLE001 - a candidate that does not compile is skipped, and said so
            row.setdefault("skipped_configs", []).append(f"{cfg}: {type(e).__name__}: {str(e)[:120]}")
            continue
        if best is None:
            row["error"] = rel_l2(out, ref)
            row["torch_bf16_error"] = rel_l2(baseline, ref)
            row["ok"] = bool(torch.isfinite(out).all()) and row["error"] <= TOLERANCE * row["torch_bf16_error"] + 4e-3
            row["folds_kernel"] = (kernel.plan_for(dtype, m) if hasattr(kernel, "uses_gemv") else
                                   kernel.plan_for(dtype)).folds
            row["kernel"] = "gluon-gemv" if getattr(kernel, "uses_gemv", lambda *a: False)(xq, wq) else "triton"
        if not bench:
            best = (0.0, cfg, kernel)
            break
        ms = bench(lambda: kernel(xq, wq, out=out))
        if best is None or ms < best[0]:
            best = (ms, cfg, kernel)
    if best is None:
        row["ok"] = False
        return row
    row["config"] = best[1]
    if not bench:
        return row

    # 2. timings: the chosen config timed afresh (the least of a few noisy timings, one per config, would count
    # its luck too: torch's rows are timed once)
    row["foldc_ms"] = bench(lambda: best[2](xq, wq, out=out))
    row["foldc_selection_ms"] = best[0]
    if row["folds_kernel"]["w"] != "dequant":  # the same generated kernel reconstructing every weight value
        deq = foldc.compile(spec, target=target, out_dtype=dtype, fold_policy="dequant", **best[1])
        deq_out = deq(xq, wq)
        row["foldc_dequant_error"] = rel_l2(deq_out, ref)
        row["ok"] = row["ok"] and row["foldc_dequant_error"] <= TOLERANCE * row["torch_bf16_error"] + 4e-3
        row["foldc_dequant_ms"] = bench(lambda: deq(xq, wq, out=deq_out))
    if spec.activation:
        row["torch_dequant_ms"] = bench(lambda: torch_dequantize(xq, dtype) @ torch_dequantize(wq, dtype).T)
    else:
        row["torch_dequant_ms"] = bench(lambda: xq @ torch_dequantize(wq, dtype).T)
    xb, wb = x.to(dtype), w_vals.contiguous()
    row["bf16_ms"] = bench(lambda: xb @ wb.T)
    row["weight_bytes"] = weight_bytes(wq)
    row["foldc_weight_GBps"] = row["weight_bytes"] / (row["foldc_ms"] * 1e-3) / 1e9
    row["bf16_weight_GBps"] = n * k * 2 / (row["bf16_ms"] * 1e-3) / 1e9
    return row


def gemv_rows_ceiling(rows: list[dict], stream_read: float) -> float:
    """The read ceiling of a GEMV table's run (the rows of benchmarks/gemv_check.py: n, k, each kernel's graph µs) by
    `foldc.bench.run_ceiling` (the streaming read, or the fastest read of any row where one was faster: fp16 cuBLAS on
    n x k x 2 bytes, torch's INT4 kernel and foldc's on their codes, scales and zeros), and every foldc row's % of
    it, set in ``rows``; returns it."""
    from foldc.backends.gluon.gemv_launch import gemv_bytes
    from foldc.bench import run_ceiling

    def nbytes(r, tag):
        return gemv_bytes(GemmSpec(r["n"], r["k"], parse_gemm_encoding(f"k-group:{tag}:128", "weight")))
    reads = []
    for r in rows:
        reads.append((r["n"] * r["k"] * 2, r.get("fp16_graph_us")))
        reads.append((nbytes(r, 4), r.get("torch_int4_graph_us")))   # its bf16 scale-and-zero pairs: as many bytes
        reads += [(nbytes(r, tag), r.get(f"int{tag}_{dt}_graph_us")) for tag in (4, 2) for dt in ("fp16", "bf16")]
    ceiling = run_ceiling(stream_read, reads)
    for r in rows:
        r["ceiling_tb_s"] = ceiling / 1e12
        for tag in (4, 2):
            for dt in ("fp16", "bf16"):
                us = r.get(f"int{tag}_{dt}_graph_us")
                if us:
                    r[f"int{tag}_{dt}_graph_pct"] = 100 * nbytes(r, tag) / (us * 1e-6) / ceiling
    return ceiling


def table(rows) -> str:
    head = (f"{'case':<17} {'N x K':<11} {'tok':>4} {'fold':<9} {'ok':<3} {'err':>8} {'bf16 err':>8} "
            f"{'foldc ms':>9} {'in-k deq':>9} {'deq+mm ms':>9} {'bf16 ms':>8} {'vs deq':>6} {'vs bf16':>7} {'GB/s':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        fold = r["folds"]["w"]
        t = lambda key: f"{r[key]:.4f}" if key in r else "-"  # noqa: E731
        speed = lambda key: f"{r[key] / r['foldc_ms']:.2f}x" if key in r and "foldc_ms" in r else "-"  # noqa: E731
        if "skipped" in r:   # not run (deadline): say so rather than print it as a failure
            lines.append(f"{r['case']:<17} {r['n']}x{r['k']:<6} {r['tokens']:>4} not run: {r['skipped']}")
            continue
        lines.append(f"{r['case']:<17} {r['n']}x{r['k']:<6} {r['tokens']:>4} {fold:<9} {'yes' if r.get('ok') else 'NO':<3} "
                     f"{r.get('error', math.nan):>8.1e} {r.get('torch_bf16_error', math.nan):>8.1e} {t('foldc_ms'):>9} "
                     f"{t('foldc_dequant_ms'):>9} "
                     f"{t('torch_dequant_ms'):>9} {t('bf16_ms'):>8} {speed('torch_dequant_ms'):>6} "
                     f"{speed('bf16_ms'):>7} {r.get('foldc_weight_GBps', 0):>6.0f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="foldc bench --gemm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/gemm", help="folder for gemm_bench.json and gemm_bench.txt")
    ap.add_argument("--cpu", action="store_true", help="tiny shapes under Triton's interpreter (checks the script)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline", type=float, default=DEADLINE_S,
                    help=f"seconds after which no new case starts (default {DEADLINE_S})")
    args = ap.parse_args(argv)
    if not args.deadline > 0:   # -1 ran no case (exit 0); NaN was never reached (inf: no deadline)
        ap.error(f"--deadline={args.deadline:g}: give the seconds after which no new case starts, a positive number "
                 f"(default {DEADLINE_S})")
    t0 = time.time()
    if args.cpu or torch.cuda.is_available():
        from foldc.options import cli_out_dir

        cli_out_dir(ap, args.out)
    if args.cpu:
        device, dtype = "cpu", torch.float16
        shapes, tokens = ((128, 256),), (1, 16)

        def bench(fn):  # wall time of one call: exercises the timing path, not a measurement
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
    else:
        if not torch.cuda.is_available():
            print("no CUDA GPU: run with --cpu for the interpreter check", file=sys.stderr)
            return 2
        import triton.testing

        device, dtype = "cuda", torch.bfloat16
        shapes, tokens = SHAPES, TOKENS

        def bench(fn):
            return triton.testing.do_bench(fn, warmup=10, rep=40)
    rows = []
    for n, k in shapes:
        for name in ENCODINGS:
            for m in tokens:
                if time.time() - t0 > args.deadline:
                    rows.append({"case": name, "n": n, "k": k, "tokens": m, "folds": {"w": "-"},
                                 "skipped": f"deadline of {args.deadline:g} s reached"})
                    continue
                row = run_case(name, n, k, m, device, dtype, bench, args.cpu, args.seed + len(rows))
                rows.append(row)
                print(json.dumps(row), flush=True)
    text = table(rows)
    print(text)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "seconds": time.time() - t0}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm_bench.json").write_text(json.dumps({"env": env, "rows": rows}, indent=2))
    (out / "gemm_bench.txt").write_text(text + "\n")
    print(f"wrote {out}/gemm_bench.json and gemm_bench.txt in {env['seconds']:.0f} s")
    bad = [r for r in rows if "ok" in r and not r["ok"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
