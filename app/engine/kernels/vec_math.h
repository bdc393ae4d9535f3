/* Vector helpers shared by the C kernels (AVX2 + FMA): one copy, so every kernel computes them alike. */
#ifndef INF_ENGINE_VEC_MATH_H
#define INF_ENGINE_VEC_MATH_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

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

/* e^x for x <= 0 sixteen lanes wide: exp256_nonpositive's arithmetic, lane for lane (the same bits). */
__attribute__((target("avx512f,avx2,fma"))) static inline __m512 exp512_nonpositive(__m512 x) {
  const __m512 lowest = _mm512_set1_ps(-87.0f);
  __mmask16 underflow = _mm512_cmp_ps_mask(x, lowest, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lowest);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps((__mmask16)~underflow, p, _mm512_castsi512_ps(e));
}

/* A bfloat16 value (its 16 bits) widened to float32, exactly. */
static inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* float32 rounded to bfloat16 bits, to nearest even as PyTorch rounds; a NaN stays a (quiet) NaN. */
static inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
  return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* Sixteen float32 lanes rounded to bfloat16 bits, to nearest even, NaN kept quiet (f32_to_bf16 lane by lane). */
__attribute__((target("avx512f,avx512bw,avx2,fma"))) static inline void store16_bf16(uint16_t* p, __m512 x) {
  __m512i bits = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(rounded));
}

/* SwiGLU sixteen lanes wide, silu(x) * up in float32: the sigmoid from e^-|x| (never overflows), the same
 * operations wherever it is used (elementwise.c's silu_mul, bf16_gemm.c's fused epilogue), so the same bits. */
__attribute__((target("avx512f,avx512dq,avx2,fma"))) static inline __m512 swiglu16(__m512 x, __m512 up) {
  const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
  __m512 t = exp512_nonpositive(_mm512_or_ps(x, sign));
  __m512 inv = _mm512_div_ps(one, _mm512_add_ps(one, t));
  __m512 sig = _mm512_mask_blend_ps(_mm512_movepi32_mask(_mm512_castps_si512(x)), inv, _mm512_mul_ps(t, inv));
  return _mm512_mul_ps(_mm512_mul_ps(x, sig), up);
}

#endif
