#!/usr/bin/env bash
# Issue 10, fifth session: traces kept whole (raw .xplane.pb.gz) for offline event analysis, on
# one H200. Every file goes to /tmp/s5 and is packed into $OUT/s5_<part>.tgz after each step.
#   part a: the host's CPU (lscpu, flags); traces of 128K half-offloaded with the prefetcher off
#           and at 4 tiles, and of 1M under the default budget (prefetcher off), each with its
#           raw trace: which wait grows when a tile moves earlier, and where the link idles.
#   part b: the CPU kernel's bf16 / int8 rates built for x86-64-v3 (default) and x86-64-v4
#           (AVX-512: 32 vector registers); 128K half-offloaded with early puts on / off
#           ($RKV_EARLY_PUTS), a trace with them on, and the prefetcher (4 tiles) on the worker path.
#   part c: the hybrid CPU share started before the append ($RKV_EARLY_CPU) with and without
#           early puts, at 128K half-offloaded (and a trace) and at 1M (default budget).
#   part d: the same at 128K half-offloaded against the CPU kernel's thread count
#           ($RKV_CPU_TAIL_THREADS 15 / 12 / 10 with both early starts; both off at 15, first and
#           last, for the drift), then 1M (default budget) early at 12 threads and off at 15.
#   part e: 1M (default budget), early starts off / on alternating, three pairs, 10 timed steps.
#   part f (never run; session6_h200.sh b measured the fused step at 1M instead): 1M, the fused step
#           ($RKV_FUSED_DECODE=1) against the general path with the early starts, three
#           alternating pairs: whether fewer dispatches a layer now shorten the host chain.
# The session's results: benchmarks/results/beyond_hbm/session5/ (a/ .. e/ by part; the raw traces
# in xplane/; part c ran on a machine where every row was ~40% slower, so it is kept, not used).
# Usage: bash benchmarks/session5_h200.sh a|b|c|d|e|f
set -uo pipefail
export PYTHONUNBUFFERED=1
P=${P:-benchmarks/results/profile_h200_v3.json}
D=/tmp/s5; mkdir -p $D/x
PART=${1:-a}
pack() { tar czf $OUT/s5_$PART.tgz -C $D . 2>/dev/null; }
q() { grep -v -i warn | grep -v "residency.py.*layer [1-9]" | grep -v "^I1\|^W1"; }
trace() {  # trace TAG PREFETCH ARGS...: one decode_trace call, JSON at $D/trace_TAG.json
  local tag=$1 pf=$2; shift 2
  echo "== trace $tag (prefetch $pf) $(date +%T)"
  RKV_PREFETCH_TILES=$pf PYTHONPATH=$PWD timeout ${T:-140} python3 -m experiments.decode_trace \
    --profile=$P --out=$D/trace_$tag.json --xplane_dir=$D/x/$tag "$@" 2>&1 | q | tail -3
  pack
}
run() {  # run TAG ARGS...: one decode_bench call, its JSON at $D/TAG.json
  local tag=$1; shift
  echo "== $tag $(date +%T)"
  PYTHONPATH=$PWD timeout ${T:-120} python3 -m experiments.decode_bench \
     --profile=$P --plot= --out=$D/$tag.json "$@" 2>&1 | q | grep -E "tok/s|Error|error" | tail -4
  pack
}
rates() {  # rates TAG: the CPU kernel's bf16 / int8 rates at 512K cells, 15 threads
  echo "== cpu rates $1 (${RKV_CPU_MARCH:-default}) $(date +%T)"
  PYTHONPATH=$PWD timeout 100 python3 -c "
import json, rkv
from rkv.offload.cpu_attention import measure_cpu_attention as m
from rkv.offload import cpu_build
r = {dt: m(524288, dtype=dt, num_threads=15, repeats=7) / 1e9 for dt in ('bfloat16', 'int8')}
r['flags'] = cpu_build.arch_flags()
print(r); json.dump(r, open('$D/cpu_rates_$1.json', 'w'))" 2>&1 | tail -2
  pack
}
case "$PART" in
  a)
    { lscpu; grep -m1 -o 'flags.*' /proc/cpuinfo; nproc; } > $D/host_cpu.txt 2>&1
    grep -E "Model name|Socket|Thread|NUMA node|L3" $D/host_cpu.txt
    grep -o -E "avx512[a-z_0-9]*|amx[a-z_0-9]*|avx_vnni" $D/host_cpu.txt | sort -u | command tr '\n' ' '; echo
    pack
    T=130 trace half128_pf0 0 --configs=offload:131072:0.5
    T=130 trace half128_pf4 4 --configs=offload:131072:0.5
    T=170 trace 1m_pf0 0 --configs=beyond:1048576
    ;;
  b)
    rates v3
    RKV_CPU_MARCH=x86-64-v4 rates v4
    RKV_EARLY_PUTS=1 T=90 run half_e1 --configs=rkv_offload --contexts=131072
    RKV_EARLY_PUTS=0 T=90 run half_e0 --configs=rkv_offload --contexts=131072
    RKV_EARLY_PUTS=1 T=130 trace half128_e1 0 --configs=offload:131072:0.5
    RKV_PREFETCH_TILES=4 T=90 run half_p4w --configs=rkv_offload --contexts=131072
    ;;
  c)
    RKV_EARLY_CPU=1 RKV_EARLY_PUTS=1 T=90 run half_c1p1 --configs=rkv_offload --contexts=131072
    RKV_EARLY_CPU=1 RKV_EARLY_PUTS=0 T=90 run half_c1p0 --configs=rkv_offload --contexts=131072
    RKV_EARLY_CPU=0 RKV_EARLY_PUTS=0 T=90 run half_c0p0 --configs=rkv_offload --contexts=131072
    RKV_EARLY_CPU=1 RKV_EARLY_PUTS=1 T=130 trace half128_c1p1 0 --configs=offload:131072:0.5
    RKV_EARLY_CPU=1 RKV_EARLY_PUTS=1 T=130 run 1m_c1p1 --configs=rkv_offload --budget=auto \
      --contexts=1048576
    RKV_EARLY_CPU=0 RKV_EARLY_PUTS=0 T=130 run 1m_c0p0 --configs=rkv_offload --budget=auto \
      --contexts=1048576
    ;;
  d)
    h() { RKV_EARLY_CPU=$1 RKV_EARLY_PUTS=$1 RKV_CPU_TAIL_THREADS=$2 T=90 run half_e$1_t$2${3:-} \
            --configs=rkv_offload --contexts=131072; }
    h 0 15 a; h 1 15; h 1 12; h 1 10; h 0 15 b
    for e in "1 12" "0 15"; do set -- $e
      RKV_EARLY_CPU=$1 RKV_EARLY_PUTS=$1 RKV_CPU_TAIL_THREADS=$2 T=130 run 1m_e$1_t$2 \
        --configs=rkv_offload --budget=auto --contexts=1048576
    done
    ;;
  e)
    for i in 1 2 3; do for e in 0 1; do
      RKV_EARLY_CPU=$e RKV_EARLY_PUTS=$e T=75 run 1m_ab_e${e}_$i --configs=rkv_offload \
        --budget=auto --contexts=1048576 --offload_steps=10
    done; done
    ;;
  f)
    for i in 1 2 3; do for fu in 0 1; do
      RKV_FUSED_DECODE=$fu T=75 run 1m_fused${fu}_$i --configs=rkv_offload --budget=auto \
        --contexts=1048576 --offload_steps=10
    done; done
    ;;
esac
echo "== done $(date +%T)"
