"""Builds the tiny HF parity fixtures in ``tests/fixtures/hf/<arch>/`` with ``transformers`` (torch, CPU).

Each fixture is a random tiny model of one architecture saved as a local HF folder (config.json +
safetensors) and ``reference.npz`` (``tokens [B,T]`` int32, ``logits [B,T,V]`` float32: HF's full
forward pass, eager attention, float32). The fixtures whose RoPE depends on the sequence length
(``dynamic``, ``longrope``) also hold ``decode_logits``: HF run with a ``DynamicCache`` over the
prefill chunks ``decode_chunks`` then one token at a time, which differs from the full forward
there (each call rotates its own tokens with its own ``max(position) + 1``). ``tests/hf_parity_test.py`` loads them with
``rkv.models.load_hf`` and needs no torch. The fixtures are committed; rerun this script only to
change them.

Torch lives in its own venv (rkv needs Python >= 3.12; the local torch wheel is for 3.11)::

    /root/.pyenv/versions/3.11.7/bin/python -m venv /tmp/torchvenv
    /tmp/torchvenv/bin/pip install /opt/wheels/torch-2.13.0+cpu-*.whl transformers==5.24.0 \
        safetensors numpy tokenizers  # the version in tests/fixtures/hf/VERSIONS.json
    /tmp/torchvenv/bin/python scripts/make_hf_fixtures.py            # every fixture
    /tmp/torchvenv/bin/python scripts/make_hf_fixtures.py qwen3 yarn  # some of them

Choices that make the parity test bite:
- weights are redrawn at unit scale (HF's std-0.02 init gives near-constant logits that would
  match anything) and, except for llama, rounded to bfloat16 and saved in bfloat16: the reference
  runs in float32 on exactly the stored values, so the bf16 read path is exercised at 1e-4;
- sliding windows (8, 6) are smaller than the 32-token sequence, Gemma-2's softcaps are small
  enough to saturate, Gemma-3 has linear RoPE scaling on its global layer and a
  ``query_pre_attn_scalar`` unequal to head_dim, Llama uses the llama3 RoPE scaling, Mistral has
  head_dim * heads != hidden, Qwen2 is sharded (model.safetensors.index.json) with tied embeddings
  and a sliding window on its second layer only.
- Qwen3 has per-head q/k norms and head_dim * heads != hidden, and a sliding window on its second
  layer. The long-context RoPE fixtures set a tiny original length (16) under a 48-token sequence:
  ``yarn`` (a Qwen3 model; ramp and attention factor), ``dynamic`` (Llama, dynamic NTK beyond
  ``max_position_embeddings`` = 16), ``longrope`` (Llama; random short/long factors, the attention
  factor derived from max_position_embeddings / original).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import torch
import transformers

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures",
                   "hf")
BATCH, SEQ, LONG_SEQ, VOCAB = 2, 32, 48, 128
DECODE_CHUNKS = (13, 7)  # then one token at a time (tests/hf_parity_test.py's PREFILL)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, attn_implementation="eager")


def configs():
  t = transformers
  gen = torch.Generator().manual_seed(12)
  half = 16 // 2  # the llama fixtures' head_dim / 2
  short = (1.0 + 0.5 * torch.rand(half, generator=gen)).tolist()
  long = (1.0 + 7.0 * torch.rand(half, generator=gen)).sort().values.tolist()
  return {
      "llama": (t.LlamaForCausalLM, t.LlamaConfig(
          **COMMON, tie_word_embeddings=False,
          rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                               low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=16)), "float32", None),
      "qwen2": (t.Qwen2ForCausalLM, t.Qwen2Config(
          **COMMON, tie_word_embeddings=True, use_sliding_window=True, sliding_window=8,
          max_window_layers=1, rope_parameters=dict(rope_type="default", rope_theta=1e6)),
          "bfloat16", "60KB"),
      "mistral": (t.MistralForCausalLM, t.MistralConfig(
          **{**COMMON, "num_key_value_heads": 1}, head_dim=24, sliding_window=8,
          tie_word_embeddings=False), "bfloat16", None),
      "gemma2": (t.Gemma2ForCausalLM, t.Gemma2Config(
          **COMMON, head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
          attn_logit_softcapping=2.0, final_logit_softcapping=5.0), "bfloat16", None),
      "gemma3": (t.Gemma3ForCausalLM, t.Gemma3TextConfig(
          **{**COMMON, "num_hidden_layers": 3, "num_key_value_heads": 1}, head_dim=32,
          sliding_window=6, query_pre_attn_scalar=24,
          layer_types=["sliding_attention", "full_attention", "sliding_attention"],
          rope_parameters={
              "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
              "sliding_attention": dict(rope_type="default", rope_theta=1e4)}),
          "bfloat16", None),
      "qwen3": (t.Qwen3ForCausalLM, t.Qwen3Config(
          **COMMON, head_dim=32, tie_word_embeddings=False, use_sliding_window=True,
          sliding_window=8, max_window_layers=1,
          rope_parameters=dict(rope_type="default", rope_theta=1e6)), "bfloat16", None),
      "yarn": (t.Qwen3ForCausalLM, t.Qwen3Config(
          **{**COMMON, "max_position_embeddings": 64}, head_dim=32, tie_word_embeddings=True,
          rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0,
                               original_max_position_embeddings=16)), "bfloat16", None),
      "dynamic": (t.LlamaForCausalLM, t.LlamaConfig(
          **{**COMMON, "max_position_embeddings": 16}, tie_word_embeddings=False,
          rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=4.0)),
          "bfloat16", None),
      "longrope": (t.LlamaForCausalLM, t.LlamaConfig(
          **{**COMMON, "max_position_embeddings": 64}, tie_word_embeddings=False,
          rope_parameters=dict(rope_type="longrope", rope_theta=1e4, short_factor=short,
                               long_factor=long, original_max_position_embeddings=16)),
          "float32", None),
  }


LONG = ("yarn", "dynamic", "longrope")  # a sequence longer than the original length
LENGTH_DEPENDENT = ("dynamic", "longrope")  # HF's incremental decode is its own reference


def randomize(model, gemma: bool, bf16: bool, gen: torch.Generator):
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:  # RMSNorm: Gemma stores w in (1 + w), Llama stores w
        x = 0.2 * torch.randn(p.shape, generator=gen) + (0.0 if gemma else 1.0)
      elif name.endswith("bias"):
        x = 0.2 * torch.randn(p.shape, generator=gen)
      elif "embed_tokens" in name:
        x = 0.3 * torch.randn(p.shape, generator=gen)
      else:  # [out, in]
        x = torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5
        if "lm_head" in name:
          x = 2.0 * x
      if bf16:
        x = x.to(torch.bfloat16).to(torch.float32)
      p.copy_(x)


def tokenizer_json(path: str):
  """A tiny word-level tokenizer (w0..w127) for the load_tokenizer test."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.save(path)


def decode_logits(model, tokens):
  """HF's logits over ``DECODE_CHUNKS`` then one token at a time, with a DynamicCache."""
  cache, out, i = transformers.DynamicCache(config=model.config), [], 0
  chunks = DECODE_CHUNKS + (1,) * (tokens.shape[1] - sum(DECODE_CHUNKS))
  for n in chunks:
    step = model(input_ids=tokens[:, i:i + n], cache=cache, use_cache=True)
    cache = step.cache
    out.append(step.logits.float().numpy())
    i += n
  return np.concatenate(out, axis=1)


def build(arch, cls, config, save_dtype, shard):
  gen = torch.Generator().manual_seed(sum(map(ord, arch)))
  torch.manual_seed(0)
  model = cls(config).eval()
  randomize(model, arch.startswith("gemma"), save_dtype == "bfloat16", gen)
  tokens = torch.randint(0, VOCAB, (BATCH, LONG_SEQ if arch in LONG else SEQ), generator=gen)
  with torch.no_grad():
    logits = model(input_ids=tokens).logits.float().numpy()
  decode = {}
  if arch in LENGTH_DEPENDENT:
    # A fresh model: transformers' dynamic rotary keeps state between calls.
    fresh = cls(config).eval()
    fresh.load_state_dict(model.state_dict())
    decode = dict(decode_logits=decode_logits(fresh, tokens),
                 decode_chunks=np.asarray(DECODE_CHUNKS, np.int32))
    if np.abs(decode["decode_logits"] - logits).max() < 1e-2:
      sys.exit(f"{arch}: incremental decode equals the full forward: the fixture does not "
               f"exercise the length-dependent RoPE")

  d = os.path.join(OUT, arch)
  shutil.rmtree(d, ignore_errors=True)
  kw = {"max_shard_size": shard} if shard else {}
  model.to(getattr(torch, save_dtype)).save_pretrained(d, **kw)
  for extra in ("generation_config.json",):
    if os.path.exists(os.path.join(d, extra)):
      os.remove(os.path.join(d, extra))
  np.savez_compressed(os.path.join(d, "reference.npz"), tokens=tokens.numpy().astype(np.int32),
                      logits=logits, **decode)
  if arch == "llama":
    tokenizer_json(os.path.join(d, "tokenizer.json"))
  for f in os.listdir(d):
    os.chmod(os.path.join(d, f), 0o644)  # transformers writes weights 0600

  # The saved folder must reproduce the reference in HF itself.
  back = cls.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
  with torch.no_grad():
    again = back(input_ids=tokens).logits.float().numpy()
  if not np.array_equal(again, logits):
    sys.exit(f"{arch}: reloaded checkpoint differs from the reference by "
             f"{np.abs(again - logits).max()}")
  size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
  print(f"{arch:8s} {size / 1024:7.1f} KiB  files={sorted(os.listdir(d))}  "
        f"logit std={logits.std():.3f}")
  return size


def main():
  print(f"transformers {transformers.__version__}, torch {torch.__version__}")
  torch.set_grad_enabled(False)
  specs = configs()
  wanted = sys.argv[1:] or list(specs)
  unknown = sorted(set(wanted) - set(specs))
  if unknown:
    sys.exit(f"unknown fixtures {unknown}; known: {sorted(specs)}")
  total = sum(build(arch, *specs[arch]) for arch in wanted)
  print(f"total {total / 1024:.1f} KiB")
  with open(os.path.join(OUT, "VERSIONS.json"), "w") as f:
    json.dump({"transformers": transformers.__version__, "torch": torch.__version__}, f, indent=1)
    f.write("\n")


if __name__ == "__main__":
  main()
