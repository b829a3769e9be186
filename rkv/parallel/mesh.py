"""The device mesh of a sharded run: two named axes, ``seq`` (context parallel) and ``heads``
(KV heads and tensor parallel), and the partition specs every sharded array takes
(docs/DESIGN.md, "Several devices").

``heads`` splits the KV heads (each device attends to its own; a GQA group stays with its KV
head, so attention needs no communication) and, over the same devices, the dense layers (the
fused projections column-sharded, ``o_proj`` / ``down_proj`` row-sharded: one all-reduce each,
which XLA inserts). ``seq`` splits the cells of every layer: each device attends to its slice and
the partials ``(o, lse)`` are merged exactly across the axis. A mesh of ``seq=1`` is pure head
sharding; ``heads=1`` pure context parallel; both multiply to the number of devices.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rkv.offload import memory

SEQ = "seq"
HEADS = "heads"
AXES = (SEQ, HEADS)

# Partition specs of the activations and caches ([B,T,H,D], [B,S,K,D], [B,S], ...).
HEADS_BTHD = P(None, None, HEADS, None)   # q, k, v, o of a chunk: heads split, every seq replica
CELLS_BSKD = P(None, SEQ, HEADS, None)    # a cache's k / v: cells over seq, heads over heads
CELLS_BS = P(None, SEQ)                   # a cache's positions
REPLICATED = P()


def make_mesh(seq: int = 1, heads: int | None = None, devices=None) -> Mesh:
  """A ``(seq, heads)`` mesh over ``devices`` (default ``jax.devices()``); ``heads`` defaults to
  the devices left after ``seq``. Device ``(s, h)`` is ``devices[s * heads + h]``."""
  devices = list(jax.devices() if devices is None else devices)
  if not isinstance(seq, int) or seq < 1:
    raise ValueError(f"make_mesh: seq must be a positive int, got {seq!r}")
  if heads is None:
    if len(devices) % seq:
      raise ValueError(f"make_mesh: seq={seq} does not divide the {len(devices)} devices")
    heads = len(devices) // seq
  if not isinstance(heads, int) or heads < 1:
    raise ValueError(f"make_mesh: heads must be a positive int, got {heads!r}")
  if seq * heads > len(devices):
    raise ValueError(f"make_mesh: seq x heads = {seq} x {heads} needs {seq * heads} devices, "
                     f"{len(devices)} available")
  return Mesh(np.asarray(devices[:seq * heads], dtype=object).reshape(seq, heads), AXES)


def check_mesh(mesh, where: str) -> Mesh:
  if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != AXES:
    raise ValueError(f"{where}: mesh must be a jax.sharding.Mesh with axes {AXES} "
                     f"(rkv.parallel.make_mesh), got {mesh!r}")
  return mesh


def axis_size(mesh: Mesh, axis: str) -> int:
  return int(mesh.shape[axis])


def check_divisible(where: str, what: str, n: int, mesh: Mesh, axis: str = HEADS) -> int:
  """``n // mesh.shape[axis]``, or a ValueError when the axis does not divide ``n``."""
  size = axis_size(mesh, axis)
  if n % size:
    raise ValueError(f"{where}: {what}={n} is not divisible by the mesh axis {axis!r} of size "
                     f"{size}")
  return n // size


def sharding(mesh: Mesh, spec: P, memory_kind: str | None = None) -> NamedSharding:
  return NamedSharding(mesh, spec, memory_kind=memory_kind)


def device_grid(mesh: Mesh) -> np.ndarray:
  """``[seq, heads]`` array of the mesh's devices."""
  return mesh.devices


@dataclasses.dataclass(frozen=True)
class DeviceMemories:
  """What one device offers for a tail: the kind its tiles take and whether it is the real one."""

  device: str
  kinds: tuple[str, ...]
  tail_kind: str


def tail_memory_kind(device: jax.Device) -> str:
  """The memory kind of ``device``'s host tail: ``pinned_host`` where the device has it (a GPU;
  a CPU host device under ``--xla_force_host_platform_device_count`` also lists it), else its
  default memory (the tail then lives with the window, and only the code path is exercised)."""
  kinds = tuple(m.kind for m in device.addressable_memories())
  return memory.PINNED_HOST if memory.PINNED_HOST in kinds else device.default_memory().kind


def memories(mesh: Mesh) -> tuple[DeviceMemories, ...]:
  """Each device's memory kinds and its tail's kind, in mesh order."""
  return tuple(DeviceMemories(str(d), tuple(m.kind for m in d.addressable_memories()),
                              tail_memory_kind(d)) for d in mesh.devices.flat)
