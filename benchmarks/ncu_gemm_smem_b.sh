#!/usr/bin/env bash
# Nsight Compute on benchmarks/gemm_smem_b.py's kernels (INT4 g128, fp16 x): stall samples by SASS opcode
# (benchmarks/ncu_stalls.py) and the details page's headline figures, into $OUT/ncu, from the repository root on the
# device:
#     OUT=/tmp/o bash benchmarks/ncu_gemm_smem_b.sh ["N K M BLOCK_M BLOCK_N STAGES SPLIT" | "ws N K M BM BN NC NW PW" ...]
set -u
R=${OUT:-/tmp/ncu_gemm_smem_b}/ncu
mkdir -p "$R"
export PYTHONPATH=.
CASES=("28672 8192 256 128 128 3 1" "4096 4096 256 128 64 4 1" "ws 28672 8192 256 128 256 6 2 4")
[ $# -gt 0 ] && CASES=("$@")
for c in "${CASES[@]}"; do
  tag=$(echo "$c" | tr ' ' '_')
  set -- $c
  if [ "$1" = ws ]; then shift; args="--ws --one $*"; kern=foldc_gemm_ws; else args="--one $*"; kern=foldc_gemm_smem_b; fi
  timeout 120 ncu --clock-control none -k regex:$kern -c 1 --set full --import-source no -o "$R/$tag" \
      python3 benchmarks/gemm_smem_b.py $args > "$R/$tag.log" 2>&1
  ncu --import "$R/$tag.ncu-rep" --page source --csv --print-source sass > "$R/${tag}_sass.csv" 2>/dev/null
  ncu --import "$R/$tag.ncu-rep" --page details > "$R/${tag}_details.txt" 2>&1
  python3 benchmarks/ncu_stalls.py "$R/${tag}_sass.csv" > "$R/${tag}_stalls.txt" 2>&1
  gzip -f "$R/${tag}_sass.csv"
  rm -f "$R/$tag.ncu-rep"
  echo "== $c"
  head -n 16 "$R/${tag}_stalls.txt"
  grep -E "Duration|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Registers Per|Achieved Occupancy|L2 Hit|Memory Throughput|Compute \(SM\) Throughput|Bank Conflicts" "$R/${tag}_details.txt" | head -n 16
done
