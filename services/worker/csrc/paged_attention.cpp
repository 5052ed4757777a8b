// Paged attention on CPU, reading K/V straight from the paged pool through each request's slot list:
// no gathered copy of any context and no mask is ever built. The pool holds float32, bfloat16, float16
// or int8 (the element type T of every loop that reads it); queries, outputs and all arithmetic are
// float32. A bfloat16 is the high half of a float32's bits and a float16 converts to float32 exactly
// (F16C's vcvtph2ps), so a 16-bit element is widened exactly as it is loaded, and with the same
// arithmetic in the same order a 16-bit pool gives, bit for bit, the float32 kernel's output on its
// upcast copy, from half the bytes.
//
// An int8 row (common/kv_int8.py) is its head's values and then their float32 scale: a head's row is
// D + 4 elements apart from the next (`hd`). The values are widened to float32 as they are loaded, as
// a bfloat16's are, and the scale enters once per row: q.(s k) = s (q.k) multiplies each key's
// scores, and w (s v) = (w s) v each key's softmax weights, so every loop that reads values runs
// unchanged on the widened integers. The values are those of the row rotated by a block Hadamard
// matrix H (hadamard.h), which is orthonormal and its own inverse: the kernels rotate each query
// head by H before the dots, (H q).(H k) = q.k, and each output head back by H at the end,
// sum p (H v) = H sum p v, all in hadamard::rotate's steps (rotated_queries, rotate_out_rows).
//
// Decode rows (paged_decode): one query token per request. The context is read once per layer, from
// memory (a step's contexts of 30 layers are far larger than the caches), which is what bounds decode
// attention.
//
// Work is split into tasks of one request and a range of its kv heads: all heads when there are
// enough requests to keep every thread busy (a token's K or V row for all heads is one contiguous
// read), one head each otherwise (so a lone long request still uses every core). Contexts differ in
// length by 10x within a batch, so threads take tasks from a shared counter instead of fixed shares.
//
// With AVX-512 and a head size of 16..128, query-key dots are computed 16 keys at a time with the
// keys across the lanes (the block's K rows transposed, see below); each K row is loaded once for all
// the queries of its head, and the values of up to four queries of a head are accumulated in
// registers from one load of each V row. Pages are scattered in the pool, which defeats the hardware
// prefetcher at every page boundary, so the rows ahead are prefetched by hand: a few lines at a time
// as the reads advance (`Pump`).
//
// With AVX2 (and no AVX-512) and a head size of 32, 64, 96 or 128, a block's K rows of a head are
// transposed once into an L1 buffer, keys across the lanes, whose dots then run 24 keys (three chains)
// per query row; the values of up to three queries of a head are accumulated in 12 registers, a
// 32-float slice of the head at a time. These loops prefetch for themselves, a line of the row 16 keys
// on for each line they read, instead of the pump (kPumped). The portable loops that serve elsewhere
// leave a decode step's attention well behind the rate its K/V reads allow.
//
// Prefill chunks (paged_prefill; AVX-512, or AVX2 for head sizes 32-128 by 32; on the portable path
// each query token runs as a decode row): several query tokens per request, each attending causally
// (and within a sliding window, if any) to the keys before it. See the second half.
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
//
// Only the headers used: <torch/extension.h> (all of libtorch's C++ API) tripled the compile time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/utils/pybind.h>
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
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "hadamard.h"
#include "settle.h"
#include "vec_exp.h"

namespace {
constexpr int64_t kAheadLines = 144;  // how far ahead of the reads the pump prefetches
constexpr int64_t kAvx2Ahead = 16;    // how many keys ahead of its reads the AVX2 path prefetches
constexpr int64_t kBlock = 16;   // keys per block of dots
// ... on AVX2's vector path: three vectors of 8 keys, so that three query rows' dots run as nine
// independent FMA chains (each dot is one chain over the dims, see below; with two vectors, the six
// chains left the FMAs waiting on their latency).
constexpr int64_t kAvx2Block = 24;
constexpr int64_t kVBlock = 32;  // keys per block of the V pass: their rows, all heads, stay in L1
constexpr int64_t kMaxRows = 4096;  // query heads of one request

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

// A decode task's query rows for the integer dots, in its scratch after the scaled queries: each int16
// value split into a high and a low signed byte (q = 256 hi + lo), four dims a word as a K row's words
// hold them; 128 * the row's sum (vpdpbusd takes the keys unsigned, as k + 128, so that
// sum (k + 128) q = k.q + 128 sum q); the row's scale.
struct QueryWords {
  int32_t* hi;      // [rows, D / 4]
  int32_t* lo;      // [rows, D / 4]
  int32_t* offset;  // [rows]
  float* scale;     // [rows]
  QueryWords(float* base, int64_t rows, int64_t D)
      : hi(reinterpret_cast<int32_t*>(base)), lo(hi + rows * D / 4), offset(lo + rows * D / 4),
        scale(reinterpret_cast<float*>(offset + rows)) {}
  static constexpr int64_t floats(int64_t rows, int64_t D) { return rows * (D / 2 + 2); }

#ifdef CBSERVE_INT_DOTS
  // Rows qs [rows, D] (rotated and scaled; D at most 128, the vector paths' largest head) rounded and
  // split. Once per decode task: on the stack, not a heap allocation each time.
  void fill(const float* qs, int64_t rows, int64_t D) {
    alignas(64) int16_t q[128];
    for (int64_t r = 0; r < rows; ++r) {
      scale[r] = quantize_query(qs + r * D, D, q);
      int32_t sum = 0;
      uint8_t* h = reinterpret_cast<uint8_t*>(hi + r * D / 4);
      uint8_t* l = reinterpret_cast<uint8_t*>(lo + r * D / 4);
      for (int64_t d = 0; d < D; ++d) {
        const int32_t low = static_cast<int8_t>(static_cast<uint8_t>(q[d] & 0xFF));
        l[d] = static_cast<uint8_t>(low);
        h[d] = static_cast<uint8_t>((q[d] - low) >> 8);
        sum += q[d];
      }
      offset[r] = 128 * sum;
    }
  }
#endif
};

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

template <class T>  // the pool's element type: float, bf16, f16 or i8
struct Task {
  const float* q;      // [hs, G, D] of this row (contiguous: heads are adjacent in a packed row)
  float* out;          // [hs, G, D]
  const T* k;          // this task's first head in key 0 of the pool: key s is k + s * stride
  const T* v;
  const int64_t* slot; // the keys this row reads: slot[0 .. n)
  int64_t n, hs, G, D;
  int64_t hd;          // elements from one head's row to the next: D + kScaleElems<T>
  int64_t stride;      // elements from one key's rows to the next key's
  float scale, cap;
};

// A task reads one stream of rows, its K rows then its V rows (each all the task's heads, one
// contiguous read); the pump keeps kAheadLines lines of bytes prefetched ahead of the reads, a row at
// a time as the reads advance. Pages are scattered, so the hardware prefetcher loses the stream at
// every page boundary, and prefetching a whole block's rows at once outran what a core can have in
// flight (the reads then waited for memory instead of overlapping the arithmetic): the pump paces
// them. Each line is prefetched once: an int8 row (D values and a scale a head) is no whole number of
// lines, and the next slot's row starts on the line where this one ends. The lines go into L2, not L1:
// a prefetch into L1 holds one of the core's few L1 miss buffers until memory answers, and with them
// all taken the reads (and the next prefetches) stalled (docs/performance-log.md has the measurements).
template <class T>
class Pump {
 public:
  // `start`: prefetch the stream's first kAheadLines lines now (else the first advance does).
  Pump(const Task<T>& t, bool start) : t_(t), row_bytes_(t.hs * t.hd * int64_t{sizeof(T)}), rows_(2 * t.n) {
    if (start) advance(0);
  }

  // The reads moved past `head_rows` more head rows of the stream (D values each, and in an int8
  // stream their scale).
  inline void advance(int64_t head_rows) {
    target_ += head_rows * t_.hd * int64_t{sizeof(T)};
    for (; pos_ < target_ && row_ < rows_; pos_ += row_bytes_, ++row_) {
      const T* row = row_ < t_.n ? t_.k + t_.slot[row_] * t_.stride : t_.v + t_.slot[row_ - t_.n] * t_.stride;
      const uintptr_t first = reinterpret_cast<uintptr_t>(row) / 64;
      const uintptr_t last = (reinterpret_cast<uintptr_t>(row) + row_bytes_ - 1) / 64;
      // A row that starts on the line where the one before it ended (the next slot of a page)
      // takes its lines from the one after.
      for (uintptr_t line = first == last_ ? first + 1 : first; line <= last; ++line)
        __builtin_prefetch(reinterpret_cast<const char*>(line * 64), 0, 1);  // into L2 (prefetcht2)
      last_ = last;
    }
  }

 private:
  const Task<T>& t_;
  const int64_t row_bytes_, rows_;
  int64_t target_ = kAheadLines * 64, pos_ = 0;  // bytes of the stream: to prefetch up to, prefetched
  int64_t row_ = 0;                               // the next row of the stream to prefetch
  uintptr_t last_ = 0;                            // the last line prefetched
};

// Whether the pump paces a task's reads (NC: run_task's). Not on AVX2's vector path, whose loops
// prefetch the rows kAvx2Ahead keys on a line at a time as they read theirs (transpose_keys,
// weighted_slice): the pump's block of prefetches at a time left those loops' reads and arithmetic
// running one after the other rather than together (docs/performance-log.md).
template <int NC>
constexpr bool kPumped =
#ifdef CBSERVE_AVX2
    NC == 0;
#else
    true;
#endif

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

// Dim b of the kPerWord<T> dims that the 32-bit words of `w` hold, as float32 (int8: unscaled).
template <class T>
inline __m512 word_dim(__m512i w, int b) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, f16>) return _mm512_castsi512_ps(w);
  else if constexpr (std::is_same_v<T, bf16>)
    return _mm512_castsi512_ps(b == 0 ? _mm512_slli_epi32(w, 16) : _mm512_and_si512(w, _mm512_set1_epi32(-65536)));
  else return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(w, 24 - 8 * b), 24));
}

// The dots of GB queries of head h (qs: the task's queries, scaled, rows D apart; these are rows r0 ..
// r0 + GB) with keys [j0, j0 + count) of the slot range, in paged_prefill's order: one FMA chain over
// the dims in order, from zero. Keys lie across the lanes: 16 words at a time of the block's 16 K rows
// are loaded and transposed (64 shuffles: the price of that order here) and meet every query at once.
// The first pass over a block (`pump` set) moves the pump along two rows at a time as it loads them.
template <int NC, int GB, class T>
inline void keys_dots(const Task<T>& t, float* qs, int64_t r0, int64_t h, int64_t j0, int64_t count,
                      float* scores, Pump<T>* pump) {
  constexpr int64_t D = 16 * NC, kWords = D / kPerWord<T>;
  const T* kr[kBlock];
  for (int64_t i = 0; i < kBlock; ++i) kr[i] = t.k + t.slot[j0 + std::min(i, count - 1)] * t.stride + h * t.hd;
  const float* q = qs + r0 * D;
  __m512 acc[GB];
  for (int g = 0; g < GB; ++g) acc[g] = _mm512_setzero_ps();
#ifdef CBSERVE_INT_DOTS
  // The integer dots' sums of the high and the low bytes.
  const QueryWords words(qs + t.hs * t.G * D, t.hs * t.G, D);
  __m512i hi[GB], lo[GB];
  for (int g = 0; g < GB; ++g) hi[g] = lo[g] = _mm512_setzero_si512();
#endif
  for (int64_t w0 = 0; w0 < kWords; w0 += 16) {
    __m512 rows[16], cols[16];
    if constexpr (std::is_same_v<T, float>) {
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        if (pump != nullptr && w0 == 0 && i % 2 == 0) pump->advance(2);
        rows[i] = _mm512_loadu_ps(kr[i] + w0);
      }
    } else if constexpr (std::is_same_v<T, f16>) {
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        if (pump != nullptr && w0 == 0 && i % 2 == 0) pump->advance(2);
        rows[i] = load16(kr[i] + w0);  // D is 16 NC: whole vectors
      }
    } else {
      // Through a mask: a row of bfloat16 or int8 may end within the 16 words. (Taken for whole words
      // too: with plain loads the bfloat16 kernel ran slower on short contexts.)
      const __mmask16 words = __mmask16(kWords - w0 >= 16 ? 0xFFFF : (1u << (kWords - w0)) - 1);
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        if (pump != nullptr && w0 == 0 && i % 2 == 0) pump->advance(2);
        rows[i] = _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(words, kr[i] + w0 * kPerWord<T>));
      }
    }
    transpose16(rows, cols);
    // Unrolled, so that the columns stay in registers (rolled, the compiler stored them to read back).
#pragma GCC unroll 16
    for (int l = 0; l < 16; ++l) {
      if (w0 + l >= kWords) break;
#ifdef CBSERVE_INT_DOTS
      if constexpr (kIntDots<T>) {
        const __m512i k = _mm512_xor_si512(_mm512_castps_si512(cols[l]), _mm512_set1_epi32(int32_t(0x80808080)));
#pragma GCC unroll 4
        for (int g = 0; g < GB; ++g) {
          const int64_t w = (r0 + g) * kWords + w0 + l;
          hi[g] = _mm512_dpbusd_epi32(hi[g], k, _mm512_set1_epi32(words.hi[w]));
          lo[g] = _mm512_dpbusd_epi32(lo[g], k, _mm512_set1_epi32(words.lo[w]));
        }
        continue;
      }
#endif
#pragma GCC unroll 4
      for (int b = 0; b < kPerWord<T>; ++b) {
        const __m512 kv = word_dim<T>(_mm512_castps_si512(cols[l]), b);
        const int64_t d = (w0 + l) * kPerWord<T> + b;
#pragma GCC unroll 4
        for (int g = 0; g < GB; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * D + d]), kv, acc[g]);
      }
    }
  }
  const __mmask16 keep = __mmask16((1u << count) - 1);
#ifdef CBSERVE_INT_DOTS
  if constexpr (kIntDots<T>)
    for (int g = 0; g < GB; ++g) {
      const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(hi[g], 8), lo[g]),
                                           _mm512_set1_epi32(words.offset[r0 + g]));
      acc[g] = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(words.scale[r0 + g]));
    }
#endif
  for (int g = 0; g < GB; ++g) _mm512_mask_storeu_ps(scores + (r0 + g) * t.n + j0, keep, acc[g]);
}

// The dots of one head's G queries with keys [j0, j0 + count) of the slot range (keys_dots), up to
// four queries a pass.
template <int NC, class T>
inline void head_dots(const Task<T>& t, float* qs, int64_t h, int64_t j0, int64_t count, float* scores,
                      Pump<T>& pump) {
  for (int64_t r0 = h * t.G; r0 < (h + 1) * t.G; r0 += 4) {
    Pump<T>* moves = r0 == h * t.G ? &pump : nullptr;
    switch (std::min<int64_t>(4, (h + 1) * t.G - r0)) {
      case 1: keys_dots<NC, 1>(t, qs, r0, h, j0, count, scores, moves); break;
      case 2: keys_dots<NC, 2>(t, qs, r0, h, j0, count, scores, moves); break;
      case 3: keys_dots<NC, 3>(t, qs, r0, h, j0, count, scores, moves); break;
      default: keys_dots<NC, 4>(t, qs, r0, h, j0, count, scores, moves); break;
    }
  }
}

// out[g] (+)= sum_j w[g][j] * V[j] over keys [j0, j1) for GB queries of one head (w rows t.n apart,
// out rows t.D apart): each V row is loaded once for all of them, and the GB x NC accumulators stay in
// registers within the block; `first` starts from zero, `last` scales by inv[g] = 1 / the row's sum.
template <int NC, int GB, class T>
inline void weighted_block(const Task<T>& t, const float* w, int64_t head_off, int64_t j0, int64_t j1,
                           const float* inv, float* out, bool first, bool last, Pump<T>* pump) {
  __m512 acc[GB][NC];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NC; ++c)
      acc[g][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + g * t.D + 16 * c);
  for (int64_t j = j0; j < j1; ++j) {
    if (pump != nullptr) pump->advance(1);
    const T* vr = t.v + t.slot[j] * t.stride + head_off;
    __m512 v[NC];
    for (int c = 0; c < NC; ++c) v[c] = load16(vr + 16 * c);
    for (int g = 0; g < GB; ++g) {
      const __m512 wg = _mm512_set1_ps(w[g * t.n + j]);
      for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_fmadd_ps(wg, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g) {
    const __m512 s = _mm512_set1_ps(last ? inv[g] : 1.f);
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(out + g * t.D + 16 * c, _mm512_mul_ps(acc[g][c], s));
  }
}

// The queries of one head over a block of keys, as many per weighted_block call as keep the
// accumulators within 16 registers; the first call moves the pump along.
template <int NC, class T>
inline void weighted_blocks(const Task<T>& t, const float* w, int64_t head_off, int64_t j0, int64_t j1,
                            const float* inv, float* out, bool first, bool last, Pump<T>& pump) {
  constexpr int kMax = std::max(1, std::min(4, 16 / NC));
  for (int64_t g = 0; g < t.G; g += kMax) {
    const int64_t gb = std::min<int64_t>(kMax, t.G - g);
    const float* wg = w + g * t.n;
    float* og = out + g * t.D;
    Pump<T>* moves = g == 0 ? &pump : nullptr;
    if (gb == 1) weighted_block<NC, 1>(t, wg, head_off, j0, j1, inv + g, og, first, last, moves);
    if constexpr (kMax >= 2) if (gb == 2) weighted_block<NC, 2>(t, wg, head_off, j0, j1, inv + g, og, first, last, moves);
    if constexpr (kMax >= 3) if (gb == 3) weighted_block<NC, 3>(t, wg, head_off, j0, j1, inv + g, og, first, last, moves);
    if constexpr (kMax >= 4) if (gb == 4) weighted_block<NC, 4>(t, wg, head_off, j0, j1, inv + g, og, first, last, moves);
  }
}

#endif

#ifdef CBSERVE_AVX2
// transpose16 for 8 lanes: out[l], lane i: in[i]'s lane l.
inline void transpose8(const __m256* in, __m256* out) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(in[2 * i], in[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(in[2 * i], in[2 * i + 1]);
  }
  // u[4a + e], 128-bit half b: lane e + 4b of vectors 4a .. 4a + 3.
  for (int a = 0; a < 2; ++a) {
    u[4 * a] = _mm256_shuffle_ps(t[4 * a], t[4 * a + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * a + 1] = _mm256_shuffle_ps(t[4 * a], t[4 * a + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * a + 2] = _mm256_shuffle_ps(t[4 * a + 1], t[4 * a + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * a + 3] = _mm256_shuffle_ps(t[4 * a + 1], t[4 * a + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int e = 0; e < 4; ++e) {
    out[e] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x20);
    out[4 + e] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x31);
  }
}

// Dim b of the kPerWord<T> dims that the 32-bit words of `w` hold, as float32 (int8: unscaled).
template <class T>
inline __m256 word_dim8(__m256i w, int b) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, f16>) return _mm256_castsi256_ps(w);
  else if constexpr (std::is_same_v<T, bf16>)
    return _mm256_castsi256_ps(b == 0 ? _mm256_slli_epi32(w, 16) : _mm256_and_si256(w, _mm256_set1_epi32(-65536)));
  else return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(w, 24 - 8 * b), 24));
}

// Head h's row of key a of the task's stream, its K rows then its V rows (past the last key, the V
// pass's first rows, which the K pass prefetches), for the AVX2 loops' prefetches; past both, `other`.
template <class T>
inline const char* stream_row(const Task<T>& t, int64_t a, int64_t h, const T* other) {
  const T* row = a < t.n ? t.k + t.slot[a] * t.stride : a < 2 * t.n ? t.v + t.slot[a - t.n] * t.stride : nullptr;
  return reinterpret_cast<const char*>(row == nullptr ? other : row + h * t.hd);
}

// The K rows of keys [j0, j0 + count) of head h, count <= kAvx2Block, transposed into kt
// [D][kAvx2Block] as float32 (int8: unscaled): dim d of key i at kt[d * kAvx2Block + i]. 8 words of 8
// rows at a time are loaded and transposed (24 shuffles), then widened (float16: widened as loaded).
// Keys past count repeat the last one. As it reads a line of a row it prefetches the same line of the
// row kAvx2Ahead keys on.
template <int NC, class T>  // NC = D / 8
inline void transpose_keys(const Task<T>& t, int64_t h, int64_t j0, int64_t count, float* kt) {
  constexpr int64_t kWords = 8 * NC / kPerWord<T>;
  static_assert(kWords % 8 == 0, "AVX2's head sizes are 32 .. 128 by 32: whole words of 8");
  for (int64_t i0 = 0; i0 < count; i0 += 8) {
    const T* kr[8];
    const char* ahead[8];
    for (int64_t i = 0; i < 8; ++i) {
      kr[i] = t.k + t.slot[j0 + std::min<int64_t>(i0 + i, count - 1)] * t.stride + h * t.hd;
      ahead[i] = stream_row(t, j0 + i0 + i + kAvx2Ahead, h, kr[i]);
    }
#pragma GCC unroll 1
    for (int64_t w0 = 0; w0 < kWords; w0 += 8) {
      __m256 rows[8], cols[8];
      if (w0 * kWordBytes<T> % 64 == 0)  // a line
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) __builtin_prefetch(ahead[i] + kWordBytes<T> * w0, 0, 3);
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i)
        if constexpr (std::is_same_v<T, f16>) rows[i] = load8(kr[i] + w0);
        else rows[i] = _mm256_loadu_ps(reinterpret_cast<const float*>(kr[i] + w0 * kPerWord<T>));
      transpose8(rows, cols);
#pragma GCC unroll 8
      for (int l = 0; l < 8; ++l)
#pragma GCC unroll 4
        for (int b = 0; b < kPerWord<T>; ++b)
          _mm256_store_ps(kt + ((w0 + l) * kPerWord<T> + b) * kAvx2Block + i0,
                          word_dim8<T>(_mm256_castps_si256(cols[l]), b));
    }
  }
}

// The dots of GB queries (rows r0 .. r0 + GB of qs, D apart) with the NV x 8 keys of kt (transpose_keys),
// in paged_prefill's order: one FMA chain over the dims in order, from zero. The NV x GB chains are
// independent: with one vector of keys a dot's chain waits on the FMA's latency at every dim.
template <int NC, int GB, int NV>
inline void keys_dots8(const float* qs, int64_t r0, const float* kt, int64_t count, float* scores, int64_t n) {
  constexpr int64_t D = 8 * NC;
  const float* q = qs + r0 * D;
  __m256 acc[GB][NV];
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[g][v] = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int64_t d = 0; d < D; ++d) {
    __m256 k[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) k[v] = _mm256_load_ps(kt + d * kAvx2Block + 8 * v);
#pragma GCC unroll 4
    for (int g = 0; g < GB; ++g) {
      const __m256 qd = _mm256_broadcast_ss(q + g * D + d);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[g][v] = _mm256_fmadd_ps(qd, k[v], acc[g][v]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g) {
    float* dst = scores + (r0 + g) * n;
    if (count == 8 * NV) {
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) _mm256_storeu_ps(dst + 8 * v, acc[g][v]);
    } else {
      alignas(32) float row[8 * NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) _mm256_store_ps(row + 8 * v, acc[g][v]);
      for (int64_t i = 0; i < count; ++i) dst[i] = row[i];
    }
  }
}

// keys_dots8 for NV vectors of keys (NV - 1) and GB query rows (GB - 1).
using KeysDots = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t);
template <int NC, int NV, size_t... G>
constexpr std::array<KeysDots, sizeof...(G)> keys_dots_of_rows(std::index_sequence<G...>) {
  return {keys_dots8<NC, static_cast<int>(G) + 1, NV>...};
}
template <int NC>
constexpr std::array<std::array<KeysDots, 4>, 3> kKeysDots = {keys_dots_of_rows<NC, 1>(std::make_index_sequence<4>()),
                                                              keys_dots_of_rows<NC, 2>(std::make_index_sequence<4>()),
                                                              keys_dots_of_rows<NC, 3>(std::make_index_sequence<4>())};

// head_dots for AVX2: the block's K rows transposed once, then the head's query rows a few at a time:
// three over three vectors of keys (nine chains, and the keys in three of the 16 registers), else four.
template <int NC, class T>  // D / 8
inline void head_dots_avx2(const Task<T>& t, const float* qs, int64_t h, int64_t j0, int64_t count, float* scores) {
  alignas(32) float kt[8 * NC * kAvx2Block];
  transpose_keys<NC>(t, h, j0, count, kt);
  float* dst = scores + j0;
  const int64_t vectors = (count + 7) / 8, most = vectors == 3 ? 3 : 4;
  for (int64_t r0 = h * t.G; r0 < (h + 1) * t.G; r0 += most) {
    const int64_t rows = std::min(most, (h + 1) * t.G - r0);
    kKeysDots<NC>[vectors - 1][rows - 1](qs, r0, kt, count, dst, t.n);
  }
}

// out[g] (+)= sum over keys j in [j0, j1) of w[g][j] * V[j], on one 32-float slice of a head (`v` at
// the slice in key row 0: key j's slice is v + slot[j] * stride), for GB query heads of a decode row:
// 4 x GB accumulators in registers, each V vector loaded once per head from L1; `first` starts from
// zero, `last` scales by inv[g]. Each key's slice prefetches the slice kAvx2Ahead keys on (of n).
// (Widening a bfloat16 V vector once per key for all GB heads instead took GB broadcasts' registers:
// float32 pools ran slower that way, and bfloat16 ones no faster.)
template <int GB, class T>
inline void weighted_slice(const T* v, int64_t stride, const int64_t* slot, const float* const* w, int64_t j0,
                           int64_t j1, int64_t n, const float* inv, float* const* out, bool first, bool last) {
  __m256 acc[GB][4];
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) acc[g][c] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out[g] + 8 * c);
  for (int64_t j = j0; j < j1; ++j) {
    const T* vr = v + slot[j] * stride;
    if (j + kAvx2Ahead < n) {
      const char* ahead = reinterpret_cast<const char*>(v + slot[j + kAvx2Ahead] * stride);
      for (int64_t b = 0; b < 32 * int64_t{sizeof(T)}; b += 64) __builtin_prefetch(ahead + b, 0, 3);
    }
#pragma GCC unroll 4
    for (int g = 0; g < GB; ++g) {
      const __m256 wg = _mm256_set1_ps(w[g][j]);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        acc[g][c] = _mm256_fmadd_ps(wg, load8(vr + 8 * c), acc[g][c]);
        settle(acc[g][c]);
      }
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g) {
    const __m256 s = _mm256_set1_ps(last ? inv[g] : 1.f);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(out[g] + 8 * c, _mm256_mul_ps(acc[g][c], s));
  }
}

// The query heads of one kv head over keys [j0, j1): weighted_slice over every 32-float slice of the
// head, up to three query heads a pass (head g's weights at w + g * n, its output at out + g * D).
template <class T>
inline void weighted_blocks_avx2(const Task<T>& t, const float* w, int64_t head_off, int64_t j0, int64_t j1,
                                 const float* inv, float* out, bool first, bool last) {
  for (int64_t g = 0; g < t.G; g += 3) {
    const int64_t gb = std::min<int64_t>(3, t.G - g);
    for (int64_t c0 = 0; c0 < t.D; c0 += 32) {
      const float* wr[3];
      float* orow[3];
      for (int64_t i = 0; i < gb; ++i) {
        wr[i] = w + (g + i) * t.n;
        orow[i] = out + (g + i) * t.D + c0;
      }
      const T* v = t.v + head_off + c0;
      if (gb == 3) weighted_slice<3>(v, t.stride, t.slot, wr, j0, j1, t.n, inv + g, orow, first, last);
      if (gb == 2) weighted_slice<2>(v, t.stride, t.slot, wr, j0, j1, t.n, inv + g, orow, first, last);
      if (gb == 1) weighted_slice<1>(v, t.stride, t.slot, wr, j0, j1, t.n, inv + g, orow, first, last);
    }
  }
}
#endif

// Portable fallbacks of the vector paths above, one key at a time. A dot's products are summed in 8
// lanes (GCC's vector type, whatever the target's width), then the lanes in one fixed tree: the order
// is written out, not left to the vectoriser, whose width follows the element type, so that a
// bfloat16 row is summed in the order of its float32 upcast.
using Lanes = float __attribute__((vector_size(32)));
constexpr int64_t kLanesGeneric = 8;

inline Lanes lanes(const float* p) {
  Lanes x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
inline Lanes lanes(const bf16* p) {
  using Raw = uint16_t __attribute__((vector_size(16)));
  using Bits = uint32_t __attribute__((vector_size(32)));
  Raw raw;
  std::memcpy(&raw, p, sizeof(raw));
  return std::bit_cast<Lanes>(__builtin_convertvector(raw, Bits) << 16);
}
inline Lanes lanes(const f16* p) {
  Lanes x;
  for (int64_t l = 0; l < kLanesGeneric; ++l) x[l] = widen(p[l]);
  return x;
}
inline Lanes lanes(const i8* p) {
  using Raw = int8_t __attribute__((vector_size(8)));
  Raw raw;
  std::memcpy(&raw, p, sizeof(raw));
  return __builtin_convertvector(raw, Lanes);
}

// e^x for x <= 0 on the portable lanes, as exp_avx2 computes it but with plain products and sums
// (no FMA here): x = n ln2 + r, Cephes's polynomial for e^r, times 2^n built in the exponent bits.
// glibc's vector exp is declared only under fast-math, which this file is built without (kernels.py),
// and expf a key at a time ran the portable decode slower.
inline Lanes exp_lanes(Lanes x) {
  using Bits = int32_t __attribute__((vector_size(32)));
  const Lanes lowest = Lanes{} - 87.3365478515625f;
  x = x < lowest ? lowest : x;
  x = x > 0.f ? Lanes{} : x;
  const float round = 12582912.f;  // 1.5 x 2^23: adding and subtracting it rounds to an integer
  const Lanes n = (x * 1.44269504088896341f + round) - round;
  Lanes r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  Lanes p = Lanes{} + 1.9875691500e-4f;
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = p * r + c;
  const Lanes e = p * (r * r) + (r + 1.f);
  const Bits two_n = (__builtin_convertvector(n, Bits) + 127) << 23;
  return e * std::bit_cast<Lanes>(two_n);
}

template <class T>
inline void dots_generic(const Task<T>& t, const float* q, int64_t head_off, int64_t j0, int64_t count, float* dst) {
  for (int64_t i = 0; i < count; ++i) {
    const T* kr = t.k + t.slot[j0 + i] * t.stride + head_off;
    Lanes sum = {};
    int64_t d = 0;
    for (; d + kLanesGeneric <= t.D; d += kLanesGeneric) sum += lanes(q + d) * lanes(kr + d);
    Lanes qt = {}, kt = {};  // the tail, zero-padded
    for (int64_t l = 0; d + l < t.D; ++l) qt[l] = q[d + l], kt[l] = widen(kr[d + l]);
    sum += qt * kt;
    dst[i] = (((sum[0] + sum[1]) + (sum[2] + sum[3])) + ((sum[4] + sum[5]) + (sum[6] + sum[7]))) * t.scale;
  }
}

template <class T>
inline void weighted_blocks_generic(const Task<T>& t, const float* w, int64_t head_off, int64_t j0, int64_t j1,
                                    const float* inv, float* out, bool first, bool last) {
  if (first) std::fill(out, out + t.G * t.D, 0.f);
  for (int64_t j = j0; j < j1; ++j) {
    const T* vr = t.v + t.slot[j] * t.stride + head_off;
    for (int64_t g = 0; g < t.G; ++g) {
      const float wj = w[g * t.n + j];
      float* o = out + g * t.D;
#pragma omp simd
      for (int64_t d = 0; d < t.D; ++d) o[d] += wj * widen(vr[d]);
    }
  }
  if (last)
    for (int64_t g = 0; g < t.G; ++g)
      for (int64_t d = 0; d < t.D; ++d) out[g * t.D + d] *= inv[g];
}

template <int NC, class T>
inline void head_weighted(const Task<T>& t, const float* w, int64_t head_off, int64_t j0, int64_t j1, const float* inv,
                          float* out, bool first, bool last) {
#ifdef CBSERVE_AVX2
  if constexpr (NC > 0) return weighted_blocks_avx2(t, w, head_off, j0, j1, inv, out, first, last);
#endif
  weighted_blocks_generic(t, w, head_off, j0, j1, inv, out, first, last);
}

// Softmax of one score row in place; returns 1 / its sum. On the vector paths the sum runs in the
// order paged_prefill reproduces: partial sum l of 16 (AVX2: 8) takes the row's keys l, l + 16, ..., in
// key order, then hsum16 (hsum8) adds the partial sums.
inline float softmax_(float* row, int64_t n, float cap) {
  soft_cap(row, n, cap);
#ifdef __AVX512F__
  // By hand: the compiler left this reduction scalar, one dependent vmaxss a key (a fifth of a
  // decode step's attention).
  __m512 mv = _mm512_set1_ps(-FLT_MAX);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(row + i));
  const __mmask16 tail = __mmask16((1u << (n - i)) - 1);
  if (i < n) mv = _mm512_mask_max_ps(mv, tail, mv, _mm512_maskz_loadu_ps(tail, row + i));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
  __m512 sum = _mm512_setzero_ps();
  for (i = 0; i + 16 <= n; i += 16) {
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(row + i), m));
    _mm512_storeu_ps(row + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (i < n) {
    const __m512 e = _mm512_maskz_mov_ps(tail, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + i), m)));
    _mm512_mask_storeu_ps(row + i, tail, e);
    sum = _mm512_add_ps(sum, e);
  }
  return 1.f / hsum16(sum);
#elif defined(CBSERVE_AVX2)
  __m256 mv = _mm256_set1_ps(-FLT_MAX);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(row + i));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  float mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  for (int64_t j = i; j < n; ++j) mx = std::max(mx, row[j]);
  const __m256 m = _mm256_set1_ps(mx);
  __m256 sum = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(row + i), m));
    _mm256_storeu_ps(row + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (i < n) {
    alignas(32) float tail[8] = {};
    std::copy(row + i, row + n, tail);
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_load_ps(tail), m));
    _mm256_store_ps(tail, e);
    for (int64_t j = n - i; j < 8; ++j) tail[j] = 0.f;
    std::copy(tail, tail + (n - i), row + i);
    sum = _mm256_add_ps(sum, _mm256_load_ps(tail));
  }
  return 1.f / hsum8(sum);
#else
  // Built with -ffinite-math-only (kernels.py): every value here stays finite, starting with this.
  float m = -FLT_MAX;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, row[j]);
  Lanes sum = {};
  int64_t i = 0;
  for (; i + kLanesGeneric <= n; i += kLanesGeneric) {
    const Lanes e = exp_lanes(lanes(row + i) - m);
    std::memcpy(row + i, &e, sizeof e);
    sum += e;
  }
  if (i < n) {
    Lanes x = {}, e = {};
    for (int64_t l = 0; i + l < n; ++l) x[l] = row[i + l];
    x = exp_lanes(x - m);
    for (int64_t l = 0; i + l < n; ++l) row[i + l] = e[l] = x[l];
    sum += e;
  }
  return 1.f / (((sum[0] + sum[1]) + (sum[2] + sum[3])) + ((sum[4] + sum[5]) + (sum[6] + sum[7])));
#endif
}

// The scores (or softmax weights) of keys [j0, j0 + count) times each key's K (or V) row scale, per
// head: for int8 pools, whose values were read unscaled.
// On AVX-512 16 keys' scales are gathered once into a vector and each of the head's G rows takes
// them in one multiply, where the scalar loop made a load, a multiply and a store per score. The same
// one product per score either way, so the scores keep their bits.
template <class T>
inline void scale_by_rows(const Task<T>& t, const T* pool, int64_t j0, int64_t count, float* scores) {
  for (int64_t h = 0; h < t.hs; ++h) {
    const T* head = pool + h * t.hd;
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i < count; i += 16) {
      const int64_t n = std::min<int64_t>(16, count - i);
      alignas(64) float s[16] = {};
      for (int64_t u = 0; u < n; ++u) s[u] = row_scale(head + t.slot[j0 + i + u] * t.stride, t.D);
      const __m512 sv = _mm512_load_ps(s);
      const __mmask16 keep = __mmask16((1u << n) - 1);
      for (int64_t g = 0; g < t.G; ++g) {
        float* row = scores + (h * t.G + g) * t.n + j0 + i;
        _mm512_mask_storeu_ps(row, keep, _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, row), sv));
      }
    }
#endif
    for (; i < count; ++i) {
      const float s = row_scale(head + t.slot[j0 + i] * t.stride, t.D);
      for (int64_t g = 0; g < t.G; ++g) scores[(h * t.G + g) * t.n + j0 + i] *= s;
    }
  }
}

// The dots of every (head, query) row of a task with keys [j0, j0 + count): on a vector path a head
// at a time, else row by row on the portable loops.
template <int NC, class T>
inline void block_dots(const Task<T>& t, float* qs, int64_t j0, int64_t count, float* scores, Pump<T>& pump) {
#ifdef __AVX512F__
  if constexpr (NC > 0) {
    for (int64_t h = 0; h < t.hs; ++h) head_dots<NC>(t, qs, h, j0, count, scores, pump);
    return;
  }
#endif
#ifdef CBSERVE_AVX2
  if constexpr (NC > 0) {
    for (int64_t h = 0; h < t.hs; ++h) head_dots_avx2<NC>(t, qs, h, j0, count, scores);
    return;
  }
#endif
  pump.advance(count * t.hs);
  (void)qs;
  for (int64_t r = 0; r < t.hs * t.G; ++r)
    dots_generic(t, t.q + r * t.D, (r / t.G) * t.hd, j0, count, scores + r * t.n + j0);
}

// Keys per block of run_task's dots.
template <int NC>
constexpr int64_t kDotsBlock =
#ifdef CBSERVE_AVX2
    NC > 0 ? kAvx2Block : kBlock;
#else
    kBlock;
#endif

// One task: the dots of every (head, query) row with each key, in key order, a block at a time; the
// softmax of each row; then the V sums in blocks of kVBlock keys. Both passes read each K or V row
// (all the task's heads, one contiguous read) front to back, once from memory: reading a whole context
// head by head instead strides through the rows several times, which from memory ran at a quarter
// of a core's streaming rate.
template <int NC, class T>  // D / 16 on the AVX-512 path, D / 8 on the AVX2 one; 0: the portable one
void run_task(const Task<T>& t, float* scores) {
  const int64_t rows = t.hs * t.G;
  // The queries times the scale, as paged_prefill scales them before its dots, after the scores.
  float* qs = scores + rows * t.n;
  if constexpr (NC > 0)
    for (int64_t i = 0; i < rows * t.D; ++i) qs[i] = t.q[i] * t.scale;
#ifdef CBSERVE_INT_DOTS
  if constexpr (kIntDots<T> && NC > 0) QueryWords(qs + rows * t.D, rows, t.D).fill(qs, rows, t.D);
#endif
  Pump<T> pump(t, kPumped<NC>);
  for (int64_t j0 = 0; j0 < t.n; j0 += kDotsBlock<NC>) {
    const int64_t count = std::min(kDotsBlock<NC>, t.n - j0);
    block_dots<NC>(t, qs, j0, count, scores, pump);
    if constexpr (kScaled<T>) scale_by_rows(t, t.k, j0, count, scores);
  }
  float inv[kMaxRows];
  for (int64_t r = 0; r < rows; ++r) inv[r] = softmax_(scores + r * t.n, t.n, t.cap);
  for (int64_t j0 = 0; j0 < t.n; j0 += kVBlock) {
    const int64_t j1 = std::min(t.n, j0 + kVBlock);
    if constexpr (kScaled<T>) scale_by_rows(t, t.v, j0, j1 - j0, scores);
#ifdef __AVX512F__
    if constexpr (NC > 0) {
      for (int64_t h = 0; h < t.hs; ++h) {
        const int64_t r = h * t.G;
        weighted_blocks<NC>(t, scores + r * t.n, h * t.hd, j0, j1, inv + r, t.out + r * t.D, j0 == 0, j1 == t.n, pump);
      }
      continue;
    }
#endif
    if constexpr (kPumped<NC>) pump.advance((j1 - j0) * t.hs);
    for (int64_t h = 0; h < t.hs; ++h) {
      const int64_t r = h * t.G;
      head_weighted<NC>(t, scores + r * t.n, h * t.hd, j0, j1, inv + r, t.out + r * t.D, j0 == 0, j1 == t.n);
    }
  }
}

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

template <class T>
using TaskFn = void (*)(const Task<T>&, float*);

template <class T>
TaskFn<T> pick(int64_t D) {
#ifdef __AVX512F__
  return by_head_size<TaskFn<T>>(D, run_task<0, T>, []<int NC>() -> TaskFn<T> { return run_task<NC, T>; });
#elif defined(CBSERVE_AVX2)
  switch (D) {
    case 32: return run_task<4, T>;
    case 64: return run_task<8, T>;
    case 96: return run_task<12, T>;
    case 128: return run_task<16, T>;
    default: return run_task<0, T>;
  }
#else
  (void)D;
  return run_task<0, T>;
#endif
}

// The pools' element type, checked: both float32, both bfloat16, both float16 or both int8,
// `[S, kv_heads, row]` with rows of D values (and, in int8, their scale). Anything else is refused.
at::ScalarType pool_type(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t D) {
  const at::ScalarType k = k_cache.scalar_type(), v = v_cache.scalar_type();
  TORCH_CHECK(k == v && (k == at::kFloat || k == at::kBFloat16 || k == at::kHalf || k == at::kChar),
              "k_cache and v_cache must both be float32, both bfloat16, both float16 or both int8, got ", k,
              " and ", v);
  const int64_t row = D + (k == at::kChar ? kScaleElems<i8> : 0);
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == row,
              "k_cache and v_cache must be [slots, kv_heads, ", row, "] for head size ", D, " in ", k, ", got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  return k;
}

// `run.template operator()<T>()` for the pools' element type.
template <class Run>
void for_pool_type(at::ScalarType type, Run&& run) {
  if (type == at::kBFloat16) run.template operator()<bf16>();
  else if (type == at::kHalf) run.template operator()<f16>();
  else if (type == at::kChar) run.template operator()<i8>();
  else run.template operator()<float>();
}

// The pool's data, of the element type the kernel was picked for.
template <class T>
const T* pool_data(const at::Tensor& cache) {
  return static_cast<const T*>(cache.const_data_ptr());
}

// An int8 pool holds each K and V row rotated by H_B block by block (common/kv_int8.py,
// hadamard.h). The kernels read those rows as stored and rotate the queries instead, once before
// the dots, (H q).(H k) = q.k, and each output head back once at the end, sum p (H v) = H sum p v:
// D log B additions a head, where rotating the keys back would cost that for every key read. The
// decode kernel and the portable prefill go through these two helpers; the vector prefills rotate each
// query row as they lay it out and each output row as they store it, in the same steps (query_row,
// rotate_head), so a row still gets the same bits from either kernel. Passes of their own over the
// chunk's queries before the tasks (a copy) and over its outputs after them (each row back from
// memory) had made the int8 prefill slower than the bfloat16 one.

// q [T, H, D] (any token stride) as a new contiguous tensor with every head rotated and rounded.
at::Tensor rotated_queries(const at::Tensor& q) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  at::Tensor r = at::empty({T, H, D}, q.options());
  const float* src = q.data_ptr<float>();
  float* dst = r.data_ptr<float>();
  const int64_t sq = q.stride(0);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::copy(src + t * sq, src + t * sq + H * D, dst + t * H * D);
      for (int64_t h = 0; h < H; ++h) {
        hadamard::rotate(dst + (t * H + h) * D, D);
        round_query(dst + (t * H + h) * D, D);
      }
    }
  });
  return r;
}

// Rows `rows[0 .. n)` of out [T, H, D] rotated back, head by head, in place.
void rotate_out_rows(at::Tensor& out, const std::vector<int64_t>& rows) {
  const int64_t H = out.size(1), D = out.size(2), so = out.stride(0);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(rows.size()), 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t h = 0; h < H; ++h) hadamard::rotate(op + rows[i] * so + h * D, D);
  });
}
}  // namespace

void paged_decode(
    at::Tensor q,        // [T, H, D] float32: heads contiguous, any token stride
    at::Tensor out,      // [T, H, D]: rows[b] is written for each request, the others left alone
    at::Tensor rows,     // [B] int64: the packed row of each request's query token
    at::Tensor k_cache,  // [S, kv_heads, D] float32, bfloat16 or float16, or [S, kv_heads, D + 4] int8;
                         // contiguous
    at::Tensor v_cache,  // k_cache's dtype and shape
    at::Tensor slots,    // [B, L] int64: the first lengths[b] entries are the keys of request b
    at::Tensor lengths,  // [B] int64
    double scale,
    double softcap) {       // <= 0: none
  TORCH_CHECK(q.dtype() == at::kFloat && out.dtype() == at::kFloat, "q and out must be float32, got ",
              q.scalar_type(), " and ", out.scalar_type());
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) && out.sizes() == q.sizes() &&
              out.stride(2) == 1 && out.stride(1) == out.size(2), "q and out must be [T, H, D] with contiguous heads");
  const at::ScalarType kv_type = pool_type(k_cache, v_cache, q.size(2));
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && slots.is_contiguous() &&
              rows.is_contiguous() && lengths.is_contiguous(), "contiguous caches and index tensors only");
  const int64_t T = q.size(0), D = q.size(2), H = k_cache.size(1);
  TORCH_CHECK(q.size(1) % H == 0, q.size(1), " query heads do not share ", H, " kv heads");
  const int64_t G = q.size(1) / H, B = slots.size(0), L = slots.size(1);
  TORCH_CHECK(H * G <= kMaxRows, "at most ", kMaxRows, " query heads, got ", H * G);
  TORCH_CHECK(rows.numel() == B && lengths.numel() == B, "rows and lengths need ", B, " entries");
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= L && rp[b] >= 0 && rp[b] < T, "request ", b, " in row ", rp[b], " of ", T,
                " reads ", lp[b], " keys of ", L);
  const bool rotated = kv_type == at::kChar;
  const at::Tensor qk = rotated ? rotated_queries(q) : q;  // the queries the dots read
  const int threads = at::get_num_threads();
  const int64_t hs = B >= 2 * threads ? H : 1;  // heads per task
  const int64_t parts = H / hs, tasks = B * parts;
  auto run = [&]<class T>() {
    const TaskFn<T> fn = pick<T>(D);
    const int64_t hd = D + kScaleElems<T>;
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      // + run_task's scaled queries and their integer words
      std::vector<float> scores(static_cast<size_t>(hs * G * (L + D) + QueryWords::floats(hs * G, D)));
      for (int64_t task = next++; task < tasks; task = next++) {
        const int64_t b = task / parts, h0 = (task % parts) * hs;
        const Task<T> t{
            qk.data_ptr<float>() + rp[b] * qk.stride(0) + h0 * G * D,
            out.data_ptr<float>() + rp[b] * out.stride(0) + h0 * G * D,
            pool_data<T>(k_cache) + h0 * hd,
            pool_data<T>(v_cache) + h0 * hd,
            slots.data_ptr<int64_t>() + b * L,
            lp[b], hs, G, D, hd, H * hd,
            static_cast<float>(scale), static_cast<float>(softcap)};
        fn(t, scores.data());
      }
    });
  };
  for_pool_type(kv_type, run);
  if (rotated) rotate_out_rows(out, std::vector<int64_t>(rp, rp + B));
}

// ------------------------------------------------------------------------------------------ prefill
//
// A prefill chunk's attention is compute-bound: per layer a 512-token prompt costs 0.3 GFLOP
// causally, and gather + SDPA with a folded mask computed twice that (the masked half too) after
// copying the context and building the mask. Here a task is one request, one kv head and a block of
// 16 query tokens: its G x 16 query rows (the kv head's query heads) are laid across the lanes of
// AVX-512 vectors (transposed once), so each key's dot with 16 rows is 64 broadcast-FMAs with no
// horizontal sums; the scores of the block (keys x rows, in L2) get a masked softmax (each row's own
// causal range), and the values are summed into up to six rows at a time from one load of each V row.
// Every sum keeps the decode kernel's order ("One row, one result" at the top). Blocks of the longest
// requests go first; threads take them from a shared counter.
namespace {
constexpr int64_t kQueryBlock = 16;  // query tokens per task
constexpr int64_t kLanes = 16;
constexpr int64_t kKeys = 8;         // keys per score block: 8 x GR accumulators (of 32 registers)

template <class T>  // the pool's element type: float, bf16, f16 or i8
struct PrefillTask {
  const float* q;        // the block's first query token at its kv head's first query head
  int64_t sq;            // q's token stride (heads are D apart)
  float* out;            // same layout as q, token stride so
  int64_t so;
  const T* k;            // this kv head in slot 0: slot s is k + s * stride
  const T* v;
  const int64_t* slot;   // the request's slot list
  int64_t nq, G, D, stride;  // stride: elements from one key's row to the next
  int64_t j0, nk;        // the block reads slot list entries [j0, j0 + nk)
  const int64_t* jlo;    // query i of the block sees entries [jlo[i], jhi[i]]
  const int64_t* jhi;
  float scale, cap;
};

// The task's rows r = i * G + g (query token i, query head g of the kv head), padded to Rp rows (whole
// vectors): each row's range [lo, hi] within the block's keys. Padding rows (zero queries, finite
// scores) take all keys and are never stored.
template <class T>
inline void prefill_ranges(const PrefillTask<T>& t, int64_t Rp, int32_t* lo, int32_t* hi) {
  const int64_t R = t.nq * t.G;
  for (int64_t r = 0; r < Rp; ++r) {
    lo[r] = r < R ? static_cast<int32_t>(t.jlo[r / t.G] - t.j0) : 0;
    hi[r] = r < R ? static_cast<int32_t>(t.jhi[r / t.G] - t.j0) : static_cast<int32_t>(t.nk - 1);
  }
}

// Query row r of the task, as the dots read it: where the pool is int8, copied into `buf`, rotated and
// rounded there by rotated_queries' own steps, so that the prefill reads the bits the decode kernel
// reads, with no pass over the whole chunk's queries before the tasks (and no copy of them).
template <class T>
inline const float* query_row(const PrefillTask<T>& t, int64_t r, float* buf) {
  const float* src = t.q + (r / t.G) * t.sq + (r % t.G) * t.D;
  if constexpr (!kScaled<T>) return src;
  std::copy(src, src + t.D, buf);
  hadamard::rotate(buf, t.D);
  round_query(buf, t.D);
  return buf;
}

// The rows' queries as qt [D, Rp], scaled (padding rows zero). `buf` holds D floats.
template <class T>
inline void prefill_queries(const PrefillTask<T>& t, int64_t Rp, float* qt, float* buf) {
  const int64_t R = t.nq * t.G;
  for (int64_t r = 0; r < Rp; ++r) {
    const float* src = r < R ? query_row(t, r, buf) : nullptr;
    for (int64_t d = 0; d < t.D; ++d) qt[d * Rp + r] = r < R ? src[d] * t.scale : 0.f;
  }
}

// Rows [j, j + keys) of a block's scores (or softmax weights) times each key's K (or V) row scale: for
// int8 pools, whose values were read unscaled.
template <class T>
inline void scale_keys(const PrefillTask<T>& t, const T* pool, int64_t j, int64_t keys, float* st, int64_t Rp) {
  for (int64_t u = j; u < j + keys; ++u) {
    const float s = row_scale(pool + t.slot[t.j0 + u] * t.stride, t.D);
    float* row = st + u * Rp;
#pragma omp simd
    for (int64_t r = 0; r < Rp; ++r) row[r] *= s;
  }
}

#ifdef __AVX512F__
// Scores of GR x 16 rows (lanes) against kKeys keys: st[u * Rp + g * 16 + lane]; where the pool is
// int8, each key's times its K row scale ks[u] as it is stored (ks null otherwise): the one product
// that a pass over the stored scores (scale_keys) would make, without that pass's loads and stores.
template <int NC, int GR>
inline void prefill_scores(const float* qt, int64_t Rp, const float* const* kr, float* st, int64_t keys,
                           const float* ks) {
  __m512 acc[kKeys][GR];
  for (int u = 0; u < kKeys; ++u)
    for (int g = 0; g < GR; ++g) acc[u][g] = _mm512_setzero_ps();
  for (int64_t d = 0; d < NC * 16; ++d) {
    __m512 qv[GR];
    for (int g = 0; g < GR; ++g) qv[g] = _mm512_loadu_ps(qt + d * Rp + g * kLanes);
    for (int u = 0; u < kKeys; ++u) {
      const __m512 kv = _mm512_set1_ps(kr[u][d]);
      for (int g = 0; g < GR; ++g) acc[u][g] = _mm512_fmadd_ps(qv[g], kv, acc[u][g]);
    }
  }
  for (int64_t u = 0; u < keys; ++u) {
    const __m512 s = _mm512_set1_ps(ks != nullptr ? ks[u] : 1.f);
    for (int g = 0; g < GR; ++g)
      _mm512_storeu_ps(st + u * Rp + g * kLanes, ks != nullptr ? _mm512_mul_ps(acc[u][g], s) : acc[u][g]);
  }
}

#ifdef CBSERVE_INT_DOTS
// Keys per pass of prefill_scores_int: 4 x GR int32 sums. With 8 x 3, as the float scores take, GCC
// kept the sums on the stack (loaded and stored around every vpdpwssd) where it keeps float ones in
// registers.
constexpr int kIntKeys = 4;
static_assert(kKeys % kIntKeys == 0);

// prefill_scores for the integer dots: the rows' int16 values as pairs of dims per lane (qp [D / 2, Rp]),
// each key's as a broadcast pair (kp[u] [D / 2]), two products a lane per vpdpwssd into exact int32
// sums; a score is float(dot) * its row's scale (sq [Rp]), then * the key's scale ks[u].
template <int NC, int GR>
inline void prefill_scores_int(const int32_t* qp, const float* sq, int64_t Rp, const int32_t* const* kp, float* st,
                               int64_t keys, const float* ks) {
  for (int u0 = 0; u0 < keys; u0 += kIntKeys) {
    __m512i acc[kIntKeys][GR];
    for (int u = 0; u < kIntKeys; ++u)
      for (int g = 0; g < GR; ++g) acc[u][g] = _mm512_setzero_si512();
    for (int64_t p = 0; p < NC * 8; ++p) {
      __m512i qv[GR];
      for (int g = 0; g < GR; ++g) qv[g] = _mm512_loadu_si512(qp + p * Rp + g * kLanes);
      for (int u = 0; u < kIntKeys; ++u) {
        const __m512i kv = _mm512_set1_epi32(kp[u0 + u][p]);
        for (int g = 0; g < GR; ++g) acc[u][g] = _mm512_dpwssd_epi32(acc[u][g], qv[g], kv);
      }
    }
    for (int64_t u = 0; u < std::min<int64_t>(kIntKeys, keys - u0); ++u) {
      const __m512 s = _mm512_set1_ps(ks[u0 + u]);
      for (int g = 0; g < GR; ++g) {
        const __m512 score = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[u][g]), _mm512_loadu_ps(sq + g * kLanes));
        _mm512_storeu_ps(st + (u0 + u) * Rp + g * kLanes, _mm512_mul_ps(score, s));
      }
    }
  }
}

// An int8 K row's D values as int16 pairs, the operand layout of vpdpwssd (dims 2p, 2p + 1 in lane p).
template <int NC>
inline void key_pairs(const i8* row, int32_t* out) {
  int c = 0;
  for (; c + 2 <= NC; c += 2)
    _mm512_storeu_si512(out + 8 * c, _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * c))));
  if (c < NC)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8 * c),
                        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c))));
}
#endif

// hadamard::rotate's steps on a head of NC vectors held in registers (D = 16 NC: blocks of 64 where
// 4 divides NC, else of 16), so that a query or an output row is rotated where it is loaded or made,
// with no pass through memory (a row stored and read back at once waited on the store).
template <int NC>
inline void rotate_head(__m512* v) {
  if constexpr (NC % 4 == 0) {
    const __m512 norm = _mm512_set1_ps(0.125f);
    for (int i = 0; i < NC; i += 4) {
      for (int c = 0; c < 4; ++c) v[i + c] = hadamard::rotate16(v[i + c]);
      hadamard::pair(v[i], v[i + 1]);  // h = 16
      hadamard::pair(v[i + 2], v[i + 3]);
      hadamard::pair(v[i], v[i + 2]);  // h = 32
      hadamard::pair(v[i + 1], v[i + 3]);
      for (int c = 0; c < 4; ++c) v[i + c] = _mm512_mul_ps(v[i + c], norm);
    }
  } else {
    for (int c = 0; c < NC; ++c) v[c] = _mm512_mul_ps(hadamard::rotate16(v[c]), _mm512_set1_ps(0.25f));
  }
}

// prefill_queries by vectors: 16 rows' 16 dims at a time, scaled and transposed in registers (the
// same products per element; one float at a time, this took about a tenth of the kernel). An int8
// pool's rows are first rotated in registers and stored scaled, each once.
template <int NC, class T>
inline void prefill_queries16(const PrefillTask<T>& t, int64_t Rp, float* qt) {
  constexpr int64_t D = NC * 16;
  const int64_t R = t.nq * t.G;
  const __m512 scale = _mm512_set1_ps(t.scale);
  alignas(64) float rotated[kScaled<T> ? kLanes : 1][D];
  for (int64_t r0 = 0; r0 < Rp; r0 += kLanes) {
    const float* src[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) {
      const int64_t r = r0 + i;
      src[i] = r < R ? t.q + (r / t.G) * t.sq + (r % t.G) * D : nullptr;
      if constexpr (kScaled<T>) {
        if (src[i] == nullptr) continue;
        __m512 v[NC];
        for (int c = 0; c < NC; ++c) v[c] = _mm512_loadu_ps(src[i] + 16 * c);
        rotate_head<NC>(v);
        round_query16<NC>(v);
        for (int c = 0; c < NC; ++c) _mm512_store_ps(rotated[i] + 16 * c, _mm512_mul_ps(v[c], scale));
        src[i] = rotated[i];
      }
    }
#ifdef CBSERVE_INT_DOTS
    if constexpr (kIntDots<T>) {
      // qt as the integer dots read it: int16 pairs [D / 2, Rp], then the rows' scales [Rp].
      int32_t* pairs = reinterpret_cast<int32_t*>(qt);
      float* scales = reinterpret_cast<float*>(pairs + D / 2 * Rp);
      // Each row's int16 values, as 32-bit pairs, padded to whole vectors of pairs; then 16 rows' pairs
      // transposed in registers, as the float queries are.
      constexpr int64_t kPairVectors = (NC + 1) / 2;
      alignas(64) int16_t q[kLanes][32 * kPairVectors] = {};
      for (int64_t i = 0; i < kLanes; ++i) scales[r0 + i] = src[i] == nullptr ? 0.f : quantize_query(src[i], D, q[i]);
      for (int64_t c = 0; c < kPairVectors; ++c) {
        __m512 in[kLanes], words[kLanes];
        for (int64_t i = 0; i < kLanes; ++i) in[i] = _mm512_load_ps(reinterpret_cast<const float*>(q[i] + 32 * c));
        transpose16(in, words);
        for (int64_t l = 0; l < 16 && 16 * c + l < D / 2; ++l)
          _mm512_storeu_si512(pairs + (16 * c + l) * Rp + r0, _mm512_castps_si512(words[l]));
      }
      continue;
    }
#endif
    for (int c = 0; c < NC; ++c) {
      __m512 in[kLanes], dims[kLanes];
      for (int64_t i = 0; i < kLanes; ++i) {
        if (src[i] == nullptr) in[i] = _mm512_setzero_ps();
        else if constexpr (kScaled<T>) in[i] = _mm512_load_ps(src[i] + 16 * c);
        else in[i] = _mm512_mul_ps(_mm512_loadu_ps(src[i] + 16 * c), scale);
      }
      transpose16(in, dims);
      for (int l = 0; l < 16; ++l) _mm512_storeu_ps(qt + (16 * c + l) * Rp + r0, dims[l]);
    }
  }
}

// 1 / the softmax sum of each of a vector of rows, from the rows' 16 partial sums part[u] (lane r of
// part[u]: the e^(s - max) of the keys j = u mod 16 of the block, in key order, 0 where row r does
// not see j), in the decode kernel's order: its partial sum l of row r takes the row's own keys
// lo[r] + l, lo[r] + l + 16, .. (softmax_), which here is part[(l + lo[r]) mod 16] in lane r; then
// sum_tree16. `lo` is the rows' first keys (int32 lanes).
inline __m512 inverse_sums16(const __m512* part, __m512i lo) {
  alignas(64) float parts[16][kLanes];
  for (int u = 0; u < 16; ++u) _mm512_store_ps(parts[u], part[u]);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 p[16];
  for (int l = 0; l < 16; ++l) {
    const __m512i u = _mm512_and_si512(_mm512_add_epi32(lo, _mm512_set1_epi32(l)), _mm512_set1_epi32(15));
    p[l] = _mm512_i32gather_ps(_mm512_add_epi32(_mm512_slli_epi32(u, 4), lane), &parts[0][0], 4);
  }
  return _mm512_div_ps(_mm512_set1_ps(1.f), sum_tree16(p));
}

// Rows per value block: ROWS x NC accumulators, at most 24 (29 of the 32 registers with the NC V
// vectors and a broadcast), so 6 rows of a 64-wide head. Each block reads the V rows of its keys once:
// 6 rows a block instead of 4 ran the prefill kernel 1.06-1.07x at 640-1024 keys, identical output.
constexpr int64_t values_rows(int NC) { return std::max(1, std::min(8, 24 / NC)); }

// The values of rows r0 .. r0 + ROWS: out = inv * sum over keys [a, b] of st[j][row] * V[j]. Rows
// that do not see key j weigh exactly 0 there.
template <int NC, int ROWS, class T>
void prefill_values(const PrefillTask<T>& t, const float* st, int64_t Rp, int64_t a, int64_t b, const float* inv,
                    int64_t r0) {
  constexpr int64_t D = NC * 16;
  __m512 acc[ROWS][NC];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = a; j <= b; ++j) {
    const T* vr = t.v + t.slot[t.j0 + j] * t.stride;
    __m512 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = load16(vr + 16 * c);
    const float* w = st + j * Rp;
    for (int r = 0; r < ROWS; ++r) {
      const __m512 wr = _mm512_set1_ps(w[r]);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_fmadd_ps(wr, vv[c], acc[r][c]);
    }
  }
  // Constant indices into acc: one runtime index kept it on the stack, stored every key.
  for (int r = 0; r < ROWS; ++r) {
    float* o = t.out + ((r0 + r) / t.G) * t.so + ((r0 + r) % t.G) * D;
    const __m512 s = _mm512_set1_ps(inv[r]);
    __m512 row[NC];  // a copy: rotate_head on acc[r] itself kept all of acc on the stack
    for (int c = 0; c < NC; ++c) row[c] = _mm512_mul_ps(acc[r][c], s);
    if constexpr (kScaled<T>) rotate_head<NC>(row);  // rotate_out_rows' steps, on the row as it is made
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + 16 * c, row[c]);
  }
}

template <class T>
using ValuesFn = void (*)(const PrefillTask<T>&, const float*, int64_t, int64_t, int64_t, const float*, int64_t);
template <int NC, class T, size_t... I>
constexpr std::array<ValuesFn<T>, sizeof...(I) + 1> values_table(std::index_sequence<I...>) {
  return {nullptr, prefill_values<NC, static_cast<int>(I) + 1, T>...};
}
// kValues<NC, T>[rows]: the value block of 1 .. values_rows(NC) rows.
template <int NC, class T>
constexpr auto kValues = values_table<NC, T>(std::make_index_sequence<values_rows(NC)>{});

// Rows r = i * G + g (query token i, query head g of the kv head), padded to Rp = whole vectors;
// qt is [D, Rp], st [nk, Rp]: both in L1/L2 for the task's life. The scores broadcast K one element
// at a time, so a block's K rows are read as float32 rows (f32_row); the values load V by vectors.
template <int NC, class T>
void run_prefill(const PrefillTask<T>& t, float* qt, float* st) {
  const int64_t R = t.nq * t.G, Rp = (R + kLanes - 1) / kLanes * kLanes;
  std::vector<int32_t> lo(Rp), hi(Rp);
  prefill_ranges(t, Rp, lo.data(), hi.data());
  prefill_queries16<NC>(t, Rp, qt);
  const int64_t vectors = Rp / kLanes;
  for (int64_t j = 0; j < t.nk; j += kKeys) {
    const int64_t keys = std::min(kKeys, t.nk - j);
    float ks[kKeys];
#ifdef CBSERVE_INT_DOTS
    if constexpr (kIntDots<T>) {
      alignas(64) int32_t pairs[kKeys][8 * NC];
      const int32_t* kp[kKeys];
      for (int64_t u = 0; u < kKeys; ++u) {
        const T* row = t.k + t.slot[t.j0 + j + std::min(u, keys - 1)] * t.stride;
        key_pairs<NC>(row, pairs[u]);
        kp[u] = pairs[u];
        ks[u] = row_scale(row, t.D);
      }
      const int32_t* qp = reinterpret_cast<const int32_t*>(qt);
      const float* sq = reinterpret_cast<const float*>(qp + 8 * NC * Rp);
      for (int64_t g0 = 0; g0 < vectors; g0 += 3) {
        const int32_t* qg = qp + g0 * kLanes;
        const float* sg = sq + g0 * kLanes;
        float* out = st + j * Rp + g0 * kLanes;
        switch (std::min<int64_t>(3, vectors - g0)) {
          case 3: prefill_scores_int<NC, 3>(qg, sg, Rp, kp, out, keys, ks); break;
          case 2: prefill_scores_int<NC, 2>(qg, sg, Rp, kp, out, keys, ks); break;
          default: prefill_scores_int<NC, 1>(qg, sg, Rp, kp, out, keys, ks); break;
        }
      }
      continue;
    }
#endif
    alignas(64) float widened[kKeys][16 * NC];
    const float* kr[kKeys];
    for (int64_t u = 0; u < kKeys; ++u) {
      const T* row = t.k + t.slot[t.j0 + j + std::min(u, keys - 1)] * t.stride;
      kr[u] = f32_row(row, widened[u], 16 * NC);
      if constexpr (kScaled<T>) ks[u] = row_scale(row, t.D);
    }
    const float* scales = kScaled<T> ? ks : nullptr;
    for (int64_t g0 = 0; g0 < vectors; g0 += 3) {
      const float* qg = qt + g0 * kLanes;
      float* sg = st + j * Rp + g0 * kLanes;
      switch (std::min<int64_t>(3, vectors - g0)) {
        case 3: prefill_scores<NC, 3>(qg, Rp, kr, sg, keys, scales); break;
        case 2: prefill_scores<NC, 2>(qg, Rp, kr, sg, keys, scales); break;
        default: prefill_scores<NC, 1>(qg, Rp, kr, sg, keys, scales); break;
      }
    }
  }
  soft_cap(st, t.nk * Rp, t.cap);
  std::vector<float> inv(Rp);
  // int8: each key's V row scale, folded into its softmax weights as they are stored (after their
  // sum takes them), the product scale_keys would make afterwards.
  std::vector<float> vs(kScaled<T> ? t.nk : 0);
  if constexpr (kScaled<T>)
    for (int64_t j = 0; j < t.nk; ++j) vs[j] = row_scale(t.v + t.slot[t.j0 + j] * t.stride, t.D);
  for (int64_t gv = 0; gv < vectors; ++gv) {
    const __m512i lv = _mm512_loadu_si512(lo.data() + gv * kLanes), hv = _mm512_loadu_si512(hi.data() + gv * kLanes);
    // Keys every lane of this vector sees: there the mask is all ones and costs nothing.
    const int64_t all_lo = *std::max_element(lo.begin() + gv * kLanes, lo.begin() + (gv + 1) * kLanes);
    const int64_t all_hi = *std::min_element(hi.begin() + gv * kLanes, hi.begin() + (gv + 1) * kLanes);
    auto seen = [&](int64_t j) -> __mmask16 {
      if (j >= all_lo && j <= all_hi) return 0xFFFF;
      const __m512i jv = _mm512_set1_epi32(static_cast<int32_t>(j));
      return _mm512_cmple_epi32_mask(lv, jv) & _mm512_cmple_epi32_mask(jv, hv);
    };
    float* col = st + gv * kLanes;
    __m512 mv = _mm512_set1_ps(-FLT_MAX);
    for (int64_t j = 0; j < t.nk; ++j) mv = _mm512_mask_max_ps(mv, seen(j), mv, _mm512_loadu_ps(col + j * Rp));
    __m512 part[16];
    for (int u = 0; u < 16; ++u) part[u] = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < t.nk; j0 += 16) {
#pragma GCC unroll 16
      for (int u = 0; u < 16; ++u) {
        const int64_t j = j0 + u;
        if (j >= t.nk) break;
        float* s = col + j * Rp;
        const __m512 ev = _mm512_maskz_mov_ps(seen(j), exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s), mv)));
        if constexpr (kScaled<T>) _mm512_storeu_ps(s, _mm512_mul_ps(ev, _mm512_set1_ps(vs[j])));
        else _mm512_storeu_ps(s, ev);
        part[u] = _mm512_add_ps(part[u], ev);
      }
    }
    _mm512_storeu_ps(inv.data() + gv * kLanes, inverse_sums16(part, lv));
  }
  constexpr int64_t kRows = values_rows(NC);
  for (int64_t r0 = 0; r0 < R; r0 += kRows) {
    const int64_t rows = std::min(kRows, R - r0);
    const int64_t a = *std::min_element(lo.begin() + r0, lo.begin() + r0 + rows);
    const int64_t b = *std::max_element(hi.begin() + r0, hi.begin() + r0 + rows);
    kValues<NC, T>[rows](t, st + r0, Rp, a, b, inv.data() + r0, r0);
  }
}
#endif

#ifdef CBSERVE_AVX2
// The AVX2 variant of the above with 16 registers: rows across the 8 lanes of a vector, both for
// the scores (2 vectors of rows against 6 keys at a time: 12 accumulators) and for the values (2
// vectors of rows against 6 dims of V).
constexpr int64_t kLanes8 = 8;
constexpr int64_t kKeys8 = 6;

// Scores of GR x 8 rows against kKeys8 keys: st[u * Rp + g * 8 + lane].
template <int NC, int GR>  // NC = D / 8
inline void prefill_scores_avx2(const float* qt, int64_t Rp, const float* const* kr, float* st, int64_t keys) {
  __m256 acc[kKeys8][GR];
#pragma GCC unroll 8
  for (int u = 0; u < kKeys8; ++u)
#pragma GCC unroll 2
    for (int g = 0; g < GR; ++g) acc[u][g] = _mm256_setzero_ps();
  for (int64_t d = 0; d < NC * 8; ++d) {
    __m256 qv[GR];
#pragma GCC unroll 2
    for (int g = 0; g < GR; ++g) qv[g] = _mm256_loadu_ps(qt + d * Rp + g * kLanes8);
#pragma GCC unroll 8
    for (int u = 0; u < kKeys8; ++u) {
      const __m256 kv = _mm256_broadcast_ss(kr[u] + d);
#pragma GCC unroll 2
      for (int g = 0; g < GR; ++g) acc[u][g] = _mm256_fmadd_ps(qv[g], kv, acc[u][g]);
    }
  }
#pragma GCC unroll 8
  for (int u = 0; u < kKeys8; ++u)
    if (u < keys)
#pragma GCC unroll 2
      for (int g = 0; g < GR; ++g) _mm256_storeu_ps(st + u * Rp + g * kLanes8, acc[u][g]);
}

// inverse_sums16 for AVX2's 8 partial sums: lane r's partial sum l is part[(l + lo[r]) mod 8].
inline __m256 inverse_sums8(const __m256* part, __m256i lo) {
  alignas(32) float parts[8][kLanes8];
  for (int u = 0; u < 8; ++u) _mm256_store_ps(parts[u], part[u]);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 p[8];
  for (int l = 0; l < 8; ++l) {
    const __m256i u = _mm256_and_si256(_mm256_add_epi32(lo, _mm256_set1_epi32(l)), _mm256_set1_epi32(7));
    p[l] = _mm256_i32gather_ps(&parts[0][0], _mm256_add_epi32(_mm256_slli_epi32(u, 3), lane), 4);
  }
  return _mm256_div_ps(_mm256_set1_ps(1.f), sum_tree8(p));
}

// The values of a block's rows, with rows across the lanes as in its scores: ot[d][r] = sum over keys
// j in [a, b] of st[j][r] * V[j][d], then out[r][d] = ot[d][r] * inv[r]. A pass takes 2 vectors of
// rows against 6 dims of V: 12 accumulators fed per key by 2 loads of scores and 6 broadcasts. The
// row-major way (3 rows x a 32-float slice of V, as the decode path's weighted_slice) has 12
// accumulators and the 4 V vectors left no register for a broadcast, so the compiler read V from
// memory for every FMA: 15 loads for 12 FMAs, and the values took 55% of the kernel against 30% for
// the scores, which are the same FLOPs. Keys go kVChunk at a time so that their V rows, their scores
// and ot stay in L1 across the passes (all keys in one pass ran 1.1-1.3x slower at 640-1152 keys).
constexpr int64_t kVChunk = 32;

// Dims d0 .. d0 + DB of GR vectors of rows, over keys vr[0 .. n).
template <int GR, int DB>
inline void values_pass_avx2(const float* const* vr, int64_t d0, const float* st, int64_t Rp, int64_t n,
                             float* ot) {
  __m256 acc[DB][GR];
#pragma GCC unroll 6
  for (int u = 0; u < DB; ++u)
#pragma GCC unroll 2
    for (int g = 0; g < GR; ++g) acc[u][g] = _mm256_loadu_ps(ot + (d0 + u) * Rp + g * kLanes8);
  for (int64_t j = 0; j < n; ++j) {
    __m256 sv[GR];
#pragma GCC unroll 2
    for (int g = 0; g < GR; ++g) sv[g] = _mm256_loadu_ps(st + j * Rp + g * kLanes8);
    const float* v = vr[j] + d0;
#pragma GCC unroll 6
    for (int u = 0; u < DB; ++u) {
      const __m256 vb = _mm256_broadcast_ss(v + u);
#pragma GCC unroll 2
      for (int g = 0; g < GR; ++g) acc[u][g] = _mm256_fmadd_ps(vb, sv[g], acc[u][g]);
    }
  }
#pragma GCC unroll 6
  for (int u = 0; u < DB; ++u)
#pragma GCC unroll 2
    for (int g = 0; g < GR; ++g) _mm256_storeu_ps(ot + (d0 + u) * Rp + g * kLanes8, acc[u][g]);
}

// Every dim of D (even: the AVX2 head sizes are 32..128 by 32), 6 at a time.
template <int GR>
inline void values_passes_avx2(const float* const* vr, int64_t D, const float* st, int64_t Rp, int64_t n, float* ot) {
  int64_t d0 = 0;
  for (; d0 + 6 <= D; d0 += 6) values_pass_avx2<GR, 6>(vr, d0, st, Rp, n, ot);
  for (; d0 + 2 <= D; d0 += 2) values_pass_avx2<GR, 2>(vr, d0, st, Rp, n, ot);
}

// ot is [D, Rp], zeroed here (the task's qt, free once its scores are done). The passes broadcast V
// one element at a time, so a chunk's V rows are read as float32 rows (f32_row).
template <int NC, class T>  // D / 8
void prefill_values_avx2(const PrefillTask<T>& t, const float* st, int64_t Rp, int64_t a, int64_t b,
                         const float* inv, float* ot) {
  constexpr int64_t D = NC * 8;
  const int64_t vectors = Rp / kLanes8, R = t.nq * t.G;
  std::fill(ot, ot + D * Rp, 0.f);
  alignas(32) float widened[kVChunk][D];
  const float* vr[kVChunk];
  for (int64_t j0 = a; j0 <= b; j0 += kVChunk) {
    const int64_t n = std::min(kVChunk, b + 1 - j0);
    for (int64_t j = 0; j < n; ++j) vr[j] = f32_row(t.v + t.slot[t.j0 + j0 + j] * t.stride, widened[j], D);
    const float* sc = st + j0 * Rp;
    for (int64_t g0 = 0; g0 < vectors; g0 += 2) {
      if (vectors - g0 >= 2) {
        values_passes_avx2<2>(vr, D, sc + g0 * kLanes8, Rp, n, ot + g0 * kLanes8);
      } else {
        values_passes_avx2<1>(vr, D, sc + g0 * kLanes8, Rp, n, ot + g0 * kLanes8);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    float* o = t.out + (r / t.G) * t.so + (r % t.G) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = ot[d * Rp + r] * inv[r];
    if constexpr (kScaled<T>) hadamard::rotate(o, D);  // rotate_out_rows' steps, while the row is in L1
  }
}

template <int NC, class T>  // D / 8
void run_prefill_avx2(const PrefillTask<T>& t, float* qt, float* st) {
  const int64_t R = t.nq * t.G, Rp = (R + kLanes8 - 1) / kLanes8 * kLanes8;
  std::vector<int32_t> lo(Rp), hi(Rp);
  prefill_ranges(t, Rp, lo.data(), hi.data());
  alignas(32) float rotated[8 * NC];
  prefill_queries(t, Rp, qt, rotated);
  const int64_t vectors = Rp / kLanes8;
  for (int64_t j = 0; j < t.nk; j += kKeys8) {
    const int64_t keys = std::min(kKeys8, t.nk - j);
    alignas(32) float widened[kKeys8][8 * NC];
    const float* kr[kKeys8];
    for (int64_t u = 0; u < kKeys8; ++u)
      kr[u] = f32_row(t.k + t.slot[t.j0 + j + std::min(u, keys - 1)] * t.stride, widened[u], 8 * NC);
    for (int64_t g0 = 0; g0 < vectors; g0 += 2) {
      const float* qg = qt + g0 * kLanes8;
      float* sg = st + j * Rp + g0 * kLanes8;
      if (vectors - g0 >= 2) {
        prefill_scores_avx2<NC, 2>(qg, Rp, kr, sg, keys);
      } else {
        prefill_scores_avx2<NC, 1>(qg, Rp, kr, sg, keys);
      }
    }
    if constexpr (kScaled<T>) scale_keys(t, t.k, j, keys, st, Rp);
  }
  soft_cap(st, t.nk * Rp, t.cap);
  std::vector<float> inv(Rp);
  const __m256i ones = _mm256_set1_epi32(-1);
  for (int64_t gv = 0; gv < vectors; ++gv) {
    const __m256i lv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo.data() + gv * kLanes8));
    const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi.data() + gv * kLanes8));
    const int64_t all_lo = *std::max_element(lo.begin() + gv * kLanes8, lo.begin() + (gv + 1) * kLanes8);
    const int64_t all_hi = *std::min_element(hi.begin() + gv * kLanes8, hi.begin() + (gv + 1) * kLanes8);
    auto seen = [&](int64_t j) -> __m256 {  // all ones in the lanes whose row sees key j
      if (j >= all_lo && j <= all_hi) return _mm256_castsi256_ps(ones);
      const __m256i jv = _mm256_set1_epi32(static_cast<int32_t>(j));
      const __m256i unseen = _mm256_or_si256(_mm256_cmpgt_epi32(lv, jv), _mm256_cmpgt_epi32(jv, hv));
      return _mm256_castsi256_ps(_mm256_xor_si256(unseen, ones));
    };
    float* col = st + gv * kLanes8;
    const __m256 lowest = _mm256_set1_ps(-FLT_MAX);
    __m256 mv = lowest;
    for (int64_t j = 0; j < t.nk; ++j)
      mv = _mm256_max_ps(mv, _mm256_blendv_ps(lowest, _mm256_loadu_ps(col + j * Rp), seen(j)));
    __m256 part[8];
    for (int u = 0; u < 8; ++u) part[u] = _mm256_setzero_ps();
    for (int64_t j0 = 0; j0 < t.nk; j0 += 8) {
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) {
        const int64_t j = j0 + u;
        if (j >= t.nk) break;
        float* s = col + j * Rp;
        const __m256 ev = _mm256_and_ps(seen(j), exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s), mv)));
        _mm256_storeu_ps(s, ev);
        part[u] = _mm256_add_ps(part[u], ev);
      }
    }
    _mm256_storeu_ps(inv.data() + gv * kLanes8, inverse_sums8(part, lv));
  }
  if constexpr (kScaled<T>) scale_keys(t, t.v, 0, t.nk, st, Rp);
  // Rows that do not see key j weigh exactly 0 there, so all rows share the span of their keys.
  prefill_values_avx2<NC>(t, st, Rp, *std::min_element(lo.begin(), lo.begin() + R),
                          *std::max_element(hi.begin(), hi.begin() + R), inv.data(), qt);
}
#endif

template <class T>
using PrefillFn = void (*)(const PrefillTask<T>&, float*, float*);

template <class T>
PrefillFn<T> pick_prefill(int64_t D) {
#ifdef __AVX512F__
  return by_head_size<PrefillFn<T>>(D, nullptr, []<int NC>() -> PrefillFn<T> { return run_prefill<NC, T>; });
#elif defined(CBSERVE_AVX2)
  switch (D) {
    case 32: return run_prefill_avx2<4, T>;
    case 64: return run_prefill_avx2<8, T>;
    case 96: return run_prefill_avx2<12, T>;
    case 128: return run_prefill_avx2<16, T>;
    default: return nullptr;
  }
#else
  (void)D;
  return nullptr;
#endif
}

// Whether this build has no vector path: there each query token of a chunk runs as a decode row over
// its own keys (the decode kernel's task, all kv heads at once), which is the decode kernel's result
// by construction, at any head size.
constexpr bool kPrefillByRows =
#if defined(__AVX512F__) || defined(CBSERVE_AVX2)
    false;
#else
    true;
#endif
}  // namespace

// Every element type has the same head sizes.
bool prefill_supports(int64_t head_dim) { return kPrefillByRows || pick_prefill<float>(head_dim) != nullptr; }

void paged_prefill(
    at::Tensor q,           // [T, H, D] float32: heads contiguous, any token stride
    at::Tensor out,         // [T, H, D]: the requests' rows are written, the others left alone
    at::Tensor k_cache,     // [S, kv_heads, D] float32, bfloat16 or float16, or [S, kv_heads, D + 4] int8;
                            // contiguous
    at::Tensor v_cache,     // k_cache's dtype and shape
    at::Tensor first_rows,  // [B] int64: packed row of each request's first query token
    at::Tensor num_queries, // [B]
    at::Tensor slots,       // [B, L]: the first lengths[b] are the keys request b's chunk reads
    at::Tensor lengths,     // [B]: its last query token sees them all, each earlier one fewer
    double scale,
    double softcap,            // <= 0: none
    int64_t window) {          // > 0: a query sees only its last `window` keys
  TORCH_CHECK(q.dtype() == at::kFloat && out.dtype() == at::kFloat, "q and out must be float32, got ",
              q.scalar_type(), " and ", out.scalar_type());
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) && out.sizes() == q.sizes() &&
              out.stride(2) == 1 && out.stride(1) == out.size(2), "q and out must be [T, H, D] with contiguous heads");
  const at::ScalarType kv_type = pool_type(k_cache, v_cache, q.size(2));
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && slots.is_contiguous() &&
              first_rows.is_contiguous() && num_queries.is_contiguous() && lengths.is_contiguous(),
              "contiguous caches and index tensors only");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KV = k_cache.size(1);
  TORCH_CHECK(prefill_supports(D), "no prefill kernel for head size ", D, " on this CPU");
  TORCH_CHECK(H % KV == 0, H, " query heads do not share ", KV, " kv heads");
  const int64_t G = H / KV, B = slots.size(0), L = slots.size(1);
  TORCH_CHECK(first_rows.numel() == B && num_queries.numel() == B && lengths.numel() == B,
              "first_rows, num_queries and lengths need ", B, " entries");
  const int64_t* fr = first_rows.data_ptr<int64_t>();
  const int64_t* nq = num_queries.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  struct Block { int64_t b, h, q0; };
  std::vector<Block> blocks;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(nq[b] >= 1 && nq[b] <= lp[b] && lp[b] <= L && fr[b] >= 0 && fr[b] + nq[b] <= T,
                "request ", b, ": ", nq[b], " queries from row ", fr[b], " over ", lp[b], " of ", L, " keys");
    for (int64_t q0 = (nq[b] - 1) / kQueryBlock * kQueryBlock; q0 >= 0; q0 -= kQueryBlock)
      for (int64_t h = 0; h < KV; ++h) blocks.push_back({b, h, q0});
  }
  const bool rotated = kv_type == at::kChar;
  if constexpr (kPrefillByRows) {
    const at::Tensor qk = rotated ? rotated_queries(q) : q;  // the queries the dots read
    TORCH_CHECK(H <= kMaxRows, "at most ", kMaxRows, " query heads, got ", H);
    int64_t tokens = 0;
    for (int64_t b = 0; b < B; ++b) tokens += nq[b];
    std::vector<std::pair<int64_t, int64_t>> rows;  // (request, query token), most keys first
    rows.reserve(static_cast<size_t>(tokens));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t x = nq[b] - 1; x >= 0; --x) rows.emplace_back(b, x);
    auto run = [&]<class T>() {
      const TaskFn<T> fn = pick<T>(D);
      const int64_t hd = D + kScaleElems<T>;
      std::atomic<int64_t> next{0};
      at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
        std::vector<float> scores(static_cast<size_t>(H * (L + D)));  // as paged_decode's
        for (int64_t i = next++; i < tokens; i = next++) {
          const auto [b, x] = rows[i];
          const int64_t jhi = lp[b] - nq[b] + x;
          const int64_t jlo = window > 0 ? std::max<int64_t>(0, jhi - window + 1) : 0;
          const int64_t row = fr[b] + x;
          const Task<T> t{qk.data_ptr<float>() + row * qk.stride(0), out.data_ptr<float>() + row * out.stride(0),
                          pool_data<T>(k_cache), pool_data<T>(v_cache), slots.data_ptr<int64_t>() + b * L + jlo,
                          jhi - jlo + 1, KV, G, D, hd, KV * hd,
                          static_cast<float>(scale), static_cast<float>(softcap)};
          fn(t, scores.data());
        }
      });
    };
    for_pool_type(kv_type, run);
    if (rotated) {
      std::vector<int64_t> written;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t x = 0; x < nq[b]; ++x) written.push_back(fr[b] + x);
      rotate_out_rows(out, written);
    }
    return;
  }
  std::stable_sort(blocks.begin(), blocks.end(), [&](const Block& x, const Block& y) {
    return lp[x.b] - nq[x.b] + x.q0 > lp[y.b] - nq[y.b] + y.q0;  // most keys first
  });
  const int64_t Rp = (kQueryBlock * G + kLanes - 1) / kLanes * kLanes;
  auto run = [&]<class T>() {
    const PrefillFn<T> fn = pick_prefill<T>(D);
    const int64_t hd = D + kScaleElems<T>;
    std::atomic<int64_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      std::vector<float> qt(static_cast<size_t>(D * Rp)), st(static_cast<size_t>(L * Rp));
      int64_t jlo[kQueryBlock], jhi[kQueryBlock];
      for (int64_t i = next++; i < static_cast<int64_t>(blocks.size()); i = next++) {
        const Block blk = blocks[i];
        const int64_t n = std::min(kQueryBlock, nq[blk.b] - blk.q0);
        for (int64_t x = 0; x < n; ++x) {
          jhi[x] = lp[blk.b] - nq[blk.b] + blk.q0 + x;
          jlo[x] = window > 0 ? std::max<int64_t>(0, jhi[x] - window + 1) : 0;
        }
        const int64_t row = fr[blk.b] + blk.q0;
        const PrefillTask<T> t{
            q.data_ptr<float>() + row * q.stride(0) + blk.h * G * D, q.stride(0),
            out.data_ptr<float>() + row * out.stride(0) + blk.h * G * D, out.stride(0),
            pool_data<T>(k_cache) + blk.h * hd, pool_data<T>(v_cache) + blk.h * hd,
            slots.data_ptr<int64_t>() + blk.b * L, n, G, D, KV * hd,
            jlo[0], jhi[n - 1] - jlo[0] + 1, jlo, jhi,
            static_cast<float>(scale), static_cast<float>(softcap)};
        fn(t, qt.data(), st.data());
      }
    });
  };
  for_pool_type(kv_type, run);
}

// The vector path this module was compiled for (the worker logs it; CBSERVE_CPU_ISA holds a build to
// a lower one).
std::string isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(CBSERVE_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL: the host plans the next step while a forward runs (async batching).
  using nogil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU; float32, bfloat16, float16 or int8 K/V)",
        nogil{});
  m.def("paged_prefill", &paged_prefill,
        "paged causal attention of prefill chunks (CPU, AVX-512 or AVX2; float32, 16-bit or int8 K/V)", nogil{});
  m.def("prefill_supports", &prefill_supports, "whether paged_prefill runs this head size here");
  m.def("isa", &isa, "the vector path this module was compiled for: avx512, avx2 or portable");
}
