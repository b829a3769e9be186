"""Prefill flash attention for Hopper (sm_90) through Pallas Mosaic GPU: the fast path.

The generic kernel (``flash_attention.py``, Triton lowering) reached about 295 TFLOP/s on the
H200 for 8K causal prefill, H=32, D=128, where cuDNN did 510 and tokamax's Mosaic GPU kernel 550
in the same run. The gap is the Hopper machinery Triton does not use well from Pallas: TMA bulk
copies, asynchronous ``wgmma`` with one operand straight from registers, warp specialization and
register reallocation. This kernel uses all of them, in the FlashAttention-3 arrangement
(Shah et al. 2024, §3.1): a producer warpgroup streams K/V tiles into a ring of SMEM stages while
two consumer warpgroups, each owning ``block_q`` query rows, ping-pong on the tensor cores: one
runs its softmax while the other runs its two GEMMs.

It covers the common case only, and the caller falls back to the generic kernel otherwise
(:func:`supports` is the gate): default positions (``k_pos = arange(S)``,
``q_pos = S - T + arange(T)``, so causal is bottom-right aligned), no window, no softcap, no
int8, bf16/f16, ``D`` in {64, 128, 256}, ``T`` a multiple of ``2 * block_q`` and ``S`` of
``block_kv``, ``T <= S`` when causal (so every row sees at least key 0), Hopper only.
Mosaic GPU's CPU interpreter (jax 0.11.2) does not cover this kernel (no ``run_state``, no
register-operand ``wgmma``), so it is tested on the H200
(``tests/pallas_flash_attention_mgpu_test.py``); the semantics are the generic kernel's, and the
reference is :func:`rkv.attention.attention_reference`.

Measured on the H200 (jax 0.11.2, bf16, B=1, T=S=8192, H=32, median of 9 x 10 calls; cuDNN
through ``jax.nn.dot_product_attention`` in the same run; causal FLOPs = 2*B*H*T*S*D):
causal D=128 K=32: 582 TFLOP/s vs cuDNN 556 (1.05x); GQA K=8: 595 vs 554 (1.07x); non-causal
D=128: 595 vs 597 (1.00x); causal D=64: 412 vs 406 (1.02x); causal D=256: 570 vs 599 (0.95x).
The generic Triton kernel did 216 on the GQA shape in the same run as the 595.

Structure: grid ``(H, T / (2 * block_q), B)``, three warpgroups per CTA. Q, K, V and O stay in
their ``[B, T|S, H|K, D]`` layouts (TMA boxes are strided rows, so there is no transpose); the LSE
is written ``[B, H, T]`` (TMA needs a contiguous minor dim) and transposed in the wrapper, 4 bytes
per row and head. Causal prefill loops over KV blocks ``[0, hi)`` of its Q tile only and applies
the mask only on the blocks that straddle the diagonal.

Glossary: B batch, T query length, S key/value length, H query heads, K kv heads, G = H/K, D head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import llvm

from rkv import validation

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_HEAD_DIMS = (64, 128, 256)
# wgmma works on 64-row slabs per warpgroup and 128-byte swizzled K/V rows (64 16-bit elements).
_ROW_QUANTUM = 64
# Two consumer warpgroups (ping-pong) plus one TMA producer warpgroup.
_CONSUMERS = 2
# Registers per thread after `setmaxnreg`: 2 x 128 x 232 + 128 x 40 = 64512 <= 65536, the SM's
# file. The consumers hold the f32 accumulator, the f32 logits and the 16-bit P at once.
_CONSUMER_REGS = 232
_PRODUCER_REGS = 40
# Hardware named barriers for the ping-pong. Mosaic GPU itself uses the low ids (0 is the CTA-wide
# barrier); 8 and 9 are free, as in tokamax's Hopper kernel.
_PINGPONG_BAR = 8
# Opt-in shared memory per CTA on sm_90 (227 KiB), minus a little for the mbarriers.
_SMEM_BYTES = 227 * 1024 - 1024


# --------------------------------------------------------------------------------------------
# (1) Block sizes
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiling of the Hopper kernel (all static under jit).

  ``block_q``: query rows per consumer warpgroup (a CTA owns ``2 * block_q`` rows).
  ``block_kv``: keys per K/V tile, i.e. the N of ``Q @ K^T`` and the K of ``P @ V``.
  ``num_stages``: K/V tiles in flight in the SMEM ring (TMA runs this far ahead of the GEMMs).
  All must fit in registers and SMEM: :meth:`fits` checks the SMEM budget; the register
  budget is the reason for the presets in :meth:`for_head_dim`. At D=128 (8K causal) the
  preset (64, 128, 2) did 582/595 TFLOP/s (K=32/8); (64, 128, 3) 586/563, (64, 64, 4) 496/483.
  """

  block_q: int = 64
  block_kv: int = 128
  num_stages: int = 2

  def __post_init__(self):
    for name in ("block_q", "block_kv"):
      val = getattr(self, name)
      if not isinstance(val, int) or val < _ROW_QUANTUM or val % _ROW_QUANTUM:
        raise ValueError(f"BlockSizes: {name} must be a positive multiple of {_ROW_QUANTUM}, "
                         f"got {val!r}")
    if not isinstance(self.num_stages, int) or self.num_stages < 2:
      raise ValueError(f"BlockSizes: num_stages must be an int >= 2 (double buffering), "
                       f"got {self.num_stages!r}")

  @property
  def tile_q(self) -> int:
    """Query rows per CTA."""
    return _CONSUMERS * self.block_q

  def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
    q_o = _CONSUMERS * self.block_q * head_dim * itemsize  # Q, reused for O
    kv = 2 * self.num_stages * self.block_kv * head_dim * itemsize
    lse = _CONSUMERS * self.block_q * 4
    return q_o + kv + lse

  def fits(self, head_dim: int) -> bool:
    return self.smem_bytes(head_dim) <= _SMEM_BYTES

  @classmethod
  def for_head_dim(cls, head_dim: int) -> "BlockSizes":
    """H200 bf16 starting points (FlashAttention-3's and tokamax's Hopper tiles).

    64 rows per warpgroup is wgmma's M; with block_kv=128 a consumer holds the 64x128 f32 logits
    (64 regs/thread), the 64xD f32 accumulator (64 at D=128) and P in 16 bits (32): that is what
    232 registers afford. D=256 doubles the accumulator, so the logits tile halves.
    """
    if head_dim <= 128:
      return cls(block_q=64, block_kv=128, num_stages=2)
    return cls(block_q=64, block_kv=64, num_stages=2)


def _default_block_sizes(head_dim: int, kv_len: int) -> BlockSizes:
  blocks = BlockSizes.for_head_dim(head_dim)
  # A cache length that is a multiple of 64 but not of 128 still takes the fast path.
  if kv_len % blocks.block_kv and kv_len % _ROW_QUANTUM == 0:
    blocks = dataclasses.replace(blocks, block_kv=_ROW_QUANTUM)
  return blocks


# --------------------------------------------------------------------------------------------
# (2) Kernel
# --------------------------------------------------------------------------------------------
def _named_barrier(op: str, barrier_id, num_threads: int) -> None:
  """``bar.arrive`` / ``bar.sync`` on a hardware named barrier (cheaper than an mbarrier: no
  SMEM word, no phase tracking); Pallas exposes only mbarriers, hence the inline PTX."""

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,))
  def _bar(_, bar_id):
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [bar_id.registers[()]],
                    f"bar.{op} $0, {num_threads};", "r", has_side_effects=True)

  _bar(barrier_id)


def _flash_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, qo_smems, k_smems, v_smems, lse_smems,
                  q_bars, k_bars, v_bars, k_free, v_free, *, causal: bool, scale: float,
                  offset: int, group: int, n_q_tiles: int, n_kv: int, block_q: int,
                  block_kv: int, stages: int):
  """One CTA: ``2 * block_q`` query rows of one head, batch row ``b``.

  Refs: q [B,T,H,D], k/v [B,S,K,D], o [B,T,H,D], lse [B,H,T] (natural log) in GMEM;
  qo_smems [2, block_q, D] (Q, then O), k/v_smems [stages, block_kv, D], lse_smems [2, block_q];
  mbarriers: q_bars [2], k_bars/v_bars [stages] (TMA landed), k_free/v_free [stages] (both
  consumers done with the slot).
  """
  tile_q = _CONSUMERS * block_q
  dtype = q_ref.dtype
  b = lax.axis_index("b")
  h = lax.axis_index("h")
  wg = lax.axis_index("wg")
  # Causal Q tiles differ in cost by up to nK x: launching the heaviest (last) tiles first keeps
  # the final wave of CTAs short (longest-processing-time-first scheduling).
  qi = (n_q_tiles - 1 - lax.axis_index("q")) if causal else lax.axis_index("q")
  tile_start = qi * tile_q

  # Both consumers walk the same KV range so that the shared ring and the ping-pong barriers see
  # the same number of steps; warpgroup 0 (the upper rows) may compute one block that is fully
  # masked for it (exact: its p is 0 there). The tile's last row sees keys <= offset + that row.
  if causal:
    kv_hi = lax.min(jnp.int32(n_kv),
                    lax.div(offset + tile_start + tile_q + block_kv - 1, block_kv))
  else:
    kv_hi = n_kv  # static: a traced constant would be captured by run_state below

  @pl.when(wg < _CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(_CONSUMER_REGS, action="increase")
    q_start = tile_start + wg * block_q
    qo_smem = qo_smems.at[wg]
    plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_start, block_q), h], qo_smem, q_bars.at[wg])

    row_layout = plgpu.Layout.WGMMA.reduce(1)
    acc = plgpu.layout_cast(jnp.zeros((block_q, q_ref.shape[-1]), jnp.float32),
                            plgpu.Layout.WGMMA)
    m = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), row_layout)
    l = plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), row_layout)
    # Logits go to base 2 in the FMA that feeds exp2 (the cheap SFU op); m is in base-2 units and
    # the LSE is converted back to natural log once, at the end.
    scale_log2 = scale * _LOG2E

    # Ping-pong (FA3 §3.1): each consumer signals the other's barrier once its QK^T is issued and
    # waits on its own before issuing PV, so the tensor cores run [PV_j, QK_j+1] of one warpgroup
    # while the other does its softmax. 256 = both warpgroups' threads.
    own_bar = _PINGPONG_BAR + wg
    other_bar = _PINGPONG_BAR + 1 - wg

    plgpu.barrier_wait(q_bars.at[wg])
    plgpu.barrier_wait(k_bars.at[0])  # kv_hi >= 1: key 0 is visible to every row
    # Warpgroup 1 starts half a step behind: it waits for warpgroup 0's first QK^T.
    pl.when(wg == 1)(lambda: _named_barrier("sync", own_bar, 256))

    def step(j, carry, *, masked: bool):
      acc, m, l = carry
      slot = lax.rem(j, stages)

      def qk(s_ref):
        plgpu.wgmma(s_ref, qo_smem, k_smems.at[slot].T)
        _named_barrier("arrive", other_bar, 256)
        return s_ref[...]

      s = pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))
      plgpu.barrier_arrive(k_free.at[slot])

      if masked:  # only on blocks that straddle the diagonal
        q_pos = offset + q_start + plgpu.broadcasted_iota(
            jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
        k_pos = j * block_kv + plgpu.broadcasted_iota(
            jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
        # -inf, not a finite sentinel: every row has seen key 0 before any masked block (block 0
        # comes first and T <= S), so m is finite here and exp2(-inf - m) = 0 exactly.
        s = jnp.where(k_pos <= q_pos, s, -jnp.inf)

      m_new = jnp.maximum(m, s.max(axis=1) * scale_log2)
      alpha = jnp.exp2(m - m_new)  # m = -inf on the first block: alpha = 0, acc and l are 0
      p = jnp.exp2(s * scale_log2 - lax.broadcast_in_dim(m_new, s.shape, [0]))
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      l = l * alpha + p.sum(axis=1)
      p16 = p.astype(dtype)
      # Pin the softmax before the barrier waits, so the compiler cannot sink part of it past
      # them (jax's and tokamax's Hopper kernels found this order faster for D <= 128; at
      # D = 256, moving the row sum behind the PV issue measured the same: 559 vs 559 TFLOP/s).
      acc, m_new, l, p16 = lax.optimization_barrier((acc, m_new, l, p16))

      plgpu.barrier_wait(v_bars.at[slot])
      _named_barrier("sync", own_bar, 256)

      def pv(acc_ref):
        plgpu.wgmma(acc_ref, p16, v_smems.at[slot])

        # While PV runs, wait for the next K tile (the producer is stages - 1 tiles ahead).
        @pl.when(j + 1 < kv_hi)
        def _():
          plgpu.barrier_wait(k_bars.at[lax.rem(j + 1, stages)])

      acc = pl.run_state(pv)(plgpu.ACC.init(acc))  # waits for the wgmma
      plgpu.barrier_arrive(v_free.at[slot])
      return acc, m_new, l

    carry = (acc, m, l)
    if causal:
      # Blocks below the diagonal of this warpgroup's first row need no mask.
      kv_full = lax.min(kv_hi, lax.div(offset + q_start + 1, block_kv))
      carry = lax.fori_loop(0, kv_full, functools.partial(step, masked=False), carry)
      # A cond around the (possibly empty) masked loop: tokamax reports a Mosaic GPU miscompile
      # of these back-to-back loops without it (not reproduced here); one branch per CTA.
      carry = lax.cond(kv_full < kv_hi,
                       lambda c: lax.fori_loop(kv_full, kv_hi,
                                               functools.partial(step, masked=True), c),
                       lambda c: c, carry)
    else:
      carry = lax.fori_loop(0, kv_hi, functools.partial(step, masked=False), carry)
    acc, m, l = carry
    # Warpgroup 0's last arrive releases warpgroup 1's last wait.
    pl.when(wg == 0)(lambda: _named_barrier("arrive", other_bar, 256))

    # l >= exp2(0) = 1 for every row (the max term), so no guard is needed.
    inv_l = 1.0 / l
    qo_smem[...] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(dtype)
    lse_smem = lse_smems.at[wg]
    lse_smem[...] = (m + jnp.log2(l)) * _LN2
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qo_smem, o_ref.at[b, pl.ds(q_start, block_q), h])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, pl.ds(q_start, block_q)])
    # Only the SMEM reads must finish before the CTA exits; the GMEM writes complete on their own.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  @pl.when(wg == _CONSUMERS)
  def _producer():
    plgpu.set_max_registers(_PRODUCER_REGS, action="decrease")
    kv_head = lax.div(h, jnp.int32(group))

    def fetch(j, slot):
      rows = pl.ds(j * block_kv, block_kv)
      plgpu.copy_gmem_to_smem(k_ref.at[b, rows, kv_head], k_smems.at[slot], k_bars.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[b, rows, kv_head], v_smems.at[slot], v_bars.at[slot])

    for i in range(stages):  # fill the ring
      if causal:
        pl.when(i < kv_hi)(functools.partial(fetch, i, i))
      else:
        fetch(i, i)  # stages <= n_kv by construction

    @pl.loop(0, kv_hi - stages)
    def _refill(j):
      slot = lax.rem(j, stages)
      rows = pl.ds((j + stages) * block_kv, block_kv)
      # K first: the consumers release K right after QK^T, V only after PV.
      plgpu.barrier_wait(k_free.at[slot])
      plgpu.copy_gmem_to_smem(k_ref.at[b, rows, kv_head], k_smems.at[slot], k_bars.at[slot])
      plgpu.barrier_wait(v_free.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[b, rows, kv_head], v_smems.at[slot], v_bars.at[slot])

    # Observe the releases of the last tiles too, so every mbarrier phase the consumers complete
    # is waited for (free on the GPU: the CTA lives until the consumers finish anyway; it keeps
    # the protocol balanced for Mosaic GPU's interpreter, which checks that).
    @pl.loop(lax.max(kv_hi - stages, 0), kv_hi)
    def _drain(j):
      slot = lax.rem(j, stages)
      plgpu.barrier_wait(k_free.at[slot])
      plgpu.barrier_wait(v_free.at[slot])


# --------------------------------------------------------------------------------------------
# (3) Jitted wrapper and eligibility
# --------------------------------------------------------------------------------------------
def _smem_tile(shape, dtype):
  # 128-byte swizzle (bank-conflict-free wgmma operand reads) on (8, 64)-element tiles: every
  # supported D is a multiple of 64 16-bit elements.
  swizzle = 128
  tile_cols = swizzle // jnp.dtype(dtype).itemsize
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, tile_cols)),
                                              plgpu.SwizzleTransform(swizzle)))


@functools.partial(jax.jit, static_argnames=("causal", "scale", "blocks"))
def _flash_attention_mgpu(q, k, v, *, causal: bool, scale: float, blocks: BlockSizes):
  b, t, h, d = q.shape
  s, kh = k.shape[1], k.shape[2]
  # A cache shorter than the ring needs fewer stages (one, for a single KV block).
  stages = min(blocks.num_stages, s // blocks.block_kv)
  n_q_tiles = t // blocks.tile_q
  n_kv = s // blocks.block_kv

  kernel = functools.partial(_flash_kernel, causal=causal, scale=scale, offset=s - t,
                             group=h // kh, n_q_tiles=n_q_tiles, n_kv=n_kv,
                             block_q=blocks.block_q, block_kv=blocks.block_kv, stages=stages)
  ring = (stages, blocks.block_kv, d)
  o, lse = plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct((b, t, h, d), q.dtype),
                jax.ShapeDtypeStruct((b, h, t), jnp.float32)),
      scratch_types=(
          _smem_tile((_CONSUMERS, blocks.block_q, d), q.dtype),    # Q, then O
          _smem_tile(ring, k.dtype),                                # K ring
          _smem_tile(ring, v.dtype),                                # V ring
          plgpu.SMEM((_CONSUMERS, blocks.block_q), jnp.float32),    # LSE staging
          plgpu.Barrier(num_barriers=_CONSUMERS),                   # Q landed
          plgpu.Barrier(num_barriers=stages),                       # K landed
          plgpu.Barrier(num_barriers=stages),                       # V landed
          plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),  # K free
          plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),  # V free
      ),
      # Grid axis 0 launches fastest: the G query heads of one kv head run side by side and
      # share its K/V tiles in L2.
      grid=(h, n_q_tiles, b),
      grid_names=("h", "q", "b"),
      num_threads=_CONSUMERS + 1,
      thread_name="wg",
      # approx_math: ex2.approx for exp2. No reduction scratch: the row max/sum of the WGMMA
      # layout are warp shuffles, and the 2 KiB default would keep 3 stages at D=128 out of SMEM.
      compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
  )(q, k, v)
  return o, jnp.transpose(lse, (0, 2, 1))


def _check(q, k, v, causal, blocks: BlockSizes, where: str) -> str | None:
  """Why the fast path cannot take this call (None: it can). Shapes and dtypes only."""
  b, t, h, d = q.shape
  s = k.shape[1]
  if jnp.dtype(q.dtype) not in _DTYPES:
    return f"{where}: q dtype must be bfloat16 or float16, got {q.dtype}"
  if jnp.dtype(k.dtype) != jnp.dtype(q.dtype) or jnp.dtype(v.dtype) != jnp.dtype(q.dtype):
    return f"{where}: k/v dtype must equal q dtype {q.dtype}, got {k.dtype}/{v.dtype}"
  if d not in _HEAD_DIMS:
    return f"{where}: head dim D must be one of {_HEAD_DIMS}, got {d}"
  if t % blocks.tile_q:
    return (f"{where}: q length T={t} must be a multiple of 2 * block_q = {blocks.tile_q}")
  if s % blocks.block_kv:
    return f"{where}: kv length S={s} must be a multiple of block_kv = {blocks.block_kv}"
  if causal and t > s:
    return f"{where}: causal needs T <= S (rows past S would see no key), got T={t}, S={s}"
  if not blocks.fits(d):
    return (f"{where}: block_sizes {blocks} need {blocks.smem_bytes(d)} bytes of SMEM at "
            f"D={d}, more than {_SMEM_BYTES}")
  return None


def flash_attention_mgpu(q, k, v, *, causal: bool = True, scale: float | None = None,
                         block_sizes: BlockSizes | None = None) -> tuple[jax.Array, jax.Array]:
  """Exact attention of q [B,T,H,D] over k/v [B,S,K,D] with default positions; (o, lse).

  ``o`` [B,T,H,D] has q's dtype; ``lse`` [B,T,H] is float32 natural log. Causal is bottom-right
  aligned (query i sees keys ``<= S - T + i``). Hopper only; see :func:`supports` for the shapes
  it takes (it raises ``ValueError`` on anything else rather than falling back).
  """
  args = validation.attention_args(q, k, v, scale=scale, where="flash_attention_mgpu")
  if block_sizes is None:
    block_sizes = _default_block_sizes(args.head_dim, args.kv_len)
  elif not isinstance(block_sizes, BlockSizes):
    raise ValueError(f"flash_attention_mgpu: block_sizes must be a BlockSizes or None, "
                     f"got {type(block_sizes).__name__}")
  why = _check(q, k, v, bool(causal), block_sizes, "flash_attention_mgpu")
  if why is not None:
    raise ValueError(why)
  return _flash_attention_mgpu(q, k, v, causal=bool(causal), scale=args.scale,
                               blocks=block_sizes)


def _is_hopper() -> bool:
  if jax.default_backend() != "gpu":
    return False
  dev = jax.devices()[0]
  # wgmma and setmaxnreg are sm_90a instructions: not on Ampere, not on Blackwell.
  return getattr(dev, "compute_capability", None) == "9.0"


def unsupported_reason(q, k, v, *, q_pos=None, k_pos=None, k_scale=None, v_scale=None,
                       causal=True, window=None, softcap=None, scale=None,
                       block_sizes=None) -> str | None:
  """Why :func:`flash_attention_mgpu` cannot compute this ``rkv.attention`` call exactly, or
  None if it can on a Hopper GPU. Looks at options, shapes and dtypes only, never at values
  (explicit positions are rejected even if they equal the defaults), so it runs on any backend.
  """
  del scale  # any scale is supported
  for name, val in (("q_pos", q_pos), ("k_pos", k_pos), ("k_scale", k_scale),
                    ("v_scale", v_scale), ("window", window), ("softcap", softcap),
                    ("block_sizes", block_sizes)):
    if val is not None:
      return f"supports: {name} must be None for the Mosaic GPU path, got a value"
  for name, x in (("q", q), ("k", k), ("v", v)):
    if len(getattr(x, "shape", ())) != 4:
      return f"supports: {name} must be rank 4, got shape {getattr(x, 'shape', None)}"
  blocks = _default_block_sizes(q.shape[-1], k.shape[1])
  return _check(q, k, v, bool(causal), blocks, "supports")


def supports(q, k, v, *, q_pos=None, k_pos=None, k_scale=None, v_scale=None, causal=True,
             window=None, softcap=None, scale=None, block_sizes=None) -> bool:
  """Whether :func:`flash_attention_mgpu` computes exactly this ``rkv.attention`` call here.

  False (the caller uses the generic kernel) off a Hopper GPU, and for every case
  :func:`unsupported_reason` names: explicit positions, int8 K/V, sliding windows, softcap,
  float32, head dims outside {64, 128, 256}, lengths that are not block multiples, causal T > S,
  explicit block sizes.
  """
  if not _is_hopper():
    return False
  return unsupported_reason(q, k, v, q_pos=q_pos, k_pos=k_pos, k_scale=k_scale,
                            v_scale=v_scale, causal=causal, window=window, softcap=softcap,
                            scale=scale, block_sizes=block_sizes) is None
