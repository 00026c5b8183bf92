#include "kvring/footprint.h"

#include <algorithm>
#include <cstdio>

#include "kvring/cache.h"
#include "kvring/store.h"

namespace kvring {

Result<Footprint> compute_footprint(const ModelConfig& config, std::int64_t context,
                                    std::int64_t slots) {
  KVRING_RETURN_IF_ERROR(config.validate());
  if (context < 1 || context > config.max_context)
    return invalid_argument("context " + std::to_string(context) + " outside [1, " +
                            std::to_string(config.max_context) + "] for model '" +
                            config.name + "'");
  if (slots < 1 || slots > kMaxFootprintSlots)
    return invalid_argument("slots " + std::to_string(slots) + " outside [1, " +
                            std::to_string(kMaxFootprintSlots) + "]");
  Footprint f;
  f.context = context;
  f.slots = slots;
  f.n_sliding = config.count(LayerKind::kSlidingRope);
  f.n_full = config.count(LayerKind::kFullNope);
  const std::int64_t row_bytes = config.kv_dim() * 2 * 2;  // K + V, f16
  f.bytes_per_token = config.n_layers * row_bytes;
  f.sliding_rows = config.plane_capacity(LayerKind::kSlidingRope, context);
  // Full planes are whole blocks of the store's pool (store.h).
  auto store = resolve_store_options(config, {.context = context});
  if (!store) return store.error();
  f.block_rows = store->block_rows;
  const std::int64_t full_capacity = config.plane_capacity(LayerKind::kFullNope, context);
  f.full_rows = (full_capacity + f.block_rows - 1) / f.block_rows * f.block_rows;
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

Result<SequenceFit> fit_sequences(const ModelConfig& config, std::int64_t length,
                                  std::int64_t memory_bytes, std::int64_t block_rows,
                                  std::int64_t slack) {
  auto o = resolve_store_options(config, {.slack = slack, .block_rows = block_rows});
  if (!o) return o.error();
  if (length < 1 || length > config.max_context)
    return invalid_argument("length " + std::to_string(length) + " outside [1, " +
                            std::to_string(config.max_context) + "] for model '" + config.name +
                            "'");
  if (memory_bytes < 1) return invalid_argument("memory " + std::to_string(memory_bytes) + " < 1 B");
  SequenceFit fit;
  fit.length = length;
  fit.memory_bytes = memory_bytes;
  fit.block_rows = o->block_rows;
  const std::int64_t row_bytes = config.kv_dim() * 2 * 2;
  fit.sliding_bytes = config.count(LayerKind::kSlidingRope) *
                      (config.plane_capacity(LayerKind::kSlidingRope, o->context) + o->slack) *
                      row_bytes;
  const std::int64_t blocks = (length + o->block_rows - 1) / o->block_rows;
  fit.full_bytes = config.count(LayerKind::kFullNope) * blocks * o->block_rows * row_bytes;
  fit.sequence_bytes = fit.sliding_bytes + fit.full_bytes;
  // What the memory holds, within what one store holds: kMaxFootprintSlots
  // sequences, kMaxPoolBlocks blocks and kMaxStoreBytes bytes.
  const std::int64_t fits = memory_bytes / fit.sequence_bytes;
  const std::int64_t sequence_blocks = config.count(LayerKind::kFullNope) * blocks;
  std::int64_t most = std::min(kMaxFootprintSlots, kMaxStoreBytes / fit.sequence_bytes);
  if (sequence_blocks > 0) most = std::min(most, kMaxPoolBlocks / sequence_blocks);
  fit.sequences = std::min(fits, most);
  fit.capped = fits > most;
  fit.pool_blocks = fit.sequences * sequence_blocks;
  return fit;
}

Result<std::int64_t> parse_bytes(const std::string& text) {
  // DIGITS[.DIGITS][ ]UNIT; a fraction is taken exactly and the bytes
  // rounded down (a memory budget is never overstated).
  constexpr std::size_t kMaxFractionDigits = 18;
  std::size_t i = 0;
  while (i < text.size() && text[i] >= '0' && text[i] <= '9') ++i;
  if (i == 0) return invalid_argument("'" + text + "' is not a byte count (e.g. 80GiB or 79.5GiB)");
  std::int64_t number = 0;
  for (std::size_t d = 0; d < i; ++d)
    if (__builtin_mul_overflow(number, 10, &number) || __builtin_add_overflow(number, text[d] - '0', &number))
      return invalid_argument("'" + text + "' exceeds 2^63 bytes");
  std::int64_t fraction = 0, denominator = 1;
  if (i < text.size() && text[i] == '.') {
    const std::size_t first = ++i;
    while (i < text.size() && text[i] >= '0' && text[i] <= '9') ++i;
    if (i == first) return invalid_argument("'" + text + "': no digits after the decimal point");
    if (i - first > kMaxFractionDigits)
      return invalid_argument("'" + text + "': more than " + std::to_string(kMaxFractionDigits) +
                              " digits after the decimal point");
    for (std::size_t d = first; d < i; ++d) fraction = fraction * 10 + (text[d] - '0'), denominator *= 10;
  }
  std::string unit = text.substr(i);
  while (!unit.empty() && unit.front() == ' ') unit.erase(0, 1);
  static const std::pair<const char*, std::int64_t> kUnits[] = {
      {"", 1},          {"B", 1},
      {"kB", 1000},     {"KiB", 1024},
      {"MB", 1000000},  {"MiB", 1 << 20},
      {"GB", 1000000000}, {"GiB", std::int64_t{1} << 30},
      {"TB", 1000000000000}, {"TiB", std::int64_t{1} << 40}};
  for (const auto& [name, scale] : kUnits)
    if (unit == name) {
      // fraction < denominator <= 10^18 and scale <= 2^40: the product
      // fits 128 bits.
      const __int128 part = static_cast<__int128>(fraction) * scale / denominator;
      std::int64_t bytes = 0;
      if (__builtin_mul_overflow(number, scale, &bytes) ||
          __builtin_add_overflow(bytes, static_cast<std::int64_t>(part), &bytes))
        return invalid_argument("'" + text + "' exceeds 2^63 bytes");
      return bytes;
    }
  return invalid_argument("'" + text + "': unknown unit '" + unit +
                          "' (B, kB, KiB, MB, MiB, GB, GiB, TB, TiB)");
}

std::string with_commas(std::int64_t value) {
  // The magnitude as unsigned: -value overflows for the most negative value.
  const std::uint64_t magnitude =
      value < 0 ? ~static_cast<std::uint64_t>(value) + 1 : static_cast<std::uint64_t>(value);
  std::string digits = std::to_string(magnitude);
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
