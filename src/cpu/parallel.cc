#include "parallel.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace kvring::cpu {

namespace {

thread_local bool t_in_task = false;
std::atomic<unsigned> g_thread_limit{0};

// A fixed pool of workers that sleep between jobs. One job runs at a time;
// tasks are handed out by an atomic counter.
class Pool {
 public:
  explicit Pool(unsigned threads) {
    for (unsigned t = 1; t < threads; ++t) workers_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }
  unsigned size() const { return static_cast<unsigned>(workers_.size()) + 1; }

  void run(std::int64_t n, const std::function<void(std::int64_t)>& fn) {
    std::lock_guard<std::mutex> job_lock(job_mu_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      n_ = n;
      next_.store(0);
      active_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
    drain();
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return active_ == 0; });
    fn_ = nullptr;
  }

 private:
  void drain() {
    t_in_task = true;
    for (std::int64_t i; (i = next_.fetch_add(1)) < n_;) (*fn_)(i);
    t_in_task = false;
  }
  void loop() {
    std::uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      drain();
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (--active_ == 0) done_.notify_all();
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex job_mu_, mu_;
  std::condition_variable wake_, done_;
  const std::function<void(std::int64_t)>* fn_ = nullptr;
  std::int64_t n_ = 0;
  std::atomic<std::int64_t> next_{0};
  int active_ = 0;
  std::uint64_t generation_ = 0;
  bool stop_ = false;
};

Pool& pool() {
  static Pool p(worker_count());
  return p;
}

}  // namespace

unsigned worker_count() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : std::min(n, 64u);
}

void set_thread_limit(unsigned limit) { g_thread_limit.store(limit); }

void parallel_for(std::int64_t n, std::int64_t work, const std::function<void(std::int64_t)>& fn) {
  if (n <= 0) return;
  if (n == 1 || work < (1 << 16) || t_in_task || worker_count() == 1 ||
      g_thread_limit.load() == 1) {
    for (std::int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  pool().run(n, fn);
}

}  // namespace kvring::cpu
