#!/usr/bin/env bash
# Nsight Compute on the register-operand GEMV at 28672 x 8192 (INT4 and INT2 at m = 1, INT4 at m = 16): stall
# samples by SASS opcode (benchmarks/ncu_stalls.py) and the details page, from the repository root on the device:
#     OUT=... bash benchmarks/ncu_gemv.sh
D=$OUT; export OUT=/tmp/o; mkdir -p $OUT; export PYTHONPATH=.
which ncu || ls /usr/local/cuda*/bin/ncu
for c in "k-group:4:128 28672 8192 1" "k-group:2:128 28672 8192 1" "k-group:4:128 28672 8192 16"; do
  tag=$(echo $c | tr ' :' '__')
  timeout 150 ncu --clock-control none -k regex:foldc_gemv -c 1 --set full --import-source no -o $OUT/$tag python3 benchmarks/gemv_one.py $c > $OUT/$tag.log 2>&1
  ncu --import $OUT/$tag.ncu-rep --page source --csv --print-source sass > $OUT/${tag}_sass.csv 2>/dev/null
  ncu --import $OUT/$tag.ncu-rep --page details > $OUT/${tag}_details.txt 2>&1
  python3 benchmarks/ncu_stalls.py $OUT/${tag}_sass.csv > $OUT/${tag}_stalls.txt 2>&1
  gzip -f $OUT/${tag}_sass.csv
  echo "== $c"; cat $OUT/${tag}_stalls.txt | head -20; grep -E "DRAM Throughput|Duration|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Registers Per|Achieved Occupancy|Theoretical Occupancy|L2 Hit|L1/TEX Hit|Mem Busy|Max Bandwidth" $OUT/${tag}_details.txt | head -20
done
tar czf $D/ncu.tgz --exclude="*.ncu-rep" -C /tmp/o .
