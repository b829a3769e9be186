"""Several devices (issue 16): decode over a mesh against its bound, the aggregate tail rate, and
resident decode scaling (``experiments/sharded_bench.py`` is the front end).

**Decode rows.** For each context and layout (``1x1``: one device, its tail on its host link;
``1xN``: KV heads and the dense layers over N devices; ``Nx1``: the cells over N devices), the
planner over several devices (:func:`rkv.planner.plan_sharded`) places every device's share
within its budget (all its free memory after the weights, minus the reserve, unless
``budget_mib``), the caches are filled synthetically (random K/V, no prefill: as
``lab/decode_bench.py``, per device, each tail in that device's ``pinned_host``), the weights are
random and generated in their sharded layout (never whole on one device), and decode steps are
timed one by one (block on the logits), the median after ``warmup`` steps. Each row carries its
bound: the slowest device's ``lab.decode_bench.plan_bound`` (its weight share, window and tail
bytes over its own HBM and host link: the devices and their links run at once) and the ratio.

**Tail rate.** ``tail_tiles`` tiles of ``tail_tile_cells`` cells (the model's K/V cell of one
layer) in each device's ``pinned_host``, moved to the device by eager ``jax.device_put`` (the
stream tactic's transfer): on device 0 alone, then on every device at once; GB/s of each and
the ratio (the issue's target: >= 1.8x on two H200s, one PCIe link each).

**Resident scaling.** The decode rows of ``resident_context`` with every layer resident on one
device and over N (``mode=resident``): tok/s and the ratio.

Everything is plain Python over the library: no flags here (the experiment parses them).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import statistics
import time
from typing import Any, Callable

import numpy as np

from lab import decode_bench

GIB = 1 << 30
LAYOUTS = ("1x1", "1xN", "Nx1")
FILLED_TACTICS = ("resident", "stream", "cpu", "hybrid")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  preset: str = "llama3-8b"
  dtype: str = "bfloat16"
  devices: int = 2
  contexts: tuple[int, ...] = (1 << 20, 1 << 21)
  layouts: tuple[str, ...] = ("1x1", "1xN")
  resident_context: int | None = 1 << 19
  batch: int = 1
  warmup: int = 2
  steps: int = 6
  mode: str = "auto"
  budget_mib: float = 0.0          # per device; 0: free memory after the weights minus reserve
  resident_budget_mib: float = 0.0  # the resident scaling rows' (0: budget_mib)
  reserve_mib: float | None = None
  tile_cells: int = 32768
  min_tile_cells: int = 4096
  profile_path: str | None = None
  tail_tiles: int = 8
  tail_tile_cells: int = 32768
  tail_repeats: int = 5
  seed: int = 0

  def __post_init__(self):
    bad = [l for l in self.layouts if l not in LAYOUTS]
    if bad:
      raise ValueError(f"sharded_bench: layouts must be among {LAYOUTS}, got {bad}")
    for name in ("devices", "batch", "steps", "tail_tiles", "tail_tile_cells", "tail_repeats"):
      if getattr(self, name) < 1:
        raise ValueError(f"sharded_bench: {name} must be >= 1, got {getattr(self, name)}")
    if self.warmup < 0:
      raise ValueError(f"sharded_bench: warmup must be >= 0, got {self.warmup}")

  def mesh_shape(self, layout: str) -> tuple[int, int]:
    n = self.devices
    return {"1x1": (1, 1), "1xN": (1, n), "Nx1": (n, 1)}[layout]


def _share_config(mc, heads: int):
  """The per-device model config of a heads split (what each device holds and reads)."""
  return mc.replace(num_heads=mc.num_heads // heads, num_kv_heads=mc.num_kv_heads // heads,
                    intermediate_size=mc.intermediate_size // heads)


# ----------------------------------------------------------------------------------------------
# Random weights, generated sharded
# ----------------------------------------------------------------------------------------------
def random_sharded_model(mc, mesh, seed: int, impl: str = "auto"):
  """A :class:`rkv.parallel.ShardedModel` with random weights generated in place on the mesh
  (one jitted program whose outputs carry each leaf's ``NamedSharding``: an 8B model never sits
  whole on one device). Norm scales are ones; projections N(0, 0.02)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from rkv import parallel
  from rkv.models import Transformer
  from rkv.parallel import model as model_lib
  abstract = nnx.eval_shape(lambda: Transformer(mc, rngs=nnx.Rngs(0), impl=impl))
  graphdef, state = nnx.split(abstract)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
  names = [model_lib.path_name(path) for path, _ in leaves]
  shardings = [jax.sharding.NamedSharding(mesh, model_lib.param_spec(n, leaf.ndim))
               for n, (_, leaf) in zip(names, leaves)]

  def generate(key):
    out = []
    for i, (name, (_, leaf)) in enumerate(zip(names, leaves)):
      if name.endswith("scale"):
        out.append(jnp.ones(leaf.shape, leaf.dtype))
      else:
        x = jax.random.normal(jax.random.fold_in(key, i), leaf.shape, jnp.float32)
        out.append((0.02 * x).astype(leaf.dtype))
    return out

  # One program for every leaf, its outputs sharded (one compile per model, not per leaf).
  out = jax.jit(generate, out_shardings=shardings)(jax.random.key(seed))
  state = jax.tree_util.tree_unflatten(treedef, out)
  return parallel.ShardedModel(mc, mesh, impl, nnx.merge(graphdef, state))


# ----------------------------------------------------------------------------------------------
# Filled caches from a sharded plan
# ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def _kv_program(shape, dtype: str, sharding):
  """Random K and V of ``shape``, generated sharded (one compile per shape and layout)."""
  import jax
  import jax.numpy as jnp

  def gen(key):
    k1, k2 = jax.random.split(key)
    return (jax.random.normal(k1, shape, jnp.float32).astype(dtype),
            jax.random.normal(k2, shape, jnp.float32).astype(dtype))

  return jax.jit(gen, out_shardings=(sharding, sharding))


@functools.lru_cache(maxsize=4)
def _shift_program():
  import jax
  import jax.numpy as jnp
  return jax.jit(lambda p, offset: jnp.where(p >= 0, p + offset, p))


def _filled_sharded_kv(mesh, mc, batch, capacity, fill, seed):
  """A resident :class:`rkv.parallel.ShardedKV` of ``capacity`` cells holding ``fill`` random
  cells (slices fill in order, as decode appends them), generated sharded."""
  import jax
  import jax.numpy as jnp
  from rkv import parallel
  from rkv.parallel.mesh import CELLS_BS, CELLS_BSKD, REPLICATED
  n = mesh.devices.shape[0]
  s_l = -(-capacity // n)  # ShardedKV.empty's slice: ceil(capacity / seq)
  fills = np.clip(fill - s_l * np.arange(n), 0, s_l).astype(np.int32)
  shard = lambda spec: jax.sharding.NamedSharding(mesh, spec)
  shape = (batch, n * s_l, mc.num_kv_heads, mc.head_dim)

  kv = _kv_program(shape, jnp.dtype(mc.dtype).name, shard(CELLS_BSKD))
  k, v = kv(jax.random.key(seed))
  slot = np.arange(n * s_l)
  pos = np.where(slot % s_l < fills[slot // s_l], slot, -1).astype(np.int32)
  pos = jax.device_put(np.broadcast_to(pos, (batch, n * s_l)), shard(CELLS_BS))
  return parallel.ShardedKV(k=k, v=v, pos=pos, lengths=jax.device_put(fills, shard(REPLICATED)),
                            mesh=mesh)


def _shift_positions(kv, offset: int):
  """A RollingKV whose cells sit at positions ``+ offset`` (a later seq slice's)."""
  if offset == 0:
    return kv
  import numpy as np
  shift = lambda p: _shift_program()(p, np.int32(offset))
  tail = dataclasses.replace(kv.tail, pos=tuple(shift(p) for p in kv.tail.pos))
  return dataclasses.replace(kv, window=dataclasses.replace(kv.window, pos=shift(kv.window.pos)),
                             staging=dataclasses.replace(kv.staging, pos=shift(kv.staging.pos)),
                             tail=tail)


def filled_caches(plan, mesh, mc, fill: int, seed: int):
  """One cache per layer as ``plan`` (a ShardedPlan) places it, ``fill`` cells of the context
  written (random K/V): resident layers as a filled ShardedKV, others a ShardedRollingKV whose
  every device part is ``lab.decode_bench.filled_rolling`` built on that device."""
  import jax
  from rkv import parallel
  capacity, batch = plan.context_len, plan.batch
  share = _share_config(mc, plan.heads)
  cap_l = plan.slice_len
  out = []
  for i in range(mc.num_layers):
    grid = plan.layer_grid(i)
    if all(lp.tactic == "resident" for row in grid for lp in row):
      out.append(_filled_sharded_kv(mesh, mc, batch, capacity, fill, seed + i))
      continue
    parts = []
    for s, row in enumerate(grid):
      fill_s = int(np.clip(fill - s * cap_l, 0, cap_l))
      prow = []
      for h, lp in enumerate(row):
        dev = mesh.devices[s, h]
        resident = lp.tactic == "resident"
        with jax.default_device(dev):
          kv = decode_bench.filled_rolling(
              share, batch, cap_l, fill_s, window_cells=cap_l if resident else lp.window_cells,
              tile_cells=lp.tile_cells or cap_l, key=jax.random.key(seed + 1000 * i + 7 * s + h))
          kv = _shift_positions(kv, s * cap_l)
          prow.append(kv.with_tactic("stream" if resident else lp.tactic,
                                     lp.cpu_fraction if lp.tactic == "hybrid" else None))
      parts.append(tuple(prow))
    out.append(parallel.ShardedRollingKV(tuple(parts), mesh))
  return tuple(out)


# ----------------------------------------------------------------------------------------------
# Rows
# ----------------------------------------------------------------------------------------------
def _residency(cfg: BenchConfig, mode: str):
  import rkv
  budget = (cfg.resident_budget_mib or cfg.budget_mib) if mode == "resident" else cfg.budget_mib
  return rkv.ResidencyConfig(mode=mode, vram_target_mib=budget,
                             reserve_mib=cfg.reserve_mib, tile_cells=cfg.tile_cells,
                             min_tile_cells=cfg.min_tile_cells, profile_path=cfg.profile_path,
                             check_free=not budget)


def decode_row(cfg: BenchConfig, mc, layout: str, context: int, mode: str, *, log=print):
  """One decode row (module docstring): tok/s, the bound, the plan per device."""
  import jax
  import jax.numpy as jnp
  from rkv import parallel
  from rkv.planner import plan_sharded
  seq, heads = cfg.mesh_shape(layout)
  devices = jax.devices()[:seq * heads]
  if len(devices) < seq * heads:
    raise ValueError(f"sharded_bench: layout {layout} needs {seq * heads} devices, "
                     f"{len(jax.devices())} available")
  mesh = parallel.make_mesh(seq=seq, heads=heads, devices=devices)
  row: dict[str, Any] = dict(layout=layout, seq=seq, heads=heads, context=context,
                             batch=cfg.batch, mode=mode, devices=[str(d) for d in devices])
  t0 = time.perf_counter()
  sm = random_sharded_model(mc, mesh, cfg.seed)  # first: the planner sees memory after weights
  plan_for = lambda m: plan_sharded(mc, context, cfg.batch, seq=seq, heads=heads,
                                    residency=_residency(cfg, m),
                                    devices=list(mesh.devices.flat))
  plan = plan_for(mode)
  bad = sorted({t for p in plan.plans for t in p.tactics()} - set(FILLED_TACTICS))
  if bad:
    # rkv.parallel's rolling caches serve the RollingKV tactics (a device's 'head' split is
    # left for later): as decode_bench does, re-plan with the stream tactic and say so.
    row["planner_fallback"] = f"mode {mode!r} chose {bad}: re-planned with mode 'stream'"
    plan = plan_for("stream")
  log(plan.table())
  n_steps = cfg.warmup + cfg.steps
  fill = context - n_steps
  caches = filled_caches(plan, mesh, mc, fill, cfg.seed)
  row["setup_s"] = time.perf_counter() - t0
  share = _share_config(mc, heads)
  bounds = []
  for s in range(seq):
    fill_s = int(np.clip(fill + n_steps - s * plan.slice_len, 0, plan.slice_len))
    for h in range(heads):
      bounds.append(decode_bench.plan_bound(plan.plan_of(s, h), share, fill_s))
  worst = max(bounds, key=lambda b: b["bound_s"])
  row.update(bound_s=worst["bound_s"], bound_by=worst["bound_by"],
             bound_tokens_per_s=cfg.batch / worst["bound_s"],
             device_bytes_per_device=[b["device_bytes"] for b in bounds],
             tail_bytes_per_device=[b["tail_bytes"] for b in bounds],
             host_kv_gib_per_device=[p.host_bytes / GIB for p in plan.plans],
             device_kv_gib_per_device=[p.device_bytes / GIB for p in plan.plans],
             tactics_per_device=[sorted(set(p.tactics())) for p in plan.plans],
             modeled_step_s=plan.step_time_s, fits=plan.fits)
  rng = np.random.default_rng(cfg.seed)
  times = []
  for _ in range(n_steps):
    tok = jnp.asarray(rng.integers(0, mc.vocab_size, (cfg.batch, 1)), jnp.int32)
    t = time.perf_counter()
    logits, caches = parallel.forward(sm, tok, caches=caches, last_only=True)
    logits.block_until_ready()
    times.append(time.perf_counter() - t)
  timed = times[cfg.warmup:]
  med = statistics.median(timed)
  row.update(step_s=med, step_min_s=min(timed), step_max_s=max(timed), n_steps=len(timed),
             n_warmup=cfg.warmup, first_step_s=times[0], tokens_per_s=cfg.batch / med,
             bound_ratio=med / worst["bound_s"])
  del caches, sm
  gc.collect()
  return row


def tail_rate(cfg: BenchConfig, mc) -> dict[str, Any]:
  """The aggregate host->device rate of per-device tails (module docstring)."""
  import jax
  import jax.numpy as jnp
  from rkv.offload import memory
  devices = jax.devices()[:cfg.devices]
  shape = (cfg.batch, cfg.tail_tile_cells, mc.num_kv_heads, mc.head_dim)
  tiles = {}
  for i, d in enumerate(devices):
    make = jax.jit(lambda k: jax.random.normal(k, shape, jnp.float32).astype(mc.dtype),
                   out_shardings=memory.sharding(memory.DEVICE, d))
    tiles[d] = [jax.device_put(make(jax.random.key(100 * i + j)),
                               memory.sharding(memory.PINNED_HOST, d))
                for j in range(cfg.tail_tiles)]
  jax.block_until_ready(list(tiles.values()))
  tile_bytes = int(np.prod(shape)) * np.dtype(jnp.dtype(mc.dtype)).itemsize

  def move(devs):
    out = [jax.device_put(t, memory.sharding(memory.DEVICE, d)) for d in devs for t in tiles[d]]
    jax.block_until_ready(out)

  def timed(devs):
    move(devs)  # warm-up
    samples = []
    for _ in range(cfg.tail_repeats):
      t = time.perf_counter()
      move(devs)
      samples.append(time.perf_counter() - t)
    s = statistics.median(samples)
    return dict(seconds=s, gbps=len(devs) * cfg.tail_tiles * tile_bytes / s / 1e9)

  one, every = timed(devices[:1]), timed(devices)
  return dict(tile_bytes=tile_bytes, tiles_per_device=cfg.tail_tiles, devices=len(devices),
              one_device=one, all_devices=every, ratio=every["gbps"] / one["gbps"],
              target_ratio=1.8)


def run(cfg: BenchConfig, *, log: Callable[[str], None] = print) -> dict[str, Any]:
  import jax
  from rkv import benchmarking
  from rkv.models import ModelConfig
  mc = ModelConfig.preset(cfg.preset, dtype=cfg.dtype)
  if jax.device_count() < cfg.devices:
    raise ValueError(f"sharded_bench: devices={cfg.devices} but {jax.device_count()} are visible")
  rows = []
  for context in cfg.contexts:
    for layout in cfg.layouts:
      log(f"decode {layout} at {context} tokens ...")
      rows.append(decode_row(cfg, mc, layout, context, cfg.mode, log=log))
      log(format_row(rows[-1]))
  scaling = []
  if cfg.resident_context:
    for layout in ("1x1", "1xN"):
      log(f"resident {layout} at {cfg.resident_context} tokens ...")
      scaling.append(decode_row(cfg, mc, layout, cfg.resident_context, "resident", log=log))
      log(format_row(scaling[-1]))
  log("tail rate ...")
  tail = tail_rate(cfg, mc)
  ratios = {}
  for context in cfg.contexts:
    by = {r["layout"]: r for r in rows if r["context"] == context}
    for layout in ("1xN", "Nx1"):
      if layout in by and "1x1" in by:
        ratios[f"{layout}_vs_1x1_at_{context}"] = by[layout]["tokens_per_s"] / by["1x1"][
            "tokens_per_s"]
  if len(scaling) == 2:
    ratios[f"resident_1xN_vs_1x1_at_{cfg.resident_context}"] = (
        scaling[1]["tokens_per_s"] / scaling[0]["tokens_per_s"])
  ratios["tail_rate_all_vs_one"] = tail["ratio"]
  return dict(**benchmarking.environment(), device_count=jax.device_count(),
              config=dataclasses.asdict(cfg), model=mc.name, rows=rows,
              resident_scaling=scaling, tail_rate=tail, ratios=ratios)


def format_row(r: dict) -> str:
  return (f"{r['layout']} ctx={r['context']} mode={r['mode']}: {r['tokens_per_s']:.3g} tok/s "
          f"(bound {r['bound_tokens_per_s']:.3g}, {r['bound_ratio']:.2f}x the bound, "
          f"{r['bound_by']}-bound; host KV GiB per device "
          f"{[round(x, 2) for x in r['host_kv_gib_per_device']]})")


def format_table(result: dict) -> str:
  from rkv import benchmarking
  rows = result["rows"] + result["resident_scaling"]
  table = benchmarking.format_table(rows, ["layout", "context", "mode", "tokens_per_s",
                                           "bound_tokens_per_s", "bound_ratio", "bound_by",
                                           "fits"])
  t = result["tail_rate"]
  return (f"{table}\ntail rate: one device {t['one_device']['gbps']:.3g} GB/s, "
          f"{t['devices']} devices {t['all_devices']['gbps']:.3g} GB/s ({t['ratio']:.2f}x; "
          f"target {t['target_ratio']}x)\nratios: {result['ratios']}")
