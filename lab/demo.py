"""The recall needle job (`make demo-recall`): a needle query at a long context with most of the KV
in the host tail (`make demo` is :mod:`lab.document_demo`, SmolLM2 on a real document).

:func:`run` loads the shipped recall model (:mod:`rkv.recall`), builds a haystack with one
needle, plans the KV cache with a forced small device budget (``device_share`` of the KV bytes;
the rest is planned off the device: the tail tactics of docs/DESIGN.md §4), prints the plan table,
answers the query through the planned caches, then answers it again through fully resident caches
and compares the two: the answers, and the teacher-forced logits of the last ``check_tokens``
prompt tokens plus the answer (:func:`rkv.generate.decode_logits`, gated by :mod:`rkv.gates`).

Runs anywhere: on a CPU-only machine the "device" is the host (memory kinds exist there too) and
the cpu/hybrid tactics run the same C kernel they run beside a GPU. ``experiments/demo.py`` is
the absl front end.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import numpy as np

from lab import niah
from rkv import gates
from rkv import generate as gen
from rkv import recall
from rkv.planner import MIB, ResidencyConfig, WINDOW_ALIGN, plan as make_plan


@dataclasses.dataclass(frozen=True)
class DemoConfig:
  """``context``: prompt tokens; ``depth``: where the needle sits (0 start .. 1 end);
  ``device_share``: the share of the KV bytes the plan may keep on the device; ``mode``: the
  planner's mode (``auto``: the selector picks each layer's tactic from the profile);
  ``tile_cells`` / ``min_tile_cells``: host-tail tiles (small: the recall model's cells are
  small); ``check_tokens``: prompt tokens decoded one by one for the logit gate;
  ``decode_tokens``: tokens decoded past the answer to time the steady decode rate."""

  context: int = 8192
  depth: float = 0.5
  device_share: float = 0.2
  mode: str = "auto"
  profile_path: str | None = None
  tile_cells: int = 1024
  min_tile_cells: int = 256
  check_tokens: int = 32
  decode_tokens: int = 32
  chunk: int = 512
  seed: int = 0
  model_path: str | None = None

  def __post_init__(self):
    where = "DemoConfig"
    if not isinstance(self.context, int) or self.context < 64:
      raise ValueError(f"{where}: context must be an int >= 64, got {self.context!r}")
    if not 0.0 <= self.depth <= 1.0:
      raise ValueError(f"{where}: depth must be in [0, 1], got {self.depth!r}")
    if not 0.0 < self.device_share < 1.0:
      raise ValueError(f"{where}: device_share must be in (0, 1), got {self.device_share!r}")
    if not isinstance(self.check_tokens, int) or not 1 <= self.check_tokens < self.context:
      raise ValueError(f"{where}: check_tokens must be an int in [1, context), got "
                       f"{self.check_tokens!r}")


def demo_plan(config, capacity: int, cfg: DemoConfig):
  """The plan with the forced budget: ``device_share`` of the KV bytes, but at least the
  smallest layout the planner accepts (an aligned window and one staging tile per layer, plus
  their int32 positions)."""
  floor_cells = WINDOW_ALIGN + cfg.min_tile_cells
  floor = (config.kv_bytes_per_token() + 4 * config.num_layers) * floor_cells
  budget = max(cfg.device_share * config.kv_bytes_per_token() * capacity, floor) / MIB
  res = ResidencyConfig(mode=cfg.mode, vram_target_mib=budget, tile_cells=cfg.tile_cells,
                        min_tile_cells=cfg.min_tile_cells, profile_path=cfg.profile_path)
  return make_plan(config, capacity, 1, residency=res)


def _text(tokenizer, ids) -> str:
  ids = [int(i) for i in np.ravel(ids)]
  if tokenizer is None:
    return " ".join(map(str, ids))
  return tokenizer.decode(ids, skip_special_tokens=False)


def run(cfg: DemoConfig = DemoConfig(), log: Callable[[str], None] = print) -> dict[str, Any]:
  """Runs the demo (see the module docstring); returns its figures as a JSON-able dict."""
  t_start = time.perf_counter()
  rm = recall.load_recall_model(cfg.model_path)
  model, tok, task = rm
  mc = model.config
  log(f"rkv demo on {jax.default_backend()} ({jax.devices()[0].device_kind}), jax "
      f"{jax.__version__}")
  log(f"model: the shipped recall model ({mc.num_layers} layers, {mc.num_heads} query / "
      f"{mc.num_kv_heads} KV heads, head_dim {mc.head_dim}, {mc.dtype}), "
      f"{mc.kv_bytes_per_token()} KV bytes per token")

  rng = np.random.default_rng(cfg.seed)
  hs = recall.haystack(rng, cfg.context, cfg.depth, task)
  prompt = hs.tokens[None]
  needle = hs.tokens[hs.needle_start:hs.needle_start + task.pair_len]
  log(f"prompt: {cfg.context} tokens; the needle at depth {cfg.depth:.2f} (token "
      f"{hs.needle_start}): '{_text(tok, needle)}'; {task.num_distractors} other pairs; "
      f"the query: '{_text(tok, hs.tokens[-2:])}'")

  n_new = task.value_len + cfg.decode_tokens
  capacity = cfg.context + n_new
  plan = demo_plan(mc, capacity, cfg)
  log(plan.table())
  log(f"plan: {plan.device_bytes / MIB:.2f} MiB of KV on the device, "
      f"{plan.host_bytes / MIB:.2f} MiB in the host tail "
      f"({plan.host_bytes / max(plan.device_bytes + plan.host_bytes, 1):.0%})")

  caches = gen.caches_from_plan(mc, plan, 1, capacity)
  out = gen.generate(model, prompt, max_new_tokens=n_new, caches=caches, chunk=cfg.chunk,
                     progress=True)
  answer = out.tokens[0, :task.value_len]
  correct = bool(np.array_equal(answer, hs.answer))
  log(f"answer (offloaded plan): '{_text(tok, answer)}' — expected '{_text(tok, hs.answer)}': "
      f"{'CORRECT' if correct else 'WRONG'}")
  log(f"speed (offloaded plan): prefill {out.prefill_tokens_per_s:,.0f} tokens/s (compiles "
      f"included), decode {out.warm_decode_tokens_per_s:,.1f} tokens/s (median of "
      f"{len(out.step_s) - 1} warm steps: {1e3 * float(np.median(out.step_s[1:])):.1f} ms)")

  resident = gen.generate(model, prompt, max_new_tokens=n_new,
                          caches=niah.tactic_caches(mc, "resident", 1, capacity,
                                                      window_cells=0, tile_cells=1),
                          chunk=cfg.chunk, progress=False)
  same_answer = bool(np.array_equal(resident.tokens, out.tokens))  # the answer and beyond
  log(f"answer (resident):      '{_text(tok, resident.tokens[0, :task.value_len])}'; all "
      f"{n_new} generated tokens identical to the offloaded run: {same_answer}")
  log(f"speed (resident):       prefill {resident.prefill_tokens_per_s:,.0f} tokens/s (compiles "
      f"included), decode {resident.warm_decode_tokens_per_s:,.1f} tokens/s")

  # The logit gate: the prompt's last check_tokens tokens and the answer, one at a time, through
  # fresh caches of each kind (teacher forced on the expected answer).
  seq = np.concatenate([hs.tokens, hs.answer])[None]
  prefill_len = cfg.context - cfg.check_tokens
  planned = gen.decode_logits(model, seq, gen.caches_from_plan(mc, plan, 1, capacity),
                              prefill_len=prefill_len, chunk=cfg.chunk)
  ref = gen.decode_logits(model, seq, niah.tactic_caches(mc, "resident", 1, capacity,
                                                           window_cells=0, tile_cells=1),
                          prefill_len=prefill_len, chunk=cfg.chunk)
  metrics = gates.logit_metrics(ref, planned)
  passed, reasons = gates.check_gate(metrics, mc.dtype)
  log(f"equivalence vs resident over {seq.shape[1] - prefill_len} decode steps: max |dlogit| "
      f"{metrics.max_abs_logit:.2e} (limit {gates.F32_MAX_ABS_LOGIT:g}), mean KL "
      f"{metrics.mean_kl:.2e}, top-1 agreement {metrics.top1_agreement:.1%}, cosine "
      f"{metrics.min_cosine:.6f}: {'PASSED' if passed else 'FAILED ' + '; '.join(reasons)}")
  wall = time.perf_counter() - t_start
  log(f"done in {wall:.1f} s")
  return dict(context=cfg.context, depth=cfg.depth, needle_start=hs.needle_start,
              answer=answer.tolist(), expected=hs.answer.tolist(), correct=correct,
              identical_to_resident=same_answer, tactics=sorted({lp.tactic for lp in plan.layers}),
              device_bytes=plan.device_bytes, host_bytes=plan.host_bytes,
              prefill_tokens_per_s=out.prefill_tokens_per_s,
              decode_tokens_per_s=out.warm_decode_tokens_per_s,
              resident_prefill_tokens_per_s=resident.prefill_tokens_per_s,
              resident_decode_tokens_per_s=resident.warm_decode_tokens_per_s,
              metrics=dataclasses.asdict(metrics), gate_passed=passed, wall_s=wall)
