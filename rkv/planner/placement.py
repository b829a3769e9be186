""":func:`plan`: device budget → per-layer window cells, tactic table (:class:`Plan` of
:class:`LayerPlan` s) and the selector's pick (docs/DESIGN.md §4 step 1).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from collections.abc import Mapping

from rkv import tactics
from rkv.planner.budget import (Reserve, check_device_fit, format_bytes, format_number,
                                kv_budget_bytes, resolve_reserve, streamed_tile_bytes)
from rkv.planner.config import MODE_TACTIC, ResidencyConfig
from rkv.planner.cost import (OFFLOAD_TACTICS, TACTICS, ModeledTimes, cpu_share, head_time, modeled_times,
                              partial_copy_time, resident_time, select)
from rkv.planner.layout import (WINDOW_ALIGN, Layout, best_layout, cell_sizes, floor_align,
                                head_layout, layer_layout)
from rkv.planner.profile import MIB, Profile, is_int
from rkv.planner.shape import AttentionShape, attention_shape

log = logging.getLogger("rkv.planner")

CPU_KERNEL_TACTICS = tactics.HOST_KERNEL  # cpu, hybrid: they need the CPU-tail kernel
# Placements a default-budget plan makes at most while it gives the worst-case reserve's slack
# back to the window (plan()); two passes settle every case measured, the third is a margin.
RESERVE_PASSES = 3


def available_tactics(forced: str | None) -> tuple[str, ...]:
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
  cpu_fraction: float | None = None
  sliding_window: int | None = None
  # An opt-in "sparse" layer's rkv.sparse.BlockCacheConfig (rkv.sparse.sparse_plan); the
  # planner itself never sets it.
  block_cache: object | None = None

  @property
  def hybrid_fraction(self) -> float | None:
    """The share of the tail streamed by ``hybrid`` (``1 - cpu_fraction``): what plans stored
    before they stored the split as it is used; kept for readers of that name."""
    return None if self.cpu_fraction is None else 1.0 - self.cpu_fraction

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
  # Planned with the host share's fixed cost, probed or estimated (ResidencyConfig.host_share):
  # the cpu / hybrid times use Profile.for_host_share's.
  host_share: bool = False

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

  def summary(self) -> str:
    """One line: the context, the tactics by count, device and host bytes, the profile."""
    counts = {}
    for lp in self.layers:
      counts[lp.tactic] = counts.get(lp.tactic, 0) + 1
    step = self.step_time_s
    share = "; CPU shares planned at the host-share thread cost" if self.host_share else ""
    return (f"rkv plan: context_len={self.context_len} batch={self.batch} mode={self.mode}: "
            f"{', '.join(f'{v} {k}' for k, v in counts.items())}; KV device "
            f"{self.device_bytes / MIB:.1f} MiB of {self.budget_bytes / MIB:.1f} MiB budget, "
            f"host {self.host_bytes / MIB:.1f} MiB; modeled step "
            f"{'-' if step is None else f'{step * 1e6:.1f}'} us; profile "
            f"{self.profile.source or self.profile.device}{share}")

  def _host_share_line(self) -> str:
    """The table's line for a plan made with the host share's fixed cost (probed or estimated:
    Profile.for_host_share)."""
    p = self.profile
    if p.cpu_overhead_us is None:
      cost = "unmeasured (the partial's copy is modeled)"
    else:
      how = "probed" if p.share_overhead_us is not None else "estimated"
      cost = f"{p.for_host_share().cpu_overhead_us:.0f} us ({how}), not {p.cpu_overhead_us:.0f}"
    return (f"CPU shares planned for the host-share thread ($RKV_HOST_SHARE=1): a call's fixed "
            f"cost {cost}")

  def table_rows(self) -> tuple[list[str], list[list[str]], list[str]]:
    """``(columns, rows, totals)`` of :meth:`table`, as strings (``rkv.planner.plan_sharded``
    prints them per device)."""
    us = lambda t: "-" if t is None else f"{t * 1e6:.1f}"
    mib = lambda b: f"{b / MIB:.1f}"
    cols = ["layer", "kind", "tactic", "W", "P", "tile", "heads", "device_MiB", "host_MiB"]
    cols += [f"{t}_us" for t in TACTICS] + ["cpu_f"]
    rows = []
    for lp in self.layers:
      row = [str(lp.layer), lp.kind if lp.sliding_window is None else f"local:{lp.sliding_window}",
             lp.tactic, str(lp.window_cells), str(lp.tail_cells),
             "-" if lp.tile_cells is None else str(lp.tile_cells),
             "-" if lp.resident_heads is None else f"{lp.resident_heads}/{self.shape.num_kv_heads}",
             mib(lp.device_bytes), mib(lp.host_bytes)]
      row += [us(lp.times.get(t)) + ("*" if t == lp.tactic else "") for t in TACTICS]
      row.append("-" if lp.cpu_fraction is None else f"{lp.cpu_fraction:.3f}")
      rows.append(row)
    counts = {}
    for lp in self.layers:
      counts[lp.tactic] = counts.get(lp.tactic, 0) + 1
    total = ["total", f"{len(self.layers)}", ",".join(f"{k}:{v}" for k, v in counts.items()),
             "", "", "", "", mib(self.device_bytes), mib(self.host_bytes)]
    total += [""] * len(TACTICS) + [""]
    return cols, rows, total

  def table(self) -> str:
    us = lambda t: "-" if t is None else f"{t * 1e6:.1f}"
    mib = lambda b: f"{b / MIB:.1f}"
    cols, rows, total = self.table_rows()
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
        *([self._host_share_line()] if self.host_share else []),
        fmt(cols), *(fmt(r) for r in rows), fmt(total),
        f"totals: device {mib(self.device_bytes)} MiB of {mib(self.budget_bytes)} MiB budget, "
        f"host {mib(self.host_bytes)} MiB; modeled step {us(step)} us "
        f"(all resident: {us(self.resident_step_time_s)} us)"]
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.table()


def split_layout(one: Layout, two: Layout | None, profile: Profile, *, batch: int,
                 cell_bytes: int, copy_s: float, tactics) -> Layout:
  """``two`` (a host tail of at least two tiles) where its fastest modeled tactic among
  ``tactics`` beats ``one``'s (a one-tile tail), else ``one``.

  Why: the layout streaming the fewest bytes may hold a single host tile a layer, and the hybrid
  tactic splits a tail by whole tiles, so the selector can then only pick one link, PCIe or the
  CPU, and the other idles. Measured on the H200 (B=8 x 128K, default budget, alternating in one
  run, benchmarks/results/beyond_hbm/session9/a/): one 8960-cell tile a layer on the cpu tactic
  ran 35.07 / 48.36 tok/s, two 4992-cell tiles split by the hybrid 57.25 / 58.63 (modeled 182 vs
  144 ms a step). Where the fewest-bytes layout already holds several tiles, finer tiles were
  slower than this model says (1M: 16K-cell tiles 5.05 / 6.55 tok/s against 7.68 / 7.83 with 22K,
  beyond_hbm/session8/d/); session 14 timed every CPU share of the same fills at the later
  defaults and found finer tiles faster on one machine (1M: 16000-cell tiles 9.53 against 8.54)
  and slower on the next (8.07 / 8.31 against 8.73, beyond_hbm/session14/), so only the one-tile
  case is reconsidered."""
  if two is None:
    return one

  def fastest(lay: Layout) -> float:
    mt = modeled_times(lay.device_read, lay.host_read, profile, partial_copy_s=copy_s,
                       tile_bytes=batch * lay.tile * cell_bytes)
    times = [t for t in (getattr(mt, name) for name in tactics) if t is not None]
    return min(times) if times else math.inf

  t_one, t_two = fastest(one), fastest(two)
  log.debug("plan: one host tile a layer (tile=%d, W=%d) modeled %.1f us; two (tile=%d, W=%d) "
            "%.1f us", one.tile, one.window, t_one * 1e6, two.tile, two.window, t_two * 1e6)
  return two if t_two < t_one else one


def check_profile_device(profile, device_kind: str | None = None) -> bool:
  """Logs which profile plans, and warns when it was measured on another kind of device than
  the one planned for (``device_kind``, default device 0's): its rates and fixed costs are then
  another machine's, and the tactic table may be wrong (``rkv calibrate`` or
  ``experiments/probe.py`` measures this one). Returns whether the kinds match (True when either
  is unknown)."""
  if device_kind is None:
    import jax
    device_kind = getattr(jax.devices()[0], "device_kind", "") or ""
  log.debug("plan: profile %s (measured on %s)", profile.source or "<unnamed>",
           profile.device or "an unrecorded device")
  if not profile.device or not device_kind or profile.device == device_kind:
    return True
  warnings.warn(f"plan: the profile ({profile.source or 'unnamed'}) was measured on "
                f"{profile.device!r}, but this device is {device_kind!r}: its rates and fixed "
                f"costs are another machine's; run `rkv calibrate` to measure this one",
                stacklevel=3)
  return False


# Once per process (a notebook plans many times): see check_builtin_profile.
_BUILTIN_PROFILE_WARNED = []
# The figures that place KV between PCIe and the host's cores.
_HOST_FIGURES = ("cpu_attn_gbps", "cpu_overhead_us", "host_read_gbps", "hybrid_pcie_gbps",
                 "hybrid_cpu_gbps", "cpu_int8_share")


def check_builtin_profile(profile, tactics_used, platform: str | None = None) -> bool:
  """Warns (once per process) when a plan for a GPU sends KV to the host CPU kernel on the
  built-in :data:`~rkv.planner.profile.H200_DEFAULT` (its host figures not overridden) rather
  than a probe of this machine: the split between PCIe and the host's cores rests on that
  profile's CPU figures, and hosts with the same GPU differ. Measured (docs/DESIGN.md §7,
  session 16): a host whose own probe read 63-70 GB/s and paid 3.3-4.5 ms a kernel call (the
  built-in profile: 97 GB/s, 2.2 ms) ran the 1M row at 4.31 tok/s planned hybrid on the built-in
  figures and 6.57 planned stream on its own.
  ``platform``: the backend planned for (default: device 0's). Returns whether it warned."""
  from rkv.planner.profile import H200_DEFAULT
  if profile.source != H200_DEFAULT.source or _BUILTIN_PROFILE_WARNED:
    return False
  if any(getattr(profile, f) != getattr(H200_DEFAULT, f) for f in _HOST_FIGURES):
    return False  # the caller set the host side's figures (ResidencyConfig overrides)
  if not any(t in CPU_KERNEL_TACTICS for t in tactics_used):
    return False
  if platform is None:
    import jax
    platform = jax.devices()[0].platform
  if platform != "gpu":
    return False
  _BUILTIN_PROFILE_WARNED.append(True)
  warnings.warn("plan: the cpu/hybrid layers are split on the built-in H200_DEFAULT profile's "
                "host figures, not this machine's; hosts differ (one measured 1.5x slower at 1M "
                "tokens as planned so, docs/DESIGN.md §7): run `rkv calibrate` once (a ~20 s "
                "probe, written to ~/.cache/rkv/profile.json, which plans then read)",
                stacklevel=4)
  return True


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
    if not is_int(val) or val < 1:
      raise ValueError(f"plan: {name} must be a positive int, got {val!r}")
  shape = attention_shape(model_config, cfg.kv_dtype)
  profile = cfg.resolve_profile()
  check_profile_device(profile)
  # The model's figures for this cache's dtype (an int8 tail is attended on the CPU at its own
  # rate: Profile.for_kv_dtype); the plan keeps the profile as resolved.
  kv_profile = profile.for_kv_dtype(shape.kv_dtype)
  # Asked for (ResidencyConfig.host_share): a CPU share in the C++ thread modeled as paying two
  # stream-ordered copies a call, not the fitted chain (Profile.for_host_share), so its split
  # moves toward the CPU. Not the default: on the H200 those splits ran slower (session 24).
  host_share = cfg.host_share_on()
  if host_share:
    kv_profile = kv_profile.for_host_share()
  sz = cell_sizes(shape, batch)
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
  # (tiles of tile_cells, the most any layer streams; narrowed to the plan's own tiles below,
  # after a first placement). An explicit target: the reserve is that
  # of the plan made (its largest streamed tile), and the plan is checked against free memory.
  reserve = None if explicit else resolve_reserve(cfg, shape, batch, model_config,
                                                  context_len=context_len)
  budget = kv_budget_bytes(cfg, memory_stats=stats, reserve=reserve)
  budget_src = (f"vram_target_mib={format_number(cfg.vram_target_mib)}, "
                f"{cfg.vram_target_mib / 1024:.3g} GiB" if explicit else
                "vram_target_mib=0: free device memory minus the reserve")
  if reserve is not None:
    log.debug("plan: budget %s = free %s - reserve %s (%s)", format_bytes(budget), format_bytes(free),
             format_bytes(reserve.total), reserve.describe())

  def finish(layers, budget, reserve) -> Plan:
    res = reserve
    if res is None:
      res = resolve_reserve(cfg, shape, batch, model_config, context_len=context_len,
                            tile_bytes=streamed_tile_bytes(layers, sz))
      log.debug("plan: %s; reserve %s (%s)%s", budget_src, format_bytes(res.total), res.describe(),
               "" if free is None else f"; device free {format_bytes(free)}")
    result = Plan(layers=tuple(layers), context_len=context_len, batch=batch, mode=cfg.mode,
                  kv_dtype=shape.kv_dtype, budget_bytes=budget, profile=profile, shape=shape,
                  budget_source=budget_src, reserve=res, free_bytes=free,
                  host_share=host_share)
    memory.check_host_pool(result.host_bytes, where="plan", argument="context_len")
    # The one line a plan logs at INFO; the figures behind it are DEBUG (and in the table).
    log.info("%s", result.summary())
    if cfg.check_free:  # a plan for this machine (check_free=False: for another one)
      if explicit and has_stats:
        check_device_fit(result, cfg, stats, resolve_reserve(cfg, shape, batch, model_config,
                                                             context_len=context_len))
      memory.check_host_memory(result.host_bytes, where="plan", argument="context_len")
      check_builtin_profile(profile, result.tactics())  # a plan that stands: is it this host's?
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

  def place(budget) -> tuple:
    if need_resident <= budget:
      layers = tuple(resident_layer(i, ring.get(i, context_len)) for i in range(shape.num_layers))
      log.debug("plan: the whole cache fits (%s of %s): every layer resident",
               format_bytes(need_resident), format_bytes(budget))
      return layers
    if cfg.mode == "resident":
      raise ValueError(f"plan: mode='resident' needs {format_bytes(need_resident)} of device memory "
                       f"for the KV cache, but {budget_src} gives {format_bytes(budget)}: raise "
                       f"vram_target_mib or pick an offloading mode")

    forced = MODE_TACTIC.get(cfg.mode)
    per_layer = (budget - ring_bytes) // len(glob) if glob else 0
    win = best_layout(sz, context_len, per_layer, cfg) if per_layer > 0 else None
    heads = head_layout(sz, context_len, per_layer, cfg) if per_layer > 0 else None
    usable = heads if forced == "head" else (win or heads) if forced is None else win
    if usable is None:
      # The smallest layout: W = min_window_cells (0 for "head"), one staging tile of
      # min_tile_cells (or the whole context when shorter), every cell's position.
      tile = min(cfg.min_tile_cells, floor_align(context_len)) or WINDOW_ALIGN
      w_min = 0 if forced == "head" else cfg.min_window_cells
      per_min = layer_layout(sz, context_len, min(w_min, context_len), min(tile, context_len)
                        ).device_bytes
      need = ring_bytes + len(glob) * per_min
      raise ValueError(
          f"plan: {budget_src} gives a KV budget of {format_bytes(budget)}, below the minimum layout "
          f"of about {format_bytes(need)}: {len(local)} sliding-window rings "
          f"({format_bytes(ring_bytes)}) + {len(glob)} global layers x {format_bytes(per_min)} (W={w_min}"
          f", one staging tile of {tile} cells, positions). Raise vram_target_mib to at least "
          f"{math.ceil(need / MIB)} MiB, or shorten context_len / batch, or use an int8 kv_dtype.")

    log.debug("plan: %d global layers overflow; budget %s, rings %s, %s per global layer; "
             "profile %s: %s", len(glob), format_bytes(budget), format_bytes(ring_bytes),
             format_bytes(per_layer), profile.source or profile.device, profile.describe())
    # With a prefetcher (layered_forward's, prefetch_tiles > 0) a layer's streamed tiles are
    # requested while the layers before it run, so the per-stream fixed cost (0.79 ms on the H200,
    # the request and first-tile latency) is paid under other work, not once per layer: the
    # stream and hybrid times are modeled without it. The head tactic's rolled heads stream inside
    # their own call (no prefetch), so its time keeps it.
    stream_profile = (kv_profile.replace(transfer_overhead_us=0.0) if cfg.prefetch_tiles
                      else kv_profile)
    candidates = available_tactics(forced) if cfg.check_free else OFFLOAD_TACTICS
    if (win is not None and win.host_cells == win.tile and forced in (None, "hybrid")
        and "hybrid" in candidates):
      win = split_layout(win, best_layout(sz, context_len, per_layer, cfg, min_host_tiles=2),
                         stream_profile, batch=batch, cell_bytes=sz.cell, copy_s=copy_s,
                         tactics=[forced] if forced else [t for t in candidates if t != "head"])
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
        log.debug("plan: layer %d -> %s (modeled us: %s; hybrid streams %.3f of the tail; W=%d "
                 "P=%d tile=%d)", i, tactic,
                 ", ".join(f"{k}={'-' if v is None else f'{v * 1e6:.1f}'}" for k, v in times.items()),
                 mt.hybrid_fraction or 0.0, lay.window, context_len - lay.window, lay.tile)
      layers.append(LayerPlan(
          layer=i, kind="global", tactic=tactic, capacity=context_len, window_cells=lay.window,
          tail_cells=context_len - lay.window, tile_cells=lay.tile, host_cells=lay.host_cells,
          resident_heads=lay.resident_heads if tactic == "head" else None,
          device_bytes=lay.device_bytes, host_bytes=lay.host_bytes, times=times,
          cpu_fraction=cpu_share(mt.hybrid_fraction)))
    return tuple(layers)

  layers = place(budget)
  if reserve is not None and any(lp.host_bytes for lp in layers):
    # vram_target_mib=0: the first reserve counted tiles of tile_cells, the largest any layer may
    # stream; the plan's own tiles are often smaller (batch rows shrink them: at B=8 x 128K the
    # worst case held 5 GiB of the 140 for tiles of 1 GiB where the plan streams 0.4 GiB ones,
    # and 4 GiB of window went to the host). Give the slack back to the window and place again
    # (a plan that keeps everything on the device has no use for it, and keeps it);
    # a placement is kept only when its own tiles fit the reserve it was budgeted with, and a
    # placement whose tiles need more is retried with what they need (while that is smaller).
    need = resolve_reserve(cfg, shape, batch, model_config, context_len=context_len,
                           tile_bytes=streamed_tile_bytes(layers, sz))
    for _ in range(RESERVE_PASSES):
      if need.total >= reserve.total:
        break
      trial_budget = kv_budget_bytes(cfg, memory_stats=stats, reserve=need)
      trial = place(trial_budget)
      trial_need = resolve_reserve(cfg, shape, batch, model_config, context_len=context_len,
                                   tile_bytes=streamed_tile_bytes(trial, sz))
      if trial_need.total <= need.total:
        log.debug("plan: reserve %s -> %s (the plan's own tiles); budget %s -> %s",
                  format_bytes(reserve.total), format_bytes(need.total), format_bytes(budget),
                  format_bytes(trial_budget))
        layers, reserve, budget = trial, need, trial_budget
      need = trial_need
  return finish(layers, budget, reserve)
