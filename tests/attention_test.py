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
from tests.support.attention_cases import CASES, Case, assert_close, expected, make_inputs, to_jax

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
    ("dtype", dict(k=jnp.zeros((1, 8, 2, 16), jnp.int32), v=jnp.zeros((1, 8, 2, 16), jnp.int32))),
]


@pytest.mark.parametrize("name,override", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_value_error_naming_the_argument(name, override):
  kw = dict(q=jnp.zeros((1, 2, 8, 16)), k=jnp.zeros((1, 8, 2, 16)), v=jnp.zeros((1, 8, 2, 16)))
  kw.update(override)
  with pytest.raises(ValueError, match=name):
    rkv.attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw)
