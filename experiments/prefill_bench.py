"""Chunked prefill on the H200: the kernel at any offset, and a 1M-token prefill through the cache.

Two parts, one JSON (``benchmarks/results/prefill_h200.json``):

* ``kernel`` rows: a chunk of T queries at the end of ``depth`` cached keys, Llama-3-8B heads
  (H=32, K=8, D=128, bf16), through ``rkv.attention``: with explicit positions (what the cache
  passes: ``tflops``), with default positions on the same query/key pairs (``default_pos_tflops``,
  the Mosaic kernel's index-mask path), explicit positions in a cache buffer with unfilled slots
  after the chunk (``cache_tflops``: what a cache of fixed capacity passes) and the generic kernel
  on the explicit call (``generic_tflops``, the path explicit positions took before). FLOPs count
  the visible pairs only: ``4 * H * D * (T * depth + T (T + 1) / 2)``.
* ``model`` rows: one prefill chunk of the Llama-3-8B shape (random weights) through the caches
  the planner lays out for a 1M-token context with the default budget (window on the device,
  tail in pinned host memory), filled synthetically to ``depth`` first; the chunk's time (median
  of the timed chunks after one warm-up), its tokens/s, and its bound: the chunk's attention
  FLOPs at the default-positions rate measured at that depth in the same run, plus its GEMM FLOPs
  at the dense rate measured in the same run, or its streamed tail bytes over the profile's PCIe
  rate if that is longer. ``prefill_1m`` integrates the measured chunk times over the depths of a
  1M-token prefill (linear between the measured depths).

On the H200:
  python -m experiments.prefill_bench --out=benchmarks/results/prefill_h200.json \
      --profile=benchmarks/results/profile_h200_v3.json
On a CPU (a smoke run: small shapes, the generic kernel interpreted):
  python -m experiments.prefill_bench --quick
"""

from __future__ import annotations

import time

from absl import app
from absl import flags

_OUT = flags.DEFINE_string("out", None, "Where to write the JSON result (none: print only).")
_QUICK = flags.DEFINE_bool("quick", False, "Tiny shapes (a CPU smoke run).")
_DEPTHS = flags.DEFINE_list("depths", ["0", "131072", "524288", "1046528"],
                            "Cached keys before the chunk.")
_CHUNKS = flags.DEFINE_list("chunks", ["512", "2048"], "Kernel rows: queries per chunk.")
_MODEL_CHUNK = flags.DEFINE_integer("model_chunk", 512, "Model rows: tokens per chunk.")
_MODEL_CONTEXT = flags.DEFINE_integer("model_context", 1 << 20, "Model rows: the planned context.")
_PARTS = flags.DEFINE_list("parts", ["kernel", "model"], "Which parts to run.")
_PROFILE = flags.DEFINE_string("profile", None, "rkv.Profile JSON for the planner (PCIe rate).")
_N_OUTER = flags.DEFINE_integer("n_outer", 7, "Kernel rows: timed batches (the median is kept).")
_MODEL_STEPS = flags.DEFINE_integer("model_steps", 3, "Model rows: timed chunks per depth.")
_TRACE = flags.DEFINE_list("trace", [], "Part 'trace': depth:chunk pairs whose explicit and "
                           "default calls are traced (jax.profiler) and summarized per kernel.")

def main(argv):
  del argv
  import numpy as np
  import rkv  # noqa: F401  (sets the memory fraction before JAX starts)
  from lab import prefill_bench as pb
  from rkv import benchmarking
  if _OUT.value:  # an unwritable --out fails now, not after the run
    benchmarking.check_output_path(_OUT.value)
  depths = [int(x) for x in _DEPTHS.value]
  chunks = [int(x) for x in _CHUNKS.value]
  shape = dict(h=pb.H, kh=pb.K, d=pb.D)
  if _QUICK.value:
    depths, chunks, shape = [0, 256], [128], dict(h=4, kh=2, d=64)
  t0 = time.perf_counter()
  result = dict(benchmarking.environment(), rows=[])
  if "kernel" in _PARTS.value:
    result["rows"] += pb.kernel_rows(depths, chunks, n_outer=_N_OUTER.value,
                                      pad=128 if _QUICK.value else 65536, **shape)
  if "trace" in _PARTS.value and _TRACE.value:
    result["rows"] += pb.trace_rows(_TRACE.value, **shape)
  if "model" in _PARTS.value and not _QUICK.value:
    from lab import decode_bench as db
    mc = db.model_config(db.BenchConfig())
    dense = pb.dense_tflops(mc, _MODEL_CHUNK.value, _N_OUTER.value)
    kr = sorted((r["depth"], r["default_pos_tflops"]) for r in result["rows"]
                if r.get("chunk") == _MODEL_CHUNK.value and "default_pos_tflops" in r)
    if not kr:
      raise SystemExit("model rows need the kernel rows at --model_chunk (the attention rate)")
    attention = lambda depth: float(np.interp(depth, [p[0] for p in kr], [p[1] for p in kr]))
    result["dense_tflops"] = dense
    mrows = pb.model_rows(depths, context=_MODEL_CONTEXT.value, chunk=_MODEL_CHUNK.value,
                       steps=_MODEL_STEPS.value, profile_path=_PROFILE.value,
                       rates=dict(attention=attention, dense=dense))
    result["rows"] += mrows
    result["prefill_1m"] = pb.integrate_1m(mrows, _MODEL_CONTEXT.value, _MODEL_CHUNK.value)
    print(f"1M prefill (integrated): {result['prefill_1m']}")
  result["wall_s"] = time.perf_counter() - t0
  cols = ["part", "depth", "chunk", "tflops", "default_pos_tflops", "ratio_vs_default",
          "cache_tflops", "generic_tflops", "chunk_s", "tokens_per_s", "bound_ratio", "error"]
  print(benchmarking.format_table(result["rows"], cols))
  if _OUT.value:
    benchmarking.write_json(_OUT.value, result)
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
