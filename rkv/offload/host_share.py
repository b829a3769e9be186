"""A layer's CPU share run by a C++ thread, started and awaited inside jitted programs.

The default on a GPU backend since session 24 (:func:`default_on`; ``$RKV_HOST_SHARE=0`` for
the Python worker): exact on the CPU backend and the H200 (session 19); with its tiles put
before its kernel starts (session 20), ahead of the worker at the same split on the H200 (2M
int8 x1.39, 1M x1.04) and on H100s; at the plans the profile's fitted cost makes, since the
splits its own estimated cost planned ran slower on the H200
(docs/DESIGN.md §6). The Python path of a
hybrid layer (``rkv.rolling``) runs the CPU kernel in a Python worker thread that must take the
GIL to start, to bring the query down and to set the kernel up: ~2 ms of a 5.5 ms layer at 2M
int8 on the H200 before the kernel ran (docs/DESIGN.md §6, "the layer chain"). A
:class:`HostShare` keeps the kernel's arguments set up (:meth:`configure`, once per tile layout)
and a C++ worker waiting; two XLA FFI custom calls drive it from inside programs:

- ``token = share.start(q, q_pos)`` where ``q [B,T,H,D]`` is made: the query and its positions
  go into the share's host buffers (on CUDA: copies enqueued on the program's stream, and a host
  function wakes the worker when they have landed: no host thread in between) and the kernel
  runs over the configured tail tiles;
- ``o, lse = share.wait(token)`` where the partial is merged: blocks until that kernel is done
  and returns its float32 partial, which merges exactly with the device partials
  (:func:`rkv.merge`).

Starts and waits of one share alternate; the wait takes its start's token, which orders it after
the start also inside one program. Built on first use (:mod:`rkv.offload.share_build`: a C++
compiler and jaxlib's FFI headers). The library never holds the GIL, so nothing here waits for
Python threads.
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from rkv import validation
from rkv.offload import cpu_attention as cpu_lib
from rkv.offload import cpu_build
from rkv.offload import memory
from rkv.offload import share_build

# $RKV_HOST_SHARE: decode steps run their layers' CPU shares here (rkv.models.transformer says
# where and why; unset: default_on), the Python worker with =0; =1 set by name also has the
# planner model a CPU share's fixed cost as this thread's (share_requested,
# rkv.planner.Profile.for_host_share). Read at each step and each plan.
HOST_SHARE_ENV = "RKV_HOST_SHARE"
# What an unset $RKV_HOST_SHARE means on a GPU backend where the share can be built and loaded
# (default_on). Elsewhere unset means off, the Python worker: where the share cannot be built
# (=1 there fails with the build's error; unset warns once and takes the worker), and on a CPU
# backend, where the query and the partial cross no link and the share saves only the worker's
# handoff (the CPU-backend tests of the share set =1 themselves). On since session 24: at the
# same split the share ran ahead of the worker on the H200 (2M int8 6.79 against 4.87 tok/s, 1M
# 9.00 against 8.63) and on H100s (benchmarks/results/beyond_hbm/session24/).
DEFAULT_ON = True


@functools.lru_cache(maxsize=None)
def share_available() -> tuple[bool, str]:
  """``(True, "")`` if a share can run here: the CPU kernel can (``kernel_available``) and the
  share's library is built and verified or a C++ compiler can build it; else ``(False, why)``.
  Builds nothing; asked once a process (a compiler does not come and go mid-run)."""
  ok, why = cpu_build.kernel_available()
  if not ok:
    return False, why
  if cpu_build.cached_build_problem(share_build.cached_path()) is None:
    return True, ""
  try:
    share_build.find_compiler()
  except cpu_build.CompilerNotFoundError as e:
    return False, str(e)
  return True, ""


@functools.lru_cache(maxsize=None)
def _loads() -> bool:
  """Whether the share's library is built (now, if it was not) and registered; where it is not,
  a warning says why, once a process, and False."""
  ok, why = share_available()
  if ok:
    try:
      _registered()
    except Exception as e:  # a broken compiler or library: the worker, not a failed decode step
      ok, why = False, f"{type(e).__name__}: {e}"
  if not ok:
    warnings.warn(f"rkv host share: cannot run here ({why}); CPU shares run in the Python worker "
                  f"(set {HOST_SHARE_ENV}=0 to choose it and silence this)", stacklevel=3)
  return ok


def default_on() -> bool:
  """What an unset ``$RKV_HOST_SHARE`` means here: :data:`DEFAULT_ON` on a GPU backend where the
  share builds and loads (:func:`share_available`, then the build), else off."""
  return DEFAULT_ON and jax.default_backend() == "gpu" and _loads()


def share_requested() -> bool:
  """Whether ``$RKV_HOST_SHARE`` is set on by name (read now): the planner then plans the CPU
  shares with the share's own fixed cost, probed or estimated
  (``rkv.planner.ResidencyConfig.host_share``). The default share (unset) keeps the profile's
  fitted cost: on the H200 the splits the estimate moved toward the CPU ran slower (session 24,
  docs/DESIGN.md §6)."""
  return validation.env_switch(HOST_SHARE_ENV, False)


def share_on() -> bool:
  """``$RKV_HOST_SHARE``, read now; unset: :func:`default_on`."""
  if os.environ.get(HOST_SHARE_ENV, "").strip():
    return validation.env_switch(HOST_SHARE_ENV, False)
  return default_on()  # asks for the backend and the compiler only when unset


START_TARGET = "rkv_share_start"
WAIT_TARGET = "rkv_share_wait"


def awaited(parts, share):
  """A layer's unmerged ``parts``, ``(device partial, token)`` when ``share`` ran its CPU share,
  with the share's partial awaited (its wait program): ``(device partial, (o, lse))``. ``share``
  None: ``parts`` as they are. Shared by the decode chains that run shares
  (``layered_forward``'s general path and :mod:`rkv.models.fused_decode`)."""
  if share is None:
    return parts
  device, token = parts
  with jax.profiler.TraceAnnotation("rkv.share.wait"):
    return (device, share.wait_program(token))


@functools.lru_cache(maxsize=None)
def _registered() -> ctypes.CDLL:
  """The library, its handlers registered with XLA for the CPU and CUDA platforms (once)."""
  lib = share_build.load_library()
  for platform, start, wait in (("cpu", lib.RkvShareStartCpu, lib.RkvShareWaitCpu),
                                ("CUDA", lib.RkvShareStartCuda, lib.RkvShareWaitCuda)):
    jax.ffi.register_ffi_target(START_TARGET, jax.ffi.pycapsule(start), platform=platform)
    jax.ffi.register_ffi_target(WAIT_TARGET, jax.ffi.pycapsule(wait), platform=platform)
  return lib


def _scratch(shape, dtype):
  """A host buffer the worker and the copies use: pinned host memory of the GPU client when
  there is a GPU (so the stream's copies are DMA), plain numpy on a CPU backend. Returns
  ``(owner, pointer)``."""
  if jax.default_backend() == "gpu":
    x = jax.device_put(np.zeros(shape, dtype), memory.sharding(memory.PINNED_HOST))
    x.block_until_ready()
    return x, x.unsafe_buffer_pointer()
  x = np.zeros(shape, dtype)
  return x, x.ctypes.data


class HostShare:
  """One layer's CPU share for queries of ``q_shape`` ``[B,T,H,D]`` (see the module docstring).

  :meth:`configure` with the cache and the tiles the CPU attends before the first start, and
  again whenever those tiles change (a flush); :meth:`start` / :meth:`wait` inside jitted
  programs, in that order. One C++ thread runs every share's kernel, in the order their
  queries land (one OpenMP team for the kernel)."""

  def __init__(self, q_shape):
    q_shape = tuple(int(n) for n in q_shape)
    if len(q_shape) != 4 or min(q_shape) < 1:
      raise ValueError(f"HostShare: q_shape must be [B,T,H,D] of positive sizes, got {q_shape}")
    self.q_shape = q_shape
    b, t, h, d = q_shape
    self._lib = _registered()
    kernel = ctypes.cast(cpu_lib._lib().rkv_cpu_attention, ctypes.c_void_p).value
    self._handle = self._lib.rkv_share_new(kernel)
    self._finalizer = weakref.finalize(self, self._lib.rkv_share_free, self._handle)
    self._q = _scratch(q_shape, np.float32)
    self._q_pos = _scratch((b, t), np.int32)
    self._o = _scratch(q_shape, np.float32)
    self._lse = _scratch((b, t, h), np.float32)
    self._prepared = None
    self._attrs = dict(share=np.int64(self._handle))
    # The share's own programs (its handle is their custom calls' attribute: compiled per share).
    self.start_program = jax.jit(self.start)
    self.wait_program = jax.jit(self.wait)

  def configure(self, kv, *, tiles, causal=True, window=None, softcap=None, scale=None,
                num_threads=None) -> None:
    """The kernel's arguments: the full tail tiles ``tiles = (start, stop)`` of the
    :class:`rkv.RollingKV` ``kv``, read in place, and the attention options (as
    :func:`rkv.offload.cpu_attention.cpu_attention_tail`). Refused while a start is pending."""
    where = "HostShare.configure"
    tail = kv.tail
    prep = cpu_lib.prepare(self.q_shape, np.float32, tail.k, tail.v, k_pos=tail.pos,
                           k_scale=tail.k_scale, v_scale=tail.v_scale, causal=causal,
                           window=window, softcap=softcap, scale=scale,
                           num_threads=cpu_lib.tail_threads(num_threads), chunk=None,
                           tiles=tiles, where=where)
    if prep.empty:
      raise ValueError(f"{where}: tiles={tiles!r} holds no cells for the CPU")
    args = prep.args
    args.q, args.q_pos = self._q[1], self._q_pos[1]
    b, t, h, d = self.q_shape
    rc = self._lib.rkv_share_configure(
        self._handle, ctypes.addressof(args), prep.num_threads, prep.chunk, self._q[1],
        b * t * h * d * 4, self._q_pos[1], b * t * 4, self._o[1], b * t * h * d, self._lse[1],
        b * t * h)
    if rc != 0:
      raise RuntimeError(f"{where}: a start of this share is still waiting for its wait")
    self._prepared = prep  # the tables and the struct the worker reads: alive while configured

  def start(self, q, q_pos):
    """Traceable: hands ``q [B,T,H,D]`` and ``q_pos [B,T]`` to the worker; returns the token
    :meth:`wait` takes."""
    if tuple(jnp.shape(q)) != self.q_shape:
      raise ValueError(f"HostShare.start: q has shape {tuple(jnp.shape(q))}, the share is for "
                       f"{self.q_shape}")
    # Declared without a side effect: a program with an effect leaves jit's C++ dispatch for
    # Python's (~0.3 ms a call on the H200 hosts, 70 against 7 us here), and the share's
    # programs are dispatched twice a layer. Nothing is lost: each call's results are its
    # program's outputs (the token, the partial), so XLA cannot drop it, and each sits alone in
    # a program of its own (or start feeding wait), so nothing can merge or repeat it.
    call = jax.ffi.ffi_call(START_TARGET, jax.ShapeDtypeStruct((), jnp.int32),
                            has_side_effect=False)
    return call(jnp.asarray(q, jnp.float32), jnp.asarray(q_pos, jnp.int32), **self._attrs)

  def wait(self, token):
    """Traceable: the float32 ``(o [B,T,H,D], lse [B,T,H])`` of the kernel ``token``'s start
    began; a kernel error or a wait with no start is an error of the program."""
    b, t, h, d = self.q_shape
    call = jax.ffi.ffi_call(WAIT_TARGET, (jax.ShapeDtypeStruct((b, t, h, d), jnp.float32),
                                          jax.ShapeDtypeStruct((b, t, h), jnp.float32)),
                            has_side_effect=False)  # as in start
    o, lse = call(token, **self._attrs)
    return o, lse

  def set_wait_seconds(self, seconds: float) -> None:
    """How long a wait blocks for its kernel before it fails (default 120 s)."""
    if not seconds > 0:
      raise ValueError(f"HostShare.set_wait_seconds: seconds must be positive, got {seconds!r}")
    self._lib.rkv_share_set_wait_seconds(self._handle, float(seconds))

  def counters(self) -> dict:
    """Starts, waits and kernel runs so far, and the last run's return code."""
    out = (ctypes.c_int64 * 4)()
    self._lib.rkv_share_counters(self._handle, out)
    return dict(starts=out[0], waits=out[1], runs=out[2], last_rc=out[3])

  def close(self) -> None:
    """Frees the share once its starts have run (also done when the object is collected)."""
    self._finalizer()
