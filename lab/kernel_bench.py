"""Kernel benchmark: rkv's attention kernels against cuDNN and XLA, measured in the same run.

Rows (docs/DESIGN.md §7 shapes, bf16, H=32, K=8, D=128 unless stated):
  decode  B=1 at S=32K/128K/512K and B=8 at S=32K: effective K+V read bandwidth.
  prefill T=S=8K causal, MHA (K=32) and GQA 32/8: TFLOP/s, causal half counted.
Every rkv row carries the ratio to cuDNN's time in the same run and its max |Δ| to cuDNN's output.
On a CPU the quick mode checks the kernels (interpret mode) against the reference on small shapes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Callable

import jax
import jax.numpy as jnp

import rkv
from rkv import benchmarking
from rkv import cache as cache_lib
from rkv.pallas import decode_attention as decode_kernel
from rkv.pallas import flash_attention as flash_kernel
from rkv.planner.profile import H200_DEFAULT


@dataclasses.dataclass(frozen=True)
class Shape:
  kind: str  # decode | prefill
  b: int
  t: int
  s: int
  h: int = 32
  k: int = 8
  d: int = 128

  @property
  def name(self) -> str:
    return f"{self.kind} B={self.b} T={self.t} S={self.s} H={self.h} K={self.k} D={self.d}"

  def kv_bytes(self, itemsize: int) -> int:
    return 2 * self.b * self.s * self.k * self.d * itemsize

  def flops(self) -> float:
    # Two matmuls of 2*T*S*D each per head; causal prefill visits about half the pairs.
    full = 4.0 * self.b * self.h * self.t * self.s * self.d
    return full * (0.5 if self.kind == "prefill" else 1.0)


FULL_SHAPES = (
    Shape("decode", 1, 1, 32 * 1024), Shape("decode", 1, 1, 128 * 1024),
    Shape("decode", 1, 1, 512 * 1024), Shape("decode", 8, 1, 32 * 1024),
    Shape("prefill", 1, 8192, 8192, k=32), Shape("prefill", 1, 8192, 8192, k=8),
)
QUICK_SHAPES = (Shape("decode", 1, 1, 2048, h=8, k=2, d=64),
                Shape("prefill", 1, 256, 256, h=4, k=2, d=64))


def _inputs(shape: Shape, dtype, seed=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (shape.b, shape.t, shape.h, shape.d), dtype)
  k = jax.random.normal(kk, (shape.b, shape.s, shape.k, shape.d), dtype)
  v = jax.random.normal(kv, (shape.b, shape.s, shape.k, shape.d), dtype)
  return q, k, v


def _contenders(shape: Shape, on_gpu: bool, sweep: list[dict[str, Any]],
                tokamax) -> dict[str, Callable]:
  causal = shape.kind == "prefill"
  kernel = decode_kernel if shape.kind == "decode" else flash_kernel
  call = kernel.decode_attention if shape.kind == "decode" else kernel.flash_attention
  fns: dict[str, Callable] = {}
  # The public path: rkv.attention picks the decode kernel (T <= 16) or, for prefill, the Hopper
  # (Mosaic GPU) kernel where it applies and the generic flash kernel elsewhere.
  fns["rkv_pallas"] = jax.jit(
      lambda q, k, v: rkv.attention(q, k, v, causal=causal, impl="pallas")[0])
  if shape.kind == "prefill":
    fns["rkv_pallas_generic"] = jax.jit(lambda q, k, v: call(q, k, v, causal=causal)[0])
  for i, cfg in enumerate(sweep):
    bs = dataclasses.replace(kernel.BlockSizes(), **cfg)
    fns[f"rkv_pallas[{i}]"] = jax.jit(
        lambda q, k, v, bs=bs: call(q, k, v, causal=causal, block_sizes=bs)[0])
  fns["rkv_xla"] = jax.jit(lambda q, k, v: rkv.attention(q, k, v, causal=causal, impl="xla")[0])
  if on_gpu:
    fns["cudnn"] = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn"))
  else:
    fns["rkv_reference"] = jax.jit(
        lambda q, k, v: rkv.attention(q, k, v, causal=causal, impl="reference")[0])
  fns["jax_xla"] = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=causal, implementation="xla"))
  if tokamax is not None and shape.kind == "prefill":
    fns["tokamax_mosaic"] = jax.jit(lambda q, k, v: tokamax.dot_product_attention(
        q, k, v, is_causal=causal, implementation="mosaic"))
  return fns


def run(*, quick: bool, sweep_decode: list[dict[str, Any]] | None = None,
        sweep_prefill: list[dict[str, Any]] | None = None, use_tokamax: bool = False,
        n_outer: int = 7, log=print) -> dict[str, Any]:
  """Measures every contender on every shape; returns the JSON-ready result."""
  on_gpu = jax.default_backend() == "gpu"
  shapes = QUICK_SHAPES if quick else FULL_SHAPES
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  tokamax = None
  if use_tokamax:
    try:
      import tokamax  # noqa: F401  (benchmark peer only; rkv never imports it)
    except ImportError as e:
      log(f"tokamax not importable ({e}); skipping that peer")
  rows = []
  for shape in shapes:
    q, k, v = _inputs(shape, dtype)
    sweep = (sweep_decode if shape.kind == "decode" else sweep_prefill) or []
    fns = _contenders(shape, on_gpu, sweep, tokamax)
    peer = "cudnn" if on_gpu else "rkv_reference"
    outputs, results = {}, {}
    for name, fn in fns.items():
      try:
        timing = benchmarking.time_fn(fn, q, k, v, n_outer=n_outer, target_s=0.05 if on_gpu else None,
                                      n_inner=1 if not on_gpu else 5)
        outputs[name] = fn(q, k, v)
        results[name] = timing
      except Exception as e:  # a peer that rejects a shape is reported, not fatal
        log(f"  {shape.name}: {name} failed: {type(e).__name__}: {str(e)[:300]}")
    ref_out = outputs.get(peer)
    ref_t = results[peer].median_s if peer in results else None
    for name, timing in results.items():
      row = dict(shape=shape.name, kind=shape.kind, b=shape.b, t=shape.t, s=shape.s, h=shape.h,
                 k=shape.k, d=shape.d, dtype=jnp.dtype(dtype).name, impl=name,
                 time_us=timing.median_s * 1e6, time_min_us=timing.min_s * 1e6,
                 n_inner=timing.n_inner, n_outer=timing.n_outer)
      if name.startswith("rkv_pallas["):
        row["block_sizes"] = sweep[int(name[len("rkv_pallas["):-1])]
      if shape.kind == "decode":
        row["kv_read_tbps"] = shape.kv_bytes(jnp.dtype(dtype).itemsize) / timing.median_s / 1e12
      else:
        row["tflops"] = shape.flops() / timing.median_s / 1e12
      if ref_t is not None:
        row[f"speedup_vs_{peer}"] = ref_t / timing.median_s
      if ref_out is not None:
        diff = jnp.abs(outputs[name].astype(jnp.float32) - ref_out.astype(jnp.float32))
        row[f"max_abs_diff_vs_{peer}"] = float(jnp.max(diff))
      rows.append(row)
    for row in rows[-len(results):]:
      log("  " + ", ".join(f"{c}={row.get(c):.4g}" if isinstance(row.get(c), float)
                           else f"{c}={row.get(c)}" for c in
                           ("shape", "impl", "time_us", "kv_read_tbps", "tflops",
                            f"speedup_vs_{peer}") if c in row))
  return dict(benchmark="kernel_bench", environment=benchmarking.environment(),
              method="median of n_outer batches of n_inner back-to-back calls after 2 warm-ups; "
                     "wall clock around block_until_ready on the batch's last output",
              rows=rows)


KV_DTYPES = ("native", "int8")


def run_layers(*, contexts: list[int], layers: int, sweep_decode: list[dict[str, Any]] | None = None,
               n_outer: int = 7, kv_dtype: str = "native", log=print) -> dict[str, Any]:
  """Decode attention as a model step issues it: ``layers`` calls in one program, each over its
  own K/V (B=1, H=32, K=8, D=128, one query), for every context in ``contexts``. ``kv_dtype``:
  ``"native"`` (bfloat16 on a GPU, float32 on a CPU) or ``"int8"`` (K/V quantized per cell and
  KV head with bfloat16 scales, as a ``RollingKV`` keeps them; contenders rkv's Pallas and XLA
  paths, which read int8; the bytes count the scales). Why int8: the 2M int8 traces read its
  window at 2.16 TB/s against bf16's 4.31 at the same cells (docs/DESIGN.md §7).

  Why a stack and not one call: a lone call's time holds a launch and the host's dispatch, and
  back-to-back calls of one program re-read a K/V that may sit in the 60 MB L2 at short contexts;
  in a decode step the calls follow each other inside one program and each reads another
  layer's cache. Rows give microseconds a layer, the K+V bytes a layer over that time, and the
  ratio of that time to the bytes at ``HBM_TBPS`` (the copy rate of the H200 profile)."""
  if not isinstance(layers, int) or layers < 1:
    raise ValueError(f"run_layers: layers must be a positive int, got {layers!r}")
  if not contexts or any(not isinstance(c, int) or c < 1 for c in contexts):
    raise ValueError(f"run_layers: contexts must be positive ints, got {contexts!r}")
  if kv_dtype not in KV_DTYPES:
    raise ValueError(f"run_layers: kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
  on_gpu = jax.default_backend() == "gpu"
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  quantized = kv_dtype == "int8"
  rows = []
  for s in contexts:
    shape = Shape("decode", 1, 1, s)
    qs, ks, vs = zip(*(_inputs(shape, dtype, seed=layer) for layer in range(layers)))
    if quantized:  # each layer's K/V as (int8 cells, bfloat16 scales) pairs
      pairs = [cache_lib.quantize_pair(k, v, scale_dtype=jnp.bfloat16) for k, v in zip(ks, vs)]
      ks, vs = zip(*pairs)
    fns = {"rkv_pallas": None}
    fns.update({f"rkv_pallas[{i}]": cfg for i, cfg in enumerate(sweep_decode or [])})

    def stack(call):
      return jax.jit(lambda qs, ks, vs: [call(q, k, v) for q, k, v in zip(qs, ks, vs)])

    def scales(k, v):  # the int8 pair's operands: K/V cells and their scales
      if not quantized:
        return (k, v), {}
      (k8, k_scale), (v8, v_scale) = k, v
      return (k8, v8), dict(k_scale=k_scale, v_scale=v_scale)

    def pallas(q, k, v, bs=None):
      (k, v), kw = scales(k, v)
      if bs is None:
        return rkv.attention(q, k, v, impl="pallas", **kw)[0]
      return decode_kernel.decode_attention(q, k, v, block_sizes=bs, **kw)[0]

    contenders = {}
    for name, cfg in fns.items():
      bs = None if cfg is None else dataclasses.replace(decode_kernel.BlockSizes(), **cfg)
      contenders[name] = stack(functools.partial(pallas, bs=bs))
    def xla(q, k, v):
      (k, v), kw = scales(k, v)
      return rkv.attention(q, k, v, impl="xla", **kw)[0]

    if quantized:  # jax's attention reads no int8; rkv's XLA path does
      contenders["rkv_xla"] = stack(xla)
    else:
      if on_gpu:
        contenders["cudnn"] = stack(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, implementation="cudnn"))
      contenders["jax_xla"] = stack(lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, implementation="xla"))
    ref = None
    # int8: a byte a K/V element and two a scale (one scale per cell and KV head, K and V).
    layer_bytes = (shape.kv_bytes(1) + 2 * shape.b * shape.s * shape.k * 2 if quantized
                   else shape.kv_bytes(jnp.dtype(dtype).itemsize))
    for name, fn in contenders.items():
      try:
        timing = benchmarking.time_fn(fn, qs, ks, vs, n_outer=n_outer, n_inner=3)
        out = fn(qs, ks, vs)
      except Exception as e:  # a config a shape rejects is reported, not fatal
        log(f"  S={s}: {name} failed: {type(e).__name__}: {str(e)[:300]}")
        continue
      if ref is None:
        ref = out
      diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                 for a, b in zip(out, ref))
      per_layer = timing.median_s / layers
      row = dict(shape=f"{layers} layers x {shape.name}", kind="decode_layers", s=s,
                 layers=layers, impl=name, dtype=jnp.dtype(dtype).name,
                 kv_dtype="int8" if quantized else jnp.dtype(dtype).name,
                 us_per_layer=per_layer * 1e6, kv_read_tbps=layer_bytes / per_layer / 1e12,
                 hbm_bound_ratio=per_layer / (layer_bytes / (HBM_TBPS * 1e12)),
                 max_abs_diff_vs_rkv_pallas=diff, n_inner=timing.n_inner,
                 n_outer=timing.n_outer)
      if name.startswith("rkv_pallas["):
        row["block_sizes"] = sweep_decode[int(name[len("rkv_pallas["):-1])]
      rows.append(row)
      log(f"  S={s} {name}: {row['us_per_layer']:.2f} us a layer, "
          f"{row['kv_read_tbps']:.2f} TB/s, {row['hbm_bound_ratio']:.2f}x the byte time")
    del qs, ks, vs
  return dict(benchmark="kernel_bench_layers", environment=benchmarking.environment(),
              method=f"median of n_outer batches of n_inner calls of one program of {layers} "
                     "decode attentions over distinct K/V, after 2 warm-ups",
              rows=rows)


# The stacked rows' ratio uses the HBM rate of rkv's shipped H200 profile (its decode-step
# bounds use the same figure).
HBM_TBPS = H200_DEFAULT.hbm_gbps / 1e3

LAYER_COLUMNS = ["shape", "impl", "us_per_layer", "kv_read_tbps", "hbm_bound_ratio",
                 "max_abs_diff_vs_rkv_pallas"]


COLUMNS = ["shape", "impl", "time_us", "kv_read_tbps", "tflops", "speedup_vs_cudnn",
           "speedup_vs_rkv_reference", "max_abs_diff_vs_cudnn", "max_abs_diff_vs_rkv_reference"]


def parse_sweep(text: str) -> list[dict[str, Any]]:
  """A JSON list of BlockSizes overrides, e.g. '[{"block_k": 128, "num_warps": 4}]'."""
  if not text:
    return []
  try:
    cfgs = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"sweep must be a JSON list of objects, got {text!r}: {e}") from e
  if not isinstance(cfgs, list) or not all(isinstance(c, dict) for c in cfgs):
    raise ValueError(f"sweep must be a JSON list of objects, got {text!r}")
  return cfgs


# float32 inputs on the CPU: every backend must match the float32 reference this closely (the
# test suite's float32 tolerance is 2e-5 against float64; bf16 GPU rows are compared to cuDNN and
# only reported).
SELF_CHECK_ATOL = 1e-4


def self_check(result: dict[str, Any]) -> list[str]:
  """Rows whose output strays from the float32 reference (CPU quick mode); empty when all agree."""
  bad = []
  for row in result["rows"]:
    diff = row.get("max_abs_diff_vs_rkv_reference")
    if diff is not None and not diff <= SELF_CHECK_ATOL:
      bad.append(f"{row['shape']} {row['impl']}: {diff:.3g}")
  return bad
