#!/usr/bin/env bash
# Issue 18's GPU checks and timings of the register-operand kernel's layouts, in device calls of under ten
# minutes each. From the repository root on the device:
#
#     bash benchmarks/layouts_gpu.sh ragged       # ragged row blocks (17, 21, 25, 31 query rows per KV head; 9 and
#                                                 #   13 at head_dim 256): checked against float64, then timed
#                                                 #   beside 16 and 18 rows per KV head at 8 x 64K
#     bash benchmarks/layouts_gpu.sh small        # the timed layout grid at 1 x 16K beside cuDNN (checked at 1 x 2K)
#     bash benchmarks/layouts_gpu.sh small_both   # the same grid at 1 x 4K and 1 x 16K
#     bash benchmarks/layouts_gpu.sh grids        # the timed grid at 8 x 64K, 1 x 4K and 1 x 16K (what docs/perf.md cites)
#     bash benchmarks/layouts_gpu.sh small_sweep  # launch options of the two slowest 1 x 16K layouts against cuDNN
#     bash benchmarks/layouts_gpu.sh split_sweep  # tokens per split at small shapes (benchmarks/split_sweep.py)
#     bash benchmarks/layouts_gpu.sh g16wide      # channel-wise groups of 16 tokens past 128 channels: checked,
#                                                 #   timed beside the Triton kernel at 8 x 64K, and at 1 x 16K
#     bash benchmarks/layouts_gpu.sh masked       # token-wise groups across a padded head_dim's bit fields (head_dim
#                                                 #   96, 160, 192): checked, then timed at 8 x 64K and 1 x 16K; with
#                                                 #   OLD=dir (a tree of foldc before the operand pieces, e.g.
#                                                 #   `git archive 8b6d7cf foldc | tar -x -C dir`) head_dim 96 by it too
#     bash benchmarks/layouts_gpu.sh value_tiles  # value tiles stored for conflict-free reads (benchmarks/value_tile_layout.py)
#     bash benchmarks/layouts_gpu.sh value_tiles_split  # the same, each side's placement alone
#     bash benchmarks/layouts_gpu.sh swizzled_tiles  # tiles of 16+ words a token swizzled (benchmarks/swizzled_tiles.py)
#     bash benchmarks/layouts_gpu.sh full_check   # every layout of the full grid (396) checked against float64 for
#                                                 #   bf16 and fp16 queries at 2 x 4K, in 12 processes side by side
#
# Each step runs under its own time limit; its output goes to $OUT/<step>.log (and JSON where the script writes
# one), and a line per step to $OUT/summary.txt. Figures go to docs/perf.md with their command, never into a test.
set -u
OUT=${OUT:-/tmp/layouts_gpu}
. "$(dirname "$0")/gpu_step.sh"   # step NAME SECONDS COMMAND...
RAGGED="token:2:128,token:2:128,32/2,128;token:2:128,token:2:128,34/2,128;token:2:128,token:2:128,36/2,128"
RAGGED="$RAGGED;token:2:128,token:2:128,50/2,128;token:2:128,token:2:128,62/2,128;token:2:128,token:2:128,64/2,128"
RAGGED="$RAGGED;token:4:128,token:4:128,16/2,256;token:4:128,token:4:128,18/2,256;token:4:128,token:4:128,20/2,256"
G16WIDE="channel:2:16,token:2:128,32/8,256;token:4:128,channel:4:16,32/8,256;channel:2:16,channel:2:16,32/8,256"
G16WIDE="$G16WIDE;channel:8:16,token:4:64,16/4,256;token:2:128,channel:2:16,16/8,256"
G16WIDE="$G16WIDE;channel:4:16:fp32,channel:2:16,8/8,256;channel:4:16,token:4:80,32/8,160;channel:2:32,token:2:128,32/8,256"
G16WIDE="$G16WIDE;channel:4:16,token:2:128,72/8,256;channel:2:16,channel:2:16,16/2,256;token:4:128,channel:4:16,64/8,256"
MASKED="token:2:32,token:2:32,32/8,96;token:4:32,token:4:32,32/8,96;token:8:48,token:8:32,32/8,96"
MASKED_NEW="token:2:32,token:2:32,32/8,160;token:4:32,token:4:32,32/8,160;token:8:32,token:8:32,32/8,160"
MASKED_NEW="$MASKED_NEW;token:2:32,token:2:32,32/8,192;token:4:32,token:8:32,16/8,192;token:2:32,none,32/8,192"
case "${1:-ragged}" in
  value_tiles)   # benchmarks/value_tile_layout.py: value tiles whose reads meet no bank conflicts, beside main, each
    # also at maxnreg 168 (the variant takes 178 registers at INT2 head_dim 128: 8 programs an SM rather than 12)
    step value_tiles 420 python3 benchmarks/ab_kernel.py --out "$OUT/value_tiles.json" \
        --variant value_tiles=benchmarks/value_tile_layout.py --variant value_tiles_168=benchmarks/value_tile_layout.py \
        --variant-options value_tiles_168=maxnreg:168 --options main_168=maxnreg:168 \
        --rounds 2 --cases 2:token/token:8x65536,4:token/token:8x65536,2:token/token:32x16384
    # head_dim 64 at 2 bits (37% of the ceiling; its short-scoreboard stalls wait at the shifts after the value reads)
    step value_tiles_d64 150 python3 benchmarks/ab_kernel.py --out "$OUT/value_tiles_d64.json" --head-dim 64 \
        --variant value_tiles=benchmarks/value_tile_layout.py --rounds 2 --cases 2:token64/token64:8x65536
    ;;
  value_tiles_split)   # which side's placement pays: value tiles only, key tiles only, both (value_tile_layout.py)
    V=benchmarks/value_tile_layout.py
    VARIANTS="--variant both=$V --variant values=$V:values_only --variant keys=$V:keys_only"
    step split_d128 200 python3 benchmarks/ab_kernel.py --out "$OUT/split_d128.json" $VARIANTS --rounds 2 \
        --cases 2:token/token:8x65536,4:token/token:8x65536,2:channel/token:8x65536,4:token/token:32x16384
    step split_d64 120 python3 benchmarks/ab_kernel.py --out "$OUT/split_d64.json" --head-dim 64 $VARIANTS --rounds 2 \
        --cases 2:token64/token64:8x65536,4:token64/token64:8x65536,2:token64/token64:32x16384
    step split_d256 120 python3 benchmarks/ab_kernel.py --out "$OUT/split_d256.json" --head-dim 256 $VARIANTS \
        --rounds 2 --cases 2:token/token:8x32768,4:token/token:8x32768
    step split_gqa16 100 python3 benchmarks/ab_kernel.py --out "$OUT/split_gqa16.json" --heads 64/4 $VARIANTS \
        --rounds 2 --cases 2:token/token:8x65536,4:token/token:8x65536
    ;;
  swizzled_tiles)   # code tiles of 16+ words a token swizzled in 32-byte units (benchmarks/swizzled_tiles.py)
    S=benchmarks/swizzled_tiles.py
    VARIANTS="--variant both=$S --variant keys=$S:keys_only --variant values=$S:values_only"
    step swz_d128 240 python3 benchmarks/ab_kernel.py --out "$OUT/swz_d128.json" $VARIANTS --rounds 3 \
        --cases 4:token/token:8x65536,4:token/token:32x16384,8:token/token:8x65536,2:token/token:8x65536
    step swz_d256 120 python3 benchmarks/ab_kernel.py --out "$OUT/swz_d256.json" --head-dim 256 $VARIANTS \
        --rounds 3 --cases 2:token/token:8x32768,4:token/token:8x32768
    step swz_gqa16 100 python3 benchmarks/ab_kernel.py --out "$OUT/swz_gqa16.json" --heads 64/4 $VARIANTS \
        --rounds 3 --cases 4:token/token:8x65536
    ;;
  masked)
    step masked_checks 260 python3 -m pytest -q tests/backends/test_gluon_gpu.py -k "generated_layouts and (d96 or d160 or d192)"
    step masked_times 150 python3 benchmarks/layout_times.py --shape 8x65536 --out "$OUT/masked_times.json" \
        --layouts "$MASKED;$MASKED_NEW"
    if [ -n "${OLD:-}" ]; then
        step masked_times_old 60 env PYTHONPATH="$OLD" python3 benchmarks/layout_times.py --shape 8x65536 \
            --out "$OUT/masked_times_old.json" --layouts "$MASKED"
    fi
    step masked_small 100 python3 benchmarks/layout_times.py --shape 1x16384 --out "$OUT/masked_small.json" \
        --layouts "$MASKED;$MASKED_NEW"
    ;;
  full_check)
    step full_check 580 python3 -m foldc bench --layouts --grid full --check-only --jobs "${JOBS:-12}" \
        --out "$OUT/full_check"
    ;;
  ragged)
    step ragged_checks 330 python3 -m pytest -q -x tests/backends/test_gluon_gpu.py -k "ragged"
    step ragged_times 240 python3 benchmarks/layout_times.py --shape 8x65536 --out "$OUT/ragged_times.json" \
        --layouts "$RAGGED"
    ;;
  g16wide)   # channel-wise groups of 16 tokens past 128 channels: checked, then timed beside the Triton kernel
    step g16wide_checks 300 python3 -m pytest -q tests/backends/test_gluon_gpu.py -k "generated_layouts and (d256 or d160)"
    step g16wide_times 280 python3 benchmarks/layout_times.py --shape 8x65536 --triton --out "$OUT/g16wide_times.json" \
        --layouts "$G16WIDE"
    step g16wide_small 150 python3 benchmarks/layout_times.py --shape 1x16384 --out "$OUT/g16wide_small.json" \
        --layouts "$G16WIDE"
    ;;
  small)
    step small 570 python3 -m foldc bench --layouts --grid timed --shapes 1x16384 --check-shape 1x2048 \
        --out "$OUT/small"
    ;;
  small_both)   # the timed grid at 1 x 4K and 1 x 16K beside cuDNN (checked at 1 x 2K): the split rule's effect
    step small_both 580 python3 -m foldc bench --layouts --grid timed --shapes 1x4096,1x16384 --check-shape 1x2048 \
        --out "$OUT/small_both"
    ;;
  grids)   # the timed grid at 8 x 64K, then at 1 x 4K and 1 x 16K, beside cuDNN, in one call
    step grid_8x64k 215 python3 -m foldc bench --layouts --grid timed --out "$OUT/grid_8x64k"
    step grid_small 355 python3 -m foldc bench --layouts --grid timed --shapes 1x4096,1x16384 --check-shape 1x2048 \
        --out "$OUT/grid_small"
    ;;
  small_sweep)   # the 1 x 16K layout slower than cuDNN on 2026-12-01 (K channel:4:64 / V token:4:64, 64/4) over
    #              splits, tiles and stages; then the same for token-wise INT2 at 64/2 (1.05x cuDNN then)
    step sweep_c4 280 python3 benchmarks/gluon_sweep.py --out "$OUT/sweep_c4_64x4.json" --bits 4 \
        --layouts channel/token --group 64 --heads 64/4 --shapes 1x16384 --pack 1 --block-n 32,64 --stages 2,3 \
        --maxnreg none --split-factor 0.5,1,2,4 --scale-ahead 0
    step sweep_t2 280 python3 benchmarks/gluon_sweep.py --out "$OUT/sweep_t2_64x2.json" --bits 2 \
        --layouts token/token --group 128 --heads 64/2 --shapes 1x16384 --pack 1 --block-n 32,64 --stages 2,3 \
        --maxnreg none --split-factor 0.5,1,2,4 --scale-ahead 0
    ;;
  split_sweep)   # tokens per split at small shapes: each layout's default split count against fewer splits
    L="channel:4:64,token:4:64,64/4,128;token:2:128,token:2:128,64/2,128;token:2:128,token:2:128,32/8,128"
    L="$L;token:4:128,token:4:128,32/8,128;token:8:128,token:8:128,32/8,128;token:2:64,token:2:64,32/8,64"
    L="$L;token:2:128,token:2:128,32/8,256;token:2:32,token:2:32,64/4,128;token:2:128,token:2:128,8/8,128"
    step split_sweep 560 python3 benchmarks/split_sweep.py --shapes 1x4096,1x16384,1x65536,4x16384 \
        --out "$OUT/split_sweep.json" --layouts "$L"
    ;;
  *)
    echo "unknown step ${1}: see the list at the top of this script" >&2
    exit 2
    ;;
esac
