"""Tail-tactic benchmark library (issue 4): every tactic's measured step vs the residency model.

One attention layer (default bf16, H=32, K=8, D=128, B=1, decode T=1) per context and window
fraction. In one process, so the figures are comparable (docs/DESIGN.md §7: ±15% run to run):

1. The profile: measured in this run with :func:`rkv.probe.run_probe` (H2D rate + per-put fixed
   cost, device attention rate + overhead, the cpu tactic's rate + fixed cost over a pinned_host
   tail, each hybrid side's rate under contention, host read bandwidth, copy latency), or loaded
   from ``profile_path`` (an ``rkv.Profile`` JSON, e.g. ``experiments/probe.py``'s).
2. The planner's layouts for a one-layer model whose KV budget is ``window_fraction`` of the
   resident bytes: ``rkv.plan(mode="stream")`` gives W and the tile of the rolling cache (stream,
   cpu, hybrid), ``mode="head"`` the head split (R resident KV heads — as many whole heads as the
   budget allows — plus the rolled heads' window), ``mode="auto"`` the selector's pick.
3. Measured (median after warm-up, one call per sample, ``block_until_ready``):
   ``rkv.rolling_attention`` per tactic — ``stream``; ``cpu``; ``hybrid`` at the planner's split
   and the ``hybrid_splits`` around it; ``head`` — and the all-resident baseline. Each output is
   compared with the resident one (``max_abs_err``).
4. Modeled: each measured configuration's step from :mod:`rkv.planner` with the profile of (1)
   and the configuration's actual bytes (device read, streamed tiles, CPU tiles); ``ratio =
   measured / modeled``.
5. Verdict per (context, fraction): the selector's pick vs the measured-fastest offload tactic
   (``pick_is_fastest``, ``pick_within_5pct``).
6. CPU kernel: :func:`rkv.offload.cpu_attention.cpu_attention_tail` timed alone over the cpu
   tactic's tail: read GB/s against the profile's host read bandwidth (target: >= half).

The CPU kernel runs with the tactics' threads everywhere (``cpu_threads``; None: their default,
:func:`rkv.offload.cpu_attention.tail_threads`), the probe included.

``experiments/tactics_bench.py`` is the absl front end; tiny contexts run on CPU.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np

import rkv
from rkv import benchmarking
from rkv import probe as probe_lib
from rkv import planner as residency
from rkv import rolling
from rkv.head_split import HeadSplitKV
from lab import rolling_bench
from rkv.offload import cpu_attention as cpu_lib
from rkv.offload import memory

OFFLOAD_TACTICS = residency.OFFLOAD_TACTICS  # stream, head, cpu, hybrid
WITHIN = 0.05  # "the pick is within 5% of the fastest"
CPU_READ_TARGET = 0.5  # the CPU kernel should read at >= half the host read bandwidth
_SPLIT_RE = re.compile(r"^plan([+-]\d+)?$")


@dataclasses.dataclass(frozen=True)
class TacticsConfig:
  """What :func:`run` measures. ``hybrid_splits``: hybrid rows, each ``"plan"`` (the planner's
  split), ``"plan+N"`` / ``"plan-N"`` (N more / fewer CPU tiles than the planner's), or a number
  in [0, 1] (share of the tail's tiles on the CPU); clipped to [0, n_tiles], duplicates dropped.
  ``profile_path``: use this profile instead of probing. ``probe_*``: the probe's sizes
  (``probe_tail_tiles``: tail sizes of its cpu fit, ``probe_contention_tiles``: tiles of its
  contention step, in tiles of ``min(tile_cells, probe_cpu_kv_len)``). ``cpu_threads``: the CPU
  kernel's threads in the cpu / hybrid rows, the kernel-alone timing and the probe (None: the
  tactics' default)."""

  contexts: tuple[int, ...] = (262144, 1048576)
  window_fractions: tuple[float, ...] = (0.75, 0.25)
  tactics: tuple[str, ...] = ("stream", "cpu", "hybrid", "head")
  hybrid_splits: tuple[str, ...] = ("plan", "plan-1", "plan+1")
  tile_cells: int = 32768
  batch: int = 1
  num_heads: int = 32
  num_kv_heads: int = 8
  head_dim: int = 128
  dtype: str = "bfloat16"
  impl: str = "auto"
  schedule: str = rolling.DEFAULT_SCHEDULE
  lookahead: int | None = rolling.DEFAULT_LOOKAHEAD
  warmup: int = 3
  repeats: int = 15
  resident: bool = True
  profile_path: str | None = None
  probe_transfer_mib: tuple[float, ...] = probe_lib.ProbeConfig.transfer_mib
  probe_attn_kv_lens: tuple[int, ...] = probe_lib.ProbeConfig.attn_kv_lens
  probe_cpu_kv_len: int = probe_lib.ProbeConfig.cpu_kv_len
  probe_host_read_mib: float = probe_lib.ProbeConfig.host_read_mib
  probe_tail_tiles: tuple[int, ...] = probe_lib.ProbeConfig.tail_tiles
  probe_contention_tiles: int = probe_lib.ProbeConfig.contention_tiles
  cpu_threads: int | None = None
  seed: int = 0

  def __post_init__(self):
    where = "TacticsConfig"
    for t in self.tactics:
      if t not in OFFLOAD_TACTICS:
        raise ValueError(f"{where}: tactics must be drawn from {OFFLOAD_TACTICS}, got {t!r}")
    for s in self.hybrid_splits:
      if not _SPLIT_RE.match(str(s)):
        try:
          ok = 0.0 <= float(s) <= 1.0
        except ValueError:
          ok = False
        if not ok:
          raise ValueError(f"{where}: hybrid_splits entries are 'plan', 'plan+N', 'plan-N' or a "
                           f"CPU share in [0, 1], got {s!r}")
    for f in self.window_fractions:
      if not 0.0 < float(f) < 1.0:
        raise ValueError(f"{where}: window_fractions must be in (0, 1) (a fraction of 1 is "
                         f"resident: nothing to offload), got {f!r}")
    if self.tile_cells % residency.WINDOW_ALIGN:
      raise ValueError(f"{where}: tile_cells must be a multiple of {residency.WINDOW_ALIGN}, "
                       f"got {self.tile_cells}")
    if self.schedule not in rolling.SCHEDULES:
      raise ValueError(f"{where}: schedule must be one of {rolling.SCHEDULES}, got "
                       f"{self.schedule!r}")


# ----------------------------------------------------------------------------------------------
# Profile and plans
# ----------------------------------------------------------------------------------------------
def measure_profile(cfg: TacticsConfig) -> residency.Profile:
  """The profile this run models with: ``profile_path`` if given, else :func:`rkv.probe.run_probe`
  at the benchmark's attention shape."""
  if cfg.profile_path:
    return residency.Profile.load(cfg.profile_path)
  dtype = "bfloat16" if cfg.dtype == "int8" else cfg.dtype
  tile = min(cfg.tile_cells, cfg.probe_cpu_kv_len)
  pcfg = probe_lib.ProbeConfig(
      transfer_mib=tuple(cfg.probe_transfer_mib), attn_kv_lens=tuple(cfg.probe_attn_kv_lens),
      batch=cfg.batch, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim, dtype=dtype, impl=cfg.impl, cpu=True,
      cpu_kv_len=cfg.probe_cpu_kv_len, cpu_tile_cells=tile,
      tail_tiles=tuple(cfg.probe_tail_tiles), contention_tiles=cfg.probe_contention_tiles,
      cpu_threads=cfg.cpu_threads, host_read_mib=cfg.probe_host_read_mib,
      warmup=max(cfg.warmup, 1), repeats=max(min(cfg.repeats, 7), 2))
  return probe_lib.run_probe(pcfg)


def _shape(cfg: TacticsConfig) -> residency.AttentionShape:
  return residency.AttentionShape(num_layers=1, num_kv_heads=cfg.num_kv_heads,
                                  head_dim=cfg.head_dim, layer_windows=(None,),
                                  num_heads=cfg.num_heads, kv_dtype=cfg.dtype)


def _budget_mib(cfg: TacticsConfig, context: int, frac: float) -> float:
  sz = residency.cell_sizes(_shape(cfg), cfg.batch)  # the planner's own byte arithmetic
  return sz.resident(context) * float(frac) / residency.MIB


def plans(cfg: TacticsConfig, context: int, frac: float, profile: residency.Profile) -> dict:
  """``{auto, window, head}``: the planner's LayerPlan (or None with ``errors[key]``) for one
  layer whose budget is ``frac`` of its resident bytes, with the modes ``auto``, ``stream`` (kept
  under its old name ``window`` in the JSON, like the committed results) and ``head``."""
  out, errors = {}, {}
  for key, mode in (("auto", "auto"), ("window", "stream"), ("head", "head")):
    rc = residency.ResidencyConfig(
        mode=mode, vram_target_mib=_budget_mib(cfg, context, frac), tile_cells=cfg.tile_cells,
        min_tile_cells=min(residency.DEFAULT_MIN_TILE_CELLS, cfg.tile_cells), profile=profile)
    try:
      out[key] = residency.plan(_shape(cfg), context, cfg.batch, residency=rc).layers[0]
    except ValueError as e:
      out[key], errors[key] = None, str(e)
  out["errors"] = errors
  return out


def _layer_json(lp) -> dict | None:
  if lp is None:
    return None
  d = dataclasses.asdict(lp)
  d["times"] = dict(lp.times)
  return d


# ----------------------------------------------------------------------------------------------
# The model at a measured configuration's bytes
# ----------------------------------------------------------------------------------------------
def _copy_s(cfg: TacticsConfig, profile: residency.Profile) -> float:
  return residency.partial_copy_time(profile, batch=cfg.batch, num_heads=cfg.num_heads,
                                     head_dim=cfg.head_dim,
                                     q_itemsize=4 if cfg.dtype == "float32" else 2)


def hybrid_time_at(device_read: float, tile_bytes: float, n_tiles: int, n_cpu: int,
                   profile: residency.Profile, partial_copy_s: float = 0.0) -> float | None:
  """Modeled step of a hybrid with ``n_cpu`` of ``n_tiles`` tiles on the CPU, the others streamed
  (:func:`rkv.planner.hybrid_time_at`: the model's tail term at a fixed split, contended rates
  and fixed costs included). ``n_cpu == 0`` is the stream tactic, ``n_cpu == n_tiles`` the cpu
  tactic."""
  return residency.hybrid_time_at(device_read, tile_bytes, n_tiles, n_cpu, profile,
                                  partial_copy_s)


def _kv_bytes(kv: rkv.RollingKV) -> dict:
  """Bytes attended per step: ``device_read`` (window + staging), ``tile_bytes``, ``n_tiles``."""
  n_alloc = kv.n_tail_tiles
  tile_bytes = kv.nbytes("tail") // n_alloc if n_alloc else 0
  cell = tile_bytes // kv.tile_cells if n_alloc else kv.nbytes("window") // max(kv.window_cells, 1)
  n = kv.n_full_tiles
  return dict(device_read=(kv.fill - n * kv.tile_cells) * cell, tile_bytes=tile_bytes, n_tiles=n)


def _split_tiles(spec: str, planned: int, n_tiles: int) -> int:
  m = _SPLIT_RE.match(str(spec))
  if m:
    n = planned + (int(m.group(1)) if m.group(1) else 0)
  else:
    n = math.floor(float(spec) * n_tiles + 0.5)
  return min(max(n, 0), n_tiles)


# ----------------------------------------------------------------------------------------------
# Measurement
# ----------------------------------------------------------------------------------------------
def _median_s(fn, cfg: TacticsConfig) -> float:
  return rolling_bench._median_s(fn, cfg.warmup, cfg.repeats)


def _err(out, ref) -> float | None:
  if ref is None:
    return None
  o = np.asarray(jnp.asarray(out[0], jnp.float32))
  return float(np.max(np.abs(o - ref)))


def _row(cfg, profile, *, context, frac, tactic, step_s, modeled_s, err, **extra) -> dict:
  return dict(context=context, window_fraction=frac, tactic=tactic, step_s=step_s,
              modeled_s=modeled_s,
              ratio=None if not modeled_s or step_s is None else step_s / modeled_s,
              max_abs_err=err, **extra)


def _rolling_rows(cfg, profile, cells, q, q_pos, ref, context, frac, lp_window) -> tuple:
  """stream / cpu / hybrid rows on the planner's window layout; plus the CPU kernel's GB/s."""
  rows, cpu_kernel = [], None
  kv = rkv.RollingKV.from_arrays(cells["k"], cells["v"], k_scale=cells["k_scale"],
                                 v_scale=cells["v_scale"], window_cells=lp_window.window_cells,
                                 tile_cells=lp_window.tile_cells)
  b = _kv_bytes(kv)
  copy_s = _copy_s(cfg, profile)
  layout = dict(window_cells=kv.window_cells, tile_cells=kv.tile_cells, n_tiles=b["n_tiles"],
                device_read_bytes=b["device_read"], tail_read_bytes=b["n_tiles"] * b["tile_bytes"])
  common = dict(q_pos=q_pos, impl=cfg.impl, schedule=cfg.schedule, lookahead=cfg.lookahead)

  def measure(tactic, **kw):
    if tactic in ("cpu", "hybrid"):
      kw["cpu_threads"] = cfg.cpu_threads
    call = lambda: rkv.rolling_attention(q, kv, tactic=tactic, **common, **kw)
    err = _err(call(), ref)
    return _median_s(call, cfg), err

  if "stream" in cfg.tactics:
    step, err = measure("stream")
    rows.append(_row(cfg, profile, context=context, frac=frac, tactic="stream", step_s=step,
                     modeled_s=residency.stream_time(b["device_read"], layout["tail_read_bytes"],
                                                     profile),
                     err=err, cpu_tiles=0, **layout))
  if "cpu" in cfg.tactics and b["n_tiles"]:
    step, err = measure("cpu")
    rows.append(_row(cfg, profile, context=context, frac=frac, tactic="cpu", step_s=step,
                     modeled_s=residency.cpu_time(b["device_read"], layout["tail_read_bytes"],
                                                  profile, copy_s),
                     err=err, cpu_tiles=b["n_tiles"], **layout))
    # The CPU kernel alone over the whole tail (reads the pinned_host tiles in place).
    threads = cpu_lib.tail_threads(cfg.cpu_threads)
    kernel_s = _median_s(lambda: cpu_lib.cpu_attention_tail(q, kv, q_pos=q_pos,
                                                            num_threads=threads), cfg)
    gbps = layout["tail_read_bytes"] / kernel_s / residency.GB
    host = profile.host_read_gbps
    cpu_kernel = dict(context=context, window_fraction=frac, tail_bytes=layout["tail_read_bytes"],
                      kernel_s=kernel_s, read_gbps=gbps, host_read_gbps=host, cpu_threads=threads,
                      probe_cpu_attn_gbps=profile.cpu_attn_gbps,
                      probe_cpu_overhead_us=profile.cpu_overhead_us,
                      fraction_of_host_read=None if not host else gbps / host,
                      meets_target=None if not host else gbps >= CPU_READ_TARGET * host)
  if "hybrid" in cfg.tactics and b["n_tiles"]:
    f_stream = lp_window.hybrid_fraction
    planned = (None if f_stream is None
               else round((1.0 - f_stream) * b["n_tiles"]))
    seen = set()
    for spec in cfg.hybrid_splits:
      if planned is None and _SPLIT_RE.match(str(spec)):
        continue  # no CPU figure in the profile: no planned split
      n_cpu = _split_tiles(spec, planned or 0, b["n_tiles"])
      if n_cpu in seen:
        continue
      seen.add(n_cpu)
      frac_cpu = n_cpu / b["n_tiles"]
      step, err = measure("hybrid", cpu_fraction=frac_cpu)
      rows.append(_row(cfg, profile, context=context, frac=frac, tactic="hybrid", step_s=step,
                       modeled_s=hybrid_time_at(b["device_read"], b["tile_bytes"], b["n_tiles"],
                                                n_cpu, profile, copy_s),
                       err=err, cpu_tiles=n_cpu, cpu_fraction=frac_cpu,
                       planned_split=n_cpu == planned, split=str(spec), **layout))
  del kv
  return rows, cpu_kernel


def _head_row(cfg, profile, cells, q, q_pos, ref, context, frac, lp_head) -> dict:
  r = lp_head.resident_heads
  kv = HeadSplitKV.from_arrays(cells["k"], cells["v"], resident_heads=r,
                               window_cells=lp_head.window_cells, tile_cells=lp_head.tile_cells,
                               k_scale=cells["k_scale"], v_scale=cells["v_scale"])
  resident_read = 0 if kv.resident is None else kv.resident.nbytes("window")
  if kv.rolled is not None:
    b = _kv_bytes(kv.rolled)
    dev_read, tail_read = resident_read + b["device_read"], b["n_tiles"] * b["tile_bytes"]
  else:
    dev_read, tail_read = resident_read, 0
  call = lambda: rkv.rolling_attention(q, kv, tactic="head", q_pos=q_pos, impl=cfg.impl,
                                       schedule=cfg.schedule, lookahead=cfg.lookahead)
  err = _err(call(), ref)
  step = _median_s(call, cfg)
  del kv
  return _row(cfg, profile, context=context, frac=frac, tactic="head", step_s=step,
              modeled_s=residency.head_time(dev_read, tail_read, profile), err=err,
              resident_heads=r, window_cells=lp_head.window_cells,
              tile_cells=lp_head.tile_cells, device_read_bytes=dev_read,
              tail_read_bytes=tail_read, device_bytes=lp_head.device_bytes,
              host_bytes=lp_head.host_bytes)


def _verdict(rows: list[dict], pick: str | None, context: int, frac: float) -> dict:
  """The selector's pick (for hybrid: at the planner's split) vs the fastest measured row."""
  offload = [r for r in rows if r["tactic"] in OFFLOAD_TACTICS and r["step_s"] is not None]
  fastest = min(offload, key=lambda r: r["step_s"]) if offload else None
  picked = [r for r in offload if r["tactic"] == pick and r.get("planned_split", True)]
  pick_s = picked[0]["step_s"] if picked else None
  out = dict(context=context, window_fraction=frac, pick=pick, pick_step_s=pick_s,
             fastest=None if fastest is None else fastest["tactic"],
             fastest_split=None if fastest is None else fastest.get("split"),
             fastest_step_s=None if fastest is None else fastest["step_s"],
             pick_is_fastest=None, pick_within_5pct=None, pick_over_fastest=None)
  if pick_s is not None and fastest is not None:
    out.update(pick_is_fastest=picked[0] is fastest or pick_s <= fastest["step_s"],
               pick_over_fastest=pick_s / fastest["step_s"],
               pick_within_5pct=pick_s <= fastest["step_s"] * (1 + WITHIN))
  return out


_attention_jit = jax.jit(rkv.attention, static_argnames=("impl",))


def run(cfg: TacticsConfig) -> dict:
  """Runs every row of ``cfg``; returns the JSON-ready result."""
  profile = measure_profile(cfg)
  result = dict(benchmark="tactics_bench", **benchmarking.environment(),
                config=dataclasses.asdict(cfg), host_pool_gib=memory.host_pool_bytes() / 2**30,
                cpu_threads=cpu_lib.tail_threads(cfg.cpu_threads), profile=profile.to_json(),
                figures=profile.figures(), steps=[], plans=[], verdicts=[], cpu_kernel=[])
  bcfg = rolling_bench.BenchConfig(batch=cfg.batch, num_kv_heads=cfg.num_kv_heads,
                                   head_dim=cfg.head_dim, dtype=cfg.dtype, seed=cfg.seed)
  q_dt = jnp.bfloat16 if cfg.dtype == "int8" else jnp.dtype(cfg.dtype)
  rng = np.random.default_rng(cfg.seed + 1)
  for s in cfg.contexts:
    cells = rolling_bench._data(bcfg, s)
    q = jnp.asarray(rng.standard_normal((cfg.batch, 1, cfg.num_heads, cfg.head_dim)), q_dt)
    q_pos = jnp.full((cfg.batch, 1), s - 1, jnp.int32)
    ref = resident_s = None
    nbytes = sum(x.nbytes for x in cells.values() if x is not None)
    if cfg.resident and rolling_bench._fits_on_device(nbytes):
      dev = {n: None if x is None else memory.to_device(x) for n, x in cells.items()}
      # Jitted, as the tactics' device partials are: eager op-by-op dispatch of the kernel's
      # wrapper cost more than the kernel at these sizes.
      call = lambda: _attention_jit(q, dev["k"], dev["v"], q_pos=q_pos, k_scale=dev["k_scale"],
                                    v_scale=dev["v_scale"], impl=cfg.impl)
      ref = np.asarray(jnp.asarray(call()[0], jnp.float32))
      resident_s = _median_s(call, cfg)
      del dev
    total_read = sum(x.nbytes for n, x in cells.items() if x is not None)
    for frac in cfg.window_fractions:
      frac = float(frac)
      lp = plans(cfg, s, frac, profile)
      pick = None if lp["auto"] is None else lp["auto"].tactic
      result["plans"].append(dict(context=s, window_fraction=frac,
                                  budget_mib=_budget_mib(cfg, s, frac), pick=pick,
                                  auto=_layer_json(lp["auto"]), window=_layer_json(lp["window"]),
                                  head=_layer_json(lp["head"]), errors=lp["errors"]))
      rows = [_row(cfg, profile, context=s, frac=frac, tactic="resident", step_s=resident_s,
                   modeled_s=residency.resident_time(total_read, profile), err=0.0 if ref is not
                   None else None)]
      if lp["window"] is not None and any(t != "head" for t in cfg.tactics):
        more, kernel = _rolling_rows(cfg, profile, cells, q, q_pos, ref, s, frac, lp["window"])
        rows += more
        if kernel is not None:
          result["cpu_kernel"].append(kernel)
      if "head" in cfg.tactics and lp["head"] is not None:
        rows.append(_head_row(cfg, profile, cells, q, q_pos, ref, s, frac, lp["head"]))
      result["steps"] += rows
      result["verdicts"].append(_verdict(rows, pick, s, frac))
    del cells
  return result


def write_json(result: dict, path: str) -> None:
  benchmarking.write_json(path, result)


def format_table(result: dict) -> str:
  """Steps (ms), the verdicts, and the CPU kernel's read rate."""
  ms = lambda x: None if x is None else x * 1e3
  steps = [dict(context=r["context"], W=r["window_fraction"], tactic=r["tactic"],
                split=(f"{r['cpu_tiles']}/{r['n_tiles']}{'*' if r.get('planned_split') else ''}"
                       if r["tactic"] == "hybrid" else
                       f"R={r['resident_heads']}" if r["tactic"] == "head" else None),
                step_ms=ms(r["step_s"]), model_ms=ms(r["modeled_s"]), ratio=r["ratio"],
                err=r["max_abs_err"]) for r in result["steps"]]
  verdicts = [dict(context=v["context"], W=v["window_fraction"], pick=v["pick"],
                   pick_ms=ms(v["pick_step_s"]), fastest=v["fastest"] + (
                       f"({v['fastest_split']})" if v["fastest_split"] else "")
                   if v["fastest"] else None,
                   fastest_ms=ms(v["fastest_step_s"]), pick_over=v["pick_over_fastest"],
                   is_fastest=v["pick_is_fastest"], within_5pct=v["pick_within_5pct"])
              for v in result["verdicts"]]
  kernel = [dict(context=k["context"], W=k["window_fraction"], read_gbps=k["read_gbps"],
                 host_read_gbps=k["host_read_gbps"], probe_cpu_gbps=k["probe_cpu_attn_gbps"],
                 probe_cpu_us=k.get("probe_cpu_overhead_us"), share=k["fraction_of_host_read"],
                 meets_half=k["meets_target"])
            for k in result["cpu_kernel"]]
  prof = residency.Profile.from_json(result["profile"])
  checks = probe_lib.format_checks(prof)
  return "\n".join([
      f"{result['device']} ({result['backend']}, jax {result['jax']}), CPU kernel threads "
      f"{result.get('cpu_threads', '-')}",
      f"profile: {prof.source}: {prof.describe()}",
      *(["probe's own steps vs the model:", checks] if checks else []),
      benchmarking.format_table(steps, ["context", "W", "tactic", "split", "step_ms", "model_ms",
                                        "ratio", "err"]),
      "selector pick vs measured fastest:",
      benchmarking.format_table(verdicts, ["context", "W", "pick", "pick_ms", "fastest",
                                           "fastest_ms", "pick_over", "is_fastest",
                                           "within_5pct"]),
      "CPU kernel read rate vs host read bandwidth (target >= 0.5):",
      benchmarking.format_table(kernel, ["context", "W", "read_gbps", "host_read_gbps",
                                         "probe_cpu_gbps", "probe_cpu_us", "share",
                                         "meets_half"])
      if kernel else "  (no cpu rows)"])
