// One decode step's attention for a batch of requests over an 8-bit K/V cache
// (BlendConfig.kv_cache_dtype = "int8"), AVX2 + FMA at 8 lanes; built again with
// -DRAGBLEND_DECODE_512 at 16 (AVX512 F/BW/VL/DQ, op namespace RAGBLEND_DECODE_Q8_NS).
//
// Layout (llama.cpp's q8_0, scales kept apart from the codes): a K or V buffer is int8 codes
// [1, Hkv, capacity, d] beside float32 scales [1, Hkv, capacity, d / block], one scale per
// `block` consecutive values of a row along the head dim (block = 32 where d is a multiple of
// 32, else d: one scale per row); symmetric: scale = amax / 127 over the block, code =
// round-half-even(x / scale) (0 where the block is all zeros), x ~ code * scale.
//
// The new token's K/V come in float32 and are quantized here (the same codes and scales
// ragblend.fusion.decode_q8.quantize_q8 gives in torch: one IEEE division and rounding per
// value), written at each request's position, then each query head attends keys [lo_b, p_b].
// q is float32 and so is everything after the codes: each run of keys is widened (code *
// scale, the float32 product torch's dequantization gives) into L1 scratch once for all query
// heads of its KV head and scored there; the values are weighed straight from their codes,
// each weight times the value's scale first (weigh_values). The result is SDPA's over the
// dequantized K/V to float32 rounding, from about a quarter of fp32's bytes.
//
// The key blocks, their merge and the write of the new codes: decode_step.h, as the other
// decode kernels'. A request's blocks depend only on its own position, so a request decoded in
// a batch gets exactly what it gets alone.
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "decode_lanes.h"
#include "decode_step.h"
#include "unroll.h"

#ifndef RAGBLEND_DECODE_Q8_NS
#define RAGBLEND_DECODE_Q8_NS ragblend_decode_q8
#endif

namespace {

using ragblend::decode::Block;
using ragblend::decode::decode_step;

// kLanes codes at c as float32 (exactly: |code| <= 127), and times d: the float32 product
// torch's dequantization gives
#ifdef RAGBLEND_DECODE_512
inline Lanes code_lanes(const int8_t* c) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}
inline Lanes widen_lanes(const int8_t* c, Lanes d) { return _mm512_mul_ps(code_lanes(c), d); }
#else
inline Lanes code_lanes(const int8_t* c) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}
inline Lanes widen_lanes(const int8_t* c, Lanes d) { return _mm256_mul_ps(code_lanes(c), d); }
#endif

// Codes and scales of one buffer (one KV head of one request): row t's codes at
// codes + t * code_stride, its dim / block scales at scales + t * scale_stride.
struct Rows {
  const int8_t* codes;
  const float* scales;
  int64_t code_stride, scale_stride, block;
};

constexpr int64_t kFixedBlock = 32;  // the scale block of a head dim known when compiling
constexpr int64_t kAheadRows = 64;   // rows of codes (and their scales) prefetched ahead

// Row t + kAheadRows's codes (every cache line of its dim) and scales prefetched: one stream
// per KV head outruns the hardware prefetcher, as the weights' do (quant_int8.cpp).
RAGBLEND_INLINE void prefetch_ahead(const Rows& src, int64_t t, int64_t dim) {
  const char* codes = reinterpret_cast<const char*>(src.codes + (t + kAheadRows) * src.code_stride);
  for (int64_t line = 0; line < dim; line += 64) _mm_prefetch(codes + line, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(src.scales + (t + kAheadRows) * src.scale_stride),
               _MM_HINT_T0);
}

// Rows [t0, t0 + n) of `src` as float32 rows of dim at dst: code * scale. D: the head dim
// where it is known when compiling (its scale block then kFixedBlock, the loop unrolled),
// else 0 and `dim`, `src.block`.
template <int D>
RAGBLEND_INLINE void widen(const Rows& src, int64_t t0, int64_t n, int64_t dim, float* dst) {
  for (int64_t t = t0; t < t0 + n; ++t, dst += D ? D : dim) {
    const int8_t* c = src.codes + t * src.code_stride;
    const float* s = src.scales + t * src.scale_stride;
    prefetch_ahead(src, t, D ? D : dim);
    if constexpr (D > 0) {
      ragblend::unroll<D / kLanes>([&](auto i) RAGBLEND_INLINE_LAMBDA {
        constexpr int64_t at = i * kLanes;
        store(dst + at, widen_lanes(c + at, broadcast(s[at / kFixedBlock])));
      });
    } else {
      for (int64_t j = 0; j < dim; j += src.block) {
        const Lanes d = broadcast(s[j / src.block]);
        for (int64_t i = j; i < j + src.block; i += kLanes) store(dst + i, widen_lanes(c + i, d));
      }
    }
  }
}

// s[r * kKeyBlock + t - begin] = scale * q_r . k_t for keys [begin, end) and `rows` query rows
// (q_stride apart); keys widened kLanes at a time into wide (kLanes x dim), a short last run
// padded with zero rows so that every key is scored the same way.
template <int D>
void scores(const float* q, int64_t q_stride, int64_t rows, const Rows& keys, int64_t begin,
            int64_t end, int64_t dim, float scale, float* s, float* wide) {
  const Vec vscale(scale);
  for (int64_t t = begin; t < end; t += kLanes) {
    const int64_t n = std::min(kLanes, end - t);
    widen<D>(keys, t, n, dim, wide);
    if (n < kLanes) std::fill(wide + n * dim, wide + kLanes * dim, 0.0f);
    for (int64_t r = 0; r < rows; ++r)
      (dot_lanes<D>(q + r * q_stride, wide, dim, dim) * vscale)
          .store(s + r * kKeyBlock + t - begin, static_cast<int>(n));
  }
}

// A run of value rows [t0, t0 + n) of `values` weighed straight from their codes (weigh_rows'
// Run, see FloatRun): the weight of value t for the columns at col is the row's weight times
// the scale of col's block, at w + (block * rows + r) * kValueRun + t (weigh_values).
template <int D>
struct CodeRun {
  const float* w;
  const Rows* values;
  int64_t t0, rows;
  RAGBLEND_INLINE Lanes value(int64_t t, int64_t col) const {
    return code_lanes(values->codes + (t0 + t) * values->code_stride + col);
  }
  RAGBLEND_INLINE float weight(int64_t r, int64_t t, int64_t col) const {
    const int64_t block = D > 0 ? kFixedBlock : values->block;
    return (w + col / block * rows * kValueRun)[r * kValueRun + t];  // col's block's weights
  }
  CodeRun rows_from(int64_t r) const { return {w + r * kValueRun, values, t0, rows}; }
};

// out[r] = sum_t s[r, t] v_t over values [begin, begin + n) for `rows` rows, straight from the
// codes: per kValueRun values, each row's weights times each value's scales (w: scratch of
// blocks x (rows + 1) x kValueRun, blocks = dim / scale block), then the codes weighed by
// them for up to 4 rows at a time. Per value, s * scale * code where dequantizing gives
// s * (code * scale): the same to float32 rounding, without writing the widened values.
template <int D>
void weigh_values(const float* s, int64_t rows, const Rows& values, int64_t begin, int64_t n,
                  int64_t dim, float* w, float* out) {
  if constexpr (D > 0) dim = D;
  const int64_t blocks = dim / (D > 0 ? kFixedBlock : values.block);
  for (int64_t t0 = 0; t0 < n; t0 += kValueRun) {
    const int64_t run = std::min(kValueRun, n - t0);
    float* columns = w + blocks * rows * kValueRun;  // the run's scales, block by block
    for (int64_t t = 0; t < run; ++t) {
      const int64_t row = begin + t0 + t;
      prefetch_ahead(values, row, dim);
      for (int64_t b = 0; b < blocks; ++b)
        columns[b * kValueRun + t] = values.scales[row * values.scale_stride + b];
    }
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t t = 0; t < run; t += Vec::size()) {
          const int n = static_cast<int>(std::min<int64_t>(Vec::size(), run - t));
          (Vec::loadu(s + r * kKeyBlock + t0 + t, n) * Vec::loadu(columns + b * kValueRun + t, n))
              .store(w + (b * rows + r) * kValueRun + t, n);
        }
    weigh_rows<D>(CodeRun<D>{w, &values, begin + t0, rows}, rows, run, dim, t0 == 0, out);
  }
}

// The query heads of one KV head over keys [begin, end): per row r its max, its sum of exps
// and out[r] = sum_t exp(s_rt - max_r) v_t (unnormalised). s: rows x kKeyBlock scratch.
template <int D>
void attend_block(const float* q, int64_t q_stride, int64_t rows, const Rows& keys,
                  const Rows& values, int64_t begin, int64_t end, int64_t dim, float scale,
                  float* s, float* wide, float* weights, float* maxes, float* sums,
                  float* out) {
  scores<D>(q, q_stride, rows, keys, begin, end, dim, scale, s, wide);
  for (int64_t r = 0; r < rows; ++r)
    std::tie(maxes[r], sums[r]) = exponentiate(s + r * kKeyBlock, end - begin);
  weigh_values<D>(s, rows, values, begin, end - begin, dim, weights, out);
}

// One row of dim float32 values quantized: codes[i] and scales[i / block] (see the layout).
void quantize_row(const float* x, int64_t dim, int64_t block, int8_t* codes, float* scales) {
  for (int64_t j = 0; j < dim; j += block) {
    float amax = 0.0f;
    for (int64_t i = j; i < j + block; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float d = amax / 127.0f;
    const float divisor = d == 0.0f ? 1.0f : d;
    for (int64_t i = j; i < j + block; ++i)
      codes[i] = static_cast<int8_t>(std::clamp(std::nearbyint(x[i] / divisor), -127.0f, 127.0f));
    scales[j / block] = d;
  }
}

// x [1, Hkv, B, d] float32 quantized: the codes as a new int8 [1, Hkv, B, d] tensor, the
// scales written into scales[b] at positions[b].
at::Tensor quantize_new(const at::Tensor& x, at::TensorList scales, at::IntArrayRef positions,
                        int64_t block) {
  const int64_t kv_heads = x.size(1), batch = x.size(2), dim = x.size(3);
  at::Tensor codes = at::empty({1, kv_heads, batch, dim}, x.options().dtype(at::kChar));
  int8_t* cd = codes.data_ptr<int8_t>();
  const float* xd = x.const_data_ptr<float>();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < kv_heads; ++h) {
      float* sd = scales[b].data_ptr<float>() + h * scales[b].stride(1) +
                  positions[b] * scales[b].stride(2);
      quantize_row(xd + h * x.stride(1) + b * x.stride(2), dim, block,
                   cd + (h * batch + b) * dim, sd);
    }
  return codes;
}

void check_scales(const at::Tensor& codes, const at::Tensor& scales, int64_t position) {
  TORCH_CHECK(codes.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat &&
                  scales.dim() == 4 && scales.size(1) == codes.size(1) &&
                  scales.size(2) == codes.size(2) && scales.stride(3) == 1,
              "decode_attend_q8: expects int8 codes [1, Hkv, capacity, d] and float32 scales "
              "[1, Hkv, capacity, d / block]");
  TORCH_CHECK(position >= 0 && position < codes.size(2), "decode_attend_q8: position ",
              position, " outside the buffer");
}

// q [1, H, B, d], k_new, v_new [1, Hkv, B, d] float32 (d contiguous, a multiple of 8); keys[b],
// values[b] int8 codes [1, Hkv, capacity, d] with key_scales[b], value_scales[b] float32
// [1, Hkv, capacity, d / block] (block a multiple of 8); the new K/V quantized and written at
// positions[b]; window 0 for none -> float32 [1, B, H * d]
at::Tensor decode_attend_q8(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                            at::TensorList keys, at::TensorList key_scales, at::TensorList values,
                            at::TensorList value_scales, at::IntArrayRef positions,
                            int64_t window, double scale) {
  TORCH_CHECK(!keys.empty() && keys.size() == key_scales.size() &&
                  values.size() == value_scales.size() && keys.size() == positions.size(),
              "decode_attend_q8: one K/V buffer pair, their scales and a position per request");
  for (const at::Tensor* t : {&q, &k_new, &v_new})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 4 && t->stride(3) == 1,
                "decode_attend_q8: expects float32 q [1, H, B, d], k_new, v_new [1, Hkv, B, d]");
  const int64_t dim = q.size(3), groups = q.size(1) / k_new.size(1);
  const int64_t block = dim / key_scales[0].size(3);
  TORCH_CHECK(dim % kLanes == 0 && block * key_scales[0].size(3) == dim && block % kLanes == 0,
              "decode_attend_q8: the head dim and its scale block must be multiples of ", kLanes);
  for (size_t b = 0; b < keys.size(); ++b) {
    check_scales(keys[b], key_scales[b], positions[b]);
    check_scales(values[b], value_scales[b], positions[b]);
    TORCH_CHECK(key_scales[b].size(3) * block == dim && value_scales[b].size(3) * block == dim,
                "decode_attend_q8: every buffer needs the same scale block");
  }
  const at::Tensor k_codes = quantize_new(k_new.contiguous(), key_scales, positions, block);
  const at::Tensor v_codes = quantize_new(v_new.contiguous(), value_scales, positions, block);

  const float fscale = static_cast<float>(scale);
  const float* qd = q.const_data_ptr<float>();
  const auto make_worker = [&] {
    return [&, s = std::vector<float>(groups * kKeyBlock),
            wide = std::vector<float>(kLanes * dim),
            weights = std::vector<float>(dim / block * (groups + 1) * kValueRun)](
               const Block& blk, const int8_t* kh, const int8_t* vh, int64_t key_stride,
               int64_t value_stride, float* maxes, float* sums, float* out) mutable {
      const at::Tensor& ks = key_scales[blk.request];
      const at::Tensor& vs = value_scales[blk.request];
      const Rows k{kh, ks.const_data_ptr<float>() + blk.head * ks.stride(1), key_stride,
                   ks.stride(2), block};
      const Rows v{vh, vs.const_data_ptr<float>() + blk.head * vs.stride(1), value_stride,
                   vs.stride(2), block};
      const float* qrows = qd + blk.head * groups * q.stride(1) + blk.request * q.stride(2);
      const auto attend = [&](auto head_dim) {
        attend_block<decltype(head_dim)::value>(qrows, q.stride(1), groups, k, v, blk.begin,
                                                blk.end, dim, fscale, s.data(), wide.data(),
                                                weights.data(), maxes, sums, out);
      };
      if (dim == 64 && block == kFixedBlock) attend(std::integral_constant<int, 64>{});
      else if (dim == 128 && block == kFixedBlock) attend(std::integral_constant<int, 128>{});
      else attend(std::integral_constant<int, 0>{});
    };
  };
  return decode_step<int8_t>(q, k_codes, v_codes, keys, values, positions, window, make_worker);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(RAGBLEND_DECODE_Q8_NS, m) {
  m.def(
      "decode_attend_q8(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!)[] keys, Tensor(b!)[] "
      "key_scales, Tensor(c!)[] values, Tensor(d!)[] value_scales, int[] positions, int window, "
      "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(RAGBLEND_DECODE_Q8_NS, CPU, m) { m.impl("decode_attend_q8", &decode_attend_q8); }
