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

#include <pthread.h>

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
  std::int64_t n;      // tasks next .. n-1
  std::int64_t total;  // how many that is when the job starts
  unsigned helpers;  // workers 0..helpers-1 join it
  std::atomic<std::int64_t> next{0};
  std::atomic<std::int64_t> done{0};
  std::atomic<bool> failed{false};
  std::mutex error_mu;
  std::exception_ptr error;
};

// A fixed pool of workers. One job runs at a time; a caller that finds
// another job running runs its own tasks alone rather than wait (a second
// store's decode is not held up behind a first store's prefill). The
// caller publishes a job and runs its tasks too; the workers the job takes
// are woken, each by its own signal, so the ones the thread limit leaves
// out stay asleep. The caller returns once every task has finished,
// without waiting for a worker that has not woken: a late worker finds
// nothing left to take.
class Pool {
 public:
  explicit Pool(unsigned threads)
      : n_workers_(threads - 1), wake_(std::make_unique<std::condition_variable[]>(n_workers_)) {
    workers_.reserve(n_workers_);
    for (unsigned t = 0; t < n_workers_; ++t) workers_.emplace_back([this, t] { loop(t); });
  }
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // Runs fn(i) for i in [first, n); false when another job holds the
  // pool, and nothing ran then.
  bool try_run(std::int64_t first, std::int64_t n, const std::function<void(std::int64_t)>& fn) {
    std::unique_lock<std::mutex> job_lock(job_mu_, std::try_to_lock);
    if (!job_lock.owns_lock()) return false;
    auto job = std::make_shared<Job>();
    job->fn = &fn;
    job->n = n;
    job->total = n - first;
    job->next.store(first, std::memory_order_relaxed);
    job->helpers = helpers();
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = job;
      generation_.fetch_add(1, std::memory_order_release);
    }
    for (unsigned w = 0; w < job->helpers; ++w) wake_[w].notify_one();
    drain(*job);
    auto finished = [&] { return job->done.load(std::memory_order_acquire) == job->total; };
    if (!spin_until(finished)) {
      std::unique_lock<std::mutex> lock(mu_);
      done_.wait(lock, finished);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_.reset();
    }
    if (job->error) std::rethrow_exception(job->error);
    return true;
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
      if (job.done.fetch_add(1, std::memory_order_acq_rel) == job.total - 1) {
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
    return limit == 0 ? n_workers_ : std::min(n_workers_, limit - 1);
  }

  // Worker `index` runs the jobs that take it. One the limit leaves out
  // sleeps until a job takes it, so it costs the engine's own threads
  // nothing; one a job takes spins a while for the next.
  void loop(unsigned index) {
    std::uint64_t seen = 0;
    for (;;) {
      if (index < helpers())
        spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; });
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_[index].wait(lock, [&] {
          return generation_.load(std::memory_order_relaxed) != seen && job_ && index < job_->helpers;
        });
        seen = generation_.load(std::memory_order_relaxed);
        job = job_;
      }
      drain(*job);
    }
  }

  const unsigned n_workers_;
  std::unique_ptr<std::condition_variable[]> wake_;  // one a worker (mu_)
  std::vector<std::thread> workers_;
  std::mutex job_mu_, mu_;
  std::condition_variable done_;
  std::shared_ptr<Job> job_;  // the job running now (mu_), null between jobs
  std::atomic<std::uint64_t> generation_{0};
};

// The process's pool, made at the first parallel call and never destroyed:
// its workers sleep through exit instead of being joined. A child of fork()
// has none of the parent's workers and may have copied the pool's locks
// held, so it forgets the parent's pool (left as it is) and makes its own
// at its first parallel call. g_pool_mu is held across fork() (handlers
// registered when the library is loaded), so the child never copies it
// held.
std::mutex g_pool_mu;
std::atomic<Pool*> g_pool{nullptr};
Pool* g_parents_pool = nullptr;  // kept reachable, never used

const int g_fork_handlers = pthread_atfork(
    [] { g_pool_mu.lock(); }, [] { g_pool_mu.unlock(); },
    [] {
      g_parents_pool = g_pool.exchange(nullptr, std::memory_order_relaxed);
      g_pool_mu.unlock();
    });

Pool& pool() {
  if (Pool* p = g_pool.load(std::memory_order_acquire)) return *p;
  std::lock_guard<std::mutex> lock(g_pool_mu);
  if (g_pool.load(std::memory_order_relaxed) == nullptr)
    g_pool.store(new Pool(worker_count()), std::memory_order_release);
  return *g_pool.load(std::memory_order_relaxed);
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
  // While another thread's job holds the pool, this call's tasks run on
  // its own thread, and the rest go to the pool once it is free.
  for (std::int64_t first = 0; first < n; ++first) {
    if (pool().try_run(first, n, fn)) return;
    fn(first);
  }
}

}  // namespace kvring::cpu
