// Linears y = x W^T (+ bias) on the CPU, float32, with W packed once into column panels.
//
// A decode step multiplies a few dozen rows by every weight of the model, so its linears are bounded
// by how fast the weights stream from memory, and a prefill chunk's by the FMA units. One simple
// layout serves both: W [N, K] is cut into panels of 32 output columns, each stored k-major
// ([K, 32], one contiguous 128-byte line per k), so a thread reads its panels front to back (the
// hardware prefetcher streams them) and multiplies each loaded line into up to 14 rows at once
// (28 accumulators, the panel's two vectors and a broadcast: 31 of the 32 vector registers; one load
// of W per 14 FMAs). Threads split the panels, so each weight is read once per product, by one core.
// A panel (72 KiB at K = 576) outgrows L1, so with more than one tile every tile after the first
// re-reads it from L2; the first tile would wait on memory while the others wait on nothing. So while
// a panel's tiles run, they pull the next panel into L2, a line every few k, spreading the weights'
// traffic evenly over the FMAs. A lone tile of 8-14 rows (a decode step of a dozen requests) pulls
// only the first line of every other k, one line in four, and leaves the rest to the hardware
// prefetchers; our guess at why that is faster, not measured: each software prefetch holds one of the
// core's few fill buffers until memory answers, and the tile's own L2-to-L1 reads queue behind them.
// With fewer rows, or more than one tile, pulling every line is faster (docs/performance-log.md).
//
// x is first copied tile by tile k-major ([K, rows]), so that a tile reads its 14 values of each k at
// constant offsets from one pointer: read in place, each row's address took an add of its own, 13
// dependent integer adds per k beside 28 FMAs. The copy is a transpose, done in register blocks of
// 16 x 16 (8 x 8 on AVX2): one float at a time, it took about as long as a panel's FMAs.
//
// Where torch's GEMM is faster at many rows (which depends on the CPU), gemm_crossover.py sends those
// there.
//
// On a CPU with AVX2 and FMA but no AVX-512 the same design runs on 16 vector registers of 8 floats:
// panels of 16 columns (one line per k) and tiles of up to 6 rows. There GCC kept the portable tile's
// accumulators in memory, and the intrinsics' accumulators too unless every loop over the rows is
// unrolled (it stored all 12 to the stack on every k), so those loops are unrolled. Blocking rows and
// k so that a block of x stays in L2 (Goto's order) was slower at 128-512 rows. A product of one to
// six rows (a decode step of a few requests) runs as one or two tiles of up to three rows on two to
// four panels at a time (tile_group), the two tiles in turns over each chunk of the panels' lines:
// one panel at a time, such a tile read its weights at well under the read rate.
//
// A gated product (the MLP's gate|up) interleaves the two weights by halves of a panel, gate columns
// then the same up columns, so that a tile ends with both halves of its outputs in registers and
// writes silu(gate) * up: the product's full width is never written to memory and read back.
//
// Each output is one sequential sum over k, which equals torch's GEMM up to fp32 summation order.
//
// bf16 weights (pack_weight_bf16) halve the bytes a decode step streams. Their panels keep the fp32
// layout's lines: per pair of k (2 k2, 2 k2 + 1) a line holds, for each of the kPanel columns, the two
// weights side by side in one 32-bit lane ([K2, kPanel, 2] per panel, K2 = ceil(K / 2), an odd K's
// last weight paired with a zero): the operand layout of AVX512-BF16's vdpbf16ps, and a line is as
// many bytes as an fp32 panel's, so the tiles, their prefetches and the split into tiles are the same
// code with K2 lines for K. Every path computes bf16(x) . bf16(W) with fp32 sums: x is rounded to bf16
// (to nearest even) as it is packed, so machines differ only in the order of the fp32 sums, as with
// fp32 weights. With AVX512-BF16 a tile multiplies x's bf16 pairs into the pairs of weights, two
// multiply-adds per lane per instruction; elsewhere it widens each lane into the two fp32 weights (by
// shifts) and runs fp32 FMAs on x's rounded values. The bf16 instructions read denormals as
// zero (below 2^-126, far under any weight or activation's scale). AVX2's panels arrange a line's
// same bytes otherwise: k = 2 k2, then 2 k2 + 1, 16 weights each, columns 0-7 in the low halves of the
// lanes and 8-15 in the high ones, so that a k's weights widen from one load by a shift and a mask.
// int8 panels (pack_weight_int8) hold a quarter of the bytes of fp32 ones, plus their scales. As in
// llama.cpp's Q8_0, each output column's weights are rounded to int8 in groups of kGroup consecutive
// k, each (column, group) on a symmetric scale of its own (sw = max |W| / 127 over the group), four
// k to a 32-bit lane, so that a line is again as many bytes as an fp32 panel's and the tiles,
// prefetches and split are the same code. A panel holds, group after group, the group's kGroup / 4
// lines of lanes (the last group's fewer where kGroup does not divide K, a K short of a multiple of 4
// padded with zeros), then a line of the columns' fp32 scales, then a line of -128 * the columns'
// weight sums over the group (int32, see below): K4 + 2 ceil(K / kGroup) lines of kPanel lanes, K4 =
// ceil(K / 4). Each row of x is rounded to int8 as it is packed, in the same groups, each (row, group)
// on a scale of its own (sx = max |x| / 127 over the group: dynamic, per token). A group's products
// are an exact int32 sum (at most 127^2 kGroup, exact in fp32 too), so every path gives the same
// sums; at the end of each group the tile adds float(sum) * sw * sx into fp32 accumulators, and only
// those fp32 steps (and the bias) round. One scale per column or row over all of K let one large
// weight or activation coarsen the rounding of all the others (docs/kernels.md gives the agreement
// with fp32 and the speed for groups of 32, 64 and 128 k against one scale per column). Within a group
// one large value still does, so each whole group of a weight column and of an x row is first
// rotated by the same orthonormal Walsh-Hadamard matrix H (QuaRot's idea: H spreads an outlier over
// the group, and (H w).(H x) = w.x): the rounding error of a group then follows its typical value, not
// its largest. The weights are rotated once as they are packed; x as it is packed, a few adds per value
// beside the group's products (a shorter last group is not rotated).
// With VNNI (AVX512-VNNI, or AVX-VNNI in an AVX2 build) vpdpbusd adds the four products of each lane
// into its int32 accumulator; it takes x unsigned, so x is packed as x + 128 (in 1 .. 255) and a
// group's sums start from its offsets, -128 * the column's weight sum over the group, computed at
// pack time (a copy per group, where subtracting them at the end would take an add). Without VNNI
// each lane is split into its even and odd k sign-extended to int16 (two shifts) and multiplied by
// vpmaddwd, two products per lane into int32, on x's values of those k as int16 pairs (two packed
// lines per K4 line): exact too, where vpmaddubsw's int16 sums of (x + 128) * w would saturate.
// A tile holds int32 and fp32 accumulators for both halves of the panel: 4 x 7 for 7 rows, the
// line's two vectors and a broadcast, 31 of the 32 registers (AVX2: 4 x 3, two, a broadcast and
// vpmaddwd's product, 16), so int8 tiles take up to 7 rows (3). Tiles of 14 rows that ran the two
// halves in turn (2 x 14 accumulators, x read twice) were no faster at 256 rows, slower at 1-16.
// The same panels also multiply x unrounded (`int8_x` false: weight-only int8; x rotated alike): each
// lane's four weights widened to fp32 in turn (a shift up and an arithmetic shift down, then a
// conversion), multiplied by their group's column scales (one multiply per widened vector, shared by
// all the tile's rows) and into x's fp32 values of their k by FMAs.
// Only the headers used: <torch/extension.h> (all of libtorch's C++ API) tripled the compile time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>
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

// The prefetches of one tile, issued once per k: its share of the next panel into L2 (see the top),
// and its own panel kAhead lines ahead into L1.
class PanelPrefetch {
 public:
  PanelPrefetch(const Tile& t, bool sparse)
      : next_(t.next), end_(t.next + t.next_lines * kPanel), every_(t.every), sparse_(sparse) {}

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

#ifdef __AVX512F__
inline __m512 silu_times(__m512 gate, __m512 up) {
  const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.f);
  const __m512 e = exp_ps(_mm512_min_ps(gate, _mm512_sub_ps(zero, gate)));
  const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(gate, zero, _CMP_LT_OQ), one, e);
  return _mm512_mul_ps(_mm512_div_ps(_mm512_mul_ps(gate, num), _mm512_add_ps(one, e)), up);
}

// How every tile ends, whatever its weights: lo[r] and hi[r] (a row's columns [0, 16) and [16, 32))
// plus the bias, or silu(lo) * hi for a gated panel, stored masked to the panel's real columns.
// Every loop over the rows is unrolled: otherwise GCC gives the accumulators a stack copy for the
// stores, zeroed by two calls to memset per tile (1.5% of a prefill's time).
template <int R>
__attribute__((always_inline)) inline void finish(const Tile& t, const __m512 (&lo)[R], const __m512 (&hi)[R]) {
  const __mmask16 m0 = t.cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << t.cols) - 1);
  if (t.gated) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(t.y + r * t.sy, m0, silu_times(lo[r], hi[r]));
    return;
  }
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (t.bias != nullptr) b0 = _mm512_loadu_ps(t.bias), b1 = _mm512_loadu_ps(t.bias + 16);
  const __mmask16 m1 = t.cols >= 32 ? __mmask16(0xFFFF) : t.cols <= 16 ? __mmask16(0) : __mmask16((1u << (t.cols - 16)) - 1);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(t.y + r * t.sy, m0, _mm512_add_ps(lo[r], b0));
    _mm512_mask_storeu_ps(t.y + r * t.sy + 16, m1, _mm512_add_ps(hi[r], b1));
  }
}

template <int R>
void tile(const Tile& t) {
  __m512 lo[R], hi[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  const float* w = t.w;
  PanelPrefetch pull(t, R >= 8 && t.every == 1);  // sparse: a lone tile of 8-14 rows, see the top
  const int64_t K = t.K;
  for (int64_t k = 0; k < K; ++k, w += kPanel) {
    pull.at(k, w);
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
    const float* xk = t.x + k * R;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(xk[r]);
      lo[r] = _mm512_fmadd_ps(xv, w0, lo[r]);
      hi[r] = _mm512_fmadd_ps(xv, w1, hi[r]);
    }
  }
  finish<R>(t, lo, hi);
}

#ifdef __AVX512BF16__
// bf16 panels: a line's lanes are pairs of weights, x's lanes pairs of its values (broadcast as
// 32 bits), and vdpbf16ps adds both products of each lane into its fp32 accumulator.
template <int R>
void tile_bf16(const Tile& t) {
  __m512 lo[R], hi[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  const float* w = t.w;
  PanelPrefetch pull(t, R >= 8 && t.every == 1);
  const int64_t K = t.K;
  for (int64_t k = 0; k < K; ++k, w += kPanel) {
    pull.at(k, w);
    const __m512bh w0 = (__m512bh)_mm512_loadu_ps(w), w1 = (__m512bh)_mm512_loadu_ps(w + 16);
    const float* xk = t.x + k * R;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_ps(xk[r]);
      lo[r] = _mm512_dpbf16_ps(lo[r], xv, w0);
      hi[r] = _mm512_dpbf16_ps(hi[r], xv, w1);
    }
  }
  finish<R>(t, lo, hi);
}
#else
// bf16 panels without AVX512-BF16: each lane widened into its two fp32 weights, w[2 k2] (the low half
// shifted up) then w[2 k2 + 1] (the high half, its low bits shifted out and back in as zeros: shifts
// need no mask register), multiplied into x's rounded values of that k. One pair of weight vectors
// lives at a time (the line is read once for each), so 2 x 14 accumulators, the pair and a broadcast
// fit in the 32 registers, as in the fp32 tile.
template <int R>
void tile_bf16(const Tile& t) {
  __m512 lo[R], hi[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  const float* w = t.w;
  PanelPrefetch pull(t, R >= 8 && t.every == 1);
  const int64_t K = t.K;
  for (int64_t k = 0; k < K; ++k, w += kPanel) {
    pull.at(k, w);
    const float* xk = t.x + 2 * k * R;
    const __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(w), 16));
    const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(w + 16), 16));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(xk[r]);
      lo[r] = _mm512_fmadd_ps(xv, e0, lo[r]);
      hi[r] = _mm512_fmadd_ps(xv, e1, hi[r]);
    }
    const float* again = opaque(w);
    const __m512 o0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_srli_epi32(_mm512_loadu_si512(again), 16), 16));
    const __m512 o1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_srli_epi32(_mm512_loadu_si512(again + 16), 16), 16));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(xk[R + r]);
      lo[r] = _mm512_fmadd_ps(xv, o0, lo[r]);
      hi[r] = _mm512_fmadd_ps(xv, o1, hi[r]);
    }
  }
  finish<R>(t, lo, hi);
}

// 16 floats rounded to bf16 to nearest even, kept as fp32 (bf16_bits on a vector).
inline __m512 round_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i tie = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(u, _mm512_add_epi32(tie, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  const __m512i r = _mm512_mask_mov_epi32(_mm512_and_si512(up, _mm512_set1_epi32(int(0xFFFF0000u))), nan,
                                          _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(r);
}
#endif

// Whole blocks of 16 lines of a tile's rows (rows <= 16) -> out [lines, rows], block(r, k0) giving
// row r's 32-bit values of lines k0 .. k0 + 15: each block transposed in registers (pairs of floats,
// then of pairs, then 128-bit lanes). Returns the first line left to pack.
template <class Block>
inline int64_t pack_blocks(int64_t rows, int64_t lines, float* out, Block block) {
  const __mmask16 m = __mmask16((1u << rows) - 1);
  int64_t k0 = 0;
  for (; k0 + 16 <= lines; k0 += 16) {
    __m512 v[16], t[16], u[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) v[r] = r < rows ? block(r, k0) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
      t[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
    }
    // u[g + j], 128-bit lane l: rows g .. g + 3 of column 4 l + j
#pragma GCC unroll 4
    for (int g = 0; g < 16; g += 4) {
      const __m512d t0 = _mm512_castps_pd(t[g]), t1 = _mm512_castps_pd(t[g + 1]);
      const __m512d t2 = _mm512_castps_pd(t[g + 2]), t3 = _mm512_castps_pd(t[g + 3]);
      u[g] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
      u[g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
      u[g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
      u[g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {  // lanes (0, 2) then (1, 3) of rows 0-7, then of rows 8-15
      const __m512 a0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88), a1 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xDD);
      const __m512 b0 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88), b1 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xDD);
      _mm512_mask_storeu_ps(out + (k0 + j) * rows, m, _mm512_shuffle_f32x4(a0, b0, 0x88));
      _mm512_mask_storeu_ps(out + (k0 + 4 + j) * rows, m, _mm512_shuffle_f32x4(a1, b1, 0x88));
      _mm512_mask_storeu_ps(out + (k0 + 8 + j) * rows, m, _mm512_shuffle_f32x4(a0, b0, 0xDD));
      _mm512_mask_storeu_ps(out + (k0 + 12 + j) * rows, m, _mm512_shuffle_f32x4(a1, b1, 0xDD));
    }
  }
  return k0;
}

// A tile's rows of x (rows <= 16, row stride sx) -> out [K, rows].
inline void pack_rows(const float* x, int64_t sx, int64_t rows, int64_t K, float* out) {
  const int64_t k0 = pack_blocks(rows, K, out, [&](int r, int64_t k) { return _mm512_loadu_ps(x + r * sx + k); });
  copy_columns(x, sx, rows, k0, K, out);
}

#ifdef __AVX512BF16__
// x for tile_bf16: [K2, rows] lanes of bf16 pairs, 32 values of a row rounded to 16 pairs at once.
inline void pack_rows_bf16(const float* x, int64_t sx, int64_t rows, int64_t K, float* out) {
  const int64_t k2 = pack_blocks(rows, K / 2, out, [&](int r, int64_t k2) {
    const float* v = x + r * sx + 2 * k2;
    return (__m512)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(v + 16), _mm512_loadu_ps(v));
  });
  copy_pairs(x, sx, rows, k2, K, out);
}
#else
// x for tile_bf16: [2 K2, rows], rounded to bf16.
inline void pack_rows_bf16(const float* x, int64_t sx, int64_t rows, int64_t K, float* out) {
  const int64_t k0 = pack_blocks(rows, K, out, [&](int r, int64_t k) { return round_bf16(_mm512_loadu_ps(x + r * sx + k)); });
  copy_columns_rounded(x, sx, rows, k0, K, (K + 1) / 2 * 2, out);
}
#endif
// The end of an int8 tile's group: its int32 sums (started from the group's -128 * weight sums) into
// the fp32 accumulators, acc += float(sum) * sw * sx. `sw`: the group's line of scales (its line of
// offsets follows); xs: the rows' scales of the group. The int32 sums die here: each is converted in
// its own register, and x's scale is a broadcast operand of the FMA.
template <int R>
__attribute__((always_inline)) inline void add_group(const float* sw, const float* xs, __m512i (&lo)[R],
                                                     __m512i (&hi)[R], __m512 (&flo)[R], __m512 (&fhi)[R]) {
  const __m512 s0 = _mm512_loadu_ps(sw), s1 = _mm512_loadu_ps(sw + 16);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const __m512 x = _mm512_set1_ps(xs[r]);
    flo[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(lo[r]), s0), x, flo[r]);
    fhi[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(hi[r]), s1), x, fhi[r]);
  }
}

#ifdef __AVX512VNNI__
// acc + the four products u8 x s8 of each lane of x and w, as _mm512_dpbusd_epi32 but in place: with
// the intrinsic GCC stored every accumulator of a tile of 14 rows to the stack on every k.
inline __m512i dpbusd(__m512i acc, __m512i x, __m512i w) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
  return acc;
}
#endif

// int8 panels: a line's lanes are four int8 weights of a column, x's lanes its four u8 values (x + 128)
// of those k (see the top). Per group, 2 x R int32 accumulators start from its offsets and take its
// lines, then go into 2 x R fp32 ones: 4 x 7, the line's two vectors and a broadcast.
template <int R>
void tile_int8(const Tile& t) {
  __m512 flo[R], fhi[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) flo[r] = fhi[r] = _mm512_setzero_ps();
  const float* w = t.w;
  const float* xs = t.xscale;
  PanelPrefetch pull(t, R >= 8 && t.every == 1);
  const int64_t K = t.K;
  for (int64_t q0 = 0; q0 < K; q0 += kGroupLines, xs += R) {
    const int64_t q1 = std::min(q0 + kGroupLines, K);
    const float* sums = w + (q1 - q0 + 1) * kPanel;
    __m512i lo[R], hi[R];
    {
      const __m512i o0 = _mm512_loadu_si512(sums), o1 = _mm512_loadu_si512(sums + 16);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) lo[r] = o0, hi[r] = o1;
    }
    for (int64_t k = q0; k < q1; ++k, w += kPanel) {
      pull.at(k, w);
#ifdef __AVX512VNNI__
      const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 16);
      const float* xk = t.x + k * R;
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_set1_epi32(lane_at(xk + r));
        lo[r] = dpbusd(lo[r], xv, w0);
        hi[r] = dpbusd(hi[r], xv, w1);
      }
#else
      // Without VNNI: the even k of each lane (its low bytes, shifted up and back with their sign),
      // then the odd k (the high bytes, shifted down), each into x's int16 pairs of those k.
      const float* xk = t.x + 2 * k * R;
      const __m512i e0 = _mm512_srai_epi16(_mm512_slli_epi16(_mm512_loadu_si512(w), 8), 8);
      const __m512i e1 = _mm512_srai_epi16(_mm512_slli_epi16(_mm512_loadu_si512(w + 16), 8), 8);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_set1_epi32(lane_at(xk + r));
        lo[r] = _mm512_add_epi32(lo[r], _mm512_madd_epi16(xv, e0));
        hi[r] = _mm512_add_epi32(hi[r], _mm512_madd_epi16(xv, e1));
        settle(lo[r]), settle(hi[r]);
      }
      const float* again = opaque(w);
      const __m512i o0 = _mm512_srai_epi16(_mm512_loadu_si512(again), 8);
      const __m512i o1 = _mm512_srai_epi16(_mm512_loadu_si512(again + 16), 8);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_set1_epi32(lane_at(xk + R + r));
        lo[r] = _mm512_add_epi32(lo[r], _mm512_madd_epi16(xv, o0));
        hi[r] = _mm512_add_epi32(hi[r], _mm512_madd_epi16(xv, o1));
      }
#endif
    }
    pull.at(q1, w), pull.at(q1, w + kPanel);
    add_group<R>(w, xs, lo, hi, flo, fhi);
    w += kInt8Trailer * kPanel;
  }
  finish<R>(t, flo, fhi);
}

// Weight-only int8 panels (see the top): byte J of each lane of a line, sign-extended, as fp32, times
// the group's scales of the columns (at `scales`).
template <int J>
inline __m512 widen_byte(const float* line, const float* scales) {
  const __m512i v = _mm512_srai_epi32(_mm512_slli_epi32(_mm512_loadu_si512(line), 24 - 8 * J), 24);
  return _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_loadu_ps(scales));
}

// Weights k = 4 k4 + J of a line (its two vectors widened and scaled) into x's values of that k. The
// line is read again for each J (opaque_for), its scales too, from `back` floats past it (not from
// a fixed pointer, which GCC would hoist out of the group's loop into two more registers): 2 x 14
// accumulators, the widened pair and a broadcast fill the registers.
template <int J, int R>
__attribute__((always_inline)) inline void fma_byte(const float* w, int64_t back, const float* xk, __m512 (&lo)[R],
                                                    __m512 (&hi)[R]) {
  const float* line = opaque_for<J>(w);
  const __m512 w0 = widen_byte<J>(line, line + back), w1 = widen_byte<J>(line + 16, line + back + 16);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const __m512 xv = _mm512_set1_ps(xk[J * R + r]);
    lo[r] = _mm512_fmadd_ps(xv, w0, lo[r]);
    hi[r] = _mm512_fmadd_ps(xv, w1, hi[r]);
  }
}

template <int R>
void tile_int8w(const Tile& t) {
  __m512 lo[R], hi[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  const float* w = t.w;
  PanelPrefetch pull(t, R >= 8 && t.every == 1);
  const int64_t K = t.K;
  for (int64_t q0 = 0; q0 < K; q0 += kGroupLines) {
    const int64_t q1 = std::min(q0 + kGroupLines, K);
    for (int64_t k = q0, back = (q1 - q0) * kPanel; k < q1; ++k, w += kPanel, back -= kPanel) {
      pull.at(k, w);
      const float* xk = t.x + 4 * k * R;
      fma_byte<0>(w, back, xk, lo, hi), fma_byte<1>(w, back, xk, lo, hi);
      fma_byte<2>(w, back, xk, lo, hi), fma_byte<3>(w, back, xk, lo, hi);
    }
    pull.at(q1, w), pull.at(q1, w + kPanel);
    w += kInt8Trailer * kPanel;
  }
  finish<R>(t, lo, hi);
}
#elif defined(__AVX2__) && defined(__FMA__)
// Lane i of the mask is set where i < n (n in [0, 8]).
inline __m256i first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline __m256 silu_times(__m256 gate, __m256 up) {
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.f);
  const __m256 e = exp_avx2(_mm256_min_ps(gate, _mm256_sub_ps(zero, gate)));
  const __m256 num = _mm256_blendv_ps(one, e, _mm256_cmp_ps(gate, zero, _CMP_LT_OQ));
  return _mm256_mul_ps(_mm256_div_ps(_mm256_mul_ps(gate, num), _mm256_add_ps(one, e)), up);
}

// The first n (0..8) lanes of v to p. A masked store (vmaskmovps) is many times slower than a plain
// one on some CPUs (AMD's Zen 2), so all 8 lanes take a plain one.
inline void store_first(float* p, __m256 v, int64_t n) {
  if (n == 8) _mm256_storeu_ps(p, v);
  else _mm256_maskstore_ps(p, first_lanes(n), v);
}

// How every tile ends, whatever its weights: see the AVX-512 one.
template <int R>
__attribute__((always_inline)) inline void finish(const Tile& t, const __m256 (&lo)[R], const __m256 (&hi)[R]) {
  if (t.gated) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) store_first(t.y + r * t.sy, silu_times(lo[r], hi[r]), t.cols);
    return;
  }
  __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
  if (t.bias != nullptr) b0 = _mm256_loadu_ps(t.bias), b1 = _mm256_loadu_ps(t.bias + 8);
  const int64_t n0 = std::min<int64_t>(t.cols, 8), n1 = std::max<int64_t>(t.cols - 8, 0);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    store_first(t.y + r * t.sy, _mm256_add_ps(lo[r], b0), n0);
    store_first(t.y + r * t.sy + 8, _mm256_add_ps(hi[r], b1), n1);
  }
}

// A lone tile of one row (a decode step of one request) issues no prefetches: it does two FMAs per
// line it loads, and the prefetch instructions cost that loop more than they save; the hardware
// prefetcher alone streams a panel faster there. With more rows, or more than one tile (which share
// the next panel's prefetches), or bf16's widening per line, the prefetches pay (docs/performance-log.md).
template <int R>
void tile(const Tile& t) {
  __m256 lo[R], hi[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  const float* w = t.w;
  PanelPrefetch pull(t, false);
  const bool prefetch = R > 1 || t.every > 1;
  const int64_t K = t.K;
  for (int64_t k = 0; k < K; ++k, w += kPanel) {
    if (prefetch) pull.at(k, w);
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
    const float* xk = t.x + k * R;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(xk + r);
      lo[r] = _mm256_fmadd_ps(xv, w0, lo[r]);
      hi[r] = _mm256_fmadd_ps(xv, w1, hi[r]);
    }
  }
  finish<R>(t, lo, hi);
}

// bf16 panels (AVX2's arrangement, see the top): one load of half a line is a k's 16 weights, widened
// into its two vectors by a shift (columns 0-7) and a mask (8-15). 2 x 6 accumulators, the two vectors
// and a broadcast: 15 of the 16 registers. Without settle() GCC kept one accumulator on the stack.
template <int R>
void tile_bf16(const Tile& t) {
  __m256 lo[R], hi[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  const float* w = t.w;
  PanelPrefetch pull(t, false);
  const __m256 high = _mm256_castsi256_ps(_mm256_set1_epi32(int(0xFFFF0000u)));
  const int64_t K = t.K;
  for (int64_t k = 0; k < K; ++k, w += kPanel) {
    pull.at(k, w);
    const float* xk = t.x + 2 * k * R;
#pragma GCC unroll 2
    for (int j = 0; j < 2; ++j) {
      const __m256 v = _mm256_loadu_ps(w + 8 * j);
      const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(v), 16));
      const __m256 w1 = _mm256_and_ps(v, high);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(xk + j * R + r);
        lo[r] = _mm256_fmadd_ps(xv, w0, lo[r]);
        hi[r] = _mm256_fmadd_ps(xv, w1, hi[r]);
        settle(lo[r]), settle(hi[r]);
      }
    }
  }
  finish<R>(t, lo, hi);
}

// The prefetches of panels ts[0 .. sizeof...(P) - 1].
template <size_t... P>
std::array<PanelPrefetch, sizeof...(P)> pulls(const Tile* ts, std::index_sequence<P...>) {
  return {PanelPrefetch(ts[P], false)...};
}

// A tile's rows (a decode step of a few requests) on NP panels at once (panels j .. j + NP - 1,
// ts[0 .. NP - 1]), over the panels' lines [k0, k1): each panel's sums as tile<R> (kBf16:
// tile_bf16<R>) makes them, in the same order, the panels' FMA chains interleaved. One panel at a time,
// a step of one to three rows read its weights at well under the read rate; reading NP panels'
// streams at once came near it (docs/kernels.md). A call over part of the lines starts from the sums
// `carry` holds (k0 > 0) and leaves its own there (k1 short of the end), so that the tiles of a few
// more rows take turns over a group's lines a chunk at a time (run_panels); `ahead` > 0 prefetches
// each panel's line that many lines on. Only bf16 panels prefetch otherwise, as tile_bf16 does, over
// the whole of their lines.
template <bool kBf16, int R, int NP>
void tile_group(const Tile* ts, int64_t k0, int64_t k1, float* carry, int64_t ahead) {
  __m256 lo[NP][R], hi[NP][R];
  const float* w[NP];
  auto pull = pulls(ts, std::make_index_sequence<NP>{});
#pragma GCC unroll 8
  for (int p = 0; p < NP; ++p) {
    w[p] = ts[p].w + k0 * kPanel;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float* sums = carry + (p * R + r) * kPanel;
      lo[p][r] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(sums);
      hi[p][r] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + 8);
    }
  }
  const __m256 high = _mm256_castsi256_ps(_mm256_set1_epi32(int(0xFFFF0000u)));
  constexpr int kPerLine = kBf16 ? 2 : 1;  // k a line
  const bool whole = k0 == 0 && k1 == ts[0].K;
  for (int64_t k = k0; k < k1; ++k) {
#pragma GCC unroll 2
    for (int j = 0; j < kPerLine; ++j) {
      const float* xk = ts[0].x + (kPerLine * k + j) * R;
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        __m256 w0, w1;
        if (j == 0 && ahead > 0) __builtin_prefetch(w[p] + ahead * kPanel, 0, 3);
        if constexpr (kBf16) {
          if (j == 0 && whole) pull[p].at(k, w[p]);
          const __m256 v = _mm256_loadu_ps(w[p] + 8 * j);
          w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(v), 16)), w1 = _mm256_and_ps(v, high);
        } else {
          w0 = _mm256_loadu_ps(w[p]), w1 = _mm256_loadu_ps(w[p] + 8);
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const __m256 xv = _mm256_broadcast_ss(xk + r);
          lo[p][r] = _mm256_fmadd_ps(xv, w0, lo[p][r]);
          hi[p][r] = _mm256_fmadd_ps(xv, w1, hi[p][r]);
          settle(lo[p][r]), settle(hi[p][r]);
        }
      }
    }
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) w[p] += kPanel;
  }
  if (k1 < ts[0].K) {
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p)
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        float* sums = carry + (p * R + r) * kPanel;
        _mm256_storeu_ps(sums, lo[p][r]);
        _mm256_storeu_ps(sums + 8, hi[p][r]);
      }
    return;
  }
#pragma GCC unroll 8
  for (int p = 0; p < NP; ++p) finish<R>(ts[p], lo[p], hi[p]);
}

// 8 floats rounded to bf16 to nearest even, kept as fp32 (bf16_bits on a vector).
inline __m256 round_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i tie = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(u, _mm256_add_epi32(tie, _mm256_set1_epi32(0x7FFF)));
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
  const __m256i r = _mm256_blendv_epi8(_mm256_and_si256(up, _mm256_set1_epi32(int(0xFFFF0000u))),
                                       _mm256_set1_epi32(0x7FC00000), nan);
  return _mm256_castsi256_ps(r);
}

// Whole blocks of 8 lines of a tile's rows (rows <= 8) -> out [lines, rows], block(r, k0) giving row
// r's values of lines k0 .. k0 + 7: each block transposed in registers (pairs of floats, then of
// pairs, then 128-bit halves). Returns the first line left to pack, which the caller writes after.
// Lines are stored in order as 8 floats, the (8 - rows) past a line spilling into lines stored after
// it: a masked store (store_first) only where 8 floats would pass the tile's `lines`.
template <class Block>
inline int64_t pack_blocks(int64_t rows, int64_t lines, float* out, Block block) {
  const auto store = [&](int64_t line, __m256 v) {
    store_first(out + line * rows, v, line * rows + 8 <= lines * rows ? 8 : rows);
  };
  int64_t k0 = 0;
  for (; k0 + 8 <= lines; k0 += 8) {
    __m256 v[8], t[8], u[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) v[r] = r < rows ? block(r, k0) : _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_ps(v[i], v[i + 1]);
      t[i + 1] = _mm256_unpackhi_ps(v[i], v[i + 1]);
    }
    // u[g + j], 128-bit half h: rows g .. g + 3 of column 4 h + j
#pragma GCC unroll 2
    for (int g = 0; g < 8; g += 4) {
      u[g] = _mm256_shuffle_ps(t[g], t[g + 2], 0x44);
      u[g + 1] = _mm256_shuffle_ps(t[g], t[g + 2], 0xEE);
      u[g + 2] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0x44);
      u[g + 3] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0xEE);
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) store(k0 + j, _mm256_permute2f128_ps(u[j], u[4 + j], 0x20));
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) store(k0 + 4 + j, _mm256_permute2f128_ps(u[j], u[4 + j], 0x31));
  }
  return k0;
}

// A tile's rows of x (rows <= 8, row stride sx) -> out [K, rows].
inline void pack_rows(const float* x, int64_t sx, int64_t rows, int64_t K, float* out) {
  const int64_t k0 = pack_blocks(rows, K, out, [&](int r, int64_t k) { return _mm256_loadu_ps(x + r * sx + k); });
  copy_columns(x, sx, rows, k0, K, out);
}

// x for tile_bf16: [2 K2, rows], rounded to bf16.
inline void pack_rows_bf16(const float* x, int64_t sx, int64_t rows, int64_t K, float* out) {
  const int64_t k0 = pack_blocks(rows, K, out, [&](int r, int64_t k) { return round_bf16(_mm256_loadu_ps(x + r * sx + k)); });
  copy_columns_rounded(x, sx, rows, k0, K, (K + 1) / 2 * 2, out);
}

// The end of an int8 tile's group: see the AVX-512 one.
template <int R>
__attribute__((always_inline)) inline void add_group(const float* sw, const float* xs, __m256i (&lo)[R],
                                                     __m256i (&hi)[R], __m256 (&flo)[R], __m256 (&fhi)[R]) {
  const __m256 s0 = _mm256_loadu_ps(sw), s1 = _mm256_loadu_ps(sw + 8);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const __m256 x = _mm256_broadcast_ss(xs + r);
    flo[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(lo[r]), s0), x, flo[r]);
    fhi[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(hi[r]), s1), x, fhi[r]);
  }
}

// int8 panels, as AVX-512's tile_int8: vpdpbusd with AVX-VNNI, else the even and odd k sign-extended
// and multiplied by vpmaddwd (2 x 3 int32 and 2 x 3 fp32 accumulators, two weight vectors, a
// broadcast and a product: 16).
template <int R>
void tile_int8(const Tile& t) {
  __m256 flo[R], fhi[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) flo[r] = fhi[r] = _mm256_setzero_ps();
  const float* w = t.w;
  const float* xs = t.xscale;
  PanelPrefetch pull(t, false);
  const int64_t K = t.K;
  for (int64_t q0 = 0; q0 < K; q0 += kGroupLines, xs += R) {
    const int64_t q1 = std::min(q0 + kGroupLines, K);
    const __m256i* sums = reinterpret_cast<const __m256i*>(w + (q1 - q0 + 1) * kPanel);
    __m256i lo[R], hi[R];
    {
      const __m256i o0 = _mm256_loadu_si256(sums), o1 = _mm256_loadu_si256(sums + 1);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) lo[r] = o0, hi[r] = o1;
    }
    for (int64_t k = q0; k < q1; ++k, w += kPanel) {
      pull.at(k, w);
      const __m256i* line = reinterpret_cast<const __m256i*>(w);
#ifdef __AVXVNNI__
      const __m256i w0 = _mm256_loadu_si256(line), w1 = _mm256_loadu_si256(line + 1);
      const float* xk = t.x + k * R;
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_set1_epi32(lane_at(xk + r));
        lo[r] = _mm256_dpbusd_avx_epi32(lo[r], xv, w0);
        hi[r] = _mm256_dpbusd_avx_epi32(hi[r], xv, w1);
      }
#else
      const float* xk = t.x + 2 * k * R;
      const __m256i e0 = _mm256_srai_epi16(_mm256_slli_epi16(_mm256_loadu_si256(line), 8), 8);
      const __m256i e1 = _mm256_srai_epi16(_mm256_slli_epi16(_mm256_loadu_si256(line + 1), 8), 8);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_set1_epi32(lane_at(xk + r));
        lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(xv, e0));
        hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(xv, e1));
        settle(lo[r]), settle(hi[r]);
      }
      const __m256i* again = reinterpret_cast<const __m256i*>(opaque(w));
      const __m256i o0 = _mm256_srai_epi16(_mm256_loadu_si256(again), 8);
      const __m256i o1 = _mm256_srai_epi16(_mm256_loadu_si256(again + 1), 8);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_set1_epi32(lane_at(xk + R + r));
        lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(xv, o0));
        hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(xv, o1));
      }
#endif
    }
    pull.at(q1, w), pull.at(q1, w + kPanel);
    add_group<R>(w, xs, lo, hi, flo, fhi);
    w += kInt8Trailer * kPanel;
  }
  finish<R>(t, flo, fhi);
}

// Weight-only int8 panels: see the AVX-512 ones (2 x 6 accumulators, the widened pair, a broadcast).
template <int J>
inline __m256 widen_byte(const float* line, const float* scales) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * J), 24)),
                       _mm256_loadu_ps(scales));
}

template <int J, int R>
__attribute__((always_inline)) inline void fma_byte(const float* w, int64_t back, const float* xk, __m256 (&lo)[R],
                                                    __m256 (&hi)[R]) {
  const float* line = opaque_for<J>(w);
  const __m256 w0 = widen_byte<J>(line, line + back), w1 = widen_byte<J>(line + 8, line + back + 8);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const __m256 xv = _mm256_broadcast_ss(xk + J * R + r);
    lo[r] = _mm256_fmadd_ps(xv, w0, lo[r]);
    hi[r] = _mm256_fmadd_ps(xv, w1, hi[r]);
  }
}

template <int R>
void tile_int8w(const Tile& t) {
  __m256 lo[R], hi[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  const float* w = t.w;
  PanelPrefetch pull(t, false);
  const int64_t K = t.K;
  for (int64_t q0 = 0; q0 < K; q0 += kGroupLines) {
    const int64_t q1 = std::min(q0 + kGroupLines, K);
    for (int64_t k = q0, back = (q1 - q0) * kPanel; k < q1; ++k, w += kPanel, back -= kPanel) {
      pull.at(k, w);
      const float* xk = t.x + 4 * k * R;
      fma_byte<0>(w, back, xk, lo, hi), fma_byte<1>(w, back, xk, lo, hi);
      fma_byte<2>(w, back, xk, lo, hi), fma_byte<3>(w, back, xk, lo, hi);
    }
    pull.at(q1, w), pull.at(q1, w + kPanel);
    w += kInt8Trailer * kPanel;
  }
  finish<R>(t, lo, hi);
}
#else
// Portable: the same tiles with the compiler's vectors, and one epilogue.
template <int R>
void finish(const Tile& t, const float (&acc)[R][kPanel]) {
  for (int r = 0; r < R; ++r) {
    if (t.gated) {
      for (int64_t c = 0; c < t.cols; ++c) t.y[r * t.sy + c] = silu_times(acc[r][c], acc[r][kHalf + c]);
      continue;
    }
    for (int64_t c = 0; c < t.cols; ++c) t.y[r * t.sy + c] = acc[r][c] + (t.bias != nullptr ? t.bias[c] : 0.f);
  }
}

template <int R>
void tile(const Tile& t) {
  float acc[R][kPanel] = {};
  const float* w = t.w;
  const int64_t K = t.K;
  for (int64_t k = 0; k < K; ++k, w += kPanel)
    for (int r = 0; r < R; ++r) {
      const float xv = t.x[k * R + r];
#pragma omp simd
      for (int64_t c = 0; c < kPanel; ++c) acc[r][c] += xv * w[c];
    }
  finish<R>(t, acc);
}

// bf16 panels: each lane's two weights widened, then multiplied into x's rounded values of their k.
template <int R>
void tile_bf16(const Tile& t) {
  float acc[R][kPanel] = {};
  const float* w = t.w;
  const int64_t K = t.K;
  for (int64_t k = 0; k < K; ++k, w += kPanel) {
    uint32_t lanes[kPanel];
    std::memcpy(lanes, w, sizeof lanes);
    float even[kPanel], odd[kPanel];
    for (int64_t c = 0; c < kPanel; ++c) {
      const uint32_t e = lanes[c] << 16, o = lanes[c] & 0xFFFF0000u;
      std::memcpy(even + c, &e, sizeof e);
      std::memcpy(odd + c, &o, sizeof o);
    }
    for (int r = 0; r < R; ++r) {
      const float xe = t.x[2 * k * R + r], xo = t.x[(2 * k + 1) * R + r];
#pragma omp simd
      for (int64_t c = 0; c < kPanel; ++c) acc[r][c] += xe * even[c] + xo * odd[c];
    }
  }
  finish<R>(t, acc);
}

// int8 panels: per group, each lane's four weights into x's four u8 values (x + 128) of their k, in
// int32 from the group's offsets, then float(sum) * sw * sx into the fp32 accumulators.
template <int R>
void tile_int8(const Tile& t) {
  float out[R][kPanel] = {};
  const float* w = t.w;
  const float* xs = t.xscale;
  const int64_t K = t.K;
  for (int64_t q0 = 0; q0 < K; q0 += kGroupLines, xs += R) {
    const int64_t q1 = std::min(q0 + kGroupLines, K);
    int32_t sums[kPanel], acc[R][kPanel];
    std::memcpy(sums, w + (q1 - q0 + 1) * kPanel, sizeof sums);
    for (int r = 0; r < R; ++r) std::memcpy(acc[r], sums, sizeof sums);
    for (int64_t k = q0; k < q1; ++k, w += kPanel) {
      const int8_t* wb = reinterpret_cast<const int8_t*>(w);
      const uint8_t* xk = reinterpret_cast<const uint8_t*>(t.x + k * R);
      for (int r = 0; r < R; ++r) {
        const uint8_t* xr = xk + 4 * r;
        for (int64_t c = 0; c < kPanel; ++c)
          acc[r][c] += xr[0] * wb[4 * c] + xr[1] * wb[4 * c + 1] + xr[2] * wb[4 * c + 2] + xr[3] * wb[4 * c + 3];
      }
    }
    const float* sw = w;
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < kPanel; ++c) out[r][c] += float(acc[r][c]) * sw[c] * xs[r];
    w += kInt8Trailer * kPanel;
  }
  finish<R>(t, out);
}

// Weight-only int8 panels: each lane's four weights widened and scaled by their group's column
// scales, into x's fp32 values of their k.
template <int R>
void tile_int8w(const Tile& t) {
  float acc[R][kPanel] = {};
  const float* w = t.w;
  const int64_t K = t.K;
  for (int64_t q0 = 0; q0 < K; q0 += kGroupLines) {
    const int64_t q1 = std::min(q0 + kGroupLines, K);
    const float* sw = w + (q1 - q0) * kPanel;
    for (int64_t k = q0; k < q1; ++k, w += kPanel) {
      const int8_t* wb = reinterpret_cast<const int8_t*>(w);
      for (int j = 0; j < 4; ++j) {
        float wv[kPanel];
        for (int64_t c = 0; c < kPanel; ++c) wv[c] = float(wb[4 * c + j]) * sw[c];
        for (int r = 0; r < R; ++r) {
          const float xv = t.x[(4 * k + j) * R + r];
#pragma omp simd
          for (int64_t c = 0; c < kPanel; ++c) acc[r][c] += xv * wv[c];
        }
      }
    }
    w += kInt8Trailer * kPanel;
  }
  finish<R>(t, acc);
}

inline void pack_rows(const float* x, int64_t sx, int64_t rows, int64_t K, float* out) {
  copy_columns(x, sx, rows, 0, K, out);
}

inline void pack_rows_bf16(const float* x, int64_t sx, int64_t rows, int64_t K, float* out) {
  copy_columns_rounded(x, sx, rows, 0, K, (K + 1) / 2 * 2, out);
}
#endif

// x for tile_int8: a tile's rows quantized (their groups' scales to `scales` [groups, rows]), then
// transposed as 32-bit lanes -> out [K4 kXLinesPerQuad, rows].
inline void pack_rows_int8(const float* x, int64_t sx, int64_t rows, int64_t K, float* out, float* scales) {
  const int64_t lines = (K + 3) / 4 * kXLinesPerQuad, groups = int8_groups(K);
  std::vector<uint32_t> lanes(rows * lines);
  std::vector<int8_t> q((K + 3) / 4 * 4);
  std::vector<float> row_scales(groups);
  for (int64_t r = 0; r < rows; ++r) {
    int8_lanes(x + r * sx, K, q.data(), lanes.data() + r * lines, row_scales.data());
    for (int64_t g = 0; g < groups; ++g) scales[g * rows + r] = row_scales[g];
  }
  const float* rows_of = reinterpret_cast<const float*>(lanes.data());
  int64_t k0 = 0;
#if defined(__AVX512F__)
  k0 = pack_blocks(rows, lines, out, [&](int r, int64_t k) { return _mm512_loadu_ps(rows_of + r * lines + k); });
#elif defined(__AVX2__) && defined(__FMA__)
  k0 = pack_blocks(rows, lines, out, [&](int r, int64_t k) { return _mm256_loadu_ps(rows_of + r * lines + k); });
#endif
  copy_lanes(lanes.data(), rows, k0, lines, out);
}

// x for tile_int8w: the rows rotated as the weights were (rotate_groups), [4 K4, rows] in fp32, the
// pad k zero.
inline void pack_rows_padded(const float* x, int64_t sx, int64_t rows, int64_t K, float* out) {
  std::vector<float> rotated(rows * K);
  for (int64_t r = 0; r < rows; ++r) rotate_groups(x + r * sx, K, rotated.data() + r * K);
  pack_rows(rotated.data(), K, rows, K, out);
  std::fill(out + K * rows, out + (K + 3) / 4 * 4 * rows, 0.f);
}

using TileFn = void (*)(const Tile&);
enum class Weights { kFloat, kBf16, kInt8, kInt8Weights };
template <Weights W, int R>
constexpr TileFn tile_for() {
  if constexpr (W == Weights::kBf16) return tile_bf16<R>;
  else if constexpr (W == Weights::kInt8) return tile_int8<R>;
  else if constexpr (W == Weights::kInt8Weights) return tile_int8w<R>;
  else return tile<R>;
}
// The tiles of 1 .. sizeof...(R) rows, by their rows (null past them).
template <Weights W, size_t... R>
constexpr std::array<TileFn, kMaxRows + 1> tiles_up_to(std::index_sequence<R...>) {
  return {nullptr, tile_for<W, int(R) + 1>()...};
}
constexpr auto kTiles = tiles_up_to<Weights::kFloat>(std::make_index_sequence<kMaxRows>{});
constexpr auto kTilesBf16 = tiles_up_to<Weights::kBf16>(std::make_index_sequence<kMaxRows>{});
#ifdef CBSERVE_AVX2
// A product of up to kGroupTiles * kGroupRows rows (bf16: kGroupTilesBf16 *) runs as tiles of up to
// kGroupRows rows on groups of panels (tile_group), kGroupPanels[R] at a time for R rows: the most that
// measured faster, as far as their accumulators leave registers (four rows in a pair hold 16
// accumulators, all the registers: GCC kept four on the stack). Where there are two tiles, they take
// turns over each kGroupChunk lines of the group, the second reading them from L1 and prefetching the
// next chunk's, so that the group is still read once, from memory, in a stream that does not stop
// while the second tile multiplies (tiles each over the whole group read it from L2 the second time,
// and left memory idle meanwhile). Tiles of more rows (tile<R>) were faster from seven rows on. A
// thread's panels short of a whole group run in pairs, then alone. bf16 tiles of four to six rows
// widen their weights in tile_bf16 faster than in turns (docs/kernels.md).
using GroupFn = void (*)(const Tile*, int64_t, int64_t, float*, int64_t);
constexpr int kGroupRows = 3, kGroupTiles = 2, kGroupTilesBf16 = 1;
constexpr int64_t kGroupChunk = 32;  // lines: 12 KiB of three panels, in L1 for the second tile
constexpr std::array<int, kGroupRows + 1> kGroupPanels = {0, 4, 3, 2};
constexpr int kMaxGroup = 4;
static_assert(*std::max_element(kGroupPanels.begin(), kGroupPanels.end()) <= kMaxGroup);
struct Groups {
  int panels;  // a group's
  GroupFn group, pair;
};
template <bool kBf16, size_t... R>
constexpr std::array<Groups, kGroupRows + 1> groups_up_to(std::index_sequence<R...>) {
  return {Groups{}, Groups{kGroupPanels[R + 1], tile_group<kBf16, int(R) + 1, kGroupPanels[R + 1]>,
                           tile_group<kBf16, int(R) + 1, 2>}...};
}
constexpr auto kGroups = groups_up_to<false>(std::make_index_sequence<kGroupRows>{});
constexpr auto kGroupsBf16 = groups_up_to<true>(std::make_index_sequence<kGroupRows>{});
#endif
constexpr auto kTilesInt8 = tiles_up_to<Weights::kInt8>(std::make_index_sequence<kMaxRowsInt8>{});
constexpr auto kTilesInt8Weights = tiles_up_to<Weights::kInt8Weights>(std::make_index_sequence<kMaxRows>{});

constexpr const char* kIsa =
#if defined(__AVX512BF16__)
    "avx512-bf16";
#elif defined(__AVX512F__)
    "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    "avx2";
#else
    "portable";
#endif

// The int8 tiles' products: vpdpbusd, or sign-extended vpmaddwd without VNNI, or portable loops.
constexpr const char* kInt8Path =
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    "avx512-vnni";
#elif defined(__AVX512F__)
    "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__AVXVNNI__)
    "avx-vnni";
#elif defined(__AVX2__) && defined(__FMA__)
    "avx2";
#else
    "portable";
#endif
}  // namespace

// W [N, K] -> panels [ceil(N / kPanel), K, kPanel], the last one zero-padded.
at::Tensor pack_weight(at::Tensor weight) {
  TORCH_CHECK(weight.dtype() == at::kFloat && weight.dim() == 2, "float32 [N, K] weight only, got ",
              weight.sizes(), " ", weight.dtype());
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kPanel - 1) / kPanel;
  auto padded = at::zeros({P * kPanel, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({P, kPanel, K}).transpose(1, 2).contiguous();
}

// W [2I, K] (gate rows, then up rows) -> panels [ceil(I / kHalf), K, kPanel]: panel j holds gate
// columns j * kHalf .. + kHalf, then the same up columns; the last one zero-padded.
at::Tensor pack_weight_gated(at::Tensor weight) {
  TORCH_CHECK(weight.dtype() == at::kFloat && weight.dim() == 2 && weight.size(0) % 2 == 0,
              "float32 [2I, K] weight only, got ", weight.sizes(), " ", weight.dtype());
  const int64_t I = weight.size(0) / 2, K = weight.size(1), P = (I + kHalf - 1) / kHalf;
  auto halves = at::zeros({2, P * kHalf, K}, weight.options());
  halves.narrow(1, 0, I).copy_(weight.view({2, I, K}));
  return halves.view({2, P, kHalf, K}).permute({1, 3, 0, 2}).reshape({P, K, kPanel}).contiguous();
}

namespace {
// W [rows, K] float32 or bfloat16 -> bf16 (rounded to nearest even), rows zero-padded to `rows` and
// K to 2 K2: its pairs of k side by side, as the panels hold them.
at::Tensor bf16_padded(const at::Tensor& weight, int64_t rows, const char* what) {
  TORCH_CHECK((weight.dtype() == at::kFloat || weight.dtype() == at::kBFloat16) && weight.dim() == 2,
              "float32 or bfloat16 ", what, " weight only, got ", weight.sizes(), " ", weight.scalar_type());
  const int64_t K = weight.size(1);
  auto padded = at::zeros({rows, (K + 1) / 2 * 2}, weight.options().dtype(at::kBFloat16));
  padded.narrow(0, 0, weight.size(0)).narrow(1, 0, K).copy_(weight);
  return padded;
}
}  // namespace

// W [N, K] -> bf16 panels [ceil(N / kPanel), K2, 2 kPanel]: per pair of k, each column's two weights
// side by side (AVX2: the two k in turn, their columns interleaved; see the top); the last panel and
// an odd K zero-padded.
at::Tensor pack_weight_bf16(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "[N, K] weight only, got ", weight.sizes());
  const int64_t N = weight.size(0), K2 = (weight.size(1) + 1) / 2, P = (N + kPanel - 1) / kPanel;
  auto padded = bf16_padded(weight, P * kPanel, "[N, K]");
#ifdef CBSERVE_AVX2
  return padded.view({P, 2, kHalf, K2, 2}).permute({0, 3, 4, 2, 1}).reshape({P, K2, 2 * kPanel}).contiguous();
#else
  return padded.view({P, kPanel, K2, 2}).permute({0, 2, 1, 3}).reshape({P, K2, 2 * kPanel}).contiguous();
#endif
}

// W [2I, K] (gate rows, then up rows) -> bf16 panels [ceil(I / kHalf), K2, 2 kPanel]: the columns of
// pack_weight_gated, the pairs of pack_weight_bf16.
at::Tensor pack_weight_gated_bf16(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) % 2 == 0, "[2I, K] weight only, got ", weight.sizes());
  const int64_t I = weight.size(0) / 2, K2 = (weight.size(1) + 1) / 2, P = (I + kHalf - 1) / kHalf;
  auto halves = at::zeros({2, P * kHalf, 2 * K2}, weight.options().dtype(at::kBFloat16));
  halves.narrow(1, 0, I).copy_(bf16_padded(weight, 2 * I, "[2I, K]").view({2, I, 2 * K2}));
#ifdef CBSERVE_AVX2
  return halves.view({2, P, kHalf, K2, 2}).permute({1, 3, 4, 2, 0}).reshape({P, K2, 2 * kPanel}).contiguous();
#else
  return halves.view({2, P, kHalf, K2, 2}).permute({1, 3, 0, 2, 4}).reshape({P, K2, 2 * kPanel}).contiguous();
#endif
}

namespace {
// W [rows, K] float32 or bfloat16 -> (int8 [rows, K], fp32 scales [rows, groups]): each group of kGroup
// k of a row on its own scale.
std::pair<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& weight, const char* what) {
  TORCH_CHECK((weight.dtype() == at::kFloat || weight.dtype() == at::kBFloat16) && weight.dim() == 2,
              "float32 or bfloat16 ", what, " weight only, got ", weight.sizes(), " ", weight.scalar_type());
  const auto w = weight.to(at::kFloat).contiguous();
  const int64_t rows = w.size(0), K = w.size(1), groups = int8_groups(K);
  auto q = at::empty({rows, K}, w.options().dtype(at::kChar));
  auto scales = at::empty({rows, groups}, w.options());
  const float* wp = w.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) quantize_groups(wp + n * K, K, qp + n * K, sp + n * groups);
  });
  return {q, scales};
}

// q [P kPanel, K] int8 and scales [P kPanel, groups], already in the panels' column order -> int8
// panels [P, K4 + 2 groups, 4 kPanel]: per group, its lines of lanes of four k (kGroup / 4, the last
// group's fewer, K zero-padded to 4 K4), its line of scales and its line of -128 * each column's
// weight sum over the group (see the top).
at::Tensor int8_panels(const at::Tensor& q, const at::Tensor& scales, int64_t P) {
  const int64_t K = q.size(1), K4 = (K + 3) / 4, groups = int8_groups(K), stride = K4 + kInt8Trailer * groups;
  auto panels = at::zeros({P, stride, 4 * kPanel}, q.options());
  const auto qc = q.contiguous();
  const auto sc = scales.contiguous();
  const int8_t* qp = qc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  int8_t* out = panels.data_ptr<int8_t>();
  constexpr int64_t line_bytes = 4 * kPanel;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      int8_t* line = out + p * stride * line_bytes;
      for (int64_t g = 0, k0 = 0; g < groups; ++g, k0 += kGroup) {
        const int64_t k1 = std::min(k0 + kGroup, K), n = (k1 - k0 + 3) / 4;
        for (int64_t c = 0; c < kPanel; ++c) {
          const int8_t* col = qp + (p * kPanel + c) * K;
          int32_t sum = 0;
          for (int64_t k = k0; k < k1; ++k) {
            line[(k - k0) / 4 * line_bytes + 4 * c + (k - k0) % 4] = col[k];
            sum += col[k];
          }
          std::memcpy(line + n * line_bytes + 4 * c, sp + (p * kPanel + c) * groups + g, sizeof(float));
          const int32_t offset = -128 * sum;
          std::memcpy(line + (n + 1) * line_bytes + 4 * c, &offset, sizeof offset);
        }
        line += (n + kInt8Trailer) * line_bytes;
      }
    }
  });
  return panels;
}
}  // namespace

// x [M, K] float32 -> its rows with each whole group of kGroup k rotated, as the int8 panels rotate
// x's rows and their weights' columns before rounding them (what the tests compare against).
at::Tensor rotate_int8(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == at::kFloat, "float32 [M, K] only, got ", x.sizes(), " ", x.scalar_type());
  const auto xc = x.contiguous();
  auto out = at::empty_like(xc);
  const int64_t K = xc.size(1);
  for (int64_t r = 0; r < xc.size(0); ++r) rotate_groups(xc.data_ptr<float>() + r * K, K, out.data_ptr<float>() + r * K);
  return out;
}

// x [M, K] float32 -> (int8 [M, K], scales [M, groups] float32): each group of kGroup k of a row
// rotated (rotate_int8) and rounded on its own symmetric scale, as the int8 panels round x's rows and
// their weights' columns (what the tests compare against).
std::tuple<at::Tensor, at::Tensor> quantize_int8(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2, "[M, K] only, got ", x.sizes());
  auto [q, scales] = quantize_rows(x, "[M, K]");
  return {q, scales};
}

// W [N, K] -> int8 panels [ceil(N / kPanel), K4 + 2 groups, 4 kPanel] (see the top); the last panel's
// missing columns have zero weights and scales.
at::Tensor pack_weight_int8(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "[N, K] weight only, got ", weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kPanel - 1) / kPanel;
  auto [q, scales] = quantize_rows(weight, "[N, K]");
  auto q_cols = at::zeros({P * kPanel, K}, q.options());
  q_cols.narrow(0, 0, N).copy_(q);
  auto s_cols = at::zeros({P * kPanel, scales.size(1)}, scales.options());
  s_cols.narrow(0, 0, N).copy_(scales);
  return int8_panels(q_cols, s_cols, P);
}

// W [2I, K] (gate rows, then up rows) -> int8 panels [ceil(I / kHalf), K4 + 2 groups, 4 kPanel]: the
// columns of pack_weight_gated, the lanes and groups of pack_weight_int8.
at::Tensor pack_weight_gated_int8(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) % 2 == 0, "[2I, K] weight only, got ", weight.sizes());
  const int64_t I = weight.size(0) / 2, K = weight.size(1), P = (I + kHalf - 1) / kHalf;
  auto [q, scales] = quantize_rows(weight, "[2I, K]");
  const int64_t groups = scales.size(1);
  auto q_halves = at::zeros({2, P * kHalf, K}, q.options());
  q_halves.narrow(1, 0, I).copy_(q.view({2, I, K}));
  auto s_halves = at::zeros({2, P * kHalf, groups}, scales.options());
  s_halves.narrow(1, 0, I).copy_(scales.view({2, I, groups}));
  return int8_panels(q_halves.view({2, P, kHalf, K}).transpose(0, 1).reshape({P * kPanel, K}),
                     s_halves.view({2, P, kHalf, groups}).transpose(0, 1).reshape({P * kPanel, groups}), P);
}

namespace {
// x [..., K] times the panels -> [..., N]; gated: N = I outputs of silu(gate) * up. int8_x: int8
// panels multiply x rounded to int8 per row; else x as it is (weight-only int8).
at::Tensor run_panels(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                      int64_t N, bool gated, bool int8_x) {
  TORCH_CHECK(x.dtype() == at::kFloat, "x must be float32, got ", x.scalar_type());
  const bool bf16 = panels.dtype() == at::kBFloat16, int8 = panels.dtype() == at::kChar;
  TORCH_CHECK(bf16 || int8 || panels.dtype() == at::kFloat, "panels must be float32, bfloat16 or int8, got ",
              panels.scalar_type());
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == (int8 ? 4 : bf16 ? 2 : 1) * kPanel && panels.is_contiguous(),
              "panels must come from pack_weight", int8 ? "_int8" : bf16 ? "_bf16" : "", ", got ", panels.sizes());
  // lines: the panels' lines of weights per column (K, K2 pairs or K4 quads of k); stride: a panel's
  // lines in all (int8: with each group's two); x_lines: x's packed lines.
  const int64_t K = x.size(-1), P = panels.size(0), width = gated ? kHalf : kPanel;
  const int64_t stride = panels.size(1);
  int64_t lines = stride;
  if (int8) {  // groups of kGroupLines lines but the last, each with its two lines of scales and offsets
    const int64_t groups = (stride + kGroupLines + kInt8Trailer - 1) / (kGroupLines + kInt8Trailer);
    lines = stride - kInt8Trailer * groups;
    TORCH_CHECK(lines > (groups - 1) * kGroupLines, "panels must come from pack_weight_int8, got ", panels.sizes());
    TORCH_CHECK((K + 3) / 4 == lines, "x has ", K, " features, the weight ", 4 * lines - 3, " to ", 4 * lines);
  } else if (bf16) {
    TORCH_CHECK((K + 1) / 2 == lines, "x has ", K, " features, the weight ", 2 * lines - 1, " or ", 2 * lines);
  } else {
    TORCH_CHECK(K == lines, "x has ", K, " features, the weight ", lines);
  }
  const bool int8_w = int8 && !int8_x;  // weight-only: x's fp32 values, 4 lines per quad of k
  const int64_t x_lines = int8_w ? 4 * lines : int8 ? lines * kXLinesPerQuad : bf16 ? lines * kXLinesPerPair : K;
  TORCH_CHECK(N > (P - 1) * width && N <= P * width, "N = ", N, " does not fit ", P, " panels");
  auto x2 = x.reshape({-1, K});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  const int64_t M = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  auto y = at::empty(out_shape, x.options());
  if (M == 0) return y;
  at::Tensor bias_padded;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bias must have ", N, " values, got ", bias->numel());
    bias_padded = at::zeros({P * kPanel}, x.options());
    bias_padded.narrow(0, 0, N).copy_(bias->reshape({N}));
  }
  const float* xp = x2.data_ptr<float>();
  // bf16 and int8 panels are read as 32-bit lanes, each a pair or quad of weights, through the vector
  // loads (or memcpy).
  const float* wp = static_cast<const float*>(panels.data_ptr());
  const float* bp = bias_padded.defined() ? bias_padded.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t sx = x2.stride(0);
  // Tiles as even as possible: 30 rows run as 10 + 10 + 10, not 14 + 14 + 2.
  int64_t max_rows = int8 && int8_x ? kMaxRowsInt8 : kMaxRows;
#ifdef CBSERVE_AVX2
  const bool grouped = !int8 && M <= (bf16 ? kGroupTilesBf16 : kGroupTiles) * kGroupRows;
  if (grouped) max_rows = kGroupRows;
#endif
  const int64_t tiles = (M + max_rows - 1) / max_rows, base = M / tiles, extra = M % tiles;
  auto tile_rows = [&](int64_t i) { return base + (i < extra ? 1 : 0); };
  auto tile_first_row = [&](int64_t i) { return i * base + std::min(i, extra); };
  auto packed_x = at::empty({M * x_lines}, x.options());
  float* xq = packed_x.data_ptr<float>();
  at::Tensor x_scales;
  const int64_t groups = int8_groups(K);
  if (int8 && int8_x) x_scales = at::empty({M * groups}, x.options());  // each tile's [groups, rows]
  float* xs = x_scales.defined() ? x_scales.data_ptr<float>() : nullptr;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r0 = tile_first_row(i);
      if (int8_w) {
        pack_rows_padded(xp + r0 * sx, sx, tile_rows(i), K, xq + r0 * x_lines);
      } else if (int8) {
        pack_rows_int8(xp + r0 * sx, sx, tile_rows(i), K, xq + r0 * x_lines, xs + r0 * groups);
      } else {
        (bf16 ? pack_rows_bf16 : pack_rows)(xp + r0 * sx, sx, tile_rows(i), K, xq + r0 * x_lines);
      }
    }
  });
  const auto& tile_fns = int8_w ? kTilesInt8Weights : int8 ? kTilesInt8 : bf16 ? kTilesBf16 : kTiles;
  // Tile i of panel j, pulling its share of panel `after` (none past the thread's `end`).
  auto tile_of = [&](int64_t j, int64_t i, int64_t after, int64_t end) {
    const int64_t r0 = tile_first_row(i);
    const int64_t line0 = stride * i / tiles, line1 = stride * (i + 1) / tiles;
    const float* next = after < end ? wp + (after * stride + line0) * kPanel : nullptr;
    return Tile{xq + r0 * x_lines, wp + j * stride * kPanel, lines, yp + r0 * N + j * width, N,
                bp == nullptr ? nullptr : bp + j * kPanel, std::min(width, N - j * width), gated,
                next, next == nullptr ? 0 : line1 - line0, tiles, xs == nullptr ? nullptr : xs + r0 * groups};
  };
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    int64_t j = begin;
#ifdef CBSERVE_AVX2
    if (grouped) {  // the tiles on groups of panels, in turns a chunk of lines at a time
      const auto& by_rows = bf16 ? kGroupsBf16 : kGroups;
      // A group's panels: the tiles' own where they agree (tiles of one height), else pairs.
      const int panels = by_rows[tile_rows(0)].panels;
      const bool agree = by_rows[tile_rows(tiles - 1)].panels == panels;
      const int64_t chunk = tiles > 1 ? kGroupChunk : lines;
      Tile ts[kGroupTiles][kMaxGroup];
      alignas(32) float carry[kGroupTiles][kMaxGroup * kGroupRows * kPanel];
      const auto run = [&](int np) {
        for (; j + np <= end; j += np) {
          for (int64_t i = 0; i < tiles; ++i)
            for (int q = 0; q < np; ++q) ts[i][q] = tile_of(j + q, i, j + np + q, end);
          for (int64_t k0 = 0; k0 < lines; k0 += chunk) {
            const int64_t k1 = std::min(lines, k0 + chunk);
            for (int64_t i = 0; i < tiles; ++i) {
              const Groups& g = by_rows[tile_rows(i)];
              const int64_t ahead = i == tiles - 1 && k1 < lines ? chunk : 0;
              (g.panels == np ? g.group : g.pair)(ts[i], k0, k1, carry[i], ahead);
            }
          }
        }
      };
      if (agree && panels > 2) run(panels);
      run(2);
    }
#endif
    for (; j < end; ++j)
      for (int64_t i = 0; i < tiles; ++i) tile_fns[tile_rows(i)](tile_of(j, i, j + 1, end));
  });
  return y;
}
}  // namespace

// x [..., K] float32 (rows contiguous), panels of pack_weight, pack_weight_bf16 or pack_weight_int8, bias [N] or None
// -> [..., N] float32. int8 panels: int8_x rounds x's rows to int8, else x multiplies as it is.
at::Tensor panel_linear(at::Tensor x, at::Tensor panels, c10::optional<at::Tensor> bias, int64_t N, bool int8_x) {
  return run_panels(x, panels, bias, N, false, int8_x);
}

// x [..., K], panels of pack_weight_gated(_bf16, _int8) for I outputs -> silu(x Wg^T) * (x Wu^T) [..., I]
at::Tensor panel_linear_gated(at::Tensor x, at::Tensor panels, int64_t I, bool int8_x) {
  return run_panels(x, panels, c10::nullopt, I, true, int8_x);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL: the host plans the next step while a forward runs (async batching).
  using nogil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("pack_weight", &pack_weight, "W [N, K] -> column panels (CPU, float32)", nogil{});
  namespace py = pybind11;
  m.def("panel_linear", &panel_linear, "x W^T + bias with W packed by pack_weight(_bf16, _int8)", py::arg("x"),
        py::arg("panels"), py::arg("bias"), py::arg("N"), py::arg("int8_x") = true, nogil{});
  m.def("pack_weight_gated", &pack_weight_gated, "[gate; up] [2I, K] -> gated column panels", nogil{});
  m.def("panel_linear_gated", &panel_linear_gated, "silu(x Wg^T) * (x Wu^T) with pack_weight_gated(_bf16, _int8)'s panels",
        py::arg("x"), py::arg("panels"), py::arg("I"), py::arg("int8_x") = true, nogil{});
  m.def("pack_weight_bf16", &pack_weight_bf16, "W [N, K] -> bf16 column panels of pairs of k", nogil{});
  m.def("pack_weight_gated_bf16", &pack_weight_gated_bf16, "[gate; up] [2I, K] -> gated bf16 column panels", nogil{});
  m.def("pack_weight_int8", &pack_weight_int8, "W [N, K] -> int8 column panels of quads of k, scales per column and group of k", nogil{});
  m.def("pack_weight_gated_int8", &pack_weight_gated_int8, "[gate; up] [2I, K] -> gated int8 column panels", nogil{});
  m.def("rotate_int8", &rotate_int8, "x [M, K] -> each whole group of k times the Walsh-Hadamard matrix, as the int8 panels rotate rows", nogil{});
  m.def("quantize_int8", &quantize_int8, "x [M, K] -> (int8 [M, K], scales [M, groups]) as the int8 panels round rows", nogil{});
  m.def("isa", [] { return std::string(kIsa); }, "the vector path compiled: avx512-bf16, avx512, avx2 or portable");
  m.def("int8_path", [] { return std::string(kInt8Path); },
        "the int8 panels' products: avx512-vnni, avx512, avx-vnni, avx2 or portable");
  m.def("int8_group", [] { return kGroup; }, "k per group of the int8 panels' scales (and of x's rows)");
}
