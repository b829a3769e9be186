"""The block cache: a fixed number of device slots per layer over an authoritative host copy.

Strata's design (issue 15), in rkv's terms. Every cell of a sparse layer lives in the **host
store** (``[B,NB,2,bs,K,D]``: a block's K and V contiguous, so a block is one memcpy; numpy views
of ``pinned_host`` buffers where the device has them, see :func:`host_array`).
The device holds ``device_slots`` blocks (``[slots*bs,K,D]`` pools, the layout
:func:`rkv.sparse.block_attention` reads) and the blocks' key summaries (Quest's min/max, made
when cells are written). Per decode step:

1. **write-through**: the new cells go to the host store always, and to their block's slot when
   that block is resident, so a slot never holds a stale copy (nothing to invalidate after a
   rejected draft or a resume);
2. the selector scores the blocks from the summaries; :func:`rkv.sparse.select_blocks` keeps the
   recent window, the sinks and the best others, per (sequence, KV head);
3. the **residency map** (``page_table [B,NB]`` -> slot, ``slot_block [slots]`` -> block, kept
   consistent both ways) splits the needed blocks into hits and misses; misses take free slots,
   then slots freed by **CLOCK** (a reference bit per slot, set on use; the hand clears set bits
   and evicts the first clear one not needed this step);
4. the misses are gathered on the host into one contiguous (pinned staging) buffer and moved
   **in one ``device_put`` per step** (the packed K/V blocks with their positions and scales),
   then scattered into their slots by one jitted program;
5. block-selected attention over the slots.

Counters: per step (:attr:`BlockCache.last_step`) and per request (:attr:`BlockCache.totals`,
since :meth:`BlockCache.reset_counters`) count hits, misses, evictions and the bytes read from the
host. The control plane (the map, CLOCK) is host numpy: the selection is read back once per layer
and step (a sync the dense tactics do not have; docs/DESIGN.md §9).

The host store is shared by every version of a cache (the newest append is authoritative, like
a file). As ``RollingKV.append`` does, ``append`` and ``step`` donate the device buffers they
write (the slots, the summaries: written in place, not copied per step): the cache passed in must
not be used afterwards; the returned one is the live one.
Prefill chunks (T > 16 queries) are attended densely over every written cell, as Quest does:
selection is for the memory-bound decode step.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import os
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from rkv import atomic_io as _atomic_io
from rkv import cache as _cache
from rkv.attention import MAX_DECODE_QUERIES, attention
from rkv.offload import memory as _memory
from rkv.sparse import blocks as _blocks

FORMAT = "rkv.sparse.BlockCache"
# v2 records each file's size and CRC-32 (checked on load); v1 saves still load, unchecked.
FORMAT_VERSION = 2
KV_DTYPES = ("bfloat16", "float16", "float32", "int8")


# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BlockCacheConfig:
  """A sparse layer's block cache. ``block_cells``: cells per block (the unit of selection and of
  transfer). ``device_slots``: blocks held on the device. ``select_blocks``: blocks read per
  (sequence, KV head) and step, including ``window_blocks`` recent blocks and ``sink_blocks``
  first blocks. ``selector``: ``"quest"`` or ``"oracle"`` (:data:`rkv.sparse.SELECTORS`)."""

  block_cells: int = 64
  device_slots: int = 256
  select_blocks: int = 32
  window_blocks: int = 4
  sink_blocks: int = 1
  selector: str = "quest"

  def __post_init__(self):
    for name in ("block_cells", "device_slots", "select_blocks"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"BlockCacheConfig: {name} must be a positive int, got {v!r}")
    for name in ("window_blocks", "sink_blocks"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise ValueError(f"BlockCacheConfig: {name} must be an int >= 0, got {v!r}")
    if self.window_blocks < 1:
      raise ValueError("BlockCacheConfig: window_blocks must be >= 1 (the block being written "
                       "holds the query's own cell)")
    if self.window_blocks + self.sink_blocks > self.select_blocks:
      raise ValueError(f"BlockCacheConfig: window_blocks + sink_blocks = "
                       f"{self.window_blocks + self.sink_blocks} exceed select_blocks="
                       f"{self.select_blocks}")
    if self.select_blocks > self.device_slots:
      raise ValueError(f"BlockCacheConfig: select_blocks={self.select_blocks} exceed "
                       f"device_slots={self.device_slots}")
    _blocks.selector(self.selector)

  @property
  def slot_cells(self) -> int:
    return self.device_slots * self.block_cells

  @property
  def selected_cells(self) -> int:
    return self.select_blocks * self.block_cells


# The H200 configurations (Llama-3-8B shape): 16K-64K cells of slots, 2K-4K selected.
PRESETS = {
    "slots16k_sel2k": BlockCacheConfig(block_cells=64, device_slots=256, select_blocks=32),
    "slots32k_sel4k": BlockCacheConfig(block_cells=64, device_slots=512, select_blocks=64),
    "slots64k_sel4k": BlockCacheConfig(block_cells=64, device_slots=1024, select_blocks=64),
    "tiny": BlockCacheConfig(block_cells=8, device_slots=12, select_blocks=4, window_blocks=1),
}


def preset(name: str) -> BlockCacheConfig:
  if name not in PRESETS:
    raise ValueError(f"unknown block cache preset {name!r}; known: {tuple(PRESETS)}")
  return PRESETS[name]


# ----------------------------------------------------------------------------------------------
# Host store, residency map, counters
# ----------------------------------------------------------------------------------------------
HOST_KINDS = ("auto", "pinned", "numpy")


def _pinned_available() -> bool:
  kinds = {m.kind for m in _memory.default_device().addressable_memories()}
  return _memory.PINNED_HOST in kinds


def host_array(shape, dtype, pinned: bool):
  """``(numpy array, owner)``: zeros of ``shape``; with ``pinned`` a writable numpy view of a
  ``pinned_host`` jax buffer (``owner``, kept alive beside it), so a ``device_put`` of the owner
  is one DMA from page-locked memory (docs/DESIGN.md §5: the buffer has one address for host and
  device); else plain numpy (``owner`` None)."""
  dtype = np.dtype(dtype)
  if not pinned:
    return np.zeros(shape, dtype), None
  owner = _memory.to_host(np.zeros(shape, dtype))
  owner.block_until_ready()
  n = int(np.prod(shape)) * dtype.itemsize
  if n == 0:
    return np.zeros(shape, dtype), owner
  raw = (ctypes.c_uint8 * n).from_address(owner.unsafe_buffer_pointer())
  raw.owner = owner  # every view's base chain reaches raw, so a view keeps the buffer alive
  return np.frombuffer(raw, np.uint8).view(dtype).reshape(shape), owner


@dataclasses.dataclass(frozen=True, eq=False)
class HostStore:
  """The authoritative copy: ``kv [B,NB,2,bs,K,D]`` (K then V of each block, contiguous),
  ``pos [B,NB,bs]`` int32 (-1 empty), int8: ``scale [B,NB,2,bs,K]`` float32. Mutable numpy,
  written through on every append; ``pinned``: views of ``pinned_host`` buffers (``owners``),
  and misses are gathered into pinned staging buffers (``staging``: per bucket of blocks, reused
  once the transfer that read them has landed)."""

  kv: np.ndarray
  pos: np.ndarray
  scale: np.ndarray | None
  pinned: bool = False
  owners: tuple = ()
  staging: dict = dataclasses.field(default_factory=dict)

  @classmethod
  def allocate(cls, shape_kv, dtype, *, quantized: bool, pinned: bool) -> "HostStore":
    b, nb, _, bs, kh, _ = shape_kv
    kv, o1 = host_array(shape_kv, dtype, pinned)
    pos, o2 = host_array((b, nb, bs), np.int32, pinned)
    pos[...] = -1
    scale, o3 = host_array((b, nb, 2, bs, kh), np.float32, pinned) if quantized else (None, None)
    if scale is not None:
      scale[...] = 1.0
    return cls(kv, pos, scale, pinned, tuple(o for o in (o1, o2, o3) if o is not None))

  def fetch(self, flat_blocks: np.ndarray, bucket: int):
    """Blocks ``flat_blocks [m]`` (``b*NB + n``), padded to ``bucket`` with block 0, on the
    device in one ``device_put``: ``(kv [bucket,2,bs,K,D], pos [bucket,bs], scale | None)``."""
    b, nb = self.pos.shape[:2]
    idx = np.zeros(bucket, np.int64)
    idx[:len(flat_blocks)] = flat_blocks
    parts = [(self.kv.reshape((b * nb,) + self.kv.shape[2:]))]
    parts.append(self.pos.reshape(b * nb, -1))
    if self.scale is not None:
      parts.append(self.scale.reshape((b * nb,) + self.scale.shape[2:]))
    if not self.pinned:
      host = tuple(np.take(x, idx, axis=0) for x in parts)
      out = jax.device_put(host)
    else:
      if bucket not in self.staging:
        self.staging[bucket] = [host_array((bucket,) + x.shape[1:], x.dtype, True) for x in parts]
        self.staging[(bucket, "pending")] = None
      pending = self.staging[(bucket, "pending")]
      if pending is not None:
        jax.block_until_ready(pending)  # the last transfer from this buffer has landed
      for x, (view, _) in zip(parts, self.staging[bucket]):
        np.take(x, idx, axis=0, out=view)
      out = jax.device_put(tuple(o for _, o in self.staging[bucket]),
                           _memory.sharding(_memory.DEVICE))
      self.staging[(bucket, "pending")] = out
    return (out[0], out[1], out[2] if self.scale is not None else None)

  @property
  def block_bytes(self) -> int:
    """Bytes one block moves host -> device (K, V, positions, scales)."""
    _, _, two, bs, kh, d = self.kv.shape
    n = two * bs * kh * d * self.kv.itemsize + bs * 4
    return n + (0 if self.scale is None else two * bs * kh * 4)


@dataclasses.dataclass(eq=False)
class Residency:
  """Mutable while one step updates its own copy (:meth:`copy`); a cache never shares it.
  ``page_table [B,NB]`` int32: the slot of block (b, n), -1 when not resident;
  ``slot_block [slots]`` int32: ``b*NB + n`` of the block a slot holds, -1 free; ``ref [slots]``
  bool: CLOCK's reference bits; ``hand``: CLOCK's next slot."""

  page_table: np.ndarray
  slot_block: np.ndarray
  ref: np.ndarray
  hand: int

  def copy(self) -> "Residency":
    return Residency(self.page_table.copy(), self.slot_block.copy(), self.ref.copy(), self.hand)


def check_residency(res: Residency) -> None:
  """Raises ``AssertionError`` unless page_table and slot_block describe the same map."""
  b, nb = res.page_table.shape
  held = np.flatnonzero(res.slot_block >= 0)
  flat = res.page_table.reshape(-1)
  resident = np.flatnonzero(flat >= 0)
  assert len(np.unique(res.slot_block[held])) == len(held), "a block sits in two slots"
  assert np.array_equal(flat[res.slot_block[held]], held), "slot_block -> page_table mismatch"
  assert np.array_equal(res.slot_block[flat[resident]], resident), "page_table -> slot_block mismatch"
  assert len(resident) == len(held), "map sizes differ"


@dataclasses.dataclass(frozen=True)
class StepCounters:
  """Blocks (unique (sequence, block) pairs) a step needed, found resident, fetched, evicted;
  bytes read from the host (the fetched blocks'; ``moved_bytes``: with the transfer's padding to
  a power of two of blocks; a dense prefill chunk's cells in ``dense_bytes``)."""

  steps: int = 0
  hits: int = 0
  misses: int = 0
  evictions: int = 0
  bytes_from_host: int = 0
  moved_bytes: int = 0
  dense_bytes: int = 0
  transfers: int = 0

  def __add__(self, other: "StepCounters") -> "StepCounters":
    return StepCounters(*(a + b for a, b in zip(dataclasses.astuple(self),
                                                dataclasses.astuple(other))))

  @property
  def hit_rate(self) -> float | None:
    n = self.hits + self.misses
    return None if n == 0 else self.hits / n

  def as_dict(self) -> dict:
    return dict(dataclasses.asdict(self), hit_rate=self.hit_rate)


# ----------------------------------------------------------------------------------------------
# The cache
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BlockCache:
  """One sparse layer's cache (module docstring). Device leaves: ``k_slots, v_slots [slots*bs,K,D]``,
  ``slot_pos [slots*bs]``, int8 ``k_scale_slots, v_scale_slots [slots*bs,K]``, the summaries
  ``k_min, k_max [B,NB,K,D]`` float32. Static: the config, host store, map, fill, counters."""

  k_slots: jax.Array
  v_slots: jax.Array
  slot_pos: jax.Array
  k_scale_slots: jax.Array | None
  v_scale_slots: jax.Array | None
  k_min: jax.Array
  k_max: jax.Array
  config: BlockCacheConfig
  store: HostStore
  residency: Residency
  fill: int
  last_step: StepCounters = StepCounters()
  totals: StepCounters = StepCounters()

  tactic: ClassVar[str] = "sparse"
  cpu_fraction: ClassVar[None] = None
  jittable: ClassVar[bool] = False  # the map is host data, read and changed between programs

  # --- shape ---
  @property
  def batch(self) -> int:
    return self.store.kv.shape[0]

  @property
  def n_blocks(self) -> int:
    return self.store.kv.shape[1]

  @property
  def block_cells(self) -> int:
    return self.config.block_cells

  @property
  def capacity(self) -> int:
    return self.n_blocks * self.block_cells

  @property
  def num_kv_heads(self) -> int:
    return self.store.kv.shape[4]

  @property
  def head_dim(self) -> int:
    return self.store.kv.shape[5]

  @property
  def dtype(self) -> np.dtype:
    return self.store.kv.dtype

  @property
  def quantized(self) -> bool:
    return self.store.scale is not None

  @property
  def filled_blocks(self) -> int:
    return -(-self.fill // self.block_cells)

  # --- construction ---
  @classmethod
  def empty(cls, batch: int, capacity: int, num_kv_heads: int, head_dim: int, *,
            config: BlockCacheConfig = BlockCacheConfig(), dtype=jnp.bfloat16,
            host: str = "auto") -> "BlockCache":
    """An empty cache of ``capacity`` cells (rounded up to whole blocks). ``host``: where the
    store lives: ``"pinned"`` (``pinned_host`` buffers, checked against XLA's pool and the host's
    RAM), ``"numpy"`` (pageable), ``"auto"`` (pinned where the device has the memory kind)."""
    where = "BlockCache.empty"
    if host not in HOST_KINDS:
      raise ValueError(f"{where}: host must be one of {HOST_KINDS}, got {host!r}")
    if not isinstance(config, BlockCacheConfig):
      raise ValueError(f"{where}: config must be a BlockCacheConfig, got {type(config).__name__}")
    for name, x in (("batch", batch), ("capacity", capacity), ("num_kv_heads", num_kv_heads),
                    ("head_dim", head_dim)):
      if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1:
        raise ValueError(f"{where}: {name} must be a positive int, got {x!r}")
    dt = _cache.check_kv_dtype(dtype, where, "dtype")
    bs = config.block_cells
    nb = -(-capacity // bs)
    quant = dt == np.dtype(np.int8)
    pinned = host == "pinned" or (host == "auto" and _pinned_available())
    shape = (batch, nb, 2, bs, num_kv_heads, head_dim)
    if pinned:
      nbytes = int(np.prod(shape)) * dt.itemsize + batch * nb * bs * (4 + (8 * num_kv_heads if quant else 0))
      _memory.check_host_pool(nbytes, where=where)
      _memory.check_host_memory(nbytes, where=where, argument="capacity")
    store = HostStore.allocate(shape, dt, quantized=quant, pinned=pinned)
    rows = config.slot_cells
    res = Residency(np.full((batch, nb), -1, np.int32),
                    np.full(config.device_slots, -1, np.int32),
                    np.zeros(config.device_slots, bool), 0)
    # Free slots hold NaN keys at position -1: never read (docs/DESIGN.md §2), and a bug that
    # read one would show.
    fill_value = 0 if quant else jnp.nan
    # Separate buffers (not one array twice): the writers donate each of them.
    slots = lambda: jnp.full((rows, num_kv_heads, head_dim), fill_value, dt)
    scales = ((jnp.ones((rows, num_kv_heads), jnp.float32),
               jnp.ones((rows, num_kv_heads), jnp.float32)) if quant else (None, None))
    return cls(k_slots=slots(), v_slots=slots(), slot_pos=jnp.full((rows,), -1, jnp.int32),
               k_scale_slots=scales[0], v_scale_slots=scales[1],
               k_min=jnp.full((batch, nb, num_kv_heads, head_dim), jnp.inf, jnp.float32),
               k_max=jnp.full((batch, nb, num_kv_heads, head_dim), -jnp.inf, jnp.float32),
               config=config, store=store, residency=res, fill=0)

  @classmethod
  def from_arrays(cls, k, v, *, config: BlockCacheConfig = BlockCacheConfig(), k_pos=None,
                  capacity: int | None = None, dtype=None) -> "BlockCache":
    """A cache holding ``k, v [B,S,K,D]`` (positions ``k_pos [B,S]``, default arange), nothing
    resident yet. ``dtype``: the store's (default k's; ``int8`` quantizes per token and head)."""
    b, s, kh, d = np.shape(k)
    dtype = k.dtype if dtype is None else dtype
    kv = cls.empty(b, s if capacity is None else capacity, kh, d, config=config, dtype=dtype)
    if k_pos is None:
      k_pos = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
    return kv.append(k, v, k_pos)

  @classmethod
  def from_host(cls, kv: np.ndarray, pos: np.ndarray, *, config: BlockCacheConfig, fill: int,
                scale: np.ndarray | None = None, summary_blocks: int = 4096,
                host: str = "numpy") -> "BlockCache":
    """A cache over a prebuilt host store ``kv [B,NB,2,bs,K,D]``, ``pos [B,NB,bs]`` (int8:
    ``scale [B,NB,2,bs,K]``) holding ``fill`` cells: taken as is with ``host="numpy"``, copied
    into pinned buffers with ``"pinned"`` / ``"auto"`` (as :meth:`empty`). The summaries are made
    ``summary_blocks`` blocks at a time (a long context's keys never sit on the device whole)."""
    b, nb, two, bs, kh, d = kv.shape
    if two != 2 or bs != config.block_cells or pos.shape != (b, nb, bs):
      raise ValueError(f"BlockCache.from_host: kv must be [B,NB,2,bs={config.block_cells},K,D] "
                       f"and pos [B,NB,bs]; got {kv.shape}, {pos.shape}")
    if not 0 <= fill <= nb * bs:
      raise ValueError(f"BlockCache.from_host: fill must be in [0, {nb * bs}], got {fill}")
    empty = cls.empty(b, 1, kh, d, config=config, dtype=kv.dtype, host="numpy")
    if host not in HOST_KINDS:
      raise ValueError(f"BlockCache.from_host: host must be one of {HOST_KINDS}, got {host!r}")
    if host == "pinned" or (host == "auto" and _pinned_available()):
      store = HostStore.allocate(kv.shape, kv.dtype, quantized=scale is not None, pinned=True)
      store.kv[...], store.pos[...] = kv, pos
      if scale is not None:
        store.scale[...] = scale
    else:
      store = HostStore(kv=kv, pos=pos, scale=scale)
    lo_parts, hi_parts = [], []
    for lo in range(0, nb, summary_blocks):
      hi = min(lo + summary_blocks, nb)
      n = hi - lo
      sc = None if scale is None else jnp.asarray(scale[:, lo:hi, 0].reshape(b, n * bs, kh))
      summ = _blocks.summarize(jnp.asarray(kv[:, lo:hi, 0].reshape(b, n * bs, kh, d)),
                               jnp.asarray(pos[:, lo:hi].reshape(b, n * bs)), block_cells=bs,
                               k_scale=sc)
      lo_parts.append(summ.k_min)
      hi_parts.append(summ.k_max)
    res = Residency(np.full((b, nb), -1, np.int32), empty.residency.slot_block,
                    empty.residency.ref, 0)
    return dataclasses.replace(empty, store=store, residency=res, fill=fill,
                               k_min=jnp.concatenate(lo_parts, 1),
                               k_max=jnp.concatenate(hi_parts, 1))

  # --- the layer-cache protocol ---
  @property
  def room(self) -> int:
    return self.capacity - self.fill

  def next_position(self) -> jax.Array:
    return jnp.int32(self.fill)

  def streamed_tiles(self) -> tuple:
    return ()  # fetches follow the selection, which is known only inside the step

  def attend(self, q, k, v, positions, *, window=None, softcap=None, scale=None, impl="auto",
             **_):
    """Appends the chunk (write-through) and attends: densely for a prefill chunk, over the
    selected blocks for a decode step. Returns ``(o, new cache)``."""
    new = self.append(k, v, positions)
    if q.shape[1] > MAX_DECODE_QUERIES:
      o, _, new = new.dense_attention(q, positions, window=window, softcap=softcap,
                                      scale=scale, impl=impl)
      return o, new
    o, _, _, new = new.step(q, positions, window=window, softcap=softcap, scale=scale,
                            impl=impl)
    return o, new

  # --- writes ---
  def append(self, k, v, pos=None) -> "BlockCache":
    """Writes ``k, v [B,T,K,D]`` at cells ``fill .. fill+T-1`` (positions ``pos [B,T]``, default
    ``fill + arange(T)``): into the host store, into resident slots, into the summaries."""
    where = "BlockCache.append"
    b, t, kh, d = np.shape(k)
    if np.shape(v) != (b, t, kh, d) or (b, kh, d) != (self.batch, self.num_kv_heads,
                                                        self.head_dim):
      raise ValueError(f"{where}: k, v must be [B,T,K,D] with B={self.batch}, "
                       f"K={self.num_kv_heads}, D={self.head_dim}; got {np.shape(k)}, {np.shape(v)}")
    if self.fill + t > self.capacity:
      raise ValueError(f"{where}: appending T={t} cells to a cache holding {self.fill} exceeds "
                       f"its capacity={self.capacity}")
    if pos is None:
      pos = np.broadcast_to(np.arange(self.fill, self.fill + t, dtype=np.int32), (b, t))
    if tuple(np.shape(pos)) != (b, t):
      raise ValueError(f"{where}: pos must be [B,T]=[{b},{t}], got {tuple(np.shape(pos))}")
    if t == 0:
      return self
    cells = self._cells_as_stored(k, v)                    # (k, v, k_scale, v_scale)
    dev_pos = pos if _is_device_int32(pos) else np.asarray(pos, np.int32)
    # One read-back for the host copy (the chunk's cells and positions together: one wait on the
    # device, not one per array); the slots are written from the arrays themselves, so nothing
    # read back is uploaded again.
    host_k, host_v, host_ks, host_vs, host_pos = jax.device_get((*cells, dev_pos))
    new_kv = np.stack([np.asarray(host_k), np.asarray(host_v)], 2)           # [B,T,2,K,D]
    new_scale = None if host_ks is None else np.stack([host_ks, host_vs], 2)  # [B,T,2,K]
    pos = np.asarray(host_pos, np.int32)
    cell_ids = np.arange(self.fill, self.fill + t)
    blk, off = cell_ids // self.block_cells, cell_ids % self.block_cells
    st = self.store
    # Write-through, step 1: the host copy, always.
    # (numpy puts the two index arrays' axis first: [T,B,2,...])
    st.kv[:, blk, :, off] = new_kv.transpose(1, 0, 2, 3, 4)
    st.pos[:, blk, off] = pos
    if new_scale is not None:
      st.scale[:, blk, :, off] = new_scale.transpose(1, 0, 2, 3)
    # Step 2: resident slots hold the same cells (rows past the pool are dropped).
    slot = self.residency.page_table[:, blk]                          # [B,T]
    rows = np.where(slot >= 0, slot * self.block_cells + off[None], self.config.slot_cells)
    rows = rows.reshape(-1).astype(np.int32)
    # Step 3: the summaries of the touched blocks, from the host copy (the whole block: its
    # earlier cells too).
    touched = np.unique(blk).astype(np.int32)
    block_keys = st.kv[:, touched, 0]                                   # [B,n,bs,K,D]
    block_scale = None if st.scale is None else st.scale[:, touched, 0]  # [B,n,bs,K]
    # Steps 2 and 3 in one program (one dispatch a layer and step); its host arguments move with
    # the call (jit's C++ path: cheaper than a jax.device_put of them first).
    out = _write_cells(self.k_slots, self.v_slots, self.slot_pos, self.k_scale_slots,
                       self.v_scale_slots, self.k_min, self.k_max, rows, cells[0], cells[1],
                       dev_pos, cells[2], cells[3], touched, block_keys, st.pos[:, touched],
                       block_scale, block_cells=self.block_cells)
    return dataclasses.replace(self, **dict(zip(_WRITTEN, out)), fill=self.fill + t)

  def _cells_as_stored(self, k, v):
    """The chunk ``k, v [B,T,K,D]`` as the store holds it: ``(k, v, k_scale, v_scale)`` in the
    store's dtype (int8: quantized here, with ``[B,T,K]`` scales; else the scales are None). Device
    arrays already in the store's dtype are used as they are (no round trip through the host)."""
    if self.quantized:
      if np.dtype(k.dtype) == np.dtype(np.int8):
        raise ValueError("BlockCache.append: give float k/v; the cache quantizes them")
      (kq, ks), (vq, vs) = _cache.quantize_pair(k, v)
      return kq, vq, ks, vs
    if all(isinstance(x, jax.Array) and np.dtype(x.dtype) == self.dtype for x in (k, v)):
      return k, v, None, None
    return np.asarray(k).astype(self.dtype), np.asarray(v).astype(self.dtype), None, None

  # --- reads ---
  def view(self, *, with_keys: bool = False) -> _blocks.SelectionView:
    """What a selector reads: the summaries (and, for the oracle, every key from the host)."""
    s = _blocks.BlockSummaries(self.k_min, self.k_max)
    if not with_keys:
      return _blocks.SelectionView(s, self.block_cells)
    b, nb, _, bs, kh, d = self.store.kv.shape
    keys = jnp.asarray(self.store.kv[:, :, 0].reshape(b, nb * bs, kh, d))
    ks = None if self.store.scale is None else jnp.asarray(
        self.store.scale[:, :, 0].reshape(b, nb * bs, kh))
    return _blocks.SelectionView(s, self.block_cells, keys=keys,
                                 key_pos=jnp.asarray(self.store.pos.reshape(b, nb * bs)),
                                 key_scale=ks)

  def select(self, q, positions, *, scale=None, softcap=None, selector=None) -> jax.Array:
    """The ``[B,K,N]`` block ids the config's (or the given) selector picks for ``q``."""
    sel = _blocks.selector(self.config.selector if selector is None else selector)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if isinstance(sel, _blocks.QuestSelector):
      return _blocks.quest_select_blocks(
          q, _blocks.BlockSummaries(self.k_min, self.k_max), scale=scale,
          n_select=self.config.select_blocks, filled_blocks=self.filled_blocks,
          window_blocks=self.config.window_blocks, sink_blocks=self.config.sink_blocks)
    view = self.view(with_keys=sel.name == "oracle")
    scores = sel.scores(q, view, q_pos=jnp.asarray(positions, jnp.int32), scale=scale,
                        softcap=softcap)
    return _blocks.select_blocks(scores, n_select=self.config.select_blocks,
                                 filled_blocks=self.filled_blocks,
                                 window_blocks=self.config.window_blocks,
                                 sink_blocks=self.config.sink_blocks)

  def step(self, q, positions, *, blocks=None, window=None, softcap=None, scale=None,
           impl="auto", selector=None):
    """One decode step's read: selects (or takes ``blocks [B,K,N]``), makes the blocks resident
    (hits, CLOCK evictions, one batched fetch of the misses), attends over them. Returns
    ``(o, lse, blocks, new cache)``."""
    if self.fill == 0:
      raise ValueError("BlockCache.step: the cache is empty")
    # The rkv.sparse.* spans name the step's phases in a jax.profiler trace
    # (experiments/sparse_bench.py --trace_steps); outside a trace they cost nothing measurable.
    with jax.profiler.TraceAnnotation("rkv.sparse.select"):
      if blocks is None:
        blocks = self.select(q, positions, scale=scale, softcap=softcap, selector=selector)
      ids = np.asarray(blocks).astype(np.int32)  # the step's one wait on the device
    if ids.ndim != 3 or ids.shape[:2] != (self.batch, self.num_kv_heads):
      raise ValueError(f"BlockCache.step: blocks must be [B,K,N]=[{self.batch},"
                       f"{self.num_kv_heads},N], got {ids.shape}")
    if ids.size and (ids.max() >= self.filled_blocks):
      raise ValueError(f"BlockCache.step: block ids must be < {self.filled_blocks} (the written "
                       f"blocks), got {int(ids.max())}")
    with jax.profiler.TraceAnnotation("rkv.sparse.resident"):
      new = self.make_resident(ids)
    slot_ids = np.where(ids < 0, -1, new.residency.page_table[np.arange(self.batch)[:, None, None],
                                                            np.maximum(ids, 0)])
    with jax.profiler.TraceAnnotation("rkv.sparse.attend"):
      o, lse = _blocks.block_attention(
          q, new.k_slots, new.v_slots, slot_ids.astype(np.int32),
          block_cells=self.block_cells, pos=new.slot_pos, q_pos=jnp.asarray(positions, jnp.int32),
          k_scale=new.k_scale_slots, v_scale=new.v_scale_slots, causal=True, window=window,
          softcap=softcap, scale=scale, impl=impl)
    # The selection made on the device is returned as it is (not uploaded again).
    selected = blocks if _is_device_int32(blocks) else jnp.asarray(ids)
    return o, lse, selected, new

  def make_resident(self, ids: np.ndarray) -> "BlockCache":
    """The cache with every block of ``ids [B,K,N]`` (negative: none) resident: CLOCK over the
    slots, then one batched host->device transfer of the misses."""
    nb, slots = self.n_blocks, self.config.device_slots
    b_idx = np.broadcast_to(np.arange(self.batch)[:, None, None], ids.shape)
    flat = np.unique((b_idx * nb + ids)[ids >= 0])
    if len(flat) > slots:
      raise ValueError(f"BlockCache: a step needs {len(flat)} distinct blocks (the union over "
                       f"sequences and KV heads) but the cache has device_slots={slots}: raise "
                       f"device_slots or lower select_blocks")
    res = self.residency.copy()
    pt = res.page_table.reshape(-1)
    hit = pt[flat] >= 0
    res.ref[pt[flat[hit]]] = True
    misses = flat[~hit]
    needed = np.zeros(slots, bool)
    needed[pt[flat[hit]]] = True
    chosen, evicted = clock_slots(res, needed, len(misses))
    pt[evicted[evicted >= 0]] = -1
    evictions = int((evicted >= 0).sum())
    res.slot_block[chosen] = misses
    pt[misses] = chosen
    res.ref[chosen] = True
    new = self
    nbytes = 0
    if len(misses):
      # One transfer: the missed blocks gathered into one contiguous host buffer (plus their
      # positions and scales, moved by the same device_put).
      # The buffer is padded to a power of two of blocks (padding goes to no slot), so the
      # scatter compiles once per bucket, not once per miss count.
      m = len(misses)
      bucket = 1 << (m - 1).bit_length()
      st = self.store
      nbytes = m * st.block_bytes
      padded = bucket * st.block_bytes
      kv_d, pos_d, sc_d = st.fetch(misses, bucket)
      to = np.full(bucket, slots, np.int32)  # past the pool: dropped
      to[:m] = chosen
      upd = _fill_slots(self.k_slots, self.v_slots, self.slot_pos, self.k_scale_slots,
                        self.v_scale_slots, jnp.asarray(to), kv_d, pos_d, sc_d)
      new = dataclasses.replace(self, **upd)
    counted = StepCounters(steps=1, hits=int(hit.sum()), misses=len(misses), evictions=evictions,
                           bytes_from_host=nbytes, moved_bytes=padded if len(misses) else 0,
                           transfers=int(len(misses) > 0))
    return dataclasses.replace(new, residency=res, last_step=counted,
                               totals=self.totals + counted)

  def dense_attention(self, q, positions, *, window=None, softcap=None, scale=None,
                      impl="auto"):
    """Exact attention over every written cell, read from the host in one transfer (the prefill
    path). Returns ``(o, lse, new cache)`` (``dense_bytes`` counted)."""
    b, nb, _, bs, kh, d = self.store.kv.shape
    n = self.filled_blocks
    st = self.store
    host = (st.kv[:, :n], st.pos[:, :n], None if st.scale is None else st.scale[:, :n])
    nbytes = sum(x.nbytes for x in host if x is not None)
    kv, pos, sc = jax.device_put(host)
    kw = {}
    if sc is not None:
      kw = dict(k_scale=sc[:, :, 0].reshape(b, n * bs, kh), v_scale=sc[:, :, 1].reshape(b, n * bs, kh))
    o, lse = attention(q, kv[:, :, 0].reshape(b, n * bs, kh, d), kv[:, :, 1].reshape(b, n * bs, kh, d),
                       q_pos=jnp.asarray(positions, jnp.int32), k_pos=pos.reshape(b, n * bs),
                       causal=True, window=window, softcap=softcap, scale=scale, impl=impl, **kw)
    counted = StepCounters(dense_bytes=nbytes, transfers=1)
    return o, lse, dataclasses.replace(self, last_step=counted, totals=self.totals + counted)

  def reset_counters(self) -> "BlockCache":
    """The cache with zeroed counters (a new request)."""
    return dataclasses.replace(self, last_step=StepCounters(), totals=StepCounters())

  def resident_copy(self):
    """Every block as one pool, block (b, n) in slot ``b*NB + n``: ``(k, v, pos, k_scale,
    v_scale)`` — what the parity tests read the same blocks from."""
    b, nb, _, bs, kh, d = self.store.kv.shape
    st = self.store
    k = jnp.asarray(st.kv[:, :, 0].reshape(b * nb * bs, kh, d))
    v = jnp.asarray(st.kv[:, :, 1].reshape(b * nb * bs, kh, d))
    sc = (None, None) if st.scale is None else (
        jnp.asarray(st.scale[:, :, 0].reshape(-1, kh)), jnp.asarray(st.scale[:, :, 1].reshape(-1, kh)))
    return k, v, jnp.asarray(st.pos.reshape(-1)), sc[0], sc[1]


jax.tree_util.register_dataclass(
    BlockCache, data_fields=["k_slots", "v_slots", "slot_pos", "k_scale_slots", "v_scale_slots",
                             "k_min", "k_max"],
    meta_fields=["config", "store", "residency", "fill", "last_step", "totals"])


def clock_slots(res: Residency, needed: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
  """Slots for ``m`` missed blocks, taken one after another as CLOCK takes them: free slots
  first (lowest first, the hand stays); then the hand sweeps, clearing the reference bits it
  passes and taking the first slot with a clear bit that this step does not need. Returns
  ``(slots [m], evicted flat blocks [m], -1 for a free slot)``; updates ``res.ref``,
  ``res.hand`` and ``needed`` (the chosen slots become needed; their bits are the caller's).

  Vectorized over the sweep (a Python loop per miss and per slot passed: 76 us for 16 misses in
  1024 slots, 460 us for 64, on CPU; this is 30-60 us):
  the victims of consecutive misses are the candidates (slots not needed) in hand order with a
  clear bit; if one lap holds fewer than ``m``, that lap clears every candidate's bit and the
  second lap takes the remaining candidates in hand order, exactly as the one-slot loop would."""
  free = np.flatnonzero(res.slot_block < 0)[:m].astype(np.int32)
  needed[free] = True
  rest = m - len(free)
  if rest == 0:
    return free, np.full(m, -1, np.int32)
  n = len(res.slot_block)
  order = (res.hand + np.arange(n)) % n
  cand = order[~needed[order]]
  if len(cand) < rest:
    raise AssertionError("CLOCK found no victim (make_resident checks the slots suffice)")
  clear = np.flatnonzero(~res.ref[cand])               # indices into cand, in sweep order
  if len(clear) >= rest:                               # within one lap
    victims = cand[clear[:rest]]
    res.ref[cand[:clear[rest - 1]]] = False
  else:                                                # a full lap, then the second lap's
    taken = np.zeros(len(cand), bool)
    taken[clear] = True
    victims = np.concatenate([cand[clear], cand[~taken][:rest - len(clear)]])
    res.ref[cand] = False
  res.hand = int(victims[-1] + 1) % n
  needed[victims] = True
  evicted = res.slot_block[victims].astype(np.int32)
  return (np.concatenate([free, victims]).astype(np.int32),
          np.concatenate([np.full(len(free), -1, np.int32), evicted]))


_WRITTEN = ("k_slots", "v_slots", "slot_pos", "k_scale_slots", "v_scale_slots", "k_min", "k_max")


def _is_device_int32(x) -> bool:
  return isinstance(x, jax.Array) and x.dtype == jnp.int32


@functools.partial(jax.jit, donate_argnums=(0, 1, 2, 3, 4, 5, 6),
                   static_argnames=("block_cells",))
def _write_cells(k_slots, v_slots, slot_pos, k_scale_slots, v_scale_slots, k_min, k_max, rows, k,
                 v, pos, k_scale, v_scale, touched, block_keys, block_pos, block_scale, *,
                 block_cells):
  """An append's device writes: the cells ``k, v [B,T,K,D]`` into their resident slots' ``rows
  [B*T]`` (rows past the pool: not resident, dropped), and the summaries of the ``touched``
  blocks, made from their host copy ``block_keys [B,n,bs,K,D]``."""
  b, t, kh, d = k.shape
  put = lambda buf, x: buf.at[rows].set(x, mode="drop")
  if k_scale is not None:
    k_scale_slots = put(k_scale_slots, k_scale.reshape(b * t, kh))
    v_scale_slots = put(v_scale_slots, v_scale.reshape(b * t, kh))
  n = block_keys.shape[1]
  summ = _blocks.summarize(block_keys.reshape(b, n * block_cells, kh, d),
                           block_pos.reshape(b, n * block_cells), block_cells=block_cells,
                           k_scale=None if block_scale is None else block_scale.reshape(
                               b, n * block_cells, kh))
  # A tuple in the donated arguments' order: jax pairs donated inputs with outputs of the same
  # shape in order, and a dict's (sorted) keys put k_max before k_min, a swap XLA resolves by
  # copying both summaries (the whole [B,NB,K,D] twice each, every append).
  return (put(k_slots, k.reshape(b * t, kh, d)), put(v_slots, v.reshape(b * t, kh, d)),
          put(slot_pos, pos.reshape(-1)), k_scale_slots, v_scale_slots,
          k_min.at[:, touched].set(summ.k_min), k_max.at[:, touched].set(summ.k_max))


@functools.partial(jax.jit, donate_argnums=(0, 1, 2, 3, 4))
def _fill_slots(k_slots, v_slots, slot_pos, k_scale_slots, v_scale_slots, slots, kv, pos, scale):
  """Scatters fetched blocks ``kv [M,2,bs,K,D]`` (positions ``[M,bs]``) into ``slots [M]``."""
  m, _, bs, kh, d = kv.shape
  # A padding entry names the slot past the pool: its rows are dropped.
  rows = (slots[:, None] * bs + jnp.arange(bs, dtype=jnp.int32)).reshape(-1)
  put = lambda buf, x: buf.at[rows].set(x, mode="drop")
  out = dict(k_slots=put(k_slots, kv[:, 0].reshape(m * bs, kh, d)),
             v_slots=put(v_slots, kv[:, 1].reshape(m * bs, kh, d)),
             slot_pos=put(slot_pos, pos.reshape(-1)))
  if scale is not None:
    out.update(k_scale_slots=put(k_scale_slots, scale[:, 0].reshape(m * bs, kh)),
               v_scale_slots=put(v_scale_slots, scale[:, 1].reshape(m * bs, kh)))
  return out


# ----------------------------------------------------------------------------------------------
# Save / load: the host store (the authoritative copy) and the fill; residency starts cold
# ----------------------------------------------------------------------------------------------
def save(kv: BlockCache, directory: str) -> None:
  """Writes the host store and fill to ``directory``, atomically and under the same rules as
  rkv.cache.save (written aside, then swapped in; a directory holding anything besides a block
  cache save is refused, not emptied; an ``OSError`` becomes a ``ValueError`` that says the
  previous save is unchanged). Residency is not saved: a loaded cache starts cold and its fetches
  bring the same bytes back."""
  _atomic_io.save_atomically(directory, functools.partial(_write_save, kv),
                             where="rkv.sparse.save", what="the block cache",
                             kind="a block cache save", names=_SAVE_FILES)


_SAVE_FILES = {"manifest.json", "kv.npy", "pos.npy", "scale.npy"}


def _write_save(kv: BlockCache, out: str) -> None:
  """The arrays, then the manifest (each file's shape, size and CRC-32), into the fresh directory
  ``out``; each file fsynced."""
  st = kv.store
  arrays = dict(kv=st.kv, pos=st.pos)
  if st.scale is not None:
    arrays["scale"] = st.scale
  specs = {}
  for name, x in arrays.items():
    path = os.path.join(out, f"{name}.npy")
    with open(path, "xb") as f:
      np.save(f, x.view(np.uint16) if x.dtype.name == "bfloat16" else x)
      f.flush()
      os.fsync(f.fileno())
    specs[name] = dict(shape=list(x.shape), bytes=os.path.getsize(path),
                       crc32=_atomic_io.file_crc32(path))
  manifest = dict(format=FORMAT, version=FORMAT_VERSION, fill=kv.fill, dtype=kv.dtype.name,
                  config=dataclasses.asdict(kv.config), arrays=specs)
  with open(os.path.join(out, "manifest.json"), "x") as f:
    json.dump(manifest, f)
    f.flush()
    os.fsync(f.fileno())


def load(directory: str, *, config: BlockCacheConfig | None = None,
         verify: bool = True) -> BlockCache:
  """Reads a cache written by :func:`save` (``config``: the saved one unless given; its
  ``block_cells`` must match). ``verify`` checks each file's CRC-32 (reads every byte once; saves
  of format v1 carry none). A missing, truncated, foreign or corrupted file, or a malformed
  manifest, raises ``ValueError`` naming it."""
  where = "rkv.sparse.load"
  path, m = _cache.read_manifest(directory, FORMAT, (1, FORMAT_VERSION), where=where,
                                 what="a block cache directory")
  try:
    saved = BlockCacheConfig(**m["config"])
    config = saved if config is None else config
    if config.block_cells != saved.block_cells:
      raise ValueError(f"{where}: config.block_cells={config.block_cells} must equal the saved "
                       f"{saved.block_cells}")
    dt = _cache.check_kv_dtype(m["dtype"], where, "manifest dtype")
    names = ("kv", "pos", "scale") if dt == np.dtype(np.int8) else ("kv", "pos")
    arrays = {name: _read_array(directory, name, m["arrays"][name], verify, where)
              for name in names}
    fill = int(m["fill"])
  except (KeyError, TypeError) as e:
    raise ValueError(f"{where}: {path} is missing or has a malformed field: {e!r}") from e
  if dt.name == "bfloat16" and arrays["kv"].dtype == np.uint16:  # saved as its bits
    arrays["kv"] = arrays["kv"].view(dt)
  if arrays["kv"].ndim != 6 or arrays["kv"].shape[3] != config.block_cells:
    raise ValueError(f"{where}: kv.npy has shape {list(arrays['kv'].shape)}, a block cache's is "
                     f"[B, n_blocks, 2, {config.block_cells}, K, D]: foreign file")
  b, nb, _, bs, kh, d = arrays["kv"].shape
  if not 0 <= fill <= nb * bs:
    raise ValueError(f"{where}: {path} has fill={fill}, outside the saved capacity {nb * bs}")
  kv = BlockCache.empty(b, nb * bs, kh, d, config=config, dtype=dt)
  st = kv.store
  for name, x in arrays.items():  # a foreign file's dtype would be cast silently by the copy
    want = getattr(st, name)
    if x.dtype != want.dtype or x.shape != want.shape:
      raise ValueError(f"{where}: {name}.npy holds {x.dtype}{list(x.shape)}, a cache of this "
                       f"manifest stores {want.dtype}{list(want.shape)}: foreign file")
  st.kv[...] = arrays["kv"]
  st.pos[...] = arrays["pos"]
  if st.scale is not None:
    st.scale[...] = arrays["scale"]
  keys = st.kv[:, :, 0].reshape(b, nb * bs, kh, d)
  ks = None if st.scale is None else st.scale[:, :, 0].reshape(b, nb * bs, kh)
  summ = _blocks.summarize(keys, st.pos.reshape(b, nb * bs), block_cells=bs, k_scale=ks)
  return dataclasses.replace(kv, k_min=summ.k_min, k_max=summ.k_max, fill=fill)


def _read_array(directory: str, name: str, spec, verify: bool, where: str) -> np.ndarray:
  """``name.npy``, checked against its manifest entry (v2: shape, size, CRC-32; v1: the shape)."""
  fpath = os.path.join(directory, f"{name}.npy")
  if not os.path.isfile(fpath):
    raise ValueError(f"{where}: missing array file {fpath}")
  shape = spec["shape"] if isinstance(spec, dict) else spec
  if isinstance(spec, dict):
    if os.path.getsize(fpath) != int(spec["bytes"]):
      raise ValueError(f"{where}: {fpath} has {os.path.getsize(fpath)} bytes, the manifest says "
                       f"{int(spec['bytes'])}: truncated or foreign file")
    if verify and _atomic_io.file_crc32(fpath) != int(spec["crc32"]):
      raise ValueError(f"{where}: {fpath} fails its CRC-32 check: corrupted or foreign file")
  try:
    x = np.load(fpath, allow_pickle=False)
  except (ValueError, OSError, EOFError) as e:
    raise ValueError(f"{where}: {fpath} is not a readable .npy file ({e})") from e
  if list(x.shape) != list(shape):
    raise ValueError(f"{where}: {fpath} has shape {list(x.shape)}, the manifest says {shape}")
  return x
