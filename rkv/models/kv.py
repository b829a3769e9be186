"""Per-layer KV caches of the models, and the one function the attention layer calls on them.

A cache is an explicit pytree passed into the model and returned updated (docs/DESIGN.md §4). The model
never looks inside it: each attention layer calls :func:`attend` with its cache, which dispatches
on the cache's type:

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
- ``rkv.RollingKV`` (device window + pinned-host tail, :mod:`rkv.cache`) is registered too: a plan
  can give any layer one, and :func:`rkv.rolling_attention` serves it with the ``stream`` tactic.
  Its fill level is static, so run such a model with :func:`rkv.models.layered_forward` (jitted
  halves around an eager attention), not under one ``jit`` (one trace per fill level).
- :class:`TacticKV` — a ``RollingKV`` plus the tail tactic that serves it (``stream``, ``cpu`` or
  ``hybrid`` with its ``cpu_fraction``) as static pytree metadata: the cache says how it is
  attended, so the model and the decode loop stay tactic-blind. ``cpu`` / ``hybrid`` run the host
  C kernel over concrete arrays: eager only, like the rolling cache itself.
- ``rkv.HeadSplitKV`` (the ``head`` tactic: R KV heads fully resident, the other ``K - R``
  rolled) is registered as is: it already carries R, and ``rolling_attention`` splits the query
  heads between its parts.

Another cache type plugs in with ``@attend.register`` (and ``@next_position.register``); the
model runs unchanged.

Slots are shared by the batch rows, positions are per row: rows of different lengths are
left-padded with position -1 (a padded token's K/V is stored as empty and never seen).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from rkv import rolling
from rkv import tactics
from rkv.attention import MAX_DECODE_QUERIES, attention, merge
from rkv.cache import RollingKV
from rkv.head_split import HeadSplitKV
from rkv.rolling import rolling_attention


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


for _cls in (ResidentCache, RingCache):
  jax.tree_util.register_dataclass(_cls, data_fields=["k", "v", "pos", "length"], meta_fields=[])


# The tactics a TacticKV names; "head" is a HeadSplitKV of its own (its parts hold the heads).
ROLLING_TACTICS = tactics.ROLLING


@dataclasses.dataclass(frozen=True)
class TacticKV:
  """One layer's :class:`rkv.RollingKV` (``kv``, the data) and the tail tactic serving it
  (static): ``tactic`` in ``ROLLING_TACTICS``; ``cpu_fraction``: ``hybrid`` only, the share of the
  tail's full tiles attended on the CPU (``rkv.rolling_attention``'s argument; default 0.5),
  None otherwise. A plain ``RollingKV`` is served like ``TacticKV(kv, "stream")``."""

  kv: RollingKV
  tactic: str = "stream"
  cpu_fraction: float | None = None

  def __post_init__(self):
    # Only the static fields are checked: unflattening may rebuild the node around non-arrays.
    where = "TacticKV"
    if self.tactic not in ROLLING_TACTICS:
      raise ValueError(f"{where}: tactic must be one of {ROLLING_TACTICS} (a 'head' layer is a "
                       f"rkv.HeadSplitKV), got {self.tactic!r}")
    object.__setattr__(self, "cpu_fraction",
                       rolling._check_fraction(self.cpu_fraction, self.tactic, where))

  def __repr__(self):
    share = "" if self.cpu_fraction is None else f", cpu_fraction={self.cpu_fraction:g}"
    return f"TacticKV({self.tactic}{share}, {self.kv!r})"

  @property
  def fill(self) -> int:
    return self.kv.fill

  @property
  def capacity(self) -> int:
    return self.kv.capacity

  def append(self, k, v, pos=None, *, k_scale=None, v_scale=None) -> "TacticKV":
    """:meth:`rkv.RollingKV.append` on ``kv``, the tactic kept (``kv``'s buffers are donated)."""
    return dataclasses.replace(self, kv=self.kv.append(k, v, pos, k_scale=k_scale,
                                                       v_scale=v_scale))


jax.tree_util.register_dataclass(TacticKV, data_fields=["kv"],
                                 meta_fields=["tactic", "cpu_fraction"])


# ----------------------------------------------------------------------------------------------
# The attention layer's entry point
# ----------------------------------------------------------------------------------------------
@functools.singledispatch
def attend(cache, q, k, v, positions, *, window, softcap, scale, impl):
  """Writes the chunk's ``k, v [B,T,K,D]`` at ``positions [B,T]`` into ``cache`` and returns
  ``(o [B,T,H,D], new_cache)``: causal attention of ``q [B,T,H,D]`` (at the same positions) over
  every cell the cache holds, this chunk included."""
  raise TypeError(f"rkv.models.kv.attend: no attention registered for cache type "
                  f"{type(cache).__name__}; register one with @rkv.models.kv.attend.register")


@attend.register
def _(cache: ResidentCache, q, k, v, positions, *, window, softcap, scale, impl):
  new = cache.write(k, v, positions)
  o, _ = attention(q, new.k, new.v, q_pos=positions, k_pos=new.pos, causal=True, window=window,
                   softcap=softcap, scale=scale, impl=impl)
  return o, new


@attend.register
def _(cache: RingCache, q, k, v, positions, *, window, softcap, scale, impl):
  if window is None or cache.capacity < window - 1:
    raise ValueError(f"RingCache: a ring of R={cache.capacity} slots serves a sliding-window layer "
                     f"with W <= R + 1, got window={window}")
  kw = dict(causal=True, window=window, softcap=softcap, scale=scale, impl=impl)
  o_ring, lse_ring = attention(q, cache.k, cache.v, q_pos=positions, k_pos=cache.pos, **kw)
  o_new, lse_new = attention(q, k.astype(cache.k.dtype), v.astype(cache.v.dtype), q_pos=positions,
                             k_pos=positions, **kw)
  o, _ = merge(o_ring, lse_ring, o_new, lse_new)
  return o, cache.write(k, v, positions)


def _append_then_attend(cache, data, q, k, v, positions, *, tactic, cpu_fraction=None, **kw):
  """The rolling caches' one step: append this chunk's cells, then ``rolling_attention`` over
  ``data(new cache)`` (the cache itself, or a TacticKV's RollingKV) with ``tactic``."""
  with jax.profiler.TraceAnnotation("rkv.append"):
    new = cache.append(k, v, positions)
  o, _ = rolling_attention(q, data(new), q_pos=positions, causal=True, tactic=tactic,
                           cpu_fraction=cpu_fraction, **kw)
  return o, new


@attend.register
def _(cache: RollingKV, q, k, v, positions, **kw):
  return _append_then_attend(cache, lambda c: c, q, k, v, positions, tactic="stream", **kw)


@attend.register
def _(cache: TacticKV, q, k, v, positions, **kw):
  tactic, share = cache.tactic, cache.cpu_fraction
  if q.shape[1] > MAX_DECODE_QUERIES:
    # A prefill chunk's tail attention is compute-bound (T queries per key read), where the CPU
    # cores are ~100x slower than the GPU; the plan's cpu/hybrid split is for the memory-bound
    # decode step. The chunk streams its tail instead (the same cells, merged the same way).
    tactic, share = "stream", None
  return _append_then_attend(cache, lambda c: c.kv, q, k, v, positions, tactic=tactic,
                             cpu_fraction=share, **kw)


@attend.register
def _(cache: HeadSplitKV, q, k, v, positions, **kw):
  # HeadSplitKV.append splits k/v by KV head; rolling_attention splits q's heads the same way.
  return _append_then_attend(cache, lambda c: c, q, k, v, positions, tactic="head", **kw)


@functools.singledispatch
def streamed_tiles(cache) -> tuple:
  """The host tiles a step's attention over ``cache`` streams to the device, in order (``stream``
  tiles of a :class:`rkv.offload.stream.Tile`), for a prefetcher to request ahead of the layer;
  ``()`` for caches that stream nothing ahead of time (resident, ring, a ``cpu`` tactic; a
  ``HeadSplitKV``'s rolled heads stream inside their own call)."""
  return ()


def _streamed(kv: RollingKV, tactic: str, cpu_fraction) -> tuple:
  n = rolling.streamed_count(kv.n_full_tiles, tactic, cpu_fraction)
  return rolling._tiles(kv, n) if n else ()


@streamed_tiles.register
def _(cache: RollingKV):
  return _streamed(cache, "stream", None)


@streamed_tiles.register
def _(cache: TacticKV):
  return _streamed(cache.kv, cache.tactic, cache.cpu_fraction)


@functools.singledispatch
def next_position(cache) -> jax.Array:
  """The position after the last cell written (int32 scalar): the default start of the next
  chunk when the caller passes no positions (rows without padding)."""
  raise TypeError(f"rkv.models.kv.next_position: unsupported cache type {type(cache).__name__}")


@next_position.register
def _(cache: ResidentCache):
  return cache.length


@next_position.register(RollingKV)
@next_position.register(TacticKV)
@next_position.register(HeadSplitKV)
def _(cache):
  return jnp.int32(cache.fill)


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
