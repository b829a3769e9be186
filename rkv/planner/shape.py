"""What the planner reads from a model config: the attention shape protocol (docs/DESIGN.md §4).

``num_layers`` int · ``num_kv_heads`` int (K) · ``head_dim`` int (D) · ``layer_windows`` tuple of
length ``num_layers``: ``None`` for a global layer, the sliding window (tokens) for a local one,
e.g. Gemma-3: ``(1024,)*5 + (None,)`` repeated; optional: ``num_heads`` (H, sizes the CPU partial
copy; default K), ``kv_dtype`` (the cache dtype; else ``dtype``; else bfloat16). A config without
``layer_windows`` (or with an empty one) is all-global, like Llama. :class:`AttentionShape` is that
protocol as a frozen dataclass; :func:`attention_shape` reads it from any config or mapping.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from rkv.cache import check_kv_dtype
from rkv.planner.profile import is_int

@runtime_checkable
class ModelShape(Protocol):
  """What :func:`plan` reads from a model config (see the module docstring)."""

  num_layers: int
  num_kv_heads: int
  head_dim: int
  layer_windows: tuple


@dataclasses.dataclass(frozen=True)
class AttentionShape:
  """The attention shape of a model, as the planner needs it. ``layer_windows[i]``: None for a
  global layer, the sliding window for a local one. ``num_heads`` (H) defaults to K."""

  num_layers: int
  num_kv_heads: int
  head_dim: int
  layer_windows: tuple = ()
  num_heads: int | None = None
  kv_dtype: str = "bfloat16"

  def __post_init__(self):
    where = "AttentionShape"
    for name in ("num_layers", "num_kv_heads", "head_dim"):
      val = getattr(self, name)
      if not is_int(val) or val < 1:
        raise ValueError(f"{where}: {name} must be a positive int, got {val!r}")
    windows = tuple(self.layer_windows) if self.layer_windows else (None,) * self.num_layers
    if len(windows) != self.num_layers:
      raise ValueError(f"{where}: layer_windows must have num_layers={self.num_layers} entries, "
                       f"got {len(windows)}")
    for i, w in enumerate(windows):
      if w is not None and (not is_int(w) or w < 1):
        raise ValueError(f"{where}: layer_windows[{i}] must be None (global) or a positive int "
                         f"(sliding window), got {w!r}")
    object.__setattr__(self, "layer_windows", tuple(None if w is None else int(w) for w in windows))
    if self.num_heads is not None and (not is_int(self.num_heads) or self.num_heads < 1
                                       or self.num_heads % self.num_kv_heads):
      raise ValueError(f"{where}: num_heads must be a positive multiple of num_kv_heads="
                       f"{self.num_kv_heads}, got {self.num_heads!r}")
    object.__setattr__(self, "kv_dtype", dtype_name(self.kv_dtype, where, "kv_dtype"))

  @property
  def query_heads(self) -> int:
    return self.num_heads or self.num_kv_heads


def dtype_name(dtype, where: str, name: str) -> str:
  return check_kv_dtype(dtype, where, name).name


def attention_shape(model_config, kv_dtype=None) -> AttentionShape:
  """Reads the planner's protocol from any config object or mapping (see the module docstring)."""
  if isinstance(model_config, AttentionShape) and kv_dtype is None:
    return model_config
  get = ((lambda n: model_config.get(n)) if isinstance(model_config, Mapping)
         else (lambda n: getattr(model_config, n, None)))
  missing = [n for n in ("num_layers", "num_kv_heads", "head_dim") if get(n) is None]
  if missing:
    raise ValueError(f"plan: model_config ({type(model_config).__name__}) lacks {missing}: it "
                     f"needs num_layers, num_kv_heads, head_dim and layer_windows (see "
                     f"rkv.AttentionShape)")
  windows = get("layer_windows")
  dtype = kv_dtype or get("kv_dtype") or get("dtype") or "bfloat16"
  return AttentionShape(num_layers=get("num_layers"), num_kv_heads=get("num_kv_heads"),
                        head_dim=get("head_dim"), layer_windows=tuple(windows or ()),
                        num_heads=get("num_heads"), kv_dtype=dtype)
