"""Tail-tactic benchmark (issue 4): each tactic's measured decode step vs the residency model.

One layer (bf16, H=32, K=8, D=128, B=1, decode T=1) per context and window fraction (the layer's
KV budget as a share of its resident bytes): for stream, cpu, hybrid (the planner's split and the
--hybrid_splits around it) and head (the planner's R whole resident heads), the measured step
(median after warm-up, block_until_ready), the modeled step from rkv.planner with a profile
measured in the same run by rkv.probe (or --profile), measured/modeled, each output's error
against the resident one, the selector's pick vs the measured-fastest tactic (fastest / within
5%), and the CPU kernel's read GB/s vs the host read bandwidth (target >= half). Writes JSON and
prints a table. 1M cells bf16 K+V is 4 GiB per layer (host copy + pinned tail + resident baseline).

Example (H200):
  .venv/bin/python -m experiments.tactics_bench --contexts=262144,1048576 \
      --window_fractions=0.75,0.25 --out=benchmarks/results/tactics_bench_h200.json
CPU smoke run:
  .venv/bin/python -m experiments.tactics_bench --contexts=1024 --tile_cells=128 \
      --num_heads=4 --num_kv_heads=2 --head_dim=16 --dtype=float32 --warmup=0 --repeats=2 \
      --probe_transfer_mib=1 --probe_attn_kv_lens=256,1024 --probe_cpu_kv_len=1024 \
      --probe_host_read_mib=4 --probe_tail_tiles=1,4 --probe_contention_tiles=4 \
      --out=/tmp/tactics_bench.json
"""

from absl import app, flags

from rkv import probe
from rkv import tactics
from lab import tactics_bench
from rkv import benchmarking

_P = probe.ProbeConfig()  # the probe flags' defaults are the library's

_CONTEXTS = flags.DEFINE_list("contexts", ["262144", "1048576"], "Context lengths (cells).")
_FRACTIONS = flags.DEFINE_list("window_fractions", ["0.75", "0.25"],
                               "The layer's KV budget as a share of its resident bytes.")
_TACTICS = flags.DEFINE_list("tactics", list(tactics.OFFLOADED), "Tactics measured.")
_SPLITS = flags.DEFINE_list("hybrid_splits", ["plan", "plan-1", "plan+1"],
                            "Hybrid rows: 'plan' (the planner's split), 'plan+N'/'plan-N' (N more "
                            "/ fewer CPU tiles) or a CPU share of the tiles in [0, 1].")
_TILE = flags.DEFINE_integer("tile_cells", 32768, "The planner's largest tail tile (cells).",
                             lower_bound=1)
_HEADS = flags.DEFINE_integer("num_heads", 32, "Query heads H.", lower_bound=1)
_KV_HEADS = flags.DEFINE_integer("num_kv_heads", 8, "KV heads K.", lower_bound=1)
_HEAD_DIM = flags.DEFINE_integer("head_dim", 128, "Head dim D.", lower_bound=1)
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "KV dtype.")
_IMPL = flags.DEFINE_enum("impl", "auto", ["auto", "xla", "pallas", "reference"],
                          "Backend of the device partials.")
_SCHEDULE = flags.DEFINE_enum("schedule", "eager", ["eager", "unrolled"], "Stream schedule.")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed runs before timing.", lower_bound=0)
_REPEATS = flags.DEFINE_integer("repeats", 15, "Timed runs; the median is reported.", lower_bound=1)
_PROFILE = flags.DEFINE_string("profile", None, "rkv.Profile JSON to model with instead of "
                               "probing in this run.")
_P_TRANSFER = flags.DEFINE_list("probe_transfer_mib", [f"{x:g}" for x in _P.transfer_mib],
                                "Probe: device_put sizes (a line gives PCIe rate + fixed cost).")
_P_KV_LENS = flags.DEFINE_list("probe_attn_kv_lens", [str(x) for x in _P.attn_kv_lens],
                               "Probe: device attention KV lengths.")
_P_CPU_KV = flags.DEFINE_integer("probe_cpu_kv_len", _P.cpu_kv_len, "Probe: CPU attention KV length.",
                                 lower_bound=1)
_P_READ = flags.DEFINE_float("probe_host_read_mib", _P.host_read_mib, "Probe: host read buffer (MiB).")
_P_TAIL = flags.DEFINE_list("probe_tail_tiles", [str(n) for n in _P.tail_tiles],
                            "Probe: tail sizes (tiles) of the cpu tactic's rate + fixed cost fit.")
_P_CONTENTION = flags.DEFINE_integer("probe_contention_tiles", _P.contention_tiles,
                                     "Probe: tiles of the hybrid contention step (0: none).",
                                     lower_bound=0)
_CPU_THREADS = flags.DEFINE_integer("cpu_threads", None,
                                    "CPU kernel threads of the cpu / hybrid rows and the probe "
                                    "(default: the tactics' default, all cores but one).")
_OUT = flags.DEFINE_string("out", "benchmarks/results/tactics_bench_h200.json", "JSON output path.")


def main(argv):
  del argv
  # Output paths first: an unwritable one used to fail only after the whole run.
  benchmarking.check_output_path(_OUT.value)
  cfg = tactics_bench.TacticsConfig(
      contexts=tuple(int(x) for x in _CONTEXTS.value),
      window_fractions=tuple(float(x) for x in _FRACTIONS.value),
      tactics=tuple(_TACTICS.value), hybrid_splits=tuple(_SPLITS.value),
      tile_cells=_TILE.value, num_heads=_HEADS.value, num_kv_heads=_KV_HEADS.value,
      head_dim=_HEAD_DIM.value, dtype=_DTYPE.value, impl=_IMPL.value, schedule=_SCHEDULE.value,
      warmup=_WARMUP.value, repeats=_REPEATS.value, profile_path=_PROFILE.value,
      probe_transfer_mib=tuple(float(x) for x in _P_TRANSFER.value),
      probe_attn_kv_lens=tuple(int(x) for x in _P_KV_LENS.value),
      probe_cpu_kv_len=_P_CPU_KV.value, probe_host_read_mib=_P_READ.value,
      probe_tail_tiles=tuple(int(x) for x in _P_TAIL.value),
      probe_contention_tiles=_P_CONTENTION.value, cpu_threads=_CPU_THREADS.value)
  result = tactics_bench.run(cfg)
  tactics_bench.write_json(result, _OUT.value)
  print(tactics_bench.format_table(result))
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
