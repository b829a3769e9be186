"""Per-layer KV caches of the models: one small protocol every cache implements.

A cache is an explicit pytree passed into the model and returned updated (docs/DESIGN.md §4). The
model and the generation loop never look inside it, nor ask which type it is: every cache is a
:class:`LayerCache` —

- ``attend(q, k, v, positions, *, window, softcap, scale, impl, ...) -> (o, new_cache)``: writes
  the chunk's cells and returns causal attention of ``q`` over every cell held, the chunk's too;
- ``next_position()``: the position after the last cell (the default start of the next chunk);
- ``room``: cells it can still take (None: a ring, which never fills);
- ``jittable``: whether ``attend`` can run inside ``jax.jit`` (the fill level is data) or must run
  eagerly between jitted halves (``rkv.models.layered_forward``: the fill is static structure);
- ``tactic`` (and ``cpu_fraction``): how it is attended, static data on the cache
  (``rkv.tactics``); ``streamed_tiles()``: the host tiles a step streams, for a prefetcher.

The caches:

- :class:`ResidentCache` — ``k, v [B,S_max,K,D]``, ``pos [B,S_max]`` (-1 = empty), ``length`` (a
  traced int32 scalar: slots written). New cells go to slots ``length .. length+T-1`` with
  ``lax.dynamic_update_slice``; attention is one :func:`rkv.attention` over the whole buffer with
  masks from positions. The fill level is data, not structure, so a jitted decode step compiles
  once for every step.
- :class:`RingCache` — the same arrays with ``S_max = R`` slots used as a ring, for a sliding-window
  layer of window W (``R >= W - 1``). Attention is the exact LSE merge (:func:`rkv.merge`) of the
  ring (the cells before this chunk) and the chunk's own keys; the chunk is written afterwards,
  modulo R. Positions make this exact whatever the slot order: a query at p needs keys in
  ``(p - W, p]``, and the ring holds the last R >= W - 1 cells before the chunk.
- ``rkv.RollingKV`` (device window + pinned-host tail, :mod:`rkv.cache`), attended with its own
  ``tactic`` (``stream``, ``cpu``, or ``hybrid`` with its ``cpu_fraction``;
  ``RollingKV.with_tactic``) by :func:`rkv.rolling_attention`. ``cpu`` / ``hybrid`` run the host C
  kernel over concrete arrays: eager only, like the rolling cache itself.
- ``rkv.HeadSplitKV`` (the ``head`` tactic: R KV heads fully resident, the other ``K - R``
  rolled): ``rolling_attention`` splits the query heads between its parts.

Another cache type plugs in by implementing the protocol; the model runs unchanged, and
``tests/cache_contract_test.py`` runs the shared contract on it with a few lines.

Slots are shared by the batch rows, positions are per row: rows of different lengths are
left-padded with position -1 (a padded token's K/V is stored as empty and never seen).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from rkv import tactics
from rkv.attention import attention, merge


@runtime_checkable
class LayerCache(Protocol):
  """What every per-layer cache implements (module docstring)."""

  tactic: str
  jittable: bool

  @property
  def room(self) -> int | None: ...

  def next_position(self) -> jax.Array: ...

  def attend(self, q, k, v, positions, **kw) -> tuple[jax.Array, "LayerCache"]: ...

  def streamed_tiles(self) -> tuple: ...


def _concrete_int(x) -> int | None:
  try:
    return int(x)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError, TypeError):
    return None


def _check_new(where, cache, k, v, positions):
  b, s, kh, d = cache.k.shape
  if k.ndim != 4 or k.shape[0] != b or k.shape[2:] != (kh, d) or v.shape != k.shape:
    raise ValueError(f"{where}: new k/v must have shape [B,T,K,D] with B={b}, K={kh}, D={d}; got "
                     f"k {tuple(k.shape)}, v {tuple(v.shape)}")
  if tuple(positions.shape) != tuple(k.shape[:2]):
    raise ValueError(f"{where}: positions must have shape [B,T]={tuple(k.shape[:2])}, got "
                     f"{tuple(positions.shape)}")


def _empty_arrays(batch, cells, num_kv_heads, head_dim, dtype):
  shape = (batch, cells, num_kv_heads, head_dim)
  return dict(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
              pos=jnp.full((batch, cells), -1, jnp.int32), length=jnp.zeros((), jnp.int32))


@dataclasses.dataclass(frozen=True)
class ResidentCache:
  """One layer's KV cache, all on the device: ``k, v [B,S_max,K,D]``, ``pos [B,S_max]`` int32
  (-1 = empty slot), ``length`` int32 scalar (slots written; the next write starts there)."""

  k: jax.Array
  v: jax.Array
  pos: jax.Array
  length: jax.Array

  tactic: ClassVar[str] = "resident"
  cpu_fraction: ClassVar[None] = None
  jittable: ClassVar[bool] = True  # the fill level is data: one trace for every step

  @classmethod
  def empty(cls, batch: int, capacity: int, num_kv_heads: int, head_dim: int, dtype=jnp.bfloat16):
    if capacity < 1:
      raise ValueError(f"{cls.__name__}.empty: capacity must be >= 1, got {capacity}")
    return cls(**_empty_arrays(batch, capacity, num_kv_heads, head_dim, dtype))

  @property
  def capacity(self) -> int:
    return self.k.shape[1]

  @property
  def nbytes(self) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in (self.k, self.v, self.pos))

  def write(self, k, v, positions) -> "ResidentCache":
    """Appends T cells at slots ``length .. length+T-1`` (positions ``[B,T]`` per row)."""
    where = "ResidentCache.write"
    _check_new(where, self, k, v, positions)
    t = k.shape[1]
    if t > self.capacity:
      raise ValueError(f"{where}: {t} new cells exceed capacity S_max={self.capacity}")
    n = _concrete_int(self.length)
    if n is not None and n + t > self.capacity:
      # Under jit the fill is traced and dynamic_update_slice would clamp the start silently:
      # size the cache for the whole context (prompt + generated tokens).
      raise ValueError(f"{where}: writing {t} cells at length {n} overflows capacity "
                       f"S_max={self.capacity}")
    start = self.length
    upd = lambda buf, new: jax.lax.dynamic_update_slice(
        buf, new.astype(buf.dtype), (0, start) + (0,) * (buf.ndim - 2))
    return dataclasses.replace(self, k=upd(self.k, k), v=upd(self.v, v),
                               pos=upd(self.pos, positions.astype(jnp.int32)),
                               length=self.length + t)

  append = write

  # --- the layer-cache protocol ---
  @property
  def room(self) -> int | None:
    """Slots left (needs a concrete ``length``: call it outside ``jit``)."""
    return self.capacity - int(self.length)

  def next_position(self) -> jax.Array:
    return self.length

  def attend(self, q, k, v, positions, *, window, softcap, scale, impl):
    new = self.write(k, v, positions)
    # kv_fill: slots from `length` on are empty, so the decode kernel bounds its keys from the
    # query positions without a reduction over `pos` (rkv/pallas/decode_attention.py).
    o, _ = attention(q, new.k, new.v, q_pos=positions, k_pos=new.pos, causal=True, window=window,
                     softcap=softcap, scale=scale, impl=impl, kv_fill=new.length)
    return o, new

  def streamed_tiles(self) -> tuple:
    return ()


@dataclasses.dataclass(frozen=True)
class RingCache(ResidentCache):
  """A sliding-window layer's cache: ``R`` slots used as a ring (slot = cell index mod R).
  Same fields as :class:`ResidentCache`; ``length`` counts every cell ever written."""

  def write(self, k, v, positions) -> "RingCache":
    """Writes T cells at slots ``(length + i) mod R``; of a chunk longer than R only the last R
    cells are kept (the earlier ones would be overwritten within the same write)."""
    _check_new("RingCache.write", self, k, v, positions)
    r, t = self.capacity, k.shape[1]
    skip = max(t - r, 0)
    k, v, positions = k[:, skip:], v[:, skip:], positions[:, skip:]
    slots = (self.length + skip + jnp.arange(t - skip, dtype=jnp.int32)) % r
    put = lambda buf, new: buf.at[:, slots].set(new.astype(buf.dtype), unique_indices=True)
    return dataclasses.replace(self, k=put(self.k, k), v=put(self.v, v),
                               pos=put(self.pos, positions.astype(jnp.int32)),
                               length=self.length + t)

  append = write

  @property
  def room(self) -> None:
    return None  # a ring never fills: it keeps the last R cells

  def attend(self, q, k, v, positions, *, window, softcap, scale, impl):
    if window is None or self.capacity < window - 1:
      raise ValueError(f"RingCache: a ring of R={self.capacity} slots serves a sliding-window "
                       f"layer with W <= R + 1, got window={window}")
    kw = dict(causal=True, window=window, softcap=softcap, scale=scale, impl=impl)
    o_ring, lse_ring = attention(q, self.k, self.v, q_pos=positions, k_pos=self.pos, **kw)
    o_new, lse_new = attention(q, k.astype(self.k.dtype), v.astype(self.v.dtype),
                               q_pos=positions, k_pos=positions, **kw)
    o, _ = merge(o_ring, lse_ring, o_new, lse_new)
    return o, self.write(k, v, positions)


for _cls in (ResidentCache, RingCache):
  jax.tree_util.register_dataclass(_cls, data_fields=["k", "v", "pos", "length"], meta_fields=[])


# The rolling tactics (served by a RollingKV with the tactic as static data).
ROLLING_TACTICS = tactics.ROLLING


# ----------------------------------------------------------------------------------------------
# The attention layer's entry points: thin calls of the protocol
# ----------------------------------------------------------------------------------------------
def attend(cache: LayerCache, q, k, v, positions, **kw):
  """``cache.attend(...)``: writes the chunk's ``k, v [B,T,K,D]`` at ``positions [B,T]`` and
  returns ``(o [B,T,H,D], new_cache)``, causal attention of ``q`` over every cell held."""
  if not isinstance(cache, LayerCache):
    raise TypeError(f"rkv.models.kv.attend: no attention registered for cache type "
                    f"{type(cache).__name__}: a cache implements rkv.models.kv.LayerCache "
                    f"(attend, next_position, room, jittable, tactic, streamed_tiles)")
  return cache.attend(q, k, v, positions, **kw)


def next_position(cache: LayerCache) -> jax.Array:
  """``cache.next_position()``: the position after the last cell written (int32 scalar)."""
  return cache.next_position()


def streamed_tiles(cache: LayerCache) -> tuple:
  """``cache.streamed_tiles()``: the host tiles a step streams, in order, for a prefetcher."""
  return cache.streamed_tiles()


def init_caches(config, batch: int, max_len: int, *, dtype=None, ring: bool = True) -> tuple:
  """One empty cache per layer for contexts up to ``max_len`` tokens: a :class:`RingCache` of W
  slots for a sliding-window layer with W < max_len (when ``ring``), else a
  :class:`ResidentCache` of ``max_len`` slots."""
  if batch < 1 or max_len < 1:
    raise ValueError(f"init_caches: batch and max_len must be >= 1, got {batch}, {max_len}")
  dtype = config.dtype if dtype is None else dtype
  out = []
  for w in config.layer_windows:
    if ring and w is not None and w < max_len:
      out.append(RingCache.empty(batch, w, config.num_kv_heads, config.head_dim, dtype))
    else:
      out.append(ResidentCache.empty(batch, max_len, config.num_kv_heads, config.head_dim, dtype))
  return tuple(out)
