"""The layer-cache contract: every cache a layer can hold (rkv.models.kv.LayerCache) runs the
same suite. Adding a cache (or a tactic) is one entry in ``CACHES``: a name and a factory of an
empty cache for ``(batch, capacity, K, D, dtype)``.

The contract: ``attend`` appends a chunk and returns causal attention over every cell held
(equal to the reference over all cells written, within the ring's window for a ring);
``next_position`` and ``room`` follow the cells written; ``jittable`` is true exactly when
``attend`` runs under ``jax.jit``; ``tactic`` is static data naming an ``rkv.tactics`` entry whose
cache kind matches; ``streamed_tiles`` lists host tiles only for tactics that stream.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rkv
from rkv import sparse, tactics
from rkv.models import kv as kv_lib
from tests.support.tolerances import ROLLING_VS_RESIDENT

B, CAP, K, D, H = 2, 40, 2, 16, 4
RING = 16  # the ring's window: a sliding-window layer of W = RING
TILE = 4

CACHES = {
    "resident": lambda: kv_lib.ResidentCache.empty(B, CAP, K, D, jnp.float32),
    "ring": lambda: kv_lib.RingCache.empty(B, RING, K, D, jnp.float32),
    "stream": lambda: rkv.RollingKV.empty(B, CAP, K, D, window_cells=6, dtype=jnp.float32,
                                          tile_cells=TILE),
    "cpu": lambda: rkv.RollingKV.empty(B, CAP, K, D, window_cells=6, dtype=jnp.float32,
                                       tile_cells=TILE).with_tactic("cpu"),
    "hybrid": lambda: rkv.RollingKV.empty(B, CAP, K, D, window_cells=6, dtype=jnp.float32,
                                          tile_cells=TILE).with_tactic("hybrid", 0.5),
    "head": lambda: rkv.HeadSplitKV.empty(B, CAP, K, D, resident_heads=1, window_cells=6,
                                          dtype=jnp.float32, tile_cells=TILE),
    # Approximate in general; selecting every block (10 of 4 cells) makes it exact, which is
    # what the contract can check.
    "sparse": lambda: sparse.BlockCache.empty(
        B, CAP, K, D, dtype=jnp.float32,
        config=sparse.BlockCacheConfig(block_cells=4, device_slots=2 * 10, select_blocks=10,
                                       window_blocks=1)),
}
KIND = {"resident": "resident", "ring": "resident", "stream": "rolling", "cpu": "rolling",
        "hybrid": "rolling", "head": "head_split", "sparse": "block"}


def _chunks(rng, lengths):
  start = 0
  for t in lengths:
    q = jnp.asarray(rng.standard_normal((B, t, H, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, t, K, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, t, K, D)), jnp.float32)
    pos = jnp.asarray(np.broadcast_to(np.arange(start, start + t, dtype=np.int32), (B, t)))
    yield q, k, v, pos
    start += t


@pytest.mark.parametrize("name", list(CACHES))
def test_cache_implements_the_protocol(name):
  cache = CACHES[name]()
  assert isinstance(cache, kv_lib.LayerCache)
  assert tactics.spec(cache.tactic).cache == KIND[name]
  assert cache.tactic == ("resident" if name == "ring" else name)
  assert cache.jittable == (KIND[name] == "resident")
  assert int(cache.next_position()) == 0
  assert cache.room == (None if name == "ring" else CAP)


@pytest.mark.parametrize("name", list(CACHES))
def test_attend_equals_the_reference_over_every_cell_written(name):
  rng = np.random.default_rng(0)
  cache = CACHES[name]()
  window = RING if name == "ring" else None
  ks, vs = [], []
  tol = ROLLING_VS_RESIDENT["float32"]
  written = 0
  for q, k, v, pos in _chunks(rng, (7, 1, 13, 1, 1)):  # a prefill crossing tiles, then decode
    ks.append(k)
    vs.append(v)
    o, cache = cache.attend(q, k, v, pos, window=window, softcap=None, scale=None, impl="xla")
    written += k.shape[1]
    kk, vv = jnp.concatenate(ks, 1), jnp.concatenate(vs, 1)
    o_ref, _ = rkv.attention(q, kk, vv, q_pos=pos, causal=True, window=window, impl="reference")
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), atol=tol[0], rtol=tol[1])
    assert int(cache.next_position()) == written
    assert cache.room == (None if name == "ring" else CAP - written)
    tiles = cache.streamed_tiles()
    assert isinstance(tiles, tuple)
    if tiles:
      assert tactics.spec(cache.tactic).streams


@pytest.mark.parametrize("name", [n for n in CACHES if KIND[n] == "resident"])
def test_a_jittable_cache_attends_under_jit(name):
  rng = np.random.default_rng(1)
  q, k, v, pos = next(_chunks(rng, (5,)))
  window = RING if name == "ring" else None
  step = jax.jit(lambda c, q, k, v, p: c.attend(q, k, v, p, window=window, softcap=None,
                                                 scale=None, impl="xla"))
  o_jit, c_jit = step(CACHES[name](), q, k, v, pos)
  o, c = CACHES[name]().attend(q, k, v, pos, window=window, softcap=None, scale=None, impl="xla")
  np.testing.assert_allclose(np.asarray(o_jit), np.asarray(o), atol=1e-6)
  assert int(c_jit.next_position()) == int(c.next_position()) == 5


def test_the_tactic_is_static_data_of_the_cache():
  kv = CACHES["hybrid"]()
  leaves, treedef = jax.tree_util.tree_flatten(kv)
  again = jax.tree_util.tree_unflatten(treedef, leaves)
  assert (again.tactic, again.cpu_fraction) == ("hybrid", 0.5)
  assert kv.with_tactic("stream").tactic == "stream"
  with pytest.raises(ValueError, match="tactic must be one of"):
    kv.with_tactic("head")
  with pytest.raises(ValueError, match="cpu_fraction is only valid"):
    kv.with_tactic("cpu", 0.5)
