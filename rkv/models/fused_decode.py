"""The decode step of rolling layers in two programs a layer (docs/DESIGN.md §4, step 3).

``layered_forward``'s general path runs a rolling layer as ``pre_attention``, the cache's eager
``attend`` (append, one program per device partial or one for all, the CPU tail, the merge) and
``post_attention``: about eight dispatches and their Python a layer and token. On the H200 that
host work was ~2.5 ms a layer in series with the CPU kernel's 1.7 ms, and bound the offloaded
step (128K half-offloaded: 171 ms a step, the PCIe link busy 106 ms of it;
``benchmarks/results/decode_trace_h200_inline.json``).

Here, for a decode step (``T <= rkv.attention.MAX_DECODE_QUERIES`` new cells), rolling layer
``i`` is:

* ``head_i`` (one program): the merge of layer ``i-1``'s partials, ``post_attention(i-1)``,
  ``pre_attention(i)`` and the append of the new cells into the window or the staging buffer
  (donated: written in place);
* ``device_i`` (one program): the partials over the window, the staging cells and the streamed
  tail tiles, merged into one float32 partial. The tiles' transfers are issued just before it
  (eager ``jax.device_put``, or staged earlier by the layer's
  :class:`rkv.offload.stream.Prefetcher`);
* the CPU kernel over the tiles the tactic gives it, in a worker thread started before
  ``device_i`` is dispatched, as soon as ``q_i`` is on the host: that copy waits for ``head_i``
  only, so ``device_i`` runs under the kernel. With the host share (``$RKV_HOST_SHARE``, the GPU
  default) it runs in :mod:`rkv.offload.host_share`'s C++ thread instead: the share's start
  program right after ``head_i``, its wait program right before ``head_{i+1}`` (or the close),
  the partial bit for bit the worker's; a step whose append fills a tile keeps the worker. Five
  dispatches a layer (the puts, ``head_i``, start, ``device_i``, wait) where the general path
  with the share has about nine. Measured on H100s only (session 21, 1M int8 with a 4 and a 10
  GiB tail, ``benchmarks/results/beyond_hbm/session21/``, docs/DESIGN.md §6): 14-23% slower than
  the general path with the share; on the H200 unmeasured.

The last rolling layer's partials are closed by a program that merges them and runs its
``post_attention``. The cells attended are the general path's, in the same tactic split; only
the order of the float32 LSE merge differs (window and staging first, then tiles, then the CPU
share), so logits agree within the gates, not bit for bit.

**No faster, so off by default** (``layered_forward(fused=True)`` or ``RKV_FUSED_DECODE=1`` opt
in). On the H200, Llama-3-8B shape, random bf16 weights: the first form measured slower in one run
(``bash benchmarks/fused_decode_ab_h200.sh a``, ``benchmarks/results/beyond_hbm/fused_ab/``: 128K
half-offloaded 7.72 tok/s fused vs 8.44 general, 1M 6.55 vs 7.83). Two suspects were changed
after it: the program donated the window and the staging buffer and returned the one it did not
write (XLA may copy it: 3.9 GB a layer at 1M), now only the written block is an argument; and the
CPU kernel ran on this thread after ``device_i`` was dispatched, now it starts in a worker first,
as the general path's does. Traced after both (``bash benchmarks/fused_decode_ab_h200.sh c``,
``beyond_hbm/session3/trace_half128_{fused,general}.json``): 130.86 vs 131.71 ms a step at 128K
half, the same within the run-to-run spread. Expected ~1 ms less host time a layer; it did not
come because the step is bound by the PCIe side of the hybrid split (the host-to-device copies
are busy 109 of 142 ms a traced step), not by the dispatches this step removes.

A layer takes the general path for a step when this one does not apply: a prefill chunk, a chunk
that would span the window's end or fill more than the staging tile, more streamed tiles than the
eager schedule keeps on the device (``lookahead + 1``) without a prefetcher, or a cache that is
not a :class:`rkv.RollingKV`. A staging tile that fills is flushed to the host tail after its
cells were attended.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rkv import cache as cache_lib
from rkv import rolling
from rkv.attention import MAX_DECODE_QUERIES
from rkv.offload import cpu_attention as cpu_lib
from rkv.offload import host_share
from rkv.offload import stream

FUSED_ENV = "RKV_FUSED_DECODE"


@dataclasses.dataclass(frozen=True)
class LayerStep:
  """How one rolling layer's decode step runs here (all static, decided on the host).

  ``dest``: where the new cells go (``"window"`` or ``"staging"``), at cell ``offset`` of it;
  ``n_stream`` of the ``n_full`` full tail tiles stream, the rest go to the CPU kernel;
  ``flush_index``: the tail tile the staging buffer becomes after this step, or None."""

  dest: str
  offset: int
  n_full: int
  n_stream: int
  flush_index: int | None


def plan_step(cache, t: int, *, prefetching: bool) -> LayerStep | None:
  """The :class:`LayerStep` of ``cache`` for ``t`` new cells, or None when the layer must take
  the general path this step (module docstring)."""
  if not isinstance(cache, cache_lib.RollingKV) or not 1 <= t <= MAX_DECODE_QUERIES:
    return None
  w, tile, fill = cache.window_cells, cache.tile_cells, cache.fill
  if fill + t > cache.capacity:
    return None  # the general path raises the capacity error
  flush_index = None
  if fill + t <= w:
    dest, offset = "window", fill
  elif fill >= w and (fill - w) % tile + t <= tile:
    dest, offset = "staging", (fill - w) % tile
    if offset + t == tile:
      flush_index = (fill + t - w) // tile - 1
  else:
    return None
  n_full = cache.n_full_tiles
  n_stream = rolling.streamed_count(n_full, cache.tactic, cache.cpu_fraction)
  if n_stream > stream.DEFAULT_LOOKAHEAD + 1 and not prefetching:
    return None  # more tiles on the device at once than the planner's reserve holds
  return LayerStep(dest=dest, offset=offset, n_full=n_full, n_stream=n_stream,
                   flush_index=flush_index)


def _new_cells(k, v, positions, *, dtype, scale_dtype) -> cache_lib.KVBlock:
  if scale_dtype is not None:  # int8: quantized against scales of the cache's own dtype
    (k, k_scale), (v, v_scale) = (cache_lib.quantize_int8(k, scale_dtype),
                                  cache_lib.quantize_int8(v, scale_dtype))
    return cache_lib.KVBlock(k=k, v=v, pos=positions, k_scale=k_scale, v_scale=v_scale)
  return cache_lib.KVBlock(k=k.astype(dtype), v=v.astype(dtype), pos=positions)


def _module(defs, leaves):
  graphdef, treedef = defs
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


@functools.lru_cache(maxsize=64)
def _programs(prev_defs, defs):
  """(head, close) for a block of structure ``defs`` after one of ``prev_defs`` (None: the
  layer before was not a fused rolling layer, its output is ``x``). Cached like
  ``layered_forward``'s block programs: layers of one structure share them."""

  def merged_input(prev_leaves, x, parts):
    if parts is None:
      return x
    o, _ = stream.merge_all(parts, out_dtype=x.dtype)
    return _module(prev_defs, prev_leaves).post_attention(x, o)

  # Only the block written is an argument (donated: written in place). Passing the other one
  # through would make it an output of the program too, and a donated buffer returned unchanged
  # is not guaranteed to be aliased rather than copied: at 1M tokens a window is 3.9 GB a layer.
  @functools.partial(jax.jit, static_argnames=("dtype", "scale_dtype"), donate_argnames="block")
  def head(prev_leaves, leaves, x, parts, rope_cs, positions, block, offset, *, dtype,
           scale_dtype):
    x = merged_input(prev_leaves, x, parts)
    q, k, v = _module(defs, leaves).pre_attention(x, rope_cs)
    new = _new_cells(k, v, positions, dtype=dtype, scale_dtype=scale_dtype)
    return x, q, cache_lib.write_block(block, new, offset)

  close = jax.jit(merged_input)
  return head, close


@functools.partial(jax.jit, static_argnames=("use_window", "use_staging", "window", "softcap",
                                             "scale", "impl"))
def _device_partial(q, q_pos, window_block, staging_block, tiles, *, use_window, use_staging,
                    window, softcap, scale, impl):
  """One float32 partial over the window, the staging cells and device tiles."""
  kw = dict(causal=True, window=window, softcap=softcap, scale=scale, impl=impl)
  parts = []
  if use_window:
    parts.append(rolling._partial(q, q_pos, window_block, **kw))
  if use_staging:
    parts.append(rolling._partial(q, q_pos, staging_block, **kw))
  parts += [rolling._partial(q, q_pos, t, **kw) for t in tiles]
  return stream.merge_all(parts, out_dtype=jnp.float32)


def _cpu_share(*args, **kwargs):
  with jax.profiler.TraceAnnotation("rkv.cpu.tail"):
    # Looked up at call time (not bound at import), so tests can watch the kernel's calls.
    return cpu_lib.cpu_attention_tail(*args, **kwargs)


class Chain:
  """The fused rolling layers of one decode step, layer by layer: :meth:`layer` runs one,
  :meth:`close` returns the residual stream after the last one."""

  def __init__(self, *, impl: str, positions, prefetcher=None, host_shares=None):
    self.impl = impl
    self.positions = positions
    self._pos_host = None
    self.prefetcher = prefetcher
    # layered_forward's per-layer rkv.offload.host_share shares ($RKV_HOST_SHARE), or None: the
    # CPU share runs in the Python worker.
    self.host_shares = host_shares
    self._pending = None  # (defs, leaves, x, parts, share) of the last fused layer, not closed

  def _q_pos_host(self):
    if self._pos_host is None:
      self._pos_host = np.asarray(self.positions)
    return self._pos_host

  def layer(self, i, defs, leaves, x, rope_cs, cache: cache_lib.RollingKV, step: LayerStep,
            attn_kw: dict) -> cache_lib.RollingKV:
    """Layer ``i`` on its input ``x`` (or the pending layer's partials); returns its new cache."""
    prev_defs, prev_leaves, parts = None, None, None
    t = self.positions.shape[1]  # new cells (and queries) this step
    share = None
    if (self.host_shares is not None and step.n_stream < step.n_full
        and rolling.external_share_applies(cache, t)):
      # Configured (if its tiles changed) before the append, which leaves them as they are.
      share = self.host_shares.for_layer(i, cache, self.positions.shape, attn_kw)
    if self._pending is not None:
      prev_defs, prev_leaves, x, parts, prev_share = self._pending
      parts = host_share.awaited(parts, prev_share)
    head, _ = _programs(prev_defs, defs)
    window, softcap, impl = attn_kw["window"], attn_kw["softcap"], attn_kw["impl"]
    scale = attn_kw["scale"] if attn_kw["scale"] is not None else cache.head_dim ** -0.5
    host_tiles = rolling._tiles(cache, step.n_stream)
    if self.prefetcher is not None and host_tiles:
      tiles = self.prefetcher.take(i, host_tiles)
    else:
      tiles = stream.put_many_eager(host_tiles) if host_tiles else []
    with jax.profiler.TraceAnnotation("rkv.layer.head"):
      into_window = step.dest == "window"
      x, q, written = head(prev_leaves, leaves, x, parts, rope_cs, self.positions,
                           cache.window if into_window else cache.staging,
                           cache_lib.device_offset(step.offset), dtype=np.dtype(cache.dtype),
                           scale_dtype=cache.scale_dtype)
      win, stg = (written, cache.staging) if into_window else (cache.window, written)
    future = token = None
    if share is not None:
      # The share's kernel starts when q lands on the host, driven by the stream (no Python
      # worker, no GIL); its partial is awaited before the next layer's head.
      with jax.profiler.TraceAnnotation("rkv.share.start"):
        token = share.start_program(q, self.positions)
    elif step.n_stream < step.n_full:
      # The CPU share starts (in a worker: its kernel releases the GIL) before device_i is
      # dispatched, as the general path's eager schedule does: if dispatching a program whose
      # input tiles are still in flight held this thread until they land, the kernel would
      # otherwise wait for the link instead of running beside it.
      future = rolling._executor().submit(
          _cpu_share, q, cache, q_pos=self._q_pos_host(), causal=True, window=window,
          softcap=softcap, scale=scale,
          num_threads=cpu_lib.tail_threads(attn_kw.get("cpu_threads")),
          tiles=(step.n_stream, step.n_full))
    try:
      with jax.profiler.TraceAnnotation("rkv.layer.device"):
        device = _device_partial(q, self.positions, win, stg, tuple(tiles),
                                 use_window=cache.window_cells > 0,
                                 use_staging=step.dest == "staging", window=window,
                                 softcap=softcap, scale=scale, impl=impl)
    finally:
      if future is not None:
        with jax.profiler.TraceAnnotation("rkv.cpu.wait"):
          cpu_part = future.result()  # waits for the kernel (and surfaces its errors)
    if self.prefetcher is not None and host_tiles:
      self.prefetcher.consumed(device)
    if token is not None:
      parts = (device, token)
    else:
      parts = (device,) if future is None else (device, cpu_part)
    new = dataclasses.replace(cache, window=win, staging=stg, fill=cache.fill + t)
    if step.flush_index is not None:
      tail, staging = cache_lib.flush(new.tail, new.staging, step.flush_index)
      new = dataclasses.replace(new, tail=tail, staging=staging)
    self._pending = (defs, leaves, x, parts, share)
    return new

  def close(self, x):
    """The residual stream after the pending fused layer (``x`` itself when there is none)."""
    if self._pending is None:
      return x
    prev_defs, prev_leaves, x, parts, share = self._pending
    self._pending = None
    parts = host_share.awaited(parts, share)
    _, close = _programs(prev_defs, prev_defs)
    with jax.profiler.TraceAnnotation("rkv.layer.close"):
      return close(prev_leaves, x, parts)
