"""The residency planner: device budget → per-layer window cells, tactic table, and the selector.

``rkv.plan(model_config, context_len, batch, residency=ResidencyConfig(...))`` decides, for every
attention layer, where its KV cells live and how the tail is attended to (docs/DESIGN.md §4 step 1,
the model in §6). Everything fits: every layer is resident. Otherwise sliding-window layers stay
resident as a ring of their window, and the global layers share what is left evenly: a device
window of ``W`` cells (a multiple of :data:`WINDOW_ALIGN`), one staging tile, a pinned-host tail of
``P = capacity - W`` cells; each overflowing layer's tactic is forced by the mode or, with
``auto``, the one with the lowest modeled step time (:func:`select`). The planner only names
tactics; ``rkv.rolling_attention`` runs them.

Modules, each with its public surface (nothing outside imports a private name):

- :mod:`.profile`: :class:`Profile` (measured figures; ``rkv.probe`` writes one),
  :data:`H200_DEFAULT`
- :mod:`.cost`: the performance model (one layer's modeled step per tactic), the hybrid split,
  :func:`select`
- :mod:`.shape`: :class:`AttentionShape`, the protocol the planner reads from a model config
- :mod:`.layout`: a layer's bytes for a window and tile, and the window/tile search
- :mod:`.budget`: the derived device reserve, the KV budget, the device-fit check
- :mod:`.config`: :class:`ResidencyConfig` and the modes
- :mod:`.placement`: :func:`plan`, :class:`Plan`, :class:`LayerPlan`
- :mod:`.sharded`: :func:`plan_sharded`, :class:`ShardedPlan` (one plan per device of a mesh)

Glossary: B batch · K kv heads · D head dim · W window cells · P tail cells · L layers.
"""

from rkv.planner.profile import (MIB, GB, PROFILE_FORMAT, PROFILE_VERSION,
                                 READABLE_PROFILE_VERSIONS, default_profile_path, is_int, is_num,
                                 check_positive, FIGURES, OPTIONAL_RATES, OPTIONAL_OVERHEADS,
                                 Profile, H200_DEFAULT)
from rkv.planner.cost import (TACTICS, OFFLOAD_TACTICS, combine, device_time, cpu_rate,
                              partial_copy_time, resident_time, transfer_time, cpu_tail_time,
                              stream_time, cpu_time, hybrid_rates, hybrid_tail_time, hybrid_split,
                              cpu_share, hybrid_time, hybrid_time_at, head_time, ModeledTimes,
                              modeled_times, select)
from rkv.planner.shape import (ModelShape, AttentionShape, dtype_name, attention_shape)
from rkv.planner.layout import (WINDOW_ALIGN, DEFAULT_MIN_TILE_CELLS, POS_BYTES, Sizes,
                                cell_sizes, Layout, layer_layout, floor_align, tile_candidates,
                                size_window, best_layout, head_layout)
from rkv.planner.budget import (DEFAULT_PREFETCH_TILES, DEFAULT_CHUNK_TOKENS, DECODE_SPLITS,
                                DECODE_LAYERS_IN_FLIGHT, PREFILL_ACTIVATION_FACTOR,
                                PREFILL_FLAT_MIB, LOGITS_COPIES, DEFAULT_RESERVE_VOCAB,
                                XLA_WORKSPACE_MIB, Reserve, derive_reserve, model_sizes,
                                resolve_reserve, kv_budget_bytes, streamed_tile_bytes,
                                check_device_fit, format_number, format_bytes)
from rkv.planner.config import (DEFAULT_TILE_CELLS, MODES, MODE_TACTIC, ResidencyConfig)
from rkv.planner.placement import (CPU_KERNEL_TACTICS, LayerPlan, Plan, available_tactics, plan)
from rkv.planner.pool import pool_occupancy, pool_windows
from rkv.planner.sharded import ShardedPlan, device_share, plan_sharded

__all__ = [
    "pool_occupancy",
    "pool_windows",
    "MIB",
    "GB",
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "READABLE_PROFILE_VERSIONS",
    "default_profile_path",
    "is_int",
    "is_num",
    "check_positive",
    "FIGURES",
    "OPTIONAL_RATES",
    "OPTIONAL_OVERHEADS",
    "Profile",
    "H200_DEFAULT",
    "TACTICS",
    "OFFLOAD_TACTICS",
    "combine",
    "device_time",
    "cpu_rate",
    "partial_copy_time",
    "resident_time",
    "transfer_time",
    "cpu_tail_time",
    "stream_time",
    "cpu_time",
    "hybrid_rates",
    "hybrid_tail_time",
    "hybrid_split",
    "cpu_share",
    "hybrid_time",
    "hybrid_time_at",
    "head_time",
    "ModeledTimes",
    "modeled_times",
    "select",
    "ModelShape",
    "AttentionShape",
    "dtype_name",
    "attention_shape",
    "WINDOW_ALIGN",
    "DEFAULT_MIN_TILE_CELLS",
    "POS_BYTES",
    "Sizes",
    "cell_sizes",
    "Layout",
    "layer_layout",
    "floor_align",
    "tile_candidates",
    "size_window",
    "best_layout",
    "head_layout",
    "DEFAULT_PREFETCH_TILES",
    "DEFAULT_CHUNK_TOKENS",
    "DECODE_SPLITS",
    "DECODE_LAYERS_IN_FLIGHT",
    "PREFILL_ACTIVATION_FACTOR",
    "PREFILL_FLAT_MIB",
    "LOGITS_COPIES",
    "DEFAULT_RESERVE_VOCAB",
    "XLA_WORKSPACE_MIB",
    "Reserve",
    "derive_reserve",
    "model_sizes",
    "resolve_reserve",
    "kv_budget_bytes",
    "streamed_tile_bytes",
    "check_device_fit",
    "format_number",
    "format_bytes",
    "DEFAULT_TILE_CELLS",
    "MODES",
    "MODE_TACTIC",
    "ResidencyConfig",
    "CPU_KERNEL_TACTICS",
    "LayerPlan",
    "available_tactics",
    "Plan",
    "plan",
    "ShardedPlan",
    "device_share",
    "plan_sharded",
]
