// A realistic weight trajectory for benchmarks: FP32 master weights ~ N(0, 0.02), updated each
// step by Adam (lr 1e-4 by default) on synthetic gradients, cast to the wire dtype each step the
// way mixed-precision training casts parameters for the allgather.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "ciera/dtype.hpp"

namespace ciera::tools {

struct TrajectoryOptions {
  uint64_t num_values = 0;
  // Index of the first value in a larger trajectory: ranks that each simulate their own shard
  // with the same seed together simulate exactly the trajectory of the whole tensor.
  uint64_t first_index = 0;
  DType dtype = DType::kBF16;
  double learning_rate = 1e-4;
  double init_std = 0.02;
  uint64_t seed = 1;
  // Gradient = persistent direction * drift + fresh noise, per element: Adam sees a consistent
  // signal plus minibatch noise, as in real training.
  double gradient_drift = 0.2;
};

class AdamTrajectory {
 public:
  explicit AdamTrajectory(const TrajectoryOptions& options);

  // One optimizer step; then values() holds the new weights cast to the dtype.
  void step();
  uint64_t steps_taken() const { return step_; }
  // The weights in the wire dtype, little-endian.
  std::span<const std::byte> values() const { return cast_; }
  // A sub-range of values (for sharding), [first, first + count).
  std::span<const std::byte> values(uint64_t first, uint64_t count) const;

 private:
  void cast();

  TrajectoryOptions options_;
  uint64_t step_ = 0;
  std::vector<float> weights_;
  std::vector<float> direction_;
  std::vector<float> m_;
  std::vector<float> v_;
  std::vector<std::byte> cast_;
};

// IEEE round-to-nearest-even conversions (exact bit results, no hardware dependence).
uint16_t float_to_bf16(float f);
uint16_t float_to_fp16(float f);

}  // namespace ciera::tools
