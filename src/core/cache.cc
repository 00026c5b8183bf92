#include "kvring/cache.h"

#include "kvring/backend.h"

namespace kvring {

Result<std::int64_t> resolve_context(const ModelConfig& config, std::int64_t context) {
  if (context == 0) return config.max_context;
  if (context < 0 || context > config.max_context)
    return invalid_argument("context " + std::to_string(context) + " outside [1, " +
                            std::to_string(config.max_context) + "] for model '" +
                            config.name + "'");
  return context;
}

Result<std::unique_ptr<KvCache>> KvCache::create(BackendKind kind, const ModelConfig& config,
                                                 CacheOptions options) {
  StoreOptions o;
  o.max_sequences = 1;
  o.context = options.context;
  o.zero_fill = options.zero_fill;
  o.slack = options.slack;
  o.block_rows = options.block_rows;
  o.attention = options.attention;
  auto store = make_store(kind, config, o);
  if (!store) return store.error();
  auto seq = (*store)->add_sequence();
  if (!seq) return seq.error();
  return std::unique_ptr<KvCache>(new KvCache(std::move(*store), *seq));
}

Result<std::unique_ptr<KvCache>> KvCache::adopt(std::unique_ptr<KvStore>&& store, SeqId seq) {
  if (!store) return invalid_argument("adopt: no store");
  if (store->options().max_sequences != 1 || !store->contains(seq))
    return invalid_argument("adopt: a cache is a store of one slot and its live sequence");
  return std::unique_ptr<KvCache>(new KvCache(std::move(store), seq));
}

Result<std::unique_ptr<KvCache>> make_cpu_cache(const ModelConfig& config, CacheOptions options) {
  return KvCache::create(BackendKind::kCpu, config, options);
}

RingState KvCache::ring(std::int64_t layer) const {
  auto r = store_->ring(seq_, layer);
  return r ? *r : RingState{};
}

std::int64_t KvCache::plane_bytes(std::int64_t layer) const {
  return store_->capacity(layer) * config().kv_dim() * 2 * 2;
}

namespace {

Status check_pointers(const char* op, const void* a, const void* b) {
  if (a == nullptr || b == nullptr) return invalid_argument(std::string(op) + ": null buffer");
  return Status::Ok();
}

}  // namespace

Status KvCache::store_token(std::int64_t layer, std::int64_t position, const float* k,
                            const float* v) {
  return store_batch(layer, position, 1, k, v);
}

Status KvCache::store_batch(std::int64_t layer, std::int64_t start, std::int64_t count,
                            const float* k, const float* v) {
  KVRING_RETURN_IF_ERROR(check_pointers("store_batch", k, v));
  if (count < 1)
    return invalid_argument("layer " + std::to_string(layer) + ": batch of " +
                            std::to_string(count) + " rows");
  const SeqSpan span{seq_, start, count};
  const std::int64_t kv_dim = config().kv_dim();
  return store_->store(layer, {&span, 1}, host_view(k, count, kv_dim), host_view(v, count, kv_dim));
}

Status KvCache::read_rows(std::int64_t layer, std::int64_t first, std::int64_t count,
                          std::uint16_t* k, std::uint16_t* v) const {
  return store_->read_rows(seq_, layer, first, count, k, v);
}

Status KvCache::read_plane(std::int64_t layer, std::uint16_t* k, std::uint16_t* v) const {
  return store_->read_plane(seq_, layer, k, v);
}

Status KvCache::attend_decode(std::int64_t layer, std::int64_t position, const float* q,
                              float* out) {
  KVRING_RETURN_IF_ERROR(check_pointers("attend_decode", q, out));
  const SeqQuery query{seq_, position};
  const std::int64_t width = config().n_heads * config().head_dim;
  return store_->attend_decode(layer, {&query, 1}, host_view(q, 1, width),
                               host_view(out, 1, width));
}

Status KvCache::prefill(std::int64_t layer, std::int64_t start, std::int64_t count,
                        const float* k, const float* v, const float* q, float* out) {
  KVRING_RETURN_IF_ERROR(check_pointers("prefill", k, v));
  KVRING_RETURN_IF_ERROR(check_pointers("prefill", q, out));
  if (count < 1)
    return invalid_argument("layer " + std::to_string(layer) + ": batch of " +
                            std::to_string(count) + " rows");
  const SeqSpan span{seq_, start, count};
  const std::int64_t kv_dim = config().kv_dim();
  const std::int64_t width = config().n_heads * config().head_dim;
  return store_->prefill(layer, {&span, 1}, host_view(k, count, kv_dim),
                         host_view(v, count, kv_dim), host_view(q, count, width),
                         host_view(out, count, width));
}

Status KvCache::install(std::int64_t layer, const RingState& ring, const std::uint16_t* k,
                        const std::uint16_t* v) {
  return store_->install(seq_, layer, ring, k, v);
}

}  // namespace kvring
