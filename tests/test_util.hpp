// Shared helpers for the codec tests: value generators for the change patterns of house rule 8.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "ciera/dtype.hpp"
#include "common/floats.hpp"
#include "common/simd_targets.hpp"

namespace ciera::testing {

// Whether this build runs under AddressSanitizer or ThreadSanitizer (GCC defines the macros,
// clang answers __has_feature). Tests may then take smaller large sizes: the sanitizer builds
// look for memory and thread errors, which need the code paths, not the volume; the release
// build runs the full sizes.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define CIERA_TESTS_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define CIERA_TESTS_SANITIZED 1
#endif
#endif
#ifdef CIERA_TESTS_SANITIZED
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif

// `n` bytes from a seeded generator (never zeros: they hide unwritten outputs).
inline std::vector<uint8_t> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// One layer's kernel tables for every SIMD target this CPU runs (kernels_for: the layer's
// format::kernels_for, entropy::entropy_kernels_for or codec::codec_kernels_for): tests run every
// kernel of every target, as Highway's do.
template <class Kernels>
std::vector<const Kernels*> kernels_of_every_target(const Kernels& (*kernels_for)(common::SimdTarget)) {
  std::vector<const Kernels*> tables;
  for (const common::SimdTarget target : common::available_simd_targets()) {
    tables.push_back(&kernels_for(target));
  }
  return tables;
}

enum class Pattern { kNone, kAll, kRandom, kSparse, kSpecial };

inline std::string pattern_name(Pattern p) {
  switch (p) {
    case Pattern::kNone: return "none";
    case Pattern::kAll: return "all";
    case Pattern::kRandom: return "random";
    case Pattern::kSparse: return "sparse";
    case Pattern::kSpecial: return "special";
  }
  return "?";
}

inline uint32_t random_bits(DType dtype, std::mt19937_64& rng) {
  const uint64_t r = rng();
  return dtype == DType::kFP32 ? static_cast<uint32_t>(r) : static_cast<uint32_t>(r & 0xFFFF);
}

// A weight-like value: N(0, 0.02) rounded into the dtype (truncation is fine for tests).
inline uint32_t weight_bits(DType dtype, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 0.02f);
  const float f = normal(rng);
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (dtype == DType::kFP32) return bits;
  if (dtype == DType::kBF16) return bits >> 16;
  // FP16 by bit surgery of a value in [-1, 1]: keep sign, rebias exponent, truncate mantissa.
  const uint32_t sign = (bits >> 31) << 15;
  const int exponent = static_cast<int>((bits >> 23) & 0xFF) - 127 + 15;
  if (exponent <= 0) return sign;  // flush tiny values to zero
  return sign | (static_cast<uint32_t>(exponent) << 10) | ((bits >> 13) & 0x3FF);
}

// NaN payloads, signed infinities, subnormals, signed zeros, extremes.
inline std::vector<uint32_t> special_bits(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return {0x7FC0, 0x7F81, 0xFFFF, 0x7F80, 0xFF80, 0x0001, 0x807F, 0x0000, 0x8000, 0x7F7F, 0x0080};
    case DType::kFP16:
      return {0x7E00, 0x7C01, 0xFFFF, 0x7C00, 0xFC00, 0x0001, 0x83FF, 0x0000, 0x8000, 0x7BFF, 0x0400};
    case DType::kFP32:
      return {0x7FC00000u, 0x7F800001u, 0xFFFFFFFFu, 0x7F800000u, 0xFF800000u, 0x00000001u,
              0x807FFFFFu, 0x00000000u, 0x80000000u, 0x7F7FFFFFu, 0x00800000u};
  }
  return {};
}

inline void put_value(DType dtype, std::vector<std::byte>& buf, size_t i, uint32_t bits) {
  const size_t vb = dtype_info(dtype).value_bytes;
  std::memcpy(buf.data() + i * vb, &bits, vb);
}
inline uint32_t get_value(DType dtype, const std::vector<std::byte>& buf, size_t i) {
  uint32_t bits = 0;
  std::memcpy(&bits, buf.data() + i * dtype_info(dtype).value_bytes, dtype_info(dtype).value_bytes);
  return bits;
}

// Value i of `buf` as a number (for tolerance checks of the lossy peer schemes).
inline double to_double(DType dtype, const std::vector<std::byte>& buf, size_t i) {
  const uint32_t bits = get_value(dtype, buf, i);
  if (dtype == DType::kFP32) return std::bit_cast<float>(bits);
  if (dtype == DType::kBF16) return bf16_to_float(static_cast<uint16_t>(bits));
  return fp16_to_float(static_cast<uint16_t>(bits));
}

// Moves a value's exponent by +-1 (a crossing of a power of two), keeping the exponent in range.
inline uint32_t nudge_exponent(DType dtype, uint32_t bits, bool up) {
  const DTypeInfo info = dtype_info(dtype);
  const unsigned shift = info.sign_mantissa_bits - 1;
  const uint32_t mask = (1u << info.exponent_bits) - 1;
  uint32_t e = (bits >> shift) & mask;
  if (up && e < mask - 1) ++e;
  else if (!up && e > 1) --e;
  else e = up ? e - 1 : e + 1;
  return (bits & ~(mask << shift)) | (e << shift);
}

// A multi-step trajectory: step 0 initialises, later steps apply the pattern.
class Trajectory {
 public:
  Trajectory(DType dtype, size_t n, Pattern pattern, uint64_t seed)
      : dtype_(dtype), n_(n), pattern_(pattern), rng_(seed),
        values_(n * dtype_info(dtype).value_bytes) {
    const auto specials = special_bits(dtype);
    for (size_t i = 0; i < n; ++i) {
      uint32_t v = weight_bits(dtype, rng_);
      if (pattern == Pattern::kSpecial && rng_() % 3 == 0) v = specials[rng_() % specials.size()];
      if (pattern == Pattern::kAll || pattern == Pattern::kRandom) v = random_bits(dtype, rng_);
      put_value(dtype, values_, i, v);
    }
  }

  const std::vector<std::byte>& values() const { return values_; }
  std::span<const std::byte> span() const { return values_; }

  void step() {
    const auto specials = special_bits(dtype_);
    for (size_t i = 0; i < n_; ++i) {
      uint32_t v = get_value(dtype_, values_, i);
      switch (pattern_) {
        case Pattern::kNone:
          break;
        case Pattern::kAll:
          v = nudge_exponent(dtype_, v, rng_() & 1);
          break;
        case Pattern::kRandom:
          if (rng_() % 10 == 0) v = random_bits(dtype_, rng_);
          break;
        case Pattern::kSparse: {
          const uint64_t r = rng_();
          if (r % 300 == 0) v = nudge_exponent(dtype_, v, (r >> 20) & 1);
          else if (r % 3 == 1) v ^= 1;  // mantissa-only change
          break;
        }
        case Pattern::kSpecial:
          if (rng_() % 7 == 0) v = specials[rng_() % specials.size()];
          break;
      }
      put_value(dtype_, values_, i, v);
    }
  }

 private:
  DType dtype_;
  size_t n_;
  Pattern pattern_;
  std::mt19937_64 rng_;
  std::vector<std::byte> values_;
};

}  // namespace ciera::testing
