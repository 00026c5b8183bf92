#include "kvring/snapshot.h"

#include <algorithm>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>

#include "core/store_access.h"
#include "cpu/host_pages.h"
#include "cpu/parallel.h"
#include "kvring/backend.h"
#include "kvring/pack.h"

namespace kvring {

void* allocate_rows(std::size_t bytes) {
  using cpu::kHugePageBytes;
  if (bytes < kHugePageBytes) {
    void* p = std::malloc(bytes == 0 ? 1 : bytes);
    if (p == nullptr) throw std::bad_alloc();
    return p;
  }
  const std::size_t rounded = (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  void* p = std::aligned_alloc(kHugePageBytes, rounded);
  if (p == nullptr) throw std::bad_alloc();
  cpu::advise_huge_pages(p, rounded);
  return p;
}

void free_rows(void* p, std::size_t) noexcept { std::free(p); }

Layout layout_for(LayerKind kind) {
  return kind == LayerKind::kSlidingRope ? Layout::kTokenMajor : Layout::kHeadMajor;
}

std::int64_t Snapshot::row_bytes() const {
  std::int64_t n = 0;
  for (const PlaneSnapshot& p : planes) n += p.ring.len() * config.kv_dim() * 2 * 2;
  return n;
}

namespace {

std::string layer_str(std::int64_t layer) { return "layer " + std::to_string(layer); }

// Runs fn(layer) for every layer; on the CPU backend the planes are
// independent, so layers run on all cores. The first failure in layer order
// is returned.
template <class Fn>
Status for_each_layer(BackendKind backend, std::int64_t n_layers, std::int64_t work, Fn&& fn) {
  std::vector<Status> status(static_cast<std::size_t>(n_layers));
  auto body = [&](std::int64_t l) { status[static_cast<std::size_t>(l)] = fn(l); };
  if (backend == BackendKind::kCpu)
    cpu::parallel_for(n_layers, work, body);
  else
    for (std::int64_t l = 0; l < n_layers; ++l) body(l);
  for (const Status& s : status) KVRING_RETURN_IF_ERROR(s);
  return Status::Ok();
}

// The first geometry field that differs, named as config.json names it.
Status compare_geometry(const ModelConfig& pack, const ModelConfig& model) {
  if (pack.fingerprint() == model.fingerprint()) return Status::Ok();
  auto differ = [&](const char* field, std::int64_t a, std::int64_t b) {
    return make_error(ErrorCode::kMismatch,
                      "the snapshot is of another model geometry: " + std::string(field) + " " +
                          std::to_string(a) + " in the snapshot, " + std::to_string(b) +
                          " in model '" + model.name + "' (fingerprints " +
                          pack.fingerprint_hex().substr(0, 16) + " vs " +
                          model.fingerprint_hex().substr(0, 16) + ")");
  };
  if (pack.n_layers != model.n_layers) return differ("num_hidden_layers", pack.n_layers, model.n_layers);
  if (pack.n_heads != model.n_heads) return differ("num_attention_heads", pack.n_heads, model.n_heads);
  if (pack.n_kv_heads != model.n_kv_heads)
    return differ("num_key_value_heads", pack.n_kv_heads, model.n_kv_heads);
  if (pack.head_dim != model.head_dim) return differ("head_dim", pack.head_dim, model.head_dim);
  if (pack.sliding_window != model.sliding_window)
    return differ("sliding_window", pack.sliding_window, model.sliding_window);
  if (pack.max_context != model.max_context)
    return differ("max_position_embeddings", pack.max_context, model.max_context);
  for (std::int64_t l = 0; l < pack.n_layers; ++l)
    if (pack.kind(l) != model.kind(l))
      return make_error(ErrorCode::kMismatch,
                        "the snapshot is of another model geometry: " + layer_str(l) + " is " +
                            layer_kind_name(pack.kind(l)) + " in the snapshot, " +
                            layer_kind_name(model.kind(l)) + " in model '" + model.name + "'");
  return make_error(ErrorCode::kMismatch, "the snapshot's geometry fingerprint differs from model '" +
                                              model.name + "'");
}

// The ring `target` plane `layer` gets, and the first snapshot row it takes.
struct Placement {
  RingState ring;
  std::int64_t skip_rows = 0;
};

// The target ring holds the last min(capacity, snapshot rows) rows, at the
// rotation a sequentially built ring has (origin_logical % capacity); a
// sliding ring needs at least the rows a ring without slack would hold.
Result<Placement> place(const Snapshot& s, std::int64_t layer, const KvStore& target) {
  const PlaneSnapshot& p = s.planes[static_cast<std::size_t>(layer)];
  const std::int64_t capacity = target.capacity(layer);
  const bool wraps = target.config().kind(layer) == LayerKind::kSlidingRope;
  auto full_ring = RingState::sequential(capacity, wraps, s.token_count);
  if (!full_ring)
    return make_error(ErrorCode::kCapacityExceeded,
                      layer_str(layer) + ": the snapshot holds " + std::to_string(s.token_count) +
                          " positions; the target's full plane holds " +
                          std::to_string(capacity) + " (store context " +
                          std::to_string(target.context()) + ")");
  if (s.token_count > target.position_limit(layer))
    return make_error(ErrorCode::kCapacityExceeded,
                      layer_str(layer) + ": the snapshot holds " + std::to_string(s.token_count) +
                          " positions; the target's sliding ring, shorter than the window, stops at its context " +
                          std::to_string(target.context()));
  const std::int64_t unslacked = wraps ? capacity - target.options().slack : capacity;
  auto needed = RingState::sequential(unslacked, wraps, s.token_count);
  if (!needed) return needed.error();
  if (needed->len() > p.ring.len())
    return make_error(ErrorCode::kMismatch,
                      layer_str(layer) + ": the target ring of capacity " +
                          std::to_string(capacity) + " needs positions [" +
                          std::to_string(needed->origin_logical()) + ", " +
                          std::to_string(s.token_count) + "), the snapshot holds only [" +
                          std::to_string(p.ring.origin_logical()) + ", " +
                          std::to_string(s.token_count) + ")");
  const std::int64_t rows = std::min(full_ring->len(), p.ring.len());
  const std::int64_t origin = s.token_count - rows;
  if (origin > 0 && rows < capacity) {
    // Rows from past position 0 that do not fill the ring (a target with
    // rollback slack): the state of a sequentially built ring rolled back
    // to token_count, which is what a live ring holds there.
    auto built = RingState::sequential(capacity, wraps, origin + capacity);
    if (!built)
      return make_error(ErrorCode::kCapacityExceeded,
                        layer_str(layer) + ": the snapshot's " + std::to_string(s.token_count) +
                            " positions lie within the target's rollback slack of " +
                            std::to_string(target.options().slack) +
                            " rows of the 2^62 position bound (" + built.error().message +
                            "); a store without slack takes it");
    auto back = built->rolled_back(capacity - rows);
    if (!back) return back.error();
    return Placement{*back, p.ring.len() - rows};
  }
  auto ring = RingState::from_parts(capacity, wraps, rows, origin, origin % capacity);
  if (!ring) return ring.error();
  return Placement{*ring, p.ring.len() - rows};
}

}  // namespace

Status validate_snapshot(const Snapshot& s, bool header_only) {
  KVRING_RETURN_IF_ERROR(s.config.validate());
  const ModelConfig& c = s.config;
  if (s.context < 1 || s.context > c.max_context)
    return invalid_argument("snapshot context " + std::to_string(s.context) + " outside [1, " +
                            std::to_string(c.max_context) + "]");
  if (s.token_count < 0)
    return invalid_argument("snapshot token_count " + std::to_string(s.token_count) + " < 0");
  if (!s.token_ids.empty() && static_cast<std::int64_t>(s.token_ids.size()) != s.token_count)
    return invalid_argument("snapshot has " + std::to_string(s.token_ids.size()) +
                            " token ids for " + std::to_string(s.token_count) + " tokens");
  if (static_cast<std::int64_t>(s.planes.size()) != c.n_layers)
    return invalid_argument("snapshot has " + std::to_string(s.planes.size()) + " planes for " +
                            std::to_string(c.n_layers) + " layers");
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    const PlaneSnapshot& p = s.planes[static_cast<std::size_t>(l)];
    const std::string where = layer_str(l) + ": ";
    if (p.kind != c.kind(l))
      return invalid_argument(where + "plane kind " + layer_kind_name(p.kind) + ", the geometry says " +
                              layer_kind_name(c.kind(l)));
    if (p.layout != layout_for(p.kind))
      return invalid_argument(where + "layout " + std::to_string(static_cast<int>(p.layout)) +
                              " is not the layout of a " + layer_kind_name(p.kind) + " plane");
    const std::int64_t capacity = c.plane_capacity(l, s.context);
    if (p.ring.capacity() != capacity || p.ring.wraps() != (p.kind == LayerKind::kSlidingRope))
      return invalid_argument(where + "ring capacity " + std::to_string(p.ring.capacity()) +
                              ", a plane at context " + std::to_string(s.context) + " has " +
                              std::to_string(capacity));
    // No cache of this context holds more (KvStore::position_limit).
    if (c.ring_stops_at_context(l, s.context) && s.token_count > s.context)
      return invalid_argument(where + "a ring of " + std::to_string(capacity) + " rows, shorter than the window of " +
                              std::to_string(c.sliding_window) + ", stops at the context, " +
                              std::to_string(s.context) + "; the snapshot is at " + std::to_string(s.token_count));
    // (Its parts in range first, so that their sum cannot overflow: a
    // RingState's bytes may have been set by hand.)
    if (p.ring.len() < 0 || p.ring.len() > capacity || p.ring.origin_logical() < 0 ||
        p.ring.origin_logical() > kMaxTokenCount)
      return invalid_argument(where + "ring of " + std::to_string(p.ring.len()) + " rows from position " +
                              std::to_string(p.ring.origin_logical()) + " is out of range (capacity " +
                              std::to_string(capacity) + ", positions up to 2^62)");
    if (p.ring.next_position() != s.token_count)
      return invalid_argument(where + "ring ends at position " +
                              std::to_string(p.ring.next_position()) + ", the snapshot at " +
                              std::to_string(s.token_count));
    // Live rings are built sequentially (KvCache accepts no other), so a
    // snapshot's ring state follows from token_count and capacity.
    auto sequential = RingState::sequential(p.ring.capacity(), p.ring.wraps(), s.token_count);
    if (!sequential || !(*sequential == p.ring))
      return invalid_argument(where + "ring origin_physical " +
                              std::to_string(p.ring.origin_physical()) +
                              " is not the rotation of a sequentially built ring");
    if (header_only) continue;
    const auto values = static_cast<std::size_t>(p.ring.len() * c.kv_dim());
    if (p.k.size() != values || p.v.size() != values)
      return invalid_argument(where + "row buffers hold " + std::to_string(p.k.size()) + " and " +
                              std::to_string(p.v.size()) + " values, the ring needs " +
                              std::to_string(values));
  }
  return Status::Ok();
}

Result<Snapshot> take_snapshot(const KvStore& store, SeqId seq) {
  Snapshot s;
  KVRING_RETURN_IF_ERROR(take_snapshot(store, seq, s));
  return s;
}

namespace {

// Everything but the rows; with `rows`, the row buffers sized for them
// (else emptied, their memory kept).
Status take_header(const KvStore& store, SeqId seq, Snapshot& s, bool rows) {
  s.token_ids.clear();
  s.metadata.clear();
  s.config = store.config();
  s.context = store.context();
  // A detached sequence's rows may not all be written yet (read_rows
  // refuses it): neither its snapshot nor its header is taken.
  if (store.is_detached(seq))
    return make_error(ErrorCode::kNotFound,
                      seq_name(seq) + " is detached (still being installed); attach it first");
  auto next = store.next_position(seq);
  if (!next) return next.error();
  s.token_count = *next;
  // resize keeps the buffers of planes that stay; equal sizes touch nothing.
  s.planes.resize(static_cast<std::size_t>(store.n_layers()));
  const std::int64_t kv_dim = s.config.kv_dim();
  try {
    for (std::int64_t l = 0; l < store.n_layers(); ++l) {
      PlaneSnapshot& p = s.planes[static_cast<std::size_t>(l)];
      p.kind = s.config.kind(l);
      p.layout = store.layout(l);
      // The ring a sequentially built plane of the store's context holds
      // (without the rollback slack): what the format records, whatever
      // forks and rollbacks the live sequence went through.
      auto live = store.ring(seq, l);
      if (!live) return live.error();
      auto ring = RingState::sequential(s.config.plane_capacity(l, s.context), live->wraps(),
                                        s.token_count);
      if (!ring) return ring.error();
      // A ring that lacks those rows (rolled back past its window, which
      // truncate_sequence and install refuse to leave) cannot be recorded.
      if (ring->origin_logical() < live->origin_logical())
        return invalid_argument(layer_str(l) + ": a snapshot records positions [" +
                                std::to_string(ring->origin_logical()) + ", " +
                                std::to_string(s.token_count) + "); " + seq_name(seq) +
                                " holds only [" + std::to_string(live->origin_logical()) + ", " +
                                std::to_string(s.token_count) + ")");
      p.ring = *ring;
      p.k.resize(rows ? static_cast<std::size_t>(p.ring.len() * kv_dim) : 0);
      p.v.resize(p.k.size());
    }
  } catch (const std::bad_alloc&) {
    return make_error(ErrorCode::kIOError, "out of host memory for a snapshot of " +
                                               std::to_string(s.token_count) + " positions");
  }
  return Status::Ok();
}

Status take_into(const KvStore& store, SeqId seq, Snapshot& s) {
  KVRING_RETURN_IF_ERROR(take_header(store, seq, s, /*rows=*/true));
  return for_each_layer(store.backend(), store.n_layers(), s.row_bytes(), [&](std::int64_t l) {
    PlaneSnapshot& p = s.planes[static_cast<std::size_t>(l)];
    return store.read_rows(seq, l, p.ring.origin_logical(), p.ring.len(), p.k.data(), p.v.data());
  });
}

}  // namespace

Status take_snapshot(const KvStore& store, SeqId seq, Snapshot& s) {
  Status st = take_into(store, seq, s);
  if (!st.ok()) invalidate_snapshot(s);
  return st;
}

Status take_snapshot_header(const KvStore& store, SeqId seq, Snapshot& out) {
  Status st = take_header(store, seq, out, /*rows=*/false);
  if (!st.ok()) invalidate_snapshot(out);
  return st;
}

void invalidate_snapshot(Snapshot& s) {
  s.token_count = -1;
  s.token_ids.clear();
  s.metadata.clear();
}

Result<Snapshot> take_snapshot(const KvCache& cache) {
  return take_snapshot(cache.store(), cache.seq());
}
Status take_snapshot(const KvCache& cache, Snapshot& out) {
  return take_snapshot(cache.store(), cache.seq(), out);
}

Status check_restorable(const Snapshot& header, const KvStore& target) {
  KVRING_RETURN_IF_ERROR(validate_snapshot(header, /*header_only=*/true));
  KVRING_RETURN_IF_ERROR(compare_geometry(header.config, target.config()));
  for (std::int64_t l = 0; l < target.n_layers(); ++l) {
    // Same geometry, so kinds and layouts agree; the context may differ.
    auto placement = place(header, l, target);
    if (!placement) return placement.error();
  }
  return Status::Ok();
}

Result<RingState> restore_ring(const Snapshot& header, std::int64_t layer, const KvStore& target) {
  if (layer < 0 || layer >= target.n_layers() || layer >= static_cast<std::int64_t>(header.planes.size()))
    return invalid_argument(layer_str(layer) + " is not a layer of both the snapshot and the store");
  KVRING_RETURN_IF_ERROR(validate_snapshot(header, /*header_only=*/true));
  KVRING_RETURN_IF_ERROR(compare_geometry(header.config, target.config()));
  auto placement = place(header, layer, target);
  if (!placement) return placement.error();
  return placement->ring;
}

Status check_restorable(const Snapshot& header, const KvCache& target) {
  return check_restorable(header, target.store());
}

namespace {

// The order in which to install the planes so that the pool never runs dry,
// or kResourceExhausted when no order can. Empty when the free pool covers
// every plane's new blocks at once (the planes may then go in any order, in
// parallel). Otherwise some planes must give their blocks back before
// others take theirs: first the planes that give back at least what they
// take, fewest taken first, then the rest, most given back first. That
// order leaves the most blocks free before each plane, so if it fails, every
// order fails.
Result<std::vector<std::int64_t>> install_order(const KvStore& target, SeqId seq,
                                                const std::vector<Placement>& placements) {
  struct Plane {
    std::int64_t layer;
    KvStore::InstallBlocks blocks;
  };
  std::vector<Plane> planes;
  std::int64_t take = 0;
  std::int64_t give = 0;
  std::int64_t shared = 0;
  for (std::int64_t l = 0; l < target.n_layers(); ++l) {
    auto n = target.blocks_to_install(seq, l, placements[static_cast<std::size_t>(l)].ring.len());
    if (!n) return n.error();
    planes.push_back({l, *n});
    take += n->take;
    give += n->give;
    shared += n->shared;
  }
  const std::int64_t free = target.free_blocks();
  if (take <= free) return std::vector<std::int64_t>{};
  const std::string need =
      "the snapshot's full planes need " + std::to_string(take) + " new blocks of " +
      std::to_string(target.options().block_rows) + " rows" +
      (shared > 0 ? " (" + std::to_string(shared) + " for blocks " + seq_name(seq) + " shares with a fork)" : "") +
      "; the target's pool has " + std::to_string(free) + " free and " + seq_name(seq) +
      "'s planes give back " + std::to_string(give) + " once in";
  if (take > free + give) return make_error(ErrorCode::kResourceExhausted, need);
  std::stable_sort(planes.begin(), planes.end(), [](const Plane& a, const Plane& b) {
    const bool a_gains = a.blocks.give >= a.blocks.take;
    const bool b_gains = b.blocks.give >= b.blocks.take;
    if (a_gains != b_gains) return a_gains;
    return a_gains ? a.blocks.take < b.blocks.take : a.blocks.give > b.blocks.give;
  });
  std::vector<std::int64_t> order;
  std::int64_t left = free;
  for (const Plane& p : planes) {
    if (p.blocks.take > left)
      return make_error(ErrorCode::kResourceExhausted,
                        need + "; no order of the planes fits: layer " + std::to_string(p.layer) +
                            " needs " + std::to_string(p.blocks.take) + " with at most " +
                            std::to_string(left) + " free before it");
    left += p.blocks.give - p.blocks.take;
    order.push_back(p.layer);
  }
  return order;
}

// The checks of restore(header, target, seq) that the header decides
// for a sequence the store holds: the geometry and rings
// (check_restorable), and the pool (install_order). Each plane's ring is
// computed once, for the pool check and the installs.
struct RestorePlan {
  std::vector<Placement> placements;
  std::vector<std::int64_t> order;  // install_order's
};
Result<RestorePlan> plan_restore(const Snapshot& header, const KvStore& target, SeqId seq) {
  KVRING_RETURN_IF_ERROR(check_restorable(header, target));
  RestorePlan plan;
  plan.placements.reserve(static_cast<std::size_t>(target.n_layers()));
  for (std::int64_t l = 0; l < target.n_layers(); ++l) {
    auto placement = place(header, l, target);
    if (!placement) return placement.error();
    plan.placements.push_back(*placement);
  }
  auto order = install_order(target, seq, plan.placements);
  if (!order) return order.error();
  plan.order = std::move(*order);
  return plan;
}

Status check_holds(const KvStore& target, SeqId seq) {
  if (!target.contains(seq))
    return make_error(ErrorCode::kNotFound, seq_name(seq) + " is not in the target store");
  return Status::Ok();
}

}  // namespace

Status check_restorable(const Snapshot& header, const KvStore& target, SeqId seq) {
  KVRING_RETURN_IF_ERROR(check_holds(target, seq));
  auto plan = plan_restore(header, target, seq);
  return plan ? Status::Ok() : Status(plan.error());
}

Status restore(const Snapshot& snapshot, KvStore& target, SeqId seq) {
  KVRING_RETURN_IF_ERROR(check_holds(target, seq));
  KVRING_RETURN_IF_ERROR(validate_snapshot(snapshot));
  auto plan = plan_restore(snapshot, target, seq);
  if (!plan) return plan.error();
  const std::vector<Placement>& placements = plan->placements;
  const std::vector<std::int64_t>& order = plan->order;
  // Nothing below can fail for a reason in the input: install() accepts
  // exactly the rings place() computes and buffers of their size, and the
  // order gives every plane its blocks.
  const std::int64_t kv_dim = snapshot.config.kv_dim();
  auto install = [&](std::int64_t l) -> Status {
    const Placement& placement = placements[static_cast<std::size_t>(l)];
    const PlaneSnapshot& p = snapshot.planes[static_cast<std::size_t>(l)];
    const std::size_t skip = static_cast<std::size_t>(placement.skip_rows * kv_dim);
    return target.install(seq, l, placement.ring, p.k.data() + skip, p.v.data() + skip);
  };
  Status s = Status::Ok();
  if (order.empty()) {
    s = for_each_layer(target.backend(), target.n_layers(), snapshot.row_bytes(), install);
  } else {
    for (const std::int64_t l : order) {
      s = install(l);
      if (!s.ok()) break;
    }
  }
  if (s.ok()) return s;
  Error e = s.error();
  const Status reset = target.reset_sequence(seq);
  e.message += reset.ok() ? " (restore failed part-way; the sequence was reset to empty)"
                          : " (restore failed part-way and the reset failed too: " +
                                reset.to_string() + ")";
  return e;
}

Status restore(const Snapshot& snapshot, KvCache& target) {
  return restore(snapshot, target.store(), target.seq());
}

Result<std::int64_t> blocks_to_restore(const Snapshot& header, const KvStore& target) {
  KVRING_RETURN_IF_ERROR(check_restorable(header, target));
  // A new sequence's full planes take every block from the free pool.
  std::int64_t need = 0;
  const std::int64_t block_rows = target.options().block_rows;
  for (std::int64_t l = 0; l < target.n_layers(); ++l) {
    if (target.config().kind(l) != LayerKind::kFullNope) continue;
    auto ring = restore_ring(header, l, target);
    if (!ring) return ring.error();
    need += (ring->len() + block_rows - 1) / block_rows;
  }
  return need;
}

Status check_restorable_as_new(const Snapshot& header, const KvStore& target) {
  auto blocks = blocks_to_restore(header, target);
  if (!blocks) return blocks.error();
  KVRING_RETURN_IF_ERROR(target.check_free_slot());
  const std::int64_t need = *blocks, block_rows = target.options().block_rows;
  if (need > target.free_blocks())
    return make_error(ErrorCode::kResourceExhausted,
                      "the snapshot's full planes need " + std::to_string(need) + " new blocks of " +
                          std::to_string(block_rows) + " rows; the target's pool has " +
                          std::to_string(target.free_blocks()) + " free");
  return Status::Ok();
}

Result<SeqId> restore_new_sequence(const Snapshot& snapshot, KvStore& target) {
  KVRING_RETURN_IF_ERROR(validate_snapshot(snapshot));
  // Checked before the sequence is added; a restore that fails after it
  // discards it (its handle never left), so any refusal leaves even the
  // next handle as it was.
  KVRING_RETURN_IF_ERROR(check_restorable_as_new(snapshot, target));
  auto seq = target.add_sequence();
  if (!seq) return seq.error();
  if (Status s = restore(snapshot, target, *seq); !s.ok()) {
    (void)KvStoreAccess::discard(target, *seq);
    return s.error();
  }
  return *seq;
}

Result<std::unique_ptr<KvCache>> restore_detached(const Snapshot& snapshot, BackendKind backend,
                                                  std::int64_t context, AttentionNumeric attention) {
  KVRING_RETURN_IF_ERROR(validate_snapshot(snapshot));
  // Every plane is either filled completely by install() or cleared by it
  // first (a ring that is not full), so no uninitialized row is ever visible.
  auto cache = make_cache(backend, snapshot.config,
                          {.context = context == 0 ? snapshot.context : context, .zero_fill = false,
                           .attention = attention});
  if (!cache) return cache.error();
  KVRING_RETURN_IF_ERROR(restore(snapshot, **cache));
  return std::move(*cache);
}

}  // namespace kvring
