// The GPU's handoffs beside their copy ceilings, each measured in the same
// run (docs/PERFORMANCE.md, "Handoff on the GPU").
//
//   kvring-handoff-cuda-bench [--tokens N[,N...]] [--message-mib M] [--pinned-message-mib M]
//                             [--peer-gpu G] [--prefill-tps T | --no-held] [--repeats R] [--json FILE]
//
// For each N (default 32768 and 131072), two CUDA stores of muse-glimmer at
// context N, the sender's sequence prefilled with N - 1 positions of seeded
// rows and queries (the values do not change what moves), the prefill
// timed:
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
//   peer      StoreSource on GPU 0 -> local_peer_pair -> StoreTarget of a
//             store on GPU G (--peer-gpu; by default 1 where two GPUs are
//             visible, else 0): device messages copied peer to peer into
//             the receiver's buffers (staged through pinned memory where
//             the pair has no peer access, as the table's line says)
//   p2p       cudaMemcpyPeerAsync of the payload's bytes from GPU 0 to GPU G,
//             once: the peer handoff's ceiling
//   ipc       StoreSource on GPU 0 -> cuda_ipc_link over a Unix socket ->
//             StoreTarget of a store on GPU G in another process (this
//             program again, started with --ipc-receiver): the receiver
//             maps the sender's buffers (CUDA IPC); paced, then swa-first
//   held      the peer handoff under each schedule while a simulated
//             prefill runs at the pace of the sender's own prefill, timed
//             when its session is filled (every layer's store and f16
//             attention, chunks of 2048), or at --prefill-tps T: each
//             message is held until the plan releases it (its rows final
//             under paced, the end of prefill for swa-first's full rows);
//             reported: the time from prefill's start to the commit, the
//             tail past prefill's end, and the share of the unheld
//             handoff's time that the prefill hid (--no-held: not run)
// Handoffs: the best of R runs after one warm-up (held: of one run after
// one); copies: the best of R.
// Without a GPU it says so and exits 1.
#include <cuda_runtime_api.h>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "../tools/args.h"
#include "bench_io.h"
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

enum class Link { kDevice, kHost, kUcx, kPeer };
const char* link_name(Link l) {
  return l == Link::kDevice ? "device" : l == Link::kHost ? "pinned" : l == Link::kUcx ? "pinned-ucx" : "peer";
}
int g_peer_gpu = 0;  // the receiver's GPU of Link::kPeer
std::string g_peer_link;  // its describe()

// A source whose messages are held until the plan releases them, counted
// from the first wait (the simulated prefill's start).
class HeldSource : public HandoffSource {
 public:
  explicit HeldSource(HandoffSource& inner) : inner_(inner) {}
  const Snapshot& header() const override { return inner_.header(); }
  RowDigest digest() const override { return inner_.digest(); }
  Result<bool> wait_final(const PlannedMessage& m, Deadline deadline) override {
    if (!t0_) t0_ = Clock::now();
    const auto at = *t0_ + duration_of(m.release_s);
    std::this_thread::sleep_until(std::min(at, deadline));
    return at <= deadline;
  }
  Status rows(const PlannedMessage& m, const std::uint16_t** k, const std::uint16_t** v) override {
    return inner_.rows(m, k, v);
  }
  Status message_rows(const PlannedMessage& m, bool device_ok, SourceRows* out) override {
    return inner_.message_rows(m, device_ok, out);
  }
  void release(const PlannedMessage& m) override { inner_.release(m); }

 private:
  HandoffSource& inner_;
  std::optional<Clock::time_point> t0_;
};

// The sender's side of one session of `seq` (token ids do not matter here).
std::unique_ptr<StoreSource> bench_source(KvStore& from, SeqId seq, const Timeline& t) {
  auto src = StoreSource::create(from, seq, t, std::vector<std::int32_t>(static_cast<std::size_t>(t.payload.rows_tokens), 1),
                                 "bench");
  if (!src) die(src.error().to_string());
  return std::move(*src);
}

// One session from `from` to `to` over a fresh link, the receiver on a
// thread; the installed sequence is removed again. Returns the sender's
// seconds (header sent to commit confirmed), or, `held` to a simulated
// prefill (HeldSource), the seconds from the prefill's start to the commit.
double hand_off(KvStore& from, SeqId seq, KvStore& to, const Timeline& t, Link link, bool held = false) {
  std::unique_ptr<Transport> a, b;
  std::unique_ptr<UcxListener> listener;
  if (link == Link::kDevice) {
    auto pair = local_device_pair();
    if (!pair) die(pair.error().to_string());
    a = std::move(pair->first);
    b = std::move(pair->second);
  } else if (link == Link::kHost) {
    std::tie(a, b) = local_pair();
  } else if (link == Link::kPeer) {
    auto pair = local_peer_pair({.sender_gpu = 0, .receiver_gpu = g_peer_gpu});
    if (!pair) die(pair.error().to_string());
    a = std::move(pair->first);
    b = std::move(pair->second);
    g_peer_link = a->describe();
  } else {
    auto l = ucx_listen("127.0.0.1:0");
    if (!l) die(l.error().to_string());
    listener = std::move(*l);
  }
  auto src = bench_source(from, seq, t);
  HeldSource held_source(*src);
  HandoffSource& source = held ? static_cast<HandoffSource&>(held_source) : *src;
  StoreTarget target(to);
  std::optional<Result<ReceiveReport>> received;
  std::thread receiver([&] {
    if (link == Link::kPeer) check_cuda(cudaSetDevice(g_peer_gpu), "cudaSetDevice");
    if (listener) {
      auto accepted = listener->accept(deadline_in(30));
      if (!accepted) {
        received.emplace(accepted.error());
        return;
      }
      b = std::move(*accepted);
    }
    received.emplace(receive_session(*b, target, {.timeout_s = 60, .max_keep_s = 0,
                                                  .credit_bytes = std::int64_t{1} << 30,
                                                  .max_message_bytes = std::int64_t{1} << 30}));
    b->close();
  });
  if (listener) {
    auto c = ucx_connect("127.0.0.1:" + std::to_string(listener->port()), deadline_in(30));
    if (!c) die(c.error().to_string());
    a = std::move(*c);
  }
  const auto t0 = Clock::now();
  auto sent = send_session(*a, source, t, {.timeout_s = 60});
  const double wall_s = std::chrono::duration<double>(Clock::now() - t0).count();
  a->close();
  receiver.join();
  if (!sent) die(std::string(link_name(link)) + " handoff: " + sent.error().to_string());
  if (!*received) die(std::string(link_name(link)) + " handoff: " + received->error().to_string());
  check(to.remove_sequence(*target.sequence()), "remove_sequence");
  return held ? wall_s : sent->seconds;
}

// The best and median of `repeats` runs of `run` after one warm-up (pools,
// pinned buffers).
Handoff measure(const Timeline& t, int repeats, const std::function<double()>& run) {
  (void)run();
  std::vector<double> runs;
  for (int r = 0; r < repeats; ++r) runs.push_back(run());
  std::sort(runs.begin(), runs.end());
  return {runs.front(), runs[runs.size() / 2], static_cast<std::int64_t>(t.messages.size())};
}
Handoff measure(KvStore& from, SeqId seq, KvStore& to, const Timeline& t, Link link, int repeats) {
  return measure(t, repeats, [&] { return hand_off(from, seq, to, t, link); });
}

// One session to the receiving process listening at `socket`; the
// sender's seconds.
std::string g_ipc_link;  // its describe()
double ipc_hand_off(KvStore& from, SeqId seq, const Timeline& t, const std::string& socket) {
  auto src = bench_source(from, seq, t);
  auto host = unix_connect(socket, deadline_in(30));
  if (!host) die(host.error().to_string());
  auto link = cuda_ipc_link(std::move(*host), deadline_in(30));
  if (!link) die(link.error().to_string());
  g_ipc_link = (*link)->describe();
  auto sent = send_session(**link, *src, t, {.timeout_s = 60});
  (*link)->close();
  if (!sent) die("ipc handoff: " + sent.error().to_string());
  return sent->seconds;
}

// The receiving process of the ipc handoffs: `sessions` sessions into a
// store of muse-glimmer at context `n` on `gpu`, each removed again.
int ipc_receiver(const std::string& socket, std::int64_t n, int sessions, int gpu) {
  check_cuda(cudaSetDevice(gpu), "cudaSetDevice");
  auto to = make_store(BackendKind::kCuda, *preset_config("muse-glimmer"), {.max_sequences = 1, .context = n});
  if (!to) die(to.error().to_string());
  auto listener = unix_listen(socket);
  if (!listener) die(listener.error().to_string());
  for (int i = 0; i < sessions; ++i) {
    auto host = (*listener)->accept(deadline_in(120));
    if (!host) die(host.error().to_string());
    auto link = cuda_ipc_link(std::move(*host), deadline_in(30));
    if (!link) die(link.error().to_string());
    StoreTarget target(**to);
    auto received = receive_session(**link, target, {.timeout_s = 60, .credit_bytes = std::int64_t{1} << 30,
                                                     .max_message_bytes = std::int64_t{1} << 30});
    (*link)->close();
    if (!received) die("ipc receiver: " + received.error().to_string());
    check((*to)->remove_sequence(*target.sequence()), "remove_sequence");
  }
  return 0;
}

// Starts this program as the ipc receiver and waits for its socket.
pid_t start_ipc_receiver(const char* self, const std::string& socket, std::int64_t n, int sessions, int gpu) {
  const std::string ns = std::to_string(n), ss = std::to_string(sessions), gs = std::to_string(gpu);
  std::vector<const char*> argv = {self, "--ipc-receiver", socket.c_str(), "--tokens", ns.c_str(),
                                   "--sessions", ss.c_str(), "--peer-gpu", gs.c_str(), nullptr};
  pid_t pid = 0;
  if (posix_spawn(&pid, self, nullptr, nullptr, const_cast<char* const*>(argv.data()), environ) != 0)
    die("cannot start the ipc receiver");
  for (int i = 0; i < 3000 && access(socket.c_str(), F_OK) != 0; ++i) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) die("the ipc receiver ended before it listened");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return pid;
}

}  // namespace

int main(int argc, char** argv) {
  constexpr const char* kUsage =
      "usage: kvring-handoff-cuda-bench [--tokens N[,N...]] [--message-mib M] [--pinned-message-mib M]\n"
      "                                 [--peer-gpu G] [--prefill-tps T | --no-held] [--repeats R] [--json FILE]\n";
  auto args = cli::Args::parse(std::vector<std::string>(argv + 1, argv + argc), {"no-held", "help"},
                               {"tokens", "message-mib", "pinned-message-mib", "repeats", "peer-gpu", "ipc-receiver",
                                "sessions", "prefill-tps", "json"});
  if (!args) die(args.error().message + "\n" + kUsage);
  if (args->flag("help")) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (!args->positional().empty()) die("unexpected argument '" + args->positional()[0] + "'\n" + kUsage);
  const std::int64_t max_context = preset_config("muse-glimmer")->max_context;
  auto integer = [&](const char* name, std::int64_t fallback, std::int64_t lo, std::int64_t hi) {
    auto v = args->integer(name, fallback, lo, hi);
    if (!v) die(v.error().message);
    return *v;
  };
  // --tokens: a comma-separated list of prompt lengths.
  std::vector<std::int64_t> tokens;
  for (std::string rest = args->str("tokens", "32768,131072"); !rest.empty();) {
    const std::size_t comma = rest.find(',');
    const std::string one = rest.substr(0, comma);
    auto v = cli::Args::parse_integer("tokens", one, 1, max_context);
    if (!v) die(v.error().message);
    tokens.push_back(*v);
    rest = comma == std::string::npos ? "" : rest.substr(comma + 1);
    if (comma != std::string::npos && rest.empty()) die("--tokens ends with a comma");
  }
  const std::int64_t message_mib = integer("message-mib", 64, 1, 4096);
  const std::int64_t pinned_message_mib = integer("pinned-message-mib", 8, 1, 4096);
  constexpr std::int64_t kMaxRepeats = 1000;
  const int repeats = static_cast<int>(integer("repeats", 3, 1, kMaxRepeats));
  int peer_gpu = static_cast<int>(integer("peer-gpu", -1, -1, 1023));
  // (The ipc receiver's: two schedules, each a warm-up and the repeats.)
  const int sessions = static_cast<int>(integer("sessions", 0, 0, 2 * (kMaxRepeats + 1)));
  double prefill_tps = 0;
  if (args->has("prefill-tps")) {
    const std::string v = args->str("prefill-tps");
    char* end = nullptr;
    prefill_tps = std::strtod(v.c_str(), &end);
    if (end != v.c_str() + v.size() || !std::isfinite(prefill_tps) || prefill_tps <= 0)
      die("--prefill-tps must be a positive number of tokens a second, got '" + v + "'");
  }
  const bool held_runs = !args->flag("no-held");
  if (args->has("prefill-tps") && !held_runs) die("--prefill-tps and --no-held exclude each other");
  const std::string json_path = args->str("json"), ipc_socket = args->str("ipc-receiver");
  if (!ipc_socket.empty()) {
    if (tokens.size() != 1 || sessions < 1 || peer_gpu < 0) die("--ipc-receiver takes one --tokens, --sessions, --peer-gpu");
    return ipc_receiver(ipc_socket, tokens[0], sessions, peer_gpu);
  }
  // A path that cannot be written fails before anything is measured; the
  // file is written whole at the end.
  if (!json_path.empty())
    if (const std::string why = bench::output_problem(json_path); !why.empty()) die("--json: " + why);
  if (cuda_device_count() == 0) {
    std::fprintf(stderr, "kvring-handoff-cuda-bench: no GPU is visible; nothing measured\n");
    return 1;
  }
  if (peer_gpu < 0) peer_gpu = cuda_device_count() > 1 ? 1 : 0;
  if (peer_gpu >= cuda_device_count()) die("--peer-gpu " + std::to_string(peer_gpu) + ": no such GPU");
  g_peer_gpu = peer_gpu;
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
    const StoreOptions o{.max_sequences = 1, .context = n, .attention = AttentionNumeric::kF16};
    auto from = make_store(BackendKind::kCuda, config, o);
    if (!from) die(from.error().to_string());
    auto to = make_store(BackendKind::kCuda, config, o);
    if (!to) die(to.error().to_string());
    const SeqId seq = *(*from)->add_sequence();
    // The sender's session: N - 1 positions prefilled in chunks of 2048
    // (every layer's store and attention under the f16 numeric, seeded f16
    // K and V, f32 queries), timed: the pace of the simulated prefills below.
    const std::int64_t kv = config.kv_dim(), chunk = 2048, layers = config.n_layers;
    const std::int64_t width = config.n_heads * config.head_dim;
    std::vector<std::uint16_t> host(static_cast<std::size_t>(chunk * std::max(kv, width)));
    for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<std::uint16_t>(0x3000 + (i * 2654435761u) % 0x0c00);
    std::vector<float> queries(static_cast<std::size_t>(chunk * width));
    for (std::size_t i = 0; i < queries.size(); ++i) queries[i] = static_cast<float>((i * 2654435761u) % 2001) / 1000 - 1;
    void *dev = nullptr, *attended = nullptr, *qdev = nullptr;
    check_cuda(cudaMalloc(&dev, host.size() * 2), "cudaMalloc");
    check_cuda(cudaMalloc(&qdev, queries.size() * 4), "cudaMalloc");
    check_cuda(cudaMalloc(&attended, queries.size() * 4), "cudaMalloc");
    check_cuda(cudaMemcpy(dev, host.data(), host.size() * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
    check_cuda(cudaMemcpy(qdev, queries.data(), queries.size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
    check((*from)->synchronize(), "synchronize");
    const auto fill0 = Clock::now();
    for (std::int64_t at = 0; at < n - 1; at += chunk) {
      const std::int64_t c = std::min(chunk, n - 1 - at);
      const SeqSpan span{seq, at, c};
      const ConstView rows{dev, MemorySpace::kDevice, DType::kF16, c, kv, kv};
      const ConstView q{qdev, MemorySpace::kDevice, DType::kF32, c, width, width};
      const MutView o_view{attended, MemorySpace::kDevice, DType::kF32, c, width, width};
      for (std::int64_t l = 0; l < layers; ++l)
        check((*from)->prefill(l, {&span, 1}, rows, rows, q, o_view), "prefill");
    }
    check((*from)->synchronize(), "synchronize");
    const double prefill_s = std::chrono::duration<double>(Clock::now() - fill0).count();
    const double measured_tps = static_cast<double>(n - 1) / prefill_s;
    check_cuda(cudaFree(dev), "cudaFree");
    check_cuda(cudaFree(attended), "cudaFree");
    check_cuda(cudaFree(qdev), "cudaFree");
    std::printf("%8lld prefill of the session's KV work (store and f16 attention, 52 layers, chunks of %lld): "
                "%.3f s, %.0f tokens/s\n",
                static_cast<long long>(n), static_cast<long long>(chunk), prefill_s, measured_tps);

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
    check_cuda(cudaSetDevice(peer_gpu), "cudaSetDevice");
    auto peer_to = make_store(BackendKind::kCuda, config, o);
    check_cuda(cudaSetDevice(0), "cudaSetDevice");
    if (!peer_to) die(peer_to.error().to_string());
    const Handoff peer = measure(**from, seq, **peer_to, *device_plan, Link::kPeer, repeats);
    // Each schedule held to a simulated prefill of n tokens at prefill_tps.
    nlohmann::json held = nlohmann::json::array();
    for (const Schedule sched : {Schedule::kSwaFirst, Schedule::kPaced}) {
      if (!held_runs) break;
      PlanOptions ho = po;
      ho.schedule = sched;
      ho.message_bytes = message_mib << 20;
      ho.prefill_tokens_per_s = prefill_tps > 0 ? prefill_tps : measured_tps;
      auto plan = plan_handoff(config, n, ho);
      if (!plan) die(plan.error().to_string());
      const Handoff h = measure(*plan, 1, [&] { return hand_off(**from, seq, **peer_to, *plan, Link::kPeer, true); });
      const double tail = h.best_s - plan->prefill_end_s;
      std::printf("%8s %-9s held to a prefill of %.3f s: commit at %.3f s, %.2f ms past its end; %.0f%% of the "
                  "unheld %.2f ms hidden\n",
                  "", schedule_name(sched), plan->prefill_end_s, h.best_s, tail * 1e3,
                  100 * std::clamp(1 - tail / peer.best_s, 0.0, 1.0), peer.best_s * 1e3);
      held.push_back({{"schedule", schedule_name(sched)}, {"prefill_s", plan->prefill_end_s}, {"commit_s", h.best_s},
                      {"commit_median_s", h.median_s}, {"tail_s", tail}});
    }
    peer_to->reset();
    const std::string socket = "/tmp/kvring-handoff-bench-" + std::to_string(getpid()) + ".sock";
    // Under swa-first too, whose 2 MiB ring messages come before the full
    // layers' 64 MiB ones: every link buffer grows once a session.
    PlanOptions so = po;
    so.schedule = Schedule::kSwaFirst;
    so.message_bytes = message_mib << 20;
    auto swa_plan = plan_handoff(config, n, so);
    if (!swa_plan) die(swa_plan.error().to_string());
    const pid_t receiver = start_ipc_receiver(argv[0], socket, n, 2 * (repeats + 1), peer_gpu);
    const Handoff ipc = measure(*device_plan, repeats, [&] { return ipc_hand_off(**from, seq, *device_plan, socket); });
    const Handoff ipc_swa = measure(*swa_plan, repeats, [&] { return ipc_hand_off(**from, seq, *swa_plan, socket); });
    int status = 0;
    waitpid(receiver, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) die("the ipc receiver failed");

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
    void* far = nullptr;
    check_cuda(cudaSetDevice(peer_gpu), "cudaSetDevice");
    check_cuda(cudaMalloc(&far, size), "cudaMalloc");
    check_cuda(cudaSetDevice(0), "cudaSetDevice");
    const double p2p = best_copy(repeats, s, [&] {
      check_cuda(cudaMemcpyPeerAsync(far, peer_gpu, src, 0, size, s), "p2p");
    });
    cudaFree(far);
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
    std::printf("%8s peer handoff %s, p2p copy %s, ratio %.2f (%s)\n", "", cell(peer.best_s).c_str(),
                cell(p2p).c_str(), p2p / peer.best_s, g_peer_link.c_str());
    std::printf("%8s ipc handoff  %s, p2p copy %s, ratio %.2f (%s)\n", "", cell(ipc.best_s).c_str(),
                cell(p2p).c_str(), p2p / ipc.best_s, g_ipc_link.c_str());
    std::printf("%8s ipc handoff  %s under swa-first (its buffers grow once a session)\n", "",
                cell(ipc_swa.best_s).c_str());
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
                   {"pinned_ucx_handoff_median_s", ucx ? nlohmann::json(ucx->median_s) : nlohmann::json()},
                   {"peer_gpu", peer_gpu},
                   {"peer_link", g_peer_link},
                   {"peer_handoff_s", peer.best_s},
                   {"peer_handoff_median_s", peer.median_s},
                   {"p2p_copy_s", p2p},
                   {"ipc_link", g_ipc_link},
                   {"ipc_handoff_s", ipc.best_s},
                   {"ipc_handoff_median_s", ipc.median_s},
                   {"ipc_swa_first_handoff_s", ipc_swa.best_s},
                   {"prefill_s", prefill_s},
                   {"prefill_tps", prefill_tps > 0 ? prefill_tps : measured_tps},
                   {"held", held}});
  }
  std::printf("ratio: the ceiling's time over the handoff's (1.0 = the handoff moves its payload as fast as\n"
              "one copy of it; the pinned path's ceiling is the slower of its two copies, which the staging\n"
              "overlaps)\n");
  if (!json_path.empty())
    if (const std::string why = bench::write_whole(json_path, nlohmann::json{{"device", prop.name}, {"runs", out}}.dump(2) + "\n");
        !why.empty())
      die(why);
  return 0;
}
