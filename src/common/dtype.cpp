#include "ciera/dtype.hpp"

#include <string>

#include "ciera/error.hpp"

namespace ciera {

DTypeInfo dtype_info(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return {2, 8, 8};
    case DType::kFP16: return {2, 5, 11};
    case DType::kFP32: return {4, 8, 24};
  }
  throw ConfigError("unknown dtype code " + std::to_string(static_cast<int>(dtype)));
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return "bf16";
    case DType::kFP16: return "fp16";
    case DType::kFP32: return "fp32";
  }
  return "unknown";
}

DType parse_dtype(std::string_view name) {
  if (name == "bf16" || name == "bfloat16") return DType::kBF16;
  if (name == "fp16" || name == "float16" || name == "half") return DType::kFP16;
  if (name == "fp32" || name == "float32" || name == "float") return DType::kFP32;
  throw ConfigError("unknown dtype '" + std::string(name) + "' (expected bf16, fp16 or fp32)");
}

bool is_valid_dtype_code(uint8_t code) { return code >= 1 && code <= 3; }

}  // namespace ciera
