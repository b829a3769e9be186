"""rkv.offload.host_share: a layer's CPU share started and awaited inside jitted programs.

On the CPU backend (the CUDA handlers need a GPU): the partial a share's C++ worker computes is
the Python path's, bit for bit (the same kernel over the same cells and the same float32 query),
across steps, appends and a reconfiguration after a flush; merged with the device partials it
equals attention over the whole cache (reference, float32 tolerances); a NaN query comes out
NaN; a wait with no start, a second start before its wait, a kernel error path and bad
arguments fail loudly, never hang or return stale values.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rkv
from rkv import rolling
from rkv.offload import cpu_attention as cpu_lib
from rkv.offload import host_share
from tests.support.tolerances import TOLERANCES

B, K, H, D = 1, 2, 8, 16


@pytest.fixture(autouse=True, scope="module")
def _built():
  from rkv.offload import share_build
  try:
    share_build.find_compiler()
  except rkv.offload.cpu_build.CompilerNotFoundError as e:
    pytest.skip(f"no C++ compiler to build the host share: {e}")


def _cache(kv_dtype, fill, rng, *, capacity=72):
  k = rng.standard_normal((B, fill, K, D)).astype(np.float32)
  v = rng.standard_normal((B, fill, K, D)).astype(np.float32)
  kw = {}
  if kv_dtype == "int8":
    k, ks = rkv.cache.quantize_int8(k, scale_dtype=jnp.bfloat16)
    v, vs = rkv.cache.quantize_int8(v, scale_dtype=jnp.bfloat16)
    kw = dict(k_scale=ks, v_scale=vs)
  kv = rkv.RollingKV.from_arrays(jnp.asarray(k), jnp.asarray(v), window_cells=8, tile_cells=8,
                                 capacity=capacity, **kw).with_tactic("hybrid", 0.5)
  return kv


def _cpu_range(kv):
  n = kv.n_full_tiles
  return rolling.streamed_count(n, "hybrid", 0.5), n


def _steps_match_the_python_path(share, kv, rng, *, steps, fill):
  """``steps`` decode queries through ``share`` (its start and wait as two programs, then as
  one, alternately): each partial equals the Python path's bit for bit."""
  start, wait = jax.jit(share.start), jax.jit(share.wait)
  both = jax.jit(lambda q, p: share.wait(share.start(q, p)))  # start and wait in one program
  for step in range(steps):
    q = jnp.asarray(rng.standard_normal(share.q_shape), jnp.bfloat16)
    q_pos = jnp.full(share.q_shape[:2], fill + step, jnp.int32)
    o, lse = wait(start(q, q_pos)) if step % 2 == 0 else both(q, q_pos)
    want_o, want_lse = cpu_lib.cpu_attention_tail(q, kv, q_pos=q_pos, tiles=_cpu_range(kv))
    np.testing.assert_array_equal(np.asarray(o), want_o)
    np.testing.assert_array_equal(np.asarray(lse), want_lse)
  assert share.counters() == dict(starts=steps, waits=steps, runs=steps, last_rc=0)


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_the_worker_computes_the_python_paths_partial(kv_dtype):
  rng = np.random.default_rng(1)
  kv = _cache(kv_dtype, 44, rng)
  share = host_share.HostShare((B, 1, H, D))
  share.configure(kv, tiles=_cpu_range(kv))
  _steps_match_the_python_path(share, kv, rng, steps=4, fill=44)  # starts and waits alternate


def test_the_share_programs_carry_no_effect():
  # An effect would send every start and wait through jit's Python dispatch (twice a layer);
  # the calls stay in their programs because their results are the programs' outputs.
  share = host_share.HostShare((B, 1, H, D))
  q, q_pos = jnp.zeros(share.q_shape, jnp.float32), jnp.zeros((B, 1), jnp.int32)
  start = jax.make_jaxpr(share.start)(q, q_pos)
  assert not start.effects and len(start.jaxpr.outvars) == 1
  wait = jax.make_jaxpr(share.wait)(jnp.int32(0))
  assert not wait.effects and len(wait.jaxpr.outvars) == 2
  share.close()


def test_merged_with_the_device_partials_it_equals_attention_over_the_cache():
  # A hybrid layer split by hand: window, staging and the streamed tiles on the device, the CPU
  # tiles through the share; one exact merge equals attention over every cell, across appends
  # and a flush (the share reconfigured for the new tile range).
  rng = np.random.default_rng(2)
  total = rng.standard_normal((B, 72, K, D)).astype(np.float32)
  fill = 43
  kv = rkv.RollingKV.from_arrays(jnp.asarray(total[:, :fill]), jnp.asarray(total[:, :fill]),
                                 window_cells=8, tile_cells=8,
                                 capacity=72).with_tactic("hybrid", 0.5)
  share = host_share.HostShare((B, 1, H, D))
  configured = None
  rtol, atol = TOLERANCES["float32"]["o"]
  for _ in range(6):  # 43 -> 49: the append to 48 = 8 + 5 * 8 flushes a fifth tile
    kv = kv.append(jnp.asarray(total[:, fill:fill + 1]), jnp.asarray(total[:, fill:fill + 1]))
    fill += 1
    n_stream, n = _cpu_range(kv)
    if configured != (n_stream, n):
      share.configure(kv, tiles=(n_stream, n))
      configured = (n_stream, n)
    q = jnp.asarray(rng.standard_normal((B, 1, H, D)), jnp.float32)
    q_pos = jnp.full((B, 1), fill - 1, jnp.int32)
    token = jax.jit(share.start)(q, q_pos)
    parts = [rolling._partial_jit(q, q_pos, kv.window, impl="xla", causal=True, window=None,
                                  softcap=None, scale=D ** -0.5)]
    if kv.n_staged:
      parts.append(rolling._partial_jit(q, q_pos, kv.staging, impl="xla", causal=True,
                                        window=None, softcap=None, scale=D ** -0.5))
    for tile in rkv.offload.stream.put_many_eager(rolling._tiles(kv, n_stream)):
      parts.append(rolling._partial_jit(q, q_pos, tile, impl="xla", causal=True, window=None,
                                        softcap=None, scale=D ** -0.5))
    parts.append(jax.jit(share.wait)(token))
    o, lse = rkv.offload.stream.merge_all(parts, out_dtype=jnp.float32)
    want_o, want_lse = rkv.attention(q, jnp.asarray(total[:, :fill]),
                                     jnp.asarray(total[:, :fill]), q_pos=q_pos,
                                     impl="reference")
    np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), rtol=rtol, atol=atol)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=rtol, atol=atol)
  assert kv.n_full_tiles == 5 and configured == _cpu_range(kv)


def test_shares_started_together_are_each_served_their_own_partial():
  # One runner thread serves every share in the order their queries land: three layers' shares
  # started back to back and awaited in reverse order each return their own cache's partial.
  rng = np.random.default_rng(6)
  caches = [_cache("float32", 44, rng) for _ in range(3)]
  shares = [host_share.HostShare((B, 1, H, D)) for _ in caches]
  for share, kv in zip(shares, caches):
    share.configure(kv, tiles=_cpu_range(kv))
  q = jnp.asarray(rng.standard_normal((B, 1, H, D)), jnp.float32)
  q_pos = jnp.full((B, 1), 44, jnp.int32)
  tokens = [share.start_program(q, q_pos) for share in shares]
  for share, kv, token in reversed(list(zip(shares, caches, tokens))):
    o, lse = share.wait_program(token)
    want_o, want_lse = cpu_lib.cpu_attention_tail(q, kv, q_pos=q_pos, tiles=_cpu_range(kv))
    np.testing.assert_array_equal(np.asarray(o), want_o)
    np.testing.assert_array_equal(np.asarray(lse), want_lse)


def test_a_nan_query_comes_out_nan():
  rng = np.random.default_rng(3)
  kv = _cache("float32", 44, rng)
  share = host_share.HostShare((B, 1, H, D))
  share.configure(kv, tiles=_cpu_range(kv))
  q = np.asarray(rng.standard_normal((B, 1, H, D)), np.float32)
  q[0, 0, 3, 5] = np.nan  # query head 3 reads it
  o, lse = jax.jit(lambda q, p: share.wait(share.start(q, p)))(
      jnp.asarray(q), jnp.full((B, 1), 44, jnp.int32))
  o, lse = np.asarray(o), np.asarray(lse)
  assert np.isnan(o[0, 0, 3]).all() and np.isnan(lse[0, 0, 3])
  assert np.isfinite(np.delete(o, 3, axis=2)).all() and np.isfinite(np.delete(lse, 3, axis=2)).all()


def test_the_protocol_fails_loudly():
  rng = np.random.default_rng(4)
  kv = _cache("float32", 44, rng)
  share = host_share.HostShare((B, 1, H, D))
  q = jnp.zeros((B, 1, H, D), jnp.float32)
  q_pos = jnp.full((B, 1), 44, jnp.int32)
  with pytest.raises(Exception, match="not configured"):  # no kernel arguments yet
    jax.block_until_ready(jax.jit(share.start)(q, q_pos))
  share.configure(kv, tiles=_cpu_range(kv))
  share.set_wait_seconds(0.2)
  with pytest.raises(Exception, match="no CPU share finished within"):  # a wait with no start
    jax.block_until_ready(jax.jit(share.wait)(jnp.int32(0)))
  token = jax.block_until_ready(jax.jit(share.start)(q, q_pos))
  with pytest.raises(Exception, match="not awaited"):  # a second start before the first's wait
    jax.block_until_ready(jax.jit(share.start)(q, q_pos))
  with pytest.raises(RuntimeError, match="still waiting"):  # no reconfiguration mid-flight
    share.configure(kv, tiles=_cpu_range(kv))
  o, _ = jax.jit(share.wait)(token)  # the pending start is still served
  want, _ = cpu_lib.cpu_attention_tail(q, kv, q_pos=q_pos, tiles=_cpu_range(kv))
  np.testing.assert_array_equal(np.asarray(o), want)
  share._prepared.args.num_heads = 3  # not a multiple of the KV heads: the kernel refuses it
  with pytest.raises(Exception, match=r"the CPU kernel failed \(rc=-2"):
    jax.block_until_ready(jax.jit(lambda q, p: share.wait(share.start(q, p)))(q, q_pos))
  assert share.counters()["last_rc"] == -2
  with pytest.raises(ValueError, match="holds no cells"):
    share.configure(kv, tiles=(2, 2))
  with pytest.raises(ValueError, match="tiles must be"):
    share.configure(kv, tiles=(0, 9))
  with pytest.raises(ValueError, match="q has shape"):
    share.start(jnp.zeros((B, 2, H, D)), jnp.zeros((B, 2), jnp.int32))
  with pytest.raises(ValueError, match="q_shape"):
    host_share.HostShare((B, 1, H))
  with pytest.raises(ValueError, match="seconds"):
    share.set_wait_seconds(0)
  share.close()
  share.close()  # closing twice is a no-op


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_cuda_handlers_compute_the_python_paths_partial(kv_dtype):
  # On the GPU the share's start enqueues the query's copies and a host function on the
  # program's stream, and its wait the partial's copies back: the same partial as the Python
  # path, bit for bit, with the tiles in pinned host memory (as the cache keeps them), step
  # after step and with start and wait in one program.
  rng = np.random.default_rng(5)
  k = rng.standard_normal((B, 300, K, 128)).astype(np.float32)
  kw = {}
  if kv_dtype == "int8":
    k, ks = rkv.cache.quantize_int8(k, scale_dtype=jnp.bfloat16)
    kw = dict(k_scale=ks, v_scale=ks)
  else:
    k = k.astype(jnp.bfloat16)
  kv = rkv.RollingKV.from_arrays(jnp.asarray(k), jnp.asarray(k), window_cells=32, tile_cells=64,
                                 capacity=320, **kw).with_tactic("hybrid", 0.5)
  assert rkv.offload.memory.memory_kind(kv.tail.k[0]) == "pinned_host"
  share = host_share.HostShare((B, 1, 8, 128))
  share.configure(kv, tiles=_cpu_range(kv))
  _steps_match_the_python_path(share, kv, rng, steps=6, fill=300)
