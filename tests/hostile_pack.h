// Packs whose manifests are well formed (every field checks, the digest
// matches) but whose claims are hostile: chunks of up to 1 GiB that no store
// holds, or a payload the file does not really contain (a sparse file).
// Built from the geometry alone, so a test can claim gigabytes of rows
// without having them. Header-only: the tests and the fuzzer's seed corpus
// generator both use it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvring/config.h"
#include "kvring/pack.h"
#include "kvring/ring.h"
#include "kvring/snapshot.h"
#include "pack/coding.h"
#include "pack/pack_common.h"

namespace kvring::testing {

struct HostilePack {
  ModelConfig config;
  std::int64_t context = 0;
  std::int64_t token_count = 0;
  std::int64_t chunk_tokens = kDefaultChunkTokens;
  Encoding encoding = Encoding::kF16Le;
  bool thin = false;
  std::vector<std::int32_t> token_ids;
  std::string metadata;
};

// The preamble, manifest and manifest digest of a pack of `spec`, every ring
// as a sequential session of token_count leaves it, chunk j of `length`
// bytes named by name_of(j, length). For a self-contained pack the caller
// appends (or extends the file by) *payload_bytes bytes.
template <class NameOf>
std::string hostile_pack_head(const HostilePack& spec, std::int64_t* payload_bytes, NameOf&& name_of) {
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
  std::string table;
  std::uint32_t n = 0;
  *payload_bytes = 0;
  for (const RingState& r : rings) {
    const std::int64_t chunks = count_chunks(r.origin_logical(), r.len(), spec.chunk_tokens);
    for (std::int64_t j = 0; j < chunks; ++j, ++n) {
      const auto range = chunk_range(r.origin_logical(), r.len(), spec.chunk_tokens, j);
      const std::int64_t length = chunk_byte_length(range.rows, c.kv_dim(), spec.encoding);
      put_fixed64(&table, static_cast<std::uint64_t>(range.first_position));
      put_fixed32(&table, static_cast<std::uint32_t>(range.rows));
      put_fixed32(&table, static_cast<std::uint32_t>(length));
      const Digest name = name_of(n, length);
      put_bytes(&table, name.data(), name.size());
      *payload_bytes += length;
    }
  }
  put_fixed32(&m, n);
  m += table;
  std::string head;
  put_bytes(&head, kPackMagic, sizeof kPackMagic);
  put_fixed16(&head, kPackVersion);
  put_fixed16(&head, spec.thin ? kFlagThin : 0);
  put_fixed32(&head, static_cast<std::uint32_t>(m.size()));
  head += m;
  const Digest digest = sha256(head.data(), head.size());
  put_bytes(&head, digest.data(), digest.size());
  return head;
}

// The same, chunk j named by the SHA-256 of its index, which no chunk's
// bytes hash to.
inline std::string hostile_pack_head(const HostilePack& spec, std::int64_t* payload_bytes) {
  return hostile_pack_head(spec, payload_bytes, [](std::uint32_t j, std::int64_t) { return sha256(&j, sizeof j); });
}

// One full-attention layer of 8 kv heads x 1024 (kv_dim 8192) in F32Le: a
// 16384-token chunk is exactly 1 GiB (kMaxChunkBytes), and `chunks` of them
// are claimed, with rows of 512 MiB per chunk once decoded.
inline HostilePack gigabyte_chunks_pack(std::int64_t chunks, bool thin) {
  HostilePack p;
  p.config = make_hybrid_config("hostile", 1, 1, 8, 8, 1024, 0, 16384 * chunks);
  p.context = 16384 * chunks;
  p.token_count = 16384 * chunks;
  p.chunk_tokens = 16384;
  p.encoding = Encoding::kF32Le;
  p.thin = thin;
  return p;
}

}  // namespace kvring::testing
