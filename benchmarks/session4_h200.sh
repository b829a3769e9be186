#!/usr/bin/env bash
# Issue 10, fourth session: same-run A/Bs on one H200. Every JSON goes to /tmp/s4 and is packed
# into $OUT/s4_<part>.tgz after each step (a call stopped at its limit still returns the steps done).
#   part a: the cross-layer prefetcher ($RKV_PREFETCH_TILES 0 / 4 / 6) at 1M (default budget) and
#           128K half-offloaded; 2M int8 (default budget) with the jitted int8 append; a trace of
#           resident 2K; the CPU tail kernel's bf16 and int8 rates on this host (15 threads); a
#           trace of the 2M int8 step under the default budget.
#   part b: resident decode (2K, 32K, 128K) under XLA's command buffers (CUDA graphs) of each kind
#           against rkv's default (off): where a resident step's ~2.7 ms over its bound goes.
#   part c: a fresh probe (profile v5, with the CPU kernel's int8 share) and the 1M / 2M int8 rows
#           planned with v3 and with v5.
#   part d: traces of 128K half-offloaded with the prefetcher (4 tiles) and of resident 2K / 128K
#           with command buffers on (FUSION,CUBLAS,CUBLASLT).
#   part e: 128K half-offloaded with 15 / 12 / 10 CPU-kernel threads.
#   part f: at commit 168cbd6 (its NextTile, since removed): $RKV_NEXT_TILE 1 / 0 at 128K
#           half-offloaded, then 1M (default budget) with it (session4/next_tile/half_nt{1,0}.json,
#           1m_nt1.json). A second run tried the request moved after the CPU partial's merge in
#           rkv.rolling._with_cpu_tail (an edit not kept: half_nt1_after_merge.json beside
#           half_nt0_run2.json, --offload_steps=5).
#   part g: traces of 128K half-offloaded with the prefetcher (4 tiles) and without (never run:
#           benchmarks/session5_h200.sh a took these traces with the raw events kept).
# The session's results: benchmarks/results/beyond_hbm/session4/ (a/, b/ and the files of c-e).
# Usage: bash benchmarks/session4_h200.sh a|b|c|d|e|f|g
set -uo pipefail
export PYTHONUNBUFFERED=1
P=${P:-benchmarks/results/profile_h200_v3.json}
D=/tmp/s4; mkdir -p $D
PART=${1:-a}
pack() { tar czf $OUT/s4_$PART.tgz -C $D . 2>/dev/null; }
q() { grep -v -i warn | grep -v "residency.py.*layer [1-9]" | grep -v "^I1\|^W1"; }
run() {  # run TAG PREFETCH ARGS...: one decode_bench call, its JSON at $D/TAG.json
  local tag=$1 pf=$2; shift 2
  echo "== $tag (prefetch $pf) $(date +%T)"
  RKV_PREFETCH_TILES=$pf PYTHONPATH=$PWD timeout ${T:-120} python3 -m experiments.decode_bench \
     --profile=$P --plot= --out=$D/$tag.json "$@" 2>&1 | q | grep -E "tok/s|Error|error" | tail -4
  pack
}
tr() {  # tr TAG ARGS...: one decode_trace call, its JSON at $D/trace_TAG.json
  local tag=$1; shift
  echo "== trace $tag $(date +%T)"
  PYTHONPATH=$PWD timeout ${T:-110} python3 -m experiments.decode_trace \
    --profile=$P --out=$D/trace_$tag.json "$@" 2>&1 | q | tail -3
  pack
}
case "$PART" in
  a)
    T=110 run 1m_p0 0 --configs=rkv_offload --budget=auto --contexts=1048576
    T=110 run 1m_p4 4 --configs=rkv_offload --budget=auto --contexts=1048576
    T=80 run half_p0 0 --configs=rkv_offload --contexts=131072
    T=80 run half_p4 4 --configs=rkv_offload --contexts=131072
    T=130 run 2m_int8 0 --configs=rkv_offload --budget=auto --contexts=2097152 --kv_dtype=int8
    T=90 tr res2k --configs=resident:2048
    echo "== cpu rates $(date +%T)"
    PYTHONPATH=$PWD timeout 90 python3 -c "
import json, rkv
from rkv.offload.cpu_attention import measure_cpu_attention as m
r = {dt: m(524288, dtype=dt, num_threads=15, repeats=5) / 1e9 for dt in ('bfloat16', 'int8')}
print(r); json.dump(r, open('$D/cpu_rates.json', 'w'))" 2>&1 | tail -2
    pack
    T=80 run half_p6 6 --configs=rkv_offload --contexts=131072
    T=110 run 1m_p6 6 --configs=rkv_offload --budget=auto --contexts=1048576
    T=130 tr 2m_int8 --configs=beyond:2097152 --kv_dtype=int8
    ;;
  b)
    for cb in "" FUSION,CUBLAS,CUBLASLT FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN; do
      tag=res_cb_$(echo "${cb:-off}" | command tr ',' '_' | command tr 'A-Z' 'a-z')
      XLA_FLAGS="--xla_gpu_enable_command_buffer=$cb" T=100 run $tag 0 --configs=rkv_resident \
        --contexts=2048,32768,131072
    done
    ;;
  c)
    PYTHONPATH=$PWD timeout 230 python3 -m experiments.probe --out=$D/profile_h200_v5.json 2>&1 \
      | q | tail -6
    for c in 1048576 2097152; do
      kv=""; [ $c = 2097152 ] && kv="--kv_dtype=int8"
      for pr in benchmarks/results/profile_h200_v3.json $D/profile_h200_v5.json; do
        [ -f $pr ] || continue
        P=$pr T=100 run r_${c}_$(basename $pr .json) 0 --configs=rkv_offload --budget=auto \
          --contexts=$c $kv
      done
    done
    ;;
  d)
    RKV_PREFETCH_TILES=4 T=150 tr half128_p4 --configs=offload:131072:0.5
    XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT T=100 tr res_cb \
      --configs=resident:2048,resident:131072
    ;;
  e)
    for th in 15 12 10; do
      RKV_CPU_TAIL_THREADS=$th T=80 run half_t$th 0 --configs=rkv_offload --contexts=131072
    done
    ;;
  f)
    for nt in 1 0; do
      RKV_NEXT_TILE=$nt T=75 run half_nt$nt 0 --configs=rkv_offload --contexts=131072
    done
    RKV_NEXT_TILE=1 T=100 run 1m_nt1 0 --configs=rkv_offload --budget=auto --contexts=1048576
    ;;
  g)
    for pf in 4 0; do
      RKV_PREFETCH_TILES=$pf T=110 tr half128_pf$pf --configs=offload:131072:0.5
    done
    ;;
esac
echo "== done $(date +%T)"
