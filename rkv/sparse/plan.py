"""The ``sparse`` tactic in a plan: opt-in per layer, never chosen by the planner.

:func:`sparse_plan` marks global layers of a :class:`rkv.Plan` as ``sparse`` with a
:class:`BlockCacheConfig`; :func:`rkv.generate.caches_from_plan` then gives those layers a
:class:`BlockCache` (:func:`block_cache_for`) and every other layer the cache its tactic names.
The tactic is approximate for a model not trained to attend to selected blocks: marking a layer
warns (:class:`ApproximateAttentionWarning`) unless the caller says the model was trained for it.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np

from rkv.sparse.block_cache import BlockCache, BlockCacheConfig

TACTIC = "sparse"


class ApproximateAttentionWarning(UserWarning):
  """A layer attends to selected blocks only: outputs approximate dense attention."""


def layer_bytes(config: BlockCacheConfig, *, batch: int, capacity: int, num_kv_heads: int,
                head_dim: int, itemsize: int, quantized: bool = False) -> tuple[int, int]:
  """``(device_bytes, host_bytes)`` of one sparse layer: the slots (K, V, positions, scales)
  and the key summaries (2 float32 per channel, block and head) on the device; every cell on
  the host."""
  bs = config.block_cells
  nb = -(-capacity // bs)
  cell = 2 * num_kv_heads * head_dim * itemsize + 4 + (8 * num_kv_heads if quantized else 0)
  device = config.slot_cells * cell + batch * nb * num_kv_heads * head_dim * 8
  host = batch * nb * bs * cell
  return device, host


def sparse_plan(plan, layers=None, config: BlockCacheConfig = BlockCacheConfig(), *,
                trained_for_sparse: bool = False):
  """``plan`` with ``layers`` (default: every global layer) attended through a block cache with
  selected-block attention (``tactic="sparse"``, ``block_cache=config``); byte fields recomputed.

  Approximate: warns with :class:`ApproximateAttentionWarning` unless ``trained_for_sparse``.
  """
  from rkv.planner import Plan
  where = "sparse_plan"
  if not isinstance(plan, Plan):
    raise ValueError(f"{where}: plan must be a rkv.Plan, got {type(plan).__name__}")
  if not isinstance(config, BlockCacheConfig):
    raise ValueError(f"{where}: config must be a rkv.sparse.BlockCacheConfig, got "
                     f"{type(config).__name__}")
  n = len(plan.layers)
  if layers is None:
    layers = [lp.layer for lp in plan.layers if lp.kind == "global"]
  layers = sorted(set(int(i) for i in layers))
  for i in layers:
    if not 0 <= i < n:
      raise ValueError(f"{where}: layer {i} out of range [0, {n})")
    if plan.layers[i].kind != "global":
      raise ValueError(f"{where}: layer {i} is a sliding-window layer: it keeps its ring (the "
                       f"sparse tactic serves global layers)")
  if layers and not trained_for_sparse:
    warnings.warn(f"{where}: layers {layers} attend to {config.selected_cells} selected cells "
                  f"per KV head ({config.selector} selector) instead of all: approximate for a "
                  f"model not trained for it (measure with rkv.gates against dense)",
                  ApproximateAttentionWarning, stacklevel=2)
  s = plan.shape
  itemsize = np.dtype(plan.kv_dtype).itemsize if plan.kv_dtype != "bfloat16" else 2
  out = list(plan.layers)
  for i in layers:
    dev, host = layer_bytes(config, batch=plan.batch, capacity=plan.context_len,
                            num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, itemsize=itemsize,
                            quantized=plan.kv_dtype == "int8")
    out[i] = dataclasses.replace(out[i], tactic=TACTIC, block_cache=config, capacity=plan.context_len,
                                 window_cells=0, tail_cells=plan.context_len, tile_cells=None,
                                 host_cells=plan.context_len, resident_heads=None,
                                 device_bytes=dev, host_bytes=host, cpu_fraction=None)
  return dataclasses.replace(plan, layers=tuple(out))


def block_cache_for(lp, *, batch: int, capacity: int, num_kv_heads: int, head_dim: int,
                    dtype) -> BlockCache:
  """The empty :class:`BlockCache` of a ``sparse`` layer plan ``lp``."""
  if lp.tactic != TACTIC or not isinstance(lp.block_cache, BlockCacheConfig):
    raise ValueError(f"block_cache_for: layer {lp.layer} is not a sparse layer with a "
                     f"BlockCacheConfig (use rkv.sparse.sparse_plan)")
  return BlockCache.empty(batch, capacity, num_kv_heads, head_dim, config=lp.block_cache,
                          dtype=dtype)
