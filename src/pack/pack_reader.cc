// The kvpack reader. Order of checks: preamble (magic, version, flags,
// manifest_len against the limit and the file size; a version or flags this
// build does not know are damage where the bytes match their digest as
// this version's), the manifest digest,
// then every manifest field against the geometry and the bytes that remain,
// the file size against the chunk table, and each chunk's hash as it is
// read. No allocation is sized by a field before that field is checked, and
// none by a chunk's claimed size before the chunk is known to exist: a thin
// pack's chunks are looked up in the store before anything is read, and a
// self-contained pack whose file holds fewer bytes than its size (a sparse
// file) has every chunk verified, streamed through bounded buffers, before
// its rows are allocated. A chunk wholly in a hole of the file reads as
// zeros and is checked against their hash unread (check_holes), so a
// verify takes the time of the file's data, not of the size it claims.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <condition_variable>
#include <functional>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <optional>

#include "coding.h"
#include "core/file_read.h"
#include "core/store_access.h"
#include "cpu/parallel.h"
#include "file_io.h"
#include "kvring/pack.h"
#include "pack_common.h"

namespace kvring {

namespace {

// A 16-bit value's bytes, most significant first, for showing it in hex.
std::array<std::uint8_t, 2> be16(std::uint16_t v) {
  return {static_cast<std::uint8_t>(v >> 8), static_cast<std::uint8_t>(v & 0xff)};
}

using namespace pack_internal;

// Fuzzing builds skip the digest comparisons so that the fuzzer reaches the
// field checks behind them; everything else is checked as in production.
#if defined(FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION)
constexpr bool kCheckDigests = false;
#else
constexpr bool kCheckDigests = true;
#endif

class FileSource final : public PackSource {
 public:
  FileSource(std::string name, int fd, std::int64_t size, std::int64_t stored)
      : name_(std::move(name)), fd_(fd), size_(size), stored_(stored) {}
  ~FileSource() override { ::close(fd_); }
  const std::string& name() const override { return name_; }
  std::int64_t size() const override { return size_; }
  std::int64_t stored_bytes() const override { return stored_; }
  Status read_at(std::int64_t offset, std::int64_t n, std::uint8_t* dst) const override {
    return pread_all(fd_, dst, n, offset, name_);
  }
  // The range must lie within the size the file had when opened
  // (range_in_hole, file_io.h, says the rest).
  bool in_hole(std::int64_t offset, std::int64_t n) const override {
    return offset >= 0 && n > 0 && offset <= size_ - n && range_in_hole(fd_, offset, n);
  }

 private:
  std::string name_;
  int fd_;
  std::int64_t size_, stored_;
};

class MemorySource final : public PackSource {
 public:
  MemorySource(const void* data, std::int64_t size, std::string name)
      : name_(std::move(name)), data_(static_cast<const std::uint8_t*>(data)), size_(size) {}
  const std::string& name() const override { return name_; }
  std::int64_t size() const override { return size_; }
  Status read_at(std::int64_t offset, std::int64_t n, std::uint8_t* dst) const override {
    // A view the caller described wrongly is its error, not the pack's.
    if (size_ < 0)
      return make_error(ErrorCode::kInvalidArgument, name_ + ": a source of " + std::to_string(size_) + " bytes");
    if (data_ == nullptr && size_ > 0)
      return make_error(ErrorCode::kInvalidArgument,
                        name_ + ": a memory view of " + std::to_string(size_) + " bytes at a null pointer");
    if (dst == nullptr && n > 0) return make_error(ErrorCode::kInvalidArgument, name_ + ": read into a null buffer");
    if (offset < 0 || n < 0 || offset > size_ || n > size_ - offset)
      return corruption(name_ + ": ends at byte " + std::to_string(size_) + ", needed bytes [" +
                        std::to_string(offset) + ", " + std::to_string(offset + n) + ")");
    if (n > 0) std::memcpy(dst, data_ + offset, static_cast<std::size_t>(n));
    return Status::Ok();
  }

 private:
  std::string name_;
  const std::uint8_t* data_;
  std::int64_t size_;
};

// Reads fixed-width fields from the manifest bytes [p, limit); every error
// names the source, the section, the item (plane or chunk), the field and
// its byte offset in the file.
class Cursor {
 public:
  Cursor(std::string source, const std::uint8_t* p, const std::uint8_t* limit,
         std::int64_t file_offset)
      : source_(std::move(source)), start_(p), p_(p), limit_(limit), file_offset_(file_offset) {}

  void section(std::string name) {
    section_ = std::move(name);
    item_.clear();
  }
  void item(std::string item) { item_ = std::move(item); }
  std::int64_t offset() const { return file_offset_ + (p_ - start_); }
  std::int64_t left() const { return static_cast<std::int64_t>(coding::remaining(p_, limit_)); }

  Status u8(const char* field, std::uint8_t* v) { return get(field, 1, coding::get_fixed8(p_, limit_, v)); }
  Status u16(const char* field, std::uint16_t* v) { return get(field, 2, coding::get_fixed16(p_, limit_, v)); }
  Status u32(const char* field, std::uint32_t* v) { return get(field, 4, coding::get_fixed32(p_, limit_, v)); }
  Status u64(const char* field, std::uint64_t* v) { return get(field, 8, coding::get_fixed64(p_, limit_, v)); }
  Status bytes(const char* field, std::int64_t n, const std::uint8_t** out) {
    if (n < 0 || n > left()) return truncated(field, n);
    return get(field, n, coding::get_bytes(p_, limit_, static_cast<std::size_t>(n), out));
  }

  // An error about the field read last.
  Error bad(const char* field, const std::string& what) const { return bad_at(field, field_offset_, what); }
  Error bad_at(const char* field, std::int64_t offset, const std::string& what) const {
    return corruption(where() + field + " at byte " + std::to_string(offset) + ": " + what);
  }
  Error truncated(const char* field, std::int64_t need) const {
    return corruption(where() + field + " at byte " + std::to_string(offset()) +
                      ": truncated: needs " + std::to_string(need) + " bytes, the manifest has " +
                      std::to_string(left()) + " left");
  }
  Error truncated_items(const char* field, std::uint64_t count, std::int64_t width) const {
    return corruption(where() + field + " at byte " + std::to_string(offset()) + ": truncated: " +
                      std::to_string(count) + " records of " + std::to_string(width) +
                      " bytes do not fit in the " + std::to_string(left()) + " bytes left");
  }

 private:
  std::string where() const {
    return source_ + ": " + section_ + (item_.empty() ? "" : ", " + item_) + ": ";
  }
  Status get(const char* field, std::int64_t width, const std::uint8_t* next) {
    if (next == nullptr) return truncated(field, width);
    field_offset_ = offset();
    p_ = next;
    return Status::Ok();
  }

  std::string source_, section_, item_;
  const std::uint8_t* start_;
  const std::uint8_t* p_;
  const std::uint8_t* limit_;
  std::int64_t file_offset_;
  std::int64_t field_offset_ = 0;
};

std::string num(std::int64_t v) { return std::to_string(v); }
std::string num(std::uint64_t v) { return std::to_string(v); }

Status parse_geometry(Cursor& c, ModelConfig* config) {
  c.section("geometry");
  std::uint32_t f[6];
  const char* names[6] = {"n_layers", "n_heads", "n_kv_heads", "head_dim", "sliding_window",
                          "max_context"};
  for (int i = 0; i < 6; ++i) KVRING_RETURN_IF_ERROR(c.u32(names[i], &f[i]));
  const std::int64_t geometry_at = c.offset() - 24;
  if (f[0] < 1 || f[0] > kMaxLayers)
    return c.bad_at("n_layers", geometry_at, num(std::uint64_t{f[0]}) + " outside [1, " + num(kMaxLayers) + "]");
  config->name = "kvpack";
  config->n_layers = f[0];
  config->n_heads = f[1];
  config->n_kv_heads = f[2];
  config->head_dim = f[3];
  config->sliding_window = f[4];
  config->max_context = f[5];
  const std::uint8_t* kinds = nullptr;
  KVRING_RETURN_IF_ERROR(c.bytes("layer_kind", config->n_layers, &kinds));
  for (std::int64_t l = 0; l < config->n_layers; ++l) {
    if (kinds[l] > static_cast<std::uint8_t>(LayerKind::kFullNope))
      return c.bad_at("layer_kind", c.offset() - config->n_layers + l,
                      "layer " + num(l) + " has kind " + num(std::uint64_t{kinds[l]}) +
                          ", not a known layer kind");
    config->layer_kinds.push_back(static_cast<LayerKind>(kinds[l]));
  }
  if (Status s = config->validate(); !s.ok())
    return c.bad_at("fields", geometry_at, "not a valid geometry: " + s.error().message);
  const std::uint8_t* fp = nullptr;
  KVRING_RETURN_IF_ERROR(c.bytes("fingerprint", kDigestBytes, &fp));
  const Digest want = config->fingerprint();
  if (std::memcmp(fp, want.data(), want.size()) != 0)
    return c.bad("fingerprint", to_hex(fp, 8) + "... does not match the geometry fields, which hash to " +
                                    short_name(want) + "...");
  return Status::Ok();
}

Status parse_cache(Cursor& c, Manifest* m) {
  c.section("cache");
  Snapshot& h = m->header;
  std::uint32_t context = 0, chunk_tokens = 0;
  std::uint64_t token_count = 0;
  KVRING_RETURN_IF_ERROR(c.u32("context", &context));
  if (context < 1 || context > h.config.max_context)
    return c.bad("context", num(std::uint64_t{context}) + " outside [1, max_context " +
                                num(h.config.max_context) + "]");
  KVRING_RETURN_IF_ERROR(c.u32("chunk_tokens", &chunk_tokens));
  const std::int64_t max_tokens = max_chunk_tokens(h.config.kv_dim());
  if (chunk_tokens < 1 || chunk_tokens > max_tokens)
    return c.bad("chunk_tokens", num(std::uint64_t{chunk_tokens}) + " outside [1, " +
                                     num(max_tokens) + "] for kv_dim " + num(h.config.kv_dim()));
  KVRING_RETURN_IF_ERROR(c.u64("token_count", &token_count));
  if (token_count > static_cast<std::uint64_t>(kMaxTokenCount))
    return c.bad("token_count", num(token_count) + " exceeds 2^62");
  h.context = context;
  m->chunk_tokens = chunk_tokens;
  h.token_count = static_cast<std::int64_t>(token_count);

  c.section("tokens");
  std::uint64_t n_ids = 0;
  KVRING_RETURN_IF_ERROR(c.u64("n_token_ids", &n_ids));
  if (n_ids != 0 && n_ids != token_count)
    return c.bad("n_token_ids", num(n_ids) + " ids for " + num(token_count) + " tokens (must be 0 or equal)");
  // Compared by count, never multiplied: n_ids may be near 2^62.
  if (n_ids > static_cast<std::uint64_t>(c.left() / 4)) return c.truncated_items("token_id", n_ids, 4);
  const std::uint8_t* ids = nullptr;
  KVRING_RETURN_IF_ERROR(c.bytes("token_id", static_cast<std::int64_t>(n_ids) * 4, &ids));
  h.token_ids.resize(static_cast<std::size_t>(n_ids));
  for (std::size_t i = 0; i < h.token_ids.size(); ++i)
    h.token_ids[i] = static_cast<std::int32_t>(coding::decode_fixed32(ids + 4 * i));

  c.section("metadata");
  std::uint32_t meta_len = 0;
  KVRING_RETURN_IF_ERROR(c.u32("metadata_len", &meta_len));
  const std::uint8_t* meta = nullptr;
  KVRING_RETURN_IF_ERROR(c.bytes("metadata", meta_len, &meta));
  h.metadata.assign(reinterpret_cast<const char*>(meta), meta_len);
  return Status::Ok();
}

Status parse_planes(Cursor& c, Manifest* m, std::int64_t* total_chunks) {
  c.section("plane table");
  Snapshot& h = m->header;
  const ModelConfig& cfg = h.config;
  std::uint32_t n_planes = 0;
  KVRING_RETURN_IF_ERROR(c.u32("n_planes", &n_planes));
  if (n_planes != cfg.n_layers)
    return c.bad("n_planes", num(std::uint64_t{n_planes}) + " planes for " + num(cfg.n_layers) + " layers");
  *total_chunks = 0;
  for (std::int64_t l = 0; l < cfg.n_layers; ++l) {
    c.item("plane " + num(l));
    std::uint32_t layer = 0, capacity = 0, len = 0, origin_physical = 0, n_chunks = 0;
    std::uint8_t kind = 0, layout = 0, encoding = 0;
    std::uint64_t origin_logical = 0;
    KVRING_RETURN_IF_ERROR(c.u32("layer", &layer));
    if (layer != l) return c.bad("layer", num(std::uint64_t{layer}) + ", planes must be listed in layer order");
    KVRING_RETURN_IF_ERROR(c.u8("kind", &kind));
    if (kind != static_cast<std::uint8_t>(cfg.kind(l)))
      return c.bad("kind", num(std::uint64_t{kind}) + ", the geometry says " + layer_kind_name(cfg.kind(l)));
    KVRING_RETURN_IF_ERROR(c.u8("layout", &layout));
    if (layout != static_cast<std::uint8_t>(layout_for(cfg.kind(l))))
      return c.bad("layout", num(std::uint64_t{layout}) + " is not the layout of a " +
                                 layer_kind_name(cfg.kind(l)) + " plane");
    KVRING_RETURN_IF_ERROR(c.u8("encoding", &encoding));
    if (encoding > static_cast<std::uint8_t>(Encoding::kF32Le))
      return c.bad("encoding", num(std::uint64_t{encoding}) + " is not a known encoding");
    KVRING_RETURN_IF_ERROR(c.u32("capacity", &capacity));
    const std::int64_t want_capacity = cfg.plane_capacity(l, h.context);
    if (capacity != want_capacity)
      return c.bad("capacity", num(std::uint64_t{capacity}) + ", a " + layer_kind_name(cfg.kind(l)) +
                                   " plane at context " + num(h.context) + " has " + num(want_capacity));
    KVRING_RETURN_IF_ERROR(c.u32("len", &len));
    KVRING_RETURN_IF_ERROR(c.u64("origin_logical", &origin_logical));
    if (origin_logical > static_cast<std::uint64_t>(kMaxTokenCount))
      return c.bad("origin_logical", num(origin_logical) + " exceeds 2^62");
    KVRING_RETURN_IF_ERROR(c.u32("origin_physical", &origin_physical));
    auto ring = RingState::from_parts(capacity, cfg.kind(l) == LayerKind::kSlidingRope, len,
                                      static_cast<std::int64_t>(origin_logical), origin_physical);
    if (!ring) return c.bad("ring state", ring.error().message);
    // Every kvring ring is built sequentially from position 0, so its state
    // follows from token_count and capacity; anything else is damage.
    auto want = RingState::sequential(capacity, ring->wraps(), h.token_count);
    if (!want || !(*want == *ring))
      return c.bad("ring state", "len " + num(ring->len()) + ", origin_logical " +
                                     num(ring->origin_logical()) + ", origin_physical " +
                                     num(ring->origin_physical()) +
                                     " is not the ring a session of token_count " +
                                     num(h.token_count) + " holds" +
                                     (want ? " (len " + num(want->len()) + ", origin_logical " +
                                                 num(want->origin_logical()) + ", origin_physical " +
                                                 num(want->origin_physical()) + ")"
                                           : ": " + want.error().message));
    // No cache of this context holds more (KvStore::position_limit), and
    // validate_snapshot refuses it.
    if (cfg.ring_stops_at_context(l, h.context) && h.token_count > h.context)
      return c.bad("ring state", "a sliding ring of " + num(std::uint64_t{capacity}) +
                                     " rows, shorter than the window of " + num(cfg.sliding_window) +
                                     ", stops at the context " + num(h.context) + "; token_count is " +
                                     num(h.token_count));
    KVRING_RETURN_IF_ERROR(c.u32("n_chunks", &n_chunks));
    const std::int64_t want_chunks = count_chunks(ring->origin_logical(), ring->len(), m->chunk_tokens);
    if (n_chunks != want_chunks)
      return c.bad("n_chunks", num(std::uint64_t{n_chunks}) + ", the live rows [" +
                                   num(ring->origin_logical()) + ", " + num(h.token_count) + ") cut at every " +
                                   num(m->chunk_tokens) + " positions make " + num(want_chunks));
    h.planes.push_back(PlaneSnapshot{cfg.kind(l), layout_for(cfg.kind(l)), *ring, {}, {}});
    m->planes.push_back(PackPlane{static_cast<Encoding>(encoding), *total_chunks, n_chunks});
    *total_chunks += n_chunks;
  }
  return Status::Ok();
}

Status parse_chunks(Cursor& c, Manifest* m, std::int64_t total_chunks) {
  c.section("chunk table");
  std::uint32_t n = 0;
  KVRING_RETURN_IF_ERROR(c.u32("n_chunk_records", &n));
  if (n != total_chunks)
    return c.bad("n_chunk_records", num(std::uint64_t{n}) + ", the planes list " + num(total_chunks));
  if (n > c.left() / kChunkRecordBytes) return c.truncated_items("chunk records", n, kChunkRecordBytes);
  m->chunks.reserve(n);
  const std::int64_t kv_dim = m->header.config.kv_dim();
  std::int64_t offset = m->payload_offset;
  for (std::size_t l = 0; l < m->planes.size(); ++l) {
    const RingState& ring = m->header.planes[l].ring;
    const PackPlane& plane = m->planes[l];
    for (std::int64_t j = 0; j < plane.n_chunks; ++j) {
      const std::int64_t index = plane.first_chunk + j;
      c.item("chunk " + num(index) + " (layer " + num(static_cast<std::int64_t>(l)) + ")");
      const ChunkRange want = chunk_range(ring.origin_logical(), ring.len(), m->chunk_tokens, j);
      std::uint64_t first = 0;
      std::uint32_t rows = 0, length = 0;
      KVRING_RETURN_IF_ERROR(c.u64("first_position", &first));
      if (first != static_cast<std::uint64_t>(want.first_position))
        return c.bad("first_position", num(first) + ", expected " + num(want.first_position));
      KVRING_RETURN_IF_ERROR(c.u32("rows", &rows));
      if (rows != want.rows) return c.bad("rows", num(std::uint64_t{rows}) + ", expected " + num(want.rows));
      KVRING_RETURN_IF_ERROR(c.u32("byte_length", &length));
      const std::int64_t want_length = chunk_byte_length(rows, kv_dim, plane.encoding);
      if (length != want_length)
        return c.bad("byte_length", num(std::uint64_t{length}) + ", " + num(std::uint64_t{rows}) +
                                        " rows of kv_dim " + num(kv_dim) + " in " +
                                        encoding_name(plane.encoding) + " take " + num(want_length));
      const std::uint8_t* name = nullptr;
      KVRING_RETURN_IF_ERROR(c.bytes("name", kDigestBytes, &name));
      PackChunk ch;
      ch.layer = static_cast<std::int64_t>(l);
      ch.first_position = want.first_position;
      ch.rows = rows;
      ch.byte_length = length;
      ch.offset = m->thin ? 0 : offset;
      std::memcpy(ch.name.data(), name, kDigestBytes);
      offset += length;
      m->payload_bytes += length;
      m->chunks.push_back(ch);
    }
  }
  if (c.left() != 0) {
    c.section("manifest");
    return c.bad_at("end of the chunk table", c.offset(),
                    num(c.left()) + " unparsed bytes before the manifest digest");
  }
  return Status::Ok();
}

std::string chunk_where(const PackSource& src, const Manifest& m, std::int64_t i) {
  const PackChunk& ch = m.chunks[static_cast<std::size_t>(i)];
  std::string s = src.name() + ": chunk " + num(i) + " (layer " + num(ch.layer) + ", positions [" +
                  num(ch.first_position) + ", " + num(ch.first_position + ch.rows) + "), " +
                  short_name(ch.name) + "...";
  if (!m.thin) s += ", bytes [" + num(ch.offset) + ", " + num(ch.offset + ch.byte_length) + ")";
  return s + ")";
}

Status check_file_size(const PackSource& src, const Manifest& m) {
  const std::int64_t size = src.size();
  if (m.thin) {
    if (size != m.payload_offset)
      return corruption(src.name() + ": payload: a thin pack ends at byte " + num(m.payload_offset) +
                        "; this file has " + num(size - m.payload_offset) + " more bytes");
    return Status::Ok();
  }
  const std::int64_t end = m.payload_offset + m.payload_bytes;
  if (size < end) {
    for (std::size_t i = 0; i < m.chunks.size(); ++i)
      if (m.chunks[i].offset + m.chunks[i].byte_length > size)
        return corruption(chunk_where(src, m, static_cast<std::int64_t>(i)) +
                          ": truncated: the file ends at byte " + num(size));
  }
  if (size > end)
    return corruption(src.name() + ": payload: " + num(size - end) +
                      " trailing bytes after the last chunk (which ends at byte " + num(end) + ")");
  return Status::Ok();
}

Status check_name(const PackSource& src, const Manifest& m, std::int64_t i, const Digest& got) {
  const PackChunk& ch = m.chunks[static_cast<std::size_t>(i)];
  if (!kCheckDigests || got == ch.name) return Status::Ok();
  return corruption(chunk_where(src, m, i) + ": its bytes hash to " + short_name(got) +
                    "..., not to its name " + to_hex(ch.name));
}

// Bytes of whole-chunk buffers that one read or verify holds at once
// across its threads; a chunk larger than this is read alone.
constexpr std::int64_t kChunkBufferBudget = std::int64_t{256} << 20;

// A count of bytes held by threads at once, at most `limit` unless one
// holder alone exceeds it.
class ByteBudget {
 public:
  explicit ByteBudget(std::int64_t limit) : limit_(limit) {}
  void take(std::int64_t n) {
    std::unique_lock<std::mutex> lock(mutex_);
    freed_.wait(lock, [&] { return held_ == 0 || held_ + n <= limit_; });
    held_ += n;
  }
  void give(std::int64_t n) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      held_ -= n;
    }
    freed_.notify_all();
  }

 private:
  const std::int64_t limit_;
  std::int64_t held_ = 0;
  std::mutex mutex_;
  std::condition_variable freed_;
};

// What names a thin pack's chunk in its store: its name and its length.
std::pair<Digest, std::int64_t> chunk_key(const Manifest& m, std::int64_t i) {
  const PackChunk& c = m.chunks[static_cast<std::size_t>(i)];
  return {c.name, c.byte_length};
}

// For each chunk record of [c0, c1), the first record of that range in
// table order that names the same chunk (name and length): a store is
// asked about each chunk once.
std::vector<std::int64_t> first_of_each_chunk(const Manifest& m, std::int64_t c0, std::int64_t c1) {
  std::vector<std::int64_t> order(static_cast<std::size_t>(c1 - c0));
  for (std::size_t j = 0; j < order.size(); ++j) order[j] = c0 + static_cast<std::int64_t>(j);
  const auto key = [&](std::int64_t i) { return chunk_key(m, i); };
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) { return key(a) < key(b); });
  std::vector<std::int64_t> first(order.size());
  for (std::size_t k = 0; k < order.size(); ++k)
    first[static_cast<std::size_t>(order[k] - c0)] = k > 0 && key(order[k]) == key(order[k - 1])
                                                         ? first[static_cast<std::size_t>(order[k - 1] - c0)]
                                                         : order[k];
  return first;
}

// A chunk's bytes decoded as record i's rows, K then V, in its plane's
// encoding, at k and v.
void decode_chunk(const Manifest& m, std::int64_t i, const std::uint8_t* bytes, std::uint16_t* k,
                  std::uint16_t* v) {
  const PackChunk& ch = m.chunks[static_cast<std::size_t>(i)];
  const Encoding enc = m.planes[static_cast<std::size_t>(ch.layer)].encoding;
  const std::int64_t half = ch.byte_length / 2;
  const std::int64_t values = half / element_size(enc);
  decode_values(enc, bytes, values, k);
  decode_values(enc, bytes + half, values, v);
}

// Reads and verifies chunk i. With k and v (where the chunk's first K and
// V rows go), decodes it there (F16Le from a file on a little-endian host
// straight into place); other chunks go through a buffer of their size,
// held within `budget`. A thin chunk's verified bytes are handed to `also`
// too, where given.
Status read_chunk(const PackSource& src, const Manifest& m, const ChunkStore* store,
                  std::int64_t i, std::uint16_t* k, std::uint16_t* v, ByteBudget& budget,
                  const std::function<void(const std::uint8_t*)>& also = nullptr) {
  const PackChunk& ch = m.chunks[static_cast<std::size_t>(i)];
  const Encoding enc = m.planes[static_cast<std::size_t>(ch.layer)].encoding;
  const std::int64_t half = ch.byte_length / 2;
  const bool out = k != nullptr;
  auto wrap = [&](const Status& s) -> Status {
    if (s.ok()) return s;
    Error e = s.error();
    e.message = chunk_where(src, m, i) + ": " + e.message;
    return e;
  };
  if (out && !m.thin && enc == Encoding::kF16Le && kHostLittleEndian) {
    KVRING_RETURN_IF_ERROR(wrap(src.read_at(ch.offset, half, reinterpret_cast<std::uint8_t*>(k))));
    KVRING_RETURN_IF_ERROR(wrap(src.read_at(ch.offset + half, half, reinterpret_cast<std::uint8_t*>(v))));
    Sha256 h;
    h.update(k, static_cast<std::size_t>(half));
    h.update(v, static_cast<std::size_t>(half));
    return check_name(src, m, i, h.finish());
  }
  budget.take(ch.byte_length);
  struct Give {
    ByteBudget& b;
    std::int64_t n;
    ~Give() { b.give(n); }
  } give{budget, ch.byte_length};
  std::vector<std::uint8_t> bytes;
  try {
    bytes.resize(static_cast<std::size_t>(ch.byte_length));
  } catch (const std::bad_alloc&) {
    return make_error(ErrorCode::kIOError, chunk_where(src, m, i) + ": out of memory");
  }
  if (m.thin) {
    // The store verifies the name itself.
    KVRING_RETURN_IF_ERROR(wrap(store->get(ch.name, bytes)));
    if (also) also(bytes.data());
  } else {
    KVRING_RETURN_IF_ERROR(wrap(src.read_at(ch.offset, ch.byte_length, bytes.data())));
    KVRING_RETURN_IF_ERROR(check_name(src, m, i, sha256(bytes.data(), bytes.size())));
  }
  if (out) decode_chunk(m, i, bytes.data(), k, v);
  return Status::Ok();
}

// Reads and verifies records [c0, c1) of the chunk table on all cores,
// decoding record i's rows at dest(i) (a pair of K and V pointers). A thin
// pack's chunk that several of them name (the same name and length) is
// fetched and verified once, at the first of them, and decoded into each.
// The first failure in table order is returned.
template <class Dest>
Status read_records(const PackSource& src, const Manifest& m, const ChunkStore* store, std::int64_t c0,
                    std::int64_t c1, const Dest& dest, ByteBudget& budget) {
  std::int64_t bytes = 0;
  for (std::int64_t i = c0; i < c1; ++i) bytes += m.chunks[static_cast<std::size_t>(i)].byte_length;
  // A task a chunk, at its first record, in table order; next[i - c0] is
  // the next record that names record i's chunk (-1: none).
  const std::vector<std::int64_t> first = m.thin ? first_of_each_chunk(m, c0, c1) : std::vector<std::int64_t>();
  std::vector<std::int64_t> tasks, next(static_cast<std::size_t>(c1 - c0), -1), last(next.size());
  for (std::int64_t i = c0; i < c1; ++i) {
    const std::int64_t f = m.thin ? first[static_cast<std::size_t>(i - c0)] : i;
    if (f == i) tasks.push_back(i);
    else next[static_cast<std::size_t>(last[static_cast<std::size_t>(f - c0)] - c0)] = i;
    last[static_cast<std::size_t>(f - c0)] = i;
  }
  std::vector<Status> status(tasks.size());
  cpu::parallel_for(static_cast<std::int64_t>(tasks.size()), bytes, [&](std::int64_t t) {
    const std::int64_t i = tasks[static_cast<std::size_t>(t)];
    const auto [k, v] = dest(i);
    const auto decode_others = [&](const std::uint8_t* chunk) {
      for (std::int64_t j = next[static_cast<std::size_t>(i - c0)]; j >= 0;
           j = next[static_cast<std::size_t>(j - c0)]) {
        const auto [jk, jv] = dest(j);
        decode_chunk(m, j, chunk, jk, jv);
      }
    };
    status[static_cast<std::size_t>(t)] = read_chunk(src, m, store, i, k, v, budget, decode_others);
  });
  return first_error(status);
}

Status with_chunk(const PackSource& src, const Manifest& m, std::int64_t i, const Status& s) {
  if (s.ok()) return s;
  Error e = s.error();
  e.message = chunk_where(src, m, i) + ": " + e.message;
  return e;
}

// Verifies chunk i of a self-contained pack in bounded pieces, whatever
// its byte_length claims.
Status verify_streamed(const PackSource& src, const Manifest& m, std::int64_t i) {
  const PackChunk& ch = m.chunks[static_cast<std::size_t>(i)];
  auto got = sha256_in_pieces(ch.byte_length, [&](std::int64_t at, std::int64_t n, std::uint8_t* dst) {
    return with_chunk(src, m, i, src.read_at(ch.offset + at, n, dst));
  });
  if (!got) return got.error();
  return check_name(src, m, i, *got);
}

// The verdicts of chunks checked in parallel: which failed, a byte each,
// and the failure of the lowest index, kept whole. Other failures' messages
// are dropped as they come, so memory follows the chunk count alone, however
// many chunks fail.
class Verdicts {
 public:
  explicit Verdicts(std::size_t n) : bad_(n, 0) {}
  void put(std::int64_t i, Status s) {
    if (s.ok()) return;
    bad_[static_cast<std::size_t>(i)] = 1;
    const std::lock_guard<std::mutex> lock(mu_);
    if (i < first_.load(std::memory_order_relaxed)) {
      first_.store(i, std::memory_order_relaxed);
      error_ = std::move(s);
    }
  }
  bool bad(std::int64_t i) const { return bad_[static_cast<std::size_t>(i)] != 0; }
  // The lowest index that failed so far (read while others put).
  std::int64_t first_bad() const { return first_.load(std::memory_order_relaxed); }
  const Status& first_error() const { return error_; }

 private:
  std::vector<char> bad_;
  std::mutex mu_;
  std::atomic<std::int64_t> first_{std::numeric_limits<std::int64_t>::max()};
  Status error_ = Status::Ok();
};

// Verifies chunk i of a self-contained pack (verify_streamed), unless its
// bytes lie wholly in a hole of the file: that chunk is marked in `hole`
// instead, for check_holes, and nothing of it is read. Only a source that
// stores fewer bytes than its size is asked where its holes are.
Status verify_unless_hole(const PackSource& src, const Manifest& m, std::int64_t i, std::vector<char>& hole) {
  const PackChunk& ch = m.chunks[static_cast<std::size_t>(i)];
  if (src.stored_bytes() < src.size() && src.in_hole(ch.offset, ch.byte_length)) {
    hole[static_cast<std::size_t>(i)] = 1;
    return Status::Ok();
  }
  return verify_streamed(src, m, i);
}

// Gives each chunk i of a self-contained pack marked in `hole` the verdict
// reading it gives, as verdict i: its bytes read as byte_length zeros, so
// they hash to the SHA-256 of that many zero bytes, and check_name compares
// that with its name. One pass over zeros as long as the longest of these
// chunks hashes every distinct length (sha256_of_zeros); no chunk is
// longer than kMaxChunkBytes, as parse_cache holds chunk_tokens to
// max_chunk_tokens and parse_chunks each byte_length to its rows.
void check_holes(const PackSource& src, const Manifest& m, const std::vector<char>& hole, Verdicts& verdicts) {
  std::vector<std::int64_t> lengths;
  for (std::size_t i = 0; i < hole.size(); ++i)
    if (hole[i]) lengths.push_back(m.chunks[i].byte_length);
  std::sort(lengths.begin(), lengths.end());
  lengths.erase(std::unique(lengths.begin(), lengths.end()), lengths.end());
  const std::vector<Digest> zeros = sha256_of_zeros(lengths);
  // The verdicts on all cores, a message's work a chunk at most.
  const auto n = static_cast<std::int64_t>(hole.size());
  cpu::parallel_for(n, n * 1024, [&](std::int64_t i) {
    const auto c = static_cast<std::size_t>(i);
    if (!hole[c]) return;
    const auto at = std::lower_bound(lengths.begin(), lengths.end(), m.chunks[c].byte_length) - lengths.begin();
    verdicts.put(i, check_name(src, m, i, zeros[static_cast<std::size_t>(at)]));
  });
}

// Chunk i of a thin pack is in the store with the size the pack gives it
// (kNotFound or kCorruption, naming the chunk and the store, otherwise).
// Nothing is read or allocated for it.
Status check_present(const PackSource& src, const Manifest& m, const ChunkStore& store, std::int64_t i) {
  const PackChunk& ch = m.chunks[static_cast<std::size_t>(i)];
  return with_chunk(src, m, i, store.check_stored(ch.name, ch.byte_length));
}

// What must hold before a pack's rows are allocated: every chunk of a thin
// pack present in its store with its size; every chunk of a self-contained pack verified
// when the file holds fewer bytes than it claims (st_blocks below st_size).
// Returns the first failure in table order.
//
// Each distinct chunk of a thin pack is asked about once (a pack may name
// one chunk many times, and a store hashes a file with holes whole), and
// once a chunk fails, the chunks after it in table order are not checked:
// the error is the first in table order all the same, and a pack that
// names one planted chunk a million times costs one check, not a million.
Status check_before_rows(const PackSource& src, const Manifest& m, const ChunkStore* store) {
  const bool sparse = src.stored_bytes() < src.size();
  if (!m.thin && !sparse) return Status::Ok();
  // The records to check: for a thin pack the first record of each
  // distinct (name, length), in table order.
  std::vector<std::int64_t> todo;
  todo.reserve(m.chunks.size());
  const auto n = static_cast<std::int64_t>(m.chunks.size());
  const std::vector<std::int64_t> first = m.thin ? first_of_each_chunk(m, 0, n) : std::vector<std::int64_t>();
  for (std::size_t i = 0; i < m.chunks.size(); ++i)
    if (!m.thin || first[i] == static_cast<std::int64_t>(i)) todo.push_back(static_cast<std::int64_t>(i));
  Verdicts verdicts(todo.size());
  // A self-contained pack's every chunk is a task (t is i); those wholly
  // in holes are checked after the others, together (check_holes).
  std::vector<char> hole(m.thin ? 0 : m.chunks.size(), 0);
  cpu::parallel_for(static_cast<std::int64_t>(todo.size()), m.payload_bytes, [&](std::int64_t t) {
    // Tasks before the first failure so far still run, so the failure
    // reported is the first in table order.
    if (t > verdicts.first_bad()) return;
    const std::int64_t i = todo[static_cast<std::size_t>(t)];
    verdicts.put(t, m.thin ? check_present(src, m, *store, i) : verify_unless_hole(src, m, i, hole));
  });
  if (!m.thin) check_holes(src, m, hole, verdicts);
  return verdicts.first_error();
}

Status need_store(const PackSource& src, const Manifest& m, const ChunkStore* store) {
  if (m.thin && store == nullptr)
    return invalid_argument(src.name() + " is a thin pack: its " + num(static_cast<std::int64_t>(m.chunks.size())) +
                            " chunks live in a chunk store; name the store (ReadOptions::store; on the "
                            "command line --store dir:PATH or --store redis://HOST:PORT)");
  return Status::Ok();
}

// The most bytes of rows a read may hold: the smaller of
// ReadOptions::max_row_bytes and the memory this process may use.
std::int64_t row_memory_limit(const ReadOptions& options) {
  return std::min(options.max_row_bytes, file_internal::memory_limit_bytes());
}

Status check_row_memory(const PackSource& src, const ReadOptions& options, std::int64_t need,
                        const std::string& what) {
  const std::int64_t limit = row_memory_limit(options);
  if (need > limit)
    return make_error(ErrorCode::kCapacityExceeded,
                      src.name() + ": " + what + num(need) + " bytes of memory, over the limit of " + num(limit));
  return Status::Ok();
}

// Reads every chunk into `s`, whose row buffers are reused where they exist.
Status read_rows(const PackSource& src, const Manifest& m, const ReadOptions& options, Snapshot& s) {
  KVRING_RETURN_IF_ERROR(need_store(src, m, options.store));
  s.config = m.header.config;
  s.context = m.header.context;
  s.token_count = m.header.token_count;
  s.token_ids = m.header.token_ids;
  s.metadata = m.header.metadata;
  s.planes.resize(m.header.planes.size());
  for (std::size_t l = 0; l < s.planes.size(); ++l) {
    s.planes[l].kind = m.header.planes[l].kind;
    s.planes[l].layout = m.header.planes[l].layout;
    s.planes[l].ring = m.header.planes[l].ring;
  }
  // The rows are sized by checked fields (geometry, rings, file size for a
  // self-contained pack), held against memory first (the manifest alone
  // says what they need, so a pack over the limit costs no chunk check),
  // then by chunks known to exist.
  KVRING_RETURN_IF_ERROR(check_row_memory(src, options, s.row_bytes(), "the pack's rows need "));
  KVRING_RETURN_IF_ERROR(check_before_rows(src, m, options.store));
  try {
    for (PlaneSnapshot& p : s.planes) {
      p.k.resize(static_cast<std::size_t>(p.ring.len() * s.config.kv_dim()));
      p.v.resize(p.k.size());
    }
  } catch (const std::bad_alloc&) {
    return make_error(ErrorCode::kIOError, src.name() + ": out of memory for " + num(s.row_bytes()) + " bytes of rows");
  }
  ByteBudget budget(kChunkBufferBudget);
  const std::int64_t kv_dim = s.config.kv_dim();
  const auto dest = [&](std::int64_t i) {
    const PackChunk& ch = m.chunks[static_cast<std::size_t>(i)];
    PlaneSnapshot& p = s.planes[static_cast<std::size_t>(ch.layer)];
    const std::int64_t first = (ch.first_position - p.ring.origin_logical()) * kv_dim;
    return std::pair(p.k.data() + first, p.v.data() + first);
  };
  return read_records(src, m, options.store, 0, static_cast<std::int64_t>(m.chunks.size()), dest, budget);
}

// Reads the pack's planes a group at a time (group_planes) into buffers
// reused for each group, verifies every chunk of the group, and installs
// the group's planes into `seq`, a detached sequence of `target` that holds
// no plane yet, each plane at the ring restore_ring gives it: the last of
// its rows the target's plane holds. The first error stops it; the caller
// removes the sequence.
Status install_in_groups(const PackSource& src, const Manifest& m, const ReadOptions& options,
                         const PlaneGroups& groups, const std::vector<RingState>& rings, KvStore& target,
                         SeqId seq) {
  const Snapshot& header = m.header;
  const std::int64_t kv_dim = header.config.kv_dim();
  std::vector<std::uint16_t> k, v;
  try {
    k.resize(static_cast<std::size_t>(groups.most * kv_dim));
    v.resize(k.size());
  } catch (const std::bad_alloc&) {
    return make_error(ErrorCode::kIOError, src.name() + ": out of memory for " + num(groups.most) +
                                               " rows of the pack's planes");
  }
  ByteBudget budget(kChunkBufferBudget);
  const auto n_layers = static_cast<std::int64_t>(header.planes.size());
  for (std::int64_t first = 0, end = 0; first < n_layers; first = end) {
    end = groups.end[static_cast<std::size_t>(first)];
    // A plane's chunks are consecutive in the table, in layer order.
    const std::int64_t c0 = m.planes[static_cast<std::size_t>(first)].first_chunk;
    const PackPlane& last = m.planes[static_cast<std::size_t>(end - 1)];
    const std::int64_t c1 = last.first_chunk + last.n_chunks;
    const auto dest = [&](std::int64_t i) {
      const PackChunk& ch = m.chunks[static_cast<std::size_t>(i)];
      const RingState& r = header.planes[static_cast<std::size_t>(ch.layer)].ring;
      const std::int64_t at =
          (groups.offset[static_cast<std::size_t>(ch.layer)] + ch.first_position - r.origin_logical()) * kv_dim;
      return std::pair(k.data() + at, v.data() + at);
    };
    KVRING_RETURN_IF_ERROR(read_records(src, m, options.store, c0, c1, dest, budget));
    for (std::int64_t l = first; l < end; ++l) {
      const RingState& ring = rings[static_cast<std::size_t>(l)];
      // The plane's first rows that the target's ring does not hold.
      const std::int64_t skip = header.planes[static_cast<std::size_t>(l)].ring.len() - ring.len();
      const std::int64_t at = (groups.offset[static_cast<std::size_t>(l)] + skip) * kv_dim;
      if (Status st = target.install(seq, l, ring, k.data() + at, v.data() + at); !st.ok()) {
        Error e = st.error();
        e.message = src.name() + ": layer " + num(l) + ": " + e.message;
        return e;
      }
    }
  }
  return target.attach_sequence(seq);
}

}  // namespace

Result<std::unique_ptr<PackSource>> open_pack_file(const std::string& path) {
  auto f = file_internal::open_regular_file(path, "pack");
  if (!f) return f.error();
  return std::unique_ptr<PackSource>(new FileSource(path, f->fd, f->size, f->stored));
}

std::unique_ptr<PackSource> memory_pack_source(const void* data, std::int64_t size, std::string name) {
  return std::make_unique<MemorySource>(data, size, std::move(name));
}

// For a preamble whose version or flags this build does not know: the
// flags under which it is a pack of this version with those fields damaged,
// if any. That is, the preamble and manifest hash to their recorded digest
// once the version reads kPackVersion and the flags one of the values this
// version defines. A pack of a newer version (or with a new flag) records
// the digest of its own bytes, which these edited bytes cannot match, so no
// unknown format is ever read as this one.
std::optional<std::uint16_t> damaged_known_preamble(const PackSource& src, const std::uint8_t* pre) {
  if (!kCheckDigests) return std::nullopt;
  const std::uint32_t manifest_len = coding::decode_fixed32(pre + 12);
  if (manifest_len > kMaxManifestBytes) return std::nullopt;
  const std::int64_t digest_at = kPreambleBytes + std::int64_t{manifest_len};
  if (src.size() < digest_at + kDigestBytes) return std::nullopt;
  std::vector<std::uint8_t> head(static_cast<std::size_t>(digest_at + kDigestBytes));
  if (!src.read_at(0, static_cast<std::int64_t>(head.size()), head.data()).ok()) return std::nullopt;
  coding::encode_fixed16(head.data() + 8, kPackVersion);
  for (const std::uint16_t flags : {std::uint16_t{0}, kFlagThin}) {
    coding::encode_fixed16(head.data() + 10, flags);
    const Digest d = sha256(head.data(), static_cast<std::size_t>(digest_at));
    if (std::memcmp(d.data(), head.data() + digest_at, kDigestBytes) == 0) return flags;
  }
  return std::nullopt;
}

Result<Manifest> read_manifest(const PackSource& src) {
  const std::string& name = src.name();
  const std::int64_t size = src.size();
  if (size < 0)
    return make_error(ErrorCode::kInvalidArgument, name + ": a source of " + num(size) + " bytes");
  if (size < kPreambleBytes)
    return corruption(name + ": preamble: truncated: the file has " + num(size) +
                      " bytes, a pack starts with a " + num(kPreambleBytes) + "-byte preamble");
  std::uint8_t pre[kPreambleBytes];
  KVRING_RETURN_IF_ERROR(src.read_at(0, kPreambleBytes, pre));
  if (std::memcmp(pre, kPackMagic, sizeof kPackMagic) != 0)
    return corruption(name + ": preamble: magic at byte 0: " + to_hex(pre, 8) +
                      " is not the kvpack magic " + to_hex(kPackMagic, 8) + " (not a kvpack file)");
  Manifest m;
  m.version = coding::decode_fixed16(pre + 8);
  if (m.version == 0) return corruption(name + ": preamble: version at byte 8: 0 is not a kvpack version");
  const std::uint16_t flags = coding::decode_fixed16(pre + 10);
  if (m.version > kPackVersion || (flags & ~kFlagThin) != 0)
    if (const auto known = damaged_known_preamble(src, pre))
      return corruption(name + ": preamble: version " + num(std::uint64_t{m.version}) + " at byte 8, flags 0x" +
                        to_hex(be16(flags).data(), 2) + " at byte 10: damaged: the preamble and manifest match " +
                        "their digest as version " + num(std::uint64_t{kPackVersion}) + " with flags 0x" +
                        to_hex(be16(*known).data(), 2));
  if (m.version > kPackVersion)
    return make_error(ErrorCode::kUnsupported,
                      name + ": preamble: version at byte 8: pack version " + num(std::uint64_t{m.version}) +
                          " is newer than this build reads (" + num(std::uint64_t{kPackVersion}) + ")");
  if ((flags & ~kFlagThin) != 0)
    return make_error(ErrorCode::kUnsupported, name + ": preamble: flags at byte 10: 0x" + to_hex(be16(flags).data(), 2) +
                                                   " has bits this build does not know");
  m.thin = (flags & kFlagThin) != 0;
  const std::uint32_t manifest_len = coding::decode_fixed32(pre + 12);
  if (manifest_len > kMaxManifestBytes)
    return corruption(name + ": preamble: manifest_len at byte 12: " + num(std::uint64_t{manifest_len}) +
                      " exceeds the format's limit of " + num(kMaxManifestBytes));
  m.manifest_bytes = manifest_len;
  m.payload_offset = kPreambleBytes + m.manifest_bytes + kDigestBytes;
  if (size < m.payload_offset)
    return corruption(name + ": manifest: truncated: the preamble announces a " + num(m.manifest_bytes) +
                      "-byte manifest and its digest, through byte " + num(m.payload_offset) +
                      "; the file has " + num(size) + " bytes");
  std::vector<std::uint8_t> head(static_cast<std::size_t>(m.payload_offset));
  KVRING_RETURN_IF_ERROR(src.read_at(0, m.payload_offset, head.data()));
  const std::int64_t digest_at = kPreambleBytes + m.manifest_bytes;
  m.digest = sha256(head.data(), static_cast<std::size_t>(digest_at));
  if (kCheckDigests && std::memcmp(m.digest.data(), head.data() + digest_at, kDigestBytes) != 0)
    return corruption(name + ": manifest digest at byte " + num(digest_at) + ": bytes [0, " + num(digest_at) +
                      ") hash to " + short_name(m.digest) + "..., the pack records " +
                      to_hex(head.data() + digest_at, 8) + "...: the preamble or manifest is damaged");

  Cursor c(name, head.data() + kPreambleBytes, head.data() + digest_at, kPreambleBytes);
  KVRING_RETURN_IF_ERROR(parse_geometry(c, &m.header.config));
  KVRING_RETURN_IF_ERROR(parse_cache(c, &m));
  std::int64_t total_chunks = 0;
  KVRING_RETURN_IF_ERROR(parse_planes(c, &m, &total_chunks));
  KVRING_RETURN_IF_ERROR(parse_chunks(c, &m, total_chunks));
  KVRING_RETURN_IF_ERROR(check_file_size(src, m));
  return m;
}

Result<Snapshot> read_pack(const PackSource& source, const ReadOptions& options) {
  Snapshot s;
  KVRING_RETURN_IF_ERROR(read_pack(source, options, s));
  return s;
}

Status read_pack(const PackSource& source, const ReadOptions& options, Snapshot& out) {
  auto m = read_manifest(source);
  Status s = m ? read_rows(source, *m, options, out) : Status(m.error());
  if (!s.ok()) invalidate_snapshot(out);
  return s;
}

Result<Snapshot> read_pack_file(const std::string& path, const ReadOptions& options) {
  auto src = open_pack_file(path);
  if (!src) return src.error();
  return read_pack(**src, options);
}

Status restore_pack(const PackSource& source, const ReadOptions& options, KvCache& target,
                    Manifest* manifest) {
  auto m = read_manifest(source);
  if (!m) return m.error();
  // Another model's pack, or one whose full planes the pool cannot hold,
  // is refused before any payload is read.
  if (Status s = check_restorable(m->header, target.store(), target.seq()); !s.ok()) {
    Error e = s.error();
    e.message = source.name() + ": " + e.message;
    return e;
  }
  Snapshot snapshot;
  KVRING_RETURN_IF_ERROR(read_rows(source, *m, options, snapshot));
  KVRING_RETURN_IF_ERROR(restore(snapshot, target));
  if (manifest) *manifest = std::move(*m);
  return Status::Ok();
}

Result<SeqId> restore_pack(const PackSource& source, const ReadOptions& options, KvStore& target,
                           Manifest* manifest) {
  return pack_internal::restore_pack_in_groups(source, options, target, manifest, pack_internal::kStoreGroupBytes);
}

Result<SeqId> pack_internal::restore_pack_in_groups(const PackSource& source, const ReadOptions& options,
                                                    KvStore& target, Manifest* manifest, std::int64_t group_bytes) {
  auto m = read_manifest(source);
  if (!m) return m.error();
  auto named = [&](Error e) {
    e.message = source.name() + ": " + e.message;
    return e;
  };
  // Refusals that the header decides come before any payload is read, and
  // before the store is touched.
  if (Status s = check_restorable_as_new(m->header, target); !s.ok()) return named(s.error());
  std::vector<RingState> rings;
  rings.reserve(m->header.planes.size());
  for (std::int64_t l = 0; l < target.n_layers(); ++l) {
    auto ring = restore_ring(m->header, l, target);
    if (!ring) return named(ring.error());
    rings.push_back(*ring);
  }
  KVRING_RETURN_IF_ERROR(need_store(source, *m, options.store));
  // A row limit under the group size makes the groups smaller: only a
  // plane longer than the limit is refused.
  const PlaneGroups groups = group_planes(m->header, std::min(group_bytes, row_memory_limit(options)));
  KVRING_RETURN_IF_ERROR(check_row_memory(source, options, groups.most * m->header.config.kv_dim() * 2 * 2,
                                          "the pack's rows, a group of planes at a time, need "));
  KVRING_RETURN_IF_ERROR(check_before_rows(source, *m, options.store));
  // The rows go into a detached sequence, which no reader sees, and it
  // becomes live only once every plane is in; any error, or an exception
  // on the way, removes it.
  auto seq = target.add_detached_sequence();
  if (!seq) return named(seq.error());
  struct RemoveUnlessLive {
    KvStore& store;
    SeqId seq;
    bool live = false;
    // Its handle never left; freeing its blocks may itself run out of
    // memory, which a destructor must not throw.
    ~RemoveUnlessLive() {
      if (live) return;
      try {
        (void)KvStoreAccess::discard(store, seq);
      } catch (...) {
      }
    }
  } guard{target, *seq};
  try {
    KVRING_RETURN_IF_ERROR(install_in_groups(source, *m, options, groups, rings, target, *seq));
  } catch (const std::bad_alloc&) {
    return make_error(ErrorCode::kIOError, source.name() + ": out of memory while restoring the pack's planes");
  }
  guard.live = true;
  if (manifest) *manifest = std::move(*m);
  return *seq;
}

Status check_pack_backed(const PackSource& source, const ReadOptions& options) {
  auto m = read_manifest(source);
  if (!m) return m.error();
  KVRING_RETURN_IF_ERROR(need_store(source, *m, options.store));
  return check_before_rows(source, *m, options.store);
}

Result<VerifyReport> verify_pack(const PackSource& source, const ChunkStore* store) {
  auto m = read_manifest(source);
  if (!m) return m.error();
  KVRING_RETURN_IF_ERROR(need_store(source, *m, store));
  // A chunk is read whole only from a store that holds it; a pack's own
  // chunks are hashed in bounded pieces.
  // A thin pack's chunk named by several records is checked once, at its
  // first record, and each record counts its verdict.
  // A self-contained pack's chunks that lie wholly in holes of the file
  // are checked after the others, together (check_holes): its time follows
  // the chunks the file holds data for, not the size it claims.
  // The first failing record in table order is the first record of its
  // chunk, so the lowest failing index is the first error either way.
  const auto n = static_cast<std::int64_t>(m->chunks.size());
  Verdicts verdicts(m->chunks.size());
  const std::vector<std::int64_t> first = m->thin ? first_of_each_chunk(*m, 0, n) : std::vector<std::int64_t>();
  std::vector<char> hole(m->thin ? 0 : m->chunks.size(), 0);
  ByteBudget budget(kChunkBufferBudget);
  cpu::parallel_for(n, m->payload_bytes, [&](std::int64_t i) {
    if (!m->thin) {
      verdicts.put(i, verify_unless_hole(source, *m, i, hole));
      return;
    }
    if (first[static_cast<std::size_t>(i)] != i) return;
    Status s = check_present(source, *m, *store, i);
    if (s.ok()) s = read_chunk(source, *m, store, i, nullptr, nullptr, budget);
    verdicts.put(i, std::move(s));
  });
  if (!m->thin) check_holes(source, *m, hole, verdicts);
  VerifyReport r;
  r.thin = m->thin;
  r.chunks = n;
  r.bytes = m->payload_bytes;
  for (std::int64_t i = 0; i < n; ++i)
    r.bad_chunks += verdicts.bad(m->thin ? first[static_cast<std::size_t>(i)] : i) ? 1 : 0;
  r.first_error = verdicts.first_error();
  return r;
}

}  // namespace kvring
