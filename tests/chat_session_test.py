"""rkv.ChatSession (what `rkv chat` runs): the second turn prefills only its own tokens through
the caches the first turn filled, and decodes what a from-scratch run of the whole conversation
decodes (logits within the float32 gate, the same greedy tokens)."""

import numpy as np
import pytest

import rkv
from rkv import gates
from rkv import generate as gen
from rkv import models

TURNS = ("My name is Ada. Reply with one short sentence.", "What is my name?")
NEW = 8


@pytest.fixture(scope="module")
def forward(smollm2):
  """One jitted resident step for every run here (each shape compiles once)."""
  return models.jit_forward(smollm2[0], last_only=True)


def _session(smollm2, forward, **kw):
  model, tok = smollm2
  return rkv.ChatSession(model, tok, capacity=256, forward=forward, **kw)


def test_second_turn_logits_equal_a_from_scratch_run(smollm2, forward):
  model, _ = smollm2
  s = _session(smollm2, forward)
  s.send(TURNS[0], max_new_tokens=NEW)
  fed = list(s._fed)  # in the caches: the first turn's prompt and reply (but its last token)
  new, kept = s.turn_ids(TURNS[1])
  assert kept and new[0] == s.ids[-1] and len(new) < len(fed)
  # Turn 2 teacher-forced through the kept caches vs the whole conversation from fresh caches.
  tail = np.asarray([new + [int(t) for t in np.arange(4) + 100]], np.int32)
  kept_logits = gen.decode_logits(model, tail, s.caches, prefill_len=len(new) - 1,
                                  forward=forward)
  whole = np.asarray([fed + tail[0].tolist()], np.int32)
  scratch = gen.decode_logits(model, whole, models.init_caches(model.config, 1, 256),
                              prefill_len=len(fed) + len(new) - 1, forward=forward)
  metrics = gates.logit_metrics(scratch, kept_logits)
  assert metrics.rows == 5
  passed, reasons = gates.check_gate(metrics, "float32")
  assert passed, reasons


def test_send_prefills_only_the_new_turn_and_replies_as_from_scratch(smollm2, forward):
  model, tok = smollm2
  s = _session(smollm2, forward, system="You are terse.")
  first = s.send(TURNS[0], max_new_tokens=NEW)
  assert first.prompt_tokens == len(s.ids) - len(first.tokens) and not s.last_turn_reused
  before = list(s._fed)
  new, _ = s.turn_ids(TURNS[1])
  second = s.send(TURNS[1], max_new_tokens=NEW)
  assert s.last_turn_reused and second.prompt_tokens == len(new) < len(before)
  assert s.ids == before + new + list(second.tokens)
  assert [m["role"] for m in s.messages] == ["system", "user", "assistant", "user", "assistant"]
  whole = np.asarray([before + new], np.int32)
  ref = gen.generate(model, whole, max_new_tokens=NEW, stop_tokens=tok.stop_ids,
                     caches=models.init_caches(model.config, 1, whole.shape[1] + NEW),
                     forward=forward)
  assert tuple(int(t) for t in ref.tokens[0, :int(ref.lengths[0])]) == second.tokens
  with pytest.raises(ValueError, match="larger capacity"):
    s.send("x " * 300, max_new_tokens=NEW)
