"""rkv.pallas.decode_attention (split-K decode kernel) against the float64 NumPy reference.

Runs the Pallas kernel with interpret=True on CPU, on small shapes with tiny blocks (block_k=16, a few
splits) so that partial blocks, uneven splits, empty splits and masked rows all happen.
Glossary: B T H K G D S (see rkv/__init__.py); N = number of splits along S.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rkv.pallas import decode_attention as da
from tests import numpy_reference
from tests.support.tolerances import DECODE_LSE_TOL as LSE_TOL, DECODE_O_TOL as O_TOL

TINY = da.BlockSizes(block_k=16, num_splits=3)


def _inputs(seed, b, t, h, kh, d, s, dtype=jnp.float32, q_dtype=None):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, t, h, d)), q_dtype or dtype)
  k = jnp.asarray(rng.standard_normal((b, s, kh, d)), dtype)
  v = jnp.asarray(rng.standard_normal((b, s, kh, d)), dtype)
  return q, k, v


def _f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _filled_positions(k_pos, kv_fill, b, s):
  """k_pos (None: arange) with the slots at indices >= kv_fill made empty: what kv_fill means."""
  k_pos = np.broadcast_to(np.arange(s), (b, s)) if k_pos is None else np.asarray(k_pos)
  fill = np.broadcast_to(np.asarray(kv_fill), (b,))
  return np.where(np.arange(s)[None, :] < fill[:, None], k_pos, -1).astype(np.int32)


def _check(q, k, v, *, tol_name, block_sizes=TINY, q_pos=None, k_pos=None, k_scale=None,
           v_scale=None, causal=True, window=None, softcap=None, scale=None, kv_fill=None):
  o, lse = da.decode_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, k_scale=k_scale, v_scale=v_scale,
                               causal=causal, window=window, softcap=softcap, scale=scale,
                               kv_fill=kv_fill, block_sizes=block_sizes, interpret=True)
  assert o.dtype == q.dtype and o.shape == q.shape
  assert lse.dtype == jnp.float32 and lse.shape == q.shape[:3]
  if kv_fill is not None:
    k_pos = _filled_positions(k_pos, kv_fill, k.shape[0], k.shape[1])
  ro, rl = numpy_reference.attention(_f64(q), _f64(k), _f64(v), q_pos, k_pos, causal=causal,
                                     window=window, softcap=softcap, scale=scale, k_scale=k_scale,
                                     v_scale=v_scale)
  o = np.asarray(jnp.asarray(o, jnp.float32))
  lse = np.asarray(lse)
  assert not np.isnan(o).any() and not np.isnan(lse).any()
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(rl))
  np.testing.assert_allclose(o, ro, **O_TOL[tol_name])
  fin = np.isfinite(rl)
  np.testing.assert_allclose(lse[fin], rl[fin], atol=LSE_TOL[tol_name], rtol=LSE_TOL[tol_name])
  return o, lse, ro, rl


# T=1/4/16; GQA 1/4/8; D 64/80/96/128; S not a multiple of block_k nor of the split.
@pytest.mark.parametrize("t,h,kh,d,s,dtype,bs", [
    (1, 8, 8, 64, 100, "float32", TINY),                          # G=1
    (4, 8, 2, 80, 77, "float32", TINY),                           # G=4, D=80, S odd
    (16, 8, 1, 64, 53, "float32", da.BlockSizes(block_k=16, num_splits=2)),  # G=8, T=16: 128 rows
    (1, 16, 2, 128, 300, "bfloat16", da.BlockSizes(block_k=32, num_splits=4)),
    (4, 8, 1, 64, 129, "bfloat16", da.BlockSizes(block_k=16, num_splits=5)),
    (2, 4, 2, 96, 70, "float16", TINY),
    (3, 8, 2, 64, 2000, "bfloat16", None),                        # default heuristic: 3 splits
    # Row blocks: 24 real rows of R=32 in two programs of 16 (the second one half padding) ...
    (3, 8, 1, 64, 70, "float32", da.BlockSizes(block_k=16, num_splits=2, block_rows=16)),
    # ... and T=16 G=8 (128 rows) in four.
    (16, 16, 2, 80, 45, "bfloat16", da.BlockSizes(block_k=16, num_splits=3, block_rows=32)),
])
def test_matches_reference(t, h, kh, d, s, dtype, bs):
  q, k, v = _inputs(0, 2, t, h, kh, d, s, jnp.dtype(dtype))
  _check(q, k, v, tol_name=dtype, block_sizes=bs)


def test_f32_query_on_bf16_cache():
  q, k, v = _inputs(1, 1, 2, 8, 2, 64, 90, jnp.bfloat16, q_dtype=jnp.float32)
  # q is rounded to the cache's bf16 for the dot: compare with the reference on that rounded q.
  o, lse = da.decode_attention(q, k, v, block_sizes=TINY, interpret=True)
  assert o.dtype == jnp.float32
  ro, rl = numpy_reference.attention(_f64(q.astype(jnp.bfloat16)), _f64(k), _f64(v))
  np.testing.assert_allclose(np.asarray(o), ro, **O_TOL["bfloat16"])
  np.testing.assert_allclose(np.asarray(lse), rl, atol=LSE_TOL["bfloat16"], rtol=LSE_TOL["bfloat16"])


@pytest.mark.parametrize("causal", [True, False])
def test_non_causal_and_explicit_q_pos(causal):
  b, t, s = 2, 4, 90
  q, k, v = _inputs(2, b, t, 8, 2, 64, s)
  # Queries in the middle of the cache, not consecutive: causal must hide the keys after each one.
  q_pos = jnp.asarray([[10, 11, 40, 41], [0, 33, 60, 89]], jnp.int32)
  _check(q, k, v, tol_name="float32", q_pos=q_pos, causal=causal)


@pytest.mark.parametrize("causal", [True, False])
def test_sliding_window(causal):
  b, t, s = 2, 4, 120
  q, k, v = _inputs(3, b, t, 8, 2, 64, s)
  q_pos = jnp.asarray([[70, 71, 72, 73], [100, 101, 118, 119]], jnp.int32)
  _check(q, k, v, tol_name="float32", q_pos=q_pos, causal=causal, window=17)


def test_softcap_and_scale():
  q, k, v = _inputs(4, 2, 4, 8, 2, 80, 75)
  q = q * 4.0  # large logits so the cap bites
  _check(q, k, v, tol_name="float32", softcap=5.0, scale=0.3)
  _check(q, k, v, tol_name="float32", softcap=5.0, window=20)


def test_explicit_k_pos_equals_default():
  """The dense (k_pos=None, positions computed from indices) and loaded k_pos paths agree."""
  q, k, v = _inputs(5, 2, 4, 8, 2, 64, 100)
  k_pos = jnp.broadcast_to(jnp.arange(100, dtype=jnp.int32), (2, 100))
  o1, l1 = da.decode_attention(q, k, v, block_sizes=TINY, window=30, interpret=True)
  o2, l2 = da.decode_attention(q, k, v, k_pos=k_pos, block_sizes=TINY, window=30, interpret=True)
  np.testing.assert_allclose(np.asarray(o1), np.asarray(o2), atol=1e-6, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(l1), np.asarray(l2), atol=1e-6, rtol=1e-6)


def test_holes_with_nan_do_not_leak():
  b, s, kh = 2, 100, 2
  q, k, v = _inputs(6, b, 4, 8, kh, 64, s)
  rng = np.random.default_rng(6)
  holes = rng.random((b, s)) < 0.3
  holes[:, 37:52] = True
  # Ring-buffer-like positions: a permutation, so positions are not monotone in the index.
  k_pos = np.stack([rng.permutation(s) for _ in range(b)]).astype(np.int32)
  k_pos[holes] = -1
  k = jnp.where(jnp.asarray(holes)[:, :, None, None], jnp.nan, k)
  v = jnp.where(jnp.asarray(holes)[:, :, None, None], jnp.nan, v)
  q_pos = jnp.asarray([[96, 97, 98, 99], [20, 50, 80, 99]], jnp.int32)
  _check(q, k, v, tol_name="float32", q_pos=q_pos, k_pos=jnp.asarray(k_pos))
  _check(q, k, v, tol_name="float32", q_pos=q_pos, k_pos=jnp.asarray(k_pos), causal=False, window=40)


def test_entirely_empty_split():
  """Split 1 of 3 covers only empty (NaN) slots: its partial is lse=-inf, o=0, and the merge ignores it."""
  b, s, t = 1, 120, 2
  q, k, v = _inputs(7, b, t, 8, 2, 64, s)
  k_pos = np.arange(s, dtype=np.int32)[None].copy()
  # Visible range is [0, 120): chunk = round_up(ceil(120/3), 16) = 48, so split 1 is [48, 96).
  k_pos[:, 48:96] = -1
  k = k.at[:, 48:96].set(jnp.nan)
  v = v.at[:, 48:96].set(jnp.nan)
  k_pos = jnp.asarray(k_pos)
  o_p, lse_p = da.decode_attention_partials(q, k, v, k_pos=k_pos, block_sizes=TINY, interpret=True)
  assert o_p.shape == (3, b, t, 8, 64) and lse_p.shape == (3, b, t, 8)
  assert np.all(np.isneginf(np.asarray(lse_p[1])))
  assert np.all(np.asarray(o_p[1]) == 0)
  assert np.all(np.isfinite(np.asarray(lse_p[0]))) and np.all(np.isfinite(np.asarray(lse_p[2])))
  _check(q, k, v, tol_name="float32", k_pos=k_pos)


def test_fully_masked_rows():
  b, t, s = 3, 4, 64
  q, k, v = _inputs(8, b, t, 8, 2, 64, s)
  k_pos = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy()
  k_pos[2] = -1  # batch row 2: an empty cache, every row sees nothing
  k = k.at[2].set(jnp.nan)
  v = v.at[2].set(jnp.nan)
  # Batch 0: a query before every key (causal) sees nothing; batch 1: fine.
  q_pos = jnp.asarray([[-5, 3, 30, 63], [60, 61, 62, 63], [60, 61, 62, 63]], jnp.int32)
  o, lse, _, _ = _check(q, k, v, tol_name="float32", q_pos=q_pos, k_pos=jnp.asarray(k_pos))
  assert np.all(o[0, 0] == 0) and np.all(np.isneginf(lse[0, 0]))
  assert np.all(o[2] == 0) and np.all(np.isneginf(lse[2]))
  assert np.all(np.isfinite(lse[1]))
  # Window: keys exist but all are too old for the row at q_pos=200.
  q_pos2 = jnp.asarray([[200, 63, 63, 63]] * b, jnp.int32)
  o, lse, _, _ = _check(q, k, v, tol_name="float32", q_pos=q_pos2, k_pos=jnp.asarray(k_pos), window=8)
  assert np.all(o[:, 0] == 0) and np.all(np.isneginf(lse[:, 0]))


def test_empty_cache():
  q = jnp.ones((2, 3, 8, 64), jnp.bfloat16)
  k = jnp.zeros((2, 0, 2, 64), jnp.bfloat16)
  o, lse = da.decode_attention(q, k, k, interpret=True)
  assert o.shape == q.shape and np.all(np.asarray(o, np.float32) == 0)
  assert np.all(np.isneginf(np.asarray(lse)))


def test_lse_is_natural_log():
  """With q = 0 every visible key has logit 0, so lse = ln(#visible keys) exactly (not log2)."""
  b, t, s = 1, 2, 80
  _, k, v = _inputs(9, b, t, 8, 2, 64, s)
  q = jnp.zeros((b, t, 8, 64), jnp.float32)
  q_pos = jnp.asarray([[39, 79]], jnp.int32)
  _, lse = da.decode_attention(q, k, v, q_pos=q_pos, block_sizes=TINY, interpret=True)
  np.testing.assert_allclose(np.asarray(lse[0, 0]), np.log(40.0), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(lse[0, 1]), np.log(80.0), rtol=1e-6)


@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])  # bfloat16: the cache's default
@pytest.mark.parametrize("q_dtype,tol_name", [("float32", "float32"), ("bfloat16", "bfloat16")])
def test_int8_kv(q_dtype, tol_name, scale_dtype):
  b, s, kh, d = 2, 90, 2, 64
  q, kf, vf = _inputs(10, b, 4, 8, kh, d, s, jnp.float32, q_dtype=jnp.dtype(q_dtype))
  k8, ks = numpy_reference.quantize_int8(kf, jnp.dtype(scale_dtype))
  v8, vs = numpy_reference.quantize_int8(vf, jnp.dtype(scale_dtype))
  k_pos = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy()
  k_pos[:, 10:20] = -1
  ks[:, 10:20] = np.nan  # empty slots: garbage scales must not leak either
  vs[:, 10:20] = np.nan
  _check(q, jnp.asarray(k8), jnp.asarray(v8), k_scale=jnp.asarray(ks), v_scale=jnp.asarray(vs),
         k_pos=jnp.asarray(k_pos), tol_name=tol_name, window=60, softcap=20.0)


@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_int8_nan_scale_on_a_visible_key_propagates(which):
  b, s, kh, d = 1, 40, 2, 64
  q, kf, vf = _inputs(12, b, 1, 4, kh, d, s, jnp.float32)
  k8, ks = numpy_reference.quantize_int8(kf, jnp.bfloat16)
  v8, vs = numpy_reference.quantize_int8(vf, jnp.bfloat16)
  scales = dict(k_scale=ks, v_scale=vs)
  scales[which][0, 7, 1] = np.nan  # a visible key of kv head 1
  o, lse = da.decode_attention(q, jnp.asarray(k8), jnp.asarray(v8), block_sizes=TINY,
                               interpret=True, **{n: jnp.asarray(x) for n, x in scales.items()})
  o = np.asarray(o)
  g = 4 // kh
  assert np.isnan(o[0, 0, g:]).all(), "the heads reading the NaN scale must be NaN"
  assert np.isfinite(o[0, 0, :g]).all(), "the other kv head's query heads must not be"


def test_deterministic():
  q, k, v = _inputs(11, 2, 4, 8, 2, 80, 99, jnp.bfloat16)
  a = da.decode_attention(q, k, v, block_sizes=TINY, window=50, interpret=True)
  c = da.decode_attention(q, k, v, block_sizes=TINY, window=50, interpret=True)
  for x, y in zip(a, c):
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def _merge_np(o_p, lse_p):
  o_p = np.asarray(o_p, np.float64)
  lse_p = np.asarray(lse_p, np.float64)
  mx = lse_p.max(0)
  mx = np.where(np.isfinite(mx), mx, 0.0)
  w = np.exp(lse_p - mx)
  den = w.sum(0)
  o = (w[..., None] * o_p).sum(0) / np.where(den > 0, den, 1.0)[..., None]
  with np.errstate(divide="ignore"):
    lse = np.where(den > 0, mx + np.log(den), -np.inf)
  return o, lse


def test_partials_merge_to_unsplit():
  q, k, v = _inputs(12, 2, 4, 8, 2, 64, 100)
  q_pos = jnp.asarray([[96, 97, 98, 99], [-3, 40, 41, 99]], jnp.int32)
  o_p, lse_p = da.decode_attention_partials(q, k, v, q_pos=q_pos, block_sizes=TINY, window=70,
                                            interpret=True)
  assert o_p.shape == (3, 2, 4, 8, 64) and o_p.dtype == jnp.float32
  o1, l1 = da.decode_attention(q, k, v, q_pos=q_pos, window=70, interpret=True,
                               block_sizes=da.BlockSizes(block_k=16, num_splits=1))
  om, lm = _merge_np(o_p, lse_p)
  np.testing.assert_array_equal(np.isneginf(lm), np.isneginf(np.asarray(l1)))
  np.testing.assert_allclose(om, np.asarray(o1), atol=1e-5, rtol=1e-5)
  fin = np.isfinite(lm)
  np.testing.assert_allclose(lm[fin], np.asarray(l1)[fin], atol=1e-5, rtol=1e-5)


def test_reference_function_matches_numpy():
  q, k, v = _inputs(13, 2, 4, 8, 2, 80, 60)
  k_pos = np.broadcast_to(np.arange(60, dtype=np.int32), (2, 60)).copy()
  k_pos[1, 5:25] = -1
  k = k.at[1, 5:25].set(jnp.nan)
  o, lse = da.decode_attention_reference(q, k, v, k_pos=jnp.asarray(k_pos), window=33, softcap=7.0)
  ro, rl = numpy_reference.attention(_f64(q), _f64(k), _f64(v), None, k_pos, window=33, softcap=7.0)
  np.testing.assert_allclose(np.asarray(o), ro, **O_TOL["float32"])
  np.testing.assert_allclose(np.asarray(lse), rl, atol=LSE_TOL["float32"], rtol=LSE_TOL["float32"])


def test_default_block_sizes():
  def resolve(b, kh, s, rows=16, d=128, itemsize=2):
    return da.BlockSizes().resolve(batch=b, kv_heads=kh, kv_len=s, rows=rows, head_dim=d,
                                   kv_itemsize=itemsize)
  big = resolve(1, 8, 512 * 1024)
  assert big.block_k == 64 and big.num_splits * 8 >= 2 * 132
  assert resolve(8, 8, 32 * 1024).num_splits * 64 >= 2 * 132
  assert resolve(1, 8, 500).num_splits == 1  # short caches are not split below 256 keys
  assert resolve(1, 8, 1000).num_splits == 3
  assert resolve(1, 8, 2048).num_splits == 8  # 256 keys a split at 2K (B=1, K=8)
  assert resolve(1, 8, 32 * 1024, d=256).block_k == 32  # keeps a K+V stage at 32 KiB
  assert resolve(1, 8, 32 * 1024, itemsize=1).block_k == 128  # int8
  assert resolve(1, 2, 32 * 1024, rows=256).block_k == 64  # [R, block_k] logits within registers
  assert resolve(1, 8, 20).block_k == 32  # never much wider than the cache
  assert big.block_rows == 16 and big.num_warps == 4
  t16 = resolve(1, 4, 4096, rows=256)  # T=16, G=16: accumulator would not fit one program
  assert t16.block_rows == 128 and t16.num_warps == 8
  assert resolve(1, 4, 4096, rows=128, d=256).block_rows == 64
  assert da.BlockSizes(block_k=32).resolve(batch=1, kv_heads=8, kv_len=10**6, rows=16, head_dim=128,
                                           kv_itemsize=2).block_k == 32


@pytest.mark.parametrize("call,match", [
    (lambda q, k, v: da.decode_attention(jnp.zeros((1, 17, 8, 64)), k, v), "q"),
    (lambda q, k, v: da.decode_attention(q, k, v[:, :50]), "v shape"),
    (lambda q, k, v: da.decode_attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2)),
     "kv heads"),
    (lambda q, k, v: da.decode_attention(q, k, v, q_pos=jnp.zeros((1, 3), jnp.int32)), "q_pos"),
    (lambda q, k, v: da.decode_attention(q, k.astype(jnp.int8), v.astype(jnp.int8)), "k_scale"),
    (lambda q, k, v: da.decode_attention(q, k, v, block_sizes=da.BlockSizes(block_k=24)), "block_k"),
    (lambda q, k, v: da.decode_attention(q, k, v, block_sizes=da.BlockSizes(num_splits=0)),
     "num_splits"),
    (lambda q, k, v: da.decode_attention(q, k, v, block_sizes=da.BlockSizes(block_rows=8)),
     "block_rows"),
    (lambda q, k, v: da.decode_attention(q, k, v, block_sizes=da.BlockSizes(split_merge="sum")),
     "split_merge"),
    (lambda q, k, v: da.decode_attention(q, k, v, block_sizes=da.BlockSizes(query_pack="host")),
     "query_pack"),
    (lambda q, k, v: da.decode_attention_partials(jnp.zeros((1, 20, 8, 64)), k, v), "q"),
])
def test_bad_input_raises(call, match):
  q, k, v = _inputs(14, 1, 2, 8, 2, 64, 64)
  with pytest.raises(ValueError, match=match):
    call(q, k, v)


@pytest.mark.parametrize("explicit_k_pos", [False, True], ids=["arange", "k_pos"])
@pytest.mark.parametrize("window", [None, 30], ids=["no_window", "window"])
@pytest.mark.parametrize("query_pack", ["wrapper", "kernel"])
def test_kv_fill_matches_reference(explicit_k_pos, window, query_pack):
  # kv_fill: keys from index kv_fill[b] on are empty slots (NaN there must not be read). Without a
  # window the keys are bounded from the query positions and the fill (no k_pos reduction); with
  # one, the reduction over k_pos stops at the fill.
  b, s = 3, 100
  q, k, v = _inputs(19, b, 2, 8, 2, 64, s)
  fill = np.asarray([37, 100, 0], np.int32)  # a half-filled row, a full one, an empty one
  for row, f in enumerate(fill):
    k = k.at[row, f:].set(jnp.nan)
    v = v.at[row, f:].set(jnp.nan)
  q_pos = jnp.asarray([[40, 41], [98, 99], [3, 5]], jnp.int32)
  k_pos = None
  if explicit_k_pos:  # left padding in row 1, a gap in row 0
    kp = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy()
    kp[1, :6] = -1
    kp[0, 10:20] = -1
    k_pos = jnp.asarray(kp)
  blocks = dataclasses.replace(TINY, query_pack=query_pack)
  o, lse, _, _ = _check(q, k, v, tol_name="float32", block_sizes=blocks, q_pos=q_pos, k_pos=k_pos,
                        window=window, kv_fill=jnp.asarray(fill))
  assert np.all(o[2] == 0) and np.all(np.isneginf(lse[2]))  # the empty row sees nothing
  # A scalar fill (a cache's length) is every row's; non-causal rows see every filled key.
  _check(q[:2], k[:1].repeat(2, 0), v[:1].repeat(2, 0), tol_name="float32", block_sizes=blocks,
         q_pos=q_pos[:2], k_pos=None if k_pos is None else k_pos[:1].repeat(2, 0), window=window,
         kv_fill=37, causal=False)


def test_kv_fill_with_a_row_block_of_padding_only():
  # T*G = 33 rows pad to R = 64 in row blocks of 16: the last block holds no query (its rows are
  # dropped by both merges), with the fill bounding every block's keys.
  q, k, v = _inputs(20, 2, 11, 3, 1, 32, 90)
  q_pos = jnp.asarray(np.stack([np.arange(40, 51), np.arange(70, 81)]), jnp.int32)
  for query_pack in ("wrapper", "kernel"):
    blocks = da.BlockSizes(block_k=16, num_splits=3, block_rows=16, query_pack=query_pack,
                           split_merge="kernel")
    _check(q, k, v, tol_name="float32", block_sizes=blocks, q_pos=q_pos,
           k_pos=jnp.broadcast_to(jnp.arange(90, dtype=jnp.int32), (2, 90)),
           kv_fill=jnp.asarray([60, 85], jnp.int32))


@pytest.mark.parametrize("kv_fill,match", [
    (jnp.zeros((2, 1), jnp.int32), "kv_fill must be a scalar or have shape"),
    (jnp.zeros((3,), jnp.int32), "kv_fill must be a scalar or have shape"),
    (jnp.zeros((1,), jnp.float32), "kv_fill must be an integer"),
    (101, "kv_fill"), (np.asarray([-1]), "kv_fill")])
def test_bad_kv_fill_raises(kv_fill, match):
  q, k, v = _inputs(21, 1, 1, 8, 2, 64, 100)
  with pytest.raises(ValueError, match=match):
    da.decode_attention(q, k, v, kv_fill=kv_fill, interpret=True)


CHAIN = da.BlockSizes(block_k=16, num_splits=3, split_merge="chain")
MERGE_KERNEL = da.BlockSizes(block_k=16, num_splits=3, split_merge="kernel")
OTHER_MERGES = pytest.mark.parametrize("merge_blocks", [CHAIN, MERGE_KERNEL],
                                       ids=["chain", "kernel"])


@OTHER_MERGES
def test_online_split_merges_match_reference_and_tree(merge_blocks):
  # The online merges of the splits ("chain" in the wrapper, "kernel" in a Pallas kernel of its
  # own), beside the default tree merge: the float64 reference on the cases that exercise the
  # merge (uneven and empty splits, rows that see nothing, NaN in holes), and the tree merge's
  # result to float32 rounding.
  q, k, v = _inputs(15, 2, 3, 8, 2, 64, 100)
  _check(q, k, v, tol_name="float32", block_sizes=merge_blocks)
  _check(q, k, v, tol_name="float32", block_sizes=merge_blocks, causal=False, window=30)
  b, s = 1, 120
  q, k, v = _inputs(7, b, 2, 8, 2, 64, s)
  k_pos = np.arange(s, dtype=np.int32)[None].copy()
  k_pos[:, 48:96] = -1  # split 1 of 3 sees only empty slots
  k = k.at[:, 48:96].set(jnp.nan)
  v = v.at[:, 48:96].set(jnp.nan)
  q_pos = jnp.asarray([[-3, 119]], jnp.int32)  # the first row sees nothing
  o, lse, _, _ = _check(q, k, v, tol_name="float32", block_sizes=merge_blocks, q_pos=q_pos,
                        k_pos=jnp.asarray(k_pos))
  assert np.all(o[0, 0] == 0) and np.all(np.isneginf(lse[0, 0]))
  tree = da.decode_attention(q, k, v, q_pos=q_pos, k_pos=jnp.asarray(k_pos), block_sizes=TINY,
                             interpret=True)
  for a, b_ in zip((o, lse), tree):
    np.testing.assert_allclose(a, np.asarray(b_), rtol=1e-6, atol=1e-6)


@OTHER_MERGES
def test_online_split_merges_propagate_nan(merge_blocks):
  q, k, v = _inputs(16, 1, 1, 8, 2, 64, 96)
  k = k.at[0, 70, 1].set(jnp.nan)  # a visible key of kv head 1, in the last split
  o, lse = da.decode_attention(q, k, v, block_sizes=merge_blocks, interpret=True)
  o, lse = np.asarray(o), np.asarray(lse)
  assert np.all(np.isnan(o[0, 0, 4:])) and np.all(np.isnan(lse[0, 0, 4:]))  # heads of kv head 1
  assert np.all(np.isfinite(o[0, 0, :4])) and np.all(np.isfinite(lse[0, 0, :4]))


@pytest.mark.parametrize("num_splits", [1, 5, 40, 130],
                         ids=["one_split", "few", "one_chunk", "two_chunks"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_merge_kernel_equals_the_tree_merge(num_splits, dtype):
  # split_merge="kernel" writes o in q's dtype from its float32 merge; the tree merges in float32
  # and casts after. With 40 or 130 splits of 16 keys over 100 most splits are empty (lse = -inf);
  # 130 takes the kernel's loop two chunks of 128. D = 96 pads the columns to 128: four column
  # blocks a row.
  q, k, v = _inputs(18, 2, 3, 8, 2, 96, 100)
  q, k, v = (x.astype(dtype) for x in (q, k, v))
  blocks = da.BlockSizes(block_k=16, num_splits=num_splits, split_merge="kernel")
  o, lse = da.decode_attention(q, k, v, block_sizes=blocks, interpret=True)
  o_t, lse_t = da.decode_attention(q, k, v, block_sizes=dataclasses.replace(blocks,
                                                                          split_merge="tree"),
                                   interpret=True)
  assert o.dtype == q.dtype and o.shape == q.shape and lse.shape == q.shape[:3]
  tol = 1e-6 if dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_t, np.float32), rtol=tol,
                             atol=tol)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_t), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("t,h,kh,d", [(1, 8, 2, 64), (3, 8, 2, 96), (16, 64, 4, 32)],
                         ids=["decode", "t3_d96", "t16_g16_row_blocks"])
def test_queries_packed_in_the_kernel_equal_the_wrapper(t, h, kh, d):
  # BlockSizes.query_pack="kernel": each program gathers its packed rows (and their positions)
  # from q and q_pos itself; the same partials as the wrapper's packing, and the reference's.
  q, k, v = _inputs(17, 2, t, h, kh, d, 90)
  rng = np.random.default_rng(17)
  q_pos = jnp.asarray(np.sort(rng.integers(20, 90, (2, t)), axis=1), jnp.int32)
  kernel = da.BlockSizes(block_k=16, num_splits=3, query_pack="kernel",
                         block_rows=16 if t == 16 else None)
  wrapper = dataclasses.replace(kernel, query_pack="wrapper")
  o, lse, _, _ = _check(q, k, v, tol_name="float32", block_sizes=kernel, q_pos=q_pos, window=50)
  got = da.decode_attention_partials(q, k, v, q_pos=q_pos, window=50, block_sizes=kernel,
                                     interpret=True)
  want = da.decode_attention_partials(q, k, v, q_pos=q_pos, window=50, block_sizes=wrapper,
                                      interpret=True)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("field,env,choices", [
    ("split_merge", "RKV_DECODE_SPLIT_MERGE", da.SPLIT_MERGES),
    ("query_pack", "RKV_DECODE_QUERY_PACK", da.QUERY_PACKS)])
def test_wrapper_options_from_the_environment(monkeypatch, field, env, choices):
  resolve = lambda: getattr(da.BlockSizes().resolve(batch=1, kv_heads=8, kv_len=4096, rows=16,
                                                    head_dim=128, kv_itemsize=2), field)
  monkeypatch.delenv(env, raising=False)
  assert resolve() == choices[0]  # the default
  for choice in choices[1:]:
    monkeypatch.setenv(env, choice)
    assert resolve() == choice
  monkeypatch.setenv(env, "other")
  with pytest.raises(ValueError, match=env):
    resolve()


# (T, H, K, D, S, kv dtype, options): the dense cache's decode kernel as the models call it
# (kv_rows_test.py lowers the pooled form).
TRITON_CONFIGS = [
    (1, 32, 8, 128, 4096, jnp.bfloat16, dict()),
    (1, 32, 8, 128, 4096, jnp.bfloat16, dict(k_pos=True, split_merge="chain")),
    (4, 8, 2, 96, 1000, jnp.float32, dict(k_pos=True, window=64, softcap=30.0)),
    (2, 16, 4, 128, 2048, jnp.int8, dict(k_pos=True)),
    (1, 32, 8, 128, 4096, jnp.int8, dict(scale_dtype=jnp.bfloat16)),  # the cache's default scales
    (3, 8, 2, 96, 1000, jnp.int8, dict(k_pos=True, query_pack="kernel", scale_dtype=jnp.bfloat16)),
    (16, 64, 4, 128, 4096, jnp.bfloat16, dict()),  # T=16, G=16: the rows split into row blocks
    (1, 32, 8, 128, 4096, jnp.bfloat16, dict(k_pos=True, query_pack="kernel")),
    (3, 8, 2, 96, 1000, jnp.int8, dict(k_pos=True, window=64, query_pack="kernel")),
    (16, 64, 4, 128, 4096, jnp.bfloat16, dict(query_pack="kernel", split_merge="chain")),
    # split_merge="kernel": the merge is a second Pallas kernel (N = 33 splits in one chunk).
    (1, 32, 8, 128, 131072, jnp.bfloat16, dict(k_pos=True, query_pack="kernel",
                                               split_merge="kernel")),
    (3, 8, 2, 96, 1000, jnp.int8, dict(k_pos=True, window=64, split_merge="kernel")),
    (16, 64, 4, 128, 4096, jnp.bfloat16, dict(split_merge="kernel")),
    # kv_fill: the bounds from the query positions in the kernel (the resident cache's call: the
    # fill is its length, the default merge and packing), and through the k_pos reduction (window).
    (1, 32, 8, 128, 131072, jnp.bfloat16, dict(k_pos=True, kv_fill=True, query_pack="kernel",
                                               split_merge="kernel")),
    (1, 32, 8, 128, 4096, jnp.bfloat16, dict(k_pos=True, kv_fill=True)),
    (3, 8, 2, 96, 1000, jnp.int8, dict(k_pos=True, kv_fill=True, window=64)),
]


@pytest.mark.parametrize("config", TRITON_CONFIGS,
                         ids=lambda c: f"t{c[0]}_d{c[3]}_{jnp.dtype(c[5]).name}"
                         + ("_bf16_scales" if "scale_dtype" in c[6] else ""))
def test_lowers_to_verified_triton_ir(config, monkeypatch):
  # What interpret mode cannot catch (non-power-of-two tiles, unsupported primitives, bad dot
  # operands), checked on this host for an H200 (private jax hooks; skips if they moved).
  from tests.support.triton_ir import record_verified_lowerings
  verified = record_verified_lowerings(monkeypatch)
  t, h, kh, d, s, kv_dt, opts = config
  opts = dict(opts)
  b = 1
  q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16 if kv_dt != jnp.float32 else jnp.float32)
  k = jax.ShapeDtypeStruct((b, s, kh, d), kv_dt)
  scales = jax.ShapeDtypeStruct((b, s, kh), opts.pop("scale_dtype", jnp.float32)) \
      if kv_dt == jnp.int8 else None
  k_pos = jax.ShapeDtypeStruct((b, s), jnp.int32) if opts.pop("k_pos", False) else None
  kv_fill = jax.ShapeDtypeStruct((1,), jnp.int32) if opts.pop("kv_fill", False) else None
  r_pad = max(16, 1 << (t * (h // kh) - 1).bit_length())
  blocks = da.BlockSizes(split_merge=opts.pop("split_merge", "tree"),
                         query_pack=opts.pop("query_pack", "wrapper")).resolve(
      batch=b, kv_heads=kh, kv_len=s, rows=r_pad, head_dim=max(16, 1 << (d - 1).bit_length()),
      kv_itemsize=jnp.dtype(kv_dt).itemsize)
  traced = da._decode_attention_jit.trace(q, k, k, jax.ShapeDtypeStruct((b, t), jnp.int32), k_pos,
                                          scales, scales, causal=True, kv_fill=kv_fill,
                                          window=opts.pop("window", None),
                                          softcap=opts.pop("softcap", None), scale=d**-0.5,
                                          block_sizes=blocks, interpret=False)
  traced.lower(lowering_platforms=("cuda",))
  assert verified == [True] * (2 if blocks.split_merge == "kernel" else 1)
