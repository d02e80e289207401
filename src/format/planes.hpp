// Splitting values into an exponent plane and a sign-mantissa plane, and merging them back
// (docs/format.md, "Exponent and sign-mantissa split"). Pure bit permutations: every bit pattern
// round-trips, NaN payloads and -0.0 included.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "ciera/dtype.hpp"
#include "format/changes.hpp"
#include "format/kernels.hpp"

namespace ciera::format {

// Byte layout of a shard's sign-mantissa plane.
struct SignMantissaLayout {
  SignMantissaLayout(DType dtype, uint64_t num_values);
  uint64_t total_bytes() const { return total_bytes_; }

  DType dtype;
  uint64_t num_values;
  uint64_t first_plane_bytes;   // BF16: sm; FP16: lo8; FP32: hi
  uint64_t second_plane_bytes;  // BF16: 0; FP16: packed hi3; FP32: lo16

 private:
  uint64_t total_bytes_;
};

// Largest `count` accepted by split_values / merge_values in one call.
inline constexpr size_t kMaxChunkValues = 16384;

// Splits values [first, first + count) of a shard. `values` points at value `first`; `exps`
// receives `count` exponents; the sign-mantissa bits go into their place in `sm_plane`, which
// covers the whole shard. Bytes of the FP16 packed plane that hold other values' bits keep them.
void split_values(const SignMantissaLayout& layout, const PlaneKernels& k, const uint8_t* values,
                  uint64_t first, size_t count, uint8_t* exps, uint8_t* sm_plane);
// Inverse of split_values: writes values [first, first + count) to `values` (pointing at `first`).
void merge_values(const SignMantissaLayout& layout, const PlaneKernels& k, const uint8_t* exps,
                  const uint8_t* sm_plane, uint64_t first, size_t count, uint8_t* values);
// The exponents of `count` values.
void extract_exponents(DType dtype, const PlaneKernels& k, const uint8_t* values, size_t count,
                       uint8_t* exps);

// Exponent field of the value at `value` / replacing it in place (inline: the decoder patches
// one value per changed exponent).
inline uint8_t exponent_of(DType dtype, const uint8_t* value) {
  switch (dtype) {
    case DType::kBF16: {
      uint16_t x;
      std::memcpy(&x, value, 2);
      return static_cast<uint8_t>(x >> 7);
    }
    case DType::kFP16: {
      uint16_t x;
      std::memcpy(&x, value, 2);
      return static_cast<uint8_t>((x >> 10) & 0x1F);
    }
    case DType::kFP32: {
      uint32_t x;
      std::memcpy(&x, value, 4);
      return static_cast<uint8_t>(x >> 23);
    }
  }
  return 0;
}

inline void set_exponent(DType dtype, uint8_t* value, uint8_t exponent) {
  switch (dtype) {
    case DType::kBF16: {
      uint16_t x;
      std::memcpy(&x, value, 2);
      x = static_cast<uint16_t>((x & 0x807F) | (uint16_t{exponent} << 7));
      std::memcpy(value, &x, 2);
      return;
    }
    case DType::kFP16: {
      uint16_t x;
      std::memcpy(&x, value, 2);
      x = static_cast<uint16_t>((x & 0x83FF) | (uint16_t{static_cast<uint8_t>(exponent & 0x1F)} << 10));
      std::memcpy(value, &x, 2);
      return;
    }
    case DType::kFP32: {
      uint32_t x;
      std::memcpy(&x, value, 4);
      x = (x & 0x807FFFFFu) | (uint32_t{exponent} << 23);
      std::memcpy(value, &x, 4);
      return;
    }
  }
}


// The literal, one-value-at-a-time reading of docs/format.md; tests hold the kernels to it.
namespace reference {
void split(DType dtype, const uint8_t* values, uint64_t n, uint8_t* exps, uint8_t* sm_plane);
void merge(DType dtype, const uint8_t* exps, const uint8_t* sm_plane, uint64_t n,
           uint8_t* values);
}  // namespace reference

}  // namespace ciera::format
