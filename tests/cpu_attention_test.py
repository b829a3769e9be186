"""The CPU-tail kernel (rkv/offload/cpu_kernel.c via rkv.offload.cpu_attention) against float64 NumPy.

Tolerances: the kernel accumulates in float32 (online softmax, float64 merge of chunk partials),
so with K/V given in a 16-bit or int8 format the reference is computed on the *same* rounded
values (and scales), and the only error left is float32 arithmetic: observed < 1e-6 on o and
lse over these shapes (|err| / (1 + |ref|)), checked at 1e-5 (absolute and relative). Thread counts never change the
result: the split into work items depends only on the shapes, so those checks are bit-exact.
"""

import ctypes
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import rkv
from rkv.offload import cpu_attention as ca
from rkv.offload import cpu_build
from tests import numpy_reference as ref
from tests.support.tolerances import CPU_KERNEL as TOL

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)


def _kv_params(dtypes):
  """(dtype, scale_dtype) cases: int8 with its scales in float32 and in bfloat16 (what the cache
  holds), the other dtypes unscaled (scale_dtype None)."""
  out = []
  for dt in dtypes:
    if dt == "int8":
      out += [pytest.param(dt, F32, id="int8-f32scale"),
              pytest.param(dt, BF16, id="int8-bf16scale")]
    else:
      out.append(pytest.param(dt, None, id=dt))
  return out


def _data(b, t, h, kh, d, s, dtype="float32", seed=0, q_dtype=np.float32, scale_dtype=None):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((b, t, h, d)).astype(q_dtype)
  k = rng.standard_normal((b, s, kh, d)).astype(np.float32)
  v = rng.standard_normal((b, s, kh, d)).astype(np.float32)
  ks = vs = None
  if dtype == "int8":
    (k, ks), (v, vs) = ref.quantize_int8(k), ref.quantize_int8(v)
    # Rounded after quantizing: the reference reads the same (rounded) scales, so it still holds.
    ks, vs = ks.astype(scale_dtype or F32), vs.astype(scale_dtype or F32)
  else:
    k, v = k.astype(np.dtype(BF16 if dtype == "bfloat16" else dtype)), v.astype(
        np.dtype(BF16 if dtype == "bfloat16" else dtype))
  return q, k, v, ks, vs


def _check(got, want, dtype="float32"):
  tol = TOL[dtype]
  o, lse = got
  ro, rl = want
  assert o.dtype == np.float32 and lse.dtype == np.float32
  assert np.array_equal(np.isneginf(lse), np.isneginf(rl)), "empty rows differ"
  np.testing.assert_allclose(o, ro, atol=tol, rtol=tol)
  np.testing.assert_allclose(lse, rl, atol=tol, rtol=tol)


@pytest.mark.parametrize("t,g,d", [(1, 1, 64), (1, 4, 80), (1, 8, 128), (4, 4, 64), (4, 1, 128),
                                   (16, 8, 80), (16, 1, 64), (1, 4, 36), (4, 8, 36)])
def test_matches_reference(t, g, d):
  kh, s = 2, 523  # S a multiple of nothing; D=36 exercises the head-dim tail (D % 8 != 0)
  q, k, v, _, _ = _data(2, t, g * kh, kh, d, s)
  _check(ca.cpu_attention(q, k, v), ref.attention(q, k, v))


@pytest.mark.parametrize("opts", [dict(causal=False), dict(window=37), dict(softcap=3.0),
                                  dict(window=50, softcap=2.0), dict(causal=False, window=64),
                                  dict(scale=0.3)])
@pytest.mark.parametrize("t,g", [(1, 4), (16, 8)])
def test_options(opts, t, g):
  q, k, v, _, _ = _data(2, t, 4 * g, 4, 64, 301, "bfloat16", seed=1)
  rng = np.random.default_rng(2)
  q_pos = rng.integers(150, 320, (2, t)).astype(np.int32)  # some queries see fewer keys
  _check(ca.cpu_attention(q, k, v, q_pos=q_pos, **opts),
         ref.attention(q, k, v, q_pos=q_pos, **opts), "bfloat16")


@pytest.mark.parametrize("dtype,scale_dtype",
                         _kv_params(["float32", "bfloat16", "float16", "int8"]))
@pytest.mark.parametrize("t,g", [(1, 4), (4, 4), (16, 8)])
def test_kv_dtypes(dtype, scale_dtype, t, g):
  q, k, v, ks, vs = _data(2, t, 2 * g, 2, 128, 777, dtype, seed=3, scale_dtype=scale_dtype)
  _check(ca.cpu_attention(q, k, v, k_scale=ks, v_scale=vs),
         ref.attention(q, k, v, k_scale=ks, v_scale=vs), dtype)


@pytest.mark.parametrize("dtype,scale_dtype",
                         _kv_params(["bfloat16", "float16", "int8", "float32"]))
@pytest.mark.parametrize("t,g,d", [(1, 1, 80), (1, 2, 80), (1, 3, 48), (1, 5, 80), (2, 1, 16),
                                   (2, 2, 32), (1, 4, 16)])
def test_register_blocked_path(dtype, scale_dtype, t, g, d):
  # D % 16 == 0 takes the register-blocked path (query rows in groups of <= 4, bf16
  # in even/odd column order); the spread-out q_pos leaves some rows without a key in whole
  # blocks (and, with the window, in whole chunks) while other rows of the head see keys there.
  q, k, v, ks, vs = _data(2, t, 2 * g, 2, d, 613, dtype, seed=11, scale_dtype=scale_dtype)
  q_pos = np.array([[40, 600][:t], [300, 612][:t]], np.int32)
  for opts in (dict(), dict(window=90), dict(softcap=2.5, causal=False)):
    _check(ca.cpu_attention(q, k, v, q_pos=q_pos, k_scale=ks, v_scale=vs, **opts),
           ref.attention(q, k, v, q_pos=q_pos, k_scale=ks, v_scale=vs, **opts), dtype)


@pytest.mark.parametrize("q_dtype", [BF16, np.float16])
def test_query_dtypes(q_dtype):
  q, k, v, _, _ = _data(1, 4, 8, 2, 64, 200, "bfloat16", q_dtype=q_dtype)
  _check(ca.cpu_attention(q, k, v), ref.attention(q.astype(np.float32), k, v), "bfloat16")


@pytest.mark.parametrize("dtype,scale_dtype", _kv_params(["float32", "bfloat16", "int8"]))
def test_holes_hold_nan(dtype, scale_dtype):
  q, k, v, ks, vs = _data(2, 4, 8, 2, 80, 400, dtype, seed=4, scale_dtype=scale_dtype)
  rng = np.random.default_rng(5)
  k_pos = np.broadcast_to(np.arange(400, dtype=np.int32), (2, 400)).copy()
  holes = rng.random((2, 400)) < 0.3
  holes[:, 100:140] = True  # a whole block of holes
  k_pos[holes] = -1
  if dtype == "int8":
    ks, vs = ks.copy(), vs.copy()
    ks[holes], vs[holes] = np.nan, np.inf  # garbage scales in empty slots
  else:
    k, v = k.copy(), v.copy()
    k[holes], v[holes] = np.nan, np.inf
  got = ca.cpu_attention(q, k, v, k_pos=k_pos, k_scale=ks, v_scale=vs)
  assert np.isfinite(got[0]).all() and np.isfinite(got[1]).all()
  with np.errstate(invalid="ignore"):  # the reference multiplies the garbage before masking it
    want = ref.attention(q, k, v, k_pos=k_pos, k_scale=ks, v_scale=vs)
  _check(got, want, dtype)


def test_fully_masked_rows_are_zero_and_neg_inf():
  q, k, v, _, _ = _data(3, 4, 8, 2, 64, 300)
  k_pos = np.broadcast_to(np.arange(300, dtype=np.int32) + 100, (3, 300)).copy()
  k_pos[2] = -1  # batch row 2: every slot empty
  q_pos = np.array([[50, 99, 100, 400], [0, 1, 250, 2], [500, 500, 500, 500]], np.int32)
  o, lse = ca.cpu_attention(q, k, v, q_pos=q_pos, k_pos=k_pos)
  empty = np.array([[1, 1, 0, 0], [1, 1, 0, 1], [1, 1, 1, 1]], bool)  # q_pos < 100 sees nothing
  assert np.all(lse[empty] == -np.inf)
  assert np.all(o[empty] == 0.0)
  assert np.isfinite(lse[~empty]).all()
  _check((o, lse), ref.attention(q, k, v, q_pos=q_pos, k_pos=k_pos))
  # Nothing visible at all, and an empty key axis.
  o, lse = ca.cpu_attention(q, k, v, q_pos=q_pos, k_pos=np.full((3, 300), -1, np.int32))
  assert np.all(o == 0.0) and np.all(lse == -np.inf)
  o, lse = ca.cpu_attention(q, k[:, :0], v[:, :0])
  assert o.shape == q.shape and np.all(o == 0.0) and np.all(lse == -np.inf)


def test_lse_is_natural_log():
  # q = 0: every logit is 0, so lse = ln(number of visible keys) exactly.
  _, k, v, _, _ = _data(1, 1, 4, 2, 64, 1000)
  q = np.zeros((1, 1, 4, 64), np.float32)
  o, lse = ca.cpu_attention(q, k, v)
  np.testing.assert_allclose(lse, np.log(1000.0), rtol=1e-6)
  np.testing.assert_allclose(o[0, 0, 0], v[0, :, 0].mean(0), atol=1e-5)


def _tile_major(x, tile):
  """[B,S,...] -> [N,B,tile,...] (the host tail's layout)."""
  b, s = x.shape[:2]
  return np.ascontiguousarray(np.moveaxis(x.reshape((b, s // tile, tile) + x.shape[2:]), 1, 0))


@pytest.mark.parametrize("dtype,scale_dtype", _kv_params(["bfloat16", "int8"]))
def test_tile_major_equals_flat(dtype, scale_dtype):
  tile, n = 64, 9
  q, k, v, ks, vs = _data(2, 4, 8, 2, 80, tile * n, dtype, seed=6, scale_dtype=scale_dtype)
  rng = np.random.default_rng(7)
  k_pos = np.broadcast_to(np.arange(tile * n, dtype=np.int32), (2, tile * n)).copy()
  k_pos[rng.random(k_pos.shape) < 0.1] = -1
  flat = ca.cpu_attention(q, k, v, k_pos=k_pos, k_scale=ks, v_scale=vs)
  tk, tv = _tile_major(k, tile), _tile_major(v, tile)
  tks = None if ks is None else _tile_major(ks, tile)
  tvs = None if vs is None else _tile_major(vs, tile)
  split = lambda x: None if x is None else tuple(x)  # N tiles [B,tile,...]: the cache's layout
  host = lambda x: None if x is None else tuple(rkv.offload.to_host(t) for t in x)
  layouts = [(tk, tv, tks, tvs), (split(tk), split(tv), split(tks), split(tvs)),
             (host(tk), host(tv), host(tks), host(tvs))]  # the last: pinned_host jax tiles
  for lk, lv, lks, lvs in layouts:
    # positions flat [B,S], tile-major [N,B,tile] or N tiles [B,tile]
    for pos in (k_pos, _tile_major(k_pos, tile), tuple(_tile_major(k_pos, tile))):
      tiled = ca.cpu_attention(q, lk, lv, k_pos=pos, k_scale=lks, v_scale=lvs)
      np.testing.assert_array_equal(tiled[0], flat[0])
      np.testing.assert_array_equal(tiled[1], flat[1])
  # A tile range (the hybrid split) equals attention over those cells.
  lo, hi = 2, 7
  part = ca.cpu_attention(q, tk, tv, k_pos=_tile_major(k_pos, tile), k_scale=tks, v_scale=tvs,
                          tiles=(lo, hi), q_pos=np.full((2, 4), tile * n, np.int32))
  cells = slice(lo * tile, hi * tile)
  _check(part, ref.attention(q, k[:, cells], v[:, cells], q_pos=np.full((2, 4), tile * n),
                             k_pos=k_pos[:, cells],
                             k_scale=None if ks is None else ks[:, cells],
                             v_scale=None if vs is None else vs[:, cells]), dtype)


# ----------------------------------------------------------------------------------------------
# int8 scales in bfloat16 (the cache's) as well as float32, on every path: the per-row one
# (D % 16 != 0, G*T < RKV_STAGE_ROWS), the staged one (G*T >= 6) and the register-blocked one
# (D % 16 == 0; its 512-bit variant on an AVX-512 build)
# ----------------------------------------------------------------------------------------------
_SCALE_PATHS = [(1, 4, 36), (2, 4, 72), (1, 4, 128), (2, 2, 80), (4, 4, 48)]


@pytest.mark.parametrize("t,g,d", _SCALE_PATHS)
def test_bf16_scales_match_reference_and_f32_scales(t, g, d):
  q, k, v, ks, vs = _data(2, t, 2 * g, 2, d, 517, "int8", seed=31, scale_dtype=BF16)
  assert ks.dtype == BF16 and vs.dtype == BF16
  q_pos = np.array([[300, 516, 100, 516][:t], [516, 40, 516, 516][:t]], np.int32)
  for opts in (dict(), dict(window=70, softcap=3.0)):
    got = ca.cpu_attention(q, k, v, q_pos=q_pos, k_scale=ks, v_scale=vs, **opts)
    _check(got, ref.attention(q, k, v, q_pos=q_pos, k_scale=ks, v_scale=vs, **opts), "int8")
    # The same values in float32: a bf16 scale widens exactly, so the outputs are identical.
    f32 = ca.cpu_attention(q, k, v, q_pos=q_pos, k_scale=ks.astype(F32), v_scale=vs.astype(F32),
                           **opts)
    for a, b in zip(got, f32):
      np.testing.assert_array_equal(a, b)


def test_bf16_scales_read_in_place_from_pinned_host_tiles():
  tile, n = 64, 5
  q, k, v, ks, vs = _data(2, 1, 8, 2, 128, tile * n, "int8", seed=32, scale_dtype=BF16)
  want = ca.cpu_attention(q, k, v, k_scale=ks, v_scale=vs)
  tiles = lambda x: tuple(rkv.offload.to_host(t) for t in _tile_major(x, tile))
  tks = tiles(ks)
  assert tks[0].dtype == jnp.bfloat16
  assert ca.host_buffer(tks[0]).ptr == tks[0].unsafe_buffer_pointer()  # no bf16 -> f32 copy
  pos = tuple(_tile_major(np.broadcast_to(np.arange(tile * n, dtype=np.int32), (2, tile * n)),
                          tile))
  got = ca.cpu_attention(q, tiles(k), tiles(v), k_pos=pos, k_scale=tks, v_scale=tiles(vs))
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)
  # A numpy bfloat16 scale is not copied on its way to the kernel (float16/float64 are converted).
  assert ca._scales_to_host(ks) is ks
  assert ca._scales_to_host(ks.astype(np.float16)).dtype == F32


@pytest.mark.parametrize("scale_dtype", [F32, BF16], ids=["f32scale", "bf16scale"])
@pytest.mark.parametrize("t,g,d", [(1, 4, 36), (1, 8, 72), (1, 4, 128)])
def test_nan_scale_visible_reaches_output_hole_does_not(scale_dtype, t, g, d):
  # A NaN k_scale on a visible cell makes that KV head's rows NaN (o and lse: it is in the logit);
  # a NaN v_scale there makes their o NaN (it weights V); NaN scales in holes are never read.
  b, kh, s = 2, 2, 300
  q, k, v, ks, vs = _data(b, t, g * kh, kh, d, s, "int8", seed=33, scale_dtype=scale_dtype)
  k_pos = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy()
  k_pos[:, 40:80] = -1  # holes, NaN scales in them
  ks, vs = ks.copy(), vs.copy()
  ks[:, 40:80], vs[:, 40:80] = np.nan, np.nan
  clean = ca.cpu_attention(q, k, v, k_pos=k_pos, k_scale=ks, v_scale=vs)
  assert np.isfinite(clean[0]).all() and np.isfinite(clean[1]).all()
  with np.errstate(invalid="ignore"):
    _check(clean, ref.attention(q, k, v, k_pos=k_pos, k_scale=ks, v_scale=vs), "int8")
  head = np.zeros((b, t, g * kh), bool)
  head[0, :, g:] = True  # batch row 0, KV head 1's query heads (every query sees cell 200)
  for which in ("k", "v"):
    bad_k, bad_v = ks.copy(), vs.copy()
    (bad_k if which == "k" else bad_v)[0, 200, 1] = np.nan
    o, lse = ca.cpu_attention(q, k, v, k_pos=k_pos, k_scale=bad_k, v_scale=bad_v)
    assert np.isnan(o[head]).all()
    assert np.isfinite(o[~head]).all() and np.isfinite(lse[~head]).all()
    if which == "k":
      assert np.isnan(lse[head]).all()
    else:
      assert np.isfinite(lse[head]).all()  # the weights' sum does not see V
    np.testing.assert_array_equal(o[~head], clean[0][~head])
    np.testing.assert_array_equal(lse[~head], clean[1][~head])


def test_scale_dtypes_are_checked():
  q, k, v, ks, vs = _data(2, 1, 8, 2, 64, 100, "int8", scale_dtype=BF16)
  for bad_k, bad_v, got in ((ks, vs.astype(F32), "bfloat16 and v_scale float32"),
                            (ks.astype(F32), vs, "float32 and v_scale bfloat16"),
                            (jnp.asarray(ks, jnp.float16), jnp.asarray(vs, jnp.float16),
                             "float16 and v_scale float16"),
                            (jnp.asarray(ks.astype(F32)), jnp.asarray(vs), "float32 and v_scale "
                             "bfloat16")):
    with pytest.raises(ValueError, match=f"k_scale and v_scale must both be float32 or both "
                                         f"bfloat16, got k_scale {got}"):
      ca.cpu_attention(q, k, v, k_scale=bad_k, v_scale=bad_v)
  ones = np.ones(ks.shape, np.int8)
  with pytest.raises(ValueError, match="k_scale must be a float array, got int8"):
    ca.cpu_attention(q, k, v, k_scale=ones, v_scale=vs)
  with pytest.raises(ValueError, match="got k_scale int8 and v_scale int8"):  # jax: read in place
    ca.cpu_attention(q, k, v, k_scale=jnp.asarray(ones), v_scale=jnp.asarray(ones))


def test_kernel_refuses_an_unknown_scale_dtype(monkeypatch):
  # The C argument check, below the Python one: scale_dtype must be RKV_F32 or RKV_BF16 for int8.
  q, k, v, ks, vs = _data(1, 1, 4, 2, 64, 100, "int8", scale_dtype=BF16)
  real = dict(ca._SCALE_CODES)
  for code in (2, 3, -1):
    monkeypatch.setattr(ca, "_SCALE_CODES", {dt: code for dt in real})
    with pytest.raises(RuntimeError, match=r"rejected its arguments \(rc=-2\)"):
      ca.cpu_attention(q, k, v, k_scale=ks, v_scale=vs)


def test_strided_views_are_read_in_place():
  q, k, v, _, _ = _data(2, 1, 8, 4, 64, 300, "bfloat16", seed=8)
  big = np.concatenate([k, v], axis=2)  # [B,S,2K,D]: k and v are strided views of it
  got = ca.cpu_attention(q, big[:, :, :4], big[:, :, 4:])
  _check(got, ref.attention(q, k, v), "bfloat16")
  assert ca.host_buffer(big[:, :, :4]).ptr == big.ctypes.data  # no copy


@pytest.mark.parametrize("t,g,dtype", [(1, 4, "bfloat16"), (16, 8, "int8"), (4, 1, "float32")])
def test_threads_and_chunks(t, g, dtype):
  q, k, v, ks, vs = _data(2, t, 2 * g, 2, 64, 1500, dtype, seed=9)
  want = ref.attention(q, k, v, k_scale=ks, v_scale=vs)
  for chunk in (None, 1, 7, 100):
    outs = [ca.cpu_attention(q, k, v, k_scale=ks, v_scale=vs, num_threads=nt, chunk=chunk)
            for nt in (1, 2, 3, 1)]
    for o, lse in outs[1:]:  # bit-identical for any thread count, and run to run
      np.testing.assert_array_equal(o, outs[0][0])
      np.testing.assert_array_equal(lse, outs[0][1])
    _check(outs[0], want, dtype)  # and within tolerance for every chunking


def _cache(dtype, s=1000, w=100, tile=128, seed=10):
  rng = np.random.default_rng(seed)
  k = rng.standard_normal((2, s, 2, 64)).astype(np.float32)
  v = rng.standard_normal((2, s, 2, 64)).astype(np.float32)
  src = np.dtype(BF16) if dtype == "int8" else np.dtype(BF16 if dtype == "bfloat16" else dtype)
  return rkv.RollingKV.from_arrays(k.astype(src), v.astype(src), window_cells=w, tile_cells=tile,
                                   dtype=dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "int8"])
def test_rolling_tail_in_place(dtype):
  kv = _cache(dtype)
  assert rkv.cache.memory_kinds(kv)["tail.k[0]"] == "pinned_host"
  cells = kv.cells()
  q = np.random.default_rng(11).standard_normal((2, 1, 8, 64)).astype(np.float32)
  o, lse = ca.cpu_attention_tail(q, kv)
  lo, hi = kv.window_cells, kv.window_cells + kv.n_full_tiles * kv.tile_cells
  sl = slice(lo, hi)
  sc = lambda x: None if x is None else x[:, sl]
  q_pos = np.full((2, 1), kv.fill - 1)
  _check((o, lse), ref.attention(q, cells["k"][:, sl], cells["v"][:, sl], q_pos=q_pos,
                                 k_pos=cells["pos"][:, sl], k_scale=sc(cells["k_scale"]),
                                 v_scale=sc(cells["v_scale"])), dtype)
  # Merged with the device partials (window, staging) it is attention over the whole cache.
  qj, qpj = jnp.asarray(q), jnp.asarray(q_pos, jnp.int32)
  parts = [rkv.attention(qj, b.k, b.v, q_pos=qpj, k_pos=b.pos, k_scale=b.k_scale,
                         v_scale=b.v_scale, impl="reference") for b in (kv.window, kv.staging)]
  om, lm = rkv.merge(*rkv.merge(*parts[0], *parts[1]), jnp.asarray(o), jnp.asarray(lse))
  _check((np.asarray(om), np.asarray(lm)),
         ref.attention(q, cells["k"], cells["v"], q_pos=q_pos, k_pos=cells["pos"],
                       k_scale=cells["k_scale"], v_scale=cells["v_scale"]), dtype)
  # A tile range of the tail, and positions handed in by the caller.
  part = ca.cpu_attention_tail(q, kv, tiles=(1, 3),
                               tail_pos=tuple(np.asarray(p) for p in kv.tail.pos))
  sl = slice(lo + kv.tile_cells, lo + 3 * kv.tile_cells)
  _check(part, ref.attention(q, cells["k"][:, sl], cells["v"][:, sl], q_pos=q_pos,
                             k_pos=cells["pos"][:, sl], k_scale=sc(cells["k_scale"]),
                             v_scale=sc(cells["v_scale"])), dtype)


def test_rolling_tail_empty_and_appends():
  kv = rkv.RollingKV.empty(1, 600, 2, 64, window_cells=100, dtype=jnp.bfloat16, tile_cells=64)
  q = np.random.default_rng(12).standard_normal((1, 1, 4, 64)).astype(np.float32)
  o, lse = ca.cpu_attention_tail(q, kv)  # no tail yet
  assert np.all(o == 0.0) and np.all(lse == -np.inf)
  rng = np.random.default_rng(13)
  for _ in range(3):  # chunks that flush tiles: the donated tail is read at its new buffer
    kv = kv.append(rng.standard_normal((1, 150, 2, 64)).astype(BF16),
                   rng.standard_normal((1, 150, 2, 64)).astype(BF16))
  cells = kv.cells()
  lo, hi = kv.window_cells, kv.window_cells + kv.n_full_tiles * kv.tile_cells
  o, lse = ca.cpu_attention_tail(q, kv)
  _check((o, lse), ref.attention(q, cells["k"][:, lo:hi], cells["v"][:, lo:hi],
                                 q_pos=np.full((1, 1), kv.fill - 1),
                                 k_pos=cells["pos"][:, lo:hi]), "bfloat16")


def test_pinned_host_pointer_is_zero_copy_on_cpu():
  kv = _cache("bfloat16")
  tile = kv.tail.k[1]
  info = ca.check_host_pointer(tile)
  assert info["content_matches"]
  if jax.default_backend() == "cpu":
    assert info["zero_copy_numpy"]  # on a GPU this is False: np.asarray copies (docstring)
  buf = ca.host_buffer(tile)
  assert buf.ptr == tile.unsafe_buffer_pointer()
  assert buf.strides == tuple(np.zeros(tile.shape, np.uint8).strides)


def test_bad_inputs_name_the_argument():
  q, k, v, _, _ = _data(2, 1, 8, 2, 64, 100)
  qi, ki, vi, ks, vs = _data(2, 1, 8, 2, 64, 100, "int8")
  bad = [
      (dict(q=q[0]), "q must be rank 4"),
      (dict(q=q.astype(np.int32)), "q dtype"),
      (dict(k=k[0]), "k must be rank 4"),
      (dict(v=v[:, :50]), "v shape"),
      (dict(v=v.astype(np.float16)), "k dtype float32 must equal v dtype"),
      (dict(k=k.astype(np.float64), v=v.astype(np.float64)), "k/v dtype"),
      (dict(q=q[:1]), "k batch"),
      (dict(q=q[..., :32]), "head dim"),
      (dict(q=q[:, :, :5]), "multiple of kv heads"),
      (dict(k=ki, v=vi), "k_scale"),
      (dict(k=ki, v=vi, k_scale=ks, v_scale=vs[:, :5]), "v_scale must have shape"),
      (dict(k=ki, v=vi, k_scale=ks.astype(np.int32), v_scale=vs), "k_scale must be a float"),
      (dict(k_scale=np.ones((2, 100, 2), np.float32), v_scale=np.ones((2, 100, 2), np.float32)),
       "only valid with int8"),
      (dict(q_pos=np.zeros((2, 3), np.int32)), "q_pos must have shape"),
      (dict(k_pos=np.zeros((2, 99), np.int32)), "k_pos must have shape"),
      (dict(k_pos=np.zeros((2, 100), np.float32)), "k_pos must be an integer"),
      (dict(window=0), "window"),
      (dict(window=2.5), "window"),
      (dict(softcap=-1.0), "softcap"),
      (dict(scale=0.0), "scale"),
      (dict(num_threads=0), "num_threads"),
      (dict(chunk=-3), "chunk"),
      (dict(tiles=(0, 1)), "tiles is only valid"),
  ]
  for kw, msg in bad:
    args = dict(q=q, k=k, v=v)
    args.update(kw)
    with pytest.raises(ValueError, match=msg):
      ca.cpu_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)
  tk, tv = _tile_major(k, 50), _tile_major(v, 50)
  for tiles in ((0, 3), (2, 1), (-1, 1), 1, (0.0, 1)):
    with pytest.raises(ValueError, match="tiles must be"):
      ca.cpu_attention(q, tk, tv, tiles=tiles)
  with pytest.raises(ValueError, match=r"k_pos must be 2 tiles"):
    ca.cpu_attention(q, tuple(tk), tuple(tv), k_pos=(np.zeros((2, 50), np.int32),))
  with pytest.raises(ValueError, match=r"k_pos\[1\] must have shape"):
    ca.cpu_attention(q, tuple(tk), tuple(tv),
                     k_pos=(np.zeros((2, 50), np.int32), np.zeros((2, 49), np.int32)))
  with pytest.raises(ValueError, match=r"v\[1\] must have shape"):
    ca.cpu_attention(q, tuple(tk), (tv[0], tv[1][:, :10]))
  with pytest.raises(ValueError, match="k must hold at least one tile"):
    ca.cpu_attention(q, (), ())
  kv = _cache("bfloat16")
  with pytest.raises(ValueError, match="kv must be a rkv.RollingKV"):
    ca.cpu_attention_tail(q, "cache")
  gone = jax.device_put(np.zeros((2, 100, 2, 64), np.float32))
  gone.delete()
  with pytest.raises(ValueError, match="k was deleted or donated"):
    ca.cpu_attention(q, gone, v)
  del kv


def test_build_entry_point_and_prebuilt_library(tmp_path, monkeypatch):
  out = tmp_path / "prebuilt"
  proc = subprocess.run([sys.executable, "-m", "rkv.offload.cpu_build", "--out", str(out)],
                        capture_output=True, text=True,
                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert proc.returncode == 0, proc.stderr
  so = out / cpu_build.LIB_NAME
  assert so.is_file() and f"{cpu_build.SO_ENV}=" in proc.stdout
  monkeypatch.setenv(cpu_build.SO_ENV, str(so))
  assert cpu_build.library_path() == str(so)
  assert ctypes.CDLL(str(so)).rkv_cpu_kernel_abi_version() == cpu_build.ABI_VERSION
  q, k, v, _, _ = _data(1, 1, 4, 2, 64, 100)
  _check(ca.cpu_attention(q, k, v), ref.attention(q, k, v))  # through the prebuilt library
  monkeypatch.setenv(cpu_build.SO_ENV, str(tmp_path / "missing.so"))
  with pytest.raises(ValueError, match=cpu_build.SO_ENV):
    cpu_build.library_path()


def test_loading_sets_a_passive_openmp_wait_policy():
  ca.max_threads()  # loads the library
  # Spinning OpenMP workers stalled calls on a busy host (cpu_build._load); a user setting wins.
  assert os.environ.get(cpu_build.WAIT_POLICY_ENV)


def test_missing_compiler_is_a_clear_error(monkeypatch):
  monkeypatch.setenv("CC", "no-such-compiler-rkv")
  monkeypatch.setenv("PATH", "")
  with pytest.raises(cpu_build.CompilerNotFoundError, match="RKV_CPU_KERNEL_SO"):
    cpu_build.find_compiler()


def test_probes_run():
  # Probes for the planner; timing is the benchmark scripts' job, here they only have to run.
  assert ca.measure_host_read_bandwidth(1 << 22, repeats=1) > 0
  for dtype in ("bfloat16", "int8"):
    assert ca.measure_cpu_attention(2048, num_kv_heads=2, head_dim=64, dtype=dtype, repeats=1,
                                    tile_cells=512) > 0


@pytest.mark.parametrize("name", ["q_pos", "k_pos"])
def test_positions_beyond_int32_are_refused(name):
  # They used to wrap on the kernel's int32 cast: 2**32 + 3 read as position 3.
  q, k, v, _, _ = _data(1, 1, 4, 2, 16, 9)
  pos = dict(q_pos=np.array([[8 + 2**32]]), k_pos=np.arange(9)[None] + 2**32)
  with pytest.raises(ValueError, match=f"{name} values must be in"):
    ca.cpu_attention(q, k, v, **{name: pos[name]})


# ----------------------------------------------------------------------------------------------
# The build cache trusts nothing it cannot verify (issue 13)
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def empty_build_cache(tmp_path, monkeypatch):
  """An empty $RKV_CACHE_DIR whose 'compiler' copies the library this session already built (a
  real compile takes ~20 s on the shared box); returns (cached path, good bytes)."""
  good = open(cpu_build.library_path(), "rb").read()
  monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path / "cache"))
  monkeypatch.delenv(cpu_build.SO_ENV, raising=False)
  builds = []
  def fake_compile(cc, out):
    builds.append(out)
    with open(out, "wb") as f:
      f.write(good)
  monkeypatch.setattr(cpu_build, "_compile", fake_compile)
  path = cpu_build._cached_path()
  os.makedirs(os.path.dirname(path))
  return path, good, builds


@pytest.mark.parametrize("corrupt,why", [
    (lambda good: b"junk" * 100, "not an ELF file"),
    (lambda good: good[:len(good) // 2], "truncated"),
    (lambda good: good[:-1] + bytes([good[-1] ^ 1]), "differ from the SHA-256"),
], ids=["junk", "truncated", "one_byte_flipped"])
def test_bad_cached_library_is_rebuilt_not_loaded(empty_build_cache, corrupt, why):
  # Before: any file at the cache path was loaded forever; a truncated one died with SIGBUS.
  path, good, builds = empty_build_cache
  assert cpu_build.library_path() == path and len(builds) == 1  # first build: nothing to warn
  with open(path, "wb") as f:
    f.write(corrupt(good))
  with pytest.warns(UserWarning, match=f"cached build .* is not usable \\(.*{why}"):
    assert cpu_build.library_path() == path
  assert len(builds) == 2 and open(path, "rb").read() == good
  assert cpu_build.cached_build_problem(path) is None


def test_truncated_prebuilt_library_is_refused(tmp_path, monkeypatch):
  good = open(cpu_build.library_path(), "rb").read()
  so = tmp_path / cpu_build.LIB_NAME
  so.write_bytes(good[:len(good) // 3])
  monkeypatch.setenv(cpu_build.SO_ENV, str(so))
  with pytest.raises(ValueError, match=f"{cpu_build.SO_ENV}=.* is not a usable library: truncated"):
    cpu_build.library_path()
  assert cpu_build.kernel_available()[0] is False


def test_hanging_compiler_times_out(tmp_path, monkeypatch):
  import time
  cc = tmp_path / "cc"
  cc.write_text("#!/bin/sh\nsleep 120\n")
  cc.chmod(0o755)
  monkeypatch.setenv("CC", str(cc))
  monkeypatch.setenv(cpu_build.TIMEOUT_ENV, "0.5")
  t0 = time.perf_counter()
  with pytest.raises(RuntimeError, match="did not finish within 0.5 s"):
    cpu_build.compile_library(str(tmp_path / "out" / "lib.so"))
  assert time.perf_counter() - t0 < 30
  assert os.listdir(tmp_path / "out") == []  # nothing half-written left behind


def test_cc_pointing_nowhere_is_an_error(monkeypatch):
  monkeypatch.setenv("CC", "/nonexistent/rkv-cc")  # PATH still has a compiler: CC must win
  with pytest.raises(cpu_build.CompilerNotFoundError, match=r"\$CC='/nonexistent/rkv-cc' is not"):
    cpu_build.find_compiler()


_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu sse2 avx avx2 fma f16c bmi2{extra}
bugs\t\t: spectre_v1

processor\t: 1
flags\t\t: fpu sse2
"""
_V4 = " avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16"


def _fake_cpu(monkeypatch, extra, machine="x86_64"):
  """This host as seen by cpu_build: the first flags line of a fake /proc/cpuinfo."""
  monkeypatch.setattr(cpu_build, "_read_cpu_flags",
                      lambda: cpu_build.parse_cpu_flags(_CPUINFO.format(extra=extra)))
  monkeypatch.setattr(cpu_build.platform, "machine", lambda: machine)


def test_arch_flags_follow_the_host_cpu(monkeypatch):
  monkeypatch.delenv(cpu_build.MARCH_ENV, raising=False)
  assert "avx512vl" in cpu_build.parse_cpu_flags(_CPUINFO.format(extra=_V4))
  assert cpu_build.parse_cpu_flags("no flags here") == frozenset()
  _fake_cpu(monkeypatch, _V4)
  assert cpu_build.arch_flags() == ("-march=x86-64-v4",) and cpu_build.host_has_avx512()
  v4_key = cpu_build.build_key()
  for extra in ("", " avx512f avx512bw avx512vl", " avx512f avx512dq avx512cd avx512bw"):
    _fake_cpu(monkeypatch, extra)  # no AVX-512, or not all of v4's: the portable v3 build
    assert cpu_build.arch_flags() == ("-march=x86-64-v3",) and not cpu_build.host_has_avx512()
  assert cpu_build.build_key() != v4_key  # a v3 library never stands in for a v4 one
  _fake_cpu(monkeypatch, _V4, machine="aarch64")
  assert cpu_build.arch_flags() == ()
  # Unreadable flags (not Linux): v3.
  monkeypatch.undo()
  monkeypatch.delenv(cpu_build.MARCH_ENV, raising=False)
  monkeypatch.setattr(cpu_build, "CPUINFO_PATH", "/nonexistent/cpuinfo")
  cpu_build._read_cpu_flags.cache_clear()
  try:
    if cpu_build.platform.machine().lower() in ("x86_64", "amd64"):
      assert cpu_build.arch_flags() == ("-march=x86-64-v3",)
  finally:
    monkeypatch.undo()
    cpu_build._read_cpu_flags.cache_clear()


def test_cpu_march_env_selects_the_build(monkeypatch):
  for extra in ("", _V4):  # the variable wins over the host's flags either way
    _fake_cpu(monkeypatch, extra)
    monkeypatch.delenv(cpu_build.MARCH_ENV, raising=False)
    default, default_key = cpu_build.arch_flags(), cpu_build.build_key()
    other = "x86-64-v3" if default == ("-march=x86-64-v4",) else "x86-64-v4"
    monkeypatch.setenv(cpu_build.MARCH_ENV, other)
    assert cpu_build.arch_flags() == (f"-march={other}",)
    assert cpu_build.build_key() != default_key  # a separate cached library, never the other one
    monkeypatch.setenv(cpu_build.MARCH_ENV, " ")
    assert cpu_build.arch_flags() == default


def test_avx512_library_is_refused_on_a_host_without_it(monkeypatch):
  lib = cpu_build.load_library()
  if not cpu_build.library_has_avx512(lib):
    pytest.skip("this session's library is not an AVX-512 build")
  _fake_cpu(monkeypatch, "")
  assert "RKV_CPU_MARCH=x86-64-v3" in cpu_build._isa_problem(lib)
  _fake_cpu(monkeypatch, _V4)
  assert cpu_build._isa_problem(lib) is None


def test_kernel_isa_names_the_path():
  isa = ca.kernel_isa()
  assert isa in ("avx512", "avx2", "portable")
  march = os.environ.get(cpu_build.MARCH_ENV, "").strip()
  if (not os.environ.get(cpu_build.SO_ENV) and not march and cpu_build.host_has_avx512()
      and cpu_build.platform.machine().lower() in ("x86_64", "amd64")):
    assert isa == "avx512"  # an AVX-512 host builds and runs the 512-bit path by default
  if march == "x86-64-v3":
    assert isa == "avx2"


# ----------------------------------------------------------------------------------------------
# The register-blocked hot shapes (D=128, G=4): the 512-bit path in an x86-64-v4 build (the
# default on an AVX-512 host; kernel_isa() says which ran), the 256-bit one under v3
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,scale_dtype",
                         _kv_params(["int8", "bfloat16", "float16", "float32"]))
@pytest.mark.parametrize("t,g", [(1, 4), (3, 4), (2, 2), (1, 8)])
def test_hot_shape_masked_holes_and_empty_rows(dtype, scale_dtype, t, g):
  # S = 613: odd, not a multiple of the 32-cell block, so the last block and chunk are partial.
  # Holes (k_pos = -1, NaN/inf in their bytes or scales) are skipped unread; a run of holes
  # empties whole blocks; batch row 1's first query sees no key (o = 0, lse = -inf).
  b, kh, d, s = 2, 2, 128, 613
  q, k, v, ks, vs = _data(b, t, g * kh, kh, d, s, dtype, seed=21, scale_dtype=scale_dtype)
  rng = np.random.default_rng(22)
  k_pos = np.broadcast_to(np.arange(s, dtype=np.int32) + 50, (b, s)).copy()
  holes = rng.random((b, s)) < 0.2
  holes[:, 64:130] = True
  k_pos[holes] = -1
  if dtype == "int8":
    ks, vs = ks.copy(), vs.copy()
    ks[holes], vs[holes] = np.nan, np.inf
  else:
    k, v = k.copy(), v.copy()
    k[holes], v[holes] = np.nan, np.inf
  q_pos = np.array([[662, 400, 300][:t], [20, 662, 120][:t]], np.int32)
  got = ca.cpu_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, k_scale=ks, v_scale=vs)
  assert np.all(got[1][1, 0] == -np.inf) and np.all(got[0][1, 0] == 0.0)
  assert np.isfinite(got[0]).all() and np.isfinite(np.delete(got[1], 0, axis=1)).all()
  with np.errstate(invalid="ignore"):
    want = ref.attention(q, k, v, q_pos=q_pos, k_pos=k_pos, k_scale=ks, v_scale=vs)
  _check(got, want, dtype)
  two = ca.cpu_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, k_scale=ks, v_scale=vs,
                         num_threads=2, chunk=100)
  _check(two, want, dtype)
  for x, y in zip(two, ca.cpu_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, k_scale=ks,
                                        v_scale=vs, num_threads=1, chunk=100)):
    np.testing.assert_array_equal(x, y)  # bit-identical for any thread count


@pytest.mark.parametrize("dtype,scale_dtype", _kv_params(["int8", "bfloat16"]))
@pytest.mark.parametrize("t,g", [(1, 4), (2, 4), (2, 2)])
def test_hot_shape_nan_in_a_visible_cell(dtype, scale_dtype, t, g):
  # A NaN in a visible K cell (int8: in its scale) reaches o and lse of exactly the rows that see
  # that cell, also when rows of one 4-row group differ (t=2, g=2); the others stay exact.
  b, kh, d, s = 2, 2, 128, 301
  q, k, v, ks, vs = _data(b, t, g * kh, kh, d, s, dtype, seed=23, scale_dtype=scale_dtype)
  bad = 200
  if dtype == "int8":
    ks = ks.copy()
    ks[0, bad, 1] = np.nan
  else:
    k = k.copy()
    k[0, bad, 1, 5] = np.nan
  q_pos = np.array([[150, 300][:t], [300, 250][:t]], np.int32)  # row (0, 0) does not see it
  o, lse = ca.cpu_attention(q, k, v, q_pos=q_pos, k_scale=ks, v_scale=vs)
  sees = np.zeros(lse.shape, bool)
  sees[0, q_pos[0] >= bad, g:] = True  # batch 0, queries past the cell, KV head 1's heads
  assert np.isnan(lse[sees]).all() and np.isnan(o[sees]).all()
  assert np.isfinite(lse[~sees]).all() and np.isfinite(o[~sees]).all()
  _check((o, lse), ref.attention(q, k, v, q_pos=q_pos, k_scale=ks, v_scale=vs), dtype)
  # NaN in q: that query head's row only.
  q = q.copy()
  q[1, 0, 2, 7] = np.nan
  o, lse = ca.cpu_attention(q, k, v, q_pos=q_pos, k_scale=ks, v_scale=vs)
  assert np.isnan(lse[1, 0, 2]) and np.isnan(o[1, 0, 2]).all()
  assert np.isfinite(lse[1, 0, 3]) and np.isfinite(lse[1, 0, :2]).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_tail_tile_pointers_are_reused_while_the_tiles_live(monkeypatch, dtype):
  # cpu_attention_tail checks each tail tile (memory kind, layout, readiness, pointer) once and
  # reuses it while that array lives: a second call looks no tile up, the result is the same; a
  # deleted tile is refused, not read through its old pointer; the cache keeps no tile alive.
  import gc
  import weakref
  kv = _cache(dtype)
  q = np.random.default_rng(14).standard_normal((2, 1, 8, 64)).astype(np.float32)
  first = ca.cpu_attention_tail(q, kv)
  looked_up = []
  real = ca.host_buffer
  monkeypatch.setattr(ca, "host_buffer",
                      lambda x, **kw: looked_up.append(kw["name"]) or real(x, **kw))
  again = ca.cpu_attention_tail(q, kv)
  assert looked_up == []
  for a, b in zip(first, again):
    np.testing.assert_array_equal(a, b)
  monkeypatch.setenv("RKV_CPU_BUFFER_CACHE", "0")  # the A/B switch: every tile looked up again
  off = ca.cpu_attention_tail(q, kv)
  per_tile = 5 if dtype == "int8" else 3  # k, v, positions (and the two scales)
  assert len(looked_up) == per_tile * kv.n_full_tiles, looked_up
  for a, b in zip(first, off):
    np.testing.assert_array_equal(a, b)
  monkeypatch.delenv("RKV_CPU_BUFFER_CACHE")
  refs = [weakref.ref(t) for t in kv.tail.k[:kv.n_full_tiles]]
  kv.tail.k[0].delete()
  with pytest.raises(ValueError, match="deleted"):
    ca.cpu_attention_tail(q, kv)
  del kv
  gc.collect()
  assert all(r() is None for r in refs)


_NICE_PROBE = r"""
import json, os, sys
import numpy as np
from rkv.offload import cpu_attention as ca
rng = np.random.default_rng(0)
q = rng.standard_normal((1, 1, 4, 64)).astype(np.float32)
k = rng.standard_normal((1, 4096, 2, 64)).astype(np.float32)
v = rng.standard_normal((1, 4096, 2, 64)).astype(np.float32)
plain = ca.cpu_attention(q, k, v, num_threads=2)
os.environ[ca.WORKER_NICE_ENV] = sys.argv[1]
niced = ca.cpu_attention(q, k, v, num_threads=2)
# Field 19 of /proc/<pid>/task/<tid>/stat is the thread's nice value (after the ')' of comm).
nice = {}
for tid in os.listdir("/proc/self/task"):
  with open(f"/proc/self/task/{tid}/stat") as f:
    nice[int(tid)] = int(f.read().rsplit(")", 1)[1].split()[16])
main = os.getpid()
print(json.dumps({"main": nice[main], "others": sorted(n for t, n in nice.items() if t != main),
                  "equal": all(np.array_equal(a, b) for a, b in zip(plain, niced))}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread nice values: Linux only")
def test_worker_nice_lowers_the_kernel_team_but_not_its_caller():
  # In a child process: a team thread keeps its nice value for the life of the process.
  proc = subprocess.run([sys.executable, "-c", _NICE_PROBE, "7"], capture_output=True,
                        text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert proc.returncode == 0, proc.stderr
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  assert got["main"] == 0  # the caller (OpenMP thread 0) is left as it was
  assert 7 in got["others"]  # the team's second thread
  assert got["equal"]  # the result does not depend on the threads' priority


def test_worker_nice_rejects_values_outside_nice_range(monkeypatch):
  for bad in ("-1", "20", "high"):
    monkeypatch.setenv(ca.WORKER_NICE_ENV, bad)
    with pytest.raises(ValueError, match="RKV_CPU_KERNEL_NICE"):
      ca.worker_nice()
  monkeypatch.setenv(ca.WORKER_NICE_ENV, "5")
  assert ca.worker_nice() == 5
  monkeypatch.delenv(ca.WORKER_NICE_ENV)
  assert ca.worker_nice() == 0
