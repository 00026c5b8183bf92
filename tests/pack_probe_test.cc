// Probes of the kvpack reader, the chunk stores and restore against packs
// whose fields are each in range but jointly hostile.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <gtest/gtest.h>
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
// (payload appended) or thin (chunks put into `store`). Every chunk record
// names the chunk `name_of(index)` when given.
std::string crafted_pack(const HostilePack& spec, ChunkStore* store = nullptr, std::uint8_t fill = 0) {
  using namespace coding;
  using pack_internal::chunk_byte_length;
  using pack_internal::chunk_range;
  using pack_internal::count_chunks;
  const ModelConfig& c = spec.config;
  std::string m;
  for (std::int64_t v : {c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.sliding_window, c.max_context})
    put_fixed32(&m, static_cast<std::uint32_t>(v));
  for (LayerKind k : c.layer_kinds) put_fixed8(&m, static_cast<std::uint8_t>(k));
  const Digest fingerprint = c.fingerprint();
  put_bytes(&m, fingerprint.data(), fingerprint.size());
  put_fixed32(&m, static_cast<std::uint32_t>(spec.context));
  put_fixed32(&m, static_cast<std::uint32_t>(spec.chunk_tokens));
  put_fixed64(&m, static_cast<std::uint64_t>(spec.token_count));
  put_fixed64(&m, spec.token_ids.size());
  for (std::int32_t id : spec.token_ids) put_fixed32(&m, static_cast<std::uint32_t>(id));
  put_fixed32(&m, static_cast<std::uint32_t>(spec.metadata.size()));
  put_bytes(&m, spec.metadata.data(), spec.metadata.size());
  std::vector<RingState> rings;
  put_fixed32(&m, static_cast<std::uint32_t>(c.n_layers));
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    const bool wraps = c.kind(l) == LayerKind::kSlidingRope;
    const RingState r = *RingState::sequential(c.plane_capacity(l, spec.context), wraps, spec.token_count);
    rings.push_back(r);
    put_fixed32(&m, static_cast<std::uint32_t>(l));
    put_fixed8(&m, static_cast<std::uint8_t>(c.kind(l)));
    put_fixed8(&m, static_cast<std::uint8_t>(layout_for(c.kind(l))));
    put_fixed8(&m, static_cast<std::uint8_t>(spec.encoding));
    put_fixed32(&m, static_cast<std::uint32_t>(r.capacity()));
    put_fixed32(&m, static_cast<std::uint32_t>(r.len()));
    put_fixed64(&m, static_cast<std::uint64_t>(r.origin_logical()));
    put_fixed32(&m, static_cast<std::uint32_t>(r.origin_physical()));
    put_fixed32(&m, static_cast<std::uint32_t>(count_chunks(r.origin_logical(), r.len(), spec.chunk_tokens)));
  }
  std::string table, payload;
  std::uint32_t n = 0;
  for (const RingState& r : rings) {
    const std::int64_t chunks = count_chunks(r.origin_logical(), r.len(), spec.chunk_tokens);
    for (std::int64_t j = 0; j < chunks; ++j, ++n) {
      const auto range = chunk_range(r.origin_logical(), r.len(), spec.chunk_tokens, j);
      const std::int64_t length = chunk_byte_length(range.rows, c.kv_dim(), spec.encoding);
      put_fixed64(&table, static_cast<std::uint64_t>(range.first_position));
      put_fixed32(&table, static_cast<std::uint32_t>(range.rows));
      put_fixed32(&table, static_cast<std::uint32_t>(length));
      const std::string bytes(static_cast<std::size_t>(length), static_cast<char>(fill));
      const Digest name = sha256(bytes.data(), bytes.size());
      put_bytes(&table, name.data(), name.size());
      if (store != nullptr) {
        ChunkData d;
        d.name = name;
        d.part1 = {reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()};
        EXPECT_TRUE(store->put({&d, 1}).ok());
      } else {
        payload += bytes;
      }
    }
  }
  put_fixed32(&m, n);
  m += table;
  std::string head;
  put_bytes(&head, kPackMagic, sizeof kPackMagic);
  put_fixed16(&head, kPackVersion);
  put_fixed16(&head, store != nullptr ? kFlagThin : 0);
  put_fixed32(&head, static_cast<std::uint32_t>(m.size()));
  head += m;
  const Digest digest = sha256(head.data(), head.size());
  put_bytes(&head, digest.data(), digest.size());
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

