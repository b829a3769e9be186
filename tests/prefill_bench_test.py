"""The prefill benchmark's lab code on CPU, small: kernel rows at two depths, model chunks through
a planned cache, and the integration of a whole prefill from the measured chunk times."""

from __future__ import annotations

import pytest

from lab import decode_bench as db
from lab import prefill_bench as pb
from tests.support.tolerances import TOLERANCES


def test_kernel_rows_compare_explicit_default_and_generic():
  rows = pb.kernel_rows([0, 256], [128], h=4, kh=2, d=64, n_outer=1, pad=128, log=lambda m: None)
  for r in rows:
    assert "error" not in r, r
    assert r["flops"] == pytest.approx(4 * 4 * 64 * (128 * r["depth"] + 128 * 129 / 2))
    for name in ("tflops", "default_pos_tflops", "generic_tflops", "cache_tflops"):
      assert r[name] > 0
    # Every path computes the same attention as the default-positions call (bf16 outputs, so
    # within the named bf16 output tolerance: a different tiling rounds differently).
    atol = TOLERANCES["bfloat16"]["o"][0]
    for name in ("max_abs_diff", "cache_max_abs_diff", "generic_max_abs_diff"):
      assert r[name] <= atol, (name, r[name])


def test_model_rows_and_the_integrated_prefill():
  mc = db.model_config(db.BenchConfig(preset="tiny-llama"))
  kv = db.kv_bytes(mc, 2048, 1)
  stats = dict(bytes_limit=int(kv * 0.6) + (262 << 20) + 1000, bytes_in_use=1000)
  rows = pb.model_rows([0, 1536], context=2048, chunk=128, steps=2, profile_path=None,
                       rates=dict(attention=lambda d: 1.0, dense=1.0), preset="tiny-llama",
                       memory_stats=stats, log=lambda m: None)
  for r in rows:
    assert "error" not in r, r
    assert r["chunk_s"] > 0 and r["bound_s"] > 0 and len(r["chunk_times_s"]) == 3
  assert rows[1]["attention_flops"] > rows[0]["attention_flops"]
  total = pb.integrate_1m(rows, 2048, 128)
  assert total["chunks"] == 16
  lo, hi = sorted(r["chunk_s"] for r in rows)
  assert 16 * lo <= total["seconds"] <= 16 * hi
