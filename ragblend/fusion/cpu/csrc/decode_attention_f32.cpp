// One decode step's attention for a batch of requests, each over its own K/V buffer.
//
// CPU, float32 math, over K/V buffers of float32 or of bfloat16 (a bf16 model's: each element
// widened exactly to float32 as it is read, so the output is what the same values held in
// float32 give, bit for bit, from half the bytes; q is always float32, the new K/V come in the
// buffers' dtype). Each request b feeds one new token at position p_b: its key and value are
// written into the request's buffers at p_b, then each query head attends keys [lo_b, p_b]
// (lo_b > 0 on a sliding-window layer). Torch would take, per request, two copies and one SDPA
// call whose flash kernel reads K/V at about half the memory bandwidth for a single query row;
// here the whole batch is one call, the query heads that share a KV head read its keys and
// values together (bf16 ones widened once, into L1 scratch, for all of them), and long
// contexts are cut into fixed blocks of keys (flash-decoding) so that even one request keeps
// every thread busy.
//
// Two builds of this file: AVX2 + FMA (8 lanes; the ragblend_native_f32 extension) and, with
// RAGBLEND_DECODE_512, AVX512 (16 lanes: twice the FMAs per instruction where bf16 K/V make
// the step compute-bound; its own extension, RAGBLEND_DECODE_NS). They sum in different
// orders, so each agrees with SDPA to fp32 rounding, not with the other bit for bit.
//
// The block boundaries depend only on the request's own positions, and the blocks are merged
// in order, so a request's output is the same whatever the batch and the thread count: a
// request decoded in a batch gets exactly what it gets alone.
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <tuple>
#include <type_traits>
#include <vector>

#include "decode_step.h"
#include "unroll.h"

namespace {

using ragblend::decode::Block;
using ragblend::decode::decode_step;
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

// rows x dim elements at src (rows src_stride apart) as float32 rows of dim at dst.
template <int D, typename T>
RAGBLEND_INLINE void widen_rows(const T* src, int64_t src_stride, int64_t rows, int64_t dim,
                                float* dst) {
  for (int64_t t = 0; t < rows; ++t) {
    if constexpr (D > 0)
      ragblend::unroll<D / kLanes>([&](auto c) RAGBLEND_INLINE_LAMBDA {
        store(dst + t * D + c * kLanes, load(src + t * src_stride + c * kLanes));
      });
    else
      for (int64_t d = 0; d < dim; d += kLanes)
        store(dst + t * dim + d, load(src + t * src_stride + d));
  }
}

// Scores of `rows` query rows (q, q + q_stride, ...) with keys [begin, end):
// s[r * width + t - begin] = scale * q_r . k_t. wide: kLanes x dim floats of scratch, where
// bf16 keys are widened once, kLanes at a time, for every query row of the group to read as
// float32 (float32 keys are read where they are). D: as dot_lanes'.
template <int D, typename T>
void scores(const float* q, int64_t q_stride, int64_t rows, const T* keys,
            int64_t key_stride, int64_t begin, int64_t end, int64_t dim, float scale, float* s,
            int64_t width, float* wide) {
  const Vec vscale(scale);
  int64_t t = begin;
  for (; t + kLanes <= end; t += kLanes) {
    const float* k;
    int64_t stride;
    if constexpr (std::is_same_v<T, float>) {
      k = keys + t * key_stride;
      stride = key_stride;
    } else {
      widen_rows<D>(keys + t * key_stride, key_stride, kLanes, dim, wide);
      k = wide;
      stride = dim;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const Vec dots = D > 0 && stride == D ? dot_lanes<D>(q + r * q_stride, k, stride, dim)
                                            : dot_lanes<0>(q + r * q_stride, k, stride, dim);
      (dots * vscale).store(s + r * width + t - begin);
    }
  }
  for (; t < end; ++t) {
    const T* k = keys + t * key_stride;
    for (int64_t r = 0; r < rows; ++r) {
      Vec acc(0.0f);
      for (int64_t d = 0; d < dim; d += Vec::size())
        acc = at::vec::fmadd(Vec::loadu(q + r * q_stride + d), Vec(load(k + d)), acc);
      s[r * width + t - begin] =
          scale * at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
    }
  }
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

constexpr int64_t kValueRun = 32;  // value rows copied to L1 (as float32) and weighed together

// out[r, d0 : d0 + kLanes W] (+)= sum_t s[r, t] v[t] over the run's n rows (v: float32 rows
// of dim) for NR rows: their kLanes W columns in registers; out is added to unless first. Per
// element, the same products summed in the same order as one fmadd per value into out.
template <int D, int NR, int W>
RAGBLEND_INLINE void weigh_run(const float* s, const float* v, int64_t n, int64_t d0,
                               int64_t dim, bool first, float* out) {
  if constexpr (D > 0) dim = D;
  Lanes acc[NR][W];
  for (int r = 0; r < NR; ++r)
    for (int w = 0; w < W; ++w)
      acc[r][w] = first ? zero() : load(out + r * dim + d0 + kLanes * w);
  for (int64_t t = 0; t < n; ++t) {
    Lanes vt[W];
    for (int w = 0; w < W; ++w) vt[w] = load(v + t * dim + d0 + kLanes * w);
    for (int r = 0; r < NR; ++r) {
      const Lanes p = broadcast(s[r * kKeyBlock + t]);
      for (int w = 0; w < W; ++w) acc[r][w] = fmadd(p, vt[w], acc[r][w]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int w = 0; w < W; ++w) store(out + r * dim + d0 + kLanes * w, acc[r][w]);
}

// ... 4 kLanes columns at a time over the run's columns (AVX2: 2: its 16 registers)
template <int D, int NR>
void weigh_run(const float* s, const float* v, int64_t n, int64_t dim, bool first, float* out) {
  constexpr int kWide = kLanes == 16 ? 4 : 2;
  int64_t d = 0;
  for (; d + kWide * kLanes <= dim; d += kWide * kLanes)
    weigh_run<D, NR, kWide>(s, v, n, d, dim, first, out);
  for (; d < dim; d += kLanes) weigh_run<D, NR, 1>(s, v, n, d, dim, first, out);
}

// out[r] = sum_t s[r, t] v_t over values [0, n) for `rows` rows, kValueRun values at a time:
// each run read in order (as the hardware prefetches it) into `wide` as float32, then weighed
// from L1 for up to 4 rows at a time.
template <int D, typename T>
void weigh_values(const float* s, int64_t rows, const T* values, int64_t value_stride, int64_t n,
                  int64_t dim, float* wide, float* out) {
  for (int64_t t0 = 0; t0 < n; t0 += kValueRun) {
    const int64_t run = std::min(kValueRun, n - t0);
    widen_rows<D>(values + t0 * value_stride, value_stride, run, dim, wide);
    for (int64_t r = 0; r < rows; r += 4) {
      const float* sr = s + r * kKeyBlock + t0;
      float* o = out + r * dim;
      switch (std::min<int64_t>(4, rows - r)) {
        case 1: weigh_run<D, 1>(sr, wide, run, dim, t0 == 0, o); break;
        case 2: weigh_run<D, 2>(sr, wide, run, dim, t0 == 0, o); break;
        case 3: weigh_run<D, 3>(sr, wide, run, dim, t0 == 0, o); break;
        default: weigh_run<D, 4>(sr, wide, run, dim, t0 == 0, o); break;
      }
    }
  }
}

// The query heads of one KV head over one block of its keys: per row r, its max and sum of
// exps, and out[r] = sum_t exp(s_rt - max_r) v_t (unnormalised). s: rows x kKeyBlock scratch,
// wide: max(kLanes, kValueRun) x dim. D: the head dim where it is known when compiling, else 0.
template <int D, typename T>
void attend_block(const float* q, int64_t q_stride, int64_t rows, const T* keys,
                  const T* values, int64_t key_stride, int64_t value_stride, int64_t begin,
                  int64_t end, int64_t dim, float scale, float* s, float* wide, float* maxes,
                  float* sums, float* out) {
  const int64_t n = end - begin;
  scores<D>(q, q_stride, rows, keys, key_stride, begin, end, dim, scale, s, kKeyBlock, wide);
  for (int64_t r = 0; r < rows; ++r)
    std::tie(maxes[r], sums[r]) = exponentiate(s + r * kKeyBlock, n);
  if constexpr (std::is_same_v<T, float>) {
    // float32 values are memory-bound: one pass over each row, added into out in place
    std::fill(out, out + rows * dim, 0.0f);
    for (int64_t t = 0; t < n; ++t) {
      const float* v = values + (begin + t) * value_stride;
      for (int64_t r = 0; r < rows; ++r) {
        const Vec p(s[r * kKeyBlock + t]);
        float* o = out + r * dim;
        for (int64_t d = 0; d < dim; d += Vec::size())
          at::vec::fmadd(p, Vec::loadu(v + d), Vec::loadu(o + d)).store(o + d);
      }
    }
  } else {  // bf16 values are compute-bound: widened once, out's columns in registers
    weigh_values<D>(s, rows, values + begin * value_stride, value_stride, n, dim, wide, out);
  }
}

// T: the K/V element (float, or uint16_t for bfloat16's bits); see decode_attend.
template <typename T>
at::Tensor decode_attend_as(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                            at::TensorList keys, at::TensorList values, at::IntArrayRef positions,
                            int64_t window, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat, "decode_attend: expects float32 q [1, H, B, d]");
  const int64_t dim = q.size(3), groups = q.size(1) / k_new.size(1);
  TORCH_CHECK(dim % kLanes == 0, "decode_attend: the head dim must be a multiple of ", kLanes);
  const float fscale = static_cast<float>(scale);
  const float* qd = q.const_data_ptr<float>();
  const auto make_worker = [&] {
    return [&, s = std::vector<float>(groups * kKeyBlock),
            wide = std::vector<float>(std::max(kLanes, kValueRun) * dim)](
               const Block& blk, const T* kh, const T* vh, int64_t key_stride,
               int64_t value_stride, float* maxes, float* sums, float* out) mutable {
      const float* qrows = qd + blk.head * groups * q.stride(1) + blk.request * q.stride(2);
      const auto attend = [&](auto head_dim) {
        attend_block<decltype(head_dim)::value>(
            qrows, q.stride(1), groups, kh, vh, key_stride, value_stride, blk.begin, blk.end,
            dim, fscale, s.data(), wide.data(), maxes, sums, out);
      };
      if (dim == 64) attend(std::integral_constant<int, 64>{});
      else if (dim == 128) attend(std::integral_constant<int, 128>{});
      else attend(std::integral_constant<int, 0>{});
    };
  };
  return decode_step<T>(q, k_new, v_new, keys, values, positions, window, make_worker);
}

// q [1, H, B, d] float32; k_new, v_new [1, Hkv, B, d] and keys[b], values[b] [1, Hkv,
// capacity, d] (d contiguous), all float32 or all bfloat16; the new K/V written at
// positions[b]; window 0 for none -> float32 [1, B, H * d]
at::Tensor decode_attend(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                         at::TensorList keys, at::TensorList values, at::IntArrayRef positions,
                         int64_t window, double scale) {
  TORCH_CHECK(!keys.empty(), "decode_attend: no requests");
  switch (keys[0].scalar_type()) {
    case at::kFloat:
      return decode_attend_as<float>(q, k_new, v_new, keys, values, positions, window, scale);
    case at::kBFloat16:
      return decode_attend_as<uint16_t>(q, k_new, v_new, keys, values, positions, window, scale);
    default:
      TORCH_CHECK(false, "decode_attend: K/V buffers must be float32 or bfloat16, got ",
                  keys[0].scalar_type());
  }
}

}  // namespace

#ifndef RAGBLEND_DECODE_NS
#define RAGBLEND_DECODE_NS ragblend_native_f32
#endif

TORCH_LIBRARY_FRAGMENT(RAGBLEND_DECODE_NS, m) {
  m.def(
      "decode_attend(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!)[] keys, Tensor(b!)[] "
      "values, int[] positions, int window, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(RAGBLEND_DECODE_NS, CPU, m) { m.impl("decode_attend", &decode_attend); }
