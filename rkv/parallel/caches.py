"""Per-layer caches on a ``(seq, heads)`` mesh: each implements ``rkv.models.kv.LayerCache``.

- :class:`ShardedKV` — a resident cache (or a sliding-window layer's ring) as global arrays:
  ``k, v [B, n_seq * S_l, K, D]`` with cells over ``seq`` and KV heads over ``heads``, ``pos
  [B, n_seq * S_l]``, ``lengths [n_seq]`` (cells written in each seq slice, replicated so every
  device computes the same owner). ``attend`` is one ``shard_map``: each device writes the chunk
  if its slice owns it, attends to its own cells, and with ``seq > 1`` the partials ``(o, lse)``
  are all-gathered over ``seq`` (``[n_seq,B,T,H/n_heads,D]``: tiny at decode) and merged by
  ``rkv.merge_partials``, the §2 merge every tactic uses. With ``seq = 1`` nothing crosses
  devices: each device runs the one-device ``ResidentCache`` / ``RingCache`` on its heads. A ring
  is only head-sharded (it holds a window, not the context): every seq replica keeps the same
  ring. Jittable: the fill is data.
- :class:`ShardedRollingKV` — one ``rkv.RollingKV`` per device, each with its own window, staging
  tile and tail in *its* device's ``pinned_host`` memory (built and attended under
  ``jax.default_device(d)``, which ``rkv.offload.memory`` honours), attended by its own tactic
  (``stream`` over that device's link, ``cpu`` / ``hybrid`` by the host kernel). Eager, like the
  rolling cache: per device the one-device code path, then, with ``seq > 1``, one jitted
  ``shard_map`` merges the partials over ``seq``.

Which slice takes a chunk: the first (lowest ``seq`` index) with room for all of it, so slices
fill in order. Positions drive every mask (docs/DESIGN.md §2), so where a cell lives never
changes which queries see it: the sharded caches are exact whatever the split.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from rkv import tactics as tactics_lib
from rkv.attention import MAX_DECODE_QUERIES, attention, merge_partials
from rkv.cache import RollingKV
from rkv.models.kv import ResidentCache, RingCache, _check_new
from rkv.offload import memory
from rkv.parallel import mesh as mesh_lib
from rkv.parallel.mesh import CELLS_BS, CELLS_BSKD, HEADS, HEADS_BTHD, REPLICATED, SEQ, P

_LSE_BTH = P(None, None, HEADS)


def _concrete(x) -> np.ndarray | None:
  return None if isinstance(x, jax.core.Tracer) else np.asarray(x)


# check_vma=False on every shard_map here: the attention kernels start their loop carries from
# constants, which the varying-axes check rejects inside a shard_map (it wants a pcast in
# rkv.attention); the outputs' replication over seq holds by construction (an all_gather, then the
# same merge on every slice).
def _merge_over_seq(o, lse):
  """Inside a ``shard_map``: the exact merge of every seq slice's partial of this device's
  heads, the same on every slice."""
  o_all = jax.lax.all_gather(o, SEQ)      # [n_seq,B,T,H_l,D]
  lse_all = jax.lax.all_gather(lse, SEQ)  # [n_seq,B,T,H_l]
  return merge_partials(o_all, lse_all)


@dataclasses.dataclass(frozen=True)
class ShardedKV:
  """A resident (or ring) layer cache on a mesh (module docstring)."""

  k: jax.Array
  v: jax.Array
  pos: jax.Array
  lengths: jax.Array
  mesh: object  # static (register_dataclass below): the jax.sharding.Mesh
  ring: bool = False

  tactic: ClassVar[str] = "resident"
  cpu_fraction: ClassVar[None] = None
  jittable: ClassVar[bool] = True

  @classmethod
  def empty(cls, mesh, batch: int, capacity: int, num_kv_heads: int, head_dim: int,
            dtype=jnp.bfloat16, *, ring: bool = False) -> "ShardedKV":
    """``capacity`` cells in all (split evenly over ``seq``, rounded up), or a ring of
    ``capacity`` slots (``ring``: every seq replica holds the whole ring)."""
    where = "ShardedKV.empty"
    mesh_lib.check_mesh(mesh, where)
    mesh_lib.check_divisible(where, "num_kv_heads", num_kv_heads, mesh)
    if batch < 1 or capacity < 1:
      raise ValueError(f"{where}: batch and capacity must be >= 1, got {batch}, {capacity}")
    n_seq = 1 if ring else mesh_lib.axis_size(mesh, SEQ)
    cells = n_seq * math.ceil(capacity / n_seq)
    specs = cls._specs_of(mesh, ring)
    k, v, pos, lengths = _empty_program(mesh, specs, (batch, cells, num_kv_heads, head_dim),
                                        jnp.dtype(dtype).name, n_seq)()
    return cls(k=k, v=v, pos=pos, lengths=lengths, mesh=mesh, ring=ring)

  @property
  def n_slices(self) -> int:
    return int(self.lengths.shape[0])

  @property
  def slice_cells(self) -> int:
    return self.k.shape[1] // self.n_slices

  @property
  def capacity(self) -> int:
    return self.k.shape[1]

  @staticmethod
  def _specs_of(mesh, ring: bool) -> "ShardedKV":
    """The partition specs of a cache's fields, as a ShardedKV (shard_map's spec pytree)."""
    kv, pos = (HEADS_BTHD, REPLICATED) if ring else (CELLS_BSKD, CELLS_BS)
    return ShardedKV(kv, kv, pos, REPLICATED, mesh, ring)

  # --- the layer-cache protocol ---
  @property
  def room(self) -> int | None:
    """Cells left in all slices (a chunk must fit in one slice); None for a ring."""
    if self.ring:
      return None
    return self.capacity - int(np.asarray(self.lengths).sum())

  def next_position(self) -> jax.Array:
    return jnp.sum(self.lengths)

  def streamed_tiles(self) -> tuple:
    return ()

  def attend(self, q, k, v, positions, *, window, softcap, scale, impl):
    where = "ShardedKV.attend"
    _check_new(where, self, k, v, positions)
    t = k.shape[1]
    lengths = _concrete(self.lengths)
    if not self.ring:
      if t > self.slice_cells:
        raise ValueError(f"{where}: a chunk of {t} cells exceeds a seq slice of "
                         f"{self.slice_cells} cells: prefill in chunks of at most that")
      if lengths is not None and not np.any(lengths + t <= self.slice_cells):
        # Under jit the fill is traced and a full cache would clamp silently (as ResidentCache).
        raise ValueError(f"{where}: writing {t} cells overflows every seq slice (filled "
                         f"{lengths.tolist()} of {self.slice_cells})")
    fn = _attend_program(self.mesh, self.ring, self.n_slices,
                         (("window", window), ("softcap", softcap), ("scale", scale),
                          ("impl", impl)))
    return fn(self, q, k, v, positions.astype(jnp.int32))


@functools.lru_cache(maxsize=64)
def _empty_program(mesh, specs, shape, dtype: str, n_seq: int):
  """The empty arrays made on the devices, each in its sharding (a host array of the whole
  cache would cross PCIe: 4 GiB a layer at 1M cells of Llama-3-8B)."""
  out = tuple(mesh_lib.sharding(mesh, spec) for spec in (specs.k, specs.v, specs.pos,
                                                          specs.lengths))
  return jax.jit(lambda: (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                          jnp.full(shape[:2], -1, jnp.int32), jnp.zeros((n_seq,), jnp.int32)),
                 out_shardings=out)


@functools.lru_cache(maxsize=64)
def _attend_program(mesh, ring: bool, n_slices: int, kw_items: tuple):
  """ShardedKV.attend's ``shard_map``, jitted once per structure: called eagerly (a ring layer
  between the rolling layers' eager halves) it is one program, not op-by-op dispatch; under the
  model's jit it simply inlines."""
  kw = dict(kw_items)
  specs = ShardedKV._specs_of(mesh, ring)
  body = _ring_body if ring else (_one_slice_body if n_slices == 1 else _seq_body)
  return jax.jit(jax.shard_map(lambda c, q, k, v, p: body(c, q, k, v, p, kw), mesh=mesh,
                               in_specs=(specs, HEADS_BTHD, HEADS_BTHD, HEADS_BTHD, REPLICATED),
                               out_specs=(HEADS_BTHD, specs), check_vma=False))


def _ring_body(c, q, k, v, positions, kw):
  o, ring = RingCache(c.k, c.v, c.pos, c.lengths[0]).attend(q, k, v, positions, **kw)
  return o, dataclasses.replace(c, k=ring.k, v=ring.v, pos=ring.pos, lengths=ring.length[None])


def _one_slice_body(c, q, k, v, positions, kw):
  o, res = ResidentCache(c.k, c.v, c.pos, c.lengths[0]).attend(q, k, v, positions, **kw)
  return o, dataclasses.replace(c, k=res.k, v=res.v, pos=res.pos, lengths=res.length[None])


def _seq_body(c, q, k, v, positions, kw):
  """One device's slice: write the chunk if this slice owns it, attend, merge over seq."""
  t, cells = k.shape[1], c.k.shape[1]
  me = jax.lax.axis_index(SEQ)
  owner = jnp.argmax(c.lengths + t <= cells)  # the first slice with room (checked outside)
  start = c.lengths[me]
  own = me == owner

  def write(buf, new):
    # A slice that does not own the chunk writes its own cells back (an O(T) select, so the
    # update stays in place); its start may clamp, which then rewrites equal values.
    idx = (0, start) + (0,) * (buf.ndim - 2)
    cur = jax.lax.dynamic_slice(buf, idx, new.shape)
    return jax.lax.dynamic_update_slice(buf, jnp.where(own, new.astype(buf.dtype), cur), idx)

  kk, vv, pp = write(c.k, k), write(c.v, v), write(c.pos, positions)
  o, lse = attention(q, kk, vv, q_pos=positions, k_pos=pp, causal=True, **kw)
  o, _ = _merge_over_seq(o.astype(jnp.float32), lse)
  lengths = c.lengths + jnp.where(jnp.arange(c.lengths.shape[0]) == owner, t, 0)
  return o.astype(q.dtype), dataclasses.replace(c, k=kk, v=vv, pos=pp, lengths=lengths)


jax.tree_util.register_dataclass(ShardedKV, data_fields=["k", "v", "pos", "lengths"],
                                 meta_fields=["mesh", "ring"])


# ----------------------------------------------------------------------------------------------
# Rolling caches: one RollingKV per device, each with its own pinned-host tail
# ----------------------------------------------------------------------------------------------
def _merge_program(mesh):
  spec_o, spec_lse = P(SEQ, None, None, HEADS, None), P(SEQ, None, None, HEADS)

  def body(o, lse):
    o, lse = _merge_over_seq(o[0], lse[0])
    return o, lse

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec_o, spec_lse),
                               out_specs=(HEADS_BTHD, _LSE_BTH), check_vma=False))


_merge_seq = functools.lru_cache(maxsize=16)(_merge_program)


def _shards(x) -> dict:
  """``{device: that device's piece}`` of a global array."""
  return {s.device: s.data for s in x.addressable_shards}


def _global(mesh, spec, shape, pieces: dict):
  sh = mesh_lib.sharding(mesh, spec)
  return jax.make_array_from_single_device_arrays(
      shape, sh, [pieces[d] for d in sh.addressable_devices_indices_map(shape)])


@dataclasses.dataclass(frozen=True)
class ShardedRollingKV:
  """One ``RollingKV`` per mesh device: ``parts[s][h]`` holds seq slice ``s`` of KV heads
  ``h * K/n_heads ..`` on ``mesh.devices[s, h]`` (module docstring)."""

  parts: tuple
  mesh: object

  jittable: ClassVar[bool] = False
  cpu_fraction: ClassVar[None] = None  # per device: parts[s][h].cpu_fraction

  @classmethod
  def empty(cls, mesh, batch: int, capacity: int, num_kv_heads: int, head_dim: int, *,
            window_cells, tile_cells=None, dtype=jnp.bfloat16, tactic="stream",
            cpu_fraction=None) -> "ShardedRollingKV":
    """``capacity`` cells in all, ``ceil(capacity / n_seq)`` a seq slice; each device keeps
    ``window_cells`` of its slice on the device and the rest in its pinned-host tail.
    ``window_cells`` / ``tile_cells`` / ``tactic`` / ``cpu_fraction``: one for every device, or
    a ``[seq][heads]`` nesting (each device's, as ``rkv.planner.plan_sharded`` plans them)."""
    where = "ShardedRollingKV.empty"
    mesh_lib.check_mesh(mesh, where)
    kl = mesh_lib.check_divisible(where, "num_kv_heads", num_kv_heads, mesh)
    n_seq, n_heads = mesh.devices.shape
    cap = math.ceil(capacity / n_seq)

    def grid(x, name):
      if not isinstance(x, (tuple, list)):
        return [[x] * n_heads] * n_seq
      if len(x) != n_seq or any(len(row) != n_heads for row in x):
        raise ValueError(f"{where}: {name} must be one value or a [seq][heads] = "
                         f"[{n_seq}][{n_heads}] nesting, got {x!r}")
      return x

    tac, frac = grid(tactic, "tactic"), grid(cpu_fraction, "cpu_fraction")
    win, tile = grid(window_cells, "window_cells"), grid(tile_cells, "tile_cells")
    parts = []
    for s in range(n_seq):
      row = []
      for h in range(n_heads):
        dev = mesh.devices[s, h]
        if mesh_lib.tail_memory_kind(dev) != memory.PINNED_HOST:
          raise ValueError(f"{where}: device {dev} has no {memory.PINNED_HOST!r} memory for its "
                           f"tail (it offers {[m.kind for m in dev.addressable_memories()]})")
        kw = {} if tile[s][h] is None else dict(tile_cells=tile[s][h])
        with jax.default_device(dev):
          kv = RollingKV.empty(batch, cap, kl, head_dim, window_cells=win[s][h], dtype=dtype,
                               **kw)
          row.append(kv.with_tactic(tac[s][h], frac[s][h]))
      parts.append(tuple(row))
    return cls(tuple(parts), mesh)

  @property
  def tactic(self) -> str:
    names = {p.tactic for row in self.parts for p in row}
    return names.pop() if len(names) == 1 else "mixed"

  @property
  def room(self) -> int:
    return sum(row[0].room for row in self.parts)

  def next_position(self) -> jax.Array:
    return jnp.int32(sum(row[0].fill for row in self.parts))

  def streamed_tiles(self) -> tuple:
    return ()  # each device streams its own tiles; the cross-layer prefetcher is one-device

  def tactics(self) -> tuple:
    """``[seq][heads]`` tactic of each device's part."""
    return tuple(tuple(p.tactic for p in row) for row in self.parts)

  def attend(self, q, k, v, positions, **kw):
    """Appends the chunk to the first seq slice with room (each device its own heads), attends
    on every device with its part's tactic, and merges over ``seq`` (one jitted shard_map)."""
    from rkv import rolling
    where = "ShardedRollingKV.attend"
    t = k.shape[1]
    owner = next((s for s, row in enumerate(self.parts) if row[0].room >= t), None)
    if owner is None:
      raise ValueError(f"{where}: a chunk of {t} cells fits no seq slice (room "
                       f"{[row[0].room for row in self.parts]})")
    mesh = self.mesh
    qs, ks, vs, ps = (_shards(x) for x in (q, k, v, positions))
    grid = [(s, h) for s in range(len(self.parts)) for h in range(len(self.parts[0]))]
    host = [(s, h) for s, h in grid if self.parts[s][h].tactic in tactics_lib.HOST_KERNEL
            and t <= MAX_DECODE_QUERIES]
    # Each device with a host-kernel share runs it on its own thread, at once, with its share of
    # the cores (the kernel blocks its calling thread: in turn, device 1 would wait for device
    # 0's tail). Streaming devices dispatch asynchronously and need no thread.
    threads = None
    if len(host) > 1:
      from rkv.offload import cpu_attention
      threads = max(1, cpu_attention.tail_threads() // len(host))

    def one(s, h):
      part, dev = self.parts[s][h], mesh.devices[s, h]
      with jax.default_device(dev):
        if s == owner:
          part = part.append(ks[dev], vs[dev], ps[dev])
        tactic, share = part.tactic, part.cpu_fraction
        if tactic in tactics_lib.HOST_KERNEL and t > MAX_DECODE_QUERIES:
          tactic, share = "stream", None  # a prefill chunk streams (RollingKV.attend's rule)
        extra = dict(cpu_threads=threads) if threads and tactic in tactics_lib.HOST_KERNEL else {}
        o, lse = rolling.rolling_attention(qs[dev], part, q_pos=ps[dev], causal=True,
                                           tactic=tactic, cpu_fraction=share, **extra, **kw)
        # An empty part answers with fresh (uncommitted) zeros: commit them to this device (a
        # no-op for the others), or the assembly below would find them on device 0.
        o, lse = jax.device_put((o, lse), dev)
      return part, o, lse

    if threads:
      import concurrent.futures
      with concurrent.futures.ThreadPoolExecutor(len(grid)) as pool:
        done = dict(zip(grid, pool.map(lambda sh: one(*sh), grid)))
    else:
      done = {sh: one(*sh) for sh in grid}
    os_ = {mesh.devices[sh]: done[sh][1] for sh in grid}
    lses = {mesh.devices[sh]: done[sh][2] for sh in grid}
    parts = [tuple(done[(s, h)][0] for h in range(len(self.parts[0])))
             for s in range(len(self.parts))]
    new = ShardedRollingKV(tuple(parts), mesh)
    n_seq = mesh.devices.shape[0]
    if n_seq == 1:
      return _global(mesh, HEADS_BTHD, q.shape, os_), new
    b, tq, h, d = q.shape
    o_all = _global(mesh, P(SEQ, None, None, HEADS, None), (n_seq, b, tq, h, d),
                    {dev: o.astype(jnp.float32)[None] for dev, o in os_.items()})
    lse_all = _global(mesh, P(SEQ, None, None, HEADS), (n_seq, b, tq, h),
                      {dev: x[None] for dev, x in lses.items()})
    o, _ = _merge_seq(mesh)(o_all, lse_all)
    return o.astype(q.dtype), new


def init_caches(config, mesh, batch: int, max_len: int, *, dtype=None, ring: bool = True):
  """``rkv.models.init_caches`` on a mesh: a :class:`ShardedKV` per layer (a head-sharded ring
  for a sliding-window layer with W < max_len)."""
  dtype = config.dtype if dtype is None else dtype
  out = []
  for w in config.layer_windows:
    is_ring = ring and w is not None and w < max_len
    out.append(ShardedKV.empty(mesh, batch, w if is_ring else max_len, config.num_kv_heads,
                               config.head_dim, dtype, ring=is_ring))
  return tuple(out)


def rolling_caches(config, mesh, batch: int, capacity: int, *, window_cells: int,
                   tile_cells: int | None = None, tactic="stream", cpu_fraction=None,
                   dtype=None):
  """One cache per layer for a context of ``capacity`` cells: a :class:`ShardedRollingKV` for
  each global layer, a head-sharded ring for a sliding-window layer shorter than the context."""
  dtype = config.dtype if dtype is None else dtype
  out = []
  for w in config.layer_windows:
    if w is not None and w < capacity:
      out.append(ShardedKV.empty(mesh, batch, w, config.num_kv_heads, config.head_dim, dtype,
                                 ring=True))
    else:
      out.append(ShardedRollingKV.empty(mesh, batch, capacity, config.num_kv_heads,
                                        config.head_dim, window_cells=window_cells,
                                        tile_cells=tile_cells, dtype=dtype, tactic=tactic,
                                        cpu_fraction=cpu_fraction))
  return tuple(out)


def caches_from_plan(config, mesh, plan, batch: int, capacity: int | None = None, dtype=None):
  """One cache per layer as a :class:`rkv.planner.ShardedPlan` places it on ``mesh`` (of the
  plan's ``seq x heads`` shape): a layer resident on every device is a :class:`ShardedKV` (a
  head-sharded ring for a short sliding window), any other a :class:`ShardedRollingKV` with each
  device's window, tile and tactic (a device where the layer fits keeps it all in its window)."""
  from rkv.planner.sharded import ShardedPlan
  where = "rkv.parallel.caches_from_plan"
  if not isinstance(plan, ShardedPlan):
    raise ValueError(f"{where}: plan must be a rkv.planner.ShardedPlan, got "
                     f"{type(plan).__name__}")
  mesh_lib.check_mesh(mesh, where)
  if tuple(mesh.devices.shape) != (plan.seq, plan.heads):
    raise ValueError(f"{where}: the plan is for a mesh of seq x heads = {plan.seq} x "
                     f"{plan.heads}, the mesh is {tuple(mesh.devices.shape)}")
  capacity = plan.context_len if capacity is None else capacity
  if not isinstance(capacity, (int, np.integer)) or capacity < 1:
    raise ValueError(f"{where}: capacity must be a positive int, got {capacity!r}")
  dtype = config.dtype if dtype is None else dtype
  cap = math.ceil(capacity / plan.seq)
  out = []
  for i, w in enumerate(config.layer_windows):
    grid = plan.layer_grid(i)
    cells = [lp for row in grid for lp in row]
    if all(lp.tactic == "resident" for lp in cells):
      ring = w is not None and w < capacity
      out.append(ShardedKV.empty(mesh, batch, w if ring else capacity, config.num_kv_heads,
                                 config.head_dim, dtype, ring=ring))
      continue
    bad = sorted({lp.tactic for lp in cells} - set(tactics_lib.ROLLING) - {"resident"})
    if bad:
      raise ValueError(f"{where}: layer {i}'s plan has tactic(s) {bad} on some device; a "
                       f"sharded rolling cache serves {tactics_lib.ROLLING} (plan with "
                       f"ResidencyConfig(mode=...) one of those)")
    resident = lambda lp: lp.tactic == "resident"
    out.append(ShardedRollingKV.empty(
        mesh, batch, capacity, config.num_kv_heads, config.head_dim, dtype=dtype,
        window_cells=[[cap if resident(lp) else lp.window_cells for lp in row] for row in grid],
        tile_cells=[[None if resident(lp) else lp.tile_cells for lp in row] for row in grid],
        tactic=[["stream" if resident(lp) else lp.tactic for lp in row] for row in grid],
        cpu_fraction=[[lp.cpu_fraction if lp.tactic == "hybrid" else None for lp in row]
                      for row in grid]))
  return tuple(out)
