"""Device memory: rkv's XLA memory fraction, the pool report, the derived reserve and the
planner's refusals of plans that cannot fit (fast, CPU; fake memory_stats dicts stand in for the
GPU's).

The figures mimic the H200: 139.8 GiB physical (cuDeviceTotalMem), a pool of 105 GiB at JAX's
default fraction 0.75 and 137 GiB at rkv's 0.98.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import types

import pytest

import rkv
from rkv import _env
from rkv import residency as rz
from rkv.offload import memory
from rkv.residency import MIB, AttentionShape, Profile, ResidencyConfig

GIB = 1 << 30
H200_PHYSICAL = 150_109_880_320           # cuDeviceTotalMem on the H200
H200_DEFAULT_LIMIT = 112_583_507_968      # bytes_limit at the default 0.75
H200_RKV_LIMIT = 147_108_921_344          # bytes_limit at 0.98

FLAT = Profile(pcie_gbps=50.0, d2h_gbps=50.0, hbm_gbps=1000.0, cpu_attn_gbps=25.0, source="test")
K, D = 2, 16
CELL = 2 * K * D * 4  # float32 K+V bytes of one cell of one layer
CTX = 4096


def shape(windows=(None, None), num_heads=4, kv_dtype="float32"):
  return AttentionShape(num_layers=len(windows), num_kv_heads=K, head_dim=D,
                        layer_windows=tuple(windows), num_heads=num_heads, kv_dtype=kv_dtype)


def cfg(**kw):
  kw.setdefault("profile", FLAT)
  kw.setdefault("tile_cells", 512)
  kw.setdefault("min_tile_cells", 128)
  return ResidencyConfig(**kw)


def stats(limit, in_use=0):
  return dict(bytes_limit=int(limit), bytes_in_use=int(in_use))


LLAMA3_8B = AttentionShape(num_layers=32, num_kv_heads=8, head_dim=128, num_heads=32,
                           kv_dtype="bfloat16")
LLAMA3_8B_SIZES = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336)


@pytest.fixture
def source(monkeypatch):
  """Restores rkv._env.fraction_source after a test that sets it."""
  monkeypatch.setattr(_env, "fraction_source", _env.fraction_source)
  monkeypatch.setattr(memory, "_warned", set())
  return monkeypatch


# ----------------------------------------------------------------------------------------------
# The fraction rkv sets at import
# ----------------------------------------------------------------------------------------------
def _fake_jax(initialized: bool, with_function: bool = True):
  xb = types.ModuleType("jax._src.xla_bridge")
  if with_function:
    xb.backends_are_initialized = lambda: initialized
  else:
    xb._backends = {"gpu": object()} if initialized else {}
  return {"jax": types.ModuleType("jax"), "jax._src.xla_bridge": xb}


def test_sets_the_fraction_when_jax_has_not_started(source):
  env = {}
  assert _env.set_default_mem_fraction(env, modules={}) == _env.FRACTION_RKV
  assert env == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.98"}
  assert _env.fraction_source == memory.fraction_source() == "set by rkv"
  # jax imported but no backend created yet: the variable still takes effect.
  for fn in (True, False):
    env = {}
    assert _env.set_default_mem_fraction(env, _fake_jax(False, fn)) == _env.FRACTION_RKV
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.98"
  assert memory.DEFAULT_DEVICE_MEM_FRACTION == _env.DEFAULT_DEVICE_MEM_FRACTION == 0.98


def test_leaves_a_users_fraction_alone(source):
  env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".75"}
  assert _env.set_default_mem_fraction(env, modules={}) == _env.FRACTION_USER
  assert env == {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".75"}
  # The newer name: setting the old one beside it would make the GPU client raise.
  env = {"XLA_CLIENT_MEM_FRACTION": ".9"}
  assert _env.set_default_mem_fraction(env, modules={}) == _env.FRACTION_USER
  assert env == {"XLA_CLIENT_MEM_FRACTION": ".9"}
  # A user's value wins even when jax is up (it may have been set before jax started).
  env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"}
  assert _env.set_default_mem_fraction(env, _fake_jax(True)) == _env.FRACTION_USER
  assert memory.fraction_source() == "set by the user"


def test_too_late_once_a_backend_exists(source):
  for fn in (True, False):
    env = {}
    assert _env.set_default_mem_fraction(env, _fake_jax(True, fn)) == _env.FRACTION_TOO_LATE
    assert env == {}  # setting it would be ignored and would mislead a later reader
  assert memory.fraction_source() == "too late"
  assert not _env.backends_initialized({})
  assert _env.backends_initialized(_fake_jax(True))


def test_import_rkv_sets_it_before_jax_starts():
  # One fresh interpreter: the real import order (the helper ran with jax not yet imported).
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION")}
  env["JAX_PLATFORMS"] = "cpu"
  code = ("import os, sys; import rkv; from rkv.offload import memory; "
          "print(os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION'), '|', memory.fraction_source())")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120, cwd=os.path.dirname(os.path.dirname(rkv.__file__)))
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip().splitlines()[-1] == "0.98 | set by rkv"


def test_this_process_recorded_what_happened():
  assert memory.fraction_source() in (_env.FRACTION_RKV, _env.FRACTION_USER,
                                      _env.FRACTION_TOO_LATE)
  if memory.fraction_source() == _env.FRACTION_RKV:
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.98"


# ----------------------------------------------------------------------------------------------
# device_memory and check_memory_fraction
# ----------------------------------------------------------------------------------------------
def test_device_memory_from_stats():
  m = memory.device_memory(memory_stats=stats(100 * GIB, 30 * GIB), physical_bytes=200 * GIB)
  assert (m.bytes_limit, m.bytes_in_use, m.free) == (100 * GIB, 30 * GIB, 70 * GIB)
  assert m.limit_share == 0.5 and m.low
  text = m.describe()
  assert "bytes_limit 100.0 GiB (50% of 200.0 GiB physical)" in text
  assert "free 70.0 GiB" in text and "XLA_PYTHON_CLIENT_MEM_FRACTION" in text
  assert m.fraction_source == memory.fraction_source()
  # Unknown physical size: no share, not "low".
  m = memory.device_memory(memory_stats=stats(100 * GIB), physical_bytes=0)
  assert m.bytes_in_use == 0 and m.limit_share is None and not m.low


on_cpu = pytest.mark.skipif(memory.default_device().platform != "cpu",
                            reason="checks the CPU backend's missing memory stats")


@on_cpu
def test_device_memory_on_cpu_has_no_stats(source):
  m = memory.device_memory()
  assert m.bytes_limit is None and m.bytes_in_use is None and m.free is None
  assert m.physical_bytes is None and not m.low
  assert "no memory stats" in m.describe()
  assert memory.check_memory_fraction("test") is None
  assert memory.physical_device_bytes() is None  # not a GPU: the driver is not asked


class FakeGpu:
  """A device whose memory_stats() is the H200's at a given pool (monkeypatched stats)."""
  platform, device_kind, id, local_hardware_id = "gpu", "NVIDIA H200", 0, 0

  def __init__(self, limit, in_use=0):
    self._stats = stats(limit, in_use)

  def memory_stats(self):
    return dict(self._stats, num_allocs=0, peak_bytes_in_use=0)


def test_check_memory_fraction_warns_on_jax_default_pool(source, caplog):
  source.setattr(memory, "_cuda_total_bytes", lambda ordinal: H200_PHYSICAL)
  source.setattr(_env, "fraction_source", _env.FRACTION_TOO_LATE)
  source.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  dev = FakeGpu(H200_DEFAULT_LIMIT)
  assert memory.physical_device_bytes(dev) == H200_PHYSICAL
  with caplog.at_level(logging.INFO, logger="rkv.offload.memory"):
    msg = memory.check_memory_fraction("plan", device=dev)
    again = memory.check_memory_fraction("plan", device=dev)
  assert msg == again and msg.startswith("plan: ")
  assert 'jax.devices()[0].memory_stats()["bytes_limit"] is 104.9 GiB' in msg
  assert "75% of the device's 139.8 GiB" in msg
  assert ("no XLA_PYTHON_CLIENT_MEM_FRACTION (JAX's default 0.75): rkv was imported after JAX "
          "had started, too late to set it") in msg
  assert "Set XLA_PYTHON_CLIENT_MEM_FRACTION=0.98 in the environment before JAX starts" in msg
  warned = [r for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warned) == 1 and warned[0].getMessage() == msg  # once per message
  # rkv's 0.98 (98% of the device) and a user's 0.95 are fine.
  assert memory.check_memory_fraction("plan", device=FakeGpu(H200_RKV_LIMIT)) is None
  assert memory.check_memory_fraction("plan", device=FakeGpu(0.95 * H200_PHYSICAL)) is None
  # Physical memory unknown: the comparison is skipped.
  source.setattr(memory, "_cuda_total_bytes", lambda ordinal: None)
  assert memory.check_memory_fraction("plan", device=FakeGpu(H200_DEFAULT_LIMIT)) is None


def test_a_users_own_low_fraction_is_logged_at_info(source, caplog):
  source.setattr(_env, "fraction_source", _env.FRACTION_USER)
  source.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".75")
  with caplog.at_level(logging.INFO, logger="rkv.offload.memory"):
    msg = memory.check_memory_fraction("plan", memory_stats=stats(H200_DEFAULT_LIMIT),
                                       physical_bytes=H200_PHYSICAL)
  assert "XLA_PYTHON_CLIENT_MEM_FRACTION=.75: set by the user" in msg
  assert [r.levelno for r in caplog.records if r.getMessage() == msg] == [logging.INFO]


# ----------------------------------------------------------------------------------------------
# The derived reserve
# ----------------------------------------------------------------------------------------------
def test_reserve_terms_by_hand_llama3_8b():
  # The default (no prefetcher): the eager stream schedule's lookahead + 1 tiles of a layer.
  d = rz.derive_reserve(LLAMA3_8B, 1, tile_cells=32768, **LLAMA3_8B_SIZES)
  assert rz.DEFAULT_PREFETCH_TILES == 0
  assert d.bytes_of("tiles") == (rkv.offload.stream.DEFAULT_LOOKAHEAD + 1) * 128 * MIB
  assert "tiles 640.0 MiB [5 (lookahead + 1) x 32768 cells x B=1 x K=8]" in d.describe()
  r = rz.derive_reserve(LLAMA3_8B, 1, tile_cells=32768, prefetch_tiles=8, **LLAMA3_8B_SIZES)
  assert [n for n, _, _ in r.terms] == ["tiles", "decode", "prefill", "logits", "workspace"]
  # 8 prefetched tiles of 32768 cells x 8 heads x (K+V) x 128 x 2 bytes = 8 x 128 MiB.
  assert r.bytes_of("tiles") == 8 * 32768 * 8 * 2 * 128 * 2 == 1024 * MIB
  # B x K x 64 splits x max(16, G=4) rows x (D + 2) x 4 bytes x 4 layers in flight.
  assert r.bytes_of("decode") == 1 * 8 * 64 * 16 * 130 * 4 * 4
  # 512 tokens x (4096 + 2 x 14336 + (32 + 16) x 128) x 4 bytes x 2.
  assert r.bytes_of("prefill") == 512 * (4096 + 28672 + 6144) * 4 * 2
  assert r.bytes_of("logits") == 128256 * 4 * 2
  assert r.bytes_of("workspace") == 256 * MIB
  assert r.total == sum(b for _, b, _ in r.terms)
  # With 8 prefetched tiles: leaner than the old flat default (2048 MiB plus two tiles), ~1.4 GiB.
  assert 1400 * MIB < r.total < 2048 * MIB + 2 * 128 * MIB
  text = r.describe()
  for name in ("tiles 1024.0 MiB [8 x 32768 cells x B=1 x K=8]", "decode", "prefill",
               "logits", "workspace 256.0 MiB"):
    assert name in text


def test_reserve_counts_the_next_layers_tiles_with_next_puts(monkeypatch):
  # $RKV_NEXT_PUTS=1 (layered_forward puts the next layer's first tiles while a layer waits): up
  # to lookahead of them sit beside the attending layer's lookahead + 1; not with a prefetcher
  # (layered_forward then has no next puts).
  la = rkv.offload.stream.DEFAULT_LOOKAHEAD
  off = rz.derive_reserve(LLAMA3_8B, 1, tile_cells=32768, **LLAMA3_8B_SIZES)
  on = rz.derive_reserve(LLAMA3_8B, 1, tile_cells=32768, next_puts=True, **LLAMA3_8B_SIZES)
  assert on.bytes_of("tiles") == (2 * la + 1) * 128 * MIB
  assert off.bytes_of("tiles") == (la + 1) * 128 * MIB
  assert "9 (lookahead + 1 + lookahead of the next layer's) x 32768 cells" in on.describe()
  monkeypatch.setenv("RKV_NEXT_PUTS", "1")  # the default follows the switch
  assert rz.derive_reserve(LLAMA3_8B, 1, tile_cells=32768,
                           **LLAMA3_8B_SIZES).bytes_of("tiles") == on.bytes_of("tiles")
  pf = rz.derive_reserve(LLAMA3_8B, 1, tile_cells=32768, prefetch_tiles=8, **LLAMA3_8B_SIZES)
  assert pf.bytes_of("tiles") == 8 * 128 * MIB


def test_reserve_scales_with_batch_and_falls_back_without_model_sizes():
  one = rz.derive_reserve(LLAMA3_8B, 1, tile_cells=32768, prefetch_tiles=8, **LLAMA3_8B_SIZES)
  four = rz.derive_reserve(LLAMA3_8B, 4, tile_cells=32768, prefetch_tiles=8, **LLAMA3_8B_SIZES)
  for name in ("decode", "prefill", "logits"):
    assert four.bytes_of(name) == 4 * one.bytes_of(name)
  assert four.bytes_of("workspace") == one.bytes_of("workspace")
  # Tiles in flight are capped by bytes like the Prefetcher's room: at B=4 a 32K-cell tile is
  # 512 MiB, so 2 of them (1 GiB), not 8.
  assert one.bytes_of("tiles") == 8 * 128 * MIB
  assert four.bytes_of("tiles") == 2 * 512 * MIB == rkv.offload.stream.DEFAULT_PREFETCH_BYTES
  assert "at most 1024 MiB" in four.describe()
  bare = rz.derive_reserve(LLAMA3_8B, 1, tile_cells=32768)
  assert bare.bytes_of("prefill") == rz.PREFILL_FLAT_MIB * MIB
  assert bare.bytes_of("logits") == rz.DEFAULT_RESERVE_VOCAB * 4 * 2
  assert "flat" in bare.describe() and "(default)" in bare.describe()
  # prefetch_tiles and chunk_tokens are the knobs; int8 tiles carry their scales.
  r = rz.derive_reserve(LLAMA3_8B, 1, tile_cells=32768, prefetch_tiles=2, chunk_tokens=1024,
                        **LLAMA3_8B_SIZES)
  assert r.bytes_of("tiles") == one.bytes_of("tiles") // 4
  assert r.bytes_of("prefill") == 2 * one.bytes_of("prefill")
  q = rz.derive_reserve(dataclasses.replace(LLAMA3_8B, kv_dtype="int8"), 1, tile_cells=32768,
                        prefetch_tiles=8)
  assert q.bytes_of("tiles") == 8 * 32768 * 8 * (2 * 128 + 2 * 2)  # bfloat16 scales
  assert rz.derive_reserve(LLAMA3_8B, 1, tile_cells=32768, tile_bytes=0).bytes_of("tiles") == 0


def test_reserve_defaults_match_the_decode_loop():
  from rkv import generate
  assert rz.DEFAULT_CHUNK_TOKENS == generate.DEFAULT_CHUNK
  c = ResidencyConfig()
  assert (c.prefetch_tiles, c.chunk_tokens, c.reserve_mib, c.check_free) == (0, 512, None, True)
  for kw, name in ((dict(prefetch_tiles=-1), "prefetch_tiles"), (dict(chunk_tokens=0),
                   "chunk_tokens"), (dict(check_free="yes"), "check_free")):
    with pytest.raises(ValueError, match=name):
      ResidencyConfig(**kw)


def test_plan_derives_the_reserve_from_the_model_config(caplog):
  from rkv.models import ModelConfig
  mc = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=K, head_dim=D, layer_windows=(None, None),
                   dtype="float32")
  free = 2 * GIB
  with caplog.at_level(logging.DEBUG, logger="rkv.planner"):  # the reserve's line is DEBUG
    p = rz.plan(mc, CTX, 2, residency=cfg(), memory_stats=stats(free + MIB, MIB))
  r = p.reserve
  # The config's tile_cells, B=2, lookahead + 1 of them (the eager schedule; no prefetcher).
  assert r.bytes_of("tiles") == (rkv.offload.stream.DEFAULT_LOOKAHEAD + 1) * 2 * 512 * CELL
  assert r.bytes_of("prefill") == 2 * 512 * (64 + 2 * 128 + (4 + 2 * K) * D) * 4 * 2
  assert r.bytes_of("logits") == 2 * 1000 * 4 * 2
  assert p.budget_bytes == free - p.reserve_bytes and p.free_bytes == free
  assert "free device memory minus the reserve" in p.budget_source
  # The log and the table say how the reserve was made, term by term.
  line = next(m for m in caplog.messages if "reserve" in m and "free" in m)
  assert all(t in line for t in ("tiles", "decode", "prefill", "logits", "workspace"))
  table = p.table()
  assert f"reserve {p.reserve_bytes / MIB:.1f} MiB (tiles" in table
  assert f"device free {free / MIB:.1f} MiB" in table
  # An explicit reserve_mib is one term and overrides the derivation.
  p = rz.plan(mc, CTX, 2, residency=cfg(reserve_mib=3), memory_stats=stats(free))
  assert p.reserve.terms == (("reserve_mib", 3 * MIB, "reserve_mib=3"),)
  assert p.budget_bytes == free - 3 * MIB


def test_explicit_target_reserve_counts_the_plans_streamed_tiles():
  # All resident: nothing streams, so no tiles in flight.
  p = rz.plan(shape(), CTX, 1, residency=cfg(vram_target_mib=10), memory_stats=stats(GIB))
  assert p.fits and p.reserve.bytes_of("tiles") == 0 and "nothing streams" in p.reserve.describe()
  # Streamed: the eager schedule's lookahead + 1 tiles of the plan's tile (no prefetcher).
  p = rz.plan(shape(), CTX, 1, residency=cfg(vram_target_mib=1.2e6 / MIB, mode="stream"),
              memory_stats=stats(GIB))
  tile = p.layers[0].tile_cells
  assert not p.fits and p.reserve.bytes_of("tiles") == (
      rkv.offload.stream.DEFAULT_LOOKAHEAD + 1) * tile * CELL


# ----------------------------------------------------------------------------------------------
# Refusals before anything is allocated
# ----------------------------------------------------------------------------------------------
def test_target_above_free_memory_is_refused_with_the_figures(source):
  source.setattr(_env, "fraction_source", _env.FRACTION_RKV)
  source.setattr(memory, "physical_device_bytes", lambda device=None: None)
  c = cfg(vram_target_mib=1.2e6 / MIB, mode="stream")
  need = rz.plan(shape(), CTX, 1, residency=c, memory_stats=stats(GIB))
  need_bytes = need.device_bytes + need.reserve_bytes
  tight = stats(need_bytes - 1 + 5 * MIB, 5 * MIB)  # one byte short, 5 MiB in use
  with pytest.raises(ValueError) as e:
    rz.plan(shape(), CTX, 1, residency=c, memory_stats=tight)
  msg = str(e.value)
  assert msg.startswith(f"plan: vram_target_mib={c.vram_target_mib:g} gives KV caches of "
                        f"{need.device_bytes} bytes")
  assert f"with the reserve of {need.reserve_bytes} bytes" in msg
  assert f"above the free device memory of {need_bytes - 1} bytes" in msg
  assert f"bytes_limit {(need_bytes - 1 + 5 * MIB) / MIB:.1f} MiB - bytes_in_use 5.0 MiB" in msg
  assert "tiles" in msg and "workspace" in msg and "check_free=False" in msg
  assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in msg  # rkv set it; no device size to compare
  # The same plan fits with the byte it lacked, and is not checked with check_free=False.
  rz.plan(shape(), CTX, 1, residency=c, memory_stats=stats(need_bytes + 5 * MIB, 5 * MIB))
  p = rz.plan(shape(), CTX, 1, residency=dataclasses.replace(c, check_free=False),
              memory_stats=tight)
  assert p.device_bytes == need.device_bytes


def test_the_suggested_target_fits():
  # "Lower vram_target_mib to at most N MiB": planning with N passes the same check, though the
  # refused plan was resident (no tiles in the reserve) and the one at N streams (8 tiles more).
  big = cfg(vram_target_mib=40, mode="stream")
  ctx, free = 65536, stats(790 * MIB)
  with pytest.raises(ValueError, match=r"Lower vram_target_mib to at most (\d+) MiB") as e:
    rz.plan(shape(), ctx, 1, residency=big, memory_stats=free)
  assert "nothing streams" in str(e.value)
  n = int(str(e.value).split("at most ")[1].split(" MiB")[0])
  p = rz.plan(shape(), ctx, 1, residency=dataclasses.replace(big, vram_target_mib=n),
              memory_stats=free)
  assert not p.fits and p.reserve.bytes_of("tiles") > 0
  assert p.device_bytes + p.reserve_bytes <= 790 * MIB
  # The reserve alone above free memory: no target is suggested.
  with pytest.raises(ValueError, match="The reserve alone does not fit"):
    rz.plan(shape(), ctx, 1, residency=big, memory_stats=stats(700 * MIB))


def test_refusal_advises_the_fraction_when_the_pool_is_short(source):
  source.setattr(memory, "physical_device_bytes", lambda device=None: H200_PHYSICAL)
  source.setattr(_env, "fraction_source", _env.FRACTION_TOO_LATE)
  source.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  source.setattr(memory, "host_memory", lambda: (128 * GIB, 120 * GIB))  # the H200's host
  # Llama-3-8B at 1M tokens with a 99 GiB window target on JAX's default 105 GiB pool with 15 GiB
  # of weights in use: the failure of the H200 run, now refused before filling.
  c = ResidencyConfig(vram_target_mib=99 * 1024, mode="stream", profile=FLAT)
  limit = stats(H200_DEFAULT_LIMIT, 15 * GIB)
  with pytest.raises(ValueError) as e:
    rz.plan(LLAMA3_8B, 1 << 20, 1, residency=c, memory_stats=limit)
  msg = str(e.value)
  assert "vram_target_mib=101376" in msg and "above the free device memory" in msg
  assert 'memory_stats()["bytes_limit"] is 104.9 GiB, 75% of the device\'s 139.8 GiB' in msg
  assert "Set XLA_PYTHON_CLIENT_MEM_FRACTION=0.98 in the environment before JAX starts" in msg
  # Physical size unknown but the fraction was not set by rkv: the advice still comes.
  source.setattr(memory, "physical_device_bytes", lambda device=None: None)
  with pytest.raises(ValueError, match="XLA_PYTHON_CLIENT_MEM_FRACTION=0.98"):
    rz.plan(LLAMA3_8B, 1 << 20, 1, residency=c, memory_stats=limit)
  # At rkv's 0.98 the same target fits with the weights loaded.
  source.setattr(_env, "fraction_source", _env.FRACTION_RKV)
  source.setattr(memory, "physical_device_bytes", lambda device=None: H200_PHYSICAL)
  p = rz.plan(LLAMA3_8B, 1 << 20, 1, residency=c, memory_stats=stats(H200_RKV_LIMIT, 15 * GIB))
  assert p.device_bytes + p.reserve_bytes <= H200_RKV_LIMIT - 15 * GIB


def test_a_target_above_what_the_plan_uses_is_not_refused():
  # gates / recall plan everything resident with vram_target_mib=1 << 20: the check is on what
  # the plan puts on the device (here 2 MiB), not on the target.
  p = rz.plan(shape(), CTX, 1, residency=cfg(vram_target_mib=1 << 20), memory_stats=stats(GIB))
  assert p.fits and p.budget_bytes == (1 << 20) * MIB
  with pytest.raises(ValueError, match="vram_target_mib=1048576"):
    rz.plan(shape(), CTX, 1, residency=cfg(vram_target_mib=1 << 20),
            memory_stats=stats(p.device_bytes + p.reserve_bytes - 1))


def test_auto_budget_below_the_reserve_names_the_terms():
  with pytest.raises(ValueError, match=r"vram_target_mib=0 leaves no KV budget.*bytes_limit 100 "
                                       r"MiB - bytes_in_use 0 MiB.*tiles.*workspace 256\.0 MiB"):
    rz.plan(shape(), CTX, 1, residency=cfg(), memory_stats=stats(100 * MIB))


@on_cpu
def test_no_stats_no_device_check():
  # No stats on CPU (memory_stats=None asks device 0): an explicit target is planned unchecked.
  assert memory.default_device().memory_stats() is None
  assert rz.plan(shape(), CTX, 1, residency=cfg(vram_target_mib=1 << 20)).fits


def test_host_tail_above_available_ram_is_refused(monkeypatch):
  c = cfg(vram_target_mib=1.2e6 / MIB, mode="stream")
  p = rz.plan(shape(), CTX, 1, residency=c, memory_stats=stats(GIB))
  assert p.host_bytes > 0
  monkeypatch.setattr(memory, "host_memory", lambda: (GIB, p.host_bytes - 1))
  with pytest.raises(ValueError) as e:
    rz.plan(shape(), CTX, 1, residency=c, memory_stats=stats(GIB))
  msg = str(e.value)
  assert "context_len gives a pinned-host tail of" in msg
  assert f"available memory of {(p.host_bytes - 1) / GIB:.1f} GiB (physical 1.0 GiB)" in msg
  assert "check_free=False" in msg
  rz.plan(shape(), CTX, 1, residency=dataclasses.replace(c, check_free=False),
          memory_stats=stats(GIB))
  monkeypatch.setattr(memory, "host_memory", lambda: (None, None))  # unknown: no check
  rz.plan(shape(), CTX, 1, residency=c, memory_stats=stats(GIB))


def test_host_memory_reads_this_machine():
  total, avail = memory.host_memory()
  assert total is not None and avail is not None
  assert 0 < avail <= total
  memory.check_host_memory(0, where="t")
  memory.check_host_memory(avail // 2, where="t")
  with pytest.raises(ValueError, match=r"t: capacity gives .* available memory"):
    memory.check_host_memory(10 * GIB, where="t", argument="capacity", memory=(8 * GIB, 4 * GIB))


def test_command_buffer_flags_are_added_unless_the_user_set_them():
  env = {}
  assert _env.add_default_xla_flags(env, modules={})
  assert env["XLA_FLAGS"].split() == list(_env.COMMAND_BUFFER_FLAGS)
  assert "CUSTOM_CALL" in _env.COMMAND_BUFFER_FLAGS[0]  # rkv's Pallas kernels in the graph too
  # The user's own setting of the flag wins; their other flags are kept.
  env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
  assert _env.add_default_xla_flags(env, modules={})
  assert env["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/x", *_env.COMMAND_BUFFER_FLAGS]
  env = {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=FUSION --xla_dump_to=/tmp/x"}
  assert not _env.add_default_xla_flags(env, modules={})  # nothing left to add
  assert env["XLA_FLAGS"] == "--xla_gpu_enable_command_buffer=FUSION --xla_dump_to=/tmp/x"
  # Too late once a backend exists: XLA has parsed the variable.
  xb = types.SimpleNamespace(backends_are_initialized=lambda: True)
  env = {}
  assert not _env.add_default_xla_flags(env, modules={"jax": object(), "jax._src.xla_bridge": xb})
  assert env == {}
