/* The small per-token operations of a Llama layer, each fused into one pass over the rows.
 *
 * Decoding one sequence runs each of them on a single 576-float row, where PyTorch spends far more time
 * dispatching its several ops per step (F.rms_norm alone is eight) than computing. Rows are split across
 * threads (threadpool.h) only when there are enough of them to pay for waking the threads.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "threadpool.h"
#include "vec_math.h"

int elementwise_abi_version(void) { return 10; }

#define ROWS_PER_THREAD 8

static inline int threads_for(int64_t rows, int num_threads) {
  int64_t t = rows / ROWS_PER_THREAD;
  if (t < 1) t = 1;
  return (int)(t < num_threads ? t : num_threads);
}

/* Rows [r0, r1) of chunk c when `rows` rows are cut into `chunks` nearly equal chunks. */
static inline void row_range(int64_t rows, int64_t chunks, int64_t c, int64_t* r0, int64_t* r1) {
  *r0 = rows * c / chunks;
  *r1 = rows * (c + 1) / chunks;
}

typedef struct {
  const void* x;
  int64_t x_ld;
  float* residual;
  int64_t res_ld;
  int flags;
  const float* weight;
  float eps;
  void* out;
  int64_t out_ld, rows, dim, chunks;
} norm_job;

#define NORM_ADD 1     /* residual += x first */
#define NORM_X_BF16 2  /* x is bfloat16 (a bfloat16 product's output), widened exactly */
#define NORM_OUT_BF16 4 /* out is bfloat16 (the next products' input), rounded as .to(torch.bfloat16) */

static inline __m256 load8_bf16(const uint16_t* p);
static inline void store8_bf16(uint16_t* p, __m256 x);

static void norm_chunk(void* arg, int64_t c) {
  const norm_job* j = (const norm_job*)arg;
  int64_t r0, r1;
  row_range(j->rows, j->chunks, c, &r0, &r1);
  const int add = j->flags & NORM_ADD, x_bf16 = j->flags & NORM_X_BF16, out_bf16 = j->flags & NORM_OUT_BF16;
  for (int64_t r = r0; r < r1; r++) {
    float* h = j->residual + r * j->res_ld;
    __m256 ss = _mm256_setzero_ps();
    for (int64_t k = 0; k < j->dim; k += 8) {
      __m256 v = _mm256_loadu_ps(h + k);
      if (add) {
        __m256 xv = x_bf16 ? load8_bf16((const uint16_t*)j->x + r * j->x_ld + k)
                           : _mm256_loadu_ps((const float*)j->x + r * j->x_ld + k);
        v = _mm256_add_ps(v, xv);
        _mm256_storeu_ps(h + k, v);
      }
      ss = _mm256_fmadd_ps(v, v, ss);
    }
    __m256 scale = _mm256_set1_ps(1.0f / sqrtf(hsum256(ss) / (float)j->dim + j->eps));
    for (int64_t k = 0; k < j->dim; k += 8) {
      __m256 v = _mm256_mul_ps(_mm256_loadu_ps(h + k), scale);
      v = _mm256_mul_ps(_mm256_loadu_ps(j->weight + k), v);
      if (out_bf16)
        store8_bf16((uint16_t*)j->out + r * j->out_ld + k, v);
      else
        _mm256_storeu_ps((float*)j->out + r * j->out_ld + k, v);
    }
  }
}

/* residual[r] += x[r] (with NORM_ADD in flags; else residual already holds the row), then
 * out[r] = residual[r] * weight / sqrt(mean(residual[r]^2) + eps). dim must be a multiple of 8. x and out are
 * float32, or bfloat16 with NORM_X_BF16 / NORM_OUT_BF16 (a bfloat16 model's products give and take bfloat16:
 * converting here saves a pass over the rows each). */
void add_rms_norm(const void* x, int64_t x_ld, float* residual, int64_t res_ld, int flags, const float* weight,
                  float eps, void* out, int64_t out_ld, int64_t rows, int64_t dim, int num_threads,
                  int use_pool) {
  int64_t chunks = threads_for(rows, num_threads);
  norm_job job = {x, x_ld, residual, res_ld, flags, weight, eps, out, out_ld, rows, dim, chunks};
  parallel_for(chunks, norm_chunk, &job, num_threads, use_pool);
}

typedef struct {
  const void* gu;
  int64_t gu_ld;
  void* out;
  int64_t out_ld, rows, inter, chunks;
} swiglu_job;

/* Eight bfloat16 values (uint16 bits) widened to float32 exactly. */
static inline __m256 load8_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

/* Eight float32 values rounded to bfloat16 (to nearest even, NaN kept quiet), as PyTorch's .to(bfloat16). */
static inline void store8_bf16(uint16_t* p, __m256 x) {
  __m256i bits = _mm256_castps_si256(x);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  rounded = _mm256_blendv_epi8(rounded, quiet, nan);
  __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  _mm_storeu_si128((__m128i*)p, packed);
}

static inline __attribute__((always_inline)) void swiglu_rows(const swiglu_job* j, int64_t r0, int64_t r1,
                                                              int bf16) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t r = r0; r < r1; r++) {
    for (int64_t k = 0; k < j->inter; k += 8) {
      __m256 x, up;
      if (bf16) {
        const uint16_t* g = (const uint16_t*)j->gu + r * j->gu_ld;
        x = load8_bf16(g + k);
        up = load8_bf16(g + j->inter + k);
      } else {
        const float* g = (const float*)j->gu + r * j->gu_ld;
        x = _mm256_loadu_ps(g + k);
        up = _mm256_loadu_ps(g + j->inter + k);
      }
      /* sigmoid(x) = 1 / (1 + e^-x) for x >= 0 and e^x / (1 + e^x) for x < 0: e^-|x| never overflows. */
      __m256 t = exp256_nonpositive(_mm256_or_ps(x, sign));
      __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, t));
      __m256 sig = _mm256_blendv_ps(inv, _mm256_mul_ps(t, inv), x); /* x's sign bit picks e^x / (1 + e^x) */
      __m256 y = _mm256_mul_ps(_mm256_mul_ps(x, sig), up);
      if (bf16)
        store8_bf16((uint16_t*)j->out + r * j->out_ld + k, y);
      else
        _mm256_storeu_ps((float*)j->out + r * j->out_ld + k, y);
    }
  }
}

/* ---- the same SwiGLU sixteen lanes wide (AVX-512F/DQ/BW), where the CPU has it: the same operations on every
 * value (the exponential's polynomial included), so the same bits, in half the instructions ---- */
#define TGT512 __attribute__((target("avx512f,avx512dq,avx512bw,avx2,fma")))

static int use_avx512 = 0; /* set by elementwise_use_avx512() from Python, which checks the CPU */

void elementwise_use_avx512(int on) { use_avx512 = on; }

TGT512 static inline __m512 load16_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

TGT512 static inline __attribute__((always_inline)) void swiglu_rows512(const swiglu_job* j, int64_t r0, int64_t r1,
                                                                        int bf16) {
  const int64_t wide = j->inter / 16 * 16;
  for (int64_t r = r0; r < r1; r++) {
    for (int64_t k = 0; k < wide; k += 16) {
      __m512 x, up;
      if (bf16) {
        const uint16_t* g = (const uint16_t*)j->gu + r * j->gu_ld;
        x = load16_bf16(g + k);
        up = load16_bf16(g + j->inter + k);
      } else {
        const float* g = (const float*)j->gu + r * j->gu_ld;
        x = _mm512_loadu_ps(g + k);
        up = _mm512_loadu_ps(g + j->inter + k);
      }
      __m512 y = swiglu16(x, up);
      if (bf16)
        store16_bf16((uint16_t*)j->out + r * j->out_ld + k, y);
      else
        _mm512_storeu_ps((float*)j->out + r * j->out_ld + k, y);
    }
  }
}

TGT512 static void swiglu512_chunk(void* arg, int64_t c) {
  const swiglu_job* j = (const swiglu_job*)arg;
  int64_t r0, r1;
  row_range(j->rows, j->chunks, c, &r0, &r1);
  swiglu_rows512(j, r0, r1, 0);
}

TGT512 static void swiglu512_chunk_bf16(void* arg, int64_t c) {
  const swiglu_job* j = (const swiglu_job*)arg;
  int64_t r0, r1;
  row_range(j->rows, j->chunks, c, &r0, &r1);
  swiglu_rows512(j, r0, r1, 1);
}

static void swiglu_chunk(void* arg, int64_t c) {
  const swiglu_job* j = (const swiglu_job*)arg;
  int64_t r0, r1;
  row_range(j->rows, j->chunks, c, &r0, &r1);
  swiglu_rows(j, r0, r1, 0);
}

static void swiglu_chunk_bf16(void* arg, int64_t c) {
  const swiglu_job* j = (const swiglu_job*)arg;
  int64_t r0, r1;
  row_range(j->rows, j->chunks, c, &r0, &r1);
  swiglu_rows(j, r0, r1, 1);
}

/* out[r, j] = silu(gu[r, j]) * gu[r, inter + j]: SwiGLU on the fused gate|up projection. inter % 8 == 0. With
 * bf16, gu and out are bfloat16 (the math is float32, the result rounded once): a bfloat16 model's MLP feeds
 * its products' output straight in and the next product's input straight out, with no conversions between. */
void silu_mul(const void* gu, int64_t gu_ld, void* out, int64_t out_ld, int64_t rows, int64_t inter, int bf16,
              int num_threads, int use_pool) {
  int64_t chunks = threads_for(rows, num_threads);
  swiglu_job job = {gu, gu_ld, out, out_ld, rows, inter, chunks};
  chunk_fn fn = use_avx512 && inter % 16 == 0 ? (bf16 ? swiglu512_chunk_bf16 : swiglu512_chunk)
                                             : (bf16 ? swiglu_chunk_bf16 : swiglu_chunk);
  parallel_for(chunks, fn, &job, num_threads, use_pool);
}

typedef struct {
  void* x;
  int64_t x_ld;
  const float *cos_t, *sin_t;
  int64_t cs_ld, rows, heads, head_dim, chunks;
  int bf16;
} rope_job;

static inline __attribute__((always_inline)) void rope_rows(const rope_job* j, int64_t r0, int64_t r1, int bf16) {
  const int64_t half = j->head_dim / 2;
  for (int64_t r = r0; r < r1; r++) {
    const float* cr = j->cos_t + r * j->cs_ld;
    const float* sr = j->sin_t + r * j->cs_ld;
    for (int64_t h = 0; h < j->heads; h++) {
      int64_t at = r * j->x_ld + h * j->head_dim;
      for (int64_t k = 0; k < half; k += 8) {
        __m256 a, b;
        if (bf16) {
          a = load8_bf16((const uint16_t*)j->x + at + k);
          b = load8_bf16((const uint16_t*)j->x + at + half + k);
        } else {
          a = _mm256_loadu_ps((const float*)j->x + at + k);
          b = _mm256_loadu_ps((const float*)j->x + at + half + k);
        }
        __m256 cv = _mm256_loadu_ps(cr + k), sv = _mm256_loadu_ps(sr + k);
        __m256 y1 = _mm256_fmsub_ps(a, cv, _mm256_mul_ps(b, sv)), y2 = _mm256_fmadd_ps(b, cv, _mm256_mul_ps(a, sv));
        if (bf16) { /* rounded once, as the float32 result is when a bfloat16 consumer reads it */
          store8_bf16((uint16_t*)j->x + at + k, y1);
          store8_bf16((uint16_t*)j->x + at + half + k, y2);
        } else {
          _mm256_storeu_ps((float*)j->x + at + k, y1);
          _mm256_storeu_ps((float*)j->x + at + half + k, y2);
        }
      }
    }
  }
}

static void rope_chunk(void* arg, int64_t c) {
  const rope_job* j = (const rope_job*)arg;
  int64_t r0, r1;
  row_range(j->rows, j->chunks, c, &r0, &r1);
  if (j->bf16)
    rope_rows(j, r0, r1, 1);
  else
    rope_rows(j, r0, r1, 0);
}

/* Rotary embedding in place, "rotate half" layout: for each of the `heads` head vectors of row r,
 * (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) with cos/sin [rows, head_dim / 2]. half % 8 == 0. x is
 * float32, or bfloat16 with bf16 (computed in float32 from the exact values, rounded once). */
void rope_inplace(void* x, int64_t x_ld, const float* cos_t, const float* sin_t, int64_t cs_ld, int64_t rows,
                  int64_t heads, int64_t head_dim, int bf16, int num_threads, int use_pool) {
  int64_t chunks = threads_for(rows, num_threads);
  rope_job job = {x, x_ld, cos_t, sin_t, cs_ld, rows, heads, head_dim, chunks, bf16};
  parallel_for(chunks, rope_chunk, &job, num_threads, use_pool);
}

typedef struct {
  const void *k, *v;
  int64_t k_ld, v_ld;
  const int64_t* slots;
  int64_t tokens, row, chunks;
  void *k_cache, *v_cache;
  int bf16, src_bf16;
} write_kv_job;

static void write_kv_chunk(void* arg, int64_t c) {
  const write_kv_job* j = (const write_kv_job*)arg;
  int64_t t0, t1;
  row_range(j->tokens, j->chunks, c, &t0, &t1);
  const int64_t size = j->src_bf16 ? 2 : 4;
  for (int64_t t = t0; t < t1; t++) {
    const char* src[2] = {(const char*)j->k + t * j->k_ld * size, (const char*)j->v + t * j->v_ld * size};
    void* dst[2] = {j->k_cache, j->v_cache};
    for (int kv = 0; kv < 2; kv++) {
      if (j->src_bf16 && j->bf16) { /* bfloat16 into bfloat16: the bits as they are */
        memcpy((uint16_t*)dst[kv] + j->slots[t] * j->row, src[kv], (size_t)j->row * 2);
      } else if (j->src_bf16) {
        float* d = (float*)dst[kv] + j->slots[t] * j->row;
        for (int64_t i = 0; i < j->row; i += 8) _mm256_storeu_ps(d + i, load8_bf16((const uint16_t*)src[kv] + i));
      } else if (j->bf16) {
        uint16_t* d = (uint16_t*)dst[kv] + j->slots[t] * j->row;
        for (int64_t i = 0; i < j->row; i += 8) store8_bf16(d + i, _mm256_loadu_ps((const float*)src[kv] + i));
      } else {
        float* d = (float*)dst[kv] + j->slots[t] * j->row;
        for (int64_t i = 0; i < j->row; i += 8) _mm256_storeu_ps(d + i, _mm256_loadu_ps((const float*)src[kv] + i));
      }
    }
  }
}

/* The new tokens' keys and values into their cache slots: row t of k (and v), `row` = kv_heads * head_dim
 * contiguous values (a multiple of 8; float32, or bfloat16 with src_bf16), goes to row slots[t] of k_cache (and
 * v_cache), rounded to bfloat16 (to nearest even, as PyTorch's .to does) when bf16. One pass instead of a
 * conversion and an index_copy each. */
void write_kv(const void* k, int64_t k_ld, const void* v, int64_t v_ld, const int64_t* slots, int64_t tokens,
              int64_t row, void* k_cache, void* v_cache, int bf16, int src_bf16, int num_threads, int use_pool) {
  int64_t chunks = tokens >= 64 ? threads_for(tokens, num_threads) : 1; /* a decode step's few rows: one thread */
  write_kv_job job = {k, v, k_ld, v_ld, slots, tokens, row, chunks, k_cache, v_cache, bf16, src_bf16};
  parallel_for(chunks, write_kv_chunk, &job, num_threads, use_pool);
}

typedef struct {
  const float* x;
  int64_t ld, rows, cols, chunks;
  int64_t *out, *ties;
} argmax_job;

/* How many values of a row equal x[at] (at least 1; a NaN counts once). */
static int64_t count_equal(const float* x, int64_t n, int64_t at) {
  const float top = x[at];
  if (top != top) return 1;
  const __m256 v = _mm256_set1_ps(top);
  int64_t count = 0, i = 0;
  for (; i + 8 <= n; i += 8)
    count += __builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), v, _CMP_EQ_OQ)));
  for (; i < n; i++) count += x[i] == top;
  return count;
}

/* The first index of the largest value of a row, as torch.argmax: a NaN counts as the largest (the first one). */
static int64_t argmax_row(const float* x, int64_t n) {
  __m256 best = _mm256_set1_ps(-INFINITY);
  __m256i best_at = _mm256_set1_epi32(-1), at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8);
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  if (n < (int64_t)1 << 31) {
    for (; i + 8 <= n; i += 8) {
      __m256 v = _mm256_loadu_ps(x + i);
      __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ); /* strictly larger: a tie keeps the earlier index */
      best = _mm256_blendv_ps(best, v, gt);
      best_at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_at), _mm256_castsi256_ps(at), gt));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      at = _mm256_add_epi32(at, step);
    }
  }
  if (_mm256_movemask_ps(nan)) {
    for (int64_t k = 0; k < n; k++)
      if (x[k] != x[k]) return k;
  }
  float vals[8];
  int32_t idx[8];
  _mm256_storeu_ps(vals, best);
  _mm256_storeu_si256((__m256i*)idx, best_at);
  float top = -INFINITY;
  int64_t top_at = -1;
  for (int l = 0; l < 8; l++) /* lanes: the largest value, then the smallest index among equals */
    if (idx[l] >= 0 && (vals[l] > top || (vals[l] == top && idx[l] < top_at))) {
      top = vals[l];
      top_at = idx[l];
    }
  if (top_at < 0 && i > 0) top_at = 0; /* the vector part saw only -inf: the first of them */
  for (; i < n; i++) {
    if (x[i] != x[i]) return i;
    if (x[i] > top || top_at < 0) {
      top = x[i];
      top_at = i;
    }
  }
  return top_at < 0 ? 0 : top_at; /* a row of -inf only: index 0, as torch */
}

static void argmax_chunk(void* arg, int64_t c) {
  const argmax_job* j = (const argmax_job*)arg;
  int64_t r0, r1;
  row_range(j->rows, j->chunks, c, &r0, &r1);
  for (int64_t r = r0; r < r1; r++) {
    j->out[r] = argmax_row(j->x + r * j->ld, j->cols);
    if (j->ties) j->ties[r] = count_equal(j->x + r * j->ld, j->cols, j->out[r]);
  }
}

/* out[r] = argmax of row r of x ([rows, cols], row stride ld), float32; ties[r] (unless ties is NULL) = how many
 * values of the row equal that largest one. */
void argmax_rows(const float* x, int64_t ld, int64_t rows, int64_t cols, int64_t* out, int64_t* ties,
                 int num_threads, int use_pool) {
  int64_t chunks = rows < num_threads ? rows : num_threads;
  argmax_job job = {x, ld, rows, cols, chunks < 1 ? 1 : chunks, out, ties};
  parallel_for(job.chunks, argmax_chunk, &job, num_threads, use_pool);
}

/* int8 products (matmul.w8a8_linear). quantize_rows_i8: each row of x [rows, dim] (float32, dim % 8 == 0) is
 * rounded to int8 by its own scale, max|x| / 127 over the channels `keep` marks 1 (the others, multiplied in
 * float32 instead, are 0 there and their codes are clamped: their weight rows are zero); the scale goes to
 * scales[r]. Rounding is to nearest even, as torch.round. dequantize_i32: out[r, j] = acc[r, j] * scales[r] *
 * col_scales[j], in place on the int32 sums reinterpreted as float32. */
typedef struct {
  const float* x;
  int64_t x_ld;
  const float* keep;
  int8_t* out;
  float* scales;
  int64_t rows, dim, chunks;
} quantize_job;

static void quantize_chunk(void* arg, int64_t c) {
  const quantize_job* j = (const quantize_job*)arg;
  int64_t r0, r1;
  row_range(j->rows, j->chunks, c, &r0, &r1);
  const __m256 sign = _mm256_set1_ps(-0.0f), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  for (int64_t r = r0; r < r1; r++) {
    const float* row = j->x + r * j->x_ld;
    __m256 m = _mm256_setzero_ps();
    for (int64_t k = 0; k < j->dim; k += 8)
      m = _mm256_max_ps(m, _mm256_mul_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(row + k)), _mm256_loadu_ps(j->keep + k)));
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    float amax = lanes[0];
    for (int i = 1; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
    if (amax < 1e-30f) amax = 1e-30f;
    j->scales[r] = amax * (1.0f / 127.0f);
    const __m256 s = _mm256_set1_ps(127.0f / amax);
    int8_t* q = j->out + r * j->dim;
    for (int64_t k = 0; k < j->dim; k += 8) {
      __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(row + k), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      __m256i n = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
      __m128i n16 = _mm_packs_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1));
      _mm_storel_epi64((__m128i*)(q + k), _mm_packs_epi16(n16, n16));
    }
  }
}

void quantize_rows_i8(const float* x, int64_t x_ld, const float* keep, int8_t* out, float* scales, int64_t rows,
                      int64_t dim, int num_threads, int use_pool) {
  int64_t chunks = threads_for(rows, num_threads);
  quantize_job job = {x, x_ld, keep, out, scales, rows, dim, chunks};
  parallel_for(chunks, quantize_chunk, &job, num_threads, use_pool);
}

typedef struct {
  void* acc;
  const float *scales, *col_scales;
  int64_t rows, cols, chunks;
} dequantize_job;

static void dequantize_chunk(void* arg, int64_t c) {
  const dequantize_job* j = (const dequantize_job*)arg;
  int64_t r0, r1;
  row_range(j->rows, j->chunks, c, &r0, &r1);
  for (int64_t r = r0; r < r1; r++) {
    int32_t* a = (int32_t*)j->acc + r * j->cols;
    float* o = (float*)j->acc + r * j->cols;
    const __m256 s = _mm256_set1_ps(j->scales[r]);
    int64_t k = 0;
    for (; k + 8 <= j->cols; k += 8) {
      __m256 v = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i*)(a + k)));
      _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_mul_ps(v, s), _mm256_loadu_ps(j->col_scales + k)));
    }
    for (; k < j->cols; k++) o[k] = ((float)a[k] * j->scales[r]) * j->col_scales[k];
  }
}

void dequantize_i32(void* acc, const float* scales, const float* col_scales, int64_t rows, int64_t cols,
                    int num_threads, int use_pool) {
  int64_t chunks = threads_for(rows, num_threads);
  dequantize_job job = {acc, scales, col_scales, rows, cols, chunks};
  parallel_for(chunks, dequantize_chunk, &job, num_threads, use_pool);
}
