// Attention of selected query rows over a causal prefix, each row reading exactly its keys.
//
// CPU, float32, any x86-64 CPU with AVX2 + FMA (compiled for that level; at::vec picks the
// 8-lane code). The same shape of algorithm as rows_attention.cpp's AMX kernel: query rows in
// position order, in tiles of kTileRows; the query heads that share a KV head are stacked into
// one tile (GQA without K/V copies); a tile reads keys only up to its last row's position, in
// blocks of kKeyBlock keys, through BLAS sgemm (the MKL inside torch's CPU library), and
// each row's online
// softmax stops at its own position. The result is causal attention by original position,
// without mask tensors and without the masked blocks' wasted keys.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "row_tiles.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

// BLAS's column-major sgemm, which torch's CPU library exports (its cpublas wrapper is not
// exported). Called from inside at::parallel_for, it runs on the calling thread.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc);

namespace {

using Vec = at::vec::Vectorized<float>;

// Measured on 2 AVX2 cores (SmolLM2's shape, 10-22 % of 3.2k rows): tiles of 16-128 rows and
// key blocks of 128-1024 keys are within 10 % of each other; sgemm runs near peak here.
constexpr int64_t kTileRows = 32;   // query rows per tile (times the heads per KV head)
constexpr int64_t kKeyBlock = 256;  // keys per online-softmax step

// A thread's buffer kept across calls (a fresh large allocation page-faults on every call).
float* kept_buffer(at::Tensor& buffer, int64_t size) {
  if (!buffer.defined() || buffer.numel() < size) buffer = at::empty({size}, at::kFloat);
  return buffer.data_ptr<float>();
}

// One row's online-softmax step over the first `count` keys of a block (count may be <= 0):
// s <- exp(s * scale - max), zero past `count`; the row's output is rescaled to the new max.
void softmax_step(float* s, int64_t count, int64_t width, float scale, float& max, float& sum,
                  float* out, int64_t dim, bool first) {
  if (count <= 0) {  // never on a row's first block, which starts at key 0
    std::fill(s, s + width, 0.0f);
    return;
  }
  const float block_max =
      at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, s,
                                 count) *
      scale;
  const float new_max = first ? block_max : std::max(max, block_max);
  const Vec vscale(scale), vshift(-new_max);
  Vec acc(0.0f);
  int64_t j = 0;
  for (; j + Vec::size() <= count; j += Vec::size()) {
    const Vec e = at::vec::fmadd(Vec::loadu(s + j), vscale, vshift).exp_u20();
    acc = acc + e;
    e.store(s + j);
  }
  if (j < count) {  // the last partial vector: lanes past `count` are zeros
    const int64_t rest = count - j;
    const Vec e = at::vec::fmadd(Vec::loadu(s + j, rest), vscale, vshift).exp_u20();
    const Vec kept = Vec::set(Vec(0.0f), e, rest);
    acc = acc + kept;
    kept.store(s + j, rest);
    j = count;
  }
  std::fill(s + j, s + width, 0.0f);
  const float block_sum =
      at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  if (first) {
    sum = block_sum;
    std::fill(out, out + dim, 0.0f);
  } else {
    const float alpha = std::exp(max - new_max);
    sum = sum * alpha + block_sum;
    const Vec va(alpha);
    for (int64_t d = 0; d < dim; d += Vec::size()) (Vec::loadu(out + d) * va).store(out + d);
  }
  max = new_max;
}

// Row-major C [rows, cols] = A [rows, inner] @ op(B) + beta * C, where op(B) is B [inner,
// cols] (row stride ldb) or, with b_transposed, B [cols, inner] read as its transpose.
void matmul(int64_t rows, int64_t cols, int64_t inner, const float* a, int64_t lda,
            const float* b, int64_t ldb, bool b_transposed, float beta, float* c, int64_t ldc) {
  // column-major C^T = op(B)^T @ A^T
  const char tb = b_transposed ? 'T' : 'N', ta = 'N';
  const int m = static_cast<int>(cols), n = static_cast<int>(rows), k = static_cast<int>(inner);
  const int ld_b = static_cast<int>(ldb), ld_a = static_cast<int>(lda),
            ld_c = static_cast<int>(ldc);
  const float one = 1.0f;
  sgemm_(&tb, &ta, &m, &n, &k, &one, b, &ld_b, a, &ld_a, &beta, c, &ld_c);
}

// q [1, H, m, d], k, v [1, Hkv, N, d] float32 (d contiguous), positions [m] int64 ascending
// -> [1, m, H * d]: row i attends keys 0 .. positions[i].
at::Tensor attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& positions, double softmax_scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == 1 &&
                  k.size(0) == 1 && v.size(0) == 1,
              "attend_rows_f32: expects q [1, H, m, d] and k, v [1, Hkv, N, d]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat, "attend_rows_f32: float32 tensors only");
  const int64_t heads = q.size(1), m = q.size(2), dim = q.size(3);
  const int64_t kv_heads = k.size(1), n = k.size(2);
  TORCH_CHECK(dim % Vec::size() == 0 && k.size(3) == dim && v.size(3) == dim &&
                  v.size(1) == kv_heads && v.size(2) == n,
              "attend_rows_f32: head dims must match and be a multiple of ", Vec::size());
  TORCH_CHECK(heads % kv_heads == 0, "attend_rows_f32: heads must be a multiple of KV heads");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "attend_rows_f32: the head dim must be contiguous");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == m, "attend_rows_f32: one int64 position per query row");
  const int64_t groups = heads / kv_heads;
  const float scale = static_cast<float>(softmax_scale);
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  ragblend::check_positions(pos, m, n, "attend_rows_f32");
  at::Tensor out = at::empty({1, m, heads * dim}, q.options());
  if (m == 0) return out;

  const std::vector<std::vector<ragblend::Task>> bins =
      ragblend::balanced_tiles(pos, m, kv_heads, kTileRows);
  const int64_t threads = static_cast<int64_t>(bins.size());

  const float* qd = q.const_data_ptr<float>();
  const float* kd = k.const_data_ptr<float>();
  const float* vd = v.const_data_ptr<float>();
  float* od = out.data_ptr<float>();
  const int64_t max_tile = groups * kTileRows;
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    thread_local at::Tensor buffer;
    float* query = kept_buffer(buffer, max_tile * (2 * dim + kKeyBlock + 2));
    float* acc = query + max_tile * dim;
    float* scores = acc + max_tile * dim;
    float* row_max = scores + max_tile * kKeyBlock;
    float* row_sum = row_max + max_tile;
    for (int64_t bin = begin; bin < end; ++bin) {
      for (const ragblend::Task& t : bins[bin]) {
        const int64_t rows = t.end - t.begin, tile = groups * rows;
        // Stack the query heads that share this KV head: tile row g * rows + r.
        for (int64_t g = 0; g < groups; ++g)
          for (int64_t r = 0; r < rows; ++r)
            std::memcpy(query + (g * rows + r) * dim,
                        qd + (t.head * groups + g) * q.stride(1) + (t.begin + r) * q.stride(2),
                        dim * sizeof(float));
        const float* kh = kd + t.head * k.stride(1);
        const float* vh = vd + t.head * v.stride(1);
        for (int64_t start = 0; start < t.keys; start += kKeyBlock) {
          const int64_t width = std::min(kKeyBlock, t.keys - start);
          // scores [tile, width] = query [tile, dim] @ keys [width, dim]^T
          matmul(tile, width, dim, query, dim, kh + start * k.stride(2), k.stride(2), true, 0.0f,
                 scores, width);
          for (int64_t i = 0; i < tile; ++i) {
            const int64_t count = std::min(pos[t.begin + i % rows] + 1 - start, width);
            softmax_step(scores + i * width, count, width, scale, row_max[i], row_sum[i],
                         acc + i * dim, dim, start == 0);
          }
          // acc [tile, dim] += probabilities [tile, width] @ values [width, dim]
          matmul(tile, dim, width, scores, width, vh + start * v.stride(2), v.stride(2), false,
                 1.0f, acc, dim);
        }
        for (int64_t i = 0; i < tile; ++i) {
          const int64_t g = i / rows, r = i % rows;
          float* dst = od + ((t.begin + r) * heads + t.head * groups + g) * dim;
          const Vec inv(1.0f / row_sum[i]);
          for (int64_t d = 0; d < dim; d += Vec::size())
            (Vec::loadu(acc + i * dim + d) * inv).store(dst + d);
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(ragblend_native_f32, m) {
  m.def("attend_rows(Tensor q, Tensor k, Tensor v, Tensor positions, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(ragblend_native_f32, CPU, m) { m.impl("attend_rows", &attend_rows); }
