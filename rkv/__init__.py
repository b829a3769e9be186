"""rkv — Rolling KV: exact long-context decoding with a device window and a pinned-host tail.

Dimension glossary (shape letters used in every docstring and comment):
  B batch · T query length · S key/value length · H query heads · K kv heads · G = H/K group ·
  D head dim · W window cells · P tail cells · L layers · R rows of a KV pool (``kv_rows``).
Layouts follow ``jax.nn.dot_product_attention``: q ``[B,T,H,D]``, k/v ``[B,S,K,D]``, o ``[B,T,H,D]``.
LSE is natural-log float32 ``[B,T,H]``; a row that sees no key has ``o = 0`` and ``lse = -inf``.

Device memory: importing rkv sets ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.98`` (JAX's GPU default is
0.75) unless it (or ``XLA_CLIENT_MEM_FRACTION``) is already set or jax's backend already exists;
``rkv.offload.memory.device_memory()`` says which happened. Opt out by setting the variable
yourself before importing rkv, e.g. ``XLA_PYTHON_CLIENT_MEM_FRACTION=.75``. It also adds
``--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN`` to ``XLA_FLAGS``
(XLA's CUDA graphs around a decode step's kernels, custom calls included: the host then launches
one graph where it launched ~700 kernels; rkv/_env.py has the figures) unless ``XLA_FLAGS``
already sets that flag (``--xla_gpu_enable_command_buffer=`` turns them off). JAX's INFO lines
for the platforms it probes and
does not find ("Unable to initialize backend 'tpu'") are dropped (``RKV_SHOW_BACKEND_PROBE=1``
keeps them).
"""

# Before anything imports jax: XLA's GPU client reads the fraction once, when it starts.
from rkv import _env

_env.set_default_mem_fraction()
_env.add_default_xla_flags()  # XLA's command buffers for custom calls too (rkv/_env.py)
_env.quiet_backend_probe()  # no "Unable to initialize backend 'tpu'" line in INFO logs

from rkv.attention import attention, attention_reference, attention_xla, merge, merge_partials
from rkv import cache, offload
from rkv.cache import KVBlock, RollingKV
from rkv.rolling import rolling_attention
from rkv.head_split import HeadSplitKV
from rkv import planner, residency
from rkv import models  # after cache/rolling: the models' caches build on them
from rkv import gates, generate
from rkv import pool, serving  # issue 14: many sequences in one KV pool per layer
from rkv.planner import AttentionShape, Plan, Profile, ResidencyConfig, plan
from rkv.text import ChatSession, TextGeneration, generate_text

__all__ = ["AttentionShape", "ChatSession", "HeadSplitKV", "KVBlock", "Plan", "Profile", "ResidencyConfig", "RollingKV", "TextGeneration",
           "attention", "attention_reference", "attention_xla", "cache", "gates", "generate", "generate_text", "merge", "merge_partials",
           "models", "offload", "plan", "pool", "residency", "rolling_attention", "serving"]
__version__ = "0.1.0"
