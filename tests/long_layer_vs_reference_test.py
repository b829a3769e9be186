"""Gate (issue 10): one layer's rolling attention at the context rkv exists for equals
``rkv.attention`` over the same K/V held whole on the device.

The long path's pieces (a window of most of the cells, a few tail tiles in pinned host memory, a
staging tile, the stream / cpu / hybrid tactics) are exact by construction and checked at small
shapes everywhere; this gate runs them at the sizes of a 1M-token Llama-3-8B layer, where a bug
in an offset, a tile count or an int32 product would only show at scale. A sample of KV heads
(one, with its G = 4 query heads) keeps the whole-device reference within memory: 1M cells of
one bf16 KV head are 512 MiB of K/V. The layout is one the planner made at 1M with the default
budget on the H200 (benchmarks/results/beyond_hbm/cmdbuf_on.json: W = 956,160, 32,384-cell tiles,
two full tail tiles and a partly filled staging tile); the plan of the rows in
decode_beyond_hbm_h200.json since session 8 is W = 960,128 with four 22,144-cell tiles, the same
code paths at other offsets. On CPU the same checks run at a 4K-cell layout.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rkv
from tests.support.tolerances import LONG_LAYER as TOL

# (context, window W, tile, fill): fill leaves staged cells, so every part of the cache is read.
SMALL = (4096, 3072, 384, 4096 - 19)
LONG = (1 << 20, 956_160, 32_384, (1 << 20) - 19)
TACTICS = [("stream", None), ("cpu", None), ("hybrid", 0.5)]


def _check(context, window, tile, fill, dtype, tactic, cpu_fraction, impl):
  kq, kk, kv_ = jax.random.split(jax.random.key(context + window), 3)
  dt = jnp.dtype(dtype)
  k = jax.random.normal(kk, (1, fill, 1, 128), jnp.float32).astype(dt)
  v = jax.random.normal(kv_, (1, fill, 1, 128), jnp.float32).astype(dt)
  q = jax.random.normal(kq, (1, 1, 4, 128), jnp.float32).astype(dt)
  kv = rkv.RollingKV.from_arrays(k, v, window_cells=window, tile_cells=tile, capacity=context)
  assert kv.n_full_tiles >= 2 and kv.n_staged > 0
  o, lse = rkv.rolling_attention(q, kv, tactic=tactic, cpu_fraction=cpu_fraction, impl=impl)
  # The float32 einsum reference over every cell (at 1M: [1,1,4,1M] scores, 16 MiB).
  o_ref, lse_ref = rkv.attention(q, k, v, impl="reference")
  o, o_ref = np.asarray(o, np.float32), np.asarray(o_ref, np.float32)
  lse, lse_ref = np.asarray(lse), np.asarray(lse_ref)
  assert np.isfinite(o).all() and np.isfinite(lse).all()
  np.testing.assert_allclose(o, o_ref, atol=TOL[dtype], rtol=TOL[dtype])
  np.testing.assert_allclose(lse, lse_ref, atol=TOL["float32"], rtol=TOL["float32"])


@pytest.mark.parametrize("tactic,cpu_fraction", TACTICS, ids=[t for t, _ in TACTICS])
def test_long_layer_layout_small(tactic, cpu_fraction):
  _check(*SMALL, "float32", tactic, cpu_fraction, impl="xla")


@pytest.mark.gpu
@pytest.mark.parametrize("tactic,cpu_fraction", TACTICS, ids=[t for t, _ in TACTICS])
def test_one_layer_at_1m_equals_attention(tactic, cpu_fraction):
  _check(*LONG, "bfloat16", tactic, cpu_fraction, impl="auto")


def _check_int8(context, window, tile, fill, tactic, cpu_fraction, impl):
  # The 2M int8 rows' cache: int8 K/V with the default (bfloat16) scales, quantized by the cache;
  # the reference reads the same int8 cells and scales whole.
  kq, kk, kv_ = jax.random.split(jax.random.key(context + window + 1), 3)
  k = np.asarray(jax.random.normal(kk, (1, fill, 1, 128), jnp.float32))
  v = np.asarray(jax.random.normal(kv_, (1, fill, 1, 128), jnp.float32))
  q = jax.random.normal(kq, (1, 1, 4, 128), jnp.float32).astype(jnp.bfloat16)
  kv = rkv.RollingKV.from_arrays(k, v, window_cells=window, tile_cells=tile, capacity=context,
                                 dtype=jnp.int8)
  assert kv.scale_dtype == jnp.bfloat16 and kv.n_full_tiles >= 2 and kv.n_staged > 0
  o, lse = rkv.rolling_attention(q, kv, tactic=tactic, cpu_fraction=cpu_fraction, impl=impl)
  (k8, ks), (v8, vs) = (rkv.cache.quantize_int8(x, jnp.bfloat16) for x in (k, v))
  o_ref, lse_ref = rkv.attention(q, k8, v8, k_scale=ks, v_scale=vs, impl="reference")
  o, o_ref = np.asarray(o, np.float32), np.asarray(o_ref, np.float32)
  assert np.isfinite(o).all() and np.isfinite(np.asarray(lse)).all()
  np.testing.assert_allclose(o, o_ref, atol=TOL["bfloat16"], rtol=TOL["bfloat16"])
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), atol=TOL["float32"],
                             rtol=TOL["float32"])


@pytest.mark.parametrize("tactic,cpu_fraction", TACTICS, ids=[t for t, _ in TACTICS])
def test_int8_long_layer_layout_small(tactic, cpu_fraction):
  _check_int8(*SMALL, tactic, cpu_fraction, impl="xla")


@pytest.mark.gpu
@pytest.mark.parametrize("tactic,cpu_fraction", TACTICS, ids=[t for t, _ in TACTICS])
def test_int8_layer_at_1m_equals_attention(tactic, cpu_fraction):
  _check_int8(*LONG, tactic, cpu_fraction, impl="auto")
