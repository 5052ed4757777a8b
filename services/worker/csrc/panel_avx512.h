// The panel kernel's tiles and packs on AVX-512 (32 registers of 16 floats; bf16 and int8 where the
// CPU has AVX512-BF16 and AVX512-VNNI): panel_linear.cpp's header has the design.
#pragma once

#include "panel_common.h"

#ifdef __AVX512F__
namespace {
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

// What a tile of R rows pulls of the next panel (panel_linear.cpp): a lone tile (the product's only
// one) of 8-14 rows a sparse line, one of fewer rows none, a tile beside others every line.
template <int R>
inline NextPanel next_panel(const Tile& t) {
  if (t.every > 1) return NextPanel::kEvery;
  return R >= 8 ? NextPanel::kSparse : NextPanel::kNone;
}

template <int R>
void tile(const Tile& t) {
  __m512 lo[R], hi[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  const float* w = t.w;
  PanelPrefetch pull(t, next_panel<R>(t));
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
  PanelPrefetch pull(t, next_panel<R>(t));
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
  PanelPrefetch pull(t, next_panel<R>(t));
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
// of those k (panel_linear.cpp). Per group, 2 x R int32 accumulators start from its offsets and take its
// lines, then go into 2 x R fp32 ones: 4 x 7, the line's two vectors and a broadcast.
template <int R>
void tile_int8(const Tile& t) {
  __m512 flo[R], fhi[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) flo[r] = fhi[r] = _mm512_setzero_ps();
  const float* w = t.w;
  const float* xs = t.xscale;
  PanelPrefetch pull(t, next_panel<R>(t));
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

// Weight-only int8 panels (panel_linear.cpp): byte J of each lane of a line, sign-extended, as fp32, times
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
  PanelPrefetch pull(t, next_panel<R>(t));
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
