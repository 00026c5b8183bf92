// `kvring run ... --handoff-to HOST:PORT|unix:PATH`: prefill the prompt and hand the
// session to `kvring handoff serve` instead of decoding it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "kvring/config.h"
#include "kvring/handoff.h"
#include "kvring/model.h"

namespace kvring::cli {

struct HandoffSendOptions {
  std::string to;                 // HOST:PORT (UCX) or unix:PATH
  std::string schedule = "paced";
  double rate_gb_s = 0;           // 0: unpaced
  double timeout_s = 10;
  double min_rate_gb_s = 64.0 * 1024 / 1e9;  // SendOptions::min_bytes_per_s; 0: no bound
  std::int64_t message_bytes = std::int64_t{4} << 20;  // largest row message
  std::int64_t prompt_tokens = 0;
  std::int64_t chunk = 128;
  std::int64_t context = 0;
  std::uint64_t seed = 1;
  ModelOptions model;
  bool json = false, progress = true;
};

// Runs the prefill of `session` (fresh, position 0) and sends it; prints a
// summary; returns the exit code.
int run_handoff_send(Session& session, const ModelConfig& config, const HandoffSendOptions& options);

// "1.25" -> 1.25; an error names the option.
// Rates are bounded so that what they become (bytes per second, seconds)
// stays finite and a plan's times stay within a double's precision.
inline constexpr double kMaxRateGbS = 1e6;          // 1 PB/s
inline constexpr double kMaxTokensPerS = 1e12;
inline constexpr double kMaxAckLatencyUs = 1e9;     // 1000 s
Result<double> parse_positive_double(const std::string& option, const std::string& value, bool allow_zero,
                                     double most = std::numeric_limits<double>::max());

// serve's default --max-mib: half the memory the process may use
// (`memory_bytes`, the host's or its cgroup's limit; 0 or less where
// unknown: no such bound), at most the receiving target's own default
// (DetachedCacheTarget::Options::max_row_bytes), at least 1 MiB. A sender
// chooses the store and the reference model serve builds; by default
// neither may take more than the process can hold beside the other. A
// CUDA store's rows count against it too; --max-mib sets more.
inline std::int64_t serve_default_max_mib(std::int64_t memory_bytes) {
  constexpr std::int64_t kMiB = std::int64_t{1} << 20;
  const std::int64_t most = handoff::DetachedCacheTarget::Options{}.max_row_bytes / kMiB;
  if (memory_bytes <= 0) return most;
  return std::max<std::int64_t>(1, std::min(most, memory_bytes / 2 / kMiB));
}

}  // namespace kvring::cli
