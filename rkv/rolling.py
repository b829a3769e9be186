"""``rkv.rolling_attention``: exact attention over a :class:`rkv.RollingKV` (window, staging, tail).

The window and the staging tile are device partials computed by :func:`rkv.attention`; the host
tail's tiles are streamed to the device (:mod:`rkv.offload.stream`); all partials merge exactly by
log-sum-exp, so the result equals attention over the whole cache held on the device
(``tests/rolling_attention_test.py``). A cache whose cells all sit in the window
(``W == capacity``, or nothing written past W) takes the plain resident path: one
``rkv.attention`` call, no host traffic.

Schedules (:mod:`rkv.offload.stream` has the H200 measurements behind them):

- ``"eager"`` (default): eager ``jax.device_put`` of each per-tile host array, issued ahead of
  separately dispatched jitted partials (window, staging, one function for every tile), then one
  jitted merge — the mechanism that overlapped transfer and compute on the H200 (21.2 ms against
  21.0 ms transfer-only; the in-jit program took 24.1 ms). The tile program compiles once per
  tile shape; the merge once per number of tiles (every ``tile_cells`` decoded tokens).
- ``"unrolled"``: one jitted program taking the tiles as arguments, specialized on the number of
  full tiles (static, from the fill level): compiles once per flush.

Under an outer ``jax.jit`` (the cache's arrays or the query are tracers) the eager schedule cannot
run — it is a Python loop of dispatches over concrete arrays — so ``rolling_attention`` falls back
to ``"unrolled"``, which gives the same result.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rkv.attention import IMPLS, attention
from rkv import cache as cache_lib
from rkv import validation
from rkv.offload import stream

# "cpu" and "hybrid" (attend to the tail on the host, or split it) arrive with the CPU-tail
# kernel; until then "auto" is "stream".
TACTICS = ("auto", "stream")
SCHEDULES = stream.SCHEDULES
DEFAULT_SCHEDULE = stream.DEFAULT_SCHEDULE
DEFAULT_LOOKAHEAD = stream.DEFAULT_LOOKAHEAD
_STATIC = ("causal", "window", "softcap", "scale", "impl")


def _partial(q, q_pos, block, *, impl, **kw):
  return attention(q, block.k, block.v, q_pos=q_pos, k_pos=block.pos,
                   k_scale=block.k_scale, v_scale=block.v_scale, impl=impl, **kw)


# The eager schedule's device partial: one program per block shape (window; staging and every
# tile share the tile shape whenever the tail is at least a tile long).
_partial_jit = jax.jit(_partial, static_argnames=_STATIC)


def _tiles(kv: cache_lib.RollingKV, n: int) -> tuple[stream.Tile, ...]:
  return tuple(stream.Tile(t.k, t.v, t.pos, t.k_scale, t.v_scale) for t in kv.tail_tiles[:n])


def _stream(q, q_pos, window_block, staging_block, tiles, *, use_window, use_staging, causal,
            window, softcap, scale, impl, schedule, lookahead, partial_fn):
  kw = dict(causal=causal, window=window, softcap=softcap, scale=scale, impl=impl)
  # Tiles, not KVBlocks: the staging partial then reuses the tile program (same pytree, shapes).
  as_tile = lambda b: stream.Tile(b.k, b.v, b.pos, b.k_scale, b.v_scale)
  window_block, staging_block = as_tile(window_block), as_tile(staging_block)

  def resident():
    parts = []
    if use_window:
      parts.append(partial_fn(q, q_pos, window_block, **kw))
    if use_staging:
      parts.append(partial_fn(q, q_pos, staging_block, **kw))
    return parts

  return stream.stream_attention(tiles, lambda tile: partial_fn(q, q_pos, tile, **kw),
                                 schedule=schedule, lookahead=lookahead, resident=resident,
                                 out_shape=q.shape, out_dtype=q.dtype)


@functools.partial(jax.jit, static_argnames=(
    "use_window", "use_staging", "causal", "window", "softcap", "scale", "impl", "lookahead"))
def _unrolled(q, q_pos, window_block, staging_block, tiles, *, use_window, use_staging, causal,
              window, softcap, scale, impl, lookahead):
  return _stream(q, q_pos, window_block, staging_block, tiles, use_window=use_window,
                 use_staging=use_staging, causal=causal, window=window, softcap=softcap,
                 scale=scale, impl=impl, schedule="unrolled", lookahead=lookahead,
                 partial_fn=_partial)


def _tracing(*trees) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(trees))


def _resolve(q, kv, *, q_pos, causal, window, softcap, scale, tactic, impl, schedule, lookahead,
             where):
  """Validates one call; returns (q_pos, static kwargs of the schedules)."""
  if not isinstance(kv, cache_lib.RollingKV):
    raise ValueError(f"{where}: kv must be a rkv.RollingKV, got {type(kv).__name__}")
  validation.check_choice(where, "tactic", tactic, TACTICS)
  validation.check_choice(where, "schedule", schedule, SCHEDULES)
  validation.check_choice(where, "impl", impl, IMPLS)
  stream.check_lookahead(lookahead, where)
  if q_pos is None and jnp.ndim(q) == 4:
    b, t = jnp.shape(q)[:2]
    q_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + (kv.fill - t), (b, t))
  w = kv.window
  args = validation.attention_args(q, w.k, w.v, q_pos=q_pos, k_pos=w.pos, k_scale=w.k_scale,
                                   v_scale=w.v_scale, window=window, softcap=softcap, scale=scale,
                                   where=where)
  static = dict(use_window=kv.window_cells > 0 and kv.fill > 0, use_staging=kv.n_staged > 0,
                causal=causal, window=window, softcap=softcap, scale=args.scale, impl=impl,
                lookahead=lookahead)
  return args.q_pos, static


def rolling_attention(q, kv, *, q_pos=None, causal=True, window=None, softcap=None, scale=None,
                      tactic="auto", impl="auto", schedule=DEFAULT_SCHEDULE,
                      lookahead=DEFAULT_LOOKAHEAD):
  """Exact attention of ``q [B,T,H,D]`` over every cell of ``kv``; returns ``(o, lse)``.

  Same semantics as :func:`rkv.attention` (DESIGN.md §3) over the cache's cells and positions;
  ``q_pos [B,T]`` defaults to the last T cells (``fill - T + arange(T)``).
  ``tactic``: one of ``TACTICS`` (``"auto"`` = ``"stream"``). ``impl``: the backend of every
  device partial (``"pallas"`` on GPU via ``"auto"``). ``schedule``: ``"eager"`` (default;
  per-tile eager transfers overlapping separately dispatched partials) or ``"unrolled"`` (one
  jitted program); under an outer ``jax.jit`` ``"eager"`` falls back to ``"unrolled"``.
  ``lookahead``: tiles requested ahead of the one being attended (default 4; the eager schedule
  then holds at most ``lookahead + 1`` tiles on the device and waits on the host for tile
  ``i - 1`` before issuing tile ``i + lookahead``); ``None`` issues every transfer up front and
  never waits, at the cost of the whole streamed tail in device memory during the call. See
  :mod:`rkv.offload.stream`.
  """
  q_pos, static = _resolve(q, kv, q_pos=q_pos, causal=causal, window=window, softcap=softcap,
                           scale=scale, tactic=tactic, impl=impl, schedule=schedule,
                           lookahead=lookahead, where="rolling_attention")
  n_tiles = kv.n_full_tiles
  if not n_tiles and not static["use_staging"] and static["use_window"]:
    # The resident path: nothing lives off the window, so this is exactly rkv.attention.
    return _partial(q, q_pos, kv.window, impl=impl, causal=causal, window=window,
                    softcap=softcap, scale=static["scale"])
  tiles = _tiles(kv, n_tiles)
  if schedule == "eager" and not _tracing(q, q_pos, kv):
    return _stream(q, q_pos, kv.window, kv.staging, tiles, schedule="eager",
                   partial_fn=_partial_jit, **static)
  return _unrolled(q, q_pos, kv.window, kv.staging, tiles, **static)


def lower(q, kv, *, q_pos=None, causal=True, window=None, softcap=None, scale=None,
          tactic="auto", impl="auto", schedule="unrolled", lookahead=DEFAULT_LOOKAHEAD,
          platforms: tuple[str, ...] | None = None) -> jax.stages.Lowered:
  """The lowered single program of the same ``rolling_attention`` call with
  ``schedule="unrolled"``, for HLO reports:
  ``rkv.offload.hlo_report(rkv.rolling.lower(q, kv).compile().as_text())``. ``platforms``
  (e.g. ``("cuda",)``) lowers for another backend without compiling: on a CPU-only machine it
  shows the GPU program's placement ops (``rkv.offload.memory.placement_report``). The eager
  schedule is a sequence of programs and has no single lowering: ``schedule="eager"`` is refused."""
  if schedule == "eager":
    raise ValueError("rolling.lower: schedule='eager' dispatches one program per partial and has "
                     "no single lowering; lower schedule='unrolled'")
  q_pos, static = _resolve(q, kv, q_pos=q_pos, causal=causal, window=window, softcap=softcap,
                           scale=scale, tactic=tactic, impl=impl, schedule=schedule,
                           lookahead=lookahead, where="rolling.lower")
  traced = _unrolled.trace(q, q_pos, kv.window, kv.staging, _tiles(kv, kv.n_full_tiles), **static)
  return traced.lower(lowering_platforms=platforms)
