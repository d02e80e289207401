// An allocator for the codec's large buffers (exponent caches, payload buffers): allocations of
// at least one huge page are aligned to 2 MiB and offered to transparent huge pages (madvise), so
// that streaming through a 16 MiB cache does not also walk 4 KiB page tables; smaller ones are
// aligned to a cache line (64 bytes), as the encoder's non-temporal stores of a payload's
// sign-mantissa plane need (docs/format.md, "Padding"). Where THP is off or madvise fails, the
// memory is ordinary memory; nothing else changes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace ciera {

template <typename T>
struct HugePageAllocator {
  using value_type = T;
  static constexpr size_t kHugePage = size_t{2} << 20;
  static constexpr size_t kCacheLine = 64;

  HugePageAllocator() = default;
  template <typename U>
  HugePageAllocator(const HugePageAllocator<U>&) {}

  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kHugePage) {
      // aligned_alloc wants a non-zero multiple of the alignment.
      const size_t lines = std::max<size_t>(1, (bytes + kCacheLine - 1) / kCacheLine);
      void* p = std::aligned_alloc(kCacheLine, lines * kCacheLine);
      if (p == nullptr) throw std::bad_alloc();
      return static_cast<T*>(p);
    }
    const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    void* p = std::aligned_alloc(kHugePage, rounded);
    if (p == nullptr) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(p, rounded, MADV_HUGEPAGE);  // advice only: failure leaves ordinary pages
#endif
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) noexcept { std::free(p); }

  template <typename U>
  bool operator==(const HugePageAllocator<U>&) const { return true; }
};

}  // namespace ciera
