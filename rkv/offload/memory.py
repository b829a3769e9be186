"""Memory kinds, placement helpers, the pinned-host pool check, and compiled-HLO inspection.

How the tail moves is decided by what the H200 measured (docs/DESIGN.md §5, figures in §7): a
move inside one jitted program did not overlap compute, eager ``jax.device_put`` of separate
per-tile ``pinned_host`` arrays did. So ``rkv.cache`` keeps
one ``pinned_host`` array per tile, flushes with an eager ``device_put`` to :func:`sharding`
``(PINNED_HOST)``, and ``rkv.offload.stream``'s default schedule moves tiles with eager
``device_put`` s to ``sharding(DEVICE)``.

What was verified with jax 0.11.2 on a CPU backend (the code path CI runs, docs/DESIGN.md §5):

- A CPU device has the memories ``device`` (default), ``pinned_host`` and ``unpinned_host``.
  ``jax.device_put(x, SingleDeviceSharding(dev, memory_kind="pinned_host"))`` gives an array whose
  aval prints as ``bf16<host>[...]`` and whose entry-parameter layout in the compiled HLO carries
  the host memory space ``S(5)``.
- Inside ``jit``, ``jax.device_put(host_array[i], jax.memory.Space.Device)`` lowers to
  ``dynamic_slice`` (``slice`` for a static index) + ``reshape``. For GPU (and TPU) jax then adds
  a ``custom_call @annotate_device_placement {_xla_buffer_placement="device"}``, which XLA's host
  offloader turns into an async DMA (``dynamic-slice-start/-done``, docs/DESIGN.md §7: 48.5 GB/s for
  32K-cell tiles); for CPU jax emits no placement op at all (``_common_device_put_lowering``), so
  a CPU compile cannot show transfers. ``jit(f).trace(...).lower(lowering_platforms=("cuda",))``
  works on a CPU-only install and shows the GPU placement ops: :func:`placement_report` counts
  them, so CI can check the GPU program's structure. ``jax.memory.Space.Device`` / ``.Host`` and
  ``SingleDeviceSharding(dev, memory_kind=...)`` lower the same way (the sharding form adds a
  sharding constraint); the Space form is used inside jit.
- Eager ``jax.device_put`` between ``device`` and ``pinned_host`` shardings works both ways and
  on pytrees (one call moves a tile's k, v and scales).
- A jitted ``dynamic_update_slice`` of a ``pinned_host`` array with a tile moved to
  ``Space.Host`` works; with ``donate_argnums`` on the host array the compiled module aliases
  input and output (``input_output_alias``), the buffer pointer is unchanged, and
  ``cost_analysis()["bytes accessed"]`` is the same for a 4-tile and a 64-tile tail (without
  donation it copies the whole tail: 0.3 MB vs 4.3 MB). The stacked-tail flush was built on this;
  the per-tile tail no longer needs it (a flush replaces one leaf).
- A computation on host data (``tail[i].astype(f32)`` before the ``device_put``) traces fine and
  runs on CPU; on GPU XLA turns it into slow host compute (``_xla_compute_type="host"``).
  :func:`host_compute_eqns` finds such equations in a jaxpr so tests can forbid them.
- ``jax.experimental.compute_on`` accepts ``"device_host"`` and ``"gpu_stream:N"``; neither is
  needed for streaming, noted here for the CPU-tail tactic of a later issue.
- XLA GPU flags tried on the H200 for the in-jit move (``rb_*.json``), none of which made it
  overlap: ``--xla_gpu_enable_pipelined_host_offloading``,
  ``--xla_gpu_enable_host_memory_offloading``, ``--xla_gpu_enable_highest_priority_async_stream``,
  ``--xla_gpu_enable_latency_hiding_scheduler``.

The pinned-host pool: XLA's GPU client caps pinned host memory at 64 GiB unless
``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` is set *before JAX starts* (it is read once, when the GPU
backend is created). :func:`check_host_pool` refuses a tail that would not fit, with that advice.

The device pool: XLA's GPU client takes ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the device (JAX's
default 0.75: 105 GiB of the H200's 140 GiB), also read once at start. ``import rkv`` sets it to
:data:`DEFAULT_DEVICE_MEM_FRACTION` when it still can (:mod:`rkv._env`); :func:`device_memory`
reports the pool and what happened, :func:`check_memory_fraction` warns when the pool is short of
the device, and :func:`host_memory` reads the host's RAM for the planner's host check.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import functools
import logging
import os
import re

import jax
from jax.sharding import SingleDeviceSharding

from rkv import _env
from rkv import validation
from rkv._env import (DEFAULT_DEVICE_MEM_FRACTION, FRACTION_RKV, FRACTION_TOO_LATE, FRACTION_USER,
                      MEM_FRACTION_ENV, MEM_FRACTION_ENV_NEW)

log = logging.getLogger(__name__)

DEVICE = "device"
PINNED_HOST = "pinned_host"
HOST_POOL_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
DEFAULT_HOST_POOL_GB = 64
_GIB = 1 << 30


# ----------------------------------------------------------------------------------------------
# Shardings and placement (outside jit)
# ----------------------------------------------------------------------------------------------
def default_device() -> jax.Device:
  # JAX's default device where one is set (``with jax.default_device(d)``: rkv.parallel builds
  # and attends each device's rolling cache that way, so its tail lands in *that* device's
  # pinned_host memory and its tiles stream back to it), else the first device.
  dev = jax.config.jax_default_device
  return dev if isinstance(dev, jax.Device) else jax.devices()[0]


def sharding(memory_kind: str, device: jax.Device | None = None) -> SingleDeviceSharding:
  return _cached_sharding(memory_kind, device or default_device())


@functools.lru_cache(maxsize=None)
def _cached_sharding(memory_kind: str, device: jax.Device) -> SingleDeviceSharding:
  # One object per (kind, device): the puts of every decode step reuse it.
  return SingleDeviceSharding(device, memory_kind=memory_kind)


# $RKV_DIRECT_PUTS=0: tiles move by jax.device_put instead of the direct path below.
DIRECT_PUTS_ENV = "RKV_DIRECT_PUTS"

# Why a path of our own beside jax.device_put for the streamed tiles: a decode step puts ~100
# pinned_host arrays (every hybrid layer's tiles: k, v and two scales each) and device_put's
# Python (pytree flattening, the primitive's bind, per-array sharding and copy checks) cost ~45 us
# an array on an H100 host: the next layer's early put of 16 arrays took 1.47 ms of the main
# thread there, ~0.7 ms of it before the copies were requested (docs/DESIGN.md §6). For the one
# case the tiles are (committed single-device pinned_host arrays to device memory of the same
# device) device_put ends in two calls, made here directly: jaxlib's batched copy (the C++ that
# enqueues the transfers) and jax's result handler, which gives each result the aval of its
# destination (device memory space; the batched copy alone keeps the source's host aval, and a
# jitted program would then lower the argument as host memory), inside jax's scope that marks a
# transfer explicit for jax.transfer_guard. jax 0.11.2 internals
# (jax/_src/array.py _array_shard_arg, dispatch._DeferredShardArg): when an import fails the
# tiles take jax.device_put, and tests/direct_put_test.py fails on the pinned jax until the path
# is checked again. Dev box, 16 small arrays: ~100 us against ~400 us for jax.device_put.
try:
  from jax._src import config as _jconfig
  from jax._src import dispatch as _jdispatch
  from jax._src.array import ArrayImpl as _ArrayImpl
  from jax._src.interpreters import pxla as _jpxla
  from jax._src.lib import _jax as _jxc
  _BATCHED_COPY = _jxc.batched_copy_array_to_devices_with_sharding
  _REUSE_INPUT = _jxc.ArrayCopySemantics.REUSE_INPUT
  _result_handler = _jpxla.global_aval_to_result_handler
  _dest_aval = _jdispatch.update_dp_aval
  _explicit_put = _jconfig.explicit_device_put_scope  # what jax.transfer_guard counts as explicit
  SingleDeviceSharding._device  # read by _direct_put_ok
except (ImportError, AttributeError):  # another jax: device_put
  _BATCHED_COPY = None


@functools.lru_cache(maxsize=256)
def _device_result_handler(host_aval, device: jax.Device):
  s = sharding(DEVICE, device)
  return _result_handler(_dest_aval(host_aval, s), s, True)


def direct_puts_available() -> bool:
  """Whether :func:`put_to_device` can take the direct path with this jax (see above)."""
  return _BATCHED_COPY is not None


def _direct_put_ok(xs, device: jax.Device) -> bool:
  for x in xs:
    if type(x) is not _ArrayImpl or not x._committed:
      return False
    s = x.sharding
    if (type(s) is not SingleDeviceSharding or s.memory_kind != PINNED_HOST
        or s._device != device):
      return False
  return True


def put_to_device(xs, device: jax.Device | None = None) -> list[jax.Array]:
  """Device-memory copies of ``xs`` (a sequence of arrays; None entries stay None), requested at
  once, returned at once (the copies are asynchronous): ``jax.device_put(xs, sharding(DEVICE,
  device))``, by the direct path above when every array is a committed ``pinned_host`` array of
  that device and ``$RKV_DIRECT_PUTS`` is not 0, else by ``jax.device_put`` itself."""
  device = device or default_device()
  idx = [i for i, x in enumerate(xs) if x is not None]
  arrays = [xs[i] for i in idx]
  out = list(xs)
  if not arrays:
    return out
  if (_BATCHED_COPY is not None and _direct_put_ok(arrays, device)
      and validation.env_switch(DIRECT_PUTS_ENV, True)):
    for x in arrays:
      x._check_if_deleted()  # jax's own error for a deleted (donated) array
    s = sharding(DEVICE, device)
    n = len(arrays)
    with _explicit_put():
      moved = _BATCHED_COPY(arrays, [s._internal_device_list.addressable_device_list] * n,
                            [s] * n, [_REUSE_INPUT] * n)
    moved = [_device_result_handler(x.aval, device)(y)
             for x, y in zip(arrays, moved)]
  else:
    moved = jax.device_put(arrays, sharding(DEVICE, device))
  for i, y in zip(idx, moved):
    out[i] = y
  return out


def to_device(x, device: jax.Device | None = None) -> jax.Array:
  """A fresh device-memory copy: never aliases ``x``, so the cache may donate it later."""
  return jax.device_put(x, sharding(DEVICE, device), may_alias=False)


def to_host(x, device: jax.Device | None = None) -> jax.Array:
  """A fresh ``pinned_host`` copy of ``x`` (numpy input goes straight to host, no device hop);
  ``x`` may be a pytree (one call, every leaf)."""
  return jax.device_put(x, sharding(PINNED_HOST, device), may_alias=False)


def memory_kind(x) -> str | None:
  return getattr(getattr(x, "sharding", None), "memory_kind", None)


# ----------------------------------------------------------------------------------------------
# The 64 GiB pinned-host pool
# ----------------------------------------------------------------------------------------------
def host_pool_bytes() -> int:
  """The pinned-host pool XLA's GPU client will allow: the env var if set, else 64 GiB."""
  raw = os.environ.get(HOST_POOL_ENV)
  if raw is None or raw.strip() == "":
    return DEFAULT_HOST_POOL_GB * _GIB
  try:
    return int(float(raw) * _GIB)
  except ValueError as e:
    raise ValueError(f"{HOST_POOL_ENV}={raw!r} must be a number of GiB") from e


def check_host_pool(tail_bytes: int, *, where: str, argument: str = "capacity") -> None:
  """Raises ``ValueError`` when a host tail of ``tail_bytes`` cannot fit the pinned-host pool.

  The check is the same on every backend so that a CPU dry run of a GPU configuration fails the
  same way; on CPU the env var is harmless to set.
  """
  limit = host_pool_bytes()
  if tail_bytes > limit:
    need = -(-tail_bytes // _GIB) + 1
    raise ValueError(
        f"{where}: {argument} gives a pinned-host tail of {tail_bytes / _GIB:.1f} GiB, above XLA's "
        f"pinned-host pool of {limit / _GIB:.0f} GiB. Set {HOST_POOL_ENV}={need} (or more) in the "
        f"environment before JAX starts (before the first jax call in the process), or shrink the "
        f"tail (larger window_cells, smaller {argument}, int8 KV).")


# ----------------------------------------------------------------------------------------------
# Device memory: XLA's pool, the device, the fraction
# ----------------------------------------------------------------------------------------------
# A pool below this share of the device is worth a warning: the default 0.75 is, rkv's 0.98 or a
# user's 0.95 (133 of 140 GiB on the H200) are not.
LOW_FRACTION = 0.9
JAX_DEFAULT_MEM_FRACTION = 0.75  # xla_client's default when the variable is unset


def fraction_source() -> str | None:
  """What ``import rkv`` did about ``XLA_PYTHON_CLIENT_MEM_FRACTION``: :data:`FRACTION_RKV`,
  :data:`FRACTION_USER`, :data:`FRACTION_TOO_LATE` (jax's backend existed first), or None (rkv's
  package ``__init__`` has not run the helper)."""
  return _env.fraction_source


def _env_fraction() -> str | None:
  for name in (MEM_FRACTION_ENV, MEM_FRACTION_ENV_NEW):
    raw = os.environ.get(name, "").strip()
    if raw:
      return f"{name}={raw}"
  return None


@functools.lru_cache(maxsize=None)
def _cuda_total_bytes(ordinal: int) -> int | None:
  # memory_stats() has no physical size (its keys on the H200: num_allocs, bytes_in_use,
  # peak_bytes_in_use, largest_alloc_size, bytes_limit, bytes_reserved, peak_bytes_reserved,
  # largest_free_block_bytes, pool_bytes, peak_pool_bytes). The driver's cuDeviceTotalMem needs
  # no context and allocates nothing (150,109,880,320 bytes on the H200); libcuda is loaded
  # already by JAX's CUDA plugin.
  try:
    cu = ctypes.CDLL("libcuda.so.1")
    dev, total = ctypes.c_int(), ctypes.c_size_t()
    if cu.cuInit(0) or cu.cuDeviceGet(ctypes.byref(dev), ordinal):
      return None
    if cu.cuDeviceTotalMem_v2(ctypes.byref(total), dev):
      return None
    return int(total.value) or None
  except (OSError, AttributeError):
    return None


def physical_device_bytes(device: jax.Device | None = None) -> int | None:
  """The device's physical memory in bytes, where it can be read (an NVIDIA GPU, through the CUDA
  driver); None elsewhere (CPU, other accelerators)."""
  device = device or default_device()
  if device.platform != "gpu" or "nvidia" not in str(getattr(device, "device_kind", "")).lower():
    return None
  return _cuda_total_bytes(int(device.local_hardware_id))


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
  """XLA's pool on one device. ``bytes_limit`` / ``bytes_in_use``: from ``memory_stats()`` (None
  where the backend reports none, e.g. CPU); ``physical_bytes``: the device's memory (None where
  unknown); ``fraction_source``: what ``import rkv`` did (:func:`fraction_source`);
  ``fraction_env``: the variable as set now (``NAME=value``, None: unset, JAX's 0.75)."""

  device: str
  bytes_limit: int | None
  bytes_in_use: int | None
  physical_bytes: int | None = None
  fraction_source: str | None = None
  fraction_env: str | None = None

  @property
  def free(self) -> int | None:
    """``bytes_limit - bytes_in_use``: what new buffers may still take (None: unknown)."""
    if self.bytes_limit is None:
      return None
    return self.bytes_limit - (self.bytes_in_use or 0)

  @property
  def limit_share(self) -> float | None:
    """``bytes_limit / physical_bytes`` (None: either unknown)."""
    if not self.bytes_limit or not self.physical_bytes:
      return None
    return self.bytes_limit / self.physical_bytes

  @property
  def low(self) -> bool:
    """The pool is below :data:`LOW_FRACTION` of the device (False when unknown)."""
    share = self.limit_share
    return share is not None and share < LOW_FRACTION

  def describe(self) -> str:
    gib = lambda b: "?" if b is None else f"{b / _GIB:.1f} GiB"
    if self.bytes_limit is None:
      return f"{self.device}: no memory stats"
    share = self.limit_share
    of = "" if share is None else f" ({share:.0%} of {gib(self.physical_bytes)} physical)"
    return (f"{self.device}: bytes_limit {gib(self.bytes_limit)}{of}, in use "
            f"{gib(self.bytes_in_use)}, free {gib(self.free)}; {_fraction_text(self)}")


def device_memory(device: jax.Device | None = None, *, memory_stats=None,
                  physical_bytes: int | None = None) -> DeviceMemory:
  """The pool of ``device`` (default device 0). ``memory_stats``: use these stats instead of the
  device's (planning for another machine, tests); ``physical_bytes``: the device's memory
  (default None: :func:`physical_device_bytes` of ``device``; 0: unknown, not looked up)."""
  if memory_stats is None:
    device = device or default_device()
    memory_stats = device.memory_stats()
  stats = memory_stats or {}
  limit = stats.get("bytes_limit")
  in_use = stats.get("bytes_in_use")
  if physical_bytes is None:
    try:
      physical_bytes = physical_device_bytes(device)
    except RuntimeError:  # no backend at all
      physical_bytes = None
  physical_bytes = physical_bytes or None
  name = "device" if device is None else f"{device.device_kind} ({device.platform}:{device.id})"
  return DeviceMemory(device=name, bytes_limit=None if limit is None else int(limit),
                      bytes_in_use=None if limit is None else int(in_use or 0),
                      physical_bytes=physical_bytes, fraction_source=fraction_source(),
                      fraction_env=_env_fraction())


_SOURCE_TEXT = {FRACTION_RKV: "set by rkv at import", FRACTION_USER: "set by the user",
                FRACTION_TOO_LATE: "rkv was imported after JAX had started, too late to set it",
                None: "rkv did not set it"}


def _fraction_text(mem: DeviceMemory) -> str:
  env = (f"the environment has {mem.fraction_env}" if mem.fraction_env else
         f"the environment has no {MEM_FRACTION_ENV} (JAX's default "
         f"{JAX_DEFAULT_MEM_FRACTION:g})")
  return f"{env}: {_SOURCE_TEXT.get(mem.fraction_source, mem.fraction_source)}"


def fraction_advice(mem: DeviceMemory) -> str:
  """How to give XLA more of the device (the sentence the planner's errors end with)."""
  limit = "?" if mem.bytes_limit is None else f"{mem.bytes_limit / _GIB:.1f} GiB"
  share = ("" if mem.limit_share is None else
           f", {mem.limit_share:.0%} of the device's {mem.physical_bytes / _GIB:.1f} GiB")
  return (f'jax.devices()[0].memory_stats()["bytes_limit"] is {limit}{share}; '
          f"{_fraction_text(mem)}. Set {MEM_FRACTION_ENV}={DEFAULT_DEVICE_MEM_FRACTION:g} in the "
          f"environment before JAX starts (before the first jax call in the process; importing "
          f"rkv before jax does it)")


_warned: set = set()


def check_memory_fraction(where: str, *, device: jax.Device | None = None, memory_stats=None,
                          physical_bytes: int | None = None) -> str | None:
  """Logs a warning (once per message) when XLA's pool on the device is below
  :data:`LOW_FRACTION` of its physical memory, with the variable to set; returns that message,
  or None when the pool is fine or either figure is unknown (CPU, or a device whose memory
  cannot be read). A pool the user chose (``fraction_source`` :data:`FRACTION_USER`) is logged
  at info level: they opted out."""
  mem = device_memory(device, memory_stats=memory_stats, physical_bytes=physical_bytes)
  if not mem.low:
    return None
  msg = f"{where}: XLA's device pool is short of the device: {fraction_advice(mem)}."
  if msg not in _warned:
    _warned.add(msg)
    log.log(logging.INFO if mem.fraction_source == FRACTION_USER else logging.WARNING, "%s", msg)
  return msg


# ----------------------------------------------------------------------------------------------
# Host memory
# ----------------------------------------------------------------------------------------------
def host_memory() -> tuple[int | None, int | None]:
  """``(physical, available)`` host RAM in bytes (None: unknown). Available is
  ``/proc/meminfo``'s MemAvailable where there is one (free memory plus the page cache the kernel
  can drop: a pinned tail can take it), else ``os.sysconf("SC_AVPHYS_PAGES")`` (free pages
  only)."""
  def sysconf(name):
    try:
      v = os.sysconf(name)
      return v if v > 0 else None
    except (ValueError, OSError, AttributeError):
      return None
  page = sysconf("SC_PAGE_SIZE")
  phys_pages, av_pages = sysconf("SC_PHYS_PAGES"), sysconf("SC_AVPHYS_PAGES")
  total = phys_pages * page if page and phys_pages else None
  avail = av_pages * page if page and av_pages else None
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          avail = int(line.split()[1]) * 1024
          break
  except (OSError, ValueError, IndexError):
    pass
  return total, avail


def check_host_memory(host_bytes: int, *, where: str, argument: str = "context_len",
                      memory: tuple[int | None, int | None] | None = None) -> None:
  """Raises ``ValueError`` when ``host_bytes`` of pinned tail exceed the host's available RAM
  (``memory``: ``(physical, available)``, default :func:`host_memory`; unknown: no check)."""
  total, avail = host_memory() if memory is None else memory
  if host_bytes <= 0 or avail is None or host_bytes <= avail:
    return
  raise ValueError(
      f"{where}: {argument} gives a pinned-host tail of {host_bytes / _GIB:.1f} GiB, above this "
      f"host's available memory of {avail / _GIB:.1f} GiB (physical "
      f"{'?' if total is None else f'{total / _GIB:.1f}'} GiB): pinned memory cannot be paged "
      f"out. Shrink the tail (larger vram_target_mib, smaller {argument} or batch, int8 KV), or "
      f"free host memory; plan for another machine with ResidencyConfig(check_free=False).")


# ----------------------------------------------------------------------------------------------
# jaxpr inspection: nothing may compute on host data
# ----------------------------------------------------------------------------------------------
# Only data movement may touch a host array: slicing out a tile (a DMA source), dropping the unit
# tile axis (a bitcast) and device_put itself. A dynamic_update_slice whose result stays on host is
# a write (the flush), which XLA's host offloader keeps as a DMA. Anything else becomes host
# compute on GPU (docs/DESIGN.md §5: a cast or transpose of host data silently runs on the CPU).
_HOST_MOVES = {"slice", "dynamic_slice", "squeeze", "reshape", "expand_dims", "device_put"}
_HOST_WRITES = {"dynamic_update_slice"}


def _is_host(aval) -> bool:
  space = getattr(aval, "memory_space", None)
  return space is not None and space == jax.memory.Space.Host


def _sub_jaxprs(params):
  for p in params.values():
    for s in (p if isinstance(p, (tuple, list)) else (p,)):
      if hasattr(s, "eqns"):
        yield s
      elif hasattr(s, "jaxpr") and hasattr(s.jaxpr, "eqns"):
        yield s.jaxpr


def host_compute_eqns(closed_jaxpr) -> list[str]:
  """Primitives in ``closed_jaxpr`` (recursively) that compute on host-memory values.

  An empty list means host data only moves (slice → bitcast → device_put, or a device tile moved
  to host and written with ``dynamic_update_slice``), which the GPU compiler can turn into DMA.
  Use it on ``jax.make_jaxpr(fn)(*args)``.
  """
  bad = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      subs = list(_sub_jaxprs(eqn.params))
      for s in subs:
        walk(s)
      if subs or not any(_is_host(getattr(v, "aval", None)) for v in eqn.invars):
        continue
      name = eqn.primitive.name
      if name in _HOST_MOVES:
        continue
      if name in _HOST_WRITES and all(_is_host(v.aval) for v in eqn.outvars):
        continue
      bad.append(name)

  walk(closed_jaxpr.jaxpr)
  return bad


# ----------------------------------------------------------------------------------------------
# Compiled-HLO inspection
# ----------------------------------------------------------------------------------------------
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_ASYNC_MOVES = ("copy-start", "dynamic-slice-start", "dynamic-update-slice-start", "async-start")


def _split_shape(rest: str) -> tuple[str, str, str]:
  """``'<shape> opcode(operands), attrs'`` → (shape, opcode, operands-and-attrs)."""
  rest = rest.strip()
  if rest.startswith("("):
    depth = 0
    for i, c in enumerate(rest):
      depth += c == "("
      depth -= c == ")"
      if depth == 0:
        shape, tail = rest[:i + 1], rest[i + 1:].strip()
        break
    else:
      return rest, "", ""
  else:
    shape, _, tail = rest.partition(" ")
  m = re.match(r"([\w\-]+)\((.*)$", tail)
  if not m:
    return shape, "", tail
  return shape, m.group(1), m.group(2)


def _arrays(shape: str) -> list[tuple[str, bool]]:
  """Array shapes in order, each as (``dtype[dims]``, on_host)."""
  out = []
  for m in _ARRAY.finditer(shape):
    layout = m.group(3) or ""
    out.append((f"{m.group(1)}[{m.group(2)}]", "S(5)" in layout))
  return out


def _non_scalar(arrays):
  return [a for a in arrays if not a[0].endswith("[]")]


_PLACEMENT = re.compile(r'annotate_device_placement.*?_xla_buffer_placement\s*=\s*"([\w]+)"')


def placement_report(lowered_text: str) -> dict[str, int]:
  """Memory kind → count of ``annotate_device_placement`` ops in a lowered (StableHLO) module.

  Each is one ``device_put`` inside jit (one per tile and array of a streamed tail in the
  ``"unrolled"`` schedule). Lower for GPU on any machine with
  ``jitted.trace(*args).lower(lowering_platforms=("cuda",)).as_text()``.
  """
  return dict(collections.Counter(_PLACEMENT.findall(lowered_text)))


def hlo_report(compiled_text: str) -> dict:
  """Counts host↔device data movement in a compiled HLO module (``compiled.as_text()``).

  Returns a dict:
    ``h2d_async``: async host→device moves (``dynamic-slice-start`` / ``copy-start`` /
      ``async-start`` whose source is in host memory ``S(5)`` and result is not): the DMA the
      streamed schedules want; ``d2h_async``: the reverse (a flush); ``h2d_sync`` / ``d2h_sync``:
      plain ``copy`` ops across memory spaces (a transfer that blocks its stream);
    ``host_params``: entry parameter arrays laid out in host memory (from the module header);
    ``host_compute``: instructions XLA placed on the host CPU (``_xla_compute_type="host"``: the
      slow path of docs/DESIGN.md §5);
    ``async_ops``: opcode → count of every ``*-start`` op (for eyeballing the schedule).
  On a CPU backend jax emits no placement ops, so only ``host_params`` shows; use
  :func:`placement_report` on a CUDA lowering to check a GPU program's structure from CI.
  """
  shapes: dict[str, str] = {}
  rep = dict(h2d_async=0, d2h_async=0, h2d_sync=0, d2h_sync=0, host_params=0, host_compute=0)
  async_ops: collections.Counter = collections.Counter()
  header = re.search(r"entry_computation_layout=\{\((.*?)\)->", compiled_text)
  if header:
    # The module header carries the entry layouts with their memory space (the CPU compiler
    # prints S(5) only there).
    rep["host_params"] = sum(h for _, h in _non_scalar(_arrays(header.group(1))))
  for line in compiled_text.splitlines():
    m = _INSTR.match(line)
    if not m:
      continue
    name, rest = m.groups()
    shape, opcode, operands = _split_shape(rest)
    if not opcode:
      continue
    shapes[name] = shape
    if '_xla_compute_type="host"' in rest:
      rep["host_compute"] += 1
    if opcode.endswith("-start"):
      async_ops[opcode] += 1
    arrays = _non_scalar(_arrays(shape))
    if opcode in _ASYNC_MOVES and len(arrays) >= 2:
      src_host, dst_host = arrays[0][1], arrays[-1][1]
      if src_host and not dst_host:
        rep["h2d_async"] += 1
      elif dst_host and not src_host:
        rep["d2h_async"] += 1
      elif opcode == "dynamic-update-slice-start" and dst_host:
        rep["d2h_async"] += 1
    elif opcode == "copy":
      operand = operands.split(")")[0].split(",")[0].strip().lstrip("%")
      src = _non_scalar(_arrays(shapes.get(operand, "")))
      if src and arrays:
        if src[0][1] and not arrays[0][1]:
          rep["h2d_sync"] += 1
        elif arrays[0][1] and not src[0][1]:
          rep["d2h_sync"] += 1
  rep["async_ops"] = dict(async_ops)
  return rep
