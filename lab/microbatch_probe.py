"""Half batches decoded side by side (experiments/microbatch_probe.py's measurements).

Every cache is built and planned as lab.decode_bench builds an rkv_offload row under
budget="auto"; a split batch's caches are planned one after the other, the ``j``-th of ``m`` with
``1 / (m - j)`` of the device memory then free, so that each gets an even share.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp

from rkv import benchmarking
from rkv.offload.cpu_attention import TAIL_THREADS_ENV
from lab import decode_bench as db


def _share_stats(stats: dict, share: int) -> dict:
  """``stats`` with ``bytes_limit`` lowered so that ``1 / share`` of the free memory is free."""
  in_use = int(stats.get("bytes_in_use", 0))
  free = int(stats["bytes_limit"]) - in_use
  return dict(stats, bytes_limit=in_use + free // share)


def _decode(step, caches, start: int, n: int, batch: int):
  """``n`` greedy steps from position ``start`` (queued one ahead, as generate runs them);
  returns the caches once the last token is ready."""
  from rkv.generate import greedy_pick
  tok = jnp.zeros((batch, 1), jnp.int32)
  pos = jnp.full((batch, 1), start, jnp.int32)
  for _ in range(n):
    tok, pos, caches = step.decode(tok, pos, caches, greedy_pick)
  jax.block_until_ready(tok)
  return caches


def _timed(step, caches, start: int, warmup: int, n: int, batch: int):
  """``warmup`` untimed steps, then ``n`` timed ones: (their seconds, the caches)."""
  caches = _decode(step, caches, start, warmup, batch)
  t0 = time.perf_counter()
  caches = _decode(step, caches, start + warmup, n, batch)
  return time.perf_counter() - t0, caches


def _concurrent(steps, caches, start, warmup, n, batch):
  """Each cache set decoded in its own thread: ``warmup`` steps, a barrier, ``n`` timed steps.
  Returns (seconds of the timed steps, new caches)."""
  m = len(steps)
  barrier = threading.Barrier(m + 1)
  out, errors = [None] * m, []

  def worker(j):
    try:
      c = _decode(steps[j], caches[j], start, warmup, batch)
      barrier.wait()
      out[j] = _decode(steps[j], c, start + warmup, n, batch)
    except BaseException as e:  # noqa: BLE001 - surfaced below
      errors.append(e)
      barrier.abort()

  threads = [threading.Thread(target=worker, args=(j,), name=f"microbatch-{j}") for j in range(m)]
  for t in threads:
    t.start()
  try:
    barrier.wait()
  except threading.BrokenBarrierError:
    pass
  t0 = time.perf_counter()
  for t in threads:
    t.join()
  elapsed = time.perf_counter() - t0
  if errors:
    raise errors[0]
  return elapsed, out


def run(*, preset: str, batch: int, microbatches: int, context: int, profile_path: str | None,
        warmup: int, steps: int, cpu_threads: list[int], repeats: int, log=print,
        memory_stats=None, **bench) -> dict:
  """The rows of experiments/microbatch_probe.py. ``memory_stats``: returns the device's
  ``memory_stats()`` (default: device 0's; tests inject them on the CPU, which has none);
  ``bench``: further lab.decode_bench.BenchConfig fields (a tiny model's dtype, tile cells)."""
  if not isinstance(microbatches, int) or microbatches < 2:
    raise ValueError(f"microbatch_probe: microbatches must be an int >= 2, got {microbatches!r}")
  if not isinstance(batch, int) or batch % microbatches:
    raise ValueError(f"microbatch_probe: batch={batch!r} must be a multiple of "
                     f"microbatches={microbatches}")
  stats_of = memory_stats or (lambda: jax.devices()[0].memory_stats())
  from flax import nnx
  from rkv.generate import Stepper
  from rkv.models import Transformer
  variants_per_round = 2 + len(cpu_threads)  # split, concurrent, concurrent_tN on one fill
  cells = variants_per_round * (warmup + steps) + 2
  half = batch // microbatches

  def config(b):
    # decode_steps (offload_warmup + 2 * offload_steps) is the room the fill leaves for decoding.
    return db.BenchConfig(preset=preset, contexts=(context,), configs=("rkv_offload",), batch=b,
                          budget="auto", profile_path=profile_path, offload_warmup=0,
                          offload_steps=-(-cells // 2), warmup=0, steps=-(-cells // 2),
                          **bench)

  whole_cfg, half_cfg = config(batch), config(half)
  mc = db.model_config(whole_cfg)
  model = Transformer(mc, rngs=nnx.Rngs(0))
  jax.block_until_ready(nnx.state(model))
  db.warm_layered_programs(model, mc, whole_cfg, log)
  db.warm_layered_programs(model, mc, half_cfg, log)
  fill = whole_cfg.fill(context)
  rows: list[dict[str, Any]] = []

  def add(variant, round_, elapsed, n_tokens, **extra):
    row = dict(variant=variant, round=round_, batch=batch, microbatches=microbatches,
               context=context, steps=steps, seconds=elapsed, tokens_per_s=n_tokens / elapsed,
               **extra)
    rows.append(row)
    log(f"{variant} (round {round_}): {row['tokens_per_s']:.2f} tok/s")

  def failed(variant, round_, e):
    rows.append(dict(variant=variant, round=round_, error=f"{type(e).__name__}: {e}"))
    log(f"{variant}: {rows[-1]['error']}")

  for r in range(repeats):
    # The whole batch: one plan, one cache set, one thread.
    try:
      plan, info = db._offload_plan(whole_cfg, mc, context, stats_of())
      caches = db.build_caches(whole_cfg, mc, context, jax.random.key(r), plan, log=log,
                               what=f"whole {batch}")
      step = Stepper(model, caches, None)
      elapsed, caches = _timed(step, caches, fill, warmup, steps, batch)
      add("whole", r, elapsed, batch * steps, plan=info)
    except Exception as e:  # noqa: BLE001 - keep the other rows
      failed("whole", r, e)
    finally:
      caches = step = None
      gc.collect()
    # The same rows as `microbatches` cache sets, each planned with its share of what is free.
    sets, infos = [], []
    try:
      for j in range(microbatches):
        stats = stats_of()
        plan, info = db._offload_plan(half_cfg, mc, context,
                                      _share_stats(stats, microbatches - j))
        sets.append(db.build_caches(half_cfg, mc, context, jax.random.fold_in(
            jax.random.key(r), j), plan, log=log, what=f"part {j} of {microbatches}"))
        infos.append(info)
      stepper = [Stepper(model, c, None) for c in sets]
      start = fill
      # split: one thread, one part after the other
      t_total = 0.0
      for j in range(microbatches):
        elapsed, sets[j] = _timed(stepper[j], sets[j], start, warmup, steps, half)
        t_total += elapsed
      add("split", r, t_total, batch * steps, plans=infos)
      start += warmup + steps
      for threads in [None] + list(cpu_threads):
        name = "concurrent" if threads is None else f"concurrent_t{threads}"
        old = os.environ.get(TAIL_THREADS_ENV)
        if threads is not None:
          os.environ[TAIL_THREADS_ENV] = str(threads)
        try:
          elapsed, sets = _concurrent(stepper, sets, start, warmup, steps, half)
        finally:
          if old is None:
            os.environ.pop(TAIL_THREADS_ENV, None)
          else:
            os.environ[TAIL_THREADS_ENV] = old
        add(name, r, elapsed, batch * steps, cpu_threads=threads)
        start += warmup + steps
    except Exception as e:  # noqa: BLE001 - keep the other rows
      failed("microbatches", r, e)
    finally:
      sets = stepper = None
      gc.collect()
  return dict(benchmark="microbatch_probe", environment=benchmarking.environment(),
              method="tokens of every row over the wall time of the timed steps (after a "
                     "barrier when concurrent); each row's warm-up steps untimed",
              rows=rows)
