#!/usr/bin/env bash
# Nsight Compute on the register-operand decode kernel at 8 x 64K, token-wise g128 (benchmarks/ncu_one.py's third
# launch): stall samples by SASS opcode (benchmarks/ncu_stalls.py) and the details page, into $OUT/ncu_decode, from
# the repository root on the device. The default cases set the 16-row program (64/4) beside the 4-row one (32/8),
# INT2 and INT4: what the 16-row program waits on (docs/perf.md, "Many query rows per KV head").
#     OUT=/tmp/o bash benchmarks/ncu_decode.sh ["2 8 65536 1 32 auto 128 128 64/4" ...]   (ncu_one.py's arguments)
set -u
R=${OUT:-/tmp/ncu_decode}/ncu_decode
mkdir -p "$R"
export PYTHONPATH=.
. "$(dirname "$0")/ncu_case.sh"
CASES=("2 8 65536 1 32 auto 128 128 64/4" "2 8 65536 2 64 auto 128 128 32/8" "4 8 65536 1 32 auto 128 128 64/4")
[ $# -gt 0 ] && CASES=("$@")
HEAD="DRAM Throughput|Duration|Issue Slots Busy|No Eligible|Eligible Warps|Warp Cycles Per Issued|Registers Per"
HEAD="$HEAD|Achieved Occupancy|Theoretical Occupancy|Block Limit Registers"
# the profiler takes the third decode launch (the first two compile and warm up)
for c in "${CASES[@]}"; do
  echo "== $c"
  NCU_SKIP=2 ncu_case "$R" "$(echo "$c" | tr ' /' '__')" foldc_decode "$HEAD" python3 benchmarks/ncu_one.py $c
done
