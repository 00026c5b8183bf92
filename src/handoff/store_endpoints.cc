// A store's sequence as a handoff's source (StoreSource) and a detached
// sequence of a store as its target (StoreTarget), on either backend; the
// CUDA backend's staging lives in device.h.
#include <algorithm>

#include "checks.h"
#include "core/store_access.h"
#include "device.h"
#include "kvring/footprint.h"
#include "kvring/handoff.h"

namespace kvring::handoff {

// ------------------------------------------------------------ source

Result<Snapshot> session_header(const KvStore& store, SeqId seq, const Payload& payload,
                                std::vector<std::int32_t> token_ids, std::string metadata) {
  if (store.is_detached(seq)) return invalid_argument("handoff: " + seq_name(seq) + " is still being installed");
  auto next = store.next_position(seq);
  if (!next) return next.error();
  if (*next != payload.rows_tokens)
    return invalid_argument("handoff: " + seq_name(seq) + " holds " + std::to_string(*next) +
                            " positions; the payload is " + std::to_string(payload.rows_tokens));
  if (store.context() != payload.context)
    return invalid_argument("handoff: the store holds " + std::to_string(store.context()) +
                            " positions of context; the payload was planned for " + std::to_string(payload.context));
  if (static_cast<std::int64_t>(token_ids.size()) != payload.rows_tokens)
    return invalid_argument("handoff: " + std::to_string(token_ids.size()) + " token ids for " +
                            std::to_string(payload.rows_tokens) + " positions");
  if (static_cast<std::int64_t>(payload.layers.size()) != store.n_layers())
    return invalid_argument("handoff: the payload has " + std::to_string(payload.layers.size()) +
                            " layers, the store " + std::to_string(store.n_layers()));
  Snapshot h;
  h.config = store.config();
  h.context = store.context();
  h.token_count = payload.rows_tokens;
  h.token_ids = std::move(token_ids);
  h.metadata = std::move(metadata);
  for (const LayerPayload& lp : payload.layers) {
    // The live ring holds at least the payload's rows (a store's rings may
    // keep a rollback slack beyond them).
    auto live = store.ring(seq, lp.layer);
    if (!live) return live.error();
    if (live->origin_logical() > lp.ring.origin_logical() || live->next_position() != lp.ring.next_position())
      return invalid_argument("handoff: layer " + std::to_string(lp.layer) + " of " + seq_name(seq) +
                              " does not hold the planned rows");
    PlaneSnapshot p;
    p.kind = lp.kind;
    p.layout = layout_for(lp.kind);
    p.ring = lp.ring;
    h.planes.push_back(std::move(p));
  }
  KVRING_RETURN_IF_ERROR(validate_snapshot(h, /*header_only=*/true));
  return h;
}

StoreSource::StoreSource(const KvStore& store, SeqId seq, const Timeline& timeline)
    : store_(store), seq_(seq), timeline_(timeline) {}

StoreSource::~StoreSource() = default;

Result<std::unique_ptr<StoreSource>> StoreSource::create(const KvStore& store, SeqId seq,
                                                         const Timeline& timeline,
                                                         std::vector<std::int32_t> token_ids,
                                                         std::string metadata) {
  auto header = session_header(store, seq, timeline.payload, std::move(token_ids), std::move(metadata));
  if (!header) return header.error();
  std::unique_ptr<StoreSource> s(new StoreSource(store, seq, timeline));
  s->header_ = std::move(*header);
  if (store.backend() == BackendKind::kCuda) {
    KVRING_RETURN_IF_ERROR(device::on_store_gpu(store));
    std::int64_t most = 1;
    for (const PlannedMessage& m : timeline.messages) most = std::max(most, m.rows);
    auto slots = device::SourceSlots::create(store, most);
    if (!slots) return slots.error();
    s->slots_ = std::move(*slots);
  }
  return s;
}

RowDigest StoreSource::digest() const { return slots_ ? RowDigest::kDigest64 : RowDigest::kSha256; }

Status StoreSource::rows(const PlannedMessage& m, const std::uint16_t** k, const std::uint16_t** v) {
  if (slots_) {
    SourceRows r;
    KVRING_RETURN_IF_ERROR(message_rows(m, false, &r));  // checks the message
    *k = static_cast<const std::uint16_t*>(r.k);
    *v = static_cast<const std::uint16_t*>(r.v);
    return Status::Ok();
  }
  KVRING_RETURN_IF_ERROR(check_planned(header_, m));
  const std::size_t n = static_cast<std::size_t>(m.rows * store_.config().kv_dim());
  k_.resize(n);
  v_.resize(n);
  KVRING_RETURN_IF_ERROR(store_.read_rows(seq_, m.layer, m.first_row, m.rows, k_.data(), v_.data()));
  *k = k_.data();
  *v = v_.data();
  return Status::Ok();
}

Status StoreSource::message_rows(const PlannedMessage& m, bool device_ok, SourceRows* out) {
  if (!slots_) return HandoffSource::message_rows(m, device_ok, out);
  KVRING_RETURN_IF_ERROR(check_planned(header_, m));
  // The staging slots follow the timeline: message i is gathered ahead as
  // the timeline's i-th, so only that message is taken.
  KVRING_RETURN_IF_ERROR(check_in_timeline(timeline_, m));
  const auto& ms = timeline_.messages;
  const bool to_host = !device_ok;
  auto prepare = [&](const PlannedMessage& p) {
    return slots_->prepare(static_cast<int>(p.index % 2), seq_, p.layer, p.first_row, p.rows, to_host);
  };
  // Message i is in slot i % 2; the next one is gathered (and copied to the
  // host) while this one is sent. Its slot held message i - 1, which has
  // been sent by now.
  if (prepared_ != m.index || prepared_host_ != to_host) KVRING_RETURN_IF_ERROR(prepare(m));
  prepared_ = -1;
  if (m.index + 1 < static_cast<std::int64_t>(ms.size())) {
    KVRING_RETURN_IF_ERROR(prepare(ms[static_cast<std::size_t>(m.index + 1)]));
    prepared_ = m.index + 1;
    prepared_host_ = to_host;
  }
  return slots_->take(static_cast<int>(m.index % 2), out);
}

// ------------------------------------------------------------ target

namespace {

// A session of another geometry than `expect`, naming the first field that differs.
Error geometry_mismatch(const ModelConfig& a, const ModelConfig& b) {
  std::string field = "layer kinds";
  if (a.n_layers != b.n_layers) field = "n_layers " + std::to_string(a.n_layers) + " vs " + std::to_string(b.n_layers);
  else if (a.n_kv_heads != b.n_kv_heads) field = "n_kv_heads " + std::to_string(a.n_kv_heads) + " vs " + std::to_string(b.n_kv_heads);
  else if (a.head_dim != b.head_dim) field = "head_dim " + std::to_string(a.head_dim) + " vs " + std::to_string(b.head_dim);
  else if (a.n_heads != b.n_heads) field = "n_heads " + std::to_string(a.n_heads) + " vs " + std::to_string(b.n_heads);
  else if (a.sliding_window != b.sliding_window) field = "sliding_window " + std::to_string(a.sliding_window) + " vs " + std::to_string(b.sliding_window);
  else if (a.max_context != b.max_context) field = "max_context " + std::to_string(a.max_context) + " vs " + std::to_string(b.max_context);
  return make_error(ErrorCode::kMismatch, "the session's geometry (fingerprint " + a.fingerprint_hex().substr(0, 16) +
                                              ") differs from this store's (" + b.fingerprint_hex().substr(0, 16) + "): " + field);
}

}  // namespace

Status StoreTarget::check_session(const Snapshot& header, const Options& options) {
  if (options.expect && options.expect->fingerprint() != header.config.fingerprint())
    return geometry_mismatch(header.config, *options.expect);
  std::int64_t bytes = 0;
  for (const PlaneSnapshot& p : header.planes) bytes += p.ring.len() * header.config.kv_dim() * 4;
  if (bytes > options.max_row_bytes)
    return make_error(ErrorCode::kCapacityExceeded,
                      "handoff: the session's rows take " + std::to_string(bytes) +
                          " B, above this target's limit of " + std::to_string(options.max_row_bytes) + " B");
  return Status::Ok();
}

StoreTarget::StoreTarget(KvStore& store) : store_(store) {}
StoreTarget::StoreTarget(KvStore& store, Options options) : store_(store), options_(std::move(options)) {}

StoreTarget::~StoreTarget() { abort(); }

Status StoreTarget::begin(const Snapshot& header) {
  // A header refused here leaves a session in progress as it was; one
  // taken replaces it.
  KVRING_RETURN_IF_ERROR(check_session(header, options_));
  if (!options_.expect && store_.config().fingerprint() != header.config.fingerprint())
    return geometry_mismatch(header.config, store_.config());
  KVRING_RETURN_IF_ERROR(check_restorable(header, store_));
  KVRING_RETURN_IF_ERROR(device::on_store_gpu(store_));
  abort();
  seq_.reset();  // a committed session's sequence is the store's now
  committed_ = false;
  auto seq = store_.add_detached_sequence();
  if (!seq) return make_error(seq.error().code, "handoff: " + seq.error().message);
  seq_ = *seq;
  header_ = header;
  skip_.clear();
  for (std::int64_t l = 0; l < store_.n_layers(); ++l) {
    auto ring = restore_ring(header, l, store_);
    Status st = ring ? store_.install_plane(*seq_, l, *ring) : Status(ring.error());
    if (!st.ok()) {
      abort();
      return make_error(st.error().code, "handoff: " + st.error().message);
    }
    skip_.push_back(ring->origin_logical());
  }
  return Status::Ok();
}

namespace {

// Rows [first, first + rows) clipped to the positions the store keeps (from
// `keep` on): the first row taken and how many.
std::pair<std::int64_t, std::int64_t> kept(std::int64_t first, std::int64_t rows, std::int64_t keep) {
  const std::int64_t from = std::max(first, keep);
  return {from - first, std::max<std::int64_t>(0, first + rows - from)};
}

}  // namespace

Status StoreTarget::check_rows(std::int64_t layer, std::int64_t first_row, std::int64_t rows) const {
  if (layer < 0 || layer >= store_.n_layers()) return invalid_argument("handoff: rows for layer " + std::to_string(layer));
  if (first_row < 0 || rows < 0 || first_row > header_.token_count || rows > header_.token_count - first_row)
    return invalid_argument("handoff: rows [" + std::to_string(first_row) + ", +" + std::to_string(rows) +
                            ") of layer " + std::to_string(layer) + ": outside the session's " +
                            std::to_string(header_.token_count) + " positions");
  return Status::Ok();
}

Status StoreTarget::put_rows(std::int64_t layer, std::int64_t first_row, std::int64_t rows, const std::uint8_t* k,
                             const std::uint8_t* v) {
  if (!seq_ || committed_) return make_error(ErrorCode::kInternal, "handoff: rows before begin or after commit");
  KVRING_RETURN_IF_ERROR(check_rows(layer, first_row, rows));
  const auto [skip, n] = kept(first_row, rows, skip_[static_cast<std::size_t>(layer)]);
  if (n == 0) return Status::Ok();
  const std::size_t at = static_cast<std::size_t>(skip * store_.config().kv_dim()) * 2;
  const auto* rk = reinterpret_cast<const std::uint16_t*>(k + at);
  const auto* rv = reinterpret_cast<const std::uint16_t*>(v + at);
  if (store_.backend() == BackendKind::kCpu) return store_.install_rows(*seq_, layer, first_row + skip, n, rk, rv);
  if (!slots_) {
    auto slots = device::TargetSlots::create();
    if (!slots) return slots.error();
    slots_ = std::move(*slots);
  }
  return slots_->put(store_, *seq_, layer, first_row + skip, n, rk, rv);
}

std::int64_t StoreTarget::pending_blocks() const {
  if (!seq_ || committed_) return 0;
  auto held = store_.blocks_held(*seq_);
  return held ? *held : 0;
}

bool StoreTarget::accepts_device() const { return store_.backend() == BackendKind::kCuda; }

Status StoreTarget::put_device_rows(std::int64_t layer, std::int64_t first_row, std::int64_t rows, const void* k,
                                    const void* v, cudaStream_t stream) {
  if (!accepts_device()) return HandoffTarget::put_device_rows(layer, first_row, rows, k, v, stream);
  if (!seq_ || committed_) return make_error(ErrorCode::kInternal, "handoff: rows before begin or after commit");
  KVRING_RETURN_IF_ERROR(check_rows(layer, first_row, rows));
  const auto [skip, n] = kept(first_row, rows, skip_[static_cast<std::size_t>(layer)]);
  if (n == 0) return Status::Ok();
  const std::size_t at = static_cast<std::size_t>(skip * store_.config().kv_dim()) * 2;
  device_stream_ = stream;
  return store_.install_rows(*seq_, layer, first_row + skip, n,
                             reinterpret_cast<const std::uint16_t*>(static_cast<const char*>(k) + at),
                             reinterpret_cast<const std::uint16_t*>(static_cast<const char*>(v) + at),
                             MemorySpace::kDevice, stream);
}

Status StoreTarget::commit() {
  if (!seq_ || committed_) return make_error(ErrorCode::kInternal, "handoff: commit without a session");
  // Every row is on the device before the sequence goes live: a copy that
  // failed on the device fails the commit.
  Status st = Status::Ok();
  if (slots_) st = slots_->finish();
  if (st.ok() && device_stream_ != nullptr) st = store_.synchronize(device_stream_);
  if (st.ok()) st = store_.attach_sequence(*seq_);
  if (!st.ok()) {
    abort();
    return st;
  }
  committed_ = true;
  return Status::Ok();
}

void StoreTarget::abort() {
  if (seq_ && !committed_) {
    // Nothing in flight may land in blocks the store hands out again.
    if (slots_) (void)slots_->finish();
    if (device_stream_ != nullptr) (void)store_.synchronize(device_stream_);
    // The sequence's handle never left (sequence() answers after commit).
    (void)KvStoreAccess::discard(store_, *seq_);
  }
  if (!committed_) seq_.reset();
  device_stream_ = nullptr;
  slots_.reset();
}

// ------------------------------------------------------------ the tool's target

DetachedCacheTarget::DetachedCacheTarget(Options options) : options_(std::move(options)) {}

DetachedCacheTarget::~DetachedCacheTarget() { abort(); }

Status DetachedCacheTarget::begin(const Snapshot& header) {
  // The checks of the header alone come before a session in progress is
  // dropped: a header refused by them leaves it as it was.
  const std::int64_t context = options_.context == 0 ? header.context : options_.context;
  if (context > header.config.max_context || context < 1)
    return invalid_argument("handoff: context " + std::to_string(context) + " outside the model's [1, " +
                            std::to_string(header.config.max_context) + "]");
  StoreTarget::Options to;
  to.expect = options_.expect;
  if (options_.store != nullptr && !to.expect) to.expect = options_.store->config();
  to.max_row_bytes = options_.max_row_bytes;
  // The cheap checks before a fresh store is allocated.
  KVRING_RETURN_IF_ERROR(StoreTarget::check_session(header, to));
  KvStore* into = options_.store;
  if (into == nullptr) {
    // A fresh store holds every row the geometry can at this context, however
    // few the session sends: the limit bounds it before it is allocated.
    auto footprint = compute_footprint(header.config, context, 1);
    if (!footprint) return footprint.error();
    if (footprint->total_bytes > options_.max_row_bytes)
      return make_error(ErrorCode::kCapacityExceeded,
                        "handoff: a store for this session's geometry at context " + std::to_string(context) +
                            " takes " + std::to_string(footprint->total_bytes) + " B, above this target's limit of " +
                            std::to_string(options_.max_row_bytes) + " B");
  }
  abort();
  if (into == nullptr) {
    // Every row a reader can see is installed, and a ring the rows do not
    // fill is cleared: no zero-fill.
    // A header off the wire carries the geometry, not the score scale or
    // the sinks: a caller that knows the run's sets them in the header;
    // otherwise the receiver's model (expect) gives them.
    ModelConfig config = header.config;
    if (options_.expect && config.query_pre_attn_scalar == 0)
      config.query_pre_attn_scalar = options_.expect->query_pre_attn_scalar;
    if (options_.expect && options_.expect->attention_sinks) config.attention_sinks = true;
    auto made = make_store(options_.backend, config, {.max_sequences = 1, .context = context, .zero_fill = false});
    if (!made) return made.error();
    own_ = std::move(*made);
    into = own_.get();
  }
  target_ = std::make_unique<StoreTarget>(*into, to);
  if (Status st = target_->begin(header); !st.ok()) {
    abort();
    return st;
  }
  header_ = header;
  return Status::Ok();
}

Status DetachedCacheTarget::put_rows(std::int64_t layer, std::int64_t first_row, std::int64_t rows,
                                     const std::uint8_t* k, const std::uint8_t* v) {
  if (!target_) return make_error(ErrorCode::kInternal, "handoff: rows before begin");
  return target_->put_rows(layer, first_row, rows, k, v);
}

bool DetachedCacheTarget::accepts_device() const {
  return (options_.store ? options_.store->backend() : options_.backend) == BackendKind::kCuda;
}

Status DetachedCacheTarget::put_device_rows(std::int64_t layer, std::int64_t first_row, std::int64_t rows,
                                            const void* k, const void* v, cudaStream_t stream) {
  if (!target_) return make_error(ErrorCode::kInternal, "handoff: rows before begin");
  return target_->put_device_rows(layer, first_row, rows, k, v, stream);
}

Status DetachedCacheTarget::commit() {
  if (!target_) return make_error(ErrorCode::kInternal, "handoff: commit without a session");
  if (Status st = target_->commit(); !st.ok()) {
    abort();
    return st;
  }
  const SeqId seq = *target_->sequence();
  target_.reset();  // committed: the sequence stays
  if (own_) {
    auto cache = KvCache::adopt(std::move(own_), seq);
    if (!cache) return cache.error();
    cache_ = std::move(*cache);
  } else {
    seq_ = seq;
  }
  return Status::Ok();
}

void DetachedCacheTarget::abort() {
  target_.reset();  // removes a session not committed from its store
  own_.reset();
  cache_.reset();
  seq_.reset();
  header_ = Snapshot{};
}

std::int64_t DetachedCacheTarget::held_row_bytes() const {
  std::int64_t b = 0;
  if (own_) b += own_->allocated_bytes();
  else if (target_ && options_.store) b += target_->pending_blocks() * options_.store->block_bytes();
  if (cache_) b += cache_->allocated_bytes();
  return b;
}

}  // namespace kvring::handoff
