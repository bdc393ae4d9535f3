/* y = x @ W^T for a few bfloat16 rows x [M, K] and a bfloat16 weight W [N, K] (nn.Linear's own layout, so no
 * packed copy): the products of a bfloat16 model's decode steps (issue 16).
 *
 * With a few rows the product is bound by the bytes of W read from memory. Each thread takes one contiguous
 * slab of W's rows and streams it once, front to back, with AVX512-BF16 `vdpbf16ps` (pairs of products summed
 * into float32 lanes). Every output is one float32 accumulator over K in order, reduced across its 16 lanes
 * by the same tree, then rounded to bfloat16 (nearest even) or kept in float32: the same bits whatever M or
 * the thread count, so a sequence decodes alike alone and in a batch.
 *
 * Built by app/engine/kernels/build.py; the AVX-512 code is compiled for its target only, and callers check
 * bf16_matmul_supported() (the CPU's AVX512-BF16) first.
 */
#include <immintrin.h>
#include <stdint.h>

#include "threadpool.h"

#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))
/* A thread's slab of weight rows is a whole number of these (the split depends only on N and the thread count). */
#define UNIT 8
/* Bytes of a thread's part of the next weight fetched ahead (bf16_matmul_then). */
#ifndef PREFETCH_NEXT
#define PREFETCH_NEXT 16384
#endif

int bf16_matmul_abi_version(void) { return 2; }

typedef struct {
  const uint16_t* x;
  int64_t ldx;
  const uint16_t* w;
  int64_t ldw;
  void* y;
  int64_t ldy, M, K, N, parts;
  int out_f32;
  const uint16_t* next_w; /* the weight the caller multiplies next, or NULL (see bf16_matmul_then) */
  int64_t next_ldw, next_N, next_parts;
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

/* Output n for rows [m0, m0 + R): weight row n read once, 32 values at a time, straight through (one sequential
 * stream per thread, which the hardware prefetcher follows at full speed: measured 1.2-1.9x faster on an
 * AVX512-BF16 EPYC than reading 2-8 weight rows side by side), each chunk multiplied into R rows of x held in L1. */
#define DEFINE_ROW(R)                                                                                          \
  TGT static void row_##R(const bjob* j, int64_t n, int64_t m0) {                                             \
    __m512 acc[R];                                                                                            \
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                                                 \
    const uint16_t* wr = j->w + n * j->ldw;                                                                   \
    const uint16_t* x0 = j->x + m0 * j->ldx;                                                                  \
    int64_t k = 0;                                                                                            \
    for (; k + 32 <= j->K; k += 32) {                                                                         \
      __m512i wv = _mm512_loadu_si512(wr + k);                                                                \
      for (int r = 0; r < R; r++)                                                                             \
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(x0 + r * j->ldx + k), (__m512bh)wv);   \
    }                                                                                                         \
    if (k < j->K) {                                                                                           \
      __mmask32 mask = (__mmask32)((1u << (j->K - k)) - 1u);                                                  \
      __m512i wv = _mm512_maskz_loadu_epi16(mask, wr + k);                                                    \
      for (int r = 0; r < R; r++)                                                                             \
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_maskz_loadu_epi16(mask, x0 + r * j->ldx + k),      \
                                  (__m512bh)wv);                                                              \
    }                                                                                                         \
    for (int r = 0; r < R; r++) store_out(j, m0 + r, n, acc[r]);                                              \
  }

DEFINE_ROW(1)
DEFINE_ROW(2)
DEFINE_ROW(3)
DEFINE_ROW(4)
DEFINE_ROW(5)
DEFINE_ROW(6)
DEFINE_ROW(7)
DEFINE_ROW(8)

typedef void (*row_fn)(const bjob*, int64_t, int64_t);
static const row_fn ROWS[9] = {0, row_1, row_2, row_3, row_4, row_5, row_6, row_7, row_8};

/* Row range [n0, n1) of part p of `parts` over N rows: whole UNITs, the same split for every call. */
static void part_rows(int64_t N, int64_t parts, int64_t p, int64_t* n0, int64_t* n1) {
  int64_t units = (N + UNIT - 1) / UNIT;
  *n0 = units * p / parts * UNIT;
  *n1 = units * (p + 1) / parts * UNIT;
  if (*n1 > N) *n1 = N;
}

static int64_t parts_for(int64_t N, int num_threads) {
  int64_t parts = (N + 63) / 64; /* at least 64 weight rows per thread */
  if (parts > num_threads) parts = num_threads;
  return parts < 1 ? 1 : parts;
}

/* Part p: outputs [n0, n1) for every row of x, 8 rows of x at a time (later passes read the weights from
 * cache); then the start of this part of the next weight, if any. */
static void part(void* arg, int64_t p) {
  const bjob* j = (const bjob*)arg;
  int64_t n0, n1;
  part_rows(j->N, j->parts, p, &n0, &n1);
  for (int64_t n = n0; n < n1; n++)
    for (int64_t m0 = 0; m0 < j->M; m0 += 8) ROWS[j->M - m0 < 8 ? j->M - m0 : 8](j, n, m0);
  if (j->next_w && p < j->next_parts) {
    /* into L2 while the kernels in between run: the next product's stream then starts from cache instead of
     * waiting for memory (a decode step's products are short, 40-200 us) */
    part_rows(j->next_N, j->next_parts, p, &n0, &n1);
    const char* start = (const char*)(j->next_w + n0 * j->next_ldw);
    int64_t bytes = (n1 - n0) * j->next_ldw * 2;
    if (bytes > PREFETCH_NEXT) bytes = PREFETCH_NEXT;
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(start + off, _MM_HINT_T1);
  }
}

/* y [M, N] (row stride ldy; bfloat16, or float32 with out_f32) = x [M, K] (row stride ldx) @ w [N, K]^T (row
 * stride ldw), all bfloat16 as raw 16-bit words; then each thread fetches the start of its part of next_w
 * ([next_N, *], row stride next_ldw; NULL for none) towards its cache. */
void bf16_matmul_then(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, void* y, int64_t ldy,
                      int64_t M, int64_t K, int64_t N, int out_f32, const uint16_t* next_w, int64_t next_ldw,
                      int64_t next_N, int num_threads, int use_pool) {
  int64_t parts = parts_for(N, num_threads);
  bjob job = {x, ldx, w, ldw, y, ldy, M, K, N, parts, out_f32, next_w, next_ldw, next_N,
              parts_for(next_N, num_threads)};
  parallel_for(parts, part, &job, num_threads, use_pool);
}

/* bf16_matmul_then without a next weight. */
void bf16_matmul(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, void* y, int64_t ldy, int64_t M,
                 int64_t K, int64_t N, int out_f32, int num_threads, int use_pool) {
  bf16_matmul_then(x, ldx, w, ldw, y, ldy, M, K, N, out_f32, 0, 0, 0, num_threads, use_pool);
}
