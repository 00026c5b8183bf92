// The many-sequence store on the CPU backend: sequences, the block pool,
// forks, rollbacks, refusals, views, and bits that never depend on the batch.
#include "kvring/store.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kvring/backend.h"
#include "kvring/f16.h"
#include "cpu/attention_cpu.h"
#include "cpu/cpu_store.h"
#include "kvring/snapshot.h"
#include "test_util.h"

namespace kvring {

// Moves a free slot's generation, as 2^32 sequences through it would.
struct KvStoreTestAccess {
  static void set_generation(KvStore& s, std::size_t slot, std::uint32_t generation) {
    s.slots_[slot].generation = generation;
  }
  // The pool's free list in order and its first never-taken block.
  static std::pair<std::vector<std::int32_t>, std::int64_t> pool(const KvStore& s) {
    return {s.free_, s.fresh_};
  }
};

namespace {

using testing::small_config;

// Deterministic per-(sequence, layer, position) data, so a sequence's
// inputs are the same whichever batch it runs in. Never all zeros.
float value(std::uint64_t seq, std::int64_t layer, std::int64_t pos, std::int64_t e, int what) {
  std::uint64_t x = seq * 0x9e3779b97f4a7c15ULL ^ static_cast<std::uint64_t>(layer) * 0xbf58476d1ce4e5b9ULL ^
                    static_cast<std::uint64_t>(pos) * 0x94d049bb133111ebULL ^
                    static_cast<std::uint64_t>(e) * 0x2545f4914f6cdd1dULL ^
                    static_cast<std::uint64_t>(what) * 0x632be59bd9b4e019ULL;
  x ^= x >> 31;
  x *= 0xd6e8feb86659fd93ULL;
  x ^= x >> 29;
  return static_cast<float>(static_cast<double>(x >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

struct Rows {
  std::vector<float> k, v, q;
};
// Rows of `count` tokens of sequence `id` from `start`, for one layer.
Rows rows_for(const ModelConfig& c, std::uint64_t id, std::int64_t layer, std::int64_t start,
              std::int64_t count) {
  const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim;
  Rows r;
  for (std::int64_t i = 0; i < count; ++i) {
    for (std::int64_t e = 0; e < kv; ++e) {
      r.k.push_back(value(id, layer, start + i, e, 0));
      r.v.push_back(value(id, layer, start + i, e, 1));
    }
    for (std::int64_t e = 0; e < width; ++e) r.q.push_back(value(id, layer, start + i, e, 2));
  }
  return r;
}

std::unique_ptr<KvStore> cpu_store(const ModelConfig& c, StoreOptions o) {
  auto s = make_store(BackendKind::kCpu, c, o);
  EXPECT_TRUE(s.ok()) << s.error().to_string();
  return std::move(*s);
}

// Attention outputs by (sequence id, layer, position).
using Outputs = std::map<std::tuple<std::uint64_t, std::int64_t, std::int64_t>, std::vector<float>>;

// Every live row of every layer of a sequence, in logical order.
std::vector<std::uint16_t> live_bytes(const KvStore& s, SeqId seq) {
  std::vector<std::uint16_t> out;
  for (std::int64_t l = 0; l < s.n_layers(); ++l) {
    auto r = s.ring(seq, l);
    EXPECT_TRUE(r.ok());
    const auto n = static_cast<std::size_t>(r->len() * s.config().kv_dim());
    std::vector<std::uint16_t> k(n), v(n);
    EXPECT_TRUE(s.read_rows(seq, l, r->origin_logical(), r->len(), k.data(), v.data()).ok());
    out.insert(out.end(), k.begin(), k.end());
    out.insert(out.end(), v.begin(), v.end());
    out.push_back(static_cast<std::uint16_t>(r->origin_logical()));
  }
  return out;
}

// Runs one chunk of each (id, seq, start, count) through every layer as one
// batch: store + decode when every count is 1, else a ragged prefill.
void run_batch(KvStore& s, const std::vector<std::pair<std::uint64_t, SeqSpan>>& batch,
               Outputs& outputs) {
  const ModelConfig& c = s.config();
  const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim;
  bool decode = true;
  std::int64_t rows = 0;
  std::vector<SeqSpan> spans;
  for (const auto& [id, sp] : batch) {
    decode = decode && sp.count == 1;
    rows += sp.count;
    spans.push_back(sp);
  }
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    Rows all;
    std::vector<SeqQuery> queries;
    for (const auto& [id, sp] : batch) {
      Rows r = rows_for(c, id, l, sp.start, sp.count);
      all.k.insert(all.k.end(), r.k.begin(), r.k.end());
      all.v.insert(all.v.end(), r.v.begin(), r.v.end());
      all.q.insert(all.q.end(), r.q.begin(), r.q.end());
      for (std::int64_t i = 0; i < sp.count; ++i) queries.push_back({sp.seq, sp.start + i});
    }
    std::vector<float> out(static_cast<std::size_t>(rows * width));
    if (decode) {
      ASSERT_TRUE(s.store(l, spans, host_view(all.k.data(), rows, kv), host_view(all.v.data(), rows, kv)).ok());
      ASSERT_TRUE(s.attend_decode(l, queries, host_view(all.q.data(), rows, width),
                                  host_view(out.data(), rows, width)).ok());
    } else {
      const Status st = s.prefill(l, spans, host_view(all.k.data(), rows, kv),
                                  host_view(all.v.data(), rows, kv),
                                  host_view(all.q.data(), rows, width),
                                  host_view(out.data(), rows, width));
      ASSERT_TRUE(st.ok()) << st.to_string();
    }
    std::int64_t row = 0;
    for (const auto& [id, sp] : batch)
      for (std::int64_t i = 0; i < sp.count; ++i, ++row)
        outputs[{id, l, sp.start + i}] = std::vector<float>(
            out.begin() + row * width, out.begin() + (row + 1) * width);
  }
}

// A sequence run alone, one token at a time.
void run_solo(const ModelConfig& c, StoreOptions o, std::uint64_t id, std::int64_t length,
              Outputs& outputs, std::vector<std::uint16_t>& bytes) {
  o.max_sequences = 1;
  auto s = cpu_store(c, o);
  auto seq = s->add_sequence();
  ASSERT_TRUE(seq.ok());
  for (std::int64_t p = 0; p < length; ++p) run_batch(*s, {{id, SeqSpan{*seq, p, 1}}}, outputs);
  bytes = live_bytes(*s, *seq);
}

TEST(Store, SequencesComeAndGoAndStaleHandlesAreRefused) {
  auto s = cpu_store(small_config(), {.max_sequences = 2});
  auto a = s->add_sequence();
  auto b = s->add_sequence();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(s->sequence_count(), 2);
  auto c = s->add_sequence();
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.error().code, ErrorCode::kResourceExhausted);
  ASSERT_TRUE(s->remove_sequence(*a).ok());
  auto again = s->remove_sequence(*a);
  EXPECT_EQ(again.error().code, ErrorCode::kNotFound);
  auto reused = s->add_sequence();  // takes a's slot
  ASSERT_TRUE(reused.ok());
  EXPECT_NE(*reused, *a);
  EXPECT_TRUE(s->contains(*reused));
  EXPECT_FALSE(s->contains(*a));
  // Every call refuses the stale handle.
  const std::int64_t kv = s->config().kv_dim(), width = s->config().n_heads * s->config().head_dim;
  std::vector<float> row(static_cast<std::size_t>(width), 0.5f), out(row.size());
  const SeqSpan span{*a, 0, 1};
  const SeqQuery query{*a, 0};
  EXPECT_EQ(s->store(0, {&span, 1}, host_view(row.data(), 1, kv), host_view(row.data(), 1, kv)).error().code,
            ErrorCode::kNotFound);
  EXPECT_EQ(s->attend_decode(0, {&query, 1}, host_view(row.data(), 1, width),
                             host_view(out.data(), 1, width)).error().code,
            ErrorCode::kNotFound);
  EXPECT_EQ(s->prefill(0, {&span, 1}, host_view(row.data(), 1, kv), host_view(row.data(), 1, kv),
                       host_view(row.data(), 1, width), host_view(out.data(), 1, width)).error().code,
            ErrorCode::kNotFound);
  EXPECT_FALSE(s->fork_sequence(*a).ok());
  EXPECT_FALSE(s->truncate_sequence(*a, 0).ok());
  EXPECT_FALSE(s->reset_sequence(*a).ok());
  EXPECT_FALSE(s->next_position(*a).ok());
  EXPECT_FALSE(s->ring(*a, 0).ok());
  EXPECT_FALSE(s->blocks_held(*a).ok());
  EXPECT_FALSE(s->read_rows(*a, 0, 0, 1, nullptr, nullptr).ok());
  EXPECT_FALSE(s->contains(SeqId{12345}));
  const Status unmade = s->remove_sequence(SeqId{});
  ASSERT_FALSE(unmade.ok());
  EXPECT_EQ(unmade.error().code, ErrorCode::kNotFound);
  EXPECT_NE(unmade.error().message.find("no store made this handle"), std::string::npos) << unmade.to_string();
  EXPECT_NE(seq_name(*a).find("sequence"), std::string::npos);
}

// Two stores of one geometry (a draft model's and a target's, say) hand
// out handles of the same slot and generation; each refuses the other's,
// on every call, and neither changes.
TEST(Store, AHandleOfAnotherStoreIsRefused) {
  auto a = cpu_store(small_config(), {.max_sequences = 2});
  auto b = cpu_store(small_config(), {.max_sequences = 2});
  auto in_a = a->add_sequence();
  auto in_b = b->add_sequence();
  ASSERT_TRUE(in_a.ok() && in_b.ok());
  EXPECT_EQ(seq_name(*in_a), seq_name(*in_b));  // slot 0, generation 0 in each
  EXPECT_NE(*in_a, *in_b);
  const std::int64_t kv = a->config().kv_dim(), width = a->config().n_heads * a->config().head_dim;
  std::vector<float> row(static_cast<std::size_t>(width), 0.5f), out(row.size());
  const SeqSpan mine{*in_a, 0, 1};
  for (std::int64_t l = 0; l < a->config().n_layers; ++l)
    ASSERT_TRUE(a->store(l, {&mine, 1}, host_view(row.data(), 1, kv), host_view(row.data(), 1, kv)).ok());
  const SeqSpan span{*in_b, 1, 1};
  const SeqQuery query{*in_b, 0};
  const Status stored = a->store(0, {&span, 1}, host_view(row.data(), 1, kv), host_view(row.data(), 1, kv));
  ASSERT_FALSE(stored.ok());
  EXPECT_EQ(stored.error().code, ErrorCode::kNotFound);
  EXPECT_NE(stored.error().message.find("another store: its tag is "), std::string::npos) << stored.error().to_string();
  auto not_found = [](const Status& st) { return !st.ok() && st.error().code == ErrorCode::kNotFound; };
  EXPECT_TRUE(not_found(
      a->attend_decode(0, {&query, 1}, host_view(row.data(), 1, width), host_view(out.data(), 1, width))));
  EXPECT_FALSE(a->contains(*in_b));
  EXPECT_TRUE(not_found(a->remove_sequence(*in_b)));
  EXPECT_TRUE(not_found(a->truncate_sequence(*in_b, 0)));
  EXPECT_FALSE(a->fork_sequence(*in_b).ok());
  EXPECT_FALSE(b->next_position(*in_a).ok());
  EXPECT_FALSE(b->read_rows(*in_a, 0, 0, 1, nullptr, nullptr).ok());
  ASSERT_TRUE(a->next_position(*in_a).ok() && b->next_position(*in_b).ok());
  EXPECT_EQ(*a->next_position(*in_a), 1);
  EXPECT_EQ(*b->next_position(*in_b), 0);
  EXPECT_EQ(a->sequence_count(), 1);
  EXPECT_EQ(b->sequence_count(), 1);
  // Stores made in turn share no tag (up to 4095 of them): of 300, each
  // refuses the first sequence of every other.
  std::vector<std::unique_ptr<KvStore>> many;
  std::vector<SeqId> firsts;
  for (int i = 0; i < 300; ++i) {
    many.push_back(cpu_store(small_config(), {.max_sequences = 1}));
    auto first = many.back()->add_sequence();
    ASSERT_TRUE(first.ok()) << i << ": " << first.error().to_string();
    firsts.push_back(*first);
  }
  for (std::size_t i = 0; i < many.size(); ++i)
    for (std::size_t j = 0; j < many.size(); ++j) ASSERT_EQ(many[i]->contains(firsts[j]), i == j) << i << " " << j;
  // A live store keeps its tag to itself however many stores come and go
  // after it: of a whole turn of 4095 stores made (and dropped) one after
  // another, none takes a live store's tag, so each refuses their handles.
  for (int i = 0; i < 4095; ++i) {
    auto later = cpu_store(small_config(), {.max_sequences = 1});
    auto first = later->add_sequence();
    ASSERT_TRUE(first.ok()) << first.error().to_string();
    for (std::size_t j = 0; j < many.size(); ++j) {
      ASSERT_FALSE(later->contains(firsts[j])) << i << " " << j;
      ASSERT_FALSE(many[j]->contains(*first)) << i << " " << j;
    }
  }
}

TEST(Store, OptionsAreChecked) {
  const ModelConfig c = small_config();
  EXPECT_FALSE(make_store(BackendKind::kCpu, c, {.max_sequences = 0}).ok());
  EXPECT_FALSE(make_store(BackendKind::kCpu, c, {.context = c.max_context + 1}).ok());
  EXPECT_FALSE(make_store(BackendKind::kCpu, c, {.slack = -1}).ok());
  EXPECT_FALSE(make_store(BackendKind::kCpu, c, {.slack = c.sliding_window + 1}).ok());
  EXPECT_FALSE(make_store(BackendKind::kCpu, c, {.block_rows = 24}).ok());
  EXPECT_FALSE(make_store(BackendKind::kCpu, c, {.block_rows = 8}).ok());
  EXPECT_FALSE(make_store(BackendKind::kCpu, c, {.pool_blocks = -1}).ok());
  const auto bad = make_store(BackendKind::kCpu, c, {.attention = static_cast<AttentionNumeric>(7)});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find("attention numeric 7"), std::string::npos) << bad.error().message;
  EXPECT_EQ(*parse_attention_numeric("f16"), AttentionNumeric::kF16);
  EXPECT_EQ(*parse_attention_numeric("f32"), AttentionNumeric::kF32);
  EXPECT_FALSE(parse_attention_numeric("fp8").ok());
  EXPECT_STREQ(attention_numeric_name(AttentionNumeric::kF16), "f16");
  // Options each within its own bound whose storage is past 2^62 bytes (or
  // past 64 bits) are refused before anything is sized by them: 2^30
  // blocks of 65536 rows of 256 KiB, and 2^20 sequences' rings of 2^25
  // rows of 256 KiB in 1023 layers.
  const ModelConfig wide = make_hybrid_config("wide", 1024, 1024, 512, 512, 128, 1 << 24, 1 << 24);
  ASSERT_TRUE(wide.validate().ok());
  for (const StoreOptions& o : {StoreOptions{.max_sequences = 1, .context = 1 << 16, .block_rows = 65536,
                                             .pool_blocks = std::int64_t{1} << 30},
                                StoreOptions{.max_sequences = 1 << 20, .slack = 1 << 24, .pool_blocks = 1}}) {
    const auto big = resolve_store_options(wide, o);
    ASSERT_FALSE(big.ok());
    EXPECT_NE(big.error().message.find("is past 4611686018427387904 bytes"), std::string::npos)
        << big.error().message;
  }
  // Just under the bound it resolves (nothing is allocated by resolving).
  EXPECT_TRUE(resolve_store_options(wide, {.max_sequences = 1, .context = 1 << 16, .block_rows = 65536,
                                           .pool_blocks = (std::int64_t{1} << 26) - 1})
                  .ok());
  auto s = make_store(BackendKind::kCpu, c, {.max_sequences = 3, .block_rows = 16});
  ASSERT_TRUE(s.ok());
  // One full layer of 256 positions: 16 blocks a sequence.
  EXPECT_EQ((*s)->pool_blocks(), 3 * 1 * 16);
  EXPECT_EQ((*s)->capacity(0), c.sliding_window);
}

// Runs sequences ids id0 + i (handles seqs[i], length[i] tokens) in random
// batches: each step some of the unfinished sequences, in random order,
// advance one token each (decode, with odds 1 in decode_odds) or by a
// chunk of 1..max_chunk tokens (a ragged prefill).
void run_random_batches(KvStore& s, const std::vector<SeqId>& seqs, const std::vector<std::int64_t>& length,
                        std::uint64_t id0, std::mt19937_64& rng, int decode_odds, std::int64_t max_chunk,
                        Outputs& out) {
  const int n_seq = static_cast<int>(seqs.size());
  std::vector<std::int64_t> done(seqs.size(), 0);
  while (true) {
    std::vector<int> ready;
    for (int i = 0; i < n_seq; ++i)
      if (done[static_cast<std::size_t>(i)] < length[static_cast<std::size_t>(i)]) ready.push_back(i);
    if (ready.empty()) break;
    std::shuffle(ready.begin(), ready.end(), rng);
    ready.resize(std::uniform_int_distribution<std::size_t>(1, ready.size())(rng));
    const bool decode = rng() % static_cast<std::uint64_t>(decode_odds) == 0;
    std::vector<std::pair<std::uint64_t, SeqSpan>> batch;
    for (int i : ready) {
      const auto u = static_cast<std::size_t>(i);
      const std::int64_t left = length[u] - done[u];
      const std::int64_t count =
          decode ? 1 : std::uniform_int_distribution<std::int64_t>(1, std::min<std::int64_t>(left, max_chunk))(rng);
      batch.push_back({id0 + static_cast<std::uint64_t>(i), SeqSpan{seqs[u], done[u], count}});
      done[u] += count;
    }
    run_batch(s, batch, out);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// Every output of `solo` is in `out` with the same bits, and `out` holds
// nothing more.
void expect_solo_bits(const Outputs& out, const Outputs& solo) {
  EXPECT_EQ(out.size(), solo.size());
  for (const auto& [key, value] : solo) {
    auto it = out.find(key);
    ASSERT_NE(it, out.end());
    ASSERT_EQ(0, std::memcmp(it->second.data(), value.data(), value.size() * 4))
        << "sequence " << std::get<0>(key) << " layer " << std::get<1>(key) << " position "
        << std::get<2>(key);
  }
}

// Seeded random batch compositions against solo runs: stored bytes and
// every attention output, bit for bit, whatever the batch, order, slot,
// chunking and blocks.
TEST(Store, BitsNeverDependOnTheBatch) {
  const ModelConfig c = small_config(/*window=*/32, /*max_context=*/256, /*n_layers=*/4);
  const StoreOptions o{.max_sequences = 6, .block_rows = 16};
  for (std::uint64_t seed : {1u, 2u, 3u}) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    const int n_seq = 5;
    std::vector<std::int64_t> length(n_seq);
    for (auto& len : length) len = std::uniform_int_distribution<std::int64_t>(1, 200)(rng);
    Outputs solo_out;
    std::vector<std::vector<std::uint16_t>> solo_bytes(n_seq);
    for (int i = 0; i < n_seq; ++i)
      run_solo(c, o, 100 + i, length[static_cast<std::size_t>(i)], solo_out,
               solo_bytes[static_cast<std::size_t>(i)]);

    auto s = cpu_store(c, o);
    // Churn the slots so sequences land in varied slots and blocks.
    std::vector<SeqId> filler;
    for (int i = 0; i < static_cast<int>(seed % 3); ++i) filler.push_back(*s->add_sequence());
    std::vector<SeqId> seqs;
    for (int i = 0; i < n_seq; ++i) {
      if (i == 2 && !filler.empty()) {
        ASSERT_TRUE(s->remove_sequence(filler.back()).ok());
        filler.pop_back();
      }
      seqs.push_back(*s->add_sequence());
    }
    Outputs out;
    run_random_batches(*s, seqs, length, 100, rng, 2, 40, out);
    if (::testing::Test::HasFatalFailure()) return;
    expect_solo_bits(out, solo_out);
    for (int i = 0; i < n_seq; ++i)
      EXPECT_EQ(live_bytes(*s, seqs[static_cast<std::size_t>(i)]), solo_bytes[static_cast<std::size_t>(i)]);
  }
}

// Runs `f` under every attention path this CPU has (scalar, AVX2,
// AVX-512), then restores the machine's.
template <class F>
void for_each_attention_isa(F&& f) {
  const cpu::AttentionIsa saved = cpu::attention_isa();
  for (const auto isa : {cpu::AttentionIsa::kScalar, cpu::AttentionIsa::kAvx2, cpu::AttentionIsa::kAvx512}) {
    if (!cpu::set_attention_isa(isa)) continue;
    SCOPED_TRACE("attention path " + std::to_string(static_cast<int>(isa)));
    f();
  }
  cpu::set_attention_isa(saved);
}

void f16_bits_never_depend_on_the_batch() {
  const ModelConfig c = make_hybrid_config("f16-small", 2, 2, 4, 2, 16, 100, 4608);
  const StoreOptions o{.max_sequences = 4, .block_rows = 16, .attention = AttentionNumeric::kF16};
  std::mt19937_64 rng(5);
  const std::vector<std::int64_t> length = {2 * kF16AttendSplitRows + 170, 1 + static_cast<std::int64_t>(rng() % 300),
                                            1 + static_cast<std::int64_t>(rng() % 300)};
  const int n_seq = static_cast<int>(length.size());
  Outputs solo_out;
  std::vector<std::vector<std::uint16_t>> solo_bytes(length.size());
  for (int i = 0; i < n_seq; ++i)
    run_solo(c, o, 200 + i, length[static_cast<std::size_t>(i)], solo_out, solo_bytes[static_cast<std::size_t>(i)]);
  auto s = cpu_store(c, o);
  std::vector<SeqId> seqs;
  for (int i = 0; i < n_seq; ++i) seqs.push_back(*s->add_sequence());
  Outputs out;
  run_random_batches(*s, seqs, length, 200, rng, 4, 700, out);
  if (::testing::Test::HasFatalFailure()) return;
  expect_solo_bits(out, solo_out);
  for (int i = 0; i < n_seq; ++i)
    EXPECT_EQ(live_bytes(*s, seqs[static_cast<std::size_t>(i)]), solo_bytes[static_cast<std::size_t>(i)]);
}

// The f16 numeric keeps every invariance of the f32 one, on every
// attention path: sequences that cross two splits (kF16AttendSplitRows
// positions each) and wrap a small ring give the bits of their solo
// token-by-token runs in any batch and chunking.
TEST(Store, F16NumericBitsNeverDependOnTheBatch) {
  for_each_attention_isa([] { f16_bits_never_depend_on_the_batch(); });
}

// The f16 numeric is attention to within its roundings, on every
// attention path: queries and weights in f16 (11 significant bits) move an
// output by a few parts in 10^4 of the values' scale against the f32
// numeric.
TEST(Store, F16NumericIsAttentionWithinF16Rounding) {
  for_each_attention_isa([] {
    const ModelConfig c = make_hybrid_config("f16-small", 2, 2, 4, 2, 16, 100, 4608);
    Outputs f32_out, f16_out;
    std::vector<std::uint16_t> f32_bytes, f16_bytes;
    const std::int64_t len = 2 * kF16AttendSplitRows + 300;
    for (const auto numeric : {AttentionNumeric::kF32, AttentionNumeric::kF16}) {
      const bool f16 = numeric == AttentionNumeric::kF16;
      auto s = cpu_store(c, {.max_sequences = 1, .block_rows = 64, .attention = numeric});
      const SeqId seq = *s->add_sequence();
      for (std::int64_t p = 0; p < len; p += 512)
        run_batch(*s, {{7, SeqSpan{seq, p, std::min<std::int64_t>(512, len - p)}}}, f16 ? f16_out : f32_out);
      (f16 ? f16_bytes : f32_bytes) = live_bytes(*s, seq);
    }
    EXPECT_EQ(f16_bytes, f32_bytes);  // the numeric is attention's, never the store's
    ASSERT_EQ(f16_out.size(), f32_out.size());
    double worst = 0, differ = 0;
    for (const auto& [key, ref] : f32_out) {
      const auto& got = f16_out.at(key);
      for (std::size_t e = 0; e < ref.size(); ++e) {
        ASSERT_TRUE(std::isfinite(got[e]));
        const double d = std::abs(double(got[e]) - ref[e]);
        worst = std::max(worst, d);
        differ += got[e] != ref[e];
      }
    }
    EXPECT_LE(worst, 2e-3);
    EXPECT_GT(differ, 0);  // the numerics are not the same arithmetic
  });
}

// A sequence's full-attention memory is its live rows rounded up to one
// block a layer: 64 sequences of 256 positions hold the blocks of 4 of 4096.
TEST(Store, FullPlanesGrowByBlocks) {
  const ModelConfig c = small_config(/*window=*/32, /*max_context=*/4096, /*n_layers=*/8);
  const std::int64_t n_full = 2;
  auto s = cpu_store(c, {.max_sequences = 64, .block_rows = 16, .pool_blocks = 4 * n_full * 4096 / 16});
  std::vector<SeqId> seqs;
  for (int i = 0; i < 64; ++i) seqs.push_back(*s->add_sequence());
  Outputs out;
  // Prefill 256 positions of each, in batches of 16 sequences.
  for (int b = 0; b < 4; ++b) {
    std::vector<std::pair<std::uint64_t, SeqSpan>> batch;
    for (int i = 0; i < 16; ++i) batch.push_back({static_cast<std::uint64_t>(b * 16 + i), SeqSpan{seqs[static_cast<std::size_t>(b * 16 + i)], 0, 256}});
    run_batch(*s, batch, out);
  }
  EXPECT_EQ(s->free_blocks(), 0);
  for (const SeqId q : seqs) EXPECT_EQ(*s->blocks_held(q), n_full * 256 / 16);
  // One more position needs one more block a full layer: refused, unchanged.
  const auto before = live_bytes(*s, seqs[0]);
  Outputs more;
  const std::int64_t kv = c.kv_dim();
  Rows r = rows_for(c, 0, 3, 256, 1);
  const SeqSpan next{seqs[0], 256, 1};
  const Status st = s->store(3, {&next, 1}, host_view(r.k.data(), 1, kv), host_view(r.v.data(), 1, kv));
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, ErrorCode::kResourceExhausted);
  EXPECT_NE(st.error().message.find("pool"), std::string::npos);
  EXPECT_EQ(live_bytes(*s, seqs[0]), before);
  EXPECT_EQ(s->free_blocks(), 0);
  // A partial block: 17 rows take two blocks a layer.
  ASSERT_TRUE(s->reset_sequence(seqs[1]).ok());
  EXPECT_EQ(s->free_blocks(), n_full * 16);
  run_batch(*s, {{1000, SeqSpan{seqs[1], 0, 17}}}, out);
  EXPECT_EQ(*s->blocks_held(seqs[1]), n_full * 2);
  ASSERT_TRUE(s->remove_sequence(seqs[1]).ok());
  EXPECT_EQ(s->free_blocks(), n_full * 16);
}

// A pool's bookkeeping grows with the blocks taken: a pool of 2^21 blocks
// (8 bytes of counters and free list a block would be 16 MiB) costs next to
// nothing until used, and its blocks are counted and given back as usual.
TEST(Store, APoolCostsBookkeepingOnlyForTheBlocksTaken) {
  const ModelConfig c = small_config(/*window=*/32, /*max_context=*/4096, /*n_layers=*/4, /*n_heads=*/2,
                                     /*n_kv_heads=*/1, /*head_dim=*/8);
  const std::int64_t blocks = std::int64_t{1} << 21;
  const std::int64_t before = testing::proc_status_bytes("VmRSS");
  ASSERT_GT(before, 0);
  auto s = cpu_store(c, {.max_sequences = 2, .block_rows = 16, .pool_blocks = blocks});
  ASSERT_NE(s, nullptr);
  EXPECT_LT(testing::proc_status_bytes("VmRSS") - before, std::int64_t{4} << 20);
  EXPECT_EQ(s->pool_blocks(), blocks);
  EXPECT_EQ(s->free_blocks(), blocks);
  const SeqId a = *s->add_sequence();
  const SeqId b = *s->add_sequence();
  Outputs out;
  run_batch(*s, {{1, SeqSpan{a, 0, 100}}, {2, SeqSpan{b, 0, 40}}}, out);
  // One full layer: 7 blocks for 100 rows, 3 for 40.
  EXPECT_EQ(*s->blocks_held(a), 7);
  EXPECT_EQ(*s->blocks_held(b), 3);
  EXPECT_EQ(s->free_blocks(), blocks - 10);
  const auto b_rows = live_bytes(*s, b);
  ASSERT_TRUE(s->remove_sequence(a).ok());
  EXPECT_EQ(s->free_blocks(), blocks - 3);
  // The blocks given back are taken again; b's rows stay as they were.
  const SeqId a2 = *s->add_sequence();
  run_batch(*s, {{3, SeqSpan{a2, 0, 100}}}, out);
  EXPECT_EQ(s->free_blocks(), blocks - 10);
  EXPECT_EQ(live_bytes(*s, b), b_rows);
}

TEST(Store, ForkSharesBlocksAndWritesNeverReachTheOther) {
  const ModelConfig c = small_config(/*window=*/32, /*max_context=*/256, /*n_layers=*/4);
  const StoreOptions o{.max_sequences = 3, .block_rows = 16};
  auto s = cpu_store(c, o);
  const SeqId a = *s->add_sequence();
  Outputs out;
  run_batch(*s, {{1, SeqSpan{a, 0, 70}}}, out);  // 4 full blocks and a partial one
  const std::int64_t free_before = s->free_blocks();
  auto b = s->fork_sequence(a);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(s->free_blocks(), free_before);  // nothing copied yet
  EXPECT_EQ(*s->next_position(*b), 70);
  EXPECT_EQ(live_bytes(*s, *b), live_bytes(*s, a));
  // Different continuations: each writes into the shared partial block.
  const auto a_prefix = live_bytes(*s, a);
  run_batch(*s, {{2, SeqSpan{*b, 70, 30}}}, out);
  EXPECT_EQ(live_bytes(*s, a), a_prefix);  // b's writes never reach a
  EXPECT_EQ(s->free_blocks(), free_before - 3);  // one copied block, two new blocks
  run_batch(*s, {{1, SeqSpan{a, 70, 30}}}, out);

  // Each equals a solo run of its own tokens. b's ids: 1 up to 70, then 2.
  Outputs solo;
  std::vector<std::uint16_t> a_bytes;
  run_solo(c, o, 1, 100, solo, a_bytes);
  EXPECT_EQ(live_bytes(*s, a), a_bytes);
  auto t = cpu_store(c, {.max_sequences = 1, .block_rows = 16});
  const SeqId u = *t->add_sequence();
  Outputs solo_b;
  run_batch(*t, {{1, SeqSpan{u, 0, 70}}}, solo_b);
  run_batch(*t, {{2, SeqSpan{u, 70, 30}}}, solo_b);
  EXPECT_EQ(live_bytes(*s, *b), live_bytes(*t, u));
  for (std::int64_t p = 70; p < 100; ++p)
    for (std::int64_t l = 0; l < 4; ++l)
      EXPECT_EQ((out[{2, l, p}]), (solo_b[{2, l, p}]));
  // The last slot is the fork's; a third sequence cannot fork.
  ASSERT_TRUE(s->add_sequence().ok());
  EXPECT_EQ(s->fork_sequence(a).error().code, ErrorCode::kResourceExhausted);
}

TEST(Store, TruncateRollsBackWithinTheSlack) {
  const ModelConfig c = small_config(/*window=*/32, /*max_context=*/256, /*n_layers=*/4);
  const StoreOptions o{.max_sequences = 2, .slack = 4, .block_rows = 16};
  auto s = cpu_store(c, o);
  EXPECT_EQ(s->capacity(0), 32 + 4);
  const SeqId a = *s->add_sequence();
  Outputs out;
  run_batch(*s, {{1, SeqSpan{a, 0, 100}}}, out);  // the rings wrapped
  const auto before = live_bytes(*s, a);
  // The floor is the slack's 4 tokens back; past it, or past the start:
  // refused, unchanged.
  EXPECT_EQ(*s->rollback_floor(a), 96);
  EXPECT_FALSE(s->truncate_sequence_to(a, 95).ok());
  EXPECT_FALSE(s->truncate_sequence(a, 5).ok());
  EXPECT_FALSE(s->truncate_sequence(a, 101).ok());
  EXPECT_FALSE(s->truncate_sequence(a, -1).ok());
  EXPECT_EQ(live_bytes(*s, a), before);
  EXPECT_EQ(*s->next_position(a), 100);
  // Speculative tokens rolled back, then other tokens: equals a solo run.
  const Status rolled = s->truncate_sequence(a, 4);
  ASSERT_TRUE(rolled.ok()) << rolled.to_string();
  EXPECT_EQ(*s->next_position(a), 96);
  run_batch(*s, {{7, SeqSpan{a, 96, 10}}}, out);
  auto t = cpu_store(c, {.max_sequences = 1, .slack = 4, .block_rows = 16});
  const SeqId u = *t->add_sequence();
  Outputs solo;
  run_batch(*t, {{1, SeqSpan{u, 0, 96}}}, solo);
  run_batch(*t, {{7, SeqSpan{u, 96, 10}}}, solo);
  EXPECT_EQ(live_bytes(*s, a), live_bytes(*t, u));
  for (std::int64_t p = 96; p < 106; ++p)
    for (std::int64_t l = 0; l < 4; ++l) EXPECT_EQ((out[{7, l, p}]), (solo[{7, l, p}]));
  // A short sequence rolls back as far as its start; blocks go back.
  const SeqId b = *s->add_sequence();
  const std::int64_t free_before = s->free_blocks();
  run_batch(*s, {{3, SeqSpan{b, 0, 20}}}, out);
  EXPECT_EQ(*s->rollback_floor(b), 0);
  ASSERT_TRUE(s->truncate_sequence(b, 20).ok());
  EXPECT_EQ(*s->next_position(b), 0);
  EXPECT_EQ(s->free_blocks(), free_before);
}

// A step of one call per layer that the pool refuses at a later full layer
// leaves the earlier layers a step ahead; truncate_sequence_to rolls every
// layer back to one position, and the sequence goes on as a solo run.
TEST(Store, AStepRefusedPartWayIsRolledBackAcrossLayers) {
  // Layers 1 and 3 full; a 20-token step takes 2 blocks of each.
  const ModelConfig c = make_hybrid_config("two-full", 4, 2, 4, 2, 16, 32, 256);
  auto s = cpu_store(c, {.max_sequences = 1, .slack = 4, .block_rows = 16, .pool_blocks = 3});
  const SeqId a = *s->add_sequence();
  const std::int64_t n = 20, kv = c.kv_dim(), width = c.n_heads * c.head_dim;
  const SeqSpan span{a, 0, n};
  Status refused;
  std::int64_t layers_done = 0;
  for (std::int64_t l = 0; l < c.n_layers && refused.ok(); ++l) {
    Rows r = rows_for(c, 9, l, 0, n);
    std::vector<float> out(static_cast<std::size_t>(n * width));
    refused = s->prefill(l, {&span, 1}, host_view(r.k.data(), n, kv), host_view(r.v.data(), n, kv),
                         host_view(r.q.data(), n, width), host_view(out.data(), n, width));
    if (refused.ok()) ++layers_done;
  }
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code, ErrorCode::kResourceExhausted);
  ASSERT_GT(layers_done, 0);
  ASSERT_LT(layers_done, c.n_layers);
  EXPECT_EQ(s->next_position(a).error().code, ErrorCode::kCacheDiscontinuity);
  const Status uneven = s->truncate_sequence(a, 0);
  EXPECT_EQ(uneven.error().code, ErrorCode::kCacheDiscontinuity);
  EXPECT_EQ(uneven.error().message.rfind(seq_name(a) + ": layer ", 0), 0u) << uneven.to_string();
  EXPECT_EQ(*s->rollback_floor(a), 0);
  // Past what a layer holds, or before 0: refused, nothing changed.
  const auto before = live_bytes(*s, a);
  const std::int64_t free_before = s->free_blocks();
  for (const std::int64_t bad : {std::int64_t{-1}, std::int64_t{1}, n}) {
    const Status st = s->truncate_sequence_to(a, bad);
    ASSERT_FALSE(st.ok()) << bad;
    EXPECT_EQ(st.error().code, ErrorCode::kInvalidArgument);
  }
  EXPECT_EQ(live_bytes(*s, a), before);
  EXPECT_EQ(s->free_blocks(), free_before);
  // Back to the step's start: every layer empty, every block free; then a
  // shorter step fits and equals a solo run of the same tokens.
  ASSERT_TRUE(s->truncate_sequence_to(a, 0).ok());
  EXPECT_EQ(*s->next_position(a), 0);
  EXPECT_EQ(s->free_blocks(), 3);
  Outputs out, solo;
  run_batch(*s, {{9, SeqSpan{a, 0, 16}}}, out);
  auto t = cpu_store(c, {.max_sequences = 1, .slack = 4, .block_rows = 16});
  const SeqId u = *t->add_sequence();
  run_batch(*t, {{9, SeqSpan{u, 0, 16}}}, solo);
  EXPECT_EQ(live_bytes(*s, a), live_bytes(*t, u));
  EXPECT_EQ(out, solo);
}

// Free slots leave out live and detached sequences; a slot comes back when
// its sequence is removed.
TEST(Store, FreeSlotsCountWhatAddSequenceCanTake) {
  auto s = cpu_store(small_config(), {.max_sequences = 3});
  EXPECT_EQ(s->free_slots(), 3);
  const SeqId a = *s->add_sequence();
  const SeqId d = *s->add_detached_sequence();
  EXPECT_EQ(s->free_slots(), 1);
  EXPECT_EQ(s->sequence_count(), 1);
  ASSERT_TRUE(s->fork_sequence(a).ok());
  EXPECT_EQ(s->free_slots(), 0);
  EXPECT_EQ(s->add_sequence().error().code, ErrorCode::kResourceExhausted);
  ASSERT_TRUE(s->remove_sequence(d).ok());
  EXPECT_EQ(s->free_slots(), 1);
}

// A slot whose generation would wrap is retired: the handle of its last
// sequence never names a later one, add, fork and free_slots pass it over,
// and once every slot is retired or taken the refusal says so.
TEST(Store, ASlotIsRetiredBeforeItsGenerationWraps) {
  auto s = cpu_store(small_config(), {.max_sequences = 2});
  const std::uint32_t last = std::numeric_limits<std::uint32_t>::max() - 1;
  KvStoreTestAccess::set_generation(*s, 0, last - 1);
  const SeqId a = *s->add_sequence();  // slot 0, generation last - 1
  ASSERT_TRUE(s->remove_sequence(a).ok());
  const SeqId b = *s->add_detached_sequence();  // slot 0 again, generation last
  EXPECT_NE(b, a);
  EXPECT_EQ(s->free_slots(), 1);
  ASSERT_TRUE(s->remove_sequence(b).ok());
  // Slot 0 is retired: one slot left, and the next sequence takes slot 1.
  EXPECT_EQ(s->free_slots(), 1);
  const SeqId c = *s->add_sequence();
  EXPECT_NE(c, a);
  EXPECT_NE(c, b);
  EXPECT_EQ(s->free_slots(), 0);
  for (const SeqId gone : {a, b}) {
    EXPECT_FALSE(s->contains(gone));
    EXPECT_EQ(s->remove_sequence(gone).error().code, ErrorCode::kNotFound);
    EXPECT_EQ(s->next_position(gone).error().code, ErrorCode::kNotFound);
  }
  const auto more = s->add_sequence();
  ASSERT_FALSE(more.ok());
  EXPECT_EQ(more.error().code, ErrorCode::kResourceExhausted);
  EXPECT_NE(more.error().message.find("1 retired"), std::string::npos) << more.error().message;
  const auto fork = s->fork_sequence(c);
  ASSERT_FALSE(fork.ok());
  EXPECT_EQ(fork.error().code, ErrorCode::kResourceExhausted);
  EXPECT_EQ(s->add_detached_sequence().error().code, ErrorCode::kResourceExhausted);
  // Slot 1 still turns over.
  ASSERT_TRUE(s->remove_sequence(c).ok());
  EXPECT_EQ(s->free_slots(), 1);
  const SeqId d = *s->add_sequence();
  EXPECT_NE(d, c);
  EXPECT_TRUE(s->contains(d));
  EXPECT_EQ(s->sequences(), std::vector<SeqId>{d});
}

// A call refused for want of blocks after taking some (free ones and fresh
// ones) gives them back as they were: the free list in its order and the
// fresh blocks untaken, so the next call places its rows as it would have.
TEST(Store, ARefusedCallLeavesThePoolInItsOrder) {
  const ModelConfig c = small_config();
  const std::int64_t kv = c.kv_dim();
  auto s = cpu_store(c, {.max_sequences = 3, .block_rows = 16, .pool_blocks = 8});
  const std::vector<float> rows(static_cast<std::size_t>(4 * 128 * kv), 0.25f);
  auto put = [&](std::span<const SeqSpan> spans) {
    std::int64_t n = 0;
    for (const SeqSpan& sp : spans) n += sp.count;
    return s->store_all_layers(spans, host_view(rows.data(), 4 * n, kv), host_view(rows.data(), 4 * n, kv));
  };
  const SeqId a = *s->add_sequence(), b = *s->add_sequence(), c2 = *s->add_sequence();
  const SeqSpan first[] = {{a, 0, 48}, {b, 0, 32}};
  ASSERT_TRUE(put(first).ok());  // blocks 0-2 to a, 3-4 to b
  ASSERT_TRUE(s->remove_sequence(a).ok());
  const auto before = KvStoreTestAccess::pool(*s);
  ASSERT_EQ(before.first.size(), 3u);
  ASSERT_EQ(before.second, 5);
  // 7 blocks wanted of the 6 free, in either order of the sequences.
  const SeqSpan b_first[] = {{b, 32, 32}, {c2, 0, 80}};
  const SeqSpan c_first[] = {{c2, 0, 64}, {b, 32, 48}};
  for (const auto& spans : {std::span<const SeqSpan>(b_first), std::span<const SeqSpan>(c_first)}) {
    const Status st = put(spans);
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.error().code, ErrorCode::kResourceExhausted) << st.to_string();
    EXPECT_EQ(KvStoreTestAccess::pool(*s), before);
    EXPECT_EQ(s->free_blocks(), 6);
  }
}

// blocks_to_store refuses what store refuses in any layer, not only the
// full ones: a ring shorter than its window stops at the store's context
// (20), where the full plane holds its 32 rows.
TEST(Store, BlocksToStoreRefusesPastASlidingRingsLimit) {
  auto s = cpu_store(small_config(/*window=*/64, /*max_context=*/256, /*n_layers=*/4),
                     {.max_sequences = 1, .context = 20, .block_rows = 16});
  ASSERT_EQ(s->position_limit(0), 20);
  ASSERT_EQ(s->capacity(3), 32);
  const SeqId a = *s->add_sequence();
  const SeqSpan fits{a, 0, 20}, past{a, 0, 25};
  EXPECT_EQ(*s->blocks_to_store({&fits, 1}), 2);
  const std::vector<float> rows(static_cast<std::size_t>(25 * s->config().kv_dim()), 0.5f);
  EXPECT_EQ(s->store(0, {&past, 1}, host_view(rows.data(), 25, s->config().kv_dim()),
                     host_view(rows.data(), 25, s->config().kv_dim())).error().code,
            ErrorCode::kCapacityExceeded);
  auto refused = s->blocks_to_store({&past, 1});
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code, ErrorCode::kCapacityExceeded);
  EXPECT_NE(refused.error().message.find("layer 0: a ring shorter than the window"), std::string::npos)
      << refused.error().message;
}

// A call that needs more blocks than are free says how many of the blocks
// in use it had taken itself (a call larger than the whole pool takes them
// all), and gives them back.
TEST(Store, APoolRefusalSaysWhatTheCallHadTaken) {
  const ModelConfig c = make_hybrid_config("one-full", 4, 4, 8, 2, 64, 64, 4096);  // layer 3 full
  auto s = cpu_store(c, {.max_sequences = 2, .slack = 4, .block_rows = 16, .pool_blocks = 2});
  const std::int64_t kv = c.kv_dim();
  auto store_full = [&](SeqId seq, std::int64_t start, std::int64_t n) {
    Rows r = rows_for(c, static_cast<std::uint64_t>(seq), 3, start, n);
    const SeqSpan span{seq, start, n};
    return s->store(3, {&span, 1}, host_view(r.k.data(), n, kv), host_view(r.v.data(), n, kv));
  };
  const SeqId a = *s->add_sequence(), b = *s->add_sequence();
  // 48 rows need 3 blocks of a pool of 2, empty when the call begins.
  const Status whole = store_full(a, 0, 48);
  ASSERT_FALSE(whole.ok());
  EXPECT_EQ(whole.error().code, ErrorCode::kResourceExhausted);
  EXPECT_NE(whole.error().message.find("all 2 blocks of 16 rows are in use (2 of them taken by this call"),
            std::string::npos)
      << whole.error().message;
  EXPECT_EQ(s->free_blocks(), 2);
  // b holds one; a's 32 rows take the other and are refused for a third.
  ASSERT_TRUE(store_full(b, 0, 16).ok());
  const Status rest = store_full(a, 0, 32);
  ASSERT_FALSE(rest.ok());
  EXPECT_NE(rest.error().message.find("(1 of them taken by this call"), std::string::npos) << rest.error().message;
  EXPECT_EQ(s->free_blocks(), 1);
  // With a's first blocks held elsewhere, the message names none of its own.
  ASSERT_TRUE(store_full(b, 16, 16).ok());
  const Status none = store_full(a, 0, 1);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.error().message.find("taken by this call"), std::string::npos) << none.error().message;
  EXPECT_EQ(s->free_blocks(), 0);
}

// A refusal tells an engine whether freeing helps: kResourceExhausted for a
// pool (or slots) used up, kCapacityExceeded for a span no pool could take,
// also when an earlier span of the batch would have used up the pool.
// blocks_held_alone prices a preemption: what removing a sequence gives back.
TEST(Store, RefusalsTellAUsedUpPoolFromASpanThatNeverFits) {
  const ModelConfig c = small_config(/*window=*/32, /*max_context=*/256, /*n_layers=*/4);
  auto s = cpu_store(c, {.max_sequences = 3, .context = 64, .block_rows = 16, .pool_blocks = 5});
  const std::int64_t kv = c.kv_dim(), L = c.n_layers;
  auto store_all = [&](std::span<const SeqSpan> spans) {
    std::int64_t n = 0;
    for (const SeqSpan& sp : spans) n += sp.count;
    std::vector<float> k, v;
    for (std::int64_t l = 0; l < L; ++l)
      for (const SeqSpan& sp : spans) {
        Rows r = rows_for(c, static_cast<std::uint64_t>(sp.seq), l, sp.start, sp.count);
        k.insert(k.end(), r.k.begin(), r.k.end());
        v.insert(v.end(), r.v.begin(), r.v.end());
      }
    return s->store_all_layers(spans, host_view(k.data(), n * L, kv), host_view(v.data(), n * L, kv));
  };
  const SeqId a = *s->add_sequence();
  const SeqSpan first{a, 0, 40};
  ASSERT_TRUE(store_all({&first, 1}).ok());
  const SeqId b = *s->fork_sequence(a);
  EXPECT_EQ(*s->blocks_held(a), 3);
  EXPECT_EQ(*s->blocks_held_alone(a), 0);
  EXPECT_EQ(*s->blocks_held_alone(b), 0);
  // b copies the shared block it writes into and takes one more.
  const SeqSpan grow{b, 40, 10};
  ASSERT_TRUE(store_all({&grow, 1}).ok());
  EXPECT_EQ(s->free_blocks(), 0);
  EXPECT_EQ(*s->blocks_held_alone(a), 1);
  EXPECT_EQ(*s->blocks_held_alone(b), 2);

  const SeqSpan more{a, 40, 10}, past{b, 50, 20};
  const Status exhausted = store_all({&more, 1});
  ASSERT_FALSE(exhausted.ok());
  EXPECT_EQ(exhausted.error().code, ErrorCode::kResourceExhausted) << exhausted.error().to_string();
  const std::vector<SeqSpan> both = {more, past};
  const Status never = store_all(both);
  ASSERT_FALSE(never.ok());
  EXPECT_EQ(never.error().code, ErrorCode::kCapacityExceeded) << never.error().to_string();
  EXPECT_EQ(s->blocks_to_store(both).error().code, ErrorCode::kCapacityExceeded);
  EXPECT_EQ(*s->next_position(a), 40);

  const std::int64_t alone = *s->blocks_held_alone(b);
  ASSERT_TRUE(s->remove_sequence(b).ok());
  EXPECT_EQ(s->free_blocks(), alone);
  EXPECT_EQ(*s->blocks_held_alone(a), 3);
  EXPECT_TRUE(store_all({&more, 1}).ok());
}

// A snapshot holds no slack rows: a sequence restored into a store with
// slack rolls back only the tokens stored after the restore.
TEST(Store, RollbackAfterARestoreStopsAtTheRestorePoint) {
  const ModelConfig c = small_config(/*window=*/32, /*max_context=*/256, /*n_layers=*/4);
  const StoreOptions o{.max_sequences = 2, .slack = 4, .block_rows = 16};
  auto s = cpu_store(c, o);
  const SeqId a = *s->add_sequence();
  Outputs out;
  run_batch(*s, {{1, SeqSpan{a, 0, 100}}}, out);
  auto snap = take_snapshot(*s, a);
  ASSERT_TRUE(snap.ok());
  auto b = restore_new_sequence(*snap, *s);
  ASSERT_TRUE(b.ok()) << b.error().to_string();
  const Status before_restore_point = s->truncate_sequence(*b, 1);
  EXPECT_EQ(before_restore_point.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(before_restore_point.error().message.find("not before a restore"), std::string::npos);
  EXPECT_TRUE(s->truncate_sequence(a, 1).ok());  // the live one still can
  run_batch(*s, {{2, SeqSpan{*b, 100, 4}}}, out);
  EXPECT_TRUE(s->truncate_sequence(*b, 4).ok());
  EXPECT_EQ(*s->next_position(*b), 100);
}

TEST(Store, TruncateIntoASharedBlockCopiesItOnWrite) {
  const ModelConfig c = small_config(/*window=*/32, /*max_context=*/256, /*n_layers=*/4);
  auto s = cpu_store(c, {.max_sequences = 2, .block_rows = 16});
  const SeqId a = *s->add_sequence();
  Outputs out;
  run_batch(*s, {{1, SeqSpan{a, 0, 32}}}, out);  // two full blocks
  const SeqId b = *s->fork_sequence(a);
  const auto a_bytes = live_bytes(*s, a);
  ASSERT_TRUE(s->truncate_sequence(b, 8).ok());  // b's last block: shared, partial
  run_batch(*s, {{9, SeqSpan{b, 24, 8}}}, out);
  EXPECT_EQ(live_bytes(*s, a), a_bytes);
}

// When every holder of a shared block writes into it in one call, the one
// that starts furthest keeps it and the others copy it: a fork and its
// source decoding together fit a pool sized for every slot at one block a
// plane, and each equals a solo run.
TEST(Store, HoldersWritingASharedBlockTogetherLeaveItToOne) {
  const ModelConfig c = small_config(/*window=*/32, /*max_context=*/64, /*n_layers=*/4);
  auto s = cpu_store(c, {.max_sequences = 2});
  ASSERT_EQ(s->pool_blocks(), 2);  // one full layer, one block of 64 rows a slot
  const SeqId a = *s->add_sequence();
  Outputs out;
  run_batch(*s, {{1, SeqSpan{a, 0, 10}}}, out);
  const SeqId b = *s->fork_sequence(a);
  EXPECT_EQ(s->free_blocks(), 1);
  const SeqSpan both[] = {{a, 10, 1}, {b, 10, 1}};
  EXPECT_EQ(*s->blocks_to_store(both), 1);
  // What store refuses, blocks_to_store refuses with store's error.
  const SeqSpan twice[] = {{a, 10, 1}, {a, 10, 1}};
  EXPECT_EQ(s->blocks_to_store(twice).error().code, ErrorCode::kInvalidArgument);
  const SeqSpan skips[] = {{a, 12, 1}};
  EXPECT_EQ(s->blocks_to_store(skips).error().code, ErrorCode::kCacheDiscontinuity);
  const SeqSpan empty[] = {{a, 10, 0}};
  EXPECT_EQ(s->blocks_to_store(empty).error().code, ErrorCode::kInvalidArgument);
  const SeqSpan past[] = {{a, 10, 55}};
  EXPECT_EQ(s->blocks_to_store(past).error().code, ErrorCode::kCapacityExceeded);
  const SeqSpan gone[] = {{SeqId{0x7777}, 0, 1}};
  EXPECT_EQ(s->blocks_to_store(gone).error().code, ErrorCode::kNotFound);
  run_batch(*s, {{1, SeqSpan{a, 10, 1}}, {2, SeqSpan{b, 10, 1}}}, out);
  EXPECT_EQ(s->free_blocks(), 0);
  run_batch(*s, {{2, SeqSpan{b, 11, 3}}, {1, SeqSpan{a, 11, 4}}}, out);
  Outputs solo;
  std::vector<std::uint16_t> a_bytes;
  run_solo(c, {}, 1, 15, solo, a_bytes);
  EXPECT_EQ(live_bytes(*s, a), a_bytes);
  auto t = cpu_store(c, {});
  const SeqId u = *t->add_sequence();
  Outputs solo_b;
  run_batch(*t, {{1, SeqSpan{u, 0, 10}}}, solo_b);
  run_batch(*t, {{2, SeqSpan{u, 10, 4}}}, solo_b);
  EXPECT_EQ(live_bytes(*s, b), live_bytes(*t, u));
  for (std::int64_t p = 10; p < 14; ++p) EXPECT_EQ((out[{2, 3, p}]), (solo_b[{2, 3, p}]));

  // From different positions (a fork rolled back): the furthest keeps the
  // block. With a third holder that does not write, both writers copy.
  auto r = cpu_store(c, {.max_sequences = 3});
  const SeqId x = *r->add_sequence();
  run_batch(*r, {{1, SeqSpan{x, 0, 10}}}, out);
  const SeqId y = *r->fork_sequence(x);
  ASSERT_TRUE(r->truncate_sequence(y, 4).ok());
  const SeqSpan apart[] = {{y, 6, 2}, {x, 10, 1}};
  EXPECT_EQ(*r->blocks_to_store(apart), 1);
  const SeqId z = *r->fork_sequence(x);
  EXPECT_EQ(*r->blocks_to_store(apart), 2);
  const std::int64_t free_before = r->free_blocks();
  run_batch(*r, {{2, SeqSpan{y, 6, 2}}, {1, SeqSpan{x, 10, 1}}}, out);
  EXPECT_EQ(r->free_blocks(), free_before - 2);
  std::vector<std::uint16_t> x_solo, z_solo;
  run_solo(c, {}, 1, 11, solo, x_solo);
  run_solo(c, {}, 1, 10, solo, z_solo);
  EXPECT_EQ(live_bytes(*r, x), x_solo);
  EXPECT_EQ(live_bytes(*r, z), z_solo);
}

// Many forks of one sequence writing their shared block in one call: all
// but one copy it (first_block_copies decides in one pass over the batch),
// blocks_to_store says so, and a fork and the source each hold a solo
// run's bytes.
TEST(Store, ManyForksWritingTheirSharedBlockTogether) {
  const ModelConfig c = small_config(/*window=*/32, /*max_context=*/64, /*n_layers=*/4);
  constexpr std::int64_t kForks = 1500;
  auto s = cpu_store(c, {.max_sequences = kForks + 1});
  const SeqId a = *s->add_sequence();
  Outputs out;
  run_batch(*s, {{1, SeqSpan{a, 0, 10}}}, out);
  std::vector<SeqId> ids{a};
  for (std::int64_t i = 0; i < kForks; ++i) ids.push_back(*s->fork_sequence(a));
  std::vector<SeqSpan> spans;
  std::vector<std::pair<std::uint64_t, SeqSpan>> batch;
  for (const SeqId id : ids) {
    spans.push_back({id, 10, 1});
    batch.push_back({1, SeqSpan{id, 10, 1}});
  }
  EXPECT_EQ(*s->blocks_to_store(spans), kForks);
  const std::int64_t free_before = s->free_blocks();
  run_batch(*s, batch, out);
  EXPECT_EQ(s->free_blocks(), free_before - kForks);
  Outputs solo;
  std::vector<std::uint16_t> bytes;
  run_solo(c, {}, 1, 11, solo, bytes);
  EXPECT_EQ(live_bytes(*s, a), bytes);
  EXPECT_EQ(live_bytes(*s, ids[kForks / 2]), bytes);
  EXPECT_EQ(live_bytes(*s, ids.back()), bytes);
}

TEST(Store, ARefusedBatchChangesNoSequence) {
  const ModelConfig c = small_config();
  auto s = cpu_store(c, {.max_sequences = 3, .block_rows = 16});
  const SeqId a = *s->add_sequence(), b = *s->add_sequence(), d = *s->add_sequence();
  Outputs out;
  run_batch(*s, {{1, SeqSpan{a, 0, 20}}, {2, SeqSpan{b, 0, 5}}, {3, SeqSpan{d, 0, 9}}}, out);
  const auto ia = live_bytes(*s, a), ib = live_bytes(*s, b), id = live_bytes(*s, d);
  const std::int64_t free_before = s->free_blocks();
  const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim;
  std::vector<float> k(static_cast<std::size_t>(3 * kv), 0.25f), q(static_cast<std::size_t>(3 * width), 0.5f),
      o(q.size());
  // The third span skips a position: every batched call names its sequence.
  const SeqSpan bad[] = {{a, 20, 1}, {b, 5, 1}, {d, 10, 1}};
  auto st = s->store(3, bad, host_view(k.data(), 3, kv), host_view(k.data(), 3, kv));
  EXPECT_EQ(st.error().code, ErrorCode::kCacheDiscontinuity);
  EXPECT_NE(st.error().message.find(seq_name(d) + ": layer 3: expected position 9, got 10"), std::string::npos)
      << st.to_string();
  st = s->store_all_layers(bad, host_view(k.data(), 3, kv), host_view(k.data(), 3, kv));
  EXPECT_FALSE(st.ok());
  st = s->prefill(3, bad, host_view(k.data(), 3, kv), host_view(k.data(), 3, kv),
                  host_view(q.data(), 3, width), host_view(o.data(), 3, width));
  EXPECT_EQ(st.error().code, ErrorCode::kCacheDiscontinuity);
  EXPECT_NE(st.error().message.find(seq_name(d) + ": "), std::string::npos) << st.to_string();
  // A sequence twice in one store batch, named.
  const SeqSpan twice[] = {{b, 5, 1}, {a, 20, 1}, {a, 21, 1}};
  st = s->store(3, twice, host_view(k.data(), 3, kv), host_view(k.data(), 3, kv));
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.error().message.find(seq_name(a) + " appears more than once"), std::string::npos) << st.to_string();
  // A decode whose rows are not stored.
  const SeqQuery ahead[] = {{a, 19}, {b, 5}};
  EXPECT_FALSE(s->attend_decode(3, ahead, host_view(q.data(), 2, width), host_view(o.data(), 2, width)).ok());
  EXPECT_EQ(live_bytes(*s, a), ia);
  EXPECT_EQ(live_bytes(*s, b), ib);
  EXPECT_EQ(live_bytes(*s, d), id);
  EXPECT_EQ(s->free_blocks(), free_before);
}

// The CPU backend standing in for a device that fails on demand: row
// writes fail while `fail_writes` (before writing, or after when
// `fail_after_writing`), mirror updates while `fail_mirror`.
class FailingStore : public CpuStore {
 public:
  using CpuStore::CpuStore;
  bool fail_writes = false;
  bool fail_after_writing = false;
  bool fail_mirror = false;
  std::int64_t fail_copy_at_layer = -1;  // a ring copy of this layer fails, after those before it
  bool fail_copy_in = false;             // row copies write their K rows, then fail

 protected:
  Status write_rows(std::span<const TableChange> changes, std::span<const RowWrite> writes,
                    const ConstView& k, const ConstView& v, cudaStream_t stream) override {
    if (fail_writes && !fail_after_writing) return make_error(ErrorCode::kCuda, "row writes failed (injected)");
    Status s = CpuStore::write_rows(changes, writes, k, v, stream);
    if (fail_writes) return make_error(ErrorCode::kCuda, "row writes failed after landing (injected)");
    return s;
  }
  Status tables_changed(std::span<const TableChange> changes, cudaStream_t stream) override {
    if (fail_mirror) return make_error(ErrorCode::kCuda, "the table upload failed (injected)");
    return CpuStore::tables_changed(changes, stream);
  }
  Status set_ring_rows(std::span<const RingRows> rows, cudaStream_t stream) override {
    for (std::size_t i = 0; i < rows.size(); ++i)
      if (rows[i].from >= 0 && rows[i].layer == fail_copy_at_layer) {
        KVRING_RETURN_IF_ERROR(CpuStore::set_ring_rows(rows.first(i), stream));
        return make_error(ErrorCode::kCuda, "the ring copy failed (injected)");
      }
    return CpuStore::set_ring_rows(rows, stream);
  }
  Status copy_in(const PlaneRef& plane, const LiveSpans& spans, const std::uint16_t* k, const std::uint16_t* v,
                 MemorySpace space, cudaStream_t stream) override {
    if (!fail_copy_in) return CpuStore::copy_in(plane, spans, k, v, space, stream);
    std::int64_t rows = 0;
    for (int i = 0; i < spans.n_spans; ++i) rows += spans.spans[static_cast<std::size_t>(i)].rows;
    std::vector<std::uint16_t> old_k(static_cast<std::size_t>(rows * config_.kv_dim())), old_v(old_k.size());
    KVRING_RETURN_IF_ERROR(copy_out(plane, spans, old_k.data(), old_v.data(), space, stream));
    KVRING_RETURN_IF_ERROR(CpuStore::copy_in(plane, spans, k, old_v.data(), space, stream));
    return make_error(ErrorCode::kCuda, "the row copy failed after its K rows (injected)");
  }
};

// An install_rows that fails part-way may have replaced some rows of an
// earlier install (here K, not V): those rows count as unwritten, so the
// sequence cannot be attached with them, until they are written again.
TEST(Store, InstallRowsThatFailPartWayCountAsUnwritten) {
  const ModelConfig c = small_config();
  const StoreOptions o = *resolve_store_options(c, {.max_sequences = 2, .block_rows = 16});
  FailingStore s(c, o);
  ASSERT_TRUE(s.allocate().ok());
  const SeqId a = *s.add_sequence();
  Outputs out;
  run_batch(s, {{1, SeqSpan{a, 0, 20}}}, out);
  auto snap = take_snapshot(s, a);
  ASSERT_TRUE(snap.ok());
  const SeqId d = *s.add_detached_sequence();
  const std::int64_t kv = c.kv_dim();
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    auto ring = restore_ring(*snap, l, s);
    ASSERT_TRUE(ring.ok());
    ASSERT_TRUE(s.install_plane(d, l, *ring).ok());
    const PlaneSnapshot& p = snap->planes[static_cast<std::size_t>(l)];
    ASSERT_TRUE(s.install_rows(d, l, ring->origin_logical(), ring->len(), p.k.data(), p.v.data()).ok());
  }
  // Layer 0's rows 4..7 again, from other bytes, failing half-way.
  const PlaneSnapshot& p0 = snap->planes[0];
  std::vector<std::uint16_t> other(static_cast<std::size_t>(4 * kv), 0x3c00);
  const auto at = static_cast<std::size_t>((4 - p0.ring.origin_logical()) * kv);
  s.fail_copy_in = true;
  EXPECT_EQ(s.install_rows(d, 0, 4, 4, other.data(), other.data()).error().code, ErrorCode::kCuda);
  s.fail_copy_in = false;
  const Status early = s.attach_sequence(d);
  ASSERT_FALSE(early.ok());
  EXPECT_EQ(early.error().code, ErrorCode::kInvalidArgument);
  EXPECT_TRUE(s.is_detached(d));
  // Written again, the rows are whole and the sequence attaches as a copy.
  ASSERT_TRUE(s.install_rows(d, 0, 4, 4, p0.k.data() + at, p0.v.data() + at).ok());
  ASSERT_TRUE(s.attach_sequence(d).ok());
  EXPECT_EQ(live_bytes(s, d), live_bytes(s, a));
}

// The CPU backend, recording the extent each view check is given (the
// bytes from a view's first element to its last row's end), and refusing
// any view longer than `limit` as a backend that knows its memory would.
class ExtentStore : public CpuStore {
 public:
  using CpuStore::CpuStore;
  std::map<std::string, std::uint64_t> seen;
  std::uint64_t limit = std::numeric_limits<std::uint64_t>::max();

 protected:
  Status check_view(const char* what, MemorySpace space, DType dtype, const void* data,
                    std::uint64_t bytes) const override {
    const_cast<ExtentStore*>(this)->seen[what] = bytes;
    if (bytes > limit) return invalid_argument(std::string(what) + " runs past its memory (test)");
    return CpuStore::check_view(what, space, dtype, data, bytes);
  }
};

// Every call that takes caller memory hands the backend each view's extent
// before it changes anything: strided and 16-bit views, row buffers, and a
// count no memory holds (saturated, not wrapped). A backend that refuses
// there leaves the store as it was.
TEST(Store, EveryViewsExtentReachesTheBackendsCheck) {
  const ModelConfig c = small_config();
  const StoreOptions o = *resolve_store_options(c, {.max_sequences = 3, .slack = 4, .block_rows = 16});
  ExtentStore s(c, o);
  ASSERT_TRUE(s.allocate().ok());
  const SeqId a = *s.add_sequence();
  Outputs out;
  run_batch(s, {{1, SeqSpan{a, 0, 20}}}, out);
  const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim, full = 3;
  ASSERT_EQ(c.kind(full), LayerKind::kFullNope);
  const std::int64_t n = 5, stride = kv + 3;
  std::vector<float> k(static_cast<std::size_t>(n * stride)), v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = 0.25f * static_cast<float>(i % 13) - 1.0f;
    v[i] = 0.5f - 0.125f * static_cast<float>(i % 7);
  }
  std::vector<std::uint16_t> k16(static_cast<std::size_t>(n * kv), 0x3c00);
  const ConstView ks{k.data(), MemorySpace::kHost, DType::kF32, n, kv, stride};
  const ConstView vs{k16.data(), MemorySpace::kHost, DType::kBF16, n, kv, kv};
  const SeqSpan span{a, 20, n};
  ASSERT_TRUE(s.store(full, std::span(&span, 1), ks, vs).ok());
  EXPECT_EQ(s.seen["k"], static_cast<std::uint64_t>(((n - 1) * stride + kv) * 4));
  EXPECT_EQ(s.seen["v"], static_cast<std::uint64_t>(n * kv * 2));

  std::vector<float> q(static_cast<std::size_t>(n * 3 * width)), o1(q.size());
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = 0.01f * static_cast<float>(i % 17);
  const SeqQuery last{a, 24};
  ASSERT_TRUE(s.attend_decode(full, {&last, 1}, ConstView{q.data(), MemorySpace::kHost, DType::kF32, 1, width, 2 * width},
                              MutView{o1.data(), MemorySpace::kHost, DType::kF32, 1, width, 3 * width})
                  .ok());
  EXPECT_EQ(s.seen["q"], static_cast<std::uint64_t>(width * 4));
  EXPECT_EQ(s.seen["out"], static_cast<std::uint64_t>(width * 4));

  std::vector<std::uint16_t> rk(static_cast<std::size_t>(25 * kv)), rv(rk.size());
  ASSERT_TRUE(s.read_rows(a, full, 0, 25, rk.data(), rv.data()).ok());
  EXPECT_EQ(s.seen["k"], static_cast<std::uint64_t>(25 * kv * 2));
  EXPECT_EQ(s.seen["v"], static_cast<std::uint64_t>(25 * kv * 2));
  // A count no memory holds is refused, its extent saturated on the way.
  EXPECT_FALSE(s.read_rows(a, full, 0, std::numeric_limits<std::int64_t>::max() / 2, rk.data(), rv.data()).ok());
  EXPECT_EQ(s.seen["k"], std::numeric_limits<std::uint64_t>::max());

  const RingState ring = *s.ring(a, full);
  const SeqId d = *s.add_detached_sequence();
  ASSERT_TRUE(s.install(d, full, ring, rk.data(), rv.data()).ok());
  EXPECT_EQ(s.seen["k"], static_cast<std::uint64_t>(ring.len() * kv * 2));
  ASSERT_TRUE(s.install_rows(d, full, 3, 7, rk.data(), rv.data()).ok());
  EXPECT_EQ(s.seen["v"], static_cast<std::uint64_t>(7 * kv * 2));

  // A backend that refuses a view past its memory: every call fails at
  // the check and nothing changes.
  const auto before = live_bytes(s, a);
  const std::int64_t free_before = s.free_blocks();
  s.limit = static_cast<std::uint64_t>(kv * 4);
  const SeqSpan more{a, 25, n};
  EXPECT_EQ(s.store(full, std::span(&more, 1), ks, ks).error().code, ErrorCode::kInvalidArgument);
  EXPECT_EQ(s.prefill(full, std::span(&more, 1), ks, ks, host_view(q.data(), n, width),
                      host_view(o1.data(), n, width))
                .error()
                .code,
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(s.read_rows(a, full, 0, 25, rk.data(), rv.data()).error().code, ErrorCode::kInvalidArgument);
  s.limit = std::numeric_limits<std::uint64_t>::max();
  EXPECT_EQ(live_bytes(s, a), before);
  EXPECT_EQ(s.free_blocks(), free_before);
  EXPECT_EQ(s.ring(a, full)->next_position(), 25);
}

TEST(Store, ASequenceWhoseDeviceTablesCannotBeRestoredIsRefusedUntilReset) {
  const ModelConfig c = small_config();
  const StoreOptions o = *resolve_store_options(c, {.max_sequences = 3, .slack = 4, .block_rows = 16});
  FailingStore s(c, o);
  ASSERT_TRUE(s.allocate().ok());
  const SeqId a = *s.add_sequence(), b = *s.add_sequence(), d = *s.add_sequence();
  Outputs out;
  // 32 tokens fill two blocks of each full plane: the next token takes a
  // new block, so its store changes (and mirrors) a table.
  run_batch(s, {{1, SeqSpan{a, 0, 32}}, {2, SeqSpan{b, 0, 32}}, {3, SeqSpan{d, 0, 32}}}, out);
  const auto ia = live_bytes(s, a);
  const std::int64_t free_before = s.free_blocks();
  const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim;
  const Rows r = rows_for(c, 1, 0, 32, 1);
  Rows all;  // a's token 32 for every layer, for store_all_layers
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    const Rows rl = rows_for(c, 1, l, 32, 1);
    all.k.insert(all.k.end(), rl.k.begin(), rl.k.end());
    all.v.insert(all.v.end(), rl.v.begin(), rl.v.end());
  }
  const auto kview = host_view(all.k.data(), c.n_layers, kv), vview = host_view(all.v.data(), c.n_layers, kv);
  std::vector<float> o1(static_cast<std::size_t>(width));
  const SeqSpan next_a{a, 32, 1};

  // A failed write whose undo reaches the mirror: the call fails, nothing
  // changed, and the sequence stays usable.
  s.fail_writes = true;
  EXPECT_EQ(s.store_all_layers(std::span(&next_a, 1), kview, vview).error().code, ErrorCode::kCuda);
  s.fail_writes = false;
  EXPECT_EQ(live_bytes(s, a), ia);
  EXPECT_EQ(s.free_blocks(), free_before);
  ASSERT_TRUE(s.store_all_layers(std::span(&next_a, 1), kview, vview).ok());
  ASSERT_TRUE(s.truncate_sequence(a, 1).ok());

  // A failed write whose undo cannot reach the mirror: the host's tables
  // and the pool are restored, and the sequence is refused.
  s.fail_writes = true;
  s.fail_mirror = true;
  EXPECT_EQ(s.store_all_layers(std::span(&next_a, 1), kview, vview).error().code, ErrorCode::kCuda);
  s.fail_writes = false;
  s.fail_mirror = false;
  EXPECT_EQ(s.free_blocks(), free_before);
  const SeqQuery qa{a, 31};
  std::vector<std::uint16_t> rk(static_cast<std::size_t>(kv)), rv(rk.size());
  for (const Status& st :
       {s.store_all_layers(std::span(&next_a, 1), kview, vview),
        s.attend_decode(1, std::span(&qa, 1), host_view(r.q.data(), 1, width), host_view(o1.data(), 1, width)),
        s.read_rows(a, 1, 0, 1, rk.data(), rv.data()), s.fork_sequence(a).status(),
        s.truncate_sequence(a, 1)}) {
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.error().code, ErrorCode::kCuda);
    EXPECT_NE(st.error().message.find("reset or remove it"), std::string::npos) << st.to_string();
  }
  // A batch naming it is refused whole; its position is still known.
  const SeqSpan both[] = {{b, 32, 1}, next_a};
  const Rows r2 = rows_for(c, 2, 0, 32, 2);
  EXPECT_FALSE(s.store(0, both, host_view(r2.k.data(), 2, kv), host_view(r2.v.data(), 2, kv)).ok());
  EXPECT_EQ(*s.next_position(a), 32);
  EXPECT_EQ(*s.next_position(b), 32);
  EXPECT_TRUE(s.contains(a));

  // The other sequences go on, bit for bit as if alone.
  for (std::int64_t p = 32; p < 40; ++p) run_batch(s, {{2, SeqSpan{b, p, 1}}}, out);
  Outputs solo;
  std::vector<std::uint16_t> b_bytes;
  run_solo(c, o, 2, 40, solo, b_bytes);
  EXPECT_EQ(live_bytes(s, b), b_bytes);

  // A prefill whose table change cannot be mirrored, nor undone: refused.
  std::int64_t full = 0;
  while (c.kind(full) != LayerKind::kFullNope) ++full;
  s.fail_mirror = true;
  const Rows rd = rows_for(c, 3, full, 32, 1);
  std::vector<float> od(static_cast<std::size_t>(width));
  const SeqSpan next_d{d, 32, 1};
  const Status pd = s.prefill(full, std::span(&next_d, 1), host_view(rd.k.data(), 1, kv), host_view(rd.v.data(), 1, kv),
                              host_view(rd.q.data(), 1, width), host_view(od.data(), 1, width));
  s.fail_mirror = false;
  EXPECT_EQ(pd.error().code, ErrorCode::kCuda);
  EXPECT_EQ(s.read_rows(d, 0, 0, 1, rk.data(), rv.data()).error().code, ErrorCode::kCuda);

  // Reset ends it: the sequence starts again from position 0.
  ASSERT_TRUE(s.reset_sequence(a).ok());
  run_batch(s, {{1, SeqSpan{a, 0, 40}}}, out);
  std::vector<std::uint16_t> a_bytes;
  run_solo(c, o, 1, 40, solo, a_bytes);
  EXPECT_EQ(live_bytes(s, a), a_bytes);
  // So does removal: the slot's next sequence is usable.
  ASSERT_TRUE(s.remove_sequence(d).ok());
  const SeqId e = *s.add_sequence();
  run_batch(s, {{4, SeqSpan{e, 0, 33}}}, out);
  EXPECT_EQ(*s.next_position(e), 33);

  // An install that fails to mirror its table leaves its plane empty, which
  // reads no mirror entry: the sequence is not stale, and a second install
  // takes.
  ASSERT_TRUE(s.remove_sequence(e).ok());
  const SeqId f = *s.add_detached_sequence();
  const RingState plane = *RingState::sequential(s.capacity(full), false, 40);
  const std::int64_t free_then = s.free_blocks();
  s.fail_mirror = true;
  EXPECT_EQ(s.install_plane(f, full, plane).error().code, ErrorCode::kCuda);
  s.fail_mirror = false;
  EXPECT_EQ(s.ring(f, full)->len(), 0);
  EXPECT_EQ(s.free_blocks(), free_then);
  ASSERT_TRUE(s.install_plane(f, full, plane).ok());
  EXPECT_EQ(s.ring(f, full)->len(), 40);
}

// A device that fails after its rows landed in a full sliding ring: the new
// rows took the slots of the oldest live ones, so the ring state that goes
// back would name rows that are gone. Those sequences are refused until
// reset; a sequence whose rings had room, in the same failed batch, is not,
// nor is any sequence after a failure before the rows were written.
TEST(Store, ASequenceThatLostRowsToAFailedWriteIsRefusedUntilReset) {
  const ModelConfig c = small_config();  // window 32, slack 4: sliding rings of 36
  const StoreOptions o = *resolve_store_options(c, {.max_sequences = 2, .slack = 4, .block_rows = 16});
  FailingStore s(c, o);
  ASSERT_TRUE(s.allocate().ok());
  const SeqId a = *s.add_sequence(), b = *s.add_sequence();
  Outputs out;
  run_batch(s, {{1, SeqSpan{a, 0, 40}}, {2, SeqSpan{b, 0, 20}}}, out);  // a's rings wrapped, b's not
  const auto ib = live_bytes(s, b);
  const std::int64_t kv = c.kv_dim(), free_before = s.free_blocks();
  Rows all;
  for (std::int64_t l = 0; l < c.n_layers; ++l)
    for (const auto& [seed, pos] : {std::pair<int, std::int64_t>{1, 40}, {2, 20}}) {
      const Rows rl = rows_for(c, seed, l, pos, 1);
      all.k.insert(all.k.end(), rl.k.begin(), rl.k.end());
      all.v.insert(all.v.end(), rl.v.begin(), rl.v.end());
    }
  const SeqSpan next[] = {{a, 40, 1}, {b, 20, 1}};
  // A device error before any row was written (an allocation, an upload)
  // takes no row: the call fails and both sequences go on as they were.
  const auto ia = live_bytes(s, a);
  s.fail_writes = true;
  const Status early = s.store_all_layers(next, host_view(all.k.data(), 2 * c.n_layers, kv),
                                          host_view(all.v.data(), 2 * c.n_layers, kv));
  ASSERT_FALSE(early.ok());
  EXPECT_EQ(early.error().code, ErrorCode::kCuda);
  EXPECT_EQ(live_bytes(s, a), ia);
  EXPECT_EQ(live_bytes(s, b), ib);
  EXPECT_EQ(s.free_blocks(), free_before);
  EXPECT_EQ(*s.next_position(a), 40);
  // Now the device fails after the rows landed.
  s.fail_after_writing = true;
  const Status failed = s.store_all_layers(next, host_view(all.k.data(), 2 * c.n_layers, kv),
                                           host_view(all.v.data(), 2 * c.n_layers, kv));
  s.fail_writes = false;
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.error().code, ErrorCode::kCuda);
  EXPECT_EQ(s.free_blocks(), free_before);
  std::vector<std::uint16_t> rk(static_cast<std::size_t>(kv)), rv(rk.size());
  const Status read = s.read_rows(a, 0, 39, 1, rk.data(), rv.data());
  ASSERT_FALSE(read.ok());
  EXPECT_EQ(read.error().code, ErrorCode::kCuda);
  EXPECT_NE(read.error().message.find("lost live rows of a full sliding ring"), std::string::npos) << read.to_string();
  EXPECT_EQ(s.truncate_sequence(a, 4).error().code, ErrorCode::kCuda);
  EXPECT_EQ(*s.next_position(a), 40);
  // b's rings had room: its rows are as they were, and it goes on.
  EXPECT_EQ(live_bytes(s, b), ib);
  run_batch(s, {{2, SeqSpan{b, 20, 5}}}, out);
  Outputs solo;
  std::vector<std::uint16_t> b_bytes;
  run_solo(c, o, 2, 25, solo, b_bytes);
  EXPECT_EQ(live_bytes(s, b), b_bytes);
  // Reset ends it.
  ASSERT_TRUE(s.reset_sequence(a).ok());
  run_batch(s, {{1, SeqSpan{a, 0, 40}}}, out);
  std::vector<std::uint16_t> a_bytes;
  run_solo(c, o, 1, 40, solo, a_bytes);
  EXPECT_EQ(live_bytes(s, a), a_bytes);
}

// A fork whose ring copies fail part-way has written the source's rows into
// a free slot: the next sequence added there starts from zeros all the
// same (zero_fill), not from another sequence's rows.
TEST(Store, AFailedForkLeavesNoRowsToTheNextSequence) {
  const ModelConfig c = small_config();
  const StoreOptions o = *resolve_store_options(c, {.max_sequences = 2, .slack = 4, .block_rows = 16});
  ASSERT_TRUE(o.zero_fill);
  FailingStore s(c, o);
  ASSERT_TRUE(s.allocate().ok());
  const SeqId a = *s.add_sequence();
  Outputs out;
  run_batch(s, {{1, SeqSpan{a, 0, 10}}}, out);
  ASSERT_EQ(c.kind(0), LayerKind::kSlidingRope);
  s.fail_copy_at_layer = 1;  // layer 0's ring is copied first
  const auto fork = s.fork_sequence(a);
  s.fail_copy_at_layer = -1;
  ASSERT_FALSE(fork.ok());
  EXPECT_EQ(fork.error().code, ErrorCode::kCuda);
  const SeqId b = *s.add_sequence();
  const std::size_t n = static_cast<std::size_t>(s.capacity(0) * c.kv_dim());
  std::vector<std::uint16_t> k(n, 1), v(n, 1);
  ASSERT_TRUE(s.read_plane(b, 0, k.data(), v.data()).ok());
  EXPECT_EQ(std::count(k.begin(), k.end(), 0), static_cast<std::ptrdiff_t>(n));
  EXPECT_EQ(std::count(v.begin(), v.end(), 0), static_cast<std::ptrdiff_t>(n));
}

// A fork whose table mirror fails gives back the slot and the blocks it
// took, and its handle, which never left the store: the next sequence added
// gets the handle it would have had without the failed fork. So does a
// restore into a new sequence whose rows fail to land.
TEST(Store, AFailedForkOrRestoreLeavesTheNextHandleAsItWas) {
  const ModelConfig c = small_config();
  const StoreOptions o = *resolve_store_options(c, {.max_sequences = 2, .slack = 4, .block_rows = 16});
  auto filled = [&](FailingStore& s) {
    EXPECT_TRUE(s.allocate().ok());
    const SeqId a = *s.add_sequence();
    Outputs out;
    run_batch(s, {{1, SeqSpan{a, 0, 40}}}, out);
    return a;
  };
  FailingStore twin(c, o);
  (void)filled(twin);
  const std::string next_name = seq_name(*twin.add_sequence());

  FailingStore s(c, o);
  const SeqId a = filled(s);
  const std::int64_t free_blocks = s.free_blocks(), free_slots = s.free_slots();
  s.fail_mirror = true;
  const auto fork = s.fork_sequence(a);
  s.fail_mirror = false;
  ASSERT_FALSE(fork.ok());
  EXPECT_EQ(fork.error().code, ErrorCode::kCuda);
  EXPECT_EQ(s.free_blocks(), free_blocks);
  EXPECT_EQ(s.free_slots(), free_slots);
  EXPECT_EQ(s.sequence_count(), 1);
  auto snap = take_snapshot(s, a);
  ASSERT_TRUE(snap.ok());
  s.fail_copy_in = true;
  const auto restored = restore_new_sequence(*snap, s);
  s.fail_copy_in = false;
  ASSERT_FALSE(restored.ok());
  EXPECT_EQ(restored.error().code, ErrorCode::kCuda);
  EXPECT_EQ(s.free_blocks(), free_blocks);
  EXPECT_EQ(s.sequence_count(), 1);
  EXPECT_EQ(seq_name(*s.add_sequence()), next_name);
}

// The resident pages of this process.
std::int64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * ::sysconf(_SC_PAGESIZE);
}

// An install of a partial sliding ring leaves the rows it does not write
// zero: a ring some sequence wrote into is cleared first (zero_fill off,
// so nothing else cleared it), and a ring that holds only zeros is left
// untouched, so a fresh store's pages stay unmapped (a handoff's fresh
// store receiving a header that claims large rings, and few rows).
TEST(Store, PartialInstallsClearOnlyWrittenRings) {
  const ModelConfig c = small_config(65536, 65536, 2, 8, 8, 64);  // layer 0: a 65536-row ring
  ASSERT_EQ(c.kind(0), LayerKind::kSlidingRope);
  auto s = cpu_store(c, {.max_sequences = 1, .zero_fill = false});
  const std::int64_t kv = c.kv_dim(), cap = s->capacity(0);
  const std::int64_t ring_bytes = cap * kv * 2 * 2;  // K and V of one layer
  ASSERT_GE(ring_bytes, std::int64_t{128} << 20);
  const std::vector<std::uint16_t> rows(static_cast<std::size_t>(5 * kv), 0x3c00);  // 1.0
  const RingState five = *RingState::sequential(cap, true, 5);
  // Both layers (sliding) take the five rows, so that the sequence attaches.
  ASSERT_EQ(c.kind(1), LayerKind::kSlidingRope);
  auto install_whole = [&](SeqId seq) {
    for (std::int64_t l : {0, 1}) ASSERT_TRUE(s->install(seq, l, five, rows.data(), rows.data()).ok());
    ASSERT_TRUE(s->attach_sequence(seq).ok());
  };

  const std::int64_t before = resident_bytes();
  const SeqId fresh = *s->add_detached_sequence();
  install_whole(fresh);
  // Five rows' pages (huge pages, where the kernel grants them) of K and V.
  EXPECT_LT(resident_bytes() - before, ring_bytes / 8) << "the fresh rings were written over";
  std::vector<std::uint16_t> k(static_cast<std::size_t>(cap * kv), 7), v(k.size(), 7);
  ASSERT_TRUE(s->read_plane(fresh, 0, k.data(), v.data()).ok());
  EXPECT_EQ(std::count(k.begin(), k.end(), 0x3c00), 5 * kv);
  EXPECT_EQ(std::count(k.begin(), k.end(), 0), static_cast<std::ptrdiff_t>(k.size()) - 5 * kv);
  ASSERT_TRUE(s->remove_sequence(fresh).ok());

  // In a fresh store, a sequence writes 40 rows into the slot's ring (a
  // store, or a prefill); the next sequence's partial install must not
  // show them.
  for (const bool prefill : {false, true}) {
    SCOPED_TRACE(prefill ? "prefill" : "store");
    s = cpu_store(c, {.max_sequences = 1, .zero_fill = false});
    const SeqId a = *s->add_sequence();
    const std::int64_t width = c.n_heads * c.head_dim;
    const std::vector<float> forty(static_cast<std::size_t>(40 * kv), 0.5f),
        q(static_cast<std::size_t>(40 * width), 0.25f);
    std::vector<float> out(q.size());
    const SeqSpan span{a, 0, 40};
    const ConstView kv40 = host_view(forty.data(), 40, kv);
    ASSERT_TRUE((prefill ? s->prefill(0, {&span, 1}, kv40, kv40, host_view(q.data(), 40, width),
                                      host_view(out.data(), 40, width))
                         : s->store(0, {&span, 1}, kv40, kv40))
                    .ok());
    ASSERT_TRUE(s->remove_sequence(a).ok());
    const SeqId b = *s->add_detached_sequence();
    install_whole(b);
    ASSERT_TRUE(s->read_plane(b, 0, k.data(), v.data()).ok());
    EXPECT_EQ(std::count(k.begin(), k.end(), 0x3c00), 5 * kv);
    EXPECT_EQ(std::count(k.begin(), k.end(), 0), static_cast<std::ptrdiff_t>(k.size()) - 5 * kv);
    EXPECT_EQ(std::count(v.begin(), v.end(), 0), static_cast<std::ptrdiff_t>(v.size()) - 5 * kv);
  }
}

TEST(Store, ViewsAreCheckedAndReadInPlace) {
  const ModelConfig c = small_config();
  auto s = cpu_store(c, {.max_sequences = 2, .block_rows = 16});
  const SeqId a = *s->add_sequence(), b = *s->add_sequence();
  const std::int64_t kv = c.kv_dim();
  std::vector<float> k = testing::random_floats(static_cast<std::size_t>(2 * kv), 5),
                     v = testing::random_floats(k.size(), 6);
  const SeqSpan one{a, 0, 1};
  // Wrong shapes, strides, null data, device memory, f32-only outputs.
  EXPECT_FALSE(s->store(0, {&one, 1}, host_view(k.data(), 2, kv), host_view(v.data(), 1, kv)).ok());
  EXPECT_FALSE(s->store(0, {&one, 1}, host_view(k.data(), 1, kv - 1), host_view(v.data(), 1, kv)).ok());
  EXPECT_FALSE(s->store(0, {&one, 1}, ConstView{k.data(), MemorySpace::kHost, DType::kF32, 1, kv, kv - 1},
                        host_view(v.data(), 1, kv)).ok());
  EXPECT_FALSE(s->store(0, {&one, 1}, ConstView{nullptr, MemorySpace::kHost, DType::kF32, 1, kv, kv},
                        host_view(v.data(), 1, kv)).ok());
  const Status dev = s->store(0, {&one, 1}, device_view(k.data(), 1, kv), host_view(v.data(), 1, kv));
  EXPECT_EQ(dev.error().code, ErrorCode::kUnsupported);
  EXPECT_FALSE(s->store(-1, {&one, 1}, host_view(k.data(), 1, kv), host_view(v.data(), 1, kv)).ok());
  EXPECT_EQ(*s->next_position(a), 0);

  // A strided f32 view (every other row of k), and f16 and bf16 inputs:
  // each stores the bits of its value rounded to f16 (nearest even).
  const ConstView strided{k.data(), MemorySpace::kHost, DType::kF32, 1, kv, 2 * kv};
  ASSERT_TRUE(s->store(0, {&one, 1}, strided, strided).ok());
  std::vector<std::uint16_t> h16(static_cast<std::size_t>(kv)), b16(h16.size());
  for (std::int64_t e = 0; e < kv; ++e) {
    h16[static_cast<std::size_t>(e)] = f32_to_f16(v[static_cast<std::size_t>(e)]);
    std::uint32_t u;
    std::memcpy(&u, &v[static_cast<std::size_t>(e)], 4);
    b16[static_cast<std::size_t>(e)] = static_cast<std::uint16_t>(u >> 16);
  }
  const SeqSpan one_b{b, 0, 1};
  ASSERT_TRUE(s->store(0, {&one_b, 1}, ConstView{h16.data(), MemorySpace::kHost, DType::kF16, 1, kv, kv},
                       ConstView{b16.data(), MemorySpace::kHost, DType::kBF16, 1, kv, kv}).ok());
  std::vector<std::uint16_t> rk(static_cast<std::size_t>(kv)), rv(rk.size());
  ASSERT_TRUE(s->read_rows(a, 0, 0, 1, rk.data(), rv.data()).ok());
  for (std::int64_t e = 0; e < kv; ++e)
    EXPECT_EQ(rk[static_cast<std::size_t>(e)], f32_to_f16(k[static_cast<std::size_t>(e)]));
  ASSERT_TRUE(s->read_rows(b, 0, 0, 1, rk.data(), rv.data()).ok());
  EXPECT_EQ(rk, h16);
  for (std::int64_t e = 0; e < kv; ++e) {
    std::uint32_t u = static_cast<std::uint32_t>(b16[static_cast<std::size_t>(e)]) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    EXPECT_EQ(rv[static_cast<std::size_t>(e)], f32_to_f16(f));
  }
  // Outputs must be f32.
  const std::int64_t width = c.n_heads * c.head_dim;
  std::vector<float> q = testing::random_floats(static_cast<std::size_t>(width), 7);
  std::vector<std::uint16_t> out16(static_cast<std::size_t>(width));
  const SeqQuery qa{a, 0};
  EXPECT_FALSE(s->attend_decode(0, {&qa, 1}, host_view(q.data(), 1, width),
                                MutView{out16.data(), MemorySpace::kHost, DType::kF16, 1, width, width}).ok());
}

// Views whose enums hold no named value, and outputs that overlap what the
// call reads, are refused and change nothing; out may be q itself.
// An engine's fused projection [rows, q | k | v] is read in place through
// column views of one row stride (host_view with a dtype and stride), and
// an output written into a slice of a wider buffer: the stored rows and
// the outputs are the bits of dense copies, and the columns around the
// output slice are left alone.
TEST(Store, AFusedProjectionIsReadThroughColumnViews) {
  const ModelConfig c = small_config();
  const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim, rows = 37;
  const std::int64_t fused = width + 2 * kv, out_stride = width + 5;
  const std::vector<float> qkv = testing::random_floats(static_cast<std::size_t>(rows * fused), 71);
  std::vector<float> q, k, v;
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* row = qkv.data() + r * fused;
    q.insert(q.end(), row, row + width);
    k.insert(k.end(), row + width, row + width + kv);
    v.insert(v.end(), row + width + kv, row + fused);
  }
  auto dense = cpu_store(c, {.max_sequences = 1, .block_rows = 16});
  auto fusedst = cpu_store(c, {.max_sequences = 1, .block_rows = 16});
  const SeqId a = *dense->add_sequence(), b = *fusedst->add_sequence();
  const float kPoison = -12345.0f;
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    const SeqSpan da{a, 0, rows}, db{b, 0, rows};
    std::vector<float> out(static_cast<std::size_t>(rows * width));
    std::vector<float> wide(static_cast<std::size_t>(rows * out_stride), kPoison);
    ASSERT_TRUE(dense->prefill(l, {&da, 1}, host_view(k.data(), rows, kv), host_view(v.data(), rows, kv),
                               host_view(q.data(), rows, width), host_view(out.data(), rows, width)).ok());
    const Status st = fusedst->prefill(
        l, {&db, 1}, host_view(qkv.data() + width, DType::kF32, rows, kv, fused),
        host_view(qkv.data() + width + kv, DType::kF32, rows, kv, fused),
        host_view(qkv.data(), DType::kF32, rows, width, fused),
        host_view(wide.data() + 2, DType::kF32, rows, width, out_stride));
    ASSERT_TRUE(st.ok()) << st.to_string();
    for (std::int64_t r = 0; r < rows; ++r) {
      const float* got = wide.data() + r * out_stride;
      EXPECT_EQ(got[0], kPoison);
      EXPECT_EQ(got[1], kPoison);
      EXPECT_EQ(std::memcmp(got + 2, out.data() + r * width, static_cast<std::size_t>(width) * 4), 0)
          << "layer " << l << " row " << r;
      for (std::int64_t e = 2 + width; e < out_stride; ++e) EXPECT_EQ(got[e], kPoison);
    }
    // The live rows: a sliding layer's ring holds the last of them.
    const std::int64_t live = dense->ring(a, l)->len();
    ASSERT_GT(live, 0);
    std::vector<std::uint16_t> ka(static_cast<std::size_t>(live * kv)), va(ka.size()), kb(ka.size()), vb(ka.size());
    ASSERT_TRUE(dense->read_rows(a, l, rows - live, live, ka.data(), va.data()).ok());
    ASSERT_TRUE(fusedst->read_rows(b, l, rows - live, live, kb.data(), vb.data()).ok());
    EXPECT_EQ(ka, kb);
    EXPECT_EQ(va, vb);
  }
}

// host_view(nullptr, ...) and device_view(nullptr, ...) name one function
// each (a MutView, which serves as a ConstView); a call with rows refuses
// the null view, and an empty batch takes it.
TEST(Store, NullViewsNameOneFunctionAndAreRefusedWithRows) {
  const MutView h = host_view(nullptr, 0, 8);
  EXPECT_TRUE(h.data == nullptr && h.space == MemorySpace::kHost && h.dtype == DType::kF32 && h.rows == 0 &&
              h.cols == 8 && h.row_stride == 8);
  const MutView d = device_view(nullptr, DType::kF16, 3, 8, 16);
  EXPECT_TRUE(d.data == nullptr && d.space == MemorySpace::kDevice && d.dtype == DType::kF16 && d.rows == 3 &&
              d.cols == 8 && d.row_stride == 16);
  EXPECT_EQ(host_view(nullptr, DType::kBF16, 2, 4, 4).dtype, DType::kBF16);
  EXPECT_EQ(device_view(nullptr, 1, 4).space, MemorySpace::kDevice);

  const ModelConfig c = small_config();
  auto s = cpu_store(c, {.max_sequences = 1});
  const SeqId a = *s->add_sequence();
  const std::int64_t kv = c.kv_dim();
  const SeqSpan one{a, 0, 1};
  for (const std::int64_t rows : {0, 1}) {
    const Status st = s->store(0, {&one, 1}, host_view(nullptr, rows, kv), host_view(nullptr, rows, kv));
    EXPECT_EQ(st.error().code, ErrorCode::kInvalidArgument) << st.to_string();
  }
  EXPECT_EQ(s->ring(a, 0)->next_position(), 0);
  // An empty batch takes a null view of no rows, as it takes any view of
  // no rows, and changes nothing.
  EXPECT_TRUE(s->store(0, {}, host_view(nullptr, 0, kv), host_view(nullptr, 0, kv)).ok());
  const std::int64_t width = c.n_heads * c.head_dim;
  EXPECT_TRUE(s->attend_decode(0, {}, host_view(nullptr, 0, width), host_view(nullptr, 0, width)).ok());
  EXPECT_EQ(s->ring(a, 0)->next_position(), 0);
}

TEST(Store, OddViewsAreRefused) {
  const ModelConfig c = small_config();
  auto s = cpu_store(c, {.max_sequences = 2, .block_rows = 16});
  const SeqId a = *s->add_sequence();
  const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim;
  Outputs out;
  run_batch(*s, {{1, SeqSpan{a, 0, 12}}}, out);
  const auto before = live_bytes(*s, a);
  std::vector<float> k = testing::random_floats(static_cast<std::size_t>(4 * std::max(kv, width)), 8);
  const SeqSpan next{a, 12, 1};
  const ConstView odd_dtype{k.data(), MemorySpace::kHost, static_cast<DType>(3), 1, kv, kv};
  EXPECT_EQ(s->store(0, {&next, 1}, odd_dtype, odd_dtype).error().code, ErrorCode::kInvalidArgument);
  const ConstView odd_space{k.data(), static_cast<MemorySpace>(7), DType::kF32, 1, kv, kv};
  EXPECT_EQ(s->store(0, {&next, 1}, odd_space, odd_space).error().code, ErrorCode::kInvalidArgument);

  // A prefill whose output lies on its K (it reads K again to store it).
  ASSERT_EQ(kv, width / 2);
  std::vector<float> q = testing::random_floats(static_cast<std::size_t>(width), 9);
  std::vector<float> buf = testing::random_floats(static_cast<std::size_t>(2 * width), 10);
  const Status on_k = s->prefill(0, {&next, 1}, host_view(buf.data(), 1, kv), host_view(k.data(), 1, kv),
                                 host_view(q.data(), 1, width), host_view(buf.data(), 1, width));
  EXPECT_EQ(on_k.error().code, ErrorCode::kInvalidArgument) << on_k.to_string();
  EXPECT_EQ(live_bytes(*s, a), before);

  // A decode whose output rows start a row into its queries.
  const SeqQuery two[] = {{a, 11}, {a, 10}};
  std::vector<float> qo = testing::random_floats(static_cast<std::size_t>(3 * width), 11);
  const Status shifted = s->attend_decode(0, two, host_view(qo.data(), 2, width), host_view(qo.data() + width, 2, width));
  EXPECT_EQ(shifted.error().code, ErrorCode::kInvalidArgument) << shifted.to_string();
  // out == q: the bits of separate buffers.
  std::vector<float> apart(static_cast<std::size_t>(2 * width));
  ASSERT_TRUE(s->attend_decode(0, two, host_view(qo.data(), 2, width), host_view(apart.data(), 2, width)).ok());
  ASSERT_TRUE(s->attend_decode(0, two, host_view(qo.data(), 2, width), host_view(qo.data(), 2, width)).ok());
  EXPECT_EQ(0, std::memcmp(apart.data(), qo.data(), apart.size() * 4));
  EXPECT_EQ(live_bytes(*s, a), before);

  // Queries and outputs side by side in the rows of one buffer, [q | out]
  // a row, share no byte: the bits of separate buffers. One column more
  // and each output row runs into the next query row.
  std::vector<float> rows = testing::random_floats(static_cast<std::size_t>(2 * 2 * width + 1), 12);
  const ConstView q_cols{rows.data(), MemorySpace::kHost, DType::kF32, 2, width, 2 * width};
  std::vector<float> q_apart(static_cast<std::size_t>(2 * width));
  for (std::size_t r = 0; r < 2; ++r)
    std::memcpy(q_apart.data() + r * width, rows.data() + r * 2 * width, static_cast<std::size_t>(width) * 4);
  ASSERT_TRUE(s->attend_decode(0, two, host_view(q_apart.data(), 2, width), host_view(apart.data(), 2, width)).ok());
  ASSERT_TRUE(
      s->attend_decode(0, two, q_cols, MutView{rows.data() + width, MemorySpace::kHost, DType::kF32, 2, width, 2 * width})
          .ok());
  for (std::size_t r = 0; r < 2; ++r)
    EXPECT_EQ(0, std::memcmp(apart.data() + r * width, rows.data() + r * 2 * width + width,
                             static_cast<std::size_t>(width) * 4));
  const Status into_next = s->attend_decode(
      0, two, q_cols, MutView{rows.data() + width + 1, MemorySpace::kHost, DType::kF32, 2, width, 2 * width});
  EXPECT_EQ(into_next.error().code, ErrorCode::kInvalidArgument) << into_next.to_string();
  EXPECT_EQ(live_bytes(*s, a), before);
}

// Queries and outputs placed at random in one buffer, with random row
// strides (one stride for both in half the trials): a decode is refused
// exactly when an output row shares a byte with a query row (out == q, row
// for row, aside), and otherwise writes the bits of separate buffers.
TEST(Store, OutputsApartFromTheirQueriesByteForByte) {
  const ModelConfig c = small_config();
  auto s = cpu_store(c, {.max_sequences = 1, .block_rows = 16});
  const SeqId a = *s->add_sequence();
  Outputs out;
  run_batch(*s, {{1, SeqSpan{a, 0, 12}}}, out);
  const std::int64_t w = c.n_heads * c.head_dim;
  const SeqQuery three[] = {{a, 11}, {a, 10}, {a, 9}};
  std::mt19937_64 rng(20261204);
  auto pick = [&](std::int64_t lo, std::int64_t hi) { return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng); };
  int refused = 0, taken = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const std::int64_t qs = pick(w, 3 * w), os = trial % 2 == 0 ? qs : pick(w, 3 * w);
    const std::int64_t span = 6 * 3 * w;
    std::vector<float> buf = testing::random_floats(static_cast<std::size_t>(span), static_cast<std::uint64_t>(trial));
    const std::int64_t qo = pick(0, span - 2 * qs - w), oo = pick(0, span - 2 * os - w);
    bool meet = false;
    for (std::int64_t i = 0; i < 3; ++i)
      for (std::int64_t j = 0; j < 3; ++j)
        meet = meet || (qo + i * qs < oo + j * os + w && oo + j * os < qo + i * qs + w);
    const bool same = qo == oo && qs == os;
    const ConstView q{buf.data() + qo, MemorySpace::kHost, DType::kF32, 3, w, qs};
    std::vector<float> qa(static_cast<std::size_t>(3 * w)), want(qa.size());
    for (std::int64_t i = 0; i < 3; ++i)
      std::memcpy(qa.data() + i * w, buf.data() + qo + i * qs, static_cast<std::size_t>(w) * 4);
    ASSERT_TRUE(s->attend_decode(0, three, host_view(qa.data(), 3, w), host_view(want.data(), 3, w)).ok());
    const Status st = s->attend_decode(0, three, q, MutView{buf.data() + oo, MemorySpace::kHost, DType::kF32, 3, w, os});
    ASSERT_EQ(st.ok(), !meet || same) << "q at " << qo << " stride " << qs << ", out at " << oo << " stride " << os;
    if (!st.ok()) {
      EXPECT_EQ(st.error().code, ErrorCode::kInvalidArgument);
      ++refused;
      continue;
    }
    ++taken;
    for (std::int64_t j = 0; j < 3; ++j)
      ASSERT_EQ(0, std::memcmp(want.data() + j * w, buf.data() + oo + j * os, static_cast<std::size_t>(w) * 4)) << trial;
  }
  EXPECT_GT(refused, 20);
  EXPECT_GT(taken, 20);
}

// [q | out] in each row of one buffer, for more rows than the row-by-row
// check covers: one row stride is answered exactly, so the call is taken,
// and an out one float into q is refused.
TEST(Store, InterleavedQueriesAndOutputsOfManyRows) {
  const ModelConfig c = small_config();
  auto s = cpu_store(c, {.max_sequences = 1, .block_rows = 16});
  const SeqId a = *s->add_sequence();
  Outputs out;
  run_batch(*s, {{1, SeqSpan{a, 0, 12}}}, out);
  const std::int64_t w = c.n_heads * c.head_dim, n = (std::int64_t{1} << 16) + 3;
  const std::vector<SeqQuery> queries(static_cast<std::size_t>(n), SeqQuery{a, 11});
  std::vector<float> buf = testing::random_floats(static_cast<std::size_t>(2 * w * n), 7);
  const ConstView q{buf.data(), MemorySpace::kHost, DType::kF32, n, w, 2 * w};
  const Status taken = s->attend_decode(0, queries, q, MutView{buf.data() + w, MemorySpace::kHost, DType::kF32, n, w, 2 * w});
  ASSERT_TRUE(taken.ok()) << taken.to_string();
  const Status refused =
      s->attend_decode(0, queries, q, MutView{buf.data() + w - 1, MemorySpace::kHost, DType::kF32, n, w, 2 * w});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message.find("out overlaps q"), std::string::npos) << refused.to_string();
}

// The CPU backend standing in for one whose views may be managed memory,
// host and device memory at once: it takes a view of either space.
class UnifiedStore : public CpuStore {
 public:
  using CpuStore::CpuStore;

 protected:
  Status check_view(const char* what, MemorySpace, DType dtype, const void* data,
                    std::uint64_t bytes) const override {
    return CpuStore::check_view(what, MemorySpace::kHost, dtype, data, bytes);
  }
};

// An out that shares bytes with the k, v or q a call reads is refused
// whichever space each is labelled: one buffer of managed memory may be
// named a host view and a device view at once.
TEST(Store, OutputsOverInputsAreRefusedAcrossSpaces) {
  const ModelConfig c = small_config();
  const StoreOptions o = *resolve_store_options(c, {.max_sequences = 1, .block_rows = 16});
  UnifiedStore s(c, o);
  ASSERT_TRUE(s.allocate().ok());
  const SeqId a = *s.add_sequence();
  Outputs outs;
  run_batch(s, {{1, SeqSpan{a, 0, 12}}}, outs);
  const auto before = live_bytes(s, a);
  const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim, n = 3;
  std::vector<float> buf = testing::random_floats(static_cast<std::size_t>(n * (width + kv)), 31);
  const std::vector<float> kept = buf;
  std::vector<float> other = testing::random_floats(static_cast<std::size_t>(n * width), 32);
  const SeqSpan span{a, 12, n};
  const MutView out_dev{buf.data(), MemorySpace::kDevice, DType::kF32, n, width, width};
  const ConstView rows_host{buf.data() + width, MemorySpace::kHost, DType::kF32, n, kv, kv};
  const ConstView apart_host{other.data(), MemorySpace::kHost, DType::kF32, n, kv, kv};
  const ConstView q_host{other.data(), MemorySpace::kHost, DType::kF32, n, width, width};
  const ConstView q_over{buf.data() + 1, MemorySpace::kHost, DType::kF32, n, width, width};
  struct Case {
    const char* what;
    ConstView k, v, q;
  };
  for (const Case& cs : {Case{"k", rows_host, apart_host, q_host}, Case{"v", apart_host, rows_host, q_host},
                         Case{"q", apart_host, apart_host, q_over}}) {
    const Status st = s.prefill(1, {&span, 1}, cs.k, cs.v, cs.q, out_dev);
    ASSERT_FALSE(st.ok()) << cs.what;
    EXPECT_EQ(st.error().code, ErrorCode::kInvalidArgument) << cs.what;
    EXPECT_NE(st.error().message.find(std::string("out overlaps ") + cs.what), std::string::npos) << st.to_string();
  }
  const SeqQuery last{a, 11};
  const Status decode = s.attend_decode(1, {&last, 1}, ConstView{buf.data() + 1, MemorySpace::kHost, DType::kF32, 1, width, width},
                                        MutView{buf.data(), MemorySpace::kDevice, DType::kF32, 1, width, width});
  EXPECT_NE(decode.to_string().find("out overlaps q"), std::string::npos) << decode.to_string();
  EXPECT_EQ(live_bytes(s, a), before);
  EXPECT_EQ(*s.next_position(a), 12);
  EXPECT_EQ(buf, kept);
}

// Extreme positions and layers get errors or defined values, never
// arithmetic past 64 bits (the sanitizer builds check that).
TEST(Store, ExtremePositionsAndLayers) {
  const ModelConfig c = small_config();
  auto s = cpu_store(c, {.max_sequences = 1, .block_rows = 16});
  const SeqId a = *s->add_sequence();
  Outputs out;
  run_batch(*s, {{1, SeqSpan{a, 0, 3}}}, out);
  const std::int64_t width = c.n_heads * c.head_dim;
  std::vector<float> q(static_cast<std::size_t>(width), 0.5f), o(q.size());
  for (const std::int64_t p : {std::numeric_limits<std::int64_t>::min(), std::int64_t{-1},
                               std::numeric_limits<std::int64_t>::max()}) {
    const SeqQuery at{a, p};
    const Status st = s->attend_decode(0, {&at, 1}, host_view(q.data(), 1, width), host_view(o.data(), 1, width));
    EXPECT_EQ(st.error().code, ErrorCode::kInvalidArgument) << p;
  }
  const SeqSpan far[] = {{a, std::numeric_limits<std::int64_t>::max(), 1}, {a, std::int64_t{1} << 62, 1}};
  for (const SeqSpan& sp : far) {
    auto n = s->blocks_to_store({&sp, 1});  // refused, as a store refuses the span
    ASSERT_FALSE(n.ok()) << sp.start;
    EXPECT_EQ(n.error().code, ErrorCode::kCacheDiscontinuity) << sp.start;
  }
  for (const std::int64_t l : {std::int64_t{-1}, c.n_layers, std::numeric_limits<std::int64_t>::max()}) {
    EXPECT_EQ(s->capacity(l), 0) << l;
    EXPECT_EQ(s->layout(l), Layout::kTokenMajor) << l;
  }
}

// The context bounds a sliding layer whose ring is shorter than its window
// (its queries would lose rows past it), as it bounds a full layer; a ring
// that holds the window runs on.
TEST(Store, ShortRingsStopAtTheContext) {
  ModelConfig c = small_config(64, 256, 2);
  c.layer_kinds.assign(2, LayerKind::kSlidingRope);
  const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim;
  std::vector<float> k = testing::random_floats(static_cast<std::size_t>(100 * kv), 12);
  std::vector<float> q = testing::random_floats(static_cast<std::size_t>(100 * width), 13), o(q.size());
  {
    auto s = cpu_store(c, {.max_sequences = 1, .context = 40});  // rings of 40 rows, W 64
    const SeqId a = *s->add_sequence();
    const SeqSpan first{a, 0, 40}, past{a, 40, 1};
    ASSERT_TRUE(s->store(0, {&first, 1}, host_view(k.data(), 40, kv), host_view(k.data(), 40, kv)).ok());
    const auto before = live_bytes(*s, a);
    EXPECT_EQ(s->store(0, {&past, 1}, host_view(k.data(), 1, kv), host_view(k.data(), 1, kv)).error().code,
              ErrorCode::kCapacityExceeded);
    EXPECT_EQ(s->prefill(0, {&past, 1}, host_view(k.data(), 1, kv), host_view(k.data(), 1, kv),
                         host_view(q.data(), 1, width), host_view(o.data(), 1, width)).error().code,
              ErrorCode::kCapacityExceeded);
    EXPECT_EQ(live_bytes(*s, a), before);
  }
  {
    auto s = cpu_store(c, {.max_sequences = 1, .context = 64});  // rings of 64 rows: the window
    const SeqId a = *s->add_sequence();
    const SeqSpan all{a, 0, 100};
    const Status st = s->prefill(0, {&all, 1}, host_view(k.data(), 100, kv), host_view(k.data(), 100, kv),
                                 host_view(q.data(), 100, width), host_view(o.data(), 100, width));
    EXPECT_TRUE(st.ok()) << st.to_string();
  }
}

// A sliding ring rolled back past its window (fewer than the W rows before
// its end, a state truncate_sequence refuses to make) is refused by install
// and install_plane alike, and nothing changes; one rolled back within the
// store's slack is taken.
TEST(Store, InstallRefusesARingRolledBackPastItsWindow) {
  const ModelConfig c = small_config(/*window=*/32, /*max_context=*/256, /*n_layers=*/4);
  auto s = cpu_store(c, {.max_sequences = 2, .slack = 4, .block_rows = 16});
  const SeqId a = *s->add_sequence();
  const std::int64_t kv = c.kv_dim();
  ASSERT_EQ(s->capacity(0), 36);
  std::vector<std::uint16_t> rows(static_cast<std::size_t>(36 * kv));
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<std::uint16_t>(0x3c00 + i % 977);
  ASSERT_TRUE(s->install(a, 0, *RingState::sequential(36, true, 50), rows.data(), rows.data()).ok());
  const RingState before_ring = *s->ring(a, 0);
  const auto before = live_bytes(*s, a);
  // Built to 50 (positions [14, 50)): by 4 it still holds [14, 46), the 32
  // rows before 46; by 5 it would lack position 13 of [13, 45).
  const RingState within = *RingState::sequential(36, true, 50)->rolled_back(4);
  const RingState past = *RingState::sequential(36, true, 50)->rolled_back(5);
  const Status refused = s->install(a, 0, past, rows.data(), rows.data());
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code, ErrorCode::kInvalidArgument) << refused.to_string();
  EXPECT_NE(refused.error().message.find("rolled back past its window"), std::string::npos)
      << refused.to_string();
  EXPECT_EQ(*s->ring(a, 0), before_ring);
  EXPECT_EQ(live_bytes(*s, a), before);
  const SeqId d = *s->add_detached_sequence();
  const Status plane = s->install_plane(d, 0, past);
  ASSERT_FALSE(plane.ok());
  EXPECT_EQ(plane.error().code, ErrorCode::kInvalidArgument) << plane.to_string();
  EXPECT_EQ(s->ring(d, 0)->len(), 0);
  ASSERT_TRUE(s->install(a, 0, within, rows.data(), rows.data()).ok());
  EXPECT_EQ(*s->ring(a, 0), within);
  ASSERT_TRUE(s->install_plane(d, 0, within).ok());
}

// A snapshot of one sequence of a store, taken after a fork and a rollback
// from a non-zero slot, restores into a sequence of another store (other
// slack, other slot) byte for byte, and both continue identically.
TEST(Store, SnapshotsMoveOneSequenceBetweenStores) {
  const ModelConfig c = small_config(/*window=*/32, /*max_context=*/256, /*n_layers=*/4);
  auto s = cpu_store(c, {.max_sequences = 3, .slack = 4, .block_rows = 16});
  const SeqId a = *s->add_sequence();
  Outputs out;
  run_batch(*s, {{1, SeqSpan{a, 0, 90}}}, out);
  const SeqId b = *s->fork_sequence(a);
  ASSERT_TRUE(s->truncate_sequence(b, 3).ok());
  run_batch(*s, {{5, SeqSpan{b, 87, 6}}}, out);
  auto snap = take_snapshot(*s, b);
  ASSERT_TRUE(snap.ok()) << snap.error().to_string();
  ASSERT_TRUE(validate_snapshot(*snap).ok());
  EXPECT_EQ(snap->token_count, 93);

  auto t = cpu_store(c, {.max_sequences = 2, .block_rows = 32});
  const SeqId other = *t->add_sequence();
  run_batch(*t, {{9, SeqSpan{other, 0, 40}}}, out);
  auto moved = restore_new_sequence(*snap, *t);
  ASSERT_TRUE(moved.ok()) << moved.error().to_string();
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    const RingState rs = *s->ring(b, l), rt = *t->ring(*moved, l);
    // The rows both hold: the last min(len) positions.
    const std::int64_t n = std::min(rs.len(), rt.len());
    std::vector<std::uint16_t> k1(static_cast<std::size_t>(n * c.kv_dim())), v1(k1.size()), k2(k1.size()),
        v2(k1.size());
    ASSERT_TRUE(s->read_rows(b, l, 93 - n, n, k1.data(), v1.data()).ok());
    ASSERT_TRUE(t->read_rows(*moved, l, 93 - n, n, k2.data(), v2.data()).ok());
    EXPECT_EQ(k1, k2);
    EXPECT_EQ(v1, v2);
  }
  Outputs o1, o2;
  run_batch(*s, {{6, SeqSpan{b, 93, 20}}}, o1);
  run_batch(*t, {{6, SeqSpan{*moved, 93, 20}}}, o2);
  EXPECT_EQ(o1, o2);
  // A store with no free slot takes no sequence and is left as it was.
  const auto before = live_bytes(*t, other);
  auto full = restore_new_sequence(*snap, *t);
  EXPECT_FALSE(full.ok());
  EXPECT_EQ(t->sequence_count(), 2);
  EXPECT_EQ(live_bytes(*t, other), before);
  // Into a store too small for its positions: refused, nothing added.
  auto small = cpu_store(c, {.max_sequences = 2, .context = 64});
  EXPECT_FALSE(restore_new_sequence(*snap, *small).ok());
  EXPECT_EQ(small->sequence_count(), 0);
}

// The source the detached-sequence tests copy: a store of 4 layers (one
// sliding window of 32 rows) holding sequence `a` at 70 positions, its
// snapshot and its live bytes.
class StoreDetached : public ::testing::Test {
 protected:
  void SetUp() override {
    Outputs out;
    run_batch(*s, {{1, SeqSpan{a, 0, 70}}}, out);
    auto taken = take_snapshot(*s, a);
    ASSERT_TRUE(taken.ok());
    taken_ = std::move(*taken);
    a_bytes = live_bytes(*s, a);
  }
  const ModelConfig c = small_config(/*window=*/32, /*max_context=*/256, /*n_layers=*/4);
  const std::unique_ptr<KvStore> s = cpu_store(c, {.max_sequences = 3, .block_rows = 16});
  const SeqId a = *s->add_sequence();
  Snapshot taken_;
  const Snapshot* snap = &taken_;
  std::vector<std::uint16_t> a_bytes;
};

// A detached sequence takes a slot and blocks but is invisible and refused
// by every batched operation and every read until attached; its planes are
// installed in pieces (install_plane, then install_rows in any order) and
// end up equal to the sequence they were copied from; removing it gives
// everything back.
TEST_F(StoreDetached, DetachedSequencesInstallInPiecesAndGoLiveOnlyWhenAttached) {
  const std::int64_t free_before = s->free_blocks();
  const std::int64_t kv = c.kv_dim();
  // Every plane of `d` from the snapshot, rows back to front in pieces of 5.
  auto install_in_pieces = [&](SeqId d) {
    for (std::int64_t l = 0; l < c.n_layers; ++l) {
      auto ring = restore_ring(*snap, l, *s);
      ASSERT_TRUE(ring.ok()) << ring.error().to_string();
      ASSERT_TRUE(s->install_plane(d, l, *ring).ok());
      const PlaneSnapshot& p = snap->planes[static_cast<std::size_t>(l)];
      const std::int64_t skip = ring->origin_logical() - p.ring.origin_logical();
      // Rows outside the plane are refused.
      EXPECT_FALSE(s->install_rows(d, l, ring->origin_logical() - 1, 1, p.k.data(), p.v.data()).ok());
      EXPECT_FALSE(s->install_rows(d, l, ring->next_position(), 1, p.k.data(), p.v.data()).ok());
      for (std::int64_t end = ring->next_position(); end > ring->origin_logical(); end -= 5) {
        const std::int64_t first = std::max(ring->origin_logical(), end - 5);
        const auto at = static_cast<std::size_t>((first - ring->origin_logical() + skip) * kv);
        ASSERT_TRUE(s->install_rows(d, l, first, end - first, p.k.data() + at, p.v.data() + at).ok());
      }
    }
  };

  auto d = s->add_detached_sequence();
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(s->is_detached(*d));
  EXPECT_FALSE(s->contains(*d));
  EXPECT_EQ(s->sequence_count(), 1);
  EXPECT_EQ(s->sequences(), std::vector<SeqId>{a});
  // Nothing reads or extends it while it is detached.
  std::vector<float> x(static_cast<std::size_t>(kv), 0.5f);
  const SeqSpan span{*d, 0, 1};
  EXPECT_EQ(s->store(0, {&span, 1}, host_view(x.data(), 1, kv), host_view(x.data(), 1, kv)).error().code,
            ErrorCode::kNotFound);
  EXPECT_EQ(s->fork_sequence(*d).error().code, ErrorCode::kNotFound);
  EXPECT_EQ(s->reset_sequence(*d).error().code, ErrorCode::kNotFound);
  EXPECT_EQ(s->truncate_sequence(*d, 0).error().code, ErrorCode::kNotFound);
  // install_rows and install_plane take only a detached sequence.
  const RingState r0 = *restore_ring(*snap, 0, *s);
  EXPECT_EQ(s->install_plane(a, 0, r0).error().code, ErrorCode::kInvalidArgument);
  // restore_ring refuses what check_restorable refuses: another geometry, or
  // a header whose rings do not end at its token count.
  {
    Snapshot other = *snap;
    other.config.head_dim *= 2;
    auto ring = restore_ring(other, 0, *s);
    ASSERT_FALSE(ring.ok());
    EXPECT_EQ(ring.error().code, ErrorCode::kMismatch) << ring.error().message;
    other = *snap;
    other.token_count += 5000;
    ring = restore_ring(other, 0, *s);
    ASSERT_FALSE(ring.ok());
    EXPECT_EQ(ring.error().code, ErrorCode::kInvalidArgument) << ring.error().message;
  }
  EXPECT_EQ(s->install_rows(a, 0, 69, 1, snap->planes[0].k.data(), snap->planes[0].v.data()).error().code,
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(live_bytes(*s, a), a_bytes);
  install_in_pieces(*d);
  EXPECT_LT(s->free_blocks(), free_before);
  std::vector<std::uint16_t> k(static_cast<std::size_t>(kv)), v(k.size());
  EXPECT_EQ(s->read_rows(*d, 0, 69, 1, k.data(), v.data()).error().code, ErrorCode::kNotFound);
  // Removed instead of attached: every block is back, nothing else changed.
  ASSERT_TRUE(s->remove_sequence(*d).ok());
  EXPECT_EQ(s->free_blocks(), free_before);
  EXPECT_EQ(s->sequence_count(), 1);
  EXPECT_EQ(live_bytes(*s, a), a_bytes);

  // Attached: live, holding the rows it was copied from, and it decodes as
  // that sequence.
  auto e = s->add_detached_sequence();
  ASSERT_TRUE(e.ok());
  install_in_pieces(*e);
  ASSERT_TRUE(s->attach_sequence(*e).ok());
  EXPECT_FALSE(s->attach_sequence(*e).ok());
  EXPECT_TRUE(s->contains(*e));
  EXPECT_EQ(s->sequence_count(), 2);
  EXPECT_EQ(live_bytes(*s, *e), a_bytes);
  Outputs o1, o2;
  run_batch(*s, {{6, SeqSpan{a, 70, 9}}}, o1);
  run_batch(*s, {{6, SeqSpan{*e, 70, 9}}}, o2);
  EXPECT_EQ(o1, o2);
  // A detached sequence takes a slot: with every slot taken, none is added.
  auto f = s->add_detached_sequence();
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(s->add_sequence().error().code, ErrorCode::kResourceExhausted);
  EXPECT_EQ(s->add_detached_sequence().error().code, ErrorCode::kResourceExhausted);
}

// attach_sequence takes a detached sequence only whole: every layer's
// plane installed to one end and every live row written (in any pieces,
// rows written twice counted once); otherwise it stays detached, and a
// removed sequence's rows left in the blocks or rings it took are never
// read.
TEST_F(StoreDetached, ADetachedSequenceIsAttachedOnlyWhole) {
  const std::int64_t kv = c.kv_dim();
  // Live rows [first, first + count) of layer l from the snapshot.
  auto put = [&](SeqId d, std::int64_t l, std::int64_t first, std::int64_t count) {
    const PlaneSnapshot& p = snap->planes[static_cast<std::size_t>(l)];
    const auto at = static_cast<std::size_t>((first - p.ring.origin_logical()) * kv);
    return s->install_rows(d, l, first, count, p.k.data() + at, p.v.data() + at);
  };
  auto planes = [&](SeqId d) {
    for (std::int64_t l = 0; l < c.n_layers; ++l) ASSERT_TRUE(s->install_plane(d, l, *restore_ring(*snap, l, *s)).ok());
  };
  auto refused = [&](SeqId d, const char* why) {
    const Status st = s->attach_sequence(d);
    ASSERT_FALSE(st.ok()) << why;
    EXPECT_EQ(st.error().code, ErrorCode::kInvalidArgument) << st.to_string();
    EXPECT_NE(st.error().message.find("is not whole"), std::string::npos) << st.to_string();
    EXPECT_TRUE(s->is_detached(d)) << why;
    EXPECT_FALSE(s->contains(d)) << why;
  };

  // Nothing installed yet: every plane ends at 0 with no rows, a whole
  // empty sequence.
  const SeqId empty = *s->add_detached_sequence();
  ASSERT_TRUE(s->attach_sequence(empty).ok());
  EXPECT_EQ(*s->next_position(empty), 0);
  ASSERT_TRUE(s->remove_sequence(empty).ok());

  // One layer installed, the others left at position 0.
  const SeqId d = *s->add_detached_sequence();
  const RingState r1 = *restore_ring(*snap, 1, *s);
  ASSERT_TRUE(s->install_plane(d, 1, r1).ok());
  ASSERT_TRUE(put(d, 1, r1.origin_logical(), r1.len()).ok());
  refused(d, "one layer");
  // Every plane, but layer 2 short of its last 3 rows; rows written twice
  // count once.
  planes(d);
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    const RingState r = *s->ring(d, l);
    const std::int64_t n = l == 2 ? r.len() - 3 : r.len();
    ASSERT_TRUE(put(d, l, r.origin_logical(), n).ok());
    ASSERT_TRUE(put(d, l, r.origin_logical(), std::min<std::int64_t>(n, 4)).ok());
  }
  refused(d, "rows missing");
  const RingState r2 = *s->ring(d, 2);
  ASSERT_TRUE(put(d, 2, r2.next_position() - 3, 3).ok());
  // A plane installed again forgets the rows written before it.
  ASSERT_TRUE(s->install_plane(d, 3, *s->ring(d, 3)).ok());
  refused(d, "plane installed again");
  const RingState r3 = *s->ring(d, 3);
  ASSERT_TRUE(put(d, 3, r3.origin_logical(), r3.len()).ok());
  ASSERT_TRUE(s->attach_sequence(d).ok());
  EXPECT_EQ(live_bytes(*s, d), a_bytes);
  Outputs o1, o2;
  run_batch(*s, {{6, SeqSpan{a, 70, 9}}}, o1);
  run_batch(*s, {{6, SeqSpan{d, 70, 9}}}, o2);
  EXPECT_EQ(o1, o2);

  // install writes every live row of its plane at once.
  const SeqId e = *s->add_detached_sequence();
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    const PlaneSnapshot& p = snap->planes[static_cast<std::size_t>(l)];
    const RingState r = *restore_ring(*snap, l, *s);
    const auto at = static_cast<std::size_t>((r.origin_logical() - p.ring.origin_logical()) * kv);
    ASSERT_TRUE(s->install(e, l, r, p.k.data() + at, p.v.data() + at).ok());
  }
  ASSERT_TRUE(s->attach_sequence(e).ok());
  EXPECT_EQ(live_bytes(*s, e), a_bytes);
}

// Under zero_fill a new or reset sequence's rings read as zeros, and the
// clear reaches only the rows some write reached since the slot's last
// clear: 40 rows stored into 65536-row rings leave the rest of the rings'
// pages unmapped through the next sequence's add, its fork and its reset;
// rows of a wrap, of a rollback and rewrite, of an install at another
// origin and of a fork are cleared all the same. A fork into a slot whose
// last sequence wrote further than the source clears those rows, so its
// rings equal the source's whole.
TEST(Store, ClearsReachOnlyTheRowsWritten) {
  {
    const ModelConfig c = small_config(65536, 65536, 2, 8, 8, 64);
    ASSERT_EQ(c.kind(0), LayerKind::kSlidingRope);
    ASSERT_EQ(c.kind(1), LayerKind::kSlidingRope);
    auto s = cpu_store(c, {.max_sequences = 2});
    const std::int64_t kv = c.kv_dim(), cap = s->capacity(0);
    const std::int64_t rings_bytes = cap * kv * 2 * 2 * 2;  // K and V of both layers
    ASSERT_GE(rings_bytes, std::int64_t{256} << 20);
    const std::vector<float> forty = testing::random_floats(static_cast<std::size_t>(2 * 40 * kv), 71);
    const SeqSpan first{*s->add_sequence(), 0, 40};
    const ConstView both = host_view(forty.data(), 80, kv);  // 40 rows, each of the two layers
    ASSERT_TRUE(s->store_all_layers({&first, 1}, both, both).ok());
    ASSERT_TRUE(s->remove_sequence(first.seq).ok());
    const std::int64_t before = resident_bytes();
    const SeqSpan next{*s->add_sequence(), 0, 40};
    ASSERT_TRUE(s->store_all_layers({&next, 1}, both, both).ok());
    auto rows_of = [&](SeqId seq, std::int64_t l) {
      testing::PlaneBytes b{std::vector<std::uint16_t>(static_cast<std::size_t>(40 * kv)),
                            std::vector<std::uint16_t>(static_cast<std::size_t>(40 * kv))};
      const Status st = s->read_rows(seq, l, 0, 40, b.k.data(), b.v.data());
      EXPECT_TRUE(st.ok()) << st.to_string();
      return b;
    };
    const testing::PlaneBytes held[] = {rows_of(next.seq, 0), rows_of(next.seq, 1)};
    const SeqId fork = *s->fork_sequence(next.seq);
    ASSERT_TRUE(s->reset_sequence(next.seq).ok());
    EXPECT_LT(resident_bytes() - before, rings_bytes / 8) << "the clears or the fork's copy reached whole rings";
    for (std::int64_t l : {0, 1}) {
      const testing::PlaneBytes b = testing::plane_bytes(*s, next.seq, l);
      EXPECT_EQ(std::count(b.k.begin(), b.k.end(), 0), static_cast<std::ptrdiff_t>(b.k.size())) << l;
      EXPECT_EQ(std::count(b.v.begin(), b.v.end(), 0), static_cast<std::ptrdiff_t>(b.v.size())) << l;
      EXPECT_TRUE(rows_of(fork, l) == held[l]) << "the fork's rows, layer " << l;
    }
  }
  const ModelConfig c = small_config(/*window=*/32, /*max_context=*/256, /*n_layers=*/4);
  const std::int64_t kv = c.kv_dim();
  auto s = cpu_store(c, {.max_sequences = 2, .slack = 4});
  const std::int64_t cap = s->capacity(0);
  const std::vector<float> rows = testing::random_floats(static_cast<std::size_t>(3 * cap * kv), 72, 2.0f);
  auto write = [&](SeqId seq, std::int64_t from, std::int64_t count) {
    const SeqSpan span{seq, from, count};
    for (std::int64_t l = 0; l < c.n_layers; ++l)
      ASSERT_TRUE(s->store(l, {&span, 1}, host_view(rows.data(), count, kv), host_view(rows.data(), count, kv)).ok());
  };
  auto all_zero = [&](SeqId seq, const char* what) {
    for (std::int64_t l = 0; l < c.n_layers; ++l) {
      if (c.kind(l) == LayerKind::kFullNope) continue;
      const testing::PlaneBytes b = testing::plane_bytes(*s, seq, l);
      const auto zeros = static_cast<std::ptrdiff_t>(b.k.size());
      EXPECT_EQ(std::count(b.k.begin(), b.k.end(), 0), zeros) << what << ", layer " << l;
      EXPECT_EQ(std::count(b.v.begin(), b.v.end(), 0), zeros) << what << ", layer " << l;
    }
  };
  // A few rows; a wrap; a rollback and a rewrite; each then removed, or
  // reset, and the slot's next sequence (or the reset one) read whole.
  for (const bool reset : {false, true}) {
    SCOPED_TRACE(reset ? "reset" : "removed and added");
    auto renew = [&](SeqId seq) {
      if (reset) {
        EXPECT_TRUE(s->reset_sequence(seq).ok());
        return seq;
      }
      EXPECT_TRUE(s->remove_sequence(seq).ok());
      return *s->add_sequence();
    };
    SeqId a = *s->add_sequence();
    write(a, 0, 5);
    a = renew(a);
    all_zero(a, "5 rows");
    write(a, 0, cap + 7);
    a = renew(a);
    all_zero(a, "a wrap");
    write(a, 0, 20);
    ASSERT_TRUE(s->truncate_sequence(a, 12).ok());
    write(a, 8, 3);
    a = renew(a);
    all_zero(a, "a rollback");
    // A fork of 9 rows, both then removed.
    write(a, 0, 9);
    const SeqId f = *s->fork_sequence(a);
    ASSERT_TRUE(s->remove_sequence(f).ok());
    a = renew(a);
    all_zero(a, "a fork's source");
    const SeqId g = *s->add_sequence();
    all_zero(g, "a fork's slot");
    ASSERT_TRUE(s->remove_sequence(g).ok());
    ASSERT_TRUE(s->remove_sequence(a).ok());
  }
  // A fork of 9 rows into the slot a wrap left.
  {
    const SeqId wide = *s->add_sequence();
    write(wide, 0, cap + 7);
    const SeqId src = *s->add_sequence();
    ASSERT_TRUE(s->remove_sequence(wide).ok());
    write(src, 0, 9);
    const SeqId f = *s->fork_sequence(src);
    for (std::int64_t l = 0; l < c.n_layers; ++l) {
      if (c.kind(l) == LayerKind::kFullNope) continue;
      const testing::PlaneBytes want = testing::plane_bytes(*s, src, l), got = testing::plane_bytes(*s, f, l);
      EXPECT_GE(std::count(want.k.begin(), want.k.end(), 0), static_cast<std::ptrdiff_t>(want.k.size() - 9 * kv))
          << "the source's rings hold their 9 rows and zeros, layer " << l;
      EXPECT_TRUE(got.k == want.k && got.v == want.v) << "the fork's rings differ from its source's, layer " << l;
    }
    ASSERT_TRUE(s->remove_sequence(f).ok());
    ASSERT_TRUE(s->remove_sequence(src).ok());
  }
  // Installs: a full ring whose origin has moved, and a partial one.
  const std::vector<std::uint16_t> ones(static_cast<std::size_t>(cap * kv), 0x3c00);
  for (const std::int64_t len : {cap, std::int64_t{6}}) {
    const SeqId d = *s->add_detached_sequence();
    const RingState state = len == cap ? *RingState::from_parts(cap, true, cap, 2 * cap + 3, (2 * cap + 3) % cap)
                                       : *RingState::sequential(cap, true, len);
    for (std::int64_t l = 0; l < c.n_layers; ++l) {
      if (c.kind(l) == LayerKind::kFullNope) continue;
      const Status st = s->install(d, l, state, ones.data(), ones.data());
      ASSERT_TRUE(st.ok()) << st.to_string();
    }
    ASSERT_TRUE(s->remove_sequence(d).ok());
    const SeqId e = *s->add_sequence();
    all_zero(e, len == cap ? "a full install at a moved origin" : "a partial install");
    ASSERT_TRUE(s->remove_sequence(e).ok());
  }
}

// A call that writes at least CpuStore::kStreamBytes of K and V streams its
// rows (non-temporal stores where a head's row fills whole 64-byte lines).
// Its planes hold the bits of the same rows written by calls below that
// size: f32 (NaNs, infinities and values past the f16 range among them),
// f16 and bf16 inputs at a row stride past their width, head rows of whole
// lines (head_dim 128) and of part lines (24), rings that wrap and full
// planes.
TEST(Store, StreamedWritesHoldTheBitsOfSmallOnes) {
  for (const std::int64_t head_dim : {128, 24}) {
    SCOPED_TRACE(head_dim);
    const ModelConfig c = make_hybrid_config("stream", 4, 2, 8, 4, head_dim, 64, 16384);
    const std::int64_t kv = c.kv_dim(), stride = kv + 8, L = c.n_layers, seqs = 2, full = 2;
    // Each sequence's n rows land whole in the two full layers; the rings
    // keep their last few dozen.
    const std::int64_t n = (CpuStore::kStreamBytes / (full * seqs * kv * 4) + 1) * 3 / 2;
    ASSERT_LE(n, c.max_context);
    const std::int64_t chunk = n / 8;  // a small call: one layer, one chunk
    ASSERT_LT(chunk * kv * 4, CpuStore::kStreamBytes);
    const auto elems = static_cast<std::size_t>(L * seqs * n * stride);
    std::vector<float> k = testing::random_floats(elems, 61, 4.0f), v = testing::random_floats(elems, 62, 4.0f);
    const float specials[] = {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity(),
                              65520.0f, -0.0f, 1e-8f, 70000.0f};
    for (std::size_t i = 0; i < elems; i += 997) k[i] = specials[(i / 997) % 6];
    std::vector<std::uint16_t> k16(elems), v16(elems), kb(elems), vb(elems);
    for (std::size_t i = 0; i < elems; ++i) {
      k16[i] = f32_to_f16(k[i]);
      v16[i] = f32_to_f16(v[i]);
      std::uint32_t u;
      std::memcpy(&u, &k[i], 4);
      kb[i] = static_cast<std::uint16_t>(u >> 16);
      std::memcpy(&u, &v[i], 4);
      vb[i] = static_cast<std::uint16_t>(u >> 16);
    }
    struct Input {
      DType dtype;
      const void* k;
      const void* v;
    };
    for (const Input in : {Input{DType::kF32, k.data(), v.data()}, Input{DType::kF16, k16.data(), v16.data()},
                           Input{DType::kBF16, kb.data(), vb.data()}}) {
      SCOPED_TRACE(dtype_name(in.dtype));
      const std::size_t bytes = dtype_bytes(in.dtype);
      // Row r of the inputs: layer r / (seqs * n), then sequence, then position.
      auto rows_at = [&](const void* base, std::int64_t r, std::int64_t count) {
        return host_view(static_cast<const char*>(base) + static_cast<std::size_t>(r * stride) * bytes, in.dtype,
                         count, kv, stride);
      };
      auto big = cpu_store(c, {.max_sequences = seqs, .context = n});
      auto small = cpu_store(c, {.max_sequences = seqs, .context = n});
      std::vector<SeqSpan> spans;
      for (std::int64_t s = 0; s < seqs; ++s) spans.push_back({*big->add_sequence(), 0, n});
      ASSERT_TRUE(big->store_all_layers(spans, rows_at(in.k, 0, L * seqs * n), rows_at(in.v, 0, L * seqs * n)).ok());
      for (std::int64_t s = 0; s < seqs; ++s) {
        const SeqId id = *small->add_sequence();
        for (std::int64_t p = 0; p < n; p += chunk) {
          const std::int64_t count = std::min(chunk, n - p);
          const SeqSpan span{id, p, count};
          for (std::int64_t l = 0; l < L; ++l) {
            const std::int64_t r = (l * seqs + s) * n + p;
            ASSERT_TRUE(small->store(l, {&span, 1}, rows_at(in.k, r, count), rows_at(in.v, r, count)).ok());
          }
        }
        for (std::int64_t l = 0; l < L; ++l)
          EXPECT_TRUE(testing::plane_bytes(*big, spans[static_cast<std::size_t>(s)].seq, l) == testing::plane_bytes(*small, id, l))
              << "sequence " << s << ", layer " << l;
      }
    }
  }
}

}  // namespace
}  // namespace kvring
