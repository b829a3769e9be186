"""Rolling-cache decode benchmark: streamed host tail vs the performance model (docs/DESIGN.md §6).

On the H200 (bf16, H=32, K=8, D=128, B=1 decode), for each context and window fraction: the
measured step time per stream schedule (eager: per-tile eager transfers + dispatched partials;
unrolled: one jitted program), lookahead and tile size, the model time max(window kernel, tail
bytes / measured H2D rate), the tail's achieved GB/s, the resident and naive-offload baselines,
the async transfer ops in the unrolled program, and the append/flush cost. Writes JSON.

Example (H200):
  .venv/bin/python -m experiments.rolling_bench --contexts=131072,524288,1048576 \
      --window_fractions=1.0,0.75,0.5,0.25 --schedules=eager,unrolled --lookaheads=4,all \
      --tile_cells=16384,32768
XLA flags worth a row each (set before JAX starts), e.g.
  XLA_FLAGS=--xla_gpu_enable_pipelined_host_offloading=true .venv/bin/python -m ...
Tails above 64 GiB need XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB set before JAX starts.
CPU smoke run:
  .venv/bin/python -m experiments.rolling_bench --contexts=256 --tile_cells=32 --repeats=2 \
      --out=/tmp/rolling_bench.json
"""

from absl import app, flags

from lab import rolling_bench as bench
from rkv import benchmarking

_CONTEXTS = flags.DEFINE_list("contexts", ["131072", "524288", "1048576"],
                              "Context lengths (cells).")
_FRACTIONS = flags.DEFINE_list("window_fractions", ["1.0", "0.75", "0.5", "0.25"],
                               "Share of the context held in the device window.")
_SCHEDULES = flags.DEFINE_list("schedules", ["eager", "unrolled"], "Stream schedules to compare.")
_TILES = flags.DEFINE_list("tile_cells", ["32768"], "Tail tile sizes (cells) to compare.")
_LOOKAHEADS = flags.DEFINE_list("lookaheads", ["4"], "Tiles requested ahead of the attended one, "
                                "one row each; 'all' = every transfer up front (whole tail on "
                                "the device during the step).")
_HEADS = flags.DEFINE_integer("num_heads", 32, "Query heads H.", lower_bound=1)
_KV_HEADS = flags.DEFINE_integer("num_kv_heads", 8, "KV heads K.", lower_bound=1)
_HEAD_DIM = flags.DEFINE_integer("head_dim", 128, "Head dim D.", lower_bound=1)
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32", "int8"],
                           "KV dtype (int8: quantized cache, bf16 queries).")
_IMPL = flags.DEFINE_enum("impl", "auto", ["auto", "xla", "pallas", "reference"],
                          "Backend of the device partials.")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed runs before timing.", lower_bound=0)
_REPEATS = flags.DEFINE_integer("repeats", 20, "Timed runs; the median is reported.", lower_bound=1)
_HYBRID = flags.DEFINE_list("hybrid_cpu_fractions", [],
                            "Also time tactic='hybrid' (eager) at these CPU shares of the tail.")
_APPENDS = flags.DEFINE_integer("append_steps", 16, "One-token appends timed per tail size.",
                                lower_bound=1)
_OUT = flags.DEFINE_string("out", "benchmarks/results/rolling_bench.json", "JSON output path.")


def _lookahead(x: str):
  if x == "all":
    return None
  try:
    return int(x)
  except ValueError:
    raise app.UsageError(f"--lookaheads: expected positive ints or 'all', got {x!r}") from None


def main(argv):
  del argv
  # Output paths first: an unwritable one used to fail only after the whole run.
  benchmarking.check_output_path(_OUT.value)
  cfg = bench.BenchConfig(
      contexts=tuple(int(x) for x in _CONTEXTS.value),
      window_fractions=tuple(float(x) for x in _FRACTIONS.value),
      schedules=tuple(_SCHEDULES.value), tile_cells=tuple(int(x) for x in _TILES.value),
      lookaheads=tuple(_lookahead(x) for x in _LOOKAHEADS.value),
      num_heads=_HEADS.value, num_kv_heads=_KV_HEADS.value,
      head_dim=_HEAD_DIM.value, dtype=_DTYPE.value, impl=_IMPL.value, warmup=_WARMUP.value,
      repeats=_REPEATS.value, append_steps=_APPENDS.value,
      hybrid_cpu_fractions=tuple(float(x) for x in _HYBRID.value))
  result = bench.run(cfg)
  bench.write_json(result, _OUT.value)
  print(bench.format_table(result))
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
