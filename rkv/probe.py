"""Probes: measure the figures of the performance model on this machine → a :class:`Profile`.

What is measured (each figure can be overridden; ``experiments/probe.py`` is the script):
- ``pcie_gbps`` / ``transfer_overhead_us`` / ``d2h_gbps``: ``jax.device_put`` between the
  ``pinned_host`` and ``device`` memory kinds, median after warm-up, at each size of
  ``transfer_mib``; a line ``time = overhead + bytes / rate`` through the host→device medians
  gives the rate and the per-put fixed cost (one size: its rate, no overhead). ``d2h_gbps`` is the
  largest size's device→host rate.
- ``copy_latency_us``: median of a small (``latency_kib``) host→device ``device_put``.
- ``hbm_gbps`` / ``attn_overhead_us``: ``rkv.attention`` (``impl``, default auto) on a decode
  shape (T=1) at each of ``attn_kv_lens``, jitted, timed with :func:`rkv.benchmarking.time_fn`;
  a least-squares line ``time = overhead + bytes / rate`` through the points.
- ``cpu_attn_gbps`` / ``cpu_overhead_us`` (:func:`measure_cpu_tail`): the cpu tactic's step,
  ``rkv.rolling_attention(tactic="cpu")``, over a real :class:`rkv.RollingKV` (a small window,
  ``tail_tiles[i]`` tiles of ``cpu_tile_cells`` in ``pinned_host``): the C kernel in the tactic's
  worker thread (the query copied down, the tiles read in place), the window partial meanwhile,
  the partial's copy up and the merge; the line ``time = overhead + bytes / rate`` through the
  medians. The same line through the CPU branch alone (the worker's part plus the copy up, as
  ``rkv.rolling._with_cpu_tail`` runs it) goes to ``details`` and serves the contention step.
- ``hybrid_pcie_gbps`` / ``hybrid_cpu_gbps`` (:func:`measure_contention`): one hybrid step on
  ``contention_tiles`` tiles, split so both sides take about the same time at the solo rates:
  the CPU branch on the last tiles in the worker thread, the stream tactic (eager per-tile
  ``device_put`` s, lookahead) on the first ones in this thread, at once; each side's finish time
  (median) minus its fixed cost (``transfer_overhead_us``; the branch's) gives its rate under
  contention. The hybrid tactic's whole step at that split, each side alone, and the model's
  time for the step go to ``details`` (:func:`format_checks` prints them).
- ``share_overhead_us`` (:func:`measure_host_share`): a CPU share run by
  ``rkv.offload.host_share``'s C++ thread over the first ``tail_tiles[i]`` tiles of the same
  cache, its start and wait programs timed to the partial (median); the line ``time = overhead +
  bytes / rate`` through the medians gives the share's fixed cost a call (its rate stays in
  ``details["host_share"]``: the kernel is the cpu tactic's). Where the share cannot be built or
  run, ``None`` and the reason in ``details["host_share"]``.
- ``cpu_int8_share``: the kernel alone over the same cells in int8 (with scales), its bytes/s
  over the float dtype's (the kernel's cost is per cell: ``Profile.for_kv_dtype``).
- ``host_read_gbps`` and the kernel alone over numpy memory (the fallback for
  ``cpu_attn_gbps`` when the tail path cannot run, and a comparison in ``details``):
  ``rkv.offload.cpu_attention.measure_host_read_bandwidth`` / ``measure_cpu_attention`` (imported
  lazily; else ``None`` with the reason in ``details``). Contract used: keyword arguments among
  ``kv_len, batch, num_kv_heads, head_dim, group, dtype, repeats, tile_cells, num_threads``
  (attention) and ``nbytes, repeats`` (host read) — only those their signature names are
  passed — returning bytes/s as a number (their documented result), or a mapping / object with a
  ``bytes_per_s`` or ``gbps`` entry.
The CPU kernel runs with the tactics' thread count (``cpu_threads``, default
``rkv.offload.cpu_attention.tail_threads()``: all cores but one).

On a CPU backend everything runs (memory kinds exist there; transfers are memcpy), so small
sizes make a smoke test. Timing is wall clock around ``block_until_ready``; speed is never a test.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math
import statistics
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rkv import benchmarking
from rkv import planner
from rkv import rolling
from rkv.cache import RollingKV
from rkv.offload import cpu_attention as cpu_lib
from rkv.offload import memory
from rkv.planner import FIGURES, GB, MIB, H200_DEFAULT, Profile, default_profile_path

__all__ = ["FIGURES", "ProbeConfig", "Profile", "H200_DEFAULT", "default_profile_path",
           "fit_cost", "fit_line", "measure_contention", "measure_copy_latency_us",
           "measure_cpu", "measure_cpu_tail", "measure_device_attention", "measure_host_share",
           "measure_transfer", "run_probe", "format_checks"]

CPU_ATTENTION_MODULE = "rkv.offload.cpu_attention"


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
  """What :func:`run_probe` measures. Sizes in MiB / KiB / cells; ``overrides``: figure → value
  replacing the measured one (a ``None`` value is ignored).

  ``cpu_kv_len``: cells of the kernel-alone timing over numpy memory. ``cpu_tile_cells``: the tile
  of that timing and of the probe's RollingKV. ``tail_tiles``: tail sizes (in tiles, at least two
  distinct) of the cpu path's fit. ``contention_tiles``: tiles of the contention step (0: not
  measured; else at least 2). ``cpu_threads``: the kernel's threads (None: the tactics' default).
  ``host_share``: also time rkv.offload.host_share's CPU share over the ``tail_tiles`` sizes
  (``share_overhead_us``; only with ``cpu``).
  """

  transfer_mib: tuple[float, ...] = (64, 256, 1024)
  latency_kib: float = 4
  attn_kv_lens: tuple[int, ...] = (131072, 524288)
  batch: int = 1
  num_heads: int = 32
  num_kv_heads: int = 8
  head_dim: int = 128
  dtype: str = "bfloat16"
  impl: str = "auto"
  cpu: bool = True
  cpu_kv_len: int = 131072
  cpu_tile_cells: int = 32768
  # Up to 2 GiB (16 tiles of 128 MiB at bf16 K=8 D=128): fits from 1 GiB down extrapolated the
  # CPU side of 1-3 GB hybrid tails 10-15% slow on the H200 (tactics_bench_h200_run5.json).
  tail_tiles: tuple[int, ...] = (2, 8, 16)
  contention_tiles: int = 16
  cpu_threads: int | None = None
  host_share: bool = True
  host_read_mib: float = 1024
  warmup: int = 2
  repeats: int = 7
  overrides: Mapping[str, float | None] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    where = "ProbeConfig"
    if not self.transfer_mib or any(not (float(x) > 0) for x in self.transfer_mib):
      raise ValueError(f"{where}: transfer_mib must be positive sizes, got {self.transfer_mib!r}")
    if not self.attn_kv_lens or any(int(x) < 1 for x in self.attn_kv_lens):
      raise ValueError(f"{where}: attn_kv_lens must be positive, got {self.attn_kv_lens!r}")
    for name in ("batch", "num_heads", "num_kv_heads", "head_dim", "cpu_kv_len",
                 "cpu_tile_cells", "repeats"):
      if int(getattr(self, name)) < 1:
        raise ValueError(f"{where}: {name} must be >= 1, got {getattr(self, name)!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"{where}: num_heads={self.num_heads} must be a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    if self.warmup < 0 or not (self.latency_kib > 0) or not (self.host_read_mib > 0):
      raise ValueError(f"{where}: warmup must be >= 0, latency_kib and host_read_mib > 0")
    if (len(set(self.tail_tiles)) < 2 or
        any(not planner.is_int(n) or n < 1 for n in self.tail_tiles)):
      raise ValueError(f"{where}: tail_tiles must hold at least two distinct positive tile "
                       f"counts (a line is fit), got {self.tail_tiles!r}")
    if (not planner.is_int(self.contention_tiles) or self.contention_tiles < 0
        or self.contention_tiles == 1):
      raise ValueError(f"{where}: contention_tiles must be 0 (not measured) or >= 2 (a tile on "
                       f"each side), got {self.contention_tiles!r}")
    if self.cpu_threads is not None and (not planner.is_int(self.cpu_threads)
                                         or self.cpu_threads < 1):
      raise ValueError(f"{where}: cpu_threads must be None or a positive int, got "
                       f"{self.cpu_threads!r}")
    if not isinstance(self.host_share, (bool, np.bool_)):
      raise ValueError(f"{where}: host_share must be a bool, got {self.host_share!r}")
    unknown = set(self.overrides) - set(FIGURES)
    if unknown:
      raise ValueError(f"{where}: overrides names unknown figures {sorted(unknown)}; known: "
                       f"{FIGURES}")


# ----------------------------------------------------------------------------------------------
# Host <-> device transfers
# ----------------------------------------------------------------------------------------------
def _time_put(x, dst, warmup: int, repeats: int) -> list[float]:
  samples = []
  for i in range(warmup + repeats):
    t0 = time.perf_counter()
    y = jax.device_put(x, dst, may_alias=False)
    y.block_until_ready()
    dt = time.perf_counter() - t0
    y.delete()
    if i >= warmup:
      samples.append(dt)
  return samples


def measure_transfer(nbytes: int, direction: str = "h2d", *, warmup: int = 2,
                     repeats: int = 7) -> dict[str, float]:
  """``device_put`` of ``nbytes`` from ``pinned_host`` to ``device`` (``h2d``) or back
  (``d2h``); returns ``{bytes, median_s, min_s, gbps}`` (median)."""
  if direction not in ("h2d", "d2h"):
    raise ValueError(f"measure_transfer: direction must be 'h2d' or 'd2h', got {direction!r}")
  src_kind, dst_kind = ((memory.PINNED_HOST, memory.DEVICE) if direction == "h2d" else
                        (memory.DEVICE, memory.PINNED_HOST))
  n = max(1, int(nbytes) // 4)
  x = jax.device_put(np.ones(n, np.float32), memory.sharding(src_kind))
  x.block_until_ready()
  try:
    samples = _time_put(x, memory.sharding(dst_kind), warmup, repeats)
  finally:
    x.delete()
  med = statistics.median(samples)
  return dict(bytes=4 * n, median_s=med, min_s=min(samples), gbps=4 * n / med / GB)


def measure_copy_latency_us(nbytes: int = 4096, *, warmup: int = 2, repeats: int = 7) -> float:
  """Median microseconds of one small pinned_host → device ``device_put``."""
  return measure_transfer(nbytes, "h2d", warmup=warmup, repeats=repeats)["median_s"] * 1e6


# ----------------------------------------------------------------------------------------------
# Device attention
# ----------------------------------------------------------------------------------------------
def fit_line(xs, ys) -> tuple[float, float]:
  """Least-squares ``y = a + b x``; returns ``(a, b)``. One point: ``(0, y / x)``."""
  xs, ys = np.asarray(xs, np.float64), np.asarray(ys, np.float64)
  if len(xs) < 2 or np.ptp(xs) == 0:
    return 0.0, float(np.mean(ys / xs))
  b, a = np.polyfit(xs, ys, 1)
  return float(a), float(b)


def fit_cost(xs, ys) -> tuple[float, float, str]:
  """``(overhead_s, rate, how)`` of ``y = overhead + x / rate`` (``x`` bytes, ``y`` seconds).

  ``how``: ``"fit"`` (least squares); ``"origin"`` when that line has a negative intercept (noise
  at small sizes: the line through the origin, overhead 0); ``"largest"`` when it has no positive
  slope (the largest point's rate, overhead 0)."""
  a, b = fit_line(xs, ys)
  if b > 0 and a >= 0:
    return a, 1.0 / b, "fit"
  xs, ys = np.asarray(xs, np.float64), np.asarray(ys, np.float64)
  if b > 0:
    return 0.0, float(np.sum(xs * xs) / np.sum(xs * ys)), "origin"
  i = int(np.argmax(xs))
  return 0.0, float(xs[i] / ys[i]), "largest"


def measure_device_attention(kv_lens=(131072, 524288), *, batch: int = 1, num_heads: int = 32,
                             num_kv_heads: int = 8, head_dim: int = 128, dtype="bfloat16",
                             impl: str = "auto", warmup: int = 2, repeats: int = 7) -> dict:
  """Decode attention (T=1) over each KV length; returns ``{hbm_gbps, attn_overhead_us,
  s_per_cell, rows}`` from the line ``time = overhead + kv_bytes / rate`` (a noisy or single
  point falls back to overhead 0 and the largest length's rate)."""
  import rkv  # the package imports this module's siblings; keep the import here
  dt = jnp.dtype(dtype)
  fn = jax.jit(functools.partial(rkv.attention, impl=impl))
  rows = []
  for s in kv_lens:
    # Decode attention is memory bound and value-independent: constant inputs time the same as
    # random ones and skip jax.random's compile (seconds on a CPU backend).
    q = jnp.full((batch, 1, num_heads, head_dim), 0.1, dt)
    k = jnp.full((batch, int(s), num_kv_heads, head_dim), 0.1, dt)
    v = jnp.ones((batch, int(s), num_kv_heads, head_dim), dt)
    timing = benchmarking.time_fn(fn, q, k, v, n_warmup=warmup, n_outer=repeats, target_s=0.05)
    nbytes = 2 * batch * int(s) * num_kv_heads * head_dim * dt.itemsize
    rows.append(dict(kv_len=int(s), bytes=nbytes, median_s=timing.median_s,
                     gbps=nbytes / timing.median_s / GB))
    del q, k, v
  overhead, s_per_byte = fit_line([r["bytes"] for r in rows], [r["median_s"] for r in rows])
  if not (s_per_byte > 0) or overhead < 0:
    last = rows[-1]
    overhead, s_per_byte = 0.0, last["median_s"] / last["bytes"]
  cell_bytes = 2 * num_kv_heads * head_dim * dt.itemsize
  return dict(hbm_gbps=1.0 / s_per_byte / GB, attn_overhead_us=overhead * 1e6,
              s_per_cell=s_per_byte * cell_bytes * batch, impl=impl,
              shape=dict(batch=batch, num_heads=num_heads, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, dtype=dt.name), rows=rows)


# ----------------------------------------------------------------------------------------------
# Host CPU attention (another module's measurement; optional)
# ----------------------------------------------------------------------------------------------
def _gbps(result, keys: tuple[str, ...]) -> float | None:
  """GB/s from a measurement: a bare number is bytes/s (the cpu_attention module's result)."""
  if isinstance(result, (int, float, np.integer, np.floating)) and not isinstance(result, bool):
    return float(result) / GB
  get = ((lambda k: result.get(k)) if isinstance(result, Mapping)
         else (lambda k: getattr(result, k, None)))
  val = get("bytes_per_s")
  if val is not None:
    return float(val) / GB
  for k in keys:
    val = get(k)
    if val is not None:
      return float(val)
  return None


def _call(fn, **candidates):
  params = inspect.signature(fn).parameters
  return fn(**{k: v for k, v in candidates.items() if k in params})


def _jsonable(x):
  if isinstance(x, (int, float, str, bool)) or x is None:
    return x
  if isinstance(x, Mapping):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if dataclasses.is_dataclass(x) and not isinstance(x, type):
    return _jsonable(dataclasses.asdict(x))
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, (np.integer, np.floating)):
    return x.item()
  return repr(x)


def measure_cpu(cfg: ProbeConfig) -> dict:
  """``{cpu_attn_gbps, host_read_gbps, cpu_int8_share, details}`` from :data:`CPU_ATTENTION_MODULE` if present;
  a missing module or function gives ``None`` with the reason."""
  out: dict[str, Any] = dict(cpu_attn_gbps=None, host_read_gbps=None, cpu_int8_share=None,
                            details={})
  if not cfg.cpu:
    out["details"] = dict(cpu_attn_gbps="skipped (cpu=False)", host_read_gbps="skipped (cpu=False)")
    return out
  try:
    mod = importlib.import_module(CPU_ATTENTION_MODULE)
  except ImportError as e:
    reason = f"{CPU_ATTENTION_MODULE} not available: {e}"
    out["details"] = dict(cpu_attn_gbps=reason, host_read_gbps=reason)
    return out
  # The CPU kernel reads a tile-major tail: the tile must divide the length.
  tile = cfg.cpu_tile_cells if cfg.cpu_kv_len % cfg.cpu_tile_cells == 0 else cfg.cpu_kv_len
  threads = getattr(mod, "tail_threads", None)
  attn_kw = dict(kv_len=cfg.cpu_kv_len, batch=cfg.batch, num_kv_heads=cfg.num_kv_heads,
                 head_dim=cfg.head_dim, group=cfg.num_heads // cfg.num_kv_heads,
                 num_heads=cfg.num_heads, dtype=cfg.dtype, repeats=cfg.repeats,
                 warmup=cfg.warmup, tile_cells=tile,
                 num_threads=None if threads is None else threads(cfg.cpu_threads))
  read_kw = dict(nbytes=int(cfg.host_read_mib * MIB), repeats=cfg.repeats)
  for figure, fn_name, keys, kw in (
      ("cpu_attn_gbps", "measure_cpu_attention", ("gbps", "cpu_attn_gbps"), attn_kw),
      ("host_read_gbps", "measure_host_read_bandwidth", ("gbps", "host_read_gbps"), read_kw)):
    fn = getattr(mod, fn_name, None)
    if fn is None:
      out["details"][figure] = f"{CPU_ATTENTION_MODULE}.{fn_name} not found"
      continue
    try:
      result = _call(fn, **kw)
    except Exception as e:  # a failing optional probe must not lose the others' figures
      out["details"][figure] = f"{fn_name} failed: {type(e).__name__}: {e}"
      continue
    val = _gbps(result, keys)
    out["details"][f"{figure}_raw"] = _jsonable(result)
    if val is None or not (val > 0) or not math.isfinite(val):
      out["details"][figure] = f"{fn_name} returned no usable GB/s: {result!r}"[:300]
    else:
      out[figure] = val
  fn = getattr(mod, "measure_cpu_attention", None)
  if (out["cpu_attn_gbps"] is not None and fn is not None and cfg.dtype != "int8"
      and "dtype" in inspect.signature(fn).parameters):
    # The kernel alone over int8 K/V, the same cells: its bytes/s as a share of the float
    # dtype's (the kernel's cost is per cell; Profile.for_kv_dtype).
    try:
      val = _gbps(_call(fn, **dict(attn_kw, dtype="int8")), ("gbps", "cpu_attn_gbps"))
    except Exception as e:  # noqa: BLE001 - optional, like the figures above
      out["details"]["cpu_int8_share"] = f"measure_cpu_attention(int8) failed: {type(e).__name__}: {e}"
    else:
      if val is not None and val > 0 and math.isfinite(val):
        out["details"]["cpu_int8_gbps"] = val
        out["cpu_int8_share"] = val / out["cpu_attn_gbps"]
  return out


# ----------------------------------------------------------------------------------------------
# The tactics' own paths over a real RollingKV: the CPU branch alone, and contention
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Tail:
  """The probe's cache: a ``WINDOW_ALIGN``-cell window (so the tactics dispatch their window
  partial, as in a real step) and ``n_tiles`` full ``pinned_host`` tail tiles."""

  kv: RollingKV
  q: jax.Array
  q_pos: jax.Array
  tile_bytes: int
  window_bytes: int
  threads: int

  def view(self, m: int):
    """The cache as if only its first ``m`` tail tiles were written (the same arrays)."""
    return dataclasses.replace(self.kv, fill=self.kv.window_cells + m * self.kv.tile_cells)


def _tail(cfg: ProbeConfig, n_tiles: int) -> _Tail:
  w, tile = planner.WINDOW_ALIGN, cfg.cpu_tile_cells
  s = w + n_tiles * tile
  dt = jnp.dtype(cfg.dtype)
  # Attention is memory bound and value-independent: constant cells time like random ones and
  # cost nothing to make (GiBs of them on the GPU host).
  shape = (cfg.batch, s, cfg.num_kv_heads, cfg.head_dim)
  kv = RollingKV.from_arrays(np.full(shape, 0.1, dt), np.full(shape, 0.2, dt),
                             window_cells=w, tile_cells=tile)
  q = jnp.full((cfg.batch, 1, cfg.num_heads, cfg.head_dim), 0.1, dt)
  q_pos = jnp.full((cfg.batch, 1), s - 1, jnp.int32)
  return _Tail(kv=kv, q=q, q_pos=q_pos, tile_bytes=kv.nbytes("tail") // kv.n_tail_tiles,
               window_bytes=kv.nbytes("window"), threads=cpu_lib.tail_threads(cfg.cpu_threads))


def _cpu_branch(tail: _Tail, tiles: tuple[int, int]) -> float:
  """What the cpu / hybrid tactics' worker does (``rkv.rolling._with_cpu_tail``): the kernel over
  ``tiles`` of the pinned_host tail (it copies q down itself), then the partial's copy up; runs
  in the tactics' worker thread. Returns the ``perf_counter`` time the partial is on the device."""
  o, lse = cpu_lib.cpu_attention_tail(tail.q, tail.kv, q_pos=tail.q_pos, tiles=tiles,
                                      num_threads=tail.threads)
  jax.block_until_ready(jax.device_put((o, lse), next(iter(tail.q.devices()))))
  return time.perf_counter()


def _stream_side(tail: _Tail, m: int, impl: str):
  """The stream tactic over the first ``m`` tiles (eager per-tile device_put, lookahead)."""
  return rolling.rolling_attention(tail.q, tail.view(m), q_pos=tail.q_pos, tactic="stream",
                                   impl=impl)


def _medians(fn, warmup: int, repeats: int) -> tuple[float, ...]:
  """Per-position medians of ``fn()`` (a tuple of seconds) over ``repeats`` after ``warmup``."""
  for _ in range(warmup):
    fn()
  samples = [fn() for _ in range(repeats)]
  return tuple(statistics.median(col) for col in zip(*samples))


def _time_call(fn) -> tuple[float]:
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  return (time.perf_counter() - t0,)


def measure_cpu_tail(cfg: ProbeConfig, tail: _Tail) -> dict:
  """The cpu tactic's step (``rkv.rolling_attention(tactic="cpu")``: the CPU branch, the window
  partial meanwhile, the merge) and its CPU branch alone (:func:`_cpu_branch`, submitted to the
  tactics' worker) over each of ``cfg.tail_tiles`` tiles; each gets the line ``time = overhead +
  bytes / rate`` (:func:`fit_cost`). The step's line gives ``{cpu_attn_gbps, cpu_overhead_us}``:
  the model's CPU side is the whole tactic's fixed cost plus the bytes; the branch's line
  (``branch``) sizes and reads the contention step, whose CPU side is the branch."""
  warmup = max(cfg.warmup, 1)
  rows = []
  for m in sorted(set(cfg.tail_tiles)):
    def branch():
      t0 = time.perf_counter()
      return (rolling._executor().submit(_cpu_branch, tail, (0, m)).result() - t0,)
    (branch_s,) = _medians(branch, warmup, cfg.repeats)
    (tactic_s,) = _medians(lambda: _time_call(lambda: rolling.rolling_attention(
        tail.q, tail.view(m), q_pos=tail.q_pos, tactic="cpu", impl=cfg.impl,
        cpu_threads=tail.threads)), warmup, cfg.repeats)
    nbytes = m * tail.tile_bytes
    rows.append(dict(tiles=m, bytes=nbytes, branch_s=branch_s, tactic_s=tactic_s,
                     gbps=nbytes / tactic_s / GB))
  line = lambda key: fit_cost([r["bytes"] for r in rows], [r[key] for r in rows])
  overhead, rate, how = line("tactic_s")
  b_overhead, b_rate, b_how = line("branch_s")
  return dict(cpu_attn_gbps=rate / GB, cpu_overhead_us=overhead * 1e6, fit=how,
              branch=dict(gbps=b_rate / GB, overhead_us=b_overhead * 1e6, fit=b_how), rows=rows)


def measure_host_share(cfg: ProbeConfig, tail: _Tail) -> dict:
  """A layer's CPU share as rkv.offload.host_share runs it (a C++ thread woken from inside its
  start program, awaited by its wait program) over tiles ``(0, m)`` of the probe's tail for each
  ``m`` of ``cfg.tail_tiles``: the start and wait programs and the partial's
  ``block_until_ready``, wall clock, median. The line ``time = overhead + bytes / rate``
  (:func:`fit_cost`) gives ``{share_overhead_us, share_cpu_gbps}``; ``rows`` the medians. Raises
  where the share cannot be built or run (the caller records why)."""
  from rkv.offload import host_share as share_lib  # builds the share's C++ library on first use
  warmup = max(cfg.warmup, 1)  # the first call compiles the share's two programs
  share = share_lib.HostShare(tail.q.shape)
  rows = []
  try:
    for m in sorted(set(cfg.tail_tiles)):
      share.configure(tail.kv, tiles=(0, m), num_threads=tail.threads)

      def call():
        t0 = time.perf_counter()
        jax.block_until_ready(share.wait_program(share.start_program(tail.q, tail.q_pos)))
        return (time.perf_counter() - t0,)

      (call_s,) = _medians(call, warmup, cfg.repeats)
      nbytes = m * tail.tile_bytes
      rows.append(dict(tiles=m, bytes=nbytes, call_s=call_s, gbps=nbytes / call_s / GB))
    # Every timed call ran the kernel once and cleanly (a skipped run would time as a fast one).
    counters = share.counters()
  finally:
    share.close()
  overhead, rate, how = fit_cost([r["bytes"] for r in rows], [r["call_s"] for r in rows])
  return dict(share_overhead_us=overhead * 1e6, share_cpu_gbps=rate / GB, fit=how, rows=rows,
              counters=counters)


def _host_share_or_reason(cfg: ProbeConfig, tail: _Tail) -> dict | str:
  """:func:`measure_host_share`, or why it was not measured: the share is optional (it needs a
  C++ compiler and jaxlib's FFI headers), so its failure must not lose the other figures."""
  if not cfg.host_share:
    return "skipped (host_share=False)"
  try:
    from rkv.offload import host_share as share_lib
    ok, why = share_lib.share_available()
    if not ok:
      return f"host share not available: {why}"[:500]
    return measure_host_share(cfg, tail)
  except Exception as e:  # noqa: BLE001 - a broken build or run: recorded, not fatal
    return f"host share failed: {type(e).__name__}: {e}"[:500]


def _balanced_cpu_tiles(n: int, tile_bytes: int, stream_s, cpu_s) -> int:
  """CPU tiles (1..n-1) of an ``n``-tile hybrid whose sides' solo times are closest."""
  return min(range(1, n), key=lambda c: abs(stream_s((n - c) * tile_bytes) - cpu_s(c * tile_bytes)))


def _rate_under(nbytes: float, seconds: float, overhead_s: float) -> tuple[float, str]:
  """``nbytes / (seconds - overhead)``: the rate that, with the model's fixed cost added back,
  gives the measured time; the whole time when the fixed cost is most of it (tiny sizes)."""
  busy = seconds - overhead_s
  if busy <= 0.25 * seconds:
    return nbytes / seconds, "fixed cost is most of the time: rate over the whole time"
  return nbytes / busy, "rate over the time minus the fixed cost"


def measure_contention(cfg: ProbeConfig, tail: _Tail, *, pcie: tuple[float, float],
                       cpu: tuple[float, float]) -> dict:
  """One hybrid step on ``cfg.contention_tiles`` tiles, both sides at once as the hybrid runs
  them: the CPU branch on the last ``c`` tiles in the worker thread (started first), the stream
  tactic on the first ``n - c`` here; ``c`` balances the sides' solo times (``pcie``, ``cpu``:
  ``(overhead_s, bytes/s)`` of each side alone). Returns ``{hybrid_pcie_gbps, hybrid_cpu_gbps}``
  (each side's bytes over its median finish time minus its fixed cost) and the raw times: each
  side contended and alone, the hybrid tactic's whole step."""
  n, tb, warmup = cfg.contention_tiles, tail.tile_bytes, max(cfg.warmup, 1)
  c = _balanced_cpu_tiles(n, tb, lambda b: pcie[0] + b / pcie[1], lambda b: cpu[0] + b / cpu[1])

  def both():
    t0 = time.perf_counter()
    future = rolling._executor().submit(_cpu_branch, tail, (n - c, n))
    jax.block_until_ready(_stream_side(tail, n - c, cfg.impl))
    stream_s = time.perf_counter() - t0
    return stream_s, future.result() - t0

  stream_s, cpu_s = _medians(both, warmup, cfg.repeats)
  (stream_alone_s,) = _medians(lambda: _time_call(lambda: _stream_side(tail, n - c, cfg.impl)),
                               warmup, cfg.repeats)

  def cpu_alone():
    t0 = time.perf_counter()
    return (rolling._executor().submit(_cpu_branch, tail, (n - c, n)).result() - t0,)

  (cpu_alone_s,) = _medians(cpu_alone, warmup, cfg.repeats)
  (hybrid_s,) = _medians(lambda: _time_call(lambda: rolling.rolling_attention(
      tail.q, tail.view(n), q_pos=tail.q_pos, tactic="hybrid", cpu_fraction=c / n,
      impl=cfg.impl, cpu_threads=tail.threads)), warmup, cfg.repeats)
  p_rate, p_how = _rate_under((n - c) * tb, stream_s, pcie[0])
  c_rate, c_how = _rate_under(c * tb, cpu_s, cpu[0])
  return dict(hybrid_pcie_gbps=p_rate / GB, hybrid_cpu_gbps=c_rate / GB, tiles=n, cpu_tiles=c,
              tile_bytes=tb, stream_s=stream_s, cpu_s=cpu_s, stream_alone_s=stream_alone_s,
              cpu_alone_s=cpu_alone_s, hybrid_step_s=hybrid_s, stream_rate=p_how,
              cpu_rate=c_how)


def measure_tail(cfg: ProbeConfig, pcie: tuple[float, float]) -> dict:
  """:func:`measure_cpu_tail` and (``contention_tiles``) :func:`measure_contention` on one probe
  cache, then (``host_share``) :func:`measure_host_share` on it; ``pcie``: the stream side's
  ``(overhead_s, bytes/s)`` alone. Returns the figures and ``details`` (``cpu_tail``,
  ``contention``, ``host_share``: its rows and fit or why not, ``tail``: the cache and
  threads)."""
  n = max(max(cfg.tail_tiles), cfg.contention_tiles)
  tail = _tail(cfg, n)
  details: dict[str, Any] = dict(tail=dict(tiles=n, tile_cells=cfg.cpu_tile_cells,
                                           tile_bytes=tail.tile_bytes,
                                           window_bytes=tail.window_bytes,
                                           cpu_threads=tail.threads))
  fit = details["cpu_tail"] = measure_cpu_tail(cfg, tail)
  out = dict(cpu_attn_gbps=fit["cpu_attn_gbps"], cpu_overhead_us=fit["cpu_overhead_us"],
             hybrid_pcie_gbps=None, hybrid_cpu_gbps=None, share_overhead_us=None,
             details=details)
  if not cfg.contention_tiles:
    details["contention"] = "skipped (contention_tiles=0)"
  else:
    branch = fit["branch"]
    con = details["contention"] = measure_contention(
        cfg, tail, pcie=pcie, cpu=(branch["overhead_us"] * 1e-6, branch["gbps"] * GB))
    out.update(hybrid_pcie_gbps=con["hybrid_pcie_gbps"], hybrid_cpu_gbps=con["hybrid_cpu_gbps"])
  share = details["host_share"] = _host_share_or_reason(cfg, tail)
  if isinstance(share, Mapping):
    out["share_overhead_us"] = share["share_overhead_us"]
  return out


def _self_check(prof: Profile, details: dict) -> None:
  """Adds the model's times for the probe's own tactic steps next to the measured ones."""
  tail, fit, con = details.get("tail"), details.get("cpu_tail"), details.get("contention")
  if not isinstance(tail, Mapping):
    return
  for r in fit.get("rows", []) if isinstance(fit, Mapping) else []:
    r["tactic_modeled_s"] = planner.cpu_time(tail["window_bytes"], r["bytes"], prof)
  if isinstance(con, Mapping):
    con["hybrid_modeled_s"] = planner.hybrid_time_at(
        tail["window_bytes"], con["tile_bytes"], con["tiles"], con["cpu_tiles"], prof)


# ----------------------------------------------------------------------------------------------
# The whole probe
# ----------------------------------------------------------------------------------------------
def _transfer_figures(h2d: list[dict]) -> tuple[float, float | None, dict]:
  """``(pcie_gbps, transfer_overhead_us, fit details)`` from the host→device rows: the fitted
  line with two sizes or more, else the largest size's rate and no overhead."""
  largest = max(h2d, key=lambda r: r["bytes"])
  if len({r["bytes"] for r in h2d}) < 2:
    return largest["gbps"], None, dict(how="one size: its rate, no fixed cost")
  overhead, rate, how = fit_cost([r["bytes"] for r in h2d], [r["median_s"] for r in h2d])
  return rate / GB, overhead * 1e6, dict(how=how, gbps=rate / GB, overhead_us=overhead * 1e6,
                                         largest_gbps=largest["gbps"])


def run_probe(cfg: ProbeConfig = ProbeConfig()) -> Profile:
  """Measures every figure (see the module docstring) and returns the :class:`Profile`."""
  details: dict[str, Any] = dict(environment=benchmarking.environment(),
                                 config=_jsonable(dataclasses.asdict(cfg)))
  h2d, d2h = [], []
  for mib in cfg.transfer_mib:
    nbytes = int(float(mib) * MIB)
    h2d.append(measure_transfer(nbytes, "h2d", warmup=cfg.warmup, repeats=cfg.repeats))
    d2h.append(measure_transfer(nbytes, "d2h", warmup=cfg.warmup, repeats=cfg.repeats))
  details["h2d"], details["d2h"] = h2d, d2h
  pcie_gbps, transfer_overhead_us, details["h2d_fit"] = _transfer_figures(h2d)
  latency_us = measure_copy_latency_us(int(cfg.latency_kib * 1024), warmup=cfg.warmup,
                                       repeats=cfg.repeats)
  attn = measure_device_attention(cfg.attn_kv_lens, batch=cfg.batch, num_heads=cfg.num_heads,
                                  num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                  dtype=cfg.dtype, impl=cfg.impl, warmup=cfg.warmup,
                                  repeats=cfg.repeats)
  details["attention"] = attn
  cpu = measure_cpu(cfg)
  details.update(cpu["details"])
  tail_figures = dict.fromkeys(("cpu_overhead_us", "hybrid_pcie_gbps", "hybrid_cpu_gbps",
                                "share_overhead_us"))
  if not cfg.cpu:
    details.update(dict.fromkeys(tail_figures, "skipped (cpu=False)"),
                   host_share="skipped (cpu=False)")
  else:
    try:
      tail = measure_tail(cfg, pcie=((transfer_overhead_us or 0.0) * 1e-6, pcie_gbps * GB))
    except Exception as e:  # keep the other figures; the kernel-alone rate stays the CPU figure
      reason = f"tail path failed: {type(e).__name__}: {e}"[:500]
      details.update(dict.fromkeys(tail_figures, reason), host_share=reason)
    else:
      details.update(tail.pop("details"))
      details["cpu_kernel_numpy_gbps"] = cpu["cpu_attn_gbps"]
      cpu["cpu_attn_gbps"] = tail.pop("cpu_attn_gbps")
      tail_figures.update(tail)
  dev = jax.devices()[0]
  prof = Profile(pcie_gbps=pcie_gbps, transfer_overhead_us=transfer_overhead_us,
                 d2h_gbps=max(d2h, key=lambda r: r["bytes"])["gbps"],
                 hbm_gbps=attn["hbm_gbps"], attn_overhead_us=attn["attn_overhead_us"],
                 cpu_attn_gbps=cpu["cpu_attn_gbps"], host_read_gbps=cpu["host_read_gbps"],
                 cpu_int8_share=cpu["cpu_int8_share"],
                 copy_latency_us=latency_us, overlap=1.0, device=dev.device_kind,
                 source=f"rkv.probe on {jax.default_backend()} ({dev.device_kind})",
                 details=details, **tail_figures)
  overrides = {k: v for k, v in dict(cfg.overrides).items() if v is not None}
  if overrides:
    details["overridden"] = {k: dict(measured=getattr(prof, k), used=v)
                             for k, v in overrides.items()}
    prof = prof.replace(**overrides)
  _self_check(prof, details)
  return prof


def format_checks(prof: Profile) -> str:
  """The probe's own tactic steps, measured next to the model's time (from ``details``)."""
  ms = lambda x: "-" if x is None else f"{x * 1e3:.3f} ms"
  d, lines = prof.details, []
  fit = d.get("cpu_tail")
  for r in fit.get("rows", []) if isinstance(fit, Mapping) else []:
    lines.append(f"cpu tactic, {r['tiles']} tiles ({r['bytes'] / MIB:.0f} MiB): step "
                 f"{ms(r['tactic_s'])} (branch {ms(r['branch_s'])}), modeled "
                 f"{ms(r.get('tactic_modeled_s'))}")
  con = d.get("contention")
  if isinstance(con, Mapping):
    lines.append(f"hybrid, {con['cpu_tiles']}/{con['tiles']} tiles on the CPU: step "
                 f"{ms(con['hybrid_step_s'])}, modeled {ms(con.get('hybrid_modeled_s'))}; "
                 f"stream side {ms(con['stream_s'])} (alone {ms(con['stream_alone_s'])}), "
                 f"CPU side {ms(con['cpu_s'])} (alone {ms(con['cpu_alone_s'])})")
  share = d.get("host_share")
  if isinstance(share, Mapping):
    # Next to the cpu tactic's rows: the share's fixed cost is what a plan made with
    # $RKV_HOST_SHARE=1 puts in place of the worker path's (Profile.for_host_share).
    rows = share.get("rows", [])
    lines.append(f"host share, {'/'.join(str(r['tiles']) for r in rows)} tiles: call "
                 f"{' / '.join(ms(r['call_s']) for r in rows)}; fit "
                 f"{share['share_overhead_us']:.4g} us + {share['share_cpu_gbps']:.4g} GB/s "
                 f"({share['fit']})")
  elif isinstance(share, str) and not share.startswith("skipped"):
    lines.append(f"host share: not measured ({share})")
  return "\n".join(lines)
