"""How many tokens a split should take at small shapes: each layout at each shape with its default split
count and with explicit fewer splits, timed by CUDA-graph replay (L2 flushed by do_bench), beside the
bytes each split reads from the cache and writes to the workspace (the merge reads them back).

    PYTHONPATH=. python3 benchmarks/split_sweep.py --shapes 1x16384,1x4096 --out $OUT/split_sweep.json \\
        --layouts "channel:4:64,token:4:64,64/4,128;token:2:128,token:2:128,32/8,128"
"""
from __future__ import annotations

import argparse
import json

import torch

import foldc
from foldc.bench import decode_case, timed
from foldc.spec import spec_from_args
from foldc.testing import rel_l2


def cache_bytes(k, v) -> int:
    return sum(t.numel() * t.element_size() for x in (k, v) for t in (x.codes, x.scale, x.zero))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", required=True, help="K,V,heads,head_dim entries separated by ';'")
    ap.add_argument("--shapes", default="1x16384")
    ap.add_argument("--divisors", default="1,1.5,2,3,4,8,16", help="split counts tried: the default's / each")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    rows = []
    for item in args.layouts.split(";"):
        k_text, v_text, heads, d = item.split(",")
        spec = spec_from_args(k_text, v_text, heads, int(d))
        for shape in args.shapes.split(","):
            batch, tokens = map(int, shape.split("x"))
            q, k, v = decode_case(spec, batch, tokens, seed=batch * tokens + int(d))
            ref = foldc.attention_reference(q, k, v)
            default = foldc.compile(spec, "auto")
            launch = default.plan_launch(q.dtype, batch, tokens, q.device, k=k, v=v)
            programs = batch * launch.head_programs
            tried = sorted({max(1, round(launch.splits / float(x))) for x in args.divisors.split(",")}, reverse=True)
            base = dict(k=k_text, v=v_text, heads=heads, head_dim=int(d), batch=batch, tokens=tokens,
                        kernel=launch.kernel, block_n=launch.block_n, default_splits=launch.splits,
                        programs=programs, cache_bytes=cache_bytes(k, v), rows=launch.rows)
            for splits in tried:
                attn = default if splits == launch.splits else foldc.compile(spec, "auto", splits=splits)
                row = dict(base, splits=splits, per_split=launch.per_split * launch.splits // splits)
                try:
                    out = attn(q, k, v)
                    row["error"] = rel_l2(out, ref)
                    row["eager_us"], row["graph_us"] = timed(lambda attn=attn, q=q, k=k, v=v: attn(q, k, v))
                    # float32 accumulator rows, their max and denominator, per program and split
                    row["workspace_bytes"] = programs * splits * launch.rows * (spec.head_dim + 2) * 4
                except Exception as e:   # keep sweeping; the row records the failure
                    row["fail"] = repr(e)[:300]
                rows.append(row)
                print(json.dumps({key: (round(x, 2) if isinstance(x, float) else x) for key, x in row.items()}),
                      flush=True)
            with open(args.out, "w") as f:
                json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)
            del q, k, v, ref
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
