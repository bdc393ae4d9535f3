/* y = x @ W^T for a bfloat16 batch x [M, K] (M from a few rows to a prefill chunk) and a bfloat16 weight W [N, K]
 * packed once: the products of a bfloat16 model's batched decode steps and prefills (issue 16).
 *
 * W is packed in panels of 64 output columns, [N / 64][K / 2][64][2]: one 256-byte row of a panel holds dims
 * (2i, 2i + 1) of its 64 columns, the operand layout of AVX512-BF16 `vdpbf16ps`. A micro-kernel keeps 6 rows x
 * 64 columns of float32 sums in 24 registers and runs over K once: per pair of dims, 4 loads of the panel, 6
 * broadcasts of x and 24 `vdpbf16ps`. Each thread takes a contiguous run of panels (one stream of weights per
 * thread, each panel read from memory once and reused from L2 by every group of 6 rows; see part()) and, with
 * enough rows to hide it, fetches its next panel into L2 while it computes the current one.
 *
 * Every sum runs over K in order, pairs of dims at a time, into one float32 lane per output, then rounds to
 * bfloat16 (nearest even) or stays float32: a row's numbers do not depend on M, on its place in the batch or on
 * the thread count (oneDNN's packed product, which this replaces from BF16_MAX_ROWS + 1 rows on, gives the same
 * numbers but for a last-bit difference on about 1 output in 20,000, its order of sums). It runs 1.1-1.4x faster
 * than oneDNN on SmolLM2's layer shapes with the weights coming from memory, as a model's do
 * (scripts/bench_bf16_matmul.py).
 *
 * Built by app/engine/kernels/build.py; the AVX-512 code is compiled for its target only, and callers check
 * bf16_matmul_supported() (the CPU's AVX512-BF16) first.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "threadpool.h"
#include "vec_math.h"

#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")))
#define NR 64 /* output columns per panel */
#define MR 6  /* rows per micro-kernel call */
/* From this many rows on the next panel is fetched during the current one: with fewer, the product is bound by
 * the weights' bytes and the extra fetches only compete with the panel being read (measured). */
#define PREFETCH_MIN_ROWS 24

int bf16_gemm_abi_version(void) { return 3; }

/* Elements of W packed for N columns and K dims (K even). */
int64_t bf16_gemm_packed_size(int64_t N, int64_t K) { return (N + NR - 1) / NR * NR * K; }

/* The weight row behind column c of panel p: W's row p * NR + c, or (inter > 0, a fused [gate | up] weight of
 * 2 * inter rows packed for bf16_gemm_swiglu) gate row 32p + c for c < 32 and up row inter + 32p + c - 32. */
static inline int64_t packed_row(int64_t p, int64_t c, int64_t inter) {
  if (!inter) return p * NR + c;
  return c < NR / 2 ? p * (NR / 2) + c : inter + p * (NR / 2) + c - NR / 2;
}

static void pack(const uint16_t* w, int64_t ldw, int64_t N, int64_t K, uint16_t* out, int64_t inter) {
  int64_t pairs = K / 2, panels = (N + NR - 1) / NR;
  for (int64_t p = 0; p < panels; p++)
    for (int64_t i = 0; i < pairs; i++) {
      uint16_t* dst = out + (p * pairs + i) * NR * 2;
      for (int64_t c = 0; c < NR; c++) {
        int64_t n = p * NR + c, row = packed_row(p, c, inter);
        dst[2 * c] = n < N ? w[row * ldw + 2 * i] : 0;
        dst[2 * c + 1] = n < N ? w[row * ldw + 2 * i + 1] : 0;
      }
    }
}

/* W [N, K] (row stride ldw, bfloat16 words) into `out` (bf16_gemm_packed_size(N, K) words); columns past N
 * (the last panel's padding) are zero. K must be even. */
void bf16_gemm_pack(const uint16_t* w, int64_t ldw, int64_t N, int64_t K, uint16_t* out) {
  pack(w, ldw, N, K, out, 0);
}

/* A fused [gate | up] weight W [2 * inter, K] for bf16_gemm_swiglu: each panel holds 32 gate columns and the
 * 32 up columns of the same outputs. inter % 32 == 0, K even; bf16_gemm_packed_size(2 * inter, K) words. */
void bf16_gemm_pack_swiglu(const uint16_t* w, int64_t ldw, int64_t inter, int64_t K, uint16_t* out) {
  pack(w, ldw, 2 * inter, K, out, inter);
}

typedef struct {
  const uint16_t* x;
  int64_t ldx;
  const uint16_t* packed;
  int64_t K, N, M;
  void* y;
  int64_t ldy;
  int out_f32, parts, swiglu; /* swiglu: y [M, N / 2] = SwiGLU of the fused [gate | up] product */
} gemm_job;

/* Columns [n, n + 16) of row r, of which `valid` (1-16) exist. */
TGT static inline void store16(const gemm_job* j, int64_t r, int64_t n, __m512 v, int64_t valid) {
  __mmask16 mask = valid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1u);
  if (j->out_f32)
    _mm512_mask_storeu_ps((float*)j->y + r * j->ldy + n, mask, v);
  else /* nearest even, as oneDNN and torch round */
    _mm256_mask_storeu_epi16((uint16_t*)j->y + r * j->ldy + n, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

/* Sixteen sums rounded to bfloat16 as store16 rounds them, widened back to float32 (exactly). */
TGT static inline __m512 rounded_bf16(__m512 v) {
  __m256i bits = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* Rows [m, m + R) x the 64 columns of panel `bp` (column n0 onward); `fetch` lines of the next panel from
 * `ahead`, spread over the loop. */
TGT static inline __attribute__((always_inline)) void micro(const gemm_job* j, const uint16_t* bp, int64_t m,
                                                            int64_t n0, const char* ahead, int64_t fetch,
                                                            const int R) {
  __m512 acc[MR][4];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
  const uint16_t* a = j->x + m * j->ldx;
  const int64_t pairs = j->K / 2;
  int64_t fetched = 0;
  for (int64_t i = 0; i < pairs; i++) {
    const uint16_t* bk = bp + i * NR * 2;
    __m512bh b0 = (__m512bh)_mm512_loadu_si512(bk), b1 = (__m512bh)_mm512_loadu_si512(bk + 32);
    __m512bh b2 = (__m512bh)_mm512_loadu_si512(bk + 64), b3 = (__m512bh)_mm512_loadu_si512(bk + 96);
    if (fetched < fetch && (i & 1) == 0) _mm_prefetch(ahead + 64 * fetched++, _MM_HINT_T1);
    for (int r = 0; r < R; r++) {
      int32_t pair;
      memcpy(&pair, a + r * j->ldx + 2 * i, 4);
      __m512bh ar = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], ar, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], ar, b1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], ar, b2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], ar, b3);
    }
  }
  if (j->swiglu) { /* gate and up rounded as the unfused product gives them, then silu_mul's arithmetic */
    for (int r = 0; r < R; r++)
      for (int c = 0; c < 2; c++) {
        __m512 g = rounded_bf16(acc[r][c]), u = rounded_bf16(acc[r][c + 2]);
        store16_bf16((uint16_t*)j->y + (m + r) * j->ldy + n0 / 2 + 16 * c, swiglu16(g, u));
      }
    return;
  }
  int64_t left = j->N - n0;
  for (int r = 0; r < R; r++)
    for (int c = 0; c < 4 && 16 * c < left; c++) store16(j, m + r, n0 + 16 * c, acc[r][c], left - 16 * c);
}

/* Row groups [c0, c1) (of MR rows) times panel p; the next panel (if `next`) fetched into L2 meanwhile, a share
 * per micro-kernel. */
TGT static void panel(const gemm_job* j, int64_t p, int64_t c0, int64_t c1, int next) {
  const int64_t panel_words = j->K * NR;
  const uint16_t* bp = j->packed + p * panel_words;
  const char* ahead = (const char*)(bp + panel_words);
  int64_t lines = next && j->M >= PREFETCH_MIN_ROWS ? panel_words * 2 / 64 : 0;
  int64_t share = (lines + (c1 - c0) - 1) / (c1 - c0);
  for (int64_t c = c0; c < c1; c++) {
    int64_t m = c * MR, fetch = lines - share * (c - c0) < share ? lines - share * (c - c0) : share;
    const char* at = ahead + 64 * share * (c - c0);
    if (fetch < 0) fetch = 0;
    switch (j->M - m < MR ? j->M - m : MR) {
      case 6: micro(j, bp, m, p * NR, at, fetch, 6); break;
      case 5: micro(j, bp, m, p * NR, at, fetch, 5); break;
      case 4: micro(j, bp, m, p * NR, at, fetch, 4); break;
      case 3: micro(j, bp, m, p * NR, at, fetch, 3); break;
      case 2: micro(j, bp, m, p * NR, at, fetch, 2); break;
      default: micro(j, bp, m, p * NR, at, fetch, 1); break;
    }
  }
}

/* Part t of `parts`: a contiguous run of the (panel, row group) units in panel order, the same split for every
 * call. Whole panels would leave a thread a panel more than the other (9 panels of 576 outputs on 2 threads:
 * 5 and 4); this way the parts differ by a micro-kernel at most and share at most a panel at their border. */
static void part(void* arg, int64_t t) {
  const gemm_job* j = (const gemm_job*)arg;
  const int64_t groups = (j->M + MR - 1) / MR, units = (j->N + NR - 1) / NR * groups;
  const int64_t u0 = units * t / j->parts, u1 = units * (t + 1) / j->parts;
  for (int64_t u = u0; u < u1;) {
    int64_t p = u / groups, c0 = u % groups, c1 = u1 - p * groups < groups ? u1 - p * groups : groups;
    panel(j, p, c0, c1, (p + 1) * groups < u1);
    u = p * groups + c1;
  }
}

/* y [M, N] (row stride ldy; bfloat16, or float32 with out_f32) = x [M, K] (row stride ldx) @ W^T, W packed by
 * bf16_gemm_pack; all bfloat16 as raw 16-bit words, K even. */
void bf16_gemm(const uint16_t* x, int64_t ldx, const uint16_t* packed, int64_t K, int64_t N, int64_t M, void* y,
               int64_t ldy, int out_f32, int num_threads, int use_pool) {
  int64_t units = (N + NR - 1) / NR * ((M + MR - 1) / MR);
  int parts = num_threads < 1 ? 1 : num_threads;
  if (parts > units) parts = (int)units;
  gemm_job job = {x, ldx, packed, K, N, M, y, ldy, out_f32, parts, 0};
  parallel_for(parts, part, &job, num_threads, use_pool);
}

/* y [M, inter] (row stride ldy, bfloat16) = silu(x @ G^T) * (x @ U^T) for a fused [gate | up] weight packed by
 * bf16_gemm_pack_swiglu: the bits of bf16_gemm (bfloat16 out) followed by silu_mul (elementwise.c, AVX-512),
 * without writing the [M, 2 * inter] product out and reading it back. */
void bf16_gemm_swiglu(const uint16_t* x, int64_t ldx, const uint16_t* packed, int64_t K, int64_t inter, int64_t M,
                      uint16_t* y, int64_t ldy, int num_threads, int use_pool) {
  int64_t units = 2 * inter / NR * ((M + MR - 1) / MR);
  int parts = num_threads < 1 ? 1 : num_threads;
  if (parts > units) parts = (int)units;
  gemm_job job = {x, ldx, packed, K, 2 * inter, M, y, ldy, 0, parts, 1};
  parallel_for(parts, part, &job, num_threads, use_pool);
}
