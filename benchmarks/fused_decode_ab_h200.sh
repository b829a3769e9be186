#!/usr/bin/env bash
# Issue 10: same-run A/Bs on one H200 (JSON in $OUT).
#   part a: the fused decode step (RKV_FUSED_DECODE=1, rkv/models/fused_decode.py) against the general
#           path (=0) at 128K half-offloaded and 1M (default budget); the fused q/k/v and gate/up
#           projections (this tree) against the tree before them (old_tree/ = git archive 18786a3,
#           untracked) on resident decode at 2K and 128K.
#   part b: the other beyond-HBM rows with the fused step (2M int8, B=8 x 128K, 512K half, resident
#           32K/512K) and a profiler trace of the fused 128K half-offloaded step.
# Usage: bash benchmarks/fused_decode_ab_h200.sh a|b
set -uo pipefail
export PYTHONUNBUFFERED=1
P=benchmarks/results/profile_h200_v3.json
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
    T=150 run 2m_int8_fused . 1 --configs=rkv_offload --budget=auto --contexts=2097152 --kv_dtype=int8
    T=100 run b8_fused . 1 --configs=rkv_offload --budget=auto --contexts=131072 --batch=8
    T=120 run half512_fused . 1 --configs=rkv_offload --contexts=524288
    T=120 run res_new_b . 1 --configs=rkv_resident --contexts=32768,524288
    echo "== trace"
    RKV_FUSED_DECODE=1 PYTHONPATH=$PWD timeout 120 python3 -m experiments.decode_trace --profile=$P \
      --configs=offload:131072:0.5 --out=$OUT/decode_trace_fused.json 2>&1 | q | tail -3
    ;;
esac
