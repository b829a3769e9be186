"""RollingKV storage: appends and flushes, O(tile) writes, save/load, bad input.

A cache fed token by token (or chunk by chunk) must hold exactly the cells a resident cache fed
the same tokens holds — same K/V, same positions, same order — and attend to them identically.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rkv
from rkv import cache as cache_lib
from rkv.offload import memory
from tests import numpy_reference
from tests.rolling_attention_test import ROLLING_VS_RESIDENT, assert_kinds

B, K, D, H = 2, 2, 16, 4
TOL = ROLLING_VS_RESIDENT["float32"]


def tokens(s, seed=0, b=B):
  rng = np.random.default_rng(seed)
  k = rng.standard_normal((b, s, K, D)).astype(np.float32)
  v = rng.standard_normal((b, s, K, D)).astype(np.float32)
  return k, v


def assert_same_attention(kv, k, v, k_pos=None, t=1, k_scale=None, v_scale=None, seed=9):
  q = jnp.asarray(np.random.default_rng(seed).standard_normal((k.shape[0], t, H, D)), jnp.float32)
  o, lse = rkv.rolling_attention(q, kv, impl="xla")
  o_ref, lse_ref = rkv.attention(q, jnp.asarray(k), jnp.asarray(v), k_pos=k_pos, k_scale=k_scale,
                                 v_scale=v_scale, impl="reference")
  np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), atol=TOL[0], rtol=TOL[1])
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), atol=TOL[0], rtol=TOL[1])


def assert_cells(kv, k, v, pos=None):
  cells = kv.cells()
  np.testing.assert_array_equal(cells["k"], k)
  np.testing.assert_array_equal(cells["v"], v)
  if pos is None:
    pos = np.broadcast_to(np.arange(k.shape[1]), k.shape[:2])
  np.testing.assert_array_equal(cells["pos"], pos)


# ----------------------------------------------------------------------------------------------
# Appends across the window/tail boundary and across flushes
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunks", [
    [1] * 45,  # decode: token by token across the window, staging and three flushes
    [3, 7, 1, 20, 2, 9, 3],  # prefill chunks straddling the window edge and tile edges
    [5, 33, 7],  # a chunk holding two whole tiles skips the staging buffer
])
def test_appends_equal_resident(chunks):
  w, tile, cap = 6, 8, 48
  total = sum(chunks)
  k, v = tokens(total)
  kv = rkv.RollingKV.empty(B, cap, K, D, window_cells=w, dtype=jnp.float32, tile_cells=tile)
  assert_kinds(kv)
  n = 0
  for c in chunks:
    kv = kv.append(k[:, n:n + c], v[:, n:n + c])
    n += c
    assert kv.fill == n
    assert_kinds(kv)  # after every append and every flush
    assert kv.n_full_tiles == max(n - w, 0) // tile and kv.n_staged == max(n - w, 0) % tile
    if c > 1 or n % 11 == 0 or n == total:
      assert_cells(kv, k[:, :n], v[:, :n])
      assert_same_attention(kv, k[:, :n], v[:, :n])
  assert kv.n_full_tiles == (total - w) // tile


def test_append_into_prefilled_cache_and_explicit_positions():
  w, tile = 10, 8
  k, v = tokens(40, seed=1)
  pos = np.broadcast_to(np.arange(40, dtype=np.int32) + 100, (B, 40)).copy()
  pos[1, 30:] = -1  # row 1 is shorter: padding cells stay empty through flushes
  kv = rkv.RollingKV.from_arrays(k[:, :25], v[:, :25], window_cells=w, k_pos=pos[:, :25],
                                 capacity=64, tile_cells=tile)
  assert (kv.n_full_tiles, kv.n_staged, kv.n_tail_tiles) == (1, 7, 6)
  kv = kv.append(k[:, 25:26], v[:, 25:26], pos[:, 25:26])  # completes tile 1: a flush
  assert (kv.n_full_tiles, kv.n_staged) == (2, 0)
  kv = kv.append(k[:, 26:40], v[:, 26:40], pos[:, 26:40])
  assert_kinds(kv)
  assert_cells(kv, k, v, pos)
  assert_same_attention(kv, k, v, k_pos=pos, t=1)


def test_int8_appends_equal_int8_resident():
  w, tile = 5, 8
  k, v = tokens(30, seed=2)
  # Quantization is per (token, KV head), so quantizing the whole sequence at once is the
  # resident int8 cache the appends must reproduce bit for bit.
  kq, ks = (np.asarray(x) for x in cache_lib.quantize_int8(k))
  vq, vs = (np.asarray(x) for x in cache_lib.quantize_int8(v))
  kv = rkv.RollingKV.empty(B, 32, K, D, window_cells=w, dtype=jnp.int8, tile_cells=tile)
  for i in range(0, 30, 6):  # float in: the cache quantizes
    kv = kv.append(k[:, i:i + 6], v[:, i:i + 6])
  assert_kinds(kv)
  cells = kv.cells()
  assert cells["k"].dtype == np.int8
  np.testing.assert_array_equal(cells["k"], kq)
  np.testing.assert_array_equal(cells["v_scale"], vs)
  assert_same_attention(kv, jnp.asarray(kq), jnp.asarray(vq), k_scale=ks, v_scale=vs)
  # The same formula as the float64 suite's quantizer; XLA's float32 division on CPU is not
  # always correctly rounded, so scales may differ from numpy's by an ulp.
  k_np, ks_np = numpy_reference.quantize_int8(k)
  np.testing.assert_allclose(ks, ks_np, rtol=3e-7)
  assert np.abs(kq.astype(int) - k_np).max() <= 1
  # int8 in, with its scales, gives the same cache.
  kv2 = rkv.RollingKV.empty(B, 32, K, D, window_cells=w, dtype=jnp.int8, tile_cells=tile)
  kv2 = kv2.append(kq, vq, k_scale=ks, v_scale=vs)
  np.testing.assert_array_equal(kv2.cells()["k_scale"], ks)
  np.testing.assert_array_equal(kv2.cells()["v"], vq)


def test_bf16_cache_casts_float32_appends():
  k, v = tokens(12, seed=3)
  kv = rkv.RollingKV.empty(B, 16, K, D, window_cells=4, tile_cells=4)  # bf16 by default
  kv = kv.append(k, v)
  assert kv.dtype == jnp.bfloat16
  np.testing.assert_array_equal(kv.cells()["k"], np.asarray(jnp.asarray(k, jnp.bfloat16)))


# ----------------------------------------------------------------------------------------------
# Append cost does not grow with the tail
# ----------------------------------------------------------------------------------------------
def _flush_cost(n_tiles, tile=64):
  cap = n_tiles * tile
  kv = rkv.RollingKV.empty(1, cap, K, D, window_cells=0, dtype=jnp.float32, tile_cells=tile)
  compiled = cache_lib._write_tiles.lower(kv.tail, kv.staging, jnp.int32(0)).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return cost["bytes accessed"], compiled.as_text()


def test_flush_bytes_do_not_grow_with_the_tail():
  # A whole-tail copy would make these grow 16x; an in-place (aliased) write touches one tile.
  small, text = _flush_cost(4)
  large, _ = _flush_cost(64)
  assert "input_output_alias" in text
  if jax.default_backend() == "gpu":
    # XLA's GPU cost model charges a dynamic-update-slice the whole operand even when it is
    # aliased (seen on the H200: 99 KB vs 1.08 MB), so the byte count proves nothing there. The
    # pointer check below and the flat flush times of benchmarks/results/rolling_bench_h200.json
    # (3.2-3.5 ms at tails of 1 to 16 tiles) carry the claim on the GPU.
    return
  assert small == large
  tile_bytes = 64 * K * D * 4 * 2 + 64 * 4  # k + v + positions of one tile
  assert large <= 3 * tile_bytes


def test_flush_only_moves_host_data():
  # The tile is reshaped on the device, moved to host, and written: no compute on host memory.
  kv = rkv.RollingKV.empty(1, 64, K, D, window_cells=0, dtype=jnp.int8, tile_cells=16)
  jaxpr = jax.make_jaxpr(cache_lib._write_tiles)(kv.tail, kv.staging, jnp.int32(0))
  assert memory.host_compute_eqns(jaxpr) == []
  # The GPU program moves exactly the tile's k, v and scales to pinned host, nothing else.
  lowered = cache_lib._write_tiles.trace(kv.tail, kv.staging, jnp.int32(0)).lower(
      lowering_platforms=("cuda",))
  assert memory.placement_report(lowered.as_text()) == {"pinned_host": 4}
  # ... and every donated host array (k, v, 2 scales) is aliased to its output: in place.
  main = next(l for l in lowered.as_text().splitlines() if "func.func public @main" in l)
  assert main.count('mhlo.memory_kind = "pinned_host"') >= 4
  assert main.count("tf.aliasing_output") == 5  # k, v, k_scale, v_scale and the positions


def test_flush_writes_in_place_and_keeps_other_tiles():
  tile = 8
  k, v = tokens(40, seed=5, b=1)
  kv = rkv.RollingKV.empty(1, 40, K, D, window_cells=0, dtype=jnp.float32, tile_cells=tile)
  kv = kv.append(k[:, :16], v[:, :16])  # two tiles flushed
  ptr = kv.tail.k.unsafe_buffer_pointer()
  before = np.asarray(kv.tail.k).copy()
  kv = kv.append(k[:, 16:24], v[:, 16:24])  # one more flush, into tile 2
  assert kv.tail.k.unsafe_buffer_pointer() == ptr, "the flush copied the tail"
  after = np.asarray(kv.tail.k)
  np.testing.assert_array_equal(after[:2], before[:2])
  np.testing.assert_array_equal(after[2, 0], k[0, 16:24])
  np.testing.assert_array_equal(after[3:], before[3:])
  assert_kinds(kv)


def test_decode_append_touches_no_tail_bytes():
  # A one-token append that does not flush never passes the tail to any computation.
  k, v = tokens(20, seed=6, b=1)
  kv = rkv.RollingKV.from_arrays(k[:, :13], v[:, :13], window_cells=4, capacity=40, tile_cells=8)
  tail_k = kv.tail.k
  kv = kv.append(k[:, 13:14], v[:, 13:14])
  assert kv.tail.k is tail_k and not tail_k.is_deleted()


# ----------------------------------------------------------------------------------------------
# Save / load
# ----------------------------------------------------------------------------------------------
def _saved(tmp_path, dtype=jnp.float32, s=37):
  k, v = tokens(s, seed=7)
  pos = np.broadcast_to(np.arange(s, dtype=np.int32), (B, s)).copy()
  pos[0, 3] = -1
  kv = rkv.RollingKV.from_arrays(k, v, window_cells=9, k_pos=pos, capacity=50, tile_cells=8,
                                 dtype=dtype)
  rkv.cache.save(kv, str(tmp_path))
  return kv, k, v, pos


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8, jnp.bfloat16])
def test_save_load_same_attention(tmp_path, dtype):
  kv, *_ = _saved(tmp_path, dtype)
  loaded = rkv.cache.load(str(tmp_path))
  assert_kinds(loaded)
  assert (loaded.window_cells, loaded.capacity, loaded.tile_cells, loaded.fill) == (9, 50, 8, 37)
  assert loaded.dtype == kv.dtype
  for name, x in kv.cells().items():
    if x is not None:
      np.testing.assert_array_equal(loaded.cells()[name], x)
  q = jnp.asarray(np.random.default_rng(0).standard_normal((B, 2, H, D)), jnp.float32)
  o1, l1 = rkv.rolling_attention(q, kv, impl="xla")
  o2, l2 = rkv.rolling_attention(q, loaded, impl="xla")
  np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
  np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))
  manifest = json.load(open(os.path.join(tmp_path, "manifest.json")))
  assert manifest["format"] == "rkv.RollingKV" and manifest["version"] == 1
  assert {"window_cells", "capacity", "tile_cells", "dtype", "positions"} <= set(manifest)
  assert all({"bytes", "crc32", "shape"} <= set(a) for a in manifest["arrays"].values())


@pytest.mark.parametrize("w", [0, 20, 50])
def test_load_with_another_window_resplits(tmp_path, w):
  kv, k, v, pos = _saved(tmp_path)
  loaded = rkv.cache.load(str(tmp_path), window_cells=w)
  assert loaded.window_cells == w and loaded.window.k.shape[1] == w
  assert loaded.n_full_tiles == max(37 - w, 0) // 8
  assert_kinds(loaded)
  assert_cells(loaded, k, v, pos)
  assert_same_attention(loaded, k, v, k_pos=pos, t=3)
  loaded = loaded.append(*tokens(13, seed=8))  # and it keeps decoding up to its capacity
  assert loaded.fill == 50


def test_load_rejects_truncated_file(tmp_path):
  _saved(tmp_path)
  path = os.path.join(tmp_path, "v.bin")
  data = open(path, "rb").read()
  open(path, "wb").write(data[:-7])
  with pytest.raises(ValueError, match="v.bin.*truncated"):
    rkv.cache.load(str(tmp_path))


def test_load_rejects_foreign_file_of_the_right_size(tmp_path):
  _saved(tmp_path)
  path = os.path.join(tmp_path, "k.bin")
  n = os.path.getsize(path)
  open(path, "wb").write(np.random.default_rng(0).bytes(n))
  with pytest.raises(ValueError, match="k.bin.*CRC"):
    rkv.cache.load(str(tmp_path))


def test_load_rejects_foreign_manifest(tmp_path):
  with pytest.raises(ValueError, match="manifest"):
    rkv.cache.load(str(tmp_path))  # no manifest at all
  open(os.path.join(tmp_path, "manifest.json"), "w").write("\x00garbage")
  with pytest.raises(ValueError, match="JSON"):
    rkv.cache.load(str(tmp_path))
  json.dump({"format": "safetensors"}, open(os.path.join(tmp_path, "manifest.json"), "w"))
  with pytest.raises(ValueError, match="format"):
    rkv.cache.load(str(tmp_path))
  _saved(tmp_path)
  manifest = json.load(open(os.path.join(tmp_path, "manifest.json")))
  manifest["version"] = 99
  json.dump(manifest, open(os.path.join(tmp_path, "manifest.json"), "w"))
  with pytest.raises(ValueError, match="version"):
    rkv.cache.load(str(tmp_path))


def test_load_into_too_large_window(tmp_path):
  _saved(tmp_path)
  with pytest.raises(ValueError, match="window_cells"):
    rkv.cache.load(str(tmp_path), window_cells=51)


# ----------------------------------------------------------------------------------------------
# Bad input names the argument
# ----------------------------------------------------------------------------------------------
def _from(**kw):
  k, v = tokens(10)
  args = dict(k=k, v=v, window_cells=4, tile_cells=4)
  args.update(kw)
  return rkv.RollingKV.from_arrays(args.pop("k"), args.pop("v"), **args)


BAD_FROM = [
    ("window_cells", dict(window_cells=11)),  # larger than capacity (= S)
    ("window_cells", dict(window_cells=-1)),
    ("capacity", dict(capacity=5)),  # fewer cells than k holds
    ("tile_cells", dict(tile_cells=0)),
    ("v shape", dict(v=np.zeros((B, 9, K, D), np.float32))),
    ("v dtype", dict(v=np.zeros((B, 10, K, D), np.float16))),
    ("k_pos", dict(k_pos=np.zeros((B, 9), np.int32))),
    ("k_pos", dict(k_pos=np.full((B, 10), -2, np.int32))),  # out of range
    ("k_pos", dict(k_pos=np.zeros((B, 10), np.float32))),
    ("k_scale", dict(k=np.zeros((B, 10, K, D), np.int8), v=np.zeros((B, 10, K, D), np.int8))),
    ("dtype", dict(dtype=jnp.int32)),
]


@pytest.mark.parametrize("name,kw", BAD_FROM, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_FROM)])
def test_from_arrays_bad_input(name, kw):
  with pytest.raises(ValueError, match=name):
    _from(**kw)


def test_append_bad_input():
  kv = rkv.RollingKV.empty(B, 12, K, D, window_cells=4, dtype=jnp.float32, tile_cells=4)
  k, v = tokens(13)
  with pytest.raises(ValueError, match="capacity"):
    kv.append(k, v)  # 13 cells into a capacity of 12
  with pytest.raises(ValueError, match="k must have shape"):
    kv.append(k[:1, :2], v[:1, :2])
  with pytest.raises(ValueError, match="v shape"):
    kv.append(k[:, :2], v[:, :3])
  with pytest.raises(ValueError, match="pos"):
    kv.append(k[:, :2], v[:, :2], pos=np.zeros((B, 3), np.int32))
  with pytest.raises(ValueError, match="pos"):
    kv.append(k[:, :2], v[:, :2], pos=np.full((B, 2), -5, np.int32))
  with pytest.raises(ValueError, match="int8"):
    kv.append(k[:, :2].astype(np.int8), v[:, :2].astype(np.int8),
              k_scale=np.ones((B, 2, K), np.float32), v_scale=np.ones((B, 2, K), np.float32))
  kv = kv.append(k[:, :12], v[:, :12])
  with pytest.raises(ValueError, match="capacity"):
    kv.append(k[:, :1], v[:, :1])  # full


def test_empty_bad_input():
  with pytest.raises(ValueError, match="window_cells"):
    rkv.RollingKV.empty(1, 8, K, D, window_cells=9)
  with pytest.raises(ValueError, match="num_kv_heads"):
    rkv.RollingKV.empty(1, 8, 0, D, window_cells=4)
  with pytest.raises(ValueError, match="capacity"):
    rkv.RollingKV.empty(1, 0, K, D, window_cells=0)


def test_tail_beyond_the_pinned_host_pool(monkeypatch):
  # 20M cells x 4 KiB (bf16, K=8, D=128) = 80 GiB of tail: refused before anything is allocated,
  # with the env var the user must set.
  monkeypatch.delenv(memory.HOST_POOL_ENV, raising=False)
  with pytest.raises(ValueError, match=f"capacity.*{memory.HOST_POOL_ENV}=81"):
    rkv.RollingKV.empty(1, 20 * 2**20, 8, 128, window_cells=0)
  monkeypatch.setenv(memory.HOST_POOL_ENV, "0.0001")  # ~107 KB
  with pytest.raises(ValueError, match=memory.HOST_POOL_ENV):
    rkv.RollingKV.empty(1, 64, 8, 128, window_cells=0, tile_cells=8)
  monkeypatch.setenv(memory.HOST_POOL_ENV, "1")  # enough
  rkv.RollingKV.empty(1, 64, 8, 128, window_cells=0, tile_cells=8)


def test_cache_is_a_pytree():
  kv = rkv.RollingKV.empty(1, 24, K, D, window_cells=4, dtype=jnp.float32, tile_cells=8)
  leaves, tree = jax.tree.flatten(kv)
  assert len(leaves) == 9  # window, staging, tail x (k, v, pos)
  again = jax.tree.unflatten(tree, leaves)
  assert again.fill == kv.fill and again.window_cells == 4
