// Probes of the handoff under unusual but legitimate or hostile conditions.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <atomic>
#include <limits>
#include <thread>

#include "kvring/backend.h"
#include "kvring/handoff.h"
#include "kvring/model.h"
#include "handoff_test_util.h"
#include "test_util.h"

namespace kvring::handoff {
namespace {

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Many small messages and credits for all of them: the sender reads no ACK
// until its end, so ACKs pile up in the link's reverse direction.
TEST(H2, ManySmallMessagesOverUnixWithLargeCredits) {
  const ModelConfig config = testing::small_config(32, 4096);
  auto m = ReferenceModel::create(config, {.hidden = 32, .vocab = 64});
  ASSERT_TRUE(m.ok());
  const auto prompt = seeded_tokens(2000, 64, 7);
  auto from = make_store(BackendKind::kCpu, config, {.max_sequences = 1});
  ASSERT_TRUE(from.ok());
  const SeqId seq = testing::prefill_in(**m, **from, prompt, 128);
  PlanOptions o;
  o.chunk_tokens = 128;
  o.message_bytes = config.kv_dim() * 4;  // one row a message
  auto t = plan_handoff(config, 2000, o);
  ASSERT_TRUE(t.ok()) << t.error().to_string();
  std::printf("messages %zu payload %lld\n", t->messages.size(), (long long)t->payload.payload_bytes);
  const std::string path = ::testing::TempDir() + "kvring-h2-" + std::to_string(getpid()) + ".sock";
  auto listener = unix_listen(path);
  ASSERT_TRUE(listener.ok());
  auto to = make_store(BackendKind::kCpu, config, {.max_sequences = 1});
  StoreTarget target(**to);
  Result<ReceiveReport> received = io_error("not run");
  std::thread receiver([&] {
    auto link = (*listener)->accept(deadline_in(5));
    if (!link) { received = link.error(); return; }
    received = receive_session(**link, target, {.timeout_s = 3});
    (*link)->close();
  });
  auto link = unix_connect(path, deadline_in(5));
  ASSERT_TRUE(link.ok());
  auto src = StoreSource::create(**from, seq, *t, std::vector<std::int32_t>(prompt.begin(), prompt.end() - 1), "");
  ASSERT_TRUE(src.ok());
  const auto t0 = Clock::now();
  auto sent = send_session(**link, **src, *t, {.timeout_s = 3});
  (*link)->close();
  receiver.join();
  std::printf("took %.2f s\n", since(t0));
  EXPECT_TRUE(sent.ok()) << sent.error().to_string();
  EXPECT_TRUE(received.ok()) << received.error().to_string();
}


// Receive options whose max_keep_s is not a number or negative read as
// "no limit" and turned off the keep-alive bound and the session's bound:
// they are refused, like send_session's options out of range.
TEST(H2, ReceiveOptionsOutOfRangeAreRefused) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (const ReceiveOptions& bad : {ReceiveOptions{.max_keep_s = nan}, ReceiveOptions{.max_keep_s = -1},
                                    ReceiveOptions{.timeout_s = 0}, ReceiveOptions{.timeout_s = nan},
                                    ReceiveOptions{.timeout_s = -1}}) {
    auto [a, b] = local_pair();
    const std::string header = "header";  // never read: the options are refused first
    ASSERT_TRUE(a->send_message(header.data(), header.size(), deadline_in(1)).ok());
    auto to = make_store(BackendKind::kCpu, testing::small_config(32, 256), {.max_sequences = 1});
    StoreTarget target(**to);
    const auto got = receive_session(*b, target, bad);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.error().code, ErrorCode::kInvalidArgument);
    EXPECT_NE(got.error().message.find("receive options"), std::string::npos) << got.error().message;
    std::vector<std::uint8_t> in;
    EXPECT_TRUE(b->recv_message(in, deadline_in(0.05), 1 << 20).ok());  // the header is still there
  }
}

// A source whose rows become final only after `delay_s` (a prefill still
// running): the sender keeps the link alive meanwhile.
class LateSource : public HandoffSource {
 public:
  LateSource(HandoffSource& s, double delay_s) : s_(s), ready_(deadline_in(delay_s)) {}
  const Snapshot& header() const override { return s_.header(); }
  Result<bool> wait_final(const PlannedMessage&, Deadline d) override {
    std::this_thread::sleep_until(std::min(d, ready_));
    return Clock::now() >= ready_;
  }
  Status rows(const PlannedMessage& m, const std::uint16_t** k, const std::uint16_t** v) override {
    return s_.rows(m, k, v);
  }

 private:
  HandoffSource& s_;
  Deadline ready_;
};

// The two ends' timeouts are set apart (serve's --timeout, run's
// --handoff-timeout): a sender whose own timeout is longer than the
// receiver's must still keep it alive through a prefill wait.
TEST(H2, KeepAlivesOutpaceAShorterReceiverTimeout) {
  const ModelConfig config = testing::small_config(32, 256);
  auto m = ReferenceModel::create(config, {.hidden = 32, .vocab = 64});
  const auto prompt = seeded_tokens(100, 64, 7);
  auto from = make_store(BackendKind::kCpu, config, {.max_sequences = 1});
  const SeqId seq = testing::prefill_in(**m, **from, prompt, 7);
  auto t = plan_handoff(config, 100, {});
  ASSERT_TRUE(t.ok());
  auto src = StoreSource::create(**from, seq, *t, std::vector<std::int32_t>(prompt.begin(), prompt.end() - 1), "");
  ASSERT_TRUE(src.ok());
  LateSource late(**src, 3.0);
  auto [a, b] = local_pair();
  auto to = make_store(BackendKind::kCpu, config, {.max_sequences = 1});
  StoreTarget target(**to);
  Result<ReceiveReport> got = io_error("not run");
  std::thread rx([&, bb = b.get()] {
    got = receive_session(*bb, target, {.timeout_s = 1.5});
    bb->close();
  });
  const auto sent = send_session(*a, late, *t, {.timeout_s = 8});
  a->close();
  rx.join();
  EXPECT_TRUE(got.ok()) << got.error().to_string();
  EXPECT_TRUE(sent.ok()) << sent.error().to_string();
}

}  // namespace
}  // namespace kvring::handoff
