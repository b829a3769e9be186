"""rkv.parallel and rkv.planner.plan_sharded on 2 and 4 CPU host devices.

Host devices need ``--xla_force_host_platform_device_count=N`` before JAX starts, and this
process has one device, so the sharded checks (tests/support/sharded_checks.py) run in one
subprocess per N, started once per module; each check is a test here that asserts on its result.
What needs no second device (the planner's table and errors, the column permutations) runs here.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rkv.models.config import PRESETS
from rkv.parallel.model import gate_up_permutation, qkv_permutation
from rkv.planner import ResidencyConfig, plan_sharded
from tests.support import sharded_checks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 900  # generous: the CI machine is shared; the checks take ~1 min of CPU each N


def _run_checks(n: int) -> dict:
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      f" --xla_force_host_platform_device_count={n}").strip()
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run([sys.executable, "-m", "tests.support.sharded_checks", str(n)], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("SHARDED_CHECKS ")]
  assert proc.returncode == 0 and lines, (
      f"the {n}-device checks did not report (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
  return json.loads(lines[-1][len("SHARDED_CHECKS "):])


_RESULTS: dict = {}


def _result(n: int, name: str) -> dict:
  if n not in _RESULTS:
    _RESULTS[n] = _run_checks(n)
  assert name in _RESULTS[n], f"check {name} did not run: {sorted(_RESULTS[n])}"
  return _RESULTS[n][name]


@pytest.mark.parametrize("n, name", [(n, name) for n in (2, 4)
                                     for name in sharded_checks.checks(n)])
def test_sharded(n, name):
  res = _result(n, name)
  assert res["ok"], f"{name} on {n} devices: {res['detail']}"


# --- one device ---------------------------------------------------------------------------------
def test_permutations_are_device_major():
  perm = qkv_permutation(num_heads=4, num_kv_heads=2, head_dim=1, n=2)
  # columns [q0 q1 q2 q3 | k0 k1 | v0 v1] -> device 0: q0 q1 k0 v0, device 1: q2 q3 k1 v1
  assert perm.tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
  assert gate_up_permutation(4, 2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
  big = qkv_permutation(32, 8, 128, 4)
  assert np.array_equal(np.sort(big), np.arange((32 + 16) * 128))


def _res(**kw):
  return ResidencyConfig(check_free=False, **kw)


def test_plan_sharded_splits_heads_and_cells():
  cfg = PRESETS["llama3-8b"]
  one = plan_sharded(cfg, 1 << 20, 1, seq=1, heads=1, residency=_res(vram_target_mib=200_000))
  two = plan_sharded(cfg, 1 << 20, 1, seq=1, heads=2, residency=_res(vram_target_mib=100_000))
  cp = plan_sharded(cfg, 1 << 20, 1, seq=2, heads=1, residency=_res(vram_target_mib=100_000))
  for p in (one, two, cp):
    assert p.fits
  # The same K/V bytes in all, split evenly: K/2 heads of every cell, or every head of half the
  # cells; each head shard keeps its own copy of the positions (4 bytes a cell and layer).
  assert cp.device_bytes == one.device_bytes
  assert two.device_bytes == one.device_bytes + cfg.num_layers * (1 << 20) * 4
  assert two.plans[0].shape.num_kv_heads == 4 and two.plans[0].context_len == 1 << 20
  assert cp.plans[0].shape.num_kv_heads == 8 and cp.plans[0].context_len == 1 << 19


def test_plan_sharded_per_device_budgets_and_table():
  cfg = PRESETS["llama3-8b"]
  # Device 1 has half device 0's budget: it offloads more (per-device windows and tactics).
  p = plan_sharded(cfg, 1 << 20, 1, seq=1, heads=2, devices=["gpu0", "gpu1"],
                   residency=[_res(vram_target_mib=60_000), _res(vram_target_mib=40_000)])
  assert not p.fits
  assert p.plans[1].host_bytes > p.plans[0].host_bytes > 0
  assert p.step_time_s == max(q.step_time_s for q in p.plans)
  table = p.table()
  header = next(line for line in table.splitlines() if "tactic" in line)
  assert header.split()[:3] == ["device", "layer", "kind"]
  rows = [line for line in table.splitlines() if line.startswith("gpu")]
  assert sum(r.startswith("gpu1") for r in rows) == cfg.num_layers + 1  # layers + its total


def test_plan_sharded_rejects_bad_input():
  cfg = PRESETS["llama3-8b"]
  with pytest.raises(ValueError, match="num_kv_heads=8 is not divisible by heads=3"):
    plan_sharded(cfg, 4096, 1, heads=3, residency=_res(vram_target_mib=1000))
  with pytest.raises(ValueError, match="residency must be one ResidencyConfig or a sequence of 2"):
    plan_sharded(cfg, 4096, 1, heads=2, residency=[_res(vram_target_mib=1000)])
  with pytest.raises(ValueError, match="seq must be a positive int"):
    plan_sharded(cfg, 4096, 1, seq=0, residency=_res(vram_target_mib=1000))
