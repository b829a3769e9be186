""":class:`ResidencyConfig`: how :func:`rkv.plan` places the KV cache (mode, budget, reserve, tiles,
the profile and per-figure overrides), and the planner's modes.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from rkv import tactics
from rkv.cache import DEFAULT_TILE_CELLS
from rkv.planner.budget import DEFAULT_CHUNK_TOKENS, DEFAULT_PREFETCH_TILES
from rkv.planner.layout import DEFAULT_MIN_TILE_CELLS, WINDOW_ALIGN
from rkv.planner.profile import (FIGURES, H200_DEFAULT, OPTIONAL_OVERHEADS, OPTIONAL_RATES,
                                 Profile, check_positive, default_profile_path, is_int, is_num)
from rkv.planner.shape import dtype_name

# The modes and the tactic each forces (rkv.tactics): a forcing mode is named like its tactic.
# "window", the stream mode's old name, is still accepted (ResidencyConfig renames it, warning).
MODES = tactics.MODES
MODE_TACTIC = {t: t for t in tactics.OFFLOADED}


@dataclasses.dataclass(frozen=True)
class ResidencyConfig:
  """How :func:`plan` places the KV cache.

  ``mode``: ``auto`` (per layer, the tactic with the lowest modeled time), ``resident`` (all on
  the device, else ValueError), or the tail tactic forced on every overflowing layer: ``stream``,
  ``cpu``, ``hybrid``, ``head`` (``window``: the deprecated name of ``stream``).
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
  barely exceed the cells that must leave the device (:func:`tile_candidates`), and where that is
  a single tile a layer, two, when the hybrid tactic then models faster
  (:func:`rkv.planner.placement.split_layout`); a tight budget may shrink it to
  ``min_tile_cells``. Both multiples of WINDOW_ALIGN.
  ``min_window_cells``: smallest W of an overflowing layer (0 = everything may stream).
  ``kv_dtype``: overrides the config's. ``profile`` / ``profile_path``: the figures (default: the
  profile at ``~/.cache/rkv/profile.json`` if present, else H200_DEFAULT); every figure can be
  overridden by the field of its name.
  ``host_share``: whether the CPU shares are planned with the fixed cost of rkv.offload.host_share's
  C++ thread (:meth:`Profile.for_host_share`: the probe's ``share_overhead_us``, else an estimate,
  two small copies a call) rather than the profile's fitted one; None (default): only when
  ``$RKV_HOST_SHARE=1`` is set by name when the plan is made. Decode steps run the share by
  default on a GPU either way (``host_share.default_on``); the estimate stays opt-in because on
  the H200 the splits it moved toward the CPU ran slower (session 24: 128K half 6.85 against
  7.87 tok/s).
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
  cpu_int8_share: float | None = None
  share_overhead_us: float | None = None
  host_share: bool | None = None

  def __post_init__(self):
    where = "ResidencyConfig"
    if self.host_share is not None and not isinstance(self.host_share, (bool, np.bool_)):
      raise ValueError(f"{where}: host_share must be a bool or None ($RKV_HOST_SHARE), got "
                       f"{self.host_share!r}")
    object.__setattr__(self, "mode", tactics.canonical_mode(self.mode, where))
    if self.mode not in MODES:
      raise ValueError(f"{where}: mode must be one of {MODES}, got {self.mode!r}")
    check_positive(where, "vram_target_mib", self.vram_target_mib, allow_none=False,
                    allow_zero=True)
    check_positive(where, "reserve_mib", self.reserve_mib, allow_zero=True)
    if not is_int(self.prefetch_tiles) or self.prefetch_tiles < 0:
      raise ValueError(f"{where}: prefetch_tiles must be an int >= 0, got {self.prefetch_tiles!r}")
    if not is_int(self.chunk_tokens) or self.chunk_tokens < 1:
      raise ValueError(f"{where}: chunk_tokens must be a positive int, got {self.chunk_tokens!r}")
    if not isinstance(self.check_free, (bool, np.bool_)):
      raise ValueError(f"{where}: check_free must be a bool, got {self.check_free!r}")
    for name in ("tile_cells", "min_tile_cells"):
      val = getattr(self, name)
      if not is_int(val) or val < WINDOW_ALIGN or val % WINDOW_ALIGN:
        raise ValueError(f"{where}: {name} must be a positive multiple of WINDOW_ALIGN="
                         f"{WINDOW_ALIGN}, got {val!r}")
    if self.min_tile_cells > self.tile_cells:
      raise ValueError(f"{where}: min_tile_cells={self.min_tile_cells} must be <= tile_cells="
                       f"{self.tile_cells}")
    if (not is_int(self.min_window_cells) or self.min_window_cells < 0
        or self.min_window_cells % WINDOW_ALIGN):
      raise ValueError(f"{where}: min_window_cells must be a non-negative multiple of "
                       f"WINDOW_ALIGN={WINDOW_ALIGN}, got {self.min_window_cells!r}")
    if self.kv_dtype is not None:
      dtype_name(self.kv_dtype, where, "kv_dtype")
    if self.profile is not None and not isinstance(self.profile, Profile):
      raise ValueError(f"{where}: profile must be a rkv.Profile or None, got "
                       f"{type(self.profile).__name__}")
    for name in ("pcie_gbps", "d2h_gbps", "hbm_gbps") + OPTIONAL_RATES:
      check_positive(where, name, getattr(self, name))
    for name in ("attn_overhead_us", "copy_latency_us") + OPTIONAL_OVERHEADS:
      check_positive(where, name, getattr(self, name), allow_zero=True)
    if self.overlap is not None and (not is_num(self.overlap) or not 0 <= self.overlap <= 1):
      raise ValueError(f"{where}: overlap must be in [0, 1] or None, got {self.overlap!r}")

  def host_share_on(self) -> bool:
    """``host_share``, else whether ``$RKV_HOST_SHARE=1`` is set by name, read now."""
    if self.host_share is not None:
      return bool(self.host_share)
    from rkv.offload import host_share  # jax and the share's builder: only when asked
    return host_share.share_requested()

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
