"""Timing helpers: the probe that writes the planner's profile (:mod:`rkv.probe`) times with them,
and so do the lab's benchmarks (``lab/``); tests never time (speed is not a test).

Timing method: warm up first so compilation stays out, then time
``n_inner`` back-to-back calls and block on the last one: JAX dispatch is asynchronous, so the
host's launch overhead overlaps the device's work and the figure is device time per call. The
reported figure is the median of ``n_outer`` such batches.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import tempfile
import platform
import statistics
import time
from typing import Any, Callable

import jax

from rkv import atomic_io


@dataclasses.dataclass(frozen=True)
class Timing:
  median_s: float
  min_s: float
  max_s: float
  n_outer: int
  n_inner: int

  def as_dict(self) -> dict[str, float]:
    return dataclasses.asdict(self)


def _block(x):
  jax.tree_util.tree_map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x)


def time_fn(fn: Callable[..., Any], *args, n_warmup: int = 2, n_outer: int = 7,
            n_inner: int = 5, target_s: float | None = None) -> Timing:
  """Median seconds per call of ``fn(*args)``.

  With ``target_s``, ``n_inner`` grows until one batch lasts about that long (short kernels need
  many calls per batch for the launch overhead to hide).
  """
  for _ in range(n_warmup):
    _block(fn(*args))
  if target_s is not None:
    t0 = time.perf_counter()
    _block(fn(*args))
    one = max(time.perf_counter() - t0, 1e-6)
    n_inner = max(1, min(1000, int(target_s / one)))
  samples = []
  for _ in range(n_outer):
    t0 = time.perf_counter()
    out = None
    for _ in range(n_inner):
      out = fn(*args)
    _block(out)
    samples.append((time.perf_counter() - t0) / n_inner)
  return Timing(statistics.median(samples), min(samples), max(samples), n_outer, n_inner)


# Environment variables that change how a run executes (rkv's A/B switches, XLA's flags and its
# client's memory fraction): a result records the ones that were set, so an A/B's two files say
# which side each is.
RECORDED_ENV_PREFIXES = ("RKV_", "XLA_FLAGS", "XLA_PYTHON_CLIENT_", "XLA_CLIENT_", "OMP_")


# The library's sources a result's ``code`` fingerprint covers (its C / C++ kernels included).
CODE_SUFFIXES = (".py", ".c", ".cc", ".h")


@functools.lru_cache(maxsize=None)
def code_fingerprint(root: str | None = None) -> str:
  """The first 12 hex digits of a SHA-256 over the rkv package's sources (paths and bytes, in
  path order): which code produced a result. Why not the git commit: an A/B runs a previous
  tree from ``git archive`` (no ``.git``), and a working tree may hold uncommitted edits; both
  sides of such an A/B then record different fingerprints."""
  root = os.path.dirname(os.path.abspath(__file__)) if root is None else root
  if not os.path.isdir(root):
    raise ValueError(f"code_fingerprint: root must be a folder of sources, got {root!r}")
  digest = hashlib.sha256()
  paths = []
  for folder, dirs, files in os.walk(root):
    dirs[:] = sorted(d for d in dirs if d != "__pycache__")
    paths += [os.path.join(folder, f) for f in files if f.endswith(CODE_SUFFIXES)]
  for path in sorted(paths):
    digest.update(os.path.relpath(path, root).encode() + b"\0")
    with open(path, "rb") as f:
      digest.update(f.read())
  return digest.hexdigest()[:12]


def environment() -> dict[str, Any]:
  """What the figures were measured on, the switches that were set (``env``) and the library
  code that ran (``code``: :func:`code_fingerprint`)."""
  dev = jax.devices()[0]
  env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(RECORDED_ENV_PREFIXES)}
  return dict(jax=jax.__version__, backend=jax.default_backend(), device=dev.device_kind,
              platform=platform.platform(), python=platform.python_version(),
              time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), env=env,
              code=code_fingerprint())


def check_output_path(path: str | None, flag: str = "out", *, directory: bool = False) -> None:
  """Fails now, not after an hour of benchmarking, if ``path`` (the value of ``--flag``) cannot be
  written: its folder is created and a probe file written and removed there. ``directory``: the
  output is a folder (created if missing). None or "" (no output) passes.
  Raises ValueError naming the flag."""
  if not path:
    return
  target = os.path.abspath(path)
  folder = target if directory else os.path.dirname(target)
  if not directory and os.path.isdir(target):
    raise ValueError(f"--{flag}={path!r} is a directory; expected a file path")
  if directory and os.path.exists(target) and not os.path.isdir(target):
    raise ValueError(f"--{flag}={path!r} exists and is not a directory")
  try:
    os.makedirs(folder, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".rkv-write-check-"):
      pass
  except OSError as e:
    raise ValueError(f"--{flag}={path!r} cannot be written ({e}); checked before the run "
                     f"starts") from e


def write_json(path: str, payload: dict[str, Any]) -> None:
  """``payload`` as JSON at ``path``, atomically: a failure keeps the results already there."""
  with atomic_io.write_file_atomically(path) as f:
    json.dump(payload, f, indent=1, sort_keys=False, default=str)
    f.write("\n")


def format_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
  """A plain fixed-width table of the given columns (missing cells print as '-').

  Columns that no row has are left out.
  """
  columns = [c for c in columns if any(c in r for r in rows)]
  def cell(v):
    if v is None:
      return "-"
    if isinstance(v, float):
      return f"{v:.4g}"
    return str(v)
  cells = [[cell(r.get(c)) for c in columns] for r in rows]
  widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c)
            for i, c in enumerate(columns)]
  lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
  lines += ["  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in cells]
  return "\n".join(lines)
