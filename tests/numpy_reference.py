"""Float64 NumPy attention: the ground truth every backend is tested against.

Written independently of the package (no jax), straight from the contract in docs/DESIGN.md §2.
"""

from __future__ import annotations

import numpy as np


def visible_mask(q_pos, k_pos, causal=True, window=None):
  """[B,T,S] bool: key j visible to query i (docs/DESIGN.md §2)."""
  q = np.asarray(q_pos, np.int64)[:, :, None]
  k = np.asarray(k_pos, np.int64)[:, None, :]
  m = k >= 0
  if causal:
    m = m & (k <= q)
  if window is not None:
    m = m & (q - k < window)
  return m


def attention(q, k, v, q_pos=None, k_pos=None, *, causal=True, window=None, softcap=None,
              scale=None, k_scale=None, v_scale=None):
  """Returns (o [B,T,H,D] float64, lse [B,T,H] float64 natural log; -inf and o=0 on empty rows)."""
  q = np.asarray(q, np.float64)
  k = np.asarray(k).astype(np.float64)
  v = np.asarray(v).astype(np.float64)
  if k_scale is not None:
    k = k * np.asarray(k_scale, np.float64)[..., None]
    v = v * np.asarray(v_scale, np.float64)[..., None]
  b, t, h, d = q.shape
  s, kh = k.shape[1], k.shape[2]
  g = h // kh
  if k_pos is None:
    k_pos = np.broadcast_to(np.arange(s), (b, s))
  if q_pos is None:
    q_pos = np.broadcast_to(np.arange(t) + s - t, (b, t))
  scale = d ** -0.5 if scale is None else scale
  mask = visible_mask(q_pos, k_pos, causal, window)  # [B,T,S]
  # Empty slots may hold NaN: zero them so 0 * NaN cannot reach the sums; they are masked anyway.
  kvalid = (np.asarray(k_pos) >= 0)[:, :, None, None]
  k = np.where(kvalid, k, 0.0)
  v = np.where(kvalid, v, 0.0)
  kx = np.repeat(k, g, axis=2)  # [B,S,H,D]
  vx = np.repeat(v, g, axis=2)
  logits = np.einsum("bthd,bshd->bhts", q, kx) * scale
  if softcap is not None:
    logits = softcap * np.tanh(logits / softcap)
  m4 = mask[:, None, :, :]
  logits = np.where(m4, logits, -np.inf)
  mx = np.max(logits, axis=-1, keepdims=True)
  mx_safe = np.where(np.isfinite(mx), mx, 0.0)
  p = np.where(m4, np.exp(logits - mx_safe), 0.0)
  den = p.sum(-1, keepdims=True)
  # A row saw a key iff its weights do not sum to exactly 0; a NaN it read (q, or a visible K/V
  # cell) makes den NaN, and NaN != 0, so the NaN reaches o and lse (docs/DESIGN.md §3).
  seen = den != 0
  o = np.einsum("bhts,bshd->bthd", p / np.where(seen, den, 1.0), vx)
  with np.errstate(divide="ignore", invalid="ignore"):
    lse = (np.log(den) + mx_safe)[..., 0]  # [B,H,T]
  lse = np.where(seen[..., 0], lse, -np.inf)
  return o, np.transpose(lse, (0, 2, 1))


def quantize_int8(x, scale_dtype=np.float32):
  """Symmetric int8 per (token, head): x [B,S,K,D] -> (int8 [B,S,K,D], scale [B,S,K] of
  ``scale_dtype``, float32 or bfloat16). The cells are quantized against the stored (rounded)
  scale."""
  x = np.asarray(x, np.float32)
  amax = np.abs(x).max(-1)
  with np.errstate(invalid="ignore"):  # a non-finite row keeps a non-finite scale (rkv refuses it)
    scale = np.where(amax == 0, 1.0, amax / 127.0).astype(np.float32).astype(scale_dtype)
  q = np.clip(np.round(x / scale.astype(np.float32)[..., None]), -127, 127).astype(np.int8)
  return q, scale
