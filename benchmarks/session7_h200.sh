#!/usr/bin/env bash
# Issue 10, seventh session, on one H200. Every file goes to /tmp/s7 and is packed into
# $OUT/s7_<part>.tgz after each step.
#   part a: a rolling layer's merge and post_attention run inside the next layer's pre_attention
#           program (layered_forward's join, $RKV_JOIN_LAYERS, on by default) against the three
#           programs before it (=0), and the CPU kernel's partial put on the device by the worker
#           thread that ran it ($RKV_CPU_UPLOAD=1: measured slower and reverted, so without that
#           change the join_up arms are the join's); 1M under the default budget, alternating, 10
#           timed steps each; then 128K half-offloaded with the join, traced (raw trace kept).
#   part b: a fresh probe with the 512-bit CPU kernel (profile v6); 1M and 2M int8 planned with
#           it against the shipped profile, alternating.
#   part c: where the dispatching thread waits for the CPU kernel to start ($RKV_CPU_HANDOFF 0:
#           never, 1: before the tiles' puts, 2: after them), 1M alternating, two rounds; 128K
#           half-offloaded once each; a trace of 128K half-offloaded with ${HT:-2}. Measured slower
#           and reverted: apply results/beyond_hbm/session7/c/cpu_handoff.diff to re-run it (without
#           it every arm is the same code).
#   part d: the offloaded rows of decode_beyond_hbm_h200.json with the shipped defaults (the join
#           on): 1M first and last, half-offloaded 128K / 512K, B=8 x 128K, 2M int8.
#   part e: each tail tile's checked pointer reused while the tile lives (the CPU kernel's setup,
#           $RKV_CPU_BUFFER_CACHE, on by default) against a lookup per call (=0), 1M alternating.
# Usage: bash benchmarks/session7_h200.sh a|b|c|d|e
D=/tmp/s7 NAME=s7 PART=${1:-a}
source "$(dirname "$0")/h200_common.sh"
m() { local tag=$1; shift; T=${T:-60} run 1m_$tag --configs=rkv_offload --budget=auto \
        --contexts=1048576 --offload_steps=10 "$@"; }
case "$PART" in
  a)
    for i in 1 2; do
      m join_$i
      RKV_JOIN_LAYERS=0 m nojoin_$i
      RKV_CPU_UPLOAD=1 m join_up_$i
    done
    T=110 trace half128_join --configs=offload:131072:0.5
    ;;
  b)
    echo "== probe $(date +%T)"
    PYTHONPATH=$PWD timeout 230 python3 -m experiments.probe --out=$D/profile_h200_v6.json 2>&1 \
      | q | tail -3
    pack
    for i in 1 2; do
      P=$D/profile_h200_v6.json m v6_$i
      m v3_$i
    done
    P=$D/profile_h200_v6.json T=110 run 2m_int8_v6 --configs=rkv_offload --budget=auto \
      --contexts=2097152 --kv_dtype=int8
    ;;
  c)
    for i in 1 2; do for h in 0 1 2; do RKV_CPU_HANDOFF=$h m h${h}_$i; done; done
    for h in 0 1 2; do RKV_CPU_HANDOFF=$h T=70 run half128_h$h --configs=rkv_offload \
      --contexts=131072; done
    RKV_CPU_HANDOFF=${HT:-2} T=110 trace half128_h${HT:-2} --configs=offload:131072:0.5
    ;;
  d)
    m base_1
    T=70 run half128 --configs=rkv_offload --contexts=131072
    T=95 run half512 --configs=rkv_offload --contexts=524288
    T=95 run b8_128k --configs=rkv_offload --budget=auto --contexts=131072 --batch=8
    T=110 run 2m_int8 --configs=rkv_offload --budget=auto --contexts=2097152 --kv_dtype=int8
    m base_2
    ;;
  e)
    for i in 1 2; do m buf1_$i; RKV_CPU_BUFFER_CACHE=0 T=60 m buf0_$i; done
    ;;
esac
echo "== done $(date +%T)"
