"""CPU smoke test of the end-to-end decode benchmark at a tiny preset (not a timed test)."""

import json

import pytest

from rkv import decode_bench

TINY = dict(preset="tiny-llama", dtype="float32", contexts=(512,), warmup=1, steps=2,
            offload_warmup=1, offload_steps=2, tile_cells=128, min_tile_cells=128, margin_gib=0.0)


def test_rkv_rows_and_outputs(tmp_path):
  cfg = decode_bench.BenchConfig(configs=("rkv_resident", "rkv_offload"), **TINY)
  out = tmp_path / "r" / "decode_bench.json"
  result = decode_bench.main(cfg, str(out), str(tmp_path / "r" / "plot.png"), log=lambda m: None)
  loaded = json.load(open(out))
  assert {"jax", "device", "config", "model", "rows", "ratios"} <= set(loaded)
  rows = {r["config"]: r for r in loaded["rows"]}
  for name in ("rkv_resident", "rkv_offload"):
    assert rows[name]["tokens_per_s"] > 0 and rows[name]["n_steps"] == 2, rows[name]
  assert rows["rkv_resident"]["jitted"] and not rows["rkv_offload"]["jitted"]
  # The planner's pick depends on the profile's figures: any tail tactic the fill builds.
  tactics = rows["rkv_offload"]["tactics"]
  assert sum(tactics.get(t, 0) for t in decode_bench.FILLED_TACTICS if t != "resident") >= 1
  assert rows["rkv_offload"]["capacity"] == 512 and rows["rkv_offload"]["fill"] == 509
  assert rows["rkv_offload"]["host_kv_gib"] > 0
  assert "rkv_resident" in decode_bench.format_table(result)
  assert rows["rkv_offload"]["schedule"] == "eager" and rows["rkv_resident"]["schedule"] is None
  assert 0 < rows["rkv_offload"]["host_s"] <= rows["rkv_offload"]["step_max_s"]


def test_unrolled_schedule_row():
  cfg = decode_bench.BenchConfig(configs=("rkv_offload",), schedule="unrolled", **TINY)
  rows = decode_bench.run_rkv(cfg, log=lambda m: None)
  assert rows[0]["schedule"] == "unrolled" and rows[0]["tokens_per_s"] > 0, rows[0]


def test_schedules_match_rolling():
  from rkv import rolling
  assert decode_bench.SCHEDULES == rolling.SCHEDULES
  with pytest.raises(ValueError, match="schedule"):
    decode_bench.BenchConfig(schedule="scan")


def test_filled_rolling_holds_the_context():
  import jax
  from rkv.models import ModelConfig
  mc = ModelConfig.preset("tiny-llama")
  kv = decode_bench.filled_rolling(mc, 1, 300, 290, window_cells=128, tile_cells=64,
                                   key=jax.random.key(0), rand=decode_bench._rand_fn())
  assert kv.fill == 290 and kv.n_full_tiles == 2 and kv.n_staged == 34
  cells = kv.cells()
  assert (cells["pos"][0] == range(290)).all()


def test_resident_skipped_when_it_does_not_fit():
  cfg = decode_bench.BenchConfig(configs=("rkv_resident",), device_memory_gib=1e-6, **TINY)
  rows = decode_bench.run_rkv(cfg, log=lambda m: None)
  assert "skipped" in rows[0] and "needs" in rows[0]["skipped"]


def test_ratios():
  rows = [dict(config="rkv_resident", context=8, tokens_per_s=30.0),
          dict(config="hf_static", context=8, tokens_per_s=20.0),
          dict(config="rkv_offload", context=8, skipped="x")]
  r = {(x["numerator"], x["context"]): x["ratio"] for x in decode_bench.ratios(rows)}
  assert r[("rkv_resident", 8)] == 1.5 and r[("rkv_offload", 8)] is None


_NO_TORCH = decode_bench.torch_available()


def test_hf_rows_marked_skipped_without_torch():
  if _NO_TORCH is None:
    pytest.skip("torch is importable: the skip path does not apply")
  cfg = decode_bench.BenchConfig(configs=("hf_static", "hf_offloaded"), **TINY)
  rows, _ = decode_bench.run_hf_isolated(cfg, log=lambda m: None)
  assert all("not importable" in r["skipped"] for r in rows)


@pytest.mark.skipif(_NO_TORCH is not None, reason=f"torch/transformers missing: {_NO_TORCH}")
def test_hf_rows_on_cpu():
  # Static cache only: transformers' offloading prefetches on a CUDA stream.
  cfg = decode_bench.BenchConfig(configs=("hf_static",), hf_device="cpu", **TINY)
  rows, env = decode_bench.run_hf(cfg, log=lambda m: None)
  assert env["offloaded_caches_available"]
  for r in rows:
    assert r.get("tokens_per_s", 0) > 0, r


def test_capacity_is_the_context_and_fill_leaves_room_for_the_steps():
  cfg = decode_bench.BenchConfig(**TINY)
  assert cfg.decode_steps == 3 and cfg.capacity(512) == 512 and cfg.fill(512) == 509
  with pytest.raises(ValueError, match="decode steps"):
    decode_bench.BenchConfig(**dict(TINY, contexts=(3,)))
