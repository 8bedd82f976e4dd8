#!/usr/bin/env bash
# The GPU checks and host-time figures of the eager launch path (bound launches through foldc's C launcher, the
# serving caches' decode-step fast paths, the paged append that moves its offsets, FoldLinear's per-stream
# buffers), in four device calls of under ten minutes each. From the repository root on the device:
#
#     bash benchmarks/host_path_gpu.sh merged     # eager calls merging inside the decode: checked, timed
#     bash benchmarks/host_path_gpu.sh merge_barriers  # its grid barrier's variants beside production
#     bash benchmarks/host_path_gpu.sh gluon_second_half  # the register-operand kernel's GPU tests from the 226th
#     bash benchmarks/host_path_gpu.sh gemv_imma  # the GEMV at m = 1 on int8 tensor-core operands beside production
#     bash benchmarks/host_path_gpu.sh value_scale  # token-wise values of 1e-4 to 1e7 against float64 (GPU test)
#     bash benchmarks/host_path_gpu.sh unrun2     # what landed 2026-12-07 afternoon with no GPU, checked
#     bash benchmarks/host_path_gpu.sh checks     # correctness against float64 / quantize's bits, real driver:
#     bash benchmarks/host_path_gpu.sh checks2    #   the serving caches and Gluon kernels, then Triton, GEMV, nn
#     bash benchmarks/host_path_gpu.sh times      # host time per call beside cuDNN, DynamicCache, nn.Linear
#     bash benchmarks/host_path_gpu.sh hf         # examples/hf_decode.py eager, rounds alternating in one process
#     bash benchmarks/host_path_gpu.sh pending    # what changed since the last H200 run, checked (two-encoding and
#     bash benchmarks/host_path_gpu.sh pending_times  # one-body pair appends, Bound.then, the pool bound, act-order
#                                                 #   FoldLinear, the per-forward mask read), then timed (host time,
#                                                 #   spill twins)
#     bash benchmarks/host_path_gpu.sh gemv_split # the GEMV's split at INT2, INT4, INT8 (launch options)
#     bash benchmarks/host_path_gpu.sh gemv_warps # the GEMV in programs of 2 and 4 warps; the read floor per shape
#     bash benchmarks/host_path_gpu.sh gemv_unrolled_ncu  # the chunk loop unrolled by stages; ncu at 28672 x 8192
#     bash benchmarks/host_path_gpu.sh gemv_m16_programs  # m = 16 in programs of 2 and 4 warps sharing the
#                                                 #   activation's tile; the GEMV's defaults at every size
#     bash benchmarks/host_path_gpu.sh gemv_xrows_check  # the activation's rows in shared memory at m > 8: the
#                                                 #   GEMV's GPU tests, then production beside the kernel before it
#     bash benchmarks/host_path_gpu.sh gemv_chunk_k  # chunks of 128 and 512 channels of k (`gemv_chunk_k`): the
#                                                 #   GEMV's float64 property test (which draws them), then timed
#                                                 #   beside the defaults, INT2 and INT4 at m = 1 and 16
#     bash benchmarks/host_path_gpu.sh gemv_int4_wave  # the GEMV's and FoldLinear's GPU tests, then INT4 in 512-channel
#                                                 #   chunks with splits that keep one wave
#     bash benchmarks/host_path_gpu.sh targets    # on the H200: the GEMV's target table, INT4 in 512-channel chunks,
#                                                 #   the layout grid at 8 x 64K
#     bash benchmarks/host_path_gpu.sh gemv_persistent  # benchmarks/gemv_persistent.py's two kernels beside production
#     bash benchmarks/host_path_gpu.sh gemv_split_waves  # the GEMV's split k against waves; the persistent variant more
#     bash benchmarks/host_path_gpu.sh gemv_block_rows   # one-warp programs of 32 and 64 channels at m = 1
#     bash benchmarks/host_path_gpu.sh gemv_wsplit       # each program's chunks split among one-warp partitions
#     bash benchmarks/host_path_gpu.sh unrun      # what landed 2026-12-06 evening to 2026-12-07 with no GPU: every
#                                                 #   layout of the full grid checked, the GEMV's, FoldLinear's and the
#                                                 #   GEMM's GPU tests (past 2**31 elements, the executor on the GPU)
#     bash benchmarks/host_path_gpu.sh pdl_patch  # after `git apply benchmarks/variants/gemv_pdl_production.patch`
#                                                 #   and `git show HEAD:foldc/backends/gluon/gemv.py >
#                                                 #   benchmarks/_gemv_b.py`: its GPU tests, then production (PDL in
#                                                 #   graphs) beside the kernel before it and itself launched plain
#     bash benchmarks/host_path_gpu.sh gemm_wgmma # the async-wgmma dequant GEMM experiment: checked, then timed
#     bash benchmarks/host_path_gpu.sh gemm_wgmma_small  # the same at m = 1 and 16 (block_m 32, split k), graphed
#     bash benchmarks/host_path_gpu.sh kernels_then_wgmma_check   # two calls of under ten minutes for a short
#     bash benchmarks/host_path_gpu.sh wgmma_times_all            #   lease: the landed kernels' tests, the experiment
#
# Each step runs under its own time limit; its output goes to $OUT/<step>.log (and JSON where the script
# writes one), and a line per step to $OUT/summary.txt. Figures go to docs/perf.md and docs/gemm.md with
# their command, never into a test.
set -u
OUT=${OUT:-/tmp/host_path_gpu}
. "$(dirname "$0")/gpu_step.sh"   # step NAME SECONDS COMMAND...
case "${1:-checks}" in
  merged)   # the eager call that merges its splits inside the decode (split_merge.py, acquire-load barrier of
    # 2026-12-07): its GPU test, then two launches against one, then the host time of a whole call (500 s of limits)
    step merge_test 150 python3 -m pytest -q -x -p no:cacheprovider tests/backends/test_gluon_gpu.py -k merge_their_splits
    step grid_merge 150 python3 benchmarks/grid_merge.py --out "$OUT/grid_merge.json"
    step launch_cost 90 python3 benchmarks/launch_cost.py --out "$OUT/launch_cost.json"
    step call_overhead 110 python3 benchmarks/call_overhead.py --shape 1x16384 --out "$OUT/call_overhead.json"
    ;;
  unrun2)   # what landed 2026-12-07 afternoon with no GPU: the paged wrapper's repeated call and shared-prefix tables,
    # the merging decode's fallback and residency per query dtype (580 s of limits)
    step paged 300 python3 -m pytest -q -p no:cacheprovider tests/serving/test_paged_gpu.py
    step merging 150 python3 -m pytest -q -p no:cacheprovider tests/backends/test_gluon_gpu.py \
        -k "merge_their_splits or prepared_runs_merge or repeated_calls_reuse"
    step call_overhead 130 python3 benchmarks/call_overhead.py --shape 1x16384 --out "$OUT/call_overhead.json"
    ;;
  gluon_second_half)   # tests/backends/test_gluon_gpu.py from its 226th test on (the whole file does not fit one call;
    # its first half passed on an H100 on 2026-12-07: docs/results/gpu_tests_merged_h100_2026-12-07.txt)
    python3 -m pytest --collect-only -q -p no:cacheprovider tests/backends/test_gluon_gpu.py | grep '::' | \
        tail -n +226 > "$OUT/ids.txt"
    step gluon_second_half 560 python3 -m pytest -q -p no:cacheprovider $(cat "$OUT/ids.txt")
    ;;
  gemv_imma)   # issue 20's GEMV at m = 1 with the codes as int8 MMA operands against the activation's digits
    # (benchmarks/gemv_imma.py, built 2026-12-07 with no GPU): each case checked against float64 beside production,
    # then timed (CUDA graphs, cold L2) at production's split, twice it, and twice it with 4 stages, beside fp16 cuBLAS
    # and torch's INT4 kernel
    step gemv_imma 450 python3 benchmarks/gemv_imma.py --out "$OUT/gemv_imma.json"
    ;;
  value_scale)   # token-wise values of any magnitude (tile_values.value_unit, 2026-12-08): the GPU test written after
    # the change's run, INT8/INT4/INT2 values of 1e-4 to 1e7 against float64 (300 s of limits)
    step any_magnitude 300 python3 -m pytest -q -p no:cacheprovider tests/backends/test_gluon_gpu.py -k any_magnitude
    ;;
  merge_barriers)   # the merging decode's barrier: production beside one packed word and sleeps between polls
    # (benchmarks/variants/merge_barrier.py), every variant checked against float64 by the run
    step barriers 300 python3 benchmarks/grid_merge.py --variants production,packed,sleep --out "$OUT/barriers.json"
    ;;
  checks)
    step append 120 python3 -m pytest -q -x tests/serving/test_append.py -k "gpu"
    step paged 200 python3 -m pytest -q tests/serving/test_paged_gpu.py
    step gluon_bound 150 python3 -m pytest -q tests/backends/test_gluon_gpu.py \
        -k "memo or repeated_calls or without_seq_lens or bound"
    ;;
  gemv_xrows_check)   # the landed X_SHARED 2: the GEMV's GPU tests, then production beside the kernel before it
    step gemv_tests 240 python3 -m pytest -q tests/backends/test_gemv_gluon.py -k gpu
    # benchmarks/_gemv_b.py: the kernel before it, not committed: git show 932582c:foldc/backends/gluon/gemv.py
    step gemv_xrows_ab 300 python3 benchmarks/gemv_ab.py --b benchmarks/_gemv_b.py --quick --cases 5,6,10,11 \
        --b-override '[{"X_SHARED": 0}]' --out "$OUT/gemv_xrows_ab.json"
    ;;
  checks2)
    step triton 240 python3 -m pytest -q tests/backends/test_triton_gpu.py
    step gemv 60 python3 -m pytest -q tests/backends/test_gemv_gluon.py -k gpu
    step linear 60 python3 -m pytest -q tests/test_nn.py -k gpu
    ;;
  times)
    step launch_cost 90 python3 benchmarks/launch_cost.py --out "$OUT/launch_cost.json"
    step call_overhead 120 python3 benchmarks/call_overhead.py --shape 1x16384 --out "$OUT/call_overhead.json"
    step linear_host 60 python3 benchmarks/linear_host.py --out "$OUT/linear_host.json"
    step cache_step 90 python3 benchmarks/cache_step_host.py --out "$OUT/cache_step.json"
    step hf_layer_step 120 python3 benchmarks/hf_layer_step.py --out "$OUT/hf_layer_step.json"
    ;;
  hf)
    L="--layers 16 --hidden 2048 --heads 16/4 --head-dim 128 --vocab 32000 --prompt 8192 --new 256 --batch 1"
    H="--sdpa flash --no-check --rounds 3 --split --sink 0 --window 0"
    step hf_tiny 90 python3 examples/hf_decode.py --new 64 $H
    step hf_tiny_paged 90 python3 examples/hf_decode.py --new 64 --cache paged $H
    step hf_1b_int4 150 python3 examples/hf_decode.py $L --k token:4:128 --v token:4:128 $H
    step hf_1b_int2 150 python3 examples/hf_decode.py $L --k token:2:128 --v token:2:128 $H
    ;;
  pending)   # each step's limit summed: 570 s, under one call's 600 (the paged tests took over 170 s on 2026-12-05)
    step append 80 python3 -m pytest -q -x tests/serving/test_append.py -k "gpu"
    step gluon_bound 110 python3 -m pytest -q tests/backends/test_gluon_gpu.py \
        -k "memo or repeated_calls or without_seq_lens or bound"
    step paged 250 python3 -m pytest -q tests/serving/test_paged_gpu.py
    step linear 50 python3 -m pytest -q tests/test_nn.py -k gpu
    step hf_tiny_check 80 python3 examples/hf_decode.py --new 32
    ;;
  unrun)   # 560 s of limits: the full grid took 135 s on an H100 on 2026-12-06
    step full_check 200 python3 -m foldc bench --layouts --grid full --check-only --jobs 12 --out "$OUT/full_check"
    step gemv_linear 150 python3 -m pytest -q tests/test_nn.py tests/backends/test_gemv_gluon.py -k gpu
    step gemm 150 python3 -m pytest -q tests/backends/test_gemm_triton.py tests/gemm/test_gemm_executor.py -k gpu
    step cache 60 python3 -m pytest -q tests/serving/test_cache.py
    ;;
  pdl_patch)   # 400 s of limits
    step pdl_tests 180 python3 -m pytest -q -x tests/test_nn.py tests/backends/test_gemv_gluon.py -k gpu
    step pdl_ab 220 python3 benchmarks/gemv_ab.py --b benchmarks/_gemv_b.py --variant '{}' --quick \
        --cases 0,1,2,3,4,5,12 --out "$OUT/pdl_ab.json"
    ;;
  pending_times)
    step launch_cost 90 python3 benchmarks/launch_cost.py --out "$OUT/launch_cost.json"
    step call_overhead 120 python3 benchmarks/call_overhead.py --shape 1x16384 --out "$OUT/call_overhead.json"
    step spill_twins 300 python3 benchmarks/spill_twins.py --shape 8x65536 --out "$OUT/spill_twins.json"
    ;;
  gemv_split)   # the production GEMV beside itself at its launch options (twice and half the split among them):
    # INT2 g128 28672 x 8192 (programs of half INT4's bytes at the same chunk count), INT4, INT8 (split 4 was faster)
    step gemv_split 300 python3 benchmarks/gemv_ab.py --b foldc/backends/gluon/gemv.py --cases 2,1,0,8 \
        --out "$OUT/gemv_split.json"
    ;;
  gemv_warps)   # issue 20's GEMV: programs of several warps (gemv_warps) beside one-warp programs, after the GPU
    # tests with them, and the fastest plain read of each timed shape's bytes (what a GEMV can approach there)
    step gemv_tests 120 python3 -m pytest -q tests/backends/test_gemv_gluon.py -k gpu
    step read_floor 90 python3 benchmarks/read_floor.py --out "$OUT/read_floor.json"
    step gemv_warps 370 python3 benchmarks/gemv_ab.py --quick --cases 0,1,2,5,6,9,8 --out "$OUT/gemv_warps.json" \
        --options '[{"gemv_warps": 2}, {"gemv_warps": 4}, {"gemv_warps": 4, "gemv_stages": 4}, {"gemv_warps": 4, "block_rows": 32}, {"gemv_warps": 2, "block_rows": 32}]'
    ;;
  gemv_m16_programs)   # m = 16 with the activation's rows in shared memory (X_SHARED 2): programs of 2 and 4 warps
    # share that tile (fewer activation bytes from L2 per code byte); then the launcher's defaults at every size
    step gemv_m16_programs 330 python3 benchmarks/gemv_ab.py --quick --cases 5,6,11,10 --out "$OUT/gemv_m16_programs.json" \
        --options '[{"gemv_warps": 2}, {"gemv_warps": 4}, {"gemv_warps": 2, "block_rows": 32}, {"gemv_warps": 4, "block_rows": 32}, {"gemv_warps": 2, "block_rows": 64}, {"gemv_warps": 4, "gemv_split": 12}, {"gemv_warps": 4, "block_rows": 32, "gemv_split": 12}, {"gemv_warps": 2, "gemv_split": 12}]'
    step gemv_defaults 200 python3 benchmarks/gemv_check.py --quick --defaults-only --out "$OUT/gemv"
    ;;
  gemv_unrolled_ncu)   # the GEMV's chunk loop unrolled by the pipeline depth (benchmarks/gemv_unrolled.py) beside
    # production, then Nsight Compute on production at 28672 x 8192 (benchmarks/ncu_gemv.sh)
    step gemv_unrolled 150 python3 benchmarks/gemv_ab.py --b benchmarks/gemv_unrolled.py --quick --cases 0,1,2,5,3 \
        --out "$OUT/gemv_unrolled.json"
    step ncu 330 bash benchmarks/ncu_gemv.sh
    ;;
  gemm_wgmma)   # issue 20's m = 256 target: benchmarks/gemm_wgmma.py beside cuBLAS and the Triton template
    step wgmma_check 230 python3 benchmarks/gemm_wgmma.py --check-only --out "$OUT/wgmma"
    step wgmma_times 350 python3 benchmarks/gemm_wgmma.py --time-only --out "$OUT/wgmma"
    ;;
  kernels_then_wgmma_check)   # one call: the landed kernels' GPU tests (append, paged, FoldLinear), then the
    # wgmma experiment's check (590 s of limits)
    step append 100 python3 -m pytest -q -x tests/serving/test_append.py -k "gpu"
    step paged 170 python3 -m pytest -q tests/serving/test_paged_gpu.py
    step linear 60 python3 -m pytest -q tests/test_nn.py -k gpu
    step wgmma_check 250 python3 benchmarks/gemm_wgmma.py --check-only --out "$OUT/wgmma"
    ;;
  wgmma_times_all)   # one call: the experiment timed at m = 64..512, then at m = 1 and 16 (590 s of limits)
    step wgmma_times 330 python3 benchmarks/gemm_wgmma.py --time-only --out "$OUT/wgmma"
    step wgmma_small 260 python3 benchmarks/gemm_wgmma.py --small --out "$OUT/wgmma"
    ;;
  gemv_chunk_k)   # 512 channels of k per chunk: 29% fewer SASS instructions per weight at INT2, m = 1 (AOT, sm_90)
    step gemv_chunk_k_tests 200 python3 -m pytest -q tests/backends/test_gemv_gluon.py -k "gpu_gemv_matches"
    step gemv_chunk_k 360 python3 benchmarks/gemv_ab.py --quick --cases 2,1,0,3,7,10,5 --out "$OUT/gemv_chunk_k.json" \
        --options '[{"gemv_chunk_k": 512}, {"gemv_chunk_k": 128}, {"gemv_chunk_k": 256}]'
    ;;
  gemv_int4_wave)   # the GEMV's GPU tests at the 2-bit defaults of 2026-12-06, FoldLinear's, then INT4 in 512-channel
    # chunks with splits that keep one wave (136 registers: 15 warps an SM, where default_split asks for 16)
    step gemv_tests 200 python3 -m pytest -q tests/backends/test_gemv_gluon.py -k gpu
    step linear 60 python3 -m pytest -q tests/test_nn.py -k gpu
    step gemv_int4_wave 300 python3 benchmarks/gemv_ab.py --quick --cases 0,3,1,4 --out "$OUT/gemv_int4_wave.json" \
        --options '[{"gemv_chunk_k": 512}, {"gemv_chunk_k": 512, "gemv_split": 7}, {"gemv_chunk_k": 512, "gemv_split": 6}, {"gemv_chunk_k": 512, "gemv_split": 5}, {"gemv_chunk_k": 512, "gemv_split": 4}]'
    ;;
  targets)   # one call on the H200: issue 20's GEMV table at the launcher's defaults (each checked first), INT4 in
    # 512-channel chunks beside them, then issue 18's timed layout grid at 8 x 64K beside cuDNN (on an H100 the first
    # two took 78 and 22 s, and the grid did not finish 27 of its 35 rows in 240 s)
    step gemv_defaults 130 python3 benchmarks/gemv_check.py --quick --defaults-only --out "$OUT/gemv"
    step gemv_int4_512 60 python3 benchmarks/gemv_ab.py --quick --cases 0,3,1 --out "$OUT/gemv_int4_512.json" \
        --options '[{"gemv_chunk_k": 512}, {"gemv_chunk_k": 512, "gemv_split": 6}, {"gemv_chunk_k": 512, "gemv_split": 4}]'
    step grid_8x64k 390 python3 -m foldc bench --layouts --grid timed --out "$OUT/grid_8x64k"
    ;;
  gemv_persistent)   # benchmarks/gemv_persistent.py beside production: resident programs streaming (block, split) items
    for kern in foldc_gemv_persistent foldc_gemv_persistent_late; do
      step "$kern" 150 python3 benchmarks/gemv_ab.py --b benchmarks/gemv_persistent.py --b-kernel "$kern" --quick \
          --cases 0,1,3,4 --options '[{"gemv_split": 16}]' --out "$OUT/$kern.json" \
          --b-override '[{"_programs_per_sm": 12}, {"_programs_per_sm": 15}, {"_programs_per_sm": 12, "_options": {"gemv_split": 16}}, {"_programs_per_sm": 15, "_options": {"gemv_split": 16}}]'
    done
    ;;
  gemv_split_waves)   # the GEMV's split k against the waves of resident programs it makes (m = 1), then the persistent
    # variant at INT2 and m = 16 (12 and 8 programs per SM: what 136 and 182 registers let reside)
    step gemv_split_waves 300 python3 benchmarks/gemv_ab.py --quick --cases 0,1,2,3,4 --out "$OUT/gemv_split_waves.json" \
        --options '[{"gemv_split": 2}, {"gemv_split": 4}, {"gemv_split": 5}, {"gemv_split": 6}, {"gemv_split": 7}, {"gemv_split": 8}, {"gemv_split": 10}, {"gemv_split": 12}, {"gemv_split": 16}]'
    step gemv_persistent_more 150 python3 benchmarks/gemv_ab.py --b benchmarks/gemv_persistent.py --quick --cases 2,5,6 \
        --b-kernel foldc_gemv_persistent --out "$OUT/gemv_persistent_more.json" \
        --b-override '[{"_programs_per_sm": 12}, {"_programs_per_sm": 8}, {"_programs_per_sm": 12, "_options": {"gemv_split": 8}}]'
    ;;
  gemv_block_rows)   # one-warp programs of 32 and 64 output channels at m = 1 (18-27% fewer SASS per weight ahead of
    # time, 128-255 registers), at the launcher's split and at half and twice it
    step gemv_block_rows 300 python3 benchmarks/gemv_ab.py --quick --cases 0,1,2,3,4,12 --out "$OUT/gemv_block_rows.json" \
        --options '[{"block_rows": 32}, {"block_rows": 64}, {"block_rows": 32, "gemv_split": 4}, {"block_rows": 32, "gemv_split": 8}, {"block_rows": 32, "gemv_split": 16}, {"block_rows": 64, "gemv_split": 8}]'
    ;;
  gemv_wsplit)   # benchmarks/gemv_wsplit.py: each program's chunks split among four one-warp partitions of one CTA
    # (gl.warp_specialize; launched with num_warps=4 for the idle default partition, maxnreg=64), split k across CTAs
    # 1-4, beside production
    step gemv_wsplit 200 python3 benchmarks/gemv_ab.py --b benchmarks/gemv_wsplit.py --quick --cases 0,1,3,4,2 \
        --out "$OUT/gemv_wsplit.json" --b-override '[{"num_warps": 4, "maxnreg": 64, "_options": {"gemv_split": 1}}, {"num_warps": 4, "maxnreg": 64, "_options": {"gemv_split": 2}}, {"num_warps": 4, "maxnreg": 64, "_options": {"gemv_split": 3}}, {"num_warps": 4, "maxnreg": 64, "_options": {"gemv_split": 4}}]'
    ;;
  gemm_wgmma_small)   # issue 20's m = 1 and 16 targets: the same kernel at block_m = 32 with split k
    step wgmma_small 300 python3 benchmarks/gemm_wgmma.py --small --out "$OUT/wgmma"
    ;;
  *)
    echo "usage: bash benchmarks/host_path_gpu.sh checks|checks2|times|hf|pending|pending_times|gemv_split|gemv_warps|gemv_unrolled_ncu|gemv_chunk_k|gemv_int4_wave|targets|gemv_persistent|gemv_split_waves|gemv_block_rows|gemv_wsplit|gemm_wgmma|gemm_wgmma_small|kernels_then_wgmma_check|wgmma_times_all" >&2
    exit 2
    ;;
esac
