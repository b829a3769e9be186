"""Residency planner, performance model, selector, profiles and the probe (fast, CPU).

Sizes are small (K=2, D=16, float32: a cell of one layer is 2*2*16*4 = 256 bytes of K/V plus a
4-byte position) so the planner's arithmetic can be redone by hand in the comments.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import subprocess
import sys
import types

import pytest
import numpy as np

from rkv import residency as rz
from rkv.planner.profile import INT8_CPU_SHARE_FALLBACK
from rkv.residency import (MIB, WINDOW_ALIGN, AttentionShape, Profile, ResidencyConfig,
                           modeled_times)

K, D = 2, 16
CELL = 2 * K * D * 4      # K+V bytes of one cell (float32)
RES_CELL = CELL + 4       # plus its int32 position: 260 bytes a resident cell
CTX = 4096

# A synthetic machine: round numbers, no fixed costs, so times are bytes / rate.
FLAT = Profile(pcie_gbps=50.0, d2h_gbps=50.0, hbm_gbps=1000.0, attn_overhead_us=0.0,
               cpu_attn_gbps=25.0, host_read_gbps=None, copy_latency_us=0.0, source="test")


def shape(windows=(None, None), num_heads=4, kv_dtype="float32"):
  return AttentionShape(num_layers=len(windows), num_kv_heads=K, head_dim=D,
                        layer_windows=tuple(windows), num_heads=num_heads, kv_dtype=kv_dtype)


def cfg(budget_bytes=None, **kw):
  kw.setdefault("profile", FLAT)
  kw.setdefault("tile_cells", 512)
  kw.setdefault("min_tile_cells", 128)
  if budget_bytes is not None:
    kw["vram_target_mib"] = budget_bytes / MIB
  return ResidencyConfig(**kw)


def check_invariants(p: rz.Plan):
  assert p.device_bytes <= p.budget_bytes
  for lp in p.layers:
    assert lp.window_cells + lp.tail_cells == lp.capacity
    if lp.tactic == "resident":
      assert lp.host_bytes == 0 and lp.tail_cells == 0
    else:
      assert lp.window_cells % WINDOW_ALIGN == 0
      assert lp.tile_cells % WINDOW_ALIGN == 0
      assert lp.host_cells == lp.tail_cells // lp.tile_cells * lp.tile_cells
      assert lp.host_cells > 0


# ----------------------------------------------------------------------------------------------
# Sizing
# ----------------------------------------------------------------------------------------------
def test_window_alignment_covers_every_kernel_block():
  from rkv.pallas import flash_attention, flash_attention_mgpu
  for d in (64, 128, 256):
    assert WINDOW_ALIGN % flash_attention.BlockSizes.for_head_dim(d).block_k == 0
  assert WINDOW_ALIGN % flash_attention_mgpu.BlockSizes().block_kv == 0
  assert WINDOW_ALIGN % 128 == 0  # the decode kernel's largest block_k (BlockSizes.resolve)
  assert rz.DEFAULT_TILE_CELLS % WINDOW_ALIGN == 0


def test_budget_to_window_by_hand():
  # Two global layers, 600,000 bytes each. Resident would need 4096 * 260 = 1,064,960 each.
  p = rz.plan(shape(), CTX, 1, residency=cfg(2 * 600_000, mode="stream"))
  check_invariants(p)
  # About 600,000 // 260 = 2307 cells fit, so ~1789 must leave: tiles of 512 (4 of them) or
  # 384 (5). With tile 512, device bytes = (W + 512) * 256 + 4 * (W + 512 + host cells):
  #   W = 1664: host = (4096 - 1664) // 512 * 512 = 2048 -> 2176*256 + 4*(2176+2048) = 573,952
  #   W = 1792: host = 2048                         -> 2304*256 + 4*(2304+2048) = 607,232 > budget
  # With tile 384 the best is W = 1792, host = 6 * 384 = 2304 cells: more streamed bytes, so 512.
  for lp in p.layers:
    assert (lp.tactic, lp.window_cells, lp.tile_cells, lp.tail_cells, lp.host_cells) == (
        "stream", 1664, 512, 2432, 2048)
    assert lp.device_bytes == 2176 * 256 + 4 * (2176 + 2048) == 573_952
    assert lp.host_bytes == 2048 * CELL == 524_288
  assert rz.layer_layout(rz.cell_sizes(shape(), 1), CTX, 1664 + WINDOW_ALIGN, 512).device_bytes > 600_000
  # Its modeled times are the model's on the same bytes: window + staged remainder on the device.
  lp = p.layers[0]
  bw, bt = (CTX - 2048) * CELL, 2048 * CELL
  assert lp.times["stream"] == pytest.approx(max(bw / 1e12, bt / 50e9))
  assert lp.times["resident"] == pytest.approx(CTX * CELL / 1e12)
  # The CPU partial: q [1,1,4,16] float32 to the host, o + lse [1,1,4,17] float32 back.
  copy = (4 * 16 * 4 + 4 * 17 * 4) / 50e9
  assert lp.times["cpu"] == pytest.approx(max(bw / 1e12, bt / 25e9) + copy)


def test_batch_scales_bytes():
  one = rz.plan(shape(), CTX, 1, residency=cfg(2 * 600_000, mode="stream"))
  two = rz.plan(shape(), CTX, 2, residency=cfg(2 * 2 * 600_000, mode="stream"))
  assert two.layers[0].window_cells == one.layers[0].window_cells
  assert two.device_bytes == 2 * one.device_bytes and two.host_bytes == 2 * one.host_bytes


def test_fits_all_resident():
  need = 2 * CTX * RES_CELL
  for mode in rz.MODES:
    p = rz.plan(shape(), CTX, 1, residency=cfg(need, mode=mode))
    assert p.fits and p.host_bytes == 0 and p.device_bytes == need
    assert p.tactics() == ("resident", "resident")
    for lp in p.layers:
      assert lp.window_cells == CTX and lp.tile_cells is None
      assert lp.times["resident"] == pytest.approx(CTX * CELL / 1e12)
      assert all(lp.times[t] is None for t in rz.TACTICS if t != "resident")


def test_int8_cells_carry_scales(monkeypatch):
  p = rz.plan(shape(kv_dtype="int8"), CTX, 1, residency=cfg(10 * MIB))
  assert p.kv_dtype == "int8"
  # bfloat16 k and v scales per (cell, head), as RollingKV.empty keeps them; float32 where the
  # process asks for float32 scales.
  assert p.layers[0].device_bytes == CTX * (2 * K * D * 1 + 2 * K * 2 + 4)
  monkeypatch.setenv("RKV_INT8_SCALE_DTYPE", "float32")
  p = rz.plan(shape(kv_dtype="int8"), CTX, 1, residency=cfg(10 * MIB))
  assert p.layers[0].device_bytes == CTX * (2 * K * D * 1 + 2 * K * 4 + 4)
  bf16 = rz.plan(shape(), CTX, 1, residency=cfg(10 * MIB, kv_dtype="bfloat16"))
  assert bf16.layers[0].device_bytes == CTX * (2 * K * D * 2 + 4)


def test_iswa_local_layers_stay_resident_as_rings():
  windows = (4096, None) * 3
  ctx = 32768
  ring = 4096 * RES_CELL
  full = ctx * RES_CELL
  budget = 3 * ring + 3 * full // 3  # the rings plus a third of the global layers
  p = rz.plan(shape(windows), ctx, 1, residency=cfg(budget))
  check_invariants(p)
  for lp in p.layers:
    if lp.layer % 2 == 0:
      assert (lp.kind, lp.tactic, lp.capacity, lp.window_cells, lp.host_bytes) == (
          "local", "resident", 4096, 4096, 0)
      assert lp.device_bytes == ring and lp.sliding_window == 4096
    else:
      assert lp.kind == "global" and lp.tactic != "resident" and lp.host_bytes > 0
      assert lp.capacity == ctx
  # A window longer than the context is a ring of the context.
  p = rz.plan(shape((8192, None)), 2048, 1, residency=cfg(10 * MIB))
  assert p.layers[0].capacity == 2048 and p.fits


def test_head_mode_keeps_whole_heads():
  p = rz.plan(shape(), CTX, 1, residency=cfg(2 * 700_000, mode="head"))
  check_invariants(p)
  for lp in p.layers:
    # One of K=2 heads fully resident is 4096 * (128 + 4) = 540,672 bytes; the other head rolls.
    assert lp.tactic == "head" and lp.resident_heads == 1
    assert lp.device_bytes <= 700_000
    assert lp.host_bytes == lp.host_cells * CELL // K


def test_impossible_budget_names_vram_target_mib():
  with pytest.raises(ValueError, match=r"vram_target_mib=0\.01.*bytes.*Raise vram_target_mib "
                                       r"to at least (\d+) MiB") as e:
    rz.plan(shape((4096, None, None)), 65536, 1, residency=cfg(vram_target_mib=0.01))
  need_mib = int(e.value.args[0].split("at least ")[1].split(" MiB")[0])
  p = rz.plan(shape((4096, None, None)), 65536, 1, residency=cfg(vram_target_mib=need_mib))
  check_invariants(p)
  # The rings alone not fitting is the same error.
  with pytest.raises(ValueError, match="vram_target_mib"):
    rz.plan(shape((4096,) * 2), 65536, 1, residency=cfg(4096 * RES_CELL))


def test_resident_mode_that_does_not_fit():
  with pytest.raises(ValueError, match=r"mode='resident' needs 2129920 bytes.*vram_target_mib"):
    rz.plan(shape(), CTX, 1, residency=cfg(1_000_000, mode="resident"))


def test_free_memory_budget():
  stats = dict(bytes_limit=100 * MIB, bytes_in_use=30 * MIB)
  c = ResidencyConfig(vram_target_mib=0, reserve_mib=20, profile=FLAT)
  assert rz.kv_budget_bytes(c, memory_stats=stats) == 50 * MIB
  # Default reserve: derived from the run (tests/device_memory_test.py checks the terms).
  big = dict(bytes_limit=10_000 * MIB, bytes_in_use=0)
  c = ResidencyConfig(profile=FLAT)
  res = rz.resolve_reserve(c, shape(), 1)
  assert rz.kv_budget_bytes(c, memory_stats=big, reserve=res) == 10_000 * MIB - res.total
  p = rz.plan(shape(), CTX, 1, residency=c, memory_stats=big)
  assert p.budget_bytes == 10_000 * MIB - p.reserve_bytes
  assert p.reserve == rz.resolve_reserve(c, shape(), 1, context_len=CTX)
  p = rz.plan(shape(), CTX, 1, residency=ResidencyConfig(reserve_mib=20, profile=FLAT),
              memory_stats=stats)
  assert p.fits and p.budget_bytes == 50 * MIB and p.reserve_bytes == 20 * MIB
  with pytest.raises(ValueError, match="vram_target_mib=0"):
    rz.kv_budget_bytes(ResidencyConfig(reserve_mib=200), memory_stats=stats)
  with pytest.raises(ValueError, match="vram_target_mib.*no memory stats"):
    rz.kv_budget_bytes(ResidencyConfig(), memory_stats={})
  with pytest.raises(ValueError, match="vram_target_mib=0 needs the reserve"):
    rz.kv_budget_bytes(ResidencyConfig(), memory_stats=big)


def test_default_budget_gives_the_worst_case_tile_reserve_back_to_the_window():
  # The first reserve counts tiles of tile_cells; at B=8 the plan streams smaller tiles, so the
  # plan places again with the reserve its own tiles need and the windows grow.
  from rkv.planner import cell_sizes, streamed_tile_bytes
  ctx, b = 65536, 8
  c = cfg(vram_target_mib=0, tile_cells=4096)
  worst = rz.resolve_reserve(c, shape(), b, context_len=ctx)
  for frac in (0.3, 0.9):
    stats = dict(bytes_limit=int(worst.total + frac * 2 * b * ctx * RES_CELL), bytes_in_use=0)
    p = rz.plan(shape(), ctx, b, residency=c, memory_stats=stats)
    at_worst = rz.plan(shape(), ctx, b, memory_stats=stats,
                       residency=cfg(vram_target_mib=0, tile_cells=4096,
                                     reserve_mib=worst.total / MIB))
    check_invariants(p)
    own = rz.resolve_reserve(c, shape(), b, context_len=ctx,
                             tile_bytes=streamed_tile_bytes(p.layers, cell_sizes(shape(), b)))
    assert own.total <= p.reserve_bytes < worst.total
    assert p.budget_bytes == stats["bytes_limit"] - p.reserve_bytes
    assert p.device_bytes <= p.budget_bytes
    assert all(a.window_cells > w.window_cells for a, w in zip(p.layers, at_worst.layers))
    assert p.host_bytes < at_worst.host_bytes


def test_best_layout_with_two_host_tiles_at_least():
  from rkv.planner import best_layout, cell_sizes
  sz, ctx = cell_sizes(shape(), 1), 4096
  per_layer = (ctx - 300) * RES_CELL    # ~300 cells must leave the device: one 384-cell tile
  one = best_layout(sz, ctx, per_layer, cfg())
  two = best_layout(sz, ctx, per_layer, cfg(), min_host_tiles=2)
  assert one.host_cells == one.tile
  assert two.host_cells >= 2 * two.tile and two.tile < one.tile
  assert two.device_bytes <= per_layer and two.window % WINDOW_ALIGN == 0


@pytest.mark.filterwarnings("ignore:plan. the profile")  # H200 figures on a CPU host, on purpose
def test_a_one_tile_tail_is_split_in_two_where_the_hybrid_then_models_faster():
  # Llama-3-8B at B=8 x 128K on 121 GiB free (the H200 row): the fewest-bytes layout holds one
  # 8960-cell tile a layer, which only the cpu tactic can serve; two tiles let the hybrid use PCIe
  # too, modeled 144 vs 182 ms a step (measured 57-59 vs 35-48 tok/s, beyond_hbm/session9/a/).
  import rkv
  mc = rkv.models.ModelConfig.preset("llama3-8b")
  stats = dict(bytes_limit=int(121.08 * 2**30), bytes_in_use=0)
  from rkv.planner import H200_DEFAULT
  h200 = dict(profile=H200_DEFAULT, check_free=False, host_share=False)  # the worker's split
  b8 = rz.plan(mc, 1 << 17, 8, memory_stats=stats, residency=ResidencyConfig(**h200))
  check_invariants(b8)
  assert set(b8.tactics()) == {"hybrid"}
  lp = b8.layers[0]
  assert lp.host_cells // lp.tile_cells == 2 and lp.cpu_fraction == 0.5
  cpu = rz.plan(mc, 1 << 17, 8, memory_stats=stats,
                residency=ResidencyConfig(mode="cpu", **h200))
  assert cpu.layers[0].host_cells == cpu.layers[0].tile_cells  # a forced cpu keeps one tile
  assert b8.step_time_s < cpu.step_time_s
  hyb = rz.plan(mc, 1 << 17, 8, memory_stats=stats,
                residency=ResidencyConfig(mode="hybrid", **h200))
  assert [(lp.tile_cells, lp.host_cells) for lp in hyb.layers] == \
      [(lp.tile_cells, lp.host_cells) for lp in b8.layers]  # a forced hybrid splits it too
  # A tail of several tiles keeps its fewest-bytes layout (1M: three 22144-cell tiles).
  m1 = rz.plan(mc, 1 << 20, 1, memory_stats=stats, residency=ResidencyConfig(**h200))
  assert {(lp.tile_cells, lp.host_cells) for lp in m1.layers} == {(22144, 3 * 22144)}


@pytest.mark.filterwarnings("ignore:plan. the profile")  # H200 figures on a CPU host, on purpose
def test_the_host_share_plans_its_own_fixed_cost(monkeypatch):
  # 128K half-offloaded on the H200 profile: with the Python worker's 2.19 ms a call two of the
  # three tiles stream; a share in the C++ thread pays two small copies (2 x 139 us), and one
  # streams (on an H100 that split ran 9.47 tok/s against 9.15 at the worker's; session 23).
  import rkv
  from rkv.planner import H200_DEFAULT
  mc = rkv.models.ModelConfig.preset("llama3-8b")
  p = H200_DEFAULT.for_host_share()
  assert p.cpu_overhead_us == pytest.approx(2 * H200_DEFAULT.copy_latency_us)
  assert dataclasses.replace(p, cpu_overhead_us=0.0) == dataclasses.replace(
      H200_DEFAULT, cpu_overhead_us=0.0)  # nothing else moves
  low = H200_DEFAULT.replace(cpu_overhead_us=100.0)
  assert low.for_host_share().cpu_overhead_us == 100.0  # never raised
  half = dict(profile=H200_DEFAULT, check_free=False, vram_target_mib=8 * 1024)
  plans = {share: rz.plan(mc, 1 << 17, 1, residency=ResidencyConfig(host_share=share, **half))
           for share in (False, True)}
  for share, plan in plans.items():
    check_invariants(plan)
    assert plan.host_share is share and set(plan.tactics()) == {"hybrid"}
  streamed = {share: {round((1 - lp.cpu_fraction) * lp.host_cells / lp.tile_cells)
                      for lp in plan.layers} for share, plan in plans.items()}
  assert streamed == {False: {2}, True: {1}}
  assert plans[True].step_time_s < plans[False].step_time_s
  assert "planned for the host-share thread" in plans[True].table()
  assert "host-share thread cost" in plans[True].summary()
  assert "host-share thread" not in plans[False].table()
  assert "279 us (estimated), not 2188" in plans[True].table()
  probed = rz.plan(mc, 1 << 17, 1, residency=ResidencyConfig(
      host_share=True, share_overhead_us=500.0, **half)).table()
  assert "500 us (probed), not 2188" in probed
  unfit = dataclasses.replace(H200_DEFAULT, cpu_overhead_us=None)  # a profile without the fit
  assert unfit.for_host_share() == unfit
  table = rz.plan(mc, 1 << 17, 1, residency=ResidencyConfig(
      host_share=True, **dict(half, profile=unfit))).table()
  assert "fixed cost unmeasured" in table
  # None: $RKV_HOST_SHARE=1 set by name, read when the plan is made; unset (the default share
  # on a GPU) plans with the profile's fitted cost.
  monkeypatch.delenv("RKV_HOST_SHARE", raising=False)
  from rkv.offload import host_share
  monkeypatch.setattr(host_share, "default_on", lambda: True)
  assert host_share.share_on()
  assert not rz.plan(mc, 1 << 17, 1, residency=ResidencyConfig(**half)).host_share
  monkeypatch.setenv("RKV_HOST_SHARE", "1")
  assert rz.plan(mc, 1 << 17, 1, residency=ResidencyConfig(**half)).host_share
  monkeypatch.setenv("RKV_HOST_SHARE", "0")
  assert not rz.plan(mc, 1 << 17, 1, residency=ResidencyConfig(**half)).host_share
  with pytest.raises(ValueError, match="host_share"):
    ResidencyConfig(host_share="yes")


def test_host_pool_limit(monkeypatch):
  monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "0.0001")  # ~107 KB
  with pytest.raises(ValueError, match="XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"):
    rz.plan(shape(), CTX, 1, residency=cfg(2 * 600_000))


# ----------------------------------------------------------------------------------------------
# The performance model, by hand
# ----------------------------------------------------------------------------------------------
def test_model_formulas_by_hand():
  bw, bt = 1e9, 2e9
  t = modeled_times(bw, bt, FLAT, head_bytes=(1.5e9, 1.5e9))
  assert t.resident == pytest.approx(3e9 / 1e12)               # (Bw + Bt) / HBM
  assert t.stream == pytest.approx(max(1e-3, 2e9 / 50e9))       # 40 ms
  assert t.cpu == pytest.approx(max(1e-3, 2e9 / 25e9))          # 80 ms
  assert t.hybrid == pytest.approx(2e9 / 75e9)                  # Bt / (PCIe + CPU)
  assert t.hybrid_fraction == pytest.approx(50 / 75)
  assert t.head == pytest.approx(max(1.5e-3, 1.5e9 / 50e9))     # 30 ms
  # Overheads: a fixed cost per device call, a partial copy added to cpu / hybrid.
  p = dataclasses.replace(FLAT, attn_overhead_us=10.0)
  t = modeled_times(bw, bt, p, partial_copy_s=1e-3)
  assert t.stream == pytest.approx(max(10e-6 + 1e-3, 40e-3))
  assert t.cpu == pytest.approx(80e-3 + 1e-3)
  assert t.hybrid == pytest.approx(2e9 / 75e9 + 1e-3)
  # overlap 0: the parts add up.
  t = modeled_times(bw, bt, dataclasses.replace(FLAT, overlap=0.0))
  assert t.stream == pytest.approx(1e-3 + 40e-3)
  # Host read bandwidth caps the CPU and the CPU + DMA sum.
  p = dataclasses.replace(FLAT, host_read_gbps=20.0)
  t = modeled_times(bw, bt, p)
  assert t.cpu == pytest.approx(2e9 / 20e9)
  assert t.hybrid == pytest.approx(2e9 / 20e9)
  # Tile granularity: 4 tiles, f*n = 2.67 -> 3 streamed (30 ms) beats 2 (40 ms on the CPU side).
  t = modeled_times(bw, bt, FLAT, tile_bytes=0.5e9)
  assert t.hybrid == pytest.approx(max(1.5e9 / 50e9, 0.5e9 / 25e9)) and t.hybrid_fraction == 0.75
  # No CPU figure: cpu and hybrid are not modeled.
  t = modeled_times(bw, bt, dataclasses.replace(FLAT, cpu_attn_gbps=None))
  assert t.cpu is None and t.hybrid is None and t.hybrid_fraction is None


def test_fixed_costs_by_hand():
  bw, bt = 1e9, 2e9
  p = dataclasses.replace(FLAT, transfer_overhead_us=100.0, cpu_overhead_us=500.0)
  t = modeled_times(bw, bt, p, partial_copy_s=1e-3, head_bytes=(1.5e9, 1.5e9))
  # One put's fixed cost per streamed call; none without a tail.
  assert t.stream == pytest.approx(100e-6 + 40e-3)
  assert t.head == pytest.approx(100e-6 + 30e-3)
  assert rz.transfer_time(0, p) == 0.0 and rz.stream_time(bw, 0, p) == pytest.approx(1e-3)
  # The measured CPU fixed cost holds the partial copies: partial_copy_s is not added again.
  assert t.cpu == pytest.approx(500e-6 + 80e-3)
  # Hybrid: both sides finish together with their fixed costs, xo + f Bt/P = co + (1-f) Bt/C:
  # f = (80 ms + 0.4 ms) / (40 ms + 80 ms) = 0.67, the tail part xo + f * 40 ms = 26.9 ms.
  assert t.hybrid_fraction == pytest.approx(80.4 / 120)
  assert t.hybrid == pytest.approx(100e-6 + 80.4 / 120 * 40e-3)
  # In whole tiles (4 of 0.5 GB): f n = 2.68 -> 3 streamed: max(0.1 + 30, 0.5 + 20) ms.
  t = modeled_times(bw, bt, p, tile_bytes=0.5e9)
  assert t.hybrid_fraction == 0.75 and t.hybrid == pytest.approx(100e-6 + 30e-3)
  # A large CPU fixed cost moves tiles to the stream: at 30 ms, f = (80 + 29.9) / 120 = 0.916,
  # f n = 3.66: 3 streamed is max(30.1, 30 + 20) = 50 ms, all 4 (the stream tactic) 40.1 ms.
  p2 = dataclasses.replace(p, cpu_overhead_us=30_000.0)
  f, tail_s = rz.hybrid_split(bt, p2, tile_bytes=0.5e9)
  assert f == 1.0 and tail_s == pytest.approx(100e-6 + 40e-3)


def test_contended_rates_by_hand():
  bw, bt = 1e9, 2e9
  # The CPU side at half its solo rate while the DMA runs: f = 50 / (50 + 12.5) = 0.8 and the
  # tail part Bt / 62.5 GB/s = 32 ms (solo rates: f = 2/3, 26.7 ms).
  p = dataclasses.replace(FLAT, hybrid_cpu_gbps=12.5)
  t = modeled_times(bw, bt, p)
  assert t.hybrid_fraction == pytest.approx(0.8) and t.hybrid == pytest.approx(32e-3)
  # In 10 tiles of 0.2 GB the split moves from 7 streamed (solo: max(28, 24) ms) to 8.
  assert modeled_times(bw, bt, FLAT, tile_bytes=0.2e9).hybrid_fraction == pytest.approx(0.7)
  t = modeled_times(bw, bt, p, tile_bytes=0.2e9)
  assert t.hybrid_fraction == pytest.approx(0.8) and t.hybrid == pytest.approx(32e-3)
  # Both sides contended.
  p = dataclasses.replace(FLAT, hybrid_pcie_gbps=40.0, hybrid_cpu_gbps=20.0)
  f, tail_s = rz.hybrid_split(bt, p)
  assert f == pytest.approx(40 / 60) and tail_s == pytest.approx(bt / 60e9)
  # A fixed split: contended rates only while both sides run; all-CPU is the cpu tactic, none the
  # stream tactic.
  assert rz.hybrid_time_at(bw, 0.5e9, 4, 1, p) == pytest.approx(max(1.5e9 / 40e9, 0.5e9 / 20e9))
  assert rz.hybrid_time_at(bw, 0.5e9, 4, 4, p) == pytest.approx(rz.cpu_time(bw, bt, p))
  assert rz.hybrid_time_at(bw, 0.5e9, 4, 4, p) == pytest.approx(2e9 / 25e9)
  assert rz.hybrid_time_at(bw, 0.5e9, 4, 0, p) == pytest.approx(rz.stream_time(bw, bt, p))
  # Measured contended rates already hold the shared host bandwidth: no host-read floor on the
  # sum (the H200 host read 119 GB/s across both sides against a 90.7 GB/s plain-read figure).
  p = dataclasses.replace(p, host_read_gbps=20.0)
  assert rz.hybrid_split(bt, p)[1] == pytest.approx(bt / 60e9)
  # Without them the floor caps the sum.
  p = dataclasses.replace(p, hybrid_pcie_gbps=None, hybrid_cpu_gbps=None)
  assert rz.hybrid_split(bt, p)[1] == pytest.approx(bt / 20e9)


def test_new_figures_fall_back_when_none():
  # None is the old model: no fixed costs, solo rates in the hybrid, the partial copy added.
  bw, bt, copy = 1e9, 2e9, 1e-3
  same = dataclasses.replace(FLAT, transfer_overhead_us=0.0, hybrid_pcie_gbps=50.0,
                             hybrid_cpu_gbps=25.0)
  for tiles in (None, 0.5e9):
    a = modeled_times(bw, bt, FLAT, partial_copy_s=copy, tile_bytes=tiles)
    b = modeled_times(bw, bt, same, partial_copy_s=copy, tile_bytes=tiles)
    assert a == b
  assert FLAT.cpu_overhead_us is None
  assert rz.cpu_time(bw, bt, FLAT, copy) == pytest.approx(80e-3 + copy)
  zero = dataclasses.replace(FLAT, cpu_overhead_us=0.0)  # measured: the copies are inside
  assert rz.cpu_time(bw, bt, zero, copy) == pytest.approx(80e-3)


def test_partial_copy_by_hand():
  p = dataclasses.replace(FLAT, copy_latency_us=5.0)
  got = rz.partial_copy_time(p, batch=2, num_heads=8, head_dim=64, q_itemsize=2)
  q_bytes, out_bytes = 2 * 8 * 64 * 2, 2 * 8 * 65 * 4
  assert got == pytest.approx(10e-6 + q_bytes / 50e9 + out_bytes / 50e9)


@pytest.mark.parametrize("pcie, cpu_gbps, want", [
    (0.5, 50.0, "cpu"),      # slow link: the CPU attends faster than the tail crosses
    (5000.0, 1.0, "stream"),  # fast link: the tail streams under the window compute
    (50.0, 50.0, "hybrid"),  # in between: split the tiles
])
def test_selector_on_synthetic_profiles(pcie, cpu_gbps, want, caplog):
  prof = dataclasses.replace(FLAT, pcie_gbps=pcie, cpu_attn_gbps=cpu_gbps)
  with caplog.at_level(logging.DEBUG, logger="rkv.planner"):  # per-layer lines are DEBUG
    p = rz.plan(shape(), CTX, 1, residency=cfg(2 * 600_000, profile=prof))
  check_invariants(p)
  assert p.tactics() == (want, want)
  lp = p.layers[0]
  assert lp.step_time_s == min(lp.times[t] for t in rz.OFFLOAD_TACTICS if lp.times[t] is not None)
  if want == "hybrid":
    assert 0 < lp.hybrid_fraction < 1
  # The decision is logged with the figures it used.
  text = caplog.text
  assert f"PCIe {pcie:.4g} GB/s" in text and f"CPU attn {cpu_gbps:.4g} GB/s" in text
  assert f"layer 0 -> {want}" in text and f"layer 1 -> {want}" in text


def test_select_ties_prefer_simple_tactics():
  assert rz.select(dict(stream=1.0, head=1.0, cpu=2.0, hybrid=1.0)) == "stream"
  assert rz.select(dict(stream=3.0, head=None, cpu=1.0, hybrid=1.0)) == "cpu"
  with pytest.raises(ValueError, match="no tactic"):
    rz.select(dict(stream=None, head=None, cpu=None, hybrid=None))


def test_forced_modes():
  for mode, tactic in rz.MODE_TACTIC.items():
    p = rz.plan(shape(), CTX, 1, residency=cfg(2 * 600_000, mode=mode))
    assert p.tactics() == (tactic, tactic)
    check_invariants(p)


# ----------------------------------------------------------------------------------------------
# Printing
# ----------------------------------------------------------------------------------------------
def test_table_has_every_layer_and_totals():
  windows = (1024, None) * 4
  p = rz.plan(shape(windows), 16384, 1, residency=cfg(4 * 1024 * RES_CELL + 4 * 1_500_000))
  text = str(p)
  assert text == p.table()
  lines = text.splitlines()
  header = next(i for i, l in enumerate(lines) if l.split()[:3] == ["layer", "kind", "tactic"])
  rows = lines[header + 1:header + 1 + len(windows)]
  assert [int(r.split()[0]) for r in rows] == list(range(len(windows)))
  for lp, row in zip(p.layers, rows):
    assert lp.tactic in row and str(lp.window_cells) in row
    assert f"{lp.device_bytes / MIB:.1f}" in row
    assert f"{lp.step_time_s * 1e6:.1f}*" in row  # the chosen tactic's time is starred
  assert lines[header + 1 + len(windows)].split()[0] == "total"
  assert f"device {p.device_bytes / MIB:.1f} MiB" in text
  assert f"host {p.host_bytes / MIB:.1f} MiB" in text
  assert f"modeled step {p.step_time_s * 1e6:.1f} us" in text
  for t in rz.TACTICS:
    assert f"{t}_us" in text


# ----------------------------------------------------------------------------------------------
# Profiles
# ----------------------------------------------------------------------------------------------
def test_profile_roundtrip_and_overrides(tmp_path):
  path = str(tmp_path / "sub" / "profile.json")
  prof = dataclasses.replace(FLAT, details=dict(note="x", rows=[1.5, 2]))
  prof.save(path)
  loaded = Profile.load(path)
  assert loaded == prof and loaded.details == prof.details and loaded.source == "test"
  assert json.load(open(path))["format"] == "rkv.Profile"
  hash(ResidencyConfig(profile=loaded))  # configs stay hashable (static jit arguments)
  c = ResidencyConfig(profile_path=path, pcie_gbps=7.0, cpu_attn_gbps=3.0, overlap=0.5)
  got = c.resolve_profile()
  assert (got.pcie_gbps, got.cpu_attn_gbps, got.overlap) == (7.0, 3.0, 0.5)
  assert got.hbm_gbps == prof.hbm_gbps and got.d2h_gbps == prof.d2h_gbps
  # A plan uses the overridden figures.
  p = rz.plan(shape(), CTX, 1, residency=cfg(2 * 600_000, profile=None, profile_path=path,
                                             pcie_gbps=7.0))
  assert p.profile.pcie_gbps == 7.0


def test_profile_new_figures_roundtrip_and_old_format(tmp_path):
  prof = dataclasses.replace(FLAT, transfer_overhead_us=700.0, cpu_overhead_us=900.0,
                             hybrid_pcie_gbps=45.0, hybrid_cpu_gbps=20.0)
  path = prof.save(str(tmp_path / "v2.json"))
  doc = json.load(open(path))
  assert doc["version"] == rz.PROFILE_VERSION == 4 and doc["cpu_overhead_us"] == 900.0
  assert Profile.load(path) == prof
  text = prof.describe()
  for piece in ("PCIe 50 GB/s + 700 us/stream", "CPU attn 25 GB/s + 900 us/call",
                "hybrid (contended) PCIe 45 GB/s CPU 20 GB/s"):
    assert piece in text
  # A version-1 profile (written before the new figures) still loads: they are None.
  old = {k: v for k, v in doc.items() if k not in ("transfer_overhead_us", "cpu_overhead_us",
                                                   "hybrid_pcie_gbps", "hybrid_cpu_gbps")}
  old["version"] = 1
  (tmp_path / "v1.json").write_text(json.dumps(old))
  loaded = Profile.load(str(tmp_path / "v1.json"))
  assert loaded == FLAT and loaded.cpu_overhead_us is None and loaded.hybrid_cpu_gbps is None
  assert "us/stream" not in loaded.describe() and "contended" not in loaded.describe()
  (tmp_path / "v9.json").write_text(json.dumps(dict(old, version=9)))
  with pytest.raises(ValueError, match="version"):
    Profile.load(str(tmp_path / "v9.json"))
  # Every figure, the new ones included, is a ResidencyConfig override.
  c = ResidencyConfig(profile=FLAT, transfer_overhead_us=1.0, cpu_overhead_us=2.0,
                      hybrid_pcie_gbps=3.0, hybrid_cpu_gbps=4.0)
  got = c.resolve_profile()
  assert (got.transfer_overhead_us, got.cpu_overhead_us, got.hybrid_pcie_gbps,
          got.hybrid_cpu_gbps) == (1.0, 2.0, 3.0, 4.0)
  assert set(rz.FIGURES) <= {f.name for f in dataclasses.fields(ResidencyConfig)}
  for bad in (dict(cpu_overhead_us=-1.0), dict(hybrid_cpu_gbps=0.0), dict(hybrid_pcie_gbps=-2)):
    with pytest.raises(ValueError, match=next(iter(bad))):
      ResidencyConfig(**bad)
    with pytest.raises(ValueError, match=next(iter(bad))):
      dataclasses.replace(FLAT, **bad)


def test_profile_share_overhead_roundtrip_and_version_3(tmp_path):
  # Version 4's figure: the host share's probed fixed cost, saved and loaded with the rest; a
  # version-3 profile (written before it) loads with None.
  prof = dataclasses.replace(FLAT, cpu_overhead_us=900.0, share_overhead_us=250.0)
  doc = json.loads(json.dumps(prof.to_json()))
  assert doc["version"] == 4 and doc["share_overhead_us"] == 250.0
  assert Profile.from_json(doc) == prof and Profile.from_json(doc).share_overhead_us == 250.0
  assert Profile.load(prof.save(str(tmp_path / "v4.json"))) == prof
  assert "host share 250 us/call" in prof.describe()
  v3 = {k: v for k, v in doc.items() if k != "share_overhead_us"}
  v3["version"] = 3
  old = Profile.from_json(v3)
  assert old.share_overhead_us is None and old == dataclasses.replace(prof, share_overhead_us=None)
  assert "host share" not in old.describe()
  assert FLAT.replace(share_overhead_us=7.0).share_overhead_us == 7.0
  for bad in (-1.0, float("nan"), "250"):
    with pytest.raises(ValueError, match="share_overhead_us"):
      dataclasses.replace(FLAT, share_overhead_us=bad)


@pytest.mark.filterwarnings("ignore:plan. the profile")  # H200 figures on a CPU host, on purpose
def test_the_host_share_plans_with_its_probed_fixed_cost():
  # With share_overhead_us probed, a plan for the share uses it in place of the two-copy
  # estimate, still never above the worker path's fitted cost: at the worker's own 2188 us the
  # 128K half-offloaded split is the worker's (two of three tiles streamed), at the estimate's
  # 279 us one streams.
  import rkv
  from rkv.planner import H200_DEFAULT
  assert H200_DEFAULT.share_overhead_us is None  # not probed: the estimate
  assert H200_DEFAULT.for_host_share().cpu_overhead_us == pytest.approx(
      2 * H200_DEFAULT.copy_latency_us)
  probed = H200_DEFAULT.replace(share_overhead_us=900.0)
  assert probed.for_host_share().cpu_overhead_us == 900.0
  assert probed.for_host_share().share_overhead_us == 900.0  # nothing else moves
  assert H200_DEFAULT.replace(share_overhead_us=0.0).for_host_share().cpu_overhead_us == 0.0
  high = H200_DEFAULT.replace(share_overhead_us=5000.0)
  assert high.for_host_share().cpu_overhead_us == H200_DEFAULT.cpu_overhead_us  # never raised
  unfit = dataclasses.replace(H200_DEFAULT, cpu_overhead_us=None, share_overhead_us=900.0)
  assert unfit.for_host_share() == unfit
  mc = rkv.models.ModelConfig.preset("llama3-8b")
  half = dict(check_free=False, vram_target_mib=8 * 1024, host_share=True)

  def streamed(share_us):
    prof = dataclasses.replace(H200_DEFAULT, share_overhead_us=share_us)
    p = rz.plan(mc, 1 << 17, 1, residency=ResidencyConfig(profile=prof, **half))
    assert p.host_share and set(p.tactics()) == {"hybrid"}
    return {round((1 - lp.cpu_fraction) * lp.host_cells / lp.tile_cells) for lp in p.layers}

  assert streamed(None) == streamed(2 * H200_DEFAULT.copy_latency_us) == {1}
  assert streamed(H200_DEFAULT.cpu_overhead_us) == {2}


def test_profile_int8_cpu_share(tmp_path):
  """An int8 cache's CPU figures: the kernel's cost is per cell, so its bytes/s is a share of
  bf16's (measured, else the fallback); PCIe and HBM figures and other dtypes are untouched."""
  prof = dataclasses.replace(FLAT, hybrid_pcie_gbps=45.0, hybrid_cpu_gbps=20.0, cpu_int8_share=0.4)
  assert Profile.load(prof.save(str(tmp_path / "p.json"))) == prof
  assert "CPU int8 at 0.4 of bf16's bytes/s" in prof.describe()
  i8 = prof.for_kv_dtype("int8")
  assert (i8.cpu_attn_gbps, i8.hybrid_cpu_gbps) == pytest.approx((10.0, 8.0))
  assert (i8.pcie_gbps, i8.hybrid_pcie_gbps, i8.hbm_gbps) == (50.0, 45.0, 1000.0)
  assert prof.for_kv_dtype("bfloat16") is prof and prof.for_kv_dtype(np.float32) is prof
  assert FLAT.for_kv_dtype(np.int8).cpu_attn_gbps == pytest.approx(
      25.0 * INT8_CPU_SHARE_FALLBACK)
  assert dataclasses.replace(FLAT, cpu_attn_gbps=None).for_kv_dtype("int8").cpu_attn_gbps is None
  with pytest.raises(ValueError, match="cpu_int8_share"):
    ResidencyConfig(cpu_int8_share=0.0)
  # The planner models an int8 cache with those figures: a slower CPU takes a smaller share of
  # a hybrid layer's tail. The plan keeps the profile as resolved.
  def hybrid_share(share):
    p = rz.plan(shape(kv_dtype="int8"), CTX, 1, residency=cfg(
        2 * 150_000, mode="hybrid", profile=dataclasses.replace(FLAT, cpu_int8_share=share)))
    assert p.profile.cpu_int8_share == share
    return p.layers[0].cpu_fraction
  assert hybrid_share(0.25) < hybrid_share(1.0)


def test_default_profile(tmp_path, monkeypatch):
  monkeypatch.setenv("HOME", str(tmp_path))
  assert rz.default_profile_path() == str(tmp_path / ".cache" / "rkv" / "profile.json")
  assert ResidencyConfig().resolve_profile() == rz.H200_DEFAULT
  FLAT.save(rz.default_profile_path())
  assert ResidencyConfig().resolve_profile() == FLAT


def test_h200_default_is_the_measured_profile():
  # The built-in figures are the probe's H200 measurements (profile v3), rounded.
  path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results",
                      "profile_h200_v3.json")
  if not os.path.isfile(path):
    pytest.skip(f"{path} not present")
  measured = rz.Profile.load(path)
  d = rz.H200_DEFAULT
  for name in rz.FIGURES:
    if name == "cpu_int8_share":  # newer than profile v3: see test_h200_default_int8_share
      continue
    if name == "share_overhead_us":  # newer than any H200 probe: not measured, not built in
      assert d.share_overhead_us is None
      continue
    want = getattr(measured, name)
    assert want is not None, name
    assert getattr(d, name) == pytest.approx(want, rel=2e-3), name


def test_h200_default_int8_share():
  # Newer than profile v3: the v5 probe's measurement (the kernel alone, int8 over bf16 bytes/s).
  path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results",
                      "profile_h200_v5.json")
  if not os.path.isfile(path):
    pytest.skip(f"{path} not present")
  assert rz.H200_DEFAULT.cpu_int8_share == pytest.approx(rz.Profile.load(path).cpu_int8_share,
                                                         rel=2e-3)


def test_bad_profiles(tmp_path):
  with pytest.raises(ValueError, match="profile_path"):
    Profile.load(str(tmp_path / "missing.json"))
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  with pytest.raises(ValueError, match="not valid JSON"):
    Profile.load(str(bad))
  bad.write_text(json.dumps(dict(format="other")))
  with pytest.raises(ValueError, match="rkv.Profile"):
    Profile.load(str(bad))
  with pytest.raises(ValueError, match="pcie_gbps"):
    Profile(pcie_gbps=0, d2h_gbps=1, hbm_gbps=1)
  with pytest.raises(ValueError, match="overlap"):
    Profile(pcie_gbps=1, d2h_gbps=1, hbm_gbps=1, overlap=2)
  with pytest.raises(ValueError, match="unknown figures"):
    FLAT.replace(pcie=1)


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, name", [
    (dict(mode="stream-ish"), "mode"),
    (dict(vram_target_mib=-1), "vram_target_mib"),
    (dict(vram_target_mib="1"), "vram_target_mib"),
    (dict(reserve_mib=-5), "reserve_mib"),
    (dict(tile_cells=1000), "tile_cells"),
    (dict(tile_cells=256, min_tile_cells=512), "min_tile_cells"),
    (dict(min_window_cells=100), "min_window_cells"),
    (dict(kv_dtype="int4"), "kv_dtype"),
    (dict(pcie_gbps=-1.0), "pcie_gbps"),
    (dict(overlap=1.5), "overlap"),
    (dict(profile="h200"), "profile"),
])
def test_bad_config(kw, name):
  with pytest.raises(ValueError, match=name):
    ResidencyConfig(**kw)


def test_bad_plan_arguments():
  c = cfg(10 * MIB)
  with pytest.raises(ValueError, match="context_len"):
    rz.plan(shape(), 0, 1, residency=c)
  with pytest.raises(ValueError, match="batch"):
    rz.plan(shape(), CTX, -1, residency=c)
  with pytest.raises(ValueError, match="residency"):
    rz.plan(shape(), CTX, 1, residency=dict(mode="auto"))
  with pytest.raises(ValueError, match="num_kv_heads"):
    rz.plan(types.SimpleNamespace(num_layers=2, head_dim=16), CTX, 1, residency=c)
  with pytest.raises(ValueError, match="layer_windows"):
    AttentionShape(num_layers=2, num_kv_heads=2, head_dim=16, layer_windows=(None,))
  with pytest.raises(ValueError, match=r"layer_windows\[1\]"):
    AttentionShape(num_layers=2, num_kv_heads=2, head_dim=16, layer_windows=(None, 0))
  with pytest.raises(ValueError, match="num_heads"):
    AttentionShape(num_layers=1, num_kv_heads=2, head_dim=16, num_heads=3)


def test_any_config_object_or_mapping():
  ns = types.SimpleNamespace(num_layers=2, num_kv_heads=K, head_dim=D, layer_windows=(64, None),
                             dtype="float32", num_heads=4, vocab_size=10)
  a = rz.plan(ns, CTX, 1, residency=cfg(10 * MIB))
  b = rz.plan(dict(num_layers=2, num_kv_heads=K, head_dim=D, layer_windows=[64, None],
                   kv_dtype="float32"), CTX, 1, residency=cfg(10 * MIB))
  assert a.device_bytes == b.device_bytes == (64 + CTX) * RES_CELL
  # No layer_windows: all global (Llama-like).
  llama = types.SimpleNamespace(num_layers=3, num_kv_heads=K, head_dim=D, dtype="float32")
  assert rz.plan(llama, CTX, 1, residency=cfg(10 * MIB)).device_bytes == 3 * CTX * RES_CELL


# ----------------------------------------------------------------------------------------------
# Probe
# ----------------------------------------------------------------------------------------------
def tiny_probe(**kw):
  from rkv import probe
  kw = dict(dict(transfer_mib=(0.25, 1), latency_kib=4, attn_kv_lens=(256, 1024), num_heads=4,
                 num_kv_heads=2, head_dim=16, dtype="float32", cpu=False, warmup=1,
                 repeats=2), **kw)
  return probe.ProbeConfig(**kw)


def test_probe_smoke(tmp_path):
  from rkv import probe
  prof = probe.run_probe(tiny_probe(overrides=dict(cpu_attn_gbps=2.5, host_read_gbps=None)))
  for name in ("pcie_gbps", "d2h_gbps", "hbm_gbps"):
    assert getattr(prof, name) > 0
  assert prof.attn_overhead_us >= 0 and prof.copy_latency_us > 0
  assert prof.cpu_attn_gbps == 2.5 and prof.details["overridden"]["cpu_attn_gbps"]["used"] == 2.5
  assert prof.host_read_gbps is None and "skipped" in prof.details["host_read_gbps"]
  assert prof.share_overhead_us is None and prof.details["host_share"] == "skipped (cpu=False)"
  assert [r["bytes"] for r in prof.details["h2d"]] == [MIB // 4, MIB]
  path = prof.save(str(tmp_path / "profile.json"))
  assert Profile.load(path) == prof and Profile.load(path).details == json.loads(
      json.dumps(prof.details, default=str))
  p = rz.plan(shape(), CTX, 1, residency=cfg(2 * 600_000, profile=None, profile_path=path))
  assert p.profile == prof and len(p.layers) == 2


def test_probe_cpu_module_adapter(monkeypatch):
  from rkv import probe
  monkeypatch.setattr(probe, "CPU_ATTENTION_MODULE", "rkv.offload.no_such_module_for_test")
  out = probe.measure_cpu(tiny_probe(cpu=True))
  assert out["cpu_attn_gbps"] is None and "not available" in out["details"]["cpu_attn_gbps"]
  # A module with the documented functions: bytes/s back, only the named arguments passed.
  seen = {}
  fake = types.ModuleType("fake_cpu_attention")

  def measure_cpu_attention(kv_len, *, num_kv_heads, head_dim, group, tile_cells, repeats,
                            dtype="float32"):
    if dtype == "int8":  # the same cells in int8: the share of the float rate
      return 1.2e9
    seen.update(kv_len=kv_len, group=group, tile_cells=tile_cells)
    return 3.0e9

  def measure_host_read_bandwidth(nbytes, *, repeats):
    seen.update(nbytes=nbytes)
    return dict(bytes_per_s=12.0e9)

  fake.measure_cpu_attention = measure_cpu_attention
  fake.measure_host_read_bandwidth = measure_host_read_bandwidth
  monkeypatch.setitem(sys.modules, "fake_cpu_attention", fake)
  monkeypatch.setattr(probe, "CPU_ATTENTION_MODULE", "fake_cpu_attention")
  out = probe.measure_cpu(tiny_probe(cpu=True, cpu_kv_len=1000, host_read_mib=1))
  assert out["cpu_attn_gbps"] == pytest.approx(3.0) and out["host_read_gbps"] == pytest.approx(12.0)
  assert out["cpu_int8_share"] == pytest.approx(0.4)
  assert seen == dict(kv_len=1000, group=2, tile_cells=1000, nbytes=MIB)
  # A failing measurement records its reason and keeps the other figure.
  def boom(**kw):
    raise RuntimeError("no compiler")
  fake.measure_cpu_attention = boom
  out = probe.measure_cpu(tiny_probe(cpu=True))
  assert out["cpu_attn_gbps"] is None and "no compiler" in out["details"]["cpu_attn_gbps"]
  assert out["host_read_gbps"] == pytest.approx(12.0)


def test_fit_line():
  from rkv import probe
  assert probe.fit_line([1.0, 3.0], [12.0, 16.0]) == pytest.approx((10.0, 2.0))
  assert probe.fit_line([4.0], [2.0]) == pytest.approx((0.0, 0.5))


def test_fit_cost():
  from rkv import probe
  # 1 ms + bytes / 50 GB/s, exactly.
  xs = [1e8, 4e8, 8e8]
  overhead, rate, how = probe.fit_cost(xs, [1e-3 + x / 50e9 for x in xs])
  assert (overhead, rate, how) == (pytest.approx(1e-3), pytest.approx(50e9), "fit")
  # Noise at small sizes: a negative intercept -> the line through the origin, no overhead.
  overhead, rate, how = probe.fit_cost([1.0, 2.0], [0.5, 2.0])
  assert how == "origin" and overhead == 0.0 and rate == pytest.approx(5 / 4.5)
  # No positive slope -> the largest point's rate.
  overhead, rate, how = probe.fit_cost([1.0, 2.0], [2.0, 1.0])
  assert how == "largest" and overhead == 0.0 and rate == pytest.approx(2.0)


NEW_FIGURES = ("transfer_overhead_us", "cpu_overhead_us", "hybrid_pcie_gbps", "hybrid_cpu_gbps")


def test_probe_tail_paths_smoke():
  # The cpu tactic's path over a real pinned_host tail and the contention step, at tiny sizes on
  # CPU: every figure is measured (finite; rates positive, fixed costs >= 0), timing is not tested.
  from rkv import probe
  from rkv.offload import cpu_attention as cpu_lib
  prof = probe.run_probe(tiny_probe(cpu=True, cpu_kv_len=1024, cpu_tile_cells=1024,
                                    tail_tiles=(1, 4), contention_tiles=4, host_read_mib=1))
  for name in ("pcie_gbps", "cpu_attn_gbps", "hybrid_pcie_gbps", "hybrid_cpu_gbps"):
    val = getattr(prof, name)
    assert val is not None and math.isfinite(val) and val > 0, name
  for name in ("transfer_overhead_us", "cpu_overhead_us"):
    val = getattr(prof, name)
    assert val is not None and math.isfinite(val) and val >= 0, name
  d = prof.details
  assert d["tail"]["cpu_threads"] == cpu_lib.tail_threads()
  assert d["tail"]["tile_bytes"] == 1024 * 2 * K * D * 4
  rows = d["cpu_tail"]["rows"]
  assert [r["tiles"] for r in rows] == [1, 4] and all(r["tactic_modeled_s"] > 0 for r in rows)
  con = d["contention"]
  assert con["tiles"] == 4 and 1 <= con["cpu_tiles"] <= 3
  for key in ("stream_s", "cpu_s", "stream_alone_s", "cpu_alone_s", "hybrid_step_s",
              "hybrid_modeled_s"):
    assert con[key] > 0, key
  assert "hybrid," in probe.format_checks(prof) and "cpu tactic" in probe.format_checks(prof)
  # The host share over the same tail sizes (where it can run here), its line through the rows.
  from rkv.offload import host_share
  ok, why = host_share.share_available()
  share = d["host_share"]
  if not ok:
    assert prof.share_overhead_us is None and why in share
  else:
    assert [r["tiles"] for r in share["rows"]] == [1, 4]
    assert [r["bytes"] for r in share["rows"]] == [1024 * 2 * K * D * 4 * m for m in (1, 4)]
    assert all(r["call_s"] > 0 for r in share["rows"])
    calls = 2 * (1 + 2)  # two sizes, each warmed up once and timed twice (tiny_probe)
    assert share["counters"] == dict(starts=calls, waits=calls, runs=calls, last_rc=0)
    assert prof.share_overhead_us == share["share_overhead_us"] >= 0
    assert share["share_cpu_gbps"] > 0 and math.isfinite(share["share_cpu_gbps"])
    if share["fit"] == "fit":  # else a noisy line fell back to no fixed cost (fit_cost)
      # A call pays its programs' dispatch and the worker's wake whatever the bytes.
      assert 0 < share["share_overhead_us"] * 1e-6 < min(r["call_s"] for r in share["rows"])
    else:
      assert share["fit"] in ("origin", "largest") and share["share_overhead_us"] == 0
    assert "host share, 1/4 tiles: call" in probe.format_checks(prof)
  # Saved and loaded whole; overrides win over the measured figures.
  assert Profile.from_json(json.loads(json.dumps(prof.to_json(), default=str))) == prof
  forced = probe.run_probe(tiny_probe(cpu=True, cpu_kv_len=1024, cpu_tile_cells=1024,
                                      tail_tiles=(1, 2), contention_tiles=0, host_read_mib=1,
                                      cpu_threads=1, host_share=False,
                                      overrides=dict(cpu_overhead_us=123.0, hybrid_cpu_gbps=7.0,
                                                     share_overhead_us=45.0)))
  assert forced.cpu_overhead_us == 123.0 and forced.hybrid_cpu_gbps == 7.0
  assert forced.share_overhead_us == 45.0
  assert forced.details["overridden"]["share_overhead_us"] == dict(measured=None, used=45.0)
  assert forced.details["host_share"] == "skipped (host_share=False)"
  assert forced.details["overridden"]["cpu_overhead_us"]["used"] == 123.0
  assert forced.hybrid_pcie_gbps is None and "skipped" in forced.details["contention"]
  assert forced.details["tail"]["cpu_threads"] == 1


def test_probe_without_the_host_share_keeps_every_other_figure(monkeypatch):
  # No C++ compiler for the share (or a share that fails to run): the probe completes, the
  # share's figure is None with the reason, and the cpu tactic's figures are still measured.
  from rkv import probe
  from rkv.offload import host_share
  small = dict(cpu=True, cpu_kv_len=1024, cpu_tile_cells=1024, tail_tiles=(1, 2),
               contention_tiles=0, host_read_mib=1, cpu_threads=1)
  monkeypatch.setattr(host_share, "share_available", lambda: (False, "no compiler"))
  prof = probe.run_probe(tiny_probe(**small))
  assert prof.share_overhead_us is None
  assert prof.details["host_share"] == "host share not available: no compiler"
  assert prof.cpu_attn_gbps > 0 and prof.cpu_overhead_us is not None
  assert [r["tiles"] for r in prof.details["cpu_tail"]["rows"]] == [1, 2]
  assert "host share: not measured (host share not available: no compiler)" in \
      probe.format_checks(prof)
  assert Profile.from_json(json.loads(json.dumps(prof.to_json(), default=str))) == prof
  # Available, but the share fails where it is built or run: recorded the same way.
  monkeypatch.setattr(host_share, "share_available", lambda: (True, ""))

  def broken(*args, **kw):
    raise RuntimeError("the share's library did not load")

  monkeypatch.setattr(host_share, "HostShare", broken)
  prof = probe.run_probe(tiny_probe(**small))
  assert prof.share_overhead_us is None and prof.cpu_attn_gbps > 0
  assert prof.details["host_share"] == ("host share failed: RuntimeError: the share's library "
                                        "did not load")


def test_probe_config_checks():
  for kw, name in ((dict(tail_tiles=(4, 4)), "tail_tiles"), (dict(contention_tiles=1),
                   "contention_tiles"), (dict(cpu_threads=0), "cpu_threads"),
                   (dict(overrides=dict(pcie=1.0)), "overrides"),
                   (dict(host_share="yes"), "host_share")):
    with pytest.raises(ValueError, match=name):
      tiny_probe(**kw)


def test_probe_script_flags(tmp_path):
  # experiments/probe.py end to end at tiny sizes: a flag per figure overrides it, the new sizes
  # reach the probe.
  out = tmp_path / "profile.json"
  cmd = [sys.executable, "-m", "experiments.probe", "--transfer_mib=0.25,1",
         "--attn_kv_lens=256,1024", "--num_heads=4", "--num_kv_heads=2", "--head_dim=16",
         "--dtype=float32", "--cpu_kv_len=512", "--cpu_tile_cells=512", "--tail_tiles=1,3",
         "--contention_tiles=3", "--cpu_threads=1", "--host_read_mib=1", "--warmup=1",
         "--repeats=2", "--transfer_overhead_us=11", "--hybrid_pcie_gbps=12", f"--out={out}"]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
  run = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]
  prof = Profile.load(str(out))
  assert prof.transfer_overhead_us == 11.0 and prof.hybrid_pcie_gbps == 12.0
  assert prof.cpu_overhead_us is not None and prof.hybrid_cpu_gbps is not None
  cfg = prof.details["config"]
  assert cfg["tail_tiles"] == [1, 3] and cfg["contention_tiles"] == 3 and cfg["cpu_threads"] == 1
  assert "hybrid, " in run.stdout and "wrote" in run.stdout


def test_the_stream_mode_is_named_like_its_tactic_and_window_is_its_deprecated_alias():
  assert "stream" in rz.MODES and "window" not in rz.MODES
  with pytest.warns(DeprecationWarning, match="'window' is deprecated, use 'stream'"):
    old = ResidencyConfig(mode="window", vram_target_mib=2 * 600_000 / MIB)
  assert old.mode == "stream"
  new = ResidencyConfig(mode="stream", vram_target_mib=2 * 600_000 / MIB)
  assert rz.plan(shape(), CTX, 1, residency=old).tactics() == \
      rz.plan(shape(), CTX, 1, residency=new).tactics() == ("stream", "stream")


def test_one_tactic_vocabulary_is_shared():
  from rkv import gates, generate, rolling, tactics
  from rkv.models import kv
  assert rz.TACTICS == tactics.TACTICS == generate.SUPPORTED_TACTICS
  assert gates.GATE_TACTICS == generate.FORCED_TACTICS == tactics.OFFLOADED
  assert rolling.TACTICS == ("auto",) + tactics.OFFLOADED
  assert kv.ROLLING_TACTICS == tactics.ROLLING == ("stream", "cpu", "hybrid")
  assert set(rz.OFFLOAD_TACTICS) == set(tactics.OFFLOADED)
  assert set(rz.MODE_TACTIC.values()) == set(tactics.OFFLOADED)
  from rkv import cli
  assert set(cli._MODES) == set(tactics.MODES) | set(tactics.DEPRECATED_MODES)
  assert {t: tactics.spec(t).cache for t in tactics.TACTICS} == {
      "resident": "resident", "stream": "rolling", "cpu": "rolling", "hybrid": "rolling",
      "head": "head_split"}
  with pytest.raises(ValueError, match="unknown tactic"):
    tactics.spec("window")


def test_the_plan_stores_the_hybrid_split_as_the_cpu_share_it_is_used_as():
  p = rz.plan(shape(), CTX, 1, residency=cfg(2 * 600_000, mode="hybrid"))
  for lp in p.layers:
    assert lp.cpu_fraction is not None and 0 < lp.cpu_fraction < 1
    assert lp.hybrid_fraction == pytest.approx(1 - lp.cpu_fraction)  # the old, streamed name
  assert "cpu_f" in p.table()


def test_planner_without_the_cpu_kernel_leaves_cpu_and_hybrid_out(monkeypatch):
  # Before: with no compiler the planner still chose cpu/hybrid and the run failed after the
  # plan printed. The profile of the synthetic selector test that picks "cpu".
  from rkv.offload import cpu_build
  monkeypatch.setattr(cpu_build, "kernel_available", lambda: (False, "no C compiler found"))
  prof = dataclasses.replace(FLAT, pcie_gbps=0.5, cpu_attn_gbps=50.0)
  with pytest.warns(UserWarning, match="CPU-tail kernel is not available.*cpu and hybrid"):
    p = rz.plan(shape(), CTX, 1, residency=cfg(2 * 600_000, profile=prof))
  assert p.tactics() == ("stream", "stream")
  for mode in ("cpu", "hybrid"):
    with pytest.raises(ValueError, match=f"mode='{mode}' needs the CPU-tail kernel.*no C compiler"):
      rz.plan(shape(), CTX, 1, residency=cfg(2 * 600_000, profile=prof, mode=mode))
  # A plan for another machine does not ask this one.
  p = rz.plan(shape(), CTX, 1, residency=cfg(2 * 600_000, profile=prof, check_free=False))
  assert p.tactics() == ("cpu", "cpu")
