#include "kvring/store.h"

#include "kvring/cache.h"
#include "core/store_access.h"

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <utility>

namespace kvring {

const char* backend_name(BackendKind kind) {
  return kind == BackendKind::kCpu ? "cpu" : "cuda";
}

const char* attention_numeric_name(AttentionNumeric numeric) {
  return numeric == AttentionNumeric::kF32 ? "f32" : "f16";
}

Result<AttentionNumeric> parse_attention_numeric(std::string_view name) {
  if (name == "f32") return AttentionNumeric::kF32;
  if (name == "f16") return AttentionNumeric::kF16;
  return invalid_argument("unknown attention numeric '" + std::string(name) + "' (f32 or f16)");
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
  }
  return "unknown";
}

std::int64_t dtype_bytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

ConstView host_view(const float* data, std::int64_t rows, std::int64_t cols) {
  return ConstView{data, MemorySpace::kHost, DType::kF32, rows, cols, cols};
}
MutView host_view(float* data, std::int64_t rows, std::int64_t cols) {
  return MutView{data, MemorySpace::kHost, DType::kF32, rows, cols, cols};
}
ConstView device_view(const float* data, std::int64_t rows, std::int64_t cols) {
  return ConstView{data, MemorySpace::kDevice, DType::kF32, rows, cols, cols};
}
MutView device_view(float* data, std::int64_t rows, std::int64_t cols) {
  return MutView{data, MemorySpace::kDevice, DType::kF32, rows, cols, cols};
}
ConstView host_view(const void* data, DType dtype, std::int64_t rows, std::int64_t cols,
                    std::int64_t row_stride) {
  return ConstView{data, MemorySpace::kHost, dtype, rows, cols, row_stride};
}
MutView host_view(void* data, DType dtype, std::int64_t rows, std::int64_t cols, std::int64_t row_stride) {
  return MutView{data, MemorySpace::kHost, dtype, rows, cols, row_stride};
}
ConstView device_view(const void* data, DType dtype, std::int64_t rows, std::int64_t cols,
                      std::int64_t row_stride) {
  return ConstView{data, MemorySpace::kDevice, dtype, rows, cols, row_stride};
}
MutView device_view(void* data, DType dtype, std::int64_t rows, std::int64_t cols, std::int64_t row_stride) {
  return MutView{data, MemorySpace::kDevice, dtype, rows, cols, row_stride};
}
MutView host_view(std::nullptr_t, std::int64_t rows, std::int64_t cols) {
  return host_view(static_cast<float*>(nullptr), rows, cols);
}
MutView device_view(std::nullptr_t, std::int64_t rows, std::int64_t cols) {
  return device_view(static_cast<float*>(nullptr), rows, cols);
}
MutView host_view(std::nullptr_t, DType dtype, std::int64_t rows, std::int64_t cols, std::int64_t row_stride) {
  return host_view(static_cast<void*>(nullptr), dtype, rows, cols, row_stride);
}
MutView device_view(std::nullptr_t, DType dtype, std::int64_t rows, std::int64_t cols, std::int64_t row_stride) {
  return device_view(static_cast<void*>(nullptr), dtype, rows, cols, row_stride);
}

namespace {

// The physical row past the last one a placement writes.
std::int64_t rows_end(const BatchPlacement& p) {
  std::int64_t end = 0;
  for (int i = 0; i < p.n_spans; ++i) {
    const PhysicalSpan& span = p.spans[static_cast<std::size_t>(i)];
    end = std::max(end, span.physical_first + span.rows);
  }
  return end;
}

// A handle's bits: the slot (below 2^20, kMaxSequences), the store's tag
// (12 bits) and the slot's generation (32 bits).
constexpr unsigned kSlotBits = 20, kTagBits = 12, kGenerationShift = kSlotBits + kTagBits;
constexpr std::uint32_t kTags = (1u << kTagBits) - 1;  // tags 1 .. 4095
// A slot whose generation reaches this is never used again, so no handle of
// a removed sequence ever names a live one.
constexpr std::uint32_t kRetired = std::numeric_limits<std::uint32_t>::max();
std::uint32_t slot_part(SeqId s) {
  return static_cast<std::uint32_t>(static_cast<std::uint64_t>(s) & ((1u << kSlotBits) - 1));
}
std::uint32_t tag_part(SeqId s) {
  return static_cast<std::uint32_t>((static_cast<std::uint64_t>(s) >> kSlotBits) & ((1u << kTagBits) - 1));
}
std::uint32_t generation_part(SeqId s) {
  return static_cast<std::uint32_t>(static_cast<std::uint64_t>(s) >> kGenerationShift);
}

// How many live stores hold each tag, and where the next search starts.
struct StoreTags {
  std::mutex mu;
  std::vector<std::uint32_t> live = std::vector<std::uint32_t>(kTags + 1, 0);
  std::uint32_t next = 1;
};
StoreTags& store_tags() {
  static StoreTags* tags = new StoreTags;  // never destroyed: stores may outlive static destruction
  return *tags;
}

// Each store takes the next tag in turn that no live store holds: stores
// alive at once (up to 4095 of them) never share one, and a store's tag
// comes back only once the turn has gone round every other, so a handle of
// one store is refused by every other live store and by the thousands made
// after it. Past 4095 live stores a new one shares the next in turn.
std::uint32_t next_store_tag() {
  StoreTags& t = store_tags();
  const std::lock_guard<std::mutex> lock(t.mu);
  std::uint32_t tag = t.next;
  for (std::uint32_t i = 0; i < kTags && t.live[tag] > 0; ++i) tag = tag % kTags + 1;
  ++t.live[tag];
  t.next = tag % kTags + 1;
  return tag;
}

void release_store_tag(std::uint32_t tag) {
  StoreTags& t = store_tags();
  const std::lock_guard<std::mutex> lock(t.mu);
  --t.live[tag];
}

// Store-wide bounds: far above any model, far below what overflows 64-bit
// index arithmetic or an allocation size.
constexpr std::int64_t kMaxSequences = 1 << 20;
static_assert(kMaxSequences <= (std::int64_t{1} << kSlotBits), "every slot fits a handle's slot bits");
constexpr std::int64_t kMaxBatchRows = std::int64_t{1} << 32;

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// Rows of each sliding ring of a store with these options.
std::int64_t ring_rows_of(const ModelConfig& config, const StoreOptions& o) {
  return config.plane_capacity(LayerKind::kSlidingRope, o.context) + o.slack;
}

// Bytes of every slot's rings and the whole pool (allocated_bytes()), or
// none past 64 bits. Each factor is within its own bound (resolve_store_options).
std::optional<std::int64_t> storage_bytes(const ModelConfig& config, const StoreOptions& o) {
  const std::int64_t row_bytes = config.kv_dim() * 4;
  std::int64_t rings = 0, pool = 0, total = 0;
  if (__builtin_mul_overflow(o.max_sequences * config.count(LayerKind::kSlidingRope),
                             ring_rows_of(config, o) * row_bytes, &rings) ||
      __builtin_mul_overflow(o.pool_blocks, o.block_rows * row_bytes, &pool) ||
      __builtin_add_overflow(rings, pool, &total))
    return std::nullopt;
  return total;
}

// The oldest position a sliding ring of `capacity` rows (`slack` of them
// the store's slack) must still hold when it ends at `next`: the oldest a
// ring without slack holds there, at least the W rows before `next` and
// what a snapshot records. truncate_sequence and install keep it.
std::int64_t oldest_kept(std::int64_t next, std::int64_t capacity, std::int64_t slack) {
  return std::max<std::int64_t>(0, next - (capacity - slack));
}

}  // namespace

std::string seq_name(SeqId seq) {
  return "sequence " + std::to_string(slot_part(seq)) + "." + std::to_string(generation_part(seq));
}

Result<StoreOptions> resolve_store_options(const ModelConfig& config, StoreOptions o) {
  KVRING_RETURN_IF_ERROR(config.validate());
  if (o.context == 0) o.context = config.max_context;
  if (o.context < 1 || o.context > config.max_context)
    return invalid_argument("context " + std::to_string(o.context) + " outside [1, " +
                            std::to_string(config.max_context) + "] for model '" + config.name +
                            "'");
  if (o.max_sequences < 1 || o.max_sequences > kMaxSequences)
    return invalid_argument("max_sequences " + std::to_string(o.max_sequences) +
                            " outside [1, " + std::to_string(kMaxSequences) + "]");
  if (o.attention != AttentionNumeric::kF32 && o.attention != AttentionNumeric::kF16)
    return invalid_argument("attention numeric " + std::to_string(static_cast<int>(o.attention)) +
                            " is neither f32 nor f16");
  if (o.slack < 0 || o.slack > config.sliding_window)
    return invalid_argument("slack " + std::to_string(o.slack) + " outside [0, " +
                            std::to_string(config.sliding_window) + "] (the sliding window)");
  const std::int64_t full_rows = config.plane_capacity(LayerKind::kFullNope, o.context);
  if (o.block_rows == 0) {
    o.block_rows = 16;
    while (o.block_rows < 256 && o.block_rows < full_rows) o.block_rows *= 2;
  }
  if (o.block_rows < 16 || o.block_rows > 65536 || (o.block_rows & (o.block_rows - 1)) != 0)
    return invalid_argument("block_rows " + std::to_string(o.block_rows) +
                            " is not a power of two in [16, 65536]");
  std::int64_t n_full = 0;
  for (std::int64_t l = 0; l < config.n_layers; ++l)
    if (config.kind(l) == LayerKind::kFullNope) ++n_full;
  const std::int64_t per_plane = ceil_div(full_rows, o.block_rows);
  if (o.pool_blocks == 0) {
    if (per_plane > kMaxPoolBlocks / std::max<std::int64_t>(1, n_full * o.max_sequences))
      return invalid_argument("the default pool for " + std::to_string(o.max_sequences) +
                              " sequences at " + std::to_string(o.context) +
                              " positions is too large; give pool_blocks");
    o.pool_blocks = n_full * o.max_sequences * per_plane;
  }
  if (o.pool_blocks < 0 || o.pool_blocks > kMaxPoolBlocks)
    return invalid_argument("pool_blocks " + std::to_string(o.pool_blocks) + " outside [0, " +
                            std::to_string(kMaxPoolBlocks) + "]");
  // Each limit above holds alone, but their product may not fit 64 bits,
  // and a backend sizes its allocations by it.
  if (const auto bytes = storage_bytes(config, o); !bytes || *bytes > kMaxStoreBytes)
    return invalid_argument("a store of " + std::to_string(o.max_sequences) + " sequences' rings and " +
                            std::to_string(o.pool_blocks) + " blocks of " + std::to_string(o.block_rows) +
                            " rows (" + std::to_string(config.kv_dim() * 4) + " B a row) is past " +
                            std::to_string(kMaxStoreBytes) + " bytes");
  return o;
}

// ---- Transactions -----------------------------------------------------------

// What one operation changes, applied by commit or undone by rollback.
struct KvStore::Txn {
  std::vector<std::tuple<std::int32_t, std::int64_t, RingState>> rings;  // (slot, layer, state)
  // Tables as they were before this operation changed them.
  std::vector<std::tuple<std::int32_t, std::int64_t, std::vector<std::int32_t>>> saved;
  // Blocks taken from the pool, in order, each with whether it was fresh
  // (never taken before) rather than from the free list.
  std::vector<std::pair<std::int32_t, bool>> taken;
  std::vector<std::int32_t> dropped;                      // references released at commit
  std::vector<std::pair<std::int32_t, std::int32_t>> copies;  // shared block -> its copy
  std::vector<TableChange> changes;
  bool mirrored = false;  // tables_changed was called for `changes`

  Result<std::int32_t> take(KvStore& s) {
    std::lock_guard<std::mutex> lock(s.pool_mutex_);
    std::int32_t b;
    const bool fresh = s.free_.empty();
    if (!fresh) {
      b = s.free_.back();
      s.free_.pop_back();
    } else if (s.fresh_ < s.pool_blocks()) {
      b = static_cast<std::int32_t>(s.fresh_);
      auto& page = s.ref_pages_[static_cast<std::size_t>(b >> kRefPageBits)];
      if (!page) page = std::make_unique<std::int32_t[]>(static_cast<std::size_t>(kRefPage));
      ++s.fresh_;
    } else {
      // The blocks this call took so far are in use too until its refusal
      // gives them back: said, so that a call larger than the whole pool
      // does not read as a pool that others hold.
      return make_error(ErrorCode::kResourceExhausted,
                        "the block pool is exhausted: all " + std::to_string(s.pool_blocks()) +
                            " blocks of " + std::to_string(s.options_.block_rows) + " rows are in use" +
                            (taken.empty() ? std::string()
                                           : " (" + std::to_string(taken.size()) +
                                                 " of them taken by this call, given back as it is refused)"));
    }
    s.refs(b) = 1;
    taken.emplace_back(b, fresh);
    return b;
  }
  // Empties the transaction, keeping its vectors' storage.
  void clear() {
    serial = next_serial();
    rings.clear();
    saved.clear();
    taken.clear();
    dropped.clear();
    copies.clear();
    changes.clear();
    mirrored = false;
  }
  // Keeps a table as it was before this transaction first changes it.
  void save(KvStore& s, std::int32_t slot, std::int64_t fi) {
    Sequence& seq = s.slots_[static_cast<std::size_t>(slot)];
    std::uint64_t& mark = seq.saved_in[static_cast<std::size_t>(fi)];
    if (mark == serial) return;
    mark = serial;
    saved.emplace_back(slot, fi, seq.tables[static_cast<std::size_t>(fi)]);
  }
  // Distinct for every transaction of the process (and never 0, a fresh
  // table's mark), so a mark left by an earlier one never matches.
  std::uint64_t serial = next_serial();
  static std::uint64_t next_serial() {
    static std::atomic<std::uint64_t> counter{1};
    return counter.fetch_add(1, std::memory_order_relaxed);
  }
};

struct KvStore::Scratch {
  Txn txn;
  std::vector<RowWrite> writes;
  std::vector<AttendItem> items;
  std::vector<RingState> before;
  std::vector<char> copies;  // plan_store: per span, first_block_copies
  std::vector<BatchPlacement> placements;  // check_placements' answers, layer by layer
  // The transaction and vectors of one batched call, emptied.
  Txn& begin() {
    txn.clear();
    writes.clear();
    items.clear();
    before.clear();
    copies.clear();
    placements.clear();
    return txn;
  }
};

void KvStore::rollback(Txn& txn, bool restore_mirror) {
  for (auto& [slot, fi, table] : txn.saved)
    slots_[static_cast<std::size_t>(slot)].tables[static_cast<std::size_t>(fi)] = std::move(table);
  {
    // In reverse, so that the pool is as it was: the free list in its order
    // and the fresh blocks untaken again (a concurrent install may have
    // taken fresh blocks since; this one's then join the free list).
    std::lock_guard<std::mutex> lock(pool_mutex_);
    for (auto it = txn.taken.rbegin(); it != txn.taken.rend(); ++it) {
      const auto [b, fresh] = *it;
      refs(b) = 0;
      if (fresh && b == fresh_ - 1)
        --fresh_;
      else
        free_.push_back(b);
    }
  }
  if (txn.mirrored && restore_mirror) {
    // Point the mirrors back at the tables as they were.
    std::vector<TableChange> back;
    for (const auto& [slot, fi, unused] : txn.saved) {
      const auto& t = slots_[static_cast<std::size_t>(slot)].tables[static_cast<std::size_t>(fi)];
      if (!t.empty())
        back.push_back(TableChange{slot, fi, t.data(), 0, static_cast<std::int64_t>(t.size())});
    }
    if (!tables_changed(back, nullptr).ok())
      for (const auto& [slot, fi, unused] : txn.saved)
        slots_[static_cast<std::size_t>(slot)].stale = Sequence::Stale::kMirror;
  }
  txn.clear();
}

void KvStore::commit(Txn& txn) {
  for (const auto& [slot, layer, state] : txn.rings)
    slots_[static_cast<std::size_t>(slot)].rings[static_cast<std::size_t>(layer)] = state;
  std::lock_guard<std::mutex> lock(pool_mutex_);
  for (const std::int32_t b : txn.dropped) {
    auto& r = refs(b);
    if (--r == 0) free_.push_back(b);
  }
  txn.clear();
}

Status KvStore::copy_blocks(const Txn& txn, cudaStream_t stream) {
  for (const auto& [from, to] : txn.copies) KVRING_RETURN_IF_ERROR(copy_block(from, to, stream));
  return Status::Ok();
}

Status KvStore::apply_blocks(Txn& txn, cudaStream_t stream) {
  KVRING_RETURN_IF_ERROR(copy_blocks(txn, stream));
  if (!txn.changes.empty()) {
    txn.mirrored = true;
    KVRING_RETURN_IF_ERROR(tables_changed(txn.changes, stream));
  }
  return Status::Ok();
}

Status KvStore::tables_changed(std::span<const TableChange>, cudaStream_t) {
  return Status::Ok();
}

// ---- Construction -------------------------------------------------------------

KvStore::KvStore(ModelConfig config, StoreOptions o)
    : config_(std::move(config)), options_(o), tag_(next_store_tag()), scratch_(std::make_unique<Scratch>()) {
  for (std::int64_t l = 0; l < config_.n_layers; ++l)
    full_index_.push_back(config_.kind(l) == LayerKind::kFullNope ? n_full_++ : -1);
  ring_rows_ = ring_rows_of(config_, o);
  max_blocks_ = ceil_div(config_.plane_capacity(LayerKind::kFullNope, o.context), o.block_rows);
  slots_.resize(static_cast<std::size_t>(o.max_sequences));
  ref_pages_.resize(static_cast<std::size_t>(ceil_div(o.pool_blocks, kRefPage)));
  sinks_.resize(static_cast<std::size_t>(config_.n_layers));
  // zero_fill zeroes every ring at creation (the backends' allocate); the
  // slots' flags are made as sequences take them (slot_rings_known).
  rings_zero_ = o.zero_fill;
}

void KvStore::rings_made_zero() {
  rings_zero_ = true;
  for (Sequence& s : slots_) std::fill(s.ring_dirty.begin(), s.ring_dirty.end(), 0);
}

void KvStore::ring_written(std::int32_t slot, std::int64_t layer, std::int64_t rows) {
  slot_rings_known(slot);
  std::vector<std::int64_t>& z = slots_[static_cast<std::size_t>(slot)].ring_dirty;
  const std::int64_t end = rows < 0 ? ring_rows() : std::min(rows, ring_rows());
  if (layer < 0) {
    for (std::int64_t& d : z) d = std::max(d, end);
  } else {
    std::int64_t& d = z[static_cast<std::size_t>(layer)];
    d = std::max(d, end);
  }
}

Status KvStore::clear_dirty_rings(std::int32_t slot, std::int64_t layer, cudaStream_t stream) {
  slot_rings_known(slot);
  std::vector<std::int64_t>& dirty = slots_[static_cast<std::size_t>(slot)].ring_dirty;
  std::vector<RingRows> rows;
  const std::int64_t first = layer < 0 ? 0 : layer, end = layer < 0 ? n_layers() : layer + 1;
  for (std::int64_t l = first; l < end; ++l)
    if (full_index(l) < 0 && dirty[static_cast<std::size_t>(l)] > 0)
      rows.push_back(RingRows{slot, -1, l, 0, dirty[static_cast<std::size_t>(l)]});
  if (rows.empty()) return Status::Ok();
  KVRING_RETURN_IF_ERROR(set_ring_rows(rows, stream));
  for (const RingRows& r : rows) dirty[static_cast<std::size_t>(r.layer)] = 0;
  return Status::Ok();
}

Status KvStore::set_attention_sinks(std::int64_t layer, std::span<const float> sinks) {
  KVRING_RETURN_IF_ERROR(check_layer(layer));
  if (!sinks.empty()) {
    if (static_cast<std::int64_t>(sinks.size()) != config_.n_heads)
      return invalid_argument("layer " + std::to_string(layer) + ": " + std::to_string(sinks.size()) +
                              " attention sinks for " + std::to_string(config_.n_heads) +
                              " query heads");
    for (std::size_t h = 0; h < sinks.size(); ++h)
      if (!std::isfinite(sinks[h]))
        return invalid_argument("layer " + std::to_string(layer) + ": the attention sink of head " +
                                std::to_string(h) + " is not finite");
  }
  KVRING_RETURN_IF_ERROR(sinks_changed(layer, sinks));
  sinks_[static_cast<std::size_t>(layer)].assign(sinks.begin(), sinks.end());
  return Status::Ok();
}

Status KvStore::sinks_changed(std::int64_t, std::span<const float>) { return Status::Ok(); }

std::span<const float> KvStore::attention_sinks(std::int64_t layer) const {
  if (!check_layer(layer).ok()) return {};
  return sinks_[static_cast<std::size_t>(layer)];
}

Status KvStore::check_sinks(std::int64_t layer) const {
  if (!config_.attention_sinks || !sinks_[static_cast<std::size_t>(layer)].empty()) return Status::Ok();
  return make_error(ErrorCode::kConfig,
                    "layer " + std::to_string(layer) + ": " + config_.name +
                        " has attention sinks and none are set for this layer (set_attention_sinks)");
}

KvStore::~KvStore() { release_store_tag(tag_); }

Layout KvStore::layout(std::int64_t layer) const {
  if (!check_layer(layer).ok()) return Layout::kTokenMajor;
  return config_.kind(layer) == LayerKind::kSlidingRope ? Layout::kTokenMajor : Layout::kHeadMajor;
}

std::int64_t KvStore::capacity(std::int64_t layer) const {
  if (!check_layer(layer).ok()) return 0;
  return config_.kind(layer) == LayerKind::kSlidingRope
             ? ring_rows_
             : config_.plane_capacity(LayerKind::kFullNope, options_.context);
}

std::int64_t KvStore::ring_bytes() const { return ring_rows_ * config_.kv_dim() * 4; }
std::int64_t KvStore::block_bytes() const { return options_.block_rows * config_.kv_dim() * 4; }

std::int64_t KvStore::allocated_bytes() const { return *storage_bytes(config_, options_); }

std::int64_t KvStore::position_limit(std::int64_t layer) const {
  if (!check_layer(layer).ok()) return 0;
  // A full plane's own capacity bounds it (RingState::plan_batch).
  return config_.ring_stops_at_context(layer, options_.context) ? options_.context : kNoPositionLimit;
}

RingState KvStore::fresh_ring(std::int64_t layer) const {
  return config_.kind(layer) == LayerKind::kSlidingRope ? RingState::sliding(capacity(layer))
                                                        : RingState::full(capacity(layer));
}

// ---- Sequences ---------------------------------------------------------------------

SeqId KvStore::handle(std::size_t slot, std::uint32_t generation) const {
  return SeqId{(std::uint64_t{generation} << kGenerationShift) | (std::uint64_t{tag_} << kSlotBits) | slot};
}

Result<std::int32_t> KvStore::find_slot(SeqId seq, bool detached_ok) const {
  if (tag_part(seq) != tag_)
    return make_error(ErrorCode::kNotFound,
                      seq_name(seq) + " is not in this store (" +
                          (tag_part(seq) == 0 ? std::string("no store made this handle")
                                              : "a handle of another store: its tag is " +
                                                    std::to_string(tag_part(seq)) + ", this store's " +
                                                    std::to_string(tag_)) +
                          ")");
  const std::uint32_t slot = slot_part(seq);
  if (slot >= slots_.size() || !slots_[slot].live ||
      slots_[slot].generation != generation_part(seq))
    return make_error(ErrorCode::kNotFound,
                      seq_name(seq) + " is not in this store (never added, or removed)");
  if (!detached_ok && slots_[slot].detached)
    return make_error(ErrorCode::kNotFound,
                      seq_name(seq) + " is detached (still being installed); attach it first");
  return static_cast<std::int32_t>(slot);
}

Result<std::int32_t> KvStore::usable_slot(SeqId seq, bool detached_ok) const {
  auto slot = find_slot(seq, detached_ok);
  if (!slot) return slot;
  switch (slots_[static_cast<std::size_t>(*slot)].stale) {
    case Sequence::Stale::kNo:
      return slot;
    case Sequence::Stale::kMirror:
      return make_error(ErrorCode::kCuda,
                        seq_name(seq) + "'s block tables on the device could not be restored after a "
                                        "failed call, so its rows are neither read nor written; reset "
                                        "or remove it");
    case Sequence::Stale::kOverwritten:
      break;
  }
  return make_error(ErrorCode::kCuda,
                    seq_name(seq) + " lost live rows of a full sliding ring to a write the backend failed "
                                    "part-way through, so its rows are neither read nor written; reset "
                                    "or remove it");
}

Result<std::int32_t> KvStore::slot_of(SeqId seq) const { return usable_slot(seq, false); }
Result<std::int32_t> KvStore::slot_any(SeqId seq) const { return usable_slot(seq, true); }

bool KvStore::contains(SeqId seq) const { return find_slot(seq, false).ok(); }

std::vector<SeqId> KvStore::sequences() const {
  std::vector<SeqId> out;
  for (std::size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i].live && !slots_[i].detached)
      out.push_back(handle(i, slots_[i].generation));
  return out;
}

std::int64_t KvStore::sequence_count() const {
  return static_cast<std::int64_t>(std::count_if(
      slots_.begin(), slots_.end(), [](const Sequence& s) { return s.live && !s.detached; }));
}

std::int64_t KvStore::free_slots() const {
  return static_cast<std::int64_t>(std::count_if(
      slots_.begin(), slots_.end(), [](const Sequence& s) { return !s.live && s.generation != kRetired; }));
}

Status KvStore::check_free_slot() const {
  if (free_slots() > 0) return Status::Ok();
  return make_error(ErrorCode::kResourceExhausted, slots_taken());
}

Result<SeqId> KvStore::add_sequence() { return add_slot(false); }
Result<SeqId> KvStore::add_detached_sequence() { return add_slot(true); }

bool KvStore::is_detached(SeqId seq) const {
  auto slot = find_slot(seq, true);
  return slot && slots_[static_cast<std::size_t>(*slot)].detached;
}

Status KvStore::attach_sequence(SeqId seq) {
  auto slot = slot_any(seq);
  if (!slot) return slot.error();
  Sequence& s = slots_[static_cast<std::size_t>(*slot)];
  if (!s.detached) return invalid_argument(seq_name(seq) + " is already live");
  // Whole, or not at all: a layer left out or rows never written would
  // read whatever the blocks and rings held before.
  const std::int64_t end = s.rings[0].next_position();
  for (std::int64_t l = 0; l < n_layers(); ++l) {
    const RingState& r = s.rings[static_cast<std::size_t>(l)];
    if (r.next_position() != end)
      return invalid_argument("attach_sequence: " + seq_name(seq) + " is not whole: layer " + std::to_string(l) +
                              " ends at position " + std::to_string(r.next_position()) + ", layer 0 at " +
                              std::to_string(end));
    const std::int64_t written = s.written[static_cast<std::size_t>(l)].rows;
    if (written != r.len())
      return invalid_argument("attach_sequence: " + seq_name(seq) + " is not whole: layer " + std::to_string(l) +
                              " has " + std::to_string(written) + " of its " + std::to_string(r.len()) +
                              " live rows written");
  }
  s.detached = false;
  s.written.clear();
  return Status::Ok();
}

void KvStore::mark_installed(std::int32_t slot, std::int64_t layer, bool rows_written) {
  Sequence& s = slots_[static_cast<std::size_t>(slot)];
  if (!s.detached) return;
  const std::int64_t len = s.rings[static_cast<std::size_t>(layer)].len();
  Sequence::Written& w = s.written[static_cast<std::size_t>(layer)];
  w.bits.assign(static_cast<std::size_t>(ceil_div(len, 64)), rows_written ? ~std::uint64_t{0} : 0);
  w.rows = rows_written ? len : 0;
}

void KvStore::mark_written(std::int32_t slot, std::int64_t layer, std::int64_t first, std::int64_t count,
                           bool written) {
  Sequence& s = slots_[static_cast<std::size_t>(slot)];
  const std::int64_t from = first - s.rings[static_cast<std::size_t>(layer)].origin_logical();
  Sequence::Written& w = s.written[static_cast<std::size_t>(layer)];
  for (std::int64_t i = from; i < from + count; ++i) {
    std::uint64_t& word = w.bits[static_cast<std::size_t>(i >> 6)];
    const std::uint64_t bit = std::uint64_t{1} << (i & 63);
    if (((word & bit) != 0) != written) {
      w.rows += written ? 1 : -1;
      word ^= bit;
    }
  }
}

std::size_t KvStore::free_slot() {
  while (free_from_ < slots_.size() && (slots_[free_from_].live || slots_[free_from_].generation == kRetired))
    ++free_from_;
  return free_from_;
}

std::string KvStore::slots_taken() const {
  const auto retired = std::count_if(slots_.begin(), slots_.end(),
                                     [](const Sequence& s) { return !s.live && s.generation == kRetired; });
  std::string m = "every one of the store's " + std::to_string(slots_.size()) + " sequence slots is taken";
  if (retired > 0)
    m += " (" + std::to_string(retired) + " retired: a slot is not used again after 2^32 - 1 sequences)";
  return m;
}

Result<SeqId> KvStore::add_slot(bool detached) {
  const std::size_t i = free_slot();
  if (i == slots_.size()) return make_error(ErrorCode::kResourceExhausted, slots_taken());
  const auto slot = static_cast<std::int32_t>(i);
  slot_rings_known(slot);
  // Under zero_fill a new sequence's rings are zero: those some write
  // reached since they were made or cleared are cleared.
  if (options_.zero_fill) KVRING_RETURN_IF_ERROR(clear_dirty_rings(slot, -1, nullptr));
  Sequence& s = slots_[i];
  s.live = true;
  s.detached = detached;
  s.rings.clear();
  for (std::int64_t l = 0; l < n_layers(); ++l) s.rings.push_back(fresh_ring(l));
  s.tables.assign(static_cast<std::size_t>(n_full_), {});
  s.saved_in.assign(static_cast<std::size_t>(n_full_), 0);
  s.written.assign(detached ? static_cast<std::size_t>(n_layers()) : 0, {});
  return handle(i, s.generation);
}

void KvStore::release_table(std::vector<std::int32_t>& table) {
  for (const std::int32_t b : table) {
    auto& r = refs(b);
    if (--r == 0) free_.push_back(b);
  }
  table.clear();
}

void KvStore::release_tables(Sequence& s) {
  for (auto& t : s.tables) release_table(t);
}

Status KvStore::remove_sequence(SeqId seq) {
  auto slot = find_slot(seq, true);
  if (!slot) return slot.error();
  vacate(*slot, true);
  return Status::Ok();
}

void KvStore::vacate(std::int32_t slot, bool retire_handle) {
  Sequence& s = slots_[static_cast<std::size_t>(slot)];
  release_tables(s);
  s.live = false;
  free_from_ = std::min(free_from_, static_cast<std::size_t>(slot));
  s.detached = false;
  s.stale = Sequence::Stale::kNo;
  s.rings.clear();
  s.written.clear();
  if (retire_handle) ++s.generation;
}

Status KvStoreAccess::discard(KvStore& store, SeqId seq) {
  auto slot = store.find_slot(seq, true);
  if (!slot) return slot.error();
  store.vacate(*slot, false);
  return Status::Ok();
}

Status KvStore::reset_sequence(SeqId seq) {
  auto slot = find_slot(seq, false);
  if (!slot) return slot.error();
  // The rows are forgotten first, so a ring whose zeroing fails holds no
  // row the store still names; a failed clear is reported. Empty
  // tables read no entry of the device's copy, so a stale one is over.
  Sequence& s = slots_[static_cast<std::size_t>(*slot)];
  release_tables(s);
  s.stale = Sequence::Stale::kNo;
  for (std::int64_t l = 0; l < n_layers(); ++l) s.rings[static_cast<std::size_t>(l)] = fresh_ring(l);
  return options_.zero_fill ? clear_dirty_rings(*slot, -1, nullptr) : Status::Ok();
}

Result<SeqId> KvStore::fork_sequence(SeqId source) {
  auto from = slot_of(source);
  if (!from) return from.error();
  const std::size_t i = free_slot();
  if (i == slots_.size())
    return make_error(ErrorCode::kResourceExhausted, "cannot fork " + seq_name(source) + ": " + slots_taken());
  const auto to = static_cast<std::int32_t>(i);
  // Each ring takes the source's rows that may be other than zero; under
  // zero_fill the rows past them that the slot's last writes reached are
  // cleared, so the ring equals the source's whole. The extents cover both
  // until the call succeeds: a call that fails part-way leaves the slot's
  // rings written, for the next add to zero.
  slot_rings_known(*from);
  slot_rings_known(to);
  const std::vector<std::int64_t>& from_dirty = slots_[static_cast<std::size_t>(*from)].ring_dirty;
  std::vector<std::int64_t>& dirty = slots_[i].ring_dirty;
  std::vector<RingRows> rows;
  for (std::int64_t l = 0; l < n_layers(); ++l) {
    if (full_index(l) >= 0) continue;
    const std::int64_t had = from_dirty[static_cast<std::size_t>(l)];
    std::int64_t& d = dirty[static_cast<std::size_t>(l)];
    if (had > 0) rows.push_back(RingRows{to, *from, l, 0, had});
    if (options_.zero_fill && d > had) rows.push_back(RingRows{to, -1, l, had, d});
    d = std::max(d, had);
  }
  if (!rows.empty()) KVRING_RETURN_IF_ERROR(set_ring_rows(rows, nullptr));
  for (const RingRows& r : rows)
    if (r.from < 0) dirty[static_cast<std::size_t>(r.layer)] = r.begin;
  const Sequence& src = slots_[static_cast<std::size_t>(*from)];
  Sequence& dst = slots_[i];
  dst.live = true;
  dst.rings = src.rings;
  dst.tables = src.tables;
  dst.saved_in.assign(static_cast<std::size_t>(n_full_), 0);
  for (const auto& t : dst.tables)
    for (const std::int32_t b : t) ++refs(b);
  std::vector<TableChange> changes;
  for (std::int64_t fi = 0; fi < n_full_; ++fi) {
    const auto& t = dst.tables[static_cast<std::size_t>(fi)];
    if (!t.empty())
      changes.push_back(TableChange{to, fi, t.data(), 0, static_cast<std::int64_t>(t.size())});
  }
  if (Status st = tables_changed(changes, nullptr); !st.ok()) {
    // The fork's handle never left: the slot keeps its generation.
    vacate(to, false);
    return st.error();
  }
  return handle(i, dst.generation);
}

Status KvStore::truncate_sequence(SeqId seq, std::int64_t tokens) {
  if (auto slot = slot_of(seq); !slot) return slot.error();
  auto next = next_position(seq);
  if (!next) return next.error();
  if (tokens < 0 || tokens > *next)
    return invalid_argument("cannot roll " + seq_name(seq) + " back by " +
                            std::to_string(tokens) + " tokens: it holds " +
                            std::to_string(*next));
  return truncate_sequence_to(seq, *next - tokens);
}

Status KvStore::truncate_sequence_to(SeqId seq, std::int64_t end) {
  auto slot = slot_of(seq);
  if (!slot) return slot.error();
  Sequence& s = slots_[static_cast<std::size_t>(*slot)];
  const auto refused = [&](const std::string& why) {
    return invalid_argument("cannot roll " + seq_name(seq) + " back to position " + std::to_string(end) + ": " +
                            why);
  };
  if (end < 0) return refused("a position is at least 0");
  std::vector<RingState> rings = s.rings;
  for (std::int64_t l = 0; l < n_layers(); ++l) {
    RingState& r = rings[static_cast<std::size_t>(l)];
    if (r.next_position() < end)
      return refused("layer " + std::to_string(l) + " holds only " + std::to_string(r.next_position()) + " tokens");
    if (r.next_position() == end) continue;  // nothing to roll back
    // A sliding ring must still hold oldest_kept at the new end; with
    // `slack` extra rows it always does for the last `slack` tokens.
    const std::int64_t need = oldest_kept(end, r.capacity(), options_.slack);
    if (r.wraps() && r.origin_logical() > need)
      return refused("layer " + std::to_string(l) + "'s ring no longer holds position " + std::to_string(need) +
                     " (rollback is guaranteed to within " + std::to_string(options_.slack) +
                     " tokens, the store's slack, of the furthest position it reached, and not before a restore)");
    auto back = r.rolled_back(r.next_position() - end);
    if (!back) return back.error();
    r = *back;
  }
  s.rings = std::move(rings);
  for (std::int64_t fi = 0; fi < n_full_; ++fi) {
    auto& t = s.tables[static_cast<std::size_t>(fi)];
    const auto keep = static_cast<std::size_t>(ceil_div(end, options_.block_rows));
    for (std::size_t b = keep; b < t.size(); ++b) {
      auto& r = refs(t[b]);
      if (--r == 0) free_.push_back(t[b]);
    }
    if (t.size() > keep) t.resize(keep);
  }
  return Status::Ok();
}

Result<std::int64_t> KvStore::rollback_floor(SeqId seq) const {
  auto slot = slot_of(seq);
  if (!slot) return slot.error();
  // truncate_sequence_to(P) needs P <= every layer's end and, for each
  // layer that ends past P, P >= its floor: its origin, and for a sliding
  // ring that has dropped rows, origin + capacity - slack (oldest_kept).
  std::int64_t floor = 0, ceiling = std::numeric_limits<std::int64_t>::max();
  for (const RingState& r : slots_[static_cast<std::size_t>(*slot)].rings) {
    const std::int64_t own = r.wraps() && r.origin_logical() > 0
                                 ? r.origin_logical() + r.capacity() - options_.slack
                                 : r.origin_logical();
    floor = std::max(floor, std::min(own, r.next_position()));
    ceiling = std::min(ceiling, r.next_position());
  }
  if (floor > ceiling)
    return invalid_argument(seq_name(seq) + " cannot be rolled back to one position: a layer ends at " +
                            std::to_string(ceiling) + ", another keeps nothing before " + std::to_string(floor));
  return floor;
}

Result<std::int64_t> KvStore::next_position(SeqId seq) const {
  auto slot = find_slot(seq, true);
  if (!slot) return slot.error();
  const auto& rings = slots_[static_cast<std::size_t>(*slot)].rings;
  if (rings.empty()) return invalid_argument("the store has no layers");
  const std::int64_t next = rings[0].next_position();
  for (std::size_t l = 1; l < rings.size(); ++l)
    if (rings[l].next_position() != next) {
      Error e = cache_discontinuity(static_cast<std::int64_t>(l), next, rings[l].next_position());
      e.message = seq_name(seq) + ": " + e.message;
      return e;
    }
  return next;
}

Result<RingState> KvStore::ring(SeqId seq, std::int64_t layer) const {
  auto slot = find_slot(seq, true);
  if (!slot) return slot.error();
  KVRING_RETURN_IF_ERROR(check_layer(layer));
  return slots_[static_cast<std::size_t>(*slot)].rings[static_cast<std::size_t>(layer)];
}

Result<std::int64_t> KvStore::blocks_held(SeqId seq) const {
  auto slot = find_slot(seq, true);
  if (!slot) return slot.error();
  std::int64_t n = 0;
  for (const auto& t : slots_[static_cast<std::size_t>(*slot)].tables)
    n += static_cast<std::int64_t>(t.size());
  return n;
}

Result<std::int64_t> KvStore::blocks_held_alone(SeqId seq) const {
  auto slot = find_slot(seq, true);
  if (!slot) return slot.error();
  std::int64_t n = 0;
  for (const auto& t : slots_[static_cast<std::size_t>(*slot)].tables)
    n += std::count_if(t.begin(), t.end(), [&](std::int32_t b) { return refs(b) == 1; });
  return n;
}

Result<KvStore::InstallBlocks> KvStore::blocks_to_install(SeqId seq, std::int64_t layer,
                                                          std::int64_t rows) const {
  auto slot = slot_any(seq);
  if (!slot) return slot.error();
  KVRING_RETURN_IF_ERROR(check_layer(layer));
  if (rows < 0 || rows > capacity(layer))
    return invalid_argument(std::to_string(rows) + " rows do not fit layer " + std::to_string(layer) +
                            " (capacity " + std::to_string(capacity(layer)) + ")");
  InstallBlocks n;
  const std::int64_t fi = full_index(layer);
  if (fi < 0) return n;
  // As plan_plane: blocks held alone within the rows are reused, the rest
  // of the rows take new blocks, blocks held alone past them go back.
  const auto& table = slots_[static_cast<std::size_t>(*slot)].tables[static_cast<std::size_t>(fi)];
  const auto blocks = static_cast<std::size_t>(ceil_div(rows, options_.block_rows));
  for (std::size_t b = 0; b < std::max(blocks, table.size()); ++b) {
    const bool alone = b < table.size() && refs(table[b]) == 1;
    if (b < blocks && !alone) ++n.take;
    if (b < blocks && b < table.size() && !alone) ++n.shared;
    if (b >= blocks && alone) ++n.give;
  }
  return n;
}

Result<std::int64_t> KvStore::blocks_to_store(std::span<const SeqSpan> spans) const {
  const std::int64_t B = options_.block_rows;
  // What storing the spans would refuse in any layer is refused here too:
  // an unknown or repeated sequence, an empty span, a span that does not
  // continue a plane, runs past it or past the layer's position limit.
  auto slots = slots_of_spans(spans, true);
  if (!slots) return slots.error();
  for (std::int64_t l = 0; l < n_layers(); ++l) KVRING_RETURN_IF_ERROR(check_placements(l, spans, *slots));
  std::int64_t n = 0;
  std::vector<char> copies;
  for (std::int64_t fi = 0; fi < n_full_; ++fi) {
    first_block_copies(spans, *slots, fi, copies);
    for (std::size_t i = 0; i < spans.size(); ++i) {
      const SeqSpan& sp = spans[i];
      const auto held = static_cast<std::int64_t>(
          slots_[static_cast<std::size_t>((*slots)[i])].tables[static_cast<std::size_t>(fi)].size());
      n += std::max<std::int64_t>(0, ceil_div(sp.start + sp.count, B) - held) + copies[i];
    }
  }
  return n;
}

// ---- Checks ----------------------------------------------------------------------

Status KvStore::check_layer(std::int64_t layer) const {
  if (layer < 0 || layer >= config_.n_layers)
    return invalid_argument("layer " + std::to_string(layer) + " outside [0, " +
                            std::to_string(config_.n_layers) + ")");
  return Status::Ok();
}

KvStore::PlaneRef KvStore::plane_ref(std::int32_t slot, std::int64_t layer) const {
  PlaneRef p;
  p.slot = slot;
  p.layer = layer;
  const std::int64_t fi = full_index(layer);
  if (fi >= 0) {
    const auto& t = slots_[static_cast<std::size_t>(slot)].tables[static_cast<std::size_t>(fi)];
    p.blocks = t.data();
    p.n_blocks = static_cast<std::int64_t>(t.size());
  }
  return p;
}

namespace {

constexpr std::int64_t kMostViewElements = std::int64_t{1} << 44;

Status check_shape(const char* what, const void* data, std::int64_t rows, std::int64_t cols,
                   std::int64_t stride, std::int64_t want_rows, std::int64_t want_cols) {
  if (rows != want_rows || cols != want_cols)
    return invalid_argument(std::string(what) + " is [" + std::to_string(rows) + ", " +
                            std::to_string(cols) + "], the call needs [" +
                            std::to_string(want_rows) + ", " + std::to_string(want_cols) + "]");
  if (stride < cols)
    return invalid_argument(std::string(what) + ": row stride " + std::to_string(stride) +
                            " is less than its " + std::to_string(cols) + " columns");
  if (rows > 0 && stride > (std::numeric_limits<std::int64_t>::max() / 8) / rows)
    return invalid_argument(std::string(what) + ": row stride " + std::to_string(stride) +
                            " is too large");
  // A view no address space holds (2^44 elements are 64 TiB of f32, past
  // what a 48-bit user space maps beside anything else) is a caller's
  // mistake, refused before a row is touched.
  if (rows > 0 && (rows - 1) * stride + cols > kMostViewElements)
    return invalid_argument(std::string(what) + ": " + std::to_string(rows) + " rows of stride " +
                            std::to_string(stride) + " span more than 2^44 elements, more than any memory holds");
  if (rows > 0 && data == nullptr) return invalid_argument(std::string(what) + " is null");
  return Status::Ok();
}

// A view's extent in bytes, from its first element to its last row's end
// (check_shape bounds it first: under 2^44 elements).
std::uint64_t view_bytes(DType dtype, std::int64_t rows, std::int64_t cols, std::int64_t stride) {
  if (rows <= 0) return 0;
  return static_cast<std::uint64_t>((rows - 1) * stride + cols) * static_cast<std::uint64_t>(dtype_bytes(dtype));
}

// The bytes of `rows` packed f16 rows of `kv_dim`; a count no memory holds
// saturates, and is refused as such where the backend checks extents.
std::uint64_t rows_bytes(std::int64_t rows, std::int64_t kv_dim) {
  if (rows <= 0) return 0;
  if (rows > kMostViewElements / kv_dim) return std::numeric_limits<std::uint64_t>::max();
  return static_cast<std::uint64_t>(rows * kv_dim) * sizeof(std::uint16_t);
}

// A view's space and dtype are values of their enums: the row readers
// handle those and nothing else.
Status check_kinds(const char* what, MemorySpace space, DType dtype) {
  if (space != MemorySpace::kHost && space != MemorySpace::kDevice)
    return invalid_argument(std::string(what) + ": memory space " +
                            std::to_string(static_cast<int>(space)) + " is neither host nor device");
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16)
    return invalid_argument(std::string(what) + ": dtype " + std::to_string(static_cast<int>(dtype)) +
                            " is none of f32, f16, bf16");
  return Status::Ok();
}

// The bytes [begin, end) a view of `rows` > 0 rows covers.
struct Extent {
  std::uintptr_t begin, end;
};
template <class View>
Extent extent_of(const View& v) {
  const auto begin = reinterpret_cast<std::uintptr_t>(v.data);
  const auto elems = static_cast<std::uintptr_t>((v.rows - 1) * v.row_stride + v.cols);
  return {begin, begin + elems * static_cast<std::uintptr_t>(dtype_bytes(v.dtype))};
}
bool overlap(Extent a, Extent b) { return a.begin < b.end && b.begin < a.end; }

std::int64_t floor_div(std::int64_t a, std::int64_t b) {  // b > 0
  const std::int64_t q = a / b;
  return q * b > a ? q - 1 : q;
}
// Whether a row of `a` shares a byte with a row of `b` (rows > 0 each; one
// address space holds host and device memory). Where the views' extents meet: views of one row
// stride (rows of out beside rows of q in each row of one buffer) are
// answered exactly by one division; otherwise each row of the view of
// fewer rows finds by division the other's rows it could meet, up to
// kExactRows rows, past which the answer is kUnresolved (refused).
enum class Overlap { kApart, kShared, kUnresolved };
template <class A, class B>
Overlap rows_overlap(const A& a, const B& b) {
  if (!overlap(extent_of(a), extent_of(b))) return Overlap::kApart;
  constexpr std::int64_t kExactRows = std::int64_t{1} << 16;
  struct Rows {
    std::int64_t first, stride, bytes, n;
  };
  auto rows_of = [](const auto& v) {
    const auto e = static_cast<std::int64_t>(dtype_bytes(v.dtype));
    return Rows{static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(v.data)), v.row_stride * e, v.cols * e,
                v.rows};
  };
  Rows few = rows_of(a), many = rows_of(b);
  if (few.n > many.n) std::swap(few, many);
  if (few.stride == many.stride && few.stride > 0) {
    // Row j of `few` meets row i of `many` where k = i - j, in
    // [-(few.n - 1), many.n - 1], has k * stride in (d - many.bytes, d + few.bytes).
    const std::int64_t d = few.first - many.first;
    const std::int64_t lo = std::max(-(few.n - 1), floor_div(d - many.bytes, few.stride) + 1);
    const std::int64_t hi = std::min(many.n - 1, floor_div(d + few.bytes - 1, few.stride));
    return lo <= hi ? Overlap::kShared : Overlap::kApart;
  }
  if (few.n > kExactRows) return Overlap::kUnresolved;
  for (std::int64_t j = 0; j < few.n; ++j) {
    // Rows i of `many` with many.first + i * stride in (f - many.bytes, f + few.bytes).
    const std::int64_t f = few.first + j * few.stride - many.first;
    const std::int64_t lo = std::max<std::int64_t>(0, floor_div(f - many.bytes, many.stride) + 1);
    const std::int64_t hi = std::min(many.n - 1, floor_div(f + few.bytes - 1, many.stride));
    if (lo <= hi) return Overlap::kShared;
  }
  return Overlap::kApart;
}

// The output of an attention call may be its queries exactly (each output
// row is written after its query row is read), but may share a byte with
// nothing else it reads: a prefill reads its K and V again when it stores
// them. Views of either space are compared: host and device addresses
// share one address space, and managed memory may be named both ways.
Status check_out_apart(const MutView& out, const char* what, const ConstView& in, bool may_equal) {
  if (out.rows < 1 || in.rows < 1) return Status::Ok();
  if (may_equal && out.data == in.data && out.row_stride == in.row_stride && out.dtype == in.dtype)
    return Status::Ok();
  switch (rows_overlap(out, in)) {
    case Overlap::kApart:
      return Status::Ok();
    case Overlap::kShared:
      return invalid_argument(std::string("out overlaps ") + what +
                              (may_equal ? " (it may be q itself, row for row, and nothing else)" : ""));
    case Overlap::kUnresolved:
      break;
  }
  return invalid_argument(std::string("out and ") + what + " lie within each other's extent with other row " +
                          "strides over more than 65536 rows, which is not checked row by row; give them " +
                          "apart, or one row stride");
}

// Two outputs of `values` f16 values each must not share a byte: one would
// overwrite the other.
Status check_apart(const char* what, const std::uint16_t* k, const std::uint16_t* v,
                   std::int64_t values) {
  const auto bytes = static_cast<std::uintptr_t>(values) * sizeof(std::uint16_t);
  const auto a = reinterpret_cast<std::uintptr_t>(k), b = reinterpret_cast<std::uintptr_t>(v);
  if (overlap(Extent{a, a + bytes}, Extent{b, b + bytes}))
    return invalid_argument(std::string(what) + ": the k and v buffers overlap");
  return Status::Ok();
}

}  // namespace

Status KvStore::check_rows_view(const char* what, const ConstView& v, std::int64_t rows,
                                std::int64_t cols) const {
  KVRING_RETURN_IF_ERROR(check_shape(what, v.data, v.rows, v.cols, v.row_stride, rows, cols));
  KVRING_RETURN_IF_ERROR(check_kinds(what, v.space, v.dtype));
  return check_view(what, v.space, v.dtype, v.data, view_bytes(v.dtype, v.rows, v.cols, v.row_stride));
}

Status KvStore::check_out_view(const char* what, const MutView& v, std::int64_t rows,
                               std::int64_t cols) const {
  KVRING_RETURN_IF_ERROR(check_shape(what, v.data, v.rows, v.cols, v.row_stride, rows, cols));
  KVRING_RETURN_IF_ERROR(check_kinds(what, v.space, v.dtype));
  if (v.dtype != DType::kF32)
    return invalid_argument(std::string(what) + " is " + dtype_name(v.dtype) +
                            "; attention writes f32");
  return check_view(what, v.space, v.dtype, v.data, view_bytes(v.dtype, v.rows, v.cols, v.row_stride));
}

Status KvStore::check_attention(const ConstView&, const MutView&) const { return Status::Ok(); }

Result<BatchPlacement> KvStore::place_span(std::int64_t layer, const RingState& r, const SeqSpan& sp,
                                           std::int64_t limit) const {
  auto placement = r.plan_batch(layer, sp.start, sp.count);
  if (!placement) {
    Error e = placement.error();  // its fields (layer, expected, got) kept
    e.message = seq_name(sp.seq) + ": " + e.message;
    return e;
  }
  if (sp.count > limit - sp.start)
    return make_error(ErrorCode::kCapacityExceeded,
                      seq_name(sp.seq) + ", layer " + std::to_string(layer) +
                          ": a ring shorter than the window holds positions [0, " + std::to_string(limit) +
                          ") (the store's context), asked for position " + std::to_string(sp.start + sp.count - 1));
  return placement;
}

Status KvStore::check_placements(std::int64_t layer, std::span<const SeqSpan> spans,
                                 std::span<const std::int32_t> slots,
                                 std::vector<BatchPlacement>* placements) const {
  const std::int64_t limit = position_limit(layer);
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const RingState& r = slots_[static_cast<std::size_t>(slots[i])].rings[static_cast<std::size_t>(layer)];
    auto placed = place_span(layer, r, spans[i], limit);
    if (!placed) return placed.error();
    if (placements != nullptr) placements->push_back(*placed);
  }
  return Status::Ok();
}

Result<std::vector<std::int32_t>> KvStore::slots_of_spans(std::span<const SeqSpan> spans,
                                                          bool unique) const {
  std::vector<std::int32_t> slots;
  slots.reserve(spans.size());
  for (const SeqSpan& s : spans) {
    auto slot = slot_of(s.seq);
    if (!slot) return slot.error();
    if (s.count < 1 || s.count > kMaxBatchRows)
      return invalid_argument(seq_name(s.seq) + ": a span of " + std::to_string(s.count) +
                              " tokens");
    slots.push_back(*slot);
  }
  if (unique) {
    std::vector<std::int32_t> sorted = slots;
    std::sort(sorted.begin(), sorted.end());
    if (auto twice = std::adjacent_find(sorted.begin(), sorted.end()); twice != sorted.end()) {
      const auto at = std::find(slots.begin(), slots.end(), *twice) - slots.begin();
      return invalid_argument(seq_name(spans[static_cast<std::size_t>(at)].seq) +
                              " appears more than once in one batch");
    }
  }
  return slots;
}

// ---- Planning ---------------------------------------------------------------------

std::int32_t KvStore::block_at(std::int32_t slot, std::int64_t fi, std::int64_t position) const {
  const auto& table = slots_[static_cast<std::size_t>(slot)].tables[static_cast<std::size_t>(fi)];
  const std::int64_t b = position / options_.block_rows;
  return b >= 0 && b < static_cast<std::int64_t>(table.size()) ? table[static_cast<std::size_t>(b)] : -1;
}

void KvStore::first_block_copies(std::span<const SeqSpan> spans, std::span<const std::int32_t> slots,
                                 std::int64_t fi, std::vector<char>& copies) const {
  copies.assign(spans.size(), 0);
  // Per shared block: how many spans start in it, and the one that starts
  // furthest (the last of equals).
  struct Writers {
    std::int64_t count = 0;
    std::size_t furthest = 0;
  };
  std::unordered_map<std::int32_t, Writers> writers;
  auto shared_first = [&](std::size_t i) -> std::int32_t {
    const std::int32_t block = block_at(slots[i], fi, spans[i].start);
    return block >= 0 && refs(block) > 1 ? block : -1;
  };
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const std::int32_t block = shared_first(i);
    if (block < 0) continue;
    Writers& w = writers[block];
    if (w.count == 0 || spans[i].start >= spans[w.furthest].start) w.furthest = i;
    ++w.count;
  }
  if (writers.empty()) return;
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const std::int32_t block = shared_first(i);
    if (block < 0) continue;
    const Writers& w = writers.at(block);
    copies[i] = w.furthest != i || w.count != refs(block);
  }
}

Status KvStore::plan_store(Txn& txn, std::int64_t layer, std::span<const SeqSpan> spans,
                           std::span<const std::int32_t> slots, std::span<const BatchPlacement> placements,
                           std::vector<RowWrite>& writes) {
  const std::int64_t fi = full_index(layer);
  const std::int64_t B = options_.block_rows;
  // Which spans copy the shared block they start in, decided on the tables
  // as they are before this call changes any.
  std::vector<char>& copies = scratch_->copies;
  if (fi >= 0)
    first_block_copies(spans, slots, fi, copies);
  else
    copies.assign(spans.size(), 0);
  std::int64_t row = 0;
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const std::int32_t slot = slots[i];
    Sequence& s = slots_[static_cast<std::size_t>(slot)];
    RingState r = s.rings[static_cast<std::size_t>(layer)];
    r.commit_batch(spans[i].count);
    txn.rings.emplace_back(slot, layer, r);
    if (fi >= 0) {
      // Full planes never wrap: physical row == position. The block that
      // receives the first row is written only while this sequence alone
      // holds it, or every other holder copies it in this call; blocks past
      // the table's end are new.
      auto& table = s.tables[static_cast<std::size_t>(fi)];
      const std::int64_t first_block = spans[i].start / B;
      const std::int64_t end_block = ceil_div(spans[i].start + spans[i].count, B);
      const bool shared = copies[i] != 0;
      if (shared || end_block > static_cast<std::int64_t>(table.size())) {
        txn.save(*this, slot, fi);
        const std::int64_t change_from =
            shared ? first_block : static_cast<std::int64_t>(table.size());
        if (shared) {
          auto copy = txn.take(*this);
          if (!copy) return copy.error();
          const std::int32_t old = table[static_cast<std::size_t>(first_block)];
          txn.copies.emplace_back(old, *copy);
          txn.dropped.push_back(old);
          table[static_cast<std::size_t>(first_block)] = *copy;
        }
        while (static_cast<std::int64_t>(table.size()) < end_block) {
          auto b = txn.take(*this);
          if (!b) return b.error();
          table.push_back(*b);
        }
        txn.changes.push_back(TableChange{slot, fi, nullptr, change_from, end_block - change_from});
      }
    }
    writes.push_back(RowWrite{plane_ref(slot, layer), row, placements[i]});
    row += spans[i].count;
  }
  return Status::Ok();
}


void KvStore::seal(Txn& txn) {
  for (auto& c : txn.changes)
    c.table = slots_[static_cast<std::size_t>(c.slot)].tables[static_cast<std::size_t>(c.full_index)].data();
}

Status KvStore::finish_store(Txn& txn, std::vector<RowWrite>& writes, const ConstView& k,
                             const ConstView& v, cudaStream_t stream) {
  seal(txn);
  for (auto& w : writes) w.plane = plane_ref(w.plane.slot, w.plane.layer);
  rows_written_ = false;
  Status st = copy_blocks(txn, stream);
  if (st.ok()) {
    txn.mirrored = !txn.changes.empty();
    for (const RowWrite& w : writes) ring_written(w.plane.slot, w.plane.layer, rows_end(w.placement));
    st = write_rows(txn.changes, writes, k, v, stream);
  }
  return settle(txn, st, writes);
}

Status KvStore::settle(Txn& txn, const Status& st, std::span<const RowWrite> writes) {
  if (!st.ok()) {
    rollback(txn);
    mark_overwritten(st, writes);
    return st;
  }
  commit(txn);
  return Status::Ok();
}

void KvStore::mark_overwritten(const Status& failed, std::span<const RowWrite> writes) {
  if (failed.ok() || failed.error().code != ErrorCode::kCuda || !rows_written_) return;
  for (const RowWrite& w : writes) {
    Sequence& s = slots_[static_cast<std::size_t>(w.plane.slot)];
    const RingState& r = s.rings[static_cast<std::size_t>(w.plane.layer)];
    if (r.wraps() && r.len() + w.placement.live_rows > r.capacity() && s.stale == Sequence::Stale::kNo)
      s.stale = Sequence::Stale::kOverwritten;
  }
}

// ---- Batched operations ------------------------------------------------------------

Status KvStore::store(std::int64_t layer, std::span<const SeqSpan> spans, const ConstView& k,
                      const ConstView& v, cudaStream_t stream) {
  KVRING_RETURN_IF_ERROR(check_layer(layer));
  auto slots = slots_of_spans(spans, true);
  if (!slots) return slots.error();
  std::int64_t rows = 0;
  for (const SeqSpan& s : spans) rows += s.count;
  KVRING_RETURN_IF_ERROR(check_rows_view("k", k, rows, config_.kv_dim()));
  KVRING_RETURN_IF_ERROR(check_rows_view("v", v, rows, config_.kv_dim()));
  if (spans.empty()) return Status::Ok();
  Txn& txn = scratch_->begin();
  std::vector<BatchPlacement>& placements = scratch_->placements;
  KVRING_RETURN_IF_ERROR(check_placements(layer, spans, *slots, &placements));
  std::vector<RowWrite>& writes = scratch_->writes;
  if (Status st = plan_store(txn, layer, spans, *slots, placements, writes); !st.ok()) {
    rollback(txn);
    return st;
  }
  return finish_store(txn, writes, k, v, stream);
}

Status KvStore::store_all_layers(std::span<const SeqSpan> spans, const ConstView& k,
                                 const ConstView& v, cudaStream_t stream) {
  auto slots = slots_of_spans(spans, true);
  if (!slots) return slots.error();
  std::int64_t rows = 0;
  for (const SeqSpan& s : spans) rows += s.count;
  KVRING_RETURN_IF_ERROR(check_rows_view("k", k, rows * n_layers(), config_.kv_dim()));
  KVRING_RETURN_IF_ERROR(check_rows_view("v", v, rows * n_layers(), config_.kv_dim()));
  if (spans.empty()) return Status::Ok();
  Txn& txn = scratch_->begin();
  std::vector<BatchPlacement>& placements = scratch_->placements;
  for (std::int64_t l = 0; l < n_layers(); ++l)
    KVRING_RETURN_IF_ERROR(check_placements(l, spans, *slots, &placements));
  std::vector<RowWrite>& writes = scratch_->writes;
  writes.reserve(spans.size() * static_cast<std::size_t>(n_layers()));
  txn.rings.reserve(writes.capacity());
  for (std::int64_t l = 0; l < n_layers(); ++l) {
    const std::size_t first = writes.size();
    const std::span<const BatchPlacement> layer_placements =
        std::span<const BatchPlacement>(placements).subspan(static_cast<std::size_t>(l) * spans.size(), spans.size());
    if (Status st = plan_store(txn, l, spans, *slots, layer_placements, writes); !st.ok()) {
      rollback(txn);
      return st;
    }
    for (std::size_t w = first; w < writes.size(); ++w) writes[w].source_row += l * rows;
  }
  return finish_store(txn, writes, k, v, stream);
}

Status KvStore::attend_decode(std::int64_t layer, std::span<const SeqQuery> queries,
                              const ConstView& q, const MutView& out, cudaStream_t stream) {
  KVRING_RETURN_IF_ERROR(check_layer(layer));
  KVRING_RETURN_IF_ERROR(check_sinks(layer));
  const std::int64_t width = config_.n_heads * config_.head_dim;
  const auto n = static_cast<std::int64_t>(queries.size());
  KVRING_RETURN_IF_ERROR(check_rows_view("q", q, n, width));
  KVRING_RETURN_IF_ERROR(check_out_view("out", out, n, width));
  KVRING_RETURN_IF_ERROR(check_attention(q, out));
  KVRING_RETURN_IF_ERROR(check_out_apart(out, "q", q, true));
  scratch_->begin();
  std::vector<AttendItem>& items = scratch_->items;
  items.reserve(queries.size());
  for (std::int64_t i = 0; i < n; ++i) {
    const SeqQuery& query = queries[static_cast<std::size_t>(i)];
    auto slot = slot_of(query.seq);
    if (!slot) return slot.error();
    const RingState& r =
        slots_[static_cast<std::size_t>(*slot)].rings[static_cast<std::size_t>(layer)];
    const std::int64_t p = query.position;
    if (p < 0)
      return invalid_argument(seq_name(query.seq) + ", layer " + std::to_string(layer) + ": decode at position " +
                              std::to_string(p) + ": positions start at 0");
    const std::int64_t lo = visible_begin(config_, config_.kind(layer), p);
    if (!r.holds(p) || lo < r.origin_logical())
      return invalid_argument(seq_name(query.seq) + ", layer " + std::to_string(layer) +
                              ": decode at position " + std::to_string(p) + " needs rows " +
                              std::to_string(lo) + " to " + std::to_string(p) +
                              ", live are [" + std::to_string(r.origin_logical()) + ", " +
                              std::to_string(r.next_position()) + ")");
    items.push_back(AttendItem{plane_ref(*slot, layer), r, p, 1, p + 1, i, 0});
  }
  if (items.empty()) return Status::Ok();
  return attend(AttendBatch{layer, items, &q, &out, nullptr, nullptr, stream});
}

Status KvStore::prefill(std::int64_t layer, std::span<const SeqSpan> chunks, const ConstView& k,
                        const ConstView& v, const ConstView& q, const MutView& out,
                        cudaStream_t stream) {
  KVRING_RETURN_IF_ERROR(check_layer(layer));
  KVRING_RETURN_IF_ERROR(check_sinks(layer));
  auto slots = slots_of_spans(chunks, true);
  if (!slots) return slots.error();
  std::int64_t rows = 0;
  for (const SeqSpan& s : chunks) rows += s.count;
  const std::int64_t width = config_.n_heads * config_.head_dim;
  KVRING_RETURN_IF_ERROR(check_rows_view("k", k, rows, config_.kv_dim()));
  KVRING_RETURN_IF_ERROR(check_rows_view("v", v, rows, config_.kv_dim()));
  KVRING_RETURN_IF_ERROR(check_rows_view("q", q, rows, width));
  KVRING_RETURN_IF_ERROR(check_out_view("out", out, rows, width));
  KVRING_RETURN_IF_ERROR(check_attention(q, out));
  KVRING_RETURN_IF_ERROR(check_out_apart(out, "q", q, true));
  KVRING_RETURN_IF_ERROR(check_out_apart(out, "k", k, false));
  KVRING_RETURN_IF_ERROR(check_out_apart(out, "v", v, false));
  if (chunks.empty()) return Status::Ok();
  // The rings as before the chunks: attention reads the rows before each
  // chunk from the plane and the chunk's own rows from k and v.
  Txn& txn = scratch_->begin();
  std::vector<BatchPlacement>& placements = scratch_->placements;
  KVRING_RETURN_IF_ERROR(check_placements(layer, chunks, *slots, &placements));
  std::vector<RowWrite>& writes = scratch_->writes;
  std::vector<RingState>& before = scratch_->before;
  std::vector<AttendItem>& items = scratch_->items;
  for (std::size_t i = 0; i < chunks.size(); ++i)
    before.push_back(
        slots_[static_cast<std::size_t>((*slots)[i])].rings[static_cast<std::size_t>(layer)]);
  if (Status st = plan_store(txn, layer, chunks, *slots, placements, writes); !st.ok()) {
    rollback(txn);
    return st;
  }
  seal(txn);
  std::int64_t row = 0;
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    writes[i].plane = plane_ref((*slots)[i], layer);
    const SeqSpan& c = chunks[i];
    // A chunk whose first query sees rows the ring no longer holds is
    // refused, as in decode. No call leaves a ring rolled back past its
    // window (truncate_sequence and install refuse one); this keeps the
    // kernels' reads inside the live rows whatever the state.
    const std::int64_t lo = visible_begin(config_, config_.kind(layer), c.start);
    if (lo < c.start && lo < before[i].origin_logical()) {
      rollback(txn);
      return invalid_argument(seq_name(c.seq) + ", layer " + std::to_string(layer) +
                              ": a chunk from position " + std::to_string(c.start) + " needs rows from " +
                              std::to_string(lo) + ", live are [" +
                              std::to_string(before[i].origin_logical()) + ", " +
                              std::to_string(before[i].next_position()) + ")");
    }
    items.push_back(AttendItem{writes[i].plane, before[i], c.start, c.count, c.start, row, row});
    row += c.count;
  }
  rows_written_ = false;
  Status st = apply_blocks(txn, stream);
  for (const RowWrite& w : writes) ring_written(w.plane.slot, w.plane.layer, rows_end(w.placement));
  if (st.ok()) st = attend_and_store(AttendBatch{layer, items, &q, &out, &k, &v, stream}, writes);
  return settle(txn, st, writes);
}

Status KvStore::attend_and_store(const AttendBatch& batch, std::span<const RowWrite> writes) {
  KVRING_RETURN_IF_ERROR(attend(batch));
  return write_rows({}, writes, *batch.chunk_k, *batch.chunk_v, batch.stream);
}

// ---- Rows of one sequence ------------------------------------------------------------

Status KvStore::check_rows_memory(MemorySpace space, const std::uint16_t* k,
                                  const std::uint16_t* v, std::int64_t rows) const {
  if (k == nullptr || v == nullptr) return invalid_argument("rows: null buffer");
  KVRING_RETURN_IF_ERROR(check_kinds("rows", space, DType::kF16));
  const auto bytes = rows_bytes(rows, config_.kv_dim());
  KVRING_RETURN_IF_ERROR(check_view("k", space, DType::kF16, k, bytes));
  return check_view("v", space, DType::kF16, v, bytes);
}

Status KvStore::check_live(SeqId seq, std::int64_t layer, const RingState& r, std::int64_t first,
                           std::int64_t count) const {
  if (!r.holds_rows(first, count))
    return invalid_argument(seq_name(seq) + ", layer " + std::to_string(layer) + ": " +
                            std::to_string(count) + " rows from position " +
                            std::to_string(first) + " are not all live (live: [" +
                            std::to_string(r.origin_logical()) + ", " +
                            std::to_string(r.next_position()) + "))");
  return Status::Ok();
}

Status KvStore::read_rows(SeqId seq, std::int64_t layer, std::int64_t first, std::int64_t count,
                          std::uint16_t* k, std::uint16_t* v, MemorySpace space,
                          cudaStream_t stream) const {
  // A detached sequence's rows may not all be written yet: not readable.
  auto slot = slot_of(seq);
  if (!slot) return slot.error();
  KVRING_RETURN_IF_ERROR(check_layer(layer));
  if (count == 0) return Status::Ok();
  KVRING_RETURN_IF_ERROR(check_rows_memory(space, k, v, count));
  const RingState& r = slots_[static_cast<std::size_t>(*slot)].rings[static_cast<std::size_t>(layer)];
  KVRING_RETURN_IF_ERROR(check_live(seq, layer, r, first, count));
  KVRING_RETURN_IF_ERROR(check_apart("read_rows", k, v, count * config_.kv_dim()));
  return copy_out(plane_ref(*slot, layer), r.spans(first, count), k, v, space, stream);
}

Status KvStore::read_plane(SeqId seq, std::int64_t layer, std::uint16_t* k,
                           std::uint16_t* v) const {
  auto slot = slot_of(seq);
  if (!slot) return slot.error();
  KVRING_RETURN_IF_ERROR(check_layer(layer));
  KVRING_RETURN_IF_ERROR(check_rows_memory(MemorySpace::kHost, k, v, capacity(layer)));
  KVRING_RETURN_IF_ERROR(check_apart("read_plane", k, v, capacity(layer) * config_.kv_dim()));
  if (full_index(layer) < 0) return read_ring(*slot, layer, k, v);
  const std::int64_t kv_dim = config_.kv_dim();
  const std::int64_t hd = config_.head_dim;
  const std::int64_t cap = capacity(layer);
  // Host buffers may sit at any address (store.h): bytes are copied, never
  // stored through a misaligned std::uint16_t*.
  const auto plane_bytes = static_cast<std::size_t>(cap * kv_dim) * sizeof(std::uint16_t);
  std::memset(k, 0, plane_bytes);
  std::memset(v, 0, plane_bytes);
  const RingState& r = slots_[static_cast<std::size_t>(*slot)].rings[static_cast<std::size_t>(layer)];
  if (r.len() == 0) return Status::Ok();
  std::vector<std::uint16_t> rk(static_cast<std::size_t>(r.len() * kv_dim)), rv(rk.size());
  KVRING_RETURN_IF_ERROR(copy_out(plane_ref(*slot, layer), r.live_spans(), rk.data(), rv.data(),
                                  MemorySpace::kHost, nullptr));
  const auto head_bytes = static_cast<std::size_t>(hd) * sizeof(std::uint16_t);
  for (std::int64_t row = 0; row < r.len(); ++row)
    for (std::int64_t h = 0; h < config_.n_kv_heads; ++h) {
      const auto dst = head_major_index(static_cast<std::uint64_t>(h), static_cast<std::uint64_t>(row), 0,
                                        static_cast<std::uint64_t>(cap), static_cast<std::uint64_t>(hd));
      const auto src = static_cast<std::size_t>(row * kv_dim + h * hd);
      std::memcpy(reinterpret_cast<unsigned char*>(k) + dst * sizeof(std::uint16_t), rk.data() + src, head_bytes);
      std::memcpy(reinterpret_cast<unsigned char*>(v) + dst * sizeof(std::uint16_t), rv.data() + src, head_bytes);
    }
  return Status::Ok();
}

namespace {

// A ring state install() accepts for a plane of `capacity` (sliding or full).
Status check_install_ring(std::int64_t layer, const RingState& state, std::int64_t capacity,
                          bool sliding, std::int64_t limit, std::int64_t slack) {
  // Positions within [0, 2^62] and a length within the capacity first, so
  // that nothing below is computed past 64 bits (a rolled-back ring may
  // have moved its origin without being full).
  if (state.len() < 0 || state.len() > state.capacity() || state.origin_logical() < 0 ||
      state.origin_logical() > (std::int64_t{1} << 62) - state.len())
    return invalid_argument("layer " + std::to_string(layer) + ": ring state of " + std::to_string(state.len()) +
                            " rows from position " + std::to_string(state.origin_logical()) +
                            " lies outside positions [0, 2^62]");
  if (state.capacity() != capacity || state.wraps() != sliding)
    return make_error(ErrorCode::kMismatch,
                      "layer " + std::to_string(layer) + ": plane of capacity " +
                          std::to_string(state.capacity()) + " (" +
                          (state.wraps() ? "sliding" : "full") + ") does not fit capacity " +
                          std::to_string(capacity) + " (" + (sliding ? "sliding" : "full") + ")");
  if (state.next_position() > limit)
    return make_error(ErrorCode::kCapacityExceeded,
                      "layer " + std::to_string(layer) + ": ring state reaches position " +
                          std::to_string(state.next_position()) + ", past the " + std::to_string(limit) +
                          " a ring shorter than the window holds (the store's context)");
  const std::int64_t rotation = sliding ? state.origin_logical() % state.capacity() : 0;
  if (state.origin_physical() != rotation || (!sliding && state.origin_logical() != 0))
    return invalid_argument("layer " + std::to_string(layer) +
                            ": ring state is not the rotation of a sequentially built ring");
  // A sliding ring holds at least the rows a ring without slack holds at
  // its end, as truncate_sequence keeps them: no state the store refuses
  // to roll back into comes in through an install.
  const std::int64_t need = oldest_kept(state.next_position(), capacity, slack);
  if (sliding && state.origin_logical() > need)
    return invalid_argument("layer " + std::to_string(layer) + ": sliding ring state ends at position " +
                            std::to_string(state.next_position()) + " but no longer holds position " +
                            std::to_string(need) + " (rolled back past its window)");
  return Status::Ok();
}

}  // namespace

Status KvStore::plan_plane(Txn& txn, std::int32_t slot, std::int64_t layer,
                           const RingState& state) {
  Sequence& s = slots_[static_cast<std::size_t>(slot)];
  const std::int64_t fi = full_index(layer);
  if (fi >= 0) {
    // The rows go into the blocks the plane holds alone, then into new
    // ones; blocks it shares are replaced, blocks past the rows released.
    txn.save(*this, slot, fi);
    auto& table = s.tables[static_cast<std::size_t>(fi)];
    const auto blocks = static_cast<std::size_t>(ceil_div(state.len(), options_.block_rows));
    for (std::size_t b = blocks; b < table.size(); ++b) txn.dropped.push_back(table[b]);
    if (table.size() > blocks) table.resize(blocks);
    for (std::size_t b = 0; b < blocks; ++b) {
      if (b < table.size() && refs(table[b]) == 1) continue;
      auto got = txn.take(*this);
      if (!got) return got.error();
      if (b < table.size()) {
        txn.dropped.push_back(table[b]);
        table[b] = *got;
      } else {
        table.push_back(*got);
      }
    }
    if (blocks > 0)
      txn.changes.push_back(
          TableChange{slot, fi, table.data(), 0, static_cast<std::int64_t>(blocks)});
  }
  return Status::Ok();
}

Status KvStore::ready_plane(Txn& txn, std::int32_t slot, std::int64_t layer,
                            const RingState& state, cudaStream_t stream) {
  KVRING_RETURN_IF_ERROR(apply_blocks(txn, stream));
  // Rows the install does not overwrite read as in a fresh ring: a ring
  // that holds only zeros already is left untouched (a fresh store's pages
  // stay unmapped until rows land).
  if (full_index(layer) < 0 && state.len() < state.capacity())
    KVRING_RETURN_IF_ERROR(clear_dirty_rings(slot, layer, stream));
  return Status::Ok();
}

void KvStore::empty_plane(Txn& txn, std::int32_t slot, std::int64_t layer) {
  // Rows of reused blocks may have changed: the plane is left empty. The
  // transaction changed this plane's table alone, and an empty table reads
  // no entry of the device's copy, so that copy is left as it is (and an
  // install, which may run beside installs of other layers, never marks
  // the sequence stale).
  rollback(txn, false);
  Sequence& s = slots_[static_cast<std::size_t>(slot)];
  s.rings[static_cast<std::size_t>(layer)] = fresh_ring(layer);
  const std::int64_t fi = full_index(layer);
  if (fi >= 0) {
    std::lock_guard<std::mutex> lock(pool_mutex_);
    release_table(s.tables[static_cast<std::size_t>(fi)]);
  }
}

Status KvStore::install(SeqId seq, std::int64_t layer, const RingState& state,
                        const std::uint16_t* k, const std::uint16_t* v, MemorySpace space,
                        cudaStream_t stream) {
  auto slot = slot_any(seq);
  if (!slot) return slot.error();
  KVRING_RETURN_IF_ERROR(check_layer(layer));
  KVRING_RETURN_IF_ERROR(
      check_install_ring(layer, state, capacity(layer), full_index(layer) < 0, position_limit(layer),
                         options_.slack));
  if (state.len() > 0) KVRING_RETURN_IF_ERROR(check_rows_memory(space, k, v, state.len()));
  Txn txn;
  if (Status st = plan_plane(txn, *slot, layer, state); !st.ok()) {
    rollback(txn);
    return st;
  }
  Status st = ready_plane(txn, *slot, layer, state, stream);
  if (st.ok()) {
    ring_written(*slot, layer);
    st = copy_in(plane_ref(*slot, layer), state.live_spans(), k, v, space, stream);
  }
  if (!st.ok()) {
    empty_plane(txn, *slot, layer);
    mark_installed(*slot, layer, false);
    return st;
  }
  txn.rings.emplace_back(*slot, layer, state);
  commit(txn);
  mark_installed(*slot, layer, true);
  return Status::Ok();
}

Status KvStore::install_plane(SeqId seq, std::int64_t layer, const RingState& state,
                              cudaStream_t stream) {
  auto slot = slot_any(seq);
  if (!slot) return slot.error();
  if (!slots_[static_cast<std::size_t>(*slot)].detached)
    return invalid_argument("install_plane: " + seq_name(seq) +
                            " is live; only a detached sequence takes a plane before its rows");
  KVRING_RETURN_IF_ERROR(check_layer(layer));
  KVRING_RETURN_IF_ERROR(
      check_install_ring(layer, state, capacity(layer), full_index(layer) < 0, position_limit(layer),
                         options_.slack));
  Txn txn;
  if (Status st = plan_plane(txn, *slot, layer, state); !st.ok()) {
    rollback(txn);
    return st;
  }
  if (Status st = ready_plane(txn, *slot, layer, state, stream); !st.ok()) {
    empty_plane(txn, *slot, layer);
    mark_installed(*slot, layer, false);
    return st;
  }
  txn.rings.emplace_back(*slot, layer, state);
  commit(txn);
  mark_installed(*slot, layer, false);
  return Status::Ok();
}

Status KvStore::install_rows(SeqId seq, std::int64_t layer, std::int64_t first,
                             std::int64_t count, const std::uint16_t* k, const std::uint16_t* v,
                             MemorySpace space, cudaStream_t stream) {
  auto slot = slot_any(seq);
  if (!slot) return slot.error();
  if (!slots_[static_cast<std::size_t>(*slot)].detached)
    return invalid_argument("install_rows: " + seq_name(seq) +
                            " is live; rows are written into a detached sequence only");
  KVRING_RETURN_IF_ERROR(check_layer(layer));
  if (count == 0) return Status::Ok();
  KVRING_RETURN_IF_ERROR(check_rows_memory(space, k, v, count));
  const RingState& r = slots_[static_cast<std::size_t>(*slot)].rings[static_cast<std::size_t>(layer)];
  KVRING_RETURN_IF_ERROR(check_live(seq, layer, r, first, count));
  ring_written(*slot, layer);
  // A copy that fails part-way may have replaced some of the rows (K or V)
  // of an earlier install: they count as not written, so attach_sequence
  // refuses the sequence until they are written again.
  const Status st = copy_in(plane_ref(*slot, layer), r.spans(first, count), k, v, space, stream);
  mark_written(*slot, layer, first, count, st.ok());
  return st;
}

}  // namespace kvring
