"""End-to-end decode benchmark (issue 5): rkv vs transformers, Llama-3-8B shape, random bf16.

Decode tokens/s (median of the timed steps after warm-up) at each context, the caches filled
synthetically (random K/V, no prefill): rkv resident, rkv with half the KV on the host (planner
mode auto), transformers StaticCache and its offloaded cache (sdpa, torch on the GPU, run first
in a spawned child). Writes JSON and a PNG of tokens/s against context (rkv/decode_bench.py).

Example (H200, ~8 min; rkv's half tail at 512K is 32 GiB, within the default 64 GiB pinned pool):
  .venv/bin/python -m experiments.decode_bench \
      --contexts=131072,524288 --out=benchmarks/results/decode_bench_h200.json \
      --plot=benchmarks/results/decode_bench_h200.png
CPU smoke run:
  .venv/bin/python -m experiments.decode_bench --preset=tiny-llama --dtype=float32 \
      --contexts=512,1024 --steps=2 --warmup=1 --offload_steps=2 --offload_warmup=1 \
      --tile_cells=128 --min_tile_cells=128 --margin_gib=0 --out=/tmp/decode_bench.json \
      --plot=/tmp/decode_bench.png
"""

from absl import app, flags

from rkv import decode_bench

_PRESET = flags.DEFINE_string("preset", "llama3-8b", "Model preset (random weights).")
_CONTEXTS = flags.DEFINE_list("contexts", ["131072", "524288"], "Synthetic cache fills (tokens).")
_CONFIGS = flags.DEFINE_list("configs", list(decode_bench.CONFIGS), "Rows to run.")
_BATCH = flags.DEFINE_integer("batch", 1, "Batch rows.")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Weights and KV dtype.")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed decode steps (resident/static rows).")
_STEPS = flags.DEFINE_integer("steps", 16, "Timed decode steps (resident/static rows).")
_OFF_WARMUP = flags.DEFINE_integer("offload_warmup", 2, "Untimed steps (offloaded rows).")
_OFF_STEPS = flags.DEFINE_integer("offload_steps", 6, "Timed steps (offloaded rows).")
_FRACTION = flags.DEFINE_float("offload_fraction", 0.5, "Share of the KV rkv puts on the host.")
_MODE = flags.DEFINE_enum("offload_mode", "auto", list(decode_bench.OFFLOAD_MODES),
                          "Planner mode of rkv_offload (force: force_stream).")
_TILE = flags.DEFINE_integer("tile_cells", 32768, "Largest host-tail tile (cells).")
_MIN_TILE = flags.DEFINE_integer("min_tile_cells", 4096, "Smallest host-tail tile (cells).")
_MARGIN = flags.DEFINE_float("margin_gib", 6.0, "Device memory kept free in the fit checks.")
_DEVMEM = flags.DEFINE_float("device_memory_gib", 0.0, "Device memory for the fit checks (0: ask).")
_PROFILE = flags.DEFINE_string("profile", None, "rkv.Profile JSON the planner uses (default: "
                               "~/.cache/rkv/profile.json if present, else rkv.H200_DEFAULT).")
_HF_DEVICE = flags.DEFINE_string("hf_device", "auto", "torch device (auto: cuda if present).")
_IMPL = flags.DEFINE_enum("impl", "auto", ["auto", "xla", "pallas", "reference"], "rkv attention.")
_SCHEDULE = flags.DEFINE_enum("schedule", None, list(decode_bench.SCHEDULES),
                              "Rolling caches' streaming schedule (default: rkv.rolling's).")
_OUT = flags.DEFINE_string("out", "benchmarks/results/decode_bench_h200.json", "JSON output.")
_PLOT = flags.DEFINE_string("plot", "benchmarks/results/decode_bench_h200.png",
                            "PNG output ('' = none).")


def main(argv):
  del argv
  cfg = decode_bench.BenchConfig(
      preset=_PRESET.value, contexts=tuple(int(x) for x in _CONTEXTS.value),
      configs=tuple(_CONFIGS.value), batch=_BATCH.value, dtype=_DTYPE.value,
      warmup=_WARMUP.value, steps=_STEPS.value, offload_warmup=_OFF_WARMUP.value,
      offload_steps=_OFF_STEPS.value, offload_fraction=_FRACTION.value,
      offload_mode=_MODE.value, tile_cells=_TILE.value, min_tile_cells=_MIN_TILE.value,
      margin_gib=_MARGIN.value, device_memory_gib=_DEVMEM.value, hf_device=_HF_DEVICE.value,
      impl=_IMPL.value, schedule=_SCHEDULE.value, profile_path=_PROFILE.value)
  decode_bench.main(cfg, _OUT.value, _PLOT.value or None)


if __name__ == "__main__":
  app.run(main)
