// Helpers for the snapshot and kvpack tests: caches filled with seeded rows,
// whole-cache images for before/after comparisons, and a Redis server started
// on loopback for the store tests.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvring/cache.h"
#include "kvring/chunk_store.h"
#include "kvring/config.h"
#include "kvring/pack.h"
#include "kvring/snapshot.h"
#include "test_util.h"

namespace kvring::testing {

// A chunk store over `inner` that counts what a reader asks it, and throws
// from its `throw_at`-th read (counting from 1; 0: never).
class CountingStore final : public ChunkStore {
 public:
  explicit CountingStore(const ChunkStore& inner, int throw_at = 0) : inner_(inner), throw_at_(throw_at) {}
  std::string spec() const override { return inner_.spec(); }
  Status put(std::span<const ChunkData>) override { return Status::Ok(); }
  Result<bool> contains(const Digest& name) const override { return inner_.contains(name); }
  Status check_stored(const Digest& name, std::int64_t bytes) const override {
    ++checks;
    return inner_.check_stored(name, bytes);
  }
  Status erase(const Digest&) override { return Status::Ok(); }
  Result<StoreStats> stats() const override { return inner_.stats(); }
  mutable std::atomic<int> checks{0}, reads{0};

 protected:
  Status read_raw(const Digest& name, std::span<std::uint8_t> dst) const override {
    if (++reads == throw_at_) throw std::runtime_error("the chunk store broke");
    return inner_.get(name, dst);
  }

 private:
  const ChunkStore& inner_;
  const int throw_at_;
};

// K and V rows of (layer, position) drawn from a generator seeded by
// (seed, layer, position) alone: two sessions with the same seed hold the
// same rows for the same positions, like two sessions sharing a prompt.
void seeded_rows(std::uint64_t seed, std::int64_t layer, std::int64_t position,
                 std::int64_t count, std::int64_t kv_dim, float* k, float* v);

// Stores positions [from, to) in every layer through store_batch in batches
// of `batch`; rows from `seed`, or from `seed_after` at positions >= split.
void fill(KvCache& cache, std::int64_t from, std::int64_t to, std::uint64_t seed,
          std::int64_t batch = 13, std::int64_t split = -1, std::uint64_t seed_after = 0);

std::unique_ptr<KvCache> filled_cache(const ModelConfig& config, std::int64_t context,
                                      std::int64_t tokens, std::uint64_t seed, std::int64_t slack = 0);

bool same_rows(const Snapshot& a, const Snapshot& b);

// A snapshot with token ids and metadata, as the run command writes them.
Snapshot snapshot_with_extras(const KvCache& cache, std::uint64_t seed);

// Byte offsets where the sections of a pack start, in file order (for
// truncation tests): preamble fields, each manifest section, the digest, and
// each chunk of the payload.
std::vector<std::int64_t> section_boundaries(const Manifest& m);

// Recomputes the manifest digest after a test edited the header, so that the
// reader's field checks (not the digest) meet the edit.
void reseal(std::string* pack);

// A redis-server child on 127.0.0.1 (and ::1 with `ipv6`) with a temporary
// directory, stopped on destruction; with `password`, clients must AUTH.
// start() returns null when redis-server is not installed.
class RedisServer {
 public:
  static std::unique_ptr<RedisServer> start(std::string* why, const std::string& password = "",
                                            bool ipv6 = false);
  ~RedisServer();
  int port() const { return port_; }
  std::string spec() const { return "redis://127.0.0.1:" + std::to_string(port_); }
  // spec() with the password, when there is one.
  std::string url() const {
    return password_.empty() ? spec()
                             : "redis://:" + password_ + "@127.0.0.1:" + std::to_string(port_);
  }

 private:
  RedisServer() = default;
  int pid_ = -1;
  int port_ = 0;
  std::string dir_, password_;
};

std::string make_temp_dir(const std::string& tag);
void remove_tree(const std::string& path);
// Names in a directory, "." and ".." excluded.
std::vector<std::string> list_dir(const std::string& path);

}  // namespace kvring::testing
