"""Attention over host-resident KV cells on the host CPU: the ``cpu`` tail tactic's kernel.

Only the query goes down to the host; the host reads the tail where it lives and returns the
small float32 partial ``(o [B,T,H,D], lse [B,T,H])``, to be merged on the GPU with the window's
partial by :func:`rkv.merge` (exact LSE merge, docs/DESIGN.md §2). The work is the multi-threaded C
kernel ``cpu_kernel.c`` (OpenMP over batch rows x chunks of cells, every K/V byte read once for
all G*T query rows of its KV head, float32 online softmax; AVX2 on x86-64-v3, plus a 512-bit path
on AVX-512 hosts: x86-64-v4, which :mod:`rkv.offload.cpu_build` picks there and builds;
:func:`kernel_isa` says which the loaded library has). jnp on the host measured 1.8 GB/s
(docs/DESIGN.md §7); this kernel is measured by :func:`measure_cpu_attention` against
:func:`measure_host_read_bandwidth`.

Inputs are read **in place** through a pointer and element strides, never copied:
- numpy arrays (``bfloat16`` is ``ml_dtypes.bfloat16``): any strides with a contiguous head dim;
- ``jax.Array`` s in host memory (``pinned_host`` on a GPU, any memory kind on the CPU backend):
  through ``unsafe_buffer_pointer()`` after ``block_until_ready()`` (a pending flush completes
  first), with the layout checked to be plain row-major. A cache tail's tiles are checked once and
  their pointers reused while each tile array lives (``_tile_buffer``).

Zero-copy access to ``pinned_host`` jax arrays (jax 0.11.2), what was found:
- ``np.asarray(x)`` is zero-copy **only when the buffer belongs to a CPU device** (jaxlib's
  ``IsZeroCopyableCpuBuffer`` requires ``buffer->IsOnCpu()``; on the CPU backend the numpy data
  pointer equals ``x.unsafe_buffer_pointer()``, checked by ``tests/cpu_attention_test.py``). On a
  GPU client a ``pinned_host`` buffer belongs to the GPU device, so ``np.asarray`` takes the
  copy path (``CopyToHostAsync``) and even caches the copy in ``x._npy_value`` for the array's
  lifetime: a full tail copy per flush and twice the host memory. Not usable for the tail.
- DLPack: ``np.from_dlpack`` refuses bfloat16 ("Unsupported dtype in DLTensor").
- ``x.unsafe_buffer_pointer()`` returns the PJRT buffer's opaque data pointer. For a
  ``pinned_host`` buffer of the GPU client that is the page-locked host allocation (unified
  virtual addressing: host and device see one address), so the host can read it directly.
  This is the path used here; on the CPU backend it is verified by pointer equality, on the H200
  it must be confirmed once with :func:`check_host_pointer` (compares bytes read through the
  pointer with a copy). It does not wait for pending writes, hence the ``block_until_ready``.
- Cacheability: write-combined pinned memory reads ~100x slower on a CPU. XLA's GPU host
  allocator (``GpuDriver::HostAllocate``) uses ``cuMemHostAlloc(..., CU_MEMHOSTALLOC_PORTABLE)``,
  i.e. ordinary cacheable pages, so the tail should read at host memory speed; timing
  :func:`cpu_attention_tail` on a real tail on the H200 host is the check.

The cache's tail is a tuple of per-tile ``pinned_host`` arrays (``kv.tail.k[i]``: ``[B,tile,K,D]``),
so the kernel takes a table of tile base pointers with strides shared by all tiles; a flat
``[B,S,K,D]`` array (one tile) and a stacked ``[N,B,tile,K,D]`` one are the same table.
Positions stay on the device in the cache (4 bytes a cell): :func:`cpu_attention_tail` takes
``np.asarray`` of each used tile's positions; on a GPU that copies once per tile (0.1% of the
tile's bytes at K=8, D=128) and jax caches the copy on that array, which a flush leaves alone;
the positions are the same for every layer, so a caller may also pass ``tail_pos`` once per step.

Rows that see no key return ``o = 0, lse = -inf``; slots with ``k_pos < 0`` are never read.
The split into work items depends only on the shapes, so results are bit-identical for any
``num_threads``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import os
import threading
import time
import weakref

import jax
import ml_dtypes
import numpy as np

from rkv.offload import cpu_build
from rkv.offload import memory
from rkv import validation

_DTYPE_CODES = {np.dtype(np.float32): 0, np.dtype(ml_dtypes.bfloat16): 1,
                np.dtype(np.float16): 2, np.dtype(np.int8): 3}
_QUERY_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))
# int8 scales the kernel reads in place (scale_dtype codes, = _DTYPE_CODES's): the cache keeps
# them in bfloat16 (half the tail's scale bytes); float32 stays accepted.
_SCALE_CODES = {np.dtype(np.float32): 0, np.dtype(ml_dtypes.bfloat16): 1}
_HOST_KINDS = ("pinned_host", "unpinned_host")


class _Args(ctypes.Structure):
  """Mirror of ``rkv_attn_args`` in cpu_kernel.c (ABI version 4)."""

  _fields_ = [
      ("q", ctypes.c_void_p), ("q_pos", ctypes.c_void_p),
      ("k_tiles", ctypes.POINTER(ctypes.c_void_p)), ("v_tiles", ctypes.POINTER(ctypes.c_void_p)),
      ("ks_tiles", ctypes.POINTER(ctypes.c_void_p)), ("vs_tiles", ctypes.POINTER(ctypes.c_void_p)),
      ("pos_tiles", ctypes.POINTER(ctypes.c_void_p)),
      ("batch", ctypes.c_int64), ("q_len", ctypes.c_int64), ("num_heads", ctypes.c_int64),
      ("num_kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64),
      ("n_tiles", ctypes.c_int64), ("tile", ctypes.c_int64),
      ("k_strides", ctypes.c_int64 * 3), ("v_strides", ctypes.c_int64 * 3),
      ("ks_strides", ctypes.c_int64 * 3), ("vs_strides", ctypes.c_int64 * 3),
      ("pos_strides", ctypes.c_int64 * 2),
      ("dtype", ctypes.c_int32), ("scale_dtype", ctypes.c_int32), ("causal", ctypes.c_int32),
      ("window", ctypes.c_int64),
      ("softcap", ctypes.c_float), ("scale", ctypes.c_float),
  ]


# The loaded library per $RKV_CPU_KERNEL_SO value: finding it (the build key's stat of the
# source, the cached .so's) took ~0.2 ms a call on the dev box, twice per CPU-tail call, on the
# host path that bounds offloaded decode. A source edited mid-process is not rebuilt.
_LOADED: dict[str | None, ctypes.CDLL] = {}


def _lib() -> ctypes.CDLL:
  key = os.environ.get(cpu_build.SO_ENV)
  lib = _LOADED.get(key)
  if lib is not None:
    _set_worker_nice(lib)
    return lib
  lib = cpu_build.load_library()
  _LOADED[key] = lib
  if not getattr(lib, "_rkv_typed", False):
    lib.rkv_cpu_attention.argtypes = [ctypes.POINTER(_Args), ctypes.c_int, ctypes.c_int64,
                                      ctypes.c_void_p, ctypes.c_void_p]
    lib.rkv_cpu_attention.restype = ctypes.c_int
    lib.rkv_cpu_attention_chunk.argtypes = [ctypes.c_int64] * 5
    lib.rkv_cpu_attention_chunk.restype = ctypes.c_int64
    lib.rkv_read_sum.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.rkv_read_sum.restype = ctypes.c_uint64
    lib.rkv_fill.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    lib.rkv_fill.restype = None
    lib.rkv_cpu_kernel_max_threads.restype = ctypes.c_int
    lib.rkv_cpu_kernel_set_worker_nice.argtypes = [ctypes.c_int]
    lib.rkv_cpu_kernel_set_worker_nice.restype = None
    lib._rkv_typed = True
    lib._rkv_nice_env = None
  _set_worker_nice(lib)
  return lib


# The nice value of the kernel's helper threads (cpu_kernel.c, apply_worker_nice): 0 (the
# default) leaves them as they are; 1-19 lets PJRT's threads, which enqueue the streamed tiles'
# copies, take a core from the kernel's team at once (docs/DESIGN.md section 6).
WORKER_NICE_ENV = "RKV_CPU_KERNEL_NICE"


def worker_nice() -> int:
  """``$RKV_CPU_KERNEL_NICE`` as a nice value in 0..19 (0 when unset)."""
  env = os.environ.get(WORKER_NICE_ENV, "").strip()
  if not env:
    return 0
  try:
    n = int(env)
  except ValueError:
    n = -1
  if not 0 <= n <= 19:
    raise ValueError(f"${WORKER_NICE_ENV} must be a nice value from 0 to 19, got {env!r}")
  return n


def _set_worker_nice(lib: ctypes.CDLL) -> None:
  # Read on every load lookup (one environ get; parsed only when it changed), so a value set
  # after the library was loaded applies to the next kernel call.
  env = os.environ.get(WORKER_NICE_ENV)
  if env != lib._rkv_nice_env:
    lib.rkv_cpu_kernel_set_worker_nice(worker_nice())
    lib._rkv_nice_env = env


def kernel_isa() -> str:
  """The vector code of the loaded kernel, for benchmark records: ``"avx512"`` (x86-64-v4 build:
  head dims D % 16 == 0 take the 512-bit path, other D the 256-bit one), ``"avx2"``
  (x86-64-v3 build) or ``"portable"`` (plain C, e.g. aarch64). Loads (builds) the library."""
  lib = _lib()
  if cpu_build.library_has_avx512(lib):
    return "avx512"
  return "avx2" if lib.rkv_cpu_kernel_has_avx2() else "portable"


def max_threads() -> int:
  """Threads the kernel uses by default (OpenMP's default: ``$OMP_NUM_THREADS`` or all cores)."""
  return _lib().rkv_cpu_kernel_max_threads()


# The cpu / hybrid tactics (rkv.rolling_attention) leave this many of OpenMP's threads to the
# rest of the process: while the kernel runs, the Python thread dispatches the device partials
# and, in a hybrid, issues every streamed tile's transfer, and PJRT's threads drive the copies.
# With every core in the kernel those threads wait for a core, and each wait delays the tile
# transfers queued behind it; the kernel is bound by host memory bandwidth, so one thread fewer
# costs it little. Override per call with rolling_attention(cpu_threads=N), or for the process
# with $RKV_CPU_TAIL_THREADS (a thread count). rkv.probe measures with the same setting.
TAIL_RESERVED_THREADS = 1
TAIL_THREADS_ENV = "RKV_CPU_TAIL_THREADS"


def tail_threads(num_threads: int | None = None) -> int:
  """The kernel threads of the cpu / hybrid tactics: ``num_threads`` if given, else
  ``$RKV_CPU_TAIL_THREADS``, else OpenMP's default (:func:`max_threads`) minus
  :data:`TAIL_RESERVED_THREADS`, at least 1."""
  where = "tail_threads"
  if num_threads is not None:
    _check_int(num_threads, "num_threads", where)
    return int(num_threads)
  env = os.environ.get(TAIL_THREADS_ENV, "").strip()
  if env:
    try:
      n = int(env)
    except ValueError:
      n = 0
    if n < 1:
      raise ValueError(f"{where}: ${TAIL_THREADS_ENV} must be a positive thread count, got "
                       f"{env!r}")
    return n
  return max(1, max_threads() - TAIL_RESERVED_THREADS)


# ----------------------------------------------------------------------------------------------
# Host buffers: pointer + element strides, from numpy or a host-memory jax.Array
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HostBuffer:
  """A host array seen through its data pointer: ``ptr``, ``shape``, ``dtype``, element
  ``strides``; ``owner`` keeps the memory alive (the numpy array or the jax.Array)."""

  ptr: int
  shape: tuple[int, ...]
  dtype: np.dtype
  strides: tuple[int, ...]
  owner: object


def host_buffer(x, *, name: str = "x", where: str = "host_buffer") -> HostBuffer:
  """``x`` (numpy, or a single-device ``jax.Array`` in host memory) as a :class:`HostBuffer`.

  Never copies a jax.Array; a numpy array is copied only if its last axis is not contiguous.
  Raises ``ValueError`` for a jax.Array in device memory of an accelerator, a deleted (donated)
  array, a sharded one, or a non-row-major layout.
  """
  if isinstance(x, jax.Array):
    validation.check_not_deleted(where, name, x)
    devices = x.sharding.device_set
    if len(devices) != 1:
      raise ValueError(f"{where}: {name} must be a single-device array, got {len(devices)} devices")
    platform = next(iter(devices)).platform
    kind = memory.memory_kind(x)
    if platform != "cpu" and kind not in _HOST_KINDS:
      raise ValueError(f"{where}: {name} must live in host memory (memory kind pinned_host), got "
                       f"memory kind {kind!r} on {platform}: the CPU kernel cannot read it")
    layout = getattr(getattr(x, "format", None), "layout", None)
    if layout is not None and (tuple(layout.major_to_minor) != tuple(range(x.ndim)) or
                               tuple(getattr(layout, "tiling", ()) or ())):
      raise ValueError(f"{where}: {name} has layout {layout}; the CPU kernel reads row-major only")
    x.block_until_ready()  # a pending flush into the tail must land before the host reads it
    strides, acc = [], 1
    for n in reversed(x.shape):
      strides.append(acc)
      acc *= n
    return HostBuffer(ptr=x.unsafe_buffer_pointer() if x.size else 0, shape=tuple(x.shape),
                      dtype=np.dtype(x.dtype), strides=tuple(reversed(strides)), owner=x)
  a = np.asarray(x)
  item = a.dtype.itemsize
  if a.ndim and (any(s % item for s in a.strides) or (a.shape[-1] > 1 and a.strides[-1] != item)):
    a = np.ascontiguousarray(a)
  return HostBuffer(ptr=a.ctypes.data, shape=a.shape, dtype=a.dtype,
                    strides=tuple(s // item for s in a.strides), owner=a)


def check_host_pointer(x) -> dict:
  """Checks that :func:`host_buffer` reads the same bytes as a copy of ``x`` (run once on a GPU).

  Returns ``dict(pointer, numpy_pointer, zero_copy_numpy, content_matches)``: ``zero_copy_numpy``
  says whether ``np.asarray`` aliased the buffer (True on the CPU backend, expected False for a
  GPU ``pinned_host`` array), ``content_matches`` whether bytes read through the pointer equal
  the copy. Copies ``x`` once: use a small array.
  """
  buf = host_buffer(x, name="x", where="check_host_pointer")
  ref = np.asarray(x)
  nbytes = ref.nbytes
  raw = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(buf.ptr)) if nbytes else (
      np.zeros(0, np.uint8))
  return dict(pointer=buf.ptr, numpy_pointer=ref.ctypes.data,
              zero_copy_numpy=ref.ctypes.data == buf.ptr,
              content_matches=bool(np.array_equal(raw, np.ascontiguousarray(ref).view(np.uint8)
                                                  .reshape(-1))))


# Each tail tile's HostBuffer, found once per array and reused while that array lives. Why: the
# per-tile checks (memory kind, layout, block_until_ready, the pointer) and the positions' numpy
# view were most of a call's ~150 us of Python on the dev box (77 us with this), and on the H200
# host the worker's setup before the kernel took 0.3-0.8 ms in a hybrid layer's chain; the step
# there measured the same with and without it (docs/DESIGN.md §7): the copies hold that layer.
# A tile is immutable once written (a flush adds a new array, never rewrites one), so its checked
# pointer stays valid until the array is deleted or collected: keyed by id() with a weak reference
# that must still name the same, undeleted array; the entry keeps no tile alive (a k/v tile is its
# own owner, passed in again at each call) and drops itself when the array is collected. What it
# does keep: a positions tile's int32 numpy copy (4 bytes a cell), freed with its entry.
# No lock: a dict's get/set/pop are atomic under the GIL, and the weak reference's callback may run
# inside any allocation (a non-reentrant lock taken there could deadlock); the one race, an entry
# for a new array of a reused id popped by a stale callback, only costs a lookup.
_BUFFERS: dict[int, tuple] = {}
_BUFFERS_ENV = "RKV_CPU_BUFFER_CACHE"  # 0: look every tile up at every call (an A/B switch)


def _tile_buffer(x, conv, *, name: str, where: str) -> HostBuffer:
  """:func:`host_buffer` of ``conv(x)`` for a tail tile ``x``, cached while ``x`` (a jax.Array)
  lives (the comment above)."""
  cacheable = isinstance(x, jax.Array) and validation.env_switch(_BUFFERS_ENV, True)
  if cacheable:
    hit = _BUFFERS.get(id(x))
    if hit is not None and hit[0]() is x and not x.is_deleted():
      cached = hit[1]
      return dataclasses.replace(cached, owner=x) if cached.owner is None else cached
  buf = host_buffer(conv(x), name=name, where=where)
  if cacheable:
    key = id(x)

    def forget(ref, key=key, table=_BUFFERS):  # bound now: at exit the module's names are gone
      if table.get(key, (None,))[0] is ref:
        table.pop(key, None)

    stored = dataclasses.replace(buf, owner=None) if buf.owner is x else buf
    _BUFFERS[key] = (weakref.ref(x, forget), stored)
  return buf


@dataclasses.dataclass(frozen=True)
class _Table:
  """Tiles ``[t0, t1)`` of an array as base pointers + element strides inside a tile."""

  ptrs: list
  strides: tuple
  dtype: np.dtype
  owners: list

  def c_array(self):
    return (ctypes.c_void_p * max(len(self.ptrs), 1))(*self.ptrs)


def _is_tiles(x) -> bool:
  return isinstance(x, (tuple, list))


def _shape_dtype(x, name: str, where: str):
  try:
    return tuple(np.shape(x)), np.dtype(x.dtype)
  except (AttributeError, TypeError) as e:
    raise ValueError(f"{where}: {name} must be an array, got {type(x).__name__}") from e


def _table(x, name: str, where: str, *, n: int, b: int, tile: int, rest: tuple, rng,
           rest_names: str, to_host=None) -> _Table:
  """``x`` as a table of tile pointers for tiles ``rng``: a tuple of N tiles ``[B,tile,*rest]``
  (the cache tail), a stacked ``[N,B,tile,*rest]`` array or a flat ``[B,N*tile,*rest]`` one.
  ``to_host`` (optional) maps each array before its pointer is taken (positions: device → numpy).
  Only the tiles in ``rng`` are touched (a tail's empty tiles are never synchronized)."""
  t0, t1 = rng
  tiled, flat = (b, tile) + rest, (b, n * tile) + rest
  conv = to_host or (lambda a: a)
  if _is_tiles(x):
    if len(x) != n:
      raise ValueError(f"{where}: {name} must be {n} tiles [B,tile{rest_names}]={tiled}, got "
                       f"{len(x)} tiles")
    bufs = []
    for i in range(t0, t1):
      bf = _tile_buffer(x[i], conv, name=f"{name}[{i}]", where=where)
      if bf.shape != tiled:
        raise ValueError(f"{where}: {name}[{i}] must have shape [B,tile{rest_names}]={tiled}, got "
                         f"{bf.shape}")
      bufs.append(bf)
    if any(bf.strides != bufs[0].strides or bf.dtype != bufs[0].dtype for bf in bufs):
      raise ValueError(f"{where}: the tiles of {name} must share one dtype and layout")
    return _Table([bf.ptr for bf in bufs], bufs[0].strides if bufs else (0,) * len(tiled),
                  bufs[0].dtype if bufs else None, bufs)
  buf = host_buffer(conv(x), name=name, where=where)
  size = buf.dtype.itemsize
  if n > 1 or len(buf.shape) == len(tiled) + 1:
    if buf.shape == (n,) + tiled:
      return _Table([buf.ptr + i * buf.strides[0] * size for i in range(t0, t1)],
                    buf.strides[1:], buf.dtype, [buf])
  if buf.shape == flat:
    return _Table([buf.ptr + i * tile * buf.strides[1] * size for i in range(t0, t1)],
                  buf.strides, buf.dtype, [buf])
  want = (f"[B,S{rest_names}]={flat}" if n == 1 else
          f"[N,B,tile{rest_names}]={(n,) + tiled}, [B,S{rest_names}]={flat} or {n} tiles "
          f"[B,tile{rest_names}]={tiled}")
  raise ValueError(f"{where}: {name} must have shape {want}, got {buf.shape}")


def _kv_layout(k, name: str, where: str):
  """``(n_tiles, B, tile, K, D, dtype)`` of K/V given flat, stacked or as a tuple of tiles."""
  if _is_tiles(k):
    if not k:
      raise ValueError(f"{where}: {name} must hold at least one tile")
    shape, dtype = _shape_dtype(k[0], f"{name}[0]", where)
    if len(shape) != 4:
      raise ValueError(f"{where}: {name} tiles must be rank 4 ([B,tile,K,D]), got shape {shape}")
    for i, x in enumerate(k):
      if _shape_dtype(x, f"{name}[{i}]", where) != (shape, dtype):
        raise ValueError(f"{where}: {name}[{i}] must have shape {shape} and dtype {dtype}, like "
                         f"{name}[0]")
    return (len(k),) + shape + (dtype,)
  shape, dtype = _shape_dtype(k, name, where)
  if len(shape) == 4:
    return (1,) + shape + (dtype,)
  if len(shape) == 5:
    return shape + (dtype,)
  raise ValueError(f"{where}: {name} must be rank 4 ([B,S,K,D]), rank 5 tile-major "
                   f"([N,B,tile,K,D]) or a tuple of tiles [B,tile,K,D], got shape {shape}")


def _check_int(value, name: str, where: str, *, allow_none: bool = True) -> None:
  if value is None and allow_none:
    return
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
    raise ValueError(f"{where}: {name} must be {'None or ' if allow_none else ''}a positive int, "
                     f"got {value!r}")


def _positions_to_host(x):
  """Positions live on the device in the cache (4 bytes a cell): one copy to numpy, int32."""
  validation.check_positions_int32("cpu_attention", "k_pos", x)  # host values would wrap
  a = np.asarray(x)
  if not np.issubdtype(a.dtype, np.integer):
    raise ValueError(f"k_pos must be an integer array, got {a.dtype}")
  return a.astype(np.int32, copy=False)


def _scales_to_host(x):
  if isinstance(x, jax.Array):
    return x  # read in place; host_buffer checks where it lives, the dtype is checked below
  a = np.asarray(x)
  if a.dtype == np.dtype(ml_dtypes.bfloat16):
    return a  # read in place (np.issubdtype does not count ml_dtypes' bfloat16 as floating)
  if not np.issubdtype(a.dtype, np.floating):
    raise ValueError(f"must be a float array, got {a.dtype}")
  return a.astype(np.float32, copy=False)


@dataclasses.dataclass
class Prepared:
  """A kernel call set up but for its query: ``args`` (the ``rkv_attn_args``, its ``q`` and
  ``q_pos`` pointers still unset), what keeps its tables and buffers alive, the query's
  ``[B,T,H,D]``, the cells ``s_total`` the positions index, and ``empty`` (no tile to attend:
  the result is ``o = 0``, ``lse = -inf`` without a call)."""

  args: object
  keep: tuple
  q_shape: tuple
  s_total: int
  num_threads: int
  chunk: int
  empty: bool


def prepare(q_shape, q_dtype, k, v, *, k_pos, k_scale, v_scale, causal, window, softcap, scale,
            num_threads, chunk, tiles, where) -> Prepared:
  """Everything of a kernel call that does not read the query's values: the checks of ``k``,
  ``v``, positions, scales and options against a query of ``q_shape`` / ``q_dtype``, the tile
  tables and the argument struct. :func:`_attention` runs it for each call;
  :class:`rkv.offload.host_share.HostShare` once per layer, its query then written by a C++
  thread into the buffer its ``args.q`` names."""
  q_shape = tuple(int(n) for n in q_shape)
  if len(q_shape) != 4:
    raise ValueError(f"{where}: q must be rank 4 ([B,T,H,D]), got shape {q_shape}")
  if np.dtype(q_dtype) not in _QUERY_DTYPES:
    raise ValueError(f"{where}: q dtype must be bfloat16, float16 or float32, got {q_dtype}")
  _, t, h, d = q_shape
  # --- k, v: layout and dtype (no pointer taken yet) ---
  if not _is_tiles(k) and not isinstance(k, jax.Array):
    k = np.asarray(k)
  if not _is_tiles(v) and not isinstance(v, jax.Array):
    v = np.asarray(v)
  n_alloc, b, tile, kh, dk, kdt = _kv_layout(k, "k", where)
  vl = _kv_layout(v, "v", where)
  if vl[:5] != (n_alloc, b, tile, kh, dk):
    raise ValueError(f"{where}: v shape {vl[:5]} must equal k shape {(n_alloc, b, tile, kh, dk)} "
                     f"(as (tiles, B, tile, K, D))")
  if vl[5] != kdt:
    raise ValueError(f"{where}: k dtype {kdt} must equal v dtype {vl[5]}")
  if kdt not in _DTYPE_CODES:
    raise ValueError(f"{where}: k/v dtype must be bfloat16, float16, float32 or int8, got {kdt}")
  tiled = _is_tiles(k) or len(np.shape(k)) == 5
  if tiles is None:
    t0, t1 = 0, n_alloc
  elif not tiled:
    raise ValueError(f"{where}: tiles is only valid with tile-major k ([N,B,tile,K,D] or a tuple "
                     f"of tiles)")
  else:
    t0 = t1 = None
    if isinstance(tiles, (tuple, list)) and len(tiles) == 2:
      t0, t1 = tiles
    if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in (t0, t1)) \
        or not 0 <= t0 <= t1 <= n_alloc:
      raise ValueError(f"{where}: tiles must be (start, stop) with 0 <= start <= stop <= "
                       f"N={n_alloc}, got {tiles!r}")
  validation.check_query_against_kv(where, q_shape, kv_batch=b, kv_heads=kh, kv_head_dim=dk)
  s_total = n_alloc * tile
  quant = kdt == np.dtype(np.int8)
  if quant:
    for nm, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
      if sc is None:
        raise ValueError(f"{where}: int8 k/v need {nm} of shape [B,S,K]={(b, s_total, kh)}")
  elif k_scale is not None or v_scale is not None:
    raise ValueError(f"{where}: k_scale/v_scale are only valid with int8 k/v, got k dtype {kdt}")
  # --- options ---
  scale = validation.attention_options(where, window=window, softcap=softcap, scale=scale,
                                       head_dim=d, causal=causal)
  _check_int(num_threads, "num_threads", where)
  _check_int(chunk, "chunk", where)
  # --- positions ---
  if k_pos is None:
    k_pos = np.broadcast_to(np.arange(s_total, dtype=np.int32), (b, s_total))

  def named(fn, nm):
    def wrapped(x):
      try:
        return fn(x)
      except ValueError as e:
        raise ValueError(f"{where}: {nm} {str(e).removeprefix('k_pos ')}") from None
    return wrapped

  geo = dict(n=n_alloc, b=b, tile=tile, rng=(t0, t1))
  pos = _table(k_pos, "k_pos", where, rest=(), rest_names="",
               to_host=named(_positions_to_host, "k_pos"), **geo)
  scales = []
  if quant:
    for nm, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
      scales.append(_table(sc, nm, where, rest=(kh,), rest_names=",K",
                           to_host=named(_scales_to_host, nm), **geo))
    # One scale_dtype for both (the kernel takes one code); an empty tile range has no dtype.
    sdt = [tb.dtype for tb in scales]
    if scales[0].ptrs and (sdt[0] != sdt[1] or sdt[0] not in _SCALE_CODES):
      raise ValueError(f"{where}: k_scale and v_scale must both be float32 or both bfloat16, got "
                       f"k_scale {sdt[0]} and v_scale {sdt[1]}")
  args = _Args()
  common = dict(q_shape=q_shape, s_total=s_total, num_threads=int(num_threads or 0),
                chunk=int(chunk or 0))
  if t1 == t0 or tile == 0:
    return Prepared(args=args, keep=(), empty=True, **common)
  kt = _table(k, "k", where, rest=(kh, d), rest_names=",K,D", **geo)
  vt = _table(v, "v", where, rest=(kh, d), rest_names=",K,D", **geo)
  if d > 1 and (kt.strides[-1] != 1 or vt.strides[-1] != 1):
    raise ValueError(f"{where}: k/v head dim must be contiguous")
  tables = [kt.c_array(), vt.c_array(), pos.c_array()]
  args.k_tiles, args.v_tiles, args.pos_tiles = (ctypes.cast(x, ctypes.POINTER(ctypes.c_void_p))
                                                for x in tables)
  if quant:
    tables += [scales[0].c_array(), scales[1].c_array()]
    args.ks_tiles, args.vs_tiles = (ctypes.cast(x, ctypes.POINTER(ctypes.c_void_p))
                                    for x in tables[3:])
    args.ks_strides[:], args.vs_strides[:] = scales[0].strides[:3], scales[1].strides[:3]
    args.scale_dtype = _SCALE_CODES[scales[0].dtype]
  args.batch, args.q_len, args.num_heads, args.num_kv_heads, args.head_dim = b, t, h, kh, d
  args.n_tiles, args.tile = t1 - t0, tile
  args.k_strides[:], args.v_strides[:] = kt.strides[:3], vt.strides[:3]
  args.pos_strides[:] = pos.strides[:2]
  args.dtype = _DTYPE_CODES[kdt]
  args.causal = int(bool(causal))
  args.window = 0 if window is None else int(window)
  args.softcap = 0.0 if softcap is None else float(softcap)
  args.scale = float(scale)
  return Prepared(args=args, keep=(kt, vt, pos, scales, tables), empty=False, **common)


def raise_for_rc(rc: int, where: str) -> None:
  if rc == -1:
    raise MemoryError(f"{where}: the CPU kernel could not allocate its work buffers")
  if rc != 0:
    raise RuntimeError(f"{where}: the CPU kernel rejected its arguments (rc={rc})")


# $RKV_CPU_OUT_PINNED=0: a decode step's CPU share returns numpy again (moved to the device by
# the merge's dispatch) instead of writing into fresh pinned_host arrays.
PINNED_OUT_ENV = "RKV_CPU_OUT_PINNED"
# Pairs made per refill of a stock (a shape and device): two steps of a 32-layer model, fewer
# where the pairs are large (at most PINNED_OUT_BATCH_BYTES a refill: pinned host memory is the
# tail's too).
PINNED_OUT_BATCH = 64
PINNED_OUT_BATCH_BYTES = 8 << 20


class PinnedOutputs:
  """Fresh ``pinned_host`` ``(o [B,T,H,D], lse [B,T,H])`` float32 pairs, initialized to ``0`` and
  ``-inf`` (what a row that sees no key returns), for the CPU kernel to write its partial into.

  Why: a numpy partial reaches the GPU as a fresh host-to-device transfer that the merge's
  dispatch requests. PJRT enqueues such a transfer on one of its own threads, and the program that
  reads it cannot be launched before that: traced on an H100 host (1M int8, hybrid layers;
  benchmarks/results/beyond_hbm/session22/h100_h4/), the join's launch blocked ~0.47 ms a layer,
  the transfer's dispatch starting ~0.2 ms after the request on an idle PJRT thread. A partial
  already in ``pinned_host`` memory is an argument whose buffer is defined: the program reads it
  with its own copy (:func:`rkv.offload.stream.merge_all` moves host-space parts to the device).

  Each pair is handed out once and never reused, so no write can race a program still reading an
  earlier partial (PJRT keeps a buffer alive until the programs using it are done). The pairs are
  made :data:`PINNED_OUT_BATCH` at a time per shape and device (fewer when large), by one
  ``jax.device_put`` of numpy arrays, waited for, so that the kernel's writes land after the
  arrays' own initialization. Thread-safe (a lock around the stock). What that costs: a refill of
  64 pairs took ~4 ms on the dev box (~30 us a pair, paid on the main thread once per 64 CPU
  shares), against the ~0.15-0.47 ms a layer the join's launch no longer waits."""

  def __init__(self, batch: int = PINNED_OUT_BATCH):
    self._batch = batch
    self._lock = threading.Lock()
    self._stock: dict[tuple, list] = {}

  def take(self, o_shape: tuple, device: jax.Device):
    key = (tuple(o_shape), device)
    with self._lock:
      stock = self._stock.get(key)
      if not stock:
        stock = self._stock[key] = self._make(tuple(o_shape), device)
      return stock.pop()

  def _make(self, o_shape, device) -> list:
    pair_bytes = 4 * math.prod(o_shape[:3]) * (o_shape[3] + 1)
    n = max(2, min(self._batch, PINNED_OUT_BATCH_BYTES // pair_bytes))
    arrays = memory.to_host([np.zeros(o_shape, np.float32) for _ in range(n)]
                            + [np.full(o_shape[:3], -np.inf, np.float32) for _ in range(n)],
                            device)
    jax.block_until_ready(arrays)
    return list(zip(arrays[:n], arrays[n:]))


_PINNED_OUTPUTS = PinnedOutputs()


def pinned_outputs(q):
  """A fresh pinned ``(o, lse)`` pair for a decode step's CPU share of query ``q`` (a single-device
  ``jax.Array``: the pair lives in that device's ``pinned_host`` memory), or None: ``q`` is not
  such an array, or ``$RKV_CPU_OUT_PINNED`` is 0 (the kernel then returns numpy)."""
  if not isinstance(q, jax.Array) or not validation.env_switch(PINNED_OUT_ENV, True):
    return None
  devices = q.sharding.device_set
  if len(devices) != 1 or q.ndim != 4:
    return None
  return _PINNED_OUTPUTS.take(q.shape, next(iter(devices)))


def _out_pointers(out, shape, where: str):
  o, lse = out
  b, t, h, d = shape
  for x, want, name in ((o, (b, t, h, d), "o"), (lse, (b, t, h), "lse")):
    if (not isinstance(x, jax.Array) or tuple(x.shape) != want or x.dtype != np.float32
        or memory.memory_kind(x) not in _HOST_KINDS or x.is_deleted()):
      raise ValueError(f"{where}: out's {name} must be a live float32 host-memory jax.Array of "
                       f"shape {want} (rkv.offload.cpu_attention.pinned_outputs), got "
                       f"{getattr(x, 'shape', None)} {getattr(x, 'dtype', type(x).__name__)} in "
                       f"{memory.memory_kind(x)!r}")
  return o.unsafe_buffer_pointer(), lse.unsafe_buffer_pointer()


def _attention(q, k, v, *, q_pos, k_pos, k_scale, v_scale, causal, window, softcap, scale,
               num_threads, chunk, tiles, where, out=None):
  # --- q ---
  with jax.profiler.TraceAnnotation("rkv.cpu.q_to_host"):
    q = np.asarray(q)  # a device q comes down to the host here: [B,T,H,D], small
    q_pos = None if q_pos is None else np.asarray(q_pos)
  prep = prepare(q.shape, q.dtype, k, v, k_pos=k_pos, k_scale=k_scale, v_scale=v_scale,
                 causal=causal, window=window, softcap=softcap, scale=scale,
                 num_threads=num_threads, chunk=chunk, tiles=tiles, where=where)
  b, t, h, d = prep.q_shape
  if q_pos is None:
    q_pos = np.broadcast_to(np.arange(t, dtype=np.int32) + (prep.s_total - t), (b, t))
  validation.check_positions_int32(where, "q_pos", q_pos)  # before the int32 cast would wrap it
  q_pos = np.asarray(q_pos)
  if not np.issubdtype(q_pos.dtype, np.integer):
    raise ValueError(f"{where}: q_pos must be an integer array, got {q_pos.dtype}")
  if q_pos.shape != (b, t):
    raise ValueError(f"{where}: q_pos must have shape {(b, t)}, got {q_pos.shape}")
  if out is not None:
    o_ptr, lse_ptr = _out_pointers(out, (b, t, h, d), where)
    o, lse = out  # fresh: already 0 and -inf
  else:
    o = np.zeros((b, t, h, d), np.float32)
    lse = np.full((b, t, h), -np.inf, np.float32)
    o_ptr, lse_ptr = o.ctypes.data, lse.ctypes.data
  if prep.empty:
    return o, lse
  qf = np.ascontiguousarray(q, dtype=np.float32)
  qp = np.ascontiguousarray(q_pos, dtype=np.int32)
  args = prep.args
  args.q, args.q_pos = qf.ctypes.data, qp.ctypes.data
  keep = (prep, qf, qp)  # alive until the call returns
  with jax.profiler.TraceAnnotation("rkv.cpu.kernel"):
    rc = _lib().rkv_cpu_attention(ctypes.byref(args), prep.num_threads, prep.chunk, o_ptr,
                                  lse_ptr)
  del keep
  raise_for_rc(rc, where)
  return o, lse


def cpu_attention(q, k, v, *, q_pos=None, k_pos=None, k_scale=None, v_scale=None, causal=True,
                  window=None, softcap=None, scale=None, num_threads=None, chunk=None,
                  tiles=None):
  """Exact attention on the host CPU: ``(o [B,T,H,D] float32, lse [B,T,H] float32)`` as numpy.

  ``q [B,T,H,D]`` (bf16/f16/f32, numpy or jax). ``k, v``: ``[B,S,K,D]``, tile-major
  ``[N,B,tile,K,D]``, or a tuple of N tiles ``[B,tile,K,D]`` (the cache tail's layout), read in
  place, in bf16 (``ml_dtypes.bfloat16``), f16, f32 or int8 with ``k_scale, v_scale``
  (``[B,S,K]`` or tiled like k; both float32 or both bfloat16, read in place; numpy float16 or
  float64 scales are converted to float32). ``k_pos``: ``[B,S]`` or tiled like k
  (``[N,B,tile]``, tuple of ``[B,tile]``); ``q_pos [B,T]``: the docs/DESIGN.md §2 visibility rule
  and defaults. ``tiles=(start, stop)`` restricts tiled inputs to those tiles (a hybrid split;
  tiles outside are not touched).
  ``num_threads`` defaults to OpenMP's; ``chunk`` (cells per work item) to a shape-only choice.
  Any T works; the kernel is built for decode (T <= 16). The call releases the GIL.
  """
  return _attention(q, k, v, q_pos=q_pos, k_pos=k_pos, k_scale=k_scale, v_scale=v_scale,
                    causal=causal, window=window, softcap=softcap, scale=scale,
                    num_threads=num_threads, chunk=chunk, tiles=tiles, where="cpu_attention")


def cpu_attention_tail(q, kv, *, q_pos=None, causal=True, window=None, softcap=None, scale=None,
                       num_threads=None, tail_pos=None, tiles=None, chunk=None, out=None):
  """The partial ``(o, lse)`` (numpy float32) of attention over ``kv``'s host tail only; with
  ``out`` (a fresh pair from :func:`pinned_outputs`) written into those arrays and returned.

  Reads the tail's per-tile ``pinned_host`` arrays in place (see the module docstring); merge the
  result with the window and staging partials with :func:`rkv.merge`. ``tiles`` defaults to the
  full tiles ``(0, kv.n_full_tiles)``. ``q_pos`` defaults to the last T cells
  (``fill - T + arange(T)``). ``tail_pos`` (a tuple of numpy ``[B,tile]`` int32, or ``[N,B,tile]``)
  saves the positions' device→host copies when the caller already holds them (they are the same
  for every layer). Do not append to the cache from another thread while the call runs.
  """
  from rkv import cache as cache_lib  # rkv.cache imports rkv.offload
  where = "cpu_attention_tail"
  if not isinstance(kv, cache_lib.RollingKV):
    raise ValueError(f"{where}: kv must be a rkv.RollingKV, got {type(kv).__name__}")
  if tiles is None:
    tiles = (0, kv.n_full_tiles)
  if q_pos is None and np.ndim(q) == 4:
    b, t = np.shape(q)[:2]
    q_pos = np.broadcast_to(np.arange(t, dtype=np.int32) + (kv.fill - t), (b, t))
  tail = kv.tail
  # Per tile, np.asarray of a device positions array copies once and jax keeps that copy on the
  # array, which a flush never replaces for a full tile: steady-state decode copies nothing.
  return _attention(q, tail.k, tail.v, q_pos=q_pos,
                    k_pos=tail.pos if tail_pos is None else tail_pos, k_scale=tail.k_scale,
                    v_scale=tail.v_scale, causal=causal, window=window, softcap=softcap,
                    scale=scale, num_threads=num_threads, chunk=chunk, tiles=tiles, where=where,
                    out=out)


# ----------------------------------------------------------------------------------------------
# Probes (for the planner): kernel throughput vs host read bandwidth
# ----------------------------------------------------------------------------------------------
def _fill_random(x: np.ndarray, seed: int = 0) -> None:
  """Fills a big array with a repeated random block (finite values, cheap for GiB arrays)."""
  flat = x.reshape(-1)
  block = np.random.default_rng(seed).standard_normal(1 << 20).astype(x.dtype)
  for i in range(0, flat.size, block.size):
    n = min(block.size, flat.size - i)
    flat[i:i + n] = block[:n]


def measure_host_read_bandwidth(nbytes: int = 1 << 30, *, num_threads: int | None = None,
                                repeats: int = 5) -> float:
  """Host memory read bandwidth in bytes/s: best of ``repeats`` multi-threaded reads of a buffer
  of ``nbytes`` (first-touched by the reading threads), the ceiling for the CPU tail."""
  _check_int(nbytes, "nbytes", "measure_host_read_bandwidth", allow_none=False)
  _check_int(repeats, "repeats", "measure_host_read_bandwidth", allow_none=False)
  _check_int(num_threads, "num_threads", "measure_host_read_bandwidth")
  lib = _lib()
  buf = np.empty(nbytes, np.uint8)
  nt = int(num_threads or 0)
  lib.rkv_fill(buf.ctypes.data, nbytes, 1, nt)
  lib.rkv_read_sum(buf.ctypes.data, nbytes, nt)  # warm-up
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    lib.rkv_read_sum(buf.ctypes.data, nbytes, nt)
    best = min(best, time.perf_counter() - t0)
  return nbytes / best


def measure_cpu_attention(kv_len: int = 262144, *, num_kv_heads: int = 8, head_dim: int = 128,
                          batch: int = 1, q_len: int = 1, group: int = 4, dtype="bfloat16",
                          num_threads: int | None = None, repeats: int = 5,
                          tile_cells: int | None = 32768) -> float:
  """Bytes/s of K+V (plus int8 scales, bfloat16 like the cache's) read by :func:`cpu_attention`,
  best of ``repeats``.

  Synthetic tail: ``kv_len`` cells, tile-major ``[N,B,tile,K,D]`` with ``tile_cells`` (at most
  ``kv_len``; None: flat ``[B,S,K,D]``), every cell visible, ``H = group * num_kv_heads`` query heads.
  """
  where = "measure_cpu_attention"
  for nm, val in (("kv_len", kv_len), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                  ("batch", batch), ("q_len", q_len), ("group", group), ("repeats", repeats)):
    _check_int(val, nm, where, allow_none=False)
  _check_int(tile_cells, "tile_cells", where)
  try:
    dt = np.dtype(jax.numpy.dtype("bfloat16" if dtype == "bf16" else dtype))
  except TypeError:
    dt = None
  if dt not in _DTYPE_CODES:
    raise ValueError(f"{where}: dtype must be bfloat16, float16, float32 or int8, got {dtype!r}")
  if tile_cells is not None:
    tile_cells = min(tile_cells, kv_len)
  if tile_cells is not None and kv_len % tile_cells:
    raise ValueError(f"{where}: kv_len={kv_len} must be a multiple of tile_cells={tile_cells}")
  b, kh, d = batch, num_kv_heads, head_dim
  shape = (b, kv_len, kh, d) if tile_cells is None else (kv_len // tile_cells, b, tile_cells, kh, d)
  k, v = np.empty(shape, dt), np.empty(shape, dt)
  if dt == np.dtype(np.int8):
    for i, x in enumerate((k, v)):
      x.reshape(-1)[:] = np.resize(np.random.default_rng(i).integers(-127, 128, 1 << 20,
                                                                      dtype=np.int8), x.size)
    k_scale = np.full(shape[:-1], 0.01, ml_dtypes.bfloat16)  # what the cache holds
    v_scale = np.full(shape[:-1], 0.01, ml_dtypes.bfloat16)
  else:
    _fill_random(k, 0)
    _fill_random(v, 1)
    k_scale = v_scale = None
  q = np.random.default_rng(2).standard_normal((b, q_len, group * kh, d)).astype(np.float32)
  pos = np.broadcast_to(np.arange(kv_len, dtype=np.int32), (b, kv_len))
  if tile_cells is not None:
    pos = np.ascontiguousarray(np.moveaxis(pos.reshape(b, -1, tile_cells), 1, 0))
  q_pos = np.full((b, q_len), kv_len, np.int32)
  kw = dict(q_pos=q_pos, k_pos=pos, k_scale=k_scale, v_scale=v_scale, num_threads=num_threads)
  cpu_attention(q, k, v, **kw)  # warm-up (page faults of the work buffers, thread pool start)
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    cpu_attention(q, k, v, **kw)
    best = min(best, time.perf_counter() - t0)
  nbytes = k.nbytes + v.nbytes + (0 if k_scale is None else k_scale.nbytes + v_scale.nbytes)
  return nbytes / best
