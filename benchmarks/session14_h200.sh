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
#   part b: (after part a's B=8 call stopped at ResidencyConfig's min_tile_cells=4096 > 3072, it
#           now passes --min_tile_cells=2048) more tile sizes: 1M at 16384 / 8192, 2M int8 at
#           16384, 128K at budget=fraction (half the layers on the host) at the default and 11264.
#   part c: a second machine, whole-run A/B without the sweep: the best layouts of parts a/b
#           against the defaults, alternating over two rounds (c/); then the 2M int8 split sweep.
#   part d: session13_h200.sh parts b and d (XLA's block-level rewriter and heroless priority
#           fusion flags, RKV_FUSED_NORM=1) at resident 2K / 32K, alternating over two rounds (d/).
#   part e: session13_h200.sh part c (the decode split floor at 128 / 256 / 512 keys), 2K / 8K /
#           32K, alternating over two rounds: `D=/tmp/s14 T=70 bash benchmarks/session13_h200.sh c`
#           (results in splitfloor/, its archive named s14_c.tgz as part c's).
# Results (H200 logs and JSON): benchmarks/results/beyond_hbm/session14/{a,b,c,d,splitfloor}/;
# pytest_gpu_pallas.txt is a GPU pytest run cut by its time limit (no failure in what ran).
# Usage: bash benchmarks/session14_h200.sh a|b|c|d.
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
  b)
    T=130 run 1m_t16k --configs=rkv_offload --budget=auto --contexts=1048576 --tile_cells=16384 \
      --split_cpu_tiles=1,3
    T=130 run 1m_t7k --configs=rkv_offload --budget=auto --contexts=1048576 --tile_cells=8192 \
      --split_cpu_tiles=3,5
    T=130 run b8_t3072 --configs=rkv_offload --budget=auto --contexts=131072 --batch=8 \
      --tile_cells=3072 --min_tile_cells=2048 --split_cpu_tiles=1,3
    T=150 run 2m_int8_t16k --configs=rkv_offload --budget=auto --contexts=2097152 \
      --kv_dtype=int8 --tile_cells=16384 --split_cpu_tiles=5,6
    T=100 run half128 --configs=rkv_offload --budget=fraction --contexts=131072
    T=100 run half128_t9k --configs=rkv_offload --budget=fraction --contexts=131072 \
      --tile_cells=11264 --split_cpu_tiles=4,5
    ;;
  c)
    for round in 1 2; do
      T=130 run 1m_t22k_$round --configs=rkv_offload --budget=auto --contexts=1048576
      T=130 run 1m_t16k_$round --configs=rkv_offload --budget=auto --contexts=1048576 \
        --tile_cells=16384
      T=100 run b8_def_$round --configs=rkv_offload --budget=auto --contexts=131072 --batch=8
      T=100 run b8_t3072_$round --configs=rkv_offload --budget=auto --contexts=131072 --batch=8 \
        --tile_cells=3072 --min_tile_cells=2048
    done
    T=100 run half128_def --configs=rkv_offload --budget=fraction --contexts=131072
    T=100 run half128_t16k --configs=rkv_offload --budget=fraction --contexts=131072 \
      --tile_cells=16512 --split_cpu_tiles=2,3 --sweep_rounds=1
    T=150 run 2m_int8_3 --configs=rkv_offload --budget=auto --contexts=2097152 --kv_dtype=int8 \
      --split_cpu_tiles=3 --sweep_rounds=1
    ;;
  d)
    BLR=--xla_gpu_experimental_enable_fusion_block_level_rewriter=true
    HPF=--xla_gpu_experimental_enable_triton_heroless_priority_fusion=true
    res() { local tag=$1; shift; T=${T:-100} run res_$tag --configs=rkv_resident \
              --budget=fraction --contexts=2048,32768 "$@"; }
    for round in 1 2; do
      res base_$round
      XLA_FLAGS=$BLR res blr_$round
      XLA_FLAGS=$HPF res hpf_$round
      RKV_FUSED_NORM=1 res fusednorm_$round
    done
    ;;
esac
echo "== done $(date +%T)"
