"""Ragged and continuous batches over a :class:`rkv.pool.Pool`: a small scheduler.

::

    pool = rkv.pool.Pool(model.config, device_rows=..., host_pages=..., page_cells=...)
    sched = rkv.serving.Scheduler(model, pool, max_batch=8, chunk=512)
    a = sched.add(rkv.serving.Request(prompt_a, max_new_tokens=64))
    b = sched.add(rkv.serving.Request(prompt_b, max_new_tokens=16, temperature=0.7, seed=1))
    while not sched.done:
      for event in sched.step():   # Event(seq, token, finished, reason)
        ...
    sched.collect()                # {seq: Finished(tokens, reason, logits)}

Each step feeds every running sequence: the next prompt chunk (up to ``chunk`` tokens) of one
still prefilling, its last token to one decoding (chunked prefill beside decode in one batch,
rows of different lengths left-padded). A request joins at the next step when the batch has room
(``max_batch``) and the pool can hold it beside the others at their final lengths (the planner's
windows and the host pages), and leaves the step it finishes (a stop token or
``max_new_tokens``). With
``share_prefix`` a request starts from the live sequence sharing its longest prefix (its rows are
shared, only the rest is prefilled); ``keep=True`` keeps a finished sequence's rows in the pool
(the conversation cache: the next turn, whose prompt starts with this turn's tokens, prefills only
its new tokens) until :meth:`Scheduler.release`.

Sampling is :func:`rkv.generate.generate`'s: greedy at temperature 0, else top-k / nucleus with
the request's seed folded with the token index, so a sequence samples what its own
single-sequence ``generate`` samples from the same logits.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from rkv import generate as gen
from rkv import planner
from rkv import validation
from rkv.models.transformer import layered_forward
from rkv.pool import Pool


@dataclasses.dataclass(frozen=True)
class Request:
  """One generation: ``prompt`` token ids, up to ``max_new_tokens``; sampling as
  :func:`rkv.generate.generate`'s (``temperature`` 0: greedy); ``stop_tokens`` end it (the stop
  token is emitted); ``keep``: keep its rows after it finishes (conversation cache);
  ``share_prefix``: start from the live sequence sharing the longest prefix."""

  prompt: tuple
  max_new_tokens: int
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0
  seed: int = 0
  stop_tokens: tuple = ()
  keep: bool = False
  share_prefix: bool = True

  def __post_init__(self):
    where = "Request"
    object.__setattr__(self, "prompt", tuple(int(x) for x in self.prompt))
    object.__setattr__(self, "stop_tokens", tuple(int(x) for x in self.stop_tokens))
    if not self.prompt:
      raise ValueError(f"{where}: prompt must hold at least one token")
    if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
      raise ValueError(f"{where}: max_new_tokens must be an int >= 1, got "
                       f"{self.max_new_tokens!r}")
    if not np.isfinite(self.temperature) or self.temperature < 0:
      raise ValueError(f"{where}: temperature must be >= 0 (0 = greedy), got "
                       f"{self.temperature!r}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"{where}: top_p must be in (0, 1], got {self.top_p!r}")
    if not isinstance(self.top_k, int) or self.top_k < 0:
      raise ValueError(f"{where}: top_k must be an int >= 0, got {self.top_k!r}")


@dataclasses.dataclass(frozen=True)
class Event:
  """A step's news for sequence ``seq``: the ``token`` it emitted; ``finished`` with ``reason``
  (``"stop_token"`` or ``"max_new_tokens"``) when it was its last."""

  seq: int
  token: int
  finished: bool = False
  reason: str | None = None


@dataclasses.dataclass(frozen=True)
class Finished:
  """A finished request: the ``tokens`` it generated, why it ended, the ``shared`` prompt tokens
  it did not prefill, and (``record_logits``) the float32 logits ``[N,V]`` each token was
  chosen from."""

  tokens: tuple
  reason: str
  shared: int = 0
  logits: np.ndarray | None = None


@dataclasses.dataclass
class _Running:
  request: Request
  todo: list  # prompt tokens still to feed
  generated: list
  shared: int
  logits: list


class Scheduler:
  """Continuous batching over ``pool`` (module docstring). ``model``: a
  :class:`rkv.models.Transformer`; ``max_batch``: sequences per step; ``chunk``: prompt tokens a
  prefilling sequence is fed per step; ``record_logits``: keep each sequence's logits."""

  def __init__(self, model, pool: Pool, *, max_batch: int = 8, chunk: int = gen.DEFAULT_CHUNK,
               record_logits: bool = False, forward=None):
    where = "Scheduler"
    if not isinstance(pool, Pool):
      raise ValueError(f"{where}: pool must be a rkv.pool.Pool, got {type(pool).__name__}")
    if pool.config.num_layers != model.config.num_layers:
      raise ValueError(f"{where}: the pool has {pool.config.num_layers} layers, the model "
                       f"{model.config.num_layers}")
    for name, x in (("max_batch", max_batch), ("chunk", chunk)):
      if not isinstance(x, int) or isinstance(x, bool) or x < 1:
        raise ValueError(f"{where}: {name} must be a positive int, got {x!r}")
    self.model, self.pool = model, pool
    self.max_batch, self.chunk, self.record_logits = max_batch, chunk, record_logits
    self._forward = forward if forward is not None else layered_forward(model, last_only=True)
    self._waiting: collections.deque = collections.deque()
    self._running: dict[int, _Running] = {}
    self._finished: dict[int, Finished] = {}
    self._tickets = 0
    self._ticket_seq: dict[int, int] = {}
    self.steps = 0

  # --- the API ---
  def add(self, request: Request) -> int:
    """Queues ``request``; returns its id (the pool sequence id once it joins a step)."""
    if not isinstance(request, Request):
      raise ValueError(f"Scheduler.add: request must be a rkv.serving.Request, got "
                       f"{type(request).__name__}")
    validation.check_token_ids("Scheduler.add", "prompt", np.asarray(request.prompt),
                               self.model.config.vocab_size)
    ticket = self._tickets
    self._tickets += 1
    self._waiting.append((ticket, request))
    return ticket

  @property
  def done(self) -> bool:
    return not self._waiting and not self._running

  def seq_of(self, ticket: int) -> int | None:
    """The pool sequence of request ``ticket`` (None until it joined a step)."""
    return self._ticket_seq.get(ticket)

  def finished(self) -> dict[int, Finished]:
    """Finished requests by id (kept until :meth:`collect`)."""
    return dict(self._finished)

  def collect(self) -> dict[int, Finished]:
    """Finished requests by id, removed from the scheduler."""
    out, self._finished = self._finished, {}
    return out

  def release(self, ticket: int) -> None:
    """Drops a kept (finished) request's rows from the pool."""
    seq = self._ticket_seq.get(ticket)
    if seq is None or seq not in self.pool.seqs or ticket in self._running:
      raise ValueError(f"Scheduler.release: request {ticket} holds no kept rows")
    self.pool.release(seq)

  def run(self) -> dict[int, Finished]:
    """Steps until every request finished; returns :meth:`collect`."""
    while not self.done:
      self.step()
    return self.collect()

  def step(self) -> list[Event]:
    """One model step over every running sequence (joining the waiting ones first)."""
    self._admit()
    if not self._running:
      return []
    feeds, rows = [], []
    for ticket, run in self._running.items():
      seq = self._ticket_seq[ticket]
      if run.todo:
        toks, run.todo = run.todo[:self.chunk], run.todo[self.chunk:]
      else:
        toks = [run.generated[-1]]
      feeds.append((seq, toks))
      rows.append((ticket, run, not run.todo))
    needs = {self._ticket_seq[t]: len(r.request.prompt) + r.request.max_new_tokens
             for t, r in self._running.items()}
    tokens, positions, caches = self.pool.prepare(feeds, needs=needs)
    try:
      logits, caches = self._forward(tokens, positions, caches)
    except BaseException:
      self.pool.abort()
      raise
    self.pool.commit(caches)
    self.steps += 1
    emit = [i for i, (_, _, ready) in enumerate(rows) if ready]
    events = []
    if not emit:
      return events
    last = logits[:, -1]
    picked = {}
    greedy = [i for i in emit if rows[i][1].request.temperature == 0]
    if greedy:
      g = np.asarray(gen.greedy(last))
      picked.update({i: int(g[i]) for i in greedy})
    for i in emit:
      req = rows[i][1].request
      if req.temperature != 0:
        run = rows[i][1]
        key = jax.random.fold_in(jax.random.key(req.seed), len(run.generated))
        picked[i] = int(np.asarray(gen.sample(
            last[i:i + 1], key, jnp.float32(req.temperature), jnp.float32(req.top_p),
            jnp.int32(req.top_k)))[0])
    host_logits = np.asarray(last) if self.record_logits else None
    for i in emit:
      ticket, run, _ = rows[i]
      tok = picked[i]
      run.generated.append(tok)
      if host_logits is not None:
        run.logits.append(host_logits[i].copy())
      reason = None
      if tok in run.request.stop_tokens:
        reason = "stop_token"
      elif len(run.generated) >= run.request.max_new_tokens:
        reason = "max_new_tokens"
      events.append(Event(seq=ticket, token=tok, finished=reason is not None, reason=reason))
      if reason is not None:
        self._finish(ticket, run, reason)
    return events

  # --- internals ---
  def _fits(self, req: Request) -> bool:
    """Whether the pool can hold the running sequences, the kept ones and ``req`` at their
    final lengths (the planner's windows, and host pages for what they leave off the device:
    shared cells counted for each sharer, so the estimate errs on the safe side)."""
    pool = self.pool
    needs, feeds = [], []
    running = {self._ticket_seq[t]: r for t, r in self._running.items()}
    for sid in pool.seqs:
      r = running.get(sid)
      needs.append(len(r.request.prompt) + r.request.max_new_tokens if r else pool.length(sid))
      feeds.append(self.chunk if r else 0)
    needs.append(len(req.prompt) + req.max_new_tokens)
    feeds.append(min(self.chunk, len(req.prompt)))
    if pool.tactic == "resident":
      return sum(needs) + sum(feeds) <= pool.device_rows
    try:
      wins = planner.pool_windows(needs, pool.device_rows, pool.page_cells, feeds)
    except ValueError:
      return False
    pages = sum(max(n - w, 0) // pool.page_cells for n, w in zip(needs, wins))
    return pages <= pool.host_pages

  def _admit(self) -> None:
    while self._waiting and len(self._running) < self.max_batch:
      ticket, req = self._waiting[0]
      if not self._fits(req):
        if not self._running:
          raise ValueError(
              f"Scheduler: request {ticket} ({len(req.prompt)} prompt + {req.max_new_tokens} new "
              f"tokens) does not fit the pool ({self.pool}) even with nothing else running"
              f"{' but kept conversations (release some)' if self.pool.seqs else ''}: give the "
              f"pool more device_rows or host_pages")
        return  # it joins when running sequences leave
      self._waiting.popleft()
      shared, src = 0, None
      if req.share_prefix:
        src, n = self.pool.find_prefix(req.prompt)
        # At least the last prompt token is fed: its logits choose the first new token.
        shared = min(n, len(req.prompt) - 1)
      seq = self.pool.fork(src, shared) if src is not None and shared else self.pool.add()
      self._ticket_seq[ticket] = seq
      self._running[ticket] = _Running(request=req, todo=list(req.prompt[shared:]),
                                       generated=[], shared=shared, logits=[])

  def _finish(self, ticket: int, run: _Running, reason: str) -> None:
    del self._running[ticket]
    seq = self._ticket_seq[ticket]
    if not run.request.keep:
      self.pool.release(seq)
    logits = np.stack(run.logits) if run.logits else None
    self._finished[ticket] = Finished(tokens=tuple(run.generated), reason=reason,
                                      shared=run.shared, logits=logits)
