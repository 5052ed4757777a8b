// Walsh-Hadamard rotations, shared by the int8 formats: the int8 KV rows (common/kv_int8.py: each block
// of B dims of a row times the normalized Sylvester Hadamard matrix H_B, B the largest of 64, 16, 4, 1
// that divides the row's size) and the int8 panels' groups of 32 k (panel_linear.cpp). H_B is its own
// inverse, so the same function rotates and rotates back. The KV writer (fused_ops.cpp, built with
// fast-math) and the attention kernels (paged_attention.cpp, built without) must store and read the
// bytes kv_int8.quantize stores, so the butterflies are pinned to the order torch computes them in.
#pragma once

#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <cstdint>

namespace hadamard {

// The butterfly stages of H_B on each block of B of x[0 .. d), unnormalized: stages h = 1, 2, .., B / 2,
// pairs (j, j + h) to (a + b, a - b); the empty asm statement after each stage keeps fast-math from
// reassociating sums across stages.
inline void butterflies(float* x, int64_t d, int64_t B) {
  for (int64_t h = 1; h < B; h *= 2) {
    for (int64_t i = 0; i < d; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    asm volatile("" : : "r"(x) : "memory");
  }
}

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
#ifdef __AVX512F__
// Registers the compiler must hold as they are between two stages (no instruction emitted): fast-math
// may not fold one stage's adds into the next's.
#define HADAMARD_PIN(...) asm("" : "+v"(__VA_ARGS__))

// One stage on a vector: a lane with bit h of its index clear adds its partner (index ^ h), one with
// it set subtracts itself from its partner: (a, b) -> (a + b, a - b), as the scalar loop. Both in one
// FMA, v times +1 or -1 (`sign`) plus the partner: the product is exact, so the one rounding of the
// sum is that of the add or the subtract, bit for bit (zeros' signs too), in two instructions where an
// add and a masked subtract took three.
inline __m512 stage(__m512 v, __m512 partner, __m512 sign) {
  __m512 out = _mm512_fmadd_ps(v, sign, partner);
  HADAMARD_PIN(out);
  return out;
}

// +1 in the lanes whose index has `upper`'s bit clear, -1 where it is set.
inline __m512 signs(__mmask16 upper) {
  return _mm512_mask_blend_ps(upper, _mm512_set1_ps(1.f), _mm512_set1_ps(-1.f));
}

// Stages h = 1, 2, 4, 8 of 16 values in one vector.
inline __m512 rotate16(__m512 v) {
  v = stage(v, _mm512_permute_ps(v, 0xB1), signs(0xAAAA));
  v = stage(v, _mm512_permute_ps(v, 0x4E), signs(0xCCCC));
  v = stage(v, _mm512_shuffle_f32x4(v, v, 0xB1), signs(0xF0F0));
  return stage(v, _mm512_shuffle_f32x4(v, v, 0x4E), signs(0xFF00));
}

// Stage h across two vectors of a block: (a, b) -> (a + b, a - b), lane by lane.
inline void pair(__m512& a, __m512& b) {
  const __m512 sum = _mm512_add_ps(a, b), difference = _mm512_sub_ps(a, b);
  a = sum;
  b = difference;
  HADAMARD_PIN(a);
  HADAMARD_PIN(b);
}
#endif

inline void rotate(float* x, int64_t d) {
  const int64_t B = block_size(d);
  if (B == 1) return;
#ifdef __AVX512F__
  // The same operations on vectors, stage after stage (what the scalar loops below do one value at a time).
  if (B == 64) {
    const __m512 norm = _mm512_set1_ps(0.125f);
    for (int64_t i = 0; i < d; i += 64) {
      __m512 v0 = rotate16(_mm512_loadu_ps(x + i)), v1 = rotate16(_mm512_loadu_ps(x + i + 16));
      __m512 v2 = rotate16(_mm512_loadu_ps(x + i + 32)), v3 = rotate16(_mm512_loadu_ps(x + i + 48));
      pair(v0, v1);  // h = 16
      pair(v2, v3);
      pair(v0, v2);  // h = 32
      pair(v1, v3);
      _mm512_storeu_ps(x + i, _mm512_mul_ps(v0, norm));
      _mm512_storeu_ps(x + i + 16, _mm512_mul_ps(v1, norm));
      _mm512_storeu_ps(x + i + 32, _mm512_mul_ps(v2, norm));
      _mm512_storeu_ps(x + i + 48, _mm512_mul_ps(v3, norm));
    }
    return;
  }
  if (B == 16) {
    for (int64_t i = 0; i < d; i += 16)
      _mm512_storeu_ps(x + i, _mm512_mul_ps(rotate16(_mm512_loadu_ps(x + i)), _mm512_set1_ps(0.25f)));
    return;
  }
#endif
  butterflies(x, d, B);
  const float norm = B == 64 ? 0.125f : B == 16 ? 0.25f : 0.5f;
  for (int64_t i = 0; i < d; ++i) x[i] *= norm;
  asm volatile("" : : "r"(x) : "memory");
}

}  // namespace hadamard
