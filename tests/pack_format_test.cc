// The kvpack format: the worked example of docs/kvpack-format.md byte for
// byte, round trips in both encodings and at many chunk sizes, chunk
// boundaries, determinism, and self-contained versus thin packs.
#include "kvring/pack.h"

#include <gtest/gtest.h>

#include <fstream>
#include <random>
#include <regex>
#include <sstream>

#include "kvring/f16.h"
#include "pack/pack_common.h"
#include "pack_test_util.h"
#include "test_util.h"

namespace kvring {
namespace {

using testing::filled_cache;
using testing::image;
using testing::same_rows;
using testing::small_config;

// The hex dump of the worked example, read from the document itself so the
// two can never drift apart.
std::string example_bytes_from_doc() {
  std::ifstream in(std::string(KVRING_SOURCE_DIR) + "/docs/kvpack-format.md");
  std::stringstream text;
  text << in.rdbuf();
  const std::string doc = text.str();
  const auto begin = doc.find("## Worked example");
  const auto end = doc.find("## ", begin + 3);
  const std::string section = doc.substr(begin, end - begin);
  std::string bytes;
  const std::regex line(R"(^[0-9a-f]{4}: ((?:[0-9a-f]{2} ?)+)$)");
  std::istringstream lines(section);
  for (std::string l; std::getline(lines, l);) {
    std::smatch m;
    if (!std::regex_match(l, m, line)) continue;
    std::istringstream hex(m[1].str());
    for (std::string b; hex >> b;) bytes.push_back(static_cast<char>(std::stoi(b, nullptr, 16)));
  }
  return bytes;
}

// The example's snapshot, built through the cache like any other.
Snapshot example_snapshot() {
  const ModelConfig cfg = make_hybrid_config("example", 2, 2, 2, 1, 2, 4, 64);
  auto cache = make_cpu_cache(cfg, {.context = 64});
  EXPECT_TRUE(cache.ok());
  for (std::int64_t l = 0; l < 2; ++l)
    for (std::int64_t t = 0; t < 3; ++t) {
      const float k[2] = {static_cast<float>(8 * l + 2 * t + 1), static_cast<float>(8 * l + 2 * t + 2)};
      const float v[2] = {-k[0], -k[1]};
      EXPECT_TRUE((*cache)->store_token(l, t, k, v).ok());
    }
  auto s = take_snapshot(**cache);
  EXPECT_TRUE(s.ok());
  s->token_ids = {5, 7, 11};
  s->metadata = "demo";
  return *s;
}

TEST(PackFormat, WorkedExampleMatchesTheDocument) {
  const std::string doc = example_bytes_from_doc();
  ASSERT_EQ(doc.size(), 460u);
  auto bytes = encode_pack(example_snapshot(), {.chunk_tokens = 2});
  ASSERT_TRUE(bytes.ok()) << bytes.error().to_string();
  EXPECT_EQ(to_hex(reinterpret_cast<const std::uint8_t*>(bytes->data()), bytes->size()),
            to_hex(reinterpret_cast<const std::uint8_t*>(doc.data()), doc.size()));

  auto m = read_manifest(*memory_pack_source(doc.data(), static_cast<std::int64_t>(doc.size())));
  ASSERT_TRUE(m.ok()) << m.error().to_string();
  EXPECT_EQ(m->manifest_bytes, 364);
  EXPECT_EQ(m->payload_offset, 412);
  EXPECT_EQ(m->chunks.size(), 4u);
  EXPECT_EQ(to_hex(m->chunks[1].name).substr(0, 8), "d2021a5c");
  EXPECT_EQ(m->header.token_ids, (std::vector<std::int32_t>{5, 7, 11}));
  EXPECT_EQ(m->header.metadata, "demo");
}

TEST(PackFormat, ThinExampleIsTheManifestWithTheThinFlag) {
  const std::string dir = testing::make_temp_dir("thin-example");
  auto store = open_dir_store(dir);
  ASSERT_TRUE(store.ok());
  auto thin = encode_pack(example_snapshot(), {.chunk_tokens = 2, .store = store->get()});
  ASSERT_TRUE(thin.ok()) << thin.error().to_string();
  ASSERT_EQ(thin->size(), 412u);
  EXPECT_EQ((*thin)[10], 1);
  const std::string doc = example_bytes_from_doc();
  EXPECT_EQ(thin->substr(16, 364), doc.substr(16, 364));  // the same manifest
  auto stats = (*store)->stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->chunks, 4);
  EXPECT_EQ(stats->bytes, 48);
  auto back = read_pack(*memory_pack_source(thin->data(), 412), {.store = store->get()});
  ASSERT_TRUE(back.ok()) << back.error().to_string();
  EXPECT_TRUE(same_rows(*back, example_snapshot()));
  testing::remove_tree(dir);
}

TEST(PackFormat, RoundTripsInBothEncodingsAtManyChunkSizes) {
  const ModelConfig cfg = small_config(32, 256, 8);
  for (std::int64_t tokens : {0, 1, 33, 100, 256}) {
    auto live = filled_cache(cfg, 256, tokens, 21);
    const Snapshot snap = testing::snapshot_with_extras(*live, 4);
    for (Encoding enc : {Encoding::kF16Le, Encoding::kF32Le}) {
      for (std::int64_t chunk : {1, 7, 32, 256, 4096}) {
        SCOPED_TRACE(std::to_string(tokens) + " tokens, " + encoding_name(enc) + ", chunk " +
                     std::to_string(chunk));
        auto bytes = encode_pack(snap, {.encoding = enc, .chunk_tokens = chunk});
        ASSERT_TRUE(bytes.ok()) << bytes.error().to_string();
        auto src = memory_pack_source(bytes->data(), static_cast<std::int64_t>(bytes->size()));
        auto back = read_pack(*src);
        ASSERT_TRUE(back.ok()) << back.error().to_string();
        EXPECT_TRUE(same_rows(*back, snap));
        auto target = make_cpu_cache(cfg, {.context = 256});
        ASSERT_TRUE(target.ok());
        ASSERT_TRUE(restore_pack(*src, {}, **target).ok());
        EXPECT_TRUE(image(**target) == image(*live));
      }
    }
  }
}

// F32Le carries every f16 bit pattern, NaN payloads and signed zeros
// included, back to the same bits.
TEST(PackFormat, F32LeIsBitwiseForEveryF16Value) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const auto bits = static_cast<std::uint16_t>(h);
    ASSERT_EQ(pack_internal::narrow_f32_bits(f32_bits(f16_to_f32(bits))), bits) << std::hex << h;
  }
  // Through a pack: rows holding every pattern.
  const ModelConfig cfg = small_config(32, 2048, 4, 4, 2, 16);  // kv_dim 32
  auto cache = make_cpu_cache(cfg, {.context = 2048});
  ASSERT_TRUE(cache.ok());
  const std::int64_t rows = 65536 / 32;
  std::vector<std::uint16_t> k(65536), v(65536);
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<std::uint16_t>(i);
    v[i] = static_cast<std::uint16_t>(65535 - i);
  }
  for (std::int64_t l = 0; l < 4; ++l) {
    const RingState& r = (*cache)->ring(l);
    auto ring = RingState::sequential(r.capacity(), r.wraps(), rows);
    ASSERT_TRUE(ring.ok());
    const std::size_t skip = static_cast<std::size_t>((rows - ring->len()) * 32);
    ASSERT_TRUE((*cache)->install(l, *ring, k.data() + skip, v.data() + skip).ok());
  }
  auto snap = take_snapshot(**cache);
  ASSERT_TRUE(snap.ok());
  auto bytes = encode_pack(*snap, {.encoding = Encoding::kF32Le});
  ASSERT_TRUE(bytes.ok());
  auto back = read_pack(*memory_pack_source(bytes->data(), static_cast<std::int64_t>(bytes->size())));
  ASSERT_TRUE(back.ok()) << back.error().to_string();
  EXPECT_TRUE(same_rows(*back, *snap));
}

// Chunk boundaries against a direct enumeration of positions.
TEST(PackFormat, ChunksAreCutAtMultiplesOfChunkTokens) {
  std::mt19937_64 rng(99);
  for (int trial = 0; trial < 2000; ++trial) {
    const std::int64_t t = 1 + static_cast<std::int64_t>(rng() % 70);
    const std::int64_t origin = static_cast<std::int64_t>(rng() % 300);
    const std::int64_t len = static_cast<std::int64_t>(rng() % 200);
    std::vector<pack_internal::ChunkRange> want;
    for (std::int64_t p = origin; p < origin + len; ++p) {
      if (want.empty() || p % t == 0) want.push_back({p, 0});
      ++want.back().rows;
    }
    const std::int64_t n = pack_internal::count_chunks(origin, len, t);
    ASSERT_EQ(n, static_cast<std::int64_t>(want.size())) << origin << " " << len << " " << t;
    for (std::int64_t j = 0; j < n; ++j) {
      const auto got = pack_internal::chunk_range(origin, len, t, j);
      ASSERT_EQ(got.first_position, want[static_cast<std::size_t>(j)].first_position);
      ASSERT_EQ(got.rows, want[static_cast<std::size_t>(j)].rows);
    }
  }
}

// The same session built through batches of other sizes gives the same pack.
TEST(PackFormat, BytesDependOnlyOnTheSession) {
  const ModelConfig cfg = small_config(32, 256, 4);
  std::string first;
  for (std::int64_t batch : {1, 7, 64, 200}) {
    auto c = make_cpu_cache(cfg, {.context = 256});
    ASSERT_TRUE(c.ok());
    testing::fill(**c, 0, 200, 5, batch);
    auto snap = take_snapshot(**c);
    ASSERT_TRUE(snap.ok());
    auto bytes = encode_pack(*snap, {.chunk_tokens = 16});
    ASSERT_TRUE(bytes.ok());
    if (first.empty()) first = *bytes;
    EXPECT_EQ(*bytes, first) << "batch " << batch;
  }
}

TEST(PackFormat, ManifestRecordsTheRings) {
  const ModelConfig cfg = small_config(32, 256, 4);
  auto live = filled_cache(cfg, 256, 70, 1);
  auto snap = take_snapshot(*live);
  ASSERT_TRUE(snap.ok());
  auto bytes = encode_pack(*snap, {.chunk_tokens = 16});
  ASSERT_TRUE(bytes.ok());
  auto m = read_manifest(*memory_pack_source(bytes->data(), static_cast<std::int64_t>(bytes->size())));
  ASSERT_TRUE(m.ok());
  const RingState& r = m->header.planes[0].ring;
  EXPECT_EQ(r.capacity(), 32);
  EXPECT_EQ(r.origin_logical(), 38);
  EXPECT_EQ(r.origin_physical(), 6);
  // [38, 48), [48, 64), [64, 70) as the document's wrapped example says.
  const PackPlane& p = m->planes[0];
  ASSERT_EQ(p.n_chunks, 3);
  EXPECT_EQ(m->chunks[0].first_position, 38);
  EXPECT_EQ(m->chunks[0].rows, 10);
  EXPECT_EQ(m->chunks[2].first_position, 64);
  EXPECT_EQ(m->chunks[2].rows, 6);
  // The full plane: [0, 16) ... [64, 70).
  EXPECT_EQ(m->planes[3].n_chunks, 5);
}

TEST(PackFormat, WriterRefusesBadOptions) {
  auto live = filled_cache(small_config(), 256, 10, 1);
  auto snap = take_snapshot(*live);
  ASSERT_TRUE(snap.ok());
  auto zero = encode_pack(*snap, {.chunk_tokens = 0});
  ASSERT_FALSE(zero.ok());
  EXPECT_NE(zero.error().message.find("chunk_tokens 0 outside"), std::string::npos);
  auto huge = encode_pack(*snap, {.chunk_tokens = kMaxChunkTokens + 1});
  EXPECT_FALSE(huge.ok());
  auto enc = encode_pack(*snap, {.encoding = static_cast<Encoding>(7)});
  EXPECT_FALSE(enc.ok());
}

// The manifest's size is known from the header and the chunk count before
// any manifest is built: metadata that brings it to the limit is written,
// one byte more is refused with the exact size, and so is a chunk size
// whose chunk table would take it past.
TEST(PackFormat, AManifestPastItsLimitIsRefused) {
  auto live = filled_cache(small_config(), 256, 10, 1);
  Snapshot snap = testing::snapshot_with_extras(*live, 2);
  snap.metadata.clear();
  auto small = encode_pack(snap, {});
  ASSERT_TRUE(small.ok());
  auto src = memory_pack_source(small->data(), static_cast<std::int64_t>(small->size()));
  auto m = read_manifest(*src);
  ASSERT_TRUE(m.ok());
  const std::int64_t rest = m->manifest_bytes;
  snap.metadata.assign(static_cast<std::size_t>(kMaxManifestBytes - rest), 'm');
  auto at_limit = encode_pack(snap, {});
  ASSERT_TRUE(at_limit.ok()) << at_limit.error().to_string();
  auto back = memory_pack_source(at_limit->data(), static_cast<std::int64_t>(at_limit->size()));
  EXPECT_EQ(read_manifest(*back)->manifest_bytes, kMaxManifestBytes);
  snap.metadata.push_back('m');
  auto over = encode_pack(snap, {});
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(over.error().message.find("the manifest would take " + std::to_string(kMaxManifestBytes + 1) +
                                      " bytes (10 token ids, " + std::to_string(kMaxManifestBytes - rest + 1) +
                                      " bytes of metadata, " + std::to_string(m->chunks.size()) + " chunks)"),
            std::string::npos)
      << over.error().message;
  // At the limit with 256-token chunks, over it with 1-token chunks: the
  // chunk table's 48 bytes a record count.
  snap.metadata.resize(static_cast<std::size_t>(kMaxManifestBytes - rest));
  auto finer = encode_pack(snap, {.chunk_tokens = 1});
  ASSERT_FALSE(finer.ok());
  EXPECT_NE(finer.error().message.find("raise chunk_tokens"), std::string::npos) << finer.error().message;
}

}  // namespace
}  // namespace kvring

namespace kvring {
namespace {

// read_pack into a reused Snapshot equals a fresh read, whatever it held.
TEST(PackFormat, ReadIntoReusedBuffers) {
  const ModelConfig cfg = testing::small_config(32, 256, 4);
  Snapshot reused;
  for (std::int64_t tokens : {100, 7, 256, 0, 40}) {
    auto live = testing::filled_cache(cfg, 256, tokens, static_cast<std::uint64_t>(tokens) + 9);
    const Snapshot snap = testing::snapshot_with_extras(*live, static_cast<std::uint64_t>(tokens));
    auto bytes = encode_pack(snap, {.chunk_tokens = 16});
    ASSERT_TRUE(bytes.ok());
    ASSERT_TRUE(read_pack(*memory_pack_source(bytes->data(), static_cast<std::int64_t>(bytes->size())), {},
                          reused)
                    .ok());
    EXPECT_TRUE(testing::same_rows(reused, snap)) << tokens;
  }
}

}  // namespace
}  // namespace kvring
