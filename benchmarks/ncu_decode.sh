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
CASES=("2 8 65536 1 32 auto 128 128 64/4" "2 8 65536 2 64 auto 128 128 32/8" "4 8 65536 1 32 auto 128 128 64/4")
[ $# -gt 0 ] && CASES=("$@")
HEAD="DRAM Throughput|Duration|Issue Slots Busy|No Eligible|Eligible Warps|Warp Cycles Per Issued|Registers Per"
HEAD="$HEAD|Achieved Occupancy|Theoretical Occupancy|Block Limit Registers"
for c in "${CASES[@]}"; do
  tag=$(echo "$c" | tr ' /' '__')
  echo "== $c"
  # the profiler takes the third decode launch (the first two compile and warm up)
  timeout 150 ncu --clock-control none -k regex:foldc_decode --launch-skip 2 -c 1 --set full --import-source no \
      -o "$R/$tag" python3 benchmarks/ncu_one.py $c > "$R/$tag.log" 2>&1
  ncu --import "$R/$tag.ncu-rep" --page source --csv --print-source sass > "$R/${tag}_sass.csv" 2>/dev/null
  ncu --import "$R/$tag.ncu-rep" --page details > "$R/${tag}_details.txt" 2>&1
  python3 benchmarks/ncu_stalls.py "$R/${tag}_sass.csv" > "$R/${tag}_stalls.txt" 2>&1
  gzip -f "$R/${tag}_sass.csv"
  rm -f "$R/$tag.ncu-rep"
  head -n 16 "$R/${tag}_stalls.txt"
  grep -E "$HEAD" "$R/${tag}_details.txt" | head -n 16
done
