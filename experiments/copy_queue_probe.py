"""Does a small host→device move wait behind tile copies already queued on the link?

Why it matters (docs/DESIGN.md §7): a hybrid layer's CPU partial (o, lse: ~16 KB at B=1) must
reach the device before the layer's merge, and the H200 runs one host→device copy at a time; if
the partial waited for every tile put queued before it, putting the next layer's tiles early
would hold up this layer's merge. Each variant issues ``--tiles`` tile puts (K and V,
``--tile_mib`` each), then at once the small move, and times (host clock, ready-synchronized)
when the small result is ready and when the tiles are. On the H200 (4 x 2 tiles of 64 MiB,
beyond_hbm/session9/a/copy_queue.json) the small move was ready after 1.12 ms against 0.20 ms
alone and 10.5 ms for the tiles: it waits for the copy in progress, not for the queue.

  alone_numpy      the small numpy array into a jitted add (how rkv's merge takes the CPU
                   partial), no tiles
  behind_numpy     the same right after the tile puts
  alone_pinned     numpy -> pinned_host array (a host copy), then a jitted program that moves it
                   to the device itself (``jax.device_put`` to ``memory_kind="device"`` inside)
  behind_pinned    the same right after the tile puts
  behind_d2h       a small device→host copy (``np.asarray``) right after the tile puts
  tiles_only       the tile puts alone

  python -m experiments.copy_queue_probe --tiles=4 --tile_mib=64 --out=/tmp/copy_queue.json
"""

import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from rkv import benchmarking
from rkv.offload import memory

_TILES = flags.DEFINE_integer("tiles", 4, "Tile puts queued first (each K and V).", lower_bound=1)
_TILE_MIB = flags.DEFINE_float("tile_mib", 64.0, "MiB of each K and each V tile.", lower_bound=1)
_SMALL = flags.DEFINE_integer("small_floats", 32 * 129, "float32 values of the small move "
                              "(B=1: H x (D + 1) = 4128, a partial's o and lse).", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 9, "Timed repeats per variant (after one warm-up).",
                                lower_bound=1)
_OUT = flags.DEFINE_string("out", None, "JSON output path.")


def _add_one(x):
  return x + 1.0


def _move_add_one(x):
  return jax.device_put(x, jax.memory.Space.Device) + 1.0  # as rkv's unrolled stream moves a tile


def main(argv):
  del argv
  benchmarking.check_output_path(_OUT.value)
  dev = jax.devices()[0]
  n = int(_TILE_MIB.value * (1 << 20)) // 2  # bf16 elements a tile
  tiles = [memory.to_host(jnp.full((n,), i, jnp.bfloat16)) for i in range(2 * _TILES.value)]
  small = np.arange(_SMALL.value, dtype=np.float32)
  on_dev = jax.device_put(small, dev)
  host_sh = memory.sharding("pinned_host")
  dev_sh = memory.sharding("device")  # how rkv's eager stream puts a tile
  add_one = jax.jit(_add_one)
  move_add = jax.jit(_move_add_one, in_shardings=host_sh, out_shardings=dev_sh)

  def small_numpy():
    return add_one(small)

  def small_pinned():
    return move_add(jax.device_put(small, host_sh))

  def small_d2h():
    return np.asarray(on_dev + 0.0)  # a fresh device value read back

  variants = {"alone_numpy": (False, small_numpy), "behind_numpy": (True, small_numpy),
              "alone_pinned": (False, small_pinned), "behind_pinned": (True, small_pinned),
              "behind_d2h": (True, small_d2h), "tiles_only": (True, None)}
  rows = {}
  for name, (with_tiles, fn) in variants.items():
    times = {"small_ms": [], "tiles_ms": []}
    for rep in range(_REPEATS.value + 1):
      jax.block_until_ready(on_dev)
      t0 = time.perf_counter()
      moved = jax.device_put(tiles, dev_sh) if with_tiles else None
      if fn is not None:
        jax.block_until_ready(fn())
        t_small = time.perf_counter()
      if moved is not None:
        jax.block_until_ready(moved)
      t_tiles = time.perf_counter()
      if rep:
        if fn is not None:
          times["small_ms"].append((t_small - t0) * 1e3)
        if moved is not None:
          times["tiles_ms"].append((t_tiles - t0) * 1e3)
      del moved
    rows[name] = {k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                  for k, v in times.items() if v}
    print(name, {k: round(v["median"], 3) for k, v in rows[name].items()}, flush=True)
  tile_bytes = 2 * _TILES.value * n * 2
  out = {**benchmarking.environment(), "tiles": _TILES.value, "tile_mib": _TILE_MIB.value,
         "small_floats": _SMALL.value, "repeats": _REPEATS.value, "tile_bytes": tile_bytes,
         "tiles_gbps": tile_bytes / (rows["tiles_only"]["tiles_ms"]["median"] * 1e-3) / 1e9,
         "hlo_move": move_add.lower(jax.device_put(small, host_sh)).compile().as_text()[:4000],
         "rows": rows}
  if _OUT.value:
    benchmarking.write_json(_OUT.value, out)


if __name__ == "__main__":
  app.run(main)
