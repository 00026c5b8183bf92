// One end of a handoff between two processes over cuda_ipc_link on a Unix
// socket (cuda_handoff_test.cc starts a pair of them):
//
//   kvring_handoff_ipc_peer recv SOCKET [--host-staging] [--expect-loss] [STALL] [SESSIONS]
//   kvring_handoff_ipc_peer send SOCKET [--die-after N] [--expect-loss] [STALL] [SESSIONS]
//
// SESSIONS, the same at both ends: --sessions LIST, each entry a schedule
// (p paced, s swa-first) and the rows of a message ("p3,s24"; default
// "p3"), or --two-sessions ("p3,s24").
//
// Both prefill the same seeded session into a CUDA store of the current
// GPU. The sender hands its sequence off; the receiver installs it into a
// new sequence of its own store, then checks that it holds the bytes of the
// session it prefilled itself and decodes bit for bit as that session.
// With --die-after N the sender's process ends at its N-th message; a
// receiver told --expect-loss then checks that the session was refused and
// its store left as it was; a sender told --expect-loss, that its session
// failed; each prints how long its session ran. STALL, --stall-at N
// [--stall-s T]: the sender's copy of its N-th device message, or the
// receiver's reads of its N-th device message, wait behind a host function
// that returns once this end's sessions ended or T seconds (default 60)
// passed, so the peer waits for an event that comes late. --timeout S
// (default 30) is this end's sessions' timeout; connecting and the link's
// handshake wait up to max(S, 60) s, so that a peer slow to start (a busy
// host, a sanitizer) does not end a test of a stalled session before its
// session begins. Sessions after the first go over the same link
// (under "p3,s24" the second's messages are larger, so the sender's buffers
// grow between them), and the receiver checks each.
// Each prints one line, "ok ..." (exit 0) or "FAIL ..." (exit 1).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>

#include "cuda_test_util.h"
#include "handoff_test_util.h"
#include "kvring/handoff.h"
#include "kvring/model.h"

namespace kvring::handoff {
namespace {

constexpr std::int64_t kPrompt = 100, kTokens = 130, kChunk = 7, kVocab = 64;

int fail(const std::string& why) {
  std::printf("FAIL %s\n", why.c_str());
  return 1;
}

// Set once this end's sessions ended: a stalled stream's host function
// returns.
std::atomic<bool> g_unstall{false};
double g_stall_s = 60;
void CUDART_CB stall(void*) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(g_stall_s);
  while (!g_unstall.load() && std::chrono::steady_clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

// A received message's device bytes whose reads, as the link sees them, end
// on a stream stalled behind `stall`: the `consumed` event the release
// names comes only once the stall ends.
class StalledReads final : public DeviceBytes {
 public:
  StalledReads(std::unique_ptr<DeviceBytes> inner, cudaStream_t stalled) : inner_(std::move(inner)), stalled_(stalled) {}
  ~StalledReads() override { (void)inner_->ready_on(stalled_); }
  const void* data() const override { return inner_->data(); }
  std::size_t size() const override { return inner_->size(); }
  Status ready_on(cudaStream_t stream) override { return inner_->ready_on(stream); }

 private:
  std::unique_ptr<DeviceBytes> inner_;
  cudaStream_t stalled_;
};

// Counts the device parts a sender sends (and the most device bytes of one
// message) and the device messages a receiver gets; ends the process at
// send `die_at` (from 1); stalls the copy of send `stall_at`, or the reads
// of device message `stall_at`.
class Counting : public testing::Relay {
 public:
  using Relay::Relay;
  ~Counting() override {
    if (stalled_) cudaStreamDestroy(stalled_);
  }
  int device_parts = 0, device_messages = 0, sends = 0, die_at = -1, stall_at = -1;
  std::size_t most_device_bytes = 0;
  Status send_message(const std::vector<Part>& parts, Deadline d) override {
    if (++sends == die_at) std::_Exit(3);  // mid-session, with device work in flight
    std::size_t device_bytes = 0;
    for (const Part& p : parts) {
      device_parts += p.kind == MemoryKind::kCudaDevice;
      if (p.kind == MemoryKind::kCudaDevice) device_bytes += p.size;
    }
    most_device_bytes = std::max(most_device_bytes, device_bytes);
    if (device_bytes > 0 && ++device_sends_ == stall_at)
      for (const Part& p : parts)
        if (p.kind == MemoryKind::kCudaDevice) {
          if (cudaLaunchHostFunc(p.stream, stall, nullptr) != cudaSuccess) std::_Exit(4);
          break;
        }
    return inner_.send_message(parts, d);
  }
  Status recv(ReceivedMessage& out, Deadline d, std::size_t max, bool keep_device) override {
    Status s = inner_.recv(out, d, max, keep_device);
    if (s.ok() && out.device && ++device_messages == stall_at) {
      if (cudaStreamCreateWithFlags(&stalled_, cudaStreamNonBlocking) != cudaSuccess ||
          cudaLaunchHostFunc(stalled_, stall, nullptr) != cudaSuccess)
        std::_Exit(4);
      out.device = std::make_unique<StalledReads>(std::move(out.device), stalled_);
    }
    return s;
  }

 private:
  int device_sends_ = 0;
  cudaStream_t stalled_ = nullptr;
};

int run(int argc, char** argv) {
  if (argc < 3) return fail("usage: kvring_handoff_ipc_peer send|recv SOCKET [FLAG]");
  const std::string role = argv[1], path = argv[2];
  bool host_staging = false, expect_loss = false;
  int die_at = -1, stall_at = -1;
  double timeout_s = 30;
  constexpr double kSetupS = 60;
  // Each session's schedule and rows a message ("p3": paced, 3 rows).
  std::vector<std::pair<Schedule, std::int64_t>> specs = {{Schedule::kPaced, 3}};
  for (int i = 3; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--host-staging") host_staging = true;
    else if (flag == "--expect-loss") expect_loss = true;
    else if (flag == "--die-after" && i + 1 < argc) die_at = std::atoi(argv[++i]);
    else if (flag == "--stall-at" && i + 1 < argc) stall_at = std::atoi(argv[++i]);
    else if (flag == "--stall-s" && i + 1 < argc) g_stall_s = std::atof(argv[++i]);
    else if (flag == "--timeout" && i + 1 < argc) timeout_s = std::atof(argv[++i]);
    else if (flag == "--two-sessions") specs = {{Schedule::kPaced, 3}, {Schedule::kSwaFirst, 24}};
    else if (flag == "--sessions" && i + 1 < argc) {
      specs.clear();
      for (std::string list = argv[++i]; !list.empty();) {
        const std::size_t comma = list.find(',');
        const std::string one = list.substr(0, comma);
        specs.push_back({one[0] == 's' ? Schedule::kSwaFirst : Schedule::kPaced, std::atoll(one.c_str() + 1)});
        list = comma == std::string::npos ? "" : list.substr(comma + 1);
      }
    } else return fail("unknown flag " + flag);
  }
  const ModelConfig config = testing::small_config(32, 256);
  auto model = ReferenceModel::create(config, {.hidden = 32, .vocab = kVocab});
  if (!model) return fail(model.error().to_string());
  const auto prompt = seeded_tokens(kPrompt, kVocab, 7);
  auto store = testing::new_store(BackendKind::kCuda, config, {.max_sequences = 3, .block_rows = 16});
  if (!store) return fail("no CUDA store");
  const SeqId seq = testing::prefill_in(**model, *store, prompt, kChunk);

  const int sessions = static_cast<int>(specs.size());
  const double setup_s = std::max(timeout_s, kSetupS);
  if (role == "send") {
    auto host = unix_connect(path, deadline_in(setup_s));
    if (!host) return fail(host.error().to_string());
    auto link = cuda_ipc_link(std::move(*host), deadline_in(setup_s));
    if (!link) return fail(link.error().to_string());
    Counting counting(**link);
    counting.die_at = die_at;
    counting.stall_at = stall_at;
    std::int64_t messages = 0;
    std::string most;  // each session's largest device bytes in one message
    for (int i = 0; i < sessions; ++i) {
      PlanOptions po;
      po.chunk_tokens = kChunk;
      po.schedule = specs[static_cast<std::size_t>(i)].first;
      po.message_bytes = specs[static_cast<std::size_t>(i)].second * 256;
      auto t = plan_handoff(config, kPrompt, po);
      if (!t) return fail(t.error().to_string());
      auto src =
          StoreSource::create(*store, seq, *t, std::vector<std::int32_t>(prompt.begin(), prompt.end() - 1), "ipc");
      if (!src) return fail(src.error().to_string());
      counting.most_device_bytes = 0;
      const auto start = Clock::now();
      auto sent = send_session(counting, **src, *t, {.timeout_s = timeout_s});
      const double took = std::chrono::duration<double>(Clock::now() - start).count();
      g_unstall = true;
      if (expect_loss) {
        (*link)->close();
        if (sent) return fail("the session was taken");
        std::printf("ok refused (%s) in %.2f s\n", sent.error().to_string().c_str(), took);
        return 0;
      }
      if (!sent) {
        (*link)->close();
        return fail("session " + std::to_string(i + 1) + ": " + sent.error().to_string());
      }
      messages += sent->messages;
      most += (i ? "," : "") + std::to_string(counting.most_device_bytes);
    }
    (*link)->close();
    std::printf("ok sent messages=%lld device_parts=%d most_device_bytes=%s link=%s\n", static_cast<long long>(messages),
                counting.device_parts, most.c_str(), (*link)->describe().c_str());
    return 0;
  }
  if (role != "recv") return fail("unknown role " + role);
  auto listener = unix_listen(path);
  if (!listener) return fail(listener.error().to_string());
  auto host = (*listener)->accept(deadline_in(setup_s));
  if (!host) return fail(host.error().to_string());
  auto link = cuda_ipc_link(std::move(*host), deadline_in(setup_s), host_staging);
  if (!link) return fail(link.error().to_string());
  Counting counting(**link);
  counting.stall_at = stall_at;
  const auto before = testing::live_bytes(*store, seq);
  const std::int64_t free_before = store->free_blocks();
  std::int64_t messages = 0;
  std::optional<std::pair<std::vector<std::int32_t>, std::vector<float>>> reference;  // `seq`'s decode
  for (int i = 0; i < sessions; ++i) {
    StoreTarget target(*store, {.expect = config});
    const auto start = Clock::now();
    auto received = receive_session(counting, target, {.timeout_s = timeout_s, .credit_bytes = 64 << 20});
    const double took = std::chrono::duration<double>(Clock::now() - start).count();
    g_unstall = true;
    if (expect_loss) {
      (*link)->close();
      if (received) return fail("a session whose sender died was committed");
      if (target.sequence() || store->sequence_count() != 1 || store->free_blocks() != free_before ||
          testing::live_bytes(*store, seq) != before)
        return fail("the refused session changed the store");
      std::printf("ok refused (%s) after %d device messages in %.2f s; the store is as it was\n",
                  received.error().to_string().c_str(), counting.device_messages, took);
      return 0;
    }
    const std::string which = "session " + std::to_string(i + 1) + ": ";
    if (!received) {
      (*link)->close();
      return fail(which + received.error().to_string());
    }
    if (!target.sequence()) return fail(which + "nothing committed");
    const SeqId moved = *target.sequence();
    if (target.header().metadata != "ipc") return fail(which + "metadata '" + target.header().metadata + "'");
    // The session as prefilled here (`seq` is decoded further below).
    if (before.empty() || testing::live_bytes(*store, moved) != before)
      return fail(which + "the installed rows differ from the session prefilled here");
    const std::vector<std::int32_t> head(prompt.begin(), prompt.end() - 1);
    if (!reference) reference = testing::greedy_decode(**model, *store, seq, head, prompt.back(), kTokens);
    const auto b = testing::greedy_decode(**model, *store, moved, head, prompt.back(), kTokens);
    if (reference->first != b.first || reference->second.size() != b.second.size() ||
        std::memcmp(reference->second.data(), b.second.data(), b.second.size() * 4) != 0)
      return fail(which + "the moved session decodes differently");
    messages += received->messages;
  }
  (*link)->close();
  std::printf("ok received sessions=%d messages=%lld device_messages=%d link=%s\n", sessions,
              static_cast<long long>(messages), counting.device_messages, (*link)->describe().c_str());
  return 0;
}

}  // namespace
}  // namespace kvring::handoff

int main(int argc, char** argv) { return kvring::handoff::run(argc, argv); }
