"""Needle-in-a-haystack: retrieval accuracy of the recall model per context length x needle depth,
on the resident path and with every layer forced offloaded (most KV in the host tail), and
whether each tactic answers exactly what resident answers (it must: the tactics are exact).

Task and model: rkv/recall.py, scoring: lab/niah.py (the shipped model is rkv/assets/recall). Offloaded tactics keep
--window_cells on the device and put the rest in host tiles of --tile_cells (rkv.generate.
force_tactic; hybrid attends --cpu_fraction of the tiles on the CPU, head keeps
--resident_heads KV heads whole on the device).

Example (CPU; writes the committed benchmarks/results/niah_cpu.json):
  .venv/bin/python -m experiments.niah --lengths=1024,2048,4096,8192 --samples=10 \
      --tactics=resident,stream,cpu,hybrid,head --out=benchmarks/results/niah_cpu.json
"""

import json
import logging
import os

from absl import app
from absl import flags

from lab import niah
from rkv import recall
from rkv import benchmarking

_N = niah.NiahConfig()
_MODEL = flags.DEFINE_string("model", None, "Recall model folder (default: the shipped one).")
_LENGTHS = flags.DEFINE_list("lengths", [str(x) for x in _N.lengths], "Context lengths (tokens).")
_DEPTHS = flags.DEFINE_list("depths", [str(x) for x in _N.depths],
                            "Needle depths in [0, 1] (0: first, 1: last before the query).")
_SAMPLES = flags.DEFINE_integer("samples", _N.samples, "Prompts per (length, depth) cell.",
                                lower_bound=1)
_BATCH = flags.DEFINE_integer("batch", _N.batch, "Prompts decoded together.", lower_bound=1)
_TACTICS = flags.DEFINE_list("tactics", list(_N.tactics),
                             f"Of {niah.TACTICS}; resident is always run (the yardstick).")
_W = flags.DEFINE_integer("window_cells", _N.window_cells, "Device window of offloaded layers.")
_TILE = flags.DEFINE_integer("tile_cells", _N.tile_cells, "Host-tail tile of offloaded layers.",
                             lower_bound=1)
_CPU_FRACTION = flags.DEFINE_float("cpu_fraction", _N.cpu_fraction,
                                   "hybrid: share of the tail's tiles attended on the CPU.")
_HEADS = flags.DEFINE_integer("resident_heads", _N.resident_heads,
                              "head: KV heads kept whole on the device.")
_CHUNK = flags.DEFINE_integer("chunk", _N.chunk, "Prefill chunk (tokens).", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", _N.seed, "Seed of the prompts.")
_IMPL = flags.DEFINE_string("impl", "auto", "Attention backend (rkv.attention impl).")
_OUT = flags.DEFINE_string("out", None, "Write the report JSON here.")


def main(argv):
  del argv
  # Output paths first: an unwritable one used to fail only after the whole run.
  benchmarking.check_output_path(_OUT.value)
  # Every batch plans its caches; the planner's "whole cache fits" line would flood the output.
  logging.getLogger("rkv.planner").setLevel(logging.WARNING)
  model, _, task = recall.load_recall_model(_MODEL.value, impl=_IMPL.value)
  cfg = niah.NiahConfig(
      lengths=tuple(int(x) for x in _LENGTHS.value),
      depths=tuple(float(x) for x in _DEPTHS.value), samples=_SAMPLES.value,
      batch=_BATCH.value, tactics=tuple(_TACTICS.value), window_cells=_W.value,
      tile_cells=_TILE.value, cpu_fraction=_CPU_FRACTION.value,
      resident_heads=_HEADS.value, chunk=_CHUNK.value, seed=_SEED.value)
  report = niah.niah(model, task, cfg)
  report["model"] = _MODEL.value or "rkv/assets/recall"
  print(niah.format_table(report))
  if _OUT.value:
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    with open(_OUT.value, "w") as f:
      json.dump(report, f, indent=2)
    print(f"wrote {_OUT.value}")
  exact = all(report["identical_to_resident"].values())
  return 0 if exact else 1


if __name__ == "__main__":
  app.run(main)
