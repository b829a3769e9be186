#!/usr/bin/env bash
# Runs the H200 benchmarks in one device call (device time is scarce: one call, every benchmark).
# Usage on the GPU machine, from the repo root, with peer-wheels/ carried:
#   bash benchmarks/run_h200.sh kernel|rolling|all   # JSON lands in $OUT (or benchmarks/results/)
set -uo pipefail
what="${1:-all}"
out="${OUT:-benchmarks/results}"
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
if [ "$what" = kernel ] || [ "$what" = all ]; then
  python3 -m experiments.kernel_bench --tokamax --out="$out/kernel_bench_h200.json" ${KERNEL_ARGS:-}
fi
if [ "$what" = rolling ] || [ "$what" = all ]; then
  python3 -m experiments.rolling_bench --out="$out/rolling_bench_h200.json" ${ROLLING_ARGS:-}
fi
