#!/usr/bin/env bash
# Session 14 on the H200 (2026-12-04). The hybrid rows sit at 1.6-1.7x their bound, and the 1M
# trace (session8/c/) has the link busy 90% with two of a layer's three 90 MB tiles streamed
# (67%) where the bound's continuous split streams ~40%. Session 8 part d found finer tiles
# slower, but that was before the early puts (one device_put call for a layer's first tiles), the
# join program and the merge kernel, and the planner, not the run, picked each split there. So:
#   part a: the split itself, measured on one fill per layout (lab/decode_bench.split_sweep,
#           --split_cpu_tiles): after the planned split is timed, the same caches are timed with
#           every hybrid layer's CPU share set to N tiles, alternating with the plan, two rounds.
#           1M at the default tiles (22144 cells, 3 full a layer: 1 or 2 on the CPU) and at
#           --tile_cells=11264 (8960 cells, 7 full: 3 planned, then 4 and 5); 2M int8 (31616
#           cells, ~6 full: 2 planned, then 3 and 4: the plan used v3's fallback int8 CPU rate,
#           0.52 of bf16's bytes/s, where the 512-bit kernel measured 0.747); B=8 x 128K at
#           --tile_cells=3072 (2432-cell tiles, 4 full a layer: 2 planned, then 1 and 3).
# Usage: bash benchmarks/session14_h200.sh a. Results: benchmarks/results/beyond_hbm/session14/.
D=/tmp/s14 NAME=s14 PART=${1:-a}
source "$(dirname "$0")/h200_common.sh"
case "$PART" in
  a)
    T=140 run 1m_t9k --configs=rkv_offload --budget=auto --contexts=1048576 --tile_cells=11264 \
      --split_cpu_tiles=4,5
    T=130 run 1m_t22k --configs=rkv_offload --budget=auto --contexts=1048576 --split_cpu_tiles=2
    T=130 run b8_t3072 --configs=rkv_offload --budget=auto --contexts=131072 --batch=8 \
      --tile_cells=3072 --split_cpu_tiles=1,3
    T=150 run 2m_int8 --configs=rkv_offload --budget=auto --contexts=2097152 --kv_dtype=int8 \
      --split_cpu_tiles=3,4
    ;;
esac
echo "== done $(date +%T)"
