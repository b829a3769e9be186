"""Decode steps move nothing between host and device implicitly on the dispatching thread.

Why: a host value handed to a jitted program is a fresh transfer that PJRT enqueues on its own
threads, and the program's launch blocks until it is enqueued. On the H200 an int8 append's cell
offset, a host scalar per layer, held each append's launch 0.24 ms, and 1.1 ms beside the host
share's kernel (docs/DESIGN.md §6, session 19); a read back the other way would sync the host
with the device. ``jax.transfer_guard("disallow")`` turns any implicit transfer into an error, so
a new one in a decode step fails here on the CPU. Explicit ``jax.device_put`` calls (the streamed
tiles' puts, a flush's tile to the host) are allowed by the guard, and the guard is the calling
thread's (the Python worker's query copy is not under it). The
Python worker's CPU partial (numpy into the join, on jit's C++ path) is such a transfer by
design, so the hybrid and cpu tactics are checked with the host share, whose partial comes back
through its FFI call.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rkv
from rkv import generate as gen
from rkv import models

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")


@pytest.fixture(scope="module")
def llama():
  model = models.load_hf(os.path.join(FIXTURES, "llama"), jnp.float32, impl="xla")
  tokens = np.load(os.path.join(FIXTURES, "llama", "reference.npz"))["tokens"]
  return model, tokens


@pytest.mark.parametrize("tactic,kv_dtype,share,fused", [
    ("stream", jnp.float32, "0", False), ("stream", jnp.int8, "0", False),
    ("hybrid", jnp.float32, "1", False), ("hybrid", jnp.int8, "1", False),
    ("cpu", jnp.int8, "1", False), ("head", jnp.float32, "0", False),
    ("stream", jnp.int8, "0", True)])
def test_decode_steps_make_no_implicit_transfer(llama, monkeypatch, tactic, kv_dtype, share,
                                                fused):
  # W=4, 4-cell tiles, B=2: a 13-token prefill, then one-token steps to 21 (the staging tile
  # fills at 16 and 20: a flush inside the guarded steps).
  monkeypatch.setenv("RKV_HOST_SHARE", share)
  model, tokens = llama
  cfg = model.config
  base = rkv.plan(cfg, 32, 2, residency=rkv.ResidencyConfig(vram_target_mib=1 << 20))
  plan = gen.force_tactic(base, tactic, 4, 4, cpu_fraction=0.5)
  fwd = models.layered_forward(model, last_only=True, fused=fused)  # fused: two programs a layer
  pos = lambda lo, hi: jnp.asarray(np.broadcast_to(np.arange(lo, hi, dtype=np.int32),
                                                   (2, hi - lo)))
  _, caches = fwd(jnp.asarray(tokens[:, :13]), pos(0, 13),
                  gen.caches_from_plan(cfg, plan, 2, 32, kv_dtype))
  _, caches = fwd(jnp.asarray(tokens[:, 13:14]), pos(13, 14), caches)  # compiles the step
  guarded = 0
  for i in range(14, 21):
    step_tokens, step_pos = jnp.asarray(tokens[:, i:i + 1]), pos(i, i + 1)
    # A step whose append fills a tile (i = 15, 19) takes the Python worker under the share:
    # its partial is the by-design transfer above, so only the streamed tactic guards it.
    fills_tile = (i - 4) % 4 == 3
    if share == "1" and fills_tile:
      logits, caches = fwd(step_tokens, step_pos, caches)
      continue
    with jax.transfer_guard("disallow"):
      logits, caches = fwd(step_tokens, step_pos, caches)
    guarded += 1
  assert caches[0].fill == 21 and np.isfinite(np.asarray(logits)).all()
  assert guarded == (5 if share == "1" else 7)
  assert len(fwd.host_shares) == (cfg.num_layers if share == "1" else 0)
