"""Several devices: one model's KV and dense layers over a ``(seq, heads)`` mesh
(docs/DESIGN.md, "Several devices").

    mesh = rkv.parallel.make_mesh(seq=1, heads=2)           # KV heads over 2 devices
    sm = rkv.parallel.shard_model(model, mesh)               # tensor-parallel parameters
    caches = rkv.parallel.init_caches(model.config, mesh, batch, max_len)
    logits, caches = rkv.parallel.forward(sm, tokens, caches=caches)

``rkv.parallel.rolling_caches`` gives each device its own window and pinned-host tail;
``rkv.planner.plan_sharded`` plans budgets, the split and each device's tactic.
"""

from rkv.parallel.caches import (ShardedKV, ShardedRollingKV, caches_from_plan, init_caches,
                                 rolling_caches)
from rkv.parallel.mesh import AXES, HEADS, SEQ, make_mesh, memories, tail_memory_kind
from rkv.parallel.model import ShardedModel, forward, shard_model

__all__ = ["AXES", "HEADS", "SEQ", "ShardedKV", "ShardedModel", "ShardedRollingKV", "caches_from_plan", "forward",
           "init_caches", "make_mesh", "memories", "rolling_caches", "shard_model",
           "tail_memory_kind"]
