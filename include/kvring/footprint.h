// Memory footprint of a model's KV cache, from the config alone. Equal to
// what the backends allocate (KvCache::allocated_bytes) for a store without
// rollback slack and with the default pool.
#pragma once

#include <cstdint>
#include <string>

#include "kvring/config.h"
#include "kvring/status.h"

namespace kvring {

struct Footprint {
  std::int64_t context = 0;
  std::int64_t slots = 0;
  std::int64_t n_sliding = 0;
  std::int64_t n_full = 0;
  std::int64_t bytes_per_token = 0;  // K + V, f16, all layers
  std::int64_t sliding_rows = 0;     // rows per sliding plane
  std::int64_t full_rows = 0;        // rows per full plane (whole blocks)
  std::int64_t block_rows = 0;       // rows of one block of the store's pool
  std::int64_t sliding_bytes = 0;    // all sliding planes of one slot
  std::int64_t full_bytes = 0;       // all full planes of one slot
  std::int64_t slot_bytes = 0;
  std::int64_t total_bytes = 0;      // slots * slot_bytes
};

// The most slots a footprint is computed for (a store holds at most as
// many sequences).
inline constexpr std::int64_t kMaxFootprintSlots = std::int64_t{1} << 20;
// Errors: context outside [1, max_context], slots outside [1, kMaxFootprintSlots].
Result<Footprint> compute_footprint(const ModelConfig& config, std::int64_t context,
                                    std::int64_t slots);

// How many sequences of `length` tokens a store holds in `memory_bytes`:
// each takes its sliding rings (max(32, min(context, W)) + slack rows)
// and, per full layer, its rows rounded up to whole blocks (block_rows 0:
// the store's default). The store of the fit: StoreOptions{.max_sequences
// = sequences, .slack = slack, .block_rows = block_rows, .pool_blocks =
// pool_blocks} (context: the model's), whose allocated_bytes() are
// sequences x sequence_bytes, at most memory_bytes; its sequences may
// each reach the model's context while the pool holds `length` tokens of
// each on average. sequences 0: not one fits.
struct SequenceFit {
  std::int64_t length = 0;
  std::int64_t memory_bytes = 0;
  std::int64_t block_rows = 0;
  std::int64_t sliding_bytes = 0;   // one sequence's rings
  std::int64_t full_bytes = 0;      // one sequence's blocks
  std::int64_t sequence_bytes = 0;
  std::int64_t sequences = 0;
  std::int64_t pool_blocks = 0;     // sequences x blocks of one sequence's full planes
  // The memory holds more, but a store holds at most kMaxFootprintSlots
  // sequences, its pool at most kMaxPoolBlocks blocks and its storage at
  // most kMaxStoreBytes: `sequences` is the most those bounds allow.
  bool capped = false;
};
Result<SequenceFit> fit_sequences(const ModelConfig& config, std::int64_t length,
                                  std::int64_t memory_bytes, std::int64_t block_rows = 0,
                                  std::int64_t slack = 0);

// Bytes from "1048576", "80GiB", "141GB", "512 MiB", "79.5GiB" (B,
// kB/KiB, MB/MiB, GB/GiB, TB/TiB; up to 18 digits after a decimal point,
// the bytes rounded down).
Result<std::int64_t> parse_bytes(const std::string& text);

// "1,826,619,392 B (1.70 GiB, 1.83 GB)"
std::string format_bytes(std::int64_t bytes);
std::string with_commas(std::int64_t value);

}  // namespace kvring
