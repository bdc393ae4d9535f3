/* Decode attention straight from the paged KV cache: one query token per sequence.
 *
 * PyTorch's way (gather every sequence's blocks into a padded tensor, then scaled_dot_product_attention on
 * [seqs, kv_heads, group, width]) pays a copy of the whole context and, worse, runs one tiny GEMM per
 * (sequence, head) with a fixed cost each. Here a task (a sequence, or one kv head of it when there are too few
 * sequences to keep the threads busy) reads its keys and values in place through the block table, once, for
 * all the query heads that share them:
 *
 *   1. scores[h][p] = scale * dot(q_h, k_p) for the p < context_len positions;
 *   2. softmax per query head (max, exp, sum) with a vectorised exp;
 *   3. out_h = sum_p softmax[h][p] * v_p.
 *
 * Caches are [num_blocks, block_size, kv_heads, head_dim] (one of K or V of one layer), float32 or bfloat16
 * (kv_bf16: half the bytes to stream; each 8-value load widens to float32 exactly, a shift, and all arithmetic
 * stays float32); block_tables is [seqs, bt_stride] int64; head_dim must be a multiple of 8 and at most 128.
 *
 * bf16_values (a bfloat16 model's attention, as prefill_attention.c computes it for bfloat16 products): 1 = keys
 * and values taken as bfloat16 values (a float32 cache is rounded on load; the caller rounds the query), weights
 * and sums float32; 2 = the same values on a bfloat16 cache with AVX512-BF16, scores by vdpbf16ps (the caller
 * checks the CPU; head_dim a multiple of 32).
 */
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "threadpool.h"
#include "vec_math.h"

int paged_attention_abi_version(void) { return 8; }

/* Eight float32 values rounded to bfloat16 (to nearest even; finite inputs), kept as float32. */
static inline __m256 round_bf16(__m256 x) {
  __m256i bits = _mm256_castps_si256(x);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32((int)0xffff0000u)));
}

/* Eight cache values from element index idx, as float32: bfloat16 is the upper half of a float32. bf16 == 2: a
 * float32 cache read as bfloat16 (rounded), for a bfloat16 model's attention. */
static inline __attribute__((always_inline)) __m256 load8(const void* base, int64_t idx, int bf16) {
  if (bf16 == 1) {
    __m128i half = _mm_loadu_si128((const __m128i*)((const uint16_t*)base + idx));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
  }
  __m256 x = _mm256_loadu_ps((const float*)base + idx);
  return bf16 == 2 ? round_bf16(x) : x;
}

/* The K and V rows of a thread's next task, fetched into L2 a few lines at a time while the current task
 * computes. A sequence's blocks lie anywhere in the cache, so a task that starts cold waits on memory at every
 * block of its first pass (measured: about a third of the bandwidth the two cores stream); fetched during the
 * task before it, that pass finds them in L2. Each block's rows are contiguous: a block is one run of lines. */
typedef struct {
  const char *k, *v;     /* cache bases, bytes */
  const int64_t* table;  /* the next task's block table; NULL: nothing to fetch */
  int64_t ctx, bs, row_bytes;
  int64_t block, line;   /* cursor: next line of the next block */
  int64_t per_call;      /* lines of K (and as many of V) per fetch_some */
  int warm;              /* the current task's own rows were fetched by the lane's task before it */
} fetch_ahead;

/* Lines the next task reads, in K (V the same). */
static inline int64_t fetch_lines(const fetch_ahead* fa) {
  return fa->table ? (fa->ctx * fa->row_bytes + 63) / 64 + (fa->ctx + fa->bs - 1) / fa->bs : 0;
}

/* Spread the next task's lines over `calls` calls of fetch_some. */
static inline void fetch_plan(fetch_ahead* fa, int64_t calls) {
  fa->per_call = calls > 0 ? fetch_lines(fa) / calls + 1 : 0;
}

static inline __attribute__((always_inline)) void fetch_some(fetch_ahead* fa) {
  if (!fa->table) return;
  for (int64_t n = 0; n < fa->per_call; n++) {
    int64_t rows = fa->ctx - fa->block * fa->bs;
    if (rows <= 0) {
      fa->table = NULL;
      return;
    }
    if (rows > fa->bs) rows = fa->bs;
    int64_t off = fa->table[fa->block] * fa->bs * fa->row_bytes + 64 * fa->line;
    _mm_prefetch(fa->k + off, _MM_HINT_T1);
    _mm_prefetch(fa->v + off, _MM_HINT_T1);
    if (64 * ++fa->line >= rows * fa->row_bytes) {
      fa->block++;
      fa->line = 0;
    }
  }
}

/* Sums of 8 vectors, one per lane: lane i of the result is the sum of the lanes of v[i]. */
static inline __m256 transpose_sum8(const __m256 v[8]) {
  __m256 a01 = _mm256_hadd_ps(v[0], v[1]), a23 = _mm256_hadd_ps(v[2], v[3]);
  __m256 a45 = _mm256_hadd_ps(v[4], v[5]), a67 = _mm256_hadd_ps(v[6], v[7]);
  __m256 b0 = _mm256_hadd_ps(a01, a23), b1 = _mm256_hadd_ps(a45, a67);
  /* b0 = [s0 s1 s2 s3 | s0' s1' s2' s3'] (low and high halves of each sum), b1 likewise for 4..7 */
  __m256 lo = _mm256_permute2f128_ps(b0, b1, 0x20), hi = _mm256_permute2f128_ps(b0, b1, 0x31);
  return _mm256_add_ps(lo, hi);
}

/* rows[p]: the element offset of position p's cache row, block by block (no division per position). */
static inline void cache_rows(const int64_t* table, int64_t ctx, int64_t bs, int64_t token_stride, int64_t* rows) {
  for (int64_t p0 = 0, b = 0; p0 < ctx; p0 += bs, b++) {
    int64_t base = table[b] * bs * token_stride, n = ctx - p0 < bs ? ctx - p0 : bs;
    for (int64_t r = 0; r < n; r++) rows[p0 + r] = base + r * token_stride;
  }
}

/* The largest of n floats (n >= 1), eight lanes at a time. */
static inline float max_of(const float* s, int64_t n) {
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  int64_t p = 0;
  for (; p + 8 <= n; p += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + p));
  float lanes[8], mx = -INFINITY;
  _mm256_storeu_ps(lanes, vmax);
  for (int i = 0; i < 8; i++) mx = lanes[i] > mx ? lanes[i] : mx;
  for (; p < n; p++) mx = s[p] > mx ? s[p] : mx;
  return mx;
}

/* Softmax weights of each query head's scores over ctx positions, in place: normalised, or (rnd) left as
 * e^(s - max) with 1 / sum in inv_sum[qh], to be applied to the output. */
static inline __attribute__((always_inline)) void softmax_heads(float* scores, int64_t qheads, int64_t ctx, int rnd,
                                                                float* inv_sum) {
  for (int64_t qh = 0; qh < qheads; qh++) {
    float* s = scores + qh * ctx;
    float mx = max_of(s, ctx);
    __m256 vmax = _mm256_set1_ps(mx), vsum = _mm256_setzero_ps();
    int64_t p = 0;
    for (; p + 8 <= ctx; p += 8) {
      __m256 e = exp256_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + p), vmax));
      _mm256_storeu_ps(s + p, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum256(vsum);
    if (p < ctx) { /* tail: pad a vector with -inf, which exp maps to 0 */
      float tail[8];
      for (int i = 0; i < 8; i++) tail[i] = p + i < ctx ? s[p + i] - mx : -INFINITY;
      __m256 e = exp256_nonpositive(_mm256_loadu_ps(tail));
      _mm256_storeu_ps(tail, e);
      for (int64_t i = 0; p + i < ctx; i++) {
        s[p + i] = tail[i];
        sum += tail[i];
      }
    }
    float inv = 1.0f / sum;
    if (rnd) { /* 1 / sum applied to the output, as the prefill kernel does */
      inv_sum[qh] = inv;
    } else {
      for (int64_t i = 0; i < ctx; i++) s[i] *= inv;
    }
  }
}

/* Attention of the query heads of kv heads [h0, h1) of one sequence (query heads h0 * group onwards; q and
 * out point at the first). Every position's keys of a sequence's kv heads are adjacent in the cache, so a task
 * that takes all the heads streams its K/V rows contiguously. The numbers of a (query head, position) do not
 * depend on the head range. `rows` is scratch for ctx cache-row indices, `scores` for (h1 - h0) * group * ctx
 * floats. Always inlined into attend_f32 / attend_bf16, so each is compiled for its cache type. */
static inline __attribute__((always_inline)) void attend(const float* q, const void* k_cache, const void* v_cache,
                                                         const int64_t* table, int64_t ctx, int64_t h0, int64_t h1,
                                                         int64_t group, int64_t kvh, int64_t hd, int64_t bs,
                                                         float scale, float* out, float* scores, int64_t* rows,
                                                         fetch_ahead* fa, int bf16, int rnd) {
  const int64_t token_stride = kvh * hd; /* floats between consecutive cache rows */
  const int64_t nvec = hd / 8;
  const int64_t qheads = (h1 - h0) * group;
  float inv_sum[256]; /* per query head (heads / kv_heads * kv_heads <= 256), with rnd */
  cache_rows(table, ctx, bs, token_stride, rows);
  fetch_plan(fa, qheads * ((ctx + 7) / 8));

  /* 1. scores[qh][p], eight positions at a time so one transposing reduction finishes eight dot products */
  for (int64_t qh = 0; qh < qheads; qh++) {
    const float* qv = q + qh * hd;
    const int64_t kh = (h0 + qh / group) * hd; /* element offset of this kv head in a cache row */
    float* s = scores + qh * ctx;
    int64_t p = 0;
    for (; p + 8 <= ctx; p += 8) {
      fetch_some(fa);
      __m256 acc[8];
      for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
      for (int64_t j = 0; j < nvec; j++) {
        __m256 qj = _mm256_loadu_ps(qv + 8 * j);
        for (int i = 0; i < 8; i++)
          acc[i] = _mm256_fmadd_ps(qj, load8(k_cache, kh + rows[p + i] + 8 * j, bf16), acc[i]);
      }
      _mm256_storeu_ps(s + p, _mm256_mul_ps(transpose_sum8(acc), _mm256_set1_ps(scale)));
    }
    if (p < ctx) fetch_some(fa);
    for (; p < ctx; p++) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t j = 0; j < nvec; j++)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qv + 8 * j), load8(k_cache, kh + rows[p] + 8 * j, bf16), acc);
      s[p] = hsum256(acc) * scale;
    }
  }

  /* 2. softmax weights into the scores buffer */
  softmax_heads(scores, qheads, ctx, rnd, inv_sum);

  /* 3. out[qh] = sum_p w[qh][p] v_p, accumulated in registers (up to 16 vectors: head_dim <= 128) */
  for (int64_t qh = 0; qh < qheads; qh++) {
    const int64_t vh = (h0 + qh / group) * hd;
    const float* w = scores + qh * ctx;
    float* o = out + qh * hd;
    for (int64_t j0 = 0; j0 < nvec; j0 += 8) {
      int64_t nj = nvec - j0 < 8 ? nvec - j0 : 8;
      __m256 acc[8];
      for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
      for (int64_t p = 0; p < ctx; p++) {
        __m256 wp = _mm256_set1_ps(w[p]);
        const int64_t vp = vh + rows[p] + 8 * j0;
        for (int64_t j = 0; j < nj; j++) acc[j] = _mm256_fmadd_ps(wp, load8(v_cache, vp + 8 * j, bf16), acc[j]);
      }
      __m256 vinv = _mm256_set1_ps(rnd ? inv_sum[qh] : 1.0f);
      for (int64_t j = 0; j < nj; j++)
        _mm256_storeu_ps(o + 8 * (j0 + j), rnd ? _mm256_mul_ps(acc[j], vinv) : acc[j]);
    }
  }
}

static void attend_f32(const float* q, const void* k, const void* v, const int64_t* table, int64_t ctx, int64_t h0,
                       int64_t h1, int64_t group, int64_t kvh, int64_t hd, int64_t bs, float scale, float* out,
                       float* scores, int64_t* rows, fetch_ahead* fa) {
  attend(q, k, v, table, ctx, h0, h1, group, kvh, hd, bs, scale, out, scores, rows, fa, 0, 0);
}

static void attend_bf16(const float* q, const void* k, const void* v, const int64_t* table, int64_t ctx, int64_t h0,
                        int64_t h1, int64_t group, int64_t kvh, int64_t hd, int64_t bs, float scale, float* out,
                        float* scores, int64_t* rows, fetch_ahead* fa) {
  attend(q, k, v, table, ctx, h0, h1, group, kvh, hd, bs, scale, out, scores, rows, fa, 1, 0);
}

/* A bfloat16 model's decode: K and V in bfloat16 values (the query comes rounded), float32 sums and weights, so
 * that a position decoded here is within float32 rounding of the prefill kernel's bfloat16 products. */
static void attend_f32_as_bf16(const float* q, const void* k, const void* v, const int64_t* table, int64_t ctx,
                               int64_t h0, int64_t h1, int64_t group, int64_t kvh, int64_t hd, int64_t bs,
                               float scale, float* out, float* scores, int64_t* rows, fetch_ahead* fa) {
  attend(q, k, v, table, ctx, h0, h1, group, kvh, hd, bs, scale, out, scores, rows, fa, 2, 1);
}

static void attend_bf16_rounded(const float* q, const void* k, const void* v, const int64_t* table, int64_t ctx,
                                int64_t h0, int64_t h1, int64_t group, int64_t kvh, int64_t hd, int64_t bs,
                                float scale, float* out, float* scores, int64_t* rows, fetch_ahead* fa) {
  attend(q, k, v, table, ctx, h0, h1, group, kvh, hd, bs, scale, out, scores, rows, fa, 1, 1);
}

/* ---- A bfloat16 model's decode on a bfloat16 cache: scores by AVX512-BF16 products (vdpbf16ps) ----
 * The same values as attend_bf16_rounded (query, keys, values in bfloat16, float32 sums and weights), in fewer
 * instructions: a key row is two bfloat16 products per 32 dims, no widening, and the value sum runs 16 lanes
 * wide. head_dim a multiple of 32, at most 128. */
#define TGT_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma")))
#define PREFETCH_AHEAD 16 /* positions */

TGT_BF16 static inline __m512bh load_bh(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

/* Lane i of the result: the sum of the 16 lanes of v[i] (16 partial dot products -> 16 scores). */
TGT_BF16 static inline __m512 sum16x16(const __m512 v[16]) {
  __m256 half[16];
  for (int i = 0; i < 16; i++)
    half[i] = _mm256_add_ps(_mm512_castps512_ps256(v[i]),
                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v[i]), 1)));
  __m256 lo = transpose_sum8(half), hi = transpose_sum8(half + 8);
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

/* For the G query heads of one kv head: out_g[0, 32 * NH) = inv_g * sum_p w_g[p] * v_p, v_p the bfloat16 row at
 * vrows + rows[p], widened exactly once for all G heads (GQA: the heads of a group share their values). Each
 * head's sum runs over p in order, as for a lone head, so the numbers do not depend on G. */
TGT_BF16 static inline __attribute__((always_inline)) void value_sum_bf16(const uint16_t* vrows, const int64_t* rows,
                                                                          const float* w, int64_t w_ld, int64_t ctx,
                                                                          const float* inv, float* out,
                                                                          int64_t out_ld, fetch_ahead* fa, const int NH,
                                                                          const int G) {
  __m512 acc[4][8];
  for (int g = 0; g < G; g++)
    for (int c = 0; c < 2 * NH; c++) acc[g][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < ctx; p++) {
    const uint16_t* row = vrows + rows[p];
    if ((p & 7) == 0) fetch_some(fa);
    if (p + 8 < ctx) {
      const char* ahead = (const char*)(vrows + rows[p + 8]);
      for (int line = 0; line < NH; line++) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
    }
    for (int c = 0; c < 2 * NH; c++) {
      __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(row + 16 * c)));
      __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
      for (int g = 0; g < G; g++) acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(w[g * w_ld + p]), v, acc[g][c]);
    }
  }
  for (int g = 0; g < G; g++) {
    __m512 vinv = _mm512_set1_ps(inv[g]);
    for (int c = 0; c < 2 * NH; c++) _mm512_storeu_ps(out + g * out_ld + 16 * c, _mm512_mul_ps(acc[g][c], vinv));
  }
}

/* value_sum_bf16 with NH and G as constants (accumulators in registers): G query heads per call, at most 4. */
TGT_BF16 static void value_sums_bf16(const uint16_t* vrows, const int64_t* rows, const float* w, int64_t ctx,
                                     const float* inv, float* out, int64_t hd, int64_t group, fetch_ahead* fa) {
  const int64_t nh = hd / 32;
  for (int64_t g0 = 0; g0 < group; g0 += 4) {
    int64_t g = group - g0 < 4 ? group - g0 : 4;
    const float* wg = w + g0 * ctx;
    float* og = out + g0 * hd;
#define VSUM(NH_, G_) value_sum_bf16(vrows, rows, wg, ctx, ctx, inv + g0, og, hd, fa, NH_, G_)
    if (nh == 2) {
      if (g == 1) VSUM(2, 1); else if (g == 2) VSUM(2, 2); else if (g == 3) VSUM(2, 3); else VSUM(2, 4);
    } else if (nh == 4) {
      if (g == 1) VSUM(4, 1); else if (g == 2) VSUM(4, 2); else if (g == 3) VSUM(4, 3); else VSUM(4, 4);
    } else {
      for (int64_t i = 0; i < g; i++) { /* head_dim 32 or 96: one head at a time */
        if (nh == 1) value_sum_bf16(vrows, rows, wg + i * ctx, ctx, ctx, inv + g0 + i, og + i * hd, hd, fa, 1, 1);
        else value_sum_bf16(vrows, rows, wg + i * ctx, ctx, ctx, inv + g0 + i, og + i * hd, hd, fa, 3, 1);
      }
    }
#undef VSUM
  }
}

TGT_BF16 static void attend_bf16_dots(const float* q, const void* k, const void* v, const int64_t* table,
                                      int64_t ctx, int64_t h0, int64_t h1, int64_t group, int64_t kvh, int64_t hd,
                                      int64_t bs, float scale, float* out, float* scores, int64_t* rows,
                                      fetch_ahead* fa) {
  const uint16_t* kc = (const uint16_t*)k;
  const uint16_t* vc = (const uint16_t*)v;
  const int64_t token_stride = kvh * hd, nh = hd / 32, qheads = (h1 - h0) * group;
  float inv_sum[256];
  cache_rows(table, ctx, bs, token_stride, rows);
  /* A cold task (its rows not fetched by the task before: a thread's first) fetches them itself in its first
   * head's pass, PREFETCH_AHEAD positions ahead, the K and V rows of every kv head of the task into L2, so
   * that the other heads' passes and the value sums do not each wait on memory for the whole context again. */
  const int cold = !fa->warm;
  const int64_t task_lines = ((h1 - h0) * hd * 2 + 63) / 64;
  fetch_plan(fa, qheads * ((ctx + 15) / 16) + (h1 - h0) * ((ctx + 7) / 8)); /* the score and value loops */
  const char* k_task = (const char*)(kc + h0 * hd);
  const char* v_task = (const char*)(vc + h0 * hd);

  /* 1. scores, 16 positions at a time: partial sums per position, then one transposing reduction */
  for (int64_t qh = 0; qh < qheads; qh++) {
    const float* qv = q + qh * hd;
    const int64_t kh = (h0 + qh / group) * hd;
    __m512bh qb[4];
    for (int64_t c = 0; c < nh; c++)
      qb[c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qv + 32 * c + 16), _mm512_loadu_ps(qv + 32 * c));
    float* s = scores + qh * ctx;
    for (int64_t p0 = 0; p0 < ctx; p0 += 16) {
      __m512 part[16];
      fetch_some(fa);
      for (int i = 0; i < 16; i++) {
        if (p0 + 16 + i < ctx) _mm_prefetch((const char*)(kc + rows[p0 + 16 + i] + kh), _MM_HINT_T0);
        if (cold && qh == 0 && p0 + PREFETCH_AHEAD + i < ctx) {
          int64_t ahead = 2 * rows[p0 + PREFETCH_AHEAD + i];
          for (int64_t line = 0; line < task_lines; line++) {
            _mm_prefetch(k_task + ahead + 64 * line, _MM_HINT_T1);
            _mm_prefetch(v_task + ahead + 64 * line, _MM_HINT_T1);
          }
        }
        part[i] = _mm512_setzero_ps();
        if (p0 + i < ctx)
          for (int64_t c = 0; c < nh; c++)
            part[i] = _mm512_dpbf16_ps(part[i], qb[c], load_bh(kc + rows[p0 + i] + kh + 32 * c));
      }
      __m512 sc = _mm512_mul_ps(sum16x16(part), _mm512_set1_ps(scale));
      if (p0 + 16 <= ctx)
        _mm512_storeu_ps(s + p0, sc);
      else
        _mm512_mask_storeu_ps(s + p0, (__mmask16)((1u << (ctx - p0)) - 1), sc);
    }
  }

  /* 2. bfloat16 weights, 1 / sum apart */
  softmax_heads(scores, qheads, ctx, 1, inv_sum);

  /* 3. out = inv * sum_p w_p v_p: float32 weights, value rows widened exactly to float32, once per group */
  for (int64_t kv = h0; kv < h1; kv++) {
    int64_t first = (kv - h0) * group;
    value_sums_bf16(vc + kv * hd, rows, scores + first * ctx, ctx, inv_sum + first, out + first * hd, hd, group,
                    fa);
  }
}

typedef void (*attend_fn)(const float*, const void*, const void*, const int64_t*, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, float, float*, float*, int64_t*, fetch_ahead*);

typedef struct {
  const void* q;
  int64_t q_ld;
  const void *k_cache, *v_cache;
  attend_fn attend;
  const int64_t *block_tables, *context_lens, *rows;
  int64_t bt_stride, heads, kvh, hd, bs, group, split, per_seq;
  float scale;
  void* out;
  int64_t out_ld;
  float* scratch;
  int64_t scratch_per_thread, max_context;
  int io_bf16; /* q and out bfloat16: widened into / rounded out of float32 rows in the thread's scratch */
  int64_t num_tasks, row_bytes;
  _Atomic int64_t next_task; /* tasks are claimed one at a time, each thread one ahead (see attention_lane) */
} attention_job;

static void attention_task(const attention_job* j, int64_t task, fetch_ahead* fa) {
  int64_t i = task / j->per_seq, h0 = (task % j->per_seq) * j->split;
  int64_t row = j->rows ? j->rows[i] : i;
  int64_t first = h0 * j->group * j->hd, n = j->split * j->group * j->hd;
  float* scores = j->scratch + (int64_t)thread_slot() * j->scratch_per_thread;
  int64_t* cache_rows = (int64_t*)(scores + ((j->heads * j->max_context + 1) & ~(int64_t)1)); /* aligned */
  const float* q = (const float*)j->q + row * j->q_ld + first;
  float* out = (float*)j->out + row * j->out_ld + first;
  if (j->io_bf16) {
    float* q32 = (float*)(cache_rows + j->max_context);
    const uint16_t* q16 = (const uint16_t*)j->q + row * j->q_ld + first;
    for (int64_t k = 0; k < n; k++) q32[k] = bf16_to_f32(q16[k]);
    q = q32;
    out = q32 + n;
  }
  j->attend(q, j->k_cache, j->v_cache, j->block_tables + i * j->bt_stride, j->context_lens[i], h0, h0 + j->split,
            j->group, j->kvh, j->hd, j->bs, j->scale, out, scores, cache_rows, fa);
  if (j->io_bf16) {
    uint16_t* o16 = (uint16_t*)j->out + row * j->out_ld + first;
    for (int64_t k = 0; k < n; k++) o16[k] = f32_to_bf16(out[k]);
  }
}

/* One thread's share: it claims its next task before it runs the current one, so that the current task can
 * fetch the next one's rows (fetch_ahead). Claiming one at a time keeps the threads balanced whatever the
 * context lengths; a lane that finds nothing left returns at once. */
static void attention_lane(void* arg, int64_t lane) {
  (void)lane;
  attention_job* j = (attention_job*)arg;
  int64_t task = atomic_fetch_add(&j->next_task, 1);
  int warm = 0;
  while (task < j->num_tasks) {
    int64_t next = atomic_fetch_add(&j->next_task, 1);
    int64_t next_seq = next / j->per_seq;
    fetch_ahead fa = {j->k_cache, j->v_cache, NULL, 0, j->bs, j->row_bytes, 0, 0, 0, warm};
    if (next < j->num_tasks) { /* whole rows: with one kv head per task, the next heads' too */
      fa.table = j->block_tables + next_seq * j->bt_stride;
      fa.ctx = j->context_lens[next_seq];
    }
    attention_task(j, task, &fa);
    warm = 1;
    task = next;
  }
}

/* q: row rows[i] (or i when rows is NULL) of a [tokens, heads * head_dim] matrix with row stride q_ld;
 * out: the same rows of a [tokens, heads * head_dim] matrix with row stride out_ld; both float32, or bfloat16 with
 * io_bf16. Each thread's scratch (scratch_per_thread floats, an even number) holds the scores, then max_context
 * int64 cache-row indices, then (io_bf16) 2 * heads * head_dim floats for a task's query and output rows.
 * With enough sequences to keep every thread busy a task is a whole sequence; with fewer, one kv head of one. */
void paged_decode_attention(const void* q, int64_t q_ld, const void* k_cache, const void* v_cache, int kv_bf16,
                            int bf16_values, int io_bf16,
                            const int64_t* block_tables, int64_t bt_stride, const int64_t* context_lens,
                            const int64_t* rows, int64_t num_seqs, int64_t heads, int64_t kvh, int64_t hd,
                            int64_t bs, float scale, void* out, int64_t out_ld, float* scratch,
                            int64_t scratch_per_thread, int64_t max_context, int num_threads, int use_pool) {
  int nthreads = num_threads < 1 ? 1 : num_threads;
  int64_t split = num_seqs >= 2 * (int64_t)nthreads ? kvh : 1; /* kv heads per task */
  attend_fn fn = bf16_values == 2 ? attend_bf16_dots
                 : bf16_values ? (kv_bf16 ? attend_bf16_rounded : attend_f32_as_bf16)
                               : (kv_bf16 ? attend_bf16 : attend_f32);
  attention_job job = {q,        q_ld,        k_cache, v_cache,     fn,      block_tables, context_lens,
                       rows,     bt_stride,   heads,   kvh,         hd,      bs,           heads / kvh,
                       split,    kvh / split, scale,   out,         out_ld,  scratch,      scratch_per_thread,
                       max_context, io_bf16, num_seqs * (kvh / split), kvh * hd * (kv_bf16 ? 2 : 4), 0};
  int64_t lanes = job.num_tasks < nthreads ? job.num_tasks : nthreads;
  parallel_for(lanes, attention_lane, &job, nthreads, use_pool);
}
