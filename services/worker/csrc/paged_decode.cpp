// Paged attention for decode rows (one query token per request) on CPU, float32.
//
// Reads each request's K/V rows straight from the paged pool through its slot list, so no gathered
// copy of the context is ever made: the context is read once per layer, from memory (a step's
// contexts of 30 layers are far larger than the caches), which is what bounds decode attention.
//
// Work is split into tasks of one request and a range of its kv heads: all heads when there are
// enough requests to keep every thread busy (a token's K or V row for all heads is one contiguous
// read), one head each otherwise (so a lone long request still uses every core). Contexts differ in
// length by 10x within a batch, so threads take tasks from a shared counter instead of fixed shares.
//
// With AVX-512 and a head size of 16..128, query-key dots are computed 16 keys at a time and their
// sums folded together by a transpose-and-add (a dot of 64 floats is 4 FMAs; summing its lanes alone
// took twice that), and the values of up to four queries of a head are accumulated in registers from
// one load of each V row. Pages are scattered in the pool, which defeats the hardware prefetcher at
// every page boundary: rows a few keys ahead are prefetched by hand.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <vector>

namespace {
#ifdef __AVX512F__
using __m512_or_float = __m512;  // one lane vector of partial dots (run_task_rows)
#else
using __m512_or_float = float;
#endif
constexpr int64_t kPrefetchKeys = 8;
constexpr int64_t kBlock = 16;  // keys per block of dots
constexpr int64_t kMaxRows = 4096;  // query heads of one request

inline void prefetch_row(const float* row, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(p + c);
}

struct Task {
  const float* q;      // [hs, G, D] of this row, contiguous
  float* out;          // [hs, G, D]
  const float* k;      // this task's first head in key 0 of the pool: key s is k + s * stride
  const float* v;
  const int64_t* slot; // the keys this row reads: slot[0 .. n)
  int64_t n, hs, G, D, stride;
  float scale, cap;
};

#ifdef __AVX512F__
// Transpose-and-add: lane i of the result holds the sum of part[i]'s lanes (four levels).
inline __m512 fold16(const __m512* part) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(part[2 * i], part[2 * i + 1]),
                         _mm512_unpackhi_ps(part[2 * i], part[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Scores of one (head, query) against keys [j0, j0 + 16) of its slot range, scaled: 16 floats.
template <int NC>
inline void dots16(const Task& t, const float* q, int64_t head_off, int64_t j0, int64_t count, float* dst) {
  __m512 qv[NC];
  for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  __m512 part[16];
  for (int64_t i = 0; i < 16; ++i) {
    if (i >= count) { part[i] = _mm512_setzero_ps(); continue; }
    const float* kr = t.k + t.slot[j0 + i] * t.stride + head_off;
    __m512 s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
    for (int c = 1; c < NC; ++c) s = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), s);
    part[i] = s;
  }
  const __m512 sums = fold16(part);
  const __mmask16 keep = count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
  _mm512_mask_storeu_ps(dst, keep, _mm512_mul_ps(sums, _mm512_set1_ps(t.scale)));
}

// out[g] = inv[g] * sum_j w[g][j] * V[j] for GB queries of one head (w rows t.n apart, out rows t.D
// apart): each V row is loaded once for all of them, and the GB x NC accumulators stay in registers.
template <int NC, int GB>
inline void weighted_sum(const Task& t, const float* w, int64_t head_off, const float* inv, float* out) {
  __m512 acc[GB][NC];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < t.n; ++j) {
    if (j + kPrefetchKeys < t.n) prefetch_row(t.v + t.slot[j + kPrefetchKeys] * t.stride + head_off, t.D * 4);
    const float* vr = t.v + t.slot[j] * t.stride + head_off;
    __m512 v[NC];
    for (int c = 0; c < NC; ++c) v[c] = _mm512_loadu_ps(vr + 16 * c);
    for (int g = 0; g < GB; ++g) {
      const __m512 wg = _mm512_set1_ps(w[g * t.n + j]);
      for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_fmadd_ps(wg, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g) {
    const __m512 s = _mm512_set1_ps(inv[g]);
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(out + g * t.D + 16 * c, _mm512_mul_ps(acc[g][c], s));
  }
}

// Queries of one head per weighted_sum call: as many as keep the accumulators within 16 registers.
template <int NC>
inline void weighted_sums(const Task& t, const float* w, int64_t head_off, const float* inv, float* out) {
  constexpr int kMax = std::max(1, std::min(4, 16 / NC));
  for (int64_t g = 0; g < t.G; g += kMax) {
    const int64_t gb = std::min<int64_t>(kMax, t.G - g);
    const float* wg = w + g * t.n;
    float* og = out + g * t.D;
    if (gb == 1) weighted_sum<NC, 1>(t, wg, head_off, inv + g, og);
    if constexpr (kMax >= 2) if (gb == 2) weighted_sum<NC, 2>(t, wg, head_off, inv + g, og);
    if constexpr (kMax >= 3) if (gb == 3) weighted_sum<NC, 3>(t, wg, head_off, inv + g, og);
    if constexpr (kMax >= 4) if (gb == 4) weighted_sum<NC, 4>(t, wg, head_off, inv + g, og);
  }
}

#endif

// Portable fallbacks of the AVX-512 pair above, one key at a time.
inline void dots_generic(const Task& t, const float* q, int64_t head_off, int64_t j0, int64_t count, float* dst) {
  for (int64_t i = 0; i < count; ++i) {
    const float* kr = t.k + t.slot[j0 + i] * t.stride + head_off;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < t.D; ++d) dot += q[d] * kr[d];
    dst[i] = dot * t.scale;
  }
}

inline void weighted_sums_generic(const Task& t, const float* w, int64_t head_off, const float* inv, float* out) {
  std::fill(out, out + t.G * t.D, 0.f);
  for (int64_t j = 0; j < t.n; ++j) {
    const float* vr = t.v + t.slot[j] * t.stride + head_off;
    for (int64_t g = 0; g < t.G; ++g) {
      const float wj = w[g * t.n + j];
      float* o = out + g * t.D;
#pragma omp simd
      for (int64_t d = 0; d < t.D; ++d) o[d] += wj * vr[d];
    }
  }
  for (int64_t g = 0; g < t.G; ++g)
    for (int64_t d = 0; d < t.D; ++d) out[g * t.D + d] *= inv[g];
}

// Softmax of one score row in place; returns 1 / its sum.
inline float softmax_(float* row, int64_t n, float cap) {
  // Built with -ffast-math (so exp vectorises): every value here stays finite, starting with this.
  if (cap > 0.f) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) row[j] = std::tanh(row[j] / cap) * cap;
  }
  float m = -FLT_MAX;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = std::max(m, row[j]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    row[j] = std::exp(row[j] - m);
    sum += row[j];
  }
  return 1.f / sum;
}

#ifdef __AVX512F__
// A task over several heads, in key order: each K and V row (all the task's heads, one contiguous
// read) is loaded once, front to back. Reading it head by head instead strides through the rows
// several times, which from memory ran at a quarter of a core's streaming rate (7 GB/s per core
// against 28 for a plain sum); in order, the hardware prefetcher streams each page. The per-key
// partial dots wait in `part` (L1) until a block of 16 is folded; the V sums accumulate in `out`.
template <int NC>
void run_task_rows(const Task& t, float* scores, __m512* part) {
  const int64_t rows = t.hs * t.G;
  for (int64_t j0 = 0; j0 < t.n; j0 += kBlock) {
    const int64_t count = std::min(kBlock, t.n - j0);
    for (int64_t i = 0; i < kBlock; ++i) {
      if (i >= count) {
        for (int64_t r = 0; r < rows; ++r) part[r * kBlock + i] = _mm512_setzero_ps();
        continue;
      }
      const float* kr = t.k + t.slot[j0 + i] * t.stride;
      for (int64_t h = 0; h < t.hs; ++h) {
        __m512 kv[NC];
        for (int c = 0; c < NC; ++c) kv[c] = _mm512_loadu_ps(kr + h * t.D + 16 * c);
        for (int64_t g = 0; g < t.G; ++g) {
          const float* q = t.q + (h * t.G + g) * t.D;
          __m512 s = _mm512_mul_ps(_mm512_loadu_ps(q), kv[0]);
          for (int c = 1; c < NC; ++c) s = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), kv[c], s);
          part[(h * t.G + g) * kBlock + i] = s;
        }
      }
    }
    const __mmask16 keep = count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
    const __m512 scale = _mm512_set1_ps(t.scale);
    for (int64_t r = 0; r < rows; ++r)
      _mm512_mask_storeu_ps(scores + r * t.n + j0, keep, _mm512_mul_ps(fold16(part + r * kBlock), scale));
  }
  float inv[kMaxRows];
  for (int64_t r = 0; r < rows; ++r) inv[r] = softmax_(scores + r * t.n, t.n, t.cap);
  std::fill(t.out, t.out + rows * t.D, 0.f);
  for (int64_t j = 0; j < t.n; ++j) {
    const float* vr = t.v + t.slot[j] * t.stride;
    for (int64_t h = 0; h < t.hs; ++h) {
      __m512 v[NC];
      for (int c = 0; c < NC; ++c) v[c] = _mm512_loadu_ps(vr + h * t.D + 16 * c);
      for (int64_t g = 0; g < t.G; ++g) {
        const int64_t r = h * t.G + g;
        const __m512 w = _mm512_set1_ps(scores[r * t.n + j]);
        float* o = t.out + r * t.D;
        for (int c = 0; c < NC; ++c)
          _mm512_storeu_ps(o + 16 * c, _mm512_fmadd_ps(w, v[c], _mm512_loadu_ps(o + 16 * c)));
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 s = _mm512_set1_ps(inv[r]);
    float* o = t.out + r * t.D;
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(o + 16 * c), s));
  }
}
#endif

template <int NC>  // D / 16 on the AVX-512 path; 0: the portable one
void run_task(const Task& t, float* scores, __m512_or_float* part) {
#ifdef __AVX512F__
  // A one-head task keeps its V sums in registers below: for few, short contexts that measured faster
  // than the key-order pass (16 against 23 us a layer for one request of 400 keys).
  if constexpr (NC > 0) if (t.hs > 1) return run_task_rows<NC>(t, scores, part);
#endif
  const int64_t span = t.hs * t.D;
  for (int64_t j0 = 0; j0 < t.n; j0 += kBlock) {
    const int64_t count = std::min(kBlock, t.n - j0);
    for (int64_t i = j0 + kBlock; i < std::min(t.n, j0 + 2 * kBlock); ++i)
      prefetch_row(t.k + t.slot[i] * t.stride, span * 4);
    for (int64_t h = 0; h < t.hs; ++h)
      for (int64_t g = 0; g < t.G; ++g) {
        const float* q = t.q + (h * t.G + g) * t.D;
        float* dst = scores + (h * t.G + g) * t.n + j0;
#ifdef __AVX512F__
        if constexpr (NC > 0) { dots16<NC>(t, q, h * t.D, j0, count, dst); continue; }
#endif
        dots_generic(t, q, h * t.D, j0, count, dst);
      }
  }
  float inv[64];  // G <= 64, checked by the caller
  for (int64_t h = 0; h < t.hs; ++h) {
    float* w = scores + h * t.G * t.n;
    for (int64_t g = 0; g < t.G; ++g) inv[g] = softmax_(w + g * t.n, t.n, t.cap);
    float* out = t.out + h * t.G * t.D;
#ifdef __AVX512F__
    if constexpr (NC > 0) { weighted_sums<NC>(t, w, h * t.D, inv, out); continue; }
#endif
    weighted_sums_generic(t, w, h * t.D, inv, out);
  }
}

using TaskFn = void (*)(const Task&, float*, __m512_or_float*);

TaskFn pick(int64_t D) {
#ifdef __AVX512F__
  switch (D) {
    case 16: return run_task<1>;
    case 32: return run_task<2>;
    case 48: return run_task<3>;
    case 64: return run_task<4>;
    case 80: return run_task<5>;
    case 96: return run_task<6>;
    case 128: return run_task<8>;
    default: break;
  }
#endif
  (void)D;
  return run_task<0>;
}
}  // namespace

torch::Tensor paged_decode(
    torch::Tensor q,        // [B, kv_heads, group, D] float32, contiguous
    torch::Tensor k_cache,  // [S, kv_heads, D] float32, contiguous
    torch::Tensor v_cache,  // [S, kv_heads, D]
    torch::Tensor slots,    // [B, L] int64: the first lengths[b] entries are the keys of request b
    torch::Tensor lengths,  // [B] int64
    double scale,
    double softcap) {       // <= 0: none
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
              v_cache.dtype() == torch::kFloat32, "float32 only, got ", q.dtype(), " and ", k_cache.dtype());
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && slots.is_contiguous(),
              "contiguous tensors only");
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  const int64_t L = slots.size(1);
  TORCH_CHECK(G <= 64, "at most 64 query heads per kv head, got ", G);
  TORCH_CHECK(H * G <= kMaxRows, "at most ", kMaxRows, " query heads, got ", H * G);
  TORCH_CHECK(slots.size(0) == B && lengths.numel() == B, "slots and lengths need ", B, " rows");
  const int64_t* lp = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= L, "request ", b, " reads ", lp[b], " keys of ", L);
  auto out = torch::empty_like(q);
  const int threads = at::get_num_threads();
  const int64_t hs = B >= 2 * threads ? H : 1;  // heads per task
  const int64_t parts = H / hs, tasks = B * parts;
  const TaskFn fn = pick(D);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> scores(static_cast<size_t>(hs * G * L));
    std::vector<__m512_or_float> part(static_cast<size_t>(hs * G * kBlock));
    for (int64_t task = next++; task < tasks; task = next++) {
      const int64_t b = task / parts, h0 = (task % parts) * hs;
      const Task t{
          q.data_ptr<float>() + (b * H + h0) * G * D,
          out.data_ptr<float>() + (b * H + h0) * G * D,
          k_cache.data_ptr<float>() + h0 * D,
          v_cache.data_ptr<float>() + h0 * D,
          slots.data_ptr<int64_t>() + b * L,
          lp[b], hs, G, D, H * D,
          static_cast<float>(scale), static_cast<float>(softcap)};
      fn(t, scores.data(), part.data());
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU, float32)");
}
