#include "pack_common.h"

#include <algorithm>

#include "coding.h"
#include "kvring/f16.h"
#include "kvring/sha256.h"

namespace kvring {

const char* encoding_name(Encoding encoding) {
  switch (encoding) {
    case Encoding::kF16Le: return "F16Le";
    case Encoding::kF32Le: return "F32Le";
  }
  return "Unknown";
}

namespace pack_internal {

std::int64_t count_chunks(std::int64_t origin, std::int64_t len, std::int64_t chunk_tokens) {
  if (len <= 0) return 0;
  return (origin + len - 1) / chunk_tokens - origin / chunk_tokens + 1;
}

ChunkRange chunk_range(std::int64_t origin, std::int64_t len, std::int64_t chunk_tokens,
                       std::int64_t j) {
  const std::int64_t c = origin / chunk_tokens + j;
  const std::int64_t first = std::max(origin, c * chunk_tokens);
  const std::int64_t end = std::min(origin + len, (c + 1) * chunk_tokens);
  return ChunkRange{first, end - first};
}

std::int64_t element_size(Encoding encoding) { return encoding == Encoding::kF32Le ? 4 : 2; }

std::int64_t chunk_byte_length(std::int64_t rows, std::int64_t kv_dim, Encoding encoding) {
  return 2 * rows * kv_dim * element_size(encoding);
}

std::int64_t max_chunk_tokens(std::int64_t kv_dim) {
  // 2 (K and V) * 4 (the widest element) bytes per value.
  return std::min(kMaxChunkTokens, kMaxChunkBytes / (kv_dim * 2 * 4));
}

std::uint16_t narrow_f32_bits(std::uint32_t bits) {
  const std::uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) {  // NaN
    const std::uint32_t top = (abs >> 13) & 0x3ffu;
    if ((abs & 0x1fffu) == 0 && top != 0)
      return static_cast<std::uint16_t>(((bits >> 16) & 0x8000u) | 0x7c00u | top);
  }
  return f32_to_f16(f32_from_bits(bits));
}

void encode_values(Encoding encoding, const std::uint16_t* src, std::int64_t n, std::uint8_t* dst) {
  if (encoding == Encoding::kF16Le) {
    for (std::int64_t i = 0; i < n; ++i) coding::encode_fixed16(dst + 2 * i, src[i]);
    return;
  }
  for (std::int64_t i = 0; i < n; ++i)
    coding::encode_fixed32(dst + 4 * i, f32_bits(f16_to_f32(src[i])));
}

void decode_values(Encoding encoding, const std::uint8_t* src, std::int64_t n, std::uint16_t* dst) {
  if (encoding == Encoding::kF16Le) {
    for (std::int64_t i = 0; i < n; ++i) dst[i] = coding::decode_fixed16(src + 2 * i);
    return;
  }
  for (std::int64_t i = 0; i < n; ++i) dst[i] = narrow_f32_bits(coding::decode_fixed32(src + 4 * i));
}

std::string short_name(const Digest& name) { return to_hex(name.data(), 8); }

bool is_chunk_name(std::string_view text) {
  auto hex = [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); };
  return text.size() == 2 * kDigestBytes && std::all_of(text.begin(), text.end(), hex);
}

Status first_error(const std::vector<Status>& statuses) {
  for (const Status& s : statuses) KVRING_RETURN_IF_ERROR(s);
  return Status::Ok();
}

namespace {
// The most bytes a streamed hash holds in its buffer.
constexpr std::int64_t kPiece = std::int64_t{1} << 20;
}  // namespace

Result<Digest> sha256_in_pieces(std::int64_t bytes,
                                const std::function<Status(std::int64_t, std::int64_t, std::uint8_t*)>& read) {
  std::vector<std::uint8_t> buf(static_cast<std::size_t>(std::min(bytes, kPiece)));
  Sha256 h;
  for (std::int64_t done = 0; done < bytes;) {
    const std::int64_t n = std::min(bytes - done, kPiece);
    KVRING_RETURN_IF_ERROR(read(done, n, buf.data()));
    h.update(buf.data(), static_cast<std::size_t>(n));
    done += n;
  }
  return h.finish();
}

std::vector<Digest> sha256_of_zeros(const std::vector<std::int64_t>& lengths) {
  const std::vector<std::uint8_t> zeros(
      static_cast<std::size_t>(lengths.empty() ? 0 : std::min(lengths.back(), kPiece)));
  std::vector<Digest> digests;
  digests.reserve(lengths.size());
  Sha256 h;
  std::int64_t done = 0;
  for (const std::int64_t length : lengths) {
    while (done < length) {
      const std::int64_t n = std::min(length - done, kPiece);
      h.update(zeros.data(), static_cast<std::size_t>(n));
      done += n;
    }
    digests.push_back(h.digest_so_far());
  }
  return digests;
}

PlaneGroups group_planes(const Snapshot& header, std::int64_t group_bytes) {
  const auto n_layers = static_cast<std::int64_t>(header.planes.size());
  auto len = [&](std::int64_t l) { return header.planes[static_cast<std::size_t>(l)].ring.len(); };
  const std::int64_t row_bytes = 2 * header.config.kv_dim() * std::int64_t{sizeof(std::uint16_t)};
  std::int64_t budget = std::max<std::int64_t>(group_bytes, 0) / row_bytes;
  for (std::int64_t l = 0; l < n_layers; ++l) budget = std::max(budget, len(l));
  PlaneGroups g;
  g.end.resize(static_cast<std::size_t>(n_layers));
  g.offset.resize(static_cast<std::size_t>(n_layers));
  for (std::int64_t first = 0; first < n_layers;) {
    std::int64_t end = first, rows = 0;
    while (end < n_layers && (end == first || rows + len(end) <= budget)) {
      g.offset[static_cast<std::size_t>(end)] = rows;
      rows += len(end++);
    }
    for (std::int64_t l = first; l < end; ++l) g.end[static_cast<std::size_t>(l)] = end;
    g.most = std::max(g.most, rows);
    first = end;
  }
  return g;
}

}  // namespace pack_internal
}  // namespace kvring
