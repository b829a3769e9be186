"""Gate (docs/DESIGN.md §8): every tail tactic decodes the resident path's logits, float32.

Each fixture checkpoint (``tests/fixtures/hf/<arch>``) is teacher-forced through resident/ring
caches and through caches forced to a tiny window (W=5, tile=4: of the 32 cells, most live in the
host tail, the tail is not a multiple of the tile, and staging tiles flush during both the prefill
and the decode steps), once per tactic: ``stream``, ``cpu`` and ``hybrid`` (a RollingKV carrying the
tactic: the host C kernel attends to all / the last ``cpu_fraction`` of the tail's tiles) and
``head`` (a HeadSplitKV with R = 0 and R = max(1, K // 2) KV heads resident: 0 < R < K at K = 2,
R = K at K = 1). Each is checked against the resident logits with the named float32 thresholds of
:mod:`rkv.gates`; the resident and stream logits also against HF's full-forward logits.
"""

import math
import os

import jax.numpy as jnp
import numpy as np
import pytest

import rkv
from rkv import gates, models
from rkv import generate as gen
from rkv.offload import cpu_attention as cpu_lib

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
ARCHS = ("llama", "mistral", "gemma2", "gemma3")
PREFILL = 18
W, TILE = 5, 4
# (tactic, force_tactic kwargs); "half": R = max(1, K // 2).
TACTICS = [("cpu", {}), ("hybrid", dict(cpu_fraction=0.25)), ("hybrid", dict(cpu_fraction=0.75)),
           ("head", dict(resident_heads=0)), ("head", dict(resident_heads="half"))]
TACTIC_IDS = [t + "".join(f"_{v}" for v in kw.values()) for t, kw in TACTICS]


@pytest.fixture(scope="module", params=ARCHS)
def arch_setup(request):
  arch = request.param
  model = models.load_hf(os.path.join(FIXTURES, arch), jnp.float32, impl="xla")
  ref = np.load(os.path.join(FIXTURES, arch, "reference.npz"))
  tokens, hf = ref["tokens"], ref["logits"]
  b, t = tokens.shape
  cfg = model.config
  base = rkv.plan(cfg, t, b, residency=rkv.ResidencyConfig(vram_target_mib=1 << 20))
  assert base.fits
  resident = gen.decode_logits(model, tokens, models.init_caches(cfg, b, t), prefill_len=PREFILL)
  return arch, model, tokens, base, resident, hf[:, PREFILL:]


def forced_caches(model, base, tactic, **kw):
  cfg = model.config
  b = base.batch
  plan = gen.force_tactic(base, tactic, W, TILE, local=not cfg.global_layers, **kw)
  return plan, gen.caches_from_plan(cfg, plan, b, base.context_len, jnp.float32)


@pytest.fixture(scope="module")
def run(arch_setup):
  arch, model, tokens, base, resident, hf = arch_setup
  _, caches = forced_caches(model, base, "stream")
  rolling = [c for c in caches if isinstance(c, rkv.RollingKV)]
  assert rolling, arch
  stream = gen.decode_logits(model, tokens, caches, prefill_len=PREFILL)
  return arch, resident, stream, hf


def test_layout_puts_most_cells_in_the_tail():
  p = (32 - W)
  assert p % TILE and p // TILE * TILE > 32 // 2  # a partial staging tile; most cells on the host
  assert (PREFILL - W) % TILE and (32 - W) // TILE > (PREFILL - W) // TILE  # flushes in decode


def test_stream_matches_resident(run):
  arch, resident, stream, _ = run
  assert resident.shape == stream.shape == (2, 32 - PREFILL, 128)
  m = gates.logit_metrics(resident, stream)
  passed, reasons = gates.check_gate(m, "float32")
  assert passed, (arch, reasons)
  assert m.max_abs_logit <= gates.F32_MAX_ABS_LOGIT and m.top1_agreement == gates.F32_TOP1


@pytest.mark.parametrize("path", ["resident", "stream"])
def test_matches_hf(run, path):
  arch, resident, stream, hf = run
  got = resident if path == "resident" else stream
  m = gates.logit_metrics(hf, got)
  assert gates.check_gate(m, "float32")[0], (arch, path, m)


def check_cache_types(caches, plan, tactic, kw, num_kv_heads):
  for c, lp in zip(caches, plan.layers):
    if lp.tactic == "resident":
      assert isinstance(c, models.ResidentCache)
    elif tactic == "head":
      assert isinstance(c, rkv.HeadSplitKV)
      assert c.resident_heads == kw["resident_heads"] and c.num_kv_heads == num_kv_heads
      if c.rolled is not None:
        assert c.rolled.window_cells == W and c.rolled.tile_cells == TILE
    else:
      assert isinstance(c, rkv.RollingKV) and c.tactic == tactic
      assert c.window_cells == W and c.tile_cells == TILE
      assert c.cpu_fraction == kw.get("cpu_fraction")


@pytest.mark.parametrize("tactic,kw", TACTICS, ids=TACTIC_IDS)
def test_tactic_matches_resident(arch_setup, tactic, kw, monkeypatch):
  arch, model, tokens, base, resident, _ = arch_setup
  kh = model.config.num_kv_heads
  if kw.get("resident_heads") == "half":
    kw = dict(resident_heads=max(1, kh // 2))
  plan, caches = forced_caches(model, base, tactic, **kw)
  check_cache_types(caches, plan, tactic, kw, kh)
  calls = []
  real = cpu_lib.cpu_attention_tail

  def spy(*a, **kwargs):
    calls.append(kwargs["tiles"])
    return real(*a, **kwargs)

  monkeypatch.setattr(cpu_lib, "cpu_attention_tail", spy)
  got = gen.decode_logits(model, tokens, caches, prefill_len=PREFILL)
  m = gates.logit_metrics(resident, got)
  passed, reasons = gates.check_gate(m, "float32")
  assert passed, (arch, tactic, kw, reasons)
  assert m.max_abs_logit <= gates.F32_MAX_ABS_LOGIT and m.top1_agreement == gates.F32_TOP1
  # The host kernel really attended the tail: all of it (cpu), the last share (hybrid), never
  # (head: the rolled heads stream).
  if tactic == "head":
    assert calls == []
  else:
    f = 1.0 if tactic == "cpu" else kw["cpu_fraction"]
    assert calls and all(lo == hi - math.floor(f * hi + 0.5) for lo, hi in calls), calls
    assert max(hi for _, hi in calls) == (32 - 1 - W) // TILE  # the last step sees 6 tiles
