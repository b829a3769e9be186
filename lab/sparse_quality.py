"""What the sparse tactic costs in quality (issue 15): logits against dense through the gates'
measures (:func:`rkv.gates.logit_metrics`: KL, top-1) and needle retrieval of the shipped recall
model against dense, per selector. ``experiments/sparse_quality.py`` is the front end.

The sparse layers read ``select_blocks`` blocks of ``block_cells`` cells per KV head at each decode
step (the recent window and the sinks included); prefill chunks are dense (rkv.sparse.BlockCache).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Callable

import numpy as np

from rkv import gates
from rkv.recall import RecallTask, answer, haystack_batch


@dataclasses.dataclass(frozen=True)
class SparseQualityConfig:
  """The grid: ``lengths`` x ``depths`` needles, ``samples`` each; ``selectors`` compared with
  dense; the block cache of each sparse layer (``block_cells``, ``select_blocks`` incl.
  ``window_blocks`` and ``sink_blocks``; ``device_slots`` 0: enough for the whole selection of
  the batch). ``logit_steps``: teacher-forced decode steps at the end of each prompt for KL/top-1."""

  lengths: tuple = (1024, 2048)
  depths: tuple = (0.25, 0.75)
  samples: int = 4
  batch: int = 4
  selectors: tuple = ("oracle", "quest")
  block_cells: int = 16
  select_blocks: int = 8
  window_blocks: int = 2
  sink_blocks: int = 1
  device_slots: int = 0
  logit_steps: int = 16
  chunk: int = 512
  seed: int = 0

  def block_config(self, selector: str, batch: int, kv_heads: int):
    from rkv import sparse
    slots = self.device_slots or batch * kv_heads * self.select_blocks
    return sparse.BlockCacheConfig(block_cells=self.block_cells, device_slots=slots,
                                   select_blocks=self.select_blocks,
                                   window_blocks=self.window_blocks, sink_blocks=self.sink_blocks,
                                   selector=selector)


def sparse_caches(config, batch: int, capacity: int, block_config, layers=None) -> tuple:
  """Empty caches: every global layer (or ``layers``) sparse through ``block_config``, the others
  resident (the approximation warning is recorded by the caller's report, not printed)."""
  from rkv import generate as gen
  from rkv import sparse
  from rkv.planner import ResidencyConfig, plan as make_plan

  base = make_plan(config, capacity, batch,
                   residency=ResidencyConfig(mode="resident", vram_target_mib=1 << 20))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", sparse.ApproximateAttentionWarning)
    p = sparse.sparse_plan(base, layers, block_config)
  return gen.caches_from_plan(config, p, batch, capacity)


def dense_caches(config, batch: int, capacity: int) -> tuple:
  from rkv import models
  return models.init_caches(config, batch, capacity)


def logit_quality(model, tokens: np.ndarray, prefill_len: int, block_config) -> dict:
  """Teacher-forced decode logits of ``tokens[:, prefill_len:]``, sparse vs dense:
  :class:`rkv.gates.LogitMetrics` as a dict, plus the block cache's counters of the last layer."""
  from rkv import generate as gen
  b, t = tokens.shape
  ref = gen.decode_logits(model, tokens, dense_caches(model.config, b, t), prefill_len=prefill_len)
  caches = sparse_caches(model.config, b, t, block_config)
  got = gen.decode_logits(model, tokens, caches, prefill_len=prefill_len)
  return gates.logit_metrics(ref, got).as_dict()


def quality(model, task: RecallTask, cfg: SparseQualityConfig = SparseQualityConfig(), *,
            log: Callable[[str], None] = print) -> dict:
  """Needle accuracy (greedy exact match of the answer) dense vs each selector, the share of
  prompts answered as dense answers them, and KL / top-1 of teacher-forced decode logits at the
  end of each prompt (its last ``logit_steps`` tokens decoded one at a time)."""
  kh = model.config.num_kv_heads
  acc = {s: {} for s in ("dense",) + tuple(cfg.selectors)}
  same = {s: 0 for s in cfg.selectors}
  logits = {s: {} for s in cfg.selectors}
  total = 0
  t0 = time.perf_counter()
  for length in cfg.lengths:
    cap = length + task.value_len
    for s in acc:
      acc[s][str(length)] = {}
    for s in cfg.selectors:
      logits[s][str(length)] = {}
    for depth in cfg.depths:
      rng = np.random.default_rng([cfg.seed, length, int(round(depth * 1000))])
      prompts, answers = haystack_batch(rng, cfg.samples, length, depth, task)
      preds = {}
      for s in acc:
        out = []
        for lo in range(0, cfg.samples, cfg.batch):
          p = prompts[lo:lo + cfg.batch]
          caches = (dense_caches(model.config, p.shape[0], cap) if s == "dense" else
                    sparse_caches(model.config, p.shape[0], cap,
                                  cfg.block_config(s, p.shape[0], kh)))
          out.append(answer(model, p, task.value_len, caches=caches, chunk=cfg.chunk))
        preds[s] = np.concatenate(out)
        acc[s][str(length)][str(depth)] = float(np.all(preds[s] == answers, axis=-1).mean())
      for s in cfg.selectors:
        same[s] += int(np.all(preds[s] == preds["dense"], axis=-1).sum())
        full = np.concatenate([prompts, answers], axis=1)[:cfg.batch]
        logits[s][str(length)][str(depth)] = logit_quality(
            model, full, full.shape[1] - cfg.logit_steps,
            cfg.block_config(s, full.shape[0], kh))
      total += cfg.samples
      log(f"sparse quality: context {length:6d} depth {depth:4.2f}: " + "  ".join(
          f"{s} {acc[s][str(length)][str(depth)]:.3f}" for s in acc) + "  " + "  ".join(
          f"{s} KL {logits[s][str(length)][str(depth)]['mean_kl']:.3g} top1 "
          f"{logits[s][str(length)][str(depth)]['top1_agreement']:.3f}" for s in cfg.selectors))
  return dict(config=dataclasses.asdict(cfg), task=task.as_dict(), prompts=total, accuracy=acc,
              answers_equal_to_dense={s: same[s] / max(total, 1) for s in cfg.selectors},
              logits_vs_dense=logits, seconds=time.perf_counter() - t0,
              note="approximate: the recall model was not trained for block-sparse attention")
