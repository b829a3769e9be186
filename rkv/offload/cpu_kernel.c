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
 * in place, never copied. Positions and int8 scales come as tile tables the same way; the scales
 * (one per cell and KV head) are float32 or bfloat16 (scale_dtype: RKV_F32 / RKV_BF16, strides in
 * elements of that dtype), so a cache that keeps them in bf16 (half the tail's scale bytes) is
 * read in place too; a bf16 scale widens exactly to float32 (bits << 16).
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
 * 512 bits (RKV_AVX512: built for x86-64-v4, which cpu_build.py picks on an AVX-512 host). At
 * 256 bits int8 is compute bound: 8 elements cost a sign-extend, a convert and an FMA per query
 * row on the two vector ports that also run every FMA, so int8 read ~51 GB/s on the H200 host
 * where bf16 reads ~80 (and the 256-bit code merely recompiled for v4 changed nothing). The
 * register-blocked path (D % 16 == 0, every dtype) therefore has a 512-bit variant: 16 elements
 * per instruction (int8: vpmovsxbd + vcvtdq2ps; bf16: one load of 32, shift = even, mask = odd,
 * so that path's column order is (16 even, 16 odd) per 32 columns; f16: vcvtph2ps), a D = 128 row
 * = 8 zmm; qk_rows_w keeps 4 cells x 4 rows = 16 dot products in registers (32 zmm registers)
 * and reduces them with one shuffle tree (hsum16x16); pv_rows_w 4 rows x 64 columns. The softmax
 * of each 4-row group runs rows-parallel (softmax4_w: one max, rescale and sum for the 4 rows,
 * exp in-register, no expf call per row), and the next block's prefetches are budgeted by their
 * exact line count. Rows beyond whole groups of 4 and softcapped logits take the per-row
 * softmax; the semantics (masking by select, NaN flagging, empty rows) are the same. Dev box
 * (2-core Xeon VM, AVX-512), 512K cells, K=8, G=4, D=128, measure_cpu_attention, median of 3
 * processes: int8 6.9 -> 9.7 GB/s on 1 thread, 13.8 -> 19.3 on 2; bf16 9.3 -> 10.8 and
 * 18.4 -> 21.5 (rkv_read_sum: 16 and 32 GB/s); with K/V in L2, int8 34 -> 22 ns per (cell,
 * head), of which QK ~8.4 and p @ V ~7.2 (L1 micro-benchmark): near the two-port bound of their
 * ~107 vector instructions.
 * On the H200 host (16-core Xeon, AVX-512; 512K cells, 15 threads, one run): bf16 95.1 GB/s
 * against the 256-bit build's 69.6, int8 71.1 against 42.3
 * (benchmarks/results/beyond_hbm/session6/e/cpu_rates_*.json).
 * Why not AVX512-BF16's vdpbf16ps (two products a lane; the H200's host and the dev box have it):
 * int8 has no one-instruction exact widening to bf16 (vpmovsxbw gives int16, bf16 needs the
 * float32 convert and then vcvtne2ps2bf16), so QK would not lose instructions, and p @ V would
 * take bf16 weights, rounding them (and denormals flushed). A later dev box (2-core AMD EPYC,
 * AVX-512 with BF16; 256K cells, measure_cpu_attention, median of 7): int8 8.7 / 15.9 GB/s on
 * 1 / 2 threads, bf16 16.8 / 30.1: the same cells per second, so per-cell instructions, not
 * bytes, bound int8 there.
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
#ifdef __linux__
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RKV_AVX2 1
#else
#define RKV_AVX2 0
#endif
/* The 512-bit register-blocked path (x86-64-v4 builds; see the header comment). */
#if RKV_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RKV_AVX512 1
#else
#define RKV_AVX512 0
#endif

#define RKV_ABI_VERSION 4
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
  const void* const* ks_tiles;  /* int8 only, else NULL: each tile's k_scale [B,tile,K], in
                                 * scale_dtype */
  const void* const* vs_tiles;
  const int32_t* const* pos_tiles; /* each tile's k_pos [B,tile] */
  int64_t batch, q_len, num_heads, num_kv_heads, head_dim;
  int64_t n_tiles, tile;        /* S = n_tiles * tile */
  int64_t k_strides[3];         /* elements within a tile: batch, cell, kv head */
  int64_t v_strides[3];
  int64_t ks_strides[3];        /* elements (of scale_dtype) within a tile: batch, cell, kv head */
  int64_t vs_strides[3];
  int64_t pos_strides[2];       /* batch, cell */
  int32_t dtype;                /* K/V: RKV_F32, RKV_BF16, RKV_F16 or RKV_I8 */
  int32_t scale_dtype;          /* int8 scales (k and v alike): RKV_F32 or RKV_BF16 */
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
/* 1 when the head dims that take the register-blocked path (D % 16 == 0) run its 512-bit
 * variant (for the dtypes RKV_WIDE selects), 0 when they run the 256-bit one. */
int rkv_cpu_kernel_has_avx512(void) { return RKV_AVX512; }
int rkv_cpu_kernel_max_threads(void) {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

/* The kernel's helper threads (the OpenMP team but its caller, thread 0) at a lower priority:
 * nice 0 (the default) leaves them as they are. Why: while the kernel runs, its team holds all cores but
 * one, and PJRT's work threads, which enqueue the streamed tiles' host-to-device copies, waited
 * for a core (0.5-2.5 ms per copy in the host share's traces, docs/DESIGN.md section 6). At a
 * higher nice value a team thread yields its core to them at once. The team's loop is scheduled
 * dynamically, so a thread preempted for a while delays the kernel by little. Linux only (a
 * no-op elsewhere); best effort: a thread whose priority cannot be changed keeps running as it
 * is. A team thread keeps the value it was given until it is given another (OpenMP reuses its
 * threads), and lowering it back needs CAP_SYS_NICE. */
static volatile int g_worker_nice = 0;
void rkv_cpu_kernel_set_worker_nice(int nice) { g_worker_nice = nice; }

static void apply_worker_nice(void) {
#if defined(_OPENMP) && defined(__linux__)
  static __thread int applied = 0;
  const int want = g_worker_nice;
  if (want == applied || omp_get_thread_num() == 0) return;
  if (want <= 0 && applied == 0) return;
  (void)setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), want);
  applied = want;
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

/* An int8 scale at p: bfloat16 (bf16 != 0) widened exactly, or float32. */
RKV_INLINE float load_scale(const char* p, const int bf16) {
  if (bf16) { uint16_t h; memcpy(&h, p, 2); return bf16_to_f32(h); }
  float f;
  memcpy(&f, p, 4);
  return f;
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

/* The Cephes expf constants, shared by exp256 and exp512: the clamp, log2(e), ln 2 in two parts
 * (x = n ln2 + r exactly) and the degree-5 polynomial in r. */
#define RKV_EXP_LO -87.3365478515625f
#define RKV_EXP_HI 88.3762626647949f
#define RKV_EXP_LOG2E 1.44269504088896341f
#define RKV_EXP_LN2_HI 0.693359375f
#define RKV_EXP_LN2_LO -2.12194440e-4f
#define RKV_EXP_P0 1.9875691500E-4f
#define RKV_EXP_P1 1.3981999507E-3f
#define RKV_EXP_P2 8.3334519073E-3f
#define RKV_EXP_P3 4.1665795894E-2f
#define RKV_EXP_P4 1.6666665459E-1f
#define RKV_EXP_P5 5.0000001201E-1f

/* exp for x <= 0 (Cephes expf polynomial, ~1 ulp; inputs below -87.3 give ~1e-38, not 0). */
static inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(RKV_EXP_LO));
  x = _mm256_min_ps(x, _mm256_set1_ps(RKV_EXP_HI));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(RKV_EXP_LOG2E), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(RKV_EXP_LN2_HI), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(RKV_EXP_LN2_LO), x);
  __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(RKV_EXP_P0);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(RKV_EXP_P1));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(RKV_EXP_P2));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(RKV_EXP_P3));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(RKV_EXP_P4));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(RKV_EXP_P5));
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
  const char** kscell;  /* scale_dtype bytes */
  const char** vscell;
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

#if RKV_AVX512
/* ------------------------------------------------------------------------------------------ */
/* The same register-blocked path at 512 bits (x86-64-v4 builds)                               */
/* ------------------------------------------------------------------------------------------ */
/* Why: on the 256-bit path int8 is compute bound (the H200 host reads int8 at ~51 GB/s where
 * bf16 reaches 78-86): every 8 elements cost a sign-extend, a convert and one FMA per query row,
 * on the two vector ports that also run the FMAs. At 512 bits each of those instructions does 16
 * lanes (a D = 128 row is 8 zmm), so the same work takes about half the instructions; the 32
 * vector registers also let a 4-row group keep 4 cells x 4 rows = 16 dot-product chains.
 *
 * Column order: bf16 comes 32 elements per 512-bit load, `x << 16` = the 16 even elements and
 * `x & 0xffff0000` = the 16 odd ones, so q rows and V accumulators of this path keep each full 32
 * columns as (16 even, 16 odd) (rkv_perm_row); a last 16 columns (D % 32 == 16) are zero-
 * extended in natural order. Other dtypes: natural order (int8 sign-extends 16 bytes, f16
 * converts 16 halves with vcvtph2ps). */
#ifndef RKV_WIDE
/* The dtypes that take this path (the others keep the 256-bit one): all of them, each measured
 * faster than at 256 bits (dev box, one thread, bf16 +17%, int8 +40%, f16 and f32 +7-9% out of
 * cache, more in L2). Build with -D'RKV_WIDE(dtype)=0' to compare. */
#define RKV_WIDE(dtype) 1
#endif
#define RKV_IN_ZREG(x) __asm__("" : "+v"(x))

/* Path-order elements [d + 16 * half, d + 16 * half + 16) of a row whose 32 columns [d, d + 32)
 * are all inside the row (d % 32 == 0). */
RKV_INLINE __m512 wload(const char* p, int64_t d, const int half, const int dtype) {
  switch (dtype) {
    case RKV_F32: return _mm512_loadu_ps((const float*)p + d + 16 * half);
    case RKV_BF16: {
      const __m512i x = _mm512_loadu_si512((const void*)((const uint16_t*)p + d));
      return _mm512_castsi512_ps(half ? _mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u))
                                      : _mm512_slli_epi32(x, 16));
    }
    case RKV_F16:
      return _mm512_cvtph_ps(
          _mm256_loadu_si256((const __m256i*)((const uint16_t*)p + d + 16 * half)));
    default:
      return _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + d + 16 * half))));
  }
}

/* Elements [d, d + 16) in natural order: the last 16 columns when D % 32 == 16. */
RKV_INLINE __m512 wload_tail(const char* p, int64_t d, const int dtype) {
  if (dtype == RKV_BF16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)p + d))), 16));
  return wload(p, d, 0, dtype);
}

/* Lane i of the result = the sum of the 16 lanes of v[i]. A tree of 15 two-source shuffle pairs
 * and adds: pairs of vectors fold their 256-bit halves, then their 128-bit lanes, then within
 * the lanes. Traced through, output lane 4k + m ends up holding the vector passed in position
 * 4m + k, hence the transposed indexing of v. */
RKV_INLINE __m512 hsum16x16(const __m512* v) {
  __m512 b[8], c[4], e[2];
  for (int i = 0; i < 8; i++) {
    const int i0 = 2 * i, i1 = 2 * i + 1;
    const __m512 x = v[4 * (i0 % 4) + i0 / 4], y = v[4 * (i1 % 4) + i1 / 4];
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xee));
  }
  for (int i = 0; i < 4; i++)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
  for (int i = 0; i < 2; i++)
    e[i] = _mm512_add_ps(_mm512_unpacklo_ps(c[2 * i], c[2 * i + 1]),
                         _mm512_unpackhi_ps(c[2 * i], c[2 * i + 1]));
  const __m512d e0 = _mm512_castps_pd(e[0]), e1 = _mm512_castps_pd(e[1]);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(e0, e1)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(e0, e1)));
}

/* Lane i of the result = the sum of the 16 lanes of v[i], 8 vectors: fold each vector's 256-bit
 * halves, then the 256-bit tree of the other path. */
RKV_INLINE __m256 hsum8x16(const __m512* v) {
  __m256 h[8];
  for (int i = 0; i < 8; i++)
    h[i] = _mm256_add_ps(_mm512_castps512_ps256(v[i]),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v[i]), 1)));
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(h[4], h[5]), _mm256_hadd_ps(h[6], h[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* exp256 at 16 lanes (same polynomial); vscalefps applies the 2^n. */
static inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(RKV_EXP_LO));
  x = _mm512_min_ps(x, _mm512_set1_ps(RKV_EXP_HI));
  __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(RKV_EXP_LOG2E), _mm512_set1_ps(0.5f));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(RKV_EXP_LN2_HI), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(RKV_EXP_LN2_LO), x);
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 y = _mm512_set1_ps(RKV_EXP_P0);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(RKV_EXP_P1));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(RKV_EXP_P2));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(RKV_EXP_P3));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(RKV_EXP_P4));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(RKV_EXP_P5));
  y = _mm512_fmadd_ps(y, z, x);
  y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, fx);
}

/* For 4 vectors v[r]: lanes 4r..4r+3 of the result = the max (MAX) or the sum of the 16 lanes
 * of v[r]. The same folding as hsum16x16, stopped at 4 vectors and finished within the lanes. */
RKV_INLINE __m512 hred4(const __m512* v, const int MAX) {
#define RKV_OP(a, b) (MAX ? _mm512_max_ps(a, b) : _mm512_add_ps(a, b))
  const __m512 b0 = RKV_OP(_mm512_shuffle_f32x4(v[0], v[1], 0x44),
                           _mm512_shuffle_f32x4(v[0], v[1], 0xee));
  const __m512 b1 = RKV_OP(_mm512_shuffle_f32x4(v[2], v[3], 0x44),
                           _mm512_shuffle_f32x4(v[2], v[3], 0xee));
  __m512 c = RKV_OP(_mm512_shuffle_f32x4(b0, b1, 0x88), _mm512_shuffle_f32x4(b0, b1, 0xdd));
  c = RKV_OP(c, _mm512_permute_ps(c, 0x4e));
  return RKV_OP(c, _mm512_permute_ps(c, 0xb1));
#undef RKV_OP
}

/* The softmax step of 4 query rows at once (the 512-bit path's rows-parallel form of the per-row
 * code in attend_impl, which it must match): lg rows (stride RKV_BLOCK) hold the logits of nvp
 * lanes (nv8 computed, the rest stale), madd[r] the row's mask. Leaves the weights in lg and
 * updates m, l, alpha, seen of the 4 rows; returns whether a row saw a key. The max, the
 * rescale factor and the sum of each row come from one vector op for all 4 rows, not 4 serial
 * reductions and 4 expf calls. */
RKV_INLINE int softmax4_w(float* restrict lg, const float* const* madd, const float* kfac,
                          const float* vfac, float* m, float* l, float* alpha, uint8_t* seen,
                          int nvp, const int quant) {
  const __m512 ninf = _mm512_set1_ps(-INFINITY), zero = _mm512_setzero_ps();
  const int nz = nvp / 16;  /* 1 or 2 */
  __m512 x[4][2], mr[4];
  int nan_row[4];
  for (int r = 0; r < 4; r++) {
    __mmask16 nan = 0;
    for (int i = 0; i < 2; i++) {
      if (i >= nz) { x[r][i] = ninf; continue; }
      __m512 v = _mm512_load_ps(lg + r * RKV_BLOCK + 16 * i);
      if (quant) v = _mm512_mul_ps(v, _mm512_load_ps(kfac + 16 * i));
      /* the select of the per-row code: masked lanes -inf, a NaN left is one the row reads */
      const __m512 ma = _mm512_load_ps(madd[r] + 16 * i);
      v = _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(ma, zero, _CMP_NEQ_UQ), ma);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      x[r][i] = v;
    }
    mr[r] = _mm512_max_ps(x[r][0], x[r][1]);
    nan_row[r] = nan != 0;
  }
  const __m512i idx4 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512 mold = _mm512_permutexvar_ps(idx4, _mm512_castps128_ps512(_mm_loadu_ps(m)));
  const __m512 lold = _mm512_permutexvar_ps(idx4, _mm512_castps128_ps512(_mm_loadu_ps(l)));
  const __m512 mx = hred4(mr, 1);
  const __m512 mnew = _mm512_max_ps(mold, mx);
  const __m512 al = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(mold, ninf, _CMP_NEQ_OQ),
                                        exp512(_mm512_sub_ps(mold, mnew)));
  __m512 sr[4];
  for (int r = 0; r < 4; r++) {
    __m512 mb;
    switch (r) {  /* row r's lanes to all 16 */
      case 0: mb = _mm512_shuffle_f32x4(mnew, mnew, 0x00); break;
      case 1: mb = _mm512_shuffle_f32x4(mnew, mnew, 0x55); break;
      case 2: mb = _mm512_shuffle_f32x4(mnew, mnew, 0xaa); break;
      default: mb = _mm512_shuffle_f32x4(mnew, mnew, 0xff); break;
    }
    sr[r] = zero;
    for (int i = 0; i < nz; i++) {
      const __m512 v = x[r][i];
      __m512 p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, ninf, _CMP_NEQ_OQ),
                                     exp512(_mm512_sub_ps(v, mb)));
      sr[r] = _mm512_add_ps(sr[r], p);
      if (quant) p = _mm512_mul_ps(p, _mm512_load_ps(vfac + 16 * i));
      _mm512_store_ps(lg + r * RKV_BLOCK + 16 * i, p);
    }
  }
  const __m512 lnew = _mm512_fmadd_ps(lold, al, hred4(sr, 0));
  float t_mx[16], t_m[16], t_l[16], t_al[16];
  _mm512_storeu_ps(t_mx, mx);
  _mm512_storeu_ps(t_m, mnew);
  _mm512_storeu_ps(t_l, lnew);
  _mm512_storeu_ps(t_al, al);
  int any = 0;
  for (int r = 0; r < 4; r++) {
    if (nan_row[r] || t_mx[4 * r] == -INFINITY) {
      /* As the per-row code: a row that read a NaN gets l = NaN (sticky), one that saw no key
       * keeps m and l; both add 0 * V to an unscaled acc. */
      if (nan_row[r]) l[r] = NAN;
      for (int i = 0; i < nz; i++) _mm512_store_ps(lg + r * RKV_BLOCK + 16 * i, zero);
      alpha[r] = 1.0f;
      seen[r] = 0;
      continue;
    }
    m[r] = t_m[4 * r];
    l[r] = t_l[4 * r];
    alpha[r] = t_al[4 * r];
    seen[r] = 1;
    any = 1;
  }
  return any;
}

/* One 16-column step of qk_rows_w: the NC cells' K chunks converted once, FMAed into NR rows. */
RKV_INLINE void qk_step_w(const float* restrict q, int64_t Dp, const char* const* kp,
                          int64_t koff, int64_t d, const int half, const int tail,
                          const int dtype, __m512* a, const int NR, const int NC) {
  __m512 k[8];
  for (int c = 0; c < NC; c++)
    k[c] = tail ? wload_tail(kp[c] + koff, d, dtype) : wload(kp[c] + koff, d, half, dtype);
  for (int r = 0; r < NR; r++) {
    __m512 qv = _mm512_load_ps(q + r * Dp + d + 16 * half);
    if (NC > 1) RKV_IN_ZREG(qv);
    for (int c = 0; c < NC; c++) a[r * NC + c] = _mm512_fmadd_ps(qv, k[c], a[r * NC + c]);
  }
}

/* qk_rows at 512 bits: NC = 4 cells for 3-4 rows (12-16 chains), 8 for 1-2 rows. The key rows
 * are kp[j] + koff (the cells' head-0 rows and the head's byte offset: no per-head table). */
RKV_INLINE void qk_rows_w(const float* restrict q, int64_t Dp, const char* const* kp,
                          int64_t koff, int nv8, int64_t D, const int dtype, float* restrict lg,
                          prefetcher* pf, int pf_n, const int NR) {
  const int NC = NR >= 3 ? 4 : 8;
  const int steps = nv8 / NC;
  const int pf_step = (pf_n + steps - 1) / steps;
  for (int j = 0; j < nv8; j += NC) {
    __m512 a[16];
    for (int x = 0; x < 16; x++) a[x] = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 32 <= D; d += 32) {
      qk_step_w(q, Dp, kp + j, koff, d, 0, 0, dtype, a, NR, NC);
      qk_step_w(q, Dp, kp + j, koff, d, 1, 0, dtype, a, NR, NC);
    }
    if (d < D) qk_step_w(q, Dp, kp + j, koff, d, 0, 1, dtype, a, NR, NC);
    /* sum of a[r * NC + c] -> lg[r * RKV_BLOCK + j + c] */
    if (NR * NC <= 8) {
      _mm256_storeu_ps(lg + j, hsum8x16(a));  /* NR = 1, NC = 8 */
    } else {
      const __m512 s = hsum16x16(a);
      if (NC == 8) {
        _mm256_storeu_ps(lg + j, _mm512_castps512_ps256(s));
        _mm256_storeu_ps(lg + RKV_BLOCK + j,
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
      } else {
        _mm_storeu_ps(lg + j, _mm512_castps512_ps128(s));
        _mm_storeu_ps(lg + RKV_BLOCK + j, _mm512_extractf32x4_ps(s, 1));
        _mm_storeu_ps(lg + 2 * RKV_BLOCK + j, _mm512_extractf32x4_ps(s, 2));
        if (NR == 4) _mm_storeu_ps(lg + 3 * RKV_BLOCK + j, _mm512_extractf32x4_ps(s, 3));
      }
    }
    prefetch_some(pf, pf_step);
  }
}

/* pv_rows_part at 512 bits: DC chunks of 16 columns (DC even, or DC = 1 for the natural-order
 * last 16 columns of D % 32 == 16), NR * DC <= 16 accumulator chains. */
RKV_INLINE int64_t pv_rows_part_w(float* restrict acc, int64_t Dp, const float* restrict alpha,
                                  const float* restrict w, const char* const* vp, int64_t voff,
                                  int nv, int64_t d0, int64_t d1, const int dtype,
                                  prefetcher* pf, int pf_step, const int NR, const int DC) {
  int64_t d = d0;
  for (; d + 16 * DC <= d1; d += 16 * DC) {
    __m512 c[16];
    for (int r = 0; r < NR; r++) {
      const __m512 al = _mm512_set1_ps(alpha[r]);
      for (int x = 0; x < DC; x++)
        c[r * DC + x] = _mm512_mul_ps(_mm512_load_ps(acc + r * Dp + d + 16 * x), al);
    }
    for (int j = 0; j < nv; j++) {
      const char* vr = vp[j] + voff + (int64_t)elem_size(dtype) * d;  /* constant offsets below */
      __m512 v[8];
      for (int x = 0; x < DC; x++)
        v[x] = DC == 1 ? wload_tail(vr, 0, dtype) : wload(vr, 32 * (x / 2), x % 2, dtype);
      for (int r = 0; r < NR; r++) {
        const __m512 wj = _mm512_set1_ps(w[r * RKV_BLOCK + j]);
        for (int x = 0; x < DC; x++) c[r * DC + x] = _mm512_fmadd_ps(wj, v[x], c[r * DC + x]);
      }
    }
    for (int r = 0; r < NR; r++)
      for (int x = 0; x < DC; x++) _mm512_store_ps(acc + r * Dp + d + 16 * x, c[r * DC + x]);
    prefetch_some(pf, pf_step);
  }
  return d;
}

/* pv_rows at 512 bits: the columns in steps of 16 * DC (DC = 8 for 1-2 rows, 4 for 3-4), the
 * rest in halving steps, so a DC = 1 step is only ever the last 16 columns. */
RKV_INLINE void pv_rows_w(float* restrict acc, int64_t Dp, const float* restrict alpha,
                          const float* restrict w, const char* const* vp, int64_t voff, int nv,
                          int64_t D, const int dtype, prefetcher* pf, int pf_n, const int NR) {
  const int DC = NR >= 3 ? 4 : 8;
  const int64_t n16 = D / 16;
  const int steps = (int)(n16 / DC + __builtin_popcountll((unsigned long long)(n16 % DC)));
  const int pf_step = (pf_n + steps - 1) / steps;
  int64_t d = pv_rows_part_w(acc, Dp, alpha, w, vp, voff, nv, 0, D, dtype, pf, pf_step, NR, DC);
  if (DC > 4) d = pv_rows_part_w(acc, Dp, alpha, w, vp, voff, nv, d, D, dtype, pf, pf_step, NR, 4);
  d = pv_rows_part_w(acc, Dp, alpha, w, vp, voff, nv, d, D, dtype, pf, pf_step, NR, 2);
  pv_rows_part_w(acc, Dp, alpha, w, vp, voff, nv, d, D, dtype, pf, pf_step, NR, 1);
}
#endif

#if RKV_AVX2
/* The register-blocked path's column order for bf16 (load16 / wload): each full 2 * hw columns
 * of a row as (hw even, hw odd) elements, hw = 8 at 256 bits and 16 at 512; a last hw columns
 * that do not fill 2 * hw stay in natural order. rkv_perm_row: natural -> path order (q rows);
 * rkv_unperm_row: path order -> natural (the accumulators, on output). */
static void rkv_perm_row(float* row, int64_t D, int hw) {
  for (int64_t d = 0; d + 2 * hw <= D; d += 2 * hw) {
    float tmp[32];
    for (int e = 0; e < hw; e++) { tmp[e] = row[d + 2 * e]; tmp[hw + e] = row[d + 2 * e + 1]; }
    memcpy(row + d, tmp, sizeof(float) * 2 * hw);
  }
}

static void rkv_unperm_row(float* dst, const float* src, int64_t D, int hw) {
  int64_t d = 0;
  for (; d + 2 * hw <= D; d += 2 * hw)
    for (int e = 0; e < hw; e++) {
      dst[d + 2 * e] = src[d + e];
      dst[d + 2 * e + 1] = src[d + hw + e];
    }
  for (; d < D; d++) dst[d] = src[d];
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
  /* Scale cells are addressed in bytes (scale_dtype's size, fixed for the call). */
  const int sbf = quant && a->scale_dtype == RKV_BF16;
  const int64_t ses = sbf ? 2 : 4;
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
#if RKV_AVX512
  const int wide = fast && RKV_WIDE(dtype);  /* its 512-bit variant */
#else
  const int wide = 0;
#endif
  const int perm_hw = wide ? 16 : 8;  /* bf16 column order: rkv_perm_row */
  (void)perm_hw;
#if RKV_AVX2
  if (fast && RKV_PERM16(dtype))
    for (int64_t x = 0; x < K * R; x++) rkv_perm_row(w->qs + x * Dp, D, perm_hw);
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
        w->kscell[nv] = (const char*)a->ks_tiles[n] + ses * (b * kss[0] + i * kss[1]);
        w->vscell[nv] = (const char*)a->vs_tiles[n] + ses * (b * vss[0] + i * vss[1]);
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
    /* Lanes the softmax vectors cover: the 512-bit path's are 16 wide. */
    const int nvp = wide ? (nv + 15) & ~15 : nv8;
    prefetcher pf;  /* the next block, a 1/K share during each head's compute */
    prefetch_init(&pf, w->nkcell, w->nvcell, (int)nxt, (int)K, es * ks[2], es * vs[2], row_bytes);
    int pf_head = (int)(2 * nxt * lines_per_row);
    if (wide) {
      /* The 512-bit path budgets the next block's exact line count, a 1/K share per head: the
       * +1 per row above overstates int8 rows (128 bytes: 3 lines for 2, and one range per cell
       * when the heads are contiguous), which issued all prefetches in the first 2/3 of the
       * block; spread over the whole block int8 streamed 12% faster (dev box, one thread). */
      const int contig = es * ks[2] == row_bytes && es * vs[2] == row_bytes;
      const int64_t range = contig ? row_bytes * K : row_bytes, n_ranges = contig ? 1 : K;
      pf_head = (int)((2 * nxt * n_ranges * ((range + 63) / 64) + K - 1) / K);
    }
    for (int64_t t = 0; t < T; t++)
      for (int j = nv; j < nvp; j++) w->madd[t * RKV_BLOCK + j] = -INFINITY;
    if (wide)  /* masked lanes of the 512-bit path read cell 0 (it takes kcell, not kp) */
      for (int j = nv; j < nv8; j++) w->kcell[j] = w->kcell[0];

    for (int64_t kh = 0; kh < K; kh++) {
      const char* kp[RKV_BLOCK];
      const char* vp[RKV_BLOCK];
      const int64_t koff = es * kh * ks[2], voff = es * kh * vs[2];  /* the head's bytes */
      if (!wide)
        for (int j = 0; j < nv; j++) {
          kp[j] = w->kcell[j] + koff;
          vp[j] = w->vcell[j] + voff;
        }
      if (quant) {
        const int64_t kso = ses * kh * kss[2], vso = ses * kh * vss[2];  /* the head's bytes */
        if (sbf)  /* two loops: the dtype test stays out of the per-cell one */
          for (int j = 0; j < nv; j++) {
            w->kfac[j] = load_scale(w->kscell[j] + kso, 1);
            w->vfac[j] = load_scale(w->vscell[j] + vso, 1);
          }
        else
          for (int j = 0; j < nv; j++) {
            w->kfac[j] = load_scale(w->kscell[j] + kso, 0);
            w->vfac[j] = load_scale(w->vscell[j] + vso, 0);
          }
      }
      for (int j = nv; j < nv8; j++) {  /* masked lanes */
        if (!wide) kp[j] = kp[0];
        w->kfac[j] = 1.0f;
      }
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
          const int nr = R - r0 >= 4 ? 4 : (int)(R - r0);
#if RKV_AVX512
          if (wide) {
            switch (nr) {
              case 4: qk_rows_w(qr, Dp, w->kcell, koff, nv8, D, dtype, lgr, &pf, pn, 4); break;
              case 3: qk_rows_w(qr, Dp, w->kcell, koff, nv8, D, dtype, lgr, &pf, pn, 3); break;
              case 2: qk_rows_w(qr, Dp, w->kcell, koff, nv8, D, dtype, lgr, &pf, pn, 2); break;
              default: qk_rows_w(qr, Dp, w->kcell, koff, nv8, D, dtype, lgr, &pf, pn, 1); break;
            }
            continue;
          }
#endif
          switch (nr) {
            case 4: qk_rows(qr, Dp, kp, nv8, D, dtype, lgr, &pf, pn, 4); break;
            case 3: qk_rows(qr, Dp, kp, nv8, D, dtype, lgr, &pf, pn, 3); break;
            case 2: qk_rows(qr, Dp, kp, nv8, D, dtype, lgr, &pf, pn, 2); break;
            default: qk_rows(qr, Dp, kp, nv8, D, dtype, lgr, &pf, pn, 1); break;
          }
        }
      }
#endif
      int64_t r_first = 0;  /* rows before it are done */
#if RKV_AVX512
      if (wide && !cap)  /* full groups of 4 rows; the rest (R % 4) row by row below */
        for (; r_first + 4 <= R; r_first += 4) {
          const float* mr[4];
          for (int x = 0; x < 4; x++) mr[x] = w->madd + (r_first + x) / G * RKV_BLOCK;
          any_row |= softmax4_w(w->lg + r_first * RKV_BLOCK, mr, w->kfac, w->vfac, m + r_first,
                                l + r_first, w->alpha + r_first, w->seen + r_first, nvp, quant);
        }
#endif
      for (int64_t r = r_first; r < R; r++) {
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
          const int nr = R - r0 >= 4 ? 4 : (int)(R - r0);
#if RKV_AVX512
          if (wide) {
            switch (nr) {
              case 4: pv_rows_w(ar, Dp, al, wr, w->vcell, voff, nv, D, dtype, &pf, pn, 4); break;
              case 3: pv_rows_w(ar, Dp, al, wr, w->vcell, voff, nv, D, dtype, &pf, pn, 3); break;
              case 2: pv_rows_w(ar, Dp, al, wr, w->vcell, voff, nv, D, dtype, &pf, pn, 2); break;
              default: pv_rows_w(ar, Dp, al, wr, w->vcell, voff, nv, D, dtype, &pf, pn, 1); break;
            }
            continue;
          }
#endif
          switch (nr) {
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
    if (fast && RKV_PERM16(dtype))  /* back from the path's (even, odd) order */
      rkv_unperm_row(p_acc + x * D, w->acc + x * Dp, D, perm_hw);
    else
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
 * Returns 0, or -1 when memory could not be allocated, -2 on inconsistent arguments (int8 with
 * a scale_dtype other than RKV_F32 / RKV_BF16 among them). */
int rkv_cpu_attention(const rkv_attn_args* a, int num_threads, int64_t chunk, float* o,
                      float* lse) {
  const int64_t B = a->batch, T = a->q_len, H = a->num_heads, K = a->num_kv_heads;
  const int64_t D = a->head_dim;
  if (B < 1 || T < 1 || K < 1 || D < 1 || H % K != 0 || a->tile < 1 || a->n_tiles < 0 ||
      a->dtype < 0 || a->dtype > 3 ||
      (a->dtype == RKV_I8 && (!a->ks_tiles || !a->vs_tiles ||
                              (a->scale_dtype != RKV_F32 && a->scale_dtype != RKV_BF16))) ||
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
    apply_worker_nice();
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
