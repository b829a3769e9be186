"""Smoke test of the tactic benchmark library at tiny sizes on CPU (not a timed test)."""

import json

import pytest

from rkv import residency
from lab import tactics_bench

STEP_KEYS = {"context", "window_fraction", "tactic", "step_s", "modeled_s", "ratio", "max_abs_err"}
VERDICT_KEYS = {"context", "window_fraction", "pick", "pick_step_s", "fastest", "fastest_step_s",
                "pick_is_fastest", "pick_within_5pct", "pick_over_fastest"}
KERNEL_KEYS = {"read_gbps", "host_read_gbps", "fraction_of_host_read", "meets_target"}


def _cfg(**kw):
  base = dict(contexts=(1024,), window_fractions=(0.75, 0.25), tile_cells=128, num_heads=4,
              num_kv_heads=2, head_dim=16, dtype="float32", warmup=0, repeats=1,
              probe_transfer_mib=(1,), probe_attn_kv_lens=(256, 1024), probe_cpu_kv_len=1024,
              probe_host_read_mib=4)
  return tactics_bench.TacticsConfig(**(base | kw))


def test_tactics_bench_tiny_on_cpu(tmp_path):
  result = tactics_bench.run(_cfg())
  path = tmp_path / "out" / "tactics_bench.json"
  tactics_bench.write_json(result, str(path))
  loaded = json.load(open(path))
  assert {"jax", "backend", "device", "config", "profile", "plans", "steps", "verdicts",
          "cpu_kernel"} <= set(loaded)
  prof = residency.Profile.from_json(loaded["profile"])
  assert prof.cpu_attn_gbps and prof.host_read_gbps
  # The in-run probe's new figures: the cpu tactic's fixed cost and each hybrid side's rate under
  # contention (one transfer size: no per-put fixed cost is fitted).
  assert prof.cpu_overhead_us is not None and prof.hybrid_pcie_gbps and prof.hybrid_cpu_gbps
  assert prof.transfer_overhead_us is None
  assert set(loaded["figures"]) == set(residency.FIGURES)
  assert loaded["figures"]["hybrid_cpu_gbps"] == prof.hybrid_cpu_gbps
  assert prof.details["tail"]["cpu_threads"] == loaded["cpu_threads"]
  for frac in (0.75, 0.25):
    rows = [r for r in loaded["steps"] if r["window_fraction"] == frac]
    assert {r["tactic"] for r in rows} == {"resident", "stream", "cpu", "hybrid", "head"}
    assert any(r.get("planned_split") for r in rows if r["tactic"] == "hybrid")
    for r in rows:
      assert STEP_KEYS <= set(r) and r["step_s"] > 0 and r["modeled_s"] > 0
      assert r["ratio"] == pytest.approx(r["step_s"] / r["modeled_s"])
      # Every tactic is exact: its output equals the resident one (float32 cache).
      assert r["max_abs_err"] < 1e-5, r
  assert len(loaded["verdicts"]) == 2
  for v in loaded["verdicts"]:
    assert VERDICT_KEYS <= set(v) and v["pick"] in residency.OFFLOAD_TACTICS
    assert isinstance(v["pick_within_5pct"], bool)
  assert len(loaded["cpu_kernel"]) == 2
  for k in loaded["cpu_kernel"]:
    assert KERNEL_KEYS <= set(k) and k["read_gbps"] > 0
    assert k["cpu_threads"] == loaded["cpu_threads"]
    assert k["probe_cpu_overhead_us"] == prof.cpu_overhead_us
  table = tactics_bench.format_table(result)
  assert "hybrid" in table and "within_5pct" in table and "probe's own steps" in table


def test_tactics_bench_bf16_given_profile(tmp_path):
  path = residency.H200_DEFAULT.replace(host_read_gbps=20.0).save(str(tmp_path / "p.json"))
  result = tactics_bench.run(_cfg(dtype="bfloat16", window_fractions=(0.5,),
                                  hybrid_splits=("plan", "0.5"), profile_path=path,
                                  cpu_threads=1))
  assert result["profile"]["source"] == residency.H200_DEFAULT.source
  assert result["cpu_threads"] == 1 and all(k["cpu_threads"] == 1 for k in result["cpu_kernel"])
  for r in result["steps"]:
    assert r["max_abs_err"] < 2e-2, r  # bf16 cache: partial sums round differently


def test_bad_config():
  with pytest.raises(ValueError, match="tactics"):
    _cfg(tactics=("resident",))
  with pytest.raises(ValueError, match="hybrid_splits"):
    _cfg(hybrid_splits=("half",))
  with pytest.raises(ValueError, match="window_fractions"):
    _cfg(window_fractions=(1.0,))
