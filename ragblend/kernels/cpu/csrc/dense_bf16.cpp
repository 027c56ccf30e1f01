// Dense bf16 weights times a decode step's few rows: out = x @ W.T (+ bias), AVX512 F/BW, in
// two builds of this file: the fp32-FMA one (AVX512 F/BW/VL/DQ) and, with
// RAGBLEND_DENSE_DPBF16 (AVX512-BF16), one whose products are vdpbf16ps'.
//
// oneDNN's bf16 linears cannot be shown to give a row the same output alone and in a batch
// (their rounding to bf16 hides a change of summation order in all but ~1 in 3000 values), so
// this kernel is batch-invariant by construction, as quant_blocks.cpp's matmul is: each
// (x row, weight row) pair has its own 16-lane fp32 accumulators (kAccs of them), which run
// over the columns in order and are reduced in a fixed order at the end. A tile of R weight
// rows by G rows of x only shares loads between pairs (each weight loaded once for the G rows,
// each x load used by the R rows); no pair's sums depend on R, G, n or the split between
// threads.
//
// fp32-FMA build: the math is exact up to the fp32 sums: bf16 -> fp32 is a 16-bit shift, the
// product of two bf16 values fits in fp32's 24-bit mantissa (so FMA equals mul + add), the sum
// (+ bias, added after it in fp32) is rounded to bf16 to nearest even as torch rounds. So
// outputs differ from F.linear's only where another fp32 summation order flips a bf16 rounding.
// Widening 32 weights (one 64-byte load): the even columns are the low halves of the 32-bit
// lanes (shift left 16), the odd ones the high halves (mask), two cheap in-lane ops. x is
// widened once per call into the same order (each 32 columns: 16 even, then 16 odd) and packed
// in groups of kGroup columns ([group][n][kGroup] fp32) that stay in L1 while a tile passes.
//
// AVX512-BF16 build: one vdpbf16ps per 32 columns of a pair, on the bf16 weights and x as
// they are (x only copied into the same groups, [group][n][kGroup] bf16): lane j adds the
// products of columns 2j and 2j + 1 to its fp32 sum, in the instruction's fixed order, rounding
// to nearest even. The products are exact as above; but the instruction treats bf16 subnormal
// inputs as zero and flushes subnormal results to zero (as oneDNN's bf16 kernels on such CPUs
// do), so values below 2^-126 count as 0. One accumulator per pair; tiles of kTileR weight rows
// by up to kTileG rows of x keep 16 instruction chains in flight.
#pragma GCC optimize("fp-contract=off")

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "task_queue.h"
#include "unroll.h"

namespace {

constexpr int64_t kMaxRows = 16;  // rows of x per call
constexpr int64_t kBlock = 32;    // columns per weight load: 32 bf16, one cache line
constexpr int64_t kGroup = 256;   // columns of x in L1 together (16 rows: 16 kB)
#ifdef RAGBLEND_DENSE_DPBF16
#ifndef RAGBLEND_DENSE_TILE_R
#define RAGBLEND_DENSE_TILE_R 4
#endif
#ifndef RAGBLEND_DENSE_TILE_G
#define RAGBLEND_DENSE_TILE_G 4
#endif
constexpr int kTileR = RAGBLEND_DENSE_TILE_R;  // weight rows per tile
constexpr int kTileG = RAGBLEND_DENSE_TILE_G;  // rows of x per tile, at most
constexpr int64_t kRowTile = kTileR;  // weight rows whose accumulators stay in memory together
constexpr int kAccs = 1;              // 16-lane fp32 accumulators per pair
using XT = uint16_t;                  // x as the tiles read it: bf16
#else
constexpr int64_t kRowTile = 4;
constexpr int kAccs = 2;  // the even columns' sums, the odd ones'
using XT = float;         // x widened
#endif
constexpr int64_t kTask = 64;  // weight rows per thread task (a multiple of kRowTile)
static_assert(kTask % kRowTile == 0);

using Acc = __m512;

using ragblend::unroll;

inline float widen1(uint16_t b) {
  const uint32_t u = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t round_bf16(float f) {  // c10::BFloat16's round_to_nearest_even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  // NaN
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// 32 bf16 weights -> w[0] the even columns, w[1] the odd ones, exactly as fp32
RAGBLEND_INLINE void widen(const uint16_t* p, __m512* w) {
  const __m512i v = _mm512_loadu_si512(p);
  w[0] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  w[1] = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}

// x's packed copy, zeroed: [cols / kGroup groups (rounded up)][n][kGroup] XT. Torch's
// allocator aligns it to 64 bytes, so that no 64-byte load of it straddles two cache lines (a
// std::vector is 16-byte aligned: in the quantized kernels, which load x alike, that made 4-8
// rows 1.2-1.4x slower in some processes; here 1.02-1.04x, measured on cached weights).
at::Tensor packed_x(int64_t n, int64_t cols) {
  const int64_t groups = (cols + kGroup - 1) / kGroup;
  return at::zeros({groups * n * kGroup}, sizeof(XT) == 4 ? at::kFloat : at::kBFloat16);
}

#ifdef RAGBLEND_DENSE_DPBF16
// x [n, cols] bf16 -> bf16 [cols / kGroup groups (rounded up)][n][kGroup], as it is
at::Tensor pack_x(const uint16_t* x, int64_t n, int64_t cols) {
  at::Tensor packed = packed_x(n, cols);
  auto* p = static_cast<XT*>(packed.data_ptr());
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c0 = 0; c0 < cols; c0 += kGroup)
      std::memcpy(p + (c0 / kGroup * n + i) * kGroup, x + i * cols + c0,
                  std::min(kGroup, cols - c0) * 2);
  return packed;
}
#else
// x [n, cols] bf16 -> fp32 [cols / kGroup groups (rounded up)][n][kGroup], in widen's order
at::Tensor pack_x(const uint16_t* x, int64_t n, int64_t cols) {
  at::Tensor packed = packed_x(n, cols);
  auto* p = static_cast<XT*>(packed.data_ptr());
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < cols; c += kBlock) {
      float* dst = p + (c / kGroup * n + i) * kGroup + c % kGroup;
      for (int64_t k = 0; k < 16; ++k) {
        dst[k] = widen1(x[i * cols + c + 2 * k]);
        dst[16 + k] = widen1(x[i * cols + c + 2 * k + 1]);
      }
    }
  return packed;
}
#endif

#ifdef RAGBLEND_DENSE_DPBF16
// R weight rows (w[r]: this group's columns) by G rows of x from row i0 (x: the group's packed
// [n][kGroup] bf16), nblk blocks of 32 columns: acc[r][i0 + g][0] += their products, in order.
template <int R, int G>
void dot_tile(const uint16_t* const* w, int64_t nblk, const XT* x, Acc (*acc)[kMaxRows][kAccs],
              int64_t i0) {
  Acc a[R][G];
  unroll<R>([&](auto r) RAGBLEND_INLINE_LAMBDA {
    unroll<G>([&](auto g) RAGBLEND_INLINE_LAMBDA { a[r][g] = acc[r][i0 + g][0]; });
  });
  for (int64_t b = 0; b < nblk; ++b) {
    __m512bh xv[G];  // loaded once for the R weight rows
    unroll<G>([&](auto g) RAGBLEND_INLINE_LAMBDA {
      xv[g] = (__m512bh)_mm512_loadu_si512(x + (i0 + g) * kGroup + b * kBlock);
    });
    unroll<R>([&](auto r) RAGBLEND_INLINE_LAMBDA {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w[r] + b * kBlock);
      unroll<G>([&](auto g) RAGBLEND_INLINE_LAMBDA {
        a[r][g] = _mm512_dpbf16_ps(a[r][g], xv[g], wv);
      });
    });
  }
  unroll<R>([&](auto r) RAGBLEND_INLINE_LAMBDA {
    unroll<G>([&](auto g) RAGBLEND_INLINE_LAMBDA { acc[r][i0 + g][0] = a[r][g]; });
  });
}

// dot_tile<R, g> for 1 <= g <= G
template <int R, int G>
RAGBLEND_INLINE void dot_tile_upto(int64_t g, const uint16_t* const* w, int64_t nblk,
                                   const XT* x, Acc (*acc)[kMaxRows][kAccs], int64_t i0) {
  if constexpr (G > 1) {
    if (g < G) return dot_tile_upto<R, G - 1>(g, w, nblk, x, acc, i0);
  }
  dot_tile<R, G>(w, nblk, x, acc, i0);
}

// rows x n pairs in tiles of kTileR weight rows by up to kTileG rows of x; the rows left,
// 1 by up to 8
void dot_rows(int64_t rows, int64_t n, const uint16_t* const* w, int64_t nblk, const XT* x,
              Acc (*acc)[kMaxRows][kAccs]) {
  int64_t r = 0;
  for (; r + kTileR <= rows; r += kTileR)
    for (int64_t i0 = 0; i0 < n; i0 += kTileG)
      dot_tile_upto<kTileR, kTileG>(std::min<int64_t>(kTileG, n - i0), w + r, nblk, x, acc + r,
                                    i0);
  for (; r < rows; ++r)
    for (int64_t i0 = 0; i0 < n; i0 += 8)
      dot_tile_upto<1, 8>(std::min<int64_t>(8, n - i0), w + r, nblk, x, acc + r, i0);
}
#else
// R weight rows (w[r]: this group's columns) by G rows of x from row i0 (x: the group's packed
// [n][kGroup]), nblk blocks of 32 columns: acc[r][i0 + g][0..2) += their products, in order.
template <int R, int G>
void dot_tile(const uint16_t* const* w, int64_t nblk, const XT* x, Acc (*acc)[kMaxRows][kAccs],
              int64_t i0) {
  Acc a[R][G][2];
  unroll<R>([&](auto r) RAGBLEND_INLINE_LAMBDA {
    unroll<G>([&](auto g) RAGBLEND_INLINE_LAMBDA { a[r][g][0] = acc[r][i0 + g][0], a[r][g][1] = acc[r][i0 + g][1]; });
  });
  for (int64_t b = 0; b < nblk; ++b) {
    __m512 xv[G][2];  // loaded once for the R weight rows (not once per FMA)
    unroll<G>([&](auto g) RAGBLEND_INLINE_LAMBDA {
      xv[g][0] = _mm512_loadu_ps(x + (i0 + g) * kGroup + b * kBlock);
      xv[g][1] = _mm512_loadu_ps(x + (i0 + g) * kGroup + b * kBlock + 16);
    });
    unroll<R>([&](auto r) RAGBLEND_INLINE_LAMBDA {
      __m512 wv[2];
      widen(w[r] + b * kBlock, wv);
      unroll<G>([&](auto g) RAGBLEND_INLINE_LAMBDA {
        a[r][g][0] = _mm512_fmadd_ps(xv[g][0], wv[0], a[r][g][0]);
        a[r][g][1] = _mm512_fmadd_ps(xv[g][1], wv[1], a[r][g][1]);
      });
    });
  }
  unroll<R>([&](auto r) RAGBLEND_INLINE_LAMBDA {
    unroll<G>([&](auto g) RAGBLEND_INLINE_LAMBDA { acc[r][i0 + g][0] = a[r][g][0], acc[r][i0 + g][1] = a[r][g][1]; });
  });
}

// rows x n pairs in tiles that keep 8-16 independent FMA chains in flight and load little per
// FMA: 4 weight rows by 1 or 2 rows of x (x in chunks of 2); the rows left, 1 by up to 8
void dot_rows(int64_t rows, int64_t n, const uint16_t* const* w, int64_t nblk, const XT* x,
              Acc (*acc)[kMaxRows][kAccs]) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4)
    for (int64_t i0 = 0; i0 < n; i0 += 2) {
      if (n - i0 == 1) dot_tile<4, 1>(w + r, nblk, x, acc + r, i0);
      else dot_tile<4, 2>(w + r, nblk, x, acc + r, i0);
    }
  for (; r < rows; ++r)
    for (int64_t i0 = 0; i0 < n; i0 += 8) switch (std::min<int64_t>(8, n - i0)) {
        case 1: dot_tile<1, 1>(w + r, nblk, x, acc + r, i0); break;
        case 2: dot_tile<1, 2>(w + r, nblk, x, acc + r, i0); break;
        case 3: dot_tile<1, 3>(w + r, nblk, x, acc + r, i0); break;
        case 4: dot_tile<1, 4>(w + r, nblk, x, acc + r, i0); break;
        case 5: dot_tile<1, 5>(w + r, nblk, x, acc + r, i0); break;
        case 6: dot_tile<1, 6>(w + r, nblk, x, acc + r, i0); break;
        case 7: dot_tile<1, 7>(w + r, nblk, x, acc + r, i0); break;
        default: dot_tile<1, 8>(w + r, nblk, x, acc + r, i0); break;
      }
}

#endif

inline float pair_sum(const Acc* a) {  // fixed order: the two (if two), then halves to one lane
  __m512 s = a[0];
  if constexpr (kAccs == 2) s = _mm512_add_ps(a[0], a[1]);
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// One weight [rows, cols]'s rows [r0, r1): out[i * stride + r] (bf16 bits), x packed (pack_x).
// The hardware prefetcher alone leaves a lone row of x at a third of the memory bandwidth
// (a tile reads its rows' columns group by group, not in address order), so each group step
// also prefetches its share of the weight bytes kAhead bytes further on (within the task).
void matmul_rows(const XT* x, int64_t n, int64_t cols, const uint16_t* w, const uint16_t* bias,
                 int64_t r0, int64_t r1, uint16_t* out, int64_t stride) {
  constexpr int64_t kAhead = 8192;
  alignas(64) Acc acc[kRowTile][kMaxRows][kAccs];
  const uint16_t* src[kRowTile];
  const char* end = reinterpret_cast<const char*>(w + r1 * cols);
  const char* ahead = reinterpret_cast<const char*>(w + r0 * cols);
  for (const char* p = ahead; p < std::min(end, ahead + kAhead); p += 64)
    _mm_prefetch(p, _MM_HINT_T0);
  ahead += kAhead;
  for (int64_t t0 = r0; t0 < r1; t0 += kRowTile) {
    const int64_t tile = std::min(kRowTile, r1 - t0);
    for (int64_t r = 0; r < tile; ++r)
      for (int64_t i = 0; i < n; ++i)
        for (int k = 0; k < kAccs; ++k) acc[r][i][k] = _mm512_setzero_ps();
    for (int64_t c0 = 0; c0 < cols; c0 += kGroup) {
      const int64_t bytes = tile * std::min(kGroup, cols - c0) * 2;
      for (const char* stop = std::min(end, ahead + bytes); ahead < stop; ahead += 64)
        _mm_prefetch(ahead, _MM_HINT_T0);
      for (int64_t r = 0; r < tile; ++r) src[r] = w + (t0 + r) * cols + c0;
      dot_rows(tile, n, src, std::min(kGroup, cols - c0) / kBlock, x + c0 * n, acc);
    }
    for (int64_t r = 0; r < tile; ++r)
      for (int64_t i = 0; i < n; ++i) {
        float v = pair_sum(acc[r][i]);
        if (bias != nullptr) v += widen1(bias[t0 + r]);
        out[i * stride + t0 + r] = round_bf16(v);
      }
  }
}

// x @ cat(weights).T (+ biases): [n, sum of rows], each weight's columns after the ones before
// (one op, one thread team for a layer's q/k/v or gate/up: no copy of their weights).
at::Tensor matmul_cat(const at::Tensor& x, at::TensorList weights,
                      const c10::List<std::optional<at::Tensor>>& biases) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  x.is_contiguous(),
              "dense_bf16: x must be a contiguous 2-D bf16 CPU tensor [n, cols]");
  const int64_t n = x.size(0), cols = x.size(1);
  TORCH_CHECK(n >= 1 && n <= kMaxRows, "dense_bf16: x has ", n, " rows; expected 1 to ", kMaxRows);
  TORCH_CHECK(cols > 0 && cols % kBlock == 0, "dense_bf16: cols (", cols,
              ") must be a positive multiple of ", kBlock);
  TORCH_CHECK(!weights.empty() && biases.size() == weights.size(),
              "dense_bf16: one bias (or None) per weight, and at least one weight");
  struct Task {
    const uint16_t *w, *bias;
    int64_t r0, r1, offset;
  };
  std::vector<Task> tasks;
  int64_t total = 0;
  for (size_t k = 0; k < weights.size(); ++k) {
    const at::Tensor& w = weights[k];
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.dim() == 2 &&
                    w.is_contiguous() && w.size(1) == cols,
                "dense_bf16: each weight must be a contiguous bf16 CPU tensor [rows, ", cols, "]");
    const uint16_t* b = nullptr;
    const std::optional<at::Tensor> bias = biases.get(k);
    if (bias.has_value()) {
      TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->dim() == 1 &&
                      bias->size(0) == w.size(0) && bias->is_contiguous(),
                  "dense_bf16: bias must be a contiguous bf16 [rows] tensor");
      b = reinterpret_cast<const uint16_t*>(bias->const_data_ptr<at::BFloat16>());
    }
    const auto* wp = reinterpret_cast<const uint16_t*>(w.const_data_ptr<at::BFloat16>());
    for (int64_t r0 = 0; r0 < w.size(0); r0 += kTask)
      tasks.push_back({wp, b, r0, std::min(w.size(0), r0 + kTask), total});
    total += w.size(0);
  }
  at::Tensor out = at::empty({n, total}, x.options());
  const at::Tensor packed =
      pack_x(reinterpret_cast<const uint16_t*>(x.const_data_ptr<at::BFloat16>()), n, cols);
  const auto* xp = static_cast<const XT*>(packed.const_data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  // a row's values do not depend on which thread computes it
  ragblend::for_tasks(static_cast<int64_t>(tasks.size()), [&](int64_t t) {
    const Task& task = tasks[t];
    matmul_rows(xp, n, cols, task.w, task.bias, task.r0, task.r1, o + task.offset, total);
  });
  return out;
}

at::Tensor matmul(const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias) {
  c10::List<std::optional<at::Tensor>> biases;
  biases.push_back(bias);
  return matmul_cat(x, {weight}, biases);
}

}  // namespace

#ifndef RAGBLEND_DENSE_NS
#define RAGBLEND_DENSE_NS ragblend_dense
#endif

TORCH_LIBRARY_FRAGMENT(RAGBLEND_DENSE_NS, m) {
  m.def("matmul(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("matmul_cat(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor");
}

TORCH_LIBRARY_IMPL(RAGBLEND_DENSE_NS, CPU, m) {
  m.impl("matmul", &matmul);
  m.impl("matmul_cat", &matmul_cat);
}
