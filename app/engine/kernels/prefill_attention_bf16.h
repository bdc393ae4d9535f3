/* The prefill kernel with bfloat16 scores (AVX512-BF16 `vdpbf16ps`: 32 multiply-adds of bfloat16 pairs into
 * 16 float32 sums per instruction, twice the float32 rate), for models that run in bfloat16: queries, keys and
 * values are bfloat16 values (as a bfloat16 SDPA has them), every sum and the softmax weights stay float32.
 * The weights are not rounded: the decode kernel computes a position's scores in another order, and a weight
 * rounded to bfloat16 would amplify that float32 rounding difference into a bfloat16 one.
 * Included by prefill_attention.c after the AVX-512 build, whose softmax and value sum it shares; same tiling,
 * same per-vector arithmetic whatever the tile holds, so it is exact across chunking as the float32 builds are.
 *
 * Keys (uint16 bfloat16 bits) are laid out [head_dim / 2][pad][2]: lane p of a vector holds dims (2i, 2i+1) of
 * position p. Values are float32 [pad][head_dim], as in the float32 builds.
 */
#define TGT_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma")))

static inline uint16_t cache_bf16(const void* cache, int64_t idx, int kv_bf16) {
  return kv_bf16 ? ((const uint16_t*)cache)[idx] : f32_to_bf16(((const float*)cache)[idx]);
}

TGT_BF16 static void gather_task_bf16dot(void* arg, int64_t task) {
  const prefill_job* j = (const prefill_job*)arg;
  int64_t s = task / j->kvh, kh = task % j->kvh;
  int64_t ctx = j->ctx[s], pad = round_up(ctx, PAD), hd = j->hd;
  uint16_t* kt = (uint16_t*)(j->kv_scratch + j->kv_off[s] + kh * 2 * hd * pad);
  float* v = j->kv_scratch + j->kv_off[s] + kh * 2 * hd * pad + hd * pad;
  const int64_t* table = j->tables + s * j->bt_stride;
  for (int64_t p = 0; p < ctx; p++) {
    int64_t base = ((table[p / j->bs] * j->bs + p % j->bs) * j->kvh + kh) * hd;
    for (int64_t d = 0; d < hd; d++) {
      kt[((d >> 1) * pad + p) * 2 + (d & 1)] = cache_bf16(j->k_cache, base + d, j->kv_bf16);
      v[p * hd + d] = bf16_to_f32(cache_bf16(j->v_cache, base + d, j->kv_bf16));
    }
  }
  for (int64_t p = ctx; p < pad; p++)
    for (int64_t d = 0; d < hd; d++) kt[((d >> 1) * pad + p) * 2 + (d & 1)] = 0;
  memset(v + ctx * hd, 0, (size_t)((pad - ctx) * hd) * sizeof(float));
}

TGT_BF16 static inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

/* s[u][p] = scale * q_u.k_p over positions [0, upto) (a multiple of 16), pairs of dims in order. qt holds the
 * tile's query pairs as 32-bit lanes, [hd / 2][TILE]. */
TGT_BF16 static void tile_scores_bf16dot(const uint32_t* qt, const uint16_t* kt, int64_t pad, int64_t hd,
                                         int64_t upto, float scale, float* scores) {
  const __m512 vscale = _mm512_set1_ps(scale);
  int64_t p = 0;
  for (; p < upto; p += 32) {
    int two = p + 32 <= upto;
    __m512 a[TILE], b[TILE];
    for (int u = 0; u < TILE; u++) a[u] = b[u] = _mm512_setzero_ps();
    for (int64_t i = 0; i < hd / 2; i++) {
      __m512bh k0 = as_bh(_mm512_loadu_si512(kt + (i * pad + p) * 2));
      __m512bh k1 = two ? as_bh(_mm512_loadu_si512(kt + (i * pad + p + 16) * 2)) : k0;
      for (int u = 0; u < TILE; u++) {
        __m512bh qi = as_bh(_mm512_set1_epi32((int)qt[i * TILE + u]));
        a[u] = _mm512_dpbf16_ps(a[u], qi, k0);
        b[u] = _mm512_dpbf16_ps(b[u], qi, k1);
      }
    }
    for (int u = 0; u < TILE; u++) {
      _mm512_storeu_ps(scores + u * pad + p, _mm512_mul_ps(a[u], vscale));
      if (two) _mm512_storeu_ps(scores + u * pad + p + 16, _mm512_mul_ps(b[u], vscale));
    }
  }
}

TGT_BF16 static void tile_task_bf16dot(void* arg, int64_t task) {
  const prefill_job* j = (const prefill_job*)arg;
  tile_place tp = place_tile(j, task);
  int64_t s = tp.s, kh = tp.kh, pad = tp.pad, hd = j->hd;
  uint32_t qt[MAX_HD / 2 * TILE];
  float* out[TILE];
  float inv[TILE];
  int64_t limit[TILE], out_at[TILE];
  float rows32[TILE * MAX_HD] __attribute__((aligned(64))); /* io_bf16: float32 sums, rounded out below */
  for (int u = 0; u < TILE; u++) {
    int64_t q_at;
    limit[u] = tile_vector(j, &tp, u, &q_at, &out_at[u]);
    if (j->io_bf16) { /* the query's bfloat16 bits as they are: what rounding a float32 copy would give */
      const uint16_t* qu = (const uint16_t*)j->q + q_at;
      for (int64_t i = 0; i < hd / 2; i++) memcpy(&qt[i * TILE + u], qu + 2 * i, 4); /* dims 2i, 2i + 1 */
      out[u] = out_at[u] >= 0 ? rows32 + u * hd : NULL;
    } else {
      const float* qu = j->q + q_at;
      for (int64_t i = 0; i < hd / 2; i++)
        qt[i * TILE + u] = (uint32_t)f32_to_bf16(qu[2 * i]) | (uint32_t)f32_to_bf16(qu[2 * i + 1]) << 16;
      out[u] = out_at[u] >= 0 ? j->out + out_at[u] : NULL;
    }
  }
  int64_t upto = limit[TILE - 1];
  const uint16_t* kt = (const uint16_t*)(j->kv_scratch + j->kv_off[s] + kh * 2 * hd * pad);
  const float* v = j->kv_scratch + j->kv_off[s] + kh * 2 * hd * pad + hd * pad;
  float* scores = j->scratch + (int64_t)thread_slot() * j->scratch_per_thread;
  float* spare = scores + TILE * pad; /* a short tile's repeated vectors write their output here */
  tile_scores_bf16dot(qt, kt, pad, hd, round_up(upto, 16), j->scale, scores);
  for (int u = 0; u < TILE; u++) inv[u] = 1.0f / softmax_row_avx512(scores + u * pad, limit[u], upto);
  for (int u = 0; u < TILE; u++)
    if (!out[u]) out[u] = spare;
  tile_values_avx512(scores, pad, v, hd, upto, inv, out);
  if (j->io_bf16)
    for (int u = 0; u < TILE; u++)
      if (out_at[u] >= 0) /* rounded to nearest even, as the float32 rows' conversion would */
        for (int64_t d = 0; d < hd; d++) ((uint16_t*)j->out)[out_at[u] + d] = f32_to_bf16(rows32[u * hd + d]);
}

TGT_BF16 static void prefill_attention_bf16dot(prefill_job* job, int nthreads, int use_pool) {
  parallel_for(job->num_seqs * job->kvh, gather_task_bf16dot, job, nthreads, use_pool);
  parallel_for(job->tile_off[job->num_seqs], tile_task_bf16dot, job, nthreads, use_pool);
}
