"""Issue 14's pool benchmarks (b)-(d) (lab/pool_bench.py): ragged vs padded batch, an offloaded
pool vs its bound, a kept chat's second turn vs prefilling it again. JSON out.

On the H200 (Llama-3-8B shape, random weights), one scenario a command (the runs behind
benchmarks/results/pool_bench_h200_*.json, all in `bash benchmarks/pool_sparse_h200.sh pool`):
  XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=96 python -m experiments.pool_bench --scenarios=ragged \
      --profile=benchmarks/results/profile_h200_v3.json --out=benchmarks/results/pool_bench_h200_ragged.json
  python -m experiments.pool_bench --scenarios=offload \
      --profile=benchmarks/results/profile_h200_v3.json --out=benchmarks/results/pool_bench_h200_offload.json
  python -m experiments.pool_bench --scenarios=chat --out=benchmarks/results/pool_bench_h200_chat.json
(all three in one process: drop --scenarios). On a CPU, a smoke run of the same code at tiny
shapes:
  python -m experiments.pool_bench --quick
"""

from __future__ import annotations

from absl import app
from absl import flags

from lab import pool_bench
from rkv import benchmarking

_QUICK = flags.DEFINE_bool("quick", False, "Tiny shapes (CPU smoke run) instead of the H200's.")
_OUT = flags.DEFINE_string("out", None, "Where to write the JSON result (none: print only).")
_SCENARIOS = flags.DEFINE_list("scenarios", list(pool_bench.SCENARIOS),
                               f"Which of {pool_bench.SCENARIOS} to run.")
_TACTIC = flags.DEFINE_enum("tactic", "stream", ["stream", "cpu", "hybrid"],
                            "How the host pages are attended.")
_PROFILE = flags.DEFINE_string("profile", None, "The planner's profile JSON for the bounds "
                               "(default: rkv.H200_DEFAULT).")
_RAGGED_GIB = flags.DEFINE_float("ragged_device_kv_gib", None, "(b)'s device KV budget in GiB "
                                  "(default: the config's).")
_STEPS = flags.DEFINE_integer("steps", None, "Timed decode steps (default: the config's).",
                              lower_bound=1)

COLUMNS = ["scenario", "layout", "batch", "tokens_per_s", "bound_tokens_per_s", "ratio_to_bound",
           "host_share", "kv_bytes_read", "kv_bytes_moved", "kept_ttft_s", "full_ttft_s", "speedup"]


def main(argv):
  del argv
  benchmarking.check_output_path(_OUT.value)
  kw = dict(tactic=_TACTIC.value, profile_path=_PROFILE.value)
  if _RAGGED_GIB.value is not None:
    kw["ragged_device_kv_gib"] = _RAGGED_GIB.value
  if _STEPS.value is not None:
    kw["steps"] = _STEPS.value
  cfg = pool_bench.PoolBenchConfig.quick(**kw) if _QUICK.value else \
      pool_bench.PoolBenchConfig(**kw)
  result = pool_bench.run(cfg, scenarios=_SCENARIOS.value)
  result["environment"] = benchmarking.environment()
  print(benchmarking.format_table(result["rows"], COLUMNS))
  if _OUT.value:
    benchmarking.write_json(_OUT.value, result)


if __name__ == "__main__":
  app.run(main)
