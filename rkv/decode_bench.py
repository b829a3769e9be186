"""End-to-end decode benchmark (issue 5): rkv vs Hugging Face transformers, tokens/s per context.

A model of a preset's shape (default ``llama3-8b``) with random weights initialised directly on the
device (no checkpoint), its KV cache filled **synthetically** to each context length (random K/V
and positions ``0..S-1`` written straight into the cache objects; nothing is prefilled through
the model), then ``warmup`` untimed and ``steps`` timed one-token greedy decode steps. Each step
is timed alone (the next token depends on the logits, so steps are sequential anyway) and the
figure is ``batch / median step seconds``.

Configurations (rows):

- ``rkv_resident``: every layer a :class:`rkv.models.ResidentCache`, the jitted decode step.
  Skipped (with the reason) when weights + KV + a margin exceed the device memory.
- ``rkv_offload``: :func:`rkv.plan` with ``vram_target_mib`` = ``offload_fraction`` (default half)
  of the full KV bytes, mode ``auto``; when the planner picks a tactic the synthetic fill cannot
  build (``head``: :data:`FILLED_TACTICS`) it re-plans with mode ``window`` (recorded as
  ``planner_fallback``); ``cpu`` / ``hybrid`` layers are served as planned
  (:func:`rkv.generate.serve_rolling`). ``offload_mode="force"``
  uses :func:`rkv.generate.force_stream` with ``W = (1 - offload_fraction) * context``.
  Window/staging cells on the device, whole tail tiles in ``pinned_host``, filled on the device
  and moved to the host tile by tile.
- ``hf_static``: ``LlamaForCausalLM`` (sdpa, bf16, random init on the torch device) with a
  ``StaticCache`` whose layers are allocated and filled with random K/V in place.
- ``hf_offloaded``: transformers' offloaded cache: ``StaticCache(..., offloading=True)``
  (transformers >= 4.56 / 5.x, ``cache_implementation="offloaded_static"``), else
  ``DynamicCache(offloading=True)`` (``"offloaded"``), else the legacy ``OffloadedStaticCache`` /
  ``OffloadedCache`` classes; the row's ``hf_cache`` says which one ran. HF offloads whole layers
  (every layer but the one computing lives on the CPU), so it moves the full KV each step.

The transformers rows run first, in a **spawned child process** that never imports JAX's GPU
backend: JAX preallocates most of the device memory when its backend starts, and the child must
have the whole card; the child exits (freeing everything) before the rkv rows start. Its rows come
back through a JSON file.

Ratios per context: ``rkv_resident / hf_static`` and ``rkv_offload / hf_offloaded`` (tokens/s).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import multiprocessing
import os
import statistics
import tempfile
import time
import traceback
from typing import Any

import numpy as np

GIB = 1 << 30
MIB = 1 << 20
CONFIGS = ("rkv_resident", "rkv_offload", "hf_static", "hf_offloaded")
OFFLOAD_MODES = ("auto", "window", "force")
# rkv.rolling.SCHEDULES, spelled out: this module is imported by the HF child, which must not
# import jax (tests/decode_bench_test.py checks the two agree).
SCHEDULES = ("eager", "unrolled")
# Plan tactics whose caches the synthetic fill builds: a filled RollingKV serves stream, cpu and
# hybrid alike; a head split would need a filled RollingKV per head group (not written yet).
FILLED_TACTICS = ("resident", "stream", "cpu", "hybrid")
RATIOS = (("rkv_resident", "hf_static"), ("rkv_offload", "hf_offloaded"))


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  preset: str = "llama3-8b"
  contexts: tuple[int, ...] = (131072, 524288)
  configs: tuple[str, ...] = CONFIGS
  batch: int = 1
  dtype: str = "bfloat16"
  warmup: int = 3
  steps: int = 16
  # Offloaded rows are slow (HF moves the whole KV over PCIe every step): fewer steps.
  offload_warmup: int = 2
  offload_steps: int = 6
  offload_fraction: float = 0.5
  offload_mode: str = "auto"
  tile_cells: int = 32768
  min_tile_cells: int = 4096
  margin_gib: float = 6.0
  device_memory_gib: float = 0.0  # 0: ask the device (JAX bytes_limit / torch total memory)
  host_memory_fraction: float = 0.85  # HF offloaded needs the full KV in host RAM
  hf_device: str = "auto"  # auto: cuda if torch sees one, else cpu
  impl: str = "auto"
  # The rolling caches' streaming schedule (rkv.rolling_attention's; None: its default).
  schedule: str | None = None
  # The planner's measured figures (rkv.Profile JSON, e.g. benchmarks/results/profile_h200.json);
  # None: ResidencyConfig's default (~/.cache/rkv/profile.json if present, else H200_DEFAULT).
  profile_path: str | None = None
  seed: int = 0

  def __post_init__(self):
    where = "BenchConfig"
    bad = [c for c in self.configs if c not in CONFIGS]
    if bad:
      raise ValueError(f"{where}: unknown configs {bad}; choose from {CONFIGS}")
    if self.offload_mode not in OFFLOAD_MODES:
      raise ValueError(f"{where}: offload_mode must be one of {OFFLOAD_MODES}")
    if self.schedule is not None and self.schedule not in SCHEDULES:
      raise ValueError(f"{where}: schedule must be one of {SCHEDULES} or None, got "
                       f"{self.schedule!r}")
    if not 0 < self.offload_fraction < 1:
      raise ValueError(f"{where}: offload_fraction must be in (0, 1)")
    if not self.contexts or any(int(c) < 2 for c in self.contexts):
      raise ValueError(f"{where}: contexts must be ints >= 2, got {self.contexts}")
    if self.steps < 1 or self.offload_steps < 1 or self.warmup < 0 or self.offload_warmup < 0:
      raise ValueError(f"{where}: steps >= 1 and warmup >= 0 required")
    if any(int(c) <= self.decode_steps for c in self.contexts):
      raise ValueError(f"{where}: every context must exceed the {self.decode_steps} decode "
                       f"steps (warm-up + timed), got {self.contexts}")

  def steps_for(self, name: str) -> tuple[int, int]:
    if name in ("rkv_offload", "hf_offloaded"):
      return self.offload_warmup, self.offload_steps
    return self.warmup, self.steps

  @property
  def decode_steps(self) -> int:
    return max(self.warmup + self.steps, self.offload_warmup + self.offload_steps)

  def capacity(self, context: int) -> int:
    """Cells each cache holds: exactly the context. The synthetic fill stops
    :attr:`decode_steps` short of it and the decode steps write the rest. (An exact power-of-two
    capacity also keeps torch's pinned host allocator, which rounds every allocation up to a
    power of two, from doubling the offloaded cache's host memory: 64 GiB of KV at 512K took
    128 GiB and the H200 host's OOM killer ended the run.)"""
    return int(context)

  def fill(self, context: int) -> int:
    """Synthetic cells written before decoding (positions ``0 .. fill-1``)."""
    return int(context) - self.decode_steps


def model_config(cfg: BenchConfig):
  from rkv.models import ModelConfig
  mc = ModelConfig.preset(cfg.preset, dtype=cfg.dtype)
  if any(w is not None for w in mc.layer_windows):
    raise ValueError(f"decode_bench: preset {cfg.preset!r} has sliding-window layers; the "
                     f"synthetic fill serves global-attention models (e.g. llama3-8b)")
  return mc


def kv_bytes(mc, cells: int, batch: int) -> int:
  return mc.kv_bytes_per_token() * cells * batch


def weight_bytes(mc) -> int:
  return int(mc.param_count() * np.dtype(mc.dtype).itemsize)


def _summary(times: list[float], warmup: int, batch: int) -> dict[str, Any]:
  timed = times[warmup:]
  med = statistics.median(timed)
  return dict(step_s=med, step_min_s=min(timed), step_max_s=max(timed), n_steps=len(timed),
              n_warmup=warmup, tokens_per_s=batch / med, first_step_s=times[0])


def _fits(need: int, limit: int | None, what: str) -> str | None:
  if limit is None or need <= limit:
    return None
  return (f"{what} needs {need / GIB:.1f} GiB (weights + KV + margin) but the device offers "
          f"{limit / GIB:.1f} GiB")


# ----------------------------------------------------------------------------------------------
# rkv side (JAX)
# ----------------------------------------------------------------------------------------------
def _rand_fn():
  import functools
  import jax

  @functools.partial(jax.jit, static_argnums=(1, 2))
  def rand(key, shape, dtype):
    return jax.random.normal(key, shape, dtype)
  return rand


def _positions(batch, lo, hi, cells):
  """``[B,cells]`` int32: positions lo..hi-1 in the first hi-lo slots, -1 after."""
  import jax.numpy as jnp
  idx = jnp.arange(cells, dtype=jnp.int32)
  pos = jnp.where(idx < hi - lo, lo + idx, -1).astype(jnp.int32)
  return jnp.broadcast_to(pos, (batch, cells))


def filled_resident(mc, batch, capacity, fill, key, rand):
  """A :class:`ResidentCache` of ``capacity`` cells whose first ``fill`` hold random K/V."""
  import jax
  import jax.numpy as jnp
  from rkv.models.kv import ResidentCache
  shape = (batch, capacity, mc.num_kv_heads, mc.head_dim)
  kk, kv = jax.random.split(key)
  return ResidentCache(k=rand(kk, shape, jnp.dtype(mc.dtype)), v=rand(kv, shape, jnp.dtype(mc.dtype)),
                       pos=_positions(batch, 0, fill, capacity), length=jnp.int32(fill))


def filled_rolling(mc, batch, capacity, fill, *, window_cells, tile_cells, key, rand):
  """A :class:`rkv.RollingKV` (``capacity`` cells, ``W = window_cells``) holding ``fill`` random
  cells: window and staging on the device, whole tail tiles generated on the device and moved to
  ``pinned_host`` one at a time (never a host numpy copy of the tail)."""
  import jax
  import jax.numpy as jnp
  from rkv.cache import KVBlock, RollingKV, _tail_bytes, _tail_layout, _untile
  from rkv.offload import memory
  w, tile = int(window_cells), int(tile_cells)
  if not 0 <= w < fill <= capacity:
    raise ValueError(f"filled_rolling: need 0 <= window_cells={w} < fill={fill} <= "
                     f"capacity={capacity}")
  dt = jnp.dtype(mc.dtype)
  kh, d = mc.num_kv_heads, mc.head_dim
  memory.check_host_pool(_tail_bytes(batch, capacity, kh, d, w, tile, np.dtype(dt)),
                         where="decode_bench", argument="context")
  n_tiles, staging_cells = _tail_layout(w, capacity, tile)
  n_full = (fill - w) // tile
  staged = (fill - w) - n_full * tile
  if staged > staging_cells or n_full > n_tiles:
    raise ValueError("filled_rolling: inconsistent layout")
  keys = iter(jax.random.split(key, 4 + 2 * n_tiles))

  def block(cells, lo, n):
    shape = (batch, cells, kh, d)
    if n:
      k, v = rand(next(keys), shape, dt), rand(next(keys), shape, dt)
    else:
      k, v = jnp.zeros(shape, dt), jnp.zeros(shape, dt)
    return KVBlock(k=k, v=v, pos=_positions(batch, lo, lo + n, cells))

  window = block(w, 0, w)
  t1 = w + n_full * tile
  staging = block(staging_cells, t1, staged)
  tiles = []
  for i in range(n_tiles):
    full = i < n_full
    b = block(tile, w + i * tile, tile if full else 0)
    kv_host = memory.to_host((b.k, b.v))
    tiles.append(KVBlock(k=kv_host[0], v=kv_host[1], pos=b.pos))
    del b
  tail = _untile(tiles, False)
  jax.block_until_ready((window, staging, tail))
  return RollingKV(window=window, staging=staging, tail=tail, window_cells=w, tile_cells=tile,
                   capacity=capacity, fill=fill)


def _tactics(p) -> list[str]:
  t = p.tactics
  return list(t() if callable(t) else t)


def _offload_plan(cfg: BenchConfig, mc, context: int):
  import rkv
  from rkv import generate as gen
  from rkv.models.kv import ROLLING_TACTICS
  cap = cfg.capacity(context)
  target_mib = (1 - cfg.offload_fraction) * kv_bytes(mc, cap, cfg.batch) / MIB
  info: dict[str, Any] = dict(vram_target_mib=target_mib, offload_mode=cfg.offload_mode)
  res = lambda mode: rkv.ResidencyConfig(mode=mode, vram_target_mib=target_mib,
                                         tile_cells=cfg.tile_cells,
                                         min_tile_cells=cfg.min_tile_cells,
                                         profile_path=cfg.profile_path)
  info["profile"] = res("auto").resolve_profile().source
  if cfg.offload_mode == "force":
    base = rkv.plan(mc, cap, cfg.batch, residency=res("window"))
    w = int(round((1 - cfg.offload_fraction) * context))
    p = gen.force_stream(base, window_cells=w, tile_cells=min(cfg.tile_cells, cap - w))
    info["planner_mode"] = "force"
  else:
    p = rkv.plan(mc, cap, cfg.batch, residency=res(cfg.offload_mode))
    info["planner_mode"] = cfg.offload_mode
    bad = sorted(set(_tactics(p)) - set(FILLED_TACTICS))
    if bad:
      info["planner_fallback"] = (f"mode {cfg.offload_mode!r} chose {bad}, which the synthetic "
                                  f"fill does not build: re-planned with mode 'window'")
      p = rkv.plan(mc, cap, cfg.batch, residency=res("window"))
      info["planner_mode"] = "window"
  info["tactics"] = {t: _tactics(p).count(t) for t in sorted(set(_tactics(p)))}
  info["device_kv_gib"] = p.device_bytes / GIB
  info["host_kv_gib"] = p.host_bytes / GIB
  info["modeled_step_s"] = p.step_time_s
  stream = [lp for lp in p.layers if lp.tactic in ROLLING_TACTICS]
  if stream:
    info["window_cells"] = sorted({lp.window_cells for lp in stream})
    info["tile_cells"] = sorted({lp.tile_cells for lp in stream})
  return p, info


def _decode_rkv(step, caches, context, warmup, steps, batch):
  import jax
  import jax.numpy as jnp
  tok = jnp.zeros((batch, 1), jnp.int32)
  times, dispatch = [], []
  for i in range(warmup + steps):
    pos = np.full((batch, 1), context + i, np.int32)
    t0 = time.perf_counter()
    logits, caches = step(tok, pos, caches)
    dispatch.append(time.perf_counter() - t0)  # the step returned: its host (Python) side
    tok = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
    jax.block_until_ready(tok)
    times.append(time.perf_counter() - t0)
  return times, dispatch, caches


def run_rkv(cfg: BenchConfig, log=print) -> list[dict[str, Any]]:
  import jax
  from flax import nnx
  from rkv import generate as gen
  from rkv import rolling
  from rkv.generate import _Stepper
  from rkv.models import Transformer, jit_forward
  from rkv.models.kv import ROLLING_TACTICS
  mc = model_config(cfg)
  names = [c for c in cfg.configs if c.startswith("rkv_")]
  if not names:
    return []
  stats = jax.devices()[0].memory_stats() or {}
  limit = (int(cfg.device_memory_gib * GIB) if cfg.device_memory_gib else
           (int(stats["bytes_limit"]) if "bytes_limit" in stats else None))
  t0 = time.perf_counter()
  model = Transformer(mc, rngs=nnx.Rngs(cfg.seed), impl=cfg.impl)
  jax.block_until_ready(nnx.state(model))
  log(f"rkv: {mc.name} random init {time.perf_counter() - t0:.1f} s "
      f"({weight_bytes(mc) / GIB:.1f} GiB weights)")
  forward = jit_forward(model, last_only=True)
  rand = _rand_fn()
  rows = []
  for ctx in cfg.contexts:
    ctx = int(ctx)
    cap, fill = cfg.capacity(ctx), cfg.fill(ctx)
    for name in names:
      row: dict[str, Any] = dict(config=name, context=ctx, capacity=cap, fill=fill,
                                 batch=cfg.batch, kv_gib=kv_bytes(mc, cap, cfg.batch) / GIB)
      rows.append(row)
      warmup, steps = cfg.steps_for(name)
      caches = None
      try:
        key = jax.random.key(cfg.seed + ctx)
        t1 = time.perf_counter()
        if name == "rkv_resident":
          need = weight_bytes(mc) + kv_bytes(mc, cap, cfg.batch) + int(cfg.margin_gib * GIB)
          why = _fits(need, limit, "resident KV")
          if why:
            row["skipped"] = why
            log(f"rkv {name} {ctx}: skipped: {why}")
            continue
          caches = tuple(filled_resident(mc, cfg.batch, cap, fill, k, rand)
                         for k in jax.random.split(key, mc.num_layers))
        else:
          plan, info = _offload_plan(cfg, mc, ctx)
          row.update(info)
          layer_keys = jax.random.split(key, mc.num_layers)
          caches = []
          for lp, k in zip(plan.layers, layer_keys):
            if lp.tactic in ROLLING_TACTICS:
              kv = filled_rolling(mc, cfg.batch, cap, fill, window_cells=lp.window_cells,
                                  tile_cells=lp.tile_cells, key=k, rand=rand)
              caches.append(gen.serve_rolling(lp, kv))
            else:
              caches.append(filled_resident(mc, cfg.batch, cap, fill, k, rand))
          caches = tuple(caches)
        jax.block_until_ready(caches)
        row["fill_s"] = time.perf_counter() - t1
        step = _Stepper(model, caches, forward, schedule=cfg.schedule)
        row["jitted"] = step.jitted
        row["schedule"] = None if step.jitted else (cfg.schedule or rolling.DEFAULT_SCHEDULE)
        times, dispatch, caches = _decode_rkv(step, caches, fill, warmup, steps, cfg.batch)
        row.update(_summary(times, warmup, cfg.batch))
        # Seconds until the step call returned (median of the timed steps): close to step_s
        # means the host side (Python dispatch, or a wait inside the step) bounds the step.
        row["host_s"] = float(np.median(dispatch[warmup:]))
        log(f"rkv {name} {ctx}: {row['tokens_per_s']:.2f} tok/s "
            f"(median step {1e3 * row['step_s']:.2f} ms, fill {row['fill_s']:.1f} s)")
      except Exception as e:  # one failing row must not lose the others
        row["error"] = f"{type(e).__name__}: {e}"
        log(f"rkv {name} {ctx}: error: {row['error']}")
      finally:
        del caches
        gc.collect()
  return rows


# ----------------------------------------------------------------------------------------------
# transformers side (torch), run in a spawned child
# ----------------------------------------------------------------------------------------------
def torch_available() -> str | None:
  """None if torch and transformers are installed, else the reason.

  Found, not imported: this is the JAX process, and importing torch here loads torch's own
  OpenMP runtime and thread pools beside the CPU-tail kernel's (the transformers rows run in a
  child process anyway)."""
  import importlib.util
  for name in ("torch", "transformers"):
    try:
      found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError) as e:
      return f"torch/transformers not importable: {type(e).__name__}: {e}"
    if not found:
      return f"torch/transformers not importable: ModuleNotFoundError: No module named '{name}'"
  return None


def _hf_config(mc, max_pos: int):
  from transformers import LlamaConfig
  kw = dict(vocab_size=mc.vocab_size, hidden_size=mc.hidden_size,
            intermediate_size=mc.intermediate_size, num_hidden_layers=mc.num_layers,
            num_attention_heads=mc.num_heads, num_key_value_heads=mc.num_kv_heads,
            head_dim=mc.head_dim, rms_norm_eps=mc.rms_norm_eps, max_position_embeddings=max_pos,
            tie_word_embeddings=mc.tie_embeddings, attn_implementation="sdpa")
  try:
    return LlamaConfig(rope_theta=mc.rope.theta, **kw)
  except TypeError:
    return LlamaConfig(**kw)


def _offloaded_kinds():
  """Offloaded cache builders transformers offers, best first: (name, build(config, cap))."""
  import inspect
  import transformers as tf
  kinds = []
  if "offloading" in inspect.signature(tf.StaticCache.__init__).parameters:
    kinds.append(("offloaded_static: StaticCache(offloading=True)",
                  lambda c, cap: tf.StaticCache(config=c, max_cache_len=cap, offloading=True)))
  if "offloading" in inspect.signature(tf.DynamicCache.__init__).parameters:
    kinds.append(("offloaded: DynamicCache(offloading=True)",
                  lambda c, cap: tf.DynamicCache(config=c, offloading=True)))
  if hasattr(tf, "OffloadedStaticCache"):
    kinds.append(("offloaded_static: OffloadedStaticCache",
                  lambda c, cap: tf.OffloadedStaticCache(config=c, max_cache_len=cap)))
  if hasattr(tf, "OffloadedCache"):
    kinds.append(("offloaded: OffloadedCache", lambda c, cap: tf.OffloadedCache()))
  return kinds


def _hf_fill(cache, hf_cfg, mc, batch, cap, fill, device, dtype, offloaded, gen):
  """Allocates every layer of ``cache`` and writes random K/V into slots ``0..fill-1``; for an
  offloaded cache every layer but the first then goes to the CPU (HF's state between steps)."""
  import torch
  if not hasattr(cache, "layers"):
    raise RuntimeError("this transformers' cache has no .layers (pre-4.56): synthetic fill "
                       "not implemented for it")
  if len(cache.layers) == 0:  # lazily replicated DynamicCache
    from transformers.cache_utils import DynamicLayer
    cache.layers.extend(DynamicLayer() for _ in range(mc.num_layers))
  fake = torch.zeros((batch, mc.num_kv_heads, 0, mc.head_dim), dtype=dtype, device=device)
  for i, layer in enumerate(cache.layers):
    try:
      layer.lazy_initialization(fake)
    except TypeError:
      layer.lazy_initialization(fake, fake)
    if layer.keys is not None and layer.keys.shape[-2] >= fill:  # static: fill in place
      layer.keys[:, :, :fill].normal_(generator=gen)
      layer.values[:, :, :fill].normal_(generator=gen)
    else:  # dynamic: the first `fill` cells
      shape = (batch, mc.num_kv_heads, fill, mc.head_dim)
      layer.keys = torch.randn(shape, dtype=dtype, device=device, generator=gen)
      layer.values = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    if offloaded and i > 0:
      layer.offload()
      if device.type == "cuda":
        torch.cuda.synchronize()
  if hasattr(cache, "cumulative_length"):
    cache.cumulative_length = fill


def _decode_hf(model, cache, context, warmup, steps, batch, device):
  import torch
  tok = torch.zeros((batch, 1), dtype=torch.long, device=device)
  sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
  times = []
  with torch.inference_mode():
    for i in range(warmup + steps):
      cp = torch.tensor([context + i], dtype=torch.long, device=device)
      sync()
      t0 = time.perf_counter()
      out = model(input_ids=tok, past_key_values=cache, cache_position=cp,
                  position_ids=cp[None].expand(batch, -1), use_cache=True)
      tok = out.logits[:, -1].argmax(-1, keepdim=True)
      sync()
      times.append(time.perf_counter() - t0)
  return times


def _dump(path: str, out: dict) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(out, f, default=str)
  os.replace(tmp, path)  # a reader never sees half a file


def run_hf(cfg: BenchConfig, log=print,
           partial_path: str | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
  """The transformers rows (call in a process whose device JAX has not claimed).
  ``partial_path``: the rows so far are written there after every row, so a child killed later
  (the host's OOM killer) still reports the rows it finished."""
  import torch
  import transformers
  from transformers import LlamaForCausalLM
  mc = model_config(cfg)
  names = [c for c in cfg.configs if c.startswith("hf_")]
  dev_name = cfg.hf_device if cfg.hf_device != "auto" else (
      "cuda" if torch.cuda.is_available() else "cpu")
  device = torch.device(dev_name)
  dtype = getattr(torch, cfg.dtype)
  env = dict(torch=torch.__version__, transformers=transformers.__version__, device=str(device),
             device_name=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu")
  limit = (int(cfg.device_memory_gib * GIB) if cfg.device_memory_gib else
           (torch.cuda.get_device_properties(0).total_memory if device.type == "cuda" else None))
  host_avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
  kinds = _offloaded_kinds()
  env["offloaded_caches_available"] = [k for k, _ in kinds]
  max_cap = max(cfg.capacity(int(c)) for c in cfg.contexts)
  hf_cfg = _hf_config(mc, max_cap)
  t0 = time.perf_counter()
  prev = torch.get_default_dtype()
  torch.set_default_dtype(dtype)
  try:
    with torch.device(device):
      model = LlamaForCausalLM(hf_cfg)
  finally:
    torch.set_default_dtype(prev)
  model = model.to(device=device, dtype=dtype).eval()
  if hasattr(model, "set_attn_implementation"):
    try:
      model.set_attn_implementation("sdpa")
    except Exception as e:  # noqa: BLE001
      env["sdpa_warning"] = str(e)
  env["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
  if device.type == "cuda":
    torch.cuda.synchronize()
  log(f"hf: LlamaForCausalLM random init {time.perf_counter() - t0:.1f} s on {device}")
  gen = torch.Generator(device=device).manual_seed(cfg.seed)
  rows = []
  for ctx in cfg.contexts:
    ctx = int(ctx)
    cap, fill = cfg.capacity(ctx), cfg.fill(ctx)
    kv = kv_bytes(mc, cap, cfg.batch)
    for name in names:
      row: dict[str, Any] = dict(config=name, context=ctx, capacity=cap, fill=fill,
                                 batch=cfg.batch, kv_gib=kv / GIB)
      rows.append(row)
      warmup, steps = cfg.steps_for(name)
      cache = None
      try:
        offloaded = name == "hf_offloaded"
        if offloaded:
          if not kinds:
            row["skipped"] = "this transformers offers no offloaded cache"
            continue
          if kv > cfg.host_memory_fraction * host_avail:
            row["skipped"] = (f"offloaded KV {kv / GIB:.1f} GiB exceeds "
                              f"{cfg.host_memory_fraction:.0%} of available host RAM "
                              f"{host_avail / GIB:.1f} GiB")
            log(f"hf {name} {ctx}: skipped: {row['skipped']}")
            continue
          kind, build = kinds[0]
          need = weight_bytes(mc) + 3 * kv // mc.num_layers + int(cfg.margin_gib * GIB)
        else:
          kind, build = "static: StaticCache", (
              lambda c, n: transformers.StaticCache(config=c, max_cache_len=n))
          need = weight_bytes(mc) + kv + int(cfg.margin_gib * GIB)
        row["hf_cache"] = kind
        why = _fits(need, limit, name)
        if why:
          row["skipped"] = why
          log(f"hf {name} {ctx}: skipped: {why}")
          continue
        t1 = time.perf_counter()
        cache = build(hf_cfg, cap)
        _hf_fill(cache, hf_cfg, mc, cfg.batch, cap, fill, device, dtype, offloaded, gen)
        row["fill_s"] = time.perf_counter() - t1
        times = _decode_hf(model, cache, fill, warmup, steps, cfg.batch, device)
        row.update(_summary(times, warmup, cfg.batch))
        log(f"hf {name} {ctx}: {row['tokens_per_s']:.2f} tok/s "
            f"(median step {1e3 * row['step_s']:.2f} ms, {kind})")
      except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {e}"
        row["traceback"] = traceback.format_exc(limit=6)
        log(f"hf {name} {ctx}: error: {row['error']}")
      finally:
        del cache
        gc.collect()
        if device.type == "cuda":
          torch.cuda.empty_cache()
        if partial_path:
          _dump(partial_path, dict(rows=rows, env=env, partial=True))
  return rows, env


def _hf_child(cfg_dict: dict, path: str) -> None:
  """Entry point of the spawned child: runs :func:`run_hf`, writes rows + env to ``path``."""
  cfg = BenchConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg_dict.items()})
  try:
    rows, env = run_hf(cfg, log=lambda m: print(m, flush=True), partial_path=path + ".partial")
    out = dict(rows=rows, env=env)
  except Exception as e:  # noqa: BLE001
    out = dict(rows=[], env={}, error=f"{type(e).__name__}: {e}",
               traceback=traceback.format_exc(limit=8))
  _dump(path, out)


def run_hf_isolated(cfg: BenchConfig, log=print, timeout_s: float = 420.0):
  """:func:`run_hf` in a spawned child process (the device is all the child's); returns
  ``(rows, env)``; rows are marked skipped when torch is missing or the child fails."""
  names = [c for c in cfg.configs if c.startswith("hf_")]
  if not names:
    return [], {}
  why = torch_available()
  if why:
    return [dict(config=n, context=int(c), skipped=why) for c in cfg.contexts for n in names], {}
  ctx = multiprocessing.get_context("spawn")
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "hf.json")
    p = ctx.Process(target=_hf_child, args=(dataclasses.asdict(cfg), path))
    p.start()
    p.join(timeout_s)
    if p.is_alive():
      p.terminate()
      p.join(10)
      err = f"transformers child exceeded {timeout_s:.0f} s and was terminated"
    elif not os.path.exists(path):
      err = f"transformers child exited with code {p.exitcode} and no result (OOM?)"
      if os.path.exists(path + ".partial"):  # the rows it finished before it died
        with open(path + ".partial") as f:
          part = json.load(f)
        done = {(r["config"], r["context"]) for r in part["rows"]}
        # The row in flight when the child died (and any after it) gets the error.
        rows = part["rows"] + [dict(config=n, context=int(c), error=err)
                               for c in cfg.contexts for n in names
                               if (n, int(c)) not in done]
        log(f"hf: {err}; kept the {len(part['rows'])} rows it finished")
        return rows, dict(part["env"], child_error=err)
    else:
      with open(path) as f:
        out = json.load(f)
      if out.get("error"):
        log(f"hf: child error: {out['error']}\n{out.get('traceback', '')}")
        env = dict(out.get("env", {}), error=out["error"])
        return [dict(config=n, context=int(c), error=out["error"]) for c in cfg.contexts
                for n in names], env
      return out["rows"], out["env"]
  log(f"hf: {err}")
  return [dict(config=n, context=int(c), error=err) for c in cfg.contexts for n in names], {}


# ----------------------------------------------------------------------------------------------
# The whole run, outputs
# ----------------------------------------------------------------------------------------------
def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """``a / b`` tokens/s for each pair of :data:`RATIOS` and context both rows measured."""
  tps = {(r["config"], r["context"]): r.get("tokens_per_s") for r in rows}
  out = []
  for ctx in sorted({r["context"] for r in rows}):
    for a, b in RATIOS:
      x, y = tps.get((a, ctx)), tps.get((b, ctx))
      out.append(dict(context=ctx, numerator=a, denominator=b,
                      ratio=(x / y) if x and y else None))
  return out


def run(cfg: BenchConfig, log=print) -> dict[str, Any]:
  """Transformers rows (child process) first, then the rkv rows; returns the JSON payload."""
  t0 = time.perf_counter()
  hf_rows, hf_env = run_hf_isolated(cfg, log=log)
  rkv_rows = run_rkv(cfg, log=log)
  from rkv import benchmarking
  mc = model_config(cfg)
  rows = rkv_rows + hf_rows
  order = {c: i for i, c in enumerate(CONFIGS)}
  rows.sort(key=lambda r: (r["context"], order.get(r["config"], 99)))
  return dict(benchmarking.environment(), hf=hf_env, config=dataclasses.asdict(cfg),
              model=dict(preset=mc.name, num_layers=mc.num_layers, hidden=mc.hidden_size,
                         heads=mc.num_heads, kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                         dtype=str(np.dtype(mc.dtype)), weight_gib=weight_bytes(mc) / GIB),
              rows=rows, ratios=ratios(rows), wall_s=time.perf_counter() - t0)


def format_table(result: dict[str, Any]) -> str:
  from rkv import benchmarking
  rows = [dict(r, step_ms=1e3 * r["step_s"] if r.get("step_s") else None,
               note=r.get("skipped") or r.get("error") or r.get("hf_cache") or
               r.get("planner_mode")) for r in result["rows"]]
  table = benchmarking.format_table(rows, ["config", "context", "kv_gib", "tokens_per_s",
                                           "step_ms", "n_steps", "note"])
  rat = benchmarking.format_table(result["ratios"], ["context", "numerator", "denominator",
                                                     "ratio"])
  return table + "\n\n" + rat


def write_plot(result: dict[str, Any], path: str, log=print) -> str | None:
  """tokens/s against context, one line per configuration; None (and a message) without
  matplotlib."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError as e:
    log(f"plot skipped: matplotlib not importable ({e})")
    return None
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name in CONFIGS:
    pts = sorted((r["context"], r["tokens_per_s"]) for r in result["rows"]
                 if r["config"] == name and r.get("tokens_per_s"))
    if pts:
      ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("context (tokens)")
  ax.set_ylabel("decode tokens/s (median)")
  ax.set_title(f"{result['model']['preset']} decode, batch {result['config']['batch']}, "
               f"{result.get('device', '')}")
  ax.grid(True, which="both", alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def write_json(result: dict[str, Any], path: str) -> None:
  from rkv import benchmarking
  benchmarking.write_json(path, result)


def main(cfg: BenchConfig, out: str, plot: str | None, log=print) -> dict[str, Any]:
  """The one call the script makes: run, print the table, write JSON and the plot."""
  result = run(cfg, log=log)
  write_json(result, out)
  log(format_table(result))
  log(f"wrote {out}")
  if plot:
    p = write_plot(result, plot, log=log)
    if p:
      log(f"wrote {p}")
  return result
