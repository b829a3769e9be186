#!/usr/bin/env bash
# The issue-10 run on one H200 (one device call, ~8 min): decode beyond HBM and the bound of every
# row. JSON lands in $OUT. Steps:
#  1. command buffers A/B: resident decode traces at 2K / 128K with XLA's command buffers (CUDA
#     graphs) forced on; if the 2K step beats the plain one by 10%, the decode rows below run with
#     them too (recorded in the rows' environment).
#  2. 128K half-offloaded trace (prefetcher + all-staged device partials).
#  3. decode_bench rows: 1M bf16, 2M int8, B=8 x 128K (--budget=auto), resident 2K-512K,
#     half-offloaded 128K / 512K, all into decode_beyond_hbm_h200.json.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
out="${OUT:-benchmarks/results}"
P=benchmarks/results/profile_h200_v3.json
CB="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_min_graph_size=1"
quiet() { grep -v -i warn | grep -v "residency.py.*layer [1-9]" | grep -v "^I1\|^W1"; }
XLA_FLAGS="$CB" timeout 100 python3 -m experiments.decode_trace --configs=resident:2048,resident:131072 \
  --profile=$P --out=$out/decode_trace_cmdbuf.json 2>&1 | quiet | tail -4
flags=$(python3 - "$out/decode_trace_cmdbuf.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
ms = {r["config"]: r.get("step_ms") for r in rows}
# Plain 2K step in decode_trace_h200_prefetch.json: 11.06 ms.
print("cmdbuf" if ms.get("resident:2048") and ms["resident:2048"] < 0.9 * 11.06 else "plain")
PY
)
echo "decode rows run with: $flags"
[ "$flags" = cmdbuf ] && export XLA_FLAGS="$CB"
timeout 80 python3 -m experiments.decode_trace --configs=offload:131072:0.5 --profile=$P \
  --out=$out/decode_trace_offload.json 2>&1 | quiet | tail -2
B="python3 -m experiments.decode_bench --profile=$P --out=$out/decode_beyond_hbm_h200.json --plot= --append"
timeout 110 $B --configs=rkv_offload --budget=auto --contexts=1048576 2>&1 | quiet | tail -4
timeout 110 $B --configs=rkv_offload --budget=auto --contexts=2097152 --kv_dtype=int8 2>&1 | quiet | tail -3
timeout 90 $B --configs=rkv_offload --budget=auto --contexts=131072 --batch=8 2>&1 | quiet | tail -3
timeout 110 $B --configs=rkv_resident,rkv_offload --contexts=2048,32768,131072,524288 2>&1 | quiet | tail -14
