// The CPU backend's task pool (src/cpu/parallel.h): every task runs once,
// on whichever thread, and a failing task reaches the caller.
#include <gtest/gtest.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "cpu/parallel.h"
#include "kvring/backend.h"

namespace kvring {
namespace {

constexpr std::int64_t kBig = std::int64_t{1} << 30;  // work past the serial cut-off

class ParallelFor : public ::testing::TestWithParam<unsigned> {
 protected:
  void SetUp() override { set_cpu_threads(GetParam()); }
  void TearDown() override { set_cpu_threads(0); }
};

// No more threads run a job's tasks than the limit allows, the caller's
// included.
TEST_P(ParallelFor, NoMoreThreadsThanTheLimit) {
  std::mutex mu;
  std::set<std::thread::id> ran_on;
  for (int job = 0; job < 20; ++job)
    cpu::parallel_for(256, kBig, [&](std::int64_t) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      const std::lock_guard<std::mutex> lock(mu);
      ran_on.insert(std::this_thread::get_id());
    });
  const unsigned limit = GetParam() == 0 ? cpu::worker_count() : std::min(GetParam(), cpu::worker_count());
  EXPECT_LE(ran_on.size(), limit);
  EXPECT_GE(ran_on.size(), 1u);
  EXPECT_EQ(cpu_threads(), limit);
}

TEST_P(ParallelFor, RunsEveryTaskExactlyOnce) {
  for (std::int64_t n : {1, 2, 3, 17, 1000}) {
    std::vector<std::atomic<int>> runs(static_cast<std::size_t>(n));
    cpu::parallel_for(n, kBig, [&](std::int64_t i) { runs[static_cast<std::size_t>(i)].fetch_add(1); });
    for (std::int64_t i = 0; i < n; ++i) EXPECT_EQ(runs[static_cast<std::size_t>(i)].load(), 1) << n << " " << i;
  }
}

// Many short jobs back to back, each with its own function and counters
// that end with the call: a worker that comes late to one must not run
// anything of it.
TEST_P(ParallelFor, BackToBackJobsStayApart) {
  for (int job = 0; job < 2000; ++job) {
    const std::int64_t n = 1 + job % 7;
    auto runs = std::make_unique<std::atomic<int>[]>(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) runs[static_cast<std::size_t>(i)] = 0;
    cpu::parallel_for(n, kBig, [&runs, job](std::int64_t i) {
      runs[static_cast<std::size_t>(i)].fetch_add(1 + job % 3);
    });
    for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(runs[static_cast<std::size_t>(i)].load(), 1 + job % 3) << job;
  }
}

TEST_P(ParallelFor, AThrowingTaskReachesTheCallerAndThePoolGoesOn) {
  std::atomic<int> started{0};
  EXPECT_THROW(cpu::parallel_for(64, kBig,
                                 [&](std::int64_t i) {
                                   started.fetch_add(1);
                                   if (i == 5) throw std::runtime_error("task 5");
                                 }),
               std::runtime_error);
  EXPECT_GE(started.load(), 6);
  EXPECT_LE(started.load(), 64);
  std::atomic<std::int64_t> sum{0};
  cpu::parallel_for(100, kBig, [&](std::int64_t i) { sum.fetch_add(i); });
  EXPECT_EQ(sum.load(), 99 * 100 / 2);
}

// A throw on a worker thread, not the caller's, reaches the caller too.
TEST_P(ParallelFor, AThrowOnAWorkerReachesTheCaller) {
  const std::thread::id caller = std::this_thread::get_id();
  std::atomic<int> on_workers{0};
  bool threw = false;
  try {
    cpu::parallel_for(64, kBig, [&](std::int64_t) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      if (std::this_thread::get_id() != caller) {
        on_workers.fetch_add(1);
        throw std::runtime_error("on a worker");
      }
    });
  } catch (const std::runtime_error&) {
    threw = true;
  }
  EXPECT_EQ(threw, on_workers.load() > 0);
  if (GetParam() == 1) {
    EXPECT_EQ(on_workers.load(), 0);
  }
}

TEST_P(ParallelFor, ACallInsideATaskRunsWhole) {
  std::atomic<std::int64_t> sum{0};
  cpu::parallel_for(8, kBig, [&](std::int64_t i) {
    cpu::parallel_for(10, kBig, [&](std::int64_t j) { sum.fetch_add(i * 10 + j); });
  });
  EXPECT_EQ(sum.load(), 79 * 80 / 2);
}

// Two threads calling at once: the calls take turns and both complete.
TEST_P(ParallelFor, CallsFromTwoThreadsBothComplete) {
  std::atomic<std::int64_t> a{0}, b{0};
  std::thread other([&] {
    for (int r = 0; r < 200; ++r) cpu::parallel_for(16, kBig, [&](std::int64_t i) { a.fetch_add(i); });
  });
  for (int r = 0; r < 200; ++r) cpu::parallel_for(16, kBig, [&](std::int64_t i) { b.fetch_add(i); });
  other.join();
  EXPECT_EQ(a.load(), 200 * 120);
  EXPECT_EQ(b.load(), 200 * 120);
}

// A job whose tasks wait for release(): it holds the pool's workers (and
// its caller) until then.
class HeldJob {
 public:
  HeldJob() {
    caller_ = std::thread([this] {
      cpu::parallel_for(2, kBig, [this](std::int64_t) {
        started_.fetch_add(1);
        while (!released_.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      });
    });
    while (started_.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ~HeldJob() { release(); }
  void release() {
    released_.store(true);
    if (caller_.joinable()) caller_.join();
  }

 private:
  std::atomic<int> started_{0};
  std::atomic<bool> released_{false};
  std::thread caller_;
};

// A call made while another thread's job holds the pool runs its tasks on
// its own thread instead of waiting for that job (one store's decode is not
// held up behind another store's prefill).
TEST_P(ParallelFor, ACallNeverWaitsForAnotherThreadsJob) {
  HeldJob held;
  std::atomic<std::int64_t> sum{0};
  std::atomic<bool> done{false};
  std::thread other([&] {
    cpu::parallel_for(64, kBig, [&](std::int64_t i) { sum.fetch_add(i); });
    done.store(true);
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!done.load() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_TRUE(done.load()) << "the call waited for the held job";
  held.release();
  other.join();
  EXPECT_EQ(sum.load(), 63 * 64 / 2);
}

// A child of fork() has none of the parent's workers, and the parent's pool
// may be copied in the middle of a job: the child's calls run all the same,
// and it exits through its static destructors.
TEST_P(ParallelFor, AForkedChildRunsCallsAndExits) {
  cpu::parallel_for(16, kBig, [](std::int64_t) {});  // the pool exists
  HeldJob held;
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  ASSERT_NE(pid, -1);
  if (pid == 0) {
    std::atomic<std::int64_t> sum{0};
    cpu::parallel_for(64, kBig, [&](std::int64_t i) { sum.fetch_add(i); });
    std::exit(sum.load() == 63 * 64 / 2 ? 0 : 3);
  }
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  pid_t got = 0;
  while ((got = ::waitpid(pid, &status, WNOHANG)) == 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  if (got == 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    FAIL() << "the forked child hung";
  }
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

INSTANTIATE_TEST_SUITE_P(Threads, ParallelFor, ::testing::Values(0u, 1u, 2u), [](const auto& info) {
  return info.param == 0 ? std::string("AllWorkers")
                         : info.param == 1 ? std::string("CallerOnly") : std::string("TwoThreads");
});

}  // namespace
}  // namespace kvring
