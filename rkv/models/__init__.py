"""Flax NNX decoder-only transformers (Llama-3, Qwen2, Mistral, Gemma-2, Gemma-3) and local HF
checkpoint loading. See :mod:`rkv.models.transformer` for how one block covers every family."""

from rkv.models import kv
from rkv.models.config import PRESETS, ModelConfig, RopeConfig
from rkv.models.hf import (hf_weight_map, load_config, load_hf, load_tokenizer, read_safetensors,
                           save_safetensors)
from rkv.models.kv import LayerCache, ResidentCache, RingCache, attend, init_caches
from rkv.models.transformer import Transformer, jit_forward, layered_forward

__all__ = ["PRESETS", "LayerCache", "ModelConfig", "ResidentCache", "RingCache", "RopeConfig",
           "Transformer", "attend", "hf_weight_map", "init_caches", "jit_forward", "kv",
           "layered_forward", "load_config", "load_hf", "load_tokenizer", "read_safetensors",
           "save_safetensors"]
