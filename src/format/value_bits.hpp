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
// The bits of the packed 3-bit plane's last byte (of a plane of n values) that no value
// occupies, which the wire requires to be 0; 0 where the 3n bits fill whole bytes.
CIERA_HD inline uint8_t fp16_high3_padding_mask(uint64_t n) {
  const unsigned used = static_cast<unsigned>((3 * n) % 8);
  return used == 0 ? uint8_t{0} : static_cast<uint8_t>(0xFFu << used);
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

// The split and merge as the GPU's threads take them, one "group" per thread: a value for BF16
// and FP32, eight values for FP16, whose 3-bit plane packs eight values into three bytes (so no
// two groups share a byte). `dtype` is the wire code (1 BF16, 2 FP16, 3 FP32); `values` are the
// shard's n values, little-endian; `sm` is its whole sign-mantissa plane (docs/format.md).
CIERA_HD inline uint64_t group_count(uint8_t dtype, uint64_t n) { return dtype == 2 ? (n + 7) / 8 : n; }

CIERA_HD inline void split_group(uint8_t dtype, const uint8_t* values, uint64_t n, uint64_t g,
                                 uint8_t* exps, uint8_t* sm) {
  if (dtype == 2) {
    const uint64_t first = 8 * g;
    if (first >= n) return;
    const unsigned count = n - first < 8 ? static_cast<unsigned>(n - first) : 8u;
    uint8_t high3[8];
    for (unsigned k = 0; k < count; ++k) {
      const uint64_t i = first + k;
      const uint16_t x = static_cast<uint16_t>(values[2 * i] | values[2 * i + 1] << 8);
      exps[i] = fp16_exponent(x);
      sm[i] = fp16_low8(x);
      high3[k] = fp16_high3(x);
    }
    const uint32_t word = fp16_pack_high3(high3, count);
    for (unsigned k = 0; k < (3 * count + 7) / 8; ++k) sm[n + 3 * g + k] = static_cast<uint8_t>(word >> (8 * k));
    return;
  }
  if (g >= n) return;
  if (dtype == 1) {
    const uint16_t x = static_cast<uint16_t>(values[2 * g] | values[2 * g + 1] << 8);
    exps[g] = bf16_exponent(x);
    sm[g] = bf16_sign_mantissa(x);
  } else {
    const uint8_t* p = values + 4 * g;
    const uint32_t x = uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
    exps[g] = fp32_exponent(x);
    sm[g] = fp32_high(x);
    const uint16_t low = fp32_low16(x);
    sm[n + 2 * g] = static_cast<uint8_t>(low);
    sm[n + 2 * g + 1] = static_cast<uint8_t>(low >> 8);
  }
}

// The inverse: `exponent(i)` gives value i's exponent (from a plane, a cache or a decoded stream).
template <typename Exponent>
CIERA_HD inline void merge_group(uint8_t dtype, const Exponent& exponent, const uint8_t* sm, uint64_t n,
                                 uint64_t g, uint8_t* values) {
  if (dtype == 2) {
    const uint64_t first = 8 * g;
    if (first >= n) return;
    const unsigned count = n - first < 8 ? static_cast<unsigned>(n - first) : 8u;
    uint32_t word = 0;
    for (unsigned k = 0; k < (3 * count + 7) / 8; ++k) word |= uint32_t{sm[n + 3 * g + k]} << (8 * k);
    for (unsigned k = 0; k < count; ++k) {
      const uint64_t i = first + k;
      const uint16_t x = fp16_merge(exponent(i), sm[i], fp16_unpack_high3(word, k));
      values[2 * i] = static_cast<uint8_t>(x);
      values[2 * i + 1] = static_cast<uint8_t>(x >> 8);
    }
    return;
  }
  if (g >= n) return;
  if (dtype == 1) {
    const uint16_t x = bf16_merge(exponent(g), sm[g]);
    values[2 * g] = static_cast<uint8_t>(x);
    values[2 * g + 1] = static_cast<uint8_t>(x >> 8);
  } else {
    const uint16_t low = static_cast<uint16_t>(sm[n + 2 * g] | sm[n + 2 * g + 1] << 8);
    const uint32_t x = fp32_merge(exponent(g), sm[g], low);
    for (int k = 0; k < 4; ++k) values[4 * g + k] = static_cast<uint8_t>(x >> (8 * k));
  }
}

}  // namespace ciera::format::bits
