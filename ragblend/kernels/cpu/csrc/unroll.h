// Compile-time unrolling for the kernels whose tiles keep their accumulators in registers
// (quant_blocks.cpp, dense_bf16.cpp): unroll<N>(f) calls f(std::integral_constant<int, 0>),
// ..., f(std::integral_constant<int, N - 1>), every call inlined, so that a tile's indices
// are constants and its accumulator arrays stay in registers.
#pragma once

#include <utility>

#define RAGBLEND_INLINE inline __attribute__((always_inline))
#define RAGBLEND_INLINE_LAMBDA __attribute__((always_inline))  // a lambda's, after its ()

namespace ragblend {

template <class F, int... I>
RAGBLEND_INLINE void unroll_impl(F& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, class F>
RAGBLEND_INLINE void unroll(F&& f) {
  unroll_impl(f, std::make_integer_sequence<int, N>{});
}

}  // namespace ragblend
