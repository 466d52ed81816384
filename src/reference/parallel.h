// CPU references: splitting independent items over host threads (results never depend on the thread count).
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace tessera::reference::detail {

// Threads for `work` operations over `items` independent items: as requested, else one per hardware thread but
// no more than gives each a few milliseconds of work.
inline int num_workers(int requested, double work, int64_t items) {
  int t = requested;
  if (t <= 0) {
    t = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    t = static_cast<int>(std::min<double>(t, std::max(1.0, work / 4e6)));
  }
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(t, items)));
}

// Runs fn(t) for t in [0, num_threads) on num_threads threads (the caller's included).
template <typename Fn>
void parallel(int num_threads, Fn&& fn) {
  std::vector<std::thread> pool;
  for (int t = 1; t < num_threads; ++t) pool.emplace_back(fn, t);
  fn(0);
  for (auto& th : pool) th.join();
}

}  // namespace tessera::reference::detail
