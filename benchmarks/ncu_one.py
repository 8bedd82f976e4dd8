"""One register-operand decode shape for Nsight Compute: three calls, the profiler takes the third
decode launch (H200; evidence for docs/perf.md, not a test). Arguments: bits batch tokens pack_heads
block_n splits|auto [head_dim [group [heads]]] (default 128, 128, 32/8).

    ncu --clock-control none -k regex:foldc_decode --launch-skip 2 -c 1 --set full --import-source no \
        -o $OUT/b8 python3 benchmarks/ncu_one.py 2 8 65536 2 64 auto
    ncu --import $OUT/b8.ncu-rep --page source --csv --print-source sass > $OUT/b8_sass.csv
    python3 benchmarks/ncu_stalls.py $OUT/b8_sass.csv
"""
from __future__ import annotations

import sys

import torch

import foldc
from foldc.bench import decode_case


def main() -> int:
    if len(sys.argv) not in (7, 8, 9, 10):
        print(__doc__, file=sys.stderr)
        return 2
    bits, batch, tokens, pack, block_n = (int(x) for x in sys.argv[1:6])
    splits = None if sys.argv[6] == "auto" else int(sys.argv[6])
    head_dim = int(sys.argv[7]) if len(sys.argv) > 7 else 128
    enc = foldc.Affine(bits, "token", int(sys.argv[8]) if len(sys.argv) > 8 else 128)
    q_heads, kv_heads = (int(x) for x in (sys.argv[9] if len(sys.argv) > 9 else "32/8").split("/"))
    spec = foldc.AttentionSpec(q_heads, kv_heads, head_dim, enc, enc)
    q, k, v = decode_case(spec, batch, tokens, seed=batch * tokens + bits)
    attn = foldc.compile(spec, "sm_90", kernel="gluon", pack_heads=pack, block_n=block_n, stages=2, splits=splits,
                         split_factor=1.0, maxnreg=None)
    for _ in range(3):
        attn(q, k, v)
    torch.cuda.synchronize()
    launch = attn.launch_config(q.dtype, batch, tokens)
    print("splits, tokens per split:", attn.split_plan(launch, batch, tokens, q.device, q.dtype, False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
