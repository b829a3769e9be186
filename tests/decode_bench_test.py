"""CPU smoke test of the end-to-end decode benchmark at a tiny preset (not a timed test)."""

import json

import numpy as np
import pytest

from lab import decode_bench

ROW_FIELDS = {"config", "context", "batch", "kv_dtype", "tokens_per_s", "bound_tokens_per_s",
              "bound_s", "bound_ratio", "device_bytes", "tail_bytes", "hbm_gbps", "link_gbps",
              "bound_by"}

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
  # The fill stops short of the capacity by the warm-up, the pipelined and the synchronous steps.
  assert rows["rkv_offload"]["capacity"] == 512 and rows["rkv_offload"]["fill"] == 512 - 1 - 2 * 2
  for name in ("rkv_resident", "rkv_offload"):
    r = rows[name]
    assert r["pipelined"] and r["sync_tokens_per_s"] == pytest.approx(1 / r["sync_step_s"])
    assert 0 < r["sync_host_s"] <= r["sync_step_s"]
  assert rows["rkv_offload"]["host_kv_gib"] > 0
  assert "rkv_resident" in decode_bench.format_table(result)
  assert rows["rkv_offload"]["schedule"] == "eager" and rows["rkv_resident"]["schedule"] is None
  # Pipelined, a step's host side overlaps the previous step's device work, so only the waited-for
  # steps bound their host time by their step time.
  assert rows["rkv_offload"]["host_s"] > 0
  # Every rkv row carries the fields and its bound.
  for name in ("rkv_resident", "rkv_offload"):
    r = rows[name]
    assert ROW_FIELDS <= set(r), ROW_FIELDS - set(r)
    assert r["batch"] == 1 and r["kv_dtype"] == "float32"
    assert r["bound_tokens_per_s"] == pytest.approx(1 / r["bound_s"])
    assert r["bound_ratio"] == pytest.approx(r["step_s"] / r["bound_s"])
    assert r["device_bytes"] > decode_bench.weight_read_bytes(decode_bench.model_config(cfg))
  assert rows["rkv_resident"]["tail_bytes"] == 0 and rows["rkv_resident"]["link_gbps"] == {}
  assert rows["rkv_offload"]["tail_bytes"] > 0 and rows["rkv_offload"]["budget"] == "fraction"
  assert set(rows["rkv_offload"]["link_gbps"]) <= {"stream", "cpu", "hybrid"}


def test_unrolled_schedule_row():
  cfg = decode_bench.BenchConfig(configs=("rkv_offload",), schedule="unrolled", **TINY)
  rows = decode_bench.run_rkv(cfg, log=lambda m: None)
  assert rows[0]["schedule"] == "unrolled" and rows[0]["tokens_per_s"] > 0, rows[0]


def test_schedules_match_rolling():
  from rkv import cache, rolling
  from rkv.models import kv
  assert decode_bench.SCHEDULES == rolling.SCHEDULES
  assert decode_bench.KV_DTYPES == cache.KV_DTYPES
  assert decode_bench.SCALE_DTYPE_ENV == cache.SCALE_DTYPE_ENV
  assert decode_bench.DEFAULT_SCALE_DTYPE == cache.DEFAULT_SCALE_DTYPE
  import jax.numpy as jnp
  assert decode_bench.SCALE_ITEMSIZES == {n: np.dtype(jnp.dtype(n)).itemsize
                                          for n in cache.SCALE_DTYPES}
  assert decode_bench.ROLLING_TACTICS == kv.ROLLING_TACTICS
  with pytest.raises(ValueError, match="schedule"):
    decode_bench.BenchConfig(schedule="scan")


def test_filled_rolling_holds_the_context():
  import jax
  from rkv.models import ModelConfig
  mc = ModelConfig.preset("tiny-llama")
  # A window of 128 generated in chunks of 48 (the last one overlapping): all cells written.
  kv = decode_bench.filled_rolling(mc, 1, 300, 290, window_cells=128, tile_cells=64,
                                   key=jax.random.key(0), chunk_cells=48)
  assert kv.fill == 290 and kv.n_full_tiles == 2 and kv.n_staged == 34
  cells = kv.cells()
  assert (cells["pos"][0] == range(290)).all()
  assert (np.abs(cells["k"][0]).sum(axis=(1, 2)) > 0).all()  # no cell left unwritten


def test_filled_rolling_int8_batch2():
  import jax
  from rkv.cache import memory_kinds
  from rkv.models import ModelConfig
  mc = ModelConfig.preset("tiny-llama")
  kv = decode_bench.filled_rolling(mc, 2, 300, 290, window_cells=128, tile_cells=64,
                                   key=jax.random.key(1), kv_dtype="int8")
  assert kv.quantized and kv.dtype == np.int8 and kv.batch == 2
  kinds = memory_kinds(kv)
  for name in ("k", "v", "k_scale", "v_scale"):
    assert kinds[f"tail.{name}[0]"] == "pinned_host" and kinds[f"window.{name}"] == "device"
  cells = kv.cells()
  for b in range(2):  # positions per batch row
    assert (cells["pos"][b] == range(290)).all()
  assert cells["k_scale"].shape == (2, 290, mc.num_kv_heads) and (cells["k_scale"] > 0).all()
  # The traffic of the bound is the cache's own: the full tiles' bytes, window + staging.
  cell = decode_bench.kv_cell_bytes(mc, "int8")
  lt = decode_bench.layer_traffic("stream", capacity=300, window_cells=128, tile_cells=64,
                                  fill=290, batch=2, cell_bytes=cell)
  tail = sum(x.nbytes for t in kv.tail_tiles[:kv.n_full_tiles]
             for x in (t.k, t.v, t.k_scale, t.v_scale))
  assert lt.tail_bytes == tail
  assert lt.device_bytes == kv.nbytes("window") + kv.nbytes("staging")
  # W = capacity: how an int8 layer is resident (no tail, no staging).
  res = decode_bench.filled_rolling(mc, 1, 300, 290, window_cells=300, tile_cells=64,
                                    key=jax.random.key(2), kv_dtype="int8")
  assert res.n_tail_tiles == 0 and res.nbytes("staging") == 0 and res.fill == 290


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
  # Rows of another batch are not compared with these.
  rows.append(dict(config="hf_static", context=8, batch=4, tokens_per_s=10.0))
  r = {(x["numerator"], x["batch"]): x["ratio"] for x in decode_bench.ratios(rows)}
  assert r[("rkv_resident", 1)] == 1.5 and r[("rkv_resident", 4)] is None


def test_merge_results_appends_runs():
  a = dict(time="t0", config=dict(batch=1), model={}, hf={}, wall_s=1.0,
           rows=[dict(config="rkv_offload", context=8, batch=1, tokens_per_s=2.0)])
  b = dict(time="t1", config=dict(batch=8), model={}, hf={}, wall_s=2.0, device="X",
           rows=[dict(config="rkv_offload", context=8, batch=8, tokens_per_s=9.0)])
  m = decode_bench.merge_results(a, b)
  assert [r["batch"] for r in m["rows"]] == [1, 8] and m["device"] == "X"
  assert [r["time"] for r in m["runs"]] == ["t0", "t1"]
  m2 = decode_bench.merge_results(m, b)
  assert len(m2["runs"]) == 3 and len(m2["rows"]) == 3


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
  # warm-up 1 + 2 pipelined + 2 waited-for steps
  assert cfg.decode_steps == 5 and cfg.capacity(512) == 512 and cfg.fill(512) == 507
  with pytest.raises(ValueError, match="decode steps"):
    decode_bench.BenchConfig(**dict(TINY, contexts=(5,)))


# ----------------------------------------------------------------------------------------------
# Beyond HBM: the bound, budget="auto", int8, batch > 1, the checks before a fill
# ----------------------------------------------------------------------------------------------
def test_step_bound_arithmetic():
  sb = decode_bench.step_bound
  # Resident: no tail, the device bytes over HBM.
  r = sb(8e9, 4000.0)
  assert r["bound_s"] == pytest.approx(2e-3) and r["tail_s"] == 0 and r["bound_by"] == "device"
  # Stream: 200 MB over 50 GB/s = 4 ms beats 8 GB over 4 TB/s = 2 ms.
  r = sb(8e9, 4000.0, [(200e6, 50.0)])
  assert r["bound_s"] == pytest.approx(4e-3) and r["bound_by"] == "tail"
  # Layers run one after another: their tail times add (2 ms + 1 ms); a 0-byte tail needs no rate.
  r = sb(4e9, 4000.0, [(100e6, 50.0), (100e6, 100.0), (0, None)])
  assert r["tail_s"] == pytest.approx(3e-3) and r["device_s"] == pytest.approx(1e-3)
  with pytest.raises(ValueError, match="rate"):
    sb(1e9, 4000.0, [(1e6, None)])
  with pytest.raises(ValueError, match="hbm_gbps"):
    sb(1e9, 0.0)


def test_link_rates_and_bound_fields():
  from rkv.residency import Profile
  prof = Profile(pcie_gbps=50.0, d2h_gbps=50.0, hbm_gbps=4000.0, cpu_attn_gbps=80.0,
                 host_read_gbps=100.0, hybrid_pcie_gbps=40.0, hybrid_cpu_gbps=60.0)
  rates = decode_bench.link_rates_gbps(prof)
  # hybrid: both sides at their contended rates at once, 40 + 60.
  assert rates == pytest.approx(dict(stream=50.0, cpu=80.0, hybrid=100.0))
  # cpu_attn above host_read: the CPU rate is capped by host reads (rkv.residency.cpu_rate).
  assert decode_bench.link_rates_gbps(prof.replace(cpu_attn_gbps=150.0))["cpu"] == 100.0
  LT = decode_bench.LayerTraffic
  layers = [LT("resident", 1e9, 0), LT("stream", 1e9, 100e6), LT("hybrid", 1e9, 300e6),
            LT("cpu", 1e9, 160e6)]
  f = decode_bench.bound_fields(layers, 4e9, 4000.0, rates, batch=2)
  # device: (4 + 4 x 1) GB / 4 TB/s = 2 ms; tail: 2 + 3 + 2 ms = 7 ms.
  assert f["device_bytes"] == 8e9 and f["tail_bytes"] == 560e6
  assert f["device_s"] == pytest.approx(2e-3) and f["tail_s"] == pytest.approx(7e-3)
  assert f["bound_s"] == pytest.approx(7e-3) and f["bound_tokens_per_s"] == pytest.approx(2 / 7e-3)
  assert f["link_gbps"] == pytest.approx(dict(cpu=80.0, hybrid=100.0, stream=50.0))
  with pytest.raises(ValueError, match="link rate"):
    decode_bench.bound_fields(layers, 0, 4000.0, dict(rates, cpu=None), batch=1)
  # Bytes of a layer: resident = the whole cache; rolling = window + staging on the device and
  # the full tiles at the fill (1000 - 300 = 700 cells: 5 tiles of 128, 60 staged).
  tr = lambda tactic, w: decode_bench.layer_traffic(tactic, capacity=1024, window_cells=w,
                                                    tile_cells=128, fill=1000, batch=2,
                                                    cell_bytes=10)
  assert tr("resident", 1024) == LT("resident", 2 * 1024 * 10, 0)
  assert tr("stream", 300) == LT("stream", 2 * (300 + 128) * 10, 2 * 5 * 128 * 10)


def test_check_fill():
  kw = dict(device_bytes=10 * decode_bench.GIB, transient_bytes=decode_bench.GIB, host_bytes=0,
            host_available=None, host_fraction=0.85, what="row")
  decode_bench.check_fill(free_device=None, **kw)  # no stats: no check
  decode_bench.check_fill(free_device=11 * decode_bench.GIB, **kw)
  with pytest.raises(ValueError, match=r"needs 11.00 GiB .* 10.50 GiB is free"):
    decode_bench.check_fill(free_device=int(10.5 * decode_bench.GIB), **kw)
  with pytest.raises(ValueError, match="host tail needs 9.00 GiB"):
    decode_bench.check_fill(**dict(kw, host_bytes=9 * decode_bench.GIB,
                                   host_available=10 * decode_bench.GIB), free_device=None)


def test_int8_rows_with_a_tail():
  cfg = decode_bench.BenchConfig(configs=("rkv_resident", "rkv_offload"), kv_dtype="int8",
                                 **dict(TINY, contexts=(384, 512)))
  rows = decode_bench.run_rkv(cfg, log=lambda m: None)
  assert [(r["config"], r["context"]) for r in rows] == [
      ("rkv_resident", 384), ("rkv_offload", 384), ("rkv_resident", 512), ("rkv_offload", 512)]
  for r in rows:
    assert r.get("tokens_per_s", 0) > 0 and r["kv_dtype"] == "int8", r
    assert ROW_FIELDS <= set(r)
    assert not r["jitted"]  # int8 layers are RollingKVs, attended eagerly
  off = [r for r in rows if r["config"] == "rkv_offload"]
  assert all(r["host_kv_gib"] > 0 and r["tail_bytes"] > 0 for r in off)
  assert all("resident_as" in r and r["tail_bytes"] == 0 for r in rows
             if r["config"] == "rkv_resident")


def test_rows_with_the_embedding_in_host_ram():
  cfg = decode_bench.BenchConfig(configs=("rkv_resident", "rkv_offload"), embedding="host",
                                 **TINY)
  rows = decode_bench.run_rkv(cfg, log=lambda m: None)
  assert [r["config"] for r in rows] == ["rkv_resident", "rkv_offload"]
  for r in rows:
    assert r.get("tokens_per_s", 0) > 0 and r["embedding"] == "host", r
  assert decode_bench.BenchConfig(**TINY).embedding == "device"


def test_batch2_rows():
  cfg = decode_bench.BenchConfig(configs=("rkv_resident", "rkv_offload"), batch=2, **TINY)
  rows = decode_bench.run_rkv(cfg, log=lambda m: None)
  for r in rows:
    assert r.get("tokens_per_s", 0) > 0 and r["batch"] == 2, r
    assert r["bound_tokens_per_s"] == pytest.approx(2 / r["bound_s"])
  assert rows[0]["jitted"] and rows[1]["tail_bytes"] > 0


def _fake_stats(free_bytes):
  return lambda: dict(bytes_limit=free_bytes + 1000, bytes_in_use=1000)


def test_budget_auto_with_injected_memory_stats():
  # CPU reports no memory stats: inject them. Free memory = reserve + half the KV.
  mc = decode_bench.model_config(decode_bench.BenchConfig(**TINY))
  kv = decode_bench.kv_bytes(mc, 512, 1)
  reserve_mib = 1.0
  free = int(reserve_mib * decode_bench.MIB) + kv // 2
  logs = []
  cfg = decode_bench.BenchConfig(configs=("rkv_offload",), budget="auto",
                                 reserve_mib=reserve_mib, fill_log_every=1, **TINY)
  rows = decode_bench.run_rkv(cfg, log=logs.append, memory_stats=_fake_stats(free))
  r = rows[0]
  assert r.get("tokens_per_s", 0) > 0, r
  assert r["budget"] == "auto" and r["vram_target_mib"] == 0
  assert r["budget_gib"] * decode_bench.GIB == pytest.approx(kv // 2)
  assert r["free_device_gib"] * decode_bench.GIB == pytest.approx(free)
  assert r["host_kv_gib"] > 0 and r["device_kv_gib"] * decode_bench.GIB <= kv // 2
  assert sum("fill layer" in m for m in logs) == mc.num_layers  # a line per layer here


def test_budget_auto_without_memory_stats_is_a_row_error():
  cfg = decode_bench.BenchConfig(configs=("rkv_offload",), budget="auto", **TINY)
  rows = decode_bench.run_rkv(cfg, log=lambda m: None, memory_stats=lambda: None)
  assert "memory stats" in rows[0]["error"], rows[0]


def test_fill_refused_before_running_out_of_device_memory():
  # 10 GiB of device, all but 1 KiB in use: the resident caches fit the device (the skip check)
  # but not its free memory.
  gib = decode_bench.GIB
  stats = lambda: dict(bytes_limit=10 * gib, bytes_in_use=10 * gib - 1024)
  cfg = decode_bench.BenchConfig(configs=("rkv_resident", "rkv_offload"), **TINY)
  rows = decode_bench.run_rkv(cfg, log=lambda m: None, memory_stats=stats)
  res, off = rows
  assert res["error"].startswith("ValueError"), res
  assert "is free" in res["error"] and "skipped" not in res, res
  assert res["bound_s"] > 0 and res["tokens_per_s"] is None  # the bound is there anyway
  # rkv_offload: refused too (by this check, or by a planner that checks free memory itself).
  assert off["error"].startswith("ValueError") and "free" in off["error"], off


def test_config_checks_and_hf_skip_for_int8():
  with pytest.raises(ValueError, match="budget"):
    decode_bench.BenchConfig(budget="all")
  with pytest.raises(ValueError, match="budget"):
    decode_bench.BenchConfig(budget="auto", offload_mode="force")
  with pytest.raises(ValueError, match="kv_dtype"):
    decode_bench.BenchConfig(kv_dtype="int4")
  with pytest.raises(ValueError, match="embedding"):
    decode_bench.BenchConfig(embedding="auto")
  cfg = decode_bench.BenchConfig(configs=("hf_static",), kv_dtype="int8", **TINY)
  assert cfg.kv_dtype_name == "int8"
  assert decode_bench.BenchConfig(**TINY).kv_dtype_name == "float32"
  rows, _ = decode_bench.run_hf_isolated(cfg, log=lambda m: None)
  assert "kv_dtype=int8" in rows[0]["skipped"] and rows[0]["kv_dtype"] == "int8"


@pytest.mark.parametrize("tactic", ["cpu", "hybrid"])
def test_host_tactic_layers_int8_batch2(tactic):
  # The tiny planner always streams: force the host-kernel tactics to run the fill's int8 tails
  # through them with two batch rows.
  import jax
  from flax import nnx
  from rkv import generate as gen
  from rkv.generate import Stepper
  from rkv.models import Transformer
  cfg = decode_bench.BenchConfig(configs=("rkv_offload",), kv_dtype="int8", batch=2, **TINY)
  mc = decode_bench.model_config(cfg)
  plan, _ = decode_bench._offload_plan(cfg, mc, 512)
  plan = gen.force_tactic(plan, tactic, window_cells=128, tile_cells=128)
  caches = decode_bench.build_caches(cfg, mc, 512, jax.random.key(0), plan, log=lambda m: None)
  assert all(c.tactic == tactic and c.quantized and c.n_full_tiles == 2 for c in caches)
  model = Transformer(mc, rngs=nnx.Rngs(0))
  step = Stepper(model, caches, None)
  times, _, caches = decode_bench._decode_rkv(step, caches, cfg.fill(512), 0, 2, 2)
  assert len(times) == 2 and caches[0].fill == cfg.fill(512) + 2
  b = decode_bench.plan_bound(plan, mc, cfg.fill(512))
  assert set(b["link_gbps"]) == {tactic} and b["tail_bytes"] == 2 * mc.num_layers * (
      2 * 128 * decode_bench.kv_cell_bytes(mc, "int8"))


def test_decode_trace_specs_are_checked():
  from experiments import decode_trace
  assert decode_trace.parse_spec("resident:2048") == ("resident", 2048, None)
  assert decode_trace.parse_spec("offload:131072:0.5") == ("offload", 131072, 0.5)
  assert decode_trace.parse_spec("beyond:1048576") == ("beyond", 1048576, None)
  for bad in ("foo:1024", "offload:1024", "resident:x", "resident:1024:0.5", "offload:1024:2",
              "resident"):
    with pytest.raises(ValueError, match="--configs"):
      decode_trace.parse_spec(bad)


def test_split_sweep_overrides_the_cpu_share_and_restores_the_plan():
  # Three full tiles a hybrid layer: the sweep runs the planned share, then 0 / 2 / 5 (clipped to
  # 3) CPU tiles, each from the same caches, and the counts it records are the ones that ran.
  import jax
  from flax import nnx
  from rkv import generate as gen, rolling
  from rkv.generate import Stepper
  from rkv.models import Transformer
  cfg = decode_bench.BenchConfig(configs=("rkv_offload",), split_cpu_tiles=(0, 2, 5),
                                 sweep_rounds=1, **TINY)
  assert cfg.sweep_steps == 4 * (1 + 2) and cfg.fill(512) == 512 - 1 - 2 * 2 - 12
  mc = decode_bench.model_config(cfg)
  plan, _ = decode_bench._offload_plan(cfg, mc, 512)
  plan = gen.force_tactic(plan, "hybrid", window_cells=128, tile_cells=96)
  caches = decode_bench.build_caches(cfg, mc, 512, jax.random.key(0), plan, log=lambda m: None)
  assert all(c.n_full_tiles == 3 for c in caches)
  planned = [c.cpu_fraction for c in caches]
  n_planned = rolling.streamed_count(3, "hybrid", planned[0])
  assert decode_bench.split_counts(decode_bench.with_cpu_tiles(caches, 2)) == {
      "1/3": mc.num_layers}
  assert decode_bench.split_counts(decode_bench.with_cpu_tiles(caches, 5)) == {
      "0/3": mc.num_layers}
  model = Transformer(mc, rngs=nnx.Rngs(0))
  step = Stepper(model, caches, None)
  position = caches[0].fill
  entries, caches = decode_bench.split_sweep(step, caches, position, cfg, log=lambda m: None)
  assert [e["cpu_tiles"] for e in entries] == ["planned", 0, 2, 5]
  assert [e["streamed_of"] for e in entries] == [
      {f"{n_planned}/3": mc.num_layers}, {"3/3": mc.num_layers}, {"1/3": mc.num_layers},
      {"0/3": mc.num_layers}]
  assert all(e["tokens_per_s"] > 0 and e["n_steps"] == 2 for e in entries)
  assert caches[0].fill == position + 4 * 3
  with pytest.raises(ValueError, match="split_cpu_tiles"):
    decode_bench.BenchConfig(split_cpu_tiles=(-1,), **TINY)
  with pytest.raises(ValueError, match="sweep_rounds"):
    decode_bench.BenchConfig(sweep_rounds=0, **TINY)


def test_step_switches_are_the_library_switches():
  from rkv import rolling
  from rkv.models import transformer
  from rkv.offload import cpu_attention, memory, stream
  assert set(decode_bench.STEP_SWITCHES) == {
      rolling.EARLY_PUTS_ENV, rolling.EARLY_CPU_ENV, rolling.EARLY_Q_COPY_ENV,
      rolling.WORKER_FIRST_ENV, rolling.EARLY_PUT_ALL_ENV, rolling.TILES_ONE_PROGRAM_ENV,
      rolling.SWITCH_INTERVAL_ENV, stream.NEXT_PUTS_ENV, transformer.HOST_SHARE_ENV,
      memory.DIRECT_PUTS_ENV, cpu_attention.PINNED_OUT_ENV, cpu_attention._BUFFERS_ENV}
  assert len(set(decode_bench.STEP_SWITCHES)) == len(decode_bench.STEP_SWITCHES)


def test_env_entries_parse_and_refuse_what_a_sweep_cannot_switch():
  assert decode_bench.parse_env_entry("RKV_HOST_SHARE=1+RKV_TILES_ONE_PROGRAM=1") == (
      ("RKV_HOST_SHARE", "1"), ("RKV_TILES_ONE_PROGRAM", "1"))
  assert decode_bench.env_label((("RKV_HOST_SHARE", "1"), ("RKV_EARLY_CPU", "0"))) == (
      "RKV_HOST_SHARE=1+RKV_EARLY_CPU=0")
  for bad, match in (("RKV_HOST_SHARE", "NAME=VALUE"), ("=1", "NAME=VALUE"),
                     ("RKV_FUSED_DECODE=1", "not switches read at every step"),
                     ("RKV_CPU_TAIL_THREADS=14", "not switches read at every step"),
                     ("RKV_HOST_SHARE=1+RKV_HOST_SHARE=0", "twice")):
    with pytest.raises(ValueError, match=match):
      decode_bench.parse_env_entry(bad)
  with pytest.raises(ValueError, match="sweep_env"):
    decode_bench.BenchConfig(sweep_env=(("RKV_PREFETCH_TILES", "8"),), **TINY)
  with pytest.raises(ValueError, match="sweep_env"):
    decode_bench.BenchConfig(sweep_env=((("RKV_PREFETCH_TILES", "8"),),), **TINY)
  assert decode_bench.parse_split_env("2@RKV_HOST_SHARE=0") == (2, (("RKV_HOST_SHARE", "0"),))
  for bad, match in (("RKV_HOST_SHARE=0", "N@NAME"), ("x@RKV_HOST_SHARE=0", "N@NAME"),
                     ("-1@RKV_HOST_SHARE=0", "N@NAME"), ("1@RKV_FUSED_DECODE=1", "not switches")):
    with pytest.raises(ValueError, match=match):
      decode_bench.parse_split_env(bad)
  with pytest.raises(ValueError, match="split_env"):
    decode_bench.BenchConfig(split_env=((-1, (("RKV_HOST_SHARE", "0"),)),), **TINY)
  with pytest.raises(ValueError, match="not switches"):
    decode_bench.BenchConfig(split_env=((1, (("RKV_FUSED_DECODE", "1"),)),), **TINY)


def test_env_sweep_times_each_setting_on_the_same_caches(monkeypatch):
  # The plan's own settings, then each entry, every round, on one fill: each entry's steps run
  # under its settings (seen by the decode loop) and nothing stays set after it.
  import os
  import jax
  from flax import nnx
  from rkv import generate as gen
  from rkv.generate import Stepper
  from rkv.models import Transformer
  monkeypatch.delenv("RKV_HOST_SHARE", raising=False)
  monkeypatch.delenv("RKV_EARLY_Q_COPY", raising=False)
  env = (("RKV_HOST_SHARE", "1"),), (("RKV_EARLY_Q_COPY", "1"), ("RKV_EARLY_CPU", "0"))
  split_env = ((1, (("RKV_EARLY_CPU", "0"),)),)
  cfg = decode_bench.BenchConfig(configs=("rkv_offload",), sweep_env=env, sweep_rounds=2,
                                 split_cpu_tiles=(0,), split_env=split_env, **TINY)
  assert cfg.sweep_steps == 2 * 5 * (1 + 2)
  mc = decode_bench.model_config(cfg)
  plan, _ = decode_bench._offload_plan(cfg, mc, 512)
  plan = gen.force_tactic(plan, "hybrid", window_cells=128, tile_cells=96)
  caches = decode_bench.build_caches(cfg, mc, 512, jax.random.key(0), plan, log=lambda m: None)
  step = Stepper(Transformer(mc, rngs=nnx.Rngs(0)), caches, None)
  seen = []
  real = decode_bench._decode_rkv

  def spy(*args, **kwargs):
    seen.append({n: os.environ.get(n) for n in ("RKV_HOST_SHARE", "RKV_EARLY_Q_COPY",
                                                 "RKV_EARLY_CPU")})
    return real(*args, **kwargs)

  monkeypatch.setattr(decode_bench, "_decode_rkv", spy)
  position = caches[0].fill
  entries, caches = decode_bench.split_sweep(step, caches, position, cfg, log=lambda m: None)
  labels = ["planned", "cpu_tiles=0", "RKV_HOST_SHARE=1", "RKV_EARLY_Q_COPY=1+RKV_EARLY_CPU=0",
            "cpu_tiles=1+RKV_EARLY_CPU=0"]
  # Round 1 runs them in reverse (a drift over the run favours none).
  assert [decode_bench.variant_label(e) for e in entries] == labels + labels[::-1]
  assert [e["round"] for e in entries] == [0] * 5 + [1] * 5
  none = dict(RKV_HOST_SHARE=None, RKV_EARLY_Q_COPY=None, RKV_EARLY_CPU=None)
  envs = [none, none, dict(none, RKV_HOST_SHARE="1"),
          dict(none, RKV_EARLY_Q_COPY="1", RKV_EARLY_CPU="0"), dict(none, RKV_EARLY_CPU="0")]
  assert seen == envs + envs[::-1]
  # The split_env item ran its split (3 full tiles a layer here: 1 on the CPU, 2 streamed).
  assert {k: v for e in entries if e["cpu_tiles"] == 1 for k, v in e["streamed_of"].items()} == (
      {"2/3": mc.num_layers})
  assert "RKV_HOST_SHARE" not in os.environ and "RKV_EARLY_Q_COPY" not in os.environ
  # The share ran its layers while its entry was set (the forward records the layers it served).
  assert len(step.fn.host_shares) > 0
  assert caches[0].fill == position + 2 * 5 * 3
  medians = decode_bench.sweep_medians(entries)
  assert list(medians) == labels
  assert all(m["rounds"] == 2 and m["tokens_per_s"] > 0 for m in medians.values())
  assert medians["planned"]["vs_planned"] == 1.0


def test_rows_count_the_layers_that_ran_the_host_share(monkeypatch):
  # $RKV_HOST_SHARE moves a cpu / hybrid layer's CPU share into rkv.offload.host_share; a row
  # records how many layers it ran for, so a row with the switch set but no share is visible.
  from rkv import generate as gen
  planned = decode_bench._offload_plan

  def hybrid_plan(*args, **kw):
    plan, info = planned(*args, **kw)
    return gen.force_tactic(plan, "hybrid", window_cells=128, tile_cells=96), info

  monkeypatch.setattr(decode_bench, "_offload_plan", hybrid_plan)
  counts = {}
  for switch in ("0", "1"):
    monkeypatch.setenv("RKV_HOST_SHARE", switch)
    (row,) = decode_bench.run_rkv(decode_bench.BenchConfig(configs=("rkv_offload",), **TINY),
                                  log=lambda m: None)
    counts[switch] = row["host_share_layers"]
  assert counts["0"] == 0
  # Every layer is hybrid (forced above; the row's tactics are the plan's before forcing).
  layers = decode_bench.model_config(decode_bench.BenchConfig(**TINY)).num_layers
  assert counts["1"] == layers >= 1, counts
