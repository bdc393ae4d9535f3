/* The prefill kernel on AMX tiles (Intel AMX-BF16: a 16 x 32 by 32 x 16 bfloat16 product into 16 x 16 float32
 * sums per instruction), for bfloat16 models on CPUs that have it. Same values as the AVX512-BF16 build:
 * queries, keys and values in bfloat16, float32 scores, softmax and sums; same tiling of query vectors (TILE per
 * task), so it is exact across chunking as the other builds are:
 *
 *   scores: a C tile [TILE vectors x 16 positions] += Q [TILE x 32 dims] . K [32 dims x 16 positions], twice for
 *           head_dim 64; every score is its own dot product, summed over the dims in order;
 *   values: the float32 weights w are split exactly into three bfloat16 parts (w = hi + mid + lo: 8 + 8 + 8 bits of
 *           significand), and out [TILE x 16 dims] += part [TILE x 32 positions] . V [32 positions x 16 dims] for
 *           each part, positions in order from 0: weights past a vector's context are 0 and add exactly 0.
 *
 * Keys come in the AVX512-BF16 build's layout ([head_dim / 2][pad][2]: a tile's rows are pairs of dims, 16
 * positions each); values as [pad32 / 2][head_dim][2] (a tile's rows are pairs of positions, 16 dims each).
 * head_dim 32 or 64 (two C tiles of scores' dims at most, four of values'). q and out may be bfloat16 (io_bf16:
 * a bfloat16 model's rows between its products; the same numbers, the output rounded). Included by prefill_attention.c
 * after the AVX512-BF16 build, whose helpers it uses.
 */
#define TGT_AMX __attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma,amx-tile,amx-bf16")))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Ask Linux for the AMX tile state (once per process; oneDNN asks too). 1 when the tiles may be used. */
int amx_request(void) {
  static int granted = -1;
  if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return granted;
}

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} __attribute__((packed, aligned(64))) tile_config;

/* tmm0-3: float32 sums [TILE x 16]; tmm4-6: bfloat16 A [TILE x 32]; tmm7: bfloat16 B [16 pair rows x 32]. */
TGT_AMX static void amx_configure(void) {
  tile_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 7; t++) {
    cfg.rows[t] = TILE;
    cfg.colsb[t] = 64;
  }
  cfg.rows[7] = 16;
  cfg.colsb[7] = 64;
  _tile_loadconfig(&cfg);
}

/* A bfloat16 cache's rows of positions p and p + 1 (hd values each, hd a multiple of 32), interleaved into
 * value-tile order: out[2d + i] = row_{p+i}[d]. */
TGT_AMX static inline void interleave_pair(const uint16_t* a, const uint16_t* b, uint16_t* out, int64_t hd) {
  static const uint16_t order[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                     8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_loadu_si512(order);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t d = 0; d < hd; d += 32) {
    __m512i x = _mm512_loadu_si512(a + d), y = _mm512_loadu_si512(b + d);
    _mm512_storeu_si512(out + 2 * d, _mm512_permutex2var_epi16(x, lo, y));
    _mm512_storeu_si512(out + 2 * d + 32, _mm512_permutex2var_epi16(x, hi, y));
  }
}

TGT_AMX static void gather_task_amx(void* arg, int64_t task) {
  const prefill_job* j = (const prefill_job*)arg;
  int64_t s = task / j->kvh, kh = task % j->kvh;
  int64_t ctx = j->ctx[s], pad = round_up(ctx, PAD), pad32 = round_up(ctx, 32), hd = j->hd;
  uint16_t* kt = (uint16_t*)(j->kv_scratch + j->kv_off[s] + kh * 2 * hd * pad);
  uint16_t* vt = kt + hd * pad; /* pad32 * hd bfloat16 <= hd * pad floats */
  const int64_t* table = j->tables + s * j->bt_stride;
  if (!j->kv_bf16) { /* a float32 cache: rounded value by value */
    for (int64_t p = 0; p < ctx; p++) {
      int64_t base = ((table[p / j->bs] * j->bs + p % j->bs) * j->kvh + kh) * hd;
      for (int64_t d = 0; d < hd; d++) {
        kt[((d >> 1) * pad + p) * 2 + (d & 1)] = cache_bf16(j->k_cache, base + d, 0);
        vt[((p >> 1) * hd + d) * 2 + (p & 1)] = cache_bf16(j->v_cache, base + d, 0);
      }
    }
  } else { /* keys: pairs of dims are 32-bit words, moved whole; values: two rows interleaved at once */
    const uint16_t *kc = (const uint16_t*)j->k_cache, *vc = (const uint16_t*)j->v_cache;
    uint32_t* kt32 = (uint32_t*)kt;
    const uint16_t zero_row[128] = {0};
    for (int64_t p = 0; p < ctx; p += 2) {
      int64_t b0 = ((table[p / j->bs] * j->bs + p % j->bs) * j->kvh + kh) * hd;
      int64_t b1 = p + 1 < ctx ? ((table[(p + 1) / j->bs] * j->bs + (p + 1) % j->bs) * j->kvh + kh) * hd : -1;
      const uint32_t* k0 = (const uint32_t*)(kc + b0);
      for (int64_t i = 0; i < hd / 2; i++) kt32[i * pad + p] = k0[i];
      if (b1 >= 0) {
        const uint32_t* k1 = (const uint32_t*)(kc + b1);
        for (int64_t i = 0; i < hd / 2; i++) kt32[i * pad + p + 1] = k1[i];
      }
      interleave_pair(vc + b0, b1 >= 0 ? vc + b1 : zero_row, vt + (p >> 1) * hd * 2, hd);
    }
    ctx = round_up(ctx, 2); /* the odd tail's partner row is already zero */
  }
  for (int64_t p = j->ctx[s]; p < pad; p++)
    for (int64_t d = 0; d < hd; d++) kt[((d >> 1) * pad + p) * 2 + (d & 1)] = 0;
  for (int64_t p = ctx; p < pad32; p++)
    for (int64_t d = 0; d < hd; d++) vt[((p >> 1) * hd + d) * 2 + (p & 1)] = 0;
}

/* bfloat16 bits of x rounded to nearest even (vcvtneps2bf16; finite x), and x minus that value, exactly. */
TGT_AMX static inline __m512 split_bf16(__m512 x, __m256i* bits) {
  *bits = (__m256i)_mm512_cvtneps_pbh(x);
  __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(*bits), 16));
  return _mm512_sub_ps(x, back);
}

/* One vector's softmax weights over its first n positions, straight into bfloat16 parts: w = e^(scale * s - m)
 * (m the largest scaled score) split as parts[p] + parts[stride + p] + parts[2 * stride + p], zeros from n to
 * upto32. Returns the sum of the float32 weights. */
TGT_AMX static float weights_amx(const float* s, int64_t n, int64_t upto32, float scale, uint16_t* parts,
                                 int64_t stride) {
  const __m512 vscale = _mm512_set1_ps(scale);
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  int64_t p = 0;
  for (; p + 16 <= n; p += 16) vmax = _mm512_max_ps(vmax, _mm512_mul_ps(_mm512_loadu_ps(s + p), vscale));
  if (p < n) {
    __mmask16 tail = (__mmask16)((1u << (n - p)) - 1);
    vmax = _mm512_mask_max_ps(vmax, tail, vmax, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + p), vscale));
  }
  float mx = _mm512_reduce_max_ps(vmax);
  __m512 vm = _mm512_set1_ps(mx), vsum = _mm512_setzero_ps();
  for (p = 0; p < n; p += 16) {
    __mmask16 live = p + 16 <= n ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - p)) - 1);
    __m512 x = _mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(live, s + p), vscale), vm);
    __m512 e = _mm512_maskz_mov_ps(live, exp512_nonpositive(x));
    vsum = _mm512_add_ps(vsum, e);
    __m256i hi, mid;
    __m512 rest = split_bf16(split_bf16(e, &hi), &mid);
    _mm256_storeu_si256((__m256i*)(parts + p), hi);
    _mm256_storeu_si256((__m256i*)(parts + stride + p), mid);
    _mm256_storeu_si256((__m256i*)(parts + 2 * stride + p), (__m256i)_mm512_cvtneps_pbh(rest)); /* exact */
  }
  for (; p < upto32; p += 16) /* past the context: weight 0 */
    for (int part = 0; part < 3; part++) _mm256_storeu_si256((__m256i*)(parts + part * stride + p), _mm256_setzero_si256());
  return _mm512_reduce_add_ps(vsum);
}

TGT_AMX static void tile_task_amx(void* arg, int64_t task) {
  const prefill_job* j = (const prefill_job*)arg;
  tile_place tp = place_tile(j, task);
  int64_t s = tp.s, kh = tp.kh, pad = tp.pad, hd = j->hd;
  uint16_t qa[TILE * 64] __attribute__((aligned(64)));
  int64_t out_at[TILE];
  float inv[TILE];
  int64_t limit[TILE];
  for (int u = 0; u < TILE; u++) {
    int64_t q_at;
    limit[u] = tile_vector(j, &tp, u, &q_at, &out_at[u]); /* out_at -1: a repeat */
    if (j->io_bf16) {
      memcpy(qa + u * hd, (const uint16_t*)j->q + q_at, (size_t)hd * 2);
    } else {
      const float* qu = j->q + q_at;
      for (int64_t d = 0; d < hd; d += 32) /* rounded to nearest even, as f32_to_bf16 */
        _mm512_storeu_si512(qa + u * hd + d,
                            (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(qu + d + 16), _mm512_loadu_ps(qu + d)));
    }
  }
  int64_t upto = limit[TILE - 1], upto16 = round_up(upto, 16), upto32 = round_up(upto, 32);
  const uint16_t* kt = (const uint16_t*)(j->kv_scratch + j->kv_off[s] + kh * 2 * hd * pad);
  const uint16_t* vt = kt + hd * pad;
  float* scores = j->scratch + (int64_t)thread_slot() * j->scratch_per_thread;
  int64_t wpad = round_up(pad, 32); /* the weights' row length: whole 32-position tiles */
  uint16_t* parts = (uint16_t*)(scores + TILE * wpad); /* three [TILE][wpad] bfloat16 parts */
  float* sums = (float*)(parts + 3 * TILE * wpad); /* [TILE][64] */
  amx_configure();

  /* 1. scores of positions [0, upto16), 16 at a time */
  const int64_t kstride = pad * 4; /* bytes between a key tile's rows (pairs of dims) */
  _tile_loadd(4, qa, hd * 2);
  if (hd == 64) _tile_loadd(5, qa + 32, hd * 2);
  for (int64_t p = 0; p < upto16; p += 16) {
    _tile_zero(0);
    _tile_loadd(7, kt + p * 2, kstride);
    _tile_dpbf16ps(0, 4, 7);
    if (hd == 64) {
      _tile_loadd(7, kt + (16 * pad + p) * 2, kstride);
      _tile_dpbf16ps(0, 5, 7);
    }
    _tile_stored(0, scores + p, wpad * 4);
  }
  for (int u = 0; u < TILE; u++) inv[u] = 1.0f / weights_amx(scores + u * wpad, limit[u], upto32, j->scale,
                                                          parts + u * wpad, TILE * wpad);

  /* 3. out = inv * sum_p w_p v_p over [0, upto32), 32 positions at a time, each part in turn */
  const int64_t nd = hd / 16;
  for (int64_t c = 0; c < nd; c++) switch (c) {
      case 0: _tile_zero(0); break;
      case 1: _tile_zero(1); break;
      case 2: _tile_zero(2); break;
      default: _tile_zero(3); break;
    }
  for (int64_t p = 0; p < upto32; p += 32) {
    _tile_loadd(4, parts + p, wpad * 2);
    _tile_loadd(5, parts + TILE * wpad + p, wpad * 2);
    _tile_loadd(6, parts + 2 * TILE * wpad + p, wpad * 2);
    const uint16_t* vb = vt + (p >> 1) * hd * 2;
#define VALUE_COLUMNS(C)                   \
  _tile_loadd(7, vb + 32 * (C), hd * 4);   \
  _tile_dpbf16ps(C, 4, 7);                 \
  _tile_dpbf16ps(C, 5, 7);                 \
  _tile_dpbf16ps(C, 6, 7);
    VALUE_COLUMNS(0)
    VALUE_COLUMNS(1)
    if (nd == 4) {
      VALUE_COLUMNS(2)
      VALUE_COLUMNS(3)
    }
#undef VALUE_COLUMNS
  }
  _tile_stored(0, sums, 64 * 4);
  _tile_stored(1, sums + 16, 64 * 4);
  if (nd == 4) {
    _tile_stored(2, sums + 32, 64 * 4);
    _tile_stored(3, sums + 48, 64 * 4);
  }
  for (int u = 0; u < TILE; u++) {
    int64_t at = out_at[u];
    if (at < 0) continue; /* a short tile's repeat of its last vector */
    __m512 vinv = _mm512_set1_ps(inv[u]);
    for (int64_t d = 0; d < hd; d += 16) {
      __m512 o = _mm512_mul_ps(_mm512_loadu_ps(sums + u * 64 + d), vinv);
      if (j->io_bf16)
        _mm256_storeu_si256((__m256i*)((uint16_t*)j->out + at + d), (__m256i)_mm512_cvtneps_pbh(o));
      else
        _mm512_storeu_ps(j->out + at + d, o);
    }
  }
}

TGT_AMX static void prefill_attention_amx(prefill_job* job, int nthreads, int use_pool) {
  parallel_for(job->num_seqs * job->kvh, gather_task_amx, job, nthreads, use_pool);
  parallel_for(job->tile_off[job->num_seqs], tile_task_amx, job, nthreads, use_pool);
}
