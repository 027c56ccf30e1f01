// What both decode-step attention kernels share (decode_attention_f32.cpp: float32 math over
// float32 or bf16 K/V; decode_attention_bf16.cpp: AVX512-BF16 dot products over bf16): the
// checks, the new token's K/V written at its position, the cut into fixed key blocks that
// threads share, the in-order merge of the blocks, and (AVX512 builds) the transposing
// reduction of 16 dot products.
//
// A request's blocks depend only on its own position, and they are merged in order, so its
// output is the same whatever the batch and the thread count.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "unroll.h"

namespace ragblend::decode {

constexpr int64_t kKeyBlock = 512;  // keys per task: K and V of one KV head stay in L2

struct Block {
  int64_t request, head, begin, end;  // KV head `head` of `request`, keys [begin, end)
};

#ifdef __AVX512F__
// A transposing reduction: lane j of the result is the sum of acc[j]'s lanes. Each stage adds
// halves of two vectors (256-bit, 128-bit, 64-bit, 32-bit pieces), leaving the sums of keys
// in the order 0 2 1 3 8 10 9 11 4 6 5 7 12 14 13 15, which one permute sorts.
RAGBLEND_INLINE __m512 sum_lanes16(__m512* acc) {
  ragblend::unroll<8>([&](auto j) RAGBLEND_INLINE_LAMBDA {
    acc[j] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[j], acc[j + 8], 0x44),
                           _mm512_shuffle_f32x4(acc[j], acc[j + 8], 0xEE));
  });
  ragblend::unroll<4>([&](auto j) RAGBLEND_INLINE_LAMBDA {
    acc[j] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[j], acc[j + 4], 0x88),
                           _mm512_shuffle_f32x4(acc[j], acc[j + 4], 0xDD));
  });
  ragblend::unroll<2>([&](auto j) RAGBLEND_INLINE_LAMBDA {
    const __m512d a = _mm512_castps_pd(acc[j]), b = _mm512_castps_pd(acc[j + 2]);
    acc[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  });
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(acc[0], acc[1], 0x88),
                                   _mm512_shuffle_ps(acc[0], acc[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(order, sums);
}
#endif

// One decode step for a batch: q [1, H, B, d] (its dtype checked by the caller), k_new, v_new
// [1, Hkv, B, d] and keys[b], values[b] [1, Hkv, capacity, d], all of element T (d
// contiguous); request b's new K/V written at positions[b], then each query head attends
// keys [lo_b, p_b] (window 0: lo_b = 0) -> float32 [1, B, H * d].
//
// make_worker() is called once per thread; the worker it returns,
//   worker(const Block& blk, const T* keys, const T* values, int64_t key_stride,
//          int64_t value_stride, float* maxes, float* sums, float* out),
// attends the `groups` query heads of KV head blk.head of request blk.request over keys
// [blk.begin, blk.end) (keys, values: that head's rows, key_stride / value_stride elements
// apart): per query head g, maxes[g] (its largest score), sums[g] (the sum of exp(score -
// max)) and out[g * d + :] those exps times the values,
// exps times the values, unnormalised.
template <typename T, class MakeWorker>
at::Tensor decode_step(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                       at::TensorList keys, at::TensorList values, at::IntArrayRef positions,
                       int64_t window, MakeWorker&& make_worker) {
  const int64_t batch = q.size(2), heads = q.size(1), dim = q.size(3);
  TORCH_CHECK(q.dim() == 4 && q.size(0) == 1 && q.stride(3) == 1,
              "decode_attend: expects q [1, H, B, d]");
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == batch &&
                  static_cast<int64_t>(values.size()) == batch &&
                  static_cast<int64_t>(positions.size()) == batch,
              "decode_attend: one K buffer, V buffer and position per request");
  const int64_t kv_heads = k_new.size(1);
  TORCH_CHECK(heads % kv_heads == 0, "decode_attend: query heads must be a multiple of KV heads");
  const at::ScalarType kv = keys[0].scalar_type();
  for (const at::Tensor* t : {&k_new, &v_new})
    TORCH_CHECK(t->dim() == 4 && t->size(1) == kv_heads && t->size(2) == batch &&
                    t->size(3) == dim && t->stride(3) == 1 && t->scalar_type() == kv,
                "decode_attend: expects k_new, v_new [1, Hkv, B, d] in the buffers' dtype");
  for (int64_t b = 0; b < batch; ++b) {
    for (const at::Tensor* t : {&keys[b], &values[b]})
      TORCH_CHECK(t->dim() == 4 && t->size(1) == kv_heads && t->size(3) == dim &&
                      t->stride(3) == 1 && t->scalar_type() == kv,
                  "decode_attend: expects buffers [1, Hkv, capacity, d] of one dtype");
    TORCH_CHECK(positions[b] >= 0 && positions[b] < keys[b].size(2) &&
                    positions[b] < values[b].size(2),
                "decode_attend: position ", positions[b], " outside the buffer");
  }
  const int64_t groups = heads / kv_heads;

  std::vector<Block> blocks;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t p = positions[b];
    const int64_t lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t t = lo; t <= p; t += kKeyBlock)
        blocks.push_back({b, h, t, std::min(t + kKeyBlock, p + 1)});
      for (const at::Tensor* src : {&k_new, &v_new}) {  // the new token's K/V at p
        const at::Tensor& dst = src == &k_new ? keys[b] : values[b];
        const T* from = static_cast<const T*>(src->const_data_ptr()) + h * src->stride(1) +
                        b * src->stride(2);
        T* to = static_cast<T*>(dst.data_ptr()) + h * dst.stride(1) + p * dst.stride(2);
        std::copy(from, from + dim, to);
      }
    }
  }
  const int64_t count = static_cast<int64_t>(blocks.size());
  // per block and query head of its group: max, sum of exps, unnormalised output
  std::vector<float> maxes(count * groups), sums(count * groups);
  at::Tensor partial = at::empty({count * groups, dim}, at::kFloat);
  float* pd = partial.data_ptr<float>();
  at::parallel_for(0, count, 1, [&](int64_t first, int64_t last) {
    auto worker = make_worker();
    for (int64_t i = first; i < last; ++i) {
      const Block& blk = blocks[i];
      const at::Tensor& k = keys[blk.request];
      const at::Tensor& v = values[blk.request];
      worker(blk, static_cast<const T*>(k.const_data_ptr()) + blk.head * k.stride(1),
             static_cast<const T*>(v.const_data_ptr()) + blk.head * v.stride(1), k.stride(2),
             v.stride(2), maxes.data() + i * groups, sums.data() + i * groups,
             pd + i * groups * dim);
    }
  });

  at::Tensor out = at::empty({1, batch, heads * dim}, at::kFloat);
  float* od = out.data_ptr<float>();
  // merge each (request, KV head)'s consecutive blocks in order
  for (int64_t i = 0; i < count;) {
    int64_t j = i;
    while (j < count && blocks[j].request == blocks[i].request && blocks[j].head == blocks[i].head)
      ++j;
    for (int64_t g = 0; g < groups; ++g) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t x = i; x < j; ++x) top = std::max(top, maxes[x * groups + g]);
      float total = 0.0f;
      float* dst = od + blocks[i].request * heads * dim + (blocks[i].head * groups + g) * dim;
      std::fill(dst, dst + dim, 0.0f);
      for (int64_t x = i; x < j; ++x) {
        const float w = std::exp(maxes[x * groups + g] - top);
        total += w * sums[x * groups + g];
        const float* src = pd + (x * groups + g) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] += w * src[d];
      }
      for (int64_t d = 0; d < dim; ++d) dst[d] /= total;
    }
    i = j;
  }
  return out;
}

}  // namespace ragblend::decode
