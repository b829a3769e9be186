"""End-to-end decode benchmark (issue 5): rkv vs transformers, Llama-3-8B shape, random bf16.

Decode tokens/s (median of the timed steps after warm-up) at each context, the caches filled
synthetically (random K/V, no prefill): rkv resident, rkv with half the KV on the host (planner
mode auto), transformers StaticCache and its offloaded cache (sdpa, torch on the GPU, run first
in a spawned child). Writes JSON and a PNG of tokens/s against context (lab/decode_bench.py).

Example (H200, ~8 min; rkv's half tail at 512K is 32 GiB, within the default 64 GiB pinned pool):
  .venv/bin/python -m experiments.decode_bench \
      --contexts=131072,524288 --out=benchmarks/results/decode_bench_h200.json \
      --plot=benchmarks/results/decode_bench_h200.png

Beyond HBM (H200, rkv rows only; --budget=auto: the planner takes all free device memory after
the weights, minus its reserve, for the window, and the rest of the KV goes to pinned host; each
row carries its bandwidth bound, bound_tokens_per_s). One run per configuration group, --append
adding each to the same JSON:
  # 1M tokens, bf16: 128 GiB of KV
  .venv/bin/python -m experiments.decode_bench --configs=rkv_offload --budget=auto \
      --contexts=1048576 --out=benchmarks/results/decode_beyond_hbm_h200.json --plot=
  # 2M tokens, int8 KV: 132 GiB with the scales
  .venv/bin/python -m experiments.decode_bench --configs=rkv_offload --budget=auto \
      --contexts=2097152 --kv_dtype=int8 --out=benchmarks/results/decode_beyond_hbm_h200.json \
      --append --plot=
  # batch 8 x 128K: 128 GiB of KV
  .venv/bin/python -m experiments.decode_bench --configs=rkv_offload --budget=auto \
      --contexts=131072 --batch=8 --out=benchmarks/results/decode_beyond_hbm_h200.json \
      --append --plot=benchmarks/results/decode_beyond_hbm_h200.png
The host tail is the KV the device does not hold after the weights and the planner's reserve,
so it depends on XLA's device pool (XLA_PYTHON_CLIENT_MEM_FRACTION; with 0.75 of an H200 the
planner's dry run gives 40-45 GiB of tail in each of these rows, with 0.95 13-17 GiB); each row
records budget_gib, free_device_gib and host_kv_gib. A tail above 64 GiB needs
XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (GiB, e.g. 160) set in the environment before JAX starts;
without it the row fails at once with that advice (rkv.offload.memory.check_host_pool).

CPU smoke runs:
  .venv/bin/python -m experiments.decode_bench --preset=tiny-llama --dtype=float32 \
      --contexts=512,1024 --steps=2 --warmup=1 --offload_steps=2 --offload_warmup=1 \
      --tile_cells=128 --min_tile_cells=128 --margin_gib=0 --out=/tmp/decode_bench.json \
      --plot=/tmp/decode_bench.png
  (the same with --kv_dtype=int8 --batch=2 --configs=rkv_resident,rkv_offload: int8 caches,
  two batch rows; --budget=auto needs a backend with memory stats, not CPU's)
"""

from absl import app, flags, logging

from lab import decode_bench
from rkv import benchmarking

_PRESET = flags.DEFINE_string("preset", "llama3-8b", "Model preset (random weights).")
_CONTEXTS = flags.DEFINE_list("contexts", ["131072", "524288"], "Synthetic cache fills (tokens).")
_CONFIGS = flags.DEFINE_list("configs", list(decode_bench.CONFIGS), "Rows to run.")
_BATCH = flags.DEFINE_integer("batch", 1, "Batch rows.", lower_bound=1)
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Weights dtype (and the KV's by default).")
_KV_DTYPE = flags.DEFINE_enum("kv_dtype", None, list(decode_bench.KV_DTYPES),
                              "KV cache dtype (default: --dtype); int8: rkv rows only.")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed decode steps (resident/static rows).",
                               lower_bound=0)
_STEPS = flags.DEFINE_integer("steps", 16, "Timed decode steps (resident/static rows).",
                              lower_bound=1)
_OFF_WARMUP = flags.DEFINE_integer("offload_warmup", 2, "Untimed steps (offloaded rows).",
                                   lower_bound=0)
_OFF_STEPS = flags.DEFINE_integer("offload_steps", 6, "Timed steps (offloaded rows).",
                                  lower_bound=1)
_FRACTION = flags.DEFINE_float("offload_fraction", 0.5, "Share of the KV rkv puts on the host "
                               "(--budget=fraction).")
_BUDGET = flags.DEFINE_enum("budget", "fraction", list(decode_bench.BUDGETS),
                            "rkv_offload's device budget: fraction: (1 - offload_fraction) of the "
                            "KV; auto: all free device memory after the weights minus the "
                            "planner's reserve (vram_target_mib=0).")
_RESERVE = flags.DEFINE_float("reserve_gib", None, "The planner's reserve under --budget=auto, "
                              "in GiB (default: derived by the planner, "
                              "rkv.planner.derive_reserve).")
_RESERVE_MIB = flags.DEFINE_float("reserve_mib", None, "Deprecated: --reserve_gib in MiB.")
_MODE = flags.DEFINE_enum("offload_mode", "auto", list(decode_bench.OFFLOAD_MODES),
                          "Planner mode of rkv_offload (force: force_stream).")
_TILE = flags.DEFINE_integer("tile_cells", 32768, "Largest host-tail tile (cells).", lower_bound=1)
_MIN_TILE = flags.DEFINE_integer("min_tile_cells", 4096, "Smallest host-tail tile (cells).",
                                 lower_bound=1)
_MARGIN = flags.DEFINE_float("margin_gib", 6.0, "Device memory kept free in the fit checks.")
_DEVMEM = flags.DEFINE_float("device_memory_gib", 0.0, "Device memory for the fit checks (0: ask).")
_PROFILE = flags.DEFINE_string("profile", None, "rkv.Profile JSON the planner uses (default: "
                               "~/.cache/rkv/profile.json if present, else rkv.H200_DEFAULT).")
_HF_DEVICE = flags.DEFINE_string("hf_device", "auto", "torch device (auto: cuda if present).")
_IMPL = flags.DEFINE_enum("impl", "auto", ["auto", "xla", "pallas", "reference"], "rkv attention.")
_SCHEDULE = flags.DEFINE_enum("schedule", None, list(decode_bench.SCHEDULES),
                              "Rolling caches' streaming schedule (default: rkv.rolling's).")
_FILL_LOG = flags.DEFINE_integer("fill_log_every", 4, "Layers between fill progress lines.",
                                 lower_bound=1)
_SPLIT = flags.DEFINE_list("split_cpu_tiles", [], "rkv_offload rows: after the planned split, "
                           "time the same caches with every hybrid layer's CPU share set to each "
                           "of these tile counts, alternating with the plan (e.g. 1,2).")
_SWEEP_ENV = flags.DEFINE_list("sweep_env", [], "rkv_offload rows: after the planned run, time "
                                "the same caches under each of these settings of per-step "
                                "switches (NAME=VALUE, several joined by '+'; "
                                "lab.decode_bench.STEP_SWITCHES), alternating with the process's "
                                "own settings (e.g. RKV_HOST_SHARE=1,RKV_EARLY_Q_COPY=1).")
_SPLIT_ENV = flags.DEFINE_list("split_env", [], "rkv_offload rows: a CPU-tile override under "
                               "switch settings, N@NAME=VALUE[+NAME=VALUE...], in the same rounds "
                               "(e.g. 1@RKV_HOST_SHARE=0: the Python worker at 1 CPU tile).")
_ROUNDS = flags.DEFINE_integer("sweep_rounds", 2, "Rounds of --split_cpu_tiles / --sweep_env / "
                               "--split_env.",
                               lower_bound=1)
_EMBEDDING = flags.DEFINE_enum("embedding", "device", list(decode_bench.EMBEDDINGS),
                               "Where the rkv rows keep the input embedding table: the device, "
                               "or host RAM (rkv.models.embedding_to_host; untied tables only).")
_OUT = flags.DEFINE_string("out", "benchmarks/results/decode_bench_h200.json", "JSON output.")
_APPEND = flags.DEFINE_bool("append", False, "Add this run's rows to those already in --out.")
_PLOT = flags.DEFINE_string("plot", "benchmarks/results/decode_bench_h200.png",
                            "PNG output ('' = none).")


def _reserve_mib() -> float | None:
  if _RESERVE_MIB.value is not None:
    logging.warning("--reserve_mib is deprecated: use --reserve_gib=%g", _RESERVE_MIB.value / 1024)
    return _RESERVE_MIB.value
  return None if _RESERVE.value is None else 1024 * _RESERVE.value


def main(argv):
  del argv
  # Output paths first: an unwritable one used to fail only after the whole run.
  benchmarking.check_output_path(_OUT.value)
  benchmarking.check_output_path(_PLOT.value, "plot")
  cfg = decode_bench.BenchConfig(
      preset=_PRESET.value, contexts=tuple(int(x) for x in _CONTEXTS.value),
      configs=tuple(_CONFIGS.value), batch=_BATCH.value, dtype=_DTYPE.value,
      kv_dtype=_KV_DTYPE.value, budget=_BUDGET.value, reserve_mib=_reserve_mib(),
      fill_log_every=_FILL_LOG.value, warmup=_WARMUP.value, steps=_STEPS.value,
      offload_warmup=_OFF_WARMUP.value,
      offload_steps=_OFF_STEPS.value, offload_fraction=_FRACTION.value,
      offload_mode=_MODE.value, tile_cells=_TILE.value, min_tile_cells=_MIN_TILE.value,
      margin_gib=_MARGIN.value, device_memory_gib=_DEVMEM.value, hf_device=_HF_DEVICE.value,
      impl=_IMPL.value, schedule=_SCHEDULE.value, profile_path=_PROFILE.value,
      split_cpu_tiles=tuple(int(x) for x in _SPLIT.value),
      sweep_env=tuple(decode_bench.parse_env_entry(x) for x in _SWEEP_ENV.value),
      split_env=tuple(decode_bench.parse_split_env(x) for x in _SPLIT_ENV.value),
      sweep_rounds=_ROUNDS.value,
      embedding=_EMBEDDING.value)
  decode_bench.main(cfg, _OUT.value, _PLOT.value or None, append=_APPEND.value)


if __name__ == "__main__":
  app.run(main)
