// The handoff's CUDA calls, checked one way on its GPU side (device_cuda.cc,
// ipc_cuda.cc): a failed call is kCuda naming who made it, what it did and
// the runtime's words, with the runtime's last error cleared; a call made
// with another GPU current than the one it belongs to is refused by name.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "kvring/status.h"

#define HANDOFF_CUDA_CALL(who, what, expr)                                  \
  do {                                                                      \
    if (const cudaError_t e_ = (expr); e_ != cudaSuccess)                   \
      return ::kvring::handoff::device::cuda_failed((who), (what), e_);     \
  } while (0)

namespace kvring::handoff::device {

inline Error cuda_failed(const char* who, const std::string& what, cudaError_t e) {
  (void)cudaGetLastError();
  return make_error(ErrorCode::kCuda, std::string(who) + ": " + what + " failed: " + cudaGetErrorName(e) + " (" +
                                          cudaGetErrorString(e) + ")");
}

// `who` ("handoff: the store") works on GPU `gpu`, which must be the
// thread's current one (its streams, events and buffers are there).
inline Status current_gpu_is(int gpu, const std::string& who) {
  int current = -1;
  HANDOFF_CUDA_CALL("handoff", "cudaGetDevice", cudaGetDevice(&current));
  if (current != gpu)
    return invalid_argument(who + " is on GPU " + std::to_string(gpu) + " and this thread's current GPU is " +
                            std::to_string(current) + " (cudaSetDevice(" + std::to_string(gpu) +
                            ") on this thread first)");
  return Status::Ok();
}

// Records `consumed` on `last`, the stream a receiver read a lent buffer
// on, so that the buffer's next writer waits for those reads on the device;
// where it cannot be recorded there, the reads are waited for here. Whether
// `consumed` was recorded.
inline bool record_after_reads(cudaEvent_t consumed, cudaStream_t last) {
  if (cudaEventRecord(consumed, last) == cudaSuccess) return true;
  (void)cudaGetLastError();
  if (cudaStreamSynchronize(last) != cudaSuccess) (void)cudaGetLastError();
  return false;
}

}  // namespace kvring::handoff::device
