#!/usr/bin/env bash
# XLA's command buffers forced on vs off on the decode rows they could move: resident 2K / 128K,
# 128K half-offloaded (hybrid), 1M (default budget); then, with them on, 2M int8 and 512K
# half-offloaded. JSON in $OUT. (When this ran, rkv's default was "on" with exactly the flags of
# mode "on" here; it measured slower, and rkv now switches them off: mode "off" is the default.)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
out="${OUT:-benchmarks/results}"
P=benchmarks/results/profile_h200_v3.json
B="python3 -m experiments.decode_bench --profile=$P --plot="
for mode in on off; do
  flags="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_min_graph_size=1"
  [ $mode = off ] && flags="--xla_gpu_enable_command_buffer="
  XLA_FLAGS="$flags" timeout 95 $B --out=$out/cmdbuf_$mode.json --configs=rkv_resident,rkv_offload \
    --contexts=2048,131072 2>&1 | grep "tok/s" | grep -v " 2048: .*rkv_offload"
  XLA_FLAGS="$flags" timeout 80 $B --out=$out/cmdbuf_$mode.json --append --configs=rkv_offload \
    --budget=auto --contexts=1048576 2>&1 | grep "tok/s"
done
# As measured: these two rows ran with command buffers on (then rkv's default).
export XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_min_graph_size=1"
timeout 80 $B --out=$out/cmdbuf_on.json --append --configs=rkv_offload --budget=auto \
  --contexts=2097152 --kv_dtype=int8 2>&1 | grep "tok/s"
timeout 70 $B --out=$out/cmdbuf_on.json --append --configs=rkv_offload --contexts=524288 2>&1 | grep "tok/s"
