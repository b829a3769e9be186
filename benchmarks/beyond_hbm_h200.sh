#!/usr/bin/env bash
# Issue 10 on one H200 in one device call (~6 min for all steps): decode beyond HBM, every row with
# its bandwidth bound. rkv itself sets the device memory fraction (0.98) and switches XLA's
# command buffers off before JAX starts (rkv/_env.py). JSON lands in $OUT (default benchmarks/results/).
# Usage: bash benchmarks/beyond_hbm_h200.sh [trace] [beyond] [batch] [resident] [half] | all
#   trace:    profiler traces of resident 2K / 128K and 128K half-offloaded decode
#   beyond:   1M bf16 and 2M int8, planned with the default budget (--budget=auto)
#   batch:    B=8 x 128K, default budget
#   resident: resident decode 2K / 32K / 128K / 512K
#   half:     half the KV on the host at 128K / 512K
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(all)
want() { for s in "${steps[@]}"; do [ "$s" = "$1" ] || [ "$s" = all ] && return 0; done; return 1; }
out="${OUT:-benchmarks/results}"
P=benchmarks/results/profile_h200_v3.json
quiet() { grep -v -i warn | grep -v "residency.py.*layer [1-9]" | grep -v "^I1\|^W1"; }
B="python3 -m experiments.decode_bench --profile=$P --out=$out/decode_beyond_hbm_h200.json --plot= --append"
want trace && timeout 150 python3 -m experiments.decode_trace --profile=$P \
  --configs=resident:2048,resident:131072,offload:131072:0.5 --out=$out/decode_trace_h200.json \
  2>&1 | quiet | tail -3
want beyond && timeout 110 $B --configs=rkv_offload --budget=auto --contexts=1048576 2>&1 | quiet | tail -3
want beyond && timeout 110 $B --configs=rkv_offload --budget=auto --contexts=2097152 --kv_dtype=int8 \
  2>&1 | quiet | tail -3
want batch && timeout 90 $B --configs=rkv_offload --budget=auto --contexts=131072 --batch=8 2>&1 | quiet | tail -3
want resident && timeout 110 $B --configs=rkv_resident --contexts=2048,32768,131072,524288 2>&1 | quiet | tail -3
want half && timeout 110 $B --configs=rkv_offload --contexts=131072,524288 2>&1 | quiet | tail -16
