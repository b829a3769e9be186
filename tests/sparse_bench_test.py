"""The block-cache benchmark's smoke run at tiny shapes on CPU (lab/sparse_bench.py): every row
carries its bound and counters, the selector finds the planted blocks, the JSON is written."""

import json

from lab import sparse_bench

TINY = dict(contexts=(2048,), slot_cells=(512,), select_cells=(128,), block_cells=16,
            num_heads=4, num_kv_heads=2, head_dim=16, layers=2, topics=4, tile_cells=512,
            impl="xla", warmup=1, steps=3, weight_bytes=1e6, dense_tactics=("stream",),
            device_kv_budget_bytes=64e6)


def test_sparse_bench_tiny_on_cpu(tmp_path):
  result = sparse_bench.run(sparse_bench.SparseBenchConfig(**TINY))
  kinds = [r["kind"] for r in result["rows"]]
  assert kinds == ["sparse", "dense_stream"]
  sp, dense = result["rows"]
  for r in (sp, dense):
    assert r["step_ms"] > 0 and r["bound_ms"] > 0 and r["tok_s_bound"] >= r["tok_s_composed"] > 0
  c = sp["counters"]
  assert c["steps"] == 3 and c["hits"] + c["misses"] > 0 and 0 <= sp["hit_rate"] <= 1
  assert sp["planted_recall"] == 1.0  # Quest's bound finds every planted block of the topic
  # The dense baseline moves its whole tail every step; the block cache only its misses.
  assert dense["mib_from_host_per_token"] > sp["mib_from_host_per_token"]
  assert sp["freed"]["sequences_at_dense_resident_memory"] >= 1
  assert sp["freed"]["batch_at_device_budget_sparse"] >= sp["freed"][
      "batch_at_device_budget_dense_resident"]
  path = tmp_path / "sb.json"
  sparse_bench.benchmarking.write_json(str(path), result)
  assert json.load(open(path))["rows"][0]["kind"] == "sparse"
  assert "sparse" in sparse_bench.format_table(result)
