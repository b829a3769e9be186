"""Exact attention with its log-sum-exp: the reference, the portable jnp path, merges, dispatch.

Every backend returns ``(o, lse)``: ``o [B,T,H,D]`` in q's dtype and ``lse [B,T,H]`` float32 in
natural log. A row that sees no key returns ``o = 0`` and ``lse = -inf``; a NaN a row reads (in q or
a visible K/V cell) propagates to its output (docs/DESIGN.md §3). Because the LSE is
returned, attention over disjoint key sets (a device window and a host tail, or split-K chunks)
combines exactly with :func:`merge`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from rkv import validation

IMPLS = ("auto", "reference", "xla", "pallas")
# The decode kernel packs the G query heads of T tokens into one tile; past 16 tokens the prefill
# kernel's query tiles are fuller (rkv/pallas/decode_attention.py).
MAX_DECODE_QUERIES = 16
_XLA_BLOCK_K = 512
_HIGHEST = jax.lax.Precision.HIGHEST


# ----------------------------------------------------------------------------------------------
# Masks and small helpers shared by the jnp paths
# ----------------------------------------------------------------------------------------------
def visible(q_pos: jax.Array, k_pos: jax.Array, *, causal: bool, window: int | None) -> jax.Array:
  """``[B,T,S]`` bool: key j is visible to query i (docs/DESIGN.md §2)."""
  qp = q_pos[:, :, None]
  kp = k_pos[:, None, :]
  mask = kp >= 0
  if causal:
    mask = mask & (kp <= qp)
  if window is not None:
    mask = mask & (qp - kp < window)
  return mask


def _dequantize(x: jax.Array, x_scale: jax.Array | None) -> jax.Array:
  if x_scale is None:
    return x.astype(jnp.float32)
  return x.astype(jnp.float32) * x_scale.astype(jnp.float32)[..., None]


def _dot_precision(dtype) -> dict:
  # float32 inputs get full-precision dots (no TF32 on GPU); 16-bit inputs feed the matrix
  # units directly and accumulate in float32.
  if jnp.dtype(dtype) == jnp.dtype(jnp.float32):
    return dict(precision=_HIGHEST)
  return dict(preferred_element_type=jnp.float32)


def _softcap(logits: jax.Array, softcap: float | None) -> jax.Array:
  return logits if softcap is None else softcap * jnp.tanh(logits / softcap)


def saw_a_key(row_sum: jax.Array) -> jax.Array:
  """True where an online-softmax row saw a key: its sum of weights is not exactly 0.

  ``row_sum != 0``, not ``row_sum > 0``: a NaN that attention read makes the sum NaN, and NaN > 0
  is False, which used to turn a poisoned row into a silent "saw no key" (o = 0, lse = -inf).
  NaN != 0 is True, so the NaN reaches o and lse (docs/DESIGN.md §3).
  """
  return row_sum != 0


def _no_keys(q):
  """The answer for S = 0 (every row sees no key): ``o = 0``, ``lse = -inf``, as every backend
  gives it (the reductions over an empty axis would fail here)."""
  return jnp.zeros(q.shape, q.dtype), jnp.full(q.shape[:3], -jnp.inf, jnp.float32)


def pool_positions(kv_rows: jax.Array, k_pos: jax.Array) -> jax.Array:
  """``k_pos [B,S]`` with padding keys (``kv_rows < 0``) made empty slots, whatever k_pos says."""
  return jnp.where(kv_rows < 0, -1, k_pos)


def _rows_2d(pool: jax.Array) -> jax.Array:
  """A pool ``[R, ...]`` as ``[R, rest]`` (``[R]`` when a row is one value)."""
  rest = math.prod(pool.shape[1:])
  return pool.reshape(pool.shape[0]) if rest == 1 else pool.reshape(pool.shape[0], rest)


def gather_rows(pool: jax.Array, kv_rows: jax.Array) -> jax.Array:
  """Pool rows ``[R,...]`` -> each sequence's keys ``[B,S,...]``. Padding (negative) rows and
  rows >= R read a clamped row, which :func:`pool_positions` or the range check makes moot."""
  return pool[jnp.clip(kv_rows, 0, pool.shape[0] - 1)]


def _finish(o_acc, row_sum, row_max, out_dtype):
  """Normalizes an online-softmax state; rows that saw no key become ``o=0, lse=-inf``, rows
  that read a NaN give NaN."""
  seen = saw_a_key(row_sum)
  o = jnp.where(seen[..., None], o_acc / jnp.where(seen, row_sum, 1.0)[..., None], 0.0)
  lse = jnp.where(seen, row_max + jnp.log(jnp.where(seen, row_sum, 1.0)), -jnp.inf)
  return o.astype(out_dtype), lse.astype(jnp.float32)


# ----------------------------------------------------------------------------------------------
# reference: float32 einsum over the full [T,S] logits
# ----------------------------------------------------------------------------------------------
def attention_reference(q, k, v, *, kv_rows=None, q_pos=None, k_pos=None, k_scale=None,
                        v_scale=None, causal=True, window=None, softcap=None, scale=None):
  """Float32 attention that materializes every logit: the yardstick for the fast paths.

  With ``kv_rows`` it gathers each sequence's rows of the pool first (the dense call is the
  definition of a pool call).
  """
  args = validation.attention_args(q, k, v, q_pos=q_pos, k_pos=k_pos, k_scale=k_scale,
                                   v_scale=v_scale, window=window, softcap=softcap, scale=scale,
                                   causal=causal, kv_rows=kv_rows, where="attention_reference")
  if args.kv_len == 0:
    return _no_keys(q)
  return _reference(q, k, v, args.kv_rows, args.q_pos, args.k_pos, k_scale, v_scale,
                    causal=causal, window=window, softcap=softcap, scale=args.scale)


@functools.partial(jax.jit, static_argnames=("causal", "window", "softcap", "scale"))
def _reference(q, k, v, kv_rows, q_pos, k_pos, k_scale, v_scale, *, causal, window, softcap,
               scale):
  if kv_rows is not None:
    k, v = gather_rows(k, kv_rows), gather_rows(v, kv_rows)
    if k_scale is not None:
      k_scale, v_scale = gather_rows(k_scale, kv_rows), gather_rows(v_scale, kv_rows)
    k_pos = pool_positions(kv_rows, k_pos)
  b, t, h, d = q.shape
  kh = k.shape[2]
  valid = (k_pos >= 0)[:, :, None, None]
  # Empty slots may hold NaN; zero them so that 0 * NaN cannot reach the output.
  kf = jnp.where(valid, _dequantize(k, k_scale), 0.0)
  vf = jnp.where(valid, _dequantize(v, v_scale), 0.0)
  qf = q.astype(jnp.float32).reshape(b, t, kh, h // kh, d)
  logits = jnp.einsum("btkgd,bskd->bkgts", qf, kf, precision=_HIGHEST) * scale
  logits = _softcap(logits, softcap)
  mask = visible(q_pos, k_pos, causal=causal, window=window)[:, None, None]
  logits = jnp.where(mask, logits, -jnp.inf)
  row_max = jnp.max(logits, axis=-1)
  safe_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  p = jnp.where(mask, jnp.exp(logits - safe_max[..., None]), 0.0)
  o_acc = jnp.einsum("bkgts,bskd->bkgtd", p, vf, precision=_HIGHEST)
  o, lse = _finish(o_acc, p.sum(-1), safe_max, q.dtype)
  return (jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(b, t, h, d),
          jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, t, h))


# ----------------------------------------------------------------------------------------------
# xla: tiled online softmax in plain jnp, [T, block] logits at a time
# ----------------------------------------------------------------------------------------------
def attention_xla(q, k, v, *, kv_rows=None, q_pos=None, k_pos=None, k_scale=None, v_scale=None,
                  causal=True, window=None, softcap=None, scale=None,
                  block_k: int = _XLA_BLOCK_K):
  """Portable flash attention: never materializes ``[T,S]``, runs on any backend.

  With ``kv_rows`` each KV block gathers its ``[B, block_k]`` rows of the pool (a jnp gather of
  one block, never the whole ``[B,S,K,D]``).
  """
  args = validation.attention_args(q, k, v, q_pos=q_pos, k_pos=k_pos, k_scale=k_scale,
                                   v_scale=v_scale, window=window, softcap=softcap, scale=scale,
                                   causal=causal, kv_rows=kv_rows, where="attention_xla")
  if not isinstance(block_k, int) or block_k < 1:
    raise ValueError(f"attention_xla: block_k must be a positive int, got {block_k!r}")
  if args.kv_len == 0:
    return _no_keys(q)
  return _xla(q, k, v, args.kv_rows, args.q_pos, args.k_pos, k_scale, v_scale, causal=causal,
              window=window, softcap=softcap, scale=args.scale,
              block_k=min(block_k, args.kv_len))


@functools.partial(jax.jit,
                   static_argnames=("causal", "window", "softcap", "scale", "block_k"))
def _xla(q, k, v, kv_rows, q_pos, k_pos, k_scale, v_scale, *, causal, window, softcap, scale,
         block_k):
  b, t, h, d = q.shape
  pooled = kv_rows is not None
  s, kh = (kv_rows.shape[1], k.shape[1]) if pooled else (k.shape[1], k.shape[2])
  g = h // kh
  n_blocks = -(-s // block_k)
  pad = n_blocks * block_k - s
  if pooled:
    k_pos = pool_positions(kv_rows, k_pos)
    if pad:  # padding keys are padding rows: the pool itself is never copied
      kv_rows = jnp.pad(kv_rows, ((0, 0), (0, pad)), constant_values=-1)
      k_pos = jnp.pad(k_pos, ((0, 0), (0, pad)), constant_values=-1)
  elif pad:
    # Padding cells are empty slots (k_pos = -1): masked like any hole.
    k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
    k_pos = jnp.pad(k_pos, ((0, 0), (0, pad)), constant_values=-1)
    if k_scale is not None:
      k_scale = jnp.pad(k_scale, ((0, 0), (0, pad), (0, 0)))
      v_scale = jnp.pad(v_scale, ((0, 0), (0, pad), (0, 0)))
  compute_dtype = jnp.float32 if k_scale is not None else jnp.promote_types(q.dtype, k.dtype)
  qf = (q.astype(jnp.float32) * scale).astype(compute_dtype).reshape(b, t, kh, g, d)

  if pooled:
    # The loop reads the pools as 2-D [R, rest] (a bitcast): a pool that is a reshaped view (a
    # block cache's [R*K,1,D] over its [R,K,D] slots) would otherwise enter the loop in a layout
    # XLA copies the whole pool into on every call (measured on CPU: 2 x 32 MiB per decode step).
    pool_shapes = {name: x.shape for name, x in (("k", k), ("v", v), ("k_scale", k_scale),
                                                 ("v_scale", v_scale)) if x is not None}
    k, v = _rows_2d(k), _rows_2d(v)
    if k_scale is not None:
      k_scale, v_scale = _rows_2d(k_scale), _rows_2d(v_scale)

  def keys(x, start, name):
    """Block ``[B, block_k, ...]`` of a dense K/V (or scale) array, or of the pool's rows."""
    if pooled:
      rows = gather_rows(x, jax.lax.dynamic_slice_in_dim(kv_rows, start, block_k, axis=1))
      return rows.reshape(rows.shape[:2] + pool_shapes[name][1:])
    return jax.lax.dynamic_slice_in_dim(x, start, block_k, axis=1)

  def block(i, carry):
    row_max, row_sum, o_acc = carry
    start = i * block_k
    kb, vb = keys(k, start, "k"), keys(v, start, "v")
    pb = jax.lax.dynamic_slice_in_dim(k_pos, start, block_k, axis=1)
    valid = (pb >= 0)[:, :, None, None]
    if k_scale is not None:
      kb = _dequantize(kb, keys(k_scale, start, "k_scale"))
      vb = _dequantize(vb, keys(v_scale, start, "v_scale"))
    kb = jnp.where(valid, kb, 0).astype(compute_dtype)
    vb = jnp.where(valid, vb, 0).astype(compute_dtype)
    logits = jnp.einsum("btkgd,bskd->bkgts", qf, kb, **_dot_precision(compute_dtype))
    logits = _softcap(logits.astype(jnp.float32), softcap)
    mask = visible(q_pos, pb, causal=causal, window=window)[:, None, None]
    logits = jnp.where(mask, logits, -jnp.inf)
    new_max = jnp.maximum(row_max, logits.max(-1))
    safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
    p = jnp.where(mask, jnp.exp(logits - safe_max[..., None]), 0.0)
    alpha = jnp.exp(jnp.where(jnp.isfinite(row_max), row_max, 0.0) - safe_max)
    alpha = jnp.where(jnp.isfinite(row_max), alpha, 0.0)
    pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(compute_dtype), vb,
                    **_dot_precision(compute_dtype))
    return new_max, alpha * row_sum + p.sum(-1), alpha[..., None] * o_acc + pv

  init = (jnp.full((b, kh, g, t), -jnp.inf, jnp.float32), jnp.zeros((b, kh, g, t), jnp.float32),
          jnp.zeros((b, kh, g, t, d), jnp.float32))
  row_max, row_sum, o_acc = jax.lax.fori_loop(0, n_blocks, block, init)
  safe_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  o, lse = _finish(o_acc, row_sum, safe_max, q.dtype)
  return (jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(b, t, h, d),
          jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, t, h))


# ----------------------------------------------------------------------------------------------
# merge: exact LSE-weighted combination of partials over disjoint key sets
# ----------------------------------------------------------------------------------------------
def merge(o_a: jax.Array, lse_a: jax.Array, o_b: jax.Array, lse_b: jax.Array):
  """Combines two partials ``(o [B,T,H,D], lse [B,T,H])`` into attention over the union.

  Exact: ``lse = log(e^lse_a + e^lse_b)`` and ``o = (e^lse_a o_a + e^lse_b o_b) / e^lse``. A side
  that saw no key (``lse = -inf``) contributes nothing; both empty gives ``o = 0, lse = -inf``; a
  NaN side (it read a NaN) gives NaN.
  """
  if jnp.shape(o_a) != jnp.shape(o_b):
    raise ValueError(f"merge: o_b shape {jnp.shape(o_b)} must equal o_a shape {jnp.shape(o_a)}")
  if jnp.shape(lse_a) != jnp.shape(lse_b) or jnp.shape(lse_a) != jnp.shape(o_a)[:-1]:
    raise ValueError(f"merge: lse_a/lse_b must have shape {jnp.shape(o_a)[:-1]}, got "
                     f"{jnp.shape(lse_a)} and {jnp.shape(lse_b)}")
  return merge_partials(jnp.stack([o_a, o_b.astype(o_a.dtype)]), jnp.stack([lse_a, lse_b]))


@jax.jit
def merge_partials(o: jax.Array, lse: jax.Array):
  """Merges N partials stacked on a leading axis: ``o [N,...,D]``, ``lse [N,...]``."""
  lse = lse.astype(jnp.float32)
  top = jnp.max(lse, axis=0)
  # Only lse = -inf means "this partial saw no key" (weight 0). The guards compare with -inf, not
  # isfinite: a NaN partial (it read a NaN) must poison the merge, not drop out of it.
  safe_top = jnp.where(top == -jnp.inf, 0.0, top)
  w = jnp.where(lse == -jnp.inf, 0.0, jnp.exp(lse - safe_top))  # [N,...], each <= 1
  total = w.sum(0)
  seen = saw_a_key(total)
  o_sum = jnp.einsum("n...,n...d->...d", w, o.astype(jnp.float32), precision=_HIGHEST)
  o_out = jnp.where(seen[..., None], o_sum / jnp.where(seen, total, 1.0)[..., None], 0.0)
  lse_out = jnp.where(seen, safe_top + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
  return o_out.astype(o.dtype), lse_out


# ----------------------------------------------------------------------------------------------
# dispatch
# ----------------------------------------------------------------------------------------------
def resolve_impl(impl: str, q_len: int) -> str:
  """``auto``: the Pallas kernels on a GPU, the jnp path elsewhere (interpret mode is for tests)."""
  validation.check_choice("attention", "impl", impl, IMPLS)
  if impl == "auto":
    return "pallas" if jax.default_backend() == "gpu" else "xla"
  return impl


def attention(q, k, v, *, kv_rows=None, q_pos=None, k_pos=None, causal=True, window=None,
              softcap=None, scale=None, impl="auto", k_scale=None, v_scale=None,
              block_sizes=None, kv_fill=None):
  """Exact attention ``(o [B,T,H,D], lse [B,T,H])`` with masks from positions (docs/DESIGN.md §2).

  ``impl``: ``"reference"`` (float32 einsum), ``"xla"`` (tiled jnp online softmax), ``"pallas"``
  (the decode kernel for T <= 16, the flash kernel above; ``interpret=True`` on CPU), ``"auto"``.
  int8 K/V take ``k_scale``/``v_scale`` ``[B,S,K]``. ``block_sizes`` goes to the Pallas kernel.

  Many sequences in one pool: with ``kv_rows [B,S]`` int32, k/v are a pool ``[R,K,D]`` shared by
  the batch and key j of sequence b is pool row ``kv_rows[b, j]``. A negative row is padding:
  never read (its K/V may be NaN) and an empty slot whatever ``k_pos`` says. ``k_pos [B,S]``
  are those keys' positions (default ``arange(S)`` per sequence); int8 pools carry
  ``k_scale``/``v_scale`` ``[R,K]``. Sequences may share rows (a common prefix) and list them in
  any order. The result equals gathering each sequence's rows into dense ``[B,S,K,D]`` arrays
  and calling this function on those; the Pallas kernels read the rows in place (no gathered
  copy). Host row values >= R raise ``ValueError``; device row tables are not read back.

  A cache filled from index 0: ``kv_fill`` (int scalar or ``[B]``) says keys at indices
  >= kv_fill[b] are empty slots whatever ``k_pos`` says (never read; their K/V may be NaN). The
  result equals the call with those slots' ``k_pos`` set to -1; the decode kernel uses it to bound
  the keys without a reduction over ``k_pos`` (host values outside [0, S] raise ``ValueError``,
  device values act clamped).
  """
  args = validation.attention_args(q, k, v, q_pos=q_pos, k_pos=k_pos, k_scale=k_scale,
                                   v_scale=v_scale, window=window, softcap=softcap, scale=scale,
                                   causal=causal, kv_rows=kv_rows)
  impl = resolve_impl(impl, args.q_len)
  kv_fill = validation.kv_fill_arg("attention", kv_fill, batch=args.batch, kv_len=args.kv_len)
  if kv_fill is not None and not (impl == "pallas" and args.q_len <= MAX_DECODE_QUERIES):
    # Only the decode kernel has a use for the fill level; the others take it as empty slots.
    k_pos = validation.fill_positions(k_pos, kv_fill, batch=args.batch, kv_len=args.kv_len)
    kv_fill = None
  # The caller's positions go through unchanged: with k_pos=None the kernels know the keys are
  # arange(S) and take their cheaper default-positions path.
  kw = dict(kv_rows=args.kv_rows, q_pos=q_pos, k_pos=k_pos, k_scale=k_scale, v_scale=v_scale,
            causal=causal, window=window, softcap=softcap, scale=args.scale)
  if impl == "reference":
    return attention_reference(q, k, v, **kw)
  if impl == "xla":
    return attention_xla(q, k, v, **kw)
  if args.q_len <= MAX_DECODE_QUERIES:
    from rkv.pallas import decode_attention as kernel
    return kernel.decode_attention(q, k, v, block_sizes=block_sizes, kv_fill=kv_fill, **kw)
  if block_sizes is None and jax.default_backend() == "gpu":
    mgpu = _mgpu_kernel()
    if mgpu is not None and mgpu.supports(q, k, v, **kw):
      # Hopper fast path (rkv/pallas/flash_attention_mgpu.py): prefill, and chunks at any
      # offset with explicit positions or a window; int8 and softcap stay on the generic kernel.
      return mgpu.flash_attention_mgpu(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=causal,
                                       window=window, scale=args.scale)
  from rkv.pallas import flash_attention as kernel
  return kernel.flash_attention(q, k, v, block_sizes=block_sizes, **kw)


def _mgpu_kernel():
  """The Mosaic GPU kernel module, or None where its imports fail (a jaxlib without Mosaic GPU)."""
  try:
    from rkv.pallas import flash_attention_mgpu
  except ImportError:
    return None
  return flash_attention_mgpu
