"""The shared attention cases and their checks: every backend (tests/attention_test.py), the Mosaic
kernel and the rolling tactics run these against the float64 NumPy reference."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from tests import numpy_reference
from tests.support.tolerances import TOLERANCES


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
  scale_dtype: str = "float32"  # int8 only: the scales' dtype (the cache's default is bfloat16)
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
    Case("decode_int8_bf16_scales_holes", t=2, kv_dtype="int8", scale_dtype="bfloat16",
         positions="holes"),
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
    Case("chunk_int8_bf16_scales", t=17, s=40, kv_dtype="int8", scale_dtype="bfloat16"),
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
    sdt = jnp.dtype(case.scale_dtype)
    k, k_scale = numpy_reference.quantize_int8(np.nan_to_num(k), sdt)
    v, v_scale = numpy_reference.quantize_int8(np.nan_to_num(v), sdt)
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
