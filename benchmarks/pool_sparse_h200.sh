#!/usr/bin/env bash
# Issues 14 and 15 on one H200 (JSON in $OUT; the commands are those of experiments/pool_bench.py's
# and experiments/sparse_bench.py's docstrings, each under a guard so that one stuck step does not
# cost the others).
#   part pool:   the GPU pool tests, then pool benchmarks (b) ragged, (c) offload, (d) chat.
#   part sparse: the block-cache decode benchmark at 256K and 1M.
# Usage: bash benchmarks/pool_sparse_h200.sh pool|sparse
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
P=benchmarks/results/profile_h200_v3.json
q() { grep -v -i warn | grep -v "^I1\|^W1"; }
case "${1:-pool}" in
  pool)
    echo "== gpu pool tests"
    timeout 120 python3 -m pytest -q -m gpu tests/pool_test.py 2>&1 | tail -4
    echo "== ragged"
    XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=96 timeout 150 python3 -m experiments.pool_bench \
      --scenarios=ragged --profile=$P --out=$OUT/pool_bench_h200_ragged.json 2>&1 | q | tail -8
    echo "== offload"
    timeout 110 python3 -m experiments.pool_bench --scenarios=offload --profile=$P \
      --out=$OUT/pool_bench_h200_offload.json 2>&1 | q | tail -6
    echo "== chat"
    timeout 150 python3 -m experiments.pool_bench --scenarios=chat \
      --out=$OUT/pool_bench_h200_chat.json 2>&1 | q | tail -6
    ;;
  sparse)
    echo "== sparse"
    timeout ${T:-200} python3 -m experiments.sparse_bench --contexts=262144,1048576 \
      --slot_cells=16384,65536 --select_cells=2048,4096 --out=$OUT/sparse_bench_h200.json 2>&1 \
      | q | tail -16
    ;;
esac
