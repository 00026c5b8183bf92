// Probes of the kvpack reader, the chunk stores and restore against packs
// whose fields are each in range but jointly hostile.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "hostile_pack.h"
#include "kvring/cache.h"
#include "kvring/chunk_store.h"
#include "kvring/config.h"
#include "kvring/pack.h"
#include "kvring/snapshot.h"
#include "pack/coding.h"
#include "pack/pack_common.h"
#include "pack_test_util.h"

namespace kvring {
namespace {

using testing::HostilePack;

// A pack of `spec` (every ring sequential at token_count) whose chunks are
// `fill` bytes, named by their SHA-256: a pack that reads, self-contained
// (payload appended) or thin (chunks put into `store`).
std::string crafted_pack(const HostilePack& spec, ChunkStore* store = nullptr, std::uint8_t fill = 0) {
  HostilePack thin_or_not = spec;
  thin_or_not.thin = store != nullptr;
  std::string payload;
  std::int64_t payload_bytes = 0;
  auto name_of = [&](std::uint32_t, std::int64_t length) {
    const std::string bytes(static_cast<std::size_t>(length), static_cast<char>(fill));
    const Digest name = sha256(bytes.data(), bytes.size());
    if (store != nullptr) {
      ChunkData d;
      d.name = name;
      d.part1 = {reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()};
      EXPECT_TRUE(store->put({&d, 1}).ok());
    } else {
      payload += bytes;
    }
    return name;
  };
  const std::string head = testing::hostile_pack_head(thin_or_not, &payload_bytes, name_of);
  return head + payload;
}

// A sliding ring shorter than the window stops at the context: no cache
// holds one past it, validate_snapshot refuses it, and so must the reader.
TEST(PackProbe, ShortSlidingRingPastTheContextIsRefusedByTheReader) {
  HostilePack spec;
  spec.config = make_hybrid_config("short", 2, 2, 1, 1, 16, 64, 256);
  spec.config.layer_kinds.assign(2, LayerKind::kSlidingRope);
  ASSERT_TRUE(spec.config.validate().ok());
  spec.context = 40;  // rings of 40 rows, window 64
  spec.token_count = 90;
  spec.chunk_tokens = 16;
  const std::string pack = crafted_pack(spec);
  auto src = memory_pack_source(pack.data(), static_cast<std::int64_t>(pack.size()), "short.kvpack");
  auto snap = read_pack(*src);
  ASSERT_FALSE(snap.ok()) << "read_pack took a pack whose snapshot validate_snapshot refuses";
  EXPECT_EQ(snap.error().code, ErrorCode::kCorruption) << snap.error().to_string();
  EXPECT_NE(snap.error().message.find("short.kvpack: plane table, plane 0: ring state at byte"), std::string::npos)
      << snap.error().to_string();
  EXPECT_NE(snap.error().message.find("a sliding ring of 40 rows, shorter than the window of 64, stops at the "
                                      "context 40; token_count is 90"),
            std::string::npos)
      << snap.error().to_string();
  EXPECT_FALSE(verify_pack(*src).ok()) << "verify called ok a pack no writer makes and no restore takes";
  // At the context itself the same rings are whole: the pack reads.
  spec.token_count = 40;
  const std::string at_context = crafted_pack(spec);
  auto fine = read_pack(*memory_pack_source(at_context.data(), static_cast<std::int64_t>(at_context.size())));
  ASSERT_TRUE(fine.ok()) << fine.error().to_string();
  EXPECT_TRUE(validate_snapshot(*fine).ok());
}

}  // namespace
}  // namespace kvring

namespace kvring {
namespace {

using testing::CountingStore;

// The header of a thin pack whose every chunk record names the same chunk.
std::string thin_head_naming(const HostilePack& spec, const Digest& name) {
  std::int64_t payload = 0;
  std::string head = testing::hostile_pack_head(spec, &payload);
  // Rewrite every chunk record's name, then reseal.
  auto m = read_manifest(*memory_pack_source(head.data(), static_cast<std::int64_t>(head.size())));
  EXPECT_TRUE(m.ok());
  const std::int64_t table_end = kPreambleBytes + m->manifest_bytes;
  const std::int64_t n = static_cast<std::int64_t>(m->chunks.size());
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t at = table_end - (n - i) * kChunkRecordBytes + 16;
    std::memcpy(head.data() + at, name.data(), name.size());
  }
  testing::reseal(&head);
  return head;
}

// Every chunk record of a thin pack names one sparse file planted in a
// directory store, which check_stored hashes whole (in pieces) each time it
// is asked. The reader asked once per record, all of them, though the
// first answer already failed, and before it held the rows the manifest
// claims against the caller's max_row_bytes: a manifest of 1024 layers of
// 1024 records naming one sparse file of 1 GiB costs a million hashes of
// 1 GiB before "over the limit".
TEST(PackProbe, OneSparsePlantedChunkIsCheckedOnce) {
  const std::string dir = testing::make_temp_dir("probe-sparse");
  auto store = open_dir_store(dir + "/store");
  ASSERT_TRUE(store.ok());
  const Digest name = sha256("planted", 7);
  const std::string path = dir + "/store/" + to_hex(name);
  {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT, 0644);
    ASSERT_GE(fd, 0);
    ::close(fd);
  }
  // One full layer of kv_dim 8192 in F32Le, 16-token chunks: 1 MiB each.
  HostilePack spec;
  spec.config = make_hybrid_config("probe", 1, 1, 8, 8, 1024, 0, 16 * 64);
  spec.context = spec.token_count = 16 * 64;
  spec.chunk_tokens = 16;
  spec.encoding = Encoding::kF32Le;
  spec.thin = true;
  ASSERT_EQ(::truncate(path.c_str(), std::int64_t{1} << 20), 0);
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  if (st.st_blocks * 512 >= st.st_size) GTEST_SKIP() << "no sparse files here";
  const std::string head = thin_head_naming(spec, name);
  auto src = memory_pack_source(head.data(), static_cast<std::int64_t>(head.size()), "thin");

  CountingStore over_limit(**store);
  auto r = read_pack(*src, {.store = &over_limit, .max_row_bytes = 1 << 20});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, ErrorCode::kCapacityExceeded) << r.error().to_string();
  EXPECT_EQ(over_limit.checks.load(), 0) << "a pack its manifest puts over max_row_bytes is refused unchecked";

  CountingStore counting(**store);
  r = read_pack(*src, {.store = &counting});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("thin: chunk 0 (layer 0"), std::string::npos) << r.error().to_string();
  EXPECT_NE(r.error().message.find("is a file with holes"), std::string::npos) << r.error().to_string();
  EXPECT_EQ(counting.checks.load(), 1) << "64 records of one chunk";

  // verify counts every record's verdict, and asks about the chunk once.
  CountingStore verifying(**store);
  auto v = verify_pack(*src, &verifying);
  ASSERT_TRUE(v.ok()) << v.error().to_string();
  EXPECT_EQ(v->chunks, 64);
  EXPECT_EQ(v->bad_chunks, 64);
  EXPECT_NE(v->first_error.error().message.find("thin: chunk 0 (layer 0"), std::string::npos)
      << v->first_error.to_string();
  EXPECT_EQ(verifying.checks.load(), 1);
  testing::remove_tree(dir);
}

// A thin pack whose 128 chunk records all name one chunk (rows that repeat
// across positions and layers) fetches it from its store once, whether
// read whole or restored into a store a group of planes at a time, and
// every record's rows are that chunk's.
TEST(PackProbe, AChunkManyRecordsNameIsFetchedOnce) {
  const std::string dir = testing::make_temp_dir("probe-repeat");
  auto store = open_dir_store(dir + "/store");
  ASSERT_TRUE(store.ok());
  HostilePack spec;
  spec.config = make_hybrid_config("probe", 2, 1, 2, 2, 8, 0, 16 * 64);  // two full layers, kv_dim 16
  spec.context = spec.token_count = 16 * 64;
  spec.chunk_tokens = 16;
  spec.thin = true;
  const std::int64_t kv = spec.config.kv_dim();
  // One chunk: 16 rows of K, then 16 of V, f16 bits, seeded.
  std::vector<std::uint16_t> rows(static_cast<std::size_t>(2 * 16 * kv));
  std::mt19937_64 rng(77);
  for (auto& x : rows) x = static_cast<std::uint16_t>(rng() & 0x7bff);  // finite
  std::vector<std::uint8_t> bytes(rows.size() * 2);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    bytes[2 * i] = static_cast<std::uint8_t>(rows[i]);
    bytes[2 * i + 1] = static_cast<std::uint8_t>(rows[i] >> 8);
  }
  const Digest name = sha256(bytes.data(), bytes.size());
  const ChunkData chunk{name, bytes, {}};
  ASSERT_TRUE((*store)->put({&chunk, 1}).ok());
  const std::string head = thin_head_naming(spec, name);
  auto src = memory_pack_source(head.data(), static_cast<std::int64_t>(head.size()), "repeat");
  auto m = read_manifest(*src);
  ASSERT_TRUE(m.ok());
  ASSERT_EQ(m->chunks.size(), 128u);

  CountingStore counting(**store);
  auto snap = read_pack(*src, {.store = &counting});
  ASSERT_TRUE(snap.ok()) << snap.error().to_string();
  EXPECT_EQ(counting.reads.load(), 1) << "128 records of one chunk";
  const std::vector<std::uint16_t> k(rows.begin(), rows.begin() + 16 * kv), v(rows.begin() + 16 * kv, rows.end());
  for (const PlaneSnapshot& p : snap->planes)
    for (std::int64_t r = 0; r < p.ring.len(); r += 16) {
      EXPECT_TRUE(std::equal(k.begin(), k.end(), p.k.begin() + r * kv)) << "row " << r;
      EXPECT_TRUE(std::equal(v.begin(), v.end(), p.v.begin() + r * kv)) << "row " << r;
    }

  // Into a store, one plane a group: once a group.
  auto target = make_store(BackendKind::kCpu, spec.config, {.max_sequences = 1, .context = spec.context});
  ASSERT_TRUE(target.ok());
  CountingStore grouped(**store);
  auto seq = pack_internal::restore_pack_in_groups(*src, {.store = &grouped}, **target, nullptr, 1);
  ASSERT_TRUE(seq.ok()) << seq.error().to_string();
  EXPECT_EQ(grouped.reads.load(), 2) << "two groups of one plane";
  auto back = take_snapshot(**target, *seq);
  ASSERT_TRUE(back.ok());
  for (std::size_t l = 0; l < snap->planes.size(); ++l)
    EXPECT_TRUE(back->planes[l].k == snap->planes[l].k && back->planes[l].v == snap->planes[l].v) << "layer " << l;
  testing::remove_tree(dir);
}

}  // namespace
}  // namespace kvring

namespace kvring {
namespace {

// Structured probe: packs whose every field is individually in range and
// whose rings are each a sequential session's (geometry, context,
// token_count, chunk_tokens and encoding drawn at random). A pack the
// reader takes must be a valid snapshot, re-encode, and restore into a
// cache of its own geometry and context.
TEST(PackProbe, WhatTheReaderTakesIsValidAndRestores) {
  int taken = 0, refused = 0;
  for (std::uint64_t seed = 1; seed <= 3000; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    auto pick = [&](std::int64_t lo, std::int64_t hi) { return lo + static_cast<std::int64_t>(rng() % (hi - lo + 1)); };
    HostilePack spec;
    const std::int64_t max_context = pick(1, 300);
    spec.config =
        make_hybrid_config("probe", pick(1, 4), pick(1, 3), 2, pick(1, 2), pick(1, 8), pick(1, 100), max_context);
    for (auto& k : spec.config.layer_kinds) k = rng() % 2 ? LayerKind::kSlidingRope : LayerKind::kFullNope;
    if (!spec.config.validate().ok()) continue;
    spec.context = pick(1, max_context);
    spec.token_count = pick(0, 400);
    spec.chunk_tokens = pick(1, 50);
    spec.encoding = rng() % 2 ? Encoding::kF32Le : Encoding::kF16Le;
    bool sequential = true;
    for (std::int64_t l = 0; l < spec.config.n_layers; ++l)
      sequential = sequential && RingState::sequential(spec.config.plane_capacity(l, spec.context),
                                                       spec.config.kind(l) == LayerKind::kSlidingRope, spec.token_count)
                                     .ok();
    if (!sequential) continue;
    const std::string pack = crafted_pack(spec, nullptr, static_cast<std::uint8_t>(pick(0, 255)));
    auto snap = read_pack(*memory_pack_source(pack.data(), static_cast<std::int64_t>(pack.size())));
    if (!snap.ok()) {
      ++refused;
      EXPECT_EQ(snap.error().code, ErrorCode::kCorruption) << snap.error().to_string();
      continue;
    }
    ++taken;
    ASSERT_TRUE(validate_snapshot(*snap).ok()) << validate_snapshot(*snap).to_string();
    auto again = encode_pack(*snap, {.encoding = spec.encoding, .chunk_tokens = spec.chunk_tokens});
    ASSERT_TRUE(again.ok()) << again.error().to_string();
    // F32Le values that are no f16 narrow on reading; F16Le is bitwise.
    if (spec.encoding == Encoding::kF16Le) {
      EXPECT_TRUE(*again == pack) << "re-encoding a pack gives other bytes";
    }
    auto cache = make_cpu_cache(spec.config, {.context = spec.context});
    ASSERT_TRUE(cache.ok()) << cache.error().to_string();
    const Status s = restore(*snap, **cache);
    ASSERT_TRUE(s.ok()) << s.to_string();
    auto back = take_snapshot(**cache);
    ASSERT_TRUE(back.ok());
    EXPECT_TRUE(testing::same_rows(*back, *snap));
  }
  // Both outcomes occur (932 and 282 of the 3000 seeded packs): the probe
  // checks packs the reader takes, and the short-ring rule is exercised.
  EXPECT_GT(taken, 300);
  EXPECT_GT(refused, 30);
}

}  // namespace
}  // namespace kvring

// Self-contained packs over files with holes (sparse files). A chunk whose
// bytes lie wholly in a hole reads as zeros; verify gives it the verdict a
// read gives, without reading it, so its time follows the bytes the file
// holds, not the size it claims.
namespace kvring {
namespace {

// A pack source over another that counts the bytes read through it within
// [watch_begin, watch_end).
class WatchedSource final : public PackSource {
 public:
  WatchedSource(const PackSource& inner, std::int64_t watch_begin, std::int64_t watch_end)
      : inner_(inner), begin_(watch_begin), end_(watch_end) {}
  const std::string& name() const override { return inner_.name(); }
  std::int64_t size() const override { return inner_.size(); }
  std::int64_t stored_bytes() const override { return inner_.stored_bytes(); }
  Status read_at(std::int64_t offset, std::int64_t n, std::uint8_t* dst) const override {
    watched_read += std::max<std::int64_t>(0, std::min(offset + n, end_) - std::max(offset, begin_));
    return inner_.read_at(offset, n, dst);
  }
  bool in_hole(std::int64_t offset, std::int64_t n) const override { return inner_.in_hole(offset, n); }
  mutable std::atomic<std::int64_t> watched_read{0};

 private:
  const PackSource& inner_;
  const std::int64_t begin_, end_;
};

// The alignment the tests give a chunk they punch into a hole: a multiple
// of any block size the probe accepts.
constexpr std::int64_t kHoleAlign = std::int64_t{64} << 10;

// Whether files in `dir` keep holes and lseek(SEEK_DATA) reports them (with
// `punch`, holes punched with fallocate too), in blocks that divide
// kHoleAlign; `why` says what is missing where not.
bool reports_holes(const std::string& dir, bool punch, std::string* why) {
  const std::string path = dir + "/hole-probe";
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) {
    *why = "cannot create a probe file";
    return false;
  }
  const auto probe = [&]() -> std::string {
    // Data in the first kHoleAlign bytes, a hole from there to 16 MiB.
    const std::vector<char> data(static_cast<std::size_t>(kHoleAlign), 'x');
    if (::pwrite(fd, data.data(), data.size(), 0) != static_cast<ssize_t>(data.size()) ||
        ::ftruncate(fd, std::int64_t{16} << 20) != 0)
      return "the file system refuses a probe file's data or its extension by ftruncate";
    struct stat st {};
    if (::fstat(fd, &st) != 0 || kHoleAlign % st.st_blksize != 0)
      return "the file system's blocks do not divide " + std::to_string(kHoleAlign) + " bytes";
    if (!(::lseek(fd, std::int64_t{8} << 20, SEEK_DATA) < 0 && errno == ENXIO) || ::lseek(fd, 0, SEEK_DATA) != 0)
      return "lseek(SEEK_DATA) does not report a file's holes here";
    if (punch && (::fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, kHoleAlign) != 0 ||
                  !(::lseek(fd, 0, SEEK_DATA) < 0 && errno == ENXIO)))
      return "fallocate(FALLOC_FL_PUNCH_HOLE) makes no hole here";
    return "";
  };
  *why = probe();
  ::close(fd);
  ::unlink(path.c_str());
  return why->empty();
}

// SHA-256 of n zero bytes, a MiB at a time.
Digest zeros_digest(std::int64_t n) {
  const std::vector<std::uint8_t> zeros(std::size_t{1} << 20);
  Sha256 h;
  for (std::int64_t done = 0; done < n; done += static_cast<std::int64_t>(zeros.size()))
    h.update(zeros.data(), static_cast<std::size_t>(std::min<std::int64_t>(n - done, zeros.size())));
  return h.finish();
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

class PackHoles : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::make_temp_dir("holes"); }
  void TearDown() override { testing::remove_tree(dir_); }
  std::string dir_;
};

TEST(PackZeros, AreHashedOnceAtEveryLength) {
  const std::vector<std::int64_t> lengths = {0, 1, 55, 56, 63, 64, 65, 1 << 20, (1 << 20) + 1, 3 << 20};
  const std::vector<Digest> got = pack_internal::sha256_of_zeros(lengths);
  ASSERT_EQ(got.size(), lengths.size());
  for (std::size_t j = 0; j < lengths.size(); ++j) {
    const std::string zeros(static_cast<std::size_t>(lengths[j]), '\0');
    EXPECT_EQ(to_hex(got[j]), to_hex(sha256(zeros.data(), zeros.size()))) << lengths[j] << " zero bytes";
  }
  // Hashing goes on after a digest is taken.
  Sha256 h;
  h.update("kv", 2);
  EXPECT_EQ(h.digest_so_far(), sha256("kv", 2));
  h.update("ring", 4);
  EXPECT_EQ(h.finish(), sha256("kvring", 6));
}

// `head` at `path`, the file then extended by `payload` bytes of holes:
// "" or what failed ("ftruncate: ..." where only the extension did).
std::string write_over_holes(const std::string& path, const std::string& head, std::int64_t payload) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return std::string("open: ") + std::strerror(errno);
  std::string why;
  if (::write(fd, head.data(), head.size()) != static_cast<ssize_t>(head.size()))
    why = std::string("write: ") + std::strerror(errno);
  else if (::ftruncate(fd, static_cast<off_t>(head.size()) + payload) != 0)
    why = std::string("ftruncate: ") + std::strerror(errno);
  ::close(fd);
  return why;
}

// The peak resident memory of this process so far.
std::int64_t peak_rss_bytes() {
  struct rusage u {};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<std::int64_t>(u.ru_maxrss) * 1024;
}

// A million chunks of 64 bytes in holes, each named otherwise: verify and
// the check before a resume count them all bad and keep the first one's
// message, not a message each (about 300 MB of them).
TEST_F(PackHoles, AMillionBadChunksKeepOneMessage) {
  std::string why;
  if (!reports_holes(dir_, /*punch=*/false, &why)) GTEST_SKIP() << why;
  HostilePack spec;
  spec.config = make_hybrid_config("many", 1, 1, 1, 1, 8, 0, kMaxContext);
  spec.context = std::int64_t{1} << 20;
  spec.token_count = spec.context;
  spec.chunk_tokens = 1;
  spec.encoding = Encoding::kF32Le;
  std::int64_t payload = 0;
  const std::string head = testing::hostile_pack_head(spec, &payload);
  const std::string path = dir_ + "/many.kvpack";
  ASSERT_EQ(write_over_holes(path, head, payload), "");
  auto src = open_pack_file(path);
  ASSERT_TRUE(src.ok()) << src.error().to_string();
  const std::int64_t before = peak_rss_bytes();
  auto v = verify_pack(**src);
  ASSERT_TRUE(v.ok()) << v.error().to_string();
  EXPECT_EQ(v->chunks, spec.token_count);
  EXPECT_EQ(v->bad_chunks, spec.token_count);
  EXPECT_NE(v->first_error.error().message.find("many.kvpack: chunk 0 "), std::string::npos)
      << v->first_error.error().message;
  const Status backed = check_pack_backed(**src);
  EXPECT_EQ(backed.error().message, v->first_error.error().message);
  // The manifest itself takes about 100 MB here; a message a chunk took
  // 300 MB more.
  const std::int64_t grew = peak_rss_bytes() - before;
  std::printf("verify of %lld bad chunks: the peak grew %.1f MB\n", static_cast<long long>(v->chunks), grew / 1e6);
  EXPECT_LT(grew, std::int64_t{200} << 20);
}

// A manifest that claims 4096 chunks of 256 MiB (all but the last), a
// TiB, over a file extended by ftruncate: every chunk lies in a hole.
// Named otherwise, every chunk is bad, and verify says so in seconds; named
// by the hash of their zeros, every chunk is good, and verify and the
// check before a resume say so in seconds too.
TEST_F(PackHoles, ATebibyteOfHolesIsVerifiedInSeconds) {
  std::string why;
  if (!reports_holes(dir_, /*punch=*/false, &why)) GTEST_SKIP() << why;
  // One full layer of kv_dim 8192 in F32Le: 64 KiB a token, 4096-token
  // chunks of 256 MiB, up to the most positions a geometry has.
  HostilePack spec;
  spec.config = make_hybrid_config("holes", 1, 1, 8, 8, 1024, 0, kMaxContext);
  spec.context = kMaxContext;
  spec.token_count = kMaxContext - 1000;  // the last chunk shorter
  spec.chunk_tokens = 4096;
  spec.encoding = Encoding::kF32Le;
  const std::int64_t chunk_bytes = std::int64_t{256} << 20, last_bytes = (4096 - 1000) * (std::int64_t{64} << 10);
  const Digest zeros = zeros_digest(chunk_bytes), last_zeros = zeros_digest(last_bytes);
  for (const bool named_by_zeros : {false, true}) {
    SCOPED_TRACE(named_by_zeros ? "chunks named by their zeros" : "chunks named otherwise");
    std::int64_t payload = 0;
    const std::string head =
        named_by_zeros
            ? testing::hostile_pack_head(spec, &payload,
                                         [&](std::uint32_t, std::int64_t n) { return n == chunk_bytes ? zeros : last_zeros; })
            : testing::hostile_pack_head(spec, &payload);
    ASSERT_EQ(payload, 4095 * chunk_bytes + last_bytes);
    const std::string path = dir_ + "/tib.kvpack";
    if (const std::string why_not = write_over_holes(path, head, payload); !why_not.empty()) {
      ASSERT_NE(why_not.rfind("ftruncate", 0), std::string::npos) << why_not;
      GTEST_SKIP() << why_not << " to a TiB";
    }
    auto src = open_pack_file(path);
    ASSERT_TRUE(src.ok()) << src.error().to_string();
    ASSERT_LT((*src)->stored_bytes(), std::int64_t{64} << 20) << "a TiB of holes";

    const auto t0 = std::chrono::steady_clock::now();
    auto v = verify_pack(**src);
    const double verify_s = seconds_since(t0);
    ASSERT_TRUE(v.ok()) << v.error().to_string();
    EXPECT_EQ(v->chunks, 4096);
    EXPECT_EQ(v->bytes, payload);
    EXPECT_LT(verify_s, 60.0) << "verify of a TiB of holes";
    std::printf("verify of %lld chunks over %.3f TiB of holes: %.2f s\n", static_cast<long long>(v->chunks),
                static_cast<double>(payload) / (std::int64_t{1} << 40), verify_s);
    if (named_by_zeros) {
      EXPECT_EQ(v->bad_chunks, 0) << v->first_error.to_string();
      const auto t1 = std::chrono::steady_clock::now();
      EXPECT_TRUE(check_pack_backed(**src).ok());
      EXPECT_LT(seconds_since(t1), 60.0) << "the check before a resume of a TiB of holes";
    } else {
      EXPECT_EQ(v->bad_chunks, 4096);
      const std::string& e = v->first_error.error().message;
      EXPECT_EQ(v->first_error.error().code, ErrorCode::kCorruption);
      EXPECT_NE(e.find("tib.kvpack: chunk 0 (layer 0, positions [0, 4096), "), std::string::npos) << e;
      EXPECT_NE(e.find(": its bytes hash to " + pack_internal::short_name(zeros) + "..., not to its name "),
                std::string::npos)
          << e;
    }
  }
}

// A thin pack of 4096 chunks of 256 MiB (a TiB) whose every chunk file in
// the directory store is a hole of its size, planted by ftruncate. Chunk 0
// is named by the hash of its zeros and is good; the others, named
// otherwise, are bad, each with the message that hashing its file gives.
// The store hashes the zeros of each length once, not each file: verify
// takes seconds, not the hours a TiB of zeros takes.
TEST_F(PackHoles, AThinPackOverATebibyteOfPlantedHolesIsVerifiedInSeconds) {
  std::string why;
  if (!reports_holes(dir_, /*punch=*/false, &why)) GTEST_SKIP() << why;
  auto store = open_dir_store(dir_ + "/store");
  ASSERT_TRUE(store.ok()) << store.error().to_string();
  HostilePack spec;
  spec.config = make_hybrid_config("holes", 1, 1, 8, 8, 1024, 0, kMaxContext);
  spec.context = kMaxContext;
  spec.token_count = kMaxContext - 1000;
  spec.chunk_tokens = 4096;
  spec.encoding = Encoding::kF32Le;
  spec.thin = true;
  const std::int64_t chunk_bytes = std::int64_t{256} << 20;
  const Digest zeros = zeros_digest(chunk_bytes);
  std::vector<std::pair<Digest, std::int64_t>> planted;
  std::int64_t payload = 0;
  const std::string head = testing::hostile_pack_head(spec, &payload, [&](std::uint32_t j, std::int64_t n) {
    const Digest name = j == 0 ? zeros : sha256(&j, sizeof j);
    planted.emplace_back(name, n);
    return name;
  });
  ASSERT_EQ(planted.size(), 4096u);
  for (const auto& [name, n] : planted) {
    const std::string path = dir_ + "/store/" + to_hex(name);
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ASSERT_GE(fd, 0) << path;
    const int extended = ::ftruncate(fd, static_cast<off_t>(n));
    const int err = errno;
    ::close(fd);
    if (extended != 0) GTEST_SKIP() << "ftruncate to " << n << " bytes: " << std::strerror(err);
  }
  auto src = memory_pack_source(head.data(), static_cast<std::int64_t>(head.size()), "thin-tib");

  const auto t0 = std::chrono::steady_clock::now();
  auto v = verify_pack(*src, store->get());
  const double verify_s = seconds_since(t0);
  ASSERT_TRUE(v.ok()) << v.error().to_string();
  EXPECT_EQ(v->chunks, 4096);
  EXPECT_EQ(v->bad_chunks, 4095);
  EXPECT_LT(verify_s, 60.0) << "verify of a thin pack over a TiB of planted holes";
  std::printf("verify of a thin pack over %lld planted chunk files of holes: %.2f s\n",
              static_cast<long long>(v->chunks), verify_s);
  const Status& e = v->first_error;
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.error().code, ErrorCode::kCorruption);
  EXPECT_NE(e.error().message.find("thin-tib: chunk 1 (layer 0"), std::string::npos) << e.to_string();
  EXPECT_NE(e.error().message.find("is a file with holes whose bytes hash to " + to_hex(zeros) + " (damaged or planted)"),
            std::string::npos)
      << e.to_string();

  // Chunk 0's file alone: the check a read makes before its rows passes.
  const Status good = (*store)->check_stored(zeros, chunk_bytes);
  EXPECT_TRUE(good.ok()) << good.to_string();
  const Status backed = check_pack_backed(*src, {.store = store->get()});
  EXPECT_EQ(backed.error().message, e.error().message);
}

// A pack of seeded rows, two full layers among sliding ones, in 64 KiB
// chunks; full layer 1's chunk 1 starts at a multiple of kHoleAlign (the
// metadata padded to put it there), so that a hole can cover exactly it.
struct AlignedPack {
  Snapshot snap;
  Manifest manifest;
  std::int64_t chunk = 0;  // layer 1's chunk 1
  std::int64_t offset = 0, length = 0;
};

AlignedPack write_aligned_pack(const std::string& path, bool zero_the_chunk) {
  const ModelConfig cfg = make_hybrid_config("holes", 4, 2, 4, 2, 16, 32, 2048);
  auto cache = testing::filled_cache(cfg, 2048, 2000, 41);
  AlignedPack a;
  a.snap = testing::snapshot_with_extras(*cache, 5);
  const std::int64_t kv = cfg.kv_dim();
  if (zero_the_chunk) {
    PlaneSnapshot& p = a.snap.planes[1];
    std::fill(p.k.begin() + 512 * kv, p.k.begin() + 1024 * kv, std::uint16_t{0});
    std::fill(p.v.begin() + 512 * kv, p.v.begin() + 1024 * kv, std::uint16_t{0});
  }
  const WriteOptions options{.chunk_tokens = 512};
  for (int pass = 0; pass < 2; ++pass) {
    EXPECT_TRUE(write_pack(a.snap, path, options).ok());
    auto src = open_pack_file(path);
    auto m = src.ok() ? read_manifest(**src) : Result<Manifest>(src.error());
    EXPECT_TRUE(m.ok());
    if (!m.ok()) return a;
    a.manifest = *m;
    a.chunk = a.manifest.planes[1].first_chunk + 1;
    const PackChunk& ch = a.manifest.chunks[static_cast<std::size_t>(a.chunk)];
    a.offset = ch.offset;
    a.length = ch.byte_length;
    a.snap.metadata += std::string(static_cast<std::size_t>((kHoleAlign - a.offset % kHoleAlign) % kHoleAlign), ' ');
  }
  EXPECT_EQ(a.offset % kHoleAlign, 0);
  EXPECT_EQ(a.length, kHoleAlign);
  return a;
}

bool punch(const std::string& path, std::int64_t offset, std::int64_t length) {
  const int fd = ::open(path.c_str(), O_WRONLY);
  const bool ok = fd >= 0 && ::fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) == 0;
  if (fd >= 0) ::close(fd);
  return ok;
}

// A legitimate pack whose chunk of all-zero K and V became a hole (as a
// sparse copy, cp --sparse=always, makes it) verifies as good, that chunk
// unread, and reads back bit for bit.
TEST_F(PackHoles, AZeroChunkInAHoleIsGood) {
  std::string why;
  if (!reports_holes(dir_, /*punch=*/true, &why)) GTEST_SKIP() << why;
  const std::string path = dir_ + "/zero.kvpack";
  const AlignedPack a = write_aligned_pack(path, /*zero_the_chunk=*/true);
  ASSERT_EQ(a.offset % kHoleAlign, 0);
  ASSERT_TRUE(punch(path, a.offset, a.length));
  auto src = open_pack_file(path);
  ASSERT_TRUE(src.ok());
  ASSERT_TRUE((*src)->in_hole(a.offset, a.length));
  EXPECT_FALSE((*src)->in_hole(a.offset - 1, a.length)) << "the chunk before holds data";
  EXPECT_FALSE((*src)->in_hole(a.offset, a.length + 1)) << "the chunk after holds data";
  EXPECT_LT((*src)->stored_bytes(), (*src)->size());

  WatchedSource watched(**src, a.offset, a.offset + a.length);
  auto v = verify_pack(watched);
  ASSERT_TRUE(v.ok()) << v.error().to_string();
  EXPECT_EQ(v->chunks, static_cast<std::int64_t>(a.manifest.chunks.size()));
  EXPECT_EQ(v->bad_chunks, 0) << v->first_error.to_string();
  EXPECT_EQ(watched.watched_read.load(), 0) << "verify read the chunk in the hole";
  // The same bytes in memory, where no hole is known: the chunk is read,
  // and good.
  std::string bytes(static_cast<std::size_t>((*src)->size()), '\0');
  ASSERT_TRUE((*src)->read_at(0, (*src)->size(), reinterpret_cast<std::uint8_t*>(bytes.data())).ok());
  const auto memory = memory_pack_source(bytes.data(), (*src)->size());
  EXPECT_FALSE(memory->in_hole(a.offset, a.length));
  WatchedSource read_whole(*memory, a.offset, a.offset + a.length);
  auto from_memory = verify_pack(read_whole);
  ASSERT_TRUE(from_memory.ok()) << from_memory.error().to_string();
  EXPECT_EQ(from_memory->bad_chunks, 0) << from_memory->first_error.to_string();
  EXPECT_EQ(read_whole.watched_read.load(), a.length);

  auto back = read_pack(**src);
  ASSERT_TRUE(back.ok()) << back.error().to_string();
  EXPECT_TRUE(testing::same_rows(*back, a.snap));
  auto cache = make_cpu_cache(a.snap.config, {.context = a.snap.context});
  ASSERT_TRUE(cache.ok());
  ASSERT_TRUE(restore_pack(**src, {}, **cache).ok());
  auto restored = take_snapshot(**cache);
  ASSERT_TRUE(restored.ok());
  Snapshot want = a.snap;
  want.token_ids.clear();
  want.metadata.clear();
  EXPECT_TRUE(testing::same_rows(*restored, want));
}

// A hole punched into a chunk of seeded rows among chunks of data: verify
// counts exactly that chunk bad, unread, with the message reading its
// zeros gives (the same bytes written as zeros, no hole), and a read
// refuses it with that message too.
TEST_F(PackHoles, ADataChunkPunchedIntoAHoleIsBadAsItsZerosAre) {
  std::string why;
  if (!reports_holes(dir_, /*punch=*/true, &why)) GTEST_SKIP() << why;
  const std::string path = dir_ + "/punched.kvpack";
  const AlignedPack a = write_aligned_pack(path, /*zero_the_chunk=*/false);
  ASSERT_EQ(a.offset % kHoleAlign, 0);

  // The chunk's bytes overwritten with zeros: read, and bad.
  {
    const std::vector<char> zeros(static_cast<std::size_t>(a.length), 0);
    const int fd = ::open(path.c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::pwrite(fd, zeros.data(), zeros.size(), a.offset), static_cast<ssize_t>(zeros.size()));
    ::close(fd);
  }
  auto written = open_pack_file(path);
  ASSERT_TRUE(written.ok());
  ASSERT_FALSE((*written)->in_hole(a.offset, a.length)) << "zeros written are data";
  auto read = verify_pack(**written);
  ASSERT_TRUE(read.ok()) << read.error().to_string();
  ASSERT_EQ(read->bad_chunks, 1);
  const std::string message = read->first_error.error().message;
  EXPECT_NE(message.find("punched.kvpack: chunk " + std::to_string(a.chunk) + " (layer 1, positions [512, 1024)"),
            std::string::npos)
      << message;
  auto refused = read_pack(**written);
  ASSERT_FALSE(refused.ok());

  // The same range a hole: the same verdict and message, the chunk unread.
  ASSERT_TRUE(punch(path, a.offset, a.length));
  auto src = open_pack_file(path);
  ASSERT_TRUE(src.ok());
  ASSERT_TRUE((*src)->in_hole(a.offset, a.length));
  WatchedSource watched(**src, a.offset, a.offset + a.length);
  auto v = verify_pack(watched);
  ASSERT_TRUE(v.ok()) << v.error().to_string();
  EXPECT_EQ(v->chunks, read->chunks);
  EXPECT_EQ(v->bad_chunks, 1);
  EXPECT_EQ(v->first_error.error().code, read->first_error.error().code);
  EXPECT_EQ(v->first_error.error().message, message);
  EXPECT_EQ(watched.watched_read.load(), 0) << "verify read the chunk in the hole";
  auto r = read_pack(**src);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().to_string(), refused.error().to_string());
  EXPECT_NE(r.error().message.find("its bytes hash to " + pack_internal::short_name(zeros_digest(a.length))),
            std::string::npos)
      << r.error().to_string();
}

}  // namespace
}  // namespace kvring
