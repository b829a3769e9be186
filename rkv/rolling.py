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
  jitted merge — the mechanism that overlapped transfer and compute on the H200 (docs/DESIGN.md
  §5, §7). The tile program compiles once per
  tile shape; the merge once per number of tiles (every ``tile_cells`` decoded tokens).
- ``"unrolled"``: one jitted program taking the tiles as arguments, specialized on the number of
  full tiles (static, from the fill level): compiles once per flush.

Under an outer ``jax.jit`` (the cache's arrays or the query are tracers) the eager schedule cannot
run — it is a Python loop of dispatches over concrete arrays — so ``rolling_attention`` falls back
to ``"unrolled"``, which gives the same result.

Tactics (``TACTICS``; the planner, :mod:`rkv.planner`, picks one per layer — ``"auto"`` here
does **not** consult a profile: it is ``"stream"`` for a :class:`rkv.RollingKV` and ``"head"`` for
a :class:`rkv.head_split.HeadSplitKV`):

- ``"stream"``: the tail's full tiles are streamed to the device (the schedules above).
- ``"cpu"``: the tail's full tiles are attended on the host, where they live, by the C kernel
  :func:`rkv.offload.cpu_attention.cpu_attention_tail` (reads the ``pinned_host`` tiles in place;
  only ``q`` comes down to the host). The device partials (window, staging) are dispatched first,
  as one program, and the kernel then runs on the calling thread (it releases the GIL and is
  itself multi-threaded, by default on all cores but one: ``cpu_lib.tail_threads``), so host and
  device work overlap; its float32 ``(o, lse)`` then merges exactly with the device partials.
  Needs concrete arrays: under an outer ``jax.jit`` it raises ``ValueError``.
- ``"hybrid"``: the last ``floor(cpu_fraction * n + 0.5)`` full tiles go to the CPU kernel
  (``tiles=(start, n)``), the first ones stream through the schedule, both at once; exact merge.
  ``cpu_fraction`` (default 0.5) is the share attended on the CPU, i.e. ``1 -`` the planner's
  ``hybrid_fraction`` (the share streamed). Eager-only like ``"cpu"``. While the eager schedule
  streams tiles from the calling thread, the kernel runs in a worker thread; when every streamed
  tile is already on the device (a prefetcher's), the layer runs like ``"cpu"``.
- ``"head"``: a :class:`~rkv.head_split.HeadSplitKV` (the first R KV heads resident, the rest
  rolled): each part is attended with its query heads (``"stream"`` for the rolled part) and
  ``o``, ``lse`` are concatenated along the heads. Traceable.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import math
import os
import sys
import threading

import jax
import jax.numpy as jnp

from rkv.attention import IMPLS, MAX_DECODE_QUERIES, attention
from rkv import cache as cache_lib
from rkv import tactics as tactics_lib
from rkv import validation
from rkv import head_split
from rkv.head_split import HeadSplitKV
from rkv.offload import cpu_attention as cpu_lib
from rkv.offload import stream

# "auto": "stream" for a RollingKV, "head" for a HeadSplitKV (no profile is consulted here: the
# planner, rkv.planner, names each layer's tactic).
TACTICS = ("auto",) + tactics_lib.OFFLOADED
DEFAULT_CPU_FRACTION = tactics_lib.DEFAULT_CPU_FRACTION
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


def _partial_pair(q, q_pos, first, second, **kw):
  return _partial(q, q_pos, first, **kw), _partial(q, q_pos, second, **kw)


# The window's and the staging tile's partials (both on the device once the append is in) as one
# eager dispatch instead of two: each dispatch of a layer's chain cost ~0.2 ms of host time on the
# H200 host (the 2M int8 trace in benchmarks/results/beyond_hbm/session17/b/: 9 programs a
# layer). Two partials out, merged as before.
_partial_pair_jit = jax.jit(_partial_pair, static_argnames=_STATIC)


def _as_tile(block) -> stream.Tile:
  """A :class:`rkv.KVBlock` (or a tile) as a :class:`rkv.offload.stream.Tile`: the pytree every
  device partial's program takes, so blocks of one shape share one compiled program."""
  return stream.Tile(block.k, block.v, block.pos, block.k_scale, block.v_scale)


def _tiles_merged(q, q_pos, parts, tiles, *, out_dtype, **kw):
  """The partial of every tile of ``tiles`` (already on the device) merged with ``parts`` (the
  window's and staging's partials, dispatched before): one program."""
  return stream.merge_all(list(parts) + [_partial(q, q_pos, t, **kw) for t in tiles],
                          out_dtype=out_dtype)


# $RKV_TILES_ONE_PROGRAM=1: a hybrid layer whose streamed tiles are all on the device already
# (early puts, a Prefetcher's) attends them and merges every device partial in one program
# instead of a program per tile and a merge (2M int8: 3 tiles, 4 dispatches of ~0.2 ms of host
# time each, benchmarks/results/beyond_hbm/session17/b/). The window and staging partials stay a
# program of their own, dispatched first, so the window's HBM read still runs while the tiles
# cross PCIe (one program with them would wait for the last tile to start). Compiled once per
# number of streamed tiles. Off by default until measured on the H200.
TILES_ONE_PROGRAM_ENV = "RKV_TILES_ONE_PROGRAM"
# $RKV_EARLY_PUT_ALL=1: a hybrid layer's early puts (early_puts, early_tile_puts) request every
# tile it streams, not only the eager schedule's lookahead, so that $RKV_TILES_ONE_PROGRAM
# applies to layers that stream more tiles than the lookahead. Why: traced on an H100 host (1M
# int8, a 10 GiB tail, 5 streamed tiles a layer; benchmarks/results/beyond_hbm/session21/), the
# main thread was busy for the whole 6.8 ms layer: 4 tiles put early, then the window's program,
# a program per tile and a merge (0.17-0.55 ms of host time each, 2.96 ms in all), while the
# link idled 1.65 ms a layer. With both switches the link was busy 4.46 of 5.02 ms; untraced
# that host's steps were no faster (already at its link's time; docs/DESIGN.md §6). On the
# device: every streamed tile of the layer at once (~48 MB each there) where the lookahead keeps
# 4; the planner's reserve does not count them, so it is off by default (an experiment's switch
# until measured on the H200).
EARLY_PUT_ALL_ENV = "RKV_EARLY_PUT_ALL"
_tiles_merged_jit = jax.jit(_tiles_merged, static_argnames=_STATIC + ("out_dtype",))


def _tiles(kv: cache_lib.RollingKV, n: int, staged=None) -> tuple[stream.Tile, ...]:
  """The first ``n`` full tiles; the first ones replaced by ``staged`` (the same tiles already on
  the device, from a :class:`rkv.offload.stream.Prefetcher`)."""
  host = tuple(_as_tile(t) for t in kv.tail_tiles[:n])
  if not staged:
    return host
  m = min(len(staged), n)
  for j in range(m):
    if staged[j].k.shape != host[j].k.shape or staged[j].k.dtype != host[j].k.dtype:
      raise ValueError(f"rolling_attention: staged tile {j} has K {staged[j].k.dtype}"
                       f"{tuple(staged[j].k.shape)}, the cache's tile {host[j].k.dtype}"
                       f"{tuple(host[j].k.shape)}")
  return tuple(staged[:m]) + host[m:]


def _all_staged(tiles) -> bool:
  """Every tile already on the device (a prefetcher requested them): nothing is left to overlap,
  so the device partials and their merge run as one jitted program (the unrolled schedule, whose
  in-program moves are no-ops on device arrays) instead of one dispatch per partial: on the H200
  the eager dispatches of a 128K half-offloaded hybrid layer took 1.8 ms of host time
  (decode_trace_h200_prefetch.json), the host being that row's bottleneck."""
  return bool(tiles) and all(stream.on_device(t) for t in tiles)


def streamed_tiles(kv: cache_lib.RollingKV) -> tuple[stream.Tile, ...]:
  """The host tiles a step's attention over ``kv`` streams to the device, in order, with the
  cache's own tactic and CPU share: what a prefetcher may request ahead of the layer."""
  n = streamed_count(kv.n_full_tiles, kv.tactic, kv.cpu_fraction)
  return _tiles(kv, n) if n else ()


def streamed_count(n_tiles: int, tactic: str, cpu_fraction: float | None) -> int:
  """How many of ``n_tiles`` full tail tiles ``tactic`` streams: all for ``stream``, none for
  ``cpu``, the first ``n - floor(cpu_fraction * n + 0.5)`` for ``hybrid`` (the others go to the
  CPU kernel); the streamed ones are always a prefix, so a prefetcher can request them early."""
  if tactic == "cpu":
    return 0
  if tactic == "hybrid":
    frac = DEFAULT_CPU_FRACTION if cpu_fraction is None else cpu_fraction
    return n_tiles - math.floor(frac * n_tiles + 0.5)  # half up
  return n_tiles


# $RKV_EARLY_PUTS=0 / $RKV_EARLY_CPU=0 turn early_puts / early_cpu_share off (same-run A/Bs; on
# by default), read at each call.
EARLY_PUTS_ENV = "RKV_EARLY_PUTS"
EARLY_CPU_ENV = "RKV_EARLY_CPU"
# $RKV_EARLY_Q_COPY=1: early_cpu_share requests the query's device -> host copy itself, before it
# submits the CPU share. Why (the 2M int8 trace, benchmarks/results/beyond_hbm/session17/b/): the
# worker's np.asarray(q) began 0.9 ms into the layer, PJRT dispatched its copy 0.2 ms later, and
# the copy ran 0.4 ms after that, queued on PJRT's host threads behind the layer's tile puts;
# the whole q_to_host span was 0.6-0.8 ms of a 5.3 ms layer, on its critical path (q copy, CPU
# kernel, merge, next layer's join). Off by default until measured on the H200.
EARLY_Q_COPY_ENV = "RKV_EARLY_Q_COPY"
# $RKV_WORKER_FIRST=1: early_cpu_share returns only once the worker has started (or after
# WORKER_FIRST_TIMEOUT_S, should both workers be busy), so the worker holds the GIL first and
# runs its query copy and setup up to the kernel call (which releases it) before this thread
# goes on with the layer's puts and append; while the query is not ready yet, it waits with the
# GIL released and this thread runs. Why: in the 2M int8 trace the worker started 0.84 ms into the
# layer, when this thread first released the GIL, and its setup ran while this thread dispatched.
# Session 7 waited instead until the kernel had started, the tiles' puts behind it, and measured
# slower at 1M and 128K half, where the link is the bound (docs/DESIGN.md §7); with
# $RKV_NEXT_PUTS those puts were issued in the previous layer's wait. Off by default until
# measured on the H200.
WORKER_FIRST_ENV = "RKV_WORKER_FIRST"
WORKER_FIRST_TIMEOUT_S = 0.002


def _append_fills_tile(kv: cache_lib.RollingKV, t_new: int) -> bool:
  """Whether appending ``t_new`` cells to ``kv`` flushes a full tile into its tail (the CPU
  share's tiles, fixed before the append otherwise, then change)."""
  return max(kv.fill + t_new - kv.window_cells, 0) // kv.tile_cells != kv.n_full_tiles


def early_puts(kv, q, *, tactic: str, cpu_fraction: float | None,
               schedule: str = DEFAULT_SCHEDULE,
               lookahead: int | None = DEFAULT_LOOKAHEAD) -> tuple[stream.Tile, ...] | None:
  """The first tiles a hybrid decode step of ``q [B,T,H,D]`` will stream from ``kv``, their
  host→device transfers issued now, for ``rolling_attention(staged=...)``; None when nothing
  applies (not the eager schedule, not ``hybrid``, a prefill chunk, nothing streamed, traced
  arrays).

  What it is for: :meth:`rkv.RollingKV.attend` calls it before its append, so the link starts on
  the layer's tiles while the host still dispatches the append. Traced on the H200 (128K
  half-offloaded, 2 of 3 tiles streamed a layer, benchmarks/results/beyond_hbm/session5/xplane/):
  the link idled ~1.07 ms of every ~4.4 ms layer, from the end of one layer's copies to the
  next layer's first copy, ~0.45 ms of it the append's host dispatch. With this alone the first
  copy started 0.56 ms earlier in the layer, but the puts cost the host ~0.5 ms themselves and the
  step did not move (6.91 vs 6.89 tok/s, session5/b/); with :func:`early_cpu_share` too, 1M ran
  faster (below). The streamed tiles are a prefix of the full tiles and full tiles are never
  rewritten (a flush adds one at the end), so the tiles requested before the append are the ones
  attended after it; as many as the eager schedule would request up front (``lookahead``), so no
  more device memory than without it."""
  if _tracing(q, kv):
    return None
  return early_tile_puts(kv, jnp.shape(q)[1], tactic=tactic, cpu_fraction=cpu_fraction,
                         schedule=schedule, lookahead=lookahead)


def early_tile_puts(kv, n_queries: int, *, tactic: str, cpu_fraction: float | None,
                    schedule: str = DEFAULT_SCHEDULE,
                    lookahead: int | None = DEFAULT_LOOKAHEAD) -> tuple[stream.Tile, ...] | None:
  """:func:`early_puts` for a step of ``n_queries`` queries, before its query exists (``kv``
  concrete): ``layered_forward`` puts a host-share layer's tiles before the program that makes
  its query, so that their copies are enqueued before the share's kernel takes the host's cores
  (docs/DESIGN.md §6)."""
  if (not validation.env_switch(EARLY_PUTS_ENV, True) or schedule != "eager"
      or not isinstance(kv, cache_lib.RollingKV) or n_queries > MAX_DECODE_QUERIES):
    return None
  if tactic != "hybrid":
    # Measured on the H200 for hybrid layers only. A stream layer whose tiles all came early would
    # also change path (one program over staged tiles, not the eager per-tile one): unmeasured.
    return None
  n = streamed_count(kv.n_full_tiles, tactic, cpu_fraction)
  if validation.env_switch(EARLY_PUT_ALL_ENV, False):
    lookahead = None
  depth = n if lookahead is None else min(lookahead, n)
  if depth <= 0:
    return None
  return tuple(stream.put_many_eager(_tiles(kv, depth)))


def early_cpu_share(kv, q, q_pos, t_new: int, *, tactic: str, cpu_fraction: float | None,
                    causal=True, window=None, softcap=None, scale=None, impl="auto",
                    schedule: str = DEFAULT_SCHEDULE, lookahead=DEFAULT_LOOKAHEAD,
                    cpu_threads=None):
  """Starts the CPU share of a hybrid decode step over ``kv`` before ``t_new`` cells are
  appended to it: the future for ``_rolling_attention(cpu_future=...)``, or None when that does
  not apply ($RKV_EARLY_CPU=0, not eager, not ``hybrid``, nothing streamed or nothing on the CPU,
  a prefill chunk, traced arrays, or an append that fills a tile: then the tiles change).

  Why: on the H200 a hybrid layer's critical path is the CPU chain (q down, the kernel, its
  partial up, the merge, the next layer's q) more than the link: traced at 128K half-offloaded
  (benchmarks/results/beyond_hbm/session5/xplane/), the link was busy 3.3 ms of a ~4.4 ms layer
  while the worker started only after the host had dispatched the append, ~0.7-1 ms into it. The
  CPU share reads only q and the full tail tiles ``[n_stream, n_full)``; an append that fills no
  tile changes neither (new cells go to the window or the staging buffer, attended on the
  device).

  Measured with :func:`early_puts` (both on or both off, $RKV_EARLY_CPU / $RKV_EARLY_PUTS; 1M
  tokens, default budget, three alternating pairs in one run, session5/e/): 7.63 / 7.18 / 7.58
  tok/s on, 7.05 / 6.53 / 7.25 off (medians 7.58 vs 7.05). At 128K half-offloaded it is within
  the run-to-run spread: 7.17 on against 6.55 and 7.12 off, run before and after it (session5/d/).
  What it costs: the kernel now runs while this thread dispatches, and the 16 host cores are
  then oversubscribed (15 kernel threads, this thread, PJRT's). In a trace on a slow machine
  (session5/c/, where this row ran 4.00 tok/s with both off) the kernel took 3.7 ms and the
  append 1.1 ms (medians), against 1.8 and 0.5 ms in a trace without the early CPU share on
  another machine (session5/b/); 12 and 10 kernel threads were not faster (6.98, 6.16 tok/s,
  session5/d/)."""
  if (not validation.env_switch(EARLY_CPU_ENV, True) or schedule != "eager" or tactic != "hybrid"
      or not isinstance(kv, cache_lib.RollingKV) or jnp.shape(q)[1] > MAX_DECODE_QUERIES
      or _tracing(q, q_pos, kv)):
    return None
  n_tiles = kv.n_full_tiles
  if _append_fills_tile(kv, t_new):
    return None
  n_stream = streamed_count(n_tiles, tactic, cpu_fraction)
  if not 0 < n_stream < n_tiles:
    return None
  q_pos, static = _resolve(q, kv, q_pos=q_pos, causal=causal, window=window, softcap=softcap,
                           scale=scale, tactic=tactic, impl=impl, schedule=schedule,
                           lookahead=lookahead, where="early_cpu_share")
  cpu_kw = _cpu_kwargs(q, q_pos, static, n_stream=n_stream, n_tiles=n_tiles,
                       cpu_threads=cpu_threads)
  if isinstance(q, jax.Array) and validation.env_switch(EARLY_Q_COPY_ENV, False):
    q.copy_to_host_async()  # the worker's np.asarray(q) then finds it in flight or done
  if not validation.env_switch(WORKER_FIRST_ENV, False):
    return _executor().submit(_annotated_cpu_tail, q, kv, **cpu_kw)
  started = threading.Event()

  def share():
    started.set()  # this thread holds the GIL now, and keeps it until it blocks (q, the kernel)
    return _annotated_cpu_tail(q, kv, **cpu_kw)

  future = _executor().submit(share)
  started.wait(WORKER_FIRST_TIMEOUT_S)  # the GIL is released while this waits
  return future


def _resident_parts(q, q_pos, window_block, staging_block, *, use_window, use_staging,
                    partial_fn, kw) -> list:
  """The window's and the staging tile's partials (those in use): one dispatch for both when
  eager (``_partial_pair_jit``), else one ``partial_fn`` call each."""
  if use_window and use_staging and partial_fn is _partial_jit:
    return list(_partial_pair_jit(q, q_pos, window_block, staging_block, **kw))
  parts = []
  if use_window:
    parts.append(partial_fn(q, q_pos, window_block, **kw))
  if use_staging:
    parts.append(partial_fn(q, q_pos, staging_block, **kw))
  return parts


def _stream(q, q_pos, window_block, staging_block, tiles, *, use_window, use_staging, causal,
            window, softcap, scale, impl, schedule, lookahead, partial_fn, out_dtype=None):
  kw = dict(causal=causal, window=window, softcap=softcap, scale=scale, impl=impl)
  # Tiles, not KVBlocks: the staging partial then reuses the tile program (same pytree, shapes).
  window_block, staging_block = _as_tile(window_block), _as_tile(staging_block)

  resident = functools.partial(_resident_parts, q, q_pos, window_block, staging_block,
                               use_window=use_window, use_staging=use_staging,
                               partial_fn=partial_fn, kw=kw)
  return stream.stream_attention(tiles, lambda tile: partial_fn(q, q_pos, tile, **kw),
                                 schedule=schedule, lookahead=lookahead, resident=resident,
                                 out_shape=q.shape,
                                 out_dtype=q.dtype if out_dtype is None else out_dtype)


@functools.partial(jax.jit, static_argnames=(
    "use_window", "use_staging", "causal", "window", "softcap", "scale", "impl", "lookahead",
    "out_dtype"))
def _unrolled(q, q_pos, window_block, staging_block, tiles, *, use_window, use_staging, causal,
              window, softcap, scale, impl, lookahead, out_dtype=None):
  return _stream(q, q_pos, window_block, staging_block, tiles, use_window=use_window,
                 use_staging=use_staging, causal=causal, window=window, softcap=softcap,
                 scale=scale, impl=impl, schedule="unrolled", lookahead=lookahead,
                 partial_fn=_partial, out_dtype=out_dtype)


def _tracing(*trees) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(trees))


def _resolve(q, kv, *, q_pos, causal, window, softcap, scale, tactic, impl, schedule, lookahead,
             where):
  """Validates one call; returns (q_pos, static kwargs of the schedules)."""
  if not isinstance(kv, cache_lib.RollingKV):
    raise ValueError(f"{where}: kv must be a rkv.RollingKV, got {type(kv).__name__}")
  cache_lib.check_live_parts(kv, where)
  validation.check_choice(where, "tactic", tactic, TACTICS)
  if tactic == "head":
    raise ValueError(f"{where}: tactic='head' needs kv to be a rkv.head_split.HeadSplitKV "
                     f"(some KV heads resident, the others rolled), got a RollingKV")
  validation.check_choice(where, "schedule", schedule, SCHEDULES)
  validation.check_choice(where, "impl", impl, IMPLS)
  stream.check_lookahead(lookahead, where)
  if q_pos is None and jnp.ndim(q) == 4:
    b, t = jnp.shape(q)[:2]
    q_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + (kv.fill - t), (b, t))
  w = kv.window
  args = validation.attention_args(q, w.k, w.v, q_pos=q_pos, k_pos=w.pos, k_scale=w.k_scale,
                                   v_scale=w.v_scale, window=window, softcap=softcap, scale=scale,
                                   causal=causal, where=where)
  static = dict(use_window=kv.window_cells > 0 and kv.fill > 0, use_staging=kv.n_staged > 0,
                causal=causal, window=window, softcap=softcap, scale=args.scale, impl=impl,
                lookahead=lookahead)
  return args.q_pos, static


_EXECUTOR = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> concurrent.futures.ThreadPoolExecutor:
  """The worker threads of the CPU tail kernel (it releases the GIL and spreads over the cores
  itself with OpenMP; a second worker lets another caller's layer queue without blocking)."""
  global _EXECUTOR
  with _EXECUTOR_LOCK:
    if _EXECUTOR is None:
      _EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=2,
                                                        thread_name_prefix="rkv-cpu-tail")
    return _EXECUTOR


# $RKV_SWITCH_INTERVAL_US: Python's GIL switch interval (sys.setswitchinterval, default 5000 us)
# while a layered step with cpu / hybrid layers runs, restored after it (unset: Python's own).
# Why: a thread that wants the GIL waits until the holder blocks in C or the interval passes, and
# the CPU share's worker needs it to start, to return from its query copy and to set up the
# kernel, while the main thread runs the layer's dispatches in Python: in the 2M int8 trace
# (benchmarks/results/beyond_hbm/session17/b/) the worker began 0.9 ms after the layer did,
# right when the main thread first released the GIL (in its first tile put). A short interval
# bounds each such wait. Process-wide while it is set (other threads see it too). Unmeasured on
# the H200 as yet: an A/B switch, off by default.
SWITCH_INTERVAL_ENV = "RKV_SWITCH_INTERVAL_US"


def switch_interval_from_env() -> float | None:
  """``$RKV_SWITCH_INTERVAL_US`` in seconds, None when unset or empty; a ValueError names the
  variable for anything but a positive number of microseconds."""
  raw = os.environ.get(SWITCH_INTERVAL_ENV, "").strip()
  if not raw:
    return None
  try:
    us = float(raw)
  except ValueError:
    us = float("nan")
  if not us > 0 or math.isinf(us):
    raise ValueError(f"${SWITCH_INTERVAL_ENV} must be a positive number of microseconds (Python's "
                     f"default is 5000), got {raw!r}")
  return us * 1e-6


@contextlib.contextmanager
def host_kernel_switch_interval(caches):
  """Within: the GIL switch interval of ``$RKV_SWITCH_INTERVAL_US`` when any of ``caches`` is a
  :class:`rkv.RollingKV` whose tactic runs the CPU kernel (``cpu`` / ``hybrid``); Python's
  interval is restored on the way out, also on an error. Otherwise (or with the variable unset)
  nothing changes."""
  interval = switch_interval_from_env()
  if interval is None or not any(isinstance(c, cache_lib.RollingKV)
                                 and c.tactic in tactics_lib.HOST_KERNEL for c in caches):
    yield
    return
  before = sys.getswitchinterval()
  sys.setswitchinterval(interval)
  try:
    yield
  finally:
    sys.setswitchinterval(before)


_check_fraction = tactics_lib.check_cpu_fraction


def _head_attention(q, kv: HeadSplitKV, *, q_pos, tactic, where, **kw):
  """The ``head`` tactic: each part with its query heads, concatenated along H."""
  if tactic not in ("auto", "head"):
    raise ValueError(f"{where}: a HeadSplitKV is served by tactic='head' (or 'auto'), got "
                     f"tactic={tactic!r}")
  if jnp.ndim(q) != 4:
    raise ValueError(f"{where}: q must be rank 4 ([B,T,H,D]), got shape {jnp.shape(q)}")
  h, kh, r = jnp.shape(q)[2], kv.num_kv_heads, kv.resident_heads
  if h % kh:
    raise ValueError(f"{where}: q heads H={h} must be a multiple of kv heads K={kh}")
  g = h // kh
  if q_pos is None:
    b, t = jnp.shape(q)[:2]
    q_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + (kv.fill - t), (b, t))
  outs = []
  # The rolled heads first: their tail transfers are issued before the resident heads' partial
  # is dispatched, so the copy engine starts at once and that partial runs under the transfers.
  if kv.rolled is not None:
    outs.append(rolling_attention(head_split.take_heads(q, r * g, h), kv.rolled, q_pos=q_pos,
                                  tactic="stream", **kw))
  if kv.resident is not None:
    outs.insert(0, rolling_attention(head_split.take_heads(q, 0, r * g), kv.resident,
                                     q_pos=q_pos, tactic="stream", **kw))
  if len(outs) == 1:
    return outs[0]
  return (jnp.concatenate([o for o, _ in outs], axis=2),
          jnp.concatenate([lse for _, lse in outs], axis=2))


def rolling_attention(q, kv, *, q_pos=None, causal=True, window=None, softcap=None, scale=None,
                      tactic="auto", impl="auto", schedule=DEFAULT_SCHEDULE,
                      lookahead=DEFAULT_LOOKAHEAD, cpu_fraction=None, cpu_threads=None,
                      staged=None):
  """Exact attention of ``q [B,T,H,D]`` over every cell of ``kv``; returns ``(o, lse)``.

  Same semantics as :func:`rkv.attention` (docs/DESIGN.md §2) over the cache's cells and positions;
  ``q_pos [B,T]`` defaults to the last T cells (``fill - T + arange(T)``).
  ``kv``: a :class:`rkv.RollingKV`, or a :class:`rkv.head_split.HeadSplitKV` (tactic ``"head"``).
  ``tactic``: one of ``TACTICS`` (see the module docstring): ``"auto"`` is ``"stream"`` for a
  RollingKV and ``"head"`` for a HeadSplitKV — it does not consult a profile (the planner,
  :mod:`rkv.planner`, names each layer's tactic); ``"cpu"`` attends to the tail's full tiles on
  the host CPU concurrently with the device partials; ``"hybrid"`` sends the last
  ``floor(cpu_fraction * n_full_tiles + 0.5)`` tiles to the CPU and streams the others, concurrently.
  ``"cpu"`` and ``"hybrid"`` need concrete arrays (``ValueError`` under an outer ``jax.jit``).
  ``cpu_fraction``: ``"hybrid"`` only, in [0, 1], default 0.5. ``cpu_threads``: the CPU kernel's
  threads (default :func:`rkv.offload.cpu_attention.tail_threads`: OpenMP's default minus one,
  leaving a core to the thread that dispatches the device work; ``$RKV_CPU_TAIL_THREADS``
  overrides it for the process). ``impl``: the backend of every
  device partial (``"pallas"`` on GPU via ``"auto"``). ``schedule``: ``"eager"`` (default;
  per-tile eager transfers overlapping separately dispatched partials) or ``"unrolled"`` (one
  jitted program); under an outer ``jax.jit`` ``"eager"`` falls back to ``"unrolled"``.
  ``lookahead``: tiles requested ahead of the one being attended (default 4; the eager schedule
  then holds at most ``lookahead + 1`` tiles on the device and waits on the host for tile
  ``i - 1`` before issuing tile ``i + lookahead``); ``None`` issues every transfer up front and
  never waits, at the cost of the whole streamed tail in device memory during the call. See
  :mod:`rkv.offload.stream`. ``staged``: the first streamed tiles already on the device, in order
  (a :class:`rkv.offload.stream.Prefetcher`'s, requested while earlier layers ran); the rest are
  requested here as usual. They must be copies of this cache's tiles: only shapes are checked.
  """
  return _rolling_attention(q, kv, q_pos=q_pos, causal=causal, window=window, softcap=softcap,
                            scale=scale, tactic=tactic, impl=impl, schedule=schedule,
                            lookahead=lookahead, cpu_fraction=cpu_fraction,
                            cpu_threads=cpu_threads, staged=staged)


def _rolling_attention(q, kv, *, q_pos, causal, window, softcap, scale, tactic, impl, schedule,
                       lookahead, cpu_fraction, cpu_threads, staged, cpu_future=None, merge=True,
                       while_waiting=None):
  """:func:`rolling_attention`; ``cpu_future``: the hybrid CPU share already started by
  :func:`early_cpu_share` for these tiles (RollingKV.attend's decode step). ``merge=False``
  returns the partials unmerged, a tuple of ``(o, lse)`` pairs (:func:`merge_parts` merges them):
  a ``cpu`` / ``hybrid`` layer's device partial (if any) and the CPU kernel's (numpy), else the
  one merged partial. ``while_waiting()``: called once, with no arguments, when this thread has
  dispatched the layer's device work and is about to wait for its CPU share in the worker (so
  host work placed there, such as the next layer's tile puts, costs the layer nothing); on every
  other path, after the call's own work. Its exceptions propagate, after the CPU share is done."""
  hook = _Once(while_waiting) if while_waiting is not None else None
  out = _rolling_parts(q, kv, q_pos=q_pos, causal=causal, window=window, softcap=softcap,
                       scale=scale, tactic=tactic, impl=impl, schedule=schedule,
                       lookahead=lookahead, cpu_fraction=cpu_fraction, cpu_threads=cpu_threads,
                       staged=staged, cpu_future=cpu_future, merge=merge, while_waiting=hook)
  if hook is not None:
    hook()  # a no-op when the worker path already called it
  if merge:
    return out
  return tuple(out) if isinstance(out, _Parts) else (out,)


class _Parts(tuple):
  """The unmerged partials of a ``cpu`` / ``hybrid`` layer (``merge=False``)."""


class _Once:
  """``fn`` called at most once, however often this is."""

  def __init__(self, fn):
    self._fn = fn

  def __call__(self):
    fn, self._fn = self._fn, None
    if fn is not None:
      fn()


def merge_parts(parts, out_dtype):
  """``(o, lse)`` of the partials :meth:`rkv.RollingKV.attend` returns with ``merge=False``,
  merged exactly (float32 LSE; ``o`` cast to ``out_dtype``). Traceable: a caller merges them
  inside its next program (``layered_forward``: with ``post_attention`` and the next layer's
  ``pre_attention``), one dispatch instead of three."""
  return stream.merge_all(list(parts), out_dtype=out_dtype)


def _rolling_parts(q, kv, *, q_pos, causal, window, softcap, scale, tactic, impl, schedule,
                   lookahead, cpu_fraction, cpu_threads, staged, cpu_future, merge,
                   while_waiting=None):
  where = "rolling_attention"
  common = dict(causal=causal, window=window, softcap=softcap, scale=scale, impl=impl,
                schedule=schedule, lookahead=lookahead)
  if isinstance(kv, HeadSplitKV):
    if cpu_fraction is not None or cpu_threads is not None or staged:
      raise ValueError(f"{where}: cpu_fraction/cpu_threads/staged are not valid with a "
                       f"HeadSplitKV (tactic='head' streams the rolled heads)")
    return _head_attention(q, kv, q_pos=q_pos, tactic=tactic, where=where, **common)
  q_pos, static = _resolve(q, kv, q_pos=q_pos, causal=causal, window=window, softcap=softcap,
                           scale=scale, tactic=tactic, impl=impl, schedule=schedule,
                           lookahead=lookahead, where=where)
  cpu_fraction = _check_fraction(cpu_fraction, tactic, where)
  if tactic == "cpu":
    cpu_fraction = 1.0
  if cpu_threads is not None and tactic not in ("cpu", "hybrid"):
    raise ValueError(f"{where}: cpu_threads is only valid with tactic='cpu' or 'hybrid', got "
                     f"tactic={tactic!r}")
  n_tiles = kv.n_full_tiles
  if tactic in ("cpu", "hybrid") and _tracing(q, q_pos, kv):
    raise ValueError(f"{where}: tactic={tactic!r} runs the tail's attention on the host CPU over "
                     f"concrete arrays and cannot run under jax.jit (q, q_pos or the cache are "
                     f"tracers); use tactic='stream' inside jit")
  if not n_tiles and not static["use_staging"] and static["use_window"]:
    # The resident path: nothing lives off the window, so this is exactly rkv.attention, as one
    # jitted program (eager op-by-op dispatch of the kernel's wrapper cost ~0.4 ms on the H200).
    fn = _partial if _tracing(q, q_pos, kv) else _partial_jit
    return fn(q, q_pos, kv.window, impl=impl, causal=causal, window=window, softcap=softcap,
              scale=static["scale"])
  n_stream = streamed_count(n_tiles, "stream" if cpu_fraction is None else "hybrid",
                            cpu_fraction)
  if n_stream < n_tiles:
    return _with_cpu_tail(q, q_pos, kv, static, n_stream=n_stream, schedule=schedule,
                          cpu_threads=cpu_threads, staged=staged, cpu_future=cpu_future,
                          merge=merge, while_waiting=while_waiting)
  tiles = _tiles(kv, n_tiles, staged)
  if schedule == "eager" and not _tracing(q, q_pos, kv) and not _all_staged(tiles):
    return _stream(q, q_pos, kv.window, kv.staging, tiles, schedule="eager",
                   partial_fn=_partial_jit, **static)
  return _unrolled(q, q_pos, kv.window, kv.staging, tiles, **static)


def _annotated_cpu_tail(*args, **kwargs):
  with jax.profiler.TraceAnnotation("rkv.cpu.tail"):  # the worker's whole share, in traces
    return cpu_lib.cpu_attention_tail(*args, **kwargs)


def _cpu_kwargs(q, q_pos, static, *, n_stream, n_tiles, cpu_threads) -> dict:
  # out: the partial written into fresh pinned_host arrays, which the merge's program reads
  # without a transfer of its own to wait for (rkv.offload.cpu_attention.PinnedOutputs).
  return dict(q_pos=q_pos, causal=static["causal"], window=static["window"],
              softcap=static["softcap"], scale=static["scale"],
              num_threads=cpu_lib.tail_threads(cpu_threads), tiles=(n_stream, n_tiles),
              out=cpu_lib.pinned_outputs(q))


def _with_cpu_tail(q, q_pos, kv, static, *, n_stream, schedule, cpu_threads, staged=None,
                   cpu_future=None, merge=True, while_waiting=None):
  """Tiles ``[n_stream, n_full_tiles)`` on the host CPU, the window, staging and tiles
  ``[0, n_stream)`` on the device meanwhile; one exact merge. The CPU share runs in a worker
  thread while this one streams tiles eagerly, else on this thread after the device partials
  (one program) are dispatched."""
  n_tiles = kv.n_full_tiles
  # Built only where a share starts here (a started one, cpu_future, holds its own output pair).
  cpu_kw = lambda: _cpu_kwargs(q, q_pos, static, n_stream=n_stream, n_tiles=n_tiles,
                               cpu_threads=cpu_threads)
  device_part = n_stream or static["use_window"] or static["use_staging"]
  tiles = _tiles(kv, n_stream, staged)
  if schedule != "eager" or not n_stream:
    # Nothing streams: the device partials are one program, dispatched first, and the CPU share
    # runs on this thread while the GPU computes them (its kernel releases the GIL). A worker
    # thread would only contend for the GIL with this one: on the H200 that stretched a 128K
    # half-offloaded hybrid layer's query copy to 0.67 ms and its wait to 2.2 ms
    # (decode_trace_h200_offload.json). Streamed tiles already on the device (early puts, a
    # Prefetcher's) take the worker path below, where this thread only dispatches while the kernel
    # runs: with the kernel on this thread (a Prefetcher of 4 tiles, 128K half-offloaded) it took
    # 2.7 ms (median) against the worker's 1.55 without one, and the Prefetcher ran 4.19 tok/s
    # against 7.45 off (beyond_hbm/session4/a/); on the worker path, 6.44 against 6.89
    # (beyond_hbm/session5/b/).
    device = None
    if device_part:
      with jax.profiler.TraceAnnotation("rkv.stream.dispatch"):
        device = _unrolled(q, q_pos, kv.window, kv.staging, tiles, out_dtype=jnp.float32,
                           **static)
    o_cpu, lse_cpu = _annotated_cpu_tail(q, kv, **cpu_kw())
    return _merge_cpu(q, device, o_cpu, lse_cpu, merge=merge)
  # The eager stream issues transfers while the CPU works: the kernel runs in a worker thread,
  # started at once: it copies q (and q_pos) down itself (np.asarray: a small device → host
  # copy), and reads the tail tiles in place; the GIL is released while it runs.
  future = cpu_future or _executor().submit(_annotated_cpu_tail, q, kv, **cpu_kw())
  device = None
  try:
    with jax.profiler.TraceAnnotation("rkv.stream.dispatch"):
      device = _eager_device_part(q, q_pos, kv, tiles, static)
    if while_waiting is not None:
      with jax.profiler.TraceAnnotation("rkv.while_waiting"):
        while_waiting()
  finally:
    with jax.profiler.TraceAnnotation("rkv.cpu.wait"):
      o_cpu, lse_cpu = future.result()  # waits for the kernel (and surfaces its errors)
  return _merge_cpu(q, device, o_cpu, lse_cpu, merge=merge)


def _eager_device_part(q, q_pos, kv, tiles, static):
  """The float32 device partial of a cpu / hybrid layer that streams ``tiles`` (at least one)
  on the eager schedule: window, staging and those tiles, merged."""
  if validation.env_switch(TILES_ONE_PROGRAM_ENV, False) and _all_staged(tiles):
    return _staged_device_part(q, q_pos, kv, tiles, static)
  return _stream(q, q_pos, kv.window, kv.staging, tiles, schedule="eager",
                 partial_fn=_partial_jit, out_dtype=jnp.float32, **static)


def external_share_applies(kv, t_new: int, *, schedule: str = DEFAULT_SCHEDULE) -> bool:
  """Whether a decode step of ``t_new`` queries over ``kv`` may leave its CPU tiles to an external
  share (:class:`rkv.offload.host_share.HostShare`): a ``cpu`` / ``hybrid``
  :class:`rkv.RollingKV` with tiles on the CPU, a decode step (``t_new <= MAX_DECODE_QUERIES``)
  on the eager schedule, and an append that fills no tile (the CPU tiles are fixed before it)."""
  if not isinstance(kv, cache_lib.RollingKV) or kv.tactic not in tactics_lib.HOST_KERNEL:
    return False
  if t_new > MAX_DECODE_QUERIES or schedule != "eager" or _tracing(kv):
    return False
  if _append_fills_tile(kv, t_new):
    return False
  n_tiles = kv.n_full_tiles
  return streamed_count(n_tiles, kv.tactic, kv.cpu_fraction) < n_tiles


def cpu_share_tiles(kv) -> tuple[int, int]:
  """``(start, stop)``: the full tail tiles a ``cpu`` / ``hybrid`` decode step of ``kv`` attends
  on the CPU (the streamed ones are the tiles before ``start``)."""
  n = kv.n_full_tiles
  return streamed_count(n, kv.tactic, kv.cpu_fraction), n


def device_part(q, kv, *, q_pos, causal=True, window=None, softcap=None, scale=None,
                impl="auto", lookahead=DEFAULT_LOOKAHEAD, staged=None):
  """The float32 ``(o, lse)`` of a ``cpu`` / ``hybrid`` decode step's device side over ``kv``
  (after its append): the window, staging and the streamed tiles ``[0, start)`` of
  :func:`cpu_share_tiles`, on the eager schedule; the CPU tiles are left to an external share,
  whose partial the caller merges (exactly, by LSE) with this one."""
  where = "rolling.device_part"
  q_pos, static = _resolve(q, kv, q_pos=q_pos, causal=causal, window=window, softcap=softcap,
                           scale=scale, tactic=kv.tactic, impl=impl, schedule="eager",
                           lookahead=lookahead, where=where)
  n_stream, _ = cpu_share_tiles(kv)
  if n_stream:
    with jax.profiler.TraceAnnotation("rkv.stream.dispatch"):
      return _eager_device_part(q, q_pos, kv, _tiles(kv, n_stream, staged), static)
  if not (static["use_window"] or static["use_staging"]):
    b, t, h, _ = q.shape
    return jnp.zeros(q.shape, jnp.float32), jnp.full((b, t, h), -jnp.inf, jnp.float32)
  with jax.profiler.TraceAnnotation("rkv.stream.dispatch"):
    return _unrolled(q, q_pos, kv.window, kv.staging, (), out_dtype=jnp.float32, **static)


def _staged_device_part(q, q_pos, kv, tiles, static):
  """The device partial of a hybrid layer whose streamed ``tiles`` are all on the device: the
  window and staging partials (one program), then the tiles' partials merged with them (another;
  ``$RKV_TILES_ONE_PROGRAM``)."""
  kw = {n: static[n] for n in _STATIC}
  parts = _resident_parts(q, q_pos, _as_tile(kv.window), _as_tile(kv.staging),
                          use_window=static["use_window"], use_staging=static["use_staging"],
                          partial_fn=_partial_jit, kw=kw)
  return _tiles_merged_jit(q, q_pos, tuple(parts), tuple(tiles), out_dtype=jnp.float32, **kw)


def _merge_cpu(q, device, o_cpu, lse_cpu, *, merge=True):
  """The CPU partial (numpy float32, or pinned_host arrays) moved to q's device and merged with
  the device one (``merge=False``: the two partials, unmerged, as :class:`_Parts`)."""
  # next(iter(...)), not pop(): a NamedSharding caches its device set, and popping it would
  # empty the set every array of that sharding reports.
  dev = next(iter(q.devices())) if isinstance(q, jax.Array) else None
  with jax.profiler.TraceAnnotation("rkv.cpu.merge"):
    if isinstance(o_cpu, jax.Array) or dev is None or dev == jax.devices()[0]:
      # pinned_host arrays of q's device (cpu_lib.pinned_outputs), which merge_all's program
      # moves to the device itself; or numpy into the jitted merge, which the dispatch moves to
      # the default device on its C++ path (an eager jax.device_put first cost a Python call per
      # layer).
      cpu_part = (o_cpu, lse_cpu)
    else:
      cpu_part = tuple(jax.device_put((o_cpu, lse_cpu), dev))
    parts = [cpu_part] if device is None else [device, cpu_part]
    if not merge:
      return _Parts(parts)
    return stream._merge_jit(parts, out_dtype=q.dtype)


def lower(q, kv, *, q_pos=None, causal=True, window=None, softcap=None, scale=None,
          tactic="auto", impl="auto", schedule="unrolled", lookahead=DEFAULT_LOOKAHEAD,
          platforms: tuple[str, ...] | None = None) -> jax.stages.Lowered:
  """The lowered single program of the same ``rolling_attention`` call with
  ``schedule="unrolled"``, for HLO reports:
  ``rkv.offload.hlo_report(rkv.rolling.lower(q, kv).compile().as_text())``. ``platforms``
  (e.g. ``("cuda",)``) lowers for another backend without compiling: on a CPU-only machine it
  shows the GPU program's placement ops (``rkv.offload.memory.placement_report``). The eager
  schedule is a sequence of programs and has no single lowering: ``schedule="eager"`` is refused."""
  if tactic not in ("auto", "stream"):
    raise ValueError(f"rolling.lower: tactic={tactic!r} has no single lowering (only 'stream' "
                     f"is one jitted program)")
  if schedule == "eager":
    raise ValueError("rolling.lower: schedule='eager' dispatches one program per partial and has "
                     "no single lowering; lower schedule='unrolled'")
  q_pos, static = _resolve(q, kv, q_pos=q_pos, causal=causal, window=window, softcap=softcap,
                           scale=scale, tactic=tactic, impl=impl, schedule=schedule,
                           lookahead=lookahead, where="rolling.lower")
  traced = _unrolled.trace(q, q_pos, kv.window, kv.staging, _tiles(kv, kv.n_full_tiles), **static)
  return traced.lower(lowering_platforms=platforms)
