"""Logit-equivalence gates: do the offloaded paths decode what the resident one does?

:func:`logit_metrics` compares two logit tensors ``[..., V]`` row by row (float64):
KL(ref || test) of their softmaxes, cosine similarity of the raw logits, top-1 agreement and the
largest |delta logit|. :func:`check_gate` applies the named thresholds for the dtype:

- float32: the tactics reorder an exact computation (tiles, LSE merges), so logits agree to
  rounding: ``max |delta| <= F32_MAX_ABS_LOGIT`` and every top-1 token equal.
- bfloat16: the partials are rounded differently, so the bar is distributional:
  ``mean KL <= BF16_MEAN_KL`` and top-1 agreement ``>= BF16_TOP1`` (near-ties may flip).

:func:`run_equivalence` is the gate itself: the same tokens teacher-forced through resident
caches and through ``stream`` caches (RollingKV, most cells in the host tail).
"""

from __future__ import annotations

import dataclasses

import numpy as np

F32_MAX_ABS_LOGIT = 1e-4
F32_TOP1 = 1.0
BF16_MEAN_KL = 1e-3
BF16_TOP1 = 0.995


@dataclasses.dataclass(frozen=True)
class LogitMetrics:
  """Per-row statistics over ``rows`` logit vectors of ``vocab`` entries."""

  mean_kl: float
  max_kl: float
  mean_cosine: float
  min_cosine: float
  top1_agreement: float
  top1_disagreements: int
  max_abs_logit: float
  rows: int
  vocab: int

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)

  def table(self) -> str:
    return "\n".join(f"{k:>20}  {v:.6g}" if isinstance(v, float) else f"{k:>20}  {v}"
                     for k, v in self.as_dict().items())


def _log_softmax(x):
  x = x - x.max(axis=-1, keepdims=True)
  return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def logit_metrics(ref_logits, test_logits) -> LogitMetrics:
  """Compares ``test_logits`` with ``ref_logits`` (same shape ``[..., V]``), in float64."""
  ref = np.asarray(ref_logits, np.float64)
  test = np.asarray(test_logits, np.float64)
  if ref.shape != test.shape or ref.ndim < 1 or ref.shape[-1] < 1 or ref.size == 0:
    raise ValueError(f"logit_metrics: ref_logits and test_logits must have the same non-empty "
                     f"shape [..., V], got {ref.shape} and {test.shape}")
  for name, x in (("ref_logits", ref), ("test_logits", test)):
    if not np.all(np.isfinite(x)):
      raise ValueError(f"logit_metrics: {name} holds non-finite values")
  v = ref.shape[-1]
  ref, test = ref.reshape(-1, v), test.reshape(-1, v)
  lp, lq = _log_softmax(ref), _log_softmax(test)
  kl = np.maximum((np.exp(lp) * (lp - lq)).sum(-1), 0.0)  # clamp -1e-17 rounding
  norms = np.linalg.norm(ref, axis=-1) * np.linalg.norm(test, axis=-1)
  cos = np.where(norms > 0, (ref * test).sum(-1) / np.where(norms > 0, norms, 1.0),
                 np.where(np.all(ref == test, axis=-1), 1.0, 0.0))
  agree = ref.argmax(-1) == test.argmax(-1)
  return LogitMetrics(mean_kl=float(kl.mean()), max_kl=float(kl.max()),
                      mean_cosine=float(cos.mean()), min_cosine=float(cos.min()),
                      top1_agreement=float(agree.mean()),
                      top1_disagreements=int((~agree).sum()),
                      max_abs_logit=float(np.abs(ref - test).max()), rows=ref.shape[0], vocab=v)


def check_gate(metrics: LogitMetrics, dtype) -> tuple[bool, list[str]]:
  """``(passed, reasons)`` for ``dtype`` (float32 or bfloat16); ``reasons`` lists each failed
  threshold with the measured value."""
  name = np.dtype(dtype).name
  reasons = []
  if name == "float32":
    if not metrics.max_abs_logit <= F32_MAX_ABS_LOGIT:
      reasons.append(f"max |delta logit| {metrics.max_abs_logit:.3g} > F32_MAX_ABS_LOGIT="
                     f"{F32_MAX_ABS_LOGIT:g}")
    if not metrics.top1_agreement >= F32_TOP1:
      reasons.append(f"top-1 agreement {metrics.top1_agreement:.4f} < F32_TOP1={F32_TOP1:g} "
                     f"({metrics.top1_disagreements} rows differ)")
  elif name == "bfloat16":
    if not metrics.mean_kl <= BF16_MEAN_KL:
      reasons.append(f"mean KL {metrics.mean_kl:.3g} > BF16_MEAN_KL={BF16_MEAN_KL:g}")
    if not metrics.top1_agreement >= BF16_TOP1:
      reasons.append(f"top-1 agreement {metrics.top1_agreement:.4f} < BF16_TOP1={BF16_TOP1:g} "
                     f"({metrics.top1_disagreements} rows differ)")
  else:
    raise ValueError(f"check_gate: dtype must be float32 or bfloat16, got {name}")
  return not reasons, reasons


def greedy_match(tokens_a, tokens_b) -> dict:
  """Compares two generated token arrays ``[B,N]``: ``{"equal", "agreement", "first_divergence"}``
  (``first_divergence``: per row, the first index where they differ, or None)."""
  a, b = np.asarray(tokens_a), np.asarray(tokens_b)
  if a.shape != b.shape:
    raise ValueError(f"greedy_match: tokens_a and tokens_b must have the same shape, got "
                     f"{a.shape} and {b.shape}")
  a2, b2 = a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1), \
      b.reshape(-1, b.shape[-1]) if b.ndim else b.reshape(1, 1)
  same = a2 == b2
  first = [None if row.all() else int(np.argmin(row)) for row in same]
  return {"equal": bool(same.all()), "agreement": float(same.mean()) if same.size else 1.0,
          "first_divergence": first}


@dataclasses.dataclass(frozen=True)
class EquivalenceReport:
  metrics: LogitMetrics
  passed: bool
  reasons: list
  dtype: str
  plan_table: str
  reference_metrics: LogitMetrics | None = None  # resident path vs external (HF) logits

  def as_dict(self) -> dict:
    return {"passed": self.passed, "reasons": self.reasons, "dtype": self.dtype,
            "metrics": self.metrics.as_dict(), "plan": self.plan_table,
            "reference_metrics": (None if self.reference_metrics is None
                                  else self.reference_metrics.as_dict())}


def run_equivalence(model, tokens, *, prefill_len: int, window_cells: int | None = None,
                    tile_cells: int | None = None, residency=None, chunk: int = 512,
                    reference_logits=None) -> EquivalenceReport:
  """Teacher-forces ``tokens [B,T]`` through resident caches and through ``stream`` caches and
  gates the stream logits against the resident ones.

  The stream layout: with ``window_cells`` and ``tile_cells``, every global layer (every layer of
  an all-sliding model) is forced to a RollingKV of that W and tile (:func:`rkv.generate.
  force_stream`); else ``rkv.plan(..., residency=residency)`` must place a tail itself (e.g.
  ``ResidencyConfig(mode="window", vram_target_mib=<tiny>)``). ``reference_logits [B,T,V]``
  (e.g. HF's full forward) adds the resident path's metrics against them at the decoded
  positions.
  """
  from rkv import generate as gen
  from rkv import models
  from rkv.residency import ResidencyConfig, plan as make_plan

  tokens = np.asarray(tokens, np.int32)
  if tokens.ndim != 2:
    raise ValueError(f"run_equivalence: tokens must be [B,T], got {tokens.shape}")
  b, t = tokens.shape
  cfg = model.config
  if window_cells is not None or tile_cells is not None:
    if window_cells is None or tile_cells is None:
      raise ValueError("run_equivalence: pass both window_cells and tile_cells, or neither")
    base = make_plan(cfg, t, b, residency=ResidencyConfig(mode="window",
                                                          vram_target_mib=1 << 20))
    no_global = all(w is not None for w in cfg.layer_windows)
    stream_plan = gen.force_stream(base, window_cells, tile_cells, local=no_global)
  else:
    stream_plan = make_plan(cfg, t, b, residency=residency or ResidencyConfig(mode="window"))
  if "stream" not in stream_plan.tactics():
    raise ValueError(f"run_equivalence: the plan streams no layer (tactics "
                     f"{stream_plan.tactics()}): lower vram_target_mib or force window_cells")
  ref = gen.decode_logits(model, tokens, models.init_caches(cfg, b, t), prefill_len=prefill_len,
                          chunk=chunk)
  test = gen.decode_logits(model, tokens, gen.caches_from_plan(cfg, stream_plan, b, t),
                           prefill_len=prefill_len, chunk=chunk)
  metrics = logit_metrics(ref, test)
  dtype = np.dtype(cfg.dtype).name
  passed, reasons = check_gate(metrics, dtype)
  ref_metrics = None
  if reference_logits is not None:
    ref_metrics = logit_metrics(np.asarray(reference_logits)[:, prefill_len:], ref)
  return EquivalenceReport(metrics=metrics, passed=passed, reasons=reasons, dtype=dtype,
                           plan_table=stream_plan.table(), reference_metrics=ref_metrics)


def equivalence_gate(*, checkpoint: str | None = None, preset: str | None = None,
                     dtype: str = "float32", seq_len: int = 32, prefill_len: int = 18,
                     batch: int = 2, window_cells: int | None = 5, tile_cells: int | None = 4,
                     vram_target_mib: float = 0.0, seed: int = 0, impl: str = "xla",
                     out: str | None = None) -> EquivalenceReport:
  """What ``experiments/equiv_gate.py`` runs: loads ``checkpoint`` (an HF folder; its
  ``reference.npz`` tokens and logits are used when present) or a random-weight ``preset``, gates
  the stream tactic against the resident path (:func:`run_equivalence`), prints the plan, the
  metrics and the verdict, and writes the report as JSON to ``out``.

  The stream layout: ``window_cells``/``tile_cells`` force W and the tile; with both None the
  planner places the tail under ``ResidencyConfig(mode="window", vram_target_mib=...)``.
  """
  import json
  import os

  from flax import nnx

  from rkv import models
  from rkv.residency import ResidencyConfig

  if (checkpoint is None) == (preset is None):
    raise ValueError("equivalence_gate: pass exactly one of checkpoint and preset")
  dt = jnp_dtype(dtype)
  reference = None
  if checkpoint is not None:
    model = models.load_hf(checkpoint, dt, impl=impl)
    ref_path = os.path.join(checkpoint, "reference.npz")
    if os.path.isfile(ref_path):
      ref = np.load(ref_path)
      tokens, reference = ref["tokens"], ref["logits"]
  else:
    cfg = models.ModelConfig.preset(preset, dtype=dtype)
    model = models.Transformer(cfg, rngs=nnx.Rngs(seed), impl=impl)
  if reference is None:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, model.config.vocab_size, size=(batch, seq_len), dtype=np.int32)
  residency = None
  if window_cells is None and tile_cells is None:
    residency = ResidencyConfig(mode="window", vram_target_mib=vram_target_mib)
  report = run_equivalence(model, tokens, prefill_len=prefill_len, window_cells=window_cells,
                           tile_cells=tile_cells, residency=residency,
                           reference_logits=reference)
  print(report.plan_table)
  print(f"\nstream vs resident ({report.dtype}, {report.metrics.rows} decode rows):")
  print(report.metrics.table())
  if report.reference_metrics is not None:
    print(f"\nresident vs checkpoint reference logits: max |delta| "
          f"{report.reference_metrics.max_abs_logit:.3g}, top-1 "
          f"{report.reference_metrics.top1_agreement:.4f}")
  print("\nGATE " + ("PASSED" if report.passed else "FAILED: " + "; ".join(report.reasons)))
  if out:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
      json.dump({"checkpoint": checkpoint, "preset": preset, "prefill_len": prefill_len,
                 "tokens_shape": list(np.shape(tokens)), **report.as_dict()}, f, indent=2)
  return report


def jnp_dtype(name: str):
  import jax.numpy as jnp
  if name not in ("float32", "bfloat16"):
    raise ValueError(f"dtype must be float32 or bfloat16, got {name!r}")
  return getattr(jnp, name)
