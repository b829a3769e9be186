"""Attention over selected KV blocks, the per-block key summaries, and the block selectors.

A *block* is ``block_cells`` consecutive cells of one sequence. Block-selected attention reads,
for every (sequence, KV head), only the N blocks it is given: exact over those blocks (the same
online softmax as :func:`rkv.attention`), returning ``(o, lse)`` so that it merges by LSE
(:func:`rkv.merge`) with any other partial of the layer. Which blocks to give it is the
selector's business; that part is approximate (docs/DESIGN.md §9).

The blocks live in a pool ``k, v [R,K,D]`` of ``R = n_slots * block_cells`` rows (a block cache's
device slots, or a resident copy of every block); ``blocks [B,K,N]`` names slots. Each KV head
may select different blocks, and :func:`rkv.attention`'s ``kv_rows`` takes one row list per
sequence shared by its heads, so each (sequence, KV head) becomes a sequence of its own with one
KV head: the pool ``[R,K,D]`` is viewed as ``[R*K,1,D]`` (a free reshape: row r of head h is row
``r*K + h``) and q ``[B,T,H,D]`` as ``[B*K,T,G,D]``. The kernels then gather the rows in place:
no gathered copy of the selected blocks is made.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from rkv.attention import attention

# Must-read blocks (the recent window, the sinks) outrank every scored block.
_MUST = float(np.finfo(np.float32).max)
_SCORE_CLIP = 1e30


def _check(cond, msg):
  if not cond:
    raise ValueError(msg)


# ----------------------------------------------------------------------------------------------
# Block-selected attention
# ----------------------------------------------------------------------------------------------
def block_rows(blocks: jax.Array, block_cells: int) -> jax.Array:
  """Slot ids ``[..., N]`` -> pool rows ``[..., N*block_cells]`` (a negative slot: -1 rows)."""
  blocks = jnp.asarray(blocks, jnp.int32)
  rows = blocks[..., None] * block_cells + jnp.arange(block_cells, dtype=jnp.int32)
  rows = jnp.where(blocks[..., None] < 0, -1, rows)
  return rows.reshape(blocks.shape[:-1] + (blocks.shape[-1] * block_cells,))


def block_attention(q, k, v, blocks, *, block_cells: int, pos, q_pos=None, k_scale=None,
                    v_scale=None, causal: bool = True, window: int | None = None,
                    softcap: float | None = None, scale: float | None = None,
                    impl: str = "auto", block_sizes=None):
  """Attention of ``q [B,T,H,D]`` over the blocks ``blocks [B,K,N]`` (slot ids; negative:
  none) of the pool ``k, v [R,K,D]``, ``R = n_slots * block_cells``, whose rows have positions
  ``pos [R]`` (-1: empty). Returns ``(o [B,T,H,D], lse [B,T,H])``, exact over the given blocks
  with the masks of docs/DESIGN.md §2; int8 pools carry ``k_scale, v_scale [R,K]``.

  The result depends on the blocks' contents and order, not on which slots hold them: the same
  blocks in the same order from another pool give the bitwise-same answer (the parity tests).
  """
  where = "block_attention"
  _check(isinstance(block_cells, (int, np.integer)) and block_cells >= 1,
         f"{where}: block_cells must be a positive int, got {block_cells!r}")
  _check(q.ndim == 4, f"{where}: q must be [B,T,H,D], got shape {tuple(q.shape)}")
  _check(k.ndim == 3 and v.shape == k.shape,
         f"{where}: k, v must be a pool [R,K,D] of one shape, got {tuple(k.shape)}, "
         f"{tuple(v.shape)}")
  b, t, h, d = q.shape
  r, kh, dk = k.shape
  _check(dk == d, f"{where}: pool head dim {dk} must equal q's {d}")
  _check(h % kh == 0, f"{where}: query heads H={h} must be a multiple of KV heads K={kh}")
  _check(r % block_cells == 0,
         f"{where}: pool rows R={r} must be a multiple of block_cells={block_cells}")
  _check(blocks.ndim == 3 and tuple(blocks.shape[:2]) == (b, kh),
         f"{where}: blocks must be [B,K,N]=[{b},{kh},N], got {tuple(blocks.shape)}")
  _check(tuple(jnp.shape(pos)) == (r,), f"{where}: pos must be [R]=[{r}], got "
         f"{tuple(jnp.shape(pos))}")
  _check((k_scale is None) == (v_scale is None), f"{where}: give both k_scale and v_scale or neither")
  if k_scale is not None:
    _check(tuple(k_scale.shape) == (r, kh) and tuple(v_scale.shape) == (r, kh),
           f"{where}: k_scale, v_scale must be [R,K]=[{r},{kh}], got {tuple(k_scale.shape)}, "
           f"{tuple(v_scale.shape)}")
  g, n = h // kh, blocks.shape[2]
  if q_pos is None:
    raise ValueError(f"{where}: q_pos [B,T] is required (block positions are not arange)")
  _check(tuple(q_pos.shape) == (b, t), f"{where}: q_pos must be [B,T]=[{b},{t}], got "
         f"{tuple(q_pos.shape)}")
  return _block_attention(q, k, v, _int32(blocks), _int32(pos), _int32(q_pos), k_scale, v_scale,
                          block_cells=int(block_cells), causal=causal, window=window,
                          softcap=softcap, scale=scale, impl=impl, block_sizes=block_sizes)


def _int32(x):
  """``x`` as int32; int32 arrays (jax or numpy) as they are: the jitted call moves a numpy one
  with its other arguments (an eager jnp.asarray is a dispatch of its own)."""
  if isinstance(x, (jax.Array, np.ndarray)) and x.dtype == np.int32:
    return x
  return jnp.asarray(x, jnp.int32)


# One program for the whole call: outside a jit, the pool's [R,K,D] -> [R*K,1,D] view is an
# eager reshape, which XLA runs as a copy of the whole pool (32 MiB per pool at 16K slots, two
# pools, every step: ~30 ms of a 40 ms CPU step); in the program it is a bitcast (attention_xla's
# loop reads pools as 2-D so that it stays one), and the shuffles around it are not dispatches
# of their own.
@functools.partial(jax.jit, static_argnames=("block_cells", "causal", "window", "softcap",
                                             "scale", "impl", "block_sizes"))
def _block_attention(q, k, v, blocks, pos, q_pos, k_scale, v_scale, *, block_cells, causal,
                     window, softcap, scale, impl, block_sizes):
  r, kh, d = k.shape
  qf, flat_rows, k_pos, qpf = _per_head_sequences(q, blocks, pos, q_pos, r=r,
                                                   block_cells=block_cells)
  scales = {}
  if k_scale is not None:
    scales = dict(k_scale=k_scale.reshape(r * kh, 1), v_scale=v_scale.reshape(r * kh, 1))
  o, lse = attention(qf, k.reshape(r * kh, 1, d), v.reshape(r * kh, 1, d), kv_rows=flat_rows,
                     q_pos=qpf, k_pos=k_pos, causal=causal, window=window, softcap=softcap,
                     scale=scale, impl=impl, block_sizes=block_sizes, **scales)
  return _per_query_heads(o, lse, kh=kh)


def _per_head_sequences(q, blocks, pos, q_pos, *, r, block_cells):
  """Each (sequence, KV head) as a sequence of one KV head: q ``[B*K,T,G,D]``, its pool rows
  in the ``[R*K,1,D]`` view, their positions, and the queries' positions."""
  b, t, h, d = q.shape
  kh, n = blocks.shape[1], blocks.shape[2]
  rows = block_rows(blocks, block_cells)                        # [B,K,N*bs] pool rows
  k_pos = jnp.where(rows < 0, -1, pos[jnp.clip(rows, 0, r - 1)])
  head = jnp.arange(kh, dtype=jnp.int32)[None, :, None]
  flat_rows = jnp.where(rows < 0, -1, rows * kh + head).reshape(b * kh, n * block_cells)
  qf = q.reshape(b, t, kh, h // kh, d).transpose(0, 2, 1, 3, 4).reshape(b * kh, t, h // kh, d)
  qpf = jnp.broadcast_to(q_pos[:, None], (b, kh, t)).reshape(b * kh, t)
  return qf, flat_rows, k_pos.reshape(b * kh, n * block_cells), qpf


def _per_query_heads(o, lse, *, kh):
  bk, t, g, d = o.shape
  b = bk // kh
  return (o.reshape(b, kh, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, kh * g, d),
          lse.reshape(b, kh, t, g).transpose(0, 2, 1, 3).reshape(b, t, kh * g))


# ----------------------------------------------------------------------------------------------
# Per-block key summaries (Quest: per-channel min and max of the keys), made when blocks are written
# ----------------------------------------------------------------------------------------------
class BlockSummaries(NamedTuple):
  """``k_min, k_max [B,NB,K,D]`` float32: per block and KV head, the channel-wise min / max of
  its written keys (dequantized); a block with no cell holds ``+inf`` / ``-inf``."""

  k_min: jax.Array
  k_max: jax.Array


def summarize(k, pos, *, block_cells: int, k_scale=None) -> BlockSummaries:
  """Summaries of blocks ``k [B,NB*bs,K,D]`` with positions ``pos [B,NB*bs]`` (-1: empty, not
  summarized; its K may be NaN). ``k_scale [B,NB*bs,K]`` for int8 keys."""
  _check(k.shape[1] % block_cells == 0,
         f"summarize: S={k.shape[1]} must be a multiple of block_cells={block_cells}")
  return _summarize(k, pos, k_scale, block_cells=block_cells)


@functools.partial(jax.jit, static_argnames=("block_cells",))
def _summarize(k, pos, k_scale, *, block_cells):
  b, s, kh, d = k.shape
  kf = jnp.asarray(k).astype(jnp.float32)
  if k_scale is not None:
    kf = kf * jnp.asarray(k_scale, jnp.float32)[..., None]
  valid = (jnp.asarray(pos) >= 0)[:, :, None, None]
  nb = s // block_cells
  lo = jnp.where(valid, kf, jnp.inf).reshape(b, nb, block_cells, kh, d).min(2)
  hi = jnp.where(valid, kf, -jnp.inf).reshape(b, nb, block_cells, kh, d).max(2)
  return BlockSummaries(lo, hi)


# ----------------------------------------------------------------------------------------------
# Selectors
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SelectionView:
  """What a selector may read about the blocks of a layer: the summaries, and (for the oracle
  only: it is what a cache does not have on the device) every block's keys
  ``keys [B,NB*bs,K,D]`` with ``key_pos [B,NB*bs]`` and int8 ``key_scale``."""

  summaries: BlockSummaries
  block_cells: int
  keys: jax.Array | None = None
  key_pos: jax.Array | None = None
  key_scale: jax.Array | None = None


@runtime_checkable
class Selector(Protocol):
  """Scores every block for the query chunk: ``scores(q [B,T,H,D], view, *, q_pos, scale,
  softcap) -> [B,K,NB]`` float32, higher meaning more worth reading. One score per KV head: the
  G query heads of a group share the blocks they read (GQA)."""

  name: str

  def scores(self, q, view: SelectionView, *, q_pos, scale: float, softcap=None) -> jax.Array: ...


def _grouped(q, kh):
  b, t, h, d = q.shape
  return jnp.asarray(q, jnp.float32).reshape(b, t, kh, h // kh, d)


@dataclasses.dataclass(frozen=True)
class QuestSelector:
  """Quest's bound: for each channel the larger of ``q_d * min_d`` and ``q_d * max_d``, summed,
  bounds ``q.k`` over the block's keys from above; the block's score is the largest bound over
  the chunk's queries and the group's heads. Reads ``2*D`` floats per block and head."""

  name: str = "quest"

  def scores(self, q, view, *, q_pos, scale, softcap=None):
    kh = view.summaries.k_min.shape[2]
    return _quest(_grouped(q, kh), view.summaries.k_min, view.summaries.k_max, scale)


@jax.jit
def _quest(qg, k_min, k_max, scale):
  # Empty blocks hold +-inf summaries; a zero query channel would give 0 * inf = NaN there.
  lo = jnp.where(jnp.isfinite(k_min), k_min, 0.0)
  hi = jnp.where(jnp.isfinite(k_max), k_max, 0.0)
  # max(q_d lo_d, q_d hi_d) is q_d hi_d where q_d > 0 and q_d lo_d where q_d < 0: two dots.
  bound = (jnp.einsum("btkgd,bnkd->bkgtn", jnp.maximum(qg, 0.0), hi, precision="highest")
           + jnp.einsum("btkgd,bnkd->bkgtn", jnp.minimum(qg, 0.0), lo, precision="highest"))
  return bound.max(axis=(2, 3)) * scale


@dataclasses.dataclass(frozen=True)
class OracleSelector:
  """The true block ranking: each block's attention mass (log-sum-exp of its visible logits,
  exact from every key), the largest over the chunk's queries and the group's heads. Reads every
  key, so it is for tests and for measuring what a cheap selector loses."""

  name: str = "oracle"

  def scores(self, q, view, *, q_pos, scale, softcap=None):
    if view.keys is None:
      raise ValueError("OracleSelector: the view holds no keys (the oracle reads every key; build "
                       "the view with keys=...)")
    kh = view.keys.shape[2]
    return _oracle(_grouped(q, kh), view.keys, view.key_pos, view.key_scale, q_pos, scale,
                   softcap, view.block_cells)


@functools.partial(jax.jit, static_argnames=("softcap", "block_cells"))
def _oracle(qg, keys, key_pos, key_scale, q_pos, scale, softcap, block_cells):
  kf = keys.astype(jnp.float32)
  if key_scale is not None:
    kf = kf * key_scale.astype(jnp.float32)[..., None]
  valid = key_pos >= 0
  kf = jnp.where(valid[:, :, None, None], kf, 0.0)
  logits = jnp.einsum("btkgd,bskd->bkgts", qg, kf, precision="highest") * scale
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  seen = valid[:, None, None, None, :] & (key_pos[:, None, None, None, :]
                                          <= q_pos[:, None, None, :, None])
  logits = jnp.where(seen, logits, -jnp.inf)
  b, kh, g, t, s = logits.shape
  mass = jax.nn.logsumexp(logits.reshape(b, kh, g, t, s // block_cells, block_cells), axis=-1)
  return mass.max(axis=(2, 3))


SELECTORS = {"quest": QuestSelector(), "oracle": OracleSelector()}


def selector(name_or_selector) -> Selector:
  """A :class:`Selector` by name (``"quest"``, ``"oracle"``) or the selector itself."""
  if isinstance(name_or_selector, str):
    if name_or_selector not in SELECTORS:
      raise ValueError(f"unknown selector {name_or_selector!r}; known: {tuple(SELECTORS)}")
    return SELECTORS[name_or_selector]
  if not isinstance(name_or_selector, Selector):
    raise ValueError(f"selector must be a name in {tuple(SELECTORS)} or implement "
                     f"rkv.sparse.Selector (name, scores), got {type(name_or_selector).__name__}")
  return name_or_selector


def must_read(n_blocks: int, filled_blocks: int, *, window_blocks: int,
              sink_blocks: int) -> np.ndarray:
  """``[NB]`` bool: the blocks every query reads whatever its scores: the last ``window_blocks``
  written blocks (the recent window) and the first ``sink_blocks`` (attention sinks)."""
  return _must_mask(np.arange(n_blocks), filled_blocks, window_blocks, sink_blocks)[0]


def _must_mask(idx, filled_blocks, window_blocks, sink_blocks):
  """``(must-read, written)`` masks over block ids ``idx``, by comparisons alone: one definition
  for :func:`must_read` (NumPy) and the selection programs (``filled_blocks`` traced there)."""
  filled = idx < filled_blocks
  return ((idx >= filled_blocks - window_blocks) | (idx < sink_blocks)) & filled, filled


def select_blocks(scores, *, n_select: int, filled_blocks: int, window_blocks: int,
                  sink_blocks: int = 0) -> jax.Array:
  """The ``[B,K,N]`` block ids to read, ``N = n_select`` (-1 where fewer than N blocks are
  written: N stays fixed so the attention compiles once): the must-read blocks (:func:`must_read`)
  and the best-scored others, in ascending order (-1 first; the order the attention reads them
  in, the same in every path). ``scores [B,K,NB]``; blocks at or past ``filled_blocks`` hold no
  cell and are never chosen."""
  n = _checked_selection(scores.shape[-1], n_select, filled_blocks, window_blocks, sink_blocks)
  return _select(scores, filled_blocks, n=n, window_blocks=window_blocks,
                 sink_blocks=sink_blocks)


def quest_select_blocks(q, summaries: BlockSummaries, *, scale: float, n_select: int,
                        filled_blocks: int, window_blocks: int, sink_blocks: int = 0) -> jax.Array:
  """``select_blocks(QuestSelector().scores(q, ...), ...)`` as one program: the same ids, one
  dispatch per decode step instead of a handful (the block cache's hot path)."""
  nb = summaries.k_min.shape[1]
  n = _checked_selection(nb, n_select, filled_blocks, window_blocks, sink_blocks)
  return _quest_select(q, summaries.k_min, summaries.k_max, scale, filled_blocks, n=n,
                       window_blocks=window_blocks, sink_blocks=sink_blocks)


def _checked_selection(nb, n_select, filled_blocks, window_blocks, sink_blocks) -> int:
  """The selection's size ``N`` after select_blocks' checks."""
  _check(0 < filled_blocks <= nb, f"select_blocks: filled_blocks must be in [1, {nb}], got "
         f"{filled_blocks}")
  n = min(int(n_select), nb)
  must = must_read(nb, filled_blocks, window_blocks=window_blocks, sink_blocks=sink_blocks)
  _check(int(must.sum()) <= n, f"select_blocks: {int(must.sum())} must-read blocks (window "
         f"{window_blocks}, sinks {sink_blocks}) exceed the selection of {n}")
  return n


def _top_blocks(scores, filled_blocks, *, n, window_blocks, sink_blocks):
  # Made in the program from the traced fill: no [NB] masks uploaded a step, no retrace.
  must, filled = _must_mask(jnp.arange(scores.shape[-1], dtype=jnp.int32), filled_blocks,
                            window_blocks, sink_blocks)
  s = jnp.clip(jnp.nan_to_num(scores.astype(jnp.float32), nan=-_SCORE_CLIP), -_SCORE_CLIP,
               _SCORE_CLIP)
  prio = jnp.where(must, _MUST, jnp.where(filled, s, -jnp.inf))
  top, ids = jax.lax.top_k(prio, n)
  return jnp.sort(jnp.where(top == -jnp.inf, -1, ids.astype(jnp.int32)), axis=-1)


_select = jax.jit(_top_blocks, static_argnames=("n", "window_blocks", "sink_blocks"))


@functools.partial(jax.jit, static_argnames=("n", "window_blocks", "sink_blocks"))
def _quest_select(q, k_min, k_max, scale, filled_blocks, *, n, window_blocks, sink_blocks):
  scores = _quest(_grouped(q, k_min.shape[2]), k_min, k_max, scale)
  return _top_blocks(scores, filled_blocks, n=n, window_blocks=window_blocks,
                     sink_blocks=sink_blocks)
