"""Decode attention under Nsight Compute: calls bracketed for ``ncu``, and its CSV summarised.

Why a driver of our own: a resident decode step is ~700 kernels and ``ncu`` replays every kernel
it profiles many times, so a step under ncu takes minutes and names XLA's fusions, not the call
they belong to. :func:`profile_decode_calls` runs one decode-attention call as a resident step
issues it (B=1, T=1, H=32, K=8, D=128, the cache's explicit positions ``k_pos = arange``), warms
it up, then runs it once between the profiler's start and stop, so that
``ncu --profile-from-start off`` sees exactly that call: the wrapper's fusions (key bounds, the
query's packing), the kernel, the split merge. Several calls share one process (JAX starting
under ncu took ~80 s on the H200). :func:`summarize` reads ``ncu --csv --page details`` back
(the csv module, not a hand parser: metric values carry thousands separators inside quotes).

ncu saves and restores what a replayed kernel writes, so the device must not be preallocated
(rkv's default takes 0.98 of it, and ncu then fails with "Failed to profile"):
``XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.5`` (see
``experiments/ncu_decode.py``).
"""

from __future__ import annotations

import csv
import dataclasses
import io
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp

from rkv.pallas import decode_attention as decode_kernel

# The shape of one Llama-3-8B layer's decode call.
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
CALL_MARK = "ncu_call:"  # printed before each call's figures, so that a summary can name calls
FILL_KEY = "kv_fill"  # a run option that is not a BlockSizes field (see profile_decode_calls)
# Call lines of the first driver (benchmarks/results/beyond_hbm/session11/ CSVs) began "S=".
_CALL_PREFIXES = (CALL_MARK, "S=")

KERNEL_METRICS = (
    "Duration", "Elapsed Cycles", "SM Frequency", "DRAM Frequency", "DRAM Throughput",
    "Memory Throughput", "Memory Throughput (byte/s)", "Compute (SM) Throughput", "Max Bandwidth", "Mem Busy", "L2 Hit Rate",
    "Registers Per Thread", "Dynamic Shared Memory Per Block", "Block Limit Shared Mem",
    "Block Limit Registers", "Theoretical Occupancy", "Achieved Occupancy", "Waves Per SM",
    "Active Warps Per Scheduler", "Eligible Warps Per Scheduler", "Issue Slots Busy",
    "No Eligible", "Warp Cycles Per Issued Instruction")


def _check_runs(runs) -> list[tuple[int, dict[str, Any]]]:
  out = []
  for run in runs:
    if (not isinstance(run, (list, tuple)) or len(run) != 2 or not isinstance(run[0], int)
        or isinstance(run[0], bool) or run[0] < 1 or not isinstance(run[1], dict)):
      raise ValueError(f"profile_decode_calls: each run must be [keys >= 1, {{BlockSizes "
                       f"overrides}}], got {run!r}")
    out.append((run[0], run[1]))
  if not out:
    raise ValueError("profile_decode_calls: runs is empty")
  return out


def profile_decode_calls(runs: Iterable, *, start: Callable[[], Any], stop: Callable[[], Any],
                         warmup: int = 3, dtype=None, log=print) -> list[dict[str, Any]]:
  """For each ``[keys, block_sizes_overrides]`` in ``runs``: warm one decode-attention call up,
  then run it once between ``start()`` and ``stop()`` (``cuProfilerStart`` / ``cuProfilerStop``
  under ncu). Returns one record a call: the keys, the overrides and the resolved BlockSizes.
  The overrides are BlockSizes fields, and ``"kv_fill": true`` to pass the cache's fill level
  (``kv_fill=keys``, as ``ResidentCache.attend`` does). Other overrides, or values BlockSizes
  refuses, are refused by name before anything runs."""
  runs = _check_runs(runs)
  fields = {f.name for f in dataclasses.fields(decode_kernel.BlockSizes)}
  for _, cfg in runs:
    if not isinstance(cfg.get(FILL_KEY, False), bool):
      raise ValueError(f"profile_decode_calls: {FILL_KEY} must be true or false, got "
                       f"{cfg[FILL_KEY]!r}")
    cfg = {name: value for name, value in cfg.items() if name != FILL_KEY}
    unknown = sorted(set(cfg) - fields)
    if unknown:
      raise ValueError(f"profile_decode_calls: {unknown} are not BlockSizes fields "
                       f"({sorted(fields)})")
    dataclasses.replace(decode_kernel.BlockSizes(), **cfg).check("profile_decode_calls")
  if dtype is None:
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
  records = []
  for keys, overrides in runs:
    cfg = {name: value for name, value in overrides.items() if name != FILL_KEY}
    block_sizes = dataclasses.replace(decode_kernel.BlockSizes(), **cfg)
    kv_fill = jnp.int32(keys) if overrides.get(FILL_KEY, False) else None
    kq, kk, kv = jax.random.split(jax.random.key(keys), 3)
    q = jax.random.normal(kq, (1, 1, HEADS, HEAD_DIM), dtype)
    k = jax.random.normal(kk, (1, keys, KV_HEADS, HEAD_DIM), dtype)
    v = jax.random.normal(kv, (1, keys, KV_HEADS, HEAD_DIM), dtype)
    q_pos = jnp.full((1, 1), keys - 1, jnp.int32)
    k_pos = jnp.arange(keys, dtype=jnp.int32)[None]
    call = jax.jit(lambda q, k, v, q_pos, k_pos, fill, bs=block_sizes:
                   decode_kernel.decode_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, kv_fill=fill,
                                                  block_sizes=bs)[0])
    for _ in range(warmup):
      call(q, k, v, q_pos, k_pos, kv_fill).block_until_ready()
    start()
    out = call(q, k, v, q_pos, k_pos, kv_fill).block_until_ready()
    stop()
    resolved = block_sizes.resolve(batch=1, kv_heads=KV_HEADS, kv_len=keys,
                                   rows=max(16, HEADS // KV_HEADS), head_dim=HEAD_DIM,
                                   kv_itemsize=jnp.dtype(dtype).itemsize)
    record = dict(keys=keys, overrides=overrides, block_sizes=dataclasses.asdict(resolved),
                  finite=bool(jnp.isfinite(out).all()))
    log(f"{CALL_MARK} keys={keys} overrides={cfg} block_sizes={record['block_sizes']}")
    records.append(record)
  return records


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One profiled kernel: its ncu ID, name, grid and block, and metric name -> (value, unit)."""
  id: int
  name: str
  grid: str
  block: str
  metrics: dict
  rules: tuple  # (rule name, description) of ncu's WRN/OPT findings

  def value(self, metric: str) -> float | None:
    """A metric as a float (ncu writes ``"131,776"``), None when absent."""
    if metric not in self.metrics:
      return None
    return float(self.metrics[metric][0].replace(",", ""))


def parse(text: str) -> tuple[list[str], list[Kernel]]:
  """``ncu --csv --page details`` output (the program's own lines may come first) ->
  (the program's ``CALL_MARK`` lines, the kernels in profiling order)."""
  lines = text.splitlines()
  header = next((i for i, line in enumerate(lines) if line.startswith('"ID",')), None)
  if header is None:
    raise ValueError("ncu_profile.parse: no ncu CSV header (a line starting with \"ID\",) found")
  calls = [line for line in lines[:header] if line.startswith(_CALL_PREFIXES)]
  reader = csv.reader(io.StringIO("\n".join(lines[header:])))
  names = next(reader)
  by_id: dict[int, dict] = {}
  for row in reader:
    if len(row) < len(names) - 5 or not row[0].isdigit():  # ncu's own messages, blank lines
      continue
    rec = dict(zip(names, row))
    k = by_id.setdefault(int(rec["ID"]), dict(name=rec["Kernel Name"], grid=rec["Grid Size"],
                                               block=rec["Block Size"], metrics={}, rules=[]))
    name, unit = rec.get("Metric Name"), rec.get("Metric Unit", "")
    if name:
      # A name may come twice in other units ("Memory Throughput": % in SpeedOfLight, byte/s
      # in MemoryWorkloadAnalysis): the later one is kept as "name (unit)".
      first = k["metrics"].get(name)
      key = name if first is None or first[1] == unit else f"{name} ({unit})"
      k["metrics"].setdefault(key, (rec["Metric Value"], unit))
    if rec.get("Rule Type") in ("WRN", "OPT") and rec.get("Rule Description"):
      k["rules"].append((rec["Rule Name"], rec["Rule Description"]))
  kernels = [Kernel(id=i, name=k["name"], grid=k["grid"], block=k["block"], metrics=k["metrics"],
                    rules=tuple(k["rules"])) for i, k in sorted(by_id.items())]
  return calls, kernels


def summarize(text: str, kernel_match: str = "rkv_decode") -> str:
  """Every kernel's duration; for kernels whose name holds ``kernel_match``, KERNEL_METRICS and
  ncu's findings, under the call line that announced them. The kernels before a call's decode
  kernel are its wrapper's, the ones after it the split merge's."""
  calls, kernels = parse(text)
  out, call = [], 0
  for k in kernels:
    duration = k.metrics.get("Duration", ("?", ""))
    if kernel_match not in k.name:
      out.append(f"  {k.id:>3} {k.name:<28} {duration[0]:>8} {duration[1]}  grid {k.grid}")
      continue
    out.append(f"=== {calls[call] if call < len(calls) else '(call not announced)'}")
    call += 1
    out.append(f"  {k.id:>3} {k.name} grid {k.grid} block {k.block}")
    for m in KERNEL_METRICS:
      if m in k.metrics:
        out.append(f"        {m:<40} {k.metrics[m][0]:>10} {k.metrics[m][1]}")
    for name, text_ in k.rules:
      out.append(f"        rule {name}: {text_[:300]}")
  return "\n".join(out) + "\n"
