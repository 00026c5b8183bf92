// One end of a handoff between two processes over cuda_ipc_link on a Unix
// socket (cuda_handoff_test.cc starts a pair of them):
//
//   kvring_handoff_ipc_peer recv SOCKET [--host-staging | --expect-loss]
//   kvring_handoff_ipc_peer send SOCKET [--die-after N]
//
// Both prefill the same seeded session into a CUDA store of the current
// GPU. The sender hands its sequence off; the receiver installs it into a
// new sequence of its own store, then checks that it holds the bytes of the
// session it prefilled itself and decodes bit for bit as that session.
// With --die-after N the sender's process ends at its N-th message; a
// receiver told --expect-loss then checks that the session was refused and
// its store left as it was.
// Each prints one line, "ok ..." (exit 0) or "FAIL ..." (exit 1).
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

// Counts the device parts a sender sends and the device messages a
// receiver gets; ends the process at send `die_at` (from 1).
class Counting : public testing::Relay {
 public:
  using Relay::Relay;
  int device_parts = 0, device_messages = 0, sends = 0, die_at = -1;
  Status send_message(const std::vector<Part>& parts, Deadline d) override {
    if (++sends == die_at) std::_Exit(3);  // mid-session, with device work in flight
    for (const Part& p : parts) device_parts += p.kind == MemoryKind::kCudaDevice;
    return inner_.send_message(parts, d);
  }
  Status recv(ReceivedMessage& out, Deadline d, std::size_t max, bool keep_device) override {
    Status s = inner_.recv(out, d, max, keep_device);
    if (s.ok() && out.device) ++device_messages;
    return s;
  }
};

int run(int argc, char** argv) {
  if (argc < 3) return fail("usage: kvring_handoff_ipc_peer send|recv SOCKET [--host-staging]");
  const std::string role = argv[1], path = argv[2];
  const std::string flag = argc > 3 ? argv[3] : "";
  const bool host_staging = flag == "--host-staging", expect_loss = flag == "--expect-loss";
  const int die_at = flag == "--die-after" && argc > 4 ? std::atoi(argv[4]) : -1;
  const ModelConfig config = testing::small_config(32, 256);
  auto model = ReferenceModel::create(config, {.hidden = 32, .vocab = kVocab});
  if (!model) return fail(model.error().to_string());
  const auto prompt = seeded_tokens(kPrompt, kVocab, 7);
  auto store = testing::new_store(BackendKind::kCuda, config, {.max_sequences = 3, .block_rows = 16});
  if (!store) return fail("no CUDA store");
  const SeqId seq = testing::prefill_in(**model, *store, prompt, kChunk);
  const double timeout_s = 30;

  if (role == "send") {
    PlanOptions po;
    po.chunk_tokens = kChunk;
    po.message_bytes = 3 * 256;
    auto t = plan_handoff(config, kPrompt, po);
    if (!t) return fail(t.error().to_string());
    auto src = StoreSource::create(*store, seq, *t, std::vector<std::int32_t>(prompt.begin(), prompt.end() - 1), "ipc");
    if (!src) return fail(src.error().to_string());
    auto host = unix_connect(path, deadline_in(timeout_s));
    if (!host) return fail(host.error().to_string());
    auto link = cuda_ipc_link(std::move(*host), deadline_in(timeout_s));
    if (!link) return fail(link.error().to_string());
    Counting counting(**link);
    counting.die_at = die_at;
    auto sent = send_session(counting, **src, *t, {.timeout_s = timeout_s});
    (*link)->close();
    if (!sent) return fail(sent.error().to_string());
    std::printf("ok sent messages=%lld device_parts=%d link=%s\n", static_cast<long long>(sent->messages),
                counting.device_parts, (*link)->describe().c_str());
    return 0;
  }
  if (role != "recv") return fail("unknown role " + role);
  auto listener = unix_listen(path);
  if (!listener) return fail(listener.error().to_string());
  auto host = (*listener)->accept(deadline_in(timeout_s));
  if (!host) return fail(host.error().to_string());
  auto link = cuda_ipc_link(std::move(*host), deadline_in(timeout_s), host_staging);
  if (!link) return fail(link.error().to_string());
  Counting counting(**link);
  const auto before = testing::live_bytes(*store, seq);
  const std::int64_t free_before = store->free_blocks();
  StoreTarget target(*store, {.expect = config});
  auto received = receive_session(counting, target, {.timeout_s = timeout_s, .credit_bytes = 64 << 20});
  (*link)->close();
  if (expect_loss) {
    if (received) return fail("a session whose sender died was committed");
    if (target.sequence() || store->sequence_count() != 1 || store->free_blocks() != free_before ||
        testing::live_bytes(*store, seq) != before)
      return fail("the refused session changed the store");
    std::printf("ok refused (%s) after %d device messages; the store is as it was\n",
                received.error().to_string().c_str(), counting.device_messages);
    return 0;
  }
  if (!received) return fail(received.error().to_string());
  if (!target.sequence()) return fail("nothing committed");
  const SeqId moved = *target.sequence();
  if (target.header().metadata != "ipc") return fail("metadata '" + target.header().metadata + "'");
  const auto want = testing::live_bytes(*store, seq), got = testing::live_bytes(*store, moved);
  if (want.empty() || got != want) return fail("the installed rows differ from the session prefilled here");
  const std::vector<std::int32_t> head(prompt.begin(), prompt.end() - 1);
  const auto a = testing::greedy_decode(**model, *store, seq, head, prompt.back(), kTokens);
  const auto b = testing::greedy_decode(**model, *store, moved, head, prompt.back(), kTokens);
  if (a.first != b.first || std::memcmp(a.second.data(), b.second.data(), a.second.size() * 4) != 0)
    return fail("the moved session decodes differently");
  std::printf("ok received messages=%lld device_messages=%d link=%s\n", static_cast<long long>(received->messages),
              counting.device_messages, (*link)->describe().c_str());
  return 0;
}

}  // namespace
}  // namespace kvring::handoff

int main(int argc, char** argv) { return kvring::handoff::run(argc, argv); }
