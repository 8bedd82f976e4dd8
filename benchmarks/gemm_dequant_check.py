"""Check and time the dequantize-then-dot GEMM template (foldc/backends/triton/gemm_dequant.py) on a
GPU, in one process:

    PYTHONPATH=. python3 benchmarks/gemm_dequant_check.py --out $OUT/dequant [--quick]

1. Correctness through `foldc.compile(spec, target="auto")`: INT2/INT4/INT8 weights, k groups
   32/64/128, fp16/bf16/fp32 scales, fp16 and bf16 activations, m = 17..256 (ragged m and n), each
   against float64 dequantize-then-matmul, beside torch's own dequantize-then-matmul in the
   activation dtype (the bar: at most 2x its error). Fresh random data per case (seed printed).
2. Timing (triton's do_bench, L2 flushed between calls): fp16 cuBLAS ``x @ w.T`` on the dequantized
   weight, the template with the launcher's default tiles and a few others, and the generated
   Triton kernel it replaces, at m = 64..512 for the issue's shapes.
Writes dequant.json and dequant.txt under --out.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

ENCODINGS = ["k-group:4:128", "k-group:4:64", "k-group:4:32", "k-group:2:128", "k-group:2:32", "k-group:8:128",
             "k-group:8:32", "k-group:4:128:bf16", "k-group:4:128:fp32", "k-group:2:64:bf16"]
SHAPES = [(1000, 2048), (4096, 4096)]
ROWS = [17, 64, 100, 256]
TIMED = [(4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192)]
TIMED_ROWS = [64, 128, 256, 512]


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def check(seed: int, quick: bool, log) -> list:
    import foldc
    from foldc.gemm import GemmSpec, parse_gemm_encoding
    from foldc.gemm.reference import gemm_reference, quantize_2d

    gen = torch.Generator().manual_seed(seed)
    out = []
    encs = ENCODINGS[:4] if quick else ENCODINGS
    for enc in encs:
        for n, k in SHAPES:
            spec = GemmSpec(n, k, parse_gemm_encoding(enc, "weight"))
            kern = foldc.compile(spec, target="auto")
            w = quantize_2d((torch.randn(n, k, generator=gen) * 0.05).cuda(), spec.weight)
            wd = w.dequantize(torch.float64)[0, 0]
            for m in ROWS:
                for dtype in (torch.float16, torch.bfloat16):
                    x = torch.randn(m, k, generator=gen).to("cuda", dtype)
                    launch = kern.triton.plan_launch(dtype, m, torch.cuda.get_device_properties(0).multi_processor_count)
                    y = kern(x, w)
                    ref = gemm_reference(x, w)
                    err = rel(y, ref)
                    bar = rel(x @ wd.to(dtype).T, ref)
                    ok = err <= 2 * bar + 1e-6
                    row = dict(enc=enc, n=n, k=k, m=m, dtype=str(dtype), template=launch.template, err=err,
                               torch_err=bar, ok=ok)
                    out.append(row)
                    log(f"{enc:20s} {n}x{k} m={m:3d} {str(dtype):14s} {launch.template:9s} err {err:.2e} "
                        f"torch {bar:.2e} {'ok' if ok else 'FAIL'}")
    return out


SWEEP = [  # (block_m, block_n, num_warps, num_stages or None: as many as fit, up to 4)
    (64, 64, 4, None), (64, 128, 8, None), (128, 128, 8, None), (256, 128, 8, None), (64, 128, 4, None),
    (128, 64, 4, None), (128, 128, 8, 3), (128, 256, 8, None), (256, 128, 8, 2)]


def timing(log, sweep_rows) -> list:
    import time as _time

    import triton
    from triton.testing import do_bench

    import foldc
    from foldc.backends.runtime.modules import load_module
    from foldc.backends.triton.gemm_dequant import SOURCE, dequant_config
    from foldc.gemm import GemmSpec, parse_gemm_encoding
    from foldc.gemm.reference import quantize_2d

    module = load_module(SOURCE, False)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for enc in ("k-group:4:128", "k-group:2:128"):
        for n, k in TIMED:
            spec = GemmSpec(n, k, parse_gemm_encoding(enc, "weight"))
            w = quantize_2d((torch.randn(n, k) * 0.05).cuda(), spec.weight)
            w16 = w.dequantize(torch.float16)[0, 0].contiguous()
            codes, s, z = w.codes[0, 0], w.scale[0, 0], w.zero[0, 0]
            kern = foldc.compile(spec, target="auto")
            for m in TIMED_ROWS:
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                ref = (x.float() @ w16.float().T)
                row = dict(enc=enc, n=n, k=k, m=m)
                row["cublas_us"] = do_bench(lambda: x @ w16.T) * 1e3
                launch = kern.triton.plan_launch(torch.float16, m, sms)
                y = kern(x, w)
                consts = dict(launch.constants)
                row["default"] = {k_: v for k_, v in consts.items() if k_ not in ("ASM", "CONS")}
                row["template"] = launch.template
                row["default_err"] = rel(y, ref)
                row["default_us"] = do_bench(lambda: kern(x, w)) * 1e3
                torch.cuda.synchronize()
                t0 = _time.perf_counter()
                for _ in range(200):
                    kern(x, w)
                row["host_us"] = (_time.perf_counter() - t0) / 200 * 1e6
                torch.cuda.synchronize()
                if not rows:   # where the eager call's host time goes (once)
                    import cProfile
                    import io
                    import pstats
                    prof = cProfile.Profile()
                    prof.enable()
                    for _ in range(200):
                        kern(x, w)
                    prof.disable()
                    torch.cuda.synchronize()
                    buf = io.StringIO()
                    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
                    log(buf.getvalue())
                sweep = []
                tile = kern.triton.dequant_tile(torch.float16, m)
                configs = SWEEP if (enc, m) in sweep_rows or sweep_rows == "all" else SWEEP[:4]
                for bm, bn, warps, stages in configs:
                    cfg = dequant_config(tile, m, n, sms, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
                    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
                    for split in sorted({1, cfg["split_k"]}):
                        for asm in ((1, 0) if (bm == 64 and bn == 128 and warps == 8) else (1,)):
                            c = dict(consts, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=cfg["num_stages"],
                                     SPLIT_K=split)
                            if not asm:
                                c["ASM"], c["CONS"] = "", ""
                            yy = torch.empty(m, n, device="cuda", dtype=torch.float16)
                            ws = torch.empty(m, n, device="cuda", dtype=torch.float32)
                            grid = (tiles, split)

                            def go():
                                if split > 1:
                                    ws.zero_()
                                    module.foldc_gemm_dequant[grid](x, x.stride(0), codes, codes.stride(0), s, z,
                                                                    s.stride(0), ws, ws.stride(0), m, n, **c)
                                    yy.copy_(ws)
                                else:
                                    module.foldc_gemm_dequant[grid](x, x.stride(0), codes, codes.stride(0), s, z,
                                                                    s.stride(0), yy, yy.stride(0), m, n, **c)
                            label = dict(bm=bm, bn=bn, w=warps, st=c["num_stages"], split=split, asm=asm)
                            try:
                                go()
                                e = rel(yy, ref)
                                us = do_bench(go) * 1e3
                                sweep.append([label, round(us, 2), e])
                                if e > 1e-2:
                                    log(f"  WRONG {label} err {e:.2e}")
                            except Exception as ex:  # noqa: BLE001
                                sweep.append([label, f"{type(ex).__name__}: {str(ex)[:80]}", None])
                row["sweep"] = sweep
                ok = [s_ for s_ in sweep if isinstance(s_[1], float) and s_[2] < 1e-2]
                best = sorted(ok, key=lambda s_: s_[1])[:3]
                log(f"{enc} {n}x{k} m={m}: cuBLAS {row['cublas_us']:.1f} kern {row['default_us']:.1f} "
                    f"(host {row['host_us']:.1f}) best " + " | ".join(f"{b[1]} {b[0]}" for b in best)
                    + f" => x{row['cublas_us'] / best[0][1]:.2f}" if best else "")
                rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/dequant")
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--sweep-all", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)
    log(f"seed {a.seed}; {torch.cuda.get_device_name()}; torch {torch.__version__}")
    result = {"seed": a.seed}
    if not a.skip_check:
        result["checks"] = check(a.seed, a.quick, log)
        log(f"checks: {sum(r['ok'] for r in result['checks'])}/{len(result['checks'])} within the bar")
    result["times"] = timing(log, "all" if a.sweep_all else {("k-group:4:128", 64), ("k-group:4:128", 256)})
    (out / "dequant.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "dequant.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
