"""rkv.generate_text on the packaged SmolLM2 (chat template in, streamed text out, EOS stop) with
resident caches and with a forced host tail (the same greedy tokens), the streamer's stop strings,
and generate()'s top_k / stop_tokens / on_token on a tiny model."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

import rkv
from rkv import generate as gen
from rkv import models
from rkv import text as text_lib

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
MAX_NEW = 10


def _forced_plan(model, n_cells, tactic="stream"):
  base = rkv.plan(model.config, n_cells, 1,
                  residency=rkv.ResidencyConfig(mode="stream", vram_target_mib=1 << 20,
                                                check_free=False))
  return gen.force_tactic(base, tactic, window_cells=8, tile_cells=8)


def test_resident_and_offloaded_reply_alike(smollm2):
  model, tok = smollm2
  pieces = []
  res = rkv.generate_text(model, tok, MESSAGES, max_new_tokens=MAX_NEW, on_token=pieces.append)
  assert res.text == "The capital of France is Paris." and "".join(pieces) == res.text
  assert res.finish == "eos" and res.tokens[-1] == tok.eos_id and res.new_tokens < MAX_NEW
  assert res.prompt_tokens == len(text_lib.prompt_ids(tok, MESSAGES))
  assert res.prefill_tokens_per_s > 0 and res.decode_tokens_per_s > 0 and res.plan is None
  assert res.generation.jitted

  # Most of the 47 cells in the host tail: an 8-cell window, tiles of 8, every layer.
  plan = _forced_plan(model, res.prompt_tokens + MAX_NEW)
  off = rkv.generate_text(model, tok, MESSAGES, max_new_tokens=MAX_NEW, residency=plan)
  assert not off.generation.jitted and off.plan is plan and plan.host_bytes > plan.device_bytes
  assert off.tokens == res.tokens and off.text == res.text and off.finish == "eos"


def test_an_offloaded_plan_compiles_its_dense_programs_before_its_caches(tiny, monkeypatch):
  # gen.warm_up runs before the plan's caches exist (XLA's autotuning scratch would not fit
  # beside a default-budget plan's caches); an all-resident plan skips it.
  model, _ = tiny
  order = []
  monkeypatch.setattr(gen, "warm_up", lambda m, **kw: order.append("warm_up"))
  real = gen.caches_from_plan
  monkeypatch.setattr(gen, "caches_from_plan",
                      lambda *a, **kw: order.append("caches") or real(*a, **kw))
  text_lib._caches(model, 40, None, _forced_plan(model, 40))
  assert order == ["warm_up", "caches"]
  order.clear()
  text_lib._caches(model, 40, None, rkv.ResidencyConfig(vram_target_mib=1 << 20,
                                                        check_free=False))
  assert order == ["caches"]


def test_stop_string_cuts_and_holds_back(smollm2):
  _, tok = smollm2
  ids = tok.encode("The capital of France is Paris. It is")
  pieces = []
  s = text_lib._Streamer(tok, ["Paris"], pieces.append, tok.stop_ids)
  ended = [s(i, np.asarray([t])) for i, t in enumerate(ids)]
  assert ended.index(True) == len(tok.encode("The capital of France is Paris")) - 1
  assert s.finish() == "The capital of France is " == "".join(pieces)
  assert not any("P" in p for p in pieces)  # " P..." was held back as a possible stop start
  assert text_lib._held_back("abc Pa", ["Paris"]) == 2 and text_lib._held_back("x", ["y"]) == 0


def test_plain_prompt_and_bad_arguments(smollm2):
  model, tok = smollm2
  assert text_lib.prompt_ids(tok, "Hello") == tok.encode("Hello")
  with pytest.raises(ValueError, match="stop"):
    rkv.generate_text(model, tok, "Hi", stop=[""])
  with pytest.raises(ValueError, match="caches or residency"):
    rkv.generate_text(model, tok, "Hi", caches=(), residency=rkv.ResidencyConfig())
  with pytest.raises(ValueError, match="context"):
    rkv.generate_text(model, tok, "Hi", max_new_tokens=10_000)


@pytest.fixture(scope="module")
def tiny():
  fixtures = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf", "llama")
  model = models.load_hf(fixtures, jnp.float32, impl="xla")
  return model, models.jit_forward(model, last_only=True)


def _run(tiny, n=6, **kw):
  model, fwd = tiny
  prompt = np.arange(1, 6, dtype=np.int32)[None]
  return gen.generate(model, prompt, max_new_tokens=n, forward=fwd,
                      caches=models.init_caches(model.config, 1, 5 + n), **kw)


def test_generate_top_k_stop_tokens_and_callback(tiny):
  greedy = _run(tiny)
  assert greedy.stopped is None and greedy.lengths.tolist() == [6]
  # top_k=1 samples the argmax whatever the temperature.
  np.testing.assert_array_equal(_run(tiny, temperature=5.0, top_k=1, seed=3).tokens,
                                greedy.tokens)
  stop = int(greedy.tokens[0, 2])
  first = int(np.argmax(greedy.tokens[0] == stop))
  out = _run(tiny, stop_tokens=[stop])
  assert out.stopped == "stop_tokens" and out.tokens.shape == (1, first + 1)
  assert out.lengths.tolist() == [first + 1]
  seen = []
  out = _run(tiny, on_token=lambda i, t: seen.append((i, int(t[0]))) or i == 1)
  assert out.stopped == "on_token" and out.tokens.shape == (1, 2)
  assert seen == [(0, int(greedy.tokens[0, 0])), (1, int(greedy.tokens[0, 1]))]
  with pytest.raises(ValueError, match="top_k"):
    _run(tiny, top_k=-1)
