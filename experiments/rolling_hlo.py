"""Writes the compiled HLO of one streamed decode step and its transfer report (rkv.offload.hlo_report).

The proof that the tail moves by async DMA and where XLA placed the waits is in this text.
(benchmarks/results/rolling_overlap/scan_128k_w50.hlo.txt is the stacked-tail scan schedule, since
removed; the per-tile cache's in-jit schedule is "unrolled".)
  python -m experiments.rolling_hlo --context=131072 --window_fraction=0.5 --out_dir=/tmp/hlo
"""

import json
import os

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

import rkv
from rkv.offload import memory

_CONTEXT = flags.DEFINE_integer("context", 131072, "Cells in the cache.", lower_bound=1)
_FRACTION = flags.DEFINE_float("window_fraction", 0.5, "Share of the cells in the device window.")
_TILE = flags.DEFINE_integer("tile_cells", 32768, "Tail tile size in cells.", lower_bound=1)
_SCHEDULES = flags.DEFINE_list("schedules", ["unrolled"], "Schedules to compile (the single-program "
                               "ones: 'eager' dispatches many small programs).")
_LOOKAHEAD = flags.DEFINE_integer("lookahead", 1, "Tiles requested ahead of the attended one.",
                                  lower_bound=0)
_OUT_DIR = flags.DEFINE_string("out_dir", "/tmp/rkv_hlo", "Where the .hlo.txt files and report go.")


def main(argv):
  del argv
  b, h, k, d, s = 1, 32, 8, 128, _CONTEXT.value
  w = int(s * _FRACTION.value)
  kk, kv_, kq = jax.random.split(jax.random.key(0), 3)
  keys = jax.random.normal(kk, (b, s, k, d), jnp.bfloat16)
  values = jax.random.normal(kv_, (b, s, k, d), jnp.bfloat16)
  cache = rkv.RollingKV.from_arrays(keys, values, window_cells=w, tile_cells=_TILE.value)
  q = jax.random.normal(kq, (b, 1, h, d), jnp.bfloat16)
  os.makedirs(_OUT_DIR.value, exist_ok=True)
  report = {}
  for schedule in _SCHEDULES.value:
    text = rkv.rolling.lower(q, cache, schedule=schedule,
                             lookahead=_LOOKAHEAD.value).compile().as_text()
    with open(os.path.join(_OUT_DIR.value, f"{schedule}.hlo.txt"), "w") as f:
      f.write(text)
    report[schedule] = memory.hlo_report(text)
    print(schedule, report[schedule])
  with open(os.path.join(_OUT_DIR.value, "hlo_report.json"), "w") as f:
    json.dump(report, f, indent=1)


if __name__ == "__main__":
  app.run(main)
