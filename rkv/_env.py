"""Environment that must be set before JAX starts: imports only ``os``, ``sys`` and ``logging``.

``rkv/__init__.py`` calls :func:`set_default_mem_fraction` before anything imports jax, because
XLA's GPU client reads ``XLA_PYTHON_CLIENT_MEM_FRACTION`` once, when the backend is created
(``jaxlib/xla_client.py``, ``generate_pjrt_gpu_plugin_options``), and caps its pool at that
share of the device (default 0.75). :mod:`rkv.offload.memory` re-exports the names and reports
what happened (:func:`rkv.offload.memory.device_memory`, ``check_memory_fraction``).
"""

from __future__ import annotations

import logging
import os
import sys

MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
# jaxlib 0.11's newer name for the same setting: the GPU client raises ValueError when both are
# set, so a user who set this one must not get the other from rkv.
MEM_FRACTION_ENV_NEW = "XLA_CLIENT_MEM_FRACTION"
# Share of the device's memory XLA's GPU pool may take. Measured on the H200 (140.4 GiB =
# 143771 MiB per nvidia-smi, 139.8 GiB per cuDeviceTotalMem; jax 0.11.2), bytes_limit / largest
# allocation that succeeded: default (0.75) 105 GiB, 0.95 -> 133 GiB, 0.97 -> 136, 0.98 -> 138,
# 0.99 -> 139 GiB (memory_stats()["bytes_limit"]: 112,583,507,968 bytes at the default,
# 147,108,921,344 at 0.98, with or without XLA_PYTHON_CLIENT_PREALLOCATE=false). Llama-3-8B at 1M
# tokens is 128 GiB of KV plus 15 GiB of weights, and each GiB more of device window saves ~9 ms
# per decoded token, so the default's 75% throws away ~33 GiB. Not 0.99: the CUDA context, the
# loaded modules (the Pallas/Triton kernels) and the cuBLAS/cuDNN handles live outside XLA's
# pool and need some of the rest.
DEFAULT_DEVICE_MEM_FRACTION = 0.98

# What set_default_mem_fraction found (None: it has not run).
FRACTION_RKV = "set by rkv"
FRACTION_USER = "set by the user"
FRACTION_TOO_LATE = "too late"  # jax's backend existed before rkv was imported: its fraction holds
fraction_source: str | None = None


def backends_initialized(modules=None) -> bool:
  """Whether jax (if imported at all, per ``modules``, default ``sys.modules``) has created its
  backends — after that an XLA env var is ignored. Never imports jax itself."""
  modules = sys.modules if modules is None else modules
  if "jax" not in modules:
    return False
  xb = modules.get("jax._src.xla_bridge")
  if xb is None:
    return False
  check = getattr(xb, "backends_are_initialized", None)
  if callable(check):
    return bool(check())
  return bool(getattr(xb, "_backends", None))


def set_default_mem_fraction(environ=None, modules=None,
                             default: float = DEFAULT_DEVICE_MEM_FRACTION) -> str:
  """Sets ``XLA_PYTHON_CLIENT_MEM_FRACTION=default`` in ``environ`` (default ``os.environ``)
  unless the user set it (or ``XLA_CLIENT_MEM_FRACTION``) or jax's backends already exist (then
  the variable would be ignored, and setting it would only mislead a later reader). Returns and
  records in :data:`fraction_source` what happened: :data:`FRACTION_USER`, :data:`FRACTION_RKV`
  or :data:`FRACTION_TOO_LATE`.

  Opting out: set the variable yourself before importing rkv (``XLA_PYTHON_CLIENT_MEM_FRACTION=
  .75`` is JAX's own default). ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` still works with rkv's
  fraction: nothing is taken up front, the pool only grows to that share (measured on the H200:
  the same bytes_limit with and without preallocation).
  """
  global fraction_source
  environ = os.environ if environ is None else environ
  if environ.get(MEM_FRACTION_ENV, "").strip() or environ.get(MEM_FRACTION_ENV_NEW, "").strip():
    source = FRACTION_USER
  elif backends_initialized(modules):
    source = FRACTION_TOO_LATE
  else:
    environ[MEM_FRACTION_ENV] = f"{default:g}"
    source = FRACTION_RKV
  fraction_source = source
  return source


# XLA's command buffers (CUDA graphs), with the kinds that hold a decode step's kernels: XLA's
# fusions, cuBLAS(Lt) GEMMs, custom calls (rkv's Pallas kernels) and cuDNN. Measured on the H200
# (benchmarks/results/beyond_hbm/session10/{b,d}/, Llama-3-8B shape, B=1, resident, one jitted
# program a step): a step launches ~700 kernels, which took the host 4.2-4.5 ms where the GPU ran
# them in 4.4-5.6, so queued steps swung with the host from run to run (2K 160-227 tok/s, 32K
# 120-193 with them off); captured, the host launches one graph and the same rows ran 215-217 /
# 180-183 / 119-121 tok/s at 2K / 32K / 128K in four runs (off, interleaved with them: 160-213 /
# 120-159 / 116-119). A step read back before the next (generate with stop tokens) is as fast as with them
# off (2K 177 / 171 vs 174 / 166) because the step donates every buffer it writes
# (rkv.models.jit_forward): with fresh token buffers each step XLA re-recorded the graph on the
# critical path (156 tok/s). Before the decode step was one program (many programs a step, each
# waited for), forcing them on had been slower (cmdbuf_{on,off}.json: 87.95 vs 114.85 at 2K).
# The offloaded (layered) steps, whose per-layer programs take fresh buffers each call, showed no
# regression beyond their run-to-run spread (benchmarks/results/beyond_hbm/session10/e/,
# session11/: 128K half on / off 8.43 / 8.69 and 8.42 / 7.76; 2M int8 on 5.04 / 5.31, off 5.26 /
# 5.36 alternating on one machine).
COMMAND_BUFFER_FLAGS = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN",)
XLA_FLAGS_ENV = "XLA_FLAGS"


def add_default_xla_flags(environ=None, modules=None, flags=COMMAND_BUFFER_FLAGS) -> bool:
  """Appends each of ``flags`` to ``XLA_FLAGS`` whose name the user's ``XLA_FLAGS`` does not
  already set (theirs win), unless jax's backends exist (too late: XLA parsed the variable).
  Returns whether any flag was added. Opting out: set the flag yourself, e.g.
  ``XLA_FLAGS=--xla_gpu_enable_command_buffer=`` turns command buffers off."""
  environ = os.environ if environ is None else environ
  if backends_initialized(modules):
    return False
  current = environ.get(XLA_FLAGS_ENV, "")
  names = {f.split("=", 1)[0] for f in current.split()}
  extra = [f for f in flags if f.split("=", 1)[0] not in names]
  if extra:
    environ[XLA_FLAGS_ENV] = " ".join([current.strip()] + extra if current.strip() else extra)
  return bool(extra)


# JAX probes every platform it knows when its backends start and logs, at INFO, each one that
# "fails quietly" (jax._src.xla_bridge: "Unable to initialize backend 'tpu': ... libtpu.so ..."
# on every machine without a TPU). A script that shows INFO logs (every absl app: its default
# verbosity is INFO; `make demo`, the experiments) printed that line before any of its own. The
# filter drops only those probe records; a backend that fails loudly still raises, and JAX's
# warnings ("An NVIDIA GPU may be present ...", a plugin error) still print.
BACKEND_PROBE_LOGGER = "jax._src.xla_bridge"
BACKEND_PROBE_PREFIX = "Unable to initialize backend"
SHOW_BACKEND_PROBE_ENV = "RKV_SHOW_BACKEND_PROBE"


class _DropBackendProbe(logging.Filter):

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.levelno < logging.WARNING
                and str(record.msg).startswith(BACKEND_PROBE_PREFIX))


def quiet_backend_probe(environ=None) -> bool:
  """Installs the filter above on JAX's backend logger (once) unless ``$RKV_SHOW_BACKEND_PROBE``
  is set to a non-empty value other than 0. Returns whether the filter is installed."""
  environ = os.environ if environ is None else environ
  logger = logging.getLogger(BACKEND_PROBE_LOGGER)
  if environ.get(SHOW_BACKEND_PROBE_ENV, "").strip() not in ("", "0"):
    return False
  if not any(isinstance(f, _DropBackendProbe) for f in logger.filters):
    logger.addFilter(_DropBackendProbe())
  return True
