"""Per-sequence windows of a multi-sequence KV pool (:mod:`rkv.pool`, docs/DESIGN.md §10).

A pool keeps each sequence's newest cells on the device and moves its oldest to pinned-host pages
of ``page_cells`` cells, one whole page at a time. Between two moves a sequence with window W
holds at most ``W + page_cells - 1`` device cells plus the cells the next step feeds it, so the
device budget is spent by water-filling: the largest common window ``w`` such that every
sequence's worst-case device occupancy, ``min(need, w + page_cells - 1 + feed)``, sums to at most
the device rows. A sequence whose whole context fits under ``w`` is resident (W = its need: it
never moves a page); the others share ``w``. Even windows follow the model of docs/DESIGN.md §6
as the rolling planner's even shares do: each sequence's tail streams under the device work of
all of them.

Shared rows (prefix reuse) are counted once per sequence holding them: the estimate is
conservative, never short.
"""

from __future__ import annotations

from collections.abc import Sequence


def _check_count(where, name, x, lo):
  if not isinstance(x, int) or isinstance(x, bool) or x < lo:
    raise ValueError(f"{where}: {name} must be an int >= {lo}, got {x!r}")


def pool_occupancy(needs: Sequence[int], feeds: Sequence[int], window: int,
                   page_cells: int) -> int:
  """Worst-case device rows the sequences hold with a common window ``window``."""
  return sum(min(n, window + page_cells - 1 + f) for n, f in zip(needs, feeds))


def pool_windows(needs: Sequence[int], device_rows: int, page_cells: int,
                 feeds: Sequence[int] | None = None) -> tuple[int, ...]:
  """Each sequence's window W (device cells it keeps, newest first) for a device part of
  ``device_rows`` rows.

  ``needs``: the cells each sequence will hold (its context plus the tokens still to generate;
  0 for a kept conversation that is not being fed). ``feeds``: the cells each is fed per step (a
  prefill chunk, 1 when decoding, 0 when idle; default 1 for every sequence with a need). Raises
  ``ValueError`` when even W = 0 does not fit (more sequences than the pool's device part can
  hold between page moves).
  """
  where = "pool_windows"
  _check_count(where, "device_rows", device_rows, 0)
  _check_count(where, "page_cells", page_cells, 1)
  needs = [int(n) for n in needs]
  feeds = [1 if n else 0 for n in needs] if feeds is None else [int(f) for f in feeds]
  if len(feeds) != len(needs):
    raise ValueError(f"{where}: feeds must have one entry per sequence ({len(needs)}), got "
                     f"{len(feeds)}")
  if any(n < 0 for n in needs) or any(f < 0 for f in feeds):
    raise ValueError(f"{where}: needs and feeds must be >= 0, got {needs}, {feeds}")
  if not needs:
    return ()
  top = max(needs)
  if pool_occupancy(needs, feeds, top, page_cells) <= device_rows:
    return tuple(needs)  # everything resident: no page ever moves
  if pool_occupancy(needs, feeds, 0, page_cells) > device_rows:
    raise ValueError(
        f"{where}: device_rows={device_rows} cannot hold {len(needs)} sequences between page "
        f"moves (each needs up to page_cells-1={page_cells - 1} staged cells plus its feed "
        f"{feeds}: {pool_occupancy(needs, feeds, 0, page_cells)} rows at W=0); give the pool more "
        f"device rows, smaller pages, or fewer sequences at once")
  lo, hi = 0, top  # occupancy(lo) fits, occupancy(hi) does not
  while hi - lo > 1:
    mid = (lo + hi) // 2
    if pool_occupancy(needs, feeds, mid, page_cells) <= device_rows:
      lo = mid
    else:
      hi = mid
  return tuple(min(n, lo) for n in needs)
