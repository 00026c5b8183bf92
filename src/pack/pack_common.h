// Pieces of the kvpack codec shared by the writer and the reader: chunk
// boundaries, element encodings, and the first-error-in-order collection of
// parallel results.
#pragma once

#include <bit>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "kvring/pack.h"
#include "kvring/snapshot.h"

namespace kvring::pack_internal {

inline constexpr bool kHostLittleEndian = std::endian::native == std::endian::little;

// Chunk j of a plane whose live rows are [origin, origin + len): boundaries
// at multiples of chunk_tokens in logical position (docs/kvpack-format.md).
struct ChunkRange {
  std::int64_t first_position = 0;
  std::int64_t rows = 0;
};
std::int64_t count_chunks(std::int64_t origin, std::int64_t len, std::int64_t chunk_tokens);
ChunkRange chunk_range(std::int64_t origin, std::int64_t len, std::int64_t chunk_tokens,
                       std::int64_t j);

std::int64_t element_size(Encoding encoding);
// K rows then V rows: 2 * rows * kv_dim elements.
std::int64_t chunk_byte_length(std::int64_t rows, std::int64_t kv_dim, Encoding encoding);
// The largest chunk_tokens for which any chunk of this kv_dim stays within
// kMaxChunkBytes in every encoding.
std::int64_t max_chunk_tokens(std::int64_t kv_dim);

// f16 bits -> the encoding's little-endian bytes, and back. Narrowing from
// F32Le rounds to nearest even and keeps a NaN's top 10 mantissa bits when
// its low 13 are zero, so f16 -> F32Le -> f16 is the identity on all bits.
void encode_values(Encoding encoding, const std::uint16_t* src, std::int64_t n, std::uint8_t* dst);
void decode_values(Encoding encoding, const std::uint8_t* src, std::int64_t n, std::uint16_t* dst);
std::uint16_t narrow_f32_bits(std::uint32_t bits);

// "1dc0b8211f55ab66": enough of a name to find it in a listing.
std::string short_name(const Digest& name);

// Whether `text` is a chunk's name as to_hex writes it: 2 * kDigestBytes
// lowercase hex digits (a directory store's file, a Redis key's tail).
bool is_chunk_name(std::string_view text);

// Statuses of independent tasks; the first failure in task order is the one
// reported, whichever thread finished first.
Status first_error(const std::vector<Status>& statuses);

// SHA-256 of `bytes` bytes that `read(offset, n, dst)` delivers, through a
// buffer of at most 1 MiB whatever `bytes` claims; read's first error.
Result<Digest> sha256_in_pieces(std::int64_t bytes,
                                const std::function<Status(std::int64_t, std::int64_t, std::uint8_t*)>& read);

// SHA-256 of `lengths[j]` zero bytes for each j, the lengths ascending
// and none negative: one pass over as many zeros as the last of them, the
// digest taken at each length on the way, through a buffer of at most
// 1 MiB.
std::vector<Digest> sha256_of_zeros(const std::vector<std::int64_t>& lengths);

// Consecutive planes of `header` in groups: as many as fit in the larger
// of `group_bytes` of rows (K and V) and the longest plane, so that a
// group's rows fit one buffer however long the sequence. Per layer: the end
// of its group and its first row in the group's buffer; `most` is the rows
// of the largest group.
struct PlaneGroups {
  std::vector<std::int64_t> end, offset;
  std::int64_t most = 0;
};
PlaneGroups group_planes(const Snapshot& header, std::int64_t group_bytes);

// write_pack of a store's sequence with consecutive planes read a group
// at a time (group_planes); write_pack takes kStoreGroupBytes.
inline constexpr std::int64_t kStoreGroupBytes = std::int64_t{64} << 20;
Status write_pack_in_groups(const KvStore& store, SeqId seq, const std::string& path,
                            const std::vector<std::int32_t>& token_ids, const std::string& metadata,
                            const WriteOptions& options, std::int64_t group_bytes);
// restore_pack into a new sequence of a store, its planes read, verified
// and installed a group at a time (group_planes); restore_pack takes
// kStoreGroupBytes.
Result<SeqId> restore_pack_in_groups(const PackSource& source, const ReadOptions& options, KvStore& target,
                                     Manifest* manifest, std::int64_t group_bytes);

}  // namespace kvring::pack_internal
