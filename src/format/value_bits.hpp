// One value's split into exponent and sign-mantissa bits and its merge back (docs/format.md,
// "Exponent and sign-mantissa split"), as plain functions the CUDA kernels share with the host
// tests (CIERA_HD). The CPU codec's own SIMD kernels (format/kernels_impl.inc) compute the same
// bits; tests/test_value_bits.cpp holds the two to each other.
#pragma once

#include <cstdint>

#include "common/host_device.hpp"

namespace ciera::format::bits {

// BF16: exponent bits 14..7; sign-mantissa byte (sign << 7) | mantissa.
CIERA_HD inline uint8_t bf16_exponent(uint16_t x) { return static_cast<uint8_t>(x >> 7); }
CIERA_HD inline uint8_t bf16_sign_mantissa(uint16_t x) {
  return static_cast<uint8_t>(((x >> 8) & 0x80) | (x & 0x7F));
}
CIERA_HD inline uint16_t bf16_merge(uint8_t exponent, uint8_t sm) {
  return static_cast<uint16_t>(((sm & 0x80) << 8) | (uint16_t{exponent} << 7) | (sm & 0x7F));
}

// FP16: exponent bits 14..10; the low 8 mantissa bits; and 3 bits (sign << 2) | mantissa[9:8],
// packed LSB-first, 8 values to 3 bytes.
CIERA_HD inline uint8_t fp16_exponent(uint16_t x) { return static_cast<uint8_t>((x >> 10) & 0x1F); }
CIERA_HD inline uint8_t fp16_low8(uint16_t x) { return static_cast<uint8_t>(x); }
CIERA_HD inline uint8_t fp16_high3(uint16_t x) {
  return static_cast<uint8_t>(((x >> 13) & 0x4) | ((x >> 8) & 0x3));
}
CIERA_HD inline uint16_t fp16_merge(uint8_t exponent, uint8_t low8, uint8_t high3) {
  return static_cast<uint16_t>(((high3 & 0x4) << 13) | ((exponent & 0x1F) << 10) |
                               ((high3 & 0x3) << 8) | low8);
}
// The 3 bits of `count` (<= 8) values starting at a multiple of 8, as the 24 bits they occupy.
CIERA_HD inline uint32_t fp16_pack_high3(const uint8_t* high3, unsigned count) {
  uint32_t word = 0;
  for (unsigned i = 0; i < count; ++i) word |= uint32_t{high3[i]} << (3 * i);
  return word;
}
CIERA_HD inline uint8_t fp16_unpack_high3(uint32_t word, unsigned i) {
  return static_cast<uint8_t>((word >> (3 * i)) & 0x7);
}

// FP32: exponent bits 30..23; a byte (sign << 7) | mantissa[22:16]; mantissa[15:0].
CIERA_HD inline uint8_t fp32_exponent(uint32_t x) { return static_cast<uint8_t>(x >> 23); }
CIERA_HD inline uint8_t fp32_high(uint32_t x) {
  return static_cast<uint8_t>(((x >> 24) & 0x80) | ((x >> 16) & 0x7F));
}
CIERA_HD inline uint16_t fp32_low16(uint32_t x) { return static_cast<uint16_t>(x); }
CIERA_HD inline uint32_t fp32_merge(uint8_t exponent, uint8_t high, uint16_t low16) {
  return ((uint32_t{high} & 0x80) << 24) | (uint32_t{exponent} << 23) |
         ((uint32_t{high} & 0x7F) << 16) | low16;
}

}  // namespace ciera::format::bits
