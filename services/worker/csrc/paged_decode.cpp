// Paged attention for decode rows (one query token per request) on CPU.
//
// Reads each request's K/V rows straight from the paged pool through its slot list, so no gathered
// copy of the context is ever made: the context is read once per layer, which is what bounds decode
// speed on a CPU. One task per (request, kv head); the `group` query heads that share a kv head are
// computed together so each K/V row is loaded once.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cfloat>
#include <cmath>
#include <vector>

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

  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(G * L));
    std::vector<float> acc(static_cast<size_t>(G * D));
    std::vector<float> maxs(static_cast<size_t>(G));
    std::vector<float> sums(static_cast<size_t>(G));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / H, h = task % H;
      const int64_t n = lp[b];
      const float* qrow = qp + (b * H + h) * G * D;
      const int64_t* srow = sp + b * L;
      // Built with -ffast-math (so exp vectorises): every value here stays finite, starting with this.
      std::fill(maxs.begin(), maxs.end(), -FLT_MAX);
      for (int64_t j = 0; j < n; ++j) {
        const float* krow = kp + (srow[j] * H + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qrow + g * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * krow[d];
          dot *= fscale;
          if (cap > 0.f) dot = std::tanh(dot / cap) * cap;
          scores[g * L + j] = dot;
          if (dot > maxs[g]) maxs[g] = dot;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g = 0; g < G; ++g) {
        float* row = scores.data() + g * L;
        const float m = maxs[g];
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) {
          row[j] = std::exp(row[j] - m);
          sum += row[j];
        }
        sums[g] = sum;
      }
      for (int64_t j = 0; j < n; ++j) {
        const float* vrow = vp + (srow[j] * H + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float w = scores[g * L + j];
          float* a = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += w * vrow[d];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* o = op + ((b * H + h) * G + g) * D;
        const float inv = 1.f / sums[g];
        for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d] * inv;
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU, float32)");
}
