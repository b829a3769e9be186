"""Smoke run of issue 14's pool benchmarks (lab/pool_bench.py) at tiny CPU shapes: every scenario
runs end to end and reports its fields; the figures themselves come from the H200."""

from lab import pool_bench


def test_every_scenario_runs_at_tiny_shapes():
  cfg = pool_bench.PoolBenchConfig.quick(warmup=0, steps=1)
  out = pool_bench.run(cfg, log=lambda *a: None)
  rows = {(r["scenario"], r.get("layout")): r for r in out["rows"]}
  assert all("error" not in r for r in out["rows"]), out["rows"]
  ragged, padded = rows[("ragged", "ragged")], rows[("ragged", "padded")]
  assert ragged["cells"] == sum(cfg.ragged_lengths) < padded["cells"]
  assert ragged["kv_bytes_read"] < padded["kv_bytes_read"]  # padding is read too
  for r in (ragged, padded, rows[("offload", None)]):
    assert r["tokens_per_s"] > 0 and r["bound_tokens_per_s"] > 0 and r["ratio_to_bound"] > 0
  assert rows[("offload", None)]["host_share"] == 0.5  # whole pages, half of each sequence
  chat = rows[("chat", None)]
  assert chat["prefill_tokens_kept"] == cfg.chat_new_tokens and chat["kept_ttft_s"] > 0
