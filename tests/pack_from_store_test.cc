// write_pack from a store's sequence: the same file as the pack of its
// snapshot, bit for bit, for forked, truncated, wrapped and empty
// sequences, both encodings, self-contained and thin; the same refusals,
// leaving no file and no chunk.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <sys/stat.h>

#include "kvring/pack.h"
#include "kvring/store.h"
#include "pack/pack_common.h"
#include "pack_test_util.h"
#include "test_util.h"

namespace kvring {
namespace {

using testing::small_config;

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

bool exists(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0;
}

std::vector<std::int32_t> ids_for(std::int64_t n, std::int32_t salt) {
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) ids[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i * 7919 + salt);
  return ids;
}

class PackFromStore : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::make_temp_dir("pack-from-store");
    cfg_ = small_config(32, 256, 8);
    // Slack rows, which a pack never records, and blocks of 16 rows.
    auto made = make_store(BackendKind::kCpu, cfg_,
                           {.max_sequences = 4, .context = 256, .slack = 8, .block_rows = 16});
    ASSERT_TRUE(made.ok()) << made.error().to_string();
    store_ = std::move(*made);
    const std::int64_t kv = cfg_.kv_dim();
    const auto x = testing::random_floats(static_cast<std::size_t>(cfg_.n_layers * 100 * kv), 31);
    const auto y = testing::random_floats(static_cast<std::size_t>(cfg_.n_layers * 100 * kv), 32);
    // long_: 100 positions (the 32-row rings wrapped).
    long_ = *store_->add_sequence();
    const SeqSpan a{long_, 0, 100};
    ASSERT_TRUE(store_->store_all_layers({&a, 1}, host_view(x.data(), cfg_.n_layers * 100, kv),
                                         host_view(y.data(), cfg_.n_layers * 100, kv)).ok());
    // fork_: shares long_'s blocks, rolled back 5 positions, then 41 of its
    // own rows (copies on write inside a shared block).
    fork_ = *store_->fork_sequence(long_);
    ASSERT_TRUE(store_->truncate_sequence(fork_, 5).ok());
    const SeqSpan b{fork_, 95, 41};
    ASSERT_TRUE(store_->store_all_layers({&b, 1}, host_view(y.data(), cfg_.n_layers * 41, kv),
                                         host_view(x.data(), cfg_.n_layers * 41, kv)).ok());
    empty_ = *store_->add_sequence();
  }
  void TearDown() override { testing::remove_tree(dir_); }

  // The pack of the sequence's snapshot with these extras.
  Status snapshot_pack(SeqId seq, const std::vector<std::int32_t>& ids, const std::string& meta,
                       const std::string& path, const WriteOptions& o) {
    auto snap = take_snapshot(*store_, seq);
    if (!snap) return snap.error();
    snap->token_ids = ids;
    snap->metadata = meta;
    return write_pack(*snap, path, o);
  }

  // The pack reads back (its chunks from `chunks`) as the sequence's
  // snapshot with these extras.
  void expect_reads_as(const PackSource& src, const ChunkStore* chunks, SeqId seq,
                       const std::vector<std::int32_t>& ids, const std::string& meta) {
    auto back = read_pack(src, {.store = chunks});
    ASSERT_TRUE(back.ok()) << back.error().to_string();
    auto want = take_snapshot(*store_, seq);
    ASSERT_TRUE(want.ok());
    want->token_ids = ids;
    want->metadata = meta;
    EXPECT_TRUE(testing::same_rows(*back, *want));
  }

  std::string dir_;
  ModelConfig cfg_;
  std::unique_ptr<KvStore> store_;
  SeqId long_{}, fork_{}, empty_{};
};

TEST_F(PackFromStore, IsTheSnapshotsPackBitForBit) {
  for (const SeqId seq : {long_, fork_, empty_}) {
    const std::int64_t n = *store_->next_position(seq);
    for (const bool with_ids : {false, true}) {
      const auto ids = with_ids ? ids_for(n, 3) : std::vector<std::int32_t>{};
      const std::string meta = with_ids ? "engine state \x01\x02" : "";
      for (const Encoding enc : {Encoding::kF16Le, Encoding::kF32Le}) {
        for (const std::int64_t chunk : {1, 7, 16, 256}) {
          SCOPED_TRACE(seq_name(seq) + " of " + std::to_string(n) + " positions, " +
                       encoding_name(enc) + ", chunk " + std::to_string(chunk) +
                       (with_ids ? ", ids" : ""));
          const WriteOptions o{.encoding = enc, .chunk_tokens = chunk};
          ASSERT_TRUE(snapshot_pack(seq, ids, meta, dir_ + "/snap.kvpack", o).ok());
          const Status s = write_pack(*store_, seq, dir_ + "/store.kvpack", ids, meta, o);
          ASSERT_TRUE(s.ok()) << s.to_string();
          const std::string want = file_bytes(dir_ + "/snap.kvpack");
          ASSERT_GT(want.size(), 0u);
          EXPECT_TRUE(file_bytes(dir_ + "/store.kvpack") == want);
        }
      }
    }
  }
}

// Thin: the same manifest file and the same chunks in the store.
TEST_F(PackFromStore, AThinPackPutsTheSameChunks) {
  auto from_snapshot = open_dir_store(dir_ + "/chunks-a");
  auto from_store = open_dir_store(dir_ + "/chunks-b");
  ASSERT_TRUE(from_snapshot.ok() && from_store.ok());
  for (const SeqId seq : {long_, fork_}) {
    const auto ids = ids_for(*store_->next_position(seq), 11);
    for (const Encoding enc : {Encoding::kF16Le, Encoding::kF32Le}) {
      SCOPED_TRACE(seq_name(seq) + ", " + encoding_name(enc));
      ASSERT_TRUE(snapshot_pack(seq, ids, "m", dir_ + "/a.kvpack",
                                {.encoding = enc, .chunk_tokens = 8, .store = from_snapshot->get()}).ok());
      const Status s = write_pack(*store_, seq, dir_ + "/b.kvpack", ids, "m",
                                  {.encoding = enc, .chunk_tokens = 8, .store = from_store->get()});
      ASSERT_TRUE(s.ok()) << s.to_string();
      EXPECT_TRUE(file_bytes(dir_ + "/a.kvpack") == file_bytes(dir_ + "/b.kvpack"));
      auto a = (*from_snapshot)->stats();
      auto b = (*from_store)->stats();
      ASSERT_TRUE(a.ok() && b.ok());
      EXPECT_EQ(a->chunks, b->chunks);
      EXPECT_EQ(a->bytes, b->bytes);
      // Every chunk the manifest names is in the second store, and the
      // pack restores the sequence there.
      auto src = open_pack_file(dir_ + "/b.kvpack");
      ASSERT_TRUE(src.ok());
      auto v = verify_pack(**src, from_store->get());
      ASSERT_TRUE(v.ok());
      EXPECT_EQ(v->bad_chunks, 0);
      EXPECT_GT(v->chunks, 0);
      expect_reads_as(**src, from_store->get(), seq, ids, "m");
    }
  }
}

// Puts a thin writer makes, counted, into a directory store.
class PutCountingStore final : public ChunkStore {
 public:
  explicit PutCountingStore(ChunkStore& inner) : inner_(inner) {}
  std::string spec() const override { return inner_.spec(); }
  Status put(std::span<const ChunkData> chunks) override {
    ++puts;
    return inner_.put(chunks);
  }
  Result<bool> contains(const Digest& name) const override { return inner_.contains(name); }
  Status check_stored(const Digest& name, std::int64_t bytes) const override {
    return inner_.check_stored(name, bytes);
  }
  Status erase(const Digest& name) override { return inner_.erase(name); }
  Result<StoreStats> stats() const override { return inner_.stats(); }
  int puts = 0;

 protected:
  Status read_raw(const Digest& name, std::span<std::uint8_t> dst) const override { return inner_.get(name, dst); }

 private:
  ChunkStore& inner_;
};

// Planes are read in groups of consecutive layers whose rows fit the
// larger of the group's bytes and the longest plane: any grouping writes
// the snapshot's pack, and a thin pack puts its chunks once a group.
// long_'s planes hold 32 rows (sliding) and 100 (full).
TEST_F(PackFromStore, GroupsOfPlanesWriteTheSamePack) {
  const std::int64_t row_bytes = 2 * cfg_.kv_dim() * 2;
  const auto ids = ids_for(100, 5);
  std::vector<std::int64_t> rows;
  for (std::int64_t l = 0; l < cfg_.n_layers; ++l)
    rows.push_back(cfg_.kind(l) == LayerKind::kSlidingRope ? 32 : 100);
  std::int64_t all = 0;
  for (const std::int64_t r : rows) all += r;
  // Consecutive planes while their rows fit, at least one a group.
  const auto groups = [&](std::int64_t budget_rows) {
    budget_rows = std::max<std::int64_t>(budget_rows, 100);
    int n = 0;
    for (std::size_t l = 0; l < rows.size(); ++n) {
      std::int64_t held = rows[l++];
      while (l < rows.size() && held + rows[l] <= budget_rows) held += rows[l++];
    }
    return n;
  };
  // Groups of the longest plane, of two planes' rows, and all at once.
  ASSERT_GT(groups(1), groups(200));
  ASSERT_GT(groups(200), 1);
  ASSERT_EQ(groups(all), 1);
  for (const std::int64_t budget_rows : {std::int64_t{1}, std::int64_t{200}, all}) {
    const std::int64_t group_bytes = budget_rows * row_bytes;
    for (const Encoding enc : {Encoding::kF16Le, Encoding::kF32Le}) {
      SCOPED_TRACE(std::to_string(group_bytes) + " bytes a group, " + encoding_name(enc));
      const WriteOptions o{.encoding = enc, .chunk_tokens = 16};
      ASSERT_TRUE(snapshot_pack(long_, ids, "g", dir_ + "/snap.kvpack", o).ok());
      const Status s = pack_internal::write_pack_in_groups(*store_, long_, dir_ + "/store.kvpack", ids, "g", o,
                                                           group_bytes);
      ASSERT_TRUE(s.ok()) << s.to_string();
      EXPECT_TRUE(file_bytes(dir_ + "/store.kvpack") == file_bytes(dir_ + "/snap.kvpack"));
      auto chunks = open_dir_store(dir_ + "/chunks-" + std::to_string(group_bytes) + encoding_name(enc));
      ASSERT_TRUE(chunks.ok());
      PutCountingStore counting(**chunks);
      WriteOptions thin = o;
      thin.store = &counting;
      ASSERT_TRUE(pack_internal::write_pack_in_groups(*store_, long_, dir_ + "/thin.kvpack", ids, "g", thin,
                                                      group_bytes).ok());
      EXPECT_EQ(counting.puts, groups(budget_rows));
      auto src = open_pack_file(dir_ + "/thin.kvpack");
      ASSERT_TRUE(src.ok());
      expect_reads_as(**src, chunks->get(), long_, ids, "g");
    }
  }
}

TEST_F(PackFromStore, ACacheIsWrittenAsItsSequence) {
  auto cache = testing::filled_cache(cfg_, 256, 77, 5);
  const Snapshot snap = testing::snapshot_with_extras(*cache, 9);
  ASSERT_TRUE(write_pack(snap, dir_ + "/snap.kvpack").ok());
  ASSERT_TRUE(write_pack(*cache, dir_ + "/cache.kvpack", snap.token_ids, snap.metadata).ok());
  EXPECT_TRUE(file_bytes(dir_ + "/snap.kvpack") == file_bytes(dir_ + "/cache.kvpack"));
}

// Each refusal leaves no file at the path and no chunk in the store.
TEST_F(PackFromStore, RefusalsLeaveNoFileAndNoChunk) {
  auto chunks = open_dir_store(dir_ + "/chunks");
  ASSERT_TRUE(chunks.ok());
  const std::string path = dir_ + "/p.kvpack";
  const auto ids = ids_for(100, 1);
  auto removed = store_->fork_sequence(long_);
  ASSERT_TRUE(removed.ok());
  ASSERT_TRUE(store_->remove_sequence(*removed).ok());
  auto detached = store_->add_detached_sequence();
  ASSERT_TRUE(detached.ok());
  struct Case {
    std::string what;
    SeqId seq;
    std::vector<std::int32_t> ids;
    std::string metadata;
    WriteOptions options;
    std::string path;
    ErrorCode code;
    std::string words;
  };
  const WriteOptions thin{.chunk_tokens = 8, .store = chunks->get()};
  WriteOptions bad_chunk = thin;
  bad_chunk.chunk_tokens = 0;
  const std::vector<Case> cases = {
      {"a removed sequence", *removed, {}, "", thin, path, ErrorCode::kNotFound, ""},
      {"a detached sequence", *detached, {}, "", thin, path, ErrorCode::kNotFound, ""},
      {"ids of another length", long_, ids_for(99, 1), "", thin, path, ErrorCode::kInvalidArgument,
       "token"},
      {"chunk_tokens 0", long_, ids, "", bad_chunk, path, ErrorCode::kInvalidArgument, "chunk_tokens 0"},
      {"metadata past the manifest's limit", long_, ids,
       std::string(static_cast<std::size_t>(kMaxManifestBytes), 'm'), thin, path,
       ErrorCode::kInvalidArgument, "manifest"},
      {"a directory as destination", long_, ids, "", thin, dir_, ErrorCode::kInvalidArgument, ""},
      {"a missing directory", long_, ids, "", thin, dir_ + "/none/p.kvpack", ErrorCode::kNotFound, ""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const Status s = write_pack(*store_, c.seq, c.path, c.ids, c.metadata, c.options);
    ASSERT_FALSE(s.ok());
    // Each refusal is also the snapshot path's, where a snapshot exists.
    if (c.seq == long_) {
      const Status snap = snapshot_pack(c.seq, c.ids, c.metadata, c.path, c.options);
      ASSERT_FALSE(snap.ok());
      EXPECT_EQ(snap.error().code, s.error().code) << s.to_string() << " / " << snap.to_string();
    } else {
      EXPECT_EQ(s.error().code, c.code) << s.to_string();
    }
    EXPECT_NE(s.error().message.find(c.words), std::string::npos) << s.to_string();
    EXPECT_FALSE(exists(path));
    auto stats = (*chunks)->stats();
    ASSERT_TRUE(stats.ok());
    EXPECT_EQ(stats->chunks, 0);
  }
  // The same sequence and store, written where it may be.
  ASSERT_TRUE(write_pack(*store_, long_, path, ids, "", thin).ok());
  EXPECT_GT((*chunks)->stats()->chunks, 0);
}

// A detached sequence, whose rows may still be arriving, has no header
// either, and its refusal comes before the destination is opened.
TEST_F(PackFromStore, ADetachedSequenceIsRefusedBeforeTheDestination) {
  auto detached = store_->add_detached_sequence();
  ASSERT_TRUE(detached.ok());
  Snapshot header;
  const Status h = take_snapshot_header(*store_, *detached, header);
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.error().code, ErrorCode::kNotFound) << h.to_string();
  EXPECT_NE(h.error().message.find("detached"), std::string::npos) << h.to_string();
  int opens = 0;
  WriteOptions o;
  o.io.fault = [&opens](IoStep step, const std::string&) {
    opens += step == IoStep::kOpen;
    return Status::Ok();
  };
  // A directory as destination, and ids of another length: the sequence
  // is what is refused.
  const Status s = write_pack(*store_, *detached, dir_, ids_for(3, 0), "", o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, ErrorCode::kNotFound) << s.to_string();
  EXPECT_EQ(opens, 0);
}

// A header is the snapshot without its rows.
TEST_F(PackFromStore, AHeaderIsTheSnapshotWithoutRows) {
  for (const SeqId seq : {long_, fork_, empty_}) {
    Snapshot header;
    ASSERT_TRUE(take_snapshot_header(*store_, seq, header).ok());
    auto full = take_snapshot(*store_, seq);
    ASSERT_TRUE(full.ok());
    EXPECT_TRUE(validate_snapshot(header, /*header_only=*/true).ok());
    EXPECT_EQ(header.row_bytes(), full->row_bytes());
    EXPECT_EQ(header.token_count, full->token_count);
    ASSERT_EQ(header.planes.size(), full->planes.size());
    for (std::size_t l = 0; l < header.planes.size(); ++l) {
      EXPECT_TRUE(header.planes[l].ring == full->planes[l].ring) << "layer " << l;
      EXPECT_TRUE(header.planes[l].k.empty() && header.planes[l].v.empty()) << "layer " << l;
    }
  }
}

// A path that names no file is refused before anything is written or put
// in a store, as check_pack_destination says beforehand.
TEST_F(PackFromStore, APathThatNamesNoFileIsRefusedFirst) {
  auto chunks = open_dir_store(dir_ + "/chunks");
  ASSERT_TRUE(chunks.ok());
  for (const std::string& path : {std::string(), dir_ + "/none/"}) {
    SCOPED_TRACE("'" + path + "'");
    EXPECT_FALSE(check_pack_destination(path).ok());
    const Status s = write_pack(*store_, long_, path, {}, "", {.chunk_tokens = 8, .store = chunks->get()});
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.error().code, ErrorCode::kInvalidArgument) << s.to_string();
    EXPECT_EQ((*chunks)->stats()->chunks, 0);
    auto snap = take_snapshot(*store_, long_);
    ASSERT_TRUE(snap.ok());
    EXPECT_FALSE(write_pack(*snap, path, {.chunk_tokens = 8, .store = chunks->get()}).ok());
    EXPECT_EQ((*chunks)->stats()->chunks, 0);
  }
}

// A failed step of the file's atomic write leaves no pack.
TEST_F(PackFromStore, AFailedWriteLeavesNoPack) {
  const std::string path = dir_ + "/p.kvpack";
  for (IoStep step : {IoStep::kOpen, IoStep::kWrite, IoStep::kFsync, IoStep::kRename}) {
    SCOPED_TRACE(io_step_name(step));
    WriteOptions o{.chunk_tokens = 8};
    o.io.fault = [step](IoStep at, const std::string&) {
      return at == step ? Status(io_error("injected")) : Status::Ok();
    };
    const Status s = write_pack(*store_, long_, path, {}, "", o);
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.error().message.find("injected"), std::string::npos) << s.to_string();
    EXPECT_FALSE(exists(path));
    for (const std::string& n : testing::list_dir(dir_)) EXPECT_EQ(n.find("p.kvpack"), std::string::npos) << n;
  }
}

}  // namespace
}  // namespace kvring
