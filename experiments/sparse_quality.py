"""Quality of the sparse tactic against dense: needle accuracy of the shipped recall model and
KL / top-1 of decode logits, per selector (lab/sparse_quality.py).

  python -m experiments.sparse_quality --lengths=1024,2048 --samples=4 --out=/tmp/sparse_quality.json
"""

from absl import app, flags

from lab import sparse_quality as lab
from rkv import benchmarking
from rkv.recall import load_recall_model

_D = lab.SparseQualityConfig()
_LENGTHS = flags.DEFINE_list("lengths", [str(x) for x in _D.lengths], "Context lengths.")
_DEPTHS = flags.DEFINE_list("depths", [str(x) for x in _D.depths], "Needle depths in [0, 1].")
_SAMPLES = flags.DEFINE_integer("samples", _D.samples, "Prompts per (length, depth).")
_SELECTORS = flags.DEFINE_list("selectors", list(_D.selectors), "Selectors: oracle, quest.")
_BLOCK = flags.DEFINE_integer("block_cells", _D.block_cells, "Cells per block.")
_SELECT = flags.DEFINE_integer("select_blocks", _D.select_blocks, "Blocks read per KV head.")
_WINDOW = flags.DEFINE_integer("window_blocks", _D.window_blocks, "Recent blocks always read.")
_SINKS = flags.DEFINE_integer("sink_blocks", _D.sink_blocks, "First blocks always read.")
_STEPS = flags.DEFINE_integer("logit_steps", _D.logit_steps, "Teacher-forced steps for KL.")
_OUT = flags.DEFINE_string("out", None, "JSON output path.")


def main(argv):
  del argv
  benchmarking.check_output_path(_OUT.value)
  model, _, task = load_recall_model()
  cfg = lab.SparseQualityConfig(
      lengths=tuple(int(x) for x in _LENGTHS.value), depths=tuple(float(x) for x in _DEPTHS.value),
      samples=_SAMPLES.value, batch=_SAMPLES.value, selectors=tuple(_SELECTORS.value),
      block_cells=_BLOCK.value, select_blocks=_SELECT.value, window_blocks=_WINDOW.value,
      sink_blocks=_SINKS.value, logit_steps=_STEPS.value)
  report = lab.quality(model, task, cfg)
  if _OUT.value:
    benchmarking.write_json(_OUT.value, dict(report, environment=benchmarking.environment()))


if __name__ == "__main__":
  app.run(main)
