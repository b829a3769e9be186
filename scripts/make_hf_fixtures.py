"""Builds the tiny HF parity fixtures in ``tests/fixtures/hf/<arch>/`` with ``transformers`` (torch, CPU).

Each fixture is a random tiny model of one architecture saved as a local HF folder (config.json +
safetensors) and ``reference.npz`` (``tokens [B,T]`` int32, ``logits [B,T,V]`` float32: HF's full
forward pass, eager attention, float32). ``tests/hf_parity_test.py`` loads them with
``rkv.models.load_hf`` and needs no torch. The fixtures are committed; rerun this script only to
change them.

Torch lives in its own venv (rkv needs Python >= 3.12; the local torch wheel is for 3.11)::

    /root/.pyenv/versions/3.11.7/bin/python -m venv /tmp/torchvenv
    /tmp/torchvenv/bin/pip install torch==2.13.0 transformers safetensors numpy  # pin torch: CPU wheel
    /tmp/torchvenv/bin/python scripts/make_hf_fixtures.py

Choices that make the parity test bite:
- weights are redrawn at unit scale (HF's std-0.02 init gives near-constant logits that would
  match anything) and, except for llama, rounded to bfloat16 and saved in bfloat16: the reference
  runs in float32 on exactly the stored values, so the bf16 read path is exercised at 1e-4;
- sliding windows (8, 6) are smaller than the 32-token sequence, Gemma-2's softcaps are small
  enough to saturate, Gemma-3 has linear RoPE scaling on its global layer and a
  ``query_pre_attn_scalar`` unequal to head_dim, Llama uses the llama3 RoPE scaling, Mistral has
  head_dim * heads != hidden, Qwen2 is sharded (model.safetensors.index.json) with tied embeddings
  and a sliding window on its second layer only.
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
BATCH, SEQ, VOCAB = 2, 32, 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, attn_implementation="eager")


def configs():
  t = transformers
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
  }


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


def build(arch, cls, config, save_dtype, shard):
  gen = torch.Generator().manual_seed(sum(map(ord, arch)))
  torch.manual_seed(0)
  model = cls(config).eval()
  randomize(model, arch.startswith("gemma"), save_dtype == "bfloat16", gen)
  tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
  with torch.no_grad():
    logits = model(input_ids=tokens).logits.float().numpy()

  d = os.path.join(OUT, arch)
  shutil.rmtree(d, ignore_errors=True)
  kw = {"max_shard_size": shard} if shard else {}
  model.to(getattr(torch, save_dtype)).save_pretrained(d, **kw)
  for extra in ("generation_config.json",):
    if os.path.exists(os.path.join(d, extra)):
      os.remove(os.path.join(d, extra))
  np.savez_compressed(os.path.join(d, "reference.npz"), tokens=tokens.numpy().astype(np.int32),
                      logits=logits)
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
  total = sum(build(arch, *spec) for arch, spec in configs().items())
  print(f"total {total / 1024:.1f} KiB")
  with open(os.path.join(OUT, "VERSIONS.json"), "w") as f:
    json.dump({"transformers": transformers.__version__, "torch": torch.__version__}, f, indent=1)
    f.write("\n")


if __name__ == "__main__":
  main()
