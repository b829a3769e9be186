"""``rkv.rolling_attention``: exact attention over a :class:`rkv.RollingKV` (window, staging, tail).

The window and the staging tile are device partials computed by :func:`rkv.attention`; the host
tail is streamed tile by tile inside the same jitted program (:mod:`rkv.offload.stream`); all
partials merge exactly by log-sum-exp, so the result equals attention over the whole cache held
on the device (``tests/rolling_attention_test.py``). A cache whose cells all sit in the window
(``W == capacity``, or nothing written past W) takes the plain resident path: one
``rkv.attention`` call, no host traffic.

The streamed program is specialized on the number of full tail tiles (static, from the cache's
fill level), so it compiles once per flush — every ``tile_cells`` decoded tokens — and is reused
for every step in between.
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


def _partial(q, q_pos, block, *, impl, **kw):
  return attention(q, block.k, block.v, q_pos=q_pos, k_pos=block.pos,
                                 k_scale=block.k_scale, v_scale=block.v_scale, impl=impl, **kw)


@functools.partial(jax.jit, static_argnames=(
    "n_tiles", "use_window", "use_staging", "causal", "window", "softcap", "scale", "impl",
    "schedule", "lookahead"))
def _rolling(q, q_pos, window_block, staging_block, tail_block, *, n_tiles, use_window,
             use_staging, causal, window, softcap, scale, impl, schedule, lookahead):
  kw = dict(causal=causal, window=window, softcap=softcap, scale=scale, impl=impl)

  def resident():
    parts = []
    if use_window:
      parts.append(_partial(q, q_pos, window_block, **kw))
    if use_staging:
      parts.append(_partial(q, q_pos, staging_block, **kw))
    return parts

  def attend(tile: stream.Tile):
    return attention(q, tile.k, tile.v, q_pos=q_pos, k_pos=tile.pos,
                                   k_scale=tile.k_scale, v_scale=tile.v_scale, **kw)

  tail = (tail_block.k, tail_block.v, tail_block.pos, tail_block.k_scale, tail_block.v_scale)
  return stream.stream_attention(tail, attend, n_tiles=n_tiles, schedule=schedule,
                                 lookahead=lookahead, resident=resident, out_shape=q.shape,
                                 out_dtype=q.dtype)


def _resolve(q, kv, *, q_pos, causal, window, softcap, scale, tactic, impl, schedule, lookahead,
             where):
  """Validates one call; returns (q_pos, static kwargs of _rolling)."""
  if not isinstance(kv, cache_lib.RollingKV):
    raise ValueError(f"{where}: kv must be a rkv.RollingKV, got {type(kv).__name__}")
  validation.check_choice(where, "tactic", tactic, TACTICS)
  validation.check_choice(where, "schedule", schedule, SCHEDULES)
  validation.check_choice(where, "impl", impl, IMPLS)
  if not isinstance(lookahead, int) or isinstance(lookahead, bool) or lookahead < 1:
    raise ValueError(f"{where}: lookahead must be a positive int, got {lookahead!r}")
  if q_pos is None and jnp.ndim(q) == 4:
    b, t = jnp.shape(q)[:2]
    q_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + (kv.fill - t), (b, t))
  w = kv.window
  args = validation.attention_args(q, w.k, w.v, q_pos=q_pos, k_pos=w.pos, k_scale=w.k_scale,
                                   v_scale=w.v_scale, window=window, softcap=softcap, scale=scale,
                                   where=where)
  static = dict(n_tiles=kv.n_full_tiles, use_window=kv.window_cells > 0 and kv.fill > 0,
                use_staging=kv.n_staged > 0, causal=causal, window=window, softcap=softcap,
                scale=args.scale, impl=impl, schedule=schedule, lookahead=lookahead)
  return args.q_pos, static


def rolling_attention(q, kv, *, q_pos=None, causal=True, window=None, softcap=None, scale=None,
                      tactic="auto", impl="auto", schedule="scan", lookahead=1):
  """Exact attention of ``q [B,T,H,D]`` over every cell of ``kv``; returns ``(o, lse)``.

  Same semantics as :func:`rkv.attention` (DESIGN.md §3) over the cache's cells and positions;
  ``q_pos [B,T]`` defaults to the last T cells (``fill - T + arange(T)``).
  ``tactic``: one of ``TACTICS`` (``"auto"`` = ``"stream"``). ``impl``: the backend of every
  device partial (``"pallas"`` on GPU via ``"auto"``). ``schedule`` (``"scan"`` or
  ``"unrolled"``) and ``lookahead`` (tiles requested ahead of the one being attended) shape how
  the tail's transfers overlap compute; see :mod:`rkv.offload.stream`.
  """
  q_pos, static = _resolve(q, kv, q_pos=q_pos, causal=causal, window=window, softcap=softcap,
                           scale=scale, tactic=tactic, impl=impl, schedule=schedule,
                           lookahead=lookahead, where="rolling_attention")
  if not static["n_tiles"] and not static["use_staging"] and static["use_window"]:
    # The resident path: nothing lives off the window, so this is exactly rkv.attention.
    return _partial(q, q_pos, kv.window, impl=impl, causal=causal, window=window,
                    softcap=softcap, scale=static["scale"])
  return _rolling(q, q_pos, kv.window, kv.staging, kv.tail, **static)


def lower(q, kv, *, q_pos=None, causal=True, window=None, softcap=None, scale=None,
          tactic="auto", impl="auto", schedule="scan", lookahead=1,
          platforms: tuple[str, ...] | None = None) -> jax.stages.Lowered:
  """The lowered streamed program of the same ``rolling_attention`` call, for HLO reports:
  ``rkv.offload.hlo_report(rkv.rolling.lower(q, kv).compile().as_text())``. ``platforms``
  (e.g. ``("cuda",)``) lowers for another backend without compiling: on a CPU-only machine it
  shows the GPU program's placement ops (``rkv.offload.memory.placement_report``)."""
  q_pos, static = _resolve(q, kv, q_pos=q_pos, causal=causal, window=window, softcap=softcap,
                           scale=scale, tactic=tactic, impl=impl, schedule=schedule,
                           lookahead=lookahead, where="rolling.lower")
  traced = _rolling.trace(q, q_pos, kv.window, kv.staging, kv.tail, **static)
  return traced.lower(lowering_platforms=platforms)
