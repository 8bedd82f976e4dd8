#!/usr/bin/env bash
# The GPU tests of channel-wise groups of 16 tokens at the launcher's new defaults (two KV heads beside V in such
# groups, 80dd8e2), then two packed KV heads at head_dim 256 beside a channel-wise side (the defaults take one: two
# spill 38-46 a tile ahead of time, but take 25-30% fewer SASS per byte), timed beside the defaults
# (ab_kernel.py --options, CUDA graphs, alternating rounds, errors against float64). From the repository root.
set -u
OUT=${OUT:-/tmp/pack_d256}
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 -m pytest -q tests/backends/test_gluon_gpu.py -k "generated_layouts and 16 and d128" 2>&1 | tail -3
timeout 250 python3 benchmarks/ab_kernel.py --options p2=pack_heads:2 --heads 32/8 --head-dim 256 --rounds 2 \
    --cases 2:channel/token:8x65536,4:token/channel:8x65536,2:channel/channel:8x65536,2:token/channel64:8x65536 \
    --out "$OUT/pack2_d256_32x8.json" 2>&1 | grep -v Warning
