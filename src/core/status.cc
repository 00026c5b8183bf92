#include "kvring/status.h"

#include <cstdio>
#include <cstdlib>

namespace kvring {

void detail::abort_bad_result_access(const Error& error) {
  std::fprintf(stderr, "kvring: a Result's value was taken where it holds an error, or its error where it "
                       "holds a value: %s\n", error.to_string().c_str());
  std::abort();
}

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "InvalidArgument";
    case ErrorCode::kCacheDiscontinuity: return "CacheDiscontinuity";
    case ErrorCode::kCapacityExceeded: return "CapacityExceeded";
    case ErrorCode::kConfig: return "ConfigError";
    case ErrorCode::kCorruption: return "Corruption";
    case ErrorCode::kMismatch: return "Mismatch";
    case ErrorCode::kNotFound: return "NotFound";
    case ErrorCode::kIOError: return "IOError";
    case ErrorCode::kUnsupported: return "Unsupported";
    case ErrorCode::kCuda: return "CudaError";
    case ErrorCode::kInternal: return "Internal";
    case ErrorCode::kResourceExhausted: return "ResourceExhausted";
  }
  return "Unknown";
}

std::string Error::to_string() const {
  return std::string(error_code_name(code)) + ": " + message;
}

Error make_error(ErrorCode code, std::string message) {
  Error e;
  e.code = code;
  e.message = std::move(message);
  return e;
}

Error invalid_argument(std::string message) {
  return make_error(ErrorCode::kInvalidArgument, std::move(message));
}
Error config_error(std::string message) {
  return make_error(ErrorCode::kConfig, std::move(message));
}
Error corruption(std::string message) {
  return make_error(ErrorCode::kCorruption, std::move(message));
}
Error io_error(std::string message) {
  return make_error(ErrorCode::kIOError, std::move(message));
}

Error cache_discontinuity(std::int64_t layer, std::int64_t expected,
                          std::int64_t got) {
  Error e = make_error(ErrorCode::kCacheDiscontinuity,
                       "layer " + std::to_string(layer) + ": expected position " +
                           std::to_string(expected) + ", got " +
                           std::to_string(got));
  e.layer = layer;
  e.expected = expected;
  e.got = got;
  return e;
}

}  // namespace kvring
