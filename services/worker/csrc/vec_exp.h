// e^x on vectors of floats, inline, for the kernels' softmax (paged_attention.cpp) and SiLU
// (panel_linear.cpp): a call into libm's vector exp per 16 values made the gated product of
// panel_linear.cpp 1.02-1.04x slower than a separate pass; inline it ran 0.96-0.97x.
//
// Both widths: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts), e^r from Cephes's degree-6
// polynomial to about 1 ulp, then times 2^n.
#pragma once
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

// e^r for the reduced r of x = n ln2 + r, on either width's operations (Avx512, Avx2 below).
template <class Ops, class V = typename Ops::V>
inline V exp_reduced(V x, V n) {
  V r = Ops::fnmadd(n, Ops::set1(0.693359375f), x);
  r = Ops::fnmadd(n, Ops::set1(-2.12194440e-4f), r);
  V p = Ops::set1(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = Ops::fmadd(p, r, Ops::set1(c));
  return Ops::fmadd(p, Ops::mul(r, r), Ops::add(r, Ops::set1(1.f)));
}

// A width's operations for exp_reduced: PREFIX is its intrinsics' (_mm512, _mm256).
#define CBSERVE_VEC_OPS(NAME, TYPE, PREFIX)                                                  \
  struct NAME {                                                                            \
    using V = TYPE;                                                                        \
    static V set1(float v) { return PREFIX##_set1_ps(v); }                                 \
    static V fmadd(V a, V b, V c) { return PREFIX##_fmadd_ps(a, b, c); }                   \
    static V fnmadd(V a, V b, V c) { return PREFIX##_fnmadd_ps(a, b, c); }                 \
    static V mul(V a, V b) { return PREFIX##_mul_ps(a, b); }                               \
    static V add(V a, V b) { return PREFIX##_add_ps(a, b); }                               \
  };
#endif

#ifdef __AVX512F__
CBSERVE_VEC_OPS(Avx512, __m512, _mm512)

// e^x, 2^n by scalef (0 far below, where x is clamped so that r stays small).
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(exp_reduced<Avx512>(x, n), n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
CBSERVE_VEC_OPS(Avx2, __m256, _mm256)

// e^x for x <= 0, down to the smallest normal (x is clamped to [-87.34, 0], so that 2^n is built in
// the exponent bits: AVX2 has no scalef).
inline __m256 exp_avx2(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3365478515625f)), _mm256_setzero_ps());
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(exp_reduced<Avx2>(x, n), _mm256_castsi256_ps(two_n));
}
#endif
