// What both paged attention kernels (paged_decode.h, paged_prefill.h) share: the pool's element
// types and how a row of each is read as float32, the rounded queries of an int8 pool, the softmax's
// pieces and the dispatch on the head size.
//
// One row, one result. A query row gets the same bits from either kernel over the same keys: a soft
// reset recomputes through paged_prefill the tokens that paged_decode first computed, and in bfloat16
// a last-bit difference in one row's attention can flip an activation's rounding and, at a near tie,
// a token. The kernels lay a row's work out differently (decode: one row, its keys streamed; prefill:
// 16 query tokens across the lanes, tiled over keys), so each step that sums is written to sum in one
// order in both:
//   - a dot: the query times the scale first, then one FMA chain over the dims in order, from zero.
//     That is the prefill's natural order (rows across the lanes, a K element broadcast per FMA); the
//     decode kernel gets it by transposing each block's K rows so that keys lie across the lanes
//     (dims across the lanes would sum 16 partial chains and then the lanes, which the prefill could
//     follow only by holding 16 partial sums per dot);
//   - an int8 key's scale, then the soft cap (soft_cap: the kernels' own vector tanh, one code for
//     every score), then e^(s - max) by exp_ps / exp_avx2 over the row's own keys (the max is exact
//     in any order);
//   - the softmax sum: 16 partial sums (AVX2: 8), partial l taking the row's keys l, l + 16, .. in
//     order, then a fixed tree (hsum16 / sum_tree16): the decode kernel's vector sum, which the prefill
//     keeps as 16 vectors of partial sums per vector of rows;
//   - the values: one FMA chain per output over the row's keys in order, then times 1 / the sum.
// The prefill also runs keys that a row does not see (outside its causal range or window) through the
// same chains with weight 0, which adds exactly nothing. (On the portable path the prefill runs the
// decode kernel's own task per query token, so the two agree by construction.) The file is built
// without fast-math's unsafe rewrites, FMA contraction or reciprocal estimates (kernels.py's
// KERNEL_FLAGS), which would re-order or round differently the same sum written in two shapes;
// tests/test_attention_prefill_is_decode.py holds every page type and vector path to it.
#pragma once

// Only the headers used: <torch/extension.h> (all of libtorch's C++ API) tripled the compile time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define CBSERVE_AVX2 1  // the 8-float variants of the vector paths (16 registers)
#endif
#if defined(__AVX512F__) || defined(CBSERVE_AVX2)
#include <immintrin.h>
#endif
#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "hadamard.h"
#include "settle.h"
#include "vec_exp.h"

namespace {

using bf16 = at::BFloat16;
using f16 = at::Half;
using i8 = int8_t;

// An int8 row's values are followed by their float32 scale (common/kv_int8.py); the other types' rows
// are their values alone.
template <class T>
constexpr bool kScaled = std::is_same_v<T, i8>;
template <class T>
constexpr int64_t kScaleElems = kScaled<T> ? 4 : 0;

// Dims of a pool row per 32-bit word: the decode dots transpose K rows as words (a word of bfloat16
// holds two dims, of int8 four), so that a narrower pool takes fewer shuffles and widens once per word.
// A float16 row is widened as it is loaded instead (vcvtph2ps takes whole vectors of halves, not one
// half of each word), and its words are then float32 ones: one dim each.
template <class T>
constexpr int kPerWord = std::is_same_v<T, f16> ? 1 : static_cast<int>(4 / sizeof(T));
// The bytes of a pool row that one transposed word holds.
template <class T>
constexpr int64_t kWordBytes = kPerWord<T> * int64_t{sizeof(T)};

// The scale of the int8 row whose D values start at `row`.
inline float row_scale(const i8* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof s);
  return s;
}

// The pool's elements as float32, exactly: a bfloat16's 16 bits are the high half of the float32's;
// every float16 is a float32; an int8 is its integer value (its row's scale is applied apart).
inline float widen(float x) { return x; }
inline float widen(bf16 x) { return std::bit_cast<float>(static_cast<uint32_t>(x.x) << 16); }
inline float widen(f16 x) { return static_cast<float>(x); }
inline float widen(i8 x) { return static_cast<float>(x); }

#ifdef __AVX512F__
// 16 elements of a pool row as float32 lanes.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const f16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const i8* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#endif
#ifdef CBSERVE_AVX2
// 8 elements of a pool row as float32 lanes.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const f16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const i8* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

// A pool row of n elements as float32: the row itself, or, from 16-bit or int8 (its values, unscaled),
// widened into `buf`. For the loops that broadcast a row one element at a time (the prefill kernels; a
// widened broadcast is three instructions where a float32 one is a load): such a row is widened once,
// by vectors, into L1.
inline const float* f32_row(const float* row, float*, int64_t) { return row; }
template <class T>
inline const float* f32_row(const T* row, float* buf, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(buf + i, load16(row + i));
#elif defined(CBSERVE_AVX2)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(buf + i, load8(row + i));
#endif
  for (; i < n; ++i) buf[i] = widen(row[i]);
  return buf;
}

// The queries of an int8 pool (common/kv_int8.py, `round_queries`): each query row, once rotated, is
// rounded to kQueryLevels steps of its own scale, max |row| / kQueryLevels (15 bits: far finer than
// the keys' 8), on every path (round_query, round_query16, and torch's for the generic path). With
// AVX512-VNNI a query-key dot is then an exact int32 sum of int16 queries times int8 keys, four (or
// two) products an instruction where the float dots widened every key element and multiplied it in
// one FMA per query (docs/performance-log.md has the kernels' times). An exact sum is the same in any
// order, so the decode kernel (keys across the lanes, vpdpbusd) and the prefill (query rows across the
// lanes, vpdpwssd) still give a row the same bits: each score is float(dot) * the row's scale, then *
// the key's scale, in that order in both. Elsewhere the rounded rows go through the float dots.
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define CBSERVE_INT_DOTS 1
template <class T>
constexpr bool kIntDots = kScaled<T>;  // only read under CBSERVE_INT_DOTS
#endif

// At most 127 * 256 + 127, so that the decode kernel can split each value into a high and a low signed
// byte (q = 256 hi + lo) for vpdpbusd.
constexpr float kQueryLevels = 32639.f;

// A rotated query row r [D] rounded in place: q = round(r * (kQueryLevels / m)) to nearest even, then
// r = q * (m / kQueryLevels), m = max |r| (a row of zeros stays zeros). Every operation is one IEEE
// rounding, so round_query16 and torch's round_queries give the same bits.
inline void round_query(float* r, int64_t D) {
  float m = 0.f;
  for (int64_t d = 0; d < D; ++d) m = std::max(m, std::fabs(r[d]));
  if (m == 0.f) return;
  const float inv = kQueryLevels / m, step = m / kQueryLevels;
  for (int64_t d = 0; d < D; ++d) r[d] = std::nearbyint(std::clamp(r[d] * inv, -kQueryLevels, kQueryLevels)) * step;
}

#ifdef __AVX512F__
// round_query on a head of NC vectors held in registers.
template <int NC>
inline void round_query16(__m512* v) {
  __m512 top = _mm512_setzero_ps();
  for (int c = 0; c < NC; ++c) top = _mm512_max_ps(top, _mm512_abs_ps(v[c]));
  const float m = _mm512_reduce_max_ps(top);
  if (m == 0.f) return;
  const __m512 inv = _mm512_set1_ps(kQueryLevels / m), step = _mm512_set1_ps(m / kQueryLevels);
  const __m512 hi = _mm512_set1_ps(kQueryLevels);
  for (int c = 0; c < NC; ++c) {
    const __m512 x = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v[c], inv), -hi), hi);
    v[c] = _mm512_mul_ps(_mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), step);
  }
}
#endif

#ifdef CBSERVE_INT_DOTS
// r [D] (a rounded query row times the softmax scale; D a multiple of 16) -> its int16 values q [D],
// returned with their scale: q = round(r * (kQueryLevels / max |r|)), exactly the rounded row's levels
// (each r is level * step * scale within a few ulps, far inside half a level).
inline float quantize_query(const float* r, int64_t D, int16_t* q) {
  __m512 top = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(r + d)));
  const float m = _mm512_reduce_max_ps(top);
  const __m512 inv = _mm512_set1_ps(m == 0.f ? 0.f : kQueryLevels / m), hi = _mm512_set1_ps(kQueryLevels);
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(r + d), inv), -hi), hi);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + d), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(v)));
  }
  return m / kQueryLevels;
}
#endif

// ------------------------------------------------------------------------- shared by both kernels
//
// A row's softmax, computed alike by both kernels (see "One row, one result" in the header): the
// soft cap, e^(x - max) and the order of the sum.

#ifdef __AVX512F__
// cap * tanh(x / cap) on 16 lanes, x / cap taken as x times inv_cap = 1 / cap: Cephes's odd polynomial
// below |x / cap| = 0.625, (1 - e^-2|y|) / (1 + e^-2|y|) above, the sign put back. The kernels' own
// rather than libm's: a compiler's vector tanh and the scalar one it calls for a loop's last elements
// may differ in the last bit, and both kernels must cap a score alike wherever it falls in a loop.
inline __m512 soft_cap16(__m512 x, float cap, float inv_cap) {
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(inv_cap)), a = _mm512_abs_ps(y), one = _mm512_set1_ps(1.f);
  const __m512 t = exp_ps(_mm512_mul_ps(a, _mm512_set1_ps(-2.f)));
  const __m512 far = _mm512_div_ps(_mm512_sub_ps(one, t), _mm512_add_ps(one, t));
  const __m512 z = _mm512_mul_ps(a, a);
  __m512 p = _mm512_set1_ps(-5.70498872745e-3f);
  for (const float c : {2.06390887954e-2f, -5.37397155531e-2f, 1.33314422036e-1f, -3.33332819422e-1f})
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(c));
  const __m512 near = _mm512_fmadd_ps(_mm512_mul_ps(p, z), a, a);
  const __m512 mag = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(0.625f), _CMP_LT_OQ), far, near);
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(INT32_MIN));
  return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag), sign)), _mm512_set1_ps(cap));
}

// The sum of 16 partial sums, lane l of p[0] .. p[15] for each l, in one fixed tree: p[i] + p[i + 8],
// then + 4, + 2, + 1. The same tree as hsum16's over the lanes of one vector.
inline __m512 sum_tree16(__m512* p) {
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) p[i] = _mm512_add_ps(p[i], p[i + w]);
  return p[0];
}

// The sum of a vector's 16 lanes in sum_tree16's tree: lane i + lane i + 8, then + 4, + 2, + 1.
inline float hsum16(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 e = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(e, _mm_movehdup_ps(e)));
}
#endif

#ifdef CBSERVE_AVX2
// soft_cap16 on 8 lanes.
inline __m256 soft_cap8(__m256 x, float cap, float inv_cap) {
  const __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(inv_cap)), one = _mm256_set1_ps(1.f);
  const __m256 sign_bit = _mm256_set1_ps(-0.f);
  const __m256 a = _mm256_andnot_ps(sign_bit, y);
  const __m256 t = exp_avx2(_mm256_mul_ps(a, _mm256_set1_ps(-2.f)));
  const __m256 far = _mm256_div_ps(_mm256_sub_ps(one, t), _mm256_add_ps(one, t));
  const __m256 z = _mm256_mul_ps(a, a);
  __m256 p = _mm256_set1_ps(-5.70498872745e-3f);
  for (const float c : {2.06390887954e-2f, -5.37397155531e-2f, 1.33314422036e-1f, -3.33332819422e-1f})
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(c));
  const __m256 near = _mm256_fmadd_ps(_mm256_mul_ps(p, z), a, a);
  const __m256 mag = _mm256_blendv_ps(far, near, _mm256_cmp_ps(a, _mm256_set1_ps(0.625f), _CMP_LT_OQ));
  return _mm256_mul_ps(_mm256_or_ps(mag, _mm256_and_ps(sign_bit, y)), _mm256_set1_ps(cap));
}

// sum_tree16 for 8 partial sums: p[i] + p[i + 4], then + 2, + 1.
inline __m256 sum_tree8(__m256* p) {
  for (int w = 4; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) p[i] = _mm256_add_ps(p[i], p[i + w]);
  return p[0];
}

// hsum16 for 8 lanes, in sum_tree8's tree.
inline float hsum8(__m256 v) {
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 e = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(e, _mm_movehdup_ps(e)));
}
#endif

// Soft-capping (Gemma2) of n scores in place: by vectors on the vector paths (a vector's worth past
// n is read and written through a mask or a copy), so that every score is capped by the same code.
inline void soft_cap(float* x, int64_t n, float cap) {
  if (cap <= 0.f) return;
  const float inv_cap = 1.f / cap;
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, soft_cap16(_mm512_loadu_ps(x + i), cap, inv_cap));
  if (i < n) {
    const __mmask16 tail = __mmask16((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(x + i, tail, soft_cap16(_mm512_maskz_loadu_ps(tail, x + i), cap, inv_cap));
  }
#elif defined(CBSERVE_AVX2)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, soft_cap8(_mm256_loadu_ps(x + i), cap, inv_cap));
  if (i < n) {
    alignas(32) float tail[8] = {};
    std::copy(x + i, x + n, tail);
    _mm256_store_ps(tail, soft_cap8(_mm256_load_ps(tail), cap, inv_cap));
    std::copy(tail, tail + (n - i), x + i);
  }
#else
  // Both kernels run this loop on the portable path: the portable prefill is the decode kernel's task.
  for (; i < n; ++i) x[i] = std::tanh(x[i] * inv_cap) * cap;
#endif
}
#ifdef __AVX512F__
// out[l], lane i: in[i]'s lane l (a 16 x 16 transpose, 64 shuffles).
inline void transpose16(const __m512* in, __m512* out) {
  __m512 t[16], u[16], v[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(in[2 * i], in[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(in[2 * i], in[2 * i + 1]);
  }
  // u[4a + e], 128-bit block b: lane e + 4b of vectors 4a .. 4a + 3.
  for (int a = 0; a < 4; ++a) {
    const __m512d t0 = _mm512_castps_pd(t[4 * a]), t1 = _mm512_castps_pd(t[4 * a + 1]);
    const __m512d t2 = _mm512_castps_pd(t[4 * a + 2]), t3 = _mm512_castps_pd(t[4 * a + 3]);
    u[4 * a] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
    u[4 * a + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
    u[4 * a + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
    u[4 * a + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
  }
  // v[8h + 4k + e]: lanes e + 4k and e + 4k + 8 of vectors 8h .. 8h + 7.
  for (int h = 0; h < 2; ++h)
    for (int e = 0; e < 4; ++e) {
      v[8 * h + e] = _mm512_shuffle_f32x4(u[8 * h + e], u[8 * h + 4 + e], _MM_SHUFFLE(2, 0, 2, 0));
      v[8 * h + 4 + e] = _mm512_shuffle_f32x4(u[8 * h + e], u[8 * h + 4 + e], _MM_SHUFFLE(3, 1, 3, 1));
    }
  for (int k = 0; k < 2; ++k)
    for (int e = 0; e < 4; ++e) {
      out[4 * k + e] = _mm512_shuffle_f32x4(v[4 * k + e], v[8 + 4 * k + e], _MM_SHUFFLE(2, 0, 2, 0));
      out[8 + 4 * k + e] = _mm512_shuffle_f32x4(v[4 * k + e], v[8 + 4 * k + e], _MM_SHUFFLE(3, 1, 3, 1));
    }
}
#endif

#ifdef __AVX512F__
// The head sizes with a vector path (D = 16 x NC): `make.template operator()<NC>()` for D, else
// `other`. Both kernels dispatch through this one list.
template <typename Fn, typename Make>
Fn by_head_size(int64_t D, Fn other, Make make) {
  switch (D) {
    case 16: return make.template operator()<1>();
    case 32: return make.template operator()<2>();
    case 48: return make.template operator()<3>();
    case 64: return make.template operator()<4>();
    case 80: return make.template operator()<5>();
    case 96: return make.template operator()<6>();
    case 128: return make.template operator()<8>();
    default: return other;
  }
}
#endif
}  // namespace
