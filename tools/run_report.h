// The summary `kvring run` prints (text, or one JSON object with --json), for
// every command that ends with a session of the reference model.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kvring/config.h"
#include "kvring/model.h"

namespace kvring::cli {

struct RunReport {
  const ModelConfig* config = nullptr;
  const Session* session = nullptr;
  std::int64_t prompt_tokens = 0;
  std::uint64_t seed = 0;
  std::int64_t chunk = 0;
  ModelOptions model;
  std::int64_t context = 0;
  std::vector<std::int32_t> generated;
  double prefill_s = 0, decode_s = 0;
  std::int64_t prefilled = 0, decoded = 0;  // tokens each phase ran
  bool json = false;
  std::string saved;                         // a "saved" line, or empty
  nlohmann::json extra_timing = nlohmann::json::object();  // merged into "timing"
  std::vector<std::string> extra_lines;      // printed after the text summary
};

// Prints the summary to stdout; returns the exit code 0.
int print_run_report(const RunReport& report);

}  // namespace kvring::cli
