"""When each program of the register-operand decode kernel starts, reaches its token loop, has its
first tile's codes, and ends, read from the GPU's global timer: how long the launch takes to put
every program on an SM, how long the prologue and the first copy take, and how far apart the
programs finish (the tail, in which SMs idle while the slowest programs run). H200; evidence for
docs/perf.md, not a test.

The timed kernel is a copy of foldc/backends/gluon/kernel.py with four stamps patched in (`patched`);
it writes them, and the SM each program ran on, over the per-split maxima of its workspace, so its
output is garbage by design. The untimed kernel's graph replay is printed beside it.

    PYTHONPATH=. python3 benchmarks/program_timeline.py --cases 2:8x65536,2:32x65536 --out $OUT/timeline.json

With dynamic tiles (``--dynamic``) the tiles-per-program column is the static split's, not what ran.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

import foldc
from foldc.bench import decode_case, timed

STAMP = '''
@gluon.jit
def _stamp(x, ASM: gl.constexpr):
    return gl.inline_asm_elementwise(ASM, "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)
'''

# (anchor text in kernel.py, text put after it): each anchor must occur exactly once
PATCHES = [
    ("    tok_l: gl.constexpr = gl.SliceLayout(1, mma)\n",
     "    rr_t = gl.arange(0, ROWS, layout=gl.SliceLayout(0, mma))\n"
     "    t_start = _stamp(rr_t, 'mov.u32 $0, %globaltimer_lo;')\n"),
    ("    acc_o = gl.zeros([D, ROWS], gl.float32, layout=mma)\n",
     "    t_loop = _stamp(rr_t, 'mov.u32 $0, %globaltimer_lo;')\n"
     "    t_first = t_loop\n"),
    ("            async_copy.wait_group(STAGES - 1)\n"
     "            gl.thread_barrier()   # tile i's words, copied by every lane, are visible\n",
     "            t_first = gl.where(i == 0, _stamp(rr_t, 'mov.u32 $0, %globaltimer_lo;'), t_first)\n"),
    ("    # token-wise V: undo the field weights",
     ""),
]
END = ("    gl.store(WS_M + base + rr, m_i)\n",
       "    t_end = _stamp(rr_t, 'mov.u32 $0, %globaltimer_lo;')\n"
       "    sm = _stamp(rr_t, 'mov.u32 $0, %smid;')\n"
       "    stamps = gl.where(rr == 0, t_start, gl.where(rr == 1, t_loop, gl.where(rr == 2, t_first,\n"
       "                      gl.where(rr == 3, t_end, sm))))\n"
       "    gl.store(WS_M + base + rr, stamps.to(gl.float32, bitcast=True))\n")


def patched() -> str:
    """kernel.py's source with the stamps added (fails loudly if kernel.py changed under an anchor)."""
    src = (Path(foldc.__file__).parent / "backends" / "gluon" / "kernel.py").read_text()
    for anchor, text in PATCHES:
        if src.count(anchor) != 1:
            raise SystemExit(f"anchor not found once in kernel.py: {anchor[:60]!r}")
        src = src.replace(anchor, anchor + text)
    anchor, text = END
    if src.count(anchor) != 1:
        raise SystemExit("the store of m_i is not in kernel.py once")
    src = src.replace(anchor, text)
    return src.replace("\n@gluon.jit\ndef foldc_decode_gluon", STAMP + "\n\n@gluon.jit\ndef foldc_decode_gluon")


def load(src: str):
    path = Path(tempfile.mkdtemp()) / "kernel_timeline.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("foldc_kernel_timeline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def summarise(stamps: np.ndarray, tiles: np.ndarray) -> dict:
    """stamps [programs, 5] uint32: start, loop, first tile, end (ns, wrapping), SM."""
    t = stamps[:, :4].astype(np.int64)
    # offsets from one program's start, read as signed 32-bit so that stamps on either side of a wrap
    # order correctly (a kernel lasts far less than the 2.1 s that leaves), then from the earliest start
    t = (t - t[0, 0] + (1 << 31)) % (1 << 32) - (1 << 31)
    t = t - t[:, 0].min()                      # ns after the first program started
    start, loop, first, end = (t[:, i] / 1e3 for i in range(4))
    sm = stamps[:, 4]
    span = end.max()
    per_sm_end = np.array([end[sm == s].max() for s in np.unique(sm)])
    per_sm_count = np.array([(sm == s).sum() for s in np.unique(sm)])
    # programs running at each microsecond, against the most that ran at once
    grid = np.arange(0.0, span, 0.25)
    running = ((start[None, :] <= grid[:, None]) & (end[None, :] > grid[:, None])).sum(1)
    q = lambda x: [round(float(v), 2) for v in np.percentile(x, [0, 10, 50, 90, 100])]
    return dict(programs=len(t), span_us=round(float(span), 2), start_us=q(start), prologue_us=q(loop - start),
                first_tile_us=q(first - start), end_us=q(end), run_us=q(end - start),
                sms=len(per_sm_count), programs_per_sm=[int(per_sm_count.min()), int(per_sm_count.max())],
                sm_last_end_us=q(per_sm_end), mean_running_over_peak=round(float(running.mean() / running.max()), 3),
                tiles_per_program=[int(tiles.min()), int(tiles.max())])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="2:8x65536,2:32x16384,2:32x65536,2:1x16384")
    ap.add_argument("--splits", default="auto", help="comma-separated split counts or auto")
    ap.add_argument("--dynamic", action="store_true", help="time the kernel with dynamic_tiles=True")
    ap.add_argument("--reps", type=int, default=5, help="timed launches; the one with the shortest span is kept")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    module = load(patched())
    rows = []
    for case in args.cases.split(","):
        bits, shape = case.split(":")
        b, n = (int(x) for x in shape.split("x"))
        enc = foldc.Affine(int(bits), "token", 128)
        spec = foldc.AttentionSpec(32, 8, 128, enc, enc)
        q, k, v = decode_case(spec, b, n, seed=b * n + int(bits))
        for sp in args.splits.split(","):
            attn = foldc.compile(spec, "sm_90", kernel="gluon", splits=None if sp == "auto" else int(sp),
                                 dynamic_tiles=args.dynamic)
            out = attn(q, k, v)
            _, graph_us = timed(lambda attn=attn, q=q, k=k, v=v, out=out: attn(q, k, v, out=out))
            launch = attn.launch_config(q.dtype, b, n)
            splits, per_split = attn.split_plan(launch, b, n, q.device, q.dtype)
            attn._modules = (module.foldc_decode_gluon, attn._kernels()[1])
            ws = attn.workspace(launch, b, splits, q.device)
            lse = torch.empty(b, spec.num_q_heads, device=q.device, dtype=torch.float32)
            best = None
            for _ in range(args.reps):
                attn.launch(launch, q, k, v, None, ws, out, lse, 1.0 / 128 ** 0.5, per_split, splits, n)
                torch.cuda.synchronize()
                stamps = ws[0][..., :5].reshape(-1, 5).contiguous().view(torch.int32).cpu().numpy().view(np.uint32)
                tiles = np.array([min(per_split, max(0, n - s * per_split)) // launch["block_n"]
                                  for _b in range(b) for _h in range(ws[0].shape[1]) for s in range(splits)])
                summary = summarise(stamps, tiles)
                if best is None or summary["span_us"] < best["span_us"]:
                    best = summary
            row = dict(case=case, dynamic=args.dynamic, splits=splits, asked=sp, block_n=launch["block_n"],
                       heads=launch["heads"], graph_us=round(graph_us, 1), **best)
            rows.append(row)
            print(json.dumps(row), flush=True)
            Path(args.out).write_text(json.dumps(rows, indent=1))
        del q, k, v
    return 0


if __name__ == "__main__":
    sys.exit(main())
