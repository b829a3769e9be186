"""Streamed attention over a pinned-host tail: tiles move host→device inside one jitted program.

The tail arrives as ``k, v [N,B,tile,K,D]`` in ``pinned_host`` with the tile axis leading, so
``tail_k[i]`` is one contiguous DMA source (DESIGN.md §4). Each tile is fetched with
``jax.device_put(tail_k[i], jax.memory.Space.Device)`` — nothing but a slice (and the bitcast
that drops the unit axis) sits between the host array and the move, so the GPU compiler emits an
async ``dynamic-slice-start/-done`` instead of host compute — then attended to on the device by
the caller's ``attend`` and merged exactly by log-sum-exp.

The streamed tail costs ``Bt / PCIe`` per step and the device partials ``Bw / HBM``; the model
time is their max only if the transfers overlap the compute (DESIGN.md §6). A naive jit hid about
20% of the window time (§5), so the schedules below make the overlap explicit in program order:
tile ``i + lookahead`` is requested before tile ``i`` is attended to, and the first
``lookahead`` tiles are requested before the device-resident partials run.

Schedules (static):
- ``"scan"``: a ``lax.fori_loop`` over tiles that carries the ``lookahead`` prefetched tiles in
  its state (a software pipeline: the body issues fetch ``i + lookahead``, then attends tile
  ``i``). Program size is independent of ``N``; the loop boundary is where XLA must keep the DMA
  in flight.
- ``"unrolled"``: a Python loop, every fetch and attention a separate op in one flat program, the
  same lookahead order. The latency-hiding scheduler sees every transfer, at the price of a
  program that grows with ``N``. ``lookahead >= N`` issues every transfer up front (and then holds
  up to the whole tail in device memory).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from rkv.attention import merge_partials
from rkv import validation

SCHEDULES = ("scan", "unrolled")


class Tile(NamedTuple):
  """A tile on the device: ``k, v [B,tile,K,D]``, ``pos [B,tile]``, scales ``[B,tile,K]`` or None."""

  k: jax.Array
  v: jax.Array
  pos: jax.Array
  k_scale: jax.Array | None
  v_scale: jax.Array | None


Partial = tuple[jax.Array, jax.Array]  # (o [B,T,H,D], lse [B,T,H])


def fetch(tail_k, tail_v, tail_pos, tail_k_scale, tail_v_scale, i) -> Tile:
  """Moves tile ``i`` (static int or traced scalar) of a host tail to the device."""
  to_dev = lambda x: None if x is None else jax.device_put(x[i], jax.memory.Space.Device)
  # Positions already live on the device (4 bytes a cell, 0.1% of a bf16 K/V cell): no transfer.
  return Tile(to_dev(tail_k), to_dev(tail_v), tail_pos[i], to_dev(tail_k_scale),
              to_dev(tail_v_scale))


def _merge2(acc: Partial, part: Partial) -> Partial:
  o, lse = merge_partials(
      jnp.stack([acc[0], part[0].astype(jnp.float32)]), jnp.stack([acc[1], part[1]]))
  return o, lse


def stream_attention(tail: Sequence, attend: Callable[[Tile], Partial], *, n_tiles: int,
                     schedule: str = "scan", lookahead: int = 1,
                     resident: Callable[[], list[Partial]] | None = None,
                     out_shape: tuple[int, ...], out_dtype) -> Partial:
  """Attention over ``resident()`` partials plus the first ``n_tiles`` tiles of a host tail.

  ``tail``: ``(k, v, pos, k_scale, v_scale)`` with ``k, v [N,B,tile,K,D]`` host arrays, ``pos
  [N,B,tile]`` device int32, scales ``[N,B,tile,K]`` host or None. ``attend(tile) -> (o, lse)``
  computes one device partial. ``resident`` runs after the first transfers are issued, so its
  device work can hide them. ``out_shape`` is ``o``'s ``[B,T,H,D]``. Returns ``(o, lse)`` with
  ``o`` in ``out_dtype``; every merge is exact (float32 LSE-weighted).
  """
  validation.check_choice("stream_attention", "schedule", schedule, SCHEDULES)
  if not isinstance(lookahead, int) or lookahead < 1:
    raise ValueError(f"stream_attention: lookahead must be a positive int, got {lookahead!r}")
  n_alloc = tail[0].shape[0]
  if not 0 <= n_tiles <= n_alloc:
    raise ValueError(f"stream_attention: n_tiles must be in [0, {n_alloc}], got {n_tiles}")
  depth = min(lookahead, n_tiles)
  get = lambda i: fetch(*tail, i)
  queue = [get(i) for i in range(depth)]  # issued before the resident partials on purpose
  partials = list(resident()) if resident is not None else []
  if n_tiles:
    if schedule == "unrolled":
      for i in range(n_tiles):
        if i + depth < n_tiles:
          queue.append(get(i + depth))
        partials.append(attend(queue.pop(0)))
    else:
      b, t, h, d = out_shape
      acc = (jnp.zeros((b, t, h, d), jnp.float32), jnp.full((b, t, h), -jnp.inf, jnp.float32))

      def body(i, carry):
        pending, acc = carry
        nxt = get(i + depth)  # the prefetch: requested before tile i's attention
        acc = _merge2(acc, attend(pending[0]))
        return tuple(pending[1:]) + (nxt,), acc

      pending, acc = jax.lax.fori_loop(0, n_tiles - depth, body, (tuple(queue), acc))
      for tile in pending:  # the pipeline's drain: the last `depth` tiles are already here
        acc = _merge2(acc, attend(tile))
      partials.append(acc)
  if not partials:
    b, t, h, d = out_shape
    return jnp.zeros(out_shape, out_dtype), jnp.full((b, t, h), -jnp.inf, jnp.float32)
  if len(partials) == 1:
    return partials[0][0].astype(out_dtype), partials[0][1]
  o = jnp.stack([p[0].astype(jnp.float32) for p in partials])
  lse = jnp.stack([p[1] for p in partials])
  o, lse = merge_partials(o, lse)
  return o.astype(out_dtype), lse
