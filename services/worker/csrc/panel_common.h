// What every path of the panel kernel (panel_linear.cpp) shares: the panels' layout as this build's
// vectors set it, a tile's description and its prefetches, and the scalar and packing helpers.
#pragma once

// Only the headers used: <torch/extension.h> (all of libtorch's C++ API) tripled the compile time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "hadamard.h"
#include "settle.h"
#include "vec_exp.h"

namespace {
// A panel's width and a tile's rows follow the vector registers: AVX-512 has 32 of 16 floats (2 x 14
// accumulators, the panel's two vectors and a broadcast), AVX2 16 of 8 (2 x 6, two, one: the 6 x 16
// of BLAS kernels for AVX2). The portable build keeps AVX-512's layout.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define CBSERVE_AVX2 1  // the 8-float variants (16 registers): panels of 16 columns
constexpr int64_t kPanel = 16;  // output columns per panel: one 64-byte line per k
constexpr int kMaxRows = 6;     // rows per tile: 2 x 6 accumulators
constexpr int kMaxRowsInt8 = 3;  // int8 tiles (x rounded): 2 x 3 int32 and 2 x 3 fp32 accumulators
#else
constexpr int64_t kPanel = 32;  // output columns per panel: two 64-byte lines per k
constexpr int kMaxRows = 14;    // rows per tile: 2 x 14 accumulators
constexpr int kMaxRowsInt8 = 7;  // int8 tiles (x rounded): 2 x 7 int32 and 2 x 7 fp32 accumulators
#endif
constexpr int64_t kHalf = kPanel / 2;  // a gated panel's outputs
constexpr int64_t kLinesPerK = kPanel * 4 / 64;
constexpr int64_t kAhead = 4096 / (kPanel * 4);  // k prefetched ahead (4 KiB): panels are read once, from memory

// x's packed lines per line of a bf16 panel: its pair of k as one 32-bit lane of two bf16 where the
// tile multiplies bf16 pairs, else the two k as fp32 (rounded to bf16) for the widened weights.
#ifdef __AVX512BF16__
constexpr int64_t kXLinesPerPair = 1;
#else
constexpr int64_t kXLinesPerPair = 2;
#endif

// x's packed lines per line of an int8 panel: four k as one lane of u8 (x + 128) where the tile
// multiplies with VNNI, else two lanes of int16 pairs, (x[4 k4], x[4 k4 + 2]) then (x[4 k4 + 1], x[4 k4 + 3]),
// for the sign-extended even and odd weights. The portable loops read the VNNI layout.
#if (defined(__AVX512F__) && defined(__AVX512VNNI__)) || (!defined(__AVX512F__) && defined(__AVXVNNI__)) || \
    !(defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)))
constexpr int64_t kXLinesPerQuad = 1;
#else
constexpr int64_t kXLinesPerQuad = 2;
#endif
// int8 panels: k per group, each group of a column on a scale of its own (whole lanes of four k). A
// build may set another (-DCBSERVE_INT8_GROUP=64) to measure it; the tests read it (int8_group()).
#ifndef CBSERVE_INT8_GROUP
#define CBSERVE_INT8_GROUP 32
#endif
constexpr int64_t kGroup = CBSERVE_INT8_GROUP;
static_assert(kGroup % 4 == 0 && kGroup > 0 && 127 * 127 * kGroup < (1 << 24), "whole lanes; sums exact in fp32");
static_assert((kGroup & (kGroup - 1)) == 0, "a whole group is rotated by a Walsh-Hadamard matrix: a power of 2");
constexpr int64_t kGroupLines = kGroup / 4;
constexpr int64_t kInt8Trailer = 2;  // an int8 group's lines after its weights: scales, then -128 * sums
inline int64_t int8_groups(int64_t K) { return (K + kGroup - 1) / kGroup; }

struct Tile {
  const float* x;  // the tile's rows, k-major: [K, rows] (bf16 panels: kXLinesPerPair lines per pair)
  const float* w;  // the panel, [K, kPanel] (bf16 panels: [K2, kPanel] lanes, each a pair of bf16)
  int64_t K;       // the panel's lines: K, or K2 for bf16 panels
  float* y;        // first row of the tile at the panel's first column
  int64_t sy;
  const float* bias;  // the panel's kPanel (zero-padded) bias values, or null
  int64_t cols;       // real outputs of this panel: kPanel (gated: kHalf) but in the last panel
  bool gated;         // columns [0, kHalf) are gate, [kHalf, kPanel) up: write silu(gate) * up
  const float* next;  // this tile's share of the next panel, pulled into L2; null after a thread's last
  int64_t next_lines;
  int64_t every;      // k per prefetched line: the tile count, so the tiles together fetch all K lines
  const float* xscale;  // int8 panels: the tile's rows' scales (sx), [groups, rows]; else null
};
// The tiles read t.K into a local before their loops over k: GCC loaded it through the reference at
// every k, one more load beside a k's broadcasts and FMAs.

// How much of its share of the next panel a tile pulls into L2 (panel_linear.cpp): every line, the
// first line of every other k, or none (its own panel's reads are then the only stream).
enum class NextPanel { kEvery, kSparse, kNone };

// The prefetches of one tile, issued once per k: its share of the next panel into L2 (panel_linear.cpp),
// and its own panel kAhead lines ahead into L1.
class PanelPrefetch {
 public:
  PanelPrefetch(const Tile& t, NextPanel next)
      : next_(t.next),
        end_(next == NextPanel::kNone ? t.next : t.next + t.next_lines * kPanel),
        every_(t.every),
        sparse_(next == NextPanel::kSparse) {}

  inline void at(int64_t k, const float* w) {
    if (wait_-- == 0 && next_ < end_) {
      wait_ = every_ - 1;
      if (!sparse_) {
        for (int64_t l = 0; l < kLinesPerK; ++l)
          __builtin_prefetch(next_ + 16 * l, 0, 2);  // to L2
      } else if ((k & 1) == 0) {
        __builtin_prefetch(next_, 0, 2);
      }
      next_ += kPanel;
    }
    for (int64_t l = 0; l < kLinesPerK; ++l)
      __builtin_prefetch(w + kAhead * kPanel + 16 * l, 0, 3);  // to L1
  }

 private:
  const float* next_;
  const float* const end_;
  const int64_t every_;
  const bool sparse_;
  int64_t wait_ = 0;  // a countdown, not k % every: a division per k costs as much as the FMAs
};

// silu(gate) * up = gate * sigmoid(gate) * up, the sigmoid from e = e^-|gate|, which never overflows
// (-ffast-math assumes no infinity): 1 / (1 + e) for gate >= 0, e / (1 + e) below.
inline float silu_times(float gate, float up) {
  const float e = std::exp(-std::fabs(gate));
  return gate * (gate < 0.f ? e : 1.f) / (1.f + e) * up;
}

// Columns [k0, K) of a tile's rows of x (row stride sx) -> out [K, rows], one float at a time: the
// portable pack, and the vector packs' last columns short of a whole block.
inline void copy_columns(const float* x, int64_t sx, int64_t rows, int64_t k0, int64_t K, float* out) {
  for (int64_t k = k0; k < K; ++k)
    for (int64_t r = 0; r < rows; ++r) out[k * rows + r] = x[r * sx + k];
}

// v rounded to bf16 to nearest even, as its 16 bits (torch's .to(bfloat16)); a NaN stays a quiet NaN.
inline uint32_t bf16_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

inline float bf16_round(float v) {
  const uint32_t u = bf16_bits(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// copy_columns for the widened bf16 tiles: the values rounded to bf16, and lines [K, lines) zero (an
// odd K's pad, multiplied into the zero weights that pair its last one).
inline void copy_columns_rounded(const float* x, int64_t sx, int64_t rows, int64_t k0, int64_t K, int64_t lines,
                                 float* out) {
  for (int64_t k = k0; k < lines; ++k)
    for (int64_t r = 0; r < rows; ++r) out[k * rows + r] = k < K ? bf16_round(x[r * sx + k]) : 0.f;
}

// p, but the compiler no longer knows that it is p: the widened bf16 tiles read a line twice (the low
// halves, then the high ones) and the second read must not be merged with the first, which would keep
// the line in two of the vector registers the accumulators need.
inline const float* opaque(const float* p) {
  __asm__("" : "+r"(p));
  return p;
}

// opaque(p) once per byte J of a lane: the weight-only int8 tiles read a line four times, and GCC
// merged four identical opaque() into one read, then kept the line on the stack.
template <int J>
inline const float* opaque_for(const float* p) {
  __asm__("" : "+r"(p) : "i"(J));
  return p;
}

// The 32-bit lane at p (a packed line of x holds lanes of u8 or int16 for the int8 tiles), as an int.
inline int32_t lane_at(const float* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

#ifdef __AVX512BF16__
// Pairs [k2_0, K2) of a tile's rows -> out [K2, rows], lanes of (bf16(x[2 k2]), bf16(x[2 k2 + 1])), the
// first in the low half as vdpbf16ps pairs them; an odd K's last value paired with a zero.
inline void copy_pairs(const float* x, int64_t sx, int64_t rows, int64_t k2_0, int64_t K, float* out) {
  for (int64_t k2 = k2_0; 2 * k2 < K; ++k2)
    for (int64_t r = 0; r < rows; ++r) {
      const float* v = x + r * sx + 2 * k2;
      const uint32_t lane = bf16_bits(v[0]) | (2 * k2 + 1 < K ? bf16_bits(v[1]) << 16 : 0u);
      std::memcpy(out + k2 * rows + r, &lane, sizeof lane);
    }
}
#endif

// x [K] -> q [K] rounded to int8 on x's own symmetric scale, returned: sx = max |x| / 127 and
// q = round(x * (127 / max |x|)) to nearest even (within [-127, 127] by construction); a row of zeros
// has scale 0. The weights' columns and the activations' rows both take this rounding.
inline float quantize_row(const float* x, int64_t K, int8_t* q) {
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  if (!(amax > 0.f)) {
    std::memset(q, 0, K);
    return 0.f;
  }
  const float inv = 127.f / amax;
  for (int64_t k = 0; k < K; ++k) q[k] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[k] * inv))));
  return amax * (1.f / 127.f);
}

// v [kGroup] -> H v in place, H the Walsh-Hadamard matrix of order kGroup over sqrt(kGroup): orthonormal
// and its own inverse. The butterflies of stage h = 1, 2, .., kGroup / 2 turn each pair (v[j], v[j + h])
// into (a + b, a - b); then one multiply by fp32(1 / sqrt(kGroup)). No step can be reordered or
// contracted, so torch's same operations give the same floats (what the tests compare against).
inline void rotate_group(float* v) {
  hadamard::butterflies(v, kGroup, kGroup);
  const float norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(kGroup)));
  for (int64_t j = 0; j < kGroup; ++j) v[j] *= norm;
}

#ifdef __AVX512F__
// rotate_group on a group of 32 held in two vectors, lane for lane the same operations (hadamard.h).
inline void rotate_pair(__m512& lo, __m512& hi) {
  lo = hadamard::rotate16(lo);
  hi = hadamard::rotate16(hi);
  hadamard::pair(lo, hi);  // stage 16
  const __m512 norm = _mm512_set1_ps(static_cast<float>(1.0 / std::sqrt(32.0)));
  lo = _mm512_mul_ps(lo, norm);
  hi = _mm512_mul_ps(hi, norm);
}

// quantize_row on a group of 32 held in two vectors: the same scale and roundings.
inline float quantize_pair(__m512 lo, __m512 hi, int8_t* q) {
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  if (!(amax > 0.f)) {
    std::memset(q, 0, 32);
    return 0.f;
  }
  // No clamp to [-127, 127] (quantize_row's): |v| <= amax, so |v * fl(127 / amax)| <= 127 (1 + 2^-24)^2,
  // which rounds to 127 at most.
  const __m512 inv = _mm512_set1_ps(127.f / amax);
  for (const auto& [v, out] : {std::pair{lo, q}, std::pair{hi, q + 16}}) {
    const __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));  // to nearest even
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(i));
  }
  return amax * (1.f / 127.f);
}
#endif

// x [K] -> out [K]: each whole group of kGroup k rotated (rotate_group), a shorter last group as it is.
inline void rotate_groups(const float* x, int64_t K, float* out) {
  int64_t k0 = 0;
#ifdef __AVX512F__
  if constexpr (kGroup == 32)
    for (; k0 + kGroup <= K; k0 += kGroup) {
      __m512 lo = _mm512_loadu_ps(x + k0), hi = _mm512_loadu_ps(x + k0 + 16);
      rotate_pair(lo, hi);
      _mm512_storeu_ps(out + k0, lo);
      _mm512_storeu_ps(out + k0 + 16, hi);
    }
#endif
  std::memcpy(out + k0, x + k0, (K - k0) * sizeof(float));
  for (; k0 + kGroup <= K; k0 += kGroup) rotate_group(out + k0);
}

// x [K] -> q [K], each group of kGroup k rotated (rotate_groups), then rounded on its own scale:
// scales[g]. A group's products are those of the rotated weights and inputs, (H w).(H x) = w.x.
inline void quantize_groups(const float* x, int64_t K, int8_t* q, float* scales) {
  int64_t k0 = 0, g = 0;
#ifdef __AVX512F__
  if constexpr (kGroup == 32)
    for (; k0 + kGroup <= K; k0 += kGroup, ++g) {
      __m512 lo = _mm512_loadu_ps(x + k0), hi = _mm512_loadu_ps(x + k0 + 16);
      rotate_pair(lo, hi);
      scales[g] = quantize_pair(lo, hi, q + k0);
    }
#endif
  std::array<float, kGroup> rotated;
  for (; k0 < K; k0 += kGroup, ++g) {
    const int64_t n = std::min(kGroup, K - k0);
    rotate_groups(x + k0, n, rotated.data());
    scales[g] = quantize_row(rotated.data(), n, q + k0);
  }
}

// One row of x quantized -> its packed lanes for the int8 tiles (kXLinesPerQuad per K4) and its
// groups' scales. `q` holds 4 K4 bytes of scratch; the pad k are x = 0 (u8 128), against zero weights.
inline void int8_lanes(const float* x, int64_t K, int8_t* q, uint32_t* lanes, float* scales) {
  const int64_t K4 = (K + 3) / 4;
  if constexpr (kXLinesPerQuad == 1) {
    // The VNNI lanes are x's bytes in order, each + 128 (its sign bit flipped): rounded in place, then
    // flipped in one pass the compiler vectorizes, not assembled lane by lane from their four bytes.
    uint8_t* bytes = reinterpret_cast<uint8_t*>(lanes);
    quantize_groups(x, K, reinterpret_cast<int8_t*>(bytes), scales);
    std::memset(bytes + K, 0, 4 * K4 - K);
    for (int64_t i = 0; i < 4 * K4; ++i) bytes[i] ^= 0x80u;
    return;
  }
  quantize_groups(x, K, q, scales);
  std::memset(q + K, 0, 4 * K4 - K);
  for (int64_t k4 = 0; k4 < K4; ++k4) {  // two int16 lanes: the even k, then the odd, each + 128
    const uint32_t u0 = uint8_t(q[4 * k4]) ^ 0x80u, u1 = uint8_t(q[4 * k4 + 1]) ^ 0x80u;
    const uint32_t u2 = uint8_t(q[4 * k4 + 2]) ^ 0x80u, u3 = uint8_t(q[4 * k4 + 3]) ^ 0x80u;
    lanes[2 * k4] = u0 | u2 << 16;
    lanes[2 * k4 + 1] = u1 | u3 << 16;
  }
}

// Lanes [k0, lines) of a tile's rows ([rows, lines], row after row) -> out [lines, rows].
inline void copy_lanes(const uint32_t* lanes, int64_t rows, int64_t k0, int64_t lines, float* out) {
  for (int64_t k = k0; k < lines; ++k)
    for (int64_t r = 0; r < rows; ++r) std::memcpy(out + k * rows + r, lanes + r * lines + k, sizeof(uint32_t));
}
}  // namespace
