"""The fused decode step (rkv/models/fused_decode.py) against layered_forward's general path.

Both decode the same tokens through caches forced to a tiny window (W=5, tile=4: most cells in the
host tail, staging tiles flushing during decode) with every rolling tactic and int8 KV; the fused
step must give the general path's logits (same cells, same tactic split; only the float32 merge
order differs), must really run (every rolling layer of every decode step), and must leave caches
that hold the same cells as the general path's.
"""

import functools
import os

import jax.numpy as jnp
import numpy as np
import pytest

import rkv
from rkv import gates, models
from rkv import generate as gen
from rkv.models import fused_decode
from rkv.offload import cpu_attention as cpu_lib
from rkv.offload import stream

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
PREFILL = 18
W, TILE = 5, 4
# stream (its last steps take the general path: more tiles than lookahead + 1), cpu (every tile
# on the host kernel), hybrid with int8 KV (quantized appends in the fused program), and Gemma-2
# (sliding-window layers beside the rolling ones, softcaps) with a hybrid split.
CASES = [("llama", "stream", {}, None), ("llama", "cpu", {}, None),
         ("llama", "hybrid", dict(cpu_fraction=0.5), "int8"),
         ("gemma2", "hybrid", dict(cpu_fraction=0.25), None)]


@functools.lru_cache(maxsize=None)
def _arch(name):
  model = models.load_hf(os.path.join(FIXTURES, name), jnp.float32, impl="xla")
  tokens = np.load(os.path.join(FIXTURES, name, "reference.npz"))["tokens"]
  b, t = tokens.shape
  base = rkv.plan(model.config, t, b, residency=rkv.ResidencyConfig(vram_target_mib=1 << 20))
  return model, tokens, base


def _caches(model, base, tactic, kw, kv_dtype):
  plan = gen.force_tactic(base, tactic, W, TILE, local=not model.config.global_layers, **kw)
  dtype = jnp.float32 if kv_dtype is None else kv_dtype
  return gen.caches_from_plan(model.config, plan, base.batch, base.context_len, dtype)


def _decode(model, tokens, caches, fused, prefetch_tiles=0):
  """Prefill (general path: a chunk), then one token a step through layered_forward."""
  b, t = tokens.shape
  fn = models.layered_forward(model, last_only=True, fused=fused, prefetch_tiles=prefetch_tiles)
  pos = lambda lo, hi: jnp.asarray(np.broadcast_to(np.arange(lo, hi, dtype=np.int32), (b, hi - lo)))
  _, caches = fn(jnp.asarray(tokens[:, :PREFILL]), pos(0, PREFILL), caches)
  out = []
  for i in range(PREFILL, t):
    logits, caches = fn(jnp.asarray(tokens[:, i:i + 1]), pos(i, i + 1), caches)
    out.append(np.asarray(logits[:, -1]))
  return np.stack(out, axis=1), caches


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(
    str(x) for x in (c[0], c[1], c[2].get("cpu_fraction"), c[3]) if x is not None))
def test_fused_decode_equals_general_path(case, monkeypatch):
  name, tactic, kw, kv_dtype = case
  monkeypatch.setenv("RKV_HOST_SHARE", "0")  # both paths with the Python worker (counted below)
  model, tokens, base = _arch(name)
  general, general_caches = _decode(model, tokens, _caches(model, base, tactic, kw, kv_dtype),
                                    fused=False)
  planned, layers, cpu_calls = [], [], []
  real_plan, real_layer = fused_decode.plan_step, fused_decode.Chain.layer
  real_tail = cpu_lib.cpu_attention_tail

  def spy_plan(cache, t, **k):
    step = real_plan(cache, t, **k)
    if t == 1 and isinstance(cache, rkv.RollingKV):
      planned.append((cache, step))
    return step

  def spy_layer(self, i, *a, **k):
    layers.append(i)
    return real_layer(self, i, *a, **k)

  def spy_tail(*a, **k):
    cpu_calls.append(k["tiles"])
    return real_tail(*a, **k)

  monkeypatch.setattr(fused_decode, "plan_step", spy_plan)
  monkeypatch.setattr(fused_decode.Chain, "layer", spy_layer)
  monkeypatch.setattr(cpu_lib, "cpu_attention_tail", spy_tail)
  fused, fused_caches = _decode(model, tokens, _caches(model, base, tactic, kw, kv_dtype),
                                fused=True)
  rolling = [i for i, c in enumerate(fused_caches) if isinstance(c, rkv.RollingKV)]
  assert rolling and len(planned) == len(rolling) * (tokens.shape[1] - PREFILL)
  # Every rolling layer of every decode step ran fused, but where more tiles would stream than
  # the eager schedule keeps on the device (the stream tactic's last steps: 6 tiles).
  for cache, step in planned:
    n = rkv.rolling.streamed_count(cache.n_full_tiles, cache.tactic, cache.cpu_fraction)
    assert (step is None) == (n > stream.DEFAULT_LOOKAHEAD + 1), (cache, step)
  assert len(layers) == sum(step is not None for _, step in planned) > len(planned) // 2
  if tactic != "stream":
    assert len(cpu_calls) == len(layers)
  m = gates.logit_metrics(general, fused)
  passed, reasons = gates.check_gate(m, "float32")
  assert passed, (name, tactic, reasons)
  assert m.max_abs_logit <= gates.F32_MAX_ABS_LOGIT and m.top1_agreement == gates.F32_TOP1
  # The same cells in the same places (window, staging, flushed tail tiles): positions exactly;
  # K/V bit for bit in the first layer (its input is the embedding either way), within float32
  # rounding after it (each layer's input carries the merge order's last-ulp differences).
  for i in rolling:
    a, b = general_caches[i], fused_caches[i]
    assert (a.fill, a.n_full_tiles, a.n_staged) == (b.fill, b.n_full_tiles, b.n_staged)
    ca, cb = a.cells(), b.cells()
    np.testing.assert_array_equal(ca["pos"], cb["pos"])
    for part in ("k", "v", "k_scale", "v_scale"):
      if ca[part] is None:
        assert cb[part] is None
      elif i == rolling[0]:
        np.testing.assert_array_equal(ca[part], cb[part], err_msg=f"layer {i} {part}")
      elif ca[part].dtype == np.int8:  # a rounding difference may move a code by one
        assert np.abs(ca[part].astype(int) - cb[part].astype(int)).max() <= 1, (i, part)
      else:
        np.testing.assert_allclose(ca[part], cb[part], rtol=1e-4, atol=1e-5,
                                   err_msg=f"layer {i} {part}")


@pytest.mark.parametrize("case", [c for c in CASES if c[1] != "stream"], ids=lambda c: "-".join(
    str(x) for x in (c[0], c[1], c[2].get("cpu_fraction"), c[3]) if x is not None))
def test_fused_decode_with_the_host_share_equals_the_python_worker(case, monkeypatch):
  # $RKV_HOST_SHARE in the fused step: the CPU share started right after the head program made
  # q and awaited before the next head; its partial is the worker's bit for bit, so logits and
  # caches equal the fused step's with the Python worker exactly. A step whose append fills a
  # tile keeps the worker (the shares' counts below say how many steps each layer ran).
  name, tactic, kw, kv_dtype = case
  model, tokens, base = _arch(name)
  monkeypatch.setenv("RKV_HOST_SHARE", "0")
  worker, worker_caches = _decode(model, tokens, _caches(model, base, tactic, kw, kv_dtype),
                                  fused=True)
  monkeypatch.setenv("RKV_HOST_SHARE", "1")
  made = []
  real_layered = models.layered_forward

  def keep_fn(*a, **k):
    made.append(real_layered(*a, **k))
    return made[-1]

  monkeypatch.setattr(models, "layered_forward", keep_fn)
  shared, shared_caches = _decode(model, tokens, _caches(model, base, tactic, kw, kv_dtype),
                                  fused=True)
  np.testing.assert_array_equal(worker, shared)
  for a, b in zip(worker_caches, shared_caches):
    if isinstance(a, rkv.RollingKV):
      for part, x in a.cells().items():
        y = b.cells()[part]
        assert (x is None) == (y is None), part
        if x is not None:
          np.testing.assert_array_equal(x, y, err_msg=part)
  shares = made[0].host_shares
  rolling = [i for i, c in enumerate(shared_caches) if isinstance(c, rkv.RollingKV)]
  assert len(shares) == len(rolling)
  decode_steps = tokens.shape[1] - PREFILL
  for share, _ in shares._shares.values():
    counts = share.counters()
    assert counts["starts"] == counts["waits"] == counts["runs"] and counts["last_rc"] == 0
    # Every decode step but those whose append fills a tile (W=5, 4-cell tiles: one in four).
    assert decode_steps // 2 < counts["starts"] < decode_steps, counts


@pytest.mark.gpu
def test_fused_decode_with_the_host_share_on_the_gpu(monkeypatch):
  # The same check with the CUDA handlers: the query's copies and the runner's wake-up enqueued
  # on the head program's stream, the partial's copies before the next head's.
  test_fused_decode_with_the_host_share_equals_the_python_worker(CASES[2], monkeypatch)


def test_fused_decode_with_the_prefetcher():
  """With a prefetcher every decode step of every rolling layer runs fused (its tiles come
  staged), and the logits are the general path's with the same prefetcher."""
  model, tokens, base = _arch("llama")
  caches = lambda: _caches(model, base, "stream", {}, None)
  general, _ = _decode(model, tokens, caches(), fused=False, prefetch_tiles=3)
  fused, _ = _decode(model, tokens, caches(), fused=True, prefetch_tiles=3)
  m = gates.logit_metrics(general, fused)
  assert gates.check_gate(m, "float32")[0], m
  assert m.max_abs_logit <= gates.F32_MAX_ABS_LOGIT and m.top1_agreement == gates.F32_TOP1


def test_plan_step_takes_the_general_path_where_it_must():
  kv = rkv.RollingKV.empty(1, 64, 2, 8, window_cells=5, dtype=jnp.float32, tile_cells=4)
  step = fused_decode.plan_step(kv, 1, prefetching=False)
  assert step.dest == "window" and step.offset == 0 and step.flush_index is None
  assert fused_decode.plan_step(kv, 17, prefetching=False) is None  # a prefill chunk
  full = kv.append(jnp.zeros((1, 5, 2, 8)), jnp.zeros((1, 5, 2, 8)))
  assert fused_decode.plan_step(full, 1, prefetching=False).dest == "staging"
  three = full.append(jnp.zeros((1, 3, 2, 8)), jnp.zeros((1, 3, 2, 8)))
  step = fused_decode.plan_step(three, 1, prefetching=False)  # the staging tile's last cell
  assert (step.dest, step.offset, step.flush_index) == ("staging", 3, 0)
  assert fused_decode.plan_step(three, 2, prefetching=False) is None  # would overfill staging
  assert fused_decode.plan_step(models.ResidentCache.empty(1, 8, 2, 8), 1,
                                prefetching=False) is None


def test_fused_flag_from_the_environment(monkeypatch):
  from rkv.models import transformer
  monkeypatch.delenv(fused_decode.FUSED_ENV, raising=False)
  assert transformer._fused_default() is False  # off unless asked for (it measured slower)
  monkeypatch.setenv(fused_decode.FUSED_ENV, "1")
  assert transformer._fused_default() is True
  monkeypatch.setenv(fused_decode.FUSED_ENV, "0")
  assert transformer._fused_default() is False
  model, _, _ = _arch("llama")
  with pytest.raises(ValueError, match="fused must be a bool"):
    models.layered_forward(model, fused="yes")
  monkeypatch.setenv(fused_decode.FUSED_ENV, "maybe")
  with pytest.raises(ValueError, match="RKV_FUSED_DECODE"):
    transformer._fused_default()
