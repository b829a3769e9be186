"""Residency planner: device budget → per-layer window cells, tactic table, and the selector.

``rkv.plan(model_config, context_len, batch, residency=ResidencyConfig(...))`` decides, for every
attention layer, where its KV cells live and how the tail is attended to (DESIGN.md §6):

- Everything fits the budget: every layer is resident, nothing else runs (no host bytes).
- Otherwise sliding-window (local) layers stay resident as a ring of their window, and the global
  layers share what is left *evenly*: each gets a device window of ``W`` cells (aligned to
  :data:`WINDOW_ALIGN`), one staging tile, and a pinned-host tail of ``P = capacity - W`` cells.
  Even shares are what the model favours: the tail's bytes sum to the same total however they
  are spread, but a small tail per layer can stream *under* that layer's window compute
  (``max``, not a sum), which a few fully offloaded layers never can.
- Each overflowing layer's tactic: ``"stream"`` (mode ``"window"``: stream the tail host→device),
  ``"cpu"`` (attend to the tail on the host), ``"hybrid"`` (split its tiles between both),
  ``"head"`` (some KV heads fully resident, the others streamed), or, with mode ``"auto"``, the
  one with the lowest modeled step time (:func:`select`), logged with the figures it used.

The planner only *names* tactics; ``rkv.rolling_attention`` runs them. Its figures come from a
:class:`Profile` (written by ``experiments/probe.py``, see :mod:`rkv.probe`), the built-in
:data:`H200_DEFAULT`, or per-figure overrides in :class:`ResidencyConfig`.

The model config protocol (what the planner reads from ``model_config``; any object or mapping):
  ``num_layers`` int · ``num_kv_heads`` int (K) · ``head_dim`` int (D) ·
  ``layer_windows`` tuple of length ``num_layers``: ``None`` for a global layer, the sliding
  window (tokens) for a local one, e.g. Gemma-3: ``(1024,)*5 + (None,)`` repeated;
  optional: ``num_heads`` (H, sizes the CPU partial copy; default K), ``kv_dtype`` (the cache
  dtype; else ``dtype``; else bfloat16). A config without ``layer_windows`` (or with an empty
  one) is all-global, like Llama.
:class:`AttentionShape` is that protocol as a frozen dataclass; :func:`attention_shape` reads it
from any config. Model configs only need these attribute names to be plannable.

Glossary: B batch · K kv heads · D head dim · W window cells · P tail cells · L layers.
Bytes are bytes; GB/s means 1e9 bytes per second; MiB is 2**20 bytes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import warnings
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import numpy as np

from rkv.cache import DEFAULT_TILE_CELLS
from rkv.offload import stream as stream_lib
from rkv.cache import check_kv_dtype

log = logging.getLogger(__name__)

MIB = 1 << 20
GB = 1e9
MODES = ("auto", "resident", "window", "head", "cpu", "hybrid")
# Per-layer tactics (the table's columns, in this order). "stream" is the name
# rkv.rolling_attention(tactic=...) takes; mode "window" selects it.
TACTICS = ("resident", "stream", "cpu", "hybrid", "head")
OFFLOAD_TACTICS = ("stream", "head", "cpu", "hybrid")  # the selector's candidates; ties: first wins
MODE_TACTIC = {"window": "stream", "head": "head", "cpu": "cpu", "hybrid": "hybrid"}
# Window cells are a multiple of the largest KV block any kernel reads, so no window block is
# partial: the decode kernel's block_k is at most 128 (rkv/pallas/decode_attention.py,
# BlockSizes.resolve), the Mosaic kernel's block_kv is 128, the generic flash kernel's block_k 64
# or 32 (rkv/pallas/flash_attention.py). Tiles are multiples of it too.
WINDOW_ALIGN = 128
# The smallest tile a tight budget may shrink to. 16K-, 32K- and 64K-cell tiles stream alike on
# the H200 (benchmarks/results/rolling_overlap/rb_t16k.json, rb_t64k.json: 48-50 GB/s at 512K
# context); 4K is unmeasured. Tiles normally land in [tile_cells / 2, tile_cells].
DEFAULT_MIN_TILE_CELLS = 4096
# The device reserve: memory the run needs beside the KV caches (and the weights, which are in
# bytes_in_use by the time a plan reads free memory). It was a flat 2048 MiB plus two tiles; on
# the H200 every GiB more of window saves ~9 ms per decoded token at 1M context (Llama-3-8B), so
# it is now derived from the run (:func:`derive_reserve`), term by term:
# - Streamed tiles in flight: with a prefetcher (layered_forward's, off unless
#   $RKV_PREFETCH_TILES is set), up to this many tail tiles of the next layers on the device;
#   without one (0), the eager schedule's lookahead + 1 tiles of the layer attending.
DEFAULT_PREFETCH_TILES = stream_lib.DEFAULT_PREFETCH_TILES  # layered_forward's Prefetcher
# - The prefill chunk whose activations are live at once: rkv.generate.DEFAULT_CHUNK (residency
#   cannot import generate, which imports it; tests/device_memory_test.py checks they agree).
DEFAULT_CHUNK_TOKENS = 512
# - The decode kernel's float32 partials (o, lse per split, rkv/pallas/decode_attention.py): at
#   most DECODE_SPLITS splits per (batch, kv head) (its heuristic aims at ~4 x 132 programs in
#   all, so 64 bounds B*K >= 8), each of max(16, G) packed query rows (the kernel pads to 16), for
#   DECODE_LAYERS_IN_FLIGHT layers at once (a layer's partials live until its merge; the stream
#   schedule overlaps a layer's window and tail partials with the next layer's dispatch).
DECODE_SPLITS = 64
DECODE_LAYERS_IN_FLIGHT = 4
# - One prefill chunk's activations: hidden + 2 x intermediate (gate and up) + q/k/v heads per
#   token, counted in float32 (the bf16 values and their f32 upcasts) times this factor for the
#   fusions' temporaries and the chunk attention's partials.
PREFILL_ACTIVATION_FACTOR = 2
# A config without hidden_size / intermediate_size (a bare AttentionShape) gets this flat
# allowance instead (Llama-3-8B's derived term is 152 MiB at the default chunk).
PREFILL_FLAT_MIB = 512
# - The logits: [B, V] float32 (decode and the last-only prefill) and one temporary of the same
#   size (softmax / top-p sort of the sampler). A config without vocab_size counts this vocab
#   (Gemma-3's 262,208 is the largest of the supported families).
LOGITS_COPIES = 2
DEFAULT_RESERVE_VOCAB = 262_208
# - XLA/cuBLAS workspace: cuBLAS(Lt) wants up to 32 MiB a handle on Hopper, and cuDNN's and
#   XLA's scratch for fusions and autotuned GEMMs come out of the same pool. 256 MiB is an
#   allowance with room, not a measurement.
XLA_WORKSPACE_MIB = 256
POS_BYTES = 4  # int32 position per cell; every part's positions live on the device (rkv/cache.py)
PROFILE_FORMAT = "rkv.Profile"
# Version 2 added the optional figures transfer_overhead_us, cpu_overhead_us, hybrid_pcie_gbps
# and hybrid_cpu_gbps; a version-1 profile still loads (they are None: the model's fallbacks).
PROFILE_VERSION = 2
READABLE_PROFILE_VERSIONS = (1, 2)


def default_profile_path() -> str:
  """``~/.cache/rkv/profile.json``: where ``experiments/probe.py`` writes by default."""
  return os.path.join(os.path.expanduser("~"), ".cache", "rkv", "profile.json")


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_num(x) -> bool:
  return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _check_positive(where: str, name: str, value, *, allow_none: bool = True, allow_zero=False):
  if value is None and allow_none:
    return
  ok = _is_num(value) and math.isfinite(float(value)) and (
      float(value) >= 0 if allow_zero else float(value) > 0)
  if not ok:
    want = "a number >= 0" if allow_zero else "a positive number"
    raise ValueError(f"{where}: {name} must be {want}{' or None' if allow_none else ''}, "
                     f"got {value!r}")


# ----------------------------------------------------------------------------------------------
# Profile: the measured figures the model uses
# ----------------------------------------------------------------------------------------------
FIGURES = ("pcie_gbps", "d2h_gbps", "hbm_gbps", "attn_overhead_us", "cpu_attn_gbps",
           "host_read_gbps", "copy_latency_us", "overlap", "transfer_overhead_us",
           "cpu_overhead_us", "hybrid_pcie_gbps", "hybrid_cpu_gbps")
_OPTIONAL_RATES = ("cpu_attn_gbps", "host_read_gbps", "hybrid_pcie_gbps", "hybrid_cpu_gbps")
_OPTIONAL_OVERHEADS = ("transfer_overhead_us", "cpu_overhead_us")


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
  ``host_read_gbps``: host memory read bandwidth (caps CPU attention, and CPU attention plus the
  DMA reads of a hybrid split when the contended rates are not measured). ``copy_latency_us``:
  fixed cost of one small host↔device copy (the query out, the CPU partial back). ``overlap``: share of the shorter of (device compute,
  tail) hidden under the longer: 1 = perfect overlap (the §6 model, a max), 0 = a sum.
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
  device: str = ""
  source: str = ""
  # Not part of equality or the hash: a config holding a profile stays hashable.
  details: dict = dataclasses.field(default_factory=dict, compare=False)

  def __post_init__(self):
    for name in ("pcie_gbps", "d2h_gbps", "hbm_gbps"):
      _check_positive("Profile", name, getattr(self, name), allow_none=False)
    for name in _OPTIONAL_RATES:
      _check_positive("Profile", name, getattr(self, name))
    for name in ("attn_overhead_us", "copy_latency_us"):
      _check_positive("Profile", name, getattr(self, name), allow_none=False, allow_zero=True)
    for name in _OPTIONAL_OVERHEADS:
      _check_positive("Profile", name, getattr(self, name), allow_zero=True)
    if not _is_num(self.overlap) or not 0.0 <= float(self.overlap) <= 1.0:
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

  def describe(self) -> str:
    f = lambda x, unit, fmt="{:.4g}": "-" if x is None else fmt.format(x) + unit
    plus = lambda x, what: "" if x is None else f" + {x:.4g} us/{what}"
    text = (f"PCIe {f(self.pcie_gbps, ' GB/s')}{plus(self.transfer_overhead_us, 'stream')} "
            f"(d2h {f(self.d2h_gbps, ' GB/s')}), "
            f"HBM {f(self.hbm_gbps, ' GB/s')} + {f(self.attn_overhead_us, ' us')}/call, "
            f"CPU attn {f(self.cpu_attn_gbps, ' GB/s')}{plus(self.cpu_overhead_us, 'call')}, ")
    if self.hybrid_pcie_gbps is not None or self.hybrid_cpu_gbps is not None:
      text += (f"hybrid (contended) PCIe {f(self.hybrid_pcie_gbps, ' GB/s')} CPU "
               f"{f(self.hybrid_cpu_gbps, ' GB/s')}, ")
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
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(self.to_json(), f, indent=1, default=str)
      f.write("\n")
    os.replace(tmp, path)
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


# The H200 of DESIGN.md §5 (jax 0.11.2, bf16, PCIe Gen5 x16, 16-core host): the figures rkv.probe
# measured there with the current CPU kernel (benchmarks/results/profile_h200_v3.json, probed in
# tactics_bench_h200_run6.json, whose every tactic ran within 0.87-1.11x of this model), rounded.
# Machines of the kind differ run to run (host read 79.6-97.1 GB/s across five runs): run
# experiments/probe.py on yours. The first probe's figures (format 1, before the fixed costs and
# the register-blocked kernel) are in benchmarks/results/profile_h200.json.
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
    # A 4 KiB pinned_host -> device device_put (median).
    copy_latency_us=139.3,
    # §6: the model is the max (perfect overlap); §5 measured ~20% hidden for a naive jit.
    overlap=1.0,
    device="NVIDIA H200",
    source="H200_DEFAULT (benchmarks/results/profile_h200_v3.json, DESIGN.md §5)")


# ----------------------------------------------------------------------------------------------
# The performance model (DESIGN.md §6): pure functions of bytes and a Profile
# ----------------------------------------------------------------------------------------------
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
  ``Bt = tail_bytes`` on the host (DESIGN.md §6). ``resident`` is the time with all
  ``Bw + Bt`` on the device (the ideal). ``head_bytes = (resident heads' bytes, streamed heads'
  bytes)`` of the head layout (None: not modeled)."""
  hyb, frac = hybrid_time(window_bytes, tail_bytes, profile, partial_copy_s, tile_bytes)
  return ModeledTimes(
      resident=resident_time(window_bytes + tail_bytes, profile),
      stream=stream_time(window_bytes, tail_bytes, profile),
      cpu=cpu_time(window_bytes, tail_bytes, profile, partial_copy_s),
      hybrid=hyb, hybrid_fraction=frac,
      head=None if head_bytes is None else head_time(*head_bytes, profile))


CPU_KERNEL_TACTICS = ("cpu", "hybrid")


def _available_tactics(forced: str | None) -> tuple[str, ...]:
  """The selector's candidates on this machine. Without the CPU-tail kernel (no compiler, no
  usable prebuilt library) cpu and hybrid cannot run: ``auto`` leaves them out with a warning
  (stream still works), a forced ``cpu``/``hybrid`` mode is refused here, before a plan is
  printed, not at the first decode step. (A plan for another machine, ``check_free=False``,
  skips this, like the free-memory check.)"""
  from rkv.offload import cpu_build
  if forced is not None and forced not in CPU_KERNEL_TACTICS:
    return OFFLOAD_TACTICS
  ok, why = cpu_build.kernel_available()
  if ok:
    return OFFLOAD_TACTICS
  if forced is not None:
    raise ValueError(f"plan: mode={forced!r} needs the CPU-tail kernel, which is not available "
                     f"here: {why}")
  warnings.warn(f"plan: the CPU-tail kernel is not available ({why}); the cpu and hybrid tactics "
                f"are left out", stacklevel=3)
  return tuple(t for t in OFFLOAD_TACTICS if t not in CPU_KERNEL_TACTICS)


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


# ----------------------------------------------------------------------------------------------
# Model config protocol
# ----------------------------------------------------------------------------------------------
@runtime_checkable
class ModelShape(Protocol):
  """What :func:`plan` reads from a model config (see the module docstring)."""

  num_layers: int
  num_kv_heads: int
  head_dim: int
  layer_windows: tuple


@dataclasses.dataclass(frozen=True)
class AttentionShape:
  """The attention shape of a model, as the planner needs it. ``layer_windows[i]``: None for a
  global layer, the sliding window for a local one. ``num_heads`` (H) defaults to K."""

  num_layers: int
  num_kv_heads: int
  head_dim: int
  layer_windows: tuple = ()
  num_heads: int | None = None
  kv_dtype: str = "bfloat16"

  def __post_init__(self):
    where = "AttentionShape"
    for name in ("num_layers", "num_kv_heads", "head_dim"):
      val = getattr(self, name)
      if not _is_int(val) or val < 1:
        raise ValueError(f"{where}: {name} must be a positive int, got {val!r}")
    windows = tuple(self.layer_windows) if self.layer_windows else (None,) * self.num_layers
    if len(windows) != self.num_layers:
      raise ValueError(f"{where}: layer_windows must have num_layers={self.num_layers} entries, "
                       f"got {len(windows)}")
    for i, w in enumerate(windows):
      if w is not None and (not _is_int(w) or w < 1):
        raise ValueError(f"{where}: layer_windows[{i}] must be None (global) or a positive int "
                         f"(sliding window), got {w!r}")
    object.__setattr__(self, "layer_windows", tuple(None if w is None else int(w) for w in windows))
    if self.num_heads is not None and (not _is_int(self.num_heads) or self.num_heads < 1
                                       or self.num_heads % self.num_kv_heads):
      raise ValueError(f"{where}: num_heads must be a positive multiple of num_kv_heads="
                       f"{self.num_kv_heads}, got {self.num_heads!r}")
    object.__setattr__(self, "kv_dtype", _dtype_name(self.kv_dtype, where, "kv_dtype"))

  @property
  def query_heads(self) -> int:
    return self.num_heads or self.num_kv_heads


def _dtype_name(dtype, where: str, name: str) -> str:
  return check_kv_dtype(dtype, where, name).name


def attention_shape(model_config, kv_dtype=None) -> AttentionShape:
  """Reads the planner's protocol from any config object or mapping (see the module docstring)."""
  if isinstance(model_config, AttentionShape) and kv_dtype is None:
    return model_config
  get = ((lambda n: model_config.get(n)) if isinstance(model_config, Mapping)
         else (lambda n: getattr(model_config, n, None)))
  missing = [n for n in ("num_layers", "num_kv_heads", "head_dim") if get(n) is None]
  if missing:
    raise ValueError(f"plan: model_config ({type(model_config).__name__}) lacks {missing}: it "
                     f"needs num_layers, num_kv_heads, head_dim and layer_windows (see "
                     f"rkv.residency.AttentionShape)")
  windows = get("layer_windows")
  dtype = kv_dtype or get("kv_dtype") or get("dtype") or "bfloat16"
  return AttentionShape(num_layers=get("num_layers"), num_kv_heads=get("num_kv_heads"),
                        head_dim=get("head_dim"), layer_windows=tuple(windows or ()),
                        num_heads=get("num_heads"), kv_dtype=dtype)


# ----------------------------------------------------------------------------------------------
# Config and plan
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ResidencyConfig:
  """How :func:`plan` places the KV cache.

  ``mode``: ``auto`` (per layer, the tactic with the lowest modeled time), ``resident`` (all on
  the device, else ValueError), ``window`` (stream the tail), ``head``, ``cpu``, ``hybrid``.
  ``vram_target_mib``: device memory the KV caches of all layers may use; 0 = all free device
  memory minus the reserve (add the weights if they are not loaded yet — the planner only sees
  free memory). ``reserve_mib``: device memory kept for everything but the caches; None = derived
  from the run (:func:`derive_reserve`: ``prefetch_tiles`` streamed tiles in flight, the decode
  kernel's partials, one prefill chunk of ``chunk_tokens`` tokens, the logits, XLA's workspace).
  ``prefetch_tiles``: the tiles layered_forward's prefetcher keeps in flight (0, the default: no
  prefetcher, and the reserve counts the eager schedule's lookahead + 1 tiles instead).
  ``check_free``: refuse, before anything is allocated, a plan that does not fit this machine —
  an explicit ``vram_target_mib`` whose caches plus the reserve exceed the device's free memory,
  or a host tail above the host's available RAM, and leave out the cpu / hybrid tactics where the
  CPU-tail kernel cannot run here (False: plan for another machine).
  ``tile_cells``: the largest host-tail tile; each layer's tile is picked so its whole tiles
  barely exceed the cells that must leave the device (:func:`tile_candidates`); a tight budget
  may shrink it to ``min_tile_cells``. Both multiples of WINDOW_ALIGN.
  ``min_window_cells``: smallest W of an overflowing layer (0 = everything may stream).
  ``kv_dtype``: overrides the config's. ``profile`` / ``profile_path``: the figures (default: the
  profile at ``~/.cache/rkv/profile.json`` if present, else H200_DEFAULT); every figure can be
  overridden by the field of its name.
  """

  mode: str = "auto"
  vram_target_mib: float = 0
  reserve_mib: float | None = None
  prefetch_tiles: int = DEFAULT_PREFETCH_TILES
  chunk_tokens: int = DEFAULT_CHUNK_TOKENS
  check_free: bool = True
  tile_cells: int = DEFAULT_TILE_CELLS
  min_tile_cells: int = DEFAULT_MIN_TILE_CELLS
  min_window_cells: int = 0
  kv_dtype: str | None = None
  profile_path: str | None = None
  profile: Profile | None = None
  pcie_gbps: float | None = None
  d2h_gbps: float | None = None
  hbm_gbps: float | None = None
  attn_overhead_us: float | None = None
  cpu_attn_gbps: float | None = None
  host_read_gbps: float | None = None
  copy_latency_us: float | None = None
  overlap: float | None = None
  transfer_overhead_us: float | None = None
  cpu_overhead_us: float | None = None
  hybrid_pcie_gbps: float | None = None
  hybrid_cpu_gbps: float | None = None

  def __post_init__(self):
    where = "ResidencyConfig"
    if self.mode not in MODES:
      raise ValueError(f"{where}: mode must be one of {MODES}, got {self.mode!r}")
    _check_positive(where, "vram_target_mib", self.vram_target_mib, allow_none=False,
                    allow_zero=True)
    _check_positive(where, "reserve_mib", self.reserve_mib, allow_zero=True)
    if not _is_int(self.prefetch_tiles) or self.prefetch_tiles < 0:
      raise ValueError(f"{where}: prefetch_tiles must be an int >= 0, got {self.prefetch_tiles!r}")
    if not _is_int(self.chunk_tokens) or self.chunk_tokens < 1:
      raise ValueError(f"{where}: chunk_tokens must be a positive int, got {self.chunk_tokens!r}")
    if not isinstance(self.check_free, (bool, np.bool_)):
      raise ValueError(f"{where}: check_free must be a bool, got {self.check_free!r}")
    for name in ("tile_cells", "min_tile_cells"):
      val = getattr(self, name)
      if not _is_int(val) or val < WINDOW_ALIGN or val % WINDOW_ALIGN:
        raise ValueError(f"{where}: {name} must be a positive multiple of WINDOW_ALIGN="
                         f"{WINDOW_ALIGN}, got {val!r}")
    if self.min_tile_cells > self.tile_cells:
      raise ValueError(f"{where}: min_tile_cells={self.min_tile_cells} must be <= tile_cells="
                       f"{self.tile_cells}")
    if (not _is_int(self.min_window_cells) or self.min_window_cells < 0
        or self.min_window_cells % WINDOW_ALIGN):
      raise ValueError(f"{where}: min_window_cells must be a non-negative multiple of "
                       f"WINDOW_ALIGN={WINDOW_ALIGN}, got {self.min_window_cells!r}")
    if self.kv_dtype is not None:
      _dtype_name(self.kv_dtype, where, "kv_dtype")
    if self.profile is not None and not isinstance(self.profile, Profile):
      raise ValueError(f"{where}: profile must be a rkv.residency.Profile or None, got "
                       f"{type(self.profile).__name__}")
    for name in ("pcie_gbps", "d2h_gbps", "hbm_gbps") + _OPTIONAL_RATES:
      _check_positive(where, name, getattr(self, name))
    for name in ("attn_overhead_us", "copy_latency_us") + _OPTIONAL_OVERHEADS:
      _check_positive(where, name, getattr(self, name), allow_zero=True)
    if self.overlap is not None and (not _is_num(self.overlap) or not 0 <= self.overlap <= 1):
      raise ValueError(f"{where}: overlap must be in [0, 1] or None, got {self.overlap!r}")

  def resolve_profile(self) -> Profile:
    """The profile the planner uses: ``profile``, else ``profile_path``, else the default file if
    present, else H200_DEFAULT; then the per-figure overrides."""
    if self.profile is not None:
      prof = self.profile
    elif self.profile_path is not None:
      prof = Profile.load(self.profile_path)
    elif os.path.isfile(default_profile_path()):
      prof = Profile.load(default_profile_path())
    else:
      prof = H200_DEFAULT
    return prof.replace(**{name: getattr(self, name) for name in FIGURES})


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  """One layer's placement. ``kind``: global / local. ``tactic``: one of TACTICS.

  ``capacity``: cells the layer's cache holds (a local layer: its ring, ``min(window,
  context_len)``). ``window_cells`` W and ``tail_cells`` P = capacity - W as in
  :class:`rkv.RollingKV` (resident: W = capacity, P = 0). For ``"head"``, ``resident_heads`` of
  the K heads keep all ``capacity`` cells on the device and W, P, tile describe the other heads'
  rolling cache. ``host_cells``: tail cells in whole host tiles (the rest of P sits in the device
  staging tile). ``device_bytes`` counts K/V, scales and positions of window, staging and tail
  positions; ``host_bytes`` the pinned-host tail. ``times``: every tactic's modeled step seconds
  (None: not applicable; "resident" of an overflowing layer is the ideal it cannot have).
  """

  layer: int
  kind: str
  tactic: str
  capacity: int
  window_cells: int
  tail_cells: int
  tile_cells: int | None
  host_cells: int
  resident_heads: int | None
  device_bytes: int
  host_bytes: int
  times: Mapping[str, float | None]
  hybrid_fraction: float | None = None
  sliding_window: int | None = None

  @property
  def step_time_s(self) -> float | None:
    return self.times.get(self.tactic)

  @property
  def offloaded(self) -> bool:
    return self.host_bytes > 0


@dataclasses.dataclass(frozen=True)
class Plan:
  """The per-layer tactic table. ``str(plan)`` / ``plan.table()`` print it with totals."""

  layers: tuple[LayerPlan, ...]
  context_len: int
  batch: int
  mode: str
  kv_dtype: str
  budget_bytes: int
  profile: Profile
  shape: AttentionShape
  # How the budget was made (``vram_target_mib=...`` or free memory minus the reserve), the
  # reserve kept beside the caches (:func:`derive_reserve`; for an explicit vram_target_mib, the
  # one the free-memory check used) and the device's free memory at planning (None: unknown).
  budget_source: str = ""
  reserve: Reserve | None = None
  free_bytes: int | None = None

  @property
  def reserve_bytes(self) -> int:
    return 0 if self.reserve is None else self.reserve.total

  @property
  def fits(self) -> bool:
    """True when every layer is resident (nothing on the host)."""
    return self.host_bytes == 0

  @property
  def device_bytes(self) -> int:
    return sum(lp.device_bytes for lp in self.layers)

  @property
  def host_bytes(self) -> int:
    return sum(lp.host_bytes for lp in self.layers)

  @property
  def step_time_s(self) -> float | None:
    """Modeled decode-step attention seconds over all layers (None if a tactic is unmodeled)."""
    times = [lp.step_time_s for lp in self.layers]
    return None if any(t is None for t in times) else sum(times)

  @property
  def resident_step_time_s(self) -> float:
    """The same step with every layer resident (the ideal the plan is measured against)."""
    return sum(lp.times["resident"] for lp in self.layers)

  def tactics(self) -> tuple[str, ...]:
    return tuple(lp.tactic for lp in self.layers)

  def table(self) -> str:
    us = lambda t: "-" if t is None else f"{t * 1e6:.1f}"
    mib = lambda b: f"{b / MIB:.1f}"
    cols = ["layer", "kind", "tactic", "W", "P", "tile", "heads", "device_MiB", "host_MiB"]
    cols += [f"{t}_us" for t in TACTICS] + ["hybrid_f"]
    rows = []
    for lp in self.layers:
      row = [str(lp.layer), lp.kind if lp.sliding_window is None else f"local:{lp.sliding_window}",
             lp.tactic, str(lp.window_cells), str(lp.tail_cells),
             "-" if lp.tile_cells is None else str(lp.tile_cells),
             "-" if lp.resident_heads is None else f"{lp.resident_heads}/{self.shape.num_kv_heads}",
             mib(lp.device_bytes), mib(lp.host_bytes)]
      row += [us(lp.times.get(t)) + ("*" if t == lp.tactic else "") for t in TACTICS]
      row.append("-" if lp.hybrid_fraction is None else f"{lp.hybrid_fraction:.3f}")
      rows.append(row)
    counts = {}
    for lp in self.layers:
      counts[lp.tactic] = counts.get(lp.tactic, 0) + 1
    total = ["total", f"{len(self.layers)}", ",".join(f"{k}:{v}" for k, v in counts.items()),
             "", "", "", "", mib(self.device_bytes), mib(self.host_bytes)]
    total += [""] * len(TACTICS) + [""]
    widths = [max(len(c), *(len(r[i]) for r in rows + [total])) for i, c in enumerate(cols)]
    fmt = lambda r: "  ".join(x.rjust(w) for x, w in zip(r, widths))
    s = self.shape
    step = self.step_time_s
    lines = [
        f"rkv plan: context_len={self.context_len} batch={self.batch} L={s.num_layers} "
        f"K={s.num_kv_heads} D={s.head_dim} kv_dtype={self.kv_dtype} mode={self.mode}",
        f"budget {mib(self.budget_bytes)} MiB ({self.budget_source or 'vram_target_mib'}); "
        f"reserve {mib(self.reserve_bytes)} MiB"
        f"{'' if self.reserve is None else f' ({self.reserve.describe()})'}"
        f"{'' if self.free_bytes is None else f'; device free {mib(self.free_bytes)} MiB'}",
        f"profile {self.profile.source or self.profile.device}: {self.profile.describe()}",
        fmt(cols), *(fmt(r) for r in rows), fmt(total),
        f"totals: device {mib(self.device_bytes)} MiB of {mib(self.budget_bytes)} MiB budget, "
        f"host {mib(self.host_bytes)} MiB; modeled step {us(step)} us "
        f"(all resident: {us(self.resident_step_time_s)} us)"]
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.table()


# ----------------------------------------------------------------------------------------------
# Sizing
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Sizes:
  """Bytes of one cell of one layer: K/V (+ int8 scales) per head, and per cell (K heads)."""

  batch: int
  heads: int
  head_cell: int

  @property
  def cell(self) -> int:
    return self.heads * self.head_cell

  def resident(self, cells: int) -> int:
    return self.batch * cells * (self.cell + POS_BYTES)


def _sizes(shape: AttentionShape, batch: int) -> _Sizes:
  itemsize = np.dtype(shape.kv_dtype).itemsize
  scales = 2 * 4 if shape.kv_dtype == "int8" else 0  # float32 k/v scale per (token, head)
  return _Sizes(batch=batch, heads=shape.num_kv_heads, head_cell=2 * shape.head_dim * itemsize
                + scales)


@dataclasses.dataclass(frozen=True)
class _Layout:
  """A rolling layout of ``heads`` KV heads (plus ``resident_heads`` fully on the device)."""

  window: int
  tile: int
  capacity: int
  resident_heads: int
  device_bytes: int
  host_bytes: int
  host_cells: int
  device_read: int  # K/V bytes attended on the device per step at full fill
  host_read: int    # K/V bytes of the host tail per step


def _layout(sz: _Sizes, capacity: int, window: int, tile: int, resident_heads: int = 0) -> _Layout:
  """Bytes of a layer whose ``resident_heads`` heads hold all cells on the device and whose other
  heads are a RollingKV(W=window, tile) — the cache's own arithmetic (rkv/cache.py)."""
  b, hc = sz.batch, sz.head_cell
  rolled = sz.heads - resident_heads
  p = capacity - window
  n_tiles = p // tile
  staging = min(tile, p)
  host_cells = n_tiles * tile
  dev = b * resident_heads * capacity * hc + (b * capacity * POS_BYTES if resident_heads else 0)
  dev += b * (rolled * (window + staging) * hc + POS_BYTES * (window + staging + host_cells))
  host = b * rolled * host_cells * hc
  read = b * (resident_heads * capacity + rolled * (capacity - host_cells)) * hc
  return _Layout(window=window, tile=tile, capacity=capacity, resident_heads=resident_heads,
                 device_bytes=dev, host_bytes=host, host_cells=host_cells, device_read=read,
                 host_read=host)


def _floor_align(x: float, q: int = WINDOW_ALIGN) -> int:
  return max(0, int(x) // q * q)


def tile_candidates(overflow_cells: int, capacity: int,
                    cfg: ResidencyConfig) -> tuple[list[int], list[int]]:
  """Tail tiles worth trying for a layer that must move ``overflow_cells`` off the device:
  ``(preferred, fallback)``.

  The staging tile is device memory the window cannot use, and the host holds
  ``floor(P / tile)`` whole tiles, so with ``W = budget - tile`` the streamed cells are
  ``(floor(overflow / tile) + 1) * tile``: up to one tile more than the overflow. A tile just
  above ``overflow / n`` streams ``n`` tiles, barely more than the overflow: preferred are those
  for the smallest ``n`` with tiles <= ``tile_cells`` and for ``n + 1``, and ``tile_cells``
  itself. The fallback, for budgets too tight for those, halves ``tile_cells`` down to
  ``min_tile_cells`` (a smaller staging tile frees device cells).
  """
  hi = min(cfg.tile_cells, _floor_align(capacity))
  over = max(int(overflow_cells), 1)
  n0 = max(1, -(-over // cfg.tile_cells))
  preferred = {cfg.tile_cells}
  for n in (n0, n0 + 1):
    base = _floor_align(over / n)
    preferred.update(base + k * WINDOW_ALIGN for k in (1, 2, 3))
  fallback, t = set(), cfg.tile_cells // 2
  while t >= cfg.min_tile_cells:
    fallback.add(t)
    t //= 2
  ok = lambda c: WINDOW_ALIGN <= c <= hi and c % WINDOW_ALIGN == 0
  return (sorted(c for c in preferred if ok(c)),
          sorted(c for c in fallback - preferred if ok(c)))


def size_window(sz: _Sizes, capacity: int, per_layer_bytes: int, cfg: ResidencyConfig,
                tile: int, resident_heads: int = 0) -> _Layout | None:
  """The largest W (a multiple of WINDOW_ALIGN, >= ``min_window_cells``, ``W + tile <=
  capacity`` so at least one tile leaves the device) whose layout fits ``per_layer_bytes``;
  None if not even ``min_window_cells`` fits."""
  lo = cfg.min_window_cells
  hi = _floor_align(capacity - tile)
  if tile > capacity or lo > hi:
    return None
  fits = lambda w: _layout(sz, capacity, w, tile, resident_heads).device_bytes <= per_layer_bytes
  if not fits(lo):
    return None
  # Device bytes grow with W except for the positions of a tail tile that disappears (4 bytes a
  # cell), so the linear estimate is within a few ALIGN steps: walk from it.
  rolled = sz.heads - resident_heads
  spare = per_layer_bytes - _layout(sz, capacity, 0, tile, resident_heads).device_bytes
  w = min(hi, max(lo, _floor_align(spare / max(1, sz.batch * rolled * sz.head_cell))))
  while w > lo and not fits(w):
    w = max(lo, w - WINDOW_ALIGN)
  while w + WINDOW_ALIGN <= hi and fits(w + WINDOW_ALIGN):
    w += WINDOW_ALIGN
  return _layout(sz, capacity, w, tile, resident_heads)


def best_layout(sz: _Sizes, capacity: int, per_layer_bytes: int, cfg: ResidencyConfig,
                resident_heads: int = 0) -> _Layout | None:
  """Over the preferred tile candidates (else the fallback ones), the layout fitting
  ``per_layer_bytes`` that streams the fewest bytes (then: the most device cells, the largest
  tile); None if none fits."""
  rolled = sz.heads - resident_heads
  if resident_heads:
    # tile_cells bounds a tile's bytes as cells of all K heads: a head split's tiles carry only
    # the rolled heads, so the same bytes hold K / rolled times the cells. Fewer, larger puts:
    # at 3 of 8 heads rolled, 29K-cell tiles (46 MB) streamed 1.35x their model on the H200
    # against 1.07x for the stream tactic's 128 MB tiles (tactics_bench_h200.json, 256K, 75%).
    grow = lambda c: max(WINDOW_ALIGN, _floor_align(c * sz.heads / rolled))
    cfg = dataclasses.replace(cfg, tile_cells=grow(cfg.tile_cells),
                              min_tile_cells=grow(cfg.min_tile_cells))
  fixed = sz.batch * resident_heads * capacity * (sz.head_cell + POS_BYTES)
  rolled_cells = (per_layer_bytes - fixed) // max(1, sz.batch * (rolled * sz.head_cell + POS_BYTES))
  for tiles in tile_candidates(capacity - rolled_cells, capacity, cfg):
    best = None
    for tile in tiles:
      lay = size_window(sz, capacity, per_layer_bytes, cfg, tile, resident_heads)
      if lay is not None and (best is None or (lay.host_read, -lay.device_read, -lay.tile) <
                              (best.host_read, -best.device_read, -best.tile)):
        best = lay
    if best is not None:
      return best
  return None


def head_layout(sz: _Sizes, capacity: int, per_layer_bytes: int,
                cfg: ResidencyConfig) -> _Layout | None:
  """Head split: the most KV heads (< K) fully resident that fit, the other heads a rolling
  cache (window from what is left, tail streamed); None if not even 0 resident heads fit."""
  for h in range(sz.heads - 1, -1, -1):
    lay = best_layout(sz, capacity, per_layer_bytes, cfg, resident_heads=h)
    if lay is not None:
      return lay
  return None


@dataclasses.dataclass(frozen=True)
class Reserve:
  """Device memory kept beside the KV caches, term by term: ``terms`` is ``(name, bytes, how)``
  triples (:func:`derive_reserve`; one ``reserve_mib`` term when the config gives the figure)."""

  terms: tuple[tuple[str, int, str], ...]

  @property
  def total(self) -> int:
    return sum(b for _, b, _ in self.terms)

  def bytes_of(self, name: str) -> int:
    """One term's bytes (0 when the reserve has no such term)."""
    return sum(b for n, b, _ in self.terms if n == name)

  def describe(self) -> str:
    return " + ".join(f"{n} {b / MIB:.1f} MiB [{how}]" for n, b, how in self.terms)


def derive_reserve(shape: AttentionShape, batch: int, *, tile_cells: int,
                   prefetch_tiles: int = DEFAULT_PREFETCH_TILES,
                   chunk_tokens: int = DEFAULT_CHUNK_TOKENS, vocab_size: int | None = None,
                   hidden_size: int | None = None, intermediate_size: int | None = None,
                   tile_bytes: int | None = None) -> Reserve:
  """The device memory a run needs beside its KV caches and weights, from what it runs:

  - ``tiles``: the streamed tail tiles on the device at once: ``prefetch_tiles`` of a prefetcher's
    (when > 0), else the eager schedule's ``lookahead + 1`` of the layer attending; each
    ``B x tile_cells`` cells of all K heads (K/V and int8 scales; their positions are in the layout already). ``tile_bytes``
    replaces one tile's bytes (a plan's largest streamed tile; 0 when nothing streams). Capped
    like the prefetcher's own room (``rkv.offload.stream.prefetch_room``: at most
    ``DEFAULT_PREFETCH_BYTES``, at least one tile).
  - ``decode``: the decode kernel's float32 partials, ``B x K x DECODE_SPLITS x max(16, G) x
    (D + 2) x 4`` bytes a layer for ``DECODE_LAYERS_IN_FLIGHT`` layers (capped at L).
  - ``prefill``: one chunk of ``chunk_tokens`` tokens, ``B x chunk x (hidden + 2 x intermediate
    + (H + 2K) x D) x 4 x PREFILL_ACTIVATION_FACTOR`` bytes; ``PREFILL_FLAT_MIB`` when
    ``hidden_size`` or ``intermediate_size`` is unknown.
  - ``logits``: ``B x vocab x 4 x LOGITS_COPIES`` (vocab ``DEFAULT_RESERVE_VOCAB`` if unknown).
  - ``workspace``: ``XLA_WORKSPACE_MIB`` for XLA's and cuBLAS's scratch.

  Llama-3-8B, B=1, bf16, 32K-cell tiles, no prefetcher: 640 + 16.2 + 152 + 1.0 + 256 = ~1065 MiB
  (with 8 prefetched tiles 1024 MiB of tiles, ~1449 MiB; the old flat default was 2048 MiB plus two tiles, 2304 MiB). Not counted: an XLA (non-Pallas) prefill
  attention that materialises ``[chunk, S]`` scores — the library's kernels do not.
  """
  sz = _sizes(shape, batch)
  b, k, d, h = batch, shape.num_kv_heads, shape.head_dim, shape.query_heads
  one_tile = b * tile_cells * sz.cell if tile_bytes is None else int(tile_bytes)
  # Without a prefetcher the eager stream schedule holds lookahead + 1 tiles of a layer.
  in_flight = (stream_lib.prefetch_room(one_tile, prefetch_tiles) if prefetch_tiles
               else (stream_lib.DEFAULT_LOOKAHEAD + 1) * one_tile)
  prefetched = bool(prefetch_tiles)
  if not prefetched:
    prefetch_tiles = stream_lib.DEFAULT_LOOKAHEAD + 1
  cap = (f", at most {stream_lib.DEFAULT_PREFETCH_BYTES / MIB:.0f} MiB"
         if stream_lib.prefetch_room(one_tile, prefetch_tiles) < prefetch_tiles * one_tile else "")
  how_tile = (f"{prefetch_tiles}{'' if prefetched else ' (lookahead + 1)'} x {tile_cells} cells x B={b} x K={k}{cap}" if tile_bytes is None
              else f"{prefetch_tiles}{'' if prefetched else ' (lookahead + 1)'} x {one_tile} bytes, "
                   f"the plan's largest streamed tile{cap}"
              if one_tile else "nothing streams")
  layers = min(DECODE_LAYERS_IN_FLIGHT, shape.num_layers)
  rows = max(16, h // k)
  decode = b * k * DECODE_SPLITS * rows * (d + 2) * 4 * layers
  if hidden_size and intermediate_size:
    per_token = hidden_size + 2 * intermediate_size + (h + 2 * k) * d
    prefill = b * chunk_tokens * per_token * 4 * PREFILL_ACTIVATION_FACTOR
    how_prefill = (f"B={b} x {chunk_tokens} tokens x ({hidden_size} + 2 x {intermediate_size} "
                   f"+ {h + 2 * k} x {d}) x 4 x {PREFILL_ACTIVATION_FACTOR}")
  else:
    prefill = PREFILL_FLAT_MIB * MIB
    how_prefill = "flat: the config has no hidden_size / intermediate_size"
  vocab = vocab_size or DEFAULT_RESERVE_VOCAB
  logits = b * vocab * 4 * LOGITS_COPIES
  return Reserve(terms=(
      ("tiles", in_flight, how_tile),
      ("decode", decode, f"B={b} x K={k} x {DECODE_SPLITS} splits x {rows} rows x (D+2) x 4 x "
                         f"{layers} layers"),
      ("prefill", prefill, how_prefill),
      ("logits", logits, f"B={b} x V={vocab}{'' if vocab_size else ' (default)'} x 4 x "
                         f"{LOGITS_COPIES}"),
      ("workspace", XLA_WORKSPACE_MIB * MIB, "XLA/cuBLAS workspace allowance")))


def _model_sizes(model_config) -> dict:
  """``vocab_size``, ``hidden_size``, ``intermediate_size`` of a config (None where absent)."""
  get = ((lambda n: model_config.get(n)) if isinstance(model_config, Mapping)
         else (lambda n: getattr(model_config, n, None)))
  out = {}
  for name in ("vocab_size", "hidden_size", "intermediate_size"):
    v = get(name)
    out[name] = int(v) if _is_int(v) and v > 0 else None
  return out


def resolve_reserve(cfg: ResidencyConfig, shape: AttentionShape, batch: int, model_config=None,
                    *, tile_bytes: int | None = None, context_len: int | None = None) -> Reserve:
  """The reserve :func:`plan` keeps: ``reserve_mib`` when given, else :func:`derive_reserve` with
  the config's ``tile_cells`` (at most ``context_len``), ``prefetch_tiles`` and
  ``chunk_tokens`` and the model's vocab / hidden / intermediate sizes."""
  if cfg.reserve_mib is not None:
    return Reserve(terms=(("reserve_mib", int(cfg.reserve_mib * MIB),
                           f"reserve_mib={cfg.reserve_mib:g}"),))
  tile = cfg.tile_cells if context_len is None else min(cfg.tile_cells, _floor_align(context_len))
  return derive_reserve(shape, batch, tile_cells=tile, prefetch_tiles=cfg.prefetch_tiles,
                        chunk_tokens=cfg.chunk_tokens, tile_bytes=tile_bytes,
                        **_model_sizes(model_config if model_config is not None else {}))


def kv_budget_bytes(cfg: ResidencyConfig, *, memory_stats: Mapping | None = None,
                    reserve: Reserve | None = None) -> int:
  """The bytes the KV caches may use: ``vram_target_mib``, or (0) free device memory
  (``bytes_limit - bytes_in_use``) minus ``reserve`` (default: ``reserve_mib``, which is then
  required; :func:`plan` passes :func:`resolve_reserve`'s)."""
  if cfg.vram_target_mib:
    return int(cfg.vram_target_mib * MIB)
  if memory_stats is None:
    import jax
    memory_stats = jax.devices()[0].memory_stats()
  if not memory_stats or "bytes_limit" not in memory_stats:
    import jax
    raise ValueError(f"plan: vram_target_mib=0 means 'all free device memory', but the "
                     f"{jax.default_backend()} backend reports no memory stats: pass "
                     f"ResidencyConfig(vram_target_mib=...) in MiB")
  if reserve is None:
    if cfg.reserve_mib is None:
      raise ValueError("kv_budget_bytes: vram_target_mib=0 needs the reserve: pass reserve= "
                       "(rkv.residency.resolve_reserve) or ResidencyConfig(reserve_mib=...)")
    reserve = Reserve(terms=(("reserve_mib", int(cfg.reserve_mib * MIB),
                              f"reserve_mib={cfg.reserve_mib:g}"),))
  free = int(memory_stats["bytes_limit"]) - int(memory_stats.get("bytes_in_use", 0))
  budget = int(free - reserve.total)
  if budget <= 0:
    from rkv.offload import memory
    mem = memory.device_memory(memory_stats=memory_stats)
    advice = f" {memory.fraction_advice(mem)}." if _short_pool(mem) else ""
    raise ValueError(f"plan: vram_target_mib=0 leaves no KV budget: free device memory "
                     f"{free / MIB:.0f} MiB (bytes_limit {mem.bytes_limit / MIB:.0f} MiB - "
                     f"bytes_in_use {mem.bytes_in_use / MIB:.0f} MiB) minus the reserve "
                     f"{reserve.total / MIB:.0f} MiB ({reserve.describe()}); lower reserve_mib "
                     f"or free device memory.{advice}")
  return budget


def _short_pool(mem) -> bool:
  """XLA's pool may be short of the device: below LOW_FRACTION of it, or (physical size unknown)
  the fraction was not set by rkv."""
  from rkv.offload import memory
  return mem.low or (mem.limit_share is None and mem.fraction_source != memory.FRACTION_RKV)


def _streamed_tile_bytes(layers, sz: _Sizes) -> int:
  """The largest tile a plan's layers stream to the device (0: none streams; the cpu tactic
  attends its tail on the host)."""
  out = 0
  for lp in layers:
    if lp.tactic in ("stream", "hybrid", "head") and lp.tile_cells:
      heads = sz.heads - (lp.resident_heads or 0)
      out = max(out, sz.batch * lp.tile_cells * heads * sz.head_cell)
  return out


def check_device_fit(p: Plan, cfg: ResidencyConfig, memory_stats: Mapping,
                     worst_reserve: Reserve | None = None) -> None:
  """Raises ``ValueError`` naming ``vram_target_mib`` when the plan's device bytes plus its
  reserve exceed the free device memory of ``memory_stats``, with the figures (and the memory
  fraction advice when XLA's pool may be short of the device). The target it suggests leaves
  room for ``worst_reserve`` (default the plan's): a lower target may make a resident plan
  stream, and streamed tiles join the reserve."""
  from rkv.offload import memory
  mem = memory.device_memory(memory_stats=memory_stats)
  if mem.free is None:
    return
  need = p.device_bytes + p.reserve_bytes
  if need <= mem.free:
    return
  room = mem.free - max(p.reserve_bytes, 0 if worst_reserve is None else worst_reserve.total)
  lower = (f"Lower vram_target_mib to at most {room // MIB} MiB (or 0: all free device memory "
           f"minus the reserve)" if room >= MIB else
           "The reserve alone does not fit: free device memory first")
  advice = f" {memory.fraction_advice(mem)}." if _short_pool(mem) else ""
  raise ValueError(
      f"plan: vram_target_mib={_num(cfg.vram_target_mib)} gives KV caches of "
      f"{_fmt_bytes(p.device_bytes)} on the device; with the reserve of "
      f"{_fmt_bytes(p.reserve_bytes)} ({p.reserve.describe()}) that is {_fmt_bytes(need)}, "
      f"above the free device memory of {_fmt_bytes(mem.free)} (bytes_limit "
      f"{mem.bytes_limit / MIB:.1f} MiB - bytes_in_use {mem.bytes_in_use / MIB:.1f} MiB). "
      f"{lower}.{advice} To plan for another machine, pass ResidencyConfig(check_free=False).")


def _num(x) -> str:
  """A figure as the user would type it: 1048576, not 1.04858e+06."""
  return str(int(x)) if float(x).is_integer() else f"{float(x):.6g}"


def _fmt_bytes(n: int) -> str:
  return f"{n} bytes ({n / MIB:.1f} MiB)"


def plan(model_config, context_len: int, batch: int = 1, *,
         residency: ResidencyConfig | None = None, memory_stats: Mapping | None = None) -> Plan:
  """Places every layer's KV cache within the budget and names its tactic (module docstring).

  ``context_len``: cells each global layer's cache holds (prompt plus generated tokens).
  ``memory_stats``: the device's ``memory_stats()`` (default: ask device 0), read for
  ``vram_target_mib=0`` and, with ``check_free``, to check an explicit target. Raises ValueError
  naming the argument on bad input, and naming ``vram_target_mib`` with the bytes needed when not
  even the rings and minimal windows fit, or (``check_free``) when the plan's device bytes plus
  the reserve exceed the free device memory (:func:`check_device_fit`); a host tail above the
  pinned pool (:func:`rkv.offload.memory.check_host_pool`) or, with ``check_free``, the host's
  available RAM (:func:`rkv.offload.memory.check_host_memory`) is refused too. The reserve and
  how it was made are logged and kept in ``Plan.reserve``.
  """
  cfg = ResidencyConfig() if residency is None else residency
  if not isinstance(cfg, ResidencyConfig):
    raise ValueError(f"plan: residency must be a rkv.ResidencyConfig, got {type(cfg).__name__}")
  for name, val in (("context_len", context_len), ("batch", batch)):
    if not _is_int(val) or val < 1:
      raise ValueError(f"plan: {name} must be a positive int, got {val!r}")
  shape = attention_shape(model_config, cfg.kv_dtype)
  profile = cfg.resolve_profile()
  sz = _sizes(shape, batch)
  from rkv.offload import memory
  explicit = bool(cfg.vram_target_mib)
  stats = memory_stats
  if stats is None and (not explicit or cfg.check_free):
    import jax
    stats = jax.devices()[0].memory_stats()
    if stats:
      memory.check_memory_fraction("plan", memory_stats=stats)
  has_stats = bool(stats) and "bytes_limit" in stats
  free = (int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))) if has_stats else None
  # vram_target_mib=0: the budget is free memory minus the reserve, so the reserve comes first
  # (tiles of tile_cells, the most any layer streams). An explicit target: the reserve is that
  # of the plan made (its largest streamed tile), and the plan is checked against free memory.
  reserve = None if explicit else resolve_reserve(cfg, shape, batch, model_config,
                                                  context_len=context_len)
  budget = kv_budget_bytes(cfg, memory_stats=stats, reserve=reserve)
  budget_src = (f"vram_target_mib={_num(cfg.vram_target_mib)}" if explicit else
                "vram_target_mib=0: free device memory minus the reserve")
  if reserve is not None:
    log.info("plan: budget %s = free %s - reserve %s (%s)", _fmt_bytes(budget), _fmt_bytes(free),
             _fmt_bytes(reserve.total), reserve.describe())

  def finish(layers) -> Plan:
    res = reserve
    if res is None:
      res = resolve_reserve(cfg, shape, batch, model_config, context_len=context_len,
                            tile_bytes=_streamed_tile_bytes(layers, sz))
      log.info("plan: %s; reserve %s (%s)%s", budget_src, _fmt_bytes(res.total), res.describe(),
               "" if free is None else f"; device free {_fmt_bytes(free)}")
    result = Plan(layers=tuple(layers), context_len=context_len, batch=batch, mode=cfg.mode,
                  kv_dtype=shape.kv_dtype, budget_bytes=budget, profile=profile, shape=shape,
                  budget_source=budget_src, reserve=res, free_bytes=free)
    memory.check_host_pool(result.host_bytes, where="plan", argument="context_len")
    if cfg.check_free:
      if explicit and has_stats:
        check_device_fit(result, cfg, stats, resolve_reserve(cfg, shape, batch, model_config,
                                                             context_len=context_len))
      memory.check_host_memory(result.host_bytes, where="plan", argument="context_len")
    return result
  q_itemsize = 4 if shape.kv_dtype == "float32" else 2
  copy_s = partial_copy_time(profile, batch=batch, num_heads=shape.query_heads,
                             head_dim=shape.head_dim, q_itemsize=q_itemsize)

  local = [i for i, w in enumerate(shape.layer_windows) if w is not None]
  glob = [i for i, w in enumerate(shape.layer_windows) if w is None]
  ring = {i: min(shape.layer_windows[i], context_len) for i in local}
  ring_bytes = sum(sz.resident(c) for c in ring.values())
  full_bytes = sz.resident(context_len)
  need_resident = ring_bytes + len(glob) * full_bytes

  def resident_layer(i, cells):
    return LayerPlan(layer=i, kind="local" if i in ring else "global", tactic="resident",
                     capacity=cells, window_cells=cells, tail_cells=0, tile_cells=None,
                     host_cells=0, resident_heads=None, device_bytes=sz.resident(cells),
                     host_bytes=0, times={t: None for t in TACTICS} | {
                         "resident": resident_time(batch * cells * sz.cell, profile)},
                     sliding_window=shape.layer_windows[i])

  if need_resident <= budget:
    layers = tuple(resident_layer(i, ring.get(i, context_len)) for i in range(shape.num_layers))
    log.info("plan: the whole cache fits (%s of %s): every layer resident",
             _fmt_bytes(need_resident), _fmt_bytes(budget))
    return finish(layers)
  if cfg.mode == "resident":
    raise ValueError(f"plan: mode='resident' needs {_fmt_bytes(need_resident)} of device memory "
                     f"for the KV cache, but {budget_src} gives {_fmt_bytes(budget)}: raise "
                     f"vram_target_mib or pick an offloading mode")

  forced = MODE_TACTIC.get(cfg.mode)
  per_layer = (budget - ring_bytes) // len(glob) if glob else 0
  win = best_layout(sz, context_len, per_layer, cfg) if per_layer > 0 else None
  heads = head_layout(sz, context_len, per_layer, cfg) if per_layer > 0 else None
  usable = heads if forced == "head" else (win or heads) if forced is None else win
  if usable is None:
    # The smallest layout: W = min_window_cells (0 for "head"), one staging tile of
    # min_tile_cells (or the whole context when shorter), every cell's position.
    tile = min(cfg.min_tile_cells, _floor_align(context_len)) or WINDOW_ALIGN
    w_min = 0 if forced == "head" else cfg.min_window_cells
    per_min = _layout(sz, context_len, min(w_min, context_len), min(tile, context_len)
                      ).device_bytes
    need = ring_bytes + len(glob) * per_min
    raise ValueError(
        f"plan: {budget_src} gives a KV budget of {_fmt_bytes(budget)}, below the minimum layout "
        f"of about {_fmt_bytes(need)}: {len(local)} sliding-window rings "
        f"({_fmt_bytes(ring_bytes)}) + {len(glob)} global layers x {_fmt_bytes(per_min)} (W={w_min}"
        f", one staging tile of {tile} cells, positions). Raise vram_target_mib to at least "
        f"{math.ceil(need / MIB)} MiB, or shorten context_len / batch, or use an int8 kv_dtype.")

  log.info("plan: %d global layers overflow; budget %s, rings %s, %s per global layer; "
           "profile %s: %s", len(glob), _fmt_bytes(budget), _fmt_bytes(ring_bytes),
           _fmt_bytes(per_layer), profile.source or profile.device, profile.describe())
  # With a prefetcher (layered_forward's, prefetch_tiles > 0) a layer's streamed tiles are
  # requested while the layers before it run, so the per-stream fixed cost (0.79 ms on the H200,
  # the request and first-tile latency) is paid under other work, not once per layer: the
  # stream and hybrid times are modeled without it. The head tactic's rolled heads stream inside
  # their own call (no prefetch), so its time keeps it.
  stream_profile = (profile.replace(transfer_overhead_us=0.0) if cfg.prefetch_tiles
                    else profile)
  candidates = _available_tactics(forced) if cfg.check_free else OFFLOAD_TACTICS
  layers = []
  for i in range(shape.num_layers):
    if i in ring:
      layers.append(resident_layer(i, ring[i]))
      continue
    tile_bytes = batch * win.tile * sz.cell if win is not None else None
    if win is not None:
      mt = modeled_times(win.device_read, win.host_read, stream_profile, partial_copy_s=copy_s,
                         tile_bytes=tile_bytes,
                         head_bytes=None)
      if heads is not None:
        mt = dataclasses.replace(mt, head=head_time(heads.device_read, heads.host_read, profile))
    else:
      mt = ModeledTimes(resident=resident_time(batch * context_len * sz.cell, profile),
                        head=head_time(heads.device_read, heads.host_read, profile))
    times = mt.as_dict()
    tactic = forced or select(times, candidates)
    if forced in ("cpu", "hybrid") and times[forced] is None:
      log.warning("plan: mode=%r but the profile has no cpu_attn_gbps: layer %d's time is not "
                  "modeled", cfg.mode, i)
    lay = heads if tactic == "head" else win
    if cfg.mode == "auto":
      log.info("plan: layer %d -> %s (modeled us: %s; hybrid streams %.3f of the tail; W=%d "
               "P=%d tile=%d)", i, tactic,
               ", ".join(f"{k}={'-' if v is None else f'{v * 1e6:.1f}'}" for k, v in times.items()),
               mt.hybrid_fraction or 0.0, lay.window, context_len - lay.window, lay.tile)
    layers.append(LayerPlan(
        layer=i, kind="global", tactic=tactic, capacity=context_len, window_cells=lay.window,
        tail_cells=context_len - lay.window, tile_cells=lay.tile, host_cells=lay.host_cells,
        resident_heads=lay.resident_heads if tactic == "head" else None,
        device_bytes=lay.device_bytes, host_bytes=lay.host_bytes, times=times,
        hybrid_fraction=mt.hybrid_fraction))
  return finish(layers)
