// The CPU backend: planes in host memory.
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

#include "attention_cpu.h"
#include "kvring/cache.h"
#include "kvring/f16.h"

namespace kvring {

namespace {

class CpuCache final : public KvCache {
 public:
  CpuCache(ModelConfig config, std::int64_t context) : KvCache(std::move(config), context) {}

  Status allocate(bool zero_fill) {
    for (std::int64_t l = 0; l < n_layers(); ++l) {
      const std::size_t n = elements(l);
      // Zero-filled on purpose: a wrapped row must never expose
      // uninitialized storage. Only a detached install skips it. calloc
      // hands out zero pages the kernel maps on first touch.
      auto alloc = [&] {
        return static_cast<std::uint16_t*>(zero_fill ? std::calloc(n, sizeof(std::uint16_t))
                                                     : std::malloc(n * sizeof(std::uint16_t)));
      };
      Plane p{HostBuffer(alloc()), HostBuffer(alloc())};
      if (!p.k || !p.v)
        return make_error(ErrorCode::kIOError, "out of host memory allocating the planes of a " +
                                                   std::to_string(context()) + "-position cache");
      planes_.push_back(std::move(p));
      allocated_ += static_cast<std::int64_t>(2 * n * sizeof(std::uint16_t));
    }
    return Status::Ok();
  }

  BackendKind backend() const override { return BackendKind::kCpu; }
  std::int64_t allocated_bytes() const override { return allocated_; }

  Status read_plane(std::int64_t layer, std::uint16_t* k, std::uint16_t* v) const override {
    KVRING_RETURN_IF_ERROR(check_layer(layer));
    if (k == nullptr || v == nullptr) return invalid_argument("read_plane: null buffer");
    std::memcpy(k, planes_[idx(layer)].k.get(), elements(layer) * 2);
    std::memcpy(v, planes_[idx(layer)].v.get(), elements(layer) * 2);
    return Status::Ok();
  }

 protected:
  Status write_token(std::int64_t layer, std::int64_t physical, const float* k,
                     const float* v) override {
    const PlaneGeometry g = geometry(layer);
    Plane& p = planes_[idx(layer)];
    for (std::int64_t e = 0; e < g.kv_dim; ++e) {
      const auto dst = index(g, physical, e);
      p.k[dst] = f32_to_f16(k[e]);
      p.v[dst] = f32_to_f16(v[e]);
    }
    return Status::Ok();
  }

  Status write_batch(std::int64_t layer, const BatchPlacement& placement, std::int64_t,
                     const float* k, const float* v) override {
    const PlaneGeometry g = geometry(layer);
    Plane& p = planes_[idx(layer)];
    for (int s = 0; s < placement.n_spans; ++s) {
      const PhysicalSpan& span = placement.spans[static_cast<std::size_t>(s)];
      for (std::int64_t r = 0; r < span.rows; ++r) {
        const std::int64_t src = (span.source_first + r) * g.kv_dim;
        for (std::int64_t e = 0; e < g.kv_dim; ++e) {
          const auto dst = index(g, span.physical_first + r, e);
          p.k[dst] = f32_to_f16(k[src + e]);
          p.v[dst] = f32_to_f16(v[src + e]);
        }
      }
    }
    return Status::Ok();
  }

  Status copy_out(std::int64_t layer, const LiveSpans& spans, std::uint16_t* k,
                  std::uint16_t* v) const override {
    const PlaneGeometry g = geometry(layer);
    const Plane& p = planes_[idx(layer)];
    std::int64_t out_row = 0;
    for (int s = 0; s < spans.n_spans; ++s) {
      const PhysicalSpan& span = spans.spans[static_cast<std::size_t>(s)];
      for (std::int64_t r = 0; r < span.rows; ++r, ++out_row)
        copy_row(g, span.physical_first + r, p, k + out_row * g.kv_dim, v + out_row * g.kv_dim);
    }
    return Status::Ok();
  }

  Status copy_in(std::int64_t layer, const LiveSpans& spans, const std::uint16_t* k,
                 const std::uint16_t* v) override {
    const PlaneGeometry g = geometry(layer);
    Plane& p = planes_[idx(layer)];
    std::int64_t in_row = 0;
    for (int s = 0; s < spans.n_spans; ++s) {
      const PhysicalSpan& span = spans.spans[static_cast<std::size_t>(s)];
      for (std::int64_t r = 0; r < span.rows; ++r, ++in_row) {
        const std::int64_t physical = span.physical_first + r;
        for (std::int64_t h = 0; h < config_.n_kv_heads; ++h) {
          const auto dst = head_row(g, physical, h);
          const std::int64_t src = in_row * g.kv_dim + h * g.head_dim;
          std::memcpy(&p.k[dst], k + src, static_cast<std::size_t>(g.head_dim) * 2);
          std::memcpy(&p.v[dst], v + src, static_cast<std::size_t>(g.head_dim) * 2);
        }
      }
    }
    return Status::Ok();
  }

  Status attend(const AttendArgs& a) override {
    const PlaneGeometry g = geometry(a.layer);
    const Plane& p = planes_[idx(a.layer)];
    cpu::PlaneView view{p.k.get(), p.v.get(), g.layout, g.capacity, g.kv_dim, g.head_dim};
    const bool sliding = config_.kind(a.layer) == LayerKind::kSlidingRope;
    cpu::AttentionShape shape{config_.n_heads, config_.n_kv_heads, config_.head_dim,
                              sliding ? config_.sliding_window : 0};
    cpu::attend(view, a.ring, shape, a.first_position, a.n_queries, a.chunk_start, a.chunk_k,
                a.chunk_v, a.q, a.out);
    return Status::Ok();
  }

  Status clear_plane(std::int64_t layer) override {
    Plane& p = planes_[idx(layer)];
    std::memset(p.k.get(), 0, elements(layer) * 2);
    std::memset(p.v.get(), 0, elements(layer) * 2);
    return Status::Ok();
  }

 private:
  struct FreeDeleter {
    void operator()(std::uint16_t* p) const { std::free(p); }
  };
  using HostBuffer = std::unique_ptr<std::uint16_t[], FreeDeleter>;
  struct Plane {
    HostBuffer k, v;
  };

  std::size_t elements(std::int64_t layer) const {
    return static_cast<std::size_t>(ring(layer).capacity() * config_.kv_dim());
  }
  static std::size_t index(const PlaneGeometry& g, std::int64_t physical, std::int64_t e) {
    return static_cast<std::size_t>(plane_index(
        g.layout, static_cast<std::uint64_t>(physical), static_cast<std::uint64_t>(e),
        static_cast<std::uint64_t>(g.kv_dim), static_cast<std::uint64_t>(g.head_dim),
        static_cast<std::uint64_t>(g.capacity)));
  }
  static std::size_t head_row(const PlaneGeometry& g, std::int64_t physical, std::int64_t h) {
    return static_cast<std::size_t>(plane_head_row(
        g.layout, static_cast<std::uint64_t>(physical), static_cast<std::uint64_t>(h),
        static_cast<std::uint64_t>(g.kv_dim), static_cast<std::uint64_t>(g.head_dim),
        static_cast<std::uint64_t>(g.capacity)));
  }
  void copy_row(const PlaneGeometry& g, std::int64_t physical, const Plane& p,
                std::uint16_t* k, std::uint16_t* v) const {
    for (std::int64_t h = 0; h < config_.n_kv_heads; ++h) {
      const auto src = head_row(g, physical, h);
      std::memcpy(k + h * g.head_dim, &p.k[src], static_cast<std::size_t>(g.head_dim) * 2);
      std::memcpy(v + h * g.head_dim, &p.v[src], static_cast<std::size_t>(g.head_dim) * 2);
    }
  }

  std::vector<Plane> planes_;
  std::int64_t allocated_ = 0;
};

}  // namespace

Result<std::unique_ptr<KvCache>> make_cpu_cache(const ModelConfig& config, CacheOptions options) {
  KVRING_RETURN_IF_ERROR(config.validate());
  auto context = resolve_context(config, options.context);
  if (!context) return context.error();
  auto cache = std::make_unique<CpuCache>(config, *context);
  KVRING_RETURN_IF_ERROR(cache->allocate(options.zero_fill));
  return std::unique_ptr<KvCache>(std::move(cache));
}

}  // namespace kvring
