// Floating-point formats that CIERA carries bit for bit.
#pragma once

#include <cstdint>
#include <string_view>

namespace ciera {

// The numeric values are the dtype codes of the wire format (docs/format.md, "Header").
enum class DType : uint8_t { kBF16 = 1, kFP16 = 2, kFP32 = 3 };

struct DTypeInfo {
  uint32_t value_bytes;        // bytes per value in memory (little-endian)
  uint32_t exponent_bits;      // width of the biased exponent field
  uint32_t sign_mantissa_bits; // 1 sign bit + the mantissa bits
};

DTypeInfo dtype_info(DType dtype);
std::string_view dtype_name(DType dtype);
// Accepts "bf16", "fp16", "fp32" (and "bfloat16", "float16", "half", "float32", "float");
// throws ConfigError otherwise.
DType parse_dtype(std::string_view name);
// True when `code` is the wire code of a known dtype.
bool is_valid_dtype_code(uint8_t code);

}  // namespace ciera
