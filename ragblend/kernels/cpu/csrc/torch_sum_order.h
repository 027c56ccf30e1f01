// The order in which torch 2.13 sums a contiguous fp32 row on CPU (ATen's SumKernel.cpp, 8-lane
// Vectorized<float>: four interleaved vector accumulators with its cascade levels, then the
// scalar tail, then the lanes left to right), applied to the squares of a row: the sum in
// HF's RMSNorm, `x.pow(2).mean(-1)`, bit for bit. fusion/native.py checks each kernel built
// on it against torch once per process, since the order is torch's implementation detail.
//
// Include after `#pragma GCC optimize("fp-contract=off")`: a square must be rounded before it
// is added.
#pragma once

#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace ragblend {

constexpr int64_t kSumLanes = 8;  // lanes of torch's fp32 sum (Vectorized<float> under AVX2)
constexpr int64_t kIlp = 4;       // SumKernel.cpp's row_sum ilp_factor
constexpr int64_t kLevels = 4;    // and multi_row_sum's num_levels

// the squares of values 8 * vec .. 8 * vec + 7, widened to fp32
inline __m256 square8(const c10::BFloat16* row, int64_t vec) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + vec * kSumLanes));
  const __m256 x = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
  return _mm256_mul_ps(x, x);
}

inline __m256 square8(const float* row, int64_t vec) {
  const __m256 x = _mm256_loadu_ps(row + vec * kSumLanes);
  return _mm256_mul_ps(x, x);
}

inline int64_t ceil_log2(int64_t x) {  // c10::utils::CeilLog2
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// multi_row_sum<Vectorized<float>, 4> over `size` groups of four vectors, then row_sum's tail
// and the fold of its four accumulators
template <typename T>
__m256 vector_sum_of_squares(const T* row, int64_t vectors) {
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
template <typename T>
float sum_of_squares(const T* row, int64_t width) {
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

}  // namespace ragblend
