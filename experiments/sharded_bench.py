"""Several devices (issue 16): Llama-3-8B-shape decode over a mesh vs one device, against the
bound; the aggregate tail rate; resident decode scaling (lab/sharded_bench.py). JSON out.

Example (2 x H200), two runs:
  # 1M tokens: the heads split fits the two HBMs (64 GiB of KV each); one GPU keeps a host tail
  # (the planner's dry run with 15 GiB of weights: 7.9 GiB, hybrid). Plus resident scaling at
  # 512K and the tail rate of one link vs both.
  .venv/bin/python -m experiments.sharded_bench --devices=2 --contexts=1048576 \
      --layouts=1x1,1xN --resident_context=524288 --out=benchmarks/results/sharded/h200x2_1m.json
  # 2M tokens: 128 GiB of KV a GPU, each with its own tail (dry run: 1.2 GiB a GPU, stream; the
  # limit covers both GPUs' tails in one process's pool with room for a larger --reserve_mib)
  XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=96 .venv/bin/python -m experiments.sharded_bench \
      --devices=2 --contexts=2097152 --layouts=1xN --resident_context=0 \
      --out=benchmarks/results/sharded/h200x2_2m.json

CPU smoke run (2 host devices, tiny model, explicit per-device budget: CPU has no memory stats):
  XLA_FLAGS=--xla_force_host_platform_device_count=2 .venv/bin/python -m experiments.sharded_bench \
      --preset=tiny-llama --dtype=float32 --devices=2 --contexts=1024 --layouts=1x1,1xN,Nx1 \
      --resident_context=256 --budget_mib=0.2 --resident_budget_mib=10 --tile_cells=128 --min_tile_cells=128 \
      --warmup=1 --steps=2 --tail_tiles=2 --tail_tile_cells=128 --tail_repeats=2 \
      --out=/tmp/sharded_bench.json
"""

from absl import app, flags

from lab import sharded_bench
from rkv import benchmarking

_PRESET = flags.DEFINE_string("preset", "llama3-8b", "Model preset (random weights).")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Weights and KV dtype.")
_DEVICES = flags.DEFINE_integer("devices", 2, "Devices of the N-device layouts.", lower_bound=1)
_CONTEXTS = flags.DEFINE_list("contexts", ["1048576", "2097152"], "Decode contexts (tokens).")
_LAYOUTS = flags.DEFINE_list("layouts", ["1x1", "1xN"], f"Mesh layouts seq x heads, of "
                             f"{sharded_bench.LAYOUTS} (N = --devices).")
_RESIDENT = flags.DEFINE_integer("resident_context", 524288, "Context of the resident scaling "
                                 "rows (0: none).", lower_bound=0)
_BATCH = flags.DEFINE_integer("batch", 1, "Batch rows.", lower_bound=1)
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed decode steps.", lower_bound=0)
_STEPS = flags.DEFINE_integer("steps", 6, "Timed decode steps (the median is reported).",
                              lower_bound=1)
_MODE = flags.DEFINE_string("mode", "auto", "Planner mode of the decode rows.")
_BUDGET = flags.DEFINE_float("budget_mib", 0.0, "KV budget per device in MiB (0: free device "
                             "memory after the weights minus the planner's reserve).")
_RES_BUDGET = flags.DEFINE_float("resident_budget_mib", 0.0, "KV budget per device of the "
                                 "resident scaling rows (0: --budget_mib).")
_RESERVE = flags.DEFINE_float("reserve_mib", None, "The planner's reserve (default: derived).")
_TILE = flags.DEFINE_integer("tile_cells", 32768, "Largest host-tail tile (cells).")
_MIN_TILE = flags.DEFINE_integer("min_tile_cells", 4096, "Smallest host-tail tile (cells).")
_PROFILE = flags.DEFINE_string("profile", None, "rkv.Profile JSON the planner uses.")
_TAIL_TILES = flags.DEFINE_integer("tail_tiles", 8, "Tiles per device of the tail-rate probe.")
_TAIL_CELLS = flags.DEFINE_integer("tail_tile_cells", 32768, "Cells of a tail-rate tile.")
_TAIL_REPEATS = flags.DEFINE_integer("tail_repeats", 5, "Timed repeats of the tail-rate probe.")
_OUT = flags.DEFINE_string("out", "benchmarks/results/sharded_bench.json", "JSON output.")


def main(argv):
  del argv
  benchmarking.check_output_path(_OUT.value)
  cfg = sharded_bench.BenchConfig(
      preset=_PRESET.value, dtype=_DTYPE.value, devices=_DEVICES.value,
      contexts=tuple(int(c) for c in _CONTEXTS.value), layouts=tuple(_LAYOUTS.value),
      resident_context=_RESIDENT.value or None, batch=_BATCH.value, warmup=_WARMUP.value,
      steps=_STEPS.value, mode=_MODE.value, budget_mib=_BUDGET.value,
      resident_budget_mib=_RES_BUDGET.value,
      reserve_mib=_RESERVE.value, tile_cells=_TILE.value, min_tile_cells=_MIN_TILE.value,
      profile_path=_PROFILE.value, tail_tiles=_TAIL_TILES.value,
      tail_tile_cells=_TAIL_CELLS.value, tail_repeats=_TAIL_REPEATS.value)
  result = sharded_bench.run(cfg)
  benchmarking.write_json(_OUT.value, result)
  print(sharded_bench.format_table(result))
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
