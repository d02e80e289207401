// Keeping `bits` (1..128) of a 128-bit block hash: the reliability suite's hook to force hash
// collisions (CodecConfig::hash_bits), the same on the CPU (common/checksum.hpp) and the GPU
// (codec/device_encode.hpp).
#pragma once

#include <cstdint>

#include "common/host_device.hpp"

namespace ciera {

CIERA_HD inline void keep_hash_bits(uint64_t& low, uint64_t& high, unsigned bits) {
  if (bits >= 128) return;
  if (bits <= 64) {
    high = 0;
    low &= bits == 64 ? ~uint64_t{0} : (uint64_t{1} << bits) - 1;
  } else {
    high &= (uint64_t{1} << (bits - 64)) - 1;
  }
}

}  // namespace ciera
