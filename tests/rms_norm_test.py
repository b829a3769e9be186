"""rkv.pallas.rms_norm (residual add + RMSNorm in one kernel) against float64 NumPy.

Interpret mode on CPU; the Triton IR of the kernel is lowered and verified for an H200."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from rkv.pallas import rms_norm as rn
from tests.support.triton_ir import record_verified_lowerings

EPS = 1e-5


def _expected(x, h, w, *, plus_one, dtype):
  """float64 NumPy: the sum rounded to the rows' dtype, the norm in float64, the model's scale."""
  x = np.asarray(x, np.float64)
  s = x if h is None else (x + np.asarray(h, np.float64)).astype(dtype).astype(np.float64)
  y = s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + EPS)
  w = np.asarray(w, np.float64)
  if plus_one:
    return s, y * (1.0 + w)
  return s, w * y.astype(dtype).astype(np.float64)


@pytest.mark.parametrize("dim", [64, 80, 4096], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("plus_one", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "norm_only"])
def test_matches_float64(dim, dtype, plus_one, with_residual):
  rng = np.random.default_rng(dim)
  np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
  x = (3 * rng.standard_normal((2, 3, dim))).astype(np_dtype)
  h = rng.standard_normal((2, 3, dim)).astype(np_dtype) if with_residual else None
  w = rng.standard_normal((dim,)).astype(np_dtype)
  args = [jnp.asarray(a) for a in (x, h, w) if a is not None]
  if with_residual:
    s, y = rn.add_rms_norm(*args, eps=EPS, plus_one=plus_one)
  else:
    s, y = jnp.asarray(x), rn.rms_norm(*args, eps=EPS, plus_one=plus_one)
  assert s.dtype == y.dtype == jnp.dtype(dtype) and s.shape == y.shape == x.shape
  want_s, want_y = _expected(x, h, w, plus_one=plus_one, dtype=np_dtype)
  np.testing.assert_array_equal(np.asarray(s, np.float64), want_s)  # one rounding: exact
  # One rounding to the rows' dtype (two for the Llama scale: y, then w * y), and float32 sums.
  tol = dict(rtol=2e-6, atol=2e-6) if dtype == "float32" else dict(rtol=2 ** -7, atol=2 ** -7)
  np.testing.assert_allclose(np.asarray(y, np.float64), want_y, **tol)


def test_equals_the_jnp_reference_at_float32():
  rng = np.random.default_rng(1)
  x, h = (jnp.asarray(rng.standard_normal((5, 96)), jnp.float32) for _ in range(2))
  w = jnp.asarray(rng.standard_normal((96,)), jnp.float32)
  for plus_one in (False, True):
    got = rn.add_rms_norm(x, h, w, eps=EPS, plus_one=plus_one)
    want = rn.add_rms_norm_reference(x, h, w, eps=EPS, plus_one=plus_one)
    for a, b in zip(got, want):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_a_nan_stays_in_its_row():
  x = jnp.ones((3, 64), jnp.float32).at[1, 5].set(jnp.nan)
  s, y = rn.add_rms_norm(x, jnp.ones_like(x), jnp.ones((64,), jnp.float32), eps=EPS)
  y = np.asarray(y)
  assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2]]).all()
  assert np.isnan(np.asarray(s)[1, 5]) and np.isfinite(np.delete(np.asarray(s)[1], 5)).all()


@pytest.mark.parametrize("call,match", [
    (lambda x, w: rn.rms_norm(x, w[:-1], eps=EPS), "weight must have shape"),
    (lambda x, w: rn.add_rms_norm(x, x[:, :-1], w, eps=EPS), "residual must match x"),
    (lambda x, w: rn.add_rms_norm(x, x.astype(jnp.bfloat16), w, eps=EPS), "residual must match"),
    (lambda x, w: rn.rms_norm(x, w, eps=0.0), "eps must be"),
    (lambda x, w: rn.rms_norm(x.astype(jnp.int32), w, eps=EPS), "float array"),
])
def test_bad_input_raises(call, match):
  x = jnp.ones((2, 32), jnp.float32)
  with pytest.raises(ValueError, match=match):
    call(x, jnp.ones((32,), jnp.float32))


@pytest.mark.parametrize("dim,dtype,with_residual", [(4096, jnp.bfloat16, True),
                                                     (2304, jnp.bfloat16, True),
                                                     (4096, jnp.float32, False)],
                         ids=["llama_add", "gemma_width_add", "f32_norm"])
def test_lowers_to_verified_triton_ir(dim, dtype, with_residual, monkeypatch):
  verified = record_verified_lowerings(monkeypatch)
  x = jax.ShapeDtypeStruct((1, dim), dtype)
  w = jax.ShapeDtypeStruct((dim,), dtype)
  traced = rn._add_rms_norm_jit.trace(x, x if with_residual else None, w, eps=EPS,
                                      plus_one=False, num_warps=4, interpret=False)
  traced.lower(lowering_platforms=("cuda",))
  assert verified == [True]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_models_decode_the_same_with_the_fused_norm(monkeypatch, family):
  # $RKV_FUSED_NORM=1 as a model step runs it (resident caches, interpret mode on CPU): Llama's
  # scale and Gemma-3's (1 + w, sandwich norms, per-head q/k norms) give the same greedy tokens
  # and, teacher-forced, the same logits as XLA's norms to float32 rounding. The prompt's
  # prefill rows (2 x 13) also take the kernel: fewer than MAX_ROWS.
  import os
  from rkv import generate as gen
  from rkv import models
  fixtures = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf", family)
  model = models.load_hf(fixtures, jnp.float32, impl="xla")
  tokens = np.load(os.path.join(fixtures, "reference.npz"))["tokens"]
  p = 13
  prompt, seq = tokens[:, :p], tokens[:, :p + 4]

  def run():
    fwd = models.jit_forward(model, last_only=True)
    out = gen.generate(model, prompt, max_new_tokens=4, forward=fwd,
                       caches=models.init_caches(model.config, 2, p + 4))
    logits = gen.decode_logits(model, seq, models.init_caches(model.config, 2, p + 4),
                               prefill_len=p, forward=fwd)
    return out.tokens, logits

  monkeypatch.delenv(rn.FUSED_NORM_ENV, raising=False)
  want_tokens, want_logits = run()
  monkeypatch.setenv(rn.FUSED_NORM_ENV, "1")
  calls = []
  kernel = rn._add_rms_norm_jit
  monkeypatch.setattr(rn, "_add_rms_norm_jit", lambda *a, **k: calls.append(1) or kernel(*a, **k))
  got_tokens, got_logits = run()
  assert calls, "the fused norm was not used"
  np.testing.assert_array_equal(got_tokens, want_tokens)
  np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5)
