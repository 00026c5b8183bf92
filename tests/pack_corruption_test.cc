// Bad packs and failed writes. Every case gets a clear error that names what
// and where, never a crash; a restore from a bad pack leaves the target cache
// exactly as it was; a failed write leaves no pack (and no temporary file)
// behind and never damages the pack already at the destination.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>

#include <fstream>
#include <random>

#include "cpu/parallel.h"
#include "kvring/pack.h"
#include "pack/coding.h"
#include "pack_test_util.h"
#include "test_util.h"

namespace kvring {
namespace {

using testing::filled_cache;
using testing::image;
using testing::small_config;

std::unique_ptr<PackSource> source(const std::string& bytes) {
  return memory_pack_source(bytes.data(), static_cast<std::int64_t>(bytes.size()), "test.kvpack");
}

std::string with_u32(std::string pack, std::int64_t at, std::uint32_t v) {
  coding::encode_fixed32(reinterpret_cast<std::uint8_t*>(pack.data() + at), v);
  testing::reseal(&pack);
  return pack;
}
std::string with_u64(std::string pack, std::int64_t at, std::uint64_t v) {
  coding::encode_fixed64(reinterpret_cast<std::uint8_t*>(pack.data() + at), v);
  testing::reseal(&pack);
  return pack;
}

class PackFaults : public ::testing::Test {
 protected:
  void SetUp() override {
    cfg_ = small_config(32, 256, 4);
    live_ = filled_cache(cfg_, 256, 70, 17);  // sliding rings wrapped
    snap_ = testing::snapshot_with_extras(*live_, 3);
    auto bytes = encode_pack(snap_, {.chunk_tokens = 16});
    ASSERT_TRUE(bytes.ok());
    pack_ = *bytes;
    auto m = read_manifest(*source(pack_));
    ASSERT_TRUE(m.ok());
    manifest_ = *m;
    bounds_ = testing::section_boundaries(manifest_);
    ASSERT_EQ(bounds_.back(), static_cast<std::int64_t>(pack_.size()));
    // The target holds a session of its own.
    target_ = filled_cache(cfg_, 256, 41, 99);
    before_ = image(*target_);
  }

  // Reading `bytes` fails with `code` and a message containing `words`; a
  // restore from them leaves the target cache exactly as it was.
  void expect_rejected(const std::string& bytes, ErrorCode code, const std::string& words) {
    auto src = source(bytes);
    auto r = read_pack(*src);
    ASSERT_FALSE(r.ok()) << "accepted: " << words;
    EXPECT_EQ(r.error().code, code) << r.error().to_string();
    EXPECT_NE(r.error().message.find(words), std::string::npos)
        << "'" << words << "' not in: " << r.error().to_string();
    const Status s = restore_pack(*src, {}, *target_);
    ASSERT_FALSE(s.ok());
    EXPECT_TRUE(image(*target_) == before_) << "target changed by: " << s.to_string();
  }

  // Section starts (docs/kvpack-format.md grammar).
  std::int64_t geometry() const { return bounds_[4]; }
  std::int64_t cache() const { return bounds_[5]; }
  std::int64_t tokens() const { return bounds_[6]; }
  std::int64_t metadata() const { return bounds_[7]; }
  std::int64_t planes() const { return bounds_[8]; }
  std::int64_t plane(std::int64_t i) const { return planes() + 4 + i * kPlaneRecordBytes; }
  std::int64_t chunks() const { return bounds_[9]; }
  std::int64_t chunk(std::int64_t i) const { return chunks() + 4 + i * kChunkRecordBytes; }
  std::int64_t payload() const { return bounds_[11]; }

  ModelConfig cfg_;
  std::unique_ptr<KvCache> live_, target_;
  Snapshot snap_;
  std::string pack_;
  Manifest manifest_;
  std::vector<std::int64_t> bounds_;
  testing::CacheImage before_;
};

TEST_F(PackFaults, TheIntactPackReads) {
  auto r = read_pack(*source(pack_));
  ASSERT_TRUE(r.ok()) << r.error().to_string();
  EXPECT_TRUE(testing::same_rows(*r, snap_));
  EXPECT_EQ(payload(), manifest_.payload_offset);
}

TEST_F(PackFaults, TruncatedAtEverySectionBoundary) {
  for (std::size_t i = 0; i + 1 < bounds_.size(); ++i) {
    for (std::int64_t delta : {-1, 0, 1}) {
      const std::int64_t at = bounds_[i] + delta;
      if (at < 0 || at >= static_cast<std::int64_t>(pack_.size())) continue;
      SCOPED_TRACE("truncated at byte " + std::to_string(at));
      expect_rejected(pack_.substr(0, static_cast<std::size_t>(at)), ErrorCode::kCorruption, "truncated");
      if (at >= payload()) {
        // The message names the first chunk the file cuts.
        std::int64_t c = 0;
        while (manifest_.chunks[static_cast<std::size_t>(c)].offset +
                   manifest_.chunks[static_cast<std::size_t>(c)].byte_length <= at)
          ++c;
        expect_rejected(pack_.substr(0, static_cast<std::size_t>(at)), ErrorCode::kCorruption,
                        "chunk " + std::to_string(c) + " (layer ");
      }
    }
  }
}

TEST_F(PackFaults, TruncatedAtEveryPrefixOfASmallPack) {
  auto small = filled_cache(small_config(32, 64, 4, 2, 1, 2), 64, 40, 5);
  auto bytes = encode_pack(testing::snapshot_with_extras(*small, 1), {.chunk_tokens = 8});
  ASSERT_TRUE(bytes.ok());
  for (std::size_t n = 0; n < bytes->size(); ++n) {
    auto r = read_pack(*source(bytes->substr(0, n)));
    ASSERT_FALSE(r.ok()) << "a prefix of " << n << " bytes was accepted";
    ASSERT_EQ(r.error().code, ErrorCode::kCorruption) << r.error().to_string();
  }
}

TEST_F(PackFaults, TruncatedAtRandomOffsets) {
  std::mt19937_64 rng(2024);
  for (int i = 0; i < 200; ++i) {
    const auto at = static_cast<std::size_t>(rng() % pack_.size());
    SCOPED_TRACE("truncated at byte " + std::to_string(at));
    expect_rejected(pack_.substr(0, at), ErrorCode::kCorruption, "truncated");
  }
}

TEST_F(PackFaults, EveryFlippedHeaderByteIsDetected) {
  std::mt19937_64 rng(7);
  for (std::int64_t at = 0; at < payload(); ++at) {
    std::string bad = pack_;
    bad[static_cast<std::size_t>(at)] ^= static_cast<char>(1 + rng() % 255);
    auto r = read_pack(*source(bad));
    ASSERT_FALSE(r.ok()) << "flipped byte " << at << " was accepted";
    // The version and flags are checked before the digest, and a value this
    // build does not know is damage only where the bytes match the digest
    // as this version's: a flip of one byte always does.
    ASSERT_EQ(r.error().code, ErrorCode::kCorruption) << r.error().to_string();
    if (at >= 16 && at < payload()) {
      ASSERT_NE(r.error().message.find("manifest"), std::string::npos) << r.error().to_string();
    }
  }
  // And a restore from a damaged header leaves the target alone.
  std::string bad = pack_;
  bad[static_cast<std::size_t>(plane(1) + 11)] ^= 0x04;  // a ring's len
  expect_rejected(bad, ErrorCode::kCorruption, "manifest digest at byte " + std::to_string(payload() - 32));
}

TEST_F(PackFaults, FlippedPayloadBytesNameTheirChunk) {
  std::mt19937_64 rng(8);
  for (int i = 0; i < 100; ++i) {
    const std::int64_t at = payload() + static_cast<std::int64_t>(rng() % (pack_.size() - payload()));
    std::int64_t c = 0;
    while (manifest_.chunks[static_cast<std::size_t>(c)].offset +
               manifest_.chunks[static_cast<std::size_t>(c)].byte_length <= at)
      ++c;
    std::string bad = pack_;
    bad[static_cast<std::size_t>(at)] ^= static_cast<char>(1 + rng() % 255);
    SCOPED_TRACE("flipped byte " + std::to_string(at));
    expect_rejected(bad, ErrorCode::kCorruption,
                    "test.kvpack: chunk " + std::to_string(c) + " (layer " +
                        std::to_string(manifest_.chunks[static_cast<std::size_t>(c)].layer));
    auto v = verify_pack(*source(bad));
    ASSERT_TRUE(v.ok());
    EXPECT_EQ(v->bad_chunks, 1);
    EXPECT_NE(v->first_error.error().message.find("chunk " + std::to_string(c) + " "), std::string::npos);
  }
}

// A snapshot read into again is no valid snapshot after a failed read,
// whatever it held: a damaged chunk (read into the rows before its hash
// was checked) and a damaged manifest alike. Its buffers stay for reuse.
TEST_F(PackFaults, AFailedReadLeavesNoValidSnapshot) {
  std::string damaged_chunk = pack_;
  damaged_chunk.back() ^= 1;
  std::string damaged_manifest = pack_;
  damaged_manifest[static_cast<std::size_t>(geometry()) + 1] ^= 1;
  for (const std::string* bad : {&damaged_chunk, &damaged_manifest}) {
    Snapshot out;
    ASSERT_TRUE(read_pack(*source(pack_), {}, out).ok());
    ASSERT_TRUE(validate_snapshot(out).ok());
    const Status r = read_pack(*source(*bad), {}, out);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().code, ErrorCode::kCorruption) << r.to_string();
    EXPECT_FALSE(validate_snapshot(out).ok());
    EXPECT_FALSE(restore(out, *target_).ok());
    EXPECT_TRUE(image(*target_) == before_);
    ASSERT_TRUE(read_pack(*source(pack_), {}, out).ok());
    EXPECT_TRUE(testing::same_rows(out, snap_));
  }
}

TEST_F(PackFaults, WrongMagic) {
  std::string bad = pack_;
  bad[1] = 'X';
  expect_rejected(bad, ErrorCode::kCorruption, "magic at byte 0");
  expect_rejected("PK\x03\x04 this is a zip file, not a pack", ErrorCode::kCorruption, "not a kvpack file");
  expect_rejected("", ErrorCode::kCorruption, "the file has 0 bytes");
}

TEST_F(PackFaults, NewerVersionAndUnknownFlags) {
  std::string newer = pack_;
  coding::encode_fixed16(reinterpret_cast<std::uint8_t*>(newer.data() + 8), 2);
  testing::reseal(&newer);
  expect_rejected(newer, ErrorCode::kUnsupported, "pack version 2 is newer than this build reads (1)");
  std::string zero = pack_;
  coding::encode_fixed16(reinterpret_cast<std::uint8_t*>(zero.data() + 8), 0);
  expect_rejected(zero, ErrorCode::kCorruption, "version at byte 8: 0 is not a kvpack version");
  std::string flags = pack_;
  coding::encode_fixed16(reinterpret_cast<std::uint8_t*>(flags.data() + 10), 0x0204);
  testing::reseal(&flags);
  expect_rejected(flags, ErrorCode::kUnsupported, "flags at byte 10: 0x0204 has bits");
  std::string both = newer;
  coding::encode_fixed16(reinterpret_cast<std::uint8_t*>(both.data() + 10), 0x0205);
  testing::reseal(&both);
  expect_rejected(both, ErrorCode::kUnsupported, "pack version 2 is newer");
}

// A version or flags this build does not know, on a pack whose bytes match
// their digest as a version-1 pack's: the field is damaged, and the pack is
// refused as damaged (verify exits 1), not as a newer format.
TEST_F(PackFaults, DamagedVersionAndFlagsAreDamageNotANewerFormat) {
  std::string version = pack_;
  coding::encode_fixed16(reinterpret_cast<std::uint8_t*>(version.data() + 8), 0x0301);
  expect_rejected(version, ErrorCode::kCorruption,
                  "preamble: version 769 at byte 8, flags 0x0000 at byte 10: damaged: the preamble and manifest "
                  "match their digest as version 1 with flags 0x0000");
  std::string flags = pack_;
  coding::encode_fixed16(reinterpret_cast<std::uint8_t*>(flags.data() + 10), 0x8001);
  expect_rejected(flags, ErrorCode::kCorruption, "flags 0x8001 at byte 10: damaged");
  std::string both = pack_;
  coding::encode_fixed16(reinterpret_cast<std::uint8_t*>(both.data() + 8), 7);
  coding::encode_fixed16(reinterpret_cast<std::uint8_t*>(both.data() + 10), 0x0040);
  expect_rejected(both, ErrorCode::kCorruption, "version 7 at byte 8, flags 0x0040 at byte 10: damaged");
  // And damage elsewhere as well: nothing matches, so the field is taken as
  // written (a newer format).
  std::string more = version;
  more[static_cast<std::size_t>(payload() - 40)] ^= 0x01;
  expect_rejected(more, ErrorCode::kUnsupported, "pack version 769 is newer than this build reads (1)");
  for (const std::string& bad : {version, flags, both}) {
    auto v = verify_pack(*source(bad));
    ASSERT_FALSE(v.ok());
    EXPECT_EQ(v.error().code, ErrorCode::kCorruption);
  }
}

// A memory view the caller described wrongly is refused as its error.
TEST_F(PackFaults, AMemoryViewAtANullPointerIsRefused) {
  const auto null_view = memory_pack_source(nullptr, static_cast<std::int64_t>(pack_.size()));
  const auto negative = memory_pack_source(pack_.data(), -5);
  for (const PackSource* src : {null_view.get(), negative.get()}) {
    const std::string what = src == null_view.get() ? " bytes at a null pointer" : "a source of -5 bytes";
    auto m = read_manifest(*src);
    ASSERT_FALSE(m.ok());
    EXPECT_NE(m.error().message.find(what), std::string::npos) << m.error().to_string();
    Snapshot out;
    const Status r = read_pack(*src, {}, out);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.error().message.find(what), std::string::npos) << r.error().to_string();
    EXPECT_FALSE(verify_pack(*src).ok());
  }
  auto m = read_manifest(*null_view);
  EXPECT_EQ(m.error().code, ErrorCode::kInvalidArgument);
  std::uint8_t byte = 0;
  EXPECT_EQ(source(pack_)->read_at(0, 1, nullptr).error().code, ErrorCode::kInvalidArgument);
  EXPECT_TRUE(source(pack_)->read_at(0, 1, &byte).ok());
  EXPECT_EQ(byte, static_cast<std::uint8_t>(pack_[0]));
}

TEST_F(PackFaults, TrailingBytes) {
  expect_rejected(pack_ + "x", ErrorCode::kCorruption, "1 trailing bytes after the last chunk");
}

// Fields with absurd values behind a valid digest: the field checks reject
// each one, naming it and its offset, before it sizes anything.
TEST_F(PackFaults, AbsurdFieldsAreRejectedByName) {
  const std::uint32_t kMax32 = 0xffffffffu;
  struct Case {
    std::string bytes;
    std::string words;
  };
  const std::int64_t c0 = chunk(0);
  std::string huge_len = pack_;
  coding::encode_fixed32(reinterpret_cast<std::uint8_t*>(huge_len.data() + 12), kMax32);
  std::string past_end = pack_;
  coding::encode_fixed32(reinterpret_cast<std::uint8_t*>(past_end.data() + 12),
                         static_cast<std::uint32_t>(pack_.size()));
  const std::vector<Case> cases = {
      {huge_len, "manifest_len at byte 12: 4294967295 exceeds"},
      {past_end, "manifest: truncated: the preamble announces"},
      {with_u32(pack_, geometry(), kMax32), "geometry: n_layers at byte 16: 4294967295 outside"},
      {with_u32(pack_, geometry() + 4, 0), "not a valid geometry: num_attention_heads = 0"},
      {with_u32(pack_, geometry() + 12, kMax32), "not a valid geometry: head_dim"},
      {with_u32(pack_, geometry() + 20, kMax32), "not a valid geometry: max_position_embeddings"},
      {with_u32(pack_, geometry() + 24 + 1, 9), "layer_kind at byte " + std::to_string(geometry() + 25)},
      {with_u32(pack_, geometry() + 24 + 4 + 3, 0x12345678), "fingerprint at byte " + std::to_string(geometry() + 28)},
      {with_u32(pack_, cache(), kMax32), "cache: context at byte " + std::to_string(cache())},
      {with_u32(pack_, cache() + 4, 0), "chunk_tokens at byte " + std::to_string(cache() + 4) + ": 0 outside"},
      {with_u32(pack_, cache() + 4, kMax32), "chunk_tokens at byte"},
      {with_u64(pack_, cache() + 8, std::uint64_t{1} << 63), "token_count at byte " + std::to_string(cache() + 8)},
      {with_u64(pack_, tokens(), std::uint64_t{1} << 61), "n_token_ids at byte " + std::to_string(tokens())},
      {with_u64(with_u64(pack_, cache() + 8, std::uint64_t{1} << 40), tokens(), std::uint64_t{1} << 40),
       "token_id at byte " + std::to_string(tokens() + 8) + ": truncated"},
      // Found by the fuzzer: the largest legal count must not overflow the
      // arithmetic of its own error message.
      {with_u64(with_u64(pack_, cache() + 8, kMaxTokenCount), tokens(), kMaxTokenCount),
       "token_id at byte " + std::to_string(tokens() + 8) + ": truncated"},
      {with_u32(pack_, metadata(), kMax32), "metadata at byte " + std::to_string(metadata() + 4) + ": truncated"},
      {with_u32(pack_, planes(), kMax32), "plane table: n_planes at byte " + std::to_string(planes())},
      {with_u32(pack_, plane(2), 7), "plane 2: layer at byte " + std::to_string(plane(2))},
      {with_u32(pack_, plane(1) + 7, kMax32), "plane 1: capacity at byte " + std::to_string(plane(1) + 7)},
      {with_u32(pack_, plane(1) + 11, kMax32), "plane 1: ring state at byte " + std::to_string(plane(1) + 23)},
      {with_u64(pack_, plane(0) + 15, std::uint64_t{1} << 63), "plane 0: origin_logical at byte"},
      {with_u32(pack_, plane(0) + 23, 31), "plane 0: ring state at byte " + std::to_string(plane(0) + 23) +
                                               ": len 32, origin_logical 38, origin_physical 31 is not"},
      {with_u64(pack_, plane(3) + 15, 1), "plane 3: ring state"},
      {with_u32(pack_, plane(3) + 27, kMax32), "plane 3: n_chunks at byte " + std::to_string(plane(3) + 27)},
      {with_u32(pack_, chunks(), kMax32), "chunk table: n_chunk_records at byte " + std::to_string(chunks())},
      {with_u64(pack_, c0, 1), "chunk 0 (layer 0): first_position at byte " + std::to_string(c0)},
      {with_u32(pack_, c0 + 8, kMax32), "chunk 0 (layer 0): rows at byte " + std::to_string(c0 + 8)},
      {with_u32(pack_, c0 + 12, kMax32), "chunk 0 (layer 0): byte_length at byte " + std::to_string(c0 + 12)},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.words);
    expect_rejected(c.bytes, ErrorCode::kCorruption, c.words);
  }
  // A plane's encoding and the planes' kinds.
  std::string enc = pack_;
  enc[static_cast<std::size_t>(plane(0) + 6)] = 9;
  testing::reseal(&enc);
  expect_rejected(enc, ErrorCode::kCorruption, "plane 0: encoding at byte " + std::to_string(plane(0) + 6));
  std::string layout = pack_;
  layout[static_cast<std::size_t>(plane(3) + 5)] = 0;
  testing::reseal(&layout);
  expect_rejected(layout, ErrorCode::kCorruption, "plane 3: layout");
}

// Another model's pack is refused before a byte of payload is read: a damaged
// payload does not even get looked at.
TEST_F(PackFaults, AnotherGeometryIsRefusedFirst) {
  std::string bad_payload = pack_;
  bad_payload[bad_payload.size() - 3] ^= 0x55;
  auto other = filled_cache(small_config(64, 256, 4), 256, 12, 1);
  const testing::CacheImage other_before = image(*other);
  const Status s = restore_pack(*source(bad_payload), {}, *other);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, ErrorCode::kMismatch) << s.to_string();
  EXPECT_NE(s.error().message.find("test.kvpack: the snapshot is of another model geometry: "
                                   "sliding_window 32 in the snapshot, 64"),
            std::string::npos)
      << s.to_string();
  EXPECT_TRUE(image(*other) == other_before);
}

TEST_F(PackFaults, ThinPackNeedsItsStore) {
  const std::string dir = testing::make_temp_dir("thin");
  auto store = open_dir_store(dir);
  ASSERT_TRUE(store.ok());
  auto thin = encode_pack(snap_, {.chunk_tokens = 16, .store = store->get()});
  ASSERT_TRUE(thin.ok());
  expect_rejected(*thin, ErrorCode::kInvalidArgument, "is a thin pack");
  testing::remove_tree(dir);
}

// --- Failed writes -------------------------------------------------------

class PackWriteFaults : public PackFaults {
 protected:
  void SetUp() override {
    PackFaults::SetUp();
    dir_ = testing::make_temp_dir("write");
    path_ = dir_ + "/session.kvpack";
    // A valid pack of another session is already there.
    auto other = filled_cache(cfg_, 256, 33, 5);
    old_snap_ = testing::snapshot_with_extras(*other, 9);
    ASSERT_TRUE(write_pack(old_snap_, path_).ok());
    old_bytes_ = read_file(path_);
  }
  void TearDown() override { testing::remove_tree(dir_); }

  static std::string read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  // The old pack is untouched and nothing else is in the directory.
  void expect_old_pack_intact() {
    EXPECT_EQ(read_file(path_), old_bytes_);
    EXPECT_EQ(testing::list_dir(dir_), std::vector<std::string>{"session.kvpack"});
    auto r = read_pack_file(path_);
    ASSERT_TRUE(r.ok()) << r.error().to_string();
    EXPECT_TRUE(testing::same_rows(*r, old_snap_));
  }

  // Runs in a death-test child: writes under a 4 KiB file size limit, which
  // stops the write part-way (as a full disk would), and exits 0 when the
  // error names the cause and the file and the old pack is intact.
  void write_under_size_limit() {
    cpu::set_thread_limit(1);  // a forked child has no pool workers
    ::signal(SIGXFSZ, SIG_IGN);
    rlimit limit{4096, 4096};
    ::setrlimit(RLIMIT_FSIZE, &limit);
    const Status s = write_pack(snap_, path_, {.chunk_tokens = 16});
    const bool named = !s.ok() && s.error().message.find("File too large") != std::string::npos &&
                       s.error().message.find(dir_ + "/.tmp-session.kvpack") != std::string::npos;
    const bool intact = read_file(path_) == old_bytes_ &&
                        testing::list_dir(dir_) == std::vector<std::string>{"session.kvpack"};
    if (!named || !intact) {
      std::fprintf(stderr, "named %d intact %d: %s\n", named, intact, s.to_string().c_str());
      std::_Exit(1);
    }
    std::_Exit(0);
  }

  std::string dir_, path_, old_bytes_;
  Snapshot old_snap_;
};

TEST_F(PackWriteFaults, EveryFailingStepLeavesTheOldPack) {
  for (IoStep step : {IoStep::kOpen, IoStep::kWrite, IoStep::kFsync, IoStep::kRename}) {
    SCOPED_TRACE(io_step_name(step));
    WriteOptions o{.chunk_tokens = 16};
    o.io.fault = [step](IoStep s, const std::string&) {
      return s == step ? Status(io_error("injected")) : Status::Ok();
    };
    const Status s = write_pack(snap_, path_, o);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.error().code, ErrorCode::kIOError);
    EXPECT_NE(s.error().message.find(std::string(io_step_name(step)) + " of " + dir_ + "/"),
              std::string::npos) << s.to_string();
    expect_old_pack_intact();
  }
  // A failed directory sync comes after the rename: the new pack is complete.
  WriteOptions o{.chunk_tokens = 16};
  o.io.fault = [](IoStep s, const std::string&) {
    return s == IoStep::kFsyncDir ? Status(io_error("injected")) : Status::Ok();
  };
  EXPECT_FALSE(write_pack(snap_, path_, o).ok());
  auto r = read_pack_file(path_);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(testing::same_rows(*r, snap_));
}

// A real short write: the file size limit stops the write part-way (as a
// full disk would). Run in a child so the limit does not outlive the test.
TEST_F(PackWriteFaults, ShortWriteOnAFullDevice) {
  EXPECT_EXIT(write_under_size_limit(), ::testing::ExitedWithCode(0), "");
}

TEST_F(PackWriteFaults, UnwritableDestinations) {
  const Status missing = write_pack(snap_, dir_ + "/no/such/dir/p.kvpack");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.error().message.find(dir_ + "/no/such/dir/.tmp-p.kvpack"), std::string::npos)
      << missing.to_string();
  // A device is never replaced (root can write /dev).
  const Status dev = write_pack(snap_, "/dev/full");
  ASSERT_FALSE(dev.ok());
  EXPECT_NE(dev.error().message.find("/dev/full: it is a character device, not a regular file"), std::string::npos);
  const Status is_dir = write_pack(snap_, dir_);
  EXPECT_FALSE(is_dir.ok());
  expect_old_pack_intact();
}

}  // namespace
}  // namespace kvring

namespace kvring {
namespace {

// A cheap, deterministic fuzz run for every CI build: random mutations of
// valid packs (byte flips and overwrites with boundary values, resealed so
// they meet the field checks; truncations; insertions) never crash, and a
// mutated pack either reads as a valid snapshot or is refused with the
// target left as it was. scripts/fuzz.sh runs the real fuzzer.
TEST(PackMutations, NeverCrashNorHalfRestore) {
  const ModelConfig cfg = testing::small_config(32, 128, 4, 2, 1, 4);
  std::vector<std::string> packs;
  for (std::int64_t tokens : {0, 20, 70}) {
    auto live = testing::filled_cache(cfg, 128, tokens, static_cast<std::uint64_t>(tokens) + 1);
    auto bytes = encode_pack(testing::snapshot_with_extras(*live, 5), {.chunk_tokens = 16});
    ASSERT_TRUE(bytes.ok());
    packs.push_back(*bytes);
  }
  auto target = testing::filled_cache(cfg, 128, 9, 3);
  const testing::CacheImage before = testing::image(*target);
  std::mt19937_64 rng(77);
  const std::uint64_t boundary[] = {0, 1, 0x7f, 0x80, 0xff, 0xffff, 0xffffffffu, 0x80000000u};
  int accepted = 0;
  for (int i = 0; i < 3000; ++i) {
    std::string p = packs[rng() % packs.size()];
    const auto at = static_cast<std::size_t>(rng() % p.size());
    switch (rng() % 4) {
      case 0:
        p[at] = static_cast<char>(rng());
        break;
      case 1: {
        const std::uint64_t v = boundary[rng() % 8];
        for (std::size_t b = 0; b < 4 && at + b < p.size(); ++b) p[at + b] = static_cast<char>(v >> (8 * b));
        break;
      }
      case 2:
        p.resize(at);
        break;
      default:
        p.insert(at, 1 + rng() % 8, static_cast<char>(rng()));
    }
    if (p.size() >= static_cast<std::size_t>(kPreambleBytes) && rng() % 2 == 0) {
      const std::uint32_t len = coding::decode_fixed32(reinterpret_cast<const std::uint8_t*>(p.data() + 12));
      if (static_cast<std::size_t>(kPreambleBytes + len + kDigestBytes) <= p.size()) testing::reseal(&p);
    }
    auto src = source(p);
    auto r = read_pack(*src);
    if (r.ok()) {
      ++accepted;
      ASSERT_TRUE(validate_snapshot(*r).ok());
    }
    const Status s = restore_pack(*src, {}, *target);
    if (!s.ok()) {
      ASSERT_TRUE(testing::image(*target) == before) << s.to_string();
    } else {
      ASSERT_TRUE(target->reset().ok());
      testing::fill(*target, 0, 9, 3);
    }
  }
  // Some mutations hit bytes no check can see (metadata, token ids behind a
  // resealed digest); most must be refused.
  EXPECT_LT(accepted, 1500);
}

// Inputs that once broke the fuzz build, as they are and resealed.
TEST(PackMutations, FuzzRegressionsAreRefused) {
  const std::string dir = std::string(KVRING_SOURCE_DIR) + "/fuzz/regressions";
  const auto names = testing::list_dir(dir);
  ASSERT_FALSE(names.empty());
  for (const std::string& n : names) {
    std::ifstream in(dir + "/" + n, std::ios::binary);
    std::string p((std::istreambuf_iterator<char>(in)), {});
    EXPECT_FALSE(read_pack(*source(p)).ok()) << n;
    testing::reseal(&p);
    auto r = read_pack(*source(p));
    ASSERT_FALSE(r.ok()) << n;
    EXPECT_EQ(r.error().code, ErrorCode::kCorruption) << r.error().to_string();
  }
}

}  // namespace
}  // namespace kvring
