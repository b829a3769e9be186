"""Logit-equivalence gate: each tail tactic (stream, cpu, hybrid, head; most KV in the pinned-host
tail) against the resident path, teacher-forced on the same tokens; prints each tactic's plan and
metrics, a table of the figures per tactic, and the verdict (exit 1 if any tactic fails).

Example (CPU, a fixture checkpoint; W=5, tile=4 force most of the 32 cells into the tail; hybrid
attends --cpu_fraction of the tail's tiles on the CPU, head keeps --resident_heads whole):
  .venv/bin/python -m experiments.equiv_gate --checkpoint=tests/fixtures/hf/gemma2 \
      --out=/tmp/equiv_gemma2.json
A random-weight preset, the planner placing the tail under a tiny budget (bfloat16 gate):
  .venv/bin/python -m experiments.equiv_gate --checkpoint= --preset=tiny-gemma3 \
      --dtype=bfloat16 --seq_len=300 --prefill_len=290 --batch=1 --window_cells=-1 \
      --tile_cells=-1 --device_gib=0.00003 --tactics=stream,cpu,hybrid
      # stream plans W=0, tile 128: 2 host tiles + 44 staged
"""

from absl import app
from absl import flags
from absl import logging

from rkv import gates
from rkv import benchmarking

_CHECKPOINT = flags.DEFINE_string("checkpoint", "tests/fixtures/hf/gemma2",
                                  "Local HF checkpoint folder ('' to use --preset).")
_PRESET = flags.DEFINE_string("preset", None, "A random-weight ModelConfig preset, e.g. tiny-llama.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Model and KV dtype.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 32, "Tokens per row (without a reference.npz).",
                                lower_bound=1)
_PREFILL = flags.DEFINE_integer("prefill_len", 18, "Prefilled tokens; the rest are decoded.",
                                lower_bound=1)
_BATCH = flags.DEFINE_integer("batch", 2, "Rows (without a reference.npz).", lower_bound=1)
_W = flags.DEFINE_integer("window_cells", 5, "Forced window W (-1: let the planner place it).")
_TILE = flags.DEFINE_integer("tile_cells", 4, "Forced tail tile (-1: the planner's).")
_DEVICE_GIB = flags.DEFINE_float("device_gib", 0.0, "KV budget for the planner when W/tile are "
                                 "not forced, in GiB (0: all free device memory).")
# The budget flag's MiB spelling, before budget flags were in GiB (rkv CLI: --device_gib).
_VRAM = flags.DEFINE_float("vram_target_mib", None, "Deprecated: --device_gib in MiB.")
_TACTICS = flags.DEFINE_list("tactics", list(gates.GATE_TACTICS),
                             "Tail tactics gated against the resident path, comma-separated.")
_CPU_FRACTION = flags.DEFINE_float("cpu_fraction", 0.5,
                                   "hybrid (forced W/tile): share of the tail tiles on the CPU.")
_RESIDENT_HEADS = flags.DEFINE_integer("resident_heads", -1,
                                       "head (forced W/tile): KV heads kept whole on the device "
                                       "(-1: K // 2).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of random weights and tokens.")
_IMPL = flags.DEFINE_string("impl", "xla", "Attention backend (rkv.attention impl).")
_OUT = flags.DEFINE_string("out", None, "Write the report JSON here.")


def _budget_mib() -> float:
  if _VRAM.value is None:
    return 1024 * _DEVICE_GIB.value
  logging.warning("--vram_target_mib is deprecated: use --device_gib=%g", _VRAM.value / 1024)
  return _VRAM.value


def main(argv):
  del argv
  # Output paths first: an unwritable one used to fail only after the whole run.
  benchmarking.check_output_path(_OUT.value)
  report = gates.equivalence_gate(
      checkpoint=_CHECKPOINT.value or None, preset=_PRESET.value, dtype=_DTYPE.value,
      seq_len=_SEQ_LEN.value, prefill_len=_PREFILL.value, batch=_BATCH.value,
      window_cells=None if _W.value < 0 else _W.value,
      tile_cells=None if _TILE.value < 0 else _TILE.value,
      vram_target_mib=_budget_mib(), tactics=_TACTICS.value, cpu_fraction=_CPU_FRACTION.value,
      resident_heads=None if _RESIDENT_HEADS.value < 0 else _RESIDENT_HEADS.value,
      seed=_SEED.value, impl=_IMPL.value, out=_OUT.value)
  return 0 if report.passed else 1


if __name__ == "__main__":
  app.run(main)
