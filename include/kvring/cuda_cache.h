// The CUDA backend: planes in device memory, kernels on explicit streams.
//
// A CudaCache is a KvCache: the host API of cache.h works unchanged (it
// copies through pinned staging and waits for the device before it
// returns). An engine that keeps its activations on the GPU uses the
// device-pointer calls below instead: the same checks and ring bookkeeping,
// the work enqueued on a stream and not waited for.
//
// This header needs no CUDA headers, so host-only code can include it.
#pragma once

#include <cstdint>
#include <memory>

#include "kvring/cache.h"

// The CUDA runtime's stream handle, declared as cuda_runtime_api.h does.
typedef struct CUstream_st* cudaStream_t;

namespace kvring {

// GPUs visible to this process; 0 when there is none or no usable driver.
// Never aborts.
int cuda_device_count();

// Attention on the GPU handles head_dim in [1, kCudaMaxHeadDim]; a larger
// head_dim stores and snapshots fine but attention returns kUnsupported.
inline constexpr std::int64_t kCudaMaxHeadDim = 256;

class CudaCache final : public KvCache {
 public:
  // Errors: an invalid config or context (as make_cpu_cache), kUnsupported
  // when no GPU is visible, kCuda when the device refuses (out of memory).
  static Result<std::unique_ptr<CudaCache>> create(const ModelConfig& config,
                                                   CacheOptions options = {});
  ~CudaCache() override;

  BackendKind backend() const override { return BackendKind::kCuda; }
  // Bytes of the K and V plane buffers (the footprint); the attention
  // workspace and staging buffers are counted apart in workspace_bytes().
  std::int64_t allocated_bytes() const override;
  std::int64_t workspace_bytes() const;
  Status read_plane(std::int64_t layer, std::uint16_t* k, std::uint16_t* v) const override;

  // The device the planes live on, and the cache's own stream (host-API
  // calls run on it and synchronise it).
  int device() const;
  cudaStream_t stream() const;
  // Waits for all work enqueued on the cache's stream.
  Status synchronize() const;

  // Device storage of one plane: f16 bits, indexed by layout.h's formulas.
  struct PlaneView {
    std::uint16_t* k = nullptr;  // [capacity * kv_dim]
    std::uint16_t* v = nullptr;
    Layout layout = Layout::kTokenMajor;
    std::int64_t capacity = 0;
    std::int64_t kv_dim = 0;
    std::int64_t head_dim = 0;
  };
  PlaneView plane_view(std::int64_t layer) const;

  // ---- Device-pointer API --------------------------------------------------
  // Pointers are device memory; `stream` null means the cache's stream.
  // Checks and errors are those of the host call of the same name; a call
  // that fails enqueues nothing and changes nothing. Calls on one cache must
  // be ordered on one stream: they share the attention workspace.
  // f32 inputs and outputs need 16-byte alignment (cudaMalloc gives 256).

  // k, v: [kv_dim] f32.
  Status store_token_device(std::int64_t layer, std::int64_t position, const float* k,
                            const float* v, cudaStream_t stream = nullptr);
  // k, v: [count, kv_dim] f32.
  Status store_batch_device(std::int64_t layer, std::int64_t start, std::int64_t count,
                            const float* k, const float* v, cudaStream_t stream = nullptr);
  // The token at `position` into every layer in one launch; all layers
  // accept it or none changes. k, v: [n_layers, kv_dim] f32.
  Status store_token_all_layers_device(std::int64_t position, const float* k, const float* v,
                                       cudaStream_t stream = nullptr);
  // A batch of `count` tokens from `start` into every layer, in one launch
  // for up to 48 spans of rows (a layer takes one, or two where its ring
  // wraps). Every layer's checks pass before anything is enqueued, so a
  // refused call changes nothing; as with the other stores of several
  // launches, a CUDA failure of a later launch leaves the rows of the
  // earlier ones written (the error is returned, the rings stay as they
  // were). k, v: [n_layers, count, kv_dim] f32 (layer l's rows from
  // l * count * kv_dim on).
  Status store_batch_all_layers_device(std::int64_t start, std::int64_t count, const float* k,
                                       const float* v, cudaStream_t stream = nullptr);
  // q, out: [n_heads, head_dim] f32.
  Status attend_decode_device(std::int64_t layer, std::int64_t position, const float* q,
                              float* out, cudaStream_t stream = nullptr);
  // Chunked prefill as KvCache::prefill. k, v: [count, kv_dim];
  // q, out: [count, n_heads, head_dim].
  Status prefill_device(std::int64_t layer, std::int64_t start, std::int64_t count,
                        const float* k, const float* v, const float* q, float* out,
                        cudaStream_t stream = nullptr);

 protected:
  Status write_token(std::int64_t layer, std::int64_t physical, const float* k,
                     const float* v) override;
  Status write_batch(std::int64_t layer, const BatchPlacement& placement, std::int64_t count,
                     const float* k, const float* v) override;
  Status copy_out(std::int64_t layer, const LiveSpans& spans, std::uint16_t* k,
                  std::uint16_t* v) const override;
  Status copy_in(std::int64_t layer, const LiveSpans& spans, const std::uint16_t* k,
                 const std::uint16_t* v) override;
  Status attend(const AttendArgs& args) override;
  Status clear_plane(std::int64_t layer) override;

 private:
  struct Impl;
  CudaCache(ModelConfig config, std::int64_t context);
  // Enqueues attention for args (device q, out and chunk rows) on `stream`.
  Status attend_on_device(const AttendArgs& args, cudaStream_t stream);
  Status store_rows_device(std::int64_t layer, const BatchPlacement& placement, const float* k,
                           const float* v, cudaStream_t stream);

  std::unique_ptr<Impl> impl_;
};

// A cache on the CUDA backend, as the KvCache interface.
Result<std::unique_ptr<KvCache>> make_cuda_cache(const ModelConfig& config,
                                                 CacheOptions options = {});

}  // namespace kvring
