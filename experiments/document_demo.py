"""`make demo`: SmolLM2 answers a question about a real document with most of its KV on the host.

    python -m experiments.document_demo      # Python's LICENSE history, 20% of the KV on the device
    python -m experiments.document_demo --device_share=0.1 --mode=hybrid
    python -m experiments.document_demo --document=notes.txt --question="..." --expected=word

Loads the packaged SmolLM2-135M-Instruct GGUF, prints the residency plan, answers through the
planned caches and through resident ones, and prints the answers, speeds and the
logit-equivalence figures (see lab/document_demo.py). Exits 1 if the answer misses every expected
string, differs from resident, or the logit gate fails.
"""

import json
import warnings

from absl import app, flags

from lab import document_demo
from rkv import cli, tactics

_D = document_demo.DocumentDemoConfig()
_DOCUMENT = flags.DEFINE_string("document", None, "Text file (default: this Python's LICENSE.txt, "
                                "its history section).")
_QUESTION = flags.DEFINE_string("question", _D.question, "The question about the document.")
_EXPECTED = flags.DEFINE_list("expected", list(_D.expected),
                              "Strings of which the answer must contain one (case-insensitive).")
_SHARE = flags.DEFINE_float("device_share", _D.device_share, "Share of the KV bytes the plan "
                            "keeps on the device (the rest goes to the host tail).")
_MODE = flags.DEFINE_enum("mode", _D.mode, list(tactics.MODES) + ["window"],
                          "Planner mode (auto: the selector picks each layer's tactic).")
_PROFILE = flags.DEFINE_string("profile", None, "rkv.Profile JSON for the planner.")
_TILE = flags.DEFINE_integer("tile_cells", _D.tile_cells, "Largest host-tail tile (cells).")
_NEW = flags.DEFINE_integer("max_new_tokens", _D.max_new_tokens, "Longest answer (tokens).")
_CHECK = flags.DEFINE_integer("check_tokens", _D.check_tokens, "Prompt tokens decoded one by "
                              "one for the logit gate.")
_MODEL = flags.DEFINE_string("model", None, "GGUF file (default: the packaged SmolLM2).")
_OUT = flags.DEFINE_string("out", None, "Also write the figures as JSON here.")


def main(argv):
  del argv
  # Warnings (e.g. the H200 profile planning a CPU run) on one line, not with a source line.
  warnings.formatwarning = cli.one_line_warning
  cfg = document_demo.DocumentDemoConfig(
      document=_DOCUMENT.value, question=_QUESTION.value, expected=tuple(_EXPECTED.value),
      device_share=_SHARE.value, mode=_MODE.value, profile_path=_PROFILE.value,
      tile_cells=_TILE.value, min_tile_cells=min(128, _TILE.value),
      max_new_tokens=_NEW.value, check_tokens=_CHECK.value, model_path=_MODEL.value)
  result = document_demo.run(cfg)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(result, f, indent=1)
  ok = result["correct"] and result["identical_to_resident"] and result["gate_passed"]
  return 0 if ok else 1


if __name__ == "__main__":
  app.run(main)
