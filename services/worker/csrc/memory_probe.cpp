// The machine's memory read rate, as the roofline of a decode step (services/bench/roofline.py): a
// decode step must stream every weight and every context's KV once, so the best it can do is the rate
// at which this CPU's cores read memory they do not modify. Each thread reads its own contiguous
// part with the widest loads the compiler has (-O3 -march=native vectorizes the loop); the parts'
// XORs are returned, so no load can be optimized away.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <vector>

namespace {
uint64_t xor_words(const uint64_t* p, int64_t n) {
  // Eight lanes of independent XORs: one chain would bound the loop by its latency, not the loads.
  uint64_t acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) acc[j] ^= p[i + j];
  }
  for (; i < n; ++i) acc[0] ^= p[i];
  uint64_t out = 0;
  for (uint64_t a : acc) out ^= a;
  return out;
}
}  // namespace

// XOR of every 8-byte word of `buffer` (contiguous, a multiple of 8 bytes), read by all threads.
int64_t read_all(const at::Tensor& buffer) {
  TORCH_CHECK(buffer.is_contiguous() && buffer.device().is_cpu(), "buffer must be a contiguous CPU tensor");
  const int64_t bytes = buffer.numel() * buffer.element_size();
  TORCH_CHECK(bytes % 8 == 0, "buffer must hold a multiple of 8 bytes, got ", bytes);
  const auto* words = static_cast<const uint64_t*>(buffer.data_ptr());
  const int64_t n = bytes / 8;
  const int64_t threads = at::get_num_threads();
  std::vector<uint64_t> parts(threads, 0);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = n * t / threads, last = n * (t + 1) / threads;
      parts[t] = xor_words(words + first, last - first);
    }
  });
  uint64_t out = 0;
  for (uint64_t part : parts) out ^= part;
  return static_cast<int64_t>(out);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("read_all", &read_all, "XOR of every 8-byte word of a buffer, read by all threads",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
