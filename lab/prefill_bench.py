"""Chunked prefill on the H200: the lab side of ``experiments/prefill_bench.py`` (its docstring
says what each part measures and how the bounds are formed)."""

from __future__ import annotations

import gc
import time

H, K, D = 32, 8, 128


def _attn_flops(t: int, depth: int, h: int = H, d: int = D) -> float:
  return 4.0 * h * d * (t * depth + t * (t + 1) / 2)


def kernel_rows(depths, chunks, *, h, kh, d, n_outer, pad=65536, log=print):
  """Kernel rows (module docstring); ``pad``: unfilled slots of the cache-capacity call."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import rkv
  from rkv import benchmarking
  from rkv.pallas import flash_attention as generic
  rows = []
  for t in chunks:
    for depth in depths:
      s = depth + t
      row = dict(part="kernel", depth=depth, chunk=t, keys=s, h=h, k=kh, d=d,
                 flops=_attn_flops(t, depth, h, d))
      rows.append(row)
      try:
        key = jax.random.key(depth + t)
        kq, kk, kv = jax.random.split(key, 3)
        q = jax.random.normal(kq, (1, t, h, d), jnp.bfloat16)
        k = jax.random.normal(kk, (1, s, kh, d), jnp.bfloat16)
        v = jax.random.normal(kv, (1, s, kh, d), jnp.bfloat16)
        q_pos = jnp.asarray(depth + np.arange(t, dtype=np.int32))[None]
        k_pos = jnp.asarray(np.arange(s, dtype=np.int32))[None]
        # A cache of fixed capacity: `pad` unfilled slots (position -1, zero K/V) after the chunk.
        k_cap = jnp.concatenate([k, jnp.zeros((1, pad, kh, d), k.dtype)], axis=1)
        v_cap = jnp.concatenate([v, jnp.zeros((1, pad, kh, d), v.dtype)], axis=1)
        pos_cap = jnp.concatenate([k_pos, jnp.full((1, pad), -1, jnp.int32)], axis=1)
        calls = {
            "tflops": jax.jit(lambda q, k, v, qp, kp: rkv.attention(q, k, v, q_pos=qp, k_pos=kp)),
            "default_pos_tflops": jax.jit(lambda q, k, v, qp, kp: rkv.attention(q, k, v)),
            "generic_tflops": jax.jit(lambda q, k, v, qp, kp: generic.flash_attention(
                q, k, v, q_pos=qp, k_pos=kp)),
        }
        args = (q, k, v, q_pos, k_pos)
        outs = {}
        for name, fn in calls.items():
            timing = benchmarking.time_fn(fn, *args, n_outer=n_outer)
            row[name] = row["flops"] / timing.median_s / 1e12
            row[name.replace("tflops", "s")] = timing.median_s
            outs[name] = fn(*args)
        cap_fn = calls["tflops"]
        timing = benchmarking.time_fn(cap_fn, q, k_cap, v_cap, q_pos, pos_cap, n_outer=n_outer)
        row["cache_tflops"] = row["flops"] / timing.median_s / 1e12
        o_cap, _ = cap_fn(q, k_cap, v_cap, q_pos, pos_cap)
        ref_o = outs["default_pos_tflops"][0].astype(jnp.float32)
        for name, (o, _) in list(outs.items()) + [("cache_tflops", (o_cap, None))]:
          row[name.replace("tflops", "max_abs_diff")] = float(
              jnp.max(jnp.abs(o.astype(jnp.float32) - ref_o)))
        row["ratio_vs_default"] = row["tflops"] / row["default_pos_tflops"]
        log(f"kernel T={t} depth={depth}: explicit {row['tflops']:.0f} TFLOP/s, default "
            f"{row['default_pos_tflops']:.0f} ({row['ratio_vs_default']:.2f}x), cache "
            f"{row['cache_tflops']:.0f}, generic {row['generic_tflops']:.0f}")
        del q, k, v, k_cap, v_cap, outs
      except Exception as e:  # one failing row must not lose the others
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
        log(f"kernel T={t} depth={depth}: error: {row['error']}")
      gc.collect()
  return rows


def trace_rows(specs, *, h, kh, d, calls_per_trace=10, log=print):
  """Where an explicit-positions call's time goes against the default one on the same pairs:
  ``calls_per_trace`` calls of each, traced, with the device kernels' total time per name."""
  import tempfile
  import jax
  import jax.numpy as jnp
  import numpy as np
  import rkv
  from lab import trace_summary
  rows = []
  for spec in specs:
    depth, t = (int(x) for x in spec.split(":"))
    s = depth + t
    kq, kk = jax.random.split(jax.random.key(depth + t))
    q = jax.random.normal(kq, (1, t, h, d), jnp.bfloat16)
    k = jax.random.normal(kk, (1, s, kh, d), jnp.bfloat16)
    q_pos = jnp.asarray(depth + np.arange(t, dtype=np.int32))[None]
    k_pos = jnp.asarray(np.arange(s, dtype=np.int32))[None]
    fns = dict(explicit=jax.jit(lambda q, k, qp, kp: rkv.attention(q, k, k, q_pos=qp, k_pos=kp)),
               default=jax.jit(lambda q, k, qp, kp: rkv.attention(q, k, k)))
    for name, fn in fns.items():
      jax.block_until_ready(fn(q, k, q_pos, k_pos))
      with tempfile.TemporaryDirectory() as tdir:
        with jax.profiler.trace(tdir):
          for _ in range(calls_per_trace):
            out = fn(q, k, q_pos, k_pos)
          jax.block_until_ready(out)
        summary = trace_summary.summarize_dir(tdir, top=12)
      kernels = {}
      for lines in summary["devices"].values():
        for line in lines.values():
          for ev in line["top"]:
            kernels[ev["name"]] = kernels.get(ev["name"], 0) + ev["total_ns"] / calls_per_trace
      row = dict(part="trace", depth=depth, chunk=t, call=name,
                 device_ns_per_call=sum(kernels.values()),
                 window_ns_per_call=(summary["device_window_ns"] or 0) / calls_per_trace,
                 kernels_ns_per_call=dict(sorted(kernels.items(), key=lambda kv: -kv[1])))
      rows.append(row)
      log(f"trace depth={depth} T={t} {name}: {row['device_ns_per_call'] / 1e3:.1f} us of "
          f"kernels a call: " + ", ".join(f"{n[:40]} {v / 1e3:.1f}" for n, v in
                                          list(row["kernels_ns_per_call"].items())[:6]))
  return rows


def dense_tflops(mc, t: int, n_outer: int) -> float:
  """bf16 GEMM rate at the MLP's shape ([t, hidden] @ [hidden, intermediate]), this run."""
  import jax
  import jax.numpy as jnp
  from rkv import benchmarking
  a = jnp.ones((t, mc.hidden_size), jnp.bfloat16)
  w = jnp.ones((mc.hidden_size, mc.intermediate_size), jnp.bfloat16)
  timing = benchmarking.time_fn(jax.jit(lambda a, w: a @ w), a, w, n_outer=n_outer)
  return 2.0 * t * mc.hidden_size * mc.intermediate_size / timing.median_s / 1e12


def _dense_flops(mc, t: int) -> float:
  hd = mc.head_dim
  qkvo = mc.hidden_size * hd * (2 * mc.num_heads + 2 * mc.num_kv_heads)
  mlp = 3 * mc.hidden_size * mc.intermediate_size
  # Projections and MLP for every token of every layer; the logits for the last token only
  # (the prefill step keeps only the last position's logits).
  return 2.0 * t * mc.num_layers * (qkvo + mlp) + 2.0 * mc.hidden_size * mc.vocab_size


def model_rows(depths, *, context, chunk, steps, profile_path, rates, preset="llama3-8b",
               memory_stats=None, log=print):
  """Prefill chunks through the 1M plan's caches at each depth (module docstring).
  ``preset``/``memory_stats`` (injected device stats) let a CPU test run it small."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from lab import decode_bench as db
  from rkv import generate as gen
  from rkv.models import Transformer, layered_forward
  cfg = db.BenchConfig(preset=preset, contexts=(context,), configs=("rkv_offload",),
                       budget="auto", profile_path=profile_path)
  mc = db.model_config(cfg)
  model = Transformer(mc, rngs=nnx.Rngs(0))
  jax.block_until_ready(nnx.state(model))
  step = layered_forward(model, last_only=True)
  # Compile the chunk's dense programs on tiny caches before any large fill: XLA's GEMM
  # autotuner allocates scratch when it compiles, which a 1M fill leaves no room for.
  gen.warm_up(model, lengths=(chunk,))
  plan, info = db._offload_plan(cfg, mc, context, memory_stats)
  log(f"model: plan for {context}: {info['tactics']}, window {info.get('window_cells')}, "
      f"host {info['host_kv_gib']:.2f} GiB")
  cell = db.kv_cell_bytes(mc)
  pcie = db.link_rates_gbps(cfg_profile(cfg))["stream"]
  rows = []
  for depth in depths:
    depth = min(depth, context - (steps + 1) * chunk)
    row = dict(part="model", depth=depth, chunk=chunk, context=context, tactics=info["tactics"],
               window_cells=info.get("window_cells"), host_kv_gib=info["host_kv_gib"])
    rows.append(row)
    try:
      t0 = time.perf_counter()
      caches = _filled(db, gen, mc, plan, depth, context)
      row["fill_s"] = time.perf_counter() - t0
      times = []
      tokens = jnp.zeros((1, chunk), jnp.int32)
      for i in range(steps + 1):
        pos = gen._positions(1, depth + i * chunk, chunk)
        t0 = time.perf_counter()
        logits, caches = step(tokens, pos, caches)
        jax.block_until_ready(logits)
        times.append(time.perf_counter() - t0)
      del caches
      chunk_s = float(np.median(times[1:]))
      mid = depth + chunk * (1 + steps / 2)  # the timed chunks' middle depth
      attn = mc.num_layers * _attn_flops(chunk, int(mid), mc.num_heads, mc.head_dim)
      dense = _dense_flops(mc, chunk)
      tail_bytes = sum(max(0, int(mid) - lp.window_cells) for lp in plan.layers
                       if lp.tactic in db.ROLLING_TACTICS) * cell
      compute_s = attn / (rates["attention"](mid) * 1e12) + dense / (rates["dense"] * 1e12)
      link_s = tail_bytes / (pcie * 1e9) if pcie else 0.0
      row.update(chunk_s=chunk_s, chunk_times_s=times, tokens_per_s=chunk / chunk_s,
                 attention_flops=attn, dense_flops=dense, tail_bytes=tail_bytes,
                 bound_s=max(compute_s, link_s),
                 bound_by="compute" if compute_s >= link_s else "pcie")
      row["bound_tokens_per_s"] = chunk / row["bound_s"]
      row["bound_ratio"] = chunk_s / row["bound_s"]
      log(f"model depth={depth}: {1e3 * chunk_s:.0f} ms a chunk ({row['tokens_per_s']:.0f} "
          f"tok/s), bound {1e3 * row['bound_s']:.0f} ms ({row['bound_by']}): "
          f"x{row['bound_ratio']:.2f}; fill {row['fill_s']:.1f} s")
    except Exception as e:  # one failing row must not lose the others
      row["error"] = f"{type(e).__name__}: {e}"[:2000]
      log(f"model depth={depth}: error: {row['error']}")
    gc.collect()
  return rows


def cfg_profile(cfg):
  import rkv
  return rkv.ResidencyConfig(profile_path=cfg.profile_path).resolve_profile()


def _filled(db, gen, mc, plan, depth, capacity):
  import jax
  caches = []
  for i, lp in enumerate(plan.layers):
    key = jax.random.fold_in(jax.random.key(depth), i)
    if lp.tactic in db.ROLLING_TACTICS:
      caches.append(gen.serve_rolling(lp, db.filled_rolling(
          mc, 1, capacity, depth, window_cells=lp.window_cells, tile_cells=lp.tile_cells,
          key=key)))
    else:
      caches.append(db.filled_resident(mc, 1, capacity, depth, key))
    jax.block_until_ready(caches[-1])
  return tuple(caches)


def integrate_1m(rows, context: int, chunk: int) -> dict:
  """Seconds of a whole ``context``-token prefill: every chunk's time, linear between the
  measured depths (the attention part grows linearly with depth)."""
  import numpy as np
  pts = sorted((r["depth"], r["chunk_s"]) for r in rows if "chunk_s" in r)
  if len(pts) < 2:
    return dict(error="fewer than two measured depths")
  depths = np.arange(0, context, chunk)
  est = np.interp(depths, [p[0] for p in pts], [p[1] for p in pts])
  bpts = sorted((r["depth"], r["bound_s"]) for r in rows if "bound_s" in r)
  bound = np.interp(depths, [p[0] for p in bpts], [p[1] for p in bpts])
  return dict(context=context, chunk=chunk, chunks=len(depths), seconds=float(est.sum()),
              minutes=float(est.sum() / 60), bound_seconds=float(bound.sum()),
              bound_ratio=float(est.sum() / bound.sum()),
              method="sum over chunks of the chunk time at its depth, linear between the "
                     f"measured depths {[p[0] for p in pts]}")
