"""A variant of the register-operand GEMV that reads a tiled copy of the weight's codes: each program's chunk (BN rows
x NB bytes) lies in one contiguous run of memory, instead of BN runs of NB bytes one weight row apart. Not
production code: it asks whether the code words' spread over DRAM pages, not their count, holds the GEMV at about
two thirds of the read ceiling at 28672 x 8192 (Nsight Compute on the H100: its warps wait on their copies).

    PYTHONPATH=. python3 benchmarks/gemv_tiled.py --out $OUT/gemv_tiled.json

Per case: production on the weight as it is, then this variant on the tiled copy (rows padded to whole blocks),
both on production's launch and checked against float64; timing as benchmarks/gemv_check.py (CUDA graphs over
distinct copies, cold L2).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from triton.experimental import gluon
from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl

import foldc.backends.gluon.gemv as production
from foldc.bench import rebound

sys.path.insert(0, str(Path(__file__).resolve().parent))


@constexpr_function
def chunk_words(W, BN):
    """A chunk of a row BN * W words after the one before it (the tiled copy)."""
    return int(BN) * int(W)


@gluon.jit
def code_rows(WC, n0, N, stride_wc, BN: gl.constexpr, W: gl.constexpr, NCH: gl.constexpr):
    """production.code_rows in the tiled copy: block b's chunk 0 at words b * NCH * BN * W, row i of the block W
    words after row i - 1 (the copy's rows are padded to whole blocks)."""
    cp_l: gl.constexpr = production.copy_layout(BN, W, gl.num_warps())
    i = gl.arange(0, BN, layout=gl.SliceLayout(1, cp_l))
    wc = gl.arange(0, W, layout=gl.SliceLayout(0, cp_l))
    return WC + (n0 // BN).to(gl.int64) * (NCH * BN * W) + i[:, None] * W + wc[None, :]


_issue = rebound(production._issue, chunk_words=chunk_words)
program_tiles = rebound(production.program_tiles, code_rows=code_rows)
program_start = rebound(production.program_start, program_tiles=program_tiles, _issue=_issue)
chunk_loop = rebound(production.chunk_loop, _issue=_issue)
program_sums = rebound(production.program_sums, program_start=program_start, chunk_loop=chunk_loop)
foldc_gemv_gluon = rebound(production.foldc_gemv_gluon, program_sums=program_sums)


def tiled_codes(codes: torch.Tensor, bn: int, nb: int) -> torch.Tensor:
    """codes [n, row_bytes] uint8 -> the same bytes as [blocks * bn, row_bytes] in tiled order: block b's chunk c
    (rows b*bn .. b*bn + bn - 1, bytes c*nb .. c*nb + nb - 1) contiguous, chunks of a block in order (rows past n:
    zero)."""
    n, row_bytes = codes.shape
    blocks = -(-n // bn)
    padded = torch.zeros(blocks * bn, row_bytes, dtype=codes.dtype, device=codes.device)
    padded[:n] = codes
    tiles = padded.view(blocks, bn, row_bytes // nb, nb).permute(0, 2, 1, 3).contiguous()
    return tiles.view(blocks * bn, row_bytes)


CASES = [("k-group:4:128", 28672, 8192, 1), ("k-group:2:128", 28672, 8192, 1), ("k-group:4:128", 4096, 14336, 1),
         ("k-group:4:128", 14336, 4096, 1), ("k-group:4:128", 28672, 8192, 16)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/gemv_tiled.json")
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    args = ap.parse_args(argv)
    import foldc
    from foldc.backends.gluon.gemv_launch import gemv_bytes
    from foldc.gemm import GemmSpec, parse_gemm_encoding
    from foldc.gemm.reference import gemm_reference, quantize_2d
    from gemv_ab import b_call
    from gemv_check import copies, graph_us, read_ceiling, rel

    print(f"seed {args.seed}", flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for enc, n, k, m in CASES:
        spec = GemmSpec(n, k, parse_gemm_encoding(enc, "weight"))
        wq = quantize_2d((torch.randn(n, k, generator=gen) * 0.05).cuda(), spec.weight)
        x = (torch.randn(m, k, generator=gen) * 2 + 0.1).to("cuda", torch.float16)
        ref = gemm_reference(x, wq)
        kern = foldc.compile(spec, target="auto", kernel="gluon")
        y = kern(x, wq)
        launch = kern.gemv.plan_launch(x.dtype, m, sms)
        consts = dict(launch.constants)
        nb = consts["W"] * 4
        tiled = SimpleNamespace(codes=tiled_codes(wq.codes[0, 0], consts["BN"], nb)[None, None], scale=wq.scale,
                                zero=wq.zero)
        call = b_call(foldc_gemv_gluon, kern.gemv, "launcher")
        yt = torch.empty_like(y)
        call(x, tiled, yt)
        torch.cuda.synchronize()
        row = {"enc": enc, "n": n, "k": k, "m": m, "bn": consts["BN"], "split": launch.grid[1],
               "err": rel(y, ref), "tiled_err": rel(yt, ref)}
        nbytes = gemv_bytes(spec)
        row["us"] = graph_us([lambda c=c: kern(x, c, out=y) for c in copies(wq, nbytes)])
        tcopies = [SimpleNamespace(codes=tiled.codes.clone(), scale=wq.scale.clone(), zero=wq.zero.clone())
                   for _ in range(max(2, -(-(400 << 20) // nbytes)))]
        row["tiled_us"] = graph_us([lambda c=c: call(x, c, yt) for c in tcopies])
        del tcopies
        row["pct"], row["tiled_pct"] = (100 * nbytes / (row[key] * 1e-6) / read_ceiling()
                                        for key in ("us", "tiled_us"))
        ok = row["tiled_err"] < 1e-2
        print(f"{enc} {n}x{k} m{m}: production {row['us']:.2f} µs ({row['pct']:.0f}%), tiled {row['tiled_us']:.2f} "
              f"({row['tiled_pct']:.0f}%), errors {row['err']:.1e} / {row['tiled_err']:.1e}{'' if ok else ' FAIL'}",
              flush=True)
        rows.append(row)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"seed": args.seed, "device": torch.cuda.get_device_name(),
                                              "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
