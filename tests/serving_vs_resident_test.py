"""The gate of ragged and continuous batches (issue 14): every sequence a rkv.serving.Scheduler
runs through a pool gets the logits of its own single-sequence run (the model without a cache
over its whole context), within rkv.gates' float32 thresholds, per sequence; sampled sequences
sample what rkv.generate.generate samples alone; a kept conversation's next turn prefills only
its new tokens and still passes the gate.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rkv import gates
from rkv import generate as gen
from rkv import models
from rkv import pool as pool_lib
from rkv import serving

CHUNK = 16


@pytest.fixture(scope="module")
def model():
  cfg = models.ModelConfig.preset("tiny-llama", dtype="float32")
  return models.Transformer(cfg, rngs=nnx.Rngs(0), impl="xla")


def _prompts(*lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(1, 128, n).tolist() for n in lengths]


def _gate(model, prompts, finished):
  """Each sequence's logits against the model's own full forward over its prompt + generated
  tokens, alone (no cache, no pool). One forward for all: each context right-padded to the
  longest, which causal attention makes invisible to the positions compared."""
  fulls = [list(p) + list(f.tokens[:-1]) for p, f in zip(prompts, finished)]
  t = max(len(x) for x in fulls)
  ref = np.asarray(model(jnp.asarray([x + [0] * (t - len(x)) for x in fulls])))
  for i, (p, f, x) in enumerate(zip(prompts, finished, fulls)):
    metrics = gates.logit_metrics(ref[i, len(p) - 1:len(x)], f.logits)
    ok, why = gates.check_gate(metrics, "float32")
    assert ok, (i, why)


@pytest.mark.parametrize("tactic", ["stream", "hybrid"])
def test_each_sequence_of_a_ragged_continuous_batch_passes_its_own_gate(model, tactic):
  # 64 device rows for contexts of 29 + 15 + 46 cells: the long ones move pages to the host.
  pool = pool_lib.Pool(model.config, device_rows=64, host_pages=16, page_cells=8, tactic=tactic,
                       row_bucket=64)
  sched = serving.Scheduler(model, pool, max_batch=2, chunk=CHUNK, record_logits=True)
  prompts = _prompts(23, 9, 40)
  ids = [sched.add(serving.Request(p, max_new_tokens=6)) for p in prompts]
  moved, real = [], pool._move_page
  pool._move_page = lambda s: moved.append(1) or real(s)
  joined_late = None
  while not sched.done:
    sched.step()
    if joined_late is None and sched.seq_of(ids[2]) is not None:
      joined_late = sched.steps  # the third request waited for a slot
  out = sched.collect()
  assert joined_late > 1 and moved, (joined_late, moved)
  for i in ids:
    assert out[i].reason == "max_new_tokens" and len(out[i].tokens) == 6
  _gate(model, prompts, [out[i] for i in ids])
  assert not pool.seqs and pool.free_rows == 64  # every finished sequence left the pool


def test_sampling_and_stop_tokens_match_single_sequence_generate(model):
  p_greedy, p_sampled = _prompts(11, 19, seed=1)
  alone = gen.generate(model, np.asarray([p_greedy]), max_new_tokens=5,
                       caches=models.init_caches(model.config, 1, 32))
  stop = int(alone.tokens[0, 2])
  sampled = gen.generate(model, np.asarray([p_sampled]), max_new_tokens=5, temperature=0.8,
                         top_k=20, seed=3, caches=models.init_caches(model.config, 1, 32))
  pool = pool_lib.Pool(model.config, device_rows=64, host_pages=8, page_cells=8, row_bucket=64)
  sched = serving.Scheduler(model, pool, max_batch=4, chunk=CHUNK, record_logits=True)
  a = sched.add(serving.Request(p_greedy, max_new_tokens=5, stop_tokens=(stop,)))
  b = sched.add(serving.Request(p_sampled, max_new_tokens=5, temperature=0.8, top_k=20, seed=3))
  events = []
  while not sched.done:
    events += sched.step()
  out = sched.collect()
  first_stop = list(alone.tokens[0]).index(stop)
  assert out[a].tokens == tuple(alone.tokens[0, :first_stop + 1]) and out[a].reason == "stop_token"
  assert out[b].tokens == tuple(sampled.tokens[0])
  assert [e.token for e in events if e.seq == b] == list(sampled.tokens[0])
  assert sum(e.finished for e in events) == 2
  _gate(model, [p_greedy, p_sampled], [out[a], out[b]])


def test_a_kept_conversation_prefills_only_the_new_turn(model, tmp_path):
  turn1, extra = _prompts(30, 7, seed=2)
  pool = pool_lib.Pool(model.config, device_rows=48, host_pages=16, page_cells=8, row_bucket=48)
  sched = serving.Scheduler(model, pool, max_batch=2, chunk=CHUNK, record_logits=True)
  first = sched.add(serving.Request(turn1, max_new_tokens=4, keep=True))
  out1 = sched.run()[first]
  kept = sched.seq_of(first)
  assert pool.length(kept) == len(turn1) + 3  # the last token was sampled, not yet fed
  saved_rows = len(pool.table(kept)["rows"])
  pool.save(str(tmp_path / "session"))
  turn2 = turn1 + list(out1.tokens) + extra
  second = sched.add(serving.Request(turn2, max_new_tokens=4))
  out2 = sched.run()[second]
  assert out2.shared == len(turn1) + 3
  # The saved session, resumed under a smaller device part (its cells split differently between
  # rows and pages), serves the same second turn.
  resumed = pool_lib.Pool.load(str(tmp_path / "session"), model.config, device_rows=24,
                               host_pages=16, row_bucket=24)
  assert len(resumed.table(kept)["rows"]) < saved_rows
  again = serving.Scheduler(model, resumed, max_batch=2, chunk=8, record_logits=True)
  third = again.add(serving.Request(turn2, max_new_tokens=4))
  out3 = again.run()[third]
  assert out3.shared == out2.shared and out3.tokens == out2.tokens
  _gate(model, [turn2, turn2], [out2, out3])
  sched.release(first)
  assert not pool.seqs and pool.free_pages == 16
  with pytest.raises(ValueError, match="holds no kept rows"):
    sched.release(first)


def test_a_request_waits_until_the_pool_can_hold_it(model):
  # 32 device rows, no host pages: two 20-token contexts cannot run at once, so the second waits
  # for the first to leave; one that can never fit is refused by name.
  pool = pool_lib.Pool(model.config, device_rows=32, host_pages=0, page_cells=8, row_bucket=32)
  sched = serving.Scheduler(model, pool, max_batch=4, chunk=CHUNK)
  a, b = (sched.add(serving.Request(p, max_new_tokens=4)) for p in _prompts(16, 16, seed=3))
  sched.step()
  assert sched.seq_of(a) is not None and sched.seq_of(b) is None
  out = sched.run()
  assert set(out) == {a, b} and len(out[b].tokens) == 4
  sched.add(serving.Request(_prompts(60)[0], max_new_tokens=4))
  with pytest.raises(ValueError, match="does not fit the pool .* even with nothing else running"):
    sched.step()
