"""Probes: measure the figures of the performance model on this machine → a :class:`Profile`.

What is measured (each figure can be overridden; ``experiments/probe.py`` is the script):
- ``pcie_gbps`` / ``d2h_gbps``: ``jax.device_put`` between the ``pinned_host`` and ``device``
  memory kinds, median after warm-up, at each size of ``transfer_mib`` (the largest size's rate
  is the profile's; DESIGN.md §5: 52.4 GB/s at 1 GiB, 37.8 at 64 MiB on the H200).
- ``copy_latency_us``: median of a small (``latency_kib``) host→device ``device_put``.
- ``hbm_gbps`` / ``attn_overhead_us``: ``rkv.attention`` (``impl``, default auto) on a decode
  shape (T=1) at each of ``attn_kv_lens``, jitted, timed with :func:`rkv.benchmarking.time_fn`;
  a least-squares line ``time = overhead + bytes / rate`` through the points.
- ``cpu_attn_gbps`` / ``host_read_gbps``: ``rkv.offload.cpu_attention.measure_cpu_attention``
  and ``measure_host_read_bandwidth`` when that module exists (imported lazily; else ``None``
  with the reason in ``details``). Contract used: keyword arguments among ``kv_len, batch,
  num_kv_heads, head_dim, group, dtype, repeats, tile_cells`` (attention) and ``nbytes,
  repeats`` (host read) — only those their signature names are passed — returning bytes/s as a
  number (their documented result), or a mapping / object with a ``bytes_per_s`` or ``gbps``
  entry.

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
from rkv.offload import memory
from rkv.residency import GB, MIB, H200_DEFAULT, Profile, default_profile_path

__all__ = ["ProbeConfig", "Profile", "H200_DEFAULT", "default_profile_path", "fit_line",
           "measure_copy_latency_us", "measure_cpu", "measure_device_attention",
           "measure_transfer", "run_probe"]

CPU_ATTENTION_MODULE = "rkv.offload.cpu_attention"


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
  """What :func:`run_probe` measures. Sizes in MiB / KiB / cells; ``overrides``: figure → value
  replacing the measured one (a ``None`` value is ignored)."""

  transfer_mib: tuple[float, ...] = (64, 1024)
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
  """``{cpu_attn_gbps, host_read_gbps, details}`` from :data:`CPU_ATTENTION_MODULE` if present;
  a missing module or function gives ``None`` with the reason."""
  out: dict[str, Any] = dict(cpu_attn_gbps=None, host_read_gbps=None, details={})
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
  attn_kw = dict(kv_len=cfg.cpu_kv_len, batch=cfg.batch, num_kv_heads=cfg.num_kv_heads,
                 head_dim=cfg.head_dim, group=cfg.num_heads // cfg.num_kv_heads,
                 num_heads=cfg.num_heads, dtype=cfg.dtype, repeats=cfg.repeats,
                 warmup=cfg.warmup, tile_cells=tile)
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
  return out


# ----------------------------------------------------------------------------------------------
# The whole probe
# ----------------------------------------------------------------------------------------------
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
  latency_us = measure_copy_latency_us(int(cfg.latency_kib * 1024), warmup=cfg.warmup,
                                       repeats=cfg.repeats)
  attn = measure_device_attention(cfg.attn_kv_lens, batch=cfg.batch, num_heads=cfg.num_heads,
                                  num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                  dtype=cfg.dtype, impl=cfg.impl, warmup=cfg.warmup,
                                  repeats=cfg.repeats)
  details["attention"] = attn
  cpu = measure_cpu(cfg)
  details.update(cpu["details"])
  largest = max(range(len(h2d)), key=lambda i: h2d[i]["bytes"])
  dev = jax.devices()[0]
  prof = Profile(pcie_gbps=h2d[largest]["gbps"], d2h_gbps=d2h[largest]["gbps"],
                 hbm_gbps=attn["hbm_gbps"], attn_overhead_us=attn["attn_overhead_us"],
                 cpu_attn_gbps=cpu["cpu_attn_gbps"], host_read_gbps=cpu["host_read_gbps"],
                 copy_latency_us=latency_us, overlap=1.0, device=dev.device_kind,
                 source=f"rkv.probe on {jax.default_backend()} ({dev.device_kind})",
                 details=details)
  overrides = {k: v for k, v in dict(cfg.overrides).items() if v is not None}
  if overrides:
    details["overridden"] = {k: dict(measured=getattr(prof, k), used=v)
                             for k, v in overrides.items()}
    prof = prof.replace(**overrides)
  return prof
