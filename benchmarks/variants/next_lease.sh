#!/usr/bin/env bash
# The queued GPU experiments, in two device calls of under ten minutes each (H100 or H200; name the card with the
# figures). From the repository root on the device:
#
#     bash benchmarks/variants/next_lease.sh a   # half-tile GPU tests at the new default; two heads at head_dim 256
#     bash benchmarks/variants/next_lease.sh b   # eq. 12's verdict overridden at 16 rows; two heads at head_dim 96
set -u
OUT=${OUT:-/tmp/next_lease}
export OUT
case "${1:-a}" in
  a) bash benchmarks/variants/run_pack_d256.sh ;;
  b) timeout 330 python3 benchmarks/variants/fold_or_dequant.py --out "$OUT/fold_or_dequant.json" 2>&1 | grep -v Warning
     bash benchmarks/variants/run_masked_heads.sh ;;
  *) echo "next_lease.sh a|b" >&2; exit 2 ;;
esac
