"""Text in, text out: :func:`generate_text` around :func:`rkv.generate.generate`.

A prompt is a string (encoded as it is) or chat messages (``[{"role", "content"}]``, rendered by
the tokenizer's chat template with the assistant's turn opened). The caches are resident unless
``caches`` or ``residency`` says otherwise: a :class:`rkv.ResidencyConfig` is planned for this
prompt plus ``max_new_tokens`` (:func:`rkv.plan`), a :class:`rkv.Plan` is used as it is (e.g. one
from :func:`rkv.generate.force_tactic`); either goes through :func:`rkv.generate.caches_from_plan`.

Streaming: ``on_token(piece)`` receives the text as it grows, never half a UTF-8 character (a
piece is held while the decoded text ends in U+FFFD) nor text that might begin a ``stop`` string
(held until it cannot). Generation ends at a stop token of the tokenizer (EOS), at a ``stop``
string (cut from the text), or after ``max_new_tokens``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import numpy as np

from rkv import generate as gen
from rkv.models.kv import init_caches
from rkv.residency import Plan, ResidencyConfig, plan as make_plan


@dataclasses.dataclass(frozen=True)
class TextGeneration:
  """The generated ``text`` (stop token and stop string excluded) and its figures.

  ``tokens``: the generated ids (a stop token included: it was generated); ``prompt_tokens``:
  the prompt's length; ``finish``: ``"eos"`` (a stop token), ``"stop"`` (a stop string) or
  ``"length"`` (``max_new_tokens``); seconds and tokens/s as in :class:`rkv.generate.Generation`
  (prefill includes the compiles of a first call). ``plan``: the residency plan the caches were
  built from (None: resident or caller's caches).
  """

  text: str
  tokens: tuple[int, ...]
  prompt_tokens: int
  finish: str
  prefill_s: float
  decode_s: float
  prefill_tokens_per_s: float
  decode_tokens_per_s: float
  plan: Plan | None = dataclasses.field(default=None, repr=False)
  generation: gen.Generation | None = dataclasses.field(default=None, repr=False)

  @property
  def new_tokens(self) -> int:
    return len(self.tokens)

  @property
  def warm_decode_tokens_per_s(self) -> float:
    """Decode tokens/s after the first step (which compiles); 0 without two decode steps."""
    return 0.0 if self.generation is None else self.generation.warm_decode_tokens_per_s

  def summary(self) -> str:
    warm = self.warm_decode_tokens_per_s
    return (f"{self.prompt_tokens} prompt tokens, {self.new_tokens} generated ({self.finish}); "
            f"prefill {self.prefill_s:.2f} s ({self.prefill_tokens_per_s:,.0f} tok/s), decode "
            f"{self.decode_s:.2f} s ({self.decode_tokens_per_s:,.1f} tok/s"
            + (f"; {warm:,.1f} tok/s after the first step's compile)" if warm else ")"))


def prompt_ids(tokenizer, prompt: str | Sequence[Mapping[str, str]], *,
               add_generation_prompt: bool = True) -> list[int]:
  """Token ids of a text prompt, or of chat messages through the chat template."""
  if isinstance(prompt, str):
    return tokenizer.encode(prompt)
  text = tokenizer.apply_chat_template(prompt, add_generation_prompt=add_generation_prompt)
  # The template writes BOS itself when the model wants one (transformers encodes its output
  # without special tokens too).
  return tokenizer.encode(text, add_bos=False)


def _held_back(text: str, stops: Sequence[str]) -> int:
  """Characters at the end of ``text`` that may be the start of a stop string."""
  held = 0
  for s in stops:
    for n in range(min(len(s) - 1, len(text)), held, -1):
      if text.endswith(s[:n]):
        held = n
        break
  return held


class _Streamer:
  """Turns tokens into text pieces for ``on_token``; finds stop strings."""

  def __init__(self, tokenizer, stops: Sequence[str], on_text: Callable[[str], None] | None,
               stop_ids: Sequence[int]):
    self.tokenizer, self.stops, self.on_text = tokenizer, tuple(stops), on_text
    self.stop_ids = set(int(i) for i in stop_ids)
    self.ids: list[int] = []
    self.sent = 0  # characters of the text already handed to on_text
    self.text = ""
    self.cut: int | None = None  # where a stop string begins

  def __call__(self, i: int, tokens) -> bool:
    tok = int(np.asarray(tokens)[0])
    if tok in self.stop_ids:
      return False  # generate stops on stop_tokens itself
    self.ids.append(tok)
    text = self.tokenizer.decode(self.ids)
    if text.endswith("\ufffd"):
      return False  # half a character: wait for the rest of its bytes
    self.text = text
    for s in self.stops:
      at = text.find(s, max(0, self.sent - len(s)))
      if at >= 0 and (self.cut is None or at < self.cut):
        self.cut = at
    if self.cut is not None:
      self._send(self.cut)
      return True
    self._send(len(text) - _held_back(text, self.stops))
    return False

  def _send(self, upto: int):
    if upto > self.sent and self.on_text is not None:
      self.on_text(self.text[self.sent:upto])
    self.sent = max(self.sent, upto)

  def finish(self) -> str:
    text = self.text if self.cut is None else self.text[:self.cut]
    self._send(len(text))
    return text


def _caches(model, n_cells: int, caches, residency):
  if caches is not None and residency is not None:
    raise ValueError("generate_text: pass caches or residency, not both")
  if caches is not None:
    return tuple(caches), None
  if residency is None:
    return init_caches(model.config, 1, n_cells), None
  if isinstance(residency, ResidencyConfig):
    plan = make_plan(model.config, n_cells, 1, residency=residency)
  elif isinstance(residency, Plan):
    plan = residency
  else:
    raise ValueError(f"generate_text: residency must be a rkv.ResidencyConfig or rkv.Plan, got "
                     f"{type(residency).__name__}")
  if any(lp.tactic != "resident" for lp in plan.layers):
    # Before the plan's caches take the device: XLA's GEMM autotuning allocates scratch as it
    # compiles, which a default-budget plan leaves no room for afterwards (gen.warm_up).
    gen.warm_up(model)
  return gen.caches_from_plan(model.config, plan, 1, max(n_cells, plan.context_len)), plan


def generate_text(model, tokenizer, prompt, *, max_new_tokens: int = 256,
                  temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                  stop: Sequence[str] | str = (), caches=None,
                  residency: ResidencyConfig | Plan | None = None,
                  on_token: Callable[[str], None] | None = None, chunk: int = gen.DEFAULT_CHUNK,
                  progress: bool | None = None, add_generation_prompt: bool = True,
                  forward=None) -> TextGeneration:
  """Generates a reply to ``prompt`` (a string, or chat messages) with ``model`` and its
  ``tokenizer`` (a :class:`rkv.models.ChatTokenizer`, e.g. from :func:`rkv.models.load_gguf`).

  ``temperature=0``: greedy; else sampling at ``temperature`` within ``top_k`` (0: all) and
  ``top_p``, reproducible for a ``seed``. ``stop``: strings that end the reply (cut from it).
  ``caches``: one per layer with room for the prompt plus ``max_new_tokens`` (donated), or
  ``residency``: a :class:`rkv.ResidencyConfig` (planned for this prompt) or a
  :class:`rkv.Plan`; neither: resident caches. ``on_token(piece)``: the text as it is generated
  (module docstring). ``progress``: the prefill's progress line (None: for long prompts).
  ``forward``: a ``jit_forward(model, last_only=True)`` reused across calls (resident only).
  """
  where = "generate_text"
  stops = (stop,) if isinstance(stop, str) else tuple(stop)
  if any(not isinstance(s, str) or not s for s in stops):
    raise ValueError(f"{where}: stop must be non-empty strings, got {stop!r}")
  ids = prompt_ids(tokenizer, prompt, add_generation_prompt=add_generation_prompt)
  if not ids:
    raise ValueError(f"{where}: the prompt encodes to no tokens")
  cfg = model.config
  if len(ids) + max_new_tokens > cfg.max_position_embeddings:
    raise ValueError(f"{where}: {len(ids)} prompt tokens + max_new_tokens={max_new_tokens} exceed "
                     f"the model's context of {cfg.max_position_embeddings} positions")
  kv, plan = _caches(model, len(ids) + max_new_tokens, caches, residency)
  return _generate_ids(model, tokenizer, ids, kv, plan, stops=stops, on_token=on_token,
                       max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                       top_p=top_p, seed=seed, chunk=chunk, progress=progress, forward=forward)


def _generate_ids(model, tokenizer, ids, kv, plan, *, stops, on_token, max_new_tokens,
                  temperature, top_k, top_p, seed, chunk, progress, forward) -> TextGeneration:
  """The reply to prompt ``ids`` through caches ``kv`` (which may already hold earlier tokens:
  generation continues after them)."""
  streamer = _Streamer(tokenizer, stops, on_token, tokenizer.stop_ids)
  out = gen.generate(model, np.asarray([ids], np.int32), max_new_tokens=max_new_tokens,
                     caches=kv, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                     chunk=chunk, progress=progress, forward=forward,
                     stop_tokens=tokenizer.stop_ids, on_token=streamer)
  text = streamer.finish()
  toks = tuple(int(x) for x in out.tokens[0, :int(out.lengths[0])])
  finish = {"stop_tokens": "eos", "on_token": "stop"}.get(out.stopped, "length")
  return TextGeneration(text=text, tokens=toks, prompt_tokens=len(ids), finish=finish,
                        prefill_s=out.prefill_s, decode_s=out.decode_s,
                        prefill_tokens_per_s=out.prefill_tokens_per_s,
                        decode_tokens_per_s=out.decode_tokens_per_s, plan=plan, generation=out)


class ChatSession:
  """A conversation whose KV stays in its caches between turns: each :meth:`send` prefills only
  the new turn's tokens (the caches are append-only, so the earlier turns' cells are still
  there), not the whole conversation again. Its figures (``prefill_s``: time to first token)
  are then the turn's own.

  The caches are built once for ``capacity`` cells (default: the model's context): resident, or
  planned from ``residency`` (a :class:`rkv.ResidencyConfig`, planned for ``capacity``, or a
  :class:`rkv.Plan`). :attr:`ids` are the conversation's tokens as the model saw them (the
  template's turns and the replies' generated ids, stop tokens included); :attr:`messages` the
  same as chat messages. A turn that no longer fits raises ``ValueError`` (start a new session
  with a larger capacity).

  A new turn's tokens are the chat template's text for the conversation with the new message,
  past the text already fed. When that text does not extend the fed text (a reply cut at a
  ``stop`` string: the template holds the cut reply, the caches the tokens generated past it)
  the session starts its caches afresh and prefills the whole conversation
  (:attr:`last_turn_reused` says which happened). ``forward``: a ``jit_forward(model,
  last_only=True)`` to share with other sessions (resident caches only).
  """

  def __init__(self, model, tokenizer, *, system: str | None = None,
               capacity: int | None = None, residency: ResidencyConfig | Plan | None = None,
               chunk: int = gen.DEFAULT_CHUNK, forward=None):
    self.model, self.tokenizer, self.chunk = model, tokenizer, chunk
    self._shared_forward = forward
    self.capacity = model.config.max_position_embeddings if capacity is None else int(capacity)
    if self.capacity < 2:
      raise ValueError(f"ChatSession: capacity must be at least 2 cells, got {capacity!r}")
    self.residency = residency
    self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
    self.last_turn_reused = False
    self._reset_caches()

  def _reset_caches(self):
    self.caches, self.plan = _caches(self.model, self.capacity, None, self.residency)
    # One compile of the resident step for every turn (generate would make its own each call).
    self._forward = None
    if all(c.jittable for c in self.caches):
      from rkv.models.transformer import jit_forward
      self._forward = self._shared_forward or jit_forward(self.model, last_only=True)
    self._fed, self._pending = [], []

  @property
  def ids(self) -> list[int]:
    """The conversation's tokens: those in the caches, then the last reply's final token
    (sampled, not fed yet: the next turn feeds it first)."""
    return self._fed + self._pending

  def turn_ids(self, content: str, role: str = "user") -> tuple[list[int], bool]:
    """``(tokens the next turn prefills, whether the caches are kept)`` for a new message."""
    text = self.tokenizer.apply_chat_template(self.messages + [{"role": role, "content": content}],
                                              add_generation_prompt=True)
    said = self.tokenizer.decode(self.ids, skip_special=False)
    if self.ids and text.startswith(said):
      return self._pending + self.tokenizer.encode(text[len(said):], add_bos=False), True
    return self.tokenizer.encode(text, add_bos=False), False

  def send(self, content: str, *, role: str = "user", max_new_tokens: int = 256,
           temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
           stop: Sequence[str] | str = (), on_token: Callable[[str], None] | None = None,
           progress: bool | None = None) -> TextGeneration:
    """Adds a message, generates the assistant's reply over the whole conversation and keeps
    both. Of the result, ``prompt_tokens`` are the tokens this turn prefilled and ``prefill_s``
    its time to first token."""
    where = "ChatSession.send"
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if any(not isinstance(s, str) or not s for s in stops):
      raise ValueError(f"{where}: stop must be non-empty strings, got {stop!r}")
    new, kept = self.turn_ids(content, role)
    if self.ids and not kept:
      self._reset_caches()
    self.last_turn_reused = kept
    room = self.capacity - len(self._fed)
    if len(new) + max_new_tokens > room:
      raise ValueError(f"{where}: this turn's {len(new)} tokens + max_new_tokens="
                       f"{max_new_tokens} exceed the {room} cells left of capacity="
                       f"{self.capacity}: start a new ChatSession with a larger capacity")
    out = _generate_ids(self.model, self.tokenizer, new, self.caches, self.plan, stops=stops,
                        on_token=on_token, max_new_tokens=max_new_tokens,
                        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                        chunk=self.chunk, progress=progress, forward=self._forward)
    self.caches = out.generation.caches
    self.messages += [{"role": role, "content": content},
                      {"role": "assistant", "content": out.text}]
    self._fed += new + list(out.tokens[:-1])
    self._pending = list(out.tokens[-1:])
    return out
