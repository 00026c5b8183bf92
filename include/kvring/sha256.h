// SHA-256 through OpenSSL (which uses the CPU's SHA extensions).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace kvring {

using Digest = std::array<std::uint8_t, 32>;

Digest sha256(const void* data, std::size_t size);
std::string to_hex(const std::uint8_t* data, std::size_t size);
inline std::string to_hex(const Digest& d) { return to_hex(d.data(), d.size()); }

// Incremental hashing.
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void update(const void* data, std::size_t size);
  // The digest of the bytes given so far; hashing may go on after it.
  Digest digest_so_far() const;
  Digest finish();

 private:
  void* ctx_;  // EVP_MD_CTX
};

}  // namespace kvring
