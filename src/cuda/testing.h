// Hooks for the CUDA tests: device-side checks that have no place in the
// store's interface.
#pragma once

#include <cstdint>

#include "kvring/status.h"

namespace kvring::cuda::testing {

// Converts every one of the 2^32 f32 bit patterns on the GPU with the store
// kernels' conversion and with f32_to_f16 (f16.h, compiled for the device),
// in both halves of a packed pair.
struct F16Sweep {
  std::uint64_t checked = 0;
  std::uint64_t mismatches = 0;
  std::uint32_t first_input = 0;   // the first mismatching f32 bits
  std::uint16_t first_device = 0;  // what the store conversion gave
  std::uint16_t first_shared = 0;  // what f32_to_f16 gave
};
Result<F16Sweep> sweep_f16_conversion();

// Caps the thread-block clusters attention launches use to `cap` CTAs (1:
// every split combines through the global workspace; 0: the device's own
// limit, the default), so a test can run both combine paths.
void set_attend_cluster_cap(int cap);
// The largest cluster an attention launch with head_dim `head_dim` uses now.
int attend_cluster_limit(int head_dim);
// Allows (the default) or forbids resident-grid combines (kernels.h,
// AttendParams::resident), so a test can run the last-arrival combine.
void set_attend_resident(bool allowed);
// The most CTAs a resident-grid attention launch with head_dim `head_dim`
// may have now (0: that path is off).
int attend_resident_limit(int head_dim);
// Attention launches so far, by the path their splits combined on
// (launches of one split per query count as none of them), and how many of
// the last-arrival ones ran query-major.
struct AttendPathCounts {
  long resident = 0;
  long cluster = 0;
  long last_arrival = 0;
  long query_major = 0;
};
AttendPathCounts attend_path_counts();
// When last-arrival launches of several queries run query-major
// (attention.cu, FirstTiles::query_major): 0, the default, when one
// query's rows outgrow the L2; 1 always; -1 never.
void set_attend_query_major(int mode);
// The splits a query that sees n rows is cut into (kernels.h).
int attend_splits_for(std::int64_t n);
// The capability check of store creation for a device of compute
// capability major.minor on which this build's kernels do (or do not) run:
// ok, or kUnsupported naming the capability and the build's targets.
Status check_capability(int major, int minor, bool kernels_run);
// Makes the next resident-grid launch of any store take epoch `epoch`
// (nonzero), as if the count had reached it: 0xffffffff makes the launch
// after it wrap.
void set_attend_next_epoch(std::uint32_t epoch);

}  // namespace kvring::cuda::testing
