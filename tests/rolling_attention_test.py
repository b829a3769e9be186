"""Rolling (window + staging + streamed host tail) attention equals resident attention.

Every case builds a ``RollingKV`` from the same cells a resident call sees and compares
``rkv.rolling_attention`` against ``rkv.attention(..., impl="reference")`` on the whole arrays
and against the float64 NumPy reference, with the suite's named tolerances. Both stream schedules
(``"eager"``: per-tile eager transfers and dispatches, ``"unrolled"``: one jitted program) run;
memory kinds are asserted on every cache the tests build: every tail tile's K/V in pinned_host.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rkv
from rkv import rolling
from rkv.offload import memory
from rkv.offload import stream
from tests import numpy_reference
from tests.support import attention_cases
from tests.support.rolling_cases import Case, assert_kinds, check, make
from tests.support.tolerances import ROLLING_VS_RESIDENT, TOLERANCES

CASES = [
    Case("w0_all_tail", window_cells=0),
    Case("w_capacity_resident", window_cells=75),
    Case("w_between_tail_not_tile_multiple"),
    Case("tail_exact_tiles", s=84, window_cells=20),  # 64 tail cells = 4 whole tiles, no staging
    Case("tail_smaller_than_tile", s=30, window_cells=20),  # everything past W stays staged
    Case("gqa8_softcap", h=8, k=1, softcap=5.0),
    Case("sliding_window", window=23, t=3),
    Case("chunk_query_explicit_q_pos", t=9, positions="chunk"),
    Case("noncausal_chunk", t=6, causal=False),
    Case("holes_nan_in_tail", t=2, positions="holes"),
    Case("ragged_batch", b=2, t=1, positions="ragged"),
    Case("int8", t=2, kv_dtype="int8"),
    Case("int8_bf16_scales_holes", t=2, kv_dtype="int8", scale_dtype="bfloat16", positions="holes"),
    Case("bf16_d48", dtype="bfloat16", d=48),
]


@pytest.mark.parametrize("schedule", ["eager", "unrolled"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_rolling_equals_resident(case, schedule):
  q, k, v, q_pos, k_pos, k_scale, v_scale = make(case)
  kv = rkv.RollingKV.from_arrays(k, v, window_cells=case.window_cells, k_pos=k_pos,
                                 k_scale=k_scale, v_scale=v_scale, tile_cells=case.tile)
  assert_kinds(kv)
  assert kv.fill == case.s and kv.window.k.shape[1] == case.window_cells
  kw = dict(q_pos=q_pos, causal=case.causal, window=case.window, softcap=case.softcap)
  o, lse = rkv.rolling_attention(q, kv, impl="xla", schedule=schedule, **kw)
  assert o.shape == q.shape and o.dtype == q.dtype and lse.dtype == jnp.float32
  ref = rkv.attention(q, k, v, k_pos=k_pos, k_scale=k_scale, v_scale=v_scale, impl="reference",
                      **kw)
  check(case, o, lse, *ref, ROLLING_VS_RESIDENT[case.dtype])
  # ... and the float64 ground truth, at the suite's named tolerances.
  o64, lse64 = numpy_reference.attention(
      np.asarray(q.astype(jnp.float32)), np.asarray(k.astype(jnp.float32)),
      np.asarray(v.astype(jnp.float32)), q_pos, k_pos, causal=case.causal, window=case.window,
      softcap=case.softcap, k_scale=k_scale, v_scale=v_scale)
  check(case, o, lse, o64, lse64, TOLERANCES[case.dtype]["o"])
  assert_kinds(kv)  # attention moved tiles, never the cache


@pytest.mark.parametrize("case", attention_cases.CASES, ids=str)
def test_shared_suite_cases(case):
  # The shared attention suite's cases (holes with NaN, rows that see nothing, ragged batches,
  # int8, 16-bit, d=80/96/256, GQA 1/4/8) through the streamed tactic: a third of the cells in
  # the window, the rest in three or more host tiles (plus a staged remainder for most cases).
  q, k, v, q_pos, k_pos, k_scale, v_scale = attention_cases.make_inputs(case)
  qj, kj, vj = attention_cases.to_jax(case, q, k, v)
  w = case.s // 3
  kv = rkv.RollingKV.from_arrays(kj, vj, window_cells=w, k_pos=k_pos, k_scale=k_scale,
                                 v_scale=v_scale, tile_cells=(case.s - w - 1) // 3)
  assert kv.n_full_tiles >= 3
  assert_kinds(kv)
  o, lse = rkv.rolling_attention(qj, kv, q_pos=q_pos, causal=case.causal, window=case.window,
                                 softcap=case.softcap, scale=case.scale, impl="xla")
  attention_cases.assert_close(case, o, lse, *attention_cases.expected(case, qj, kj, vj, q_pos,
                                                                      k_pos, k_scale, v_scale))


def test_resident_path_when_window_holds_everything():
  case = Case("resident", window_cells=75)
  q, k, v, *_ = make(case)
  kv = rkv.RollingKV.from_arrays(k, v, window_cells=75, tile_cells=16)
  assert kv.n_tail_tiles == 0 and kv.tail.k == () and kv.staging.k.shape[1] == 0
  o, lse = rkv.rolling_attention(q, kv, impl="xla")
  o_res, lse_res = rkv.attention(q, k, v, impl="xla")
  np.testing.assert_array_equal(np.asarray(o), np.asarray(o_res))  # same code path, bit-equal
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_res))


# 9 >= the 3 tiles and None: every transfer issued up front
@pytest.mark.parametrize("lookahead", [1, 2, 9, None])
@pytest.mark.parametrize("schedule", ["eager", "unrolled"])
def test_lookahead_depths(schedule, lookahead):
  case = Case("lookahead", s=70, window_cells=10, tile=16, t=2)
  q, k, v, *_ = make(case, seed=2)
  kv = rkv.RollingKV.from_arrays(k, v, window_cells=10, tile_cells=16)
  o, lse = rkv.rolling_attention(q, kv, impl="xla", schedule=schedule, lookahead=lookahead)
  check(case, o, lse, *rkv.attention(q, k, v, impl="reference"), ROLLING_VS_RESIDENT["float32"])


def test_empty_cache_sees_nothing():
  kv = rkv.RollingKV.empty(1, 40, 2, 16, window_cells=8, dtype=jnp.float32, tile_cells=8)
  q = jnp.ones((1, 1, 4, 16))
  o, lse = rkv.rolling_attention(q, kv, q_pos=jnp.zeros((1, 1), jnp.int32), impl="xla")
  assert (np.asarray(o) == 0).all() and np.isneginf(np.asarray(lse)).all()


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_no_compute_on_host_data(kv_dtype):
  # docs/DESIGN.md §5: only data movement may touch the host tail inside a program; a cast or
  # dequantize there would run on the host CPU. The int8 tail must be dequantized on the device.
  # (make_jaxpr traces, so rolling_attention runs its in-jit "unrolled" schedule here.)
  case = Case("hostcheck", kv_dtype=kv_dtype)
  q, k, v, q_pos, k_pos, k_scale, v_scale = make(case)
  kv = rkv.RollingKV.from_arrays(k, v, window_cells=20, k_scale=k_scale, v_scale=v_scale,
                                 tile_cells=16)
  jaxpr = jax.make_jaxpr(lambda q, kv: rkv.rolling_attention(q, kv, impl="xla"))(q, kv)
  assert memory.host_compute_eqns(jaxpr) == []
  report = memory.hlo_report(rkv.rolling.lower(q, kv, impl="xla", schedule="unrolled")
                             .compile().as_text())
  # k, v (+ scales) of each of the 3 full tiles enter as host arrays, the empty tile does not.
  assert kv.n_full_tiles == 3
  assert report["host_params"] == 3 * (4 if kv_dtype else 2)
  assert report["host_compute"] == 0


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@pytest.mark.parametrize("lookahead", [1, None])
def test_gpu_lowering_moves_every_tile(lookahead, kv_dtype):
  # A CPU compile has no placement ops (one memory); lowering for CUDA shows the GPU program of
  # the unrolled schedule: one device placement per streamed array (k, v, + 2 scales) per tile.
  case = Case("lowering", s=84, window_cells=20, tile=16, kv_dtype=kv_dtype)  # 4 whole tiles
  q, k, v, q_pos, k_pos, k_scale, v_scale = make(case)
  kv = rkv.RollingKV.from_arrays(k, v, window_cells=20, k_scale=k_scale, v_scale=v_scale,
                                 tile_cells=16)
  text = rkv.rolling.lower(q, kv, impl="xla", schedule="unrolled", lookahead=lookahead,
                           platforms=("cuda",)).as_text()
  arrays = 4 if kv_dtype else 2
  assert memory.placement_report(text) == {"device": arrays * kv.n_full_tiles}


# ----------------------------------------------------------------------------------------------
# The eager schedule: issue order, flow control, device-only programs, one tile program
# ----------------------------------------------------------------------------------------------
def _spy_eager(monkeypatch):
  """Logs the eager schedule's transfers, partial dispatches and host waits, in order."""
  log = []
  put, part, wait = stream.put_eager, rolling._partial_jit, stream._wait

  def spy_put(tile, device=None):
    log.append(("put", int(tile.pos[0, 0])))
    assert memory.memory_kind(tile.k) == memory.PINNED_HOST
    return put(tile, device)

  many = stream.put_many_eager

  def spy_many(tiles, device=None):  # the first lookahead tiles go out in one call
    for tile in tiles:
      log.append(("put", int(tile.pos[0, 0])))
      assert memory.memory_kind(tile.k) == memory.PINNED_HOST
    return many(tiles, device)

  def spy_partial(q, q_pos, block, **kw):
    # Every program the eager schedule dispatches sees device arrays only.
    for x in jax.tree.leaves(block):
      assert memory.memory_kind(x) == memory.DEVICE
    log.append(("attend", int(block.pos[0, 0]), block.k.shape[1]))
    return part(q, q_pos, block, **kw)

  pair = rolling._partial_pair_jit

  def spy_pair(q, q_pos, first, second, **kw):
    # The window's and the staging's partials, one dispatch: logged as two, in that order.
    for block in (first, second):
      for x in jax.tree.leaves(block):
        assert memory.memory_kind(x) == memory.DEVICE
      log.append(("attend", int(block.pos[0, 0]), block.k.shape[1]))
    return pair(q, q_pos, first, second, **kw)

  def spy_wait(partial):
    log.append(("wait",))
    wait(partial)

  monkeypatch.setattr(stream, "put_eager", spy_put)
  monkeypatch.setattr(stream, "put_many_eager", spy_many)
  monkeypatch.setattr(rolling, "_partial_jit", spy_partial)
  monkeypatch.setattr(rolling, "_partial_pair_jit", spy_pair)
  monkeypatch.setattr(stream, "_wait", spy_wait)
  return log


@pytest.mark.parametrize("lookahead", [2, None])
def test_eager_issue_order(monkeypatch, lookahead):
  # W=10, four 16-cell tiles (starting at 10, 26, 42, 58), 6 staged cells (74..79).
  case = Case("order", s=80, window_cells=10, tile=16)
  q, k, v, *_ = make(case, seed=3)
  kv = rkv.RollingKV.from_arrays(k, v, window_cells=10, tile_cells=16)
  log = _spy_eager(monkeypatch)
  o, lse = rkv.rolling_attention(q, kv, impl="xla", lookahead=lookahead)  # eager is the default
  window, staging = ("attend", 0, 10), ("attend", 74, 16)
  tile = lambda i: ("attend", 10 + 16 * i, 16)
  put = lambda i: ("put", 10 + 16 * i)
  if lookahead == 2:
    # The first two transfers go out before the window/staging partials; tile i + 2 is requested
    # before tile i is attended, after the host waited for tile i - 1.
    assert log == [put(0), put(1), window, staging, put(2), tile(0), ("wait",), put(3), tile(1),
                   tile(2), tile(3)]
  else:
    # Every transfer up front, no host wait.
    assert log == [put(0), put(1), put(2), put(3), window, staging, tile(0), tile(1), tile(2),
                   tile(3)]
  check(case, o, lse, *rkv.attention(q, k, v, impl="reference"), ROLLING_VS_RESIDENT["float32"])
  assert_kinds(kv)


def test_eager_compiles_one_tile_program():
  # Every tile (and the staging tile, same shape) reuses one compiled partial: a cache with more
  # tiles adds no compilation of it. (d=24 appears in no other test, so the count is ours.)
  case = Case("compile", s=90, window_cells=10, tile=16, d=24)
  q, k, v, *_ = make(case, seed=5)
  before = rolling._partial_jit._cache_size()
  pairs = rolling._partial_pair_jit._cache_size()
  small = rkv.RollingKV.from_arrays(k[:, :50], v[:, :50], window_cells=10, tile_cells=16)
  rkv.rolling_attention(q, small, impl="xla")  # 2 tiles + 8 staged cells
  assert rolling._partial_jit._cache_size() == before + 1  # the tile's
  assert rolling._partial_pair_jit._cache_size() == pairs + 1  # the window's with the staging's
  large = rkv.RollingKV.from_arrays(k, v, window_cells=10, tile_cells=16)
  o, lse = rkv.rolling_attention(q, large, impl="xla")  # 5 tiles, nothing staged
  assert rolling._partial_jit._cache_size() == before + 2  # + the window's alone, not a tile's
  assert rolling._partial_pair_jit._cache_size() == pairs + 1
  check(case, o, lse, *rkv.attention(q, k, v, impl="reference"), ROLLING_VS_RESIDENT["float32"])


def test_eager_falls_back_to_unrolled_under_jit(monkeypatch):
  case = Case("jit", s=70, window_cells=10, tile=16, t=2)
  q, k, v, *_ = make(case, seed=6)
  kv = rkv.RollingKV.from_arrays(k, v, window_cells=10, tile_cells=16)
  log = _spy_eager(monkeypatch)
  o, lse = jax.jit(lambda q, kv: rkv.rolling_attention(q, kv, impl="xla"))(q, kv)
  assert log == []  # no eager transfer or dispatch happened: the in-jit schedule ran
  check(case, o, lse, *rkv.attention(q, k, v, impl="reference"), ROLLING_VS_RESIDENT["float32"])


def test_lower_refuses_eager():
  kv = rkv.RollingKV.empty(1, 40, 2, 16, window_cells=8, dtype=jnp.float32, tile_cells=8)
  with pytest.raises(ValueError, match="schedule"):
    rkv.rolling.lower(jnp.ones((1, 1, 4, 16)), kv, schedule="eager")


def test_host_compute_check_catches_a_cast_on_host():
  host = memory.to_host(np.zeros((2, 4, 8), np.float32))
  bad = lambda x: jax.device_put(x[0].astype(jnp.bfloat16), jax.memory.Space.Device)
  good = lambda x: jax.device_put(x[0], jax.memory.Space.Device).astype(jnp.bfloat16)
  assert memory.host_compute_eqns(jax.make_jaxpr(bad)(host)) == ["convert_element_type"]
  assert memory.host_compute_eqns(jax.make_jaxpr(good)(host)) == []


_GPU_LIKE_HLO = """HloModule m, entry_computation_layout={(bf16[4,1,64,8,128]{4,3,2,1,0:S(5)}, s32[])->bf16[1,64,8,128]{3,2,1,0}}

ENTRY %main (p0: bf16[4,1,64,8,128], i: s32[]) -> bf16[1,64,8,128] {
  %p0 = bf16[4,1,64,8,128]{4,3,2,1,0:S(5)} parameter(0)
  %i = s32[] parameter(1)
  %dynamic-slice-start.1 = ((bf16[4,1,64,8,128]{4,3,2,1,0:S(5)}, s32[], s32[], s32[], s32[], s32[]), bf16[1,1,64,8,128]{4,3,2,1,0}, u32[]) dynamic-slice-start(%p0, %i, %i, %i, %i, %i), dynamic_slice_sizes={1,1,64,8,128}
  %dynamic-slice-done.1 = bf16[1,1,64,8,128]{4,3,2,1,0} dynamic-slice-done(%dynamic-slice-start.1)
  %copy-start.2 = (bf16[4,1,64,8,128]{4,3,2,1,0:S(5)}, bf16[4,1,64,8,128]{4,3,2,1,0}, u32[]) copy-start(%p0)
  %copy-done.2 = bf16[4,1,64,8,128]{4,3,2,1,0} copy-done(%copy-start.2)
  %copy-start.3 = (bf16[4,1,64,8,128]{4,3,2,1,0}, bf16[4,1,64,8,128]{4,3,2,1,0:S(5)}, u32[]) copy-start(%copy-done.2)
  %copy.4 = bf16[4,1,64,8,128]{4,3,2,1,0} copy(%p0)
  %convert.5 = f32[4,1,64,8,128]{4,3,2,1,0:S(5)} convert(%p0), frontend_attributes={_xla_compute_type="host"}
  ROOT %bitcast.6 = bf16[1,64,8,128]{3,2,1,0} bitcast(%dynamic-slice-done.1)
}
"""


def test_hlo_report_counts_transfers():
  rep = memory.hlo_report(_GPU_LIKE_HLO)
  assert rep["h2d_async"] == 2  # the dynamic-slice-start and the host→device copy-start
  assert rep["d2h_async"] == 1
  assert rep["h2d_sync"] == 1
  assert rep["host_params"] == 1
  assert rep["host_compute"] == 1
  assert rep["async_ops"] == {"dynamic-slice-start": 1, "copy-start": 2}


def test_pallas_partials_match():
  # One interpret-mode run of the Pallas backends through the streamed program (slow on CPU).
  case = Case("pallas", s=60, window_cells=12, tile=16, t=1)
  q, k, v, *_ = make(case, seed=4)
  kv = rkv.RollingKV.from_arrays(k, v, window_cells=12, tile_cells=16)
  o, lse = rkv.rolling_attention(q, kv, impl="pallas")  # the default eager schedule
  check(case, o, lse, *rkv.attention(q, k, v, impl="reference"), TOLERANCES["float32"]["o"])


BAD = [
    ("tactic", dict(tactic="gpu")),
    ("schedule", dict(schedule="pipelined")),
    ("schedule", dict(schedule="scan")),  # gone with the stacked tail
    ("lookahead", dict(lookahead=0)),
    ("lookahead", dict(lookahead=2.0)),
    ("impl", dict(impl="cuda")),
    ("window", dict(window=0)),
    ("q_pos", dict(q_pos=jnp.zeros((1, 3), jnp.int32))),
]


@pytest.mark.parametrize("name,kw", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_arguments_name_themselves(name, kw):
  kv = rkv.RollingKV.empty(1, 40, 2, 16, window_cells=8, dtype=jnp.float32, tile_cells=8)
  with pytest.raises(ValueError, match=name):
    rkv.rolling_attention(jnp.ones((1, 1, 4, 16)), kv, **kw)


def test_bad_tactic_lists_the_valid_ones():
  kv = rkv.RollingKV.empty(1, 40, 2, 16, window_cells=8, dtype=jnp.float32, tile_cells=8)
  with pytest.raises(ValueError, match=r"\('auto', 'stream', 'cpu', 'hybrid', 'head'\)"):
    rkv.rolling_attention(jnp.ones((1, 1, 4, 16)), kv, tactic="gpu")


def test_query_shape_mismatch():
  kv = rkv.RollingKV.empty(1, 40, 2, 16, window_cells=8, dtype=jnp.float32, tile_cells=8)
  with pytest.raises(ValueError, match="head dim"):
    rkv.rolling_attention(jnp.ones((1, 1, 4, 32)), kv)
  with pytest.raises(ValueError, match="multiple of kv heads"):
    rkv.rolling_attention(jnp.ones((1, 1, 3, 16)), kv)
