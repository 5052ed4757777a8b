// The rotation of the int8 KV format (common/kv_int8.py): each block of B dims of a row times the
// normalized Sylvester Hadamard matrix H_B, B the largest of 64, 16, 4, 1 that divides the row's
// size. H_B is its own inverse, so the same function rotates and rotates back. Shared by the writer
// (fused_ops.cpp, built with fast-math) and the attention kernels (paged_attention.cpp, built
// without): the writer must store the bytes kv_int8.quantize stores, so the butterflies are pinned
// to the order torch computes them in.
#pragma once

#include <cstdint>

namespace kv_hadamard {

// B for rows of d values.
inline int64_t block_size(int64_t d) {
  for (const int64_t b : {64, 16, 4})
    if (d % b == 0) return b;
  return 1;
}

// x[0 .. d) times H_B block by block, in place: butterfly stages h = 1, 2, .., B / 2 (pairs (i, i + h)
// to (a + b, a - b)), then times 1 / sqrt(B), exact as B is a power of 4. The empty asm statements
// after each stage make the compiler store the stage and read it back, so fast-math can neither
// reassociate sums across stages nor fold the final product into them: every value gets
// kv_int8.hadamard's float32 operations in its order.
inline void rotate(float* x, int64_t d) {
  const int64_t B = block_size(d);
  if (B == 1) return;
  for (int64_t h = 1; h < B; h *= 2) {
    for (int64_t i = 0; i < d; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    asm volatile("" : : "r"(x) : "memory");
  }
  const float norm = B == 64 ? 0.125f : B == 16 ? 0.25f : 0.5f;
  for (int64_t i = 0; i < d; ++i) x[i] *= norm;
  asm volatile("" : : "r"(x) : "memory");
}

}  // namespace kv_hadamard
