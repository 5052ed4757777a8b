// The panel kernel's tiles and packs on AVX2 with FMA and no AVX-512 (16 registers of 8 floats),
// with the groups of panels that few rows take turns over: panel_linear.cpp's header has the design.
#pragma once

#include "panel_common.h"

#ifdef CBSERVE_AVX2
namespace {
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
  PanelPrefetch pull(t, NextPanel::kEvery);
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

// bf16 panels (AVX2's arrangement, panel_linear.cpp): one load of half a line is a k's 16 weights, widened
// into its two vectors by a shift (columns 0-7) and a mask (8-15). 2 x 6 accumulators, the two vectors
// and a broadcast: 15 of the 16 registers. Without settle() GCC kept one accumulator on the stack.
template <int R>
void tile_bf16(const Tile& t) {
  __m256 lo[R], hi[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  const float* w = t.w;
  PanelPrefetch pull(t, NextPanel::kEvery);
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
  return {PanelPrefetch(ts[P], NextPanel::kEvery)...};
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
  PanelPrefetch pull(t, NextPanel::kEvery);
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
  PanelPrefetch pull(t, NextPanel::kEvery);
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
}  // namespace
#endif
