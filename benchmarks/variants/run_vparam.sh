#!/usr/bin/env bash
# Channel-wise V group parameters at immediate offsets (main, 219200f) beside the 64-bit address a value before it
# (benchmarks/variants/vparam_before/: kernel.py, tile_groups.py, tile_operands.py at 3b813d5): the GPU tests of
# the layouts it touches, then CUDA-graph times at 8 x 64K in alternating rounds (ab_kernel.py). From the
# repository root on the device.
set -u
OUT=${OUT:-/tmp/vparam}
V="--variant before=benchmarks/variants/vparam_before/kernel.py"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 250 python3 -m pytest -q tests/backends/test_gluon_gpu.py \
    -k "keeps_values or every_layout or channel_wise_splits or packed_heads or generated_layouts" 2>&1 | tail -6
timeout 200 python3 benchmarks/ab_kernel.py $V --heads 32/8 --rounds 2 \
    --cases 2:token/channel32:8x65536,2:token32/channel32:8x65536,2:channel32/channel32:8x65536,2:token/channel:8x65536,4:token/channel32:8x65536,8:token/channel32:8x65536 \
    --out "$OUT/vparam_32x8.json" 2>&1 | grep -v Warning
timeout 100 python3 benchmarks/ab_kernel.py $V --heads 8/8 --rounds 2 --cases 2:token/channel:8x65536 \
    --out "$OUT/vparam_8x8.json" 2>&1 | grep -v Warning
