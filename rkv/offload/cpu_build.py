"""Builds and loads the CPU-tail attention library (``cpu_kernel.c``, plain C + OpenMP).

The shared library is compiled on first use with the system C compiler (``$CC``, else ``cc``,
``gcc`` or ``clang``) into a cache directory keyed by a hash of the source and the flags:
``$RKV_CACHE_DIR`` if set, else ``~/.cache/rkv``. A GPU machine without a compiler loads a
prebuilt library named by ``$RKV_CPU_KERNEL_SO``; build one elsewhere with::

  python -m rkv.offload.cpu_build --out DIR     # writes DIR/librkv_cpu_kernel.so

x86-64 builds target ``-march=x86-64-v4`` when the host has AVX-512 (F, BW, CD, DQ, VL, read from
``/proc/cpuinfo``): the kernel's 512-bit path, which int8 K/V needs (the 256-bit one is compute
bound there). Otherwise, or when the flags cannot be read, ``-march=x86-64-v3`` (AVX2, FMA, F16C:
any Haswell/Zen or later host). Either is a fixed level, not ``-march=native``, and
``$RKV_CPU_MARCH`` overrides the choice; the level is part of the cache key, so a v3 and a v4
build never stand in for each other. A v4 library runs only on AVX-512 hosts: to prebuild for a
host without it, set ``RKV_CPU_MARCH=x86-64-v3`` (loading a v4 library on such a host is refused
with that advice, not left to die on an illegal instruction). Other architectures get the
portable C path of the kernel (``-O3`` auto-vectorized).

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
ABI_VERSION = 4  # must equal RKV_ABI_VERSION in cpu_kernel.c
LIB_NAME = "librkv_cpu_kernel.so"
SO_ENV = "RKV_CPU_KERNEL_SO"
CACHE_ENV = "RKV_CACHE_DIR"
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
TIMEOUT_ENV = "RKV_CC_TIMEOUT_S"
DEFAULT_COMPILE_TIMEOUT_S = 300.0
_BASE_FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-Wall")


class CompilerNotFoundError(RuntimeError):
  """No C compiler to build the CPU-tail kernel, and no prebuilt library given."""


MARCH_ENV = "RKV_CPU_MARCH"
CPUINFO_PATH = "/proc/cpuinfo"
# The AVX-512 subsets -march=x86-64-v4 lets the compiler use. The kernel's 512-bit path needs F,
# BW and VL; CD and DQ are asked for too because the compiler may emit them anywhere in a v4
# build (every AVX-512 Xeon since Skylake-SP has all five; a host missing one builds v3).
V4_FLAGS = frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})


def parse_cpu_flags(cpuinfo: str) -> frozenset:
  """The feature flags of the first ``flags`` line of a ``/proc/cpuinfo`` text (empty if none)."""
  for line in cpuinfo.splitlines():
    key, sep, value = line.partition(":")
    if sep and key.strip() == "flags":
      return frozenset(value.split())
  return frozenset()


@functools.lru_cache(maxsize=1)
def _read_cpu_flags() -> frozenset:
  """This host's CPU flags (empty where ``/proc/cpuinfo`` cannot be read: not Linux). Cached:
  every cache-key computation asks, and the file is large on many-core hosts."""
  try:
    with open(CPUINFO_PATH) as f:
      return parse_cpu_flags(f.read())
  except OSError:
    return frozenset()


def host_has_avx512() -> bool:
  """Whether this host has the AVX-512 of an x86-64-v4 build (:data:`V4_FLAGS`). Linux clears
  these flags when the kernel does not enable the 512-bit register state, so they are enough."""
  return V4_FLAGS <= _read_cpu_flags()


def arch_flags() -> tuple[str, ...]:
  """``-march`` of the build: ``$RKV_CPU_MARCH`` if set, else on x86-64 ``x86-64-v4`` when the
  host has AVX-512 (:func:`host_has_avx512`) and ``x86-64-v3`` otherwise, else none.

  Why v4: it compiles the kernel's 512-bit register-blocked path (cpu_kernel.c, RKV_AVX512). The
  256-bit intrinsics alone built for v4 changed nothing on the H200 host (77.7 GB/s bf16 and
  50.9 int8 against v3's 75.4 and 51.1, 15 threads, 512K cells;
  benchmarks/results/beyond_hbm/session5/b/cpu_rates_v*.json): int8 was compute bound there.
  The 512-bit path on the dev box (2-core Xeon VM with AVX-512, 512K cells, median of 3
  processes): int8 6.9 -> 9.7 GB/s on one thread and 13.8 -> 19.3 on two, bf16 9.3 -> 10.8 and
  18.4 -> 21.5 (a plain read: 16 and 32 GB/s). On the H200 host (15 threads, one run): bf16
  69.6 -> 95.1 GB/s, int8 42.3 -> 71.1 (benchmarks/results/beyond_hbm/session6/e/)."""
  march = os.environ.get(MARCH_ENV, "").strip()
  if march:
    return (f"-march={march}",)
  if platform.machine().lower() in ("x86_64", "amd64"):
    # x86-64-v3 = AVX2 + FMA + F16C + BMI: what the 256-bit path needs, portable across hosts;
    # v4 adds AVX-512 (F, BW, CD, DQ, VL) for the 512-bit path, on hosts that have it.
    return ("-march=x86-64-v4",) if host_has_avx512() else ("-march=x86-64-v3",)
  return ()


_PREBUILD_HINT = (f"build the library on another machine of the same architecture with `python -m "
                  f"rkv.offload.cpu_build --out DIR` and set {SO_ENV}=DIR/{LIB_NAME}")


def find_compiler() -> str:
  """``$CC`` if set (it must exist: a CC pointing nowhere used to be skipped silently), else the
  first of cc, gcc, clang on PATH."""
  cc = os.environ.get("CC")
  if cc:
    if not shutil.which(cc):
      raise CompilerNotFoundError(
          f"rkv CPU-tail kernel: $CC={cc!r} is not an executable on PATH. Point CC at a C "
          f"compiler, unset it to use cc/gcc/clang, or {_PREBUILD_HINT}.")
    return shutil.which(cc)
  for cand in ("cc", "gcc", "clang"):
    if shutil.which(cand):
      return shutil.which(cand)
  raise CompilerNotFoundError(
      "rkv CPU-tail kernel: no C compiler found ($CC, cc, gcc, clang) to build "
      f"{SOURCE}. Either install one (e.g. `apt-get install gcc`), or {_PREBUILD_HINT} before "
      f"using the cpu tactic.")


def compile_timeout_s() -> float:
  """Seconds a build may take (``$RKV_CC_TIMEOUT_S``, default 300): a hanging compiler used to
  block the first ``tactic="cpu"`` call forever."""
  raw = os.environ.get(TIMEOUT_ENV)
  if raw is None:
    return DEFAULT_COMPILE_TIMEOUT_S
  try:
    t = float(raw)
  except ValueError:
    t = float("nan")
  if not t > 0:
    raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
  return t


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
  """Cache key of a build: the source, the flags (the ``-march`` level among them: a v3 and a v4
  build of the same source get different keys) and the architecture."""
  h = hashlib.sha256(source_hash().encode())
  h.update("\0".join(_BASE_FLAGS + arch_flags()).encode())
  h.update(platform.machine().encode())
  return h.hexdigest()[:16]


def cache_dir() -> str:
  return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "rkv")


def _compile(cc: str, out: str) -> None:
  """Runs the compiler on ``cpu_kernel.c`` into ``out``, within :func:`compile_timeout_s`."""
  cmd = [cc, *_BASE_FLAGS, *arch_flags(), f"-DRKV_SOURCE_HASH=\"{source_hash()}\"", SOURCE,
         "-o", out, "-lm"]
  timeout = compile_timeout_s()
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    raise RuntimeError(f"rkv CPU-tail kernel: the compiler did not finish within {timeout:g} s "
                       f"({' '.join(cmd)}); it was killed. Set {TIMEOUT_ENV} to allow longer, or "
                       f"{_PREBUILD_HINT}.") from None
  if proc.returncode != 0:
    raise RuntimeError(f"rkv CPU-tail kernel: compiling failed ({' '.join(cmd)}):\n"
                       f"{proc.stdout}{proc.stderr}")


def _sha256(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def _digest_path(so_path: str) -> str:
  return so_path + ".sha256"


def compile_library(out_path: str, *, compiler: str | None = None) -> str:
  """Compiles ``cpu_kernel.c`` to ``out_path`` (atomically: a half-written file never appears)
  and records its SHA-256 beside it (``out_path.sha256``), which :func:`library_path` checks
  before a cached build is loaded."""
  cc = compiler or find_compiler()
  return build_atomically(out_path, lambda tmp: _compile(cc, tmp), "rkv CPU-tail kernel")


def build_atomically(out_path: str, compile_into, label: str) -> str:
  """Runs ``compile_into(tmp)`` on a temporary file beside ``out_path``, checks the ELF file it
  wrote, then moves it and its SHA-256 (``out_path.sha256``) into place: a half-written library
  never appears under ``out_path``. Shared by the kernel's and the host share's builds."""
  out_dir = os.path.dirname(os.path.abspath(out_path))
  os.makedirs(out_dir, exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
  os.close(fd)
  try:
    compile_into(tmp)
    problem = elf_problem(tmp)
    if problem:
      raise RuntimeError(f"{label}: the compiler wrote an unusable library: {problem}")
    digest_tmp = tmp + ".sha256"
    with open(digest_tmp, "w") as f:
      f.write(_sha256(tmp))
    # The digest first: a crash between the two leaves a digest that does not match, so the next
    # load rebuilds instead of trusting a stale file.
    os.replace(digest_tmp, _digest_path(out_path))
    os.replace(tmp, out_path)
  finally:
    for leftover in (tmp, tmp + ".sha256"):
      if os.path.exists(leftover):
        os.remove(leftover)
  return out_path


def elf_problem(path: str) -> str | None:
  """Why ``path`` is not a loadable 64-bit ELF shared library of this build, or None.

  Checked before ``dlopen``: junk fails there with an obscure error, and a truncated library
  whose segments run past the end of the file is mapped anyway and kills the process with
  SIGBUS at the first touch of the missing pages."""
  try:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      head = f.read(64)
      if len(head) < 64 or head[:4] != b"\x7fELF":
        return "not an ELF file"
      if head[4] != 2 or head[5] != 1:
        return "not a 64-bit little-endian ELF file"
      phoff = int.from_bytes(head[0x20:0x28], "little")
      shoff = int.from_bytes(head[0x28:0x30], "little")
      phentsize = int.from_bytes(head[0x36:0x38], "little")
      phnum = int.from_bytes(head[0x38:0x3a], "little")
      shentsize = int.from_bytes(head[0x3a:0x3c], "little")
      shnum = int.from_bytes(head[0x3c:0x3e], "little")
      if phnum == 0 or phoff + phnum * phentsize > size or shoff + shnum * shentsize > size:
        return f"truncated ({size} bytes: its headers run past the end)"
      f.seek(phoff)
      table = f.read(phnum * phentsize)
  except OSError as e:
    return f"unreadable ({e})"
  for i in range(phnum):
    ph = table[i * phentsize:(i + 1) * phentsize]
    offset = int.from_bytes(ph[8:16], "little")
    filesz = int.from_bytes(ph[32:40], "little")
    if offset + filesz > size:
      return f"truncated ({size} bytes, segment {i} ends at byte {offset + filesz})"
  return None


def cached_build_problem(path: str) -> str | None:
  """Why the cached build ``path`` must not be loaded (missing, a bad ELF file, or bytes that
  differ from the SHA-256 recorded when it was built), or None."""
  if not os.path.isfile(path):
    return "missing"
  problem = elf_problem(path)
  if problem:
    return problem
  try:
    with open(_digest_path(path)) as f:
      recorded = f.read().strip()
  except OSError:
    return "no recorded SHA-256 (built by an older rkv, or the record was lost)"
  if recorded != _sha256(path):
    return "its bytes differ from the SHA-256 recorded when it was built"
  return None


def kernel_available() -> tuple[bool, str]:
  """``(True, "")`` if the cpu / hybrid tactics can run here: a usable ``$RKV_CPU_KERNEL_SO``, a
  verified cached build, or a compiler to build one; else ``(False, why)``. Builds nothing (the
  planner asks it before choosing a tactic)."""
  env = os.environ.get(SO_ENV)
  if env:
    problem = elf_problem(env) if os.path.isfile(env) else "not a file"
    return (problem is None, "" if problem is None else f"{SO_ENV}={env!r}: {problem}")
  if cached_build_problem(_cached_path()) is None:
    return True, ""
  try:
    find_compiler()
  except CompilerNotFoundError as e:
    return False, str(e)
  return True, ""


def _cached_path() -> str:
  return os.path.join(cache_dir(), f"rkv_cpu_kernel-{build_key()}-{platform.machine()}.so")


def library_path() -> str:
  """The library to load: ``$RKV_CPU_KERNEL_SO``, else the cached build (compiled if missing)."""
  env = os.environ.get(SO_ENV)
  if env:
    if not os.path.isfile(env):
      raise ValueError(f"{SO_ENV}={env!r} is not a file")
    problem = elf_problem(env)
    if problem:
      raise ValueError(f"{SO_ENV}={env!r} is not a usable library: {problem}; {_PREBUILD_HINT}")
    return env
  path = _cached_path()
  problem = cached_build_problem(path)
  if problem is not None:
    if problem != "missing":  # never load a build we cannot vouch for: rebuild it
      warnings.warn(f"rkv CPU-tail kernel: the cached build {path} is not usable ({problem}); "
                    f"rebuilding it", stacklevel=2)
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
  problem = _isa_problem(lib)
  if problem:
    raise RuntimeError(f"rkv CPU-tail kernel {path}: {problem}")
  lib.rkv_cpu_kernel_source_hash.restype = ctypes.c_char_p
  built = lib.rkv_cpu_kernel_source_hash().decode()
  if built != source_hash():
    warnings.warn(f"rkv CPU-tail kernel {path} was built from another source (hash {built}, "
                  f"current {source_hash()}); same ABI, but rebuild it to be sure", stacklevel=3)
  return lib


def library_has_avx512(lib: ctypes.CDLL) -> bool:
  """Whether ``lib`` was built with the 512-bit path (False for a library older than it)."""
  fn = getattr(lib, "rkv_cpu_kernel_has_avx512", None)
  return bool(fn()) if fn is not None else False


def _isa_problem(lib: ctypes.CDLL) -> str | None:
  """Why ``lib`` cannot run on this host, or None: a v4 (AVX-512) build on an x86 host whose
  flags say it has no AVX-512 would die on its first 512-bit instruction. Unknown flags (not
  Linux) are not held against it."""
  flags = _read_cpu_flags()
  if flags and library_has_avx512(lib) and not V4_FLAGS <= flags:
    return (f"it was built for AVX-512 (x86-64-v4) and this CPU lacks "
            f"{', '.join(sorted(V4_FLAGS - flags))}: build it with {MARCH_ENV}=x86-64-v3")
  return None


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
        f"avx512 {int(library_has_avx512(lib))}, {' '.join(arch_flags()) or 'default march'}, "
        f"source {source_hash()}, {platform.machine()})")
  print(f"export {SO_ENV}={os.path.abspath(path)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
