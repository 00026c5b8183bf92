// Splits independent tasks over the host's cores. Each task runs whole on
// exactly one thread, so results never depend on the number of threads.
#pragma once

#include <cstdint>
#include <functional>

namespace kvring::cpu {

unsigned worker_count();

// Caps the threads parallel_for uses, the caller's included (1: the
// calling thread only; 0: all workers). Results never depend on it.
void set_thread_limit(unsigned limit);
unsigned thread_limit();

// Runs fn(i) for every i in [0, n). `work` estimates the total cost in
// multiply-adds; small jobs run on the calling thread. Calls from inside a
// task, and calls made while another thread's job holds the workers, run
// serially on the calling thread. When a task throws, the tasks not yet started are
// skipped and the first exception is rethrown to the caller once no task
// runs any more.
void parallel_for(std::int64_t n, std::int64_t work, const std::function<void(std::int64_t)>& fn);

}  // namespace kvring::cpu
