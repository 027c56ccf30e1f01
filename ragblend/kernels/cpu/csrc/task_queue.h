// Work split between at::parallel_for's threads as a queue, for the decode-step matmuls
// (quant_blocks.cpp, dense_bf16.cpp).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

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

// part.run(r0, r1) over each part's rows [0, part.rows) in tasks of `task` rows, all parts'
// tasks in one queue (a decode step's q/k/v weights in one parallel region).
template <class Part>
void for_part_rows(const std::vector<Part>& parts, int64_t task) {
  std::vector<std::pair<size_t, int64_t>> tasks;  // (part, first row)
  for (size_t k = 0; k < parts.size(); ++k)
    for (int64_t r0 = 0; r0 < parts[k].rows; r0 += task) tasks.emplace_back(k, r0);
  for_tasks(static_cast<int64_t>(tasks.size()), [&](int64_t t) {
    const Part& part = parts[tasks[t].first];
    part.run(tasks[t].second, std::min(part.rows, tasks[t].second + task));
  });
}

}  // namespace ragblend
