"""Probe this machine's figures for the residency planner and write a profile JSON.

Measures host↔device device_put bandwidth and its per-put fixed cost (pinned_host ↔ device),
small-copy latency, the device decode-attention rate, host memory read bandwidth, and — over a
real RollingKV with a pinned_host tail — the cpu tactic's CPU branch at several tail sizes (rate
and fixed cost) and both hybrid sides running at once (each side's rate under contention)
(rkv/probe.py). rkv.plan reads the profile (ResidencyConfig(profile_path=...), default
~/.cache/rkv/profile.json).

Example (H200):
  .venv/bin/python -m experiments.probe --out=benchmarks/results/profile_h200.json
CPU smoke run (small sizes):
  .venv/bin/python -m experiments.probe --transfer_mib=1,4 --attn_kv_lens=512,2048 \
      --num_heads=4 --num_kv_heads=2 --head_dim=64 --dtype=float32 --cpu_kv_len=2048 \
      --cpu_tile_cells=1024 --tail_tiles=1,4 --contention_tiles=4 --host_read_mib=16 \
      --repeats=3 --out=/tmp/profile.json
Any figure can be forced, e.g. --cpu_attn_gbps=20 (recorded as overridden in the profile).
"""

from absl import app
from absl import flags

from rkv import probe
from rkv import benchmarking

_D = probe.ProbeConfig()  # every flag's default is the library's

_TRANSFER = flags.DEFINE_list("transfer_mib", [f"{x:g}" for x in _D.transfer_mib],
                              "device_put sizes (MiB): a line through the host->device times "
                              "gives pcie_gbps and transfer_overhead_us; the largest, d2h_gbps.")
_LATENCY = flags.DEFINE_float("latency_kib", _D.latency_kib, "Size of the small copy timed for its latency.")
_KV_LENS = flags.DEFINE_list("attn_kv_lens", [str(x) for x in _D.attn_kv_lens],
                             "KV lengths of the decode-attention timings (a line is fit).")
_BATCH = flags.DEFINE_integer("batch", 1, "Batch B of the attention shapes.", lower_bound=1)
_HEADS = flags.DEFINE_integer("num_heads", 32, "Query heads H.", lower_bound=1)
_KV_HEADS = flags.DEFINE_integer("num_kv_heads", 8, "KV heads K.", lower_bound=1)
_HEAD_DIM = flags.DEFINE_integer("head_dim", 128, "Head dim D.", lower_bound=1)
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "KV dtype.")
_IMPL = flags.DEFINE_enum("impl", "auto", ["auto", "xla", "pallas", "reference"],
                          "rkv.attention backend timed.")
_CPU = flags.DEFINE_bool("cpu", True, "Measure host-CPU attention (if its module exists).")
_CPU_KV_LEN = flags.DEFINE_integer("cpu_kv_len", _D.cpu_kv_len, "KV length of the CPU attention timing.",
                                   lower_bound=1)
_CPU_TILE = flags.DEFINE_integer("cpu_tile_cells", _D.cpu_tile_cells,
                                 "Tail tile of the CPU timings and of the probe's RollingKV.",
                                 lower_bound=1)
_TAIL_TILES = flags.DEFINE_list("tail_tiles", [str(n) for n in _D.tail_tiles],
                                "Tail sizes (tiles) of the cpu path's fit: cpu_attn_gbps and "
                                "cpu_overhead_us.")
_CONTENTION = flags.DEFINE_integer("contention_tiles", _D.contention_tiles,
                                   "Tiles of the hybrid contention step (0: not measured).",
                                   lower_bound=0)
_CPU_THREADS = flags.DEFINE_integer("cpu_threads", None,
                                    "CPU kernel threads (default: the tactics' default, all "
                                    "cores but one; rkv.offload.cpu_attention.tail_threads).")
_HOST_READ = flags.DEFINE_float("host_read_mib", _D.host_read_mib, "Buffer read to time host memory bandwidth.")
_WARMUP = flags.DEFINE_integer("warmup", _D.warmup, "Untimed runs before timing.", lower_bound=0)
_REPEATS = flags.DEFINE_integer("repeats", 7, "Timed runs; the median is reported.", lower_bound=1)
_OUT = flags.DEFINE_string("out", None, "Profile path (default ~/.cache/rkv/profile.json).")
_OVERRIDES = {name: flags.DEFINE_float(name, None, f"Use this {name} instead of measuring it.")
              for name in probe.FIGURES}


def main(argv):
  del argv
  # Output paths first: an unwritable one used to fail only after the whole run.
  benchmarking.check_output_path(_OUT.value)
  cfg = probe.ProbeConfig(
      transfer_mib=tuple(float(x) for x in _TRANSFER.value), latency_kib=_LATENCY.value,
      attn_kv_lens=tuple(int(x) for x in _KV_LENS.value), batch=_BATCH.value,
      num_heads=_HEADS.value, num_kv_heads=_KV_HEADS.value, head_dim=_HEAD_DIM.value,
      dtype=_DTYPE.value, impl=_IMPL.value, cpu=_CPU.value, cpu_kv_len=_CPU_KV_LEN.value,
      cpu_tile_cells=_CPU_TILE.value, tail_tiles=tuple(int(x) for x in _TAIL_TILES.value),
      contention_tiles=_CONTENTION.value, cpu_threads=_CPU_THREADS.value,
      host_read_mib=_HOST_READ.value,
      warmup=_WARMUP.value, repeats=_REPEATS.value,
      overrides={name: flag.value for name, flag in _OVERRIDES.items()})
  profile = probe.run_probe(cfg)
  path = profile.save(_OUT.value or probe.default_profile_path())
  print(profile.describe())
  checks = probe.format_checks(profile)
  if checks:
    print(checks)
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
