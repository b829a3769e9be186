"""The needle-in-a-haystack recall task and its shipped model.

The task. A prompt is ``<bos>``, a *haystack* of filler words holding ``1 + num_distractors``
key→value *pairs* (a key word followed by ``value_len`` value words), then the query ``? KEY``::

    <bos> while cold Demi 117 108 over the ... the needle: Bako 151 102 ... fast ? Bako
                                                                           -> answer: 151 102

The *needle* is the pair whose key the query names; it starts at fractional ``depth`` of the
haystack (0: right after ``<bos>``, 1: right before the query). Keys, values and filler come from
disjoint vocabulary ranges and every pair token (key or value) occurs once in the haystack, so
the answer is unambiguous: each answer token is the token that followed the previous token's
only earlier occurrence. That is what an induction circuit computes (a previous-token head, then
a head matching the current token against the previous-token features), and two layers learn it.

The model is an ``rkv.models`` Llama (tied embeddings, float32) shipped as a Hugging Face folder
(``config.json``, ``model.safetensors``, ``tokenizer.json``, ``recall_task.json``,
``training_log.json``) at ``rkv/assets/recall``; :func:`load_recall_model` reads it back and
:func:`answer` decodes a needle's answer through any caches. How it was trained and why it
length-generalizes is the lab's (``lab/recall_train.py``); scoring over lengths x depths x
tactics is ``lab/niah.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import NamedTuple, Sequence

import numpy as np


ASSET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "recall")
TASK_FILE = "recall_task.json"
LOG_FILE = "training_log.json"

PAD, UNK, BOS, QUERY = "<pad>", "<unk>", "<bos>", "?"
SPECIALS = (PAD, UNK, BOS, QUERY)
# Filler: common English words (lower case, so they never collide with the capitalized keys or the
# numeric values). The haystack is word salad of these.
FILLER_WORDS = (
    "the of and to in is was for on that with as by at from his her it an were are which this "
    "be or had not but what all when can there we one who more if out so up said do into time "
    "has two could like other new then some them way these see him now may only its over also "
    "after where most first well very through back much before good our just any man same old "
    "right too three long little down while great day never world own under last might place "
    "house still high another small part people found both between each name home light hand "
    "water since away large three along far round open city near river stone cold green wind "
    "quiet road field early night morning tree warm soft slow fast deep").split()
FILLER_WORDS = tuple(dict.fromkeys(FILLER_WORDS))  # drop repeats, keep order
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def _key_words(n: int) -> tuple[str, ...]:
  """``n`` distinct two-syllable names (``Bako``, ``Demi``, ...), a fixed spread of the 4900."""
  syl = [c + v for c in _CONSONANTS for v in _VOWELS]
  total = len(syl) ** 2
  if n > total:
    raise ValueError(f"RecallTask: num_keys must be <= {total}, got {n}")
  # 9973 is prime and does not divide 4900: i -> 9973 i mod 4900 is a bijection, so the names
  # are distinct and spread over all syllables without a random generator.
  out = []
  for i in range(n):
    j = (i * 9973) % total
    out.append((syl[j // len(syl)] + syl[j % len(syl)]).capitalize())
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class RecallTask:
  """The vocabulary and the prompt shape.

  Token ids: the ``SPECIALS`` (0..3), then ``num_keys`` key words, ``num_values`` value words
  (``"100"``, ``"101"``, ...), then ``num_filler`` filler words. A small vocabulary is what lets
  the circuit form within minutes on a CPU: every token's embedding must learn to be matched and
  copied, and a token seen rarely learns slowly (256 keys and values stayed on the loss plateau
  twice as long as 64/96 did). A pair is a key and ``value_len`` values;
  a haystack prompt holds the needle and ``num_distractors`` other pairs.
  """

  num_keys: int = 64
  num_values: int = 96
  num_filler: int = 64
  value_len: int = 2
  num_distractors: int = 15

  def __post_init__(self):
    if not isinstance(self.num_filler, (int, np.integer)) or not 1 <= self.num_filler <= len(
        FILLER_WORDS):
      raise ValueError(f"RecallTask: num_filler must be in [1, {len(FILLER_WORDS)}], got "
                       f"{self.num_filler!r}")
    for f in ("num_keys", "num_values", "value_len"):
      v = getattr(self, f)
      if not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"RecallTask: {f} must be a positive int, got {v!r}")
    if not isinstance(self.num_distractors, (int, np.integer)) or self.num_distractors < 0:
      raise ValueError(f"RecallTask: num_distractors must be an int >= 0, got "
                       f"{self.num_distractors!r}")
    if (1 + self.num_distractors) > self.num_keys or \
        (1 + self.num_distractors) * self.value_len > self.num_values:
      raise ValueError(f"RecallTask: {1 + self.num_distractors} pairs need that many distinct "
                       f"keys (num_keys={self.num_keys}) and value_len x that distinct values "
                       f"(num_values={self.num_values})")
    _key_words(self.num_keys)

  # --- vocabulary ---
  @property
  def key_start(self) -> int:
    return len(SPECIALS)

  @property
  def value_start(self) -> int:
    return self.key_start + self.num_keys

  @property
  def filler_start(self) -> int:
    return self.value_start + self.num_values

  @property
  def vocab_size(self) -> int:
    return self.filler_start + self.num_filler

  @property
  def bos_id(self) -> int:
    return SPECIALS.index(BOS)

  @property
  def query_id(self) -> int:
    return SPECIALS.index(QUERY)

  @property
  def pair_len(self) -> int:
    return 1 + self.value_len

  @property
  def min_context(self) -> int:
    """The shortest haystack prompt: ``<bos>``, every pair, ``? KEY``, and two pairs' worth of
    filler, so the pairs fit on both sides of a needle at any depth."""
    return 3 + (3 + self.num_distractors) * self.pair_len

  def words(self) -> tuple[str, ...]:
    """Every token's word, by id."""
    values = tuple(str(100 + i) for i in range(self.num_values))
    return SPECIALS + _key_words(self.num_keys) + values + FILLER_WORDS[:self.num_filler]

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)

  def replace(self, **changes) -> "RecallTask":
    return dataclasses.replace(self, **changes)


def build_tokenizer(task: RecallTask):
  """A ``tokenizers`` WordLevel tokenizer of the task's words (whitespace-split; decoding joins
  with spaces and drops ``<pad>``/``<unk>``/``<bos>``)."""
  from tokenizers import Tokenizer, models as tk_models, pre_tokenizers

  vocab = {w: i for i, w in enumerate(task.words())}
  tok = Tokenizer(tk_models.WordLevel(vocab, unk_token=UNK))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens([PAD, UNK, BOS])
  return tok


# ----------------------------------------------------------------------------------------------
# Prompts
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Haystack:
  """``tokens [T]`` int32 prompt (``<bos>`` ... ``? KEY``); ``answer [value_len]`` int32 (the
  needle's values); ``needle_start``: index in ``tokens`` of the needle's key; ``key``: its id;
  ``pair_starts``: indices of every pair's key (the needle's included), ascending."""

  tokens: np.ndarray
  answer: np.ndarray
  needle_start: int
  key: int
  pair_starts: np.ndarray


def place_pairs(rng, length: int, n: int, pair_len: int) -> np.ndarray:
  """Sorted starts of ``n`` non-overlapping pairs at random places in ``[0, length)``."""
  free = length - n * pair_len
  ins = np.sort(rng.integers(0, free + 1, size=n))
  return ins + pair_len * np.arange(n)


def draw_pairs(rng, task: RecallTask, n: int) -> tuple[np.ndarray, np.ndarray]:
  """``n`` distinct keys ``[n]`` and ``n x value_len`` distinct values ``[n, value_len]``."""
  keys = task.key_start + rng.choice(task.num_keys, size=n, replace=False)
  values = task.value_start + rng.choice(task.num_values, size=n * task.value_len,
                                         replace=False).reshape(n, task.value_len)
  return keys.astype(np.int32), values.astype(np.int32)


def haystack(rng: np.random.Generator, context_len: int, depth: float,
             task: RecallTask = RecallTask(), *, num_distractors: int | None = None) -> Haystack:
  """A prompt of exactly ``context_len`` tokens with the needle at fractional ``depth`` in [0, 1]
  of the haystack (between ``<bos>`` and the query), ``num_distractors`` (default the task's)
  other pairs at random places, filler words elsewhere."""
  where = "haystack"
  nd = task.num_distractors if num_distractors is None else num_distractors
  if nd != task.num_distractors:
    task = task.replace(num_distractors=nd)
  if not isinstance(context_len, (int, np.integer)) or context_len < task.min_context:
    raise ValueError(f"{where}: context_len must be an int >= {task.min_context} (<bos>, "
                     f"{1 + nd} pairs of {task.pair_len} and 2 of filler, '? KEY'), got "
                     f"{context_len!r}")
  if not 0.0 <= float(depth) <= 1.0:
    raise ValueError(f"{where}: depth must be in [0, 1], got {depth!r}")
  body = context_len - 3
  pl = task.pair_len
  needle = int(round(float(depth) * (body - pl)))
  # Distractors fall left or right of the needle in proportion to the room on each side.
  left_room, right_room = needle, body - needle - pl
  n_left = int(rng.binomial(nd, left_room / max(left_room + right_room, 1))) if nd else 0
  n_left = min(max(n_left, nd - right_room // pl), left_room // pl)
  right = needle + pl + place_pairs(rng, right_room, nd - n_left, pl)
  starts = np.concatenate([place_pairs(rng, left_room, n_left, pl), [needle], right]).astype(int)
  keys, values = draw_pairs(rng, task, 1 + nd)
  toks = (task.filler_start + rng.integers(0, task.num_filler, size=body)).astype(np.int32)
  for j, s in enumerate(starts):
    toks[s] = keys[j]
    toks[s + 1:s + pl] = values[j]
  needle_j = n_left
  out = np.concatenate([[task.bos_id], toks, [task.query_id, keys[needle_j]]]).astype(np.int32)
  return Haystack(tokens=out, answer=values[needle_j].copy(), needle_start=1 + needle,
                  key=int(keys[needle_j]), pair_starts=(1 + starts).astype(np.int32))


def haystack_batch(rng, batch: int, context_len: int, depth: float,
                   task: RecallTask = RecallTask()) -> tuple[np.ndarray, np.ndarray]:
  """``(tokens [B,T], answers [B,value_len])`` of ``batch`` haystacks at one length and depth."""
  hs = [haystack(rng, context_len, depth, task) for _ in range(batch)]
  return np.stack([h.tokens for h in hs]), np.stack([h.answer for h in hs])


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RecallModelSpec:
  """The tiny Llama's dimensions (vocabulary from the task)."""

  num_layers: int = 2
  hidden_size: int = 128
  intermediate_size: int = 256
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 64
  # A large base keeps the low rotary pairs nearly still over 16K positions (module docstring):
  # with D=64 the 11 slowest of the 32 pairs turn by < 0.5 rad over 16K positions, while the
  # fastest (1 rad per position) let a head pick out the previous token.
  rope_theta: float = 1e7
  max_position_embeddings: int = 32768


def model_config(task: RecallTask, spec: RecallModelSpec = RecallModelSpec()):
  """The :class:`rkv.models.ModelConfig` (Llama family, tied embeddings, float32)."""
  from rkv.models.config import ModelConfig, RopeConfig
  return ModelConfig(
      vocab_size=task.vocab_size, hidden_size=spec.hidden_size,
      intermediate_size=spec.intermediate_size, num_layers=spec.num_layers,
      num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
      layer_windows=(None,) * spec.num_layers, rope=RopeConfig(theta=spec.rope_theta),
      rms_norm_eps=1e-6, tie_embeddings=True,
      max_position_embeddings=spec.max_position_embeddings, dtype="float32", family="llama",
      name="rkv-recall")



class RecallModel(NamedTuple):
  """What :func:`load_recall_model` returns: the model (``model.config`` is its
  :class:`rkv.models.ModelConfig`), the ``tokenizers.Tokenizer`` and the :class:`RecallTask`."""

  model: object
  tokenizer: object
  task: RecallTask


def load_recall_model(path: str | None = None, *, impl: str = "auto") -> RecallModel:
  """``(model, tokenizer, task)`` from a folder written by :func:`save_model` (default: the
  shipped ``rkv/assets/recall``)."""
  import jax.numpy as jnp
  from rkv.models import hf

  path = ASSET_DIR if path is None else os.fspath(path)
  task_file = os.path.join(path, TASK_FILE)
  if not os.path.isfile(task_file):
    raise ValueError(f"load_recall_model: {path!r} holds no {TASK_FILE} (train one with "
                     f"python -m experiments.train_recall)")
  with open(task_file) as f:
    task = RecallTask(**json.load(f))
  model = hf.load_hf(path, jnp.float32, impl=impl)
  tok = hf.load_tokenizer(path)
  if model.config.vocab_size != task.vocab_size or (
      tok is not None and tok.get_vocab_size() != task.vocab_size):
    raise ValueError(f"load_recall_model({path}): vocab sizes disagree: model "
                     f"{model.config.vocab_size}, task {task.vocab_size}, tokenizer "
                     f"{None if tok is None else tok.get_vocab_size()}")
  return RecallModel(model, tok, task)


def answer(model, tokens, value_len: int, *, caches, chunk: int = 512) -> np.ndarray:
  """Greedy ``[B, value_len]`` answer tokens of prompts ``tokens [B,T]`` through ``caches``
  (room for ``T + value_len`` cells): :func:`rkv.generate.generate`."""
  from rkv import generate as gen
  return gen.generate(model, tokens, max_new_tokens=value_len, caches=caches, chunk=chunk,
                      progress=False).tokens

def decode_text(tokenizer, ids: Sequence[int]) -> str:
  """Readable text of token ids (``tokenizer.decode``, specials dropped)."""
  return tokenizer.decode([int(i) for i in ids])
