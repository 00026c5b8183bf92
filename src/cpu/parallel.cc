#include "parallel.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace kvring::cpu {

namespace {

thread_local bool t_in_task = false;
std::atomic<unsigned> g_thread_limit{0};

// How long a thread spins for a job (a worker) or for a job's last tasks
// (the caller) before it sleeps. Calls come back to back in a decode step
// (a layer's attention after its store), and waking a sleeping thread
// costs from tens of microseconds to milliseconds on a virtual machine,
// longer than many a call takes; docs/PERFORMANCE.md has the figures.
constexpr auto kSpin = std::chrono::microseconds(1000);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// Spins until ready() holds or kSpin passes; returns ready().
template <class F>
bool spin_until(F&& ready) {
  const auto deadline = std::chrono::steady_clock::now() + kSpin;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (ready()) return true;
      cpu_relax();
    }
    if (std::chrono::steady_clock::now() >= deadline) return ready();
  }
}

// One parallel_for call. Tasks are handed out by `next`; `done` counts the
// finished ones. A worker holds the job by a shared pointer, so one that
// arrives after the call returned finds every task taken and never calls
// fn, which lived in the caller's frame. The first exception a task throws
// is kept for the caller; the tasks not yet started are then skipped.
struct Job {
  const std::function<void(std::int64_t)>* fn;
  std::int64_t n;
  unsigned helpers;  // workers 0..helpers-1 join it
  std::atomic<std::int64_t> next{0};
  std::atomic<std::int64_t> done{0};
  std::atomic<bool> failed{false};
  std::mutex error_mu;
  std::exception_ptr error;
};

// A fixed pool of workers. One job runs at a time. The caller publishes a
// job and runs its tasks too; workers join when they see it, and the
// caller returns once every task has finished, without waiting for a
// worker that has not woken: a late worker finds nothing left to take.
class Pool {
 public:
  explicit Pool(unsigned threads) {
    for (unsigned t = 1; t < threads; ++t) workers_.emplace_back([this, t] { loop(t - 1); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_.store(true);
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }

  void run(std::int64_t n, const std::function<void(std::int64_t)>& fn) {
    std::lock_guard<std::mutex> job_lock(job_mu_);
    auto job = std::make_shared<Job>();
    job->fn = &fn;
    job->n = n;
    job->helpers = helpers();
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = job;
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    drain(*job);
    auto finished = [&] { return job->done.load(std::memory_order_acquire) == n; };
    if (!spin_until(finished)) {
      std::unique_lock<std::mutex> lock(mu_);
      done_.wait(lock, finished);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_.reset();
    }
    if (job->error) std::rethrow_exception(job->error);
  }

 private:
  void drain(Job& job) {
    t_in_task = true;
    for (std::int64_t i; (i = job.next.fetch_add(1, std::memory_order_relaxed)) < job.n;) {
      if (!job.failed.load(std::memory_order_relaxed)) {
        try {
          (*job.fn)(i);
        } catch (...) {
          std::lock_guard<std::mutex> lock(job.error_mu);
          if (!job.error) job.error = std::current_exception();
          job.failed.store(true, std::memory_order_relaxed);
        }
      }
      if (job.done.fetch_add(1, std::memory_order_acq_rel) == job.n - 1) {
        // The last task: wake a caller that stopped spinning.
        std::lock_guard<std::mutex> lock(mu_);
        done_.notify_all();
      }
    }
    t_in_task = false;
  }

  // Workers a job takes under the thread limit (the caller is one thread).
  unsigned helpers() const {
    const unsigned limit = g_thread_limit.load(std::memory_order_relaxed);
    const auto all = static_cast<unsigned>(workers_.size());
    return limit == 0 ? all : std::min(all, limit - 1);
  }

  // Worker `index` runs the jobs that take it; one the limit leaves out
  // sleeps between jobs instead of spinning, so it costs the engine's own
  // threads nothing.
  void loop(unsigned index) {
    std::uint64_t seen = 0;
    for (;;) {
      auto news = [&] {
        return stop_.load(std::memory_order_acquire) ||
               generation_.load(std::memory_order_acquire) != seen;
      };
      if (index < helpers()) spin_until(news);
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, news);
        if (stop_.load()) return;
        seen = generation_.load();
        job = job_;
      }
      if (job && index < job->helpers) drain(*job);
    }
  }

  std::vector<std::thread> workers_;
  std::mutex job_mu_, mu_;
  std::condition_variable wake_, done_;
  std::shared_ptr<Job> job_;  // the job running now (mu_), null between jobs
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
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
unsigned thread_limit() { return g_thread_limit.load(); }

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
