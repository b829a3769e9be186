#!/usr/bin/env bash
# Issue 10, eleventh session, on one H200. Every file goes to /tmp/s11 and is packed into
# $OUT/s11_<part>.tgz after each step.
#   part a: the shipped defaults (command buffers on) at 1M and resident 512K; 128K half-offloaded
#           with command buffers off, then on (session10_h200.sh e ran on, off). As run it began
#           with four Nsight Compute steps that all failed (rkv's default preallocates 0.98 of the
#           device and ncu must save what a replayed kernel writes); they are removed here and
#           part b does them.
#   part b: the same Nsight Compute profiles in one process, the device not preallocated (128K
#           also block_k=128 with 8 warps); then 2M int8 and B=8 x 128K under the shipped defaults.
#   part c: part b's profiles say the decode kernel is bound by its programs' per-iteration latency
#           (89 KB of shared memory a program at block_k=64, 3 stages: 2 programs an SM, 2 warps
#           a scheduler, 0.5 eligible), so: decode attention as a step runs it at 2K / 32K / 128K
#           for tilings that fit more programs an SM (2 stages, block_k=32) with more splits;
#           Nsight Compute on two of them at 128K.
#   part d: 2M int8 with command buffers off, then on (part b's 4.22 tok/s against session 8's
#           5.41: is it the new default?).
#   part e: the same two in the other order (on, then off).
#   part f (run at the start of session 12; chain + pack at 128K did not finish inside its 100 s
#           in either round, so those two runs have no JSON): resident 2K / 32K
#           / 128K, the decode wrapper's launch-cutting options against the defaults,
#           alternating: the queries packed in the kernel with the chain split merge, and with
#           the merge kernel (split_merge="kernel", new this session: a T=1 call then runs the
#           key-bounds reduction, the decode kernel and the merge kernel, where ncu counted ~10
#           kernels); kernel_bench --layers for the same, and ncu on the new pair. Session 8 measured chain + pack with
#           each step waited for and no command buffers (no faster); queued under command
#           buffers a step is the GPU's busy time, so fewer kernels may now show.
# Usage: bash benchmarks/session11_h200.sh a|b|c|d|e|f. Results: benchmarks/results/beyond_hbm/session11/
# (each part's own files; the ncu CSVs gzipped afterwards and summarised by
# `python3 -m experiments.ncu_summary --csv=...`). Parts b and c ran the driver as
# benchmarks/ncu_decode.py (its call lines began "S="); it is experiments.ncu_decode now, the same
# calls (lab/ncu_profile.py).
D=/tmp/s11 NAME=s11 PART=${1:-a}
source "$(dirname "$0")/h200_common.sh"
case "$PART" in
  a)
    T=110 run 1m --configs=rkv_offload --budget=auto --contexts=1048576 --offload_steps=10
    T=110 run res512 --configs=rkv_resident --contexts=524288
    OFF=--xla_gpu_enable_command_buffer=
    XLA_FLAGS=$OFF T=70 run half128_off --configs=rkv_offload --contexts=131072
    T=70 run half128_on --configs=rkv_offload --contexts=131072
    ;;
  b)
    ncu_calls 300 '[[2048, {}], [32768, {}], [131072, {}], [131072, {"block_k": 128, "num_warps": 8}]]'
    T=120 run 2m_int8 --configs=rkv_offload --budget=auto --contexts=2097152 --kv_dtype=int8
    T=110 run b8 --configs=rkv_offload --budget=auto --contexts=131072 --batch=8
    ;;
  c)
    SWEEP='[{"num_stages": 2, "num_splits": 66}, {"num_stages": 2, "num_splits": 49},
            {"block_k": 32, "num_splits": 49}, {"block_k": 32, "num_splits": 66},
            {"block_k": 32, "num_stages": 4, "num_splits": 49}, {"num_splits": 49},
            {"num_stages": 2, "num_splits": 33}]'
    echo "== kernel layers $(date +%T)"
    PYTHONPATH=$PWD timeout 240 python3 -m experiments.kernel_bench --layers=32 \
      --contexts=2048,32768,131072 --sweep_decode="$SWEEP" --out=$D/kernel_layers.json \
      2>&1 | q | grep -E "S=|rror" | tail -40
    pack
    ncu_calls 120 '[[131072, {"num_stages": 2, "num_splits": 66}], [131072, {"block_k": 32, "num_splits": 49}]]'
    ;;
  d)
    OFF=--xla_gpu_enable_command_buffer=
    XLA_FLAGS=$OFF T=120 run 2m_int8_off --configs=rkv_offload --budget=auto --contexts=2097152 \
      --kv_dtype=int8
    T=120 run 2m_int8_on --configs=rkv_offload --budget=auto --contexts=2097152 --kv_dtype=int8
    ;;
  e)
    OFF=--xla_gpu_enable_command_buffer=
    T=110 run 2m_int8_on2 --configs=rkv_offload --budget=auto --contexts=2097152 --kv_dtype=int8
    XLA_FLAGS=$OFF T=110 run 2m_int8_off2 --configs=rkv_offload --budget=auto \
      --contexts=2097152 --kv_dtype=int8
    ;;
  f)
    res3() { local tag=$1; shift; T=${T:-100} run res_$tag --configs=rkv_resident \
               --contexts=2048,32768,131072 "$@"; }
    echo "== kernel layers $(date +%T)"
    PYTHONPATH=$PWD timeout 200 python3 -m experiments.kernel_bench --layers=32 \
      --contexts=2048,32768,131072 --out=$D/kernel_layers_f.json --sweep_decode='[
        {"split_merge": "kernel"}, {"split_merge": "kernel", "query_pack": "kernel"},
        {"split_merge": "chain", "query_pack": "kernel"}]' 2>&1 | q | grep -E "S=|rror" | tail -20
    pack
    ncu_calls 120 '[[2048, {"split_merge": "kernel", "query_pack": "kernel"}], [131072, {"split_merge": "kernel", "query_pack": "kernel"}]]'
    for round in 1 2; do
      res3 base_$round
      RKV_DECODE_SPLIT_MERGE=kernel RKV_DECODE_QUERY_PACK=kernel res3 mergepack_$round
      RKV_DECODE_SPLIT_MERGE=chain RKV_DECODE_QUERY_PACK=kernel res3 chainpack_$round
    done
    ;;
esac
echo "== done $(date +%T)"
