// Value-delta trajectories (docs/format.md, "Value-delta frames") for the device codec's tests:
// the host emulation's (tests/test_device_encoder.cpp, test_device_decoder.cpp) and the GPU's
// (tests/cuda/). No CUDA here: the host tests include it too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "ciera/dtype.hpp"
#include "codec/differences.hpp"
#include "test_util.hpp"

namespace ciera::testing {

// What one step does to the values.
enum class DeltaStep {
  kNothing,    // no value changes ('unchanged' sections)
  kUlp,        // +-1 unit in the last place on ~3% of the values
  kSmall,      // +-200 units on a third of the values (escapes with extra bits)
  kSignFlip,   // across zero: +-0, the smallest subnormals, flipped signs
  kSpecial,    // NaN payloads, +-Inf, subnormals, +-0, extremes on a fifth of the values
  kJump,       // huge jumps (random bit patterns) on 5% of the values
  kRandomAll,  // every value random: the differences do not fit, a key frame goes instead
  kAllUp,      // every value up by one unit (a constant groups stream when 3 divides N)
  kOneJump,    // one value jumps far (a single escape: a constant escapes stream)
};

inline std::string delta_step_name(DeltaStep s) {
  switch (s) {
    case DeltaStep::kNothing: return "nothing";
    case DeltaStep::kUlp: return "ulp";
    case DeltaStep::kSmall: return "small";
    case DeltaStep::kSignFlip: return "sign-flip";
    case DeltaStep::kSpecial: return "special";
    case DeltaStep::kJump: return "jump";
    case DeltaStep::kRandomAll: return "random-all";
    case DeltaStep::kAllUp: return "all-up";
    case DeltaStep::kOneJump: return "one-jump";
  }
  return "?";
}

// Every kind, random values in the middle and small steps again after them.
inline std::vector<DeltaStep> delta_schedule() {
  return {DeltaStep::kNothing, DeltaStep::kUlp,       DeltaStep::kUlp,     DeltaStep::kSmall,
          DeltaStep::kSignFlip, DeltaStep::kSpecial,  DeltaStep::kJump,    DeltaStep::kAllUp,
          DeltaStep::kOneJump, DeltaStep::kRandomAll, DeltaStep::kUlp,     DeltaStep::kNothing,
          DeltaStep::kRandomAll, DeltaStep::kRandomAll, DeltaStep::kSmall, DeltaStep::kSpecial,
          DeltaStep::kUlp};
}

class DeltaTrajectory {
 public:
  DeltaTrajectory(DType dtype, size_t n, uint64_t seed)
      : dtype_(dtype), n_(n), rng_(seed), values_(n * dtype_info(dtype).value_bytes) {
    for (size_t i = 0; i < n; ++i) put_value(dtype_, values_, i, weight_bits(dtype_, rng_));
  }

  const std::vector<std::byte>& values() const { return values_; }
  std::span<const std::byte> span() const { return values_; }
  std::span<const uint8_t> bytes() const {
    return {reinterpret_cast<const uint8_t*>(values_.data()), values_.size()};
  }

  void step(DeltaStep s) {
    const unsigned w = 8 * dtype_info(dtype_).value_bytes;
    const uint32_t all = w == 32 ? 0xFFFFFFFFu : (1u << w) - 1;
    const uint32_t sign = 1u << (w - 1);
    const auto specials = special_bits(dtype_);
    for (size_t i = 0; i < n_; ++i) {
      uint32_t x = get_value(dtype_, values_, i);
      const uint64_t r = rng_();
      switch (s) {
        case DeltaStep::kNothing: break;
        case DeltaStep::kUlp:
          if (r % 100 < 3) x = ord_add(x, (r >> 8) & 1 ? 1 : -1, w);
          break;
        case DeltaStep::kSmall:
          if (r % 3 == 0) x = ord_add(x, static_cast<int64_t>((r >> 8) % 401) - 200, w);
          break;
        case DeltaStep::kSignFlip:
          if (r % 10 == 0) x = static_cast<uint32_t>((r >> 8) % 3);  // +0 and the smallest subnormals
          if (r % 5 == 1) x ^= sign;
          break;
        case DeltaStep::kSpecial:
          if (r % 5 == 0) x = specials[(r >> 8) % specials.size()];
          break;
        case DeltaStep::kJump:
          if (r % 20 == 0) x = static_cast<uint32_t>(r >> 16) & all;
          break;
        case DeltaStep::kRandomAll: x = static_cast<uint32_t>(r >> 8) & all; break;
        case DeltaStep::kAllUp: x = ord_add(x, 1, w); break;
        case DeltaStep::kOneJump:
          if (i == n_ / 2) x = ord_add(x, int64_t{1} << (w - 2), w);
          break;
      }
      put_value(dtype_, values_, i, x);
    }
  }

 private:
  static uint32_t ord_add(uint32_t x, int64_t d, unsigned w) {
    if (w == 16) {
      const auto o = codec::to_ordered<uint16_t>(static_cast<uint16_t>(x));
      return codec::from_ordered<uint16_t>(static_cast<uint16_t>(o + static_cast<uint16_t>(d)));
    }
    const uint32_t o = codec::to_ordered<uint32_t>(x);
    return codec::from_ordered<uint32_t>(o + static_cast<uint32_t>(d));
  }

  DType dtype_;
  size_t n_;
  std::mt19937_64 rng_;
  std::vector<std::byte> values_;
};

}  // namespace ciera::testing
