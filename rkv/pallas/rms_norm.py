"""Residual add + RMSNorm of a few rows in one Pallas kernel (Triton lowering), for decode steps.

Why a kernel: in a resident decode step XLA runs each RMSNorm as two kernels (the reduction of
x*x, then the multiply that broadcasts its result back) and the residual add before it as a third,
~1.3-1.5 us each on the H200 for rows of 8 KB (session 10's traced 2K step; docs/DESIGN.md §7).
Here one program reads its row once, adds the residual, writes the sum, reduces in float32 and
writes the normalised row: one launch where there were three (two for a norm without the add).

The arithmetic is the model's RMSNorm (``rkv.models.transformer.RMSNorm``) step for step: the add
in the rows' dtype, the mean of squares in float32, ``x * rsqrt(ms + eps)``, then ``w * y`` in the
rows' dtype (Llama) or ``y * (1 + w)`` in float32 (Gemma, ``plus_one``). Only the order of the
float32 sum differs from XLA's, so results agree to float32 rounding, not bit for bit.

Opt-in (``$RKV_FUSED_NORM=1``): timed on the H200 in resident decode it was no faster than XLA's
fusions (2K / 32K: 222.98 / 191.31 and 222.43 / 191.52 tok/s against 224.06 / 188.80 and 225.78 /
192.27, alternating; ``benchmarks/results/beyond_hbm/session14/d/``), so the default stays XLA's.

Glossary: N rows (B*T flattened), Dm the model width (hidden size), Dp its power-of-two padding.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Rows up to this many go through the kernel (decode: B*T small); above, XLA's fusions (a prefill
# chunk's norms are a small part of a compute-bound step, and one program a row would be many).
MAX_ROWS = 256
FUSED_NORM_ENV = "RKV_FUSED_NORM"


# ---------------------------------------------------------------------------------------------------
# (1) Block sizes
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """One program a row; ``num_warps`` None: 4 up to Dp = 8192 (a [Dp] float32 row is then at most
  64 registers a thread), 8 above."""

  num_warps: int | None = None

  def resolve(self, d_pad: int) -> "BlockSizes":
    return BlockSizes(num_warps=self.num_warps or (4 if d_pad <= 8192 else 8))


# ---------------------------------------------------------------------------------------------------
# (2) Kernel
# ---------------------------------------------------------------------------------------------------


def _add_rms_norm_kernel(*refs, dim: int, eps: float, plus_one: bool, has_residual: bool):
  """One row. Refs: x [Dm], residual [Dm] (with ``has_residual``), w [Dm]; outputs: the sum
  x + residual [Dm] (with ``has_residual``) and the normalised row [Dm], in x's dtype."""
  it = iter(refs)
  x_ref = next(it)
  h_ref = next(it) if has_residual else None
  w_ref = next(it)
  sum_ref = next(it) if has_residual else None
  y_ref = next(it)
  d_pad = max(16, 1 << (dim - 1).bit_length())
  cols = lax.broadcasted_iota(jnp.int32, (d_pad,), 0)
  ok = cols < dim
  row = pl.ds(0, d_pad)
  x = plgpu.load(x_ref.at[row], mask=ok, other=0)
  if has_residual:
    x = x + plgpu.load(h_ref.at[row], mask=ok, other=0)  # in the rows' dtype, as the model adds
    plgpu.store(sum_ref.at[row], x, mask=ok)
  xf = x.astype(jnp.float32)
  # Padding columns load as 0, so they add nothing to the sum; the mean divides by Dm.
  inv = lax.rsqrt(jnp.sum(xf * xf) / dim + eps)
  y = xf * inv
  w = plgpu.load(w_ref.at[row], mask=ok, other=0)
  if plus_one:
    out = (y * (1.0 + w.astype(jnp.float32))).astype(y_ref.dtype)
  else:
    out = (w.astype(jnp.float32) * y.astype(y_ref.dtype).astype(jnp.float32)).astype(y_ref.dtype)
  plgpu.store(y_ref.at[row], out, mask=ok)


# ---------------------------------------------------------------------------------------------------
# (3) Jitted wrapper
# ---------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("eps", "plus_one", "num_warps", "interpret"))
def _add_rms_norm_jit(x, residual, weight, *, eps, plus_one, num_warps, interpret):
  n, dim = x.shape
  has_residual = residual is not None
  row_spec = pl.BlockSpec((None, dim), lambda i: (i, 0))
  operands = [x] + ([residual] if has_residual else []) + [weight]
  in_specs = [row_spec] * (2 if has_residual else 1) + [pl.BlockSpec((dim,), lambda i: (0,))]
  out_shape = [jax.ShapeDtypeStruct((n, dim), x.dtype)] * (2 if has_residual else 1)
  outs = pl.pallas_call(
      functools.partial(_add_rms_norm_kernel, dim=dim, eps=eps, plus_one=plus_one,
                        has_residual=has_residual),
      grid=(n,),
      in_specs=in_specs,
      out_specs=[row_spec] * len(out_shape),
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="rkv_add_rms_norm",
  )(*operands)
  return tuple(outs)


def _check(where, x, residual, weight, eps):
  if x.ndim < 1 or x.shape[-1] < 1:
    raise ValueError(f"{where}: x must have a last (model width) axis, got shape {x.shape}")
  if weight.shape != x.shape[-1:]:
    raise ValueError(f"{where}: weight must have shape {x.shape[-1:]}, got {weight.shape}")
  if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
    raise ValueError(f"{where}: residual must match x ({x.shape}, {x.dtype}), got "
                     f"{residual.shape}, {residual.dtype}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{where}: x must be a float array, got {x.dtype}")
  if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
    raise ValueError(f"{where}: eps must be a finite number > 0, got {eps!r}")


def _call(where, x, residual, weight, *, eps, plus_one, block_sizes, interpret):
  _check(where, x, residual, weight, eps)
  dim = x.shape[-1]
  rows = x.reshape(-1, dim)
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  d_pad = max(16, 1 << (dim - 1).bit_length())
  blocks = (block_sizes or BlockSizes()).resolve(d_pad)
  outs = _add_rms_norm_jit(rows, None if residual is None else residual.reshape(-1, dim),
                           weight, eps=float(eps), plus_one=bool(plus_one),
                           num_warps=blocks.num_warps, interpret=bool(interpret))
  return tuple(o.reshape(x.shape) for o in outs)


def add_rms_norm(x, residual, weight, *, eps: float, plus_one: bool = False,
                 block_sizes: BlockSizes | None = None, interpret: bool | None = None):
  """``s = x + residual`` (in x's dtype) and ``rms_norm(s)``, in one kernel: returns ``(s, y)``.

  x, residual [..., Dm] of one float dtype, weight [Dm]; ``plus_one``: Gemma's ``1 + w`` scale.
  ``interpret=None`` interprets on CPU."""
  return _call("add_rms_norm", x, residual, weight, eps=eps, plus_one=plus_one,
               block_sizes=block_sizes, interpret=interpret)


def rms_norm(x, weight, *, eps: float, plus_one: bool = False,
             block_sizes: BlockSizes | None = None, interpret: bool | None = None):
  """``x / rms(x)`` times ``weight`` (or ``1 + weight``) in one kernel; x [..., Dm], weight [Dm]."""
  (y,) = _call("rms_norm", x, None, weight, eps=eps, plus_one=plus_one, block_sizes=block_sizes,
               interpret=interpret)
  return y


# ---------------------------------------------------------------------------------------------------
# (4) Reference
# ---------------------------------------------------------------------------------------------------


def add_rms_norm_reference(x, residual, weight, *, eps: float, plus_one: bool = False):
  """Plain jnp, the model's own arithmetic (``residual=None``: the norm alone, ``s = x``). Where
  XLA fuses the add into the reduction it may keep the sum in float32 (excess precision, on by
  default), where the kernel, like XLA's separate add kernel on the H200, rounds it to x's dtype
  first: for bf16 rows the normalised values can then differ by one bf16 unit."""
  s = x if residual is None else x + residual
  sf = s.astype(jnp.float32)
  y = sf * lax.rsqrt(jnp.mean(sf * sf, axis=-1, keepdims=True) + eps)
  if plus_one:
    return s, (y * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
  return s, weight * y.astype(x.dtype)
