// digest64: the 64-bit digest of a handoff message whose rows are checked
// where they lie, on the host or on the GPU (docs/DESIGN.md, "Handoff",
// "Verification"). It detects corruption (a flipped bit, a torn or
// misplaced copy, a lost piece), not tampering: it is not cryptographic.
//
// The bytes of a segment are read as little-endian 64-bit words w_i (the
// last one zero-padded). With a segment's seed s (distinct per segment of a
// message):
//   words(s, bytes)   = sum over i of fmix64(w_i ^ key(s, i))          mod 2^64
//   segment(s, bytes) = words(s, bytes) + fmix64(length ^ ~key(s, 0))  mod 2^64
//   digest            = fmix64(sum of its segments' values ^ kFinal)
// where key(s, i) = (i + 1 + s * 2^40) * kGolden and fmix64 is MurmurHash3's
// 64-bit finalizer (a bijection with full avalanche). Each word's term is a
// bijection of the word, so a change to any one word always changes the sum;
// changes to several cancel with probability about 2^-64. The sum does not
// depend on the order its terms are added in, so a GPU adds them in any
// order (atomics across blocks) and gets the host's value exactly.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvring/layout.h"  // KVRING_HD

namespace kvring::digest64 {

inline constexpr std::uint64_t kGolden = 0x9e3779b97f4a7c15ULL;
inline constexpr std::uint64_t kFinal = 0x6b7672696e673634ULL;  // "kvring64"

KVRING_HD constexpr std::uint64_t fmix64(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

KVRING_HD constexpr std::uint64_t key(std::uint32_t seed, std::uint64_t i) {
  return (i + 1 + (static_cast<std::uint64_t>(seed) << 40)) * kGolden;
}

KVRING_HD constexpr std::uint64_t term(std::uint64_t word, std::uint32_t seed, std::uint64_t i) {
  return fmix64(word ^ key(seed, i));
}

// words(): the sum of every word's term (host).
std::uint64_t words(const void* data, std::size_t bytes, std::uint32_t seed);

inline std::uint64_t length_term(std::size_t bytes, std::uint32_t seed) {
  return fmix64(static_cast<std::uint64_t>(bytes) ^ ~key(seed, 0));
}

inline std::uint64_t segment(const void* data, std::size_t bytes, std::uint32_t seed) {
  return words(data, bytes, seed) + length_term(bytes, seed);
}

inline std::uint64_t finish(std::uint64_t sum) { return fmix64(sum ^ kFinal); }

}  // namespace kvring::digest64
