// How the partials of a CTA's warps, and then of a query's splits, combine
// (docs/CUDA.md, "The order of reduction"): the CTA's warps in warp order,
// then the splits in a fixed tree of their count (in two levels beyond
// kAttendSingleLevel splits), on one of three paths:
//  - resident grid: every split stores its partial as epoch-tagged words,
//    waits for the others' and combines a share of the output
//    (finish_resident, the stage in ResidentStage);
//  - thread-block cluster: the item's splits form one cluster; each CTA
//    stores its partial's values into the shared memory of the CTAs that
//    combine them (ClusterInbox) and combines its share from its own (the
//    general kernel through InboxPartials after a cluster barrier, the
//    tensor-core kernel in combine_staged once its inbox mbarrier has
//    counted every byte: finish_heads);
//  - last arrival: partials in the global workspace, combined by the last
//    CTA to arrive (GlobalPartials, arrive_last).
// Every path runs the same arithmetic in the same order, and no value is
// ever accumulated in arrival order, so the bits of a query's output do
// not depend on the path.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "attend_rows.cuh"
#include "kernels.h"
#include "ptx.cuh"

namespace kvring::cuda {

// Partials of the warps of one CTA, then of the splits of one item.
struct Shared {
  float m[kAttendWarps][kTensorHeads];  // running max (log2 units)
  float l[kAttendWarps][kTensorHeads];  // sum of weights
  float weight[kAttendWarps][kTensorHeads];
  float head_m[kTensorHeads];
  float head_l[kTensorHeads];
  unsigned last;  // arrive_last's and arrive_run's answer to the CTA
  // A resident launch's clock count (clock_copy).
  unsigned long long clock;
};
// Output elements of one CTA: [head * head_dim + dim].
inline constexpr int kPartFloats = kTensorHeads * kTensorHeadDim;
// Each warp's unnormalised output, [head * head_dim + dim], lies at
// o + warp * stride (floats) in shared memory; with `rotated` (head_dim
// 128, the tensor-core kernel) dim d of head h lies at column (d + 8 h) %
// 128 of the head's row, so that the 8 heads' writes of one column of a
// warp's fragments fall on distinct banks (rotated_column).
struct WarpOutputs {
  const float* o;
  int stride;
  bool rotated = false;
};
__device__ __forceinline__ int rotated_column(int d, int h) { return (d + 8 * h) & (kTensorHeadDim - 1); }
static_assert(kTensorHeadDim == 128, "a 128-column rotation");
static_assert(kTensorHeads <= kAttendWarps, "one warp per head in the final combine");
static_assert(kPartFloats >= kGeneralMaxHeadDim, "a CTA's elements hold any one head");

// Element i (head h) of the CTA's result: its warps combined in warp order.
__device__ __forceinline__ float cta_value(const Shared& sh, WarpOutputs wo, int i, int h) {
  float o = 0.0f;
  const int at = wo.rotated ? h * kTensorHeadDim + rotated_column(i - h * kTensorHeadDim, h) : i;
#pragma unroll
  for (int w = 0; w < kAttendWarps; ++w) o = __fmaf_rn(wo.o[w * wo.stride + at], sh.weight[w][h], o);
  return o;
}
// Elements e .. e + 3 (e % 4 == 0, one head h) as cta_value gives each:
// one 16-byte load a warp where the outputs are rotated (head_dim 128, so
// the four lie side by side and aligned).
__device__ __forceinline__ float4 cta_value4(const Shared& sh, WarpOutputs wo, int e, int h) {
  if (!wo.rotated)
    return make_float4(cta_value(sh, wo, e, h), cta_value(sh, wo, e + 1, h), cta_value(sh, wo, e + 2, h),
                       cta_value(sh, wo, e + 3, h));
  const int at = h * kTensorHeadDim + rotated_column(e - h * kTensorHeadDim, h);
  float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
  for (int w = 0; w < kAttendWarps; ++w) {
    const float4 v = *reinterpret_cast<const float4*>(wo.o + w * wo.stride + at);
    const float wt = sh.weight[w][h];
    o.x = __fmaf_rn(v.x, wt, o.x);
    o.y = __fmaf_rn(v.y, wt, o.y);
    o.z = __fmaf_rn(v.z, wt, o.z);
    o.w = __fmaf_rn(v.w, wt, o.w);
  }
  return o;
}

// The tensor-core kernel has one warp a query head (kTensorHeads ==
// kAttendWarps, head_dim 128 = 4 elements a lane), and warp h finishes head
// h itself: combine_warps' steps for the head in the same order, its
// lanes handing the warps' (m, l) round by shuffles, so no barrier stands
// between the weights and the partial's elements and no thread waits for
// 8 others' chains. The bits are those of combine_warps and cta_value4.
struct HeadWeights {
  float max, sum;
  float wt[kAttendWarps];
};
__device__ __forceinline__ HeadWeights head_weights(const Shared& sh, int h, int lane) {
  static_assert(kTensorHeads == kAttendWarps && kTensorHeadDim == 4 * 32, "a warp a head, 4 elements a lane");
  const float my_m = lane < kAttendWarps ? sh.m[lane][h] : -INFINITY;
  const float my_l = lane < kAttendWarps ? sh.l[lane][h] : 0.0f;
  HeadWeights hw;
  hw.max = -INFINITY;
#pragma unroll
  for (int w = 0; w < kAttendWarps; ++w) hw.max = fmaxf(hw.max, __shfl_sync(kFullMask, my_m, w));
  const float my_wt = weight_of(my_m, hw.max);
  hw.sum = 0.0f;
#pragma unroll
  for (int w = 0; w < kAttendWarps; ++w) {
    hw.wt[w] = __shfl_sync(kFullMask, my_wt, w);
    hw.sum = __fmaf_rn(__shfl_sync(kFullMask, my_l, w), hw.wt[w], hw.sum);
  }
  return hw;
}
// Elements 4 lane .. 4 lane + 3 of head h of the CTA's result (rotated
// warp outputs, head_dim 128), as cta_value4 gives them.
__device__ __forceinline__ float4 head_value4(WarpOutputs wo, const HeadWeights& hw, int h, int lane) {
  const int at = h * kTensorHeadDim + rotated_column(4 * lane, h);
  float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
  for (int w = 0; w < kAttendWarps; ++w) {
    const float4 v = *reinterpret_cast<const float4*>(wo.o + w * wo.stride + at);
    o.x = __fmaf_rn(v.x, hw.wt[w], o.x);
    o.y = __fmaf_rn(v.y, hw.wt[w], o.y);
    o.z = __fmaf_rn(v.z, hw.wt[w], o.z);
    o.w = __fmaf_rn(v.w, hw.wt[w], o.w);
  }
  return o;
}

// The split partials of an item in the global workspace (the last-arrival
// combine's; a cluster's lie in its ranks' inboxes, ClusterInbox below).
struct GlobalPartials {
  const float* o;   // [split][heads * hd]
  const float* ml;  // [split][heads][m, l]
  int total;
  __device__ float m_of(int s, int h, int heads) const { return __ldcg(ml + (s * heads + h) * 2); }
  __device__ float l_of(int s, int h, int heads) const { return __ldcg(ml + (s * heads + h) * 2 + 1); }
  __device__ float4 o4(int s, int u) const {
    return __ldcg(reinterpret_cast<const float4*>(o + static_cast<std::int64_t>(s) * total) + u);
  }
  __device__ float o1(int s, int i) const { return __ldcg(o + static_cast<std::int64_t>(s) * total + i); }
};
// A cluster's combine: rank s combines output elements [begin, end) of
// s's share (finish), and each split of the cluster stores into rank s's
// inbox its (m, l) of every head and its values of those elements, split
// t's element e at o[t * stride + e - begin], stride = 4 x the share in
// float4 units. The shares' bound: n x ceil(units / n) units over n <=
// kAttendSingleLevel splits.
inline constexpr int kInboxFloats = kPartFloats + 4 * kAttendSingleLevel;
struct ClusterInbox {
  alignas(16) float o[kInboxFloats];
  float ml[kAttendSingleLevel][kTensorHeads][2];
  // The tensor-core kernel's: the mbarrier its inbox's stores count their
  // bytes at (finish_heads).
  unsigned long long full;
};
struct InboxPartials {
  const ClusterInbox* in;
  int stride;
  int begin;
  __device__ float m_of(int s, int h, int) const { return in->ml[s][h][0]; }
  __device__ float l_of(int s, int h, int) const { return in->ml[s][h][1]; }
  __device__ float4 o4(int s, int u) const {
    return *reinterpret_cast<const float4*>(in->o + s * stride + 4 * u - begin);
  }
  __device__ float o1(int s, int i) const { return in->o[s * stride + i - begin]; }
};
// Rank `rank`'s share of `valid` output elements among n splits, in whole
// float4 units: element e belongs to rank e / stride, and rank s combines
// [begin, end).
struct InboxShare {
  int stride, begin, end;
  __device__ InboxShare(int rank, int n, int valid) {
    const int units = (valid + 3) / 4;
    const int share = (units + n - 1) / n;
    stride = 4 * share;
    begin = min(rank * share, units) * 4;
    end = min((rank + 1) * share * 4, valid);
  }
};

// Combines the n split partials of an item and writes output elements
// [begin, end) (of heads_valid * hd). Each thread loads every split's m of
// its element's head and the partials and l of kChunk splits at once (all
// of them on the tensor-core kernel), then computes the maximum, each split's weight exp2(m_s - max), the
// weight sum and the weighted sum of partials, each in split order: the
// same arithmetic for every element of a head, wherever the partials lie.
// With `out_ml`, the result is itself a partial: unnormalised sums to
// `out`, each head's maximum and weight sum to out_ml; without, the
// output, divided by sink_divisor (`sinks` from the launch's first head on,
// or null).
template <int kChunk, class Partials>
__device__ __forceinline__ void combine_element(const Partials& src, int n, int heads, int h,
                                                int u, float4& acc, float& max, float& sum) {
  float4 v[kChunk];
  float m[kAttendSingleLevel], l[kChunk];
#pragma unroll
  for (int s = 0; s < kAttendSingleLevel; ++s)
    if (s < n) m[s] = src.m_of(s, h, heads);
#pragma unroll
  for (int s = 0; s < kChunk; ++s) {
    if (s < n) {
      v[s] = src.o4(s, u);
      l[s] = src.l_of(s, h, heads);
    }
  }
  max = -INFINITY;
#pragma unroll
  for (int s = 0; s < kAttendSingleLevel; ++s)
    if (s < n) max = fmaxf(max, m[s]);
  // Sums start at -0, so that fma(x, 1, -0) == x for every x, -0 included:
  // one partial combines to exactly the CTA's own result.
  sum = -0.0f;
  acc = make_float4(-0.0f, -0.0f, -0.0f, -0.0f);
#pragma unroll
  for (int s0 = 0; s0 < kAttendSingleLevel; s0 += kChunk) {
    if (s0 > 0) {
#pragma unroll
      for (int c = 0; c < kChunk; ++c) {
        if (s0 + c < n) {
          v[c] = src.o4(s0 + c, u);
          l[c] = src.l_of(s0 + c, h, heads);
        }
      }
    }
#pragma unroll
    for (int c = 0; c < kChunk; ++c) {
      if (s0 + c < n) {
        const float wt = weight_of(m[s0 + c], max);
        sum = __fmaf_rn(l[c], wt, sum);
        acc.x = __fmaf_rn(v[c].x, wt, acc.x);
        acc.y = __fmaf_rn(v[c].y, wt, acc.y);
        acc.z = __fmaf_rn(v[c].z, wt, acc.z);
        acc.w = __fmaf_rn(v[c].w, wt, acc.w);
      }
    }
  }
}

// Vector partials as float4 (kVec: always, as for head_dim 128); scalar
// ones (head_dim not a multiple of 4) through the same arithmetic one
// element at a time.
template <class Partials>
struct ScalarView {
  const Partials& p;
  __device__ float4 o4(int s, int i) const { return make_float4(p.o1(s, i), 0.0f, 0.0f, 0.0f); }
  __device__ float m_of(int s, int h, int heads) const { return p.m_of(s, h, heads); }
  __device__ float l_of(int s, int h, int heads) const { return p.l_of(s, h, heads); }
};

// At most kAttendSingleLevel partials meet in one combine.
static_assert(kAttendGroup <= kAttendSingleLevel &&
              (kAttendMaxSplits + kAttendGroup - 1) / kAttendGroup <= kAttendSingleLevel);
template <bool kVec, class Partials>
__device__ void combine_splits(const Partials& src, float* out, int n, int heads, int hd,
                               int begin, int end, const float* sinks, float* out_ml = nullptr) {
  const int tid = static_cast<int>(threadIdx.x);
  const int threads = static_cast<int>(blockDim.x);
  const bool vec = kVec || (hd & 3) == 0;
  const int stride = vec ? 4 : 1;
  for (int e = begin + tid * stride; e < end; e += threads * stride) {
    const int h = e / hd;
    float4 acc;
    float max, sum;
    if (vec) {
      combine_element<kVec ? kAttendSingleLevel : 4>(src, n, heads, h, e / 4, acc, max, sum);
      reinterpret_cast<float4*>(out)[e / 4] =
          out_ml != nullptr ? acc : divided(acc, sink_divisor(sum, max, sinks, h));
    } else if constexpr (!kVec) {
      const ScalarView<Partials> view{src};
      combine_element<4>(view, n, heads, h, e, acc, max, sum);
      out[e] = out_ml != nullptr ? acc.x : acc.x / sink_divisor(sum, max, sinks, h);
    }
    if (out_ml != nullptr && e % hd == 0) {
      out_ml[2 * h] = max;
      out_ml[2 * h + 1] = sum;
    }
  }
}

// A CTA of a cluster launch of the general kernel whose split does not
// exist for its query still takes part in the cluster's barriers: the wait
// for the arrivals every CTA made at its start (cluster_arrive_relaxed),
// then the combine's barrier.
__device__ __forceinline__ void idle_in_cluster(const AttendParams& P) {
  if (P.cluster) {
    cluster_wait();
    cluster_sync();
  }
}

// The tensor-core kernel's start in a cluster launch: thread 0 sets up the
// inbox barrier (one arrival, its own, and the bytes it then expects), and
// every thread arrives at the cluster barrier, which the CTA's stores into
// other CTAs wait for (finish_heads), so no store reaches a barrier before
// it is set up.
__device__ __forceinline__ void cluster_begin(ClusterInbox& inbox) {
  if (threadIdx.x == 0) mbarrier_init_for_cluster(static_cast<unsigned>(__cvta_generic_to_shared(&inbox.full)));
  cluster_arrive_relaxed();
}

// combine_element's arithmetic over n partials of one output unit in
// shared memory (split s's sums o[s * o_stride], maximum ml[s * ml_stride]
// and weight sum ml[s * ml_stride + 1]), in short loops rather than
// unrolled code: its sum, maximum and weight sum, and the sum divided by
// the weight sum (the output, when this is the last level). A launch's
// code reaches each SM anew (docs/CUDA.md, "Code on the critical path"),
// so the combine that ends a short decode costs about its instruction
// count in fetches: one copy of this code (not inlined) serves every level
// of the resident combine and the cluster combine of the tensor-core
// kernel, and every call computes the quotient, so that a last level finds
// its code in the instruction cache where the calls of an earlier level
// brought it.
struct Staged {
  float4 acc;
  float max, sum;
  float4 out;
  // A last level's output for head h: `out`, or with the launch's sinks
  // (sinks_from) the sum divided by sink_divisor.
  __device__ __forceinline__ float4 output(const float* sinks, int h) const {
    return sinks == nullptr ? out : divided(acc, sink_divisor(sum, max, sinks, h));
  }
};
static __device__ __noinline__ Staged combine_staged(const float4* o, int o_stride, const float* ml,
                                                     int ml_stride, int n) {
  Staged r;
  r.max = -INFINITY;
#pragma unroll 4
  for (int s = 0; s < n; ++s) r.max = fmaxf(r.max, ml[s * ml_stride]);
  r.sum = -0.0f;
  r.acc = make_float4(-0.0f, -0.0f, -0.0f, -0.0f);
#pragma unroll 4
  for (int s = 0; s < n; ++s) {
    const float wt = weight_of(ml[s * ml_stride], r.max);
    const float4 v = o[s * o_stride];
    r.sum = __fmaf_rn(ml[s * ml_stride + 1], wt, r.sum);
    r.acc.x = __fmaf_rn(v.x, wt, r.acc.x);
    r.acc.y = __fmaf_rn(v.y, wt, r.acc.y);
    r.acc.z = __fmaf_rn(v.z, wt, r.acc.z);
    r.acc.w = __fmaf_rn(v.w, wt, r.acc.w);
  }
  r.out = make_float4(r.acc.x / r.sum, r.acc.y / r.sum, r.acc.z / r.sum, r.acc.w / r.sum);
  return r;
}

// Tagged partials: a float in the low half of a 64-bit word whose high half
// is the launch's epoch, stored and loaded whole (single-copy atomic), so a
// reader that sees the epoch sees the value, with no fence or counter.
__device__ __forceinline__ std::uint64_t tag(float v, unsigned epoch) {
  return (static_cast<std::uint64_t>(epoch) << 32) | __float_as_uint(v);
}
__device__ __forceinline__ void store_tagged2(std::uint64_t* p, float a, float b, unsigned epoch) {
  st_relaxed_v2_b64(p, tag(a, epoch), tag(b, epoch));
}
__device__ __forceinline__ void load_tagged2(const std::uint64_t* p, std::uint64_t& a,
                                             std::uint64_t& b) {
  ld_relaxed_v2_b64(p, a, b);
}
__device__ __forceinline__ bool tagged(std::uint64_t w, unsigned epoch) {
  return static_cast<unsigned>(w >> 32) == epoch;
}
__device__ __forceinline__ float untag(std::uint64_t w) {
  return __uint_as_float(static_cast<unsigned>(w));
}

// The resident clock on the device (kernels.h, ResidentClock; docs/CUDA.md,
// "The resident clock"). Every CTA of a resident launch reads the count
// (its launch's epoch and half): a working CTA by a copy into sh.clock that
// thread 0 issues with its first tiles (clock_copy), so no thread waits for
// it; an idle one by a load. Each then counts itself in at `readers` once,
// from thread 0. A working CTA's thread 0 arrives as its finish starts, after
// its cp.async.wait_group, so its read has completed by then; an idle CTA
// uses its count only to advance the clock, and the thread that stores the
// new count read the old one itself. So when the last arrival finds every
// other one in, every CTA that tags words has read the count, and that CTA
// alone advances it (clock_advance_if_last). A working CTA looks at the
// answer after its combine, so the round trip overlaps the combine.
//
// The epoch skips 0, and where it wraps the launches go on in the other
// half of the tagged words, whose words no launch of the next 2^32 - 1 can
// mistake for its own: the launches of epochs 1 to kClockZeroLaunches of
// each half zero the other half, a kClockZeroLaunches-th of it each, from
// the CTA that advances the clock.
inline constexpr unsigned kClockZeroLaunches = 1024;
__device__ __forceinline__ void clock_copy(const AttendParams& P, Shared& sh) {
  cp_async8(static_cast<unsigned>(__cvta_generic_to_shared(&sh.clock)), &P.clock->count);
}
__device__ __forceinline__ unsigned clock_arrive(const AttendParams& P) {
  return atomicAdd(&P.clock->readers, 1u);
}
// Warp 0, all lanes: `arrived` (lane 0's) is clock_arrive's answer.
__device__ __forceinline__ void clock_advance_if_last(const AttendParams& P, unsigned long long count,
                                                      unsigned arrived) {
  const unsigned ctas = gridDim.x * gridDim.y * gridDim.z;
  if (!__shfl_sync(kFullMask, arrived == ctas - 1, 0)) return;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  if (lane == 0) {
    P.clock->readers = 0;
    unsigned long long next = count + 1;
    if (static_cast<unsigned>(next) == 0) ++next;
    st_relaxed_u64(&P.clock->count, next);
  }
  const unsigned epoch = static_cast<unsigned>(count);
  if (epoch > kClockZeroLaunches) return;
  const std::int64_t per = (P.tagged_half + kClockZeroLaunches - 1) / kClockZeroLaunches;
  const std::int64_t to = min((epoch - 1) * per + per, P.tagged_half);
  std::uint64_t* other = P.tagged + (((count >> 32) & 1) ^ 1) * P.tagged_half;
  for (std::int64_t i = (epoch - 1) * per + lane; i < to; i += 32) other[i] = 0;
}
// An idle CTA of a resident launch: warp 0 reads the count and arrives.
__device__ __forceinline__ void clock_idle(const AttendParams& P) {
  if (threadIdx.x >= 32) return;
  const unsigned long long count = ld_relaxed_u64(&P.clock->count);
  const unsigned arrived = threadIdx.x == 0 ? clock_arrive(P) : 0;
  clock_advance_if_last(P, count, arrived);
}

// The most splits x output units of a resident share, and its stage: the
// units of a share over n splits number ceil(units / n), so units + n pairs
// at most; then, for two levels, 16 units (n >= 17) times 8 groups.
inline constexpr int kUnitsMax = kTensorHeads * kTensorHeadDim / 4;
inline constexpr int kResidentPairs = kUnitsMax + kAttendMaxSplits;
inline constexpr int kMaxGroups = attend_groups(kAttendMaxSplits);
inline constexpr int kResidentGroupPairs =
    (kUnitsMax + kAttendSingleLevel) / (kAttendSingleLevel + 1) * kMaxGroups;
static_assert(kMaxGroups <= kAttendWarps, "a warp per level-one group");

// The shared-memory stage of a resident combine: the (split, unit) pairs
// of the CTA's share as [split][unit] (a unit's sums, and its head's m
// and l), then the level-one results as [unit][group].
struct ResidentStage {
  float4 o[kResidentPairs];
  float ml[kResidentPairs][2];
  float4 group_o[kResidentGroupPairs];
  float group_ml[kResidentGroupPairs][2];
};
static_assert(sizeof(ResidentStage) == (kResidentPairs + kResidentGroupPairs) * 24 &&
                  offsetof(ResidentStage, ml) == 16 * kResidentPairs &&
                  offsetof(ResidentStage, group_o) == 24 * kResidentPairs &&
                  offsetof(ResidentStage, group_ml) ==
                      24 * kResidentPairs + 16 * kResidentGroupPairs,
              "the stage is packed: no padding between its arrays");

// Waits until the tagged words of output unit u in split `src`'s partial
// carry the epoch, and stages them at o[at], ml[2 at] (m, l). Every word
// carries its own tag, so the three loads go out together.
__device__ __forceinline__ void gather_unit(const std::uint64_t* src, int total, int hd, int u,
                                            unsigned epoch, float4* o, float* ml, int at) {
  std::uint64_t m, l, o0, o1, o2, o3;
  for (;;) {
    load_tagged2(src + total + 2 * (u * 4 / hd), m, l);
    load_tagged2(src + 4 * u, o0, o1);
    load_tagged2(src + 4 * u + 2, o2, o3);
    if (tagged(m, epoch) && tagged(l, epoch) && tagged(o0, epoch) && tagged(o1, epoch) &&
        tagged(o2, epoch) && tagged(o3, epoch))
      break;
    __nanosleep(32);
  }
  o[at] = make_float4(untag(o0), untag(o1), untag(o2), untag(o3));
  ml[2 * at] = untag(m);
  ml[2 * at + 1] = untag(l);
}

// Resident-grid finish of a CTA (hd % 4 == 0): it stores its partial as
// tagged words at its place in P.tagged, then combines the split-th share
// of the item's output, in whole float4 units, from every split's tagged
// words, staged in shared memory as [split][unit] once they carry the
// epoch, in the same tree and arithmetic as the last-arrival combine. With
// one level, a thread per (unit, split) stages and, after a barrier, a
// thread per unit combines. With two, warp w stages group w's splits and
// combines them (level one) as soon as they are in, so the groups that
// finished early are combined while the last split is still running; then
// a thread per unit combines the groups. Every CTA of the grid is resident,
// so every wait ends.
static __device__ void finish_resident(const AttendParams& P, const Shared& sh, const HeadWeights& hw, float4 v,
                                ResidentStage& stage, const QueryRange& r, int heads,
                                int heads_valid, float* out, const float* sinks) {
  const int tid = static_cast<int>(threadIdx.x);
  const int hd = P.head_dim;
  const int n = r.n_splits;
  const int total = heads * hd;
  const std::int64_t words = total + 2 * heads;
  // Counted in at the clock now; the answer is looked at after the combine.
  const unsigned long long clock = sh.clock;
  const unsigned arrived = tid == 0 ? clock_arrive(P) : 0;
  const unsigned epoch = static_cast<unsigned>(clock);
  std::uint64_t* item = P.tagged + ((clock >> 32) & 1) * P.tagged_half +
                        ((static_cast<std::int64_t>(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x) * words;
  {
    // Warp h's head: its elements 4 a lane, and its (m, l).
    std::uint64_t* mine = item + r.split * words;
    const int h = tid >> 5;
    if (h < heads_valid) {
      store_tagged2(mine + 4 * tid, v.x, v.y, epoch);
      store_tagged2(mine + 4 * tid + 2, v.z, v.w, epoch);
      if ((tid & 31) == 0) store_tagged2(mine + total + 2 * h, hw.max, hw.sum, epoch);
    }
  }
  const int units = heads_valid * hd / 4;
  const int share = (units + n - 1) / n;
  const int u0 = min(r.split * share, units);
  const int count = min(u0 + share, units) - u0;
  // Staged as [split][unit], so the threads of consecutive units read
  // consecutive words.
  float4* st_o = stage.o;
  float* st_ml = &stage.ml[0][0];  // [split][unit][m, l]
  float4* out4 = reinterpret_cast<float4*>(out);
  const int groups = attend_groups(n);
  if (groups == 0) {
    for (int i = tid; i < count * n; i += blockDim.x) {
      const int s = i / count, j = i - s * count;
      gather_unit(item + s * words, total, hd, u0 + j, epoch, st_o, st_ml, i);
    }
    __syncthreads();
    for (int j = tid; j < count; j += blockDim.x) {
      const Staged c = combine_staged(st_o + j, count, st_ml + 2 * j, 2 * count, n);
      out4[u0 + j] = c.output(sinks, (u0 + j) * 4 / hd);
    }
    if (tid < 32) clock_advance_if_last(P, clock, arrived);
    return;
  }
  // Level one, in the warp of the group; its results as [unit][group].
  float4* g_o = stage.group_o;
  float* g_ml = &stage.group_ml[0][0];
  const int warp = tid >> 5, lane = tid & 31;
  if (warp < groups) {
    const int first = warp * kAttendGroup;
    const int members = min(kAttendGroup, n - first);
    for (int i = lane; i < count * members; i += 32) {
      const int k = i / count, j = i - k * count;
      gather_unit(item + (first + k) * words, total, hd, u0 + j, epoch, st_o, st_ml,
                  (first + k) * count + j);
    }
    __syncwarp();
    for (int j = lane; j < count; j += 32) {
      const int at = first * count + j;
      const Staged c = combine_staged(st_o + at, count, st_ml + 2 * at, 2 * count, members);
      const int g = j * groups + warp;
      g_o[g] = c.acc;
      g_ml[2 * g] = c.max;
      g_ml[2 * g + 1] = c.sum;
    }
  }
  __syncthreads();
  for (int j = tid; j < count; j += blockDim.x) {
    const Staged c = combine_staged(g_o + j * groups, 1, g_ml + 2 * j * groups, 2, groups);
    out4[u0 + j] = c.output(sinks, (u0 + j) * 4 / hd);
  }
  if (tid < 32) clock_advance_if_last(P, clock, arrived);
}

// Counts this CTA in at `counter` after its writes so far (by any of its
// threads) are published; true for the last of `expected` arrivals, which
// then sees every arrival's writes and resets the counter for the next
// launch.
__device__ __forceinline__ bool arrive_last(unsigned& counter, int expected, Shared& sh) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned arrived = atomicAdd(&counter, 1u);
    const bool last = arrived == static_cast<unsigned>(expected - 1);
    if (last) {
      counter = 0;
      __threadfence();
    }
    sh.last = last ? 1u : 0u;
  }
  __syncthreads();
  return sh.last != 0;
}

// Counts the splits [s0, s1] of a CTA's run in at once, after their
// partials (written by any of its threads) are published: at the item's
// counter with one level, else at each group's counter the run's splits
// in that group. Returns bit g for each group g the run completed (bit 0:
// the item, with one level); the CTA that completes a counter resets it
// for the next launch and then sees every arrival's writes. One fence and
// one atomic a group, not a split: the splits inside a run publish their
// partials without arriving (publish_in_run).
__device__ __forceinline__ unsigned arrive_run(unsigned* counters, int n, int s0, int s1, Shared& sh) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    unsigned done = 0;
    if (attend_groups(n) == 0) {
      const unsigned count = static_cast<unsigned>(s1 - s0 + 1);
      if (atomicAdd(&counters[0], count) + count == static_cast<unsigned>(n)) {
        counters[0] = 0;
        done = 1u;
      }
    } else {
      for (int g = s0 / kAttendGroup; g <= s1 / kAttendGroup; ++g) {
        const int first = g * kAttendGroup;
        const int end = min(first + kAttendGroup, n);
        const unsigned count = static_cast<unsigned>(min(s1 + 1, end) - max(s0, first));
        if (atomicAdd(&counters[1 + g], count) + count == static_cast<unsigned>(end - first)) {
          counters[1 + g] = 0;
          done |= 1u << g;
        }
      }
    }
    if (done != 0) __threadfence();
    sh.last = done;
  }
  __syncthreads();
  return sh.last;
}

// Each head's maximum and weight sum over the CTA's warps, and each warp's
// weight (sh.head_m, head_l, weight), for `heads` heads; a barrier follows.
__device__ __forceinline__ void combine_warps(Shared& sh, int heads) {
  const int tid = static_cast<int>(threadIdx.x);
  if (tid < heads) {
    float max = -INFINITY;
    for (int w = 0; w < kAttendWarps; ++w) max = fmaxf(max, sh.m[w][tid]);
    float sum = 0.0f;
    for (int w = 0; w < kAttendWarps; ++w) {
      const float wt = weight_of(sh.m[w][tid], max);
      sh.weight[w][tid] = wt;
      sum = __fmaf_rn(sh.l[w][tid], wt, sum);
    }
    sh.head_m[tid] = max;
    sh.head_l[tid] = sum;
  }
  __syncthreads();
}

// Where an item's split partials and arrival counters lie in the global
// workspace: the query's slots of every work item from r.ws_slot on, this
// item's (blockIdx.y) among them, [item][slot][...].
struct Workspace {
  float* o;            // [slot][heads * hd]
  float* ml;           // [slot][heads][m, l]
  unsigned* counters;  // the item's, then one per group
};
__device__ __forceinline__ Workspace workspace_of(const AttendParams& P, const QueryRange& r, int heads) {
  const int slots = attend_slots(r.item_splits);
  const std::int64_t item = r.ws_slot * gridDim.y + static_cast<std::int64_t>(blockIdx.y) * slots;
  return {P.ws_o + item * heads * P.head_dim, P.ws_ml + item * heads * 2,
          P.counters + r.ws_counter * gridDim.y +
              static_cast<std::int64_t>(blockIdx.y) * attend_counters(r.item_splits)};
}

// The CTA's partial of split r.split into its workspace slot.
__device__ __forceinline__ void publish_split(const Shared& sh, WarpOutputs wo, const QueryRange& r,
                                              const Workspace& ws, int heads, int hd) {
  const int tid = static_cast<int>(threadIdx.x);
  const int total = heads * hd;
  for (int i = tid; i < total; i += blockDim.x)
    ws.o[static_cast<std::int64_t>(r.split) * total + i] = cta_value(sh, wo, i, i / hd);
  if (tid < heads) {
    ws.ml[(r.split * heads + tid) * 2] = sh.head_m[tid];
    ws.ml[(r.split * heads + tid) * 2 + 1] = sh.head_l[tid];
  }
}

// Group `group` of a two-level combine is complete (its last split has
// arrived): its splits' partials combine into the group's slot, which then
// arrives at the item's counter; the last group to arrive combines the
// groups into the output.
template <bool kVec>
__device__ __forceinline__ void group_done(Shared& sh, const Workspace& ws, int n, int item_splits, int group,
                                           int heads, int hd, int heads_valid, float* out, const float* sinks) {
  const int total = heads * hd;
  const int first = group * kAttendGroup;
  const int members = min(kAttendGroup, n - first);
  const int slot = item_splits + group;
  combine_splits<kVec>(GlobalPartials{ws.o + static_cast<std::int64_t>(first) * total,
                                      ws.ml + first * heads * 2, total},
                       ws.o + static_cast<std::int64_t>(slot) * total, members, heads, hd, 0, total,
                       nullptr, ws.ml + slot * heads * 2);
  if (!arrive_last(ws.counters[0], attend_groups(n), sh)) return;
  combine_splits<kVec>(GlobalPartials{ws.o + static_cast<std::int64_t>(item_splits) * total,
                                      ws.ml + item_splits * heads * 2, total},
                       out, attend_groups(n), heads, hd, 0, heads_valid * hd, sinks);
}

// After arrive_run: the combines the CTA's arrival completed (`done`). With
// one level, the query's splits into the output; with two, each completed
// group into the group's slot, in group order, and the groups into the
// output when the last group arrives.
template <bool kVec>
__device__ __forceinline__ void combine_arrived(Shared& sh, const Workspace& ws, const QueryRange& r,
                                                unsigned done, int heads, int hd, int heads_valid,
                                                float* out, const float* sinks) {
  const int n = r.n_splits;
  if (attend_groups(n) == 0) {
    if (done != 0)
      combine_splits<kVec>(GlobalPartials{ws.o, ws.ml, heads * hd}, out, n, heads, hd, 0, heads_valid * hd, sinks);
    return;
  }
  for (int group = 0; group < attend_groups(n); ++group)
    if ((done >> group) & 1u)
      group_done<kVec>(sh, ws, n, r.item_splits, group, heads, hd, heads_valid, out, sinks);
}

// Warp h's share of the split's partial in the workspace (head h's
// elements and (m, l), as publish_split writes them).
__device__ __forceinline__ void publish_head(const Workspace& ws, const QueryRange& r, float4 v,
                                             const HeadWeights& hw, int h, int lane) {
  reinterpret_cast<float4*>(ws.o + static_cast<std::int64_t>(r.split) * kPartFloats)[threadIdx.x] = v;
  if (lane == 0) {
    ws.ml[(r.split * kTensorHeads + h) * 2] = hw.max;
    ws.ml[(r.split * kTensorHeads + h) * 2 + 1] = hw.sum;
  }
}

// The finish of a split that another split of the CTA's run follows (the
// tensor-core kernel's last-arrival launches; launch.cu): its partial goes
// out, exactly as a CTA of that one split would publish it, and is counted
// in with the rest of the run at the run's end (arrive_run in finish), so
// no fence, atomic or combine runs inside the tile loop. With one level the
// split could never be the last arrival anyway (the run's next split has
// not arrived); with two, the group it completes is combined after the
// run's last split. The warps' (m, l) and outputs are complete (a barrier
// before); the closing barrier keeps the warps' outputs until every thread
// has read them.
__device__ __forceinline__ void publish_in_run(const AttendParams& P, const Shared& sh, WarpOutputs wo,
                                               const QueryRange& r) {
  const int h = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const HeadWeights hw = head_weights(sh, h, lane);
  publish_head(workspace_of(P, r, kTensorHeads), r, head_value4(wo, hw, h, lane), hw, h, lane);
  __syncthreads();
}

// The tensor-core kernel's finish: the paths of finish (the general
// kernel's, below) and the resident grid's (finish_resident), each warp
// taking its head's weights and elements itself (HeadWeights), so the bits
// are those combine_warps gives and no barrier stands between the weights
// and the partial.
__device__ __forceinline__ void finish_heads(const AttendParams& P, Shared& sh, ClusterInbox* inbox,
                                             ResidentStage* stage, WarpOutputs wo, const QueryRange& r,
                                             int run_first, int heads_valid, int head0) {
  constexpr int heads = kTensorHeads, hd = kTensorHeadDim;
  const int tid = static_cast<int>(threadIdx.x), h = tid >> 5, lane = tid & 31;
  const HeadWeights hw = head_weights(sh, h, lane);
  const float4 v = head_value4(wo, hw, h, lane);
  float* out = P.out + static_cast<std::int64_t>(r.qi) * P.out_stride + static_cast<std::int64_t>(head0) * hd;
  if (r.n_splits == 1 && !P.cluster) {
    if (h < heads_valid) {
      float* o = out + 4 * tid;
      const float d = sink_divisor(hw.sum, hw.max, sinks_from(P, head0), h);
      o[0] = v.x / d;
      o[1] = v.y / d;
      o[2] = v.z / d;
      o[3] = v.w / d;
    }
    if (P.resident && tid < 32) clock_advance_if_last(P, sh.clock, tid == 0 ? clock_arrive(P) : 0);
    return;
  }
  if (P.resident) {
    finish_resident(P, sh, hw, v, *stage, r, heads, heads_valid, out, sinks_from(P, head0));
    return;
  }
  if (P.cluster) {
    // As finish's cluster path: warp h stores its head's (m, l) into every
    // rank's inbox (lane s to rank s), each thread its 4 elements into their
    // rank's, each store counted at the rank's inbox barrier (cluster_begin
    // set it up), which the rank waits at for the n splits' bytes of its
    // share: no cluster barrier, and no CTA waits for a rank that is not
    // its source.
    const int n = r.n_splits;
    const int valid = heads_valid * hd;
    const InboxShare share(r.split, n, valid);
    const int stride = share.stride;
    cluster_wait();  // every CTA of the cluster runs, its inbox barrier set up
    if (lane < n)
      store_async(cluster_address(&inbox->ml[r.split][h][0], static_cast<unsigned>(lane)), make_float2(hw.max, hw.sum),
                  cluster_address(&inbox->full, static_cast<unsigned>(lane)));
    const int e = 4 * tid;
    if (e < valid) {
      const int rank = e / stride;
      store_async(cluster_address(inbox->o + r.split * stride + e - rank * stride, static_cast<unsigned>(rank)), v,
                  cluster_address(&inbox->full, static_cast<unsigned>(rank)));
    }
    const unsigned full = static_cast<unsigned>(__cvta_generic_to_shared(&inbox->full));
    if (tid == 0)
      mbarrier_arrive_expect(full, static_cast<unsigned>(n * (heads * 8 + 4 * (share.end - share.begin))));
    mbarrier_wait_first_phase(full);
    // combine_splits' arithmetic on the inbox, in combine_staged's loops.
    float4* out4 = reinterpret_cast<float4*>(out);
    const float* sinks = sinks_from(P, head0);
    for (int u = share.begin / 4 + tid; 4 * u < share.end; u += static_cast<int>(blockDim.x)) {
      const Staged c = combine_staged(reinterpret_cast<const float4*>(inbox->o + 4 * u - share.begin), stride / 4,
                                      &inbox->ml[0][4 * u / hd][0], 2 * heads, n);
      out4[u] = c.output(sinks, 4 * u / hd);
    }
    return;
  }
  const Workspace ws = workspace_of(P, r, heads);
  publish_head(ws, r, v, hw, h, lane);
  combine_arrived<true>(sh, ws, r, arrive_run(ws.counters, r.n_splits, run_first, r.split, sh), heads, hd,
                        heads_valid, out, sinks_from(P, head0));
}

// The general kernel's finish: combines the CTA's warp partials (in sh,
// after a barrier) for `heads` query heads head0.. of `heads_valid` real
// ones, and either writes the output (one split) or the split's partial,
// which is combined with the others in the fixed tree: through the
// cluster's shared memory when the item's splits form one cluster (each
// CTA then writes a share of the output), else through the global
// workspace by the last split to arrive, a CTA's run of splits
// [run_first, r.split] counted in at once (arrive_run). `inbox` is the
// CTA's inbox of a cluster combine. The general kernel is never a resident
// grid (LaunchPolicy::resident_limit), so no path here reads the clock.
static __device__ void finish(const AttendParams& P, Shared& sh, ClusterInbox* inbox, WarpOutputs wo,
                              const QueryRange& r, int run_first, int heads, int heads_valid, int head0) {
  const int hd = P.head_dim;
  const int tid = static_cast<int>(threadIdx.x);
  combine_warps(sh, heads);
  float* out = P.out + static_cast<std::int64_t>(r.qi) * P.out_stride +
               static_cast<std::int64_t>(head0) * hd;
  const float* sinks = sinks_from(P, head0);
  if (r.n_splits == 1 && !P.cluster) {
    for (int i = tid; i < heads_valid * hd; i += blockDim.x) {
      const int h = i / hd;
      out[i] = cta_value(sh, wo, i, h) / sink_divisor(sh.head_l[h], sh.head_m[h], sinks, h);
    }
    return;
  }

  if (P.cluster) {
    // Rank s writes the s-th share of the output, in whole float4 units,
    // from its inbox: every split stores its (m, l) and its values of the
    // share there (remote stores, which never wait for an answer), one
    // barrier releases them to s, and no CTA reads another's memory.
    const int n = r.n_splits;
    const int valid = heads_valid * hd;
    const InboxShare share(r.split, n, valid);
    const int stride = share.stride;
    cluster_wait();  // every CTA of the cluster runs: its shared memory takes stores
    for (int i = tid; i < n * heads; i += blockDim.x) {
      const int rank = i / heads, h = i % heads;
      store_cluster(cluster_address(&inbox->ml[r.split][h][0], static_cast<unsigned>(rank)),
                    make_float2(sh.head_m[h], sh.head_l[h]));
    }
    // Element e belongs to rank e / stride ((e / 4) / share).
    if (hd % 4 == 0) {
      for (int e = 4 * tid; e < valid; e += 4 * static_cast<int>(blockDim.x)) {
        const int rank = e / stride;
        store_cluster(cluster_address(inbox->o + r.split * stride + e - rank * stride, static_cast<unsigned>(rank)),
                      cta_value4(sh, wo, e, e / hd));
      }
    } else {
      for (int e = tid; e < valid; e += static_cast<int>(blockDim.x)) {
        const int rank = e / stride;
        store_cluster(cluster_address(inbox->o + r.split * stride + e - rank * stride, static_cast<unsigned>(rank)),
                      cta_value(sh, wo, e, e / hd));
      }
    }
    cluster_sync();  // this CTA's stores released to their ranks, the others' acquired
    combine_splits<false>(InboxPartials{inbox, stride, share.begin}, out, n, heads, hd, share.begin, share.end,
                          sinks);
    return;
  }

  // Global workspace: this split's partial, then arrivals counted.
  const Workspace ws = workspace_of(P, r, heads);
  publish_split(sh, wo, r, ws, heads, hd);
  combine_arrived<false>(sh, ws, r, arrive_run(ws.counters, r.n_splits, run_first, r.split, sh), heads,
                        hd, heads_valid, out, sinks);
}

}  // namespace kvring::cuda
