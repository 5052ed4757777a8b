// Paged attention for decode rows (one query token per request) on CPU.
//
// Reads each request's K/V rows straight from the paged pool through its slot list, so no gathered
// copy of the context is ever made: the context is read once per layer, which is what bounds decode
// speed on a CPU. A task covers one request and a range of its kv heads: all heads when there are
// enough requests to keep every thread busy (a token's K or V row for all heads is one contiguous
// read), one head each otherwise (so a lone long request still uses every core). The `group` query
// heads sharing a kv head are computed together so each K/V row is loaded once. Pages are scattered
// in the pool, which defeats the hardware prefetcher at every page boundary: rows a few tokens ahead
// are prefetched by hand (measured: 1.4-2x faster on 38 requests x 350 tokens than without).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cfloat>
#include <cmath>
#include <vector>

namespace {
constexpr int64_t kPrefetchTokens = 8;

inline void prefetch_row(const float* row, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(p + c);
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
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous only");
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  const int64_t L = slots.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const float cap = static_cast<float>(softcap);
  // Heads per task: all of them, unless that leaves threads idle.
  const int64_t hs = B >= 2 * at::get_num_threads() ? H : 1;
  const int64_t parts = H / hs;

  at::parallel_for(0, B * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(hs * G * L));
    std::vector<float> acc(static_cast<size_t>(hs * G * D));
    std::vector<float> maxs(static_cast<size_t>(hs * G));
    std::vector<float> sums(static_cast<size_t>(hs * G));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / parts, h0 = (task % parts) * hs;
      const int64_t n = lp[b];
      const int64_t* srow = sp + b * L;
      const int64_t span = hs * D;  // floats of one token's row that this task reads
      // Built with -ffast-math (so exp vectorises): every value here stays finite, starting with this.
      std::fill(maxs.begin(), maxs.end(), -FLT_MAX);
      for (int64_t j = 0; j < n; ++j) {
        if (j + kPrefetchTokens < n) prefetch_row(kp + (srow[j + kPrefetchTokens] * H + h0) * D, span * 4);
        const float* krow = kp + (srow[j] * H + h0) * D;
        for (int64_t h = 0; h < hs; ++h) {
          const float* kh = krow + h * D;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qp + ((b * H + h0 + h) * G + g) * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * kh[d];
            dot *= fscale;
            if (cap > 0.f) dot = std::tanh(dot / cap) * cap;
            const int64_t r = h * G + g;
            scores[r * L + j] = dot;
            if (dot > maxs[r]) maxs[r] = dot;
          }
        }
      }
      for (int64_t r = 0; r < hs * G; ++r) {
        float* row = scores.data() + r * L;
        const float m = maxs[r];
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) {
          row[j] = std::exp(row[j] - m);
          sum += row[j];
        }
        sums[r] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < n; ++j) {
        if (j + kPrefetchTokens < n) prefetch_row(vp + (srow[j + kPrefetchTokens] * H + h0) * D, span * 4);
        const float* vrow = vp + (srow[j] * H + h0) * D;
        for (int64_t h = 0; h < hs; ++h) {
          const float* vh = vrow + h * D;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t r = h * G + g;
            const float w = scores[r * L + j];
            float* a = acc.data() + r * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += w * vh[d];
          }
        }
      }
      for (int64_t r = 0; r < hs * G; ++r) {
        float* o = op + ((b * H + h0) * G + r) * D;
        const float inv = 1.f / sums[r];
        for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU, float32)");
}
