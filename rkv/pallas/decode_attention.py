"""Split-K decode attention for a few query tokens (T <= 16) over a long KV cache (Pallas, Triton lowering).

Decode is memory bound: each step reads all of K and V once (B=1 H=32 K=8 D=128 bf16 at 512K keys is
2 GiB; cuDNN does it in 787 us on the H200, docs/DESIGN.md §7) and does ~2*T*G flops per byte. So the kernel
is laid out to stream K/V at HBM speed, not to save flops:

- Grid (B, K, N). One program owns one kv head and one contiguous chunk of S (a "split"), so
  B*K*N programs share the work and N is picked from B, K and S to fill the 132 SMs several times.
- All G*T query rows that read the same kv head are packed into one tile [R, D] (row r = t*G + g,
  R = max(16, next_pow2(T*G))) so every K/V byte loaded is used by all of them through one tensor-core
  dot ([R, D] @ [D, block_k]); Triton needs power-of-two dot dims >= 16, hence the padding. Only when
  R*D would overflow the registers (T=16 with G=16, or D=256 with T*G > 64) are the rows cut into
  row blocks, each its own program; those re-read the same K/V right after each other, from L2.
- K/V are read in place from the [B, S, K, D] cache (no transpose, no pad copy: at 512K keys such a
  copy costs more than the kernel). Lengths that are not tile multiples and head dims that are not
  powers of two are handled by masked loads; masked-off rows are never fetched from memory.
- Keys nobody can see (empty slots, future keys, keys outside the sliding window) are skipped: a
  per-batch index range [lo, hi) that may hold visible keys is computed in the wrapper (from q_pos
  alone when k_pos is the default arange, or when the caller passes ``kv_fill`` and there is no
  window; by one fused reduction over k_pos otherwise) and the N
  splits partition only that range, so a half-empty preallocated cache or a short window over a long
  one still keeps every SM busy on the keys that matter. With default positions, keys inside the range
  but outside the visible positions are also masked out of the K/V loads (their bytes stay in HBM).
  With explicit k_pos the loads are masked by the chunk bounds only, because a load mask that depends
  on the loaded k_pos makes Triton single-buffer K/V; NaN in empty slots is neutralised after the load.
- Each split writes a float32 partial (o normalised, lse natural log, -inf when it saw no key); a
  second kernel (``_merge_kernel``) merges the splits exactly with a log-sum-exp weighted sum (the
  same merge as rkv.merge) and writes o in q's dtype. A resident decode call is then three
  launches: the bounds' small fusion, this kernel, the merge.
- Many sequences in one pool (``kv_rows [B,S]``, K/V ``[R_pool,K,D]``): each block of block_k keys
  first loads its block_k row numbers, then gather-loads those rows of K and V (a pointer tensor of
  block_k x D addresses: Triton lowers a load indexed by an int array to exactly that, see
  ``_compute_offsets_from_indices`` in jax's Pallas Triton lowering). One row of one kv head is
  D contiguous elements (256 B at bf16 D=128, two full 128 B lines), so a row-level gather still
  moves whole cache lines and needs no page granularity; rows in order coalesce like the dense
  cache. Padding rows (negative) are masked out of the loads, so they are never fetched. Nothing is
  gathered into a copy: a copy would read every byte the kernel reads and write it once more.

Glossary: B batch, T query length, S key/value length, H query heads, K kv heads, G = H/K, D head dim,
R packed query rows per kv head, N splits along S; R_pool rows of a shared K/V pool (kv_rows).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from rkv import validation

MAX_QUERY_LEN = 16  # beyond this the packed tile (T*G rows) stops being "decode"; use flash attention.

# H200 (docs/DESIGN.md §7). Programs are small (one [R, D] accumulator, K/V tiles in shared memory), so a few
# co-reside per SM. Measured on the H200 (benchmarks/results/kernel_bench_h200_sweep1.json, bf16 D=128):
# about 2 programs per SM (N=33 at B=1, K=8) beat 4 per SM by 2-10% from 32K to 512K keys.
_NUM_SMS = 132
_TARGET_PROGRAMS = 2 * _NUM_SMS
# Below ~256 keys per program the pipeline prologue/epilogue (first loads in flight, final store)
# is no longer small next to the streaming time (256 keys x 256 B x 2 = 128 KiB per program at
# D=128 bf16). The floor was 512 while every extra split added work to an XLA merge; with the
# merge kernel (up to 128 splits in one pass) 256 measured faster at short contexts, resident
# decode through the model, alternating with 512 and 128 over two rounds on one H200 (tok/s at
# 2K / 8K / 32K): 256: 227.96, 229.93 / 219.82, 220.78 / 192.26, 191.09; 512: 220.17, 222.59 /
# 217.47, 218.84 / 188.90, 190.25; 128: 232.42, 228.96 / 217.68, 216.65 / 188.55, 189.77
# (benchmarks/results/beyond_hbm/session14/splitfloor/). At 2K (8 kv heads) that is 8 splits, not 4.
_MIN_KEYS_PER_SPLIT = 256
# One pipeline buffer holds a K and a V tile. Compiled for sm_90 (Triton 3.9), block_k=64 and
# num_stages=3 at bf16 D=128 gives two 32 KiB K/V buffers, 70 KiB of shared memory and 88 registers,
# so up to three programs share an SM's 227 KiB (one computes while the others wait on HBM); one
# buffer in flight per program (32 KiB) is already about twice the bytes an SM must keep in flight
# for its 1/132 share of ~3.3 TB/s at ~700 ns of HBM latency. Measured by Nsight Compute on the H200
# for the path the caches take (explicit k_pos, B=1 T=1 H=32 K=8): 87 KiB of shared memory and 142
# registers a program, so two programs an SM; at 128K keys 4.10 TB/s (85% of DRAM peak; cuDNN takes
# the same time). block_k=32 fits four (46 KiB, 96 registers; occupancy 17.9 vs 12.3%) and reads no
# faster (4.11 TB/s): occupancy is not what holds the rate (docs/DESIGN.md §7).
_STAGE_BYTES = 32 * 1024
# Keep the [rows, block_k] float32 logits tile at <= 16K elements (64 KiB of registers over 4..8 warps).
_MAX_LOGIT_TILE = 16 * 1024
# The float32 accumulator [rows, Dp] lives in registers: <= 16K elements per program keeps it at
# <= 64 registers a thread with 8 warps. Compiled for sm_90 (Triton 3.9, ptxas), T=16 G=8 D=128 in one
# 4-warp program used 255 registers and spilled ~1 KB; with 8 warps it does not.
_MAX_ACC = 16 * 1024

_INT32_MAX = 2**31 - 1

SPLIT_MERGES = ("kernel", "tree", "chain")  # the first of each is the default
SPLIT_MERGE_ENV = "RKV_DECODE_SPLIT_MERGE"
QUERY_PACKS = ("kernel", "wrapper")
QUERY_PACK_ENV = "RKV_DECODE_QUERY_PACK"


# ---------------------------------------------------------------------------------------------------
# (1) Block sizes
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiling of the decode kernel. ``None`` fields are chosen from the shapes (see ``resolve``).

  Defaults for the H200 at bf16 D=128: block_k=64 (16 KiB K + 16 KiB V per buffer), num_stages=3
  (Triton pipelines the K/V loads through cp.async: 87 KiB of shared memory a program measured, so
  two programs an SM), num_warps=4 (the [16, 64] logits tile is tiny; more warps only add
  synchronisation), num_splits such that B*K*N ~ 2 x 132 programs but no split shorter than 512
  keys. Timed on the H200: the sweeps of benchmarks/results/kernel_bench_h200_sweep{1,2}.json and
  seven tilings in a 32-layer stack (benchmarks/results/beyond_hbm/session11/c/) found none faster
  by more than the run-to-run spread (docs/DESIGN.md §7).
  """

  block_k: int | None = None     # keys per inner iteration (power of two, >= 16)
  num_splits: int | None = None  # N: programs per (batch, kv head) along S
  num_warps: int | None = None
  num_stages: int | None = None  # Triton software-pipelining depth of the K/V loads
  block_rows: int | None = None  # packed query rows per program (power of two >= 16); None: all R
                                 # rows up to 16K / Dp of them (accumulator register budget)
  # How the N split partials are merged: "kernel" (a second Pallas kernel, ``_merge_kernel``,
  # merges them and writes o in q's dtype, so that with T=1 and a power-of-two D the unpacking is
  # a reshape: one launch), "tree" (max, then the weighted sums in XLA: ~4 small kernels, Nsight
  # Compute, benchmarks/results/beyond_hbm/session11/b/) or "chain" (an online merge unrolled over
  # N in XLA). None: $RKV_DECODE_SPLIT_MERGE, else "kernel". Why: a resident decode step is a
  # queue of ~20 small kernels a layer around the GEMMs and this kernel (docs/DESIGN.md §7).
  # Measured on the H200 with query_pack="kernel", against tree + wrapper, resident decode, two
  # alternating rounds (benchmarks/results/beyond_hbm/session11/f/): 2K 219.5 / 216.0 vs
  # 216.3 / 216.0 tok/s, 32K 185.0 / 184.7 vs 182.4 / 182.3, 128K 120.5 / 119.8 vs 119.6 / 119.5;
  # 32 stacked layers 141.5 vs 146.8 us at 128K. "chain" with query_pack="kernel" was no faster
  # than tree there (2K 215.4 / 218.4, 32K 181.7 / 183.0), as in session 8.
  split_merge: str | None = None
  # Where the G*T query rows of a kv head are packed and padded into the [R, Dp] tile, with their
  # positions: "kernel" (each program gathers its rows from q [B,T,H,D] and q_pos [B,T] itself:
  # no launch) or "wrapper" (XLA pad/transpose fusions before the kernel, two launches a call).
  # None: $RKV_DECODE_QUERY_PACK, else "kernel" (measured with split_merge above).
  query_pack: str | None = None

  def resolve(self, *, batch: int, kv_heads: int, kv_len: int, rows: int, head_dim: int,
              kv_itemsize: int) -> BlockSizes:
    """Fills the ``None`` fields for one call; ``rows`` is the padded packed tile height R and
    ``head_dim`` the padded Dp."""
    block_rows = self.block_rows
    if block_rows is None:
      block_rows = max(16, _floor_pow2(_MAX_ACC // head_dim))
    rows = min(rows, block_rows)
    block_k = self.block_k
    if block_k is None:
      # Largest power of two whose K+V stage fits _STAGE_BYTES (64 at bf16 D=128, 128 for int8), no
      # larger than 128 (per-iteration overhead is already small there) nor than the logits-tile
      # register budget.
      per_key = 2 * head_dim * kv_itemsize
      block_k = min(128, _floor_pow2(_STAGE_BYTES // per_key), _floor_pow2(_MAX_LOGIT_TILE // rows))
      block_k = max(16, min(block_k, _next_pow2(kv_len)))
    num_splits = self.num_splits
    if num_splits is None:
      want = -(-_TARGET_PROGRAMS // (batch * kv_heads))
      num_splits = max(1, min(want, kv_len // _MIN_KEYS_PER_SPLIT))
    num_warps = self.num_warps
    if num_warps is None:
      # The accumulator [rows, Dp] and the logits [rows, block_k] both sit in registers: up to ~96 of
      # them a thread, 4 warps (the decode case, [16, 128] + [16, 64], uses 88 registers on sm_90);
      # beyond, 8 warps (T=16 G=4 int8, [64, 128] + [64, 128], at 4 warps compiled to 255 registers).
      num_warps = 4 if rows * (head_dim + block_k) <= 4 * 32 * 96 else 8
    num_stages = 3 if self.num_stages is None else self.num_stages
    split_merge = self.split_merge or validation.env_choice(SPLIT_MERGE_ENV, SPLIT_MERGES,
                                                             SPLIT_MERGES[0])
    query_pack = self.query_pack or validation.env_choice(QUERY_PACK_ENV, QUERY_PACKS,
                                                           QUERY_PACKS[0])
    return BlockSizes(block_k=block_k, num_splits=num_splits, num_warps=num_warps,
                      num_stages=num_stages, block_rows=rows, split_merge=split_merge,
                      query_pack=query_pack)

  def check(self, where: str) -> None:
    if self.block_k is not None and (self.block_k < 16 or self.block_k & (self.block_k - 1)):
      raise ValueError(f"{where}: block_sizes.block_k must be a power of two >= 16 (Triton dot), "
                       f"got {self.block_k}")
    if self.num_splits is not None and self.num_splits < 1:
      raise ValueError(f"{where}: block_sizes.num_splits must be >= 1, got {self.num_splits}")
    if self.num_warps is not None and (self.num_warps < 1 or self.num_warps > 16
                                       or self.num_warps & (self.num_warps - 1)):
      raise ValueError(f"{where}: block_sizes.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
    if self.num_stages is not None and self.num_stages < 1:
      raise ValueError(f"{where}: block_sizes.num_stages must be >= 1, got {self.num_stages}")
    for name, value, choices in (("split_merge", self.split_merge, SPLIT_MERGES),
                                 ("query_pack", self.query_pack, QUERY_PACKS)):
      if value is not None:
        validation.check_choice(where, f"block_sizes.{name}", value, choices)
    if self.block_rows is not None and (self.block_rows < 16
                                        or self.block_rows & (self.block_rows - 1)):
      raise ValueError(f"{where}: block_sizes.block_rows must be a power of two >= 16 (Triton dot), "
                       f"got {self.block_rows}")


def _next_pow2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def _floor_pow2(n: int) -> int:
  return 1 << (max(1, int(n)).bit_length() - 1)


# ---------------------------------------------------------------------------------------------------
# (2) Kernel
# ---------------------------------------------------------------------------------------------------


def _decode_kernel(*refs, block_k: int, num_splits: int, num_row_blocks: int, rows: int,
                   head_dim: int, causal: bool, window: int | None, softcap: float | None,
                   scale: float, dense_k_pos: bool, quantized: bool, pooled: bool,
                   pool_rows: int, compute_dtype, packed_in_kernel: tuple | None = None):
  """One (batch b, kv head h and row block, split n) program.

  Refs (leading block dims squeezed by the BlockSpecs):
    bounds [4] int32: lo, hi (index range of S that may hold visible keys), kmin, kmax (positions a
      visible key can have, kmin >= 0 so that it also rejects empty slots)
    qpos [Rb] int32, q [Rb, Dp] (Rb = block_rows of the R packed rows); kpos [S] int32 (absent when
    k_pos is the default arange); kv_rows [S] int32 (pooled only); k, v [S, D], or the pool's
    [R_pool, D] when pooled; k_scale, v_scale [S] (or [R_pool]) float32 or bfloat16 (int8 only)
    outputs: o [Rb, Dp] float32 (normalised within the split), lse [Rb] float32 (natural log)
  ``rows`` = T*G, the packed rows that are real (the rest pad R to a power of two).
  ``packed_in_kernel`` = (Rb, Dp, G): qpos is then q_pos [T] and q is q [T, H, D] of the batch row,
  and the program gathers its Rb packed rows itself (padding rows and columns read as 0).
  """
  it = iter(refs)
  bounds_ref, qpos_ref, q_ref = next(it), next(it), next(it)
  kpos_ref = None if dense_k_pos else next(it)
  rows_ref = next(it) if pooled else None
  k_ref, v_ref = next(it), next(it)
  ks_ref, vs_ref = (next(it), next(it)) if quantized else (None, None)
  o_ref, lse_ref = next(it), next(it)

  if packed_in_kernel is None:
    r_pad, d_pad = q_ref.shape
    q = q_ref[...]
    qpos = qpos_ref[...]
  else:
    r_pad, d_pad, group = packed_in_kernel
    j = pl.program_id(1)
    row = (j % num_row_blocks) * r_pad + lax.broadcasted_iota(jnp.int32, (r_pad,), 0)
    row_ok = row < rows
    t_idx = jnp.where(row_ok, row // group, 0)  # row r = t*G + g reads query head kv*G + g of t
    h_idx = (j // num_row_blocks) * group + row % group
    tile = (r_pad, d_pad)
    cols = lax.broadcasted_iota(jnp.int32, tile, 1)
    q_ok = row_ok[:, None] & (cols < head_dim)
    q = plgpu.load(q_ref.at[jnp.broadcast_to(t_idx[:, None], tile),
                            jnp.broadcast_to(jnp.where(row_ok, h_idx, 0)[:, None], tile),
                            jnp.minimum(cols, head_dim - 1)],
                   mask=q_ok, other=0).astype(compute_dtype)
    qpos = plgpu.load(qpos_ref.at[t_idx], mask=row_ok, other=0)
  lo, hi, kmin, kmax = bounds_ref[0], bounds_ref[1], bounds_ref[2], bounds_ref[3]
  # The N splits partition [lo, hi) in chunks that are whole blocks, so only the last block of the
  # last non-empty split is partial. hi - lo >= 0 is guaranteed by the wrapper.
  chunk = ((hi - lo + num_splits - 1) // num_splits + block_k - 1) // block_k * block_k
  start = lo + pl.program_id(2) * chunk
  stop = jnp.minimum(start + chunk, hi)
  num_blocks = (jnp.maximum(stop - start, 0) + block_k - 1) // block_k

  # float32 caches: full-precision dots. Triton's default for a float32 dot is TF32, which misses
  # the float32 tolerance by ~1e-3 (seen on the H200 in tests/attention_test.py).
  precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
  # Head dims that are not powers of two: load Dp columns, fetch only the first D.
  d_ok = None
  if d_pad != head_dim:
    d_ok = lax.broadcasted_iota(jnp.int32, (1, d_pad), 1) < head_dim

  def body(i, carry):
    acc, m_prev, l_prev = carry
    s0 = start + i * block_k
    idx = s0 + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    in_chunk = idx < stop
    if dense_k_pos:
      kpos = idx
    else:
      kpos = plgpu.load(kpos_ref.at[pl.ds(s0, block_k)], mask=in_chunk, other=-1)
    # Keys some row may see (kmin >= 0, so empty slots are out too).
    col = in_chunk & (kpos >= kmin) & (kpos <= kmax)
    # Load masks must not depend on the k_pos load: Triton then puts K/V one pipeline stage behind it
    # with a single buffer (seen in the sm_90 TTGIR), halving the bytes in flight. So with explicit
    # k_pos only the chunk bounds mask the loads ([lo, hi) already skipped the unseen ranges), and
    # NaN in empty slots is neutralised after the load: in K by the -inf mask on the logits, in V by
    # a select (p = 0 there, but 0 * NaN = NaN in the dot).
    load_ok = col if dense_k_pos else in_chunk
    if pooled:
      # The K/V addresses depend on this load anyway, so masking padding rows out of the K/V loads
      # adds no pipeline dependency. (With explicit k_pos the wrapper made padding keys empty slots
      # too, so col already rejects them.) Rows >= R_pool (device tables are not range-checked)
      # read the last row, as a jnp gather clamps: never memory outside the pool.
      rows = plgpu.load(rows_ref.at[pl.ds(s0, block_k)], mask=in_chunk, other=-1)
      row_ok = rows >= 0
      col = col & row_ok
      load_ok = load_ok & row_ok
      rows = jnp.clip(rows, 0, pool_rows - 1)
    kv_mask = load_ok[:, None] if d_ok is None else load_ok[:, None] & d_ok
    kv_cols = pl.ds(0, d_pad)

    def load_kv(ref):
      if not pooled:
        return plgpu.load(ref.at[pl.ds(s0, block_k), kv_cols], mask=kv_mask, other=0)
      # A gather: both indices are int arrays of the tile's shape (the interpreter's load takes
      # all-array or all-slice indices, not a mix; Triton lowers either to one pointer tensor).
      tile = (block_k, d_pad)
      row_idx = jnp.broadcast_to(rows[:, None], tile)
      col_idx = lax.broadcasted_iota(jnp.int32, tile, 1)
      return plgpu.load(ref.at[row_idx, col_idx], mask=jnp.broadcast_to(kv_mask, tile), other=0)

    def load_scale(ref):
      return plgpu.load(ref.at[rows if pooled else pl.ds(s0, block_k)], mask=load_ok,
                        other=0.0).astype(jnp.float32)  # bfloat16 scales widen here

    k = load_kv(k_ref)
    s = lax.dot_general(q, k.astype(compute_dtype), (((1,), (1,)), ((), ())),
                        precision=precision, preferred_element_type=jnp.float32)  # [R, block_k]
    if quantized:  # int8 K: dequantise the logits column-wise, one multiply per key, not per element.
      ks = load_scale(ks_ref)
      s = s * (ks * scale)[None, :]
    else:
      s = s * scale
    if softcap is not None:
      s = softcap * jnp.tanh(s / softcap)
    vis = col[None, :]
    if causal:
      vis = vis & (kpos[None, :] <= qpos[:, None])
    if window is not None:
      vis = vis & (qpos[:, None] - kpos[None, :] < window)
    s = jnp.where(vis, s, -jnp.inf)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
    # A row that has seen nothing yet keeps m = -inf; shift by 0 then so exp gives 0, not NaN.
    m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_shift[:, None])
    alpha = jnp.exp(m_prev - m_shift)
    l_new = alpha * l_prev + jnp.sum(p, axis=1)
    v = load_kv(v_ref)
    if not dense_k_pos:
      v = jnp.where(col[:, None], v, jnp.zeros_like(v))
    if quantized:  # int8 V: fold the per-key scale into p before the dot.
      vs = load_scale(vs_ref)
      p = p * jnp.where(col, vs, 0.0)[None, :]
    pv = lax.dot_general(p.astype(compute_dtype), v.astype(compute_dtype), (((1,), (0,)), ((), ())),
                         precision=precision, preferred_element_type=jnp.float32)  # [R, Dp]
    return acc * alpha[:, None] + pv, m_new, l_new

  init = (jnp.zeros((r_pad, d_pad), jnp.float32), jnp.full((r_pad,), -jnp.inf, jnp.float32),
          jnp.zeros((r_pad,), jnp.float32))
  acc, m, l = lax.fori_loop(0, num_blocks, body, init)
  # l != 0, not l > 0: a NaN the row read makes l NaN and must reach o and lse (docs/DESIGN.md §3).
  seen = l != 0
  l_safe = jnp.where(seen, l, 1.0)
  o = acc / l_safe[:, None]
  lse = jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)
  if rows == r_pad * num_row_blocks:
    o_ref[...] = o
    lse_ref[...] = lse
  else:  # padded rows are discarded by the wrapper; do not spend write bandwidth on them.
    first_row = (pl.program_id(1) % num_row_blocks) * r_pad
    row_ok = first_row + lax.broadcasted_iota(jnp.int32, (r_pad,), 0) < rows
    plgpu.store(o_ref, o, mask=jnp.broadcast_to(row_ok[:, None], (r_pad, d_pad)))
    plgpu.store(lse_ref, lse, mask=row_ok)


# The merge kernel's tiling. Splits per step of its loop: up to 128, so the split counts the
# defaults choose (N = ceil(2 x 132 / (B*K)): 33 at B=1 K=8; only B*K = 1 or 2 goes past 128) are
# one masked load of the partials and no loop-carried latency; Nsight Compute timed the first version, 32 splits a step and one program a
# row, at 6.8 us for N=33 (two dependent loads; benchmarks/results/beyond_hbm/session11/f/); this
# one at 3.6 us (session12/b/).
_MERGE_CHUNK = 128
# Columns of o per merge program: a row's Dp columns are shared by Dp / 32 programs (each recomputes
# the row's N weights, which are tiny), so B*K*rows*Dp/32 programs (128 at B=1 H=32 D=128) keep
# more loads in flight than B*K*rows (32), and the [chunk, 32] float32 tile is 32 registers a thread.
_MERGE_COLS = 32


def _merge_kernel(lse_ref, o_ref, o_out_ref, lse_out_ref, *, num_splits: int, chunk: int):
  """One (batch b, kv head, packed row, column block) program of the split merge
  (``split_merge="kernel"``).

  Refs: lse [N] and o [N, Dc] float32, the N splits' partials of this row (Dc of its columns);
  outputs o [Dc] (q's dtype) and lse [1] float32 (every column block of a row writes the same
  value). An online LSE merge over chunks of ``chunk`` splits (masked past N), with
  ``_merge_splits_chain``'s rules: a split with lse = -inf adds nothing, all -inf gives o = 0 and
  lse = -inf, and a NaN lse or o (a split that read a NaN) makes the row NaN."""
  cols = o_ref.shape[-1]

  def body(c, carry):
    m, den, acc = carry
    idx = c * chunk + lax.broadcasted_iota(jnp.int32, (chunk,), 0)
    ok = idx < num_splits
    lse_c = plgpu.load(lse_ref.at[pl.ds(c * chunk, chunk)], mask=ok, other=-jnp.inf)
    o_c = plgpu.load(o_ref.at[pl.ds(c * chunk, chunk), pl.ds(0, cols)],
                     mask=jnp.broadcast_to(ok[:, None], (chunk, cols)), other=0.0)
    m_new = jnp.maximum(m, jnp.max(lse_c))
    ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # all -inf so far: weights exp(-inf) = 0
    alpha = jnp.exp(m - ref)
    w = jnp.exp(lse_c - ref)
    den = den * alpha + jnp.sum(w)
    acc = acc * alpha + jnp.sum(w[:, None] * o_c, axis=0)
    return m_new, den, acc

  init = (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.zeros((cols,), jnp.float32))
  m, den, acc = lax.fori_loop(0, -(-num_splits // chunk), body, init)
  seen = den != 0  # != 0, not > 0: a NaN den must reach o and lse
  den_safe = jnp.where(seen, den, 1.0)
  o_out_ref[...] = (acc / den_safe).astype(o_out_ref.dtype)
  lse = jnp.where(seen, m + jnp.log(den_safe), -jnp.inf)
  lse_out_ref[...] = jnp.full((1,), lse, jnp.float32)


# ---------------------------------------------------------------------------------------------------
# (3) Jitted wrappers
# ---------------------------------------------------------------------------------------------------

_STATIC = ("causal", "window", "softcap", "scale", "block_sizes", "interpret")


def _compute_dtype(q_dtype, kv_dtype):
  """dtype of the dot operands: the cache's own float type (q is cast to it, so bf16/f16 caches run on
  the tensor cores at full rate); for int8, q's dtype (every int8 value is exact in bf16/f16/f32)."""
  if jnp.dtype(kv_dtype) == jnp.dtype(jnp.int8):
    return jnp.dtype(q_dtype)
  return jnp.dtype(kv_dtype)


def _query_bounds(qmin, qmax, fill, *, causal: bool, window: int | None, dense_k_pos: bool):
  """(lo, hi, kmin, kmax) [B] from the queries' position range [qmin, qmax] and ``fill`` (keys at
  indices >= fill are empty), without reading k_pos: exact index bounds when positions are the
  indices (``dense_k_pos``), else [0, fill) with kmin/kmax to reject by position (only used with no
  window: a window over explicit positions needs ``_key_bounds``' k_pos reduction to skip keys)."""
  zero = qmin * 0
  kmax = qmax if causal else zero + _INT32_MAX
  if window is None:
    kmin = zero
  else:  # q - k < window  <=>  k >= q - window + 1; written so that it cannot underflow int32.
    kmin = jnp.where(qmin > window - 1, qmin - (window - 1), 0)
  if dense_k_pos:
    lo = kmin
    hi = jnp.where(kmax < 0, 0, jnp.minimum(kmax, fill - 1) + 1)
  else:
    lo, hi = zero, zero + fill
  lo = jnp.minimum(lo, fill)
  hi = jnp.maximum(hi, lo)
  return lo // 16 * 16, hi, kmin, kmax  # aligned block starts; [kmin, kmax] rejects the extra keys


def _key_bounds(q_pos, k_pos, kv_len: int, kv_fill=None, *, causal: bool, window: int | None):
  """[B, 4] int32 (lo, hi, kmin, kmax): keys at indices outside [lo, hi), or with positions outside
  [kmin, kmax], are invisible to every query of the batch row. ``kv_fill`` ([1] or [B] int32, or
  None): keys at indices >= kv_fill are empty. Costs O(B*T) (one small fusion) when k_pos is the
  default arange, or when kv_fill is given and there is no window; else a min/max reduction over
  k_pos [B, S] (4 bytes a key, <1% of the K/V bytes, but three launches: Nsight Compute timed them
  at ~11 us a call at 128K keys against ~3 for the small fusion, benchmarks/results/beyond_hbm/
  session12/b/)."""
  qmin = jnp.min(q_pos, axis=1)
  qmax = jnp.max(q_pos, axis=1)
  fill = (jnp.full_like(qmin, kv_len) if kv_fill is None
          else jnp.broadcast_to(jnp.clip(kv_fill, 0, kv_len), qmin.shape))
  if k_pos is None or (kv_fill is not None and window is None):
    lo, hi, kmin, kmax = _query_bounds(qmin, qmax, fill, causal=causal, window=window,
                                       dense_k_pos=k_pos is None)
  else:
    _, _, kmin, kmax = _query_bounds(qmin, qmax, fill, causal=causal, window=window,
                                     dense_k_pos=False)
    idx = lax.broadcasted_iota(jnp.int32, k_pos.shape, 1)
    cand = (k_pos >= kmin[:, None]) & (k_pos <= kmax[:, None]) & (idx < fill[:, None])
    # No candidate: an empty range at the fill, so that the 16-aligned start below reaches back
    # only over keys that are not candidates by position (never over filled-out slots).
    lo = jnp.min(jnp.where(cand, idx, fill[:, None]), axis=1)
    hi = jnp.maximum(jnp.max(jnp.where(cand, idx + 1, 0), axis=1), lo)
    lo = lo // 16 * 16
  return jnp.stack([lo, hi, kmin, kmax], axis=1).astype(jnp.int32)


def _packed_partials(q, k, v, q_pos, k_pos, k_scale, v_scale, kv_rows=None, kv_fill=None, *,
                     causal, window, softcap, scale, block_sizes: BlockSizes, interpret: bool):
  """Runs the kernel. Returns o [B, N, K, R, Dp] float32 and lse [B, N, K, R] float32 (packed rows).

  With ``kv_rows`` [B,S], k/v are a pool [R_pool,K,D] (k_scale/v_scale [R_pool,K]). ``kv_fill``
  [1] or [B] int32 (or None): keys at indices >= kv_fill[b] are empty slots, never read."""
  b, t, h, d = q.shape
  pooled = kv_rows is not None
  s, kh = (kv_rows.shape[1], k.shape[1]) if pooled else (k.shape[1], k.shape[2])
  if pooled and k_pos is not None:
    # Padding keys become empty slots, so that the [lo, hi) bounds skip them too.
    k_pos = jnp.where(kv_rows < 0, -1, k_pos)
  g = h // kh
  rows = t * g
  r_pad = max(16, _next_pow2(rows))
  d_pad = max(16, _next_pow2(d))
  cdt = _compute_dtype(q.dtype, k.dtype)
  quantized = jnp.dtype(k.dtype) == jnp.dtype(jnp.int8)
  bk, n, rb = block_sizes.block_k, block_sizes.num_splits, block_sizes.block_rows
  nrb = r_pad // rb  # row blocks; 1 unless R*Dp overflows the registers (see _MAX_ACC)
  if s == 0:  # an empty cache: every row sees nothing (and a zero-size block cannot be launched)
    return (jnp.zeros((b, n, kh, r_pad, d_pad), jnp.float32),
            jnp.full((b, n, kh, r_pad), -jnp.inf, jnp.float32))

  # In the wrapper, not the kernel: deriving them in each program from q_pos and kv_fill saved
  # the launch but made the kernel 5% slower at 128K keys (152 registers against 128; Nsight
  # Compute, benchmarks/results/beyond_hbm/session12/b/).
  operands = [_key_bounds(q_pos, k_pos, s, kv_fill, causal=causal, window=window)]
  in_specs = [pl.BlockSpec((None, 4), lambda i, j, n_: (i, 0))]
  # Grid axis 1 is kv head * row block, row blocks of one head adjacent so that they read the same
  # K/V at about the same time (L2 hits). Axis 0 (B) is the fastest-launched.
  in_kernel = block_sizes.query_pack == "kernel"
  if in_kernel:  # each program gathers its packed rows from q and q_pos (see _decode_kernel)
    operands += [q_pos, q]
    in_specs += [pl.BlockSpec((None, t), lambda i, j, n_: (i, 0)),
                 pl.BlockSpec((None, t, h, d), lambda i, j, n_: (i, 0, 0, 0))]
  else:
    # Pack the G*T rows of each kv head (row r = t*G + g); q is tiny, so this copy is cheap (but
    # two XLA launches: see BlockSizes.query_pack).
    qp = q.reshape(b, t, kh, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kh, rows, d).astype(cdt)
    qp = jnp.pad(qp, ((0, 0), (0, 0), (0, r_pad - rows), (0, d_pad - d)))
    qpos_rows = jnp.pad(jnp.repeat(q_pos, g, axis=1), ((0, 0), (0, r_pad - rows)))
    operands += [qpos_rows, qp]
    in_specs += [pl.BlockSpec((None, rb), lambda i, j, n_: (i, j % nrb)),
                 pl.BlockSpec((None, None, rb, d_pad), lambda i, j, n_: (i, j // nrb, j % nrb, 0))]
  if k_pos is not None:
    operands.append(k_pos)
    in_specs.append(pl.BlockSpec((None, s), lambda i, j, n_: (i, 0)))
  if pooled:
    # Every program sees the whole pool of its kv head; its sequence's row table picks the rows.
    operands.append(kv_rows)
    in_specs.append(pl.BlockSpec((None, s), lambda i, j, n_: (i, 0)))
    r_pool = k.shape[0]
    kv_spec = pl.BlockSpec((r_pool, None, d), lambda i, j, n_: (0, j // nrb, 0))
    scale_spec = pl.BlockSpec((r_pool, None), lambda i, j, n_: (0, j // nrb))
  else:
    r_pool = 0
    kv_spec = pl.BlockSpec((None, s, None, d), lambda i, j, n_: (i, 0, j // nrb, 0))
    scale_spec = pl.BlockSpec((None, s, None), lambda i, j, n_: (i, 0, j // nrb))
  operands += [k, v]
  in_specs += [kv_spec, kv_spec]
  if quantized:
    # As they are (bfloat16 too): a cast here was an XLA pass over every scale of the window.
    operands += [validation.scale_operand(k_scale), validation.scale_operand(v_scale)]
    in_specs += [scale_spec] * 2

  kernel = functools.partial(
      _decode_kernel, block_k=bk, num_splits=n, num_row_blocks=nrb, rows=rows, head_dim=d,
      causal=causal, window=window, softcap=softcap, scale=scale, dense_k_pos=k_pos is None,
      quantized=quantized, pooled=pooled, pool_rows=r_pool, compute_dtype=cdt,
      packed_in_kernel=(rb, d_pad, g) if in_kernel else None)
  return pl.pallas_call(
      kernel,
      grid=(b, kh * nrb, n),
      in_specs=in_specs,
      out_specs=[pl.BlockSpec((None, None, None, rb, d_pad),
                              lambda i, j, n_: (i, n_, j // nrb, j % nrb, 0)),
                 pl.BlockSpec((None, None, None, rb), lambda i, j, n_: (i, n_, j // nrb, j % nrb))],
      out_shape=[jax.ShapeDtypeStruct((b, n, kh, r_pad, d_pad), jnp.float32),
                 jax.ShapeDtypeStruct((b, n, kh, r_pad), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=block_sizes.num_warps,
                                           num_stages=block_sizes.num_stages),
      interpret=interpret,
      name="rkv_decode_attention",
  )(*operands)


def _unpack(x, t: int, g: int, d: int | None):
  """[..., K, R, Dp] (or [..., K, R]) packed rows -> [..., T, H, D] (or [..., T, H]), h = k*G + g."""
  kh = x.shape[-3] if d is not None else x.shape[-2]
  lead = x.shape[:-3] if d is not None else x.shape[:-2]
  nl = len(lead)
  if d is not None:
    x = x[..., : t * g, :d].reshape(*lead, kh, t, g, d)
    x = jnp.moveaxis(x, nl, nl + 1)  # [..., T, K, G, D]
    return x.reshape(*lead, t, kh * g, d)
  x = x[..., : t * g].reshape(*lead, kh, t, g)
  x = jnp.moveaxis(x, nl, nl + 1)
  return x.reshape(*lead, t, kh * g)


def _merge_splits(o_parts, lse_parts, axis: int):
  """Exact LSE-weighted merge over ``axis``; all -inf gives lse=-inf and o=0; a NaN split (it
  read a NaN) gives NaN, as rkv.attention.merge_partials."""
  mx = jnp.max(lse_parts, axis=axis, keepdims=True)
  mx = jnp.where(mx == -jnp.inf, 0.0, mx)  # only -inf means "no key": NaN must go through
  w = jnp.exp(lse_parts - mx)  # 0 for splits that saw no key
  den = jnp.sum(w, axis=axis)
  seen = den != 0
  o = jnp.sum(w[..., None] * o_parts, axis=axis) / jnp.where(seen, den, 1.0)[..., None]
  lse = jnp.where(seen, jnp.squeeze(mx, axis) + jnp.log(jnp.where(seen, den, 1.0)), -jnp.inf)
  return o, lse


def _merge_splits_chain(o_parts, lse_parts, axis: int):
  """:func:`_merge_splits` as an online merge, split by split (N is static and small): only
  elementwise ops on slices, so XLA can fuse it into one or two kernels instead of a reduction
  chain. Same results to float32 rounding, same empty-row and NaN rules: a split with lse = -inf
  adds nothing, all -inf gives lse = -inf and o = 0, a NaN lse or o gives NaN."""
  take = lambda x, i: lax.index_in_dim(x, i, axis, keepdims=False)
  m = take(lse_parts, 0)
  den = jnp.where(m == -jnp.inf, 0.0, 1.0)
  acc = den[..., None] * take(o_parts, 0)
  for i in range(1, lse_parts.shape[axis]):
    li = take(lse_parts, i)
    m_new = jnp.maximum(m, li)
    ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # both -inf: weights exp(-inf) = 0, no NaN
    a, b = jnp.exp(m - ref), jnp.exp(li - ref)
    den = den * a + b
    acc = acc * a[..., None] + b[..., None] * take(o_parts, i)
    m = m_new
  seen = den != 0
  o = acc / jnp.where(seen, den, 1.0)[..., None]
  lse = jnp.where(seen, m + jnp.log(jnp.where(seen, den, 1.0)), -jnp.inf)
  return o, lse


def _merge_call(o_p, lse_p, *, rows: int, out_dtype, interpret: bool):
  """The split merge as one Pallas kernel: o_p [B, N, K, R, Dp], lse_p [B, N, K, R] float32
  (``_packed_partials``) -> o [B, K, rows, Dp] in ``out_dtype``, lse [B, K, rows] float32. Only
  the ``rows`` real packed rows are merged (the kernel leaves padding rows unwritten). Grid
  (B, K, rows x column blocks): see ``_MERGE_COLS``."""
  b, n, kh, _, d_pad = o_p.shape
  chunk = min(_MERGE_CHUNK, _next_pow2(n))
  cols = min(_MERGE_COLS, d_pad)
  nc = d_pad // cols  # Dp and cols are powers of two
  o, lse = pl.pallas_call(
      functools.partial(_merge_kernel, num_splits=n, chunk=chunk),
      grid=(b, kh, rows * nc),
      in_specs=[pl.BlockSpec((None, n, None, None), lambda i, j, r: (i, 0, j, r // nc)),
                pl.BlockSpec((None, n, None, None, cols),
                             lambda i, j, r: (i, 0, j, r // nc, r % nc))],
      out_specs=[pl.BlockSpec((None, None, None, cols), lambda i, j, r: (i, j, r // nc, r % nc)),
                 pl.BlockSpec((None, None, None, 1), lambda i, j, r: (i, j, r // nc, 0))],
      out_shape=[jax.ShapeDtypeStruct((b, kh, rows, d_pad), out_dtype),
                 jax.ShapeDtypeStruct((b, kh, rows, 1), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="rkv_decode_merge",
  )(lse_p, o_p)
  return o, lse[..., 0]


@functools.partial(jax.jit, static_argnames=_STATIC)
def _decode_attention_jit(q, k, v, q_pos, k_pos, k_scale, v_scale, kv_rows=None, kv_fill=None, *,
                          causal, window, softcap, scale, block_sizes, interpret):
  t, h, d = q.shape[1:]
  g = h // k.shape[-2]  # [B,S,K,D] or a pool [R_pool,K,D]
  o_p, lse_p = _packed_partials(q, k, v, q_pos, k_pos, k_scale, v_scale, kv_rows, kv_fill,
                                causal=causal,
                                window=window, softcap=softcap, scale=scale,
                                block_sizes=block_sizes, interpret=interpret)
  rows = t * g
  if block_sizes.split_merge == "kernel":
    o, lse = _merge_call(o_p, lse_p, rows=rows, out_dtype=q.dtype, interpret=interpret)
    return _unpack(o[..., :d], t, g, d), _unpack(lse, t, g, None)
  # Merge on the packed layout (drop padded rows/columns first: the slices fuse into the merge).
  merge = _merge_splits_chain if block_sizes.split_merge == "chain" else _merge_splits
  o, lse = merge(o_p[..., :rows, :d], lse_p[..., :rows], axis=1)  # [B, K, rows, D], [B, K, rows]
  return _unpack(o, t, g, d).astype(q.dtype), _unpack(lse, t, g, None)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _decode_partials_jit(q, k, v, q_pos, k_pos, k_scale, v_scale, kv_rows=None, kv_fill=None, *,
                         causal, window, softcap, scale, block_sizes, interpret):
  t, h, d = q.shape[1:]
  g = h // k.shape[-2]
  o_p, lse_p = _packed_partials(q, k, v, q_pos, k_pos, k_scale, v_scale, kv_rows, kv_fill,
                                causal=causal,
                                window=window, softcap=softcap, scale=scale,
                                block_sizes=block_sizes, interpret=interpret)
  o_p = jnp.moveaxis(_unpack(o_p, t, g, d), 1, 0)  # [N, B, T, H, D]
  lse_p = jnp.moveaxis(_unpack(lse_p, t, g, None), 1, 0)  # [N, B, T, H]
  return o_p, lse_p


def _prepare(where, q, k, v, kv_rows, q_pos, k_pos, k_scale, v_scale, causal, window, softcap,
             scale, block_sizes, interpret, kv_fill=None):
  args = validation.attention_args(q, k, v, q_pos=q_pos, k_pos=k_pos, k_scale=k_scale,
                                   v_scale=v_scale, window=window, softcap=softcap, scale=scale,
                                   causal=causal, kv_rows=kv_rows, where=where)
  if args.q_len > MAX_QUERY_LEN:
    raise ValueError(f"{where}: q must have T <= {MAX_QUERY_LEN} query tokens (decode), got shape "
                     f"{tuple(q.shape)}; use flash attention for longer queries")
  if block_sizes is None:
    block_sizes = BlockSizes()
  elif not isinstance(block_sizes, BlockSizes):
    raise ValueError(f"{where}: block_sizes must be a BlockSizes or None, got {type(block_sizes)}")
  block_sizes.check(where)
  r_pad = max(16, _next_pow2(args.q_len * args.group))
  block_sizes = block_sizes.resolve(
      batch=args.batch, kv_heads=args.num_kv_heads, kv_len=args.kv_len, rows=r_pad,
      head_dim=max(16, _next_pow2(args.head_dim)), kv_itemsize=jnp.dtype(k.dtype).itemsize)
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  kv_fill = validation.kv_fill_arg(where, kv_fill, batch=args.batch, kv_len=args.kv_len)
  operands = (q, k, v, args.q_pos, None if k_pos is None else args.k_pos, k_scale, v_scale,
              args.kv_rows, kv_fill)
  static = dict(causal=bool(causal), window=None if window is None else int(window),
                softcap=None if softcap is None else float(softcap), scale=args.scale,
                block_sizes=block_sizes, interpret=bool(interpret))
  return operands, static


def decode_attention(q, k, v, *, kv_rows=None, q_pos=None, k_pos=None, k_scale=None, v_scale=None,
                     causal=True, window=None, softcap=None, scale=None, kv_fill=None,
                     block_sizes: BlockSizes | None = None,
                     interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """Exact attention of T <= 16 query tokens over S keys, split along S across the GPU.

  q [B,T,H,D]; k, v [B,S,K,D] (bf16, f16, f32, or int8 with k_scale/v_scale [B,S,K] float32 or
  bfloat16);
  q_pos [B,T], k_pos [B,S] int32 (defaults: k_pos = arange(S), q_pos = S - T + arange(T); k_pos < 0
  marks an empty slot whose K/V may be NaN). Returns o [B,T,H,D] in q's dtype and lse [B,T,H] float32,
  natural log; a row that sees no key gets o = 0, lse = -inf. ``interpret=None`` interprets on CPU.

  Leave ``k_pos=None`` when positions are the indices: the kernel then derives them from the index
  (no k_pos read, no [B,S] reduction in the wrapper, loads masked by visibility, fewer registers).

  A pool: with ``kv_rows [B,S]`` int32, k/v are ``[R_pool,K,D]`` (scales ``[R_pool,K]``) and key j
  of sequence b is row ``kv_rows[b, j]``; negative rows are padding (empty slots, never fetched).
  The kernel gather-loads the rows in place; the result equals the dense call on the gathered rows.

  ``kv_fill`` (int scalar or ``[B]``): keys at indices >= kv_fill[b] are empty slots whatever
  ``k_pos`` says (never read; their K/V may be NaN), as a cache filled from index 0 knows. With no
  window the keys are then bounded from the query positions alone, with no reduction over
  ``k_pos`` before the kernel (Nsight Compute: two fewer launches, ~8 us less a call at 128K keys).
  """
  operands, static = _prepare("decode_attention", q, k, v, kv_rows, q_pos, k_pos, k_scale,
                              v_scale, causal, window, softcap, scale, block_sizes, interpret,
                              kv_fill)
  return _decode_attention_jit(*operands, **static)


def decode_attention_partials(q, k, v, *, kv_rows=None, q_pos=None, k_pos=None, k_scale=None,
                              v_scale=None, causal=True, window=None, softcap=None, scale=None,
                              kv_fill=None, block_sizes: BlockSizes | None = None,
                              interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """The unmerged per-split results of :func:`decode_attention`, for callers that merge them with
  other partials (e.g. a streamed host tail) themselves.

  Returns o [N,B,T,H,D] float32 (each split normalised on its own) and lse [N,B,T,H] float32 natural
  log (-inf, with o = 0, where a split saw no key for that row). Split n covers a contiguous index
  range of S that depends on the data (the splits partition the range that may hold visible keys);
  merging all N with the LSE-weighted sum (``rkv.attention.merge_partials``) gives exactly
  :func:`decode_attention`.
  """
  operands, static = _prepare("decode_attention_partials", q, k, v, kv_rows, q_pos, k_pos, k_scale,
                              v_scale, causal, window, softcap, scale, block_sizes, interpret,
                              kv_fill)
  return _decode_partials_jit(*operands, **static)


# ---------------------------------------------------------------------------------------------------
# (4) Reference
# ---------------------------------------------------------------------------------------------------


def decode_attention_reference(q, k, v, *, kv_rows=None, q_pos=None, k_pos=None, k_scale=None,
                               v_scale=None, causal=True, window=None, softcap=None,
                               scale=None, kv_fill=None) -> tuple[jax.Array, jax.Array]:
  """Plain-jnp float32 attention with the full [B,T,S] mask; same contract as decode_attention.

  The one reference of the package (``rkv.attention.attention_reference``) under this file's name.
  """
  from rkv.attention import attention_reference  # lazy: rkv.attention dispatches to this module
  where = "decode_attention_reference"
  args = validation.attention_args(q, k, v, q_pos=q_pos, k_pos=k_pos, k_scale=k_scale,
                                   v_scale=v_scale, window=window, softcap=softcap, scale=scale,
                                   kv_rows=kv_rows, where=where)
  kv_fill = validation.kv_fill_arg(where, kv_fill, batch=args.batch, kv_len=args.kv_len)
  if kv_fill is not None:
    k_pos = validation.fill_positions(k_pos, kv_fill, batch=args.batch, kv_len=args.kv_len)
  return attention_reference(q, k, v, kv_rows=kv_rows, q_pos=q_pos, k_pos=k_pos, k_scale=k_scale,
                             v_scale=v_scale, causal=causal, window=window, softcap=softcap,
                             scale=scale)
