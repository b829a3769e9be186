"""Rolling-cache benchmark library: streamed decode steps against the performance model.

For each context length and window fraction it builds a :class:`rkv.RollingKV` and measures, in
one process so the ratios are comparable (docs/DESIGN.md §7: ±15% run to run):

- ``step_s``: one decode step of :func:`rkv.rolling_attention` per schedule (``"eager"``: per-tile
  eager transfers and dispatches, ``"unrolled"``: one jitted program), lookahead and tile size
  (median wall clock after warm-up, ``block_until_ready``);
- ``window_s``: the resident kernel over the window alone (one jitted ``rkv.attention``); ``h2d_gbps``: ``device_put`` of the
  pinned-host tail to the device; ``model_s = max(window_s, tail_bytes / h2d_rate)`` (docs/DESIGN.md
  §6: overlap is a max, not a sum) and ``step_s / model_s``;
- ``tail_gbps``: tail bytes over the step time; ``resident_s``: the whole context on the device
  (where it fits); ``naive_s``: move every per-tile tail array to the device (eager
  ``device_put``), then attend in one program (no overlap);
- the async host→device transfer ops of the ``"unrolled"`` schedule's compiled program
  (``hlo_report``; the eager schedule is many small programs: ``hlo`` is None);
- the cost of a one-token append with the tail holding 0, 1/4 and 1/2 of the context (until the
  window/staging buffers it writes are ready; ``cache_wait_s``: the extra time a
  ``block_until_ready`` over the whole cache then takes, which walks every tail tile), and of the
  append that flushes a tile.

``experiments/rolling_bench.py`` is the absl front end; tiny ``contexts`` run on CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import rkv
from rkv import benchmarking
from rkv import cache as cache_lib
from rkv import rolling
from rkv.offload import memory
from rkv.offload import stream


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  contexts: tuple[int, ...] = (131072, 524288, 1048576)
  window_fractions: tuple[float, ...] = (1.0, 0.75, 0.5, 0.25)
  schedules: tuple[str, ...] = ("eager", "unrolled")
  tile_cells: tuple[int, ...] = (32768,)
  lookaheads: tuple[int | None, ...] = (rolling.DEFAULT_LOOKAHEAD,)  # None: every tile up front
  batch: int = 1
  num_heads: int = 32
  num_kv_heads: int = 8
  head_dim: int = 128
  dtype: str = "bfloat16"
  impl: str = "auto"
  warmup: int = 3
  repeats: int = 20
  append_steps: int = 16
  resident: bool = True
  naive: bool = True
  # Extra rows with tactic="hybrid" (eager schedule) at these CPU shares of the tail: the same
  # tail, the same naive baseline, another way to serve it (the issue-4 tactic).
  hybrid_cpu_fractions: tuple[float, ...] = ()
  seed: int = 0


def _median_s(fn, warmup: int, repeats: int) -> float:
  # One call per sample (n_inner=1): a decode step is wall clock from dispatch to ready, launch
  # overhead included, as a decode loop sees it.
  return benchmarking.time_fn(fn, n_warmup=warmup, n_outer=max(repeats, 1), n_inner=1).median_s


def _data(cfg: BenchConfig, s: int) -> dict:
  """Cells ``k, v [B,S,K,D]`` (+ int8 scales ``[B,S,K]``) as host numpy: a random block tiled
  along S (values do not change the timings, and drawing 10^9 normals would dominate the run)."""
  rng = np.random.default_rng(cfg.seed)
  block = min(s, 4096)
  shape = (cfg.batch, block, cfg.num_kv_heads, cfg.head_dim)
  reps = -(-s // block)
  tile = lambda x: np.ascontiguousarray(np.tile(x, (1, reps) + (1,) * (x.ndim - 2))[:, :s])
  out = dict(k_scale=None, v_scale=None)
  for name in ("k", "v"):
    x = rng.standard_normal(shape).astype(np.float32)
    if cfg.dtype == "int8":
      xq, scale = cache_lib.quantize_int8(x)
      out[name], out[f"{name}_scale"] = tile(np.asarray(xq)), tile(np.asarray(scale))
    else:
      out[name] = tile(x.astype(jnp.dtype(cfg.dtype)))
  return out


def _cut(cells: dict, lo: int, hi: int) -> dict:
  return {n: None if x is None else x[:, lo:hi] for n, x in cells.items()}


def _fits_on_device(nbytes: int) -> bool:
  stats = memory.default_device().memory_stats()
  if not stats or "bytes_limit" not in stats:
    return True  # CPU: no accounting, the test sizes are tiny
  return nbytes * 1.2 < stats["bytes_limit"] - stats.get("bytes_in_use", 0)


@functools.partial(jax.jit, static_argnames=("impl",))
def _attend_all(q, q_pos, blocks, *, impl):
  """One program: the cells of every block (window, staging, the tail's tiles on the device)
  concatenated, then one attention call."""
  blocks = [b for b in blocks if b.k.shape[1]]
  cat = lambda name: (None if getattr(blocks[0], name) is None else
                      jnp.concatenate([getattr(b, name) for b in blocks], axis=1))
  return rkv.attention(q, cat("k"), cat("v"), q_pos=q_pos, k_pos=cat("pos"),
                       k_scale=cat("k_scale"), v_scale=cat("v_scale"), impl=impl)


# The resident kernel as one program: the model's window term and the resident baseline are the
# kernel's time, not the eager dispatch of its wrapper's small ops (~0.4 ms on the H200).
_attend_jit = jax.jit(rkv.attention, static_argnames=("impl",))


def _naive(q, q_pos, kv, *, impl):
  """Naive offload: move the whole streamed tail to the device (eager ``device_put`` of every
  per-tile array), then attend in one program that waits for all of it (no overlap, 2x tail in
  HBM for the concatenation)."""
  tiles = jax.device_put(kv.tail_tiles[:kv.n_full_tiles], memory.sharding(memory.DEVICE))
  return _attend_all(q, q_pos, (kv.window, kv.staging) + tuple(tiles), impl=impl)


def _step_rows(cfg: BenchConfig, s: int, cells: dict, q, q_pos, resident_s):
  rows = []
  for frac in cfg.window_fractions:
    w = int(round(s * frac))
    tiles = cfg.tile_cells if w < s else cfg.tile_cells[:1]
    window_s = h2d_gbps = naive_s = None
    for tile in tiles:
      kv = rkv.RollingKV.from_arrays(cells["k"], cells["v"], k_scale=cells["k_scale"],
                                     v_scale=cells["v_scale"], window_cells=w, tile_cells=tile)
      base = dict(context=s, window_fraction=frac, window_cells=w, tail_cells=s - w,
                  tile_cells=tile, window_bytes=kv.nbytes("window"),
                  streamed_bytes=kv.n_full_tiles * kv.nbytes("tail") // max(kv.n_tail_tiles, 1),
                  resident_s=resident_s)
      if window_s is None and w:
        wb = kv.window
        window_s = _median_s(lambda: _attend_jit(q, wb.k, wb.v, q_pos=q_pos, k_pos=wb.pos,
                                                 k_scale=wb.k_scale, v_scale=wb.v_scale,
                                                 impl=cfg.impl), cfg.warmup, cfg.repeats)
      if kv.n_full_tiles and h2d_gbps is None:
        # Every per-tile tail array (k, v, scales) in one eager device_put: the transfer path the
        # eager schedule uses.
        dev = memory.sharding(memory.DEVICE)
        tail = (kv.tail.k, kv.tail.v, kv.tail.k_scale, kv.tail.v_scale)
        h2d_s = _median_s(lambda: jax.device_put(tail, dev), 1, max(cfg.repeats // 4, 2))
        h2d_gbps = kv.nbytes("tail") / h2d_s / 1e9
      if kv.n_full_tiles and cfg.naive and naive_s is None and _fits_on_device(
          2 * kv.nbytes("tail")):
        naive_s = _median_s(lambda: _naive(q, q_pos, kv, impl=cfg.impl), 1,
                            max(cfg.repeats // 4, 2))
      runs = ([(s_, la, "stream", None) for s_ in cfg.schedules for la in cfg.lookaheads]
              + [("eager", rolling.DEFAULT_LOOKAHEAD, "hybrid", f)
                 for f in cfg.hybrid_cpu_fractions] if kv.n_full_tiles
              else [("resident", None, None, None)])
      for schedule, lookahead, tactic, cpu_fraction in runs:
        kw = dict(q_pos=q_pos, impl=cfg.impl)
        if schedule != "resident":
          kw.update(schedule=schedule, lookahead=lookahead, tactic=tactic)
        if tactic == "hybrid":
          kw.update(cpu_fraction=cpu_fraction)
        step_s = _median_s(lambda: rkv.rolling_attention(q, kv, **kw), cfg.warmup, cfg.repeats)
        hlo = None
        if schedule == "unrolled":
          hlo = memory.hlo_report(rolling.lower(q, kv, **kw).compile().as_text())
        tail_s = base["streamed_bytes"] / (h2d_gbps * 1e9) if h2d_gbps else 0.0
        model_s = max(window_s or 0.0, tail_s)
        if tactic == "hybrid":  # the stream model does not describe it (tactics_bench does)
          model_s = None
        rows.append(dict(base, schedule=schedule, lookahead=lookahead, tactic=tactic,
                         cpu_fraction=cpu_fraction, step_s=step_s,
                         window_s=window_s, tail_model_s=tail_s, h2d_gbps=h2d_gbps,
                         model_s=model_s, step_over_model=step_s / model_s if model_s else None,
                         tail_gbps=base["streamed_bytes"] / step_s / 1e9 if tail_s else None,
                         naive_s=naive_s, hlo=hlo))
      del kv
  return rows


def _append_rows(cfg: BenchConfig, s: int, cells: dict):
  """One-token appends with the tail holding 0, 1/4, 1/2 of the context, then the flush alone."""
  tile = cfg.tile_cells[0]
  rows = []
  for share in (0.0, 0.25, 0.5):
    p = (int(s * share) // tile) * tile
    n = min(cfg.append_steps, s)
    s0 = s - n  # the last append of the loop completes a tile when p > 0 and n <= tile
    first = _cut(cells, 0, s0)
    kv = rkv.RollingKV.from_arrays(first["k"], first["v"], k_scale=first["k_scale"],
                                   v_scale=first["v_scale"], window_cells=s - p, capacity=s,
                                   tile_cells=tile)
    plain, walks, flushes = [], [], 0
    jax.block_until_ready(kv)  # from_arrays' host transfers must not land in the timings
    for i in range(n):
      tiles_before = kv.n_full_tiles
      new = jax.block_until_ready({n: None if x is None else jnp.asarray(x)
                                   for n, x in _cut(cells, s0 + i, s0 + i + 1).items()})
      t0 = time.perf_counter()
      kv = kv.append(new["k"], new["v"], k_scale=new["k_scale"], v_scale=new["v_scale"])
      # A plain append writes the window or the staging tile: done when those are.
      jax.block_until_ready((kv.window, kv.staging))
      t1 = time.perf_counter()
      # Waiting on the whole cache also walks every tail tile's arrays (a cost of the wait that
      # grows with the tail, not of the append): reported apart.
      jax.block_until_ready(kv)
      t2 = time.perf_counter()
      if kv.n_full_tiles > tiles_before:
        flushes += 1
      else:
        plain.append(t1 - t0)
        walks.append(t2 - t1)
    warm = plain[1:] or plain  # the first append compiles
    walks = walks[1:] or walks
    flush_s = None
    if kv.n_tail_tiles:
      # The flush on its own, warm: rewrites tile 0 of this throwaway cache again and again
      # (each call replaces leaf 0 of the tail tuples with a fresh pinned_host tile, as append does).
      state = [kv.tail, kv.staging]

      def one_flush():
        state[0], state[1] = cache_lib.flush(state[0], state[1], 0)
        return state[0]

      flush_s = _median_s(one_flush, 1, max(cfg.repeats // 4, 2))
    rows.append(dict(context=s, tail_cells=p, tail_share=share, tile_cells=tile, appends=n,
                     append_s=statistics.median(warm) if warm else None,
                     cache_wait_s=statistics.median(walks) if walks else None, flush_s=flush_s,
                     flushes_in_loop=flushes,
                     tile_bytes=kv.nbytes("tail") // kv.n_tail_tiles if kv.n_tail_tiles else 0))
    del kv
  return rows


def run(cfg: BenchConfig) -> dict:
  """Runs every row of ``cfg``; returns the JSON-ready result."""
  for sch in cfg.schedules:
    if sch not in rolling.SCHEDULES:
      raise ValueError(f"run: schedules must be drawn from {rolling.SCHEDULES}, got {sch!r}")
  for la in cfg.lookaheads:
    stream.check_lookahead(la, "run: lookaheads")
  result = dict(
      benchmark="rolling_bench", **benchmarking.environment(), config=dataclasses.asdict(cfg), host_pool_gib=memory.host_pool_bytes() / 2**30,
      xla_flags=os.environ.get("XLA_FLAGS", ""),
      steps=[], appends=[])
  rng = np.random.default_rng(cfg.seed + 1)
  # int8 caches serve bf16 queries.
  q_dt = jnp.bfloat16 if cfg.dtype == "int8" else jnp.dtype(cfg.dtype)
  for s in cfg.contexts:
    cells = _data(cfg, s)
    q = jnp.asarray(rng.standard_normal((cfg.batch, 1, cfg.num_heads, cfg.head_dim)), q_dt)
    q_pos = jnp.full((cfg.batch, 1), s - 1, jnp.int32)
    resident_s = None
    nbytes = sum(x.nbytes for x in cells.values() if x is not None)
    if cfg.resident and _fits_on_device(nbytes):
      dev = {n: None if x is None else memory.to_device(x) for n, x in cells.items()}
      resident_s = _median_s(lambda: _attend_jit(q, dev["k"], dev["v"], q_pos=q_pos,
                                                 k_scale=dev["k_scale"], v_scale=dev["v_scale"],
                                                 impl=cfg.impl), cfg.warmup, cfg.repeats)
      del dev
    result["steps"] += _step_rows(cfg, s, cells, q, q_pos, resident_s)
    result["appends"] += _append_rows(cfg, s, cells)
  return result


def write_json(result: dict, path: str) -> None:
  benchmarking.write_json(path, result)


def format_table(result: dict) -> str:
  def cell(x, width, fmt="8.3f", scale=1.0):
    if x is None:
      return f"{'-':>{width}}"
    return f"{format(x * scale if scale != 1.0 else x, fmt):>{width}}"

  def label(r):  # hybrid rows: the CPU share of the tail
    if r.get("tactic") == "hybrid":
      return f"hyb{r['cpu_fraction']:.2f}"
    return r["schedule"]

  def ahead(r):
    if r["schedule"] == "resident":
      return "-"
    return "all" if r["lookahead"] is None else str(r["lookahead"])

  lines = [f"{result['device']} ({result['backend']}, jax {result['jax']})",
           f"{'context':>8} {'W frac':>6} {'tile':>6} {'schedule':>9} {'ahead':>5} {'step ms':>8} "
           f"{'model ms':>8} {'ratio':>6} {'win ms':>8} {'h2d GB/s':>8} {'tail GB/s':>9} "
           f"{'resid ms':>8} {'naive ms':>8} {'h2d async':>9}"]
  for r in result["steps"]:
    hlo = None if r["hlo"] is None else r["hlo"]["h2d_async"]
    lines.append(
        f"{r['context']:>8} {r['window_fraction']:>6.2f} {r['tile_cells']:>6} "
        f"{label(r):>9} {ahead(r):>5} "
        f"{cell(r['step_s'], 8, scale=1e3)} {cell(r['model_s'], 8, scale=1e3)} "
        f"{cell(r['step_over_model'], 6, '.2f')} {cell(r['window_s'], 8, scale=1e3)} "
        f"{cell(r['h2d_gbps'], 8, '.1f')} {cell(r['tail_gbps'], 9, '.1f')} "
        f"{cell(r['resident_s'], 8, scale=1e3)} {cell(r['naive_s'], 8, scale=1e3)} "
        f"{cell(hlo, 9, 'd')}")
  lines.append(f"{'context':>8} {'tail':>8} {'append ms':>9} {'wait-all ms':>11} {'flush ms':>8}")
  for r in result["appends"]:
    lines.append(f"{r['context']:>8} {r['tail_cells']:>8} {cell(r['append_s'], 9, scale=1e3)} "
                 f"{cell(r['cache_wait_s'], 11, scale=1e3)} {cell(r['flush_s'], 8, scale=1e3)}")
  return "\n".join(lines)
