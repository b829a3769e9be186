"""Gate (DESIGN.md §7): the ``stream`` tactic decodes the resident path's logits, float32.

Each fixture checkpoint (``tests/fixtures/hf/<arch>``) is teacher-forced through resident/ring
caches and through RollingKV caches forced to a tiny window (W=5, tile=4: of the 32 cells, most
live in the host tail, the tail is not a multiple of the tile, and staging tiles flush during
both the prefill and the decode steps). Both are checked against each other with the named
float32 thresholds of :mod:`rkv.gates`, and against HF's full-forward logits from the fixture.
"""

import os

import jax.numpy as jnp
import numpy as np
import pytest

import rkv
from rkv import gates, models
from rkv import generate as gen

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
ARCHS = ("llama", "mistral", "gemma2", "gemma3")
PREFILL = 18
W, TILE = 5, 4


@pytest.fixture(scope="module", params=ARCHS)
def run(request):
  arch = request.param
  model = models.load_hf(os.path.join(FIXTURES, arch), jnp.float32, impl="xla")
  ref = np.load(os.path.join(FIXTURES, arch, "reference.npz"))
  tokens, hf = ref["tokens"], ref["logits"]
  b, t = tokens.shape
  cfg = model.config
  base = rkv.plan(cfg, t, b, residency=rkv.ResidencyConfig(vram_target_mib=1 << 20))
  assert base.fits
  plan = gen.force_stream(base, W, TILE, local=not cfg.global_layers)
  caches = gen.caches_from_plan(cfg, plan, b, t, jnp.float32)
  rolling = [c for c in caches if isinstance(c, rkv.RollingKV)]
  assert rolling, arch
  resident = gen.decode_logits(model, tokens, models.init_caches(cfg, b, t), prefill_len=PREFILL)
  stream = gen.decode_logits(model, tokens, caches, prefill_len=PREFILL)
  return arch, resident, stream, hf[:, PREFILL:]


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
