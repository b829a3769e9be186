"""Streamed attention over a pinned-host tail held as per-tile arrays.

The tail arrives as a sequence of :class:`Tile` s, each ``k, v [B,tile,K,D]`` (scales
``[B,tile,K]``) in memory kind ``pinned_host`` and ``pos [B,tile]`` on the device — the layout of
:class:`rkv.RollingKV` (``kv.tail_tiles``). Each tile is moved to the device whole, attended to by
the caller's ``attend``, and every partial is merged exactly by log-sum-exp.

The streamed tail costs ``Bt / PCIe`` per step and the device partials ``Bw / HBM``; the model
time is their max only if the transfers overlap the compute (docs/DESIGN.md §6). On the H200
transfers inside one jitted program did not overlap compute; per-tile ``pinned_host`` arrays moved
by eager ``jax.device_put``, issued before separately dispatched jitted partials, did
(docs/DESIGN.md §5 and §7, "overlap"; a tiny jitted fetch per tile from a stacked array overlapped
only partly, 23.0 ms against 21.2, ``overlap_probe_h200.json``: ``eager_fetch``).

Schedules:

- ``"eager"`` (default): a Python-level pipeline of asynchronously dispatched calls. The first
  ``lookahead`` tiles' ``device_put`` s are issued **before** the resident (window, staging)
  partials are dispatched, so the device compute runs while they land; then for each tile ``i``
  the transfer of tile ``i + lookahead`` is issued and tile ``i``'s attention dispatched (one
  jitted function for every tile: same shapes, compiled once); finally one jitted exact merge of
  all partials. Nothing here reads a result, so the call returns futures (JAX async dispatch) —
  with one exception, the flow control of a bounded ``lookahead``: async dispatch lets the Python
  loop run ahead of the GPU, so issue order alone bounds nothing (every ``device_put`` allocates
  its device buffer when issued, and a model's next layers would be dispatched, with their tails'
  transfers, before this one finishes). So before issuing tile ``i + lookahead`` the host waits
  for tile ``i - 1``'s partial: at most ``lookahead + 1`` tiles are on the device at a time, and
  while the host waits ``lookahead`` transfers are queued, which keeps the copy engine busy (a
  tile's attention took under 0.1 ms on the H200 against ~2.6 ms for its 128 MiB transfer). The
  call returns when the last ``lookahead`` tiles are in flight, so the next call (the next layer)
  may allocate its first tiles while they drain: about ``2 * (lookahead + 1)`` tiles at the
  peak. ``lookahead=None`` issues every transfer up front and never waits (the probe's
  configuration): it holds the layer's whole streamed tail in device memory during the step, and
  a caller that dispatches several layers ahead holds several layers' tails.
  Needs concrete arrays: under an outer ``jax.jit`` use ``"unrolled"`` (``rkv.rolling_attention``
  falls back to it by itself).
- ``"unrolled"``: one jitted program taking the tiles as arguments; each tile is
  ``jax.device_put(tile, jax.memory.Space.Device)`` inside the program (on GPU an
  ``annotate_device_placement`` that XLA's host offloader turns into an async copy), in the same
  lookahead order. Kept for comparison with the in-jit mechanism that did not overlap, and as the
  path for callers inside ``jit``. ``lookahead=None`` (or >= N) requests every tile up front.

``"scan"`` (a ``lax.fori_loop`` over a stacked tail) is gone with the stacked tail.
"""

from __future__ import annotations

import collections
import os
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from rkv.attention import merge_partials
from rkv import validation
from rkv.offload import memory

SCHEDULES = ("eager", "unrolled")
DEFAULT_SCHEDULE = "eager"
# Tiles requested ahead of the one being attended: 4 keeps ~4 transfers (~10 ms at 32K-cell bf16
# tiles, K=8, D=128, 48 GB/s) queued behind the copy engine while the host waits, at a device
# memory cost of lookahead + 1 tiles (640 MiB for those tiles).
DEFAULT_LOOKAHEAD = 4


class Tile(NamedTuple):
  """One tile: ``k, v [B,tile,K,D]``, ``pos [B,tile]``, scales ``[B,tile,K]`` or None."""

  k: jax.Array
  v: jax.Array
  pos: jax.Array
  k_scale: jax.Array | None
  v_scale: jax.Array | None


Partial = tuple[jax.Array, jax.Array]  # (o [B,T,H,D], lse [B,T,H])


def check_lookahead(lookahead, where: str):
  if lookahead is not None and (not isinstance(lookahead, int) or isinstance(lookahead, bool)
                                or lookahead < 1):
    raise ValueError(f"{where}: lookahead must be a positive int or None (every tile up front), "
                     f"got {lookahead!r}")


def on_device(tile: Tile) -> bool:
  """Whether ``tile``'s K/V already live in device memory (a tile the :class:`Prefetcher` staged)."""
  return memory.memory_kind(tile.k) == memory.DEVICE


def put_eager(tile: Tile, device: jax.Device | None = None) -> Tile:
  """Issues the host→device transfer of a tile's K/V (and scales): an eager put
  (:func:`rkv.offload.memory.put_to_device`, ``jax.device_put``'s C++ copy), PJRT's async
  transfer path. Returns at once with device arrays still being written. Positions already
  live on the device (4 bytes a cell, 0.1% of a bf16 K/V cell): no transfer."""
  if on_device(tile):  # staged by a Prefetcher
    return tile
  k, v, ks, vs = memory.put_to_device((tile.k, tile.v, tile.k_scale, tile.v_scale), device)
  return Tile(k, v, tile.pos, ks, vs)


def put_many_eager(tiles: Sequence[Tile], device: jax.Device | None = None) -> list[Tile]:
  """:func:`put_eager` of several tiles in one call (:func:`rkv.offload.memory.put_to_device`: one
  batched request of every array); tiles already on the device are returned as they are."""
  todo = [i for i, t in enumerate(tiles) if not on_device(t)]
  out = list(tiles)
  if todo:
    flat = [a for i in todo for a in (tiles[i].k, tiles[i].v, tiles[i].k_scale, tiles[i].v_scale)]
    moved = memory.put_to_device(flat, device)
    for j, i in enumerate(todo):
      k, v, ks, vs = moved[4 * j:4 * j + 4]
      out[i] = Tile(k, v, tiles[i].pos, ks, vs)
  return out


def put_in_jit(tile: Tile) -> Tile:
  """The same move inside a jitted program (``Space.Device``: a placement op, async copy on GPU)."""
  to_dev = lambda x: None if x is None else jax.device_put(x, jax.memory.Space.Device)
  return Tile(to_dev(tile.k), to_dev(tile.v), tile.pos, to_dev(tile.k_scale),
              to_dev(tile.v_scale))


def _on_device(x):
  """``x`` moved to device memory inside a program when it lives in host memory (a CPU share's
  pinned_host partial, rkv.offload.cpu_attention.PinnedOutputs): computing on it where it is
  would be host compute (docs/DESIGN.md §5)."""
  if isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
    if getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host:
      return jax.device_put(x, jax.memory.Space.Device)
  return x


def merge_all(partials: Sequence[Partial], out_dtype) -> Partial:
  """Exact float32 LSE merge of partials; ``o`` cast to ``out_dtype``. Traceable (jit it).
  Partials in host memory are moved to the device first."""
  partials = [(_on_device(o), _on_device(lse)) for o, lse in partials]
  if len(partials) == 1:
    return partials[0][0].astype(out_dtype), partials[0][1]
  o = jnp.stack([p[0].astype(jnp.float32) for p in partials])
  lse = jnp.stack([p[1] for p in partials])
  o, lse = merge_partials(o, lse)
  return o.astype(out_dtype), lse


# One program per (number of partials, shapes, dtype): recompiled once per flush, like the
# unrolled program.
_merge_jit = jax.jit(merge_all, static_argnames="out_dtype")


def _wait(partial: Partial) -> None:
  """Host flow control of the eager schedule (a separate function so tests can watch it)."""
  with jax.profiler.TraceAnnotation("rkv.stream.wait"):
    jax.block_until_ready(partial)


def stream_attention(tiles: Sequence[Tile], attend: Callable[[Tile], Partial], *,
                     schedule: str = DEFAULT_SCHEDULE, lookahead: int | None = DEFAULT_LOOKAHEAD,
                     resident: Callable[[], list[Partial]] | None = None,
                     out_shape: tuple[int, ...], out_dtype, device: jax.Device | None = None
                     ) -> Partial:
  """Attention over ``resident()`` partials plus every tile of ``tiles`` (see the module docs).

  ``tiles``: the tiles to stream (host K/V and scales, device positions). ``attend(tile) -> (o,
  lse)`` computes one device partial; for ``"eager"`` pass a jitted function (it is called once
  per tile with identical shapes), for ``"unrolled"`` call this inside ``jit``. ``resident`` runs
  after the first ``lookahead`` transfers are issued, so its device work hides them. ``out_shape``
  is ``o``'s ``[B,T,H,D]``. Returns ``(o, lse)`` with ``o`` in ``out_dtype``; every merge is exact
  (float32 LSE-weighted). ``device``: where eager transfers go (default: the first device).
  """
  validation.check_choice("stream_attention", "schedule", schedule, SCHEDULES)
  check_lookahead(lookahead, "stream_attention")
  n = len(tiles)
  depth = n if lookahead is None else min(lookahead, n)
  eager = schedule == "eager"
  put = (lambda t: put_eager(t, device)) if eager else put_in_jit
  # The first transfers go before the resident partials (one call when eager).
  queue = collections.deque(put_many_eager(tiles[:depth], device) if eager
                            else [put(tiles[i]) for i in range(depth)])
  partials = list(resident()) if resident is not None else []
  streamed = []
  for i in range(n):
    if i + depth < n:
      # Tile i-1 consumed: at most lookahead + 1 tiles on the device. A tile a Prefetcher already
      # staged costs no new device memory, so issuing it needs no wait.
      if eager and lookahead is not None and i and not on_device(tiles[i + depth]):
        _wait(streamed[i - 1])
      queue.append(put(tiles[i + depth]))
    streamed.append(attend(queue.popleft()))
  partials += streamed
  if not partials:
    b, t, h, _ = out_shape
    return jnp.zeros(out_shape, out_dtype), jnp.full((b, t, h), -jnp.inf, jnp.float32)
  return (_merge_jit if eager else merge_all)(partials, out_dtype=out_dtype)


# ----------------------------------------------------------------------------------------------
# Across layers: the Prefetcher
# ----------------------------------------------------------------------------------------------
# Streamed tiles of the next layers kept in flight by a Prefetcher, when one is on. 8 tiles of 32K cells (128 MiB
# at K=8, D=128, bf16) are ~20 ms of PCIe at 54 GB/s: more than a layer's longest wait on the H200
# (its CPU share and the query's host copy, ~2.5 ms at 128K half-offloaded), for 1 GiB of HBM.
#
# Off by default (0; $RKV_PREFETCH_TILES sets it for a process): measured on the H200 the decode
# step is bound by the host's Python per layer, not by an idle link, and the prefetcher's own
# bookkeeping made it slower: 128K half-offloaded 6.36 tok/s without it vs 5.73 with 8 tiles, 1M
# tokens (default budget) 6.52 vs 5.44 (benchmarks/results/beyond_hbm/ab_prefetch{0,8}.json).
# Later, with the step bound by PCIe (a layer's copies idle through ~1 ms of its host work), it
# was slower still: 128K half 7.45 tok/s off vs 4.19 / 5.41 with 4 / 6 tiles, 1M 6.97 vs 6.38 /
# 5.13; traced, the copies stayed as busy and each layer's host part grew
# (benchmarks/results/beyond_hbm/session4/). A lighter form that queued only the next streaming
# layer's first tile behind the current layer's puts (commit 168cbd6, removed again) was slower
# too: 6.70 vs 7.57 tok/s at 128K half (session4/next_tile/). Traced event by event
# (beyond_hbm/session5/xplane/half128_pf{0,4}): with the Prefetcher the layer's CPU share ran on
# the dispatching thread and took 2.7 ms (median) against 1.55, the link idling meanwhile; on the
# worker thread (rolling._with_cpu_tail, now) it is 6.44 vs 6.89 tok/s off (session5/b/).
# At B=8 x 128K (two tiles a layer, hybrid; the link idles ~1.3 ms a layer) it was no faster
# either: 1 / 2 tiles 48.84, 56.60 / 55.77 tok/s against 51.73 / 57.18 off (session9/c/).
PREFETCH_TILES_ENV = "RKV_PREFETCH_TILES"
# $RKV_NEXT_PUTS=1: layered_forward puts the next rolling layer's first streamed tiles while a
# layer waits for its CPU share (rkv.models.transformer says why). Those tiles (up to
# DEFAULT_LOOKAHEAD of them) are on the device beside the attending layer's lookahead + 1, and the
# planner's reserve counts them when the switch is on (rkv.planner.budget.derive_reserve).
NEXT_PUTS_ENV = "RKV_NEXT_PUTS"


def next_puts_on() -> bool:
  """``$RKV_NEXT_PUTS``, read now (off when unset)."""
  return validation.env_switch(NEXT_PUTS_ENV, False)


def _prefetch_tiles_from_env() -> int:
  raw = os.environ.get(PREFETCH_TILES_ENV, "").strip() or "0"
  try:
    n = int(raw)
  except ValueError:
    n = -1
  if n < 0:
    raise ValueError(f"${PREFETCH_TILES_ENV} must be a non-negative tile count (0: no "
                     f"prefetcher), got {raw!r}")
  return n


DEFAULT_PREFETCH_TILES = _prefetch_tiles_from_env()
PREFETCH_TILES = 8  # a Prefetcher's own default, when one is made
# ... and at most this many bytes of them (but always one tile): a batch of 8 makes each 32K-cell
# tile 1 GiB, and 8 of those would take 8 GiB of window from every step.
DEFAULT_PREFETCH_BYTES = 1 << 30


def _tile_bytes(tile: Tile) -> int:
  return sum(int(x.nbytes) for x in (tile.k, tile.v, tile.k_scale, tile.v_scale) if x is not None)


def prefetch_room(tile_bytes: int, max_tiles: int = PREFETCH_TILES,
                  max_bytes: int = DEFAULT_PREFETCH_BYTES) -> int:
  """Device bytes a :class:`Prefetcher` holds at most for tiles of ``tile_bytes``: ``max_tiles``
  of them, fewer if they exceed ``max_bytes``, at least one (what a planner reserves)."""
  if tile_bytes <= 0 or max_tiles <= 0:
    return 0
  return max(1, min(max_tiles, max_bytes // tile_bytes)) * tile_bytes


class Prefetcher:
  """Issues the host→device transfers of the tiles a model step streams, in the order the layers
  attend them, up to ``max_tiles`` on the device at a time, across layers and into the next step.

  Within one ``rolling_attention`` call the eager schedule already keeps the copy engine busy; but
  between calls it idles: a layer's tiles are requested only when the host reaches that layer,
  and a ``cpu`` / ``hybrid`` layer holds the host until its query has come down and its CPU share
  is done (on the H200, 128K half-offloaded, 4.3 ms a layer with the link busy well under half of
  it: ``benchmarks/results/decode_trace_h200.json``). Tail tiles are immutable once full (a flush
  writes a new tile, never an old one), so the next layers' tiles, and the next step's first
  ones, can be requested long before they are attended.

  At most ``max_tiles`` tiles and ``max_bytes`` bytes (but always one tile) are on the device
  at a time, requested or taken and not yet read (:func:`prefetch_room`).

  Use: :meth:`begin` with the step's caches and their streamed tiles (``[(layer, tiles)]``, in
  attention order); before layer ``i`` attends, :meth:`take` ``(i, tiles)`` returns its tiles on
  the device (those not staged yet are requested now) and requests the following ones while room
  is left; after it, :meth:`consumed` ``(result)`` names an array that is ready only once the
  layer's tiles have been read, which is what frees their room. At the end of a step,
  :meth:`begin` with the returned caches starts the next step's transfers.
  """

  def __init__(self, max_tiles: int = PREFETCH_TILES,
               max_bytes: int = DEFAULT_PREFETCH_BYTES, device: jax.Device | None = None):
    for name, val in (("max_tiles", max_tiles), ("max_bytes", max_bytes)):
      if not isinstance(val, int) or isinstance(val, bool) or val < 1:
        raise ValueError(f"Prefetcher: {name} must be a positive int, got {val!r}")
    self.max_tiles = max_tiles
    self.max_bytes = max_bytes
    self.device = device
    self._order: list[tuple[int, int, Tile]] = []  # (layer, tile index, host tile), to request
    self._next = 0  # index into _order of the next tile to request
    self._staged: dict[tuple[int, int], tuple[object, Tile, int]] = {}  # (layer, j) -> (host k,
    # device tile, bytes)
    self._taken = collections.deque()  # [tiles, bytes, consumer or None]: possibly still read
    self._tiles = 0  # staged + taken-and-unread tiles, and their bytes
    self._bytes = 0
    self.requested = 0  # tiles requested ahead of their layer (counters for benchmarks)
    self.late = 0  # tiles a layer had to request itself

  def _in_flight(self) -> int:
    return self._tiles

  def _full(self, nbytes: int) -> bool:
    n = self._tiles
    return n >= self.max_tiles or (n > 0 and self._bytes + nbytes > self.max_bytes)

  def _unstage(self, key):
    host, tile, nbytes = self._staged.pop(key)
    self._tiles -= 1
    self._bytes -= nbytes
    return host, tile, nbytes

  def _make_room(self) -> bool:
    """Waits for the oldest taken tiles to be read; False when nothing can be freed."""
    while self._taken and self._taken[0][2] is not None:
      n, nbytes, consumer = self._taken.popleft()
      _wait(consumer)
      self._tiles -= n
      self._bytes -= nbytes
      if n:
        return True
    return False

  def _fill(self) -> None:
    while self._next < len(self._order):
      layer, j, tile = self._order[self._next]
      nbytes = _tile_bytes(tile)
      while self._full(nbytes):
        if not self._make_room():
          return
      self._next += 1
      key = (layer, j)
      if key not in self._staged:
        self._staged[key] = (tile.k, put_eager(tile, self.device), nbytes)
        self._tiles += 1
        self._bytes += nbytes
        self.requested += 1

  def begin(self, layers: Sequence[tuple[int, Sequence[Tile]]]) -> None:
    """Plans the next step: ``layers`` = ``[(layer index, its streamed host tiles)]`` in the order
    they will be attended. Staged tiles that are no longer wanted (another cache) are dropped."""
    order = [(i, j, t) for i, tiles in layers for j, t in enumerate(tiles)]
    want = {(i, j): t.k for i, j, t in order}
    for key in [k for k, (host, _, _) in self._staged.items() if want.get(k) is not host]:
      self._unstage(key)
    self._order, self._next = order, 0
    self._fill()

  def take(self, layer: int, tiles: Sequence[Tile]) -> tuple[Tile, ...]:
    """Layer ``layer``'s ``tiles`` on the device, in order (staged ones, the rest requested now);
    then requests the following layers' tiles while room is left."""
    out, nbytes = [], 0
    for j, t in enumerate(tiles):
      hit = self._unstage((layer, j)) if (layer, j) in self._staged else None
      if hit is not None and hit[0] is t.k:
        out.append(hit[1])
        nbytes += hit[2]
      else:
        out.append(put_eager(t, self.device))
        nbytes += _tile_bytes(t)
        self.late += 1
    # Skip what this layer took (and anything planned before it) in the request order.
    while self._next < len(self._order) and self._order[self._next][0] <= layer:
      self._next += 1
    self._taken.append([len(out), nbytes, None])
    self._tiles += len(out)
    self._bytes += nbytes
    return tuple(out)

  def consumed(self, result) -> None:
    """``result``: ready only after the last :meth:`take`'s tiles were read (the layer's output)."""
    if self._taken and self._taken[-1][2] is None:
      self._taken[-1][2] = result
    self._fill()
