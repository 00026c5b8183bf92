// Attention launches: the grid of a batch, the combine path and grid order
// each launch takes, and what a device offers them (docs/CUDA.md,
// "Attention").
#include <algorithm>
#include <limits>
#include <map>
#include <mutex>

#include "attend_f16.cuh"
#include "attend_general.cuh"
#include "attend_hd128.cuh"
#include "attend_rows.cuh"
#include "kernels.h"
#include "launch_plain.cuh"
#include "launch_policy.h"

namespace kvring::cuda {

AttendGrid attend_grid(int n_heads, int n_kv_heads, int head_dim) {
  if (head_dim == kTensorHeadDim) {
    const int group = n_heads / n_kv_heads;
    return {n_kv_heads * ((group + kTensorHeads - 1) / kTensorHeads), kTensorHeads};
  }
  return {n_heads, 1};
}

std::int64_t attend_slot_floats(int n_heads, int n_kv_heads, int head_dim) {
  const AttendGrid g = attend_grid(n_heads, n_kv_heads, head_dim);
  return static_cast<std::int64_t>(g.items) * g.heads_per_item * (head_dim + 2);
}

bool kernels_run_here() {
  cudaFuncAttributes a{};
  if (cudaFuncGetAttributes(&a, attend_general_kernel) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return true;
}

namespace {

// The largest cluster of CTAs of `kernel` this device runs (size 1: no
// clusters), and how many CTAs of such clusters it runs at once. Queried
// once per kernel; a failed query clears its error.
struct ClusterLimit {
  int size = 1;
  int ctas = 0;
};
template <class Kernel>
ClusterLimit max_cluster(Kernel kernel, std::size_t smem) {
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
    (void)cudaGetLastError();
    return {};
  }
  for (int size : {16, 8, 4, 2}) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(static_cast<unsigned>(size), 1, 1);
    cfg.blockDim = dim3(kAttendThreads, 1, 1);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = static_cast<unsigned>(size);
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    const cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg);
    if (e == cudaSuccess && clusters >= 1) return {size, clusters * size};
    (void)cudaGetLastError();
  }
  return {};
}

// The FirstTiles of a launch.
FirstTiles first_tiles(const AttendParams& P) {
  FirstTiles f{};
  f.reach = P.window > 0 ? P.window - 1 : std::numeric_limits<std::int64_t>::max() / 2;
  f.group = P.n_heads / P.n_kv_heads;
  f.sets = (f.group + kTensorHeads - 1) / kTensorHeads;
  f.n_heads = P.n_heads;
  // One query an item (a decode) and one head set a KV head: no two CTAs
  // read the same row.
  f.read_once = P.n_queries == P.n_items && f.sets == 1 ? 1 : 0;
  return f;
}

// The combine path of a launch of `grid` under these limits: a cluster a
// work item, a resident grid, or neither (last arrival). Clusters come
// first: their splits combine in the cluster's shared memory, with no pass
// through global memory (docs/CUDA.md, "Attention").
struct Paths {
  bool resident, cluster;
};
Paths paths_of(dim3 grid, const AttendParams& params, int cluster_limit, std::int64_t cluster_ctas,
               int resident_ctas) {
  const std::int64_t ctas = static_cast<std::int64_t>(grid.x) * grid.y * grid.z;
  Paths p;
  p.cluster = grid.x >= 2 && static_cast<int>(grid.x) <= cluster_limit && (cluster_ctas <= 0 || ctas <= cluster_ctas);
  p.resident = !p.cluster && grid.x >= 2 && params.tagged != nullptr &&
               ctas <= std::min(resident_ctas, params.tagged_ctas);
  return p;
}

// Launches `kernel` over `grid` (x = split, y = item, z = query), each CTA
// of a last-arrival launch taking `split_run` consecutive splits. When the
// grid has at most `resident_ctas` CTAs (and the tagged partials have
// room), it is a resident grid through a cooperative launch; else the
// splits of each item (grid.x of them) form one cluster when there are
// several, a cluster that large runs and the grid's clusters all run at
// once (at most `cluster_ctas` CTAs; 0: no bound); else they combine by
// last arrival, as they also do when the device turns the cooperative
// launch down (too large, or not supported or permitted here); a
// last-arrival launch of several queries runs query-major when
// `query_major_ok` says so. A launch that is not a resident grid is a
// programmatic dependent where `programmatic`. A launch of several splits
// is counted in `stats` (when not null) by the path it took.
//
// The kernel of a launch: its arguments' two forms (attend_rows.cuh).
struct Kernels {
  void (*uploaded)(KernelArgs);  // items at params.items, or one in params.single
  void (*inlined)(InlineArgs);   // items in the parameters
};
const Kernels kTensorKernels{attend_hd128_kernel, attend_hd128_inline_kernel};
const Kernels kWarpSplitKernels{attend_hd128_warp_kernel, attend_hd128_warp_inline_kernel};
const Kernels kGeneralKernels{attend_general_kernel, attend_general_inline_kernel};

// cudaLaunchKernelEx of `k` with `cfg`: its items in the parameters where
// `inline_items` (params.n_items of them) is not null.
cudaError_t launch_kernel(const cudaLaunchConfig_t& cfg, Kernels k, const FirstTiles& first,
                          const AttendParams& params, const AttendQueryItem* inline_items) {
  if (inline_items == nullptr) return cudaLaunchKernelEx(&cfg, k.uploaded, KernelArgs{first, params});
  InlineArgs args{};
  args.F = first;
  args.P = params;
  args.P.items = nullptr;
  std::copy_n(inline_items, params.n_items, args.items);
  return cudaLaunchKernelEx(&cfg, k.inlined, args);
}

cudaError_t launch(Kernels kernel, int cluster_limit, std::int64_t cluster_ctas, int resident_ctas,
                   bool query_major_ok, int split_run, bool programmatic, dim3 grid, std::size_t smem,
                   AttendParams params, const AttendQueryItem* inline_items, AttendStats* stats,
                   cudaStream_t stream) {
  const auto [resident, cluster] = paths_of(grid, params, cluster_limit, cluster_ctas, resident_ctas);
  params.cluster = cluster ? 1 : 0;
  params.resident = resident ? 1 : 0;
  FirstTiles first = first_tiles(params);
  first.query_major = query_major_ok && !resident && !cluster && grid.x >= 2 && grid.z >= 2 ? 1 : 0;
  first.split_run = !resident && !cluster && grid.x >= 2 ? std::max(1, split_run) : 1;
  const dim3 runs((grid.x + static_cast<unsigned>(first.split_run) - 1) / static_cast<unsigned>(first.split_run),
                  grid.y, grid.z);
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = first.query_major ? dim3(runs.z, runs.y, runs.x) : runs;
  cfg.blockDim = dim3(kAttendThreads, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attrs[2]{};
  unsigned n_attrs = 0;
  if (cluster) {
    cudaLaunchAttribute& a = attrs[n_attrs++];
    a.id = cudaLaunchAttributeClusterDimension;
    a.val.clusterDim.x = grid.x;
    a.val.clusterDim.y = 1;
    a.val.clusterDim.z = 1;
  } else if (resident) {
    cudaLaunchAttribute& a = attrs[n_attrs++];
    a.id = cudaLaunchAttributeCooperative;
    a.val.cooperative = 1;
  }
  // A resident grid may be one too: its CTAs wait for the grids before it
  // before anything else, so each that starts early waits beside work that
  // never waits for it, and its launch lets no dependent start before all of
  // its CTAs run (each executes the trigger first).
  if (programmatic) programmatic_attribute(attrs[n_attrs++]);
  cfg.attrs = attrs;
  cfg.numAttrs = n_attrs;
  cudaError_t e = launch_kernel(cfg, kernel, first, params, inline_items);
  if (resident && (e == cudaErrorCooperativeLaunchTooLarge || e == cudaErrorNotSupported ||
                   e == cudaErrorNotPermitted)) {
    (void)cudaGetLastError();
    return launch(kernel, cluster_limit, cluster_ctas, 0, query_major_ok, split_run, programmatic, grid, smem,
                  params, inline_items, stats, stream);
  }
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // reported here, not by a later call
  } else if (stats != nullptr) {
    if (inline_items != nullptr) ++stats->inline_items;
    if (grid.x >= 2) {
      ++(resident ? stats->resident : cluster ? stats->cluster : stats->last_arrival);
      if (first.query_major) ++stats->query_major;
      if (first.split_run > 1) ++stats->split_runs;
    }
  }
  return e;
}

// The CTAs of `kernel` this device holds at once (0 when a query fails;
// its error is cleared).
template <class Kernel>
int wave_capacity(Kernel kernel, std::size_t smem, int threads = kAttendThreads) {
  int device = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) !=
          cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return sms * per_sm;
}

// As many, when the device takes cooperative launches (0 otherwise).
template <class Kernel>
int resident_capacity(Kernel kernel, std::size_t smem) {
  int device = 0, cooperative = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&cooperative, cudaDevAttrCooperativeLaunch, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return cooperative ? wave_capacity(kernel, smem) : 0;
}

// Both forms of a kernel opted in to `smem` bytes of dynamic shared memory
// (0: the default, no opt-in) and to clusters larger than the portable 8
// (max_cluster asks for the uploaded form's itself); the first error,
// cleared.
cudaError_t opt_in(Kernels k, std::size_t smem) {
  cudaError_t e = cudaSuccess;
  for (const void* f : {reinterpret_cast<const void*>(k.uploaded), reinterpret_cast<const void*>(k.inlined)})
    if (e == cudaSuccess && smem > 0)
      e = cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e == cudaSuccess) e = cudaFuncSetAttribute(k.inlined, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  if (e != cudaSuccess) (void)cudaGetLastError();
  return e;
}

// What a device offers attention launches, set up once per device: the
// tensor-core and f16 kernels' opt-ins to more than the 48 KB default of
// shared memory (a per-device attribute, which every launch needs), each kernel's
// largest cluster, how many CTAs of the tensor-core kernel a resident grid
// may have (the general kernel always combines by last arrival), and the
// L2's size: the device's launch policy.
struct DeviceSetup {
  cudaError_t opted_in = cudaSuccess;
  cudaError_t warp_opted_in = cudaSuccess;  // the warp-split kernel
  cudaError_t f16_opted_in = cudaSuccess;  // the f16 numeric's kernels
  LaunchPolicy policy;
};

cudaError_t device_setup(DeviceSetup& out) {
  int device = 0;
  const cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  // The last device this thread launched on, so that a launch takes the
  // lock only on a thread's first launch or a change of device.
  thread_local int cached_device = -1;
  thread_local DeviceSetup cached;
  if (device == cached_device) {
    out = cached;
    return cudaSuccess;
  }
  static std::mutex mu;
  static std::map<int, DeviceSetup> by_device;
  const std::lock_guard<std::mutex> lock(mu);
  auto it = by_device.find(device);
  if (it == by_device.end()) {
    DeviceSetup s;
    s.opted_in = opt_in(kTensorKernels, sizeof(TensorSmem));
    if (s.opted_in == cudaSuccess) {
      const ClusterLimit c = max_cluster(attend_hd128_kernel, sizeof(TensorSmem));
      s.policy.hd128_cluster = c.size;
      s.policy.hd128_cluster_ctas = c.ctas;
      s.policy.hd128_resident = resident_capacity(attend_hd128_kernel, sizeof(TensorSmem));
      s.policy.hd128_wave = wave_capacity(attend_hd128_kernel, sizeof(TensorSmem));
    }
    s.warp_opted_in = opt_in(kWarpSplitKernels, sizeof(WarpSplitSmem));
    if (s.warp_opted_in == cudaSuccess)
      s.policy.hd128_warp_wave = wave_capacity(attend_hd128_warp_kernel, sizeof(WarpSplitSmem), kWarpSplitThreads);
    s.f16_opted_in = cudaFuncSetAttribute(attend_f16_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(f16_smem_bytes(2)));
    if (s.f16_opted_in == cudaSuccess)
      s.f16_opted_in = cudaFuncSetAttribute(attend_f16_deep_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(f16_smem_bytes(3)));
    if (s.f16_opted_in != cudaSuccess) (void)cudaGetLastError();
    if (s.f16_opted_in == cudaSuccess)
      s.policy.f16_deep_wave = wave_capacity(attend_f16_deep_kernel, f16_smem_bytes(3));
    (void)opt_in(kGeneralKernels, 0);
    const ClusterLimit g = max_cluster(attend_general_kernel, 0);
    s.policy.general_cluster = g.size;
    s.policy.general_cluster_ctas = g.ctas;
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess) {
      s.policy.programmatic = major >= 9;
    } else {
      (void)cudaGetLastError();
    }
    int l2 = 0;
    if (cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device) == cudaSuccess) {
      s.policy.l2_bytes = l2;
    } else {
      (void)cudaGetLastError();
    }
    it = by_device.emplace(device, s).first;
  }
  cached_device = device;
  cached = it->second;
  out = cached;
  return cudaSuccess;
}

// Whether a launch of the tensor-core kernel over `grid` takes the
// warp-split kernel instead (LaunchPolicy::warp_splits): a decode whose
// queries all see at most kAttendSplitBand rows, where the policy says so.
bool takes_warp_splits(const AttendParams& params, const LaunchPolicy& policy, const DeviceSetup& s, dim3 grid) {
  if (policy.warp_splits == WarpSplits::kNever || s.warp_opted_in != cudaSuccess) return false;
  if (params.n_queries != params.n_items || params.most_rows > kAttendSplitBand) return false;
  if (policy.warp_splits == WarpSplits::kAlways) return true;
  const Paths paths = paths_of(grid, params, policy.cluster_limit(kTensorHeadDim),
                               policy.cluster_wave(kTensorHeadDim), policy.resident_limit(kTensorHeadDim));
  return grid.x >= 2 && !paths.resident && !paths.cluster;
}

// Launches the warp-split kernel over `grid` (x = split, y = item, z =
// query), each CTA taking a run of splits (LaunchPolicy::warp_run_for),
// split-major, combining by last arrival; counted in the policy's stats.
cudaError_t launch_warp_splits(AttendParams params, const LaunchPolicy& policy, dim3 grid,
                               const AttendQueryItem* inline_items, cudaStream_t stream) {
  params.cluster = 0;
  params.resident = 0;
  FirstTiles first = first_tiles(params);
  first.query_major = 0;
  first.split_run = policy.warp_run_for(static_cast<std::int64_t>(grid.x) * grid.y * grid.z, params.max_splits,
                                        params.least_splits);
  const unsigned run = static_cast<unsigned>(first.split_run);
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3((grid.x + run - 1) / run, grid.y, grid.z);
  cfg.blockDim = dim3(kWarpSplitThreads, 1, 1);
  cfg.dynamicSmemBytes = sizeof(WarpSplitSmem);
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  programmatic_attribute(attr);
  cfg.attrs = &attr;
  cfg.numAttrs = policy.programmatic ? 1 : 0;
  const cudaError_t e = launch_kernel(cfg, kWarpSplitKernels, first, params, inline_items);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // reported here, not by a later call
  } else if (policy.stats != nullptr) {
    ++policy.stats->warp_splits;
    if (inline_items != nullptr) ++policy.stats->inline_items;
    if (grid.x >= 2) ++policy.stats->last_arrival;
  }
  return e;
}

}  // namespace

int LaunchPolicy::cluster_limit(int head_dim) const {
  return head_dim == kTensorHeadDim ? hd128_cluster : general_cluster;
}

std::int64_t LaunchPolicy::cluster_wave(int head_dim) const {
  return head_dim == kTensorHeadDim ? hd128_cluster_ctas : general_cluster_ctas;
}

int LaunchPolicy::resident_limit(int head_dim) const {
  return head_dim == kTensorHeadDim ? hd128_resident : 0;
}

int LaunchPolicy::split_run_for(std::int64_t ctas, int max_splits, int least_splits, bool decode) const {
  // A power of two and never longer than the splits.
  auto pow2_within = [&](int n) {
    int run = 1;
    while (2 * run <= std::min(n, max_splits)) run *= 2;
    return run;
  };
  if (split_run > 0) return pow2_within(split_run);
  if (!decode || hd128_wave <= 0 || max_splits < 2) return 1;
  const std::int64_t per_split = ctas / max_splits;  // CTAs of one split, over items and queries
  auto runs = [&](int run) { return per_split * ((max_splits + run - 1) / run); };
  if (least_splits == max_splits) {
    // Equal work a CTA: the shortest run that fits the launch in one wave,
    // else the longest, so that each CTA ramps up and combines as few times
    // as it can.
    const int whole = pow2_within(kAttendMaxSplits);
    for (int run = 1; run < whole; run *= 2)
      if (runs(run) <= hd128_wave) return run;
    return whole;
  }
  // Unequal work: the longest run of at most a group that leaves two
  // waves, so that the CTAs still balance.
  const int longest = pow2_within(kAttendGroup);
  int run = 1;
  while (2 * run <= longest && runs(2 * run) >= 2 * hd128_wave) run *= 2;
  return run;
}

int LaunchPolicy::warp_run_for(std::int64_t ctas, int max_splits, int least_splits) const {
  int cover = kWarpSplitWarps;
  while (cover < std::min(max_splits, kAttendMaxSplits)) cover *= 2;
  if (split_run > 0) {
    int run = kWarpSplitWarps;
    while (2 * run <= std::min(split_run, cover)) run *= 2;
    return run;
  }
  if (least_splits != max_splits || hd128_warp_wave <= 0 || max_splits < 1) return kWarpSplitWarps;
  const std::int64_t per_split = ctas / max_splits;  // CTAs of one split, over items and queries
  for (int run = kWarpSplitWarps; run < cover; run *= 2)
    if (per_split * ((max_splits + run - 1) / run) <= hd128_warp_wave) return run;
  return cover;
}

bool LaunchPolicy::f16_deep_for(std::int64_t ctas) const {
  if (f16_stages == 2 || f16_stages == 3) return f16_stages == 3;
  return ctas <= f16_deep_wave;
}

bool LaunchPolicy::query_major_for(std::int64_t most_rows, std::int64_t kv_dim) const {
  if (query_major != QueryMajor::kPastL2) return query_major == QueryMajor::kAlways;
  return l2_bytes > 0 && most_rows * kv_dim * 4 > l2_bytes;
}

LaunchPolicy device_launch_policy() {
  DeviceSetup s;
  if (device_setup(s) != cudaSuccess) {
    (void)cudaGetLastError();
    return LaunchPolicy{};
  }
  return s.policy;
}

cudaError_t launch_attend(const AttendParams& params, const LaunchPolicy& policy, cudaStream_t stream,
                          const AttendQueryItem* inline_items) {
  if (params.n_queries <= 0) return cudaSuccess;
  if (inline_items != nullptr && (params.n_items < 1 || params.n_items > kAttendInlineItems))
    return cudaErrorInvalidValue;
  if (params.own_rows && policy.stats != nullptr) ++policy.stats->own_rows;
  const AttendGrid g = attend_grid(params.n_heads, params.n_kv_heads, params.head_dim);
  const dim3 grid(static_cast<unsigned>(params.max_splits), static_cast<unsigned>(g.items),
                  static_cast<unsigned>(params.n_queries));
  DeviceSetup s;
  const cudaError_t e = device_setup(s);
  if (e != cudaSuccess) return e;
  const int cluster_limit = policy.cluster_limit(params.head_dim);
  const bool query_major = policy.query_major_for(params.most_rows, params.kv_dim);
  if (params.head_dim == kTensorHeadDim) {
    if (s.opted_in != cudaSuccess) return s.opted_in;
    const std::int64_t ctas = static_cast<std::int64_t>(grid.x) * grid.y * grid.z;
    if (takes_warp_splits(params, policy, s, grid))
      return launch_warp_splits(params, policy, grid, inline_items, stream);
    if (params.first_blocks_n > 0 && policy.stats != nullptr) ++policy.stats->first_blocks;
    return launch(kTensorKernels, cluster_limit, policy.cluster_wave(params.head_dim),
                  policy.resident_limit(params.head_dim), query_major,
                  policy.split_run_for(ctas, params.max_splits, params.least_splits,
                                       params.n_queries == params.n_items),
                  policy.programmatic, grid, sizeof(TensorSmem), params, inline_items, policy.stats, stream);
  }
  // The general kernel takes one split a CTA.
  return launch(kGeneralKernels, cluster_limit,
                policy.cluster_wave(params.head_dim), 0, query_major, 1, policy.programmatic, grid, 0, params,
                inline_items, policy.stats, stream);
}

cudaError_t launch_attend_f16(const F16Params& params, const LaunchPolicy& policy, cudaStream_t stream) {
  if (params.n_tiles <= 0) return cudaSuccess;
  DeviceSetup s;
  cudaError_t e = device_setup(s);
  if (e != cudaSuccess) return e;
  if (s.f16_opted_in != cudaSuccess) return s.f16_opted_in;
  // Tiles fastest: the CTAs that run at once are one split's of many tiles,
  // which read the same rows, so those come from L2 for all but the first.
  const dim3 grid(static_cast<unsigned>(params.n_tiles), static_cast<unsigned>(params.P.n_kv_heads),
                  static_cast<unsigned>(params.max_splits));
  const bool deep = policy.f16_deep_for(params.ctas);
  e = launch_plain(deep ? attend_f16_deep_kernel : attend_f16_kernel, grid, kF16Threads, f16_smem_bytes(deep ? 3 : 2),
                   stream, params);
  if (e != cudaSuccess || params.ws == nullptr) return e;
  // The combine: a warp per (query, head) of a tile.
  const int pairs = f16_tile_queries(params.P.n_heads / params.P.n_kv_heads) * params.P.n_heads;
  constexpr int kWarps = kF16Threads / 32;
  const dim3 combine(static_cast<unsigned>(params.n_tiles), static_cast<unsigned>((pairs + kWarps - 1) / kWarps));
  return launch_plain(attend_f16_combine_kernel, combine, kF16Threads, 0, stream, params);
}

}  // namespace kvring::cuda
