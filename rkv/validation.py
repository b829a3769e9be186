"""Input validation and positional defaults shared by every attention backend.

Every public entry point (``rkv.attention``, each Pallas wrapper, the rolling cache) funnels its
arguments through :func:`attention_args` so that a bad call fails the same way, with a
``ValueError`` naming the argument, whichever backend it would have reached.

Glossary: B batch, T query length, S key/value length, H query heads, K kv heads, G = H / K, D head dim,
R rows of a shared KV pool (``kv_rows``).
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_KV_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
QUERY_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class AttentionArgs:
  """Validated arguments: positions filled in, scale resolved, dims named."""

  q_pos: jax.Array  # [B,T] int32
  k_pos: jax.Array  # [B,S] int32
  scale: float
  batch: int
  q_len: int
  kv_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  # With a pool: kv_rows [B,S] int32 (as given, negative = padding) and R, its number of rows.
  kv_rows: jax.Array | None = None
  pool_rows: int | None = None

  @property
  def group(self) -> int:
    return self.num_heads // self.num_kv_heads


def _shape(x) -> tuple[int, ...]:
  return tuple(np.shape(x))


def default_positions(batch: int, q_len: int, kv_len: int) -> tuple[jax.Array, jax.Array]:
  """``k_pos = arange(S)``, ``q_pos = S - T + arange(T)``: the queries are the last T keys."""
  k_pos = jnp.broadcast_to(jnp.arange(kv_len, dtype=jnp.int32), (batch, kv_len))
  q_pos = jnp.broadcast_to(jnp.arange(q_len, dtype=jnp.int32) + (kv_len - q_len), (batch, q_len))
  return q_pos, k_pos


def check_query_against_kv(where: str, q_shape: tuple[int, ...], *, kv_batch: int, kv_heads: int,
                           kv_head_dim: int) -> None:
  """q ``[B,T,H,D]`` against the K/V's batch, kv heads K and head dim, whatever the K/V layout."""
  b, t, h, d = q_shape
  if kv_batch != b:
    raise ValueError(f"{where}: k batch {kv_batch} must equal q batch {b}")
  if kv_head_dim != d:
    raise ValueError(f"{where}: k head dim {kv_head_dim} must equal q head dim {d}")
  if kv_heads == 0 or h % kv_heads != 0:
    raise ValueError(f"{where}: q heads H={h} must be a multiple of kv heads K={kv_heads}")
  if t == 0 or d == 0:
    raise ValueError(f"{where}: q must have T >= 1 and D >= 1, got shape {tuple(q_shape)}")


def _dtype(x):
  return x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype


def _as_int32(x):
  # jnp.asarray costs ~5 us even on an int32 jax.Array: every eager decode step validates, so
  # arrays that already are int32 pass through untouched.
  if isinstance(x, (jax.Array, jax.core.Tracer)) and x.dtype == jnp.int32:
    return x
  return jnp.asarray(x, jnp.int32)


def scale_operand(x):
  """An int8 scale array as a Pallas kernel operand: float32 and bfloat16 as they are (the kernels
  widen each block of them as they load it), any other float as float32."""
  return x if jnp.dtype(x.dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)) else (
      jnp.asarray(x, jnp.float32))


def attention_args(q, k, v, *, q_pos=None, k_pos=None, k_scale=None, v_scale=None,
                   window=None, softcap=None, scale=None, causal=True, kv_rows=None,
                   where: str = "attention") -> AttentionArgs:
  """Checks shapes, dtypes and options of one attention call; returns the resolved arguments.

  ``k_scale``/``v_scale`` (``[B,S,K]`` float, ``[R,K]`` with a pool) must be given exactly when
  K/V are int8. With ``kv_rows [B,S]``, k/v are a pool ``[R,K,D]`` and key j of sequence b is its
  row ``kv_rows[b, j]`` (negative: padding); S is kv_rows' length.
  """
  if len(_shape(q)) != 4:
    raise ValueError(f"{where}: q must be rank 4 ([B,T,H,D]), got shape {_shape(q)}")
  b, t, h, d = _shape(q)
  pool_rows = None
  if kv_rows is None:
    for name, x in (("k", k), ("v", v)):
      if len(_shape(x)) != 4:
        raise ValueError(f"{where}: {name} must be rank 4 ([B,S,K,D]), got shape {_shape(x)}")
    bk, s, kh, dk = _shape(k)
  else:
    pool_rows, s, kh, dk = _pool_shape(where, k, v, kv_rows, batch=b)
    bk = b
  if _shape(v) != _shape(k):
    raise ValueError(f"{where}: v shape {_shape(v)} must equal k shape {_shape(k)}")
  check_query_against_kv(where, _shape(q), kv_batch=bk, kv_heads=kh, kv_head_dim=dk)
  # Scales follow the K/V layout: one per (key, kv head) of [B,S,K,D], one per (row, kv head) of
  # a pool [R,K,D].
  if kv_rows is None:
    scale_shape, scale_name = (b, s, kh), "[B,S,K]"
  else:
    scale_shape, scale_name = (pool_rows, kh), "[R,K]"
  if jnp.dtype(q.dtype) not in [jnp.dtype(x) for x in QUERY_DTYPES]:
    raise ValueError(f"{where}: q dtype must be bfloat16, float16 or float32, got {q.dtype}")
  if jnp.dtype(k.dtype) != jnp.dtype(v.dtype):
    raise ValueError(f"{where}: k dtype {k.dtype} must equal v dtype {v.dtype}")
  if jnp.dtype(k.dtype) == jnp.dtype(jnp.int8):
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
      if sc is None:
        raise ValueError(f"{where}: int8 k/v need {name} of shape {scale_name}={scale_shape}")
      if _shape(sc) != scale_shape:
        raise ValueError(f"{where}: {name} must have shape {scale_name}={scale_shape}, got "
                         f"{_shape(sc)}")
      if not jnp.issubdtype(sc.dtype, jnp.floating):
        raise ValueError(f"{where}: {name} must be a float array, got {sc.dtype}")
  elif jnp.dtype(k.dtype) in [jnp.dtype(x) for x in FLOAT_KV_DTYPES]:
    if k_scale is not None or v_scale is not None:
      raise ValueError(f"{where}: k_scale/v_scale are only valid with int8 k/v, got k dtype {k.dtype}")
  else:
    raise ValueError(f"{where}: k/v dtype must be bfloat16, float16, float32 or int8, got {k.dtype}")

  if q_pos is None or k_pos is None:
    dq, dk_ = default_positions(b, t, s)
    q_pos = dq if q_pos is None else q_pos
    k_pos = dk_ if k_pos is None else k_pos
  for name, pos, want in (("q_pos", q_pos, (b, t)), ("k_pos", k_pos, (b, s))):
    if _shape(pos) != want:
      raise ValueError(f"{where}: {name} must have shape {want}, got {_shape(pos)}")
    check_positions_int32(where, name, pos)  # first: jnp cannot even hold such a list
    pos_dtype = _dtype(pos)
    if not jnp.issubdtype(pos_dtype, jnp.integer):
      raise ValueError(f"{where}: {name} must be an integer array, got {pos_dtype}")
  q_pos, k_pos = _as_int32(q_pos), _as_int32(k_pos)

  scale = attention_options(where, window=window, softcap=softcap, scale=scale, head_dim=d,
                            causal=causal)
  return AttentionArgs(q_pos=q_pos, k_pos=k_pos, scale=scale, batch=b, q_len=t, kv_len=s,
                       num_heads=h, num_kv_heads=kh, head_dim=d,
                       kv_rows=None if kv_rows is None else _as_int32(kv_rows),
                       pool_rows=pool_rows)


def kv_fill_arg(where: str, kv_fill, *, batch: int, kv_len: int):
  """Checks ``kv_fill`` (an int scalar, ``[1]`` or ``[B]``: keys at indices >= kv_fill[b] are empty
  slots) and returns it as int32 ``[1]`` (a scalar) or ``[B]``, or None. Host values must lie in
  ``[0, S]``; device values are not read back (a sync per layer) and act clamped to ``[0, S]`` in
  every impl."""
  if kv_fill is None:
    return None
  shape = _shape(kv_fill)
  if shape not in ((), (1,), (batch,)):  # (1,): a scalar this function already returned
    raise ValueError(f"{where}: kv_fill must be a scalar or have shape (B,)=({batch},), got {shape}")
  if not jnp.issubdtype(_dtype(kv_fill), jnp.integer):
    raise ValueError(f"{where}: kv_fill must be an integer array, got {_dtype(kv_fill)}")
  check_int_range(where, "kv_fill", kv_fill, 0, kv_len, f"filled slots of the S={kv_len} keys")
  return _as_int32(kv_fill).reshape(-1)


def fill_positions(k_pos, kv_fill, *, batch: int, kv_len: int):
  """``k_pos`` [B,S] (None: arange) with the slots at indices >= ``kv_fill`` (from
  :func:`kv_fill_arg`) made empty (-1): how the impls without a fast path for ``kv_fill`` honour it."""
  idx = jnp.arange(kv_len, dtype=jnp.int32)[None, :]
  if k_pos is None:
    k_pos = jnp.broadcast_to(idx, (batch, kv_len))
  return jnp.where(idx < kv_fill[:, None], _as_int32(k_pos), -1)


def _pool_shape(where: str, k, v, kv_rows, *, batch: int) -> tuple[int, int, int, int]:
  """Checks a pool ``k, v [R,K,D]`` and its row table ``kv_rows [B,S]``; returns (R, S, K, D).

  Row values are checked on host data only (:func:`host_values`): reading a device row table
  back would be a sync per layer and step. A device row >= R reads the pool's last row in every
  impl (each one clamps, as a jnp gather does), never memory outside the pool."""
  for name, x in (("k", k), ("v", v)):
    if len(_shape(x)) != 3:
      raise ValueError(f"{where}: with kv_rows, {name} must be a rank-3 pool [R,K,D], got shape "
                       f"{_shape(x)}")
  r = _shape(k)[0]
  rows_shape = _shape(kv_rows)
  if len(rows_shape) != 2 or rows_shape[0] != batch:
    raise ValueError(f"{where}: kv_rows must have shape [B,S] with B={batch} (q's batch), got "
                     f"{rows_shape}")
  check_int_range(where, "kv_rows", kv_rows, INT32_MIN, r - 1,
                  f"rows of the pool of R={r} rows; negative marks padding")
  if not jnp.issubdtype(_dtype(kv_rows), jnp.integer):
    raise ValueError(f"{where}: kv_rows must be an integer array, got {_dtype(kv_rows)}")
  if r == 0 and rows_shape[1]:
    # Nothing to read, not even padding's clamped address: refuse rather than index an empty pool.
    raise ValueError(f"{where}: k is an empty pool (R=0) but kv_rows has S={rows_shape[1]}")
  return (r, rows_shape[1], *_shape(k)[1:])


def _positive_finite(x) -> bool:
  # inf passed ``x > 0``: scale=inf makes every logit inf or NaN, softcap=inf gives inf * 0 = NaN.
  try:
    return math.isfinite(float(x)) and float(x) > 0 and not isinstance(x, bool)
  except (TypeError, ValueError):
    return False


def check_causal(where: str, causal) -> None:
  # causal="no" is truthy: it used to run causal attention silently.
  if not isinstance(causal, (bool, np.bool_)):
    raise ValueError(f"{where}: causal must be a bool, got {causal!r}")


def attention_options(where: str, *, window, softcap, scale, head_dim: int,
                      causal=True) -> float:
  """Checks ``causal``/``window``/``softcap``/``scale``; returns the scale (``D**-0.5`` by
  default)."""
  check_causal(where, causal)
  if window is not None and (not isinstance(window, (int, np.integer)) or isinstance(window, bool)
                             or window < 1):
    raise ValueError(f"{where}: window must be None or a positive int, got {window!r}")
  if softcap is not None and not _positive_finite(softcap):
    raise ValueError(f"{where}: softcap must be None or a finite number > 0, got {softcap!r}")
  if scale is None:
    return float(head_dim) ** -0.5
  if not _positive_finite(scale):
    raise ValueError(f"{where}: scale must be a finite number > 0, got {scale!r}")
  return float(scale)


INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
STALE_HINT = "use the cache returned by the last append"


def host_values(x) -> np.ndarray | None:
  """``x`` as numpy when it is host data (numpy, lists, Python ints), else None.

  jax arrays and tracers give None: reading a device value back is a host sync (one per layer
  and token stalls the decode loop), and a jax array cannot hold an integer beyond int32 anyway
  (x64 is off), so range checks only ever need the host values."""
  if isinstance(x, (jax.Array, jax.core.Tracer)):
    return None
  try:
    return np.asarray(x)
  except (TypeError, ValueError, OverflowError):
    return None  # not array-like: the dtype/shape checks that follow name it


def check_int_range(where: str, name: str, x, lo: int, hi: int, meaning: str) -> None:
  """ValueError naming ``name`` if host integers ``x`` leave ``[lo, hi]`` (jax arrays: skipped,
  see :func:`host_values`). Without it an int64 position beyond int32 wraps to another position
  on the cast and a token id -1 indexes the last row of the embedding."""
  values = host_values(x)
  if values is None or values.size == 0:
    return
  if values.dtype == object:
    # Python ints beyond int64 make an object array; anything else in it is the dtype check's.
    if not all(isinstance(e, (int, np.integer)) and not isinstance(e, bool)
               for e in values.ravel()):
      return
  elif not np.issubdtype(values.dtype, np.integer):
    return  # a float array: the dtype check names it
  vmin, vmax = int(values.min()), int(values.max())
  if vmin < lo or vmax > hi:
    raise ValueError(f"{where}: {name} values must be in [{lo}, {hi}] ({meaning}), got range "
                     f"[{vmin}, {vmax}]")


def check_positions_int32(where: str, name: str, pos) -> None:
  """Positions are int32 (docs/DESIGN.md §2): a host value beyond int32 would wrap."""
  check_int_range(where, name, pos, INT32_MIN, INT32_MAX, "positions are int32")


def check_token_ids(where: str, name: str, tokens, vocab_size: int) -> None:
  """Token ids index the embedding: each must be in ``[0, vocab_size)``."""
  check_int_range(where, name, tokens, 0, vocab_size - 1, f"the vocabulary has {vocab_size} ids")


def check_not_deleted(where: str, name: str, x) -> None:
  """ValueError if the jax array ``x`` was deleted or donated (``append`` donates the window and
  staging it writes), instead of jax's "Array has been deleted" from deep inside a call."""
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted():
    raise ValueError(f"{where}: {name} was deleted or donated ({STALE_HINT})")


def check_live(where: str, name: str, tree) -> None:
  """:func:`check_not_deleted` for every array of a cache (or any pytree). The decode-path
  callers pass only the parts ``append`` donates (window, staging): a few arrays, whatever the
  tail holds; save and generate pass whole caches."""
  for x in jax.tree.leaves(tree):
    check_not_deleted(where, name, x)


def check_choice(where: str, name: str, value, choices) -> None:
  if value not in choices:
    raise ValueError(f"{where}: {name} must be one of {tuple(choices)}, got {value!r}")


_SWITCH_ON, _SWITCH_OFF = ("1", "true", "on"), ("0", "false", "off")


def env_switch(name: str, default: bool) -> bool:
  """An on/off environment variable (``1``/``0``, ``true``/``false``, ``on``/``off``; unset or
  empty: ``default``), read now; anything else is a ValueError naming the variable, not a silent
  default."""
  raw = os.environ.get(name, "").strip().lower()
  if not raw:
    return default
  if raw not in _SWITCH_ON + _SWITCH_OFF:
    raise ValueError(f"${name} must be 0/1 (false/true, off/on), got {raw!r}")
  return raw in _SWITCH_ON


def env_choice(name: str, choices, default: str) -> str:
  """An environment variable naming one of ``choices`` (unset or empty: ``default``), read now;
  anything else is a ValueError naming the variable."""
  raw = os.environ.get(name, "").strip()
  if not raw:
    return default
  if raw not in choices:
    raise ValueError(f"${name} must be one of {tuple(choices)}, got {raw!r}")
  return raw
