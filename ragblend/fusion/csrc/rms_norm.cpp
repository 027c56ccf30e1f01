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

namespace {

using at::BFloat16;
constexpr int64_t kLanes = 16;  // bfloat16 values per AVX512 step of the normalisation
constexpr int64_t kSumLanes = 8;  // lanes of torch's fp32 sum (Vectorized<float> under AVX2)
constexpr int64_t kIlp = 4;     // SumKernel.cpp's row_sum ilp_factor
constexpr int64_t kLevels = 4;  // and multi_row_sum's num_levels

inline __m512 load16(const BFloat16* p) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

inline __m512 round16(__m512 x) {
  const __m256i b = (__m256i)_mm512_cvtneps_pbh(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

inline __m256 square8(const BFloat16* row, int64_t vec) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + vec * kSumLanes));
  const __m256 x = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
  return _mm256_mul_ps(x, x);
}

inline int64_t ceil_log2(int64_t x) {  // c10::utils::CeilLog2
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// multi_row_sum<Vectorized<float>, 4> over `size` groups of four vectors, then row_sum's tail
// and the fold of its four accumulators
__m256 vector_sum_of_squares(const BFloat16* row, int64_t vectors) {
  const int64_t size = vectors / kIlp;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(size) / kLevels);
  const int64_t level_step = int64_t{1} << level_power;
  const int64_t level_mask = level_step - 1;
  __m256 acc[kLevels][kIlp];
  for (auto& level : acc) {
    for (auto& a : level) a = _mm256_setzero_ps();
  }
  int64_t i = 0;
  while (i + level_step <= size) {
    for (int64_t j = 0; j < level_step; ++j, ++i) {
      for (int64_t k = 0; k < kIlp; ++k) {
        acc[0][k] = _mm256_add_ps(acc[0][k], square8(row, i * kIlp + k));
      }
    }
    for (int64_t j = 1; j < kLevels; ++j) {
      for (int64_t k = 0; k < kIlp; ++k) {
        acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = _mm256_setzero_ps();
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i) {
    for (int64_t k = 0; k < kIlp; ++k) {
      acc[0][k] = _mm256_add_ps(acc[0][k], square8(row, i * kIlp + k));
    }
  }
  for (int64_t j = 1; j < kLevels; ++j) {
    for (int64_t k = 0; k < kIlp; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
  }
  for (int64_t v = size * kIlp; v < vectors; ++v) {
    acc[0][0] = _mm256_add_ps(acc[0][0], square8(row, v));
  }
  for (int64_t k = 1; k < kIlp; ++k) acc[0][0] = _mm256_add_ps(acc[0][0], acc[0][k]);
  return acc[0][0];
}

// vectorized_inner_sum: the scalar tail first, then the vector's lanes left to right
float sum_of_squares(const BFloat16* row, int64_t width) {
  const int64_t vectors = width / kSumLanes;
  float total = 0.0f;
  for (int64_t c = vectors * kSumLanes; c < width; ++c) {
    const float x = static_cast<float>(row[c]);
    total += x * x;
  }
  alignas(32) float lanes[kSumLanes];
  _mm256_store_ps(lanes, vector_sum_of_squares(row, vectors));
  for (int64_t l = 0; l < kSumLanes; ++l) total += lanes[l];
  return total;
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
