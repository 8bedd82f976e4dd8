#!/usr/bin/env bash
# Channel-wise K's query operand by fp16 products and its zero term by MMA (main) beside the float32 path before
# it (benchmarks/variants/kernel_kgroup_f32.py): errors against float64 (check_kgroup.py), the GPU tests of
# channel-wise layouts, then CUDA-graph times at 8 x 64K in alternating rounds (ab_kernel.py). From the
# repository root on the device.
set -u
OUT=${OUT:-/tmp/kgroup}
V="--variant f32=benchmarks/variants/kernel_kgroup_f32.py"
timeout 200 python3 benchmarks/variants/check_kgroup.py --out "$OUT/kgroup_check.json" 2>&1 | grep -v Warning
timeout 150 python3 -m pytest -q -x tests/backends/test_gluon_gpu.py -k "channel or range or every_layout" 2>&1 | tail -5
timeout 200 python3 benchmarks/ab_kernel.py $V --heads 32/8 --rounds 2 \
    --cases 2:channel32/token32:8x65536,2:channel/token:8x65536,2:channel32/channel32:8x65536,2:channel16/token:8x65536,4:channel64/channel64:8x65536,8:channel32/token32:8x65536 \
    --out "$OUT/kgroup_32x8.json" 2>&1 | grep -v Warning
timeout 100 python3 benchmarks/ab_kernel.py $V --heads 40/8 --rounds 2 --cases 4:channel/token:8x65536 \
    --out "$OUT/kgroup_40x8.json" 2>&1 | grep -v Warning
