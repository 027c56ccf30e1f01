// Work split between at::parallel_for's threads as a queue, for the decode-step matmuls
// (quant_blocks.cpp, dense_bf16.cpp).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace ragblend {

// f(t) for the tasks t in [0, count), which the threads take in turn: a thread that starts late
// or runs slow (a busy machine) leaves more of the work to the others than a static split
// would. A kernel whose rows' values do not depend on the thread keeps them the same.
template <class F>
void for_tasks(int64_t count, const F& f) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(count, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t t = next++; t < count; t = next++) f(t);
  });
}

}  // namespace ragblend
