#include "kvring/cache.h"

#include <algorithm>

#include "kvring/f16.h"

namespace kvring {

const char* backend_name(BackendKind kind) {
  return kind == BackendKind::kCpu ? "cpu" : "cuda";
}

std::int64_t visible_begin(const ModelConfig& config, LayerKind kind, std::int64_t position) {
  if (kind == LayerKind::kFullNope) return 0;
  return std::max<std::int64_t>(0, position - config.sliding_window + 1);
}

Result<std::int64_t> resolve_context(const ModelConfig& config, std::int64_t context) {
  if (context == 0) return config.max_context;
  if (context < 0 || context > config.max_context)
    return invalid_argument("context " + std::to_string(context) + " outside [1, " +
                            std::to_string(config.max_context) + "] for model '" +
                            config.name + "'");
  return context;
}

KvCache::KvCache(ModelConfig config, std::int64_t context)
    : config_(std::move(config)), context_(context) {
  for (std::int64_t l = 0; l < config_.n_layers; ++l) {
    const LayerKind kind = config_.kind(l);
    const std::int64_t capacity = config_.plane_capacity(kind, context_);
    rings_.push_back(kind == LayerKind::kSlidingRope ? RingState::sliding(capacity)
                                                     : RingState::full(capacity));
    layouts_.push_back(kind == LayerKind::kSlidingRope ? Layout::kTokenMajor
                                                       : Layout::kHeadMajor);
  }
}

KvCache::PlaneGeometry KvCache::geometry(std::int64_t layer) const {
  return PlaneGeometry{layouts_[idx(layer)], rings_[idx(layer)].capacity(), config_.kv_dim(),
                       config_.head_dim};
}

std::int64_t KvCache::plane_bytes(std::int64_t layer) const {
  // K and V, f16 each.
  return ring(layer).capacity() * config_.kv_dim() * 2 * 2;
}


Status KvCache::check_layer(std::int64_t layer) const {
  if (layer < 0 || layer >= config_.n_layers)
    return invalid_argument("layer " + std::to_string(layer) + " outside [0, " +
                            std::to_string(config_.n_layers) + ")");
  return Status::Ok();
}

namespace {

Status check_pointers(const char* op, const void* a, const void* b) {
  if (a == nullptr || b == nullptr)
    return invalid_argument(std::string(op) + ": null buffer");
  return Status::Ok();
}

}  // namespace

Status KvCache::store_token(std::int64_t layer, std::int64_t position, const float* k,
                            const float* v) {
  KVRING_RETURN_IF_ERROR(check_layer(layer));
  KVRING_RETURN_IF_ERROR(check_pointers("store_token", k, v));
  RingState next = rings_[idx(layer)];
  auto physical = next.append(layer, position);
  if (!physical) return physical.error();
  KVRING_RETURN_IF_ERROR(write_token(layer, *physical, k, v));
  rings_[idx(layer)] = next;
  return Status::Ok();
}

Status KvCache::store_batch(std::int64_t layer, std::int64_t start, std::int64_t count,
                            const float* k, const float* v) {
  KVRING_RETURN_IF_ERROR(check_layer(layer));
  KVRING_RETURN_IF_ERROR(check_pointers("store_batch", k, v));
  auto placement = rings_[idx(layer)].plan_batch(layer, start, count);
  if (!placement) return placement.error();
  KVRING_RETURN_IF_ERROR(write_batch(layer, *placement, count, k, v));
  rings_[idx(layer)].commit_batch(count);
  return Status::Ok();
}

Status KvCache::read_rows(std::int64_t layer, std::int64_t first, std::int64_t count,
                          std::uint16_t* k, std::uint16_t* v) const {
  KVRING_RETURN_IF_ERROR(check_layer(layer));
  if (count == 0) return Status::Ok();
  KVRING_RETURN_IF_ERROR(check_pointers("read_rows", k, v));
  const RingState& r = ring(layer);
  if (count < 0 || count > r.len() || first < r.origin_logical() ||
      first > r.next_position() - count)
    return invalid_argument("layer " + std::to_string(layer) + ": " + std::to_string(count) +
                            " rows from position " + std::to_string(first) +
                            " are not all live (live: [" + std::to_string(r.origin_logical()) +
                            ", " + std::to_string(r.next_position()) + "))");
  return copy_out(layer, r.spans(first, count), k, v);
}

Status KvCache::check_decode(std::int64_t layer, std::int64_t position) const {
  KVRING_RETURN_IF_ERROR(check_layer(layer));
  const RingState& r = ring(layer);
  const std::int64_t lo = visible_begin(config_, config_.kind(layer), position);
  if (position < 0 || !r.holds(position) || lo < r.origin_logical())
    return invalid_argument("layer " + std::to_string(layer) + ": decode at position " +
                            std::to_string(position) + " needs rows [" + std::to_string(lo) +
                            ", " + std::to_string(position + 1) + "), live are [" +
                            std::to_string(r.origin_logical()) + ", " +
                            std::to_string(r.next_position()) + ")");
  return Status::Ok();
}

Status KvCache::attend_decode(std::int64_t layer, std::int64_t position, const float* q,
                              float* out) {
  KVRING_RETURN_IF_ERROR(check_decode(layer, position));
  KVRING_RETURN_IF_ERROR(check_pointers("attend_decode", q, out));
  const RingState& r = ring(layer);
  return attend(AttendArgs{layer, r, position, 1, position + 1, nullptr, nullptr, q, out});
}

Result<BatchPlacement> KvCache::check_prefill(std::int64_t layer, std::int64_t start,
                                              std::int64_t count) const {
  KVRING_RETURN_IF_ERROR(check_layer(layer));
  const RingState& before = rings_[idx(layer)];
  auto placement = before.plan_batch(layer, start, count);
  if (!placement) return placement.error();
  const std::int64_t lo = visible_begin(config_, config_.kind(layer), start);
  if (lo < start && lo < before.origin_logical())
    return make_error(ErrorCode::kInternal,
                      "layer " + std::to_string(layer) + ": rows before the chunk are gone");
  return placement;
}

Status KvCache::prefill(std::int64_t layer, std::int64_t start, std::int64_t count,
                        const float* k, const float* v, const float* q, float* out) {
  KVRING_RETURN_IF_ERROR(check_layer(layer));
  KVRING_RETURN_IF_ERROR(check_pointers("prefill", k, v));
  KVRING_RETURN_IF_ERROR(check_pointers("prefill", q, out));
  auto placement = check_prefill(layer, start, count);
  if (!placement) return placement.error();
  const RingState before = rings_[idx(layer)];
  // The chunk's rows exactly as the store will hold them.
  const std::size_t n = static_cast<std::size_t>(count * config_.kv_dim());
  std::vector<std::uint16_t> chunk_k(n), chunk_v(n);
  for (std::size_t i = 0; i < n; ++i) {
    chunk_k[i] = f32_to_f16(k[i]);
    chunk_v[i] = f32_to_f16(v[i]);
  }
  KVRING_RETURN_IF_ERROR(
      attend(AttendArgs{layer, before, start, count, start, chunk_k.data(), chunk_v.data(), q, out}));
  KVRING_RETURN_IF_ERROR(write_batch(layer, *placement, count, k, v));
  rings_[idx(layer)].commit_batch(count);
  return Status::Ok();
}

Status KvCache::install(std::int64_t layer, const RingState& state, const std::uint16_t* k,
                        const std::uint16_t* v) {
  KVRING_RETURN_IF_ERROR(check_layer(layer));
  const RingState& cur = ring(layer);
  if (state.capacity() != cur.capacity() || state.wraps() != cur.wraps())
    return make_error(ErrorCode::kMismatch,
                      "layer " + std::to_string(layer) + ": plane of capacity " +
                          std::to_string(state.capacity()) + " (" +
                          (state.wraps() ? "sliding" : "full") + ") does not fit capacity " +
                          std::to_string(cur.capacity()) + " (" +
                          (cur.wraps() ? "sliding" : "full") + ")");
  auto expected = RingState::sequential(state.capacity(), state.wraps(), state.next_position());
  if (!expected) return expected.error();
  if (!(*expected == state))
    return invalid_argument("layer " + std::to_string(layer) +
                            ": ring state is not the rotation of a sequentially built ring");
  if (state.len() > 0) KVRING_RETURN_IF_ERROR(check_pointers("install", k, v));
  // Rows the install does not overwrite must read as in a fresh plane.
  if (state.len() < state.capacity()) KVRING_RETURN_IF_ERROR(clear_plane(layer));
  KVRING_RETURN_IF_ERROR(copy_in(layer, state.live_spans(), k, v));
  rings_[idx(layer)] = state;
  return Status::Ok();
}

Status KvCache::clear() {
  for (std::int64_t l = 0; l < n_layers(); ++l) KVRING_RETURN_IF_ERROR(clear_plane(l));
  return Status::Ok();
}

Status KvCache::reset() {
  KVRING_RETURN_IF_ERROR(clear());
  for (auto& r : rings_) r = r.wraps() ? RingState::sliding(r.capacity()) : RingState::full(r.capacity());
  return Status::Ok();
}

Result<std::int64_t> KvCache::next_position() const {
  if (rings_.empty()) return invalid_argument("cache has no layers");
  const std::int64_t next = rings_[0].next_position();
  for (std::size_t l = 1; l < rings_.size(); ++l)
    if (rings_[l].next_position() != next)
      return cache_discontinuity(static_cast<std::int64_t>(l), next, rings_[l].next_position());
  return next;
}

}  // namespace kvring
