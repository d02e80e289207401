#include "trajectory.hpp"

#include <bit>
#include <cmath>
#include <cstring>

#include "common/floats.hpp"

namespace ciera::tools {
namespace {

// murmur3's 32-bit finaliser as a counter-based generator: vectorisable and reproducible.
inline uint32_t mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

// Approximately N(0, 1): the sum of four 16-bit uniforms (Irwin-Hall), rescaled.
inline float normal_from(uint32_t a, uint32_t b) {
  const float sum = static_cast<float>(a & 0xFFFF) + static_cast<float>(a >> 16) +
                    static_cast<float>(b & 0xFFFF) + static_cast<float>(b >> 16);
  constexpr float kMean = 2.0f * 65535.0f;
  constexpr float kInvStd = 1.0f / 37837.23f;  // sqrt(4 / 12) * 65536
  return (sum - kMean) * kInvStd;
}

inline float normal_at(uint64_t seed, uint64_t stream, uint64_t i) {
  const uint32_t key = mix32(static_cast<uint32_t>(seed * 0x9E3779B97F4A7C15ull >> 32) ^
                             static_cast<uint32_t>(stream * 0x632BE5ABu));
  const uint32_t x = static_cast<uint32_t>(i);
  return normal_from(mix32(x * 2u + key), mix32(x * 2u + 1u + key));
}

}  // namespace

uint16_t float_to_bf16(float f) { return ciera::float_to_bf16(f); }

uint16_t float_to_fp16(float f) { return ciera::float_to_fp16(f); }

AdamTrajectory::AdamTrajectory(const TrajectoryOptions& options)
    : options_(options),
      weights_(options.num_values),
      direction_(options.num_values),
      m_(options.num_values, 0.0f),
      v_(options.num_values, 0.0f),
      cast_(options.num_values * dtype_info(options.dtype).value_bytes) {
  const float std = static_cast<float>(options.init_std);
  for (uint64_t i = 0; i < options.num_values; ++i) {
    weights_[i] = std * normal_at(options.seed, 0, options.first_index + i);
    direction_[i] = normal_at(options.seed, 1, options.first_index + i);
  }
  cast();
}

void AdamTrajectory::step() {
  ++step_;
  constexpr float kBeta1 = 0.9f, kBeta2 = 0.999f, kEps = 1e-8f, kGradScale = 1e-3f;
  const float lr = static_cast<float>(options_.learning_rate);
  const float bias1 = 1.0f - std::pow(kBeta1, static_cast<float>(step_));
  const float bias2 = 1.0f - std::pow(kBeta2, static_cast<float>(step_));
  const float step_size = lr / bias1;
  const float inv_sqrt_bias2 = 1.0f / std::sqrt(bias2);
  const float drift = static_cast<float>(options_.gradient_drift);
  float* w = weights_.data();
  float* m = m_.data();
  float* v = v_.data();
  const float* d = direction_.data();
  const uint64_t n = options_.num_values;
  const uint64_t stream = 2 + step_;
  for (uint64_t i = 0; i < n; ++i) {
    const float g = kGradScale * (drift * d[i] + normal_at(options_.seed, stream, options_.first_index + i));
    m[i] = kBeta1 * m[i] + (1.0f - kBeta1) * g;
    v[i] = kBeta2 * v[i] + (1.0f - kBeta2) * g * g;
    w[i] -= step_size * m[i] / (std::sqrt(v[i]) * inv_sqrt_bias2 + kEps);
  }
  cast();
}

void AdamTrajectory::cast() {
  const uint64_t n = options_.num_values;
  switch (options_.dtype) {
    case DType::kBF16:
      for (uint64_t i = 0; i < n; ++i) {
        const uint16_t h = float_to_bf16(weights_[i]);
        std::memcpy(cast_.data() + 2 * i, &h, 2);
      }
      break;
    case DType::kFP16:
      for (uint64_t i = 0; i < n; ++i) {
        const uint16_t h = float_to_fp16(weights_[i]);
        std::memcpy(cast_.data() + 2 * i, &h, 2);
      }
      break;
    case DType::kFP32:
      std::memcpy(cast_.data(), weights_.data(), 4 * n);
      break;
  }
}

std::span<const std::byte> AdamTrajectory::values(uint64_t first, uint64_t count) const {
  const uint32_t vb = dtype_info(options_.dtype).value_bytes;
  return std::span<const std::byte>(cast_).subspan(first * vb, count * vb);
}

}  // namespace ciera::tools
