"""Do two half batches decoded side by side fill the link and the CPU that one batch leaves idle?

Why (docs/DESIGN.md §6, "layer chain"): a hybrid layer's CPU share and its merge form a serial
chain with the next layer's query, so at B=8 x 128K the PCIe link idled ~1.3 ms of a ~4.4 ms
layer (beyond_hbm/session9/b/trace_b8.json). Two half batches share no chain: while one waits for
its CPU partial, the other's tiles can stream and its programs run. This probe measures that
before anything is built into rkv: the batch is planned and filled as ``--microbatches`` caches
of ``batch / microbatches`` rows (each planned with its share of the free device memory, under
the default budget), and each half decodes in its own Python thread (the CPU kernel and the waits
release the GIL). Rows, alternating in one run:

  whole        one batch of ``--batch`` rows (decode_bench's rkv_offload row, budget="auto")
  split        the same rows as ``--microbatches`` caches, decoded one after the other in one
               thread (the control: what splitting alone costs)
  concurrent   the same caches, each decoded in its own thread at once
  concurrent_tN  the same with ``$RKV_CPU_TAIL_THREADS=N`` (two CPU kernels may run at once and
               share the 16 host cores)

tokens/s counts every row's tokens over the wall time of the timed steps (after a barrier, so
that every thread has warmed up).

  python -m experiments.microbatch_probe --batch=8 --microbatches=2 --context=131072 \\
      --profile=benchmarks/results/profile_h200_v3.json --out=/tmp/microbatch.json
"""

from absl import app
from absl import flags

from rkv import benchmarking
from lab import microbatch_probe

_BATCH = flags.DEFINE_integer("batch", 8, "Rows of the whole batch.", lower_bound=2)
_MICRO = flags.DEFINE_integer("microbatches", 2, "Caches the batch is split into.", lower_bound=2)
_CONTEXT = flags.DEFINE_integer("context", 131072, "Cells of every row.", lower_bound=64)
_PRESET = flags.DEFINE_string("preset", "llama3-8b", "Model preset (random weights).")
_PROFILE = flags.DEFINE_string("profile", None, "rkv.Profile JSON for the planner.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps per thread.", lower_bound=1)
_STEPS = flags.DEFINE_integer("steps", 6, "Timed steps.", lower_bound=1)
_THREADS = flags.DEFINE_list("cpu_threads", ["7"], "Extra concurrent rows with this many CPU "
                             "kernel threads each ($RKV_CPU_TAIL_THREADS).")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Rounds of the alternation.", lower_bound=1)
_OUT = flags.DEFINE_string("out", None, "JSON output path.")


def main(argv):
  del argv
  benchmarking.check_output_path(_OUT.value)
  if _BATCH.value % _MICRO.value:
    raise SystemExit(f"--batch={_BATCH.value} must be a multiple of --microbatches="
                     f"{_MICRO.value}")
  result = microbatch_probe.run(
      preset=_PRESET.value, batch=_BATCH.value, microbatches=_MICRO.value,
      context=_CONTEXT.value, profile_path=_PROFILE.value, warmup=_WARMUP.value,
      steps=_STEPS.value, cpu_threads=[int(t) for t in _THREADS.value],
      repeats=_REPEATS.value)
  for row in result["rows"]:
    print(f"{row['variant']:>16}: {row.get('tokens_per_s', float('nan')):.2f} tok/s "
          f"{row.get('error', '')}")
  if _OUT.value:
    benchmarking.write_json(_OUT.value, result)
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
