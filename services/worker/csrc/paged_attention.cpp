// Paged attention on CPU, reading K/V straight from the paged pool through each request's slot list:
// no gathered copy of any context and no mask is ever built. The pool holds float32, bfloat16, float16
// or int8 (the element type T of every loop that reads it); queries, outputs and all arithmetic are
// float32. A bfloat16 is the high half of a float32's bits and a float16 converts to float32 exactly
// (F16C's vcvtph2ps), so a 16-bit element is widened exactly as it is loaded, and with the same
// arithmetic in the same order a 16-bit pool gives, bit for bit, the float32 kernel's output on its
// upcast copy, from half the bytes.
//
// An int8 row (common/kv_int8.py) is its head's values and then their float32 scale: a head's row is
// D + 4 elements apart from the next (`hd`). The values are widened to float32 as they are loaded, as
// a bfloat16's are, and the scale enters once per row: q.(s k) = s (q.k) multiplies each key's
// scores, and w (s v) = (w s) v each key's softmax weights, so every loop that reads values runs
// unchanged on the widened integers. The values are those of the row rotated by a block Hadamard
// matrix H (hadamard.h), which is orthonormal and its own inverse: the kernels rotate each query
// head by H before the dots, (H q).(H k) = q.k, and each output head back by H at the end,
// sum p (H v) = H sum p v, all in hadamard::rotate's steps (rotated_queries, rotate_out_rows).
//
// Decode rows (paged_decode): one query token per request. The context is read once per layer, from
// memory (a step's contexts of 30 layers are far larger than the caches), which is what bounds decode
// attention.
//
// Work is split into tasks of one request and a range of its kv heads: all heads when there are
// enough requests to keep every thread busy (a token's K or V row for all heads is one contiguous
// read), one head each otherwise (so a lone long request still uses every core). Contexts differ in
// length by 10x within a batch, so threads take tasks from a shared counter instead of fixed shares.
//
// With AVX-512 and a head size of 16..128, query-key dots are computed 16 keys at a time with the
// keys across the lanes (the block's K rows transposed, see below); each K row is loaded once for all
// the queries of its head, and the values of up to four queries of a head are accumulated in
// registers from one load of each V row. Pages are scattered in the pool, which defeats the hardware
// prefetcher at every page boundary, so the rows ahead are prefetched by hand: a few lines at a time
// as the reads advance (`Pump`).
//
// With AVX2 (and no AVX-512) and a head size of 32, 64, 96 or 128, a block's K rows of a head are
// transposed once into an L1 buffer, keys across the lanes, whose dots then run 24 keys (three chains)
// per query row; the values of up to three queries of a head are accumulated in 12 registers, a
// 32-float slice of the head at a time. These loops prefetch for themselves, a line of the row 16 keys
// on for each line they read, instead of the pump (kPumped). The portable loops that serve elsewhere
// leave a decode step's attention well behind the rate its K/V reads allow.
//
// Prefill chunks (paged_prefill; AVX-512, or AVX2 for head sizes 32-128 by 32; on the portable path
// each query token runs as a decode row): several query tokens per request, each attending causally
// (and within a sliding window, if any) to the keys before it.
//
// The parts: paged_common.h (the pool's element types, the queries of an int8 pool and the softmax
// pieces both kernels share, with the rule that holds them to one result), paged_decode.h,
// paged_prefill.h; this file, the entry points that check their tensors and hand out the tasks.

// Only the headers used: <torch/extension.h> (all of libtorch's C++ API) tripled the compile time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <vector>

#include "paged_common.h"
#include "paged_decode.h"
#include "paged_prefill.h"

namespace {
// The pools' element type, checked: both float32, both bfloat16, both float16 or both int8,
// `[S, kv_heads, row]` with rows of D values (and, in int8, their scale). Anything else is refused.
at::ScalarType pool_type(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t D) {
  const at::ScalarType k = k_cache.scalar_type(), v = v_cache.scalar_type();
  TORCH_CHECK(k == v && (k == at::kFloat || k == at::kBFloat16 || k == at::kHalf || k == at::kChar),
              "k_cache and v_cache must both be float32, both bfloat16, both float16 or both int8, got ", k,
              " and ", v);
  const int64_t row = D + (k == at::kChar ? kScaleElems<i8> : 0);
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == row,
              "k_cache and v_cache must be [slots, kv_heads, ", row, "] for head size ", D, " in ", k, ", got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  return k;
}

// `run.template operator()<T>()` for the pools' element type.
template <class Run>
void for_pool_type(at::ScalarType type, Run&& run) {
  if (type == at::kBFloat16) run.template operator()<bf16>();
  else if (type == at::kHalf) run.template operator()<f16>();
  else if (type == at::kChar) run.template operator()<i8>();
  else run.template operator()<float>();
}

// The pool's data, of the element type the kernel was picked for.
template <class T>
const T* pool_data(const at::Tensor& cache) {
  return static_cast<const T*>(cache.const_data_ptr());
}

// An int8 pool holds each K and V row rotated by H_B block by block (common/kv_int8.py,
// hadamard.h). The kernels read those rows as stored and rotate the queries instead, once before
// the dots, (H q).(H k) = q.k, and each output head back once at the end, sum p (H v) = H sum p v:
// D log B additions a head, where rotating the keys back would cost that for every key read. The
// decode kernel and the portable prefill go through these two helpers; the vector prefills rotate each
// query row as they lay it out and each output row as they store it, in the same steps (query_row,
// rotate_head), so a row still gets the same bits from either kernel. Passes of their own over the
// chunk's queries before the tasks (a copy) and over its outputs after them (each row back from
// memory) had made the int8 prefill slower than the bfloat16 one.

// q [T, H, D] (any token stride) as a new contiguous tensor with every head rotated and rounded.
at::Tensor rotated_queries(const at::Tensor& q) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  at::Tensor r = at::empty({T, H, D}, q.options());
  const float* src = q.data_ptr<float>();
  float* dst = r.data_ptr<float>();
  const int64_t sq = q.stride(0);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::copy(src + t * sq, src + t * sq + H * D, dst + t * H * D);
      for (int64_t h = 0; h < H; ++h) {
        hadamard::rotate(dst + (t * H + h) * D, D);
        round_query(dst + (t * H + h) * D, D);
      }
    }
  });
  return r;
}

// Rows `rows[0 .. n)` of out [T, H, D] rotated back, head by head, in place.
void rotate_out_rows(at::Tensor& out, const std::vector<int64_t>& rows) {
  const int64_t H = out.size(1), D = out.size(2), so = out.stride(0);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(rows.size()), 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t h = 0; h < H; ++h) hadamard::rotate(op + rows[i] * so + h * D, D);
  });
}
}  // namespace

void paged_decode(
    at::Tensor q,        // [T, H, D] float32: heads contiguous, any token stride
    at::Tensor out,      // [T, H, D]: rows[b] is written for each request, the others left alone
    at::Tensor rows,     // [B] int64: the packed row of each request's query token
    at::Tensor k_cache,  // [S, kv_heads, D] float32, bfloat16 or float16, or [S, kv_heads, D + 4] int8;
                         // contiguous
    at::Tensor v_cache,  // k_cache's dtype and shape
    at::Tensor slots,    // [B, L] int64: the first lengths[b] entries are the keys of request b
    at::Tensor lengths,  // [B] int64
    double scale,
    double softcap) {       // <= 0: none
  TORCH_CHECK(q.dtype() == at::kFloat && out.dtype() == at::kFloat, "q and out must be float32, got ",
              q.scalar_type(), " and ", out.scalar_type());
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) && out.sizes() == q.sizes() &&
              out.stride(2) == 1 && out.stride(1) == out.size(2), "q and out must be [T, H, D] with contiguous heads");
  const at::ScalarType kv_type = pool_type(k_cache, v_cache, q.size(2));
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && slots.is_contiguous() &&
              rows.is_contiguous() && lengths.is_contiguous(), "contiguous caches and index tensors only");
  const int64_t T = q.size(0), D = q.size(2), H = k_cache.size(1);
  TORCH_CHECK(q.size(1) % H == 0, q.size(1), " query heads do not share ", H, " kv heads");
  const int64_t G = q.size(1) / H, B = slots.size(0), L = slots.size(1);
  TORCH_CHECK(H * G <= kMaxRows, "at most ", kMaxRows, " query heads, got ", H * G);
  TORCH_CHECK(rows.numel() == B && lengths.numel() == B, "rows and lengths need ", B, " entries");
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= L && rp[b] >= 0 && rp[b] < T, "request ", b, " in row ", rp[b], " of ", T,
                " reads ", lp[b], " keys of ", L);
  const bool rotated = kv_type == at::kChar;
  const at::Tensor qk = rotated ? rotated_queries(q) : q;  // the queries the dots read
  const int threads = at::get_num_threads();
  const int64_t hs = B >= 2 * threads ? H : 1;  // heads per task
  const int64_t parts = H / hs, tasks = B * parts;
  auto run = [&]<class T>() {
    const TaskFn<T> fn = pick<T>(D);
    const int64_t hd = D + kScaleElems<T>;
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      // + run_task's scaled queries and their integer words
      std::vector<float> scores(static_cast<size_t>(hs * G * (L + D) + QueryWords::floats(hs * G, D)));
      for (int64_t task = next++; task < tasks; task = next++) {
        const int64_t b = task / parts, h0 = (task % parts) * hs;
        const Task<T> t{
            qk.data_ptr<float>() + rp[b] * qk.stride(0) + h0 * G * D,
            out.data_ptr<float>() + rp[b] * out.stride(0) + h0 * G * D,
            pool_data<T>(k_cache) + h0 * hd,
            pool_data<T>(v_cache) + h0 * hd,
            slots.data_ptr<int64_t>() + b * L,
            lp[b], hs, G, D, hd, H * hd,
            static_cast<float>(scale), static_cast<float>(softcap)};
        fn(t, scores.data());
      }
    });
  };
  for_pool_type(kv_type, run);
  if (rotated) rotate_out_rows(out, std::vector<int64_t>(rp, rp + B));
}


// Every element type has the same head sizes.
bool prefill_supports(int64_t head_dim) { return kPrefillByRows || pick_prefill<float>(head_dim) != nullptr; }

void paged_prefill(
    at::Tensor q,           // [T, H, D] float32: heads contiguous, any token stride
    at::Tensor out,         // [T, H, D]: the requests' rows are written, the others left alone
    at::Tensor k_cache,     // [S, kv_heads, D] float32, bfloat16 or float16, or [S, kv_heads, D + 4] int8;
                            // contiguous
    at::Tensor v_cache,     // k_cache's dtype and shape
    at::Tensor first_rows,  // [B] int64: packed row of each request's first query token
    at::Tensor num_queries, // [B]
    at::Tensor slots,       // [B, L]: the first lengths[b] are the keys request b's chunk reads
    at::Tensor lengths,     // [B]: its last query token sees them all, each earlier one fewer
    double scale,
    double softcap,            // <= 0: none
    int64_t window) {          // > 0: a query sees only its last `window` keys
  TORCH_CHECK(q.dtype() == at::kFloat && out.dtype() == at::kFloat, "q and out must be float32, got ",
              q.scalar_type(), " and ", out.scalar_type());
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) && out.sizes() == q.sizes() &&
              out.stride(2) == 1 && out.stride(1) == out.size(2), "q and out must be [T, H, D] with contiguous heads");
  const at::ScalarType kv_type = pool_type(k_cache, v_cache, q.size(2));
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && slots.is_contiguous() &&
              first_rows.is_contiguous() && num_queries.is_contiguous() && lengths.is_contiguous(),
              "contiguous caches and index tensors only");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KV = k_cache.size(1);
  TORCH_CHECK(prefill_supports(D), "no prefill kernel for head size ", D, " on this CPU");
  TORCH_CHECK(H % KV == 0, H, " query heads do not share ", KV, " kv heads");
  const int64_t G = H / KV, B = slots.size(0), L = slots.size(1);
  TORCH_CHECK(first_rows.numel() == B && num_queries.numel() == B && lengths.numel() == B,
              "first_rows, num_queries and lengths need ", B, " entries");
  const int64_t* fr = first_rows.data_ptr<int64_t>();
  const int64_t* nq = num_queries.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  struct Block { int64_t b, h, q0; };
  std::vector<Block> blocks;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(nq[b] >= 1 && nq[b] <= lp[b] && lp[b] <= L && fr[b] >= 0 && fr[b] + nq[b] <= T,
                "request ", b, ": ", nq[b], " queries from row ", fr[b], " over ", lp[b], " of ", L, " keys");
    for (int64_t q0 = (nq[b] - 1) / kQueryBlock * kQueryBlock; q0 >= 0; q0 -= kQueryBlock)
      for (int64_t h = 0; h < KV; ++h) blocks.push_back({b, h, q0});
  }
  const bool rotated = kv_type == at::kChar;
  if constexpr (kPrefillByRows) {
    const at::Tensor qk = rotated ? rotated_queries(q) : q;  // the queries the dots read
    TORCH_CHECK(H <= kMaxRows, "at most ", kMaxRows, " query heads, got ", H);
    int64_t tokens = 0;
    for (int64_t b = 0; b < B; ++b) tokens += nq[b];
    std::vector<std::pair<int64_t, int64_t>> rows;  // (request, query token), most keys first
    rows.reserve(static_cast<size_t>(tokens));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t x = nq[b] - 1; x >= 0; --x) rows.emplace_back(b, x);
    auto run = [&]<class T>() {
      const TaskFn<T> fn = pick<T>(D);
      const int64_t hd = D + kScaleElems<T>;
      std::atomic<int64_t> next{0};
      at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
        std::vector<float> scores(static_cast<size_t>(H * (L + D)));  // as paged_decode's
        for (int64_t i = next++; i < tokens; i = next++) {
          const auto [b, x] = rows[i];
          const int64_t jhi = lp[b] - nq[b] + x;
          const int64_t jlo = window > 0 ? std::max<int64_t>(0, jhi - window + 1) : 0;
          const int64_t row = fr[b] + x;
          const Task<T> t{qk.data_ptr<float>() + row * qk.stride(0), out.data_ptr<float>() + row * out.stride(0),
                          pool_data<T>(k_cache), pool_data<T>(v_cache), slots.data_ptr<int64_t>() + b * L + jlo,
                          jhi - jlo + 1, KV, G, D, hd, KV * hd,
                          static_cast<float>(scale), static_cast<float>(softcap)};
          fn(t, scores.data());
        }
      });
    };
    for_pool_type(kv_type, run);
    if (rotated) {
      std::vector<int64_t> written;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t x = 0; x < nq[b]; ++x) written.push_back(fr[b] + x);
      rotate_out_rows(out, written);
    }
    return;
  }
  std::stable_sort(blocks.begin(), blocks.end(), [&](const Block& x, const Block& y) {
    return lp[x.b] - nq[x.b] + x.q0 > lp[y.b] - nq[y.b] + y.q0;  // most keys first
  });
  const int64_t Rp = (kQueryBlock * G + kLanes - 1) / kLanes * kLanes;
  auto run = [&]<class T>() {
    const PrefillFn<T> fn = pick_prefill<T>(D);
    const int64_t hd = D + kScaleElems<T>;
    std::atomic<int64_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      std::vector<float> qt(static_cast<size_t>(D * Rp)), st(static_cast<size_t>(L * Rp));
      int64_t jlo[kQueryBlock], jhi[kQueryBlock];
      for (int64_t i = next++; i < static_cast<int64_t>(blocks.size()); i = next++) {
        const Block blk = blocks[i];
        const int64_t n = std::min(kQueryBlock, nq[blk.b] - blk.q0);
        for (int64_t x = 0; x < n; ++x) {
          jhi[x] = lp[blk.b] - nq[blk.b] + blk.q0 + x;
          jlo[x] = window > 0 ? std::max<int64_t>(0, jhi[x] - window + 1) : 0;
        }
        const int64_t row = fr[blk.b] + blk.q0;
        const PrefillTask<T> t{
            q.data_ptr<float>() + row * q.stride(0) + blk.h * G * D, q.stride(0),
            out.data_ptr<float>() + row * out.stride(0) + blk.h * G * D, out.stride(0),
            pool_data<T>(k_cache) + blk.h * hd, pool_data<T>(v_cache) + blk.h * hd,
            slots.data_ptr<int64_t>() + blk.b * L, n, G, D, KV * hd,
            jlo[0], jhi[n - 1] - jlo[0] + 1, jlo, jhi,
            static_cast<float>(scale), static_cast<float>(softcap)};
        fn(t, qt.data(), st.data());
      }
    });
  };
  for_pool_type(kv_type, run);
}

// The vector path this module was compiled for (the worker logs it; CBSERVE_CPU_ISA holds a build to
// a lower one).
std::string isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(CBSERVE_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL: the host plans the next step while a forward runs (async batching).
  using nogil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU; float32, bfloat16, float16 or int8 K/V)",
        nogil{});
  m.def("paged_prefill", &paged_prefill,
        "paged causal attention of prefill chunks (CPU, AVX-512 or AVX2; float32, 16-bit or int8 K/V)", nogil{});
  m.def("prefill_supports", &prefill_supports, "whether paged_prefill runs this head size here");
  m.def("isa", &isa, "the vector path this module was compiled for: avx512, avx2 or portable");
}
