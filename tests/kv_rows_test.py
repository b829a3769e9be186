"""Many sequences in one KV pool (``kv_rows``, issue 14): every backend of ``rkv.attention``.

K/V are a pool ``[R,K,D]`` shared by the batch and key j of sequence b is pool row
``kv_rows[b, j]``; a negative row is padding. The contract (docs/DESIGN.md §3) defines a pool call as
the dense call on each sequence's gathered rows, so the reference of record here is exactly that:
gather the rows with NumPy, make padding keys empty slots, and run the float64 NumPy attention.
Pool rows nobody lists, and padding, hold NaN (int8 pools: NaN scales), so a read of a row that
is not visible shows up as NaN.
Glossary: B T H K G D S (rkv/__init__.py); R pool rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import rkv
from rkv.pallas import decode_attention as da
from rkv.pallas import flash_attention as fa
from rkv.pallas import flash_attention_mgpu as fm
from tests import numpy_reference
from tests.support.triton_ir import record_verified_lowerings

# Named tolerances (absolute, relative), the same as tests/attention_test.py: float32 accumulation
# over a few dozen keys lands near 1e-6; 16-bit inputs round o and feed P to the PV dot in that
# dtype.
TOLERANCES = {
    "float32": dict(o=(2e-5, 2e-5), lse=(2e-5, 2e-5)),
    "bfloat16": dict(o=(2e-2, 2e-2), lse=(1e-2, 1e-2)),
}
IMPLS = ("reference", "xla", "pallas")
# Tiny tiles: several key blocks, splits and query blocks per call, partial last ones.
DECODE_TILES = da.BlockSizes(block_k=16, num_splits=3)
CHUNK_TILES = fa.BlockSizes(block_q=16, block_k=16)


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  lengths: tuple[int, ...] = (37, 30, 12)  # keys of each sequence; S = the longest
  t: int = 1
  h: int = 8
  k: int = 2
  d: int = 32
  dtype: str = "float32"
  int8: bool = False
  causal: bool = True
  window: int | None = None
  softcap: float | None = None
  layout: str = "shuffled"  # in_order | shuffled | shared_prefix
  explicit_k_pos: bool = False  # k_pos = arange(S) given: padding must win over k_pos >= 0
  holes: bool = False  # padding rows inside the sequences, not just after them

  def __str__(self):
    return self.name


CASES = [
    Case("decode_ragged_in_order_gqa4", layout="in_order"),
    Case("decode_ragged_shuffled_mha", h=4, k=4, explicit_k_pos=True),
    Case("decode_shared_prefix_t4_window", t=4, window=9, layout="shared_prefix"),
    Case("decode_holes_softcap_d80", t=3, d=80, softcap=5.0, holes=True, explicit_k_pos=True),
    Case("decode_t16_int8_shared_prefix_holes", t=16, int8=True, layout="shared_prefix",
         holes=True, lengths=(40, 25)),
    Case("decode_bf16_noncausal", t=2, dtype="bfloat16", causal=False),
    Case("chunk_ragged_shuffled_gqa4", t=20, lengths=(45, 33, 20)),
    Case("chunk_shared_prefix_mha_window", t=17, h=2, k=2, window=6, layout="shared_prefix",
         lengths=(40, 29), explicit_k_pos=True),
    Case("chunk_int8_holes", t=18, int8=True, holes=True, lengths=(35, 26)),
]


@dataclasses.dataclass
class Pool:
  q: np.ndarray  # [B,T,H,D]
  k: np.ndarray  # [R,K,D] float32 (int8 pools: int8, with scales)
  v: np.ndarray
  kv_rows: np.ndarray  # [B,S] int32
  q_pos: np.ndarray  # [B,T]
  k_pos: np.ndarray | None  # [B,S] or None (arange(S) per sequence)
  k_scale: np.ndarray | None = None  # [R,K]
  v_scale: np.ndarray | None = None


def make_pool(case: Case, seed: int = 0) -> Pool:
  """A pool holding every sequence's rows, with spare rows (NaN) nobody lists."""
  rng = np.random.default_rng(seed)
  b, s = len(case.lengths), max(case.lengths)
  kv_rows = np.full((b, s), -1, np.int32)
  shared = min(case.lengths) // 2 if case.layout == "shared_prefix" else 0
  need = shared + sum(n - shared for n in case.lengths)
  r = need + 7  # spare rows
  order = np.arange(r) if case.layout == "in_order" else rng.permutation(r)
  free = iter(order[:need])
  prefix = [next(free) for _ in range(shared)]
  for i, n in enumerate(case.lengths):
    kv_rows[i, :shared] = prefix  # the same pool rows for every sequence's first keys
    kv_rows[i, shared:n] = [next(free) for _ in range(n - shared)]
  if case.holes:  # padding inside a sequence: those keys are empty slots
    holes = rng.random((b, s)) < 0.25
    holes[np.arange(b), np.asarray(case.lengths) - 1] = False  # each sequence's last key stays
    kv_rows[holes] = -1
  listed = np.zeros(r, bool)
  listed[kv_rows[kv_rows >= 0]] = True
  k = rng.standard_normal((r, case.k, case.d)).astype(np.float32) * 1.5
  v = rng.standard_normal((r, case.k, case.d)).astype(np.float32)
  k_scale = v_scale = None
  if case.int8:
    (k,), (k_scale,) = numpy_reference.quantize_int8(k[None])
    (v,), (v_scale,) = numpy_reference.quantize_int8(v[None])
    k_scale[~listed] = np.nan  # int8 cannot hold NaN; a NaN scale is read through the same path
    v_scale[~listed] = np.nan
  else:
    k[~listed] = np.nan
    v[~listed] = np.nan
  q = rng.standard_normal((b, case.t, case.h, case.d)).astype(np.float32)
  # Each sequence's queries are its last t keys.
  q_pos = (np.asarray(case.lengths)[:, None] - case.t + np.arange(case.t)).astype(np.int32)
  k_pos = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy() if case.explicit_k_pos \
      else None
  return Pool(q, k, v, kv_rows, q_pos, k_pos, k_scale, v_scale)


def to_jax(case: Case, pool: Pool):
  dt = jnp.dtype(case.dtype)
  kv_dt = jnp.int8 if case.int8 else dt
  return jnp.asarray(pool.q, dt), jnp.asarray(pool.k, kv_dt), jnp.asarray(pool.v, kv_dt)


def gather_dense(kv_rows, k, v, k_pos, k_scale=None, v_scale=None):
  """The definition of a pool call: each sequence's rows as dense ``[B,S,K,D]`` arrays, padding
  keys empty slots (k_pos = -1) holding NaN."""
  kv_rows = np.asarray(kv_rows)
  b, s = kv_rows.shape
  pad = kv_rows < 0
  take = lambda x: np.asarray(x)[np.where(pad, 0, kv_rows)]
  k_d, v_d = take(k).astype(np.float32), take(v).astype(np.float32)
  k_d[pad] = np.nan
  v_d[pad] = np.nan
  if k_pos is None:
    k_pos = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
  k_pos = np.where(pad, -1, k_pos).astype(np.int32)
  scales = (None, None) if k_scale is None else (take(k_scale), take(v_scale))
  return k_d, v_d, k_pos, scales


def expected(case: Case, pool: Pool, qj, kj, vj):
  # The reference sees exactly the (rounded) values the backend sees.
  k_d, v_d, k_pos, (ks, vs) = gather_dense(
      pool.kv_rows, np.asarray(kj.astype(jnp.float32)), np.asarray(vj.astype(jnp.float32)),
      pool.k_pos, pool.k_scale, pool.v_scale)
  return numpy_reference.attention(
      np.asarray(qj.astype(jnp.float32)), k_d, v_d, pool.q_pos, k_pos, causal=case.causal,
      window=case.window, softcap=case.softcap, k_scale=ks, v_scale=vs)


def tiles(t: int):
  return DECODE_TILES if t <= da.MAX_QUERY_LEN else CHUNK_TILES


def pool_attention(case: Case, pool: Pool, impl: str, q, k, v, kv_rows=None):
  return rkv.attention(q, k, v, kv_rows=pool.kv_rows if kv_rows is None else kv_rows,
                       q_pos=pool.q_pos, k_pos=pool.k_pos, causal=case.causal,
                       window=case.window, softcap=case.softcap, impl=impl,
                       k_scale=pool.k_scale, v_scale=pool.v_scale,
                       block_sizes=tiles(case.t) if impl == "pallas" else None)


def assert_close(dtype: str, o, lse, o_ref, lse_ref):
  tol = TOLERANCES[dtype]
  o = np.asarray(o.astype(jnp.float32))
  lse = np.asarray(lse)
  assert lse.dtype == np.float32
  assert not np.isnan(o).any() and not np.isnan(lse).any(), "a NaN row nobody sees was read"
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
  empty = np.isneginf(lse_ref)
  assert (o[empty] == 0).all(), "rows that see no key must give o = 0"
  np.testing.assert_allclose(o, o_ref, atol=tol["o"][0], rtol=tol["o"][1])
  np.testing.assert_allclose(lse[~empty], lse_ref[~empty], atol=tol["lse"][0],
                             rtol=tol["lse"][1])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_pool_matches_float64_of_gathered_rows(case, impl):
  pool = make_pool(case)
  qj, kj, vj = to_jax(case, pool)
  o, lse = pool_attention(case, pool, impl, qj, kj, vj)
  assert o.shape == pool.q.shape and o.dtype == qj.dtype and lse.shape == pool.q.shape[:3]
  assert_close(case.dtype, o, lse, *expected(case, pool, qj, kj, vj))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("t", [1, 17])  # the decode kernel, the flash kernel
def test_pool_call_equals_dense_call_on_gathered_rows(impl, t):
  # The contract's own words: gathering each sequence's rows and calling rkv.attention on the
  # dense arrays gives the same result, on the same backend.
  case = Case("dense", t=t, lengths=(36, 21), layout="shared_prefix", holes=True)
  pool = make_pool(case, seed=2)
  qj, kj, vj = to_jax(case, pool)
  o, lse = pool_attention(case, pool, impl, qj, kj, vj)
  k_d, v_d, k_pos, _ = gather_dense(pool.kv_rows, pool.k, pool.v, pool.k_pos)
  o_d, lse_d = rkv.attention(qj, jnp.asarray(k_d), jnp.asarray(v_d), q_pos=pool.q_pos,
                             k_pos=k_pos, impl=impl)
  tol = TOLERANCES["float32"]
  np.testing.assert_allclose(np.asarray(o), np.asarray(o_d), atol=tol["o"][0], rtol=tol["o"][1])
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_d), atol=tol["lse"][0],
                             rtol=tol["lse"][1])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("t", [1, 17])  # the decode kernel's bounds from the fill, the flash kernel
def test_kv_fill_on_a_pool_equals_those_keys_made_empty(impl, t):
  # kv_fill counts the row table's entries (indices into S), not pool rows: sequence 0 keeps its
  # first 30 of 36 keys, sequence 1 all of its 21, and the result equals giving the cut keys
  # k_pos = -1, on the same backend.
  case = Case("fill", t=t, lengths=(36, 21), layout="shared_prefix", holes=True,
              explicit_k_pos=True)
  pool = make_pool(case, seed=4)
  qj, kj, vj = to_jax(case, pool)
  s = pool.kv_rows.shape[1]
  fill = np.asarray([30, s], np.int32)
  kw = dict(kv_rows=pool.kv_rows, q_pos=pool.q_pos, impl=impl,
            block_sizes=tiles(t) if impl == "pallas" else None)
  o, lse = rkv.attention(qj, kj, vj, k_pos=pool.k_pos, kv_fill=jnp.asarray(fill), **kw)
  cut = np.where(np.arange(s)[None] < fill[:, None], np.asarray(pool.k_pos), -1).astype(np.int32)
  o_r, lse_r = rkv.attention(qj, kj, vj, k_pos=cut, **kw)
  assert not np.array_equal(np.asarray(cut), np.asarray(pool.k_pos))  # the fill cuts keys
  assert_close("float32", np.asarray(o), np.asarray(lse), np.asarray(o_r), np.asarray(lse_r))


@pytest.mark.parametrize("impl", IMPLS)
def test_all_padding_sees_no_key(impl):
  # Every key is padding over a pool of NaN: o = 0, lse = -inf, whatever k_pos says.
  pool = jnp.full((5, 2, 16), jnp.nan)
  o, lse = rkv.attention(jnp.ones((2, 1, 4, 16)), pool, pool, kv_rows=np.full((2, 9), -1),
                         q_pos=np.full((2, 1), 8), k_pos=np.zeros((2, 9), np.int32), impl=impl)
  assert (np.asarray(o) == 0).all() and np.isneginf(np.asarray(lse)).all()


def test_decode_partials_of_a_pool_merge_to_the_pool_call():
  # Callers that merge the splits with other partials (a host tail) get the same pool reads.
  case = Case("partials", t=2, lengths=(40, 17), holes=True)
  pool = make_pool(case, seed=8)
  qj, kj, vj = to_jax(case, pool)
  kw = dict(kv_rows=pool.kv_rows, q_pos=pool.q_pos, block_sizes=DECODE_TILES, interpret=True)
  o_p, lse_p = da.decode_attention_partials(qj, kj, vj, **kw)
  assert o_p.shape[0] == DECODE_TILES.num_splits
  o, lse = rkv.merge_partials(o_p, lse_p)
  assert_close("float32", o, lse, *expected(case, pool, qj, kj, vj))


# ----------------------------------------------------------------------------------------------
# NaN in a pool row that attention reads propagates (docs/DESIGN.md §3), to every sequence that lists
# the row and to no other.
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("t", [1, 17])
@pytest.mark.parametrize("place", ["k_shared_row", "v_own_row"])
def test_nan_in_a_visible_pool_row_propagates(impl, t, place):
  case = Case("nan", t=t, h=4, k=2, d=16, lengths=(30, 24), layout="shared_prefix")
  pool = make_pool(case, seed=11)
  if place == "k_shared_row":  # the first key, listed by both sequences and seen by every query
    pool.k[pool.kv_rows[0, 0], 1, 3] = np.nan
  else:  # a key only sequence 1 lists, seen by all its queries
    pool.v[pool.kv_rows[1, 20], 0, :] = np.nan
  o, lse = pool_attention(case, pool, impl, *to_jax(case, pool))
  o, lse = np.asarray(o), np.asarray(lse)
  k_d, v_d, k_pos, _ = gather_dense(pool.kv_rows, pool.k, pool.v, pool.k_pos)
  o_ref, lse_ref = numpy_reference.attention(pool.q, k_d, v_d, pool.q_pos, k_pos)
  assert np.isnan(o_ref).any(), "the case must read its NaN"
  if place == "k_shared_row":
    assert np.isnan(o_ref[0]).any() and np.isnan(o_ref[1]).any()
  else:
    assert not np.isnan(o_ref[0]).any()
  np.testing.assert_array_equal(np.isnan(o), np.isnan(o_ref), err_msg="NaN in o differs")
  np.testing.assert_array_equal(np.isnan(lse), np.isnan(lse_ref), err_msg="NaN in lse differs")
  tol = TOLERANCES["float32"]
  ok = ~np.isnan(o_ref)
  np.testing.assert_allclose(o[ok], o_ref[ok], atol=tol["o"][0], rtol=tol["o"][1])


# ----------------------------------------------------------------------------------------------
# Row tables on the device: used under jit without a host sync; rows >= R read a clamped row.
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_device_row_table_under_jit_rows_beyond_the_pool_read_the_last_row(impl):
  # A traced row table works (no host sync to check it: one per layer and step would stall
  # decode); a row >= R then reads row R-1 in every impl, never memory outside the pool.
  case = Case("clamp", t=1, lengths=(20, 13), layout="in_order")
  pool = make_pool(case, seed=6)
  r = pool.k.shape[0]
  pool.k[r - 1], pool.v[r - 1] = pool.k[0], pool.v[0]  # a finite last row
  clamped = pool.kv_rows.copy()
  clamped[1, 3] = r + 100
  qj, kj, vj = to_jax(case, pool)
  fn = jax.jit(lambda rows: pool_attention(case, pool, impl, qj, kj, vj, kv_rows=rows))
  o, lse = fn(jnp.asarray(clamped))
  pool.kv_rows = np.where(clamped >= r, r - 1, clamped)
  assert_close("float32", o, lse, *expected(case, pool, qj, kj, vj))


# ----------------------------------------------------------------------------------------------
# The kernels read rows in place: no gathered [B,S,K,D] copy outside the kernel.
# ----------------------------------------------------------------------------------------------
def _gathers_outside_kernels(jaxpr) -> list:
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      continue  # the kernel body's loads are the in-place reads
    if eqn.primitive.name == "gather":
      found.append(eqn)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          found += _gathers_outside_kernels(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          found += _gathers_outside_kernels(sub)
  return found


@pytest.mark.parametrize("t", [1, 17])
def test_pallas_kernels_make_no_gathered_copy(t):
  case = Case("nocopy", t=t, lengths=(36, 21))
  pool = make_pool(case)
  qj, kj, vj = to_jax(case, pool)
  jaxpr = jax.make_jaxpr(lambda q, k, v, rows: rkv.attention(
      q, k, v, kv_rows=rows, q_pos=pool.q_pos, impl="pallas"))(qj, kj, vj, pool.kv_rows)
  assert not _gathers_outside_kernels(jaxpr.jaxpr)
  # The check can see one: the reference gathers.
  jaxpr = jax.make_jaxpr(lambda q, k, v, rows: rkv.attention(
      q, k, v, kv_rows=rows, q_pos=pool.q_pos, impl="reference"))(qj, kj, vj, pool.kv_rows)
  assert _gathers_outside_kernels(jaxpr.jaxpr)


# (kernel, T, D, kv dtype, options): the pool paths lowered to Triton IR for an H200 (what
# interpret mode cannot check: the gather loads' pointer tensors, tile shapes, dot operands).
TRITON_CONFIGS = [
    ("decode", 1, 128, jnp.bfloat16, dict()),
    ("decode", 4, 80, jnp.int8, dict(k_pos=True, window=64)),
    ("flash", 64, 128, jnp.bfloat16, dict()),
    ("flash", 40, 96, jnp.int8, dict(softcap=30.0)),
]


@pytest.mark.parametrize("config", TRITON_CONFIGS,
                         ids=lambda c: f"{c[0]}_d{c[2]}_{jnp.dtype(c[3]).name}")
def test_pool_kernels_lower_to_verified_triton_ir(config, monkeypatch):
  verified = record_verified_lowerings(monkeypatch)
  kernel, t, d, kv_dt, opts = config
  b, s, h, kh, r = 2, 300, 8, 2, 1000
  q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
  pool = jax.ShapeDtypeStruct((r, kh, d), kv_dt)
  scales = jax.ShapeDtypeStruct((r, kh), jnp.float32) if kv_dt == jnp.int8 else None
  rows = jax.ShapeDtypeStruct((b, s), jnp.int32)
  q_pos = jax.ShapeDtypeStruct((b, t), jnp.int32)
  k_pos = jax.ShapeDtypeStruct((b, s), jnp.int32)
  static = dict(causal=True, window=opts.get("window"), softcap=opts.get("softcap"),
                scale=d**-0.5, interpret=False)
  if kernel == "decode":
    blocks = da.BlockSizes().resolve(batch=b, kv_heads=kh, kv_len=s, rows=16, head_dim=128,
                                     kv_itemsize=jnp.dtype(kv_dt).itemsize)
    traced = da._decode_attention_jit.trace(q, pool, pool, q_pos,
                                            k_pos if opts.get("k_pos") else None, scales,
                                            scales, rows, block_sizes=blocks, **static)
  else:
    traced = fa._flash_attention.trace(q, pool, pool, q_pos, k_pos, scales, scales, rows,
                                       block_sizes=fa.BlockSizes.for_head_dim(d),
                                       count_visits=False, **static)
  traced.lower(lowering_platforms=("cuda",))
  # The decode call's default split merge is a second Pallas kernel (``split_merge="kernel"``).
  assert verified == [True] * (2 if kernel == "decode" else 1)


def test_mosaic_kernel_refuses_pools_so_the_generic_kernel_runs():
  q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
  pool = jax.ShapeDtypeStruct((512, 2, 128), jnp.bfloat16)
  rows = jax.ShapeDtypeStruct((1, 256), jnp.int32)
  assert "kv_rows" in fm.unsupported_reason(q, pool, pool, kv_rows=rows)
  assert not fm.supports(q, pool, pool, kv_rows=rows)


# ----------------------------------------------------------------------------------------------
# Bad input raises ValueError naming the argument, on every impl.
# ----------------------------------------------------------------------------------------------
_R, _B, _S = 12, 2, 8
_ROWS = np.arange(_B * _S, dtype=np.int32).reshape(_B, _S) % _R
BAD_INPUTS = [
    ("kv_rows must have shape", dict(kv_rows=_ROWS[:1])),  # batch 1 for q's 2
    ("kv_rows must have shape", dict(kv_rows=_ROWS[0])),  # rank 1
    ("kv_rows values must be in", dict(kv_rows=np.where(_ROWS == 3, _R, _ROWS))),  # row R
    ("kv_rows values must be in", dict(kv_rows=_ROWS.astype(np.int64) + 2**33)),
    ("kv_rows must be an integer", dict(kv_rows=_ROWS.astype(np.float32))),
    ("k must be a rank-3 pool", dict(k=jnp.zeros((_B, _S, 2, 16)), v=jnp.zeros((_B, _S, 2, 16)))),
    ("v shape", dict(v=jnp.zeros((_R + 1, 2, 16)))),
    ("k_pos", dict(k_pos=np.zeros((_B, _S + 1), np.int32))),
    ("k_scale must have shape", dict(k=jnp.zeros((_R, 2, 16), jnp.int8),
                                     v=jnp.zeros((_R, 2, 16), jnp.int8),
                                     k_scale=jnp.ones((_B, _S, 2)), v_scale=jnp.ones((_B, _S, 2)))),
    ("k_scale", dict(k=jnp.zeros((_R, 2, 16), jnp.int8), v=jnp.zeros((_R, 2, 16), jnp.int8))),
    ("multiple of kv heads", dict(k=jnp.zeros((_R, 3, 16)), v=jnp.zeros((_R, 3, 16)))),
    ("empty pool", dict(k=jnp.zeros((0, 2, 16)), v=jnp.zeros((0, 2, 16)),
                        kv_rows=np.full((_B, _S), -1, np.int32))),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,override", BAD_INPUTS, ids=[f"{i}-{b[0]}" for i, b in
                                                          enumerate(BAD_INPUTS)])
def test_bad_pool_input_raises_value_error_naming_the_argument(name, override, impl):
  kw = dict(q=jnp.zeros((_B, 1, 4, 16)), k=jnp.zeros((_R, 2, 16)), v=jnp.zeros((_R, 2, 16)),
            kv_rows=_ROWS, impl=impl)
  kw.update(override)
  with pytest.raises(ValueError, match=name):
    rkv.attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw)

