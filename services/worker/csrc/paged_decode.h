// Decode rows (paged_decode): one query token per request, its context's K and V rows read once per
// layer, straight from the pool (paged_attention.cpp's header has the design).
#pragma once

#include "paged_common.h"

namespace {
constexpr int64_t kAheadLines = 144;  // how far ahead of the reads the pump prefetches
constexpr int64_t kPumpBytes = 256;   // the least the pump prefetches of a key at a step
constexpr int64_t kAvx2Ahead = 16;    // how many keys ahead of its reads the AVX2 path prefetches
constexpr int64_t kBlock = 16;   // keys per block of dots
// ... on AVX2's vector path: three vectors of 8 keys, so that three query rows' dots run as nine
// independent FMA chains (each dot is one chain over the dims, see below; with two vectors, the six
// chains left the FMAs waiting on their latency).
constexpr int64_t kAvx2Block = 24;
constexpr int64_t kVBlock = 32;  // keys per block of the V pass: their rows, all heads, stay in L1
constexpr int64_t kMaxRows = 4096;  // query heads of one request

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

// A task's passes read its K rows, then its V rows, a block of keys at a time (kBlock keys in the K
// pass, kVBlock in the V pass), and within a block a head at a time: head 0 of every key of the block,
// then head 1, and so on. The pump keeps kAheadLines lines of bytes prefetched ahead of the reads in
// that same order, a run of heads (at least kPumpBytes) of one key at a time as the reads advance.
// Pages are scattered, so the hardware prefetcher loses the stream at every page boundary, and
// prefetching a whole block's rows at once outran what a core can have in flight (the reads then
// waited for memory instead of overlapping the arithmetic): the pump paces them. It follows the
// reads' order, not the rows' order in memory: a pump ahead by whole rows fell behind the first head
// of a block whenever the block's rows spanned more than its distance (1 KB rows of 8 heads), and
// runs of fewer bytes cost more in the pump's own steps than their prefetches won. Each line is
// prefetched once: an int8 head (D values and a scale) is no whole number of lines, and the next
// run of a key starts on the line where the one before it ended. The lines go into L2, not L1: a
// prefetch into L1 holds one of the core's few L1 miss buffers until memory answers, and with them
// all taken the reads (and the next prefetches) stalled (docs/performance-log.md has the
// measurements).
template <class T>
class Pump {
 public:
  // `start`: prefetch the stream's first kAheadLines lines now (else the first advance does);
  // `k_block`: keys per block of the K pass.
  Pump(const Task<T>& t, bool start, int64_t k_block)
      : t_(t), head_bytes_(t.hd * int64_t{sizeof(T)}), stride_(t.stride * int64_t{sizeof(T)}),
        run_(std::min(t.hs, std::max<int64_t>(1, (kPumpBytes + head_bytes_ - 1) / head_bytes_))),
        block_{k_block, kVBlock} {
    if (t.n == 0) pos_ = kDone;
    else begin_run();
    if (start) advance(0);
  }

  // The reads moved past `head_rows` more head rows, in their order (D values each, and in an int8
  // stream their scale).
  inline void advance(int64_t head_rows) {
    target_ += head_rows * head_bytes_;
    while (pos_ < target_) {
      const uintptr_t start = reinterpret_cast<uintptr_t>(base_ + slot_[i_] * stride_);
      const uintptr_t last = (start + bytes_ - 1) / 64;
      for (uintptr_t line = shared_ && start % 64 != 0 ? start / 64 + 1 : start / 64; line <= last; ++line)
        __builtin_prefetch(reinterpret_cast<const char*>(line * 64), 0, 1);  // into L2 (prefetcht2)
      pos_ += bytes_;
      if (__builtin_expect(++i_ == count_, 0)) next_run();
    }
  }

 private:
  static constexpr int64_t kDone = std::numeric_limits<int64_t>::max();

  // The run of heads h_ .. over the keys of the block from j0_ in pass pass_.
  void begin_run() {
    count_ = std::min(block_[pass_], t_.n - j0_);
    heads_ = std::min(run_, t_.hs - h_);
    bytes_ = heads_ * head_bytes_;
    base_ = reinterpret_cast<const char*>((pass_ == 0 ? t_.k : t_.v) + h_ * t_.hd);
    slot_ = t_.slot + j0_;
    shared_ = h_ > 0;  // the key's run before this one ended on this run's first line
    i_ = 0;
  }

  void next_run() {
    if ((h_ += heads_) == t_.hs) {
      h_ = 0;
      if ((j0_ += count_) == t_.n) {
        j0_ = 0;
        if (++pass_ == 2) {
          pos_ = kDone;
          return;
        }
      }
    }
    begin_run();
  }

  const Task<T>& t_;
  const int64_t head_bytes_;                   // bytes of one head's row
  const int64_t stride_;                       // bytes from one key's rows to the next key's
  const int64_t run_;                          // heads a run
  const int64_t block_[2];                     // keys per block of the K and the V pass
  int pass_ = 0;                               // 0: K, 1: V
  int64_t j0_ = 0, h_ = 0;                     // the run's block's first key, its first head
  int64_t count_ = 0, heads_ = 0, bytes_ = 0;  // its keys, heads, bytes a key
  const char* base_ = nullptr;                 // its first head in key 0 of the pool
  const int64_t* slot_ = nullptr;              // its block's slots
  bool shared_ = false;
  int64_t i_ = 0;                              // the run's next key
  int64_t target_ = kAheadLines * 64, pos_ = 0;  // bytes of the stream: to prefetch up to, prefetched
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
// The first pass over a block (`pump` set) moves the pump past this head's rows of the block, a share
// after each 16 words' loads: a step of the pump inlined among the loads, every second row, ran them
// slower.
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
      for (int i = 0; i < 16; ++i) rows[i] = _mm512_loadu_ps(kr[i] + w0);
    } else if constexpr (std::is_same_v<T, f16>) {
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) rows[i] = load16(kr[i] + w0);  // D is 16 NC: whole vectors
    } else {
      // Through a mask: a row of bfloat16 or int8 may end within the 16 words. (Taken for whole words
      // too: with plain loads the bfloat16 kernel ran slower on short contexts.)
      const __mmask16 words = __mmask16(kWords - w0 >= 16 ? 0xFFFF : (1u << (kWords - w0)) - 1);
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) rows[i] = _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(words, kr[i] + w0 * kPerWord<T>));
    }
    if (pump != nullptr) pump->advance(std::min(kWords, w0 + 16) * kBlock / kWords - w0 * kBlock / kWords);
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
  Pump<T> pump(t, kPumped<NC>, kDotsBlock<NC>);
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
}  // namespace
