"""CPU smoke test of the micro-batch probe (lab/microbatch_probe.py) on a tiny model."""

from lab import decode_bench
from lab import microbatch_probe


def test_every_variant_runs_and_counts_every_row():
  mc = decode_bench.model_config(decode_bench.BenchConfig(preset="tiny-llama", dtype="float32"))
  kv = decode_bench.kv_bytes(mc, 8192, 4)
  # A quarter of the KV free (plus the reserve), and these stats do not see what a fill takes:
  # every part, the last one too with all of it, and the whole batch keep a host tail.
  reserve = 1 << 16
  free = kv // 4 + reserve
  stats = lambda: dict(bytes_limit=free + 1000, bytes_in_use=1000)
  result = microbatch_probe.run(
      preset="tiny-llama", batch=4, microbatches=2, context=8192, profile_path=None, warmup=1,
      steps=2, cpu_threads=[1], repeats=1, log=lambda m: None, memory_stats=stats,
      dtype="float32", tile_cells=128, min_tile_cells=128, margin_gib=0.0,
      reserve_mib=reserve / (1 << 20))
  rows = {r["variant"]: r for r in result["rows"]}
  assert set(rows) == {"whole", "split", "concurrent", "concurrent_t1"}, result["rows"]
  for r in rows.values():
    assert "error" not in r and r["tokens_per_s"] > 0, r
    assert r["tokens_per_s"] == 4 * 2 / r["seconds"]
  # Every part was planned with its share of the free memory and holds a host tail.
  assert len(rows["split"]["plans"]) == 2
  assert all(p["host_kv_gib"] > 0 for p in rows["split"]["plans"]), rows["split"]["plans"]
  assert rows["whole"]["plan"]["host_kv_gib"] > 0


def test_a_batch_that_does_not_split_evenly_is_refused_before_any_work():
  import pytest
  for batch, micro, what in ((5, 2, "multiple of microbatches"), (4, 1, "microbatches must")):
    with pytest.raises(ValueError, match=what):
      microbatch_probe.run(preset="tiny-llama", batch=batch, microbatches=micro, context=8192,
                           profile_path=None, warmup=1, steps=1, cpu_threads=[], repeats=1,
                           log=lambda m: None, memory_stats=lambda: None)
