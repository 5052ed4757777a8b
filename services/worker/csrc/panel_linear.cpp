// Linears y = x W^T (+ bias) on the CPU, float32, with W packed once into column panels.
//
// A decode step multiplies a few dozen rows by every weight of the model, so its linears are bounded
// by how fast the weights stream from memory, and a prefill chunk's by the FMA units. One simple
// layout serves both: W [N, K] is cut into panels of 32 output columns, each stored k-major
// ([K, 32], one contiguous 128-byte line per k), so a thread reads its panels front to back (the
// hardware prefetcher streams them) and multiplies each loaded line into up to 14 rows at once
// (28 accumulators, the panel's two vectors and a broadcast: 31 of the 32 vector registers; one load
// of W per 14 FMAs). Threads split the panels, so each weight is read once per product, by one core.
// A panel (72 KiB at K = 576) outgrows L1, so with more than one tile every tile after the first
// re-reads it from L2; the first tile would wait on memory while the others wait on nothing. So while
// a panel's tiles run, they pull the next panel into L2, a line every few k, spreading the weights'
// traffic evenly over the FMAs. A lone tile of 8-14 rows (a decode step of a dozen requests) pulls
// only the first line of every other k, one line in four, and leaves the rest to the hardware
// prefetchers; our guess at why that is faster, not measured: each software prefetch holds one of the
// core's few fill buffers until memory answers, and the tile's own L2-to-L1 reads queue behind them.
// With more than one tile, pulling every line is faster. A lone tile of fewer rows reads its panel
// straight from memory anyway, a few products per line, and on AVX-512 pulls none of the next panel:
// its own reads are then the only stream, which the hardware prefetcher follows, and its weights
// arrive faster (docs/performance-log.md). On AVX2 such products run in groups of panels instead.
//
// x is first copied tile by tile k-major ([K, rows]), so that a tile reads its 14 values of each k at
// constant offsets from one pointer: read in place, each row's address took an add of its own, 13
// dependent integer adds per k beside 28 FMAs. The copy is a transpose, done in register blocks of
// 16 x 16 (8 x 8 on AVX2): one float at a time, it took about as long as a panel's FMAs.
//
// Where torch's GEMM is faster at many rows (which depends on the CPU), gemm_crossover.py sends those
// there.
//
// On a CPU with AVX2 and FMA but no AVX-512 the same design runs on 16 vector registers of 8 floats:
// panels of 16 columns (one line per k) and tiles of up to 6 rows. There GCC kept the portable tile's
// accumulators in memory, and the intrinsics' accumulators too unless every loop over the rows is
// unrolled (it stored all 12 to the stack on every k), so those loops are unrolled. Blocking rows and
// k so that a block of x stays in L2 (Goto's order) was slower at 128-512 rows. A product of one to
// six rows (a decode step of a few requests) runs as one or two tiles of up to three rows on two to
// four panels at a time (tile_group), the two tiles in turns over each chunk of the panels' lines:
// one panel at a time, such a tile read its weights at well under the read rate.
//
// A gated product (the MLP's gate|up) interleaves the two weights by halves of a panel, gate columns
// then the same up columns, so that a tile ends with both halves of its outputs in registers and
// writes silu(gate) * up: the product's full width is never written to memory and read back.
//
// Each output is one sequential sum over k, which equals torch's GEMM up to fp32 summation order.
//
// bf16 weights (pack_weight_bf16) halve the bytes a decode step streams. Their panels keep the fp32
// layout's lines: per pair of k (2 k2, 2 k2 + 1) a line holds, for each of the kPanel columns, the two
// weights side by side in one 32-bit lane ([K2, kPanel, 2] per panel, K2 = ceil(K / 2), an odd K's
// last weight paired with a zero): the operand layout of AVX512-BF16's vdpbf16ps, and a line is as
// many bytes as an fp32 panel's, so the tiles, their prefetches and the split into tiles are the same
// code with K2 lines for K. Every path computes bf16(x) . bf16(W) with fp32 sums: x is rounded to bf16
// (to nearest even) as it is packed, so machines differ only in the order of the fp32 sums, as with
// fp32 weights. With AVX512-BF16 a tile multiplies x's bf16 pairs into the pairs of weights, two
// multiply-adds per lane per instruction; elsewhere it widens each lane into the two fp32 weights (by
// shifts) and runs fp32 FMAs on x's rounded values. The bf16 instructions read denormals as
// zero (below 2^-126, far under any weight or activation's scale). AVX2's panels arrange a line's
// same bytes otherwise: k = 2 k2, then 2 k2 + 1, 16 weights each, columns 0-7 in the low halves of the
// lanes and 8-15 in the high ones, so that a k's weights widen from one load by a shift and a mask.
// int8 panels (pack_weight_int8) hold a quarter of the bytes of fp32 ones, plus their scales. As in
// llama.cpp's Q8_0, each output column's weights are rounded to int8 in groups of kGroup consecutive
// k, each (column, group) on a symmetric scale of its own (sw = max |W| / 127 over the group), four
// k to a 32-bit lane, so that a line is again as many bytes as an fp32 panel's and the tiles,
// prefetches and split are the same code. A panel holds, group after group, the group's kGroup / 4
// lines of lanes (the last group's fewer where kGroup does not divide K, a K short of a multiple of 4
// padded with zeros), then a line of the columns' fp32 scales, then a line of -128 * the columns'
// weight sums over the group (int32, see below): K4 + 2 ceil(K / kGroup) lines of kPanel lanes, K4 =
// ceil(K / 4). Each row of x is rounded to int8 as it is packed, in the same groups, each (row, group)
// on a scale of its own (sx = max |x| / 127 over the group: dynamic, per token). A group's products
// are an exact int32 sum (at most 127^2 kGroup, exact in fp32 too), so every path gives the same
// sums; at the end of each group the tile adds float(sum) * sw * sx into fp32 accumulators, and only
// those fp32 steps (and the bias) round. One scale per column or row over all of K let one large
// weight or activation coarsen the rounding of all the others (docs/kernels.md gives the agreement
// with fp32 and the speed for groups of 32, 64 and 128 k against one scale per column). Within a group
// one large value still does, so each whole group of a weight column and of an x row is first
// rotated by the same orthonormal Walsh-Hadamard matrix H (QuaRot's idea: H spreads an outlier over
// the group, and (H w).(H x) = w.x): the rounding error of a group then follows its typical value, not
// its largest. The weights are rotated once as they are packed; x as it is packed, a few adds per value
// beside the group's products (a shorter last group is not rotated).
// With VNNI (AVX512-VNNI, or AVX-VNNI in an AVX2 build) vpdpbusd adds the four products of each lane
// into its int32 accumulator; it takes x unsigned, so x is packed as x + 128 (in 1 .. 255) and a
// group's sums start from its offsets, -128 * the column's weight sum over the group, computed at
// pack time (a copy per group, where subtracting them at the end would take an add). Without VNNI
// each lane is split into its even and odd k sign-extended to int16 (two shifts) and multiplied by
// vpmaddwd, two products per lane into int32, on x's values of those k as int16 pairs (two packed
// lines per K4 line): exact too, where vpmaddubsw's int16 sums of (x + 128) * w would saturate.
// A tile holds int32 and fp32 accumulators for both halves of the panel: 4 x 7 for 7 rows, the
// line's two vectors and a broadcast, 31 of the 32 registers (AVX2: 4 x 3, two, a broadcast and
// vpmaddwd's product, 16), so int8 tiles take up to 7 rows (3). Tiles of 14 rows that ran the two
// halves in turn (2 x 14 accumulators, x read twice) were no faster at 256 rows, slower at 1-16.
// The same panels also multiply x unrounded (`int8_x` false: weight-only int8; x rotated alike): each
// lane's four weights widened to fp32 in turn (a shift up and an arithmetic shift down, then a
// conversion), multiplied by their group's column scales (one multiply per widened vector, shared by
// all the tile's rows) and into x's fp32 values of their k by FMAs.
//
// The parts: panel_common.h (the layout, a tile, its prefetches, the helpers every path uses), then
// one file of tiles and packs per path (panel_avx512.h, panel_avx2.h, panel_portable.h: each empty
// unless it is this build's); this file, the pick of a tile and the entry points.
// Only the headers used: <torch/extension.h> (all of libtorch's C++ API) tripled the compile time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include "panel_avx2.h"
#include "panel_avx512.h"
#include "panel_common.h"
#include "panel_portable.h"

namespace {
// x for tile_int8: a tile's rows quantized (their groups' scales to `scales` [groups, rows]), then
// transposed as 32-bit lanes -> out [K4 kXLinesPerQuad, rows].
inline void pack_rows_int8(const float* x, int64_t sx, int64_t rows, int64_t K, float* out, float* scales) {
  const int64_t lines = (K + 3) / 4 * kXLinesPerQuad, groups = int8_groups(K);
  std::vector<uint32_t> lanes(rows * lines);
  std::vector<int8_t> q((K + 3) / 4 * 4);
  std::vector<float> row_scales(groups);
  for (int64_t r = 0; r < rows; ++r) {
    int8_lanes(x + r * sx, K, q.data(), lanes.data() + r * lines, row_scales.data());
    for (int64_t g = 0; g < groups; ++g) scales[g * rows + r] = row_scales[g];
  }
  const float* rows_of = reinterpret_cast<const float*>(lanes.data());
  int64_t k0 = 0;
#if defined(__AVX512F__)
  k0 = pack_blocks(rows, lines, out, [&](int r, int64_t k) { return _mm512_loadu_ps(rows_of + r * lines + k); });
#elif defined(__AVX2__) && defined(__FMA__)
  k0 = pack_blocks(rows, lines, out, [&](int r, int64_t k) { return _mm256_loadu_ps(rows_of + r * lines + k); });
#endif
  copy_lanes(lanes.data(), rows, k0, lines, out);
}

// x for tile_int8w: the rows rotated as the weights were (rotate_groups), [4 K4, rows] in fp32, the
// pad k zero.
inline void pack_rows_padded(const float* x, int64_t sx, int64_t rows, int64_t K, float* out) {
  std::vector<float> rotated(rows * K);
  for (int64_t r = 0; r < rows; ++r) rotate_groups(x + r * sx, K, rotated.data() + r * K);
  pack_rows(rotated.data(), K, rows, K, out);
  std::fill(out + K * rows, out + (K + 3) / 4 * 4 * rows, 0.f);
}

using TileFn = void (*)(const Tile&);
enum class Weights { kFloat, kBf16, kInt8, kInt8Weights };
template <Weights W, int R>
constexpr TileFn tile_for() {
  if constexpr (W == Weights::kBf16) return tile_bf16<R>;
  else if constexpr (W == Weights::kInt8) return tile_int8<R>;
  else if constexpr (W == Weights::kInt8Weights) return tile_int8w<R>;
  else return tile<R>;
}
// The tiles of 1 .. sizeof...(R) rows, by their rows (null past them).
template <Weights W, size_t... R>
constexpr std::array<TileFn, kMaxRows + 1> tiles_up_to(std::index_sequence<R...>) {
  return {nullptr, tile_for<W, int(R) + 1>()...};
}
constexpr auto kTiles = tiles_up_to<Weights::kFloat>(std::make_index_sequence<kMaxRows>{});
constexpr auto kTilesBf16 = tiles_up_to<Weights::kBf16>(std::make_index_sequence<kMaxRows>{});
#ifdef CBSERVE_AVX2
// A product of up to kGroupTiles * kGroupRows rows (bf16: kGroupTilesBf16 *) runs as tiles of up to
// kGroupRows rows on groups of panels (tile_group), kGroupPanels[R] at a time for R rows: the most that
// measured faster, as far as their accumulators leave registers (four rows in a pair hold 16
// accumulators, all the registers: GCC kept four on the stack). Where there are two tiles, they take
// turns over each kGroupChunk lines of the group, the second reading them from L1 and prefetching the
// next chunk's, so that the group is still read once, from memory, in a stream that does not stop
// while the second tile multiplies (tiles each over the whole group read it from L2 the second time,
// and left memory idle meanwhile). Tiles of more rows (tile<R>) were faster from seven rows on. A
// thread's panels short of a whole group run in pairs, then alone. bf16 tiles of four to six rows
// widen their weights in tile_bf16 faster than in turns (docs/kernels.md).
using GroupFn = void (*)(const Tile*, int64_t, int64_t, float*, int64_t);
constexpr int kGroupRows = 3, kGroupTiles = 2, kGroupTilesBf16 = 1;
constexpr int64_t kGroupChunk = 32;  // lines: 12 KiB of three panels, in L1 for the second tile
constexpr std::array<int, kGroupRows + 1> kGroupPanels = {0, 4, 3, 2};
constexpr int kMaxGroup = 4;
static_assert(*std::max_element(kGroupPanels.begin(), kGroupPanels.end()) <= kMaxGroup);
struct Groups {
  int panels;  // a group's
  GroupFn group, pair;
};
template <bool kBf16, size_t... R>
constexpr std::array<Groups, kGroupRows + 1> groups_up_to(std::index_sequence<R...>) {
  return {Groups{}, Groups{kGroupPanels[R + 1], tile_group<kBf16, int(R) + 1, kGroupPanels[R + 1]>,
                           tile_group<kBf16, int(R) + 1, 2>}...};
}
constexpr auto kGroups = groups_up_to<false>(std::make_index_sequence<kGroupRows>{});
constexpr auto kGroupsBf16 = groups_up_to<true>(std::make_index_sequence<kGroupRows>{});
#endif
constexpr auto kTilesInt8 = tiles_up_to<Weights::kInt8>(std::make_index_sequence<kMaxRowsInt8>{});
constexpr auto kTilesInt8Weights = tiles_up_to<Weights::kInt8Weights>(std::make_index_sequence<kMaxRows>{});

constexpr const char* kIsa =
#if defined(__AVX512BF16__)
    "avx512-bf16";
#elif defined(__AVX512F__)
    "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    "avx2";
#else
    "portable";
#endif

// The int8 tiles' products: vpdpbusd, or sign-extended vpmaddwd without VNNI, or portable loops.
constexpr const char* kInt8Path =
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    "avx512-vnni";
#elif defined(__AVX512F__)
    "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__AVXVNNI__)
    "avx-vnni";
#elif defined(__AVX2__) && defined(__FMA__)
    "avx2";
#else
    "portable";
#endif
}  // namespace

// W [N, K] -> panels [ceil(N / kPanel), K, kPanel], the last one zero-padded.
at::Tensor pack_weight(at::Tensor weight) {
  TORCH_CHECK(weight.dtype() == at::kFloat && weight.dim() == 2, "float32 [N, K] weight only, got ",
              weight.sizes(), " ", weight.dtype());
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kPanel - 1) / kPanel;
  auto padded = at::zeros({P * kPanel, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({P, kPanel, K}).transpose(1, 2).contiguous();
}

// W [2I, K] (gate rows, then up rows) -> panels [ceil(I / kHalf), K, kPanel]: panel j holds gate
// columns j * kHalf .. + kHalf, then the same up columns; the last one zero-padded.
at::Tensor pack_weight_gated(at::Tensor weight) {
  TORCH_CHECK(weight.dtype() == at::kFloat && weight.dim() == 2 && weight.size(0) % 2 == 0,
              "float32 [2I, K] weight only, got ", weight.sizes(), " ", weight.dtype());
  const int64_t I = weight.size(0) / 2, K = weight.size(1), P = (I + kHalf - 1) / kHalf;
  auto halves = at::zeros({2, P * kHalf, K}, weight.options());
  halves.narrow(1, 0, I).copy_(weight.view({2, I, K}));
  return halves.view({2, P, kHalf, K}).permute({1, 3, 0, 2}).reshape({P, K, kPanel}).contiguous();
}

namespace {
// W [rows, K] float32 or bfloat16 -> bf16 (rounded to nearest even), rows zero-padded to `rows` and
// K to 2 K2: its pairs of k side by side, as the panels hold them.
at::Tensor bf16_padded(const at::Tensor& weight, int64_t rows, const char* what) {
  TORCH_CHECK((weight.dtype() == at::kFloat || weight.dtype() == at::kBFloat16) && weight.dim() == 2,
              "float32 or bfloat16 ", what, " weight only, got ", weight.sizes(), " ", weight.scalar_type());
  const int64_t K = weight.size(1);
  auto padded = at::zeros({rows, (K + 1) / 2 * 2}, weight.options().dtype(at::kBFloat16));
  padded.narrow(0, 0, weight.size(0)).narrow(1, 0, K).copy_(weight);
  return padded;
}
}  // namespace

// W [N, K] -> bf16 panels [ceil(N / kPanel), K2, 2 kPanel]: per pair of k, each column's two weights
// side by side (AVX2: the two k in turn, their columns interleaved; see the top); the last panel and
// an odd K zero-padded.
at::Tensor pack_weight_bf16(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "[N, K] weight only, got ", weight.sizes());
  const int64_t N = weight.size(0), K2 = (weight.size(1) + 1) / 2, P = (N + kPanel - 1) / kPanel;
  auto padded = bf16_padded(weight, P * kPanel, "[N, K]");
#ifdef CBSERVE_AVX2
  return padded.view({P, 2, kHalf, K2, 2}).permute({0, 3, 4, 2, 1}).reshape({P, K2, 2 * kPanel}).contiguous();
#else
  return padded.view({P, kPanel, K2, 2}).permute({0, 2, 1, 3}).reshape({P, K2, 2 * kPanel}).contiguous();
#endif
}

// W [2I, K] (gate rows, then up rows) -> bf16 panels [ceil(I / kHalf), K2, 2 kPanel]: the columns of
// pack_weight_gated, the pairs of pack_weight_bf16.
at::Tensor pack_weight_gated_bf16(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) % 2 == 0, "[2I, K] weight only, got ", weight.sizes());
  const int64_t I = weight.size(0) / 2, K2 = (weight.size(1) + 1) / 2, P = (I + kHalf - 1) / kHalf;
  auto halves = at::zeros({2, P * kHalf, 2 * K2}, weight.options().dtype(at::kBFloat16));
  halves.narrow(1, 0, I).copy_(bf16_padded(weight, 2 * I, "[2I, K]").view({2, I, 2 * K2}));
#ifdef CBSERVE_AVX2
  return halves.view({2, P, kHalf, K2, 2}).permute({1, 3, 4, 2, 0}).reshape({P, K2, 2 * kPanel}).contiguous();
#else
  return halves.view({2, P, kHalf, K2, 2}).permute({1, 3, 0, 2, 4}).reshape({P, K2, 2 * kPanel}).contiguous();
#endif
}

namespace {
// W [rows, K] float32 or bfloat16 -> (int8 [rows, K], fp32 scales [rows, groups]): each group of kGroup
// k of a row on its own scale.
std::pair<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& weight, const char* what) {
  TORCH_CHECK((weight.dtype() == at::kFloat || weight.dtype() == at::kBFloat16) && weight.dim() == 2,
              "float32 or bfloat16 ", what, " weight only, got ", weight.sizes(), " ", weight.scalar_type());
  const auto w = weight.to(at::kFloat).contiguous();
  const int64_t rows = w.size(0), K = w.size(1), groups = int8_groups(K);
  auto q = at::empty({rows, K}, w.options().dtype(at::kChar));
  auto scales = at::empty({rows, groups}, w.options());
  const float* wp = w.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) quantize_groups(wp + n * K, K, qp + n * K, sp + n * groups);
  });
  return {q, scales};
}

// q [P kPanel, K] int8 and scales [P kPanel, groups], already in the panels' column order -> int8
// panels [P, K4 + 2 groups, 4 kPanel]: per group, its lines of lanes of four k (kGroup / 4, the last
// group's fewer, K zero-padded to 4 K4), its line of scales and its line of -128 * each column's
// weight sum over the group (see the top).
at::Tensor int8_panels(const at::Tensor& q, const at::Tensor& scales, int64_t P) {
  const int64_t K = q.size(1), K4 = (K + 3) / 4, groups = int8_groups(K), stride = K4 + kInt8Trailer * groups;
  auto panels = at::zeros({P, stride, 4 * kPanel}, q.options());
  const auto qc = q.contiguous();
  const auto sc = scales.contiguous();
  const int8_t* qp = qc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  int8_t* out = panels.data_ptr<int8_t>();
  constexpr int64_t line_bytes = 4 * kPanel;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      int8_t* line = out + p * stride * line_bytes;
      for (int64_t g = 0, k0 = 0; g < groups; ++g, k0 += kGroup) {
        const int64_t k1 = std::min(k0 + kGroup, K), n = (k1 - k0 + 3) / 4;
        for (int64_t c = 0; c < kPanel; ++c) {
          const int8_t* col = qp + (p * kPanel + c) * K;
          int32_t sum = 0;
          for (int64_t k = k0; k < k1; ++k) {
            line[(k - k0) / 4 * line_bytes + 4 * c + (k - k0) % 4] = col[k];
            sum += col[k];
          }
          std::memcpy(line + n * line_bytes + 4 * c, sp + (p * kPanel + c) * groups + g, sizeof(float));
          const int32_t offset = -128 * sum;
          std::memcpy(line + (n + 1) * line_bytes + 4 * c, &offset, sizeof offset);
        }
        line += (n + kInt8Trailer) * line_bytes;
      }
    }
  });
  return panels;
}
}  // namespace

// x [M, K] float32 -> its rows with each whole group of kGroup k rotated, as the int8 panels rotate
// x's rows and their weights' columns before rounding them (what the tests compare against).
at::Tensor rotate_int8(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == at::kFloat, "float32 [M, K] only, got ", x.sizes(), " ", x.scalar_type());
  const auto xc = x.contiguous();
  auto out = at::empty_like(xc);
  const int64_t K = xc.size(1);
  for (int64_t r = 0; r < xc.size(0); ++r) rotate_groups(xc.data_ptr<float>() + r * K, K, out.data_ptr<float>() + r * K);
  return out;
}

// x [M, K] float32 -> (int8 [M, K], scales [M, groups] float32): each group of kGroup k of a row
// rotated (rotate_int8) and rounded on its own symmetric scale, as the int8 panels round x's rows and
// their weights' columns (what the tests compare against).
std::tuple<at::Tensor, at::Tensor> quantize_int8(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2, "[M, K] only, got ", x.sizes());
  auto [q, scales] = quantize_rows(x, "[M, K]");
  return {q, scales};
}

// W [N, K] -> int8 panels [ceil(N / kPanel), K4 + 2 groups, 4 kPanel] (see the top); the last panel's
// missing columns have zero weights and scales.
at::Tensor pack_weight_int8(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "[N, K] weight only, got ", weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kPanel - 1) / kPanel;
  auto [q, scales] = quantize_rows(weight, "[N, K]");
  auto q_cols = at::zeros({P * kPanel, K}, q.options());
  q_cols.narrow(0, 0, N).copy_(q);
  auto s_cols = at::zeros({P * kPanel, scales.size(1)}, scales.options());
  s_cols.narrow(0, 0, N).copy_(scales);
  return int8_panels(q_cols, s_cols, P);
}

// W [2I, K] (gate rows, then up rows) -> int8 panels [ceil(I / kHalf), K4 + 2 groups, 4 kPanel]: the
// columns of pack_weight_gated, the lanes and groups of pack_weight_int8.
at::Tensor pack_weight_gated_int8(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) % 2 == 0, "[2I, K] weight only, got ", weight.sizes());
  const int64_t I = weight.size(0) / 2, K = weight.size(1), P = (I + kHalf - 1) / kHalf;
  auto [q, scales] = quantize_rows(weight, "[2I, K]");
  const int64_t groups = scales.size(1);
  auto q_halves = at::zeros({2, P * kHalf, K}, q.options());
  q_halves.narrow(1, 0, I).copy_(q.view({2, I, K}));
  auto s_halves = at::zeros({2, P * kHalf, groups}, scales.options());
  s_halves.narrow(1, 0, I).copy_(scales.view({2, I, groups}));
  return int8_panels(q_halves.view({2, P, kHalf, K}).transpose(0, 1).reshape({P * kPanel, K}),
                     s_halves.view({2, P, kHalf, groups}).transpose(0, 1).reshape({P * kPanel, groups}), P);
}

namespace {
// x [..., K] times the panels -> [..., N]; gated: N = I outputs of silu(gate) * up. int8_x: int8
// panels multiply x rounded to int8 per row; else x as it is (weight-only int8).
at::Tensor run_panels(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                      int64_t N, bool gated, bool int8_x) {
  TORCH_CHECK(x.dtype() == at::kFloat, "x must be float32, got ", x.scalar_type());
  const bool bf16 = panels.dtype() == at::kBFloat16, int8 = panels.dtype() == at::kChar;
  TORCH_CHECK(bf16 || int8 || panels.dtype() == at::kFloat, "panels must be float32, bfloat16 or int8, got ",
              panels.scalar_type());
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == (int8 ? 4 : bf16 ? 2 : 1) * kPanel && panels.is_contiguous(),
              "panels must come from pack_weight", int8 ? "_int8" : bf16 ? "_bf16" : "", ", got ", panels.sizes());
  // lines: the panels' lines of weights per column (K, K2 pairs or K4 quads of k); stride: a panel's
  // lines in all (int8: with each group's two); x_lines: x's packed lines.
  const int64_t K = x.size(-1), P = panels.size(0), width = gated ? kHalf : kPanel;
  const int64_t stride = panels.size(1);
  int64_t lines = stride;
  if (int8) {  // groups of kGroupLines lines but the last, each with its two lines of scales and offsets
    const int64_t groups = (stride + kGroupLines + kInt8Trailer - 1) / (kGroupLines + kInt8Trailer);
    lines = stride - kInt8Trailer * groups;
    TORCH_CHECK(lines > (groups - 1) * kGroupLines, "panels must come from pack_weight_int8, got ", panels.sizes());
    TORCH_CHECK((K + 3) / 4 == lines, "x has ", K, " features, the weight ", 4 * lines - 3, " to ", 4 * lines);
  } else if (bf16) {
    TORCH_CHECK((K + 1) / 2 == lines, "x has ", K, " features, the weight ", 2 * lines - 1, " or ", 2 * lines);
  } else {
    TORCH_CHECK(K == lines, "x has ", K, " features, the weight ", lines);
  }
  const bool int8_w = int8 && !int8_x;  // weight-only: x's fp32 values, 4 lines per quad of k
  const int64_t x_lines = int8_w ? 4 * lines : int8 ? lines * kXLinesPerQuad : bf16 ? lines * kXLinesPerPair : K;
  TORCH_CHECK(N > (P - 1) * width && N <= P * width, "N = ", N, " does not fit ", P, " panels");
  auto x2 = x.reshape({-1, K});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  const int64_t M = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  auto y = at::empty(out_shape, x.options());
  if (M == 0) return y;
  at::Tensor bias_padded;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bias must have ", N, " values, got ", bias->numel());
    bias_padded = at::zeros({P * kPanel}, x.options());
    bias_padded.narrow(0, 0, N).copy_(bias->reshape({N}));
  }
  const float* xp = x2.data_ptr<float>();
  // bf16 and int8 panels are read as 32-bit lanes, each a pair or quad of weights, through the vector
  // loads (or memcpy).
  const float* wp = static_cast<const float*>(panels.data_ptr());
  const float* bp = bias_padded.defined() ? bias_padded.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t sx = x2.stride(0);
  // Tiles as even as possible: 30 rows run as 10 + 10 + 10, not 14 + 14 + 2.
  int64_t max_rows = int8 && int8_x ? kMaxRowsInt8 : kMaxRows;
#ifdef CBSERVE_AVX2
  const bool grouped = !int8 && M <= (bf16 ? kGroupTilesBf16 : kGroupTiles) * kGroupRows;
  if (grouped) max_rows = kGroupRows;
#endif
  const int64_t tiles = (M + max_rows - 1) / max_rows, base = M / tiles, extra = M % tiles;
  auto tile_rows = [&](int64_t i) { return base + (i < extra ? 1 : 0); };
  auto tile_first_row = [&](int64_t i) { return i * base + std::min(i, extra); };
  auto packed_x = at::empty({M * x_lines}, x.options());
  float* xq = packed_x.data_ptr<float>();
  at::Tensor x_scales;
  const int64_t groups = int8_groups(K);
  if (int8 && int8_x) x_scales = at::empty({M * groups}, x.options());  // each tile's [groups, rows]
  float* xs = x_scales.defined() ? x_scales.data_ptr<float>() : nullptr;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r0 = tile_first_row(i);
      if (int8_w) {
        pack_rows_padded(xp + r0 * sx, sx, tile_rows(i), K, xq + r0 * x_lines);
      } else if (int8) {
        pack_rows_int8(xp + r0 * sx, sx, tile_rows(i), K, xq + r0 * x_lines, xs + r0 * groups);
      } else {
        (bf16 ? pack_rows_bf16 : pack_rows)(xp + r0 * sx, sx, tile_rows(i), K, xq + r0 * x_lines);
      }
    }
  });
  const auto& tile_fns = int8_w ? kTilesInt8Weights : int8 ? kTilesInt8 : bf16 ? kTilesBf16 : kTiles;
  // Tile i of panel j, pulling its share of panel `after` (none past the thread's `end`).
  auto tile_of = [&](int64_t j, int64_t i, int64_t after, int64_t end) {
    const int64_t r0 = tile_first_row(i);
    const int64_t line0 = stride * i / tiles, line1 = stride * (i + 1) / tiles;
    const float* next = after < end ? wp + (after * stride + line0) * kPanel : nullptr;
    return Tile{xq + r0 * x_lines, wp + j * stride * kPanel, lines, yp + r0 * N + j * width, N,
                bp == nullptr ? nullptr : bp + j * kPanel, std::min(width, N - j * width), gated,
                next, next == nullptr ? 0 : line1 - line0, tiles, xs == nullptr ? nullptr : xs + r0 * groups};
  };
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    int64_t j = begin;
#ifdef CBSERVE_AVX2
    if (grouped) {  // the tiles on groups of panels, in turns a chunk of lines at a time
      const auto& by_rows = bf16 ? kGroupsBf16 : kGroups;
      // A group's panels: the tiles' own where they agree (tiles of one height), else pairs.
      const int panels = by_rows[tile_rows(0)].panels;
      const bool agree = by_rows[tile_rows(tiles - 1)].panels == panels;
      const int64_t chunk = tiles > 1 ? kGroupChunk : lines;
      Tile ts[kGroupTiles][kMaxGroup];
      alignas(32) float carry[kGroupTiles][kMaxGroup * kGroupRows * kPanel];
      const auto run = [&](int np) {
        for (; j + np <= end; j += np) {
          for (int64_t i = 0; i < tiles; ++i)
            for (int q = 0; q < np; ++q) ts[i][q] = tile_of(j + q, i, j + np + q, end);
          for (int64_t k0 = 0; k0 < lines; k0 += chunk) {
            const int64_t k1 = std::min(lines, k0 + chunk);
            for (int64_t i = 0; i < tiles; ++i) {
              const Groups& g = by_rows[tile_rows(i)];
              const int64_t ahead = i == tiles - 1 && k1 < lines ? chunk : 0;
              (g.panels == np ? g.group : g.pair)(ts[i], k0, k1, carry[i], ahead);
            }
          }
        }
      };
      if (agree && panels > 2) run(panels);
      run(2);
    }
#endif
    for (; j < end; ++j)
      for (int64_t i = 0; i < tiles; ++i) tile_fns[tile_rows(i)](tile_of(j, i, j + 1, end));
  });
  return y;
}
}  // namespace

// x [..., K] float32 (rows contiguous), panels of pack_weight, pack_weight_bf16 or pack_weight_int8, bias [N] or None
// -> [..., N] float32. int8 panels: int8_x rounds x's rows to int8, else x multiplies as it is.
at::Tensor panel_linear(at::Tensor x, at::Tensor panels, c10::optional<at::Tensor> bias, int64_t N, bool int8_x) {
  return run_panels(x, panels, bias, N, false, int8_x);
}

// x [..., K], panels of pack_weight_gated(_bf16, _int8) for I outputs -> silu(x Wg^T) * (x Wu^T) [..., I]
at::Tensor panel_linear_gated(at::Tensor x, at::Tensor panels, int64_t I, bool int8_x) {
  return run_panels(x, panels, c10::nullopt, I, true, int8_x);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL: the host plans the next step while a forward runs (async batching).
  using nogil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("pack_weight", &pack_weight, "W [N, K] -> column panels (CPU, float32)", nogil{});
  namespace py = pybind11;
  m.def("panel_linear", &panel_linear, "x W^T + bias with W packed by pack_weight(_bf16, _int8)", py::arg("x"),
        py::arg("panels"), py::arg("bias"), py::arg("N"), py::arg("int8_x") = true, nogil{});
  m.def("pack_weight_gated", &pack_weight_gated, "[gate; up] [2I, K] -> gated column panels", nogil{});
  m.def("panel_linear_gated", &panel_linear_gated, "silu(x Wg^T) * (x Wu^T) with pack_weight_gated(_bf16, _int8)'s panels",
        py::arg("x"), py::arg("panels"), py::arg("I"), py::arg("int8_x") = true, nogil{});
  m.def("pack_weight_bf16", &pack_weight_bf16, "W [N, K] -> bf16 column panels of pairs of k", nogil{});
  m.def("pack_weight_gated_bf16", &pack_weight_gated_bf16, "[gate; up] [2I, K] -> gated bf16 column panels", nogil{});
  m.def("pack_weight_int8", &pack_weight_int8, "W [N, K] -> int8 column panels of quads of k, scales per column and group of k", nogil{});
  m.def("pack_weight_gated_int8", &pack_weight_gated_int8, "[gate; up] [2I, K] -> gated int8 column panels", nogil{});
  m.def("rotate_int8", &rotate_int8, "x [M, K] -> each whole group of k times the Walsh-Hadamard matrix, as the int8 panels rotate rows", nogil{});
  m.def("quantize_int8", &quantize_int8, "x [M, K] -> (int8 [M, K], scales [M, groups]) as the int8 panels round rows", nogil{});
  m.def("isa", [] { return std::string(kIsa); }, "the vector path compiled: avx512-bf16, avx512, avx2 or portable");
  m.def("int8_path", [] { return std::string(kInt8Path); },
        "the int8 panels' products: avx512-vnni, avx512, avx-vnni, avx2 or portable");
  m.def("int8_group", [] { return kGroup; }, "k per group of the int8 panels' scales (and of x's rows)");
}
