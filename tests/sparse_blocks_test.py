"""Block-selected attention against the float64 NumPy reference over the same cells, the
selectors against NumPy's scores, and the selection rule (rkv/sparse/blocks.py)."""

import numpy as np
import pytest
import jax.numpy as jnp

from rkv import sparse
from rkv.attention import attention, merge
from tests import numpy_reference as ref
from tests.support.tolerances import TOLERANCES

BS = 8


def _pool(rng, n_slots, kh, d, *, empty_frac=0.1, dtype=np.float32):
  r = n_slots * BS
  k = rng.standard_normal((r, kh, d)).astype(dtype)
  v = rng.standard_normal((r, kh, d)).astype(dtype)
  pos = rng.permutation(r).astype(np.int32)  # rows hold any positions: only positions mask
  empty = rng.random(r) < empty_frac
  pos[empty] = -1
  k[empty] = np.nan  # empty slots are never read
  v[empty] = np.nan
  return k, v, pos


def _numpy_block_attention(q, k, v, pos, blocks, q_pos, *, k_scale=None, v_scale=None, **kw):
  """Per (sequence, KV head): gather that head's blocks, float64 attention of its query heads."""
  b, t, h, d = q.shape
  kh = k.shape[1]
  g = h // kh
  o = np.zeros((b, t, h, d))
  lse = np.zeros((b, t, h))
  for bi in range(b):
    for hi in range(kh):
      rows = np.concatenate([np.arange(s * BS, (s + 1) * BS) for s in blocks[bi, hi] if s >= 0]
                            or [np.zeros(0, int)])
      sl = slice(hi * g, (hi + 1) * g)
      sc = {} if k_scale is None else dict(k_scale=k_scale[rows, hi][None, :, None],
                                           v_scale=v_scale[rows, hi][None, :, None])
      ob, lb = ref.attention(q[bi:bi + 1, :, sl], k[rows, hi][None, :, None],
                             v[rows, hi][None, :, None], q_pos[bi:bi + 1], pos[rows][None],
                             **sc, **kw)
      o[bi, :, sl], lse[bi, :, sl] = ob[0], lb[0]
  return o, lse


def _check(o, lse, o_ref, lse_ref, dtype="float32"):
  tol = TOLERANCES[dtype]
  np.testing.assert_allclose(np.asarray(o, np.float64), o_ref,
                             rtol=tol["o"][1], atol=tol["o"][0])
  np.testing.assert_allclose(np.asarray(lse, np.float64), lse_ref, rtol=tol["lse"][1],
                             atol=tol["lse"][0])


@pytest.mark.parametrize("impl", ["reference", "xla"])
@pytest.mark.parametrize("kh,g,d,window,softcap", [(2, 2, 24, None, None), (1, 4, 16, 40, None),
                                                   (3, 1, 8, None, 5.0)])
def test_block_attention_equals_float64_reference(impl, kh, g, d, window, softcap):
  rng = np.random.default_rng([kh, g, d])
  b, t, n_slots, n = 2, 3, 7, 4
  k, v, pos = _pool(rng, n_slots, kh, d)
  q = rng.standard_normal((b, t, kh * g, d)).astype(np.float32)
  q_pos = rng.integers(20, 56, (b, t)).astype(np.int32)
  blocks = np.stack([np.stack([rng.permutation(n_slots)[:n] for _ in range(kh)])
                     for _ in range(b)]).astype(np.int32)
  blocks[0, 0, -1] = -1  # fewer blocks for one head: padding
  o, lse = sparse.block_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                  jnp.asarray(blocks), block_cells=BS, pos=jnp.asarray(pos),
                                  q_pos=jnp.asarray(q_pos), window=window, softcap=softcap,
                                  impl=impl)
  o_ref, lse_ref = _numpy_block_attention(q, k, v, pos, blocks, q_pos, window=window,
                                          softcap=softcap)
  _check(o, lse, o_ref, lse_ref)


def test_block_attention_int8_pool_and_pallas_interpret():
  rng = np.random.default_rng(3)
  kh, g, d, b, n_slots = 2, 2, 16, 1, 5
  kf, vf, pos = _pool(rng, n_slots, kh, d, empty_frac=0.0)
  k, k_scale = ref.quantize_int8(kf[None])
  v, v_scale = ref.quantize_int8(vf[None])
  k, v, k_scale, v_scale = k[0], v[0], k_scale[0], v_scale[0]
  q = rng.standard_normal((b, 1, kh * g, d)).astype(np.float32)
  q_pos = np.full((b, 1), 100, np.int32)
  blocks = np.array([[[0, 3, 4], [1, 2, -1]]], np.int32)
  o_ref, lse_ref = _numpy_block_attention(q, k, v, pos, blocks, q_pos, k_scale=k_scale,
                                          v_scale=v_scale)
  for impl in ("xla", "pallas"):  # pallas: the decode kernel in interpret mode, rows in place
    o, lse = sparse.block_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                    jnp.asarray(blocks), block_cells=BS, pos=jnp.asarray(pos),
                                    q_pos=jnp.asarray(q_pos), k_scale=jnp.asarray(k_scale),
                                    v_scale=jnp.asarray(v_scale), impl=impl)
    _check(o, lse, o_ref, lse_ref)


def test_every_block_is_dense_attention_and_partials_merge():
  """All blocks = rkv.attention over the cells; two disjoint block sets merge by LSE to it."""
  rng = np.random.default_rng(4)
  b, s, kh, g, d = 2, 48, 2, 2, 16
  k = rng.standard_normal((b, s, kh, d)).astype(np.float32)
  v = rng.standard_normal((b, s, kh, d)).astype(np.float32)
  q = rng.standard_normal((b, 1, kh * g, d)).astype(np.float32)
  q_pos = np.full((b, 1), s - 1, np.int32)
  nb = s // BS
  pool = lambda x: jnp.asarray(x.reshape(b * s, kh, d))
  pos = jnp.asarray(np.tile(np.arange(s, dtype=np.int32), b))
  ids = lambda sel: jnp.asarray(np.broadcast_to(np.arange(b)[:, None, None] * nb + np.asarray(sel),
                                                (b, kh, len(sel))).astype(np.int32))
  call = lambda sel: sparse.block_attention(jnp.asarray(q), pool(k), pool(v), ids(sel),
                                            block_cells=BS, pos=pos, q_pos=jnp.asarray(q_pos),
                                            impl="xla")
  o_all, lse_all = call(range(nb))
  o_ref, lse_ref = ref.attention(q, k, v, q_pos)
  _check(o_all, lse_all, o_ref, lse_ref)
  o_m, lse_m = merge(*call([0, 2, 5]), *call([1, 3, 4]))
  _check(o_m, lse_m, o_ref, lse_ref)
  o_d, _ = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), q_pos=jnp.asarray(q_pos),
                     impl="xla")
  np.testing.assert_allclose(np.asarray(o_all), np.asarray(o_d), rtol=2e-6, atol=2e-6)


def _blocky(rng, b, nb, kh, d):
  k = rng.standard_normal((b, nb * BS, kh, d)).astype(np.float32)
  return k, np.broadcast_to(np.arange(nb * BS, dtype=np.int32), (b, nb * BS)).copy()


def test_oracle_scores_are_numpy_block_masses():
  rng = np.random.default_rng(5)
  b, nb, kh, g, d, t = 2, 6, 2, 2, 8, 2
  k, kpos = _blocky(rng, b, nb, kh, d)
  kpos[1, -5:] = -1
  q = rng.standard_normal((b, t, kh * g, d)).astype(np.float32)
  q_pos = np.full((b, t), nb * BS - 1, np.int32)
  q_pos[:, 0] -= 3
  view = sparse.SelectionView(sparse.summarize(jnp.asarray(k), jnp.asarray(kpos), block_cells=BS),
                              BS, keys=jnp.asarray(k), key_pos=jnp.asarray(kpos))
  got = np.asarray(sparse.OracleSelector().scores(jnp.asarray(q), view, q_pos=jnp.asarray(q_pos),
                                                  scale=d ** -0.5))
  logits = np.einsum("btkgd,bskd->bkgts", q.reshape(b, t, kh, g, d).astype(np.float64), k) * d ** -0.5
  seen = (kpos[:, None, None, None, :] >= 0) & (kpos[:, None, None, None, :] <= q_pos[:, None, None, :, None])
  logits = np.where(seen, logits, -np.inf).reshape(b, kh, g, t, nb, BS)
  with np.errstate(divide="ignore"):
    mass = np.log(np.exp(logits).sum(-1)).max(axis=(2, 3))
  np.testing.assert_allclose(got, mass, rtol=1e-5, atol=1e-5)


def test_quest_score_bounds_every_key_and_finds_planted_blocks():
  rng = np.random.default_rng(6)
  b, nb, kh, g, d = 1, 10, 2, 2, 16
  k, kpos = _blocky(rng, b, nb, kh, d)
  q = rng.standard_normal((b, 1, kh * g, d)).astype(np.float32)
  planted = {0: [3, 7], 1: [2, 5]}
  for h, blks in planted.items():  # a few keys per block aligned with the group's mean query
    for blk in blks:
      k[0, blk * BS + 2, h] = 4.0 * q[0, 0, h * g:(h + 1) * g].mean(0)
  summ = sparse.summarize(jnp.asarray(k), jnp.asarray(kpos), block_cells=BS)
  view = sparse.SelectionView(summ, BS)
  scores = np.asarray(sparse.QuestSelector().scores(jnp.asarray(q), view, q_pos=None, scale=1.0))
  exact = np.einsum("bkgd,bskd->bkgs", q[:, 0].reshape(b, kh, g, d).astype(np.float64), k)
  exact = exact.reshape(b, kh, g, nb, BS).max(axis=(2, 4))
  assert np.all(scores >= exact - 1e-4)  # an upper bound on every q.k of the block
  ids = np.asarray(sparse.select_blocks(jnp.asarray(scores), n_select=4, filled_blocks=nb,
                                        window_blocks=1, sink_blocks=1))
  for h, blks in planted.items():
    assert set(ids[0, h]) == {0, nb - 1, *blks}, ids[0, h]


def test_fused_quest_selection_equals_scores_then_select_blocks():
  """The block cache's one-program selection picks exactly what the two public steps pick, and
  the window, sinks and written blocks follow the fill without a recompile per fill."""
  from rkv.sparse import blocks as blocks_mod
  rng = np.random.default_rng(8)
  b, nb, kh, g, d = 2, 12, 2, 3, 16
  k, kpos = _blocky(rng, b, nb, kh, d)
  summ = sparse.summarize(jnp.asarray(k), jnp.asarray(kpos), block_cells=BS)
  view = sparse.SelectionView(summ, BS)
  for filled in (1, 3, 7, nb):
    for window, sinks in ((1, 0), (2, 1), (3, 2)):
      q = jnp.asarray(rng.standard_normal((b, 1, kh * g, d)).astype(np.float32))
      scores = sparse.QuestSelector().scores(q, view, q_pos=None, scale=0.25)
      want = sparse.select_blocks(scores, n_select=5, filled_blocks=filled, window_blocks=window,
                                  sink_blocks=sinks)
      got = blocks_mod.quest_select_blocks(q, summ, scale=0.25, n_select=5, filled_blocks=filled,
                                           window_blocks=window, sink_blocks=sinks)
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
      must = sparse.must_read(nb, filled, window_blocks=window, sink_blocks=sinks)
      assert all(set(np.flatnonzero(must)) <= set(np.asarray(got)[i, h].tolist())
                 for i in range(b) for h in range(kh))


def test_select_blocks_rule_and_errors():
  scores = jnp.asarray(np.array([[[5.0, 1.0, 9.0, 2.0, 8.0, -1.0, 0.0, 7.0]]], np.float32))
  ids = sparse.select_blocks(scores, n_select=4, filled_blocks=6, window_blocks=2, sink_blocks=0)
  np.testing.assert_array_equal(np.asarray(ids), [[[0, 2, 4, 5]]])  # 4,5 window; then 9, 5
  ids = sparse.select_blocks(scores, n_select=5, filled_blocks=3, window_blocks=1)
  np.testing.assert_array_equal(np.asarray(ids), [[[-1, -1, 0, 1, 2]]])  # never past the written
  with pytest.raises(ValueError, match="must-read"):
    sparse.select_blocks(scores, n_select=2, filled_blocks=6, window_blocks=2, sink_blocks=1)
  with pytest.raises(ValueError, match="filled_blocks"):
    sparse.select_blocks(scores, n_select=2, filled_blocks=9, window_blocks=1)
  q = jnp.zeros((1, 1, 4, 8))
  with pytest.raises(ValueError, match="multiple of block_cells"):
    sparse.block_attention(q, jnp.zeros((10, 2, 8)), jnp.zeros((10, 2, 8)),
                           jnp.zeros((1, 2, 1), jnp.int32), block_cells=BS,
                           pos=jnp.zeros((10,), jnp.int32), q_pos=jnp.zeros((1, 1), jnp.int32))
  with pytest.raises(ValueError, match="unknown selector"):
    sparse.selector("nope")
