"""`make demo-recall`: a needle query at a long context with most of the KV in the host tail.

    python -m experiments.demo                      # 8K tokens, 20% of the KV on the device
    python -m experiments.demo --context=16384 --depth=0.1 --device_share=0.1 --mode=hybrid

Loads the shipped recall model (rkv/assets/recall), prints the residency plan, answers the needle
query through the planned caches and through resident ones, and prints the answer, tokens/s and
the logit-equivalence figures (see lab/demo.py). Exits 1 if the answer is wrong, differs from
resident, or the logit gate fails.
"""

import json
import warnings

from absl import app, flags

from lab import demo
from rkv import cli, tactics
from rkv import benchmarking

_CONTEXT = flags.DEFINE_integer("context", 8192, "Prompt tokens.", lower_bound=1)
_DEPTH = flags.DEFINE_float("depth", 0.5, "Needle depth: 0 = start of the haystack, 1 = end.")
_SHARE = flags.DEFINE_float("device_share", 0.2, "Share of the KV bytes the plan keeps on the "
                            "device (the rest goes to the host tail).")
_MODE = flags.DEFINE_enum("mode", "auto", list(tactics.MODES) + ["window"],
                          "Planner mode (auto: the selector picks each layer's tactic; window: "
                          "the deprecated name of stream).")
_PROFILE = flags.DEFINE_string("profile", None, "rkv.Profile JSON for the planner (default: "
                               "~/.cache/rkv/profile.json if present, else rkv.H200_DEFAULT).")
_TILE = flags.DEFINE_integer("tile_cells", 1024, "Largest host-tail tile (cells).", lower_bound=1)
_CHECK = flags.DEFINE_integer("check_tokens", 32, "Prompt tokens decoded one by one for the "
                              "logit gate.", lower_bound=0)
_SEED = flags.DEFINE_integer("seed", 0, "Haystack seed.")
_MODEL = flags.DEFINE_string("model", None, "Recall model folder (default: the shipped one).")
_OUT = flags.DEFINE_string("out", None, "Also write the figures as JSON here.")


def main(argv):
  del argv
  # Warnings (e.g. the H200 profile planning a CPU run) on one line, not with a source line.
  warnings.formatwarning = cli.one_line_warning
  # Output paths first: an unwritable one used to fail only after the whole run.
  benchmarking.check_output_path(_OUT.value)
  cfg = demo.DemoConfig(context=_CONTEXT.value, depth=_DEPTH.value,
                        device_share=_SHARE.value, mode=_MODE.value, profile_path=_PROFILE.value,
                        tile_cells=_TILE.value, min_tile_cells=min(256, _TILE.value),
                        check_tokens=_CHECK.value, seed=_SEED.value, model_path=_MODEL.value)
  result = demo.run(cfg)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(result, f, indent=1)
  ok = result["correct"] and result["identical_to_resident"] and result["gate_passed"]
  return 0 if ok else 1


if __name__ == "__main__":
  app.run(main)
