// The panel kernel's tiles and packs with the compiler's vectors, where the CPU has neither AVX-512
// nor AVX2 with FMA.
#pragma once

#include "panel_common.h"

#if !defined(__AVX512F__) && !defined(CBSERVE_AVX2)
namespace {
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
}  // namespace
#endif
