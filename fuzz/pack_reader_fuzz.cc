// libFuzzer target for the kvpack reader. Built by scripts/fuzz.sh with
// clang -fsanitize=fuzzer,address,undefined; not part of the normal build.
//
// The fuzz build defines FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION, which
// turns off the digest comparisons (manifest digest, chunk names) so that
// mutated inputs reach the field checks behind them. Every input is read as
// a pack (self-contained, or thin over a store that serves any chunk), and a
// pack that reads is re-encoded, read back and restored into a cache of its
// geometry, and into a new sequence of a store, when that cache is small:
// the round trip must hold exactly. A
// thin pack is also read and verified over an empty store, which aborts if
// a chunk is read before the store was asked whether it holds it.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "kvring/chunk_store.h"
#include "kvring/pack.h"
#include "kvring/snapshot.h"
#include "kvring/store.h"

namespace {

using namespace kvring;

constexpr std::int64_t kMaxRowBytes = std::int64_t{64} << 20;

// Serves every chunk with bytes derived from its name (the digest check is
// off in this build), so thin packs decode too.
class PatternStore final : public ChunkStore {
 public:
  std::string spec() const override { return "fuzz:pattern"; }
  Status put(std::span<const ChunkData>) override { return Status::Ok(); }
  Result<bool> contains(const Digest&) const override { return true; }
  Status check_stored(const Digest&, std::int64_t) const override { return Status::Ok(); }
  Status erase(const Digest&) override { return Status::Ok(); }
  Result<StoreStats> stats() const override { return StoreStats{}; }

 protected:
  Status read_raw(const Digest& name, std::span<std::uint8_t> dst) const override {
    for (std::size_t i = 0; i < dst.size(); ++i) dst[i] = static_cast<std::uint8_t>(name[i % 32] + i);
    return Status::Ok();
  }
};

[[noreturn]] void broken(const char* what) {
  std::fprintf(stderr, "round trip broke: %s\n", what);
  std::abort();
}

bool same(const Snapshot& a, const Snapshot& b) {
  if (a.token_count != b.token_count || a.token_ids != b.token_ids || a.metadata != b.metadata ||
      a.context != b.context || a.planes.size() != b.planes.size())
    return false;
  for (std::size_t l = 0; l < a.planes.size(); ++l)
    if (!(a.planes[l].ring == b.planes[l].ring) || a.planes[l].k != b.planes[l].k || a.planes[l].v != b.planes[l].v)
      return false;
  return true;
}

std::int64_t cache_bytes(const Snapshot& s) {
  std::int64_t n = 0;
  for (std::int64_t l = 0; l < s.config.n_layers; ++l)
    n += s.config.plane_capacity(l, s.context) * s.config.kv_dim() * 4;
  return n;
}

// Holds nothing: a thin pack's chunks are all missing.
class EmptyStore final : public ChunkStore {
 public:
  std::string spec() const override { return "fuzz:empty"; }
  Status put(std::span<const ChunkData>) override { return Status::Ok(); }
  Result<bool> contains(const Digest&) const override { return false; }
  Status check_stored(const Digest&, std::int64_t) const override {
    return make_error(ErrorCode::kNotFound, spec() + ": holds no chunk");
  }
  Status erase(const Digest&) override { return Status::Ok(); }
  Result<StoreStats> stats() const override { return StoreStats{}; }

 protected:
  Status read_raw(const Digest&, std::span<std::uint8_t>) const override {
    std::abort();  // a reader must ask check_stored() before it reads
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static PatternStore store;
  static EmptyStore empty;
  auto src = memory_pack_source(data, static_cast<std::int64_t>(size), "fuzz");
  auto m = read_manifest(*src);
  // The pattern store serves any claim, so verify against it only claims a
  // fuzzing process can hold; larger ones meet the empty store, where every
  // chunk is missing before anything is sized by it.
  const ChunkStore* serving = &empty;
  if (m.ok() && m->payload_bytes <= kMaxRowBytes) serving = &store;
  (void)verify_pack(*src, serving);
  (void)read_pack(*src, {.store = &empty, .max_row_bytes = kMaxRowBytes});
  if (!m.ok()) return 0;
  auto snap = read_pack(*src, {.store = &store, .max_row_bytes = kMaxRowBytes});
  if (!snap.ok()) return 0;
  if (!validate_snapshot(*snap).ok()) broken("a pack that reads is not a valid snapshot");

  // Re-encode in the pack's chunking and the first plane's encoding.
  WriteOptions w;
  w.chunk_tokens = m->chunk_tokens;
  if (!m->planes.empty()) w.encoding = m->planes[0].encoding;
  auto bytes = encode_pack(*snap, w);
  if (!bytes.ok()) broken("a snapshot that was read does not encode");
  auto again = read_pack(*memory_pack_source(bytes->data(), static_cast<std::int64_t>(bytes->size())),
                         {.max_row_bytes = kMaxRowBytes});
  if (!again.ok() || !same(*again, *snap)) broken("re-encoded pack does not read back the same");

  if (cache_bytes(*snap) <= kMaxRowBytes) {
    auto cache = make_cpu_cache(snap->config, {.context = snap->context});
    if (!cache.ok()) broken("no cache for a valid geometry");
    if (!restore(*snap, **cache).ok()) broken("a valid snapshot does not restore");
    auto back = take_snapshot(**cache);
    if (!back.ok()) broken("no snapshot of a restored cache");
    back->token_ids = snap->token_ids;
    back->metadata = snap->metadata;
    if (!same(*back, *snap)) broken("restored cache differs from its snapshot");
    // The same pack into a new sequence of a store, a group of planes at a
    // time: it restores as well, to the same rows.
    auto st = make_store(BackendKind::kCpu, snap->config, {.max_sequences = 1, .context = snap->context});
    if (!st.ok()) broken("no store for a valid geometry");
    auto seq = restore_pack(*src, {.store = &store, .max_row_bytes = kMaxRowBytes}, **st);
    if (!seq.ok()) broken("a pack that reads does not restore into a store");
    auto from_store = take_snapshot(**st, *seq);
    if (!from_store.ok()) broken("no snapshot of a sequence restored into a store");
    from_store->token_ids = snap->token_ids;
    from_store->metadata = snap->metadata;
    if (!same(*from_store, *snap)) broken("a sequence restored into a store differs from its snapshot");
  }
  return 0;
}
