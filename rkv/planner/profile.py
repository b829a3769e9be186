"""The planner's measured figures: :class:`Profile` (what ``rkv.probe`` writes and the performance
model reads), the built-in :data:`H200_DEFAULT`, units, and the small number checks the planner's
configs share.

Bytes are bytes; GB/s means 1e9 bytes per second; MiB is 2**20 bytes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping

import numpy as np

from rkv import atomic_io

MIB = 1 << 20
GB = 1e9

PROFILE_FORMAT = "rkv.Profile"
# Version 2 added the optional figures transfer_overhead_us, cpu_overhead_us, hybrid_pcie_gbps
# and hybrid_cpu_gbps, version 3 cpu_int8_share, version 4 share_overhead_us; an older profile
# still loads (they are None: the model's fallbacks).
PROFILE_VERSION = 4
READABLE_PROFILE_VERSIONS = (1, 2, 3, 4)

# The CPU tail kernel's rate over int8 K/V as a share of its bf16 rate (bytes/s), for a profile
# that did not measure it (cpu_int8_share None). The kernel's cost is per cell, not per byte: the
# same FMAs and softmax whatever the dtype (int8 sign-extends where bf16 shifts), and an int8
# cell-head is 2 * 128 + 8 bytes against bf16's 2 * 256. On the dev box (one thread, tiles in
# cache and out) both ran at 2.25-2.28 M cells/s, so int8 read 0.52 of bf16's bytes/s. With
# bf16's bytes/s the 2M int8 default plan put 3 of a layer's 6 tail tiles on the CPU; with the
# measured share (and with this fallback) it puts 2.
INT8_CPU_SHARE_FALLBACK = 264 / 512


def default_profile_path() -> str:
  """``~/.cache/rkv/profile.json``: where ``experiments/probe.py`` writes by default."""
  return os.path.join(os.path.expanduser("~"), ".cache", "rkv", "profile.json")


def is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def is_num(x) -> bool:
  return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def check_positive(where: str, name: str, value, *, allow_none: bool = True, allow_zero=False):
  if value is None and allow_none:
    return
  ok = is_num(value) and math.isfinite(float(value)) and (
      float(value) >= 0 if allow_zero else float(value) > 0)
  if not ok:
    want = "a number >= 0" if allow_zero else "a positive number"
    raise ValueError(f"{where}: {name} must be {want}{' or None' if allow_none else ''}, "
                     f"got {value!r}")


FIGURES = ("pcie_gbps", "d2h_gbps", "hbm_gbps", "attn_overhead_us", "cpu_attn_gbps",
           "host_read_gbps", "copy_latency_us", "overlap", "transfer_overhead_us",
           "cpu_overhead_us", "hybrid_pcie_gbps", "hybrid_cpu_gbps", "cpu_int8_share",
           "share_overhead_us")
OPTIONAL_RATES = ("cpu_attn_gbps", "host_read_gbps", "hybrid_pcie_gbps", "hybrid_cpu_gbps",
                  "cpu_int8_share")
OPTIONAL_OVERHEADS = ("transfer_overhead_us", "cpu_overhead_us", "share_overhead_us")


@dataclasses.dataclass(frozen=True)
class Profile:
  """Measured figures of one machine (GB/s = 1e9 B/s). ``None``: not measured (a tactic that
  needs it is not modeled, or the model falls back to a simpler formula: see each figure).

  ``pcie_gbps``: host→device rate of the tail (pinned_host → device): with
  ``transfer_overhead_us`` the slope of ``time = overhead + bytes / rate`` fitted over
  ``device_put`` sizes, else the rate of the largest put. ``transfer_overhead_us``: the fixed cost
  of one ``device_put`` (that fit's intercept); a streamed tail pays it once per call (None: 0).
  ``d2h_gbps``: device→host. ``hbm_gbps``: the device attention's K/V read rate;
  ``attn_overhead_us``: its fixed cost per call (decode time ≈ overhead + bytes / hbm).
  ``cpu_attn_gbps``: host-CPU attention over a host tail, K/V bytes read per second; with
  ``cpu_overhead_us`` the slope of ``time = overhead + bytes / rate`` fitted over tail sizes
  through the cpu tactic's own path (kernel over pinned_host tiles in its worker thread, the
  query's copy down and the partial's copy up). ``cpu_overhead_us``: that fit's intercept; it
  includes the partial copies, so the model then adds no separate partial copy (None: the model
  adds :func:`partial_copy_time` instead). ``hybrid_pcie_gbps`` / ``hybrid_cpu_gbps``: each
  side's rate while the DMA stream and the CPU kernel run at the same time on disjoint tiles
  (they share host memory bandwidth and the cores; None: the side's solo rate).
  ``cpu_int8_share``: the CPU kernel's bytes/s over int8 K/V (with their scales) as a share of
  its bf16 bytes/s, both measured by the kernel alone (None: :data:`INT8_CPU_SHARE_FALLBACK`);
  :meth:`for_kv_dtype` applies it to the CPU figures of an int8 cache.
  ``share_overhead_us``: the fixed cost of one call of a CPU share run by
  rkv.offload.host_share's C++ thread (its start and wait programs, the kernel between): the
  intercept of ``time = overhead + bytes / rate`` fitted over the probe's tail sizes (None: not
  measured; :meth:`for_host_share` then estimates it).
  ``host_read_gbps``: host memory read bandwidth (caps CPU attention, and CPU attention plus the
  DMA reads of a hybrid split when the contended rates are not measured). ``copy_latency_us``:
  fixed cost of one small host↔device copy (the query out, the CPU partial back). ``overlap``: share of the shorter of (device compute,
  tail) hidden under the longer: 1 = perfect overlap (docs/DESIGN.md §6, a max), 0 = a sum.
  ``details``: raw measurements and the reason for each ``None``.
  """

  pcie_gbps: float
  d2h_gbps: float
  hbm_gbps: float
  attn_overhead_us: float = 0.0
  cpu_attn_gbps: float | None = None
  host_read_gbps: float | None = None
  copy_latency_us: float = 0.0
  overlap: float = 1.0
  transfer_overhead_us: float | None = None
  cpu_overhead_us: float | None = None
  hybrid_pcie_gbps: float | None = None
  hybrid_cpu_gbps: float | None = None
  cpu_int8_share: float | None = None
  share_overhead_us: float | None = None
  device: str = ""
  source: str = ""
  # Not part of equality or the hash: a config holding a profile stays hashable.
  details: dict = dataclasses.field(default_factory=dict, compare=False)

  def __post_init__(self):
    for name in ("pcie_gbps", "d2h_gbps", "hbm_gbps"):
      check_positive("Profile", name, getattr(self, name), allow_none=False)
    for name in OPTIONAL_RATES:
      check_positive("Profile", name, getattr(self, name))
    for name in ("attn_overhead_us", "copy_latency_us"):
      check_positive("Profile", name, getattr(self, name), allow_none=False, allow_zero=True)
    for name in OPTIONAL_OVERHEADS:
      check_positive("Profile", name, getattr(self, name), allow_zero=True)
    if not is_num(self.overlap) or not 0.0 <= float(self.overlap) <= 1.0:
      raise ValueError(f"Profile: overlap must be in [0, 1], got {self.overlap!r}")

  def figures(self) -> dict[str, float | None]:
    return {name: getattr(self, name) for name in FIGURES}

  def replace(self, **overrides) -> "Profile":
    """A copy with the non-None ``overrides`` (figure name → value) applied."""
    unknown = set(overrides) - set(FIGURES) - {"device", "source"}
    if unknown:
      raise ValueError(f"Profile.replace: unknown figures {sorted(unknown)}; known: {FIGURES}")
    kw = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(self, **kw) if kw else self

  def for_kv_dtype(self, kv_dtype) -> "Profile":
    """The figures a cache of ``kv_dtype`` sees: for ``int8`` the CPU kernel's rates, solo and
    contended, times ``cpu_int8_share`` (else :data:`INT8_CPU_SHARE_FALLBACK`); PCIe and HBM move
    bytes whatever they hold, so every other figure, and every other dtype, is unchanged."""
    name = kv_dtype if isinstance(kv_dtype, str) else np.dtype(kv_dtype).name
    if name != "int8" or self.cpu_attn_gbps is None:
      return self
    share = INT8_CPU_SHARE_FALLBACK if self.cpu_int8_share is None else self.cpu_int8_share
    scaled = lambda x: None if x is None else x * share
    return dataclasses.replace(self, cpu_attn_gbps=scaled(self.cpu_attn_gbps),
                               hybrid_cpu_gbps=scaled(self.hybrid_cpu_gbps))

  def for_host_share(self) -> "Profile":
    """The figures of a CPU share run by rkv.offload.host_share's C++ thread (``$RKV_HOST_SHARE``):
    ``cpu_overhead_us`` becomes the share's own fixed cost a call, where the probe fitted it
    through the Python worker's path (its start, the query's copy through PJRT's threads, its
    setup and the join's wait: 2188 us on the H200). That cost is ``share_overhead_us`` where the
    probe measured it (the share's start and wait programs timed over the probe's tail), else an
    estimate, two small stream-ordered copies, ``2 x copy_latency_us`` (the query down, the
    partial up). Used only when asked for (``ResidencyConfig.host_share``): what the estimate
    planned was the fastest split on H100s (sessions 23-24: 1M int8 8.13 tok/s at 3 of 7 CPU
    tiles against 6.63 at the worker's 2) and slower on the H200 (128K half 6.85 at 2 of 3
    against 7.87 at 1; docs/DESIGN.md §6), hence the probed figure. Either way it never raises
    the fixed cost above ``cpu_overhead_us``, and leaves a profile without a ``cpu_overhead_us``
    unchanged (the model then adds the partial's copy itself). The CPU rate stays the profile's
    (the same kernel)."""
    if self.cpu_overhead_us is None:
      return self
    share_us = (2.0 * self.copy_latency_us if self.share_overhead_us is None
                else self.share_overhead_us)
    return dataclasses.replace(self, cpu_overhead_us=min(self.cpu_overhead_us, share_us))

  def describe(self) -> str:
    f = lambda x, unit, fmt="{:.4g}": "-" if x is None else fmt.format(x) + unit
    plus = lambda x, what: "" if x is None else f" + {x:.4g} us/{what}"
    text = (f"PCIe {f(self.pcie_gbps, ' GB/s')}{plus(self.transfer_overhead_us, 'stream')} "
            f"(d2h {f(self.d2h_gbps, ' GB/s')}), "
            f"HBM {f(self.hbm_gbps, ' GB/s')} + {f(self.attn_overhead_us, ' us')}/call, "
            f"CPU attn {f(self.cpu_attn_gbps, ' GB/s')}{plus(self.cpu_overhead_us, 'call')}, ")
    if self.share_overhead_us is not None:
      text += f"host share {self.share_overhead_us:.4g} us/call, "
    if self.hybrid_pcie_gbps is not None or self.hybrid_cpu_gbps is not None:
      text += (f"hybrid (contended) PCIe {f(self.hybrid_pcie_gbps, ' GB/s')} CPU "
               f"{f(self.hybrid_cpu_gbps, ' GB/s')}, ")
    if self.cpu_int8_share is not None:
      text += f"CPU int8 at {self.cpu_int8_share:.3g} of bf16's bytes/s, "
    return text + (f"host read {f(self.host_read_gbps, ' GB/s')}, "
                   f"copy latency {f(self.copy_latency_us, ' us')}, overlap {self.overlap:g}")

  def to_json(self) -> dict:
    return dict(format=PROFILE_FORMAT, version=PROFILE_VERSION, **dataclasses.asdict(self))

  @classmethod
  def from_json(cls, data: Mapping, where: str = "Profile.from_json") -> "Profile":
    if not isinstance(data, Mapping) or data.get("format") != PROFILE_FORMAT:
      raise ValueError(f"{where}: not an {PROFILE_FORMAT} document (format="
                       f"{data.get('format') if isinstance(data, Mapping) else None!r})")
    if data.get("version") not in READABLE_PROFILE_VERSIONS:
      raise ValueError(f"{where}: profile version {data.get('version')!r}, this rkv reads "
                       f"versions {READABLE_PROFILE_VERSIONS}")
    names = {f.name for f in dataclasses.fields(cls)}
    missing = [n for n in ("pcie_gbps", "d2h_gbps", "hbm_gbps") if n not in data]
    if missing:
      raise ValueError(f"{where}: profile lacks {missing}")
    return cls(**{k: v for k, v in data.items() if k in names})

  def save(self, path: str) -> str:
    """Writes the profile as JSON (atomically); returns the path."""
    path = os.path.expanduser(path)
    with atomic_io.write_file_atomically(path) as f:
      json.dump(self.to_json(), f, indent=1, default=str)
      f.write("\n")
    return path

  @classmethod
  def load(cls, path: str) -> "Profile":
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
      raise ValueError(f"Profile.load: profile_path {path!r} does not exist (write one with "
                       f"experiments/probe.py)")
    try:
      with open(path) as f:
        data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f"Profile.load: {path} is not valid JSON: {e}") from e
    return cls.from_json(data, where=f"Profile.load({path})")


# The H200 of docs/DESIGN.md §7 (jax 0.11.2, bf16, PCIe Gen5 x16, 16-core host): the figures rkv.probe
# measured there with the current CPU kernel (benchmarks/results/profile_h200_v3.json, probed in
# tactics_bench_h200_run6.json, whose every tactic ran within 0.87-1.11x of this model), rounded.
# Machines of the kind differ run to run (host read 79.6-97.1 GB/s across five runs): run
# experiments/probe.py on yours. The first probe's figures (format 1, before the fixed costs and
# the register-blocked kernel) are in benchmarks/results/profile_h200.json. The CPU figures were
# probed with the kernel's 256-bit build. Its 512-bit path (built on AVX-512 hosts since session 6)
# read bf16 at 95.1 GB/s against 69.6, and int8 at 71.1 against 42.3 (0.75 of bf16), on the H200
# host in one run (benchmarks/results/beyond_hbm/session6/e/). Probed with it in session 7
# (profile_h200_v6.json: cpu path 80.8 GB/s + 2356 us a call, hybrid CPU 74.1, int8 share 0.747):
# the call's fixed cost, not the kernel's rate, dominates a layer's share, and the 1M default plan
# is the same under both profiles and ran no faster on v6 (docs/DESIGN.md §7), so these stay.
H200_DEFAULT = Profile(
    # pinned_host <-> device device_put over 64 MiB .. 1 GiB: 54.30 GB/s + 787 us a call (one
    # fixed cost per streamed call, not per tile); device -> host 52.52 GB/s.
    pcie_gbps=54.30, d2h_gbps=52.52, transfer_overhead_us=787.4,
    # Decode attention fit (rkv.attention, B=1 H=32 K=8 D=128 bf16, 128K and 512K keys).
    hbm_gbps=4591.2, attn_overhead_us=17.59,
    # The cpu tactic's path over 2/8/16 pinned tiles of 128 MiB on 15 threads: 83.82 GB/s +
    # 2188 us; each side while a hybrid runs both (16 tiles, 10 on the CPU): PCIe 47.98, CPU 71.18.
    cpu_attn_gbps=83.82, cpu_overhead_us=2188.1, hybrid_pcie_gbps=47.98, hybrid_cpu_gbps=71.18,
    # measure_host_read_bandwidth, 1 GiB, 15 threads.
    host_read_gbps=97.06,
    # The kernel alone over int8 K/V: 47.38 GB/s against 70.35 for bf16 on the same cells (the
    # v5 probe, benchmarks/results/profile_h200_v5.json; v3 predates the figure).
    cpu_int8_share=0.6734,
    # A 4 KiB pinned_host -> device device_put (median).
    copy_latency_us=139.3,
    # docs/DESIGN.md §6: the model is the max (perfect overlap), what the eager schedule achieves (§7).
    overlap=1.0,
    device="NVIDIA H200",
    source="H200_DEFAULT (benchmarks/results/profile_h200_v3.json, its int8 share from "
           "profile_h200_v5.json; docs/DESIGN.md §7)")
