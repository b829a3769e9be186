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
from tests.support.rolling_cases import assert_kinds
from tests.support.tolerances import ROLLING_VS_RESIDENT

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


@pytest.mark.parametrize("scale_dtype", [None, "float32"])  # None: the default, bfloat16
def test_int8_appends_equal_int8_resident(scale_dtype):
  w, tile = 5, 8
  sdt = np.dtype(jnp.bfloat16 if scale_dtype is None else scale_dtype)
  k, v = tokens(30, seed=2)
  # Quantization is per (token, KV head), so quantizing the whole sequence at once is the
  # resident int8 cache the appends must reproduce bit for bit.
  kq, ks = (np.asarray(x) for x in cache_lib.quantize_int8(k, sdt))
  vq, vs = (np.asarray(x) for x in cache_lib.quantize_int8(v, sdt))
  assert ks.dtype == sdt
  kv = rkv.RollingKV.empty(B, 32, K, D, window_cells=w, dtype=jnp.int8, tile_cells=tile,
                           scale_dtype=scale_dtype)
  assert kv.scale_dtype == sdt
  for i in range(0, 30, 6):  # float in: the cache quantizes
    kv = kv.append(k[:, i:i + 6], v[:, i:i + 6])
  assert_kinds(kv)
  cells = kv.cells()
  assert cells["k"].dtype == np.int8 and cells["k_scale"].dtype == sdt
  np.testing.assert_array_equal(cells["k"], kq)
  np.testing.assert_array_equal(cells["v_scale"], vs)
  assert_same_attention(kv, jnp.asarray(kq), jnp.asarray(vq), k_scale=ks, v_scale=vs)
  # The same formula as the float64 suite's quantizer; XLA's float32 division on CPU is not
  # always correctly rounded, so scales may differ from numpy's by an ulp (of the scale's dtype).
  k_np, ks_np = numpy_reference.quantize_int8(k, sdt)
  assert ks_np.dtype == sdt
  np.testing.assert_allclose(ks.astype(np.float32), ks_np.astype(np.float32),
                             rtol=3e-7 if sdt == np.float32 else 2 ** -7)
  assert np.abs(kq.astype(int) - k_np).max() <= 1
  # Within half a step of the float cells (the rounded scale is the one quantized against).
  err = np.abs(kq.astype(np.float64) * ks.astype(np.float64)[..., None] - k)
  assert (err <= 0.5 * ks.astype(np.float64)[..., None] * (1 + 1e-6)).all()
  # int8 in, with its scales, gives the same cache.
  kv2 = rkv.RollingKV.empty(B, 32, K, D, window_cells=w, dtype=jnp.int8, tile_cells=tile,
                            scale_dtype=scale_dtype)
  kv2 = kv2.append(kq, vq, k_scale=ks, v_scale=vs)
  np.testing.assert_array_equal(kv2.cells()["k_scale"], ks)
  np.testing.assert_array_equal(kv2.cells()["v"], vq)


def test_int8_scale_dtypes():
  k, v = tokens(12, seed=4)
  kq, ks = (np.asarray(x) for x in cache_lib.quantize_int8(k))  # float32 scales
  vq, vs = (np.asarray(x) for x in cache_lib.quantize_int8(v))
  # Given float32 scales stay float32 (rounding them would pair the int8 cells with other
  # scales); given bfloat16 ones stay bfloat16; float K/V quantize to the default, bfloat16.
  kv = rkv.RollingKV.from_arrays(kq, vq, k_scale=ks, v_scale=vs, window_cells=4, tile_cells=4)
  assert kv.scale_dtype == np.float32
  np.testing.assert_array_equal(kv.cells()["k_scale"], ks)
  b16 = ks.astype(jnp.bfloat16)
  kv = rkv.RollingKV.from_arrays(kq, vq, k_scale=b16, v_scale=vs.astype(jnp.bfloat16),
                                 window_cells=4, tile_cells=4)
  assert kv.scale_dtype == jnp.bfloat16
  kv = rkv.RollingKV.from_arrays(k, v, window_cells=4, tile_cells=4, dtype=jnp.int8)
  assert kv.scale_dtype == jnp.bfloat16 and kv.tail.k_scale[0].dtype == jnp.bfloat16
  kv = rkv.RollingKV.from_arrays(k, v, window_cells=4, tile_cells=4, dtype=jnp.int8,
                                 scale_dtype="float32")
  np.testing.assert_array_equal(kv.cells()["k_scale"], ks)
  # float32 scales into a bfloat16 cache are refused, not rounded; bfloat16 into float32 widen.
  empty = lambda sd: rkv.RollingKV.empty(B, 16, K, D, window_cells=4, dtype=jnp.int8,
                                         tile_cells=4, scale_dtype=sd)
  with pytest.raises(ValueError, match="float32 but this cache holds bfloat16"):
    empty(None).append(kq, vq, k_scale=ks, v_scale=vs)
  with pytest.raises(ValueError, match="share one dtype"):
    empty("float32").append(kq, vq, k_scale=ks, v_scale=vs.astype(jnp.bfloat16))
  got = empty("float32").append(kq, vq, k_scale=b16, v_scale=vs.astype(jnp.bfloat16))
  np.testing.assert_array_equal(got.cells()["k_scale"], b16.astype(np.float32))
  with pytest.raises(ValueError, match="scale_dtype must be one of"):
    empty("float16")
  with pytest.raises(ValueError, match="only valid for an int8 cache"):
    rkv.RollingKV.empty(B, 16, K, D, window_cells=4, scale_dtype="float32")


def test_int8_decode_append_is_one_program(monkeypatch):
  # A token into the window, into the staging tile, and the one that fills (and flushes) it: each
  # quantized and written by _write_quantized alone, the cells those of the general path.
  k, v = tokens(12, seed=6, b=1)
  calls = []
  for name in ("_write_cells", "quantize_pair", "_write_quantized"):
    fn = getattr(cache_lib, name)
    monkeypatch.setattr(cache_lib, name, lambda *a, _f=fn, _n=name, **kw: (calls.append(_n),
                                                                          _f(*a, **kw))[1])
  kv = rkv.RollingKV.empty(1, 12, K, D, window_cells=3, dtype=jnp.int8, tile_cells=4)
  for i in range(11):
    kv = kv.append(k[:, i:i + 1], v[:, i:i + 1])
  assert calls == ["_write_quantized"] * 11 and kv.n_full_tiles == 2 and kv.n_staged == 0
  kq, ks = (np.asarray(x) for x in cache_lib.quantize_int8(k[:, :11], jnp.bfloat16))
  np.testing.assert_array_equal(kv.cells()["k"], kq)  # per token: the same cells bit for bit
  np.testing.assert_array_equal(kv.cells()["k_scale"], ks)
  assert_kinds(kv)


def test_layers_appending_at_one_offset_share_one_device_scalar(monkeypatch):
  # Every layer of a decode step writes at the same cell offset: the writers get one device
  # scalar for it (one host-to-device transfer a step, not one a layer), the same cells as the
  # general path; under a trace the kept scalar is concrete, never a tracer.
  seen = []
  real = cache_lib._write_quantized
  monkeypatch.setattr(cache_lib, "_write_quantized",
                      lambda block, k, v, pos, offset, **kw: (seen.append(offset),
                                                              real(block, k, v, pos, offset,
                                                                   **kw))[1])
  k, v = tokens(6, seed=8, b=1)
  layers = [rkv.RollingKV.empty(1, 8, K, D, window_cells=3, dtype=jnp.int8, tile_cells=4)
            for _ in range(3)]
  for i in range(6):
    layers = [kv.append(k[:, i:i + 1], v[:, i:i + 1]) for kv in layers]
    step = seen[-3:]
    assert all(isinstance(x, jax.Array) for x in step)
    assert step[0] is step[1] is step[2]  # one buffer for the step's layers
    assert int(step[0]) == (i if i < 3 else (i - 3) % 4)
  kq, _ = cache_lib.quantize_int8(k, jnp.bfloat16)
  for kv in layers:
    np.testing.assert_array_equal(kv.cells()["k"], np.asarray(kq))
  traced = []
  jax.jit(lambda x: (traced.append(cache_lib.device_offset(12345)), x + 1)[1])(jnp.int32(0))
  assert not isinstance(traced[0], jax.core.Tracer)
  assert cache_lib.device_offset(12345) is traced[0] and int(traced[0]) == 12345


def test_int8_scale_dtype_env(monkeypatch):
  monkeypatch.setenv(cache_lib.SCALE_DTYPE_ENV, "float32")
  kv = rkv.RollingKV.empty(B, 16, K, D, window_cells=4, dtype=jnp.int8, tile_cells=4)
  assert kv.scale_dtype == np.float32
  monkeypatch.setenv(cache_lib.SCALE_DTYPE_ENV, "float64")
  with pytest.raises(ValueError, match="RKV_INT8_SCALE_DTYPE"):
    rkv.RollingKV.empty(B, 16, K, D, window_cells=4, dtype=jnp.int8, tile_cells=4)


def test_bf16_cache_casts_float32_appends():
  k, v = tokens(12, seed=3)
  kv = rkv.RollingKV.empty(B, 16, K, D, window_cells=4, tile_cells=4)  # bf16 by default
  kv = kv.append(k, v)
  assert kv.dtype == jnp.bfloat16
  np.testing.assert_array_equal(kv.cells()["k"], np.asarray(jnp.asarray(k, jnp.bfloat16)))


# ----------------------------------------------------------------------------------------------
# A flush is O(tile) by construction: one device_put, one leaf replaced, the tail never read
# ----------------------------------------------------------------------------------------------
def _leaves(tail):
  return {name: list(getattr(tail, name)) for name in ("k", "v", "pos", "k_scale", "v_scale")
          if getattr(tail, name) is not None}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8])
def test_flush_replaces_one_leaf(dtype):
  tile = 8
  k, v = tokens(40, seed=5, b=1)
  kv = rkv.RollingKV.empty(1, 40, K, D, window_cells=0, dtype=dtype, tile_cells=tile)
  kv = kv.append(k[:, :16], v[:, :16])  # two tiles flushed
  before = _leaves(kv.tail)
  ptrs = {n: [x.unsafe_buffer_pointer() for x in xs] for n, xs in before.items()}
  kv = kv.append(k[:, 16:23], v[:, 16:23])  # staged only: the tail is the same object
  assert all(kv.tail.k[i] is before["k"][i] for i in range(5))
  kv = kv.append(k[:, 23:24], v[:, 23:24])  # completes the staging tile: flushed into tile 2
  after = _leaves(kv.tail)
  for name, xs in after.items():
    assert len(xs) == 5
    for i, x in enumerate(xs):
      if i == 2:
        assert x is not before[name][i], f"tail.{name}[2] was not replaced"
        continue
      # Every other tile is the very same array on the same buffer, alive: nothing copied it.
      assert x is before[name][i] and not x.is_deleted(), f"tail.{name}[{i}] changed"
      assert x.unsafe_buffer_pointer() == ptrs[name][i]
  assert kv.tail.k[2].sharding.memory_kind == "pinned_host"
  cells = kv.cells()
  want = np.asarray(cache_lib.quantize_int8(k, jnp.bfloat16)[0]) if dtype == jnp.int8 else k
  np.testing.assert_array_equal(cells["k"][:, 16:24], want[:, 16:24])
  np.testing.assert_array_equal(cells["pos"], np.arange(24)[None])
  assert_kinds(kv)


def test_flush_never_reads_the_tail():
  # Delete every array of the tail, then complete a staging tile: the flush must still work, so
  # no program (and no copy) took the tail as an input — a whole-tail copy would raise here.
  k, v = tokens(40, seed=6, b=1)
  kv = rkv.RollingKV.empty(1, 40, K, D, window_cells=4, dtype=jnp.float32, tile_cells=8)
  kv = kv.append(k[:, :19], v[:, :19])  # window 4, tile 0 flushed, 7 staged
  assert (kv.n_full_tiles, kv.n_staged) == (1, 7)
  for x in jax.tree.leaves(kv.tail):
    x.delete()
  kv = kv.append(k[:, 19:20], v[:, 19:20])  # the flush into tile 1
  assert kv.n_full_tiles == 2
  np.testing.assert_array_equal(np.asarray(kv.tail.k[1]), k[:, 12:20])
  np.testing.assert_array_equal(np.asarray(kv.tail.pos[1]), np.arange(12, 20)[None])
  assert kv.tail.k[0].is_deleted() and kv.tail.k[2].is_deleted()  # untouched, never recreated
  # The same through flush() itself, for the last tile.
  assert kv.n_tail_tiles == 4
  tail, staging = cache_lib.flush(kv.tail, kv.staging, 3)
  assert tail.v[3].sharding.memory_kind == "pinned_host" and tail.v[2] is kv.tail.v[2]
  with pytest.raises(ValueError, match="tile index"):
    cache_lib.flush(kv.tail, kv.staging, 4)


def test_flush_moves_one_tile_of_bytes(monkeypatch):
  # Every byte that goes to the host in a flushing append is the tile's: k, v (and scales).
  moved = []
  to_host = memory.to_host

  def spy(x, device=None):
    moved.append(sum(leaf.nbytes for leaf in jax.tree.leaves(x)))
    return to_host(x, device)

  k, v = tokens(64, seed=7, b=1)
  kv = rkv.RollingKV.empty(1, 64, K, D, window_cells=0, dtype=jnp.int8, tile_cells=8)
  kv = kv.append(k[:, :7], v[:, :7])
  monkeypatch.setattr(memory, "to_host", spy)
  kv = kv.append(k[:, 7:8], v[:, 7:8])  # one flush
  tile_bytes = 2 * 8 * K * D + 2 * 8 * K * 2  # int8 k, v + bfloat16 scales of one tile
  assert moved == [tile_bytes]
  moved.clear()
  kv = kv.append(k[:, 8:40], v[:, 8:40])  # a 4-tile chunk: four tiles, each moved once
  assert moved == [tile_bytes] * 4 and kv.n_full_tiles == 5
  assert_kinds(kv)


def test_decode_append_touches_no_tail_bytes():
  # A one-token append that does not flush never passes the tail to any computation.
  k, v = tokens(20, seed=6, b=1)
  kv = rkv.RollingKV.from_arrays(k[:, :13], v[:, :13], window_cells=4, capacity=40, tile_cells=8)
  tail_k = kv.tail.k
  kv = kv.append(k[:, 13:14], v[:, 13:14])
  assert kv.tail.k is tail_k and not any(x.is_deleted() for x in tail_k)


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


@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
def test_save_load_keeps_the_scale_dtype(tmp_path, scale_dtype):
  # A save from before bfloat16 scales (float32) loads as float32, each as it was saved.
  k, v = tokens(21, seed=12)
  kv = rkv.RollingKV.from_arrays(k, v, window_cells=5, tile_cells=8, dtype=jnp.int8,
                                 scale_dtype=scale_dtype)
  rkv.cache.save(kv, str(tmp_path))
  manifest = json.load(open(os.path.join(tmp_path, "manifest.json")))
  assert manifest["arrays"]["k_scale"]["dtype"] == scale_dtype
  loaded = rkv.cache.load(str(tmp_path))
  assert loaded.scale_dtype == np.dtype(jnp.dtype(scale_dtype))
  for name, x in kv.cells().items():
    np.testing.assert_array_equal(loaded.cells()[name], x)
  manifest["arrays"]["k_scale"]["dtype"] = "float16"
  json.dump(manifest, open(os.path.join(tmp_path, "manifest.json"), "w"))
  with pytest.raises(ValueError, match="scale_dtype must be one of"):
    rkv.cache.load(str(tmp_path))


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
  assert kv.n_tail_tiles == 2
  assert len(leaves) == 12  # window, staging x (k, v, pos) + 2 tail tiles x (k, v, pos)
  again = jax.tree.unflatten(tree, leaves)
  assert again.fill == kv.fill and again.window_cells == 4
