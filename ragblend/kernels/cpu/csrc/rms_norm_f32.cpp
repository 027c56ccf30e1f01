// HF's LlamaRMSNorm (Llama, Mistral, Qwen2, Qwen3) in float32, bit for bit, in one pass.
//
// torch runs it as five passes over the rows:
//   var = x.pow(2).mean(-1); x = x * rsqrt(var + eps); weight * x
// Here each row is read twice from cache and written once. The values are torch's because
// every step is the same IEEE operation in the same order: the squares are summed in the order
// of torch's CPU sum (torch_sum_order.h), the mean divides by the width, rsqrt is 1 / sqrt,
// and each product is rounded to float32 on its own.
#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>

#include "torch_sum_order.h"

namespace {

using Vec = at::vec::Vectorized<float>;

// x [..., D] float32 with contiguous rows, weight [D] float32 -> a new tensor like x
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "rms_norm_f32: expects float32 x and weight");
  const int64_t width = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == width && weight.is_contiguous(),
              "rms_norm_f32: weight must be [D] matching x's last dim");
  TORCH_CHECK(x.is_contiguous(), "rms_norm_f32: expects a contiguous x");
  at::Tensor out = at::empty_like(x);
  const int64_t rows = width ? x.numel() / width : 0;
  const float* xd = x.const_data_ptr<float>();
  const float* wd = weight.const_data_ptr<float>();
  float* od = out.data_ptr<float>();
  const float eps32 = static_cast<float>(eps);
  const float count = static_cast<float>(width);
  const int64_t whole = width - width % Vec::size();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xd + r * width;
      float* dst = od + r * width;
      const float variance = ragblend::sum_of_squares(row, width) / count;
      const float inv = 1.0f / std::sqrt(variance + eps32);
      const Vec vinv(inv);
      for (int64_t c = 0; c < whole; c += Vec::size())
        (Vec::loadu(wd + c) * (Vec::loadu(row + c) * vinv)).store(dst + c);
      for (int64_t c = whole; c < width; ++c) dst[c] = wd[c] * (row[c] * inv);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ragblend_native_f32, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(ragblend_native_f32, CPU, m) { m.impl("rms_norm", &rms_norm); }
