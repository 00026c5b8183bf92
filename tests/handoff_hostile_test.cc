// Hostile peers: a legitimate session's messages recorded, then edited
// (fields changed and digests recomputed, cut, repeated, reordered) and
// replayed into receive_session; scripted receivers against send_session.
// Every refusal is a clear error that leaves the target store as it was.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <thread>

#include "kvring/backend.h"
#include "kvring/handoff.h"
#include "kvring/model.h"
#include "kvring/sha256.h"
#include "kvring/snapshot.h"
#include "handoff_wire.h"
#include "handoff_test_util.h"
#include "test_util.h"

namespace kvring::handoff {
namespace {

using Msg = std::vector<std::uint8_t>;
constexpr std::int64_t kPrompt = 100, kChunk = 7;
using testing::kRowsFixed;
using testing::kRowsHead;
using testing::Recorder;
using testing::reseal_header;
using testing::reseal_rows;
using testing::restamp_end;

void put64(Msg& m, std::size_t at, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) m[at + i] = static_cast<std::uint8_t>(v >> (8 * i));
}
void put32(Msg& m, std::size_t at, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) m[at + i] = static_cast<std::uint8_t>(v >> (8 * i));
}
std::uint64_t get64(const Msg& m, std::size_t at) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | m[at + i];
  return v;
}

SeqId prefill_in(const ReferenceModel& model, KvStore& store, const std::vector<std::int32_t>& prompt) {
  return testing::prefill_in(model, store, prompt, kChunk);
}

// A source that sends an arbitrary header and no rows.
class HeaderOnly : public HandoffSource {
 public:
  explicit HeaderOnly(Snapshot h) : h_(std::move(h)) {}
  const Snapshot& header() const override { return h_; }
  Result<bool> wait_final(const PlannedMessage&, Deadline) override { return true; }
  Status rows(const PlannedMessage&, const std::uint16_t**, const std::uint16_t**) override {
    return make_error(ErrorCode::kInternal, "no rows");
  }
  Snapshot h_;
};

// The encoded HEADER message of `h` (with `n_messages` and `payload_bytes`).
Msg encode_header(const Snapshot& h, std::int64_t n_messages = 0, std::int64_t payload_bytes = 0) {
  HeaderOnly src(h);
  Timeline t;
  t.messages.resize(static_cast<std::size_t>(n_messages));
  t.payload.payload_bytes = payload_bytes;
  Recorder rec(nullptr);
  (void)send_session(rec, src, t, {.timeout_s = 0.1});
  return rec.sent.at(0);
}

// A sequential header of `c` at `context` holding `tokens` positions; its
// rings hold at most 2^62 positions (the most a ring state can), so a larger
// `tokens` gives a header whose count and rings disagree.
Snapshot make_header(const ModelConfig& c, std::int64_t context, std::int64_t tokens) {
  Snapshot h;
  h.config = c;
  h.context = context;
  h.token_count = tokens;
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    PlaneSnapshot p;
    p.kind = c.kind(l);
    p.layout = layout_for(p.kind);
    p.ring = *RingState::sequential(c.plane_capacity(l, context), p.kind == LayerKind::kSlidingRope,
                                    std::min(tokens, std::int64_t{1} << 62));
    h.planes.push_back(p);
  }
  return h;
}

std::int64_t payload_of(const Snapshot& h) {
  std::int64_t b = 0;
  for (const auto& p : h.planes) b += p.ring.len() * h.config.kv_dim() * 4;
  return b;
}

struct Replay {
  Result<ReceiveReport> received = io_error("not run");
  std::vector<Msg> replies;
  double seconds = 0;
};

class Hostile : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = testing::small_config(32, 256);
    auto m = ReferenceModel::create(config_, {.hidden = 32, .vocab = 64});
    ASSERT_TRUE(m.ok());
    model_ = *m;
    prompt_ = seeded_tokens(kPrompt, 64, 7);
    auto from = make_store(BackendKind::kCpu, config_, {.max_sequences = 1});
    ASSERT_TRUE(from.ok());
    from_ = std::move(*from);
    seq_ = prefill_in(*model_, *from_, prompt_);
    PlanOptions o;
    o.chunk_tokens = kChunk;
    o.message_bytes = 3 * 256;
    o.credit_bytes = 1 << 20;
    timeline_ = *plan_handoff(config_, kPrompt, o);
    // A legitimate stream, recorded.
    auto [a, b] = local_pair();
    Recorder rec(a.get());
    auto sink = make_store(BackendKind::kCpu, config_, {.max_sequences = 1});
    StoreTarget sink_target(**sink);
    Result<ReceiveReport> r = io_error("");
    std::thread t([&] { r = receive_session(*b, sink_target); });
    auto src = StoreSource::create(*from_, seq_, timeline_, std::vector<std::int32_t>(prompt_.begin(), prompt_.end() - 1), "m");
    ASSERT_TRUE(src.ok());
    auto s = send_session(rec, **src, timeline_);
    t.join();
    ASSERT_TRUE(s.ok()) << s.error().to_string();
    ASSERT_TRUE(r.ok());
    stream_ = rec.sent;
    ASSERT_EQ(stream_.back().size(), 1u);  // BYE
    stream_.pop_back();
    ASSERT_EQ(stream_.back()[0], 8);  // END
    auto to = make_store(BackendKind::kCpu, config_, {.max_sequences = 2, .block_rows = 16});
    ASSERT_TRUE(to.ok());
    store_ = std::move(*to);
    other_ = prefill_in(*model_, *store_, seeded_tokens(kPrompt, 64, 5));
    free_before_ = store_->free_blocks();
    // A store whose slots go as store_'s: its next handle is the one
    // store_'s next sequence must get.
    auto twin = make_store(BackendKind::kCpu, config_, {.max_sequences = 2, .block_rows = 16});
    ASSERT_TRUE(twin.ok());
    twin_ = std::move(*twin);
    ASSERT_TRUE(twin_->add_sequence().ok());
  }

  // A plan of few large messages (4 MiB each), for paced sends.
  static PlanOptions few_messages() {
    PlanOptions o;
    o.chunk_tokens = kChunk;
    o.message_bytes = 4 << 20;
    o.credit_bytes = 64 << 20;
    return o;
  }
  // Queues `msgs` then BYE (ends the receiver's linger) and runs the receiver here.
  Replay replay(const std::vector<Msg>& msgs, HandoffTarget& target, ReceiveOptions ro = {.timeout_s = 1}) {
    auto [a, b] = local_pair();
    for (const Msg& m : msgs) EXPECT_TRUE(a->send_message(m.data(), m.size(), deadline_in(1)).ok());
    const std::uint8_t bye = 10;
    EXPECT_TRUE(a->send_message(&bye, 1, deadline_in(1)).ok());
    Replay r;
    const auto t0 = Clock::now();
    r.received = receive_session(*b, target, ro);
    r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    Msg in;
    while (a->recv_message(in, deadline_in(0.01), 1 << 30).ok()) r.replies.push_back(in);
    return r;
  }
  // Runs `msgs` into a StoreTarget of store_ and checks the store is as it
  // was on failure, down to the handle its next sequence gets.
  Replay into_store(const std::vector<Msg>& msgs, ReceiveOptions ro = {.timeout_s = 1}) {
    StoreTarget target(*store_, {.expect = config_});
    Replay r = replay(msgs, target, ro);
    if (r.received.ok()) {
      EXPECT_TRUE(target.sequence().has_value());
      EXPECT_TRUE(store_->remove_sequence(*target.sequence()).ok());
      EXPECT_TRUE(twin_->remove_sequence(*twin_->add_sequence()).ok());
    } else {
      const auto mine = store_->add_sequence();
      const auto twins = twin_->add_sequence();
      EXPECT_TRUE(mine.ok() && twins.ok());
      if (mine.ok() && twins.ok()) {
        EXPECT_EQ(seq_name(*mine), seq_name(*twins)) << "the refused handoff moved the next handle";
        EXPECT_TRUE(store_->remove_sequence(*mine).ok() && twin_->remove_sequence(*twins).ok());
      }
    }
    EXPECT_EQ(store_->sequence_count(), 1);
    EXPECT_EQ(store_->free_blocks(), free_before_);
    EXPECT_EQ(target.pending_blocks(), 0);
    return r;
  }
  // A cache of the prompt's first kPrompt - 1 tokens, as from_'s sequence.
  std::unique_ptr<KvCache> prefilled_cache() const {
    auto cache = KvCache::create(BackendKind::kCpu, config_, {});
    if (!cache.ok()) return nullptr;
    std::vector<float> logits(static_cast<std::size_t>((kPrompt - 1) * 64));
    if (!model_->forward(**cache, 0, prompt_.data(), kPrompt - 1, logits.data()).ok()) return nullptr;
    return std::move(*cache);
  }
  // A source of `t` over from_'s sequence, or over `cache` (the same
  // prompt); null where it cannot be made.
  std::unique_ptr<HandoffSource> store_or_cache_source(bool from_store, const KvCache& cache,
                                                       const Timeline& t) const {
    const std::vector<std::int32_t> ids(prompt_.begin(), prompt_.end() - 1);
    if (from_store) {
      auto s = StoreSource::create(*from_, seq_, t, ids, "m");
      return s.ok() ? std::unique_ptr<HandoffSource>(std::move(*s)) : nullptr;
    }
    auto s = CacheSource::create(cache, t.payload, ids, "m");
    return s.ok() ? std::unique_ptr<HandoffSource>(std::move(*s)) : nullptr;
  }
  // Edits that take a planned message outside the session's planes.
  static std::vector<std::function<void(PlannedMessage&)>> outside_the_planes() {
    constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
    return {
        [](PlannedMessage& m) { m.rows = -1; },
        [](PlannedMessage& m) { m.rows = std::int64_t{1} << 40; },
        [](PlannedMessage& m) { m.rows = kMax; },
        [](PlannedMessage& m) { m.rows = 0; },
        [](PlannedMessage& m) { m.first_row = -1; },
        [](PlannedMessage& m) { m.first_row = kMax - 1; },
        [](PlannedMessage& m) { m.layer = -1; },
        [](PlannedMessage& m) { m.layer = 99; },
        [](PlannedMessage& m) { m.bytes = -1; },
    };
  }
  std::size_t first_rows() const { return 1; }
  std::size_t n_rows_msgs() const { return stream_.size() - 2; }

  ModelConfig config_;
  std::shared_ptr<const ReferenceModel> model_;
  std::vector<std::int32_t> prompt_;
  std::unique_ptr<KvStore> from_, store_;
  SeqId seq_{}, other_{};
  Timeline timeline_;
  std::vector<Msg> stream_;
  std::int64_t free_before_ = 0;
  std::unique_ptr<KvStore> twin_;
};

#define EXPECT_REFUSED(r, needle)                                                                  \
  do {                                                                                             \
    ASSERT_FALSE((r).received.ok());                                                               \
    EXPECT_NE((r).received.error().message.find(needle), std::string::npos)                        \
        << (r).received.error().to_string();                                                       \
  } while (0)

TEST_F(Hostile, HarnessReplaysALegitStream) {
  auto r = into_store(stream_);
  ASSERT_TRUE(r.received.ok()) << r.received.error().to_string();
}

TEST_F(Hostile, EmptyAndUnknownMessages) {
  EXPECT_REFUSED(into_store({Msg{}}), "empty");
  EXPECT_REFUSED(into_store({Msg{42}}), "did not start with a header");
  auto s = stream_;
  s.insert(s.begin() + 2, Msg{});
  EXPECT_REFUSED(into_store(s), "empty");
  s = stream_;
  s.insert(s.begin() + 2, Msg{77, 1, 2});
  EXPECT_REFUSED(into_store(s), "unexpected message type 77");
  s = stream_;
  s.insert(s.begin() + 2, Msg{6, 0});  // KEEP with a byte
  EXPECT_REFUSED(into_store(s), "unexpected message type 6");
  s = stream_;
  s.insert(s.begin() + 2, stream_[0]);  // a second header
  EXPECT_REFUSED(into_store(s), "unexpected message type 1");
}

TEST_F(Hostile, TruncatedRowsAtEveryLength) {
  const Msg& m = stream_[1];
  for (std::size_t n = 1; n < m.size(); n += (n < 80 ? 1 : 37)) {
    auto s = stream_;
    s[1].resize(n);
    auto r = into_store(s);
    ASSERT_FALSE(r.received.ok()) << n;
    EXPECT_EQ(r.received.error().code, ErrorCode::kCorruption) << n << r.received.error().to_string();
  }
}

TEST_F(Hostile, RowFieldsResealed) {
  auto with = [&](std::size_t msg, auto&& edit) {
    auto s = stream_;
    edit(s[msg]);
    reseal_rows(s[msg]);
    return into_store(s);
  };
  // Rows field disagrees with the bytes.
  EXPECT_REFUSED(with(1, [](Msg& m) { put64(m, 21, get64(m, 21) + 1); }), "rows");
  EXPECT_REFUSED(with(1, [](Msg& m) { put64(m, 21, 0); }), "for 0 rows");
  EXPECT_REFUSED(with(1, [](Msg& m) { put64(m, 21, ~std::uint64_t{0}); }), "rows");
  EXPECT_REFUSED(with(1, [](Msg& m) { put64(m, 21, std::uint64_t{1} << 62); }), "rows");
  // Bytes cut by one row with a matching rows field (then the layer is incomplete).
  EXPECT_REFUSED(with(1,
                      [&](Msg& m) {
                        const std::uint64_t rows = get64(m, 21);
                        const std::size_t kv = static_cast<std::size_t>(config_.kv_dim());
                        // K then V: drop the last row of each.
                        Msg k(m.begin() + kRowsFixed, m.begin() + kRowsFixed + rows * kv * 2);
                        Msg v(m.begin() + kRowsFixed + rows * kv * 2, m.end());
                        k.resize(k.size() - kv * 2);
                        v.resize(v.size() - kv * 2);
                        m.resize(kRowsFixed);
                        m.insert(m.end(), k.begin(), k.end());
                        m.insert(m.end(), v.begin(), v.end());
                        put64(m, 21, rows - 1);
                      }),
                 "rows from");
  // Layers out of range.
  EXPECT_REFUSED(with(1, [&](Msg& m) { put32(m, 9, static_cast<std::uint32_t>(config_.n_layers)); }), "layer 4");
  EXPECT_REFUSED(with(1, [](Msg& m) { put32(m, 9, 0xffffffffu); }), "layer 4294967295");
  // First row elsewhere: behind, ahead, negative, far past the context.
  EXPECT_REFUSED(with(1, [](Msg& m) { put64(m, 13, get64(m, 13) + 1); }), "rows from");
  EXPECT_REFUSED(with(1, [](Msg& m) { put64(m, 13, ~std::uint64_t{0}); }), "rows from -1");
  EXPECT_REFUSED(with(1, [](Msg& m) { put64(m, 13, std::uint64_t{1} << 62); }), "rows from");
  // Sequence numbers.
  EXPECT_REFUSED(with(1, [](Msg& m) { put64(m, 1, 1); }), "sequence number 1");
  EXPECT_REFUSED(with(2, [](Msg& m) { put64(m, 1, 0); }), "sequence number 0");
}

TEST_F(Hostile, RepeatedReorderedAndSkippedRows) {
  auto s = stream_;
  s.insert(s.begin() + 2, stream_[1]);
  EXPECT_REFUSED(into_store(s), "sequence number 0");
  s = stream_;
  std::swap(s[1], s[2]);
  EXPECT_REFUSED(into_store(s), "sequence number 1");
  // Renumbered so the sequence is right: the rows are then out of order.
  s = stream_;
  std::swap(s[1], s[2]);
  put64(s[1], 1, 0);
  put64(s[2], 1, 1);
  reseal_rows(s[1]);
  reseal_rows(s[2]);
  EXPECT_REFUSED(into_store(s), "expected");
  // A message dropped and the rest renumbered: END finds fewer.
  s = stream_;
  s.erase(s.begin() + 1);
  for (std::size_t i = 1; i + 1 < s.size(); ++i) {
    put64(s[i], 1, i - 1);
    reseal_rows(s[i]);
  }
  auto r = into_store(s);
  ASSERT_FALSE(r.received.ok());
  EXPECT_FALSE(r.received.error().message.empty());
}

TEST_F(Hostile, DigestMismatchAndFlippedBytes) {
  std::mt19937 rng(1);
  for (int i = 0; i < 40; ++i) {
    auto s = stream_;
    const std::size_t msg = 1 + rng() % n_rows_msgs();
    s[msg][rng() % s[msg].size()] ^= static_cast<std::uint8_t>(1 + rng() % 255);
    auto r = into_store(s);
    ASSERT_FALSE(r.received.ok());
  }
}

TEST_F(Hostile, EndMessages) {
  auto s = stream_;
  s.insert(s.begin() + 2, stream_.back());  // END early
  EXPECT_REFUSED(into_store(s), "the stream ended after 1 of");
  s = stream_;
  s.back()[20] ^= 1;  // END names another header
  EXPECT_REFUSED(into_store(s), "another session");
  s = stream_;
  s.back().pop_back();
  EXPECT_REFUSED(into_store(s), "malformed");
  s = stream_;
  s.back().push_back(0);
  EXPECT_REFUSED(into_store(s), "malformed");
  s = stream_;
  put64(s.back(), 9, get64(s.back(), 9) + 1);
  EXPECT_REFUSED(into_store(s), "the stream ended");
  s = stream_;
  s.pop_back();  // no END: the peer goes quiet
  EXPECT_REFUSED(into_store(s, {.timeout_s = 0.3}), "unexpected message type 10");
}

TEST_F(Hostile, AbortMessages) {
  auto s = stream_;
  s.insert(s.begin() + 3, Msg{7, 1});  // ABORT, truncated code
  EXPECT_REFUSED(into_store(s), "malformed error");
  s = stream_;
  s.insert(s.begin() + 3, Msg{7, 0xff, 0xff, 0xff, 0xff, 'x'});
  EXPECT_REFUSED(into_store(s), "malformed error");
  s = stream_;
  s.insert(s.begin() + 3, Msg{7, 2, 0, 0, 0, 'b', 'y', 'e'});
  EXPECT_REFUSED(into_store(s), "aborted: bye");
}

// A peer's abort text reaches the caller's message cut and escaped: no
// byte of it acts on a terminal, and a megabyte of it is not kept nor sent
// back whole in the receiver's ERROR.
TEST_F(Hostile, AbortTextIsCutAndEscaped) {
  Msg abort{7, 5, 0, 0, 0};
  const std::string hostile = "\x1b[2J\x1b]0;owned\x07\nFAKE: commit ok\r";
  abort.insert(abort.end(), hostile.begin(), hostile.end());
  abort.resize(abort.size() + (1 << 20), 'z');
  auto s = stream_;
  s.insert(s.begin() + 3, abort);
  const Replay r = into_store(s);
  ASSERT_FALSE(r.received.ok());
  const std::string& m = r.received.error().message;
  EXPECT_NE(m.find("aborted: \\x1b[2J\\x1b]0;owned\\x07\\x0aFAKE: commit ok\\x0dzzz"), std::string::npos) << m;
  EXPECT_NE(m.find("... (" + std::to_string(hostile.size() + (1 << 20)) + " bytes)"), std::string::npos)
      << m.substr(0, 300);
  EXPECT_LT(m.size(), std::size_t{4096});
  for (const char c : m) EXPECT_FALSE(static_cast<unsigned char>(c) < 0x20 || c == 0x7f) << static_cast<int>(c);
  for (const Msg& reply : r.replies) EXPECT_LT(reply.size(), std::size_t{4096}) << "reply type " << int(reply[0]);
  // The receiver's ERROR repeats the cut text and says how long it was.
  ASSERT_FALSE(r.replies.empty());
  const Msg& error = r.replies.back();
  ASSERT_EQ(error[0], 3);
  const std::string text(error.begin() + 5, error.end());
  EXPECT_EQ(text.size(), 2048u);
  EXPECT_NE(text.find(" bytes)"), std::string::npos) << text.substr(text.size() - 40);
}

// A rows message larger than the credits the receiver handed out is
// refused (by its size alone, before its bytes are taken, once it is past
// 4 KiB); one that fits them is not.
TEST_F(Hostile, RowsPastTheCreditsAreRefused) {
  const std::int64_t payload = static_cast<std::int64_t>(stream_[1].size() - kRowsFixed);
  const Replay over = into_store(stream_, {.timeout_s = 1, .credit_bytes = payload - 1});
  EXPECT_REFUSED(over, std::to_string(payload) + " B of rows, past the credits of " + std::to_string(payload - 1));
  // A message claimed past the credits and 4 KiB: refused by its size.
  Msg big = stream_[1];
  big.resize(big.size() + (std::size_t{1} << 20));
  auto s = stream_;
  s[1] = big;
  EXPECT_REFUSED(into_store(s, {.timeout_s = 1, .credit_bytes = payload}),
                 "exceeds " + std::to_string(std::max<std::int64_t>(payload + kRowsFixed, 4096)) + " B");
  std::int64_t largest = 0;
  for (std::size_t i = 1; i + 1 < stream_.size(); ++i)
    largest = std::max(largest, static_cast<std::int64_t>(stream_[i].size() - kRowsFixed));
  const Replay fits = into_store(stream_, {.timeout_s = 1, .credit_bytes = largest});
  EXPECT_TRUE(fits.received.ok()) << fits.received.error().to_string();
}

TEST_F(Hostile, TruncatedHeaderAtEveryLengthResealed) {
  const Msg& h = stream_[0];
  for (std::size_t n = 0; n + 32 < h.size(); ++n) {
    Msg m(h.begin(), h.begin() + n);
    m.resize(n + 32);
    reseal_header(m);
    auto s = stream_;
    s[0] = m;
    StoreTarget target(*store_);
    auto r = replay(s, target);
    ASSERT_FALSE(r.received.ok()) << n;
    EXPECT_EQ(store_->sequence_count(), 1);
    EXPECT_EQ(store_->free_blocks(), free_before_);
  }
  // And cut without resealing.
  for (std::size_t n = 0; n < h.size(); n += 7) {
    auto s = stream_;
    s[0].resize(n);
    StoreTarget target(*store_);
    auto r = replay(s, target);
    ASSERT_FALSE(r.received.ok()) << n;
  }
}

TEST_F(Hostile, HeaderFields) {
  const std::int64_t L = config_.n_layers;
  const std::size_t ctx_at = 60 + L + 32, count_at = ctx_at + 8, ids_at = count_at + 8;
  auto header_with = [&](auto&& edit) {
    auto s = stream_;
    edit(s[0]);
    reseal_header(s[0]);
    restamp_end(s.back(), s[0]);
    return s;
  };
  EXPECT_REFUSED(into_store(header_with([&](Msg& m) { put64(m, ctx_at, 0); })), "context 0");
  EXPECT_REFUSED(into_store(header_with([&](Msg& m) { put64(m, ctx_at, 257); })), "context 257");
  EXPECT_REFUSED(into_store(header_with([&](Msg& m) { put64(m, ctx_at, ~std::uint64_t{0}); })), "context");
  EXPECT_REFUSED(into_store(header_with([&](Msg& m) { put64(m, count_at, ~std::uint64_t{0}); })), "token_count");
  EXPECT_REFUSED(into_store(header_with([&](Msg& m) { put64(m, count_at, 100); })), "");
  EXPECT_REFUSED(into_store(header_with([&](Msg& m) { put64(m, ids_at, 98); })), "");
  EXPECT_REFUSED(into_store(header_with([&](Msg& m) { m[11] = 2; })), "row digest 2");
  EXPECT_REFUSED(into_store(header_with([&](Msg& m) { m[9] = 1; })), "protocol version 1");
  EXPECT_REFUSED(into_store(header_with([&](Msg& m) { m[1] = 'X'; })), "bad magic");
  EXPECT_REFUSED(into_store(header_with([&](Msg& m) { m[60] = 1; })), "fingerprint does not match");
  EXPECT_REFUSED(into_store(header_with([&](Msg& m) { m[60] = 7; })), "unknown kind");
  EXPECT_REFUSED(into_store(header_with([&](Msg& m) { put64(m, 12, 0); })), "layer count");
  EXPECT_REFUSED(into_store(header_with([&](Msg& m) { put64(m, 12, 1u << 20); })), "layer count");
  // Message count / payload bytes (the last 16 B before the digest).
  EXPECT_REFUSED(into_store(header_with([&](Msg& m) { put64(m, m.size() - 40, 1); })), "payload of 1 B");
  EXPECT_REFUSED(into_store(header_with([&](Msg& m) { put64(m, m.size() - 48, ~std::uint64_t{0}); })), "message count");
  EXPECT_REFUSED(into_store(header_with([&](Msg& m) { put64(m, m.size() - 48, 3); })), "rows past the header's 3 messages");
}

// Another geometry, valid on its own, with its own fingerprint.
TEST_F(Hostile, OtherGeometryHeader) {
  const ModelConfig other = testing::small_config(32, 256, 4, 4, 2, 32);  // head_dim 32
  auto s = stream_;
  s[0] = encode_header(make_header(other, 256, 99), 1, payload_of(make_header(other, 256, 99)));
  EXPECT_REFUSED(into_store(s), "head_dim 32 vs 16");  // StoreTarget with expect
  StoreTarget plain(*store_);  // no expect: the store's geometry
  auto r = replay(s, plain);
  EXPECT_REFUSED(r, "head_dim");
  EXPECT_EQ(store_->sequence_count(), 1);
  EXPECT_EQ(store_->free_blocks(), free_before_);
  // DetachedCacheTarget into the store.
  DetachedCacheTarget::Options o;
  o.store = store_.get();
  DetachedCacheTarget d(o);
  auto r2 = replay(s, d);
  EXPECT_REFUSED(r2, "head_dim");
  EXPECT_EQ(d.held_row_bytes(), 0);
  EXPECT_EQ(store_->sequence_count(), 1);
  EXPECT_EQ(store_->free_blocks(), free_before_);
}

// A begin refused for its header leaves the session in progress as it was,
// and rows outside the session's positions (negative, past its end, or so
// far that first + count overflows) are refused, not dropped.
TEST_F(Hostile, ARefusedBeginLeavesTheSessionInProgress) {
  const ModelConfig other = testing::small_config(32, 256, 4, 4, 2, 32);  // head_dim 32
  const Snapshot good = make_header(config_, 256, 60), bad = make_header(other, 256, 60);
  StoreTarget target(*store_, {.expect = config_});
  ASSERT_TRUE(target.begin(good).ok());
  const std::int64_t pending = target.pending_blocks();
  ASSERT_GT(pending, 0);
  const Status refused = target.begin(bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message.find("head_dim"), std::string::npos) << refused.to_string();
  EXPECT_EQ(target.pending_blocks(), pending);
  EXPECT_EQ(store_->free_blocks(), free_before_ - pending);
  const std::vector<std::uint8_t> rows(static_cast<std::size_t>(4 * config_.kv_dim() * 2), 0);
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  for (const auto& [first, n] : {std::pair<std::int64_t, std::int64_t>{-5, 3}, {-100, 1}, {0, -3}, {kMax - 1, 10},
                                 {58, 3}, {61, 0}, {0, kMax}}) {
    const Status st = target.put_rows(0, first, n, rows.data(), rows.data());
    ASSERT_FALSE(st.ok()) << first << " " << n;
    EXPECT_EQ(st.error().code, ErrorCode::kInvalidArgument) << st.to_string();
  }
  EXPECT_EQ(target.pending_blocks(), pending);
  // A header it takes replaces the session.
  ASSERT_TRUE(target.begin(good).ok());
  EXPECT_EQ(store_->free_blocks(), free_before_ - pending);
  target.abort();
  EXPECT_EQ(store_->free_blocks(), free_before_);
  EXPECT_EQ(store_->sequence_count(), 1);

  DetachedCacheTarget::Options o;
  o.store = store_.get();
  DetachedCacheTarget d(o);
  ASSERT_TRUE(d.begin(good).ok());
  const std::int64_t held = d.held_row_bytes();
  ASSERT_GT(held, 0);
  EXPECT_FALSE(d.begin(bad).ok());
  EXPECT_EQ(d.held_row_bytes(), held);
  d.abort();
  EXPECT_EQ(store_->free_blocks(), free_before_);
}

// A header that claims 2^26 token ids in a message of a few hundred bytes is
// refused for its ids before their vector is sized.
TEST_F(Hostile, HeaderClaimingMoreTokenIdsThanItHolds) {
  const std::int64_t L = config_.n_layers;
  const std::size_t ids_at = 60 + L + 32 + 16;
  Msg m(stream_[0].begin(), stream_[0].begin() + ids_at + 8);
  put64(m, ids_at, std::uint64_t{1} << 26);
  m.resize(m.size() + 32);
  reseal_header(m);
  StoreTarget target(*store_);
  auto r = replay({m}, target);
  EXPECT_REFUSED(r, "token ids");
  EXPECT_EQ(store_->free_blocks(), free_before_);
}

// A timeline is the caller's: a message whose rows lie outside the
// header's planes (a count that sizes no buffer, rows before or past the
// live ones, another layer) or whose bytes are not its rows' is refused
// before any source is asked for its rows, and the receiver is told.
TEST_F(Hostile, ATimelineMessageOutsideThePlanesIsRefused) {
  std::unique_ptr<KvCache> cache = prefilled_cache();
  ASSERT_NE(cache, nullptr);
  const std::vector<std::function<void(PlannedMessage&)>> edits = outside_the_planes();
  for (std::size_t e = 0; e < edits.size(); ++e)
    for (int kind = 0; kind < 2; ++kind) {
      Timeline t = timeline_;
      edits[e](t.messages[3]);
      std::unique_ptr<HandoffSource> source = store_or_cache_source(kind == 0, *cache, t);
      ASSERT_NE(source, nullptr);
      auto [a, b] = local_pair();
      StoreTarget target(*store_, {.expect = config_});
      Result<ReceiveReport> r = io_error("not run");
      std::thread th([&] { r = receive_session(*b, target, {.timeout_s = 2}); });
      auto s = send_session(*a, *source, t, {.timeout_s = 2});
      th.join();
      ASSERT_FALSE(s.ok()) << e << " " << kind;
      EXPECT_EQ(s.error().code, ErrorCode::kInvalidArgument) << s.error().to_string();
      EXPECT_NE(s.error().message.find("message 3"), std::string::npos) << s.error().to_string();
      ASSERT_FALSE(r.ok());
      EXPECT_NE(r.error().message.find("aborted"), std::string::npos) << r.error().to_string();
      EXPECT_EQ(store_->sequence_count(), 1);
      EXPECT_EQ(store_->free_blocks(), free_before_);
    }
}

// The same messages asked of a source directly (an engine driving its own
// send loop): each source refuses them before it sizes a buffer by them,
// and still hands out the timeline's own message after.
TEST_F(Hostile, ASourceAskedDirectlyForRowsOutsideItsPlanesRefuses) {
  const std::vector<std::int32_t> ids(prompt_.begin(), prompt_.end() - 1);
  std::unique_ptr<KvCache> cache = prefilled_cache();
  ASSERT_NE(cache, nullptr);
  const std::vector<std::function<void(PlannedMessage&)>> edits = outside_the_planes();
  const PlannedMessage good = timeline_.messages[3];
  const std::size_t n = static_cast<std::size_t>(good.rows * config_.kv_dim());
  auto header = session_header(cache->store(), cache->seq(), timeline_.payload, ids, "m");
  ASSERT_TRUE(header.ok()) << header.error().to_string();
  for (int kind = 0; kind < 3; ++kind) {
    // The prefill source checks a message against its own timeline first,
    // so its timeline carries the edited message.
    std::vector<Timeline> timelines(edits.size(), timeline_);
    std::vector<std::unique_ptr<HandoffSource>> sources;
    for (std::size_t e = 0; e < edits.size(); ++e) {
      if (kind < 2) {
        sources.push_back(store_or_cache_source(kind == 0, *cache, timeline_));
        ASSERT_NE(sources.back(), nullptr);
      } else {
        edits[e](timelines[e].messages[3]);
        auto p = std::make_unique<PrefillSource>(*cache, timelines[e], *header);
        p->finish(Status::Ok());
        sources.push_back(std::move(p));
      }
    }
    for (std::size_t e = 0; e < edits.size(); ++e) {
      PlannedMessage m = good;
      edits[e](m);
      const std::uint16_t *k = nullptr, *v = nullptr;
      Status s = sources[e]->rows(m, &k, &v);
      ASSERT_FALSE(s.ok()) << kind << " " << e;
      EXPECT_EQ(s.error().code, ErrorCode::kInvalidArgument) << s.error().to_string();
      EXPECT_NE(s.error().message.find("message 3"), std::string::npos) << s.error().to_string();
      SourceRows out;
      s = sources[e]->message_rows(m, false, &out);
      ASSERT_FALSE(s.ok()) << kind << " " << e;
      EXPECT_EQ(s.error().code, ErrorCode::kInvalidArgument) << s.error().to_string();
    }
    // A source of the unedited timeline still hands out message 3's rows.
    if (kind < 2) {
      const std::uint16_t *k = nullptr, *v = nullptr;
      ASSERT_TRUE(sources[0]->rows(good, &k, &v).ok()) << kind;
      std::vector<std::uint16_t> ek(n), ev(n);
      ASSERT_TRUE((kind == 0 ? from_->read_rows(seq_, good.layer, good.first_row, good.rows, ek.data(), ev.data())
                             : cache->read_rows(good.layer, good.first_row, good.rows, ek.data(), ev.data()))
                      .ok());
      EXPECT_EQ(std::vector<std::uint16_t>(k, k + n), ek) << kind;
      EXPECT_EQ(std::vector<std::uint16_t>(v, v + n), ev) << kind;
    }
  }
}

// A header of a big sliding-window geometry and one position: almost no
// payload, but a fresh store of 2 GiB. The target's limit covers the store.
TEST_F(Hostile, FreshStoreAboveTheLimitIsRefused) {
  // 8 sliding layers, kv_dim 8192, window 8192: 256 MiB of ring per layer.
  ModelConfig big = make_hybrid_config("big", 8, 0, 64, 64, 128, 8192, 8192);
  ASSERT_TRUE(big.validate().ok());
  const Snapshot h = make_header(big, 8192, 1);
  DetachedCacheTarget::Options o;
  o.max_row_bytes = 1 << 20;
  DetachedCacheTarget target(o);
  const Status s = target.begin(h);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, ErrorCode::kCapacityExceeded) << s.error().to_string();
  EXPECT_NE(s.error().message.find("limit of 1048576 B"), std::string::npos) << s.error().to_string();
  EXPECT_EQ(target.held_row_bytes(), 0);
  // Under a limit that covers its store the same session begins.
  o.max_row_bytes = std::int64_t{4} << 30;
  big = make_hybrid_config("small-enough", 2, 0, 4, 2, 16, 64, 256);
  DetachedCacheTarget fits(o);
  ASSERT_TRUE(fits.begin(make_header(big, 256, 1)).ok());
  EXPECT_GT(fits.held_row_bytes(), 0);
  fits.abort();
}

// A session whose rows alone pass the limit is refused the same way, into
// a store that exists as into a fresh one.
TEST_F(Hostile, RowsAboveTheLimitAreRefused) {
  const Snapshot h = make_header(store_->config(), store_->context(), 40);
  StoreTarget::Options so;
  so.max_row_bytes = payload_of(h) - 1;
  StoreTarget into(*store_, so);
  const Status s = into.begin(h);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, ErrorCode::kCapacityExceeded) << s.error().to_string();
  EXPECT_NE(s.error().message.find("the session's rows take"), std::string::npos) << s.error().to_string();
  EXPECT_EQ(store_->sequence_count(), 1);
  EXPECT_EQ(store_->free_blocks(), free_before_);
  DetachedCacheTarget::Options o;
  o.max_row_bytes = payload_of(h) - 1;
  DetachedCacheTarget fresh(o);
  const Status f = fresh.begin(h);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.error().code, ErrorCode::kCapacityExceeded) << f.error().to_string();
  EXPECT_EQ(fresh.held_row_bytes(), 0);
}

// The same through the wire: a session of no rows for that geometry.
TEST_F(Hostile, FreshStoreAboveTheLimitThroughTheWire) {
  ModelConfig big = make_hybrid_config("big", 8, 0, 64, 64, 128, 8192, 8192);
  Snapshot h = make_header(big, 8192, 0);
  Msg header = encode_header(h, 0, 0);
  Msg end(49, 0);
  end[0] = 8;
  restamp_end(end, header);
  DetachedCacheTarget::Options o;
  o.max_row_bytes = 1 << 20;
  DetachedCacheTarget target(o);
  auto r = replay({header, end}, target);
  ASSERT_FALSE(r.received.ok());
  EXPECT_EQ(r.received.error().code, ErrorCode::kCapacityExceeded) << r.received.error().to_string();
  EXPECT_EQ(target.held_row_bytes(), 0);
  EXPECT_EQ(target.take(), nullptr);
}

// Positions far past anything a store takes, on an all-sliding geometry.
TEST_F(Hostile, HugePositionsOnSlidingOnlyGeometry) {
  ModelConfig slide = make_hybrid_config("slide", 2, 0, 4, 2, 16, 32, 256);
  for (std::int64_t tokens : {std::int64_t{1} << 40, std::numeric_limits<std::int64_t>::max()}) {
    Snapshot h = make_header(slide, 256, tokens);
    Msg header = encode_header(h, 0, payload_of(h));
    auto st = make_store(BackendKind::kCpu, slide, {.max_sequences = 1});
    ASSERT_TRUE(st.ok());
    const auto free0 = (*st)->free_blocks();
    StoreTarget target(**st);
    auto r = replay({header}, target, {.timeout_s = 0.2});
    EXPECT_REFUSED(r, "");
    EXPECT_EQ((*st)->free_blocks(), free0);
    EXPECT_EQ(target.pending_blocks(), 0);
  }
}

// Random bytes changed in every kind of message, each resealed so the
// structural checks are reached.
TEST_F(Hostile, ResealedRandomMutations) {
  std::mt19937 rng(7);
  int accepted = 0;
  for (int i = 0; i < 400; ++i) {
    auto s = stream_;
    const std::size_t msg = rng() % s.size();
    const int n = 1 + rng() % 4;
    for (int j = 0; j < n; ++j) {
      // Mostly the fixed fields.
      const std::size_t lim = std::min<std::size_t>(s[msg].size(), rng() % 2 ? 64 : s[msg].size());
      s[msg][rng() % lim] = static_cast<std::uint8_t>(rng());
    }
    if (msg == 0) {
      reseal_header(s[0]);
      restamp_end(s.back(), s[0]);
    } else if (msg + 1 < s.size() && s[msg][0] == 4 && s[msg].size() >= kRowsFixed) {
      reseal_rows(s[msg]);
    }
    auto r = into_store(s, {.timeout_s = 0.2});
    if (r.received.ok()) ++accepted;
  }
  // Ids and row bytes are the session's own: a mutation there may commit.
  EXPECT_LT(accepted, 400);
}

// A sender that only keeps the link alive is refused after max_keep_s, and
// the blocks its session held go back to the store.
TEST_F(Hostile, KeepAlivesAloneEndTheSession) {
  auto [a, b] = local_pair();
  StoreTarget target(*store_, {.expect = config_});
  std::atomic<bool> done{false};
  Result<ReceiveReport> got = io_error("not run");
  std::thread t([&, bb = b.get()] {
    got = receive_session(*bb, target, {.timeout_s = 2, .max_keep_s = 0.5});
    done = true;
  });
  ASSERT_TRUE(a->send_message(stream_[0].data(), stream_[0].size(), deadline_in(1)).ok());
  const auto t0 = Clock::now();
  while (!done && Clock::now() - t0 < std::chrono::seconds(10)) {
    const std::uint8_t keep = 6;
    (void)a->send_message(&keep, 1, deadline_in(1));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const bool finished = done;
  a->close();
  t.join();
  EXPECT_TRUE(finished) << "the receiver still waited after 10 s of keep-alives";
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.error().message.find("only keep-alives"), std::string::npos) << got.error().to_string();
  EXPECT_EQ(store_->free_blocks(), free_before_);
  EXPECT_EQ(target.pending_blocks(), 0);
}

// A session's messages into store_, a rows message every 0.25 s with
// keep-alives every 0.05 s between them, until the receiver ends or `for_s`
// passed.
struct Trickle {
  Result<ReceiveReport> got = io_error("not run");
  bool ended = false;
  double seconds = 0;
  std::size_t sent = 0;  // stream messages sent, the header included
};
// A transport that passes everything on to `inner`; a subclass changes
// what it sends.
class PassThrough : public Transport {
 public:
  explicit PassThrough(Transport& inner) : inner_(inner) {}
  Status send_message(const std::vector<Part>& parts, Deadline d) override { return inner_.send_message(parts, d); }
  Status recv_message(std::vector<std::uint8_t>& out, Deadline d, std::size_t max) override {
    return inner_.recv_message(out, d, max);
  }
  std::string describe() const override { return inner_.describe(); }
  void close() override { inner_.close(); }

 protected:
  Transport& inner_;
};

// Passes a receiver's messages on until `after_s` from its making; from
// then on each send waits out its deadline and fails, as on a link to a
// sender that reads nothing more (its socket buffer full).
class StallSendsAfter : public PassThrough {
 public:
  StallSendsAfter(Transport& inner, double after_s) : PassThrough(inner), from_(deadline_in(after_s)) {}
  Status send_message(const std::vector<Part>& parts, Deadline d) override {
    if (Clock::now() < from_) return inner_.send_message(parts, d);
    std::this_thread::sleep_until(d);
    return io_error("timed out waiting to send (the link is full)");
  }

 private:
  Deadline from_;
};

// Sends the header, then a rows message every 250 ms with keep-alives
// between them, for up to for_s; the receiver's sends stall from
// stall_after_s on (negative: never).
Trickle trickle(const std::vector<Msg>& stream, KvStore& store, const ModelConfig& config, const ReceiveOptions& ro,
                double for_s, double stall_after_s = -1) {
  auto [a, b] = local_pair();
  StoreTarget target(store, {.expect = config});
  Trickle r;
  std::atomic<bool> done{false};
  std::thread t([&, bb = b.get()] {
    if (stall_after_s < 0) {
      r.got = receive_session(*bb, target, ro);
    } else {
      StallSendsAfter stalled(*bb, stall_after_s);
      r.got = receive_session(stalled, target, ro);
    }
    done = true;
  });
  const auto t0 = Clock::now();
  (void)a->send_message(stream[0].data(), stream[0].size(), deadline_in(1));
  r.sent = 1;
  auto last = Clock::now();
  while (!done && Clock::now() - t0 < duration_of(for_s)) {
    if (r.sent + 1 < stream.size() && Clock::now() - last >= std::chrono::milliseconds(250)) {
      (void)a->send_message(stream[r.sent].data(), stream[r.sent].size(), deadline_in(1));
      ++r.sent;
      last = Clock::now();
    } else {
      const std::uint8_t keep = 6;
      (void)a->send_message(&keep, 1, deadline_in(1));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  r.ended = done;
  a->close();
  t.join();
  EXPECT_EQ(target.pending_blocks(), 0);
  return r;
}

// A sender that sends each message within the receiver's timeout, with
// keep-alives between them, but too slowly for the session's bound
// (ReceiveOptions::min_bytes_per_s) is refused once the session passes it,
// before its last message; the blocks its session held go back.
TEST_F(Hostile, ATricklingSenderIsRefusedAtTheSessionsBound) {
  ASSERT_GE(n_rows_msgs(), 16u);
  // The bound: 0.6 + 1 + 0.4 = 2 s; the whole stream would take 4 s and more.
  const double payload = static_cast<double>(timeline_.payload.payload_bytes);
  const Trickle r =
      trickle(stream_, *store_, config_, {.timeout_s = 1, .max_keep_s = 0.6, .min_bytes_per_s = payload / 0.4}, 10);
  EXPECT_TRUE(r.ended) << "the receiver still waited after 10 s";
  ASSERT_FALSE(r.got.ok());
  EXPECT_NE(r.got.error().message.find("did not end the session within"), std::string::npos) << r.got.error().to_string();
  EXPECT_GE(r.seconds, 1.9);
  EXPECT_LT(r.seconds, 5.0);
  EXPECT_LT(r.sent + 1, stream_.size()) << "every rows message was sent before the refusal";
  EXPECT_EQ(store_->free_blocks(), free_before_);
}

// A sender that stops reading the receiver's ACKs late in the session
// cannot hold it past its bound: an ACK waits for the link only until the
// bound, not for a whole timeout_s after it.
TEST_F(Hostile, AnAckThatCannotBeSentEndsAtTheSessionsBound) {
  ASSERT_GE(n_rows_msgs(), 16u);
  // The bound: 0.6 + 2 + 0.3 = 2.9 s (max_keep_s well past the 250 ms
  // between rows, for a loaded machine). The ACKs stall from 2.6 s on, so
  // the next rows' ACK (at about 2.75 s) meets the bound first: the
  // receiver ends near 3.9 s, after its ERROR's send waits 1 s. Without
  // the bound the ACK would wait until 4.75 s, and the receiver end near
  // 5.75 s.
  const double payload = static_cast<double>(timeline_.payload.payload_bytes);
  const Trickle r =
      trickle(stream_, *store_, config_, {.timeout_s = 2, .max_keep_s = 0.6, .min_bytes_per_s = payload / 0.3}, 10, 2.6);
  EXPECT_TRUE(r.ended) << "the receiver still waited after 10 s";
  ASSERT_FALSE(r.got.ok());
  EXPECT_NE(r.got.error().message.find("did not end the session within"), std::string::npos) << r.got.error().to_string();
  EXPECT_LT(r.seconds, 4.8);
  EXPECT_EQ(store_->free_blocks(), free_before_);
}

// The same trickle with no bound runs past it: each message and each run
// of keep-alives within its own limit, as the bound's test needs.
TEST_F(Hostile, ATrickleWithinEachWaitRunsPastTheBoundWithoutIt) {
  const Trickle r = trickle(stream_, *store_, config_, {.timeout_s = 1, .max_keep_s = 0.6, .min_bytes_per_s = 0}, 2.5);
  EXPECT_FALSE(r.ended) << (r.got.ok() ? std::string("ended") : r.got.error().to_string());
  EXPECT_EQ(store_->free_blocks(), free_before_);
}

// Flips a byte in the middle of the n-th message it sends.
class FlipOneSend : public PassThrough {
 public:
  FlipOneSend(Transport& inner, int n) : PassThrough(inner), n_(n) {}
  Status send_message(const std::vector<Part>& parts, Deadline d) override {
    if (++sends_ != n_) return inner_.send_message(parts, d);
    Msg m;
    for (const Part& p : parts)
      m.insert(m.end(), static_cast<const std::uint8_t*>(p.data), static_cast<const std::uint8_t*>(p.data) + p.size);
    m[m.size() / 2] ^= 0x10;
    return inner_.send_message(m.data(), m.size(), d);
  }

 private:
  int n_, sends_ = 0;
};

// A paced sender still has rows on their way when the receiver refuses a
// corrupted message: the receiver's linger takes them, so the sender hears
// the reason, not a closed link.
TEST_F(Hostile, APacedSenderHearsTheRefusalWithRowsInFlight) {
  auto t = plan_handoff(config_, kPrompt, few_messages());
  ASSERT_TRUE(t.ok());
  auto src = StoreSource::create(*from_, seq_, *t, std::vector<std::int32_t>(prompt_.begin(), prompt_.end() - 1), "m");
  ASSERT_TRUE(src.ok());
  auto [a, b] = local_pair();
  FlipOneSend flip(*a, 3);
  DetachedCacheTarget target({});
  Result<ReceiveReport> got = io_error("not run");
  std::thread rx([&, bb = b.get()] {
    got = receive_session(*bb, target, {.timeout_s = 5});
    bb->close();
  });
  const auto sent = send_session(flip, **src, *t, {.timeout_s = 5, .rate_bytes_per_s = payload_of(src->get()->header()) / 1.0});
  flip.close();
  rx.join();
  ASSERT_FALSE(got.ok());
  ASSERT_FALSE(sent.ok());
  EXPECT_NE(sent.error().message.find("does not match"), std::string::npos) << sent.error().to_string();
}

// A paced sender whose gaps between messages outlast the receiver's
// timeout keeps the link alive through them, as through a prefill wait,
// and the session completes.
TEST_F(Hostile, APacedSendersGapsOutlastTheReceiversTimeout) {
  auto t = plan_handoff(config_, kPrompt, few_messages());
  ASSERT_TRUE(t.ok());
  // The wait before message i + 1 is message i's bytes at the rate.
  std::int64_t largest = 0;
  for (std::size_t i = 0; i + 1 < t->messages.size(); ++i) largest = std::max(largest, t->messages[i].bytes);
  const double rate = static_cast<double>(t->payload.payload_bytes) / 1.5;  // the whole send about 1.5 s
  const double gap = static_cast<double>(largest) / rate;
  ASSERT_GE(gap, 0.2) << t->messages.size() << " messages: too many for a gap to show";
  auto src = StoreSource::create(*from_, seq_, *t, std::vector<std::int32_t>(prompt_.begin(), prompt_.end() - 1), "m");
  ASSERT_TRUE(src.ok());
  auto [a, b] = local_pair();
  DetachedCacheTarget target({});
  Result<ReceiveReport> got = io_error("not run");
  std::thread rx([&, bb = b.get()] {
    got = receive_session(*bb, target, {.timeout_s = gap / 2});
    bb->close();
  });
  const auto sent = send_session(*a, **src, *t, {.timeout_s = gap / 2, .rate_bytes_per_s = rate});
  a->close();
  rx.join();
  ASSERT_TRUE(sent.ok()) << sent.error().to_string();
  ASSERT_TRUE(got.ok()) << got.error().to_string();
  EXPECT_GE(sent->seconds, 0.9 * (static_cast<double>(t->payload.payload_bytes - t->messages.back().bytes) / rate));
}

// Send options outside their ranges are refused before anything is sent.
TEST_F(Hostile, SendOptionsOutOfRangeAreRefused) {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  for (const SendOptions& bad : {SendOptions{.timeout_s = 0}, SendOptions{.timeout_s = nan},
                                 SendOptions{.rate_bytes_per_s = -1}, SendOptions{.rate_bytes_per_s = nan},
                                 SendOptions{.rate_bytes_per_s = inf}}) {
    auto src = StoreSource::create(*from_, seq_, timeline_, std::vector<std::int32_t>(prompt_.begin(), prompt_.end() - 1), "m");
    ASSERT_TRUE(src.ok());
    auto [a, b] = local_pair();
    const auto sent = send_session(*a, **src, timeline_, bad);
    ASSERT_FALSE(sent.ok());
    EXPECT_EQ(sent.error().code, ErrorCode::kInvalidArgument);
    EXPECT_NE(sent.error().message.find("send options"), std::string::npos) << sent.error().message;
    std::vector<std::uint8_t> in;
    EXPECT_FALSE(b->recv_message(in, deadline_in(0.05), 1 << 20).ok());  // nothing was sent
  }
}

// ---------------------------------------------------------------- hostile receivers

struct SendRun {
  Result<SendReport> sent = io_error("not run");
  double seconds = 0;
};

class HostileReceiver : public Hostile {
 protected:
  // Runs the sender against a scripted receiver: `script` gets the link's receiver end.
  template <class F>
  SendRun send_against(F&& script, double timeout_s = 0.5) {
    auto [a, b] = local_pair();
    std::thread t([&, bb = b.get()] { script(*bb); });
    auto src = StoreSource::create(*from_, seq_, timeline_, std::vector<std::int32_t>(prompt_.begin(), prompt_.end() - 1), "m");
    EXPECT_TRUE(src.ok());
    SendRun r;
    const auto t0 = Clock::now();
    r.sent = send_session(*a, **src, timeline_, {.timeout_s = timeout_s});
    r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    a->close();
    t.join();
    return r;
  }
  static void send(Transport& t, const Msg& m) { (void)t.send_message(m.data(), m.size(), deadline_in(1)); }
  static Msg accept(std::int64_t credits) {
    Msg m(9);
    m[0] = 2;
    put64(m, 1, static_cast<std::uint64_t>(credits));
    return m;
  }
  static Msg ack(std::int64_t seq, std::int64_t bytes) {
    Msg m(17);
    m[0] = 5;
    put64(m, 1, static_cast<std::uint64_t>(seq));
    put64(m, 9, static_cast<std::uint64_t>(bytes));
    return m;
  }
};

TEST_F(HostileReceiver, BadAcceptsAndErrors) {
  EXPECT_FALSE(send_against([](Transport& t) { Msg in; (void)t.recv_message(in, deadline_in(1), 1 << 30); send(t, Msg{}); }).sent.ok());
  EXPECT_FALSE(send_against([](Transport& t) { Msg in; (void)t.recv_message(in, deadline_in(1), 1 << 30); send(t, Msg{2, 1}); }).sent.ok());
  EXPECT_FALSE(send_against([](Transport& t) { Msg in; (void)t.recv_message(in, deadline_in(1), 1 << 30); send(t, accept(0)); }).sent.ok());
  EXPECT_FALSE(send_against([](Transport& t) { Msg in; (void)t.recv_message(in, deadline_in(1), 1 << 30); send(t, accept(-1)); }).sent.ok());
  EXPECT_FALSE(send_against([](Transport& t) { Msg in; (void)t.recv_message(in, deadline_in(1), 1 << 30); send(t, Msg{3}); }).sent.ok());
  EXPECT_FALSE(send_against([](Transport& t) {
    Msg in;
    (void)t.recv_message(in, deadline_in(1), 1 << 30);
    Msg e(5 + (2 << 20), 'x');
    e[0] = 3;
    put32(e, 1, 2);
    send(t, e);  // an ERROR over the sender's 1 MiB
  }).sent.ok());
  // ACK beyond what was sent.
  EXPECT_FALSE(send_against([](Transport& t) {
    Msg in;
    (void)t.recv_message(in, deadline_in(1), 1 << 30);
    send(t, accept(1 << 20));
    (void)t.recv_message(in, deadline_in(1), 1 << 30);
    send(t, ack(0, 1 << 30));
    (void)t.recv_message(in, deadline_in(1), 1 << 30);
  }).sent.ok());
}

// Credits of no bytes, or past 2^63, are no receiver's: refused at the
// ACCEPT as the peer's fault. Credits a later message exceeds are refused
// there too, before any rows go out, not once the sender reaches it.
TEST_F(HostileReceiver, CreditsAreCheckedAtTheAccept) {
  for (const std::int64_t credits : {std::int64_t{0}, std::int64_t{-1}}) {
    const SendRun r = send_against([credits](Transport& t) {
      Msg in;
      (void)t.recv_message(in, deadline_in(1), 1 << 30);
      send(t, accept(credits));
      (void)t.recv_message(in, deadline_in(1), 1 << 30);
    });
    ASSERT_FALSE(r.sent.ok());
    EXPECT_EQ(r.sent.error().code, ErrorCode::kCorruption) << r.sent.error().to_string();
    EXPECT_NE(r.sent.error().message.find("accepted with " + std::to_string(static_cast<std::uint64_t>(credits)) +
                                          " B of credits"),
              std::string::npos)
        << r.sent.error().to_string();
  }
  // Swa-first, one message a layer: the sliding rings (32 rows) go before
  // the full plane's 100.
  PlanOptions o;
  o.schedule = Schedule::kSwaFirst;
  o.chunk_tokens = kChunk;
  o.message_bytes = 1 << 20;
  timeline_ = *plan_handoff(config_, kPrompt, o);
  std::int64_t largest = 0;
  for (const PlannedMessage& m : timeline_.messages) largest = std::max(largest, m.bytes);
  const std::int64_t first = timeline_.messages.front().bytes;
  ASSERT_LT(first, largest);  // so rows could go out before the message that does not fit
  Msg after_accept;
  const SendRun r = send_against([&](Transport& t) {
    Msg in;
    (void)t.recv_message(in, deadline_in(1), 1 << 30);
    send(t, accept(first));
    (void)t.recv_message(after_accept, deadline_in(1), 1 << 30);
    while (t.recv_message(in, deadline_in(0.2), 1 << 30).ok()) {
    }
  });
  ASSERT_FALSE(r.sent.ok());
  EXPECT_NE(r.sent.error().message.find("a message of " + std::to_string(largest) +
                                        " B exceeds the receiver's credits of " + std::to_string(first) + " B"),
            std::string::npos)
      << r.sent.error().to_string();
  ASSERT_FALSE(after_accept.empty());
  EXPECT_EQ(after_accept[0], 7) << "the first message after the ACCEPT is the ABORT (7), not rows (4)";
}

// A sender that aborts (here: its first message exceeds the receiver's
// credits) waits for the receiver's ERROR past only the ACKs it is owed:
// a receiver that answers with ACKs, each just within the timeout, holds
// it no longer than one of them.
TEST_F(HostileReceiver, AnAbortWaitsOnlyForTheAcksItIsOwed) {
  const SendRun r = send_against([](Transport& t) {
    Msg in;
    (void)t.recv_message(in, deadline_in(1), 1 << 30);
    send(t, accept(1));
    (void)t.recv_message(in, deadline_in(1), 1 << 30);  // the ABORT
    for (int i = 0; i < 6; ++i) {
      send(t, ack(i, 0));
      std::this_thread::sleep_for(std::chrono::milliseconds(400));
    }
  });
  ASSERT_FALSE(r.sent.ok());
  EXPECT_NE(r.sent.error().message.find("exceeds the receiver's credits"), std::string::npos) << r.sent.error().to_string();
  EXPECT_LT(r.seconds, 1.5);
}

// A receiver waiting for a header skips a stale BYE or KEEP, but only
// until its timeout: a flood of keep-alives ends there.
TEST_F(Hostile, KeepAlivesInsteadOfAHeaderEndAtTheTimeout) {
  auto [a, b] = local_pair();
  std::atomic<bool> stop{false};
  std::thread flood([&, &a = a] {
    const std::uint8_t keep = 6;
    for (int i = 0; i < 3'000'000 && !stop; ++i) (void)a->send_message(&keep, 1, deadline_in(1));
  });
  auto sink = make_store(BackendKind::kCpu, config_, {.max_sequences = 1});
  ASSERT_TRUE(sink.ok());
  StoreTarget target(**sink);
  const auto t0 = Clock::now();
  const auto got = receive_session(*b, target, {.timeout_s = 0.3});
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  stop = true;
  flood.join();
  ASSERT_FALSE(got.ok());
  EXPECT_LT(seconds, 2.0);
  EXPECT_FALSE(target.sequence().has_value());
}

// A receiver that says DONE before the end, or after it with messages
// unacknowledged, or acknowledges a message with bytes past its end, has
// not taken the session: the sender fails.
TEST_F(HostileReceiver, DoneBeforeEveryAcknowledgementFails) {
  auto early = send_against([](Transport& t) {
    Msg in;
    (void)t.recv_message(in, deadline_in(1), 1 << 30);
    send(t, accept(1 << 20));
    send(t, Msg{9});  // DONE at once, before any row or END
    while (t.recv_message(in, deadline_in(1), 1 << 30).ok()) {
    }
  });
  // The sender reads replies when it needs credits and after its end.
  ASSERT_FALSE(early.sent.ok());
  EXPECT_NE(early.sent.error().message.find("said done with 0 of"), std::string::npos)
      << early.sent.error().to_string();
  auto waiting = send_against([](Transport& t) {
    Msg in;
    (void)t.recv_message(in, deadline_in(1), 1 << 30);
    send(t, accept(3 * 256));  // one message of credit: the sender reads replies before the end
    send(t, Msg{9});
    while (t.recv_message(in, deadline_in(1), 1 << 30).ok()) {
    }
  });
  ASSERT_FALSE(waiting.sent.ok());
  EXPECT_NE(waiting.sent.error().message.find("said done before the end"), std::string::npos)
      << waiting.sent.error().to_string();
  auto unacked = send_against([](Transport& t) {
    Msg in;
    (void)t.recv_message(in, deadline_in(1), 1 << 30);
    send(t, accept(1 << 20));
    while (t.recv_message(in, deadline_in(1), 1 << 30).ok())
      if (!in.empty() && in[0] == 8) send(t, Msg{9});  // DONE after END, no ACK ever
  });
  ASSERT_FALSE(unacked.sent.ok());
  EXPECT_NE(unacked.sent.error().message.find("said done with 0 of"), std::string::npos)
      << unacked.sent.error().to_string();
  // One ACK for the whole session after END (message 0 with every byte),
  // then DONE: an ACK carries the bytes up to its own message's end.
  auto lump = send_against([](Transport& t) {
    Msg in;
    (void)t.recv_message(in, deadline_in(1), 1 << 30);
    send(t, accept(1 << 20));
    while (t.recv_message(in, deadline_in(1), 1 << 30).ok())
      if (in.size() >= 17 && in[0] == 8) {  // END: messages, then bytes
        send(t, ack(0, static_cast<std::int64_t>(get64(in, 9))));
        send(t, Msg{9});
      }
  });
  ASSERT_FALSE(lump.sent.ok());
  EXPECT_NE(lump.sent.error().message.find("acknowledged message 0 with"), std::string::npos)
      << lump.sent.error().to_string();
}

// Acknowledgements must advance in order: a repeated one ends the session
// at once instead of holding the sender in its wait for credits.
TEST_F(HostileReceiver, RepeatedAcknowledgementsFail) {
  auto r = send_against(
      [&](Transport& t) {
        Msg in;
        (void)t.recv_message(in, deadline_in(1), 1 << 30);
        send(t, accept(3 * 256));  // one message of credit
        const Msg again = ack(0, 0);
        const auto t0 = Clock::now();
        while (Clock::now() - t0 < std::chrono::seconds(3) &&
               t.send_message(again.data(), again.size(), deadline_in(1)).ok())
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
      },
      0.3);
  ASSERT_FALSE(r.sent.ok());
  EXPECT_NE(r.sent.error().message.find("acknowledged"), std::string::npos) << r.sent.error().to_string();
  EXPECT_LT(r.seconds, 2.5);
  // A real acknowledgement, repeated; a skipped one.
  for (const std::int64_t second : {0, 2}) {
    auto again = send_against([&](Transport& t) {
      Msg in;
      (void)t.recv_message(in, deadline_in(1), 1 << 30);
      send(t, accept(3 * 256));
      (void)t.recv_message(in, deadline_in(1), 1 << 30);  // message 0
      const auto bytes = static_cast<std::int64_t>(get64(in, 21)) * config_.kv_dim() * 4;
      send(t, ack(0, bytes));
      (void)t.recv_message(in, deadline_in(1), 1 << 30);  // message 1
      send(t, ack(second, 2 * bytes));
      while (t.recv_message(in, deadline_in(1), 1 << 30).ok()) {
      }
    });
    ASSERT_FALSE(again.sent.ok()) << second;
    EXPECT_NE(again.sent.error().message.find("acknowledged message " + std::to_string(second) + " where 1"),
              std::string::npos)
        << again.sent.error().to_string();
  }
}

}  // namespace
}  // namespace kvring::handoff

namespace kvring::handoff {
namespace {
// The pool holds the first full layer's blocks but not the second's: begin()
// fails part way through its planes and must leave the store as it was.
TEST(HostileBegin, PoolRunsOutOnALaterPlane) {
  const ModelConfig c = make_hybrid_config("two-full", 4, 2, 4, 2, 16, 32, 256);  // layers 1 and 3 full
  Snapshot h = make_header(c, 256, 99);  // 99 rows: 7 blocks of 16 per full layer
  auto st = make_store(BackendKind::kCpu, c, {.max_sequences = 2, .block_rows = 16, .pool_blocks = 10});
  ASSERT_TRUE(st.ok());
  KvStore& store = **st;
  const SeqId keep = *store.add_sequence();
  (void)keep;
  const auto free0 = store.free_blocks();
  StoreTarget target(store);
  Status s = target.begin(h);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(store.free_blocks(), free0);
  EXPECT_EQ(store.sequence_count(), 1);
  EXPECT_EQ(target.pending_blocks(), 0);
  EXPECT_TRUE(store.add_sequence().ok());  // the slot was given back
}
}  // namespace
}  // namespace kvring::handoff
