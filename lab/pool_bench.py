"""Issue 14's pool benchmarks (b)-(d): ragged vs padded batches, an offloaded pool, a kept chat.

Model: the decode benchmark's (``lab.decode_bench.model_config``: a preset, random weights). KV:
a :class:`rkv.pool.Pool`, filled synthetically (random K/V written through ``Pool.extend`` in
chunks, pages moving to the host as the planner's windows say), so a run spends its time on
what it measures. Every decode figure is the median of ``steps`` steps after ``warmup``
(``rkv.benchmarking.time_fn``), one token per sequence a step.

- (b) ``ragged``: sequences of ``ragged_lengths`` (16K..128K, B=8) vs the same batch padded to
  the longest (every sequence as long as the longest: the bytes a padded dense batch moves and
  reads), in one device budget: tok/s, bytes read on the device and moved from the host a step.
- (c) ``offload``: ``offload_seqs`` sequences of ``offload_len`` cells with ``host_fraction`` of
  the pool's cells on the host: tok/s vs the bound of docs/DESIGN.md §6 (bytes over each link's
  rate, from the planner's profile: ``max((weights + device rows) / HBM, host pages / PCIe)``).
- (d) ``chat``: the second turn of a ``chat_context``-token conversation kept in the pool
  (``keep=True``; the turn prefills its ``chat_new_tokens`` only) vs prefilling the whole
  context again (``share_prefix=False``): time to first token of each.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import numpy as np

from lab import decode_bench

SCENARIOS = ("ragged", "offload", "chat")
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class PoolBenchConfig:
  preset: str = "llama3-8b"
  dtype: str = "bfloat16"
  impl: str = "auto"
  tactic: str = "stream"  # the host pages' tactic (rkv.pool.POOL_TACTICS)
  page_cells: int = 32768
  fill_chunk: int = 32768  # cells per synthetic write
  row_bucket: int | None = None  # the pool's row bucket (None: page_cells)
  warmup: int = 2
  steps: int = 8
  ragged_lengths: tuple[int, ...] = tuple(16384 * i for i in range(1, 9))
  # (b)'s device part, both rows: 104 GiB (832K rows at 128 KiB a cell) holds the ragged batch's
  # 576K cells whole and leaves one 32K page per padded sequence (32 GiB) on the host, beside 15
  # GiB of weights on the H200 (at 96-100 GiB the padded batch needs two pages each: 64 GiB
  # pinned, XLA's default cap).
  ragged_device_kv_gib: float = 104.0
  offload_seqs: int = 4
  offload_len: int = 100_000
  host_fraction: float = 0.5
  # (c)'s pages: a page moves whole, so the host holds a whole number of pages a sequence; 16K
  # pages put 48% of a 100K sequence there (32K pages: 32% or 64%).
  offload_page_cells: int = 16384
  chat_context: int = 131072
  chat_new_tokens: int = 512
  chat_device_kv_gib: float = 40.0
  prefill_chunk: int = 2048
  chat_repeats: int = 3  # timed second turns (after one warm-up)
  chat_full_repeats: int = 1  # timed full prefills (after one untimed)
  profile_path: str | None = None
  seed: int = 0

  def __post_init__(self):
    where = "PoolBenchConfig"
    for name in ("page_cells", "fill_chunk", "steps", "offload_seqs", "offload_len",
                 "chat_context", "chat_new_tokens", "prefill_chunk", "chat_repeats",
                 "chat_full_repeats"):
      x = getattr(self, name)
      if not isinstance(x, int) or x < 1:
        raise ValueError(f"{where}: {name} must be a positive int, got {x!r}")
    if not self.ragged_lengths or any(int(n) < 1 for n in self.ragged_lengths):
      raise ValueError(f"{where}: ragged_lengths must be positive ints, got {self.ragged_lengths}")
    if not 0 < self.host_fraction < 1:
      raise ValueError(f"{where}: host_fraction must be in (0, 1), got {self.host_fraction!r}")

  @classmethod
  def quick(cls, **kw) -> "PoolBenchConfig":
    """CPU smoke shapes: the tiny Llama, float32, a few dozen cells, pages of 16."""
    base = dict(preset="tiny-llama", dtype="float32", impl="xla", page_cells=16, fill_chunk=16,
                row_bucket=128, warmup=1, steps=2, ragged_lengths=(16, 40),
                # tiny-llama: 512 bytes a cell (2 layers): 64 and 96 device rows
                ragged_device_kv_gib=64 * 512 / GIB,
                offload_seqs=2, offload_len=64, offload_page_cells=8, chat_context=64,
                chat_new_tokens=8,
                chat_device_kv_gib=96 * 512 / GIB, prefill_chunk=16, chat_repeats=1)
    base.update(kw)
    return cls(**base)


def _model(cfg: PoolBenchConfig):
  import jax
  from flax import nnx
  from rkv.models import Transformer
  mc = decode_bench.model_config(cfg)  # reads cfg.preset and cfg.dtype
  model = Transformer(mc, rngs=nnx.Rngs(cfg.seed), impl=cfg.impl)
  jax.block_until_ready(nnx.state(model))
  return mc, model


def _profile(cfg: PoolBenchConfig):
  import rkv
  return rkv.Profile.load(cfg.profile_path) if cfg.profile_path else rkv.planner.H200_DEFAULT


def _cell_bytes(mc) -> int:
  return mc.num_layers * decode_bench.kv_cell_bytes(mc)  # every layer's K/V of one token


def _rows_for(mc, gib: float) -> int:
  return max(1, int(gib * GIB) // _cell_bytes(mc))


def fill(pool, lengths, needs_extra: int, *, chunk: int, seed: int) -> list[int]:
  """Sequences of ``lengths`` random cells (random K/V per layer, random tokens); the planner's
  windows see each sequence's final need (``length + needs_extra``) from the start."""
  import jax
  import jax.numpy as jnp
  mc = pool.config
  rng = np.random.default_rng(seed)
  seqs = [pool.add() for _ in lengths]
  needs = {s: int(n) + needs_extra for s, n in zip(seqs, lengths)}
  key = jax.random.key(seed)
  shape = (chunk, mc.num_kv_heads, mc.head_dim)
  dt = jnp.dtype(pool.dtype)
  for s, n in zip(seqs, lengths):
    done = 0
    while done < n:
      m = min(chunk, n - done)
      kv = []
      for _ in range(mc.num_layers):
        key, a, b = jax.random.split(key, 3)
        kv.append((jax.random.normal(a, shape, dt)[:m], jax.random.normal(b, shape, dt)[:m]))
      pool.extend(s, rng.integers(1, mc.vocab_size, m).tolist(), kv, needs=needs)
      done += m
  pool.maintain(needs)
  jax.block_until_ready([c.k for c in pool.caches])
  return seqs


def decode_step_fn(forward, pool, seqs, needs):
  """One decode step of every sequence in ``seqs`` (token 1 each): prepare, model, commit."""
  feeds = [(s, [1]) for s in seqs]

  def step():
    tokens, positions, caches = pool.prepare(feeds, needs=needs)
    logits, caches = forward(tokens, positions, caches)
    pool.commit(caches)
    return logits
  return step


def time_decode(cfg, model, pool, seqs, lengths) -> dict[str, Any]:
  from rkv import benchmarking
  from rkv.models import layered_forward
  needs = {s: int(n) + cfg.warmup + cfg.steps + 2 for s, n in zip(seqs, lengths)}
  bytes_ = pool.referenced_bytes(seqs)  # before the steps: what every step reads, to a token
  step = decode_step_fn(layered_forward(model, last_only=True), pool, seqs, needs)
  timing = benchmarking.time_fn(step, n_warmup=cfg.warmup, n_outer=cfg.steps, n_inner=1)
  return dict(step_s=timing.median_s, step_min_s=timing.min_s, step_max_s=timing.max_s,
              tokens_per_s=len(seqs) / timing.median_s, device_kv_bytes=bytes_["device"],
              host_kv_bytes=bytes_["host"])


def _bound(cfg, mc, row) -> dict[str, Any]:
  prof = _profile(cfg)
  rate = prof.pcie_gbps if cfg.tactic in ("stream", "resident") else prof.cpu_attn_gbps
  weights = decode_bench.weight_read_bytes(mc)
  b = decode_bench.step_bound(weights + row["device_kv_bytes"], prof.hbm_gbps,
                              [(row["host_kv_bytes"], rate)])
  return dict(weight_bytes=weights, bound_s=b["bound_s"], bound_by=b["bound_by"],
              bound_tokens_per_s=row["batch"] / b["bound_s"],
              ratio_to_bound=row["tokens_per_s"] / (row["batch"] / b["bound_s"]))


def host_pages_for(needs, device_rows: int, page_cells: int, fill_chunk: int,
                   spare: int = 0) -> int:
  """Host pages a fill of sequences with final ``needs`` (one fed ``fill_chunk`` cells at a time,
  the others decoding) can use under the planner's windows: a page moves only whole, so a
  sequence with window W holds at most ``floor((need - W) / page)`` pages; the most over which
  sequence is being filled, plus ``spare``. (Allotting what is used, not every cell, keeps the
  pinned-host pool, capped at 64 GiB by default, for the pages that exist.)"""
  from rkv import planner
  most = 0
  for i in range(len(needs)):
    feeds = [1] * len(needs)
    feeds[i] = fill_chunk
    wins = planner.pool_windows(list(needs), device_rows, page_cells, feeds)
    most = max(most, sum(max(n - w, 0) // page_cells for n, w in zip(needs, wins)))
  return most + spare


def _pool(cfg, mc, device_rows: int, needs, spare: int = 0, page_cells: int | None = None):
  from rkv.pool import Pool
  page = page_cells or cfg.page_cells
  pages = 0 if cfg.tactic == "resident" else host_pages_for(
      needs, device_rows, page, max(cfg.fill_chunk, cfg.prefill_chunk), spare)
  return Pool(mc, device_rows=device_rows, host_pages=pages, page_cells=page,
              tactic=cfg.tactic, row_bucket=min(cfg.row_bucket or page, device_rows))


def run_ragged(cfg: PoolBenchConfig, log=print, model=None) -> list[dict[str, Any]]:
  """(b): the ragged batch and the same batch padded to the longest, one device budget."""
  import gc
  mc, model = model or _model(cfg)
  rows = _rows_for(mc, cfg.ragged_device_kv_gib)
  longest = max(cfg.ragged_lengths)
  out = []
  for layout, lengths in (("ragged", tuple(int(n) for n in cfg.ragged_lengths)),
                          ("padded", (longest,) * len(cfg.ragged_lengths))):
    extra = cfg.warmup + cfg.steps + 2
    pool = _pool(cfg, mc, rows, [n + extra for n in lengths])
    t0 = time.perf_counter()
    seqs = fill(pool, lengths, extra, chunk=cfg.fill_chunk, seed=cfg.seed)
    log(f"pool_bench ragged: {layout} filled {sum(lengths)} cells in "
        f"{time.perf_counter() - t0:.1f} s ({pool})")
    row = dict(scenario="ragged", layout=layout, batch=len(lengths), lengths=list(lengths),
               cells=sum(lengths), device_rows=rows, tactic=pool.tactic)
    row.update(time_decode(cfg, model, pool, seqs, lengths))
    row["kv_bytes_moved"] = row["host_kv_bytes"]
    row["kv_bytes_read"] = row["device_kv_bytes"] + row["host_kv_bytes"]
    row.update(_bound(cfg, mc, row))
    log(f"pool_bench ragged: {layout} {row['tokens_per_s']:.2f} tok/s, "
        f"{row['kv_bytes_read'] / GIB:.2f} GiB read, {row['kv_bytes_moved'] / GIB:.2f} GiB moved "
        f"a step")
    out.append(row)
    del pool, seqs
    gc.collect()
  if len(out) == 2:
    out[0]["speedup_vs_padded"] = out[0]["tokens_per_s"] / out[1]["tokens_per_s"]
  return out


def run_offload(cfg: PoolBenchConfig, log=print, model=None) -> list[dict[str, Any]]:
  """(c): ``offload_seqs`` x ``offload_len`` cells, ``host_fraction`` of them on the host."""
  mc, model = model or _model(cfg)
  n, length, page = cfg.offload_seqs, cfg.offload_len, cfg.offload_page_cells
  total = n * length
  extra = cfg.warmup + cfg.steps + 2
  # The whole pages nearest host_fraction of each sequence, and the device rows whose planned
  # window W leaves exactly those on the host: each sequence holds up to W + page - 1 rows plus
  # its feed between page moves (the planner's rule), the fill feeds fill_chunk at a time.
  host_per_seq = max(1, round(cfg.host_fraction * length / page)) * page
  window = length - host_per_seq  # a sequence of `length` cells then holds host_per_seq on the host
  rows = n * (window + page - 1) + cfg.fill_chunk
  pool = _pool(cfg, mc, rows, [length + extra] * n, page_cells=page)
  t0 = time.perf_counter()
  seqs = fill(pool, (length,) * n, extra, chunk=cfg.fill_chunk, seed=cfg.seed)
  # The last sequence filled was planned with its fill chunk still to come: every sequence now
  # gets the window the rows were sized for (decode's planned windows are larger: nothing moves).
  pool.maintain(windows=dict.fromkeys(seqs, window))
  log(f"pool_bench offload: filled {total} cells in {time.perf_counter() - t0:.1f} s ({pool})")
  row = dict(scenario="offload", batch=n, lengths=[length] * n, cells=total, device_rows=rows,
             tactic=pool.tactic)
  row.update(time_decode(cfg, model, pool, seqs, (length,) * n))
  row["host_share"] = row["host_kv_bytes"] / max(row["host_kv_bytes"] + row["device_kv_bytes"], 1)
  row.update(_bound(cfg, mc, row))
  log(f"pool_bench offload: {row['tokens_per_s']:.2f} tok/s, bound "
      f"{row['bound_tokens_per_s']:.2f} ({row['ratio_to_bound']:.2f}x), host share "
      f"{row['host_share']:.2f}")
  return [row]


def _first_token_s(sched, request) -> float:
  t0 = time.perf_counter()
  ticket = sched.add(request)
  while sched.finished().get(ticket) is None:
    sched.step()
  sched.collect()
  return time.perf_counter() - t0


def run_chat(cfg: PoolBenchConfig, log=print, model=None) -> list[dict[str, Any]]:
  """(d): the second turn's time to first token, conversation kept vs prefilled again."""
  from rkv import serving
  mc, model = model or _model(cfg)
  ctx, new = cfg.chat_context, cfg.chat_new_tokens
  rows = _rows_for(mc, cfg.chat_device_kv_gib)
  # The kept turn plus one more context of the same length (the full prefill's sequence).
  pool = _pool(cfg, mc, rows, [ctx + new + 2] * 2, spare=2)
  t0 = time.perf_counter()
  (turn1,) = fill(pool, (ctx,), new + 2, chunk=cfg.fill_chunk, seed=cfg.seed)
  log(f"pool_bench chat: turn 1 of {ctx} cells filled in {time.perf_counter() - t0:.1f} s")
  history = pool.tokens(turn1)
  rng = np.random.default_rng(cfg.seed + 1)
  sched = serving.Scheduler(model, pool, max_batch=1, chunk=cfg.prefill_chunk)

  def turn2(share: bool):
    prompt = history + rng.integers(1, mc.vocab_size, new).tolist()
    return serving.Request(prompt, max_new_tokens=1, share_prefix=share)

  kept = [_first_token_s(sched, turn2(True)) for _ in range(1 + cfg.chat_repeats)]
  log(f"pool_bench chat: kept conversation, first token after {kept[1:]} s")
  # One untimed full prefill first: its programs (one per chunk shape and row bucket) compile
  # there, and compiles are not time to first token.
  full = [_first_token_s(sched, turn2(False)) for _ in range(1 + cfg.chat_full_repeats)][1:]
  log(f"pool_bench chat: prefilled again, first token after {full} s")
  k_med, f_med = statistics.median(kept[1:]), statistics.median(full)
  return [dict(scenario="chat", context=ctx, new_tokens=new, device_rows=rows, tactic=pool.tactic,
               kept_ttft_s=k_med, kept_ttft_all_s=kept[1:], full_ttft_s=f_med,
               full_ttft_all_s=full, speedup=f_med / k_med,
               prefill_tokens_kept=new, prefill_tokens_full=ctx + new)]


def run(cfg: PoolBenchConfig, scenarios=SCENARIOS, log=print) -> dict[str, Any]:
  """Every scenario named in ``scenarios``; one failing scenario is reported, not fatal."""
  bad = [s for s in scenarios if s not in SCENARIOS]
  if bad:
    raise ValueError(f"pool_bench: unknown scenarios {bad}; choose from {SCENARIOS}")
  model = _model(cfg)
  fns = dict(ragged=run_ragged, offload=run_offload, chat=run_chat)
  rows = []
  for name in scenarios:
    try:
      rows += fns[name](cfg, log=log, model=model)
    except Exception as e:  # one failing scenario must not lose the others
      rows.append(dict(scenario=name, error=f"{type(e).__name__}: {e}"))
      log(f"pool_bench {name}: error: {rows[-1]['error']}")
  return dict(config=dataclasses.asdict(cfg), rows=rows)
