// The tensor-core attention kernel (head_dim 128): its shared-memory
// layout and its declaration (attend_hd128.cu; docs/CUDA.md, "head_dim
// 128, on tensor cores").
#pragma once

#include <cstddef>

#include "attend_rows.cuh"
#include "combine.cuh"
#include "kernels.h"

namespace kvring::cuda {

// Each warp streams its tiles through kStages shared-memory stages with
// cp.async, kStages - 1 tiles ahead of the one it computes: more rows in
// flight than the registers of the 8 warps an SM holds could keep.
//
// A stage holds the tile's 16 head rows of K, then of V, 256 bytes (16
// pieces of 16 bytes) a row. Lane l copies piece l % 16 of rows 2k + l / 16
// (k < 8) of both, so each copy instruction of the warp moves two whole
// rows: whole sectors, one 128-byte line of shared memory per 8 lanes, and
// one pointer with constant steps when the tile's rows lie evenly spaced.
// Piece c of row r lands at c ^ swizzle(r), which stays within the piece's
// 128-byte half of the row and puts the reads of every quarter warp on 8
// distinct bank groups: K is read as pieces 4i + t of rows g and 8 + g
// (swizzle 4(r & 1)), V by ldmatrix as one piece of 8 consecutive rows
// (swizzle r & 7).
constexpr int kStages = 3;
constexpr int kRowBytes = kTensorHeadDim * 2;
constexpr int kTileBytes = kAttendTile * kRowBytes;
constexpr int kStageBytes = 2 * kTileBytes;       // K, then V
constexpr int kWarpArea = kStages * kStageBytes;  // bytes per warp
static_assert(kAttendTile == 16 && kRowBytes == 256, "the swizzles assume 16 rows of 16 pieces");

__device__ __forceinline__ int k_swizzle(int row) { return (row & 1) << 2; }
__device__ __forceinline__ int v_swizzle(int row) { return row & 7; }

struct TensorSmem {
  Shared sh;
  // Apart from the warps' areas: the other CTAs of a cluster store into it
  // whenever they reach their combine, this CTA's tiles still in flight.
  ClusterInbox inbox;
  // Per warp; its output partial [head * 128 + dim] after the loop, and in
  // warp 0's, behind its partial, the stage of a resident combine
  // (Warp0Finish).
  alignas(128) unsigned char area[kAttendWarps][kWarpArea];
  // The query's A operands of k-step s for lane l at qa[s][l], made by
  // warp s (query_operands_shared).
  uint4 qa[kAttendWarps][32];
  // The largest magnitude of query head g over k-step s at amax[g][s].
  alignas(16) float amax[kTensorHeads][kAttendWarps];
};
static_assert(sizeof(TensorSmem) <= 227 * 1024, "within the shared memory a CTA may opt in to");
constexpr int kPartialBytes = kTensorHeads * kTensorHeadDim * 4;
// Warp 0's area after the loop: its output partial, then the stage of a
// resident combine.
struct Warp0Finish {
  float partial[kTensorHeads * kTensorHeadDim];
  ResidentStage resident;
};
static_assert(offsetof(Warp0Finish, resident) == kPartialBytes &&
                  sizeof(Warp0Finish) == kPartialBytes + sizeof(ResidentStage) &&
                  sizeof(Warp0Finish) <= kWarpArea,
              "warp 0's area holds its partial and the resident stage");

__global__ void __launch_bounds__(kAttendThreads, 1) attend_hd128_kernel(const KernelArgs A);
__global__ void __launch_bounds__(kAttendThreads, 1)
    attend_hd128_inline_kernel(const __grid_constant__ InlineArgs A);

// A warp a split (attend_hd128_warp_kernel): for decode launches whose
// queries all see at most kAttendSplitBand rows, so that every split is one
// tile for each of the CTA kernel's 8 warps. One warp streams a whole
// split's K tiles, then its V tiles, each through kWarpSplitStages stages
// of one tile, kWarpSplitStages - 1 ahead, and makes the split's partial
// with the CTA kernel's arithmetic (docs/CUDA.md, "A warp a split"). Its
// loops over a split's tiles are not unrolled, so that the kernel's code
// stays small enough for the instruction cache; what a tile leaves for the
// V pass (its weight operands, maximum and weight sum) waits in the warp's
// scratch, a lane's own entries.
constexpr int kWarpSplitStages = 5;
constexpr int kWarpSplitThreads = 32 * kWarpSplitWarps;
constexpr int kSplitTiles = static_cast<int>(kAttendMinSplitRows / kAttendTile);
struct WarpSplitScratch {
  uint4 pa[kSplitTiles][32];
  float m[kSplitTiles][32];
  float l[kSplitTiles][32];  // the weight sum, then the tile's weight
};
struct WarpSplitArea {
  alignas(128) unsigned char stages[kWarpSplitStages][kTileBytes];
  WarpSplitScratch scratch;
};
struct WarpSplitSmem {
  Shared sh;
  WarpSplitArea area[kWarpSplitWarps];
};
static_assert(2 * (sizeof(WarpSplitSmem) + 1024) <= 228 * 1024, "two CTAs within an SM's shared memory");

__global__ void __launch_bounds__(kWarpSplitThreads, 2) attend_hd128_warp_kernel(const KernelArgs A);
__global__ void __launch_bounds__(kWarpSplitThreads, 2)
    attend_hd128_warp_inline_kernel(const __grid_constant__ InlineArgs A);

}  // namespace kvring::cuda
