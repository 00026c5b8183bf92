// The kvpack writer: validate the snapshot, cut and hash the chunks on all
// cores, build the manifest, then hand the bytes to a sink (a buffer, an
// atomically written file, a chunk store plus a manifest file). The rows
// come from a snapshot or, a group of planes at a time, from a store's
// sequence.
#include <algorithm>
#include <limits>
#include <new>

#include "coding.h"
#include "cpu/parallel.h"
#include "file_io.h"
#include "kvring/cache.h"
#include "kvring/pack.h"
#include "kvring/store.h"
#include "pack_common.h"

namespace kvring {

namespace {

using namespace pack_internal;

struct PlannedChunk {
  std::int64_t layer = 0;
  ChunkRange range;
  std::int64_t row = 0;  // of its first row in the plane's live rows
  std::int64_t byte_length = 0;
  std::int64_t offset = 0;  // in a self-contained pack
  ChunkData data;           // name and bytes
};

struct WritePlan {
  std::vector<PlannedChunk> chunks;
  // Layer l's chunks are chunks[first_chunk[l], first_chunk[l + 1]), its
  // payload bytes [first_byte[l], first_byte[l + 1]).
  std::vector<std::size_t> first_chunk;
  std::vector<std::int64_t> first_byte;
  // Chunk bytes that are not views of the rows (F32Le, or any encoding on
  // a big-endian host), one group of layers at a time (RowSource).
  std::vector<std::uint8_t> encoded;
  bool views = false;
  std::int64_t payload_bytes = 0;
};

// Where a pack's rows come from: a snapshot's buffers, all resident, or a
// store's sequence, a group of consecutive planes at a time into buffers
// reused for each.
class RowSource {
 public:
  virtual ~RowSource() = default;
  // The layers [first, group_end(first)) are readable together after one
  // load(first); views of their rows last until the next load.
  virtual std::int64_t group_end(std::int64_t first) const = 0;
  virtual Status load(std::int64_t first) = 0;
  virtual const std::uint16_t* k(std::int64_t layer) const = 0;
  virtual const std::uint16_t* v(std::int64_t layer) const = 0;
};

class SnapshotRows final : public RowSource {
 public:
  explicit SnapshotRows(const Snapshot& s) : s_(s) {}
  std::int64_t group_end(std::int64_t) const override {
    return static_cast<std::int64_t>(s_.planes.size());
  }
  Status load(std::int64_t) override { return Status::Ok(); }
  const std::uint16_t* k(std::int64_t layer) const override { return plane(layer).k.data(); }
  const std::uint16_t* v(std::int64_t layer) const override { return plane(layer).v.data(); }

 private:
  const PlaneSnapshot& plane(std::int64_t layer) const {
    return s_.planes[static_cast<std::size_t>(layer)];
  }
  const Snapshot& s_;
};

// Consecutive planes' rows in host memory, a group at a time
// (pack_internal::group_planes), so a save holds that much however long the
// sequence, and a short sequence is read, hashed and (thin) put in one
// group.
class StoreRows final : public RowSource {
 public:
  StoreRows(const KvStore& store, SeqId seq, const Snapshot& header, std::int64_t group_bytes)
      : store_(store), seq_(seq), header_(header), groups_(pack_internal::group_planes(header, group_bytes)) {}
  // Sizes the buffers for the largest group, before anything is written.
  Status reserve() {
    try {
      k_.resize(static_cast<std::size_t>(groups_.most * header_.config.kv_dim()));
      v_.resize(k_.size());
    } catch (const std::bad_alloc&) {
      return make_error(ErrorCode::kIOError, "out of host memory for " + std::to_string(groups_.most) +
                                                 " rows of a sequence's planes");
    }
    return Status::Ok();
  }
  std::int64_t group_end(std::int64_t first) const override {
    return groups_.end[static_cast<std::size_t>(first)];
  }
  // `first` starts a group; its planes lie one after another in the buffers.
  Status load(std::int64_t first) override {
    loaded_ = -1;
    for (std::int64_t l = first; l < group_end(first); ++l) {
      const RingState& r = header_.planes[static_cast<std::size_t>(l)].ring;
      const auto at = static_cast<std::size_t>(groups_.offset[static_cast<std::size_t>(l)] * header_.config.kv_dim());
      KVRING_RETURN_IF_ERROR(store_.read_rows(seq_, l, r.origin_logical(), r.len(), k_.data() + at, v_.data() + at));
    }
    loaded_ = first;
    return Status::Ok();
  }
  const std::uint16_t* k(std::int64_t layer) const override { return rows(k_, layer); }
  const std::uint16_t* v(std::int64_t layer) const override { return rows(v_, layer); }

 private:
  // Null for any layer outside the group loaded: never another plane's rows.
  const std::uint16_t* rows(const std::vector<std::uint16_t>& buffer, std::int64_t layer) const {
    if (loaded_ < 0 || layer < loaded_ || layer >= group_end(loaded_)) return nullptr;
    return buffer.data() + groups_.offset[static_cast<std::size_t>(layer)] * header_.config.kv_dim();
  }
  const KvStore& store_;
  SeqId seq_;
  const Snapshot& header_;
  const pack_internal::PlaneGroups groups_;
  std::int64_t loaded_ = -1;
  // Plain pages: the buffers are touched once a save and reused for every
  // group, where huge pages cost more to fault in than they save.
  std::vector<std::uint16_t> k_, v_;
};

// The manifest's bytes for this header and number of chunks, field by
// field as build_manifest writes them (docs/kvpack-format.md).
std::uint64_t manifest_bytes(const Snapshot& s, std::uint64_t chunks) {
  const std::uint64_t layers = s.config.layer_kinds.size();
  return 6 * 4 + layers + kDigestBytes +                // geometry, fingerprint
         4 + 4 + 8 +                                    // context, chunk_tokens, token_count
         8 + 4 * std::uint64_t{s.token_ids.size()} +    // token ids
         4 + std::uint64_t{s.metadata.size()} +         // metadata
         4 + s.planes.size() * kPlaneRecordBytes +      // plane table
         4 + chunks * kChunkRecordBytes;                // chunk table
}

// The number of chunks, after the options' refusals and the manifest's
// size, known from that number alone: a manifest past the format's limit
// is refused before a chunk table is built (which would take more memory
// than the manifest). The limit keeps the count far below the chunk
// table's 2^32.
Result<std::int64_t> check_options(const Snapshot& s, const WriteOptions& o) {
  if (o.encoding != Encoding::kF16Le && o.encoding != Encoding::kF32Le)
    return invalid_argument("unknown pack encoding " + std::to_string(static_cast<int>(o.encoding)));
  const std::int64_t max_tokens = max_chunk_tokens(s.config.kv_dim());
  if (o.chunk_tokens < 1 || o.chunk_tokens > max_tokens)
    return invalid_argument("chunk_tokens " + std::to_string(o.chunk_tokens) + " outside [1, " +
                            std::to_string(max_tokens) + "] for kv_dim " +
                            std::to_string(s.config.kv_dim()));
  if (s.token_count > kMaxTokenCount)
    return invalid_argument("token_count " + std::to_string(s.token_count) + " exceeds 2^62");
  std::int64_t chunks = 0;
  for (const PlaneSnapshot& p : s.planes)
    chunks += count_chunks(p.ring.origin_logical(), p.ring.len(), o.chunk_tokens);
  const std::uint64_t bytes = manifest_bytes(s, static_cast<std::uint64_t>(chunks));
  if (bytes > static_cast<std::uint64_t>(kMaxManifestBytes))
    return invalid_argument("the manifest would take " + std::to_string(bytes) + " bytes (" +
                            std::to_string(s.token_ids.size()) + " token ids, " +
                            std::to_string(s.metadata.size()) + " bytes of metadata, " +
                            std::to_string(chunks) + " chunks), over the format's " +
                            std::to_string(kMaxManifestBytes) +
                            "; raise chunk_tokens or shrink the metadata");
  return chunks;
}

std::string build_manifest(const Snapshot& s, const WriteOptions& o,
                           const std::vector<PlannedChunk>& chunks) {
  using namespace coding;
  const ModelConfig& c = s.config;
  std::string m;
  // geometry
  for (std::int64_t v : {c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.sliding_window,
                         c.max_context})
    put_fixed32(&m, static_cast<std::uint32_t>(v));
  for (LayerKind k : c.layer_kinds) put_fixed8(&m, static_cast<std::uint8_t>(k));
  const Digest fingerprint = c.fingerprint();
  put_bytes(&m, fingerprint.data(), fingerprint.size());
  // cache
  put_fixed32(&m, static_cast<std::uint32_t>(s.context));
  put_fixed32(&m, static_cast<std::uint32_t>(o.chunk_tokens));
  put_fixed64(&m, static_cast<std::uint64_t>(s.token_count));
  // tokens
  put_fixed64(&m, s.token_ids.size());
  for (std::int32_t id : s.token_ids) put_fixed32(&m, static_cast<std::uint32_t>(id));
  // metadata
  put_fixed32(&m, static_cast<std::uint32_t>(s.metadata.size()));
  put_bytes(&m, s.metadata.data(), s.metadata.size());
  // plane table
  put_fixed32(&m, static_cast<std::uint32_t>(s.planes.size()));
  for (std::size_t l = 0; l < s.planes.size(); ++l) {
    const PlaneSnapshot& p = s.planes[l];
    put_fixed32(&m, static_cast<std::uint32_t>(l));
    put_fixed8(&m, static_cast<std::uint8_t>(p.kind));
    put_fixed8(&m, static_cast<std::uint8_t>(p.layout));
    put_fixed8(&m, static_cast<std::uint8_t>(o.encoding));
    put_fixed32(&m, static_cast<std::uint32_t>(p.ring.capacity()));
    put_fixed32(&m, static_cast<std::uint32_t>(p.ring.len()));
    put_fixed64(&m, static_cast<std::uint64_t>(p.ring.origin_logical()));
    put_fixed32(&m, static_cast<std::uint32_t>(p.ring.origin_physical()));
    put_fixed32(&m, static_cast<std::uint32_t>(
                        count_chunks(p.ring.origin_logical(), p.ring.len(), o.chunk_tokens)));
  }
  // chunk table
  put_fixed32(&m, static_cast<std::uint32_t>(chunks.size()));
  for (const PlannedChunk& ch : chunks) {
    put_fixed64(&m, static_cast<std::uint64_t>(ch.range.first_position));
    put_fixed32(&m, static_cast<std::uint32_t>(ch.range.rows));
    put_fixed32(&m, static_cast<std::uint32_t>(ch.byte_length));
    put_bytes(&m, ch.data.name.data(), ch.data.name.size());
  }
  return m;
}

// Cuts a snapshot that validate_snapshot accepts (header-only: `rows`
// delivers the rows) into chunks and sizes everything; the chunks' bytes
// and names come later, from prepare_chunk, so that a file writer can hash
// and write each chunk in one pass.
Result<WritePlan> plan_pack(const Snapshot& s, const WriteOptions& o, const RowSource& rows) {
  auto count = check_options(s, o);
  if (!count) return count.error();
  const std::int64_t kv_dim = s.config.kv_dim();
  const auto n_layers = static_cast<std::int64_t>(s.planes.size());
  WritePlan plan;
  try {
    plan.chunks.reserve(static_cast<std::size_t>(*count));
    plan.first_chunk.reserve(static_cast<std::size_t>(n_layers + 1));
    plan.first_byte.reserve(static_cast<std::size_t>(n_layers + 1));
  } catch (const std::bad_alloc&) {
    return make_error(ErrorCode::kIOError, "out of host memory for a table of " + std::to_string(*count) +
                                               " chunks");
  }
  for (std::int64_t l = 0; l < n_layers; ++l) {
    plan.first_chunk.push_back(plan.chunks.size());
    plan.first_byte.push_back(plan.payload_bytes);
    const RingState& r = s.planes[static_cast<std::size_t>(l)].ring;
    const std::int64_t n = count_chunks(r.origin_logical(), r.len(), o.chunk_tokens);
    for (std::int64_t j = 0; j < n; ++j) {
      PlannedChunk ch;
      ch.layer = l;
      ch.range = chunk_range(r.origin_logical(), r.len(), o.chunk_tokens, j);
      ch.row = ch.range.first_position - r.origin_logical();
      ch.byte_length = chunk_byte_length(ch.range.rows, kv_dim, o.encoding);
      ch.offset = plan.payload_bytes;
      plan.payload_bytes += ch.byte_length;
      plan.chunks.push_back(ch);
    }
  }
  plan.first_chunk.push_back(plan.chunks.size());
  plan.first_byte.push_back(plan.payload_bytes);
  // F16Le chunks on a little-endian host are views of the rows: K rows then V
  // rows of one plane are two contiguous spans. Everything else is encoded,
  // into a buffer of the largest group's bytes.
  plan.views = o.encoding == Encoding::kF16Le && kHostLittleEndian;
  if (!plan.views) {
    std::int64_t most = 0;
    for (std::int64_t first = 0, end = 0; first < n_layers; first = end) {
      end = rows.group_end(first);
      most = std::max(most, plan.first_byte[static_cast<std::size_t>(end)] -
                                plan.first_byte[static_cast<std::size_t>(first)]);
    }
    try {
      plan.encoded.resize(static_cast<std::size_t>(most));
    } catch (const std::bad_alloc&) {
      return make_error(ErrorCode::kIOError, "out of host memory encoding " + std::to_string(most) +
                                                 " bytes of pack payload");
    }
  }
  return plan;
}

// Sets chunk i's bytes (views or encoded) and its name, its layer's rows
// loaded and `base` the payload offset of its group's first byte. Chunks
// are independent: safe to run in parallel over i.
void prepare_chunk(WritePlan& plan, const RowSource& rows, std::int64_t kv_dim, Encoding encoding,
                   std::int64_t base, std::size_t i) {
  PlannedChunk& ch = plan.chunks[i];
  const std::int64_t first = ch.row * kv_dim;
  const std::int64_t values = ch.range.rows * kv_dim;
  const std::int64_t half = ch.byte_length / 2;
  if (plan.views) {
    ch.data.part1 = {reinterpret_cast<const std::uint8_t*>(rows.k(ch.layer) + first),
                     static_cast<std::size_t>(half)};
    ch.data.part2 = {reinterpret_cast<const std::uint8_t*>(rows.v(ch.layer) + first),
                     static_cast<std::size_t>(half)};
  } else {
    std::uint8_t* dst = plan.encoded.data() + (ch.offset - base);
    encode_values(encoding, rows.k(ch.layer) + first, values, dst);
    encode_values(encoding, rows.v(ch.layer) + first, values, dst + half);
    ch.data.part1 = {dst, static_cast<std::size_t>(ch.byte_length)};
  }
  Sha256 h;
  h.update(ch.data.part1.data(), ch.data.part1.size());
  h.update(ch.data.part2.data(), ch.data.part2.size());
  ch.data.name = h.finish();
}

// Sets every chunk's bytes and name a group of layers at a time (all
// cores), calling `each(i)` on chunk i as soon as it is set and
// `group_done(from, to)` after each group, while the group's views are
// valid. An error stops it at the end of its group; the first in chunk
// order is returned.
Status for_each_chunk(WritePlan& plan, RowSource& rows, std::int64_t kv_dim, Encoding encoding,
                      const std::function<Status(std::size_t)>& each,
                      const std::function<Status(std::size_t, std::size_t)>& group_done) {
  const auto n_layers = static_cast<std::int64_t>(plan.first_chunk.size()) - 1;
  for (std::int64_t first = 0, end = 0; first < n_layers; first = end) {
    end = rows.group_end(first);
    KVRING_RETURN_IF_ERROR(rows.load(first));
    const std::size_t from = plan.first_chunk[static_cast<std::size_t>(first)];
    const std::size_t to = plan.first_chunk[static_cast<std::size_t>(end)];
    const std::int64_t base = plan.first_byte[static_cast<std::size_t>(first)];
    std::vector<Status> status(to - from);
    cpu::parallel_for(static_cast<std::int64_t>(to - from),
                      plan.first_byte[static_cast<std::size_t>(end)] - base, [&](std::int64_t j) {
      const std::size_t i = from + static_cast<std::size_t>(j);
      prepare_chunk(plan, rows, kv_dim, encoding, base, i);
      if (each) status[static_cast<std::size_t>(j)] = each(i);
    });
    KVRING_RETURN_IF_ERROR(first_error(status));
    if (group_done) KVRING_RETURN_IF_ERROR(group_done(from, to));
  }
  return Status::Ok();
}

// Preamble, manifest and manifest digest. Its size does not depend on the
// chunk names, so a writer may size it before the chunks are hashed.
Result<std::string> build_head(const Snapshot& s, const WriteOptions& o, const WritePlan& plan,
                               bool thin) {
  const std::string manifest = build_manifest(s, o, plan.chunks);
  // check_options refused a manifest past the limit from this size.
  if (manifest.size() != manifest_bytes(s, plan.chunks.size()))
    return make_error(ErrorCode::kInternal, "the manifest took " + std::to_string(manifest.size()) +
                                                " bytes, not the " +
                                                std::to_string(manifest_bytes(s, plan.chunks.size())) +
                                                " its fields add up to");
  std::string head;
  coding::put_bytes(&head, kPackMagic, sizeof kPackMagic);
  coding::put_fixed16(&head, kPackVersion);
  coding::put_fixed16(&head, thin ? kFlagThin : 0);
  coding::put_fixed32(&head, static_cast<std::uint32_t>(manifest.size()));
  head += manifest;
  const Digest digest = sha256(head.data(), head.size());
  coding::put_bytes(&head, digest.data(), digest.size());
  return head;
}

std::vector<ChunkData> chunk_data(const WritePlan& plan, std::size_t from, std::size_t to) {
  std::vector<ChunkData> out;
  out.reserve(to - from);
  for (std::size_t i = from; i < to; ++i) out.push_back(plan.chunks[i].data);
  return out;
}

std::span<const std::uint8_t> bytes_of(const std::string& s) {
  return {reinterpret_cast<const std::uint8_t*>(s.data()), s.size()};
}

// The file of a planned pack; the snapshot's rows come from `rows`.
Status write_planned(const Snapshot& s, WritePlan& plan, RowSource& rows, const std::string& path,
                     const WriteOptions& options) {
  const std::int64_t kv_dim = s.config.kv_dim();
  const bool thin = options.store != nullptr;
  // The head's size does not depend on the chunk names. Whatever refuses
  // the input (plan_pack, then the destination) refuses it before a chunk
  // is hashed, written or put in a store.
  const auto base = kPreambleBytes + static_cast<std::int64_t>(manifest_bytes(s, plan.chunks.size())) +
                    kDigestBytes;
  auto file = pack_internal::AtomicFile::create(path, options.io);
  if (!file) return file.error();
  if (thin) {
    // A thin pack's manifest must never name a chunk the store lacks: the
    // chunks are durable before the manifest file exists (the commit's
    // rename).
    KVRING_RETURN_IF_ERROR(for_each_chunk(plan, rows, kv_dim, options.encoding, nullptr,
                                          [&](std::size_t from, std::size_t to) {
      return options.store->put(chunk_data(plan, from, to));
    }));
  } else {
    // Self-contained: each chunk is hashed and written in one pass; the
    // head, which holds the names, is written last.
    KVRING_RETURN_IF_ERROR(for_each_chunk(plan, rows, kv_dim, options.encoding,
                                          [&](std::size_t i) {
      const PlannedChunk& ch = plan.chunks[i];
      Status st = (*file)->write_at(base + ch.offset, ch.data.part1);
      if (st.ok() && !ch.data.part2.empty())
        st = (*file)->write_at(base + ch.offset + static_cast<std::int64_t>(ch.data.part1.size()),
                               ch.data.part2);
      return st;
    }, nullptr));
  }
  auto head = build_head(s, options, plan, thin);
  if (!head) return head.error();
  // Invariant: fixed-width records, so the names do not change the size.
  if (static_cast<std::int64_t>(head->size()) != base)
    return make_error(ErrorCode::kInternal, "pack head changed size while naming its chunks");
  KVRING_RETURN_IF_ERROR((*file)->write_at(0, bytes_of(*head)));
  return (*file)->commit();
}

}  // namespace

Result<std::string> encode_pack(const Snapshot& snapshot, const WriteOptions& options) {
  KVRING_RETURN_IF_ERROR(validate_snapshot(snapshot));
  SnapshotRows rows(snapshot);
  auto plan = plan_pack(snapshot, options, rows);
  if (!plan) return plan.error();
  const bool thin = options.store != nullptr;
  // One group: every chunk's views stay valid to the end.
  KVRING_RETURN_IF_ERROR(for_each_chunk(*plan, rows, snapshot.config.kv_dim(), options.encoding,
                                        nullptr, nullptr));
  auto head = build_head(snapshot, options, *plan, thin);
  if (!head) return head.error();
  if (thin) {
    KVRING_RETURN_IF_ERROR(options.store->put(chunk_data(*plan, 0, plan->chunks.size())));
    return std::move(*head);
  }
  std::string out = std::move(*head);
  try {
    out.reserve(out.size() + static_cast<std::size_t>(plan->payload_bytes));
  } catch (const std::bad_alloc&) {
    return make_error(ErrorCode::kIOError, "out of host memory for a pack of " +
                                               std::to_string(out.size() + plan->payload_bytes) + " bytes");
  }
  for (const PlannedChunk& ch : plan->chunks) {
    out.append(reinterpret_cast<const char*>(ch.data.part1.data()), ch.data.part1.size());
    out.append(reinterpret_cast<const char*>(ch.data.part2.data()), ch.data.part2.size());
  }
  return out;
}

Status write_pack(const Snapshot& snapshot, const std::string& path, const WriteOptions& options) {
  KVRING_RETURN_IF_ERROR(validate_snapshot(snapshot));
  SnapshotRows rows(snapshot);
  auto plan = plan_pack(snapshot, options, rows);
  if (!plan) return plan.error();
  return write_planned(snapshot, *plan, rows, path, options);
}

Status pack_internal::write_pack_in_groups(const KvStore& store, SeqId seq, const std::string& path,
                                           const std::vector<std::int32_t>& token_ids,
                                           const std::string& metadata, const WriteOptions& options,
                                           std::int64_t group_bytes) {
  Snapshot header;
  KVRING_RETURN_IF_ERROR(take_snapshot_header(store, seq, header));
  try {
    header.token_ids = token_ids;
    header.metadata = metadata;
  } catch (const std::bad_alloc&) {
    return make_error(ErrorCode::kIOError, "out of host memory for the pack's token ids and metadata");
  }
  KVRING_RETURN_IF_ERROR(validate_snapshot(header, /*header_only=*/true));
  StoreRows rows(store, seq, header, group_bytes);
  auto plan = plan_pack(header, options, rows);
  if (!plan) return plan.error();
  KVRING_RETURN_IF_ERROR(rows.reserve());
  return write_planned(header, *plan, rows, path, options);
}

Status write_pack(const KvStore& store, SeqId seq, const std::string& path,
                  const std::vector<std::int32_t>& token_ids, const std::string& metadata,
                  const WriteOptions& options) {
  return pack_internal::write_pack_in_groups(store, seq, path, token_ids, metadata, options,
                                             pack_internal::kStoreGroupBytes);
}

Status write_pack(const KvCache& cache, const std::string& path,
                  const std::vector<std::int32_t>& token_ids, const std::string& metadata,
                  const WriteOptions& options) {
  return write_pack(cache.store(), cache.seq(), path, token_ids, metadata, options);
}

Status check_pack_destination(const std::string& path) {
  auto file = pack_internal::AtomicFile::create(path, {});
  return file ? Status::Ok() : Status(file.error());
}

}  // namespace kvring
