"""Builds and loads the CPU-tail attention library (``cpu_kernel.c``, plain C + OpenMP).

The shared library is compiled on first use with the system C compiler (``$CC``, else ``cc``,
``gcc`` or ``clang``) into a cache directory keyed by a hash of the source and the flags:
``$RKV_CACHE_DIR`` if set, else ``~/.cache/rkv``. A GPU machine without a compiler loads a
prebuilt library named by ``$RKV_CPU_KERNEL_SO``; build one elsewhere with::

  python -m rkv.offload.cpu_build --out DIR     # writes DIR/librkv_cpu_kernel.so

x86-64 builds target ``-march=x86-64-v3`` (AVX2, FMA, F16C: any Haswell/Zen or later host), not
``-march=native``, so a library built on one machine runs on another. Other architectures get
the portable C path of the kernel (``-O3`` auto-vectorized).

The library is loaded with :class:`ctypes.CDLL`, which releases the GIL for the duration of each
call: the Python thread that feeds the GPU keeps running while the host computes. Loading it sets
``OMP_WAIT_POLICY=passive`` unless the environment already sets it (see :func:`_load`); the
thread count is OpenMP's default (``$OMP_NUM_THREADS``, else every core) unless a call passes one.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_kernel.c")
ABI_VERSION = 2  # must equal RKV_ABI_VERSION in cpu_kernel.c
LIB_NAME = "librkv_cpu_kernel.so"
SO_ENV = "RKV_CPU_KERNEL_SO"
CACHE_ENV = "RKV_CACHE_DIR"
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
_BASE_FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-Wall")


class CompilerNotFoundError(RuntimeError):
  """No C compiler to build the CPU-tail kernel, and no prebuilt library given."""


def arch_flags() -> tuple[str, ...]:
  if platform.machine().lower() in ("x86_64", "amd64"):
    # x86-64-v3 = AVX2 + FMA + F16C + BMI: what the intrinsics path needs, portable across hosts.
    return ("-march=x86-64-v3",)
  return ()


def find_compiler() -> str:
  for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
    if cand and shutil.which(cand):
      return shutil.which(cand)
  raise CompilerNotFoundError(
      "rkv CPU-tail kernel: no C compiler found ($CC, cc, gcc, clang) to build "
      f"{SOURCE}. Either install one (e.g. `apt-get install gcc`), or build the library on "
      f"another machine of the same architecture with `python -m rkv.offload.cpu_build --out DIR`"
      f" and set {SO_ENV}=DIR/{LIB_NAME} before using the cpu tactic.")


def source_hash() -> str:
  """Hash of ``cpu_kernel.c``; compiled into the library (``rkv_cpu_kernel_source_hash``)."""
  st = os.stat(SOURCE)
  return _file_hash(SOURCE, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=8)
def _file_hash(path: str, mtime_ns: int, size: int) -> str:
  # Keyed by the file's stat: every kernel call resolves the library path, and reading and
  # hashing the source each time cost ~70 us a call.
  del mtime_ns, size
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()[:16]


def build_key() -> str:
  """Cache key of a build: the source, the flags and the architecture."""
  h = hashlib.sha256(source_hash().encode())
  h.update("\0".join(_BASE_FLAGS + arch_flags()).encode())
  h.update(platform.machine().encode())
  return h.hexdigest()[:16]


def cache_dir() -> str:
  return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "rkv")


def compile_library(out_path: str, *, compiler: str | None = None) -> str:
  """Compiles ``cpu_kernel.c`` to ``out_path`` (atomically: a half-written file never appears)."""
  cc = compiler or find_compiler()
  flags = _BASE_FLAGS + arch_flags()
  out_dir = os.path.dirname(os.path.abspath(out_path))
  os.makedirs(out_dir, exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
  os.close(fd)
  cmd = [cc, *flags, f"-DRKV_SOURCE_HASH=\"{source_hash()}\"", SOURCE, "-o", tmp, "-lm"]
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
      raise RuntimeError(f"rkv CPU-tail kernel: compiling failed ({' '.join(cmd)}):\n"
                         f"{proc.stdout}{proc.stderr}")
    os.replace(tmp, out_path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return out_path


def library_path() -> str:
  """The library to load: ``$RKV_CPU_KERNEL_SO``, else the cached build (compiled if missing)."""
  env = os.environ.get(SO_ENV)
  if env:
    if not os.path.isfile(env):
      raise ValueError(f"{SO_ENV}={env!r} is not a file")
    return env
  path = os.path.join(cache_dir(), f"rkv_cpu_kernel-{build_key()}-{platform.machine()}.so")
  if not os.path.isfile(path):
    compile_library(path)
  return path


@functools.lru_cache(maxsize=None)
def _load(path: str) -> ctypes.CDLL:
  # libgomp reads its settings once, when it is loaded, and in this process the kernel is what
  # loads it (jax and numpy do not). Its default wait policy spins idle threads, which on a busy
  # host (the GPU-feeding Python thread, other processes) stalls every call until the scheduler
  # runs the spinning-out worker: 16 ms instead of 0.43 ms a call, 2 threads on the shared dev
  # box. Passive waiting costs a futex wake per call. An explicit setting wins.
  os.environ.setdefault(WAIT_POLICY_ENV, "passive")
  lib = ctypes.CDLL(path)
  lib.rkv_cpu_kernel_abi_version.restype = ctypes.c_int
  abi = lib.rkv_cpu_kernel_abi_version()
  if abi != ABI_VERSION:
    raise RuntimeError(f"rkv CPU-tail kernel {path} has ABI version {abi}, this rkv needs "
                       f"{ABI_VERSION}: rebuild it with `python -m rkv.offload.cpu_build --out DIR`")
  lib.rkv_cpu_kernel_source_hash.restype = ctypes.c_char_p
  built = lib.rkv_cpu_kernel_source_hash().decode()
  if built != source_hash():
    warnings.warn(f"rkv CPU-tail kernel {path} was built from another source (hash {built}, "
                  f"current {source_hash()}); same ABI, but rebuild it to be sure", stacklevel=3)
  return lib


def load_library() -> ctypes.CDLL:
  """The loaded CPU-tail kernel library (built on first use; see the module docstring)."""
  return _load(os.path.abspath(library_path()))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m rkv.offload.cpu_build",
      description="Prebuild the rkv CPU-tail attention library; use it on a machine without a "
                  f"compiler with {SO_ENV}=DIR/{LIB_NAME}.")
  parser.add_argument("--out", required=True, help="output directory")
  parser.add_argument("--cc", default=None, help="C compiler (default: $CC, cc, gcc, clang)")
  args = parser.parse_args(argv)
  path = compile_library(os.path.join(args.out, LIB_NAME), compiler=args.cc)
  lib = ctypes.CDLL(os.path.abspath(path))
  print(f"{path} (abi {lib.rkv_cpu_kernel_abi_version()}, avx2 {lib.rkv_cpu_kernel_has_avx2()}, "
        f"source {source_hash()}, {platform.machine()})")
  print(f"export {SO_ENV}={os.path.abspath(path)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
