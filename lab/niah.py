"""Needle-in-a-haystack scoring of the recall model (rkv.recall) over context lengths x needle
depths, on the resident path and with every layer forced to an offloaded tactic; every tactic
must answer exactly what resident answers (they are exact). ``experiments/niah.py`` is the front end.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from rkv import tactics
from rkv.recall import RecallTask, answer, haystack_batch


TACTICS = tactics.TACTICS


def tactic_caches(config, tactic: str, batch: int, capacity: int, *, window_cells: int,
                  tile_cells: int, cpu_fraction: float = 0.5, resident_heads: int = 1) -> tuple:
  """Empty caches for ``tactic``: ``resident`` (:func:`rkv.models.init_caches`), or every layer
  forced to an offloaded tactic (:func:`rkv.generate.force_tactic`) with a device window of
  ``window_cells`` and host tiles of ``tile_cells``; ``hybrid`` attends ``cpu_fraction`` of the
  tail's tiles on the CPU, ``head`` keeps ``resident_heads`` KV heads whole on the device."""
  from rkv import generate as gen
  from rkv import models
  from rkv.planner import ResidencyConfig, plan as make_plan

  if tactic not in TACTICS:
    raise ValueError(f"tactic_caches: tactic must be one of {TACTICS}, got {tactic!r}")
  if tactic == "resident":
    return models.init_caches(config, batch, capacity)
  # A budget far above the cache: every layer planned resident, then forced offloaded.
  base = make_plan(config, capacity, batch,
                   residency=ResidencyConfig(mode="stream", vram_target_mib=1 << 20))
  forced = gen.force_tactic(base, tactic, window_cells, tile_cells, cpu_fraction=cpu_fraction,
                            resident_heads=resident_heads)
  return gen.caches_from_plan(config, forced, batch, capacity)


@dataclasses.dataclass(frozen=True)
class NiahConfig:
  """The grid :func:`niah` scores: ``samples`` prompts per (length, depth) cell in batches of
  ``batch``; offloaded tactics use a device window of ``window_cells`` and ``tile_cells`` tiles
  (``hybrid``: ``cpu_fraction`` of the tiles on the CPU; ``head``: ``resident_heads`` whole KV
  heads on the device), see :func:`tactic_caches`."""

  lengths: tuple = (1024, 2048, 4096, 8192)
  depths: tuple = (0.0, 0.25, 0.5, 0.75, 1.0)
  samples: int = 8
  batch: int = 8
  tactics: tuple = ("resident", "stream")
  window_cells: int = 256
  tile_cells: int = 512
  cpu_fraction: float = 0.5
  resident_heads: int = 1
  chunk: int = 512
  seed: int = 0


def niah(model, task: RecallTask, cfg: NiahConfig = NiahConfig(), *,
         log: Callable[[str], None] = print) -> dict:
  """Scores needle retrieval (greedy exact match of all answer tokens) per tactic over
  ``cfg.lengths`` x ``cfg.depths``; every tactic decodes the same prompts (seeded per cell).

  Returns a JSON-able dict: ``accuracy[tactic][length][depth]``, ``accuracy_by_length``,
  ``identical_to_resident[tactic]`` (every predicted answer token equal to resident's) with the
  count of differing prompts, per-cell seconds, and the config.
  """
  bad = [t for t in cfg.tactics if t not in TACTICS]
  if bad:
    raise ValueError(f"niah: unknown tactics {bad}; known: {TACTICS}")
  tactics = tuple(cfg.tactics)
  if "resident" not in tactics:
    tactics = ("resident",) + tactics  # the yardstick every tactic is compared with
  acc = {t: {} for t in tactics}
  secs = {t: 0.0 for t in tactics}
  differ = {t: 0 for t in tactics}
  total = 0
  for length in cfg.lengths:
    cap = length + task.value_len
    for t in tactics:
      acc[t][str(length)] = {}
    for depth in cfg.depths:
      rng = np.random.default_rng([cfg.seed, length, int(round(depth * 1000))])
      prompts, answers = haystack_batch(rng, cfg.samples, length, depth, task)
      preds = {}
      for t in tactics:
        t0 = time.perf_counter()
        out = []
        for lo in range(0, cfg.samples, cfg.batch):
          p = prompts[lo:lo + cfg.batch]
          caches = tactic_caches(model.config, t, p.shape[0], cap,
                                 window_cells=cfg.window_cells, tile_cells=cfg.tile_cells,
                                 cpu_fraction=cfg.cpu_fraction,
                                 resident_heads=cfg.resident_heads)
          out.append(answer(model, p, task.value_len, caches=caches, chunk=cfg.chunk))
        preds[t] = np.concatenate(out)
        secs[t] += time.perf_counter() - t0
        acc[t][str(length)][str(depth)] = float(np.all(preds[t] == answers, axis=-1).mean())
      for t in tactics:
        differ[t] += int(np.any(preds[t] != preds["resident"], axis=-1).sum())
      total += cfg.samples
      log(f"niah: context {length:6d} depth {depth:4.2f}: " + "  ".join(
          f"{t} {acc[t][str(length)][str(depth)]:.3f}" for t in tactics)
          + ("" if all(np.array_equal(preds[t], preds["resident"]) for t in tactics)
             else "  ANSWERS DIFFER FROM RESIDENT"))
  by_len = {t: {ln: float(np.mean(list(d.values()))) for ln, d in acc[t].items()}
            for t in tactics}
  return dict(config=dataclasses.asdict(cfg), task=task.as_dict(), prompts=total,
              accuracy=acc, accuracy_by_length=by_len,
              identical_to_resident={t: differ[t] == 0 for t in tactics},
              prompts_differing_from_resident=differ, seconds=secs)


def format_table(report: dict) -> str:
  """The accuracy table of a :func:`niah` report: one block per tactic, rows = depth,
  columns = context length, plus the mean per length and the identity check."""
  lines = []
  for t, table in report["accuracy"].items():
    lengths = list(table)
    depths = list(next(iter(table.values()))) if table else []
    lines.append(f"[{t}] identical to resident: {report['identical_to_resident'][t]}")
    lines.append("depth  " + "".join(f"{ln:>8}" for ln in lengths))
    for d in depths:
      lines.append(f"{float(d):5.2f}  " + "".join(f"{table[ln][d]:8.3f}" for ln in lengths))
    lines.append(" mean  " + "".join(f"{report['accuracy_by_length'][t][ln]:8.3f}"
                                     for ln in lengths))
  return "\n".join(lines)
