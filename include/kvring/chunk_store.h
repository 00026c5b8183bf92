// Content-addressed chunk stores: the home of a thin pack's payload.
//
// A chunk is named by the SHA-256 of its bytes. Every read verifies that the
// bytes match the name, so a damaged or planted chunk is an error, never an
// input. Two stores: a local directory (the embedded default) and Redis
// (shared across machines). docs/kvpack-format.md gives their on-disk and
// key layouts.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "kvring/sha256.h"
#include "kvring/status.h"

namespace kvring {

// The durable steps of writing a file (or a chunk) atomically.
enum class IoStep { kOpen, kWrite, kFsync, kRename, kFsyncDir };
const char* io_step_name(IoStep step);

// Fault injection for tests (leveldb's FaultInjectionTestEnv in miniature):
// called before each step with the path it acts on; an error it returns is
// reported as that step's failure. Empty in production.
struct IoOptions {
  std::function<Status(IoStep step, const std::string& path)> fault = nullptr;
  // A directory store's directory is made where it is absent; false (a
  // store only read from): its absence is kNotFound and nothing is made.
  bool create = true;
};

// One chunk to store: its name and its bytes, given as up to two spans that
// are stored back to back (the K rows and the V rows of a plane need no copy).
struct ChunkData {
  Digest name{};
  std::span<const std::uint8_t> part1, part2;
  std::size_t size() const { return part1.size() + part2.size(); }
};

struct StoreStats {
  std::int64_t chunks = 0;
  std::int64_t bytes = 0;
};

class ChunkStore {
 public:
  virtual ~ChunkStore() = default;

  // "dir:/path" or "redis://host:port", as open_chunk_store accepts it,
  // never with a password (it is safe to print).
  virtual std::string spec() const = 0;

  // Starts a new operation (a save, a load, a verify): a remote store's
  // total-time budget (RedisOptions::deadline) restarts, and a server that
  // timed out during the last operation is tried again. Opening a store
  // starts the first operation; a caller that keeps a store for several
  // operations calls this before each. Local stores ignore it.
  virtual void begin_operation() {}

  // Fails when a put would fail for want of access (a directory store that
  // is read-only, say, or whose path leaves no room under PATH_MAX for a
  // chunk's temporary name; a Redis server that refuses this user's SET,
  // or every write at its maxmemory), so that a caller can refuse work
  // whose result it could not store before doing it. Writes nothing that
  // stays.
  virtual Status check_writable() const { return Status::Ok(); }

  // Stores every chunk under its name. Precondition: each name is the SHA-256
  // of the chunk's bytes (the pack writer computes it). A chunk already
  // present and intact need not be written again (the directory store
  // skips it; Redis sets it again, the same bytes); a damaged one is
  // replaced. When this returns ok, every chunk is
  // durable (as durable as the store: fsync for a directory, the server's
  // persistence settings for Redis).
  virtual Status put(std::span<const ChunkData> chunks) = 0;

  // Reads the chunk `name` into `dst` and verifies it: kNotFound when it is
  // absent, kCorruption when it holds other than dst.size() bytes or bytes
  // whose SHA-256 is not `name`. Safe to call from several threads at once.
  Status get(const Digest& name, std::span<std::uint8_t> dst) const;

  virtual Result<bool> contains(const Digest& name) const = 0;
  // What get() would refuse without reading the bytes: kNotFound when
  // `name` is absent; kCorruption when what stands under it is not a chunk
  // or holds other than `bytes` bytes. A reader asks this before it sizes
  // any buffer by a pack's claim, so a planted small chunk under a name
  // that claims 1 GiB costs nothing. The bytes are checked by get(), and
  // here where a store's size costs nothing to claim (the directory store
  // hashes a file with holes, in bounded pieces).
  virtual Status check_stored(const Digest& name, std::int64_t bytes) const = 0;
  // Removes a chunk (absent: nothing to do). Packs that name it stop reading.
  virtual Status erase(const Digest& name) = 0;
  // Chunks and bytes held (what prefix sharing saves shows up here).
  virtual Result<StoreStats> stats() const = 0;

 protected:
  // get without the hash check. Thread-safe.
  virtual Status read_raw(const Digest& name, std::span<std::uint8_t> dst) const = 0;
};

// A directory store rooted at `path` (created if absent and io.create,
// parent must exist).
Result<std::unique_ptr<ChunkStore>> open_dir_store(const std::string& path,
                                                   IoOptions io = {});
// Temporary files of killed writers in a directory store. A temporary
// (".tmp-<chunk name or probe>-<pid>-<counter>-<clock>", the name a writer
// gives it; no other file) is removed only when no writer holds its lock
// (writers hold an exclusive flock on it until it is renamed into place)
// and it has not been modified for `min_age` (which also covers writers
// that take no lock, and the moment between a writer's create and its
// lock). Directories that a put moved aside from chunk names
// (".quarantine-*") are counted, never removed: they may hold someone's
// files.
struct DirStoreGcReport {
  std::int64_t removed = 0;
  std::int64_t kept = 0;  // held by a live writer, or modified within min_age
  std::int64_t quarantined = 0;
};
inline constexpr std::chrono::seconds kDirStoreTempMinAge{600};
Result<DirStoreGcReport> gc_dir_store(const std::string& path,
                                      std::chrono::seconds min_age = kDirStoreTempMinAge);

struct RedisOptions {
  std::string host;  // a name, an IPv4 address or an IPv6 address (no brackets)
  int port = 6379;
  // AUTH after connecting when password is set (with user: Redis 6 ACLs).
  // Neither appears in any message; spec() shows the user only.
  std::string user, password;
  // The longest any one wait may take: resolving the host and connecting
  // (one wait; getaddrinfo runs on a thread of its own, left to finish
  // alone past it), sending while the server reads nothing, waiting while
  // it sends nothing. A server that times out fails every later call of
  // the same operation at once, so a stalled server costs one timeout per
  // operation, not one per chunk.
  std::chrono::milliseconds timeout{5000};
  // The longest one operation (everything from open_redis_store or
  // begin_operation on) may take, however the server paces its replies.
  std::chrono::milliseconds deadline{std::chrono::minutes(10)};
};

// A Redis store (connects now, to fail early). Replies are checked as they
// arrive against the command's budget (a chunk read: the chunk's size; a
// SCAN page: 4 MiB; every other command: 4 KiB; never more than
// kMaxRedisControlBytes), each item charged what it costs in memory
// besides its wire bytes (docs/kvpack-format.md): a reply past it is
// refused before it is buffered, and the connection dropped.
Result<std::unique_ptr<ChunkStore>> open_redis_store(const RedisOptions& options);
Result<std::unique_ptr<ChunkStore>> open_redis_store(const std::string& host, int port);
inline constexpr std::int64_t kMaxRedisControlBytes = std::int64_t{64} << 20;

// "dir:PATH", or "redis://[[USER]:PASSWORD@]HOST[:PORT][/][?OPTIONS]" with
// HOST a name, an IPv4 address or a bracketed IPv6 address ([::1]), PORT
// 6379 when omitted, USER and PASSWORD percent-decoded, and OPTIONS
// "timeout_ms=N" and "deadline_ms=N" (RedisOptions) joined by '&'.
Result<std::unique_ptr<ChunkStore>> open_chunk_store(std::string_view spec, IoOptions io = {});
// open_chunk_store's refusals of the spec itself, without opening anything.
Status check_chunk_store_spec(std::string_view spec);
// The Redis part of open_chunk_store: the options a redis:// spec names.
Result<RedisOptions> parse_redis_spec(std::string_view spec);

// True when this build has the Redis store (hiredis was found).
bool redis_store_compiled();

}  // namespace kvring
