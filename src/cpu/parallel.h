// Splits independent tasks over the host's cores. Each task runs on exactly
// one thread, so results never depend on the number of threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace kvring::cpu {

inline unsigned worker_count() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : std::min(n, 64u);
}

// Runs fn(i) for i in [0, n); uses threads only when `work` (an estimate of
// the total cost) makes them worth starting.
template <class Fn>
void parallel_for(std::int64_t n, std::int64_t work, Fn&& fn) {
  const std::int64_t threads =
      std::min<std::int64_t>({static_cast<std::int64_t>(worker_count()), n,
                              std::max<std::int64_t>(1, work / (1 << 18))});
  if (threads <= 1) {
    for (std::int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(static_cast<std::size_t>(threads - 1));
  auto body = [&](std::int64_t t) {
    for (std::int64_t i = t; i < n; i += threads) fn(i);
  };
  for (std::int64_t t = 1; t < threads; ++t) pool.emplace_back(body, t);
  body(0);
  for (auto& th : pool) th.join();
}

}  // namespace kvring::cpu
