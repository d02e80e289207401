// The GPU codec measured on the benchmark trajectory (tools/trajectory.hpp: Adam on synthetic
// gradients, cast to the wire dtype each step), shared by `ciera bench codec --device cuda` and
// the device check's ciera_cuda_bench: every steady-state step is encoded and decoded on the GPU
// (CUDA events on one stream), checked against the CPU codec (the same payload bytes, the same
// shard back), and timed beside cudaMemcpy device-to-device of the same bytes; nvCOMP's ANS
// (when built in: CIERA_NVCOMP_DIR) codes the same shards, statelessly, as the paper's peer.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "ciera/config.hpp"
#include "common/statistics.hpp"

namespace ciera::bench {

// One device allocation (cudaMalloc), freed with its owner; throws ciera::Error if it fails.
struct DeviceBuffer {
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(p); }
  void* p = nullptr;
  size_t size;
};

struct DeviceCodecRequest {
  CodecConfig config;  // warmup_steps key frames first
  uint64_t values = 16ull << 20;
  uint32_t steps = 40;  // warmup included
  double learning_rate = 1e-4;
  uint64_t seed = 1;
  uint32_t nvcomp_every = 5;  // nvCOMP on every k-th steady step
  std::function<void(uint32_t step, uint32_t steps)> progress;  // may be empty
};

// One coder's steady-state timings (seconds per step) and sizes.
struct DeviceCoder {
  std::string name;
  std::vector<double> encode_s, decode_s;
  double wire_bytes = 0;  // summed over frames
  uint64_t frames = 0;
  double bits_per_value(uint64_t values) const { return frames ? 8 * wire_bytes / frames / values : 0; }
};

struct DeviceCodecResult {
  std::string gpu;
  uint64_t values = 0;
  uint64_t shard_bytes = 0;
  std::vector<double> memcpy_s;
  DeviceCoder ciera;           // the device ShardEncoder / ShardDecoder
  DeviceCoder key_frames;      // the warmup key frames (sizes; times of the steady state only)
  std::vector<DeviceCoder> peers;  // nvCOMP ANS on the exponent plane and on the whole shard
  bool nvcomp_built = false;
  bool verified = true;        // every payload equal to the CPU's, every shard back bit for bit
  std::string failure;         // what was not verified, if anything
};

// Throws ciera::Error when no device can run it (device_available's reason).
DeviceCodecResult measure_device_codec(const DeviceCodecRequest& request);

using ciera::median;  // common/statistics.hpp: the mean of the middle two for an even count

}  // namespace ciera::bench
