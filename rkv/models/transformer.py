"""The decoder-only transformer (Flax NNX) shared by the Llama and Gemma-2/3 families.

One block, switched by :class:`~rkv.models.config.ModelConfig` (no subclass per family)::

    x = embed(tokens) [* sqrt(hidden)]                              # Gemma: embed_scale
    for each layer i:                                               # window W_i, RoPE_i
      h = attn(norm(x))  -> [post_attn_norm(h)]  x = x + h          # Gemma: sandwich_norms
      h = mlp(norm(x))   -> [post_ffw_norm(h)]   x = x + h
    logits = final_norm(x) @ W_out [softcap]                        # tied: W_out = embedding^T

Attention: the fused q/k/v projection (+ bias: Qwen2), [per-head q/k RMSNorm: Qwen3, Gemma-3],
RoPE from the layer's positions (its own base and scaling: Gemma-3 local 10k / global 1M x linear
8; yarn, dynamic NTK and longrope as transformers computes them, see :func:`rope_tables`), then
:func:`rkv.attention` with ``q_pos``/``k_pos`` = positions, the layer's ``window``, the attention
softcap and the scale ``query_pre_attn_scalar ** -0.5`` (else ``head_dim ** -0.5``). With caches,
the layer calls its cache's ``attend`` (the protocol of :mod:`rkv.models.kv`, never a branch on
the cache's type), so each layer can hold a different kind (resident, ring, rolling window + host
tail, head split).

RMSNorm computes in float32; Llama casts back before the weight (``w * x.astype(dtype)``), Gemma
multiplies by ``1 + w`` in float32 first, as in transformers. Logits are returned in float32.
With ``$RKV_FUSED_NORM=1`` (opt-in, not yet timed) the norms of decode rows, and the residual add
before the MLP's norm, run as one Pallas kernel each (:mod:`rkv.pallas.rms_norm`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rkv.attention import IMPLS, attention
from rkv.pallas import rms_norm as rms_norm_kernel
from rkv import cache as cache_lib
from rkv import rolling as rolling_lib
from rkv import validation
from rkv.offload import host_share
from rkv.offload import stream as stream_lib
from rkv.models.config import ModelConfig, RopeConfig, dynamic_inv_freq

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
    if _fused_norm(x):
      return rms_norm_kernel.rms_norm(x, self.scale[...], eps=self.eps, plus_one=self.plus_one)
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    w = self.scale[...]
    if self.plus_one:
      return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
    return w * y.astype(x.dtype)

  def add_and_norm(self, x, h):
    """``(x + h, norm(x + h))``: the residual add and this norm, one kernel under
    ``$RKV_FUSED_NORM`` (XLA makes three of them)."""
    if _fused_norm(x):
      return rms_norm_kernel.add_rms_norm(x, h.astype(x.dtype), self.scale[...], eps=self.eps,
                                          plus_one=self.plus_one)
    x = x + h
    return x, self(x)


def _fused_norm(x) -> bool:
  """Whether this norm runs as the Pallas kernel: ``$RKV_FUSED_NORM`` on (read at trace time), and
  decode rows (at most ``rms_norm_kernel.MAX_ROWS``)."""
  rows = math.prod(x.shape[:-1])
  return (validation.env_switch(rms_norm_kernel.FUSED_NORM_ENV, False)
          and rows <= rms_norm_kernel.MAX_ROWS)


def rope_tables(rope: RopeConfig, head_dim: int, positions):
  """``cos, sin [B,T,D/2]`` float32 for integer ``positions [B,T]``, times the rope's
  ``attention_scaling`` (yarn, longrope), as transformers' rotary embedding returns them.

  A length-dependent rope (longrope, dynamic NTK) takes ``seq_len = max(positions) + 1`` over the
  whole call, as transformers does per forward (padding, -1, never raises it). It is traced, so
  a jitted step does not recompile as the sequence grows; what that means with a KV cache is in
  :class:`~rkv.models.config.RopeConfig`'s docstring."""
  base = rope.inv_freq(head_dim)
  if rope.length_dependent:
    seq_len = jnp.max(positions).astype(jnp.int32) + 1
    beyond = seq_len > rope.original_max_position
    if rope.kind == "longrope":
      longer = rope.inv_freq(head_dim, seq_len=rope.original_max_position + 1)
    else:  # dynamic NTK: the base grows with seq_len
      exponents = jnp.arange(0, head_dim, 2, dtype=jnp.int32).astype(jnp.float32) / head_dim
      longer = dynamic_inv_freq(jnp, rope, exponents, seq_len.astype(jnp.float32))
    inv = jnp.where(beyond, longer, base)
  else:
    inv = jnp.asarray(base)
  freqs = positions.astype(jnp.float32)[..., None] * inv
  cos, sin = jnp.cos(freqs), jnp.sin(freqs)
  if rope.attention_scaling != 1.0:
    cos, sin = cos * rope.attention_scaling, sin * rope.attention_scaling
  return cos, sin


def apply_rope(x, cos, sin):
  """Rotates ``x [B,T,N,D]`` by halves (the HF layout: pairs ``(i, i + D/2)``)."""
  xf = x.astype(jnp.float32)
  x1, x2 = jnp.split(xf, 2, axis=-1)
  c, s = cos[:, :, None, :], sin[:, :, None, :]
  return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
  """The projections around attention: :meth:`project` before it, :meth:`output` after (the
  attention itself, over a cache or not, is :meth:`Block.__call__`'s)."""

  def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
    self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.window = cfg.layer_windows[layer]
    self.rope = cfg.layer_rope(layer)
    self.softcap = cfg.attn_softcap
    self.scale = cfg.attn_scale
    h, d = cfg.hidden_size, cfg.head_dim
    # q, k and v are one projection (columns [q | k | v], see hf_weight_map): at decode (M=1)
    # XLA turned the separate k and v projections into reduce fusions at 0.78 TB/s (11 us each
    # for 8 MB on the H200, decode_trace_h200.json), and each projection was a launch of its own.
    self.qkv_proj = _linear(cfg, h, (cfg.num_heads + 2 * cfg.num_kv_heads) * d, cfg.qkv_bias, rngs)
    self.o_proj = _linear(cfg, cfg.num_heads * d, h, cfg.o_bias, rngs)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(d, eps=cfg.rms_norm_eps, plus_one=cfg.norm_plus_one, dtype=cfg.dtype)
      self.k_norm = RMSNorm(d, eps=cfg.rms_norm_eps, plus_one=cfg.norm_plus_one, dtype=cfg.dtype)
    else:
      self.q_norm = self.k_norm = None

  def project(self, x, rope_cs):
    """``x [B,T,hidden]`` -> ``q [B,T,H,D], k, v [B,T,K,D]`` (biases, q/k norms, RoPE applied)."""
    b, t, _ = x.shape
    nq, nk = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
    q, k, v = jnp.split(self.qkv_proj(x), (nq, nq + nk), axis=-1)
    q = q.reshape(b, t, self.num_heads, self.head_dim)
    k = k.reshape(b, t, self.num_kv_heads, self.head_dim)
    v = v.reshape(b, t, self.num_kv_heads, self.head_dim)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    return apply_rope(q, *rope_cs), apply_rope(k, *rope_cs), v

  def attention_kwargs(self, impl) -> dict:
    return dict(window=self.window, softcap=self.softcap, scale=self.scale, impl=impl)

  def output(self, o):
    """``o [B,T,H,D]`` -> ``[B,T,hidden]``."""
    b, t = o.shape[:2]
    return self.o_proj(o.reshape(b, t, self.num_heads * self.head_dim))



class MLP(nnx.Module):
  """Gated MLP: ``down(act(gate(x)) * up(x))``; SwiGLU (silu) or GeGLU (gelu tanh); gate and up
  are the two column halves of ``gate_up_proj``."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.activation = cfg.activation
    # gate and up are one projection (columns [gate | up]): one weight read and
    # one launch instead of two.
    self.gate_up_proj = _linear(cfg, cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias,
                                rngs)
    self.down_proj = _linear(cfg, cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, rngs)

  def __call__(self, x):
    g, u = jnp.split(self.gate_up_proj(x), 2, axis=-1)
    if self.activation == "silu":
      g = jax.nn.silu(g)
    else:
      g = jax.nn.gelu(g, approximate=self.activation == "gelu_tanh")
    return self.down_proj(g * u)


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

  # The block in two halves around the cache (what layered_forward jits separately):
  # pre_attention -> attend(cache) -> post_attention.
  def pre_attention(self, x, rope_cs):
    """``x`` -> the layer's ``q, k, v``."""
    return self.attn.project(self.attn_norm(x), rope_cs)

  def post_attention(self, x, o):
    """The residual stream after the layer, from its input ``x`` and attention output ``o``."""
    h = self.attn.output(o)
    if self.attn_post_norm is not None:
      h = self.attn_post_norm(h)
    x, normed = self.mlp_norm.add_and_norm(x, h)
    h = self.mlp(normed)
    if self.mlp_post_norm is not None:
      h = self.mlp_post_norm(h)
    return x + h

  def __call__(self, x, positions, rope_cs, cache, impl):
    q, k, v = self.pre_attention(x, rope_cs)
    kw = self.attn.attention_kwargs(impl)
    if cache is None:
      o, _ = attention(q, k, v, q_pos=positions, k_pos=positions, causal=True, **kw)
    else:
      o, cache = cache.attend(q, k, v, positions, **kw)
    return self.post_attention(x, o), cache


def _ropes(cfg: ModelConfig) -> tuple:
  """The layers' distinct RoPE configs, in first-use order."""
  return tuple(dict.fromkeys(cfg.layer_rope(i) for i in range(cfg.num_layers)))


def _all_rope_tables(cfg: ModelConfig, positions) -> tuple:
  return tuple(rope_tables(r, cfg.head_dim, positions) for r in _ropes(cfg))


def _embed_tokens(cfg: ModelConfig, embed, tokens):
  x = embed(tokens)
  if cfg.embed_scale:
    # Gemma rounds the normalizer to the activation dtype (sqrt(3072) -> 55.5 in bf16).
    x = x * jnp.asarray(math.sqrt(cfg.hidden_size), x.dtype)
  return x


def _logits(cfg: ModelConfig, embed, final_norm, lm_head, x, last_only: bool):
  x = final_norm(x)
  if last_only:
    x = x[:, -1:]
  if lm_head is None:  # tied: the embedding's transpose
    logits = jnp.einsum("bth,vh->btv", x, embed.embedding[...], precision=_precision(cfg.dtype),
                        preferred_element_type=jnp.float32)
  else:
    logits = jnp.einsum("bth,hv->btv", x, lm_head.kernel[...], precision=_precision(cfg.dtype),
                        preferred_element_type=jnp.float32)
  logits = logits.astype(jnp.float32)
  if cfg.final_softcap is not None:
    logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
  return logits


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

  def check_inputs(self, tokens, positions, caches, where: str = "Transformer"):
    """``(tokens [B,T] int, positions [B,T] int32, caches tuple | None)`` as device arrays, or a
    ValueError naming what is wrong. ``positions`` None: ``0..T-1``, or with caches the first
    cache's next position onwards."""
    cfg = self.config
    # Host values only (validation.host_values): no device read-back in the decode loop.
    validation.check_token_ids(where, "tokens", tokens, cfg.vocab_size)
    validation.check_positions_int32(where, "positions", positions)
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"{where}: tokens must be an int array [B,T], got {tokens.dtype} "
                       f"{tuple(tokens.shape)}")
    b, t = tokens.shape
    if caches is not None:
      caches = tuple(caches)
      if len(caches) != cfg.num_layers:
        raise ValueError(f"{where}: caches must hold one cache per layer "
                         f"({cfg.num_layers}), got {len(caches)}")
    if positions is None:
      start = 0 if caches is None else caches[0].next_position()
      positions = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
    positions = jnp.asarray(positions)
    if tuple(positions.shape) != (b, t) or not jnp.issubdtype(positions.dtype, jnp.integer):
      raise ValueError(f"{where}: positions must be an int array [B,T]={(b, t)}, got "
                       f"{positions.dtype} {tuple(positions.shape)}")
    return tokens, positions.astype(jnp.int32), caches

  def embed_tokens(self, tokens):
    """``tokens [B,T]`` -> the residual stream ``x [B,T,hidden]``."""
    return _embed_tokens(self.config, self.embed, tokens)

  def rope_tables(self, positions) -> tuple:
    """One ``(cos, sin)`` per distinct RoPE of the layers, in :meth:`rope_index` order."""
    return _all_rope_tables(self.config, positions)

  def rope_index(self) -> tuple[int, ...]:
    """Layer ``i`` uses ``rope_tables(...)[rope_index()[i]]``."""
    ropes = _ropes(self.config)
    return tuple(ropes.index(self.config.layer_rope(i)) for i in range(self.config.num_layers))


  def logits(self, x, last_only: bool = False):
    """The final norm and the output projection: ``x [B,T,hidden]`` -> float32 logits ``[B,T,V]``
    (``[B,1,V]`` with ``last_only``), softcapped where the model caps them."""
    return _logits(self.config, self.embed, self.final_norm, self.lm_head, x, last_only)

  def __call__(self, tokens, positions=None, caches=None, *, impl: str | None = None,
               last_only: bool = False):
    impl = self.impl if impl is None else impl
    validation.check_choice("Transformer", "impl", impl, IMPLS)
    tokens, positions, caches = self.check_inputs(tokens, positions, caches)
    x = self.embed_tokens(tokens)
    tables, index = self.rope_tables(positions), self.rope_index()
    new_caches = []
    for i, layer in enumerate(self.layers):
      x, c = layer(x, positions, tables[index[i]], None if caches is None else caches[i], impl)
      new_caches.append(c)
    logits = self.logits(x, last_only)
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
  ``fn.decode_step(tokens, positions, caches, pick, pick_args)`` is one decode step with the pick
  of the next tokens in the same program (what :meth:`rkv.generate.Stepper.decode` runs); with
  ``donate_caches`` it donates its tokens and positions as well as the caches (keep a copy of a
  token array you still need: ``jnp.copy``), so that every buffer the step writes is one it was
  given.
  """
  # The parameters travel as a flat list of arrays (C++ pytree flattening, as layered_forward's
  # programs take them) rather than as the nnx State (Python flatten rules on every call). On the
  # H200 the step's 5.7-8 ms of host time (decode_trace_h200*.json) turned out to be XLA launching
  # its ~780 kernels, not this flattening: the flat list did not move it measurably.
  graphdef, treedef, leaves = _split_flat(model)

  @functools.partial(jax.jit, donate_argnames=("caches",) if donate_caches else ())
  def jitted(leaves, tokens, positions, caches):
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))(
        tokens, positions, caches, impl=impl, last_only=last_only)

  def fn(tokens, positions=None, caches=None):
    return jitted(leaves, tokens, positions, caches)

  # A decode step as one program: the forward, the pick of the next tokens and the next positions,
  # so a decode loop feeds each step the previous one's device outputs and reads nothing back.
  # Why: on the H200 a resident step was waited for, then its token sliced, argmaxed and
  # converted eagerly and the next positions put up, and the GPU idled through all of it. Queued
  # one ahead through this program, resident 2K decode went from 171 to 208 tok/s, 512K from 46
  # to 50 (one run, docs/DESIGN.md §7).
  # The step donates its tokens and positions too: their successors then take the same buffers,
  # and with XLA's command buffers on (rkv/_env.py) a step whose buffers are all where the last
  # one's were replays its captured CUDA graph without re-recording it. Measured on the H200
  # (benchmarks/results/beyond_hbm/session10/d/): with command buffers but fresh token/position
  # buffers each step, a step read back before the next (generate with stop tokens) ran 156 /
  # 135 / 95 tok/s at 2K / 32K / 128K; donating them, 177 / 148 / 100 (without command buffers
  # 174 / 149 / 101).
  step_donated = ("caches", "tokens", "positions") if donate_caches else ()

  @functools.partial(jax.jit, donate_argnames=step_donated, static_argnames=("pick",))
  def decode(leaves, tokens, positions, caches, pick_args, *, pick):
    logits, caches = jitted(leaves, tokens, positions, caches)
    return pick(logits[:, -1], *pick_args)[:, None], positions + 1, caches

  def decode_step(tokens, positions, caches, pick, pick_args=()):
    """``(tokens [B,1], positions [B,1], caches)`` -> ``(next tokens [B,1] int32, positions + 1,
    caches)``; ``pick(logits [B,V], *pick_args) -> [B] int32`` is a static argument (a
    module-level function, so that the program is traced once)."""
    return decode(leaves, tokens, positions, caches, tuple(pick_args), pick=pick)

  fn.jitted = jitted
  fn.decode_step = decode_step
  fn.decode_program = decode  # its compile cache, as fn.jitted's
  return fn


# ----------------------------------------------------------------------------------------------
# Layered forward: eager across layers, jitted within them
# ----------------------------------------------------------------------------------------------
# The programs are built once per (graphdef, state treedef) and cached (the 64 latest
# structures: a notebook that builds many models does not keep every model's programs), so every
# layered_forward (every generate call) shares their compile cache, and layers of the same
# structure (all the global layers of a model) share one program per function. The graphdef and
# treedef are closed over, not static arguments: hashing a graphdef on every call cost ~0.2 ms.
# Parameters travel as a flat list of arrays (C++ pytree flattening, not nnx Variables').
@functools.lru_cache(maxsize=64)
def _edge_programs(cfg: ModelConfig, graphdef, treedef):
  """(enter, leave): embedding + the RoPE tables of every distinct RoPE; final norm + logits."""
  modules = lambda leaves: nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

  @jax.jit
  def enter(leaves, tokens, positions):
    embed, _, _ = modules(leaves)
    return _embed_tokens(cfg, embed, tokens), _all_rope_tables(cfg, positions)

  @functools.partial(jax.jit, static_argnums=2)
  def leave(leaves, x, last_only):
    embed, final_norm, lm_head = modules(leaves)
    return _logits(cfg, embed, final_norm, lm_head, x, last_only)

  return enter, leave


@functools.lru_cache(maxsize=64)
def _block_programs(graphdef, treedef):
  """(pre_attention, post_attention, whole block with its cache donated) of one block."""
  block = lambda leaves: nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
  pre = jax.jit(lambda leaves, x, rope_cs: block(leaves).pre_attention(x, rope_cs))
  post = jax.jit(lambda leaves, x, o: block(leaves).post_attention(x, o))
  whole = jax.jit(lambda leaves, x, positions, rope_cs, cache, impl:
                  block(leaves)(x, positions, rope_cs, cache, impl),
                  static_argnums=5, donate_argnums=4)
  return pre, post, whole


def _merged_post(block, x, parts, o_dtype):
  o, _ = rolling_lib.merge_parts(parts, out_dtype=o_dtype)
  return block.post_attention(x, o)


@functools.lru_cache(maxsize=64)
def _join_programs(prev_defs, defs):
  """(join, close) around a rolling layer whose attention partials are not merged yet
  (``RollingKV.attend(merge=False)``). ``join``: their merge, that layer's ``post_attention``
  and the next layer's (structure ``defs``) ``pre_attention`` in one program; ``close``: the
  merge and ``post_attention`` alone (the last rolling layer, or one before a resident layer).
  Why one program: on the H200 host each dispatch of a hybrid layer's chain (merge, post, pre)
  took 0.2-0.5 ms, in series with the CPU kernel (docs/DESIGN.md §7). Measured there: one
  dispatch of ~0.5 ms where the three took ~1 ms, but the same step time (1M, session 7), the
  layer being held by its tile copies; kept for the host time it saves."""
  prev = lambda leaves: nnx.merge(prev_defs[0], jax.tree.unflatten(prev_defs[1], leaves))
  block = lambda leaves: nnx.merge(defs[0], jax.tree.unflatten(defs[1], leaves))

  @functools.partial(jax.jit, static_argnames="o_dtype")
  def join(prev_leaves, leaves, x, parts, rope_cs, *, o_dtype):
    x = _merged_post(prev(prev_leaves), x, parts, o_dtype)
    return (x,) + tuple(block(leaves).pre_attention(x, rope_cs))

  close = jax.jit(lambda leaves, x, parts, *, o_dtype: _merged_post(prev(leaves), x, parts,
                                                                      o_dtype),
                  static_argnames="o_dtype")
  return join, close


# $RKV_JOIN_LAYERS=0: a rolling layer's merge and post_attention run as separate programs again
# (merged in attend, then post), and the next layer's pre_attention as a third (an A/B switch,
# read when layered_forward builds its step).
JOIN_ENV = "RKV_JOIN_LAYERS"
# $RKV_NEXT_PUTS=1: while a rolling layer's host thread waits for its CPU share (a hybrid decode
# step), it requests the next rolling layer's first streamed tiles (rkv.rolling.early_puts,
# handed to that layer as ``staged``) instead of that layer doing so itself, first thing. Why
# (the 2M int8 trace, benchmarks/results/beyond_hbm/session17/b/, medians of its layers in
# beyond_hbm/layer_chains.json): a 5.46 ms layer was the CPU share's chain (the worker began 0.84
# ms in, its query copy took 0.81, the kernel 2.40), the main thread waited for it 0.74 ms and the
# PCIe link idled 1.88: the puts' ~0.7 ms of Python ran first in each layer, holding the GIL the
# worker needed to start, and the query's copy queued behind them on PJRT's host threads. In the
# wait they cost the host little and the link gets the next layer's tiles at once. On the device
# meanwhile: this layer's tiles in flight and up to lookahead of the next layer's, which the
# planner's reserve counts when the switch is on (rkv.planner.budget.derive_reserve). Session 6's
# form (the puts right after the merge) was slower at 1M, where the link was busy
# (docs/DESIGN.md §7). Read at each step; off by default until measured on the H200.
NEXT_PUTS_ENV = stream_lib.NEXT_PUTS_ENV
# $RKV_HOST_SHARE (on a GPU backend by default, rkv.offload.host_share.default_on): a hybrid /
# cpu layer's CPU share, where
# rkv.rolling.external_share_applies, runs in a C++ thread of rkv.offload.host_share instead of
# the Python worker: started by the share's start program, dispatched right after the program
# that makes the layer's query (its join, or its pre_attention), and awaited by its wait program
# right before the next join (or close), which merges the partial as before. No Python thread, no
# GIL and no host round trip of the query in the layer's chain (docs/DESIGN.md §6), for two small
# dispatches a layer. Why programs of their own and not custom calls inside the join: a share's
# handle is a compile-time attribute, so joins holding them would compile once per layer (the
# join is one program for every layer of a structure now), tens of seconds at Llama-3-8B's size;
# the share's own programs are tiny. A step whose append fills a tile takes the Python path. The
# fused decode step (rkv.models.fused_decode) runs the same shares between its two programs.
# Read at each step. Exact on the CPU backend and the H200; no faster there in session 19,
# when its layers' tiles were put after its kernel had started and their copies waited for it;
# they are put before it since session 20. At the Python worker's split it ran ahead of the
# worker on H100s (1.03-1.05x, session 23) and on the H200 (2M int8 1.39x, 1M 1.04x, session
# 24), hence the default; plans keep the profile's fitted cost (docs/DESIGN.md §6).
HOST_SHARE_ENV = host_share.HOST_SHARE_ENV


class _HostShares:
  """layered_forward's rkv.offload.host_share.HostShare of each layer ($RKV_HOST_SHARE), made
  on first use and configured again whenever the layer's CPU tiles change (a flush)."""

  def __init__(self, heads):
    self._heads = heads  # per layer: (query heads, head dim)
    self._shares = {}  # layer -> (share, the configuration's key)
    self._retired = []  # shares left with a start never awaited (an error mid-step): kept alive

  def for_layer(self, i, cache, tokens_shape, attn_kw):
    b, t = tokens_shape[:2]
    q_shape = (b, t) + tuple(self._heads[i])
    tiles = rolling_lib.cpu_share_tiles(cache)
    tail_k = cache.tail.k[tiles[0]:tiles[1]]
    key = (q_shape, tiles, tuple(id(x) for x in tail_k), attn_kw.get("window"),
           attn_kw.get("softcap"), attn_kw.get("scale"))
    share, configured = self._shares.get(i, (None, None))
    if share is not None:
      counts = share.counters()
      if counts["starts"] != counts["waits"] or share.q_shape != q_shape:
        self._retired.append(share)  # a CUDA host function may still name it: never freed
        share = configured = None
    if share is None:
      share = host_share.HostShare(q_shape)
    if configured != key:
      share.configure(cache, tiles=tiles, window=attn_kw.get("window"),
                      softcap=attn_kw.get("softcap"), scale=attn_kw.get("scale"))
    self._shares[i] = (share, key)
    return share

  def __len__(self):
    return len(self._shares)


def _split_flat(node):
  graphdef, state = nnx.split(node)
  leaves, treedef = jax.tree.flatten(state)
  return graphdef, treedef, leaves


def _fused_default() -> bool:
  from rkv.models import fused_decode
  # Off by default: on the H200 it measured slower than the general path (fused_decode's
  # docstring, benchmarks/results/beyond_hbm/fused_ab/).
  return validation.env_switch(fused_decode.FUSED_ENV, False)


def layered_forward(model: Transformer, *, impl: str | None = None, last_only: bool = False,
                    schedule: str | None = None, prefetch_tiles: int | None = None,
                    fused: bool | None = None):
  """``fn(tokens, positions=None, caches)`` -> ``(logits, new_caches)``, the same computation
  as ``model(tokens, positions, caches)`` for caches that cannot run under one ``jit``: those
  with a *static* fill (``jittable`` False: a :class:`rkv.RollingKV` whatever its tactic, a
  ``HeadSplitKV``), whose attention is an eager schedule of transfers and device partials or
  the host CPU kernel.

  Each such layer runs as three steps: a jitted ``pre_attention`` (norm, q/k/v projections, q/k
  norms, RoPE), the cache's eager ``attend``, a jitted ``post_attention`` (output projection,
  residual, MLP). A :class:`rkv.RollingKV` layer's attention partials are left unmerged
  (``attend(merge=False)``) and its merge and ``post_attention`` run inside the next layer's
  ``pre_attention`` program (the join; alone, as a close, before a resident layer or the logits):
  one dispatch where there were three (``$RKV_JOIN_LAYERS=0``: separate programs; measured the same
  on the H200, docs/DESIGN.md §7; not with a prefetcher, whose flow control waits on each layer's
  merged output). A resident or ring layer runs as one jitted block with its cache donated (its fill
  is data). Embedding + RoPE tables and the final norm + logits are one program each. So a decode
  step dispatches a handful of programs per layer instead of a few dozen eager ops, and reads no
  device value back (but for the query of a ``cpu`` / ``hybrid`` layer, which the host kernel
  needs): the Python thread runs ahead of the device. Every program is specialized on shapes only (a
  decode step compiles once).

  ``schedule``: the rolling caches' streaming schedule (``rkv.rolling_attention``'s; None = its
  default). The parameters are a snapshot taken now, as in :func:`jit_forward`; the caches
  passed in are donated (resident/ring layers) or updated in place (rolling windows and staging
  tiles): use the returned ones.

  ``prefetch_tiles``: streamed tail tiles kept in flight ahead of the layer that attends them, by
  one :class:`rkv.offload.stream.Prefetcher` shared by every call of ``fn`` (so the next step's
  first tiles are requested at the end of this one); default
  ``rkv.offload.stream.DEFAULT_PREFETCH_TILES`` (``$RKV_PREFETCH_TILES``, else 0: off, each layer
  requests its own tiles; on the H200 the host, not the link, bounds the offloaded step, and the
  prefetcher measured slower: see that constant). They are device memory on top of the plan's
  (the planner's reserve counts them when ``ResidencyConfig.prefetch_tiles`` says so).

  ``fused``: run a decode step's rolling layers as two programs a layer plus the CPU kernel
  (:mod:`rkv.models.fused_decode`: the merge, ``post_attention``, the next ``pre_attention`` and
  the append in one program; the device partials in another) instead of the general path's
  eight dispatches; the same cells and tactic split, merged in another order. Default
  ``$RKV_FUSED_DECODE`` (0 unless set to 1: experimental, it measured slower on the H200). Prefill
  chunks always take the general path.
  """
  impl = model.impl if impl is None else impl
  validation.check_choice("layered_forward", "impl", impl, IMPLS)
  if schedule is not None:
    validation.check_choice("layered_forward", "schedule", schedule, stream_lib.SCHEDULES)
  cfg = model.config
  edge_def, edge_tree, edge_leaves = _split_flat((model.embed, model.final_norm, model.lm_head))
  enter, leave = _edge_programs(cfg, edge_def, edge_tree)
  blocks, block_defs = [], []
  for layer in model.layers:
    graphdef, treedef, leaves = _split_flat(layer)
    blocks.append((_block_programs(graphdef, treedef), leaves))
    block_defs.append((graphdef, treedef))
  if fused is not None and not isinstance(fused, bool):
    raise ValueError(f"layered_forward: fused must be a bool or None (None: $RKV_FUSED_DECODE), "
                     f"got {fused!r}")
  fused = _fused_default() if fused is None else fused
  if fused:
    from rkv.models import fused_decode
  attn_kw = [layer.attn.attention_kwargs(impl) for layer in model.layers]
  if schedule is not None:
    attn_kw = [dict(kw, schedule=schedule) for kw in attn_kw]
  index = model.rope_index()
  if prefetch_tiles is None:
    prefetch_tiles = stream_lib.DEFAULT_PREFETCH_TILES
  if not isinstance(prefetch_tiles, int) or isinstance(prefetch_tiles, bool) or prefetch_tiles < 0:
    raise ValueError(f"layered_forward: prefetch_tiles must be a non-negative int, got "
                     f"{prefetch_tiles!r}")
  prefetcher = stream_lib.Prefetcher(prefetch_tiles) if prefetch_tiles else None
  # Rolling layers' partials merged in the next program (see _join_programs); not with a
  # prefetcher, whose flow control waits on each layer's merged output. Layer i's join takes layer
  # i-1's partials; built here, once (hashing graphdefs as an lru_cache key cost ~0.2 ms a call).
  joins = closes = None
  if validation.env_switch(JOIN_ENV, True) and prefetcher is None:
    joins = [None] + [_join_programs(block_defs[i - 1], block_defs[i])[0]
                      for i in range(1, len(block_defs))]
    closes = [_join_programs(d, d)[1] for d in block_defs]
  planned = [None]  # the caches the prefetcher's current plan was made for
  host_shares = _HostShares([(layer.attn.num_heads, layer.attn.head_dim)
                             for layer in model.layers])

  def plan_prefetch(caches):
    if prefetcher is not None and planned[0] is not caches:
      with jax.profiler.TraceAnnotation("rkv.prefetch.begin"):
        prefetcher.begin([(i, t) for i, c in enumerate(caches)
                          if (t := c.streamed_tiles())])
      planned[0] = caches

  def fn(tokens, positions=None, caches=None):
    if caches is None:
      raise ValueError("layered_forward: caches are required (without caches, call the model "
                       "or jit_forward)")
    tokens, positions, caches = model.check_inputs(tokens, positions, caches,
                                                   where="layered_forward")
    with rolling_lib.host_kernel_switch_interval(caches):
      return run_step(tokens, positions, caches)

  def run_step(tokens, positions, caches):
    if not (planned[0] is not None and len(planned[0]) == len(caches)
            and all(a is b for a, b in zip(planned[0], caches))):
      plan_prefetch(caches)
    x, tables = enter(edge_leaves, tokens, positions)
    new_caches = []
    share_env = host_share.share_on()
    chain = (fused_decode.Chain(impl=impl, positions=positions, prefetcher=prefetcher,
                                host_shares=host_shares if share_env else None)
             if fused else None)
    pending = None  # (layer, its parts, o dtype): a rolling layer before its merge and post
    # Layer -> its first streamed tiles, put while the layer before it waited ($RKV_NEXT_PUTS).
    ahead = {} if chain is None and stream_lib.next_puts_on() else None
    use_shares = joins is not None and chain is None and share_env

    def first_tiles(j):
      """Layer j's first streamed tiles, put now (rolling.early_tile_puts), or None."""
      cache_j, kw_j = caches[j], attn_kw[j]
      return rolling_lib.early_tile_puts(
          cache_j, tokens.shape[1], tactic=cache_j.tactic, cpu_fraction=cache_j.cpu_fraction,
          schedule=kw_j.get("schedule", rolling_lib.DEFAULT_SCHEDULE),
          lookahead=kw_j.get("lookahead", rolling_lib.DEFAULT_LOOKAHEAD))

    def put_next(j):
      tiles = first_tiles(j)
      if tiles:
        ahead[j] = tiles

    def close(x):
      j, parts, o_dtype, share = pending
      parts = host_share.awaited(parts, share)
      with jax.profiler.TraceAnnotation("rkv.layer.close"):
        return closes[j](blocks[j][1], x, parts, o_dtype=o_dtype)

    for i, ((pre, post, whole), leaves) in enumerate(blocks):
      cache, rope_cs = caches[i], tables[index[i]]
      step = (fused_decode.plan_step(cache, tokens.shape[1], prefetching=prefetcher is not None)
              if chain is not None else None)
      if step is not None:
        if pending is not None:
          x, pending = close(x), None
        new_caches.append(chain.layer(i, block_defs[i], leaves, x, rope_cs, cache, step,
                                      attn_kw[i]))
        continue
      if chain is not None:
        x = chain.close(x)
      if cache.jittable:  # resident and ring caches: the whole layer is one program
        if pending is not None:
          x, pending = close(x), None
        x, cache = whole(leaves, x, positions, rope_cs, cache, impl)
      else:
        share = None
        if use_shares and rolling_lib.external_share_applies(
            cache, tokens.shape[1],
            schedule=attn_kw[i].get("schedule", rolling_lib.DEFAULT_SCHEDULE)):
          share = host_shares.for_layer(i, cache, tokens.shape, attn_kw[i])
        kw = attn_kw[i]
        if ahead is not None and i in ahead:
          kw = dict(kw, staged=ahead.pop(i))
        if pending is not None:
          parts = host_share.awaited(pending[1], pending[3])
        if share is not None and kw.get("staged") is None:
          # This layer's first streamed tiles, put before its query is made and so before its
          # share's kernel can start: while that kernel runs on all but one of the host's cores,
          # PJRT's threads, which enqueue the tiles' copies, may wait for it to end. On the H200
          # under the share, most tiles put after the kernel began waited 0.5-2.5 ms for their
          # first copy (0.13 ms before it), and the link idled 1.4-1.6 ms a layer (session 19's
          # traces; lab.trace_summary.copies_in_kernels, docs/DESIGN.md §6). On the GPU the
          # previous layer's kernel is done here: its wait's launch returns only then.
          with jax.profiler.TraceAnnotation("rkv.share.puts"):
            staged = first_tiles(i)
          if staged:
            kw = dict(kw, staged=staged)
        if pending is not None:
          with jax.profiler.TraceAnnotation("rkv.layer.join"):
            x, q, k, v = joins[i](blocks[i - 1][1], leaves, x, parts, rope_cs,
                                  o_dtype=pending[2])
          pending = None
        else:
          with jax.profiler.TraceAnnotation("rkv.layer.pre"):
            q, k, v = pre(leaves, x, rope_cs)
        if share is not None:
          with jax.profiler.TraceAnnotation("rkv.share.start"):
            token = share.start_program(q, positions)
        if joins is not None and isinstance(cache, cache_lib.RollingKV):
          hook = None
          if ahead is not None:
            if i + 1 < len(caches) and isinstance(caches[i + 1], cache_lib.RollingKV):
              hook = functools.partial(put_next, i + 1)
          with jax.profiler.TraceAnnotation("rkv.layer.attend"):
            if share is not None:
              (part,), cache = cache.attend(q, k, v, positions, merge=False, while_waiting=hook,
                                            cpu_share="external", **kw)
              parts = (part, token)
            else:
              parts, cache = cache.attend(q, k, v, positions, merge=False, while_waiting=hook,
                                          **kw)
          pending = (i, parts, np.dtype(q.dtype), share)
          new_caches.append(cache)
          continue
        tiles = cache.streamed_tiles() if prefetcher is not None else ()
        if tiles:
          with jax.profiler.TraceAnnotation("rkv.prefetch.take"):
            kw = dict(kw, staged=prefetcher.take(i, tiles))
        with jax.profiler.TraceAnnotation("rkv.layer.attend"):
          o, cache = cache.attend(q, k, v, positions, **kw)
        if tiles:
          # Its waits and requests, in traces: with 4 tiles the layers' host parts outside
          # attend/pre/post took ~0.8 ms a layer (benchmarks/results/beyond_hbm/session4/
          # trace_half128_p4.json), unannotated then.
          with jax.profiler.TraceAnnotation("rkv.prefetch.consumed"):
            prefetcher.consumed(o)
        with jax.profiler.TraceAnnotation("rkv.layer.post"):
          x = post(leaves, x, o)
      new_caches.append(cache)
    if pending is not None:
      x, pending = close(x), None
    if chain is not None:
      x = chain.close(x)
    new_caches = tuple(new_caches)
    plan_prefetch(new_caches)  # the next step's first tiles start moving now
    # last_only: the final norm is per position, so slicing first changes nothing but the
    # program's input shape, [B,1,hidden] whatever the chunk: one compile of the logits GEMM
    # (rkv.generate.warm_up compiles it before a plan's caches take the device).
    return leave(edge_leaves, x[:, -1:] if last_only else x, last_only), new_caches

  fn.prefetcher = prefetcher
  fn.host_shares = host_shares

  return fn
