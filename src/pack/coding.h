// Fixed-width little-endian encoding and decoding, as in leveldb's
// util/coding.h.
//
// Writers append to a std::string. Readers take (p, limit) and return the
// position after the value, or nullptr when fewer bytes than the value's
// width remain before `limit`: they never read past the end. The format is
// little-endian on every host; no value is ever read through a cast pointer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace kvring::coding {

inline void encode_fixed16(std::uint8_t* dst, std::uint16_t v) {
  dst[0] = static_cast<std::uint8_t>(v);
  dst[1] = static_cast<std::uint8_t>(v >> 8);
}
inline void encode_fixed32(std::uint8_t* dst, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) dst[i] = static_cast<std::uint8_t>(v >> (8 * i));
}
inline void encode_fixed64(std::uint8_t* dst, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) dst[i] = static_cast<std::uint8_t>(v >> (8 * i));
}

inline std::uint16_t decode_fixed16(const std::uint8_t* p) {
  return static_cast<std::uint16_t>(p[0] | (p[1] << 8));
}
inline std::uint32_t decode_fixed32(const std::uint8_t* p) {
  std::uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
inline std::uint64_t decode_fixed64(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

inline void put_fixed8(std::string* dst, std::uint8_t v) { dst->push_back(static_cast<char>(v)); }
inline void put_fixed16(std::string* dst, std::uint16_t v) {
  std::uint8_t b[2];
  encode_fixed16(b, v);
  dst->append(reinterpret_cast<const char*>(b), sizeof b);
}
inline void put_fixed32(std::string* dst, std::uint32_t v) {
  std::uint8_t b[4];
  encode_fixed32(b, v);
  dst->append(reinterpret_cast<const char*>(b), sizeof b);
}
inline void put_fixed64(std::string* dst, std::uint64_t v) {
  std::uint8_t b[8];
  encode_fixed64(b, v);
  dst->append(reinterpret_cast<const char*>(b), sizeof b);
}
inline void put_bytes(std::string* dst, const void* data, std::size_t n) {
  dst->append(static_cast<const char*>(data), n);
}

// Bytes left in [p, limit); 0 when p is at or past limit.
inline std::size_t remaining(const std::uint8_t* p, const std::uint8_t* limit) {
  return p < limit ? static_cast<std::size_t>(limit - p) : 0;
}

inline const std::uint8_t* get_fixed8(const std::uint8_t* p, const std::uint8_t* limit,
                                      std::uint8_t* v) {
  if (remaining(p, limit) < 1) return nullptr;
  *v = *p;
  return p + 1;
}
inline const std::uint8_t* get_fixed16(const std::uint8_t* p, const std::uint8_t* limit,
                                       std::uint16_t* v) {
  if (remaining(p, limit) < 2) return nullptr;
  *v = decode_fixed16(p);
  return p + 2;
}
inline const std::uint8_t* get_fixed32(const std::uint8_t* p, const std::uint8_t* limit,
                                       std::uint32_t* v) {
  if (remaining(p, limit) < 4) return nullptr;
  *v = decode_fixed32(p);
  return p + 4;
}
inline const std::uint8_t* get_fixed64(const std::uint8_t* p, const std::uint8_t* limit,
                                       std::uint64_t* v) {
  if (remaining(p, limit) < 8) return nullptr;
  *v = decode_fixed64(p);
  return p + 8;
}
// `n` raw bytes: *out points at them inside [p, limit).
inline const std::uint8_t* get_bytes(const std::uint8_t* p, const std::uint8_t* limit,
                                     std::size_t n, const std::uint8_t** out) {
  if (remaining(p, limit) < n) return nullptr;
  *out = p;
  return p + n;
}

}  // namespace kvring::coding
