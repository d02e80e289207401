// The device ShardDecoder against the CPU decoder, on a device: CPU-encoded trajectories of every
// dtype, block sizes 64/512/4096 and sizes 0, 1, odd and 16M decode to the same bytes and the same
// cache; corrupted and out-of-sequence payloads are refused with FormatError and leave the cache
// as it was; value-delta streams too (the cache then the previous values). Skipped without a
// usable device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <random>
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

using ciera::testing::DeltaTrajectory;
using ciera::testing::Pattern;
using ciera::testing::Trajectory;

// Device bytes.
using Device = testing::DeviceVector<std::byte>;

void run(DType dtype, uint32_t block, size_t n, ExponentCoding coding, int steps) {
  SCOPED_TRACE(std::string(dtype_name(dtype)) + " B " + std::to_string(block) + " n " +
               std::to_string(n) + " " + std::string(exponent_coding_name(coding)));
  CodecConfig config;
  config.dtype = dtype;
  config.block_values = block;
  config.coding = coding;
  config.warmup_steps = 2;
  ciera::ShardEncoder encoder(config, n, {5, 77});
  ciera::ShardDecoder cpu(config, n, {5, 77});
  ShardDecoder gpu(config, n, {5, 77});
  Trajectory trajectory(dtype, n, Pattern::kSparse, n + block);
  const size_t bytes = n * dtype_info(dtype).value_bytes;
  std::vector<std::byte> payload(encoder.max_payload_bytes()), cpu_out(bytes);
  Device d_payload(payload.size()), d_out(bytes);
  std::mt19937_64 rng(n);
  size_t size = 0;
  for (int step = 0; step < steps; ++step) {
    if (step > 0) trajectory.step();
    size = encoder.encode(trajectory.span(), payload).payload_bytes;
    cpu.decode(std::span(payload.data(), size), cpu_out);
    if (size > 0 && step % 2 == 1) {  // a corrupted copy first: refused, cache unchanged
      const auto cache_before = gpu.cached_exponents();
      std::vector<std::byte> bad(payload.begin(), payload.begin() + static_cast<std::ptrdiff_t>(size));
      bad[rng() % size] ^= std::byte{0x10};
      d_payload.put(bad.data(), size);
      gpu.decode(d_payload.get(), size, d_out.get(), nullptr);
      EXPECT_THROW(gpu.check(), FormatError) << "step " << step;
      EXPECT_EQ(gpu.cached_exponents(), cache_before) << "step " << step;
    }
    d_payload.put(payload.data(), size);
    gpu.decode(d_payload.get(), size, d_out.get(), nullptr);
    ASSERT_NO_THROW(gpu.check()) << "step " << step;
    ASSERT_EQ(d_out.host(bytes), cpu_out) << "step " << step;
    const auto cache = gpu.cached_exponents();
    ASSERT_TRUE(std::equal(cache.begin(), cache.end(), cpu.cached_exponents().begin())) << "step " << step;
  }
  // A replay of the last frame is out of sequence; a truncated one is refused too.
  const auto cache = gpu.cached_exponents();
  gpu.decode(d_payload.get(), size, d_out.get(), nullptr);
  EXPECT_THROW(gpu.check(), FormatError);
  gpu.decode(d_payload.get(), size / 2, d_out.get(), nullptr);
  EXPECT_THROW(gpu.check(), FormatError);
  EXPECT_EQ(gpu.cached_exponents(), cache);
}

TEST(CudaDecoder, DecodesCpuPayloadsBitForBitForEveryDtypeBlockAndSize) {
  SKIP_WITHOUT_DEVICE();
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (const uint32_t block : {64u, 512u, 4096u}) {
      for (const size_t n : {size_t{0}, size_t{1}, size_t{12345}}) {
        for (const ExponentCoding coding : {ExponentCoding::kAuto, ExponentCoding::kBlock, ExponentCoding::kFine}) {
          run(dtype, block, n, coding, 6);
        }
      }
    }
  }
}

TEST(CudaDecoder, DecodesA16MValueShard) {
  SKIP_WITHOUT_DEVICE();
  run(DType::kBF16, 512, size_t{1} << 24, ExponentCoding::kAuto, 4);
}

// Value-delta streams: CPU-encoded frames decode on the device to the CPU decoder's bytes; a
// corrupted copy of every frame is refused, with the device cache (the previous values)
// unchanged; a replay and a truncation are refused too.
void run_delta(DType dtype, size_t n) {
  SCOPED_TRACE(std::string(dtype_name(dtype)) + " value-delta n " + std::to_string(n));
  CodecConfig config;
  config.dtype = dtype;
  config.stream_kind = StreamKind::kValueDelta;
  ciera::ShardEncoder encoder(config, n, {5, 77});
  ciera::ShardDecoder cpu(config, n, {5, 77});
  ShardDecoder gpu(config, n, {5, 77});
  EXPECT_TRUE(gpu.cached_exponents().empty());
  DeltaTrajectory trajectory(dtype, n, n + 3);
  const size_t bytes = n * dtype_info(dtype).value_bytes;
  std::vector<std::byte> payload(encoder.max_payload_bytes()), cpu_out(bytes);
  Device d_payload(payload.size()), d_out(bytes);
  std::mt19937_64 rng(n);
  size_t size = 0;
  const auto steps = ciera::testing::delta_schedule();
  for (size_t step = 0; step <= steps.size(); ++step) {
    if (step > 0) trajectory.step(steps[step - 1]);
    size = encoder.encode(trajectory.span(), payload).payload_bytes;
    cpu.decode(std::span(payload.data(), size), cpu_out);
    if (step > 0) {  // a corrupted copy first (past the header): refused, cache unchanged
      const auto cache_before = gpu.cached_values();
      std::vector<std::byte> bad(payload.begin(), payload.begin() + static_cast<std::ptrdiff_t>(size));
      bad[size > 80 ? 80 + rng() % (size - 80) : rng() % size] ^= std::byte{0x10};
      d_payload.put(bad.data(), size);
      gpu.decode(d_payload.get(), size, d_out.get(), nullptr);
      EXPECT_THROW(gpu.check(), FormatError) << "step " << step;
      EXPECT_EQ(gpu.cached_values(), cache_before) << "step " << step;
    }
    d_payload.put(payload.data(), size);
    gpu.decode(d_payload.get(), size, d_out.get(), nullptr);
    ASSERT_NO_THROW(gpu.check()) << "step " << step;
    ASSERT_EQ(d_out.host(bytes), cpu_out) << "step " << step;
    const auto cache = gpu.cached_values();
    ASSERT_TRUE(std::equal(cache.begin(), cache.end(), reinterpret_cast<const uint8_t*>(cpu_out.data())))
        << "step " << step;
  }
  const auto cache = gpu.cached_values();
  gpu.decode(d_payload.get(), size, d_out.get(), nullptr);
  EXPECT_THROW(gpu.check(), FormatError);
  gpu.decode(d_payload.get(), size / 2, d_out.get(), nullptr);
  EXPECT_THROW(gpu.check(), FormatError);
  EXPECT_EQ(gpu.cached_values(), cache);
}

TEST(CudaDecoder, DecodesCpuValueDeltaStreams) {
  SKIP_WITHOUT_DEVICE();
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (const size_t n : {size_t{1}, size_t{2}, size_t{3}, size_t{5}, size_t{1000}, size_t{100003}}) {
      run_delta(dtype, n);
    }
  }
}

}  // namespace
}  // namespace ciera::cuda
