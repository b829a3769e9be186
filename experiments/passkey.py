"""Passkey retrieval with SmolLM2 through every tactic: each must score what resident scores and
generate the same tokens (the tactics are exact).

A random five-digit key hidden in filler text, the question at the end, the chat template; a
reply scores 1 if it contains the key (lab/passkey.py). Offloaded tactics keep --window_cells on
the device and put the rest in host tiles of --tile_cells (rkv.generate.force_tactic; hybrid
attends --cpu_fraction of the tiles on the CPU, head keeps --resident_heads KV heads whole).
SmolLM2's context is 8K, so 8K is the longest length; the GGUF (98 MB) does not travel to the GPU
machine, so this is a CPU benchmark.

Example (CPU, 2 cores; writes the committed benchmarks/results/passkey_smollm2_cpu.json):
  .venv/bin/python -m experiments.passkey --lengths=1024,2048,4096,8192 --samples=3 \
      --samples_at=2048:2,4096:1,8192:1 --tactics_at=4096:resident+stream+head,8192:resident+cpu \
      --out=benchmarks/results/passkey_smollm2_cpu.json
"""

import json
import logging
import os
import time

from absl import app
from absl import flags

from lab import passkey
from rkv import benchmarking
from rkv import models
from rkv.models import gguf_loader

_P = passkey.PasskeyConfig()
_MODEL = flags.DEFINE_string("model", None, "GGUF file (default: the packaged SmolLM2).")
_LENGTHS = flags.DEFINE_list("lengths", [str(x) for x in _P.lengths],
                             "Prompt lengths (tokens, at most).")
_SAMPLES = flags.DEFINE_integer("samples", _P.samples, "Prompts per length (depths spread over "
                                "[0, 1]).", lower_bound=1)
_TACTICS = flags.DEFINE_list("tactics", list(_P.tactics),
                             f"Of {passkey.TACTICS}; resident is always run (the yardstick).")
_TACTICS_AT = flags.DEFINE_list(
    "tactics_at", [], "Per-length tactics overriding --tactics there, as LENGTH:T1+T2 (e.g. "
    "8192:resident+hybrid to run fewer at the longest length).")
_SAMPLES_AT = flags.DEFINE_list(
    "samples_at", [], "Per-length samples overriding --samples there, as LENGTH:N.")
_W = flags.DEFINE_integer("window_cells", _P.window_cells, "Device window of offloaded layers.",
                          lower_bound=0)
_TILE = flags.DEFINE_integer("tile_cells", _P.tile_cells, "Host-tail tile of offloaded layers.",
                             lower_bound=1)
_CPU_FRACTION = flags.DEFINE_float("cpu_fraction", _P.cpu_fraction,
                                   "hybrid: share of the tail's tiles attended on the CPU.")
_HEADS = flags.DEFINE_integer("resident_heads", _P.resident_heads,
                              "head: KV heads kept whole on the device.", lower_bound=0)
_NEW = flags.DEFINE_integer("max_new_tokens", _P.max_new_tokens, "Longest reply (tokens).",
                            lower_bound=1)
_SEED = flags.DEFINE_integer("seed", _P.seed, "Seed of the keys.")
_OUT = flags.DEFINE_string("out", None, "Write the report JSON here.")


def _tactics_at(values):
  out = []
  for v in values:
    length, sep, names = v.partition(":")
    if not sep or not length.isdigit():
      raise ValueError(f"--tactics_at: expected LENGTH:T1+T2, got {v!r}")
    out.append((int(length), tuple(names.split("+"))))
  return tuple(out)


def _samples_at(values):
  out = []
  for v in values:
    length, sep, n = v.partition(":")
    if not sep or not length.isdigit() or not n.isdigit():
      raise ValueError(f"--samples_at: expected LENGTH:N, got {v!r}")
    out.append((int(length), int(n)))
  return tuple(out)


def main(argv):
  del argv
  benchmarking.check_output_path(_OUT.value)  # before the run, not after it
  # Every prompt plans its caches; the planner's lines would flood the output.
  logging.getLogger("rkv.planner").setLevel(logging.ERROR)
  cfg = passkey.PasskeyConfig(
      lengths=tuple(int(x) for x in _LENGTHS.value), samples=_SAMPLES.value,
      tactics=tuple(_TACTICS.value), tactics_at=_tactics_at(_TACTICS_AT.value),
      samples_at=_samples_at(_SAMPLES_AT.value),
      window_cells=_W.value, tile_cells=_TILE.value, cpu_fraction=_CPU_FRACTION.value,
      resident_heads=_HEADS.value, max_new_tokens=_NEW.value, seed=_SEED.value)
  t0 = time.perf_counter()
  model, tok = models.load_gguf(_MODEL.value, impl="xla")
  report = passkey.run(model, tok, cfg)
  report["model"] = _MODEL.value or gguf_loader.SMOLLM2_FILE
  report["dtype"] = str(model.config.dtype)
  report["cpu_count"] = os.cpu_count()
  report["wall_s"] = time.perf_counter() - t0
  print(passkey.format_table(report))
  if _OUT.value:
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    with open(_OUT.value, "w") as f:
      json.dump(report, f, indent=2)
    print(f"wrote {_OUT.value}")
  return 0 if all(report["identical_to_resident"].values()) else 1


if __name__ == "__main__":
  app.run(main)
