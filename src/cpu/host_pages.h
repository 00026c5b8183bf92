// Zeroed host memory for planes and other large buffers of rows.
#pragma once

#include <cstddef>

namespace kvring::cpu {

// The size of a transparent huge page on x86-64.
constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

// Asks the kernel for transparent huge pages over [p, p + bytes) when it
// spans at least one (madvise MADV_HUGEPAGE). Advice only: where the kernel
// grants none, the small pages are correct too.
void advise_huge_pages(void* p, std::size_t bytes);

// An anonymous mapping of `bytes`, zero until written and backed only where
// it is touched. At 2 MiB and more it asks the kernel for transparent huge
// pages: one TLB entry then maps 512 small pages' worth of rows, so a
// stream of rows does not wait on page walks (docs/PERFORMANCE.md has the
// figures; a kernel that grants none leaves small pages, which are correct
// too). Moves only.
class HostPages {
 public:
  HostPages() = default;
  // Empty (data() null) when the mapping fails.
  static HostPages allocate(std::size_t bytes);
  HostPages(HostPages&& o) noexcept : data_(o.data_), bytes_(o.bytes_) {
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  HostPages& operator=(HostPages&& o) noexcept;
  HostPages(const HostPages&) = delete;
  HostPages& operator=(const HostPages&) = delete;
  ~HostPages();

  void* data() const { return data_; }
  std::size_t size() const { return bytes_; }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace kvring::cpu
