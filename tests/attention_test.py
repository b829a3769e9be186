"""The shared attention suite: every backend of ``rkv.attention`` against float64 NumPy.

Each case runs through every ``impl`` (the Pallas kernels in interpret mode on CPU); the rolling
tactics join through ``tests/rolling_attention_test.py``. Tolerances are per dtype and named here.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import rkv
from tests import numpy_reference

# Named tolerances (absolute, relative) on o and on lse. float32 inputs: float32 accumulation over
# a few dozen keys lands near 1e-6. 16-bit inputs: o is rounded to bf16 (2^-8 relative) and the
# kernels feed P to the PV dot in the input dtype, so about 1e-2.
TOLERANCES = {
    "float32": dict(o=(2e-5, 2e-5), lse=(2e-5, 2e-5)),
    "bfloat16": dict(o=(2e-2, 2e-2), lse=(1e-2, 1e-2)),
    "float16": dict(o=(4e-3, 4e-3), lse=(2e-3, 2e-3)),
}
IMPLS = ("reference", "xla", "pallas")


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  b: int = 1
  t: int = 1
  s: int = 37
  h: int = 8
  k: int = 2
  d: int = 64
  dtype: str = "float32"
  kv_dtype: str | None = None  # None: same as dtype; "int8": quantized with scales
  causal: bool = True
  window: int | None = None
  softcap: float | None = None
  scale: float | None = None
  positions: str = "default"  # default | chunk | holes | before | ragged

  def __str__(self):
    return self.name


CASES = [
    Case("decode"),
    Case("decode_b2_mha", b=2, h=4, k=4),
    Case("decode_gqa8_d80", h=8, k=1, d=80, s=45),
    Case("decode_t4_window_softcap", t=4, window=9, softcap=7.0),
    Case("decode_holes_nan", t=3, positions="holes"),
    Case("decode_noncausal", t=2, causal=False, s=29),
    Case("decode_rows_see_nothing", t=2, positions="before"),
    Case("decode_int8", t=2, kv_dtype="int8"),
    Case("decode_bf16", t=1, dtype="bfloat16", s=70),
    Case("decode_f16_d96", t=1, dtype="float16", d=96),
    Case("decode_ragged_batch", b=3, t=1, positions="ragged"),
    Case("chunk_d80_gqa4", t=19, s=53, h=8, k=2, d=80, positions="chunk"),
    Case("chunk_mha_window", t=24, s=24, h=2, k=2, window=5),
    Case("chunk_gqa8_softcap_scale", t=17, s=40, h=8, k=1, softcap=3.0, scale=0.3),
    Case("chunk_holes_nan", t=20, s=33, positions="holes"),
    Case("chunk_noncausal_bf16", t=18, s=31, dtype="bfloat16", causal=False),
    Case("chunk_rows_see_nothing", t=17, s=21, positions="before"),
    Case("chunk_int8_d256", t=17, s=19, h=2, k=1, d=256, kv_dtype="int8"),
]


def make_inputs(case: Case, seed: int = 0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((case.b, case.t, case.h, case.d)).astype(np.float32)
  k = rng.standard_normal((case.b, case.s, case.k, case.d)).astype(np.float32) * 1.5
  v = rng.standard_normal((case.b, case.s, case.k, case.d)).astype(np.float32)
  k_pos = np.broadcast_to(np.arange(case.s, dtype=np.int32), (case.b, case.s)).copy()
  q_pos = np.broadcast_to(np.arange(case.t, dtype=np.int32) + case.s - case.t, (case.b, case.t)).copy()
  if case.positions == "chunk":  # a chunk in the middle of the cache: later cells are the future
    q_pos = q_pos - case.s // 3
  elif case.positions == "holes":  # empty slots hold NaN and must not leak
    holes = rng.random((case.b, case.s)) < 0.3
    holes[:, -1] = False
    k_pos[holes] = -1
    k[holes] = np.nan
    v[holes] = np.nan
  elif case.positions == "before":  # the first query rows precede every key: they see nothing
    k_pos = k_pos + 5
    q_pos[:, 0] = 2
  elif case.positions == "ragged":  # each batch row has its own fill level
    for i in range(case.b):
      fill = case.s - 7 * i
      k_pos[i, fill:] = -1
      k[i, fill:] = np.nan
      v[i, fill:] = np.nan
      q_pos[i] = fill - case.t + np.arange(case.t)
  k_scale = v_scale = None
  if case.kv_dtype == "int8":
    k, k_scale = numpy_reference.quantize_int8(np.nan_to_num(k))
    v, v_scale = numpy_reference.quantize_int8(np.nan_to_num(v))
  return q, k, v, q_pos, k_pos, k_scale, v_scale


def to_jax(case: Case, q, k, v):
  dt = jnp.dtype(case.dtype)
  kv_dt = jnp.int8 if case.kv_dtype == "int8" else dt
  return jnp.asarray(q, dt), jnp.asarray(k, kv_dt), jnp.asarray(v, kv_dt)


def expected(case: Case, qj, kj, vj, q_pos, k_pos, k_scale, v_scale):
  # The reference sees exactly the (rounded) inputs the backend sees.
  return numpy_reference.attention(
      np.asarray(qj.astype(jnp.float32)), np.asarray(kj.astype(jnp.float32)),
      np.asarray(vj.astype(jnp.float32)), q_pos, k_pos, causal=case.causal, window=case.window,
      softcap=case.softcap, scale=case.scale, k_scale=k_scale, v_scale=v_scale)


def assert_close(case: Case, o, lse, o_ref, lse_ref):
  tol = TOLERANCES[case.dtype]
  o = np.asarray(o.astype(jnp.float32))
  lse = np.asarray(lse)
  assert lse.dtype == np.float32
  assert not np.isnan(o).any() and not np.isnan(lse).any()
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
  empty = np.isneginf(lse_ref)
  assert (o[empty] == 0).all(), "rows that see no key must give o = 0"
  np.testing.assert_allclose(o, o_ref, atol=tol["o"][0], rtol=tol["o"][1])
  finite = ~empty
  np.testing.assert_allclose(lse[finite], lse_ref[finite], atol=tol["lse"][0], rtol=tol["lse"][1])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_attention_matches_float64(case, impl):
  q, k, v, q_pos, k_pos, k_scale, v_scale = make_inputs(case)
  qj, kj, vj = to_jax(case, q, k, v)
  o, lse = rkv.attention(qj, kj, vj, q_pos=q_pos, k_pos=k_pos, causal=case.causal,
                         window=case.window, softcap=case.softcap, scale=case.scale, impl=impl,
                         k_scale=k_scale, v_scale=v_scale)
  assert o.shape == q.shape and o.dtype == qj.dtype
  assert lse.shape == q.shape[:3]
  assert_close(case, o, lse, *expected(case, qj, kj, vj, q_pos, k_pos, k_scale, v_scale))


@pytest.mark.parametrize("impl", IMPLS)
def test_lse_is_natural_log(impl):
  # q = 0 makes every logit 0, so lse = ln(number of visible keys) exactly; log2 would give
  # log2(n) and fail.
  b, t, s, h, d = 1, 2, 24, 4, 64
  q = jnp.zeros((b, t, h, d), jnp.float32)
  k = jnp.asarray(np.random.default_rng(1).standard_normal((b, s, 2, d)), jnp.float32)
  o, lse = rkv.attention(q, k, k, impl=impl)
  np.testing.assert_allclose(np.asarray(lse)[0, :, 0], np.log([s - 1.0, s]), rtol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("t", [1, 20])
def test_deterministic(impl, t):
  case = Case("det", t=t, s=45, positions="holes")
  q, k, v, q_pos, k_pos, *_ = make_inputs(case, seed=3)
  run = lambda: rkv.attention(*to_jax(case, q, k, v), q_pos=q_pos, k_pos=k_pos, impl=impl)
  (o1, l1), (o2, l2) = run(), run()
  np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
  np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))


@pytest.mark.parametrize("impl", ("reference", "xla"))
@pytest.mark.parametrize("split", [0, 13, 37])
def test_merge_of_split_equals_unsplit(impl, split):
  # split 0 and split S leave one side empty (lse = -inf everywhere on that side).
  case = Case("merge", t=3, s=37, positions="holes")
  q, k, v, q_pos, k_pos, *_ = make_inputs(case, seed=5)
  qj, kj, vj = to_jax(case, q, k, v)
  kw = dict(q_pos=q_pos, impl=impl)
  full = rkv.attention(qj, kj, vj, k_pos=k_pos, **kw)
  pos_a = np.where(np.arange(case.s) < split, k_pos, -1)
  pos_b = np.where(np.arange(case.s) >= split, k_pos, -1)
  part_a = rkv.attention(qj, kj, vj, k_pos=pos_a, **kw)
  part_b = rkv.attention(qj, kj, vj, k_pos=pos_b, **kw)
  o, lse = rkv.merge(*part_a, *part_b)
  np.testing.assert_allclose(np.asarray(o), np.asarray(full[0]), atol=2e-6, rtol=2e-6)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(full[1]), atol=2e-6, rtol=2e-6)


def test_merge_both_empty_gives_zero_and_neg_inf():
  o = jnp.ones((1, 2, 3, 4))
  lse = jnp.full((1, 2, 3), -jnp.inf)
  mo, ml = rkv.merge(o, lse, 2 * o, lse)
  assert (np.asarray(mo) == 0).all() and np.isneginf(np.asarray(ml)).all()


def test_merge_rejects_mismatched_shapes():
  with pytest.raises(ValueError, match="o_b"):
    rkv.merge(jnp.zeros((1, 2, 3, 4)), jnp.zeros((1, 2, 3)), jnp.zeros((1, 2, 3, 5)),
              jnp.zeros((1, 2, 3)))
  with pytest.raises(ValueError, match="lse"):
    rkv.merge(jnp.zeros((1, 2, 3, 4)), jnp.zeros((1, 2)), jnp.zeros((1, 2, 3, 4)),
              jnp.zeros((1, 2, 3)))


BAD_INPUTS = [
    ("k", dict(k=jnp.zeros((1, 8, 3, 16)), v=jnp.zeros((1, 8, 3, 16)))),  # H=8 % K=3
    ("v", dict(v=jnp.zeros((1, 9, 2, 16)))),
    ("q", dict(q=jnp.zeros((1, 2, 8)))),
    ("head dim", dict(k=jnp.zeros((1, 8, 2, 32)), v=jnp.zeros((1, 8, 2, 32)))),
    ("k_scale", dict(k=jnp.zeros((1, 8, 2, 16), jnp.int8), v=jnp.zeros((1, 8, 2, 16), jnp.int8))),
    ("q_pos", dict(q_pos=jnp.zeros((1, 3), jnp.int32))),
    ("k_pos", dict(k_pos=jnp.zeros((1, 8), jnp.float32))),
    ("window", dict(window=0)),
    ("softcap", dict(softcap=-1.0)),
    ("impl", dict(impl="cuda")),
    # inf passed "> 0" (every logit inf or NaN); "no" is truthy (causal ran silently).
    ("scale must be a finite", dict(scale=float("inf"))),
    ("softcap must be None or a finite", dict(softcap=float("inf"))),
    ("causal must be a bool", dict(causal="no")),
    # Host positions beyond int32 used to wrap to other positions on the cast.
    ("q_pos values must be in", dict(q_pos=np.array([[0, 2**31]], np.int64))),
    ("k_pos values must be in", dict(k_pos=np.arange(8, dtype=np.int64)[None] + 2**31 - 4)),
    ("q_pos values must be in", dict(q_pos=[[0, -2**40]])),
    ("dtype", dict(k=jnp.zeros((1, 8, 2, 16), jnp.int32), v=jnp.zeros((1, 8, 2, 16), jnp.int32))),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,override", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_value_error_naming_the_argument(name, override, impl):
  kw = dict(q=jnp.zeros((1, 2, 8, 16)), k=jnp.zeros((1, 8, 2, 16)), v=jnp.zeros((1, 8, 2, 16)),
            impl=impl)
  kw.update(override)
  with pytest.raises(ValueError, match=name):
    rkv.attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw)


# ----------------------------------------------------------------------------------------------
# NaN that attention reads propagates (DESIGN.md §3): the backends and the CPU kernel give NaN
# exactly where the float64 reference does, and the same finite values everywhere else.
# ----------------------------------------------------------------------------------------------
def _cpu_kernel_attention(q, k, v, q_pos, k_pos):
  from rkv.offload import cpu_attention
  return cpu_attention.cpu_attention(np.asarray(q), np.asarray(k), np.asarray(v), q_pos=q_pos,
                                     k_pos=k_pos)


# (what is NaN, where): q row 0 head 0 (one element); K of a cell every query sees (one element);
# K of the last cell, which in a chunk only the last query sees (the others must stay finite: a
# masked key is never read); V of a cell every query sees (its whole row, so o is NaN in every
# column of the rows that read it).
NAN_PLACES = ("q", "k_seen_by_all", "k_seen_by_last", "v_seen_by_all")


def _poison(place, q, k, v):
  q, k, v = q.copy(), k.copy(), v.copy()
  if place == "q":
    q[0, 0, 0, 5] = np.nan
  elif place == "k_seen_by_all":
    k[0, 3, 0, 7] = np.nan
  elif place == "k_seen_by_last":
    k[0, -1, 1, 0] = np.nan
  else:
    v[0, 3, 1, :] = np.nan
  return q, k, v


@pytest.mark.parametrize("impl", IMPLS + ("cpu_kernel",))
@pytest.mark.parametrize("t", [1, 17])  # the decode kernel, the flash kernel
@pytest.mark.parametrize("place", NAN_PLACES)
def test_nan_that_attention_reads_propagates(impl, t, place):
  case = Case("nan", t=t, s=24, h=4, k=2, d=16, positions="holes")  # NaN holes must stay quiet
  q, k, v, q_pos, k_pos, _, _ = make_inputs(case, seed=11)
  k_pos[:, [3, case.s - 1]] = [3, case.s - 1]  # the poisoned cells are not holes
  q, k, v = _poison(place, q, k, v)
  if impl == "cpu_kernel":
    o, lse = _cpu_kernel_attention(q, k, v, q_pos, k_pos)
  else:
    o, lse = rkv.attention(*to_jax(case, q, k, v), q_pos=q_pos, k_pos=k_pos, impl=impl)
  o, lse = np.asarray(o, np.float32), np.asarray(lse)
  o_ref, lse_ref = numpy_reference.attention(q, k, v, q_pos, k_pos)
  assert np.isnan(o_ref).any(), "the case must read its NaN"
  np.testing.assert_array_equal(np.isnan(o), np.isnan(o_ref), err_msg="NaN in o differs")
  np.testing.assert_array_equal(np.isnan(lse), np.isnan(lse_ref), err_msg="NaN in lse differs")
  if place != "v_seen_by_all":  # a NaN logit poisons the row's lse as well
    assert np.isnan(lse_ref).any()
  ok = ~np.isnan(o_ref)
  tol = TOLERANCES["float32"]
  np.testing.assert_allclose(o[ok], o_ref[ok], atol=tol["o"][0], rtol=tol["o"][1])
  ok = ~np.isnan(lse_ref) & ~np.isneginf(lse_ref)
  np.testing.assert_allclose(lse[ok], lse_ref[ok], atol=tol["lse"][0], rtol=tol["lse"][1])


def test_merge_propagates_a_nan_partial():
  o = jnp.ones((1, 2, 3, 4))
  lse = jnp.zeros((1, 2, 3))
  nan_lse = lse.at[0, 0, 0].set(jnp.nan)
  nan_o = o.at[0, 1, 2, 3].set(jnp.nan)
  for o_a, lse_a in ((o, nan_lse), (nan_o, lse)):
    for o_b, lse_b in ((o, lse), (jnp.zeros_like(o), jnp.full_like(lse, -jnp.inf))):
      mo, ml = rkv.merge(o_a, lse_a, o_b, lse_b)
      mo, ml = np.asarray(mo), np.asarray(ml)
      assert np.isnan(mo[0, 0, 0]).all() == bool(np.isnan(lse_a[0, 0, 0]))
      assert np.isnan(ml[0, 0, 0]) == bool(np.isnan(lse_a[0, 0, 0]))
      assert np.isnan(mo[0, 1, 2, 3]) == bool(np.isnan(o_a[0, 1, 2, 3]))
      assert np.isnan(mo).sum() == (4 if np.isnan(lse_a).any() else 1)
      assert np.isnan(ml).sum() == int(np.isnan(lse_a).sum())


@pytest.mark.parametrize("impl", IMPLS + ("cpu_kernel",))
@pytest.mark.parametrize("t", [1, 17])
def test_no_keys_gives_zero_and_neg_inf_on_every_backend(impl, t):
  # S = 0 raised ZeroDivisionError (xla) and a reduction error (reference) where the kernels
  # returned the no-key answer.
  q = np.ones((1, t, 4, 16), np.float32)
  k = np.zeros((1, 0, 2, 16), np.float32)
  if impl == "cpu_kernel":
    o, lse = _cpu_kernel_attention(q, k, k, None, None)
  else:
    o, lse = rkv.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(k), impl=impl)
  assert o.shape == q.shape and lse.shape == q.shape[:3]
  assert (np.asarray(o) == 0).all() and np.isneginf(np.asarray(lse)).all()
