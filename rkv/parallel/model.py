"""A model's parameters on a mesh (tensor parallel over ``heads``) and its sharded forward.

The dense layers are sharded the usual way and left to XLA's SPMD partitioner: ``qkv_proj`` and
``gate_up_proj`` column-sharded (each device computes its heads' q/k/v and its share of the
intermediate), ``o_proj`` and ``down_proj`` row-sharded (XLA inserts the all-reduce of their
partial sums); norms, the embedding and the output projection are replicated.

The fused projections need one relayout first: their columns are ``[q | k | v]`` and
``[gate | up]`` (``rkv.models.hf.hf_weight_map``), so a plain column split would give device 0
all of q and device 1 all of k and v. :func:`shard_model` permutes the columns device-major —
``[q_0 | k_0 | v_0 | q_1 | k_1 | v_1 ...]``, ``[gate_0 | up_0 | gate_1 | up_1 ...]`` — so that
each device's contiguous block is its own heads' q, k, v (its own slice of gate and up). The
logical q, k, v and gate, up arrays are those of the one-device model (same heads in the same
order, each column's dot product unsplit); only ``o_proj`` / ``down_proj`` sum in another order.
The relaid parameters no longer fit ``Attention.project`` / ``MLP.__call__`` (they split at
``H*D``), so this module computes those two from the modules' weights itself (:func:`_project`,
:func:`_mlp`) and reuses every other piece of the model (norms, RoPE, ``o_proj``, logits).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rkv import validation
from rkv.attention import IMPLS
from rkv.models.config import ModelConfig
# The edge helpers are transformer.py's own (embedding, RoPE tables, logits), shared, not copied.
from rkv.models.transformer import Transformer, _edge_programs, apply_rope
from rkv.parallel import mesh as mesh_lib
from rkv.parallel.mesh import HEADS, HEADS_BTHD, P


def qkv_permutation(num_heads: int, num_kv_heads: int, head_dim: int, n: int) -> np.ndarray:
  """Column order of the device-major ``qkv_proj``: ``new[:, j] = old[:, perm[j]]``."""
  hq, hk = num_heads // n * head_dim, num_kv_heads // n * head_dim
  nq, nk = num_heads * head_dim, num_kv_heads * head_dim
  return np.concatenate([np.concatenate([np.arange(j * hq, (j + 1) * hq),
                                         nq + np.arange(j * hk, (j + 1) * hk),
                                         nq + nk + np.arange(j * hk, (j + 1) * hk)])
                         for j in range(n)])


def gate_up_permutation(intermediate: int, n: int) -> np.ndarray:
  """Column order of the device-major ``gate_up_proj``."""
  m = intermediate // n
  return np.concatenate([np.concatenate([np.arange(j * m, (j + 1) * m),
                                         intermediate + np.arange(j * m, (j + 1) * m)])
                         for j in range(n)])


def check_shardable(cfg: ModelConfig, mesh, where: str = "shard_model") -> None:
  """Every split the ``heads`` axis makes must be whole: KV heads (each device keeps whole GQA
  groups), query heads, the intermediate size."""
  mesh_lib.check_divisible(where, "num_kv_heads", cfg.num_kv_heads, mesh)
  mesh_lib.check_divisible(where, "num_heads", cfg.num_heads, mesh)
  mesh_lib.check_divisible(where, "intermediate_size", cfg.intermediate_size, mesh)


def path_name(path) -> str:
  """``layers/0/attn/qkv_proj/kernel`` from a state leaf's key path (nnx's ``.value`` dropped)."""
  keys = []
  for k in path:
    key = getattr(k, "key", getattr(k, "idx", getattr(k, "name", None)))
    if key is not None and key != "value":
      keys.append(str(key))
  return "/".join(keys)


def param_spec(path: str, ndim: int) -> P:
  """The partition spec of one parameter, by its place in the model (``path_name``)."""
  col = "/qkv_proj/" in path or "/gate_up_proj/" in path
  row = "/o_proj/" in path or "/down_proj/" in path
  if col:
    return P(None, HEADS) if path.endswith("/kernel") else P(HEADS)
  if row and path.endswith("/kernel"):
    return P(HEADS, None)
  return P(*([None] * ndim))  # norms, embedding, lm_head, the row-sharded layers' biases


def _relaid(path: str, x, cfg: ModelConfig, n: int):
  if "/qkv_proj/" in path:
    perm = qkv_permutation(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, n)
  elif "/gate_up_proj/" in path:
    perm = gate_up_permutation(cfg.intermediate_size, n)
  else:
    return x
  return jnp.take(x, jnp.asarray(perm), axis=-1)  # kernel [in, out] and bias [out] alike


@dataclasses.dataclass(frozen=True)
class ShardedModel:
  """A model's relaid, sharded parameters on ``mesh`` (``shard_model``). Call it with
  :func:`forward`; ``module`` is the relaid nnx model, whose own ``__call__`` would split the
  fused projections wrongly: it is held for its other pieces only."""

  config: ModelConfig
  mesh: object
  impl: str
  module: Transformer

  @property
  def heads_parallel(self) -> int:
    return mesh_lib.axis_size(self.mesh, HEADS)

  # The flat splits are taken once (nnx.split per call costs Python time in a decode loop);
  # cached_property writes the instance dict, which a frozen dataclass allows.
  @functools.cached_property
  def _whole(self):
    return _split_flat(self.module)

  @functools.cached_property
  def _edges(self):
    m = self.module
    return _split_flat((m.embed, m.final_norm, m.lm_head))

  @functools.cached_property
  def _layers(self):
    return tuple(_split_flat(layer) for layer in self.module.layers)


def shard_model(model: Transformer, mesh, *, impl: str | None = None) -> ShardedModel:
  """``model``'s parameters relaid device-major and placed on ``mesh`` with ``NamedSharding``
  (module docstring); ``model`` itself is left as it is."""
  where = "shard_model"
  if not isinstance(model, Transformer):
    raise ValueError(f"{where}: model must be an rkv.models Transformer, got "
                     f"{type(model).__name__}")
  mesh_lib.check_mesh(mesh, where)
  from rkv.models.host_embed import HostEmbed
  if isinstance(model.embed, HostEmbed):
    # Its lookup is a host callback of one device's program; the sharded forward was not
    # built or tested for it, so it is refused rather than left to fail inside a program.
    raise ValueError(f"{where}: the model's input embedding is in host RAM "
                     f"(rkv.models.embedding_to_host): shard the model before moving it, or "
                     f"keep it on the device")
  cfg = model.config
  check_shardable(cfg, mesh, where)
  impl = model.impl if impl is None else impl
  validation.check_choice(where, "impl", impl, IMPLS)
  n = mesh_lib.axis_size(mesh, HEADS)
  graphdef, state = nnx.split(model)

  def place(path, x):
    name = path_name(path)
    return jax.device_put(_relaid(name, x, cfg, n),
                          mesh_lib.sharding(mesh, param_spec(name, x.ndim)))

  state = jax.tree_util.tree_map_with_path(place, state)
  names = [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
  for part in ("qkv_proj/kernel", "o_proj/kernel", "gate_up_proj/kernel", "down_proj/kernel"):
    if sum(name.endswith("/" + part) for name in names) != cfg.num_layers:
      # A renamed module would otherwise be replicated silently (correct, but not sharded).
      raise ValueError(f"{where}: expected one {part} per layer in the model's parameters, "
                       f"found {sum(name.endswith('/' + part) for name in names)}")
  return ShardedModel(cfg, mesh, impl, nnx.merge(graphdef, state))


# ----------------------------------------------------------------------------------------------
# The sharded block: the model's pieces around the two fused projections
# ----------------------------------------------------------------------------------------------
def _constrain(x, mesh, spec):
  return jax.lax.with_sharding_constraint(x, mesh_lib.sharding(mesh, spec))


def _project(attn, x, rope_cs, n: int, mesh):
  """``Attention.project`` over the device-major ``qkv_proj``: ``x`` (normed) -> ``q, k, v``
  with heads sharded over ``heads``."""
  b, t, _ = x.shape
  h, kh, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
  hq, hk = h // n * d, kh // n * d
  y = attn.qkv_proj(x).reshape(b, t, n, hq + 2 * hk)  # device j's block is [q_j | k_j | v_j]
  q, k, v = jnp.split(y, (hq, hq + hk), axis=-1)
  q, k, v = q.reshape(b, t, h, d), k.reshape(b, t, kh, d), v.reshape(b, t, kh, d)
  if attn.q_norm is not None:
    q, k = attn.q_norm(q), attn.k_norm(k)
  q, k = apply_rope(q, *rope_cs), apply_rope(k, *rope_cs)
  return tuple(_constrain(a, mesh, HEADS_BTHD) for a in (q, k, v))


def _mlp(mlp, x, n: int):
  """``MLP.__call__`` over the device-major ``gate_up_proj``."""
  b, t, _ = x.shape
  m = mlp.down_proj.kernel.shape[0]
  y = mlp.gate_up_proj(x).reshape(b, t, n, 2, m // n)  # device j's block is [gate_j | up_j]
  g, u = y[..., 0, :].reshape(b, t, m), y[..., 1, :].reshape(b, t, m)
  if mlp.activation == "silu":
    g = jax.nn.silu(g)
  else:
    g = jax.nn.gelu(g, approximate=mlp.activation == "gelu_tanh")
  return mlp.down_proj(g * u)


def _pre(block, x, rope_cs, n, mesh):
  return _project(block.attn, block.attn_norm(x), rope_cs, n, mesh)


def _post(block, x, o, n):
  """``Block.post_attention`` with the sharded MLP."""
  h = block.attn.output(o)
  if block.attn_post_norm is not None:
    h = block.attn_post_norm(h)
  x = x + h
  h = _mlp(block.mlp, block.mlp_norm(x), n)
  if block.mlp_post_norm is not None:
    h = block.mlp_post_norm(h)
  return x + h


def _split_flat(node):
  graphdef, state = nnx.split(node)
  leaves, treedef = jax.tree.flatten(state)
  return graphdef, treedef, leaves


@functools.lru_cache(maxsize=16)
def _whole_program(graphdef, treedef, n: int, mesh, impl: str, last_only: bool):
  """The whole model as one jitted program (every cache jittable), caches donated."""

  @functools.partial(jax.jit, donate_argnums=3)
  def run(leaves, tokens, positions, caches):
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    x = model.embed_tokens(tokens)
    tables, index = model.rope_tables(positions), model.rope_index()
    new = []
    for i, layer in enumerate(model.layers):
      q, k, v = _pre(layer, x, tables[index[i]], n, mesh)
      o, c = caches[i].attend(q, k, v, positions, **layer.attn.attention_kwargs(impl))
      x = _post(layer, x, o, n)
      new.append(c)
    return model.logits(x, last_only), tuple(new)

  return run


@functools.lru_cache(maxsize=64)
def _layer_programs(graphdef, treedef, n: int, mesh):
  """(pre, post) of one block: jitted halves around an eager cache (layered_forward's shape)."""
  block = lambda leaves: nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
  pre = jax.jit(lambda leaves, x, rope_cs: _pre(block(leaves), x, rope_cs, n, mesh))
  post = jax.jit(lambda leaves, x, o: _post(block(leaves), x, o, n))
  return pre, post


def forward(sharded: ShardedModel, tokens, positions=None, caches=None, *,
            last_only: bool = False):
  """``(logits [B,T,V] float32, new_caches)``: the model over ``caches`` (one sharded cache per
  layer, :mod:`rkv.parallel.caches`), the same computation as the one-device
  ``model(tokens, positions, caches)``. Every cache jittable: one jitted program, caches donated;
  otherwise per layer a jitted half before attention, the cache's eager per-device attention, a
  jitted half after it (``rkv.models.layered_forward``'s shape)."""
  if not isinstance(sharded, ShardedModel):
    raise ValueError(f"rkv.parallel.forward: sharded must be a ShardedModel (shard_model), got "
                     f"{type(sharded).__name__}")
  if caches is None:
    raise ValueError("rkv.parallel.forward: caches are required (rkv.parallel.init_caches)")
  model, mesh, n = sharded.module, sharded.mesh, sharded.heads_parallel
  for i, c in enumerate(caches):
    if getattr(c, "mesh", None) != mesh:
      raise ValueError(f"rkv.parallel.forward: caches[{i}] ({type(c).__name__}) is not a "
                       f"sharded cache on the model's mesh")
  tokens, positions, caches = model.check_inputs(tokens, positions, caches,
                                                 where="rkv.parallel.forward")
  rep = mesh_lib.sharding(mesh, mesh_lib.REPLICATED)
  tokens, positions = jax.device_put((tokens, positions), rep)
  if all(c.jittable for c in caches):
    graphdef, treedef, leaves = sharded._whole
    run = _whole_program(graphdef, treedef, n, mesh, sharded.impl, bool(last_only))
    return run(leaves, tokens, positions, caches)
  edge_def, edge_tree, edge_leaves = sharded._edges
  enter, leave = _edge_programs(sharded.config, edge_def, edge_tree)
  x, tables = enter(edge_leaves, tokens, positions)
  index = model.rope_index()
  new = []
  for i, layer in enumerate(model.layers):
    graphdef, treedef, leaves = sharded._layers[i]
    pre, post = _layer_programs(graphdef, treedef, n, mesh)
    q, k, v = pre(leaves, x, tables[index[i]])
    o, c = caches[i].attend(q, k, v, positions, **layer.attn.attention_kwargs(sharded.impl))
    x = post(leaves, x, o)
    new.append(c)
  return leave(edge_leaves, x, bool(last_only)), tuple(new)
