# Sourced by the Nsight Compute scripts (benchmarks/ncu_gemv.sh, benchmarks/ncu_gemm_smem_b.sh):
#     ncu_case DIR TAG KERNEL_REGEX HEADLINES COMMAND...
# profiles the first launch of a kernel matching KERNEL_REGEX under COMMAND (--set full) into DIR/TAG*: the
# stall samples by SASS opcode (benchmarks/ncu_stalls.py), the details page, and prints both, the details
# filtered by the extended regular expression HEADLINES. NCU_SKIP=N: profile the launch after the first N instead.
ncu_case() {
  local dir=$1 tag=$2 kern=$3 headlines=$4
  shift 4
  timeout 150 ncu --clock-control none -k "regex:$kern" --launch-skip "${NCU_SKIP:-0}" -c 1 --set full \
      --import-source no -o "$dir/$tag" "$@" > "$dir/$tag.log" 2>&1
  ncu --import "$dir/$tag.ncu-rep" --page source --csv --print-source sass > "$dir/${tag}_sass.csv" 2>/dev/null
  ncu --import "$dir/$tag.ncu-rep" --page details > "$dir/${tag}_details.txt" 2>&1
  python3 benchmarks/ncu_stalls.py "$dir/${tag}_sass.csv" > "$dir/${tag}_stalls.txt" 2>&1
  gzip -f "$dir/${tag}_sass.csv"
  rm -f "$dir/$tag.ncu-rep"
  head -n 16 "$dir/${tag}_stalls.txt"
  grep -E "$headlines" "$dir/${tag}_details.txt" | head -n 16
}
