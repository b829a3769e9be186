"""Chunked prefill and the decode loop over per-layer caches built from a residency plan.

- :func:`caches_from_plan` turns a :class:`rkv.Plan` into one cache per layer, serving every
  planned tactic: ``resident`` layers get a :class:`rkv.models.ResidentCache` (a
  :class:`rkv.models.RingCache` for a sliding-window layer), ``stream`` layers a
  :class:`rkv.RollingKV` with the plan's W and tile, ``cpu`` / ``hybrid`` layers the same cache
  with the tactic as its static data (``RollingKV.with_tactic``; ``hybrid``: with the plan's CPU
  share of the tail, :func:`cpu_fraction`), ``head`` layers a :class:`rkv.HeadSplitKV` with the
  plan's ``resident_heads``.
- :func:`force_tactic` (and :func:`force_stream`) overrides a plan's layout for gates and tests.
- :func:`prefill` feeds the prompt in chunks (a textual progress line on stderr for long prompts).
- :func:`generate` samples: greedy (``temperature=0``), temperature, top-k, nucleus (``top_p``);
  it stops early on ``stop_tokens`` and streams each step's tokens to ``on_token``
  (:func:`rkv.text.generate_text` builds text in, text out on it).
- :func:`decode_logits` is the teacher-forced run the logit gates compare (:mod:`rkv.gates`);
  :func:`sequence_logits` the logits at every position, chunk by chunk (perplexity).

Compilation: when every cache is resident or a ring, the model runs through
:func:`rkv.models.jit_forward`: the fill level is data, so the decode step ``[B,1]`` traces once
and each prefill chunk shape once. A :class:`rkv.RollingKV` has a *static* fill (its window /
staging / tail split is structure), so a jitted step would retrace every token; with any such
layer (a cache whose ``jittable`` is False: a RollingKV, or a HeadSplitKV of them) the model
runs through
:func:`rkv.models.layered_forward`: each such layer is a jitted half before attention, the
cache's eager attention (``rkv.rolling_attention``'s streaming schedule, or the ``cpu`` /
``hybrid`` host kernel, which only exist outside ``jit``), and a jitted half after it; resident
and ring layers run as one jitted block. No step reads a device value back except the host
kernel's query, so the Python thread dispatches ahead of the device (what layering bought on the
H200: docs/DESIGN.md §7, "decode, op-by-op eager model vs layered_forward").

Batches are unpadded: every row has the same prompt length (positions ``0..T-1``).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from rkv import planner
from rkv import tactics
from rkv import validation
from rkv.cache import RollingKV
from rkv.head_split import HeadSplitKV, check_heads
from rkv.models.kv import ROLLING_TACTICS, LayerCache, ResidentCache, RingCache
from rkv.models.transformer import jit_forward, layered_forward
from rkv.planner import LayerPlan, Plan
from rkv.rolling import DEFAULT_CPU_FRACTION

DEFAULT_CHUNK = 512
# Prompts at least this long print a progress line every PROGRESS_EVERY chunks.
PROGRESS_MIN_TOKENS = 8192
PROGRESS_EVERY = 8
# Every tactic the planner names (rkv.planner.TACTICS) is served by caches_from_plan.
SUPPORTED_TACTICS = tactics.TACTICS
FORCED_TACTICS = tactics.OFFLOADED  # what force_tactic can impose


# ----------------------------------------------------------------------------------------------
# Caches from a plan
# ----------------------------------------------------------------------------------------------
def cpu_fraction(lp: LayerPlan) -> float | None:
  """The share of the tail's full tiles a ``hybrid`` layer attends on the CPU — what
  ``rkv.rolling_attention(cpu_fraction=...)`` takes; None for every other tactic.

  The plan stores it as ``lp.cpu_fraction`` (:func:`rkv.planner.cpu_share` of the model's
  streamed share in whole tiles; rolling_attention rounds ``cpu_fraction * n`` half up, which
  gives back the planned tiles at full fill). A hybrid layer planned without a CPU figure has no
  modeled split (``cpu_fraction`` None; the planner warns): it gets an even split,
  ``DEFAULT_CPU_FRACTION``.
  """
  if lp.tactic != "hybrid":
    return None
  return DEFAULT_CPU_FRACTION if lp.cpu_fraction is None else lp.cpu_fraction


def serve_rolling(lp: LayerPlan, kv: RollingKV) -> RollingKV:
  """``kv``, built for layer plan ``lp`` (tactic ``stream``, ``cpu`` or ``hybrid``), carrying the
  plan's tactic (and the hybrid's :func:`cpu_fraction`) as its static data."""
  if lp.tactic not in ROLLING_TACTICS:
    raise ValueError(f"serve_rolling: layer {lp.layer}'s tactic {lp.tactic!r} is not served by a "
                     f"RollingKV (expected one of {ROLLING_TACTICS})")
  return kv.with_tactic(lp.tactic, cpu_fraction(lp))


def caches_from_plan(config, plan: Plan, batch: int, capacity: int | None = None,
                     dtype=None) -> tuple:
  """One empty cache per layer as ``plan`` places it (module docstring: which type per tactic).

  ``capacity``: cells of each global layer's cache (default ``plan.context_len``); it must hold
  the prompt plus the generated tokens. ``dtype``: the KV dtype (default ``config.dtype``).
  Local layers get a ring of their window (:class:`RingCache`), or a resident cache of
  ``capacity`` cells when the context is shorter than the window.
  """
  where = "caches_from_plan"
  if not isinstance(plan, Plan):
    raise ValueError(f"{where}: plan must be a rkv.Plan, got {type(plan).__name__}")
  if len(plan.layers) != config.num_layers:
    raise ValueError(f"{where}: plan has {len(plan.layers)} layers, config has "
                     f"{config.num_layers}")
  if not isinstance(batch, (int, np.integer)) or batch < 1:
    raise ValueError(f"{where}: batch must be a positive int, got {batch!r}")
  capacity = plan.context_len if capacity is None else capacity
  if not isinstance(capacity, (int, np.integer)) or capacity < 1:
    raise ValueError(f"{where}: capacity must be a positive int, got {capacity!r}")
  dtype = config.dtype if dtype is None else dtype
  kh, d = config.num_kv_heads, config.head_dim
  out = []
  for i, lp in enumerate(plan.layers):
    w = config.layer_windows[i]
    if lp.tactic == "resident":
      if w is not None and w < capacity:
        out.append(RingCache.empty(batch, w, kh, d, dtype))
      else:
        out.append(ResidentCache.empty(batch, capacity, kh, d, dtype))
      continue
    if lp.tactic in tactics.APPROXIMATE:  # opt-in block-sparse layers (rkv.sparse.sparse_plan)
      from rkv.sparse import plan as sparse_plan
      out.append(sparse_plan.block_cache_for(lp, batch=batch, capacity=capacity, num_kv_heads=kh,
                                             head_dim=d, dtype=dtype))
      continue
    if lp.tactic not in SUPPORTED_TACTICS:
      raise ValueError(f"{where}: layer {i}'s tactic {lp.tactic!r} is unknown (supported: "
                       f"{SUPPORTED_TACTICS})")
    r = None
    if lp.tactic == "head":
      if lp.resident_heads is None:
        raise ValueError(f"{where}: layer {i} has tactic 'head' but no resident_heads")
      r = check_heads(lp.resident_heads, kh, f"{where}: layer {i}")
    if r != kh and lp.window_cells >= capacity:
      raise ValueError(f"{where}: capacity={capacity} must exceed layer {i}'s window "
                       f"W={lp.window_cells} for a host tail (plan for a longer context_len or "
                       f"pass a larger capacity)")
    if lp.tactic == "head":
      out.append(HeadSplitKV.empty(batch, capacity, kh, d, resident_heads=r,
                                   window_cells=lp.window_cells, dtype=dtype,
                                   tile_cells=lp.tile_cells))
    else:
      out.append(serve_rolling(lp, RollingKV.empty(batch, capacity, kh, d,
                                                   window_cells=lp.window_cells, dtype=dtype,
                                                   tile_cells=lp.tile_cells)))
  return tuple(out)


# Cells of warm_up's tiny caches: window and tile, a multiple of the planner's WINDOW_ALIGN.
WARM_CELLS = 256


def warm_up(model, *, batch: int = 1, lengths=(1,), kv_dtype=None, schedule=None) -> float:
  """Compiles the dense programs of :func:`rkv.models.layered_forward` (the embedding, each
  block's halves around attention, the final norm and logits) for ``[batch, T]`` tokens at each
  ``T`` of ``lengths``, on tiny rolling caches; returns the seconds it took.

  Call it before a plan's caches take the device. XLA autotunes a GEMM as it compiles it and
  allocates scratch to do so: on the H200 at 1M tokens, compiling the logits program after the
  fill failed with RESOURCE_EXHAUSTED allocating 1018 MiB, the size of Llama-3-8B's [4096, 128256]
  logits weight plus two 8 MiB redzones (so, most likely, the autotuner's copy of that operand),
  more than a default-budget plan leaves free once its caches exist. The reserve's workspace term
  covers the blocks' GEMMs (240 MiB at most there), not this one. The programs are cached by the model's
  structure and the token shape, so the planned run reuses them; the logits program sees one
  position whatever the chunk (``layered_forward`` slices it with ``last_only``), so the default
  ``lengths=(1,)`` warms it for prefill and decode. A plan whose caches are all resident runs
  :func:`rkv.models.jit_forward` instead, which this does not compile."""
  where = "warm_up"
  _check_count(where, "batch", batch, 1)
  lengths = tuple(lengths)
  if not lengths:
    raise ValueError(f"{where}: lengths must name at least one token count")
  for t in lengths:
    _check_count(where, "lengths", t, 1)
  config = model.config
  t0 = time.perf_counter()
  cap = max(lengths) + 4 * WARM_CELLS
  res = planner.ResidencyConfig(vram_target_mib=1 << 20, check_free=False,
                                **({} if kv_dtype is None else {"kv_dtype": kv_dtype}))
  import warnings
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the profile's device is not this one's: no matter here
    plan = force_tactic(planner.plan(config, cap, batch, residency=res), "stream",
                        max(lengths) + WARM_CELLS, WARM_CELLS)
  step = layered_forward(model, last_only=True, schedule=schedule)
  for t in lengths:
    caches = caches_from_plan(config, plan, batch, cap,
                              None if kv_dtype is None else jnp.dtype(kv_dtype))
    logits, caches = step(jnp.zeros((batch, t), jnp.int32), _positions(batch, 0, t), caches)
    jax.block_until_ready(logits)
    del caches
  return time.perf_counter() - t0


def _check_count(where, name, val, lo):
  if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or val < lo:
    want = "a positive" if lo > 0 else "a non-negative"
    raise ValueError(f"{where}: {name} must be {want} int, got {val!r}")


def force_tactic(plan: Plan, tactic: str, window_cells: int, tile_cells: int, *,
                 cpu_fraction: float = DEFAULT_CPU_FRACTION, resident_heads: int = 1,
                 local: bool = False) -> Plan:
  """``plan`` with every global layer (and every local one with ``local``) set to ``tactic``
  (one of ``FORCED_TACTICS``) with ``W = window_cells`` and ``tile = tile_cells``, whatever the
  budget.

  For gates and tests: it puts most of a short context in the host tail with tiles smaller than
  the planner's WINDOW_ALIGN (the planner never plans a tail for a context that fits).
  ``cpu_fraction`` (``hybrid`` only): the share of the tail's tiles attended on the CPU, stored as
  the plan's ``cpu_fraction``.
  ``resident_heads`` (``head`` only): R in ``[0, K]`` KV heads kept whole on the device, W and
  the tile then describe the other heads. Byte fields are recomputed with the planner's own
  arithmetic (K/V, scales and positions, :func:`rkv.planner.layer_layout`); the modeled ``times``
  are left as planned (a forced layout is not the planner's choice).
  """
  where = "force_tactic"
  if tactic not in FORCED_TACTICS:
    raise ValueError(f"{where}: tactic must be one of {FORCED_TACTICS}, got {tactic!r}")
  if not isinstance(plan, Plan):
    raise ValueError(f"{where}: plan must be a rkv.Plan, got {type(plan).__name__}")
  _check_count(where, "window_cells", window_cells, 0)
  _check_count(where, "tile_cells", tile_cells, 1)
  cap = plan.context_len
  if window_cells >= cap:
    raise ValueError(f"{where}: window_cells={window_cells} must be < plan.context_len={cap}")
  s = plan.shape
  r, share = None, None
  if tactic == "head":
    r = check_heads(resident_heads, s.num_kv_heads, where)
  if tactic == "hybrid":  # the same check as rolling_attention's
    share = tactics.check_cpu_fraction(cpu_fraction, tactic, where)
  lay = planner.layer_layout(planner.cell_sizes(s, plan.batch), cap, window_cells, tile_cells,
                             r or 0)
  layers = []
  for lp in plan.layers:
    if lp.kind == "global" or local:
      lp = dataclasses.replace(
          lp, tactic=tactic, capacity=cap, window_cells=window_cells,
          tail_cells=cap - window_cells, tile_cells=tile_cells, host_cells=lay.host_cells,
          resident_heads=r, device_bytes=lay.device_bytes, host_bytes=lay.host_bytes,
          cpu_fraction=share)
    layers.append(lp)
  return dataclasses.replace(plan, layers=tuple(layers))


def force_stream(plan: Plan, window_cells: int, tile_cells: int, *, local: bool = False) -> Plan:
  """:func:`force_tactic` with the ``stream`` tactic."""
  return force_tactic(plan, "stream", window_cells, tile_cells, local=local)


# ----------------------------------------------------------------------------------------------
# Running the model
# ----------------------------------------------------------------------------------------------
def _all_jittable(caches) -> bool:
  return all(c.jittable for c in caches)


def _cache_room(caches) -> tuple[int | None, int]:
  """(cells the tightest bounded cache can still take — None if all are rings, fill)."""
  room, fill = None, 0
  for c in caches:
    r = c.room
    if r is None:  # a ring never fills
      continue
    fill = max(fill, int(c.next_position()))
    room = r if room is None else min(room, r)
  return room, fill


def _check_caches(where, model, caches):
  caches = tuple(caches)
  if len(caches) != model.config.num_layers:
    raise ValueError(f"{where}: caches must hold one cache per layer ({model.config.num_layers}),"
                     f" got {len(caches)}")
  # Caches are donated by every step: ones an earlier call consumed are refused up front.
  for i, c in enumerate(caches):
    validation.check_live(where, f"caches[{i}]", c)
  for i, c in enumerate(caches):
    if not isinstance(c, LayerCache):
      raise ValueError(f"caches: unsupported cache type {type(c).__name__} (layer {i}): a cache "
                       f"implements rkv.models.kv.LayerCache")
  return caches


def _check_tokens(where, name, tokens, vocab_size, min_len=1):
  validation.check_token_ids(where, name, tokens, vocab_size)  # -1 would act as id V-1
  tokens = np.asarray(tokens)
  if tokens.ndim == 1:
    tokens = tokens[None]
  if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"{where}: {name} must be int tokens [B,T] (or [T]), got {tokens.dtype} "
                     f"{tuple(tokens.shape)}")
  if tokens.shape[0] < 1 or tokens.shape[1] < min_len:
    raise ValueError(f"{where}: {name} must hold at least {min_len} token(s) per row, got shape "
                     f"{tuple(tokens.shape)}")
  return tokens.astype(np.int32)


def _check_chunk(where, chunk):
  if not isinstance(chunk, (int, np.integer)) or chunk < 1:
    raise ValueError(f"{where}: chunk must be a positive int, got {chunk!r}")


class Stepper:
  """Runs one model step on ``(tokens [B,T], positions [B,T], caches)`` -> ``([B,1,V], caches)``:
  the jitted form when every cache is ``jittable``, else :func:`rkv.models.layered_forward`
  (layers whose cache is not — a RollingKV or a HeadSplitKV — attend eagerly between jitted
  halves). ``schedule``: the rolling caches' streaming schedule (None: the default). Public for
  the lab's benchmarks, which time the same step generation runs."""

  def __init__(self, model, caches, forward=None, schedule=None):
    self.jitted = _all_jittable(caches)
    if self.jitted:
      self.fn = forward if forward is not None else jit_forward(model, last_only=True)
    else:
      self.fn = layered_forward(model, last_only=True, schedule=schedule)

  def __call__(self, tokens, positions, caches):
    return self.fn(jnp.asarray(tokens), jnp.asarray(positions), caches)

  def decode(self, tokens, positions, caches, pick, pick_args=()):
    """One decode step on device values: ``(tokens [B,1], positions [B,1], caches)`` ->
    ``(next tokens [B,1] int32, positions + 1, caches)``, the next tokens ``pick(logits [B,V],
    *pick_args)`` (:func:`greedy_pick`, :func:`sample_pick`). Nothing is read back, so a loop can
    dispatch step ``i+1`` before step ``i`` has run. Jitted: one program (``jit_forward``'s
    ``decode_step``, which also consumes the ``tokens`` and ``positions`` passed in: feed it the
    last step's outputs and keep ``jnp.copy`` of the tokens you need); layered: the layers'
    programs, then one program for the pick."""
    decode_step = getattr(self.fn, "decode_step", None) if self.jitted else None
    if decode_step is not None:
      return decode_step(tokens, positions, caches, pick, pick_args)
    logits, caches = self(tokens, positions, caches)
    tok, positions = _pick_next(logits, positions, tuple(pick_args), pick=pick)
    return tok, positions, caches


def _positions(b, start, t):
  return np.broadcast_to(np.arange(start, start + t, dtype=np.int32), (b, t))


def _progress(done, total, elapsed, file):
  width = 30
  frac = done / total
  bar = "#" * int(round(frac * width))
  rate = done / elapsed if elapsed > 0 else float("inf")
  print(f"prefill [{bar:<{width}}] {done}/{total} tokens {100 * frac:5.1f}% "
        f"{rate:,.0f} tok/s", file=file, flush=True)


def _prefill(step, tokens, caches, start, *, chunk, progress, progress_every):
  b, t = tokens.shape
  report = progress if callable(progress) else None
  show = report is None and ((t >= PROGRESS_MIN_TOKENS) if progress is None else bool(progress))
  t0 = time.perf_counter()
  logits = None
  n_chunks = -(-t // chunk)
  for j in range(n_chunks):
    lo, hi = j * chunk, min(t, (j + 1) * chunk)
    logits, caches = step(tokens[:, lo:hi], _positions(b, start + lo, hi - lo), caches)
    if show and ((j + 1) % progress_every == 0 or j + 1 == n_chunks):
      jax.block_until_ready(logits)
      _progress(hi, t, time.perf_counter() - t0, sys.stderr)
    elif report is not None:
      jax.block_until_ready(logits)
      report(hi, t)
  return logits, caches


def prefill(model, tokens, caches, *, chunk: int = DEFAULT_CHUNK, progress: bool | None = None,
            progress_every: int = PROGRESS_EVERY, forward=None):
  """Feeds ``tokens [B,T]`` in chunks of ``chunk``; returns ``(logits [B,V] of the last
  position, caches)``. ``progress``: print ``prefill [###...] n/T tokens ... tok/s`` to stderr
  every ``progress_every`` chunks (None: when ``T >= PROGRESS_MIN_TOKENS``); a callable instead
  is called as ``progress(done_tokens, T)`` after every chunk (e.g. a tqdm bar's update).
  ``forward``: a :func:`rkv.models.jit_forward` (``last_only=True``) to reuse across calls
  (all-resident caches only). The caches passed in are donated: use the returned ones."""
  where = "prefill"
  tokens = _check_tokens(where, "tokens", tokens, model.config.vocab_size)
  caches = _check_caches(where, model, caches)
  _check_chunk(where, chunk)
  room, fill = _cache_room(caches)
  if room is not None and tokens.shape[1] > room:
    raise ValueError(f"{where}: caches have room for {room} more cells, tokens has "
                     f"{tokens.shape[1]}: build caches with a larger capacity")
  step = Stepper(model, caches, forward)
  logits, caches = _prefill(step, tokens, caches, fill, chunk=chunk, progress=progress,
                            progress_every=progress_every)
  return logits[:, -1], caches


# ----------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------
def greedy_pick(logits):
  """``logits [B,V]`` -> the argmax ``[B]`` int32 (a pick for :meth:`Stepper.decode`)."""
  return jnp.argmax(logits, axis=-1).astype(jnp.int32)


_greedy = jax.jit(greedy_pick)


@jax.jit
def _sample(logits, key, temperature, top_p, top_k):
  """Top-k and nucleus sampling of ``logits [B,V]``: keep the ``top_k`` most probable tokens
  (``top_k=0``: all), of those the ones whose probability mass before them is < top_p (the top
  token always), renormalise, sample at ``temperature`` (the filters as transformers orders them:
  top-k, then top-p over the tokens top-k kept)."""
  x = logits.astype(jnp.float32) / temperature
  order = jnp.argsort(-x, axis=-1)
  xs = jnp.take_along_axis(x, order, axis=-1)
  rank = jnp.arange(xs.shape[-1])
  xs = jnp.where((top_k <= 0) | (rank < top_k), xs, -jnp.inf)
  probs = jax.nn.softmax(xs, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs
  xs = jnp.where(before < top_p, xs, -jnp.inf)
  choice = jax.random.categorical(key, xs, axis=-1)
  return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


@functools.partial(jax.jit, donate_argnums=0)
def _next_index(i):
  """``i + 1`` in ``i``'s own buffer (the sampling step index of :func:`generate`)."""
  return i + 1


def sample_pick(logits, key, i, temperature, top_p, top_k):
  """:func:`sample` of step ``i`` (the key folded with ``i``): a pick for :meth:`Stepper.decode`
  with ``pick_args = (key, i, temperature, top_p, top_k)``."""
  return _sample(logits, jax.random.fold_in(key, i), temperature, top_p, top_k)


@functools.partial(jax.jit, static_argnames=("pick",))
def _pick_next(logits, positions, pick_args, *, pick):
  """The layered step's pick: ``logits [B,1,V]`` -> (next tokens [B,1], positions + 1)."""
  return pick(logits[:, -1], *pick_args)[:, None], positions + 1


# The samplers, public for the other decode loops (rkv.serving samples per sequence with them).
greedy = _greedy
sample = _sample


@dataclasses.dataclass(frozen=True)
class Generation:
  """``tokens [B, N]`` int32 (the prompt excluded; ``N = max_new_tokens`` unless the run stopped
  early: every row emitted one of ``stop_tokens``, or ``on_token`` asked to stop); seconds and
  tokens/s of the prefill and of the decode steps (decode: the tokens after the first, which
  prefill yields); ``jitted``: whether the steps ran through jit (False: some layer holds a
  RollingKV, plain or in a HeadSplitKV). ``lengths [B]``: each row's tokens up to and
  including its first stop token (``N`` for a row that never stopped); ``stopped``: why the run
  ended early (``"stop_tokens"``, ``"on_token"``) or None."""

  tokens: np.ndarray
  prefill_s: float
  decode_s: float
  prefill_tokens_per_s: float
  decode_tokens_per_s: float
  jitted: bool
  # Seconds of each decode step (the first includes its compile when the step is jitted): the
  # interval between successive tokens' completion (without stop tokens or on_token the steps are
  # queued one ahead, so this is the steady rate, not a step's latency).
  step_s: tuple = ()
  caches: tuple = dataclasses.field(repr=False, default=())
  lengths: np.ndarray | None = None
  stopped: str | None = None

  @property
  def warm_decode_tokens_per_s(self) -> float:
    """Tokens/s of the decode steps after the first (which compiles): the steady rate."""
    warm = self.step_s[1:]
    return self.tokens.shape[0] * len(warm) / sum(warm) if warm else 0.0


def generate(model, prompt_tokens, *, max_new_tokens: int, caches, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: int = 0, chunk: int = DEFAULT_CHUNK,
             progress: bool | None = None, forward=None, stop_tokens=(),
             on_token=None) -> Generation:
  """Prefills ``prompt_tokens [B,T]`` (or ``[T]``) and generates up to ``max_new_tokens`` per row.

  ``temperature=0``: greedy (argmax). Otherwise softmax sampling at ``temperature`` restricted to
  the ``top_k`` most probable tokens (0: no limit) and the nucleus ``top_p`` (``top_p=1``: the
  whole vocabulary), reproducible for a ``seed``.
  ``caches``: from :func:`caches_from_plan` or :func:`rkv.models.init_caches`, with room for
  ``T + max_new_tokens`` cells; donated (the updated ones are in the result). ``forward``: a
  ``jit_forward(model, last_only=True)`` to reuse, so repeated calls compile nothing new.
  ``stop_tokens``: ids that end a row (EOS); the run stops once every row has emitted one (a row
  that stopped earlier keeps being sampled; ``Generation.lengths`` says where each ends).
  ``on_token(i, tokens)``: called with each step's tokens (``[B]`` int32 numpy, step ``i`` from
  0) as soon as they exist; a true return value ends the run after that token.
  """
  where = "generate"
  prompt = _check_tokens(where, "prompt_tokens", prompt_tokens, model.config.vocab_size)
  caches = _check_caches(where, model, caches)
  if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
    raise ValueError(f"{where}: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
  if not np.isfinite(temperature) or temperature < 0:
    raise ValueError(f"{where}: temperature must be >= 0 (0 = greedy), got {temperature!r}")
  if not 0 < top_p <= 1:
    raise ValueError(f"{where}: top_p must be in (0, 1], got {top_p!r}")
  _check_count(where, "top_k", top_k, 0)
  stops = np.asarray(sorted({int(x) for x in stop_tokens}), np.int32)
  if on_token is not None and not callable(on_token):
    raise ValueError(f"{where}: on_token must be callable or None, got {type(on_token).__name__}")
  _check_chunk(where, chunk)
  b, t = prompt.shape
  room, fill = _cache_room(caches)
  if room is not None and t + max_new_tokens > room:
    raise ValueError(f"{where}: caches have room for {room} more cells but prompt_tokens ({t}) + "
                     f"max_new_tokens ({max_new_tokens}) need {t + max_new_tokens}: build caches "
                     f"with capacity >= {fill + t + max_new_tokens}")
  step = Stepper(model, caches, forward)
  key = jax.random.key(seed)

  if temperature == 0:
    pick, pick_args = greedy_pick, lambda i: ()
  else:
    pick = sample_pick
    # The same device arrays every step, the step index one buffer counted up in place
    # (_next_index): a jitted step whose inputs keep their buffers replays its captured CUDA
    # graph instead of re-recording it (see rkv.models.jit_forward).
    consts = (jnp.float32(temperature), jnp.float32(top_p), jnp.int32(top_k))
    index = [jnp.int32(0), 0]  # the device step index, and the host's count of it

    def pick_args(i):
      # Counted up when the next step asks, once the last step (which reads it) is dispatched.
      if i != index[1]:  # the loop asks for steps 0, 1, 2, ... in order
        raise AssertionError(f"{where}: sampling step {i} asked for where step {index[1]} was next")
      if i:
        index[0] = _next_index(index[0])
      index[1] = i + 1
      return (key, index[0]) + consts

  # Early stopping reads each token back to the host; without stops or a callback nothing does.
  watch = bool(stops.size) or on_token is not None
  lengths = np.full((b,), max_new_tokens, np.int64)
  done = np.zeros((b,), bool)

  def should_stop(i, tok) -> str | None:
    tok = np.asarray(tok)
    if stops.size:
      hit = ~done & np.isin(tok, stops)
      lengths[hit] = i + 1
      done[hit] = True
    asked = on_token(i, tok) if on_token is not None else False
    if stops.size and done.all():
      return "stop_tokens"
    return "on_token" if asked else None

  t0 = time.perf_counter()
  logits, caches = _prefill(step, prompt, caches, fill, chunk=chunk, progress=progress,
                            progress_every=PROGRESS_EVERY)
  # A jitted step donates the tokens and positions it is given (rkv.models.jit_forward): each
  # step is fed the last one's own output (`feed`, so the buffers stay put) and the tokens kept
  # are copies (one small program a step).
  keep = jnp.copy if step.jitted else (lambda x: x)
  out = []  # [B,1] device tokens, one a step
  feed = None
  if max_new_tokens:
    feed = _pick_next(logits, jnp.zeros((b, 1), jnp.int32), pick_args(0), pick=pick)[0]
    out.append(keep(feed))
  jax.block_until_ready(out or logits)
  t1 = time.perf_counter()
  stopped = should_stop(0, out[0][:, 0]) if out and watch else None
  positions = jnp.asarray(_positions(b, fill + t, 1))
  # Each step takes the previous one's tokens and positions on the device. Watched (stop tokens,
  # on_token), every token is read before the next step: a stop leaves the caches holding exactly
  # the cells before it. Unwatched, step i+1 is queued before step i's token is waited for, so the
  # device never idles for the host between steps; step_s are then the intervals between
  # successive tokens' completion.
  step_s, last, queued = [], t1, None
  for i in range(1, max_new_tokens if stopped is None else 0):
    feed, positions, caches = step.decode(feed, positions, caches, pick, pick_args(i))
    tok = keep(feed)
    out.append(tok)
    if watch or queued is not None:
      jax.block_until_ready(tok if watch else queued)
      now = time.perf_counter()
      step_s.append(now - last)
      last = now
    queued = None if watch else tok
    if watch and (stopped := should_stop(i, np.asarray(tok)[:, 0])) is not None:
      break
  if queued is not None:
    jax.block_until_ready(queued)
    step_s.append(time.perf_counter() - last)
  toks = (np.concatenate([np.asarray(x) for x in out], axis=1) if out
          else np.zeros((b, 0), np.int32))
  t2 = time.perf_counter()
  n_dec = max(toks.shape[1] - 1, 0)
  return Generation(tokens=toks, prefill_s=t1 - t0, decode_s=t2 - t1,
                    prefill_tokens_per_s=b * t / (t1 - t0),
                    decode_tokens_per_s=(b * n_dec / (t2 - t1)) if n_dec else 0.0,
                    jitted=step.jitted, step_s=tuple(step_s), caches=caches,
                    lengths=np.minimum(lengths, toks.shape[1]), stopped=stopped)


# ----------------------------------------------------------------------------------------------
# Teacher-forced decoding (what the gates compare)
# ----------------------------------------------------------------------------------------------
def decode_logits(model, tokens, caches, *, prefill_len: int, chunk: int = DEFAULT_CHUNK,
                  forward=None) -> np.ndarray:
  """Prefills ``tokens[:, :prefill_len]``, then feeds ``tokens[:, prefill_len:]`` one at a time;
  returns the logits of those incremental steps, ``[B, T - prefill_len, V]`` float32 — what a
  full forward gives at positions ``prefill_len .. T-1`` if decoding is exact."""
  where = "decode_logits"
  tokens = _check_tokens(where, "tokens", tokens, model.config.vocab_size, min_len=2)
  caches = _check_caches(where, model, caches)
  b, t = tokens.shape
  if not isinstance(prefill_len, (int, np.integer)) or not 1 <= prefill_len < t:
    raise ValueError(f"{where}: prefill_len must be an int in [1, T-1] = [1, {t - 1}], got "
                     f"{prefill_len!r}")
  _check_chunk(where, chunk)
  room, fill = _cache_room(caches)
  if room is not None and t > room:
    raise ValueError(f"{where}: caches have room for {room} more cells, tokens has {t}: build "
                     f"caches with capacity >= {fill + t}")
  step = Stepper(model, caches, forward)
  _, caches = _prefill(step, tokens[:, :prefill_len], caches, fill, chunk=chunk, progress=False,
                       progress_every=PROGRESS_EVERY)
  out = []
  for i in range(prefill_len, t):
    logits, caches = step(tokens[:, i:i + 1], _positions(b, fill + i, 1), caches)
    out.append(np.asarray(logits[:, -1]))
  return np.stack(out, axis=1)


def sequence_logits(model, tokens, caches, *, chunk: int = 16) -> np.ndarray:
  """The logits at every position of ``tokens [B,T]`` fed in chunks of ``chunk`` through
  ``caches`` (donated), ``[B, T, V]`` float32: row ``i`` predicts ``tokens[:, i + 1]``, so
  :func:`rkv.gates.perplexity` of them scores the text.

  The default chunk is the decode kernel's query limit (``rkv.attention.MAX_DECODE_QUERIES``):
  a ``cpu`` / ``hybrid`` layer attends chunks that short with the host kernel, longer ones stream
  their tail (``RollingKV.attend``), so the default scores the text through each tactic's own
  decode path."""
  where = "sequence_logits"
  tokens = _check_tokens(where, "tokens", tokens, model.config.vocab_size)
  caches = _check_caches(where, model, caches)
  _check_chunk(where, chunk)
  b, t = tokens.shape
  room, fill = _cache_room(caches)
  if room is not None and t > room:
    raise ValueError(f"{where}: caches have room for {room} more cells, tokens has {t}: build "
                     f"caches with capacity >= {fill + t}")
  if _all_jittable(caches):
    fn = jit_forward(model, last_only=False)
  else:
    fn = layered_forward(model, last_only=False)
  out = []
  for lo in range(0, t, chunk):
    hi = min(t, lo + chunk)
    logits, caches = fn(jnp.asarray(tokens[:, lo:hi]), jnp.asarray(_positions(b, fill + lo,
                                                                               hi - lo)), caches)
    out.append(np.asarray(logits, np.float32))
  return np.concatenate(out, axis=1)
