// The Redis chunk store: chunk N is the string value of key
// "kvpack:chunk:<hex(N)>". One connection per concurrent caller (hiredis
// contexts are not thread-safe), kept in a small pool; writes are pipelined.
#include "kvring/chunk_store.h"

#if KVRING_HAVE_HIREDIS
#include <hiredis/hiredis.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#include "cpu/parallel.h"
#include "pack_common.h"
#endif

namespace kvring {

#if KVRING_HAVE_HIREDIS

namespace {

constexpr const char* kKeyPrefix = "kvpack:chunk:";
constexpr timeval kConnectTimeout{5, 0};
constexpr timeval kCommandTimeout{60, 0};
// A pipelined batch is sent once it holds this many bytes or chunks.
constexpr std::size_t kBatchBytes = std::size_t{32} << 20;
constexpr std::size_t kBatchChunks = 64;

std::string key_of(const Digest& name) { return kKeyPrefix + to_hex(name); }

struct ReplyDeleter {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

class RedisStore final : public ChunkStore {
 public:
  RedisStore(std::string host, int port) : host_(std::move(host)), port_(port) {}
  ~RedisStore() override {
    for (redisContext* c : idle_) redisFree(c);
  }

  std::string spec() const override { return "redis://" + host_ + ":" + std::to_string(port_); }

  Status connect_check() const {
    auto c = acquire();
    if (!c) return c.error();
    Reply r(static_cast<redisReply*>(redisCommand(*c, "PING")));
    Status s = check(*c, r.get(), "PING");
    release(*c);
    return s;
  }

  Status put(std::span<const ChunkData> chunks) override {
    // Batches of chunks, each batch pipelined on one connection.
    std::vector<std::pair<std::size_t, std::size_t>> batches;
    std::size_t begin = 0, bytes = 0;
    for (std::size_t i = 0; i < chunks.size(); ++i) {
      bytes += chunks[i].size();
      if (bytes >= kBatchBytes || i + 1 - begin >= kBatchChunks || i + 1 == chunks.size()) {
        batches.emplace_back(begin, i + 1);
        begin = i + 1;
        bytes = 0;
      }
    }
    std::vector<Status> status(batches.size());
    std::int64_t total = 0;
    for (const ChunkData& c : chunks) total += static_cast<std::int64_t>(c.size());
    cpu::parallel_for(static_cast<std::int64_t>(batches.size()), total, [&](std::int64_t b) {
      const auto [first, last] = batches[static_cast<std::size_t>(b)];
      status[static_cast<std::size_t>(b)] = put_batch(chunks.subspan(first, last - first));
    });
    return pack_internal::first_error(status);
  }

  Result<bool> contains(const Digest& name) const override {
    auto c = acquire();
    if (!c) return c.error();
    const std::string key = key_of(name);
    Reply r(static_cast<redisReply*>(redisCommand(*c, "EXISTS %b", key.data(), key.size())));
    Status s = check(*c, r.get(), "EXISTS");
    release(*c);
    if (!s.ok()) return s.error();
    return r->type == REDIS_REPLY_INTEGER && r->integer == 1;
  }

  Status erase(const Digest& name) override {
    auto c = acquire();
    if (!c) return c.error();
    const std::string key = key_of(name);
    Reply r(static_cast<redisReply*>(redisCommand(*c, "DEL %b", key.data(), key.size())));
    Status s = check(*c, r.get(), "DEL");
    release(*c);
    return s;
  }

  Result<StoreStats> stats() const override {
    auto c = acquire();
    if (!c) return c.error();
    StoreStats stats;
    std::string cursor = "0";
    const std::string pattern = std::string(kKeyPrefix) + "*";
    Status s;
    do {
      Reply r(static_cast<redisReply*>(
          redisCommand(*c, "SCAN %s MATCH %s COUNT 1000", cursor.c_str(), pattern.c_str())));
      s = check(*c, r.get(), "SCAN");
      if (!s.ok()) break;
      if (r->type != REDIS_REPLY_ARRAY || r->elements != 2) {
        s = io_error(spec() + ": SCAN gave an unexpected reply");
        break;
      }
      cursor.assign(r->element[0]->str, r->element[0]->len);
      const redisReply* keys = r->element[1];
      for (std::size_t i = 0; i < keys->elements; ++i)
        redisAppendCommand(*c, "STRLEN %b", keys->element[i]->str, keys->element[i]->len);
      for (std::size_t i = 0; i < keys->elements && s.ok(); ++i) {
        void* raw = nullptr;
        redisGetReply(*c, &raw);
        Reply len(static_cast<redisReply*>(raw));
        s = check(*c, len.get(), "STRLEN");
        if (s.ok() && len->type == REDIS_REPLY_INTEGER && len->integer > 0) {
          ++stats.chunks;
          stats.bytes += len->integer;
        }
      }
    } while (s.ok() && cursor != "0");
    release(*c);
    if (!s.ok()) return s.error();
    return stats;
  }

 protected:
  Status read_raw(const Digest& name, std::span<std::uint8_t> dst) const override {
    auto c = acquire();
    if (!c) return c.error();
    const std::string key = key_of(name);
    // GETRANGE caps the reply at one byte more than expected, so a planted
    // giant value never sizes an allocation here; EXISTS tells a missing
    // key from an empty value. One round trip for both.
    const std::string last = std::to_string(dst.size());
    redisAppendCommand(*c, "EXISTS %b", key.data(), key.size());
    redisAppendCommand(*c, "GETRANGE %b 0 %s", key.data(), key.size(), last.c_str());
    void* raw_exists = nullptr;
    void* raw_value = nullptr;
    redisGetReply(*c, &raw_exists);
    Reply exists(static_cast<redisReply*>(raw_exists));
    if (exists) redisGetReply(*c, &raw_value);
    Reply value(static_cast<redisReply*>(raw_value));
    Status s = check(*c, exists.get(), "EXISTS");
    if (s.ok()) s = check(*c, value.get(), "GETRANGE");
    release(*c);
    KVRING_RETURN_IF_ERROR(s);
    if (exists->type != REDIS_REPLY_INTEGER || exists->integer != 1)
      return make_error(ErrorCode::kNotFound, spec() + ": chunk " + to_hex(name) + " is missing");
    if (value->type != REDIS_REPLY_STRING)
      return corruption(spec() + ": key " + key + " is not a string");
    if (value->len != dst.size())
      return corruption(spec() + ": chunk " + to_hex(name) + " holds " +
                        (value->len > dst.size() ? "more than " + std::to_string(dst.size())
                                                 : std::to_string(value->len)) +
                        " bytes, the pack expects " + std::to_string(dst.size()));
    std::memcpy(dst.data(), value->str, value->len);
    return Status::Ok();
  }

 private:
  // A connection for this caller alone.
  Result<redisContext*> acquire() const {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!idle_.empty()) {
        redisContext* c = idle_.back();
        idle_.pop_back();
        return c;
      }
    }
    redisContext* c = redisConnectWithTimeout(host_.c_str(), port_, kConnectTimeout);
    if (c == nullptr) return io_error(spec() + ": cannot allocate a connection");
    if (c->err != 0) {
      Error e = io_error(spec() + ": cannot connect: " + c->errstr);
      redisFree(c);
      return e;
    }
    redisSetTimeout(c, kCommandTimeout);
    return c;
  }
  // A broken connection is closed, not pooled.
  void release(redisContext* c) const {
    if (c->err != 0) {
      redisFree(c);
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    idle_.push_back(c);
  }

  Status check(redisContext* c, const redisReply* r, const char* what) const {
    if (r == nullptr)
      return io_error(spec() + ": " + what + " failed: " + (c->err != 0 ? c->errstr : "no reply"));
    if (r->type == REDIS_REPLY_ERROR)
      return io_error(spec() + ": " + what + " refused: " + std::string(r->str, r->len));
    return Status::Ok();
  }

  Status put_batch(std::span<const ChunkData> chunks) const {
    auto conn = acquire();
    if (!conn) return conn.error();
    redisContext* c = *conn;
    Status s = put_batch_on(c, chunks);
    release(c);
    return s;
  }

  // Every chunk is SET, also when its key exists: a content-addressed value
  // is only ever replaced by the same bytes, and a damaged or planted value
  // under the name must not stop the true bytes from being stored.
  Status put_batch_on(redisContext* c, std::span<const ChunkData> chunks) const {
    std::string value;
    for (const ChunkData& ch : chunks) {
      const std::string key = key_of(ch.name);
      // SET takes the value as one argument; hiredis copies it into its
      // output buffer, so `value` is reused at once.
      value.assign(reinterpret_cast<const char*>(ch.part1.data()), ch.part1.size());
      value.append(reinterpret_cast<const char*>(ch.part2.data()), ch.part2.size());
      if (redisAppendCommand(c, "SET %b %b", key.data(), key.size(), value.data(), value.size()) !=
          REDIS_OK)
        return io_error(spec() + ": cannot queue SET of chunk " + key);
    }
    Status s;
    for (std::size_t i = 0; i < chunks.size(); ++i) {
      void* raw = nullptr;
      redisGetReply(c, &raw);
      Reply r(static_cast<redisReply*>(raw));
      if (Status e = check(c, r.get(), "SET"); !e.ok() && s.ok()) s = e;
      if (!r) break;
    }
    return s;
  }

  std::string host_;
  int port_;
  mutable std::mutex mu_;
  mutable std::vector<redisContext*> idle_;
};

}  // namespace

bool redis_store_compiled() { return true; }

Result<std::unique_ptr<ChunkStore>> open_redis_store(const std::string& host, int port) {
  auto store = std::make_unique<RedisStore>(host, port);
  KVRING_RETURN_IF_ERROR(store->connect_check());
  return std::unique_ptr<ChunkStore>(std::move(store));
}

#else

bool redis_store_compiled() { return false; }

Result<std::unique_ptr<ChunkStore>> open_redis_store(const std::string& host, int port) {
  return make_error(ErrorCode::kUnsupported,
                    "redis://" + host + ":" + std::to_string(port) +
                        ": this build has no Redis store (hiredis was not found)");
}

#endif

}  // namespace kvring
