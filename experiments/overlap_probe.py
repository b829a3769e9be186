"""Does a host→device tail transfer overlap device compute, and through which mechanism?

Compares, for one decode step over a device window plus a pinned-host tail of N tiles:
  in_jit        rkv.rolling_attention(schedule="unrolled"): transfers inside one program
  rkv_eager     rkv.rolling_attention(schedule="eager"), the default lookahead (host flow control)
  rkv_eager_all the same with lookahead=None: every transfer up front, no host waits
  eager_fetch   one tiny jitted fetch per tile from a stacked [N,B,tile,K,D] pinned_host array
                (its own executable), all issued before compute
  eager_put     per-tile pinned_host arrays moved by jax.device_put (PJRT's transfer path)
  transfer_only the eager_put transfers alone;  compute_only  the attention on resident tiles
  put_return    host time until the eager device_puts *return* vs until their tiles are ready
If a variant overlaps, its time approaches max(transfer_only, compute_only) instead of the sum.
The first H200 run (benchmarks/results/rolling_overlap/overlap_probe_h200.json) predates the
per-tile cache: its in_jit row is the stacked-tail scan schedule (24.1 ms), eager_put 21.2 ms.
  python -m experiments.overlap_probe --context=524288 --window_fraction=0.5 --out=/tmp/overlap.json
"""

import json
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

import rkv
from rkv import benchmarking
from rkv.offload import memory

_CONTEXT = flags.DEFINE_integer("context", 524288, "Cells in the cache.", lower_bound=1)
_FRACTION = flags.DEFINE_float("window_fraction", 0.5, "Share of the cells on the device.")
_TILE = flags.DEFINE_integer("tile_cells", 32768, "Tail tile size.", lower_bound=1)
_OUT = flags.DEFINE_string("out", None, "JSON output path.")


def main(argv):
  del argv
  # Output paths first: an unwritable one used to fail only after the whole run.
  benchmarking.check_output_path(_OUT.value)
  b, h, kh, d, s = 1, 32, 8, 128, _CONTEXT.value
  w = int(s * _FRACTION.value)
  tile = _TILE.value
  n = (s - w) // tile
  keys = jax.random.split(jax.random.key(0), 3)
  k = jax.random.normal(keys[0], (b, s, kh, d), jnp.bfloat16)
  v = jax.random.normal(keys[1], (b, s, kh, d), jnp.bfloat16)
  q = jax.random.normal(keys[2], (b, 1, h, d), jnp.bfloat16)
  q_pos = jnp.full((b, 1), s - 1, jnp.int32)
  cache = rkv.RollingKV.from_arrays(k, v, window_cells=w, tile_cells=tile)
  win_k, win_v = k[:, :w], v[:, :w]
  # The first design's stacked tail, for the eager_fetch variant.
  stacked_k = memory.to_host(jnp.moveaxis(k[:, w:w + n * tile].reshape(b, n, tile, kh, d), 1, 0))
  stacked_v = memory.to_host(jnp.moveaxis(v[:, w:w + n * tile].reshape(b, n, tile, kh, d), 1, 0))
  tiles_k = [memory.to_host(k[:, w + i * tile:w + (i + 1) * tile]) for i in range(n)]
  tiles_v = [memory.to_host(v[:, w + i * tile:w + (i + 1) * tile]) for i in range(n)]
  dev_tiles = [(memory.to_device(a), memory.to_device(c)) for a, c in zip(tiles_k, tiles_v)]
  tile_pos = [jnp.arange(w + i * tile, w + (i + 1) * tile, dtype=jnp.int32)[None] for i in range(n)]
  win_pos = jnp.arange(w, dtype=jnp.int32)[None]

  attend = jax.jit(lambda q, k, v, p: rkv.attention(q, k, v, q_pos=q_pos, k_pos=p))
  fetch = jax.jit(lambda tk, tv, i: (jax.device_put(tk[i], jax.memory.Space.Device),
                                     jax.device_put(tv[i], jax.memory.Space.Device)))
  merge = jax.jit(lambda os, ls: rkv.merge_partials(jnp.stack(os), jnp.stack(ls)))

  def finish(parts):
    return merge([p[0] for p in parts], [p[1] for p in parts])

  def in_jit():
    return rkv.rolling_attention(q, cache, schedule="unrolled")

  def rkv_eager():
    return rkv.rolling_attention(q, cache, schedule="eager")

  def rkv_eager_all():
    return rkv.rolling_attention(q, cache, schedule="eager", lookahead=None)

  def eager_fetch():
    moved = [fetch(stacked_k, stacked_v, i) for i in range(n)]
    parts = [attend(q, win_k, win_v, win_pos)]
    parts += [attend(q, mk, mv, tile_pos[i]) for i, (mk, mv) in enumerate(moved)]
    return finish(parts)

  def eager_put():
    moved = [(memory.to_device(a), memory.to_device(c)) for a, c in zip(tiles_k, tiles_v)]
    parts = [attend(q, win_k, win_v, win_pos)]
    parts += [attend(q, mk, mv, tile_pos[i]) for i, (mk, mv) in enumerate(moved)]
    return finish(parts)

  def transfer_only():
    return [(memory.to_device(a), memory.to_device(c)) for a, c in zip(tiles_k, tiles_v)]

  def compute_only():
    parts = [attend(q, win_k, win_v, win_pos)]
    parts += [attend(q, mk, mv, tile_pos[i]) for i, (mk, mv) in enumerate(dev_tiles)]
    return finish(parts)

  ref = in_jit()
  results = {}
  for name, fn in [("in_jit", in_jit), ("rkv_eager", rkv_eager), ("rkv_eager_all", rkv_eager_all),
                   ("eager_fetch", eager_fetch), ("eager_put", eager_put),
                   ("transfer_only", transfer_only), ("compute_only", compute_only)]:
    out = fn()
    if name not in ("transfer_only", "in_jit"):
      err = float(jnp.max(jnp.abs(out[0].astype(jnp.float32) - ref[0].astype(jnp.float32))))
    else:
      err = None
    t = benchmarking.time_fn(fn, n_warmup=2, n_outer=7, n_inner=1)
    results[name] = dict(median_ms=t.median_s * 1e3, min_ms=t.min_s * 1e3, max_abs_diff=err)
    print(f"{name:14s} {t.median_s * 1e3:9.3f} ms  (min {t.min_s * 1e3:.3f})  diff={err}")
  # Does the eager device_put return before its copy is done? Host seconds until the calls
  # return vs until the tiles are ready (medians of 7). If they are close, device_put holds the
  # Python thread for the copy and a model's later layers cannot be dispatched meanwhile.
  host, ready = [], []
  for _ in range(8):
    t0 = time.perf_counter()
    moved = transfer_only()
    t1 = time.perf_counter()
    jax.block_until_ready(moved)
    host.append(t1 - t0)
    ready.append(time.perf_counter() - t0)
    del moved
  results["put_return"] = dict(host_ms=statistics.median(host[1:]) * 1e3,
                               ready_ms=statistics.median(ready[1:]) * 1e3)
  print(f"device_put of {n} tiles: returns after {results['put_return']['host_ms']:.3f} ms, "
        f"ready after {results['put_return']['ready_ms']:.3f} ms")
  tail_bytes = 2 * b * (s - w) * kh * d * 2
  payload = dict(benchmark="overlap_probe", environment=benchmarking.environment(),
                 context=s, window_cells=w, tile_cells=tile, n_tiles=n, tail_bytes=tail_bytes,
                 results=results,
                 sum_ms=results["transfer_only"]["median_ms"] + results["compute_only"]["median_ms"],
                 max_ms=max(results["transfer_only"]["median_ms"],
                            results["compute_only"]["median_ms"]))
  print(json.dumps({k: payload[k] for k in ("sum_ms", "max_ms")}))
  if _OUT.value:
    benchmarking.write_json(_OUT.value, payload)


if __name__ == "__main__":
  app.run(main)
