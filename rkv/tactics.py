"""The tactics: how one layer's KV cache is attended to (docs/DESIGN.md §4, step 4).

One definition, shared by the planner (its table's columns, its modes, the selector), the caches
(which cache type serves a tactic), the generation loop, the gates, the experiments' flags and
the benchmarks. A tactic is named by its string everywhere (plans, flags, JSON); :data:`SPECS`
says what each one is.
"""

from __future__ import annotations

import dataclasses
import warnings


@dataclasses.dataclass(frozen=True)
class TacticSpec:
  """``name``: what plans, flags and ``rkv.rolling_attention(tactic=...)`` say.
  ``cache``: the cache type that serves it (``"resident"``: a ResidentCache or RingCache,
  ``"rolling"``: an ``rkv.RollingKV`` with the tactic as static data, ``"head_split"``: an
  ``rkv.HeadSplitKV``). ``offloaded``: part of the KV lives in the pinned-host tail.
  ``streams``: tail tiles move host→device. ``host_kernel``: part of the tail is attended by the
  host C kernel, which needs concrete arrays (eager only, never under ``jit``). ``exact``: equal
  to resident attention (False: an approximation a user opts into per layer; ``"block"``: an
  ``rkv.sparse.BlockCache``)."""

  name: str
  cache: str
  offloaded: bool
  streams: bool
  host_kernel: bool
  exact: bool = True


# The plan table's column order.
SPECS = (
    TacticSpec("resident", cache="resident", offloaded=False, streams=False, host_kernel=False),
    TacticSpec("stream", cache="rolling", offloaded=True, streams=True, host_kernel=False),
    TacticSpec("cpu", cache="rolling", offloaded=True, streams=False, host_kernel=True),
    TacticSpec("hybrid", cache="rolling", offloaded=True, streams=True, host_kernel=True),
    TacticSpec("head", cache="head_split", offloaded=True, streams=True, host_kernel=False),
)
# Approximate tactics: opt-in per layer (rkv.sparse.sparse_plan), outside SPECS on purpose, so
# that the plan table, the selector, ``auto`` and the modes (all built from SPECS) never name them.
# "sparse" reads selected KV blocks through a VRAM block cache over a host copy (docs/DESIGN.md §9).
APPROXIMATE_SPECS = (
    TacticSpec("sparse", cache="block", offloaded=True, streams=True, host_kernel=False,
               exact=False),
)
BY_NAME = {s.name: s for s in SPECS + APPROXIMATE_SPECS}

TACTICS = tuple(s.name for s in SPECS)                                  # every tactic
OFFLOADED = tuple(s.name for s in SPECS if s.offloaded)                 # the tail tactics
ROLLING = tuple(s.name for s in SPECS if s.cache == "rolling")          # served by a RollingKV
HOST_KERNEL = tuple(s.name for s in SPECS if s.host_kernel)             # eager only
APPROXIMATE = tuple(s.name for s in APPROXIMATE_SPECS)                  # opt-in, never selected
# The selector's candidates in tie order (the first of equal modeled times wins): the tactics
# with the fewest moving parts first.
SELECTOR_ORDER = ("stream", "head", "cpu", "hybrid")

# Planner modes: "auto" (the selector picks per layer), "resident" (all on the device or an
# error), or a tail tactic forced on every overflowing layer, named like that tactic.
MODES = ("auto", "resident") + OFFLOADED
# Old mode names, still accepted with a DeprecationWarning: "window" was the stream tactic's.
DEPRECATED_MODES = {"window": "stream"}


# The hybrid split when none is given: half the tail's full tiles on the CPU.
DEFAULT_CPU_FRACTION = 0.5


def check_cpu_fraction(cpu_fraction, tactic: str, where: str) -> float | None:
  """The CPU share ``tactic`` runs with: ``hybrid``'s in [0, 1] (default
  :data:`DEFAULT_CPU_FRACTION`), None for every other tactic (a share given to one raises)."""
  if cpu_fraction is None:
    return DEFAULT_CPU_FRACTION if tactic == "hybrid" else None
  if tactic != "hybrid":
    raise ValueError(f"{where}: cpu_fraction is only valid with tactic='hybrid', got "
                     f"tactic={tactic!r}")
  if (isinstance(cpu_fraction, bool) or not isinstance(cpu_fraction, (int, float))
      or not 0.0 <= float(cpu_fraction) <= 1.0):
    raise ValueError(f"{where}: cpu_fraction must be a number in [0, 1] (the share of the tail's "
                     f"tiles attended on the CPU), got {cpu_fraction!r}")
  return float(cpu_fraction)


def spec(name: str) -> TacticSpec:
  """The :class:`TacticSpec` of ``name``; ``ValueError`` naming the known tactics otherwise."""
  if name not in BY_NAME:
    raise ValueError(f"unknown tactic {name!r}; known: {TACTICS + APPROXIMATE}")
  return BY_NAME[name]


def canonical_mode(mode: str, where: str) -> str:
  """``mode`` with a deprecated name replaced by its tactic's (and a DeprecationWarning)."""
  if mode in DEPRECATED_MODES:
    new = DEPRECATED_MODES[mode]
    warnings.warn(f"{where}: mode {mode!r} is deprecated, use {new!r} (the tactic it forces)",
                  DeprecationWarning, stacklevel=3)
    return new
  return mode
