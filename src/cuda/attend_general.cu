// The general attention kernel (any head_dim up to 256 but 128;
// attend_general.cuh, docs/CUDA.md, "Any other head_dim").
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "attend_general.cuh"
#include "attend_rows.cuh"
#include "combine.cuh"
#include "kernels.h"
#include "ptx.cuh"

namespace kvring::cuda {
namespace {

// ---- Any head_dim up to 256 --------------------------------------------------
//
// One CTA per query head; lane i holds dims i, i + 32, ... Each key's score
// is the lane's partial dot product summed over the warp in a butterfly,
// which leaves the same bits in every lane; the online softmax then runs
// key by key in logical order.

constexpr int kGeneralDimsPerLane = kGeneralMaxHeadDim / 32;
constexpr int kGeneralKeys = 4;  // keys in flight per warp step

__device__ __forceinline__ float f16_value(std::uint16_t bits) {
  return __half2float(__ushort_as_half(bits));
}

}  // namespace

// The body of both launches' kernels (KernelArgs, InlineArgs).
template <class Args>
__device__ __forceinline__ void attend_general(const Args& A) {
  if (A.P.cluster) cluster_arrive_relaxed();  // finish waits for every CTA's
  enter_dependent();
  const FirstTiles& F = A.F;
  const AttendParams& P = A.P;
  __shared__ Shared sh;
  __shared__ float warp_o[kAttendWarps][kGeneralMaxHeadDim];
  __shared__ ClusterInbox inbox;
  QueryRange r;
  if (!query_range(F, P, launch_items(A), r)) return idle_in_cluster(P);
  r.n_splits = split_count(r);
  const int hd = P.head_dim;
  const int head = static_cast<int>(blockIdx.y);
  const int kv_head = head / F.group;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;

  // A one-token prefill's own row p goes to the plane first, from the warp
  // whose rows (warp_rows) hold it.
  if (P.own_rows) {
    std::int64_t a, b;
    warp_rows(r, warp, a, b);
    if (a <= r.p && r.p < b) store_own_row(P, r, HeadRows(P, r, hd, kv_head), kv_head, hd, lane);
  }
  float qv[kGeneralDimsPerLane];
  const float* q = P.q + static_cast<std::int64_t>(r.qi) * P.q_stride +
                   static_cast<std::int64_t>(head) * hd;
#pragma unroll
  for (int i = 0; i < kGeneralDimsPerLane; ++i) {
    const int d = lane + 32 * i;
    qv[i] = d < hd ? q[d] : 0.0f;
  }

  std::int64_t a, b;
  warp_rows(r, warp, a, b);
  const HeadRows rows(P, r, hd, kv_head);
  float m = -INFINITY, l = 0.0f;
  float o[kGeneralDimsPerLane];
#pragma unroll
  for (int i = 0; i < kGeneralDimsPerLane; ++i) o[i] = 0.0f;

#pragma unroll 1
  for (std::int64_t base = a; base < b; base += kGeneralKeys) {
    float s[kGeneralKeys];
    float vv[kGeneralKeys][kGeneralDimsPerLane];
#pragma unroll
    for (int u = 0; u < kGeneralKeys; ++u) {
      s[u] = 0.0f;
      const bool live = base + u < b;
      RowPtr row{nullptr, nullptr};
      if (live) row = row_at(P, rows, base + u);
#pragma unroll
      for (int i = 0; i < kGeneralDimsPerLane; ++i) {
        const int d = lane + 32 * i;
        vv[u][i] = 0.0f;
        if (live && d < hd) {
          s[u] += qv[i] * f16_value(row.k[d]);
          vv[u][i] = f16_value(row.v[d]);
        }
      }
    }
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1)
#pragma unroll
      for (int u = 0; u < kGeneralKeys; ++u) s[u] += __shfl_xor_sync(kFullMask, s[u], off);
#pragma unroll
    for (int u = 0; u < kGeneralKeys; ++u) {
      if (base + u >= b) break;
      const float x = s[u] * P.scale_log2;
      const float m_new = fmaxf(m, x);
      const float alpha = weight_of(m, m_new);
      const float p = weight_of(x, m_new);
      l = l * alpha + p;
#pragma unroll
      for (int i = 0; i < kGeneralDimsPerLane; ++i) o[i] = o[i] * alpha + p * vv[u][i];
      m = m_new;
    }
  }

  if (lane == 0) {
    sh.m[warp][0] = m;
    sh.l[warp][0] = l;
  }
#pragma unroll
  for (int i = 0; i < kGeneralDimsPerLane; ++i) {
    const int d = lane + 32 * i;
    if (d < hd) warp_o[warp][d] = o[i];
  }
  __syncthreads();
  finish(P, sh, &inbox, WarpOutputs{warp_o[0], kGeneralMaxHeadDim}, r, r.split, 1, 1, head);
}
__global__ void __launch_bounds__(kAttendThreads, 2) attend_general_kernel(const KernelArgs A) { attend_general(A); }
__global__ void __launch_bounds__(kAttendThreads, 2)
    attend_general_inline_kernel(const __grid_constant__ InlineArgs A) {
  attend_general(A);
}


}  // namespace kvring::cuda
