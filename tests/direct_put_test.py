"""The streamed tiles' direct put (rkv.offload.memory.put_to_device) against jax.device_put.

The direct path calls two jax internals (the batched copy and the result handler) that
jax.device_put ends in; these tests pin what it must give: the same arrays (values, aval with its
memory space, sharding, committed), the same compiled program when a jitted function takes them,
jax.device_put itself wherever the arrays are not the tiles' case, and the same attention.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rkv
from rkv import rolling
from rkv.offload import memory, stream

from tests.support.rolling_cases import assert_same_attention, hybrid_decode_case


def _host(x):
  return memory.to_host(jnp.asarray(x))


def _tile_arrays(seed=0):
  """A tile's four arrays as a cache holds them: int8 K/V and bfloat16 scales, plus a float32 K."""
  rng = np.random.default_rng(seed)
  k = rng.integers(-127, 128, (1, 8, 2, 16), dtype=np.int8)
  v = rng.integers(-127, 128, (1, 8, 2, 16), dtype=np.int8)
  ks = rng.standard_normal((1, 8, 2)).astype(jnp.bfloat16)
  vs = rng.standard_normal((1, 8, 2)).astype(jnp.bfloat16)
  kf = rng.standard_normal((1, 8, 2, 16)).astype(np.float32)
  return [_host(a) for a in (k, v, ks, vs, kf)]


@pytest.fixture
def batched_calls(monkeypatch):
  """Counts the direct path's batched copies (the arrays of each call)."""
  calls = []
  real = memory._BATCHED_COPY
  monkeypatch.setattr(memory, "_BATCHED_COPY",
                      lambda xs, *a: calls.append(len(xs)) or real(xs, *a))
  return calls


def test_direct_path_exists_on_the_pinned_jax():
  # If this fails after a jax upgrade, the tiles quietly take jax.device_put (slower, not wrong):
  # check the internals named in memory.py's comment again before changing this test.
  assert memory.direct_puts_available()


def test_direct_put_gives_what_device_put_gives(batched_calls):
  xs = _tile_arrays()
  got = memory.put_to_device([xs[0], None, *xs[1:]])
  assert batched_calls == [len(xs)]
  assert got[1] is None
  want = jax.device_put(xs, memory.sharding(memory.DEVICE))
  for g, w, x in zip([got[0], *got[2:]], want, xs):
    assert g.aval == w.aval and g.aval.memory_space == jax.memory.Space.Device
    assert g.sharding == w.sharding and g.sharding.memory_kind == memory.DEVICE
    assert g.committed and w.committed
    assert g.dtype == x.dtype and g.shape == x.shape
    np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)),
                                  np.asarray(x.astype(jnp.float32)))
    assert g.unsafe_buffer_pointer() != x.unsafe_buffer_pointer()  # a copy, not the host buffer


def test_transfer_guard_counts_the_direct_put_as_explicit(batched_calls):
  # As jax.device_put's own transfers: allowed under "disallow" (implicit ones only), refused
  # under "disallow_explicit".
  xs = _tile_arrays(5)
  with jax.transfer_guard("disallow"):
    memory.put_to_device(xs)
  assert batched_calls == [len(xs)]
  with jax.transfer_guard("disallow_explicit"):
    with pytest.raises(Exception, match="(?i)disallowed"):
      memory.put_to_device(xs)


def test_direct_results_reuse_device_puts_program(batched_calls):
  # A jitted function compiled for device_put's results must be the one that runs on the
  # direct path's (same aval, sharding and committedness: no second compile, and on a GPU no
  # program that reads its arguments from host memory).
  xs = _tile_arrays(1)
  f = jax.jit(lambda k, v, ks, vs, kf: (k.astype(jnp.float32) * ks[..., None].astype(jnp.float32)
                                        + v.astype(jnp.float32) * vs[..., None] + kf).sum())
  want = f(*jax.device_put(xs, memory.sharding(memory.DEVICE)))
  got = f(*memory.put_to_device(xs))
  assert batched_calls == [len(xs)]
  assert f._cache_size() == 1
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_other_inputs_take_device_put(batched_calls):
  xs = _tile_arrays(2)
  on_device = memory.to_device(jnp.ones((4,), jnp.float32))
  numpy = np.arange(6, dtype=np.int32)
  for mixed in ([xs[0], on_device], [numpy], [xs[0], numpy]):
    got = memory.put_to_device(mixed)
    want = jax.device_put(mixed, memory.sharding(memory.DEVICE))
    for g, w in zip(got, want):
      assert g.aval == w.aval and g.sharding == w.sharding
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  assert batched_calls == []
  assert memory.put_to_device([None, None]) == [None, None]


def test_switch_off_takes_device_put(monkeypatch, batched_calls):
  xs = _tile_arrays(3)
  monkeypatch.setenv(memory.DIRECT_PUTS_ENV, "0")
  got = memory.put_to_device(xs)
  assert batched_calls == []
  for g, x in zip(got, xs):
    assert g.sharding.memory_kind == memory.DEVICE
    np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)),
                                  np.asarray(x.astype(jnp.float32)))
  monkeypatch.setenv(memory.DIRECT_PUTS_ENV, "fast")
  with pytest.raises(ValueError, match=memory.DIRECT_PUTS_ENV):
    memory.put_to_device(xs)


def test_deleted_array_is_refused_like_device_put(batched_calls):
  xs = _tile_arrays(4)
  xs[1].delete()
  with pytest.raises(RuntimeError, match="deleted"):
    memory.put_to_device(xs)
  with pytest.raises(RuntimeError, match="deleted"):
    jax.device_put(xs, memory.sharding(memory.DEVICE))
  assert batched_calls == []


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_attention_is_the_same_with_the_switch_off(monkeypatch, batched_calls, kv_dtype):
  # A hybrid decode step streams its tiles by the direct path (the early puts and the lookahead's)
  # and gives what the same step gives with every tile moved by jax.device_put.
  k, v, fresh, q, new, args = hybrid_decode_case(5, 44, capacity=64)
  make = fresh if kv_dtype == "float32" else (
      lambda: rkv.RollingKV.from_arrays(k, v, window_cells=8, tile_cells=8, capacity=64,
                                        dtype=jnp.int8).with_tactic("hybrid", 0.4))
  on, _ = make().attend(*args, impl="xla")
  assert batched_calls, "the hybrid step put no tile by the direct path"
  monkeypatch.setenv(memory.DIRECT_PUTS_ENV, "0")
  n = len(batched_calls)
  off, _ = make().attend(*args, impl="xla")
  assert len(batched_calls) == n
  np.testing.assert_array_equal(np.asarray(on), np.asarray(off))
  if kv_dtype == "float32":
    assert_same_attention(on, off, q, k, v, new, args[3])


def test_stream_put_many_keeps_staged_tiles(batched_calls):
  xs = _tile_arrays(6)
  pos = jnp.arange(8, dtype=jnp.int32)[None]
  host = stream.Tile(xs[0], xs[1], pos, xs[2], xs[3])
  staged = stream.put_eager(host)
  assert batched_calls == [4] and stream.on_device(staged)
  out = stream.put_many_eager([staged, host, stream.Tile(xs[4], xs[4], pos, None, None)])
  assert out[0] is staged
  assert batched_calls == [4, 6]  # the second tile's four arrays and the third's two
  assert out[2].k_scale is None and stream.on_device(out[1]) and stream.on_device(out[2])
  np.testing.assert_array_equal(np.asarray(out[1].v), np.asarray(xs[1]))


@pytest.mark.gpu
def test_direct_put_on_the_gpu(batched_calls):
  # A tile of the 2M int8 plan's size (32768 cells, K=8, D=128), pinned_host -> HBM over PCIe:
  # the same arrays and the same program as jax.device_put's.
  rng = np.random.default_rng(7)
  shape = (1, 32768, 8, 128)
  xs = [_host(rng.integers(-127, 128, shape, dtype=np.int8)),
        _host(rng.integers(-127, 128, shape, dtype=np.int8)),
        _host(rng.standard_normal(shape[:3]).astype(jnp.bfloat16)),
        _host(rng.standard_normal(shape[:3]).astype(jnp.bfloat16))]
  f = jax.jit(lambda k, v, ks, vs: (k.astype(jnp.float32).sum((1, 3)) * ks.astype(jnp.float32)
                                    + v.astype(jnp.float32).sum((1, 3)) * vs).sum())
  want_arrays = jax.device_put(xs, memory.sharding(memory.DEVICE))
  got_arrays = memory.put_to_device(xs)
  assert batched_calls == [4]
  for g, w in zip(got_arrays, want_arrays):
    assert g.aval == w.aval and g.sharding == w.sharding
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  np.testing.assert_array_equal(np.asarray(f(*got_arrays)), np.asarray(f(*want_arrays)))
  assert f._cache_size() == 1
