// RoPE applied in place to cached keys, in one pass (rotate_half layout, bfloat16).
//
// The fusor rotates every cached key of the prompt on every layer; in torch that is several
// passes over the keys, here one read and one write. The values are HF's
// apply_rotary_pos_emb in bfloat16 bit for bit: k * cos and rotate_half(k) * sin are each
// rounded to bfloat16, then their sum (a product of two bfloat16 numbers is exact in fp32).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <immintrin.h>

namespace {

using at::BFloat16;

inline __m512 load16(const BFloat16* p) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

inline void store16(BFloat16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
}

// x rounded to bfloat16 (nearest even) and widened back, as a bfloat16 torch op's result
inline __m512 round16(__m512 x) {
  const __m256i b = (__m256i)_mm512_cvtneps_pbh(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// k [1, H, N, d] (rotated in place); cos, sin [1, N, d]:
// k[:d/2] <- k[:d/2] * cos[:d/2] + (-k[d/2:]) * sin[:d/2]
// k[d/2:] <- k[d/2:] * cos[d/2:] + k[:d/2] * sin[d/2:]
at::Tensor rope_(at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(k.dim() == 4 && k.size(0) == 1 && k.scalar_type() == at::kBFloat16 &&
                  k.stride(3) == 1, "rope_: expects bfloat16 k [1, H, N, d], d contiguous");
  const int64_t heads = k.size(1), n = k.size(2), dim = k.size(3), half = dim / 2;
  TORCH_CHECK(dim % 32 == 0, "rope_: the head dim must be a multiple of 32");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == 1 && t->size(1) == n && t->size(2) == dim &&
                    t->stride(2) == 1 && t->scalar_type() == at::kBFloat16,
                "rope_: expects bfloat16 cos and sin [1, N, d] matching k");
  }
  BFloat16* kd = k.data_ptr<BFloat16>();
  const BFloat16* cd = cos.const_data_ptr<BFloat16>();
  const BFloat16* sd = sin.const_data_ptr<BFloat16>();
  at::parallel_for(0, heads * n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = t / n, r = t % n;
      BFloat16* row = kd + h * k.stride(1) + r * k.stride(2);
      const BFloat16* c = cd + r * cos.stride(1);
      const BFloat16* s = sd + r * sin.stride(1);
      for (int64_t d = 0; d < half; d += 16) {
        const __m512 x1 = load16(row + d), x2 = load16(row + half + d);
        const __m512 y1 = _mm512_sub_ps(round16(_mm512_mul_ps(x1, load16(c + d))),
                                        round16(_mm512_mul_ps(x2, load16(s + d))));
        const __m512 y2 = _mm512_add_ps(round16(_mm512_mul_ps(x2, load16(c + half + d))),
                                        round16(_mm512_mul_ps(x1, load16(s + half + d))));
        store16(row + d, y1);
        store16(row + half + d, y2);
      }
    }
  });
  return k;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ragblend_native, m) {
  m.def("rope_(Tensor(a!) k, Tensor cos, Tensor sin) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(ragblend_native, CPU, m) { m.impl("rope_", &rope_); }
