"""``make demo``: a real model answers a question about a real document with most of its KV cache
in host memory, and answers exactly as with the whole cache on the device.

:func:`run` loads SmolLM2-135M-Instruct (the packaged GGUF, :func:`rkv.models.load_gguf`), reads
a document — by default the history section of the running Python's own ``LICENSE.txt`` (the
PSF's text, shipped with every CPython, so present wherever rkv runs) — and asks a question whose
answer is in it. The KV cache is planned with ``device_share`` of its bytes on the device (at
least the planner's smallest layout; :func:`lab.demo.demo_plan`, as the recall demo plans), the
rest in the host tail. It generates the reply through the planned caches, again through resident
caches, and compares them: the replies token by token, and the teacher-forced logits of the
prompt's last ``check_tokens`` tokens plus the reply (:func:`rkv.generate.decode_logits`, gated
by :mod:`rkv.gates`). The recall model's demo (:mod:`lab.demo`) stays for needles beyond
SmolLM2's 8K context.
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
import time
from typing import Any, Callable

import jax
import numpy as np

from rkv import gates
from rkv import generate as gen
from rkv import models
from lab.demo import demo_plan
from rkv.planner import MIB
from rkv.text import generate_text, prompt_ids

_HISTORY_END = "B. TERMS AND CONDITIONS"


@dataclasses.dataclass(frozen=True)
class DocumentDemoConfig:
  """``document``: a text file (None: Python's LICENSE.txt, its history section); ``question``
  and the ``expected`` strings, one of which the reply must contain (case-insensitive);
  ``device_share``, ``mode``, ``tile_cells``, ``min_tile_cells``, ``profile_path``: the plan, as
  :class:`lab.demo.DemoConfig`; ``check_tokens``: prompt tokens decoded one by one for the gate."""

  document: str | None = None
  question: str = ("Which organization was formed in 2001 to own Python-related Intellectual "
                   "Property?")
  expected: tuple[str, ...] = ("Python Software Foundation",)
  device_share: float = 0.2
  mode: str = "auto"
  profile_path: str | None = None
  tile_cells: int = 128
  min_tile_cells: int = 128
  max_new_tokens: int = 48
  check_tokens: int = 16
  model_path: str | None = None

  def __post_init__(self):
    where = "DocumentDemoConfig"
    if not 0.0 < self.device_share < 1.0:
      raise ValueError(f"{where}: device_share must be in (0, 1), got {self.device_share!r}")
    if not isinstance(self.check_tokens, int) or self.check_tokens < 1:
      raise ValueError(f"{where}: check_tokens must be a positive int, got {self.check_tokens!r}")
    if not self.expected or not all(isinstance(e, str) and e for e in self.expected):
      raise ValueError(f"{where}: expected must hold non-empty strings, got {self.expected!r}")


def python_license_path() -> str:
  """The running CPython's ``LICENSE.txt`` (in its standard library folder)."""
  path = os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt")
  if not os.path.isfile(path):
    raise ValueError(f"no {path} in this Python's standard library: pass a document "
                     f"(--document=/path/to/text)")
  return path


def read_document(path: str | None) -> tuple[str, str]:
  """``(text, where it came from)``: the file, or Python's LICENSE.txt up to its section B."""
  if path is None:
    path = python_license_path()
    with open(path, encoding="utf-8") as f:
      text = f.read()
    cut = text.find(_HISTORY_END)
    return (text[:cut] if cut > 0 else text).strip(), f"{path} (section A, the history)"
  if not os.path.isfile(path):
    raise ValueError(f"document {path!r} does not exist")
  with open(path, encoding="utf-8") as f:
    return f.read().strip(), path


def run(cfg: DocumentDemoConfig = DocumentDemoConfig(), log: Callable[[str], None] = print, *,
        loaded: tuple | None = None) -> dict[str, Any]:
  """Runs the demo (module docstring); returns its figures as a JSON-able dict. ``loaded``: a
  ``(model, tokenizer)`` already in memory (tests), else :func:`rkv.models.load_gguf`."""
  t_start = time.perf_counter()
  model, tok = loaded or models.load_gguf(cfg.model_path, progress=True)
  mc = model.config
  log(f"rkv document demo on {jax.default_backend()} ({jax.devices()[0].device_kind}), jax "
      f"{jax.__version__}")
  log(f"model: {mc.name} ({mc.num_layers} layers, {mc.num_heads} query / {mc.num_kv_heads} KV "
      f"heads, head_dim {mc.head_dim}, {mc.dtype}), {mc.kv_bytes_per_token()} KV bytes per token")
  text, source = read_document(cfg.document)
  messages = [{"role": "user", "content": f"{text}\n\nAnswer the question from the document "
                                          f"above.\nQuestion: {cfg.question}"}]
  ids = prompt_ids(tok, messages)
  n = len(ids)
  if cfg.check_tokens >= n:
    raise ValueError(f"check_tokens={cfg.check_tokens} must be below the prompt's {n} tokens")
  log(f"document: {source}, {len(text):,} characters; prompt {n} tokens with the question: "
      f"{cfg.question!r}")

  capacity = n + cfg.max_new_tokens
  plan = demo_plan(mc, capacity, cfg)
  log(plan.table())
  share = plan.host_bytes / max(plan.device_bytes + plan.host_bytes, 1)
  log(f"plan: {plan.device_bytes / MIB:.2f} MiB of KV on the device, "
      f"{plan.host_bytes / MIB:.2f} MiB in the host tail ({share:.0%})")

  off = generate_text(model, tok, messages, max_new_tokens=cfg.max_new_tokens, residency=plan)
  correct = any(e.lower() in off.text.lower() for e in cfg.expected)
  log(f"answer (offloaded plan): {off.text!r} — expected one of {list(cfg.expected)}: "
      f"{'CORRECT' if correct else 'WRONG'}")
  log(f"speed (offloaded plan): {off.summary()}")
  res = generate_text(model, tok, messages, max_new_tokens=cfg.max_new_tokens)
  same = res.tokens == off.tokens
  log(f"answer (resident):      {res.text!r}; all {len(off.tokens)} generated tokens identical "
      f"to the offloaded run: {same}")
  log(f"speed (resident):       {res.summary()}")

  # The logit gate: the prompt's last check_tokens tokens and the reply, one at a time, through
  # fresh caches of each kind (teacher forced on the offloaded reply).
  seq = np.asarray([ids + list(off.tokens)], np.int32)
  prefill_len = n - cfg.check_tokens
  planned = gen.decode_logits(model, seq, gen.caches_from_plan(mc, plan, 1, capacity),
                              prefill_len=prefill_len)
  ref = gen.decode_logits(model, seq, models.init_caches(mc, 1, capacity), prefill_len=prefill_len)
  metrics = gates.logit_metrics(ref, planned)
  passed, reasons = gates.check_gate(metrics, mc.dtype)
  log(f"equivalence vs resident over {seq.shape[1] - prefill_len} decode steps: max |dlogit| "
      f"{metrics.max_abs_logit:.2e}, mean KL {metrics.mean_kl:.2e}, top-1 agreement "
      f"{metrics.top1_agreement:.1%}, cosine {metrics.min_cosine:.6f}: "
      f"{'PASSED' if passed else 'FAILED ' + '; '.join(reasons)}")
  wall = time.perf_counter() - t_start
  log(f"done in {wall:.1f} s")
  return dict(document=source, prompt_tokens=n, question=cfg.question, answer=off.text,
              resident_answer=res.text, correct=correct, identical_to_resident=same,
              tactics=sorted({lp.tactic for lp in plan.layers}), device_bytes=plan.device_bytes,
              host_bytes=plan.host_bytes, prefill_tokens_per_s=off.prefill_tokens_per_s,
              decode_tokens_per_s=off.warm_decode_tokens_per_s,
              resident_prefill_tokens_per_s=res.prefill_tokens_per_s,
              resident_decode_tokens_per_s=res.warm_decode_tokens_per_s,
              metrics=dataclasses.asdict(metrics), gate_passed=passed, wall_s=wall)
