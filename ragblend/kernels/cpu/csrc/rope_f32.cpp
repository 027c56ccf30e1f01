// RoPE applied in place (rotate_half layout, float32), in one pass.
//
// The fusor rotates every cached key of the prompt on every layer; in torch that is several
// passes over the keys, here one read and one write. The values are HF's
// apply_rotary_pos_emb in float32 bit for bit: k * cos and rotate_half(k) * sin are each
// rounded to float32, then added (compiled without FMA contraction, so nothing is fused).
#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

namespace {

using Vec = at::vec::Vectorized<float>;

// k [1, H, N, d] (rotated in place); cos, sin [1, N, d]:
// k[:d/2] <- k[:d/2] * cos[:d/2] - k[d/2:] * sin[:d/2]
// k[d/2:] <- k[d/2:] * cos[d/2:] + k[:d/2] * sin[d/2:]
at::Tensor rope_(at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(k.dim() == 4 && k.size(0) == 1 && k.scalar_type() == at::kFloat &&
                  k.stride(3) == 1, "rope_f32: expects float32 k [1, H, N, d], d contiguous");
  const int64_t heads = k.size(1), n = k.size(2), dim = k.size(3), half = dim / 2;
  TORCH_CHECK(half % Vec::size() == 0 && dim % 2 == 0,
              "rope_f32: the head dim must be a multiple of ", 2 * Vec::size());
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == 1 && t->size(1) == n && t->size(2) == dim &&
                    t->stride(2) == 1 && t->scalar_type() == at::kFloat,
                "rope_f32: expects float32 cos and sin [1, N, d] matching k");
  }
  float* kd = k.data_ptr<float>();
  const float* cd = cos.const_data_ptr<float>();
  const float* sd = sin.const_data_ptr<float>();
  at::parallel_for(0, heads * n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = t / n, r = t % n;
      float* row = kd + h * k.stride(1) + r * k.stride(2);
      const float* c = cd + r * cos.stride(1);
      const float* s = sd + r * sin.stride(1);
      for (int64_t d = 0; d < half; d += Vec::size()) {
        const Vec x1 = Vec::loadu(row + d), x2 = Vec::loadu(row + half + d);
        const Vec y1 = x1 * Vec::loadu(c + d) - x2 * Vec::loadu(s + d);
        const Vec y2 = x2 * Vec::loadu(c + half + d) + x1 * Vec::loadu(s + half + d);
        y1.store(row + d);
        y2.store(row + half + d);
      }
    }
  });
  return k;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ragblend_native_f32, m) {
  m.def("rope_(Tensor(a!) k, Tensor cos, Tensor sin) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(ragblend_native_f32, CPU, m) { m.impl("rope_", &rope_); }
