// One decode step's attention for a batch of requests, each over its own K/V buffer.
//
// CPU, float32 math, AVX2 + FMA (at::vec's 8-lane code), over K/V buffers of float32 or of
// bfloat16 (a bf16 model's: each element widened exactly to float32 as it is read, so the output
// is what the same values held in float32 give, bit for bit, from half the bytes; q is always
// float32, the new K/V come in the buffers' dtype). Each request b feeds one new token at
// position p_b: its key and value are written into the request's buffers at p_b, then each
// query head attends keys [lo_b, p_b] (lo_b > 0 on a sliding-window layer). Torch would take,
// per request, two copies and one SDPA call whose flash kernel reads K/V at about half the
// memory bandwidth for a single query row; here the whole batch is one call, the query heads
// that share a KV head read its keys and values together (bf16 ones widened once, into L1
// scratch, for all of them), and long contexts are cut into fixed blocks of keys
// (flash-decoding) so that even one request keeps every thread busy.
//
// The block boundaries depend only on the request's own positions, and the blocks are merged
// in order, so a request's output is the same whatever the batch and the thread count: a
// request decoded in a batch gets exactly what it gets alone.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

constexpr int64_t kKeyBlock = 512;  // keys per task: K and V of one KV head stay in L2

struct Block {
  int64_t request, head, begin, end;  // KV head `head` of `request`, keys [begin, end)
};

// Eight K/V elements as float32: float32 as they are, bfloat16 (its bits) widened exactly.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// Eight dot products with one query row, summed across lanes together: [q . k_0, ..., q . k_7].
template <typename T>
inline Vec dot8(const float* q, const T* k, int64_t key_stride, int64_t dim) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < dim; d += 8) {
    const __m256 qd = _mm256_loadu_ps(q + d);
    for (int j = 0; j < 8; ++j)
      acc[j] = _mm256_fmadd_ps(qd, load8(k + j * key_stride + d), acc[j]);
  }
  // a transposing reduction: lane j of the result is the sum of acc[j]'s lanes
  const __m256 s01 = _mm256_hadd_ps(acc[0], acc[1]), s23 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 s45 = _mm256_hadd_ps(acc[4], acc[5]), s67 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
  const __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return Vec(_mm256_add_ps(lo, hi));
}

// Eight keys' rows [t, t + 8) as float32: float32 keys where they are, bf16 ones widened
// once into `wide` (8 x dim), so that every query row of the group reads them as float32.
inline const float* keys8(const float* keys, int64_t key_stride, int64_t, float*,
                          int64_t& stride) {
  stride = key_stride;
  return keys;
}
inline const float* keys8(const uint16_t* keys, int64_t key_stride, int64_t dim, float* wide,
                          int64_t& stride) {
  for (int j = 0; j < 8; ++j)
    for (int64_t d = 0; d < dim; d += 8)
      _mm256_storeu_ps(wide + j * dim + d, load8(keys + j * key_stride + d));
  stride = dim;
  return wide;
}

// Scores of `rows` query rows (q, q + q_stride, ...) with keys [begin, end):
// s[r * width + t - begin] = scale * q_r . k_t. wide: 8 x dim floats of scratch.
template <typename T>
void scores(const float* q, int64_t q_stride, int64_t rows, const T* keys,
            int64_t key_stride, int64_t begin, int64_t end, int64_t dim, float scale, float* s,
            int64_t width, float* wide) {
  const Vec vscale(scale);
  int64_t t = begin;
  for (; t + 8 <= end; t += 8) {
    int64_t stride;
    const float* k = keys8(keys + t * key_stride, key_stride, dim, wide, stride);
    for (int64_t r = 0; r < rows; ++r)
      (dot8(q + r * q_stride, k, stride, dim) * vscale).store(s + r * width + t - begin);
  }
  for (; t < end; ++t) {
    const T* k = keys + t * key_stride;
    for (int64_t r = 0; r < rows; ++r) {
      Vec acc(0.0f);
      for (int64_t d = 0; d < dim; d += Vec::size())
        acc = at::vec::fmadd(Vec::loadu(q + r * q_stride + d), Vec(load8(k + d)), acc);
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

// out[r, d0 : d0 + 8 W] (+)= sum_t s[r, t] v[t] over the run's n rows (v: float32 rows of dim)
// for NR rows: their 8 W columns in registers; out is added to unless first. Per element, the
// same products summed in the same order as one fmadd per value into out.
template <int NR, int W>
void weigh_run(const float* s, const float* v, int64_t n, int64_t d0, int64_t dim, bool first,
               float* out) {
  __m256 acc[NR][W];
  for (int r = 0; r < NR; ++r)
    for (int w = 0; w < W; ++w)
      acc[r][w] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + r * dim + d0 + 8 * w);
  for (int64_t t = 0; t < n; ++t) {
    __m256 vt[W];
    for (int w = 0; w < W; ++w) vt[w] = _mm256_loadu_ps(v + t * dim + d0 + 8 * w);
    for (int r = 0; r < NR; ++r) {
      const __m256 p = _mm256_set1_ps(s[r * kKeyBlock + t]);
      for (int w = 0; w < W; ++w) acc[r][w] = _mm256_fmadd_ps(p, vt[w], acc[r][w]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(out + r * dim + d0 + 8 * w, acc[r][w]);
}

// ... 16 columns at a time over the run's columns
template <int NR>
void weigh_run(const float* s, const float* v, int64_t n, int64_t dim, bool first, float* out) {
  int64_t d = 0;
  for (; d + 16 <= dim; d += 16) weigh_run<NR, 2>(s, v, n, d, dim, first, out);
  if (d < dim) weigh_run<NR, 1>(s, v, n, d, dim, first, out);
}

// out[r] = sum_t s[r, t] v_t over values [0, n) for `rows` rows, kValueRun values at a time:
// each run read in order (as the hardware prefetches it) into `wide` as float32, then weighed
// from L1 for up to 4 rows at a time.
template <typename T>
void weigh_values(const float* s, int64_t rows, const T* values, int64_t value_stride, int64_t n,
                  int64_t dim, float* wide, float* out) {
  for (int64_t t0 = 0; t0 < n; t0 += kValueRun) {
    const int64_t run = std::min(kValueRun, n - t0);
    for (int64_t t = 0; t < run; ++t)
      for (int64_t d = 0; d < dim; d += 8)
        _mm256_storeu_ps(wide + t * dim + d, load8(values + (t0 + t) * value_stride + d));
    for (int64_t r = 0; r < rows; r += 4) {
      const float* sr = s + r * kKeyBlock + t0;
      float* o = out + r * dim;
      switch (std::min<int64_t>(4, rows - r)) {
        case 1: weigh_run<1>(sr, wide, run, dim, t0 == 0, o); break;
        case 2: weigh_run<2>(sr, wide, run, dim, t0 == 0, o); break;
        case 3: weigh_run<3>(sr, wide, run, dim, t0 == 0, o); break;
        default: weigh_run<4>(sr, wide, run, dim, t0 == 0, o); break;
      }
    }
  }
}

// The query heads of one KV head over one block of its keys: per row r, its max and sum of
// exps, and out[r] = sum_t exp(s_rt - max_r) v_t (unnormalised). s: rows x kKeyBlock scratch,
// wide: max(8, kValueRun) x dim.
template <typename T>
void attend_block(const float* q, int64_t q_stride, int64_t rows, const T* keys,
                  const T* values, int64_t key_stride, int64_t value_stride, int64_t begin,
                  int64_t end, int64_t dim, float scale, float* s, float* wide, float* maxes,
                  float* sums, float* out) {
  const int64_t n = end - begin;
  scores(q, q_stride, rows, keys, key_stride, begin, end, dim, scale, s, kKeyBlock, wide);
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
    weigh_values(s, rows, values + begin * value_stride, value_stride, n, dim, wide, out);
  }
}

// T: the K/V element (float, or uint16_t for bfloat16's bits); see decode_attend.
template <typename T>
at::Tensor decode_attend_as(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                            at::TensorList keys, at::TensorList values, at::IntArrayRef positions,
                            int64_t window, double scale) {
  const int64_t batch = q.size(2), heads = q.size(1), dim = q.size(3);
  TORCH_CHECK(q.dim() == 4 && q.size(0) == 1 && q.scalar_type() == at::kFloat &&
                  q.stride(3) == 1, "decode_attend: expects float32 q [1, H, B, d]");
  TORCH_CHECK(dim % 8 == 0, "decode_attend: the head dim must be a multiple of 8");
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
  const float fscale = static_cast<float>(scale);

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
  const float* qd = q.const_data_ptr<float>();
  at::parallel_for(0, count, 1, [&](int64_t first, int64_t last) {
    std::vector<float> s(groups * kKeyBlock), wide(std::max<int64_t>(8, kValueRun) * dim);
    for (int64_t i = first; i < last; ++i) {
      const Block& blk = blocks[i];
      const at::Tensor& k = keys[blk.request];
      const at::Tensor& v = values[blk.request];
      const float* qrows = qd + blk.head * groups * q.stride(1) + blk.request * q.stride(2);
      attend_block(qrows, q.stride(1), groups,
                   static_cast<const T*>(k.const_data_ptr()) + blk.head * k.stride(1),
                   static_cast<const T*>(v.const_data_ptr()) + blk.head * v.stride(1),
                   k.stride(2), v.stride(2), blk.begin, blk.end, dim, fscale, s.data(),
                   wide.data(), maxes.data() + i * groups, sums.data() + i * groups,
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

TORCH_LIBRARY_FRAGMENT(ragblend_native_f32, m) {
  m.def(
      "decode_attend(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!)[] keys, Tensor(b!)[] "
      "values, int[] positions, int window, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(ragblend_native_f32, CPU, m) { m.impl("decode_attend", &decode_attend); }
