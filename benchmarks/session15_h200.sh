#!/usr/bin/env bash
# Session 15 on the H200 (2026-12-04).
#   part a: the GPU tests at this commit, whose decode split floor is 256 keys (session 14): the
#           whole `pytest -m gpu` and the Pallas decode kernel's own file compiled for the GPU.
#   part b: the CPU kernel's OpenMP threads bound to cores (OMP_PROC_BIND=close, OMP_PLACES=cores)
#           against the defaults (unbound: the kernel's 15 threads, the dispatching Python thread
#           and XLA's threads migrate over 16 cores between calls), 1M and 128K half, alternating
#           over two rounds. Expected: at most a few percent (sessions 4-7 found no host knob that
#           moved the layer chain); adopted only if both rows move beyond their spread.
#   part c: every row of the README's Beyond HBM table at this commit, one machine, one run each
#           (resident 2K / 32K / 128K / 512K, 128K and 512K half, 1M, 2M int8, B=8 x 128K).
# Usage: bash benchmarks/session15_h200.sh a|b|c. Results: benchmarks/results/beyond_hbm/session15/.
D=/tmp/s15 NAME=s15 PART=${1:-a}
source "$(dirname "$0")/h200_common.sh"
case "$PART" in
  a)
    echo "== pytest -m gpu $(date +%T)"
    timeout 240 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider > $D/pytest_gpu.txt 2>&1
    tail -3 $D/pytest_gpu.txt; pack
    echo "== pytest pallas decode $(date +%T)"
    timeout 300 python3 -m pytest -q tests/pallas_decode_attention_test.py -p no:cacheprovider \
      > $D/pytest_gpu_pallas_decode.txt 2>&1
    tail -3 $D/pytest_gpu_pallas_decode.txt; pack
    ;;
  b)
    for round in 1 2; do
      T=100 run 1m_base_$round --configs=rkv_offload --budget=auto --contexts=1048576
      OMP_PROC_BIND=close OMP_PLACES=cores T=100 run 1m_bind_$round --configs=rkv_offload \
        --budget=auto --contexts=1048576
      T=80 run half128_base_$round --configs=rkv_offload --budget=fraction --contexts=131072
      OMP_PROC_BIND=close OMP_PLACES=cores T=80 run half128_bind_$round --configs=rkv_offload \
        --budget=fraction --contexts=131072
    done
    ;;
  c)
    T=150 run res --configs=rkv_resident --contexts=2048,32768,131072,524288
    T=90 run half128 --configs=rkv_offload --budget=fraction --contexts=131072
    T=110 run 1m --configs=rkv_offload --budget=auto --contexts=1048576 --offload_steps=10
    T=110 run b8 --configs=rkv_offload --budget=auto --contexts=131072 --batch=8
    T=150 run 2m_int8 --configs=rkv_offload --budget=auto --contexts=2097152 --kv_dtype=int8
    T=150 run half512 --configs=rkv_offload --budget=fraction --contexts=524288
    ;;
esac
echo "== done $(date +%T)"
