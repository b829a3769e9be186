"""Kernel benchmark: rkv's Pallas decode/prefill kernels against cuDNN and XLA in one run.

On the H200 (writes benchmarks/results/kernel_bench_h200.json):
  python -m experiments.kernel_bench --out=benchmarks/results/kernel_bench_h200.json --tokamax
On a CPU (the self-check the README's demo runs; kernels in interpret mode, small shapes):
  python -m experiments.kernel_bench --quick
Sweep block sizes (JSON lists of BlockSizes overrides):
  python -m experiments.kernel_bench --sweep_decode='[{"block_k": 256, "num_warps": 4}]'
Decode attention as a model step runs it (32 calls in one program, each over its own K/V; with
--kv_dtype=int8, int8 K/V with bfloat16 scales):
  python -m experiments.kernel_bench --layers=32 --contexts=2048,32768 --sweep_decode='[...]'
"""

from absl import app
from absl import flags

from rkv import benchmarking
from lab import kernel_bench

_QUICK = flags.DEFINE_bool("quick", False, "Small shapes (CPU self-check) instead of the H200 shapes.")
_OUT = flags.DEFINE_string("out", None, "Where to write the JSON result (none: print only).")
_TOKAMAX = flags.DEFINE_bool("tokamax", False, "Add tokamax's Mosaic attention as a prefill peer.")
_SWEEP_DECODE = flags.DEFINE_string("sweep_decode", "", "JSON list of decode BlockSizes overrides.")
_SWEEP_PREFILL = flags.DEFINE_string("sweep_prefill", "", "JSON list of flash BlockSizes overrides.")
_LAYERS = flags.DEFINE_integer("layers", 0, "Decode attention only, this many calls over distinct "
                                "K/V in one program per context (0: the per-call rows).",
                                lower_bound=0)
_CONTEXTS = flags.DEFINE_list("contexts", ["2048", "8192", "32768", "131072"],
                              "Contexts of the --layers rows (B=1, H=32, K=8, D=128).")
_KV_DTYPE = flags.DEFINE_enum("kv_dtype", "native", ["native", "int8"],
                              "K/V of the --layers rows: the run's float dtype, or int8 with "
                              "bfloat16 scales.")
_N_OUTER = flags.DEFINE_integer("n_outer", 7, "Timed batches per contender (the median is reported).",
                                lower_bound=1)


def main(argv):
  del argv
  # Output paths first: an unwritable one used to fail only after the whole run.
  benchmarking.check_output_path(_OUT.value)
  if _LAYERS.value:
    try:
      contexts = [int(c) for c in _CONTEXTS.value]
    except ValueError:
      contexts = []
    if not contexts or min(contexts) < 1:
      raise SystemExit(f"--contexts must be positive integers, got {_CONTEXTS.value}")
    result = kernel_bench.run_layers(contexts=contexts, layers=_LAYERS.value,
                                     n_outer=_N_OUTER.value, kv_dtype=_KV_DTYPE.value,
                                     sweep_decode=kernel_bench.parse_sweep(_SWEEP_DECODE.value))
    print(benchmarking.format_table(result["rows"], kernel_bench.LAYER_COLUMNS))
    if _OUT.value:
      benchmarking.write_json(_OUT.value, result)
      print(f"wrote {_OUT.value}")
    return
  result = kernel_bench.run(quick=_QUICK.value, use_tokamax=_TOKAMAX.value, n_outer=_N_OUTER.value,
                            sweep_decode=kernel_bench.parse_sweep(_SWEEP_DECODE.value),
                            sweep_prefill=kernel_bench.parse_sweep(_SWEEP_PREFILL.value))
  print(benchmarking.format_table(result["rows"], kernel_bench.COLUMNS))
  failed = kernel_bench.self_check(result)
  if failed:
    raise SystemExit("self-check FAILED (max |diff| vs the float32 reference above tolerance): "
                     + "; ".join(failed))
  print(f"self-check passed: every impl within {kernel_bench.SELF_CHECK_ATOL} of the reference")
  if _OUT.value:
    benchmarking.write_json(_OUT.value, result)
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
