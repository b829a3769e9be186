"""``HeadSplitKV``: the ``head`` tail tactic's cache (docs/DESIGN.md §4).

The first R KV heads are fully resident on the device (a :class:`rkv.RollingKV` whose window is
its whole capacity: no tail, no staging); the other ``K - R`` KV heads roll (window W, staging,
pinned_host tail). ``rkv.rolling_attention(q, kv, tactic="head")`` (or ``"auto"``) attends to
each part with its own heads of ``q`` (query head h uses KV head ``h // G``: the first ``R * G``
query heads go with the resident part) and concatenates ``o`` and ``lse`` along the head axis:
attention is independent per head, so the result equals attention over the whole cache.

``R == 0`` or ``R == K`` leaves one part empty: it is stored as ``None``. A layer cache
(``rkv.models.kv.LayerCache``) whose tactic is ``head``; eager like the RollingKVs it holds.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from rkv import cache as cache_lib


@dataclasses.dataclass(frozen=True)
class HeadSplitKV:
  """``resident``: the first ``resident_heads`` KV heads (window = capacity) or None (R = 0);
  ``rolled``: the remaining KV heads (window W + tail) or None (R = K). Static:
  ``resident_heads`` R and ``num_kv_heads`` K."""

  resident: cache_lib.RollingKV | None
  rolled: cache_lib.RollingKV | None
  resident_heads: int
  num_kv_heads: int

  tactic: ClassVar[str] = "head"
  cpu_fraction: ClassVar[None] = None
  jittable: ClassVar[bool] = False

  def __repr__(self):
    return (f"HeadSplitKV(R={self.resident_heads}/{self.num_kv_heads}, resident={self.resident!r}, "
            f"rolled={self.rolled!r})")

  @property
  def parts(self) -> tuple[cache_lib.RollingKV, ...]:
    return tuple(p for p in (self.resident, self.rolled) if p is not None)

  @property
  def fill(self) -> int:
    return self.parts[0].fill

  @property
  def capacity(self) -> int:
    return self.parts[0].capacity

  @property
  def batch(self) -> int:
    return self.parts[0].batch

  @property
  def head_dim(self) -> int:
    return self.parts[0].head_dim

  @property
  def dtype(self):
    return self.parts[0].dtype

  @classmethod
  def from_arrays(cls, k, v, *, resident_heads: int, window_cells: int, k_pos=None,
                  k_scale=None, v_scale=None, capacity: int | None = None,
                  tile_cells: int = cache_lib.DEFAULT_TILE_CELLS, dtype=None) -> "HeadSplitKV":
    """A head-split cache of ``k, v [B,S,K,D]``: KV heads ``[0, R)`` resident (window =
    ``capacity``, default S), heads ``[R, K)`` rolled with ``window_cells`` W on the device and
    the rest in the host tail (``tile_cells`` per tile). Other arguments: as
    :meth:`rkv.RollingKV.from_arrays` (scales ``[B,S,K]`` are split by head too)."""
    where = "HeadSplitKV.from_arrays"
    shape = np.shape(k)
    if len(shape) != 4:
      raise ValueError(f"{where}: k must be rank 4 ([B,S,K,D]), got shape {shape}")
    kh = shape[2]
    r = check_heads(resident_heads, kh, where)
    cap = shape[1] if capacity is None else capacity
    take = take_heads
    kw = dict(k_pos=k_pos, capacity=capacity, tile_cells=tile_cells, dtype=dtype)
    resident = rolled = None
    if r:
      resident = cache_lib.RollingKV.from_arrays(
          take(k, 0, r), take(v, 0, r), window_cells=cap, k_scale=take(k_scale, 0, r),
          v_scale=take(v_scale, 0, r), **kw)
    if r < kh:
      rolled = cache_lib.RollingKV.from_arrays(
          take(k, r, kh), take(v, r, kh), window_cells=window_cells,
          k_scale=take(k_scale, r, kh), v_scale=take(v_scale, r, kh), **kw)
    return cls(resident=resident, rolled=rolled, resident_heads=r, num_kv_heads=kh)

  @classmethod
  def empty(cls, batch: int, capacity: int, num_kv_heads: int, head_dim: int, *,
            resident_heads: int, window_cells: int, dtype=None,
            tile_cells: int = cache_lib.DEFAULT_TILE_CELLS) -> "HeadSplitKV":
    """An empty head-split cache for decoding: KV heads ``[0, R)`` hold all ``capacity`` cells on
    the device, heads ``[R, K)`` roll with ``window_cells`` W on the device (see
    :meth:`rkv.RollingKV.empty`; ``dtype`` default bfloat16)."""
    where = "HeadSplitKV.empty"
    if not cache_lib._is_int(num_kv_heads) or num_kv_heads < 1:
      raise ValueError(f"{where}: num_kv_heads must be a positive int, got {num_kv_heads!r}")
    r = check_heads(resident_heads, num_kv_heads, where)
    kw = dict(dtype=jnp.bfloat16 if dtype is None else dtype, tile_cells=tile_cells)
    resident = rolled = None
    if r:
      resident = cache_lib.RollingKV.empty(batch, capacity, r, head_dim, window_cells=capacity,
                                           **kw)
    if r < num_kv_heads:
      rolled = cache_lib.RollingKV.empty(batch, capacity, num_kv_heads - r, head_dim,
                                         window_cells=window_cells, **kw)
    return cls(resident=resident, rolled=rolled, resident_heads=r, num_kv_heads=num_kv_heads)

  def append(self, k, v, pos=None, *, k_scale=None, v_scale=None) -> "HeadSplitKV":
    """Appends ``k, v [B,T,K,D]`` (split by KV head between the parts); returns the new cache.
    Donation as :func:`rkv.cache.append`: use the returned cache."""
    shape = np.shape(k)
    if len(shape) != 4 or shape[2] != self.num_kv_heads:
      raise ValueError(f"HeadSplitKV.append: k must be [B,T,K={self.num_kv_heads},D], got shape "
                       f"{shape}")
    r, kh = self.resident_heads, self.num_kv_heads
    take = take_heads
    resident, rolled = self.resident, self.rolled
    if resident is not None:
      resident = resident.append(take(k, 0, r), take(v, 0, r), pos,
                                 k_scale=take(k_scale, 0, r), v_scale=take(v_scale, 0, r))
    if rolled is not None:
      rolled = rolled.append(take(k, r, kh), take(v, r, kh), pos,
                             k_scale=take(k_scale, r, kh), v_scale=take(v_scale, r, kh))
    return dataclasses.replace(self, resident=resident, rolled=rolled)

  # --- the layer-cache protocol (rkv.models.kv.LayerCache) ---
  @property
  def room(self) -> int:
    return self.capacity - self.fill

  def next_position(self) -> jax.Array:
    return jnp.int32(self.fill)

  def attend(self, q, k, v, positions, **kw) -> tuple[jax.Array, "HeadSplitKV"]:
    """Appends the chunk (split by KV head) and attends with the ``head`` tactic: each part with
    its query heads (:func:`rkv.rolling_attention`)."""
    from rkv import rolling  # rolling builds on this module
    with jax.profiler.TraceAnnotation("rkv.append"):
      new = self.append(k, v, positions)
    o, _ = rolling.rolling_attention(q, new, q_pos=positions, causal=True, tactic="head", **kw)
    return o, new

  def streamed_tiles(self) -> tuple:
    return ()  # the rolled heads stream inside their own call


jax.tree_util.register_dataclass(HeadSplitKV, data_fields=["resident", "rolled"],
                                 meta_fields=["resident_heads", "num_kv_heads"])


@functools.partial(jax.jit, static_argnames=("lo", "hi"))
def _heads_jit(x, *, lo: int, hi: int):
  return x[:, :, lo:hi]


def take_heads(x, lo: int, hi: int):
  """Heads ``[lo, hi)`` of ``x [B,T,K,...]`` (KV heads, or a query's ``[B,T,H,D]``; None passes
  through). A device array is sliced by one program with the bounds static: sliced eagerly, its
  start indices were host scalars sent to the device at every decode step
  (tests/transfer_guard_test.py). Host arrays are sliced in place (NumPy: no copy)."""
  if x is None:
    return None
  if isinstance(x, jax.Array):
    return _heads_jit(x, lo=lo, hi=hi)
  return x[:, :, lo:hi]


def check_heads(resident_heads, num_kv_heads: int, where: str) -> int:
  """``resident_heads`` as an int in ``[0, K]``, else ``ValueError`` naming ``where``."""
  if (not isinstance(resident_heads, (int, np.integer)) or isinstance(resident_heads, bool)
      or not 0 <= resident_heads <= num_kv_heads):
    raise ValueError(f"{where}: resident_heads must be an int in [0, K={num_kv_heads}], got "
                     f"{resident_heads!r}")
  return int(resident_heads)
