// libFuzzer target for the handoff receiver (receive_session into a
// StoreTarget). Built by scripts/fuzz.sh with clang
// -fsanitize=fuzzer,address,undefined; not part of the normal build.
//
// A legitimate session's messages are recorded once. Each input is a list
// of edits to that stream (5 bytes each: operation, message, 16-bit offset,
// value), applied in order; the header's and the SHA-256 rows messages'
// digests are then computed again and END is pointed at the header (unless
// the input's first byte is odd), so that edits reach the field checks
// behind the digests. The stream, then BYE, is replayed into a receiver over
// an in-process link. Whatever the receiver answers, the store must be as
// it was when it refuses, and hold the one new sequence when it commits; the
// sequence it held before never changes.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "handoff_wire.h"
#include "kvring/config.h"
#include "kvring/handoff.h"
#include "kvring/model.h"
#include "kvring/sha256.h"
#include "kvring/store.h"

namespace {

using namespace kvring;
using namespace kvring::handoff;
using Msg = std::vector<std::uint8_t>;

// Message types (docs/DESIGN.md, "Handoff"); the digests' offsets are in
// handoff_wire.h.
constexpr std::uint8_t kRows = 4, kEnd = 8, kBye = 10;

[[noreturn]] void broken(const char* what) {
  std::fprintf(stderr, "handoff receiver invariant broke: %s\n", what);
  std::abort();
}

struct World {
  ModelConfig config;
  std::vector<Msg> stream;  // header .. END, without BYE
  std::unique_ptr<KvStore> store;
  SeqId resident{};  // the sequence the store held before any input
  std::int64_t free_before = 0;
  Digest resident_rows{};
};

// SHA-256 of every live row of `seq`, layer by layer, with each ring.
Digest live_rows(const KvStore& store, SeqId seq) {
  Sha256 d;
  for (std::int64_t l = 0; l < store.n_layers(); ++l) {
    const auto ring = store.ring(seq, l);
    if (!ring.ok()) broken("the resident sequence has no ring");
    const std::int64_t at[2] = {ring->origin_logical(), ring->len()};
    d.update(at, sizeof at);
    const auto n = static_cast<std::size_t>(ring->len() * store.config().kv_dim());
    std::vector<std::uint16_t> k(n), v(n);
    if (!store.read_rows(seq, l, ring->origin_logical(), ring->len(), k.data(), v.data()).ok())
      broken("the resident sequence's rows cannot be read");
    d.update(k.data(), n * 2);
    d.update(v.data(), n * 2);
  }
  return d.finish();
}

// A 40-token session of a small hybrid (window 8, two of four layers
// sliding) in messages of 3 rows, and a store that already holds one
// sequence, into which every input is received.
World make_world() {
  World w;
  w.config = make_hybrid_config("fuzz-hybrid", 4, 2, 4, 2, 8, 8, 64);
  auto model = ReferenceModel::create(w.config, {.hidden = 16, .vocab = 32});
  if (!model.ok()) broken("no model");
  std::mt19937 rng(5);
  std::vector<std::int32_t> prompt(40);
  for (auto& t : prompt) t = static_cast<std::int32_t>(rng() % 32);
  auto fill = [&](KvStore& s) {
    const SeqId seq = *s.add_sequence();
    std::vector<float> logits(static_cast<std::size_t>(39 * 32));
    const SeqSpan span{seq, 0, 39};
    if (!(*model)->forward(s, {&span, 1}, prompt.data(), logits.data()).ok()) broken("no prefill");
    return seq;
  };
  auto from = make_store(BackendKind::kCpu, w.config, {.max_sequences = 1});
  if (!from.ok()) broken("no source store");
  const SeqId seq = fill(**from);
  PlanOptions o;
  o.chunk_tokens = 5;
  o.message_bytes = 3 * w.config.kv_dim() * 4;
  o.credit_bytes = 1 << 20;
  auto timeline = plan_handoff(w.config, 40, o);
  if (!timeline.ok()) broken("no plan");
  auto link = local_pair();
  Transport& b = *link.second;
  testing::Recorder rec(link.first.get());
  auto sink = make_store(BackendKind::kCpu, w.config, {.max_sequences = 1});
  StoreTarget sink_target(**sink);
  Result<ReceiveReport> received = io_error("not run");
  std::thread t([&] { received = receive_session(b, sink_target); });
  auto src =
      StoreSource::create(**from, seq, *timeline, std::vector<std::int32_t>(prompt.begin(), prompt.end() - 1), "fuzz");
  if (!src.ok()) broken("no source");
  const auto sent = send_session(rec, **src, *timeline);
  t.join();
  if (!sent.ok() || !received.ok()) broken("the recorded session failed");
  w.stream = rec.sent;
  if (w.stream.empty() || w.stream.back() != Msg{kBye}) broken("the stream does not end in BYE");
  w.stream.pop_back();
  auto to = make_store(BackendKind::kCpu, w.config, {.max_sequences = 2, .block_rows = 16});
  if (!to.ok()) broken("no target store");
  w.store = std::move(*to);
  w.resident = fill(*w.store);
  w.free_before = w.store->free_blocks();
  w.resident_rows = live_rows(*w.store, w.resident);
  return w;
}

// The header's digest, then every SHA-256 ROWS message's, computed again,
// and END pointed at the header.
void reseal(std::vector<Msg>& s) {
  if (s.empty() || s[0].size() < 32) return;
  testing::reseal_header(s[0]);
  for (std::size_t i = 1; i < s.size(); ++i) {
    Msg& m = s[i];
    if (m.size() >= testing::kRowsFixed && m[0] == kRows)
      testing::reseal_rows(m);
    else if (m.size() >= testing::kEndDigest + 32 && m[0] == kEnd)
      testing::restamp_end(m, s[0]);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static World w = make_world();
  std::vector<Msg> s = w.stream;
  const bool keep_digests = size > 0 && (data[0] & 1) != 0;
  for (std::size_t at = size > 0 ? 1 : 0; at + 5 <= size && !s.empty(); at += 5) {
    const std::size_t i = data[at + 1] % s.size();
    Msg& m = s[i];
    const std::size_t pos = static_cast<std::size_t>(data[at + 2] | (data[at + 3] << 8));
    const std::uint8_t v = data[at + 4];
    switch (data[at] % 7) {
      case 0:  // set a byte
        if (!m.empty()) m[pos % m.size()] = v;
        break;
      case 1:  // flip bits of a byte in the first 64, where the fields are
        if (!m.empty()) m[pos % std::min<std::size_t>(m.size(), 64)] ^= v;
        break;
      case 2:  // drop the message
        s.erase(s.begin() + static_cast<std::ptrdiff_t>(i));
        break;
      case 3:  // send it twice
        if (s.size() < 4096) s.insert(s.begin() + static_cast<std::ptrdiff_t>(i), Msg(m));
        break;
      case 4:  // cut it
        m.resize(pos % (m.size() + 1));
        break;
      case 5:  // swap it with the next
        if (i + 1 < s.size()) std::swap(s[i], s[i + 1]);
        break;
      case 6:  // grow it by v bytes of v
        m.insert(m.end(), v, v);
        break;
    }
  }
  if (!keep_digests) reseal(s);

  auto [a, b] = local_pair();
  for (const Msg& m : s)
    if (!a->send_message(m.data(), m.size(), deadline_in(1)).ok()) broken("the link refused a message");
  const std::uint8_t bye = kBye;
  if (!a->send_message(&bye, 1, deadline_in(1)).ok()) broken("the link refused BYE");
  StoreTarget target(*w.store, {.expect = w.config});
  const auto received = receive_session(*b, target, {.timeout_s = 0.05});
  if (received.ok()) {
    if (!target.sequence().has_value()) broken("a commit without a sequence");
    if (w.store->sequence_count() != 2) broken("a commit that did not add one sequence");
    if (!w.store->remove_sequence(*target.sequence()).ok()) broken("the committed sequence cannot be removed");
  } else if (received.error().message.empty()) {
    broken("a refusal without a message");
  } else if (size < 6) {
    // No edit: the recorded session itself.
    broken("the unedited session was refused");
  }
  if (w.store->sequence_count() != 1) broken("the store's sequences changed");
  if (w.store->free_blocks() != w.free_before) broken("the store's free blocks changed");
  if (target.pending_blocks() != 0) broken("the target still holds blocks");
  if (live_rows(*w.store, w.resident) != w.resident_rows) broken("the resident sequence's rows changed");
  return 0;
}
