// A bound on the engine's wire bytes that an engine sending raw cannot meet, for the round-trip
// tests (tests/test_engine.cpp, tests/mpi/test_mpi_engine.cpp).
#pragma once

#include <cstdint>

#include "ciera/engine.hpp"

namespace ciera::testing {

// The most the wire may carry for a steady-state (delta-frame) gather of `l` when exponents
// rarely change (Pattern::kSparse: one value in 300 per step, each by +-1), from docs/format.md.
// Per rank: the envelope header (24 + 8 bytes per parameter); a raw parameter's bytes; per CIERA
// parameter the 80-byte payload header, the bitmap, the padding (only before planes of 64 KiB or
// more), the sign-mantissa plane (BF16 1 byte per value, FP16 11 bits, FP32 24 bits) and an
// exponent section of at most 4 stream headers and the extra-bit length (48 bytes) plus one bit
// per value. A fine-coded change costs at most 24 bits (a 6-bit change symbol, 7 gap bits, and a
// count symbol with its extra bits for its block), so one bit per value holds up to one change
// in 24 values, eight times the rate of this data; a single-value shard codes in 10 bytes.
// An engine that sends raw bytes puts at least the raw bytes on the wire, so callers also check
// that this bound is below them.
inline uint64_t sparse_delta_wire_bound(const BucketLayout& l, uint32_t block_values) {
  uint64_t bytes = 0;
  for (int r = 0; r < l.ranks(); ++r) {
    bytes += 24 + 8 * l.params();
    for (size_t k = 0; k < l.params(); ++k) {
      const uint64_t n = l.shard_values[r][k];
      if (l.policy[k] == ShardPolicy::kRaw) {
        bytes += n * dtype_info(l.dtype).value_bytes;
        continue;
      }
      const uint64_t sign_mantissa = l.dtype == DType::kBF16   ? n
                                     : l.dtype == DType::kFP16 ? n + (3 * n + 7) / 8
                                                               : 3 * n;
      const uint64_t bitmap = ((n + block_values - 1) / block_values + 7) / 8;
      const uint64_t padding = sign_mantissa >= 65536 ? 63 : 0;
      bytes += 80 + bitmap + padding + sign_mantissa + 48 + (n + 7) / 8;
    }
  }
  return bytes;
}

}  // namespace ciera::testing
