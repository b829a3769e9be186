"""rkv.models: presets, HF config parsing, checkpoint errors, caches, compilation behaviour."""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rkv import models
from rkv.models import ModelConfig, RopeConfig

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")

# The released config.json files (transformers 4.x layout), trimmed of unused keys.
HUB_CONFIGS = {
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "hidden_act": "silu",
        "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 8192,
        "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "vocab_size": 128256},
    "llama3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "hidden_act": "silu",
        "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 131072,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "vocab_size": 128256},
    "qwen2.5-1.5b": {
        "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 1536,
        "intermediate_size": 8960, "max_position_embeddings": 131072, "max_window_layers": 28,
        "model_type": "qwen2", "num_attention_heads": 12, "num_hidden_layers": 28,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "sliding_window": 131072, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "use_sliding_window": False, "vocab_size": 151936},
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32000},
    "gemma2-2b": {
        "architectures": ["Gemma2ForCausalLM"], "attention_bias": False,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 2304, "intermediate_size": 9216, "max_position_embeddings": 8192,
        "model_type": "gemma2", "num_attention_heads": 8, "num_hidden_layers": 26,
        "num_key_value_heads": 4, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32",
        "vocab_size": 256000},
    "gemma3-4b": {  # google/gemma-3-4b-it: the text config relies on Gemma3TextConfig defaults
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                        "model_type": "gemma3_text", "num_hidden_layers": 34,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "torch_dtype": "bfloat16", "vision_config": {"hidden_size": 1152}},
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288,
        "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
        "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_sliding_window": False, "vocab_size": 151936},
}


# ----------------------------------------------------------------------------------------------
# Presets and configs
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,dims,params", [
    ("llama3-8b", (32, 32, 8, 128, 128256, 4096), 8_030_261_248),
    ("qwen2.5-1.5b", (28, 12, 2, 128, 151936, 1536), 1_543_714_304),
    ("mistral-7b", (32, 32, 8, 128, 32000, 4096), 7_241_732_096),
    ("gemma2-2b", (26, 8, 4, 256, 256000, 2304), 2_614_341_888),
    ("gemma3-4b", (34, 8, 4, 256, 262208, 2560), 3_880_263_168),
    ("qwen3-8b", (36, 32, 8, 128, 151936, 4096), 8_190_735_360),
])
def test_presets_have_true_dims(name, dims, params):
  c = ModelConfig.preset(name)
  assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size,
          c.hidden_size) == dims
  assert c.param_count() == params  # the released checkpoints' parameter counts
  assert c.dtype == np.dtype(jnp.bfloat16)


def test_preset_features():
  llama, qwen = ModelConfig.preset("llama3-8b"), ModelConfig.preset("qwen2.5-1.5b")
  g2, g3 = ModelConfig.preset("gemma2-2b"), ModelConfig.preset("gemma3-4b")
  assert llama.rope.theta == 500000.0 and not llama.tie_embeddings and llama.activation == "silu"
  assert llama.kv_bytes_per_token(0) == 2 * 8 * 128 * 2
  assert llama.kv_bytes_per_token() == 32 * 2 * 8 * 128 * 2
  assert qwen.qkv_bias and not qwen.o_bias and qwen.tie_embeddings
  assert (g2.attn_softcap, g2.final_softcap, g2.attn_scale) == (50.0, 30.0, 256 ** -0.5)
  assert g2.norm_plus_one and g2.sandwich_norms and g2.embed_scale and not g2.qk_norm
  assert g2.activation == "gelu_tanh" and g2.tie_embeddings
  assert g3.qk_norm and g3.attn_softcap is None and g3.final_softcap is None
  assert g3.rope == RopeConfig(theta=1e6, kind="linear", factor=8.0)
  assert g3.rope_local == RopeConfig(theta=1e4)
  assert g3.layer_rope(0) == g3.rope_local and g3.layer_rope(5) == g3.rope


def test_layer_windows():
  assert ModelConfig.preset("llama3-8b").layer_windows == (None,) * 32
  assert ModelConfig.preset("qwen2.5-1.5b").layer_windows == (None,) * 28
  assert ModelConfig.preset("mistral-7b").layer_windows == (4096,) * 32
  g2 = ModelConfig.preset("gemma2-2b")
  assert g2.layer_windows == (4096, None) * 13
  g3 = ModelConfig.preset("gemma3-4b")
  assert g3.global_layers == (5, 11, 17, 23, 29)
  assert all(g3.layer_windows[i] == 1024 for i in g3.sliding_layers)
  assert len(g3.sliding_layers) == 29


@pytest.mark.parametrize("name", sorted(HUB_CONFIGS))
def test_from_hf_release_configs_match_presets(name):
  got = ModelConfig.from_hf(HUB_CONFIGS[name], dtype="bfloat16")
  assert got.replace(name=name) == ModelConfig.preset(name)


def _v4_layout(arch: str, d: dict) -> dict:
  """The transformers-4.x spelling of a fixture's (5.x) config.json."""
  d = dict(d)
  rp = d.pop("rope_parameters")
  if arch == "gemma3":
    d.update(rope_theta=rp["full_attention"]["rope_theta"],
             rope_local_base_freq=rp["sliding_attention"]["rope_theta"],
             rope_scaling={k: v for k, v in rp["full_attention"].items() if k != "rope_theta"},
             sliding_window_pattern=2)
  else:
    d["rope_theta"] = rp.pop("rope_theta")
    d["rope_scaling"] = None if rp.get("rope_type") == "default" else rp
  if arch != "llama":
    d.pop("layer_types", None)
  d.pop("_sliding_window_pattern", None)
  return d


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma2", "gemma3", "qwen3", "yarn",
                                  "dynamic", "longrope"])
def test_from_hf_reads_both_config_layouts(arch):
  with open(os.path.join(FIXTURES, arch, "config.json")) as f:
    d = json.load(f)
  new = ModelConfig.from_hf(d)
  assert new == ModelConfig.from_hf(_v4_layout(arch, d))
  assert new.dtype == np.dtype(d["dtype"])  # the checkpoint's dtype unless one is asked for


def test_fixture_configs_cover_the_features():
  cfg = {a: models.load_config(os.path.join(FIXTURES, a)) for a in
         ("llama", "qwen2", "mistral", "gemma2", "gemma3")}
  assert cfg["llama"].rope.kind == "llama3" and cfg["llama"].layer_windows == (None, None)
  assert cfg["qwen2"].layer_windows == (None, 8) and cfg["qwen2"].qkv_bias
  assert cfg["mistral"].layer_windows == (8, 8) and cfg["mistral"].head_dim == 24
  assert cfg["gemma2"].layer_windows == (8, None) and cfg["gemma2"].attn_softcap == 2.0
  assert cfg["gemma3"].layer_windows == (6, None, 6) and cfg["gemma3"].rope.kind == "linear"
  assert cfg["gemma3"].rope_local == RopeConfig(theta=1e4)
  q3 = models.load_config(os.path.join(FIXTURES, "qwen3"))
  assert q3.family == "qwen3" and q3.qk_norm and not q3.norm_plus_one and not q3.qkv_bias
  assert q3.head_dim * q3.num_heads != q3.hidden_size and q3.layer_windows == (None, 8)
  long = {a: models.load_config(os.path.join(FIXTURES, a)).rope
          for a in ("yarn", "dynamic", "longrope")}
  assert {a: r.kind for a, r in long.items()} == {a: a for a in long}
  assert all(r.original_max_position == 16 for r in long.values())
  assert long["yarn"].attention_scaling == pytest.approx(0.1 * np.log(4.0) + 1)
  # longrope: factor = max_position_embeddings / original = 64 / 16
  assert long["longrope"].attention_scaling == pytest.approx(np.sqrt(1 + np.log(4) / np.log(16)))


@pytest.mark.parametrize("change,match", [
    (dict(num_kv_heads=3), "multiple of num_kv_heads"),
    (dict(layer_windows=(None,)), "layer_windows must have"),
    (dict(layer_windows=(0, None)), "layer_windows entries"),
    (dict(dtype="int8"), "dtype must be one of"),
    (dict(activation="relu"), "activation must be one of"),
    (dict(head_dim=15), "head_dim must be even"),
    (dict(rms_norm_eps=-1e-6), "rms_norm_eps must be a finite number >= 0"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be a finite number >= 0"),
])
def test_config_validation(change, match):
  with pytest.raises(ValueError, match=match):
    ModelConfig.preset("tiny-llama", **change)


def test_from_hf_errors():
  with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
    ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
  with pytest.raises(ValueError, match="unsupported model_type 'bert'"):
    ModelConfig.from_hf({"model_type": "bert"})
  llama = dict(HUB_CONFIGS["llama3-8b"])
  with pytest.raises(ValueError, match="unsupported rope_type 'ntk-by-parts'"):
    ModelConfig.from_hf({**llama, "rope_scaling": {"rope_type": "ntk-by-parts", "factor": 4.0}})
  with pytest.raises(ValueError, match="rope_type 'longrope' needs 'long_factor'"):
    ModelConfig.from_hf({**llama, "rope_scaling": {"rope_type": "longrope",
                                                   "short_factor": [1.0] * 64}})
  with pytest.raises(ValueError, match="rope_type 'dynamic' needs 'factor'"):
    ModelConfig.from_hf({**llama, "rope_scaling": {"rope_type": "dynamic"}})
  del llama["hidden_size"]
  with pytest.raises(ValueError, match="hidden_size"):
    ModelConfig.from_hf(llama)
  with pytest.raises(ValueError, match="unknown preset"):
    ModelConfig.preset("llama-70b")


def test_long_context_rope_parsing_follows_transformers_defaults():
  llama = dict(HUB_CONFIGS["llama3-8b"])  # max_position_embeddings 8192
  # Phi-3 style: the top-level original_max_position_embeddings wins; no factor: the ratio.
  phi = ModelConfig.from_hf({**llama, "original_max_position_embeddings": 4096, "rope_scaling": {
      "rope_type": "longrope", "short_factor": [1.0] * 64, "long_factor": [2.0] * 64,
      "original_max_position_embeddings": 1024}}).rope
  assert (phi.original_max_position, phi.factor) == (4096, 2.0)
  assert phi.attention_scaling == pytest.approx(np.sqrt(1 + np.log(2) / np.log(4096)))
  yarn = ModelConfig.from_hf({**llama, "rope_scaling": {
      "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
      "mscale": 0.707, "mscale_all_dim": 0.707}}).rope
  assert (yarn.beta_fast, yarn.beta_slow, yarn.truncate) == (32.0, 1.0, True)
  assert yarn.attention_scaling == pytest.approx(1.0)  # DeepSeek's mscale / mscale_all_dim
  assert dataclasses.replace(yarn, attention_factor=1.5).attention_scaling == 1.5
  dyn = ModelConfig.from_hf({**llama, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
  assert dyn.rope.original_max_position == 8192  # transformers scales past max_position_embeddings
  with pytest.raises(ValueError, match="longrope short_factor has 3 entries, expected"):
    RopeConfig(kind="longrope", short_factor=(1.0,) * 3, long_factor=(1.0,) * 3).inv_freq(16)


def test_yarn_frequencies_blend_extrapolation_and_interpolation():
  yarn = RopeConfig(theta=1e4, kind="yarn", factor=8.0, original_max_position=64)
  base = RopeConfig(theta=1e4).inv_freq(64)
  got = yarn.inv_freq(64)
  # The highest frequency (32 rotations within the original length) is kept, the low ones are
  # divided by the factor, and the ratio falls monotonically between (the ramp).
  ratio = got / base
  assert ratio[0] == 1.0
  np.testing.assert_allclose(ratio[-4:], 1 / 8.0, rtol=1e-6)
  assert np.all(np.diff(ratio) <= 1e-7) and 1 / 8.0 < ratio[3] < 1.0


def test_length_dependent_ropes_take_each_calls_max_position():
  """rope_tables (traced) equals RopeConfig.inv_freq at seq_len = max(positions) + 1; padding
  (-1) does not count; at or below the original length both are the unscaled frequencies."""
  from rkv.models.transformer import rope_tables
  d = 16
  ropes = [RopeConfig(theta=1e4, kind="dynamic", factor=4.0, original_max_position=16),
           RopeConfig(theta=1e4, kind="longrope", factor=4.0, original_max_position=16,
                      short_factor=np.linspace(1, 1.5, d // 2), long_factor=np.linspace(1, 8, d // 2))]
  jitted = jax.jit(rope_tables, static_argnums=(0, 1))
  for rope in ropes:
    for last in (10, 15, 16, 40):
      pos = np.stack([np.arange(last - 7, last + 1), np.r_[np.arange(6), -1, -1]]).astype(np.int32)
      cos, sin = jitted(rope, d, jnp.asarray(pos))
      inv = rope.inv_freq(d, seq_len=last + 1)
      scale = rope.attention_scaling
      np.testing.assert_allclose(np.asarray(cos), np.cos(pos[..., None] * inv) * scale,
                                 atol=2e-6)
      np.testing.assert_allclose(np.asarray(sin), np.sin(pos[..., None] * inv) * scale,
                                 atol=2e-6)
      unscaled = rope.inv_freq(d)
      assert np.array_equal(inv, unscaled) == (last + 1 <= 16), (rope.kind, last)
  assert jitted._cache_size() == 2  # one program per rope: seq_len is data, not shape


def test_llama3_rope_scaling_bands():
  base = RopeConfig(theta=500000.0).inv_freq(128)
  scaled = ModelConfig.preset("llama3.1-8b").rope.inv_freq(128)
  wavelen = 2 * np.pi / base
  np.testing.assert_array_equal(scaled[wavelen < 8192 / 4], base[wavelen < 8192 / 4])
  np.testing.assert_allclose(scaled[wavelen > 8192], base[wavelen > 8192] / 8, rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# Checkpoint loading
# ----------------------------------------------------------------------------------------------
def _copy_fixture(arch, dst):
  shutil.copytree(os.path.join(FIXTURES, arch), dst, dirs_exist_ok=True)
  return str(dst)


def test_load_hf_missing_files(tmp_path):
  with pytest.raises(ValueError, match="does not exist"):
    models.load_hf(str(tmp_path / "nope"))
  with pytest.raises(ValueError, match="missing config.json"):
    models.load_hf(str(tmp_path))
  path = _copy_fixture("mistral", tmp_path / "m")
  os.remove(os.path.join(path, "model.safetensors"))
  with pytest.raises(ValueError, match="no weights: expected model.safetensors"):
    models.load_hf(path)
  qwen = _copy_fixture("qwen2", tmp_path / "q")
  os.remove(os.path.join(qwen, "model-00002-of-00003.safetensors"))
  with pytest.raises(ValueError, match="model-00002-of-00003.safetensors"):
    models.load_hf(qwen)


def test_load_hf_unsupported_architecture(tmp_path):
  path = _copy_fixture("llama", tmp_path / "x")
  with open(os.path.join(path, "config.json")) as f:
    d = json.load(f)
  d["architectures"] = ["MixtralForCausalLM"]
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(d, f)
  with pytest.raises(ValueError, match="unsupported architecture 'MixtralForCausalLM'"):
    models.load_hf(path)


def test_load_hf_missing_or_misshapen_tensor(tmp_path):
  src = models.read_safetensors(os.path.join(FIXTURES, "gemma2", "model.safetensors"))
  path = _copy_fixture("gemma2", tmp_path / "g")
  file = os.path.join(path, "model.safetensors")
  name = "model.layers.1.pre_feedforward_layernorm.weight"
  models.save_safetensors(file, {k: v for k, v in src.items() if k != name})
  with pytest.raises(ValueError, match=f"missing tensors.*{name}"):
    models.load_hf(path)
  bad = dict(src)
  bad["model.layers.0.self_attn.k_proj.weight"] = np.zeros((3, 64), np.float32)
  models.save_safetensors(file, bad)
  with pytest.raises(ValueError, match=r"k_proj.weight' has shape \(3, 64\), expected \(64, 64\)"):
    models.load_hf(path)
  with open(file, "wb") as f:
    f.write((1 << 40).to_bytes(8, "little"))
  with pytest.raises(ValueError, match="header length"):
    models.load_hf(path)


def test_fused_projections_round_trip_and_refuse_a_partial_fill():
  """q/k/v and gate/up load into one fused parameter each: model_tensors splits them back to the
  checkpoint's tensors bit for bit, and a weight map that leaves columns unfilled raises."""
  from rkv.models import hf
  path = os.path.join(FIXTURES, "qwen2")  # sharded, with q/k/v biases
  src = {}
  for file in hf.checkpoint_files(path):
    src.update(models.read_safetensors(file))
  model = models.load_hf(path)
  back = models.model_tensors(model)
  assert sorted(back) == sorted(n for n in src if n != "lm_head.weight" or
                                not model.config.tie_embeddings)
  for name, x in back.items():
    np.testing.assert_array_equal(x, np.asarray(src[name], np.float32), err_msg=name)
  mapping = [s for s in models.hf_weight_map(model.config)
             if s.name != "model.layers.1.self_attn.v_proj.bias"]
  with pytest.raises(ValueError, match=r"layers\.1\.attn\.qkv_proj\.bias got \d+ of its \d+ "
                                       r"columns"):
    hf.model_from_tensors(model.config, src, mapping, where="test")


def _params(model):
  return jax.tree.leaves(nnx.state(model, nnx.Param))


def _edit_config(path, **changes):
  with open(os.path.join(path, "config.json")) as f:
    d = json.load(f)
  for k, v in changes.items():
    if v is None:
      d.pop(k, None)
    else:
      d[k] = v
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(d, f)


def test_load_hf_keeps_the_checkpoints_dtype(tmp_path):
  """No dtype: the checkpoint's own (config.json's dtype, else torch_dtype, else the weights'
  headers), so a bf16 checkpoint's KV cache is bf16; dtype= overrides it."""
  bf16 = os.path.join(FIXTURES, "qwen2")  # saved in bfloat16, config "dtype": "bfloat16"
  model = models.load_hf(bf16, impl="xla")
  assert model.config.dtype == jnp.bfloat16
  assert {p.dtype for p in _params(model)} == {jnp.dtype(jnp.bfloat16)}
  assert models.init_caches(model.config, 1, 8)[0].k.dtype == jnp.bfloat16
  assert models.load_config(bf16).dtype == jnp.bfloat16
  f32 = models.load_hf(bf16, jnp.float32, impl="xla")
  assert {p.dtype for p in _params(f32)} == {jnp.dtype(jnp.float32)}
  # Same values: bf16 -> f32 is exact, and the bf16 load did not round twice.
  for a, b in zip(_params(model), _params(f32)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b))
  assert models.load_hf(os.path.join(FIXTURES, "llama"), impl="xla").config.dtype == jnp.float32
  # A 4.x config (torch_dtype) and one that names no dtype (the headers say bfloat16).
  path = _copy_fixture("gemma3", tmp_path / "g")
  _edit_config(path, dtype=None, torch_dtype="float16")
  assert models.load_config(path).dtype == jnp.float16
  _edit_config(path, torch_dtype=None)
  assert models.load_config(path).dtype == jnp.bfloat16
  assert models.load_hf(path, impl="xla").embed.embedding[...].dtype == jnp.bfloat16


def test_load_hf_copies_each_parameter_once_already_final(monkeypatch):
  """What crosses to the device is one host array per parameter, already in the parameter's
  dtype and [in, out] (fused q/k/v, gate/up) layout: each parameter is that array bit for bit,
  so no device-side cast, transpose or concatenation followed."""
  path = os.path.join(FIXTURES, "mistral")  # bf16 weights, loaded as float32
  sent = []
  real_put = jax.device_put

  def spy(x, *args, **kwargs):
    sent.append(x)
    return real_put(x, *args, **kwargs)
  monkeypatch.setattr(jax, "device_put", spy)
  model = models.load_hf(path, jnp.float32, impl="xla")
  monkeypatch.undo()
  params = [np.asarray(v) for v in _params(model)]
  assert len(sent) == len(params)
  assert all(isinstance(h, np.ndarray) and h.flags.c_contiguous and h.dtype == np.float32
             for h in sent)
  by_content = {(h.shape, h.tobytes()) for h in sent}
  assert all((p.shape, p.tobytes()) in by_content for p in params)


def test_load_hf_progress(capsys):
  path = os.path.join(FIXTURES, "gemma2")
  models.load_hf(path, impl="xla", progress=True)
  err = capsys.readouterr().err
  assert "loading" in err and "tensors" in err
  models.load_hf(path, impl="xla", progress=False)
  models.load_hf(path, impl="xla")  # default: a small checkpoint (and no terminal) is quiet
  assert capsys.readouterr().err == ""


def _fake_hub_cache(cache, repo_id, src, revision="main",
                    commit="0123456789abcdef0123456789abcdef01234567"):
  """huggingface_hub's cache layout: models--org--name/{blobs,refs/<rev>,snapshots/<commit>/},
  each snapshot file a symlink to its blob."""
  repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
  snap = os.path.join(repo, "snapshots", commit)
  os.makedirs(snap)
  os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
  os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
  for i, name in enumerate(sorted(os.listdir(src))):
    blob = os.path.join(repo, "blobs", f"{commit[:8]}{i:032x}")
    shutil.copy(os.path.join(src, name), blob)
    os.symlink(os.path.relpath(blob, snap), os.path.join(snap, name))
  with open(os.path.join(repo, "refs", revision), "w") as f:
    f.write(commit)
  return snap


def test_load_hf_resolves_hub_ids_from_the_local_cache(tmp_path, monkeypatch):
  cache = str(tmp_path / "hub")
  src = os.path.join(FIXTURES, "llama")
  snap = _fake_hub_cache(cache, "tiny-org/tiny-llama", src)
  monkeypatch.setenv("HF_HUB_CACHE", cache)
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # and no network either way
  assert models.resolve_checkpoint("tiny-org/tiny-llama") == snap
  model = models.load_hf("tiny-org/tiny-llama", impl="xla")
  local = models.load_hf(src, impl="xla")
  assert model.config.name == "tiny-org/tiny-llama"  # the id, not the snapshot's hash
  assert model.config.replace(name="x") == local.config.replace(name="x")
  for a, b in zip(_params(model), _params(local)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert models.load_tokenizer("tiny-org/tiny-llama").get_vocab_size() == 128
  assert models.load_config("tiny-org/tiny-llama", revision=os.path.basename(snap)).num_layers == 2
  # Not cached (or not at that revision): a ValueError naming the id and the cache searched.
  with pytest.raises(ValueError, match=f"'tiny-org/nope'.*not in the local HF cache {cache}"):
    models.load_hf("tiny-org/nope")
  with pytest.raises(ValueError, match="'tiny-org/tiny-llama' at revision 'v2'"):
    models.load_hf("tiny-org/tiny-llama", revision="v2")
  # HF_HOME/hub when HF_HUB_CACHE is unset.
  monkeypatch.delenv("HF_HUB_CACHE")
  monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
  assert models.hub_cache_dir() == str(tmp_path / "home" / "hub")
  with pytest.raises(ValueError, match="tiny-org/tiny-llama"):
    models.load_config("tiny-org/tiny-llama")
  home_snap = _fake_hub_cache(str(tmp_path / "home" / "hub"), "tiny-org/tiny-llama", src)
  assert models.resolve_checkpoint("tiny-org/tiny-llama") == home_snap
  # A local folder of the same name wins over the cache.
  local_dir = _copy_fixture("mistral", tmp_path / "cwd" / "tiny-org" / "tiny-llama")
  monkeypatch.chdir(tmp_path / "cwd")
  assert models.load_config("tiny-org/tiny-llama").family == "mistral"
  with pytest.raises(ValueError, match="revision='main' is for hub ids"):
    models.load_config(local_dir, revision="main")


def test_safetensors_roundtrip(tmp_path):
  tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3),
             "b": np.array([1.5, -2.0], dtype=jnp.bfloat16),
             "c": np.array([[1, 2]], dtype=np.int32)}
  models.save_safetensors(str(tmp_path / "t.safetensors"), tensors, metadata={"format": "pt"})
  back = models.read_safetensors(str(tmp_path / "t.safetensors"))
  assert sorted(back) == ["a", "b", "c"]
  for k, v in tensors.items():
    assert back[k].dtype == v.dtype and back[k].shape == v.shape
    np.testing.assert_array_equal(back[k], v)


def test_load_tokenizer():
  tok = models.load_tokenizer(os.path.join(FIXTURES, "llama"))
  assert tok.encode("w1 w2 w127").ids == [1, 2, 127]
  assert models.load_tokenizer(os.path.join(FIXTURES, "mistral")) is None


def test_hf_weight_map_names_every_parameter():
  for name in ("tiny-llama", "tiny-qwen2", "tiny-gemma2", "tiny-gemma3"):
    cfg = ModelConfig.preset(name)
    abstract = nnx.eval_shape(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)))
    params = {tuple(p) for p, _ in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}
    mapped = {s.path for s in models.hf_weight_map(cfg)}
    assert mapped == params, name


# ----------------------------------------------------------------------------------------------
# Model, caches, compilation
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_gemma3():
  return models.Transformer(ModelConfig.preset("tiny-gemma3"), rngs=nnx.Rngs(0), impl="xla")


def test_tiny_model_jit_and_decode_without_recompiling(tiny_gemma3):
  model = tiny_gemma3
  cfg = model.config
  graphdef, state = nnx.split(model)
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
  both = lambda s, t: (nnx.merge(graphdef, s)(t), nnx.merge(graphdef, s)(t, last_only=True))
  full, last = jax.jit(both)(state, tokens)
  assert full.shape == (2, 16, cfg.vocab_size) and full.dtype == jnp.float32
  np.testing.assert_allclose(last[:, 0], full[:, -1], atol=1e-5)

  traces = []

  @jax.jit
  def step(state, tokens, positions, caches):
    traces.append(tokens.shape)
    return nnx.merge(graphdef, state)(tokens, positions, caches)

  caches = models.init_caches(cfg, 2, 16)
  assert [type(c).__name__ for c in caches] == ["RingCache", "ResidentCache", "RingCache"]
  pos = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))
  out = []
  logits, caches = step(state, tokens[:, :8], pos[:, :8], caches)
  out.append(logits)
  for i in range(8, 16):
    # No positions: they continue from the caches' fill level.
    logits, caches = step(state, tokens[:, i:i + 1], None, caches)
    out.append(logits)
  assert traces == [(2, 8), (2, 1)]  # one trace for the prefill, one for all 8 decode steps
  assert step._cache_size() == 2
  np.testing.assert_allclose(jnp.concatenate(out, axis=1), full, atol=1e-4)
  assert int(caches[1].length) == 16 and int(caches[0].length) == 16


def test_model_input_errors(tiny_gemma3):
  with pytest.raises(ValueError, match="tokens must be an int array"):
    tiny_gemma3(jnp.zeros((2, 3), jnp.float32))
  with pytest.raises(ValueError, match="positions must be an int array"):
    tiny_gemma3(jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 4), jnp.int32))
  with pytest.raises(ValueError, match="one cache per layer"):
    tiny_gemma3(jnp.zeros((1, 3), jnp.int32), caches=())
  with pytest.raises(ValueError, match="impl must be one of"):
    tiny_gemma3(jnp.zeros((1, 3), jnp.int32), impl="cuda")


def test_ring_cache_keeps_the_last_cells():
  ring = models.RingCache.empty(1, 4, 1, 2, jnp.float32)
  kv = lambda p: jnp.broadcast_to(jnp.asarray(p, jnp.float32)[None, :, None, None], (1, len(p), 1, 2))

  def write(ring, p):
    return ring.write(kv(p), kv(p), jnp.asarray([p], jnp.int32))

  ring = write(ring, [0, 1, 2])
  ring = write(ring, [3, 4, 5])  # wraps: slots 3, 0, 1
  assert ring.pos[0].tolist() == [4, 5, 2, 3] and int(ring.length) == 6
  np.testing.assert_array_equal(ring.k[0, :, 0, 0], [4, 5, 2, 3])
  ring = write(ring, list(range(6, 13)))  # longer than the ring: the last 4 cells survive
  assert sorted(ring.pos[0].tolist()) == [9, 10, 11, 12] and int(ring.length) == 13
  np.testing.assert_array_equal(ring.k[0, :, 0, 0], ring.pos[0])


def test_resident_cache_overflow_and_shapes():
  cache = models.ResidentCache.empty(1, 4, 2, 8, jnp.float32)
  new = jnp.zeros((1, 3, 2, 8))
  cache = cache.write(new, new, jnp.arange(3, dtype=jnp.int32)[None])
  assert cache.pos[0].tolist() == [0, 1, 2, -1]
  with pytest.raises(ValueError, match="overflows capacity"):
    cache.write(new, new, jnp.arange(3, 6, dtype=jnp.int32)[None])
  with pytest.raises(ValueError, match="new k/v must have shape"):
    cache.write(jnp.zeros((1, 1, 3, 8)), jnp.zeros((1, 1, 3, 8)), jnp.zeros((1, 1), jnp.int32))
  with pytest.raises(ValueError, match="serves a sliding-window layer"):
    q = jnp.zeros((1, 1, 2, 8))
    models.attend(models.RingCache.empty(1, 4, 2, 8, jnp.float32), q, q, q,
                  jnp.zeros((1, 1), jnp.int32), window=None, softcap=None, scale=None,
                  impl="xla")
  with pytest.raises(TypeError, match="no attention registered"):
    models.attend(object(), None, None, None, None, window=None, softcap=None, scale=None,
                  impl="xla")


def test_init_caches_layouts():
  cfg = ModelConfig.preset("gemma2-2b")
  caches = models.init_caches(cfg.replace(num_layers=2, layer_windows=(4096, None)), 1, 8192)
  assert [type(c).__name__ for c in caches] == ["RingCache", "ResidentCache"]
  assert [c.capacity for c in caches] == [4096, 8192]
  assert caches[0].k.dtype == jnp.bfloat16
  flat = models.init_caches(cfg.replace(num_layers=2, layer_windows=(4096, None)), 1, 2048)
  assert [type(c).__name__ for c in flat] == ["ResidentCache"] * 2  # window >= context: no ring


@pytest.mark.parametrize("name", ["llama3-8b", "qwen2.5-1.5b", "gemma3-4b"])
def test_model_parameters_match_the_release(name):
  """The NNX model built from a preset (abstractly: nothing allocated) has the released count."""
  cfg = ModelConfig.preset(name)
  abstract = nnx.eval_shape(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)))
  leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
  assert sum(int(np.prod(x.shape)) for x in leaves) == cfg.param_count()
  assert {x.dtype for x in leaves} == {np.dtype(jnp.bfloat16)}
