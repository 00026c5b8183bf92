// The handoff protocol: framing, the sender and the receiver, and the
// KvCache source and target (a Snapshot restored through restore_detached).
//
// Messages (little-endian), each a transport message whose first byte is its type:
//   HEADER  S->R  magic, version, row digest, geometry, fingerprint,
//                 context, token ids, metadata, ring state per plane, message
//                 count, payload bytes; SHA-256 of all that
//   ACCEPT  R->S  the receiver's credits (bytes it takes unacknowledged)
//   ERROR   R->S  an error code and message: the receiver refused or failed
//   ROWS    S->R  sequence, layer, first row, rows, digest (32 B: SHA-256, or
//                 digest64 and 24 zero bytes), then K then V
//   ACK     R->S  sequence, payload bytes taken so far
//   KEEP    S->R  nothing yet (prefill still running); keeps the link alive
//   ABORT   S->R  an error code and message: the sender gives up
//   END     S->R  message count, payload bytes, the header's digest
//   DONE    R->S  the session is installed and live
//   BYE     S->R  DONE was heard; the receiver may close
// A receiver that ends (DONE or ERROR) lingers until the sender closes or
// says BYE, briefly: closing at once could let the disconnect overtake its
// last message.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <limits>
#include <optional>
#include <thread>

#include "core/digest64.h"
#include "core/text.h"
#include "checks.h"
#include "device.h"
#include "kvring/handoff.h"
#include "kvring/sha256.h"
#include "pack/coding.h"

namespace kvring::handoff {

static_assert(std::endian::native == std::endian::little, "the wire carries f16 rows little-endian");

namespace {

enum Type : std::uint8_t {
  kHeader = 1, kAccept = 2, kError = 3, kRows = 4, kAck = 5, kKeep = 6, kAbort = 7, kEnd = 8, kDone = 9,
  kBye = 10,
};
constexpr double kLingerS = 2.0;
// What a receiver lingering after DONE accepts: only BYE is due.
constexpr std::size_t kByeOnlyBytes = 4096;

// Waits until the peer closes the link or says BYE (or the linger ends),
// dropping messages of up to `max_bytes` meanwhile: after an ERROR the
// sender may still have rows in flight, and a larger one ends the wait.
void linger(Transport& t, double seconds, std::size_t max_bytes) {
  std::vector<std::uint8_t> in;
  const Deadline end = deadline_in(seconds);
  while (Clock::now() < end) {
    if (!t.recv_message(in, end, max_bytes).ok()) return;
    if (!in.empty() && in[0] == kBye) return;
  }
}
constexpr char kMagic[8] = {'k', 'v', 'h', 'a', 'n', 'd', 'o', 'f'};
// Version 2 added the row digest to the header; version 3 the status code
// kResourceExhausted (a peer of version 2 would read it as malformed).
constexpr std::uint16_t kVersion = 3;
constexpr std::size_t kRowsHead = 1 + 8 + 4 + 8 + 8;  // type, seq, layer, first, rows
constexpr std::size_t kRowsFixed = kRowsHead + 32;     // + digest
constexpr std::int64_t kMaxIds = std::int64_t{1} << 26;
constexpr std::int64_t kMaxMetadata = std::int64_t{64} << 20;
// The text an ERROR or ABORT carries, and a peer's that is shown.
constexpr std::size_t kStatusTextBytes = 2048;
// The most ACKs the sender leaves unread: each is a small message, and a
// socket's buffer holds a few hundred of them (their per-message overhead
// counts, not their 25 bytes).
constexpr std::int64_t kMaxUnreadAcks = 64;
// The longest a sender whose send failed waits for the receiver's reason.
constexpr double kReasonWaitS = 0.5;
// The longest a sender waiting for its prefill or its pacing goes without
// a keep-alive.
constexpr double kMaxKeepaliveS = 0.25;

using coding::put_bytes;
using coding::put_fixed16;
using coding::put_fixed32;
using coding::put_fixed64;
using coding::put_fixed8;

// A bounds-checked reader over one message.
struct Reader {
  const std::uint8_t* p;
  const std::uint8_t* end;
  bool ok = true;
  std::uint64_t u(int width) {
    if (!ok || end - p < width) {
      ok = false;
      return 0;
    }
    std::uint64_t v = 0;
    for (int i = width - 1; i >= 0; --i) v = (v << 8) | p[i];
    p += width;
    return v;
  }
  const std::uint8_t* bytes(std::uint64_t n) {
    if (!ok || static_cast<std::uint64_t>(end - p) < n) {
      ok = false;
      return nullptr;
    }
    const std::uint8_t* at = p;
    p += n;
    return at;
  }
};

Error wire_error(const std::string& what) { return corruption("handoff: " + what); }

std::string encode_header(const Snapshot& h, const Timeline& t, RowDigest digest) {
  const ModelConfig& c = h.config;
  std::string s;
  put_fixed8(&s, kHeader);
  put_bytes(&s, kMagic, sizeof kMagic);
  put_fixed16(&s, kVersion);
  put_fixed8(&s, static_cast<std::uint8_t>(digest));
  for (std::int64_t v : {c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.sliding_window, c.max_context})
    put_fixed64(&s, static_cast<std::uint64_t>(v));
  for (LayerKind k : c.layer_kinds) put_fixed8(&s, static_cast<std::uint8_t>(k));
  const auto fp = c.fingerprint();
  put_bytes(&s, fp.data(), fp.size());
  put_fixed64(&s, h.context);
  put_fixed64(&s, h.token_count);
  put_fixed64(&s, h.token_ids.size());
  for (std::int32_t id : h.token_ids) put_fixed32(&s, static_cast<std::uint32_t>(id));
  put_fixed64(&s, h.metadata.size());
  put_bytes(&s, h.metadata.data(), h.metadata.size());
  for (const PlaneSnapshot& p : h.planes) {
    put_fixed64(&s, p.ring.capacity());
    put_fixed8(&s, p.ring.wraps() ? 1 : 0);
    put_fixed64(&s, p.ring.len());
    put_fixed64(&s, p.ring.origin_logical());
    put_fixed64(&s, p.ring.origin_physical());
  }
  put_fixed64(&s, t.messages.size());
  put_fixed64(&s, t.payload.payload_bytes);
  const Digest d = sha256(s.data(), s.size());
  put_bytes(&s, d.data(), d.size());
  return s;
}

struct DecodedHeader {
  Snapshot header;
  RowDigest rows = RowDigest::kSha256;
  std::int64_t n_messages = 0, payload_bytes = 0;
  Digest digest{};
};

Result<DecodedHeader> decode_header(const std::vector<std::uint8_t>& m) {
  if (m.size() < 1 + sizeof kMagic + 2 + 32) return wire_error("header of " + std::to_string(m.size()) + " B is truncated");
  const Digest want = sha256(m.data(), m.size() - 32);
  if (std::memcmp(want.data(), m.data() + m.size() - 32, 32) != 0) return wire_error("header digest does not match");
  Reader r{m.data(), m.data() + m.size() - 32};
  r.u(1);
  const std::uint8_t* magic = r.bytes(sizeof kMagic);
  if (!magic || std::memcmp(magic, kMagic, sizeof kMagic) != 0) return wire_error("not a kvring handoff (bad magic)");
  if (const auto v = r.u(2); v != kVersion)
    return make_error(ErrorCode::kUnsupported, "handoff: protocol version " + std::to_string(v) + " (this build speaks " +
                                                   std::to_string(kVersion) + ")");
  DecodedHeader d;
  if (const auto digest = r.u(1); digest > static_cast<std::uint8_t>(RowDigest::kDigest64))
    return make_error(ErrorCode::kUnsupported, "handoff: row digest " + std::to_string(digest) + " is unknown");
  else
    d.rows = static_cast<RowDigest>(digest);
  Snapshot& h = d.header;
  ModelConfig& c = h.config;
  c.name = "handoff";
  std::int64_t* fields[] = {&c.n_layers, &c.n_heads, &c.n_kv_heads, &c.head_dim, &c.sliding_window, &c.max_context};
  for (std::int64_t* f : fields) *f = static_cast<std::int64_t>(r.u(8));
  if (!r.ok || c.n_layers < 1 || c.n_layers > kMaxLayers) return wire_error("header: bad layer count");
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    const auto k = r.u(1);
    if (k > 1) return wire_error("header: layer " + std::to_string(l) + " has unknown kind " + std::to_string(k));
    c.layer_kinds.push_back(static_cast<LayerKind>(k));
  }
  if (!r.ok) return wire_error("header is truncated");
  if (Status s = c.validate(); !s.ok()) return make_error(ErrorCode::kMismatch, "handoff: the session's geometry is invalid: " + s.error().message);
  const std::uint8_t* fp = r.bytes(32);
  if (!fp) return wire_error("header is truncated");
  if (std::memcmp(fp, c.fingerprint().data(), 32) != 0) return wire_error("header: fingerprint does not match its geometry");
  h.context = static_cast<std::int64_t>(r.u(8));
  h.token_count = static_cast<std::int64_t>(r.u(8));
  const auto n_ids = static_cast<std::int64_t>(r.u(8));
  if (!r.ok || n_ids < 0 || n_ids > kMaxIds) return wire_error("header: bad token id count");
  // The ids' bytes must be there before their vector is sized.
  if (static_cast<std::uint64_t>(r.end - r.p) / 4 < static_cast<std::uint64_t>(n_ids))
    return wire_error("header is truncated (" + std::to_string(n_ids) + " token ids claimed)");
  h.token_ids.resize(static_cast<std::size_t>(n_ids));
  for (auto& id : h.token_ids) id = static_cast<std::int32_t>(r.u(4));
  const auto n_meta = static_cast<std::int64_t>(r.u(8));
  if (!r.ok || n_meta < 0 || n_meta > kMaxMetadata) return wire_error("header: bad metadata length");
  const std::uint8_t* meta = r.bytes(static_cast<std::uint64_t>(n_meta));
  if (!r.ok) return wire_error("header is truncated");
  h.metadata.assign(reinterpret_cast<const char*>(meta), static_cast<std::size_t>(n_meta));
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    PlaneSnapshot p;
    p.kind = c.kind(l);
    p.layout = layout_for(p.kind);
    const auto cap = static_cast<std::int64_t>(r.u(8));
    const bool wraps = r.u(1) != 0;
    const auto len = static_cast<std::int64_t>(r.u(8));
    const auto ol = static_cast<std::int64_t>(r.u(8));
    const auto op = static_cast<std::int64_t>(r.u(8));
    if (!r.ok) return wire_error("header is truncated");
    auto ring = RingState::from_parts(cap, wraps, len, ol, op);
    if (!ring) return wire_error("header: plane " + std::to_string(l) + ": " + ring.error().message);
    p.ring = *ring;
    h.planes.push_back(std::move(p));
  }
  d.n_messages = static_cast<std::int64_t>(r.u(8));
  d.payload_bytes = static_cast<std::int64_t>(r.u(8));
  if (!r.ok || r.p != r.end) return wire_error("header has a bad length");
  if (d.n_messages < 0 || d.payload_bytes < 0) return wire_error("header: bad message count");
  if (Status s = validate_snapshot(h, /*header_only=*/true); !s.ok())
    return make_error(s.error().code, "handoff: header: " + s.error().message);
  std::memcpy(d.digest.data(), m.data() + m.size() - 32, 32);
  return d;
}

// An ERROR or ABORT: its code and at most kStatusTextBytes of its message;
// a longer one is cut at a character's start and says its length.
std::string encode_status(std::uint8_t type, const Error& e) {
  std::string s;
  put_fixed8(&s, type);
  put_fixed32(&s, static_cast<std::uint32_t>(e.code));
  if (e.message.size() <= kStatusTextBytes) {
    put_bytes(&s, e.message.data(), e.message.size());
    return s;
  }
  const std::string more = "... (" + std::to_string(e.message.size()) + " bytes)";
  std::size_t keep = kStatusTextBytes - more.size();
  while (keep > 0 && (static_cast<unsigned char>(e.message[keep]) & 0xc0) == 0x80) --keep;
  put_bytes(&s, e.message.data(), keep);
  put_bytes(&s, more.data(), more.size());
  return s;
}

// The peer's text is shown cut to kStatusTextBytes, every byte that could
// act on a terminal escaped (backslashes kept: a kvring peer's message may
// already quote escaped text).
Error decode_status(const std::vector<std::uint8_t>& m, const std::string& who) {
  Reader r{m.data(), m.data() + m.size()};
  r.u(1);
  const auto code = r.u(4);
  if (!r.ok || code > static_cast<std::uint64_t>(ErrorCode::kResourceExhausted)) return wire_error(who + " sent a malformed error");
  const std::string_view text(reinterpret_cast<const char*>(r.p), static_cast<std::size_t>(r.end - r.p));
  return make_error(static_cast<ErrorCode>(code), who + ": " + shown(text, kStatusTextBytes, /*escape_backslash=*/false));
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

Error peer_lost(const Status& s, const std::string& who) {
  return make_error(s.error().code, who + ": " + s.error().message);
}

// A ROWS message's digest field: SHA-256 of its head fields, K and V; or
// digest64 of the head fields (seed 0), K (seed 1) and V (seed 2), given K's
// and V's words, in 8 little-endian bytes and 24 zero bytes.
void put_digest64(std::uint8_t* field, const std::uint8_t* head, std::uint64_t kv_words,
                  std::size_t plane_bytes) {
  const std::uint64_t d = digest64::finish(digest64::segment(head, kRowsHead, 0) + kv_words +
                                           digest64::length_term(plane_bytes, 1) +
                                           digest64::length_term(plane_bytes, 2));
  std::memset(field, 0, 32);
  coding::encode_fixed64(field, d);
}
std::uint64_t host_words(const void* k, const void* v, std::size_t plane_bytes) {
  return digest64::words(k, plane_bytes, 1) + digest64::words(v, plane_bytes, 2);
}

}  // namespace

// The timeline is the caller's and a source sizes its buffers by the
// message (rows x kv_dim), so the sender and each source refuse a message
// that is not rows of the header's planes before anything else.
Status check_planned(const Snapshot& h, const PlannedMessage& m) {
  const std::int64_t kv = h.config.kv_dim();
  bool ok = kv >= 1 && m.layer >= 0 && m.layer < static_cast<std::int64_t>(h.planes.size());
  if (ok) {
    const RingState& r = h.planes[static_cast<std::size_t>(m.layer)].ring;
    // The header is the source's own: rows * kv * 4 is checked, not assumed
    // to fit.
    ok = m.rows >= 1 && r.holds_rows(m.first_row, m.rows) &&
         m.rows <= std::numeric_limits<std::int64_t>::max() / 4 / kv && m.bytes == m.rows * kv * 4;
  }
  if (ok) return Status::Ok();
  return invalid_argument("handoff: message " + std::to_string(m.index) + " of the timeline (layer " +
                          std::to_string(m.layer) + ", " + std::to_string(m.rows) + " rows from " +
                          std::to_string(m.first_row) + ", " + std::to_string(m.bytes) +
                          " B) is not rows of the session's planes");
}

const char* row_digest_name(RowDigest digest) {
  return digest == RowDigest::kSha256 ? "SHA-256" : "digest64";
}

Status HandoffSource::message_rows(const PlannedMessage& m, bool, SourceRows* out) {
  const std::uint16_t *k = nullptr, *v = nullptr;
  KVRING_RETURN_IF_ERROR(rows(m, &k, &v));
  *out = SourceRows{k, v, MemoryKind::kHost, nullptr, std::nullopt};
  return Status::Ok();
}

Status HandoffTarget::put_device_rows(std::int64_t, std::int64_t, std::int64_t, const void*, const void*,
                                      cudaStream_t) {
  return make_error(ErrorCode::kUnsupported, "handoff: this target takes rows in host memory only");
}

// ------------------------------------------------------------ sources

Result<std::unique_ptr<CacheSource>> CacheSource::create(const KvCache& cache, const Payload& payload,
                                                         std::vector<std::int32_t> token_ids,
                                                         std::string metadata) {
  auto header = session_header(cache.store(), cache.seq(), payload, std::move(token_ids), std::move(metadata));
  if (!header) return header.error();
  std::unique_ptr<CacheSource> s(new CacheSource(cache));
  s->header_ = std::move(*header);
  return s;
}

Status CacheSource::rows(const PlannedMessage& m, const std::uint16_t** k, const std::uint16_t** v) {
  KVRING_RETURN_IF_ERROR(check_planned(header_, m));
  const std::size_t n = static_cast<std::size_t>(m.rows * cache_.config().kv_dim());
  k_.resize(n);
  v_.resize(n);
  KVRING_RETURN_IF_ERROR(cache_.read_rows(m.layer, m.first_row, m.rows, k_.data(), v_.data()));
  *k = k_.data();
  *v = v_.data();
  return Status::Ok();
}

namespace {

// A prefill source's header is its caller's, not read from its cache, so
// before a buffer is sized by a message its rows are checked live in the
// cache itself.
Status check_in_cache(const KvCache& cache, const PlannedMessage& m) {
  const RingState r = cache.ring(m.layer);
  if (m.rows >= 1 && r.holds_rows(m.first_row, m.rows)) return Status::Ok();
  return invalid_argument("handoff: message " + std::to_string(m.index) + " (layer " + std::to_string(m.layer) + ", " +
                          std::to_string(m.rows) + " rows from " + std::to_string(m.first_row) +
                          ") is not rows the prefill source's cache holds (positions " +
                          std::to_string(r.origin_logical()) + " to " + std::to_string(r.next_position()) +
                          " of that layer)");
}

}  // namespace

Status check_in_timeline(const Timeline& timeline, const PlannedMessage& m) {
  const auto& ms = timeline.messages;
  if (m.index >= 0 && m.index < static_cast<std::int64_t>(ms.size())) {
    const PlannedMessage& t = ms[static_cast<std::size_t>(m.index)];
    if (t.layer == m.layer && t.first_row == m.first_row && t.rows == m.rows) return Status::Ok();
  }
  return invalid_argument("handoff: message " + std::to_string(m.index) + " (layer " + std::to_string(m.layer) +
                          ", rows from " + std::to_string(m.first_row) + ") is not one of the source's timeline");
}

PrefillSource::PrefillSource(const KvCache& cache, const Timeline& timeline, Snapshot header)
    : cache_(cache), timeline_(timeline), header_(std::move(header)) {
  const std::size_t n = timeline.messages.size();
  staged_k_.resize(n);
  staged_v_.resize(n);
  staged_.assign(n, false);
}

Status PrefillSource::stage_final(std::int64_t steps_done) {
  const auto& ms = timeline_.messages;
  const std::size_t kv = static_cast<std::size_t>(cache_.config().kv_dim());
  for (;;) {
    std::size_t i;
    {
      std::lock_guard lock(mu_);
      i = static_cast<std::size_t>(next_to_stage_);
    }
    if (i >= ms.size() || ms[i].release_step >= steps_done || ms[i].release_step == timeline_.n_steps - 1) break;
    const PlannedMessage& m = ms[i];
    KVRING_RETURN_IF_ERROR(check_planned(header_, m));
    KVRING_RETURN_IF_ERROR(check_in_cache(cache_, m));
    std::vector<std::uint16_t> k(static_cast<std::size_t>(m.rows) * kv), v(k.size());
    KVRING_RETURN_IF_ERROR(cache_.read_rows(m.layer, m.first_row, m.rows, k.data(), v.data()));
    {
      std::lock_guard lock(mu_);
      staged_k_[i] = std::move(k);
      staged_v_[i] = std::move(v);
      staged_[i] = true;
      staged_bytes_ += m.bytes;
      staged_peak_ = std::max(staged_peak_, staged_bytes_);
      ++next_to_stage_;
    }
    cv_.notify_all();
  }
  return Status::Ok();
}

void PrefillSource::finish(Status prefill_status) {
  {
    std::lock_guard lock(mu_);
    finished_ = true;
    prefill_status_ = std::move(prefill_status);
  }
  cv_.notify_all();
}

// A message of this source's timeline (its index, layer and rows), which
// indexes the staged rows; any other is the caller's error.
Status PrefillSource::check_known(const PlannedMessage& m) const { return check_in_timeline(timeline_, m); }

Result<bool> PrefillSource::wait_final(const PlannedMessage& m, Deadline deadline) {
  KVRING_RETURN_IF_ERROR(check_known(m));
  std::unique_lock lock(mu_);
  const std::size_t i = static_cast<std::size_t>(m.index);
  cv_.wait_until(lock, deadline, [&] { return staged_[i] || finished_; });
  if (finished_ && !prefill_status_.ok()) return prefill_status_.error();
  return staged_[i] || finished_;
}

Status PrefillSource::rows(const PlannedMessage& m, const std::uint16_t** k, const std::uint16_t** v) {
  KVRING_RETURN_IF_ERROR(check_known(m));
  KVRING_RETURN_IF_ERROR(check_planned(header_, m));
  const std::size_t i = static_cast<std::size_t>(m.index);
  {
    std::lock_guard lock(mu_);
    if (staged_[i]) {
      *k = staged_k_[i].data();
      *v = staged_v_[i].data();
      return Status::Ok();
    }
    if (!finished_) return make_error(ErrorCode::kInternal, "handoff: rows read before they are final");
  }
  // Prefill is over: nothing writes the cache any more.
  KVRING_RETURN_IF_ERROR(check_in_cache(cache_, m));
  const std::size_t n = static_cast<std::size_t>(m.rows * cache_.config().kv_dim());
  k_.resize(n);
  v_.resize(n);
  KVRING_RETURN_IF_ERROR(cache_.read_rows(m.layer, m.first_row, m.rows, k_.data(), v_.data()));
  *k = k_.data();
  *v = v_.data();
  return Status::Ok();
}

// A released message's staged rows are gone: it counts as not staged, so
// rows() asked for it again reads it in place once prefill is done (and
// before that refuses), never an emptied buffer; a second release does
// nothing. The bytes taken off are those staging added (the timeline's).
void PrefillSource::release(const PlannedMessage& m) {
  if (!check_known(m).ok()) return;
  std::lock_guard lock(mu_);
  const std::size_t i = static_cast<std::size_t>(m.index);
  if (!staged_[i]) return;
  staged_bytes_ -= timeline_.messages[i].bytes;
  std::vector<std::uint16_t>().swap(staged_k_[i]);
  std::vector<std::uint16_t>().swap(staged_v_[i]);
  staged_[i] = false;
}

std::int64_t PrefillSource::staged_bytes_peak() const {
  std::lock_guard lock(mu_);
  return staged_peak_;
}

// ------------------------------------------------------------ sender

Result<SendReport> send_session(Transport& transport, HandoffSource& source, const Timeline& timeline,
                                const SendOptions& options) {
  const auto t0 = Clock::now();
  if (!(options.timeout_s > 0) || !(options.rate_bytes_per_s >= 0) || !std::isfinite(options.rate_bytes_per_s))
    return invalid_argument("send options: timeout_s " + std::to_string(options.timeout_s) +
                            " must be above 0 and rate_bytes_per_s " + std::to_string(options.rate_bytes_per_s) +
                            " a finite rate of at least 0 (0: unpaced)");
  if (!(options.min_bytes_per_s >= 0) || !std::isfinite(options.min_bytes_per_s))
    return invalid_argument("send options: min_bytes_per_s " + std::to_string(options.min_bytes_per_s) +
                            " must be finite and at least 0 (0: no bound)");
  const std::string who = "receiver at " + transport.describe();
  const RowDigest digest = source.digest();
  const std::string header = encode_header(source.header(), timeline, digest);
  const Digest header_digest = [&] {
    Digest d;
    std::memcpy(d.data(), header.data() + header.size() - 32, 32);
    return d;
  }();
  SendReport report;
  std::int64_t acks = 0;
  // The whole session's bound on the receiver (SendOptions::min_bytes_per_s):
  // the time this end spends in calls that wait on it (sends, replies) from
  // its acceptance on, not on its own source or pacing, summed over the
  // session. The receiver's begin() before it accepts is not counted (each
  // wait there has its own timeout), and its commit() before DONE is
  // allowed a second timeout_s.
  const bool bounded = options.min_bytes_per_s > 0;
  bool counting = false;
  const double bound_s =
      bounded ? 2 * options.timeout_s + static_cast<double>(timeline.payload.payload_bytes) / options.min_bytes_per_s
              : 0;
  const Clock::duration budget = duration_of(bound_s);
  Clock::duration waited{};
  auto past_bound = [&]() -> Error {
    char limit[160];
    std::snprintf(limit, sizeof limit, "%.1f s (2 x timeout_s + %lld B at %.0f B/s)", bound_s,
                  static_cast<long long>(timeline.payload.payload_bytes), options.min_bytes_per_s);
    return io_error("handoff: " + who + " did not take the session within " + limit + ": " + std::to_string(acks) +
                    " of " + std::to_string(timeline.messages.size()) + " acknowledgements read");
  };
  // A send that failed may have met a receiver that ended the session and
  // said why before it closed the link: an ERROR that this end, waiting on
  // its prefill or its pacing, had not read. Its reason is read back where
  // it is there, past the ACKs before it.
  std::vector<std::uint8_t> in;
  // A receiver that ended with an ERROR lingers until BYE (or the link's
  // close), dropping what arrives: BYE ends its linger, so the link's next
  // session is not dropped with it.
  auto bye = [&]() {
    const std::uint8_t b = kBye;
    (void)transport.send_message(&b, 1, deadline_in(1.0));
  };
  auto why_ended = [&]() -> std::optional<Error> {
    const Deadline d = deadline_in(std::min(kReasonWaitS, options.timeout_s));
    for (std::int64_t i = 0; i <= kMaxUnreadAcks + 1; ++i) {
      if (!transport.recv_message(in, d, 1 << 20).ok() || in.empty()) break;
      if (in[0] == kError) {
        bye();
        return decode_status(in, who + " ended the session");
      }
      if (in[0] != kAck) break;
    }
    return std::nullopt;
  };
  // A call that waits on the receiver, with its deadline. A failed send
  // reports the receiver's reason where it gave one, before this end's own
  // bound or the link's error.
  auto on_receiver = [&](auto&& call, bool sends = false) -> Status {
    const auto start = Clock::now();
    const bool bound_here = bounded && counting;
    if (bound_here && waited >= budget) return past_bound();
    Deadline d = deadline_in(options.timeout_s);
    if (bound_here) d = std::min(d, start + (budget - waited));
    Status s = call(d);
    if (counting) waited += Clock::now() - start;
    if (s.ok()) return s;
    if (sends)
      if (std::optional<Error> reason = why_ended()) return *reason;
    if (bound_here && waited >= budget) return past_bound();
    return peer_lost(s, who);
  };
  KVRING_RETURN_IF_ERROR(
      on_receiver([&](Deadline d) { return transport.send_message(header.data(), header.size(), d); }, true));
  report.wire_bytes += static_cast<std::int64_t>(header.size());
  KVRING_RETURN_IF_ERROR(on_receiver([&](Deadline d) { return transport.recv_message(in, d, 1 << 20); }));
  if (in.empty()) return wire_error(who + " sent an empty message");
  if (in[0] == kError) {
    bye();
    return decode_status(in, who + " refused the session");
  }
  if (in[0] != kAccept || in.size() != 9) return wire_error(who + " sent message type " + std::to_string(in[0]) + " instead of accepting");
  Reader r{in.data() + 1, in.data() + in.size()};
  const std::uint64_t credits = r.u(8);
  // A receiver hands out at least a byte of credits (ReceiveOptions), and
  // no count past 2^63 fits the accounting.
  if (credits < 1 || credits > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
    return wire_error(who + " accepted with " + std::to_string(credits) + " B of credits");
  report.credit_bytes = static_cast<std::int64_t>(credits);
  counting = true;

  std::int64_t sent = 0, acked = 0;
  bool ended = false;
  // The bytes sent up to the end of each message not yet acknowledged, in
  // order (at most kMaxUnreadAcks + 1 of them, below).
  std::deque<std::int64_t> unacked;
  // Reads one reply: an ACK advances `acked`; an ERROR ends the session.
  // The receiver acknowledges each message in order, with the bytes taken
  // up to its end, and says DONE only after the end, every message
  // acknowledged: a reply that breaks that order ends the session.
  // `unasked`: read while no reply was awaited (a receiver's ERROR then
  // says it ended the session).
  auto read_reply = [&](bool unasked = false) -> Status {
    KVRING_RETURN_IF_ERROR(on_receiver([&](Deadline d) { return transport.recv_message(in, d, 1 << 20); }));
    if (in.empty()) return wire_error(who + " sent an empty message");
    if (in[0] == kError) {
      bye();
      return decode_status(in, who + (unasked ? " ended the session" : " failed"));
    }
    if (in[0] == kAck && in.size() == 17) {
      Reader a{in.data() + 1, in.data() + in.size()};
      const auto seq = a.u(8);
      const auto bytes = static_cast<std::int64_t>(a.u(8));
      if (seq != static_cast<std::uint64_t>(acks) || unacked.empty())
        return wire_error(who + " acknowledged message " + std::to_string(seq) + " where " + std::to_string(acks) +
                          " of " + std::to_string(report.messages) + " sent was next");
      if (bytes != unacked.front())
        return wire_error(who + " acknowledged message " + std::to_string(seq) + " with " + std::to_string(bytes) +
                          " B where it ends at " + std::to_string(unacked.front()) + " B of " + std::to_string(sent));
      unacked.pop_front();
      acked = bytes;
      ++acks;
      return Status::Ok();
    }
    if (in[0] == kDone) {
      if (!ended || !unacked.empty())
        return wire_error(who + " said done " + (ended ? "" : "before the end, ") + "with " + std::to_string(acked) +
                          " of " + std::to_string(sent) + " B acknowledged (" + std::to_string(acks) + " of " +
                          std::to_string(report.messages) + " messages)");
      return Status::Ok();
    }
    return wire_error(who + " sent message type " + std::to_string(in[0]));
  };
  // ABORT, then the receiver's ERROR and BYE, so that the receiver's
  // linger ends before the link's next session. The ERROR comes after the
  // ACKs of the rows the receiver takes first: at most one for each
  // message not yet acknowledged, in order, each within timeout_s and all
  // within the session's bound; any other reply ends the wait.
  auto abort_with = [&](const Error& e) -> Error {
    const std::string s = encode_status(kAbort, e);
    if (!transport.send_message(s.data(), s.size(), deadline_in(1.0)).ok()) return e;
    std::int64_t next = acks;
    for (std::size_t owed = unacked.size();; --owed) {
      if (!on_receiver([&](Deadline d) { return transport.recv_message(in, d, 1 << 20); }).ok() || in.empty())
        break;
      if (in[0] == kError) {
        bye();
        break;
      }
      if (in[0] != kAck || in.size() != 17 || owed == 0) break;
      Reader a{in.data() + 1, in.data() + in.size()};
      if (a.u(8) != static_cast<std::uint64_t>(next++)) break;
    }
    return e;
  };

  const std::int64_t kv = source.header().config.kv_dim();
  const bool device_ok = transport.carries(MemoryKind::kCudaDevice);
  // Keep-alives go at least every kMaxKeepaliveS whatever this end's
  // timeout: the receiver's own timeout is its setting (serve's --timeout),
  // not this one's, and a keep-alive costs a byte.
  const double keepalive_s = std::clamp(options.timeout_s / 4, 0.05, kMaxKeepaliveS);
  // While a message is held back (prefill, pacing), replies that arrived
  // are read first: the ACKs of earlier messages, or a receiver's ERROR,
  // which ends the session here even where that receiver keeps the link
  // open (Transport::message_waiting).
  auto keep_alive = [&]() -> Status {
    while (transport.message_waiting()) KVRING_RETURN_IF_ERROR(read_reply(/*unasked=*/true));
    const std::uint8_t keep = kKeep;
    return on_receiver([&](Deadline d) { return transport.send_message(&keep, 1, d); }, true);
  };
  // A message past the receiver's credits could never be sent (and the
  // wait for credits below would never end): refused at the acceptance,
  // not once the prefill reaches it.
  for (const PlannedMessage& m : timeline.messages)
    if (m.bytes > report.credit_bytes)
      return abort_with(invalid_argument("a message of " + std::to_string(m.bytes) + " B exceeds the receiver's credits of " +
                                         std::to_string(report.credit_bytes) + " B"));
  auto allowed_at = Clock::now();
  for (const PlannedMessage& m : timeline.messages) {
    if (Status s = check_planned(source.header(), m); !s.ok()) return abort_with(s.error());
    for (;;) {
      auto ready = source.wait_final(m, deadline_in(keepalive_s));
      if (!ready.ok()) return abort_with(make_error(ready.error().code, "the sender's session failed: " + ready.error().message));
      if (*ready) break;
      KVRING_RETURN_IF_ERROR(keep_alive());
    }
    while (sent - acked + m.bytes > report.credit_bytes) KVRING_RETURN_IF_ERROR(read_reply());
    if (options.rate_bytes_per_s > 0) {
      // The pacing wait keeps the link alive as a prefill wait does: the
      // receiver bounds a run of keep-alives by its max_keep_s, so a rate
      // too slow for it ends there (its ERROR read before the next
      // keep-alive, or that keep-alive's send failing), not at the
      // sender's last message.
      const auto now = Clock::now();
      while (Clock::now() < allowed_at) {
        std::this_thread::sleep_until(std::min(allowed_at, Clock::now() + duration_of(keepalive_s)));
        if (Clock::now() < allowed_at) KVRING_RETURN_IF_ERROR(keep_alive());
      }
      allowed_at = std::max(allowed_at, now) +
                   duration_of(static_cast<double>(m.bytes) / options.rate_bytes_per_s);
    }
    SourceRows rows;
    if (Status s = source.message_rows(m, device_ok, &rows); !s.ok()) return abort_with(s.error());
    std::uint8_t head[kRowsFixed];
    head[0] = kRows;
    coding::encode_fixed64(head + 1, static_cast<std::uint64_t>(m.index));
    coding::encode_fixed32(head + 9, static_cast<std::uint32_t>(m.layer));
    coding::encode_fixed64(head + 13, static_cast<std::uint64_t>(m.first_row));
    coding::encode_fixed64(head + 21, static_cast<std::uint64_t>(m.rows));
    const std::size_t plane_bytes = static_cast<std::size_t>(m.rows * kv * 2);
    const bool host_rows = rows.kind == MemoryKind::kHost;
    if (digest == RowDigest::kSha256) {
      if (!host_rows)
        return abort_with(make_error(ErrorCode::kInternal, "handoff: a SHA-256 session's rows are in device memory"));
      Sha256 h;
      h.update(head, kRowsHead);
      h.update(rows.k, plane_bytes);
      h.update(rows.v, plane_bytes);
      const Digest d = h.finish();
      std::memcpy(head + kRowsHead, d.data(), 32);
    } else {
      if (!rows.digest_words && !host_rows)
        return abort_with(make_error(ErrorCode::kInternal, "handoff: device rows came without their digest"));
      put_digest64(head + kRowsHead, head,
                   rows.digest_words ? *rows.digest_words : host_words(rows.k, rows.v, plane_bytes), plane_bytes);
    }
    Status s = on_receiver([&](Deadline d) {
      return transport.send_message({{head, kRowsFixed},
                                     {rows.k, plane_bytes, rows.kind, rows.stream},
                                     {rows.v, plane_bytes, rows.kind, rows.stream}},
                                    d);
    }, true);
    source.release(m);
    KVRING_RETURN_IF_ERROR(s);
    sent += m.bytes;
    unacked.push_back(sent);
    report.max_in_flight = std::max(report.max_in_flight, sent - acked);
    report.wire_bytes += static_cast<std::int64_t>(kRowsFixed + 2 * plane_bytes);
    ++report.messages;
    // The receiver acknowledges every message, and blocks sending an ACK
    // once the link's reverse direction is full: unread ACKs are bounded by
    // count as well as by credits, or many small messages under large
    // credits would leave both ends blocked in a send until their timeouts.
    while (report.messages - acks > kMaxUnreadAcks) KVRING_RETURN_IF_ERROR(read_reply());
  }
  std::string end;
  put_fixed8(&end, kEnd);
  put_fixed64(&end, timeline.messages.size());
  put_fixed64(&end, sent);
  put_bytes(&end, header_digest.data(), header_digest.size());
  KVRING_RETURN_IF_ERROR(
      on_receiver([&](Deadline d) { return transport.send_message(end.data(), end.size(), d); }, true));
  ended = true;
  for (;;) {
    KVRING_RETURN_IF_ERROR(read_reply());
    if (in[0] == kDone) break;
  }
  bye();  // the session is live either way
  report.payload_bytes = sent;
  report.seconds = seconds_since(t0);
  return report;
}

// ------------------------------------------------------------ receiver

Result<ReceiveReport> receive_session(Transport& transport, HandoffTarget& target, const ReceiveOptions& options) {
  // Sizes the receiver hands out as credits and bounds messages by: a
  // negative one would pass to the transport as a huge size_t.
  if (options.credit_bytes < 1 || options.max_message_bytes < 1)
    return invalid_argument("receive options: credit_bytes " + std::to_string(options.credit_bytes) +
                            " and max_message_bytes " + std::to_string(options.max_message_bytes) +
                            " must be at least 1");
  // NaN or a negative max_keep_s would read as 0 ("no limit") below and turn
  // off both the keep-alive bound and the whole session's bound.
  if (!(options.timeout_s > 0) || !(options.max_keep_s >= 0))
    return invalid_argument("receive options: timeout_s " + std::to_string(options.timeout_s) +
                            " must be above 0 and max_keep_s " + std::to_string(options.max_keep_s) +
                            " at least 0 (0: no limit)");
  if (!(options.min_bytes_per_s >= 0) || !std::isfinite(options.min_bytes_per_s))
    return invalid_argument("receive options: min_bytes_per_s " + std::to_string(options.min_bytes_per_s) +
                            " must be finite and at least 0");
  const std::string who = "sender at " + transport.describe();
  // Rows may stay in device memory when both the link and the target can
  // hold them there; they are then digested and installed on `stream`
  // (declared first: a message's device bytes are freed in its order).
  const bool keep_device = target.accepts_device() && transport.carries(MemoryKind::kCudaDevice);
  std::unique_ptr<device::Stream> stream;
  std::unique_ptr<device::Digester> digester;
  ReceivedMessage msg;
  std::vector<std::uint8_t>& in = msg.host;
  bool begun = false;
  // Every error path: free what the target took, tell the sender (best
  // effort, the link may be gone), name the error.
  auto fail = [&](Error e) -> Error {
    if (begun) target.abort();
    const std::string s = encode_status(kError, e);
    if (transport.send_message(s.data(), s.size(), deadline_in(1.0)).ok())
      linger(transport, std::min(kLingerS, options.timeout_s), static_cast<std::size_t>(options.max_message_bytes));
    return e;
  };
  // The header may take max_message_bytes; once credits are handed out, no
  // message may carry more rows than they allow.
  std::int64_t limit = options.max_message_bytes;
  auto recv = [&](Deadline d) -> Status {
    if (Status s = transport.recv(msg, d, static_cast<std::size_t>(limit), keep_device); !s.ok())
      return peer_lost(s, who);
    if (in.empty()) return wire_error(who + " sent an empty message");
    return Status::Ok();
  };
  // A BYE or KEEP before the header is the end of an earlier session on
  // the link (a sender that heard this end's ERROR after its linger), not
  // this one's start. A transport hands over what is already there past a
  // deadline, so the clock bounds the skipping.
  const Deadline first_by = deadline_in(options.timeout_s);
  for (;;) {
    if (Status s = recv(first_by); !s.ok()) return fail(s.error());
    if (in.size() != 1 || (in[0] != kBye && in[0] != kKeep)) break;
    if (Clock::now() >= first_by)
      return fail(io_error("handoff: " + who + " sent no header within " + std::to_string(options.timeout_s) +
                           " s, only keep-alives or a BYE"));
  }
  const auto t0 = Clock::now();
  if (in[0] != kHeader) return fail(wire_error(who + " did not start with a header (type " + std::to_string(in[0]) + ")"));
  auto decoded = decode_header(in);
  if (!decoded) return fail(decoded.error());
  const Snapshot& h = decoded->header;
  std::int64_t expected_bytes = 0;
  for (const PlaneSnapshot& p : h.planes) expected_bytes += p.ring.len() * h.config.kv_dim() * 4;
  if (expected_bytes != decoded->payload_bytes)
    return fail(wire_error("header: payload of " + std::to_string(decoded->payload_bytes) + " B, its planes hold " +
                           std::to_string(expected_bytes) + " B"));
  begun = true;
  if (Status s = target.begin(h); !s.ok()) return fail(s.error());
  // The credits handed out: at most the rows a message of max_message_bytes
  // carries (at least a byte), so that a sender refuses at the acceptance
  // a message this end would refuse by its size.
  const auto fixed = static_cast<std::int64_t>(kRowsFixed);
  const std::int64_t credits = std::max<std::int64_t>(1, std::min(options.credit_bytes, options.max_message_bytes - fixed));
  {
    std::string accept;
    put_fixed8(&accept, kAccept);
    put_fixed64(&accept, credits);
    if (Status s = transport.send_message(accept.data(), accept.size(), deadline_in(options.timeout_s)); !s.ok())
      return fail(peer_lost(s, who));
    // (At least what an ABORT or an END takes, whatever the credits.)
    if (credits < options.max_message_bytes - fixed)
      limit = std::max<std::int64_t>(credits + fixed, 2 * kStatusTextBytes);
    limit = std::min(limit, options.max_message_bytes);
  }
  const std::int64_t kv = h.config.kv_dim();
  std::vector<std::int64_t> next_row;
  for (const PlaneSnapshot& p : h.planes) next_row.push_back(p.ring.origin_logical());
  ReceiveReport report;
  std::int64_t taken = 0;
  // The whole session's bound (ReceiveOptions::min_bytes_per_s), from its
  // acceptance: the target's own begin() does not count against it.
  const bool bounded = options.min_bytes_per_s > 0 && options.max_keep_s > 0;
  const double session_s =
      bounded ? options.max_keep_s + options.timeout_s + static_cast<double>(expected_bytes) / options.min_bytes_per_s
              : 0;
  const Deadline session_end = bounded ? Clock::now() + duration_of(session_s) : Deadline::max();
  auto past_session = [&]() -> Error {
    char limit[192];
    std::snprintf(limit, sizeof limit, "%.1f s (max_keep_s + timeout_s + %lld B at %.0f B/s)", session_s,
                  static_cast<long long>(expected_bytes), options.min_bytes_per_s);
    return io_error("handoff: " + who + " did not end the session within " + limit + ": " +
                    std::to_string(report.messages) + " of " + std::to_string(decoded->n_messages) + " messages, " +
                    std::to_string(taken) + " of " + std::to_string(expected_bytes) + " B arrived");
  };
  // Keep-alives say the sender's prefill still runs; they hold the target's
  // blocks, so a run of them with no rows ends at max_keep_s.
  auto last_rows = Clock::now();
  for (;;) {
    if (Clock::now() >= session_end) return fail(past_session());
    if (Status s = recv(std::min(deadline_in(options.timeout_s), session_end)); !s.ok()) {
      if (Clock::now() >= session_end) return fail(past_session());
      return fail(make_error(s.error().code, s.error().message + " (after " + std::to_string(report.messages) + " of " +
                                                 std::to_string(decoded->n_messages) + " messages)"));
    }
    const std::string at = "message " + std::to_string(report.messages) + ": ";
    if (in[0] == kKeep && in.size() == 1) {
      if (options.max_keep_s > 0 && seconds_since(last_rows) > options.max_keep_s) {
        char limit[32];
        std::snprintf(limit, sizeof limit, "%g", options.max_keep_s);
        return fail(io_error("handoff: " + who + " sent only keep-alives for " + limit + " s (after " +
                             std::to_string(report.messages) + " of " + std::to_string(decoded->n_messages) +
                             " messages)"));
      }
      continue;
    }
    if (in[0] == kAbort) return fail(decode_status(in, who + " aborted"));
    if (in[0] == kRows) {
      const std::size_t size = in.size() + (msg.device ? msg.device->size() : 0);
      if (in.size() < kRowsFixed || (msg.device && in.size() != kRowsFixed))
        return fail(wire_error(at + "rows message of " + std::to_string(size) + " B is truncated"));
      if (report.messages == decoded->n_messages)
        return fail(wire_error(at + "rows past the header's " + std::to_string(decoded->n_messages) + " messages"));
      Reader r{in.data() + 1, in.data() + kRowsHead};
      const auto seq = static_cast<std::int64_t>(r.u(8));
      const auto layer = static_cast<std::int64_t>(r.u(4));
      const auto first = static_cast<std::int64_t>(r.u(8));
      const auto rows = static_cast<std::int64_t>(r.u(8));
      if (seq != report.messages) return fail(wire_error(at + "sequence number " + std::to_string(seq)));
      if (layer >= h.config.n_layers) return fail(wire_error(at + "layer " + std::to_string(layer)));
      if (rows < 1 || rows > options.max_message_bytes / (kv * 4) ||
          size != kRowsFixed + static_cast<std::size_t>(rows * kv * 4))
        return fail(wire_error(at + std::to_string(size) + " B for " + std::to_string(rows) + " rows"));
      if (rows * kv * 4 > credits)
        return fail(wire_error(at + std::to_string(rows * kv * 4) + " B of rows, past the credits of " +
                               std::to_string(credits) + " B"));
      const PlaneSnapshot& p = h.planes[static_cast<std::size_t>(layer)];
      std::int64_t& next = next_row[static_cast<std::size_t>(layer)];
      if (first != next || first + rows > p.ring.next_position())
        return fail(wire_error(at + "layer " + std::to_string(layer) + " rows from " + std::to_string(first) +
                               ", expected " + std::to_string(next) + " (live up to " + std::to_string(p.ring.next_position()) + ")"));
      const std::size_t plane_bytes = static_cast<std::size_t>(rows * kv * 2);
      const std::uint8_t* k = msg.device ? static_cast<const std::uint8_t*>(msg.device->data()) : in.data() + kRowsFixed;
      const std::uint8_t* v = k + plane_bytes;
      std::uint8_t want[32];
      if (decoded->rows == RowDigest::kSha256) {
        if (msg.device) return fail(wire_error(at + "a SHA-256 session's rows arrived in device memory"));
        Sha256 d;
        d.update(in.data(), kRowsHead);
        d.update(k, 2 * plane_bytes);
        const Digest got = d.finish();
        std::memcpy(want, got.data(), 32);
      } else if (!msg.device) {
        put_digest64(want, in.data(), host_words(k, v, plane_bytes), plane_bytes);
      } else {
        // Device rows: digested on the GPU and installed on the same stream
        // before the digest is known; a mismatch aborts the detached
        // sequence they went into.
        if (!stream) {
          auto made = device::Stream::create();
          if (!made) return fail(made.error());
          stream = std::move(*made);
          auto d = device::Digester::create();
          if (!d) return fail(d.error());
          digester = std::move(*d);
        }
        if (Status s = msg.device->ready_on(stream->get()); !s.ok()) return fail(s.error());
        if (Status s = digester->start(k, v, plane_bytes, stream->get()); !s.ok()) return fail(s.error());
        if (Status s = target.put_device_rows(layer, first, rows, k, v, stream->get()); !s.ok()) return fail(s.error());
        auto words = digester->wait();
        if (!words) return fail(words.error());
        put_digest64(want, in.data(), *words, plane_bytes);
      }
      if (std::memcmp(want, in.data() + kRowsHead, 32) != 0)
        return fail(corruption("handoff: " + at + "layer " + std::to_string(layer) + " rows " + std::to_string(first) + ".." +
                               std::to_string(first + rows - 1) + ": " + row_digest_name(decoded->rows) +
                               " does not match (a corrupted byte)"));
      if (!msg.device)
        if (Status s = target.put_rows(layer, first, rows, k, v); !s.ok()) return fail(s.error());
      next += rows;
      taken += rows * kv * 4;
      ++report.messages;
      last_rows = Clock::now();
      std::string ack;
      put_fixed8(&ack, kAck);
      put_fixed64(&ack, seq);
      put_fixed64(&ack, taken);
      // Within the session's bound too: a sender that reads no ACK cannot
      // hold the target's blocks past it by filling the link.
      if (Status s = transport.send_message(ack.data(), ack.size(), std::min(deadline_in(options.timeout_s), session_end));
          !s.ok())
        return fail(Clock::now() >= session_end ? past_session() : peer_lost(s, who));
      continue;
    }
    if (in[0] == kEnd) {
      Reader r{in.data() + 1, in.data() + in.size()};
      const auto n = static_cast<std::int64_t>(r.u(8));
      const auto bytes = static_cast<std::int64_t>(r.u(8));
      const std::uint8_t* digest = r.bytes(32);
      if (!r.ok || r.p != r.end) return fail(wire_error("end message is malformed"));
      if (std::memcmp(digest, decoded->digest.data(), 32) != 0) return fail(wire_error("end message names another session"));
      if (n != decoded->n_messages || n != report.messages || bytes != taken || taken != expected_bytes)
        return fail(wire_error("the stream ended after " + std::to_string(report.messages) + " of " +
                               std::to_string(decoded->n_messages) + " messages, " + std::to_string(taken) + " of " +
                               std::to_string(expected_bytes) + " B; its end claims " + std::to_string(n) +
                               " messages, " + std::to_string(bytes) + " B"));
      for (std::size_t l = 0; l < h.planes.size(); ++l)
        if (next_row[l] != h.planes[l].ring.next_position())
          return fail(wire_error("layer " + std::to_string(l) + " is incomplete"));
      if (Status s = target.commit(); !s.ok()) return fail(s.error());
      report.payload_bytes = taken;
      report.seconds = seconds_since(t0);
      const std::uint8_t done = kDone;
      // The session is live; a sender that left before hearing so changes nothing here.
      if (transport.send_message(&done, 1, deadline_in(options.timeout_s)).ok())
        linger(transport, std::min(kLingerS, options.timeout_s), kByeOnlyBytes);
      return report;
    }
    return fail(wire_error(at + "unexpected message type " + std::to_string(in[0])));
  }
}

}  // namespace kvring::handoff
