#!/usr/bin/env bash
# Runs the H200 benchmarks in one device call (device time is scarce: batch what you need).
# Usage on the GPU machine, from the repo root, with peer-wheels/ carried:
#   bash benchmarks/run_h200.sh [kernel] [rolling] [overlap] [tactics] [decode] [niah] [gputests] | all
# JSON lands in $OUT (or benchmarks/results/). Extra flags per step: KERNEL_ARGS, ROLLING_ARGS,
# TACTICS_ARGS, DECODE_ARGS, NIAH_ARGS. Each step runs under its own time limit (STEP_LIMIT_S,
# default 500 s; LIMIT_<step> for one step) so one slow step cannot take the others' device time.
set -uo pipefail
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(all)
out="${OUT:-benchmarks/results}"
limit="${STEP_LIMIT_S:-500}"
export PYTHONUNBUFFERED=1
if [ -d peer-wheels ]; then  # tokamax, the prefill peer (benchmark only; rkv never imports it)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site peer-wheels/*.whl
  mkdir -p /tmp/site/xprof/cli && touch /tmp/site/xprof/__init__.py /tmp/site/xprof/cli/__init__.py
  echo "get_kernel_stats_tool = None" > /tmp/site/xprof/cli/tools.py
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
want() { for s in "${steps[@]}"; do [ "$s" = "$1" ] || [ "$s" = all ] && return 0; done; return 1; }
step() {  # LIMIT_<step> overrides STEP_LIMIT_S for one step
  local name=$1 lim; shift; lim=$(eval echo "\${LIMIT_$name:-$limit}")
  echo "=== $name (limit ${lim}s, $(date +%T))"; timeout "$lim" "$@"; echo "=== $name rc=$? ($(date +%T))"
}
want gputests && step gputests python3 -m pytest -q -x tests/cache_test.py \
  tests/rolling_attention_test.py tests/rolling_tactics_test.py
want kernel && step kernel python3 -m experiments.kernel_bench --tokamax \
  --out="$out/kernel_bench_h200.json" ${KERNEL_ARGS:-}
want overlap && step overlap python3 -m experiments.overlap_probe \
  --out="$out/overlap_probe_h200_pertile.json"
want rolling && step rolling python3 -m experiments.rolling_bench \
  --out="$out/rolling_bench_h200.json" ${ROLLING_ARGS:-}
want tactics && step tactics python3 -m experiments.tactics_bench \
  --out="$out/tactics_bench_h200.json" ${TACTICS_ARGS:-}
want decode && step decode python3 -m experiments.decode_bench \
  --out="$out/decode_bench_h200.json" --plot="$out/decode_bench_h200.png" ${DECODE_ARGS:-}
want niah && step niah python3 -m experiments.niah --out="$out/niah_h200.json" ${NIAH_ARGS:-}
exit 0
