// HF's LlamaRMSNorm (Llama, Mistral, Qwen2, Qwen3) in bfloat16, bit for bit, in one pass.
//
// torch runs it as six passes over the rows with fp32 temporaries:
//   x = x.float(); var = x.pow(2).mean(-1); x = x * rsqrt(var + eps); weight * x.bfloat16()
// Here each row is read once and written once. The values are torch's because every step is
// the same IEEE operation in the same order: the squares are summed in the order of torch's
// CPU sum over a contiguous fp32 row (SumKernel.cpp, which torch 2.13 dispatches with 8-lane
// vectors: four interleaved vector accumulators with its cascade levels, then the lanes left to
// right; fusion/native.py checks this against torch once per process), the mean divides by
// the width, rsqrt is 1 / sqrt, and each product is rounded to bfloat16 where torch rounds it.
//
// No multiply-add may be contracted into an FMA (a square must be rounded before it is added).
#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>

#include "torch_sum_order.h"

namespace {

using at::BFloat16;
using ragblend::sum_of_squares;
constexpr int64_t kLanes = 16;  // bfloat16 values per AVX512 step of the normalisation

inline __m512 load16(const BFloat16* p) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

inline __m512 round16(__m512 x) {
  const __m256i b = (__m256i)_mm512_cvtneps_pbh(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

inline BFloat16 to_bf16(float x) { return static_cast<BFloat16>(x); }  // nearest even

// x [..., D] bfloat16 with contiguous rows, weight [D] bfloat16 -> a new tensor like x
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "rms_norm: expects bfloat16 x and weight");
  const int64_t width = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == width && weight.is_contiguous(),
              "rms_norm: weight must be [D] matching x's last dim");
  TORCH_CHECK(x.is_contiguous(), "rms_norm: expects a contiguous x");
  at::Tensor out = at::empty_like(x);
  const int64_t rows = width ? x.numel() / width : 0;
  const BFloat16* xd = x.const_data_ptr<BFloat16>();
  const BFloat16* wd = weight.const_data_ptr<BFloat16>();
  BFloat16* od = out.data_ptr<BFloat16>();
  const float eps32 = static_cast<float>(eps);
  const float count = static_cast<float>(width);
  const int64_t vectors = width / kLanes;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const BFloat16* row = xd + r * width;
      BFloat16* dst = od + r * width;
      const float variance = sum_of_squares(row, width) / count;
      const float inv = 1.0f / std::sqrt(variance + eps32);
      const __m512 vinv = _mm512_set1_ps(inv);
      for (int64_t v = 0; v < vectors; ++v) {
        const int64_t c = v * kLanes;
        const __m512 y = round16(_mm512_mul_ps(load16(row + c), vinv));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(load16(wd + c), y)));
      }
      for (int64_t c = vectors * kLanes; c < width; ++c) {
        const float y = static_cast<float>(to_bf16(static_cast<float>(row[c]) * inv));
        dst[c] = to_bf16(static_cast<float>(wd[c]) * y);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ragblend_native, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(ragblend_native, CPU, m) { m.impl("rms_norm", &rms_norm); }
