// The launch policy of attention: which combine paths a launch may take
// and in which grid order it runs (docs/CUDA.md, "The launch policy").
//
// It is a value, not a setting: a CudaStore holds one, the policy of its
// device (device_launch_policy) unless its creator passes another
// (CudaStore::create). The tests make policies with paths turned off to
// force each combine path, and count the paths taken through `stats`.
// Whatever the policy, a query's output bits are the same (kernels.h).
//
// Host code only; no CUDA headers.
#pragma once

#include <cstdint>

namespace kvring::cuda {

// Attention launches by the path their splits combined on (a launch of one
// split per query is none of them), and how many of the last-arrival ones
// ran query-major.
struct AttendStats {
  long resident = 0;
  long cluster = 0;
  long last_arrival = 0;
  long query_major = 0;
  // Last-arrival launches whose CTAs each took a run of several splits.
  long split_runs = 0;
  // Launches on the warp-split kernel (WarpSplits); those of several
  // splits are last-arrival launches too.
  long warp_splits = 0;
  // Launches that also stored their one-token prefills' rows
  // (AttendParams::own_rows).
  long own_rows = 0;
  // Launches of several items that carried them in their parameters
  // (LaunchPolicy::inline_items).
  long inline_items = 0;
  // Tensor-core launches of one query on a full plane that carried the
  // blocks of its splits' first rows (LaunchPolicy::first_blocks).
  long first_blocks = 0;
};

// When a last-arrival launch of several queries runs query-major (grid.x
// the query and grid.z the split, so that the CTAs that run at once are one
// split's of many queries and read the same rows).
enum class QueryMajor {
  kPastL2,  // when the K and V rows its last query sees outgrow the L2
  kAlways,
  kNever,
};

// Which decode launches of head_dim 128 whose queries all see at most
// kAttendSplitBand rows (so that every split is one tile for each warp of
// the CTA kernel) take the warp-split kernel, where one warp makes a
// whole split's partial with the same arithmetic (docs/CUDA.md, "A warp a
// split").
enum class WarpSplits {
  kLastArrival,  // those that would combine by last arrival (a batch too
                 // large for a resident grid or one wave of clusters)
  kAlways,
  kNever,
};

struct LaunchPolicy {
  // The largest thread-block cluster the splits of a work item may form,
  // for the tensor-core kernel (head_dim 128) and for the general one: 1,
  // no cluster combine. At most what the device runs.
  int hd128_cluster = 1;
  int general_cluster = 1;
  // The most CTAs of a launch that combines in clusters: what the device
  // runs at once in clusters of the largest size (0: no bound). A launch
  // of more (a large batch) would run its clusters in waves, each waiting
  // for a cluster's worth of SMs, and combines by last arrival instead.
  std::int64_t hd128_cluster_ctas = 0;
  std::int64_t general_cluster_ctas = 0;
  // The most CTAs of a resident grid of the tensor-core kernel (the
  // general kernel never runs as one): 0, no resident combine. At most what
  // the device holds at once. A store allocates its tagged partials for
  // this many CTAs.
  int hd128_resident = 0;
  // The CTAs of the tensor-core kernel the device holds at once (0:
  // unknown), and the splits each CTA of a last-arrival launch of that
  // kernel takes: 0, the rule of split_run_for; n, the longest power of
  // two up to n and the launch's split bound.
  std::int64_t hd128_wave = 0;
  int split_run = 0;
  // The warp-split kernel: which launches take it, and the CTAs of it the
  // device holds at once (0: unknown).
  WarpSplits warp_splits = WarpSplits::kLastArrival;
  std::int64_t hd128_warp_wave = 0;
  // The f16 numeric's kernel: 0, the rule of f16_deep_for; 2, the kernel
  // whose copies run one tile ahead (three CTAs an SM); 3, the deep one
  // (two tiles ahead, two CTAs an SM). And the CTAs the device holds at
  // once of the deep kernel (0: unknown, so the rule never takes it).
  int f16_stages = 0;
  std::int64_t f16_deep_wave = 0;
  // Whether the store and decode-attention kernels launch as programmatic
  // dependents of the work before them on the stream (sm_90 and later;
  // resident grids too): each starts, and lets the next one start,
  // while the one before it finishes, and waits for it before touching
  // memory, so a chain of small launches (a decode step) overlaps each
  // launch with the end of the one before (docs/CUDA.md, "Programmatic
  // launches").
  bool programmatic = false;
  // Whether an attention launch of several items, at most
  // kAttendInlineItems (kernels.h), carries them in its parameters; else
  // they go to the device in a descriptor upload before it, a copy-engine
  // step the kernel waits for (docs/CUDA.md, "Items in the launch").
  bool inline_items = true;
  // Whether a launch of one query on a full plane, enqueued outside a
  // capture, carries the block of each split's first row from the host's
  // table (AttendParams::first_blocks), so that its CTAs' first copies do
  // not wait for a table entry; else every block comes from the table on
  // the device.
  bool first_blocks = true;
  // The device's L2 in bytes (0: unknown, so kPastL2 never holds).
  std::int64_t l2_bytes = 0;
  QueryMajor query_major = QueryMajor::kPastL2;
  // The epoch of the store's first resident-grid launch (0 is taken as
  // 1); the next ones count on from it on the device, and where the count
  // wraps it skips 0 and goes on in the other half of the tagged words
  // (kernels.h, ResidentClock; 0xffffffff: the second launch wraps).
  std::uint32_t first_epoch = 1;
  // Where the store counts its attention launches (null: nowhere), under
  // the store's lock; the counter outlives the store's calls.
  AttendStats* stats = nullptr;

  // The cluster and resident-grid limits of attention with `head_dim`.
  int cluster_limit(int head_dim) const;
  std::int64_t cluster_wave(int head_dim) const;
  int resident_limit(int head_dim) const;
  // Whether a last-arrival launch of several queries, whose last query
  // sees `most_rows` rows of `kv_dim` elements, runs query-major.
  bool query_major_for(std::int64_t most_rows, std::int64_t kv_dim) const;
  // The run of splits each CTA of a last-arrival launch of the tensor-core
  // kernel takes, for a grid of `ctas` CTAs of one split each whose queries
  // have from `least_splits` to `max_splits` splits, `decode` when every
  // item of the launch is one query: a power of two, at most max_splits.
  // Prefill launches (whose CTAs share rows through the L2) keep a CTA a
  // split. A decode launch where every query has as many splits takes the
  // shortest run that fits it in one wave of the device, or where none
  // fits the longest (a query's splits, up to a power of two); a launch
  // that fits one wave a CTA a split keeps it. Other decode launches take
  // the longest run of at most 8 that still leaves two waves, so that CTAs
  // of unequal work balance (docs/CUDA.md, "Runs of splits", gives the
  // measurements).
  int split_run_for(std::int64_t ctas, int max_splits, int least_splits, bool decode) const;
  // Whether an f16 launch of `ctas` CTAs takes the deep kernel: where it
  // fits one wave of it, so that the SMs run two CTAs or fewer and each
  // CTA's wait for its rows, not the SM's throughput, sets the time
  // (docs/CUDA.md, "The f16 numeric").
  bool f16_deep_for(std::int64_t ctas) const;
  // The run of splits each CTA of the warp-split kernel takes (its warps
  // take the run's splits in turn), for a grid of `ctas` CTAs of one split
  // each whose queries have from `least_splits` to `max_splits` splits:
  // kWarpSplitWarps (a split a warp) times a power of two, no longer than
  // needed to cover max_splits. Where every query has as many splits, the
  // shortest that fits the launch in one wave of the device, else the one
  // that covers a query's splits; else a split a warp. A forced split_run
  // gives the longest such run up to it.
  int warp_run_for(std::int64_t ctas, int max_splits, int least_splits) const;
};

// The policy of the current device: every combine path it runs,
// query-major past its L2. A device that cannot be queried gets the
// default value (last arrival only), its error cleared.
LaunchPolicy device_launch_policy();

}  // namespace kvring::cuda
