"""The decoder-only transformer (Flax NNX) shared by the Llama and Gemma-2/3 families.

One block, switched by :class:`~rkv.models.config.ModelConfig` (no subclass per family)::

    x = embed(tokens) [* sqrt(hidden)]                              # Gemma: embed_scale
    for each layer i:                                               # window W_i, RoPE_i
      h = attn(norm(x))  -> [post_attn_norm(h)]  x = x + h          # Gemma: sandwich_norms
      h = mlp(norm(x))   -> [post_ffw_norm(h)]   x = x + h
    logits = final_norm(x) @ W_out [softcap]                        # tied: W_out = embedding^T

Attention: q/k/v projections (+ bias: Qwen2), [q/k RMSNorm: Gemma-3], RoPE from the layer's
positions (its own base and scaling: Gemma-3 local 10k / global 1M x linear 8), then
:func:`rkv.attention` with ``q_pos``/``k_pos`` = positions, the layer's ``window``, the attention
softcap and the scale ``query_pre_attn_scalar ** -0.5`` (else ``head_dim ** -0.5``). With caches,
the layer hands its cache to :func:`rkv.models.kv.attend`, which dispatches on the cache type, so
each layer can hold a different kind (resident, ring, rolling window + host tail).

RMSNorm computes in float32; Llama casts back before the weight (``w * x.astype(dtype)``), Gemma
multiplies by ``1 + w`` in float32 first, as in transformers. Logits are returned in float32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rkv.attention import IMPLS, attention
from rkv import validation
from rkv.models import kv as kv_lib
from rkv.models.config import ModelConfig, RopeConfig

_HIGHEST = jax.lax.Precision.HIGHEST


def _precision(dtype):
  # float32 models are the parity yardstick: no TF32 on a GPU.
  return _HIGHEST if np.dtype(dtype) == np.float32 else None


def _linear(cfg: ModelConfig, n_in: int, n_out: int, bias: bool, rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(n_in, n_out, use_bias=bias, dtype=cfg.dtype, param_dtype=cfg.dtype,
                    precision=_precision(cfg.dtype), rngs=rngs)


class RMSNorm(nnx.Module):
  """``x / rms(x)`` in float32 times ``w`` (Llama) or ``1 + w`` (Gemma, ``plus_one``)."""

  def __init__(self, dim: int, *, eps: float, plus_one: bool, dtype):
    self.eps = eps
    self.plus_one = plus_one
    self.scale = nnx.Param(jnp.zeros((dim,), dtype) if plus_one else jnp.ones((dim,), dtype))

  def __call__(self, x):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    w = self.scale[...]
    if self.plus_one:
      return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
    return w * y.astype(x.dtype)


def rope_tables(rope: RopeConfig, head_dim: int, positions):
  """``cos, sin [B,T,D/2]`` float32 for integer ``positions [B,T]``."""
  inv = jnp.asarray(rope.inv_freq(head_dim))
  freqs = positions.astype(jnp.float32)[..., None] * inv
  return jnp.cos(freqs), jnp.sin(freqs)


def apply_rope(x, cos, sin):
  """Rotates ``x [B,T,N,D]`` by halves (the HF layout: pairs ``(i, i + D/2)``)."""
  xf = x.astype(jnp.float32)
  x1, x2 = jnp.split(xf, 2, axis=-1)
  c, s = cos[:, :, None, :], sin[:, :, None, :]
  return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
    self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.window = cfg.layer_windows[layer]
    self.rope = cfg.layer_rope(layer)
    self.softcap = cfg.attn_softcap
    self.scale = cfg.attn_scale
    h, d = cfg.hidden_size, cfg.head_dim
    self.q_proj = _linear(cfg, h, cfg.num_heads * d, cfg.qkv_bias, rngs)
    self.k_proj = _linear(cfg, h, cfg.num_kv_heads * d, cfg.qkv_bias, rngs)
    self.v_proj = _linear(cfg, h, cfg.num_kv_heads * d, cfg.qkv_bias, rngs)
    self.o_proj = _linear(cfg, cfg.num_heads * d, h, cfg.o_bias, rngs)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(d, eps=cfg.rms_norm_eps, plus_one=cfg.norm_plus_one, dtype=cfg.dtype)
      self.k_norm = RMSNorm(d, eps=cfg.rms_norm_eps, plus_one=cfg.norm_plus_one, dtype=cfg.dtype)
    else:
      self.q_norm = self.k_norm = None

  def __call__(self, x, positions, rope_cs, cache, impl):
    b, t, _ = x.shape
    q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
    k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = apply_rope(q, *rope_cs), apply_rope(k, *rope_cs)
    kw = dict(window=self.window, softcap=self.softcap, scale=self.scale, impl=impl)
    if cache is None:
      o, _ = attention(q, k, v, q_pos=positions, k_pos=positions, causal=True, **kw)
    else:
      o, cache = kv_lib.attend(cache, q, k, v, positions, **kw)
    return self.o_proj(o.reshape(b, t, self.num_heads * self.head_dim)), cache


class MLP(nnx.Module):
  """Gated MLP: ``down(act(gate(x)) * up(x))``; SwiGLU (silu) or GeGLU (gelu tanh)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.activation = cfg.activation
    self.gate_proj = _linear(cfg, cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, rngs)
    self.up_proj = _linear(cfg, cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, rngs)
    self.down_proj = _linear(cfg, cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, rngs)

  def __call__(self, x):
    g = self.gate_proj(x)
    if self.activation == "silu":
      g = jax.nn.silu(g)
    else:
      g = jax.nn.gelu(g, approximate=self.activation == "gelu_tanh")
    return self.down_proj(g * self.up_proj(x))


class Block(nnx.Module):
  def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
    norm = functools.partial(RMSNorm, cfg.hidden_size, eps=cfg.rms_norm_eps,
                             plus_one=cfg.norm_plus_one, dtype=cfg.dtype)
    self.attn_norm = norm()
    self.attn = Attention(cfg, layer, rngs=rngs)
    self.mlp_norm = norm()
    self.mlp = MLP(cfg, rngs=rngs)
    self.attn_post_norm = norm() if cfg.sandwich_norms else None
    self.mlp_post_norm = norm() if cfg.sandwich_norms else None

  def __call__(self, x, positions, rope_cs, cache, impl):
    h, cache = self.attn(self.attn_norm(x), positions, rope_cs, cache, impl)
    if self.attn_post_norm is not None:
      h = self.attn_post_norm(h)
    x = x + h
    h = self.mlp(self.mlp_norm(x))
    if self.mlp_post_norm is not None:
      h = self.mlp_post_norm(h)
    return x + h, cache


class Transformer(nnx.Module):
  """``model(tokens [B,T]) -> logits [B,T,V]``;
  ``model(tokens, positions, caches) -> (logits, new_caches)``.

  ``positions [B,T]`` int32 (default: ``0..T-1`` without caches, the caches' next position
  onwards with them; -1 marks a padding token, whose query sees nothing and whose K/V is stored as
  empty). ``caches``: one per layer (see :mod:`rkv.models.kv`), returned updated; build them with
  :func:`rkv.models.init_caches`. ``impl`` picks the attention backend (``rkv.attention``).
  ``last_only`` returns only the last position's logits ``[B,1,V]`` (a prefill needs no more).
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, impl: str = "auto"):
    if not isinstance(config, ModelConfig):
      raise ValueError(f"Transformer: config must be a ModelConfig, got {type(config).__name__}")
    validation.check_choice("Transformer", "impl", impl, IMPLS)
    self.config = config
    self.impl = impl
    cfg = config
    self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype,
                           param_dtype=cfg.dtype, rngs=rngs)
    self.layers = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, plus_one=cfg.norm_plus_one,
                              dtype=cfg.dtype)
    self.lm_head = None if cfg.tie_embeddings else _linear(cfg, cfg.hidden_size, cfg.vocab_size,
                                                           False, rngs)

  def __call__(self, tokens, positions=None, caches=None, *, impl: str | None = None,
               last_only: bool = False):
    cfg = self.config
    impl = self.impl if impl is None else impl
    validation.check_choice("Transformer", "impl", impl, IMPLS)
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"Transformer: tokens must be an int array [B,T], got {tokens.dtype} "
                       f"{tuple(tokens.shape)}")
    b, t = tokens.shape
    if caches is not None:
      caches = tuple(caches)
      if len(caches) != cfg.num_layers:
        raise ValueError(f"Transformer: caches must hold one cache per layer "
                         f"({cfg.num_layers}), got {len(caches)}")
    if positions is None:
      start = 0 if caches is None else kv_lib.next_position(caches[0])
      positions = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
    positions = jnp.asarray(positions)
    if tuple(positions.shape) != (b, t) or not jnp.issubdtype(positions.dtype, jnp.integer):
      raise ValueError(f"Transformer: positions must be an int array [B,T]={(b, t)}, got "
                       f"{positions.dtype} {tuple(positions.shape)}")
    positions = positions.astype(jnp.int32)

    x = self.embed(tokens)
    if cfg.embed_scale:
      # Gemma rounds the normalizer to the activation dtype (sqrt(3072) -> 55.5 in bf16).
      x = x * jnp.asarray(math.sqrt(cfg.hidden_size), x.dtype)
    tables = {}
    new_caches = []
    for i, layer in enumerate(self.layers):
      rope = cfg.layer_rope(i)
      if rope not in tables:
        tables[rope] = rope_tables(rope, cfg.head_dim, positions)
      x, c = layer(x, positions, tables[rope], None if caches is None else caches[i], impl)
      new_caches.append(c)
    x = self.final_norm(x)
    if last_only:
      x = x[:, -1:]
    if self.lm_head is None:
      w = self.embed.embedding[...]
      logits = jnp.einsum("bth,vh->btv", x, w, precision=_precision(cfg.dtype),
                          preferred_element_type=jnp.float32)
    else:
      logits = jnp.einsum("bth,hv->btv", x, self.lm_head.kernel[...],
                          precision=_precision(cfg.dtype), preferred_element_type=jnp.float32)
    logits = logits.astype(jnp.float32)
    if cfg.final_softcap is not None:
      logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
    if caches is None:
      return logits
    return logits, tuple(new_caches)


def jit_forward(model: Transformer, *, impl: str | None = None, last_only: bool = False,
                donate_caches: bool = True):
  """A jitted pure form of ``model``: ``fn(tokens, positions=None, caches=None)``.

  The parameters (a snapshot taken now: later in-place updates of ``model`` are not seen) are
  passed as an argument, not baked into the program as constants, and the caches are donated so
  the update happens in place (the caches passed in must not be used again). The program is specialized on shapes only:
  a decode loop with fixed ``[B,1]`` tokens traces once (``fn.jitted._cache_size()``).
  """
  graphdef, state = nnx.split(model)

  @functools.partial(jax.jit, donate_argnames=("caches",) if donate_caches else ())
  def jitted(state, tokens, positions, caches):
    return nnx.merge(graphdef, state)(tokens, positions, caches, impl=impl, last_only=last_only)

  def fn(tokens, positions=None, caches=None):
    return jitted(state, tokens, positions, caches)

  fn.jitted = jitted
  return fn
