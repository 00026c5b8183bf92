// The KV cache of one sequence: one plane per layer, behind one interface
// for every backend.
//
// The base class owns the ring states and does every check and every piece
// of ring arithmetic; a backend only moves bytes to the physical rows it is
// given. An operation that fails leaves every plane and ring as it was.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvring/config.h"
#include "kvring/layout.h"
#include "kvring/ring.h"
#include "kvring/status.h"

namespace kvring {

enum class BackendKind { kCpu, kCuda };
const char* backend_name(BackendKind kind);

struct CacheOptions {
  // Positions this cache is sized for (0: the model's max_context).
  std::int64_t context = 0;
  // Zero-fill planes at allocation. Only a detached install, which
  // overwrites every row before anything reads it, may turn this off.
  bool zero_fill = true;
};

class KvCache {
 public:
  virtual ~KvCache() = default;
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  virtual BackendKind backend() const = 0;
  const ModelConfig& config() const { return config_; }
  std::int64_t context() const { return context_; }
  std::int64_t n_layers() const { return config_.n_layers; }
  const RingState& ring(std::int64_t layer) const { return rings_[idx(layer)]; }
  Layout layout(std::int64_t layer) const { return layouts_[idx(layer)]; }
  // Bytes of K and V storage for one plane by its geometry, and the bytes
  // the backend actually allocated for all planes.
  std::int64_t plane_bytes(std::int64_t layer) const;
  virtual std::int64_t allocated_bytes() const = 0;

  // Store the K and V rows of the token at `position`.
  // k, v: host f32 [kv_dim]; stored as f16 (round to nearest even).
  Status store_token(std::int64_t layer, std::int64_t position, const float* k, const float* v);

  // Store `count` tokens at positions [start, start + count).
  // k, v: host f32 [count, kv_dim]. A batch longer than a sliding ring
  // writes only the rows that stay live.
  Status store_batch(std::int64_t layer, std::int64_t start, std::int64_t count, const float* k,
                     const float* v);

  // Live rows [first, first + count) in logical order as f16 bits.
  // k, v: host [count, kv_dim].
  Status read_rows(std::int64_t layer, std::int64_t first, std::int64_t count, std::uint16_t* k,
                   std::uint16_t* v) const;

  // The whole physical K and V buffers of a plane as stored (f16 bits,
  // layout-indexed, host [capacity * kv_dim] each).
  virtual Status read_plane(std::int64_t layer, std::uint16_t* k, std::uint16_t* v) const = 0;

  // Decode attention for the query at `position`, whose K/V is stored.
  // q, out: host f32 [n_heads, head_dim].
  Status attend_decode(std::int64_t layer, std::int64_t position, const float* q, float* out);

  // Chunked prefill: stores the chunk [start, start + count) and computes
  // attention for its queries, each seeing the rows before the chunk (read
  // in place from the plane) and the chunk's rows up to itself. The result
  // equals, bit for bit, `count` rounds of store_token + attend_decode.
  // k, v: host f32 [count, kv_dim]; q, out: host f32 [count, n_heads, head_dim].
  Status prefill(std::int64_t layer, std::int64_t start, std::int64_t count, const float* k,
                 const float* v, const float* q, float* out);

  // Replace a plane with `ring.len()` rows in logical order (f16 bits,
  // host [len, kv_dim]); `ring` must be the state a sequentially built ring
  // holds (RingState::sequential), so the restored bytes equal the live ones.
  Status install(std::int64_t layer, const RingState& ring, const std::uint16_t* k,
                 const std::uint16_t* v);

  // Empty every plane; storage is zero-filled again.
  Status reset();

  // Next position every layer expects, or an error if layers disagree.
  Result<std::int64_t> next_position() const;

 protected:
  KvCache(ModelConfig config, std::int64_t context);

  struct PlaneGeometry {
    Layout layout;
    std::int64_t capacity;
    std::int64_t kv_dim;
    std::int64_t head_dim;
  };
  PlaneGeometry geometry(std::int64_t layer) const;

  // Backend hooks: the arguments are checked and the placement computed.
  virtual Status write_token(std::int64_t layer, std::int64_t physical, const float* k,
                             const float* v) = 0;
  virtual Status write_batch(std::int64_t layer, const BatchPlacement& placement,
                             std::int64_t count, const float* k, const float* v) = 0;
  virtual Status copy_out(std::int64_t layer, const LiveSpans& spans, std::uint16_t* k,
                          std::uint16_t* v) const = 0;
  // Writes logical rows (source order) at the physical spans given.
  virtual Status copy_in(std::int64_t layer, const LiveSpans& spans, const std::uint16_t* k,
                         const std::uint16_t* v) = 0;
  // Attention of `n_queries` queries at first_position.. over rows
  // [lo(p), p]: rows before `chunk_start` come from the plane (ring state
  // `ring`, as before the chunk is stored), rows from `chunk_start` on from
  // chunk_k / chunk_v (f16 bits [chunk_rows, kv_dim]; null when the chunk is
  // already in the plane, as in decode).
  struct AttendArgs {
    std::int64_t layer;
    RingState ring;
    std::int64_t first_position;
    std::int64_t n_queries;
    std::int64_t chunk_start;
    const std::uint16_t* chunk_k;
    const std::uint16_t* chunk_v;
    const float* q;
    float* out;
  };
  virtual Status attend(const AttendArgs& args) = 0;
  // Zero-fill one plane, or every plane.
  virtual Status clear_plane(std::int64_t layer) = 0;
  Status clear();

  std::size_t idx(std::int64_t layer) const { return static_cast<std::size_t>(layer); }
  Status check_layer(std::int64_t layer) const;
  // The checks of attend_decode (every row the query sees is live) and of
  // prefill (the placement of the chunk; the rows before it are live), for
  // backends that offer the same operations on other kinds of pointers.
  Status check_decode(std::int64_t layer, std::int64_t position) const;
  Result<BatchPlacement> check_prefill(std::int64_t layer, std::int64_t start,
                                       std::int64_t count) const;

  ModelConfig config_;
  std::int64_t context_;
  std::vector<RingState> rings_;
  std::vector<Layout> layouts_;
};

// First visible logical position for a query at `position` on `kind`.
std::int64_t visible_begin(const ModelConfig& config, LayerKind kind, std::int64_t position);

// `context` 0 means the model's max_context; otherwise it must lie in
// [1, max_context].
Result<std::int64_t> resolve_context(const ModelConfig& config, std::int64_t context);

// A cache on the CPU backend (host memory).
Result<std::unique_ptr<KvCache>> make_cpu_cache(const ModelConfig& config,
                                                CacheOptions options = {});

}  // namespace kvring
