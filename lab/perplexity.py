"""Perplexity of real text through every tactic, gated against resident.

The text (by default the history section of the running Python's ``LICENSE.txt``, the document
``make demo`` reads) is scored chunk by chunk (:func:`rkv.generate.sequence_logits`, chunks of
16: the decode path, so ``cpu`` / ``hybrid`` attend with the host kernel) through resident caches
and through caches with every layer forced to each offloaded tactic with a small device window
(:func:`lab.niah.tactic_caches`: most of the text's KV in the host tail). Each tactic's logits at
every position must pass :func:`rkv.gates.check_gate` against resident's, and its perplexity then
lies within the bound :func:`rkv.gates.perplexity` states.
"""

from __future__ import annotations

import numpy as np

from rkv import gates
from rkv import generate as gen
from rkv import tactics as tactic_names
from lab.document_demo import read_document
from lab.niah import tactic_caches


def real_text_tokens(tokenizer, n_tokens: int, document: str | None = None) -> np.ndarray:
  """The first ``n_tokens`` tokens of ``document`` (None: Python's license history), ``[1, n]``."""
  text, source = read_document(document)
  ids = tokenizer.encode(text)
  if len(ids) < n_tokens:
    raise ValueError(f"real_text_tokens: {source} has {len(ids)} tokens, fewer than "
                     f"n_tokens={n_tokens}")
  return np.asarray([ids[:n_tokens]], np.int32)


def perplexity_by_tactic(model, tokens, *, tactics=tactic_names.TACTICS, window_cells: int = 64,
                         tile_cells: int = 64, chunk: int = 16, cpu_fraction: float = 0.5,
                         resident_heads: int = 1) -> dict:
  """``{tactic: {"nll", "perplexity", "metrics", "passed", "reasons"}}`` for ``tokens [B,T]``;
  ``metrics`` and the gate compare each tactic's logits with resident's (resident's own entry
  compares it with itself)."""
  tokens = np.asarray(tokens, np.int32)
  b, t = tokens.shape
  cfg = model.config
  order = ("resident",) + tuple(x for x in tactics if x != "resident")
  ref = None
  out = {}
  for tactic in order:
    caches = tactic_caches(cfg, tactic, b, t, window_cells=window_cells, tile_cells=tile_cells,
                           cpu_fraction=cpu_fraction, resident_heads=resident_heads)
    logits = gen.sequence_logits(model, tokens, caches, chunk=chunk)
    ref = logits if ref is None else ref
    nll, ppl = gates.perplexity(logits, tokens)
    metrics = gates.logit_metrics(ref, logits)
    passed, reasons = gates.check_gate(metrics, cfg.dtype)
    out[tactic] = dict(nll=nll, perplexity=ppl, metrics=metrics.as_dict(), passed=passed,
                       reasons=reasons)
  return out
