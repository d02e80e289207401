// The fine alphabet (docs/format.md, "Exponent section", fine): how fine coding turns a changed
// block's changes into rANS symbols and extra bits. Part of the wire format, owned by the codec;
// the step classes it codes are the format layer's (format/changes.hpp).
#pragma once

#include <cstdint>

#include "common/host_device.hpp"
#include "format/changes.hpp"

namespace ciera::wire {

// Fine coding's variable-length integers (docs/format.md, "Exponent section", fine):
// bucket(v) = bit width of v; buckets >= 2 carry bucket - 1 extra bits.
inline constexpr unsigned kMaxBucket = 12;  // values < 4096 = kMaxBlockValues
// Branch-free forms: these run once per changed value, and their inputs are unpredictable.
inline unsigned bucket_of(uint32_t v) {  // == std::bit_width(v) for v < 2^31
  return 63u - static_cast<unsigned>(__builtin_clzll(2 * uint64_t{v} + 1));
}
CIERA_HD inline unsigned bucket_extra_bits(unsigned bucket) { return bucket - (bucket != 0); }
CIERA_HD inline uint32_t bucket_base(unsigned bucket) { return (1u << bucket) >> 1; }

// Fine coding's change symbols: 3 * bucket(gap) + step class (format::StepClass: +1, -1 or
// escaped).
inline constexpr unsigned kStepClasses = 3;
inline constexpr unsigned kMaxChangeSymbol = kStepClasses * kMaxBucket + format::kStepEscape;  // 38

}  // namespace ciera::wire
