#!/usr/bin/env bash
# Two packed KV heads where token-wise groups cross a padded head_dim's bit fields (head_dim 96), the launcher's
# default on this branch (each packed head's pieces in turn; AOT, sm_90: 20-24% fewer SASS per byte than one head,
# no spill): the GPU tests of those layouts, then CUDA-graph times in alternating rounds beside one head per program
# (ab_kernel.py --options, errors against float64). From the repository root on the device.
set -u
OUT=${OUT:-/tmp/masked_heads}
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 -m pytest -q tests/backends/test_gluon_gpu.py -k "d96 or d160" 2>&1 | tail -3
timeout 300 python3 benchmarks/ab_kernel.py --options one=pack_heads:1 --heads 32/8 --head-dim 96 --rounds 2 \
    --cases 2:token32/token32:8x65536,4:token32/token32:8x65536,8:token48/token32:8x65536,2:token32/token32:2x16384 \
    --out "$OUT/masked_heads_d96_32x8.json" 2>&1 | grep -v Warning
