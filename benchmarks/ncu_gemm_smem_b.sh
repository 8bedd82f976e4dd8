#!/usr/bin/env bash
# Nsight Compute on benchmarks/gemm_smem_b.py's kernels (INT4 g128, fp16 x): stall samples by SASS opcode
# (benchmarks/ncu_stalls.py) and the details page's headline figures, into $OUT/ncu, from the repository root on the
# device:
#     OUT=/tmp/o bash benchmarks/ncu_gemm_smem_b.sh ["N K M BLOCK_M BLOCK_N STAGES SPLIT" | "ws N K M BM BN NC NW PW" ...]
set -u
R=${OUT:-/tmp/ncu_gemm_smem_b}/ncu
mkdir -p "$R"
export PYTHONPATH=.
. "$(dirname "$0")/ncu_case.sh"
CASES=("28672 8192 256 128 128 3 1" "4096 4096 256 128 64 4 1" "ws 28672 8192 256 128 256 6 2 4")
[ $# -gt 0 ] && CASES=("$@")
HEAD="Duration|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Registers Per|Achieved Occupancy|L2 Hit"
HEAD="$HEAD|Memory Throughput|Compute \(SM\) Throughput"
for c in "${CASES[@]}"; do
  echo "== $c"
  set -- $c
  if [ "$1" = ws ]; then
    shift
    ncu_case "$R" "ws_$(echo "$*" | tr ' ' '_')" foldc_gemm_ws "$HEAD" python3 benchmarks/gemm_smem_b.py --ws --one "$@"
  else
    ncu_case "$R" "$(echo "$*" | tr ' ' '_')" foldc_gemm_smem_b "$HEAD" python3 benchmarks/gemm_smem_b.py --one "$@"
  fi
done
