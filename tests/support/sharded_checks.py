"""The sharded paths' checks, run in a process of N host devices (tests/parallel_test.py).

``XLA_FLAGS=--xla_force_host_platform_device_count=N`` must be set before JAX starts, and the
suite's process has one device, so tests/parallel_test.py runs ``python -m
tests.support.sharded_checks N`` once per N and asserts on the JSON it prints: one entry per
check, ``{"ok": bool, "detail": str}``. Each check compares against the one-device run (logits
within the named gates of rkv/gates.py) or the float64 NumPy reference, or inspects placement.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rkv import gates, models, parallel
from rkv.models.config import PRESETS
from rkv.parallel.mesh import CELLS_BSKD, HEADS_BTHD, REPLICATED
from rkv.planner import ResidencyConfig, plan_sharded
from tests import numpy_reference
from tests.support.tolerances import TOLERANCES

PROMPT, STEPS = 8, 3          # prefill tokens, then decode steps
CAPACITY = PROMPT + STEPS + 5  # cells of each global layer (16: a seq slice of 8 or 4)


def _config(kv_heads: int, preset: str = "tiny-llama"):
  cfg = PRESETS[preset]
  if kv_heads != cfg.num_kv_heads:
    cfg = cfg.replace(num_heads=2 * kv_heads, num_kv_heads=kv_heads)
  return cfg


def _tokens(cfg, n):
  rng = np.random.default_rng(0)
  return jnp.asarray(rng.integers(0, cfg.vocab_size, (1, n)), jnp.int32)


def _chunks(prompt: int, chunk: int):
  return [(i, min(i + chunk, prompt)) for i in range(0, prompt, chunk)]


_REFERENCES: dict = {}


def _one_device(model, tokens, chunk):
  """The one-device run's logits: prefill in chunks, then one token a step (computed once per
  config, tokens, chunking and capacity: several checks share it; every check builds its model
  from nnx.Rngs(0), so one config is one set of weights)."""
  key = (model.config, chunk, CAPACITY, np.asarray(tokens).tobytes())
  if key not in _REFERENCES:
    _REFERENCES[key] = _one_device_run(model, tokens, chunk)
  return _REFERENCES[key]


def _one_device_run(model, tokens, chunk):
  fn = models.jit_forward(model)
  caches = models.init_caches(model.config, 1, CAPACITY)
  out = []
  for a, b in _chunks(PROMPT, chunk) + [(i, i + 1) for i in range(PROMPT, PROMPT + STEPS)]:
    logits, caches = fn(tokens[:, a:b], caches=caches)
    out.append(np.asarray(logits))
  return np.concatenate(out, axis=1)


def _sharded(sm, caches, tokens, chunk):
  out = []
  for a, b in _chunks(PROMPT, chunk) + [(i, i + 1) for i in range(PROMPT, PROMPT + STEPS)]:
    logits, caches = parallel.forward(sm, tokens[:, a:b], caches=caches)
    out.append(np.asarray(logits))
  return np.concatenate(out, axis=1), caches


def _gate(ref, got) -> tuple[bool, str]:
  m = gates.logit_metrics(ref, got)
  ok, why = gates.check_gate(m, np.float32)
  return ok, f"max|dlogit|={m.max_abs_logit:.3g} top1={m.top1_agreement:.3f} {'; '.join(why)}"


def model_vs_one_device(seq, heads, kind, tactic="stream", preset="tiny-llama"):
  """Logits of the sharded model over ``kind`` caches equal the one-device run's
  (tiny-mistral: every layer a sliding window of 8, so its caches are head-sharded rings)."""
  cfg = _config(max(2, heads), preset)
  model = models.Transformer(cfg, rngs=nnx.Rngs(0), impl="xla")
  tokens = _tokens(cfg, PROMPT + STEPS)
  mesh = parallel.make_mesh(seq=seq, heads=heads)
  chunk = PROMPT // seq  # a chunk must fit a seq slice
  ref = _one_device(model, tokens, chunk)
  sm = parallel.shard_model(model, mesh)
  if kind == "resident":
    caches = parallel.init_caches(cfg, mesh, 1, CAPACITY)
  else:
    caches = parallel.rolling_caches(cfg, mesh, 1, CAPACITY, window_cells=2, tile_cells=2,
                                     tactic=tactic,
                                     cpu_fraction=0.5 if tactic == "hybrid" else None)
  got, caches = _sharded(sm, caches, tokens, chunk)
  ok, detail = _gate(ref, got)
  rings = [w is not None and w < CAPACITY for w in cfg.layer_windows]
  if kind == "resident" and [c.ring for c in caches] != rings:
    ok, detail = False, f"{detail}; rings {[c.ring for c in caches]}, expected {rings}"
  if kind == "rolling":  # each device's tail lives in its own pinned_host memory
    for s, row in enumerate(caches[0].parts):
      for h, part in enumerate(row):
        dev = mesh.devices[s, h]
        tiles = part.tail.k
        if not tiles:
          ok, detail = False, f"{detail}; device {dev} has no tail tiles (test too small)"
        for t in tiles:
          if t.sharding.memory_kind != "pinned_host" or t.devices() != {dev}:
            ok, detail = False, (f"{detail}; a tail tile of device {dev} is "
                                 f"{t.sharding.memory_kind} on {t.devices()}")
  return ok, detail


def params_sharded(heads):
  """The fused projections are column-sharded (each device one contiguous block of its heads),
  o_proj / down_proj row-sharded, norms replicated; the relayout is a permutation."""
  cfg = _config(max(2, heads))
  model = models.Transformer(cfg, rngs=nnx.Rngs(0), impl="xla")
  mesh = parallel.make_mesh(seq=1, heads=heads)
  sm = parallel.shard_model(model, mesh)
  layer = sm.module.layers[0]
  want = {
      "qkv_proj": (layer.attn.qkv_proj.kernel[...], (cfg.hidden_size,
                   (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim // heads)),
      "o_proj": (layer.attn.o_proj.kernel[...], (cfg.num_heads * cfg.head_dim // heads,
                 cfg.hidden_size)),
      "gate_up_proj": (layer.mlp.gate_up_proj.kernel[...], (cfg.hidden_size,
                       2 * cfg.intermediate_size // heads)),
      "down_proj": (layer.mlp.down_proj.kernel[...], (cfg.intermediate_size // heads,
                    cfg.hidden_size)),
      "attn_norm": (layer.attn_norm.scale[...], (cfg.hidden_size,)),
  }
  bad = [f"{n}: shards {sorted({s.data.shape for s in x.addressable_shards})}"
         for n, (x, shape) in want.items()
         if {s.data.shape for s in x.addressable_shards} != {shape}]
  # Device j's block of qkv_proj holds exactly its q heads, then its k and v heads.
  orig = np.asarray(model.layers[0].attn.qkv_proj.kernel[...])
  relaid = np.asarray(layer.attn.qkv_proj.kernel[...])
  d, hq, hk = cfg.head_dim, cfg.num_heads // heads, cfg.num_kv_heads // heads
  nq, nk = cfg.num_heads * d, cfg.num_kv_heads * d
  for j, shard in enumerate(sorted(layer.attn.qkv_proj.kernel[...].addressable_shards,
                                   key=lambda s: s.index[1].start or 0)):
    block = np.asarray(shard.data)
    expect = np.concatenate([orig[:, j * hq * d:(j + 1) * hq * d],
                             orig[:, nq + j * hk * d:nq + (j + 1) * hk * d],
                             orig[:, nq + nk + j * hk * d:nq + nk + (j + 1) * hk * d]], axis=1)
    if not np.array_equal(block, expect):
      bad.append(f"qkv_proj block {j} is not [q_{j} | k_{j} | v_{j}]")
  if sorted(map(tuple, relaid.T.tolist())) != sorted(map(tuple, orig.T.tolist())):
    bad.append("the relaid qkv_proj is not a column permutation")
  return not bad, "; ".join(bad) or "ok"


def attention_vs_numpy(seq, heads):
  """One layer's ShardedKV attention (GQA 2, a half-filled cache, an empty slice) against the
  float64 NumPy reference over every cell written."""
  mesh = parallel.make_mesh(seq=seq, heads=heads)
  b, kh, g, d, cap = 2, 2 * heads, 2, 16, 24
  rng = np.random.default_rng(1)
  cache = parallel.ShardedKV.empty(mesh, b, cap, kh, d, jnp.float32)
  sh = lambda spec: jax.sharding.NamedSharding(mesh, spec)
  ks, vs, ps, errs = [], [], [], []
  kw = dict(window=None, softcap=None, scale=None, impl="xla")
  # With seq=2 (slices of 12): 10 cells and 1 to slice 0, then 3 that only slice 1 has room for.
  for a, t in ((0, 10), (10, 1), (11, 3)):
    q = rng.standard_normal((b, t, kh * g, d), np.float32)
    k = rng.standard_normal((b, t, kh, d), np.float32)
    v = rng.standard_normal((b, t, kh, d), np.float32)
    pos = np.broadcast_to(np.arange(a, a + t, dtype=np.int32), (b, t))
    o, cache = cache.attend(jax.device_put(q, sh(HEADS_BTHD)), jax.device_put(k, sh(HEADS_BTHD)),
                            jax.device_put(v, sh(HEADS_BTHD)), jax.device_put(pos, sh(REPLICATED)),
                            **kw)
    ks.append(k), vs.append(v), ps.append(pos)
    o_ref, _ = numpy_reference.attention(q, np.concatenate(ks, 1), np.concatenate(vs, 1),
                                         q_pos=pos, k_pos=np.concatenate(ps, 1), causal=True)
    tol = TOLERANCES["float32"]["o"]
    if not np.allclose(np.asarray(o), o_ref, atol=tol[0], rtol=tol[1]):
      errs.append(f"chunk at {a}: max |do| {np.abs(np.asarray(o) - o_ref).max():.3g}")
  if cache.k.sharding.spec != CELLS_BSKD:
    errs.append(f"cache k spec {cache.k.sharding.spec}")
  if int(cache.next_position()) != 14:
    errs.append(f"next_position {int(cache.next_position())}")
  return not errs, "; ".join(errs) or "ok"


def collectives(seq, heads):
  """Head sharding attends with no communication; the seq axis adds exactly the gathers of the
  merge (all-gather of o and lse)."""
  mesh = parallel.make_mesh(seq=seq, heads=heads)
  cache = parallel.ShardedKV.empty(mesh, 1, 16, 2 * heads, 16, jnp.float32)
  sh = lambda spec: jax.sharding.NamedSharding(mesh, spec)
  q = jax.device_put(jnp.ones((1, 1, 4 * heads, 16)), sh(HEADS_BTHD))
  k = jax.device_put(jnp.ones((1, 1, 2 * heads, 16)), sh(HEADS_BTHD))
  p = jax.device_put(jnp.zeros((1, 1), jnp.int32), sh(REPLICATED))
  fn = jax.jit(lambda c, q, k, p: c.attend(q, k, k, p, window=None, softcap=None, scale=None,
                                           impl="xla"))
  hlo = fn.lower(cache, q, k, p).compile().as_text()
  ops = {op: hlo.count(f" {op}(") + hlo.count(f" {op}-start(")
         for op in ("all-gather", "all-reduce", "collective-permute", "all-to-all",
                    "reduce-scatter")}
  want = {op: 0 for op in ops}
  if seq > 1:
    want["all-gather"] = 2
  return ops == want, f"collectives {ops}, expected {want}"


def model_collectives(heads):
  """The tensor-parallel decode step communicates only where the dense layers need it: one
  all-reduce after o_proj and one after down_proj per layer (XLA's), nothing else (a fused
  projection split across heads would add all-to-all / all-gather resharding)."""
  from rkv.parallel import model as model_lib
  cfg = _config(max(2, heads))
  model = models.Transformer(cfg, rngs=nnx.Rngs(0), impl="xla")
  mesh = parallel.make_mesh(seq=1, heads=heads)
  sm = parallel.shard_model(model, mesh)
  caches = parallel.init_caches(cfg, mesh, 1, CAPACITY)
  graphdef, treedef, leaves = sm._whole
  run = model_lib._whole_program(graphdef, treedef, heads, mesh, sm.impl, False)
  rep = jax.sharding.NamedSharding(mesh, REPLICATED)
  tokens = jax.device_put(jnp.zeros((1, 1), jnp.int32), rep)
  hlo = run.lower(leaves, tokens, tokens, caches).compile().as_text()
  ops = {op: hlo.count(f" {op}(") + hlo.count(f" {op}-start(")
         for op in ("all-gather", "all-reduce", "collective-permute", "all-to-all",
                    "reduce-scatter")}
  want = {op: 0 for op in ops} | {"all-reduce": 2 * cfg.num_layers}
  return ops == want, f"collectives {ops}, expected {want}"


def bad_inputs(n):
  """KV heads not divisible by the heads axis, a chunk larger than a seq slice: a ValueError
  naming what is wrong."""
  out = []
  cfg = PRESETS["tiny-llama"].replace(num_heads=6, num_kv_heads=3)  # K=3 over heads=n (2 or 4)
  model = models.Transformer(cfg, rngs=nnx.Rngs(0), impl="xla")
  try:
    parallel.shard_model(model, parallel.make_mesh(seq=1, heads=n))
    out.append(f"shard_model accepted K=3 over heads={n}")
  except ValueError as e:
    if "num_kv_heads=3 is not divisible" not in str(e):
      out.append(f"shard_model: {e}")
  mesh = parallel.make_mesh(seq=n, heads=1)
  cache = parallel.ShardedKV.empty(mesh, 1, 8, 2, 16, jnp.float32)
  t = 8 // n + 1
  x = jnp.zeros((1, t, 2, 16))
  try:
    cache.attend(jnp.zeros((1, t, 4, 16)), x, x, jnp.zeros((1, t), jnp.int32), window=None,
                 softcap=None, scale=None, impl="xla")
    out.append("a chunk larger than a seq slice was accepted")
  except ValueError as e:
    if "seq slice" not in str(e):
      out.append(f"ShardedKV.attend: {e}")
  return not out, "; ".join(out) or "ok"


def planner_end_to_end(seq, heads):
  """plan_sharded's per-device plans build the caches (some layers offloaded on every device),
  and the sharded model decodes the one-device logits through them; the table has a device
  column."""
  cfg = _config(max(2, heads))
  model = models.Transformer(cfg, rngs=nnx.Rngs(0), impl="xla")
  mesh = parallel.make_mesh(seq=seq, heads=heads)
  global CAPACITY
  saved = CAPACITY
  try:
    CAPACITY = 512 * seq  # the planner aligns windows and tiles to 128 cells
    # Budget for a window of 128 cells and one staging tile of 128 per layer and device.
    cell = 2 * (cfg.num_kv_heads // heads) * cfg.head_dim * 4 + 4
    budget = cfg.num_layers * (256 * cell + 512 * 4) / 2**20 * 1.01
    res = ResidencyConfig(vram_target_mib=budget, check_free=False, mode="stream",
                          tile_cells=128, min_tile_cells=128, reserve_mib=0)
    p = plan_sharded(cfg, CAPACITY, 1, seq=seq, heads=heads, residency=res,
                     devices=list(mesh.devices.flat))
    table = p.table()
    errs = []
    header = next((line for line in table.splitlines() if "tactic" in line), "")
    if not header.split() or header.split()[0] != "device" or str(mesh.devices.flat[0]) not in table:
      errs.append(f"the table has no device column: {header!r}")
    if p.fits or not all(lp.tactic == "stream" for q in p.plans for lp in q.layers):
      errs.append(f"expected every layer streamed, got {p.tactics()}")
    caches = parallel.caches_from_plan(cfg, mesh, p, 1)
    tokens = _tokens(cfg, PROMPT + STEPS)
    chunk = PROMPT
    ref = _one_device(model, tokens, chunk)
    got, caches = _sharded(parallel.shard_model(model, mesh), caches, tokens, chunk)
    ok, detail = _gate(ref, got)
    if not ok:
      errs.append(detail)
    return not errs, "; ".join(errs) or detail
  finally:
    CAPACITY = saved


def bench_smoke():
  """lab/sharded_bench.py at a tiny shape (a smoke run, not a timing): its rows, bounds, tail
  rate and ratios are there and the JSON is written."""
  import os
  import tempfile
  from lab import sharded_bench
  from rkv import benchmarking
  cfg = sharded_bench.BenchConfig(
      preset="tiny-llama", dtype="float32", devices=2, contexts=(384,), layouts=("1x1", "1xN"),
      resident_context=128, warmup=1, steps=1, budget_mib=0.08, resident_budget_mib=10,
      tile_cells=128,
      min_tile_cells=128, tail_tiles=2, tail_tile_cells=128, tail_repeats=1)
  result = sharded_bench.run(cfg, log=lambda m: None)
  errs = []
  rows = {(r["layout"], r["mode"]): r for r in result["rows"] + result["resident_scaling"]}
  for key in (("1x1", "auto"), ("1xN", "auto"), ("1x1", "resident"), ("1xN", "resident")):
    r = rows.get(key)
    if r is None or not (r["tokens_per_s"] > 0 and r["bound_tokens_per_s"] > 0
                         and r["bound_ratio"] > 0):
      errs.append(f"row {key}: {r}")
  if not all(h > 0 for h in rows[("1xN", "auto")]["host_kv_gib_per_device"]):
    errs.append("the 1xN row has no host tail on some device (budget too large for the smoke)")
  if rows[("1xN", "resident")]["host_kv_gib_per_device"] != [0.0, 0.0]:
    errs.append("the resident scaling row has a host tail")
  t = result["tail_rate"]
  if not (t["one_device"]["gbps"] > 0 and t["all_devices"]["gbps"] > 0 and t["devices"] == 2):
    errs.append(f"tail rate {t}")
  want = {"1xN_vs_1x1_at_384", "resident_1xN_vs_1x1_at_128", "tail_rate_all_vs_one"}
  if set(result["ratios"]) != want:
    errs.append(f"ratios {sorted(result['ratios'])}")
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "sharded_bench.json")
    benchmarking.write_json(path, result)
    if json.load(open(path))["rows"][0]["layout"] != "1x1":
      errs.append("the JSON does not round-trip")
  sharded_bench.format_table(result)
  return not errs, "; ".join(errs) or "ok"


def checks(n: int) -> dict:
  if n == 2:
    return {
        "params_heads2": lambda: params_sharded(2),
        "attention_seq2": lambda: attention_vs_numpy(2, 1),
        "attention_heads2": lambda: attention_vs_numpy(1, 2),
        "collectives_heads2": lambda: collectives(1, 2),
        "collectives_seq2": lambda: collectives(2, 1),
        "model_collectives_heads2": lambda: model_collectives(2),
        "resident_heads2": lambda: model_vs_one_device(1, 2, "resident"),
        "resident_seq2": lambda: model_vs_one_device(2, 1, "resident"),
        "ring_heads2": lambda: model_vs_one_device(1, 2, "resident", preset="tiny-mistral"),
        "rolling_stream_heads2": lambda: model_vs_one_device(1, 2, "rolling", "stream"),
        "rolling_cpu_seq2": lambda: model_vs_one_device(2, 1, "rolling", "cpu"),
        "planner_heads2": lambda: planner_end_to_end(1, 2),
        "bad_inputs": lambda: bad_inputs(2),
        "bench_smoke": bench_smoke,
    }
  if n == 4:
    return {
        "params_heads4": lambda: params_sharded(4),
        "attention_seq2_heads2": lambda: attention_vs_numpy(2, 2),
        "collectives_seq2_heads2": lambda: collectives(2, 2),
        "model_collectives_heads4": lambda: model_collectives(4),
        "resident_heads4": lambda: model_vs_one_device(1, 4, "resident"),
        "resident_seq4": lambda: model_vs_one_device(4, 1, "resident"),
        "resident_seq2_heads2": lambda: model_vs_one_device(2, 2, "resident"),
        "ring_seq2_heads2": lambda: model_vs_one_device(2, 2, "resident", preset="tiny-mistral"),
        "rolling_hybrid_seq2_heads2": lambda: model_vs_one_device(2, 2, "rolling", "hybrid"),
        "planner_seq2_heads2": lambda: planner_end_to_end(2, 2),
    }
  raise ValueError(f"no checks for {n} devices")


def main(argv):
  n = int(argv[1])
  if jax.device_count() != n:
    print(json.dumps({"device_count": {"ok": False, "detail": f"{jax.device_count()} devices"}}))
    return
  only = set(argv[2:])
  out = {}
  for name, fn in checks(n).items():
    if only and name not in only:
      continue
    t0, c0 = time.perf_counter(), time.process_time()
    try:
      ok, detail = fn()
    except Exception:  # a check that raises fails with its traceback, the others still run
      ok, detail = False, traceback.format_exc()
    out[name] = {"ok": bool(ok), "detail": detail, "wall_s": time.perf_counter() - t0,
                 "cpu_s": time.process_time() - c0}
  print("SHARDED_CHECKS " + json.dumps(out))


if __name__ == "__main__":
  main(sys.argv)
