"""The input embedding table in host RAM: :class:`HostEmbed`, :func:`embedding_to_host`.

Why: when the KV cache does not fit on the device, every byte of device memory is window, and
every GiB of window is a GiB less tail to move per token (1 GiB over PCIe and the host's cores
together, ~119 GB/s on the H200, is ~9 ms a token; docs/DESIGN.md §6). An untied input embedding is such a GiB (Llama-3-8B: 128256 x 4096 bf16 =
1.0 GiB) that a decode step reads one row of per token. llama.cpp keeps it on the host for the same
reason. Kept here, each lookup gathers its ``[B,T]`` rows from a NumPy table and puts them on the
device: ``B * T * hidden`` bytes (8 KiB a token), against the whole table on the device.

A tied table is also the output projection, read whole every step: it stays on the device
(:func:`embedding_to_host` refuses it). Under a ``jit`` the lookup is a ``jax.pure_callback``
(the step's tokens are device values: the callback reads them back when the program reaches it,
which is the one host round trip a step adds); called eagerly it gathers directly.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

log = logging.getLogger("rkv.models")

GIB = 1 << 30


class _Table:
  """Holds the NumPy table as static module data (part of the graph definition, not a state
  leaf: a leaf would be passed into every jitted program, i.e. copied to the device each call).
  Compared and hashed by identity: the programs cached per graph definition must not hash a
  GiB of data."""

  def __init__(self, array: np.ndarray):
    self.array = array

  def __hash__(self):
    return id(self)

  def __eq__(self, other):
    return self is other

  def __repr__(self):
    return f"_Table({self.array.dtype}{list(self.array.shape)})"


def gather_rows(table: np.ndarray, tokens) -> np.ndarray:
  """``table[tokens]`` with ``jnp.take``'s rules (what ``nnx.Embed`` applies): an id in
  ``[-V, 0)`` counts from the end, one outside ``[-V, V)`` gives a row of NaN."""
  t = np.asarray(tokens)
  v = table.shape[0]
  ok = (t >= -v) & (t < v)
  rows = table[np.where(ok, t, 0)]
  if not ok.all():
    rows[~ok] = np.nan
  return rows


class HostEmbed(nnx.Module):
  """``tokens [B,T]`` -> ``[B,T,features]`` from a table in host RAM (module docstring).

  Takes the place of ``nnx.Embed`` as ``Transformer.embed`` (:func:`embedding_to_host`); it has
  no ``attend`` (a tied table stays on the device). Inference only: the lookup has no gradient,
  and ``rkv.parallel.shard_model`` refuses a model that holds one."""

  def __init__(self, table: np.ndarray):
    table = np.asarray(table)
    if table.ndim != 2:
      raise ValueError(f"HostEmbed: the table must be [vocab, features], got {table.shape}")
    self.num_embeddings, self.features = table.shape
    self.dtype = table.dtype
    self.table = _Table(table)

  @property
  def nbytes(self) -> int:
    return int(self.table.array.nbytes)

  def __call__(self, tokens):
    if isinstance(tokens, jax.core.Tracer):
      out = jax.ShapeDtypeStruct(tuple(tokens.shape) + (self.features,), self.dtype)
      return jax.pure_callback(functools.partial(gather_rows, self.table.array), out, tokens)
    return jnp.asarray(gather_rows(self.table.array, tokens))


def embedding_to_host(model):
  """Moves ``model``'s input embedding table to host RAM (:class:`HostEmbed`), in place; returns
  ``model``. Call it before :func:`rkv.plan` reads the free device memory and before building the
  step functions (``jit_forward``, ``layered_forward``, ``rkv.generate.warm_up``), which snapshot
  the parameters: the device copy is freed once nothing holds it. A model that is already so is
  returned as is. Raises ValueError for a tied embedding (it is the output projection too).

  Meant for plans whose KV overflows the device (each step then already waits on the host); a
  resident plan runs one jitted program per step, to which the lookup adds a host round trip."""
  from rkv.models.transformer import Transformer
  if not isinstance(model, Transformer):
    raise ValueError(f"embedding_to_host: model must be a rkv.models.Transformer, got "
                     f"{type(model).__name__}")
  if isinstance(model.embed, HostEmbed):
    return model
  if model.config.tie_embeddings or model.lm_head is None:
    raise ValueError(f"embedding_to_host: {model.config.name or 'this model'} ties its input "
                     f"embedding to the output projection, which every step reads whole: it "
                     f"stays on the device")
  table = np.asarray(jax.device_get(model.embed.embedding[...]))
  model.embed = HostEmbed(table)
  log.info("embedding_to_host: %.2f GiB embedding table now in host RAM", table.nbytes / GIB)
  return model
