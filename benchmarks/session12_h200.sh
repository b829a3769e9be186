#!/usr/bin/env bash
# Session 12 on the H200 (2026-12-03), after session 11 part f (the merge kernel and in-kernel
# query packing timed: benchmarks/results/beyond_hbm/session11/f/) made both the defaults, and
# kv_fill (the resident cache's length) let the decode kernel bound its keys itself, with no
# XLA reduction and stack before it (Nsight Compute, 11/f: ~12 us of ~145 a call at 128K).
#   part a: Nsight Compute on the resident cache's call at 2K / 128K keys (kv_fill, the new
#           defaults); then resident 2K / 32K / 128K and 512K, this tree against the last
#           commit before it (out/base: `git archive 6a8c4c5 rkv experiments lab benchmarks`,
#           carried to the device), alternating, two rounds. Parts a and b ran an earlier form
#           of kv_fill (each program derived the key bounds from q_pos and the fill itself; never
#           committed: part c's form replaced it); the offloaded rows of part b do not pass
#           kv_fill, so they ran the shipped code.
#   part b: part a's ncu put the decode kernel at 133 us and 152 registers at 128K (11/f: 126 us,
#           128 registers, another machine): do the bounds derived in the kernel cost it time?
#           ncu on the default call with and without kv_fill, in one process; then the offloaded
#           rows at the new defaults (their window partials now pack the queries in the
#           kernel): 1M, 128K half, B=8 x 128K, 2M int8.
#   part c: part b: with kv_fill the kernel took 135.4 us and 152 registers at 128K, without it
#           129.2 us and 128 (the XLA bounds kernels before it 10.8 us); at 2K 17.1 against 13.8.
#           So the bounds are now computed in the wrapper from q_pos and the fill (one small
#           fusion, no k_pos reduction) and the kernel is back to its session-11 form: ncu on that
#           call; resident 2K / 32K / 128K once; part b's 1M row (7.12 tok/s against 8.41 in
#           session 11): this tree and the last commit's, alternating, on one machine.
#   part d: part c's 1M A/B again in the other order (this tree 8.24, the last commit's 8.41).
#   part e: the shipped defaults' kernels natively against float64 NumPy and the model's tokens and
#           logits under the other wrapper options: the shared attention suite's pallas cases
#           (the kv_fill ones included) and generate_test's option test, on the GPU
#           (interpret=None runs the kernels natively there).
# Usage: bash benchmarks/session12_h200.sh a|b|c|d|e (parts a and c need out/base carried).
# Results: benchmarks/results/beyond_hbm/session12/<part>/.
D=/tmp/s12 NAME=s12 PART=${1:-a}
source "$(dirname "$0")/h200_common.sh"
case "$PART" in
  a)
    ncu_calls 150 '[[2048, {"kv_fill": true}], [131072, {"kv_fill": true}]]'
    res() { local tag=$1; shift; T=${T:-100} run res_$tag --configs=rkv_resident "$@"; }
    for round in 1 2; do
      res new_$round --contexts=2048,32768,131072
      SRC=out/base res base_$round --contexts=2048,32768,131072
    done
    T=110 res new512 --contexts=524288
    SRC=out/base T=110 res base512 --contexts=524288
    ;;
  b)
    ncu_calls 150 '[[2048, {}], [2048, {"kv_fill": true}], [131072, {}], [131072, {"kv_fill": true}]]'
    T=110 run 1m --configs=rkv_offload --budget=auto --contexts=1048576 --offload_steps=10
    T=70 run half128 --configs=rkv_offload --contexts=131072
    T=110 run b8 --configs=rkv_offload --budget=auto --contexts=131072 --batch=8
    T=120 run 2m_int8 --configs=rkv_offload --budget=auto --contexts=2097152 --kv_dtype=int8
    ;;
  c)
    ncu_calls 120 '[[2048, {"kv_fill": true}], [131072, {"kv_fill": true}]]'
    T=100 run res_c --configs=rkv_resident --contexts=2048,32768,131072
    T=110 run 1m_new --configs=rkv_offload --budget=auto --contexts=1048576 --offload_steps=10
    SRC=out/base T=110 run 1m_base --configs=rkv_offload --budget=auto --contexts=1048576 \
      --offload_steps=10
    ;;
  d)
    SRC=out/base T=110 run 1m_base2 --configs=rkv_offload --budget=auto --contexts=1048576 \
      --offload_steps=10
    T=110 run 1m_new2 --configs=rkv_offload --budget=auto --contexts=1048576 --offload_steps=10
    ;;
  e)
    timeout 180 python3 -m pytest -q tests/attention_test.py tests/generate_test.py \
      -k "pallas or wrapper_options" -p no:cacheprovider > $OUT/pytest_gpu_pallas.txt 2>&1
    tail -3 $OUT/pytest_gpu_pallas.txt
    ;;
esac
echo "== done $(date +%T)"
