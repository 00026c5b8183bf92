// The Redis chunk store: chunk N is the string value of key
// "kvpack:chunk:<hex(N)>". One connection per concurrent caller (hiredis
// contexts are not thread-safe), kept in a small pool; writes are pipelined.
//
// The server is not trusted to answer, nor to answer sizes it was asked
// for: every wait is bounded (RedisOptions::timeout, ::deadline), and reply
// headers are checked before hiredis buffers what they announce.
#include "kvring/chunk_store.h"

#if KVRING_HAVE_HIREDIS
#include <hiredis/hiredis.h>

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>
#include <mutex>
#include <string_view>
#include <vector>

#include "cpu/parallel.h"
#include "pack_common.h"
#endif

namespace kvring {

#if KVRING_HAVE_HIREDIS

namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kKeyPrefix = "kvpack:chunk:";
// A pipelined batch is sent once it holds this many bytes or chunks.
constexpr std::size_t kBatchBytes = std::size_t{32} << 20;
constexpr std::size_t kBatchChunks = 64;
// hiredis nests replies at most 7 deep; the commands used here, 2.
constexpr std::size_t kMaxReplyDepth = 4;
// A status, error or length line longer than this is not from Redis.
constexpr std::size_t kMaxLineBytes = 64 << 10;

std::string key_of(const Digest& name) { return kKeyPrefix + to_hex(name); }

struct ReplyDeleter {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

// What a reply may announce. Checked on the bytes as they arrive, before
// hiredis buffers a value or allocates an array, so a server cannot make
// kvring hold more than `max_reply` bytes per reply whatever it sends.
struct ReplyLimits {
  std::int64_t max_bulk = kMaxRedisControlBytes;  // one string value
  std::int64_t max_elements = 1 << 20;            // one array
  std::int64_t max_reply = kMaxRedisControlBytes;  // one whole reply
};
ReplyLimits chunk_limits(std::size_t chunk_bytes) {
  const auto b = static_cast<std::int64_t>(chunk_bytes) + 1;  // GETRANGE's cap
  return {.max_bulk = b, .max_elements = 0, .max_reply = b + 64};
}

// An incremental RESP (Redis protocol) scanner: follows line and value
// boundaries across reads and refuses a header over the limits.
class ReplyGuard {
 public:
  void set_limits(const ReplyLimits& limits) { limits_ = limits; }

  // Empty when the bytes keep within the limits; else why they do not.
  std::string scan(const char* p, std::size_t n) {
    while (n > 0) {
      if (skip_ > 0) {
        const auto take = static_cast<std::size_t>(std::min<std::uint64_t>(skip_, n));
        skip_ -= take;
        p += take;
        n -= take;
        if (std::string why = count(take); !why.empty()) return why;
        if (skip_ == 0) end_item();
        continue;
      }
      const auto* nl = static_cast<const char*>(std::memchr(p, '\n', n));
      const std::size_t take = nl != nullptr ? static_cast<std::size_t>(nl - p) + 1 : n;
      line_.append(p, take);
      p += take;
      n -= take;
      if (std::string why = count(take); !why.empty()) return why;
      if (line_.size() > kMaxLineBytes)
        return "a reply line longer than " + std::to_string(kMaxLineBytes) + " bytes";
      if (nl == nullptr) continue;
      if (std::string why = header(); !why.empty()) return why;
      line_.clear();
    }
    return {};
  }

 private:
  std::string count(std::size_t n) {
    reply_bytes_ += static_cast<std::int64_t>(n);
    if (reply_bytes_ > limits_.max_reply)
      return "a reply of more than " + std::to_string(limits_.max_reply) + " bytes";
    return {};
  }

  std::string header() {
    if (line_.size() < 3 || line_[line_.size() - 2] != '\r') return "a reply line without CRLF";
    const char type = line_[0];
    const std::string_view text(line_.data() + 1, line_.size() - 3);
    if (type == '+' || type == '-' || type == ':') {
      end_item();
      return {};
    }
    if (type != '$' && type != '*') return "a reply that is not Redis protocol";
    std::int64_t v = 0;
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (text.empty() || ec != std::errc() || end != text.data() + text.size() || v < -1)
      return "a malformed length in a reply";
    if (type == '$') {
      if (v > limits_.max_bulk)
        return "a value of " + std::to_string(v) + " bytes, more than the " +
               std::to_string(limits_.max_bulk) + " this call can use";
      if (v < 0) end_item();
      else skip_ = static_cast<std::uint64_t>(v) + 2;  // the value and its CRLF
      return {};
    }
    if (v > limits_.max_elements)
      return "an array of " + std::to_string(v) + " elements, more than the " +
             std::to_string(limits_.max_elements) + " this call can use";
    if (v <= 0) {
      end_item();
      return {};
    }
    if (pending_.size() >= kMaxReplyDepth) return "replies nested too deep";
    pending_.push_back(v);
    return {};
  }

  // One item is complete: it fills a slot of the innermost open array, and
  // an array whose slots are all filled is itself complete.
  void end_item() {
    while (!pending_.empty()) {
      if (--pending_.back() > 0) return;
      pending_.pop_back();
    }
    reply_bytes_ = 0;  // a whole reply is complete
  }

  ReplyLimits limits_;
  std::string line_;
  std::uint64_t skip_ = 0;
  std::vector<std::int64_t> pending_;
  std::int64_t reply_bytes_ = 0;
};

// A connection: a hiredis context in non-blocking mode, driven by poll() so
// that every wait has a bound, and the guard over what it receives.
struct Conn {
  redisContext* ctx = nullptr;
  ReplyGuard guard;
  bool broken = false;
  ~Conn() {
    if (ctx != nullptr) redisFree(ctx);
  }
};

class RedisStore final : public ChunkStore {
 public:
  explicit RedisStore(RedisOptions o) : o_(std::move(o)) { begin_operation(); }

  std::string spec() const override {
    const bool v6 = o_.host.find(':') != std::string::npos;
    return "redis://" + (o_.user.empty() ? "" : o_.user + "@") + (v6 ? "[" + o_.host + "]" : o_.host) +
           ":" + std::to_string(o_.port);
  }

  void begin_operation() override {
    std::lock_guard<std::mutex> lock(mu_);
    deadline_ = Clock::now() + o_.deadline;
    stalled_.clear();
  }

  Status connect_check() const {
    auto c = acquire();
    if (!c) return c.error();
    Status s = command(**c, "PING", {}, [](Conn& conn) { return redisAppendCommand(conn.ctx, "PING"); });
    release(std::move(*c));
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
    KVRING_RETURN_IF_ERROR(send(**c, {}, [&](Conn& conn) {
      return redisAppendCommand(conn.ctx, "EXISTS %b", key.data(), key.size());
    }));
    auto r = receive(**c, "EXISTS");
    release(std::move(*c));
    if (!r) return r.error();
    return (*r)->type == REDIS_REPLY_INTEGER && (*r)->integer == 1;
  }

  Status erase(const Digest& name) override {
    auto c = acquire();
    if (!c) return c.error();
    const std::string key = key_of(name);
    Status s = command(**c, "DEL", {}, [&](Conn& conn) {
      return redisAppendCommand(conn.ctx, "DEL %b", key.data(), key.size());
    });
    release(std::move(*c));
    return s;
  }

  Result<StoreStats> stats() const override {
    auto conn = acquire();
    if (!conn) return conn.error();
    Conn& c = **conn;
    StoreStats stats;
    std::string cursor = "0";
    const std::string pattern = std::string(kKeyPrefix) + "*";
    Status s;
    do {
      s = send(c, {}, [&](Conn& cc) {
        return redisAppendCommand(cc.ctx, "SCAN %s MATCH %s COUNT 1000", cursor.c_str(), pattern.c_str());
      });
      if (!s.ok()) break;
      auto r = receive(c, "SCAN");
      if (!r) {
        s = r.error();
        break;
      }
      const redisReply* reply = r->get();
      if (reply->type != REDIS_REPLY_ARRAY || reply->elements != 2 ||
          reply->element[0]->type != REDIS_REPLY_STRING || reply->element[1]->type != REDIS_REPLY_ARRAY) {
        s = io_error(spec() + ": SCAN gave an unexpected reply");
        break;
      }
      cursor.assign(reply->element[0]->str, reply->element[0]->len);
      const redisReply* keys = reply->element[1];
      s = send(c, {}, [&](Conn& cc) {
        for (std::size_t i = 0; i < keys->elements; ++i)
          if (keys->element[i]->type != REDIS_REPLY_STRING ||
              redisAppendCommand(cc.ctx, "STRLEN %b", keys->element[i]->str, keys->element[i]->len) !=
                  REDIS_OK)
            return REDIS_ERR;
        return REDIS_OK;
      });
      for (std::size_t i = 0; i < keys->elements && s.ok(); ++i) {
        auto len = receive(c, "STRLEN");
        if (!len) {
          s = len.error();
          break;
        }
        if ((*len)->type == REDIS_REPLY_INTEGER && (*len)->integer > 0) {
          ++stats.chunks;
          stats.bytes += (*len)->integer;
        }
      }
    } while (s.ok() && cursor != "0");
    release(std::move(*conn));
    if (!s.ok()) return s.error();
    return stats;
  }

 protected:
  Status read_raw(const Digest& name, std::span<std::uint8_t> dst) const override {
    auto conn = acquire();
    if (!conn) return conn.error();
    Conn& c = **conn;
    const std::string key = key_of(name);
    // GETRANGE caps an honest server's reply at one byte more than expected,
    // and the reply limits hold a dishonest one to the same; EXISTS tells a
    // missing key from an empty value. One round trip for both.
    const std::string last = std::to_string(dst.size());
    Status s = send(c, chunk_limits(dst.size()), [&](Conn& cc) {
      if (redisAppendCommand(cc.ctx, "EXISTS %b", key.data(), key.size()) != REDIS_OK) return REDIS_ERR;
      return redisAppendCommand(cc.ctx, "GETRANGE %b 0 %s", key.data(), key.size(), last.c_str());
    });
    Result<Reply> exists = s.ok() ? receive(c, "EXISTS") : Result<Reply>(s.error());
    Result<Reply> value = exists.ok() ? receive(c, "GETRANGE") : Result<Reply>(exists.error());
    release(std::move(*conn));
    if (!value) return value.error();
    if ((*exists)->type != REDIS_REPLY_INTEGER || (*exists)->integer != 1)
      return make_error(ErrorCode::kNotFound, spec() + ": chunk " + to_hex(name) + " is missing");
    const redisReply* v = value->get();
    if (v->type != REDIS_REPLY_STRING) return corruption(spec() + ": key " + key + " is not a string");
    if (v->len != dst.size())
      return corruption(spec() + ": chunk " + to_hex(name) + " holds " +
                        (v->len > dst.size() ? "more than " + std::to_string(dst.size())
                                             : std::to_string(v->len)) +
                        " bytes, the pack expects " + std::to_string(dst.size()));
    std::memcpy(dst.data(), v->str, v->len);
    return Status::Ok();
  }

 private:
  using ConnPtr = std::unique_ptr<Conn>;

  std::string host_port() const {
    const bool v6 = o_.host.find(':') != std::string::npos;
    return (v6 ? "[" + o_.host + "]" : o_.host) + ":" + std::to_string(o_.port);
  }

  // The end of the wait that starts now: one timeout, or the operation's
  // deadline when that comes first.
  Clock::time_point wait_end(Clock::time_point* deadline) const {
    {
      std::lock_guard<std::mutex> lock(mu_);
      *deadline = deadline_;
    }
    return std::min(Clock::now() + o_.timeout, *deadline);
  }

  // The error of a wait that ran out, remembered so that the rest of the
  // operation fails at once instead of waiting again for each chunk.
  Error timed_out(const char* what, Clock::time_point deadline) const {
    const bool whole = Clock::now() >= deadline;
    const auto ms = [](std::chrono::milliseconds d) { return std::to_string(d.count()); };
    Error e = io_error(spec() + ": timed out " + what + " " + host_port() + " (" +
                       (whole ? "deadline_ms=" + ms(o_.deadline) + " for the whole operation"
                              : "timeout_ms=" + ms(o_.timeout) + " for one wait") +
                       "; redis://HOST:PORT?timeout_ms=N&deadline_ms=N sets them)");
    std::lock_guard<std::mutex> lock(mu_);
    if (stalled_.empty()) stalled_ = e.message;
    return e;
  }

  // Set once a wait of this operation ran out.
  std::string stalled() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stalled_;
  }

  // Waits until fd is ready for `events`; false when the wait ran out.
  static bool wait_fd(int fd, short events, Clock::time_point end) {
    for (;;) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(end - Clock::now()).count();
      if (left <= 0) return false;
      pollfd p{fd, events, 0};
      const int rc = ::poll(&p, 1, static_cast<int>(left));
      if (rc > 0) return true;
      if (rc < 0 && errno != EINTR) return true;  // the read or write reports the error
    }
  }

  // A connection for this caller alone.
  Result<ConnPtr> acquire() const {
    if (const std::string s = stalled(); !s.empty()) return io_error(s + "; not retried in this operation");
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!idle_.empty()) {
        ConnPtr c = std::move(idle_.back());
        idle_.pop_back();
        return c;
      }
    }
    Clock::time_point deadline;
    const auto end = wait_end(&deadline);
    const auto left = std::chrono::duration_cast<std::chrono::microseconds>(end - Clock::now());
    if (left.count() <= 0) return timed_out("connecting to", deadline);
    const timeval tv{static_cast<time_t>(left.count() / 1000000),
                     static_cast<suseconds_t>(left.count() % 1000000)};
    auto c = std::make_unique<Conn>();
    c->ctx = redisConnectWithTimeout(o_.host.c_str(), o_.port, tv);
    if (c->ctx == nullptr) return io_error(spec() + ": cannot allocate a connection");
    if (c->ctx->err != 0) {
      if (c->ctx->err == REDIS_ERR_IO && (errno == ETIMEDOUT || std::strstr(c->ctx->errstr, "timed out")))
        return timed_out("connecting to", deadline);
      return io_error(spec() + ": cannot connect: " + c->ctx->errstr);
    }
    // Non-blocking from here on: every wait goes through wait_fd.
    const int flags = ::fcntl(c->ctx->fd, F_GETFL);
    if (flags < 0 || ::fcntl(c->ctx->fd, F_SETFL, flags | O_NONBLOCK) != 0)
      return io_error(spec() + ": cannot make the connection non-blocking: " + std::strerror(errno));
    c->ctx->flags &= ~REDIS_BLOCK;
    if (!o_.password.empty()) {
      // The reply is the server's; the message never repeats what was sent.
      Status s = command(*c, "AUTH", {}, [&](Conn& cc) {
        return o_.user.empty()
                   ? redisAppendCommand(cc.ctx, "AUTH %b", o_.password.data(), o_.password.size())
                   : redisAppendCommand(cc.ctx, "AUTH %b %b", o_.user.data(), o_.user.size(),
                                        o_.password.data(), o_.password.size());
      });
      if (!s.ok()) return s.error();
    }
    return c;
  }

  // A broken connection is closed, not pooled.
  void release(ConnPtr c) const {
    if (c->broken || c->ctx->err != 0) return;
    std::lock_guard<std::mutex> lock(mu_);
    idle_.push_back(std::move(c));
  }

  // Queues commands (append returns REDIS_OK or REDIS_ERR) with the limits
  // their replies must keep, and sends them.
  template <class Append>
  Status send(Conn& c, const ReplyLimits& limits, Append append) const {
    c.guard.set_limits(limits);
    if (append(c) != REDIS_OK) {
      c.broken = true;
      return io_error(spec() + ": cannot queue a command");
    }
    Clock::time_point deadline;
    int done = 0;
    while (!done) {
      const auto end = wait_end(&deadline);
      if (!wait_fd(c.ctx->fd, POLLOUT, end)) {
        c.broken = true;
        return timed_out("sending to", deadline);
      }
      if (redisBufferWrite(c.ctx, &done) != REDIS_OK) {
        c.broken = true;
        return io_error(spec() + ": sending: " + c.ctx->errstr);
      }
    }
    return Status::Ok();
  }

  // The next reply, read under the guard; a server error reply is an error.
  Result<Reply> receive(Conn& c, const char* what) const {
    void* raw = nullptr;
    Clock::time_point deadline;
    for (;;) {
      if (redisGetReplyFromReader(c.ctx, &raw) != REDIS_OK) {
        c.broken = true;
        return io_error(spec() + ": " + what + ": a malformed reply: " + c.ctx->errstr);
      }
      if (raw != nullptr) break;
      const auto end = wait_end(&deadline);
      if (!wait_fd(c.ctx->fd, POLLIN, end)) {
        c.broken = true;
        return timed_out(("waiting for the reply to " + std::string(what) + " from").c_str(), deadline);
      }
      char buf[16 << 10];
      const ssize_t n = ::recv(c.ctx->fd, buf, sizeof buf, 0);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
      if (n <= 0) {
        c.broken = true;
        return io_error(spec() + ": " + what + ": " +
                        (n == 0 ? std::string("the server closed the connection")
                                : std::string("reading: ") + std::strerror(errno)));
      }
      if (std::string why = c.guard.scan(buf, static_cast<std::size_t>(n)); !why.empty()) {
        c.broken = true;
        return io_error(spec() + ": " + what + ": refused " + why + " from the server");
      }
      if (redisReaderFeed(c.ctx->reader, buf, static_cast<std::size_t>(n)) != REDIS_OK) {
        c.broken = true;
        return io_error(spec() + ": " + what + ": out of memory buffering a reply");
      }
    }
    Reply r(static_cast<redisReply*>(raw));
    if (r->type == REDIS_REPLY_ERROR)
      return io_error(spec() + ": " + what + " refused: " + std::string(r->str, r->len));
    return r;
  }

  template <class Append>
  Status command(Conn& c, const char* what, const ReplyLimits& limits, Append append) const {
    KVRING_RETURN_IF_ERROR(send(c, limits, append));
    return receive(c, what).status();
  }

  Status put_batch(std::span<const ChunkData> chunks) const {
    auto conn = acquire();
    if (!conn) return conn.error();
    Status s = put_batch_on(**conn, chunks);
    release(std::move(*conn));
    return s;
  }

  // Every chunk is SET, also when its key exists: a content-addressed value
  // is only ever replaced by the same bytes, and a damaged or planted value
  // under the name must not stop the true bytes from being stored.
  Status put_batch_on(Conn& c, std::span<const ChunkData> chunks) const {
    std::string value;
    KVRING_RETURN_IF_ERROR(send(c, {}, [&](Conn& cc) {
      for (const ChunkData& ch : chunks) {
        const std::string key = key_of(ch.name);
        // SET takes the value as one argument; hiredis copies it into its
        // output buffer, so `value` is reused at once.
        value.assign(reinterpret_cast<const char*>(ch.part1.data()), ch.part1.size());
        value.append(reinterpret_cast<const char*>(ch.part2.data()), ch.part2.size());
        if (redisAppendCommand(cc.ctx, "SET %b %b", key.data(), key.size(), value.data(), value.size()) !=
            REDIS_OK)
          return REDIS_ERR;
      }
      return REDIS_OK;
    }));
    Status s;
    for (std::size_t i = 0; i < chunks.size(); ++i) {
      auto r = receive(c, "SET");
      if (!r && s.ok()) s = r.status();
      if (c.broken) break;
    }
    return s;
  }

  RedisOptions o_;
  mutable std::mutex mu_;
  mutable std::vector<ConnPtr> idle_;
  mutable Clock::time_point deadline_;
  mutable std::string stalled_;  // the timeout that ended this operation
};

}  // namespace

bool redis_store_compiled() { return true; }

Result<std::unique_ptr<ChunkStore>> open_redis_store(const RedisOptions& options) {
  auto store = std::make_unique<RedisStore>(options);
  KVRING_RETURN_IF_ERROR(store->connect_check());
  return std::unique_ptr<ChunkStore>(std::move(store));
}

Result<std::unique_ptr<ChunkStore>> open_redis_store(const std::string& host, int port) {
  RedisOptions o;
  o.host = host;
  o.port = port;
  return open_redis_store(o);
}

#else

bool redis_store_compiled() { return false; }

Result<std::unique_ptr<ChunkStore>> open_redis_store(const RedisOptions& o) {
  return make_error(ErrorCode::kUnsupported,
                    "redis://" + o.host + ":" + std::to_string(o.port) +
                        ": this build has no Redis store (hiredis was not found)");
}

Result<std::unique_ptr<ChunkStore>> open_redis_store(const std::string& host, int port) {
  RedisOptions o;
  o.host = host;
  o.port = port;
  return open_redis_store(o);
}

#endif

}  // namespace kvring
