"""HF parity: rkv.models reproduces transformers' float32 logits on tiny random checkpoints.

The fixtures (``tests/fixtures/hf/<arch>/``, made by ``scripts/make_hf_fixtures.py`` with
transformers, eager attention, float32) hold a checkpoint and HF's full-forward logits for a fixed
``[2, 32]`` token batch (``[2, 48]`` for the long-context RoPE fixtures ``yarn``, ``dynamic``,
``longrope``, whose original length is 16). Sliding windows (8, 6) are shorter than the sequence,
so ring caches wrap both inside a prefill chunk and during decode. No torch is needed here.

Where the RoPE depends on the sequence length (``dynamic``, ``longrope``), an incremental decode
does not equal the full forward, in transformers as in rkv: those fixtures also hold HF's own
logits for the same prefill chunks and decode steps (``decode_logits``), which rkv's incremental
decode must match.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rkv import models
from tests.support.tolerances import HF_LOGITS_ATOL as ATOL

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
ARCHS = ("llama", "qwen2", "mistral", "gemma2", "gemma3", "qwen3", "yarn", "dynamic", "longrope")
LONG_ROPE = {"yarn": "yarn", "dynamic": "dynamic", "longrope": "longrope"}  # fixture -> rope kind
PREFILL = (13, 7)  # two prefill chunks (the second wraps the rings), then one token at a time


def _reference(arch):
  ref = np.load(os.path.join(FIXTURES, arch, "reference.npz"))
  return ref["tokens"], ref["logits"]


def _decode_reference(arch):
  """HF's logits for PREFILL then one token at a time: its full forward's, unless the RoPE
  depends on the length (then HF's own incremental run, saved with the chunks it used)."""
  ref = np.load(os.path.join(FIXTURES, arch, "reference.npz"))
  if "decode_logits" not in ref:
    return ref["logits"]
  assert tuple(ref["decode_chunks"]) == PREFILL
  return ref["decode_logits"]


@pytest.fixture(scope="module", params=ARCHS)
def loaded(request):
  """(arch, model, fwd): ``fwd`` is one jitted step shared by the cached tests of the arch, so the
  prefill and decode shapes compile once per arch."""
  arch = request.param
  model = models.load_hf(os.path.join(FIXTURES, arch), jnp.float32, impl="xla")
  return arch, model, models.jit_forward(model)


def _max_err(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_full_forward_matches_hf(loaded, impl):
  arch, model, _ = loaded
  tokens, want = _reference(arch)
  got = model(jnp.asarray(tokens), impl=impl)
  assert got.shape == want.shape and got.dtype == jnp.float32
  assert _max_err(got, want) < ATOL, arch


def _decode(fwd, tokens, positions, caches):
  """Prefill ``PREFILL`` chunks, then one token at a time; the logits of every step."""
  t = tokens.shape[1]
  chunks = PREFILL + (1,) * (t - sum(PREFILL))
  out, i = [], 0
  for n in chunks:
    logits, caches = fwd(jnp.asarray(tokens[:, i:i + n]),
                         jnp.asarray(positions[:, i:i + n], jnp.int32), caches)
    out.append(np.asarray(logits))
    i += n
  return np.concatenate(out, axis=1)


def test_incremental_decode_matches_hf(loaded):
  arch, model, fwd = loaded
  tokens, _ = _reference(arch)
  want = _decode_reference(arch)
  b, t = tokens.shape
  caches = models.init_caches(model.config, b, t)
  assert any(isinstance(c, models.RingCache) for c in caches) == bool(model.config.sliding_layers)
  positions = np.broadcast_to(np.arange(t), (b, t))
  got = _decode(fwd, tokens, positions, caches)
  assert _max_err(got, want) < ATOL, arch
  # Two prefill shapes and one decode shape: no compilation per token.
  assert fwd.jitted._cache_size() == 3


def test_incremental_decode_resident_caches_on_sliding_layers():
  """Sliding-window layers on full-length resident caches (the window is a mask there)."""
  model = models.load_hf(os.path.join(FIXTURES, "gemma3"), jnp.float32, impl="xla")
  tokens, want = _reference("gemma3")
  b, t = tokens.shape
  caches = models.init_caches(model.config, b, t, ring=False)
  assert all(type(c) is models.ResidentCache for c in caches)
  got = _decode(models.jit_forward(model), tokens, np.broadcast_to(np.arange(t), (b, t)), caches)
  assert _max_err(got, want) < ATOL


def test_left_padded_row_matches_unpadded(loaded):
  """A row left-padded with position -1 gives the unpadded logits for its real tokens, in the full
  forward pass and through the caches."""
  arch, model, fwd = loaded
  tokens, want = _reference(arch)
  pad, n = 5, tokens.shape[1] - 5
  toks = np.stack([tokens[0], np.concatenate([np.zeros(pad, tokens.dtype), tokens[1, :n]])])
  pos = np.stack([np.arange(tokens.shape[1]), np.r_[np.full(pad, -1), np.arange(n)]])
  got = model(jnp.asarray(toks), jnp.asarray(pos, jnp.int32))
  assert _max_err(got[0], want[0]) < ATOL
  assert _max_err(got[1, pad:], want[1, :n]) < ATOL
  if model.config.rope.length_dependent:
    return  # padding moves row 1's tokens into other calls, whose seq_len differs (see above)
  got = _decode(fwd, toks, pos, models.init_caches(model.config, 2, tokens.shape[1]))
  assert _max_err(got[0], want[0]) < ATOL
  assert _max_err(got[1, pad:], want[1, :n]) < ATOL


@pytest.mark.parametrize("arch", sorted(LONG_ROPE))
def test_long_context_fixtures_exercise_their_rope_scaling(arch):
  """The sequence passes the original length, so the same weights with the unscaled RoPE miss
  HF's logits by far: the parity above is the scaling's, not a default rope's."""
  model = models.load_hf(os.path.join(FIXTURES, arch), jnp.float32, impl="xla")
  rope = model.config.rope
  assert rope.kind == LONG_ROPE[arch] and rope.original_max_position == 16
  tokens, want = _reference(arch)
  assert tokens.shape[1] > 2 * rope.original_max_position
  plain = models.ModelConfig.from_hf(_config_json(arch), dtype="float32")
  plain = plain.replace(rope=models.RopeConfig(theta=rope.theta))
  unscaled = nnx.merge(nnx.graphdef(models.Transformer(plain, rngs=nnx.Rngs(0), impl="xla")),
                       nnx.state(model))
  assert _max_err(models.jit_forward(unscaled)(jnp.asarray(tokens)), want) > 100 * ATOL


def _config_json(arch):
  with open(os.path.join(FIXTURES, arch, "config.json")) as f:
    return json.load(f)


def test_gemma3_multimodal_checkpoint_text_part(tmp_path):
  """Gemma3ForConditionalGeneration, transformers-4.x config layout (rope_theta,
  rope_local_base_freq, rope_scaling on global layers, sliding_window_pattern), weights under
  ``language_model.model.`` beside a vision tower that is ignored."""
  src = os.path.join(FIXTURES, "gemma3")
  with open(os.path.join(src, "config.json")) as f:
    text = json.load(f)
  for k in ("layer_types", "rope_parameters", "_sliding_window_pattern", "architectures"):
    text.pop(k)
  text.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=2,
              rope_scaling={"rope_type": "linear", "factor": 8.0})
  cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
         "text_config": text, "vision_config": {"hidden_size": 8}}
  with open(tmp_path / "config.json", "w") as f:
    json.dump(cfg, f)
  tensors = {"language_model." + k: v
             for k, v in models.read_safetensors(os.path.join(src, "model.safetensors")).items()}
  tensors["vision_tower.vision_model.post_layernorm.weight"] = np.ones(8, np.float32)
  models.save_safetensors(str(tmp_path / "model.safetensors"), tensors)
  model = models.load_hf(str(tmp_path), jnp.float32, impl="xla")
  assert model.config.layer_windows == (6, None, 6)
  tokens, want = _reference("gemma3")
  assert _max_err(model(jnp.asarray(tokens)), want) < ATOL


def test_bfloat16_load_runs_close_to_float32():
  arch = "gemma3"
  tokens, want = _reference(arch)
  model = models.load_hf(os.path.join(FIXTURES, arch), jnp.bfloat16, impl="xla")
  assert model.config.dtype == jnp.bfloat16
  assert model.embed.embedding[...].dtype == jnp.bfloat16
  got = model(jnp.asarray(tokens))
  assert got.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(got)))
  # bf16 activations through a few layers: a smoke bound, not a parity gate.
  assert _max_err(got, want) < 0.02 * float(np.abs(want).max()) + 0.1


def test_rolling_cache_on_global_layers_matches_hf():
  """A plan's per-layer swap: RollingKV (device window + pinned-host tail) on the global layers of
  Gemma-2, a ring on its sliding layer; the model calls rkv.rolling_attention for the former."""
  import rkv
  model = models.load_hf(os.path.join(FIXTURES, "gemma2"), jnp.float32, impl="xla")
  tokens, want = _reference("gemma2")
  b, t = 2, 12
  cfg = model.config
  caches = list(models.init_caches(cfg, b, t))
  for i in cfg.global_layers:
    caches[i] = rkv.RollingKV.empty(b, t, cfg.num_kv_heads, cfg.head_dim, window_cells=4,
                                    tile_cells=4, dtype=jnp.float32)
  pos = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
  logits, caches = model(jnp.asarray(tokens[:, :9]), jnp.asarray(pos[:, :9]), caches)
  out = [np.asarray(logits)]
  for i in range(9, t):
    logits, caches = model(jnp.asarray(tokens[:, i:i + 1]), jnp.asarray(pos[:, i:i + 1]), caches)
    out.append(np.asarray(logits))
  assert caches[1].n_full_tiles == 2  # 8 of the 12 cells live in the host tail
  assert _max_err(np.concatenate(out, axis=1), want[:, :t]) < ATOL
