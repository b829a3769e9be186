"""Block-cache decode benchmark (issue 15): one sparse layer's decode step through the block cache
(selection, residency, one batched fetch of the misses, block-selected attention) against the
dense offloaded decode of the same context (``rkv.rolling_attention`` over a RollingKV), each row
with its bound (docs/DESIGN.md §6: bytes over each link's rate), composed to the model's tok/s.

**Planted structure.** Random keys give a selector nothing to find (every block scores alike, and
the hit rate would measure only the recent window). The context is random noise plus ``topics``
planted directions: topic j owns ``select - window - sinks`` blocks (the same blocks in every KV
head, so the union over heads is one selection), each holding a few keys aligned with the topic's
direction. Each decode step's query points at one topic, drawn Zipf(``zipf``) over the topics:
the selector must find that topic's blocks, and the hit rate measures how well the slots hold the
hot topics (more topics than the slots hold: misses). This is a synthetic workload, not a
model's; it says what the block cache's machinery costs and moves, not what a model reads.

Rows per (context, slots, selection): ``sparse`` (measured median step after warm-up, hit rate,
MiB from the host per step and per token over ``layers``), ``dense_<tactic>`` (the same context
offloaded with a device window of the same device bytes as the sparse layer: "equal device
memory"), the bounds, and what the freed VRAM buys (modeled): the dense window the sparse layer's
device bytes would hold, and how many sequences fit the dense layer's device bytes as sparse ones.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

import rkv
from rkv import benchmarking
from rkv import sparse
from rkv.planner import H200_DEFAULT

MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class SparseBenchConfig:
  """Llama-3-8B's attention shape by default (H=32, K=8, D=128, L=32, bf16, 16.06e9 weight bytes).
  ``contexts`` cells; ``slot_cells`` / ``select_cells``: the block cache's device cells and cells
  read per step (multiples of ``block_cells``); ``window_blocks`` and ``sink_blocks`` are part of
  the selection. ``dense_tactics``: the offloaded baselines; ``dense_window_cells`` 0: the window
  with the sparse layer's device bytes (equal device memory)."""

  contexts: tuple = (262144, 1048576)
  slot_cells: tuple = (16384, 65536)
  select_cells: tuple = (2048, 4096)
  block_cells: int = 64
  window_blocks: int = 4
  sink_blocks: int = 1
  num_heads: int = 32
  num_kv_heads: int = 8
  head_dim: int = 128
  layers: int = 32
  weight_bytes: float = 16.06e9
  dtype: str = "bfloat16"
  topics: int = 32
  zipf: float = 1.1
  planted_keys: int = 4
  dense_tactics: tuple = ("stream", "hybrid")
  dense_window_cells: int = 0
  tile_cells: int = 32768
  selector: str = "quest"
  host: str = "auto"  # the block store: pinned_host buffers where the device has them
  impl: str = "auto"
  warmup: int = 64  # steps before timing: the slots reach their steady state (cold misses out)
  steps: int = 64
  # > 0: the first sparse row traces this many more steps (jax.profiler) and keeps the summary
  # (lab/trace_summary.py: device streams, the rkv.sparse.* host spans) in its "trace".
  trace_steps: int = 0
  seed: int = 0
  pcie_gbps: float = H200_DEFAULT.pcie_gbps
  hbm_gbps: float = H200_DEFAULT.hbm_gbps
  # The KV budget of one H200 at rkv's 0.98 memory fraction after the weights and the planner's
  # ~1.04 GiB reserve (docs/DESIGN.md §6): what "the freed VRAM buys" is counted against.
  device_kv_budget_bytes: float = 0.98 * 140 * 2**30 - 16.06e9 - 1.04 * 2**30

  def __post_init__(self):
    if not isinstance(self.trace_steps, int) or self.trace_steps < 0:
      raise ValueError(f"SparseBenchConfig: trace_steps must be an int >= 0, got "
                       f"{self.trace_steps!r}")
    for name in ("slot_cells", "select_cells"):
      for c in getattr(self, name):
        if c % self.block_cells:
          raise ValueError(f"SparseBenchConfig: {name} {c} must be a multiple of block_cells="
                           f"{self.block_cells}")

  @property
  def cell_bytes(self) -> int:
    return 2 * self.num_kv_heads * self.head_dim * np.dtype(jnp.dtype(self.dtype)).itemsize + 4


def _context(cfg: SparseBenchConfig, context: int, select_blocks: int, rng):
  """The host store of one layer (numpy ``[1,NB,2,bs,K,D]``), the topics' directions ``[T,K,D]``
  and blocks ``[T,n]``; noise is one random slab tiled (generating GiBs of normals is slow; the
  tiling is no structure a q.k bound can use)."""
  bs, kh, d = cfg.block_cells, cfg.num_kv_heads, cfg.head_dim
  dt = np.dtype(jnp.dtype(cfg.dtype))
  cap = context + cfg.warmup * 4 + cfg.steps * 4 + 64   # room for the timed appends
  nb = -(-cap // bs)
  slab = (0.5 * rng.standard_normal((min(nb, 256), 2, bs, kh, d))).astype(dt)
  kv = np.empty((1, nb, 2, bs, kh, d), dt)
  for lo in range(0, nb, len(slab)):
    n = min(len(slab), nb - lo)
    kv[0, lo:lo + n] = slab[:n]
  pos = np.full((1, nb, bs), -1, np.int32)
  pos.reshape(1, -1)[0, :context] = np.arange(context, dtype=np.int32)
  per_topic = select_blocks - cfg.window_blocks - cfg.sink_blocks
  filled = -(-context // bs)
  candidates = np.arange(cfg.sink_blocks, filled - cfg.window_blocks)
  chosen = rng.choice(candidates, size=(cfg.topics, per_topic), replace=False)
  dirs = rng.standard_normal((cfg.topics, kh, d)).astype(np.float32)
  dirs /= np.linalg.norm(dirs, axis=-1, keepdims=True)
  for j in range(cfg.topics):
    for blk in chosen[j]:
      cells = rng.choice(bs, size=cfg.planted_keys, replace=False)
      kv[0, blk, 0, cells] = (3.0 * math.sqrt(d) * dirs[j]).astype(dt)[None]
  return kv, pos, dirs, chosen


def _queries(cfg, dirs, rng, n):
  """``n`` decode queries ``[1,1,H,D]``, each at one Zipf-drawn topic, with its topic index."""
  p = 1.0 / np.arange(1, cfg.topics + 1) ** cfg.zipf
  topics = rng.choice(cfg.topics, size=n, p=p / p.sum())
  g = cfg.num_heads // cfg.num_kv_heads
  out = []
  for j in topics:
    q = np.repeat(dirs[j], g, axis=0) + 0.1 * rng.standard_normal((cfg.num_heads, cfg.head_dim))
    out.append(q.astype(np.float32)[None, None])
  return out, topics


def _new_cells(cfg, rng, n):
  shape = (1, 1, cfg.num_kv_heads, cfg.head_dim)
  return [(jnp.asarray(0.5 * rng.standard_normal(shape), cfg.dtype),
           jnp.asarray(0.5 * rng.standard_normal(shape), cfg.dtype)) for _ in range(n)]


def sparse_row(cfg, context, slot_cells, select_cells) -> dict:
  # Seeded without the slot count: every slot count sees the same context and queries.
  rng = np.random.default_rng([cfg.seed, context, select_cells])
  bs = cfg.block_cells
  nsel = select_cells // bs
  bcfg = sparse.BlockCacheConfig(block_cells=bs, device_slots=slot_cells // bs,
                                 select_blocks=nsel, window_blocks=cfg.window_blocks,
                                 sink_blocks=cfg.sink_blocks, selector=cfg.selector)
  kv, pos, dirs, chosen = _context(cfg, context, nsel, rng)
  t0 = time.perf_counter()
  cache = sparse.BlockCache.from_host(kv, pos, config=bcfg, fill=context, host=cfg.host)
  del kv  # pinned: copied into page-locked buffers
  build_s = time.perf_counter() - t0
  n = cfg.warmup + cfg.steps + (cfg.trace_steps + 1 if cfg.trace_steps else 0)
  qs, topics = _queries(cfg, dirs, rng, n)
  cells = _new_cells(cfg, rng, n)
  state = dict(cache=cache, i=0, found=0)

  def step():
    i = state["i"]
    c = state["cache"]
    p = c.fill
    positions = jnp.full((1, 1), p, jnp.int32)
    with jax.profiler.TraceAnnotation("rkv.sparse.append"):
      c = c.append(*cells[i], positions)
    o, _, ids, c = c.step(jnp.asarray(qs[i], cfg.dtype), positions, impl=cfg.impl)
    picked = set(np.asarray(ids)[0, 0].tolist())
    state["found"] += len(picked & set(chosen[topics[i]].tolist())) / len(chosen[topics[i]])
    state["cache"], state["i"] = c, i + 1
    return o

  for _ in range(cfg.warmup):
    jax.block_until_ready(step())
  before, found0 = state["cache"].totals, state["found"]
  times = []
  for _ in range(cfg.steps):
    t = time.perf_counter()
    jax.block_until_ready(step())
    times.append(time.perf_counter() - t)
  tot, found1 = state["cache"].totals, state["found"]
  trace = _trace(cfg, step, n_steps=cfg.trace_steps) if cfg.trace_steps else None
  d = dataclasses.replace(tot, **{f: getattr(tot, f) - getattr(before, f)
                                  for f in ("steps", "hits", "misses", "evictions",
                                            "bytes_from_host", "moved_bytes", "transfers")})
  step_s = float(np.median(times))
  host_b = d.moved_bytes / max(d.steps, 1)
  dev_b, _ = sparse.layer_bytes(bcfg, batch=1, capacity=cache.capacity,
                                num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                itemsize=np.dtype(jnp.dtype(cfg.dtype)).itemsize)
  # The step reads the selection's cells and every block's summary (2*D float32 per head).
  read_b = select_cells * cfg.cell_bytes + cache.n_blocks * cfg.num_kv_heads * cfg.head_dim * 8
  return dict(kind="sparse", context=context, slot_cells=slot_cells, select_cells=select_cells,
              block_cells=bs, selector=cfg.selector, step_ms=step_s * 1e3,
              step_ms_min=float(np.min(times)) * 1e3, hit_rate=d.hit_rate, misses_per_step=d.misses / d.steps,
              evictions_per_step=d.evictions / d.steps,
              mib_from_host_per_step=host_b / MIB, mib_from_host_per_token=cfg.layers * host_b / MIB,
              planted_recall=(found1 - found0) / cfg.steps,
              device_bytes=dev_b, device_read_bytes=read_b,
              bound_ms=max(read_b / (cfg.hbm_gbps * 1e9), host_b / (cfg.pcie_gbps * 1e9)) * 1e3,
              build_s=build_s, host_store="pinned" if cache.store.pinned else "numpy",
              counters=d.as_dict(), **({} if trace is None else {"trace": trace}))


def _trace(cfg, step, n_steps: int) -> dict:
  """``n_steps`` more steps under ``jax.profiler`` (after one traced and thrown away: the
  profiler's start), summarized; ``traced_step_ms`` are their wall times."""
  import glob
  import os
  import tempfile
  from lab.trace_summary import summarize
  opts = jax.profiler.ProfileOptions()
  opts.python_tracer_level = 0
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, profiler_options=opts):
      jax.block_until_ready(step())
  times = []
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, profiler_options=opts):
      for _ in range(n_steps):
        t = time.perf_counter()
        jax.block_until_ready(step())
        times.append(1e3 * (time.perf_counter() - t))
    pb = sorted(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True))
    out = summarize(pb[-1], 20)
  out["traced_step_ms"] = times
  return out


def dense_row(cfg, context, tactic, window_cells) -> dict:
  rng = np.random.default_rng([cfg.seed, context, 7])
  kh, d = cfg.num_kv_heads, cfg.head_dim
  cap = context + cfg.warmup + cfg.steps + 8
  dt = jnp.dtype(cfg.dtype)
  slab = (0.5 * rng.standard_normal((1, min(context, 1 << 14), kh, d))).astype(np.dtype(dt))
  reps = -(-context // slab.shape[1])
  k = np.tile(slab, (1, reps, 1, 1))[:, :context]
  kv = rkv.RollingKV.from_arrays(k, k, window_cells=window_cells,
                                 tile_cells=min(cfg.tile_cells, context), capacity=cap)
  del k
  if tactic != "stream":
    kv = kv.with_tactic(tactic)
  n = cfg.warmup + cfg.steps
  qs = [jnp.asarray(0.1 * rng.standard_normal((1, 1, cfg.num_heads, d)), dt) for _ in range(n)]
  cells = _new_cells(cfg, rng, n)
  state = dict(kv=kv, i=0)

  def step():
    i = state["i"]
    c = state["kv"]
    positions = jnp.full((1, 1), c.fill, jnp.int32)
    o, c = c.attend(qs[i], *cells[i], positions, window=None, softcap=None, scale=None,
                    impl=cfg.impl)
    state["kv"], state["i"] = c, i + 1
    return o

  for _ in range(cfg.warmup):
    jax.block_until_ready(step())
  times = []
  for _ in range(cfg.steps):
    t = time.perf_counter()
    jax.block_until_ready(step())
    times.append(time.perf_counter() - t)
  step_s = float(np.median(times))
  tail_b = (context - window_cells) * cfg.cell_bytes
  win_b = window_cells * cfg.cell_bytes
  return dict(kind=f"dense_{tactic}", context=context, window_cells=window_cells,
              step_ms=step_s * 1e3, step_ms_min=float(np.min(times)) * 1e3,
              mib_from_host_per_step=tail_b / MIB, mib_from_host_per_token=cfg.layers * tail_b / MIB,
              device_bytes=win_b,
              bound_ms=max(win_b / (cfg.hbm_gbps * 1e9), tail_b / (cfg.pcie_gbps * 1e9)) * 1e3)


def _compose(cfg, row) -> dict:
  """The model's tok/s from one layer: L layers of the measured step beside the weights' read
  (at the HBM rate); the bound: the device bytes (weights + L layers' reads) over HBM against
  the host bytes over PCIe, links at once (docs/DESIGN.md §6)."""
  weights_s = cfg.weight_bytes / (cfg.hbm_gbps * 1e9)
  measured = 1.0 / (cfg.layers * row["step_ms"] * 1e-3 + weights_s)
  dev = cfg.weight_bytes + cfg.layers * row.get("device_read_bytes", row["device_bytes"])
  host = cfg.layers * row["mib_from_host_per_step"] * MIB
  bound_s = max(dev / (cfg.hbm_gbps * 1e9), host / (cfg.pcie_gbps * 1e9))
  return dict(tok_s_composed=measured, tok_s_bound=1.0 / bound_s,
              ratio_to_bound=measured * bound_s)


def run(cfg: SparseBenchConfig = SparseBenchConfig()) -> dict:
  rows = []
  dense_memo = {}  # (context, tactic, window): the dense row does not depend on the selection
  for context in cfg.contexts:
    for slots in cfg.slot_cells:
      for sel in cfg.select_cells:
        if sel > slots or slots > context:
          continue
        r = sparse_row(cfg if not rows else dataclasses.replace(cfg, trace_steps=0), context,
                       slots, sel)  # only the first sparse row is traced
        r.update(_compose(cfg, r))
        rows.append(r)
        # Equal device memory: the dense window holds the sparse layer's device bytes.
        w = cfg.dense_window_cells or max(cfg.block_cells, (r["device_bytes"] // cfg.cell_bytes)
                                          // 512 * 512)
        w = min(w, context - cfg.block_cells)
        for tactic in cfg.dense_tactics:
          key = (context, tactic, w)
          if key not in dense_memo:
            dense_memo[key] = dense_row(cfg, context, tactic, w)
          dr = dict(dense_memo[key])
          dr.update(_compose(cfg, dr), slot_cells=slots, select_cells=sel)
          rows.append(dr)
        # What the freed VRAM buys (modeled): a resident dense layer of this context takes
        # context * cell bytes; as sparse sequences, that memory holds this many.
        r["freed"] = dict(
            dense_resident_layer_bytes=context * cfg.cell_bytes,
            sequences_at_dense_resident_memory=int(context * cfg.cell_bytes // r["device_bytes"]),
            # Modeled: sequences of this context whose sparse layers (own slots and summaries
            # each) fit one H200's KV budget, against the dense resident KV's count (0: offload).
            batch_at_device_budget_sparse=int(cfg.device_kv_budget_bytes
                                              // (cfg.layers * r["device_bytes"])),
            batch_at_device_budget_dense_resident=int(cfg.device_kv_budget_bytes
                                                      // (cfg.layers * context * cfg.cell_bytes)),
            dense_window_at_sparse_memory=w,
            speedup_vs_dense=[dr["step_ms"] / r["step_ms"] for dr in rows
                              if dr.get("slot_cells") == slots and dr.get("select_cells") == sel
                              and dr["context"] == context and dr["kind"] != "sparse"])
  return dict(config=dataclasses.asdict(cfg), rows=rows,
              environment=benchmarking.environment(),
              note=("synthetic planted topics (module docstring): hit rates measure the block "
                    "cache on a workload with structure, not a model's"))


def format_table(result: dict) -> str:
  cols = ["kind", "context", "slot_cells", "select_cells", "window_cells", "step_ms", "bound_ms",
          "hit_rate", "mib_from_host_per_token", "tok_s_composed", "tok_s_bound"]
  return benchmarking.format_table(result["rows"], cols)
