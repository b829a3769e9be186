"""rkv.models.embedding_to_host: the input embedding table in host RAM, looked up exactly."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rkv
from rkv import generate as gen
from rkv import models
from rkv.models import host_embed

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")


def _llama():
  model = models.load_hf(os.path.join(FIXTURES, "llama"), jnp.float32, impl="xla")
  tokens = np.load(os.path.join(FIXTURES, "llama", "reference.npz"))["tokens"]
  return model, tokens


def test_gather_rows_follows_jnp_take():
  table = np.arange(15, dtype=np.float32).reshape(5, 3)
  tokens = np.array([[0, 4, -1, -5], [5, -6, 2, 100]])
  got = host_embed.gather_rows(table, tokens)
  want = np.asarray(jnp.take(jnp.asarray(table), jnp.asarray(tokens), axis=0))
  np.testing.assert_array_equal(got, want)  # NaN rows compare equal to NaN rows
  assert np.isnan(got[1, 0]).all() and np.isnan(got[1, 1]).all() and np.isnan(got[1, 3]).all()
  np.testing.assert_array_equal(got[0, 2], table[4])


def test_lookup_eager_and_jitted_equal_the_device_table():
  model, tokens = _llama()
  table = np.asarray(model.embed.embedding[...])
  want = np.asarray(model.embed(jnp.asarray(tokens)))
  emb = models.HostEmbed(table)
  np.testing.assert_array_equal(np.asarray(emb(tokens)), want)
  np.testing.assert_array_equal(np.asarray(jax.jit(emb)(jnp.asarray(tokens))), want)
  assert emb.nbytes == table.nbytes
  assert jax.tree.leaves(nnx.state(emb)) == []  # not a leaf: never passed into a program


def test_jitted_model_logits_unchanged_bit_for_bit():
  model, tokens = _llama()
  want = np.asarray(models.jit_forward(model)(tokens[:, :9]))
  assert models.embedding_to_host(model) is model
  assert isinstance(model.embed, models.HostEmbed)
  assert models.embedding_to_host(model) is model  # already there: unchanged
  np.testing.assert_array_equal(np.asarray(models.jit_forward(model)(tokens[:, :9])), want)


@pytest.mark.parametrize("tactic", ["stream", "hybrid"])
def test_offloaded_decode_unchanged_bit_for_bit(tactic):
  """A forced offloaded plan (W=4, 4-cell tiles, B=2): prefill 13, then one-token steps through
  layered_forward (the staging tile flushes at 16), with the table on the device and on the host:
  the same logits and caches, bit for bit."""
  def run(on_host):
    model, tokens = _llama()
    if on_host:
      models.embedding_to_host(model)
    cfg = model.config
    base = rkv.plan(cfg, 32, 2, residency=rkv.ResidencyConfig(vram_target_mib=1 << 20))
    plan = gen.force_tactic(base, tactic, 4, 4, cpu_fraction=0.5)
    pos = lambda lo, hi: np.broadcast_to(np.arange(lo, hi, dtype=np.int32), (2, hi - lo))
    fwd = models.layered_forward(model, last_only=True)
    out = [fwd(tokens[:, :13], pos(0, 13), gen.caches_from_plan(cfg, plan, 2, 32, jnp.float32))]
    for i in range(13, 19):
      out.append(fwd(jnp.asarray(tokens[:, i:i + 1]), pos(i, i + 1), out[-1][1]))
    return [np.asarray(l) for l, _ in out], out[-1][1]

  dev, host = run(False), run(True)
  for x, y in zip(dev[0], host[0]):
    np.testing.assert_array_equal(x, y)
  for x, y in zip(jax.tree.leaves(dev[1]), jax.tree.leaves(host[1])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_generate_with_the_table_on_the_host():
  model, tokens = _llama()
  cfg = model.config
  ref = gen.generate(model, tokens[:, :13], max_new_tokens=4,
                     caches=models.init_caches(cfg, tokens.shape[0], 17))
  models.embedding_to_host(model)
  out = gen.generate(model, tokens[:, :13], max_new_tokens=4,
                     caches=models.init_caches(cfg, tokens.shape[0], 17))
  np.testing.assert_array_equal(out.tokens, ref.tokens)


def test_bad_inputs_name_the_problem():
  cfg = models.ModelConfig.preset("tiny-gemma2", dtype="float32")
  assert cfg.tie_embeddings
  tied = models.Transformer(cfg, rngs=nnx.Rngs(0), impl="xla")
  with pytest.raises(ValueError, match="ties its input embedding"):
    models.embedding_to_host(tied)
  assert isinstance(tied.embed, nnx.Embed)  # refused: nothing moved
  with pytest.raises(ValueError, match="must be a rkv.models.Transformer"):
    models.embedding_to_host(object())
  with pytest.raises(ValueError, match=r"\[vocab, features\]"):
    models.HostEmbed(np.zeros(4))
  from rkv import parallel
  untied = models.embedding_to_host(models.Transformer(
      models.ModelConfig.preset("tiny-llama", dtype="float32"), rngs=nnx.Rngs(0), impl="xla"))
  with pytest.raises(ValueError, match="shard the model before moving it"):
    parallel.shard_model(untied, parallel.make_mesh(1, 1, devices=jax.devices()[:1]))


def test_the_device_table_is_freed():
  import gc
  model = models.Transformer(models.ModelConfig.preset("tiny-llama", dtype="float32"),
                             rngs=nnx.Rngs(0), impl="xla")
  live = lambda: sum(a.nbytes for a in jax.live_arrays())
  gc.collect()
  before = live()
  models.embedding_to_host(model)
  gc.collect()
  assert before - live() == model.embed.nbytes == 128 * 64 * 4  # vocab x hidden x f32
