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
from rkv.recall import RecallTask, haystack_batch


@dataclasses.dataclass(frozen=True)
class SparseQualityConfig:
  """The grid: ``lengths`` x ``depths`` needles, ``samples`` each; ``selectors`` compared with
  dense; the block cache of each sparse layer (``block_cells``, ``select_blocks`` incl.
  ``window_blocks`` and ``sink_blocks``; ``device_slots`` 0: enough for the whole selection of
  the batch). ``logit_steps``: the tokens at the end of each prompt + answer decoded one at a
  time through the sparse layers (they include the query and the answer)."""

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


def decode_run(model, tokens: np.ndarray, decode_steps: int, caches) -> np.ndarray:
  """Logits of the last ``decode_steps`` tokens of ``tokens`` fed one at a time (teacher-forced
  decode after a prefill of the rest): ``[B, decode_steps, V]``."""
  from rkv import generate as gen
  return gen.decode_logits(model, tokens, caches, prefill_len=tokens.shape[1] - decode_steps)


def logit_quality(model, tokens: np.ndarray, prefill_len: int, block_config) -> dict:
  """Teacher-forced decode logits of ``tokens[:, prefill_len:]``, sparse vs dense:
  :class:`rkv.gates.LogitMetrics` as a dict."""
  b, t = tokens.shape
  steps = t - prefill_len
  ref = decode_run(model, tokens, steps, dense_caches(model.config, b, t))
  got = decode_run(model, tokens, steps, sparse_caches(model.config, b, t, block_config))
  return gates.logit_metrics(ref, got).as_dict()


def quality(model, task: RecallTask, cfg: SparseQualityConfig = SparseQualityConfig(), *,
            log: Callable[[str], None] = print) -> dict:
  """Needles and logits, sparse vs dense, from one teacher-forced decode per prompt batch: the
  prompt and its answer, of which the last ``logit_steps`` tokens (the end of the haystack, the
  query ``? KEY`` and the answer) are decoded one at a time, so the retrieval itself runs
  through the sparse layers (prefill chunks are dense). A needle is found when every answer token
  is the argmax at its step (teacher forcing then equals greedy decoding); KL / top-1 over all
  decoded steps (:func:`rkv.gates.logit_metrics`)."""
  v = task.value_len
  if cfg.logit_steps < v + 2:
    raise ValueError(f"quality: logit_steps must be >= value_len + 2 = {v + 2} (the query and the "
                     f"answer decoded), got {cfg.logit_steps}")
  kh = model.config.num_kv_heads
  acc = {s: {} for s in ("dense",) + tuple(cfg.selectors)}
  same = {s: 0 for s in cfg.selectors}
  logits = {s: {} for s in cfg.selectors}
  total = 0
  t0 = time.perf_counter()
  for length in cfg.lengths:
    for s in acc:
      acc[s][str(length)] = {}
    for s in cfg.selectors:
      logits[s][str(length)] = {}
    for depth in cfg.depths:
      rng = np.random.default_rng([cfg.seed, length, int(round(depth * 1000))])
      prompts, answers = haystack_batch(rng, cfg.samples, length, depth, task)
      full = np.concatenate([prompts, answers], axis=1)
      cap = full.shape[1]
      out = {s: [] for s in acc}
      for lo in range(0, cfg.samples, cfg.batch):
        x = full[lo:lo + cfg.batch]
        for s in acc:
          caches = (dense_caches(model.config, x.shape[0], cap) if s == "dense" else
                    sparse_caches(model.config, x.shape[0], cap,
                                  cfg.block_config(s, x.shape[0], kh)))
          out[s].append(decode_run(model, x, cfg.logit_steps, caches))
      out = {s: np.concatenate(o) for s, o in out.items()}
      # Step j predicts token (cap - logit_steps + j + 1); the answer is the last v tokens.
      preds = {s: o[:, -v - 1:-1].argmax(-1) for s, o in out.items()}
      for s in acc:
        acc[s][str(length)][str(depth)] = float(np.all(preds[s] == answers, axis=-1).mean())
      for s in cfg.selectors:
        same[s] += int(np.all(preds[s] == preds["dense"], axis=-1).sum())
        logits[s][str(length)][str(depth)] = gates.logit_metrics(out["dense"], out[s]).as_dict()
      total += cfg.samples
      log(f"sparse quality: context {length:6d} depth {depth:4.2f}: " + "  ".join(
          f"{s} {acc[s][str(length)][str(depth)]:.3f}" for s in acc) + "  " + "  ".join(
          f"{s} KL {logits[s][str(length)][str(depth)]['mean_kl']:.3g} top1 "
          f"{logits[s][str(length)][str(depth)]['top1_agreement']:.3f}" for s in cfg.selectors))
  return dict(config=dataclasses.asdict(cfg), task=task.as_dict(), prompts=total, accuracy=acc,
              answers_equal_to_dense={s: same[s] / max(total, 1) for s in cfg.selectors},
              logits_vs_dense=logits, seconds=time.perf_counter() - t0,
              note="approximate: the recall model was not trained for block-sparse attention")
