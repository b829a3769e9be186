"""Where a decode step's time goes: a ``jax.profiler`` trace of a few steps, summarized.

Builds the preset's model with random weights (as ``experiments.decode_bench``), fills each
configuration's caches synthetically, runs ``--warmup`` steps, times ``--steps`` untraced steps,
then traces ``--trace_steps`` more and summarizes the trace from its ``.xplane.pb``
(``jax.profiler.ProfileData``, no TensorBoard): per device stream the busy time and the top
kernels by total time, the host-to-device copies, and the host spans the library annotates
(``rkv.*``: the CPU tail kernel, the query's host copy, stream flow control). Writes one JSON.

Configurations: ``resident:<context>`` (every layer resident), ``offload:<context>:<share>``
(the planner's auto mode with ``share`` of the KV on the host) and ``beyond:<context>`` (the
planner's default budget: all free device memory after the weights, minus its reserve).

Example (H200, ~4 min):
  .venv/bin/python -m experiments.decode_trace --configs=resident:2048,resident:131072,\
offload:131072:0.5 --out=/tmp/decode_trace.json
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import tempfile
import time

from absl import app, flags

import rkv  # noqa: F401  (first: rkv sets the device memory fraction before JAX starts)
from lab.trace_summary import summarize
from rkv import benchmarking

_PRESET = flags.DEFINE_string("preset", "llama3-8b", "Model preset (random weights).")
_CONFIGS = flags.DEFINE_list("configs", ["resident:2048", "resident:131072",
                                         "offload:131072:0.5"], "kind:context[:host share].")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed steps.", lower_bound=0)
_STEPS = flags.DEFINE_integer("steps", 8, "Timed, untraced steps.", lower_bound=1)
_TRACE_STEPS = flags.DEFINE_integer("trace_steps", 3, "Traced steps.", lower_bound=1)
_PROFILE = flags.DEFINE_string("profile", None, "rkv.Profile JSON for the planner.")
_TOP = flags.DEFINE_integer("top", 25, "Kernels listed per stream.", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch", 1, "Batch rows of every configuration.", lower_bound=1)
_KV_DTYPE = flags.DEFINE_enum("kv_dtype", None, ["int8"], "The caches' dtype (default: the model's).")
_OUT = flags.DEFINE_string("out", "/tmp/decode_trace.json", "JSON output.")
_XPLANE_DIR = flags.DEFINE_string("xplane_dir", None, "Also keep each row's raw trace here, "
                                  "gzipped (<config>.xplane.pb.gz, colons as '_'): the event "
                                  "timeline the summary aggregates, for offline analysis.")


KINDS = ("resident", "offload", "beyond")


def parse_spec(spec: str) -> tuple[str, int, float | None]:
  """``kind:context[:share]`` -> (kind, context, share), or a ValueError naming --configs."""
  parts = spec.split(":")
  try:
    kind, ctx = parts[0], int(parts[1])
    share = float(parts[2]) if len(parts) > 2 else None
  except (IndexError, ValueError):
    kind = None
  if (kind not in KINDS or len(parts) > 3 or ctx < 2
      or (kind == "offload") != (share is not None) or (share is not None and not 0 < share < 1)):
    raise ValueError(f"--configs: {spec!r} is not resident:<context>, offload:<context>:<share in "
                     f"(0, 1)> or beyond:<context>")
  return kind, ctx, share


def _caches(kind, mc, ctx, share, key, profile):
  from lab import decode_bench as db
  cfg = db.BenchConfig(contexts=(ctx,), batch=_BATCH.value,
                       offload_fraction=share if share else 0.5,
                       budget="auto" if kind == "beyond" else "fraction", profile_path=profile,
                       warmup=_WARMUP.value, steps=_STEPS.value + _TRACE_STEPS.value + 1,
                       offload_warmup=_WARMUP.value, kv_dtype=_KV_DTYPE.value,
                       offload_steps=_STEPS.value + _TRACE_STEPS.value + 1)
  if kind == "resident":
    return db.build_caches(cfg, mc, ctx, key), cfg.fill(ctx), {}
  plan, info = db._offload_plan(cfg, mc, ctx)
  return db.build_caches(cfg, mc, ctx, key, plan), cfg.fill(ctx), info


def _keep_xplane(path: str, spec: str) -> str:
  import gzip
  import shutil
  os.makedirs(_XPLANE_DIR.value, exist_ok=True)
  dst = os.path.join(_XPLANE_DIR.value, spec.replace(":", "_") + ".xplane.pb.gz")
  with open(path, "rb") as src, gzip.open(dst, "wb") as out:
    shutil.copyfileobj(src, out)
  return dst


def main(argv):
  del argv
  # Output paths first: an unwritable one used to fail only after the whole run.
  benchmarking.check_output_path(_OUT.value)
  import gc
  import jax
  import numpy as np
  from flax import nnx
  from lab import decode_bench as db
  from rkv.generate import Stepper
  from rkv.models import Transformer, jit_forward
  mc = db.model_config(db.BenchConfig(preset=_PRESET.value))
  model = Transformer(mc, rngs=nnx.Rngs(0))
  jax.block_until_ready(nnx.state(model))
  forward = jit_forward(model, last_only=True)
  result = dict(benchmarking.environment(), preset=mc.name,
                weight_gib=db.weight_bytes(mc) / db.GIB,
                memory_stats=jax.devices()[0].memory_stats(), rows=[])
  specs = [parse_spec(spec) for spec in _CONFIGS.value]  # every spec checked before any work
  if any(kind != "resident" for kind, _, _ in specs):
    # Before any large fill (rkv.generate.warm_up): the 1M and 2M rows ran out of memory here
    # compiling the logits GEMM after the fill (benchmarks/results/beyond_hbm/session3/).
    db.warm_layered_programs(model, mc, db.BenchConfig(preset=_PRESET.value, batch=_BATCH.value,
                                                       kv_dtype=_KV_DTYPE.value))
  for spec, (kind, ctx, share) in zip(_CONFIGS.value, specs):
    row = dict(config=spec, kind=kind, context=ctx, batch=_BATCH.value, share=share,
               kv_dtype=_KV_DTYPE.value)
    result["rows"].append(row)
    caches = None
    try:
      caches, fill, info = _caches(kind, mc, ctx, share, jax.random.key(ctx), _PROFILE.value)
      row.update(info)
      jax.block_until_ready(caches)
      step = Stepper(model, caches, forward)
      n = _WARMUP.value + _STEPS.value
      times, dispatch, caches = db._decode_rkv(step, caches, fill, _WARMUP.value, _STEPS.value,
                                                 _BATCH.value)
      row["step_ms"] = 1e3 * statistics.median(times[_WARMUP.value:])
      row["host_ms"] = 1e3 * statistics.median(dispatch[_WARMUP.value:])
      opts = jax.profiler.ProfileOptions()
      opts.python_tracer_level = 0
      with tempfile.TemporaryDirectory() as d:
        # The first traced step pays the profiler's start (1 s on the H200): trace one step and
        # throw it away first.
        with jax.profiler.trace(d, profiler_options=opts):
          _, _, caches = db._decode_rkv(step, caches, fill + n, 0, 1, _BATCH.value)
        n += 1
      with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, profiler_options=opts):
          t0 = time.perf_counter()
          t_tr, _, caches = db._decode_rkv(step, caches, fill + n, 0, _TRACE_STEPS.value,
                                              _BATCH.value)
          row["traced_wall_ms"] = 1e3 * (time.perf_counter() - t0)
        row["traced_step_ms"] = [1e3 * t for t in t_tr]
        pb = sorted(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True))
        row["trace"] = summarize(pb[-1], _TOP.value)
        if _XPLANE_DIR.value:
          row["xplane"] = _keep_xplane(pb[-1], spec)
      print(json.dumps({k: row[k] for k in row if k != "trace"}), flush=True)
    except Exception as e:  # noqa: BLE001 - keep the other rows
      import traceback
      row["error"] = f"{type(e).__name__}: {e}"
      row["traceback"] = traceback.format_exc(limit=8)
      print(row["error"], flush=True)
    finally:
      del caches
      gc.collect()
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(result, f, indent=1, default=str)
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
