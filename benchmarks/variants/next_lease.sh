#!/usr/bin/env bash
# The queued GPU experiments, in two device calls of under ten minutes each (H100 or H200; name the card with the
# figures). From the repository root on the device:
#
#     bash benchmarks/variants/next_lease.sh a   # half-tile GPU tests at the new default; two heads at head_dim 256
#     bash benchmarks/variants/next_lease.sh b   # eq. 12's verdict overridden at 16 rows; two heads at head_dim 96
#     bash benchmarks/variants/next_lease.sh c   # 64-token tiles where one side is channel-wise in groups of 64 or
#                                                # 128 and the other token-wise in two groups a token (the launcher's
#                                                # "mix follows the side with more groups", not measured): AOT 6-9%
#                                                # fewer SASS per byte, no spill (sm_90)
set -u
OUT=${OUT:-/tmp/next_lease}
export OUT
case "${1:-a}" in
  a) bash benchmarks/variants/run_pack_d256.sh ;;
  b) timeout 330 python3 benchmarks/variants/fold_or_dequant.py --out "$OUT/fold_or_dequant.json" 2>&1 | grep -v Warning
     bash benchmarks/variants/run_masked_heads.sh ;;
  c) nvidia-smi --query-gpu=name --format=csv,noheader
     timeout 300 python3 benchmarks/ab_kernel.py --options n64=block_n:64 --heads 32/8 --rounds 2 \
         --cases 2:channel64/token64:8x65536,2:channel/token64:8x65536,2:token64/channel64:8x65536,2:token64/channel:8x65536,2:token64/token64:8x65536 \
         --out "$OUT/block64_mixed_32x8.json" 2>&1 | grep -v Warning ;;
  *) echo "next_lease.sh a|b|c" >&2; exit 2 ;;
esac
