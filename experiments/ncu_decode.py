"""Decode-attention calls bracketed for Nsight Compute (lab/ncu_profile.py says why and how).

  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 \\
  XLA_FLAGS=--xla_gpu_enable_command_buffer= \\
  ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
      --section Occupancy --section WarpStateStats --csv --page details \\
      python3 -m experiments.ncu_decode --runs='[[2048, {}], [131072, {"block_k": 32}]]' \\
      > ncu_decode.csv
  python3 -m experiments.ncu_summary --csv=ncu_decode.csv

Command buffers are turned off so that each kernel is launched, and profiled, on its own.
Without ncu the calls simply run (the profiler start/stop are no-ops then).
"""

import ctypes
import json

from absl import app
from absl import flags

from lab import ncu_profile

_RUNS = flags.DEFINE_string("runs", '[[131072, {}]]', "JSON list of [keys, {BlockSizes "
                            "overrides, and \"kv_fill\": true to pass the cache's fill as the "
                            "resident cache does}]: one profiled call each.")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Unprofiled calls before each profiled one.",
                               lower_bound=1)


def main(argv):
  del argv
  try:
    runs = json.loads(_RUNS.value)
  except json.JSONDecodeError as e:
    raise app.UsageError(f"--runs is not JSON: {e}")
  cuda = ctypes.CDLL("libcuda.so.1")  # the driver API's cuProfilerStart / cuProfilerStop
  ncu_profile.profile_decode_calls(runs, start=cuda.cuProfilerStart, stop=cuda.cuProfilerStop,
                                   warmup=_WARMUP.value)


if __name__ == "__main__":
  app.run(main)
