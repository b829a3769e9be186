"""Rolling-cache cases and checks shared by the rolling, tactic and cache tests: a case's inputs
(``make``), the placement check of every array (``assert_kinds``) and the comparison (``check``)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

import rkv
from rkv.offload import memory
from tests import numpy_reference
from tests.support.tolerances import TOLERANCES


def assert_kinds(kv):
  kinds = rkv.cache.memory_kinds(kv)
  for name, kind in kinds.items():
    part, field = name.split(".")
    field = field.split("[")[0]  # tail arrays are per tile: "tail.k[3]"
    want = memory.PINNED_HOST if part == "tail" and field != "pos" else memory.DEVICE
    assert kind == want, f"{name} is in {kind}, expected {want}"
  assert kv.window.k.sharding.memory_kind == "device"
  assert isinstance(kv.tail.k, tuple) and len(kv.tail.k) == len(kv.tail.v) == kv.n_tail_tiles
  for i, (tk, tv) in enumerate(zip(kv.tail.k, kv.tail.v)):
    assert tk.sharding.memory_kind == "pinned_host", f"tail.k[{i}]"
    assert tv.sharding.memory_kind == "pinned_host", f"tail.v[{i}]"
    assert tk.shape == (kv.batch, kv.tile_cells, kv.num_kv_heads, kv.head_dim)
  assert len(kinds) == 3 * (2 + kv.n_tail_tiles) + (2 * (2 + kv.n_tail_tiles) if kv.quantized
                                                     else 0)


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  s: int = 75
  window_cells: int = 20
  tile: int = 16
  b: int = 1
  t: int = 1
  h: int = 4
  k: int = 2
  d: int = 32
  dtype: str = "float32"
  kv_dtype: str | None = None
  scale_dtype: str = "float32"  # int8 only: the scales' dtype (the cache's default is bfloat16)
  causal: bool = True
  window: int | None = None
  softcap: float | None = None
  positions: str = "default"  # default | chunk | holes | ragged

  def __str__(self):
    return self.name


def make(case: Case, seed: int = 0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((case.b, case.t, case.h, case.d)).astype(np.float32)
  k = rng.standard_normal((case.b, case.s, case.k, case.d)).astype(np.float32) * 1.5
  v = rng.standard_normal((case.b, case.s, case.k, case.d)).astype(np.float32)
  k_pos = np.broadcast_to(np.arange(case.s, dtype=np.int32), (case.b, case.s)).copy()
  q_pos = None
  if case.positions == "chunk":  # a chunk in the middle: later cells (window and tail) are future
    q_pos = np.broadcast_to(np.arange(case.t, dtype=np.int32) + 37, (case.b, case.t)).copy()
  elif case.positions == "holes":  # empty slots hold NaN in the window, tail and staging
    holes = rng.random((case.b, case.s)) < 0.3
    holes[:, -1] = False
    k_pos[holes] = -1
    k[holes] = np.nan
    v[holes] = np.nan
  elif case.positions == "ragged":
    for i in range(case.b):
      fill = case.s - 23 * i
      k_pos[i, fill:] = -1
      k[i, fill:] = np.nan
    q_pos = np.stack([[case.s - 23 * i - 1] for i in range(case.b)]).astype(np.int32)
  k_scale = v_scale = None
  if case.kv_dtype == "int8":
    sdt = jnp.dtype(case.scale_dtype)
    k, k_scale = numpy_reference.quantize_int8(np.nan_to_num(k), sdt)
    v, v_scale = numpy_reference.quantize_int8(np.nan_to_num(v), sdt)
  dt = jnp.dtype(case.dtype)
  kv_dt = jnp.int8 if case.kv_dtype == "int8" else dt
  return (jnp.asarray(q, dt), jnp.asarray(k, kv_dt), jnp.asarray(v, kv_dt), q_pos, k_pos,
          k_scale, v_scale)


def check(case, o, lse, o_ref, lse_ref, tol):
  o = np.asarray(jnp.asarray(o, jnp.float32))
  lse = np.asarray(lse)
  o_ref, lse_ref = np.asarray(o_ref, np.float64), np.asarray(lse_ref, np.float64)
  assert not np.isnan(o).any() and not np.isnan(lse).any()
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
  np.testing.assert_allclose(o, o_ref, atol=tol[0], rtol=tol[1])
  finite = ~np.isneginf(lse_ref)
  np.testing.assert_allclose(lse[finite], lse_ref[finite], atol=tol[0], rtol=tol[1])


def hybrid_decode_case(seed, fill, *, capacity):
  """A hybrid cache of ``fill`` cells (8-cell window and tiles, 40% of the tiles on the CPU),
  as a factory of fresh copies, and one decode step's ``attend`` arguments."""
  rng = np.random.default_rng(seed)
  k = jnp.asarray(rng.standard_normal((1, fill, 2, 16)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((1, fill, 2, 16)), jnp.float32)
  fresh = lambda: rkv.RollingKV.from_arrays(k, v, window_cells=8, tile_cells=8,
                                            capacity=capacity).with_tactic("hybrid", 0.4)
  q = jnp.asarray(rng.standard_normal((1, 1, 8, 16)), jnp.float32)
  new = jnp.asarray(rng.standard_normal((1, 1, 2, 16)), jnp.float32)
  return k, v, fresh, q, new, (q, new, new, jnp.full((1, 1), fill, jnp.int32))


def assert_same_attention(on, off, q, k, v, new, q_pos):
  """``on`` (a switch's path) equals ``off`` (the default path) and the reference over the
  cache's K/V with ``new`` appended."""
  np.testing.assert_allclose(np.asarray(on), np.asarray(off), rtol=1e-6, atol=1e-6)
  ref, _ = rkv.attention(q, jnp.concatenate([k, new], 1), jnp.concatenate([v, new], 1),
                         q_pos=q_pos, impl="reference")
  rtol, atol = TOLERANCES["float32"]["o"]
  np.testing.assert_allclose(np.asarray(on), np.asarray(ref), rtol=rtol, atol=atol)
