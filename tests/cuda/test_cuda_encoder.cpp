// The device ShardEncoder against the CPU encoder, on a device: for every dtype, block sizes
// 64/512/4096, sizes 0, 1, odd and 16M and every coding mode, each payload is the CPU encoder's
// byte for byte, and it decodes on the CPU decoder and on the device decoder (GPU -> CPU and
// GPU -> GPU interop; CPU -> GPU is test_cuda_decoder.cpp); the same for value-delta streams.
// Skipped without a usable device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/cuda.hpp"
#include "cuda/cuda_test_util.hpp"
#include "ciera/error.hpp"
#include "cuda/value_delta_trajectory.hpp"
#include "test_util.hpp"

namespace ciera::cuda {
namespace {

using ciera::testing::DeltaStep;
using ciera::testing::DeltaTrajectory;
using ciera::testing::Pattern;
using ciera::testing::Trajectory;

// Device bytes.
using Device = testing::DeviceVector<std::byte>;

void run(DType dtype, uint32_t block, size_t n, ExponentCoding coding, int steps,
         ChangeDetection detection = ChangeDetection::kExact) {
  SCOPED_TRACE(std::string(dtype_name(dtype)) + " B " + std::to_string(block) + " n " +
               std::to_string(n) + " " + std::string(exponent_coding_name(coding)));
  CodecConfig config;
  config.dtype = dtype;
  config.block_values = block;
  config.coding = coding;
  config.detection = detection;
  config.warmup_steps = 2;
  ciera::ShardEncoder cpu(config, n, {9, 3});
  ShardEncoder gpu(config, n, {9, 3});
  ciera::ShardDecoder cpu_decoder(config, n, {9, 3});
  ShardDecoder gpu_decoder(config, n, {9, 3});
  Trajectory trajectory(dtype, n, Pattern::kSparse, n + block);
  const size_t bytes = n * dtype_info(dtype).value_bytes;
  std::vector<std::byte> expected(cpu.max_payload_bytes()), decoded(bytes);
  ASSERT_EQ(gpu.max_payload_bytes(), cpu.max_payload_bytes());
  Device d_shard(bytes), d_payload(gpu.max_payload_bytes()), d_length(8), d_out(bytes);
  for (int step = 0; step < steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (step > 0) trajectory.step();
    if (step == steps - 2) {
      cpu.request_key_frame();
      gpu.request_key_frame();
      cpu_decoder.request_resync();
      gpu_decoder.request_resync(nullptr);
    }
    const size_t size = cpu.encode(trajectory.span(), expected).payload_bytes;
    d_shard.put(trajectory.values().data(), bytes);
    gpu.encode(d_shard.get(), d_payload.get(), reinterpret_cast<uint64_t*>(d_length.get()), nullptr);
    ASSERT_EQ(gpu.payload_bytes(), size);
    const auto payload = d_payload.host(size);
    ASSERT_TRUE(std::equal(payload.begin(), payload.end(), expected.begin())) << "payloads differ";
    cpu_decoder.decode(payload, decoded);
    ASSERT_EQ(decoded, trajectory.values());
    gpu_decoder.decode(d_payload.get(), size, d_out.get(), nullptr);
    ASSERT_NO_THROW(gpu_decoder.check());
    ASSERT_EQ(d_out.host(bytes), trajectory.values());
  }
}

TEST(CudaEncoder, WritesTheCpuPayloadsForEveryDtypeBlockSizeAndCoding) {
  SKIP_WITHOUT_DEVICE();
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (const uint32_t block : {64u, 512u, 4096u}) {
      for (const size_t n : {size_t{0}, size_t{1}, size_t{12345}}) {
        for (const ExponentCoding coding : {ExponentCoding::kAuto, ExponentCoding::kBlock, ExponentCoding::kFine}) {
          run(dtype, block, n, coding, 7);
        }
      }
    }
  }
}

TEST(CudaEncoder, A16MValueShard) {
  SKIP_WITHOUT_DEVICE();
  run(DType::kBF16, 512, size_t{1} << 24, ExponentCoding::kAuto, 5);
}

TEST(CudaEncoder, HashDetectionWritesTheCpuPayloads) {
  SKIP_WITHOUT_DEVICE();
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    run(dtype, 512, 12345, ExponentCoding::kAuto, 6, ChangeDetection::kHash);
  }
}

// Value-delta streams (docs/format.md, "Value-delta frames"): every payload the CPU encoder's,
// decoded by the CPU decoder and the device decoder (whose cache is then the values), key frames
// where the differences do not fit and a resynchronisation included.
void run_delta(DType dtype, size_t n, const std::vector<DeltaStep>& steps) {
  SCOPED_TRACE(std::string(dtype_name(dtype)) + " value-delta n " + std::to_string(n));
  CodecConfig config;
  config.dtype = dtype;
  config.stream_kind = StreamKind::kValueDelta;
  ciera::ShardEncoder cpu(config, n, {9, 3});
  ShardEncoder gpu(config, n, {9, 3});
  ciera::ShardDecoder cpu_decoder(config, n, {9, 3});
  ShardDecoder gpu_decoder(config, n, {9, 3});
  const size_t bytes = n * dtype_info(dtype).value_bytes;
  ASSERT_EQ(gpu_decoder.cache_bytes(), bytes);
  DeltaTrajectory trajectory(dtype, n, n + 17);
  std::vector<std::byte> expected(cpu.max_payload_bytes()), decoded(bytes);
  Device d_shard(bytes), d_payload(gpu.max_payload_bytes()), d_length(8), d_out(bytes);
  for (size_t step = 0; step <= steps.size(); ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (step > 0) trajectory.step(steps[step - 1]);
    if (step + 2 == steps.size()) {
      cpu.request_key_frame();
      gpu.request_key_frame();
      cpu_decoder.request_resync();
      gpu_decoder.request_resync(nullptr);
    }
    const FrameStats stats = cpu.encode(trajectory.span(), expected);
    d_shard.put(trajectory.values().data(), bytes);
    gpu.encode(d_shard.get(), d_payload.get(), reinterpret_cast<uint64_t*>(d_length.get()), nullptr);
    ASSERT_EQ(gpu.payload_bytes(), stats.payload_bytes) << frame_kind_name(stats.kind) << " frame";
    const auto payload = d_payload.host(stats.payload_bytes);
    ASSERT_TRUE(std::equal(payload.begin(), payload.end(), expected.begin()))
        << "payloads differ (" << frame_kind_name(stats.kind) << " frame)";
    cpu_decoder.decode(payload, decoded);
    ASSERT_EQ(decoded, trajectory.values());
    gpu_decoder.decode(d_payload.get(), stats.payload_bytes, d_out.get(), nullptr);
    ASSERT_NO_THROW(gpu_decoder.check());
    ASSERT_EQ(d_out.host(bytes), trajectory.values());
    const auto cache = gpu_decoder.cached_values();
    ASSERT_TRUE(std::equal(cache.begin(), cache.end(), reinterpret_cast<const uint8_t*>(trajectory.values().data())));
  }
}

TEST(CudaEncoder, ValueDeltaFramesAreTheCpuEncodersAndDecodeOnBoth) {
  SKIP_WITHOUT_DEVICE();
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (const size_t n : {size_t{0}, size_t{1}, size_t{2}, size_t{3}, size_t{4}, size_t{5}, size_t{1000},
                           size_t{100003}}) {
      run_delta(dtype, n, ciera::testing::delta_schedule());
    }
  }
}

TEST(CudaEncoder, ValueDeltaOn16MValues) {
  SKIP_WITHOUT_DEVICE();
  run_delta(DType::kBF16, size_t{1} << 24,
            {DeltaStep::kUlp, DeltaStep::kSmall, DeltaStep::kNothing, DeltaStep::kRandomAll, DeltaStep::kUlp});
}

}  // namespace
}  // namespace ciera::cuda
