#!/usr/bin/env bash
# Issue 10, eighth session, on one H200. Every file goes to /tmp/s8 and is packed into
# $OUT/s8_<part>.tgz after each step. The code under test: each decode step is one program with
# its greedy pick and next positions (jit_forward's decode_step), and the steps are queued one
# ahead (step i+1 launched before step i's token is waited for); every row also times as many
# steps each waited for (sync_tokens_per_s), the control in the same run.
#   part a: resident 2K / 32K / 128K / 512K; a trace of resident 2K (the gaps between steps);
#           1M under the default budget; 128K half-offloaded; transformers' static cache at 2K
#           and 128K (its loop timed the same two ways).
#   part b: 512K half-offloaded, B=8 x 128K, 2M int8, 1M again.
#   part c: 1M under the default budget, traced (raw trace kept).
#   part d: 1M with smaller tail tiles (a finer PCIe/CPU split: --tile_cells 16384, 12288)
#           against the default 32768, alternating.
# Usage: bash benchmarks/session8_h200.sh a|b|c|d
D=/tmp/s8 NAME=s8 PART=${1:-a}
source "$(dirname "$0")/h200_common.sh"
m() { local tag=$1; shift; T=${T:-90} run 1m_$tag --configs=rkv_offload --budget=auto \
        --contexts=1048576 --offload_steps=10 "$@"; }
case "$PART" in
  a)
    T=150 run res --configs=rkv_resident --contexts=2048,32768,131072,524288
    T=120 trace res2k --configs=resident:2048
    m base_1
    T=80 run half128 --configs=rkv_offload --contexts=131072
    T=150 run hf_static --configs=hf_static --contexts=2048,131072
    ;;
  b)
    T=100 run half512 --configs=rkv_offload --contexts=524288
    T=100 run b8_128k --configs=rkv_offload --budget=auto --contexts=131072 --batch=8
    T=120 run 2m_int8 --configs=rkv_offload --budget=auto --contexts=2097152 --kv_dtype=int8
    m base_2
    ;;
  c)
    T=200 trace 1m --configs=beyond:1048576
    ;;
  d)
    m t32k_1
    m t16k_1 --tile_cells=16384
    m t12k_1 --tile_cells=12288
    m t32k_2
    m t16k_2 --tile_cells=16384
    ;;
esac
echo "== done $(date +%T)"
