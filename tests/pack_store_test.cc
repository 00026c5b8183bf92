// Chunk stores (a directory, and Redis started on loopback by the test):
// reads verify names, thin packs round-trip, a missing or planted chunk is an
// error naming it, prefix sharing stores shared chunks once, and a crash
// mid-write never leaves a chunk or a pack that reads as valid.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <atomic>
#include <chrono>
#include <thread>
#include <mutex>
#include <map>

#include "cpu/parallel.h"
#include "kvring/chunk_store.h"
#include "kvring/pack.h"
#include "pack/file_io.h"
#include "pack_test_util.h"
#include "test_util.h"

namespace kvring {
namespace {

using testing::filled_cache;
using testing::image;
using testing::small_config;

std::span<const std::uint8_t> bytes_of(const std::string& s) {
  return {reinterpret_cast<const std::uint8_t*>(s.data()), s.size()};
}
ChunkData chunk_of(const std::string& bytes) {
  return ChunkData{sha256(bytes.data(), bytes.size()), bytes_of(bytes), {}};
}

// The same tests for both stores.
class StoreTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "dir") {
      dir_ = testing::make_temp_dir("store");
      spec_ = "dir:" + dir_;
    } else {
      std::string why;
      redis_ = testing::RedisServer::start(&why);
      if (!redis_) {
        if (why.find("not installed") != std::string::npos || why.find("no Redis store") != std::string::npos)
          GTEST_SKIP() << why;
        FAIL() << why;
      }
      spec_ = redis_->spec();
    }
    auto s = open_chunk_store(spec_);
    ASSERT_TRUE(s.ok()) << s.error().to_string();
    store_ = std::move(*s);
  }
  void TearDown() override {
    store_.reset();
    redis_.reset();
    if (!dir_.empty()) testing::remove_tree(dir_);
  }

  std::string dir_, spec_;
  std::unique_ptr<testing::RedisServer> redis_;
  std::unique_ptr<ChunkStore> store_;
};

TEST_P(StoreTest, PutGetContainsStats) {
  const std::string a = "the K and V rows of a chunk", b(100000, 'q');
  const ChunkData ca = chunk_of(a), cb = chunk_of(b);
  const std::vector<ChunkData> chunks = {ca, cb, ca};  // a duplicate is stored once
  ASSERT_TRUE(store_->put(chunks).ok());
  ASSERT_TRUE(store_->put(chunks).ok());  // and again: nothing changes
  auto stats = store_->stats();
  ASSERT_TRUE(stats.ok()) << stats.error().to_string();
  EXPECT_EQ(stats->chunks, 2);
  EXPECT_EQ(stats->bytes, static_cast<std::int64_t>(a.size() + b.size()));
  std::string got(b.size(), '\0');
  ASSERT_TRUE(store_->get(cb.name, {reinterpret_cast<std::uint8_t*>(got.data()), got.size()}).ok());
  EXPECT_EQ(got, b);
  EXPECT_TRUE(*store_->contains(ca.name));
  ASSERT_TRUE(store_->erase(ca.name).ok());
  EXPECT_FALSE(*store_->contains(ca.name));
}

TEST_P(StoreTest, ReadsVerifyTheName) {
  const std::string real = "what the writer stored", fake = "what an attacker stored";
  std::string buf(real.size(), '\0');
  std::span<std::uint8_t> dst(reinterpret_cast<std::uint8_t*>(buf.data()), buf.size());
  const Digest name = sha256(real.data(), real.size());
  const Status missing = store_->get(name, dst);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code, ErrorCode::kNotFound);
  EXPECT_NE(missing.error().message.find(to_hex(name) + " is missing"), std::string::npos);
  // Planted: other bytes of another size, then of the same size.
  const std::vector<ChunkData> planted = {{name, bytes_of(fake), {}}};
  ASSERT_TRUE(store_->put(planted).ok());
  const Status size = store_->get(name, dst);
  ASSERT_FALSE(size.ok());
  EXPECT_EQ(size.error().code, ErrorCode::kCorruption);
  EXPECT_NE(size.error().message.find(" bytes, the pack expects 22"), std::string::npos) << size.to_string();
  // A value far larger than expected is refused without reading it all.
  const std::string huge(1 << 20, 'h');
  ASSERT_TRUE(store_->erase(name).ok());
  const std::vector<ChunkData> planted_huge = {{name, bytes_of(huge), {}}};
  ASSERT_TRUE(store_->put(planted_huge).ok());
  const Status big = store_->get(name, dst);
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.error().code, ErrorCode::kCorruption);
  const std::string same_size = "what an attacker wrote";
  ASSERT_TRUE(store_->erase(name).ok());
  const std::vector<ChunkData> planted2 = {{name, bytes_of(same_size), {}}};
  ASSERT_TRUE(store_->put(planted2).ok());
  const Status hash = store_->get(name, dst);
  ASSERT_FALSE(hash.ok());
  EXPECT_EQ(hash.error().code, ErrorCode::kCorruption);
  EXPECT_NE(hash.error().message.find("damaged or planted"), std::string::npos) << hash.to_string();
}

// check_stored answers what get() would refuse, without reading: absent,
// another size (either way), or present with the size asked.
TEST_P(StoreTest, CheckStoredComparesTheSizeUnread) {
  const std::string real = "a chunk of known size";
  const Digest name = sha256(real.data(), real.size());
  const auto size = static_cast<std::int64_t>(real.size());
  const Status missing = store_->check_stored(name, size);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code, ErrorCode::kNotFound);
  EXPECT_NE(missing.error().message.find(to_hex(name) + " is missing"), std::string::npos) << missing.to_string();
  const std::vector<ChunkData> chunk = {{name, bytes_of(real), {}}};
  ASSERT_TRUE(store_->put(chunk).ok());
  EXPECT_TRUE(store_->check_stored(name, size).ok());
  for (const std::int64_t claim : {size - 1, size + 1, std::int64_t{1} << 30}) {
    const Status other = store_->check_stored(name, claim);
    ASSERT_FALSE(other.ok());
    EXPECT_EQ(other.error().code, ErrorCode::kCorruption);
    EXPECT_NE(other.error().message.find("holds 21 bytes, the pack expects " + std::to_string(claim)),
              std::string::npos)
        << other.to_string();
  }
  // An empty value is present, of size 0.
  const Digest empty = sha256("", 0);
  const std::vector<ChunkData> none = {{empty, {}, {}}};
  ASSERT_TRUE(store_->put(none).ok());
  EXPECT_TRUE(store_->check_stored(empty, 0).ok());
}

// A Redis key under a chunk's name that holds a list (WRONGTYPE to a
// read) is a planted chunk, kCorruption, not a failing link.
TEST_P(StoreTest, AKeyOfAnotherTypeIsAPlantedChunk) {
  if (GetParam() != "redis") GTEST_SKIP() << "Redis keys only";
  const std::string real = "rows under a listed name";
  const Digest name = sha256(real.data(), real.size());
  const std::string cmd = "redis-cli -p " + std::to_string(redis_->port()) + " RPUSH kvpack:chunk:" + to_hex(name) +
                          " x > /dev/null 2>&1";
  if (std::system(cmd.c_str()) != 0) GTEST_SKIP() << "no redis-cli to plant the key with";
  std::string buf(real.size(), '\0');
  const Status got = store_->get(name, {reinterpret_cast<std::uint8_t*>(buf.data()), buf.size()});
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.error().code, ErrorCode::kCorruption) << got.to_string();
  EXPECT_NE(got.error().message.find("holds a value that is not a string"), std::string::npos) << got.to_string();
  const Status checked = store_->check_stored(name, static_cast<std::int64_t>(real.size()));
  ASSERT_FALSE(checked.ok());
  EXPECT_EQ(checked.error().code, ErrorCode::kCorruption) << checked.to_string();
  // The store goes on: a put replaces the key, and it reads back.
  const std::vector<ChunkData> chunk = {{name, bytes_of(real), {}}};
  ASSERT_TRUE(store_->put(chunk).ok());
  ASSERT_TRUE(store_->get(name, {reinterpret_cast<std::uint8_t*>(buf.data()), buf.size()}).ok());
  EXPECT_EQ(buf, real);
}

// A planted value of the right size under a chunk's name does not stop the
// true bytes from being stored: the next put replaces it.
TEST_P(StoreTest, PutReplacesAPlantedChunk) {
  const std::string real = "the rows a writer means", fake = "the rows planted there!";
  ASSERT_EQ(real.size(), fake.size());
  const Digest name = sha256(real.data(), real.size());
  const std::vector<ChunkData> planted = {{name, bytes_of(fake), {}}};
  ASSERT_TRUE(store_->put(planted).ok());
  std::string buf(real.size(), '\0');
  std::span<std::uint8_t> dst(reinterpret_cast<std::uint8_t*>(buf.data()), buf.size());
  ASSERT_EQ(store_->get(name, dst).error().code, ErrorCode::kCorruption);
  const std::vector<ChunkData> honest = {chunk_of(real)};
  ASSERT_TRUE(store_->put(honest).ok());
  ASSERT_TRUE(store_->get(name, dst).ok());
  EXPECT_EQ(buf, real);
}

class ThinPackTest : public StoreTest {
 protected:
  void SetUp() override {
    StoreTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    pack_dir_ = testing::make_temp_dir("thin");
    path_ = pack_dir_ + "/s.kvpack";
    cfg_ = small_config(32, 256, 8);
    live_ = filled_cache(cfg_, 256, 90, 31);
    snap_ = testing::snapshot_with_extras(*live_, 2);
    ASSERT_TRUE(write_pack(snap_, path_, {.chunk_tokens = 16, .store = store_.get()}).ok());
    auto src = open_pack_file(path_);
    ASSERT_TRUE(src.ok());
    src_ = std::move(*src);
    auto m = read_manifest(*src_);
    ASSERT_TRUE(m.ok());
    manifest_ = *m;
    target_ = filled_cache(cfg_, 256, 12, 77);
    before_ = image(*target_);
  }
  void TearDown() override {
    src_.reset();
    if (!pack_dir_.empty()) testing::remove_tree(pack_dir_);
    StoreTest::TearDown();
  }
  void expect_restore_fails(ErrorCode code, const std::string& words) {
    const Status s = restore_pack(*src_, {.store = store_.get()}, *target_);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.error().code, code) << s.to_string();
    EXPECT_NE(s.error().message.find(words), std::string::npos) << s.to_string();
    EXPECT_TRUE(image(*target_) == before_);
  }

  std::string pack_dir_, path_;
  ModelConfig cfg_;
  std::unique_ptr<KvCache> live_, target_;
  Snapshot snap_;
  std::unique_ptr<PackSource> src_;
  Manifest manifest_;
  testing::CacheImage before_;
};

TEST_P(ThinPackTest, RoundTrips) {
  EXPECT_TRUE(manifest_.thin);
  EXPECT_EQ(src_->size(), manifest_.payload_offset);
  auto back = read_pack(*src_, {.store = store_.get()});
  ASSERT_TRUE(back.ok()) << back.error().to_string();
  EXPECT_TRUE(testing::same_rows(*back, snap_));
  ASSERT_TRUE(restore_pack(*src_, {.store = store_.get()}, *target_).ok());
  EXPECT_TRUE(image(*target_) == image(*live_));
  EXPECT_TRUE(check_pack_backed(*src_, {.store = store_.get()}).ok());
  auto v = verify_pack(*src_, store_.get());
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->bad_chunks, 0);
  EXPECT_EQ(v->chunks, static_cast<std::int64_t>(manifest_.chunks.size()));
}

TEST_P(ThinPackTest, MissingChunkIsNamed) {
  const PackChunk& victim = manifest_.chunks[5];
  ASSERT_TRUE(store_->erase(victim.name).ok());
  expect_restore_fails(ErrorCode::kNotFound, "s.kvpack: chunk 5 (layer " + std::to_string(victim.layer) +
                                                 ", positions [" + std::to_string(victim.first_position));
  // Found before any row is allocated, and without a store at all.
  const Status backed = check_pack_backed(*src_, {.store = store_.get()});
  ASSERT_FALSE(backed.ok());
  EXPECT_EQ(backed.error().code, ErrorCode::kNotFound);
  EXPECT_NE(backed.error().message.find("s.kvpack: chunk 5 "), std::string::npos) << backed.error().message;
  const Status no_store = check_pack_backed(*src_);
  ASSERT_FALSE(no_store.ok());
  EXPECT_NE(no_store.error().message.find("is a thin pack"), std::string::npos) << no_store.error().message;
  auto v = verify_pack(*src_, store_.get());
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->bad_chunks, 1);
  EXPECT_NE(v->first_error.error().message.find("chunk 5 "), std::string::npos);
}

TEST_P(ThinPackTest, PlantedChunkIsNamed) {
  const PackChunk& victim = manifest_.chunks[9];
  ASSERT_TRUE(store_->erase(victim.name).ok());
  const std::string junk(static_cast<std::size_t>(victim.byte_length), '\x5a');
  const std::vector<ChunkData> planted = {{victim.name, bytes_of(junk), {}}};
  ASSERT_TRUE(store_->put(planted).ok());
  expect_restore_fails(ErrorCode::kCorruption, "s.kvpack: chunk 9 (layer ");
}

// A write the destination refuses (a directory, a missing directory) or
// whose manifest would be too large puts no chunk in the store, as
// encode_pack refuses the same snapshot.
TEST_P(ThinPackTest, ARefusedWritePutsNoChunk) {
  auto other = filled_cache(cfg_, 256, 120, 57);  // rows the store holds none of
  auto snap = testing::snapshot_with_extras(*other, 1);
  auto before = store_->stats();
  ASSERT_TRUE(before.ok());
  const WriteOptions o{.chunk_tokens = 16, .store = store_.get()};
  for (const std::string& dest : {pack_dir_, pack_dir_ + "/no-such-dir/p.kvpack"}) {
    SCOPED_TRACE(dest);
    EXPECT_FALSE(write_pack(snap, dest, o).ok());
    auto after = store_->stats();
    ASSERT_TRUE(after.ok());
    EXPECT_EQ(after->chunks, before->chunks);
    EXPECT_EQ(after->bytes, before->bytes);
  }
  snap.metadata.assign(static_cast<std::size_t>(kMaxManifestBytes), 'm');
  const Status big = write_pack(snap, pack_dir_ + "/big.kvpack", o);
  ASSERT_FALSE(big.ok());
  EXPECT_NE(big.to_string().find("manifest"), std::string::npos) << big.to_string();
  auto after = store_->stats();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->chunks, before->chunks);
  // The same snapshot written where it may be puts its chunks there.
  snap.metadata.clear();
  ASSERT_TRUE(write_pack(snap, pack_dir_ + "/ok.kvpack", o).ok());
  EXPECT_GT(store_->stats()->chunks, before->chunks);
}

// Two sessions share their first 150 tokens. The full planes' chunks that lie
// inside the prefix are identical and stored once; nothing else is shared
// (the sliding rings have moved past the prefix).
TEST_P(ThinPackTest, SharedPrefixChunksAreStoredOnce) {
  ASSERT_TRUE(store_->stats().ok());
  std::vector<ChunkData> none;
  const std::int64_t t = 16, split = 150;
  auto a = make_cpu_cache(cfg_, {.context = 256});
  auto b = make_cpu_cache(cfg_, {.context = 256});
  ASSERT_TRUE(a.ok() && b.ok());
  testing::fill(**a, 0, 200, 40, 9, split, 41);
  testing::fill(**b, 0, 230, 40, 23, split, 42);
  std::set<Digest> names;
  std::int64_t union_bytes = 0, sum_bytes = 0, shared = 0;
  std::set<Digest> in_a;
  for (auto* cache : {a->get(), b->get()}) {
    auto snap = take_snapshot(*cache);
    ASSERT_TRUE(snap.ok());
    const std::string path = pack_dir_ + (cache == a->get() ? "/a.kvpack" : "/b.kvpack");
    ASSERT_TRUE(write_pack(*snap, path, {.chunk_tokens = t, .store = store_.get()}).ok());
    auto m = read_manifest(**open_pack_file(path));
    ASSERT_TRUE(m.ok());
    for (const PackChunk& c : m->chunks) {
      sum_bytes += c.byte_length;
      if (names.insert(c.name).second) union_bytes += c.byte_length;
      if (cache == a->get()) {
        in_a.insert(c.name);
      } else if (in_a.count(c.name)) {
        ++shared;
        // Only full-plane chunks wholly inside the prefix are shared.
        EXPECT_EQ(cfg_.kind(c.layer), LayerKind::kFullNope);
        EXPECT_LE(c.first_position + c.rows, split);
        EXPECT_EQ(c.rows, t);
      }
    }
  }
  const std::int64_t full_layers = cfg_.count(LayerKind::kFullNope);
  EXPECT_EQ(shared, full_layers * (split / t));  // 2 x 9
  const std::int64_t chunk_bytes = 2 * t * cfg_.kv_dim() * 2;
  // The store held the first pack's chunks already (SetUp); count afresh.
  auto stats = store_->stats();
  ASSERT_TRUE(stats.ok());
  std::set<Digest> all = names;
  for (const PackChunk& c : manifest_.chunks) all.insert(c.name);
  EXPECT_EQ(stats->chunks, static_cast<std::int64_t>(all.size()));
  std::int64_t setup_only = 0;
  std::set<Digest> seen = names;
  for (const PackChunk& c : manifest_.chunks)
    if (seen.insert(c.name).second) setup_only += c.byte_length;
  EXPECT_EQ(stats->bytes, union_bytes + setup_only);
  EXPECT_EQ(union_bytes, sum_bytes - shared * chunk_bytes);
}

INSTANTIATE_TEST_SUITE_P(Stores, StoreTest, ::testing::Values("dir", "redis"));
INSTANTIATE_TEST_SUITE_P(Stores, ThinPackTest, ::testing::Values("dir", "redis"));

// --- Directory store: crashes and failures ------------------------------

class DirStoreFaults : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::make_temp_dir("dirfaults");
    root_ = dir_ + "/chunks";
    live_ = filled_cache(small_config(32, 256, 4), 256, 60, 3);
    auto s = take_snapshot(*live_);
    ASSERT_TRUE(s.ok());
    snap_ = *s;
  }
  void TearDown() override { testing::remove_tree(dir_); }

  // Every file named like a chunk holds bytes with that name, and nothing is
  // named like the pack.
  void expect_only_valid_chunks() {
    auto store = open_dir_store(root_);
    ASSERT_TRUE(store.ok());
    for (const std::string& n : testing::list_dir(root_)) {
      if (n.rfind(".tmp-", 0) == 0) continue;
      std::ifstream in(root_ + "/" + n, std::ios::binary);
      const std::string bytes((std::istreambuf_iterator<char>(in)), {});
      EXPECT_EQ(to_hex(sha256(bytes.data(), bytes.size())), n);
    }
    EXPECT_EQ(::access((dir_ + "/p.kvpack").c_str(), F_OK), -1);
  }

  std::string dir_, root_;
  std::unique_ptr<KvCache> live_;
  Snapshot snap_;
};

// A process killed between writing a chunk and renaming it (simulated by
// _exit in the fault hook, so no destructor cleans up) leaves only a
// temporary file: no chunk under the name, no pack; a later write succeeds.
// A store opened only to be read is not made where it is absent.
// A chunk store in memory that counts the bytes its reads hold at once,
// each read taking a while so that reads of different threads overlap.
class SlowMemoryStore final : public ChunkStore {
 public:
  std::string spec() const override { return "memory"; }
  Status put(std::span<const ChunkData> chunks) override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const ChunkData& c : chunks) {
      std::vector<std::uint8_t>& b = chunks_[to_hex(c.name)];
      b.assign(c.part1.begin(), c.part1.end());
      b.insert(b.end(), c.part2.begin(), c.part2.end());
    }
    return Status::Ok();
  }
  Result<bool> contains(const Digest& name) const override { return find(name) != nullptr; }
  Status check_stored(const Digest& name, std::int64_t bytes) const override {
    const auto* b = find(name);
    if (b == nullptr) return make_error(ErrorCode::kNotFound, "missing");
    if (static_cast<std::int64_t>(b->size()) != bytes) return make_error(ErrorCode::kCorruption, "size");
    return Status::Ok();
  }
  Status erase(const Digest&) override { return Status::Ok(); }
  Result<StoreStats> stats() const override { return StoreStats{}; }
  std::int64_t most_held() const { return most_held_; }

 protected:
  Status read_raw(const Digest& name, std::span<std::uint8_t> dst) const override {
    const auto* b = find(name);
    if (b == nullptr || b->size() != dst.size()) return make_error(ErrorCode::kNotFound, "missing");
    const auto n = static_cast<std::int64_t>(dst.size());
    {
      std::lock_guard<std::mutex> lock(mutex_);
      most_held_ = std::max(most_held_, held_ += n);
    }
    if (n > (std::int64_t{1} << 20)) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    std::copy(b->begin(), b->end(), dst.begin());
    std::lock_guard<std::mutex> lock(mutex_);
    held_ -= n;
    return Status::Ok();
  }

 private:
  const std::vector<std::uint8_t>* find(const Digest& name) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = chunks_.find(to_hex(name));
    return it == chunks_.end() ? nullptr : &it->second;
  }
  mutable std::mutex mutex_;
  std::map<std::string, std::vector<std::uint8_t>> chunks_;
  mutable std::int64_t held_ = 0, most_held_ = 0;
};

// A thin pack's chunks are read whole, but the chunk buffers a read or a
// verify holds at once across its threads stay within 256 MiB: its two
// chunks of 144 and 137 MiB (a full plane of 18000 tokens at 4096 values a
// row, in chunks of 9216 tokens) are never held together, however many
// threads read.
TEST(ThinPackReads, ChunkBuffersStayWithinTheirBudget) {
  const ModelConfig cfg = small_config(32, 18000, 4, 32, 32, 128);
  ASSERT_EQ(cfg.kind(3), LayerKind::kFullNope);
  const std::int64_t tokens = 18000, chunk_tokens = 9216;
  auto live = filled_cache(cfg, tokens, tokens, 5);
  auto snap = take_snapshot(*live);
  ASSERT_TRUE(snap.ok());
  SlowMemoryStore store;
  auto bytes = encode_pack(*snap, {.chunk_tokens = chunk_tokens, .store = &store});
  ASSERT_TRUE(bytes.ok()) << bytes.error().to_string();
  const std::int64_t big = chunk_tokens * cfg.kv_dim() * 4, other = (tokens - chunk_tokens) * cfg.kv_dim() * 4;
  ASSERT_GT(big + other, std::int64_t{256} << 20);
  auto src = memory_pack_source(bytes->data(), static_cast<std::int64_t>(bytes->size()), "big.kvpack");
  auto v = verify_pack(*src, &store);
  ASSERT_TRUE(v.ok()) << v.error().to_string();
  EXPECT_EQ(v->bad_chunks, 0);
  EXPECT_GE(store.most_held(), big);
  EXPECT_LT(store.most_held(), big + other);
  auto back = read_pack(*src, {.store = &store});
  ASSERT_TRUE(back.ok()) << back.error().to_string();
  EXPECT_TRUE(testing::same_rows(*back, *snap));
  EXPECT_LT(store.most_held(), big + other);
}

TEST_F(DirStoreFaults, AStoreOpenedToReadIsNotMade) {
  auto absent = open_dir_store(root_, {.create = false});
  ASSERT_FALSE(absent.ok());
  EXPECT_EQ(absent.error().code, ErrorCode::kNotFound) << absent.error().to_string();
  EXPECT_FALSE(std::filesystem::exists(root_));
  auto spec = open_chunk_store("dir:" + root_, {.create = false});
  ASSERT_FALSE(spec.ok());
  EXPECT_FALSE(std::filesystem::exists(root_));
  ASSERT_TRUE(open_dir_store(root_).ok());  // made
  EXPECT_TRUE(std::filesystem::is_directory(root_));
  EXPECT_TRUE(open_dir_store(root_, {.create = false}).ok());
}

TEST_F(DirStoreFaults, CrashBeforeRenameLeavesNoChunk) {
  for (IoStep crash_at : {IoStep::kWrite, IoStep::kFsync, IoStep::kRename}) {
    SCOPED_TRACE(io_step_name(crash_at));
    const pid_t pid = ::fork();
    if (pid == 0) {
      // The child of a fork has no pool workers: run every task here.
      cpu::set_thread_limit(1);
      IoOptions io;
      int seen = 0;
      io.fault = [&](IoStep s, const std::string&) {
        if (s == crash_at && ++seen == 3) ::_exit(0);
        return Status::Ok();
      };
      auto store = open_dir_store(root_, io);
      if (!store.ok()) ::_exit(2);
      WriteOptions o{.chunk_tokens = 8, .store = store->get()};
      o.io = io;
      (void)write_pack(snap_, dir_ + "/p.kvpack", o);
      ::_exit(1);  // the crash did not happen
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
    expect_only_valid_chunks();
  }
  auto store = open_dir_store(root_);
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE(write_pack(snap_, dir_ + "/p.kvpack", {.chunk_tokens = 8, .store = store->get()}).ok());
  auto back = read_pack_file(dir_ + "/p.kvpack", {.store = store->get()});
  ASSERT_TRUE(back.ok()) << back.error().to_string();
  EXPECT_TRUE(testing::same_rows(*back, snap_));
  auto stats = (*store)->stats();
  ASSERT_TRUE(stats.ok());
  auto m = read_manifest(**open_pack_file(dir_ + "/p.kvpack"));
  EXPECT_EQ(stats->chunks, static_cast<std::int64_t>(m->chunks.size()));  // temporaries not counted
}

// A directory store's chunk temporaries are listed while written, as a
// pack file's are: remove_live_temporaries (the tool's signal handler)
// unlinks one whose writer is between its write and its rename, and that
// write then fails; no temporary and no pack are left.
TEST_F(DirStoreFaults, ChunkTemporariesAreRemovedOnRequest) {
  std::atomic<int> removed{0}, existed{0};
  std::atomic<bool> once{false};
  IoOptions io;
  io.fault = [&](IoStep s, const std::string& path) {
    if (s == IoStep::kFsync && path.rfind(root_ + "/.tmp-", 0) == 0 && !once.exchange(true)) {
      existed = ::access(path.c_str(), F_OK) == 0;
      pack_internal::remove_live_temporaries();
      removed = ::access(path.c_str(), F_OK) == 0 ? 2 : 1;
    }
    return Status::Ok();
  };
  auto store = open_dir_store(root_, io);
  ASSERT_TRUE(store.ok());
  WriteOptions o{.chunk_tokens = 8, .store = store->get()};
  o.io = io;
  const Status st = write_pack(snap_, dir_ + "/p.kvpack", o);
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(existed.load(), 1);
  EXPECT_EQ(removed.load(), 1);  // 2: the temporary was still there
  for (const std::string& d : {dir_, root_})
    for (const std::string& n : testing::list_dir(d)) EXPECT_NE(n.rfind(".tmp-", 0), 0u) << d << "/" << n;
  expect_only_valid_chunks();
}

TEST_F(DirStoreFaults, FailedStepsAreNamedAndLeaveNoPack) {
  for (IoStep step : {IoStep::kOpen, IoStep::kWrite, IoStep::kFsync, IoStep::kRename, IoStep::kFsyncDir}) {
    SCOPED_TRACE(io_step_name(step));
    IoOptions io;
    io.fault = [step](IoStep s, const std::string& path) {
      return s == step && path.find(".kvpack") == std::string::npos ? Status(io_error("injected"))
                                                                     : Status::Ok();
    };
    testing::remove_tree(root_);
    auto store = open_dir_store(root_, io);
    ASSERT_TRUE(store.ok());
    const Status s = write_pack(snap_, dir_ + "/p.kvpack", {.chunk_tokens = 8, .store = store->get()});
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.error().message.find(std::string(io_step_name(step)) + " of " + root_), std::string::npos)
        << s.to_string();
    expect_only_valid_chunks();
    for (const std::string& n : testing::list_dir(root_)) EXPECT_NE(n.rfind(".tmp-", 0), 0u) << n;
  }
}

// A store on a full device: the file size limit cuts every chunk write
// short. Runs in a death-test child so the limit does not outlive it.
void put_under_size_limit(const std::string& root, const std::string& pack, const Snapshot& snap) {
  cpu::set_thread_limit(1);  // a forked child has no pool workers
  ::signal(SIGXFSZ, SIG_IGN);
  rlimit limit{1000, 1000};
  ::setrlimit(RLIMIT_FSIZE, &limit);
  auto store = open_dir_store(root);
  const Status s = write_pack(snap, pack, {.chunk_tokens = 8, .store = store->get()});
  std::_Exit(!s.ok() && s.error().message.find("File too large") != std::string::npos ? 0 : 1);
}

TEST_F(DirStoreFaults, FullDevice) {
  EXPECT_EXIT(put_under_size_limit(root_, dir_ + "/p.kvpack", snap_), ::testing::ExitedWithCode(0), "");
  expect_only_valid_chunks();
}

TEST(ChunkStoreSpec, BadSpecsAndLocations) {
  const std::string dir = testing::make_temp_dir("spec");
  const std::string file = dir + "/plain-file";
  std::ofstream(file) << "x";
  for (const std::string& spec : {std::string("dir:"), std::string("ftp://host"), std::string("redis://:6379"),
                                  std::string("redis://host:0"), std::string("redis://host:99999"),
                                  std::string("redis://host:12x"), "dir:" + file, "dir:" + file + "/sub"}) {
    auto s = open_chunk_store(spec);
    ASSERT_FALSE(s.ok()) << spec;
    EXPECT_FALSE(s.error().message.empty());
  }
  auto under_file = open_chunk_store("dir:" + file + "/sub");
  EXPECT_NE(under_file.error().message.find(file + "/sub"), std::string::npos) << under_file.error().to_string();
  if (redis_store_compiled()) {
    // Nothing listens on a port we just found free.
    auto refused = open_chunk_store("redis://127.0.0.1:1");
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.error().message.find("redis://127.0.0.1:1: cannot connect"), std::string::npos)
        << refused.error().to_string();
  }
  testing::remove_tree(dir);
}

// What the tool's signal handler runs: the temporaries of files still
// being written go; a committed file, and a file whose writer is gone, are
// no longer listed. Past kTrackedTemporaries files at once the rest are not
// listed, and nothing fails.
TEST(AtomicFiles, LiveTemporariesAreRemovedOnRequest) {
  namespace fs = std::filesystem;
  const std::string dir = testing::make_temp_dir("atomic");
  const std::vector<std::uint8_t> bytes(4096, 0x5a);
  auto open = [&](const std::string& name) {
    auto f = pack_internal::AtomicFile::create(dir + "/" + name, {});
    EXPECT_TRUE(f.ok()) << f.status().to_string();
    EXPECT_TRUE((*f)->write_at(0, bytes).ok());
    return std::move(*f);
  };
  auto live = open("live.kvpack");
  auto done = open("done.kvpack");
  ASSERT_TRUE(done->commit().ok());
  const std::string temp = live->temp_path();
  ASSERT_TRUE(fs::exists(temp));
  pack_internal::remove_live_temporaries();
  EXPECT_FALSE(fs::exists(temp));
  EXPECT_EQ(fs::file_size(dir + "/done.kvpack"), bytes.size());
  EXPECT_FALSE(live->commit().ok());  // its temporary is gone: no partial file appears
  EXPECT_FALSE(fs::exists(dir + "/live.kvpack"));
  live.reset();
  done.reset();

  std::vector<std::unique_ptr<pack_internal::AtomicFile>> many;
  const int extra = 5;
  for (int i = 0; i < pack_internal::kTrackedTemporaries + extra; ++i)
    many.push_back(open("many-" + std::to_string(i)));
  auto temporaries = [&] {
    int n = 0;
    for (const auto& e : fs::directory_iterator(dir)) n += e.path().filename().string().starts_with(".tmp-");
    return n;
  };
  EXPECT_EQ(temporaries(), pack_internal::kTrackedTemporaries + extra);
  pack_internal::remove_live_temporaries();
  EXPECT_EQ(temporaries(), extra);
  many.clear();
  EXPECT_EQ(temporaries(), 0);

  // A file listed with its text goes only while it holds exactly that.
  auto put = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir + "/" + name, std::ios::binary) << text;
  };
  put("same", "4242\n");
  put("changed", "4242\n");
  put("longer", "4242\n");
  const int same = pack_internal::track_file_holding(dir + "/same", "4242\n");
  const int changed = pack_internal::track_file_holding(dir + "/changed", "4242\n");
  const int longer = pack_internal::track_file_holding(dir + "/longer", "4242\n");
  EXPECT_EQ(pack_internal::track_file_holding(dir + "/big", std::string(pack_internal::kTrackedTextBytes + 1, 'x')),
            -1);
  put("changed", "4243\n");
  put("longer", "4242\n4242\n");
  pack_internal::remove_live_temporaries();
  EXPECT_FALSE(fs::exists(dir + "/same"));
  EXPECT_TRUE(fs::exists(dir + "/changed"));
  EXPECT_TRUE(fs::exists(dir + "/longer"));
  for (const int slot : {same, changed, longer}) {
    EXPECT_GE(slot, 0);
    pack_internal::untrack_temporary(slot);
  }
  put("changed", "4242\n");  // holds the text again, but no longer listed
  pack_internal::remove_live_temporaries();
  EXPECT_TRUE(fs::exists(dir + "/changed"));
  testing::remove_tree(dir);
}

}  // namespace
}  // namespace kvring
