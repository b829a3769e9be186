"""Prefill flash attention for Hopper (sm_90) through Pallas Mosaic GPU: the fast path.

The generic kernel (``flash_attention.py``, Triton lowering) reached about 295 TFLOP/s on the
H200 for 8K causal prefill, H=32, D=128, where cuDNN did 510 and tokamax's Mosaic GPU kernel 550
in the same run. The gap is the Hopper machinery Triton does not use well from Pallas: TMA bulk
copies, asynchronous ``wgmma`` with one operand straight from registers, warp specialization and
register reallocation. This kernel uses all of them, in the FlashAttention-3 arrangement
(Shah et al. 2024, §3.1): a producer warpgroup streams K/V tiles into a ring of SMEM stages while
two consumer warpgroups, each owning ``block_q`` query rows, ping-pong on the tensor cores: one
runs its softmax while the other runs its two GEMMs.

It takes two kinds of call, and the caller falls back to the generic kernel otherwise
(:func:`supports` is the gate). With default positions (``k_pos = arange(S)``,
``q_pos = S - T + arange(T)``, causal bottom-right aligned, ``T <= S``) the masks come from
indices and only the blocks on the diagonal are masked. With explicit positions or a window (a
prefill chunk at any offset into a cache, holes, sliding windows) a visit plan built from
per-block position bounds (:func:`_visit_plan`) lists, per CTA, the KV blocks to read: the
unmasked ones first, then the masked ones, whose masks come from the loaded positions; blocks
nobody can see are never fetched. Blocks that hold an empty slot (``k_pos < 0``) are left to the
generic kernel and merged by LSE, because here V goes from SMEM straight into ``wgmma`` and
``p = 0`` cannot cancel a NaN there. Softcap and int8 K/V stay on the generic kernel; bf16/f16,
``D`` in {64, 128, 256}, ``T`` a multiple of ``2 * block_q`` and ``S`` of ``block_kv``,
Hopper only.
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
from rkv.pallas import flash_attention as generic_kernel

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


def _flash_kernel(q_ref, k_ref, v_ref, *refs, causal: bool, scale: float, offset: int,
                  group: int, n_q_tiles: int, n_kv: int, block_q: int, block_kv: int,
                  stages: int, positions: bool, window: int | None):
  """One CTA: ``2 * block_q`` query rows of one head, batch row ``b``.

  Refs: q [B,T,H,D], k/v [B,S,K,D], o [B,T,H,D], lse [B,H,T] (natural log) in GMEM;
  qo_smems [2, block_q, D] (Q, then O), k/v_smems [stages, block_kv, D], lse_smems [2, block_q];
  mbarriers: q_bars [2], k_bars/v_bars [stages] (TMA landed), k_free/v_free [stages] (both
  consumers done with the slot).

  With ``positions``, four more GMEM inputs come after v: q_pos [B,T], k_pos [B,S], and the
  visit plan of :func:`_visit_plan`, ``order`` [B, nQ, nKV] (the KV blocks this CTA reads:
  the unmasked ones first, then the masked ones) and ``counts`` [B, nQ, 2] (how many of each:
  ``n_full``, ``n_total``). The KV loop then walks ``order[:n_total]`` instead of ``[0, hi)``.
  """
  if positions:
    (qpos_ref, kpos_ref, order_ref, counts_ref, o_ref, lse_ref, qo_smems, k_smems, v_smems,
     lse_smems, q_bars, k_bars, v_bars, k_free, v_free) = refs
  else:
    (o_ref, lse_ref, qo_smems, k_smems, v_smems, lse_smems, q_bars, k_bars, v_bars, k_free,
     v_free) = refs
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
  if positions:
    # The plan's counts: steps [0, plan_full) need no mask, [plan_full, kv_hi) do.
    plan_full = counts_ref[b, qi, 0]
    kv_hi = counts_ref[b, qi, 1]
    block_of = lambda j: order_ref[b, qi, j]
  elif causal:
    kv_hi = lax.min(jnp.int32(n_kv),
                    lax.div(offset + tile_start + tile_q + block_kv - 1, block_kv))
    block_of = lambda j: j
  else:
    kv_hi = n_kv  # static: a traced constant would be captured by run_state below
    block_of = lambda j: j

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
    if positions:
      # Explicit positions: a CTA may have nothing to read (then its rows see no key).
      pl.when(kv_hi > 0)(lambda: plgpu.barrier_wait(k_bars.at[0]))
      # Loaded once: the row positions of this warpgroup, for the masked blocks.
      q_pos_rows = plgpu.load(qpos_ref.at[b, pl.ds(q_start, block_q)], layout=row_layout,
                              optimized=False)
    else:
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

      if masked and positions:
        # Only clean blocks reach the kernel (every k_pos >= 0, _visit_plan), so visibility is
        # the causal and window terms alone.
        kv_start = block_of(j) * block_kv
        k_pos = plgpu.load(kpos_ref.at[b, pl.ds(kv_start, block_kv)],
                           layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
        q_pos = lax.broadcast_in_dim(q_pos_rows, s.shape, [0])
        k_pos = lax.broadcast_in_dim(k_pos, s.shape, [1])
        vis = None
        if causal:
          vis = k_pos <= q_pos
        if window is not None:
          in_window = q_pos - k_pos < window
          vis = in_window if vis is None else vis & in_window
        if vis is not None:  # non-causal with no window: every clean block is unmasked
          s = jnp.where(vis, s, -jnp.inf)
      elif masked:  # only on blocks that straddle the diagonal
        q_pos = offset + q_start + plgpu.broadcasted_iota(
            jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
        k_pos = j * block_kv + plgpu.broadcasted_iota(
            jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
        # -inf, not a finite sentinel: every row has seen key 0 before any masked block (block 0
        # comes first and T <= S), so m is finite here and exp2(-inf - m) = 0 exactly.
        s = jnp.where(k_pos <= q_pos, s, -jnp.inf)

      m_new = jnp.maximum(m, s.max(axis=1) * scale_log2)
      if masked and positions:
        # With explicit positions a row may have seen nothing yet (m_new = -inf): shift by 0
        # there, so exp2(-inf - 0) = 0 instead of exp2(-inf - -inf) = NaN. Unmasked blocks
        # make every row's m finite, so they skip this.
        m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      else:
        m_shift = m_new
      alpha = jnp.exp2(m - m_shift)  # m = -inf on the first block: alpha = 0, acc and l are 0
      p = jnp.exp2(s * scale_log2 - lax.broadcast_in_dim(m_shift, s.shape, [0]))
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
    if positions:
      carry = lax.fori_loop(0, plan_full, functools.partial(step, masked=False), carry)
      carry = lax.cond(plan_full < kv_hi,
                       lambda c: lax.fori_loop(plan_full, kv_hi,
                                               functools.partial(step, masked=True), c),
                       lambda c: c, carry)
    elif causal:
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

    lse_smem = lse_smems.at[wg]
    if positions:
      # A row that saw no key has l = 0 and acc = 0: o = 0, lse = -inf (docs/DESIGN.md §2).
      seen = l != 0.0  # NaN (a read NaN) is "seen": it propagates
      safe_l = jnp.where(seen, l, 1.0)
      inv_l = 1.0 / safe_l
      lse = jnp.where(seen, (m + jnp.log2(safe_l)) * _LN2, -jnp.inf)
    else:
      # l >= exp2(0) = 1 for every row (the max term), so no guard is needed.
      inv_l = 1.0 / l
      lse = (m + jnp.log2(l)) * _LN2
    qo_smem[...] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(dtype)
    lse_smem[...] = lse
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
      rows = pl.ds(block_of(j) * block_kv, block_kv)
      plgpu.copy_gmem_to_smem(k_ref.at[b, rows, kv_head], k_smems.at[slot], k_bars.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[b, rows, kv_head], v_smems.at[slot], v_bars.at[slot])

    for i in range(stages):  # fill the ring
      if causal or positions:
        pl.when(i < kv_hi)(functools.partial(fetch, i, i))
      else:
        fetch(i, i)  # stages <= n_kv by construction

    @pl.loop(0, kv_hi - stages)
    def _refill(j):
      slot = lax.rem(j, stages)
      rows = pl.ds(block_of(j + stages) * block_kv, block_kv)
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


# Sort keys of the visit plan: unmasked blocks first, then masked ones, then the skipped.
_VISIT_FULL, _VISIT_MASKED, _VISIT_SKIP = 0, 1, 2


def _visit_plan(q_pos, k_pos, *, tile_q: int, block_kv: int, causal: bool,
                window: int | None):
  """Which KV blocks each CTA reads, from positions alone: ``(order, counts, clean)``.

  ``order`` [B, nQ, nKV] int32 lists block indices, unmasked first (every key visible to every
  row of the CTA's tile), then masked (some key visible to some row), then the rest;
  ``counts`` [B, nQ, 2] holds how many are unmasked and how many are read in all; ``clean``
  [B, nKV] says which blocks hold no empty slot. Only clean blocks are listed: the kernel feeds
  V from SMEM straight into wgmma, where p = 0 cannot cancel a NaN in an empty slot (0 * NaN),
  so blocks with empty slots go to the generic kernel, which zeroes those rows
  (:func:`_flash_attention_mgpu`). The bounds are from per-block min/max positions, O(S + T +
  nQ * nKV): a block listed as masked may turn out to hold nothing visible (exact: p = 0).
  """
  b, t = q_pos.shape
  s = k_pos.shape[1]
  kp = k_pos.reshape(b, s // block_kv, block_kv)
  clean = jnp.all(kp >= 0, axis=2)                      # [B, nKV]
  kmin, kmax = jnp.min(kp, axis=2), jnp.max(kp, axis=2)  # exact on clean blocks
  qp = q_pos.reshape(b, t // tile_q, tile_q)
  qmin, qmax = jnp.min(qp, axis=2), jnp.max(qp, axis=2)  # [B, nQ]
  kmin, kmax = kmin[:, None, :], kmax[:, None, :]
  qmin, qmax = qmin[:, :, None], qmax[:, :, None]
  some = jnp.broadcast_to(clean[:, None, :], (b, t // tile_q, s // block_kv))
  every = some
  if causal:
    some = some & (kmin <= qmax)
    every = every & (kmax <= qmin)
  if window is not None:
    some = some & (qmin - kmax < window)
    every = every & (qmax - kmin < window)
  kind = jnp.where(every, _VISIT_FULL, jnp.where(some, _VISIT_MASKED, _VISIT_SKIP))
  order = jnp.argsort(kind, axis=2, stable=True).astype(jnp.int32)
  counts = jnp.stack([jnp.sum(kind == _VISIT_FULL, axis=2),
                      jnp.sum(kind != _VISIT_SKIP, axis=2)], axis=2).astype(jnp.int32)
  return order, counts, clean


@functools.partial(jax.jit, static_argnames=("causal", "scale", "blocks", "window"))
def _flash_attention_mgpu(q, k, v, q_pos, k_pos, *, causal: bool, scale: float,
                          blocks: BlockSizes, window: int | None):
  b, t, h, d = q.shape
  s, kh = k.shape[1], k.shape[2]
  positions = q_pos is not None
  # A cache shorter than the ring needs fewer stages (one, for a single KV block).
  stages = min(blocks.num_stages, s // blocks.block_kv)
  n_q_tiles = t // blocks.tile_q
  n_kv = s // blocks.block_kv

  kernel = functools.partial(_flash_kernel, causal=causal, scale=scale, offset=s - t,
                             group=h // kh, n_q_tiles=n_q_tiles, n_kv=n_kv,
                             block_q=blocks.block_q, block_kv=blocks.block_kv, stages=stages,
                             positions=positions, window=window)
  inputs = (q, k, v)
  if positions:
    order, counts, clean = _visit_plan(q_pos, k_pos, tile_q=blocks.tile_q,
                                       block_kv=blocks.block_kv, causal=causal, window=window)
    inputs += (q_pos, k_pos, order, counts)
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
  )(*inputs)
  lse = jnp.transpose(lse, (0, 2, 1))
  if not positions:
    return o, lse
  # Blocks with an empty slot (holes, the unfilled end of a cache) go to the generic kernel,
  # every other block hidden from it; in the common chunked prefill there are none, and its
  # programs find nothing to read. The two partials cover disjoint keys: an exact LSE merge.
  hidden = jnp.repeat(clean, blocks.block_kv, axis=1)
  o_rest, lse_rest = generic_kernel.flash_attention(q, k, v, q_pos=q_pos,
                                                    k_pos=jnp.where(hidden, -1, k_pos),
                                                    causal=causal, window=window,
                                                    scale=scale)
  from rkv.attention import merge_partials  # pylint: disable=g-import-not-at-top
  return merge_partials(jnp.stack([o, o_rest]), jnp.stack([lse, lse_rest]))


def _check(q, k, v, causal, blocks: BlockSizes, where: str, *,
           positions: bool = False) -> str | None:
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
  # With explicit positions a row that sees no key is handled (o = 0, lse = -inf); the default
  # positions path assumes every row sees key 0.
  if causal and t > s and not positions:
    return f"{where}: causal needs T <= S (rows past S would see no key), got T={t}, S={s}"
  if not blocks.fits(d):
    return (f"{where}: block_sizes {blocks} need {blocks.smem_bytes(d)} bytes of SMEM at "
            f"D={d}, more than {_SMEM_BYTES}")
  return None


def flash_attention_mgpu(q, k, v, *, q_pos=None, k_pos=None, causal: bool = True,
                         window: int | None = None, scale: float | None = None,
                         block_sizes: BlockSizes | None = None) -> tuple[jax.Array, jax.Array]:
  """Exact attention of q [B,T,H,D] over k/v [B,S,K,D]; returns (o, lse).

  ``o`` [B,T,H,D] has q's dtype; ``lse`` [B,T,H] is float32 natural log. With no positions and
  no window, causal is bottom-right aligned (query i sees keys ``<= S - T + i``) and the kernel
  computes its masks from indices. With ``q_pos`` [B,T] / ``k_pos`` [B,S] (either; the other
  takes its default) or a ``window``, visibility is the contract's (docs/DESIGN.md §2): empty slots
  (``k_pos < 0``) are never read, rows that see no key give ``o = 0, lse = -inf``. Hopper only;
  see :func:`supports` for the shapes it takes (it raises ``ValueError`` on anything else
  rather than falling back).
  """
  args = validation.attention_args(q, k, v, q_pos=q_pos, k_pos=k_pos, window=window,
                                   scale=scale, where="flash_attention_mgpu")
  positions = q_pos is not None or k_pos is not None or window is not None
  if block_sizes is None:
    block_sizes = _default_block_sizes(args.head_dim, args.kv_len)
  elif not isinstance(block_sizes, BlockSizes):
    raise ValueError(f"flash_attention_mgpu: block_sizes must be a BlockSizes or None, "
                     f"got {type(block_sizes).__name__}")
  why = _check(q, k, v, bool(causal), block_sizes, "flash_attention_mgpu", positions=positions)
  if why is not None:
    raise ValueError(why)
  return _flash_attention_mgpu(q, k, v, args.q_pos if positions else None,
                               args.k_pos if positions else None, causal=bool(causal),
                               scale=args.scale, blocks=block_sizes, window=window)


def _is_hopper() -> bool:
  if jax.default_backend() != "gpu":
    return False
  dev = jax.devices()[0]
  # wgmma and setmaxnreg are sm_90a instructions: not on Ampere, not on Blackwell.
  return getattr(dev, "compute_capability", None) == "9.0"


def unsupported_reason(q, k, v, *, q_pos=None, k_pos=None, k_scale=None, v_scale=None,
                       causal=True, window=None, softcap=None, scale=None,
                       block_sizes=None, kv_rows=None) -> str | None:
  """Why :func:`flash_attention_mgpu` cannot compute this ``rkv.attention`` call exactly, or
  None if it can on a Hopper GPU. Looks at options, shapes and dtypes only, never at values,
  so it runs on any backend. Explicit positions and windows are taken; int8 K/V and softcap
  stay on the generic kernel, and so do pools (``kv_rows``): this kernel's TMA copies move
  contiguous [block, D] tiles of one sequence, not rows gathered through a table.
  """
  del scale  # any scale is supported
  for name, val in (("k_scale", k_scale), ("v_scale", v_scale), ("softcap", softcap),
                    ("block_sizes", block_sizes), ("kv_rows", kv_rows)):
    if val is not None:
      return f"supports: {name} must be None for the Mosaic GPU path, got a value"
  for name, x in (("q", q), ("k", k), ("v", v)):
    if len(getattr(x, "shape", ())) != 4:
      return f"supports: {name} must be rank 4, got shape {getattr(x, 'shape', None)}"
  blocks = _default_block_sizes(q.shape[-1], k.shape[1])
  positions = q_pos is not None or k_pos is not None or window is not None
  return _check(q, k, v, bool(causal), blocks, "supports", positions=positions)


def supports(q, k, v, *, q_pos=None, k_pos=None, k_scale=None, v_scale=None, causal=True,
             window=None, softcap=None, scale=None, block_sizes=None, kv_rows=None) -> bool:
  """Whether :func:`flash_attention_mgpu` computes exactly this ``rkv.attention`` call here.

  False (the caller uses the generic kernel) off a Hopper GPU, and for every case
  :func:`unsupported_reason` names: a pool (kv_rows), int8 K/V, softcap, float32, head dims outside
  {64, 128, 256}, lengths that are not block multiples, causal T > S with default positions,
  explicit block sizes.
  """
  if not _is_hopper():
    return False
  return unsupported_reason(q, k, v, q_pos=q_pos, k_pos=k_pos, k_scale=k_scale,
                            v_scale=v_scale, causal=causal, window=window, softcap=softcap,
                            scale=scale, block_sizes=block_sizes, kv_rows=kv_rows) is None
