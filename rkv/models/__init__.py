"""Flax NNX decoder-only transformers (Llama-3, Qwen2, Qwen3, Mistral, Gemma-2, Gemma-3), HF
checkpoint loading (a folder or a hub id in the local HF cache), GGUF files (``load_gguf``: model
and tokenizer), an untied input embedding in host RAM (``embedding_to_host``). See
:mod:`rkv.models.transformer` for how one block covers every family."""

from rkv.models import kv
from rkv.models.config import PRESETS, ModelConfig, RopeConfig
from rkv.models.hf import (WeightSlot, checkpoint_dtype, hf_weight_map, hub_cache_dir, load_config,
                           load_hf, load_tokenizer, model_tensors, read_safetensors,
                           resolve_checkpoint, save_safetensors)
from rkv.models.tokenizer import ChatTokenizer
from rkv.models.gguf_loader import config_from_gguf, load_gguf, smollm2_path
from rkv.models.host_embed import HostEmbed, embedding_to_host
from rkv.models.kv import LayerCache, ResidentCache, RingCache, attend, init_caches
from rkv.models.transformer import Transformer, jit_forward, layered_forward

__all__ = ["ChatTokenizer", "HostEmbed", "LayerCache", "PRESETS", "ModelConfig", "ResidentCache",
           "RingCache", "RopeConfig", "Transformer", "attend", "checkpoint_dtype",
           "config_from_gguf", "embedding_to_host", "hf_weight_map", "hub_cache_dir",
           "init_caches", "jit_forward", "kv", "layered_forward", "load_config", "load_gguf",
           "load_hf", "load_tokenizer", "model_tensors", "read_safetensors", "resolve_checkpoint",
           "save_safetensors", "smollm2_path", "WeightSlot"]
