"""The shared attention suite: every backend of ``rkv.attention`` against float64 NumPy.

Each case runs through every ``impl`` (the Pallas kernels in interpret mode on CPU); the rolling
tactics join through ``tests/rolling_attention_test.py``. The cases and checks are
``tests/support/attention_cases.py``, the tolerances ``tests/support/tolerances.py``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import rkv
from tests import numpy_reference
from tests.support.attention_cases import CASES, Case, assert_close, expected, make_inputs, to_jax
from tests.support.tolerances import TOLERANCES

IMPLS = ("reference", "xla", "pallas")


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
# NaN that attention reads propagates (docs/DESIGN.md §3): the backends and the CPU kernel give NaN
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


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("t", [1, 17])  # the decode kernel (its fast path), the flash kernel
@pytest.mark.parametrize("positions", ["default", "holes"])
def test_kv_fill_marks_the_slots_beyond_it_empty(impl, t, positions):
  # attention(kv_fill=...) equals float64 NumPy with the slots at indices >= kv_fill[b] given
  # k_pos = -1, on every backend; NaN in those slots (a cache's unwritten cells) is never read.
  case = Case("fill", t=t, s=60, h=4, k=2, d=16, b=2, positions=positions)
  q, k, v, q_pos, k_pos, _, _ = make_inputs(case, seed=23)
  fill = np.asarray([41, 60], np.int32)
  k[0, 41:], v[0, 41:] = np.nan, np.nan
  o, lse = rkv.attention(*to_jax(case, q, k, v), q_pos=q_pos, k_pos=k_pos, impl=impl,
                         kv_fill=jnp.asarray(fill))
  base = np.broadcast_to(np.arange(case.s), (2, case.s)) if k_pos is None else np.asarray(k_pos)
  filled = np.where(np.arange(case.s)[None] < fill[:, None], base, -1).astype(np.int32)
  o_ref, lse_ref = numpy_reference.attention(q, k, v, q_pos, filled)
  o, lse = np.asarray(o, np.float32), np.asarray(lse)
  assert not np.isnan(o).any() and not np.isnan(lse).any()
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
  tol = TOLERANCES["float32"]
  np.testing.assert_allclose(o, o_ref, atol=tol["o"][0], rtol=tol["o"][1])
  ok = ~np.isneginf(lse_ref)
  np.testing.assert_allclose(lse[ok], lse_ref[ok], atol=tol["lse"][0], rtol=tol["lse"][1])
