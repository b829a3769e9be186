"""The planner over several devices: one :func:`rkv.plan` per device of a ``(seq, heads)`` mesh.

A device of the mesh holds ``K / heads`` KV heads (``H / heads`` query heads) of every layer and
``ceil(context_len / seq)`` cells of each global layer (``rkv.parallel``: docs/DESIGN.md, "Several
devices"). What it must place is therefore the one-device planning problem of a smaller
attention shape and context, within its own budget: :func:`plan_sharded` builds that shape and
runs the single-device planner on it, per device, with that device's budget (a
``ResidencyConfig`` each, or one for all) and memory stats. Each device thus gets its own window,
tail and tactic (the selector of §6 per device, over that device's host link). The devices run
at once, so the modeled step is the slowest device's; the merge over ``seq`` moves only the
partials ``(o, lse)`` of one step (kilobytes), left out of the model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from rkv.planner.budget import model_sizes
from rkv.planner.config import ResidencyConfig
from rkv.planner.placement import Plan, plan
from rkv.planner.profile import MIB, is_int
from rkv.planner.shape import attention_shape


def device_share(model_config, *, seq: int, heads: int) -> tuple[dict, int]:
  """The per-device model config (``{...}``, what :func:`rkv.plan` reads): K, H and the
  intermediate size over ``heads`` (the dense weights are sharded alike), and the divisor of
  the context (``seq``)."""
  shape = attention_shape(model_config)
  where = "plan_sharded"
  h = shape.query_heads
  for name, n in (("num_kv_heads", shape.num_kv_heads), ("num_heads", h)):
    if n % heads:
      raise ValueError(f"{where}: {name}={n} is not divisible by heads={heads}")
  sizes = model_sizes(model_config)
  inter = sizes.get("intermediate_size")
  if inter is not None and inter % heads:
    raise ValueError(f"{where}: intermediate_size={inter} is not divisible by heads={heads}")
  share = dict(num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads // heads,
               num_heads=h // heads, head_dim=shape.head_dim, layer_windows=shape.layer_windows,
               kv_dtype=shape.kv_dtype, vocab_size=sizes.get("vocab_size"),
               hidden_size=sizes.get("hidden_size"),
               intermediate_size=None if inter is None else inter // heads)
  return share, seq


@dataclasses.dataclass(frozen=True)
class ShardedPlan:
  """One :class:`rkv.Plan` per device, in mesh order (device ``(s, h)`` is ``plans[s * heads +
  h]``). ``str(plan)`` prints today's plan table with a device column."""

  plans: tuple[Plan, ...]
  seq: int
  heads: int
  devices: tuple[str, ...]
  context_len: int
  batch: int

  def plan_of(self, s: int, h: int) -> Plan:
    return self.plans[s * self.heads + h]

  def layer_grid(self, layer: int) -> tuple[tuple, ...]:
    """``[seq][heads]`` LayerPlans of one layer (what ``rkv.parallel`` builds its caches from)."""
    return tuple(tuple(self.plan_of(s, h).layers[layer] for h in range(self.heads))
                 for s in range(self.seq))

  @property
  def slice_len(self) -> int:
    return math.ceil(self.context_len / self.seq)

  @property
  def fits(self) -> bool:
    return all(p.fits for p in self.plans)

  @property
  def device_bytes(self) -> int:
    return sum(p.device_bytes for p in self.plans)

  @property
  def host_bytes(self) -> int:
    return sum(p.host_bytes for p in self.plans)

  @property
  def step_time_s(self) -> float | None:
    """The slowest device's modeled attention step (the devices run at once)."""
    times = [p.step_time_s for p in self.plans]
    return None if any(t is None for t in times) else max(times)

  def tactics(self) -> tuple[tuple[tuple[str, ...], ...], ...]:
    """``[seq][heads]`` per-layer tactics of each device."""
    return tuple(tuple(self.plan_of(s, h).tactics() for h in range(self.heads))
                 for s in range(self.seq))

  def table(self) -> str:
    us = lambda t: "-" if t is None else f"{t * 1e6:.1f}"
    mib = lambda b: f"{b / MIB:.1f}"
    cols, body = None, []
    for i, p in enumerate(self.plans):
      s, h = divmod(i, self.heads)
      name = f"{self.devices[i]} (seq {s}, heads {h})"
      c, rows, total = p.table_rows()
      cols = ["device"] + c
      body += [[name] + r for r in rows] + [[name] + total]
    widths = [max(len(c), *(len(r[i]) for r in body)) for i, c in enumerate(cols)]
    fmt = lambda r: "  ".join(x.rjust(w) for x, w in zip(r, widths))
    p0 = self.plans[0]
    sh = p0.shape
    lines = [
        f"rkv sharded plan: context_len={self.context_len} batch={self.batch} mesh seq={self.seq}"
        f" x heads={self.heads}; per device: {self.slice_len} cells, K={sh.num_kv_heads} of "
        f"{sh.num_kv_heads * self.heads}, D={sh.head_dim}, kv_dtype={p0.kv_dtype}, "
        f"mode={p0.mode}",
        *(f"budget {self.devices[i]}: {mib(p.budget_bytes)} MiB "
          f"({p.budget_source or 'vram_target_mib'}); reserve {mib(p.reserve_bytes)} MiB"
          for i, p in enumerate(self.plans)),
        f"profile {p0.profile.source or p0.profile.device}: {p0.profile.describe()}",
        fmt(cols), *(fmt(r) for r in body),
        f"totals: device {mib(self.device_bytes)} MiB, host {mib(self.host_bytes)} MiB over "
        f"{len(self.plans)} devices; modeled step {us(self.step_time_s)} us (the slowest device; "
        f"per device: {', '.join(us(p.step_time_s) for p in self.plans)})"]
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.table()


def _per_device(value, n: int, name: str, kind, default):
  if value is None:
    return [default] * n
  if isinstance(value, kind):
    return [value] * n
  if isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and len(value) == n:
    return list(value)
  raise ValueError(f"plan_sharded: {name} must be one {kind.__name__} or a sequence of {n} "
                   f"(one per device), got {value!r}")


def plan_sharded(model_config, context_len: int, batch: int = 1, *, seq: int = 1,
                 heads: int = 1, residency=None, memory_stats=None, devices=None
                 ) -> ShardedPlan:
  """Plans every device of a ``seq x heads`` mesh (module docstring).

  ``residency``: one :class:`ResidencyConfig` for every device or one per device (mesh order):
  per-device budgets. ``memory_stats``: one mapping per device (default: each of ``devices``'
  ``memory_stats()`` where a budget needs it). ``devices``: the mesh's devices in mesh order
  (``mesh.devices.flat``) or their names (default ``jax.devices()[:seq * heads]`` when the
  stats are asked for, else ``device0..``). Raises ValueError naming the argument on bad input,
  or :func:`rkv.plan`'s errors for a device that cannot place its share."""
  for name, val in (("context_len", context_len), ("batch", batch), ("seq", seq),
                    ("heads", heads)):
    if not is_int(val) or val < 1:
      raise ValueError(f"plan_sharded: {name} must be a positive int, got {val!r}")
  n = seq * heads
  share, _ = device_share(model_config, seq=seq, heads=heads)
  configs = _per_device(residency, n, "residency", ResidencyConfig, ResidencyConfig())
  stats = _per_device(memory_stats, n, "memory_stats", Mapping, None)
  if devices is None and any(s is None and (not c.vram_target_mib or c.check_free)
                             for s, c in zip(stats, configs)):
    import jax
    devices = jax.devices()[:n]
  if devices is not None:
    devices = list(devices)
    if len(devices) != n:
      raise ValueError(f"plan_sharded: devices must list seq x heads = {n} devices, got "
                       f"{len(devices)}")
    stats = [st if st is not None or isinstance(d, str) else d.memory_stats()
             for st, d in zip(stats, devices)]
  names = tuple(str(d) for d in devices) if devices is not None else tuple(
      f"device{i}" for i in range(n))
  cells = math.ceil(context_len / seq)
  plans = tuple(plan(share, cells, batch, residency=configs[i], memory_stats=stats[i] or {})
                for i in range(n))
  from rkv.offload import memory
  # One process's pinned pool serves every device's tail (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB).
  host = sum(p.host_bytes for p in plans)
  memory.check_host_pool(host, where="plan_sharded", argument="context_len")
  if any(c.check_free for c in configs):
    memory.check_host_memory(host, where="plan_sharded", argument="context_len")
  return ShardedPlan(plans, seq, heads, names, context_len, batch)
