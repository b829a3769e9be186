"""Many sequences in one KV pool per layer: device rows + pinned-host pages (docs/DESIGN.md §10).

Layout, per layer (:class:`PoolKV`, a pytree):

- ``k, v [R,K,D]``: the **device part**, R rows shared by every sequence, read through
  ``rkv.attention(kv_rows=...)`` (the kernels gather rows in place);
- ``host_k, host_v``: a tuple of N **host pages**, each a ``pinned_host`` array
  ``[1,page_cells,K,D]`` (None while free). One array per page for the reason the rolling cache
  keeps one per tile: eager ``device_put`` of separate host arrays overlapped compute on the H200
  (docs/DESIGN.md §5); the leading 1 makes a page a one-row tile the host C kernel reads in place.

The bookkeeping is one host-side :class:`Pool` for all layers (every layer holds the same cells
at the same rows and pages, as a paged cache's block table serves every layer): a free list of
rows and of pages, refcounts, and per sequence its **row table** — host pages ``(page, cells)``
holding its oldest cells, then device rows holding its newest, in position order (cell i of a
sequence is position i, so positions need no storage). **Residency** is per sequence: the
planner (:func:`rkv.planner.pool_windows`) gives each a window W from the device budget; after a
step a sequence holding ``W + page_cells`` or more device cells moves its oldest
``page_cells`` to a fresh host page (a gather per layer and one eager device→host copy).

**Sharing** (prefix reuse, conversation turns): KV is append-only, so a cell once written never
changes. A sequence sharing another's first L cells references the same device rows (page size 1:
no partial page exists on the device) and the same host pages; a host page holding the shared
prefix's end is referenced with fewer valid cells (``cells < page_cells``), read with the rest
masked. Host pages are written once, whole, and never again, and a device row is written once,
so neither needs copy-on-write: sharing is reference counting. ``rewind`` drops references
beyond a position. When sharers move the same device rows to the host, the first move's page is
reused by the others (no duplicate page).

Attention (:meth:`PoolKV.attend`): the chunk's cells are scattered into their rows, then the
partials merge by LSE (docs/DESIGN.md §2): the device part through ``kv_rows`` (one call for the
whole ragged batch), and the host pages by the layer's tactic:

- ``stream``: each page referenced by the batch is moved to the device once (eager
  ``device_put``, :func:`rkv.offload.stream.stream_attention`'s lookahead) and attended by every
  batch row that references it (per-row positions mask the others): ragged and shared alike;
- ``cpu``: the host C kernel reads each row's pages in place (one call per batch row);
- ``hybrid``: the first pages of the batch stream, the last ``cpu_fraction`` go to the kernel;
- ``resident``: no host pages (the planner must fit every sequence in the device part).
- ``head`` splits the KV heads of a dense cache and has no pool form: refused by name.

A prefill chunk (T > 16) of ``cpu``/``hybrid`` streams its pages, as the rolling cache does.

The step's layout (:class:`StepLayout`: rows written, rows read, pages per tactic) is built once
per step by :meth:`Pool.prepare` and carried by every layer's cache as static data, so a step
dispatches the same few programs per layer whatever the batch holds; row tables are padded to
``row_bucket`` and the batch to a power of two so programs compile once per bucket.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import zlib
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from rkv import atomic_io
from rkv import cache as cache_lib
from rkv import planner
from rkv import validation
from rkv.attention import IMPLS, MAX_DECODE_QUERIES, attention
from rkv.offload import cpu_attention as cpu_lib
from rkv.offload import memory
from rkv.offload import stream

POOL_TACTICS = ("resident", "stream", "cpu", "hybrid")
DEFAULT_PAGE_CELLS = 32768  # the rolling cache's tile (docs/DESIGN.md §7: 48.5 GB/s at 32K cells)
DEFAULT_ROW_BUCKET = 256
DEFAULT_CPU_FRACTION = 0.5
FORMAT = "rkv.Pool"
FORMAT_VERSION = 1
_SAVE_FILES = {"manifest.json", "rows.bin", "pages.bin"}


# ----------------------------------------------------------------------------------------------
# The step layout and the per-layer pytree
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class StepLayout:
  """Where one step's cells go and which cells each batch row reads (shared by every layer).

  ``write_rows [B,T]``: the pool row of each fed cell (R: padding, dropped). ``read_rows,
  read_pos [B,S]``: each row's device cells after the write and their positions (-1: padding).
  ``read_fill [B]``: how many of them each row lists (all padding comes after them: the decode
  kernel's ``kv_fill``, so its key bounds need no reduction over ``read_pos``).
  ``stream_pages``: host pages streamed, with ``stream_pos`` (one device ``[B,page]`` per page:
  each batch row's positions of the page's cells, -1 where that row does not read them).
  ``cpu_pages[b]``: ``(pages, positions)`` the host kernel reads for batch row b (numpy
  ``[1,page]`` positions). ``q_pos`` (numpy ``[B,T]``): the fed positions, for the kernel.
  Compared by identity: it is static data of the caches, built once per step."""

  write_rows: jax.Array
  read_rows: jax.Array
  read_pos: jax.Array
  read_fill: jax.Array
  stream_pages: tuple
  stream_pos: tuple
  cpu_pages: tuple
  q_pos: np.ndarray
  next_position: int
  room: int


@dataclasses.dataclass(frozen=True)
class PoolKV:
  """One layer's pool (module docstring): ``k, v [R,K,D]`` device rows, ``host_k, host_v``
  tuples of N ``pinned_host`` pages ``[1,page,K,D]`` (None: free). Static: the step's
  ``layout`` (set by :meth:`Pool.prepare`), ``tactic`` and ``cpu_fraction``.

  A layer cache (``rkv.models.kv.LayerCache``): :meth:`attend` needs a layout, so run it through
  :class:`Pool` / :class:`rkv.serving.Scheduler`; it is eager (``jittable`` False)."""

  k: jax.Array
  v: jax.Array
  host_k: tuple
  host_v: tuple
  layout: StepLayout | None = None
  tactic: str = "stream"
  cpu_fraction: float | None = None

  jittable: ClassVar[bool] = False

  @property
  def rows(self) -> int:
    return self.k.shape[0]

  def with_layout(self, layout: StepLayout | None) -> "PoolKV":
    return dataclasses.replace(self, layout=layout)

  # --- the layer-cache protocol ---
  @property
  def room(self) -> int | None:
    return None if self.layout is None else self.layout.room

  def next_position(self) -> jax.Array:
    return jnp.int32(0 if self.layout is None else self.layout.next_position)

  def streamed_tiles(self) -> tuple:
    return ()  # pages are streamed by attend itself (no cross-layer prefetcher for pools)

  def attend(self, q, k, v, positions, *, window=None, softcap=None, scale=None, impl="auto",
             schedule=None, staged=None) -> tuple[jax.Array, "PoolKV"]:
    """Scatters the chunk ``k, v [B,T,K,D]`` into its rows and returns ``(o, new cache)``:
    causal attention of ``q`` over each batch row's cells (device rows and host pages, merged by
    LSE). ``positions [B,T]`` must be the layout's (padding -1). Pages stream on the eager
    schedule (``schedule`` None or ``"eager"``); a pool takes no prefetched ``staged`` tiles."""
    where = "PoolKV.attend"
    if self.layout is None:
      raise ValueError(f"{where}: the cache has no step layout; run steps through "
                       f"rkv.pool.Pool.prepare (or rkv.serving.Scheduler)")
    if staged:
      raise ValueError(f"{where}: a pool streams its own pages (no prefetcher); got staged tiles")
    if schedule not in (None, "eager"):
      raise ValueError(f"{where}: a pool's pages stream on the eager schedule only (its layered "
                       f"step is never one jitted program), got schedule={schedule!r}")
    validation.check_choice(where, "impl", impl, IMPLS)
    lay = self.layout
    if tuple(k.shape[:2]) != tuple(lay.write_rows.shape) or v.shape != k.shape:
      raise ValueError(f"{where}: k/v must be [B,T,K,D] with [B,T]={tuple(lay.write_rows.shape)}"
                       f", got {tuple(k.shape)}, {tuple(v.shape)}")
    kp, vp = _scatter(self.k, self.v, k, v, lay.write_rows)
    kw = dict(window=window, softcap=softcap, scale=scale, impl=impl)

    def resident():
      return [_device_partial(q, kp, vp, lay.read_rows, positions, lay.read_pos, lay.read_fill,
                              **kw)]

    tiles = [stream.Tile(self.host_k[p], self.host_v[p], pos, None, None)
             for p, pos in zip(lay.stream_pages, lay.stream_pos)]
    part = stream.stream_attention(
        tiles, lambda t: _page_partial(q, t.k, t.v, positions, t.pos, **kw),
        schedule="eager", lookahead=stream.DEFAULT_LOOKAHEAD, resident=resident,
        out_shape=q.shape, out_dtype=jnp.float32)
    parts = [part]
    if lay.cpu_pages:
      # After the device work is dispatched: the kernel (it releases the GIL) runs on this
      # thread while the device computes, as rolling_attention's cpu tactic does.
      parts.append(_cpu_partial(q, self, lay, kw))
    o, _ = stream._merge_jit(parts, out_dtype=q.dtype)
    return o, dataclasses.replace(self, k=kp, v=vp)


jax.tree_util.register_dataclass(PoolKV, data_fields=["k", "v", "host_k", "host_v"],
                                 meta_fields=["layout", "tactic", "cpu_fraction"])


def _scatter_impl(kp, vp, k, v, rows):
  flat = rows.reshape(-1)
  put = lambda pool, x: pool.at[flat].set(x.reshape((-1,) + x.shape[2:]).astype(pool.dtype),
                                          mode="drop")
  return put(kp, k), put(vp, v)


_scatter = jax.jit(_scatter_impl, donate_argnums=(0, 1))

_STATIC = ("window", "softcap", "scale", "impl")


def _device_partial_impl(q, kp, vp, rows, q_pos, k_pos, fill, *, window, softcap, scale, impl):
  o, lse = attention(q, kp, vp, kv_rows=rows, q_pos=q_pos, k_pos=k_pos, causal=True,
                     window=window, softcap=softcap, scale=scale, impl=impl, kv_fill=fill)
  return o.astype(jnp.float32), lse


_device_partial = jax.jit(_device_partial_impl, static_argnames=_STATIC)


def _page_partial_impl(q, pk, pv, q_pos, k_pos, *, window, softcap, scale, impl):
  # A page ``[1,P,K,D]`` as a one-page pool read by every batch row: rows 0..P-1 for all, the
  # positions ``k_pos [B,P]`` (-1) mask the rows that do not reference it.
  b, p = q.shape[0], pk.shape[1]
  rows = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
  o, lse = attention(q, pk[0], pv[0], kv_rows=rows, q_pos=q_pos, k_pos=k_pos, causal=True,
                     window=window, softcap=softcap, scale=scale, impl=impl)
  return o.astype(jnp.float32), lse


_page_partial = jax.jit(_page_partial_impl, static_argnames=_STATIC)


def _cpu_partial(q, kv: PoolKV, lay: StepLayout, kw):
  """The host kernel over each batch row's kernel pages, in place: float32 numpy ``(o, lse)``."""
  qh = np.asarray(q)
  b, t, h, d = qh.shape
  o = np.zeros((b, t, h, d), np.float32)
  lse = np.full((b, t, h), -np.inf, np.float32)
  threads = cpu_lib.tail_threads(None)
  for row, (pages, poss) in enumerate(lay.cpu_pages):
    if not pages:
      continue
    o[row:row + 1], lse[row:row + 1] = cpu_lib.cpu_attention(
        qh[row:row + 1], tuple(kv.host_k[p] for p in pages), tuple(kv.host_v[p] for p in pages),
        k_pos=tuple(poss), q_pos=lay.q_pos[row:row + 1], causal=True, window=kw["window"],
        softcap=kw["softcap"], scale=kw["scale"], num_threads=threads)
  return o, lse


@jax.jit
def _gather_page(kp, vp, rows):
  return kp[rows][None], vp[rows][None]


@jax.jit
def _gather_rows(kp, vp, rows):
  return kp[rows], vp[rows]


# ----------------------------------------------------------------------------------------------
# The bookkeeping: one Pool for every layer
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Seq:
  """A sequence's row table: ``pages`` ``[page, cells]`` (its oldest cells, in order), then
  ``rows`` (device rows, newest last); ``tokens``: the token of each cell written."""

  tokens: list
  pages: list
  rows: list

  @property
  def length(self) -> int:
    return len(self.tokens)

  @property
  def host_cells(self) -> int:
    return sum(c for _, c in self.pages)


def _next_pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def _bucket(x: int, step: int) -> int:
  return max(step, -(-x // step) * step)


def _check_int(where, name, x, lo):
  if not isinstance(x, (int, np.integer)) or isinstance(x, bool) or x < lo:
    raise ValueError(f"{where}: {name} must be an int >= {lo}, got {x!r}")


class Pool:
  """The KV of many sequences for every layer of a model (module docstring).

  ``Pool(config, device_rows=R, host_pages=N, page_cells=P)``: R device rows and N host pages
  per layer, K/D/L from the model config, KV dtype ``dtype`` (default the model's; float only).
  ``tactic``: how host pages are attended (``POOL_TACTICS``; ``hybrid`` with ``cpu_fraction`` of
  each step's pages on the CPU). ``caches``: the current per-layer :class:`PoolKV` tuple.

  Sequences: :meth:`add` (empty, or sharing another's first cells), :meth:`fork`,
  :meth:`find_prefix`, :meth:`rewind`, :meth:`release`; a step: :meth:`prepare` →
  the model → :meth:`commit`. :meth:`save` / :meth:`load`: the whole session, atomically.
  """

  def __init__(self, config, *, device_rows: int, host_pages: int = 0,
               page_cells: int = DEFAULT_PAGE_CELLS, dtype=None, tactic: str = "stream",
               cpu_fraction: float | None = None, row_bucket: int = DEFAULT_ROW_BUCKET):
    where = "Pool"
    _check_int(where, "device_rows", device_rows, 1)
    _check_int(where, "host_pages", host_pages, 0)
    _check_int(where, "page_cells", page_cells, 1)
    _check_int(where, "row_bucket", row_bucket, 1)
    if tactic == "head":
      raise ValueError(f"{where}: tactic 'head' splits the KV heads of one dense cache "
                       f"(rkv.HeadSplitKV) and has no pool form; a ragged pool serves "
                       f"{POOL_TACTICS}")
    validation.check_choice(where, "tactic", tactic, POOL_TACTICS)
    if tactic == "resident" and host_pages:
      raise ValueError(f"{where}: tactic 'resident' keeps every cell on the device: host_pages "
                       f"must be 0, got {host_pages}")
    if tactic == "hybrid":
      cpu_fraction = DEFAULT_CPU_FRACTION if cpu_fraction is None else cpu_fraction
      if not isinstance(cpu_fraction, (int, float)) or not 0 <= cpu_fraction <= 1:
        raise ValueError(f"{where}: cpu_fraction must be in [0, 1], got {cpu_fraction!r}")
    elif cpu_fraction is not None:
      raise ValueError(f"{where}: cpu_fraction is only valid with tactic='hybrid'")
    dt = cache_lib.check_kv_dtype(config.dtype if dtype is None else dtype, where, "dtype")
    if dt == np.dtype(np.int8):
      raise ValueError(f"{where}: int8 pools are not implemented yet (their [R,K] scales are "
                       f"supported by rkv.attention(kv_rows=...)); use a float dtype")
    self.config = config
    self.device_rows, self.host_pages, self.page_cells = device_rows, host_pages, page_cells
    self.dtype, self.tactic, self.cpu_fraction = dt, tactic, cpu_fraction
    self.row_bucket = row_bucket
    kh, d = config.num_kv_heads, config.head_dim
    self._page_bytes = 2 * page_cells * kh * d * dt.itemsize
    memory.check_host_pool(config.num_layers * host_pages * self._page_bytes, where=where,
                           argument="host_pages")
    # Made on the device (a host buffer of R rows would cross PCIe twice per layer).
    zeros = lambda: jax.device_put(jnp.zeros((device_rows, kh, d), dt),
                                   memory.sharding(memory.DEVICE))
    self.caches = tuple(
        PoolKV(k=zeros(), v=zeros(), host_k=(None,) * host_pages,
               host_v=(None,) * host_pages, tactic=tactic, cpu_fraction=cpu_fraction)
        for _ in range(config.num_layers))
    self._row_ref = np.zeros(device_rows, np.int64)
    self._page_ref = np.zeros(host_pages, np.int64)
    self._page_start = np.full(host_pages, -1, np.int64)
    self._free_rows = list(range(device_rows - 1, -1, -1))  # a stack: low rows first
    self._free_pages = list(range(host_pages - 1, -1, -1))
    self._moved: dict[tuple, int] = {}  # device rows already copied to a page -> that page
    self._moved_by_row: dict[int, tuple] = {}
    self.seqs: dict[int, _Seq] = {}
    self._next_id = 0
    self._pending = None

  # --- reading the tables ---
  def __repr__(self):
    return (f"Pool(L={self.config.num_layers}, R={self.device_rows} rows "
            f"({self.free_rows} free), N={self.host_pages} pages of {self.page_cells} "
            f"({self.free_pages} free), tactic={self.tactic}, sequences={len(self.seqs)})")

  @property
  def free_rows(self) -> int:
    return len(self._free_rows)

  @property
  def free_pages(self) -> int:
    return len(self._free_pages)

  def _seq(self, seq: int, where: str) -> _Seq:
    if seq not in self.seqs:
      raise ValueError(f"{where}: no sequence {seq!r} in the pool (live: {sorted(self.seqs)})")
    return self.seqs[seq]

  def length(self, seq: int) -> int:
    """Cells (tokens) sequence ``seq`` holds."""
    return self._seq(seq, "Pool.length").length

  def tokens(self, seq: int) -> list[int]:
    return list(self._seq(seq, "Pool.tokens").tokens)

  def table(self, seq: int) -> dict:
    """``{"pages": [(page, cells), ...], "rows": [...], "length": n}``: where the cells live."""
    s = self._seq(seq, "Pool.table")
    return dict(pages=[tuple(p) for p in s.pages], rows=list(s.rows), length=s.length)

  def refcount(self, *, row: int | None = None, page: int | None = None) -> int:
    return int(self._row_ref[row]) if row is not None else int(self._page_ref[page])

  # --- sequences ---
  def add(self, share_from: int | None = None, length: int = 0) -> int:
    """A new sequence: empty, or sharing the first ``length`` cells of ``share_from``."""
    if share_from is None:
      if length:
        raise ValueError(f"Pool.add: length={length} needs share_from")
      sid = self._next_id
      self._next_id += 1
      self.seqs[sid] = _Seq(tokens=[], pages=[], rows=[])
      return sid
    return self.fork(share_from, length)

  def fork(self, src: int, length: int) -> int:
    """A new sequence whose first ``length`` cells are ``src``'s, shared (refcounted)."""
    where = "Pool.fork"
    s = self._seq(src, where)
    _check_int(where, "length", length, 0)
    if length > s.length:
      raise ValueError(f"{where}: length={length} exceeds sequence {src}'s {s.length} cells")
    pages, rows = _prefix_table(s, length)
    for p, _ in pages:
      self._page_ref[p] += 1
    for r in rows:
      self._row_ref[r] += 1
    sid = self._next_id
    self._next_id += 1
    self.seqs[sid] = _Seq(tokens=list(s.tokens[:length]), pages=pages, rows=rows)
    return sid

  def find_prefix(self, tokens) -> tuple[int | None, int]:
    """``(seq, n)``: the live sequence sharing the longest common prefix with ``tokens``
    (n tokens; ``(None, 0)`` when none shares a first token)."""
    tokens = [int(x) for x in tokens]
    best, best_n = None, 0
    for sid, s in self.seqs.items():
      n = 0
      for a, b in zip(s.tokens, tokens):
        if a != b:
          break
        n += 1
      if n > best_n:
        best, best_n = sid, n
    return best, best_n

  def rewind(self, seq: int, position: int) -> None:
    """Truncates ``seq`` to its first ``position`` cells (the next cell written is at
    ``position``); rows and pages no sequence references any more return to the free lists."""
    where = "Pool.rewind"
    s = self._seq(seq, where)
    _check_int(where, "position", position, 0)
    if position > s.length:
      raise ValueError(f"{where}: position={position} is beyond sequence {seq}'s {s.length} "
                       f"cells")
    pages, rows = _prefix_table(s, position)
    # A last page kept with fewer cells keeps its reference (it is read masked).
    for p, _ in s.pages[len(pages):]:
      self._unref_page(p)
    for r in s.rows[len(rows):]:
      self._unref_row(r)
    s.pages, s.rows, s.tokens = pages, rows, s.tokens[:position]

  def release(self, seq: int) -> None:
    """Drops ``seq``: its references go; cells another sequence shares stay."""
    s = self._seq(seq, "Pool.release")
    for p, _ in s.pages:
      self._unref_page(p)
    for r in s.rows:
      self._unref_row(r)
    del self.seqs[seq]

  def _unref_row(self, r):
    self._row_ref[r] -= 1
    if self._row_ref[r] == 0:
      self._free_rows.append(r)
      run = self._moved_by_row.pop(r, None)
      if run is not None:
        self._moved.pop(run, None)
        for x in run:
          self._moved_by_row.pop(x, None)

  def _unref_page(self, p):
    self._page_ref[p] -= 1
    if self._page_ref[p] == 0:
      self._free_pages.append(p)
      self._page_start[p] = -1
      for run in [r for r, q in self._moved.items() if q == p]:
        del self._moved[run]
        for x in run:
          self._moved_by_row.pop(x, None)
      self.caches = tuple(_set_page(c, p, None, None) for c in self.caches)

  # --- residency ---
  def windows(self, needs: dict | None = None, feeds: dict | None = None) -> dict:
    """Each sequence's window from the planner (:func:`rkv.planner.pool_windows`): ``needs``
    maps a sequence to the cells it will hold (default its length), ``feeds`` to the cells a step
    feeds it (default 0)."""
    ids = sorted(self.seqs)
    needs = needs or {}
    feeds = feeds or {}
    f = [int(feeds.get(i, 0)) for i in ids]
    n = [max(int(needs.get(i, 0)), self.seqs[i].length + fi) for i, fi in zip(ids, f)]
    if self.tactic == "resident":
      return dict(zip(ids, n))
    return dict(zip(ids, planner.pool_windows(n, self.device_rows, self.page_cells, f)))

  def maintain(self, needs: dict | None = None, feeds: dict | None = None, *,
               windows: dict | None = None) -> int:
    """Moves each sequence's oldest whole pages of device cells beyond its window to the host;
    returns the pages written. ``windows``: windows to use instead of the planner's for some
    sequences (e.g. 0 to send an idle conversation's whole pages to the host)."""
    wins = self.windows(needs, feeds)
    for sid, w in (windows or {}).items():
      self._seq(sid, "Pool.maintain")
      _check_int("Pool.maintain", "windows", w, 0)
      wins[sid] = w
    moved = 0
    for sid, w in wins.items():
      s = self.seqs[sid]
      while len(s.rows) - self.page_cells >= w:
        moved += self._move_page(s)
    return moved

  def _move_page(self, s: _Seq) -> int:
    run = tuple(s.rows[:self.page_cells])
    start = s.host_cells
    page = self._moved.get(run)
    wrote = 0
    if page is None:
      if not self._free_pages:
        raise ValueError(f"Pool: no free host page to move {self.page_cells} cells to (all "
                         f"{self.host_pages} in use): give the pool more host_pages")
      page = self._free_pages.pop()
      rows = jnp.asarray(np.asarray(run, np.int32))
      new = []
      for c in self.caches:
        pk, pv = memory.to_host(_gather_page(c.k, c.v, rows))
        new.append(_set_page(c, page, pk, pv))
      self.caches = tuple(new)
      self._page_start[page] = start
      self._moved[run] = page
      for r in run:
        self._moved_by_row[r] = run
      wrote = 1
    self._page_ref[page] += 1
    s.pages.append([page, self.page_cells])
    s.rows = s.rows[self.page_cells:]
    for r in run:
      self._unref_row(r)
    return wrote

  # --- a step ---
  def prepare(self, feeds, *, needs: dict | None = None):
    """Lays out one step feeding ``feeds`` (``[(seq, tokens), ...]``, one entry per batch row,
    each with at least one token) and returns ``(tokens [B,T], positions [B,T], caches)`` for
    ``layered_forward``: rows left-padded (position -1) so each row's last fed token is at
    ``T-1``; B padded to a power of two, T to a power of two. Moves pages first
    (:meth:`maintain`) so the fed cells fit; run the model, then :meth:`commit` its caches."""
    where = "Pool.prepare"
    if self._pending is not None:
      raise ValueError(f"{where}: the previous step was not committed (Pool.commit)")
    feeds = [(sid, [int(x) for x in toks]) for sid, toks in feeds]
    if not feeds:
      raise ValueError(f"{where}: feeds must hold at least one (seq, tokens) entry")
    seen = set()
    for sid, toks in feeds:
      self._seq(sid, where)
      if sid in seen:
        raise ValueError(f"{where}: sequence {sid} is fed twice in one step")
      seen.add(sid)
      if not toks:
        raise ValueError(f"{where}: sequence {sid} is fed no token")
      validation.check_token_ids(where, "tokens", np.asarray(toks), self.config.vocab_size)
    self.maintain(needs, {sid: len(t) for sid, t in feeds})
    need_rows = sum(len(t) for _, t in feeds)
    if need_rows > self.free_rows:
      raise ValueError(f"{where}: the step feeds {need_rows} cells but {self.free_rows} device "
                       f"rows are free: give the pool more device_rows or feed less at once")
    b = _next_pow2(len(feeds))
    t = _next_pow2(max(len(x) for _, x in feeds))
    r, p = self.device_rows, self.page_cells
    tokens = np.zeros((b, t), np.int32)
    q_pos = np.full((b, t), -1, np.int32)
    write = np.full((b, t), r, np.int32)
    new_rows = []
    for i, (sid, toks) in enumerate(feeds):
      s = self.seqs[sid]
      n = len(toks)
      rows = [self._free_rows.pop() for _ in range(n)]
      new_rows.append(rows)
      tokens[i, t - n:] = toks
      q_pos[i, t - n:] = s.length + np.arange(n)
      write[i, t - n:] = rows
    # A bucket of rows (one program per bucket, not per fill); never wider than the device part.
    s_len = min(_bucket(max(len(self.seqs[sid].rows) + len(x) for sid, x in feeds),
                        self.row_bucket), r)
    read = np.full((b, s_len), -1, np.int32)
    read_pos = np.full((b, s_len), -1, np.int32)
    read_fill = np.zeros((b,), np.int32)
    page_pos: dict[int, np.ndarray] = {}
    order: list[int] = []
    for i, (sid, toks) in enumerate(feeds):
      s = self.seqs[sid]
      rows = s.rows + new_rows[i]
      h = s.host_cells
      read[i, :len(rows)] = rows
      read_pos[i, :len(rows)] = h + np.arange(len(rows))
      read_fill[i] = len(rows)
      for page, cells in s.pages:
        if page not in page_pos:
          page_pos[page] = np.full((b, p), -1, np.int32)
          order.append(page)
        start = self._page_start[page]
        page_pos[page][i, :cells] = start + np.arange(cells)
    n_cpu = 0
    if t > MAX_DECODE_QUERIES:
      pass  # a prefill chunk is compute-bound: its pages stream (the CPU split is for decode)
    elif self.tactic == "cpu":
      n_cpu = len(order)
    elif self.tactic == "hybrid":
      n_cpu = math.floor(self.cpu_fraction * len(order) + 0.5)  # half up, as rolling's
    streamed, kernel = order[:len(order) - n_cpu], set(order[len(order) - n_cpu:])
    cpu_pages = []
    for i in range(b):
      mine = [pg for pg in order if pg in kernel and (page_pos[pg][i] >= 0).any()]
      cpu_pages.append((tuple(mine), tuple(page_pos[pg][i:i + 1].copy() for pg in mine)))
    layout = StepLayout(
        write_rows=jnp.asarray(write), read_rows=jnp.asarray(read), read_pos=jnp.asarray(read_pos),
        read_fill=jnp.asarray(read_fill),
        stream_pages=tuple(streamed), stream_pos=tuple(jnp.asarray(page_pos[x]) for x in streamed),
        cpu_pages=tuple(cpu_pages) if kernel else (), q_pos=q_pos,
        next_position=max(self.seqs[sid].length for sid, _ in feeds), room=self.free_rows)
    self._pending = (feeds, new_rows)
    return tokens, q_pos, tuple(c.with_layout(layout) for c in self.caches)

  def commit(self, caches) -> None:
    """Takes the caches the model returned for the step :meth:`prepare` laid out."""
    if self._pending is None:
      raise ValueError("Pool.commit: no step is pending (call Pool.prepare first)")
    caches = tuple(caches)
    if len(caches) != len(self.caches) or not all(isinstance(c, PoolKV) for c in caches):
      raise ValueError(f"Pool.commit: caches must be the {len(self.caches)} PoolKV the step "
                       f"returned")
    feeds, new_rows = self._pending
    self._pending = None
    self.caches = tuple(c.with_layout(None) for c in caches)
    for (sid, toks), rows in zip(feeds, new_rows):
      s = self.seqs[sid]
      for r in rows:
        self._row_ref[r] += 1
      s.rows = s.rows + rows
      s.tokens = s.tokens + toks

  def abort(self) -> None:
    """Undoes a :meth:`prepare` whose step failed: its rows go back to the free list."""
    if self._pending is not None:
      for rows in self._pending[1]:
        self._free_rows.extend(reversed(rows))
      self._pending = None

  def extend(self, seq: int, tokens, kv, *, needs: dict | None = None) -> None:
    """Appends cells computed elsewhere to ``seq``: ``tokens [n]`` and ``kv``, one ``(k, v)``
    ``[n,K,D]`` per layer (numpy or device). Pages move first so the n cells fit (the caller
    chunks a long context). For a synthetic fill (benchmarks) or K/V imported from another run."""
    where = "Pool.extend"
    s = self._seq(seq, where)
    if self._pending is not None:
      raise ValueError(f"{where}: a step is pending (commit it first)")
    tokens = [int(x) for x in tokens]
    kv = list(kv)
    n, kh, d = len(tokens), self.config.num_kv_heads, self.config.head_dim
    if len(kv) != len(self.caches):
      raise ValueError(f"{where}: kv must hold one (k, v) per layer ({len(self.caches)}), got "
                       f"{len(kv)}")
    for i, (k, v) in enumerate(kv):
      if tuple(np.shape(k)) != (n, kh, d) or tuple(np.shape(v)) != (n, kh, d):
        raise ValueError(f"{where}: layer {i}'s k/v must be [n,K,D]={(n, kh, d)}, got "
                         f"{tuple(np.shape(k))}, {tuple(np.shape(v))}")
    if not n:
      return
    self.maintain(needs, {seq: n})
    if n > self.free_rows:
      raise ValueError(f"{where}: {n} cells but {self.free_rows} device rows are free: extend in "
                       f"smaller chunks")
    rows = [self._free_rows.pop() for _ in range(n)]
    write = jnp.asarray(np.asarray(rows, np.int32)[None])
    self.caches = tuple(
        dataclasses.replace(c, **dict(zip(("k", "v"), _scatter(c.k, c.v, jnp.asarray(k)[None],
                                                               jnp.asarray(v)[None], write))))
        for c, (k, v) in zip(self.caches, kv))
    for r in rows:
      self._row_ref[r] += 1
    s.rows = s.rows + rows
    s.tokens = s.tokens + tokens

  def referenced_bytes(self, seqs=None) -> dict:
    """K/V bytes a step over ``seqs`` (default all) reads, every layer: ``device`` (the rows
    they reference) and ``host`` (the pages they reference, each moved once however many
    share it)."""
    seqs = list(self.seqs) if seqs is None else list(seqs)
    rows = {r for sid in seqs for r in self.seqs[sid].rows}
    pages = {p for sid in seqs for p, _ in self.seqs[sid].pages}
    cell = 2 * self.config.num_kv_heads * self.config.head_dim * self.dtype.itemsize
    layers = len(self.caches)
    return dict(device=layers * cell * len(rows), host=layers * cell * self.page_cells * len(pages))

  # --- save / load ---
  def save(self, directory: str) -> None:
    """Writes the whole session to ``directory`` atomically (as :func:`rkv.cache.save`: a fresh
    temporary directory, fsynced, installed by one rename or atomic exchange; a failed save
    raises ``ValueError`` and leaves the previous save as it was).

    Files: ``rows.bin`` (the used device rows, ``[L,2,n_rows,K,D]``), ``pages.bin`` (the used
    host pages, ``[L,2,n_pages,page,K,D]``), ``manifest.json`` (shapes, dtype, CRC-32s, every
    sequence's tokens and row table in saved indices, page start positions, refcounts)."""
    if self._pending is not None:
      raise ValueError("Pool.save: a step is pending (commit it first)")
    for i, c in enumerate(self.caches):
      validation.check_live("Pool.save", f"caches[{i}]", c)
    atomic_io.save_atomically(directory, self._write_save, where="Pool.save",
                              what="the session", kind="a pool save", names=_SAVE_FILES)

  def _write_save(self, out: str) -> None:
    used_rows = sorted({r for s in self.seqs.values() for r in s.rows})
    used_pages = sorted({pg for s in self.seqs.values() for pg, _ in s.pages})
    row_ix = {r: i for i, r in enumerate(used_rows)}
    page_ix = {pg: i for i, pg in enumerate(used_pages)}
    files = {}
    rows = jnp.asarray(np.asarray(used_rows, np.int32))
    for name, chunks in (("rows", lambda c: _gather_rows(c.k, c.v, rows) if used_rows else ()),
                         ("pages", lambda c: [x for pg in used_pages
                                              for x in (c.host_k[pg], c.host_v[pg])])):
      crc, nbytes = 0, 0
      with open(os.path.join(out, f"{name}.bin"), "xb") as f:
        for c in self.caches:
          if name == "rows":
            parts = chunks(c)
            parts = [np.asarray(parts[0]), np.asarray(parts[1])] if parts else []
          else:
            arrs = chunks(c)
            parts = [np.stack([np.asarray(x)[0] for x in arrs[0::2]]),
                     np.stack([np.asarray(x)[0] for x in arrs[1::2]])] if arrs else []
          for x in parts:
            data = np.ascontiguousarray(x).tobytes()
            crc, nbytes = zlib.crc32(data, crc), nbytes + len(data)
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
      files[name] = dict(file=f"{name}.bin", bytes=nbytes, crc32=crc)
    cfg = self.config
    manifest = dict(
        format=FORMAT, version=FORMAT_VERSION, dtype=self.dtype.name, num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, page_cells=self.page_cells,
        n_rows=len(used_rows), n_pages=len(used_pages), files=files,
        page_starts=[int(self._page_start[pg]) for pg in used_pages],
        row_refs=[int(self._row_ref[r]) for r in used_rows],
        page_refs=[int(self._page_ref[pg]) for pg in used_pages],
        next_id=self._next_id,
        sequences=[dict(id=sid, tokens=[int(x) for x in s.tokens],
                        pages=[[page_ix[pg], int(c)] for pg, c in s.pages],
                        rows=[row_ix[r] for r in s.rows]) for sid, s in sorted(self.seqs.items())])
    with open(os.path.join(out, "manifest.json"), "x") as f:
      json.dump(manifest, f)
      f.flush()
      os.fsync(f.fileno())

  @classmethod
  def load(cls, directory: str, config, *, device_rows: int, host_pages: int,
           tactic: str = "stream", cpu_fraction: float | None = None,
           row_bucket: int = DEFAULT_ROW_BUCKET, needs: dict | None = None,
           verify: bool = True) -> "Pool":
    """A session written by :meth:`save`, placed for a (possibly different) budget: the saved
    device cells beyond each sequence's new window go to host pages as they load (shared runs
    once), the rest to device rows. ``needs`` as in :meth:`windows`."""
    where = "Pool.load"
    manifest, data = _read_save(directory, config, verify, where)
    pool = cls(config, device_rows=device_rows, host_pages=host_pages,
               page_cells=manifest["page_cells"], dtype=manifest["dtype"], tactic=tactic,
               cpu_fraction=cpu_fraction, row_bucket=row_bucket)
    n_rows, n_pages, p = manifest["n_rows"], manifest["n_pages"], manifest["page_cells"]
    rows_np, pages_np = data
    starts = manifest["page_starts"]
    if len(manifest["page_refs"]) != n_pages or len(manifest["row_refs"]) != n_rows:
      raise ValueError(f"{where}: manifest refcounts do not match its rows/pages")
    # Saved pages first: each gets a page of the new pool.
    page_map = {}
    for i in range(n_pages):
      if not pool._free_pages:
        raise ValueError(f"{where}: the save holds {n_pages} host pages, more than "
                         f"host_pages={host_pages}")
      page_map[i] = pool._free_pages.pop()
    seqs = {}
    for rec in manifest["sequences"]:
      seqs[int(rec["id"])] = _Seq(tokens=list(rec["tokens"]),
                                  pages=[[page_map[int(a)], int(c)] for a, c in rec["pages"]],
                                  rows=[int(x) for x in rec["rows"]])  # saved row indices yet
    # The tables must give the refcounts the save recorded: a manifest edited or mixed up is
    # refused rather than loaded with wrong sharing.
    row_refs, page_refs = np.zeros(n_rows, np.int64), np.zeros(n_pages, np.int64)
    for rec in manifest["sequences"]:
      for r in rec["rows"]:
        row_refs[int(r)] += 1
      for a, _ in rec["pages"]:
        page_refs[int(a)] += 1
    if row_refs.tolist() != list(manifest["row_refs"]) or \
        page_refs.tolist() != list(manifest["page_refs"]):
      raise ValueError(f"{where}: the manifest's row tables do not give its refcounts: an "
                       f"inconsistent save")
    pool.seqs = seqs
    pool._next_id = int(manifest["next_id"])
    # The new windows decide which saved device cells become pages now (numpy source).
    saved_ref = np.zeros(n_rows, np.int64)
    for s in seqs.values():
      for r in s.rows:
        saved_ref[r] += 1
    ids = sorted(seqs)
    n = [max(int((needs or {}).get(i, 0)), seqs[i].length) for i in ids]
    wins = (dict(zip(ids, n)) if tactic == "resident" else
            dict(zip(ids, planner.pool_windows(n, device_rows, p, [0] * len(ids)))))
    new_pages: dict[tuple, int] = {}
    for sid in ids:
      s = seqs[sid]
      while len(s.rows) - p >= wins[sid]:
        run = tuple(s.rows[:p])
        if run not in new_pages:
          if not pool._free_pages:
            raise ValueError(f"{where}: host_pages={host_pages} cannot hold the save under "
                             f"device_rows={device_rows}")
          new_pages[run] = pool._free_pages.pop()
          starts_run = s.host_cells
          pool._page_start[new_pages[run]] = starts_run
        s.pages.append([new_pages[run], p])
        s.rows = s.rows[p:]
        for r in run:
          saved_ref[r] -= 1
    row_map = {}
    for r in range(n_rows):
      if saved_ref[r] > 0:
        if not pool._free_rows:
          raise ValueError(f"{where}: device_rows={device_rows} cannot hold the save's device "
                           f"cells")
        row_map[r] = pool._free_rows.pop()
    caches = []
    for layer, c in enumerate(pool.caches):
      host_k, host_v = list(c.host_k), list(c.host_v)
      for i in range(n_pages):
        host_k[page_map[i]], host_v[page_map[i]] = memory.to_host(
            (pages_np[layer, 0, i][None], pages_np[layer, 1, i][None]))
      for run, pg in new_pages.items():
        ix = np.asarray(run)
        host_k[pg], host_v[pg] = memory.to_host((rows_np[layer, 0, ix][None],
                                                 rows_np[layer, 1, ix][None]))
      k = np.zeros(c.k.shape, pool.dtype)
      v = np.zeros(c.v.shape, pool.dtype)
      if row_map:
        src = np.asarray(list(row_map))
        dst = np.asarray(list(row_map.values()))
        k[dst], v[dst] = rows_np[layer, 0, src], rows_np[layer, 1, src]
      caches.append(dataclasses.replace(c, k=memory.to_device(k), v=memory.to_device(v),
                                        host_k=tuple(host_k), host_v=tuple(host_v)))
    pool.caches = tuple(caches)
    for i, pg in page_map.items():
      pool._page_start[pg] = starts[i]
    for s in seqs.values():
      s.rows = [row_map[r] for r in s.rows]
      for pg, _ in s.pages:
        pool._page_ref[pg] += 1
      for r in s.rows:
        pool._row_ref[r] += 1
    return pool


def _set_page(c: PoolKV, page: int, pk, pv) -> PoolKV:
  hk, hv = list(c.host_k), list(c.host_v)
  hk[page], hv[page] = pk, pv
  return dataclasses.replace(c, host_k=tuple(hk), host_v=tuple(hv))


def _prefix_table(s: _Seq, length: int) -> tuple[list, list]:
  """The first ``length`` cells of ``s``'s table: whole pages, a last page with fewer cells
  (read masked), then device rows."""
  pages, left = [], length
  for pg, cells in s.pages:
    if left <= 0:
      break
    take = min(cells, left)
    pages.append([pg, take])
    left -= take
  rows = list(s.rows[:max(left, 0)])
  return pages, rows


def _read_save(directory, config, verify, where):
  path, m = cache_lib.read_manifest(directory, FORMAT, FORMAT_VERSION, where=where,
                                    what="an rkv pool save")
  try:
    want = (config.num_layers, config.num_kv_heads, config.head_dim)
    got = (m["num_layers"], m["num_kv_heads"], m["head_dim"])
    if tuple(got) != want:
      raise ValueError(f"{where}: the save is for L, K, D = {tuple(got)}, the model has {want}")
    dt = cache_lib.check_kv_dtype(m["dtype"], where, "manifest dtype")
    L, kh, d, p = want[0], want[1], want[2], int(m["page_cells"])
    shapes = dict(rows=(L, 2, int(m["n_rows"]), kh, d), pages=(L, 2, int(m["n_pages"]), p, kh, d))
    out = []
    for name, shape in shapes.items():
      spec = m["files"][name]
      fpath = os.path.join(directory, spec["file"])
      nbytes = int(np.prod(shape)) * dt.itemsize
      if not os.path.isfile(fpath):
        raise ValueError(f"{where}: missing array file {fpath}")
      if os.path.getsize(fpath) != nbytes or int(spec["bytes"]) != nbytes:
        raise ValueError(f"{where}: {fpath} has {os.path.getsize(fpath)} bytes, expected "
                         f"{nbytes}: truncated or foreign file")
      if verify and atomic_io.file_crc32(fpath) != int(spec["crc32"]):
        raise ValueError(f"{where}: {fpath} fails its CRC-32 check: corrupted or foreign file")
      out.append(np.fromfile(fpath, dtype=dt).reshape(shape) if nbytes else np.zeros(shape, dt))
  except (KeyError, TypeError) as e:
    raise ValueError(f"{where}: {path} is missing or has a malformed field: {e!r}") from e
  return m, tuple(out)
