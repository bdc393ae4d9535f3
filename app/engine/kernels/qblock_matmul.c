/* Matrix products on GGUF-style quantized blocks, executed as they are (never widened to float in memory).
 *
 * A weight row is cut into blocks of 32; block b of row n holds unsigned codes u (4 or 8 bits), a scale d and
 * a min m (float16):  W[n, 32b + j] = d * (u_j - offset) + m.  Q4_1 is offset 0 with its own m; Q4_0 is offset
 * 8 and m = 0; Q8_0 is stored as u = q + 128, offset 128, m = 0. The activations are quantized per block of 32
 * to int8 (scale xs = max|x| / 127, llama.cpp's Q8_1), so a block's dot product is an exact integer sum:
 *
 *   y[r, n] = sum_b  d[n,b] * xs[r,b] * sum_j (u_j - offset) * xq[r, 32b + j]   +   m[n,b] * xsum[r,b]
 *
 * with xsum = xs * sum_j xq (the min term, Q4_1 only). The integer part runs on AVX512-VNNI dot products
 * (vpdpbusd: unsigned codes times signed activations, the offset folded in exactly as a per-lane start value of
 * -offset * sum(xq)), or on AVX2's maddubs where the CPU lacks VNNI; both give the same integers, and the float
 * part is the same code, so both builds give the same bits. Every output row is computed alike whatever the
 * number of rows in the call, so results do not depend on how requests are batched.
 *
 * Layout (qblock.py packs it): 4-bit codes in pairs of blocks, 32 bytes per pair, byte j holding block 2p's
 * code j in its low nibble and block 2p+1's in its high nibble (one load, a mask and a shift give 64 codes);
 * 8-bit codes one byte each. d and m are [N, nbp] float16, nbp = the blocks rounded up to 8, padded with zeros.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "threadpool.h"
#include "vec_math.h"

int qblock_matmul_abi_version(void) { return 1; }

#define QK 32
#define MAX_BLOCKS 1024 /* K <= 32768 */
#define ROW_TILE 4      /* activation rows per pass over a weight row */
#define PREFETCH 2048   /* bytes ahead in the codes (a weight chunk's rows are contiguous): DRAM latency */

typedef struct {
  const int8_t* xq;   /* [M, nb * 32] */
  const float* xs;    /* [M, nbp] */
  const float* xsum;  /* [M, nbp] */
  const int32_t* corr; /* [M, nb, 8]: -offset * the lane sums of xq (unused when offset is 0) */
  int64_t M, nb, nbp;
  const uint8_t* codes;
  const uint16_t *d, *m;
  int bits, offset, has_min;
  int64_t N;
  const float* bias;
  float* out;
  int64_t ldo;
  int64_t n_chunk, m_chunk, n_chunks;
} qjob;

/* ---- activations ---- */

typedef struct {
  const float* x;
  int64_t ldx, K, nb, nbp;
  int8_t* xq;
  float *xs, *xsum;
  int32_t* corr;
  int offset;
} quant_job;

static void quantize_row(void* arg, int64_t r) {
  const quant_job* j = (const quant_job*)arg;
  const float* x = j->x + r * j->ldx;
  int8_t* q = j->xq + r * j->nb * QK;
  float* xs = j->xs + r * j->nbp;
  float* xsum = j->xsum + r * j->nbp;
  int32_t* corr = j->corr + r * j->nb * 8;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < j->nb; b++) {
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
      int64_t k = b * QK + 8 * i;
      if (k + 8 <= j->K) {
        v[i] = _mm256_loadu_ps(x + k);
      } else { /* the last block of a K that is not a multiple of 32: zeros beyond it */
        float tmp[8] = {0};
        for (int t = 0; k + t < j->K && t < 8; t++) tmp[t] = x[k + t];
        v[i] = _mm256_loadu_ps(tmp);
      }
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    float scale = _mm_cvtss_f32(h) / 127.0f;
    __m256 inv = _mm256_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
    int32_t total = 0;
    for (int i = 0; i < 4; i++) {
      __m256i qi = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT));
      int32_t lanes[8];
      _mm256_storeu_si256((__m256i*)lanes, qi);
      for (int t = 0; t < 8; t++) q[b * QK + 8 * i + t] = (int8_t)lanes[t];
      /* lanes 2i and 2i+1 of the dot products hold bytes 8i..8i+3 and 8i+4..8i+7 */
      int32_t lo = lanes[0] + lanes[1] + lanes[2] + lanes[3], hi = lanes[4] + lanes[5] + lanes[6] + lanes[7];
      corr[b * 8 + 2 * i] = -j->offset * lo;
      corr[b * 8 + 2 * i + 1] = -j->offset * hi;
      total += lo + hi;
    }
    xs[b] = scale;
    xsum[b] = scale * (float)total;
  }
  for (int64_t b = j->nb; b < j->nbp; b++) xs[b] = xsum[b] = 0.0f;
}

/* ---- the integer dot product of one block (32 codes) with 32 activations, 8 int32 lanes ---- */

__attribute__((target("avx2,fma"))) static inline __m256i dot_avx2(__m256i u, __m256i x, __m256i start,
                                                                    int bits) {
  if (bits == 8) { /* codes up to 255 would saturate maddubs' int16 pairs: multiply |u - 128| by signed x */
    __m256i w = _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80));
    __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    /* start is -128 * lane sums for Q8_0; the signed product already is q * x, so leave it out */
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
  }
  __m256i p = _mm256_maddubs_epi16(u, x);
  return _mm256_add_epi32(start, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

__attribute__((target("avx2,fma,avx512f,avx512vl,avx512vnni"))) static inline __m256i dot_vnni(__m256i u, __m256i x,
                                                                                              __m256i start,
                                                                                              int bits) {
  (void)bits;
  return _mm256_dpbusd_epi32(start, u, x);
}

/* ---- one weight row against up to ROW_TILE activation rows ---- */

#define DEFINE_ROW_KERNEL(NAME, DOT, TARGET)                                                                   \
  __attribute__((target(TARGET), always_inline)) static inline void NAME##_rows(const qjob* j, int64_t n,        \
                                                                                int64_t r0, const int rows) {  \
    const int64_t nb = j->nb, nbp = j->nbp;                                                                    \
    const uint16_t* dn = j->d + n * nbp;                                                                       \
    _mm_prefetch((const char*)(dn + 4 * nbp), _MM_HINT_T0);                                                    \
    if (j->has_min) _mm_prefetch((const char*)(j->m + (n + 4) * nbp), _MM_HINT_T0);                            \
    float cs[ROW_TILE][MAX_BLOCKS] __attribute__((aligned(32)));                                               \
    __m256 acc0[ROW_TILE], acc1[ROW_TILE], accm[ROW_TILE];                                                     \
    for (int64_t r = 0; r < rows; r++) {                                                                       \
      const float* xs = j->xs + (r0 + r) * nbp;                                                                \
      for (int64_t b = 0; b < nbp; b += 8)                                                                     \
        _mm256_store_ps(&cs[r][b], _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dn + b))), \
                                                 _mm256_loadu_ps(xs + b)));                                    \
      acc0[r] = acc1[r] = accm[r] = _mm256_setzero_ps();                                                       \
    }                                                                                                          \
    const __m256i zero = _mm256_setzero_si256(), low = _mm256_set1_epi8(0x0F);                                \
    const int use_corr = j->offset != 0;                                                                       \
    if (j->bits == 4) {                                                                                        \
      const uint8_t* c = j->codes + n * (nb / 2) * QK;                                                         \
      for (int64_t p = 0; p < nb / 2; p++) {                                                                   \
        _mm_prefetch((const char*)(c + p * QK) + PREFETCH, _MM_HINT_T0);                                       \
        __m256i v = _mm256_loadu_si256((const __m256i*)(c + p * QK));                                          \
        __m256i u0 = _mm256_and_si256(v, low), u1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);           \
        for (int64_t r = 0; r < rows; r++) {                                                                   \
          const int8_t* xq = j->xq + (r0 + r) * nb * QK + 2 * p * QK;                                          \
          const int32_t* cr = j->corr + (r0 + r) * nb * 8 + 2 * p * 8;                                         \
          __m256i s0 = use_corr ? _mm256_loadu_si256((const __m256i*)cr) : zero;                               \
          __m256i s1 = use_corr ? _mm256_loadu_si256((const __m256i*)(cr + 8)) : zero;                         \
          __m256i i0 = DOT(u0, _mm256_loadu_si256((const __m256i*)xq), s0, 4);                                 \
          __m256i i1 = DOT(u1, _mm256_loadu_si256((const __m256i*)(xq + QK)), s1, 4);                          \
          acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_set1_ps(cs[r][2 * p]), acc0[r]);            \
          acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_set1_ps(cs[r][2 * p + 1]), acc1[r]);        \
        }                                                                                                      \
      }                                                                                                        \
    } else {                                                                                                   \
      const uint8_t* c = j->codes + n * nb * QK;                                                               \
      for (int64_t b = 0; b < nb; b++) {                                                                       \
        _mm_prefetch((const char*)(c + b * QK) + PREFETCH, _MM_HINT_T0);                                       \
        __m256i u = _mm256_loadu_si256((const __m256i*)(c + b * QK));                                          \
        for (int64_t r = 0; r < rows; r++) {                                                                   \
          const int8_t* xq = j->xq + (r0 + r) * nb * QK + b * QK;                                              \
          const int32_t* cr = j->corr + (r0 + r) * nb * 8 + b * 8;                                             \
          __m256i s = use_corr ? _mm256_loadu_si256((const __m256i*)cr) : zero;                                \
          __m256i i = DOT(u, _mm256_loadu_si256((const __m256i*)xq), s, 8);                                    \
          if (b & 1)                                                                                           \
            acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(cs[r][b]), acc1[r]);               \
          else                                                                                                 \
            acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(cs[r][b]), acc0[r]);               \
        }                                                                                                      \
      }                                                                                                        \
    }                                                                                                          \
    if (j->has_min) {                                                                                          \
      const uint16_t* mn = j->m + n * nbp;                                                                     \
      for (int64_t b = 0; b < nbp; b += 8) {                                                                   \
        __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(mn + b)));                                \
        for (int64_t r = 0; r < rows; r++)                                                                     \
          accm[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(j->xsum + (r0 + r) * nbp + b), accm[r]);               \
      }                                                                                                        \
    }                                                                                                          \
    float bias = j->bias ? j->bias[n] : 0.0f;                                                                  \
    for (int64_t r = 0; r < rows; r++)                                                                         \
      j->out[(r0 + r) * j->ldo + n] = hsum256(_mm256_add_ps(acc0[r], acc1[r])) + hsum256(accm[r]) + bias;     \
  }                                                                                                            \
  /* one copy per tile height, so the accumulators stay in registers */                                        \
  __attribute__((target(TARGET))) static void NAME(const qjob* j, int64_t n, int64_t r0, int64_t rows) {        \
    switch (rows) {                                                                                            \
      case 1: NAME##_rows(j, n, r0, 1); break;                                                                 \
      case 2: NAME##_rows(j, n, r0, 2); break;                                                                 \
      case 3: NAME##_rows(j, n, r0, 3); break;                                                                 \
      default: NAME##_rows(j, n, r0, 4); break;                                                                \
    }                                                                                                          \
  }

DEFINE_ROW_KERNEL(row_avx2, dot_avx2, "avx2,fma,f16c")
DEFINE_ROW_KERNEL(row_vnni, dot_vnni, "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")

typedef void (*row_fn)(const qjob*, int64_t, int64_t, int64_t);

typedef struct {
  const qjob* job;
  row_fn row;
} qtask;

static void matmul_chunk(void* arg, int64_t c) {
  const qtask* t = (const qtask*)arg;
  const qjob* j = t->job;
  int64_t nc = c % j->n_chunks, mc = c / j->n_chunks;
  int64_t n0 = nc * j->n_chunk, n1 = n0 + j->n_chunk < j->N ? n0 + j->n_chunk : j->N;
  int64_t m0 = mc * j->m_chunk, m1 = m0 + j->m_chunk < j->M ? m0 + j->m_chunk : j->M;
  for (int64_t r = m0; r < m1; r += ROW_TILE) {
    int64_t rows = m1 - r < ROW_TILE ? m1 - r : ROW_TILE;
    for (int64_t n = n0; n < n1; n++) t->row(j, n, r, rows);
  }
}

/* Scratch bytes the activations of M rows of K need (quantized values, scales, sums, lane corrections). */
int64_t qblock_scratch_bytes(int64_t M, int64_t K) {
  int64_t nb = (K + QK - 1) / QK, nbp = (nb + 7) / 8 * 8;
  return M * (nb * QK + 2 * nbp * 4 + nb * 32) + 64;
}

/* y[M, N] (row stride ldo) = x[M, K] (row stride ldx) times the quantized weight (layout above) + bias.
 * bits 4 (nb even) or 8; offset 0, 8 or 128; has_min for a per-block min. scratch: qblock_scratch_bytes.
 * isa 1 uses AVX512-VNNI (the caller checks the CPU), 0 AVX2. Returns 0, or -1 for a shape it does not take. */
int qblock_matmul(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* codes, const uint16_t* d,
                  const uint16_t* m, int bits, int offset, int has_min, int64_t N, const float* bias, float* out,
                  int64_t ldo, void* scratch, int isa, int threads, int use_pool) {
  int64_t nb = (K + QK - 1) / QK, nbp = (nb + 7) / 8 * 8;
  if (M <= 0 || N <= 0 || nb > MAX_BLOCKS || (bits != 4 && bits != 8) || (bits == 4 && nb % 2)) return -1;
  char* s = (char*)(((uintptr_t)scratch + 31) & ~(uintptr_t)31);
  int8_t* xq = (int8_t*)s;
  float* xs = (float*)(s + M * nb * QK);
  float* xsum = xs + M * nbp;
  int32_t* corr = (int32_t*)(xsum + M * nbp);
  quant_job qj = {x, ldx, K, nb, nbp, xq, xs, xsum, corr, offset};
  parallel_for(M, quantize_row, &qj, M >= 16 ? threads : 1, use_pool);
  qjob j = {xq, xs, xsum, corr, M, nb, nbp, codes, d, m, bits, offset, has_min, N, bias, out, ldo, 0, 0, 0};
  /* Chunks: weight rows split so every thread gets several, activation rows in tiles that stay in L2. */
  j.m_chunk = M < 64 ? M : 64;
  int64_t m_chunks = (M + j.m_chunk - 1) / j.m_chunk;
  int64_t want = (int64_t)threads * 8 / m_chunks + 1;
  j.n_chunk = (N + want - 1) / want;
  if (j.n_chunk < 8) j.n_chunk = 8;
  j.n_chunks = (N + j.n_chunk - 1) / j.n_chunk;
  qtask t = {&j, isa == 1 ? row_vnni : row_avx2};
  parallel_for(j.n_chunks * m_chunks, matmul_chunk, &t, threads, use_pool);
  return 0;
}
