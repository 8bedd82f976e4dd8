#!/usr/bin/env bash
# Nsight Compute on the register-operand GEMV at 28672 x 8192 (INT4 and INT2 at m = 1, INT4 at m = 16): stall
# samples by SASS opcode (benchmarks/ncu_stalls.py) and the details page, into $OUT/ncu, from the repository root
# on the device:
#     OUT=/tmp/o bash benchmarks/ncu_gemv.sh ["k-group:4:128 28672 8192 1" ...]   (cases: weight n k m)
set -u
R=${OUT:-/tmp/ncu_gemv}/ncu
mkdir -p "$R"
export PYTHONPATH=.
. "$(dirname "$0")/ncu_case.sh"
CASES=("k-group:4:128 28672 8192 1" "k-group:2:128 28672 8192 1" "k-group:4:128 28672 8192 16")
[ $# -gt 0 ] && CASES=("$@")
HEAD="DRAM Throughput|Duration|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Registers Per|Achieved Occupancy"
HEAD="$HEAD|Theoretical Occupancy|L1/TEX Hit|L2 Hit"
for c in "${CASES[@]}"; do
  echo "== $c"
  ncu_case "$R" "$(echo "$c" | tr ' :' '__')" foldc_gemv "$HEAD" python3 benchmarks/gemv_one.py $c
done
