// The GPU's handoffs beside their copy ceilings, each measured in the same
// run (docs/PERFORMANCE.md, "Handoff on the GPU").
//
//   kvring-handoff-cuda-bench [--tokens N]... [--message-mib M] [--pinned-message-mib M]
//                             [--repeats R] [--json FILE]
//
// For each N (default 32768 and 131072), two CUDA stores of muse-glimmer at
// context N, the sender's sequence filled with N - 1 positions of seeded
// rows (the values do not change what moves):
//   device    StoreSource -> local_device_pair -> StoreTarget: rows gathered
//             on the GPU, digested there (digest64), copied device to
//             device by the transport, digested and installed by the
//             receiver; header sent to commit confirmed
//   d2d       cudaMemcpyAsync device to device of the payload's bytes, once
//   pinned    the same handoff over local_pair (host memory): the sender
//             stages through two pinned buffers (device to host while the
//             previous message is sent), the receiver through two (host to
//             device and install while the next is received)
//   pinned-ucx  the same over UCX on loopback in this process (where the
//             build has UCX): the staging path with a real transport
//   d2h, h2d  cudaMemcpyAsync of the payload's bytes between the GPU and one
//             pinned buffer, each way alone
// Handoffs: the best of R runs after one warm-up; copies: the best of R.
// Without a GPU it says so and exits 1.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "kvring/cuda_store.h"
#include "kvring/handoff.h"

using namespace kvring;
using namespace kvring::handoff;

namespace {

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "kvring-handoff-cuda-bench: %s\n", what.c_str());
  std::exit(2);
}
void check(const Status& s, const char* what) {
  if (!s.ok()) die(std::string(what) + ": " + s.to_string());
}
void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) die(std::string(what) + ": " + cudaGetErrorString(e));
}

// Seconds of `fn` (enqueuing on `s`) by device events, the best of `repeats`.
template <class Fn>
double best_copy(int repeats, cudaStream_t s, Fn&& fn) {
  cudaEvent_t a, b;
  check_cuda(cudaEventCreate(&a), "cudaEventCreate");
  check_cuda(cudaEventCreate(&b), "cudaEventCreate");
  double best = 1e30;
  for (int r = 0; r < repeats + 1; ++r) {  // the first is a warm-up
    check_cuda(cudaEventRecord(a, s), "cudaEventRecord");
    fn();
    check_cuda(cudaEventRecord(b, s), "cudaEventRecord");
    check_cuda(cudaEventSynchronize(b), "cudaEventSynchronize");
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    if (r > 0) best = std::min(best, ms / 1e3);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return best;
}

struct Handoff {
  double best_s = 1e30, median_s = 0;
  std::int64_t messages = 0;
};

enum class Link { kDevice, kHost, kUcx };
const char* link_name(Link l) { return l == Link::kDevice ? "device" : l == Link::kHost ? "pinned" : "pinned-ucx"; }

// One session from `from` to `to` over a fresh link, the receiver on a
// thread; the installed sequence is removed again. Returns the sender's
// seconds (header sent to commit confirmed).
double hand_off(KvStore& from, SeqId seq, KvStore& to, const Timeline& t, Link link) {
  std::unique_ptr<Transport> a, b;
  std::unique_ptr<UcxListener> listener;
  if (link == Link::kDevice) {
    auto pair = local_device_pair();
    if (!pair) die(pair.error().to_string());
    a = std::move(pair->first);
    b = std::move(pair->second);
  } else if (link == Link::kHost) {
    std::tie(a, b) = local_pair();
  } else {
    auto l = ucx_listen("127.0.0.1:0");
    if (!l) die(l.error().to_string());
    listener = std::move(*l);
  }
  const std::int64_t rows = t.payload.rows_tokens;
  auto src = StoreSource::create(from, seq, t, std::vector<std::int32_t>(static_cast<std::size_t>(rows), 1), "bench");
  if (!src) die(src.error().to_string());
  StoreTarget target(to);
  std::optional<Result<ReceiveReport>> received;
  std::thread receiver([&] {
    if (listener) {
      auto accepted = listener->accept(deadline_in(30));
      if (!accepted) {
        received.emplace(accepted.error());
        return;
      }
      b = std::move(*accepted);
    }
    received.emplace(receive_session(*b, target, {.timeout_s = 60, .credit_bytes = std::int64_t{1} << 30,
                                                  .max_message_bytes = std::int64_t{1} << 30}));
    b->close();
  });
  if (listener) {
    auto c = ucx_connect("127.0.0.1:" + std::to_string(listener->port()), deadline_in(30));
    if (!c) die(c.error().to_string());
    a = std::move(*c);
  }
  auto sent = send_session(*a, **src, t, {.timeout_s = 60});
  a->close();
  receiver.join();
  if (!sent) die(std::string(link_name(link)) + " handoff: " + sent.error().to_string());
  if (!*received) die(std::string(link_name(link)) + " handoff: " + received->error().to_string());
  check(to.remove_sequence(*target.sequence()), "remove_sequence");
  return sent->seconds;
}

Handoff measure(KvStore& from, SeqId seq, KvStore& to, const Timeline& t, Link link, int repeats) {
  (void)hand_off(from, seq, to, t, link);  // warm-up: pools, pinned buffers
  std::vector<double> runs;
  for (int r = 0; r < repeats; ++r) runs.push_back(hand_off(from, seq, to, t, link));
  std::sort(runs.begin(), runs.end());
  return {runs.front(), runs[runs.size() / 2], static_cast<std::int64_t>(t.messages.size())};
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::int64_t> tokens;
  std::int64_t message_mib = 64, pinned_message_mib = 8;
  int repeats = 3;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--tokens" && i + 1 < argc) tokens.push_back(std::atoll(argv[++i]));
    else if (a == "--message-mib" && i + 1 < argc) message_mib = std::atoll(argv[++i]);
    else if (a == "--pinned-message-mib" && i + 1 < argc) pinned_message_mib = std::atoll(argv[++i]);
    else if (a == "--repeats" && i + 1 < argc) repeats = std::atoi(argv[++i]);
    else if (a == "--json" && i + 1 < argc) json_path = argv[++i];
    else
      die("usage: kvring-handoff-cuda-bench [--tokens N]... [--message-mib M] [--pinned-message-mib M] "
          "[--repeats R] [--json FILE]");
  }
  if (tokens.empty()) tokens = {32768, 131072};
  if (repeats < 1 || message_mib < 1 || pinned_message_mib < 1) die("--repeats and message sizes are at least 1");
  if (cuda_device_count() == 0) {
    std::fprintf(stderr, "kvring-handoff-cuda-bench: no GPU is visible; nothing measured\n");
    return 1;
  }
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  const ModelConfig config = *preset_config("muse-glimmer");
  std::printf("kvring-handoff-cuda-bench: %s, muse-glimmer, device messages of %lld MiB, pinned of %lld MiB, "
              "best of %d\n",
              prop.name, static_cast<long long>(message_mib), static_cast<long long>(pinned_message_mib), repeats);
  std::printf("%8s %14s | %-24s %-24s %6s | %-24s %-24s %-24s %6s | %-24s\n", "tokens", "payload B",
              "device handoff", "d2d copy", "ratio", "pinned handoff", "d2h pinned", "h2d pinned", "ratio",
              "pinned over UCX");
  nlohmann::json out = nlohmann::json::array();
  for (const std::int64_t n : tokens) {
    if (n < 2 || n > config.max_context) die("--tokens " + std::to_string(n) + " outside [2, max_context]");
    const StoreOptions o{.max_sequences = 1, .context = n};
    auto from = make_store(BackendKind::kCuda, config, o);
    if (!from) die(from.error().to_string());
    auto to = make_store(BackendKind::kCuda, config, o);
    if (!to) die(to.error().to_string());
    const SeqId seq = *(*from)->add_sequence();
    // N - 1 positions of seeded f16 rows, stored in chunks through device views.
    const std::int64_t kv = config.kv_dim(), chunk = 2048, layers = config.n_layers;
    std::vector<std::uint16_t> host(static_cast<std::size_t>(chunk * layers * kv));
    for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<std::uint16_t>(0x3000 + (i * 2654435761u) % 0x0c00);
    void* dev = nullptr;
    check_cuda(cudaMalloc(&dev, host.size() * 2), "cudaMalloc");
    check_cuda(cudaMemcpy(dev, host.data(), host.size() * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
    for (std::int64_t at = 0; at < n - 1; at += chunk) {
      const std::int64_t c = std::min(chunk, n - 1 - at);
      const SeqSpan span{seq, at, c};
      const ConstView rows{dev, MemorySpace::kDevice, DType::kF16, c * layers, kv, kv};
      check((*from)->store_all_layers({&span, 1}, rows, rows), "store_all_layers");
    }
    check((*from)->synchronize(), "synchronize");
    check_cuda(cudaFree(dev), "cudaFree");

    PlanOptions po;
    po.context = n;
    po.message_bytes = message_mib << 20;
    auto device_plan = plan_handoff(config, n, po);
    if (!device_plan) die(device_plan.error().to_string());
    po.message_bytes = pinned_message_mib << 20;
    auto pinned_plan = plan_handoff(config, n, po);
    if (!pinned_plan) die(pinned_plan.error().to_string());
    const std::int64_t bytes = device_plan->payload.payload_bytes;

    const Handoff device = measure(**from, seq, **to, *device_plan, Link::kDevice, repeats);
    const Handoff pinned = measure(**from, seq, **to, *pinned_plan, Link::kHost, repeats);
    std::optional<Handoff> ucx;
    if (ucx_compiled()) ucx = measure(**from, seq, **to, *pinned_plan, Link::kUcx, repeats);

    // The ceilings, on buffers of the payload's size.
    cudaStream_t s = nullptr;
    check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    void *src = nullptr, *dst = nullptr, *pin = nullptr;
    const auto size = static_cast<std::size_t>(bytes);
    check_cuda(cudaMalloc(&src, size), "cudaMalloc");
    check_cuda(cudaMalloc(&dst, size), "cudaMalloc");
    check_cuda(cudaHostAlloc(&pin, size, cudaHostAllocDefault), "cudaHostAlloc");
    check_cuda(cudaMemsetAsync(src, 1, size, s), "cudaMemsetAsync");
    const double d2d = best_copy(repeats, s, [&] { check_cuda(cudaMemcpyAsync(dst, src, size, cudaMemcpyDeviceToDevice, s), "d2d"); });
    const double d2h = best_copy(repeats, s, [&] { check_cuda(cudaMemcpyAsync(pin, src, size, cudaMemcpyDeviceToHost, s), "d2h"); });
    const double h2d = best_copy(repeats, s, [&] { check_cuda(cudaMemcpyAsync(dst, pin, size, cudaMemcpyHostToDevice, s), "h2d"); });
    cudaFree(src);
    cudaFree(dst);
    cudaFreeHost(pin);
    cudaStreamDestroy(s);

    auto cell = [&](double sec) {
      char b[64];
      std::snprintf(b, sizeof b, "%8.3f ms %7.1f GB/s", sec * 1e3, bytes / sec / 1e9);
      return std::string(b);
    };
    std::printf("%8lld %14lld | %-24s %-24s %6.2f | %-24s %-24s %-24s %6.2f | %-24s\n", static_cast<long long>(n),
                static_cast<long long>(bytes), cell(device.best_s).c_str(), cell(d2d).c_str(), d2d / device.best_s,
                cell(pinned.best_s).c_str(), cell(d2h).c_str(), cell(h2d).c_str(),
                std::max(d2h, h2d) / pinned.best_s, ucx ? cell(ucx->best_s).c_str() : "(no UCX)");
    out.push_back({{"tokens", n},
                   {"payload_bytes", bytes},
                   {"device_messages", device.messages},
                   {"device_handoff_s", device.best_s},
                   {"device_handoff_median_s", device.median_s},
                   {"d2d_copy_s", d2d},
                   {"pinned_messages", pinned.messages},
                   {"pinned_handoff_s", pinned.best_s},
                   {"pinned_handoff_median_s", pinned.median_s},
                   {"d2h_pinned_s", d2h},
                   {"h2d_pinned_s", h2d},
                   {"pinned_ucx_handoff_s", ucx ? nlohmann::json(ucx->best_s) : nlohmann::json()},
                   {"pinned_ucx_handoff_median_s", ucx ? nlohmann::json(ucx->median_s) : nlohmann::json()}});
  }
  std::printf("ratio: the ceiling's time over the handoff's (1.0 = the handoff moves its payload as fast as\n"
              "one copy of it; the pinned path's ceiling is the slower of its two copies, which the staging\n"
              "overlaps)\n");
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    f << nlohmann::json{{"device", prop.name}, {"runs", out}}.dump(2) << "\n";
    if (!f) die("cannot write " + json_path);
  }
  return 0;
}
