#include "kvring/chunk_store.h"

#include <charconv>

namespace kvring {

const char* io_step_name(IoStep step) {
  switch (step) {
    case IoStep::kOpen: return "open";
    case IoStep::kWrite: return "write";
    case IoStep::kFsync: return "fsync";
    case IoStep::kRename: return "rename";
    case IoStep::kFsyncDir: return "fsync of the directory";
  }
  return "unknown";
}

Status ChunkStore::get(const Digest& name, std::span<std::uint8_t> dst) const {
  KVRING_RETURN_IF_ERROR(read_raw(name, dst));
  const Digest got = sha256(dst.data(), dst.size());
#if defined(FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION)
  // Fuzzing builds skip digest comparisons, as the pack reader does.
  if (false)
#else
  if (got != name)
#endif
    return corruption(spec() + ": chunk " + to_hex(name) + " holds bytes that hash to " +
                      to_hex(got) + " (damaged or planted)");
  return Status::Ok();
}

namespace {

// `spec` as messages show it. Its userinfo runs from the scheme's "://" (or
// its ':' where the slashes are missing) to the last '@' anywhere in it, as
// parse_redis_spec reads it: a password may hold '/', '?' or '@' unescaped.
// The userinfo keeps its user part and shows "***" for the rest; one with no
// ':' may be a password typed without its user and is "***" whole.
std::string redacted(std::string_view spec) {
  const auto at = spec.rfind('@');
  if (at == std::string_view::npos) return std::string(spec);
  std::size_t start = 0;
  if (const auto slashes = spec.find("://"); slashes != std::string_view::npos && slashes < at)
    start = slashes + 3;
  else if (const auto colon = spec.find(':'); colon != std::string_view::npos && colon < at)
    start = colon + 1;
  const std::string_view userinfo = spec.substr(start, at - start);
  const auto colon = userinfo.find(':');
  return std::string(spec.substr(0, start)) +
         (colon == std::string_view::npos ? std::string("***") : std::string(userinfo.substr(0, colon)) + ":***") +
         std::string(spec.substr(at));
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// %XX sequences decoded; false on a malformed one.
bool percent_decode(std::string_view in, std::string* out) {
  out->clear();
  for (std::size_t i = 0; i < in.size(); ++i) {
    if (in[i] != '%') {
      out->push_back(in[i]);
      continue;
    }
    const int hi = i + 1 < in.size() ? hex_value(in[i + 1]) : -1;
    const int lo = i + 2 < in.size() ? hex_value(in[i + 2]) : -1;
    if (hi < 0 || lo < 0) return false;
    out->push_back(static_cast<char>(hi * 16 + lo));
    i += 2;
  }
  return true;
}

bool parse_int(std::string_view s, std::int64_t lo, std::int64_t hi, std::int64_t* out) {
  std::int64_t v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size() || v < lo || v > hi) return false;
  *out = v;
  return true;
}

}  // namespace

Result<RedisOptions> parse_redis_spec(std::string_view spec) {
  if (!spec.starts_with("redis://"))
    return invalid_argument("chunk store '" + redacted(spec) + "' is not a redis:// URL");
  const std::string shown = redacted(spec);
  auto bad = [&](const std::string& why) {
    return invalid_argument("chunk store '" + shown + "': " + why +
                            " (redis://[[USER]:PASSWORD@]HOST[:PORT][?timeout_ms=N&deadline_ms=N])");
  };
  std::string_view rest = spec.substr(8);
  RedisOptions o;
  // The userinfo ends at the last '@' (the same as redacted() hides), so a
  // password may hold '/', '?' or '@'; what follows it, the only text a
  // message below may quote, holds no credentials.
  if (const auto at = rest.rfind('@'); at != std::string_view::npos) {
    const std::string_view userinfo = rest.substr(0, at);
    rest = rest.substr(at + 1);
    const auto colon = userinfo.find(':');
    if (colon == std::string_view::npos) return bad("a user needs a password (USER:PASSWORD@ or :PASSWORD@)");
    if (!percent_decode(userinfo.substr(0, colon), &o.user) ||
        !percent_decode(userinfo.substr(colon + 1), &o.password))
      return bad("a malformed %XX escape in the user or password");
    if (o.password.empty()) return bad("the password is empty");
  }
  std::string_view query;
  if (const auto q = rest.find('?'); q != std::string_view::npos) {
    query = rest.substr(q + 1);
    rest = rest.substr(0, q);
  }
  if (const auto slash = rest.find('/'); slash != std::string_view::npos) {
    if (slash + 1 != rest.size()) return bad("database paths are not supported");
    rest = rest.substr(0, slash);
  }
  std::string_view host = rest, port;
  bool has_port = false;
  if (rest.starts_with("[")) {
    const auto close = rest.find(']');
    if (close == std::string_view::npos) return bad("an IPv6 address lacks its ']'");
    host = rest.substr(1, close - 1);
    const std::string_view after = rest.substr(close + 1);
    if (!after.empty()) {
      if (after[0] != ':') return bad("unexpected text after the IPv6 address");
      port = after.substr(1);
      has_port = true;
    }
  } else if (const auto colon = rest.find(':'); colon != std::string_view::npos) {
    if (rest.find(':', colon + 1) != std::string_view::npos)
      return bad("an IPv6 address goes in brackets (redis://[::1]:6379)");
    host = rest.substr(0, colon);
    port = rest.substr(colon + 1);
    has_port = true;
  }
  if (host.empty()) return bad("no host");
  o.host = std::string(host);
  if (has_port) {
    std::int64_t p = 0;
    if (!parse_int(port, 1, 65535, &p)) return bad("port '" + std::string(port) + "' is not in [1, 65535]");
    o.port = static_cast<int>(p);
  }
  bool seen_timeout = false, seen_deadline = false;
  while (!query.empty()) {
    const auto amp = query.find('&');
    const std::string_view item = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    const auto eq = item.find('=');
    const std::string_view key = item.substr(0, eq);
    const std::string_view value = eq == std::string_view::npos ? std::string_view() : item.substr(eq + 1);
    // At most a day: the timeouts must stay well inside poll()'s int range.
    std::int64_t ms = 0;
    const bool number = parse_int(value, 1, 86400000, &ms);
    if (key == "timeout_ms" || key == "deadline_ms") {
      // A key given twice is refused, as the tool refuses an option given
      // twice: which one holds would be a guess.
      bool& seen = key == "timeout_ms" ? seen_timeout : seen_deadline;
      if (seen) return bad(std::string(key) + " is given twice");
      seen = true;
      if (!number) return bad(std::string(key) + " = '" + std::string(value) + "' is not in [1, 86400000]");
      (key == "timeout_ms" ? o.timeout : o.deadline) = std::chrono::milliseconds(ms);
    } else {
      return bad("unknown option '" + std::string(key) + "' (timeout_ms, deadline_ms)");
    }
  }
  return o;
}

Status check_chunk_store_spec(std::string_view spec) {
  if (spec.starts_with("dir:")) {
    if (spec.size() == 4) return invalid_argument("chunk store 'dir:' needs a path (dir:PATH)");
    return Status::Ok();
  }
  if (spec.starts_with("redis://")) {
    auto options = parse_redis_spec(spec);
    return options ? Status::Ok() : Status(options.error());
  }
  return invalid_argument("unknown chunk store '" + redacted(spec) +
                          "' (dir:PATH or redis://HOST:PORT)");
}

Result<std::unique_ptr<ChunkStore>> open_chunk_store(std::string_view spec, IoOptions io) {
  KVRING_RETURN_IF_ERROR(check_chunk_store_spec(spec));
  if (spec.starts_with("dir:")) return open_dir_store(std::string(spec.substr(4)), std::move(io));
  auto options = parse_redis_spec(spec);
  if (!options) return options.error();
  return open_redis_store(*options);
}

}  // namespace kvring
