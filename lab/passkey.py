"""Passkey retrieval with a real chat model (SmolLM2 by default) through every tactic.

The classic long-context probe (Mohtashami & Jaggi, 2023): a random five-digit key is hidden at
some depth of repeated filler sentences, and the user's question at the end asks for it. The
prompt goes through the model's chat template; the greedy reply scores 1 if it contains the key.
Every tactic decodes the same prompts: resident caches, or every layer forced to an offloaded
tactic with a small device window (:func:`lab.niah.tactic_caches`), so most of the KV sits in
the host tail. The tactics are exact, so each must score what resident scores and generate the
same tokens; :func:`run` reports both. ``experiments/passkey.py`` is the front end.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from rkv import generate as gen
from rkv import tactics as tactic_names
from rkv.models.transformer import jit_forward
from rkv.text import prompt_ids
from lab.niah import tactic_caches

TACTICS = tactic_names.TACTICS

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.\n\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? Answer with the number only."


@dataclasses.dataclass(frozen=True)
class PasskeyPrompt:
  """``ids``: the chat-templated prompt; ``key``: the five digits; ``depth``: where the needle
  sits among the fillers (0: first, 1: last); ``fillers``: how many filler sentences."""

  ids: list
  key: str
  depth: float
  fillers: int


def _render(tokenizer, key: str, fillers: int, at: int) -> list[int]:
  body = FILLER * at + NEEDLE.format(key=key) + FILLER * (fillers - at)
  return prompt_ids(tokenizer, [{"role": "user", "content": INTRO + body + QUESTION}])


def passkey_prompt(tokenizer, length: int, key: str, depth: float) -> PasskeyPrompt:
  """The longest prompt of at most ``length`` tokens hiding ``key`` at ``depth`` in [0, 1]."""
  if not (isinstance(key, str) and len(key) == 5 and key.isdigit()):
    raise ValueError(f"passkey_prompt: key must be five digits, got {key!r}")
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f"passkey_prompt: depth must be in [0, 1], got {depth!r}")
  base = len(_render(tokenizer, key, 0, 0))
  per = len(_render(tokenizer, key, 1, 0)) - base  # tokens one filler sentence adds
  if length < base + per:
    raise ValueError(f"passkey_prompt: length={length} leaves no room for filler (the prompt "
                     f"without filler is {base} tokens)")
  n = (length - base) // per
  while True:  # BPE merges at the joins may add a token: shrink until it fits
    at = int(round(depth * n))
    ids = _render(tokenizer, key, n, at)
    if len(ids) <= length:
      return PasskeyPrompt(ids=ids, key=key, depth=depth, fillers=n)
    n -= 1


def contains_key(text: str, key: str) -> bool:
  return key in text


@dataclasses.dataclass(frozen=True)
class PasskeyConfig:
  """``samples`` prompts per length (depths spread evenly over [0, 1], keys drawn from ``seed``);
  ``tactics_at`` / ``samples_at``: per length, the tactics / samples run there instead (e.g.
  fewer at 8K on a small CPU); the offloaded layout as :func:`lab.niah.tactic_caches`."""

  lengths: tuple = (1024, 2048, 4096, 8192)
  samples: int = 3
  tactics: tuple = TACTICS
  tactics_at: tuple = ()  # ((length, (tactic, ...)), ...)
  samples_at: tuple = ()  # ((length, samples), ...)
  window_cells: int = 128
  tile_cells: int = 256
  cpu_fraction: float = 0.5
  resident_heads: int = 1
  max_new_tokens: int = 12
  chunk: int = 512
  seed: int = 0

  def __post_init__(self):
    where = "PasskeyConfig"
    bad = [t for t in self.tactics if t not in TACTICS]
    for _, ts in self.tactics_at:
      bad += [t for t in ts if t not in TACTICS]
    if bad:
      raise ValueError(f"{where}: unknown tactics {bad}; known: {TACTICS}")
    if min((self.samples, self.max_new_tokens) + tuple(n for _, n in self.samples_at)) < 1:
      raise ValueError(f"{where}: samples and max_new_tokens must be positive")

  def samples_for(self, length: int) -> int:
    return dict(self.samples_at).get(length, self.samples)

  def tactics_for(self, length: int) -> tuple:
    """The tactics run at ``length``, resident first (the yardstick)."""
    ts = dict(self.tactics_at).get(length, self.tactics)
    return ("resident",) + tuple(t for t in ts if t != "resident")


def depths(samples: int) -> list[float]:
  """``samples`` depths spread over [0, 1] (one sample: the middle)."""
  return [0.5] if samples == 1 else [i / (samples - 1) for i in range(samples)]


def reply(model, tokenizer, prompt: PasskeyPrompt, tactic: str, cfg: PasskeyConfig, *,
          forward=None) -> tuple[list, str, float]:
  """``(generated ids, their text, seconds)`` of the greedy reply to ``prompt`` through fresh
  caches of ``tactic``. ``forward``: a ``jit_forward(model, last_only=True)`` shared by the
  resident runs (one compile)."""
  t0 = time.perf_counter()
  cap = len(prompt.ids) + cfg.max_new_tokens
  caches = tactic_caches(model.config, tactic, 1, cap, window_cells=cfg.window_cells,
                         tile_cells=cfg.tile_cells, cpu_fraction=cfg.cpu_fraction,
                         resident_heads=cfg.resident_heads)
  out = gen.generate(model, np.asarray([prompt.ids], np.int32), max_new_tokens=cfg.max_new_tokens,
                     caches=caches, stop_tokens=tokenizer.stop_ids, chunk=cfg.chunk,
                     forward=forward if tactic == "resident" else None)
  ids = [int(x) for x in out.tokens[0, :int(out.lengths[0])]]
  return ids, tokenizer.decode(ids), time.perf_counter() - t0


def run(model, tokenizer, cfg: PasskeyConfig = PasskeyConfig(), *,
        log: Callable[[str], None] = print) -> dict:
  """Scores passkey retrieval per length and tactic (module docstring). Returns a JSON-able dict:
  ``accuracy[tactic][length]``, ``identical_to_resident[tactic]`` (every generated token equal
  to resident's on every prompt), ``samples`` (each prompt's key, depth, tokens and every
  tactic's reply), ``seconds[tactic][length]`` (all its prompts there, compiles included) and
  the config."""
  rng = np.random.default_rng(cfg.seed)
  forward = jit_forward(model, last_only=True)
  acc, secs, differ, samples = {}, {}, {}, []
  for length in cfg.lengths:
    run_here = cfg.tactics_for(length)
    n = cfg.samples_for(length)
    for t in run_here:
      acc.setdefault(t, {})[str(length)] = 0.0
      secs.setdefault(t, {})[str(length)] = 0.0
      differ.setdefault(t, 0)
    for depth in depths(n):
      key = f"{int(rng.integers(10000, 100000))}"
      p = passkey_prompt(tokenizer, length, key, depth)
      replies, toks = {}, {}
      for t in run_here:
        toks[t], replies[t], s = reply(model, tokenizer, p, t, cfg, forward=forward)
        secs[t][str(length)] += s
        acc[t][str(length)] += contains_key(replies[t], key) / n
      for t in run_here:
        differ[t] += toks[t] != toks["resident"]
      samples.append(dict(length=length, prompt_tokens=len(p.ids), key=key, depth=depth,
                          replies=replies, identical={t: toks[t] == toks["resident"]
                                                      for t in run_here}))
      log(f"passkey: {len(p.ids):5d} tokens, key {key} at depth {depth:.2f}: " + "  ".join(
          f"{t} {'ok' if contains_key(replies[t], key) else 'miss'}" for t in run_here)
          + ("" if all(toks[t] == toks["resident"] for t in run_here)
             else "  TOKENS DIFFER FROM RESIDENT") + f"  (resident: {replies['resident']!r})")
  return dict(config=dataclasses.asdict(cfg), accuracy=acc,
              identical_to_resident={t: n == 0 for t, n in differ.items()},
              prompts_differing_from_resident=differ, seconds=secs, samples=samples)


def format_table(report: dict) -> str:
  """Accuracy per tactic (rows) and length (columns), with the identity check."""
  lengths = [str(n) for n in report["config"]["lengths"]]
  lines = ["tactic    " + "".join(f"{n:>8}" for n in lengths) + "  identical to resident"]
  for t, by_len in report["accuracy"].items():
    cells = "".join(f"{by_len[n]:8.2f}" if n in by_len else f"{'-':>8}" for n in lengths)
    lines.append(f"{t:<10}{cells}  {report['identical_to_resident'][t]}")
  return "\n".join(lines)
