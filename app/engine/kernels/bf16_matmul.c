/* y = x @ W^T for a few bfloat16 rows x [M, K] and a bfloat16 weight W [N, K] (nn.Linear's own layout, so no
 * packed copy): the products of a bfloat16 model's decode steps (issue 16).
 *
 * With a few rows the product is bound by the bytes of W read from memory. Each thread takes one contiguous
 * slab of W's rows and streams it once: a group of G weight rows is read 32 values at a time, each chunk
 * multiplied into R rows of x with AVX512-BF16 `vdpbf16ps` (pairs of products summed into float32 lanes), and
 * the next group's rows are prefetched one group ahead. Every output is one float32 accumulator over K in
 * order, reduced across its 16 lanes by the same tree, then rounded to bfloat16 (nearest even) or kept in
 * float32: the same bits whatever M, the row grouping or the thread count, so a sequence decodes alike alone
 * and in a batch.
 *
 * Built by app/engine/kernels/build.py; the AVX-512 code is compiled for its target only, and callers check
 * bf16_matmul_supported() (the CPU's AVX512-BF16) first.
 */
#include <immintrin.h>
#include <stdint.h>

#include "threadpool.h"

#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))
/* Weight rows per slab unit: a thread's slab is a whole number of units, so groups never straddle threads. */
#define UNIT 8

int bf16_matmul_abi_version(void) { return 1; }

typedef struct {
  const uint16_t* x;
  int64_t ldx;
  const uint16_t* w;
  int64_t ldw;
  void* y;
  int64_t ldy, M, K, N, parts;
  int out_f32;
} bjob;

static inline uint16_t round_bf16(float f) {
  union {
    float f;
    uint32_t u;
  } v = {f};
  if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u); /* quiet NaN */
  return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

TGT static inline void store_out(const bjob* j, int64_t m, int64_t n, __m512 acc) {
  float s = _mm512_reduce_add_ps(acc);
  if (j->out_f32)
    ((float*)j->y)[m * j->ldy + n] = s;
  else
    ((uint16_t*)j->y)[m * j->ldy + n] = round_bf16(s);
}

/* Rows [m0, m0 + R) of y, outputs [n0, n0 + G): G weight rows times R rows of x, over K in chunks of 32. */
#define DEFINE_BLOCK(G, R)                                                                                     \
  TGT static void block_##G##_##R(const bjob* j, int64_t n0, int64_t m0, int prefetch) {                     \
    __m512 acc[R][G];                                                                                         \
    for (int r = 0; r < R; r++)                                                                               \
      for (int g = 0; g < G; g++) acc[r][g] = _mm512_setzero_ps();                                            \
    const uint16_t* w0 = j->w + n0 * j->ldw;                                                                  \
    const int64_t ahead = (int64_t)G * j->ldw; /* the next group's rows, one group ahead */                  \
    for (int64_t k = 0; k < j->K; k += 32) {                                                                  \
      __mmask32 mask = j->K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (j->K - k)) - 1u);     \
      __m512i wv[G];                                                                                          \
      for (int g = 0; g < G; g++) {                                                                           \
        const uint16_t* p = w0 + g * j->ldw + k;                                                              \
        if (prefetch) _mm_prefetch((const char*)(p + ahead), _MM_HINT_T0);                                    \
        wv[g] = _mm512_maskz_loadu_epi16(mask, p);                                                            \
      }                                                                                                       \
      for (int r = 0; r < R; r++) {                                                                           \
        __m512i xv = _mm512_maskz_loadu_epi16(mask, j->x + (m0 + r) * j->ldx + k);                            \
        for (int g = 0; g < G; g++) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], (__m512bh)xv, (__m512bh)wv[g]);  \
      }                                                                                                       \
    }                                                                                                         \
    for (int r = 0; r < R; r++)                                                                               \
      for (int g = 0; g < G; g++) store_out(j, m0 + r, n0 + g, acc[r][g]);                                    \
  }

DEFINE_BLOCK(8, 1)
DEFINE_BLOCK(8, 2)
DEFINE_BLOCK(4, 1)
DEFINE_BLOCK(4, 2)
DEFINE_BLOCK(4, 3)
DEFINE_BLOCK(4, 4)
DEFINE_BLOCK(4, 5)
DEFINE_BLOCK(1, 1)

typedef void (*block_fn)(const bjob*, int64_t, int64_t, int);

/* Outputs [n0, n0 + G) for every row: up to 2 rows against 8 weight rows (16 accumulators), else 4 weight rows
 * against up to 5 rows at a time (20 accumulators); the weights of later row groups come from L1/L2. */
TGT static void group(const bjob* j, int64_t n0, int64_t G) {
  static const block_fn by4[6] = {0, block_4_1, block_4_2, block_4_3, block_4_4, block_4_5};
  if (G == 8 && j->M <= 2) {
    (j->M == 1 ? block_8_1 : block_8_2)(j, n0, 0, 1);
    return;
  }
  if (G == 8) {
    group(j, n0, 4);
    group(j, n0 + 4, 4);
    return;
  }
  for (int64_t m0 = 0; m0 < j->M; m0 += 5) {
    int64_t R = j->M - m0 < 5 ? j->M - m0 : 5;
    by4[R](j, n0, m0, m0 == 0);
  }
}

static void part(void* arg, int64_t p) {
  const bjob* j = (const bjob*)arg;
  int64_t units = (j->N + UNIT - 1) / UNIT;
  int64_t n0 = units * p / j->parts * UNIT, n1 = units * (p + 1) / j->parts * UNIT;
  if (n1 > j->N) n1 = j->N;
  int64_t n = n0;
  for (; n + 8 <= n1; n += 8) group(j, n, 8);
  for (; n + 4 <= n1; n += 4) group(j, n, 4);
  for (; n < n1; n++)
    for (int64_t m = 0; m < j->M; m++) block_1_1(j, n, m, 0);
}

/* y [M, N] (row stride ldy; bfloat16, or float32 with out_f32) = x [M, K] (row stride ldx) @ w [N, K]^T (row
 * stride ldw), all bfloat16 as raw 16-bit words. */
void bf16_matmul(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, void* y, int64_t ldy, int64_t M,
                 int64_t K, int64_t N, int out_f32, int num_threads, int use_pool) {
  int64_t parts = (N + 63) / 64; /* at least 64 weight rows per thread */
  if (parts > num_threads) parts = num_threads;
  if (parts < 1) parts = 1;
  bjob job = {x, ldx, w, ldw, y, ldy, M, K, N, parts, out_f32};
  parallel_for(parts, part, &job, num_threads, use_pool);
}
