#!/usr/bin/env bash
# Nsight Compute on the register-operand GEMV at 28672 x 8192 (INT4 and INT2 at m = 1, INT4 at m = 16): stall
# samples by SASS opcode (benchmarks/ncu_stalls.py) and the details page, into $OUT/ncu, from the repository root
# on the device:
#     OUT=/tmp/o bash benchmarks/ncu_gemv.sh ["k-group:4:128 28672 8192 1" ...]   (cases: weight n k m)
set -u
R=${OUT:-/tmp/ncu_gemv}/ncu
mkdir -p "$R"
export PYTHONPATH=.
CASES=("k-group:4:128 28672 8192 1" "k-group:2:128 28672 8192 1" "k-group:4:128 28672 8192 16")
[ $# -gt 0 ] && CASES=("$@")
for c in "${CASES[@]}"; do
  tag=$(echo "$c" | tr ' :' '__')
  timeout 100 ncu --clock-control none -k regex:foldc_gemv -c 1 --set full --import-source no -o "$R/$tag" \
      python3 benchmarks/gemv_one.py $c > "$R/$tag.log" 2>&1
  ncu --import "$R/$tag.ncu-rep" --page source --csv --print-source sass > "$R/${tag}_sass.csv" 2>/dev/null
  ncu --import "$R/$tag.ncu-rep" --page details > "$R/${tag}_details.txt" 2>&1
  python3 benchmarks/ncu_stalls.py "$R/${tag}_sass.csv" > "$R/${tag}_stalls.txt" 2>&1
  gzip -f "$R/${tag}_sass.csv"
  rm -f "$R/$tag.ncu-rep"
  echo "== $c"
  head -n 14 "$R/${tag}_stalls.txt"
  grep -E "DRAM Throughput|Duration|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Registers Per|Achieved Occupancy|Theoretical Occupancy|L1/TEX Hit|L2 Hit" "$R/${tag}_details.txt" | head -n 14
done
