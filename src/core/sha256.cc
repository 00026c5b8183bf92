#include "kvring/sha256.h"

#include <openssl/evp.h>

#include <stdexcept>

namespace kvring {

Digest sha256(const void* data, std::size_t size) {
  Digest d{};
  unsigned int n = 0;
  // EVP_Digest only fails on allocation failure inside OpenSSL.
  if (EVP_Digest(data, size, d.data(), &n, EVP_sha256(), nullptr) != 1 || n != 32)
    throw std::runtime_error("OpenSSL SHA-256 failed");
  return d;
}

std::string to_hex(const std::uint8_t* data, std::size_t size) {
  static const char* kHex = "0123456789abcdef";
  std::string s(size * 2, '0');
  for (std::size_t i = 0; i < size; ++i) {
    s[2 * i] = kHex[data[i] >> 4];
    s[2 * i + 1] = kHex[data[i] & 15];
  }
  return s;
}

Sha256::Sha256() : ctx_(EVP_MD_CTX_new()) {
  if (ctx_ == nullptr ||
      EVP_DigestInit_ex(static_cast<EVP_MD_CTX*>(ctx_), EVP_sha256(), nullptr) != 1)
    throw std::runtime_error("OpenSSL SHA-256 init failed");
}

Sha256::~Sha256() { EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_)); }

void Sha256::update(const void* data, std::size_t size) {
  EVP_DigestUpdate(static_cast<EVP_MD_CTX*>(ctx_), data, size);
}

Digest Sha256::digest_so_far() const {
  EVP_MD_CTX* copy = EVP_MD_CTX_new();
  Digest d{};
  unsigned int n = 0;
  const bool ok = copy != nullptr &&
                  EVP_MD_CTX_copy_ex(copy, static_cast<const EVP_MD_CTX*>(ctx_)) == 1 &&
                  EVP_DigestFinal_ex(copy, d.data(), &n) == 1 && n == 32;
  EVP_MD_CTX_free(copy);
  // Only an allocation failure inside OpenSSL gets here.
  if (!ok) throw std::runtime_error("OpenSSL SHA-256 copy failed");
  return d;
}

Digest Sha256::finish() {
  Digest d{};
  unsigned int n = 0;
  EVP_DigestFinal_ex(static_cast<EVP_MD_CTX*>(ctx_), d.data(), &n);
  return d;
}

}  // namespace kvring
