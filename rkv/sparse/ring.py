"""A drafter's window: a small device ring over a host copy of recent cells, or a resident KV
when the host copy cannot be had (issue 15, deliverable 4).

A draft model (or any second reader of a layer's recent cells: an MTP head, a verifier) needs the
last ``R`` cells, not the whole context. :class:`DraftRing` keeps them in a device ring (slot =
cell index mod R) and writes every cell through to a host copy as well, so the ring can be
rebuilt from the host at any length: after a rejected draft (:meth:`DraftRing.truncate`) or a
resume, nothing on the device has to be trusted or invalidated. The host copy costs host RAM for
every cell; :func:`draft_kv` checks that RAM (``/proc/meminfo``'s MemAvailable, and XLA's
pinned-host pool) before enabling the ring, and otherwise falls back to :class:`ResidentDraftKV`,
all cells on the device, with the reason as a message (a warning), not an error.

Both read the same way: :meth:`attend` gives ``(o, lse)`` of queries over the cells within a
window of ``window`` positions (``window <= R``: the reader's queries sit at written positions).
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from rkv import cache as _cache
from rkv.attention import attention
from rkv.offload import memory as _memory


class DraftFallbackWarning(UserWarning):
  """The drafter's host copy could not be had: it reads a resident KV instead."""


def _check_new(where, batch, kh, d, k, v, pos):
  b, t, kh_, d_ = np.shape(k)
  if (b, kh_, d_) != (batch, kh, d) or np.shape(v) != np.shape(k):
    raise ValueError(f"{where}: k, v must be [B,T,K,D] with B={batch}, K={kh}, D={d}; got "
                     f"{np.shape(k)}, {np.shape(v)}")
  if tuple(np.shape(pos)) != (b, t):
    raise ValueError(f"{where}: pos must be [B,T]=[{b},{t}], got {tuple(np.shape(pos))}")


@dataclasses.dataclass(frozen=True)
class DraftRing:
  """``k, v [B,R,K,D]``, ``pos [B,R]`` on the device (the last R cells, slot = index mod R);
  ``host_k, host_v [B,C,K,D]``, ``host_pos [B,C]`` numpy: every cell (the authoritative copy,
  shared by versions, like the block cache's store); ``length``: cells written."""

  k: jax.Array
  v: jax.Array
  pos: jax.Array
  host_k: np.ndarray
  host_v: np.ndarray
  host_pos: np.ndarray
  length: int

  backing = "host"

  @classmethod
  def empty(cls, batch, capacity, num_kv_heads, head_dim, *, ring_cells, dtype=jnp.bfloat16):
    dt = _cache.check_kv_dtype(dtype, "DraftRing.empty", "dtype")
    if dt == np.dtype(np.int8):
      raise ValueError("DraftRing.empty: dtype int8 is not supported (a drafter's window is small)")
    if not 1 <= ring_cells <= capacity:
      raise ValueError(f"DraftRing.empty: ring_cells must be in [1, capacity={capacity}], got "
                       f"{ring_cells}")
    shape = (batch, ring_cells, num_kv_heads, head_dim)
    return cls(k=jnp.zeros(shape, dt), v=jnp.zeros(shape, dt),
               pos=jnp.full((batch, ring_cells), -1, jnp.int32),
               host_k=np.zeros((batch, capacity, num_kv_heads, head_dim), dt),
               host_v=np.zeros((batch, capacity, num_kv_heads, head_dim), dt),
               host_pos=np.full((batch, capacity), -1, np.int32), length=0)

  @property
  def ring_cells(self) -> int:
    return self.k.shape[1]

  @property
  def capacity(self) -> int:
    return self.host_k.shape[1]

  def append(self, k, v, pos) -> "DraftRing":
    """Writes ``k, v [B,T,K,D]`` at positions ``pos [B,T]``: to the host copy always, and the
    last ``min(T, R)`` of them to the ring."""
    b, r, kh, d = self.k.shape
    _check_new("DraftRing.append", b, kh, d, k, v, pos)
    t = np.shape(k)[1]
    if self.length + t > self.capacity:
      raise ValueError(f"DraftRing.append: {t} cells at length {self.length} exceed capacity "
                       f"{self.capacity}")
    kn, vn = np.asarray(k).astype(self.host_k.dtype), np.asarray(v).astype(self.host_v.dtype)
    pn = np.asarray(pos, np.int32)
    sl = slice(self.length, self.length + t)
    self.host_k[:, sl], self.host_v[:, sl], self.host_pos[:, sl] = kn, vn, pn
    keep = min(t, r)
    slots = jnp.asarray((self.length + t - keep + np.arange(keep)) % r, jnp.int32)
    ring = _put(self.k, self.v, self.pos, slots, jnp.asarray(kn[:, t - keep:]),
                jnp.asarray(vn[:, t - keep:]), jnp.asarray(pn[:, t - keep:]))
    return dataclasses.replace(self, k=ring[0], v=ring[1], pos=ring[2], length=self.length + t)

  def truncate(self, length: int) -> "DraftRing":
    """The ring as it was at ``length`` cells (a rejected draft rolled back, a resume): its R
    slots rebuilt from the host copy in one transfer."""
    if not 0 <= length <= self.length:
      raise ValueError(f"DraftRing.truncate: length must be in [0, {self.length}], got {length}")
    b, r, kh, d = self.k.shape
    lo = max(length - r, 0)
    idx = np.arange(lo, length)
    slots = idx % r
    k = np.zeros((b, r, kh, d), self.host_k.dtype)
    v = np.zeros_like(k)
    pos = np.full((b, r), -1, np.int32)
    k[:, slots], v[:, slots], pos[:, slots] = (self.host_k[:, idx], self.host_v[:, idx],
                                               self.host_pos[:, idx])
    self.host_pos[:, length:self.length] = -1
    k, v, pos = jax.device_put((k, v, pos))
    return dataclasses.replace(self, k=k, v=v, pos=pos, length=length)

  def attend(self, q, positions, *, window, softcap=None, scale=None, impl="auto"):
    """``(o, lse)`` of ``q [B,T,H,D]`` at ``positions [B,T]`` over the ring's cells within
    ``window`` positions (causal)."""
    # The reader's queries sit at written positions (the newest cell included), so a window of
    # W positions needs the last W cells: R >= W.
    if window is None or window > self.ring_cells:
      raise ValueError(f"DraftRing.attend: a ring of R={self.ring_cells} serves window <= R, "
                       f"got window={window}")
    return attention(q, self.k, self.v, q_pos=positions, k_pos=self.pos, causal=True,
                     window=window, softcap=softcap, scale=scale, impl=impl)


@jax.jit
def _put(k, v, pos, slots, kn, vn, pn):
  return (k.at[:, slots].set(kn, unique_indices=True), v.at[:, slots].set(vn, unique_indices=True),
          pos.at[:, slots].set(pn, unique_indices=True))


@dataclasses.dataclass(frozen=True)
class ResidentDraftKV:
  """The fallback: every cell on the device (``k, v [B,C,K,D]``, ``pos [B,C]``), read through
  the same window; ``reason``: why the ring was not used."""

  k: jax.Array
  v: jax.Array
  pos: jax.Array
  length: int
  reason: str = ""

  backing = "resident"

  @classmethod
  def empty(cls, batch, capacity, num_kv_heads, head_dim, *, dtype=jnp.bfloat16, reason=""):
    shape = (batch, capacity, num_kv_heads, head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
               jnp.full((batch, capacity), -1, jnp.int32), 0, reason)

  @property
  def capacity(self) -> int:
    return self.k.shape[1]

  def append(self, k, v, pos) -> "ResidentDraftKV":
    b, c, kh, d = self.k.shape
    _check_new("ResidentDraftKV.append", b, kh, d, k, v, pos)
    t = np.shape(k)[1]
    if self.length + t > c:
      raise ValueError(f"ResidentDraftKV.append: {t} cells at length {self.length} exceed "
                       f"capacity {c}")
    up = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, jnp.asarray(x).astype(buf.dtype),
                                                            self.length, axis=1)
    return dataclasses.replace(self, k=up(self.k, k), v=up(self.v, v),
                               pos=up(self.pos, jnp.asarray(pos, jnp.int32)),
                               length=self.length + t)

  def truncate(self, length: int) -> "ResidentDraftKV":
    if not 0 <= length <= self.length:
      raise ValueError(f"ResidentDraftKV.truncate: length must be in [0, {self.length}], got "
                       f"{length}")
    pos = jnp.where(jnp.arange(self.capacity)[None] < length, self.pos, -1)
    return dataclasses.replace(self, pos=pos, length=length)

  def attend(self, q, positions, *, window, softcap=None, scale=None, impl="auto"):
    return attention(q, self.k, self.v, q_pos=positions, k_pos=self.pos, causal=True,
                     window=window, softcap=softcap, scale=scale, impl=impl)


def host_copy_bytes(batch, capacity, num_kv_heads, head_dim, dtype) -> int:
  return 2 * batch * capacity * num_kv_heads * head_dim * np.dtype(dtype).itemsize + batch * capacity * 4


def draft_kv(batch, capacity, num_kv_heads, head_dim, *, ring_cells, dtype=jnp.bfloat16,
             memory: tuple[int | None, int | None] | None = None, headroom: float = 0.9):
  """A :class:`DraftRing` when its host copy fits ``headroom`` of the host's available RAM and
  XLA's pinned-host pool (``memory``: ``(physical, available)`` bytes, default
  :func:`rkv.offload.memory.host_memory`); else a :class:`ResidentDraftKV` with the reason, which
  is also warned (:class:`DraftFallbackWarning`)."""
  dt = _cache.check_kv_dtype(dtype, "draft_kv", "dtype")
  need = host_copy_bytes(batch, capacity, num_kv_heads, head_dim, dt)
  _, avail = _memory.host_memory() if memory is None else memory
  reason = ""
  if avail is not None and need > headroom * avail:
    reason = (f"the drafter's host copy needs {need / 2**30:.2f} GiB, above {headroom:.0%} of the "
              f"host's available {avail / 2**30:.2f} GiB")
  elif need > _memory.host_pool_bytes():
    reason = (f"the drafter's host copy needs {need / 2**30:.2f} GiB, above XLA's pinned-host "
              f"pool of {_memory.host_pool_bytes() / 2**30:.0f} GiB "
              f"({_memory.HOST_POOL_ENV} raises it)")
  if reason:
    warnings.warn(f"draft_kv: {reason}: using a resident KV of {capacity} cells on the device "
                  f"instead of a {ring_cells}-cell ring", DraftFallbackWarning, stacklevel=2)
    return ResidentDraftKV.empty(batch, capacity, num_kv_heads, head_dim, dtype=dt,
                                 reason=reason)
  return DraftRing.empty(batch, capacity, num_kv_heads, head_dim, ring_cells=ring_cells,
                         dtype=dt)
