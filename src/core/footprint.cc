#include "kvring/footprint.h"

#include <cstdio>

#include "kvring/cache.h"

namespace kvring {

inline constexpr std::int64_t kMaxSlots = 1 << 20;

Result<Footprint> compute_footprint(const ModelConfig& config, std::int64_t context,
                                    std::int64_t slots) {
  KVRING_RETURN_IF_ERROR(config.validate());
  if (context < 1 || context > config.max_context)
    return invalid_argument("context " + std::to_string(context) + " outside [1, " +
                            std::to_string(config.max_context) + "] for model '" +
                            config.name + "'");
  if (slots < 1 || slots > kMaxSlots)
    return invalid_argument("slots " + std::to_string(slots) + " outside [1, " +
                            std::to_string(kMaxSlots) + "]");
  Footprint f;
  f.context = context;
  f.slots = slots;
  f.n_sliding = config.count(LayerKind::kSlidingRope);
  f.n_full = config.count(LayerKind::kFullNope);
  const std::int64_t row_bytes = config.kv_dim() * 2 * 2;  // K + V, f16
  f.bytes_per_token = config.n_layers * row_bytes;
  f.sliding_rows = config.plane_capacity(LayerKind::kSlidingRope, context);
  f.full_rows = config.plane_capacity(LayerKind::kFullNope, context);
  f.sliding_bytes = f.n_sliding * f.sliding_rows * row_bytes;
  f.full_bytes = f.n_full * f.full_rows * row_bytes;
  f.slot_bytes = f.sliding_bytes + f.full_bytes;
  // One slot of the largest valid geometry fits in 2^57 bytes (config.h's
  // bounds); many slots of it need not fit in 64 bits.
  if (__builtin_mul_overflow(f.slot_bytes, slots, &f.total_bytes))
    return invalid_argument(std::to_string(slots) + " slots of " + with_commas(f.slot_bytes) +
                            " B each exceed 2^63 bytes");
  return f;
}

std::string with_commas(std::int64_t value) {
  std::string digits = std::to_string(value < 0 ? -value : value);
  std::string out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return value < 0 ? "-" + out : out;
}

std::string format_bytes(std::int64_t bytes) {
  static const char* kBin[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  static const char* kDec[] = {"B", "kB", "MB", "GB", "TB"};
  double b = static_cast<double>(bytes), d = b;
  int bi = 0, di = 0;
  while (b >= 1024.0 && bi < 4) b /= 1024.0, ++bi;
  while (d >= 1000.0 && di < 4) d /= 1000.0, ++di;
  char buf[96];
  if (bi == 0) {
    std::snprintf(buf, sizeof buf, "%s B", with_commas(bytes).c_str());
  } else {
    std::snprintf(buf, sizeof buf, "%s B (%.2f %s, %.2f %s)", with_commas(bytes).c_str(), b,
                  kBin[bi], d, kDec[di]);
  }
  return buf;
}

}  // namespace kvring
