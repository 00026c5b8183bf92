// The CUDA backend of KvStore: rings and the block pool in device memory,
// kernels on explicit streams.
//
// A store lives on the GPU current when it was made. Each call makes that
// GPU current for its duration and gives the calling thread's current
// device back before it returns.
//
// Device views are read and written in place; their calls are enqueued on
// the given stream (null: the store's own; a stream of another GPU is
// refused where the build's CUDA is 12.8 or later and the stream is not
// being captured) and never wait for the device.
// Host views are staged through pinned buffers, and such a call waits for
// its copies before it returns. The store orders its own work across
// streams: a call on another stream than the previous call's first waits
// (on the device, through an event) for the work enqueued before it.
//
// Calls enqueued while a stream is captured into a CUDA graph run when the
// graph is launched, which the store does not see: launch such a graph in
// order with the store's other work (on one stream, or ordered by events),
// never beside it or beside another such graph, since the store's
// attention launches share its workspace and its resident clock
// (docs/CUDA.md, "The resident clock"). Capture in
// cudaStreamCaptureModeRelaxed: a captured call may make a descriptor
// chunk (pinned and device memory, kept for the store's lifetime), and the
// other modes prohibit allocations during a capture (the call then fails
// with kCuda and the capture with it).
//
// This header needs no CUDA headers, so host-only code can include it.
#pragma once

// A build of kvring without its CUDA backend defines none of this
// (backend.h's cuda_compiled() says which build an engine links).
#if defined(KVRING_HAVE_CUDA) && !KVRING_HAVE_CUDA
#error "kvring was built without its CUDA backend: include kvring/cuda_store.h only where KVRING_HAVE_CUDA is 1"
#endif

#include <cstdint>
#include <memory>

#include "kvring/store.h"

namespace kvring {

namespace cuda {
struct LaunchPolicy;     // src/cuda/launch_policy.h
struct AttendParams;     // src/cuda/kernels.h
struct AttendQueryItem;  // src/cuda/kernels.h
}

// GPUs visible to this process; 0 when there is none or no usable driver.
// Never aborts.
int cuda_device_count();

// Attention on the GPU handles head_dim in [1, kCudaMaxHeadDim]; a larger
// head_dim stores and snapshots fine but attention returns kUnsupported.
inline constexpr std::int64_t kCudaMaxHeadDim = 256;

class CudaStore final : public KvStore {
 public:
  // Errors: invalid options (resolve_store_options), kUnsupported when no
  // GPU is visible or the current device's compute capability is not one
  // this build has kernels for, kCuda when the device refuses (out of
  // memory). Attention launches under `policy` (src/cuda/launch_policy.h;
  // the library's tests pass one to force each combine path), null: the
  // device's own.
  static Result<std::unique_ptr<CudaStore>> create(const ModelConfig& config,
                                                   StoreOptions options = {},
                                                   const cuda::LaunchPolicy* policy = nullptr);
  ~CudaStore() override;

  BackendKind backend() const override { return BackendKind::kCuda; }
  Status synchronize(cudaStream_t stream = nullptr) const override;

  // The device the store lives on, and its own stream.
  int device() const;
  cudaStream_t stream() const;
  // Device bytes beside the planes: attention workspace, tagged partials,
  // the block-table mirror, descriptor buffers (staging included) and the
  // attention scratch the store keeps between calls: what its pool has
  // mapped, at least the most one call took (a prefill chunk's f16 rows
  // and, under the f16 numeric, at most 512 MiB of partials, or one query
  // tile's where that is more: 64 x n_kv_heads (query, head) rows of 528
  // bytes for each split of 2048 positions the call's longest query
  // sees), until release_scratch.
  std::int64_t workspace_bytes() const;
  // Hands the attention scratch the store keeps between calls back to the
  // device, once the work enqueued on the store so far is done (waits for
  // it); the next call that needs scratch maps it again. Refused while the
  // store's own stream (stream()) is being captured into a graph.
  Status release_scratch();

 protected:
  Status check_view(const char* what, MemorySpace space, DType dtype, const void* data,
                    std::uint64_t bytes) const override;
  Status check_attention(const ConstView& q, const MutView& out) const override;
  Status write_rows(std::span<const TableChange> changes, std::span<const RowWrite> writes,
                    const ConstView& k, const ConstView& v, cudaStream_t stream) override;
  Status attend(const AttendBatch& batch) override;
  // One-token prefills of device K/V under the f32 numeric are one
  // attention launch that stores each chunk's row as it reads it
  // (docs/CUDA.md, "One-token prefills"); every other prefill attends, then
  // stores.
  Status attend_and_store(const AttendBatch& batch, std::span<const RowWrite> writes) override;
  Status copy_out(const PlaneRef& plane, const LiveSpans& spans, std::uint16_t* k,
                  std::uint16_t* v, MemorySpace space, cudaStream_t stream) const override;
  Status copy_in(const PlaneRef& plane, const LiveSpans& spans, const std::uint16_t* k,
                 const std::uint16_t* v, MemorySpace space, cudaStream_t stream) override;
  Status read_ring(std::int32_t slot, std::int64_t layer, std::uint16_t* k,
                   std::uint16_t* v) const override;
  Status set_ring_rows(std::span<const RingRows> rows, cudaStream_t stream) override;
  Status copy_block(std::int32_t from, std::int32_t to, cudaStream_t stream) override;
  Status tables_changed(std::span<const TableChange> changes, cudaStream_t stream) override;
  Status sinks_changed(std::int64_t layer, std::span<const float> sinks) override;

 private:
  // attend's launches under each numeric, on stream s, after the queries,
  // outputs and chunk are in device memory.
  Status attend_f32(const AttendBatch& batch, const float* q, std::int64_t q_stride, float* out,
                    std::int64_t out_stride, const std::uint16_t* chunk, cudaStream_t s);
  Status attend_f16(const AttendBatch& batch, const float* q, std::int64_t q_stride, float* out,
                    std::int64_t out_stride, const std::uint16_t* chunk, cudaStream_t s);
  // What both numerics' launches share: an item's plane, ring state and
  // chunk rows; a launch's queries, outputs, chunk and geometry (its
  // queries from q0 on, n of them).
  void plane_of(const AttendBatch& batch, const AttendItem& item, cuda::AttendQueryItem& d) const;
  // P.first_blocks of a launch of one decode query on a full plane, outside a capture.
  void first_blocks(const AttendBatch& batch, cudaStream_t stream, cuda::AttendParams& P) const;
  void launch_params(const AttendBatch& batch, const float* q, std::int64_t q_stride, float* out,
                     std::int64_t out_stride, const std::uint16_t* chunk, std::int64_t q0,
                     std::int64_t n, cuda::AttendParams& P) const;
  struct Impl;
  CudaStore(ModelConfig config, StoreOptions resolved);
  std::unique_ptr<Impl> impl_;
};

// A store on the CUDA backend (the current device), as make_store gives it.
Result<std::unique_ptr<KvStore>> make_cuda_store(const ModelConfig& config,
                                                 StoreOptions options = {});

}  // namespace kvring
