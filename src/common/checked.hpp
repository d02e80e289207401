// Sizes computed from a caller's counts, checked: nullopt where a product or sum passes
// 2^64 - 1, so that a size check sees the overflow instead of a wrapped, small size it would
// accept (2^62 + 4 FP32 values are 16 bytes once wrapped).
#pragma once

#include <cstdint>
#include <optional>
#include <span>

namespace ciera {

inline std::optional<uint64_t> checked_product(uint64_t a, uint64_t b) {
  uint64_t product = 0;
  if (__builtin_mul_overflow(a, b, &product)) return std::nullopt;
  return product;
}

// The sum of `counts`, each times `scale`.
inline std::optional<uint64_t> checked_scaled_sum(std::span<const uint64_t> counts,
                                                  uint64_t scale) {
  uint64_t sum = 0;
  for (const uint64_t n : counts) {
    const std::optional<uint64_t> scaled = checked_product(n, scale);
    if (!scaled || __builtin_add_overflow(sum, *scaled, &sum)) return std::nullopt;
  }
  return sum;
}

}  // namespace ciera
