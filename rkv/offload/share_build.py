"""Builds and loads ``host_share.cc`` (rkv.offload.host_share's FFI library) on first use.

The same caching as :mod:`rkv.offload.cpu_build` (the kernel's builder): a build is keyed by the
source, the flags, the jaxlib whose FFI headers it was compiled against, and the architecture;
it is written atomically with its SHA-256 beside it and verified before it is loaded. The C++
compiler is ``$CXX`` if set, else the first of c++, g++, clang++ on PATH (``$RKV_CC_TIMEOUT_S``
bounds it like the kernel's build). Why C++: the XLA FFI's handler API (``xla/ffi/api/ffi.h``,
shipped with jaxlib) is C++17; the C kernel itself stays C (cpu_kernel.c) and is reached through
the function pointer the Python side passes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess

import jax
import jaxlib

from rkv.offload import cpu_build

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_share.cc")
ABI_VERSION = 1  # must equal rkv_share_abi_version() in host_share.cc
_FLAGS = ("-O2", "-std=c++17", "-fPIC", "-shared", "-Wall", "-pthread")


def find_compiler() -> str:
  cxx = os.environ.get("CXX")
  if cxx:
    if not shutil.which(cxx):
      raise cpu_build.CompilerNotFoundError(f"rkv host share: $CXX={cxx!r} is not an executable "
                                            f"on PATH")
    return shutil.which(cxx)
  for cand in ("c++", "g++", "clang++"):
    if shutil.which(cand):
      return shutil.which(cand)
  raise cpu_build.CompilerNotFoundError("rkv host share: no C++ compiler ($CXX, c++, g++, "
                                        "clang++) to build " + SOURCE)


def build_key() -> str:
  h = hashlib.sha256()
  with open(SOURCE, "rb") as f:
    h.update(f.read())
  h.update("\0".join(_FLAGS).encode())
  h.update(jaxlib.__version__.encode())  # the FFI headers it was compiled against
  h.update(platform.machine().encode())
  return h.hexdigest()[:16]


def cached_path() -> str:
  return os.path.join(cpu_build.cache_dir(), f"rkv_host_share-{build_key()}.so")


def compile_library(out_path: str) -> str:
  """Compiles ``host_share.cc`` to ``out_path`` atomically, its SHA-256 recorded beside it."""
  cxx = find_compiler()

  def compile_into(tmp):
    cmd = [cxx, *_FLAGS, f"-I{jax.ffi.include_dir()}", SOURCE, "-o", tmp, "-ldl"]
    timeout = cpu_build.compile_timeout_s()
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
      raise RuntimeError(f"rkv host share: the compiler did not finish within {timeout:g} s "
                         f"({' '.join(cmd)}); set {cpu_build.TIMEOUT_ENV} to allow longer") from None
    if proc.returncode != 0:
      raise RuntimeError(f"rkv host share: compiling failed ({' '.join(cmd)}):\n"
                         f"{proc.stdout}{proc.stderr}")

  return cpu_build.build_atomically(out_path, compile_into, "rkv host share")


@functools.lru_cache(maxsize=None)
def load_library() -> ctypes.CDLL:
  """The loaded library (built on first use), its C entry points typed."""
  path = cached_path()
  if cpu_build.cached_build_problem(path) is not None:
    compile_library(path)
  lib = ctypes.CDLL(path)
  lib.rkv_share_abi_version.restype = ctypes.c_int
  if lib.rkv_share_abi_version() != ABI_VERSION:
    raise RuntimeError(f"rkv host share {path}: ABI {lib.rkv_share_abi_version()}, this rkv "
                       f"needs {ABI_VERSION}")
  lib.rkv_share_new.restype = ctypes.c_void_p
  lib.rkv_share_new.argtypes = [ctypes.c_void_p]
  i64, ptr = ctypes.c_int64, ctypes.c_void_p
  lib.rkv_share_configure.restype = ctypes.c_int
  lib.rkv_share_configure.argtypes = [ptr, ptr, ctypes.c_int, i64, ptr, i64, ptr, i64, ptr, i64,
                                      ptr, i64]
  lib.rkv_share_set_wait_seconds.restype = None
  lib.rkv_share_set_wait_seconds.argtypes = [ptr, ctypes.c_double]
  lib.rkv_share_counters.restype = None
  lib.rkv_share_counters.argtypes = [ptr, ctypes.POINTER(i64)]
  lib.rkv_share_free.restype = None
  lib.rkv_share_free.argtypes = [ptr]
  return lib
