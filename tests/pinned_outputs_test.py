"""The CPU share's partial written into fresh pinned_host arrays (cpu_attention.PinnedOutputs).

What must hold: every pair is new (never a buffer a program may still read), starts at the
values of a row that sees no key (0, -inf), gets the same bits the numpy path returns, and is
moved to the device by the merge's own program (no computation on host memory there); a decode
step gives the same result with the switch on and off.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rkv
from rkv import rolling
from rkv.offload import cpu_attention as cpu_lib
from rkv.offload import memory, stream

from tests.support.decode_runs import assert_same_run, decode_with
from tests.support.rolling_cases import assert_same_attention, hybrid_decode_case


@pytest.fixture
def takes(monkeypatch):
  """Counts the pairs handed out, and keeps them (to check they are all distinct)."""
  pairs = []
  real = cpu_lib.pinned_outputs
  monkeypatch.setattr(cpu_lib, "pinned_outputs",
                      lambda q: (lambda p: p is not None and pairs.append(p) or p)(real(q)))
  return pairs


def test_pairs_are_fresh_and_initialized():
  q = jnp.zeros((2, 1, 4, 8), jnp.bfloat16)
  stock = cpu_lib.PinnedOutputs(batch=3)
  dev = jax.devices()[0]
  pairs = [stock.take(q.shape, dev) for _ in range(7)]  # three refills
  ptrs = {a.unsafe_buffer_pointer() for p in pairs for a in p}
  assert len(ptrs) == 14  # no buffer handed out twice
  for o, lse in pairs:
    assert memory.memory_kind(o) == memory.memory_kind(lse) == memory.PINNED_HOST
    assert o.shape == (2, 1, 4, 8) and lse.shape == (2, 1, 4)
    assert o.dtype == lse.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(o), 0)
    np.testing.assert_array_equal(np.asarray(lse), -np.inf)


def test_pinned_outputs_only_for_a_jax_query(monkeypatch):
  assert cpu_lib.pinned_outputs(np.zeros((1, 1, 4, 8), np.float32)) is None
  o, lse = cpu_lib.pinned_outputs(jnp.zeros((1, 1, 4, 8), jnp.float32))
  assert o.shape == (1, 1, 4, 8) and lse.shape == (1, 1, 4)
  monkeypatch.setenv(cpu_lib.PINNED_OUT_ENV, "0")
  assert cpu_lib.pinned_outputs(jnp.zeros((1, 1, 4, 8), jnp.float32)) is None
  monkeypatch.setenv(cpu_lib.PINNED_OUT_ENV, "yes please")
  with pytest.raises(ValueError, match=cpu_lib.PINNED_OUT_ENV):
    cpu_lib.pinned_outputs(jnp.zeros((1, 1, 4, 8), jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8])
def test_tail_written_into_out_equals_the_numpy_result(dtype):
  k, v, fresh, q, new, args = hybrid_decode_case(8, 40, capacity=64)
  kv = rkv.RollingKV.from_arrays(k, v, window_cells=8, tile_cells=8, capacity=64, dtype=dtype)
  want_o, want_lse = cpu_lib.cpu_attention_tail(q, kv, tiles=(1, kv.n_full_tiles))
  assert isinstance(want_o, np.ndarray)
  out = cpu_lib.pinned_outputs(q)
  o, lse = cpu_lib.cpu_attention_tail(q, kv, tiles=(1, kv.n_full_tiles), out=out)
  assert o is out[0] and lse is out[1]
  np.testing.assert_array_equal(np.asarray(o), want_o)
  np.testing.assert_array_equal(np.asarray(lse), want_lse)
  # No tile on the CPU: the pair comes back as it was made (a row that saw no key).
  out = cpu_lib.pinned_outputs(q)
  o, lse = cpu_lib.cpu_attention_tail(q, kv, tiles=(kv.n_full_tiles, kv.n_full_tiles), out=out)
  np.testing.assert_array_equal(np.asarray(o), 0)
  np.testing.assert_array_equal(np.asarray(lse), -np.inf)


def test_bad_out_is_refused():
  k, v, fresh, q, new, args = hybrid_decode_case(9, 40, capacity=64)
  kv = fresh()
  o, lse = cpu_lib.pinned_outputs(q)
  bad = [(np.zeros(o.shape, np.float32), lse),  # numpy: no pinned buffer
         (o, memory.to_host(jnp.zeros((1, 1, 3), jnp.float32))),  # wrong shape
         (memory.to_host(jnp.zeros(o.shape, jnp.bfloat16)), lse),  # wrong dtype
         (memory.to_device(jnp.zeros(o.shape, jnp.float32)), lse)]  # device memory
  for out in bad:
    with pytest.raises(ValueError, match="out's"):
      cpu_lib.cpu_attention_tail(q, kv, tiles=(1, kv.n_full_tiles), out=out)


def test_merge_moves_host_parts_and_computes_on_device_only():
  o, lse = cpu_lib.pinned_outputs(jnp.zeros((1, 1, 4, 8), jnp.float32))
  dev_part = (jnp.ones((1, 1, 4, 8), jnp.float32), jnp.zeros((1, 1, 4), jnp.float32))
  merge = jax.jit(lambda parts: stream.merge_all(parts, jnp.bfloat16))
  jaxpr = jax.make_jaxpr(lambda parts: stream.merge_all(parts, jnp.bfloat16))([dev_part, (o, lse)])
  assert memory.host_compute_eqns(jaxpr) == []
  text = merge.trace([dev_part, (o, lse)]).lower(lowering_platforms=("cuda",)).as_text()
  assert memory.placement_report(text) == {"device": 2}  # o and lse, nothing else
  # The pinned pair holds (0, -inf): a partial that saw no key; the merge is the device part.
  got_o, got_lse = merge([dev_part, (o, lse)])
  assert got_o.sharding.memory_kind == memory.DEVICE
  np.testing.assert_array_equal(np.asarray(got_o), np.ones((1, 1, 4, 8), jnp.bfloat16))
  np.testing.assert_array_equal(np.asarray(got_lse), 0)


@pytest.mark.parametrize("fill", [40, 47])  # a plain step, and one whose append flushes a tile
def test_decode_step_is_the_same_with_the_switch_off(monkeypatch, takes, fill):
  k, v, fresh, q, new, args = hybrid_decode_case(11, fill, capacity=64)
  on, _ = fresh().attend(*args, impl="xla")
  assert len(takes) == 1, "the hybrid step's CPU share took no pinned pair"
  monkeypatch.setenv(cpu_lib.PINNED_OUT_ENV, "0")
  off, _ = fresh().attend(*args, impl="xla")
  assert len(takes) == 1
  np.testing.assert_array_equal(np.asarray(on), np.asarray(off))
  assert_same_attention(on, off, q, k, v, new, args[3])


@pytest.mark.parametrize("tactic", ["hybrid", "cpu"])
def test_layered_decode_is_the_same_with_the_switch_off(monkeypatch, takes, tactic):
  # The model's path: the CPU share started early, its parts merged inside the next layer's
  # join program (RKV_JOIN_LAYERS): a prefill, decode steps and a flush.
  on = decode_with(tactic)
  assert takes, "no CPU share took a pinned pair"
  monkeypatch.setenv(cpu_lib.PINNED_OUT_ENV, "0")
  n = len(takes)
  off = decode_with(tactic)
  assert len(takes) == n
  assert_same_run(on, off)


def test_large_pairs_are_made_fewer_at_a_time(monkeypatch):
  monkeypatch.setattr(cpu_lib, "PINNED_OUT_BATCH_BYTES", 3 * 4 * 4 * 9)  # three [1,1,4,8] pairs
  stock = cpu_lib.PinnedOutputs(batch=64)
  dev = jax.devices()[0]
  stock.take((1, 1, 4, 8), dev)
  assert len(stock._stock[((1, 1, 4, 8), dev)]) == 2
  monkeypatch.setattr(cpu_lib, "PINNED_OUT_BATCH_BYTES", 1)  # never fewer than two
  stock.take((2, 1, 4, 8), dev)
  assert len(stock._stock[((2, 1, 4, 8), dev)]) == 1
