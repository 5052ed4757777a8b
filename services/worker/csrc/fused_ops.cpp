// The element-wise parts of a Llama decoder layer, one pass each over rows of the packed batch.
//
// In eager torch, RMSNorm is six kernels (cast, square, mean, add, rsqrt, two products), rotary
// embedding eight per tensor (two slices, neg, cat, three products, add), each reading and writing
// the whole activation: a small model's norms and rotary then take a visible share of a step. Here each
// is one loop over the data, parallel over rows (SiLU-times-up is written by the gate|up product
// itself: panel_linear.cpp). Results equal torch's up to fp32 summation order.
// Only the headers used: <torch/extension.h> (all of libtorch's C++ API) tripled the compile time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/utils/pybind.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "hadamard.h"

namespace {
void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dtype() == at::kFloat && t.dim() == 2 && t.stride(1) == 1, name,
              " must be float32 [rows, width] with contiguous rows, got ", t.sizes(), " ", t.dtype());
}

inline void normalize_row(const float* x, const float* w, float* y, int64_t h, float eps) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < h; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) y[i] = w[i] * (x[i] * r);
}
}  // namespace

// y = x / rms(x) * weight, per row.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must be [", x.size(1), "]");
  auto y = at::empty({x.size(0), x.size(1)}, x.options());
  const int64_t h = x.size(1), sx = x.stride(0);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, x.size(0), 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) normalize_row(xp + t * sx, wp, yp + t * h, h, eps);
  });
  return y;
}

// residual += x (in place); returns rms_norm(residual): a layer's skip connection and the next norm.
at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes(), "residual must be contiguous ",
              x.sizes());
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must be [", x.size(1), "]");
  auto y = at::empty_like(residual);
  const int64_t h = x.size(1), sx = x.stride(0);
  const float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, x.size(0), 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* r = rp + t * h;
      const float* xr = xp + t * sx;
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) r[i] += xr[i];
      normalize_row(r, wp, yp + t * h, h, eps);
    }
  });
  return y;
}

namespace {
// Each packed row's position, checked against the rotary table.
const int64_t* checked_positions(const at::Tensor& positions, const at::Tensor& x, const at::Tensor& cos,
                                 const at::Tensor& sin, int64_t num_heads, int64_t head_dim) {
  TORCH_CHECK(num_heads * head_dim <= x.size(1) && head_dim % 2 == 0, "bad rotary heads ", num_heads,
              " x ", head_dim, " for rows of ", x.size(1));
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == head_dim &&
                  sin.sizes() == cos.sizes(), "cos/sin must be [positions, ", head_dim, "]");
  TORCH_CHECK(positions.dtype() == at::kLong && positions.is_contiguous() && positions.numel() == x.size(0),
              "positions must be contiguous int64 [", x.size(0), "]");
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < x.size(0); ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < cos.size(0), "position ", pp[t], " outside the rotary table of ", cos.size(0));
  return pp;
}

// Rotate-half convention: out[i] = x[i] cos[i] - x[i + D/2] sin[i],
// out[i + D/2] = x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2], on `num_heads` heads of one row.
inline void rotate_row(float* row, int64_t num_heads, int64_t head_dim, const float* c, const float* s) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < num_heads; ++h) {
    float* a = row + h * head_dim;
    float* b = a + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = a[i], x2 = b[i];
      a[i] = x1 * c[i] - x2 * s[i];
      b[i] = x2 * c[i + half] + x1 * s[i + half];
    }
  }
}
}  // namespace

namespace {
constexpr int64_t kScaleBytes = 4;  // an int8 row's float32 scale, after its values (common/kv_int8.py)

// Each store_kv writes `heads` rows of `d` values to one slot.
inline void store_kv(const float* src, int64_t heads, int64_t d, float* dst) { std::copy(src, src + heads * d, dst); }

// Rounded to nearest even, as torch's .to(torch.bfloat16): a page holds the same bytes whichever path
// wrote it.
inline void store_kv(const float* src, int64_t heads, int64_t d, c10::BFloat16* dst) {
  for (int64_t i = 0; i < heads * d; ++i) dst[i] = c10::BFloat16(src[i]);
}

// f as a float16's bits, rounded to nearest even as torch's .to(torch.float16): past 65504 infinite,
// below 2^-14 subnormal. F16C converts in one instruction; elsewhere the bits are worked out in
// integers, where c10::Half's float tricks for the same would be rewritten by -ffast-math (a value past
// the range became NaN instead of infinite).
inline uint16_t half_bits(float f) {
#ifdef __F16C__
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  const uint32_t x = std::bit_cast<uint32_t>(f), a = x & 0x7FFFFFFFu;
  const auto sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  if (a > 0x7F800000u) return sign | 0x7E00u;  // NaN
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // 65520 and past: ties 65504 (odd) and infinity (even)
  if (a >= 0x38800000u) {  // normal: the exponent rebased, 13 bits of the mantissa rounded off
    const uint32_t m = a - 0x38000000u;
    return sign | static_cast<uint16_t>((m + 0x0FFFu + ((m >> 13) & 1u)) >> 13);
  }
  if (a <= 0x33000000u) return sign;  // at most 2^-25, half the least subnormal: zero (a tie: even)
  const uint32_t shift = 126 - (a >> 23), mantissa = (a & 0x7FFFFFu) | 0x800000u;  // shift 14 .. 24
  const uint32_t q = mantissa >> shift, rest = mantissa & ((1u << shift) - 1), half = 1u << (shift - 1);
  return sign | static_cast<uint16_t>(q + (rest > half || (rest == half && (q & 1u))));
#endif
}

inline void store_kv(const float* src, int64_t heads, int64_t d, c10::Half* dst) {
  for (int64_t i = 0; i < heads * d; ++i) dst[i].x = half_bits(src[i]);
}

// The int8 format of common/kv_int8.py, in the float32 operations of its `quantize` in the same
// order, so that both writers store the same bytes: per row, y = the row rotated block by block by
// H_B (hadamard.h), scale = max|y| * (1 / 127), values round-half-even(y * (1 / scale)) clamped to
// [-127, 127] (0 for a zero row), then the scale. `d` is at most kMaxInt8HeadDim (checked by the caller).
constexpr int64_t kMaxInt8HeadDim = 1024;

#ifdef __AVX512F__
// The steps below on one row of 16 NV values (NV a multiple of 4: blocks of 64), held in registers
// from the load to the int8 store: through a buffer, each row was copied, stored rotated and read back
// twice. The rotation is hadamard::rotate's for B = 64; max|y| is exact in any order; nearbyint is
// vroundscale in the current rounding mode.
template <int NV>
inline void store_int8_row(const float* src, int8_t* row) {
  static_assert(NV % 4 == 0, "blocks of 64");
  __m512 y[NV];
  const __m512 norm = _mm512_set1_ps(0.125f);
  for (int i = 0; i < NV; i += 4) {
    for (int c = 0; c < 4; ++c) y[i + c] = hadamard::rotate16(_mm512_loadu_ps(src + 16 * (i + c)));
    hadamard::pair(y[i], y[i + 1]);  // h = 16
    hadamard::pair(y[i + 2], y[i + 3]);
    hadamard::pair(y[i], y[i + 2]);  // h = 32
    hadamard::pair(y[i + 1], y[i + 3]);
    for (int c = 0; c < 4; ++c) {
      y[i + c] = _mm512_mul_ps(y[i + c], norm);
      HADAMARD_PIN(y[i + c]);  // the rotated row as kv_int8 rounds it: not folded into 1 / scale
    }
  }
  __m512 m = _mm512_setzero_ps();
  for (int c = 0; c < NV; ++c) m = _mm512_max_ps(m, _mm512_abs_ps(y[c]));
  float scale = _mm512_reduce_max_ps(m) * (1.0f / 127.0f);
  asm volatile("" : "+m"(scale));
  const __m512 inv = _mm512_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
  const __m512 low = _mm512_set1_ps(-127.f), high = _mm512_set1_ps(127.f);
  for (int c = 0; c < NV; ++c) {
    const __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(y[c], inv), _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
    const __m512i v = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(q, low), high));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(row + 16 * c), _mm512_cvtsepi32_epi8(v));
  }
  std::memcpy(row + 16 * NV, &scale, sizeof scale);
}
#endif

inline void store_kv(const float* src, int64_t heads, int64_t d, int8_t* dst) {
#ifdef __AVX512F__
  if (d == 64 || d == 128) {
    for (int64_t h = 0; h < heads; ++h) {
      int8_t* row = dst + h * (d + kScaleBytes);
      if (d == 64) store_int8_row<4>(src + h * d, row);
      else store_int8_row<8>(src + h * d, row);
    }
    return;
  }
#endif
  alignas(64) float y[kMaxInt8HeadDim];
  for (int64_t h = 0; h < heads; ++h) {
    std::copy(src + h * d, src + (h + 1) * d, y);
    hadamard::rotate(y, d);
    int8_t* row = dst + h * (d + kScaleBytes);
    float m = 0.f;
    for (int64_t i = 0; i < d; ++i) m = std::max(m, std::abs(y[i]));
    float scale = m * (1.0f / 127.0f);
    // Fast-math may fold 1 / (m * c) into another expression with another rounding: the scale is
    // pinned here as it is stored.
    asm volatile("" : "+m"(scale));
    const float inv = scale > 0.f ? 1.f / scale : 0.f;
    for (int64_t i = 0; i < d; ++i)
      row[i] = static_cast<int8_t>(std::clamp(std::nearbyint(y[i] * inv), -127.f, 127.f));
    std::memcpy(row + d, &scale, sizeof scale);
  }
}

template <typename T>
void rotate_and_store(at::Tensor& qkv, int64_t q_heads, int64_t kv_heads, int64_t head_dim, const at::Tensor& cos,
                      const at::Tensor& sin, const int64_t* pp, at::Tensor& k_cache, at::Tensor& v_cache,
                      const int64_t* sl) {
  // A slot holds kv_heads rows of the cache's last dimension (head_dim, and an int8 row's scale).
  const int64_t sx = qkv.stride(0), width = kv_heads * head_dim, k_off = q_heads * head_dim;
  const int64_t slot_elems = kv_heads * k_cache.size(2);
  float* xp = qkv.data_ptr<float>();
  T* kp = k_cache.data_ptr<T>();
  T* vp = v_cache.data_ptr<T>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, qkv.size(0), 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = xp + t * sx;
      rotate_row(row, q_heads + kv_heads, head_dim, cp + pp[t] * head_dim, sp + pp[t] * head_dim);
      store_kv(row + k_off, kv_heads, head_dim, kp + sl[t] * slot_elems);
      store_kv(row + k_off + width, kv_heads, head_dim, vp + sl[t] * slot_elems);
    }
  });
}
}  // namespace

// Rotary embedding, in place, on the q and k heads of each row of a fused q|k|v projection
// [rows, (q_heads + 2 kv_heads) x D], with cos/sin [max_positions, D] read at each row's position;
// then the row's k heads (rotated) and v heads written to its KV slot `slots[t]` of k_cache/v_cache
// [S, kv_heads, D] float32, bfloat16 or float16, or [S, kv_heads, D + 4] int8 (values and scale, quantized
// here as common/kv_int8.py does): one pass while the row is in cache, where index_copy_ after
// the rotary took 70 us a layer for a few dozen rows. Every position and slot is checked before
// anything is written.
void rotary_store_kv_(at::Tensor qkv, int64_t q_heads, int64_t kv_heads, int64_t head_dim, at::Tensor cos,
                      at::Tensor sin, at::Tensor positions, at::Tensor k_cache, at::Tensor v_cache,
                      at::Tensor slots) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(qkv.size(1) == (q_heads + 2 * kv_heads) * head_dim, "qkv rows of ", qkv.size(1), " are not ",
              q_heads, " + 2 x ", kv_heads, " heads of ", head_dim);
  const int64_t* pp = checked_positions(positions, qkv, cos, sin, q_heads + kv_heads, head_dim);
  const bool int8_kv = k_cache.dtype() == at::kChar;
  const int64_t row = head_dim + (int8_kv ? kScaleBytes : 0);
  TORCH_CHECK(!int8_kv || head_dim <= kMaxInt8HeadDim, "int8 pools take head sizes up to ", kMaxInt8HeadDim,
              ", got ", head_dim);
  const at::ScalarType kv_type = k_cache.scalar_type();
  TORCH_CHECK((kv_type == at::kFloat || kv_type == at::kBFloat16 || kv_type == at::kHalf || int8_kv) &&
                  v_cache.dtype() == k_cache.dtype() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.dim() == 3 && k_cache.size(1) == kv_heads &&
                  k_cache.size(2) == row,
              "caches must be contiguous float32, bfloat16 or float16 [slots, ", kv_heads, ", ", head_dim,
              "] or int8 [slots, ", kv_heads, ", ", head_dim + kScaleBytes, "], got ", k_cache.sizes(), " ",
              k_cache.dtype(), " and ", v_cache.sizes(), " ", v_cache.dtype());
  TORCH_CHECK(slots.dtype() == at::kLong && slots.is_contiguous() && slots.numel() == qkv.size(0),
              "slots must be contiguous int64 [", qkv.size(0), "]");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t S = k_cache.size(0);
  for (int64_t t = 0; t < qkv.size(0); ++t) TORCH_CHECK(sl[t] >= 0 && sl[t] < S, "slot ", sl[t], " outside ", S);
  if (int8_kv)
    rotate_and_store<int8_t>(qkv, q_heads, kv_heads, head_dim, cos, sin, pp, k_cache, v_cache, sl);
  else if (kv_type == at::kBFloat16)
    rotate_and_store<c10::BFloat16>(qkv, q_heads, kv_heads, head_dim, cos, sin, pp, k_cache, v_cache, sl);
  else if (kv_type == at::kHalf)
    rotate_and_store<c10::Half>(qkv, q_heads, kv_heads, head_dim, cos, sin, pp, k_cache, v_cache, sl);
  else
    rotate_and_store<float>(qkv, q_heads, kv_heads, head_dim, cos, sin, pp, k_cache, v_cache, sl);
}

namespace {
// Index of the first maximum of x[0 .. n), or of the first NaN if there is one (torch.argmax's rule).
// NaN is tested on the bits, which -ffast-math cannot assume away.
int64_t argmax_row(const float* x, int64_t n) {
  const auto is_nan = [](float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    return (bits & 0x7fffffffu) > 0x7f800000u;
  };
  int64_t i = 0;
  float m = -INFINITY;
#ifdef __AVX512F__
  __m512 mv = _mm512_set1_ps(-INFINITY);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf_bits = _mm512_set1_epi32(0x7f800000);
  __mmask16 nan = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), abs_mask), inf_bits);
    mv = _mm512_max_ps(mv, v);
  }
  if (nan != 0) {
    for (int64_t j = 0; j < n; ++j)
      if (is_nan(x[j])) return j;
  }
  m = _mm512_reduce_max_ps(mv);
#endif
  for (int64_t j = i; j < n; ++j) {
    if (is_nan(x[j])) return j;
    m = std::max(m, x[j]);
  }
  for (int64_t j = 0; j < n; ++j)
    if (x[j] == m) return j;
  return 0;  // n == 0 is refused by the caller
}
}  // namespace

// argmax over each row of x [rows, n] -> int64 [rows], equal to torch's x.argmax(-1) (first maximum;
// a NaN wins), one vector pass a row: torch's own is a scalar pass, and it was a greedy step's whole
// sampling time.
at::Tensor argmax_rows(at::Tensor x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) > 0, "rows of no values have no argmax");
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t n = x.size(1), sx = x.stride(0);
  at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) op[t] = argmax_row(xp + t * sx, n);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL: the host plans the next step while a forward runs (async batching).
  using nogil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("argmax_rows", &argmax_rows, "x.argmax(-1) for float32 rows", nogil{});
  m.def("rms_norm", &rms_norm, "x / rms(x) * weight, per row", nogil{});
  m.def("add_rms_norm", &add_rms_norm, "residual += x; rms_norm(residual)", nogil{});
  m.def("rotary_store_kv_", &rotary_store_kv_, "rotary on q|k, then k and v written to their KV slots", nogil{});
}
