"""Layouts: the bytes of one layer's cache for a window W and a tile (the cache's own arithmetic,
rkv/cache.py), and the search for the window and tile that fit a per-layer budget.

The functions taking ``cfg`` read its ``tile_cells``, ``min_tile_cells`` and ``min_window_cells``
(a :class:`rkv.planner.config.ResidencyConfig`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from rkv.cache import default_scale_dtype
from rkv.planner.shape import AttentionShape

if TYPE_CHECKING:
  from rkv.planner.config import ResidencyConfig

# Window cells are a multiple of the largest KV block any kernel reads, so no window block is
# partial: the decode kernel's block_k is at most 128 (rkv/pallas/decode_attention.py,
# BlockSizes.resolve), the Mosaic kernel's block_kv is 128, the generic flash kernel's block_k 64
# or 32 (rkv/pallas/flash_attention.py). Tiles are multiples of it too.
WINDOW_ALIGN = 128
# The smallest tile a tight budget may shrink to. 16K-, 32K- and 64K-cell tiles stream alike on
# the H200 (benchmarks/results/rolling_overlap/rb_t16k.json, rb_t64k.json: 48-50 GB/s at 512K
# context); 4K is unmeasured. Tiles normally land in [tile_cells / 2, tile_cells].
DEFAULT_MIN_TILE_CELLS = 4096
POS_BYTES = 4  # int32 position per cell; every part's positions live on the device (rkv/cache.py)


@dataclasses.dataclass(frozen=True)
class Sizes:
  """Bytes of one cell of one layer: K/V (+ int8 scales) per head, and per cell (K heads)."""

  batch: int
  heads: int
  head_cell: int

  @property
  def cell(self) -> int:
    return self.heads * self.head_cell

  def resident(self, cells: int) -> int:
    return self.batch * cells * (self.cell + POS_BYTES)


def cell_sizes(shape: AttentionShape, batch: int) -> Sizes:
  itemsize = np.dtype(shape.kv_dtype).itemsize
  # A k and a v scale per (token, head), of the dtype the planner's caches keep (RollingKV.empty's
  # default: bfloat16 unless $RKV_INT8_SCALE_DTYPE says otherwise).
  scales = 2 * default_scale_dtype().itemsize if shape.kv_dtype == "int8" else 0
  return Sizes(batch=batch, heads=shape.num_kv_heads, head_cell=2 * shape.head_dim * itemsize
                + scales)


@dataclasses.dataclass(frozen=True)
class Layout:
  """A rolling layout of ``heads`` KV heads (plus ``resident_heads`` fully on the device)."""

  window: int
  tile: int
  capacity: int
  resident_heads: int
  device_bytes: int
  host_bytes: int
  host_cells: int
  device_read: int  # K/V bytes attended on the device per step at full fill
  host_read: int    # K/V bytes of the host tail per step


def layer_layout(sz: Sizes, capacity: int, window: int, tile: int,
                 resident_heads: int = 0) -> Layout:
  """Bytes of a layer whose ``resident_heads`` heads hold all cells on the device and whose other
  heads are a RollingKV(W=window, tile) — the cache's own arithmetic (rkv/cache.py)."""
  b, hc = sz.batch, sz.head_cell
  rolled = sz.heads - resident_heads
  p = capacity - window
  n_tiles = p // tile
  staging = min(tile, p)
  host_cells = n_tiles * tile
  dev = b * resident_heads * capacity * hc + (b * capacity * POS_BYTES if resident_heads else 0)
  dev += b * (rolled * (window + staging) * hc + POS_BYTES * (window + staging + host_cells))
  host = b * rolled * host_cells * hc
  read = b * (resident_heads * capacity + rolled * (capacity - host_cells)) * hc
  return Layout(window=window, tile=tile, capacity=capacity, resident_heads=resident_heads,
                 device_bytes=dev, host_bytes=host, host_cells=host_cells, device_read=read,
                 host_read=host)


def floor_align(x: float, q: int = WINDOW_ALIGN) -> int:
  return max(0, int(x) // q * q)


def tile_candidates(overflow_cells: int, capacity: int, cfg: ResidencyConfig,
                    min_host_tiles: int = 1) -> tuple[list[int], list[int]]:
  """Tail tiles worth trying for a layer that must move ``overflow_cells`` off the device:
  ``(preferred, fallback)``.

  The staging tile is device memory the window cannot use, and the host holds
  ``floor(P / tile)`` whole tiles, so with ``W = budget - tile`` the streamed cells are
  ``(floor(overflow / tile) + 1) * tile``: up to one tile more than the overflow. A tile just
  above ``overflow / n`` streams ``n`` tiles, barely more than the overflow: preferred are those
  for the smallest ``n`` with tiles <= ``tile_cells`` and for ``n + 1``, and ``tile_cells``
  itself. The fallback, for budgets too tight for those, halves ``tile_cells`` down to
  ``min_tile_cells`` (a smaller staging tile frees device cells). ``min_host_tiles``: the
  smallest ``n`` tried (2: a tail the hybrid tactic can split, :func:`best_layout`).
  """
  hi = min(cfg.tile_cells, floor_align(capacity))
  over = max(int(overflow_cells), 1)
  n0 = max(min_host_tiles, -(-over // cfg.tile_cells))
  preferred = {cfg.tile_cells}
  for n in (n0, n0 + 1):
    base = floor_align(over / n)
    preferred.update(base + k * WINDOW_ALIGN for k in (1, 2, 3))
  fallback, t = set(), cfg.tile_cells // 2
  while t >= cfg.min_tile_cells:
    fallback.add(t)
    t //= 2
  ok = lambda c: WINDOW_ALIGN <= c <= hi and c % WINDOW_ALIGN == 0
  return (sorted(c for c in preferred if ok(c)),
          sorted(c for c in fallback - preferred if ok(c)))


def size_window(sz: Sizes, capacity: int, per_layer_bytes: int, cfg: ResidencyConfig,
                tile: int, resident_heads: int = 0) -> Layout | None:
  """The largest W (a multiple of WINDOW_ALIGN, >= ``min_window_cells``, ``W + tile <=
  capacity`` so at least one tile leaves the device) whose layout fits ``per_layer_bytes``;
  None if not even ``min_window_cells`` fits."""
  lo = cfg.min_window_cells
  hi = floor_align(capacity - tile)
  if tile > capacity or lo > hi:
    return None
  fits = lambda w: (layer_layout(sz, capacity, w, tile, resident_heads).device_bytes
                    <= per_layer_bytes)
  if not fits(lo):
    return None
  # Device bytes grow with W except for the positions of a tail tile that disappears (4 bytes a
  # cell), so the linear estimate is within a few ALIGN steps: walk from it.
  rolled = sz.heads - resident_heads
  spare = per_layer_bytes - layer_layout(sz, capacity, 0, tile, resident_heads).device_bytes
  w = min(hi, max(lo, floor_align(spare / max(1, sz.batch * rolled * sz.head_cell))))
  while w > lo and not fits(w):
    w = max(lo, w - WINDOW_ALIGN)
  while w + WINDOW_ALIGN <= hi and fits(w + WINDOW_ALIGN):
    w += WINDOW_ALIGN
  return layer_layout(sz, capacity, w, tile, resident_heads)


def best_layout(sz: Sizes, capacity: int, per_layer_bytes: int, cfg: ResidencyConfig,
                resident_heads: int = 0, min_host_tiles: int = 1) -> Layout | None:
  """Over the preferred tile candidates (else the fallback ones), the layout fitting
  ``per_layer_bytes`` that streams the fewest bytes (then: the most device cells, the largest
  tile); None if none fits. ``min_host_tiles=2`` keeps only layouts whose host tail is at least
  two whole tiles: the hybrid tactic splits a tail by whole tiles, so a one-tile tail leaves one
  of its two links idle (the planner models both layouts, :func:`rkv.planner.placement.plan`)."""
  rolled = sz.heads - resident_heads
  if resident_heads:
    # tile_cells bounds a tile's bytes as cells of all K heads: a head split's tiles carry only
    # the rolled heads, so the same bytes hold K / rolled times the cells. Fewer, larger puts:
    # at 3 of 8 heads rolled, 29K-cell tiles (46 MB) streamed 1.35x their model on the H200
    # against 1.07x for the stream tactic's 128 MB tiles (tactics_bench_h200.json, 256K, 75%).
    grow = lambda c: max(WINDOW_ALIGN, floor_align(c * sz.heads / rolled))
    cfg = dataclasses.replace(cfg, tile_cells=grow(cfg.tile_cells),
                              min_tile_cells=grow(cfg.min_tile_cells))
  fixed = sz.batch * resident_heads * capacity * (sz.head_cell + POS_BYTES)
  rolled_cells = (per_layer_bytes - fixed) // max(1, sz.batch * (rolled * sz.head_cell + POS_BYTES))
  for tiles in tile_candidates(capacity - rolled_cells, capacity, cfg, min_host_tiles):
    best = None
    for tile in tiles:
      lay = size_window(sz, capacity, per_layer_bytes, cfg, tile, resident_heads)
      if lay is not None and lay.host_cells < min_host_tiles * lay.tile:
        continue
      if lay is not None and (best is None or (lay.host_read, -lay.device_read, -lay.tile) <
                              (best.host_read, -best.device_read, -best.tile)):
        best = lay
    if best is not None:
      return best
  return None


def head_layout(sz: Sizes, capacity: int, per_layer_bytes: int,
                cfg: ResidencyConfig) -> Layout | None:
  """Head split: the most KV heads (< K) fully resident that fit, the other heads a rolling
  cache (window from what is left, tail streamed); None if not even 0 resident heads fit."""
  for h in range(sz.heads - 1, -1, -1):
    lay = best_layout(sz, capacity, per_layer_bytes, cfg, resident_heads=h)
    if lay is not None:
      return lay
  return None
