"""The fastest plain read of N bytes on this GPU, timed as the GEMV is: what a GEMV that reads those bytes can
approach at that size (a kernel launch's start and drain, not only the bandwidth, set a small read's time).

    PYTHONPATH=. python3 benchmarks/read_floor.py --out $OUT/read_floor.json

For the byte counts of the GEMV's timed shapes (INT4 and INT2 g128: codes, scales, zeros; fp16 weights for
cuBLAS), a Triton kernel reads a buffer of that size once (each program sums BLOCK contiguous int32 words, 16
bytes a lane per load, and writes one word), at a few BLOCK / num_warps choices; the best is the floor. Timing as
benchmarks/gemv_check.py: CUDA graphs of calls on distinct copies (cold L2), µs per call. Prints µs, TB/s, % of
the streaming-read ceiling measured in the same process (`gemv_check.read_ceiling`; it was a fixed 4.46 TB/s, the
H200's, on every card), and the time that 75% of the ceiling would need.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv_check import TIMED, copies, graph_us, read_ceiling  # noqa: E402


@triton.jit
def read_words(src, out, n_words, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(src + offs, mask=offs < n_words, other=0)
    tl.store(out + tl.program_id(0), tl.sum(v, axis=0))


CHOICES = [(2048, 4), (4096, 4), (4096, 8), (8192, 8), (16384, 8)]


def floor_us(nbytes: int) -> dict:
    n_words = -(-nbytes // 4)
    src = torch.randint(-1000, 1000, (n_words,), dtype=torch.int32, device="cuda")
    bufs = copies(src, n_words * 4)
    best = None
    for block, warps in CHOICES:
        grid = (triton.cdiv(n_words, block),)
        out = torch.empty(grid[0], dtype=torch.int32, device="cuda")
        read_words[grid](src, out, n_words, BLOCK=block, num_warps=warps)
        want = src.view(-1)[:grid[0] * block] if n_words % block == 0 else None
        if want is not None:   # the kernel read every word: its sums match torch's
            assert torch.equal(out, want.view(grid[0], block).sum(1, dtype=torch.int32)), (block, warps)
        us = graph_us([lambda b=b, o=out, g=grid, bl=block, w=warps: read_words[g](b, o, n_words, BLOCK=bl,
                                                                                       num_warps=w) for b in bufs])
        if best is None or us < best["us"]:
            best = {"us": us, "block": block, "num_warps": warps}
    del bufs
    best["bytes"] = nbytes
    best["tbs"] = nbytes / (best["us"] * 1e-6) / 1e12
    best["pct"] = 100 * nbytes / (best["us"] * 1e-6) / read_ceiling()
    best["us_at_75pct"] = nbytes / (0.75 * read_ceiling()) * 1e6
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/read_floor.json")
    args = ap.parse_args(argv)
    from foldc.backends.gluon.gemv_launch import gemv_bytes
    from foldc.gemm import GemmSpec, parse_gemm_encoding

    rows = []
    for n, k in TIMED:
        for what in ("k-group:4:128", "k-group:2:128", "fp16"):
            nbytes = n * k * 2 if what == "fp16" else gemv_bytes(GemmSpec(n, k, parse_gemm_encoding(what, "weight")))
            row = {"n": n, "k": k, "weight": what, **floor_us(nbytes)}
            rows.append(row)
            print(f"{n:5} x {k:5} {what:14} {nbytes / 1e6:7.1f} MB: {row['us']:6.1f} µs {row['tbs']:.2f} TB/s "
                  f"({row['pct']:.0f}%; 75% would be {row['us_at_75pct']:.1f} µs) block {row['block']} "
                  f"warps {row['num_warps']}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "ceiling_tb_s": read_ceiling() / 1e12,
                                          "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
