"""Block-sparse attention over a host-resident KV: block-selected attention, the selectors, the
block cache, the drafter's ring (issue 15; docs/DESIGN.md §9).

Approximate by design: a selector reads only some blocks, so a model not trained for it answers
close to, not exactly as, dense attention. Opt in per layer (:func:`sparse_plan`); the planner's
selector and ``auto`` mode never choose it.
"""

from rkv.sparse.blocks import (BlockSummaries, OracleSelector, QuestSelector, SELECTORS,
                               SelectionView, Selector, block_attention, block_rows, must_read,
                               select_blocks, selector, summarize)
from rkv.sparse.block_cache import (BlockCache, BlockCacheConfig, HostStore, PRESETS, Residency,
                                    StepCounters, check_residency, load, preset, save)
from rkv.sparse.ring import (DraftFallbackWarning, DraftRing, ResidentDraftKV, draft_kv,
                             host_copy_bytes)
from rkv.sparse.plan import (ApproximateAttentionWarning, block_cache_for, layer_bytes,
                             sparse_plan)

__all__ = [
    "BlockSummaries", "OracleSelector", "QuestSelector", "SELECTORS", "SelectionView", "Selector",
    "block_attention", "block_rows", "must_read", "select_blocks", "selector", "summarize",
    "BlockCache", "BlockCacheConfig", "HostStore", "PRESETS", "Residency", "StepCounters",
    "check_residency", "load", "preset", "save",
    "ApproximateAttentionWarning", "block_cache_for", "layer_bytes", "sparse_plan",
    "DraftFallbackWarning", "DraftRing", "ResidentDraftKV", "draft_kv", "host_copy_bytes",
]
