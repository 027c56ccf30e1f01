// One decode step's attention for a batch of requests over bf16 K/V, in AVX512-BF16 dot
// products (vdpbf16ps: 32 bf16 products summed into 16 fp32 lanes per instruction, twice what
// fp32 FMAs do, and no widening of K or V).
//
// It computes what torch's SDPA computes for a bf16 model's one query row: the bf16 q . k
// products (exact in fp32) summed in fp32, the softmax in fp32, its probabilities rounded to
// bf16 for the weighted sum of the bf16 values (as SDPA's flash kernel rounds them for its
// second matmul), summed in fp32, normalised by the fp32 sum of the exps. The new K/V written
// at each request's position, the key blocks, the merge: decode_step.h, as the fp32 kernel's.
//
// Values are weighed two rows at a time: each pair of rows is interleaved in registers
// (column c of row t beside column c of row t + 1, within each 128-bit lane), so that one
// vdpbf16ps adds p_t v_t + p_t+1 v_t+1 for 16 columns; a row's sums end in the order the
// interleave leaves them, put back in order once per block.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "decode_step.h"
#include "unroll.h"

namespace {

using ragblend::unroll;
using ragblend::decode::Block;
using ragblend::decode::kKeyBlock;

constexpr int64_t kPairs = 16;  // value-row pairs weighed per pass of a row group
constexpr int64_t kRows = 4;    // query rows weighed together (columns in registers)
constexpr int64_t kAhead = 64;  // K/V rows prefetched this far ahead of the ones in use

// Asks for rows [0, rows) at p (stride bytes apart, `bytes` each) to be brought into L1: a
// block's K and V are short streams that the hardware prefetcher ramps up on too late.
inline void prefetch_rows(const void* p, int64_t rows, int64_t stride, int64_t bytes) {
  const char* base = static_cast<const char*>(p);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(base + r * stride + b, _MM_HINT_T0);
}

RAGBLEND_INLINE __m512bh bf16x32(const uint16_t* p) {
  return (__m512bh)_mm512_loadu_si512(p);
}

// s[r * kKeyBlock + t - begin] = scale * q_r . k_t for the rows query rows and keys
// [begin, end); 16 keys at a time, each row's 16 sums from one transposing reduction. values:
// the block's first value row, prefetched once the keys ahead are all asked for.
// D: the head dim where it is known when compiling (loops unrolled), else 0 and `dim`. S: the
// rows' stride where it is known (rows of D, dense: the 16 keys' offsets constants, where a
// variable stride kept 16 row pointers, more than the registers hold), else 0 and the strides.
template <int D, int S>
void scores(const uint16_t* q, int64_t q_stride, int64_t rows, const uint16_t* keys,
            int64_t key_stride, const uint16_t* values, int64_t value_stride, int64_t begin,
            int64_t end, int64_t dim, float scale, float* s) {
  if constexpr (D > 0) dim = D;
  if constexpr (S > 0) key_stride = value_stride = S;
  const __m512 vscale = _mm512_set1_ps(scale);
  int64_t t = begin;
  for (; t + 16 <= end; t += 16) {
    const uint16_t* k = keys + t * key_stride;
    if (t + kAhead < end)  // the keys kAhead on, then the block's first values
      prefetch_rows(k + kAhead * key_stride, 16, key_stride * 2, dim * 2);
    else
      prefetch_rows(values + (t + kAhead - end) * value_stride, 16,
                                      value_stride * 2, dim * 2);
    for (int64_t r = 0; r < rows; ++r) {
      const uint16_t* qr = q + r * q_stride;
      __m512 acc[16];
      unroll<16>([&](auto j) RAGBLEND_INLINE_LAMBDA { acc[j] = _mm512_setzero_ps(); });
      const auto chunk = [&](int64_t d) RAGBLEND_INLINE_LAMBDA {
        const __m512bh qd = bf16x32(qr + d);
        unroll<16>([&](auto j) RAGBLEND_INLINE_LAMBDA {
          acc[j] = _mm512_dpbf16_ps(acc[j], qd, bf16x32(k + j * key_stride + d));
        });
      };
      if constexpr (D > 0)
        unroll<D / 32>([&](auto c) RAGBLEND_INLINE_LAMBDA { chunk(c * 32); });
      else
        for (int64_t d = 0; d < dim; d += 32) chunk(d);
      _mm512_storeu_ps(s + r * kKeyBlock + t - begin,
                       _mm512_mul_ps(ragblend::decode::sum_lanes16(acc), vscale));
    }
  }
  for (; t < end; ++t) {
    const uint16_t* k = keys + t * key_stride;
    for (int64_t r = 0; r < rows; ++r) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < dim; d += 32)
        acc = _mm512_dpbf16_ps(acc, bf16x32(q + r * q_stride + d), bf16x32(k + d));
      s[r * kKeyBlock + t - begin] = scale * _mm512_reduce_add_ps(acc);
    }
  }
}

// exp(x) for x <= 0 (scores less their max): 2^(x log2 e) as 2^n 2^f, n = round(x log2 e),
// 2^f by its Taylor polynomial of degree 6 on |f| <= 1/2 (relative error < 2e-7, about
// exp_u20's), 2^n applied by vscalefps (0 where x is far below the max).
RAGBLEND_INLINE __m512 exp_nonpositive(__m512 x) {
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 e = _mm512_set1_ps(1.5403530393381609e-4f);
  for (const float c : {1.3333558146428443e-3f, 9.6181291076284772e-3f, 5.5504108664821580e-2f,
                        2.4022650695910071e-1f, 6.9314718055994531e-1f, 1.0f})
    e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(e, n);
}

// Row r's n scores s[r * kKeyBlock + t] to p[r * (kKeyBlock + 32) + t] = bf16(exp(s - max))
// (round to nearest even), zero from n to the next multiple of 32; maxes[r], and sums[r] the
// sum of the fp32 exps (as SDPA normalises).
void exps_to_bf16(const float* s, int64_t rows, int64_t n, uint16_t* p, float* maxes,
                  float* sums) {
  const auto mask = [n](int64_t t) -> __mmask16 {
    return n - t >= 16 ? 0xFFFF : (n > t ? (1u << (n - t)) - 1 : 0);
  };
  for (int64_t r = 0; r < rows; ++r) {
    const float* sr = s + r * kKeyBlock;
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < n; t += 16)
      top = _mm512_mask_max_ps(top, mask(t), top, _mm512_maskz_loadu_ps(mask(t), sr + t));
    const float max = _mm512_reduce_max_ps(top);
    const __m512 shift = _mm512_set1_ps(-max);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 32) {
      const __mmask16 lo = mask(t), hi = mask(t + 16);
      const __m512 el = _mm512_maskz_mov_ps(
          lo, exp_nonpositive(_mm512_add_ps(_mm512_maskz_loadu_ps(lo, sr + t), shift)));
      const __m512 eh = _mm512_maskz_mov_ps(
          hi, exp_nonpositive(_mm512_add_ps(_mm512_maskz_loadu_ps(hi, sr + t + 16), shift)));
      sum = _mm512_add_ps(sum, _mm512_add_ps(el, eh));
      _mm512_storeu_si512(p + r * (kKeyBlock + 32) + t, (__m512i)_mm512_cvtne2ps_pbh(eh, el));
    }
    maxes[r] = max;
    sums[r] = _mm512_reduce_add_ps(sum);
  }
}

// acc[r, w0 : w0 + W] += sum over value rows [t, t + 2 * pairs) of p[r, t] v_t for NR rows:
// each pair of value rows (the second zero past n) interleaved in registers, column c of row t
// beside column c of row t + 1 within each 128-bit lane, the lo and hi unpacks of 32 columns
// being vectors 2c and 2c + 1 of a row of acc (W of them, from w0, in registers); one
// vdpbf16ps adds p_t v_t + p_t+1 v_t+1 for 16 columns. acc: NR rows of `width` vectors.
template <int NR, int W>
RAGBLEND_INLINE void weigh_pairs(const uint16_t* p, const uint16_t* values, int64_t value_stride,
                                 int64_t t, int64_t pairs, int64_t n, int64_t width, int64_t w0,
                                 float* acc) {
  static_assert(W % 2 == 0, "whole 32-column chunks");
  __m512 a[NR][W];
  unroll<NR>([&](auto r) RAGBLEND_INLINE_LAMBDA {
    unroll<W>([&](auto w) RAGBLEND_INLINE_LAMBDA {
      a[r][w] = _mm512_loadu_ps(acc + (r * width + w0 + w) * 16);
    });
  });
  for (int64_t i = 0; i < pairs; ++i, t += 2) {
    const uint16_t* first = values + t * value_stride + w0 * 16;
    const uint16_t* second = first + value_stride;
    __m512i v[W];
    unroll<W / 2>([&](auto c) RAGBLEND_INLINE_LAMBDA {
      const __m512i va = _mm512_loadu_si512(first + 32 * c);
      const __m512i vb = t + 1 < n ? _mm512_loadu_si512(second + 32 * c) : _mm512_setzero_si512();
      v[2 * c] = _mm512_unpacklo_epi16(va, vb);
      v[2 * c + 1] = _mm512_unpackhi_epi16(va, vb);
    });
    unroll<NR>([&](auto r) RAGBLEND_INLINE_LAMBDA {
      int32_t bits;
      std::memcpy(&bits, p + r * (kKeyBlock + 32) + 2 * i, sizeof bits);
      const __m512bh pr = (__m512bh)_mm512_set1_epi32(bits);
      unroll<W>([&](auto w) RAGBLEND_INLINE_LAMBDA {
        a[r][w] = _mm512_dpbf16_ps(a[r][w], pr, (__m512bh)v[w]);
      });
    });
  }
  unroll<NR>([&](auto r) RAGBLEND_INLINE_LAMBDA {
    unroll<W>([&](auto w) RAGBLEND_INLINE_LAMBDA {
      _mm512_storeu_ps(acc + (r * width + w0 + w) * 16, a[r][w]);
    });
  });
}

// ... over all of a row's vectors (width of them: dim / 16), 4 at a time
template <int NR>
void weigh_pairs(const uint16_t* p, const uint16_t* values, int64_t value_stride, int64_t t,
                 int64_t pairs, int64_t n, int64_t width, float* acc) {
  int64_t w = 0;
  for (; w + 4 <= width; w += 4)
    weigh_pairs<NR, 4>(p, values, value_stride, t, pairs, n, width, w, acc);
  for (; w < width; w += 2)
    weigh_pairs<NR, 2>(p, values, value_stride, t, pairs, n, width, w, acc);
}

// out[r, :] = acc[r, :] in column order: vector 2c of a row holds the unpacklo half of
// columns [32c, 32c + 32) (4 columns of each 8), vector 2c + 1 the unpackhi half.
void put_in_order(const float* acc, int64_t rows, int64_t dim, float* out) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < dim / 32; ++c) {
      const __m512 lo = _mm512_loadu_ps(acc + r * dim + 32 * c);
      const __m512 hi = _mm512_loadu_ps(acc + r * dim + 32 * c + 16);
      _mm512_storeu_ps(out + r * dim + 32 * c, _mm512_permutex2var_ps(lo, first, hi));
      _mm512_storeu_ps(out + r * dim + 32 * c + 16, _mm512_permutex2var_ps(lo, second, hi));
    }
}

// Per-thread scratch: scores, their bf16 exps, the rows' sums of values.
struct Scratch {
  std::vector<float> s, acc;
  std::vector<uint16_t> p;
  Scratch(int64_t rows, int64_t dim)
      : s(rows * kKeyBlock), acc(rows * dim), p(rows * (kKeyBlock + 32)) {}
};

// The query heads of one KV head over one block of its keys (see decode_step's worker).
template <int D>
void attend_block(const uint16_t* q, int64_t q_stride, int64_t rows, const uint16_t* keys,
                  const uint16_t* values, int64_t key_stride, int64_t value_stride,
                  int64_t begin, int64_t end, int64_t dim, float scale, Scratch& scratch,
                  float* maxes, float* sums, float* out) {
  const int64_t n = end - begin, width = dim / 16;
  const uint16_t* block = values + begin * value_stride;
  if (D > 0 && key_stride == D && value_stride == D)
    scores<D, D>(q, q_stride, rows, keys, key_stride, block, value_stride, begin, end, dim,
                 scale, scratch.s.data());
  else
    scores<D, 0>(q, q_stride, rows, keys, key_stride, block, value_stride, begin, end, dim,
                 scale, scratch.s.data());
  exps_to_bf16(scratch.s.data(), rows, n, scratch.p.data(), maxes, sums);
  std::fill(scratch.acc.begin(), scratch.acc.end(), 0.0f);
  for (int64_t t0 = 0; t0 < n; t0 += 2 * kPairs) {
    const int64_t pairs = std::min(kPairs, (n - t0 + 1) / 2);
    if (t0 + kAhead < n)
      prefetch_rows(block + (t0 + kAhead) * value_stride,
                                      std::min(2 * kPairs, n - t0 - kAhead), value_stride * 2,
                                      dim * 2);
    for (int64_t r = 0; r < rows; r += kRows) {
      const uint16_t* p = scratch.p.data() + r * (kKeyBlock + 32) + t0;
      float* acc = scratch.acc.data() + r * dim;
      switch (std::min(kRows, rows - r)) {
        case 1: weigh_pairs<1>(p, block, value_stride, t0, pairs, n, width, acc); break;
        case 2: weigh_pairs<2>(p, block, value_stride, t0, pairs, n, width, acc); break;
        case 3: weigh_pairs<3>(p, block, value_stride, t0, pairs, n, width, acc); break;
        default: weigh_pairs<4>(p, block, value_stride, t0, pairs, n, width, acc); break;
      }
    }
  }
  put_in_order(scratch.acc.data(), rows, dim, out);
}

// q [1, H, B, d], k_new, v_new [1, Hkv, B, d] and keys[b], values[b] [1, Hkv, capacity, d],
// all bfloat16 (d contiguous, a multiple of 32); the new K/V written at positions[b]; window 0
// for none -> float32 [1, B, H * d]
at::Tensor decode_attend(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                         at::TensorList keys, at::TensorList values, at::IntArrayRef positions,
                         int64_t window, double scale) {
  TORCH_CHECK(!keys.empty(), "decode_attend: no requests");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && keys[0].scalar_type() == at::kBFloat16,
              "decode_attend: expects bfloat16 q and K/V");
  const int64_t dim = q.size(3), groups = q.size(1) / k_new.size(1);
  TORCH_CHECK(dim % 32 == 0, "decode_attend: the head dim must be a multiple of 32");
  const float fscale = static_cast<float>(scale);
  const auto* qd = static_cast<const uint16_t*>(q.const_data_ptr());
  const auto make_worker = [&] {
    return [&, scratch = Scratch(groups, dim)](
               const Block& blk, const uint16_t* kh, const uint16_t* vh, int64_t key_stride,
               int64_t value_stride, float* maxes, float* sums, float* out) mutable {
      const uint16_t* qrows = qd + blk.head * groups * q.stride(1) + blk.request * q.stride(2);
      const auto attend = [&](auto head_dim) {
        attend_block<decltype(head_dim)::value>(qrows, q.stride(1), groups, kh, vh, key_stride,
                                                value_stride, blk.begin, blk.end, dim, fscale,
                                                scratch, maxes, sums, out);
      };
      if (dim == 64) attend(std::integral_constant<int, 64>{});
      else if (dim == 128) attend(std::integral_constant<int, 128>{});
      else attend(std::integral_constant<int, 0>{});
    };
  };
  return ragblend::decode::decode_step<uint16_t>(q, k_new, v_new, keys, values, positions, window,
                                                 make_worker);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ragblend_native, m) {
  m.def(
      "decode_attend(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!)[] keys, Tensor(b!)[] "
      "values, int[] positions, int window, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(ragblend_native, CPU, m) { m.impl("decode_attend", &decode_attend); }
