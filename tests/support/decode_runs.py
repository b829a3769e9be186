"""A short llama-fixture run on a forced tactic plan (prefill, decode steps, a flush) and its
bit-for-bit comparison, shared by the tests of switches that must not change a result."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

import rkv
from rkv import models
from rkv import generate as gen

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures",
                        "hf")


def decode_with(tactic, **forward_kw):
  """The llama fixture on a forced ``tactic`` plan (W=4, 4-cell tiles, B=2): a 13-token prefill,
  then one-token steps to 19 (the staging tile flushes at fill 16) through
  ``layered_forward(**forward_kw)``. Returns (every call's logits, the last caches, the fn)."""
  model = models.load_hf(os.path.join(FIXTURES, "llama"), jnp.float32, impl="xla")
  tokens = np.load(os.path.join(FIXTURES, "llama", "reference.npz"))["tokens"]
  cfg = model.config
  base = rkv.plan(cfg, 32, 2, residency=rkv.ResidencyConfig(vram_target_mib=1 << 20))
  plan = gen.force_tactic(base, tactic, 4, 4, cpu_fraction=0.5)
  pos = lambda lo, hi: np.broadcast_to(np.arange(lo, hi, dtype=np.int32), (2, hi - lo))
  fwd = models.layered_forward(model, last_only=True, **forward_kw)
  out = [fwd(tokens[:, :13], pos(0, 13), gen.caches_from_plan(cfg, plan, 2, 32, jnp.float32))]
  for i in range(13, 19):
    out.append(fwd(tokens[:, i:i + 1], pos(i, i + 1), out[-1][1]))
  return [np.asarray(l) for l, _ in out], out[-1][1], fwd


def assert_same_run(a, b):
  for x, y in zip(a[0], b[0]):
    np.testing.assert_array_equal(x, y)
  for x, y in zip(jax.tree.leaves(a[1]), jax.tree.leaves(b[1])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
