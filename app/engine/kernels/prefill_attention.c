/* Prefill attention straight from the paged KV cache: many query tokens per sequence, causal.
 *
 * PyTorch's CPU flash attention runs at about 43 GFLOP/s on a 512-token prompt here (2 cores), and its numbers
 * for a query row depend on how the keys are blocked, so a prompt whose prefix came from the cache (or that was
 * cut into chunks) would not attend exactly as the whole prompt did. Here every query vector (one head of one
 * token) gets the same arithmetic wherever it sits: its scores are dot products summed over head_dim in order,
 * its softmax runs over exactly its positions, and its output sums the positions in order. So prefix caching,
 * chunked prefill and batching give the same bits, and the work is blocked for speed only across vectors:
 *
 *   1. per (sequence, kv head): gather its keys transposed ([head_dim][ctx]) and its values, float32;
 *   2. per tile of TILE query vectors that share a kv head (GQA: the group's heads of a few tokens), scores for
 *      W positions at a time (one key vector load feeds TILE fused multiply-adds), softmax, and the value sum
 *      (one value row load feeds the tile's accumulators).
 *
 * Builds of the same code, chosen at run time: AVX-512 where the CPU has it, AVX2 elsewhere; and for bfloat16
 * models, bfloat16 products where the CPU has AVX512-BF16 (prefill_attention_bf16.h).
 * Caches are [num_blocks, block_size, kv_heads, head_dim], float32 or bfloat16; queries and outputs float32.
 */
#define _GNU_SOURCE /* syscall(), for the AMX tile permission */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "threadpool.h"
#include "vec_math.h"

int prefill_attention_abi_version(void) { return 5; }

#define TILE 12 /* query vectors per tile: 12 accumulators + a key vector fit AVX2's 16 registers */
#define PAD 16  /* position padding of a gathered sequence: a whole vector at either width */
#define MAX_HD 256

typedef struct {
  const float* q;
  int64_t q_ld;
  const void *k_cache, *v_cache;
  int kv_bf16;
  const int64_t *tables, *ctx, *qstart, *qlen;
  int64_t bt_stride, num_seqs, kvh, group, hd, bs;
  float scale;
  float* out;
  int64_t out_ld;
  float* kv_scratch;
  int64_t* kv_off;   /* [num_seqs] float offset of a sequence's gathered K/V */
  int64_t* tile_off; /* [num_seqs + 1] first task of each sequence */
  float* scratch;    /* per thread: scores, then a spare output row */
  int64_t scratch_per_thread;
  int io_bf16; /* q and out are bfloat16 (the AMX and AVX512-BF16 builds) */
} prefill_job;

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* Where task `task` of phase 2 sits: sequence s, kv head kh, and its first query vector u0 (vector u = query row
 * u / group, head u % group of the kv head's group); tasks run the longest tiles first, for balance. */
typedef struct {
  int64_t s, kh, u0, nvec, ctx, pad;
} tile_place;

static inline tile_place place_tile(const prefill_job* j, int64_t task) {
  tile_place t;
  t.s = 0;
  while (j->tile_off[t.s + 1] <= task) t.s++;
  int64_t local = task - j->tile_off[t.s];
  int64_t ntiles = (j->tile_off[t.s + 1] - j->tile_off[t.s]) / j->kvh;
  t.kh = local % j->kvh;
  t.u0 = (ntiles - 1 - local / j->kvh) * TILE;
  t.nvec = j->qlen[t.s] * j->group;
  t.ctx = j->ctx[t.s];
  t.pad = round_up(t.ctx, PAD);
  return t;
}

/* Vector u of the tile (a short last tile repeats its last vector): the element offset of its query row and
 * head in q (q_ld) and out (out_ld), -1 for out when it is a repeat, and the positions it may see. */
static inline int64_t tile_vector(const prefill_job* j, const tile_place* t, int u, int64_t* q_at, int64_t* out_at) {
  int64_t uu = t->u0 + u < t->nvec ? t->u0 + u : t->nvec - 1;
  int64_t row = j->qstart[t->s] + uu / j->group, head = t->kh * j->group + uu % j->group;
  *q_at = row * j->q_ld + head * j->hd;
  *out_at = t->u0 + u < t->nvec ? row * j->out_ld + head * j->hd : -1;
  return t->ctx - j->qlen[t->s] + uu / j->group + 1;
}

static inline float hmax8(__m256 v) {
  __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_max_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

#define SFX avx2
#define TGT
#define W 8
#define VT __m256
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VSET1 _mm256_set1_ps
#define VZERO _mm256_setzero_ps
#define VFMA _mm256_fmadd_ps
#define VMUL _mm256_mul_ps
#define VSUB _mm256_sub_ps
#define VADD _mm256_add_ps
#define VMAXV _mm256_max_ps
#define VEXP exp256_nonpositive
#define VHSUM hsum256
#define VHMAX hmax8
#include "prefill_attention_impl.h"
#undef SFX
#undef TGT
#undef W
#undef VT
#undef VLOAD
#undef VSTORE
#undef VSET1
#undef VZERO
#undef VFMA
#undef VMUL
#undef VSUB
#undef VADD
#undef VMAXV
#undef VEXP
#undef VHSUM
#undef VHMAX

/* ---- AVX-512 (F only), compiled for it function by function and run only where the CPU has it ---- */
#define TGT512 __attribute__((target("avx512f,avx2,fma")))

TGT512 static inline float hsum16(__m512 v) {
  __m256 lo = _mm512_castps512_ps256(v);
  __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return hsum256(_mm256_add_ps(lo, hi));
}

TGT512 static inline float hmax16(__m512 v) {
  __m256 lo = _mm512_castps512_ps256(v);
  __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return hmax8(_mm256_max_ps(lo, hi));
}

#define SFX avx512
#define TGT TGT512
#define W 16
#define VT __m512
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VSET1 _mm512_set1_ps
#define VZERO _mm512_setzero_ps
#define VFMA _mm512_fmadd_ps
#define VMUL _mm512_mul_ps
#define VSUB _mm512_sub_ps
#define VADD _mm512_add_ps
#define VMAXV _mm512_max_ps
#define VEXP exp512_nonpositive
#define VHSUM hsum16
#define VHMAX hmax16
#include "prefill_attention_impl.h"
#include "prefill_attention_bf16.h"
#include "prefill_attention_amx.h"

/* q / out: [tokens, heads * head_dim] (row strides q_ld / out_ld); sequence s has qlen[s] query rows from row
 * qstart[s], the last qlen[s] of its ctx[s] positions, whose K/V (new ones included) are already in the cache
 * through its row of tables ([num_seqs, bt_stride]). kv_scratch holds sum over s of kvh * 2 * head_dim *
 * round_up(ctx[s], 16) floats; scratch, per thread, scratch_per_thread >= TILE * round_up(max ctx, 16) + head_dim
 * floats (AMX: TILE * round_up(max ctx, 32) * 2.5 + TILE * 64 + head_dim). isa picks the build (the caller
 * checks the CPU): 0 AVX2, 1 AVX-512, 2 AVX-512 with bfloat16 products (prefill_attention_bf16.h), 3 AMX tiles
 * (prefill_attention_amx.h; head_dim 32 or 64, after amx_request()). Builds 2 and 3 also take bfloat16 q and out
 * (io_bf16: the same numbers, the output rounded to nearest even). Returns 0, or -1 when out of memory. */
int paged_prefill_attention(const float* q, int64_t q_ld, const void* k_cache, const void* v_cache, int kv_bf16,
                            int io_bf16,
                            const int64_t* tables, int64_t bt_stride, const int64_t* ctx, const int64_t* qstart,
                            const int64_t* qlen, int64_t num_seqs, int64_t heads, int64_t kvh, int64_t hd,
                            int64_t bs, float scale, float* out, int64_t out_ld, float* kv_scratch, float* scratch,
                            int64_t scratch_per_thread, int isa, int num_threads, int use_pool) {
  int64_t* offsets = (int64_t*)malloc((size_t)(2 * num_seqs + 1) * sizeof(int64_t));
  if (!offsets) return -1;
  prefill_job job = {q,         q_ld,      k_cache,   v_cache,     kv_bf16,     tables, ctx,    qstart,
                     qlen,      bt_stride, num_seqs,  kvh,         heads / kvh, hd,     bs,     scale,
                     out,       out_ld,    kv_scratch, offsets,    offsets + num_seqs, scratch,
                     scratch_per_thread, io_bf16};
  int64_t kv = 0, tiles = 0;
  for (int64_t s = 0; s < num_seqs; s++) {
    job.kv_off[s] = kv;
    job.tile_off[s] = tiles;
    kv += kvh * 2 * hd * round_up(ctx[s], PAD);
    tiles += kvh * ((qlen[s] * job.group + TILE - 1) / TILE);
  }
  job.tile_off[num_seqs] = tiles;
  int nthreads = num_threads < 1 ? 1 : num_threads;
  if (isa == 3)
    prefill_attention_amx(&job, nthreads, use_pool);
  else if (isa == 2)
    prefill_attention_bf16dot(&job, nthreads, use_pool);
  else if (isa == 1)
    prefill_attention_avx512(&job, nthreads, use_pool);
  else
    prefill_attention_avx2(&job, nthreads, use_pool);
  free(offsets);
  return 0;
}
