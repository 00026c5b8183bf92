// Writes the fuzzer's seed corpus: small valid packs of several geometries,
// ring states (empty, partial, wrapped), encodings, chunk sizes and forms
// (self-contained and thin), with and without token ids and metadata, and
// hostile packs whose well-formed manifests claim chunks of 1 GiB that no
// store holds and no file carries (tests/hostile_pack.h).
// usage: kvring-pack-seeds DIR
#include <cstdio>
#include <random>
#include <string>

#include <fstream>

#include "hostile_pack.h"
#include "kvring/pack.h"
#include "kvring/snapshot.h"

namespace {

using namespace kvring;

// A store that keeps nothing: thin seeds need only their manifests.
class NullStore final : public ChunkStore {
 public:
  std::string spec() const override { return "null"; }
  Status put(std::span<const ChunkData>) override { return Status::Ok(); }
  Result<bool> contains(const Digest&) const override { return false; }
  Status check_stored(const Digest&, std::int64_t) const override {
    return make_error(ErrorCode::kNotFound, spec() + ": holds no chunk");
  }
  Status erase(const Digest&) override { return Status::Ok(); }
  Result<StoreStats> stats() const override { return StoreStats{}; }

 protected:
  Status read_raw(const Digest&, std::span<std::uint8_t>) const override {
    return make_error(ErrorCode::kNotFound, "null store");
  }
};

Snapshot session(const ModelConfig& cfg, std::int64_t context, std::int64_t tokens, std::uint64_t seed,
                 bool extras) {
  auto cache = make_cpu_cache(cfg, {.context = context});
  if (!cache.ok()) std::abort();
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
  std::vector<float> k(static_cast<std::size_t>(cfg.kv_dim())), v(k.size());
  for (std::int64_t p = 0; p < tokens; ++p)
    for (std::int64_t l = 0; l < cfg.n_layers; ++l) {
      for (std::size_t e = 0; e < k.size(); ++e) {
        k[e] = dist(rng);
        v[e] = dist(rng);
      }
      if (!(*cache)->store_token(l, p, k.data(), v.data()).ok()) std::abort();
    }
  auto s = take_snapshot(**cache);
  if (!s.ok()) std::abort();
  if (extras) {
    for (std::int64_t p = 0; p < tokens; ++p) s->token_ids.push_back(static_cast<std::int32_t>(rng() % 1000));
    s->metadata = "{\"seed\":" + std::to_string(seed) + "}";
  }
  return *s;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  NullStore null_store;
  const ModelConfig hybrid = make_hybrid_config("seed", 4, 4, 2, 1, 4, 32, 128);
  const ModelConfig tiny = make_hybrid_config("seed", 2, 2, 2, 1, 2, 4, 64);
  ModelConfig sliding_only = make_hybrid_config("seed", 2, 0, 2, 2, 2, 8, 64);
  const ModelConfig full_only = make_hybrid_config("seed", 2, 1, 4, 2, 2, 8, 64);
  struct Seed {
    const ModelConfig* cfg;
    std::int64_t context, tokens, chunk;
    Encoding enc;
    bool extras, thin;
  };
  const Seed seeds[] = {
      {&tiny, 64, 3, 2, Encoding::kF16Le, true, false},      // the worked example's shape
      {&hybrid, 128, 0, 16, Encoding::kF16Le, false, false},  // empty
      {&hybrid, 128, 20, 16, Encoding::kF16Le, true, false},  // partial rings
      {&hybrid, 128, 70, 16, Encoding::kF16Le, true, false},  // wrapped rings
      {&hybrid, 128, 70, 7, Encoding::kF32Le, false, false},
      {&hybrid, 64, 45, 1, Encoding::kF16Le, true, false},
      {&hybrid, 128, 70, 16, Encoding::kF16Le, true, true},   // thin
      {&sliding_only, 40, 90, 8, Encoding::kF16Le, true, false},
      {&full_only, 64, 33, 32, Encoding::kF32Le, true, true},
  };
  int n = 0;
  for (const Seed& s : seeds) {
    const Snapshot snap = session(*s.cfg, s.context, s.tokens, static_cast<std::uint64_t>(n) + 1, s.extras);
    WriteOptions o;
    o.encoding = s.enc;
    o.chunk_tokens = s.chunk;
    if (s.thin) o.store = &null_store;
    const std::string path = dir + "/seed-" + std::to_string(n++) + ".kvpack";
    if (Status st = write_pack(snap, path, o); !st.ok()) {
      std::fprintf(stderr, "%s: %s\n", path.c_str(), st.to_string().c_str());
      return 1;
    }
  }
  // Hostile: thin packs claiming 1 GiB chunks (two and one), the
  // self-contained form's manifest without its gigabyte payload, and a
  // geometry at the kv_dim bound.
  using testing::gigabyte_chunks_pack;
  testing::HostilePack wide;
  wide.config = make_hybrid_config("seed", 1, 1, 64, 64, 1024, 0, 64);
  wide.context = 64;
  wide.token_count = 3;
  wide.chunk_tokens = 2;
  wide.thin = true;
  wide.token_ids = {1, -1, 1 << 30};
  wide.metadata = "{\"kvring_run\":1,\"model\":\"\\u001b[2J\"}";
  for (const testing::HostilePack& h : {gigabyte_chunks_pack(2, true), gigabyte_chunks_pack(1, true),
                                        gigabyte_chunks_pack(1, false), wide}) {
    std::int64_t payload = 0;
    const std::string head = testing::hostile_pack_head(h, &payload);
    const std::string path = dir + "/seed-" + std::to_string(n++) + "-hostile.kvpack";
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(head.data(), static_cast<std::streamsize>(head.size()));
    if (!f.good()) {
      std::fprintf(stderr, "%s: cannot write\n", path.c_str());
      return 1;
    }
  }
  std::printf("%d seed packs in %s\n", n, dir.c_str());
  return 0;
}
