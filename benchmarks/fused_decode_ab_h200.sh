#!/usr/bin/env bash
# Issue 10: same-run A/Bs on one H200 (JSON in $OUT).
#   part a: the fused decode step (RKV_FUSED_DECODE=1, rkv/models/fused_decode.py) against the general
#           path (=0) at 128K half-offloaded and 1M (default budget); the fused q/k/v and gate/up
#           projections (this tree) against the tree before them (old_tree/ = git archive 18786a3,
#           untracked) on resident decode at 2K and 128K.
#   part b: the other beyond-HBM rows on the default (general) path with the fused projections:
#           2M int8, B=8 x 128K, 512K half, resident 32K/512K.
#   part c: profiler traces (experiments.decode_trace) of the 128K half-offloaded step on the general
#           path and the fused step, and of the 2M int8 step under the default budget.
#   part d: a fresh planner profile (experiments.probe: the v3 profile predates the CPU kernel's
#           cheaper calls) and the 128K half / 1M / 2M int8 rows planned with it, beside the v3
#           profile with smaller largest tiles (--tile_cells: a finer PCIe/CPU split).
# Usage: bash benchmarks/fused_decode_ab_h200.sh a|b|c|d
set -uo pipefail
export PYTHONUNBUFFERED=1
P=${P:-benchmarks/results/profile_h200_v3.json}
q() { grep -v -i warn | grep -v "residency.py.*layer [1-9]" | grep -v "^I1\|^W1"; }
run() {  # run TAG DIR FUSED ARGS...: one decode_bench call, its JSON at $OUT/TAG.json
  local tag=$1 dir=$2 fused=$3; shift 3
  echo "== $tag"
  (cd "$dir" && RKV_FUSED_DECODE=$fused PYTHONPATH=$PWD timeout ${T:-120} python3 -m experiments.decode_bench \
     --profile=$P --plot= --out=$OUT/$tag.json "$@" 2>&1 | q | grep -E "tok/s|Error|error" | tail -6)
}
case "${1:-a}" in
  a)
    run res_new . 1 --configs=rkv_resident --contexts=2048,131072
    run res_old old_tree 1 --configs=rkv_resident --contexts=2048,131072
    run half_fused . 1 --configs=rkv_offload --contexts=131072
    run half_general . 0 --configs=rkv_offload --contexts=131072
    T=150 run 1m_fused . 1 --configs=rkv_offload --budget=auto --contexts=1048576
    T=150 run 1m_general . 0 --configs=rkv_offload --budget=auto --contexts=1048576
    ;;
  b)
    T=150 run 2m_int8 . 0 --configs=rkv_offload --budget=auto --contexts=2097152 --kv_dtype=int8
    T=100 run b8 . 0 --configs=rkv_offload --budget=auto --contexts=131072 --batch=8
    T=120 run half512 . 0 --configs=rkv_offload --contexts=524288
    T=120 run res_32k_512k . 0 --configs=rkv_resident --contexts=32768,524288
    ;;
  c)
    tr() {  # tr TAG FUSED ARGS...: one decode_trace call, its JSON at $OUT/trace_TAG.json
      local tag=$1 fused=$2; shift 2
      echo "== trace $tag"
      RKV_FUSED_DECODE=$fused PYTHONPATH=$PWD timeout ${T:-110} python3 -m experiments.decode_trace \
        --profile=$P --out=$OUT/trace_$tag.json "$@" 2>&1 | q | tail -3
    }
    tr half128_general 0 --configs=offload:131072:0.5
    tr half128_fused 1 --configs=offload:131072:0.5
    T=150 tr 2m_int8 0 --configs=beyond:2097152 --kv_dtype=int8
    ;;
  d)
    echo "== probe"
    PYTHONPATH=$PWD timeout 200 python3 -m experiments.probe --out=$OUT/profile_h200_v4.json 2>&1 \
      | q | tail -4
    T=80 run half_v3_t8k . 0 --configs=rkv_offload --contexts=131072 --tile_cells=8192
    if [ -f $OUT/profile_h200_v4.json ]; then
      T=80 P=$OUT/profile_h200_v4.json run half_v4 . 0 --configs=rkv_offload --contexts=131072
      T=120 P=$OUT/profile_h200_v4.json run 1m_v4 . 0 --configs=rkv_offload --budget=auto \
        --contexts=1048576
    fi
    T=120 run 1m_v3_t16k . 0 --configs=rkv_offload --budget=auto --contexts=1048576 --tile_cells=16384
    ;;
esac
