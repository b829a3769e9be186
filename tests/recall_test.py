"""The recall task (rkv.recall) and the shipped needle-in-a-haystack model (rkv/assets/recall)."""

import json
import os

import numpy as np
import pytest

from lab import niah, recall_train
from rkv import recall
from rkv.models import hf

TASK = recall.RecallTask()


def test_vocabulary_ranges_are_disjoint_and_named():
  words = TASK.words()
  assert len(words) == TASK.vocab_size == len(set(words))
  keys = words[TASK.key_start:TASK.value_start]
  values = words[TASK.value_start:TASK.filler_start]
  filler = words[TASK.filler_start:]
  assert len(keys) == TASK.num_keys and all(k[0].isupper() for k in keys)
  assert len(values) == TASK.num_values and all(v.isdigit() for v in values)
  assert all(w.islower() for w in filler)
  assert words[TASK.bos_id] == recall.BOS and words[TASK.query_id] == recall.QUERY


@pytest.mark.parametrize("context_len", [TASK.min_context, 100, 1000])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_haystack_properties(context_len, depth):
  rng = np.random.default_rng([context_len, int(depth * 10)])
  h = recall.haystack(rng, context_len, depth, TASK)
  t = h.tokens
  assert t.dtype == np.int32 and t.shape == (context_len,)
  assert t[0] == TASK.bos_id and t[-2] == TASK.query_id and t[-1] == h.key
  # The needle: its key at the requested fraction of the haystack, then the answer.
  body = context_len - 3
  assert h.needle_start - 1 == round(depth * (body - TASK.pair_len))
  assert t[h.needle_start] == h.key
  np.testing.assert_array_equal(t[h.needle_start + 1:h.needle_start + TASK.pair_len], h.answer)
  # Every pair token occurs once in the haystack: keys distinct, values distinct, the query key
  # found only at the needle.
  assert len(h.pair_starts) == 1 + TASK.num_distractors
  pair_tokens = t[1:-2][t[1:-2] < TASK.filler_start]
  assert len(pair_tokens) == len(set(pair_tokens.tolist())) == len(h.pair_starts) * TASK.pair_len
  keys = t[h.pair_starts]
  assert np.all((keys >= TASK.key_start) & (keys < TASK.value_start))
  for s in h.pair_starts:
    vals = t[s + 1:s + TASK.pair_len]
    assert np.all((vals >= TASK.value_start) & (vals < TASK.filler_start))
  assert np.flatnonzero(t[:-1] == h.key).tolist() == [h.needle_start]


def test_haystack_rejects_bad_arguments():
  rng = np.random.default_rng(0)
  with pytest.raises(ValueError, match="context_len"):
    recall.haystack(rng, TASK.min_context - 1, 0.5, TASK)
  with pytest.raises(ValueError, match="depth"):
    recall.haystack(rng, 200, 1.5, TASK)


@pytest.mark.parametrize("repeat", [0.0, 0.5])
def test_training_batch_targets_are_the_query_answers(repeat):
  rng = np.random.default_rng(0)
  b = recall_train.training_batch(rng, 3, 128, TASK, num_queries=4, max_pairs=8, repeat=repeat)
  per_row = b.mask.sum(axis=1)
  assert np.all(per_row == 4 * TASK.value_len) if repeat == 0 else np.all(per_row >= 8)
  assert b.tokens.shape == b.positions.shape == b.targets.shape == b.mask.shape == (3, 128)
  np.testing.assert_array_equal(b.tokens[:, 1:], b.targets[:, :-1])
  assert np.all(np.diff(b.positions, axis=1) >= 1)  # increasing, jumps allowed
  for r in range(3):
    toks = np.concatenate([b.tokens[r], b.targets[r, -1:]])
    for i in np.flatnonzero(b.mask[r]):
      target = b.targets[r, i]
      # The target is what followed the previous token's first (only) occurrence.
      first = np.flatnonzero(toks[:i + 1] == toks[i])[0]
      assert first < i and toks[first + 1] == target
      # Pair and query tokens sit at consecutive positions (no jump inside them).
      assert b.positions[r, i] - b.positions[r, i - 1] == 1


def test_tokenizer_round_trip(tmp_path):
  tok = recall.build_tokenizer(TASK)
  rng = np.random.default_rng(1)
  h = recall.haystack(rng, 120, 0.5, TASK)
  text = recall.decode_text(tok, h.tokens)
  assert not text.startswith(recall.BOS)  # specials dropped
  ids = tok.encode(recall.BOS + " " + text).ids
  np.testing.assert_array_equal(ids, h.tokens)
  tok.save(str(tmp_path / "tokenizer.json"))
  again = hf.load_tokenizer(str(tmp_path))
  assert again.encode(text).ids == h.tokens[1:].tolist()


def test_saved_folder_loads_as_hf_llama(tmp_path):
  spec = recall.RecallModelSpec(num_layers=1, hidden_size=32, intermediate_size=64, num_heads=4,
                                num_kv_heads=2, head_dim=8)
  task = recall.RecallTask(num_keys=20, num_values=40, num_distractors=3)
  model = recall_train.init_model(task, spec, seed=3)
  recall_train.save_model(str(tmp_path), model, task, log={"note": "test"})
  loaded, tok, task2 = recall.load_recall_model(str(tmp_path), impl="reference")
  assert task2 == task and tok.get_vocab_size() == task.vocab_size
  cfg = loaded.config
  assert cfg.family == "llama" and cfg.tie_embeddings and cfg.rope.theta == spec.rope_theta
  tokens = recall.haystack(np.random.default_rng(0), 40, 0.5, task).tokens[None]
  np.testing.assert_allclose(np.asarray(loaded(tokens)), np.asarray(model(tokens)), atol=1e-5)
  # The training-loss forward mirrors the model's.
  np.testing.assert_allclose(np.asarray(recall_train.answer_logits(model, tokens, np.arange(40)[None],
                                                             5)),
                             np.asarray(model(tokens)[:, -5:]), atol=1e-5)
  with open(tmp_path / "config.json") as f:
    assert json.load(f)["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.slow
def test_train_runs_every_stage_kind_and_saves(tmp_path):
  spec = recall.RecallModelSpec(num_layers=1, hidden_size=32, intermediate_size=64, num_heads=4,
                                num_kv_heads=2, head_dim=8)
  cfg = recall_train.TrainConfig(
      stages=(recall_train.Stage(3, (32,), repeat=0.5), recall_train.Stage(2, (64,), jump_prob=0.5)),
      tokens_per_step=256, log_every=1, eval_lengths=(64,), eval_samples=2)
  lines = []
  model, log = recall_train.train(TASK, spec, cfg, out=str(tmp_path), log=lines.append)
  assert [h["step"] for h in log["history"]] == [1, 2, 3, 4, 5]
  assert all(np.isfinite(h["loss"]) for h in log["history"])
  assert set(log["eval_accuracy"]) == {"64"} and any("stage 1" in x for x in lines)
  loaded, _, task = recall.load_recall_model(str(tmp_path))
  assert task == TASK and loaded.config.num_layers == 1


# ----------------------------------------------------------------------------------------------
# The shipped model
# ----------------------------------------------------------------------------------------------
SHIPPED = os.path.isfile(os.path.join(recall.ASSET_DIR, recall.TASK_FILE))
needs_shipped = pytest.mark.skipif(not SHIPPED, reason="rkv/assets/recall not trained yet")
RECALL_BAR = 0.95


@pytest.fixture(scope="module")
def shipped():
  return recall.load_recall_model(impl="xla")


@needs_shipped
def test_shipped_folder_is_small_and_complete():
  files = set(os.listdir(recall.ASSET_DIR))
  assert {"config.json", "model.safetensors", "tokenizer.json", recall.TASK_FILE,
          recall.LOG_FILE} <= files
  size = sum(os.path.getsize(os.path.join(recall.ASSET_DIR, f)) for f in files)
  assert size < 4 << 20
  cfg = hf.load_config(recall.ASSET_DIR)
  assert cfg.num_kv_heads >= 2 and cfg.num_heads >= 4 and cfg.dtype.name == "float32"


@needs_shipped
@pytest.mark.slow
def test_shipped_model_retrieves_and_stream_answers_identically(shipped):
  model, tok, task = shipped
  n, length = 8, 1024
  rng = np.random.default_rng(2024)
  hs = [recall.haystack(rng, length, d, task) for d in np.linspace(0.0, 1.0, n)]
  prompts = np.stack([h.tokens for h in hs])
  answers = np.stack([h.answer for h in hs])
  cap = length + task.value_len
  caches = niah.tactic_caches(model.config, "resident", n, cap, window_cells=0, tile_cells=1)
  resident = recall.answer(model, prompts, task.value_len, caches=caches)
  acc = np.all(resident == answers, axis=-1).mean()
  assert acc >= RECALL_BAR, (acc, [recall.decode_text(tok, r) for r in resident])
  # Most of the KV in the host tail (W=128 of 1026 cells, tiles of 256): the same answers.
  caches = niah.tactic_caches(model.config, "stream", n, cap, window_cells=128, tile_cells=256)
  stream = recall.answer(model, prompts, task.value_len, caches=caches)
  np.testing.assert_array_equal(stream, resident)
