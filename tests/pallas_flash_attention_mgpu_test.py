"""The Hopper (Mosaic GPU) prefill kernel against the float64 NumPy reference, and its gate.

The kernel itself cannot run on CPU (Mosaic GPU has no ``pallas_call`` interpret path), so the
numerical cases are ``gpu``-marked and run on the H200. The eligibility predicate and the input
validation are pure shape/dtype logic and run everywhere: they decide whether a call reaches the
kernel at all, so a wrong "yes" there would be a silent wrong answer on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools

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



@dataclasses.dataclass(frozen=True)
class PosCase:
  """A call with explicit positions: a chunk of T queries at ``start`` into a cache of S slots
  filled to ``fill`` (slots past it empty, k_pos = -1, holding NaN), with optional holes."""
  name: str
  b: int = 1
  t: int = 128
  s: int = 512
  h: int = 4
  k: int = 2
  d: int = 128
  start: int = 256
  fill: int | None = None  # default: start + t (what a chunked prefill writes before attending)
  holes: tuple[tuple[int, int], ...] = ()  # [lo, hi) slot ranges marked empty
  k_shift: int = 0  # slot j holds position j + k_shift
  causal: bool = True
  window: int | None = None
  dtype: str = "bfloat16"

  def __str__(self):
    return self.name

  def positions(self):
    fill = self.start + self.t if self.fill is None else self.fill
    k_pos = np.where(np.arange(self.s) < fill, np.arange(self.s) + self.k_shift, -1)
    for lo, hi in self.holes:
      k_pos[lo:hi] = -1
    q_pos = self.start + np.arange(self.t)
    # Batch rows at different offsets: row r's chunk sits r * 128 earlier.
    q_pos = np.stack([q_pos - 128 * r for r in range(self.b)]).astype(np.int32)
    return q_pos, np.broadcast_to(k_pos, (self.b, self.s)).astype(np.int32)


POS_CASES = [
    PosCase("chunk_at_offset"),                                # full blocks + the diagonal
    PosCase("chunk_at_depth_gqa4", t=256, s=2048, h=8, k=2, start=1536),
    PosCase("unfilled_end_mid_block", fill=448, start=320),     # a block with empty slots
    PosCase("holes", holes=((64, 100), (200, 264)), s=640, start=384),
    PosCase("window", window=200, s=1024, start=640),
    PosCase("window_d64", window=64, d=64, s=512, start=256),
    PosCase("rows_see_nothing", start=0, k_shift=64),  # rows 0..63 see no key, in clean blocks
    PosCase("all_empty", start=0, holes=((0, 128),)),   # no key at all: o = 0, lse = -inf
    PosCase("batch_rows_apart", b=2, start=384, s=640),
    PosCase("noncausal_holes", causal=False, holes=((128, 160),), fill=384, start=0),
    PosCase("f16_d256", d=256, h=2, k=1, dtype="float16"),
]


def pos_inputs(case: PosCase, seed: int = 0):
  rng = np.random.default_rng(seed)
  dt = jnp.dtype(case.dtype)
  q_pos, k_pos = case.positions()
  q = rng.standard_normal((case.b, case.t, case.h, case.d))
  k = rng.standard_normal((case.b, case.s, case.k, case.d)) * 1.5
  v = rng.standard_normal((case.b, case.s, case.k, case.d))
  empty = (k_pos < 0)[:, :, None, None]
  k, v = np.where(empty, np.nan, k), np.where(empty, np.nan, v)  # must never be read
  return (jnp.asarray(q, dt), jnp.asarray(k, dt), jnp.asarray(v, dt), jnp.asarray(q_pos),
          jnp.asarray(k_pos))


def assert_close_pos(case: PosCase, o, lse, q, k, v, q_pos, k_pos):
  f32 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32))
  o_ref, lse_ref = numpy_reference.attention(f32(q), f32(k), f32(v), np.asarray(q_pos),
                                             np.asarray(k_pos), causal=case.causal,
                                             window=case.window)
  tol = TOLERANCES[case.dtype]
  assert o.shape == q.shape and o.dtype == q.dtype and lse.dtype == jnp.float32
  o, lse = f32(o), np.asarray(lse)
  assert not np.isnan(o).any() and not np.isnan(lse).any()
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
  np.testing.assert_allclose(o, o_ref, atol=tol["o"][0], rtol=tol["o"][1])
  fin = np.isfinite(lse_ref)
  np.testing.assert_allclose(lse[fin], lse_ref[fin], atol=tol["lse"][0], rtol=tol["lse"][1])


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
@pytest.mark.parametrize("case", POS_CASES, ids=str)
def test_positions_match_float64(case):
  q, k, v, q_pos, k_pos = pos_inputs(case)
  kw = dict(q_pos=q_pos, k_pos=k_pos, causal=case.causal, window=case.window)
  assert fm.supports(q, k, v, **kw), fm.unsupported_reason(q, k, v, **kw)
  o, lse = fm.flash_attention_mgpu(q, k, v, **kw)
  assert_close_pos(case, o, lse, q, k, v, q_pos, k_pos)
  # rkv.attention dispatches the same call here.
  o2, lse2 = rkv.attention(q, k, v, impl="pallas", **kw)
  np.testing.assert_array_equal(np.asarray(o2.astype(jnp.float32)),
                                np.asarray(o.astype(jnp.float32)))


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["k", "v"])
def test_positions_nan_in_a_visible_key_propagates(where):
  # Slot 10 (position 10) is visible to every row. NaN in one element of its V reaches that
  # column of o for the query heads of its KV head; NaN in its K, their whole rows.
  case = PosCase("nan_visible")
  q, k, v, q_pos, k_pos = pos_inputs(case)
  if where == "k":
    k = k.at[0, 10, 0, 3].set(jnp.nan)
  else:
    v = v.at[0, 10, 0, 3].set(jnp.nan)
  o, lse = fm.flash_attention_mgpu(q, k, v, q_pos=q_pos, k_pos=k_pos)
  o = np.asarray(o.astype(jnp.float32))
  g = case.h // case.k
  hit = o[0, :, :g] if where == "k" else o[0, :, :g, 3]
  assert np.isnan(hit).all()
  assert not np.isnan(o[0, :, g:]).any()  # the other KV head's query heads never read it
  if where == "v":
    assert not np.isnan(np.delete(o[0, :, :g], 3, axis=-1)).any()

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
# Everywhere: the visit plan, walked the way the kernel walks it
# --------------------------------------------------------------------------------------------
def _walk_plan(case: PosCase, blocks: fm.BlockSizes, q, k, v, q_pos, k_pos):
  """float64 NumPy of what the kernel computes from ``_visit_plan``: the listed unmasked blocks
  with no mask at all, the listed masked ones masked by positions, merged with the contract's
  attention over the blocks it left to the generic kernel. A block the plan calls unmasked
  that holds an invisible key, or a skipped block that holds a visible one, changes the result."""
  order, counts, clean = (np.asarray(x) for x in fm._visit_plan(
      q_pos, k_pos, tile_q=blocks.tile_q, block_kv=blocks.block_kv, causal=case.causal,
      window=case.window))
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  q_pos, k_pos = np.asarray(q_pos), np.asarray(k_pos)
  g, scale = case.h // case.k, case.d ** -0.5
  o = np.zeros(q.shape)
  lse = np.full(q.shape[:3], -np.inf)
  for bi in range(case.b):
    for qt in range(case.t // blocks.tile_q):
      rows = slice(qt * blocks.tile_q, (qt + 1) * blocks.tile_q)
      n_full, n_total = counts[bi, qt]
      cols, masks = [], []
      for j in range(n_total):
        blk = order[bi, qt, j]
        assert clean[bi, blk], "the kernel must only read blocks without empty slots"
        c = np.arange(blk * blocks.block_kv, (blk + 1) * blocks.block_kv)
        if j < n_full:
          m = np.ones((blocks.tile_q, c.size), bool)
        else:
          m = numpy_reference.visible_mask(q_pos[bi:bi + 1, rows], k_pos[bi:bi + 1, c],
                                           case.causal, case.window)[0]
        cols.append(c)
        masks.append(m)
      if not cols:
        continue
      c, m = np.concatenate(cols), np.concatenate(masks, axis=1)
      for hi in range(case.h):
        s = q[bi, rows, hi] @ k[bi, c, hi // g].T * scale
        s = np.where(m, s, -np.inf)
        top = s.max(axis=1)
        seen = np.isfinite(top)
        p = np.exp(s - np.where(seen, top, 0)[:, None])
        l = p.sum(axis=1)
        o[bi, rows, hi] = np.where(seen[:, None], (p @ v[bi, c, hi // g]) /
                                   np.where(seen, l, 1)[:, None], 0)
        lse[bi, rows, hi] = np.where(seen, top + np.log(np.where(seen, l, 1)), -np.inf)
  hidden = np.repeat(clean, blocks.block_kv, axis=1)
  o_rest, lse_rest = numpy_reference.attention(q, k, v, q_pos, np.where(hidden, -1, k_pos),
                                               causal=case.causal, window=case.window)
  top = np.maximum(lse, lse_rest)
  safe = np.where(np.isfinite(top), top, 0)
  w_a, w_b = np.exp(lse - safe), np.exp(lse_rest - safe)
  total = w_a + w_b
  seen = total > 0
  o_all = np.where(seen[..., None], (w_a[..., None] * o + w_b[..., None] * o_rest) /
                   np.where(seen, total, 1)[..., None], 0)
  return o_all, np.where(seen, safe + np.log(np.where(seen, total, 1)), -np.inf), counts


@pytest.mark.parametrize("case", POS_CASES, ids=str)
def test_visit_plan_walk_equals_the_contract(case):
  # Small D: the plan depends on positions only, so the walk is checked at float64 exactly.
  case = dataclasses.replace(case, d=16, dtype="float32")
  blocks = fm._default_block_sizes(128 if case.d <= 128 else 256, case.s)
  q, k, v, q_pos, k_pos = pos_inputs(case)
  o, lse, counts = _walk_plan(case, blocks, q, k, v, q_pos, k_pos)
  o_ref, lse_ref = numpy_reference.attention(q, k, v, q_pos, k_pos, causal=case.causal,
                                             window=case.window)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
  np.testing.assert_allclose(o, o_ref, atol=1e-12, rtol=1e-10)
  fin = np.isfinite(lse_ref)
  np.testing.assert_allclose(lse[fin], lse_ref[fin], atol=1e-12, rtol=1e-10)
  assert (counts[..., 0] <= counts[..., 1]).all()



@pytest.mark.parametrize("causal,window,positions", [
    (True, None, False), (False, None, False), (True, None, True), (False, None, True),
    (True, 128, True), (False, 96, True)])
def test_kernel_lowers_for_cuda(causal, window, positions):
  # The kernel cannot run here, but JAX lowers it for CUDA on any host: the whole Mosaic GPU
  # program (layouts, barriers, the visit plan's loads) is built, short of PTX. A kernel that
  # does not lower never reaches the H200's tests.
  q, kv, _ = _shapes(t=256, s=1024)
  pos = (jax.ShapeDtypeStruct((1, 256), jnp.int32), jax.ShapeDtypeStruct((1, 1024), jnp.int32))
  fn = functools.partial(fm._flash_attention_mgpu, causal=causal, scale=0.1,
                         blocks=fm.BlockSizes(), window=window)
  if positions:
    traced = jax.jit(fn).trace(q, kv, kv, *pos)
  else:
    traced = jax.jit(lambda q, k, v: fn(q, k, v, None, None)).trace(q, kv, kv)
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_visit_plan_skips_what_no_row_can_see():
  # A 128-query chunk at depth 1536 of 2048 slots, causal: blocks past the chunk are never
  # listed, every block wholly below the tile's first row is unmasked, at most two are masked.
  case = PosCase("depth", t=128, s=2048, start=1536)
  q_pos, k_pos = case.positions()
  order, counts, clean = fm._visit_plan(jnp.asarray(q_pos), jnp.asarray(k_pos), tile_q=128,
                                        block_kv=128, causal=True, window=None)
  n_full, n_total = np.asarray(counts)[0, 0]
  assert n_full == 1536 // 128 and n_total == n_full + 1
  assert sorted(np.asarray(order)[0, 0, :n_total]) == list(range(n_total))
  assert np.asarray(clean)[0, :13].all() and not np.asarray(clean)[0, 13:].any()
  # A window of 256 over the same chunk: only the blocks within reach are read.
  order, counts, _ = fm._visit_plan(jnp.asarray(q_pos), jnp.asarray(k_pos), tile_q=128,
                                    block_kv=128, causal=True, window=256)
  n_full, n_total = np.asarray(counts)[0, 0]
  assert sorted(np.asarray(order)[0, 0, :n_total]) == [10, 11, 12]
  assert n_full == 1  # block 11: keys 1408..1535, inside every row's window


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


def test_reason_none_for_positions_and_windows():
  # Chunks at an offset (explicit positions, holes) and sliding windows take the fast path;
  # a causal T > S is fine there (rows that see nothing give o = 0, lse = -inf).
  assert fm.unsupported_reason(*_shapes(), q_pos=np.zeros((1, 256), np.int32)) is None
  assert fm.unsupported_reason(*_shapes(), k_pos=np.arange(256, dtype=np.int32)[None]) is None
  assert fm.unsupported_reason(*_shapes(), window=64) is None
  assert fm.unsupported_reason(*_shapes(t=512, s=256), window=64) is None


@pytest.mark.parametrize("name,kwargs", [
    ("k_scale", dict(k_scale=np.ones((1, 256, 2), np.float32))),
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
