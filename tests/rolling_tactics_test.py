"""The exact tail tactics of ``rkv.rolling_attention`` equal resident attention.

``"cpu"`` (the tail's tiles attended by the host C kernel in a worker thread, merged on the
device), ``"hybrid"`` (the last ``cpu_fraction`` of the tiles on the CPU, the others streamed) and
``"head"`` (a ``HeadSplitKV``: the first R KV heads resident, the rest rolled) are compared with
``rkv.attention(..., impl="reference")`` over the whole arrays at the suite's named tolerances
(``tests/support/tolerances.py`` TOLERANCES), for fresh caches and for caches grown by appends across
flushes; bad tactic/kv combinations and arguments raise ValueError naming the argument.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rkv
from rkv import rolling
from rkv.head_split import HeadSplitKV
from rkv.offload import cpu_attention as cpu_lib
from tests.support.rolling_cases import (Case, assert_kinds, assert_same_attention,
                                         hybrid_decode_case, make)
from tests.support.tolerances import TOLERANCES

K2 = dict(h=8, k=2)  # GQA 4
CASES = [
    Case("w0_all_tail_gqa4", window_cells=0, **K2),
    Case("w_between_tail_not_tile_multiple_gqa4", **K2),
    Case("decode_softcap_gqa4", softcap=5.0, **K2),
    Case("chunk5_explicit_q_pos_gqa4", t=5, positions="chunk", **K2),
    Case("sliding_window_chunk", window=23, t=3),
    Case("holes_nan", t=2, positions="holes"),
    Case("int8", t=2, kv_dtype="int8"),
    Case("int8_bf16_scales_holes", t=2, kv_dtype="int8", scale_dtype="bfloat16", positions="holes"),
    Case("bf16_gqa4", dtype="bfloat16", **K2),
    Case("bf16_chunk5", dtype="bfloat16", t=5, positions="chunk"),
    Case("w_capacity_resident", window_cells=75),
    Case("tail_smaller_than_tile", s=30, window_cells=20),
]
# (tactic, extra kwargs, resident_heads for "head")
TACTIC_CONFIGS = [
    ("cpu", {}, None),
    ("hybrid", dict(cpu_fraction=0.0), None),
    ("hybrid", dict(cpu_fraction=0.5), None),
    ("hybrid", dict(cpu_fraction=1.0), None),
    ("head", {}, 0),
    ("head", {}, 1),
    ("head", {}, 2),  # R = K
]
# ("stream" is rolling_attention_test.py's matrix.)
CONFIG_IDS = [f"{t}{'_' + str(kw['cpu_fraction']) if kw else ''}"
              f"{'' if r is None else f'_R{r}'}" for t, kw, r in TACTIC_CONFIGS]


def assert_close(dtype, o, lse, o_ref, lse_ref):
  tol = TOLERANCES[dtype]
  o = np.asarray(jnp.asarray(o, jnp.float32))
  lse = np.asarray(lse)
  o_ref = np.asarray(jnp.asarray(o_ref, jnp.float32))
  lse_ref = np.asarray(lse_ref)
  assert not np.isnan(o).any() and not np.isnan(lse).any()
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
  np.testing.assert_allclose(o, o_ref, atol=tol["o"][0], rtol=tol["o"][1])
  finite = ~np.isneginf(lse_ref)
  np.testing.assert_allclose(lse[finite], lse_ref[finite], atol=tol["lse"][0], rtol=tol["lse"][1])


def build(tactic, r, k, v, *, window_cells, tile, k_pos=None, k_scale=None, v_scale=None,
          capacity=None):
  kw = dict(window_cells=window_cells, k_pos=k_pos, k_scale=k_scale, v_scale=v_scale,
            tile_cells=tile, capacity=capacity)
  if tactic == "head":
    return HeadSplitKV.from_arrays(k, v, resident_heads=r, **kw)
  return rkv.RollingKV.from_arrays(k, v, **kw)


def check_kinds(kv):
  for part in (kv.parts if isinstance(kv, HeadSplitKV) else (kv,)):
    assert_kinds(part)


@pytest.mark.parametrize("config", TACTIC_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_tactic_equals_resident(case, config):
  tactic, extra, r = config
  q, k, v, q_pos, k_pos, k_scale, v_scale = make(case)
  kv = build(tactic, r, k, v, window_cells=case.window_cells, tile=case.tile, k_pos=k_pos,
             k_scale=k_scale, v_scale=v_scale)
  check_kinds(kv)
  kw = dict(q_pos=q_pos, causal=case.causal, window=case.window, softcap=case.softcap)
  o, lse = rkv.rolling_attention(q, kv, tactic=tactic, impl="xla", **extra, **kw)
  assert o.shape == q.shape and o.dtype == q.dtype and lse.dtype == jnp.float32
  ref = rkv.attention(q, k, v, k_pos=k_pos, k_scale=k_scale, v_scale=v_scale, impl="reference",
                      **kw)
  assert_close(case.dtype, o, lse, *ref)
  check_kinds(kv)  # attention never moved the cache


@pytest.mark.parametrize("tactic,extra", [("cpu", {}), ("hybrid", dict(cpu_fraction=0.5))])
def test_cpu_tactics_unrolled_schedule(tactic, extra):
  case = Case("unrolled", s=90, window_cells=10, t=2, **K2)
  q, k, v, *_ = make(case, seed=1)
  kv = rkv.RollingKV.from_arrays(k, v, window_cells=10, tile_cells=16)
  o, lse = rkv.rolling_attention(q, kv, tactic=tactic, impl="xla", schedule="unrolled",
                                 lookahead=1, **extra)
  assert_close("float32", o, lse, *rkv.attention(q, k, v, impl="reference"))


@pytest.mark.parametrize("fraction,want", [(0.0, 0), (0.2, 1), (0.5, 3), (None, 3), (0.7, 4), (0.09, 0), (1.0, 5)])
def test_hybrid_split_goes_to_last_tiles(monkeypatch, fraction, want):
  case = Case("split", s=90, window_cells=10, **K2)  # 5 full tiles of 16
  q, k, v, *_ = make(case, seed=3)
  kv = rkv.RollingKV.from_arrays(k, v, window_cells=10, tile_cells=16)
  assert kv.n_full_tiles == 5
  calls = []
  real = cpu_lib.cpu_attention_tail

  def spy(*a, **kw):
    calls.append((kw["tiles"], threading.current_thread().name))
    return real(*a, **kw)

  monkeypatch.setattr(cpu_lib, "cpu_attention_tail", spy)
  extra = {} if fraction is None else dict(cpu_fraction=fraction)  # None: the default, 0.5
  o, lse = rkv.rolling_attention(q, kv, tactic="hybrid", impl="xla", **extra)
  assert_close("float32", o, lse, *rkv.attention(q, k, v, impl="reference"))
  if want == 0:
    assert calls == []
  else:
    # the CPU kernel runs over the last `want` tiles: in the worker thread while this thread
    # streams the others eagerly, on this thread when nothing is left to stream (all 5 on the
    # CPU: the device partials are one program, dispatched before the kernel runs)
    assert calls == [((5 - want, 5), calls[0][1])]
    if want < 5:
      assert calls[0][1].startswith("rkv-cpu-tail") and calls[0][1] != threading.main_thread().name
    else:
      assert calls[0][1] == threading.current_thread().name


def test_cpu_kernel_overlaps_device_partials(monkeypatch):
  # The kernel is submitted before the device partials are dispatched: when the first device
  # partial is dispatched the CPU call has already been started.
  case = Case("overlap", s=95, window_cells=10, **K2)  # 5 tiles + 5 staged
  q, k, v, *_ = make(case, seed=4)
  kv = rkv.RollingKV.from_arrays(k, v, window_cells=10, tile_cells=16)
  events = []
  started = threading.Event()
  real_cpu, real_partial = cpu_lib.cpu_attention_tail, rolling._partial_jit
  real_pair = rolling._partial_pair_jit

  def cpu_spy(*a, **kw):
    started.set()
    events.append("cpu")
    return real_cpu(*a, **kw)

  def spy(real):
    def partial_spy(*a, **kw):
      started.wait(10)
      events.append("device")
      return real(*a, **kw)
    return partial_spy

  monkeypatch.setattr(cpu_lib, "cpu_attention_tail", cpu_spy)
  monkeypatch.setattr(rolling, "_partial_jit", spy(real_partial))
  monkeypatch.setattr(rolling, "_partial_pair_jit", spy(real_pair))
  o, lse = rkv.rolling_attention(q, kv, tactic="hybrid", cpu_fraction=0.4, impl="xla")
  # The window's and the staging's partials (one program), 3 tiles.
  assert events[0] == "cpu" and events.count("device") == 1 + 3
  assert_close("float32", o, lse, *rkv.attention(q, k, v, impl="reference"))


def test_cpu_tactic_dispatches_device_partials_before_its_kernel(monkeypatch):
  # Nothing streams: the window and staging partials go out as one program first, then the
  # kernel runs on the calling thread while the device computes them.
  case = Case("inline", s=95, window_cells=10, **K2)  # 5 tiles + 5 staged
  q, k, v, *_ = make(case, seed=5)
  kv = rkv.RollingKV.from_arrays(k, v, window_cells=10, tile_cells=16)
  events = []
  real_cpu, real_unrolled = cpu_lib.cpu_attention_tail, rolling._unrolled

  def cpu_spy(*a, **kw):
    events.append(("cpu", threading.current_thread().name))
    return real_cpu(*a, **kw)

  def unrolled_spy(*a, **kw):
    events.append(("device", len(a[4])))  # its tiles: none streamed
    return real_unrolled(*a, **kw)

  monkeypatch.setattr(cpu_lib, "cpu_attention_tail", cpu_spy)
  monkeypatch.setattr(rolling, "_unrolled", unrolled_spy)
  o, lse = rkv.rolling_attention(q, kv, tactic="cpu", impl="xla")
  assert events == [("device", 0), ("cpu", threading.current_thread().name)]
  assert_close("float32", o, lse, *rkv.attention(q, k, v, impl="reference"))


@pytest.mark.parametrize("config", TACTIC_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_appends_across_flushes(config, kv_dtype):
  tactic, extra, r = config
  rng = np.random.default_rng(5)
  b, kh, h, d, cap = 1, 2, 8, 16, 120
  total = rng.standard_normal((b, cap, kh, d)).astype(np.float32)
  vals = rng.standard_normal((b, cap, kh, d)).astype(np.float32)
  ks = vs = None
  if kv_dtype == "int8":
    total, ks = rkv.cache.quantize_int8(total)
    vals, vs = rkv.cache.quantize_int8(vals)
    total, vals, ks, vs = map(np.asarray, (total, vals, ks, vs))
  s0 = 30
  sl = lambda x, lo, hi: None if x is None else x[:, lo:hi]
  kv = build(tactic, r, total[:, :s0], vals[:, :s0], window_cells=12, tile=8,
             k_scale=sl(ks, 0, s0), v_scale=sl(vs, 0, s0), capacity=cap)
  fill = s0
  for t in (1, 11, 1, 1, 16, 5, 1):  # single tokens, chunks crossing and skipping staging
    kv = kv.append(total[:, fill:fill + t], vals[:, fill:fill + t], k_scale=sl(ks, fill, fill + t),
                   v_scale=sl(vs, fill, fill + t))
    fill += t
    assert kv.fill == fill
    check_kinds(kv)
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    o, lse = rkv.rolling_attention(q, kv, tactic=tactic, impl="xla", **extra)
    ref = rkv.attention(q, jnp.asarray(total[:, :fill]), jnp.asarray(vals[:, :fill]),
                        k_scale=sl(ks, 0, fill), v_scale=sl(vs, 0, fill), impl="reference")
    assert_close("float32", o, lse, *ref)


@pytest.mark.parametrize("tactic,share", [("hybrid", 0.5), ("stream", None)])
def test_decode_attend_starts_its_tail_before_the_append(monkeypatch, tactic, share):
  # RollingKV.attend starts a hybrid step's CPU share (rolling.early_cpu_share) and requests its
  # first streamed tiles (rolling.early_puts) before it dispatches the append (a stream step
  # does neither), and the attention then uses both: across a flush (the step that adds a full tile, where the CPU share must wait
  # for the append) the result stays exact, and the CPU share runs in the worker thread.
  from rkv import cache as cache_lib
  from rkv.offload import stream
  rng = np.random.default_rng(11)
  b, kh, h, d, cap = 1, 2, 8, 16, 80
  k = rng.standard_normal((b, cap, kh, d)).astype(np.float32)
  v = rng.standard_normal((b, cap, kh, d)).astype(np.float32)
  kv = rkv.RollingKV.from_arrays(jnp.asarray(k[:, :45]), jnp.asarray(v[:, :45]), window_cells=12,
                                 tile_cells=8, capacity=cap).with_tactic(tactic, share)
  events = []
  real_puts, real_append, real_cpu = stream.put_many_eager, cache_lib.append, \
      cpu_lib.cpu_attention_tail
  monkeypatch.setattr(stream, "put_many_eager",
                      lambda tiles, *a, **kw: events.append(("puts", len(tiles)))
                      or real_puts(tiles, *a, **kw))
  monkeypatch.setattr(cache_lib, "append", lambda *a, **kw: events.append(("append",))
                      or real_append(*a, **kw))
  monkeypatch.setattr(cpu_lib, "cpu_attention_tail", lambda *a, **kw: events.append(
      ("cpu", threading.current_thread().name)) or real_cpu(*a, **kw))
  real_early = rolling.early_cpu_share
  started = []  # (events recorded before it, its future)

  def early_spy(*a, **kw):
    n = len([e for e in events if e[0] != "cpu"])
    future = real_early(*a, **kw)
    started.append((n, future))
    return future

  monkeypatch.setattr(rolling, "early_cpu_share", early_spy)
  fill = 45
  for _ in range(8):  # 45 -> 53 cells: the append to 52 = 12 + 5 * 8 flushes a fifth full tile
    events.clear()
    n_before = kv.n_full_tiles
    q = jnp.asarray(rng.standard_normal((b, 1, h, d)), jnp.float32)
    o, kv = kv.attend(q, jnp.asarray(k[:, fill:fill + 1]), jnp.asarray(v[:, fill:fill + 1]),
                      jnp.full((b, 1), fill, jnp.int32), impl="xla")
    fill += 1
    n_stream = rolling.streamed_count(n_before, tactic, share)
    cpu = [e for e in events if e[0] == "cpu"]  # from the worker: anywhere in the order
    main = [e for e in events if e[0] != "cpu"]
    if tactic == "hybrid":
      assert main[0] == ("puts", min(rolling.DEFAULT_LOOKAHEAD, n_stream)), events
      assert main[1] == ("append",), events
    else:  # early puts are for hybrid layers only (measured there): the stream schedule's own
      assert main[0] == ("append",) and main[1] == ("puts", min(rolling.DEFAULT_LOOKAHEAD,
                                                                n_stream)), events
    # The CPU share was started before anything else, unless this append fills a tile.
    flushes = kv.n_full_tiles != n_before
    assert started[-1][0] == 0 and (started[-1][1] is not None) == (
        tactic == "hybrid" and not flushes), (started, events)
    if tactic == "hybrid":
      assert len(cpu) == 1 and cpu[0][1].startswith("rkv-cpu-tail"), events
    ref, _ = rkv.attention(q, jnp.asarray(k[:, :fill]), jnp.asarray(v[:, :fill]),
                           q_pos=jnp.full((b, 1), fill - 1, jnp.int32), impl="reference")
    rtol, atol = TOLERANCES["float32"]["o"]
    np.testing.assert_allclose(np.asarray(o), np.asarray(ref), rtol=rtol, atol=atol)
  assert kv.n_full_tiles == 5  # 4 full tiles at 45 cells: a flush happened on the way


@pytest.mark.parametrize("name", ["RKV_EARLY_CPU", "RKV_EARLY_PUTS", "RKV_EARLY_Q_COPY",
                                  "RKV_WORKER_FIRST"])
def test_early_start_switches_refuse_bad_values(monkeypatch, name):
  rng = np.random.default_rng(12)
  k = jnp.asarray(rng.standard_normal((1, 40, 2, 16)), jnp.float32)
  kv = rkv.RollingKV.from_arrays(k, k, window_cells=8, tile_cells=8,
                                 capacity=48).with_tactic("hybrid", 0.5)
  q = jnp.zeros((1, 1, 8, 16), jnp.float32)
  monkeypatch.setenv(name, "maybe")
  with pytest.raises(ValueError, match=name):
    kv.attend(q, k[:, :1], k[:, :1], jnp.full((1, 1), 40, jnp.int32), impl="xla")
  monkeypatch.setenv(name, "off")  # a valid spelling: the step runs
  o, _ = kv.attend(q, k[:, :1], k[:, :1], jnp.full((1, 1), 40, jnp.int32), impl="xla")
  assert o.shape == q.shape


def _small_hybrid(k, tactic="hybrid", share=0.5):
  """A 56-cell cache of ``k`` (as K and V): window 8, 8-cell tiles, ``tactic`` with ``share``."""
  return rkv.RollingKV.from_arrays(k, k, window_cells=8, tile_cells=8,
                                   capacity=56).with_tactic(tactic,
                                                            share if tactic == "hybrid" else None)


@pytest.mark.parametrize("tactic,share,fill", [
    ("hybrid", 0.5, 40),  # the worker path: 4 full tiles, 2 streamed, 2 on the CPU
    ("cpu", None, 40),  # nothing streamed: the CPU share on this thread
    ("stream", None, 40),
    ("hybrid", 0.5, 6)])  # every cell in the window: the resident path
def test_while_waiting_runs_once_before_the_cpu_partial_is_read(monkeypatch, tactic, share, fill):
  # attend(while_waiting=fn) calls fn exactly once: on the hybrid worker path after the device
  # work is dispatched and before the CPU share's result is read (the merge), elsewhere after
  # the call's own work; the result is the same as without it.
  rng = np.random.default_rng(13)
  k = jnp.asarray(rng.standard_normal((1, fill, 2, 16)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((1, fill, 2, 16)), jnp.float32)
  fresh = lambda: rkv.RollingKV.from_arrays(k, v, window_cells=8, tile_cells=8,
                                            capacity=56).with_tactic(tactic, share)
  kv = fresh()
  q = jnp.asarray(rng.standard_normal((1, 1, 8, 16)), jnp.float32)
  new = jnp.asarray(rng.standard_normal((1, 1, 2, 16)), jnp.float32)
  pos = jnp.full((1, 1), fill, jnp.int32)
  events = []
  real_merge, real_cpu = rolling._merge_cpu, cpu_lib.cpu_attention_tail
  monkeypatch.setattr(rolling, "_merge_cpu",
                      lambda *a, **kw: events.append("merge") or real_merge(*a, **kw))
  monkeypatch.setattr(cpu_lib, "cpu_attention_tail",
                      lambda *a, **kw: (real_cpu(*a, **kw), events.append("cpu done"))[0])
  o, _ = kv.attend(q, new, new, pos, impl="xla", while_waiting=lambda: events.append("hook"))
  assert events.count("hook") == 1, events
  if tactic == "hybrid" and fill > 8:
    assert events.index("hook") < events.index("merge"), events
  elif tactic == "cpu":
    assert events.index("hook") > events.index("merge"), events
  ref, _ = fresh().attend(q, new, new, pos, impl="xla")
  np.testing.assert_array_equal(np.asarray(o), np.asarray(ref))


def test_while_waiting_error_propagates_after_the_cpu_share(monkeypatch):
  rng = np.random.default_rng(14)
  k = jnp.asarray(rng.standard_normal((1, 40, 2, 16)), jnp.float32)
  kv = _small_hybrid(k)
  done = []
  real_cpu = cpu_lib.cpu_attention_tail
  monkeypatch.setattr(cpu_lib, "cpu_attention_tail",
                      lambda *a, **kw: (real_cpu(*a, **kw), done.append(1))[0])

  def hook():
    raise RuntimeError("from the hook")

  with pytest.raises(RuntimeError, match="from the hook"):
    kv.attend(jnp.zeros((1, 1, 8, 16), jnp.float32), k[:, :1], k[:, :1],
              jnp.full((1, 1), 40, jnp.int32), impl="xla", while_waiting=hook)
  assert done == [1]  # the worker's CPU share had finished when the error came out


# One staged cell after the append, several, and an append that flushes a fifth tile: the early
# puts then cover 2 of the 3 tiles streamed after it, so the per-tile path runs.
@pytest.mark.parametrize("fill", [40, 44, 47])
def test_tiles_one_program_attends_the_same(monkeypatch, fill):
  # $RKV_TILES_ONE_PROGRAM=1: a hybrid decode step whose streamed tiles all came early attends
  # them and merges the device partials in one program (the window and staging in another);
  # the partials and their order are the same, so the result equals the default path.
  k, v, fresh, q, new, args = hybrid_decode_case(16, fill, capacity=64)
  calls = []
  real = rolling._tiles_merged_jit
  monkeypatch.setattr(rolling, "_tiles_merged_jit",
                      lambda *a, **kw: calls.append(len(a[3])) or real(*a, **kw))
  off, _ = fresh().attend(*args, impl="xla")
  assert not calls
  monkeypatch.setenv("RKV_TILES_ONE_PROGRAM", "1")
  kv = fresh()
  on, _ = kv.attend(*args, impl="xla")
  n_stream = rolling.streamed_count(kv.n_full_tiles, "hybrid", 0.4)
  assert calls == ([] if fill == 47 else [n_stream]) and n_stream == 2
  assert_same_attention(on, off, q, k, v, new, args[3])
  monkeypatch.setenv("RKV_TILES_ONE_PROGRAM", "often")
  with pytest.raises(ValueError, match="RKV_TILES_ONE_PROGRAM"):
    fresh().attend(*args, impl="xla")


def test_worker_first_starts_the_cpu_share_before_the_puts(monkeypatch):
  # $RKV_WORKER_FIRST=1: the CPU share's worker has started before attend goes on to the tile
  # puts and the append; the result is the same.
  from rkv.offload import stream
  rng = np.random.default_rng(17)
  k = jnp.asarray(rng.standard_normal((1, 40, 2, 16)), jnp.float32)
  fresh = lambda: _small_hybrid(k)
  q = jnp.asarray(rng.standard_normal((1, 1, 8, 16)), jnp.float32)
  args = (q, k[:, :1], k[:, :1], jnp.full((1, 1), 40, jnp.int32))
  off, _ = fresh().attend(*args, impl="xla")
  events = []
  real_tail, real_puts = rolling._annotated_cpu_tail, stream.put_many_eager
  monkeypatch.setattr(rolling, "_annotated_cpu_tail",
                      lambda *a, **kw: events.append("worker") or real_tail(*a, **kw))
  monkeypatch.setattr(stream, "put_many_eager",
                      lambda *a, **kw: events.append("puts") or real_puts(*a, **kw))
  monkeypatch.setattr(rolling, "WORKER_FIRST_TIMEOUT_S", 30.0)  # a loaded machine's wake-up
  monkeypatch.setenv("RKV_WORKER_FIRST", "1")
  on, _ = fresh().attend(*args, impl="xla")
  assert events[:2] == ["worker", "puts"], events
  np.testing.assert_array_equal(np.asarray(on), np.asarray(off))


def test_external_cpu_share_refuses_what_it_cannot_serve():
  # attend(cpu_share="external") computes the device side alone: only for a cpu / hybrid decode
  # step whose append fills no tile, unmerged, without cpu_threads; anything else names the
  # argument.
  k = jnp.zeros((1, 40, 2, 16), jnp.float32)
  fresh = lambda tactic="hybrid": _small_hybrid(k, tactic)
  q = jnp.zeros((1, 1, 8, 16), jnp.float32)
  args = (q, k[:, :1], k[:, :1], jnp.full((1, 1), 40, jnp.int32))
  with pytest.raises(ValueError, match="cpu_share must be None or 'external'"):
    fresh().attend(*args, merge=False, cpu_share="outside", impl="xla")
  with pytest.raises(ValueError, match="cpu_share='external' returns the device partial"):
    fresh().attend(*args, cpu_share="external", impl="xla")
  with pytest.raises(ValueError, match="cpu_threads"):
    fresh().attend(*args, merge=False, cpu_share="external", cpu_threads=2, impl="xla")
  with pytest.raises(ValueError, match="cpu_share='external' needs"):
    fresh("stream").attend(*args, merge=False, cpu_share="external", impl="xla")
  ((o, lse),), _ = fresh().attend(*args, merge=False, cpu_share="external", impl="xla")
  assert o.dtype == jnp.float32 and lse.shape == (1, 1, 8)


def test_early_q_copy_attends_the_same(monkeypatch):
  # $RKV_EARLY_Q_COPY=1 requests q's host copy before the CPU share is submitted: same result.
  rng = np.random.default_rng(15)
  k = jnp.asarray(rng.standard_normal((1, 40, 2, 16)), jnp.float32)
  kv = _small_hybrid(k)
  q = jnp.asarray(rng.standard_normal((1, 1, 8, 16)), jnp.float32)
  args = (q, k[:, :1], k[:, :1], jnp.full((1, 1), 40, jnp.int32))
  off, _ = kv.attend(*args, impl="xla")
  monkeypatch.setenv("RKV_EARLY_Q_COPY", "1")
  on, _ = _small_hybrid(k).attend(*args, impl="xla")
  np.testing.assert_array_equal(np.asarray(on), np.asarray(off))


def test_switch_interval_is_set_for_host_kernel_steps_and_restored(monkeypatch):
  import sys
  k = jnp.zeros((1, 40, 2, 16), jnp.float32)
  hybrid = _small_hybrid(k)
  streamed = hybrid.with_tactic("stream")
  before = sys.getswitchinterval()
  with rolling.host_kernel_switch_interval([hybrid]):
    assert sys.getswitchinterval() == before  # unset: Python's own
  monkeypatch.setenv("RKV_SWITCH_INTERVAL_US", "250")
  with rolling.host_kernel_switch_interval([streamed]):
    assert sys.getswitchinterval() == before  # no layer runs the CPU kernel
  with pytest.raises(KeyError):
    with rolling.host_kernel_switch_interval([streamed, hybrid]):
      assert sys.getswitchinterval() == pytest.approx(250e-6)
      raise KeyError("inside")
  assert sys.getswitchinterval() == before
  for bad in ("0", "-5", "fast", "inf"):
    monkeypatch.setenv("RKV_SWITCH_INTERVAL_US", bad)
    with pytest.raises(ValueError, match="RKV_SWITCH_INTERVAL_US"):
      with rolling.host_kernel_switch_interval([hybrid]):
        pass
  assert sys.getswitchinterval() == before


def test_auto_tactic():
  case = Case("auto", **K2)
  q, k, v, *_ = make(case)
  ref = rkv.attention(q, k, v, impl="reference")
  kv = rkv.RollingKV.from_arrays(k, v, window_cells=20, tile_cells=16)
  assert_close("float32", *rkv.rolling_attention(q, kv, impl="xla"), *ref)  # stream
  hs = HeadSplitKV.from_arrays(k, v, resident_heads=1, window_cells=20, tile_cells=16)
  assert hs.resident.window_cells == hs.resident.capacity == 75 and hs.resident.n_tail_tiles == 0
  assert hs.rolled.num_kv_heads == 1 and hs.rolled.n_full_tiles == 3
  assert_close("float32", *rkv.rolling_attention(q, hs, impl="xla"), *ref)  # head


def test_head_tactic_under_jit():
  case = Case("jit", **K2)
  q, k, v, *_ = make(case)
  hs = HeadSplitKV.from_arrays(k, v, resident_heads=1, window_cells=20, tile_cells=16)
  f = jax.jit(lambda q, kv: rkv.rolling_attention(q, kv, tactic="head", impl="xla"))
  assert_close("float32", *f(q, hs), *rkv.attention(q, k, v, impl="reference"))


# ---------------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small():
  case = Case("bad", **K2)
  q, k, v, *_ = make(case)
  return q, k, v, rkv.RollingKV.from_arrays(k, v, window_cells=20, tile_cells=16)


@pytest.mark.parametrize("tactic", ["cpu", "hybrid"])
def test_cpu_tactics_refused_under_jit(small, tactic):
  q, _, _, kv = small
  f = jax.jit(lambda q, kv: rkv.rolling_attention(q, kv, tactic=tactic, impl="xla"))
  with pytest.raises(ValueError, match="tactic='%s'.*jax.jit" % tactic):
    f(q, kv)


@pytest.mark.parametrize("fraction", [-0.1, 1.5, True, "0.5", float("nan")])
def test_cpu_fraction_out_of_range(small, fraction):
  q, _, _, kv = small
  with pytest.raises(ValueError, match="cpu_fraction"):
    rkv.rolling_attention(q, kv, tactic="hybrid", cpu_fraction=fraction)


@pytest.mark.parametrize("tactic", ["auto", "stream", "cpu"])
def test_cpu_fraction_needs_hybrid(small, tactic):
  q, _, _, kv = small
  with pytest.raises(ValueError, match="cpu_fraction"):
    rkv.rolling_attention(q, kv, tactic=tactic, cpu_fraction=0.5)


def test_cpu_threads_needs_cpu_tactic(small):
  q, _, _, kv = small
  with pytest.raises(ValueError, match="cpu_threads"):
    rkv.rolling_attention(q, kv, tactic="stream", cpu_threads=2)


@pytest.mark.parametrize("r", [3, -1, 1.0, True])
def test_resident_heads_out_of_range(small, r):
  _, k, v, _ = small
  with pytest.raises(ValueError, match="resident_heads"):
    HeadSplitKV.from_arrays(k, v, resident_heads=r, window_cells=20, tile_cells=16)


def test_bad_tactic_kv_combinations(small):
  q, k, v, kv = small
  with pytest.raises(ValueError, match="tactic"):
    rkv.rolling_attention(q, kv, tactic="head")
  with pytest.raises(ValueError, match="tactic"):
    rkv.rolling_attention(q, kv, tactic="bogus")
  hs = HeadSplitKV.from_arrays(k, v, resident_heads=1, window_cells=20, tile_cells=16)
  for tactic in ("stream", "cpu", "hybrid"):
    with pytest.raises(ValueError, match="tactic"):
      rkv.rolling_attention(q, hs, tactic=tactic)
  with pytest.raises(ValueError, match="cpu_fraction"):
    rkv.rolling_attention(q, hs, tactic="head", cpu_fraction=0.5)
  with pytest.raises(ValueError, match="tactic"):
    rolling.lower(q, kv, tactic="cpu")


def test_cpu_threads_passthrough(small):
  q, k, v, kv = small
  o, lse = rkv.rolling_attention(q, kv, tactic="cpu", cpu_threads=1, impl="xla")
  assert_close("float32", o, lse, *rkv.attention(q, k, v, impl="reference"))


def test_cpu_tactics_leave_a_core_by_default(small, monkeypatch):
  # The kernel of the cpu / hybrid tactics runs on OpenMP's threads minus one by default (the
  # thread dispatching the device work keeps a core); cpu_threads and $RKV_CPU_TAIL_THREADS win.
  q, k, v, kv = small
  monkeypatch.delenv(cpu_lib.TAIL_THREADS_ENV, raising=False)
  default = max(1, cpu_lib.max_threads() - cpu_lib.TAIL_RESERVED_THREADS)
  assert cpu_lib.TAIL_RESERVED_THREADS == 1 and cpu_lib.tail_threads() == default
  assert cpu_lib.tail_threads(3) == 3
  seen = []
  real = cpu_lib.cpu_attention_tail

  def spy(*a, **kw):
    seen.append(kw["num_threads"])
    return real(*a, **kw)

  monkeypatch.setattr(cpu_lib, "cpu_attention_tail", spy)
  ref = rkv.attention(q, k, v, impl="reference")
  for extra in (dict(tactic="cpu"), dict(tactic="hybrid", cpu_fraction=1.0),
                dict(tactic="cpu", cpu_threads=2)):
    assert_close("float32", *rkv.rolling_attention(q, kv, impl="xla", **extra), *ref)
  monkeypatch.setenv(cpu_lib.TAIL_THREADS_ENV, "5")
  assert cpu_lib.tail_threads() == 5
  rkv.rolling_attention(q, kv, tactic="cpu", impl="xla")
  assert seen == [default, default, 2, 5]
  for bad in ("0", "two"):
    monkeypatch.setenv(cpu_lib.TAIL_THREADS_ENV, bad)
    with pytest.raises(ValueError, match=cpu_lib.TAIL_THREADS_ENV):
      cpu_lib.tail_threads()


# (tactic, extra kwargs, resident_heads): every way a tail is attended, "stream" in both schedules.
NAN_TACTICS = [("stream", dict(schedule="eager"), None), ("stream", dict(schedule="unrolled"), None),
               ("cpu", {}, None), ("hybrid", dict(cpu_fraction=0.5), None), ("head", {}, 1)]


@pytest.mark.parametrize("config", NAN_TACTICS,
                         ids=["stream_eager", "stream_unrolled", "cpu", "hybrid", "head_R1"])
@pytest.mark.parametrize("cell,field", [(5, "k"), (25, "k"), (60, "v"), (70, "k")],
                         ids=["window_k", "first_tile_k", "last_tile_v", "staging_v"])
def test_nan_in_a_visible_cell_propagates(config, cell, field):
  # W=20, tile 16: cells [20,36), [36,52), [52,68) are tail tiles, [68,75) staged. The NaN cell is
  # visible to every query; holes elsewhere hold NaN and must stay quiet. Before the fix the tile
  # (or part) holding the NaN silently dropped out of the merge.
  tactic, extra, r = config
  case = Case("nan", t=2, positions="holes", **K2)
  q, k, v, q_pos, k_pos, _, _ = make(case)
  k_pos[:, cell] = cell
  k, v = np.array(k), np.array(v)
  (k if field == "k" else v)[0, cell, 1, 3] = np.nan
  kv = build(tactic, r, k, v, window_cells=case.window_cells, tile=case.tile, k_pos=k_pos)
  o, lse = rkv.rolling_attention(q, kv, tactic=tactic, impl="xla", q_pos=q_pos, **extra)
  o_ref, lse_ref = rkv.attention(q, k, v, k_pos=k_pos, q_pos=q_pos, impl="reference")
  o, lse, o_ref, lse_ref = (np.asarray(x, np.float32) for x in (o, lse, o_ref, lse_ref))
  assert np.isnan(o_ref).any()
  np.testing.assert_array_equal(np.isnan(o), np.isnan(o_ref))
  np.testing.assert_array_equal(np.isnan(lse), np.isnan(lse_ref))
  ok = ~np.isnan(o_ref)
  tol = TOLERANCES["float32"]
  np.testing.assert_allclose(o[ok], o_ref[ok], atol=tol["o"][0], rtol=tol["o"][1])


@pytest.mark.parametrize("tactic", ["stream", "cpu", "hybrid"])
def test_degenerate_inputs_agree_across_tactics(tactic):
  # An empty cache: o = 0, lse = -inf on every tactic; bad options: the same ValueError.
  kv = rkv.RollingKV.empty(1, 32, 2, 16, window_cells=8, tile_cells=8, dtype=jnp.float32)
  q = jnp.ones((1, 1, 4, 16), jnp.float32)
  o, lse = rkv.rolling_attention(q, kv, tactic=tactic, impl="xla", q_pos=np.zeros((1, 1), np.int32))
  assert (np.asarray(o) == 0).all() and np.isneginf(np.asarray(lse)).all()
  kv = rkv.RollingKV.from_arrays(*(np.ones((1, 20, 2, 16), np.float32),) * 2, window_cells=4,
                                 tile_cells=8)
  for bad, match in ((dict(scale=float("inf")), "scale must be a finite"),
                     (dict(softcap=float("inf")), "softcap must be None or a finite"),
                     (dict(causal="no"), "causal must be a bool")):
    with pytest.raises(ValueError, match=match):
      rkv.rolling_attention(q, kv, tactic=tactic, impl="xla", **bad)
    with pytest.raises(ValueError, match=match):
      cpu_lib.cpu_attention(np.ones((1, 1, 4, 16), np.float32), np.ones((1, 9, 2, 16), np.float32),
                            np.ones((1, 9, 2, 16), np.float32), **bad)


@pytest.mark.parametrize("tactic,share", [("hybrid", 0.5), ("cpu", None), ("stream", None)])
def test_attend_unmerged_parts_merge_to_the_merged_output(tactic, share):
  # RollingKV.attend(merge=False) hands back the partials layered_forward merges in its next
  # program: a cpu/hybrid layer's device and CPU partials (float32), else the one merged one;
  # merged by rolling.merge_parts they are the merged attend's output and equal the reference.
  rng = np.random.default_rng(13)
  b, kh, h, d, cap = 1, 2, 8, 16, 64
  k = rng.standard_normal((b, cap, kh, d)).astype(np.float32)
  v = rng.standard_normal((b, cap, kh, d)).astype(np.float32)
  kv = lambda: rkv.RollingKV.from_arrays(  # an append donates the window: one cache per call
      jnp.asarray(k[:, :40]), jnp.asarray(v[:, :40]), window_cells=8, tile_cells=8,
      capacity=cap).with_tactic(tactic, share)
  q = jnp.asarray(rng.standard_normal((b, 1, h, d)), jnp.float32)
  new = (jnp.asarray(k[:, 40:41]), jnp.asarray(v[:, 40:41]), jnp.full((b, 1), 40, jnp.int32))
  o, _ = kv().attend(q, *new, impl="xla")
  parts, kv2 = kv().attend(q, *new, impl="xla", merge=False)
  assert kv2.fill == 41 and isinstance(parts, tuple)
  assert len(parts) == (1 if tactic == "stream" else 2), [type(p[0]) for p in parts]
  merged, _ = rolling.merge_parts(parts, out_dtype=q.dtype)
  np.testing.assert_allclose(np.asarray(merged), np.asarray(o), rtol=0, atol=1e-6)
  ref, _ = rkv.attention(q, jnp.asarray(k[:, :41]), jnp.asarray(v[:, :41]),
                         q_pos=jnp.full((b, 1), 40, jnp.int32), impl="reference")
  rtol, atol = TOLERANCES["float32"]["o"]
  np.testing.assert_allclose(np.asarray(merged), np.asarray(ref), rtol=rtol, atol=atol)


def test_early_put_all_puts_every_streamed_tile_so_one_program_applies(monkeypatch):
  # 6 streamed tiles, more than the lookahead's 4: the early puts cover 4 and the per-tile path
  # runs; with $RKV_EARLY_PUT_ALL=1 they cover all 6 and $RKV_TILES_ONE_PROGRAM's program runs,
  # equal to the default path.
  from rkv.offload import stream
  k, v, fresh, q, new, args = hybrid_decode_case(21, 90, capacity=128)
  n_stream = rolling.streamed_count(fresh().n_full_tiles, "hybrid", 0.4)
  assert n_stream > rolling.DEFAULT_LOOKAHEAD
  puts, calls = [], []
  real_puts, real_merged = stream.put_many_eager, rolling._tiles_merged_jit
  monkeypatch.setattr(stream, "put_many_eager",
                      lambda tiles, *a, **kw: puts.append(len(tiles)) or real_puts(tiles, *a, **kw))
  monkeypatch.setattr(rolling, "_tiles_merged_jit",
                      lambda *a, **kw: calls.append(len(a[3])) or real_merged(*a, **kw))
  monkeypatch.setenv("RKV_TILES_ONE_PROGRAM", "1")
  off, _ = fresh().attend(*args, impl="xla")
  assert puts[0] == rolling.DEFAULT_LOOKAHEAD and not calls
  puts.clear()
  monkeypatch.setenv("RKV_EARLY_PUT_ALL", "1")
  on, _ = fresh().attend(*args, impl="xla")
  assert puts == [n_stream] and calls == [n_stream]
  assert_same_attention(on, off, q, k, v, new, args[3])
  monkeypatch.setenv("RKV_EARLY_PUT_ALL", "every")
  with pytest.raises(ValueError, match="RKV_EARLY_PUT_ALL"):
    fresh().attend(*args, impl="xla")


@pytest.mark.parametrize("tactic", ["cpu", "hybrid"])
def test_a_sharded_query_keeps_its_sharding_device_set(tactic):
  # A query with a NamedSharding (what a sharded model hands each device): a NamedSharding caches
  # its device set, and the CPU partial's merge once popped q's device out of it, so the next
  # query of the same sharding reported no device (a KeyError inside the sharded bench).
  from jax.sharding import Mesh, NamedSharding, PartitionSpec
  k, v, fresh, q, new, (q, k_new, v_new, q_pos) = hybrid_decode_case(3, 40, capacity=64)
  sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("x",)), PartitionSpec())
  q = jax.device_put(q, sharding)
  outs = []
  for _ in range(2):
    kv = fresh().with_tactic(tactic, 0.4 if tactic == "hybrid" else None)
    o, _ = rolling.rolling_attention(q, kv, q_pos=q_pos, tactic=tactic,
                                     cpu_fraction=kv.cpu_fraction)
    outs.append(np.asarray(o))
    assert q.devices() == {jax.devices()[0]} and sharding.device_set == {jax.devices()[0]}
  ref, _ = rkv.attention(q, k, v, q_pos=q_pos, impl="reference")
  for o in outs:
    np.testing.assert_allclose(o, np.asarray(ref), **dict(zip(("rtol", "atol"),
                                                            TOLERANCES["float32"]["o"])))
