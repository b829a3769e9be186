"""CPU smoke test of the stacked decode rows (lab.kernel_bench.run_layers): every contender runs,
agrees with rkv's default path, and its figures are consistent with its time."""

from lab import kernel_bench


def test_layer_rows_agree_and_their_figures_follow_the_time():
  result = kernel_bench.run_layers(contexts=[256], layers=2, n_outer=1, log=lambda m: None,
                                   sweep_decode=[{"num_splits": 2}])
  rows = {r["impl"]: r for r in result["rows"]}
  assert set(rows) == {"rkv_pallas", "rkv_pallas[0]", "jax_xla"}, rows
  layer_bytes = 2 * 256 * 8 * 128 * 4  # K and V, float32 on the CPU
  for r in rows.values():
    assert r["max_abs_diff_vs_rkv_pallas"] < 1e-4, r
    per_layer = r["us_per_layer"] * 1e-6
    assert abs(r["kv_read_tbps"] - layer_bytes / per_layer / 1e12) < 1e-12
    assert abs(r["hbm_bound_ratio"] * layer_bytes / (kernel_bench.HBM_TBPS * 1e12)
               - per_layer) < 1e-12
  assert rows["rkv_pallas[0]"]["block_sizes"] == {"num_splits": 2}


def test_bad_layers_or_contexts_are_refused_by_name():
  import pytest
  with pytest.raises(ValueError, match="layers must"):
    kernel_bench.run_layers(contexts=[256], layers=0)
  with pytest.raises(ValueError, match="contexts must"):
    kernel_bench.run_layers(contexts=[256, -1], layers=2)


def test_int8_layer_rows_read_int8_with_their_scales():
  # rkv's Pallas (interpret mode here) and XLA paths over the same int8 cells and bfloat16 scales
  # agree; the bytes are a byte an element and two a scale.
  result = kernel_bench.run_layers(contexts=[256], layers=2, n_outer=1, log=lambda m: None,
                                   kv_dtype="int8", sweep_decode=[{"block_k": 32}])
  rows = {r["impl"]: r for r in result["rows"]}
  assert set(rows) == {"rkv_pallas", "rkv_pallas[0]", "rkv_xla"}, rows
  layer_bytes = 2 * 256 * 8 * 128 + 2 * 256 * 8 * 2
  for r in rows.values():
    assert r["kv_dtype"] == "int8" and r["max_abs_diff_vs_rkv_pallas"] < 1e-4, r
    assert abs(r["kv_read_tbps"] - layer_bytes / (r["us_per_layer"] * 1e-6) / 1e12) < 1e-12


def test_bad_kv_dtype_is_refused_by_name():
  import pytest
  with pytest.raises(ValueError, match="kv_dtype must"):
    kernel_bench.run_layers(contexts=[256], layers=2, kv_dtype="fp8")
