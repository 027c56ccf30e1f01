// The selected-row attention kernels' shared bookkeeping: query positions checked, and rows cut
// into (KV head, row tile) tasks balanced over the threads. No vector code: both builds (bf16
// AMX, fp32 AVX2) include it with their own compile flags.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace ragblend {

struct Task {
  int64_t head, begin, end, keys;  // KV head, rows [begin, end), keys 0 .. keys - 1
};

// Positions must be ascending and inside [0, n): one clear error naming `op` otherwise.
inline void check_positions(const int64_t* pos, int64_t m, int64_t n, const char* op) {
  for (int64_t i = 0; i < m; ++i) {
    TORCH_CHECK(pos[i] >= 0 && pos[i] < n, op, ": position ", pos[i], " outside ", n, " keys");
    TORCH_CHECK(i == 0 || pos[i] > pos[i - 1], op, ": positions must be ascending");
  }
}

// Tasks of `tile_rows` rows per KV head, costing rows x keys read; longest first onto the
// least loaded thread (tiles late in the prompt read more keys, so equal counts would not
// balance). One bin per thread that gets work.
inline std::vector<std::vector<Task>> balanced_tiles(const int64_t* pos, int64_t m,
                                                     int64_t kv_heads, int64_t tile_rows) {
  std::vector<Task> tasks;
  for (int64_t h = 0; h < kv_heads; ++h)
    for (int64_t a = 0; a < m; a += tile_rows) {
      const int64_t b = std::min(m, a + tile_rows);
      tasks.push_back({h, a, b, pos[b - 1] + 1});
    }
  const auto cost = [](const Task& t) { return t.keys * (t.end - t.begin); };
  std::sort(tasks.begin(), tasks.end(),
            [&](const Task& x, const Task& y) { return cost(x) > cost(y); });
  const int64_t threads =
      std::min<int64_t>(std::max(at::get_num_threads(), 1), static_cast<int64_t>(tasks.size()));
  std::vector<std::vector<Task>> bins(threads);
  std::vector<int64_t> load(threads, 0);
  for (const Task& t : tasks) {
    const auto i = std::min_element(load.begin(), load.end()) - load.begin();
    bins[i].push_back(t);
    load[i] += cost(t);
  }
  return bins;
}

}  // namespace ragblend
