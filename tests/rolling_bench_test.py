"""Smoke test of the rolling benchmark library at tiny sizes on CPU (not a timed test)."""

import json

from rkv.offload import bench

STEP_KEYS = {"context", "window_fraction", "window_cells", "tail_cells", "tile_cells", "schedule",
             "step_s", "model_s", "window_s", "h2d_gbps", "tail_gbps", "resident_s", "naive_s",
             "step_over_model", "hlo"}
APPEND_KEYS = {"context", "tail_cells", "append_s", "flush_s"}


def test_bench_runs_tiny_on_cpu(tmp_path):
  cfg = bench.BenchConfig(contexts=(96,), window_fractions=(1.0, 0.5), tile_cells=(16,),
                          num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32", warmup=0,
                          repeats=1, append_steps=4)
  result = bench.run(cfg)
  path = tmp_path / "out" / "rolling_bench.json"
  bench.write_json(result, str(path))
  loaded = json.load(open(path))
  assert {"jax", "backend", "device", "config", "steps", "appends"} <= set(loaded)
  assert [r["schedule"] for r in loaded["steps"]] == ["resident", "scan", "unrolled"]
  for row in loaded["steps"]:
    assert STEP_KEYS <= set(row)
    assert row["step_s"] > 0
  streamed = loaded["steps"][1]
  assert streamed["model_s"] >= max(streamed["window_s"], 0) and streamed["hlo"]["host_params"] == 2
  assert [r["tail_cells"] for r in loaded["appends"]] == [0, 16, 48]
  for row in loaded["appends"]:
    assert APPEND_KEYS <= set(row) and row["append_s"] > 0
  assert loaded["appends"][1]["flush_s"] > 0
  assert "schedule" in bench.format_table(result)
