// The exactness contract (docs/DESIGN.md) over seeded random geometries,
// through the reference model on the CPU backend. Each seed draws a geometry
// (1 to 6 layers in any sliding/full pattern, all-sliding and all-full
// included; 1 to 4 KV heads in groups of 1 to 8; head dims to 16, even where
// a layer uses RoPE and any where none does; windows 1 to 64; contexts 64 to
// 400; slack 0 to 8; block sizes; the f32 or the f16 numeric), a model, and
// a few token streams, each sharing a prefix with the first. Every stream is
// decoded alone, one token at a time (its solo run). Then, bit for bit:
//   (a) the first stream prefilled in chunks of random sizes gives the solo
//       run's logits at every position, and at every chunk's end its stored
//       K/V (read_plane and read_rows);
//   (b) all streams in one store, in random batches (decode steps and ragged
//       prefills, any composition and order), give their solo logits and
//       leave their solo images;
//   (c) a snapshot part-way, through a pack in memory or in a file, restored
//       into a fresh cache and into a store of another slack, block size and
//       context beside another sequence, continues with the solo logits and
//       rows;
//   (d) the first stream forked at each other stream's branch point, the
//       branches continued in random batches (the source sometimes removed
//       first): each equals its solo run;
//   (e) garbage fed and rolled back (truncate_sequence, within the slack and
//       past it), then the stream re-fed, equals the solo run; a rollback is
//       refused exactly when a ring no longer holds what a ring without
//       slack would hold at the new end, and a refusal changes nothing.
// KVRING_GATE_SEEDS (default 60) and KVRING_GATE_FIRST_SEED (default 1) pick
// the seeds; KVRING_GATE_PROGRESS=1 prints each seed's geometry.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvring/model.h"
#include "kvring/pack.h"
#include "kvring/snapshot.h"
#include "kvring/store.h"
#include "pack_test_util.h"
#include "test_util.h"

namespace kvring {
namespace {

using Tokens = std::vector<std::int32_t>;
using testing::same_bits;

std::int64_t uniform(std::mt19937_64& rng, std::int64_t lo, std::int64_t hi) {
  return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
}

// 0 (the store's default) or a power of two from 16 to 256.
std::int64_t draw_block_rows(std::mt19937_64& rng) {
  const std::int64_t r = uniform(rng, 0, 5);
  return r == 0 ? 0 : std::int64_t{8} << r;
}

// No slack a third of the time, else 1 to 8 rows (at most the window).
std::int64_t draw_slack(std::mt19937_64& rng, std::int64_t window) {
  return uniform(rng, 0, 2) == 0 ? 0 : std::min(window, uniform(rng, 1, 8));
}

// A token stream and its solo run: decoded one token at a time in a store
// of its own, which it leaves holding the whole stream.
struct Solo {
  Tokens tokens;
  std::int64_t branch = 0;    // leading positions shared with the first stream
  std::vector<float> logits;  // [length, vocab]
  std::unique_ptr<KvStore> store;
  SeqId seq{};
  std::int64_t length() const { return std::ssize(tokens); }
};

// A sequence of a store that runs stream `solo` from `at` up to `until`.
struct Member {
  SeqId seq{};
  const Solo* solo = nullptr;
  std::int64_t at = 0;
  std::int64_t until = 0;
};

struct Stats {
  std::int64_t seeds = 0, calls = 0, tokens = 0, forks = 0, restores = 0;
  std::int64_t rollbacks = 0, refused = 0, f16 = 0, all_sliding = 0, all_full = 0;
};

// Every live row two sequences both hold, in logical order; and they hold
// at least the rows the next query reads (the window on a sliding layer,
// every position on a full one).
::testing::AssertionResult same_rows(const KvStore& a, SeqId sa, const KvStore& b, SeqId sb) {
  const ModelConfig& c = a.config();
  const std::int64_t kv = c.kv_dim();
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    auto ra = a.ring(sa, l), rb = b.ring(sb, l);
    if (!ra.ok() || !rb.ok()) return ::testing::AssertionFailure() << "layer " << l << ": no ring";
    const std::int64_t next = ra->next_position();
    if (rb->next_position() != next)
      return ::testing::AssertionFailure() << "layer " << l << ": next positions " << next << " and "
                                           << rb->next_position();
    const std::int64_t first = std::max(ra->origin_logical(), rb->origin_logical());
    const std::int64_t need =
        c.kind(l) == LayerKind::kSlidingRope ? std::max<std::int64_t>(0, next - c.sliding_window) : 0;
    if (first > need)
      return ::testing::AssertionFailure() << "layer " << l << ": rows from " << first
                                           << " held, the next query reads from " << need;
    const auto n = static_cast<std::size_t>((next - first) * kv);
    std::vector<std::uint16_t> ka(n), va(n), kb(n), vb(n);
    const Status s1 = a.read_rows(sa, l, first, next - first, ka.data(), va.data());
    const Status s2 = b.read_rows(sb, l, first, next - first, kb.data(), vb.data());
    if (!s1.ok() || !s2.ok())
      return ::testing::AssertionFailure() << "layer " << l << ": " << s1.to_string() << " / " << s2.to_string();
    if (ka != kb || va != vb)
      return ::testing::AssertionFailure() << "layer " << l << ": rows [" << first << ", " << next
                                           << ") differ";
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult same_image(const KvStore& a, SeqId sa, const Solo& solo) {
  if (testing::image(a, sa) == testing::image(*solo.store, solo.seq)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "ring states or plane bytes differ from the solo run's";
}

class Gate {
 public:
  Gate(std::uint64_t seed, Stats& stats)
      : rng_(seed), stats_(stats), parts_(result().total_part_count()) {
    draw();
  }

  const std::string& description() const { return text_; }

  void run() {
    ASSERT_TRUE(model_ != nullptr);
    streams();
    if (stopped()) return;
    prefill_chunks();
    if (stopped()) return;
    batches();
    if (stopped()) return;
    restores();
    if (stopped()) return;
    forks();
    if (stopped()) return;
    rollbacks();
  }

 private:
  static const ::testing::TestResult& result() {
    return *::testing::UnitTest::GetInstance()->current_test_info()->result();
  }
  // A failure of this seed (every part a test records is a failure) ends it.
  bool stopped() const { return result().total_part_count() > parts_; }

  void draw() {
    ModelConfig& c = config_;
    c.name = "random";
    c.n_layers = uniform(rng_, 1, 6);
    // All sliding, all full, each layer at random, or every `every`-th full.
    const std::int64_t pattern = uniform(rng_, 0, 3);
    const std::int64_t every = uniform(rng_, 2, std::max<std::int64_t>(2, c.n_layers));
    for (std::int64_t l = 0; l < c.n_layers; ++l) {
      const bool full = pattern == 1 || (pattern == 2 && (rng_() & 1) != 0) ||
                        (pattern == 3 && l % every == every - 1);
      c.layer_kinds.push_back(full ? LayerKind::kFullNope : LayerKind::kSlidingRope);
    }
    c.n_kv_heads = uniform(rng_, 1, 4);
    c.n_heads = c.n_kv_heads * uniform(rng_, 1, 8);
    const bool rope = c.count(LayerKind::kSlidingRope) > 0;
    // RoPE turns pairs of dimensions: the model takes an odd head_dim only
    // where no layer uses it.
    c.head_dim = rope ? 2 * uniform(rng_, 1, 8) : uniform(rng_, 1, 16);
    c.sliding_window = rope || (rng_() & 1) != 0 ? uniform(rng_, 1, 64) : 0;
    const std::int64_t context = uniform(rng_, 64, 400);
    c.max_context = context + ((rng_() & 1) != 0 ? uniform(rng_, 1, 100) : 0);
    options_.context = context;
    options_.slack = draw_slack(rng_, c.sliding_window);
    options_.block_rows = draw_block_rows(rng_);
    options_.attention = (rng_() & 1) != 0 ? AttentionNumeric::kF16 : AttentionNumeric::kF32;
    const ModelOptions mo{.hidden = uniform(rng_, 4, 48),
                          .vocab = uniform(rng_, 2, 64),
                          .mlp = (rng_() & 1) != 0 ? 0 : uniform(rng_, 1, 64),
                          .seed = rng_()};
    vocab_ = mo.vocab;
    std::string kinds;
    for (LayerKind k : c.layer_kinds) kinds += k == LayerKind::kFullNope ? 'F' : 'S';
    text_ = "layers " + kinds + ", heads " + std::to_string(c.n_heads) + "/" +
            std::to_string(c.n_kv_heads) + " x " + std::to_string(c.head_dim) + ", window " +
            std::to_string(c.sliding_window) + ", context " + std::to_string(context) + " of " +
            std::to_string(c.max_context) + ", slack " + std::to_string(options_.slack) +
            ", block_rows " + std::to_string(options_.block_rows) + ", " +
            attention_numeric_name(options_.attention) + ", hidden " + std::to_string(mo.hidden) +
            ", vocab " + std::to_string(mo.vocab) + ", mlp " + std::to_string(mo.mlp);
    stats_.f16 += options_.attention == AttentionNumeric::kF16 ? 1 : 0;
    stats_.all_sliding += c.count(LayerKind::kFullNope) == 0 ? 1 : 0;
    stats_.all_full += c.count(LayerKind::kSlidingRope) == 0 ? 1 : 0;
    auto model = ReferenceModel::create(c, mo);
    EXPECT_TRUE(model.ok()) << model.error().to_string();
    if (model.ok()) model_ = *model;
  }

  std::unique_ptr<KvStore> make(const StoreOptions& options) {
    auto store = make_store(BackendKind::kCpu, config_, options);
    EXPECT_TRUE(store.ok()) << store.error().to_string();
    return store.ok() ? std::move(*store) : nullptr;
  }

  // A chunk of at most `left` tokens: one, a few, or any number.
  std::int64_t chunk(std::int64_t left) {
    switch (uniform(rng_, 0, 3)) {
      case 0: return 1;
      case 1: return std::min(left, uniform(rng_, 2, 8));
      default: return uniform(rng_, 1, left);
    }
  }

  // One model call over `spans`, the logits of every row in `logits`.
  void forward(KvStore& store, const std::vector<SeqSpan>& spans, const Tokens& tokens,
               std::vector<float>& logits) {
    logits.assign(tokens.size() * static_cast<std::size_t>(vocab_), 0.0f);
    const Status s = model_->forward(store, spans, tokens.data(), logits.data());
    ASSERT_TRUE(s.ok()) << s.to_string();
    ++stats_.calls;
    stats_.tokens += std::ssize(tokens);
  }

  // Logits rows [0, count) are those of positions [from, from + count) of
  // the solo run.
  ::testing::AssertionResult solo_logits(const Solo& solo, std::int64_t from, std::int64_t count,
                                         const float* logits) const {
    const auto v = static_cast<std::size_t>(vocab_);
    for (std::int64_t i = 0; i < count; ++i)
      if (!same_bits(logits + static_cast<std::size_t>(i) * v,
                     solo.logits.data() + static_cast<std::size_t>(from + i) * v, v))
        return ::testing::AssertionFailure() << "logits differ from the solo run's at position " << from + i;
    return ::testing::AssertionSuccess();
  }

  // Advances every member to its `until` in random batches: a random subset
  // of the members in a random order, all decode steps or chunks of random
  // sizes; checks every row's logits against the solo runs.
  void rounds(KvStore& store, std::vector<Member>& members) {
    std::vector<float> logits;
    for (;;) {
      std::vector<Member*> open;
      for (Member& m : members)
        if (m.at < m.until) open.push_back(&m);
      if (open.empty()) return;
      std::shuffle(open.begin(), open.end(), rng_);
      const bool decode = uniform(rng_, 0, 2) == 0;
      std::vector<Member*> batch;
      std::vector<SeqSpan> spans;
      Tokens tokens;
      for (Member* m : open) {
        if (!batch.empty() && uniform(rng_, 0, 2) == 0) continue;
        const std::int64_t n = decode ? 1 : chunk(m->until - m->at);
        batch.push_back(m);
        spans.push_back({m->seq, m->at, n});
        tokens.insert(tokens.end(), m->solo->tokens.begin() + m->at, m->solo->tokens.begin() + m->at + n);
      }
      forward(store, spans, tokens, logits);
      if (stopped()) return;
      std::int64_t row = 0;
      for (std::size_t i = 0; i < batch.size(); ++i) {
        ASSERT_TRUE(solo_logits(*batch[i]->solo, spans[i].start, spans[i].count,
                                logits.data() + row * vocab_))
            << "in a batch of " << spans.size() << " spans";
        row += spans[i].count;
        batch[i]->at += spans[i].count;
      }
    }
  }

  // Decodes a solo run one token at a time up to `until`.
  void decode(Solo& solo, std::int64_t until) {
    auto next = solo.store->next_position(solo.seq);
    ASSERT_TRUE(next.ok());
    for (std::int64_t p = *next; p < until; ++p) {
      const SeqSpan span{solo.seq, p, 1};
      const Status s = model_->forward(*solo.store, {&span, 1}, solo.tokens.data() + p,
                                       solo.logits.data() + p * vocab_);
      ASSERT_TRUE(s.ok()) << "solo decode at " << p << ": " << s.to_string();
      ++stats_.calls;
      ++stats_.tokens;
    }
  }

  // The streams: the first of random length; each other one the first's
  // leading `branch` tokens, then tokens of its own.
  void streams() {
    const std::int64_t context = options_.context;
    const auto n = static_cast<std::size_t>(uniform(rng_, 2, 4));
    solos_.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      Solo& s = solos_[i];
      const std::int64_t length = uniform(rng_, 2, context);
      if (i > 0) {
        s.branch = uniform(rng_, 0, std::min(solos_[0].length(), length - 1));
        s.tokens.assign(solos_[0].tokens.begin(), solos_[0].tokens.begin() + s.branch);
      }
      const Tokens own = seeded_tokens(length - s.branch, vocab_, rng_());
      s.tokens.insert(s.tokens.end(), own.begin(), own.end());
      s.logits.assign(static_cast<std::size_t>(length * vocab_), 0.0f);
      s.store = make(options_);
      ASSERT_TRUE(s.store != nullptr);
      auto seq = s.store->add_sequence();
      ASSERT_TRUE(seq.ok());
      s.seq = *seq;
      // The first stream is decoded alongside (a).
      if (i > 0) decode(s, length);
      if (stopped()) return;
    }
  }

  // (a) Chunks of random sizes against the decode, at every chunk's end.
  void prefill_chunks() {
    SCOPED_TRACE("(a) prefill chunks");
    Solo& solo = solos_[0];
    auto store = make(options_);
    ASSERT_TRUE(store != nullptr);
    auto seq = store->add_sequence();
    ASSERT_TRUE(seq.ok());
    std::vector<float> logits;
    for (std::int64_t at = 0; at < solo.length();) {
      const std::int64_t n = chunk(solo.length() - at);
      forward(*store, {{*seq, at, n}}, Tokens(solo.tokens.begin() + at, solo.tokens.begin() + at + n),
              logits);
      if (stopped()) return;
      decode(solo, at + n);
      if (stopped()) return;
      ASSERT_TRUE(solo_logits(solo, at, n, logits.data())) << "a chunk of " << n;
      ASSERT_TRUE(same_image(*store, *seq, solo)) << "after a chunk of " << n << " at " << at;
      ASSERT_TRUE(same_rows(*store, *seq, *solo.store, solo.seq)) << "after a chunk of " << n << " at " << at;
      at += n;
    }
  }

  // (b) Every stream in one store, in random batches.
  void batches() {
    SCOPED_TRACE("(b) batches");
    StoreOptions o = options_;
    o.max_sequences = std::ssize(solos_) + uniform(rng_, 0, 2);
    o.block_rows = draw_block_rows(rng_);
    auto store = make(o);
    ASSERT_TRUE(store != nullptr);
    // A sequence added and removed first moves the slots and generations.
    if ((rng_() & 1) != 0) {
      auto gone = store->add_sequence();
      ASSERT_TRUE(gone.ok());
      ASSERT_TRUE(store->remove_sequence(*gone).ok());
    }
    std::vector<std::size_t> order(solos_.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng_);
    std::vector<Member> members;
    for (std::size_t i : order) {
      auto seq = store->add_sequence();
      ASSERT_TRUE(seq.ok());
      members.push_back({*seq, &solos_[i], 0, solos_[i].length()});
    }
    rounds(*store, members);
    if (stopped()) return;
    for (const Member& m : members) ASSERT_TRUE(same_image(*store, m.seq, *m.solo));
  }

  // (c) A snapshot part-way through a pack, restored and continued.
  void restores() {
    SCOPED_TRACE("(c) restores");
    const Solo& solo = solos_[0];
    const std::int64_t length = solo.length();
    const std::int64_t at = uniform(rng_, 1, length - 1);
    auto source = make(options_);
    ASSERT_TRUE(source != nullptr);
    auto seq = source->add_sequence();
    ASSERT_TRUE(seq.ok());
    std::vector<Member> first = {{*seq, &solo, 0, at}};
    rounds(*source, first);
    if (stopped()) return;
    auto snap = take_snapshot(*source, *seq);
    ASSERT_TRUE(snap.ok()) << snap.error().to_string();
    snap->token_ids.assign(solo.tokens.begin(), solo.tokens.begin() + at);
    snap->metadata = "gate";
    const std::int64_t chunk_choice = uniform(rng_, 0, 3);
    const WriteOptions write{
        .encoding = (rng_() & 1) != 0 ? Encoding::kF32Le : Encoding::kF16Le,
        .chunk_tokens = chunk_choice == 0   ? 1
                        : chunk_choice == 1 ? uniform(rng_, 2, 64)
                        : chunk_choice == 2 ? kDefaultChunkTokens
                                            : kMaxChunkTokens};
    const std::string trace = std::string("pack ") + encoding_name(write.encoding) + ", chunks of " +
                              std::to_string(write.chunk_tokens) + ", at " + std::to_string(at);
    SCOPED_TRACE(trace);

    // Into a fresh cache of the same options: from a pack in memory
    // (restore_pack) or in a file (read, then restore).
    auto cache = make_cpu_cache(config_, {.context = options_.context,
                                          .slack = options_.slack,
                                          .block_rows = options_.block_rows,
                                          .attention = options_.attention});
    ASSERT_TRUE(cache.ok()) << cache.error().to_string();
    Snapshot back;
    if ((rng_() & 1) != 0) {
      auto bytes = encode_pack(*snap, write);
      ASSERT_TRUE(bytes.ok()) << bytes.error().to_string();
      const auto src = memory_pack_source(bytes->data(), static_cast<std::int64_t>(bytes->size()));
      const Status s = restore_pack(*src, {}, **cache);
      ASSERT_TRUE(s.ok()) << s.to_string();
      auto read = read_pack(*src);
      ASSERT_TRUE(read.ok()) << read.error().to_string();
      back = std::move(*read);
    } else {
      const std::string dir = testing::make_temp_dir("gate");
      const std::string path = dir + "/snapshot.kvpack";
      const Status w = write_pack(*snap, path, write);
      auto read = read_pack_file(path);
      testing::remove_tree(dir);
      ASSERT_TRUE(w.ok()) << w.to_string();
      ASSERT_TRUE(read.ok()) << read.error().to_string();
      back = std::move(*read);
      const Status s = restore(back, **cache);
      ASSERT_TRUE(s.ok()) << s.to_string();
    }
    ++stats_.restores;
    ASSERT_EQ(back.token_ids, snap->token_ids);
    ASSERT_EQ(back.metadata, snap->metadata);
    ASSERT_TRUE(same_rows((*cache)->store(), (*cache)->seq(), *source, *seq)) << "restored";
    // Without slack the restored sequence is the live one, byte for byte.
    if (options_.slack == 0) {
      ASSERT_TRUE(testing::image((*cache)->store(), (*cache)->seq()) == testing::image(*source, *seq))
          << "restored";
    }
    std::vector<Member> fresh = {{(*cache)->seq(), &solo, at, length}};
    rounds((*cache)->store(), fresh);
    if (stopped()) return;
    ASSERT_TRUE(same_rows((*cache)->store(), (*cache)->seq(), *solo.store, solo.seq));
    // Once the continuation has refilled the slack rows a snapshot leaves
    // out, the restored sequence is the uninterrupted one, byte for byte.
    if (length - at >= options_.slack) {
      ASSERT_TRUE(same_image((*cache)->store(), (*cache)->seq(), solo));
    }

    // Into a store of another slack, block size and context, as a new
    // sequence beside another stream that runs on around it.
    StoreOptions o = options_;
    o.max_sequences = 2;
    o.slack = draw_slack(rng_, config_.sliding_window);
    o.block_rows = draw_block_rows(rng_);
    o.context = uniform(rng_, std::max(length, solos_[1].length()), config_.max_context);
    SCOPED_TRACE("into slack " + std::to_string(o.slack) + ", block_rows " + std::to_string(o.block_rows) +
                 ", context " + std::to_string(o.context));
    auto other = make(o);
    ASSERT_TRUE(other != nullptr);
    auto neighbour = other->add_sequence();
    ASSERT_TRUE(neighbour.ok());
    const std::int64_t half = uniform(rng_, 0, solos_[1].length());
    std::vector<Member> members = {{*neighbour, &solos_[1], 0, half}};
    rounds(*other, members);
    if (stopped()) return;
    auto restored = restore_new_sequence(back, *other);
    ASSERT_TRUE(restored.ok()) << restored.error().to_string();
    ++stats_.restores;
    members.push_back({*restored, &solo, at, length});
    members[0].until = solos_[1].length();
    rounds(*other, members);
    if (stopped()) return;
    ASSERT_TRUE(same_rows(*other, *restored, *solo.store, solo.seq));
    ASSERT_TRUE(same_rows(*other, *neighbour, *solos_[1].store, solos_[1].seq));
  }

  // (d) Forks of the first stream at each branch point, continued in random
  // batches.
  void forks() {
    SCOPED_TRACE("(d) forks");
    StoreOptions o = options_;
    o.max_sequences = std::ssize(solos_);
    o.block_rows = draw_block_rows(rng_);
    auto store = make(o);
    ASSERT_TRUE(store != nullptr);
    auto root = store->add_sequence();
    ASSERT_TRUE(root.ok());
    std::vector<Member> members = {{*root, &solos_[0], 0, 0}};
    std::vector<const Solo*> branches;
    for (std::size_t i = 1; i < solos_.size(); ++i) branches.push_back(&solos_[i]);
    std::sort(branches.begin(), branches.end(),
              [](const Solo* a, const Solo* b) { return a->branch < b->branch; });
    for (const Solo* b : branches) {
      // The root runs to the branch point, the branches so far part of the way.
      members[0].until = b->branch;
      for (std::size_t i = 1; i < members.size(); ++i)
        members[i].until = uniform(rng_, members[i].at, members[i].solo->length());
      rounds(*store, members);
      if (stopped()) return;
      auto fork = store->fork_sequence(*root);
      ASSERT_TRUE(fork.ok()) << fork.error().to_string();
      ++stats_.forks;
      members.push_back({*fork, b, b->branch, b->branch});
    }
    // The root removed: its blocks stay with the branches that share them.
    if (uniform(rng_, 0, 2) == 0) {
      ASSERT_TRUE(store->remove_sequence(*root).ok());
      members.erase(members.begin());
    }
    for (Member& m : members) m.until = m.solo->length();
    rounds(*store, members);
    if (stopped()) return;
    for (const Member& m : members) ASSERT_TRUE(same_image(*store, m.seq, *m.solo));
  }

  // (e) Garbage fed, rolled back, the stream re-fed.
  void rollbacks() {
    SCOPED_TRACE("(e) rollbacks");
    const Solo& solo = solos_[0];
    const std::int64_t length = solo.length(), slack = options_.slack;
    auto store = make(options_);
    ASSERT_TRUE(store != nullptr);
    auto seq = store->add_sequence();
    ASSERT_TRUE(seq.ok());
    std::vector<Member> member = {{*seq, &solo, 0, 0}};
    std::int64_t furthest = 0;
    std::vector<float> logits;
    for (int round = 0; round < 4 && member[0].at < length; ++round) {
      member[0].until = uniform(rng_, member[0].at + 1, length);
      rounds(*store, member);
      if (stopped()) return;
      const std::int64_t at = member[0].at;
      if (at == length) break;
      // Tokens of a draft that is then rejected.
      const std::int64_t garbage = uniform(rng_, 1, std::min(slack + 4, length - at));
      const Tokens draft = seeded_tokens(garbage, vocab_, rng_());
      for (std::int64_t i = 0; i < garbage;) {
        const std::int64_t n = chunk(garbage - i);
        forward(*store, {{*seq, at + i, n}}, Tokens(draft.begin() + i, draft.begin() + i + n), logits);
        if (stopped()) return;
        i += n;
      }
      furthest = std::max(furthest, at + garbage);
      const std::int64_t end = uniform(rng_, std::max<std::int64_t>(0, at - 8), at);
      // The documented rule: every sliding ring still holds what a ring
      // without slack holds at the new end, always so within the slack of
      // the furthest position reached.
      bool allowed = true;
      for (std::int64_t l = 0; l < config_.n_layers; ++l) {
        if (config_.kind(l) != LayerKind::kSlidingRope) continue;
        auto ring = store->ring(*seq, l);
        ASSERT_TRUE(ring.ok());
        const std::int64_t unslacked = store->capacity(l) - slack;
        allowed = allowed && ring->origin_logical() <= std::max<std::int64_t>(0, end - unslacked);
      }
      if (end >= furthest - slack) {
        ASSERT_TRUE(allowed) << "the test's rule misses the guarantee";
      }
      const testing::CacheImage before = testing::image(*store, *seq);
      const Status s = store->truncate_sequence(*seq, at + garbage - end);
      SCOPED_TRACE("rollback from " + std::to_string(at + garbage) + " to " + std::to_string(end) +
                   ", furthest " + std::to_string(furthest));
      ASSERT_EQ(s.ok(), allowed) << s.to_string();
      if (s.ok()) {
        ++stats_.rollbacks;
        auto next = store->next_position(*seq);
        ASSERT_TRUE(next.ok());
        ASSERT_EQ(*next, end);
        member[0].at = end;
        continue;
      }
      ++stats_.refused;
      ASSERT_TRUE(testing::image(*store, *seq) == before) << "a refused rollback changed the sequence";
      // Start over: an emptied sequence is a fresh one.
      ASSERT_TRUE(store->reset_sequence(*seq).ok());
      member[0].at = 0;
      furthest = 0;
    }
    member[0].until = length;
    rounds(*store, member);
    if (stopped()) return;
    ASSERT_TRUE(same_image(*store, *seq, solo));
  }


  std::mt19937_64 rng_;
  Stats& stats_;
  int parts_;
  ModelConfig config_;
  StoreOptions options_;  // every solo run's store (one sequence)
  std::int64_t vocab_ = 0;
  std::shared_ptr<const ReferenceModel> model_;
  std::string text_;
  std::vector<Solo> solos_;
};

TEST(ModelGates, RandomGeometriesKeepEveryInvariance) {
  const std::uint64_t seeds = testing::env_or("KVRING_GATE_SEEDS", 60);
  const std::uint64_t first = testing::env_or("KVRING_GATE_FIRST_SEED", 1);
  const bool progress = testing::env_or("KVRING_GATE_PROGRESS", 0) != 0;
  Stats stats;
  int failed = 0;
  for (std::uint64_t seed = first; seed < first + seeds && failed < 3; ++seed) {
    const auto* result = ::testing::UnitTest::GetInstance()->current_test_info()->result();
    const int before = result->total_part_count();
    Gate gate(seed, stats);
    if (progress) std::fprintf(stderr, "seed %llu: %s\n", static_cast<unsigned long long>(seed),
                               gate.description().c_str());
    {
      SCOPED_TRACE("seed " + std::to_string(seed) + ": " + gate.description());
      gate.run();
    }
    ++stats.seeds;
    // Every recorded part is a failure: a new one is this seed's.
    if (result->total_part_count() > before) ++failed;
  }
  std::printf("%lld seeds (%lld f16, %lld all-sliding, %lld all-full): %lld model calls, %lld tokens, "
              "%lld forks, %lld restores, %lld rollbacks, %lld refused\n",
              static_cast<long long>(stats.seeds), static_cast<long long>(stats.f16),
              static_cast<long long>(stats.all_sliding), static_cast<long long>(stats.all_full),
              static_cast<long long>(stats.calls), static_cast<long long>(stats.tokens),
              static_cast<long long>(stats.forks), static_cast<long long>(stats.restores),
              static_cast<long long>(stats.rollbacks), static_cast<long long>(stats.refused));
}

}  // namespace
}  // namespace kvring
