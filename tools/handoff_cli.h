// `kvring run ... --handoff-to HOST:PORT`: prefill the prompt and hand the
// session to `kvring handoff serve` instead of decoding it.
#pragma once

#include <cstdint>
#include <string>

#include "kvring/config.h"
#include "kvring/model.h"

namespace kvring::cli {

struct HandoffSendOptions {
  std::string to;                 // HOST:PORT
  std::string schedule = "paced";
  double rate_gb_s = 0;           // 0: unpaced
  double timeout_s = 10;
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
Result<double> parse_positive_double(const std::string& option, const std::string& value, bool allow_zero);

}  // namespace kvring::cli
