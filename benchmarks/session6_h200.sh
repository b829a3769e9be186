#!/usr/bin/env bash
# Issue 10, sixth session, on one H200. Every file goes to /tmp/s6 and is packed into
# $OUT/s6_<part>.tgz after each step.
#   part a: the next hybrid layer's first tiles requested right after this layer's merge
#           (next_layer_puts, $RKV_CHAIN_PUTS; the change was measured slower and reverted, its
#           diff is in results/beyond_hbm/session6/a/next_layer_puts.diff: apply it to re-run this
#           part, without it both arms are the same code): 1M under the default budget, alternating, two
#           pairs, 10 timed steps; 128K half-offloaded on, and its trace (raw trace kept).
#   part b: the host chain of a hybrid layer, at 1M under the default budget: Python's GIL
#           switch interval ($SI_US, sys.setswitchinterval: the worker waited ~0.3 ms for the GIL
#           after its query had come down), OpenMP's wait policy (passive: idle kernel threads
#           stop spinning on the cores this thread dispatches from), the fused decode step
#           ($RKV_FUSED_DECODE=1), alone and together; the baseline first and last.
#   part c: XLA's pool at 0.99 of the device against rkv's default 0.98 (about 1.4 GiB more of
#           window at 1M: less tail), 1M alternating, two pairs; then the rows last measured before
#           the early starts, with the shipped defaults: 2M int8, 512K half-offloaded, B=8 x 128K.
#   part d: libgomp's spin before an idle kernel thread sleeps ($GOMP_SPINCOUNT; default 300000
#           spins, longer than a ~4 ms layer, so the 15 kernel threads may never sleep between
#           layers and this thread's dispatches share what is left of the 16 cores), at 1M
#           alternating with the default; 512K half-offloaded with the early starts on / off.
#           ${MARCH_ROWS:-}: also the CPU kernel's rates built for x86-64-v3 / v4.
#   part e: the CPU kernel's 512-bit path (built for x86-64-v4 on an AVX-512 host): bf16 / int8
#           rates at 512K cells, 15 threads, v3 and v4 builds; then 2M int8 under the default
#           budget with the profile's int8 share set to the v4 build's measured int8 / bf16 ratio.
# Usage: bash benchmarks/session6_h200.sh a|b|c|d|e
set -uo pipefail
export PYTHONUNBUFFERED=1
P=${P:-benchmarks/results/profile_h200_v3.json}
D=/tmp/s6; mkdir -p $D/x
PART=${1:-a}
pack() { tar czf $OUT/s6_$PART.tgz -C $D . 2>/dev/null; }
q() { grep -v -i warn | grep -v "residency.py.*layer [1-9]" | grep -v "^I1\|^W1"; }
trace() {  # trace TAG ARGS...: one decode_trace call, JSON at $D/trace_TAG.json, raw trace in x/TAG
  local tag=$1; shift
  echo "== trace $tag $(date +%T)"
  PYTHONPATH=$PWD timeout ${T:-140} python3 -c "import sys, runpy
if '${SI_US:-}': sys.setswitchinterval(float('${SI_US:-0}') * 1e-6)
runpy.run_module('experiments.decode_trace', run_name='__main__')" \
    --profile=$P --out=$D/trace_$tag.json --xplane_dir=$D/x/$tag "$@" 2>&1 | q | tail -3
  pack
}
run() {  # run TAG ARGS...: one decode_bench call, its JSON at $D/TAG.json
  local tag=$1; shift
  echo "== $tag $(date +%T)"
  PYTHONPATH=$PWD timeout ${T:-120} python3 -c "import sys, runpy
if '${SI_US:-}': sys.setswitchinterval(float('${SI_US:-0}') * 1e-6)
runpy.run_module('experiments.decode_bench', run_name='__main__')" \
     --profile=$P --plot= --out=$D/$tag.json "$@" 2>&1 | q | grep -E "tok/s|Error|error" | tail -4
  pack
}
case "$PART" in
  a)
    for i in 1 2; do for c in 1 0; do
      RKV_CHAIN_PUTS=$c T=80 run 1m_chain${c}_$i --configs=rkv_offload --budget=auto \
        --contexts=1048576 --offload_steps=10
    done; done
    RKV_CHAIN_PUTS=1 T=70 run half_chain1 --configs=rkv_offload --contexts=131072
    RKV_CHAIN_PUTS=1 T=120 trace half128_chain1 --configs=offload:131072:0.5
    ;;
  b)
    m() { T=75 run 1m_$1 --configs=rkv_offload --budget=auto --contexts=1048576 --offload_steps=10; }
    m base1
    SI_US=100 m si100
    OMP_WAIT_POLICY=passive m passive
    SI_US=100 OMP_WAIT_POLICY=passive m si100_passive
    RKV_FUSED_DECODE=1 m fused
    RKV_FUSED_DECODE=1 SI_US=100 OMP_WAIT_POLICY=passive m fused_si100_passive
    m base2
    SI_US=100 OMP_WAIT_POLICY=passive T=100 trace 1m_si100_passive --configs=beyond:1048576
    ;;
  c)
    m() { T=75 run 1m_$1 --configs=rkv_offload --budget=auto --contexts=1048576 --offload_steps=10; }
    for i in 1 2; do
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.99 m f99_$i
      m f98_$i
    done
    T=110 run 2m_int8 --configs=rkv_offload --budget=auto --contexts=2097152 --kv_dtype=int8
    T=90 run half512 --configs=rkv_offload --contexts=524288
    T=90 run b8_128k --configs=rkv_offload --budget=auto --contexts=131072 --batch=8
    ;;
  d)
    m() { T=70 run 1m_$1 --configs=rkv_offload --budget=auto --contexts=1048576 --offload_steps=10; }
    m base1
    GOMP_SPINCOUNT=10000 m spin10k_1
    GOMP_SPINCOUNT=1000 m spin1k
    m base2
    GOMP_SPINCOUNT=10000 m spin10k_2
    GOMP_SPINCOUNT=100000 m spin100k
    RKV_EARLY_CPU=0 RKV_EARLY_PUTS=0 T=90 run half512_e0 --configs=rkv_offload --contexts=524288
    T=90 run half512_e1 --configs=rkv_offload --contexts=524288
    ;;
  e)
    for mv in x86-64-v3 auto; do
      echo "== cpu rates $mv $(date +%T)"
      RKV_CPU_MARCH=$([ $mv = auto ] || echo $mv) PYTHONPATH=$PWD timeout 60 python3 -c "
import json, rkv
from rkv.offload import cpu_attention as ca
r = {dt: ca.measure_cpu_attention(524288, dtype=dt, num_threads=15, repeats=7) / 1e9
     for dt in ('bfloat16', 'int8')}
r['isa'] = ca.kernel_isa()
print(r); json.dump(r, open('$D/cpu_rates_$mv.json', 'w'))" 2>&1 | tail -1
      pack
    done
    python3 -c "
import json; r = json.load(open('$D/cpu_rates_auto.json')); p = json.load(open('$P'))
p['cpu_int8_share'] = r['int8'] / r['bfloat16']; p['source'] += ' (cpu_int8_share: session6 e)'
json.dump(p, open('$D/profile_int8.json', 'w'))" && \
      P=$D/profile_int8.json T=100 run 2m_int8_v4 --configs=rkv_offload --budget=auto \
        --contexts=2097152 --kv_dtype=int8
    ;;
esac
echo "== done $(date +%T)"
