// Prefill chunks (paged_prefill): several query tokens per request, attending causally.
#pragma once

#include "paged_decode.h"  // the portable path runs each query token as a decode row

// ------------------------------------------------------------------------------------------ prefill
//
// A prefill chunk's attention is compute-bound: per layer a 512-token prompt costs 0.3 GFLOP
// causally, and gather + SDPA with a folded mask computed twice that (the masked half too) after
// copying the context and building the mask. Here a task is one request, one kv head and a block of
// 16 query tokens: its G x 16 query rows (the kv head's query heads) are laid across the lanes of
// AVX-512 vectors (transposed once), so each key's dot with 16 rows is 64 broadcast-FMAs with no
// horizontal sums; the scores of the block (keys x rows, in L2) get a masked softmax (each row's own
// causal range), and the values are summed into up to six rows at a time from one load of each V row.
// Every sum keeps the decode kernel's order ("One row, one result" in paged_common.h). Blocks of the longest
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
