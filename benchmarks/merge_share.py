"""How much of a decode call the merge kernel adds, under CUDA graphs (where it runs as a programmatic dependent
launch of the decode kernel): each case's graph replay with the merge, and with the merge left out of the captured
graph (the decode kernel alone; its output then unmerged, so that copy is timed only). The difference is what a
merge inside the decode kernel could at most save.

    PYTHONPATH=. python3 benchmarks/merge_share.py --out $OUT/merge_share.json
"""
from __future__ import annotations

import argparse
import sys

import torch

import foldc
from foldc.bench import decode_case, save_rows
from foldc.timing import capture_graph
from foldc.testing import rel_l2


class _NoMerge:
    """Stands for the merge kernel's launcher: a launch that does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None

    def bind(self, *args, **kwargs):   # a bound launch (eager calls before the capture) that does nothing
        return lambda *args, **kwargs: True


def graph_us(fn) -> float:
    from triton.testing import do_bench

    graph = capture_graph(fn)
    return do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="2:1x4096,2:1x16384,2:4x16384,2:8x65536,2:32x16384,4:1x16384,4:8x65536",
                    help="BITS:BATCHxTOKENS, comma-separated (token-wise g128, 32/8 heads, head_dim 128)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for case in args.cases.split(","):
        bits, shape = case.split(":")
        b, n = (int(x) for x in shape.split("x"))
        enc = foldc.Affine(int(bits), "token", 128)
        spec = foldc.AttentionSpec(32, 8, 128, enc, enc)
        q, k, v = decode_case(spec, b, n, seed=b * n + int(bits))
        attn = foldc.compile(spec, "sm_90", kernel="gluon")
        out = attn(q, k, v)
        err = rel_l2(out, foldc.attention_reference(q, k, v)) if b * n <= 600_000 else None
        whole = graph_us(lambda: attn(q, k, v))
        decode = attn._launchers()[0]
        attn._launchers = lambda: (decode, _NoMerge())
        alone = graph_us(lambda: attn(q, k, v))
        rows.append(dict(case=case, with_merge_us=whole, decode_alone_us=alone, merge_us=whole - alone, error=err,
                         device=torch.cuda.get_device_name()))
        print(f"{case:<14} with merge {whole:7.1f} us, decode alone {alone:7.1f} us, merge adds {whole - alone:5.1f} "
              f"us ({100 * (whole - alone) / whole:.0f}%)  error {err}", flush=True)
        save_rows(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
