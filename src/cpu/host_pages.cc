#include "host_pages.h"

#include <sys/mman.h>

#include <utility>

namespace kvring::cpu {

void advise_huge_pages(void* p, std::size_t bytes) {
#ifdef MADV_HUGEPAGE
  if (bytes >= kHugePageBytes) (void)madvise(p, bytes, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

HostPages HostPages::allocate(std::size_t bytes) {
  HostPages h;
  const std::size_t n = bytes == 0 ? 1 : bytes;
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return h;
  advise_huge_pages(p, n);
  h.data_ = p;
  h.bytes_ = n;
  return h;
}

HostPages& HostPages::operator=(HostPages&& o) noexcept {
  if (this != &o) {
    HostPages old(std::move(*this));
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

HostPages::~HostPages() {
  if (data_ != nullptr) munmap(data_, bytes_);
}

}  // namespace kvring::cpu
