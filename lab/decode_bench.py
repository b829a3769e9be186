"""End-to-end decode benchmark (issue 5): rkv vs Hugging Face transformers, tokens/s per context.

A model of a preset's shape (default ``llama3-8b``) with random weights initialised directly on the
device (no checkpoint), its KV cache filled **synthetically** to each context length (random K/V
and positions ``0..S-1`` written straight into the cache objects; nothing is prefilled through
the model), then ``warmup`` untimed and ``steps`` timed one-token greedy decode steps, the next
token and position kept on the device. The steps are queued one ahead (step ``i+1`` launched
before step ``i`` is waited for, what ``rkv.generate.generate`` does without stop tokens, and the
same for transformers), a step's time is the interval between two tokens' completion, and the
figure is ``batch / median step seconds``. Then ``steps`` more, each waited for before the next
is launched (``sync_tokens_per_s``: what a loop that reads every token, e.g. for stop tokens,
gets).

Configurations (rows):

- ``rkv_resident``: every layer a :class:`rkv.models.ResidentCache`, the jitted decode step.
  Skipped (with the reason) when weights + KV + a margin exceed the device memory.
- ``rkv_offload``: :func:`rkv.plan`, mode ``auto``, with the device budget of ``budget``:
  ``"fraction"`` (default): ``vram_target_mib`` = ``1 - offload_fraction`` (default half) of the
  full KV bytes; ``"auto"``: ``vram_target_mib=0``, i.e. all free device memory after the
  weights minus the planner's reserve (``reserve_mib``; ``offload_fraction`` is then unused): the
  planner decides the window, and the rows go beyond HBM. The plan is made after the weights are
  on the device (so free memory is right) and after the previous row's caches are freed. When
  the planner picks a tactic the synthetic fill cannot build (``head``: :data:`FILLED_TACTICS`)
  it re-plans with mode ``window`` (recorded as ``planner_fallback``); ``cpu`` / ``hybrid``
  layers are served as planned (:func:`rkv.generate.serve_rolling`). ``offload_mode="force"``
  uses :func:`rkv.generate.force_stream` with ``W = (1 - offload_fraction) * context`` (budget
  ``fraction`` only). Window/staging cells on the device, whole tail tiles in ``pinned_host``,
  generated on the device and moved to the host tile by tile.
- ``hf_static``: ``LlamaForCausalLM`` (sdpa, bf16, random init on the torch device) with a
  ``StaticCache`` whose layers are allocated and filled with random K/V in place.
- ``hf_offloaded``: transformers' offloaded cache: ``StaticCache(..., offloading=True)``
  (transformers >= 4.56 / 5.x, ``cache_implementation="offloaded_static"``), else
  ``DynamicCache(offloading=True)`` (``"offloaded"``), else the legacy ``OffloadedStaticCache`` /
  ``OffloadedCache`` classes; the row's ``hf_cache`` says which one ran. HF offloads whole layers
  (every layer but the one computing lives on the CPU), so it moves the full KV each step.

``kv_dtype`` (default: the model dtype) may be ``int8``: the rkv caches are int8 RollingKVs
(K/V int8, bfloat16 scales per token and KV head, float32 with ``$RKV_INT8_SCALE_DTYPE=float32``;
the tail's in ``pinned_host`` too), generated in the model dtype on the device a tile at a time
and quantized there (``rkv.cache.quantize_int8``).
:class:`rkv.models.ResidentCache` holds no int8, so a layer the plan keeps resident (and every
layer of ``rkv_resident``) is a RollingKV whose window is the whole capacity (no tail, no staging:
rkv.rolling_attention's resident path, run eagerly per layer, not as one jitted step). The
transformers rows are skipped for int8 (their caches hold the model dtype).

``embedding="host"`` keeps an untied input embedding table in host RAM for the rkv rows
(:func:`rkv.models.embedding_to_host`: a budget="auto" window gets that GiB; each row records
``embedding``); the default keeps it on the device (session 16 measured no consistent gain).

``batch`` > 1: every row's positions run ``0..fill-1`` in each batch row (unpadded, like
:func:`rkv.generate.generate`); tokens/s counts all rows.

**The bound.** Every rkv row carries the bandwidth bound of its decode step
(:func:`step_bound`): ``max(device bytes / HBM, sum over layers of tail bytes / link rate)``.
Device bytes: the weights read per step (all but the input embedding table, of which a step reads
one row) plus every layer's K/V (+ int8 scales) attended on the device (window and staging
buffers; a resident layer's whole cache); tail bytes: the full host tiles at the fill, the cells a
step streams or reads on the host. Link rate of a layer: ``stream`` PCIe (``pcie_gbps``),
``cpu`` the CPU attention rate (:func:`rkv.planner.cpu_rate`: ``cpu_attn_gbps``, capped by
``host_read_gbps``), ``hybrid`` both sides at once at their contended rates
(:func:`rkv.planner.hybrid_rates`, summed: an optimal split moves the tail at their sum).
Layers run one after another, so their tail times add. Fixed costs (call overheads, the first
transfer's latency) are not in the bound. Rates are the plan's profile's (``profile_path``), for
the cache's dtype (``Profile.for_kv_dtype``: an int8 tail's CPU rates are the kernel's int8 share
of its bf16 ones). The
row gets ``bound_s``, ``bound_tokens_per_s`` (``batch / bound_s``), ``bound_ratio`` (``step_s /
bound_s``), ``device_bytes``, ``tail_bytes``, ``hbm_gbps``, ``link_gbps`` (tactic -> GB/s used),
``bound_by`` (``device`` or ``tail``).

Before filling, the caches' device bytes plus one generated tile are checked against free device
memory (``memory_stats()``: ``bytes_limit - bytes_in_use``; skipped when the backend reports none)
and the host tail against available host RAM: a ValueError with the figures (the row's ``error``)
instead of a RESOURCE_EXHAUSTED or the OOM killer halfway through. The fill logs a progress line
every ``fill_log_every`` layers (layer i/L, GiB written, seconds).

The transformers rows run first, in a **spawned child process** that never imports JAX's GPU
backend: JAX preallocates most of the device memory when its backend starts, and the child must
have the whole card; the child exits (freeing everything) before the rkv rows start. Its rows come
back through a JSON file.

Ratios per context (and batch, kv dtype): ``rkv_resident / hf_static`` and ``rkv_offload /
hf_offloaded`` (tokens/s). :func:`main` with ``append=True`` adds a run's rows to an existing
JSON (``runs`` lists each run's config), so one file can hold several configuration groups.

Beyond HBM on one H200 (``experiments/decode_bench.py``; a pinned-host tail above 64 GiB needs
``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` set before JAX starts, :mod:`rkv.offload.memory`)::

  # 1M tokens, bf16 (128 GiB of KV), the planner's window
  python -m experiments.decode_bench --configs=rkv_offload --budget=auto --contexts=1048576 \\
      --out=benchmarks/results/decode_beyond_hbm_h200.json --plot=
  # 2M tokens, int8 KV (130 GiB with its bfloat16 scales)
  python -m experiments.decode_bench --configs=rkv_offload --budget=auto --contexts=2097152 \\
      --kv_dtype=int8 --out=benchmarks/results/decode_beyond_hbm_h200.json --append --plot=
  # batch 8 at 128K (128 GiB of KV)
  python -m experiments.decode_bench --configs=rkv_offload --budget=auto --contexts=131072 \\
      --batch=8 --out=benchmarks/results/decode_beyond_hbm_h200.json --append --plot=

A/Bs on one fill (:func:`split_sweep`): after an ``rkv_offload`` row is timed, its caches are
timed again under each ``split_cpu_tiles`` override of the hybrid layers' CPU share, each
``sweep_env`` setting of the library's per-step switches (:data:`STEP_SWITCHES`) and each
``split_env`` pair of both, alternating with the plan as it is over ``sweep_rounds`` rounds;
``row["sweep_medians"]`` holds each variant's median tokens/s and its ratio to the plan's (one
process, one plan, one fill: its rounds spread far less than separate runs). On a GPU the plan
runs the host share (the default): here against 3 and 4 CPU tiles and the Python worker at the
plan's split and at 1 CPU tile::

  python -m experiments.decode_bench --configs=rkv_offload --budget=auto \\
      --contexts=2097152 --kv_dtype=int8 --split_cpu_tiles=3,4 \\
      --sweep_env=RKV_HOST_SHARE=0 --split_env=1@RKV_HOST_SHARE=0 --sweep_rounds=3
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import multiprocessing
import os
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from unittest import mock

import numpy as np

GIB = 1 << 30
MIB = 1 << 20
GB = 1e9  # the profile's GB/s are 1e9 bytes per second
CONFIGS = ("rkv_resident", "rkv_offload", "hf_static", "hf_offloaded")
# "window": the old name of the stream mode (benchmarks/README.md commands use it).
OFFLOAD_MODES = ("auto", "stream", "window", "force")
# How rkv_offload's device budget is set: "fraction": (1 - offload_fraction) of the KV bytes;
# "auto": vram_target_mib=0, all free device memory after the weights minus the planner's reserve.
BUDGETS = ("fraction", "auto")
# rkv.rolling.SCHEDULES and rkv.cache.KV_DTYPES, spelled out: this module is imported by the HF
# child, which must not import jax (tests/decode_bench_test.py checks they agree).
SCHEDULES = ("eager", "unrolled")
KV_DTYPES = ("bfloat16", "float16", "float32", "int8")
# Plan tactics whose caches the synthetic fill builds: a filled RollingKV serves stream, cpu and
# hybrid alike; a head split would need a filled RollingKV per head group (not written yet).
FILLED_TACTICS = ("resident", "stream", "cpu", "hybrid")
ROLLING_TACTICS = ("stream", "cpu", "hybrid")  # = rkv.tactics.ROLLING (tests compare; no rkv import)
RATIOS = (("rkv_resident", "hf_static"), ("rkv_offload", "hf_offloaded"))
# rkv.cache.SCALE_DTYPE_ENV, default_scale_dtype's itemsizes, spelled out (no jax here; the tests
# compare): a k and a v scale per (token, KV head), bfloat16 unless $RKV_INT8_SCALE_DTYPE=float32.
SCALE_DTYPE_ENV = "RKV_INT8_SCALE_DTYPE"
SCALE_ITEMSIZES = {"bfloat16": 2, "float32": 4}
DEFAULT_SCALE_DTYPE = "bfloat16"


def int8_scale_dtype() -> str:
  """The int8 scales' dtype this process's caches keep (rkv.cache.default_scale_dtype)."""
  name = os.environ.get(SCALE_DTYPE_ENV) or DEFAULT_SCALE_DTYPE
  if name not in SCALE_ITEMSIZES:
    raise ValueError(f"${SCALE_DTYPE_ENV} must be one of {tuple(SCALE_ITEMSIZES)}, got {name!r}")
  return name


def int8_scale_bytes() -> int:
  """Bytes of the k and v scale of one (token, KV head) of an int8 cache."""
  return 2 * SCALE_ITEMSIZES[int8_scale_dtype()]
# Where the rkv rows keep the input embedding table: on the device, or an untied one in host RAM
# (rkv.models.embedding_to_host: a GiB more window for Llama-3-8B). Measured both ways in
# session 16 (benchmarks/results/beyond_hbm/session16/): no consistent gain, so "device".
EMBEDDINGS = ("device", "host")
# The library's switches read at every decode step (so one filled cache can be timed under each
# in turn: BenchConfig.sweep_env), spelled out like the names above (no rkv import here; the
# tests compare them with the library's constants). Switches read once, when a forward is built
# or at import (RKV_FUSED_DECODE, RKV_JOIN_LAYERS, RKV_PREFETCH_TILES, RKV_INT8_SCALE_DTYPE,
# ...), need a process of their own; so do the CPU kernel's threads and nice value
# (RKV_CPU_TAIL_THREADS, RKV_CPU_KERNEL_NICE), which a host share reads only when it is set up.
# RKV_NEXT_PUTS is here, but the plan reserves its tiles only when it is set for the whole
# process (rkv.planner.budget.derive_reserve): sweep it to 0 from there, not to 1 from a plan
# made without it, on a lean reserve.
STEP_SWITCHES = (
    "RKV_EARLY_PUTS", "RKV_EARLY_CPU", "RKV_EARLY_Q_COPY", "RKV_WORKER_FIRST", "RKV_EARLY_PUT_ALL",
    "RKV_TILES_ONE_PROGRAM", "RKV_SWITCH_INTERVAL_US", "RKV_NEXT_PUTS", "RKV_HOST_SHARE",
    "RKV_DIRECT_PUTS", "RKV_CPU_OUT_PINNED", "RKV_CPU_BUFFER_CACHE")


def check_env_entry(entry, where: str = "sweep_env") -> None:
  """``entry``: a non-empty tuple of ``(name, value)`` string pairs, each name one of
  :data:`STEP_SWITCHES`, none twice. ValueError otherwise (naming the entry)."""
  ok = isinstance(entry, tuple) and entry and all(
      isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in entry)
  if not ok:
    raise ValueError(f"{where}: each sweep_env entry must be a non-empty tuple of (name, value) "
                     f"string pairs, got {entry!r}")
  names = [n for n, _ in entry]
  bad = [n for n in names if n not in STEP_SWITCHES]
  if bad:
    raise ValueError(f"{where}: sweep_env names {bad} are not switches read at every step; "
                     f"choose from {STEP_SWITCHES} (others need a process of their own)")
  if len(set(names)) != len(names):
    raise ValueError(f"{where}: sweep_env entry {entry!r} sets a name twice")


def parse_env_entry(text: str) -> tuple[tuple[str, str], ...]:
  """``"NAME=VALUE[+NAME=VALUE...]"`` (a ``--sweep_env`` item) -> ``((name, value), ...)``,
  checked by :func:`check_env_entry`."""
  pairs = []
  for part in text.split("+"):
    name, eq, value = part.strip().partition("=")
    if not eq or not name:
      raise ValueError(f"--sweep_env: {text!r}: each setting is NAME=VALUE, joined by '+' "
                       f"(e.g. RKV_HOST_SHARE=1+RKV_TILES_ONE_PROGRAM=1)")
    pairs.append((name.strip(), value.strip()))
  entry = tuple(pairs)
  check_env_entry(entry, "--sweep_env")
  return entry


def parse_split_env(text: str) -> tuple[int, tuple[tuple[str, str], ...]]:
  """``"N@NAME=VALUE[+NAME=VALUE...]"`` (a ``--split_env`` item: N CPU tiles a hybrid layer
  under those switches) -> ``(N, ((name, value), ...))``."""
  n, at, env = text.partition("@")
  if not at or not n.strip().isdigit():
    raise ValueError(f"--split_env: {text!r}: each item is N@NAME=VALUE[+NAME=VALUE...] (N CPU "
                     f"tiles a layer, e.g. 1@RKV_HOST_SHARE=0)")
  return int(n), parse_env_entry(env)


def env_label(entry) -> str:
  """``"A=1+B=0"``: an entry as it is written on the command line."""
  return "+".join(f"{n}={v}" for n, v in entry)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  preset: str = "llama3-8b"
  contexts: tuple[int, ...] = (131072, 524288)
  configs: tuple[str, ...] = CONFIGS
  batch: int = 1
  dtype: str = "bfloat16"
  # The KV caches' dtype (KV_DTYPES); None: the model dtype. int8: rkv rows only (module doc).
  kv_dtype: str | None = None
  warmup: int = 3
  steps: int = 16
  # Offloaded rows are slow (HF moves the whole KV over PCIe every step): fewer steps.
  offload_warmup: int = 2
  offload_steps: int = 6
  offload_fraction: float = 0.5
  offload_mode: str = "auto"
  budget: str = "fraction"
  # The planner's reserve under budget="auto" (MiB); None: derived from the run
  # (rkv.planner.derive_reserve: tiles in flight, decode partials, a prefill chunk, logits,
  # workspace; ~1.04 GiB for Llama-3-8B at B=1).
  reserve_mib: float | None = None
  tile_cells: int = 32768
  min_tile_cells: int = 4096
  margin_gib: float = 6.0
  device_memory_gib: float = 0.0  # 0: ask the device (JAX bytes_limit / torch total memory)
  host_memory_fraction: float = 0.85  # of available host RAM a host KV (rkv tail, HF) may take
  hf_device: str = "auto"  # auto: cuda if torch sees one, else cpu
  impl: str = "auto"
  # The rolling caches' streaming schedule (rkv.rolling_attention's; None: its default).
  schedule: str | None = None
  # The planner's measured figures (rkv.Profile JSON, e.g. benchmarks/results/profile_h200.json);
  # None: ResidencyConfig's default (~/.cache/rkv/profile.json if present, else H200_DEFAULT).
  profile_path: str | None = None
  fill_log_every: int = 4  # layers between the fill's progress lines
  seed: int = 0
  # rkv_offload rows: after the planned split is timed, the same caches are timed again with
  # each hybrid layer's CPU share overridden to this many of its full tail tiles (clipped to the
  # layer's count), alternating with the planned split over sweep_rounds rounds
  # (:func:`split_sweep`): what a finer or coarser PCIe/CPU split does, on one fill.
  split_cpu_tiles: tuple[int, ...] = ()
  # rkv_offload rows: the same caches timed again under each of these settings of the library's
  # per-step switches (:data:`STEP_SWITCHES`; each entry ``((name, value), ...)``), in the same
  # rounds as split_cpu_tiles: an A/B of switches on one fill in one process (separate
  # processes on one machine spread by ±8% at 2M int8: README, session 22).
  sweep_env: tuple[tuple[tuple[str, str], ...], ...] = ()
  # rkv_offload rows: a CPU-tile override and switch settings together, ``(n_cpu, entry)``, in
  # the same rounds: e.g. another default's split and path (the Python worker at its own plan's
  # split) beside this process's plan.
  split_env: tuple[tuple[int, tuple[tuple[str, str], ...]], ...] = ()
  sweep_rounds: int = 2
  embedding: str = "device"  # EMBEDDINGS

  def __post_init__(self):
    where = "BenchConfig"
    bad = [c for c in self.configs if c not in CONFIGS]
    if bad:
      raise ValueError(f"{where}: unknown configs {bad}; choose from {CONFIGS}")
    if self.offload_mode not in OFFLOAD_MODES:
      raise ValueError(f"{where}: offload_mode must be one of {OFFLOAD_MODES}")
    if self.budget not in BUDGETS:
      raise ValueError(f"{where}: budget must be one of {BUDGETS}, got {self.budget!r}")
    if self.budget == "auto" and self.offload_mode == "force":
      raise ValueError(f"{where}: budget='auto' lets the planner size the window; "
                       f"offload_mode='force' sets it from offload_fraction: use budget="
                       f"'fraction' with force")
    if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
      raise ValueError(f"{where}: kv_dtype must be one of {KV_DTYPES} or None (the model "
                       f"dtype), got {self.kv_dtype!r}")
    if self.reserve_mib is not None and not self.reserve_mib >= 0:
      raise ValueError(f"{where}: reserve_mib must be >= 0 or None, got {self.reserve_mib!r}")
    if self.schedule is not None and self.schedule not in SCHEDULES:
      raise ValueError(f"{where}: schedule must be one of {SCHEDULES} or None, got "
                       f"{self.schedule!r}")
    if not 0 < self.offload_fraction < 1:
      raise ValueError(f"{where}: offload_fraction must be in (0, 1)")
    if not isinstance(self.batch, int) or self.batch < 1:
      raise ValueError(f"{where}: batch must be a positive int, got {self.batch!r}")
    if not isinstance(self.fill_log_every, int) or self.fill_log_every < 1:
      raise ValueError(f"{where}: fill_log_every must be a positive int, got "
                       f"{self.fill_log_every!r}")
    if not self.contexts or any(int(c) < 2 for c in self.contexts):
      raise ValueError(f"{where}: contexts must be ints >= 2, got {self.contexts}")
    if self.steps < 1 or self.offload_steps < 1 or self.warmup < 0 or self.offload_warmup < 0:
      raise ValueError(f"{where}: steps >= 1 and warmup >= 0 required")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in self.split_cpu_tiles):
      raise ValueError(f"{where}: split_cpu_tiles must be non-negative ints (CPU tiles a "
                       f"layer), got {self.split_cpu_tiles!r}")
    if self.embedding not in EMBEDDINGS:
      raise ValueError(f"{where}: embedding must be one of {EMBEDDINGS}, got "
                       f"{self.embedding!r}")
    for entry in self.sweep_env:
      check_env_entry(entry, where)
    for item in self.split_env:
      ok = isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], int) and (
          not isinstance(item[0], bool)) and item[0] >= 0
      if not ok:
        raise ValueError(f"{where}: each split_env item must be (CPU tiles >= 0, settings), got "
                         f"{item!r}")
      check_env_entry(item[1], where)
    if not isinstance(self.sweep_rounds, int) or self.sweep_rounds < 1:
      raise ValueError(f"{where}: sweep_rounds must be a positive int, got {self.sweep_rounds!r}")
    if any(int(c) <= self.decode_steps for c in self.contexts):
      raise ValueError(f"{where}: every context must exceed the {self.decode_steps} decode "
                       f"steps (warm-up + timed), got {self.contexts}")

  def steps_for(self, name: str) -> tuple[int, int]:
    if name in ("rkv_offload", "hf_offloaded"):
      return self.offload_warmup, self.offload_steps
    return self.warmup, self.steps

  @property
  def decode_steps(self) -> int:
    """Cells the decode steps write: an rkv row's warm-up, its timed pipelined steps and as many
    timed synchronous ones (see :func:`_decode_rkv`)."""
    return max(self.warmup + 2 * self.steps, self.offload_warmup + 2 * self.offload_steps
               + self.sweep_steps)

  @property
  def sweep_steps(self) -> int:
    """Cells the sweep's decode steps write (each split and env entry and the plan as it is,
    every round)."""
    if not (self.split_cpu_tiles or self.sweep_env or self.split_env):
      return 0
    entries = len(self.split_cpu_tiles) + len(self.sweep_env) + len(self.split_env) + 1
    return self.sweep_rounds * entries * (self.offload_warmup + self.offload_steps)

  @property
  def kv_dtype_name(self) -> str:
    """The caches' dtype: ``kv_dtype``, else the model dtype."""
    return self.kv_dtype or _np_dtype(self.dtype).name

  def capacity(self, context: int) -> int:
    """Cells each cache holds: exactly the context. The synthetic fill stops
    :attr:`decode_steps` short of it and the decode steps write the rest. (An exact power-of-two
    capacity also keeps torch's pinned host allocator, which rounds every allocation up to a
    power of two, from doubling the offloaded cache's host memory: 64 GiB of KV at 512K took
    128 GiB and the H200 host's OOM killer ended the run.)"""
    return int(context)

  def fill(self, context: int) -> int:
    """Synthetic cells written before decoding (positions ``0 .. fill-1``)."""
    return int(context) - self.decode_steps


def _np_dtype(dtype) -> np.dtype:
  """``dtype`` (a name such as "bfloat16", or a dtype) as a NumPy dtype."""
  import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy; no jax import)
  return np.dtype(dtype)


def model_config(cfg: BenchConfig):
  from rkv.models import ModelConfig
  mc = ModelConfig.preset(cfg.preset, dtype=cfg.dtype)
  if any(w is not None for w in mc.layer_windows):
    raise ValueError(f"decode_bench: preset {cfg.preset!r} has sliding-window layers; the "
                     f"synthetic fill serves global-attention models (e.g. llama3-8b)")
  return mc


def kv_cell_bytes(mc, kv_dtype: str | None = None) -> int:
  """Bytes of one cell (token) of one layer and one batch row: K and V of every KV head, plus the
  scales of an int8 cache (``kv_dtype`` None: the model dtype)."""
  dt = _np_dtype(mc.dtype if kv_dtype is None else kv_dtype)
  scales = int8_scale_bytes() if dt == np.dtype(np.int8) else 0
  return mc.num_kv_heads * (2 * mc.head_dim * dt.itemsize + scales)


def kv_bytes(mc, cells: int, batch: int, kv_dtype: str | None = None) -> int:
  """K/V (+ scales) bytes of every layer's cache of ``cells`` cells."""
  return mc.num_layers * kv_cell_bytes(mc, kv_dtype) * cells * batch


def weight_bytes(mc) -> int:
  return int(mc.param_count() * np.dtype(mc.dtype).itemsize)


def weight_read_bytes(mc) -> int:
  """Weight bytes a decode step reads: all but the input embedding table, of which it reads one
  row per token (a tied table is the output projection too, read whole)."""
  if mc.tie_embeddings:
    return weight_bytes(mc)
  return weight_bytes(mc) - int(mc.vocab_size * mc.hidden_size * np.dtype(mc.dtype).itemsize)


def _summary(times: list[float], warmup: int, batch: int) -> dict[str, Any]:
  timed = times[warmup:]
  med = statistics.median(timed)
  return dict(step_s=med, step_min_s=min(timed), step_max_s=max(timed), n_steps=len(timed),
              n_warmup=warmup, tokens_per_s=batch / med, first_step_s=times[0])


def _fits(need: int, limit: int | None, what: str) -> str | None:
  if limit is None or need <= limit:
    return None
  return (f"{what} needs {need / GIB:.1f} GiB (weights + KV + margin) but the device offers "
          f"{limit / GIB:.1f} GiB")


# ----------------------------------------------------------------------------------------------
# The bound (pure: bytes and rates)
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LayerTraffic:
  """One layer's bytes per decode step: ``device_bytes`` of K/V (+ scales) attended on the device,
  ``tail_bytes`` of the host tail read through the layer's ``tactic``'s link."""

  tactic: str
  device_bytes: int
  tail_bytes: int


def layer_traffic(tactic: str, *, capacity: int, window_cells: int, tile_cells: int | None,
                  fill: int, batch: int, cell_bytes: int) -> LayerTraffic:
  """The bytes one layer's step moves (``cell_bytes``: :func:`kv_cell_bytes`).

  ``resident``: its whole cache (a resident step attends every slot, masked by positions). A
  rolling layer (``stream``, ``cpu``, ``hybrid``): the window and staging buffers on the device
  (attended whole), and the full host tiles at ``fill`` (the cells a step streams or reads on the
  host). Positions (4 bytes a cell) are not counted."""
  if tactic == "resident" or window_cells >= capacity:
    return LayerTraffic(tactic, batch * capacity * cell_bytes, 0)
  if tactic not in ROLLING_TACTICS:
    raise ValueError(f"layer_traffic: tactic must be 'resident' or one of {ROLLING_TACTICS}, got "
                     f"{tactic!r}")
  if not tile_cells or tile_cells < 1:
    raise ValueError(f"layer_traffic: tile_cells must be a positive int for tactic {tactic!r}, "
                     f"got {tile_cells!r}")
  staging = min(tile_cells, capacity - window_cells)
  n_full = max(fill - window_cells, 0) // tile_cells
  return LayerTraffic(tactic, batch * (window_cells + staging) * cell_bytes,
                      batch * n_full * tile_cells * cell_bytes)


def step_bound(device_bytes: float, hbm_gbps: float,
               tails: Iterable[tuple[float, float]] = ()) -> dict[str, Any]:
  """The bandwidth bound of one decode step: ``max(device_bytes / HBM, sum of tail_bytes / rate
  over the (tail_bytes, rate_gbps) of tails)`` (layers run one after another, so their tail
  times add; a tail of 0 bytes needs no rate). Rates in GB/s (1e9 B/s). Returns ``bound_s``,
  ``device_s``, ``tail_s`` and ``bound_by`` ("device" or "tail")."""
  if not hbm_gbps or not hbm_gbps > 0:
    raise ValueError(f"step_bound: hbm_gbps must be positive, got {hbm_gbps!r}")
  if device_bytes < 0:
    raise ValueError(f"step_bound: device_bytes must be >= 0, got {device_bytes!r}")
  tail_s = 0.0
  for nbytes, rate in tails:
    if nbytes < 0:
      raise ValueError(f"step_bound: tail bytes must be >= 0, got {nbytes!r}")
    if not nbytes:
      continue
    if rate is None or not rate > 0:
      raise ValueError(f"step_bound: a tail of {nbytes} bytes needs a positive rate (GB/s), got "
                       f"{rate!r}")
    tail_s += nbytes / (rate * GB)
  device_s = device_bytes / (hbm_gbps * GB)
  return dict(bound_s=max(device_s, tail_s), device_s=device_s, tail_s=tail_s,
              bound_by="tail" if tail_s > device_s else "device")


def link_rates_gbps(profile) -> dict[str, float | None]:
  """GB/s of each tactic's host link under ``profile`` (an rkv.Profile): ``stream`` PCIe,
  ``cpu`` :func:`rkv.planner.cpu_rate`, ``hybrid`` the sum of
  :func:`rkv.planner.hybrid_rates` (both sides at their contended rates; an optimal split
  moves the tail at their sum). None: the profile has no CPU figure."""
  from rkv import planner as residency
  cpu = residency.cpu_rate(profile)
  hyb = residency.hybrid_rates(profile)
  return dict(stream=float(profile.pcie_gbps), cpu=None if cpu is None else cpu / GB,
              hybrid=None if hyb is None else float(hyb[0]) + hyb[1] / GB)


def bound_fields(layers: Iterable[LayerTraffic], weight_bytes: int, hbm_gbps: float,
                 link_gbps: Mapping[str, float | None], batch: int) -> dict[str, Any]:
  """The row fields of the bound of a step over ``layers`` plus ``weight_bytes`` of weights
  (:func:`step_bound`): ``device_bytes``, ``tail_bytes``, ``hbm_gbps``, ``link_gbps`` (the rates
  of the tactics with a tail), ``bound_s``, ``device_s``, ``tail_s``, ``bound_by``,
  ``bound_tokens_per_s`` (``batch / bound_s``)."""
  layers = list(layers)
  device = weight_bytes + sum(lt.device_bytes for lt in layers)
  used = sorted({lt.tactic for lt in layers if lt.tail_bytes})
  missing = [t for t in used if link_gbps.get(t) is None]
  if missing:
    raise ValueError(f"bound_fields: no link rate for tactics {missing} (link_gbps="
                     f"{dict(link_gbps)}); a cpu/hybrid bound needs the profile's CPU figures")
  b = step_bound(device, hbm_gbps, [(lt.tail_bytes, link_gbps.get(lt.tactic)) for lt in layers])
  return dict(device_bytes=int(device), tail_bytes=int(sum(lt.tail_bytes for lt in layers)),
              hbm_gbps=float(hbm_gbps), link_gbps={t: link_gbps[t] for t in used}, **b,
              bound_tokens_per_s=batch / b["bound_s"] if b["bound_s"] > 0 else None)


def plan_traffic(plan, fill: int, cell_bytes: int) -> list[LayerTraffic]:
  """:func:`layer_traffic` of every layer of an :class:`rkv.Plan` at ``fill``."""
  return [layer_traffic(lp.tactic, capacity=lp.capacity, window_cells=lp.window_cells,
                        tile_cells=lp.tile_cells, fill=fill, batch=plan.batch,
                        cell_bytes=cell_bytes) for lp in plan.layers]


def plan_bound(plan, mc, fill: int, kv_dtype: str | None = None) -> dict[str, Any]:
  """The bound fields (:func:`bound_fields`) of the step of ``plan`` (its profile's rates) for
  model config ``mc`` with its caches filled to ``fill`` cells."""
  cell = kv_cell_bytes(mc, kv_dtype or plan.kv_dtype)
  return bound_fields(plan_traffic(plan, fill, cell), weight_read_bytes(mc),
                      plan.profile.hbm_gbps,
                      link_rates_gbps(plan.profile.for_kv_dtype(plan.kv_dtype)), plan.batch)


def resident_bound(mc, profile, capacity: int, batch: int,
                   kv_dtype: str | None = None) -> dict[str, Any]:
  """The bound fields of an all-resident step (every layer's whole cache of ``capacity``)."""
  cell = kv_cell_bytes(mc, kv_dtype)
  layers = [LayerTraffic("resident", batch * capacity * cell, 0)] * mc.num_layers
  return bound_fields(layers, weight_read_bytes(mc), profile.hbm_gbps,
                      link_rates_gbps(profile), batch)


# ----------------------------------------------------------------------------------------------
# Memory checks before a fill
# ----------------------------------------------------------------------------------------------
def free_device_bytes(stats: Mapping | None) -> int | None:
  """``bytes_limit - bytes_in_use`` of a device's ``memory_stats()``; None without them."""
  from rkv.offload import memory
  return memory.device_memory(memory_stats=stats or {}, physical_bytes=0).free


def host_available_bytes() -> int | None:
  """Host RAM available to a new allocation (:func:`rkv.offload.memory.host_memory`)."""
  from rkv.offload import memory
  return memory.host_memory()[1]


def check_fill(*, device_bytes: int, transient_bytes: int, free_device: int | None,
               host_bytes: int, host_available: int | None, host_fraction: float,
               what: str) -> None:
  """Raises ValueError (with the figures) when the caches about to be filled cannot fit: their
  ``device_bytes`` plus ``transient_bytes`` (one tile being generated) above ``free_device``, or
  their pinned-host tail ``host_bytes`` above ``host_fraction`` of ``host_available``. A None
  figure (unknown) skips its check."""
  need = device_bytes + transient_bytes
  if free_device is not None and need > free_device:
    raise ValueError(
        f"{what}: the fill needs {need / GIB:.2f} GiB of device memory (caches "
        f"{device_bytes / GIB:.2f} GiB + one generated tile {transient_bytes / GIB:.2f} GiB) but "
        f"{free_device / GIB:.2f} GiB is free: lower context or batch, raise offload_fraction, "
        f"or use budget='auto'")
  if host_available is not None and host_bytes > host_fraction * host_available:
    raise ValueError(
        f"{what}: the host tail needs {host_bytes / GIB:.2f} GiB of pinned host memory, above "
        f"{host_fraction:.0%} of the {host_available / GIB:.2f} GiB of host RAM available: lower "
        f"context or batch, or use kv_dtype='int8'")


# ----------------------------------------------------------------------------------------------
# rkv side (JAX)
# ----------------------------------------------------------------------------------------------
@functools.cache
def _kernels():
  """The fill's jitted helpers (built once: this module is imported by the HF child, which must
  not import jax)."""
  import jax
  import jax.numpy as jnp
  from rkv.cache import quantize_int8

  @functools.partial(jax.jit, static_argnums=(2, 3, 4))
  def generate(key, i, shape, dtype, scale_dtype):
    """Random K and V ``shape`` of ``dtype`` from ``fold_in(key, i)``, int8-quantized on the
    device with scales of ``scale_dtype`` unless None: ``(k, v)`` or ``(k, v, k_scale,
    v_scale)``."""
    kk, kv = jax.random.split(jax.random.fold_in(key, i))
    k, v = jax.random.normal(kk, shape, dtype), jax.random.normal(kv, shape, dtype)
    if scale_dtype is None:
      return k, v
    (k, ks), (v, vs) = quantize_int8(k, scale_dtype), quantize_int8(v, scale_dtype)
    return k, v, ks, vs

  @functools.partial(jax.jit, donate_argnums=0)
  def write(parts, new, offset):
    """``new`` into ``parts`` (donated: in place) at cell ``offset`` (axis 1)."""
    return tuple(jax.lax.dynamic_update_slice_in_dim(x, y, offset, axis=1)
                 for x, y in zip(parts, new))

  return generate, write


def _positions(batch, lo, hi, cells):
  """``[B,cells]`` int32: positions lo..hi-1 in the first hi-lo slots of every row, -1 after."""
  import jax.numpy as jnp
  idx = jnp.arange(cells, dtype=jnp.int32)
  pos = jnp.where(idx < hi - lo, lo + idx, -1).astype(jnp.int32)
  return jnp.broadcast_to(pos, (batch, cells))


class _Keys:
  """Distinct indices for ``fold_in`` under one key: every generated chunk gets its own."""

  def __init__(self, key):
    self.key, self.i = key, 0

  def next(self) -> int:
    self.i += 1
    return self.i


def _random_block(mc, batch, cells, lo, n, *, kv_dtype, chunk, keys):
  """A :class:`rkv.cache.KVBlock` of ``cells`` device cells whose first ``n`` hold random K/V at
  positions ``lo..lo+n-1`` (the others empty: position -1), generated ``chunk`` cells at a time
  in the model dtype (quantized on the device for int8) and written in place into the block: one
  chunk is the only transient, whatever the block's size."""
  import jax.numpy as jnp
  from rkv.cache import KVBlock, default_scale_dtype
  generate, write = _kernels()
  dt, kdt = jnp.dtype(mc.dtype), jnp.dtype(kv_dtype)
  int8 = kdt == jnp.dtype(jnp.int8)
  sdt = default_scale_dtype() if int8 else None  # what RollingKV.empty and the planner take
  kh, d = mc.num_kv_heads, mc.head_dim
  c = min(int(chunk), cells)
  if n and c == cells:  # one chunk is the block
    parts = generate(keys.key, keys.next(), (batch, cells, kh, d), dt, sdt)
  else:
    kv0 = lambda: jnp.zeros((batch, cells, kh, d), kdt)
    scale0 = lambda: jnp.zeros((batch, cells, kh), sdt)
    parts = (kv0(), kv0()) + ((scale0(), scale0()) if int8 else ())
    offsets = range(0, n, c) if n else ()  # no data, no chunk (c is 0 for a 0-cell block)
    for off in offsets:
      # The last chunk ends at the block's end (one chunk shape, one compile); the cells it
      # writes past n are empty slots (position -1), never attended.
      parts = write(parts, generate(keys.key, keys.next(), (batch, c, kh, d), dt, sdt),
                    np.int32(min(off, cells - c)))
  scales = parts[2:] if int8 else (None, None)
  return KVBlock(k=parts[0], v=parts[1], pos=_positions(batch, lo, lo + n, cells),
                 k_scale=scales[0], v_scale=scales[1])


def filled_resident(mc, batch, capacity, fill, key, *, chunk_cells=32768):
  """A :class:`ResidentCache` of ``capacity`` cells whose first ``fill`` hold random K/V (the
  model dtype: a ResidentCache holds no int8), generated ``chunk_cells`` at a time."""
  import jax.numpy as jnp
  from rkv.models.kv import ResidentCache
  b = _random_block(mc, batch, capacity, 0, fill, kv_dtype=mc.dtype, chunk=chunk_cells,
                    keys=_Keys(key))
  return ResidentCache(k=b.k, v=b.v, pos=b.pos, length=jnp.int32(fill))


def filled_rolling(mc, batch, capacity, fill, *, window_cells, tile_cells, key, kv_dtype=None,
                   chunk_cells=None):
  """A :class:`rkv.RollingKV` (``capacity`` cells, ``W = window_cells``) holding ``fill`` random
  cells: window and staging on the device, whole tail tiles generated on the device and moved to
  ``pinned_host`` one at a time (never a host numpy copy of the tail). ``kv_dtype`` (default the
  model dtype) may be int8: K/V quantized on the device, the scales beside them (the tail's in
  pinned_host too). ``W = capacity`` is a cache with no tail (and no staging): how an int8 layer
  is resident. ``chunk_cells`` (default ``tile_cells``): the generated chunk of window and
  staging."""
  import jax
  from rkv.cache import RollingKV, _tail_bytes, _tail_layout, _untile, default_scale_dtype
  from rkv.offload import memory
  w, tile = int(window_cells), int(tile_cells)
  if not (0 <= w <= capacity and 0 <= fill <= capacity and tile >= 1):
    raise ValueError(f"filled_rolling: need 0 <= window_cells={w} <= capacity={capacity}, "
                     f"0 <= fill={fill} <= capacity and tile_cells={tile} >= 1")
  kdt = _np_dtype(mc.dtype if kv_dtype is None else kv_dtype)
  chunk = tile if chunk_cells is None else int(chunk_cells)
  kh, d = mc.num_kv_heads, mc.head_dim
  sdt = default_scale_dtype() if kdt == np.dtype(np.int8) else None
  memory.check_host_pool(_tail_bytes(batch, capacity, kh, d, w, tile, kdt, sdt),
                         where="decode_bench", argument="context")
  n_tiles, staging_cells = _tail_layout(w, capacity, tile)
  wf = min(fill, w)
  n_full = (fill - wf) // tile
  staged = (fill - wf) - n_full * tile
  if staged > staging_cells or n_full > n_tiles:
    raise ValueError("filled_rolling: inconsistent layout")
  keys = _Keys(key)
  block = lambda cells, lo, n, c: _random_block(mc, batch, cells, lo, n, kv_dtype=kdt, chunk=c,
                                                keys=keys)
  window = block(w, 0, wf, chunk)
  staging = block(staging_cells, w + n_full * tile, staged, chunk)
  quantized = kdt == np.dtype(np.int8)
  tiles = []
  for i in range(n_tiles):
    b = block(tile, w + i * tile, tile if i < n_full else 0, tile)
    moved = memory.to_host((b.k, b.v, b.k_scale, b.v_scale))
    # One tile in flight: the device copy is freed before the next is generated, so the fill
    # never holds more than a tile beyond the caches (the budget leaves just the reserve).
    jax.block_until_ready(moved)
    tiles.append(dataclasses.replace(b, k=moved[0], v=moved[1], k_scale=moved[2],
                                     v_scale=moved[3]))
    del b
  tail = _untile(tiles, quantized)
  jax.block_until_ready((window, staging, tail))
  return RollingKV(window=window, staging=staging, tail=tail, window_cells=w, tile_cells=tile,
                   capacity=capacity, fill=fill)


def _tactics(p) -> list[str]:
  t = p.tactics
  return list(t() if callable(t) else t)


def _offload_plan(cfg: BenchConfig, mc, context: int, memory_stats: Mapping | None = None):
  """``(plan, row info)`` of rkv_offload at ``context`` (module docstring: budget, fallback).
  ``memory_stats``: given to :func:`rkv.plan` (None: the planner asks device 0 itself)."""
  import rkv
  from rkv import generate as gen
  cap = cfg.capacity(context)
  kvd = cfg.kv_dtype_name
  auto = cfg.budget == "auto"
  target_mib = 0 if auto else (1 - cfg.offload_fraction) * kv_bytes(mc, cap, cfg.batch, kvd) / MIB
  info: dict[str, Any] = dict(vram_target_mib=target_mib, offload_mode=cfg.offload_mode)
  res = lambda mode: rkv.ResidencyConfig(mode=mode, vram_target_mib=target_mib,
                                         reserve_mib=cfg.reserve_mib, kv_dtype=kvd,
                                         tile_cells=cfg.tile_cells,
                                         min_tile_cells=cfg.min_tile_cells,
                                         profile_path=cfg.profile_path)
  plan = lambda mode: rkv.plan(mc, cap, cfg.batch, residency=res(mode),
                               memory_stats=memory_stats)
  info["profile"] = res("auto").resolve_profile().source
  if cfg.offload_mode == "force":
    base = plan("stream")
    w = int(round((1 - cfg.offload_fraction) * context))
    p = gen.force_stream(base, window_cells=w, tile_cells=min(cfg.tile_cells, cap - w))
    info["planner_mode"] = "force"
  else:
    p = plan(cfg.offload_mode)
    info["planner_mode"] = cfg.offload_mode
    bad = sorted(set(_tactics(p)) - set(FILLED_TACTICS))
    if bad:
      info["planner_fallback"] = (f"mode {cfg.offload_mode!r} chose {bad}, which the synthetic "
                                  f"fill does not build: re-planned with mode 'stream'")
      p = plan("stream")
      info["planner_mode"] = "stream"
  info["budget_gib"] = p.budget_bytes / GIB
  # The reserve and free memory the plan was made with (planners that record them).
  for field, key in (("reserve_bytes", "reserve_gib"), ("free_bytes", "free_device_gib")):
    val = getattr(p, field, None)
    if val is not None:
      info[key] = val / GIB
  if auto and "free_device_gib" not in info:
    free = free_device_bytes(memory_stats if memory_stats is not None else
                             _device_memory_stats())
    info["free_device_gib"] = None if free is None else free / GIB
  info["tactics"] = {t: _tactics(p).count(t) for t in sorted(set(_tactics(p)))}
  # Split planned for CPU shares in the host-share thread ($RKV_HOST_SHARE, Plan.host_share).
  info["plan_host_share"] = p.host_share
  info["device_kv_gib"] = p.device_bytes / GIB
  info["host_kv_gib"] = p.host_bytes / GIB
  info["modeled_step_s"] = p.step_time_s
  stream = [lp for lp in p.layers if lp.tactic in ROLLING_TACTICS]
  if stream:
    info["window_cells"] = sorted({lp.window_cells for lp in stream})
    info["tile_cells"] = sorted({lp.tile_cells for lp in stream})
  return p, info


def _cache_bytes(cache) -> tuple[int, int]:
  """(device bytes, pinned-host bytes) of a cache's arrays."""
  import jax
  from rkv.offload import memory
  dev = host = 0
  for x in jax.tree.leaves(cache):
    if memory.memory_kind(x) == memory.PINNED_HOST:
      host += x.nbytes
    else:
      dev += x.nbytes
  return dev, host


def build_caches(cfg: BenchConfig, mc, context: int, key, plan=None, *, log=print,
                 what: str = "rkv") -> tuple:
  """One filled cache per layer: as ``plan`` places it (None: every layer resident), in
  ``cfg.kv_dtype_name``. A resident layer is a :class:`ResidentCache`, or for int8 a RollingKV
  whose window is the whole capacity; a stream / cpu / hybrid layer a filled RollingKV with the
  plan's W and tile (:func:`rkv.generate.serve_rolling`). Logs progress every
  ``cfg.fill_log_every`` layers. (A function of its own so that no layer's cache outlives the
  row in a local of the caller: the next row's plan sees the memory freed.)"""
  import jax
  from rkv import generate as gen
  cap, fill, b = cfg.capacity(context), cfg.fill(context), cfg.batch
  int8 = cfg.kv_dtype_name == "int8"
  n = mc.num_layers
  caches, dev, host, t0 = [], 0, 0, time.perf_counter()
  for i in range(n):
    lp = None if plan is None else plan.layers[i]
    k = jax.random.fold_in(key, i)
    if lp is not None and lp.tactic in ROLLING_TACTICS:
      cache = gen.serve_rolling(lp, filled_rolling(
          mc, b, cap, fill, window_cells=lp.window_cells, tile_cells=lp.tile_cells, key=k,
          kv_dtype=cfg.kv_dtype_name))
    elif lp is not None and lp.tactic != "resident":
      raise ValueError(f"build_caches: layer {i}'s tactic {lp.tactic!r} is not filled "
                       f"(FILLED_TACTICS: {FILLED_TACTICS})")
    elif int8:  # ResidentCache holds no int8: a RollingKV with no tail
      cache = filled_rolling(mc, b, cap, fill, window_cells=cap, tile_cells=cfg.tile_cells,
                             key=k, kv_dtype="int8", chunk_cells=cfg.tile_cells)
    else:
      cache = filled_resident(mc, b, cap, fill, k, chunk_cells=cfg.tile_cells)
    jax.block_until_ready(cache)
    caches.append(cache)
    d, h = _cache_bytes(cache)
    dev, host = dev + d, host + h
    if (i + 1) % cfg.fill_log_every == 0 or i + 1 == n:
      log(f"{what}: fill layer {i + 1}/{n}: {(dev + host) / GIB:.2f} GiB written (device "
          f"{dev / GIB:.2f}, host {host / GIB:.2f}), {time.perf_counter() - t0:.1f} s")
  return tuple(caches)


def _decode_rkv(step, caches, context, warmup, steps, batch, *, pipelined=True):
  """``warmup + steps`` greedy decode steps from position ``context``, each through
  :meth:`rkv.generate.Stepper.decode` (jitted: the forward, the argmax and the next positions in
  one program), fed the previous step's device tokens. Returns ``(times, dispatch, caches)``:
  ``dispatch[i]`` the seconds until step ``i``'s call returned (its host side).

  ``pipelined`` (what :func:`rkv.generate.generate` runs without stop tokens): step ``i+1`` is
  dispatched before step ``i``'s token is waited for, and ``times[i]`` is the interval between the
  completion of steps ``i-1`` and ``i`` (the first: from the call). Else (what ``generate`` runs
  with stop tokens: it reads every token before the next step) each step is waited for before the
  next is dispatched, and ``times[i]`` is that step's dispatch-to-token time."""
  import jax
  import jax.numpy as jnp
  from rkv.generate import greedy_pick
  # A jitted step donates the tokens it is given (rkv.models.jit_forward): the next step deletes
  # this one's, so a queued loop waits on a copy of them (a one-kernel program behind the step),
  # as rkv.generate keeps its tokens.
  donated = step.jitted
  tok = jnp.zeros((batch, 1), jnp.int32)
  pos = jnp.full((batch, 1), context, jnp.int32)  # every row at the same position
  times, dispatch = [], []
  last = time.perf_counter()
  queued = None
  for _ in range(warmup + steps):
    t0 = time.perf_counter()
    tok, pos, caches = step.decode(tok, pos, caches, greedy_pick)
    dispatch.append(time.perf_counter() - t0)
    if not pipelined:
      jax.block_until_ready(tok)
      times.append(time.perf_counter() - t0)
      continue
    if queued is not None:
      jax.block_until_ready(queued)
      now = time.perf_counter()
      times.append(now - last)
      last = now
    queued = jnp.copy(tok) if donated else tok
  if queued is not None:
    jax.block_until_ready(queued)
    times.append(time.perf_counter() - last)
  return times, dispatch, caches


def with_cpu_tiles(caches, n_cpu: int | None):
  """``caches`` with every hybrid rolling layer's CPU share set to ``n_cpu`` of its full tail
  tiles (clipped to its count; None: unchanged). The share is stored as a fraction
  (``n_cpu / n``, exact under rolling's half-up rounding); a flush during the steps that follow
  adds a tile and the same fraction may then round to another count (the sweep records the
  counts it started from)."""
  from rkv import cache as cache_lib
  if n_cpu is None:
    return caches
  out = []
  for c in caches:
    if isinstance(c, cache_lib.RollingKV) and c.tactic == "hybrid" and c.n_full_tiles:
      n = c.n_full_tiles
      c = c.with_tactic("hybrid", min(n_cpu, n) / n)
    out.append(c)
  return tuple(out)


def split_counts(caches) -> dict[str, int]:
  """``"streamed/full"`` tile counts of the hybrid layers -> how many layers have them."""
  from rkv import cache as cache_lib, rolling
  counts: dict[str, int] = {}
  for c in caches:
    if isinstance(c, cache_lib.RollingKV) and c.tactic == "hybrid":
      n = c.n_full_tiles
      key = f"{rolling.streamed_count(n, 'hybrid', c.cpu_fraction)}/{n}"
      counts[key] = counts.get(key, 0) + 1
  return counts


def split_sweep(step, caches, position: int, cfg: BenchConfig, *, log=print, what=""):
  """The plan as it is, each ``cfg.split_cpu_tiles`` override and each ``cfg.sweep_env`` setting,
  on the same caches, steps queued as in :func:`_decode_rkv`, alternating over
  ``cfg.sweep_rounds`` rounds (odd rounds in reverse order). Returns ``(entries, caches)``: one entry per variant and round with
  the CPU tiles (``"planned"`` or the override), the env settings it ran under (``{}``: the
  process's own), the streamed/full tile counts it ran and its tokens/s (median of the timed
  steps)."""
  planned = tuple((c.tactic, c.cpu_fraction) if hasattr(c, "cpu_fraction") else None
                  for c in caches)
  variants = ([(None, ())] + [(n, ()) for n in cfg.split_cpu_tiles]
              + [(None, e) for e in cfg.sweep_env] + list(cfg.split_env))
  entries = []
  for r in range(cfg.sweep_rounds):
    # Odd rounds run the variants in reverse, so a drift over the run (the host warming, the
    # allocator's state) does not favour the ones run first.
    for n_cpu, env in (variants if r % 2 == 0 else variants[::-1]):
      if n_cpu is None:  # back to the plan's own shares
        caches = tuple(c if p is None or p[0] != "hybrid" else c.with_tactic(*p)
                       for c, p in zip(caches, planned))
      else:
        caches = with_cpu_tiles(caches, n_cpu)
      counts = split_counts(caches)
      with mock.patch.dict(os.environ, dict(env)):  # restored after, also on an error
        times, _, caches = _decode_rkv(step, caches, position, cfg.offload_warmup,
                                       cfg.offload_steps, cfg.batch)
      position += cfg.offload_warmup + cfg.offload_steps
      e = dict(round=r, cpu_tiles="planned" if n_cpu is None else n_cpu, env=dict(env),
               streamed_of=counts, **_summary(times, cfg.offload_warmup, cfg.batch))
      entries.append(e)
      log(f"{what}: {variant_label(e)} (streamed/full tiles: layers {counts}), round {r}: "
          f"{e['tokens_per_s']:.2f} tok/s")
  return entries, caches


def variant_label(entry: Mapping) -> str:
  """A sweep entry's variant: ``"planned"``, ``"cpu_tiles=N"``, its env settings, or both
  (``"cpu_tiles=N+NAME=VALUE"``)."""
  split = None if entry["cpu_tiles"] == "planned" else f"cpu_tiles={entry['cpu_tiles']}"
  env = env_label(tuple(entry["env"].items())) if entry.get("env") else None
  return "+".join(x for x in (split, env) if x) or "planned"


def sweep_medians(entries) -> dict[str, dict[str, float]]:
  """Per variant of a sweep (:func:`variant_label`, in the order first run): the median of its
  rounds' tokens/s, and that over the plan's own (``"planned"``) median: what to quote from an
  in-process A/B."""
  by: dict[str, list[float]] = {}
  for e in entries:
    by.setdefault(variant_label(e), []).append(e["tokens_per_s"])
  base = statistics.median(by["planned"]) if "planned" in by else None
  return {k: dict(tokens_per_s=statistics.median(v), rounds=len(v),
                  vs_planned=statistics.median(v) / base if base else None)
          for k, v in by.items()}


def _device_memory_stats():
  import jax
  return jax.devices()[0].memory_stats()


def _fill_row(cfg: BenchConfig, mc, model, forward, name: str, ctx: int, row: dict,
              memory_stats: Callable[[], Mapping | None] | None, limit: int | None,
              log) -> None:
  """Plans (rkv_offload), bounds, checks, fills and decodes one rkv row into ``row``.
  ``memory_stats``: injected device stats (None: device 0's; the planner then reads them
  itself)."""
  import jax
  import rkv
  from rkv import rolling
  from rkv.generate import Stepper
  cap, fill, kvd = cfg.capacity(ctx), cfg.fill(ctx), cfg.kv_dtype_name
  warmup, steps = cfg.steps_for(name)
  what = f"rkv {name} {ctx}"
  key = jax.random.key(cfg.seed + ctx)
  if name == "rkv_resident":
    profile = rkv.ResidencyConfig(profile_path=cfg.profile_path).resolve_profile()
    row.update(resident_bound(mc, profile, cap, cfg.batch, kvd))
    need = weight_bytes(mc) + kv_bytes(mc, cap, cfg.batch, kvd) + int(cfg.margin_gib * GIB)
    why = _fits(need, limit, "resident KV")
    if why:
      row["skipped"] = why
      log(f"{what}: skipped: {why}")
      return
    if kvd == "int8":
      row["resident_as"] = "RollingKV(W=capacity): ResidentCache holds no int8"
    positions = mc.num_layers * cfg.batch * cap * 4  # int32 per cell, beside the K/V
    plan, dev_bytes, host_bytes = None, kv_bytes(mc, cap, cfg.batch, kvd) + positions, 0
    chunk = cfg.tile_cells  # build_caches' chunk for resident layers
  else:
    plan, info = _offload_plan(cfg, mc, ctx, None if memory_stats is None else memory_stats())
    row.update(info)
    row.update(plan_bound(plan, mc, fill, kvd))
    dev_bytes, host_bytes = plan.device_bytes, plan.host_bytes
    # build_caches' largest chunk: a rolling layer's tile, a resident layer's tile_cells.
    chunk = max(lp.tile_cells if lp.tactic in ROLLING_TACTICS else cfg.tile_cells
                for lp in plan.layers)
  # One chunk of K/V in the model dtype, and as much again for the generator's temporaries and
  # the int8 copy.
  transient = 2 * cfg.batch * min(chunk, cap) * kv_cell_bytes(mc)
  check_fill(device_bytes=dev_bytes, transient_bytes=transient,
             free_device=free_device_bytes((memory_stats or _device_memory_stats)()),
             host_bytes=host_bytes,
             host_available=host_available_bytes(), host_fraction=cfg.host_memory_fraction,
             what=what)
  t1 = time.perf_counter()
  caches = build_caches(cfg, mc, ctx, key, plan, log=log, what=what)
  row["fill_s"] = time.perf_counter() - t1
  step = Stepper(model, caches, forward, schedule=cfg.schedule)
  row["jitted"] = step.jitted
  row["schedule"] = None if step.jitted else (cfg.schedule or rolling.DEFAULT_SCHEDULE)
  times, dispatch, caches = _decode_rkv(step, caches, fill, warmup, steps, cfg.batch)
  # The same steps again, each waited for before the next is dispatched (generate with stop
  # tokens): what the host costs between steps when nothing is queued behind the device.
  sync, sync_dispatch, caches = _decode_rkv(step, caches, fill + warmup + steps, 0, steps,
                                            cfg.batch, pipelined=False)
  if name == "rkv_offload" and (cfg.split_cpu_tiles or cfg.sweep_env or cfg.split_env):
    row["split_sweep"], caches = split_sweep(step, caches, fill + warmup + 2 * steps, cfg,
                                             log=log, what=what)
    row["sweep_medians"] = sweep_medians(row["split_sweep"])
  del caches
  row.update(_summary(times, warmup, cfg.batch))
  row["pipelined"] = True
  # Layers whose CPU share ran in rkv.offload.host_share ($RKV_HOST_SHARE): a row that set the
  # switch but ran none (no layer it applies to) says so here, not only in its env.
  row["host_share_layers"] = len(getattr(step.fn, "host_shares", ()))
  # Seconds until the step call returned (median of the timed steps): close to step_s means the
  # host side (Python dispatch, or a wait inside the step) bounds the step.
  row["host_s"] = float(np.median(dispatch[warmup:]))
  row["sync_step_s"] = float(np.median(sync))
  row["sync_tokens_per_s"] = cfg.batch / row["sync_step_s"]
  row["sync_host_s"] = float(np.median(sync_dispatch))
  if row.get("bound_s"):
    row["bound_ratio"] = row["step_s"] / row["bound_s"]
  log(f"{what}: {row['tokens_per_s']:.2f} tok/s (median step {1e3 * row['step_s']:.2f} ms, "
      f"bound {1e3 * row['bound_s']:.2f} ms by {row['bound_by']}: x{row['bound_ratio']:.2f}; "
      f"each step waited for: {row['sync_tokens_per_s']:.2f} tok/s; fill {row['fill_s']:.1f} s)")


def warm_layered_programs(model, mc, cfg: BenchConfig, log=print) -> None:
  """Compiles the layered decode step's dense programs before any large fill
  (:func:`rkv.generate.warm_up`: XLA's GEMM autotuning allocates scratch as it compiles; after a
  1M fill that failed with RESOURCE_EXHAUSTED, decode_beyond_hbm_h200.json run 1)."""
  from rkv import generate as gen
  del mc
  s = gen.warm_up(model, batch=cfg.batch, kv_dtype=cfg.kv_dtype_name, schedule=cfg.schedule)
  log(f"rkv: layered decode programs compiled on tiny caches in {s:.1f} s")




def run_rkv(cfg: BenchConfig, log=print,
            memory_stats: Callable[[], Mapping | None] | None = None) -> list[dict[str, Any]]:
  """The rkv rows. ``memory_stats``: returns the device's ``memory_stats()`` (default: device
  0's), read for budget="auto" plans and the fill checks; tests inject one on CPU, whose
  backend reports none."""
  import jax
  from flax import nnx
  from rkv.models import Transformer, embedding_to_host, jit_forward
  mc = model_config(cfg)
  names = [c for c in cfg.configs if c.startswith("rkv_")]
  if not names:
    return []
  stats = (memory_stats or _device_memory_stats)() or {}
  limit = (int(cfg.device_memory_gib * GIB) if cfg.device_memory_gib else
           (int(stats["bytes_limit"]) if "bytes_limit" in stats else None))
  t0 = time.perf_counter()
  model = Transformer(mc, rngs=nnx.Rngs(cfg.seed), impl=cfg.impl)
  jax.block_until_ready(nnx.state(model))
  log(f"rkv: {mc.name} random init {time.perf_counter() - t0:.1f} s "
      f"({weight_bytes(mc) / GIB:.1f} GiB weights)")
  embedding = cfg.embedding
  if embedding == "host":  # before any step function snapshots the parameters
    embedding_to_host(model)
    log(f"rkv: the input embedding table in host RAM ({model.embed.nbytes / GIB:.2f} GiB)")
  forward = jit_forward(model, last_only=True)
  if "rkv_offload" in names:
    warm_layered_programs(model, mc, cfg, log)
  rows = []
  for ctx in cfg.contexts:
    ctx = int(ctx)
    cap = cfg.capacity(ctx)
    for name in names:
      row: dict[str, Any] = dict(
          config=name, context=ctx, capacity=cap, fill=cfg.fill(ctx), batch=cfg.batch,
          kv_dtype=cfg.kv_dtype_name, budget=cfg.budget if name == "rkv_offload" else None,
          kv_gib=kv_bytes(mc, cap, cfg.batch, cfg.kv_dtype_name) / GIB, tokens_per_s=None,
          bound_tokens_per_s=None, embedding=embedding)
      if cfg.kv_dtype_name == "int8":
        row["scale_dtype"] = int8_scale_dtype()
      rows.append(row)
      try:
        _fill_row(cfg, mc, model, forward, name, ctx, row, memory_stats, limit, log)
      except Exception as e:  # one failing row must not lose the others
        row["error"] = f"{type(e).__name__}: {e}"
        log(f"rkv {name} {ctx}: error: {row['error']}")
      finally:
        gc.collect()  # the row's caches are gone before the next row plans
  return rows


# ----------------------------------------------------------------------------------------------
# transformers side (torch), run in a spawned child
# ----------------------------------------------------------------------------------------------
def torch_available() -> str | None:
  """None if torch and transformers are installed, else the reason.

  Found, not imported: this is the JAX process, and importing torch here loads torch's own
  OpenMP runtime and thread pools beside the CPU-tail kernel's (the transformers rows run in a
  child process anyway)."""
  import importlib.util
  for name in ("torch", "transformers"):
    try:
      found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError) as e:
      return f"torch/transformers not importable: {type(e).__name__}: {e}"
    if not found:
      return f"torch/transformers not importable: ModuleNotFoundError: No module named '{name}'"
  return None


def _hf_config(mc, max_pos: int):
  from transformers import LlamaConfig
  kw = dict(vocab_size=mc.vocab_size, hidden_size=mc.hidden_size,
            intermediate_size=mc.intermediate_size, num_hidden_layers=mc.num_layers,
            num_attention_heads=mc.num_heads, num_key_value_heads=mc.num_kv_heads,
            head_dim=mc.head_dim, rms_norm_eps=mc.rms_norm_eps, max_position_embeddings=max_pos,
            tie_word_embeddings=mc.tie_embeddings, attn_implementation="sdpa")
  try:
    return LlamaConfig(rope_theta=mc.rope.theta, **kw)
  except TypeError:
    return LlamaConfig(**kw)


def _offloaded_kinds():
  """Offloaded cache builders transformers offers, best first: (name, build(config, cap))."""
  import inspect
  import transformers as tf
  kinds = []
  if "offloading" in inspect.signature(tf.StaticCache.__init__).parameters:
    kinds.append(("offloaded_static: StaticCache(offloading=True)",
                  lambda c, cap: tf.StaticCache(config=c, max_cache_len=cap, offloading=True)))
  if "offloading" in inspect.signature(tf.DynamicCache.__init__).parameters:
    kinds.append(("offloaded: DynamicCache(offloading=True)",
                  lambda c, cap: tf.DynamicCache(config=c, offloading=True)))
  if hasattr(tf, "OffloadedStaticCache"):
    kinds.append(("offloaded_static: OffloadedStaticCache",
                  lambda c, cap: tf.OffloadedStaticCache(config=c, max_cache_len=cap)))
  if hasattr(tf, "OffloadedCache"):
    kinds.append(("offloaded: OffloadedCache", lambda c, cap: tf.OffloadedCache()))
  return kinds


def _hf_fill(cache, hf_cfg, mc, batch, cap, fill, device, dtype, offloaded, gen):
  """Allocates every layer of ``cache`` and writes random K/V into slots ``0..fill-1``; for an
  offloaded cache every layer but the first then goes to the CPU (HF's state between steps)."""
  import torch
  if not hasattr(cache, "layers"):
    raise RuntimeError("this transformers' cache has no .layers (pre-4.56): synthetic fill "
                       "not implemented for it")
  if len(cache.layers) == 0:  # lazily replicated DynamicCache
    from transformers.cache_utils import DynamicLayer
    cache.layers.extend(DynamicLayer() for _ in range(mc.num_layers))
  fake = torch.zeros((batch, mc.num_kv_heads, 0, mc.head_dim), dtype=dtype, device=device)
  for i, layer in enumerate(cache.layers):
    try:
      layer.lazy_initialization(fake)
    except TypeError:
      layer.lazy_initialization(fake, fake)
    if layer.keys is not None and layer.keys.shape[-2] >= fill:  # static: fill in place
      layer.keys[:, :, :fill].normal_(generator=gen)
      layer.values[:, :, :fill].normal_(generator=gen)
    else:  # dynamic: the first `fill` cells
      shape = (batch, mc.num_kv_heads, fill, mc.head_dim)
      layer.keys = torch.randn(shape, dtype=dtype, device=device, generator=gen)
      layer.values = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    if offloaded and i > 0:
      layer.offload()
      if device.type == "cuda":
        torch.cuda.synchronize()
  if hasattr(cache, "cumulative_length"):
    cache.cumulative_length = fill


def _decode_hf(model, cache, context, warmup, steps, batch, device, *, pipelined=True):
  """transformers' greedy steps, timed as :func:`_decode_rkv` times rkv's (the same two modes):
  the next token and position stay on the device; ``pipelined``, step ``i+1`` is launched before
  step ``i`` is waited for (a CUDA event per step), and ``times[i]`` is the interval between the
  completion of steps ``i-1`` and ``i``."""
  import torch
  cuda = device.type == "cuda"
  tok = torch.zeros((batch, 1), dtype=torch.long, device=device)
  cp = torch.tensor([context], dtype=torch.long, device=device)
  if cuda:
    torch.cuda.synchronize()

  def done():  # a handle to wait for everything launched so far
    if not cuda:
      return None
    ev = torch.cuda.Event()
    ev.record()
    return ev

  times, last, queued = [], time.perf_counter(), None
  with torch.inference_mode():
    for _ in range(warmup + steps):
      t0 = time.perf_counter()
      out = model(input_ids=tok, past_key_values=cache, cache_position=cp,
                  position_ids=cp[None].expand(batch, -1), use_cache=True)
      tok = out.logits[:, -1].argmax(-1, keepdim=True)
      cp = cp + 1
      ev = done()
      if not pipelined:
        if ev is not None:
          ev.synchronize()
        times.append(time.perf_counter() - t0)
        continue
      if queued is not None or not cuda:
        if queued is not None:
          queued.synchronize()
        now = time.perf_counter()
        times.append(now - last)
        last = now
      queued = ev
  if queued is not None:
    queued.synchronize()
    times.append(time.perf_counter() - last)
  return times


def _dump(path: str, out: dict) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(out, f, default=str)
  os.replace(tmp, path)  # a reader never sees half a file


def run_hf(cfg: BenchConfig, log=print,
           partial_path: str | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
  """The transformers rows (call in a process whose device JAX has not claimed).
  ``partial_path``: the rows so far are written there after every row, so a child killed later
  (the host's OOM killer) still reports the rows it finished."""
  import torch
  import transformers
  from transformers import LlamaForCausalLM
  mc = model_config(cfg)
  names = [c for c in cfg.configs if c.startswith("hf_")]
  dev_name = cfg.hf_device if cfg.hf_device != "auto" else (
      "cuda" if torch.cuda.is_available() else "cpu")
  device = torch.device(dev_name)
  dtype = getattr(torch, cfg.dtype)
  env = dict(torch=torch.__version__, transformers=transformers.__version__, device=str(device),
             device_name=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu")
  limit = (int(cfg.device_memory_gib * GIB) if cfg.device_memory_gib else
           (torch.cuda.get_device_properties(0).total_memory if device.type == "cuda" else None))
  host_avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
  kinds = _offloaded_kinds()
  env["offloaded_caches_available"] = [k for k, _ in kinds]
  max_cap = max(cfg.capacity(int(c)) for c in cfg.contexts)
  hf_cfg = _hf_config(mc, max_cap)
  t0 = time.perf_counter()
  prev = torch.get_default_dtype()
  torch.set_default_dtype(dtype)
  try:
    with torch.device(device):
      model = LlamaForCausalLM(hf_cfg)
  finally:
    torch.set_default_dtype(prev)
  model = model.to(device=device, dtype=dtype).eval()
  if hasattr(model, "set_attn_implementation"):
    try:
      model.set_attn_implementation("sdpa")
    except Exception as e:  # noqa: BLE001
      env["sdpa_warning"] = str(e)
  env["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
  if device.type == "cuda":
    torch.cuda.synchronize()
  log(f"hf: LlamaForCausalLM random init {time.perf_counter() - t0:.1f} s on {device}")
  gen = torch.Generator(device=device).manual_seed(cfg.seed)
  rows = []
  for ctx in cfg.contexts:
    ctx = int(ctx)
    cap, fill = cfg.capacity(ctx), cfg.fill(ctx)
    kv = kv_bytes(mc, cap, cfg.batch)
    for name in names:
      row: dict[str, Any] = dict(config=name, context=ctx, capacity=cap, fill=fill,
                                 batch=cfg.batch, kv_dtype=cfg.kv_dtype_name, kv_gib=kv / GIB)
      rows.append(row)
      warmup, steps = cfg.steps_for(name)
      cache = None
      try:
        why = hf_unsupported(cfg)
        if why:
          row["skipped"] = why
          continue
        offloaded = name == "hf_offloaded"
        if offloaded:
          if not kinds:
            row["skipped"] = "this transformers offers no offloaded cache"
            continue
          if kv > cfg.host_memory_fraction * host_avail:
            row["skipped"] = (f"offloaded KV {kv / GIB:.1f} GiB exceeds "
                              f"{cfg.host_memory_fraction:.0%} of available host RAM "
                              f"{host_avail / GIB:.1f} GiB")
            log(f"hf {name} {ctx}: skipped: {row['skipped']}")
            continue
          kind, build = kinds[0]
          need = weight_bytes(mc) + 3 * kv // mc.num_layers + int(cfg.margin_gib * GIB)
        else:
          kind, build = "static: StaticCache", (
              lambda c, n: transformers.StaticCache(config=c, max_cache_len=n))
          need = weight_bytes(mc) + kv + int(cfg.margin_gib * GIB)
        row["hf_cache"] = kind
        why = _fits(need, limit, name)
        if why:
          row["skipped"] = why
          log(f"hf {name} {ctx}: skipped: {why}")
          continue
        t1 = time.perf_counter()
        cache = build(hf_cfg, cap)
        _hf_fill(cache, hf_cfg, mc, cfg.batch, cap, fill, device, dtype, offloaded, gen)
        row["fill_s"] = time.perf_counter() - t1
        times = _decode_hf(model, cache, fill, warmup, steps, cfg.batch, device)
        sync = _decode_hf(model, cache, fill + warmup + steps, 0, steps, cfg.batch, device,
                          pipelined=False)
        row.update(_summary(times, warmup, cfg.batch))
        row["pipelined"] = True
        row["sync_step_s"] = float(np.median(sync))
        row["sync_tokens_per_s"] = cfg.batch / row["sync_step_s"]
        log(f"hf {name} {ctx}: {row['tokens_per_s']:.2f} tok/s "
            f"(median step {1e3 * row['step_s']:.2f} ms, {kind}; each step waited for: "
            f"{row['sync_tokens_per_s']:.2f} tok/s)")
      except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {e}"
        row["traceback"] = traceback.format_exc(limit=6)
        log(f"hf {name} {ctx}: error: {row['error']}")
      finally:
        del cache
        gc.collect()
        if device.type == "cuda":
          torch.cuda.empty_cache()
        if partial_path:
          _dump(partial_path, dict(rows=rows, env=env, partial=True))
  return rows, env


def _hf_child(cfg_dict: dict, path: str) -> None:
  """Entry point of the spawned child: runs :func:`run_hf`, writes rows + env to ``path``."""
  cfg = BenchConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg_dict.items()})
  try:
    rows, env = run_hf(cfg, log=lambda m: print(m, flush=True), partial_path=path + ".partial")
    out = dict(rows=rows, env=env)
  except Exception as e:  # noqa: BLE001
    out = dict(rows=[], env={}, error=f"{type(e).__name__}: {e}",
               traceback=traceback.format_exc(limit=8))
  _dump(path, out)


def hf_unsupported(cfg: BenchConfig) -> str | None:
  """Why the transformers rows cannot run ``cfg`` (None: they can)."""
  if cfg.kv_dtype_name != _np_dtype(cfg.dtype).name:
    return (f"kv_dtype={cfg.kv_dtype_name}: transformers' static and offloaded caches hold the "
            f"model dtype ({cfg.dtype})")
  return None


def run_hf_isolated(cfg: BenchConfig, log=print, timeout_s: float = 420.0):
  """:func:`run_hf` in a spawned child process (the device is all the child's); returns
  ``(rows, env)``; rows are marked skipped when torch is missing, the kv dtype is not the
  model's, or the child fails."""
  names = [c for c in cfg.configs if c.startswith("hf_")]
  if not names:
    return [], {}
  why = hf_unsupported(cfg) or torch_available()
  if why:
    return [dict(config=n, context=int(c), batch=cfg.batch, kv_dtype=cfg.kv_dtype_name,
                 skipped=why) for c in cfg.contexts for n in names], {}
  ctx = multiprocessing.get_context("spawn")
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "hf.json")
    p = ctx.Process(target=_hf_child, args=(dataclasses.asdict(cfg), path))
    p.start()
    p.join(timeout_s)
    if p.is_alive():
      p.terminate()
      p.join(10)
      err = f"transformers child exceeded {timeout_s:.0f} s and was terminated"
    elif not os.path.exists(path):
      err = f"transformers child exited with code {p.exitcode} and no result (OOM?)"
      if os.path.exists(path + ".partial"):  # the rows it finished before it died
        with open(path + ".partial") as f:
          part = json.load(f)
        done = {(r["config"], r["context"]) for r in part["rows"]}
        # The row in flight when the child died (and any after it) gets the error.
        rows = part["rows"] + [dict(config=n, context=int(c), error=err)
                               for c in cfg.contexts for n in names
                               if (n, int(c)) not in done]
        log(f"hf: {err}; kept the {len(part['rows'])} rows it finished")
        return rows, dict(part["env"], child_error=err)
    else:
      with open(path) as f:
        out = json.load(f)
      if out.get("error"):
        log(f"hf: child error: {out['error']}\n{out.get('traceback', '')}")
        env = dict(out.get("env", {}), error=out["error"])
        return [dict(config=n, context=int(c), error=out["error"]) for c in cfg.contexts
                for n in names], env
      return out["rows"], out["env"]
  log(f"hf: {err}")
  return [dict(config=n, context=int(c), error=err) for c in cfg.contexts for n in names], {}


# ----------------------------------------------------------------------------------------------
# The whole run, outputs
# ----------------------------------------------------------------------------------------------
def _group(r: dict[str, Any]) -> tuple:
  """Rows of one context, batch and kv dtype are compared with each other."""
  return (r["context"], r.get("batch", 1), r.get("kv_dtype"))


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """``a / b`` tokens/s for each pair of :data:`RATIOS` and (context, batch, kv dtype) both rows
  measured."""
  tps = {(r["config"],) + _group(r): r.get("tokens_per_s") for r in rows}
  out = []
  for g in sorted({_group(r) for r in rows}, key=lambda g: (g[0], g[1], str(g[2]))):
    for a, b in RATIOS:
      x, y = tps.get((a,) + g), tps.get((b,) + g)
      if (a,) + g not in tps and (b,) + g not in tps:
        continue
      out.append(dict(context=g[0], batch=g[1], kv_dtype=g[2], numerator=a, denominator=b,
                      ratio=(x / y) if x and y else None))
  return out


def _sort_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  order = {c: i for i, c in enumerate(CONFIGS)}
  return sorted(rows, key=lambda r: (r["context"], r.get("batch", 1), str(r.get("kv_dtype")),
                                     order.get(r["config"], 99)))


def run(cfg: BenchConfig, log=print,
        memory_stats: Callable[[], Mapping | None] | None = None) -> dict[str, Any]:
  """Transformers rows (child process) first, then the rkv rows; returns the JSON payload."""
  t0 = time.perf_counter()
  hf_rows, hf_env = run_hf_isolated(cfg, log=log)
  rkv_rows = run_rkv(cfg, log=log, memory_stats=memory_stats)
  from rkv import benchmarking
  mc = model_config(cfg)
  rows = _sort_rows(rkv_rows + hf_rows)
  return dict(benchmarking.environment(), hf=hf_env, config=dataclasses.asdict(cfg),
              model=dict(preset=mc.name, num_layers=mc.num_layers, hidden=mc.hidden_size,
                         heads=mc.num_heads, kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                         dtype=str(np.dtype(mc.dtype)), weight_gib=weight_bytes(mc) / GIB),
              rows=rows, ratios=ratios(rows), wall_s=time.perf_counter() - t0)


_RUN_KEYS = ("time", "config", "model", "hf", "wall_s")


def merge_results(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
  """``new`` with ``old``'s rows before its own: ``rows`` holds both runs' rows (each row names
  its batch, kv dtype and budget), ``runs`` each run's ``time``, ``config``, ``model``, ``hf``
  and ``wall_s`` (an old file without ``runs`` counts as one run); the environment is the new
  run's."""
  runs = list(old.get("runs") or [{k: old.get(k) for k in _RUN_KEYS}])
  runs.append({k: new.get(k) for k in _RUN_KEYS})
  rows = _sort_rows(list(old.get("rows", [])) + list(new["rows"]))
  return dict(new, rows=rows, ratios=ratios(rows), runs=runs)


def format_table(result: dict[str, Any]) -> str:
  from rkv import benchmarking
  rows = [dict(r, step_ms=1e3 * r["step_s"] if r.get("step_s") else None,
               bound_ms=1e3 * r["bound_s"] if r.get("bound_s") else None,
               note=r.get("skipped") or r.get("error") or r.get("hf_cache") or
               r.get("planner_mode")) for r in result["rows"]]
  table = benchmarking.format_table(rows, [
      "config", "context", "batch", "kv_dtype", "budget", "kv_gib", "host_kv_gib",
      "tokens_per_s", "bound_tokens_per_s", "bound_ratio", "bound_by", "step_ms", "bound_ms",
      "n_steps", "note"])
  rat = benchmarking.format_table(result["ratios"], ["context", "batch", "kv_dtype", "numerator",
                                                     "denominator", "ratio"])
  return table + "\n\n" + rat


def _line_label(r: dict[str, Any]) -> tuple:
  return (r["config"], r.get("batch", 1), r.get("kv_dtype"), r.get("budget"))


def write_plot(result: dict[str, Any], path: str, log=print) -> str | None:
  """tokens/s against context, one line per configuration (and batch, kv dtype, budget where
  the rows differ in them), each rkv line's bound dashed beside it; None (and a message) without
  matplotlib."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError as e:
    log(f"plot skipped: matplotlib not importable ({e})")
    return None
  measured = [r for r in result["rows"] if r.get("tokens_per_s")]
  labels = sorted({_line_label(r) for r in measured}, key=lambda x: tuple(map(str, x)))
  # Name only what varies between the lines: the config, plus batch / dtype / budget if mixed.
  varies = [len({lab[i] for lab in labels if lab[i] is not None}) > 1 for i in range(4)]
  names = ("", "B=", "", "budget=")
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for lab in labels:
    pts = sorted((r["context"], r["tokens_per_s"]) for r in measured if _line_label(r) == lab)
    text = " ".join([lab[0]] + [f"{names[i]}{lab[i]}" for i in range(1, 4)
                                if varies[i] and lab[i] is not None])
    (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=text)
    # The row's bandwidth bound, dashed in the same colour (rkv rows).
    bnd = sorted((r["context"], r["bound_tokens_per_s"]) for r in measured
                 if _line_label(r) == lab and r.get("bound_tokens_per_s"))
    if bnd:
      ax.plot([p[0] for p in bnd], [p[1] for p in bnd], marker="x", linestyle="--",
              color=line.get_color(), alpha=0.6, label=f"{text} bound")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("context (tokens)")
  ax.set_ylabel("decode tokens/s (median)")
  batches = sorted({r.get("batch", 1) for r in measured}) or [result["config"]["batch"]]
  ax.set_title(f"{result['model']['preset']} decode, batch {','.join(map(str, batches))}, "
               f"{result.get('device', '')}")
  ax.grid(True, which="both", alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def write_json(result: dict[str, Any], path: str) -> None:
  from rkv import benchmarking
  benchmarking.write_json(path, result)


def _print(msg: str) -> None:
  print(msg, flush=True)  # progress lines of a long fill appear as they happen, even piped


def main(cfg: BenchConfig, out: str, plot: str | None, log=_print, *, append: bool = False,
         memory_stats: Callable[[], Mapping | None] | None = None) -> dict[str, Any]:
  """The one call the script makes: run, print the table, write JSON (``append``: added to the
  rows already in ``out``, :func:`merge_results`) and the plot (of everything written)."""
  result = run(cfg, log=log, memory_stats=memory_stats)
  if append and os.path.exists(out):
    with open(out) as f:
      result = merge_results(json.load(f), result)
  write_json(result, out)
  log(format_table(result))
  log(f"wrote {out}")
  if plot:
    p = write_plot(result, plot, log=log)
    if p:
      log(f"wrote {p}")
  return result
