"""Logit-equivalence gates: do the offloaded paths decode what the resident one does?

:func:`logit_metrics` compares two logit tensors ``[..., V]`` row by row (float64):
KL(ref || test) of their softmaxes, cosine similarity of the raw logits, top-1 agreement and the
largest |delta logit|. :func:`check_gate` applies the named thresholds for the dtype:

- float32: the tactics reorder an exact computation (tiles, LSE merges), so logits agree to
  rounding: ``max |delta| <= F32_MAX_ABS_LOGIT`` and every top-1 token equal.
- bfloat16: the partials are rounded differently, so the bar is distributional:
  ``mean KL <= BF16_MEAN_KL`` and top-1 agreement ``>= BF16_TOP1`` (near-ties may flip).

:func:`run_equivalence` is the gate itself: the same tokens teacher-forced through resident
caches and through the caches of one tail tactic (``stream``, ``cpu``, ``hybrid`` or ``head``;
most cells in the host tail); :func:`equivalence_gate` runs it for several tactics against one
resident run and prints a table of the figures per tactic.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rkv import tactics

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


def perplexity(logits, tokens) -> tuple[float, float]:
  """``(mean negative log-likelihood in nats, perplexity)`` of ``tokens [B,T]`` under ``logits
  [B,T,V]`` (row ``i`` predicting token ``i + 1``, as :func:`rkv.generate.sequence_logits`
  returns them), over the ``B * (T - 1)`` predicted tokens, in float64.

  Two logit tensors within ``d = max |delta logit|`` of each other give log-probabilities within
  ``2 d`` (a log-softmax moves by at most twice its input's largest change), so mean NLLs within
  ``2 d``: the float32 gate's ``F32_MAX_ABS_LOGIT`` bounds the perplexity gap too."""
  lg = np.asarray(logits, np.float64)
  tok = np.asarray(tokens)
  if lg.ndim != 3 or tok.shape != lg.shape[:2] or tok.shape[1] < 2:
    raise ValueError(f"perplexity: logits must be [B,T,V] and tokens [B,T] with T >= 2, got "
                     f"{lg.shape} and {tok.shape}")
  lp = _log_softmax(lg[:, :-1])
  nll = -np.take_along_axis(lp, tok[:, 1:, None].astype(np.int64), axis=-1)[..., 0]
  mean = float(nll.mean())
  return mean, float(np.exp(mean))


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


GATE_TACTICS = tactics.OFFLOADED


@dataclasses.dataclass(frozen=True)
class EquivalenceReport:
  metrics: LogitMetrics
  passed: bool
  reasons: list
  dtype: str
  plan_table: str
  reference_metrics: LogitMetrics | None = None  # resident path vs external (HF) logits
  tactic: str = "stream"

  def as_dict(self) -> dict:
    return {"tactic": self.tactic, "passed": self.passed, "reasons": self.reasons,
            "dtype": self.dtype, "metrics": self.metrics.as_dict(), "plan": self.plan_table,
            "reference_metrics": (None if self.reference_metrics is None
                                  else self.reference_metrics.as_dict())}


@dataclasses.dataclass(frozen=True)
class GateReport:
  """The gate over several tactics: one :class:`EquivalenceReport` each, in the order run."""

  reports: tuple

  @property
  def passed(self) -> bool:
    return all(r.passed for r in self.reports)

  @property
  def reasons(self) -> list:
    return [f"{r.tactic}: {why}" for r in self.reports for why in r.reasons]

  def table(self) -> str:
    cols = ["tactic", "max_abs_logit", "mean_kl", "max_kl", "min_cosine", "top1", "rows", "gate"]
    rows = [[r.tactic, f"{r.metrics.max_abs_logit:.3g}", f"{r.metrics.mean_kl:.3g}",
             f"{r.metrics.max_kl:.3g}", f"{r.metrics.min_cosine:.9f}",
             f"{r.metrics.top1_agreement:.4f}", str(r.metrics.rows),
             "PASSED" if r.passed else "FAILED"] for r in self.reports]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    fmt = lambda row: "  ".join(x.rjust(w) for x, w in zip(row, widths))
    return "\n".join([fmt(cols), *(fmt(row) for row in rows)])

  def as_dict(self) -> dict:
    """``passed`` / ``reasons`` over every tactic, the run-wide ``dtype`` and
    ``reference_metrics``, and each tactic's report under ``results[tactic]``."""
    first = self.reports[0] if self.reports else None
    return {"tactics": [r.tactic for r in self.reports], "passed": self.passed,
            "reasons": self.reasons, "dtype": None if first is None else first.dtype,
            "reference_metrics": (None if first is None or first.reference_metrics is None
                                  else first.reference_metrics.as_dict()),
            "results": {r.tactic: r.as_dict() for r in self.reports}}


def check_tactics(tactics, where: str = "tactics") -> tuple[str, ...]:
  """``tactics`` (a sequence, or a comma-separated string) as a tuple of GATE_TACTICS."""
  if isinstance(tactics, str):
    tactics = [t.strip() for t in tactics.split(",") if t.strip()]
  tactics = tuple(tactics)
  bad = [t for t in tactics if t not in GATE_TACTICS]
  if not tactics or bad or len(set(tactics)) != len(tactics):
    raise ValueError(f"{where}: tactics must be distinct names from {GATE_TACTICS}, got "
                     f"{tactics!r}")
  return tactics


def tactic_plan(config, tactic: str, context_len: int, batch: int, *,
                window_cells: int | None = None, tile_cells: int | None = None, residency=None,
                cpu_fraction: float = 0.5, resident_heads: int | None = None):
  """The plan a gate runs ``tactic`` with: with ``window_cells`` and ``tile_cells`` every global
  layer (every layer of an all-sliding model) is forced to that layout
  (:func:`rkv.generate.force_tactic`, with ``cpu_fraction`` for ``hybrid`` and ``resident_heads``
  for ``head``, default ``K // 2``); else ``rkv.plan`` places the tail itself under ``residency``
  with the tactic's mode (e.g. ``ResidencyConfig(vram_target_mib=<tiny>)``), and must give at
  least one layer that tactic."""
  from rkv import generate as gen
  from rkv.planner import ResidencyConfig, plan as make_plan

  where = "tactic_plan"
  check_tactics([tactic], where)
  if window_cells is not None or tile_cells is not None:
    if window_cells is None or tile_cells is None:
      raise ValueError(f"{where}: pass both window_cells and tile_cells, or neither")
    base = make_plan(config, context_len, batch,
                     residency=ResidencyConfig(mode="stream", vram_target_mib=1 << 20))
    no_global = all(w is not None for w in config.layer_windows)
    r = config.num_kv_heads // 2 if resident_heads is None else resident_heads
    p = gen.force_tactic(base, tactic, window_cells, tile_cells, cpu_fraction=cpu_fraction,
                         resident_heads=r, local=no_global)
  else:
    residency = residency or ResidencyConfig()
    mode = tactic  # the planner mode that forces a tactic is named like it
    p = make_plan(config, context_len, batch,
                  residency=dataclasses.replace(residency, mode=mode))
  if tactic not in p.tactics():
    raise ValueError(f"{where}: the plan gives no layer the {tactic!r} tactic (tactics "
                     f"{p.tactics()}): lower vram_target_mib or force window_cells")
  return p


def run_equivalence(model, tokens, *, prefill_len: int, tactic: str = "stream",
                    window_cells: int | None = None, tile_cells: int | None = None,
                    residency=None, cpu_fraction: float = 0.5, resident_heads: int | None = None,
                    chunk: int = 512, reference_logits=None,
                    resident_logits=None) -> EquivalenceReport:
  """Teacher-forces ``tokens [B,T]`` through resident caches and through the caches of
  ``tactic`` (a plan from :func:`tactic_plan`, see there for ``window_cells``, ``tile_cells``,
  ``residency``, ``cpu_fraction``, ``resident_heads``) and gates the tactic's logits against the
  resident ones. ``reference_logits [B,T,V]`` (e.g. HF's full forward) adds the resident path's
  metrics against them at the decoded positions. ``resident_logits``: the resident run's
  :func:`rkv.generate.decode_logits`, when already computed (gating several tactics).
  """
  from rkv import generate as gen
  from rkv import models

  tokens = np.asarray(tokens, np.int32)
  if tokens.ndim != 2:
    raise ValueError(f"run_equivalence: tokens must be [B,T], got {tokens.shape}")
  b, t = tokens.shape
  cfg = model.config
  test_plan = tactic_plan(cfg, tactic, t, b, window_cells=window_cells, tile_cells=tile_cells,
                          residency=residency, cpu_fraction=cpu_fraction,
                          resident_heads=resident_heads)
  ref = resident_logits
  if ref is None:
    ref = gen.decode_logits(model, tokens, models.init_caches(cfg, b, t),
                            prefill_len=prefill_len, chunk=chunk)
  test = gen.decode_logits(model, tokens, gen.caches_from_plan(cfg, test_plan, b, t),
                           prefill_len=prefill_len, chunk=chunk)
  metrics = logit_metrics(ref, test)
  dtype = np.dtype(cfg.dtype).name
  passed, reasons = check_gate(metrics, dtype)
  ref_metrics = None
  if reference_logits is not None:
    ref_metrics = logit_metrics(np.asarray(reference_logits)[:, prefill_len:], ref)
  return EquivalenceReport(metrics=metrics, passed=passed, reasons=reasons, dtype=dtype,
                           plan_table=test_plan.table(), reference_metrics=ref_metrics,
                           tactic=tactic)


def equivalence_gate(*, checkpoint: str | None = None, preset: str | None = None,
                     dtype: str = "float32", seq_len: int = 32, prefill_len: int = 18,
                     batch: int = 2, window_cells: int | None = 5, tile_cells: int | None = 4,
                     vram_target_mib: float = 0.0, tactics=GATE_TACTICS,
                     cpu_fraction: float = 0.5, resident_heads: int | None = None,
                     seed: int = 0, impl: str = "xla", out: str | None = None) -> GateReport:
  """What ``experiments/equiv_gate.py`` runs: loads ``checkpoint`` (an HF folder; its
  ``reference.npz`` tokens and logits are used when present) or a random-weight ``preset``, gates
  each of ``tactics`` against one resident run (:func:`run_equivalence`), prints each tactic's
  plan and metrics, a table of the figures per tactic and the verdict, and writes the report as
  JSON to ``out`` (:meth:`GateReport.as_dict` plus the run's inputs).

  The layout: ``window_cells``/``tile_cells`` force W and the tile (``cpu_fraction`` and
  ``resident_heads`` the hybrid split and the head split); with both None the planner places the
  tail under ``ResidencyConfig(mode=<the tactic's>, vram_target_mib=...)``.
  """
  import json
  import os

  from flax import nnx

  from rkv import atomic_io
  from rkv import generate as gen
  from rkv import models
  from rkv.planner import ResidencyConfig

  if (checkpoint is None) == (preset is None):
    raise ValueError("equivalence_gate: pass exactly one of checkpoint and preset")
  tactics = check_tactics(tactics, "equivalence_gate")
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
  tokens = np.asarray(tokens, np.int32)
  residency = None
  if window_cells is None and tile_cells is None:
    residency = ResidencyConfig(vram_target_mib=vram_target_mib)
  b, t = tokens.shape
  resident = gen.decode_logits(model, tokens, models.init_caches(model.config, b, t),
                               prefill_len=prefill_len)
  reports = []
  for tactic in tactics:
    report = run_equivalence(model, tokens, prefill_len=prefill_len, tactic=tactic,
                             window_cells=window_cells, tile_cells=tile_cells,
                             residency=residency, cpu_fraction=cpu_fraction,
                             resident_heads=resident_heads, reference_logits=reference,
                             resident_logits=resident)
    reports.append(report)
    print(f"== {tactic} ==")
    print(report.plan_table)
    print(f"\n{tactic} vs resident ({report.dtype}, {report.metrics.rows} decode rows):")
    print(report.metrics.table() + "\n")
  gate = GateReport(tuple(reports))
  if reports and reports[0].reference_metrics is not None:
    rm = reports[0].reference_metrics
    print(f"resident vs checkpoint reference logits: max |delta| {rm.max_abs_logit:.3g}, top-1 "
          f"{rm.top1_agreement:.4f}\n")
  print(gate.table())
  print("\nGATE " + ("PASSED" if gate.passed else "FAILED: " + "; ".join(gate.reasons)))
  if out:
    with atomic_io.write_file_atomically(out) as f:
      json.dump({"checkpoint": checkpoint, "preset": preset, "prefill_len": prefill_len,
                 "tokens_shape": list(np.shape(tokens)), **gate.as_dict()}, f, indent=2)
  return gate


def jnp_dtype(name: str):
  import jax.numpy as jnp
  if name not in ("float32", "bfloat16"):
    raise ValueError(f"dtype must be float32 or bfloat16, got {name!r}")
  return getattr(jnp, name)
