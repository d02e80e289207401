// `ciera bench codec --device cuda` (bench_codec.cpp parses it): the GPU codec on the benchmark
// trajectory beside cudaMemcpy D2D and nvCOMP's ANS (bench/cuda/device_codec_bench.hpp).
#pragma once

#include <cstdint>

#include "ciera/config.hpp"

namespace ciera::tools {

struct DeviceBenchOptions {
  CodecConfig config;
  uint64_t values = 0;
  uint32_t steps = 0;
  double learning_rate = 1e-4;
  uint64_t seed = 1;
  uint32_t sample_every = 10;
  bool json = false;
  bool quiet = false;
};

// Returns the exit code: 0 when every step verified. Throws ciera::Error without a usable device.
int run_bench_codec_cuda(const DeviceBenchOptions& options);

}  // namespace ciera::tools
