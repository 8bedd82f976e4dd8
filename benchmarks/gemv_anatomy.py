"""Where the register-operand GEMV's time goes at m = 1 (H200): the production kernel beside two
variants of it that keep its grid, its pipeline and its shared memory but drop one side of the work.

    PYTHONPATH=. python3 benchmarks/gemv_anatomy.py --out $OUT/anatomy.json

- ``copy``: the same copies (the program's parameter words at the start, code words STAGES deep),
  each chunk's words read from shared memory into registers and folded into an integer; no unpack,
  MMA or parameters. The memory floor of this program structure.
- ``compute``: the same chunk work (unpack, MMAs, parameters, the activation's loads) on the words the
  prologue copied, no copies in the loop. The instruction floor.
- ``stream``: a plain streaming read of the same bytes (a Triton reduction over the code words), the
  bandwidth a kernel of this size can reach at all.
Each at the launcher's default split and a few others; CUDA graphs over distinct weight copies (cold
L2), INT4 and INT2 g128, fp16 activations. The production kernel is checked against float64 first;
the variants compute nothing useful and are timed only. (The run of 2026-12-03 at commit beda257,
docs/results/gemv_anatomy_h200_2026-12-03.json, also timed copies without the parameter words and
with a weight stored tile by tile: the per-chunk parameter copies of that kernel were the cost.)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemv_check import copies, graph_us, rel, read_ceiling  # noqa: E402

from foldc.backends.gluon.gemv import _chunk, _issue, _load_x, _zeros_tiles, program_start  # noqa: E402
from foldc.backends.gluon.tile_operands import key_words_layout  # noqa: E402
from foldc.backends.runtime.fast_launch import FastLaunch  # noqa: E402


@gluon.jit
def gemv_variant(X, WC, WS, WZ, Y, PART, COUNTERS, M, N, stride_x, stride_wc, stride_ws, stride_y,
                 chunks_per_split, BN: gl.constexpr, W: gl.constexpr, F: gl.constexpr, NG: gl.constexpr,
                 ROWS: gl.constexpr, ROW_BYTES: gl.constexpr, G: gl.constexpr, BITS: gl.constexpr,
                 STAGES: gl.constexpr, SPLIT: gl.constexpr, ASM: gl.constexpr, CONS: gl.constexpr,
                 XF16: gl.constexpr, VALUE_EXP: gl.constexpr, KIND: gl.constexpr, SUB: gl.constexpr,
                 GW: gl.constexpr, X_SHARED: gl.constexpr, SWAP: gl.constexpr, COPY: gl.constexpr,
                 COMPUTE: gl.constexpr):
    """foldc_gemv_gluon's loop with the copies of code words (COPY) and / or the chunk work (COMPUTE) kept;
    the parameter words are copied at the start as there; the result is written to y unreduced (timing
    only)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    NB: gl.constexpr = W * 4
    D: gl.constexpr = NB * F
    T: gl.constexpr = BN // 16
    n0, c_lo, c_hi, w_rows, x_at, w_smem, x_smem, s_run, z_run = program_start(
        X, WC, WS, WZ, M, N, stride_x, stride_wc, stride_ws, chunks_per_split, BN, W, F, ROWS, ROW_BYTES, G, STAGES,
        SUB, GW, KIND != 2, X_SHARED)
    ys = _zeros_tiles(ROWS, T)
    kw_l: gl.constexpr = key_words_layout(16, W)
    folded = gl.zeros([16, W], gl.int32, layout=kw_l)
    if COMPUTE and not X_SHARED:
        x_next = _load_x(X, x_at, stride_x, c_lo * NB, D, NB, ROWS, ROW_BYTES)
    for i in range(gl.cdiv(c_hi - c_lo, SUB)):
        ahead = i + STAGES - 1
        gl.thread_barrier()
        if COPY and c_lo + ahead * SUB < c_hi:
            _issue(ahead % STAGES, c_lo + ahead * SUB, c_hi, w_rows, w_smem, X, x_at, x_smem, W, SUB, X_SHARED)
        else:
            async_copy.commit_group()
        async_copy.wait_group(STAGES - 1)
        gl.thread_barrier()
        for u in gl.static_range(SUB):
            c = c_lo + i * SUB + u
            slot = ((i % STAGES) if COPY else (i % (STAGES - 1))) * SUB + u
            if COMPUTE:
                if X_SHARED:
                    x_in = x_smem.index(slot)
                else:
                    x_in = x_next
                    x_next = _load_x(X, x_at, stride_x, gl.minimum(c + 1, c_hi - 1) * NB, D, NB, ROWS, ROW_BYTES)
                if c < c_hi:
                    ys = _chunk(w_smem.index(slot), s_run, z_run, c_lo * NB, x_in, ys, n0, N, stride_ws, c * NB, T, W,
                                F, NG, ROWS, ROW_BYTES, G, BITS, ASM, CONS, XF16, VALUE_EXP, KIND, GW, X_SHARED, SWAP)
            else:
                for t in gl.static_range(T):
                    folded = folded ^ w_smem.index(slot).slice(16 * t, 16, dim=0).load(kw_l)
    async_copy.wait_group(0)
    rn = n0 + gl.arange(0, 16, layout=gl.SliceLayout(1, mma))
    rm = gl.arange(0, ROWS, layout=gl.SliceLayout(0, mma))
    ok = (rn < N)[:, None] & (rm < M)[None, :]
    if COMPUTE:
        total = ys[0]
    else:
        total = gl.convert_layout(gl.sum(folded, axis=1), gl.SliceLayout(1, mma)).to(gl.float32)[:, None] + \
            gl.zeros([16, ROWS], gl.float32, layout=mma)
    gl.store(Y + rm[None, :] * stride_y + rn[:, None], total.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def stream_read(P, OUT, n_words, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.int32)
    for start in range(pid * BLOCK, n_words, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc ^= tl.load(P + offs, mask=offs < n_words, other=0)
    tl.store(OUT + pid, tl.sum(acc, axis=0))


def variant_call(gemv, kernel, flags: dict):
    """A callable like ``gemv(x, w, out=y)`` that runs ``kernel`` (gemv_variant) with ``flags`` through the
    launcher's own launch (grid, split, constants, buffers)."""
    fast = FastLaunch(kernel)
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def call(x, w, out):
        launch = gemv.plan_launch(x.dtype, x.shape[0], sms)
        part, counters = gemv.buffers(launch, x.device)
        codes, scale, zero = w.codes[0, 0], w.scale[0, 0], w.zero[0, 0]
        fast[launch.grid](x, codes.view(torch.int32), scale, zero, out, part, counters, launch.m, gemv.spec.n,
                          x.stride(0), codes.stride(0) // 4, scale.stride(0), out.stride(0), launch.chunks_per_split,
                          XF16=x.dtype == torch.float16, **dict(launch.constants), **flags)
    return call


def main(argv=None) -> int:
    import foldc
    from foldc.backends.gluon.gemv_launch import gemv_bytes
    from foldc.gemm import GemmSpec, parse_gemm_encoding
    from foldc.gemm.reference import gemm_reference, quantize_2d

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="4096x14336,28672x8192")
    ap.add_argument("--encodings", default="k-group:4:128,k-group:2:128")
    ap.add_argument("--splits", default="default,4,6,12,16,24")
    ap.add_argument("--block-rows", default="16,32")
    args = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(20261203)
    rows = []
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        w = (torch.randn(n, k, generator=gen) * 0.05).cuda()
        x = (torch.randn(1, k, generator=gen) + 0.1).cuda().half()
        w16 = w.half()
        base = {"n": n, "k": k, "m": 1}
        fp16 = graph_us([lambda t=t: torch.mm(x, t.T) for t in copies(w16, n * k * 2)])
        rows.append(dict(base, what="fp16 cuBLAS", us=round(fp16, 2)))
        print(json.dumps(rows[-1]), flush=True)
        for enc in args.encodings.split(","):
            spec = GemmSpec(n, k, parse_gemm_encoding(enc, "weight"))
            wq = quantize_2d(w, spec.weight)
            nbytes = gemv_bytes(spec)
            ws = copies(wq, nbytes)
            words = [c.codes.view(torch.int32).reshape(-1) for c in ws]
            sink = torch.empty(4096, device="cuda", dtype=torch.int32)
            for programs in (528, 1056, 2112):
                us = graph_us([lambda p=p: stream_read[(programs,)](p, sink, p.numel(), BLOCK=1024, num_warps=4)
                               for p in words])
                rows.append(dict(base, enc=enc, what=f"stream read of the code words, {programs} programs",
                                 us=round(us, 2),
                                 pct=round(100 * nbytes / (us * 1e-6) / read_ceiling(), 1)))
                print(json.dumps(rows[-1]), flush=True)
            for br in map(int, args.block_rows.split(",")):
                for split in args.splits.split(","):
                    opts = {"block_rows": br} | ({} if split == "default" else {"gemv_split": int(split)})
                    kern = foldc.compile(spec, target="auto", kernel="gluon", **opts)
                    y = kern(x, wq)
                    err = rel(y, gemm_reference(x, wq))
                    gemv = kern.gemv
                    launch = gemv.plan_launch(x.dtype, 1, torch.cuda.get_device_properties(0).multi_processor_count)
                    row = dict(base, enc=enc, block_rows=br, split=launch.grid[1], programs=launch.grid[0] * launch.grid[1],
                               chunks_per_program=launch.chunks_per_split, err=err)
                    if not err < 1e-2:
                        row["bad"] = True
                        rows.append(row)
                        continue
                    row["production_us"] = round(graph_us([lambda c=c: kern(x, c, out=y) for c in ws]), 2)
                    for name, flags in (("copy_us", dict(COPY=True, COMPUTE=False)),
                                        ("compute_us", dict(COPY=False, COMPUTE=True))):
                        call = variant_call(gemv, gemv_variant, flags)
                        yv = torch.empty_like(y)
                        row[name] = round(graph_us([lambda c=c: call(x, c, yv) for c in ws]), 2)
                    row["pct"] = round(100 * nbytes / (row["production_us"] * 1e-6) / read_ceiling(), 1)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    out_path.write_text(json.dumps(rows, indent=1))
    out_path.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
