// Attention of selected query rows over a causal prefix, each row reading exactly its keys.
//
// CPU, bfloat16, through ATen's brgemm micro-kernel (oneDNN's: AMX tiles, or AVX512-BF16 dot
// products on a CPU without AMX). Query rows are taken in position order in
// tiles of kTileRows; the query heads that share a KV head are stacked into one tile (GQA
// without K/V copies), and a tile reads keys only up to its last row's position. Inside the
// tile each row's softmax stops at its own position (flash-attention style online softmax), so
// the result is causal attention by original position, with no mask tensors.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "row_tiles.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using at::BFloat16;
using Vec = at::vec::Vectorized<float>;
using at::native::cpublas::brgemm;

constexpr int64_t kTileRows = 32;   // query rows per tile (times the heads per KV head)
constexpr int64_t kKeyBlock = 512;  // keys per online-softmax step
constexpr int64_t kPackN = 64;      // brgemm's packed-B block width

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// In-register transpose of a 16x16 block of 32-bit words: x[i][j] -> x[j][i].
void transpose16(__m512i x[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(x[2 * i], x[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(x[2 * i], x[2 * i + 1]);
  }
  // u[4R + c], 128-bit lane L: column 4L + c of rows 4R..4R+3
  for (int r = 0; r < 4; ++r) {
    x[4 * r] = _mm512_unpacklo_epi64(t[4 * r], t[4 * r + 2]);
    x[4 * r + 1] = _mm512_unpackhi_epi64(t[4 * r], t[4 * r + 2]);
    x[4 * r + 2] = _mm512_unpacklo_epi64(t[4 * r + 1], t[4 * r + 3]);
    x[4 * r + 3] = _mm512_unpackhi_epi64(t[4 * r + 1], t[4 * r + 3]);
  }
  // then a 4x4 transpose of 128-bit lanes for each c
  for (int c = 0; c < 4; ++c) {
    const __m512i s0 = _mm512_shuffle_i32x4(x[c], x[4 + c], 0x88);
    const __m512i s1 = _mm512_shuffle_i32x4(x[c], x[4 + c], 0xdd);
    const __m512i s2 = _mm512_shuffle_i32x4(x[8 + c], x[12 + c], 0x88);
    const __m512i s3 = _mm512_shuffle_i32x4(x[8 + c], x[12 + c], 0xdd);
    t[c] = _mm512_shuffle_i32x4(s0, s2, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(s1, s3, 0x88);
    t[8 + c] = _mm512_shuffle_i32x4(s0, s2, 0xdd);
    t[12 + c] = _mm512_shuffle_i32x4(s1, s3, 0xdd);
  }
  for (int i = 0; i < 16; ++i) x[i] = t[i];  // t[4L + c] = column 4L + c
}

// K [N, dim] (row stride ld) -> VNNI [dim/2][padded][2]: B = K^T for q @ k^T. As 32-bit
// pairs this is a transpose of [N keys, dim/2 pairs]; keys past n are zeros.
void pack_keys(const BFloat16* k, int64_t ld, int64_t n, int64_t padded, int64_t dim,
               BFloat16* out) {
  const auto* src = reinterpret_cast<const int*>(k);
  auto* dst = reinterpret_cast<int*>(out);
  const int64_t ld32 = ld / 2;
  __m512i x[16];
  for (int64_t b = 0; b < padded; b += kPackN) {
    for (int64_t j = 0; j < kPackN; j += 16) {
      for (int64_t p = 0; p < dim / 2; p += 16) {
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t key = b + j + i;
          x[i] = key < n ? _mm512_loadu_si512(src + key * ld32 + p) : _mm512_setzero_si512();
        }
        transpose16(x);
        for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(dst + (p + i) * padded + b + j, x[i]);
      }
    }
  }
}

// V [N, dim] (row stride ld) -> VNNI [N/2][dim][2]: B = V for p @ v (rows interleaved in
// pairs); keys past n are zeros.
void pack_values(const BFloat16* v, int64_t ld, int64_t n, int64_t padded, int64_t dim,
                 BFloat16* out) {
  alignas(64) static const uint16_t lo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38,
                                              7, 39, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13,
                                              45, 14, 46, 15, 47};
  const __m512i idx_lo = _mm512_load_si512(lo);
  const __m512i idx_hi = _mm512_add_epi16(idx_lo, _mm512_set1_epi16(16));
  for (int64_t key = 0; key < padded; key += 2) {
    BFloat16* row = out + key * dim;
    for (int64_t d = 0; d < dim; d += 32) {
      const __m512i a = key < n ? _mm512_loadu_si512(v + key * ld + d) : _mm512_setzero_si512();
      const __m512i c =
          key + 1 < n ? _mm512_loadu_si512(v + (key + 1) * ld + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(row + 2 * d, _mm512_permutex2var_epi16(a, idx_lo, c));
      _mm512_storeu_si512(row + 2 * d + 32, _mm512_permutex2var_epi16(a, idx_hi, c));
    }
  }
}

// A thread's buffer kept across calls (a fresh large allocation page-faults on every call);
// at::empty aligns to 64 bytes, which AMX tile loads want.
template <typename T>
T* kept_buffer(at::Tensor& buffer, int64_t size) {
  if (!buffer.defined() || buffer.numel() < size)
    buffer = at::empty({size}, at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
  return buffer.data_ptr<T>();
}

// A worker's tile buffers: scores and probabilities of one key block, the output rows, the
// running max and sum per row, and the tile's stacked queries.
struct Scratch {
  float *scores, *out, *max, *sum;
  BFloat16 *probs, *query;
  Scratch(int64_t rows, int64_t dim) {
    thread_local at::Tensor floats, halves;
    scores = kept_buffer<float>(floats, rows * (kKeyBlock + dim + 2));
    out = scores + rows * kKeyBlock;
    max = out + rows * dim;
    sum = max + rows;
    probs = kept_buffer<BFloat16>(halves, rows * (kKeyBlock + dim));
    query = probs + rows * kKeyBlock;
  }
};

// One row's online-softmax step over the first `count` keys of a block (count may be <= 0):
// p = exp(s * scale - max) as bfloat16, zero past `count`; the row's output is rescaled to the
// new max. Scores past `count` are overwritten with -inf up to a whole vector.
void softmax_step(float* s, BFloat16* p, int64_t count, int64_t width, float scale, float& max,
                  float& sum, float* out, int64_t dim, bool first) {
  constexpr int64_t kStep = 2 * Vec::size();
  if (count <= 0) {
    std::memset(static_cast<void*>(p), 0, width * sizeof(BFloat16));
    return;
  }
  const int64_t span = round_up(count, kStep);  // <= width: width is a multiple of 64
  std::fill(s + count, s + span, -std::numeric_limits<float>::infinity());
  // two accumulators each: a single one makes every step wait on the previous one's latency
  __m512 max0 = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), max1 = max0;
  for (int64_t j = 0; j < span; j += kStep) {
    max0 = _mm512_max_ps(max0, _mm512_loadu_ps(s + j));
    max1 = _mm512_max_ps(max1, _mm512_loadu_ps(s + j + Vec::size()));
  }
  const float block_max = _mm512_reduce_max_ps(_mm512_max_ps(max0, max1)) * scale;
  const float new_max = first ? block_max : std::max(max, block_max);
  const Vec vscale(scale), vshift(-new_max);
  Vec sum0(0.0f), sum1(0.0f);
  for (int64_t j = 0; j < span; j += kStep) {
    Vec e0 = at::vec::fmadd(Vec::loadu(s + j), vscale, vshift).fexp_u20();
    Vec e1 = at::vec::fmadd(Vec::loadu(s + j + Vec::size()), vscale, vshift).fexp_u20();
    sum0 = sum0 + e0;
    sum1 = sum1 + e1;
    // one AVX512-BF16 instruction, round to nearest even (as c10::BFloat16)
    _mm512_storeu_si512(p + j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
  }
  std::memset(static_cast<void*>(p + span), 0, (width - span) * sizeof(BFloat16));
  const float block_sum = _mm512_reduce_add_ps(sum0 + sum1);
  if (first) {
    sum = block_sum;
  } else {
    const float alpha = std::exp(max - new_max);
    sum = sum * alpha + block_sum;
    const Vec va(alpha);
    for (int64_t d = 0; d < dim; d += Vec::size()) (Vec::loadu(out + d) * va).store(out + d);
  }
  max = new_max;
}

at::Tensor attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& positions, double softmax_scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == 1 &&
                  k.size(0) == 1 && v.size(0) == 1,
              "attend_rows: expects q [1, H, m, d] and k, v [1, Hkv, N, d]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16, "attend_rows: bfloat16 tensors only");
  const int64_t heads = q.size(1), m = q.size(2), dim = q.size(3);
  const int64_t kv_heads = k.size(1), n = k.size(2);
  TORCH_CHECK(dim % 32 == 0 && k.size(3) == dim && v.size(3) == dim && v.size(1) == kv_heads &&
                  v.size(2) == n, "attend_rows: head dims must match and be a multiple of 32");
  TORCH_CHECK(heads % kv_heads == 0, "attend_rows: heads must be a multiple of KV heads");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "attend_rows: the head dim must be contiguous");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == m, "attend_rows: one int64 position per query row");
  const int64_t groups = heads / kv_heads;
  const float scale = static_cast<float>(softmax_scale);
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  ragblend::check_positions(pos, m, n, "attend_rows");
  at::Tensor out = at::empty({1, m, heads * dim}, q.options());
  if (m == 0) return out;

  // Pack each KV head's K and V up to the last row's position, into a buffer the calling
  // thread keeps (one layer's K and V: 1/num_layers of the prompt's KV cache).
  const int64_t used = pos[m - 1] + 1, padded = round_up(used, kPackN);
  const int64_t head_size = padded * dim;
  thread_local at::Tensor packed;
  BFloat16* kpack = kept_buffer<BFloat16>(packed, 2 * kv_heads * head_size);
  BFloat16* vpack = kpack + kv_heads * head_size;
  const BFloat16* kd = k.const_data_ptr<BFloat16>();
  const BFloat16* vd = v.const_data_ptr<BFloat16>();
  at::parallel_for(0, 2 * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = t / 2;
      if (t % 2 == 0) {
        pack_keys(kd + h * k.stride(1), k.stride(2), used, padded, dim, kpack + h * head_size);
      } else {
        pack_values(vd + h * v.stride(1), v.stride(2), used, padded, dim, vpack + h * head_size);
      }
    }
  });

  const std::vector<std::vector<ragblend::Task>> bins =
      ragblend::balanced_tiles(pos, m, kv_heads, kTileRows);
  const int64_t threads = static_cast<int64_t>(bins.size());

  const BFloat16* qd = q.const_data_ptr<BFloat16>();
  BFloat16* od = out.data_ptr<BFloat16>();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    Scratch sc(groups * kTileRows, dim);
    for (int64_t bin = begin; bin < end; ++bin) {
      for (const ragblend::Task& t : bins[bin]) {
        const int64_t rows = t.end - t.begin, tile = groups * rows;
        // Stack the query heads that share this KV head: tile row g * rows + r.
        for (int64_t g = 0; g < groups; ++g)
          for (int64_t r = 0; r < rows; ++r)
            std::memcpy(static_cast<void*>(sc.query + (g * rows + r) * dim),
                        qd + (t.head * groups + g) * q.stride(1) + (t.begin + r) * q.stride(2),
                        dim * sizeof(BFloat16));
        const BFloat16* kh = kpack + t.head * head_size;
        const BFloat16* vh = vpack + t.head * head_size;
        for (int64_t start = 0; start < t.keys; start += kKeyBlock) {
          const int64_t width = round_up(std::min(kKeyBlock, t.keys - start), kPackN);
          brgemm(tile, width, dim, dim, padded, width, false, sc.query, kh + start * 2,
                 sc.scores);
          for (int64_t i = 0; i < tile; ++i) {
            const int64_t count = pos[t.begin + i % rows] + 1 - start;
            softmax_step(sc.scores + i * width, sc.probs + i * width, std::min(count, width),
                         width, scale, sc.max[i], sc.sum[i], sc.out + i * dim, dim, start == 0);
          }
          brgemm(tile, dim, width, width, dim, dim, start > 0, sc.probs, vh + start * dim,
                 sc.out);
        }
        for (int64_t i = 0; i < tile; ++i) {
          const int64_t g = i / rows, r = i % rows;
          BFloat16* dst = od + ((t.begin + r) * heads + t.head * groups + g) * dim;
          const __m512 inv = _mm512_set1_ps(1.0f / sc.sum[i]);
          for (int64_t d = 0; d < dim; d += 16) {
            const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sc.out + i * dim + d), inv);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), (__m256i)_mm512_cvtneps_pbh(x));
          }
        }
      }
    }
    at::native::cpublas::brgemm_release();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(ragblend_native, m) {
  m.def("attend_rows(Tensor q, Tensor k, Tensor v, Tensor positions, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(ragblend_native, CPU, m) { m.impl("attend_rows", &attend_rows); }
