"""The performance model (docs/DESIGN.md §6): pure functions of bytes and a :class:`Profile` giving
each tactic's modeled step time for one layer, the hybrid split, and the selector.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from rkv import tactics
from rkv.planner.profile import GB, Profile

# Per-layer tactics (the table's columns, in this order) and the selector's candidates in tie
# order: rkv.tactics.
TACTICS = tactics.TACTICS
OFFLOAD_TACTICS = tactics.SELECTOR_ORDER


def combine(a: float, b: float, overlap: float = 1.0) -> float:
  """Two concurrent parts: ``max(a, b) + (1 - overlap) * min(a, b)`` (overlap 1: a max)."""
  return max(a, b) + (1.0 - overlap) * min(a, b)


def device_time(nbytes: float, profile: Profile) -> float:
  """Seconds of device attention over ``nbytes`` of K/V: ``overhead + bytes / HBM``."""
  if nbytes <= 0:
    return 0.0
  return profile.attn_overhead_us * 1e-6 + nbytes / (profile.hbm_gbps * GB)


def cpu_rate(profile: Profile) -> float | None:
  """Bytes/s of host-CPU attention: ``min(cpu_attn, host_read)``; None if unmeasured."""
  if profile.cpu_attn_gbps is None:
    return None
  rate = profile.cpu_attn_gbps
  if profile.host_read_gbps is not None:
    rate = min(rate, profile.host_read_gbps)
  return rate * GB


def partial_copy_time(profile: Profile, *, batch: int, num_heads: int, head_dim: int,
                      query_len: int = 1, q_itemsize: int = 2) -> float:
  """Seconds to send the query to the host and the CPU's partial back, per layer and step.

  ``q [B,T,H,D]`` device→host, ``o`` (float32) and ``lse`` ``[B,T,H]`` host→device, plus one
  copy latency each way.
  """
  q_bytes = batch * query_len * num_heads * head_dim * q_itemsize
  out_bytes = batch * query_len * num_heads * (head_dim + 1) * 4
  return (2 * profile.copy_latency_us * 1e-6 + q_bytes / (profile.d2h_gbps * GB)
          + out_bytes / (profile.pcie_gbps * GB))


def resident_time(nbytes: float, profile: Profile) -> float:
  """Resident: ``Bw / HBM`` (+ the call overhead)."""
  return device_time(nbytes, profile)


def transfer_time(nbytes: float, profile: Profile, rate_gbps: float | None = None) -> float:
  """Seconds to stream ``nbytes`` of tail tiles host→device in one call: ``transfer_overhead +
  bytes / PCIe`` (``rate_gbps`` replaces PCIe, e.g. the hybrid's contended rate).

  One fixed cost per call, not per tile: the stream schedule keeps ``lookahead`` transfers queued,
  so every put's fixed cost after the first hides behind the transfers ahead of it (on the H200
  a 25-tile stream took the one-put fit's time within 1%). No bytes, no cost."""
  if nbytes <= 0:
    return 0.0
  overhead = profile.transfer_overhead_us or 0.0
  return overhead * 1e-6 + nbytes / ((rate_gbps or profile.pcie_gbps) * GB)


def cpu_tail_time(nbytes: float, profile: Profile, rate: float | None = None) -> float | None:
  """Seconds of the CPU branch of the cpu / hybrid tactics over ``nbytes`` of tail:
  ``cpu_overhead + bytes / CPU`` (``rate`` in bytes/s replaces :func:`cpu_rate`); None without a
  CPU figure. No bytes, no cost (the branch does not run)."""
  rate = cpu_rate(profile) if rate is None else rate
  if rate is None:
    return None
  if nbytes <= 0:
    return 0.0
  return (profile.cpu_overhead_us or 0.0) * 1e-6 + nbytes / rate


def _cpu_copy_s(profile: Profile, partial_copy_s: float) -> float:
  # A measured cpu_overhead was taken through the path that copies q down and the partial up:
  # adding the modeled copy again would count it twice.
  return partial_copy_s if profile.cpu_overhead_us is None else 0.0


def stream_time(window_bytes: float, tail_bytes: float, profile: Profile) -> float:
  """Streamed tail: ``max(Bw / HBM, transfer_overhead + Bt / PCIe)``."""
  return combine(device_time(window_bytes, profile), transfer_time(tail_bytes, profile),
                 profile.overlap)


def cpu_time(window_bytes: float, tail_bytes: float, profile: Profile,
             partial_copy_s: float = 0.0) -> float | None:
  """CPU tail: ``max(Bw / HBM, cpu_overhead + Bt / CPU_attn)``, plus ``partial_copy_s`` when the
  profile has no ``cpu_overhead_us`` (a measured overhead already holds the copies); None without
  a CPU figure."""
  tail_s = cpu_tail_time(tail_bytes, profile)
  if tail_s is None:
    return None
  return (combine(device_time(window_bytes, profile), tail_s, profile.overlap)
          + _cpu_copy_s(profile, partial_copy_s))


def hybrid_rates(profile: Profile, contended: bool = True) -> tuple[float, float] | None:
  """``(PCIe GB/s, CPU bytes/s)`` of a hybrid's two sides: while both run (``contended``) the
  profile's ``hybrid_pcie_gbps`` / ``hybrid_cpu_gbps`` where measured, else (and for a side
  running alone) the solo rates. None without a CPU figure."""
  crate = cpu_rate(profile)
  if crate is None:
    return None
  prate = profile.pcie_gbps
  if contended and profile.hybrid_pcie_gbps is not None:
    prate = profile.hybrid_pcie_gbps
  if contended and profile.hybrid_cpu_gbps is not None:
    crate = profile.hybrid_cpu_gbps * GB
  return prate, crate


def hybrid_tail_time(stream_bytes: float, cpu_bytes: float, profile: Profile) -> float | None:
  """Seconds of a hybrid's tail part, ``stream_bytes`` streamed while the CPU attends
  ``cpu_bytes``: the slower side (:func:`transfer_time`, :func:`cpu_tail_time`; contended rates
  when both sides run). Without measured contended rates, at least all the bytes over
  ``host_read`` (the DMA and the CPU read the same host memory); with them, the contention is
  in the rates and no floor applies: on the H200 host the two sides together read 3.2 GB in
  27.2 ms (119 GB/s) where plain reads on 15 threads measured 90.7 GB/s
  (tactics_bench_h200_run4.json, 1M, 25%). None without a CPU figure."""
  both = stream_bytes > 0 and cpu_bytes > 0
  rates = hybrid_rates(profile, contended=both)
  if rates is None:
    return None
  prate, crate = rates
  measured = profile.hybrid_pcie_gbps is not None and profile.hybrid_cpu_gbps is not None
  floor_s = (0.0 if profile.host_read_gbps is None or (both and measured)
             else (stream_bytes + cpu_bytes) / (profile.host_read_gbps * GB))
  return max(transfer_time(stream_bytes, profile, prate), cpu_tail_time(cpu_bytes, profile, crate),
             floor_s)


def _balanced_fraction(tail_bytes: float, profile: Profile) -> float:
  """The streamed share ``f`` at which both sides finish together under contention:
  ``xo + f Bt / P = co + (1 - f) Bt / C`` (``xo``, ``co`` the fixed costs; without them
  ``f = P / (P + C)``), clipped to [0, 1]."""
  prate, crate = hybrid_rates(profile)
  p_s, c_s = tail_bytes / (prate * GB), tail_bytes / crate
  xo = (profile.transfer_overhead_us or 0.0) * 1e-6
  co = (profile.cpu_overhead_us or 0.0) * 1e-6
  return min(1.0, max(0.0, (c_s + co - xo) / (p_s + c_s)))


def hybrid_split(tail_bytes: float, profile: Profile,
                 tile_bytes: float | None = None) -> tuple[float, float] | None:
  """``(fraction of the tail streamed, seconds of the tail part)`` with both sides finishing
  together under contention (:func:`_balanced_fraction`; without fixed costs or contended rates
  ``f = PCIe / (PCIe + CPU)`` and the time ``Bt / (PCIe + CPU)``, at least ``Bt / host_read``).
  With ``tile_bytes`` the split is in whole tiles (the tail is stored in tiles): the better of
  rounding ``f * n`` down or up, timed by :func:`hybrid_tail_time`. None without a CPU figure."""
  if cpu_rate(profile) is None:
    return None
  if tail_bytes <= 0:
    return 1.0, 0.0
  f = _balanced_fraction(tail_bytes, profile)
  if tile_bytes is None or tile_bytes <= 0:
    return f, hybrid_tail_time(f * tail_bytes, (1.0 - f) * tail_bytes, profile)
  n = max(1, round(tail_bytes / tile_bytes))
  best = None
  for n_gpu in sorted({min(n, max(0, math.floor(f * n))), min(n, max(0, math.ceil(f * n)))}):
    t = hybrid_tail_time(n_gpu * tile_bytes, (n - n_gpu) * tile_bytes, profile)
    if best is None or t < best[1]:
      best = (n_gpu / n, t)
  return best


def cpu_share(streamed_fraction: float | None) -> float | None:
  """The share of a hybrid tail attended on the CPU, ``1 - streamed_fraction`` (what the caches and
  ``rkv.rolling_attention(cpu_fraction=...)`` take; the model splits by the streamed share).

  Rounded: 1 - (1 - 0.1) is 0.09999999999999998, and rolling_attention's half-up rounding of the
  tile count would then flip at exact halves (0.1 * 5 tiles + 0.5 = 1.0 must give 1 CPU tile)."""
  if streamed_fraction is None:
    return None
  return min(1.0, max(0.0, round(1.0 - float(streamed_fraction), 12)))


def hybrid_time(window_bytes: float, tail_bytes: float, profile: Profile,
                partial_copy_s: float = 0.0,
                tile_bytes: float | None = None) -> tuple[float | None, float | None]:
  """Hybrid: ``max(Bw / HBM, tail part of hybrid_split)`` (without fixed costs or contended
  rates the tail part is ``Bt / (PCIe + CPU)``), plus ``partial_copy_s`` when the profile has no
  ``cpu_overhead_us``; returns ``(seconds, fraction streamed)``, ``(None, None)`` without a CPU
  figure."""
  split = hybrid_split(tail_bytes, profile, tile_bytes)
  if split is None:
    return None, None
  f, tail_s = split
  return (combine(device_time(window_bytes, profile), tail_s, profile.overlap)
          + _cpu_copy_s(profile, partial_copy_s), f)


def hybrid_time_at(window_bytes: float, tile_bytes: float, n_tiles: int, n_cpu: int,
                   profile: Profile, partial_copy_s: float = 0.0) -> float | None:
  """The modeled step of a hybrid with ``n_cpu`` of ``n_tiles`` tiles on the CPU and the others
  streamed (a fixed split, e.g. one the benchmark measures): ``n_cpu == 0`` is the stream
  tactic, ``n_cpu == n_tiles`` the cpu tactic; in between ``max(Bw / HBM, hybrid_tail_time)`` +
  the copy as in :func:`hybrid_time`. None without a CPU figure (unless nothing is on the CPU)."""
  if n_cpu <= 0:
    return stream_time(window_bytes, n_tiles * tile_bytes, profile)
  if n_cpu >= n_tiles:
    return cpu_time(window_bytes, n_tiles * tile_bytes, profile, partial_copy_s)
  tail_s = hybrid_tail_time((n_tiles - n_cpu) * tile_bytes, n_cpu * tile_bytes, profile)
  if tail_s is None:
    return None
  return (combine(device_time(window_bytes, profile), tail_s, profile.overlap)
          + _cpu_copy_s(profile, partial_copy_s))


def head_time(resident_bytes: float, streamed_bytes: float, profile: Profile) -> float:
  """Head split: ``max(resident heads' bytes / HBM, transfer_overhead + streamed bytes / PCIe)``.
  Its tiles carry only the rolled heads; the planner sizes them by bytes like the stream
  tactic's (:func:`best_layout`), so there are as few puts and one fixed cost per call is what
  is modeled (:func:`transfer_time`): the head rows of tactics_bench_h200_run6.json ran 1.00-1.11x
  this model (46 MB tiles, before the byte sizing, had run 1.35x)."""
  return stream_time(resident_bytes, streamed_bytes, profile)


@dataclasses.dataclass(frozen=True)
class ModeledTimes:
  """Modeled seconds per decode step of one layer under each tactic (None: not applicable)."""

  resident: float | None = None
  stream: float | None = None
  cpu: float | None = None
  hybrid: float | None = None
  head: float | None = None
  hybrid_fraction: float | None = None  # share of the tail streamed by "hybrid"

  def as_dict(self) -> dict[str, float | None]:
    return {t: getattr(self, t) for t in TACTICS}


def modeled_times(window_bytes: float, tail_bytes: float, profile: Profile, *,
                  partial_copy_s: float = 0.0, tile_bytes: float | None = None,
                  head_bytes: tuple[float, float] | None = None) -> ModeledTimes:
  """Every tactic's modeled step time for a layer with ``Bw = window_bytes`` on the device and
  ``Bt = tail_bytes`` on the host (docs/DESIGN.md §6). ``resident`` is the time with all
  ``Bw + Bt`` on the device (the ideal). ``head_bytes = (resident heads' bytes, streamed heads'
  bytes)`` of the head layout (None: not modeled)."""
  hyb, frac = hybrid_time(window_bytes, tail_bytes, profile, partial_copy_s, tile_bytes)
  return ModeledTimes(
      resident=resident_time(window_bytes + tail_bytes, profile),
      stream=stream_time(window_bytes, tail_bytes, profile),
      cpu=cpu_time(window_bytes, tail_bytes, profile, partial_copy_s),
      hybrid=hyb, hybrid_fraction=frac,
      head=None if head_bytes is None else head_time(*head_bytes, profile))


def select(times: Mapping[str, float | None], candidates=OFFLOAD_TACTICS) -> str:
  """The candidate with the lowest modeled time; ties (within 1e-9 relative) go to the earlier
  candidate (stream, head, cpu, hybrid: simplest first — a hybrid that rounds to 0 or all tiles
  streamed is just cpu or stream plus a copy)."""
  best, best_t = None, math.inf
  for tactic in candidates:
    t = times.get(tactic)
    if t is not None and t < best_t * (1 - 1e-9):
      best, best_t = tactic, t
  if best is None:
    raise ValueError(f"select: no tactic among {tuple(candidates)} has a modeled time: {times}")
  return best
