# Sourced by the device scripts (benchmarks/host_path_gpu.sh, benchmarks/layouts_gpu.sh): `step NAME SECONDS
# COMMAND...` runs COMMAND under its own time limit, its output to $OUT/NAME.log, and a line per step (exit
# status, seconds, the log's last line) to $OUT/summary.txt. The caller sets OUT.
mkdir -p "$OUT"
export PYTHONPATH=.
step() {
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - start))s: $(tail -n 1 "$OUT/$name.log")" | tee -a "$OUT/summary.txt"
}
