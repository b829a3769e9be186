"""Flash attention (tiled online softmax) as one generic Pallas kernel, positions-aware.

The same kernel compiles through the Pallas Triton lowering on the H200 and runs with
``interpret=True`` on CPU, so CI tests the code that runs on the GPU. Semantics are docs/DESIGN.md §2:
arbitrary ``q_pos``/``k_pos``, ``k_pos < 0`` marks an empty slot whose K/V may be NaN, causal and
sliding-window masks from positions, softcap, GQA, int8 K/V with per (token, kv head) scales.
Returns ``o`` (q's dtype) and the natural-log ``lse`` (float32), ``o = 0``/``lse = -inf`` on rows
that see no key.

Structure: grid ``(T/block_q, H, B)``; one program owns ``block_q`` query rows of one query head
and loops (``lax.fori_loop``) over the KV blocks of its kv head ``h // G``; the K/V refs cover the
whole of S. Tile skipping: the wrapper reduces positions to per-KV-block ``[kmin, kmax]`` of valid
keys and per-Q-block ``[qmin, qmax]`` (O(S + T) jnp), derives for each Q block the range
``[lo, hi)`` of KV blocks that can be visible, and the kernel loops over that range only, with a
branch that also skips interior blocks nothing in the Q block can see (holes, non-monotone
positions). With default positions, causal prefill visits about half the blocks.

Nothing is padded in the wrapper: head dims that are not a power of two (80, 96) and lengths that
are not tile multiples are handled by masked loads/stores inside the kernel (Triton needs
power-of-two tiles), so an aligned call and an unaligned one cost the same HBM traffic.

Many sequences in one pool (``kv_rows [B,S]``, K/V ``[R,K,D]``): a KV block loads its block_k row
numbers, then gather-loads those rows of the pool (Triton lowers a load indexed by int arrays to
one pointer tensor; a row of one kv head is D contiguous elements, whole cache lines at D >= 64
bf16). Padding rows (negative) are masked out of the loads and are empty slots; no gathered copy
of K/V is ever made. Rows >= R (device tables are not range-checked) read the last row, as a jnp
gather clamps.

Glossary: B batch, T query length, S key/value length, H query heads, K kv heads, G = H/K,
D head dim, R rows of a shared K/V pool.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from rkv import validation

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
# Sentinels for a KV block without a valid key: kmin > kmax makes it invisible, and |2**30| keeps
# `qmin - kmax` and `kmin - qmax` inside int32 for any position below 2**30.
_EMPTY_MIN = 2**30
_EMPTY_MAX = -(2**30)
# Triton's dot needs every operand dim >= 16, and every tile a power of two.
_MIN_TILE = 16


# --------------------------------------------------------------------------------------------
# (1) Block sizes
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiling and Triton launch knobs of the flash-attention kernel (all static under jit).

  ``block_q``/``block_k`` must be powers of two >= 16 (Triton tile and dot constraints); they are
  clamped down to the next power of two above T / S for short inputs. ``num_warps`` and
  ``num_stages`` go to ``plgpu.CompilerParams`` and are ignored in interpret mode.
  ``skip_interior`` keeps the in-loop branch that skips invisible KV blocks inside ``[lo, hi)``;
  switching it off leaves only the range (exact for monotone positions) and may let Triton's
  software pipeliner stream K/V better: a knob to sweep, not a correctness switch (masking makes
  a visited invisible block an exact no-op either way).
  """

  block_q: int = 128
  block_k: int = 64
  num_warps: int = 8
  num_stages: int = 3
  skip_interior: bool = True

  def __post_init__(self):
    for name in ("block_q", "block_k"):
      val = getattr(self, name)
      if not isinstance(val, int) or val < _MIN_TILE or val & (val - 1):
        raise ValueError(f"BlockSizes: {name} must be a power of two >= {_MIN_TILE}, got {val!r}")
    for name in ("num_warps", "num_stages"):
      val = getattr(self, name)
      if not isinstance(val, int) or val < 1:
        raise ValueError(f"BlockSizes: {name} must be a positive int, got {val!r}")

  @classmethod
  def for_head_dim(cls, head_dim: int) -> "BlockSizes":
    """Untuned H200 starting points, bf16 prefill (FlashAttention-2 Triton-style tiles).

    The f32 accumulator ``[block_q, D]`` lives in registers: D=256 halves block_q to keep it at
    64 KiB per program; small D affords 4 warps (jax's own mha heuristic: 4 warps for D <= 64).
    """
    if head_dim <= 64:
      return cls(block_q=128, block_k=64, num_warps=4, num_stages=3)
    if head_dim <= 128:
      return cls(block_q=128, block_k=64, num_warps=8, num_stages=3)
    return cls(block_q=64, block_k=32, num_warps=4, num_stages=2)

  @classmethod
  def for_interpret(cls) -> "BlockSizes":
    """Opt-in for CPU interpret runs on larger shapes: each grid step and each masked load
    re-pads whole refs there, so fewer, larger tiles run fastest. ``block_sizes=None`` keeps the
    GPU preset even when interpreting, so CI runs the GPU tiling (clamped to short inputs)."""
    return cls(block_q=64, block_k=64, num_warps=4, num_stages=1)


# --------------------------------------------------------------------------------------------
# (2) Kernel
# --------------------------------------------------------------------------------------------
def _masked_load(ref, mask, other):
  """``ref[...]``, predicated when a mask is needed (tile overhangs T, S or D)."""
  if mask is None:
    return ref[...]
  return plgpu.load(ref, mask=mask, other=other)


def _and(a, b):
  if a is None:
    return b
  if b is None:
    return a
  return a & b


def _flash_kernel(qmeta_ref, kmeta_ref, q_pos_ref, k_pos_ref, q_ref, k_ref, v_ref, *rest,
                  quantized: bool, causal: bool, window: int | None, softcap: float | None,
                  scale: float, head_dim: int, q_len: int, kv_len: int, q_block: int,
                  block_k: int, skip_interior: bool, count_visits: bool, pooled: bool = False,
                  pool_rows: int = 0):
  """One program: ``block_q`` query rows of one query head against all KV blocks of its kv head.

  Refs (batch and head squeezed): qmeta [4] int32 = (lo, hi, qmin, qmax) of this Q block;
  kmeta [nK, 2] int32 = (kmin, kmax) per KV block; q_pos [block_q]; k_pos [S];
  q [block_q, Dp]; k, v [S, Dp] (a pool's [R, Dp] when ``pooled``, then kv_rows [S] int32);
  optional k_scale, v_scale [S] (or [R]); then o [block_q, Dp], lse [block_q], optional
  visits [] (KV blocks actually computed, for tests).
  """
  if pooled:
    rows_ref, *rest = rest
  if quantized:
    ks_ref, vs_ref, *rest = rest
  o_ref, lse_ref, *rest = rest
  visits_ref = rest[0] if count_visits else None
  block_q, d_pad = q_ref.shape

  # Static masks for tiles that overhang the arrays; None when the shapes are aligned, so the
  # aligned (common) case issues plain, unpredicated loads.
  q_start = q_block * block_q
  row_ok = None
  if q_len % block_q:
    row_ok = q_start + lax.iota(jnp.int32, block_q) < q_len  # [block_q]
  col_ok = (lax.iota(jnp.int32, d_pad) < head_dim)[None, :] if d_pad != head_dim else None

  q = _masked_load(q_ref, _and(None if row_ok is None else row_ok[:, None], col_ok), 0)
  q_pos = _masked_load(q_pos_ref, row_ok, 0)  # rows past T are never stored
  mm_dtype = q.dtype  # matrix units get q's dtype (bf16 on the H200), accumulation is f32
  # f32 operands: force IEEE, Triton's default for f32 is TF32 (~1e-3 relative).
  precision = lax.Precision.HIGHEST if mm_dtype == jnp.float32 else None

  lo, hi, qmin, qmax = qmeta_ref[0], qmeta_ref[1], qmeta_ref[2], qmeta_ref[3]

  # Logits go to base 2 here (exp2 is the cheap SFU op); m is in base-2 units, lse is converted
  # back to natural log exactly once at the end.
  if softcap is None:
    pre, post = scale * _LOG2E, None
  else:
    pre, post = scale / softcap, softcap * _LOG2E

  def compute(j, carry):
    acc, m_prev, l_prev, n = carry
    start = j * block_k
    keys = pl.ds(start, block_k)
    kv_row_ok = None
    if kv_len % block_k:
      kv_row_ok = start + lax.iota(jnp.int32, block_k) < kv_len  # [block_k]
    tile_mask = _and(None if kv_row_ok is None else kv_row_ok[:, None], col_ok)

    k_pos = _masked_load(k_pos_ref.at[keys], kv_row_ok, -1)  # rows past S: empty slots
    k_ok = k_pos >= 0  # the wrapper made padding rows empty slots
    if pooled:
      rows = _masked_load(rows_ref.at[keys], kv_row_ok, -1)
      row_ok = rows >= 0  # padding, and keys past S: never fetched
      rows = jnp.clip(rows, 0, pool_rows - 1)
      tile = (block_k, d_pad)
      # All-array indices (the interpreter's load takes all-array or all-slice ones, not a mix).
      row_idx = jnp.broadcast_to(rows[:, None], tile)
      col_idx = lax.broadcasted_iota(jnp.int32, tile, 1)
      gather_mask = jnp.broadcast_to(_and(row_ok[:, None], col_ok), tile)
      load_kv = lambda ref: plgpu.load(ref.at[row_idx, col_idx], mask=gather_mask, other=0)
      load_scale = lambda ref: plgpu.load(ref.at[rows], mask=row_ok, other=0.0).astype(
          jnp.float32)
    else:
      load_kv = lambda ref: _masked_load(ref.at[keys, :], tile_mask, 0)
      load_scale = lambda ref: _masked_load(ref.at[keys], kv_row_ok, 0.0).astype(jnp.float32)
    k = load_kv(k_ref)
    s = lax.dot_general(q, k.astype(mm_dtype), (((1,), (1,)), ((), ())),
                        precision=precision, preferred_element_type=jnp.float32)  # [bq, bk]
    if quantized:
      s = s * load_scale(ks_ref)[None, :]
    if post is None:
      s = s * pre
    else:
      s = post * jnp.tanh(s * pre)

    visible = k_ok[None, :]
    if causal:
      visible = visible & (k_pos[None, :] <= q_pos[:, None])
    if window is not None:
      visible = visible & (q_pos[:, None] - k_pos[None, :] < window)
    # Empty slots may hold NaN K: their logit columns are replaced here (NaN only pollutes its
    # own column of q @ k.T).
    s = jnp.where(visible, s, -jnp.inf)

    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    # A row with nothing visible so far keeps m = -inf; shifting by 0 then gives exp2(-inf) = 0
    # instead of exp2(-inf - -inf) = NaN.
    m_shift = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    alpha = jnp.exp2(m_prev - m_shift)
    p = jnp.exp2(s - m_shift[:, None])
    l_next = alpha * l_prev + jnp.sum(p, axis=1)

    v = load_kv(v_ref)
    if quantized:
      # (p * v_scale) @ v_int8: one scale per key column. A NaN scale in an empty slot would
      # survive p = 0 (0 * NaN), so the scale is zeroed there.
      vs = load_scale(vs_ref)
      p_v = p * jnp.where(k_ok, vs, 0.0)[None, :]
    else:
      # p = 0 on empty slots is not enough: 0 * NaN = NaN in the dot. Zero their V rows.
      v = jnp.where(k_ok[:, None], v, jnp.zeros_like(v))
      p_v = p
    pv = lax.dot_general(p_v.astype(mm_dtype), v.astype(mm_dtype), (((1,), (0,)), ((), ())),
                         precision=precision, preferred_element_type=jnp.float32)
    return alpha[:, None] * acc + pv, m_next, l_next, n + 1

  def body(j, carry):
    if not skip_interior:
      return compute(j, carry)
    # Positions are arbitrary, so [lo, hi) may contain blocks nothing here can see: no load,
    # no math for those.
    kmin, kmax = kmeta_ref[j, 0], kmeta_ref[j, 1]
    seen = kmin <= kmax  # the block holds at least one valid key
    if causal:
      seen = seen & (kmin <= qmax)
    if window is not None:
      seen = seen & (qmin - kmax < window)
    return lax.cond(seen, compute, lambda _, c: c, j, carry)

  carry = (jnp.zeros((block_q, d_pad), jnp.float32),
           jnp.full((block_q,), -jnp.inf, jnp.float32),
           jnp.zeros((block_q,), jnp.float32),
           jnp.int32(0))
  acc, m, l, n = lax.fori_loop(lo, hi, body, carry)

  # l != 0, not l > 0: a NaN the row read makes l NaN and must reach o and lse (docs/DESIGN.md §3).
  seen_any = l != 0.0
  inv_l = 1.0 / jnp.where(seen_any, l, 1.0)
  o = (acc * inv_l[:, None]).astype(o_ref.dtype)  # acc = 0 on empty rows, so o = 0
  lse = jnp.where(seen_any, (m + jnp.log2(jnp.where(seen_any, l, 1.0))) * _LN2, -jnp.inf)
  if row_ok is None and col_ok is None:
    o_ref[...] = o
  else:
    plgpu.store(o_ref, o, mask=_and(None if row_ok is None else row_ok[:, None], col_ok))
  if row_ok is None:
    lse_ref[...] = lse
  else:
    plgpu.store(lse_ref, lse, mask=row_ok)
  if count_visits:
    visits_ref[...] = n


# --------------------------------------------------------------------------------------------
# (3) Jitted wrapper
# --------------------------------------------------------------------------------------------
def _next_pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def _block_ranges(q_pos, k_pos, *, block_q: int, block_k: int, causal: bool,
                  window: int | None):
  """Per-Q-block (lo, hi, qmin, qmax) [B,nQ,4] and per-KV-block (kmin, kmax) [B,nK,2], int32.

  O(S + T + nQ * nK) jnp; the [nQ, nK] visibility table is a fused reduction, never stored.
  A Q block that can see no KV block gets lo = hi = 0.
  """
  b, t = q_pos.shape
  s = k_pos.shape[1]
  n_q, n_k = pl.cdiv(t, block_q), pl.cdiv(s, block_k)
  kp = jnp.pad(k_pos, ((0, 0), (0, n_k * block_k - s)), constant_values=-1)
  kp = kp.reshape(b, n_k, block_k)
  k_ok = kp >= 0
  kmin = jnp.min(jnp.where(k_ok, kp, _EMPTY_MIN), axis=2)
  kmax = jnp.max(jnp.where(k_ok, kp, _EMPTY_MAX), axis=2)
  # Edge padding repeats the last query, so a partial Q block's min/max are its real rows'.
  qp = jnp.pad(q_pos, ((0, 0), (0, n_q * block_q - t)), mode="edge").reshape(b, n_q, block_q)
  qmin, qmax = jnp.min(qp, axis=2), jnp.max(qp, axis=2)

  seen = (kmin <= kmax)[:, None, :]  # [B, nQ or 1, nK]
  if causal:
    seen = seen & (kmin[:, None, :] <= qmax[:, :, None])
  if window is not None:
    seen = seen & (qmin[:, :, None] - kmax[:, None, :] < window)
  seen = jnp.broadcast_to(seen, (b, n_q, n_k))
  any_seen = jnp.any(seen, axis=2)
  lo = jnp.where(any_seen, jnp.argmax(seen, axis=2), 0)
  hi = jnp.where(any_seen, n_k - jnp.argmax(seen[:, :, ::-1], axis=2), 0)
  qmeta = jnp.stack([lo, hi, qmin, qmax], axis=2).astype(jnp.int32)
  kmeta = jnp.stack([kmin, kmax], axis=2).astype(jnp.int32)
  return qmeta, kmeta


@functools.partial(
    jax.jit,
    static_argnames=("causal", "window", "softcap", "scale", "block_sizes", "interpret",
                     "count_visits"))
def _flash_attention(q, k, v, q_pos, k_pos, k_scale, v_scale, kv_rows=None, *, causal: bool,
                     window: int | None, softcap: float | None, scale: float,
                     block_sizes: BlockSizes, interpret: bool, count_visits: bool):
  b, t, h, d = q.shape
  pooled = kv_rows is not None
  s, kh = (kv_rows.shape[1], k.shape[1]) if pooled else (k.shape[1], k.shape[2])
  if pooled:
    # Padding keys become empty slots: masked like holes, skipped by the block ranges.
    k_pos = jnp.where(kv_rows < 0, -1, k_pos)
  g = h // kh
  quantized = k_scale is not None
  # Short inputs shrink the tiles (not below Triton's 16) instead of computing dead rows.
  block_q = min(block_sizes.block_q, max(_MIN_TILE, _next_pow2(t)))
  block_k = min(block_sizes.block_k, max(_MIN_TILE, _next_pow2(s)))
  d_pad = max(_MIN_TILE, _next_pow2(d))
  n_q, n_k = pl.cdiv(t, block_q), pl.cdiv(s, block_k)

  qmeta, kmeta = _block_ranges(q_pos, k_pos, block_q=block_q, block_k=block_k, causal=causal,
                               window=window)

  # Grid axis 0 is Triton's fastest launch axis: all Q blocks of one head run side by side and
  # share its K/V in L2; GQA heads of one kv head follow. Q blocks run last-first because under a
  # causal mask the last ones see the most keys: starting them first shortens the tail.
  rev = lambda i: n_q - 1 - i
  in_specs = [
      pl.BlockSpec((None, None, 4), lambda i, j, bi: (bi, rev(i), 0)),            # qmeta
      pl.BlockSpec((None, n_k, 2), lambda i, j, bi: (bi, 0, 0)),                  # kmeta
      pl.BlockSpec((None, block_q), lambda i, j, bi: (bi, rev(i))),               # q_pos
      pl.BlockSpec((None, s), lambda i, j, bi: (bi, 0)),                          # k_pos
      pl.BlockSpec((None, block_q, None, d_pad), lambda i, j, bi: (bi, rev(i), j, 0)),  # q
  ]
  args = [qmeta, kmeta, q_pos, k_pos, q, k, v]
  if pooled:
    # Each program sees its kv head's whole pool; its sequence's row table picks the rows.
    r_pool = k.shape[0]
    kv_spec = pl.BlockSpec((r_pool, None, d_pad), lambda i, j, bi: (0, j // g, 0))
    scale_spec = pl.BlockSpec((r_pool, None), lambda i, j, bi: (0, j // g))
    in_specs += [kv_spec, kv_spec, pl.BlockSpec((None, s), lambda i, j, bi: (bi, 0))]
    args.append(kv_rows)
  else:
    r_pool = 0
    kv_spec = pl.BlockSpec((None, s, None, d_pad), lambda i, j, bi: (bi, 0, j // g, 0))
    scale_spec = pl.BlockSpec((None, s, None), lambda i, j, bi: (bi, 0, j // g))
    in_specs += [kv_spec, kv_spec]
  if quantized:
    in_specs += [scale_spec, scale_spec]
    # bfloat16 scales go in as they are (widened as the kernel loads them): a cast here would be
    # one more XLA pass over them.
    args += [validation.scale_operand(k_scale), validation.scale_operand(v_scale)]
  out_specs = [
      pl.BlockSpec((None, block_q, None, d_pad), lambda i, j, bi: (bi, rev(i), j, 0)),  # o
      pl.BlockSpec((None, block_q, None), lambda i, j, bi: (bi, rev(i), j)),            # lse
  ]
  out_shape = [jax.ShapeDtypeStruct((b, t, h, d), q.dtype),
               jax.ShapeDtypeStruct((b, t, h), jnp.float32)]
  if count_visits:
    out_specs.append(pl.BlockSpec((None, None, None), lambda i, j, bi: (bi, j, rev(i))))
    out_shape.append(jax.ShapeDtypeStruct((b, h, n_q), jnp.int32))

  def kernel(*refs):
    # The Q block index is only known from the grid inside the kernel (for the overhang mask).
    return _flash_kernel(*refs, quantized=quantized, causal=causal, window=window,
                         softcap=softcap, scale=scale, head_dim=d, q_len=t, kv_len=s,
                         q_block=rev(pl.program_id(0)), block_k=block_k,
                         skip_interior=block_sizes.skip_interior, count_visits=count_visits,
                         pooled=pooled, pool_rows=r_pool)

  outs = pl.pallas_call(
      kernel,
      grid=(n_q, h, b),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=block_sizes.num_warps,
                                           num_stages=block_sizes.num_stages),
      interpret=interpret,
      name="rkv_flash_attention",
  )(*args)
  return tuple(outs)


def _resolve(q, k, v, kv_rows, q_pos, k_pos, k_scale, v_scale, window, softcap, scale,
             block_sizes, interpret):
  args = validation.attention_args(q, k, v, q_pos=q_pos, k_pos=k_pos, k_scale=k_scale,
                                   v_scale=v_scale, window=window, softcap=softcap, scale=scale,
                                   kv_rows=kv_rows, where="flash_attention")
  if block_sizes is None:
    block_sizes = BlockSizes.for_head_dim(args.head_dim)
  elif not isinstance(block_sizes, BlockSizes):
    raise ValueError(f"flash_attention: block_sizes must be a BlockSizes or None, "
                     f"got {type(block_sizes).__name__}")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  return args, dict(window=None if window is None else int(window),
                    softcap=None if softcap is None else float(softcap), scale=args.scale,
                    block_sizes=block_sizes, interpret=bool(interpret))


def flash_attention(q, k, v, *, kv_rows=None, q_pos=None, k_pos=None, k_scale=None,
                    v_scale=None, causal=True, window=None, softcap=None, scale=None,
                    block_sizes: BlockSizes | None = None,
                    interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """Exact attention of q [B,T,H,D] over k/v [B,S,K,D] by positions; returns (o, lse).

  ``o`` [B,T,H,D] has q's dtype; ``lse`` [B,T,H] is float32 natural log; rows that see no key
  give ``o = 0``, ``lse = -inf``. K/V may be int8 with ``k_scale``/``v_scale`` [B,S,K].
  ``interpret=None`` interprets on a CPU backend. ``block_sizes=None`` picks
  ``BlockSizes.for_head_dim(D)``. With ``kv_rows [B,S]`` int32, k/v are a pool ``[R,K,D]``
  (scales ``[R,K]``) and key j of sequence b is row ``kv_rows[b, j]`` (negative: padding, an
  empty slot never fetched); the kernel gather-loads the rows in place.
  """
  validation.check_causal("flash_attention", causal)
  args, static = _resolve(q, k, v, kv_rows, q_pos, k_pos, k_scale, v_scale, window, softcap,
                          scale, block_sizes, interpret)
  if args.kv_len == 0:  # no KV blocks to tile: the no-key answer, as every backend gives it
    return jnp.zeros(q.shape, q.dtype), jnp.full(q.shape[:3], -jnp.inf, jnp.float32)
  o, lse = _flash_attention(q, k, v, args.q_pos, args.k_pos, k_scale, v_scale, args.kv_rows,
                            causal=bool(causal), count_visits=False, **static)
  return o, lse


def flash_attention_block_visits(q, k, v, *, kv_rows=None, q_pos=None, k_pos=None,
                                 k_scale=None, v_scale=None, causal=True, window=None,
                                 softcap=None, scale=None, block_sizes: BlockSizes | None = None,
                                 interpret: bool | None = None):
  """Like :func:`flash_attention`, plus visits [B,H,nQ] int32: KV blocks each program computed.

  For tests and tuning: proves tile skipping happens (a causal prefill with default positions
  computes about half of the nQ * nK blocks).
  """
  validation.check_causal("flash_attention", causal)
  args, static = _resolve(q, k, v, kv_rows, q_pos, k_pos, k_scale, v_scale, window, softcap,
                          scale, block_sizes, interpret)
  return _flash_attention(q, k, v, args.q_pos, args.k_pos, k_scale, v_scale, args.kv_rows,
                          causal=bool(causal), count_visits=True, **static)


# --------------------------------------------------------------------------------------------
# (4) Reference
# --------------------------------------------------------------------------------------------
def flash_attention_reference(q, k, v, *, kv_rows=None, q_pos=None, k_pos=None, k_scale=None,
                              v_scale=None, causal=True, window=None, softcap=None,
                              scale=None) -> tuple[jax.Array, jax.Array]:
  """Plain-jnp float32 attention with the full [B,T,S] mask: same contract as the kernel.

  The one reference of the package (``rkv.attention.attention_reference``) under this file's name.
  """
  from rkv.attention import attention_reference  # lazy: rkv.attention dispatches to this module
  validation.attention_args(q, k, v, q_pos=q_pos, k_pos=k_pos, k_scale=k_scale, v_scale=v_scale,
                            window=window, softcap=softcap, scale=scale, kv_rows=kv_rows,
                            where="flash_attention_reference")
  return attention_reference(q, k, v, kv_rows=kv_rows, q_pos=q_pos, k_pos=k_pos, k_scale=k_scale,
                             v_scale=v_scale, causal=causal, window=window, softcap=softcap,
                             scale=scale)
