"""Check and time the register-operand GEMV (foldc/backends/gluon/gemv.py) on a GPU, in one process.

    PYTHONPATH=. python3 benchmarks/gemv_check.py --out $OUT/gemv [--quick]

1. Correctness: for each weight encoding (INT2/INT4/INT8, k groups 32/64/128, per channel, fp16,
   bf16 and fp32 scales), odd and round shapes, m = 1..16, fp16 and bf16 activations, default and
   forced split-k: the kernel against the float64 reference (dequantize, then matmul), next to the
   error of torch's own dequantize-then-matmul in the activation dtype (the bar). Fresh random
   data per case (the seed is printed).
2. Timing (CUDA graphs of calls on distinct weight copies, so no launch overhead and a cold L2):
   for the issue's shapes, fp16 cuBLAS ``x @ w.T``, torch's INT4 kernel ``_weight_int4pack_mm``
   (bf16 x, g128), the generated Triton kernel, and the register-operand GEMV INT4 and INT2 g128
   (the best of a few launch choices, each checked against float64 first; then fp16 and bf16 x),
   at m = 1 and 16; percent of the run's read ceiling on the bytes each one must read (`apply_ceiling`: the
   faster of a streaming read measured in the same process, `read_ceiling`, and the fastest read of any row,
   cuBLAS's and torch's included; it was a fixed 4.46 TB/s, the H200's, on every card).
``--quick`` checks fewer encodings and shapes (the timing is the same).
Writes gemv_check.json and gemv_check.txt under --out.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from foldc.gemm.bench import gemv_rows_ceiling as apply_ceiling   # the run's ceiling and every row's %

#: bytes/s the tables of docs/gemm.md up to 2026-12-07 divided by on every card (an H200's streaming read); a run
#: measures its own now (`read_ceiling`), e.g. ``--ceiling 4.46`` to compare with those tables
DOCS_CEILING = 4.46e12
_MEASURED: dict = {}
ENCODINGS = ["k-group:4:128", "k-group:4:64", "k-group:4:32", "k-group:2:128", "k-group:2:64", "k-group:2:32",
             "k-group:8:128", "k-group:8:32", "per-channel:8", "per-channel:4", "per-channel:2",
             "k-group:4:128:bf16", "k-group:2:128:fp32", "k-group:4:16"]
SHAPES = [(1000, 2048), (4096, 4096), (96, 1536)]
ROWS = [1, 3, 8, 9, 16]
TIMED = [(4096, 14336), (28672, 8192), (14336, 4096), (4096, 4096)]   # the targets first


def read_ceiling(tb_s: float | None = None) -> float:
    """Bytes/s of a streaming read on this GPU (`foldc.bench.stream_read_ceiling`), measured once per process, or
    ``tb_s`` TB/s where given: every GEMV script's % is of the card it ran on (the fixed 4.46 TB/s of an H200 put the
    H100's runs, whose read is about 2.99 TB/s, at 0.67x their share)."""
    if tb_s:
        return tb_s * 1e12
    if "bytes_s" not in _MEASURED:
        from foldc.bench import stream_read_ceiling

        _MEASURED["bytes_s"] = stream_read_ceiling()
    return _MEASURED["bytes_s"]


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def dequantize(t, dtype):
    from foldc.encoding import unpack_codes

    codes = unpack_codes(t.codes[0, 0], t.encoding.bits)
    rows, k = codes.shape
    g = t.encoding.group_size
    s, z = t.scale[0, 0].to(dtype), t.zero[0, 0].to(dtype)
    return (codes.view(rows, k // g, g).to(dtype) * s[..., None] + z[..., None]).view(rows, k)


def check(seed: int, quick: bool) -> list[dict]:
    import foldc
    from foldc.gemm import GemmSpec, parse_gemm_encoding
    from foldc.gemm.reference import gemm_reference, quantize_2d

    rows = []
    gen = torch.Generator().manual_seed(seed)
    for enc in ENCODINGS[:4] if quick else ENCODINGS:
        for n, k in SHAPES[::2] if quick else SHAPES:
            spec = GemmSpec(n, k, parse_gemm_encoding(enc, "weight"))
            w = (torch.randn(n, k, generator=gen) * 0.05 + 0.01 * torch.randn(n, 1, generator=gen)).cuda()
            wq = quantize_2d(w, spec.weight)
            for m in (1, 9) if quick else ROWS:
                for dtype in (torch.float16, torch.bfloat16):
                    x = (torch.randn(m, k, generator=gen) * 3 + 0.2).to("cuda", dtype)
                    ref = gemm_reference(x, wq)
                    bar = rel(x @ dequantize(wq, dtype).T, ref)
                    for split in (None, 3):
                        row = {"enc": enc, "n": n, "k": k, "m": m, "dtype": str(dtype)[6:], "split": split}
                        try:
                            kern = foldc.compile(spec, target="auto", gemv_split=split)
                            lowered, why = kern.gemv.lowers(dtype, m)
                            if not lowered:
                                row.update(ok=True, not_lowered=why)
                                rows.append(row)
                                continue
                            y = kern(x, wq)
                            torch.cuda.synchronize()
                            row.update(err=rel(y, ref), bar=bar)
                            row["ok"] = bool(torch.isfinite(y).all()) and row["err"] <= 2 * bar + 2e-3
                        except Exception as e:  # noqa: BLE001 - reported per case
                            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
                        rows.append(row)
                        if not row["ok"]:
                            print("FAIL", json.dumps(row), flush=True)
    return rows


def int4pack(wq):
    """torch's INT4 tinygemm weight from a foldc k-group:4 weight: the same values (w = (q - 8) s + z')."""
    from foldc.encoding import unpack_codes

    q = unpack_codes(wq.codes[0, 0], 4).to(torch.int32)
    packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 8)
    s, z = wq.scale[0, 0].float(), wq.zero[0, 0].float()
    sz = torch.stack([s, z + 8 * s], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return packed, sz


def graph_us(fns, reps: int = 4) -> float:
    """µs per call of ``fns`` (calls on distinct weight copies, so the L2 holds none of them) replayed
    ``reps`` times in one CUDA graph: no launch overhead, cold weights."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for fn in fns:
                fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (reps * len(fns)))
    return best


def copies(t, nbytes: int, total: int = 400 << 20) -> list:
    """Enough clones of ``t`` (a tensor or an AffineTensor) to exceed the L2 several times over."""
    from foldc.encoding import AffineTensor

    count = max(2, -(-total // nbytes))
    if isinstance(t, AffineTensor):
        return [AffineTensor(t.codes.clone(), t.scale.clone(), t.zero.clone(), t.encoding, t.shape[-1])
                for _ in range(count)]
    return [t.clone() for _ in range(count)]


def timing(seed: int, quick: bool, save=lambda rows: None, defaults_only: bool = False,
           stream_read: float | None = None) -> list[dict]:
    import foldc
    from foldc.backends.gluon.gemv_launch import gemv_bytes
    from foldc.gemm import GemmSpec, parse_gemm_encoding
    from foldc.gemm.reference import gemm_reference, quantize_2d

    stream_read = stream_read or read_ceiling()
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n, k in TIMED:
        w = (torch.randn(n, k, generator=gen) * 0.05).cuda()
        w16 = w.half()
        for m in (1, 16):
            x = (torch.randn(m, k, generator=gen) + 0.1).cuda()
            row = {"n": n, "k": k, "m": m}
            xh, xb = x.half(), x.bfloat16()
            row["fp16_graph_us"] = graph_us([lambda t=t: torch.mm(xh, t.T) for t in copies(w16, n * k * 2)])
            for enc in ("k-group:4:128", "k-group:2:128"):
                spec = GemmSpec(n, k, parse_gemm_encoding(enc, "weight"))
                wq = quantize_2d(w, spec.weight)
                nbytes = gemv_bytes(spec)
                tag = enc.split(":")[1]
                if tag == "4":
                    packed, sz = int4pack(wq)
                    y = torch._weight_int4pack_mm(xb, packed, 128, sz)
                    row["torch_int4_err"] = rel(y, gemm_reference(xb, wq))
                    pk = copies(packed, packed.numel() * packed.element_size())
                    row["torch_int4_graph_us"] = graph_us([lambda p=p: torch._weight_int4pack_mm(xb, p, 128, sz)
                                                           for p in pk])
                if tag == "2" and m == 16:
                    continue
                cands = [{"block_rows": br, "gemv_stages": st, "gemv_sub": sb}
                         for br, st, sb in ((16, 4, None), (16, 3, None), (32, 3, None), (16, 2, 4))]
                # a register cap without spills in the chunk loop (AOT: 128 at 4 stages; 104-120 spill)
                cands.append({"block_rows": 16, "gemv_stages": 4, "gemv_maxnreg": 128})
                if defaults_only:
                    cands = [{}]
                best = None
                for opts in cands + ([] if defaults_only else [None]):
                    if opts is None:   # the best again with twice its split
                        opts = dict(best[1], gemv_split=2 * best[3])
                    kern = foldc.compile(spec, target="auto", kernel="gluon", **opts)
                    yy = kern(xh, wq)
                    err = rel(yy, gemm_reference(xh, wq))
                    if not err < 1e-2:
                        row[f"int{tag}_bad_{json.dumps(opts)}"] = err
                        continue
                    us = graph_us([lambda c=c: kern(xh, c, out=yy) for c in copies(wq, nbytes)])
                    split = kern.gemv.plan_launch(xh.dtype, m, torch.cuda.get_device_properties(0).multi_processor_count).grid[1]
                    row.setdefault(f"int{tag}_sweep", []).append((opts, split, round(us, 2)))
                    if best is None or us < best[0]:
                        best = (us, opts, err, split)
                for dt, xx in (("fp16", xh), ("bf16", xb)):
                    kern = foldc.compile(spec, target="auto", kernel="gluon", **best[1])
                    yy = kern(xx, wq)
                    err = rel(yy, gemm_reference(xx, wq))
                    us = graph_us([lambda c=c: kern(xx, c, out=yy) for c in copies(wq, nbytes)])
                    row[f"int{tag}_{dt}_graph_us"], row[f"int{tag}_{dt}_opts"], row[f"int{tag}_{dt}_err"] = us, best[1], err
                if not defaults_only:
                    triton_k = foldc.compile(spec, target="auto", kernel="triton")
                    yt = triton_k(xh, wq)
                    row[f"int{tag}_triton_graph_us"] = graph_us([lambda c=c: triton_k(xh, c, out=yt)
                                                                 for c in copies(wq, nbytes)])
            out.append(row)
            apply_ceiling(out, stream_read)   # every row so far against the fastest read so far
            print(json.dumps(row), flush=True)
            save(out)
    return out


def graph_table(rows) -> str:
    f = lambda r, key: f"{r[key]:.1f}" if r.get(key) is not None else "-"  # noqa: E731
    head = (f"{'N x K':<12} {'m':>2} {'fp16':>6} {'torch4':>6} {'int4 f16':>8} {'%ceil':>5} {'int4 b16':>8} "
            f"{'int2 f16':>8} {'%ceil':>5} {'vs torch4':>9} {'int4 vs fp16':>12} {'int2 vs fp16':>12} "
            f"{'err int4':>8} {'err torch4':>10}")
    ceiling = f"; % of {rows[0]['ceiling_tb_s']:.2f} TB/s" if rows and "ceiling_tb_s" in rows[0] else ""
    lines = [f"CUDA graphs, cold L2 (µs per call); err: rel. L2 vs float64 with bf16 x, foldc INT4 and torch INT4"
             f"{ceiling}", head]
    for r in rows:
        g4, g2 = r.get("int4_fp16_graph_us"), r.get("int2_fp16_graph_us")
        v4 = r["torch_int4_graph_us"] / g4 if g4 and r.get("torch_int4_graph_us") else 0
        lines.append(f"{r['n']}x{r['k']:<7} {r['m']:>2} {f(r, 'fp16_graph_us'):>6} {f(r, 'torch_int4_graph_us'):>6} "
                     f"{f(r, 'int4_fp16_graph_us'):>8} {f(r, 'int4_fp16_graph_pct'):>5} {f(r, 'int4_bf16_graph_us'):>8} "
                     f"{f(r, 'int2_fp16_graph_us'):>8} {f(r, 'int2_fp16_graph_pct'):>5} {v4:>8.2f}x "
                     f"{r['fp16_graph_us'] / g4 if g4 else 0:>11.2f}x {r['fp16_graph_us'] / g2 if g2 else 0:>11.2f}x "
                     f"{r.get('int4_bf16_err', 0):>8.1e} {r.get('torch_int4_err', 0):>10.1e}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/gemv")
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--defaults-only", action="store_true", help="time the launcher's defaults only (no sweep, "
                    "no Triton kernel)")
    ap.add_argument("--ceiling", type=float, default=None, help="TB/s of the streaming read to take (default: "
                    "measured in this run; 4.46 for the docs' tables of 2026-12-04)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    print(f"seed {args.seed}", flush=True)
    checks = [] if args.skip_check else check(args.seed, args.quick)
    bad = [r for r in checks if not r["ok"]]
    print(f"correctness: {len(checks) - len(bad)}/{len(checks)} ok in {time.time() - t0:.0f} s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save(rows):   # after every shape: a run cut short keeps what it measured
        (out / "gemv_check.json").write_text(json.dumps({"checks": checks, "times": rows}, indent=1))

    stream_read = read_ceiling(args.ceiling)
    times = timing(args.seed, args.quick, save, args.defaults_only, stream_read)
    text = graph_table(times)
    print(text)
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "seed": args.seed,
           "seconds": time.time() - t0, "stream_read_tb_s": stream_read / 1e12,
           "ceiling_tb_s": times[0]["ceiling_tb_s"] if times else None}
    (out / "gemv_check.json").write_text(json.dumps({"env": env, "checks": checks, "times": times}, indent=1))
    (out / "gemv_check.txt").write_text(text + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
