"""Hugging Face checkpoints: ``load_hf(path_or_id)``, ``load_config``, ``load_tokenizer``.

A checkpoint folder holds ``config.json`` and the weights as ``model.safetensors``, or shards
listed by ``model.safetensors.index.json``. The folder is a local path, or a hub id
(``"org/name"``) already in the local HF cache, resolved by ``huggingface_hub.snapshot_download``
with ``local_files_only=True`` (``HF_HUB_CACHE`` / ``HF_HOME`` read at call time): nothing is ever
downloaded. safetensors files are read by the small reader below (an 8-byte header length, a JSON
header, raw little-endian tensors): the tensors are ``numpy.memmap`` views, bfloat16 via
``ml_dtypes`` (a JAX dependency), so a checkpoint is never held twice in host memory.

Loading keeps the checkpoint's own dtype unless told otherwise (a bf16 checkpoint is a bf16
model, and its KV cache is bf16), assembles each parameter on the host (numpy, from the memmap:
cast, transposed, the fused projections side by side) and copies it to the device once, already
in its final dtype and layout: no device-side cast or transpose copy, no float32 detour.

HF weight names -> model parameters (``P`` = ``model.``, or for Gemma-3 multimodal checkpoints
``language_model.model.`` / ``model.language_model.``; HF linear weights are ``[out, in]``, NNX
kernels ``[in, out]``, so projections are transposed):

| HF name                                         | parameter                                  |
| ----------------------------------------------- | ------------------------------------------ |
| ``P embed_tokens.weight``                       | ``embed.embedding``                        |
| ``P layers.i.self_attn.{q,k,v}_proj.weight``    | ``layers.i.attn.qkv_proj.kernel`` (T, columns q, k, v) |
| ``P layers.i.self_attn.{q,k,v}_proj.bias``      | ``layers.i.attn.qkv_proj.bias`` (same columns) |
| ``P layers.i.self_attn.o_proj.{weight,bias}``   | ``layers.i.attn.o_proj.{kernel (T),bias}`` |
| ``P layers.i.self_attn.{q,k}_norm.weight``      | ``layers.i.attn.{q,k}_norm.scale`` (Qwen3, Gemma-3) |
| ``P layers.i.mlp.{gate,up}_proj.weight``        | ``layers.i.mlp.gate_up_proj.kernel`` (T, columns gate, up) |
| ``P layers.i.mlp.down_proj.weight``             | ``layers.i.mlp.down_proj.kernel`` (T)      |
| ``P layers.i.input_layernorm.weight``           | ``layers.i.attn_norm.scale``               |
| ``P layers.i.post_attention_layernorm.weight``  | Llama: ``layers.i.mlp_norm.scale``; Gemma: ``layers.i.attn_post_norm.scale`` |
| ``P layers.i.pre_feedforward_layernorm.weight`` | ``layers.i.mlp_norm.scale`` (Gemma)        |
| ``P layers.i.post_feedforward_layernorm.weight``| ``layers.i.mlp_post_norm.scale`` (Gemma)   |
| ``P norm.weight``                               | ``final_norm.scale``                       |
| ``lm_head.weight``                              | ``lm_head.kernel`` (T; absent when tied)   |
"""

from __future__ import annotations

import json
import os
import sys
from typing import NamedTuple

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from rkv import atomic_io
from rkv.models.config import DTYPES, ModelConfig
from rkv.models.transformer import Transformer

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
_MAX_HEADER = 100 << 20
_TEXT_PREFIXES = ("model.", "model.language_model.", "language_model.model.", "")
_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")
# progress=None shows a bar only for checkpoints at least this large (and only on a terminal):
# smaller ones load in a second or two, and a bar in every test log or notebook cell is noise.
PROGRESS_MIN_BYTES = 1 << 30


# ----------------------------------------------------------------------------------------------
# safetensors
# ----------------------------------------------------------------------------------------------
def _parse_json(raw: bytes, where: str, what: str):
  """``raw`` as UTF-8 JSON, or a ValueError saying which part of which file is not."""
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"{where}: {what} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
                     f"{e.start})") from None
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"{where}: {what} is not valid JSON ({e})") from None


def _read_json_file(path: str, where: str, what: str):
  with open(path, "rb") as f:
    return _parse_json(f.read(), where, what)


def _tensor_entry(where: str, name: str, info, data_bytes: int) -> tuple[np.dtype, tuple, int, int]:
  """One header entry checked field by field: ``(dtype, shape, lo, hi)`` with the byte range
  ``[lo, hi)`` inside the data section and exactly the size dtype and shape declare."""
  if not isinstance(info, dict):
    raise ValueError(f"{where}: tensor {name!r}: header entry must be an object with dtype, shape "
                     f"and data_offsets, got {type(info).__name__}")
  missing = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
  if missing:
    raise ValueError(f"{where}: tensor {name!r}: header entry is missing {missing}")
  dt = _ST_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
  if dt is None:
    raise ValueError(f"{where}: tensor {name!r} has unsupported dtype {info['dtype']!r}")
  shape, offsets = info["shape"], info["data_offsets"]
  is_int = lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0
  if not isinstance(shape, list) or not all(is_int(x) for x in shape):
    raise ValueError(f"{where}: tensor {name!r}: shape must be a list of non-negative ints, got "
                     f"{shape!r}")
  if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_int(x) for x in offsets):
    raise ValueError(f"{where}: tensor {name!r}: data_offsets must be [begin, end] non-negative "
                     f"ints, got {offsets!r}")
  lo, hi = offsets
  want = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
  if not lo <= hi <= data_bytes or hi - lo != want:
    raise ValueError(f"{where}: tensor {name!r} offsets [{lo}, {hi}) do not hold "
                     f"{tuple(shape)} {info['dtype']} ({want} bytes) in a {data_bytes}-byte data "
                     f"section")
  return np.dtype(dt), tuple(shape), lo, hi


def _check_disjoint(where: str, ranges: dict[str, tuple[int, int]]) -> None:
  """Tensors may not share bytes: overlapping ranges mean a corrupt or hand-edited header."""
  prev_name, prev_hi = None, 0
  for name, (lo, hi) in sorted(ranges.items(), key=lambda kv: kv[1]):
    if lo == hi:
      continue  # an empty tensor holds no bytes
    if lo < prev_hi:
      raise ValueError(f"{where}: tensors {prev_name!r} and {name!r} overlap (bytes {lo} to "
                       f"{prev_hi} belong to both)")
    prev_name, prev_hi = name, hi


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """``{name: array}`` of one safetensors file, each a read-only memmap view (no copy).

  A malformed file (short, a header that is not UTF-8 JSON or not an object, an entry missing a
  field or of the wrong type, a byte range that disagrees with its dtype and shape or overlaps
  another tensor's) raises ``ValueError`` naming the file and what is wrong."""
  where = f"read_safetensors({path})"
  if not os.path.isfile(path):
    raise ValueError(f"{where}: no such file")
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) < 8:
      raise ValueError(f"{where}: file too short for a safetensors header")
    n = int.from_bytes(raw, "little")
    if n > min(size - 8, _MAX_HEADER):
      raise ValueError(f"{where}: header length {n} does not fit the {size}-byte file")
    header = _parse_json(f.read(n), where, "header")
  if not isinstance(header, dict):
    raise ValueError(f"{where}: header must be a JSON object of tensors, got "
                     f"{type(header).__name__}")
  header.pop("__metadata__", None)
  base = 8 + n
  data = np.memmap(path, dtype=np.uint8, mode="r", offset=base, shape=(size - base,)) \
      if size > base else np.zeros((0,), np.uint8)
  entries = {name: _tensor_entry(where, name, info, data.shape[0])
             for name, info in header.items()}
  _check_disjoint(where, {name: (lo, hi) for name, (_, _, lo, hi) in entries.items()})
  return {name: data[lo:hi].view(dt).reshape(shape)
          for name, (dt, shape, lo, hi) in entries.items()}


def save_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict | None = None):
  """Writes ``tensors`` as one safetensors file (the layout :func:`read_safetensors` reads)."""
  header, offset, arrays = {}, 0, []
  for name in sorted(tensors):
    a = np.ascontiguousarray(np.asarray(tensors[name]))
    if a.dtype not in _ST_NAMES:
      raise ValueError(f"save_safetensors: tensor {name!r} has unsupported dtype {a.dtype}")
    header[name] = dict(dtype=_ST_NAMES[a.dtype], shape=list(a.shape),
                        data_offsets=[offset, offset + a.nbytes])
    offset += a.nbytes
    arrays.append(a)
  if metadata:
    header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # data section 8-byte aligned, as safetensors writes it
  # Aside, then renamed into place: a failure keeps the checkpoint already at path (and arrays
  # that load_safetensors memory-mapped from it keep their bytes).
  with atomic_io.write_file_atomically(path, binary=True) as f:
    f.write(len(blob).to_bytes(8, "little"))
    f.write(blob)
    for a in arrays:
      f.write(a.tobytes())


def checkpoint_files(path: str) -> list[str]:
  """The safetensors files of a checkpoint folder (all shards of the index, if there is one)."""
  where = f"load_hf({path})"
  index = os.path.join(path, INDEX_FILE)
  if os.path.isfile(index):
    files = _index_shards(_read_json_file(index, where, INDEX_FILE), where)
    missing = [x for x in files if not os.path.isfile(os.path.join(path, x))]
    if missing:
      raise ValueError(f"{where}: shards listed in {INDEX_FILE} are missing: {missing}")
    return [os.path.join(path, x) for x in files]
  if os.path.isfile(os.path.join(path, SINGLE_FILE)):
    return [os.path.join(path, SINGLE_FILE)]
  found = sorted(x for x in os.listdir(path) if x.endswith(".safetensors"))
  if not found:
    other = [x for x in os.listdir(path) if x.endswith((".bin", ".pt", ".pth", ".gguf"))]
    hint = f" (found {other}: only safetensors weights are supported)" if other else ""
    raise ValueError(f"{where}: no weights: expected {SINGLE_FILE} or {INDEX_FILE} (or any "
                     f"*.safetensors){hint}")
  return [os.path.join(path, x) for x in found]


def _index_shards(index, where: str) -> list[str]:
  """The shard file names of a parsed ``model.safetensors.index.json``: a ``weight_map`` object
  of tensor name -> plain file name in the folder."""
  if not isinstance(index, dict):
    raise ValueError(f"{where}: {INDEX_FILE} must be a JSON object with a weight_map, got "
                     f"{type(index).__name__}")
  weight_map = index.get("weight_map")
  if not isinstance(weight_map, dict):
    raise ValueError(f"{where}: {INDEX_FILE} needs a weight_map object (tensor name -> shard "
                     f"file), got {type(weight_map).__name__}")
  if not weight_map:
    raise ValueError(f"{where}: {INDEX_FILE} has an empty weight_map")
  for name, file in weight_map.items():
    if not isinstance(file, str) or not file or os.path.basename(file) != file:
      raise ValueError(f"{where}: {INDEX_FILE} maps tensor {name!r} to {file!r}: expected the "
                       f"name of a shard file in the folder")
  return sorted(set(weight_map.values()))


# ----------------------------------------------------------------------------------------------
# Config and weights
# ----------------------------------------------------------------------------------------------
def hub_cache_dir() -> str:
  """The HF hub cache folder, from the environment as it is now: ``HF_HUB_CACHE``, else the
  legacy ``HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, else huggingface_hub's default
  (``~/.cache/huggingface/hub``). huggingface_hub reads these once, at its import; reading them
  per call lets a process (or a test) point at another cache later."""
  for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
    if os.environ.get(var):
      return os.path.expanduser(os.path.expandvars(os.environ[var]))
  if os.environ.get("HF_HOME"):
    return os.path.join(os.path.expanduser(os.path.expandvars(os.environ["HF_HOME"])), "hub")
  from huggingface_hub import constants
  return constants.HF_HUB_CACHE


def _is_repo_id(name: str) -> bool:
  """Whether ``name`` can be a hub id (``org/name`` or a bare legacy ``name``), not a path."""
  if not name or name.startswith(("/", ".", "~")) or name.count("/") > 1:
    return False
  try:
    from huggingface_hub.utils import validate_repo_id
  except ImportError:  # without huggingface_hub every name is a path
    return False
  try:
    validate_repo_id(name)
  except ValueError:  # HFValidationError
    return False
  return True


def resolve_checkpoint(path_or_id, *, revision: str | None = None, where: str = "load_hf") -> str:
  """The local folder of a checkpoint: ``path_or_id`` itself when it is a folder, else the
  snapshot of the hub id ``path_or_id`` (``"org/name"``) in the local HF cache
  (:func:`hub_cache_dir`) at ``revision`` (a branch, tag or commit; None: ``main``), found by
  ``huggingface_hub.snapshot_download(..., local_files_only=True)``: no network, ever. A name that
  is neither raises ``ValueError`` naming it and the cache searched."""
  path = os.fspath(path_or_id)
  if os.path.isdir(path):
    if revision is not None:
      raise ValueError(f"{where}: revision={revision!r} is for hub ids; {path!r} is a local folder")
    return path
  if not _is_repo_id(path):
    raise ValueError(f"{where}: checkpoint folder {path!r} does not exist (no downloads: pass a "
                     f"local folder holding {CONFIG_FILE} and *.safetensors, or the id of a "
                     f"model in the local Hugging Face cache, 'org/name')")
  try:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
  except ImportError:
    raise ValueError(f"{where}: {path!r} is not a local folder, and resolving it as a hub id "
                     f"needs the 'huggingface_hub' package (pip install huggingface_hub)") from None
  cache = hub_cache_dir()
  try:
    return snapshot_download(path, revision=revision, cache_dir=cache, local_files_only=True)
  except LocalEntryNotFoundError as e:  # not cached, or cached incompletely
    at = "" if revision is None else f" at revision {revision!r}"
    raise ValueError(f"{where}: {path!r} is not a local folder, and the Hugging Face hub id "
                     f"{path!r}{at} is not in the local HF cache {cache} ({e}). rkv never "
                     f"downloads: fetch it first (`hf download {path}`), or point HF_HUB_CACHE / "
                     f"HF_HOME at the cache that holds it") from None


def _dtype_name(value) -> str | None:
  """A config's ``dtype`` / ``torch_dtype`` ("bfloat16", "torch.bfloat16") if rkv runs it."""
  if not isinstance(value, str):
    return None
  name = value.removeprefix("torch.")
  return name if name in DTYPES else None


def weights_dtype(tensors) -> str | None:
  """The float dtype holding most bytes among ``tensors`` (name -> array), if rkv runs it."""
  by_dtype: dict[str, int] = {}
  for a in tensors.values():
    if np.issubdtype(a.dtype, np.floating) or a.dtype == ml_dtypes.bfloat16:
      by_dtype[np.dtype(a.dtype).name] = by_dtype.get(np.dtype(a.dtype).name, 0) + a.nbytes
  if not by_dtype:
    return None
  name = max(by_dtype, key=by_dtype.get)
  return name if name in DTYPES else None


def _config_dtype(config: dict) -> str | None:
  for d in (config, config.get("text_config") or {}):
    for key in ("dtype", "torch_dtype"):
      name = _dtype_name(d.get(key))
      if name:
        return name
  return None


def checkpoint_dtype(config: dict, tensors=None) -> str:
  """The dtype a checkpoint loads in by default: its ``config.json``'s ``dtype`` (transformers 5)
  or ``torch_dtype`` (4.x), also inside ``text_config``; else the float dtype of most of its
  weights (``tensors``: the safetensors views, whose headers say it); else float32."""
  return _config_dtype(config) or (weights_dtype(tensors) if tensors else None) or "float32"


def _read_config_json(path: str) -> dict:
  cfg_path = os.path.join(path, CONFIG_FILE)
  if not os.path.isfile(cfg_path):
    raise ValueError(f"load_hf({path}): missing {CONFIG_FILE}")
  d = _read_json_file(cfg_path, f"load_hf({path})", CONFIG_FILE)
  if not isinstance(d, dict):
    raise ValueError(f"load_hf({path}): {CONFIG_FILE} must be a JSON object, got "
                     f"{type(d).__name__}")
  return d


def _read_weights(path: str) -> dict[str, np.ndarray]:
  tensors: dict[str, np.ndarray] = {}
  for file in checkpoint_files(path):
    tensors.update(read_safetensors(file))
  return tensors


def load_config(path: str, *, dtype=None, revision: str | None = None) -> ModelConfig:
  """The :class:`ModelConfig` of a checkpoint's ``config.json`` (a folder, or a hub id in the
  local HF cache: :func:`resolve_checkpoint`). ``dtype=None``: the checkpoint's own
  (:func:`checkpoint_dtype`; the safetensors headers are read only when the config names none)."""
  folder = resolve_checkpoint(path, revision=revision, where="load_config")
  return _config_of(folder, _read_config_json(folder), dtype, None, _checkpoint_name(path, folder))


def _checkpoint_name(path_or_id, folder: str) -> str:
  """The model's name: the hub id as given when it came from the cache (not the snapshot's
  commit hash), else the folder's name."""
  given = os.fspath(path_or_id)
  return given if given != folder else os.path.basename(os.path.normpath(folder))


def _config_of(folder: str, d: dict, dtype, tensors, name: str) -> ModelConfig:
  if dtype is None:
    if tensors is None and _config_dtype(d) is None:
      try:
        tensors = _read_weights(folder)  # headers only: the data stays memory-mapped, unread
      except ValueError:
        tensors = None
    dtype = checkpoint_dtype(d, tensors)
  return ModelConfig.from_hf(d, dtype=dtype, name=name)


class WeightSlot(NamedTuple):
  """Where one checkpoint tensor goes: the tensor ``name``, the model parameter ``path`` it fills,
  ``transpose`` (an HF ``[out, in]`` linear weight into an NNX ``[in, out]`` kernel), and
  ``columns``: the ``[start, stop)`` range of the parameter's last axis it fills (the fused q/k/v
  and gate/up projections hold several checkpoint tensors side by side), None for all of it."""

  name: str
  path: tuple
  transpose: bool
  columns: tuple[int, int] | None = None


def hf_weight_map(config: ModelConfig, prefix: str = "model.") -> list[WeightSlot]:
  """A :class:`WeightSlot` for every checkpoint tensor of the model (the lm_head entry names
  ``lm_head.weight``); together they fill every parameter exactly once."""
  gemma = config.sandwich_norms
  out = [WeightSlot(f"{prefix}embed_tokens.weight", ("embed", "embedding"), False),
         WeightSlot(f"{prefix}norm.weight", ("final_norm", "scale"), False)]
  if not config.tie_embeddings:
    out.append(WeightSlot("lm_head.weight", ("lm_head", "kernel"), True))
  d = config.head_dim
  qkv = _column_ranges((("q", config.num_heads * d), ("k", config.num_kv_heads * d),
                        ("v", config.num_kv_heads * d)))
  gate_up = _column_ranges((("gate", config.intermediate_size), ("up", config.intermediate_size)))
  for i in range(config.num_layers):
    hf, me = f"{prefix}layers.{i}.", ("layers", i)
    for p, cols in qkv.items():
      out.append(WeightSlot(f"{hf}self_attn.{p}_proj.weight", me + ("attn", "qkv_proj", "kernel"),
                            True, cols))
      if config.qkv_bias:
        out.append(WeightSlot(f"{hf}self_attn.{p}_proj.bias", me + ("attn", "qkv_proj", "bias"),
                              False, cols))
    out.append(WeightSlot(f"{hf}self_attn.o_proj.weight", me + ("attn", "o_proj", "kernel"), True))
    if config.o_bias:
      out.append(WeightSlot(f"{hf}self_attn.o_proj.bias", me + ("attn", "o_proj", "bias"), False))
    if config.qk_norm:
      for p in ("q", "k"):
        out.append(WeightSlot(f"{hf}self_attn.{p}_norm.weight", me + ("attn", f"{p}_norm", "scale"),
                              False))
    for p, cols in gate_up.items():
      out.append(WeightSlot(f"{hf}mlp.{p}_proj.weight", me + ("mlp", "gate_up_proj", "kernel"),
                            True, cols))
      if config.mlp_bias:
        out.append(WeightSlot(f"{hf}mlp.{p}_proj.bias", me + ("mlp", "gate_up_proj", "bias"),
                              False, cols))
    out.append(WeightSlot(f"{hf}mlp.down_proj.weight", me + ("mlp", "down_proj", "kernel"), True))
    if config.mlp_bias:
      out.append(WeightSlot(f"{hf}mlp.down_proj.bias", me + ("mlp", "down_proj", "bias"), False))
    out.append(WeightSlot(f"{hf}input_layernorm.weight", me + ("attn_norm", "scale"), False))
    if gemma:
      out += [WeightSlot(f"{hf}post_attention_layernorm.weight", me + ("attn_post_norm", "scale"),
                         False),
              WeightSlot(f"{hf}pre_feedforward_layernorm.weight", me + ("mlp_norm", "scale"), False),
              WeightSlot(f"{hf}post_feedforward_layernorm.weight", me + ("mlp_post_norm", "scale"),
                         False)]
    else:
      out.append(WeightSlot(f"{hf}post_attention_layernorm.weight", me + ("mlp_norm", "scale"),
                            False))
  return out


def _column_ranges(widths) -> dict[str, tuple[int, int]]:
  """``{name: (start, stop)}`` of parts laid side by side in ``widths`` order."""
  out, start = {}, 0
  for name, width in widths:
    out[name] = (start, start + width)
    start += width
  return out


def _get(tree: dict, path: tuple):
  for p in path:
    tree = tree[p]
  return tree


def _check_layer_count(where: str, config: ModelConfig, prefix: str, tensors) -> None:
  """A config with fewer layers than the checkpoint would load a truncated model silently."""
  head = f"{prefix}layers."
  found = {int(n[len(head):].split(".", 1)[0]) for n in tensors
           if n.startswith(head) and n[len(head):].split(".", 1)[0].isdigit()}
  extra = sorted(i for i in found if i >= config.num_layers)
  if extra:
    raise ValueError(f"{where}: {CONFIG_FILE} has num_hidden_layers={config.num_layers} but the "
                     f"checkpoint holds layers up to {max(found)} ({len(extra)} layer(s) would be "
                     f"ignored): the config does not match the weights")


def load_hf(path: str, dtype=None, *, impl: str = "auto", progress: bool | None = None,
            revision: str | None = None) -> Transformer:
  """A :class:`~rkv.models.Transformer` with the weights of an HF checkpoint.

  ``path``: a local checkpoint folder, or a hub id (``"org/name"``) already in the local HF cache
  (``HF_HUB_CACHE`` / ``HF_HOME``), at ``revision`` (None: ``main``); nothing is downloaded
  (:func:`resolve_checkpoint`). Supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
  MistralForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM and the text part of
  Gemma3ForConditionalGeneration, with the rope types of :class:`rkv.models.RopeConfig`.

  ``dtype``: the parameters', activations' and KV cache's dtype. None (the default, as
  transformers' ``dtype="auto"``): the checkpoint's own, from ``config.json``'s ``dtype`` /
  ``torch_dtype``, else the float dtype of most of its weights in the safetensors headers, else
  float32 (:func:`checkpoint_dtype`); a bf16 checkpoint is a bf16 model. Pass ``jnp.float32`` for
  float32 logits parity. Each weight is cast and transposed on the host and copied to the device
  once.

  ``progress``: a tqdm bar (stderr) over the bytes copied to the device. None (the default): a
  bar only when stderr is a terminal and the checkpoint holds at least ``PROGRESS_MIN_BYTES``
  (1 GiB); True / False: always / never.

  A missing folder/file, a hub id not in the cache, an unsupported architecture or a missing or
  misshapen tensor raises ``ValueError`` naming it.
  """
  folder = resolve_checkpoint(path, revision=revision, where="load_hf")
  where = f"load_hf({folder})"
  d = _read_config_json(folder)
  tensors = _read_weights(folder)
  config = _config_of(folder, d, dtype, tensors, _checkpoint_name(path, folder))

  prefix = next((p for p in _TEXT_PREFIXES if f"{p}embed_tokens.weight" in tensors), None)
  if prefix is None:
    raise ValueError(f"{where}: missing tensor 'model.embed_tokens.weight' (no embedding table "
                     f"under any of the prefixes {_TEXT_PREFIXES[:-1]})")
  mapping = hf_weight_map(config, prefix)
  if not config.tie_embeddings:
    head = next((h for h in _HEAD_NAMES if h in tensors), _HEAD_NAMES[0])
    mapping = [s._replace(name=head) if s.name == "lm_head.weight" else s for s in mapping]
  _check_layer_count(where, config, prefix, tensors)
  missing = [s.name for s in mapping if s.name not in tensors]
  if missing:
    more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
    raise ValueError(f"{where}: missing tensors for {config.family} ({len(missing)}): "
                     f"{missing[:8]}{more}")
  return model_from_tensors(config, tensors, mapping, where=where, impl=impl, progress=progress)


def _progress_bar(mapping, tensors, progress: bool | None):
  """A tqdm bar over the bytes of ``mapping``'s tensors, or None (see :func:`load_hf`)."""
  total = sum(int(tensors[s.name].nbytes) for s in mapping if s.name in tensors)
  if progress is None:
    progress = total >= PROGRESS_MIN_BYTES and sys.stderr.isatty()
  if not progress:
    return None
  from tqdm import tqdm
  return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
              desc=f"loading {len(mapping)} tensors", leave=False)


def model_from_tensors(config: ModelConfig, tensors, mapping, *, where: str,
                       impl: str = "auto", progress: bool | None = False) -> Transformer:
  """A :class:`Transformer` of ``config`` whose parameters are filled from ``tensors[name]`` for
  each :class:`WeightSlot` of ``mapping`` (:func:`hf_weight_map`'s layout), cast to the
  parameters' dtype. Each parameter is assembled (transposed, fused) in host memory and copied to
  the device once. Shared by :func:`load_hf` and :func:`rkv.models.load_gguf`; a misshapen
  tensor, or a parameter the mapping leaves partly unfilled, raises ``ValueError`` prefixed with
  ``where``. ``progress``: as :func:`load_hf`'s."""
  abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), impl=impl))
  graphdef, state = nnx.split(abstract)
  values = nnx.to_pure_dict(state)
  host: dict[tuple, np.ndarray] = {}    # parameter path -> its host buffer
  filled: dict[tuple, int] = {}         # parameter path -> columns filled so far
  bar = _progress_bar(mapping, tensors, progress)
  for slot in mapping:
    want = _get(values, slot.path)
    cols = (0, want.shape[-1]) if slot.columns is None else slot.columns
    part = tuple(want.shape[:-1]) + (cols[1] - cols[0],)
    arr = tensors[slot.name]
    shape = arr.shape[::-1] if slot.transpose else arr.shape
    if tuple(shape) != part:
      raise ValueError(f"{where}: tensor {slot.name!r} has shape {tuple(arr.shape)}, expected "
                       f"{part[::-1] if slot.transpose else part}")
    buf = host.get(slot.path)
    if buf is None:
      buf = host[slot.path] = np.empty(want.shape, np.dtype(want.dtype))
    x = np.asarray(arr)
    buf[..., cols[0]:cols[1]] = x.T if slot.transpose else x   # transposed and cast on the host
    filled[slot.path] = filled.get(slot.path, 0) + part[-1]
    if bar is not None:
      bar.update(int(arr.nbytes))
  if bar is not None:
    bar.close()
  for ppath, buf in host.items():
    if filled[ppath] != buf.shape[-1]:
      raise ValueError(f"{where}: parameter {'.'.join(map(str, ppath))} got {filled[ppath]} of "
                       f"its {buf.shape[-1]} columns from the checkpoint")
    tree = values
    for p in ppath[:-1]:
      tree = tree[p]
    tree[ppath[-1]] = jax.device_put(buf)  # one explicit copy, already final
  unfilled = [".".join(map(str, p)) for p, _ in nnx.to_flat_state(state) if tuple(p) not in host]
  if unfilled:
    raise ValueError(f"{where}: the weight map leaves parameters unfilled: {unfilled[:8]}")
  nnx.replace_by_pure_dict(state, values)
  return nnx.merge(graphdef, state)


def model_tensors(model: Transformer, prefix: str = "model.") -> dict[str, np.ndarray]:
  """The inverse of :func:`model_from_tensors`: ``{hf_name: float32 array}`` of ``model`` in the
  checkpoint layout of :func:`hf_weight_map` (the fused projections split back, kernels
  transposed to ``[out, in]``), as :func:`save_safetensors` writes them."""
  values = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  out = {}
  for slot in hf_weight_map(model.config, prefix):
    x = np.asarray(_get(values, slot.path), np.float32)
    if slot.columns is not None:
      x = x[..., slot.columns[0]:slot.columns[1]]
    out[slot.name] = np.ascontiguousarray(x.T if slot.transpose else x)
  return out


def load_tokenizer(path: str, *, revision: str | None = None):
  """The ``tokenizers.Tokenizer`` of ``path/tokenizer.json`` (a folder, or a hub id in the local
  HF cache: :func:`resolve_checkpoint`), or None when there is none."""
  path = resolve_checkpoint(path, revision=revision, where="load_tokenizer")
  file = os.path.join(path, TOKENIZER_FILE)
  if not os.path.isfile(file):
    return None
  try:
    import tokenizers
  except ImportError:
    raise ValueError(f"load_tokenizer({path}): {TOKENIZER_FILE} needs the 'tokenizers' package "
                     f"(pip install tokenizers)") from None
  return tokenizers.Tokenizer.from_file(file)
