/* rkv CPU-tail decode attention: exact (o, lse) over KV cells that live in host memory.
 *
 * The "cpu" tactic (docs/DESIGN.md §4) attends to the pinned-host tail where it lives: only the query
 * goes down to the host and the small partial (o [B,T,H,D], lse [B,T,H]) comes back to be merged
 * on the GPU. The cost is Bt / CPU_attn_bw, so this kernel is written to stream K/V at a large
 * fraction of host memory bandwidth (jnp on the host measured 1.8 GB/s, docs/DESIGN.md §7).
 *
 * Layout. K/V cells are addressed as N tiles of `tile` cells, each tile given by its own base
 * pointer (a table), with strides shared by all tiles: cell s of batch row b, KV head h is at
 *   tiles[s / tile] + b * st[0] + (s % tile) * st[1] + h * st[2]   (elements; head dim contiguous).
 * The cache's tail (a tuple of per-tile [B,tile,K,D] pinned_host arrays), a stacked
 * [N,B,tile,K,D] array and a flat [B,S,K,D] one (N = 1) are all such tables, so the tail is read
 * in place, never copied. Positions and int8 scales come as tile tables the same way.
 *
 * Work split. A work item is (batch row b, chunk of cells, all K heads): the chunk's cells are
 * contiguous memory (a cell holds all heads), so each core streams its own region and no cache
 * line is fetched for another core. Within an item, cells go in blocks of RKV_BLOCK (32); per
 * block and KV head, the head's 32 K rows serve all G*T query rows of that head (GQA reuse: every
 * K/V byte comes from memory once; the later rows hit L1), then the same for V. The next block is
 * software-prefetched into L2 (prefetcht1) in memory order (cell by cell: its K rows of all
 * heads, then its V rows), a 1/K share spread over each head's compute; prefetching only the
 * same head's rows of the next block (256-byte pieces at a 2 KiB stride) into L1 streamed at
 * 8.6 GB/s where this streams at 13.5 GB/s (dev box, one thread, hot case). Items run under an OpenMP
 * dynamic schedule; each leaves an unnormalized partial (acc, m, l) per row, and a second phase
 * merges the partials of each (b, head) in chunk order with float64 LSE weights. The chunk size
 * depends only on the shapes (never on the thread count), so the result is bit-identical for any
 * number of threads.
 *
 * Arithmetic: float32 online softmax (natural log, like every rkv backend): logits of a block,
 * one rescale of the accumulators per block, then p @ V. A cell with k_pos < 0 is skipped before
 * its K/V bytes are touched, so NaN there cannot leak; a row that sees no key returns o = 0,
 * lse = -inf; a row that reads a NaN (q, or a visible K cell) returns NaN in o and lse, as every
 * rkv backend (masked cells are a select to -inf, so a NaN there is not "read"). int8 scales multiply the logit (k) and the weight (v), not the elements.
 *
 * Vectorization: AVX2 + FMA + F16C intrinsics when compiled for x86-64-v3; exp is a Cephes
 * polynomial. With D % 16 == 0 (the hot case: bf16, T=1, G=4, D=128) the register-blocked path:
 * K/V come 16 elements at a time (load16) and each converted chunk is FMAed into up to 4 query
 * rows at once (qk_rows: 2 cells x 4 rows = 8 FMA chains, one hadd tree per 2 cells; pv_rows: 4
 * rows x 16 columns = 8 accumulators), so a K/V element is converted once per 4 rows, not once per
 * row. bf16 needs no shuffle at all: one 256-bit load of 16 bf16, `x << 16` = the even elements and
 * `x & 0xffff0000` = the odd ones as float32; the query rows and the V accumulators of this path
 * are kept in that (even, odd) order per 16 columns (q permuted once per item, acc un-permuted on
 * output). f16 converts with vcvtph2ps, int8 sign-extends, both in natural order. Other head
 * dims take the older paths: 8-key dot products converted per row in registers (bf16:
 * zero-extend and shift), or, with many rows (G*T >= RKV_STAGE_ROWS), the head's rows of a block
 * converted once into an L1 float32 buffer. Other targets (aarch64 hosts) take portable C loops
 * that the compiler auto-vectorizes; the paths agree to float32 rounding, not bit for bit (each
 * path is deterministic, and which one runs depends on the shapes only).
 *
 * Measured on the H200 host (16 cores, the tactics' 15 threads, the pinned tail read in place;
 * experiments/tactics_bench.py): 78-86 GB/s, 0.81-0.89 of its measured read bandwidth
 * (benchmarks/results/tactics_bench_h200_run6.json; this file before the register-blocked path:
 * 40-51 GB/s, tactics_bench_h200.json). Dev-box design notes (2-core AMD EPYC Zen 4 VM, bf16,
 * T=1, H=32, K=8, D=128, B=1, 1 GiB of K+V, cpu_attention() timed directly, median; not a
 * committed benchmark): 1 thread 6.3 -> 13.5 GB/s, 2 threads 12.4 -> 26 GB/s, against a plain
 * read (rkv_read_sum) of ~30 GB/s. Per (cell, KV head), in TSC cycles: 205 -> 98 out of cache,
 * 138 -> 87 in cache (QK ~37, softmax ~10, p @ V ~36; the FMAs alone are ~45).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RKV_AVX2 1
#else
#define RKV_AVX2 0
#endif

#define RKV_ABI_VERSION 2
#define RKV_BLOCK 32           /* cells per online-softmax block (a multiple of 8) */
#define RKV_TARGET_ITEMS 256   /* work items wanted for dynamic load balance */
#define RKV_MIN_CHUNK 256      /* cells: below this, per-item overhead dominates */
#define RKV_PARTIAL_BYTES (64LL << 20) /* cap on the partials buffer */
#ifndef RKV_STAGE_ROWS
/* Head dims not a multiple of 16 only (the register-blocked path takes the rest): from this many
 * query rows per KV head (G*T), a head's K/V rows of a block are converted once into an
 * L1-resident float32 buffer; below it each row converts them in registers. Measured on the dev
 * box (in cache, bf16, D=128): at G*T = 4 direct was 115 vs 132 cycles per (cell, head), at 8
 * staged 184 vs 240, at 128 staged 2650 vs 4070. The register-blocked path, same box, in L3, TSC
 * cycles: 87 at G*T = 4 (old direct 138), 160 at 8 (staged 210), 620 at 32 (650), 2550 at 128
 * (2500). */
#define RKV_STAGE_ROWS 6
#endif

enum { RKV_F32 = 0, RKV_BF16 = 1, RKV_F16 = 2, RKV_I8 = 3 };

typedef struct {
  const float* q;               /* [B,T,H,D] contiguous float32, unscaled */
  const int32_t* q_pos;         /* [B,T] contiguous */
  const void* const* k_tiles;   /* [n_tiles] base of each tile's K [B,tile,K,D] */
  const void* const* v_tiles;
  const float* const* ks_tiles; /* int8 only, else NULL: each tile's k_scale [B,tile,K] */
  const float* const* vs_tiles;
  const int32_t* const* pos_tiles; /* each tile's k_pos [B,tile] */
  int64_t batch, q_len, num_heads, num_kv_heads, head_dim;
  int64_t n_tiles, tile;        /* S = n_tiles * tile */
  int64_t k_strides[3];         /* elements within a tile: batch, cell, kv head */
  int64_t v_strides[3];
  int64_t ks_strides[3];
  int64_t vs_strides[3];
  int64_t pos_strides[2];       /* batch, cell */
  int32_t dtype;
  int32_t causal;
  int64_t window;          /* <= 0: none */
  float softcap;           /* <= 0: none */
  float scale;
} rkv_attn_args;

#ifndef RKV_SOURCE_HASH
#define RKV_SOURCE_HASH "unknown"
#endif

int rkv_cpu_kernel_abi_version(void) { return RKV_ABI_VERSION; }
const char* rkv_cpu_kernel_source_hash(void) { return RKV_SOURCE_HASH; }
int rkv_cpu_kernel_has_avx2(void) { return RKV_AVX2; }
int rkv_cpu_kernel_max_threads(void) {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

/* ------------------------------------------------------------------------------------------ */
/* Element conversion                                                                          */
/* ------------------------------------------------------------------------------------------ */
static inline float bf16_to_f32(uint16_t h) {
  uint32_t w = (uint32_t)h << 16;
  float f;
  memcpy(&f, &w, 4);
  return f;
}

static inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, w;
  if (exp == 0x1fu) {
    w = sign | 0x7f800000u | (man << 13);              /* inf / nan */
  } else if (exp != 0) {
    w = sign | ((exp + 112u) << 23) | (man << 13);      /* normal */
  } else if (man == 0) {
    w = sign;                                           /* zero */
  } else {                                              /* subnormal: renormalize */
    exp = 113;
    while (!(man & 0x400u)) { man <<= 1; exp--; }
    w = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  memcpy(&f, &w, 4);
  return f;
}

#define RKV_INLINE static inline __attribute__((always_inline))

/* Element d of a row of the given dtype as float32. */
RKV_INLINE float load1(const char* p, int64_t d, const int dtype) {
  switch (dtype) {
    case RKV_F32: { float f; memcpy(&f, p + 4 * d, 4); return f; }
    case RKV_BF16: { uint16_t h; memcpy(&h, p + 2 * d, 2); return bf16_to_f32(h); }
    case RKV_F16: { uint16_t h; memcpy(&h, p + 2 * d, 2); return f16_to_f32(h); }
    default: return (float)(int8_t)p[d];
  }
}

/* ------------------------------------------------------------------------------------------ */
/* Vector helpers (AVX2 + FMA + F16C)                                                          */
/* ------------------------------------------------------------------------------------------ */
#if RKV_AVX2
/* Elements [d, d+8) of a row as float32, converted in registers. Converting into a float32
 * staging buffer instead cost ~2.5x in load bandwidth on the dev box (streaming loads and the
 * buffer's stores contend), so on the per-row path K/V rows are re-converted by each query row
 * that uses them (they sit in L1 by then); the register-blocked path converts once per 4 rows. */
RKV_INLINE __m256 load8(const char* p, int64_t d, const int dtype) {
  switch (dtype) {
    case RKV_F32: return _mm256_loadu_ps((const float*)p + d);
    case RKV_BF16:
      return _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)((const uint16_t*)p + d))), 16));
    case RKV_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)p + d)));
    default:
      return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + d))));
  }
}

/* The last n < 8 elements of a row, zero-padded: never reads past the row (D % 8 != 0). */
RKV_INLINE __m256 load8_tail(const char* p, int64_t d, int64_t n, const int dtype) {
  float tmp[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  for (int64_t x = 0; x < n; x++) tmp[x] = load1(p, d + x, dtype);
  return _mm256_loadu_ps(tmp);
}

/* exp for x <= 0 (Cephes expf polynomial, ~1 ulp; inputs below -87.3 give ~1e-38, not 0). */
static inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365478515625f));
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, z, x);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)),
                                23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline float hmax256(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* dot(q, k_j) for the 8 key rows kp[0..7]: 8 FMA chains, one hadd-tree reduction. */
RKV_INLINE __m256 dot8(const float* restrict q, const char* const* kp, int64_t D, const int dtype) {
  const char *k0 = kp[0], *k1 = kp[1], *k2 = kp[2], *k3 = kp[3], *k4 = kp[4], *k5 = kp[5],
             *k6 = kp[6], *k7 = kp[7];
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
         a7 = a0;
  const int64_t D8 = D & ~(int64_t)7;
  int64_t d = 0;
  for (; d < D8; d += 8) {
    const __m256 qv = _mm256_load_ps(q + d);
    a0 = _mm256_fmadd_ps(qv, load8(k0, d, dtype), a0);
    a1 = _mm256_fmadd_ps(qv, load8(k1, d, dtype), a1);
    a2 = _mm256_fmadd_ps(qv, load8(k2, d, dtype), a2);
    a3 = _mm256_fmadd_ps(qv, load8(k3, d, dtype), a3);
    a4 = _mm256_fmadd_ps(qv, load8(k4, d, dtype), a4);
    a5 = _mm256_fmadd_ps(qv, load8(k5, d, dtype), a5);
    a6 = _mm256_fmadd_ps(qv, load8(k6, d, dtype), a6);
    a7 = _mm256_fmadd_ps(qv, load8(k7, d, dtype), a7);
  }
  if (d < D) {
    const int64_t n = D - d;
    const __m256 qv = _mm256_load_ps(q + d);
    a0 = _mm256_fmadd_ps(qv, load8_tail(k0, d, n, dtype), a0);
    a1 = _mm256_fmadd_ps(qv, load8_tail(k1, d, n, dtype), a1);
    a2 = _mm256_fmadd_ps(qv, load8_tail(k2, d, n, dtype), a2);
    a3 = _mm256_fmadd_ps(qv, load8_tail(k3, d, n, dtype), a3);
    a4 = _mm256_fmadd_ps(qv, load8_tail(k4, d, n, dtype), a4);
    a5 = _mm256_fmadd_ps(qv, load8_tail(k5, d, n, dtype), a5);
    a6 = _mm256_fmadd_ps(qv, load8_tail(k6, d, n, dtype), a6);
    a7 = _mm256_fmadd_ps(qv, load8_tail(k7, d, n, dtype), a7);
  }
  __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* acc[0:D] = acc * alpha + sum_{j<n} w[j] * v_j, the V rows vp[j] converted in registers;
 * 8 independent FMA chains per 64 columns hide the FMA latency. */
RKV_INLINE void pv_row(float* restrict acc, float alpha, const float* restrict w,
                       const char* const* vp, int n, int64_t D, const int dtype) {
  const __m256 al = _mm256_set1_ps(alpha);
  const int64_t D8 = D & ~(int64_t)7;
  int64_t d = 0;
  for (; d + 64 <= D8; d += 64) {
    __m256 c0 = _mm256_mul_ps(_mm256_load_ps(acc + d + 0), al);
    __m256 c1 = _mm256_mul_ps(_mm256_load_ps(acc + d + 8), al);
    __m256 c2 = _mm256_mul_ps(_mm256_load_ps(acc + d + 16), al);
    __m256 c3 = _mm256_mul_ps(_mm256_load_ps(acc + d + 24), al);
    __m256 c4 = _mm256_mul_ps(_mm256_load_ps(acc + d + 32), al);
    __m256 c5 = _mm256_mul_ps(_mm256_load_ps(acc + d + 40), al);
    __m256 c6 = _mm256_mul_ps(_mm256_load_ps(acc + d + 48), al);
    __m256 c7 = _mm256_mul_ps(_mm256_load_ps(acc + d + 56), al);
    for (int j = 0; j < n; j++) {
      const char* vr = vp[j];
      const __m256 wj = _mm256_set1_ps(w[j]);
      c0 = _mm256_fmadd_ps(wj, load8(vr, d + 0, dtype), c0);
      c1 = _mm256_fmadd_ps(wj, load8(vr, d + 8, dtype), c1);
      c2 = _mm256_fmadd_ps(wj, load8(vr, d + 16, dtype), c2);
      c3 = _mm256_fmadd_ps(wj, load8(vr, d + 24, dtype), c3);
      c4 = _mm256_fmadd_ps(wj, load8(vr, d + 32, dtype), c4);
      c5 = _mm256_fmadd_ps(wj, load8(vr, d + 40, dtype), c5);
      c6 = _mm256_fmadd_ps(wj, load8(vr, d + 48, dtype), c6);
      c7 = _mm256_fmadd_ps(wj, load8(vr, d + 56, dtype), c7);
    }
    _mm256_store_ps(acc + d + 0, c0);
    _mm256_store_ps(acc + d + 8, c1);
    _mm256_store_ps(acc + d + 16, c2);
    _mm256_store_ps(acc + d + 24, c3);
    _mm256_store_ps(acc + d + 32, c4);
    _mm256_store_ps(acc + d + 40, c5);
    _mm256_store_ps(acc + d + 48, c6);
    _mm256_store_ps(acc + d + 56, c7);
  }
  for (; d + 16 <= D8; d += 16) {
    __m256 c0 = _mm256_mul_ps(_mm256_load_ps(acc + d), al);
    __m256 c1 = _mm256_mul_ps(_mm256_load_ps(acc + d + 8), al);
    for (int j = 0; j < n; j++) {
      const __m256 wj = _mm256_set1_ps(w[j]);
      c0 = _mm256_fmadd_ps(wj, load8(vp[j], d, dtype), c0);
      c1 = _mm256_fmadd_ps(wj, load8(vp[j], d + 8, dtype), c1);
    }
    _mm256_store_ps(acc + d, c0);
    _mm256_store_ps(acc + d + 8, c1);
  }
  for (; d < D8; d += 8) {
    __m256 c0 = _mm256_mul_ps(_mm256_load_ps(acc + d), al);
    for (int j = 0; j < n; j++)
      c0 = _mm256_fmadd_ps(_mm256_set1_ps(w[j]), load8(vp[j], d, dtype), c0);
    _mm256_store_ps(acc + d, c0);
  }
  if (d < D) {  /* acc is padded to a multiple of 8; the tail lanes of V load as 0 */
    __m256 c0 = _mm256_mul_ps(_mm256_load_ps(acc + d), al);
    for (int j = 0; j < n; j++)
      c0 = _mm256_fmadd_ps(_mm256_set1_ps(w[j]), load8_tail(vp[j], d, D - d, dtype), c0);
    _mm256_store_ps(acc + d, c0);
  }
}
#endif

/* ------------------------------------------------------------------------------------------ */
/* One work item: batch row b, cells [s0, s1), all KV heads                                    */
/* ------------------------------------------------------------------------------------------ */
typedef struct {
  float* qs;      /* [K][R][Dp]  scaled queries, zero-padded */
  float* acc;     /* [K][R][Dp] */
  float* m;       /* [K][R] */
  float* l;       /* [K][R] */
  float* lg;      /* [R][BLOCK] logits, then weights */
  float* madd;    /* [T][BLOCK] 0 where the cell is visible to query t, else -inf */
  float* kfac;    /* [BLOCK] int8 scales of the current head */
  float* vfac;    /* [BLOCK] */
  float* alpha;   /* [R] */
  float* kf;      /* [BLOCK][Dp] the head's K rows as float32 (staged path) */
  float* vf;      /* [BLOCK][Dp] */
  uint8_t* seen;  /* [R] the row saw a key in this block */
  const char** kcell;   /* [BLOCK] each valid cell's head-0 K row (V, scales likewise) */
  const char** vcell;
  const float** kscell;
  const float** vscell;
  const char** nkcell;  /* [BLOCK] the next block's cells (prefetch) */
  const char** nvcell;
} scratch;

static size_t elem_size(int dtype) {
  return dtype == RKV_F32 ? 4 : dtype == RKV_I8 ? 1 : 2;
}

/* Software prefetch of the next block, spread over the current block's compute: a burst of
 * prefetches at block start stalled on the miss buffers and did not overlap (dev box). Hint 2
 * (prefetcht1, into L2): 13.1 GB/s; 3 (L1), 10.0; 0 (non-temporal), 9.9 (dev box, hot case). */
#ifndef RKV_PF_HINT
#define RKV_PF_HINT 2
#endif
typedef struct {
  const char* const* kc;  /* [ncell] the next block's cells: head-0 K rows */
  const char* const* vc;
  int64_t kstep, vstep;   /* bytes from one head's row to the next */
  int64_t row_bytes;
  int ncell, nhead;
  int j, h, kv;           /* the row being prefetched: cell j, head h, K (0) or V (1) */
  const char* line;       /* its next line */
  const char* end;        /* its end */
} prefetcher;

RKV_INLINE void prefetch_row(prefetcher* pf) {
  const char* r = (pf->kv ? pf->vc[pf->j] + pf->h * pf->vstep : pf->kc[pf->j] + pf->h * pf->kstep);
  pf->line = (const char*)((uintptr_t)r & ~(uintptr_t)63);
  pf->end = r + pf->row_bytes;
}

RKV_INLINE void prefetch_init(prefetcher* pf, const char* const* kc, const char* const* vc,
                              int ncell, int nhead, int64_t kstep, int64_t vstep,
                              int64_t row_bytes) {
  pf->kc = kc; pf->vc = vc; pf->ncell = ncell; pf->nhead = nhead;
  pf->kstep = kstep; pf->vstep = vstep; pf->row_bytes = row_bytes;
  if (kstep == row_bytes && vstep == row_bytes) {  /* a cell's heads are one range */
    pf->nhead = 1;
    pf->row_bytes = row_bytes * nhead;
  }
  pf->j = pf->h = pf->kv = 0;
  pf->line = pf->end = NULL;
  if (ncell > 0) prefetch_row(pf);
}

/* n more lines, in memory order of a contiguous cell: cell by cell, its K rows (all heads) then
 * its V rows. */
RKV_INLINE void prefetch_some(prefetcher* pf, int n) {
  while (n > 0 && pf->j < pf->ncell) {
    const char* line = pf->line;
    const int left = (int)((pf->end - line + 63) / 64);
    const int k = left < n ? left : n;
    for (int x = 0; x < k; x++) __builtin_prefetch(line + 64 * x, 0, RKV_PF_HINT);
    n -= k;
    pf->line = line + 64 * k;
    if (k == left) {
      if (++pf->h == pf->nhead) {
        pf->h = 0;
        if (++pf->kv == 2) { pf->kv = 0; pf->j++; }
      }
      if (pf->j < pf->ncell) prefetch_row(pf);
    }
  }
}

#if RKV_AVX2
/* ------------------------------------------------------------------------------------------ */
/* Register-blocked path (D % 16 == 0, any G*T: query rows in groups of up to 4)               */
/* ------------------------------------------------------------------------------------------ */
/* Elements [d, d+16) of a row as two float32 vectors. bf16 comes from ONE 256-bit load with no
 * shuffle: each 32-bit word holds elements (2i, 2i+1), so `x << 16` is the even elements and
 * `x & 0xffff0000` the odd ones, exactly as float32. The query rows and V accumulators of this
 * path are kept in that even/odd order per 16 columns (rkv_perm16: q permuted once per item, acc
 * un-permuted on output), so the dot products and p @ V need no cross-lane work. Other dtypes
 * return elements [d, d+8) and [d+8, d+16) in natural order. */
#define RKV_PERM16(dtype) ((dtype) == RKV_BF16)
/* Keeps a loaded vector in a register: gcc otherwise folds the load into every instruction that
 * uses it (a K chunk loaded twice, a q chunk once per cell), and the loads, not the FMAs, bound
 * the dot products (dev box). */
#define RKV_IN_REG(x) __asm__("" : "+x"(x))
RKV_INLINE void load16(const char* p, int64_t d, const int dtype, __m256* lo, __m256* hi) {
  if (dtype == RKV_BF16) {
    __m256i x = _mm256_loadu_si256((const __m256i*)((const uint16_t*)p + d));
    RKV_IN_REG(x);
    *lo = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    *hi = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xffff0000u)));
  } else {
    *lo = load8(p, d, dtype);
    *hi = load8(p, d + 8, dtype);
  }
}

/* Logits of NR query rows (q rows at stride Dp, in load16 order) against the block's key rows
 * kp[0..nv8): each K row chunk is loaded and converted once and FMAed into all NR rows;
 * NC = 8 / NR cells at a time keep 8 independent FMA chains, reduced by one hadd tree. Writes
 * lg[r * RKV_BLOCK + j]. Spreads pf_n prefetches of the next block over its steps. */
RKV_INLINE void qk_rows(const float* restrict q, int64_t Dp, const char* const* kp, int nv8,
                        int64_t D, const int dtype, float* restrict lg, prefetcher* pf,
                        int pf_n, const int NR) {
  const int NC = NR == 1 ? 8 : NR == 2 ? 4 : 2;
  const int steps = nv8 / NC;
  const int pf_step = (pf_n + steps - 1) / steps;
  for (int j = 0; j < nv8; j += NC) {
    __m256 a[8];
    for (int x = 0; x < 8; x++) a[x] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      __m256 k0[8], k1[8];
      for (int c = 0; c < NC; c++) load16(kp[j + c], d, dtype, &k0[c], &k1[c]);
      for (int r = 0; r < NR; r++) {
        __m256 q0 = _mm256_load_ps(q + r * Dp + d), q1 = _mm256_load_ps(q + r * Dp + d + 8);
        if (NC > 1) { RKV_IN_REG(q0); RKV_IN_REG(q1); }
        for (int c = 0; c < NC; c++) {
          a[r * NC + c] = _mm256_fmadd_ps(q0, k0[c], a[r * NC + c]);
          a[r * NC + c] = _mm256_fmadd_ps(q1, k1[c], a[r * NC + c]);
        }
      }
    }
    /* s[x] = sum of a[x]: x = r * NC + c */
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    const __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                   _mm256_permute2f128_ps(u0, u1, 0x31));
    if (NR == 1) {
      _mm256_store_ps(lg + j, s);
    } else {
      float tmp[8] __attribute__((aligned(32)));
      _mm256_store_ps(tmp, s);
      for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) lg[r * RKV_BLOCK + j + c] = tmp[r * NC + c];
    }
    prefetch_some(pf, pf_step);
  }
}

/* acc[r][d0:d1) = acc * alpha[r] + sum_{j<nv} w[r][j] * v_j for NR rows (acc rows at stride Dp,
 * w rows at stride RKV_BLOCK), DC chunks of 16 columns at a time: each V row chunk is loaded and
 * converted once for all NR rows; 2 * NR * DC (8, or 6 at NR = 3) accumulator chains. Returns
 * the first column it did not do (d1 rounded down to whole steps). */
RKV_INLINE int64_t pv_rows_part(float* restrict acc, int64_t Dp, const float* restrict alpha,
                                const float* restrict w, const char* const* vp, int nv,
                                int64_t d0, int64_t d1, const int dtype, prefetcher* pf,
                                int pf_step, const int NR, const int DC) {
  int64_t d = d0;
  for (; d + 16 * DC <= d1; d += 16 * DC) {
    __m256 c[8];
    for (int r = 0; r < NR; r++) {
      const __m256 al = _mm256_set1_ps(alpha[r]);
      for (int x = 0; x < 2 * DC; x++)
        c[r * 2 * DC + x] = _mm256_mul_ps(_mm256_load_ps(acc + r * Dp + d + 8 * x), al);
    }
    for (int j = 0; j < nv; j++) {
      __m256 v[8];
      for (int x = 0; x < DC; x++) load16(vp[j], d + 16 * x, dtype, &v[2 * x], &v[2 * x + 1]);
      for (int r = 0; r < NR; r++) {
        const __m256 wj = _mm256_broadcast_ss(w + r * RKV_BLOCK + j);
        for (int x = 0; x < 2 * DC; x++)
          c[r * 2 * DC + x] = _mm256_fmadd_ps(wj, v[x], c[r * 2 * DC + x]);
      }
    }
    for (int r = 0; r < NR; r++)
      for (int x = 0; x < 2 * DC; x++) _mm256_store_ps(acc + r * Dp + d + 8 * x, c[r * 2 * DC + x]);
    prefetch_some(pf, pf_step);
  }
  return d;
}

RKV_INLINE void pv_rows(float* restrict acc, int64_t Dp, const float* restrict alpha,
                        const float* restrict w, const char* const* vp, int nv, int64_t D,
                        const int dtype, prefetcher* pf, int pf_n, const int NR) {
  const int DC = NR == 1 ? 4 : NR == 2 ? 2 : 1;
  const int steps = (int)(D / (16 * DC)) + (int)(D % (16 * DC) / 16);
  const int pf_step = (pf_n + steps - 1) / steps;
  int64_t d = pv_rows_part(acc, Dp, alpha, w, vp, nv, 0, D, dtype, pf, pf_step, NR, DC);
  if (DC > 1) pv_rows_part(acc, Dp, alpha, w, vp, nv, d, D, dtype, pf, pf_step, NR, 1);
}
#endif

RKV_INLINE void attend_impl(const rkv_attn_args* a, int64_t b, int64_t s0, int64_t s1,
                            scratch* w, float* p_acc, float* p_m, float* p_l, const int dtype) {
  const int64_t T = a->q_len, H = a->num_heads, K = a->num_kv_heads, D = a->head_dim;
  const int64_t G = H / K, R = G * T, Dp = (D + 7) & ~(int64_t)7;
  const int64_t tile = a->tile;
  const int64_t es = (int64_t)elem_size(dtype);
  const int64_t *ks = a->k_strides, *vs = a->v_strides, *kss = a->ks_strides,
                *vss = a->vs_strides, *ps = a->pos_strides;
  const int quant = dtype == RKV_I8;
  const int cap = a->softcap > 0.0f;
  const float softcap = a->softcap, inv_cap = cap ? 1.0f / a->softcap : 0.0f;
  const int32_t* qp = a->q_pos + b * T;
  const int64_t row_bytes = D * es;
  /* Lines prefetched per (cell, head), K and V (+1: a row not aligned to 64 bytes touches one
   * more line); a budget, the prefetcher walks the exact lines. */
  const int lines_per_row = (int)((row_bytes + 63) / 64) + 1;

  /* Scaled queries: row r = t * G + g of head h = kh * G + g. */
  for (int64_t kh = 0; kh < K; kh++)
    for (int64_t t = 0; t < T; t++)
      for (int64_t g = 0; g < G; g++) {
        float* dst = w->qs + (kh * R + t * G + g) * Dp;
        const float* src = a->q + ((b * T + t) * H + kh * G + g) * D;
        for (int64_t d = 0; d < D; d++) dst[d] = src[d] * a->scale;
        for (int64_t d = D; d < Dp; d++) dst[d] = 0.0f;
      }
  /* The register-blocked path (a function of the shapes only, like every choice here). */
  const int fast = RKV_AVX2 && D % 16 == 0;
#if RKV_AVX2
  if (fast && RKV_PERM16(dtype))  /* each 16 columns as (even, odd): load16's order */
    for (int64_t x = 0; x < K * R; x++) {
      float* row = w->qs + x * Dp;
      for (int64_t d = 0; d < D; d += 16) {
        float tmp[16];
        for (int e = 0; e < 8; e++) { tmp[e] = row[d + 2 * e]; tmp[8 + e] = row[d + 2 * e + 1]; }
        memcpy(row + d, tmp, sizeof tmp);
      }
    }
#endif
  for (int64_t x = 0; x < K * R; x++) { w->m[x] = -INFINITY; w->l[x] = 0.0f; }
  memset(w->acc, 0, sizeof(float) * K * R * Dp);

  int64_t n = s0 / tile, i = s0 - n * tile;  /* (tile, cell in tile) of the next cell */
  for (int64_t c0 = s0; c0 < s1; c0 += RKV_BLOCK) {
    const int64_t c1 = c0 + RKV_BLOCK < s1 ? c0 + RKV_BLOCK : s1;
    /* Visible cells of the block (holes and cells no query sees are never read). */
    int nv = 0;
    for (int64_t s = c0; s < c1; s++, i++) {
      if (i == tile) { n++; i = 0; }
      const int32_t p = a->pos_tiles[n][b * ps[0] + i * ps[1]];
      if (p < 0) continue;
      int any = 0;
      for (int64_t t = 0; t < T; t++) {
        const int64_t qt = qp[t];
        const int ok = (!a->causal || (int64_t)p <= qt) &&
                       (a->window <= 0 || qt - (int64_t)p < a->window);
        w->madd[t * RKV_BLOCK + nv] = ok ? 0.0f : -INFINITY;
        any |= ok;
      }
      if (!any) continue;
      w->kcell[nv] = (const char*)a->k_tiles[n] + es * (b * ks[0] + i * ks[1]);
      w->vcell[nv] = (const char*)a->v_tiles[n] + es * (b * vs[0] + i * vs[1]);
      if (quant) {
        w->kscell[nv] = a->ks_tiles[n] + b * kss[0] + i * kss[1];
        w->vscell[nv] = a->vs_tiles[n] + b * vss[0] + i * vss[1];
      }
      nv++;
    }
    /* The next block's cells (n, i continue from here), for the prefetches. */
    const int64_t nxt = s1 - c1 < RKV_BLOCK ? s1 - c1 : RKV_BLOCK;
    {
      int64_t pn = n, pi = i;
      for (int64_t j = 0; j < nxt; j++, pi++) {
        if (pi == tile) { pn++; pi = 0; }
        w->nkcell[j] = (const char*)a->k_tiles[pn] + es * (b * ks[0] + pi * ks[1]);
        w->nvcell[j] = (const char*)a->v_tiles[pn] + es * (b * vs[0] + pi * vs[1]);
      }
    }
    if (nv == 0) continue;
    const int nv8 = (nv + 7) & ~7;
    prefetcher pf;  /* the next block, a 1/K share during each head's compute */
    prefetch_init(&pf, w->nkcell, w->nvcell, (int)nxt, (int)K, es * ks[2], es * vs[2], row_bytes);
    const int pf_head = (int)(2 * nxt * lines_per_row);
    for (int64_t t = 0; t < T; t++)
      for (int j = nv; j < nv8; j++) w->madd[t * RKV_BLOCK + j] = -INFINITY;

    for (int64_t kh = 0; kh < K; kh++) {
      const char* kp[RKV_BLOCK];
      const char* vp[RKV_BLOCK];
      for (int j = 0; j < nv; j++) {
        kp[j] = w->kcell[j] + es * kh * ks[2];
        vp[j] = w->vcell[j] + es * kh * vs[2];
        if (quant) {
          w->kfac[j] = w->kscell[j][kh * kss[2]];
          w->vfac[j] = w->vscell[j][kh * vss[2]];
        }
      }
      for (int j = nv; j < nv8; j++) { kp[j] = kp[0]; w->kfac[j] = 1.0f; }  /* masked lanes */
      const int pf_per_row = (pf_head + (int)R - 1) / (int)R;
      const int staged = !RKV_AVX2 || (!fast && dtype != RKV_F32 && R >= RKV_STAGE_ROWS);
      const char* kps[RKV_BLOCK];  /* staged rows (float32) */
      const char* vps[RKV_BLOCK];
      if (staged) {
        for (int j = 0; j < nv; j++) {
          float* dst = w->kf + j * Dp;
#if RKV_AVX2
          int64_t d = 0;
          for (; d + 8 <= D; d += 8) _mm256_store_ps(dst + d, load8(kp[j], d, dtype));
          if (d < D) _mm256_store_ps(dst + d, load8_tail(kp[j], d, D - d, dtype));
#else
          for (int64_t d = 0; d < D; d++) dst[d] = load1(kp[j], d, dtype);
          for (int64_t d = D; d < Dp; d++) dst[d] = 0.0f;
#endif
          kps[j] = (const char*)dst;
          vps[j] = (const char*)(w->vf + j * Dp);
        }
        for (int j = nv; j < nv8; j++) kps[j] = kps[0];
      }
      (void)vps;
      float* m = w->m + kh * R;
      float* l = w->l + kh * R;
      int any_row = 0;
#if RKV_AVX2
      if (fast) {  /* all rows' logits first: each K row is converted once per 4 query rows */
        const int ng = (int)((R + 3) / 4);
        for (int64_t r0 = 0; r0 < R; r0 += 4) {
          const float* qr = w->qs + (kh * R + r0) * Dp;
          float* lgr = w->lg + r0 * RKV_BLOCK;
          const int pn = pf_head / 2 / ng + 1;
          switch (R - r0 >= 4 ? 4 : (int)(R - r0)) {
            case 4: qk_rows(qr, Dp, kp, nv8, D, dtype, lgr, &pf, pn, 4); break;
            case 3: qk_rows(qr, Dp, kp, nv8, D, dtype, lgr, &pf, pn, 3); break;
            case 2: qk_rows(qr, Dp, kp, nv8, D, dtype, lgr, &pf, pn, 2); break;
            default: qk_rows(qr, Dp, kp, nv8, D, dtype, lgr, &pf, pn, 1); break;
          }
        }
      }
#endif
      for (int64_t r = 0; r < R; r++) {
        const int64_t t = r / G;
        const float* qrow = w->qs + (kh * R + r) * Dp;
        float* lg = w->lg + r * RKV_BLOCK;
        const float* madd = w->madd + t * RKV_BLOCK;
        float mx;
        int row_nan = 0;
#if RKV_AVX2
        if (fast) {
          if (quant)
            for (int j = 0; j < nv8; j += 8)
              _mm256_store_ps(lg + j, _mm256_mul_ps(_mm256_load_ps(lg + j),
                                                    _mm256_loadu_ps(w->kfac + j)));
        } else {
          for (int j = 0; j < nv8; j += 8) {
            __m256 x = staged ? dot8(qrow, kps + j, Dp, RKV_F32) : dot8(qrow, kp + j, D, dtype);
            if (quant) x = _mm256_mul_ps(x, _mm256_loadu_ps(w->kfac + j));
            _mm256_store_ps(lg + j, x);
            prefetch_some(&pf, pf_per_row / (nv8 / 8) + 1);
          }
        }
        if (cap)
          for (int j = 0; j < nv; j++) lg[j] = softcap * tanhf(lg[j] * inv_cap);
        {
          /* Masked cells become -inf by a select, not by adding -inf: NaN + -inf is NaN, and a
           * NaN logit left in a masked cell could not be told from one the row reads. After the
           * select every NaN is a visible one (q or a visible K cell): flag the row. */
          __m256 mv = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
          for (int j = 0; j < nv8; j += 8) {
            const __m256 ma = _mm256_load_ps(madd + j);
            __m256 x = _mm256_blendv_ps(_mm256_load_ps(lg + j), ma,
                                        _mm256_cmp_ps(ma, _mm256_setzero_ps(), _CMP_NEQ_UQ));
            _mm256_store_ps(lg + j, x);
            mv = _mm256_max_ps(mv, x);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
          }
          mx = hmax256(mv);
          row_nan = _mm256_movemask_ps(nan) != 0;
        }
#else
        prefetch_some(&pf, pf_per_row);
        mx = -INFINITY;
        for (int j = 0; j < nv; j++) {
          const float* kr = w->kf + j * Dp;
          float x = 0.0f;
          for (int64_t d = 0; d < Dp; d++) x += qrow[d] * kr[d];
          if (quant) x *= w->kfac[j];
          if (cap) x = softcap * tanhf(x * inv_cap);
          x = madd[j] == 0.0f ? x : -INFINITY;  /* a select: see the AVX2 path */
          row_nan |= x != x;
          lg[j] = x;
          mx = x > mx ? x : mx;
        }
#endif
        if (row_nan) {
          /* The row read a NaN: its l becomes NaN (sticky: later blocks give l * alpha + sum) and
           * the final merge writes NaN to o and lse. The comparisons below would drop it. */
          l[r] = NAN;
          w->seen[r] = 0;
          if (fast) {  /* as for a row that saw nothing in this block: add 0 * V, keep acc */
            w->alpha[r] = 1.0f;
            for (int j = 0; j < nv8; j++) lg[j] = 0.0f;
          }
          continue;
        }
        if (mx == -INFINITY) {
          w->seen[r] = 0;
          if (fast) {  /* p @ V runs over groups of rows: this one adds 0 * V and keeps acc */
            w->alpha[r] = 1.0f;
            for (int j = 0; j < nv8; j++) lg[j] = 0.0f;
          }
          continue;
        }
        const float mnew = m[r] > mx ? m[r] : mx;
        const float alpha = m[r] == -INFINITY ? 0.0f : expf(m[r] - mnew);
        float sum;
#if RKV_AVX2
        {
          const __m256 mvv = _mm256_set1_ps(mnew), ninf = _mm256_set1_ps(-INFINITY);
          __m256 sv = _mm256_setzero_ps();
          for (int j = 0; j < nv8; j += 8) {
            __m256 x = _mm256_load_ps(lg + j);
            __m256 live = _mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ);
            __m256 p = _mm256_and_ps(live, exp256(_mm256_sub_ps(x, mvv)));
            sv = _mm256_add_ps(sv, p);
            if (quant) p = _mm256_mul_ps(p, _mm256_loadu_ps(w->vfac + j));
            _mm256_store_ps(lg + j, p);
          }
          sum = hsum256(sv);
        }
#else
        sum = 0.0f;
        for (int j = 0; j < nv; j++) {
          float p = lg[j] == -INFINITY ? 0.0f : expf(lg[j] - mnew);
          sum += p;
          lg[j] = quant ? p * w->vfac[j] : p;
        }
#endif
        l[r] = l[r] * alpha + sum;
        m[r] = mnew;
        w->alpha[r] = alpha;
        w->seen[r] = 1;
        any_row = 1;
      }
      if (!any_row) continue;
#if RKV_AVX2
      if (fast) {
        const int ng = (int)((R + 3) / 4);
        for (int64_t r0 = 0; r0 < R; r0 += 4) {
          float* ar = w->acc + (kh * R + r0) * Dp;
          const float* al = w->alpha + r0;
          const float* wr = w->lg + r0 * RKV_BLOCK;
          const int pn = pf_head / 2 / ng + 1;
          switch (R - r0 >= 4 ? 4 : (int)(R - r0)) {
            case 4: pv_rows(ar, Dp, al, wr, vp, nv, D, dtype, &pf, pn, 4); break;
            case 3: pv_rows(ar, Dp, al, wr, vp, nv, D, dtype, &pf, pn, 3); break;
            case 2: pv_rows(ar, Dp, al, wr, vp, nv, D, dtype, &pf, pn, 2); break;
            default: pv_rows(ar, Dp, al, wr, vp, nv, D, dtype, &pf, pn, 1); break;
          }
        }
      } else if (staged) {
        for (int j = 0; j < nv; j++) {
          float* dst = w->vf + j * Dp;
          int64_t d = 0;
          for (; d + 8 <= D; d += 8) _mm256_store_ps(dst + d, load8(vp[j], d, dtype));
          if (d < D) _mm256_store_ps(dst + d, load8_tail(vp[j], d, D - d, dtype));
        }
        for (int64_t r = 0; r < R; r++)
          if (w->seen[r])
            pv_row(w->acc + (kh * R + r) * Dp, w->alpha[r], w->lg + r * RKV_BLOCK, vps, nv, Dp,
                   RKV_F32);
      } else {
        for (int64_t r = 0; r < R; r++)
          if (w->seen[r])
            pv_row(w->acc + (kh * R + r) * Dp, w->alpha[r], w->lg + r * RKV_BLOCK, vp, nv, D,
                   dtype);
      }
#else
      for (int j = 0; j < nv; j++) {
        float* dst = w->vf + j * Dp;
        for (int64_t d = 0; d < D; d++) dst[d] = load1(vp[j], d, dtype);
      }
      for (int64_t r = 0; r < R; r++) {
        if (!w->seen[r]) continue;
        float* acc = w->acc + (kh * R + r) * Dp;
        const float al = w->alpha[r];
        const float* wr = w->lg + r * RKV_BLOCK;
        for (int64_t d = 0; d < D; d++) acc[d] *= al;
        for (int j = 0; j < nv; j++) {
          const float* vr = w->vf + j * Dp;
          const float wj = wr[j];
          for (int64_t d = 0; d < D; d++) acc[d] += wj * vr[d];
        }
      }
#endif
    }
    prefetch_some(&pf, 1 << 30);  /* whatever is left */
  }
  /* The unnormalized partial of this item: acc [K][R][D], m and l [K][R]. */
  for (int64_t x = 0; x < K * R; x++) {
#if RKV_AVX2
    if (fast && RKV_PERM16(dtype)) {  /* back from (even, odd) per 16 columns */
      const float* src = w->acc + x * Dp;
      float* dst = p_acc + x * D;
      for (int64_t d = 0; d < D; d += 16)
        for (int e = 0; e < 8; e++) { dst[d + 2 * e] = src[d + e]; dst[d + 2 * e + 1] = src[d + 8 + e]; }
    } else
#endif
    memcpy(p_acc + x * D, w->acc + x * Dp, sizeof(float) * D);
    p_m[x] = w->m[x];
    p_l[x] = w->l[x];
  }
}

/* One specialization per K/V dtype: the element conversion is resolved at compile time. */
static void attend_item(const rkv_attn_args* a, int64_t b, int64_t s0, int64_t s1, scratch* w,
                        float* p_acc, float* p_m, float* p_l) {
  switch (a->dtype) {
    case RKV_F32: attend_impl(a, b, s0, s1, w, p_acc, p_m, p_l, RKV_F32); break;
    case RKV_BF16: attend_impl(a, b, s0, s1, w, p_acc, p_m, p_l, RKV_BF16); break;
    case RKV_F16: attend_impl(a, b, s0, s1, w, p_acc, p_m, p_l, RKV_F16); break;
    default: attend_impl(a, b, s0, s1, w, p_acc, p_m, p_l, RKV_I8); break;
  }
}

static void* aligned(size_t bytes) {
  bytes = (bytes + 63) & ~(size_t)63;
  void* p = aligned_alloc(64, bytes ? bytes : 64);
  if (p) memset(p, 0, bytes ? bytes : 64);  /* never read uninitialized padding */
  return p;
}

static int scratch_alloc(scratch* w, int64_t K, int64_t R, int64_t T, int64_t Dp) {
  w->qs = aligned(sizeof(float) * K * R * Dp);
  w->acc = aligned(sizeof(float) * K * R * Dp);
  w->m = aligned(sizeof(float) * K * R);
  w->l = aligned(sizeof(float) * K * R);
  w->lg = aligned(sizeof(float) * R * RKV_BLOCK);
  w->madd = aligned(sizeof(float) * T * RKV_BLOCK);
  w->kfac = aligned(sizeof(float) * RKV_BLOCK);
  w->vfac = aligned(sizeof(float) * RKV_BLOCK);
  w->alpha = aligned(sizeof(float) * R);
  w->kf = aligned(sizeof(float) * RKV_BLOCK * Dp);
  w->vf = aligned(sizeof(float) * RKV_BLOCK * Dp);
  w->seen = aligned(R);
  w->kcell = aligned(sizeof(void*) * RKV_BLOCK);
  w->vcell = aligned(sizeof(void*) * RKV_BLOCK);
  w->kscell = aligned(sizeof(void*) * RKV_BLOCK);
  w->vscell = aligned(sizeof(void*) * RKV_BLOCK);
  w->nkcell = aligned(sizeof(void*) * RKV_BLOCK);
  w->nvcell = aligned(sizeof(void*) * RKV_BLOCK);
  return w->qs && w->acc && w->m && w->l && w->lg && w->madd && w->kfac && w->vfac &&
         w->alpha && w->kf && w->vf && w->seen && w->kcell && w->vcell &&
         w->kscell && w->vscell && w->nkcell && w->nvcell;
}

static void scratch_free(scratch* w) {
  free(w->qs); free(w->acc); free(w->m); free(w->l); free(w->lg); free(w->madd); free(w->kfac);
  free(w->vfac); free(w->alpha); free(w->kf); free(w->vf); free(w->seen);
  free((void*)w->kcell); free((void*)w->vcell); free((void*)w->kscell); free((void*)w->vscell);
  free((void*)w->nkcell); free((void*)w->nvcell);
}

/* Cells per work item: a function of the shapes only (so results do not depend on threads). */
int64_t rkv_cpu_attention_chunk(int64_t B, int64_t S, int64_t K, int64_t R, int64_t D) {
  if (S <= 0) return 1;
  const int64_t Dp = (D + 7) & ~(int64_t)7;
  int64_t per_row = (RKV_TARGET_ITEMS + B - 1) / B;
  int64_t chunk = (S + per_row - 1) / per_row;
  if (chunk < RKV_MIN_CHUNK) chunk = RKV_MIN_CHUNK;
  /* Bound the partials buffer (B * S / chunk items of K * R * D floats). */
  const int64_t item_bytes = K * R * Dp * 4 + K * R * 8;
  const int64_t max_items = RKV_PARTIAL_BYTES / item_bytes > B ? RKV_PARTIAL_BYTES / item_bytes : B;
  const int64_t max_per_row = max_items / B > 1 ? max_items / B : 1;
  const int64_t min_chunk = (S + max_per_row - 1) / max_per_row;
  if (chunk < min_chunk) chunk = min_chunk;
  return chunk < S ? chunk : S;
}

/* Attention over the cells; writes o [B,T,H,D] and lse [B,T,H] (float32, natural log).
 * chunk <= 0 picks rkv_cpu_attention_chunk; num_threads <= 0 uses OpenMP's default.
 * Returns 0, or -1 when memory could not be allocated, -2 on inconsistent arguments. */
int rkv_cpu_attention(const rkv_attn_args* a, int num_threads, int64_t chunk, float* o,
                      float* lse) {
  const int64_t B = a->batch, T = a->q_len, H = a->num_heads, K = a->num_kv_heads;
  const int64_t D = a->head_dim;
  if (B < 1 || T < 1 || K < 1 || D < 1 || H % K != 0 || a->tile < 1 || a->n_tiles < 0 ||
      a->dtype < 0 || a->dtype > 3 || (a->dtype == RKV_I8 && (!a->ks_tiles || !a->vs_tiles)) ||
      (a->n_tiles > 0 && (!a->k_tiles || !a->v_tiles || !a->pos_tiles)))
    return -2;
  const int64_t G = H / K, R = G * T, Dp = (D + 7) & ~(int64_t)7;
  const int64_t S = a->n_tiles * a->tile;
  if (chunk <= 0) chunk = rkv_cpu_attention_chunk(B, S, K, R, D);
  const int64_t nchunk = S > 0 ? (S + chunk - 1) / chunk : 0;
  const int64_t items = B * nchunk;
  float* p_acc = NULL;
  float* p_ml = NULL;
  if (items > 0) {
    p_acc = (float*)malloc(sizeof(float) * items * K * R * D);
    p_ml = (float*)malloc(sizeof(float) * items * K * R * 2);
    if (!p_acc || !p_ml) { free(p_acc); free(p_ml); return -1; }
  }
  int failed = 0;
#ifdef _OPENMP
  if (num_threads <= 0) num_threads = omp_get_max_threads();
#pragma omp parallel num_threads(num_threads)
#endif
  {
    scratch w;
    memset(&w, 0, sizeof w);
    int ok = items == 0 || scratch_alloc(&w, K, R, T, Dp);
    if (!ok) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
      failed = 1;
    }
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (int64_t it = 0; it < items; it++) {
      if (!ok) continue;
      const int64_t b = it / nchunk, c = it % nchunk;
      const int64_t s0 = c * chunk, s1 = s0 + chunk < S ? s0 + chunk : S;
      float* pm = p_ml + it * K * R * 2;
      attend_item(a, b, s0, s1, &w, p_acc + it * K * R * D, pm, pm + K * R);
    }
    scratch_free(&w);  /* free(NULL) is a no-op */
    /* Exact merge of the chunk partials of each (b, head), in chunk order. */
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t bk = 0; bk < B * K; bk++) {
      const int64_t b = bk / K, kh = bk % K;
      double ov[Dp];
      for (int64_t r = 0; r < R; r++) {
        const int64_t t = r / G, g = r % G, h = kh * G + g;
        float* orow = o + ((b * T + t) * H + h) * D;
        double top = -INFINITY;
        int read_nan = 0;
        for (int64_t c = 0; c < nchunk; c++) {
          const float* pm = p_ml + (b * nchunk + c) * K * R * 2;
          const float lc = pm[K * R + kh * R + r];
          read_nan |= lc != lc;
          if (lc > 0.0f && pm[kh * R + r] > top) top = pm[kh * R + r];
        }
        if (read_nan) {  /* a chunk read a NaN (q or a visible K cell): it propagates */
          for (int64_t d = 0; d < D; d++) orow[d] = NAN;
          lse[(b * T + t) * H + h] = NAN;
          continue;
        }
        if (top == -INFINITY) {
          for (int64_t d = 0; d < D; d++) orow[d] = 0.0f;
          lse[(b * T + t) * H + h] = -INFINITY;
          continue;
        }
        double total = 0.0;
        for (int64_t d = 0; d < D; d++) ov[d] = 0.0;
        for (int64_t c = 0; c < nchunk; c++) {
          const int64_t it = b * nchunk + c;
          const float* pm = p_ml + it * K * R * 2;
          const float lc = pm[K * R + kh * R + r];
          if (!(lc > 0.0f)) continue;
          const double wgt = exp((double)pm[kh * R + r] - top);
          total += wgt * lc;
          const float* pa = p_acc + (it * K * R + kh * R + r) * D;
          for (int64_t d = 0; d < D; d++) ov[d] += wgt * pa[d];
        }
        for (int64_t d = 0; d < D; d++) orow[d] = (float)(ov[d] / total);
        lse[(b * T + t) * H + h] = (float)(top + log(total));
      }
    }
  }
  free(p_acc);
  free(p_ml);
  return failed ? -1 : 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Host memory probes                                                                          */
/* ------------------------------------------------------------------------------------------ */
/* Fills buf in parallel (first touch from the threads that will read it). */
void rkv_fill(void* buf, int64_t nbytes, int value, int num_threads) {
  const int64_t step = 1 << 20;
  const int64_t n = (nbytes + step - 1) / step;
#ifdef _OPENMP
  if (num_threads <= 0) num_threads = omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(num_threads)
#endif
  for (int64_t i = 0; i < n; i++) {
    const int64_t lo = i * step, hi = lo + step < nbytes ? lo + step : nbytes;
    memset((char*)buf + lo, value, (size_t)(hi - lo));
  }
}

/* Reads every byte of buf once (a multi-threaded 64-bit sum): the host read bandwidth probe. */
uint64_t rkv_read_sum(const void* buf, int64_t nbytes, int num_threads) {
  const int64_t n = nbytes / 32;  /* 32-byte words; the tail bytes are ignored */
  const char* p = (const char*)buf;
  uint64_t total = 0;
#ifdef _OPENMP
  if (num_threads <= 0) num_threads = omp_get_max_threads();
#pragma omp parallel for schedule(static) reduction(+ : total) num_threads(num_threads)
#endif
  for (int64_t blk = 0; blk < (n + 255) / 256; blk++) {
    const int64_t lo = blk * 256, hi = lo + 256 < n ? lo + 256 : n;
#if RKV_AVX2
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
    int64_t i = lo;
    for (; i + 4 <= hi; i += 4) {
      s0 = _mm256_add_epi64(s0, _mm256_loadu_si256((const __m256i*)(p + 32 * i)));
      s1 = _mm256_add_epi64(s1, _mm256_loadu_si256((const __m256i*)(p + 32 * (i + 1))));
      s2 = _mm256_add_epi64(s2, _mm256_loadu_si256((const __m256i*)(p + 32 * (i + 2))));
      s3 = _mm256_add_epi64(s3, _mm256_loadu_si256((const __m256i*)(p + 32 * (i + 3))));
    }
    for (; i < hi; i++) s0 = _mm256_add_epi64(s0, _mm256_loadu_si256((const __m256i*)(p + 32 * i)));
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i*)lanes, _mm256_add_epi64(_mm256_add_epi64(s0, s1),
                                                          _mm256_add_epi64(s2, s3)));
    total += lanes[0] + lanes[1] + lanes[2] + lanes[3];
#else
    uint64_t s = 0;
    for (int64_t i = lo * 4; i < hi * 4; i++) {
      uint64_t x;
      memcpy(&x, p + 8 * i, 8);
      s += x;
    }
    total += s;
#endif
  }
  return total;
}
