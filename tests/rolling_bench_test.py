"""Smoke test of the rolling benchmark library at tiny sizes on CPU (not a timed test)."""

import dataclasses
import json

import pytest

from lab import rolling_bench as bench

STEP_KEYS = {"context", "window_fraction", "window_cells", "tail_cells", "tile_cells", "schedule",
             "step_s", "model_s", "window_s", "h2d_gbps", "tail_gbps", "resident_s", "naive_s",
             "step_over_model", "hlo"}
APPEND_KEYS = {"context", "tail_cells", "append_s", "cache_wait_s", "flush_s"}


def test_bench_runs_tiny_on_cpu(tmp_path):
  cfg = bench.BenchConfig(contexts=(96,), window_fractions=(1.0, 0.5), tile_cells=(16,),
                          num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32", warmup=0,
                          repeats=1, append_steps=4)
  result = bench.run(cfg)
  path = tmp_path / "out" / "rolling_bench.json"
  bench.write_json(result, str(path))
  loaded = json.load(open(path))
  assert {"jax", "backend", "device", "config", "steps", "appends"} <= set(loaded)
  assert [r["schedule"] for r in loaded["steps"]] == ["resident", "eager", "unrolled"]
  for row in loaded["steps"]:
    assert STEP_KEYS <= set(row)
    assert row["step_s"] > 0
  eager, unrolled = loaded["steps"][1:]
  assert eager["lookahead"] == unrolled["lookahead"] == 4
  assert eager["model_s"] >= max(eager["window_s"], 0) and eager["hlo"] is None
  assert eager["naive_s"] > 0
  # The unrolled program takes k and v of each of the 3 streamed tiles as host arguments.
  assert unrolled["tail_cells"] == 48 and unrolled["hlo"]["host_params"] == 6
  assert [r["tail_cells"] for r in loaded["appends"]] == [0, 16, 48]
  for row in loaded["appends"]:
    assert APPEND_KEYS <= set(row) and row["append_s"] > 0
  assert loaded["appends"][1]["flush_s"] > 0
  assert "schedule" in bench.format_table(result)


def test_bench_lookaheads_and_bad_schedule():
  cfg = bench.BenchConfig(contexts=(64,), window_fractions=(0.5,), tile_cells=(16,),
                          schedules=("eager",), lookaheads=(1, None), num_heads=2,
                          num_kv_heads=1, head_dim=8, dtype="float32", warmup=0, repeats=1,
                          append_steps=2, resident=False, naive=False)
  result = bench.run(cfg)
  assert [(r["schedule"], r["lookahead"]) for r in result["steps"]] == [("eager", 1),
                                                                       ("eager", None)]
  assert " all " in bench.format_table(result)
  with pytest.raises(ValueError, match="schedules"):
    bench.run(dataclasses.replace(cfg, schedules=("scan",)))
  with pytest.raises(ValueError, match="lookahead"):
    bench.run(dataclasses.replace(cfg, lookaheads=(0,)))


def test_bench_hybrid_rows():
  cfg = bench.BenchConfig(contexts=(64,), window_fractions=(0.5,), tile_cells=(16,),
                          schedules=("eager",), hybrid_cpu_fractions=(0.5,), num_heads=2,
                          num_kv_heads=1, head_dim=8, dtype="float32", warmup=0, repeats=1,
                          append_steps=2, resident=False, naive=False)
  result = bench.run(cfg)
  rows = result["steps"]
  assert [(r["tactic"], r["cpu_fraction"]) for r in rows] == [("stream", None), ("hybrid", 0.5)]
  assert rows[1]["step_s"] > 0 and rows[1]["model_s"] is None
  assert "hyb0.50" in bench.format_table(result)
  with pytest.raises(ValueError, match="cpu_fraction"):
    bench.run(dataclasses.replace(cfg, hybrid_cpu_fractions=(1.5,)))
