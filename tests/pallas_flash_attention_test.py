"""The Pallas flash-attention kernel (interpret mode on CPU) against the float64 NumPy reference.

Tiny tiles (16) make several full and partial Q/KV tiles per call, so the online softmax, the
overhang masks (T, S, D not tile multiples) and the tile-skipping ranges are all exercised.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rkv.pallas import flash_attention as fa
from tests import numpy_reference
from tests.support.tolerances import TOLERANCES
from tests.support.triton_ir import record_verified_lowerings

TINY = fa.BlockSizes(block_q=16, block_k=16)


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  b: int = 1
  t: int = 20
  s: int = 45
  h: int = 4
  k: int = 2
  d: int = 64
  dtype: str = "float32"
  int8: bool = False
  causal: bool = True
  window: int | None = None
  softcap: float | None = None
  scale: float | None = None
  positions: str = "default"  # default | chunk | holes | before | ragged | hole_block
  blocks: fa.BlockSizes | None = TINY

  def __str__(self):
    return self.name


CASES = [
    Case("prefill_mha_tiny_tiles", t=45, s=45, h=2, k=2),
    Case("chunk_d80_gqa4", t=19, s=53, h=8, k=2, d=80, positions="chunk"),
    Case("noncausal_gqa8_bq16_bk32", t=5, s=40, h=8, k=1, causal=False,
         blocks=fa.BlockSizes(block_q=16, block_k=32)),
    Case("window_causal", t=50, s=50, window=7),
    Case("window_noncausal", t=21, s=47, causal=False, window=6, positions="chunk"),
    Case("softcap_scale_bq32", t=33, s=40, softcap=5.0, scale=0.3,
         blocks=fa.BlockSizes(block_q=32, block_k=16)),
    Case("holes_nan", t=20, s=53, positions="holes"),
    Case("hole_block_nan", t=20, s=64, positions="hole_block"),
    Case("rows_see_nothing", t=17, s=21, positions="before"),
    Case("ragged_batch", b=3, t=4, s=50, positions="ragged"),
    Case("decode_t1", t=1, s=70, h=8, k=1),
    Case("int8_holes_nan_scales", t=18, s=37, int8=True, positions="holes"),
    Case("int8_d80_gqa4", t=16, s=40, h=8, k=2, d=80, int8=True),
    Case("int8_d256", t=17, s=19, h=2, k=1, d=256, int8=True),
    Case("bf16_gqa4_default_blocks", t=64, s=96, h=8, k=2, dtype="bfloat16", blocks=None),
    Case("bf16_window_softcap", t=40, s=40, dtype="bfloat16", window=9, softcap=7.0),
    Case("f16_d96", t=24, s=37, d=96, dtype="float16"),
]


def make_inputs(case: Case, seed: int = 0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((case.b, case.t, case.h, case.d)).astype(np.float32)
  k = rng.standard_normal((case.b, case.s, case.k, case.d)).astype(np.float32) * 1.5
  v = rng.standard_normal((case.b, case.s, case.k, case.d)).astype(np.float32)
  k_pos = np.broadcast_to(np.arange(case.s, dtype=np.int32), (case.b, case.s)).copy()
  q_pos = np.broadcast_to(np.arange(case.t, dtype=np.int32) + case.s - case.t,
                          (case.b, case.t)).copy()
  empty = np.zeros((case.b, case.s), bool)
  if case.positions == "chunk":  # a chunk in the middle of S: the later cells are its future
    q_pos = q_pos - case.s // 3
  elif case.positions == "holes":  # scattered empty slots holding NaN
    empty = rng.random((case.b, case.s)) < 0.3
    empty[:, -1] = False
  elif case.positions == "hole_block":  # a whole interior KV tile empty (skipped inside [lo,hi))
    empty[:, 16:32] = True
  elif case.positions == "before":  # the first query precedes every key: it sees nothing
    k_pos = k_pos + 5
    q_pos[:, 0] = 2
  elif case.positions == "ragged":  # each batch row has its own fill level
    for i in range(case.b):
      fill = case.s - 7 * i
      empty[i, fill:] = True
      q_pos[i] = fill - case.t + np.arange(case.t)
  k_pos[empty] = -1
  k[empty] = np.nan
  v[empty] = np.nan
  k_scale = v_scale = None
  if case.int8:
    k, k_scale = numpy_reference.quantize_int8(np.nan_to_num(k))
    v, v_scale = numpy_reference.quantize_int8(np.nan_to_num(v))
    k_scale[empty] = np.nan  # scales of empty slots are garbage too
    v_scale[empty] = np.nan
  return q, k, v, q_pos, k_pos, k_scale, v_scale


def to_jax(case: Case, q, k, v):
  dt = jnp.dtype(case.dtype)
  kv_dt = jnp.int8 if case.int8 else dt
  return jnp.asarray(q, dt), jnp.asarray(k, kv_dt), jnp.asarray(v, kv_dt)


def options(case: Case):
  return dict(causal=case.causal, window=case.window, softcap=case.softcap, scale=case.scale)


def expected(case: Case, qj, kj, vj, q_pos, k_pos, k_scale, v_scale):
  # The reference sees exactly the (rounded) inputs the kernel sees.
  return numpy_reference.attention(
      np.asarray(qj.astype(jnp.float32)), np.asarray(kj.astype(jnp.float32)),
      np.asarray(vj.astype(jnp.float32)), q_pos, k_pos, k_scale=k_scale, v_scale=v_scale,
      **options(case))


def assert_close(dtype: str, o, lse, o_ref, lse_ref):
  tol = TOLERANCES[dtype]
  o = np.asarray(o.astype(jnp.float32))
  lse = np.asarray(lse)
  assert lse.dtype == np.float32
  assert not np.isnan(o).any() and not np.isnan(lse).any()
  empty = np.isneginf(lse_ref)
  np.testing.assert_array_equal(np.isneginf(lse), empty)
  assert (o[empty] == 0).all(), "rows that see no key must give o = 0"
  np.testing.assert_allclose(o, o_ref, atol=tol["o"][0], rtol=tol["o"][1])
  np.testing.assert_allclose(lse[~empty], lse_ref[~empty], atol=tol["lse"][0],
                             rtol=tol["lse"][1])


@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_matches_float64(case):
  q, k, v, q_pos, k_pos, k_scale, v_scale = make_inputs(case)
  qj, kj, vj = to_jax(case, q, k, v)
  o, lse = fa.flash_attention(qj, kj, vj, q_pos=q_pos, k_pos=k_pos, k_scale=k_scale,
                              v_scale=v_scale, block_sizes=case.blocks, **options(case))
  assert o.shape == q.shape and o.dtype == qj.dtype
  assert lse.shape == q.shape[:3]
  assert_close(case.dtype, o, lse, *expected(case, qj, kj, vj, q_pos, k_pos, k_scale, v_scale))


@pytest.mark.parametrize("case", [c for c in CASES if c.dtype == "float32"] + [CASES[-3]], ids=str)
def test_jnp_reference_matches_float64(case):
  q, k, v, q_pos, k_pos, k_scale, v_scale = make_inputs(case)
  qj, kj, vj = to_jax(case, q, k, v)
  o, lse = fa.flash_attention_reference(qj, kj, vj, q_pos=q_pos, k_pos=k_pos, k_scale=k_scale,
                                        v_scale=v_scale, **options(case))
  assert o.dtype == qj.dtype and lse.dtype == jnp.float32
  assert_close(case.dtype, o, lse, *expected(case, qj, kj, vj, q_pos, k_pos, k_scale, v_scale))


def test_lse_is_natural_log():
  # q = 0 makes every logit 0, so lse = ln(number of visible keys); a log2 lse would fail.
  s = 40
  q = jnp.zeros((1, 3, 2, 64), jnp.float32)
  k = jnp.asarray(np.random.default_rng(1).standard_normal((1, s, 1, 64)), jnp.float32)
  _, lse = fa.flash_attention(q, k, k, block_sizes=TINY)
  np.testing.assert_allclose(np.asarray(lse)[0, :, 0], np.log([s - 2.0, s - 1.0, s]), rtol=1e-6)


@pytest.mark.parametrize("case", [CASES[6], CASES[11]], ids=str)
def test_deterministic(case):
  q, k, v, q_pos, k_pos, k_scale, v_scale = make_inputs(case, seed=3)
  run = lambda: fa.flash_attention(*to_jax(case, q, k, v), q_pos=q_pos, k_pos=k_pos,
                                   k_scale=k_scale, v_scale=v_scale, block_sizes=case.blocks)
  (o1, l1), (o2, l2) = run(), run()
  np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
  np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))


# ------------------------------------------------------------------------------------------
# Tile skipping: the kernel reports how many KV tiles each program computed.
# ------------------------------------------------------------------------------------------
def _visits(case: Case, blocks=TINY, seed=0):
  q, k, v, q_pos, k_pos, k_scale, v_scale = make_inputs(case, seed)
  qj, kj, vj = to_jax(case, q, k, v)
  o, lse, visits = fa.flash_attention_block_visits(
      qj, kj, vj, q_pos=q_pos, k_pos=k_pos, k_scale=k_scale, v_scale=v_scale,
      block_sizes=blocks, **options(case))
  assert_close(case.dtype, o, lse, *expected(case, qj, kj, vj, q_pos, k_pos, k_scale, v_scale))
  return np.asarray(visits)


def test_causal_prefill_visits_only_the_lower_triangle():
  # T = S = 128, 16-tiles: Q tile i (positions 16i..16i+15) sees KV tiles 0..i, so i + 1 visits
  # and 36 of 64 tiles in all. Without skipping every program would visit all 8.
  visits = _visits(Case("p", t=128, s=128, h=2, k=1))
  np.testing.assert_array_equal(visits, np.broadcast_to(np.arange(1, 9), (1, 2, 8)))


def test_noncausal_visits_every_tile():
  visits = _visits(Case("p", t=32, s=80, h=2, k=1, causal=False))
  np.testing.assert_array_equal(visits, 5)


def test_sliding_window_visits_a_band():
  # window 16 with 16-tiles: Q tile i sees KV tiles i-1 and i (positions 16i-15 .. 16i+15).
  visits = _visits(Case("p", t=128, s=128, h=2, k=1, window=16))
  np.testing.assert_array_equal(visits[0, 0], [1] + [2] * 7)


def test_empty_interior_tile_is_skipped():
  # KV tile 1 (slots 16..31) is empty and NaN. Q tile i sees tiles 0..i except 1; for Q tiles
  # 2 and 3 it lies inside [lo, hi), so only the in-loop branch can skip it.
  case = Case("p", t=64, s=64, h=2, k=1, positions="hole_block")
  np.testing.assert_array_equal(_visits(case)[0, 0], [1, 1, 2, 3])
  ranged_only = fa.BlockSizes(block_q=16, block_k=16, skip_interior=False)
  np.testing.assert_array_equal(_visits(case, ranged_only)[0, 0], [1, 1, 3, 4])


def test_queries_that_see_nothing_visit_nothing():
  # Every key lies in the future of the chunk: lo = hi, no tile at all, o = 0, lse = -inf.
  case = Case("p", t=16, s=48, h=2, k=1)
  q, k, v, _, k_pos, *_ = make_inputs(case)
  q_pos = np.full((1, 16), -3, np.int32)
  o, lse, visits = fa.flash_attention_block_visits(*to_jax(case, q, k, v), q_pos=q_pos,
                                                   k_pos=k_pos, block_sizes=TINY)
  assert (np.asarray(visits) == 0).all()
  assert (np.asarray(o) == 0).all() and np.isneginf(np.asarray(lse)).all()


def test_block_sizes_presets_are_valid():
  for d in (64, 80, 96, 128, 256):
    assert isinstance(fa.BlockSizes.for_head_dim(d), fa.BlockSizes)
  assert fa.BlockSizes.for_interpret().block_q >= 16


# ------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------
BAD_INPUTS = [
    ("H=8 must be a multiple", dict(k=jnp.zeros((1, 8, 3, 16)), v=jnp.zeros((1, 8, 3, 16)))),
    ("v shape", dict(v=jnp.zeros((1, 9, 2, 16)))),
    ("q must be rank 4", dict(q=jnp.zeros((1, 2, 8)))),
    ("k_scale", dict(k=jnp.zeros((1, 8, 2, 16), jnp.int8), v=jnp.zeros((1, 8, 2, 16), jnp.int8))),
    ("q_pos", dict(q_pos=jnp.zeros((1, 3), jnp.int32))),
    ("k_pos", dict(k_pos=jnp.zeros((1, 8), jnp.float32))),
    ("window", dict(window=0)),
    ("softcap", dict(softcap=-1.0)),
    ("scale", dict(scale=0.0)),
    ("block_sizes", dict(block_sizes=(16, 16))),
]


@pytest.mark.parametrize("match,override", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_value_error_naming_the_argument(match, override):
  kw = dict(q=jnp.zeros((1, 2, 8, 16)), k=jnp.zeros((1, 8, 2, 16)), v=jnp.zeros((1, 8, 2, 16)))
  kw.update(override)
  with pytest.raises(ValueError, match=match):
    fa.flash_attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw)
  if "block_sizes" not in override:
    kw = dict(q=jnp.zeros((1, 2, 8, 16)), k=jnp.zeros((1, 8, 2, 16)), v=jnp.zeros((1, 8, 2, 16)))
    kw.update(override)
    with pytest.raises(ValueError, match=match):
      fa.flash_attention_reference(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw)


@pytest.mark.parametrize("name,value", [("block_q", 24), ("block_k", 8), ("num_warps", 0)])
def test_bad_block_sizes(name, value):
  with pytest.raises(ValueError, match=name):
    fa.BlockSizes(**{name: value})


# ------------------------------------------------------------------------------------------
# The compiled path: lower the kernel to Triton IR for an H200 without a GPU.
# ------------------------------------------------------------------------------------------
TRITON_CONFIGS = [
    # (B, T, S, H, K, D, q dtype, kv dtype, options)
    (1, 256, 256, 4, 2, 128, jnp.bfloat16, jnp.bfloat16, dict()),
    (1, 100, 300, 4, 1, 80, jnp.bfloat16, jnp.bfloat16, dict(window=64, softcap=30.0)),
    (1, 100, 300, 2, 2, 96, jnp.float32, jnp.float32, dict(causal=False)),
    (2, 64, 200, 8, 2, 64, jnp.bfloat16, jnp.int8, dict(count_visits=True)),
    (1, 64, 200, 4, 2, 128, jnp.bfloat16, jnp.int8, dict(scale_dtype=jnp.bfloat16)),
    (1, 64, 256, 2, 1, 256, jnp.float16, jnp.float16,
     dict(block_sizes=fa.BlockSizes(block_q=64, block_k=32, skip_interior=False))),
]


@pytest.mark.parametrize("config", TRITON_CONFIGS, ids=lambda c: f"d{c[5]}_{jnp.dtype(c[7]).name}"
                         + ("_bf16_scales" if "scale_dtype" in c[8] else ""))
def test_lowers_to_verified_triton_ir(config, monkeypatch):
  # Catches what interpret mode cannot: non-power-of-two tiles, unsupported primitives, bad dot
  # operands. Uses private jax hooks (the only way to name a GPU on a CPU host); skips if moved.
  verified = record_verified_lowerings(monkeypatch)
  b, t, s, h, kh, d, q_dt, kv_dt, opts = config
  opts = dict(opts)
  q = jax.ShapeDtypeStruct((b, t, h, d), q_dt)
  k = jax.ShapeDtypeStruct((b, s, kh, d), kv_dt)
  scales = jax.ShapeDtypeStruct((b, s, kh), opts.pop("scale_dtype", jnp.float32)) \
      if kv_dt == jnp.int8 else None
  static = dict(causal=opts.pop("causal", True), window=opts.pop("window", None),
                softcap=opts.pop("softcap", None), scale=d**-0.5,
                block_sizes=opts.pop("block_sizes", fa.BlockSizes.for_head_dim(d)),
                interpret=False, count_visits=opts.pop("count_visits", False))
  traced = fa._flash_attention.trace(q, k, k, jax.ShapeDtypeStruct((b, t), jnp.int32),
                                     jax.ShapeDtypeStruct((b, s), jnp.int32), scales, scales,
                                     **static)
  traced.lower(lowering_platforms=("cuda",))
  assert verified == [True]
