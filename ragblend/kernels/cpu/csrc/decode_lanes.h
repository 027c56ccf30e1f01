// The float32 lanes of the decode attention kernels and the steps they share once a run of
// keys or values is float32: the dot products of a query row with kLanes keys, the block's
// exponentiation and the weighing of value rows with the query rows' columns in registers.
// AVX2 + FMA (8 lanes), or AVX512 (16) where the including file is built with
// RAGBLEND_DECODE_512 (decode_attention_f32.cpp's second build).
//
// Everything is in an anonymous namespace: each kernel file is its own extension, and two of
// them (the AVX2 and AVX512 builds) may be loaded in one process, so an inline function of
// one build must never bind to the other's (a named namespace's weak symbols would).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include "decode_step.h"
#include "unroll.h"

namespace {

using ragblend::decode::kKeyBlock;
using Vec = at::vec::Vectorized<float>;

#ifdef RAGBLEND_DECODE_512
using Lanes = __m512;
constexpr int64_t kLanes = 16;

// Sixteen K/V elements as float32: float32 as they are, bfloat16 (its bits) widened exactly.
inline Lanes load(const float* p) { return _mm512_loadu_ps(p); }
inline Lanes load(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline Lanes zero() { return _mm512_setzero_ps(); }
inline Lanes fmadd(Lanes a, Lanes b, Lanes c) { return _mm512_fmadd_ps(a, b, c); }
inline Lanes broadcast(float x) { return _mm512_set1_ps(x); }
inline void store(float* p, Lanes v) { _mm512_storeu_ps(p, v); }

RAGBLEND_INLINE Lanes sum_lanes(Lanes* acc) { return ragblend::decode::sum_lanes16(acc); }
#else
using Lanes = __m256;
constexpr int64_t kLanes = 8;

// Eight K/V elements as float32: float32 as they are, bfloat16 (its bits) widened exactly.
inline Lanes load(const float* p) { return _mm256_loadu_ps(p); }
inline Lanes load(const uint16_t* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline Lanes zero() { return _mm256_setzero_ps(); }
inline Lanes fmadd(Lanes a, Lanes b, Lanes c) { return _mm256_fmadd_ps(a, b, c); }
inline Lanes broadcast(float x) { return _mm256_set1_ps(x); }
inline void store(float* p, Lanes v) { _mm256_storeu_ps(p, v); }

// A transposing reduction: lane j of the result is the sum of acc[j]'s lanes.
RAGBLEND_INLINE Lanes sum_lanes(Lanes* acc) {
  const __m256 s01 = _mm256_hadd_ps(acc[0], acc[1]), s23 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 s45 = _mm256_hadd_ps(acc[4], acc[5]), s67 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
  const __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(lo, hi);
}
#endif
static_assert(kLanes == Vec::size(), "at::vec's width must be the build's");

// kLanes dot products with one query row: [q . k_0, ..., q . k_{kLanes - 1}], key j at
// k + j * key_stride. D: the head dim where it is known when compiling (its loop unrolled,
// the key offsets constants), else 0 and `dim`.
template <int D, typename T>
RAGBLEND_INLINE Vec dot_lanes(const float* q, const T* k, int64_t key_stride, int64_t dim) {
  Lanes acc[kLanes];
  ragblend::unroll<kLanes>([&](auto j) RAGBLEND_INLINE_LAMBDA { acc[j] = zero(); });
  const auto chunk = [&](int64_t d) RAGBLEND_INLINE_LAMBDA {
    const Lanes qd = load(q + d);
    ragblend::unroll<kLanes>([&](auto j) RAGBLEND_INLINE_LAMBDA {
      acc[j] = fmadd(qd, load(k + j * (D ? D : key_stride) + d), acc[j]);
    });
  };
  if constexpr (D > 0)
    ragblend::unroll<D / kLanes>([&](auto c) RAGBLEND_INLINE_LAMBDA { chunk(c * kLanes); });
  else
    for (int64_t d = 0; d < dim; d += kLanes) chunk(d);
  return Vec(sum_lanes(acc));
}

// exp(s - max) in place over n scores; returns (max, sum of the exps).
std::pair<float, float> exponentiate(float* s, int64_t n) {
  const float max = at::vec::reduce_all<float>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, s, n);
  const Vec shift(-max);
  int64_t j = 0;
  Vec acc(0.0f);
  for (; j + Vec::size() <= n; j += Vec::size()) {
    const Vec e = (Vec::loadu(s + j) + shift).exp_u20();
    acc = acc + e;
    e.store(s + j);
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - max);
    sum += s[j];
  }
  return {max, sum};
}

constexpr int64_t kValueRun = 32;  // value rows weighed together (float32 ones copied to L1 first)

// A run of value rows to weigh (weigh_rows), as a kernel stores them: value(t, col), value
// row t's kLanes columns from col as float32; weight(r, t, col), query row r's weight of value
// t for those columns; rows_from(r), the same run seen from query row r on. FloatRun: float32
// rows of dim at v, weighed by the rows' scores s (kKeyBlock apart).
template <int D>
struct FloatRun {
  const float* s;
  const float* v;
  int64_t dim;
  RAGBLEND_INLINE Lanes value(int64_t t, int64_t col) const {
    return load(v + t * (D ? D : dim) + col);
  }
  RAGBLEND_INLINE float weight(int64_t r, int64_t t, int64_t) const { return s[r * kKeyBlock + t]; }
  FloatRun rows_from(int64_t r) const { return {s + r * kKeyBlock, v, dim}; }
};

// out[r, d0 : d0 + kLanes W] (+)= sum_t weight(r, t) value(t) over the run's n rows for NR
// query rows: their kLanes W columns in registers; out is added to unless first. Per element,
// the same products summed in the same order as one fmadd per value into out.
template <int D, int NR, int W, class Run>
RAGBLEND_INLINE void weigh_run(const Run& run, int64_t n, int64_t d0, int64_t dim, bool first,
                               float* out) {
  if constexpr (D > 0) dim = D;
  Lanes acc[NR][W];
  for (int r = 0; r < NR; ++r)
    for (int w = 0; w < W; ++w)
      acc[r][w] = first ? zero() : load(out + r * dim + d0 + kLanes * w);
  for (int64_t t = 0; t < n; ++t) {
    Lanes vt[W];
    for (int w = 0; w < W; ++w) vt[w] = run.value(t, d0 + kLanes * w);
    for (int r = 0; r < NR; ++r)
      for (int w = 0; w < W; ++w)
        acc[r][w] = fmadd(broadcast(run.weight(r, t, d0 + kLanes * w)), vt[w], acc[r][w]);
  }
  for (int r = 0; r < NR; ++r)
    for (int w = 0; w < W; ++w) store(out + r * dim + d0 + kLanes * w, acc[r][w]);
}

// ... 4 kLanes columns at a time over the run's columns (AVX2: 2: its 16 registers)
template <int D, int NR, class Run>
void weigh_run(const Run& run, int64_t n, int64_t dim, bool first, float* out) {
  constexpr int kWide = kLanes == 16 ? 4 : 2;
  int64_t d = 0;
  for (; d + kWide * kLanes <= dim; d += kWide * kLanes)
    weigh_run<D, NR, kWide>(run, n, d, dim, first, out);
  for (; d < dim; d += kLanes) weigh_run<D, NR, 1>(run, n, d, dim, first, out);
}

// out[r] (+)= sum_t weight(r, t) value(t) for `rows` query rows over one run of n value rows
// (see FloatRun), up to 4 rows at a time; out (rows of dim) is added to unless first.
template <int D, class Run>
void weigh_rows(const Run& run, int64_t rows, int64_t n, int64_t dim, bool first, float* out) {
  for (int64_t r = 0; r < rows; r += 4) {
    const Run from = run.rows_from(r);
    float* o = out + r * dim;
    switch (std::min<int64_t>(4, rows - r)) {
      case 1: weigh_run<D, 1>(from, n, dim, first, o); break;
      case 2: weigh_run<D, 2>(from, n, dim, first, o); break;
      case 3: weigh_run<D, 3>(from, n, dim, first, o); break;
      default: weigh_run<D, 4>(from, n, dim, first, o); break;
    }
  }
}

}  // namespace
