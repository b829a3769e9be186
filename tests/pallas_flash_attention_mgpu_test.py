"""The Hopper (Mosaic GPU) prefill kernel against the float64 NumPy reference, and its gate.

The kernel itself cannot run on CPU (Mosaic GPU has no ``pallas_call`` interpret path), so the
numerical cases are ``gpu``-marked and run on the H200. The eligibility predicate and the input
validation are pure shape/dtype logic and run everywhere: they decide whether a call reaches the
kernel at all, so a wrong "yes" there would be a silent wrong answer on the GPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rkv
from rkv.pallas import flash_attention_mgpu as fm
from tests import numpy_reference
from tests.support.tolerances import TOLERANCES


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  b: int = 1
  t: int = 256
  s: int = 256
  h: int = 4
  k: int = 4
  d: int = 128
  dtype: str = "bfloat16"
  causal: bool = True
  scale: float | None = None
  blocks: fm.BlockSizes | None = None

  def __str__(self):
    return self.name


CASES = [
    Case("causal_mha_d128"),
    Case("causal_gqa4_d64", h=8, k=2, d=64, t=384, s=384),
    Case("causal_gqa8_d128_b2", b=2, h=8, k=1),
    Case("noncausal_gqa4_d128", h=8, k=2, t=128, s=384, causal=False),
    Case("noncausal_mha_d64_scale", t=256, s=512, d=64, causal=False, scale=0.3),
    # A prefill chunk at the end of the cache: bottom-right aligned causal mask.
    Case("chunk_at_end_causal", t=128, s=640, h=4, k=2),
    Case("chunk_at_end_kv64", t=256, s=448, h=2, k=1),  # S % 128 != 0: block_kv 64 preset
    Case("causal_d256", t=256, s=256, h=2, k=1, d=256),
    Case("causal_f16", t=256, s=384, h=4, k=2, dtype="float16"),
    Case("single_kv_block", t=128, s=128, h=2, k=2),  # a one-stage ring
    Case("blocks_q128_kv64_3stages", t=512, s=768, h=2, k=1,
         blocks=fm.BlockSizes(block_q=128, block_kv=64, num_stages=3)),
    Case("blocks_kv128_3stages_long", t=1024, s=2048, h=2, k=2,
         blocks=fm.BlockSizes(block_q=64, block_kv=128, num_stages=3)),
]


def make_inputs(case: Case, seed: int = 0):
  rng = np.random.default_rng(seed)
  dt = jnp.dtype(case.dtype)
  q = jnp.asarray(rng.standard_normal((case.b, case.t, case.h, case.d)), dt)
  k = jnp.asarray(rng.standard_normal((case.b, case.s, case.k, case.d)) * 1.5, dt)
  v = jnp.asarray(rng.standard_normal((case.b, case.s, case.k, case.d)), dt)
  return q, k, v


def assert_close(case: Case, o, lse, q, k, v):
  # The reference sees exactly the (rounded) inputs the kernel sees.
  f32 = lambda x: np.asarray(x.astype(jnp.float32))
  o_ref, lse_ref = numpy_reference.attention(f32(q), f32(k), f32(v), causal=case.causal,
                                             scale=case.scale)
  tol = TOLERANCES[case.dtype]
  assert o.shape == q.shape and o.dtype == q.dtype
  assert lse.shape == q.shape[:3] and lse.dtype == jnp.float32
  o, lse = f32(o), np.asarray(lse)
  assert np.isfinite(o).all() and np.isfinite(lse).all()
  np.testing.assert_allclose(o, o_ref, atol=tol["o"][0], rtol=tol["o"][1])
  np.testing.assert_allclose(lse, lse_ref, atol=tol["lse"][0], rtol=tol["lse"][1])


# --------------------------------------------------------------------------------------------
# On the GPU: numerics
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_float64(case):
  q, k, v = make_inputs(case)
  o, lse = fm.flash_attention_mgpu(q, k, v, causal=case.causal, scale=case.scale,
                                   block_sizes=case.blocks)
  assert_close(case, o, lse, q, k, v)


@pytest.mark.gpu
def test_lse_is_natural_log():
  # q = 0 makes every logit 0, so lse = ln(number of visible keys) exactly: row i of a causal
  # prefill with T = S sees i + 1 keys. A log2 LSE would give log2(i + 1).
  t = 256
  q = jnp.zeros((1, t, 2, 128), jnp.bfloat16)
  k = jnp.asarray(np.random.default_rng(1).standard_normal((1, t, 2, 128)), jnp.bfloat16)
  _, lse = fm.flash_attention_mgpu(q, k, k, causal=True)
  np.testing.assert_allclose(np.asarray(lse)[0, :, 0], np.log(np.arange(1, t + 1)), rtol=1e-5)


@pytest.mark.gpu
def test_deterministic():
  q, k, v = make_inputs(Case("det", h=8, k=2))
  o1, l1 = fm.flash_attention_mgpu(q, k, v)
  o2, l2 = fm.flash_attention_mgpu(q, k, v)
  np.testing.assert_array_equal(np.asarray(o1.astype(jnp.float32)),
                                np.asarray(o2.astype(jnp.float32)))
  np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))


@pytest.mark.gpu
def test_dispatch_takes_the_fast_path_when_supported():
  case = Case("dispatch", h=8, k=2)
  q, k, v = make_inputs(case)
  assert fm.supports(q, k, v), fm.unsupported_reason(q, k, v)
  o, lse = rkv.attention(q, k, v, impl="pallas")
  o_fast, lse_fast = fm.flash_attention_mgpu(q, k, v)
  np.testing.assert_array_equal(np.asarray(o.astype(jnp.float32)),
                                np.asarray(o_fast.astype(jnp.float32)))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_fast))
  # Explicit positions fall back to the generic kernel, which must agree within tolerance.
  o_gen, lse_gen = rkv.attention(q, k, v, k_pos=np.broadcast_to(np.arange(case.s), (1, case.s)),
                                 impl="pallas")
  np.testing.assert_allclose(np.asarray(o_gen.astype(jnp.float32)),
                             np.asarray(o.astype(jnp.float32)), atol=2e-2, rtol=2e-2)
  assert_close(case, o_gen, lse_gen, q, k, v)


# --------------------------------------------------------------------------------------------
# Everywhere: the gate and the validation
# --------------------------------------------------------------------------------------------
def _shapes(b=1, t=256, s=256, h=4, kh=2, d=128, dtype=jnp.bfloat16, kv_dtype=None):
  q = jax.ShapeDtypeStruct((b, t, h, d), dtype)
  kv = jax.ShapeDtypeStruct((b, s, kh, d), kv_dtype or dtype)
  return q, kv, kv


def test_reason_none_for_the_plain_prefill():
  assert fm.unsupported_reason(*_shapes()) is None
  assert fm.unsupported_reason(*_shapes(t=128, s=640), causal=True) is None
  assert fm.unsupported_reason(*_shapes(d=64, s=448)) is None  # block_kv 64 preset
  assert fm.unsupported_reason(*_shapes(t=512, s=128), causal=False) is None
  assert fm.unsupported_reason(*_shapes(), scale=0.1) is None


@pytest.mark.parametrize("name,kwargs", [
    ("q_pos", dict(q_pos=np.zeros((1, 256), np.int32))),
    ("k_pos", dict(k_pos=np.arange(256, dtype=np.int32)[None])),
    ("k_scale", dict(k_scale=np.ones((1, 256, 2), np.float32))),
    ("window", dict(window=64)),
    ("softcap", dict(softcap=30.0)),
    ("block_sizes", dict(block_sizes=fm.BlockSizes())),
])
def test_reason_rejects_options(name, kwargs):
  reason = fm.unsupported_reason(*_shapes(), **kwargs)
  assert reason is not None and name in reason


@pytest.mark.parametrize("what,shapes,causal", [
    ("dtype", _shapes(dtype=jnp.float32), True),
    ("dtype", _shapes(kv_dtype=jnp.int8), True),
    ("dtype", _shapes(kv_dtype=jnp.float16), True),
    ("head dim", _shapes(d=96), True),
    ("head dim", _shapes(d=80), True),
    ("T=", _shapes(t=200), True),  # not a multiple of 2 * block_q = 128
    ("S=", _shapes(s=300), True),  # not a multiple of 64
    ("T <= S", _shapes(t=512, s=256), True),  # rows past S would see no key
])
def test_reason_rejects_shapes(what, shapes, causal):
  reason = fm.unsupported_reason(*shapes, causal=causal)
  assert reason is not None and what in reason


def test_supports_is_false_off_hopper():
  if jax.default_backend() == "gpu":
    pytest.skip("checks the non-GPU answer")
  assert not fm.supports(*_shapes())


def test_dispatch_on_cpu_uses_the_generic_kernel():
  # rkv.attention(impl="pallas") must keep interpreting the generic kernel on CPU.
  if jax.default_backend() == "gpu":
    pytest.skip("CPU dispatch")
  case = Case("cpu_dispatch", t=32, s=32, h=2, k=1, d=64, dtype="float32")
  q, k, v = make_inputs(case)
  o, lse = rkv.attention(q, k, v, impl="pallas")
  o_ref, lse_ref = numpy_reference.attention(np.asarray(q), np.asarray(k), np.asarray(v))
  np.testing.assert_allclose(np.asarray(o), o_ref, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(np.asarray(lse), lse_ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("match,kwargs", [
    ("q dtype", dict(dtype=jnp.float32)),
    ("head dim D", dict(d=96)),
    ("T=200", dict(t=200)),
    ("S=300", dict(s=300)),
    ("causal needs T <= S", dict(t=512, s=256)),
])
def test_wrapper_rejects_unsupported_inputs(match, kwargs):
  q, k, v = (jnp.zeros(x.shape, x.dtype) for x in _shapes(**kwargs))
  with pytest.raises(ValueError, match=match):
    fm.flash_attention_mgpu(q, k, v)


def test_wrapper_validates_like_every_backend():
  q, k, v = (jnp.zeros(x.shape, x.dtype) for x in _shapes(h=6, kh=4))
  with pytest.raises(ValueError, match="multiple of kv heads"):
    fm.flash_attention_mgpu(q, k, v)
  q, k, v = (jnp.zeros(x.shape, x.dtype) for x in _shapes())
  with pytest.raises(ValueError, match="block_sizes"):
    fm.flash_attention_mgpu(q, k, v, block_sizes=(64, 128, 2))
  with pytest.raises(ValueError, match="scale"):
    fm.flash_attention_mgpu(q, k, v, scale=-1.0)
  # 4 stages of 128 x 256 K and V tiles: 512 KiB of SMEM, more than an SM has.
  q, k, v = (jnp.zeros(x.shape, x.dtype) for x in _shapes(d=256, s=512))
  with pytest.raises(ValueError, match="SMEM"):
    fm.flash_attention_mgpu(q, k, v, block_sizes=fm.BlockSizes(block_kv=128, num_stages=4))


@pytest.mark.parametrize("kwargs,name", [
    (dict(block_q=32), "block_q"),
    (dict(block_kv=100), "block_kv"),
    (dict(num_stages=1), "num_stages"),
])
def test_block_sizes_reject_bad_values(kwargs, name):
  with pytest.raises(ValueError, match=name):
    fm.BlockSizes(**kwargs)


def test_presets_fit_in_smem():
  for d in (64, 128, 256):
    assert fm.BlockSizes.for_head_dim(d).fits(d)
