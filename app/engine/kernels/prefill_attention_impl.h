/* The body of prefill_attention.c, compiled once per instruction set: the includer defines
 *   SFX        a suffix for every name (avx2, avx512)
 *   TGT        the function attribute that selects the instruction set
 *   W          float32 lanes per vector; VT the vector type
 *   VLOAD VSTORE VSET1 VZERO VFMA VMUL VSUB VADD VMAXV  the usual vector operations
 *   VEXP       e^x for x <= 0 (softmax arguments after subtracting the max); VHSUM VHMAX horizontal sum / max
 * Nothing here depends on which rows share a tile: see prefill_attention.c for why that matters.
 */
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define NAME(x) CAT(x, SFX)

/* Phase 1: one sequence's keys of one kv head, transposed ([head_dim][ctx_pad], so that W consecutive positions
 * are one vector), and its values ([ctx_pad][head_dim]), both float32; the padding past ctx is zero. */
TGT static void NAME(gather_task)(void* arg, int64_t task) {
  const prefill_job* j = (const prefill_job*)arg;
  int64_t s = task / j->kvh, kh = task % j->kvh;
  int64_t ctx = j->ctx[s], pad = round_up(ctx, PAD), hd = j->hd;
  float* kt = j->kv_scratch + j->kv_off[s] + kh * 2 * hd * pad;
  float* v = kt + hd * pad;
  const int64_t* table = j->tables + s * j->bt_stride;
  for (int64_t p = 0; p < ctx; p++) {
    int64_t base = ((table[p / j->bs] * j->bs + p % j->bs) * j->kvh + kh) * hd;
    if (j->kv_bf16) {
      const uint16_t* kc = (const uint16_t*)j->k_cache + base;
      const uint16_t* vc = (const uint16_t*)j->v_cache + base;
      for (int64_t d = 0; d < hd; d++) {
        kt[d * pad + p] = bf16_to_f32(kc[d]);
        v[p * hd + d] = bf16_to_f32(vc[d]);
      }
    } else {
      const float* kc = (const float*)j->k_cache + base;
      for (int64_t d = 0; d < hd; d++) kt[d * pad + p] = kc[d];
      memcpy(v + p * hd, (const float*)j->v_cache + base, (size_t)hd * sizeof(float));
    }
  }
  for (int64_t d = 0; d < hd; d++)
    for (int64_t p = ctx; p < pad; p++) kt[d * pad + p] = 0.0f;
  memset(v + ctx * hd, 0, (size_t)((pad - ctx) * hd) * sizeof(float));
}

/* Scores of TILE query vectors against positions [0, upto) (upto a multiple of W), scaled: s[u][p] = scale *
 * q_u.k_p, each a dot product summed over d in order, whatever else the tile holds. qt is the tile's queries
 * transposed ([hd][TILE]: one base pointer for every broadcast); with AVX-512, two key vectors per step. */
TGT static void NAME(tile_scores)(const float* qt, const float* kt, int64_t pad, int64_t hd, int64_t upto,
                                  float scale, float* scores) {
  const VT vscale = VSET1(scale);
  int64_t p = 0;
#if W == 16 /* 2 x TILE accumulators: too many for AVX2's 16 registers */
  for (; p + 2 * W <= upto; p += 2 * W) {
    VT a[TILE], b[TILE];
    for (int u = 0; u < TILE; u++) a[u] = b[u] = VZERO();
    for (int64_t d = 0; d < hd; d++) {
      VT k0 = VLOAD(kt + d * pad + p), k1 = VLOAD(kt + d * pad + p + W);
      for (int u = 0; u < TILE; u++) {
        VT qd = VSET1(qt[d * TILE + u]);
        a[u] = VFMA(qd, k0, a[u]);
        b[u] = VFMA(qd, k1, b[u]);
      }
    }
    for (int u = 0; u < TILE; u++) {
      VSTORE(scores + u * pad + p, VMUL(a[u], vscale));
      VSTORE(scores + u * pad + p + W, VMUL(b[u], vscale));
    }
  }
#endif
  for (; p < upto; p += W) {
    VT a[TILE];
    for (int u = 0; u < TILE; u++) a[u] = VZERO();
    for (int64_t d = 0; d < hd; d++) {
      VT k0 = VLOAD(kt + d * pad + p);
      for (int u = 0; u < TILE; u++) a[u] = VFMA(VSET1(qt[d * TILE + u]), k0, a[u]);
    }
    for (int u = 0; u < TILE; u++) VSTORE(scores + u * pad + p, VMUL(a[u], vscale));
  }
}

/* Softmax of one vector's scores over its first n positions, unnormalised (e^(s - max)), in place; positions
 * [n, upto) become 0 so that the value sum may run to upto. Returns the sum of the weights. */
TGT static float NAME(softmax_row)(float* s, int64_t n, int64_t upto) {
  VT vmax = VSET1(-INFINITY);
  int64_t p = 0;
  for (; p + W <= n; p += W) vmax = VMAXV(vmax, VLOAD(s + p));
  float mx = VHMAX(vmax);
  for (; p < n; p++) mx = s[p] > mx ? s[p] : mx;
  VT vm = VSET1(mx), vsum = VZERO();
  for (p = 0; p + W <= n; p += W) {
    VT e = VEXP(VSUB(VLOAD(s + p), vm));
    VSTORE(s + p, e);
    vsum = VADD(vsum, e);
  }
  float sum = VHSUM(vsum);
  if (p < n) { /* tail: pad a vector with -inf, which exp maps to 0 */
    float tail[W];
    for (int i = 0; i < W; i++) tail[i] = p + i < n ? s[p + i] - mx : -INFINITY;
    VSTORE(tail, VEXP(VLOAD(tail)));
    for (int64_t i = 0; p + i < n; i++) {
      s[p + i] = tail[i];
      sum += tail[i];
    }
  }
  for (int64_t i = n; i < upto; i++) s[i] = 0.0f;
  return sum;
}

/* out_u = inv_u * sum_{p < upto} w[u][p] v_p for NV vectors and NC vectors of W values of head_dim (columns
 * [c0, c0 + NC * W)), positions summed in order. Weights past a vector's context are 0, which adds exactly 0. */
TGT static inline __attribute__((always_inline)) void NAME(values_block)(const float* w, int64_t pad,
                                                                         const float* v, int64_t hd, int64_t upto,
                                                                         int64_t c0, const float* inv,
                                                                         float* const* out, const int NV,
                                                                         const int NC) {
  VT acc[6][4];
  for (int u = 0; u < NV; u++)
    for (int c = 0; c < NC; c++) acc[u][c] = VZERO();
  for (int64_t p = 0; p < upto; p++) {
    VT vp[4];
    for (int c = 0; c < NC; c++) vp[c] = VLOAD(v + p * hd + c0 + c * W);
    for (int u = 0; u < NV; u++) {
      VT wp = VSET1(w[u * pad + p]);
      for (int c = 0; c < NC; c++) acc[u][c] = VFMA(wp, vp[c], acc[u][c]);
    }
  }
  for (int u = 0; u < NV; u++)
    for (int c = 0; c < NC; c++) VSTORE(out[u] + c0 + c * W, VMUL(acc[u][c], VSET1(inv[u])));
}

TGT static void NAME(tile_values)(const float* w, int64_t pad, const float* v, int64_t hd, int64_t upto,
                                  const float* inv, float* const* out) {
  /* 6 vectors x 4 column vectors of accumulators at a time (24 registers with AVX-512; AVX2 spills a few) */
  for (int64_t c0 = 0; c0 < hd;) {
    int64_t left = (hd - c0) / W;
    for (int u0 = 0; u0 < TILE; u0 += 6) {
      const float* wu = w + u0 * pad;
      if (left >= 4)
        NAME(values_block)(wu, pad, v, hd, upto, c0, inv + u0, out + u0, 6, 4);
      else if (left == 3)
        NAME(values_block)(wu, pad, v, hd, upto, c0, inv + u0, out + u0, 6, 3);
      else if (left == 2)
        NAME(values_block)(wu, pad, v, hd, upto, c0, inv + u0, out + u0, 6, 2);
      else
        NAME(values_block)(wu, pad, v, hd, upto, c0, inv + u0, out + u0, 6, 1);
    }
    c0 += (left >= 4 ? 4 : left) * W;
  }
}

/* Phase 2: TILE consecutive query vectors of one kv head of one sequence (vector u = query row u / group, head
 * u % group of that kv head's group); a short last tile repeats its last vector and stores it once. */
TGT static void NAME(tile_task)(void* arg, int64_t task) {
  const prefill_job* j = (const prefill_job*)arg;
  tile_place tp = place_tile(j, task);
  int64_t s = tp.s, kh = tp.kh, pad = tp.pad, hd = j->hd;
  float qt[MAX_HD * TILE];
  float* out[TILE];
  float inv[TILE];
  int64_t limit[TILE];
  for (int u = 0; u < TILE; u++) {
    int64_t q_at, out_at;
    limit[u] = tile_vector(j, &tp, u, &q_at, &out_at); /* positions this query may see */
    for (int64_t d = 0; d < hd; d++) qt[d * TILE + u] = j->q[q_at + d];
    out[u] = out_at >= 0 ? j->out + out_at : NULL;
  }
  int64_t upto = limit[TILE - 1]; /* the tile's last vector sees the most */
  int64_t upto_pad = round_up(upto, W);
  const float* kt = j->kv_scratch + j->kv_off[s] + kh * 2 * hd * pad;
  const float* v = kt + hd * pad;
  float* scores = j->scratch + (int64_t)thread_slot() * j->scratch_per_thread;
  float* spare = scores + TILE * pad; /* a short tile's repeated vectors write their output here */
  NAME(tile_scores)(qt, kt, pad, hd, upto_pad, j->scale, scores);
  for (int u = 0; u < TILE; u++) inv[u] = 1.0f / NAME(softmax_row)(scores + u * pad, limit[u], upto);
  for (int u = 0; u < TILE; u++)
    if (!out[u]) out[u] = spare;
  NAME(tile_values)(scores, pad, v, hd, upto, inv, out);
}

TGT static void NAME(prefill_attention)(prefill_job* job, int nthreads, int use_pool) {
  parallel_for(job->num_seqs * job->kvh, NAME(gather_task), job, nthreads, use_pool);
  parallel_for(job->tile_off[job->num_seqs], NAME(tile_task), job, nthreads, use_pool);
}

#undef NAME
#undef CAT
#undef CAT_
