#!/usr/bin/env bash
# Launch options the defaults do not pick, timed beside them (ab_kernel.py --options, CUDA graphs, alternating
# rounds, errors against float64): two packed KV heads where V is channel-wise in groups of half a tile (16
# tokens; the defaults take one head since packed heads spilled, before 219200f), and 64-token tiles at head_dim 64.
# From the repository root on the device.
set -u
OUT=${OUT:-/tmp/options}
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 330 python3 benchmarks/ab_kernel.py --options p2=pack_heads:2 --heads 32/8 --rounds 2 \
    --cases 2:channel16/channel16:8x65536,2:token/channel16:8x65536,4:token/channel16:8x65536,8:token/channel16:8x65536,2:channel16/channel:8x65536,2:channel32/channel16:8x65536,2:token32/channel16:8x65536,4:channel16/channel16:8x65536 \
    --out "$OUT/pack2_half_tile_32x8.json" 2>&1 | grep -v Warning
timeout 150 python3 benchmarks/ab_kernel.py --options n64=block_n:64 --heads 32/8 --head-dim 64 --rounds 2 \
    --cases 2:token32/token32:8x65536,2:token64/token64:8x65536,4:token32/token32:8x65536,2:channel/channel:8x65536 \
    --out "$OUT/block64_d64_32x8.json" 2>&1 | grep -v Warning
