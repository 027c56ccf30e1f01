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

#include "decode_lanes.h"
#include "decode_step.h"
#include "unroll.h"

namespace {

using ragblend::decode::Block;
using ragblend::decode::decode_step;

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

// out[r] = sum_t s[r, t] v_t over values [0, n) for `rows` rows, kValueRun values at a time:
// each run read in order (as the hardware prefetches it) into `wide` as float32, then weighed
// from L1 for up to 4 rows at a time.
template <int D, typename T>
void weigh_values(const float* s, int64_t rows, const T* values, int64_t value_stride, int64_t n,
                  int64_t dim, float* wide, float* out) {
  for (int64_t t0 = 0; t0 < n; t0 += kValueRun) {
    const int64_t run = std::min(kValueRun, n - t0);
    widen_rows<D>(values + t0 * value_stride, value_stride, run, dim, wide);
    weigh_rows<D>(FloatRun<D>{s + t0, wide, dim}, rows, run, dim, t0 == 0, out);
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
