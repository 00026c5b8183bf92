// The kvpack writer: validate the snapshot, cut and hash the chunks on all
// cores, build the manifest, then hand the bytes to a sink (a buffer, an
// atomically written file, a chunk store plus a manifest file).
#include <limits>
#include <new>

#include "coding.h"
#include "cpu/parallel.h"
#include "file_io.h"
#include "kvring/pack.h"
#include "pack_common.h"

namespace kvring {

namespace {

using namespace pack_internal;

struct PlannedChunk {
  std::int64_t layer = 0;
  ChunkRange range;
  std::int64_t byte_length = 0;
  std::int64_t offset = 0;  // in a self-contained pack
  ChunkData data;           // name and bytes
};

struct WritePlan {
  std::vector<PlannedChunk> chunks;
  // Chunk bytes that are not views of the snapshot's rows (F32Le, or any
  // encoding on a big-endian host).
  std::vector<std::uint8_t> encoded;
  bool views = false;
  std::int64_t payload_bytes = 0;
};

Status check_options(const Snapshot& s, const WriteOptions& o) {
  if (o.encoding != Encoding::kF16Le && o.encoding != Encoding::kF32Le)
    return invalid_argument("unknown pack encoding " + std::to_string(static_cast<int>(o.encoding)));
  const std::int64_t max_tokens = max_chunk_tokens(s.config.kv_dim());
  if (o.chunk_tokens < 1 || o.chunk_tokens > max_tokens)
    return invalid_argument("chunk_tokens " + std::to_string(o.chunk_tokens) + " outside [1, " +
                            std::to_string(max_tokens) + "] for kv_dim " +
                            std::to_string(s.config.kv_dim()));
  // The token ids and the metadata alone (4 bytes an id) bound the
  // manifest from below: refused here, before a manifest of that size is
  // built to be measured.
  const std::uint64_t at_least = 4 * static_cast<std::uint64_t>(s.token_ids.size()) + s.metadata.size();
  if (at_least > static_cast<std::uint64_t>(kMaxManifestBytes))
    return invalid_argument("the manifest would take at least " + std::to_string(at_least) + " bytes (" +
                            std::to_string(s.token_ids.size()) + " token ids, " + std::to_string(s.metadata.size()) +
                            " bytes of metadata), over the format's " + std::to_string(kMaxManifestBytes));
  if (s.token_count > kMaxTokenCount)
    return invalid_argument("token_count " + std::to_string(s.token_count) + " exceeds 2^62");
  return Status::Ok();
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

// Cuts the snapshot into chunks and sizes everything; the chunks' bytes and
// names come later, from prepare_chunk, so that a file writer can hash and
// write each chunk in one pass.
Result<WritePlan> plan_pack(const Snapshot& s, const WriteOptions& o) {
  KVRING_RETURN_IF_ERROR(validate_snapshot(s));
  KVRING_RETURN_IF_ERROR(check_options(s, o));
  const std::int64_t kv_dim = s.config.kv_dim();
  WritePlan plan;
  for (std::size_t l = 0; l < s.planes.size(); ++l) {
    const RingState& r = s.planes[l].ring;
    const std::int64_t n = count_chunks(r.origin_logical(), r.len(), o.chunk_tokens);
    for (std::int64_t j = 0; j < n; ++j) {
      PlannedChunk ch;
      ch.layer = static_cast<std::int64_t>(l);
      ch.range = chunk_range(r.origin_logical(), r.len(), o.chunk_tokens, j);
      ch.byte_length = chunk_byte_length(ch.range.rows, kv_dim, o.encoding);
      ch.offset = plan.payload_bytes;
      plan.payload_bytes += ch.byte_length;
      plan.chunks.push_back(ch);
    }
  }
  if (plan.chunks.size() > std::numeric_limits<std::uint32_t>::max())
    return invalid_argument("a pack of " + std::to_string(plan.chunks.size()) +
                            " chunks exceeds the format's 2^32; raise chunk_tokens");
  // F16Le chunks on a little-endian host are views of the rows: K rows then V
  // rows of one plane are two contiguous spans. Everything else is encoded.
  plan.views = o.encoding == Encoding::kF16Le && kHostLittleEndian;
  if (!plan.views) {
    try {
      plan.encoded.resize(static_cast<std::size_t>(plan.payload_bytes));
    } catch (const std::bad_alloc&) {
      return make_error(ErrorCode::kIOError, "out of host memory encoding " +
                                                 std::to_string(plan.payload_bytes) +
                                                 " bytes of pack payload");
    }
  }
  return plan;
}

// Sets chunk i's bytes (views or encoded) and its name. Chunks are
// independent: safe to run in parallel over i.
void prepare_chunk(WritePlan& plan, const Snapshot& s, const WriteOptions& o, std::int64_t i) {
  PlannedChunk& ch = plan.chunks[static_cast<std::size_t>(i)];
  const std::int64_t kv_dim = s.config.kv_dim();
  const PlaneSnapshot& p = s.planes[static_cast<std::size_t>(ch.layer)];
  const std::int64_t first = (ch.range.first_position - p.ring.origin_logical()) * kv_dim;
  const std::int64_t values = ch.range.rows * kv_dim;
  const std::int64_t half = ch.byte_length / 2;
  if (plan.views) {
    ch.data.part1 = {reinterpret_cast<const std::uint8_t*>(p.k.data() + first),
                     static_cast<std::size_t>(half)};
    ch.data.part2 = {reinterpret_cast<const std::uint8_t*>(p.v.data() + first),
                     static_cast<std::size_t>(half)};
  } else {
    std::uint8_t* dst = plan.encoded.data() + ch.offset;
    encode_values(o.encoding, p.k.data() + first, values, dst);
    encode_values(o.encoding, p.v.data() + first, values, dst + half);
    ch.data.part1 = {dst, static_cast<std::size_t>(ch.byte_length)};
  }
  Sha256 h;
  h.update(ch.data.part1.data(), ch.data.part1.size());
  h.update(ch.data.part2.data(), ch.data.part2.size());
  ch.data.name = h.finish();
}

void prepare_all(WritePlan& plan, const Snapshot& s, const WriteOptions& o) {
  cpu::parallel_for(static_cast<std::int64_t>(plan.chunks.size()), plan.payload_bytes,
                    [&](std::int64_t i) { prepare_chunk(plan, s, o, i); });
}

// Preamble, manifest and manifest digest. Its size does not depend on the
// chunk names, so a writer may size it before the chunks are hashed.
Result<std::string> build_head(const Snapshot& s, const WriteOptions& o, const WritePlan& plan,
                               bool thin) {
  const std::string manifest = build_manifest(s, o, plan.chunks);
  if (static_cast<std::int64_t>(manifest.size()) > kMaxManifestBytes)
    return invalid_argument("the manifest would take " + std::to_string(manifest.size()) +
                            " bytes, over the format's " + std::to_string(kMaxManifestBytes) +
                            "; raise chunk_tokens or shrink the metadata");
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

std::vector<ChunkData> chunk_data(const WritePlan& plan) {
  std::vector<ChunkData> out;
  out.reserve(plan.chunks.size());
  for (const PlannedChunk& ch : plan.chunks) out.push_back(ch.data);
  return out;
}

std::span<const std::uint8_t> bytes_of(const std::string& s) {
  return {reinterpret_cast<const std::uint8_t*>(s.data()), s.size()};
}

}  // namespace

Result<std::string> encode_pack(const Snapshot& snapshot, const WriteOptions& options) {
  const bool thin = options.store != nullptr;
  auto plan = plan_pack(snapshot, options);
  if (!plan) return plan.error();
  prepare_all(*plan, snapshot, options);
  auto head = build_head(snapshot, options, *plan, thin);
  if (!head) return head.error();
  if (thin) {
    KVRING_RETURN_IF_ERROR(options.store->put(chunk_data(*plan)));
    return std::move(*head);
  }
  std::string out = std::move(*head);
  out.reserve(out.size() + static_cast<std::size_t>(plan->payload_bytes));
  for (const PlannedChunk& ch : plan->chunks) {
    out.append(reinterpret_cast<const char*>(ch.data.part1.data()), ch.data.part1.size());
    out.append(reinterpret_cast<const char*>(ch.data.part2.data()), ch.data.part2.size());
  }
  return out;
}

Status write_pack(const Snapshot& snapshot, const std::string& path, const WriteOptions& options) {
  const bool thin = options.store != nullptr;
  auto plan = plan_pack(snapshot, options);
  if (!plan) return plan.error();
  if (thin) {
    // A thin pack's manifest must never name a chunk the store lacks: the
    // chunks are durable before the manifest file exists (the commit's
    // rename). Whatever refuses the input (the manifest's size, the
    // destination) refuses it first, so a refused write puts nothing in
    // the store.
    auto sized = build_head(snapshot, options, *plan, thin);
    if (!sized) return sized.error();
    auto file = pack_internal::AtomicFile::create(path, options.io);
    if (!file) return file.error();
    prepare_all(*plan, snapshot, options);
    KVRING_RETURN_IF_ERROR(options.store->put(chunk_data(*plan)));
    auto head = build_head(snapshot, options, *plan, thin);
    if (!head) return head.error();
    if (head->size() != sized->size())
      return make_error(ErrorCode::kInternal, "pack head changed size while naming its chunks");
    KVRING_RETURN_IF_ERROR((*file)->write_at(0, bytes_of(*head)));
    return (*file)->commit();
  }
  // Self-contained: the head's size is known before the names, so each
  // chunk is hashed and written in one pass on all cores; the head, which
  // holds the names, is written last.
  auto sized = build_head(snapshot, options, *plan, thin);
  if (!sized) return sized.error();
  const auto base = static_cast<std::int64_t>(sized->size());
  auto file = pack_internal::AtomicFile::create(path, options.io);
  if (!file) return file.error();
  std::vector<Status> status(plan->chunks.size());
  cpu::parallel_for(static_cast<std::int64_t>(plan->chunks.size()), plan->payload_bytes,
                    [&](std::int64_t i) {
    prepare_chunk(*plan, snapshot, options, i);
    const PlannedChunk& ch = plan->chunks[static_cast<std::size_t>(i)];
    Status s = (*file)->write_at(base + ch.offset, ch.data.part1);
    if (s.ok() && !ch.data.part2.empty())
      s = (*file)->write_at(base + ch.offset + static_cast<std::int64_t>(ch.data.part1.size()),
                            ch.data.part2);
    status[static_cast<std::size_t>(i)] = s;
  });
  KVRING_RETURN_IF_ERROR(pack_internal::first_error(status));
  auto head = build_head(snapshot, options, *plan, thin);
  if (!head) return head.error();
  // Invariant: fixed-width records, so the names do not change the size.
  if (static_cast<std::int64_t>(head->size()) != base)
    return make_error(ErrorCode::kInternal, "pack head changed size while naming its chunks");
  KVRING_RETURN_IF_ERROR((*file)->write_at(0, bytes_of(*head)));
  return (*file)->commit();
}

Status check_pack_destination(const std::string& path) {
  auto file = pack_internal::AtomicFile::create(path, {});
  return file ? Status::Ok() : Status(file.error());
}

}  // namespace kvring
