#!/usr/bin/env bash
# The lazy-rescale / in-MMA accumulation variants (benchmarks/variants/kernel_lazy_*.py) beside main: error against
# float64 at one split of 64K tokens (the tensor core's running sum over 2048 tiles) and at the default split, times.
set -u
OUT=${OUT:-/tmp/lazy}
V="--variant lazy=benchmarks/variants/kernel_lazy_acc.py --variant sums=benchmarks/variants/kernel_lazy_sums.py"
V1="--variant lazy1=benchmarks/variants/kernel_lazy_acc.py --variant sums1=benchmarks/variants/kernel_lazy_sums.py"
O1="--options main1=splits:1 --variant-options lazy1=splits:1 --variant-options sums1=splits:1"
timeout 280 python3 benchmarks/ab_kernel.py $V $V1 $O1 --heads 64/4 --rounds 2 \
    --cases 2:token/token:8x65536,4:token/token:8x65536 --out "$OUT/lazy_64x4.json" 2>&1 | grep -v Warning
timeout 250 python3 benchmarks/ab_kernel.py $V --heads 32/8 --rounds 2 \
    --cases 2:token/token:8x65536,4:token/token:8x65536,2:channel/token:8x65536 --out "$OUT/lazy_32x8.json" 2>&1 | grep -v Warning
