// Byte-symbol histograms and their order-0 entropy.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace ciera::entropy {

struct Histogram {
  std::array<uint64_t, 256> count{};
  uint64_t total = 0;

  void add(const uint8_t* symbols, size_t n);
  unsigned distinct() const;
  unsigned max_symbol() const;  // 0 when empty
  // Order-0 entropy in bits per symbol (0 when empty).
  double entropy_bits() const;
};

}  // namespace ciera::entropy
