/* y = x @ w (+ bias) for a few rows of x: the matrix-vector products of decoding.
 *
 * x is [M, K] (row stride ldx), w is [K, N] row-major (the transpose of an nn.Linear weight, which the engine
 * stores column-major), y is [M, N] (row stride ldy). With one or a few rows the product is bound by the
 * speed at which w streams from memory, and MKL runs it on one thread. Here the K rows of w are split into one
 * contiguous slab per thread (threadpool.h), so every core streams its own part of the weights sequentially;
 * each part accumulates into its own partial result (part 0 directly into y, the others into scratch, which
 * holds (parts - 1) * M * N floats, parts <= threads), and the partials are added at the end.
 *
 * Every row of y is computed the same way whatever M is (the split depends only on K and the thread count),
 * so a sequence gets bit-identical results alone and in a small batch.
 *
 * Built by app/engine/kernels/build.py with -O3 -mavx2 -mfma -fopenmp, only on CPUs with AVX2 and FMA.
 * Which thread computes a part does not matter: the parts and the order they are added in depend only on K and
 * the thread count.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "threadpool.h"

/* Columns processed per pass over a thread's rows: 32 KiB of each weight row, and M such blocks of
 * accumulators, stay in L1/L2 while the weights stream through. */
#define COL_BLOCK 8192
/* Fewer rows than this per thread is not worth a thread. */
#define MIN_ROWS_PER_THREAD 64

int small_matmul_abi_version(void) { return 2; }

static void accumulate_rows(const float* x, int64_t ldx, const float* w, float* acc, int64_t acc_ld, int64_t M,
                            int64_t k0, int64_t k1, int64_t N, int64_t c0, int64_t width) {
  int64_t vec = width & ~(int64_t)7;
  int64_t k = k0;
  /* Four weight rows per step: one load and store of each accumulator for four FMAs. */
  for (; k + 4 <= k1; k += 4) {
    const float* w0 = w + k * N + c0;
    const float* w1 = w0 + N;
    const float* w2 = w1 + N;
    const float* w3 = w2 + N;
    for (int64_t m = 0; m < M; m++) {
      const float* xm = x + m * ldx + k;
      __m256 x0 = _mm256_set1_ps(xm[0]), x1 = _mm256_set1_ps(xm[1]);
      __m256 x2 = _mm256_set1_ps(xm[2]), x3 = _mm256_set1_ps(xm[3]);
      float* a = acc + m * acc_ld;
      int64_t j = 0;
      for (; j < vec; j += 8) {
        __m256 s = _mm256_loadu_ps(a + j);
        s = _mm256_fmadd_ps(x0, _mm256_loadu_ps(w0 + j), s);
        s = _mm256_fmadd_ps(x1, _mm256_loadu_ps(w1 + j), s);
        s = _mm256_fmadd_ps(x2, _mm256_loadu_ps(w2 + j), s);
        s = _mm256_fmadd_ps(x3, _mm256_loadu_ps(w3 + j), s);
        _mm256_storeu_ps(a + j, s);
      }
      for (; j < width; j++) {
        float s = a[j];
        s = __builtin_fmaf(xm[0], w0[j], s);
        s = __builtin_fmaf(xm[1], w1[j], s);
        s = __builtin_fmaf(xm[2], w2[j], s);
        s = __builtin_fmaf(xm[3], w3[j], s);
        a[j] = s;
      }
    }
  }
  for (; k < k1; k++) {
    const float* wr = w + k * N + c0;
    for (int64_t m = 0; m < M; m++) {
      float xs = x[m * ldx + k];
      __m256 xv = _mm256_set1_ps(xs);
      float* a = acc + m * acc_ld;
      int64_t j = 0;
      for (; j < vec; j += 8)
        _mm256_storeu_ps(a + j, _mm256_fmadd_ps(xv, _mm256_loadu_ps(wr + j), _mm256_loadu_ps(a + j)));
      for (; j < width; j++) a[j] = __builtin_fmaf(xs, wr[j], a[j]);
    }
  }
}

typedef struct {
  const float* x;
  int64_t ldx;
  const float* w;
  const float* bias;
  float* y;
  int64_t ldy, M, K, N, parts;
  float* scratch;
} matmul_job;

/* Part p of the K rows: into y itself for part 0, into its own scratch slab for the others. */
static void matmul_part(void* arg, int64_t part) {
  const matmul_job* j = (const matmul_job*)arg;
  int64_t k0 = j->K * part / j->parts, k1 = j->K * (part + 1) / j->parts;
  float* base = part == 0 ? j->y : j->scratch + (part - 1) * j->M * j->N;
  int64_t ld = part == 0 ? j->ldy : j->N;
  for (int64_t c0 = 0; c0 < j->N; c0 += COL_BLOCK) {
    int64_t width = j->N - c0 < COL_BLOCK ? j->N - c0 : COL_BLOCK;
    for (int64_t m = 0; m < j->M; m++) memset(base + m * ld + c0, 0, (size_t)width * sizeof(float));
    accumulate_rows(j->x, j->ldx, j->w, base + c0, ld, j->M, k0, k1, j->N, c0, width);
  }
}

/* Columns [c0, c1) of y: add the other parts and the bias, always in the same order. */
static void matmul_reduce(void* arg, int64_t chunk) {
  const matmul_job* j = (const matmul_job*)arg;
  int64_t units = (j->N + 7) / 8, chunks = j->parts;
  int64_t c0 = units * chunk / chunks * 8, c1 = units * (chunk + 1) / chunks * 8;
  if (c1 > j->N) c1 = j->N;
  for (int64_t m = 0; m < j->M; m++) {
    float* out = j->y + m * j->ldy;
    for (int64_t p = 1; p < j->parts; p++) {
      const float* part = j->scratch + (p - 1) * j->M * j->N + m * j->N;
      for (int64_t c = c0; c < c1; c++) out[c] += part[c];
    }
    if (j->bias)
      for (int64_t c = c0; c < c1; c++) out[c] += j->bias[c];
  }
}

void small_matmul(const float* x, int64_t ldx, const float* w, const float* bias, float* y, int64_t ldy,
                  int64_t M, int64_t K, int64_t N, float* scratch, int num_threads, int use_pool) {
  int64_t parts = K / MIN_ROWS_PER_THREAD;
  if (parts > num_threads) parts = num_threads;
  if (parts < 1) parts = 1;
  matmul_job job = {x, ldx, w, bias, y, ldy, M, K, N, parts, scratch};
  parallel_for(parts, matmul_part, &job, num_threads, use_pool);
  parallel_for(parts, matmul_reduce, &job, num_threads, use_pool);
}
