// Probes of the handoff under unusual but legitimate or hostile conditions.
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <thread>

#include "handoff_test_util.h"
#include "handoff_wire.h"
#include "kvring/backend.h"
#include "kvring/handoff.h"
#include "kvring/model.h"
#include "test_util.h"

namespace kvring::handoff {
namespace {

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// One session over a Unix socket at a fresh path named by `name`: the
// receiver into `target` on a thread, `send` on this one with the
// sender's end of the link. Returns what the receiver reported.
Result<ReceiveReport> over_unix(const std::string& name, HandoffTarget& target, const ReceiveOptions& options,
                                const std::function<void(Transport&)>& send) {
  const std::string path = ::testing::TempDir() + "kvring-" + name + "-" + std::to_string(getpid()) + ".sock";
  auto listener = unix_listen(path);
  if (!listener) return listener.error();
  Result<ReceiveReport> received = io_error("not run");
  std::thread receiver([&] {
    auto link = (*listener)->accept(deadline_in(5));
    if (!link) {
      received = link.error();
      return;
    }
    received = receive_session(**link, target, options);
    (*link)->close();
  });
  auto link = unix_connect(path, deadline_in(5));
  EXPECT_TRUE(link.ok());
  if (link) {
    send(**link);
    (*link)->close();
  }
  receiver.join();
  return received;
}

// Many small messages and credits for all of them: the sender reads no ACK
// until its end, so ACKs pile up in the link's reverse direction.
TEST(HandoffBounds, ManySmallMessagesOverUnixWithLargeCredits) {
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
  auto to = make_store(BackendKind::kCpu, config, {.max_sequences = 1});
  StoreTarget target(**to);
  auto src = StoreSource::create(**from, seq, *t, std::vector<std::int32_t>(prompt.begin(), prompt.end() - 1), "");
  ASSERT_TRUE(src.ok());
  Result<SendReport> sent = io_error("not run");
  const auto received = over_unix("bounds", target, {.timeout_s = 3},
                                  [&](Transport& link) { sent = send_session(link, **src, *t, {.timeout_s = 3}); });
  EXPECT_TRUE(sent.ok()) << sent.error().to_string();
  EXPECT_TRUE(received.ok()) << received.error().to_string();
}

// Receive options whose max_keep_s is not a number or negative read as
// "no limit" and turned off the keep-alive bound and the session's bound:
// they are refused, like send_session's options out of range.
TEST(HandoffBounds, ReceiveOptionsOutOfRangeAreRefused) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (const ReceiveOptions& bad :
       {ReceiveOptions{.max_keep_s = nan}, ReceiveOptions{.max_keep_s = -1}, ReceiveOptions{.timeout_s = 0},
        ReceiveOptions{.timeout_s = nan}, ReceiveOptions{.timeout_s = -1}}) {
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

// A prefilled session of `tokens` tokens of a small config, its plan and a
// source that sends it, and an empty store of the same geometry to take it.
struct Prefilled {
  ModelConfig config = testing::small_config(32, 256);
  std::unique_ptr<KvStore> from, to;
  Timeline timeline;
  std::unique_ptr<HandoffSource> source;
};
Prefilled prefilled(std::int64_t tokens, const PlanOptions& plan = {}) {
  Prefilled p;
  auto m = ReferenceModel::create(p.config, {.hidden = 32, .vocab = 64});
  EXPECT_TRUE(m.ok());
  const auto prompt = seeded_tokens(tokens, 64, 7);
  p.from = std::move(*make_store(BackendKind::kCpu, p.config, {.max_sequences = 1}));
  p.to = std::move(*make_store(BackendKind::kCpu, p.config, {.max_sequences = 1}));
  const SeqId seq = testing::prefill_in(**m, *p.from, prompt, 7);
  auto t = plan_handoff(p.config, tokens, plan);
  EXPECT_TRUE(t.ok());
  p.timeline = std::move(*t);
  auto src =
      StoreSource::create(*p.from, seq, p.timeline, std::vector<std::int32_t>(prompt.begin(), prompt.end() - 1), "");
  EXPECT_TRUE(src.ok());
  p.source = std::move(*src);
  return p;
}

// The two ends' timeouts are set apart (serve's --timeout, run's
// --handoff-timeout): a sender whose own timeout is longer than the
// receiver's must still keep it alive through a prefill wait.
TEST(HandoffBounds, KeepAlivesOutpaceAShorterReceiverTimeout) {
  Prefilled p = prefilled(100);
  ASSERT_TRUE(p.source);
  const Timeline* t = &p.timeline;
  LateSource late(*p.source, 3.0);
  auto [a, b] = local_pair();
  StoreTarget target(*p.to);
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

// The receiver refused a session of keep-alives (max_keep_s), and the
// sender reports that reason as the receiver's.
void expect_keep_alive_refusal(const Result<ReceiveReport>& got, const Result<SendReport>& sent) {
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.error().message.find("sent only keep-alives"), std::string::npos) << got.error().to_string();
  ASSERT_FALSE(sent.ok());
  EXPECT_NE(sent.error().message.find("ended the session"), std::string::npos) << sent.error().to_string();
  EXPECT_NE(sent.error().message.find("sent only keep-alives"), std::string::npos) << sent.error().to_string();
}

// A receiver that ends a session while the sender waits on its prefill
// (only keep-alives for max_keep_s) says why before it closes the link; the
// sender, which reads no reply while it waits, hears that reason when its
// next keep-alive fails, not just that the link closed.
TEST(HandoffBounds, ASenderWaitingOnItsPrefillHearsWhyTheReceiverEnded) {
  Prefilled p = prefilled(100);
  ASSERT_TRUE(p.source);
  const Timeline* t = &p.timeline;
  LateSource late(*p.source, 30.0);
  StoreTarget target(*p.to);
  Result<SendReport> sent = io_error("not run");
  double took = 0;
  const auto got = over_unix("bounds-why", target, {.timeout_s = 3, .max_keep_s = 0.5}, [&](Transport& link) {
    const auto t0 = Clock::now();
    sent = send_session(link, late, *t, {.timeout_s = 3});
    took = since(t0);
  });
  expect_keep_alive_refusal(got, sent);
  EXPECT_LT(took, 10.0);
  EXPECT_EQ(p.to->sequence_count(), 0);
}

// A receiver that refuses a session of keep-alives (max_keep_s) and keeps
// the link open for its next session: the sender, holding its next
// message back on its prefill or on its pacing (1 B/s), reads the refusal
// before its next keep-alive and ends at once, where it would otherwise
// keep the link alive until the prefill or the pacing ended. In-process,
// over a Unix socket, over UCX (whose accept completes only as the
// sender's end makes progress, so each end is made on its own thread) and
// over a CUDA IPC link (both ends in this process, where a GPU is visible;
// its handshake, too, needs both ends at once).
TEST(HandoffBounds, ASenderHearsARefusalOnALinkLeftOpen) {
  enum class Link { kInProcess, kUnix, kUcx, kCudaIpc };
  for (const Link kind : {Link::kInProcess, Link::kUnix, Link::kUcx, Link::kCudaIpc}) {
    if (kind == Link::kUcx && !ucx_compiled()) continue;
    if (kind == Link::kCudaIpc && !cuda_device_available()) continue;
    for (const bool pacing : {false, true}) {
      const std::string name = kind == Link::kInProcess ? "in-process"
                               : kind == Link::kUnix    ? "unix"
                               : kind == Link::kUcx     ? "ucx"
                                                        : "cuda ipc";
      SCOPED_TRACE(name + (pacing ? ", pacing" : ", prefill"));
      Prefilled p = prefilled(100);
      ASSERT_TRUE(p.source);
      ASSERT_GT(p.timeline.messages.size(), 1u);
      LateSource late(*p.source, pacing ? 0.0 : 60.0);
      std::function<Result<std::unique_ptr<Transport>>()> accept, connect;
      std::unique_ptr<UnixListener> unix_listener;
      std::unique_ptr<UcxListener> ucx_listener;
      std::pair<std::unique_ptr<Transport>, std::unique_ptr<Transport>> pair;
      const std::string path = ::testing::TempDir() + "kvring-bounds-open-" + std::to_string(getpid()) + ".sock";
      if (kind == Link::kInProcess) {
        pair = local_pair();
        accept = [&]() -> Result<std::unique_ptr<Transport>> { return std::move(pair.second); };
        connect = [&]() -> Result<std::unique_ptr<Transport>> { return std::move(pair.first); };
      } else if (kind == Link::kCudaIpc) {
        pair = local_pair();
        accept = [&] { return cuda_ipc_link(std::move(pair.second), deadline_in(10)); };
        connect = [&] { return cuda_ipc_link(std::move(pair.first), deadline_in(10)); };
      } else if (kind == Link::kUnix) {
        auto l = unix_listen(path);
        ASSERT_TRUE(l.ok()) << l.error().to_string();
        unix_listener = std::move(*l);
        accept = [&] { return unix_listener->accept(deadline_in(10)); };
        connect = [&] { return unix_connect(path, deadline_in(10)); };
      } else {
        auto l = ucx_listen("127.0.0.1:0");
        ASSERT_TRUE(l.ok()) << l.error().to_string();
        ucx_listener = std::move(*l);
        accept = [&] { return ucx_listener->accept(deadline_in(10)); };
        connect = [&] { return ucx_connect("127.0.0.1:" + std::to_string(ucx_listener->port()), deadline_in(10)); };
      }
      StoreTarget target(*p.to);
      std::atomic<bool> sender_done{false};
      Result<ReceiveReport> got = io_error("not run");
      std::thread rx([&] {
        auto link = accept();
        if (!link) {
          got = link.error();
          return;
        }
        got = receive_session(**link, target, {.timeout_s = 3, .max_keep_s = 0.5});
        // The link stays open (a server between sessions), for as long as
        // a sender that does not hear the refusal could take here.
        const auto until = deadline_in(20);
        while (!sender_done && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        (*link)->close();
      });
      auto link = connect();
      EXPECT_TRUE(link.ok()) << link.error().to_string();
      Result<SendReport> sent = io_error("not connected");
      double took = 0;
      if (link) {
        const auto t0 = Clock::now();
        sent = send_session(**link, late, p.timeline, {.timeout_s = 3, .rate_bytes_per_s = pacing ? 1.0 : 0.0});
        took = since(t0);
      }
      sender_done = true;
      rx.join();
      if (link) (*link)->close();
      expect_keep_alive_refusal(got, sent);
      EXPECT_LT(took, 5.0);
      EXPECT_EQ(p.to->sequence_count(), 0);
    }
  }
}

// A target whose begin() and commit() take `delay_s` each (a receiver
// building its store, then making the sequence live).
class SlowTarget : public HandoffTarget {
 public:
  SlowTarget(HandoffTarget& t, double delay_s) : t_(t), delay_(duration_of(delay_s)) {}
  Status begin(const Snapshot& h) override {
    std::this_thread::sleep_for(delay_);
    return t_.begin(h);
  }
  Status put_rows(std::int64_t layer, std::int64_t first, std::int64_t rows, const std::uint8_t* k,
                  const std::uint8_t* v) override {
    return t_.put_rows(layer, first, rows, k, v);
  }
  Status commit() override {
    std::this_thread::sleep_for(delay_);
    return t_.commit();
  }
  void abort() override { t_.abort(); }

 private:
  HandoffTarget& t_;
  Clock::duration delay_;
};

// An honest receiver whose begin() and commit() each take most of the
// sender's timeout, with a payload whose bytes at min_bytes_per_s take far
// less: the sender's bound on the receiver does not count the wait before
// acceptance and allows the commit a timeout of its own, so the session
// completes.
TEST(HandoffBounds, AReceiverSlowToBeginAndCommitIsNotPastTheBound) {
  Prefilled p = prefilled(20);
  ASSERT_TRUE(p.source);
  const Timeline* t = &p.timeline;
  // The payload's bytes at 64 KiB/s take under 0.2 s: begin and commit
  // together (1.6 s) pass one timeout_s + those bytes' time and stay within
  // two.
  ASSERT_LT(static_cast<double>(t->payload.payload_bytes) / (64 << 10), 0.2);
  StoreTarget inner(*p.to);
  SlowTarget slow(inner, 0.8);
  auto [a, b] = local_pair();
  Result<ReceiveReport> got = io_error("not run");
  std::thread rx([&, bb = b.get()] {
    got = receive_session(*bb, slow, {.timeout_s = 5});
    bb->close();
  });
  const auto sent = send_session(*a, *p.source, *t, {.timeout_s = 1.0});
  a->close();
  rx.join();
  EXPECT_TRUE(sent.ok()) << sent.error().to_string();
  EXPECT_TRUE(got.ok()) << got.error().to_string();
  EXPECT_EQ(p.to->sequence_count(), 1);
}

// ---- Random re-splits of a real session, valid and broken ----

using Msg = std::vector<std::uint8_t>;
void put64(Msg& m, std::size_t at, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) m[at + i] = static_cast<std::uint8_t>(v >> (8 * i));
}
// A SHA-256 ROWS message of `rows` rows of `layer` from `first`, read from `store`.
Msg rows_msg(const KvStore& store, SeqId seq, std::int64_t n, std::int64_t layer, std::int64_t first,
             std::int64_t rows) {
  const std::size_t kv = static_cast<std::size_t>(store.config().kv_dim());
  std::vector<std::uint16_t> k(static_cast<std::size_t>(rows) * kv), v(k.size());
  EXPECT_TRUE(store.read_rows(seq, layer, first, rows, k.data(), v.data()).ok());
  Msg m(testing::kRowsFixed);
  m[0] = 4;
  put64(m, 1, static_cast<std::uint64_t>(n));
  for (int i = 0; i < 4; ++i) m[9 + i] = static_cast<std::uint8_t>(layer >> (8 * i));
  put64(m, 13, static_cast<std::uint64_t>(first));
  put64(m, 21, static_cast<std::uint64_t>(rows));
  const auto* kb = reinterpret_cast<const std::uint8_t*>(k.data());
  const auto* vb = reinterpret_cast<const std::uint8_t*>(v.data());
  m.insert(m.end(), kb, kb + k.size() * 2);
  m.insert(m.end(), vb, vb + v.size() * 2);
  testing::reseal_rows(m);
  return m;
}

TEST(HandoffBounds, RandomResplitsAndBreakages) {
  const ModelConfig config = testing::small_config(32, 256);
  auto model = ReferenceModel::create(config, {.hidden = 32, .vocab = 64});
  const auto prompt = seeded_tokens(100, 64, 7);
  auto from = make_store(BackendKind::kCpu, config, {.max_sequences = 1});
  const SeqId seq = testing::prefill_in(**model, **from, prompt, 7);
  auto t = plan_handoff(config, 100, {.chunk_tokens = 7});
  ASSERT_TRUE(t.ok());
  // The header, captured from a real send.
  Msg header;
  {
    testing::Recorder cap(nullptr);
    auto src = StoreSource::create(**from, seq, *t, std::vector<std::int32_t>(prompt.begin(), prompt.end() - 1), "");
    (void)send_session(cap, **src, *t, {.timeout_s = 1});
    ASSERT_FALSE(cap.sent.empty());
    header = cap.sent[0];
  }
  ASSERT_GT(header.size(), 64u);
  for (const StoreOptions& so : {StoreOptions{.max_sequences = 2, .block_rows = 16},
                                 StoreOptions{.max_sequences = 2, .slack = 5, .block_rows = 16},
                                 StoreOptions{.max_sequences = 2, .context = 128, .block_rows = 16}}) {
    auto to = make_store(BackendKind::kCpu, config, so);
    ASSERT_TRUE(to.ok()) << to.error().to_string();
    KvStore& store = **to;
    const SeqId other = testing::prefill_in(**model, store, seeded_tokens(100, 64, 5), 7);
    const auto other_bytes = testing::live_bytes(store, other);
    const auto want = testing::live_bytes(**from, seq);
    const auto free0 = store.free_blocks();
    std::mt19937_64 rng(12345);
    int accepted = 0, refused = 0, wrong = 0;
    for (int iter = 0; iter < 400; ++iter) {
      // Per layer, the live rows cut at random sizes; layers interleaved at random.
      std::vector<std::array<std::int64_t, 3>> pieces;  // layer, first, rows
      std::vector<std::int64_t> at, end;
      for (std::int64_t l = 0; l < config.n_layers; ++l) {
        const RingState r = *(*from)->ring(seq, l);
        at.push_back(r.origin_logical());
        end.push_back(r.next_position());
      }
      for (;;) {
        std::vector<std::int64_t> open;
        for (std::int64_t l = 0; l < config.n_layers; ++l)
          if (at[l] < end[l]) open.push_back(l);
        if (open.empty()) break;
        const std::int64_t l = open[rng() % open.size()];
        const std::int64_t n = std::min<std::int64_t>(end[l] - at[l], 1 + static_cast<std::int64_t>(rng() % 40));
        pieces.push_back({l, at[l], n});
        at[l] += n;
      }
      // A breakage, or none.
      const int kind = static_cast<int>(rng() % 8);
      bool valid = true;
      const std::size_t i = rng() % pieces.size();
      switch (kind) {
        case 0:  // a piece twice: a layer's rows sent twice
          pieces.insert(pieces.begin() + i, pieces[i]);
          valid = false;
          break;
        case 1:  // a piece missing
          pieces.erase(pieces.begin() + i);
          valid = false;
          break;
        case 2:  // a piece one row short: a gap before the next
          if (pieces[i][2] > 1) {
            pieces[i][2] -= 1;
            valid = false;
          }
          break;
        case 3:  // a piece shifted back a row: it overlaps the one before
          if (pieces[i][1] > 0) {
            pieces[i][1] -= 1;
            valid = false;
          }
          break;
        case 4:  // two pieces of a layer swapped
          if (i + 1 < pieces.size() && pieces[i][0] == pieces[i + 1][0]) {
            std::swap(pieces[i], pieces[i + 1]);
            valid = false;
          }
          break;
        default:  // none: the split is valid
          break;
      }
      std::vector<Msg> msgs;
      Msg h = header;
      put64(h, h.size() - 48, pieces.size());
      testing::reseal_header(h);
      msgs.push_back(h);
      std::int64_t bytes = 0;
      for (std::size_t n = 0; n < pieces.size(); ++n) {
        const auto [l, first, rows] = pieces[n];
        const RingState r = *(*from)->ring(seq, l);
        if (first < r.origin_logical() || first + rows > r.next_position()) {
          valid = false;
          continue;
        }
        msgs.push_back(rows_msg(**from, seq, static_cast<std::int64_t>(msgs.size()) - 1, l, first, rows));
        bytes += rows * config.kv_dim() * 4;
      }
      Msg e(49);
      e[0] = 8;
      put64(e, 1, msgs.size() - 1);
      put64(e, 9, static_cast<std::uint64_t>(bytes));
      if (msgs.size() - 1 != pieces.size()) {
        put64(msgs[0], msgs[0].size() - 48, msgs.size() - 1);
        testing::reseal_header(msgs[0]);
      }
      testing::restamp_end(e, msgs[0]);
      msgs.push_back(e);
      msgs.push_back(Msg{10});
      auto [a, b] = local_pair();
      for (const Msg& m : msgs) ASSERT_TRUE(a->send_message(m.data(), m.size(), deadline_in(1)).ok());
      StoreTarget target(store, {.expect = config});
      const auto got = receive_session(*b, target, {.timeout_s = 0.5});
      if (got.ok()) {
        ++accepted;
        const SeqId s2 = *target.sequence();
        if (testing::live_bytes(store, s2) != want) ++wrong;
        EXPECT_TRUE(valid) << "iteration " << iter << " kind " << kind << " was taken";
        ASSERT_TRUE(store.remove_sequence(s2).ok());
      } else {
        ++refused;
        EXPECT_FALSE(valid) << "iteration " << iter << ": " << got.error().to_string();
      }
      EXPECT_EQ(store.sequence_count(), 1);
      EXPECT_EQ(store.free_blocks(), free0);
      EXPECT_EQ(testing::live_bytes(store, other), other_bytes);
    }
    EXPECT_EQ(wrong, 0);
    // Both outcomes occur (179 and 221 of the 400 seeded splits).
    EXPECT_GT(accepted, 40);
    EXPECT_GT(refused, 40);
  }
}

// A receiver that takes each message and acknowledges it just within the
// sender's timeout held the sender for as many timeouts as there are
// messages (30 x 0.15 s against a 0.2 s timeout): the session's bound on
// the receiver (SendOptions::min_bytes_per_s) ends it.
TEST(HandoffBounds, SlowAcksAreBoundedOverTheSession) {
  PlanOptions o;
  o.chunk_tokens = 7;
  o.message_bytes = 7 * 128;
  o.credit_bytes = 7 * 128;
  Prefilled p = prefilled(100, o);
  auto [a, b] = local_pair();
  std::thread rx([&, bb = b.get()] {
    std::vector<std::uint8_t> in;
    (void)bb->recv_message(in, deadline_in(1), 1 << 30);
    std::vector<std::uint8_t> acc(9, 0);
    acc[0] = 2;
    acc[2] = 0x10;  // 4096 B of credits
    (void)bb->send_message(acc.data(), acc.size(), deadline_in(1));
    std::int64_t seqno = 0, taken = 0;
    while (bb->recv_message(in, deadline_in(2), 1 << 30).ok()) {
      if (in[0] != 4) continue;
      taken += (static_cast<std::int64_t>(in.size()) - static_cast<std::int64_t>(testing::kRowsFixed));
      std::this_thread::sleep_for(std::chrono::milliseconds(150));  // within the sender's 0.2 s
      std::vector<std::uint8_t> ack(17, 0);
      ack[0] = 5;
      for (int i = 0; i < 8; ++i) ack[1 + i] = static_cast<std::uint8_t>(seqno >> (8 * i));
      for (int i = 0; i < 8; ++i) ack[9 + i] = static_cast<std::uint8_t>(taken >> (8 * i));
      ++seqno;
      if (!bb->send_message(ack.data(), ack.size(), deadline_in(1)).ok()) break;
    }
  });
  const auto t0 = Clock::now();
  // The bound: 2 x 0.2 s + 24,960 B at 64 KiB/s, 0.78 s; the receiver would take 4.5 s.
  auto sent = send_session(*a, *p.source, p.timeline, {.timeout_s = 0.2});
  const double s = since(t0);
  a->close();
  rx.join();
  ASSERT_EQ(p.timeline.messages.size(), 30u);
  ASSERT_FALSE(sent.ok());
  EXPECT_NE(sent.error().message.find("did not take the session within 0.8 s"), std::string::npos)
      << sent.error().to_string();
  EXPECT_LT(s, 1.5);
}

// Credits past what a message of the receiver's max_message_bytes carries:
// the receiver hands out only what it takes in one message, so a sender
// whose message is larger refuses it at the acceptance, before any row
// moves, with the receiver's figure (not a broken link after the receiver
// refused the message by its size), and one whose messages fit is taken.
TEST(HandoffBounds, CreditsStayWithinTheMessageBound) {
  const ModelConfig config = testing::small_config(32, 256);
  auto m = ReferenceModel::create(config, {.hidden = 32, .vocab = 64});
  ASSERT_TRUE(m.ok());
  const auto prompt = seeded_tokens(100, 64, 7);
  auto from = make_store(BackendKind::kCpu, config, {.max_sequences = 1});
  ASSERT_TRUE(from.ok());
  const SeqId seq = testing::prefill_in(**m, **from, prompt, 128);
  const std::vector<std::int32_t> ids(prompt.begin(), prompt.end() - 1);
  constexpr std::int64_t kMaxMessage = 8 << 10;  // the header fits; the full plane's 99 rows (12,672 B) do not
  const std::int64_t granted = kMaxMessage - static_cast<std::int64_t>(testing::kRowsFixed);
  const ReceiveOptions ro{.timeout_s = 3, .credit_bytes = 1 << 20, .max_message_bytes = kMaxMessage};
  auto to = make_store(BackendKind::kCpu, config, {.max_sequences = 1});
  ASSERT_TRUE(to.ok());
  const std::int64_t free_before = (*to)->free_blocks();
  for (const std::int64_t message_bytes : {std::int64_t{4} << 20, std::int64_t{4} << 10}) {
    PlanOptions o;
    o.chunk_tokens = 128;
    o.message_bytes = message_bytes;
    auto t = plan_handoff(config, 100, o);
    ASSERT_TRUE(t.ok()) << t.error().to_string();
    std::int64_t largest = 0;
    for (const PlannedMessage& pm : t->messages) largest = std::max(largest, pm.bytes);
    auto src = StoreSource::create(**from, seq, *t, ids, "");
    ASSERT_TRUE(src.ok());
    StoreTarget target(**to);
    Result<SendReport> sent = io_error("not run");
    const auto received = over_unix("credits", target, ro,
                                    [&](Transport& link) { sent = send_session(link, **src, *t, {.timeout_s = 3}); });
    if (largest > granted) {
      ASSERT_FALSE(sent.ok());
      EXPECT_EQ(sent.error().code, ErrorCode::kInvalidArgument) << sent.error().to_string();
      EXPECT_NE(sent.error().message.find(std::string("a message of ")
                                              .append(std::to_string(largest))
                                              .append(" B exceeds the receiver's credits of ")
                                              .append(std::to_string(granted))),
                std::string::npos)
          << sent.error().to_string();
      ASSERT_FALSE(received.ok());
      EXPECT_NE(received.error().message.find("aborted"), std::string::npos) << received.error().to_string();
      EXPECT_EQ((*to)->sequence_count(), 0);
      EXPECT_EQ((*to)->free_blocks(), free_before);
    } else {
      ASSERT_TRUE(sent.ok()) << sent.error().to_string();
      ASSERT_TRUE(received.ok()) << received.error().to_string();
      EXPECT_EQ(sent->credit_bytes, granted);
      ASSERT_TRUE(target.sequence().has_value());
      EXPECT_EQ(testing::live_bytes(**to, *target.sequence()), testing::live_bytes(**from, seq));
    }
  }
}

}  // namespace
}  // namespace kvring::handoff
