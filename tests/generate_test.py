"""rkv.generate (prefill, sampling, teacher-forced decode) and the rkv.gates metrics."""

import math
import os

import jax.numpy as jnp
import numpy as np
import pytest

import rkv
from rkv import gates, models
from rkv import generate as gen

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
P = 13  # prompt length
N = 8  # new tokens


@pytest.fixture(scope="module")
def llama():
  model = models.load_hf(os.path.join(FIXTURES, "llama"), jnp.float32, impl="xla")
  tokens = np.load(os.path.join(FIXTURES, "llama", "reference.npz"))["tokens"]
  return model, tokens, models.jit_forward(model, last_only=True)


def _gen(model, prompt, fwd=None, n=N, capacity=None, **kw):
  capacity = prompt.shape[1] + n if capacity is None else capacity
  caches = models.init_caches(model.config, prompt.shape[0], capacity)
  return gen.generate(model, prompt, max_new_tokens=n, caches=caches, forward=fwd, **kw)


def test_greedy_equals_argmax_of_teacher_forced(llama):
  model, tokens, fwd = llama
  out = _gen(model, tokens[:, :P], fwd)
  assert out.tokens.shape == (2, N) and out.jitted
  assert out.prefill_tokens_per_s > 0 and out.decode_tokens_per_s > 0
  seq = np.concatenate([tokens[:, :P], out.tokens], axis=1)
  full = np.asarray(model(jnp.asarray(seq)))
  np.testing.assert_array_equal(full[:, P - 1:-1].argmax(-1), out.tokens)
  forced = gen.decode_logits(model, seq, models.init_caches(model.config, 2, P + N),
                             prefill_len=P, forward=fwd)
  assert forced.shape == (2, N, model.config.vocab_size)
  np.testing.assert_array_equal(forced[:, :-1].argmax(-1), out.tokens[:, 1:])


def test_sampling_reproducible_and_tiny_top_p_is_greedy(llama):
  model, tokens, fwd = llama
  prompt = tokens[:, :P]
  a = _gen(model, prompt, fwd, temperature=1.0, top_p=0.9, seed=3).tokens
  b = _gen(model, prompt, fwd, temperature=1.0, top_p=0.9, seed=3).tokens
  c = _gen(model, prompt, fwd, temperature=1.0, top_p=1.0, seed=4).tokens
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)  # a near-uniform random model: another seed, other tokens
  greedy = _gen(model, prompt, fwd).tokens
  np.testing.assert_array_equal(_gen(model, prompt, fwd, temperature=1.5, top_p=1e-6).tokens,
                                greedy)
  assert gates.greedy_match(greedy, greedy)["equal"]


def test_decode_step_traces_once():
  model = models.load_hf(os.path.join(FIXTURES, "llama"), jnp.float32, impl="xla")
  tokens = np.load(os.path.join(FIXTURES, "llama", "reference.npz"))["tokens"]
  fwd = models.jit_forward(model, last_only=True)
  # Prefill chunks 5, 5, 3 and the decode step [B,1]: three programs, whatever the token count
  # (the cache capacity is a shape: same capacity, same programs).
  _gen(model, tokens[:, :P], fwd, n=4, capacity=32, chunk=5)
  assert fwd.jitted._cache_size() == 3
  _gen(model, tokens[:, :P], fwd, n=16, capacity=32, chunk=5)
  assert fwd.jitted._cache_size() == 3


def test_progress_on_long_prefill(llama, capsys, monkeypatch):
  model, tokens, fwd = llama
  caches = models.init_caches(model.config, 2, 32)
  logits, _ = gen.prefill(model, tokens, caches, chunk=4, progress=True, progress_every=2,
                          forward=fwd)
  assert logits.shape == (2, model.config.vocab_size)
  err = capsys.readouterr().err.splitlines()
  assert len(err) == 4 and err[-1].startswith("prefill [") and "32/32 tokens" in err[-1]
  assert all("tok/s" in line for line in err)
  _gen(model, tokens[:, :P], fwd)  # short prompt: silent
  assert capsys.readouterr().err == ""
  monkeypatch.setattr(gen, "PROGRESS_MIN_TOKENS", P)  # "long" now: the default turns it on
  _gen(model, tokens[:, :P], fwd)
  assert "prefill [" in capsys.readouterr().err


def test_bad_inputs_name_the_argument(llama):
  model, tokens, fwd = llama
  cfg = model.config
  caches = lambda n=32: models.init_caches(cfg, 2, n)
  with pytest.raises(ValueError, match="prompt_tokens"):
    gen.generate(model, np.zeros((2, 0), np.int32), max_new_tokens=2, caches=caches())
  with pytest.raises(ValueError, match="max_new_tokens"):
    gen.generate(model, tokens[:, :P], max_new_tokens=-1, caches=caches())
  for top_p in (0.0, 1.5):
    with pytest.raises(ValueError, match="top_p"):
      gen.generate(model, tokens[:, :P], max_new_tokens=2, caches=caches(), top_p=top_p,
                   temperature=1.0)
  with pytest.raises(ValueError, match="temperature"):
    gen.generate(model, tokens[:, :P], max_new_tokens=2, caches=caches(), temperature=-1.0)
  with pytest.raises(ValueError, match="capacity"):
    gen.generate(model, tokens[:, :P], max_new_tokens=10, caches=caches(P + 5))
  with pytest.raises(ValueError, match="prefill_len"):
    gen.decode_logits(model, tokens, caches(), prefill_len=0)
  with pytest.raises(ValueError, match="chunk"):
    gen.prefill(model, tokens, caches(), chunk=0)
  plan = rkv.plan(cfg, 32, 2, residency=rkv.ResidencyConfig(vram_target_mib=1 << 20))
  cpu = gen.force_stream(plan, 5, 3)
  cpu = cpu.__class__(**{**cpu.__dict__, "layers": tuple(
      lp.__class__(**{**lp.__dict__, "tactic": "cpu"}) for lp in cpu.layers)})
  with pytest.raises(ValueError, match="'cpu' is not yet supported by generation"):
    gen.caches_from_plan(cfg, cpu, 2, 32)
  with pytest.raises(ValueError, match="capacity"):
    gen.caches_from_plan(cfg, gen.force_stream(plan, 5, 3), 2, 5)


def test_stream_caches_generate_like_resident():
  """Greedy generation with RollingKV global layers (eager steps) equals the resident run. Same
  shapes as tests/rolling_vs_resident_test.py (prompt 18, W=5, tile=4, 32 cells), so the eager
  ops compiled by one are reused by the other in a session."""
  model = models.load_hf(os.path.join(FIXTURES, "gemma2"), jnp.float32, impl="xla")
  tokens = np.load(os.path.join(FIXTURES, "gemma2", "reference.npz"))["tokens"]
  cfg = model.config
  plan = gen.force_stream(
      rkv.plan(cfg, 32, 2, residency=rkv.ResidencyConfig(vram_target_mib=1 << 20)), 5, 4)
  assert plan.tactics() == ("resident", "stream")
  p, n = 18, 5  # 22 cells: 4 tail tiles after the prefill, a staging flush at 21 in decode
  out = gen.generate(model, tokens[:, :p], max_new_tokens=n,
                     caches=gen.caches_from_plan(cfg, plan, 2, 32, jnp.float32))
  assert not out.jitted and out.caches[1].n_full_tiles == (p + n - 1 - 5) // 4 == 4
  ref = gen.generate(model, tokens[:, :p], max_new_tokens=n,
                     caches=models.init_caches(cfg, 2, 32))
  assert gates.greedy_match(ref.tokens, out.tokens) == {
      "equal": True, "agreement": 1.0, "first_divergence": [None, None]}


# ----------------------------------------------------------------------------------------------
# gates
# ----------------------------------------------------------------------------------------------
def test_metrics_of_identical_logits():
  x = np.random.default_rng(0).normal(size=(3, 5, 17)).astype(np.float32)
  m = gates.logit_metrics(x, x)
  assert m.mean_kl == m.max_kl == 0.0 and m.max_abs_logit == 0.0
  assert m.top1_agreement == 1.0 and m.top1_disagreements == 0 and m.rows == 15
  assert math.isclose(m.min_cosine, 1.0, abs_tol=1e-12)
  assert gates.check_gate(m, "float32") == (True, []) and gates.check_gate(m, jnp.bfloat16)[0]


def test_metrics_known_values():
  ref = np.array([[0.0, 0.0, -50.0], [3.0, 0.0, 0.0], [0.0, 2.0, 0.0], [1.0, 0.0, 0.5]])
  test = ref.copy()
  test[0] = [0.0, math.log(3.0), -50.0]  # p = (1/2, 1/2) vs q = (1/4, 3/4), top-1 flips
  m = gates.logit_metrics(ref, test)
  want_kl = 0.5 * math.log(2.0) + 0.5 * math.log(2.0 / 3.0)
  assert math.isclose(m.max_kl, want_kl, rel_tol=1e-9)
  assert math.isclose(m.mean_kl, want_kl / 4, rel_tol=1e-9)
  assert m.top1_agreement == 0.75 and m.top1_disagreements == 1
  assert math.isclose(m.max_abs_logit, math.log(3.0))
  passed, reasons = gates.check_gate(m, "float32")
  assert not passed and len(reasons) == 2 and "F32_TOP1" in reasons[1]
  passed, reasons = gates.check_gate(m, "bfloat16")
  assert not passed and any("BF16_MEAN_KL" in r for r in reasons)
  with pytest.raises(ValueError, match="same non-empty shape"):
    gates.logit_metrics(ref, test[:2])
  with pytest.raises(ValueError, match="dtype"):
    gates.check_gate(m, "float16")
  match = gates.greedy_match([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 0, 6]])
  assert match == {"equal": False, "agreement": 5 / 6, "first_divergence": [None, 1]}
