"""How soon does a hybrid layer's CPU kernel start? One layer's decode step, switch by switch.

Why it matters (docs/DESIGN.md §7, "a hybrid layer, event by event"): a hybrid layer's time is
its CPU share's chain, and at 2M int8 on the H200 the kernel started ~2 ms into a 5.5 ms layer
(the worker waiting for the GIL, its query copy, its setup). This times, for one
``RollingKV.attend`` of a hybrid cache on this machine (host clock), when the CPU kernel's call
begins after ``attend`` is entered, and the whole call (to its partials' readiness), for each
variant of the session-18 switches, round-robin so that drift hits them alike:

  default          every switch off
  worker_first     $RKV_WORKER_FIRST=1 (attend goes on once the worker holds the GIL)
  q_copy           $RKV_EARLY_Q_COPY=1 (the query's host copy requested before the worker)
  both             the two above
  switch_<N>us     $RKV_SWITCH_INTERVAL_US=N, with the interval set around the call as
                   layered_forward sets it

The kernel's start is seen through a wrapper around the loaded library's entry point (this
script's own instrumentation; the library is not changed). The step is not a model's: no
other layers, no joins, so what it shows is the mechanism, not a tok/s.

  python -m experiments.chain_probe --steps=60 --out=/tmp/chain_probe.json
"""

import contextlib
import json
import os
import statistics
import time
from unittest import mock

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from rkv import benchmarking

_STEPS = flags.DEFINE_integer("steps", 60, "Timed steps per variant (after 5 warm-up steps).",
                              lower_bound=1)
_WINDOW = flags.DEFINE_integer("window", 4096, "Window cells.", lower_bound=1)
_TILE = flags.DEFINE_integer("tile", 1024, "Cells a tile.", lower_bound=1)
_TILES = flags.DEFINE_integer("tiles", 5, "Full tail tiles.", lower_bound=2)
_CPU_FRACTION = flags.DEFINE_float("cpu_fraction", 0.4, "The hybrid split's CPU share.")
_KV_DTYPE = flags.DEFINE_enum("kv_dtype", "int8", ["int8", "bfloat16"], "The cache's dtype.")
_SWITCH_US = flags.DEFINE_integer("switch_us", 200, "The switch_<N>us variant's interval.",
                                  lower_bound=1)
_OUT = flags.DEFINE_string("out", None, "Where to write the JSON result (none: print only).")

SWITCHES = ("RKV_WORKER_FIRST", "RKV_EARLY_Q_COPY", "RKV_SWITCH_INTERVAL_US")


def variants(switch_us: int) -> dict[str, dict[str, str]]:
  return {"default": {}, "worker_first": {"RKV_WORKER_FIRST": "1"},
          "q_copy": {"RKV_EARLY_Q_COPY": "1"},
          "both": {"RKV_WORKER_FIRST": "1", "RKV_EARLY_Q_COPY": "1"},
          f"switch_{switch_us}us": {"RKV_SWITCH_INTERVAL_US": str(switch_us)}}


class _KernelClock:
  """The CPU kernel library with its entry point timed (the last call's start)."""

  def __init__(self, lib):
    self._lib = lib
    self.started = None

  def __getattr__(self, name):
    return getattr(self._lib, name)

  def rkv_cpu_attention(self, *args):
    self.started = time.perf_counter()
    return self._lib.rkv_cpu_attention(*args)


def main(argv):
  del argv
  benchmarking.check_output_path(_OUT.value)
  import rkv
  from rkv import rolling
  from rkv.offload import cpu_attention as cpu_lib
  for name in SWITCHES:
    if os.environ.get(name):
      raise app.UsageError(f"${name} is set; the probe sets each variant's switches itself")
  b, k, d, h = 1, 8, 128, 32
  window, tile, n = _WINDOW.value, _TILE.value, _TILES.value
  dtype = jnp.int8 if _KV_DTYPE.value == "int8" else jnp.bfloat16
  capacity = window + tile * (n + 1)
  rng = np.random.default_rng(0)
  fill = window + tile * n + 1
  kv = rkv.RollingKV.empty(b, capacity, k, d, window_cells=window, dtype=dtype,
                           tile_cells=tile).with_tactic("hybrid", _CPU_FRACTION.value)
  cells = jnp.asarray(rng.standard_normal((b, fill, k, d)), jnp.bfloat16)
  kv = kv.append(cells, cells, jnp.arange(fill, dtype=jnp.int32)[None])
  q = jnp.asarray(rng.standard_normal((b, 1, h, d)), jnp.bfloat16)
  new = jnp.asarray(rng.standard_normal((b, 1, k, d)), jnp.bfloat16)
  clock = _KernelClock(cpu_lib._lib())
  cpu_lib._lib = lambda: clock  # this process's instrumentation only

  def step(kv, env):
    with mock.patch.dict(os.environ, env):  # the switches for this step only
      scope = (rolling.host_kernel_switch_interval([kv]) if "RKV_SWITCH_INTERVAL_US" in env
               else contextlib.nullcontext())
      with scope:
        t0 = time.perf_counter()
        parts, kv = kv.attend(q, new, new, jnp.full((b, 1), kv.fill, jnp.int32), merge=False,
                              impl="xla" if jax.default_backend() == "cpu" else "auto")
        jax.block_until_ready(parts)
        t1 = time.perf_counter()
    if kv.room < 2:  # back to the fill the probe started from (a flush would change the split)
      kv = rkv.RollingKV.empty(b, capacity, k, d, window_cells=window, dtype=dtype,
                               tile_cells=tile).with_tactic("hybrid", _CPU_FRACTION.value)
      kv = kv.append(cells, cells, jnp.arange(fill, dtype=jnp.int32)[None])
    return kv, clock.started - t0, t1 - t0

  table = variants(_SWITCH_US.value)
  samples = {name: ([], []) for name in table}
  for _ in range(5):
    for env in table.values():
      kv, _, _ = step(kv, env)
  for _ in range(_STEPS.value):
    for name, env in table.items():
      kv, start, total = step(kv, env)
      samples[name][0].append(start)
      samples[name][1].append(total)
  rows = {}
  for name, (start, total) in samples.items():
    rows[name] = dict(switches=table[name],
                      kernel_start_ms=dict(median=1e3 * statistics.median(start),
                                           p90=1e3 * float(np.percentile(start, 90))),
                      attend_ms=dict(median=1e3 * statistics.median(total),
                                     p90=1e3 * float(np.percentile(total, 90))))
    print(f"{name:>14s}: kernel starts {rows[name]['kernel_start_ms']['median']:.3f} ms after "
          f"attend (p90 {rows[name]['kernel_start_ms']['p90']:.3f}); the call "
          f"{rows[name]['attend_ms']['median']:.3f} ms")
  result = dict(benchmark="chain_probe", environment=benchmarking.environment(),
                window=window, tile=tile, tiles=n, cpu_fraction=_CPU_FRACTION.value,
                kv_dtype=_KV_DTYPE.value, steps=_STEPS.value, cpu_count=os.cpu_count(),
                rows=rows)
  if _OUT.value:
    benchmarking.write_json(_OUT.value, result)
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
