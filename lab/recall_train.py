"""Training of the needle-in-a-haystack recall model (the task and its loading: rkv.recall).

The task (prompt layout, the needle, why two layers can solve it) is described in
:mod:`rkv.recall`'s docstring.

Why it length-generalizes from short training (:func:`training_batch`, :class:`TrainConfig`):
- The match is on content, and RoPE with a large base (1e7, D=64) leaves a third of the rotary
  pairs nearly still over 16K positions, so a head can match keys wherever the needle is.
- Training positions are spread with random jumps between filler words (up to ``max_span``) so
  query→needle distances up to 16K are seen in rows of 128–1024 tokens; the pairs and the query
  themselves stay contiguous, so the previous-token head learns offset 1 exactly. (Randomized
  positions as in Ruoss et al. 2023, "Randomized Positional Encodings Boost Length
  Generalization of Transformers".)
- Distance is not all: trained on rows of <= 1K tokens, the model missed 8K needles late in
  the haystack (heads that attend over 8K tokens were not sharp enough for that many), and then
  needles right before the query at 4K–8K; continuing on rows of 2K–4K tokens, with
  ``adjacent_prob`` rows, fixed both (the runs are in ``training_log.json``).
- Loss on answer tokens only: every step supervises the retrieval, never the random filler; a
  curriculum (:data:`DEFAULT_STAGES`) forms the circuit on short rows with repeated pairs first.

The model is an ``rkv.models`` Llama (tied embeddings, float32) trained by :func:`train` (optax)
through rkv's own forward without a cache, and shipped as a Hugging Face folder
(``config.json``, ``model.safetensors``, ``tokenizer.json``, ``recall_task.json``,
``training_log.json``) at ``rkv/assets/recall``; :func:`load_recall_model` reads it back.
:func:`niah` scores retrieval over context lengths x needle depths on the resident path and the
offloaded tactics, and checks every tactic answers exactly what resident answers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
from typing import Callable

import numpy as np

from rkv.recall import (LOG_FILE, PAD, SPECIALS, TASK_FILE, RecallModelSpec, RecallTask,
                        build_tokenizer, draw_pairs, haystack, load_recall_model, model_config,
                        place_pairs)


@dataclasses.dataclass(frozen=True)
class TrainBatch:
  """``tokens``, ``positions``, ``targets`` int32 and ``mask`` float32, all ``[B,T]``: the loss
  is on ``targets`` where ``mask`` (the answer tokens of the queries)."""

  tokens: np.ndarray
  positions: np.ndarray
  targets: np.ndarray
  mask: np.ndarray


def training_batch(rng, batch: int, length: int, task: RecallTask = RecallTask(), *,
                   num_queries: int = 6, max_pairs: int = 16, max_span: int = 16384,
                   jump_prob: float = 0.75, max_jumps: int = 8,
                   repeat: float = 0.0, adjacent_prob: float = 0.0) -> TrainBatch:
  """Training rows of ``length`` tokens: ``<bos>``, a haystack of 1..``max_pairs`` pairs (at
  least ``num_queries``), then ``num_queries`` queries ``? KEY v1 .. vL`` on distinct pairs;
  targets are the values of each query (teacher-forced).

  ``repeat`` > 0: about that share of the haystack's pair slots repeat an earlier pair, and
  the values of every repeat are targets too (the same retrieval, four times the supervised
  tokens of a short row: what gets the induction circuit off its plateau).
  ``adjacent_prob``: the share of rows whose haystack ends with the first query's pair, right
  before ``? KEY`` (a needle at depth 1; rare otherwise, and a model never shown it confuses
  the answer's second token there).

  With probability ``jump_prob`` a row's positions jump forward at 1..``max_jumps`` random places
  (before a filler word or the first query, unless the row is ``adjacent``) so its last position
  is uniform in ``[length, max_span)``: query→needle distances far beyond ``length`` (module
  docstring).
  """
  pl = task.pair_len
  q_len = num_queries * (1 + pl)
  body = length + 1 - 1 - q_len  # +1: the row carries one more token for the shifted targets
  if body < max_pairs * pl:
    raise ValueError(f"training_batch: length={length} leaves {body} haystack tokens, fewer than "
                     f"max_pairs={max_pairs} x {pl}")
  if max_pairs > min(task.num_keys, task.num_values // task.value_len):
    raise ValueError(f"training_batch: max_pairs={max_pairs} exceeds the distinct keys/values")
  toks = np.empty((batch, length + 1), np.int32)
  mask = np.zeros((batch, length + 1), np.float32)
  pos = np.empty((batch, length), np.int32)
  for r in range(batch):
    m = int(rng.integers(num_queries, max_pairs + 1))  # pair slots
    n = max(num_queries, int(round(m * (1.0 - repeat))))  # distinct pairs
    keys, values = draw_pairs(rng, task, n)
    which = np.concatenate([np.arange(n), rng.integers(0, n, size=m - n)])
    which = which[rng.permutation(m)] if m > n else which
    row = task.filler_start + rng.integers(0, task.num_filler, size=body)
    starts = place_pairs(rng, body, m, pl)
    adjacent = adjacent_prob > 0 and rng.random() < adjacent_prob  # no draw at 0: same stream
    if adjacent:
      starts[-1] = body - pl  # the last pair slides right, onto the query
    seen = set()
    for s, j in zip(starts, which):
      row[s] = keys[j]
      row[s + 1:s + pl] = values[j]
      if j in seen:
        mask[r, 1 + s + 1:1 + s + pl] = 1.0
      seen.add(j)
    qs = []
    asked = rng.choice(n, size=num_queries, replace=False)
    if adjacent and which[-1] not in asked[:1]:
      asked = np.concatenate([[which[-1]], asked[asked != which[-1]][:num_queries - 1]])
    for j in asked:
      qs += [task.query_id, keys[j], *values[j]]
    toks[r] = np.concatenate([[task.bos_id], row, qs])
    for q in range(num_queries):
      a = 1 + body + q * (1 + pl) + 2  # first value of query q
      mask[r, a:a + task.value_len] = 1.0
    inc = np.ones(length, np.int64)
    inc[0] = 0
    if rng.random() < jump_prob and max_span > length:
      # A jump lands before token i when token i is filler or the first query marker.
      cand = np.flatnonzero(toks[r, :length] >= task.filler_start)
      cand = cand[cand > 0] if adjacent else np.append(cand[cand > 0], 1 + body)
      k = int(rng.integers(1, max_jumps + 1))
      cuts = rng.choice(cand, size=min(k, cand.size), replace=False)
      extra = int(rng.integers(0, max_span - length))
      if cuts.size:  # an adjacent row of pairs only has no place to jump
        np.add.at(inc, cuts, rng.multinomial(extra, np.full(cuts.size, 1.0 / cuts.size)))
    pos[r] = np.cumsum(inc)
  return TrainBatch(tokens=toks[:, :-1], positions=pos, targets=toks[:, 1:], mask=mask[:, 1:])


def hf_config(config, task: RecallTask) -> dict:
  """The ``config.json`` of a LlamaForCausalLM with ``config``'s dimensions."""
  return {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
      "intermediate_size": config.intermediate_size,
      "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
      "hidden_act": "silu", "rms_norm_eps": config.rms_norm_eps,
      "rope_theta": config.rope.theta, "rope_scaling": None,
      "max_position_embeddings": config.max_position_embeddings,
      "tie_word_embeddings": config.tie_embeddings, "attention_bias": False,
      "attention_dropout": 0.0, "mlp_bias": False, "initializer_range": 0.02,
      "bos_token_id": task.bos_id, "eos_token_id": None, "pad_token_id": SPECIALS.index(PAD),
      "torch_dtype": "float32", "use_cache": True,
  }


RESIDUAL_INIT = 0.1
SHARED_INIT = 1.0


def init_model(task: RecallTask, spec: RecallModelSpec = RecallModelSpec(), seed: int = 0):
  """A freshly initialized :class:`rkv.models.Transformer`.

  The tied embedding is drawn with std ``hidden**-0.5`` (NNX's default std 1 would start the
  tied logits at std ~sqrt(hidden)), plus one vector shared by every token (``SHARED_INIT`` of
  the per-token scale): without biases, a head can attend by position alone (the
  previous-token head of the induction circuit, via RoPE) only through a component common to all
  tokens' queries and keys, which zero-mean embeddings lack and learn slowly (one row per token
  seen; in a 600-step pilot, token accuracy 0.17 with it against 0.12 without). The
  projections that write into the residual stream (``o_proj``, ``down_proj``) are scaled by
  ``RESIDUAL_INIT``: at NNX's default (LeCun) scale each block adds unit-variance noise, ten
  times the embedding, and the token identities the induction circuit reads drown."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from rkv.models.transformer import Transformer

  cfg = model_config(task, spec)
  model = Transformer(cfg, rngs=nnx.Rngs(seed), impl="reference")
  k_tok, k_shared = jax.random.split(jax.random.key(seed + 1))
  emb = jax.random.normal(k_tok, (cfg.vocab_size, cfg.hidden_size), jnp.float32)
  shared = jax.random.normal(k_shared, (1, cfg.hidden_size), jnp.float32)
  model.embed.embedding[...] = (emb + SHARED_INIT * shared) * cfg.hidden_size ** -0.5
  for layer in model.layers:
    for lin in (layer.attn.o_proj, layer.mlp.down_proj):
      lin.kernel[...] = lin.kernel[...] * RESIDUAL_INIT
  return model


def save_model(path: str, model, task: RecallTask, *, log: dict | None = None):
  """Writes the HF folder: ``config.json``, ``model.safetensors`` (HF names via
  :func:`rkv.models.hf_weight_map`), ``tokenizer.json``, ``recall_task.json`` and, given
  ``log``, ``training_log.json``."""
  from rkv.models import hf

  os.makedirs(path, exist_ok=True)
  cfg = model.config
  tensors = hf.model_tensors(model)
  hf.save_safetensors(os.path.join(path, hf.SINGLE_FILE), tensors, metadata={"format": "pt"})
  with open(os.path.join(path, hf.CONFIG_FILE), "w") as f:
    json.dump(hf_config(cfg, task), f, indent=2, sort_keys=True)
  build_tokenizer(task).save(os.path.join(path, hf.TOKENIZER_FILE))
  with open(os.path.join(path, TASK_FILE), "w") as f:
    json.dump(task.as_dict(), f, indent=2)
  if log is not None:
    with open(os.path.join(path, LOG_FILE), "w") as f:
      json.dump(log, f, indent=2)


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Stage:
  """``steps`` optimizer steps on rows of one of ``lengths`` (drawn per step), the share of rows
  with spread positions ramping linearly from the previous stage's ``jump_prob`` to this one's
  over the stage's first half; ``repeat``: see :func:`training_batch`."""

  steps: int
  lengths: tuple
  jump_prob: float = 0.0
  repeat: float = 0.0  # training_batch(repeat=...): supervised repeats inside the haystack


# Measured on 2 CPU cores: with only the final queries supervised, the 2-layer model sat for
# 800-1600 steps on the plateau of "copy any value in the context" (token accuracy ~13%), at 32
# tokens as at 128+. Supervised repeats inside 32-token rows lift it within a few hundred steps
# (token accuracy 44% after 600). So: form the circuit on short rows with repeats, move to the
# task's own rows (one occurrence per pair, queries at the end), then spread the positions.
DEFAULT_STAGES = (Stage(1500, (32,), repeat=0.5), Stage(700, (64, 128), repeat=0.3),
                  Stage(500, (128, 256)), Stage(1300, (128, 256, 512), jump_prob=0.75))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """:func:`train`'s knobs: the curriculum ``stages``; ``tokens_per_step // length`` rows per
  step (so every step costs about the same); rows of length L hold up to ``num_queries`` queries
  (at most L // 16) and up to ``max_pairs`` pairs (as many as fit); AdamW with linear warm-up and
  cosine decay over all steps."""

  stages: tuple = DEFAULT_STAGES
  tokens_per_step: int = 2048
  lr: float = 3e-3
  warmup: int = 100
  weight_decay: float = 0.01
  clip: float = 1.0
  num_queries: int = 6
  max_pairs: int = 16
  max_span: int = 16384
  adjacent_prob: float = 0.2
  seed: int = 0
  log_every: int = 100
  eval_lengths: tuple = (1024, 2048, 4096, 8192)
  eval_samples: int = 16

  @property
  def steps(self) -> int:
    return sum(st.steps for st in self.stages)

  def row_shape(self, length: int, task: "RecallTask") -> tuple[int, int]:
    """``(num_queries, max_pairs)`` of a training row of ``length`` tokens."""
    q = max(1, min(self.num_queries, length // 16))
    pairs = min(self.max_pairs, (length - q * (1 + task.pair_len)) // task.pair_len)
    if pairs < q:
      raise ValueError(f"TrainConfig: rows of {length} tokens are too short for {q} queries")
    return q, pairs


def answer_logits(model, tokens, positions, last: int, *, impl: str = "reference"):
  """``model(tokens, positions)[:, -last:]`` (float32 ``[B,last,V]``) without the vocabulary
  projection of the other positions: training rows end with their queries, and the tied
  projection of every position is a third of a step's FLOPs on the CPU. Mirrors
  :class:`rkv.models.Transformer` for the Llama family (tests/recall_test.py checks it)."""
  import jax.numpy as jnp
  from rkv.models.transformer import rope_tables

  cfg = model.config
  if cfg.family != "llama" or not cfg.tie_embeddings or cfg.final_softcap is not None:
    raise ValueError("answer_logits: only the tied-embedding Llama recall model is mirrored")
  positions = jnp.asarray(positions, jnp.int32)
  x = model.embed(jnp.asarray(tokens))
  cs = rope_tables(cfg.rope, cfg.head_dim, positions)
  for layer in model.layers:
    x, _ = layer(x, positions, cs, None, impl)
  x = model.final_norm(x[:, -last:])
  return jnp.einsum("bth,vh->btv", x, model.embed.embedding[...],
                    preferred_element_type=jnp.float32)


def _loss_fn(graphdef, last, params, rest, tokens, positions, targets, mask):
  import jax
  import jax.numpy as jnp
  from flax import nnx

  model = nnx.merge(graphdef, params, rest)
  logits = answer_logits(model, tokens, positions, last)
  targets, mask = targets[:, -last:], mask[:, -last:]
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  loss = jnp.sum(nll * mask) / jnp.sum(mask)
  hit = jnp.argmax(logits, axis=-1) == targets
  # A row counts as retrieved when every answer token of all its queries is right.
  acc = jnp.mean(jnp.all(hit | (mask == 0), axis=-1))
  tok_acc = jnp.sum(hit * mask) / jnp.sum(mask)
  return loss, (acc, tok_acc)


def train(task: RecallTask = RecallTask(), spec: RecallModelSpec = RecallModelSpec(),
          cfg: TrainConfig = TrainConfig(), *, out: str | None = None, init: str | None = None,
          log: Callable[[str], None] = print):
  """Trains the recall model with optax; prints ``step, loss, accuracy`` every ``log_every``
  steps, evaluates greedy retrieval at ``eval_lengths`` (:func:`evaluate`), and with ``out``
  saves the HF folder (:func:`save_model`). ``init``: continue from the weights of a saved
  folder (its task must equal ``task``; ``spec`` is then ignored). Returns ``(model, training
  log dict)``."""
  import jax
  import optax
  from flax import nnx

  if init is None:
    model = init_model(task, spec, cfg.seed)
  else:
    model, _, init_task = load_recall_model(init, impl="reference")
    if init_task != task:
      raise ValueError(f"train: init={init!r} was trained on {init_task}, not {task}")
    c = model.config
    spec = RecallModelSpec(num_layers=c.num_layers, hidden_size=c.hidden_size,
                           intermediate_size=c.intermediate_size, num_heads=c.num_heads,
                           num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                           rope_theta=c.rope.theta,
                           max_position_embeddings=c.max_position_embeddings)
    log(f"continuing from {init}")
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  log(f"recall model: {model.config.num_layers} layers, hidden {model.config.hidden_size}, "
      f"H={model.config.num_heads} K={model.config.num_kv_heads} D={model.config.head_dim}, "
      f"vocab {model.config.vocab_size}: {n_params:,} parameters")
  warmup = min(cfg.warmup, cfg.steps // 2)  # short smoke runs still get a decay phase
  sched = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, cfg.steps, cfg.lr * 0.05)
  opt = optax.chain(optax.clip_by_global_norm(cfg.clip),
                    optax.adamw(sched, b1=0.9, b2=0.98, weight_decay=cfg.weight_decay))
  opt_state = opt.init(params)

  @functools.partial(jax.jit, static_argnames=("last",))
  def step(params, opt_state, tokens, positions, targets, mask, last):
    # ``last``: the query region that ends every row (only its logits are computed).
    (loss, aux), grads = jax.value_and_grad(
        functools.partial(_loss_fn, graphdef, last), has_aux=True)(params, rest, tokens,
                                                                   positions, targets, mask)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, aux

  rng = np.random.default_rng(cfg.seed)
  history, t0, window, i, prev_jump = [], time.perf_counter(), [], 0, 0.0
  for k, stage in enumerate(cfg.stages):
    log(f"stage {k}: {stage.steps} steps, lengths {stage.lengths}, spread rows -> "
        f"{stage.jump_prob:g}, repeats {stage.repeat:g}")
    for j in range(stage.steps):
      i += 1
      length = int(rng.choice(stage.lengths))
      ramp = min(2.0 * j / stage.steps, 1.0)
      jump = prev_jump + (stage.jump_prob - prev_jump) * ramp
      nq, pairs = cfg.row_shape(length, task)
      b = training_batch(rng, max(cfg.tokens_per_step // length, 1), length, task,
                         num_queries=nq, max_pairs=pairs, max_span=cfg.max_span, jump_prob=jump,
                         repeat=stage.repeat, adjacent_prob=cfg.adjacent_prob)
      params, opt_state, loss, (acc, tok_acc) = step(
          params, opt_state, b.tokens, b.positions, b.targets, b.mask,
          last=length if stage.repeat else nq * (1 + task.pair_len))
      window.append((float(loss), float(acc), float(tok_acc)))
      if i % cfg.log_every == 0 or i == cfg.steps:
        l, a, ta = (float(np.mean(x)) for x in zip(*window))
        window = []
        el = time.perf_counter() - t0
        history.append(dict(step=i, stage=k, loss=l, accuracy=a, token_accuracy=ta,
                            seconds=el))
        log(f"step {i:5d}  loss {l:.4f}  row acc {a:.3f}  token acc {ta:.3f}  "
            f"lr {float(sched(i)):.2e}  spread {jump:.2f}  {el:.0f}s")
    prev_jump = stage.jump_prob
  train_s = time.perf_counter() - t0
  model = nnx.merge(graphdef, params, rest)
  model.impl = "auto"
  evals = {}
  for length in cfg.eval_lengths:
    acc = evaluate(model, task, length, cfg.eval_samples, seed=cfg.seed + 1)
    evals[str(length)] = acc
    log(f"eval: context {length}: greedy retrieval accuracy {acc:.3f} "
        f"({cfg.eval_samples} prompts, random depths)")
  record = dict(task=task.as_dict(), model=dataclasses.asdict(spec),
                train=dataclasses.asdict(cfg), command=" ".join(sys.argv), init=init,
                parameters=n_params, train_seconds=train_s,
                final_loss=history[-1]["loss"] if history else None,
                eval_accuracy=evals, history=history)
  if out:
    save_model(out, model, task, log=record)
    log(f"saved {out}")
  return model, record


def evaluate(model, task: RecallTask, context_len: int, samples: int, *, seed: int = 0,
             batch: int = 4, impl: str = "xla") -> float:
  """Greedy retrieval accuracy at ``context_len`` over ``samples`` prompts at uniform random
  depths, from one teacher-forced full forward per batch (no cache): every answer token is the
  argmax iff greedy decoding emits the whole answer, so this equals the greedy exact match."""
  rng = np.random.default_rng([seed, context_len])
  right = 0
  for lo in range(0, samples, batch):
    n = min(batch, samples - lo)
    hs = [haystack(rng, context_len, float(rng.random()), task) for _ in range(n)]
    seq = np.stack([np.concatenate([h.tokens, h.answer[:-1]]) for h in hs])
    ans = np.stack([h.answer for h in hs])
    logits = model(seq, impl=impl)
    pred = np.asarray(logits[:, -task.value_len:].argmax(-1))
    right += int(np.all(pred == ans, axis=-1).sum())
  return right / samples


