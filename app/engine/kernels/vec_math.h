/* Vector helpers shared by the C kernels (AVX2 + FMA): one copy, so every kernel computes them alike. */
#ifndef INF_ENGINE_VEC_MATH_H
#define INF_ENGINE_VEC_MATH_H

#include <immintrin.h>

/* The sum of the eight lanes. */
static inline float hsum256(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

/* e^x for x <= 0 (softmax and sigmoid arguments): 2^n * e^r with n = round(x / ln 2) and a degree-6
 * polynomial for e^r on |r| <= ln2 / 2 (relative error ~2e-7), r = x - n ln2 in two steps (ln2 split into a
 * short exact part and the rest) to keep r accurate; x below -87 gives 0. */
static inline __m256 exp256_nonpositive(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.0f);
  __m256 underflow = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lowest);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

#endif
