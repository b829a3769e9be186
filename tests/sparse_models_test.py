"""The sparse tactic in the models: opt-in per layer, never selected, warned about, served by
caches_from_plan; exact when it selects every block; its quality measured against dense
(lab/sparse_quality.py on the shipped recall model)."""

import warnings

import numpy as np
import pytest
from flax import nnx

import rkv
from rkv import gates, models, sparse, tactics
from rkv import generate as gen


def _tiny(context=96):
  cfg = models.ModelConfig.preset("tiny-llama", dtype="float32")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the H200 profile on a CPU
    plan = rkv.plan(cfg, context, 1, residency=rkv.ResidencyConfig(mode="resident",
                                                                   vram_target_mib=1 << 20))
  return cfg, plan


def test_sparse_is_opt_in_and_never_selected():
  assert tactics.spec("sparse").exact is False and tactics.spec("sparse").cache == "block"
  for names in (tactics.TACTICS, tactics.MODES, tactics.SELECTOR_ORDER, tactics.OFFLOADED):
    assert "sparse" not in names
  assert all(tactics.spec(t).exact for t in tactics.TACTICS)
  cfg, plan = _tiny()
  with pytest.warns(sparse.ApproximateAttentionWarning, match="approximate"):
    sp = sparse.sparse_plan(plan, [1], sparse.PRESETS["tiny"])
  assert sp.tactics() == ("resident", "sparse") and sp.layers[1].block_cache == sparse.PRESETS["tiny"]
  assert sp.layers[1].host_bytes > 0 and "sparse" in sp.table()
  with warnings.catch_warnings():
    warnings.simplefilter("error", sparse.ApproximateAttentionWarning)
    sparse.sparse_plan(plan, [0], sparse.PRESETS["tiny"], trained_for_sparse=True)
  caches = gen.caches_from_plan(cfg, sp, 1)
  assert isinstance(caches[0], models.ResidentCache) and isinstance(caches[1], sparse.BlockCache)
  assert caches[1].capacity >= 96 and caches[1].config == sparse.PRESETS["tiny"]
  with pytest.raises(ValueError, match="out of range"):
    sparse.sparse_plan(plan, [5], trained_for_sparse=True)
  gcfg = models.ModelConfig.preset("tiny-mistral", dtype="float32")  # sliding-window layers
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    gplan = rkv.plan(gcfg, 96, 1, residency=rkv.ResidencyConfig(mode="resident",
                                                                vram_target_mib=1 << 20))
  with pytest.raises(ValueError, match="sliding-window"):
    sparse.sparse_plan(gplan, [0], trained_for_sparse=True)


def test_every_block_selected_decodes_like_dense_and_fewer_are_measured():
  cfg, plan = _tiny(48)
  model = models.Transformer(cfg, rngs=nnx.Rngs(0), impl="xla")
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 48)).astype(np.int32)
  dense = gen.decode_logits(model, tokens, models.init_caches(cfg, 1, 48), prefill_len=42)
  every = sparse.BlockCacheConfig(block_cells=8, device_slots=2 * 6, select_blocks=6,
                                  window_blocks=1)
  sp = sparse.sparse_plan(plan, None, every, trained_for_sparse=True)
  got = gen.decode_logits(model, tokens, gen.caches_from_plan(cfg, sp, 1), prefill_len=42)
  passed, reasons = gates.check_gate(gates.logit_metrics(dense, got), np.float32)
  assert passed, reasons
  few = sparse.BlockCacheConfig(block_cells=8, device_slots=2 * 2, select_blocks=2,
                                window_blocks=1)
  sp = sparse.sparse_plan(plan, None, few, trained_for_sparse=True)
  m = gates.logit_metrics(dense, gen.decode_logits(model, tokens, gen.caches_from_plan(cfg, sp, 1),
                                                   prefill_len=42))
  assert m.rows == 6 and np.isfinite(m.mean_kl) and m.max_abs_logit > 0  # 2 of 6 blocks: lossy


def test_sparse_quality_lab_on_the_recall_model():
  from lab import sparse_quality as lab
  from rkv.recall import load_recall_model
  model, _, task = load_recall_model(impl="xla")
  cfg = lab.SparseQualityConfig(lengths=(128,), depths=(0.5,), samples=1, batch=1,
                                selectors=("quest",), block_cells=16, select_blocks=9,
                                logit_steps=6)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    r = lab.quality(model, task, cfg, log=lambda s: None)
  # 9 blocks of 16 hold every cell of 128 + 2: the sparse path must answer as dense does.
  assert r["answers_equal_to_dense"] == {"quest": 1.0}
  assert r["logits_vs_dense"]["quest"]["128"]["0.5"]["top1_agreement"] == 1.0
  assert r["accuracy"]["quest"] == r["accuracy"]["dense"]


def test_dense_layers_keep_their_rolling_tactic():
  cfg = models.ModelConfig.preset("tiny-llama", dtype="float32")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    plan = rkv.plan(cfg, 512, 1, residency=rkv.ResidencyConfig(
        mode="stream", vram_target_mib=0.15, tile_cells=128, min_tile_cells=128))
  assert plan.tactics() == ("stream", "stream"), plan.table()
  sp = sparse.sparse_plan(plan, [0], sparse.PRESETS["tiny"], trained_for_sparse=True)
  assert sp.tactics() == ("sparse", "stream") and sp.layers[1] == plan.layers[1]
  caches = gen.caches_from_plan(cfg, sp, 1)
  assert isinstance(caches[0], sparse.BlockCache)
  assert isinstance(caches[1], rkv.RollingKV) and caches[1].tactic == "stream"
