// The Redis chunk store: chunk N is the string value of key
// "kvpack:chunk:<hex(N)>". One connection per concurrent caller (hiredis
// contexts are not thread-safe), kept in a small pool; writes are pipelined.
//
// The server is not trusted to answer, nor to answer sizes it was asked
// for, nor to keep the connection open: every wait is bounded
// (RedisOptions::timeout, ::deadline), reply headers are checked against a
// memory budget before hiredis buffers or allocates what they announce, and
// commands are written with send(MSG_NOSIGNAL), so a peer that hangs up is
// an error, never SIGPIPE. hiredis only connects and parses replies.
#include "kvring/chunk_store.h"

#if KVRING_HAVE_HIREDIS
#include <hiredis/hiredis.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <unordered_set>
#include <vector>

#include "core/text.h"
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
// What each reply item costs a reply's budget on top of its wire bytes: at
// least what hiredis allocates for it (a redisReply of 48 to 64 bytes and
// the allocator's overhead; a value's copy is paid for by its wire bytes).
constexpr std::int64_t kItemCost = 96;
// What each element an array header announces costs: hiredis allocates the
// element vector from the header, before any element arrives.
constexpr std::int64_t kSlotCost = 8;
// SCAN's COUNT. Redis answers about COUNT keys per call (more while its
// table rehashes); kScanLimits leaves ten times that.
constexpr int kScanCount = 1000;
// No Redis string comes near this (proto-max-bulk-len is 512 MiB unless
// raised): a STRLEN past it is not from Redis.
constexpr std::int64_t kMaxStrlen = std::int64_t{1} << 40;
// Text the server chose (error replies) is cut to this many bytes in messages.
constexpr std::size_t kMaxShownBytes = 200;
// A connection's send buffer is given back past this size, so that pooled
// connections do not each keep a batch's worth of memory.
constexpr std::size_t kKeptSendBytes = 64 << 10;

std::string key_of(const Digest& name) { return kKeyPrefix + to_hex(name); }

// stats() keeps the chunks it has counted, to count a key SCAN repeats
// once: at most this many (some 200 MB of them; 4M chunks of the default
// size hold some 256 GiB, past what one Redis server keeps in memory).
constexpr std::size_t kMaxStatsChunks = std::size_t{1} << 22;

// A chunk key's first 16 digest bytes, from its hex digits as key_of
// writes them; none for a key that names no chunk.
using ChunkId = std::array<std::uint64_t, 2>;
struct ChunkIdHash {
  std::size_t operator()(const ChunkId& id) const {
    return static_cast<std::size_t>(id[0] ^ (id[1] * 0x9E3779B97F4A7C15u));
  }
};
std::optional<ChunkId> chunk_id(std::string_view key) {
  const std::string_view prefix = kKeyPrefix;
  if (!key.starts_with(prefix) || !pack_internal::is_chunk_name(key.substr(prefix.size()))) return std::nullopt;
  ChunkId id{};
  for (std::size_t i = 0; i < 32; ++i) {
    const char c = key[prefix.size() + i];
    id[i / 16] = id[i / 16] << 4 | static_cast<std::uint64_t>(c <= '9' ? c - '0' : c - 'a' + 10);
  }
  return id;
}

std::string_view as_text(std::span<const std::uint8_t> s) {
  return {reinterpret_cast<const char*>(s.data()), s.size()};
}

// Text the server chose, as a message may show it: at most kMaxShownBytes of
// it, with every byte that could act on a terminal escaped.
std::string shown(std::string_view text) { return kvring::shown(text, kMaxShownBytes); }

struct ReplyDeleter {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

// What a reply is, for a message about one that was not expected.
std::string reply_kind(const redisReply& r) {
  switch (r.type) {
    case REDIS_REPLY_STRING: return "a string of " + std::to_string(r.len) + " bytes";
    case REDIS_REPLY_ARRAY: return "an array of " + std::to_string(r.elements) + " elements";
    case REDIS_REPLY_INTEGER: return "the integer " + std::to_string(r.integer);
    case REDIS_REPLY_NIL: return "a nil";
    case REDIS_REPLY_STATUS: return "the status '" + shown({r.str, r.len}) + "'";
    case REDIS_REPLY_ERROR: return "the error '" + shown({r.str, r.len}) + "'";
  }
  return "a reply of type " + std::to_string(r.type);
}

// What a reply may announce and cost. Checked on the bytes as they arrive,
// before hiredis buffers a value or allocates an array. A reply's budget
// (`max_reply`) is charged its wire bytes, kItemCost per item and
// kSlotCost per element an array announces, which is at least what hiredis
// allocates for the parsed reply: however a server shapes a reply, its
// parsed form holds at most `max_reply` bytes, besides hiredis's input
// buffer (that reply's wire bytes and at most one read more: receive() reads
// only while no whole reply is buffered).
struct ReplyLimits {
  std::int64_t max_bulk;      // one string value, in bytes
  std::int64_t max_elements;  // one array; -1: the command takes no arrays
  std::int64_t max_reply;     // one whole reply's budget
};
// PING, AUTH, SET, DEL, EXISTS, STRLEN: a status, an integer or an error.
constexpr ReplyLimits kControlLimits{.max_bulk = 1 << 10, .max_elements = -1, .max_reply = 4 << 10};
// SCAN: a cursor and an array of keys (ours are 77 bytes).
constexpr ReplyLimits kScanLimits{
    .max_bulk = 64 << 10, .max_elements = 10 * kScanCount, .max_reply = 4 << 20};
static_assert(kScanLimits.max_reply <= kMaxRedisControlBytes &&
              kControlLimits.max_reply <= kMaxRedisControlBytes);
// A chunk read: EXISTS's integer, then GETRANGE's value of at most one byte
// more than the chunk (what it asks for).
ReplyLimits chunk_limits(std::size_t chunk_bytes) {
  const auto b = static_cast<std::int64_t>(chunk_bytes) + 1;
  return {.max_bulk = b, .max_elements = -1, .max_reply = b + kItemCost + 64};
}

// An incremental RESP (Redis protocol) scanner: follows line and value
// boundaries across reads and refuses a header over the limits or a reply
// over its budget.
class ReplyGuard {
 public:
  void set_limits(const ReplyLimits& limits) { limits_ = limits; }

  // No reply is partly scanned.
  bool idle() const { return line_.empty() && skip_ == 0 && pending_.empty(); }

  // Empty when the bytes keep within the limits; else why they do not.
  std::string scan(const char* p, std::size_t n) {
    while (n > 0) {
      if (skip_ > 0) {
        const auto take = static_cast<std::size_t>(std::min<std::uint64_t>(skip_, n));
        skip_ -= take;
        p += take;
        n -= take;
        if (std::string why = charge(static_cast<std::int64_t>(take)); !why.empty()) return why;
        if (skip_ == 0) end_item();
        continue;
      }
      const auto* nl = static_cast<const char*>(std::memchr(p, '\n', n));
      const std::size_t take = nl != nullptr ? static_cast<std::size_t>(nl - p) + 1 : n;
      line_.append(p, take);
      p += take;
      n -= take;
      if (std::string why = charge(static_cast<std::int64_t>(take)); !why.empty()) return why;
      if (line_.size() > kMaxLineBytes)
        return "a reply line longer than " + std::to_string(kMaxLineBytes) + " bytes";
      if (nl == nullptr) continue;
      if (std::string why = header(); !why.empty()) return why;
      line_.clear();
    }
    return {};
  }

 private:
  // reply_bytes_ is at most max_reply before a charge, and a charge at most
  // one read, kItemCost or kSlotCost * max_elements: no overflow.
  std::string charge(std::int64_t cost) {
    reply_bytes_ += cost;
    if (reply_bytes_ > limits_.max_reply)
      return "a reply of more than " + std::to_string(limits_.max_reply) + " bytes";
    return {};
  }

  std::string header() {
    if (line_.size() < 3 || line_[line_.size() - 2] != '\r') return "a reply line without CRLF";
    const char type = line_[0];
    const std::string_view text(line_.data() + 1, line_.size() - 3);
    if (type != '+' && type != '-' && type != ':' && type != '$' && type != '*')
      return "a reply that is not Redis protocol";
    if (std::string why = charge(kItemCost); !why.empty()) return why;
    if (type == '+' || type == '-' || type == ':') {
      end_item();
      return {};
    }
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
    if (limits_.max_elements < 0)
      return "an array of " + std::to_string(v) + " elements, where this call takes no arrays";
    if (v > limits_.max_elements)
      return "an array of " + std::to_string(v) + " elements, more than the " +
             std::to_string(limits_.max_elements) + " this call can use";
    if (v <= 0) {
      end_item();
      return {};
    }
    if (std::string why = charge(v * kSlotCost); !why.empty()) return why;
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

  ReplyLimits limits_ = kControlLimits;
  std::string line_;
  std::uint64_t skip_ = 0;
  std::vector<std::int64_t> pending_;
  std::int64_t reply_bytes_ = 0;
};

// What resolving a host name gave: its numeric addresses in the resolver's
// order, or why there are none.
struct Resolved {
  std::vector<std::string> addrs;
  std::string error;       // set when the resolver answered with none
  bool timed_out = false;  // no answer before the wait's end
};

// A lookup on a thread of its own: getaddrinfo takes no timeout (the
// resolver's own, from resolv.conf, can run to tens of seconds), so the
// caller waits for it only until its wait ends. A lookup still running then
// finishes on its thread, which holds the only other reference to this.
struct Lookup {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Resolved result;
};

void run_lookup(const std::shared_ptr<Lookup>& lookup, const std::string& host) {
  Resolved r;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* list = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &list);
  if (rc != 0) {
    r.error = rc == EAI_SYSTEM ? std::strerror(errno) : ::gai_strerror(rc);
  } else {
    for (const addrinfo* a = list; a != nullptr; a = a->ai_next) {
      char text[INET6_ADDRSTRLEN] = {};
      const void* bytes = nullptr;
      if (a->ai_family == AF_INET) bytes = &reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr;
      if (a->ai_family == AF_INET6) bytes = &reinterpret_cast<const sockaddr_in6*>(a->ai_addr)->sin6_addr;
      if (bytes == nullptr || ::inet_ntop(a->ai_family, bytes, text, sizeof text) == nullptr) continue;
      if (std::find(r.addrs.begin(), r.addrs.end(), text) == r.addrs.end()) r.addrs.emplace_back(text);
    }
    ::freeaddrinfo(list);
    if (r.addrs.empty()) r.error = "no IPv4 or IPv6 address";
  }
  std::lock_guard<std::mutex> lock(lookup->mu);
  lookup->result = std::move(r);
  lookup->done = true;
  lookup->cv.notify_all();
}

// The addresses of `host` by `end`. A numeric address is its own answer.
Resolved resolve_host(const std::string& host, Clock::time_point end) {
  in6_addr numeric;
  if (::inet_pton(AF_INET, host.c_str(), &numeric) == 1 || ::inet_pton(AF_INET6, host.c_str(), &numeric) == 1)
    return Resolved{{host}, {}, false};
  auto lookup = std::make_shared<Lookup>();
  try {
    std::thread(run_lookup, lookup, host).detach();
  } catch (const std::system_error& e) {
    return Resolved{{}, std::string("cannot start a lookup: ") + e.what(), false};
  }
  std::unique_lock<std::mutex> lock(lookup->mu);
  if (!lookup->cv.wait_until(lock, end, [&] { return lookup->done; })) return Resolved{{}, {}, true};
  return std::move(lookup->result);
}

// A connection: a hiredis context that connected and parses replies, its
// socket non-blocking and driven by poll() so that every wait has a bound,
// and the guard over what it receives. Commands are queued in `out` and
// written by RedisStore::send.
struct Conn {
  redisContext* ctx = nullptr;
  ReplyGuard guard;
  std::string out;          // commands queued and not yet sent
  std::size_t queued = 0;   // how many commands `out` holds
  std::size_t pending = 0;  // commands sent whose replies were not yet read
  bool broken = false;
  ~Conn() {
    if (ctx != nullptr) redisFree(ctx);
  }

  // Queues a command (RESP: an array of bulk strings).
  void queue(std::initializer_list<std::string_view> args) {
    header('*', args.size());
    for (std::string_view a : args) value(a, {});
    ++queued;
  }
  // SET key value, the value given in two parts (ChunkData's).
  void queue_set(std::string_view key, std::string_view part1, std::string_view part2) {
    header('*', 3);
    value("SET", {});
    value(key, {});
    value(part1, part2);
    ++queued;
  }

  // Whether a later caller may use the connection: it is sound, every reply
  // it was sent has been read, and nothing else has arrived. A connection
  // with a reply still owed would hand its next caller this caller's answer.
  bool reusable() const {
    return !broken && ctx->err == 0 && queued == 0 && pending == 0 && guard.idle() &&
           ctx->reader->ridx == -1 && ctx->reader->pos == ctx->reader->len;
  }

 private:
  void header(char type, std::size_t n) {
    out += type;
    out += std::to_string(n);
    out += "\r\n";
  }
  void value(std::string_view a, std::string_view b) {
    header('$', a.size() + b.size());
    out.append(a);
    out.append(b);
    out += "\r\n";
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
    Status s = status_command(**c, "PING", {"PING"}, "PONG");
    release(std::move(*c));
    return s;
  }

  // A put's SET, tried on a probe key: under the chunks' prefix, so that an
  // ACL that lets this user write chunks lets it write the probe, and never
  // a chunk's name (stats and readers never count it); it expires within a
  // minute should its DEL not arrive. So a server that would refuse the put
  // (a read-only user, a replica, maxmemory reached under noeviction)
  // refuses here, before the work whose result it could not store.
  Status check_writable() const override {
    static std::atomic<std::uint64_t> counter{0};
    const std::string probe = std::string(kKeyPrefix) + "probe-" + std::to_string(::getpid()) + "-" +
                              std::to_string(counter.fetch_add(1));
    auto conn = acquire();
    if (!conn) return conn.error();
    Status s = status_command(**conn, "SET", {"SET", probe, "1", "PX", "60000"}, "OK");
    if (s.ok()) s = command(**conn, "DEL", {"DEL", probe});
    release(std::move(*conn));
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
    auto conn = acquire();
    if (!conn) return conn.error();
    Conn& c = **conn;
    c.queue({"EXISTS", key_of(name)});
    const Status s = send(c, kControlLimits, "EXISTS");
    Result<Reply> r = s.ok() ? receive(c, "EXISTS") : Result<Reply>(s.error());
    Result<bool> present = r ? exists_answer(c, **r) : Result<bool>(r.error());
    release(std::move(*conn));
    return present;
  }

  // EXISTS tells a missing key from an empty value; STRLEN of a key that
  // holds no string is WRONGTYPE, which receive() reports as kCorruption.
  Status check_stored(const Digest& name, std::int64_t bytes) const override {
    auto conn = acquire();
    if (!conn) return conn.error();
    Conn& c = **conn;
    c.queue({"EXISTS", key_of(name)});
    c.queue({"STRLEN", key_of(name)});
    const Status s = send(c, kControlLimits, "STRLEN");
    Result<Reply> exists = s.ok() ? receive(c, "EXISTS") : Result<Reply>(s.error());
    Result<bool> present = exists ? exists_answer(c, **exists) : Result<bool>(exists.error());
    Result<Reply> len = present.ok() ? receive(c, "STRLEN") : Result<Reply>(present.error());
    if (len && ((*len)->type != REDIS_REPLY_INTEGER || (*len)->integer < 0 || (*len)->integer > kMaxStrlen)) {
      c.broken = true;
      len = io_error(spec() + ": unexpected reply to STRLEN: " + reply_kind(**len));
    }
    release(std::move(*conn));
    if (!len) return len.error();
    if (!*present) return make_error(ErrorCode::kNotFound, spec() + ": chunk " + to_hex(name) + " is missing");
    if ((*len)->integer != bytes)
      return corruption(spec() + ": chunk " + to_hex(name) + " holds " + std::to_string((*len)->integer) +
                        " bytes, the pack expects " + std::to_string(bytes));
    return Status::Ok();
  }

  Status erase(const Digest& name) override {
    auto c = acquire();
    if (!c) return c.error();
    Status s = command(**c, "DEL", {"DEL", key_of(name)});
    release(std::move(*c));
    return s;
  }

  Result<StoreStats> stats() const override {
    auto conn = acquire();
    if (!conn) return conn.error();
    Conn& c = **conn;
    Result<StoreStats> stats = stats_on(c);
    release(std::move(*conn));
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
    // missing key from an empty value. One round trip for both. A failed
    // EXISTS leaves GETRANGE's reply owed, and release() closes the
    // connection rather than pool it.
    c.queue({"EXISTS", key});
    c.queue({"GETRANGE", key, "0", std::to_string(dst.size())});
    const Status s = send(c, chunk_limits(dst.size()), "GETRANGE");
    Result<Reply> exists = s.ok() ? receive(c, "EXISTS") : Result<Reply>(s.error());
    Result<bool> present = exists ? exists_answer(c, **exists) : Result<bool>(exists.error());
    Result<Reply> value = present.ok() ? receive(c, "GETRANGE") : Result<Reply>(present.error());
    release(std::move(*conn));
    if (!value) return value.error();
    if (!*present) return make_error(ErrorCode::kNotFound, spec() + ": chunk " + to_hex(name) + " is missing");
    const redisReply* v = value->get();
    if (v->type != REDIS_REPLY_STRING)
      return corruption(spec() + ": key " + key + ": GETRANGE answered " + reply_kind(*v) + ", not the chunk's bytes");
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

  // EXISTS of one key answers the integer 0 or 1; anything else means the
  // connection no longer speaks for this request, and it is dropped.
  Result<bool> exists_answer(Conn& c, const redisReply& r) const {
    if (r.type == REDIS_REPLY_INTEGER && (r.integer == 0 || r.integer == 1)) return r.integer == 1;
    c.broken = true;
    return io_error(spec() + ": unexpected reply to EXISTS: " + reply_kind(r));
  }

  // SCAN over the chunk keys, then STRLEN of each, pipelined. Only keys
  // that name a chunk (key_of's form) count. SCAN may return a key more
  // than once (while the server rehashes), so each counts once: the ones
  // counted are kept, up to kMaxStatsChunks.
  Result<StoreStats> stats_on(Conn& c) const {
    StoreStats stats;
    std::unordered_set<ChunkId, ChunkIdHash> seen;
    std::vector<std::string_view> fresh;
    std::string cursor = "0";
    const std::string pattern = std::string(kKeyPrefix) + "*";
    const std::string count = std::to_string(kScanCount);
    do {
      c.queue({"SCAN", cursor, "MATCH", pattern, "COUNT", count});
      KVRING_RETURN_IF_ERROR(send(c, kScanLimits, "SCAN"));
      auto r = receive(c, "SCAN");
      if (!r) return r.error();
      const redisReply* reply = r->get();
      bool shaped = reply->type == REDIS_REPLY_ARRAY && reply->elements == 2 &&
                    reply->element[0]->type == REDIS_REPLY_STRING &&
                    reply->element[1]->type == REDIS_REPLY_ARRAY;
      for (std::size_t i = 0; shaped && i < reply->element[1]->elements; ++i)
        shaped = reply->element[1]->element[i]->type == REDIS_REPLY_STRING;
      if (!shaped) {
        c.broken = true;
        return io_error(spec() + ": SCAN gave an unexpected reply: " + reply_kind(*reply));
      }
      cursor.assign(reply->element[0]->str, reply->element[0]->len);
      const redisReply* keys = reply->element[1];
      fresh.clear();
      for (std::size_t i = 0; i < keys->elements; ++i) {
        const std::string_view key(keys->element[i]->str, keys->element[i]->len);
        const std::optional<ChunkId> id = chunk_id(key);
        if (!id || !seen.insert(*id).second) continue;
        if (seen.size() > kMaxStatsChunks)
          return make_error(ErrorCode::kCapacityExceeded,
                            spec() + ": more than " + std::to_string(kMaxStatsChunks) +
                                " chunks, the most stats() counts");
        fresh.push_back(key);
      }
      if (fresh.empty()) continue;
      for (std::string_view key : fresh) c.queue({"STRLEN", key});
      KVRING_RETURN_IF_ERROR(send(c, kControlLimits, "STRLEN"));
      for (std::size_t i = 0; i < fresh.size(); ++i) {
        auto len = receive(c, "STRLEN");
        if (!len) return len.error();
        const redisReply& l = **len;
        if (l.type != REDIS_REPLY_INTEGER || l.integer < 0 || l.integer > kMaxStrlen) {
          c.broken = true;
          return io_error(spec() + ": unexpected reply to STRLEN: " + reply_kind(l));
        }
        if (l.integer == 0) continue;  // deleted since the SCAN
        ++stats.chunks;
        if (__builtin_add_overflow(stats.bytes, l.integer, &stats.bytes)) {
          c.broken = true;
          return io_error(spec() + ": the chunks' sizes add up past 2^63 bytes (STRLEN replies)");
        }
      }
    } while (cursor != "0");
    return stats;
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

  // Whether an idle connection can still be used: nothing to read on it.
  // One the server has closed (Redis's `timeout` closes idle clients) reads
  // as end of file, one it sent something unasked reads as data; both are
  // dropped instead of failing the caller that takes them.
  static bool quiet(const Conn& c) {
    char b;
    const ssize_t n = ::recv(c.ctx->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
  }

  // A connection for this caller alone.
  Result<ConnPtr> acquire() const {
    if (const std::string s = stalled(); !s.empty()) return io_error(s + "; not retried in this operation");
    for (;;) {
      ConnPtr c;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (idle_.empty()) break;
        c = std::move(idle_.back());
        idle_.pop_back();
      }
      if (quiet(*c)) return c;
    }
    Clock::time_point deadline;
    const auto end = wait_end(&deadline);
    // The name is resolved within the same wait as the connection, and
    // each address it gives is tried in turn, hiredis only connecting to a
    // numeric one.
    const Resolved resolved = resolve_host(o_.host, end);
    if (resolved.timed_out) return timed_out("resolving", deadline);
    if (resolved.addrs.empty()) return io_error(spec() + ": cannot resolve " + shown(o_.host) + ": " + resolved.error);
    auto c = std::make_unique<Conn>();
    for (const std::string& addr : resolved.addrs) {
      const auto left = std::chrono::duration_cast<std::chrono::microseconds>(end - Clock::now());
      if (left.count() <= 0) return timed_out("connecting to", deadline);
      const timeval tv{static_cast<time_t>(left.count() / 1000000),
                       static_cast<suseconds_t>(left.count() % 1000000)};
      if (c->ctx != nullptr) redisFree(c->ctx);
      c->ctx = redisConnectWithTimeout(addr.c_str(), o_.port, tv);
      if (c->ctx == nullptr) return io_error(spec() + ": cannot allocate a connection");
      if (c->ctx->err == 0) break;
    }
    if (c->ctx->err != 0) {
      if (c->ctx->err == REDIS_ERR_IO && (errno == ETIMEDOUT || std::strstr(c->ctx->errstr, "timed out")))
        return timed_out("connecting to", deadline);
      return io_error(spec() + ": cannot connect: " + shown(c->ctx->errstr));
    }
    // Non-blocking from here on: every wait goes through wait_fd.
    const int flags = ::fcntl(c->ctx->fd, F_GETFL);
    if (flags < 0 || ::fcntl(c->ctx->fd, F_SETFL, flags | O_NONBLOCK) != 0)
      return io_error(spec() + ": cannot make the connection non-blocking: " + std::strerror(errno));
    if (!o_.password.empty()) {
      // The reply is the server's; the message never repeats what was sent.
      Status s = o_.user.empty() ? status_command(*c, "AUTH", {"AUTH", o_.password}, "OK")
                                 : status_command(*c, "AUTH", {"AUTH", o_.user, o_.password}, "OK");
      if (!s.ok()) return s.error();
    }
    return c;
  }

  // Only a connection that owes no reply and holds no unread bytes is
  // pooled; any other is closed.
  void release(ConnPtr c) const {
    if (!c->reusable()) return;
    std::lock_guard<std::mutex> lock(mu_);
    idle_.push_back(std::move(c));
  }

  // Sends the queued commands, whose replies must keep `limits`. The bytes
  // go out with send(MSG_NOSIGNAL): a server that has closed the connection
  // makes this an error, not SIGPIPE.
  Status send(Conn& c, const ReplyLimits& limits, const char* what) const {
    c.guard.set_limits(limits);
    c.pending += c.queued;
    c.queued = 0;
    Status s;
    Clock::time_point deadline;
    for (std::size_t off = 0; off < c.out.size();) {
      const ssize_t n = ::send(c.ctx->fd, c.out.data() + off, c.out.size() - off, MSG_NOSIGNAL);
      if (n > 0) {
        off += static_cast<std::size_t>(n);
        continue;
      }
      const int err = n < 0 ? errno : EPIPE;
      if (err == EINTR) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) {
        if (wait_fd(c.ctx->fd, POLLOUT, wait_end(&deadline))) continue;
        s = timed_out("sending to", deadline);
      } else if (err == EPIPE || err == ECONNRESET) {
        s = io_error(spec() + ": sending " + what + ": the server closed the connection (" +
                     std::strerror(err) + ")" + last_words(c));
      } else {
        s = io_error(spec() + ": sending " + what + ": " + std::strerror(err));
      }
      c.broken = true;
      break;
    }
    c.out.clear();
    if (c.out.capacity() > kKeptSendBytes) std::string().swap(c.out);
    return s;
  }

  // The error line a server sent before it closed the connection (a
  // value past its proto-max-bulk-len, say), as "; it said: ...", or
  // nothing: only what has already arrived is read.
  std::string last_words(Conn& c) const {
    char buf[512];
    const ssize_t n = ::recv(c.ctx->fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n <= 1 || buf[0] != '-') return "";
    const std::string_view line(buf + 1, static_cast<std::size_t>(n) - 1);
    return "; it said: " + shown(line.substr(0, line.find('\r')));
  }

  // The next reply, read under the guard; a server error reply is an error.
  Result<Reply> receive(Conn& c, const char* what) const {
    void* raw = nullptr;
    Clock::time_point deadline;
    for (;;) {
      if (redisGetReplyFromReader(c.ctx, &raw) != REDIS_OK) {
        c.broken = true;
        return io_error(spec() + ": " + what + ": a malformed reply: " + shown(c.ctx->errstr));
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
    if (c.pending > 0) --c.pending;
    if (r->type == REDIS_REPLY_ERROR) {
      // WRONGTYPE: a key under a chunk's name holds a list, a set, ...: the
      // store's content is damaged or planted, not the link.
      const std::string_view text(r->str, r->len);
      if (text.starts_with("WRONGTYPE"))
        return corruption(spec() + ": " + what + ": the key holds a value that is not a string (" + shown(text) +
                          ")");
      return io_error(spec() + ": " + what + " refused: " + shown(text));
    }
    return r;
  }

  // One command of kControlLimits, sent and answered.
  Status command(Conn& c, const char* what, std::initializer_list<std::string_view> args) const {
    c.queue(args);
    KVRING_RETURN_IF_ERROR(send(c, kControlLimits, what));
    return receive(c, what).status();
  }

  // A command whose one answer is the status `expected` (PING's PONG,
  // AUTH's OK): any other reply is an error naming it, and the connection
  // is dropped.
  Status status_command(Conn& c, const char* what, std::initializer_list<std::string_view> args,
                        std::string_view expected) const {
    c.queue(args);
    KVRING_RETURN_IF_ERROR(send(c, kControlLimits, what));
    auto r = receive(c, what);
    if (!r) return r.error();
    const redisReply& reply = **r;
    if (reply.type == REDIS_REPLY_STATUS && std::string_view(reply.str, reply.len) == expected) return Status::Ok();
    c.broken = true;
    return io_error(spec() + ": unexpected reply to " + what + ": " + reply_kind(reply));
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
  // under the name must not stop the true bytes from being stored. Only
  // +OK answers a SET: any other status (QUEUED, or PONG, a reply meant for
  // another command) stored nothing the put can vouch for.
  Status put_batch_on(Conn& c, std::span<const ChunkData> chunks) const {
    for (const ChunkData& ch : chunks) c.queue_set(key_of(ch.name), as_text(ch.part1), as_text(ch.part2));
    KVRING_RETURN_IF_ERROR(send(c, kControlLimits, "SET"));
    Status s;
    for (std::size_t i = 0; i < chunks.size() && !c.broken; ++i) {
      auto r = receive(c, "SET");
      if (r && ((*r)->type != REDIS_REPLY_STATUS || std::string_view((*r)->str, (*r)->len) != "OK")) {
        c.broken = true;
        r = io_error(spec() + ": unexpected reply to SET: " + reply_kind(**r));
      }
      if (!r && s.ok()) s = r.status();
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
