// Integer-only arithmetic behind the rANS model (docs/architecture.md, "Deterministic encoding"):
// the CPU encoder and the GPU encoder must build the same frequency table and choose the same
// stream method from the same histogram, so nothing here may depend on a platform's floating
// point (log2 rounding, fused multiply-add contraction).
#pragma once

#include <array>
#include <cstdint>

#include "common/host_device.hpp"
#include "entropy/rans_core.hpp"

namespace ciera::entropy {

// log2(f) in fixed point with 16 fraction bits, truncated, for 1 <= f < 2^16: the integer part,
// then one fraction bit per squaring of the mantissa.
CIERA_HD constexpr uint32_t log2_q16(uint32_t f) {
  uint32_t integer = 0;
  while ((f >> (integer + 1)) != 0) ++integer;
  uint64_t y = uint64_t{f} << (31 - integer);  // f / 2^integer in Q31, in [1, 2)
  uint32_t fraction = 0;
  for (int bit = 15; bit >= 0; --bit) {
    y = (y * y) >> 31;
    if (y >= (uint64_t{2} << 31)) {
      y >>= 1;
      fraction |= 1u << bit;
    }
  }
  return integer << 16 | fraction;
}

// log2_q16 of 0..kRansTotal + 1 (entry 0 unused).
struct Log2Table {
  std::array<uint32_t, kRansTotal + 2> q16{};
  constexpr Log2Table() {
    for (uint32_t f = 1; f < q16.size(); ++f) q16[f] = log2_q16(f);
  }
};
inline constexpr Log2Table kLog2Table{};

// log2_q16(f) for 1 <= f <= kRansTotal + 1: from the table on the host, computed on a GPU (whose
// code cannot read a host table); the same function either way.
CIERA_HD inline uint32_t log2_q16_of(uint32_t f) {
#if defined(__CUDA_ARCH__)
  return log2_q16(f);
#else
  return kLog2Table.q16[f];
#endif
}

// Bits (in Q16) that `count` occurrences of a symbol of frequency `freq` cost under the model.
CIERA_HD inline uint64_t rans_cost_q16(uint64_t count, uint32_t freq) {
  return count * ((uint64_t{kRansScaleBits} << 16) - log2_q16_of(freq));
}

// Normalises `count` (total `total` > 0) to frequencies summing to kRansTotal, every present
// symbol at least 1: round each count * kRansTotal / total to the nearest integer (halves up),
// then move one unit at a time where it costs the fewest coded bits (in Q16; ties go to the
// lowest symbol). Returns the first and last present symbols through `first` / `last`.
CIERA_HD inline void normalise_frequencies(const uint64_t* count, uint64_t total, uint16_t* freq,
                                           uint8_t* first, uint8_t* last) {
  int64_t sum = 0;
  bool any = false;
  for (unsigned s = 0; s < 256; ++s) {
    freq[s] = 0;
    if (count[s] == 0) continue;
    if (!any) *first = static_cast<uint8_t>(s);
    any = true;
    *last = static_cast<uint8_t>(s);
    const uint64_t rounded = (count[s] * (2 * uint64_t{kRansTotal}) + total) / (2 * total);
    freq[s] = static_cast<uint16_t>(rounded < 1 ? 1 : rounded);
    sum += freq[s];
  }
  while (sum != static_cast<int64_t>(kRansTotal)) {
    const bool grow = sum < static_cast<int64_t>(kRansTotal);
    int best = -1;
    int64_t best_delta = 0;
    for (unsigned s = *first; s <= *last; ++s) {
      const uint64_t c = count[s];
      if (c == 0) continue;
      const uint32_t f = freq[s];
      if (!grow && f <= 1) continue;
      // Change in coded bits (Q16): c * (log2 f_old - log2 f_new).
      const int64_t delta = grow ? -static_cast<int64_t>(c * (log2_q16_of(f + 1) - log2_q16_of(f)))
                                 : static_cast<int64_t>(c * (log2_q16_of(f) - log2_q16_of(f - 1)));
      if (best < 0 || delta < best_delta) {
        best = static_cast<int>(s);
        best_delta = delta;
      }
    }
    freq[best] = static_cast<uint16_t>(freq[best] + (grow ? 1 : -1));
    sum += grow ? 1 : -1;
  }
}

}  // namespace ciera::entropy
