"""KV cache pytrees: :class:`RollingKV` = device window + device staging tile + pinned-host tail.

Cells fill in order: the first ``W = window_cells`` go to the **window** (device, ``[B,W,K,D]``),
every later cell is **tail**-bound. Tail-bound cells are first written to a one-tile **staging**
buffer on the device (``[B,tile,K,D]``); when it is full it is **flushed** to the host tail.
The tail is a tuple of ``N`` **per-tile arrays**: ``kv.tail.k[i]`` / ``kv.tail.v[i]`` are tile
``i``'s ``[B,tile,K,D]`` in memory kind ``pinned_host`` (int8 scales ``kv.tail.k_scale[i]``
``[B,tile,K]`` likewise), ``kv.tail.pos[i]`` its ``[B,tile]`` positions; ``kv.tail_tiles`` gives
the same as one :class:`KVBlock` per tile. Positions (``k_pos``, int32, -1 = empty) live on the
device for all three parts: 4 bytes a cell is 0.1% of a bf16 cell at K=8, D=128, and masks then
need no transfer. int8 caches keep a scale per (token, KV head) next to each part (host for the
tail), bfloat16 by default (:func:`default_scale_dtype`; float32 kept where a caller's scales
are float32): the tail crosses PCIe at about half the bf16 bytes and is dequantized on the device.
Attention over the cache (:func:`rkv.rolling_attention`) is the exact LSE merge of window,
staging and tail partials, so where a cell lives never changes the result.

Why one array per tile: a stacked ``pinned_host`` tail moved inside one jitted program did not
overlap compute on the H200, separate per-tile arrays moved by eager ``jax.device_put`` did
(docs/DESIGN.md §5, the figures in §7). :mod:`rkv.offload.stream` builds its default ``"eager"``
schedule on that, and per-tile storage is what it needs.

Flush design (O(tile) by construction): the tail is preallocated for ``capacity`` (every tile
allocated in ``pinned_host`` at construction, so a tail too large for XLA's pinned-host pool fails
there and not in the middle of a decode). A flush is ``jax.device_put`` of the staging tile's
K/V (and scales) to the ``pinned_host`` sharding, and the result **replaces one leaf** of each
tuple: no program ever takes the tail as an input, the other tiles' arrays are the same objects on
the same buffers, and the replaced (empty) tile is freed when the old tuple goes. The staging
positions array becomes the tile's positions as is (no copy; the staging gets a fresh -1 array).
``tests/cache_test.py`` checks all of this (a flush still works with every other tile deleted).
The device→host copy is PJRT's async transfer, as the host→device one the eager schedule uses.

The fill level is static metadata (a Python int in the pytree's treedef): every placement
decision — window or staging, whether to flush, which tail tile — is then plain Python, and no
host write ever sits under a traced condition. The jitted writers take their offsets as traced
scalars, so a changing fill does not recompile them; ``append`` and ``rolling_attention`` jit
internally and are meant to be called eagerly per layer and step. An outer ``jit`` over a function
taking the cache retraces whenever the fill changes (and ``rolling_attention`` then runs its
single-program ``"unrolled"`` schedule).

``append`` donates the device buffers it writes (window, staging): the cache passed in must not be
used afterwards (the usual in-place KV cache contract; the returned cache is the live one).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import zlib
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from rkv import atomic_io
from rkv import tactics
from rkv import validation
from rkv.offload import memory

DEFAULT_TILE_CELLS = 32768  # docs/DESIGN.md §7: 32K-cell tiles streamed at 48.5 GB/s inside one jit.
KV_DTYPES = ("bfloat16", "float16", "float32", "int8")
FORMAT = "rkv.RollingKV"
FORMAT_VERSION = 1
_ARRAY_NAMES = ("k", "v", "pos", "k_scale", "v_scale")
# int8 scales: float32 or bfloat16. bfloat16 is the default of every scale rkv computes: a cell of
# Llama-3-8B's shape holds 2 x 8 heads x (128 int8 + a scale), so float32 scales are 64 of a
# layer's 2116 bytes a cell (with its 4-byte position) and bfloat16 ones 32 of 2084. At 2M tokens
# that is 2 GiB less KV, all of it taken from the host tail that bounds the step (docs/DESIGN.md
# §6). Quantizing against the rounded scale keeps the int8 step's error bound (below).
SCALE_DTYPES = ("float32", "bfloat16")
DEFAULT_SCALE_DTYPE = "bfloat16"
# $RKV_INT8_SCALE_DTYPE (float32 / bfloat16) replaces the default in this process, for the planner
# (rkv.planner.layout) and every cache alike: the same-run A/B of the two formats.
SCALE_DTYPE_ENV = "RKV_INT8_SCALE_DTYPE"


def default_scale_dtype() -> np.dtype:
  """The dtype of the int8 scales rkv computes: ``$RKV_INT8_SCALE_DTYPE`` where set, else
  :data:`DEFAULT_SCALE_DTYPE`; a value outside :data:`SCALE_DTYPES` is a ValueError."""
  name = os.environ.get(SCALE_DTYPE_ENV) or DEFAULT_SCALE_DTYPE
  if name not in SCALE_DTYPES:
    raise ValueError(f"${SCALE_DTYPE_ENV} must be one of {SCALE_DTYPES}, got {name!r}")
  return np.dtype(jnp.dtype(name))


# ----------------------------------------------------------------------------------------------
# Pytrees
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KVBlock:
  """Cells of one storage part. ``k, v [B,S,K,D]``, ``pos [B,S]`` int32 (-1: empty slot),
  ``k_scale, v_scale [B,S,K]`` (float32 or bfloat16) for int8 K/V, else None. Window and staging
  hold arrays; the tail holds, in each field, a **tuple** of N per-tile arrays ``[B,tile,...]``
  (K/V and scales in ``pinned_host``, positions on the device)."""

  k: jax.Array
  v: jax.Array
  pos: jax.Array
  k_scale: jax.Array | None = None
  v_scale: jax.Array | None = None


jax.tree_util.register_dataclass(KVBlock, data_fields=list(_ARRAY_NAMES), meta_fields=[])


@dataclasses.dataclass(frozen=True)
class RollingKV:
  """One layer's KV cache: ``window`` (device), ``staging`` (device), ``tail`` (pinned_host).

  ``window.k`` / ``window.v`` are ``[B,W,K,D]`` device arrays. ``tail.k`` / ``tail.v`` are tuples
  of ``n_tail_tiles`` per-tile ``pinned_host`` arrays ``[B,tile,K,D]`` (``tail.pos``: tuple of
  device ``[B,tile]``; int8 scales: tuples of ``pinned_host`` ``[B,tile,K]``); ``tail_tiles``
  views them as one :class:`KVBlock` per tile. (Until the per-tile rework the tail was one
  stacked ``[N,B,tile,K,D]`` array; see the module docstring for why it changed.) Only the first
  ``n_full_tiles`` tiles hold data.

  Static fields: ``window_cells`` W, ``tile_cells``, ``capacity`` (W + P), ``fill`` (cells
  written), and how a layer attends to it: ``tactic`` (one of ``rkv.tactics.ROLLING``:
  ``stream``, ``cpu``, ``hybrid``) with ``cpu_fraction`` (``hybrid``: the share of the tail's full
  tiles on the CPU), set by :meth:`with_tactic`. ``W == capacity`` means no tail and no staging:
  attention is the resident path.

  A layer cache (``rkv.models.kv.LayerCache``): :meth:`attend` appends a chunk and attends with
  the cache's tactic; its fill is static, so it runs eagerly (``jittable`` False).
  """

  window: KVBlock
  staging: KVBlock
  tail: KVBlock
  window_cells: int
  tile_cells: int
  capacity: int
  fill: int
  tactic: str = "stream"
  cpu_fraction: float | None = None

  jittable: ClassVar[bool] = False

  def __repr__(self):
    how = "" if self.tactic == "stream" else (
        f", tactic={self.tactic}" + ("" if self.cpu_fraction is None
                                     else f", cpu_fraction={self.cpu_fraction:g}"))
    return (f"RollingKV(B={self.batch}, K={self.num_kv_heads}, D={self.head_dim}, "
            f"dtype={np.dtype(self.dtype).name}, fill={self.fill}/{self.capacity}, "
            f"W={self.window_cells}, tile={self.tile_cells}, tail_tiles={self.n_full_tiles}/"
            f"{self.n_tail_tiles}, staged={self.n_staged}{how})")

  # --- derived sizes (all static) ---
  @property
  def batch(self) -> int:
    return self.window.k.shape[0]

  @property
  def num_kv_heads(self) -> int:
    return self.window.k.shape[2]

  @property
  def head_dim(self) -> int:
    return self.window.k.shape[3]

  @property
  def dtype(self):
    return self.window.k.dtype

  @property
  def quantized(self) -> bool:
    return self.window.k_scale is not None

  @property
  def scale_dtype(self):
    """The int8 scales' dtype (float32 or bfloat16); None for a float cache."""
    return None if self.window.k_scale is None else self.window.k_scale.dtype

  @property
  def tail_cells(self) -> int:
    """P: cells beyond the window (host tail plus the staging tile)."""
    return self.capacity - self.window_cells

  @property
  def n_tail_tiles(self) -> int:
    """Tiles allocated in the host tail (a last partial tile stays in staging)."""
    return len(self.tail.pos)

  @property
  def tail_tiles(self) -> tuple[KVBlock, ...]:
    """The host tail as one :class:`KVBlock` per tile (``k, v [B,tile,K,D]`` pinned_host, ...),
    all ``n_tail_tiles`` of them; the first ``n_full_tiles`` hold data."""
    return _tiles(self.tail)

  @property
  def window_fill(self) -> int:
    return min(self.fill, self.window_cells)

  @property
  def n_full_tiles(self) -> int:
    """Tail tiles holding data: the ones attention streams."""
    return max(self.fill - self.window_cells, 0) // self.tile_cells

  @property
  def n_staged(self) -> int:
    return max(self.fill - self.window_cells, 0) % self.tile_cells

  def nbytes(self, part: str) -> int:
    """Bytes of K, V and scales of ``part`` in ``("window", "staging", "tail")`` (the tail: all
    ``n_tail_tiles`` allocated tiles)."""
    block = getattr(self, part)
    leaves = jax.tree.leaves((block.k, block.v, block.k_scale, block.v_scale))
    return sum(x.nbytes for x in leaves)

  # --- constructors and writes ---
  @classmethod
  def from_arrays(cls, k, v, *, window_cells: int, k_pos=None, k_scale=None, v_scale=None,
                  capacity: int | None = None, tile_cells: int = DEFAULT_TILE_CELLS,
                  dtype=None, scale_dtype=None) -> "RollingKV":
    """A cache holding ``k, v [B,S,K,D]`` (cells in order), W of them on the device.

    ``k_pos [B,S]`` defaults to ``arange(S)``. ``capacity`` (default S) leaves room for appends.
    ``dtype`` (default k's) may be ``int8``: float K/V are then quantized per (token, KV head);
    int8 K/V must come with ``k_scale, v_scale [B,S,K]``. ``scale_dtype`` (int8 only: float32 or
    bfloat16) is the scales' dtype; by default bfloat16 for scales computed here and the given
    scales' own (bfloat16 kept, any other float as float32) for int8 K/V. Numpy inputs are
    assembled on the host and never visit the device beyond the window and staging cells.
    """
    return _assemble(k, v, k_pos, k_scale, v_scale, window_cells=window_cells,
                     capacity=capacity, tile_cells=tile_cells, dtype=dtype,
                     scale_dtype=scale_dtype, where="RollingKV.from_arrays")

  @classmethod
  def empty(cls, batch: int, capacity: int, num_kv_heads: int, head_dim: int, *,
            window_cells: int, dtype=jnp.bfloat16,
            tile_cells: int = DEFAULT_TILE_CELLS, scale_dtype=None) -> "RollingKV":
    """An empty cache for decoding: ``capacity`` cells, the first ``window_cells`` on the device;
    an int8 one keeps ``scale_dtype`` scales (default :func:`default_scale_dtype`: bfloat16)."""
    for name, val in (("batch", batch), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
      if not _is_int(val) or val < 1:
        raise ValueError(f"RollingKV.empty: {name} must be a positive int, got {val!r}")
    where = "RollingKV.empty"
    dt = check_kv_dtype(dtype, where, "dtype")
    sdt = check_scale_dtype(scale_dtype, dt, where)
    zeros = np.zeros((batch, 0, num_kv_heads, head_dim), dt)
    scales = np.zeros((batch, 0, num_kv_heads), sdt) if sdt is not None else None
    return _assemble(zeros, zeros, None, scales, scales, window_cells=window_cells,
                     capacity=capacity, tile_cells=tile_cells, dtype=dt, scale_dtype=sdt,
                     where=where)

  def append(self, k, v, pos=None, *, k_scale=None, v_scale=None) -> "RollingKV":
    """See :func:`append`."""
    return append(self, k, v, pos, k_scale=k_scale, v_scale=v_scale)

  def with_tactic(self, tactic: str, cpu_fraction: float | None = None) -> "RollingKV":
    """The same cache attended with ``tactic`` (``stream``, ``cpu`` or ``hybrid``; ``hybrid``
    with ``cpu_fraction`` of the tail's full tiles on the CPU, default 0.5). Shares the arrays."""
    where = "RollingKV.with_tactic"
    if tactic not in tactics.ROLLING:
      raise ValueError(f"{where}: tactic must be one of {tactics.ROLLING} (a 'head' layer is a "
                       f"rkv.HeadSplitKV), got {tactic!r}")
    return dataclasses.replace(self, tactic=tactic, cpu_fraction=tactics.check_cpu_fraction(
        cpu_fraction, tactic, where))

  # --- the layer-cache protocol (rkv.models.kv.LayerCache) ---
  @property
  def room(self) -> int:
    """Cells the cache can still take."""
    return self.capacity - self.fill

  def next_position(self) -> jax.Array:
    """The position after the last cell written: the default start of the next chunk."""
    return jnp.int32(self.fill)

  def attend(self, q, k, v, positions, *, merge=True, while_waiting=None, cpu_share=None,
             **kw) -> tuple[jax.Array, "RollingKV"]:
    """Appends the chunk's ``k, v`` at ``positions`` and returns ``(o, new cache)``: causal
    :func:`rkv.rolling_attention` of ``q`` over every cell with the cache's tactic (``kw``: its
    ``window``, ``softcap``, ``scale``, ``impl``, ``schedule``, ``lookahead``, ``cpu_threads``,
    ``staged``). ``merge=False`` returns ``(parts, new cache)`` instead: the unmerged ``(o, lse)``
    partials, for a caller that merges them in its next program
    (:func:`rkv.rolling.merge_parts`; ``layered_forward`` does, with ``post_attention``). A
    hybrid decode step starts its CPU share and requests its first streamed tiles before the
    append (:func:`rkv.rolling.early_cpu_share`, :func:`rkv.rolling.early_puts`;
    ``$RKV_EARLY_CPU`` / ``$RKV_EARLY_PUTS`` = 0 turn them off). ``while_waiting()``: host work
    to run while this thread would wait for the step's CPU share (``layered_forward`` puts the
    next layer's first tiles there), else after the step's own work; called once.
    ``cpu_share="external"`` (with ``merge=False``): the step's CPU tiles
    (:func:`rkv.rolling.cpu_share_tiles`) are attended by the caller's
    :class:`rkv.offload.host_share.HostShare`, started on this step's query already; the parts
    are then the device partial alone (:func:`rkv.rolling.device_part`), for the caller to merge
    with the share's. Only where :func:`rkv.rolling.external_share_applies`."""
    from rkv import rolling  # rolling builds on this module
    from rkv.attention import MAX_DECODE_QUERIES
    tactic, share = self.tactic, self.cpu_fraction
    if tactic in tactics.HOST_KERNEL and q.shape[1] > MAX_DECODE_QUERIES:
      # A prefill chunk's tail attention is compute-bound (T queries per key read), where the CPU
      # cores are ~100x slower than the GPU; the cpu/hybrid split is for the memory-bound decode
      # step. The chunk streams its tail instead (the same cells, merged the same way).
      tactic, share = "stream", None
    kw = dict(dict(window=None, softcap=None, scale=None, impl="auto",
                   schedule=rolling.DEFAULT_SCHEDULE, lookahead=rolling.DEFAULT_LOOKAHEAD,
                   cpu_threads=None, staged=None), **kw)
    # A decode step's CPU share and its first streamed tiles start before the append is
    # dispatched (rolling.early_cpu_share and rolling.early_puts say why); the append changes
    # neither unless it fills a tile, and then early_cpu_share declines.
    common = {n: kw[n] for n in ("window", "softcap", "scale", "impl", "schedule", "lookahead")}
    if cpu_share is not None:
      return self._attend_external(q, k, v, positions, merge=merge, cpu_share=cpu_share,
                                   while_waiting=while_waiting, kw=kw)
    cpu_future = rolling.early_cpu_share(self, q, positions, np.shape(k)[1], tactic=tactic,
                                         cpu_fraction=share, cpu_threads=kw["cpu_threads"],
                                         **common)
    if kw["staged"] is None:
      kw["staged"] = rolling.early_puts(self, q, tactic=tactic, cpu_fraction=share,
                                        schedule=kw["schedule"], lookahead=kw["lookahead"])
    with jax.profiler.TraceAnnotation("rkv.append"):
      new = self.append(k, v, positions)
    out = rolling._rolling_attention(q, new, q_pos=positions, causal=True, tactic=tactic,
                                     cpu_fraction=share, cpu_future=cpu_future, merge=merge,
                                     while_waiting=while_waiting, **kw)
    return (out[0] if merge else out), new

  def _attend_external(self, q, k, v, positions, *, merge, cpu_share, while_waiting, kw):
    """:meth:`attend` with ``cpu_share="external"``: the device side only."""
    from rkv import rolling
    where = "RollingKV.attend"
    if cpu_share != "external":
      raise ValueError(f"{where}: cpu_share must be None or 'external', got {cpu_share!r}")
    if merge:
      raise ValueError(f"{where}: cpu_share='external' returns the device partial unmerged "
                       f"(merge=False): the caller merges it with its share's")
    if kw["cpu_threads"] is not None:
      raise ValueError(f"{where}: cpu_threads is the external share's, not attend's")
    if not rolling.external_share_applies(self, np.shape(k)[1], schedule=kw["schedule"]):
      raise ValueError(f"{where}: cpu_share='external' needs a cpu / hybrid decode step with "
                       f"tiles on the CPU whose append fills no tile (tactic={self.tactic!r}, "
                       f"{np.shape(k)[1]} new cells, fill={self.fill}); see "
                       f"rkv.rolling.external_share_applies")
    staged = kw["staged"]
    if staged is None:
      staged = rolling.early_puts(self, q, tactic=self.tactic, cpu_fraction=self.cpu_fraction,
                                  schedule=kw["schedule"], lookahead=kw["lookahead"])
    with jax.profiler.TraceAnnotation("rkv.append"):
      new = self.append(k, v, positions)
    part = rolling.device_part(q, new, q_pos=positions, window=kw["window"],
                               softcap=kw["softcap"], scale=kw["scale"], impl=kw["impl"],
                               lookahead=kw["lookahead"], staged=staged)
    if while_waiting is not None:
      while_waiting()
    return (part,), new

  def streamed_tiles(self) -> tuple:
    """The host tiles a step streams, in order, for a prefetcher (``()`` for ``cpu``)."""
    from rkv import rolling
    return rolling.streamed_tiles(self)

  def cells(self) -> dict:
    """All written cells in order as numpy arrays ``[B,fill,...]`` (None for absent scales).

    A debugging/IO view: it copies the whole tail to host numpy.
    """
    out = {}
    for name in _ARRAY_NAMES:
      rows = [[] for _ in range(self.batch)]
      for b, chunk in _cell_chunks(self, name):
        rows[b].append(chunk)
      x = getattr(self.window, name)
      out[name] = None if x is None else np.stack([
          np.concatenate(r) if r else np.zeros((0,) + x.shape[2:], x.dtype) for r in rows])
    return out


jax.tree_util.register_dataclass(
    RollingKV, data_fields=["window", "staging", "tail"],
    meta_fields=["window_cells", "tile_cells", "capacity", "fill", "tactic", "cpu_fraction"])


def _tiles(tail: KVBlock) -> tuple[KVBlock, ...]:
  """A tail of per-field tuples → one :class:`KVBlock` per tile."""
  n = len(tail.pos)
  get = lambda x, i: None if x is None else x[i]
  return tuple(KVBlock(k=tail.k[i], v=tail.v[i], pos=tail.pos[i], k_scale=get(tail.k_scale, i),
                       v_scale=get(tail.v_scale, i)) for i in range(n))


def _untile(tiles, quantized: bool) -> KVBlock:
  """One :class:`KVBlock` per tile → a tail of per-field tuples."""
  field = lambda name: tuple(getattr(t, name) for t in tiles)
  return KVBlock(k=field("k"), v=field("v"), pos=field("pos"),
                 k_scale=field("k_scale") if quantized else None,
                 v_scale=field("v_scale") if quantized else None)


def memory_kinds(kv: RollingKV) -> dict[str, str | None]:
  """``"part.field" -> memory kind`` for every array of the cache (for tests and debugging); the
  tail's per-tile arrays are named ``"tail.field[i]"``."""
  out = {}
  for part in ("window", "staging", "tail"):
    for name in _ARRAY_NAMES:
      x = getattr(getattr(kv, part), name)
      if x is None:
        continue
      if part == "tail":
        for i, tile in enumerate(x):
          out[f"tail.{name}[{i}]"] = memory.memory_kind(tile)
      else:
        out[f"{part}.{name}"] = memory.memory_kind(x)
  return out


# ----------------------------------------------------------------------------------------------
# Validation helpers
# ----------------------------------------------------------------------------------------------
def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def check_kv_dtype(dtype, where: str, name: str) -> np.dtype:
  """``dtype`` as a NumPy dtype if a cache can hold it (KV_DTYPES), else a ValueError naming ``name``."""
  try:
    dt = np.dtype(jnp.dtype(dtype))
  except TypeError as e:
    raise ValueError(f"{where}: {name} must be one of {KV_DTYPES}, got {dtype!r}") from e
  if dt.name not in KV_DTYPES:
    raise ValueError(f"{where}: {name} must be one of {KV_DTYPES}, got {dt.name}")
  return dt


def check_scale_dtype(scale_dtype, kv_dtype, where: str, *, given=None) -> np.dtype | None:
  """The int8 scales' dtype a cache of ``kv_dtype`` keeps: None for a float cache (a
  ``scale_dtype`` given there is refused), else ``scale_dtype`` if given (one of SCALE_DTYPES),
  else the dtype of the ``given`` scales (bfloat16 kept, any other float as float32), else
  :func:`default_scale_dtype`."""
  if np.dtype(kv_dtype) != np.dtype(np.int8):
    if scale_dtype is not None:
      raise ValueError(f"{where}: scale_dtype is only valid for an int8 cache, got dtype "
                       f"{np.dtype(kv_dtype).name}")
    return None
  if scale_dtype is None:
    if given is not None and np.dtype(given) == np.dtype(jnp.bfloat16):
      return np.dtype(jnp.bfloat16)
    return np.dtype(np.float32) if given is not None else default_scale_dtype()
  try:
    sdt = np.dtype(jnp.dtype(scale_dtype))
  except TypeError as e:
    raise ValueError(f"{where}: scale_dtype must be one of {SCALE_DTYPES}, got "
                     f"{scale_dtype!r}") from e
  if sdt.name not in SCALE_DTYPES:
    raise ValueError(f"{where}: scale_dtype must be one of {SCALE_DTYPES}, got {sdt.name}")
  return sdt


def _concrete(x) -> np.ndarray | None:
  try:
    return np.asarray(x)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return None


def _check_positions(pos, want: tuple[int, int], where: str, name: str, *,
                     read_device: bool = True):
  """Shape, dtype and (for host values, or device values with ``read_device``) range.

  ``append`` passes ``read_device=False``: reading a device array back is a host sync, and one
  per layer and token made the whole decode loop wait for the GPU at every layer (the Python
  thread could no longer run ahead of the device)."""
  if tuple(np.shape(pos)) != want:
    raise ValueError(f"{where}: {name} must have shape [B,S]={want}, got {tuple(np.shape(pos))}")
  dtype = pos.dtype if hasattr(pos, "dtype") else np.asarray(pos).dtype
  if not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"{where}: {name} must be an integer array, got {dtype}")
  values = None if isinstance(pos, jax.Array) and not read_device else _concrete(pos)
  if values is not None and values.size:
    lo, hi = int(values.min()), int(values.max())
    if lo < -1 or hi > np.iinfo(np.int32).max:
      raise ValueError(f"{where}: {name} values must be in [-1, 2**31-1] (-1 marks an empty slot),"
                       f" got range [{lo}, {hi}]")


def check_live_parts(kv: RollingKV, where: str, name: str = "kv") -> None:
  """A stale cache (one an ``append`` already consumed) gives a ValueError saying to use the
  cache returned by the last append. Only the window and staging are checked: they are what
  ``append`` donates, a whole block at a time (every array of it), so each block's ``k`` stands
  for the block: two checks whatever the tail holds (this runs per layer and token; walking the
  blocks' leaves cost 4.6 us a call)."""
  for block in (kv.window, kv.staging):
    validation.check_not_deleted(where, name, block.k)


def _check_kv(k, v, k_scale, v_scale, where: str):
  for name, x in (("k", k), ("v", v)):
    if len(np.shape(x)) != 4:
      raise ValueError(f"{where}: {name} must be rank 4 [B,S,K,D], got shape {np.shape(x)}")
  if np.shape(v) != np.shape(k):
    raise ValueError(f"{where}: v shape {np.shape(v)} must equal k shape {np.shape(k)}")
  if np.dtype(k.dtype) != np.dtype(v.dtype):
    raise ValueError(f"{where}: v dtype {v.dtype} must equal k dtype {k.dtype}")
  check_kv_dtype(k.dtype, where, "k dtype")
  b, s, kh, _ = np.shape(k)
  if np.dtype(k.dtype) == np.dtype(np.int8):
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
      if sc is None or tuple(np.shape(sc)) != (b, s, kh):
        raise ValueError(f"{where}: int8 k/v need {name} of shape [B,S,K]={(b, s, kh)}, got "
                         f"{None if sc is None else tuple(np.shape(sc))}")
  elif k_scale is not None or v_scale is not None:
    raise ValueError(f"{where}: k_scale/v_scale are only valid with int8 k/v, got {k.dtype}")


def _common_scale_dtype(k_scale, v_scale, where: str) -> np.dtype:
  """The dtype of given int8 scales: both float (one dtype), else a ValueError."""
  dtype_of = lambda x: np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype
  kd, vd = dtype_of(k_scale), dtype_of(v_scale)
  if kd != vd:
    raise ValueError(f"{where}: k_scale ({kd.name}) and v_scale ({vd.name}) must share one dtype")
  if not (np.issubdtype(kd, np.floating) or kd == np.dtype(jnp.bfloat16)):
    raise ValueError(f"{where}: k_scale/v_scale must be float arrays, got {kd.name}")
  return kd


def quantize_int8(x, scale_dtype=jnp.float32):
  """Symmetric int8 per (token, KV head): ``x [...,K,D]`` → (int8, scale ``[...,K]`` of
  ``scale_dtype``, float32 or bfloat16).

  The same formula as ``tests/numpy_reference.quantize_int8`` (amax / 127 rounded to the scale's
  dtype, then x over that scale rounded half to even); XLA's float32 division on CPU is not
  always correctly rounded, so a scale may differ from numpy's by an ulp.

  The cells are quantized against the *stored* (rounded) scale, so ``q * scale`` is within half a
  step of x whatever the scale's dtype. A bfloat16 scale is within 2**-8 (relative) of amax / 127,
  so amax / scale <= 127 / (1 - 2**-8) < 127.5 rounds to at most 127: no cell is clipped.
  """
  x = jnp.asarray(x, jnp.float32)
  amax = jnp.max(jnp.abs(x), axis=-1)
  # amax == 0 (an all-zero row) gets scale 1; a NaN or inf amax keeps a NaN / inf scale, so a
  # non-finite row that reached here (device values, not checked: see check_quantizable) gives
  # NaN where attention reads it instead of a finite, wrong row (``amax > 0`` made NaN's scale 1).
  scale = jnp.where(amax == 0, 1.0, amax / 127.0).astype(jnp.float32).astype(scale_dtype)
  q = jnp.clip(jnp.round(x / scale.astype(jnp.float32)[..., None]), -127, 127).astype(jnp.int8)
  return q, scale


@functools.partial(jax.jit, static_argnames="scale_dtype")
def quantize_pair(k, v, scale_dtype=jnp.float32):
  """:func:`quantize_int8` of ``k`` and ``v`` as one program: ``((k8, k_scale), (v8, v_scale))``.

  What appends call per layer and token: op by op the two quantizations were a dozen eager
  dispatches, 1.57 ms an append against 0.24 for bf16 on the dev box's CPU and 5.1 ms on the H200
  (the 2M int8 trace, ``benchmarks/results/beyond_hbm/session3/trace_2097152.json``)."""
  return quantize_int8(k, scale_dtype), quantize_int8(v, scale_dtype)


def check_quantizable(where: str, name: str, x, pos=None) -> None:
  """int8 holds finite values only: a NaN or inf in ``x [B,S,K,D]`` is refused with the cell named
  (batch row, cell index and its position in ``pos [B,S]`` if given, KV head).

  ``x`` must be host data or a value the caller reads back anyway; ``append`` passes device
  values on without a check (a read-back per layer and token would sync the decode loop), and
  :func:`quantize_int8` then keeps the row non-finite rather than wrong."""
  x = np.asarray(x)
  finite = np.isfinite(x)
  if finite.all():
    return
  b, j, h, _ = (int(i) for i in np.argwhere(~finite)[0])
  at = "" if pos is None else f", position {int(np.asarray(pos)[b, j])}"
  raise ValueError(f"{where}: {name} holds {x[b, j, h][~finite[b, j, h]][0]} at batch row {b}, "
                   f"cell {j}{at}, kv head {h}: an int8 cache cannot represent a non-finite value "
                   f"(its per-(token, head) scale would be NaN or inf); "
                   f"{int((~finite).any(-1).sum())} cell-head(s) affected")


def _tail_layout(window_cells, capacity, tile_cells):
  p = capacity - window_cells
  return p // tile_cells, min(tile_cells, p)  # (tail tiles allocated, staging cells)


def _tail_bytes(batch, capacity, kh, d, window_cells, tile_cells, dt, sdt) -> int:
  n_tiles, _ = _tail_layout(window_cells, capacity, tile_cells)
  cells = n_tiles * tile_cells * batch * kh
  scales = 2 * sdt.itemsize * cells if sdt is not None else 0
  return 2 * cells * d * dt.itemsize + scales


# ----------------------------------------------------------------------------------------------
# Assembly (from_arrays, empty, load)
# ----------------------------------------------------------------------------------------------
def _assemble(k, v, k_pos, k_scale, v_scale, *, window_cells, capacity, tile_cells, dtype,
              where, scale_dtype=None) -> RollingKV:
  _check_kv(k, v, k_scale, v_scale, where)
  b, s, kh, d = np.shape(k)
  capacity = s if capacity is None else capacity
  if not _is_int(capacity) or capacity < 1:
    raise ValueError(f"{where}: capacity must be a positive int, got {capacity!r}")
  if not _is_int(window_cells) or window_cells < 0:
    raise ValueError(f"{where}: window_cells must be a non-negative int, got {window_cells!r}")
  if window_cells > capacity:
    raise ValueError(f"{where}: window_cells={window_cells} must be <= capacity={capacity}")
  if not _is_int(tile_cells) or tile_cells < 1:
    raise ValueError(f"{where}: tile_cells must be a positive int, got {tile_cells!r}")
  if s > capacity:
    raise ValueError(f"{where}: k holds S={s} cells, more than capacity={capacity}")
  src_dt = np.dtype(k.dtype)
  dt = src_dt if dtype is None else check_kv_dtype(dtype, where, "dtype")
  given = None if k_scale is None or src_dt != np.dtype(np.int8) else _common_scale_dtype(
      k_scale, v_scale, where)
  sdt = check_scale_dtype(scale_dtype, dt, where, given=given)
  memory.check_host_pool(_tail_bytes(b, capacity, kh, d, window_cells, tile_cells, dt, sdt),
                         where=where, argument="capacity")
  if k_pos is None:
    k_pos = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
  _check_positions(k_pos, (b, s), where, "k_pos")

  if dt == np.dtype(np.int8) and src_dt != dt:
    # Construction reads every cell to the host anyway: refuse non-finite ones by name.
    check_quantizable(where, "k", k, k_pos)
    check_quantizable(where, "v", v, k_pos)
    (k, k_scale), (v, v_scale) = quantize_int8(k, sdt), quantize_int8(v, sdt)
  elif dt != np.dtype(np.int8) and src_dt == np.dtype(np.int8):
    raise ValueError(f"{where}: int8 k/v cannot fill a {dt.name} cache; pass dtype=int8")
  host = lambda x: None if x is None else np.asarray(x)
  k, v, k_scale, v_scale = host(k), host(v), host(k_scale), host(v_scale)
  k, v = k.astype(dt, copy=False), v.astype(dt, copy=False)
  if k_scale is not None:
    k_scale, v_scale = k_scale.astype(sdt, copy=False), v_scale.astype(sdt, copy=False)
  pos = np.asarray(k_pos).astype(np.int32)
  arrays = dict(k=k, v=v, pos=pos, k_scale=k_scale, v_scale=v_scale)

  n_tiles, staging_cells = _tail_layout(window_cells, capacity, tile_cells)
  wf = min(s, window_cells)
  n_full = max(s - window_cells, 0) // tile_cells
  t0, t1 = wf, wf + n_full * tile_cells  # cells [t0, t1) are whole tail tiles, the rest staged

  def part(x, lo, hi, cells, fill_value):
    """Cells [lo, hi) of x into a fresh [B, cells, ...] buffer, the rest empty."""
    out = np.full((b, cells) + x.shape[2:], fill_value, x.dtype)
    out[:, :hi - lo] = x[:, lo:hi]
    return out

  empties = {}

  def tail_tile(x, i, fill_value):
    """Tile i of the tail: cells of x, or an empty tile (one numpy buffer per field, copied)."""
    if i < n_full:
      lo = t0 + i * tile_cells
      return np.ascontiguousarray(x[:, lo:lo + tile_cells])
    key = (x.dtype.str, x.shape[2:], fill_value)
    if key not in empties:
      empties[key] = np.full((b, tile_cells) + x.shape[2:], fill_value, x.dtype)
    return empties[key]

  blocks = {}
  for part_name in ("window", "staging"):
    fields = {}
    for name, x in arrays.items():
      if x is None:
        fields[name] = None
        continue
      empty = -1 if name == "pos" else 0
      if part_name == "window":
        fields[name] = memory.to_device(part(x, 0, wf, window_cells, empty))
      else:
        fields[name] = memory.to_device(part(x, t1, s, staging_cells, empty) if s > t1 else
                                        np.full((b, staging_cells) + x.shape[2:], empty, x.dtype))
    blocks[part_name] = KVBlock(**fields)
  tiles = []
  for i in range(n_tiles):
    fields = {}
    for name, x in arrays.items():
      if x is None:
        fields[name] = None
        continue
      # Positions stay on the device (see the module docstring); K/V/scales go to pinned host,
      # one array per tile.
      place = memory.to_device if name == "pos" else memory.to_host
      fields[name] = place(tail_tile(x, i, -1 if name == "pos" else 0))
    tiles.append(KVBlock(**fields))
  tail = _untile(tiles, arrays["k_scale"] is not None)
  return RollingKV(window=blocks["window"], staging=blocks["staging"], tail=tail,
                   window_cells=window_cells, tile_cells=tile_cells, capacity=capacity, fill=s)


# ----------------------------------------------------------------------------------------------
# Writes: append → window / staging, flush → one host tile
# ----------------------------------------------------------------------------------------------
def write_block(block: KVBlock, new: KVBlock, offset) -> KVBlock:
  """``new [B,m,...]`` written at cell ``offset`` of a device block (traced: the body of the
  cache's writers and of :mod:`rkv.models.fused_decode`'s head program)."""
  return jax.tree.map(lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, y, offset, axis=1),
                      block, new)


# Writes ``new`` into a device block in place (the block donated).
_write_cells = jax.jit(write_block, donate_argnums=0)


@functools.lru_cache(maxsize=256)
def device_offset(offset: int) -> jax.Array:
  """Cell ``offset`` as an int32 device scalar, kept for the next caller.

  Why: a host scalar handed to a jitted writer is a fresh host-to-device transfer, which PJRT
  enqueues on its async work threads, and the writer's launch blocks until that transfer is
  enqueued. Behind the tile puts of a hybrid layer that cost 0.24 ms of the main thread per
  append, and 1.1 ms with the host share's kernel on 15 cores beside it (2M int8 on the H200,
  ``benchmarks/results/beyond_hbm/session19/b/``, the ``jit__write_quantized`` launches). Every
  layer of a decode step writes at the same offset, so one transfer serves the step's layers.
  Built eagerly even when called under a trace (never a tracer in the cache); uncommitted, so a
  writer on another device takes it there."""
  with jax.ensure_compile_time_eval():
    return jax.device_put(np.int32(offset))


@functools.partial(jax.jit, static_argnames="tile")
def _split_tiles(block: KVBlock, *, tile: int) -> tuple[KVBlock, ...]:
  """``block [B,w*tile,...]`` (device) → w device blocks ``[B,tile,...]`` (fresh buffers)."""
  w = block.k.shape[1] // tile
  return tuple(jax.tree.map(lambda x: x[:, i * tile:(i + 1) * tile], block) for i in range(w))


def _tile_to_host(tile: KVBlock) -> KVBlock:
  """One device tile → a tail tile: K/V/scales to ``pinned_host`` by eager ``jax.device_put``
  (PJRT's async device→host copy; never touches the tail), positions stay on the device."""
  k, v, k_scale, v_scale = memory.to_host((tile.k, tile.v, tile.k_scale, tile.v_scale))
  return KVBlock(k=k, v=v, pos=tile.pos, k_scale=k_scale, v_scale=v_scale)


def _put_tiles(tail: KVBlock, start: int, tiles) -> KVBlock:
  """The tail with tiles ``start, start+1, ...`` replaced by ``tiles`` (tail tiles): new tuples
  sharing every other leaf."""
  out = list(_tiles(tail))
  if not 0 <= start <= len(out) - len(tiles):
    raise ValueError(f"flush: tile index {start} (+{len(tiles)}) is outside the tail's "
                     f"{len(out)} tiles")
  out[start:start + len(tiles)] = tiles
  return _untile(out, tail.k_scale is not None)


def flush(tail: KVBlock, staging: KVBlock, index: int) -> tuple[KVBlock, KVBlock]:
  """Moves the full staging tile to host tail tile ``index``; returns (tail, emptied staging).

  O(tile) by construction: one ``jax.device_put`` of the staging K/V (and scales) to pinned host,
  whose result replaces leaf ``index`` of the tail's tuples. The tail is not an input of anything:
  the other tiles stay the same arrays. The staging positions become the tile's (no copy).
  """
  tail = _put_tiles(tail, index, [_tile_to_host(staging)])
  # Emptying is just positions: stale K/V under pos = -1 never reach attention. A fresh array,
  # because the old one now belongs to the tail tile.
  return tail, dataclasses.replace(staging, pos=_emptied_positions(staging.pos))


@jax.jit
def _emptied_positions(pos):
  # Jitted, so -1 is a constant of the program: eager, it was a host scalar sent to the device
  # at every flush (tests/transfer_guard_test.py).
  return jnp.full_like(pos, -1)


def _take(block: KVBlock, lo: int, hi: int) -> KVBlock:
  if lo == 0 and hi == block.k.shape[1]:
    return block  # the whole block (a decode token): no slicing ops to dispatch
  return jax.tree.map(lambda x: x[:, lo:hi], block)


def _as(x, dtype):
  # jnp.asarray dispatches a conversion even when nothing changes; appends run per layer and
  # token, so arrays already on the device in the right dtype pass through untouched.
  if isinstance(x, jax.Array) and x.dtype == dtype:
    return x
  return jnp.asarray(x, dtype)


@functools.partial(jax.jit, donate_argnums=0, static_argnames="scale_dtype")
def _write_quantized(block: KVBlock, k, v, pos, offset, *, scale_dtype) -> KVBlock:
  """:func:`quantize_pair` of float ``k, v [B,m,K,D]`` and :func:`_write_cells` of the result at
  ``offset`` as one program. A decode token's append into an int8 cache was two dispatches, and
  each cost 0.3-0.7 ms of host time on the H200 host at 2M int8 (the traced step in
  ``benchmarks/results/beyond_hbm/session17/b/``: 9 programs a layer in the layer chain)."""
  (k8, ks), (v8, vs) = quantize_int8(k, scale_dtype), quantize_int8(v, scale_dtype)
  return write_block(block, KVBlock(k=k8, v=v8, pos=pos, k_scale=ks, v_scale=vs), offset)


def _new_cells(kv: RollingKV, k, v, pos, k_scale, v_scale, where: str, *,
               quantize: bool = True) -> KVBlock:
  """Validates appended cells and brings them to the cache's dtype on the device.

  ``quantize=False`` (float cells for an int8 cache, quantized by the caller's
  :func:`_write_quantized`): the cells stay float, the scales None."""
  _check_kv(k, v, k_scale, v_scale, where)
  b, t, kh, d = np.shape(k)
  if (b, kh, d) != (kv.batch, kv.num_kv_heads, kv.head_dim):
    raise ValueError(f"{where}: k must have shape [B,T,K,D] with B={kv.batch}, "
                     f"K={kv.num_kv_heads}, D={kv.head_dim}, got {np.shape(k)}")
  if kv.fill + t > kv.capacity:
    raise ValueError(f"{where}: appending T={t} cells to a cache holding {kv.fill} would exceed "
                     f"its capacity={kv.capacity}")
  if pos is None:  # host numpy: one transfer instead of two eager device ops
    pos = np.broadcast_to(np.arange(kv.fill, kv.fill + t, dtype=np.int32), (b, t))
  _check_positions(pos, (b, t), where, "pos", read_device=False)
  src_int8 = np.dtype(k.dtype) == np.dtype(np.int8)
  if kv.quantized and not src_int8:
    for name, x in (("k", k), ("v", v)):
      if validation.host_values(x) is not None:  # host cells only: no device read-back per step
        check_quantizable(where, name, x, pos)
    if not quantize:
      return KVBlock(k=k, v=v, pos=_as(pos, jnp.int32))
    (k, k_scale), (v, v_scale) = quantize_pair(k, v, scale_dtype=kv.scale_dtype)
  elif not kv.quantized and src_int8:
    raise ValueError(f"{where}: int8 k/v cannot be appended to a {kv.dtype} cache")
  elif kv.quantized:
    given = _common_scale_dtype(k_scale, v_scale, where)
    if given != kv.scale_dtype and kv.scale_dtype != np.dtype(np.float32):
      # float32 scales into a bfloat16 cache would be rounded: the int8 cells were quantized
      # against the exact ones, so the stored pair would be silently off by up to 2**-8.
      held = np.dtype(kv.scale_dtype).name
      raise ValueError(f"{where}: k_scale/v_scale are {given.name} but this cache holds {held} "
                       f"scales; pass {held} scales (or float k/v to quantize here), or build the "
                       f"cache with scale_dtype=float32")
  new = KVBlock(k=_as(k, kv.dtype), v=_as(v, kv.dtype), pos=_as(pos, jnp.int32),
                k_scale=None if k_scale is None else _as(k_scale, kv.scale_dtype),
                v_scale=None if v_scale is None else _as(v_scale, kv.scale_dtype))
  return new


def append(kv: RollingKV, k, v, pos=None, *, k_scale=None, v_scale=None) -> RollingKV:
  """Appends ``k, v [B,T,K,D]`` (one token at decode, a chunk at prefill); returns the new cache.

  ``pos [B,T]`` defaults to ``fill + arange(T)``; -1 marks a padding cell (ragged batches).
  Host positions (numpy, lists) are range-checked; positions already on the device are checked
  for shape and dtype only (reading them back would sync the host with the device every step).
  Cells go to the window while it has room, then to the staging tile; a full staging tile is
  flushed to the host tail (:func:`flush`), and whole tiles of a long chunk go to the host tail
  directly, each replacing one tail leaf. The cost is O(T + tile) whatever the tail holds. The
  window and staging buffers written are donated: use the returned cache.
  """
  if not isinstance(kv, RollingKV):
    raise ValueError(f"append: kv must be a RollingKV, got {type(kv).__name__}")
  check_live_parts(kv, "append")
  w, tile, fill = kv.window_cells, kv.tile_cells, kv.fill
  window, staging, tail = kv.window, kv.staging, kv.tail
  shape = np.shape(k)
  t = shape[1] if len(shape) == 4 else 0  # anything else: the general path's checks name it
  into_window = fill + t <= w
  if (t and kv.quantized and np.dtype(getattr(k, "dtype", np.int8)) != np.dtype(np.int8) and
      (into_window or (fill >= w and (fill - w) % tile + t <= tile))):
    # Float cells that land in one device block (a decode token, a short chunk): quantized and
    # written by one program.
    new = _new_cells(kv, k, v, pos, k_scale, v_scale, "append", quantize=False)
    offset = fill if into_window else (fill - w) % tile
    block = _write_quantized(window if into_window else staging, new.k, new.v, new.pos,
                             device_offset(offset), scale_dtype=kv.scale_dtype)
    if into_window:
      return dataclasses.replace(kv, window=block, fill=fill + t)
    if offset + t == tile:
      tail, block = flush(tail, block, (fill + t - w) // tile - 1)
    return dataclasses.replace(kv, staging=block, tail=tail, fill=fill + t)
  new = _new_cells(kv, k, v, pos, k_scale, v_scale, "append")
  t = new.k.shape[1]
  i = 0
  m = max(0, min(t, w - fill))
  if m:
    window = _write_cells(window, _take(new, 0, m), device_offset(fill))
    fill, i = fill + m, m
  while i < t:
    tail_fill = fill - w
    staged = tail_fill % tile
    whole = (t - i) // tile
    if staged == 0 and whole:
      # A long chunk: whole tiles skip the staging buffer (O(chunk), never O(tail)).
      moved = [_tile_to_host(x) for x in _split_tiles(_take(new, i, i + whole * tile), tile=tile)]
      tail = _put_tiles(tail, tail_fill // tile, moved)
      fill, i = fill + whole * tile, i + whole * tile
      continue
    m = min(tile - staged, t - i)
    staging = _write_cells(staging, _take(new, i, i + m), device_offset(staged))
    fill, i = fill + m, i + m
    if staged + m == tile:
      tail, staging = flush(tail, staging, (fill - w) // tile - 1)
  return dataclasses.replace(kv, window=window, staging=staging, tail=tail, fill=fill)


# ----------------------------------------------------------------------------------------------
# Save / load
# ----------------------------------------------------------------------------------------------
def _cell_chunks(kv: RollingKV, name: str):
  """Yields ``(b, cells)`` of array ``name`` in file order: row by row, each row's window cells,
  tail tiles, staged cells."""
  wx, tx, sx = (getattr(getattr(kv, p), name) for p in ("window", "tail", "staging"))
  if wx is None:
    return
  wf, n_full, ns = kv.window_fill, kv.n_full_tiles, kv.n_staged
  # Plain copies of whole tiles to numpy: slicing a pinned_host array eagerly would be host
  # compute on GPU.
  tail = [np.asarray(tx[i]) for i in range(n_full)]
  window = np.asarray(wx) if wf else None
  staging = np.asarray(sx) if ns else None
  for b in range(kv.batch):
    if wf:
      yield b, window[b, :wf]
    for i in range(n_full):
      yield b, tail[i][b]
    if ns:
      yield b, staging[b, :ns]


def save(kv: RollingKV, directory: str) -> None:
  """Writes the cache's cells (window and tail alike, in cell order) to ``directory``, atomically.

  Files: ``k.bin, v.bin, pos.bin`` (+ ``k_scale.bin, v_scale.bin`` for int8), raw C-order
  ``[B,fill,...]``, and ``manifest.json`` (format name and version, dtype, W, capacity, tile,
  fill, shapes, and the byte size and CRC-32 of each file).

  Atomic: the save is written into a fresh temporary directory beside ``directory`` (a unique
  name per save), fsynced, and only then put in place by one rename (an atomic exchange with the
  previous save where Linux offers it). So ``directory`` always holds a complete save: the
  previous one until the new one is complete, whatever fails or kills the writer meanwhile;
  concurrent saves into one directory each install a whole save, the last one wins. A failed save
  raises ``ValueError`` saying why and leaves the previous save as it was (a killed writer leaves
  its ``.<name>.saving-*`` directory beside it). Because the whole directory is replaced, a
  directory holding anything besides an rkv save is refused rather than emptied.
  """
  if not isinstance(kv, RollingKV):
    raise ValueError(f"save: kv must be a RollingKV, got {type(kv).__name__}")
  validation.check_live("save", "kv", kv)  # before anything is written
  atomic_io.save_atomically(directory, functools.partial(_write_save, kv), where="save",
                            what="the cache", kind="an rkv save", names=_save_file_names())


def _save_file_names() -> set[str]:
  # manifest.json.tmp: the temporary manifest of saves before atomic saving.
  return {"manifest.json", "manifest.json.tmp"} | {f"{n}.bin" for n in _ARRAY_NAMES}


def _write_save(kv: RollingKV, out: str) -> None:
  """Every array file, then the manifest, into the fresh directory ``out``; all fsynced."""
  files = {}
  for name in _ARRAY_NAMES:
    block = getattr(kv.window, name)
    if block is None:
      continue
    crc, nbytes = 0, 0
    with open(os.path.join(out, f"{name}.bin"), "xb") as f:
      for _, chunk in _cell_chunks(kv, name):
        data = np.ascontiguousarray(chunk).tobytes()
        crc, nbytes = zlib.crc32(data, crc), nbytes + len(data)
        f.write(data)
      f.flush()
      os.fsync(f.fileno())
    files[name] = dict(file=f"{name}.bin", dtype=np.dtype(block.dtype).name,
                       shape=[kv.batch, kv.fill] + list(block.shape[2:]), bytes=nbytes, crc32=crc)
  manifest = dict(format=FORMAT, version=FORMAT_VERSION, dtype=np.dtype(kv.dtype).name,
                  window_cells=kv.window_cells, capacity=kv.capacity, tile_cells=kv.tile_cells,
                  fill=kv.fill, batch=kv.batch, num_kv_heads=kv.num_kv_heads,
                  head_dim=kv.head_dim, positions="pos.bin", arrays=files)
  with open(os.path.join(out, "manifest.json"), "x") as f:
    json.dump(manifest, f, indent=1)
    f.flush()
    os.fsync(f.fileno())


def read_manifest(directory: str, fmt: str, version: int | tuple[int, ...], *, where: str,
                  what: str) -> tuple[str, dict]:
  """``(path, manifest)`` of ``directory/manifest.json`` (a cache's, a pool's or a block cache's
  save), after checking it is JSON of format ``fmt`` at ``version`` (or one of them);
  ``ValueError`` naming the file otherwise (``what``: the kind of save, for the message)."""
  versions = (version,) if isinstance(version, int) else tuple(version)
  path = os.path.join(directory, "manifest.json")
  if not os.path.isfile(path):
    raise ValueError(f"{where}: {directory!r} has no manifest.json: not {what}")
  try:
    with open(path) as f:
      manifest = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{where}: {path} is not a valid JSON manifest: {e}") from e
  if not isinstance(manifest, dict) or manifest.get("format") != fmt:
    raise ValueError(f"{where}: {path} is not an {fmt} manifest (format="
                     f"{manifest.get('format') if isinstance(manifest, dict) else None!r})")
  if manifest.get("version") not in versions:
    raise ValueError(f"{where}: {path} has format version {manifest.get('version')!r}, this rkv "
                     f"reads version {' or '.join(map(str, versions))}")
  return path, manifest


def load(directory: str, window_cells: int | None = None, *, capacity: int | None = None,
         tile_cells: int | None = None, verify: bool = True) -> RollingKV:
  """Reads a cache written by :func:`save`, split at ``window_cells`` (default: the saved W).

  ``verify`` checks each file's CRC-32 (reads every byte once). A missing, truncated or foreign
  file raises ``ValueError`` naming it.
  """
  where = "load"
  path, manifest = read_manifest(directory, FORMAT, FORMAT_VERSION, where=where,
                                 what="an rkv cache directory")
  try:
    fill, b = int(manifest["fill"]), int(manifest["batch"])
    kh, d = int(manifest["num_kv_heads"]), int(manifest["head_dim"])
    dt = check_kv_dtype(manifest["dtype"], where, "manifest dtype")
    specs = manifest["arrays"]
    want = dict(k=((b, fill, kh, d), dt), v=((b, fill, kh, d), dt), pos=((b, fill), np.int32))
    if dt == np.dtype(np.int8):
      # The scales' dtype is the save's (float32 before bfloat16 scales, either since).
      sdt = check_scale_dtype(specs["k_scale"]["dtype"], dt, where)
      want.update(k_scale=((b, fill, kh), sdt), v_scale=((b, fill, kh), sdt))
    arrays = {}
    for name, (shape, adt) in want.items():
      spec = specs[name]
      if tuple(spec["shape"]) != shape or np.dtype(jnp.dtype(spec["dtype"])) != np.dtype(adt):
        raise ValueError(f"{where}: manifest entry {name} has shape {spec['shape']} dtype "
                         f"{spec['dtype']}, expected {list(shape)} {np.dtype(adt).name}")
      fpath = os.path.join(directory, spec["file"])
      nbytes = int(np.prod(shape)) * np.dtype(adt).itemsize
      if not os.path.isfile(fpath):
        raise ValueError(f"{where}: missing array file {fpath}")
      size = os.path.getsize(fpath)
      if size != nbytes or int(spec["bytes"]) != nbytes:
        raise ValueError(f"{where}: {fpath} has {size} bytes, expected {nbytes}: truncated or "
                         f"foreign file")
      if verify and atomic_io.file_crc32(fpath) != int(spec["crc32"]):
        raise ValueError(f"{where}: {fpath} fails its CRC-32 check: corrupted or foreign file")
      arrays[name] = (np.memmap(fpath, dtype=adt, mode="r", shape=shape) if nbytes else
                      np.zeros(shape, adt))
  except (KeyError, TypeError) as e:
    raise ValueError(f"{where}: {path} is missing or has a malformed field: {e!r}") from e
  return _assemble(arrays["k"], arrays["v"], arrays["pos"], arrays.get("k_scale"),
                   arrays.get("v_scale"),
                   window_cells=manifest["window_cells"] if window_cells is None else window_cells,
                   capacity=manifest["capacity"] if capacity is None else capacity,
                   tile_cells=manifest["tile_cells"] if tile_cells is None else tile_cells,
                   dtype=dt, where=where)
