"""rkv.generate (prefill, sampling, teacher-forced decode) and the rkv.gates metrics."""

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rkv
from rkv import gates, models
from rkv import generate as gen
from tests.support.decode_runs import assert_same_run, decode_with

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


@pytest.mark.parametrize("split_merge,query_pack", [("tree", "wrapper"), ("kernel", "wrapper"),
                                                    ("chain", "kernel")])
def test_decode_wrapper_options_decode_like_the_default(monkeypatch, split_merge, query_pack):
  # The decode kernel's other wrapper options ($RKV_DECODE_SPLIT_MERGE, $RKV_DECODE_QUERY_PACK)
  # as a model step runs them (resident caches, explicit positions, interpret mode on CPU): the
  # same greedy tokens and, teacher-forced, the same logits as the defaults to float32 rounding.
  model = models.load_hf(os.path.join(FIXTURES, "llama"), jnp.float32, impl="pallas")
  tokens = np.load(os.path.join(FIXTURES, "llama", "reference.npz"))["tokens"]
  prompt, seq = tokens[:, :P], tokens[:, :P + 4]

  def run():
    fwd = models.jit_forward(model, last_only=True)
    out = _gen(model, prompt, fwd, n=4)
    logits = gen.decode_logits(model, seq, models.init_caches(model.config, 2, P + 4),
                               prefill_len=P, forward=fwd)
    return out.tokens, logits

  monkeypatch.delenv("RKV_DECODE_SPLIT_MERGE", raising=False)
  monkeypatch.delenv("RKV_DECODE_QUERY_PACK", raising=False)
  want_tokens, want_logits = run()
  monkeypatch.setenv("RKV_DECODE_SPLIT_MERGE", split_merge)
  monkeypatch.setenv("RKV_DECODE_QUERY_PACK", query_pack)
  got_tokens, got_logits = run()
  np.testing.assert_array_equal(got_tokens, want_tokens)
  np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5)


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


@pytest.mark.parametrize("kw", [{}, dict(temperature=1.0, top_p=0.9, seed=3)])
def test_queued_steps_equal_waited_for_steps(llama, kw):
  # Unwatched, generate queues step i+1 before step i's token is read; watched (a stop token
  # that never comes, a callback), it reads each token first. Same tokens, same caches.
  model, tokens, fwd = llama
  prompt = tokens[:, :P]
  queued = _gen(model, prompt, fwd, **kw)
  seen = []
  never = int(model.config.vocab_size)  # no token id reaches it
  watched = _gen(model, prompt, fwd, stop_tokens=(never,),
                 on_token=lambda i, t: seen.append((i, t.copy())), **kw)
  np.testing.assert_array_equal(queued.tokens, watched.tokens)
  assert [i for i, _ in seen] == list(range(N)) and watched.stopped is None
  np.testing.assert_array_equal(np.stack([t for _, t in seen], axis=1), watched.tokens)
  assert len(queued.step_s) == len(watched.step_s) == N - 1
  assert all(x > 0 for x in queued.step_s + watched.step_s)
  for a, b in zip(queued.caches, watched.caches):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_decode_step_keeps_undonated_caches(llama):
  # jit_forward(donate_caches=False): its decode program must leave the caches passed in usable,
  # and its step equals the forward's argmax.
  model, tokens, _ = llama
  fwd = models.jit_forward(model, last_only=True, donate_caches=False)
  caches = models.init_caches(model.config, 2, P + 1)
  _, caches = fwd(jnp.asarray(tokens[:, :P]), jnp.asarray(gen._positions(2, 0, P)), caches)
  tok = jnp.asarray(tokens[:, P:P + 1])
  pos = jnp.full((2, 1), P, jnp.int32)
  nxt, pos1, _ = fwd.decode_step(tok, pos, caches, gen.greedy_pick)
  logits, _ = fwd(tok, pos, caches)  # the same caches again: not donated
  np.testing.assert_array_equal(np.asarray(nxt)[:, 0], np.asarray(logits)[:, -1].argmax(-1))
  np.testing.assert_array_equal(np.asarray(pos1), P + 1)


def test_decode_step_donates_tokens_and_positions(llama):
  # With donated caches the step also consumes its tokens and positions (their successors take
  # the same buffers: a captured CUDA graph is then replayed as it is, rkv/_env.py), and a loop
  # that feeds each step the last one's outputs gives the teacher-forced argmaxes.
  model, tokens, _ = llama
  fwd = models.jit_forward(model, last_only=True)
  caches = models.init_caches(model.config, 2, P + 3)
  _, caches = fwd(jnp.asarray(tokens[:, :P]), jnp.asarray(gen._positions(2, 0, P)), caches)
  tok = jnp.asarray(tokens[:, P:P + 1])
  pos = jnp.full((2, 1), P, jnp.int32)
  nxt, pos1, caches = fwd.decode_step(tok, pos, caches, gen.greedy_pick)
  assert tok.is_deleted() and pos.is_deleted()
  kept = jnp.copy(nxt)
  nxt2, pos2, _ = fwd.decode_step(nxt, pos1, caches, gen.greedy_pick)
  assert nxt.is_deleted() and not kept.is_deleted()
  seq = np.concatenate([tokens[:, :P + 1], np.asarray(kept)], axis=1)
  full = np.asarray(model(jnp.asarray(seq)))
  np.testing.assert_array_equal(full[:, -2:].argmax(-1),
                                np.concatenate([np.asarray(kept), np.asarray(nxt2)], axis=1))
  np.testing.assert_array_equal(np.asarray(pos2), P + 2)


def test_decode_step_traces_once():
  model = models.load_hf(os.path.join(FIXTURES, "llama"), jnp.float32, impl="xla")
  tokens = np.load(os.path.join(FIXTURES, "llama", "reference.npz"))["tokens"]
  fwd = models.jit_forward(model, last_only=True)
  # Prefill chunks 5, 5, 3: two forward programs; the decode step [B,1] with its pick: one
  # decode program; whatever the token count (the cache capacity is a shape: same capacity, same
  # programs).
  _gen(model, tokens[:, :P], fwd, n=4, capacity=32, chunk=5)
  assert (fwd.jitted._cache_size(), fwd.decode_program._cache_size()) == (2, 1)
  _gen(model, tokens[:, :P], fwd, n=16, capacity=32, chunk=5)
  assert (fwd.jitted._cache_size(), fwd.decode_program._cache_size()) == (2, 1)


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
  # Token ids outside [0, V): -1 used to act as id V-1, V+3 to be clamped by the gather.
  for bad in (-1, cfg.vocab_size, 2**40):
    prompt = np.array(tokens[:, :P], np.int64)
    prompt[1, 4] = bad
    with pytest.raises(ValueError, match=r"prompt_tokens values must be in \[0, "):
      gen.generate(model, prompt, max_new_tokens=2, caches=caches())
    with pytest.raises(ValueError, match="tokens values"):
      gen.prefill(model, prompt, caches())
    with pytest.raises(ValueError, match="tokens values"):
      gen.decode_logits(model, prompt, caches(), prefill_len=3)
    with pytest.raises(ValueError, match="tokens values"):
      model(prompt)
  with pytest.raises(ValueError, match="positions values"):
    model(tokens[:, :2], np.array([[0, 2**31]] * 2, np.int64))
  plan = rkv.plan(cfg, 32, 2, residency=rkv.ResidencyConfig(vram_target_mib=1 << 20))
  with pytest.raises(ValueError, match="'bogus' is unknown"):
    gen.caches_from_plan(cfg, _with_layers(gen.force_stream(plan, 5, 3), tactic="bogus"), 2, 32)
  for tactic in gen.FORCED_TACTICS:
    with pytest.raises(ValueError, match="capacity"):
      gen.caches_from_plan(cfg, gen.force_tactic(plan, tactic, 5, 3), 2, 5)


def _with_layers(plan, **fields):
  """``plan`` with ``fields`` replaced in every global layer (plans a planner would not make)."""
  return dataclasses.replace(plan, layers=tuple(
      dataclasses.replace(lp, **fields) if lp.kind == "global" else lp for lp in plan.layers))


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


def test_layered_forward_equals_the_model_and_traces_once():
  """rkv.models.layered_forward (eager across layers, jitted within) gives the eager model's
  logits and caches on a ring (local) + RollingKV (global) model, from prefill through a staging
  flush, and compiles each of its programs once for the decode step."""
  from rkv.models import transformer
  model = models.load_hf(os.path.join(FIXTURES, "gemma2"), jnp.float32, impl="xla")
  tokens = np.load(os.path.join(FIXTURES, "gemma2", "reference.npz"))["tokens"]
  cfg = model.config
  plan = gen.force_stream(
      rkv.plan(cfg, 32, 2, residency=rkv.ResidencyConfig(vram_target_mib=1 << 20)), 5, 4)
  caches_a = gen.caches_from_plan(cfg, plan, 2, 32, jnp.float32)
  caches_b = gen.caches_from_plan(cfg, plan, 2, 32, jnp.float32)
  assert isinstance(caches_a[0], models.RingCache) and isinstance(caches_a[1], rkv.RollingKV)
  fwd = models.layered_forward(model, last_only=True)
  pos = lambda lo, hi: np.broadcast_to(np.arange(lo, hi, dtype=np.int32), (2, hi - lo))
  # float32 rounding only: XLA fuses the jitted halves differently from op-by-op eager dispatch
  # (measured max |diff| 1.8e-6; the float32 logit gate is 1e-4).
  close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
  la, caches_a = fwd(tokens[:, :18], pos(0, 18), caches_a)
  lb, caches_b = model(tokens[:, :18], pos(0, 18), caches_b, last_only=True)
  close(la, lb)
  pre, post, whole = transformer._block_programs(*transformer._split_flat(model.layers[1])[:2])
  sizes = None
  for i in range(18, 24):  # 6 one-token steps: the staging tile flushes at fill 21
    la, caches_a = fwd(tokens[:, i:i + 1], pos(i, i + 1), caches_a)
    lb, caches_b = model(tokens[:, i:i + 1], pos(i, i + 1), caches_b, last_only=True)
    close(la, lb)
    if i == 19:
      sizes = (pre._cache_size(), post._cache_size())
  assert (pre._cache_size(), post._cache_size()) == sizes  # no retrace per token or per flush
  assert caches_a[1].fill == caches_b[1].fill == 24 and caches_a[1].n_full_tiles == 4
  for x, y in zip(jax.tree.leaves(caches_a[1].cells()), jax.tree.leaves(caches_b[1].cells())):
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-5)
  with pytest.raises(ValueError, match="caches are required"):
    fwd(tokens[:, :2])
  with pytest.raises(ValueError, match="schedule"):
    models.layered_forward(model, schedule="scan")


def test_warm_up_compiles_the_logits_and_decode_programs_a_plan_reuses():
  """rkv.generate.warm_up compiles on tiny caches what a planned run compiles later: after it, a
  prefill chunk and decode steps over the plan's own caches add no logits program (it sees one
  position whatever the chunk) and no decode-shaped block program."""
  from flax import nnx
  from rkv.models import transformer
  # A structure no other test builds (programs are cached by it), so nothing is compiled yet.
  cfg = models.ModelConfig.preset("tiny-llama").replace(vocab_size=301, hidden_size=48,
                                                        dtype="float32")
  model = models.Transformer(cfg, rngs=nnx.Rngs(0), impl="xla")
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 21)).astype(np.int32)
  _, leave = transformer._edge_programs(
      cfg, *transformer._split_flat((model.embed, model.final_norm, model.lm_head))[:2])
  defs = transformer._split_flat(model.layers[1])[:2]
  pre, _, _ = transformer._block_programs(*defs)
  # A rolling layer's merge and post_attention run in the next layer's join (or the last one's
  # close): those are the block programs of a decode step, with the first layer's pre.
  join, close = transformer._join_programs(defs, defs)
  programs = (leave, pre, join, close)
  count = lambda: tuple(f._cache_size() for f in programs)
  assert count() == (0, 0, 0, 0)
  assert gen.warm_up(model, batch=2) > 0
  sizes = count()
  assert min(sizes) >= 1
  plan = gen.force_stream(
      rkv.plan(cfg, 32, 2, residency=rkv.ResidencyConfig(vram_target_mib=1 << 20)), 5, 4)
  caches = gen.caches_from_plan(cfg, plan, 2, 32, jnp.float32)
  fwd = models.layered_forward(model, last_only=True)
  pos = lambda lo, hi: np.broadcast_to(np.arange(lo, hi, dtype=np.int32), (2, hi - lo))
  _, caches = fwd(tokens[:, :18], pos(0, 18), caches)
  assert leave._cache_size() == sizes[0]           # the chunk's logits: the warmed program
  after_chunk = count()                            # (the chunk's own block programs)
  for i in range(18, 21):
    _, caches = fwd(tokens[:, i:i + 1], pos(i, i + 1), caches)
  assert count() == after_chunk                    # decode: all warmed
  for bad, match in ((dict(batch=0), "batch"), (dict(lengths=()), "lengths"),
                     (dict(lengths=(0,)), "lengths")):
    with pytest.raises(ValueError, match=match):
      gen.warm_up(model, **bad)


@pytest.mark.parametrize("tactic", ["stream", "hybrid"])
def test_layered_forward_prefetch_equals_no_prefetch(tactic):
  """The cross-layer Prefetcher (tiles of the next layers and of the next step requested ahead)
  changes when tiles move, not what is attended: logits and caches equal layered_forward without
  it, bit for bit, through a prefill, decode steps and a flush, with 2 tiles in flight at most
  (the flow control waits) and with 16; ahead-requested tiles are actually used."""
  runs = {depth: decode_with(tactic, prefetch_tiles=depth) for depth in (0, 2, 16)}
  assert runs[0][2].prefetcher is None
  for depth in (2, 16):
    assert_same_run(runs[0], runs[depth])
    pf = runs[depth][2].prefetcher
    assert pf.requested > 0 and pf._in_flight() <= depth
  # With room for every tile, every decode step's tiles were requested ahead, by the step
  # before: only the prefill (nothing requested yet) and the tiles a flush adds come late.
  assert runs[16][2].prefetcher.late < runs[16][2].prefetcher.requested
  model = models.load_hf(os.path.join(FIXTURES, "llama"), jnp.float32, impl="xla")
  with pytest.raises(ValueError, match="prefetch_tiles"):
    models.layered_forward(model, prefetch_tiles=-1)


@pytest.mark.parametrize("tactic", ["stream", "hybrid", "cpu"])
def test_layered_forward_join_equals_separate_programs(monkeypatch, tactic):
  """A rolling layer's merge and post_attention run inside the next layer's pre_attention program
  (the join, the default) or as programs of their own ($RKV_JOIN_LAYERS=0): the same cells, the
  same float32 merge; logits agree to float32 rounding and the caches are equal, through a
  prefill, decode steps and a flush. The joins are built only when they are on."""
  joined = decode_with(tactic)
  monkeypatch.setenv("RKV_JOIN_LAYERS", "0")
  separate = decode_with(tactic)
  for x, y in zip(joined[0], separate[0]):
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)
  for x, y in zip(jax.tree.leaves(joined[1]), jax.tree.leaves(separate[1])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  monkeypatch.setenv("RKV_JOIN_LAYERS", "sometimes")
  model = models.load_hf(os.path.join(FIXTURES, "llama"), jnp.float32, impl="xla")
  with pytest.raises(ValueError, match="RKV_JOIN_LAYERS"):
    models.layered_forward(model)


@pytest.mark.parametrize("tactic", ["hybrid", "stream"])
def test_layered_forward_next_puts_equal_own_puts(monkeypatch, tactic):
  """$RKV_NEXT_PUTS=1: a hybrid layer requests the next layer's first streamed tiles while it
  waits for its CPU share, and that layer attends them as staged tiles instead of putting its
  own. When tiles move changes, not what is attended: logits and caches equal the default run,
  bit for bit, through a prefill, decode steps and a flush; with it on, every decode step's
  hybrid layers after the first were handed their tiles (stream layers put none early)."""
  from rkv import cache as cache_lib
  seen = []  # (T, layer's staged tiles given?, a while_waiting hook given?)
  real_attend = cache_lib.RollingKV.attend

  def spy(self, q, *a, **kw):
    seen.append((q.shape[1], bool(kw.get("staged")), kw.get("while_waiting") is not None))
    return real_attend(self, q, *a, **kw)

  monkeypatch.setattr(cache_lib.RollingKV, "attend", spy)
  monkeypatch.setenv("RKV_HOST_SHARE", "0")  # next puts are the Python worker's path
  default = decode_with(tactic)
  assert not any(staged or hook for _, staged, hook in seen)
  seen.clear()
  monkeypatch.setenv("RKV_NEXT_PUTS", "1")
  ahead = decode_with(tactic)
  assert_same_run(default, ahead)
  n_layers = len(default[1])
  decode = [seen[i:i + n_layers] for i in range(0, len(seen), n_layers)
            if seen[i][0] == 1]
  assert decode and all(hook for step in decode for _, _, hook in step[:-1])
  assert not any(hook for step in decode for _, _, hook in step[-1:])  # no layer after the last
  staged = [s for step in decode for _, s, _ in step[1:]]
  assert all(staged) if tactic == "hybrid" else not any(staged)
  # With those tiles staged, the tiles' partials and their merge as one program
  # ($RKV_TILES_ONE_PROGRAM): the same partials in the same order.
  from rkv import rolling
  merged = []
  real_merged = rolling._tiles_merged_jit
  monkeypatch.setattr(rolling, "_tiles_merged_jit",
                      lambda *a, **kw: merged.append(1) or real_merged(*a, **kw))
  monkeypatch.setenv("RKV_TILES_ONE_PROGRAM", "1")
  one = decode_with(tactic)
  assert bool(merged) == (tactic == "hybrid")
  for x, y in zip(default[0], one[0]):
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)
  for x, y in zip(jax.tree.leaves(default[1]), jax.tree.leaves(one[1])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  monkeypatch.setenv("RKV_NEXT_PUTS", "soon")
  with pytest.raises(ValueError, match="RKV_NEXT_PUTS"):
    decode_with(tactic)


@pytest.mark.parametrize("tactic", ["hybrid", "cpu", "stream"])
def test_layered_forward_host_share_equals_the_python_worker(monkeypatch, tactic):
  """$RKV_HOST_SHARE=1: a cpu / hybrid layer's CPU share runs in rkv.offload.host_share's C++
  thread, started in the join that makes its query and awaited in the next one. The same
  kernel over the same cells and query, merged in the same order: logits and caches equal the
  Python worker's, bit for bit, through a prefill, decode steps and a flush (whose step takes
  the Python path). Stream layers have no CPU share."""
  from rkv import cache as cache_lib
  seen = []  # (T, cpu_share)
  real_attend = cache_lib.RollingKV.attend

  def spy(self, q, *a, **kw):
    seen.append((q.shape[1], kw.get("cpu_share")))
    return real_attend(self, q, *a, **kw)

  monkeypatch.setattr(cache_lib.RollingKV, "attend", spy)
  monkeypatch.setenv("RKV_HOST_SHARE", "0")  # the Python worker, whatever the default
  default = decode_with(tactic)
  assert not any(c for _, c in seen)
  seen.clear()
  monkeypatch.setenv("RKV_HOST_SHARE", "1")
  shared = decode_with(tactic)
  assert_same_run(default, shared)
  n_layers = len(default[1])
  steps = [seen[i:i + n_layers] for i in range(0, len(seen), n_layers)]
  decode = [step for step in steps if step[0][0] == 1]
  assert not any(c for step in steps if step[0][0] > 1 for _, c in step)  # the prefill: Python
  external = [c == "external" for step in decode for _, c in step]
  if tactic == "stream":
    assert not any(external) and len(shared[2].host_shares) == 0
  else:
    # Every layer of a decode step, but in the step whose append flushes a tile.
    assert sum(external) >= len(external) - n_layers and any(external)
    assert len(shared[2].host_shares) == n_layers
  monkeypatch.setenv("RKV_HOST_SHARE", "perhaps")
  with pytest.raises(ValueError, match="RKV_HOST_SHARE"):
    decode_with(tactic)


def test_host_share_layers_put_their_tiles_before_the_share_starts(monkeypatch):
  """$RKV_HOST_SHARE=1: a hybrid layer's first streamed tiles are put before the program that
  makes its query, so before its share's start: on the H200 a put issued while a share's kernel
  ran waited up to ~2 ms for PJRT's threads to enqueue its copies (docs/DESIGN.md §6). Those
  tiles are the ones the layer attends (attend puts none of its own), one put a layer."""
  from rkv import rolling
  from rkv.models import transformer
  events = []
  real_puts, real_early_puts = rolling.early_tile_puts, rolling.early_puts

  def tile_puts(kv, n, **kw):
    tiles = real_puts(kv, n, **kw)
    events.append(("put", tiles is not None and len(tiles) > 0))
    return tiles

  def early_puts(*a, **kw):  # attend's own (a layer given no staged tiles)
    tiles = real_early_puts(*a, **kw)
    events.append(("attend_put", tiles is not None))
    return tiles

  real_for_layer = transformer._HostShares.for_layer

  def for_layer(self, *a, **kw):
    share = real_for_layer(self, *a, **kw)
    if not getattr(share, "_spied", False):
      start = share.start_program
      share.start_program = lambda *x: (events.append(("start", None)), start(*x))[1]
      share._spied = True
    return share

  monkeypatch.setattr(rolling, "early_tile_puts", tile_puts)
  monkeypatch.setattr(rolling, "early_puts", early_puts)
  monkeypatch.setattr(transformer._HostShares, "for_layer", for_layer)
  monkeypatch.setenv("RKV_HOST_SHARE", "1")
  decode_with("hybrid")
  starts = [i for i, (what, _) in enumerate(events) if what == "start"]
  assert starts
  for i in starts:
    assert events[i - 1] == ("put", True), events[max(0, i - 3):i + 1]
  assert ("attend_put", True) not in [events[i + 1] for i in starts if i + 1 < len(events)]
  # attend's own puts (the steps that take the Python path: the prefill, the flushing step)
  # record ("put", ...) inside ("attend_put", ...): every other put is a share layer's.
  layered = [i for i, e in enumerate(events) if e == ("put", True)
             and (i + 1 == len(events) or events[i + 1][0] != "attend_put")]
  assert len(layered) == len(starts)


@pytest.mark.gpu
def test_layered_forward_host_share_on_the_gpu(monkeypatch):
  # The same check with the CUDA handlers: the query's copies and the worker's wake-up enqueued
  # on the join's stream, the partial's copies on the next join's.
  test_layered_forward_host_share_equals_the_python_worker(monkeypatch, "hybrid")


def test_layered_forward_switch_interval_during_host_kernel_steps(monkeypatch):
  """$RKV_SWITCH_INTERVAL_US: the GIL switch interval while a step with cpu / hybrid layers runs
  (seen inside each layer's attend), Python's own again after it; the logits are the default's."""
  import sys
  from rkv import cache as cache_lib
  seen = []
  real_attend = cache_lib.RollingKV.attend
  monkeypatch.setattr(cache_lib.RollingKV, "attend", lambda self, *a, **kw: (
      seen.append(sys.getswitchinterval()), real_attend(self, *a, **kw))[1])
  before = sys.getswitchinterval()
  default = decode_with("hybrid")
  assert set(seen) == {before}
  seen.clear()
  monkeypatch.setenv("RKV_SWITCH_INTERVAL_US", "300")
  short = decode_with("hybrid")
  assert seen and all(x == pytest.approx(300e-6) for x in seen)
  assert sys.getswitchinterval() == before
  assert_same_run(default, short)


# ----------------------------------------------------------------------------------------------
# Every tactic through generation
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma2():
  """The gemma2 fixture (K=2: a head split 0 < R < K exists; a sliding + a global layer), its
  tokens and the resident greedy run (prompt 18, 5 new tokens: same shapes as above)."""
  model = models.load_hf(os.path.join(FIXTURES, "gemma2"), jnp.float32, impl="xla")
  tokens = np.load(os.path.join(FIXTURES, "gemma2", "reference.npz"))["tokens"]
  ref = gen.generate(model, tokens[:, :18], max_new_tokens=5,
                     caches=models.init_caches(model.config, 2, 32))
  base = rkv.plan(model.config, 32, 2, residency=rkv.ResidencyConfig(vram_target_mib=1 << 20))
  return model, tokens, ref.tokens, base


@pytest.mark.parametrize("tactic,kw", [
    ("cpu", {}), ("hybrid", dict(cpu_fraction=0.5)), ("head", dict(resident_heads=0)),
    ("head", dict(resident_heads=1))], ids=["cpu", "hybrid_0.5", "head_R0", "head_R1"])
def test_tactic_caches_generate_like_resident(gemma2, tactic, kw):
  """Greedy generation through each non-stream tactic equals the resident run, token for token."""
  model, tokens, ref, base = gemma2
  cfg = model.config
  plan = gen.force_tactic(base, tactic, 5, 4, **kw)
  assert plan.tactics() == ("resident", tactic)
  caches = gen.caches_from_plan(cfg, plan, 2, 32, jnp.float32)
  want = rkv.HeadSplitKV if tactic == "head" else rkv.RollingKV
  assert isinstance(caches[1], want) and caches[1].tactic == tactic
  out = gen.generate(model, tokens[:, :18], max_new_tokens=5, caches=caches)
  assert not out.jitted and isinstance(out.caches[1], want) and out.caches[1].fill == 22
  assert gates.greedy_match(ref, out.tokens) == {
      "equal": True, "agreement": 1.0, "first_divergence": [None, None]}



def test_cpu_tactic_streams_prefill_chunks_and_decodes_on_the_cpu(gemma2, monkeypatch):
  """A cpu layer's prefill chunk (18 queries > MAX_DECODE_QUERIES) streams its tail, the T=1
  decode steps attend it on the CPU; the tokens stay the resident run's."""
  from rkv import rolling
  model, tokens, ref, base = gemma2
  plan = gen.force_tactic(base, "cpu", 5, 4)
  caches = gen.caches_from_plan(model.config, plan, 2, 32, jnp.float32)
  cpu_queries = []
  real = rolling._with_cpu_tail

  def spy(q, *args, **kwargs):
    cpu_queries.append(q.shape[1])
    return real(q, *args, **kwargs)

  monkeypatch.setattr(rolling, "_with_cpu_tail", spy)
  out = gen.generate(model, tokens[:, :18], max_new_tokens=5, caches=caches, chunk=32)
  assert cpu_queries and set(cpu_queries) == {1}, cpu_queries
  assert gates.greedy_match(ref, out.tokens)["equal"]


def _tiny_plan(mode, **kw):
  # tiny-llama (L=2, K=2, D=16, float32) at 512 cells: 0.254 MiB of KV in all; 0.15 MiB leaves
  # each global layer W=128, a staging tile and 3 host tiles of 128. CPU attention about as fast
  # as PCIe and no fixed costs (the H200's measured ~1-2 ms would send a 0.1 MiB tail all one
  # way) make the modeled hybrid split a real one.
  cfg = models.ModelConfig.preset("tiny-llama", dtype="float32")
  profile = dataclasses.replace(  # Profile.replace skips None: a plain dataclass replace
      rkv.residency.H200_DEFAULT, transfer_overhead_us=None, cpu_overhead_us=None,
      hybrid_pcie_gbps=None, hybrid_cpu_gbps=None)
  res = rkv.ResidencyConfig(mode=mode, vram_target_mib=0.15, tile_cells=128, min_tile_cells=128,
                            profile=profile, cpu_attn_gbps=48.5, **kw)
  return cfg, rkv.plan(cfg, 512, 1, residency=res)


@pytest.mark.parametrize("mode", ["cpu", "hybrid", "head"])
def test_caches_from_a_real_plan(mode):
  cfg, plan = _tiny_plan(mode)
  assert plan.tactics() == (mode, mode), plan.table()
  caches = gen.caches_from_plan(cfg, plan, 1)
  for c, lp in zip(caches, plan.layers):
    assert c.capacity == 512 and c.fill == 0
    if mode == "head":
      assert isinstance(c, rkv.HeadSplitKV) and 0 <= lp.resident_heads < 2
      assert c.resident_heads == lp.resident_heads
      assert c.rolled.window_cells == lp.window_cells and c.rolled.tile_cells == lp.tile_cells
      continue
    assert isinstance(c, rkv.RollingKV) and c.tactic == mode
    assert (c.window_cells, c.tile_cells) == (lp.window_cells, lp.tile_cells)
    assert c.n_tail_tiles == lp.host_cells // lp.tile_cells
    if mode == "cpu":
      assert c.cpu_fraction is None and lp.hybrid_fraction is not None  # modeled, unused
      continue
    # The model splits by the share streamed in whole tiles of the full tail; the plan and the
    # cache store the share on the CPU, and rolling_attention's half-up rounding gives back the
    # planned tile counts.
    n = c.n_tail_tiles
    n_stream = round(lp.hybrid_fraction * n)
    assert n == 3 and 0 < n_stream < n, plan.table()
    assert c.cpu_fraction == gen.cpu_fraction(lp)
    assert math.isclose(c.cpu_fraction, 1.0 - lp.hybrid_fraction, abs_tol=1e-12)
    assert math.floor(c.cpu_fraction * n + 0.5) == n - n_stream


def test_planned_hybrid_decodes_like_resident():
  cfg, plan = _tiny_plan("hybrid")
  from flax import nnx
  model = models.Transformer(cfg, rngs=nnx.Rngs(0), impl="xla")
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(1, 512), dtype=np.int32)
  ref = gen.decode_logits(model, tokens, models.init_caches(cfg, 1, 512), prefill_len=506)
  got = gen.decode_logits(model, tokens, gen.caches_from_plan(cfg, plan, 1), prefill_len=506)
  passed, reasons = gates.check_gate(gates.logit_metrics(ref, got), "float32")
  assert passed, reasons


def test_cpu_fraction_of_a_layer_plan():
  _, plan = _tiny_plan("hybrid")
  lp = plan.layers[0]
  assert gen.cpu_fraction(dataclasses.replace(lp, cpu_fraction=None)) == 0.5  # unmodeled
  assert gen.cpu_fraction(dataclasses.replace(lp, cpu_fraction=0.0)) == 0.0
  assert gen.cpu_fraction(dataclasses.replace(lp, tactic="stream")) is None
  forced = gen.force_tactic(plan, "hybrid", 128, 128, cpu_fraction=0.25)
  assert forced.layers[0].hybrid_fraction == 0.75 and gen.cpu_fraction(forced.layers[0]) == 0.25
  # 1 - (1 - 0.1) is not 0.1 in floats: the share comes back exact, so 5 tiles still give 1
  forced = gen.force_tactic(plan, "hybrid", 128, 128, cpu_fraction=0.1)
  assert gen.cpu_fraction(forced.layers[0]) == 0.1


def test_force_tactic_layouts_and_bytes():
  _, plan = _tiny_plan("hybrid")  # a real plan: force_tactic overrides it whatever it holds
  cell = 2 * 2 * 16 * 4  # K/V bytes of one cell of one layer (K=2, D=16, float32, B=1)
  for tactic in gen.FORCED_TACTICS:
    r = 1 if tactic == "head" else None
    forced = gen.force_tactic(plan, tactic, 100, 64, resident_heads=1)
    for lp in forced.layers:
      assert (lp.tactic, lp.window_cells, lp.tail_cells, lp.tile_cells) == (tactic, 100, 412, 64)
      assert lp.resident_heads == r and lp.host_cells == 6 * 64
      heads = 1 if tactic == "head" else 2  # rolled heads
      assert lp.host_bytes == heads * 6 * 64 * cell // 2
      # window + staging K/V of the rolled heads, their positions (window, staging, host
      # tiles: all on the device), the resident head's cells and positions
      dev = (heads * (100 + 64) * cell // 2 + 4 * (100 + 64 + 6 * 64)
             + (512 * (cell // 2 + 4) if r else 0))
      assert lp.device_bytes == dev
    assert (forced.layers[0].hybrid_fraction is None) == (tactic != "hybrid")
  # force_stream is force_tactic("stream")
  assert gen.force_stream(plan, 100, 64) == gen.force_tactic(plan, "stream", 100, 64)


def test_force_tactic_bad_inputs_name_the_argument():
  cfg, plan = _tiny_plan("hybrid")
  with pytest.raises(ValueError, match="tactic must be one of"):
    gen.force_tactic(plan, "resident", 100, 64)
  with pytest.raises(ValueError, match="tactic"):
    gen.force_tactic(plan, "bogus", 100, 64)
  for r in (3, -1, True, 1.0):
    with pytest.raises(ValueError, match="resident_heads"):
      gen.force_tactic(plan, "head", 100, 64, resident_heads=r)
  for f in (-0.1, 1.5, True, "0.5"):
    with pytest.raises(ValueError, match="cpu_fraction"):
      gen.force_tactic(plan, "hybrid", 100, 64, cpu_fraction=f)
  with pytest.raises(ValueError, match="window_cells"):
    gen.force_tactic(plan, "cpu", 512, 64)
  with pytest.raises(ValueError, match="tile_cells"):
    gen.force_tactic(plan, "cpu", 100, 0)
  with pytest.raises(ValueError, match="plan"):
    gen.force_tactic(None, "cpu", 100, 64)
  head = gen.force_tactic(plan, "head", 100, 64)
  with pytest.raises(ValueError, match="resident_heads"):
    gen.caches_from_plan(cfg, _with_layers(head, resident_heads=None), 1)
  with pytest.raises(ValueError, match="resident_heads"):
    gen.caches_from_plan(cfg, _with_layers(head, resident_heads=5), 1)
  kv = rkv.RollingKV.empty(1, 8, 2, 16, window_cells=2, tile_cells=2)
  with pytest.raises(ValueError, match="tactic"):
    kv.with_tactic("head")
  with pytest.raises(ValueError, match="cpu_fraction"):
    kv.with_tactic("cpu", cpu_fraction=0.5)
  with pytest.raises(ValueError, match="cpu_fraction"):
    kv.with_tactic("hybrid", cpu_fraction=2.0)
  assert kv.with_tactic("hybrid").cpu_fraction == 0.5
  with pytest.raises(ValueError, match="tactic"):
    gen.serve_rolling(head.layers[0], kv)


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


def test_tactic_plan_from_the_planner():
  """Without a forced layout the gate's plan comes from rkv.plan in the tactic's mode."""
  cfg = models.ModelConfig.preset("tiny-llama", dtype="float32")
  res = rkv.ResidencyConfig(vram_target_mib=0.15, tile_cells=128, min_tile_cells=128,
                            cpu_attn_gbps=48.5)
  for tactic in gates.GATE_TACTICS:
    assert gates.tactic_plan(cfg, tactic, 512, 1, residency=res).tactics() == (tactic,) * 2
  with pytest.raises(ValueError, match="no layer"):  # everything fits: no tail, no tactic
    gates.tactic_plan(cfg, "cpu", 512, 1, residency=rkv.ResidencyConfig(vram_target_mib=64))
  with pytest.raises(ValueError, match="tactics"):
    gates.tactic_plan(cfg, "scan", 512, 1, residency=res)


def test_equivalence_gate_per_tactic(tmp_path, capsys):
  """experiments/equiv_gate.py's library call: one resident run, a report per tactic, a table."""
  import json
  out = tmp_path / "gate.json"
  report = gates.equivalence_gate(checkpoint=os.path.join(FIXTURES, "gemma2"), tactics="cpu,head",
                                  out=str(out))
  assert report.passed and [r.tactic for r in report.reports] == ["cpu", "head"]
  printed = capsys.readouterr().out
  assert "== cpu ==" in printed and "GATE PASSED" in printed
  table = report.table().splitlines()
  assert table[0].split()[:2] == ["tactic", "max_abs_logit"] and len(table) == 3
  saved = json.load(open(out))
  assert saved["tactics"] == ["cpu", "head"] and saved["passed"] and saved["reasons"] == []
  assert saved["dtype"] == "float32" and saved["reference_metrics"]["top1_agreement"] == 1.0
  assert saved["results"]["head"]["plan"].count("head") >= 2  # the head plan's table
  assert saved["results"]["cpu"]["metrics"]["max_abs_logit"] <= gates.F32_MAX_ABS_LOGIT
  for bad in ("bogus", "", "cpu,cpu", ("resident",)):
    with pytest.raises(ValueError, match="tactics"):
      gates.check_tactics(bad)


def test_prefetcher_room_by_tiles_and_bytes(monkeypatch):
  """The Prefetcher keeps at most max_tiles tiles and max_bytes bytes on the device (always at
  least one tile), frees room only once a layer's result is ready, and requests in attention
  order across layers; prefetch_room is the planner's reserve for it."""
  from rkv.offload import memory, stream
  dev = lambda shape: jnp.zeros(shape, jnp.float32)
  host = lambda shape: memory.to_host(jnp.ones(shape, jnp.float32))
  tile = lambda: stream.Tile(host((1, 4, 1, 8)), host((1, 4, 1, 8)), dev((1, 4)), None, None)
  nb = 2 * 4 * 8 * 4  # K and V of one tile
  layers = [(i, [tile(), tile()]) for i in range(3)]
  pf = stream.Prefetcher(max_tiles=8, max_bytes=3 * nb)
  pf.begin(layers)
  assert pf.requested == 3 and pf._in_flight() == 3  # the byte cap, not the tile cap
  got = pf.take(0, layers[0][1])
  assert all(stream.on_device(t) for t in got) and pf.late == 0
  pf.consumed(jnp.zeros(()))  # layer 0 done: its 2 tiles' room comes back
  assert pf.requested == 5 and pf._in_flight() == 3
  # A tile larger than max_bytes still streams, one at a time.
  big = stream.Prefetcher(max_tiles=8, max_bytes=1)
  big.begin(layers)
  assert big.requested == 1
  assert stream.prefetch_room(nb, 8, 3 * nb) == 3 * nb
  assert stream.prefetch_room(10 * nb, 8, 3 * nb) == 10 * nb
  assert stream.prefetch_room(0, 8) == 0 and stream.prefetch_room(nb, 0) == 0
  with pytest.raises(ValueError, match="max_bytes"):
    stream.Prefetcher(max_bytes=0)
  for raw, want in (("", 0), ("3", 3)):
    monkeypatch.setenv(stream.PREFETCH_TILES_ENV, raw)
    assert stream._prefetch_tiles_from_env() == want
  monkeypatch.setenv(stream.PREFETCH_TILES_ENV, "lots")
  with pytest.raises(ValueError, match="RKV_PREFETCH_TILES"):
    stream._prefetch_tiles_from_env()
