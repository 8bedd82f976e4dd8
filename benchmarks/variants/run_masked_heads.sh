#!/usr/bin/env bash
# Two packed KV heads where token-wise groups cross a padded head_dim's bit fields (head_dim 96): the production
# kernel takes one head there (a static_assert in kernel.py's KMG/VMG paths); benchmarks/variants/
# kernel_masked_heads.py loops those paths over the packed heads (each head's keys against every row, kept in its
# own rows; each head's values against its own rows' P). Ahead of time (sm_90) two heads take 20-24% fewer SASS per
# byte with no spill at head_dim 96 (token:2:32 8.83 -> 6.68 lane slots a byte). Errors against float64 and
# CUDA-graph times in alternating rounds beside the production kernel's one head (ab_kernel.py). From the
# repository root on the device.
set -u
OUT=${OUT:-/tmp/masked_heads}
V="--variant mh=benchmarks/variants/kernel_masked_heads.py --variant-options mh=pack_heads:2"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python3 benchmarks/ab_kernel.py $V --heads 32/8 --head-dim 96 --rounds 2 \
    --cases 2:token32/token32:8x65536,4:token32/token32:8x65536,8:token48/token32:8x65536,2:token32/token32:2x16384 \
    --out "$OUT/masked_heads_d96_32x8.json" 2>&1 | grep -v Warning
