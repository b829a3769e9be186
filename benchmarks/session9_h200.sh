#!/usr/bin/env bash
# Issue 10, ninth session, on one H200. Every file goes to /tmp/s9 and is packed into
# $OUT/s9_<part>.tgz after each step.
#   part a: does a small host->device move (a hybrid layer's CPU partial) wait behind tile puts
#           already queued (experiments.copy_queue_probe: numpy into a jitted program as rkv's
#           merge takes it, and a pinned_host array moved inside the program); B=8 x 128K under
#           the default budget with the default tiles (one 8960-cell tile a layer: the cpu
#           tactic) against --tile_cells=8192 (two 4992-cell tiles: hybrid, one streamed, one on
#           the CPU), alternating.
#   part b: B=8 x 128K with the shipped planner (a one-tile tail laid out as two tiles where the
#           hybrid then models faster: the plan part a ran with --tile_cells=8192), twice; one
#           traced step of it (experiments.decode_trace --batch=8, raw trace kept); the GPU-only
#           tests (pytest -m gpu).
#   part c: B=8 x 128K (the shipped two-tile hybrid plan, whose link idles ~1.3 ms a layer) with
#           layered_forward's cross-layer Prefetcher ($RKV_PREFETCH_TILES=1, 2) against it off,
#           alternating.
# Usage: bash benchmarks/session9_h200.sh a|b|c
D=/tmp/s9 NAME=s9 PART=${1:-a}
source "$(dirname "$0")/h200_common.sh"
b8() { local tag=$1; shift; T=${T:-110} run b8_$tag --configs=rkv_offload --budget=auto \
         --contexts=131072 --batch=8 "$@"; }
case "$PART" in
  a)
    echo "== copy_queue $(date +%T)"
    PYTHONPATH=$PWD timeout 120 python3 -m experiments.copy_queue_probe --tiles=4 --tile_mib=64 \
      --out=$D/copy_queue.json 2>&1 | q | tail -8
    pack
    b8 base_1
    b8 t8k_1 --tile_cells=8192
    b8 base_2
    b8 t8k_2 --tile_cells=8192
    ;;
  b)
    b8 plan_1
    b8 plan_2
    T=150 trace b8 --configs=beyond:131072 --batch=8
    echo "== pytest -m gpu $(date +%T)"
    timeout 240 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider > $D/pytest_gpu.txt 2>&1
    tail -3 $D/pytest_gpu.txt
    pack
    ;;
  c)
    b8 pf0_1
    RKV_PREFETCH_TILES=1 b8 pf1_1
    RKV_PREFETCH_TILES=2 b8 pf2_1
    b8 pf0_2
    RKV_PREFETCH_TILES=1 b8 pf1_2
    ;;
esac
echo "== done $(date +%T)"
